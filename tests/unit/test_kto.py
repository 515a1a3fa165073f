"""KTO: ``from trainer import KTOTrainer, KTOConfig`` against TRL 1.16's ``KTOTrainer``, step by step,
and the pieces it is made of (unpairing, TRL's tokenisation, the KL partners, the config's rules).

The runs happen in one child process (tests/helpers/kto_scenarios.py, plain python, one rank),
TRL's and ours on the same tiny Llama, tokenizer, rows, order and seed.
"""

from __future__ import annotations

import json

import datasets
import pytest

from tests.helpers.kto_scenarios import METRICS, completions
from tests.helpers.launch import launch
from tests.helpers.preference_scenarios import pairs, tokenizer
from trainer import KTOConfig, KTOTrainer
from trainer.loop.kto import with_kl_partners

SCRIPT = "tests/helpers/kto_scenarios.py"
# Plain SGD: every metric (kto_adamw, TRL's optimizer family: below).
PARITY = [
    "kto_text",
    "kto_conversation",
    "kto_weighted_accumulated",
    "apo_zero_unpaired",
    "kto_from_pairs",
    "kto_lora",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("kto")
    names = [*PARITY, "kto_adamw"]
    launch([SCRIPT, str(out), *names], launcher="python", timeout=1200)
    return {name: json.loads((out / f"{name}.json").read_text()) for name in names}


def assert_steps_match(run, keys):
    ours, trl = run["ours"], run["trl"]
    for key in keys:
        assert len(trl[key]) == 4, key
        assert ours[key] == pytest.approx(trl[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("name", PARITY)
def test_each_step_and_the_evaluation_match_trls_kto_trainer(results, name):
    """Loss, grad norm and TRL's KTO metrics at every one of 4 steps, and the trained model's
    evaluation of 8 other rows, within fp32's reordering of the same sums."""
    run = results[name]
    assert_steps_match(run, METRICS)
    assert run["trl"]["loss"][3] != run["trl"]["loss"][0]  # the policy moved
    keys = ["eval_loss", *(f"eval_{m}" for m in METRICS[3:])]
    assert {k: run["ours_eval"].get(k) for k in keys} == pytest.approx(
        {k: run["trl_eval"].get(k) for k in keys}, rel=1e-5, abs=1e-6
    )
    # The trained weights agree to an ulp (SGD's update rounds apart), so the evaluation's KL, a
    # mean of differences between log-probabilities near -80 (whose ulp is 7.6e-6), is compared
    # at that ulp; during training, where the weights are the same, kl is within 1e-6 above.
    assert run["ours_eval"]["eval_kl"] == pytest.approx(run["trl_eval"]["eval_kl"], rel=1e-5, abs=7.6e-6)


def test_the_kl_estimate_is_exercised(results):
    """kto: the estimate is positive at some steps (a clamp at 0 everywhere would hide it);
    apo_zero_unpaired has none."""
    assert max(results["kto_text"]["trl"]["kl"]) > 0.1
    assert set(results["apo_zero_unpaired"]["ours"]["kl"]) == {0.0}


def test_with_adamw_loss_grad_norm_and_log_probs_match(results):
    """TRL's optimizer family at lr 1e-2. Adam's first step divides each gradient by its own size,
    so gradients that agree to rounding (plain SGD's weights after step 1 agree to 2e-9) give
    weights a few 1e-5 apart where a gradient is near 0: the loss, the grad norm and the summed
    log-probs still agree within 1e-5 relative; the rewards and mean logits, small differences of
    those, were seen up to 4e-6 apart, and are compared under SGD above."""
    assert_steps_match(
        results["kto_adamw"], ["loss", "grad_norm", "kl", "entropy", "logps/chosen", "logps/rejected"]
    )


def test_a_preference_set_is_unpaired_as_trl_unpairs_it():
    args = KTOConfig(output_dir="unused", max_length=64)
    rows = KTOTrainer.pairs(pairs("implicit", 3), "train", args, tokenizer())
    assert rows["label"] == [True, True, True, False, False, False]  # the block's chosen, then its rejected
    assert rows["prompt_ids"][0] == rows["prompt_ids"][3]  # one prompt, both answers
    assert rows["chosen_ids"][0] != rows["chosen_ids"][3]


def test_text_completions_end_with_eos_and_a_full_prompt_drops_its_row():
    tok = tokenizer()
    args = KTOConfig(output_dir="unused", max_length=64)
    rows = KTOTrainer.pairs(completions(4), "train", args, tok)
    assert all(ids[-1] == tok.eos_token_id for ids in rows["chosen_ids"])
    assert rows["label"] == [True, False, True, True]
    short = KTOTrainer.pairs(completions(4), "train", KTOConfig(output_dir="unused", max_length=3), tok)
    assert len(short) == 0  # every prompt is 3 tokens or more: nothing left to learn from


def test_kl_partners_rotate_within_each_global_micro_batch():
    """Each row takes the completion of the row before it in its block (the first, the last's): on
    2 ranks of 2 rows, the block is the 4 rows one process of 4 reads in one micro-batch."""
    rows = datasets.Dataset.from_dict({"chosen_ids": [[i] for i in range(6)]})
    assert with_kl_partners(rows, 4)["rejected_ids"] == [[3], [0], [1], [2], [5], [4]]


def test_a_missing_column_is_named():
    with pytest.raises(ValueError, match="the train set has no label column"):
        KTOTrainer.pairs(datasets.Dataset.from_dict({"prompt": ["a"], "completion": ["b"]}), "train",
                         KTOConfig(output_dir="unused"), tokenizer())  # fmt: skip


def test_kto_config_takes_trls_fields_and_refuses_what_is_not_implemented():
    args = KTOConfig(
        output_dir="unused", desirable_weight=2.0, undesirable_weight=0.5, loss_type="apo_zero_unpaired"
    )
    assert (args.objective, args.train_sampling_strategy, args.learning_rate, args.logging_steps) == (
        "kto",
        "sequential",
        1e-6,
        10,
    )
    for fields, message in (
        ({"train_sampling_strategy": "random"}, "train_sampling_strategy: loss_type kto builds its KL pairs"),
        ({"per_device_train_batch_size": 1}, "per_device_train_batch_size: loss_type kto pairs each prompt"),
        ({"sync_ref_model": True}, "sync_ref_model=True: not supported"),
        ({"padding_free": True}, "padding_free=True: not supported"),
        ({"truncation_mode": "keep_end"}, "truncation_mode='keep_end': not supported"),
    ):
        with pytest.raises(ValueError, match=message):
            KTOConfig(output_dir="unused", **fields)
