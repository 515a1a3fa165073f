"""scripts/bench_data.py scaled down (40 files of the standard library twice over, 2 ranks): the
report holds every figure, and each resume gave the block the uninterrupted stream reads next.
Timings are reported, never asserted."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import launch

pytestmark = pytest.mark.distributed


def test_the_report_holds_every_figure_and_resumes_were_exact(tmp_path):
    report = tmp_path / "report.json"
    launch(
        ["scripts/bench_data.py", "--scale", "2", "--max_files", "40", "--resume_steps", "1,6",
         "--global_batch", "8", "--block_size", "64", "--nproc", "2", "--lanes", "8", "--train_steps", "4", "--json",
         str(report)],
        launcher="python", timeout=900,
    )  # fmt: skip
    r = json.loads(report.read_text())
    assert r["corpus"]["scale"] == 2 and r["corpus"]["files"] == 16 and r["corpus"]["bytes"] > 0
    assert set(r["first_step_s"]) == {"map_style", "streamed"} and min(r["first_step_s"].values()) > 0
    assert sorted(r["resume_s"], key=int) == ["1", "6"]
    for cost in r["resume_s"].values():
        assert cost["ours_same_block"] is True
        assert min(cost["ours_s"], cost["reread_s"], cost["hf_trainer_s"], cost["datasets_state_dict_s"]) > 0
    assert r["loader_tokens_per_second_per_rank"] > 0 and r["model_tokens_per_second_per_rank"] > 0
