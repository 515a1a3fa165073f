"""Online RL through the public command: ``scripts/train.py --objective grpo|rloo --reward_funcs
module:function,...`` on a saved tiny Llama and a JSON-lines file of prompts.

- GRPO on 2 ranks under ZeRO-3 (the deepspeed launcher), each generation feeding 2 steps and read
  twice (``steps_per_generation 2``, ``num_iterations 2``: 4 steps a rollout buffer), with a
  checkpoint every 2 steps: inside a buffer;
- the same run under torchrun's elastic agent with rank 1 killed (SIGKILL) after step 3: the agent
  restarts both ranks, they resume from checkpoint-2 (inside the buffer) and end bit for bit where
  the uninterrupted run ended: the same rollouts, rewards, losses and weights;
- GRPO with LoRA on 2 ranks under ZeRO-3, ``beta`` > 0 (the reference is the base with its
  adapters off); RLOO at TRL's defaults on 2 ranks under ZeRO-3 through ``accelerate launch`` (its
  reference a frozen engine of the base, loaded from its path and partitioned like the policy).
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.grpo_scenarios import prompts
from tests.helpers.launch import launch, run_env
from tests.helpers.preference_scenarios import base
from tests.helpers.scaffold import assert_same_weights, train_rows

pytestmark = pytest.mark.distributed

REWARDS = "tests.helpers.grpo_scenarios:colour_named,tests.helpers.grpo_scenarios:length_reward"
COMMON = ["--reward_funcs", REWARDS, "--num_generations", "4", "--max_completion_length", "8",
          "--per_device_train_batch_size", "2", "--learning_rate", "0.5", "--optim", "sgd",
          "--lr_scheduler_type", "constant", "--logging_steps", "1", "--validation_split_percentage", "0"]  # fmt: skip
BUFFER = ["--objective", "grpo", "--zero_stage", "3", "--max_steps", "6", "--save_steps", "2",
          "--steps_per_generation", "2", "--num_iterations", "2", "--epsilon", "0.05"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_cli")
    model = base(root)
    prompts(16).to_json(root / "prompts.jsonl")
    start = ["scripts/train.py", "--model_name_or_path", model, "--dataset", str(root / "prompts.jsonl"),
             "--cache_dir", str(root / "cache"), *COMMON]  # fmt: skip
    out = {name: root / name for name in ("zero3", "resumed", "lora_zero3", "rloo_zero3")}

    def command(name: str, *extra: str) -> list[str]:
        return [*start, "--output_dir", str(out[name]), *extra]

    launch(command("zero3", *BUFFER), launcher="deepspeed")
    crash = run_env(TRAINER_FAULT="crash:rank=1:step=3")
    lora = ["--objective", "grpo", "--zero_stage", "3", "--max_steps", "3", "--use_peft", "true", "--lora_r", "4",
            "--lora_alpha", "8", "--beta", "0.2", "--learning_rate", "2.0"]  # fmt: skip
    rloo = ["--objective", "rloo", "--zero_stage", "3", "--max_steps", "3"]
    out["resumed_proc"] = launch(command("resumed", *BUFFER), restarts=1, env=crash)
    launch(command("lora_zero3", *lora), launcher="deepspeed")
    launch(command("rloo_zero3", *rloo), launcher="accelerate")
    return out


def test_trls_metric_names_are_logged(runs):
    rows = train_rows(runs["zero3"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "grad_norm", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                "clip_ratio/region_mean", "num_tokens"):  # fmt: skip
        assert all(key in r for r in rows), key
    # A rollout is logged at the step that generated it: steps 1 and 5 here.
    generated = [r["step"] for r in rows if "reward" in r]
    assert generated == [1, 5]
    for key in ("reward_std", "rewards/colour_named/mean", "rewards/length_reward/mean",
                "completions/mean_length", "completions/clipped_ratio", "frac_reward_zero_std"):  # fmt: skip
        assert all(key in r for r in rows if r["step"] in generated), key
    # The second pass over a buffer moves the ratio off 1: the clipped share is positive somewhere.
    assert max(r["clip_ratio/region_mean"] for r in rows) > 0


def test_a_run_killed_inside_a_rollout_buffer_resumes_bitwise(runs):
    resumed = f"Resumed from {runs['resumed'] / 'checkpoint-2'} at step 2."
    assert resumed in runs["resumed_proc"].stdout  # the agent restarted the killed ranks
    rows = train_rows(runs["resumed"])
    assert [r["step"] for r in rows] in ([1, 2, 3, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]), rows
    whole = {r["step"]: r for r in train_rows(runs["zero3"])}
    names = (
        "loss",
        "grad_norm",
        "entropy",
        "clip_ratio/region_mean",
        "num_tokens",
        "reward",
        "completions/mean_length",
    )
    for row in rows:
        assert {k: row.get(k) for k in names} == {k: whole[row["step"]].get(k) for k in names}, row["step"]
    assert_same_weights(runs["resumed"] / "final", runs["zero3"] / "final")


def test_lora_under_zero3_trains_against_the_base(runs):
    rows = train_rows(runs["lora_zero3"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["kl"] == 0.0 and rows[-1]["kl"] > 0  # the adapters move the policy off the base
    assert (runs["lora_zero3"] / "final" / "adapter_config.json").is_file()


def test_rloo_under_zero3_against_a_partitioned_reference(runs):
    rows = train_rows(runs["rloo_zero3"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("kl" in r and "reward" in r for r in rows)
    # The reference is the initial policy; RLOO's kl is the mean log-ratio (of either sign), not k3.
    assert rows[0]["kl"] == 0.0 and abs(rows[-1]["kl"]) > 1e-4
    assert (runs["rloo_zero3"] / "final" / "model.safetensors").is_file()
    ds_config = json.loads((runs["rloo_zero3"] / "ds_config.json").read_text())
    # accelerate started 2 ranks of 2 rows each
    assert (ds_config["train_batch_size"], ds_config["zero_optimization"]["stage"]) == (2 * 2, 3)
