"""A short fault campaign through ``scripts/fault_campaign.py``: one fault of each kind on the default
job under ``torchrun --max-restarts 3`` (CPU, 2 ranks, fp32), with flash snapshots every step.
Every run must recover; all but the NaN rollback (which lowers the learning rate by design) must end
bitwise equal to the uninterrupted reference; a killed rank loses at most the step in flight."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.launch import ROOT, run_env
from tests.helpers.scaffold import tmpfs_refusal

pytestmark = pytest.mark.distributed

EQUAL_KINDS = ("kill", "sigterm", "disk", "cache")


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    """The campaign's JSON and printed output; the disk kind is left out where no tmpfs can be mounted."""
    tmp = tmp_path_factory.mktemp("campaign")
    no_tmpfs = tmpfs_refusal(tmp / "probe")
    kinds = ["kill", "sigterm", "nan", *([] if no_tmpfs else ["disk"]), "cache"]
    cmd = [sys.executable, "scripts/fault_campaign.py", "--runs", str(len(kinds)), "--kinds", ",".join(kinds),
           "--seed", "1", "--out", str(tmp / "out")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=1200)
    report = tmp / "out" / "campaign.json"
    assert report.is_file(), proc.stdout[-6000:] + proc.stderr[-6000:]
    return json.loads(report.read_text()), proc, no_tmpfs


def records_of(report, kind):
    return [r for r in report["records"] if r["kind"] == kind]


def test_every_fault_hits_and_every_run_recovers(campaign):
    report, proc, _ = campaign
    assert len(report["records"]) == len(report["kinds"]), proc.stdout[-4000:]
    for record in report["records"]:
        assert record["fault_hit"], json.dumps(record, indent=1)
        assert record["recovered"], json.dumps(record, indent=1)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "| fault | runs | fault hit | recovered |" in proc.stdout


def test_all_but_the_rollback_end_bitwise_equal_to_the_reference(campaign):
    report, _, _ = campaign
    for record in report["records"]:
        if record["kind"] in EQUAL_KINDS:
            assert record["bitwise_equal"], json.dumps(record, indent=1)


def test_a_killed_rank_with_snapshots_loses_at_most_one_step(campaign):
    report, _, _ = campaign
    assert report["snapshots"]
    (kill,) = records_of(report, "kill")
    assert kill["resumed_from"].startswith("/dev/shm/"), kill  # a flash snapshot, not a disk checkpoint
    assert 0 <= kill["steps_lost"] <= 1, kill
    assert kill["first_step_after"] == kill["resumed_step"] + 1, kill  # it goes on from the snapshot's step
    assert kill["restart_s"] is not None and kill["restart_s"] > 0, kill
    assert not kill["snapshots_left"], kill  # the finished job left nothing in /dev/shm


def test_a_preempted_job_exits_75_and_resumes_where_it_saved(campaign):
    report, _, _ = campaign
    (sigterm,) = records_of(report, "sigterm")
    assert len(sigterm["exit_codes"]) == 2 and sigterm["exit_codes"][-1] == 0, sigterm
    assert any("exiting with 75" in line for line in sigterm["stop_lines"]), sigterm
    assert sigterm["steps_lost"] == 0 and sigterm["first_step_after"] == sigterm["resumed_step"] + 1, sigterm


def test_a_nan_rolls_back_to_a_checkpoint_and_finishes(campaign):
    report, _, _ = campaign
    (nan,) = records_of(report, "nan")
    assert nan["exit_codes"] == [0], nan
    assert nan["resumed_from"].startswith("checkpoint-"), nan


def test_a_full_disk_stops_the_job_with_one_line_and_a_restart_resumes(campaign):
    report, _, no_tmpfs = campaign
    if no_tmpfs:
        pytest.skip(f"the disk kind needs a tmpfs, and none can be mounted here: {no_tmpfs}")
    (disk,) = records_of(report, "disk")
    assert disk["exit_codes"][-1] == 0 and len(disk["exit_codes"]) == 2, disk
    first, *restarts = [line for line in disk["stop_lines"] if line.startswith("error:")]
    assert "not saved: the disk is full" in first, disk
    # torchrun restarts the ranks into the same full disk: each attempt stops at the door, untrained.
    assert restarts and all(line.startswith("error: the disk is still full: ") for line in restarts), disk
    # From a flash snapshot taken before the failed save: the one of the step before it, or of the
    # step before that when its background write was not committed yet (docs/fault-tolerance.md).
    assert disk["resumed_from"].startswith("/dev/shm/"), disk
    assert disk["resumed_step"] < disk["details"]["save"] <= disk["reached_step"], disk


def test_a_damaged_tokenisation_cache_is_rebuilt(campaign):
    report, _, _ = campaign
    (cache,) = records_of(report, "cache")
    assert len(cache["cache_lines"]) == 1 and cache["exit_codes"] == [0], cache
