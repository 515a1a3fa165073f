"""``--optim muon`` through the user's command.

One process trains four steps on one batch of 16 rows, and again in four micro-batches of 4; two
ranks under torchrun train the same four steps under ZeRO 1, 2 and 3 (stage 3 builds the model
under ``zero.Init``), each rank accumulating four micro-batches of 2 rows. So every stage is checked at once against a split over
ranks and over micro-batches: a Muon that stepped on each micro-batch's gradient (DeepSpeed PR
#8600), orthogonalised its flat slices instead of whole matrices, or was left out (PR #8438) moves
the weights elsewhere. A copy of the ZeRO-2 run's checkpoint-2 is resumed by the same command, and
copies of the ZeRO-2 and ZeRO-3 runs' by one process (another number of shards, through DeepSpeed's
universal conversion, which reads Adam's moments only: Muon's momentum goes through under Adam's name).
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers.launch import launch, together
from tests.helpers.scaffold import TINY_MODEL, assert_same_weights, tiny_flags, train_rows

pytestmark = pytest.mark.distributed

MUON = ["--optim", "muon", "--optim_args", "muon_lr=0.05,adam_lr=0.003"]
# Three layers: ZeRO 1-2 then cut the Muon group's flat tensor between the ranks inside a matrix (an
# MLP weight of the second layer); with two the cut falls between the layers, and the gather that
# makes each matrix whole would go untested there.
MODEL = {**TINY_MODEL, "num_hidden_layers": 3}
COMMON = ["scripts/train.py", *tiny_flags(save_steps=2, vocab_size=4096, model_config_overrides=MODEL), *MUON]
SPLIT = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4"]
STAGES = (1, 2, 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon")
    names = ("one", "one_accumulating", *STAGES, "resumed", "bf16_0", "bf16_1", "bf16_resumed")
    out = {name: root / str(name) for name in names}
    out.update({("alone", stage): root / f"alone{stage}" for stage in (2, 3)})

    def zero(stage: int, where: str | int) -> None:
        launch([*COMMON, *SPLIT, "--output_dir", str(out[where]), "--zero_stage", str(stage)])

    def alone(stage: int) -> None:
        shutil.copytree(out[stage] / "checkpoint-2", out["alone", stage] / "checkpoint-2")
        flags = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "8"]
        launch(
            [*COMMON, *flags, "--output_dir", str(out["alone", stage]), "--zero_stage", str(stage)],
            launcher="python",
        )

    def bf16(stage: int, where: str) -> None:
        flags = ["--bf16", "true", "--max_grad_norm", "0", "--per_device_train_batch_size", "8"]
        launch(
            [*COMMON, *flags, "--zero_stage", str(stage), "--output_dir", str(out[where])], launcher="python"
        )

    def bf16_resumed() -> None:
        shutil.copytree(out["bf16_0"] / "checkpoint-2", out["bf16_resumed"] / "checkpoint-2")
        bf16(0, "bf16_resumed")

    # Each launch of two ranks with one-process runs beside it, which fill the cores the ranks leave idle.
    one = [*COMMON, "--output_dir", str(out["one"]), "--per_device_train_batch_size", "16"]
    together(lambda: launch(one, launcher="python"), lambda: zero(1, 1), lambda: bf16(0, "bf16_0"))
    accumulating = [*COMMON, *SPLIT, "--output_dir", str(out["one_accumulating"])]
    accumulating[accumulating.index("--per_device_train_batch_size") + 1] = "4"
    together(lambda: launch(accumulating, launcher="python"), lambda: zero(2, 2), lambda: bf16(1, "bf16_1"))

    together(lambda: alone(2), lambda: zero(3, 3), bf16_resumed)
    shutil.copytree(out[2] / "checkpoint-2", out["resumed"] / "checkpoint-2")
    together(lambda: alone(3), lambda: zero(2, "resumed"))
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_two_ranks_accumulating_take_one_process_steps(runs, stage):
    """Losses, grad norms and the exported weights within 1e-5 of one process's single batch."""
    one, ranks = train_rows(runs["one"]), train_rows(runs[stage])
    assert [r["step"] for r in ranks] == [1, 2, 3, 4]
    assert ranks[-1]["loss"] < ranks[0]["loss"] - 0.05  # it trained
    for a, b in zip(one, ranks, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), a["step"]
    assert_same_weights(runs[stage] / "final", runs["one"] / "final", rtol=1e-5, atol=1e-6)
    ds = json.loads((runs[stage] / "ds_config.json").read_text())
    assert ds["optimizer"] == {
        "type": "Muon",
        "params": {
            "lr": 3e-3,
            "muon_lr": 0.05,
            "adam_lr": 3e-3,
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "weight_decay": 0.1,
        },
    }
    assert ds["zero_allow_untested_optimizer"] is True


def test_one_process_accumulating_takes_the_single_batch_steps(runs):
    """ZeRO-0 on one process: four micro-batches of 4 rows step as one batch of 16, to 1e-5."""
    one, accumulating = train_rows(runs["one"]), train_rows(runs["one_accumulating"])
    assert len(accumulating) == 4
    for a, b in zip(one, accumulating, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), a["step"]
    assert_same_weights(runs["one_accumulating"] / "final", runs["one"] / "final", rtol=1e-5, atol=1e-6)


def test_a_checkpoint_resumes_bitwise(runs):
    """The momentum and AdamW's moments are in the ZeRO optimizer states: steps 3 and 4 again, bit
    for bit."""
    names = ("loss", "grad_norm")
    again = {(r["step"], k): r[k] for r in train_rows(runs["resumed"]) for k in names}
    whole = {(r["step"], k): r[k] for r in train_rows(runs[2]) for k in names if r["step"] >= 3}
    assert again == whole
    assert_same_weights(runs["resumed"] / "final", runs[2] / "final")


@pytest.mark.parametrize("stage", (2, 3))
def test_one_process_resumes_two_ranks_checkpoint(runs, stage):
    """On one process (a universal conversion of the 2-rank states), steps 3 and 4 follow the 2-rank
    run within 1e-5: a momentum lost in the conversion, or a group given another's settings (ZeRO-3's
    load copies the first group's to all), would part them."""
    alone = train_rows(runs["alone", stage])
    two = [r for r in train_rows(runs[stage]) if r["step"] >= 3]
    assert [r["step"] for r in alone] == [3, 4]
    for a, b in zip(two, alone, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), a["step"]
    assert_same_weights(runs["alone", stage] / "final", runs[stage] / "final", rtol=1e-5, atol=1e-6)


def test_bf16_at_zero0_steps_as_zero1_and_resumes_bitwise(runs):
    """In bf16 at ZeRO-0, DeepSpeed's unfused mixed-precision wrapper hands Muon an fp32 copy of
    each parameter. It would have stepped it once on zero gradients at start (DeepSpeed PR #5104),
    which Adam's half would count and weight decay would apply, and it took the gradient norm it
    clips by 2e-5 off (fp32 norms per tensor): trainer/engine/mixed_precision.py. One process: the
    losses and weights of ZeRO-1 bit for bit (the same bf16 gradients, ZeRO's fp32 slices), its grad
    norms to its fp32 rounding, and a
    resume from checkpoint-2 that repeats steps 3 and 4 bit for bit. Without clipping: a clip
    coefficient 1e-8 apart (the two norms' last fp32 digits) flips a few weights' bf16 rounding, and
    Muon's bf16 iteration takes the trajectories 1e-3 apart within two steps."""
    zero0, zero1 = train_rows(runs["bf16_0"]), train_rows(runs["bf16_1"])
    assert [r["step"] for r in zero0] == [1, 2, 3, 4]
    assert zero0[-1]["loss"] < zero0[0]["loss"] - 0.05  # it trained
    for a, b in zip(zero1, zero0, strict=True):
        assert b["loss"] == a["loss"], a["step"]
        # ZeRO-1 reports its norm in fp32 (rounding 6e-8); the two were 1e-8 apart here
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-7), a["step"]
    assert_same_weights(runs["bf16_0"] / "final", runs["bf16_1"] / "final")  # bit for bit
    again = {(r["step"], r["loss"], r["grad_norm"]) for r in train_rows(runs["bf16_resumed"])}
    assert again == {(r["step"], r["loss"], r["grad_norm"]) for r in zero0 if r["step"] >= 3}
    assert_same_weights(runs["bf16_resumed"] / "final", runs["bf16_0"] / "final")
