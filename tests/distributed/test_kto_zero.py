"""KTO on 2 ranks (torchrun, one launch of tests/helpers/kto_scenarios.py), step by step against the
one-process run of the same global micro-batches of 4 rows, and TRL's: ZeRO-3 (the reference pass
scores with the partitioned weights), ZeRO-3 with LoRA (the reference is the base with its
adapters off), and sequence parallelism (SP=2 under ZeRO-3: both ranks every row, each half of
every sequence, the NLL summed over the two)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.kto_scenarios import METRICS
from tests.helpers.launch import launch, together

pytestmark = pytest.mark.distributed
SCRIPT = "tests/helpers/kto_scenarios.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("kto_zero")
    singles = ("kto_text", "kto_lora")
    together(
        lambda: launch([SCRIPT, str(out), "kto_ranks"], launcher="torchrun", timeout=900),
        lambda: launch([SCRIPT, str(out), *singles], launcher="python", timeout=900),
    )
    return {name: json.loads((out / f"{name}.json").read_text()) for name in ("kto_ranks", *singles)}


@pytest.mark.parametrize(
    "run, one", [("zero3", "kto_text"), ("zero3_lora", "kto_lora"), ("sp2_zero3", "kto_text")]
)
def test_two_ranks_follow_one_process_and_trl(runs, run, one):
    ranks, single = runs["kto_ranks"], runs[one]
    assert ranks["world_size"] == 2
    # Under sequence parallelism no rank holds a row's whole logits: entropy and logits/* are not logged.
    whole = run != "sp2_zero3"
    keys = [k for k in METRICS if whole or not (k == "entropy" or k.startswith("logits/"))]
    for key in keys:
        # kl is a mean of differences between log-probabilities near -80, whose ulp is 7.6e-6: the
        # ranks' forwards (partitioned weights, split sequences) may round one of them apart.
        tolerance = 7.6e-6 if key == "kl" else 1e-6
        assert ranks[run][key] == pytest.approx(single["ours"][key], rel=1e-5, abs=tolerance), key
        assert ranks[run][key] == pytest.approx(single["trl"][key], rel=1e-5, abs=tolerance), key
    if not whole:
        assert set(ranks[run]["entropy"]) == {None}
    assert max(ranks[run]["kl"]) > 0.01  # the estimate, over both ranks' rows, is in play
