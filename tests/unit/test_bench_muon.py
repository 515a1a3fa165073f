"""scripts/bench_muon.py without training: the eval curve and time to target read from metrics rows
shaped as a run writes them, the summary and its table, the schedule, the variants, the commands
and the flags."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from trainer.bench.muon import (
    ROOT,
    Run,
    Variant,
    command,
    eval_points,
    launch_env,
    schedule,
    summarise,
    table,
    time_to_target,
    variants,
)


def _script():
    spec = importlib.util.spec_from_file_location("bench_muon", ROOT / "scripts" / "bench_muon.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(evals: list[tuple[int, float, float]], every: int = 20) -> list[dict]:
    """metrics.jsonl rows as a run of ours writes them: a training row at each logging step (the
    training seconds so far), an eval row after it at each evaluated step, the train() summary last."""
    rows = []
    by_step = {step: (loss, seconds) for step, loss, seconds in evals}
    last = max(by_step)
    for step in range(every, last + 1, every):
        seconds = by_step.get(step, (None, step * 0.1))[1]
        rows.append({"step": step, "epoch": step / 3258, "loss": 7.0 - step / 100, "learning_rate": 1e-3,
                     "grad_norm": 0.9, "step_time_s": 0.2, "tokens_per_second": 5000.0,
                     "total_tokens": step * 1024.0, "train_time_s": seconds})  # fmt: skip
        if step in by_step:
            rows.append(
                {"step": step, "eval_loss": by_step[step][0], "eval_runtime": 1.04, "epoch": step / 3258}
            )
    rows.append({"step": last, "train_runtime": 99.0, "train_loss": 6.9, "epoch": last / 3258})
    return rows


BASELINE = [(20, 6.68, 4.5), (40, 6.52, 9.1), (60, 6.40, 13.9)]


def test_eval_points_pair_each_evaluation_with_the_training_time_logged_at_its_step():
    rows = _rows([(20, 6.677, 4.57), (40, 6.525, 9.08)], every=10)
    assert eval_points(rows) == [(20, 6.677, 4.57), (40, 6.525, 9.08)]  # not the eval's or the run's runtime


def test_a_step_evaluated_without_a_logged_training_time_is_refused():
    rows = [r for r in _rows(BASELINE) if not (r["step"] == 40 and "train_time_s" in r)]
    with pytest.raises(ValueError, match="step 40 was evaluated but no training time"):
        eval_points(rows)


def test_time_to_target_is_the_first_evaluation_at_or_below_it():
    points = [(20, 6.7, 4.0), (40, 6.4, 8.0), (60, 6.5, 12.0), (80, 6.3, 16.0)]
    assert time_to_target(points, 6.4) == (40, 8.0)  # equal counts; a later rise does not matter
    assert time_to_target(points, 6.35) == (80, 16.0)
    assert time_to_target(points, 6.0) is None
    # A tolerance: a loss that much of the target above it counts (rounding between two systems).
    assert time_to_target(points, 6.69, tolerance=2e-3) == (20, 4.0)
    assert time_to_target(points, 6.69, tolerance=1e-4) == (40, 8.0)


def test_a_tolerance_lets_a_run_equal_to_rounding_reach_the_target():
    twin = _rows([(20, 6.68, 4.4), (40, 6.52, 9.0), (60, 6.400001, 14.0)])
    runs = {"adamw": Run(0, 20.0, _rows(BASELINE)), "hf_trainer": Run(0, 21.0, twin)}
    assert summarise(runs)["hf_trainer"]["reached"] is False
    s = summarise(runs, tolerance=1e-6)
    assert s["hf_trainer"]["ratio"] == pytest.approx(14.0 / 13.9) and s["adamw"]["step_to_target"] == 60
    assert "target: the adamw run's final eval loss, 6.4000 (reached at or below 6.4000)" in table(s)


def test_summary_ratios_against_the_baseline_and_a_variant_that_never_gets_there(tmp_path):
    log = tmp_path / "muon.log"
    log.write_text("loading\nerror: optim: unknown optimizer muon\n\n")
    runs = {
        "adamw": Run(0, 20.0, _rows(BASELINE)),
        "adamw_lr0.005": Run(0, 15.0, _rows([(20, 6.85, 3.0), (40, 6.39, 6.0), (60, 6.30, 9.0)])),
        "hf_trainer": Run(0, 30.0, _rows([(20, 6.69, 5.0), (40, 6.53, 10.0), (60, 6.42, 15.0)])),
        "muon_lr0.02": Run(2, 1.5, [], str(log)),
    }
    s = summarise(runs)
    base, fast, hf, muon = (s[k] for k in runs)
    assert base["target_eval_loss"] == 6.40 and base["step_to_target"] == 60 and base["ratio"] == 1.0
    assert (fast["step_to_target"], fast["train_s_to_target"]) == (40, 6.0)
    assert fast["ratio"] == pytest.approx(6.0 / 13.9) and fast["train_s"] == 9.0
    assert fast["final_eval_loss"] == 6.30 and fast["perplexity"] == pytest.approx(math.exp(6.30))
    assert hf["reached"] is False and hf["ratio"] is None and hf["step_to_target"] is None
    assert muon["error"] == "exit 2: error: optim: unknown optimizer muon" and "ratio" not in muon
    text = table(s)
    assert "6.4000" in text and "| adamw_lr0.005 | 6.3000 |" in text and "| 0.43 |" in text
    assert "| hf_trainer | 6.4200 | 614.00 | not reached |  | 15.0 | 30 |  |" in text
    assert "| muon_lr0.02 | failed: exit 2: error: optim: unknown optimizer muon |" in text


def test_the_target_is_the_baselines_final_loss_even_where_an_earlier_evaluation_was_lower():
    runs = {
        "adamw": Run(0, 20.0, _rows([(20, 6.60, 4.0), (40, 6.38, 8.0), (60, 6.40, 12.0)])),
        "muon_lr0.02": Run(0, 25.0, _rows([(20, 6.39, 5.0), (40, 6.2, 10.0), (60, 6.1, 15.0)])),
    }
    s = summarise(runs)
    assert s["adamw"]["target_eval_loss"] == 6.40
    assert (s["adamw"]["step_to_target"], s["adamw"]["ratio"]) == (
        40,
        1.0,
    )  # the baseline's own first time there
    assert s["muon_lr0.02"]["ratio"] == pytest.approx(5.0 / 8.0)
    s["muon_lr0.02"].update(final_step=40, final_eval_loss=6.2)  # its step-60 evaluation was not finite
    assert "| muon_lr0.02 | 6.2000 (step 40) |" in table(s) and "| adamw | 6.4000 |" in table(s)


def test_without_a_finished_baseline_there_is_no_target(tmp_path):
    runs = {"adamw": Run(1, 3.0, _rows(BASELINE[:1]), str(tmp_path / "none.log")),
            "adamw_lr0.005": Run(0, 15.0, _rows(BASELINE))}  # fmt: skip
    with pytest.raises(RuntimeError, match="baseline adamw did not finish"):
        summarise(runs)


def test_the_schedule_scales_with_max_steps_and_logs_every_evaluated_step():
    assert schedule(600) == schedule(600, 50)
    assert (schedule(600).eval_steps, schedule(600).logging_steps) == (50, 10)
    assert (schedule(60).eval_steps, schedule(60, 20).logging_steps) == (5, 20)
    assert (schedule(8).eval_steps, schedule(8, 3).logging_steps) == (1, 1)
    for max_steps, every in ((600, 50), (60, 20), (70, 20), (100, 30), (7, 7)):
        plan = schedule(max_steps, every)
        assert plan.eval_steps % plan.logging_steps == 0 and plan.max_steps % plan.logging_steps == 0
    with pytest.raises(ValueError, match="eval_steps"):
        schedule(60, 61)


def test_variants_and_their_commands():
    runs = variants([2e-3], [0.02], 3e-3, "update_scale=match_rms_adamw")
    assert [v.name for v in runs] == ["adamw", "adamw_lr0.002", "muon_lr0.02", "hf_trainer"]
    adamw = ("--optim", "adamw_torch")  # the default job's optimizer before Muon
    assert runs[0].flags == adamw and runs[1].flags == (*adamw, "--learning_rate", "0.002")
    assert runs[2].flags == ("--optim", "muon", "--optim_args",
                             "muon_lr=0.02,adam_lr=0.003,update_scale=match_rms_adamw")  # fmt: skip
    plan = schedule(60, 20)
    ours = command(runs[1], Path("/o/adamw_lr0.002"), plan)
    assert ours[1:] == [str(ROOT / "scripts" / "train.py"), "--output_dir", "/o/adamw_lr0.002",
                        "--max_steps", "60", "--eval_steps", "20", "--logging_steps", "20",
                        "--optim", "adamw_torch", "--learning_rate", "0.002"]  # fmt: skip
    hf = command(runs[3], Path("/o/hf_trainer"), plan)
    assert hf[1:5] == ["-m", "trainer.bench.muon", "hf_trainer", "--output_dir"] and hf[-2:] == [
        "--logging_steps",
        "20",
    ]
    with pytest.raises(ValueError, match="share a name"):
        variants([2e-3, 0.002], [], 3e-3)
    assert [v.name for v in variants([], [], 3e-3, hf_trainer=False)] == ["adamw"]


def test_the_runs_environment_is_make_demos(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    env = launch_env(2, gpu=False)
    assert env["OMP_NUM_THREADS"] == "2" and env["DS_ACCELERATOR"] == "cpu" and "RANK" not in env
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert launch_env(16, gpu=True)["CUDA_VISIBLE_DEVICES"] == "2"


def test_the_scripts_flags():
    bench = _script()
    args = bench.parse_args([])
    assert [v.name for v in args.variants] == ["adamw", "adamw_lr0.002", "adamw_lr0.005", "muon_lr0.01",
                                               "muon_lr0.02", "muon_lr0.04", "hf_trainer"]  # fmt: skip
    assert (args.plan.max_steps, args.plan.eval_steps, args.plan.logging_steps) == (600, 50, 10)
    quick = bench.parse_args(
        ["--max_steps", "60", "--muon_lrs", "", "--adamw_lrs", "5e-3", "--no-hf_trainer"]
    )
    assert [v.name for v in quick.variants] == ["adamw", "adamw_lr0.005"] and quick.plan.eval_steps == 5
    assert isinstance(quick.variants[0], Variant)


@pytest.mark.parametrize(
    "argv", [["--max_steps", "0"], ["--adamw_lrs", "-1"], ["--max_steps", "10", "--eval_steps", "11"],
             ["--adamw_lrs", "3e-3,3e-3"], ["--threads", "0"]],
)  # fmt: skip
def test_bad_flags_exit_2_before_anything_runs(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        _script().parse_args(argv)
    assert stop.value.code == 2 and "error:" in capsys.readouterr().err


def test_hf_trainers_batches_of_packed_rows_carry_no_attention_mask():
    """As our objective forwards packed rows: without the mask the model builds the block-diagonal
    mask from position_ids (with it, HF's Trainer saw other losses than ours: 7.5528 against 7.5510
    after 4 steps)."""
    from types import SimpleNamespace

    from trainer.bench.muon import PackedCollator

    collate = PackedCollator(SimpleNamespace(pad_token_id=1, eos_token_id=2))
    packed = collate([{"input_ids": [5, 6, 2, 7], "position_ids": [0, 1, 2, 0]}] * 2)
    assert sorted(packed) == ["input_ids", "labels", "position_ids"]
    assert packed["labels"].tolist() == packed["input_ids"].tolist() == [[5, 6, 2, 7]] * 2
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0]] * 2
    rows = collate([{"input_ids": [5, 6, 2]}, {"input_ids": [5]}])
    assert rows["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
