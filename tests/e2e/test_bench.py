"""scripts/bench.py: the five systems on one tiny job (2 CPU ranks each; ours_tp one group of two
with AutoTP), and how figures are derived.

Timings are never asserted: only the contract (systems, keys, ratios) and that our Trainer did the
same work as the raw DeepSpeed loop (bit-equal final loss on the same seed and data).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.helpers.launch import ROOT, launch
from trainer.bench.job import SYSTEMS, Job
from trainer.bench.report import summarise, verdicts

KEYS = ("step_time_median_s", "tokens_per_second", "peak_memory_bytes", "final_loss")
TINY = ["--device", "cpu", "--model", "tiny", "--steps", "4", "--warmup", "1", "--chunk", "1",
        "--data", "random", "--vocab_size", "256", "--seq_len", "32", "--micro_batch", "2"]  # fmt: skip
# Every system in one run: ours at ZeRO-2 is the baseline of the peers and of ours_tp alike.
ALL = ["--systems", ",".join(SYSTEMS), "--zero_stage", "2", "--tensor_parallel_size", "2"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = launch(
        ["scripts/bench.py", *TINY, *ALL, "--out", str(out / "work"), "--json", str(out / "bench.json")],
        launcher="python",
    )
    return json.loads((out / "bench.json").read_text()), proc, out / "work"


@pytest.mark.distributed
def test_json_holds_the_five_systems_with_the_contract_keys(bench):
    data, _, _ = bench
    assert list(data) == list(SYSTEMS) == ["ours", "deepspeed", "hf_trainer", "accelerate", "ours_tp"]
    for system, entry in data.items():
        for key in KEYS:
            assert isinstance(entry[key], (int, float)) and math.isfinite(entry[key]), (system, key)
        assert entry["step_time_median_s"] > 0 and entry["peak_memory_bytes"] > 0
        # 4 steps, 1 warm-up: 3 measured; 2 ranks x micro-batch 2 x 32 tokens per step.
        assert entry["steps_measured"] == 3
        assert entry["tokens_per_second"] == pytest.approx(128 / entry["step_time_median_s"])
        # ours_tp: one tensor-parallel group of the two ranks, each reading both micro-batches.
        assert entry["dp_world_size"] == (1 if system == "ours_tp" else 2)
        assert len(entry["peak_memory_bytes_per_rank"]) == 2


@pytest.mark.distributed
def test_ours_tp_does_ours_work_with_each_layer_split(bench):
    data, _, work = bench
    assert data["ours_tp"]["final_loss"] == pytest.approx(data["ours"]["final_loss"], rel=1e-5)
    assert (work / "ours_tp").is_dir() and json.loads((work / "job.json").read_text())["tensor_parallel"] == 2


@pytest.mark.distributed
def test_ours_final_loss_equals_the_raw_deepspeed_loop(bench):
    data, proc, _ = bench
    assert data["ours"]["final_loss"] == data["deepspeed"]["final_loss"]
    loss = data["ours"]["final_loss"]
    assert f"same work: final loss ours {loss:.6f}, raw loop {loss:.6f} (equal)" in proc.stdout
    # Accelerate reads the same blocks in the same order; it averages per micro-batch instead of
    # summing over the window, which agrees up to rounding because no block has padding.
    assert data["accelerate"]["final_loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.distributed
def test_ratios_are_each_system_over_ours(bench):
    data, _, _ = bench
    for entry in data.values():
        for key in KEYS:
            assert entry["ratio_to_ours"][key] == pytest.approx(entry[key] / data["ours"][key])
    assert all(v == 1.0 for v in data["ours"]["ratio_to_ours"].values())


@pytest.mark.distributed
def test_work_dir_records_the_job_and_the_one_deepspeed_config(bench):
    _, proc, work = bench
    job = json.loads((work / "job.json").read_text())
    assert (job["world_size"], job["steps"], job["zero_stage"], job["precision"]) == (2, 4, 2, "fp32")
    ds_config = json.loads((work / "ds_config.json").read_text())
    assert ds_config["train_batch_size"] == 4 and ds_config["zero_optimization"]["stage"] == 2
    assert "auto" not in json.dumps(ds_config)
    assert "overhead vs the raw DeepSpeed loop" in proc.stdout
    for system in SYSTEMS:
        assert (work / "logs" / f"{system}.log").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--systems", "ours,foo"], "--systems: unknown ['foo']"),
        (["--steps", "3", "--warmup", "5"], "--steps (3) must exceed --warmup (5)"),
        (["--micro_batch", "0"], "argument --micro_batch: must be at least 1, got 0"),
        (["--systems", "ours,ours_tp"], "--systems ours_tp: give --tensor_parallel_size N (N > 1)"),
        (
            ["--tensor_parallel_size", "2", "--nproc", "3"],
            "--tensor_parallel_size 2 does not divide --nproc 3",
        ),
    ],
)
def test_bad_arguments_exit_before_anything_starts(args, message):
    proc = subprocess.run(
        [sys.executable, "scripts/bench.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert message in proc.stderr


# ---------------------------------------------------------------- figures from step times


def _job(**kw) -> Job:
    base = dict(
        device="cpu", model="tiny", vocab_size=256, seq_len=32, micro_batch=2, grad_accum=1, steps=6, warmup=2,
        chunk=1, zero_stage=2, precision="fp32", gradient_checkpointing=False, seed=42, learning_rate=1e-3,
        lr_warmup_steps=3, data_path="", world_size=2, out_dir="",
    )  # fmt: skip
    return Job(**{**base, **kw})


def _rank(times, cpu=None, loss=1.0, memory=100, profiled=()):
    return {
        "times": times,
        "cpu_times": cpu or [t / 2 for t in times],
        "final_loss": loss,
        "peak_memory_bytes": memory,
        "profiled": list(profiled),
        "dp_world_size": 2,
        "notes": [],
    }


def test_summary_takes_the_slowest_rank_and_skips_warmup_and_profiled_steps():
    job = _job()
    results = {
        # Step 1-2 are warm-up; step 4 was profiled on ours (slow, and left out).
        "ours": [
            _rank([9, 9, 1.0, 5.0, 1.2, 1.1], memory=100, profiled=[4]),
            _rank([9, 9, 1.1, 1.0, 1.0, 1.3], memory=120),
        ],
        "deepspeed": [
            _rank([9, 9, 2.0, 2.0, 2.0, 2.0], memory=90),
            _rank([9, 9, 2.0, 2.0, 2.0, 2.4], memory=80),
        ],
    }
    summary = summarise(job, results)
    ours, raw = summary["ours"], summary["deepspeed"]
    # ours per step (max over ranks) without steps 1, 2 and 4: [1.1, 1.2, 1.3]
    assert ours["step_time_median_s"] == 1.2 and ours["steps_measured"] == 3
    assert ours["tokens_per_second"] == pytest.approx(128 / 1.2)
    assert ours["peak_memory_bytes"] == 120 and ours["peak_memory_bytes_per_rank"] == [100, 120]
    assert raw["step_time_median_s"] == 2.0 and raw["steps_measured"] == 4
    assert raw["ratio_to_ours"]["step_time_median_s"] == pytest.approx(2.0 / 1.2)
    assert raw["ratio_to_ours"]["peak_memory_bytes"] == pytest.approx(90 / 120)
    # Paired over the steps both measured (3, 5, 6): 2/1.1, 2/1.2, 2.4/1.3 -> median 2/1.1.
    assert raw["ratio_to_ours"]["step_time_paired"] == pytest.approx(2.0 / 1.1)
    assert "steps 4-4 were profiled" in ours["notes"][0]
    lines = verdicts(summary)
    assert lines[0].startswith("overhead vs the raw DeepSpeed loop: -40.0% step time")
    assert lines[1] == "same work: final loss ours 1.000000, raw loop 1.000000 (equal)"


def test_summary_reports_mfu_on_gpus_against_the_table_peak():
    job = _job(device="cuda", precision="bf16", world_size=1, warmup=0, steps=2, micro_batch=4, seq_len=2048)
    rank = _rank([0.5, 0.5]) | {"flops_per_token": 1e10, "device_name": "NVIDIA H200"}
    entry = summarise(job, {"ours": [rank]})["ours"]
    # 8192 tokens / 0.5 s x 1e10 FLOPs = 163.84 TFLOP/s on one GPU; H200 bf16 dense peak 989.
    assert entry["model_tflops_per_gpu"] == pytest.approx(163.84)
    assert entry["mfu"] == pytest.approx(163.84 / 989)
    assert "cpu_time_median_s" not in entry


# ---------------------------------------------------------------- launching, and the loop without the model


def test_each_rank_is_the_worker_module_under_the_deepspeed_launcher():
    from trainer.bench.launch import worker_command

    cmd = worker_command("ours", _job(), ROOT / "job.json", "127.0.0.1:1234")
    assert cmd[1:3] == ["-m", "deepspeed.launcher.runner"]
    at = cmd.index("--module")
    assert cmd[at + 1 :] == ["trainer.bench.worker", "--system", "ours", "--job", str(ROOT / "job.json"),
                             "--gate", "127.0.0.1:1234"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.bench.worker", "--help"], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and "--system" in proc.stdout


def test_count_only_engine_leaves_out_the_model_and_forwards_everything_else():
    import torch

    from trainer.bench.loop_overhead import CountOnlyEngine

    class FakeEngine:
        device = torch.device("cpu")
        lr_scale = 1.0

        def local_targets(self, window):
            return float(sum(len(b["labels"]) for b in window))

        def train_window(self, window, window_tokens):
            raise AssertionError("the model must not run")

    engine = FakeEngine()
    wrapped = CountOnlyEngine(engine)
    loss = wrapped.train_window([{"labels": [1, 2, 3]}], 3.0)
    assert loss.item() == 0.0 and loss.device == engine.device
    wrapped.lr_scale = 0.5  # writes reach the engine the Trainer reads back
    assert engine.lr_scale == 0.5 and wrapped.lr_scale == 0.5
    assert wrapped.local_targets([{"labels": [1]}]) == 1.0
