"""scripts/bench_muon.py scaled down (8 steps, evaluated every 4, the tests' tiny model through
``--job_flags``): the baseline, Muon and HF's Trainer each train the default job through their own
process; the report holds each curve, the baseline is its own target, and HF's Trainer trained the
same job (the same eval losses to rounding). Timings are reported, never asserted, so the runs share
the cores with the other worker's tests rather than waiting in the ``distributed`` group's queue."""

from __future__ import annotations

import json
import shlex

import pytest

from tests.helpers.launch import launch
from tests.helpers.scaffold import TINY_MODEL

JOB = ["--model_config_overrides", json.dumps(TINY_MODEL), "--block_size", "64", "--max_eval_samples", "16"]


def test_three_variants_train_the_default_job_and_are_timed_to_the_baselines_loss(tmp_path):
    report = tmp_path / "report.json"
    proc = launch(
        ["scripts/bench_muon.py", "--max_steps", "8", "--eval_steps", "4", "--adamw_lrs", "",
         "--muon_lrs", "0.02", "--tolerance", "1e-5", "--job_flags", shlex.join(JOB), "--out", str(tmp_path / "runs"), "--json", str(report)],
        launcher="python", timeout=600,
    )  # fmt: skip
    r = json.loads(report.read_text())
    assert list(r) == ["adamw", "muon_lr0.02", "hf_trainer"]
    for name, e in r.items():
        assert e["returncode"] == 0 and "error" not in e, (name, e)
        assert [p[0] for p in e["curve"]] == [4, 8] and e["final_eval_loss"] == e["curve"][-1][1]
        assert 0 < e["curve"][0][2] < e["curve"][1][2] == e["train_s"] < e["wall_s"]
    base, muon, hf = r["adamw"], r["muon_lr0.02"], r["hf_trainer"]
    assert base["target_eval_loss"] == base["final_eval_loss"] and base["ratio"] == 1.0
    assert base["curve"][1][1] < base["curve"][0][1] < 8.3  # it learned (a uniform guess: ln 4096 = 8.3)
    assert muon["command"][-10:] == [*JOB, "--optim", "muon", "--optim_args", "muon_lr=0.02,adam_lr=0.003"]
    assert muon["curve"][0][1] != pytest.approx(base["curve"][0][1], rel=1e-3)  # another optimizer ran
    # The same model, weights, blocks, order and schedule: HF's eval losses are ours to rounding.
    assert [p[1] for p in hf["curve"]] == pytest.approx([p[1] for p in base["curve"]], rel=1e-5)
    assert hf["step_to_target"] == 8 and hf["ratio"] > 0  # reached, within the rounding --tolerance allows
    assert "| hf_trainer |" in proc.stdout and "time to target / adamw" in proc.stdout
