"""Online RL: ``from trainer import GRPOTrainer, RLOOTrainer`` against TRL 1.16's, step by step, and
the invariants the losses must keep.

The runs happen in one child process (tests/helpers/grpo_scenarios.py, plain python, one rank), TRL's
and ours on the same tiny Llama, tokenizer, prompts, reward functions and seed: both generate the
same completions from it, so every metric below is computed from the same rollouts.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.grpo_scenarios import METRICS
from tests.helpers.launch import launch
from trainer import GRPOConfig, GRPOTrainer, RLOOConfig

SCRIPT = "tests/helpers/grpo_scenarios.py"
PARITY = ["grpo_dapo", "grpo_grpo", "grpo_bnpo", "grpo_dr_grpo", "gspo_buffer", "grpo_scaled_masked",
          "grpo_lora_beta", "grpo_tiled", "grpo_conversation", "rloo", "rloo_normalized"]  # fmt: skip
KL = {"gspo_buffer", "grpo_lora_beta", "grpo_tiled", "rloo"}  # beta > 0: kl is logged


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    names = [*PARITY, "dapo_splits", "seeds"]
    launch([SCRIPT, str(out), *names], launcher="python", timeout=1200)
    return {name: json.loads((out / f"{name}.json").read_text()) for name in names}


@pytest.mark.parametrize("name", PARITY)
def test_each_step_matches_trls_trainer(results, name):
    """Loss, grad norm, rewards, entropy, clipping and completion metrics at every step, within
    fp32's reordering of the same sums. An on-policy loss is a sum of advantages that cancel (about
    1e-7), so the absolute 1e-6 bounds it; the grad norms are compared relatively."""
    run = results[name]
    keys = [*METRICS, *(["kl"] if name in KL else [])]
    if name.startswith("rloo"):
        keys = [k for k in keys if k not in ("clip_ratio/low_mean", "clip_ratio/high_mean")] + [
            "clip_ratio/low_mean"
        ]
    for key in keys:
        trl, ours = run["trl"][key], run["ours"][key]
        assert len(trl) == len(ours) >= 3, key
        logged = [i for i, v in enumerate(trl) if v is not None]  # num_tokens: TRL's rows of a generation
        if key != "num_tokens":
            assert [v is None for v in ours] == [v is None for v in trl], key
        assert [ours[i] for i in logged] == pytest.approx([trl[i] for i in logged], rel=1e-5, abs=1e-6), key
    assert run["trl"]["grad_norm"][0] > 0.05  # a gradient to compare


def test_the_runs_exercise_what_they_claim(results):
    """Unscored completions (None), truncated and ended ones, clipping where the buffer is reused,
    a KL that grows from 0, rewards that differ within groups."""
    grpo, gspo = results["grpo_grpo"]["trl"], results["gspo_buffer"]["trl"]
    assert None in grpo["rewards/colour_named/mean"]
    assert min(grpo["completions/clipped_ratio"]) > 0 or 0 < max(grpo["completions/clipped_ratio"]) < 1
    assert max(gspo["clip_ratio/region_mean"]) > 0
    assert gspo["kl"][0] == 0 and max(gspo["kl"]) > 0
    assert max(results["grpo_lora_beta"]["trl"]["kl"]) > 0
    assert max(results["rloo"]["trl"]["kl"]) > 0
    assert min(grpo["frac_reward_zero_std"]) < 1


def test_the_tiled_run_never_held_the_whole_logits(results):
    assert results["grpo_tiled"]["ours"]["tile_tokens"] == 5
    assert results["grpo_dapo"]["ours"]["tile_tokens"] is None


def test_on_policy_the_ratio_is_one(results):
    """num_iterations=1, one generation a step: the ratio is exactly 1, so a clip range of 1e-7
    (grpo_grpo's) clips no token."""
    for key in ("clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max"):
        assert set(results["grpo_grpo"]["ours"][key]) == {0.0}, key


def test_dapo_does_not_depend_on_the_micro_batches(results):
    """One generation batch of 4 completions a step, trained as 4x1, 2x2 or 1x4 micro-batches. (TRL's
    entropy is a mean over micro-batches of their token means: a split changes it by definition.)"""
    runs = results["dapo_splits"]
    for key in ("loss", "grad_norm", "reward", "completions/mean_length"):
        for split in ("2x2", "1x4"):
            assert runs[split][key] == pytest.approx(runs["4x1"][key], rel=1e-6, abs=1e-7), (key, split)


def test_a_seed_gives_the_same_completions(results):
    a, b, c = (results["seeds"][n] for n in "abc")
    assert a == b
    assert a["reward"] != c["reward"]


def test_fields_not_implemented_are_refused_by_name():
    with pytest.raises(ValueError, match="use_vllm=True: not supported"):
        GRPOConfig(output_dir="x", use_vllm=True)
    with pytest.raises(ValueError, match="entropy_coef=0.1: not supported"):
        GRPOConfig(output_dir="x", entropy_coef=0.1)
    with pytest.raises(ValueError, match="loss_type"):
        GRPOConfig(output_dir="x", loss_type="vespo")
    with pytest.raises(ValueError, match="generation_batch_size, steps_per_generation"):
        RLOOConfig(output_dir="x", generation_batch_size=8, steps_per_generation=2)
    with pytest.raises(ValueError, match="must be a multiple of num_generations"):
        GRPOConfig(output_dir="x", per_device_train_batch_size=3).rollout_sizes(1)
    with pytest.raises(ValueError, match="tools is not supported"):
        GRPOTrainer("unused", reward_funcs=len, args=GRPOConfig(output_dir="x"), tools=[len])


def test_scale_rewards_takes_trls_booleans():
    assert GRPOConfig(output_dir="x", scale_rewards=False).scale_rewards == "none"
    from trainer.args import RunConfig

    run = RunConfig.from_flat({"objective": "grpo", "reward_funcs": "a:f, b:g", "output_dir": "x"})
    assert run.data.reward_funcs == ["a:f", "b:g"]
    with pytest.raises(ValueError, match="reward_funcs: objective grpo scores its completions"):
        RunConfig.from_flat({"objective": "grpo", "output_dir": "x"})
    with pytest.raises(ValueError, match="reward_funcs: objective causal_lm generates nothing"):
        RunConfig.from_flat({"reward_funcs": "a:f", "output_dir": "x"})


PROMPT = 'def f(x):\n    """Doc."""\n'


@pytest.mark.parametrize(
    "completion, score, whole",
    [
        ("    return x\n", 1.05, 1.0),  # all code, one statement
        ("    return x", 1.05, 1.0),  # cut at the length cap where the line happens to parse
        ("    y = x + 1\n    return y\n", 1.1, 1.0),
        ("    y = x + 1\n    return y\n    garbage (\n", 12 / 20 + 0.1, 0.0),  # 12 of 20 characters parse
        ("    return\n" * 10, 0.1 + 0.05, 1.0),  # one distinct line of ten
        ("\n    return # return # return\n", 6 / 20 + 0.05, 1.0),  # comments are not code
        ("\n    self\n    pass\n", 0.0, 0.0),  # nothing that does something
        ("def()\n", 0.0, 0.0),
    ],
)
def test_python_body_rewards_code_that_parses(completion, score, whole):
    from trainer.loop.rewards import python_body

    logged = {}
    assert python_body([PROMPT], [completion], log_metric=logged.__setitem__) == [pytest.approx(score)]
    assert logged == {"python/parses": whole}


def test_reward_functions_by_name_and_a_reward_model_by_path(tmp_path):
    """``module:function`` imports a callable (its name logged as TRL logs it); any other name is a
    sequence classifier's path, whose first logit scores prompt and completion together; an async
    callable is awaited; None is NaN; a count that is not one per completion is refused by name."""
    import math

    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from tests.helpers.preference_scenarios import tokenizer
    from trainer.loop.rewards import Rewards

    tok = tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)  # fmt: skip
    model = LlamaForSequenceClassification(config)
    model.save_pretrained(tmp_path / "judge")
    tok.save_pretrained(tmp_path / "judge")
    rewards = Rewards(["tests.helpers.grpo_scenarios:colour_named", str(tmp_path / "judge"),
                       "tests.helpers.grpo_scenarios:vowels"], [1.0, 0.5, 2.0])  # fmt: skip
    assert rewards.names == ["colour_named", "judge", "vowels"]
    prompts, completions = (
        ["What colour is a cat?", "What colour is the sea?"],
        [" It is red.", " It is blue."],
    )
    scores = rewards.score(prompts, completions, [[1], [2]], [{"subject": "a cat"}, {"subject": "the sea"}],
                           None, torch.device("cpu"))  # fmt: skip
    assert scores[0, 0] == 1.0 and math.isnan(scores[1, 0])
    inputs = tok([p + c for p, c in zip(prompts, completions, strict=True)], return_tensors="pt", padding=True,
                 padding_side="right", add_special_tokens=False)  # fmt: skip
    with torch.no_grad():
        expected = model.eval()(**inputs).logits[:, 0]
    assert scores[:, 1].tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    assert scores[:, 2].tolist() == pytest.approx([2 / 5, 3 / 5])
    with pytest.raises(ValueError, match="names no importable function"):
        Rewards(["tests.helpers.grpo_scenarios:missing"], None)
    with pytest.raises(ValueError, match="returned 1 rewards for 2 completions"):
        Rewards([lambda **kw: [1.0]], None).score(
            prompts, completions, [[1], [2]], [{}, {}], None, torch.device("cpu")
        )


def test_a_buffer_resumed_on_another_number_of_ranks_is_refused():
    """Each rank's buffer holds its own completions: a checkpoint inside a buffer resumes only on
    the ranks that generated it (a resume at a generation's first step regenerates)."""
    from types import SimpleNamespace

    from trainer.loop.rollouts import RolloutProducer, RolloutRows

    args = GRPOConfig(
        output_dir="x", per_device_train_batch_size=4, num_generations=4, steps_per_generation=2
    )
    mesh = SimpleNamespace(readers=1, data_ranks=(1, 0))
    state = SimpleNamespace(epoch_index=0, samples_into_epoch=4)  # one micro-batch into the first buffer
    trainer = SimpleNamespace(args=args, state=state, mesh=mesh, rewards=None, processing_class=None,
                              generation_config=None, eos_token_ids=[0],
                              train_dataset=RolloutRows(list(range(8)), 2, 4, 1))  # fmt: skip
    producer = RolloutProducer(trainer)
    producer.load_state_dict({"key": [0, 0], "readers": 2, "buffer": [{}, {}]})
    with pytest.raises(RuntimeError, match="generated on 2 ranks; this run has 1"):
        next(producer.windows(trainer, None))
    producer.load_state_dict({"key": [0, 1], "readers": 1, "buffer": [{}, {}]})  # not the one resumed into
    with pytest.raises(RuntimeError, match="rollout buffer of generation 0 is not in the checkpoint"):
        next(producer.windows(trainer, None))
