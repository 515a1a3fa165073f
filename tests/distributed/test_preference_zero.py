"""Preference training on 2 ranks (torchrun, one launch of tests/helpers/preference_scenarios.py),
step by step against the one-process run of the same global batches, and TRL's:
- DPO under ZeRO-2, and under ZeRO-3 with two accumulated micro-batches: the reference pass scores
  each rank's share with the partitioned weights;
- ORPO under ZeRO-2 (each rank's micro-batch the pairs of one of a process's two accumulated ones);
- SimPO under ZeRO-3 with two accumulated micro-batches;
- DPO under ZeRO-3 with a tiled loss (the partitioned head gathered by each tile);
- sequence parallelism (SP=2, both ranks every pair, each half of every sequence): DPO with ZeRO-3
  and a tiled loss, ORPO padding-free (its packed sequences kept apart) with two micro-batches;
- DPO under ZeRO-3 with a ref_model unlike the policy: an engine of its own partitions it over the
  ranks while it scores the pairs (each rank holds half), against TRL's, which forwards it every step;
- SFTTrainer on packed rows under ZeRO-3 with two accumulated micro-batches (the same launch), against
  one process of tests/helpers/sft_scenarios.py and TRL's SFTTrainer."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import launch, together
from tests.helpers.preference_scenarios import EXTRA_METRICS, LOGIT_METRICS, METRICS

pytestmark = pytest.mark.distributed
SCRIPT = "tests/helpers/preference_scenarios.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("preference_zero")
    singles = ("sigmoid_text", "orpo_accumulated", "simpo", "other_reference")

    def one_process() -> None:
        launch([SCRIPT, str(out), *singles], launcher="python", timeout=900)
        launch(["tests/helpers/sft_scenarios.py", str(out), "text_packed"], launcher="python", timeout=900)

    # The one-process references beside the launch of two ranks.
    together(lambda: launch([SCRIPT, str(out), "zero_stages"], launcher="torchrun", timeout=900), one_process)
    return {
        name: json.loads((out / f"{name}.json").read_text())
        for name in ("zero_stages", *singles, "text_packed")
    }


@pytest.mark.parametrize(
    "run, one, method",
    [("zero2", "sigmoid_text", "dpo"), ("zero3_accumulated", "sigmoid_text", "dpo"),
     ("orpo_zero2", "orpo_accumulated", "orpo"), ("simpo_zero3_accumulated", "simpo", "cpo"),
     ("ref_model_zero3", "other_reference", "dpo"), ("tiled_zero3", "sigmoid_text", "dpo"),
     ("sp2_tiled_zero3", "sigmoid_text", "dpo"), ("orpo_sp2_padding_free", "orpo_accumulated", "orpo")],
)  # fmt: skip
def test_two_ranks_follow_one_process_and_trl(runs, run, one, method):
    """The metrics that read the whole logits are not logged tiled, split or padding-free, and are
    compared only where the global micro-batch is the one process's: they are token means per
    micro-batch, so micro-batches of other pairs give other means (as TRL's)."""
    ranks, single = runs["zero_stages"], runs[one]
    assert ranks["world_size"] == 2
    whole = not any(layout in run for layout in ("tiled", "sp2", "padding_free"))
    keys = [k for k in (*METRICS, *EXTRA_METRICS.get(method, ())) if whole or k not in LOGIT_METRICS]
    assert set(ranks[run]) == set(keys)
    same_micro_batches = run in ("zero2", "ref_model_zero3")
    for key in keys:
        if key in LOGIT_METRICS and not same_micro_batches:
            continue
        # DPO's step-1 margins are 0 up to rounding (test_preference.py)
        first = 1 if key == "rewards/accuracies" and method == "dpo" else 0
        assert ranks[run][key][first:] == pytest.approx(single["ours"][key][first:], rel=1e-5, abs=1e-6), key
        assert ranks[run][key][first:] == pytest.approx(single["trl"][key][first:], rel=1e-5, abs=1e-6), key


def test_sft_on_two_ranks_follows_one_process_and_trl(runs):
    """Loss and grad norm are token-exact over ranks and micro-batches. Entropy and token accuracy
    are means over micro-batches, as TRL's, so four micro-batches of one row each log other means
    than one of four rows: they are only checked to be there. TRL's num_tokens counts every rank's."""
    ranks, single = runs["zero_stages"]["sft_packed_zero3_accumulated"], runs["text_packed"]
    assert set(ranks) == {"loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens"}
    for key in ("loss", "grad_norm", "num_tokens"):
        assert ranks[key] == pytest.approx(single["ours"][key], rel=1e-5, abs=1e-6), key
        assert ranks[key] == pytest.approx(single["trl"][key], rel=1e-5, abs=1e-6), key


def test_sequence_parallel_ranks_forward_half_of_each_sequence(runs):
    """The SP=2 run's training forwards on a rank are at most 12 tokens wide: half of the batches'
    padded widths of 20-24."""
    widths = runs["zero_stages"]["sp_widths"]
    assert len(widths) == 4 and all(w <= 12 for w in widths), widths


def test_a_ref_model_is_partitioned_under_zero3(runs):
    """Each of 2 ranks held its half of the reference's weights (rounded up per tensor), never the
    whole: the reference costs a second model's memory divided over the ranks, as the planner says."""
    assert 0.45 < runs["zero_stages"]["ref_model_share"] < 0.56
