"""HF's ``auto_find_batch_size`` on 2 ranks (ZeRO-2, under torchrun): only rank 1's model runs
out of memory at 8 rows per forward; both ranks agree to start over, at 4, and finish with the losses
and grad norms of a run started at 4. One launch of tests/helpers/auto_batch_scenario.py."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import launch

pytestmark = pytest.mark.distributed


def test_an_out_of_memory_error_on_one_rank_starts_every_rank_over(tmp_path):
    # Ranks that disagree hang in a collective: the timeout (the launch takes ~50 s here) fails the test.
    proc = launch(
        ["tests/helpers/auto_batch_scenario.py", str(tmp_path), "two_ranks"], launcher="torchrun", timeout=300
    )
    runs = {
        name: [json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in (0, 1)]
        for name in ("auto", "direct")
    }
    lines = [line for line in proc.stdout.splitlines() if "auto_find_batch_size:" in line]
    assert len(lines) == 1, proc.stdout[-4000:]  # rank 0 says it once, for the job
    assert "out of memory at per_device_train_batch_size 8 (in the forward on 1 of 2 ranks)" in lines[0]
    assert "from step 0 at per_device_train_batch_size 4 " in lines[0]
    direct = runs["direct"][0]
    for auto in runs["auto"]:
        assert (auto["micro_batch"], auto["ds_micro_batch"], auto["ds_accumulation"]) == (4, 4, 2)
        assert auto["steps"] == [1, 2, 3]
        assert auto["losses"] == direct["losses"]
        assert auto["grad_norms"] == direct["grad_norms"]
