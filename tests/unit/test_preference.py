"""Preference training: ``from trainer import DPOTrainer, ORPOTrainer, CPOTrainer`` (and their configs)
against TRL's trainers of the same names, step by step, and the pieces they are made of (TRL's
tokenisation rules, the pair collator, the arguments' refusals).

The runs happen in one child process (tests/helpers/preference_scenarios.py, plain python, one
rank), TRL's and ours on the same tiny Llama, tokenizer, pairs, order and seed.
"""

from __future__ import annotations

import json

import datasets
import pytest
import torch

from tests.helpers.launch import launch
from tests.helpers.preference_scenarios import EXTRA_METRICS, LOGIT_METRICS, METRICS, tokenizer
from trainer.data.preference import PreferenceCollator, split_prompt, tokenize_pair, tokenize_preferences
from trainer.engine.objectives import batch_rows

SCRIPT = "tests/helpers/preference_scenarios.py"
PARITY = ["sigmoid_text", "sigmoid_implicit", "sigmoid_conversation", "ipo", "hinge", "robust", "lora_adapters_off",
          "ref_model"]  # fmt: skip
# Reference-free: TRL's experimental ORPOTrainer and CPOTrainer (loss_type simpo: SimPO)
FREE = {"orpo": "orpo", "orpo_accumulated": "orpo", "cpo": "cpo", "simpo": "cpo", "cpo_ipo": "cpo", "orpo_bos": "orpo",
        "cpo_bos": "cpo"}  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("preference")
    names = [*PARITY, *FREE, "reference_cache", "resume", "reference_resume", "layouts"]
    launch([SCRIPT, str(out), *names], launcher="python", timeout=1200)
    return {name: json.loads((out / f"{name}.json").read_text()) for name in names}


@pytest.mark.parametrize("name", PARITY)
def test_each_step_matches_trls_dpo_trainer(results, name):
    """Loss, grad norm and TRL's reward metrics at every one of 4 steps (4 pairs each, padded),
    within fp32's reordering of the same sums."""
    ours, trl = results[name]["ours"], results[name]["trl"]
    keys = (*METRICS, *EXTRA_METRICS["dpo"])
    assert set(trl) == set(keys) and set(ours) == set(keys)
    for key in keys:
        assert len(trl[key]) == 4, key
        # At step 1 the policy is the reference: each margin is 0 up to rounding, which differs
        # between TRL's reference forward (the training batch) and ours (the pass's batches), so
        # whether a margin is above 0 there is rounding's call. Its size is checked below.
        first = 1 if key == "rewards/accuracies" else 0
        assert ours[key][first:] == pytest.approx(trl[key][first:], rel=1e-5, abs=1e-6), key
    assert trl["loss"][1] != trl["loss"][0]  # the first step moved the policy away from the reference
    assert_same_evaluation(results[name], keys[2:])


def assert_same_evaluation(run, metrics):
    """The trained model's evaluation of 8 other pairs: eval_loss and the metrics, as TRL's names them."""
    keys = ["eval_loss", *(f"eval_{m}" for m in metrics)]
    assert {k: run["ours_eval"].get(k) for k in keys} == pytest.approx(
        {k: run["trl_eval"][k] for k in keys}, rel=1e-5, abs=1e-6
    )


@pytest.mark.parametrize("name", FREE)
def test_each_step_matches_trls_reference_free_trainer(results, name):
    """ORPO, CPO and SimPO: loss, grad norm, the reward metrics and the method's own metrics at every
    one of 4 steps. orpo_accumulated: two micro-batches of 2 pairs a step (the NLL term is each
    micro-batch's token mean, as TRL's)."""
    ours, trl = results[name]["ours"], results[name]["trl"]
    keys = {*METRICS, *EXTRA_METRICS[FREE[name]]}
    assert set(trl) == keys and set(ours) == keys
    for key in keys:
        assert len(trl[key]) == 4, key
        assert ours[key] == pytest.approx(trl[key], rel=1e-5, abs=1e-6), key
    assert trl["loss"][3] < trl["loss"][0]
    assert_same_evaluation(results[name], [*METRICS[2:], *EXTRA_METRICS[FREE[name]]])


def test_a_lora_reference_is_fingerprinted_by_its_base_alone(results):
    assert results["lora_adapters_off"]["same_digest"]


def test_a_given_ref_model_scores_both_sets_and_is_let_go(results):
    """A ref_model unlike the policy: the train and eval sets' cached log-probs are its own (the
    eval set was once scored by the policy, after the ref_model had been let go)."""
    assert results["ref_model"]["ref_model_kept"] is False
    gaps = results["ref_model"]["other_ref_gaps"]
    assert set(gaps) == {"train", "eval"} and max(gaps.values()) < 1e-4, gaps


@pytest.mark.parametrize("layout", ["tiled", "padding_free"])
@pytest.mark.parametrize("method, padded", [("dpo", "sigmoid_text"), ("orpo", "orpo")])
def test_tiled_and_padding_free_pairs_train_the_same_steps(results, method, padded, layout):
    """Every step's loss, grad norm and metrics are those of the padded, untiled run:
    - tiled, 7 tokens a tile: the head ran per tile, since a micro-batch's 4 pairs x 2 sequences of
      21-23 targets make over 20 tiles, each called in forward and again in backward, at each of 4
      steps (untiled: once a forward);
    - padding-free: a micro-batch's 8 sequences in one row, each attending to itself alone."""
    run, whole = results["layouts"][f"{method}_{layout}"], results[padded]["ours"]
    for key in whole:
        if key in LOGIT_METRICS:  # no rank holds the whole logits there
            assert key not in run, key
            continue
        assert run[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key
    if layout == "tiled":
        assert len(run["head_calls"]) > 4 * 2 * 20
    else:
        assert run["rows"] == [1] * 4  # each step's forward: one row


def test_the_policy_at_the_reference_has_loss_ln2_and_no_reward(results):
    run = results["reference_cache"]
    assert abs(run["first_loss"] - run["ln2"]) < 1e-6
    assert run["first_rewards"] == pytest.approx([0.0, 0.0, 0.0], abs=1e-6)


def test_a_rerun_reads_the_cached_reference_and_a_stale_one_is_refused(results):
    run = results["reference_cache"]
    assert not run["rescored"]  # the second run read the file the first one wrote
    assert run["refusal"].startswith(
        run["cache_file"] + ": the reference log-probabilities there were computed"
    )
    # A set passed to evaluate() is no stale train set: it is scored and cached under its fingerprint.
    assert run["other_set_loss"] == pytest.approx(run["ln2"], abs=1e-6)  # the policy is the reference
    names = run["reference_files"]
    assert len(names) == 3 and names[1].startswith("set-")
    assert (names[0], names[2]) == ("eval.safetensors", "train.safetensors")


def test_the_eval_set_is_scored_before_the_first_step_and_a_late_set_is_refused(results):
    """Evaluated after a step of lr 1e-2, the eval set's loss is no longer ln 2: its reference was
    scored with the initial weights (scored with the trained ones, it would read ln 2 again). A new
    set after training has no reference left to score it with."""
    run = results["reference_cache"]
    assert abs(run["eval_after_a_step"] - run["ln2"]) > 1e-3
    assert run["late_set_refusal"].startswith("the set-")
    assert "reference (the policy) is gone once training starts" in run["late_set_refusal"]


def test_a_resumed_run_scores_the_initial_policy_and_ends_bitwise_equal(results):
    """The resumed run has no cache: its reference pass runs before the checkpoint is loaded, so
    it scores the initial weights. Had it scored step 2's, steps 3-4 would differ."""
    run = results["resume"]
    assert len(run["whole"]["loss"]) == 4 and len(run["resumed"]["loss"]) == 2
    for key in METRICS:
        assert run["resumed"][key] == run["whole"][key][2:], key
    assert run["same_weights"]


# ---- tokenisation: TRL's rules -----------------------------------------------------------------


def test_an_implicit_prompt_is_the_shared_start_and_the_answers_keep_their_space():
    assert split_prompt({"chosen": "Q? It is blue.", "rejected": "Q? It is red."}) == (
        "Q? It is",
        " blue.",
        " red.",
    )
    chat = [{"role": "user", "content": "Q?"}]
    row = {
        "chosen": chat + [{"role": "assistant", "content": "A"}],
        "rejected": chat + [{"role": "assistant", "content": "B"}],
    }
    assert split_prompt(row) == (chat, [row["chosen"][1]], [row["rejected"][1]])
    # A text prompt beside conversations is not theirs: the prompt is taken from the answers.
    assert split_prompt({**row, "prompt": "Q?"})[0] == chat


def test_text_answers_end_with_eos_and_start_where_the_ids_part():
    tok = tokenizer()
    ids = tokenize_pair(
        {"prompt": "What colour is the sky?", "chosen": " It is blue.", "rejected": " red."}, tok
    )
    assert ids["prompt_ids"] + ids["chosen_ids"] == tok("What colour is the sky? It is blue.")[
        "input_ids"
    ] + [tok.eos_token_id]
    assert ids["rejected_ids"][-1] == tok.eos_token_id
    twice = tokenize_pair({"prompt": "Q", "chosen": "A" + tok.eos_token, "rejected": "B"}, tok)
    assert twice["chosen_ids"].count(tok.eos_token_id) == 1  # an EOS already there is not added again


def test_a_bad_row_is_named_by_its_index():
    rows = datasets.Dataset.from_list(
        [{"prompt": "Q", "chosen": "A", "rejected": "B"}, {"prompt": "Q", "chosen": "A", "rejected": None}]
    )
    with pytest.raises(ValueError, match=r"the train set's row 1: rejected is missing"):
        tokenize_preferences(rows, tokenizer(), None, "keep_start", "train")
    with pytest.raises(ValueError, match=r"the train set has no chosen column"):
        tokenize_preferences(rows.remove_columns("chosen"), tokenizer(), None, "keep_start", "train")


def test_a_prompt_that_fills_max_length_drops_its_pair(caplog):
    tok = tokenizer()
    rows = datasets.Dataset.from_list(
        [
            {"prompt": "What colour is the sky?", "chosen": " blue", "rejected": " red"},
            {"prompt": "Q", "chosen": " A", "rejected": " B"},
        ]
    )
    prompt = len(tok("What colour is the sky?")["input_ids"])
    assert len(tokenize_preferences(rows, tok, prompt, "keep_start", "train")) == 1
    dropped = f"the train set: 1 of 2 pairs dropped: the prompt alone fills max_length={prompt}, leaving no answer token"
    assert [r.getMessage() for r in caplog.records] == [dropped]
    caplog.clear()
    assert len(tokenize_preferences(rows, tok, prompt + 1, "keep_start", "train")) == 2
    assert not caplog.records
    assert len(tokenize_preferences(rows, tok, prompt, "keep_end", "train")) == 2


def test_group_by_length_orders_pairs_by_their_longer_sequence(tmp_path):
    from trainer import ORPOConfig
    from trainer.data.loader import sample_lengths

    rows = datasets.Dataset.from_list(
        [{"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9], "rejected_ids": [10]},
         {"prompt_ids": [5], "chosen_ids": [11], "rejected_ids": [12, 13, 14]}]
    )  # fmt: skip
    args = ORPOConfig(output_dir=str(tmp_path), train_sampling_strategy="group_by_length")
    assert sample_lengths(rows, args) == [5, 4]


def test_the_collator_batches_pairs_and_cuts_as_asked():
    rows = [
        {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9], "rejected_ids": [10], "ref_logps": [-1.0, -2.0]},
        {"prompt_ids": [5], "chosen_ids": [11], "rejected_ids": [12, 13, 14]},
    ]
    rows[1]["ref_logps"] = [-3.0, -4.0]
    batch = PreferenceCollator(pad_token_id=0)(rows)
    assert batch["input_ids"].shape == (2, 2, 5)  # a batch's rows are its pairs
    assert batch["input_ids"][0].tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 10, 0]]
    assert batch["completion_mask"][1].tolist() == [[0, 1, 0, 0, 0], [0, 1, 1, 1, 0]]
    assert batch["attention_mask"][1].tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]
    assert batch["ref_logps"].tolist() == [[-1.0, -2.0], [-3.0, -4.0]]
    kept_end = PreferenceCollator(
        pad_token_id=0, max_length=3, truncation_mode="keep_end", pad_to_multiple_of=4
    )(rows)
    assert kept_end["input_ids"][0].tolist() == [[7, 8, 9, 0], [6, 7, 10, 0]]
    assert kept_end["completion_mask"][0].tolist() == [[0, 1, 1, 0], [0, 0, 1, 0]]
    assert torch.equal(kept_end["attention_mask"].sum(-1), torch.tensor([[3, 3], [2, 3]]))
    free = PreferenceCollator(pad_token_id=0, padding_free=True)(rows)
    assert free["input_ids"].tolist() == [[5, 6, 7, 8, 9, 5, 6, 7, 10, 5, 11, 5, 12, 13, 14]]
    assert free["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 0, 1, 2, 3]]
    assert free["token_index"][1].tolist() == [[9, 10, -1, -1, -1], [11, 12, 13, 14, -1]]
    assert torch.equal(free["completion_mask"], batch["completion_mask"])
    assert batch_rows(free) == 2  # still counted in pairs (the step's samples)


# ---- the arguments -------------------------------------------------------------------------------


def test_dpo_config_takes_trls_fields_and_refuses_what_is_not_implemented(tmp_path):
    from trainer import DPOConfig

    args = DPOConfig(output_dir=str(tmp_path), loss_type="ipo", beta=0.5)
    assert args.loss_type == ["ipo"] and args.learning_rate == 1e-6 and args.gradient_checkpointing
    for field, value in (("use_weighting", True), ("f_divergence_type", "js_divergence"), ("ld_alpha", 0.5)):
        with pytest.raises(ValueError, match=rf"{field}=.*: not supported"):
            DPOConfig(output_dir=str(tmp_path), **{field: value})
    with pytest.raises(ValueError, match="loss_type"):
        DPOConfig(output_dir=str(tmp_path), loss_type="discopop")
    with pytest.raises(ValueError, match="loss_weights: 1 weights for 2 loss types"):
        DPOConfig(output_dir=str(tmp_path), loss_type=["sigmoid", "ipo"], loss_weights=[1.0])


def test_orpo_and_cpo_configs_take_trls_fields_and_refuse_what_is_not_implemented(tmp_path):
    from trainer import CPOConfig, ORPOConfig

    orpo = ORPOConfig(output_dir=str(tmp_path), beta=0.2, padding_value=0)
    assert (orpo.beta, orpo.padding_value, orpo.learning_rate, orpo.max_length) == (0.2, 0, 1e-6, 1024)
    cpo = CPOConfig(output_dir=str(tmp_path), loss_type="simpo", cpo_alpha=0.0)
    assert (cpo.loss_type, cpo.cpo_alpha, cpo.simpo_gamma, cpo.beta) == ("simpo", 0.0, 0.5, 0.1)
    refused = [(ORPOConfig, "max_completion_length", 64), (ORPOConfig, "generate_during_eval", True),
               (CPOConfig, "alpha", 0.25), (CPOConfig, "is_encoder_decoder", True)]  # fmt: skip
    for config, field, value in refused:
        with pytest.raises(ValueError, match=rf"{field}={value!r}: not supported \("):
            config(output_dir=str(tmp_path), **{field: value})
    with pytest.raises(ValueError, match="loss_type"):
        CPOConfig(output_dir=str(tmp_path), loss_type="alphapo")


def test_a_preference_trainer_takes_only_its_own_config(tmp_path):
    from trainer import DPOConfig, ORPOTrainer

    with pytest.raises(TypeError, match="^ORPOTrainer: args must be ORPOConfig, got DPOConfig$"):
        ORPOTrainer(torch.nn.Linear(1, 1), args=DPOConfig(output_dir=str(tmp_path)))


def test_a_reference_pass_stopped_midway_resumes_where_it_stopped(results):
    run = results["reference_resume"]
    assert run["stopped"] and run["chunks_left"] == 3  # one chunk per batch scored before the stop
    assert run["forwards_after"] == 3  # only the batches left
    assert not run["partial_left"]  # the whole pass is in the cache; its chunks are gone
    assert run["same_cache"]
    for key in METRICS:
        assert run["resumed"][key] == run["whole"][key], key


def test_orpo_and_cpo_put_the_tokenizers_bos_in_front_of_the_prompt_as_trls_do():
    """TRL's ORPO and CPO keep an older tokenisation than DPO's: a BOS token the tokenizer does not
    add itself goes in front of the prompt (once), an EOS after each answer; DPO's rule adds none."""
    from trainer.data.preference import tokenize_pair_with_bos

    tok = tokenizer(bos=True)
    row = {"prompt": "What colour is the sky?", "chosen": " It is blue.", "rejected": " It is red."}
    older, dpo = tokenize_pair_with_bos(row, tok), tokenize_pair(row, tok)
    assert older["prompt_ids"][0] == tok.bos_token_id and older["prompt_ids"][1:] == dpo["prompt_ids"]
    assert older["chosen_ids"] == dpo["chosen_ids"] and older["chosen_ids"][-1] == tok.eos_token_id
    assert (
        tokenize_pair_with_bos({**row, "prompt": tok.bos_token + row["prompt"]}, tok)["prompt_ids"]
        == older["prompt_ids"]
    )
