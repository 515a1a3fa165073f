"""``--optim lars`` through the user's command.

One process trains four steps with the global batch in two micro-batches; two ranks under torchrun
train the same four steps under ZeRO-2 and ZeRO-3, where DeepSpeed hands LARS flat slices of many
parameters. A copy of the ZeRO-2 run's checkpoint-2 is resumed by the same command, and one of the
ZeRO-3 run's by one process. The runs are shared by the tests below; the one-process runs go beside
the 2-rank launches.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers.launch import launch, together
from tests.helpers.scaffold import assert_same_weights, tiny_flags, train_rows

pytestmark = pytest.mark.distributed

# A rate of 1 with trust 0.02: each matrix moves by about 2% of its norm a step, a real trajectory.
LARS = ["--optim", "lars", "--optim_args", "trust_coefficient=0.02,momentum=0.9", "--learning_rate", "1.0"]
COMMON = ["scripts/train.py", *tiny_flags(save_steps=2, vocab_size=4096), *LARS]
STAGES = (2, 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lars")
    out = {"one": root / "one"}
    out.update({stage: root / f"zero{stage}" for stage in STAGES})

    def zero(stage: int) -> None:
        launch([*COMMON, "--output_dir", str(out[stage]), "--zero_stage", str(stage)])

    one = [*COMMON, "--output_dir", str(out["one"]), "--gradient_accumulation_steps", "2"]
    together(lambda: launch(one, launcher="python"), lambda: zero(2))
    zero(3)
    resumed, alone = out["resumed"], out["alone"] = root / "resumed", root / "alone"
    shutil.copytree(out[2] / "checkpoint-2", resumed / "checkpoint-2")
    shutil.copytree(out[3] / "checkpoint-2", alone / "checkpoint-2")
    # One process resumes the ZeRO-3 checkpoint: its momentum crosses the universal conversion.
    single = [*COMMON, "--output_dir", str(alone), "--zero_stage", "3", "--gradient_accumulation_steps", "2"]
    together(
        lambda: launch([*COMMON, "--output_dir", str(resumed), "--zero_stage", "2"]),
        lambda: launch(single, launcher="python"),
    )
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_two_ranks_under_zero_take_one_process_steps(runs, stage):
    """Losses, grad norms and the exported weights within 1e-5: a LARS that took the norms of its
    flat slices instead of each parameter's would move them differently. The grad norms agree to
    1e-7 at step 1 (the same weights, gradients summed over ranks in another fp32 order, each norm
    summed in fp64 on both sides) and part as the trajectories do, to 9e-7 by step 4 after three
    steps at a rate of 1 (2026-12-04); 1e-6 would leave no margin. (One process's ZeRO-0 norm was
    2.8e-5 off while it summed in fp32.)"""
    one, ranks = train_rows(runs["one"]), train_rows(runs[stage])
    assert [r["step"] for r in ranks] == [1, 2, 3, 4]
    assert ranks[-1]["loss"] < ranks[0]["loss"] - 0.05  # it trained
    for a, b in zip(one, ranks, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), a["step"]
    assert_same_weights(runs[stage] / "final", runs["one"] / "final", rtol=1e-5, atol=1e-6)
    ds = json.loads((runs[stage] / "ds_config.json").read_text())
    assert "optimizer" not in ds and ds["zero_allow_untested_optimizer"] is True


def test_a_checkpoint_resumes_bitwise(runs):
    """The momentum is in the ZeRO optimizer states: steps 3 and 4 again, bit for bit."""
    names = ("loss", "grad_norm")
    again = {(r["step"], k): r[k] for r in train_rows(runs["resumed"]) for k in names}
    whole = {(r["step"], k): r[k] for r in train_rows(runs[2]) for k in names if r["step"] >= 3}
    assert again == whole
    assert_same_weights(runs["resumed"] / "final", runs[2] / "final")


def test_one_process_resumes_the_zero3_checkpoint_of_two_ranks(runs):
    """Through DeepSpeed's universal conversion (Adam's moments only: LARS's momentum goes through
    under Adam's name and takes its own back), steps 3 and 4 follow the 2-rank run within 1e-5."""
    two = [r for r in train_rows(runs[3]) if r["step"] >= 3]
    alone = train_rows(runs["alone"])
    assert [r["step"] for r in alone] == [3, 4]
    for a, b in zip(two, alone, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), a["step"]
    assert_same_weights(runs["alone"] / "final", runs[3] / "final", rtol=1e-5, atol=1e-6)
