"""A mixture of experts through the user's command: ``deepspeed --num_gpus 2 scripts/train.py
--model_type mixtral --expert_parallel_size 2 --zero_stage 3`` (the others under the same launcher
unless said), with the router's load-balancing loss on at ``--router_aux_loss_coef``, at ZeRO-3 and
with ``--expert_parallel_size 2`` (AutoEP: each rank holds half of every layer's experts) at ZeRO 1,
2 (its optimizer offloaded to the CPU) and 3.

Two ranks, each accumulating 2 micro-batches of 2 rows, against one process on one batch of 8 over
4 steps: the losses, router losses and grad norms, and the exported weights, within 1e-5. The
expert-parallel ZeRO-3 run again under torchrun's elastic agent, with rank 1 killed (SIGKILL) after
step 3: the agent restarts both ranks, they resume from checkpoint-2 and end bit for bit where the
uninterrupted run ended. A copy of that checkpoint is refused, naming both sizes, by a run without
expert parallelism. ``final/`` holds every expert in HF's layout, and ``from_pretrained`` loads it
as a Mixtral.

DeepSeek-V3's shape (``--model_type deepseek_v3``: a dense first layer, then routed experts chosen
within groups with the router's score correction bias, beside a shared expert) on 2 ranks with
expert parallelism at ZeRO-3 against one process: the same steps, and an export that keeps the
shared expert and the correction bias under HF's names.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.launch import launch, run_env, together
from tests.helpers.scaffold import TINY_MODEL, assert_same_weights, tiny_flags, train_rows

pytestmark = pytest.mark.distributed

EXPERTS = {**TINY_MODEL, "num_local_experts": 4}
COMMON = [
    "scripts/train.py", *tiny_flags(save_steps=2, model_config_overrides=EXPERTS),
    "--model_type", "mixtral", "--router_aux_loss_coef", "0.1", "--optim", "adamw_torch",
]  # fmt: skip
SPLIT = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
RUNS = ("zero3", "ep_zero1", "ep_zero2_offload", "ep_zero3")
DEEPSEEK = [
    "scripts/train.py", *tiny_flags(save_steps=4, model_config_overrides={
        **TINY_MODEL, "num_hidden_layers": 3, "moe_intermediate_size": 32, "kv_lora_rank": 16,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    }), "--model_type", "deepseek_v3", "--optim", "adamw_torch",
]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    out = {name: root / name for name in ("one", *RUNS, "resumed", "refused", "deepseek_one", "deepseek_ep")}

    def two_ranks(where: str) -> None:
        stage = next((c for c in where if c.isdigit()), "3")  # "resumed": the ZeRO-3 run's
        expert = ["--expert_parallel_size", "2"] if where.startswith("ep") or where == "resumed" else []
        offload = ["--offload_optimizer", "cpu"] if where.endswith("offload") else []
        flags = [*SPLIT, *expert, *offload, "--output_dir", str(out[where]), "--zero_stage", stage]
        if where == "resumed":  # killed after step 3, restarted by the agent
            out["resumed_proc"] = launch(
                [*COMMON, *flags], restarts=1, env=run_env(TRAINER_FAULT="crash:rank=1:step=3")
            )
        else:
            launch([*COMMON, *flags], launcher="deepspeed")

    def refused() -> None:
        shutil.copytree(out["ep_zero3"] / "checkpoint-2", out["refused"] / "checkpoint-2")
        flags = [
            "--per_device_train_batch_size",
            "8",
            "--zero_stage",
            "3",
            "--output_dir",
            str(out["refused"]),
        ]
        out["refused_proc"] = launch([*COMMON, *flags], launcher="python", check=False)

    one = [*COMMON, "--output_dir", str(out["one"]), "--per_device_train_batch_size", "8"]
    together(lambda: launch(one, launcher="python"), lambda: two_ranks("zero3"))
    two_ranks("ep_zero3")
    together(lambda: two_ranks("resumed"), refused)
    two_ranks("ep_zero1")
    deepseek_one = [*DEEPSEEK, "--per_device_train_batch_size", "8", "--output_dir", str(out["deepseek_one"])]
    deepseek_ep = [*DEEPSEEK, *SPLIT, "--zero_stage", "3", "--expert_parallel_size", "2",
                   "--output_dir", str(out["deepseek_ep"])]  # fmt: skip
    together(lambda: launch(deepseek_one, launcher="python"), lambda: two_ranks("ep_zero2_offload"))
    launch(deepseek_ep, launcher="deepspeed")
    return out


@pytest.mark.parametrize("run", RUNS)
def test_two_ranks_accumulating_take_one_process_steps(runs, run):
    one, ranks = train_rows(runs["one"]), train_rows(runs[run])
    assert [r["step"] for r in ranks] == [1, 2, 3, 4]
    assert ranks[-1]["loss"] < ranks[0]["loss"] - 0.05  # it trained
    for a, b in zip(one, ranks, strict=True):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a["step"])
        assert sorted(k for k in b if k.startswith("expert_imbalance/")) == [
            "expert_imbalance/0",
            "expert_imbalance/1",
        ]
        assert all(1.0 <= b[f"expert_imbalance/{layer}"] <= 2.0 for layer in (0, 1))  # 4 experts, top-2
    assert_same_weights(runs[run] / "final", runs["one"] / "final", rtol=1e-5, atol=1e-6)


def test_the_router_loss_is_on_and_weighted(runs):
    """4 experts, top-2: 2 when balanced, more when not."""
    assert all(1.95 < row["aux_loss"] < 2.5 for row in train_rows(runs["one"]))


def test_expert_parallel_ranks_held_half_of_the_experts_each(runs):
    """Each rank's share of the expert states: the checkpoint's expert files, one per expert."""
    files = sorted(
        p.name for p in (runs["ep_zero2_offload"] / "checkpoint-4" / "ds").rglob("layer_*_expert_*")
    )
    assert len(files) == 2 * 4, files  # 2 layers x 4 experts, written by the ranks that hold them


def test_a_killed_expert_parallel_run_restarts_and_resumes_bitwise(runs):
    resumed = f"Resumed from {runs['resumed'] / 'checkpoint-2'} at step 2."
    assert resumed in runs["resumed_proc"].stdout  # the agent restarted the killed ranks
    rows = train_rows(runs["resumed"])
    # The first attempt's rows (step 3's unless the kill came before it was logged), then 3-4 again.
    assert [r["step"] for r in rows] in ([1, 2, 3, 3, 4], [1, 2, 3, 4]), rows
    names = ("loss", "aux_loss", "grad_norm")
    whole = {r["step"]: {k: r[k] for k in names} for r in train_rows(runs["ep_zero3"])}
    assert [{k: r[k] for k in names} for r in rows] == [whole[r["step"]] for r in rows]
    assert_same_weights(runs["resumed"] / "final", runs["ep_zero3"] / "final")


def test_another_expert_parallel_size_is_refused_naming_both(runs):
    proc = runs["refused_proc"]
    assert proc.returncode != 0
    assert "was saved with expert_parallel_size 2 and this run asks for 1" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_the_export_is_a_mixtral_with_every_expert(runs):
    ep = AutoModelForCausalLM.from_pretrained(runs["ep_zero3"] / "final")
    one = AutoModelForCausalLM.from_pretrained(runs["one"] / "final")
    assert type(ep).__name__ == "MixtralForCausalLM"
    experts = ep.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 2 * 128, 64) and experts.down_proj.shape == (4, 64, 128)
    ids = torch.arange(1, 17)[None]
    assert torch.allclose(ep(ids).logits, one(ids).logits, rtol=1e-5, atol=5e-6)  # 9e-7 apart here


def test_deepseek_v3_with_expert_parallelism_takes_one_process_steps_and_exports_whole(runs):
    """The routed experts split over the 2 ranks; the shared expert, the router and its correction
    bias stay whole on each. Losses and grad norms within 1e-5 of one process (1.2e-7 apart here),
    and the export loads as a DeepSeek-V3 whose logits are one process's."""
    one, ranks = train_rows(runs["deepseek_one"]), train_rows(runs["deepseek_ep"])
    ds_config = json.loads((runs["deepseek_ep"] / "ds_config.json").read_text())
    assert ds_config["expert_parallel"] == {"autoep_size": 2, "enabled": True}
    assert [r["step"] for r in ranks] == [1, 2, 3, 4]
    assert ranks[-1]["loss"] < ranks[0]["loss"] - 0.05  # it trained
    for a, b in zip(one, ranks, strict=True):
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a["step"])
    assert_same_weights(runs["deepseek_ep"] / "final", runs["deepseek_one"] / "final", rtol=1e-5, atol=1e-6)
    ep = AutoModelForCausalLM.from_pretrained(runs["deepseek_ep"] / "final")
    one_model = AutoModelForCausalLM.from_pretrained(runs["deepseek_one"] / "final")
    assert type(ep).__name__ == "DeepseekV3ForCausalLM"
    block = ep.model.layers[1].mlp  # layer 0 is dense
    assert block.experts.gate_up_proj.shape[0] == 8 and block.shared_experts.down_proj.weight.shape == (
        64,
        32,
    )
    assert block.gate.e_score_correction_bias.shape == (8,)
    ids = torch.arange(1, 17)[None]
    assert torch.allclose(ep(ids).logits, one_model(ids).logits, rtol=1e-5, atol=5e-6)
