"""AutoTP tensor parallelism through the user's command.

One process trains four steps (a checkpoint at step 2) at the recipe's ZeRO-0, as a user would run it.
Two ranks under torchrun with ``--tensor_parallel_size 2`` train the same four steps under ZeRO 1, 2
and 3: one TP group, each rank holding half of every projection and reading the same rows (at ZeRO-2
with the same global batch in two micro-batches a step, the tiled loss and activation checkpointing).
A group of two at ZeRO-1 and one process beside it also train the default job's model (width 256,
tied embeddings), where one process's grad norm was once 8e-5 off (fp32 sums over the 4096 x 256
embedding's gradient; 3e-5 on the tiny model). The ZeRO-2 run killed after step 3 is started again
by the same command; the ZeRO-1 run's checkpoint-2 resumes on one process. The runs are shared by
the tests below; each one-process run goes beside a launch of two ranks.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.e2e.test_sequence_parallel import _curves, assert_same_curves
from tests.helpers.launch import launch, run_env, together
from tests.helpers.scaffold import assert_same_weights, load_weights, tiny_flags, train_rows
from trainer.model.modeling import DEFAULT_LLAMA

pytestmark = pytest.mark.distributed

# AdamW, which tensor parallelism runs (the recipe's Muon gives way to it there), on every run alike.
ADAMW = ["--optim", "adamw_torch"]
COMMON = ["scripts/train.py", *tiny_flags(save_steps=2, vocab_size=4096), *ADAMW]
# The default job's model (no --model_config_overrides), with the tiny run's steps and blocks; no checkpoint.
DEFAULT_MODEL = [
    "scripts/train.py",
    *tiny_flags(vocab_size=4096, model_config_overrides=None, save_strategy="no"),
    *ADAMW,
]
TP = ["--tensor_parallel_size", "2"]
STAGES = (1, 2, 3)
COMPOSED = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--tiled_loss", "true",
            "--tile_tokens", "16", "--gradient_checkpointing", "true"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    out = {"one": root / "one", **{stage: root / f"tp_zero{stage}" for stage in STAGES}}
    out.update({"default": root / "default", "tp_default": root / "tp_default"})

    def tensor_parallel(stage: int) -> None:
        """The group of two at ``stage``; at ZeRO-2 the same global batch in two micro-batches, tiled, recomputed."""
        flags = ["--zero_stage", str(stage), *TP, *(COMPOSED if stage == 2 else [])]
        launch([*COMMON, "--output_dir", str(out[stage]), *flags])

    def killed_and_started_again() -> None:
        killed = out["killed"] = root / "killed"
        cmd = [*COMMON, "--output_dir", str(killed), "--zero_stage", "2", *TP, *COMPOSED]
        first = launch(cmd, check=False, env=run_env(TRAINER_FAULT="crash:rank=1:step=3"))
        out["killed_rc"] = first.returncode
        out["killed_steps"] = [row["step"] for row in train_rows(killed)]
        launch(cmd)

    def elsewhere() -> None:  # the ZeRO-1 run's checkpoint-2 on one process
        out["elsewhere"] = root / "elsewhere"
        out["elsewhere"].mkdir()
        shutil.copytree(out[1] / "checkpoint-2", out["elsewhere"] / "checkpoint-2")
        launch([*COMMON, "--output_dir", str(out["elsewhere"]), "--zero_stage", "1"], launcher="python")

    one = [*COMMON, "--output_dir", str(out["one"])]
    default = [*DEFAULT_MODEL, "--output_dir", str(out["default"])]
    tp_default = [*DEFAULT_MODEL, "--output_dir", str(out["tp_default"]), "--zero_stage", "1", *TP]
    together(lambda: launch(one, launcher="python"), lambda: tensor_parallel(1))
    together(elsewhere, lambda: tensor_parallel(2))
    together(lambda: launch(default, launcher="python"), lambda: tensor_parallel(3))
    launch(tp_default)
    killed_and_started_again()
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_a_group_of_two_follows_one_process(runs, stage):
    """Losses and grad norms to 1e-5 of one process at the recipe's ZeRO-0, whose norm is taken
    apart from ZeRO's (``trainer.engine.core.clip_grad_norm``)."""
    one = _curves(runs["one"])
    assert len(one) == 9  # four steps' losses and grad norms, and the evaluation
    assert_same_curves(_curves(runs[stage]), one)
    for a, b in zip(train_rows(runs["one"]), train_rows(runs[stage]), strict=True):
        assert (b["epoch"], b["total_tokens"]) == (a["epoch"], a["total_tokens"]), a["step"]


@pytest.mark.parametrize("stage", STAGES)
def test_the_export_gathers_the_whole_model(runs, stage):
    got, want = load_weights(runs[stage] / "final"), load_weights(runs["one"] / "final")
    assert_same_weights(got, want, rtol=1e-5, atol=1e-6, what=f"zero {stage}")
    assert got["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)  # whole, not a (32, 64) slice


def test_the_default_model_in_a_group_of_two_follows_one_process(runs):
    """The default job's model, both runs at their own ZeRO stage: losses and grad norms to 1e-5
    at every step (one process's fp32 norm read 8e-5 to 1.8e-4 below here). The weights are left
    to the tiny model's runs: AutoTP sums each split matmul in another order, and over three Adam
    steps at the recipe's rate of 3e-3 a few of these 4.2M weights then move up to 8e-6 apart."""
    config = json.loads((runs["tp_default"] / "final" / "config.json").read_text())
    assert {key: config[key] for key in DEFAULT_LLAMA} == DEFAULT_LLAMA
    one = _curves(runs["default"])
    assert len(one) == 9
    assert_same_curves(_curves(runs["tp_default"]), one)


@pytest.mark.parametrize("stage", STAGES)
def test_each_rank_holds_half_of_every_projection(runs, stage):
    """The checkpoint's two model-state files are the two slices: q_proj is (32, 64) in each."""
    ds = runs[stage] / "checkpoint-2" / "ds"
    if stage == 3:
        names = sorted(p.name for p in ds.glob("zero_pp_rank_0_mp_rank_0*_model_states.pt"))
        assert names == [
            "zero_pp_rank_0_mp_rank_00_model_states.pt",
            "zero_pp_rank_0_mp_rank_01_model_states.pt",
        ]
        return
    shapes = []
    for rank in (0, 1):
        module = torch.load(ds / f"mp_rank_0{rank}_model_states.pt", weights_only=False)["module"]
        shapes.append(tuple(module["model.layers.0.self_attn.q_proj.weight"].shape))
    assert shapes == [(32, 64), (32, 64)]


def test_the_manifest_records_the_layout(runs):
    manifest = json.loads((runs[2] / "checkpoint-2" / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["tensor_parallel_size"], manifest["data_parallel_size"]) == (
        2,
        2,
        1,
    )


def test_a_killed_run_started_again_resumes_bitwise(runs):
    """Rank 1 is killed after step 3; the same command resumes checkpoint-2 and trains steps 3 and 4
    again: the same losses, grad norms and final weights as the run never killed, bit for bit."""
    assert runs["killed_rc"] != 0 and runs["killed_steps"][:2] == [1, 2] and max(runs["killed_steps"]) <= 3
    names = ("loss", "grad_norm")
    again = {(r["step"], k): r[k] for r in train_rows(runs["killed"])[-2:] for k in names}
    whole = {(r["step"], k): r[k] for r in train_rows(runs[2]) for k in names if r["step"] >= 3}
    assert again == whole
    assert_same_weights(runs["killed"] / "final", runs[2] / "final")


def test_a_tensor_parallel_checkpoint_resumes_on_one_process(runs):
    resumed = _curves(runs["elsewhere"])
    assert sorted(resumed) == [(3, "grad_norm"), (3, "loss"), (4, "eval_loss"), (4, "grad_norm"), (4, "loss")]
    assert_same_curves(resumed, {key: value for key, value in _curves(runs[1]).items() if key in resumed})
    assert (runs["elsewhere"] / "checkpoint-2" / "universal" / "COMPLETE").exists()
    assert_same_weights(runs["elsewhere"] / "final", runs[1] / "final", rtol=1e-5, atol=1e-6)


def test_trainer_export_of_a_tensor_parallel_checkpoint_is_the_final_model(runs, tmp_path):
    """Offline, from the checkpoint's slices alone: the universal conversion joins them."""
    launch(
        ["-m", "trainer.cli.main", "export", str(runs[1] / "checkpoint-4"), str(tmp_path)], launcher="python"
    )
    assert_same_weights(tmp_path, runs[1] / "final", rtol=0, atol=1e-7)


def test_a_zero3_tensor_parallel_checkpoint_the_conversion_cannot_join_is_refused_by_name(runs, tmp_path):
    checkpoint = runs[3] / "checkpoint-4"
    proc = launch(
        ["-m", "trainer.cli.main", "export", str(checkpoint), str(tmp_path)], launcher="python", check=False
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert (
        f"{checkpoint}: ZeRO-3 with tensor_parallel_size 2: DeepSpeed's universal conversion" in proc.stderr
    )


@pytest.mark.slow
def test_two_groups_of_two_on_four_ranks_follow_one_process(tmp_path):
    """TP = 2 x DP = 2: each group reads its own rows, 8 a micro-batch; one process reads all 16."""
    one, four = tmp_path / "one", tmp_path / "four"
    launch([*COMMON, "--output_dir", str(one), "--per_device_train_batch_size", "16"], launcher="python")
    launch([*COMMON, "--output_dir", str(four), "--zero_stage", "2", *TP], nproc=4, launcher="deepspeed")
    assert_same_curves(_curves(four), _curves(one))
    for a, b in zip(train_rows(one), train_rows(four), strict=True):
        assert (b["epoch"], b["total_tokens"]) == (a["epoch"], a["total_tokens"]), a["step"]
    assert_same_weights(four / "final", one / "final", rtol=1e-5, atol=1e-6)
