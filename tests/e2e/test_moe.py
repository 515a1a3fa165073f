"""A mixture of experts through the user's command: ``deepspeed --num_gpus 2 scripts/train.py
--model_type mixtral --zero_stage 3`` (and 2), with the router's load-balancing loss on at
``--router_aux_loss_coef``.

Two ranks, each accumulating 2 micro-batches of 2 rows, against one process on one batch of 8 over
4 steps: the losses, router losses and grad norms, and the exported weights, within 1e-5. A copy of
the ZeRO-3 run's checkpoint-2 is resumed by the same command, bit for bit. ``final/`` holds every
expert, and ``from_pretrained`` loads it as a Mixtral.
"""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoModelForCausalLM

from tests.helpers.launch import launch, together
from tests.helpers.scaffold import TINY_MODEL, assert_same_weights, tiny_flags, train_rows

pytestmark = pytest.mark.distributed

EXPERTS = {**TINY_MODEL, "num_local_experts": 4}
COMMON = [
    "scripts/train.py", *tiny_flags(save_steps=2, model_config_overrides=EXPERTS),
    "--model_type", "mixtral", "--router_aux_loss_coef", "0.1", "--optim", "adamw_torch",
]  # fmt: skip
SPLIT = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
STAGES = (2, 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    out = {name: root / str(name) for name in ("one", *STAGES, "resumed")}

    def zero(stage: int, where: str | int) -> None:
        flags = [*SPLIT, "--output_dir", str(out[where]), "--zero_stage", str(stage)]
        launch([*COMMON, *flags], launcher="deepspeed")

    def resumed() -> None:
        shutil.copytree(out[3] / "checkpoint-2", out["resumed"] / "checkpoint-2")
        zero(3, "resumed")

    one = [*COMMON, "--output_dir", str(out["one"]), "--per_device_train_batch_size", "8"]
    together(lambda: launch(one, launcher="python"), lambda: zero(3, 3))
    together(lambda: zero(2, 2), resumed)
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_two_ranks_accumulating_take_one_process_steps(runs, stage):
    one, ranks = train_rows(runs["one"]), train_rows(runs[stage])
    assert [r["step"] for r in ranks] == [1, 2, 3, 4]
    assert ranks[-1]["loss"] < ranks[0]["loss"] - 0.05  # it trained
    for a, b in zip(one, ranks, strict=True):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a["step"])
        assert sorted(k for k in b if k.startswith("expert_imbalance/")) == ["expert_imbalance/0", "expert_imbalance/1"]
        assert all(1.0 <= b[f"expert_imbalance/{layer}"] <= 2.0 for layer in (0, 1))  # 4 experts, top-2
    assert_same_weights(runs[stage] / "final", runs["one"] / "final", rtol=1e-5, atol=1e-6)


def test_the_router_loss_is_on_and_weighted(runs):
    """4 experts, top-2: 2 when balanced, more when not; 0.1 of it is in the loss."""
    assert all(1.95 < row["aux_loss"] < 2.5 for row in train_rows(runs["one"]))


def test_a_checkpoint_resumes_bitwise(runs):
    names = ("loss", "aux_loss", "grad_norm")
    again = {(r["step"], k): r[k] for r in train_rows(runs["resumed"]) for k in names}
    whole = {(r["step"], k): r[k] for r in train_rows(runs[3]) for k in names if r["step"] >= 3}
    assert again == whole
    assert_same_weights(runs["resumed"] / "final", runs[3] / "final")


def test_the_export_is_a_mixtral_with_every_expert(runs):
    model = AutoModelForCausalLM.from_pretrained(runs[3] / "final")
    assert type(model).__name__ == "MixtralForCausalLM"
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[0] == 4 and experts.gate_up_proj.abs().sum() > 0
