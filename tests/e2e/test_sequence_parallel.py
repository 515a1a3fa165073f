"""Ulysses sequence parallelism through the user's command, on 2048-token blocks.

One process trains two steps; two ranks under the deepspeed launcher with
``--sequence_parallel_size 2`` (ZeRO-3) train the same two steps, each rank holding half of every
row; a third run resumes the SP run's checkpoint-1 with the tiled loss, tiled MLPs, activation
offload and activation checkpointing on, and a fourth resumes it on one process. No warmup: the
first step already moves the weights, so the second step's loss and grad norm and the evaluation
check the update. The runs are shared by the tests below; each one-process run goes beside a launch
of two ranks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from tests.helpers.launch import BIN, free_port, launch, together
from tests.helpers.scaffold import assert_same_weights, read_metrics, tiny_flags, train_rows

pytestmark = pytest.mark.distributed

MODEL = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2}  # fmt: skip
COMMON = [
    "scripts/train.py",
    *tiny_flags(max_steps=2, save_steps=1, eval_steps=2, max_train_samples=8, max_eval_samples=2, block_size=2048,
                vocab_size=8192, zero_stage=3, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                warmup_ratio=0, model_config_overrides=MODEL),
]  # fmt: skip
TILED = ["--tiled_loss", "true", "--tile_tokens", "512", "--tiled_mlp", "--offload_activations",
         "--gradient_checkpointing"]  # fmt: skip


def _curves(out: Path) -> dict[tuple[int, str], float]:
    """Each logged step's loss and grad norm, and the evaluation's loss, keyed by (step, name)."""
    names = ("loss", "grad_norm", "eval_loss")
    return {(r["step"], k): r[k] for r in read_metrics(out) for k in names if k in r}


def assert_same_curves(got: dict, want: dict) -> None:
    """The same steps; losses and grad norms as fp32 allows (the sums only run in another order).
    Clipping at 1.0 and Adam would hide a gradient off by a constant factor from the losses, never
    from its norm."""
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key


def _peak(out: Path, cmd: list[str], nproc: int) -> int:
    """Run under the peak-RSS wrapper; the largest process's peak in bytes."""
    report = out.parent / f"{out.name}.rss.json"
    wrapped = ["-m", "trainer.bench.peak_rss", "--report", str(report), "--"]
    start = [str(BIN / "python")] if nproc == 1 else [str(BIN / "deepspeed"), "--num_gpus", str(nproc),
                                                       "--master_port", str(free_port())]  # fmt: skip
    launch([*wrapped, *start, *cmd], launcher="python")
    return json.loads(report.read_text())["peak_rss_bytes"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp")
    one, sp = root / "one", root / "sp"
    # Each peak is of a run's own processes: the two running at once does not change them.
    peak_one, peak_sp = together(
        lambda: _peak(one, [*COMMON, "--output_dir", str(one)], 1),
        lambda: _peak(sp, [*COMMON, "--output_dir", str(sp), "--sequence_parallel_size", "2"], 2),
    )
    peaks = {"one": peak_one, "sp": peak_sp}
    resumed = root / "resumed"
    elsewhere = root / "elsewhere"  # the same checkpoint on one process, without sequence parallelism
    for out in (resumed, elsewhere):
        out.mkdir()
        shutil.copytree(sp / "checkpoint-1", out / "checkpoint-1")
    together(
        lambda: launch([*COMMON, "--output_dir", str(resumed), "--sequence_parallel_size", "2", *TILED]),
        lambda: launch([*COMMON, "--output_dir", str(elsewhere)], launcher="python"),
    )
    return {"one": one, "sp": sp, "resumed": resumed, "elsewhere": elsewhere, "peaks": peaks}


def test_two_ranks_follow_the_one_rank_losses_and_grad_norms(runs):
    one = _curves(runs["one"])
    assert len(one) == 5  # two steps' losses and grad norms, and the evaluation
    assert_same_curves(_curves(runs["sp"]), one)


def test_a_group_of_two_counts_its_rows_once(runs):
    for a, b in zip(train_rows(runs["one"]), train_rows(runs["sp"]), strict=True):
        assert (b["epoch"], b["total_tokens"]) == (a["epoch"], a["total_tokens"]), a["step"]


def test_the_largest_rank_holds_well_below_one_process(runs):
    peaks = runs["peaks"]
    # Each rank holds half of every row's activations and logits; the rest (weights, libraries) is equal.
    assert peaks["sp"] < 0.8 * peaks["one"], peaks


def test_the_export_is_the_one_rank_model(runs):
    assert_same_weights(runs["sp"] / "final", runs["one"] / "final", rtol=0, atol=1e-4)
    model = AutoModelForCausalLM.from_pretrained(runs["sp"] / "final")
    assert model.config.num_attention_heads == MODEL["num_attention_heads"]


def test_a_resume_with_tiling_and_offload_continues_the_run(runs):
    resumed = _curves(runs["resumed"])
    assert sorted(resumed) == [(2, "eval_loss"), (2, "grad_norm"), (2, "loss")]
    sp = _curves(runs["sp"])
    assert_same_curves(resumed, {key: sp[key] for key in resumed})
    assert_same_weights(runs["resumed"] / "final", runs["sp"] / "final", rtol=0, atol=1e-4, same_keys=False)


def test_a_sequence_parallel_checkpoint_resumes_on_one_process(runs):
    resumed = _curves(runs["elsewhere"])
    assert sorted(resumed) == [(2, "eval_loss"), (2, "grad_norm"), (2, "loss")]
    sp = _curves(runs["sp"])
    assert_same_curves(resumed, {key: sp[key] for key in resumed})
    # ZeRO-3 shards over both ranks of the group: one process needs the universal form.
    assert (runs["elsewhere"] / "checkpoint-1" / "universal" / "COMPLETE").exists()


# ---- sequence parallelism with data parallelism: 4 ranks, SP=2 x DP=2 ------------------------------

BLOCK, ROWS = 256, 4  # a step's rows: one process reads 4, each of the 2 groups 2
SP_DP = [
    "scripts/train.py",
    *tiny_flags(max_steps=3, save_steps=3, eval_steps=3, max_train_samples=16, max_eval_samples=4, block_size=BLOCK,
                zero_stage=2, warmup_ratio=0, gradient_accumulation_steps=1, model_config_overrides=MODEL),
]  # fmt: skip


@pytest.fixture(scope="module")
def sp_dp(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp_dp")
    one, four = root / "one", root / "four"
    launch([*SP_DP, "--output_dir", str(one), "--per_device_train_batch_size", str(ROWS)], launcher="python")
    launch([*SP_DP, "--output_dir", str(four), "--per_device_train_batch_size", str(ROWS // 2),
            "--sequence_parallel_size", "2"], nproc=4)  # fmt: skip
    return one, four


@pytest.mark.slow
def test_two_groups_of_two_follow_one_process(sp_dp):
    one, four = sp_dp
    want = _curves(one)
    assert len(want) == 7  # three steps' losses and grad norms, and the evaluation
    # The divisor: DeepSpeed averages over the 2 data-parallel groups, not the 4 ranks.
    assert_same_curves(_curves(four), want)
    assert_same_weights(four / "final", one / "final", rtol=0, atol=1e-4)


@pytest.mark.slow
def test_a_group_is_counted_once(sp_dp):
    one, four = sp_dp
    for a, b in zip(train_rows(one), train_rows(four), strict=True):
        step = a["step"]
        assert a["epoch"] == b["epoch"] == step * ROWS / 16, step
        assert a["total_tokens"] == b["total_tokens"] == step * ROWS * BLOCK, step
        # The rate's window is one step here: its samples and tokens, each row once.
        assert b["samples_per_second"] * b["step_time_s"] == pytest.approx(ROWS), step
        assert b["tokens_per_second"] * b["step_time_s"] == pytest.approx(ROWS * BLOCK), step
    states = [json.loads((run / "checkpoint-3" / "trainer_state.json").read_text()) for run in sp_dp]
    keys = ("world_size", "steps_per_epoch", "num_input_tokens_seen", "epoch")
    assert [states[1][k] for k in keys] == [2, *(states[0][k] for k in keys[1:])]


def test_a_layout_the_model_cannot_split_is_refused_before_loading(tmp_path):
    model = json.dumps({**MODEL, "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 192})
    out = tmp_path / "bad"
    proc = launch(
        [*COMMON, "--output_dir", str(out), "--sequence_parallel_size", "4", "--model_config_overrides", model],
        launcher="python", check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr
    assert "sequence_parallel_size: 4 does not divide the model's 6 attention heads" in err
    assert "4 and the model's 3 key/value heads do not divide one another" in err
    assert "4 does not divide the 1 ranks of this run" in err
    assert not (out / "metrics.jsonl").exists()
