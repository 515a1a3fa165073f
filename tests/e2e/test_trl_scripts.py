"""TRL 1.16's own ``dpo.py``, ``sft.py``, ``kto.py``, ``grpo.py`` and ``rloo.py`` (as the installed TRL ships them), with only their
``from trl import`` lines naming our trainer and config (tests/helpers/trl_scripts.py), run as a user
runs them: TRL's flags, ``quantization_config=get_quantization_config(...)`` and
``peft_config=get_peft_config(...)`` into the trainer, ``trainer.accelerator.print(...)`` and
``trainer.end()`` at the end.

- One process: DPO with LoRA (``--use_peft``: the adapters drawn after seeding, as TRL's), SFT of a
  mixture of experts (a Mixtral, its router loss on by default in both, one row a micro-batch, where
  TRL's pool of a micro-batch's tokens and ours of a row's agree) on prompt-completion rows, KTO on
  labelled completions (plain SGD: tests/helpers/kto_scenarios.py says why), and GRPO and RLOO on
  prompts (the reward functions imported by the scripts by dotted path; both trainers generate the
  same completions) give, step by step, what TRL's unchanged script gives.
- Two ranks under the deepspeed launcher, a ZeRO-3 DeepSpeed file of "auto" values: DPO with LoRA
  follows the one-process run at the same global batch, and the script's prints appear once.

TRL's numbers come from its checkpoint's ``trainer_state.json``; ours from ``metrics.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.launch import launch, together
from tests.helpers.scaffold import train_rows
from tests.helpers.trl_scripts import trl_script, write_inputs, write_ported

pytestmark = pytest.mark.distributed

COMMON = ["--max_steps", "4", "--per_device_train_batch_size", "4", "--lr_scheduler_type", "constant",
          "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "4", "--report_to", "none",
          "--disable_tqdm", "true", "--seed", "0", "--bf16", "false", "--gradient_checkpointing", "false"]  # fmt: skip
DPO = ["--learning_rate", "1e-2", "--max_length", "24", "--use_peft", "--lora_r", "4", "--lora_alpha", "8",
       "--lora_target_modules", "q_proj", "v_proj"]  # fmt: skip
SFT = ["--learning_rate", "5e-3", "--max_length", "32", "--per_device_train_batch_size", "1"]
KTO = ["--optim", "sgd", "--learning_rate", "1.0", "--max_length", "24"]
# GRPO and RLOO: TRL's scripts import the reward functions by dotted path from the working directory.
RL = ["--optim", "sgd", "--learning_rate", "0.5", "--num_generations", "4", "--max_completion_length", "8",
      "--reward_funcs", "tests.helpers.grpo_scenarios.colour_named", "tests.helpers.grpo_scenarios.length_reward"]  # fmt: skip
ZERO3 = {  # as users write it: the batch and clipping from the arguments
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3},
}
DPO_METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
               "logps/rejected")  # fmt: skip
SFT_METRICS = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "aux_loss")
KTO_METRICS = ("loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected",
               "logits/chosen", "entropy")  # fmt: skip
RL_METRICS = ("loss", "grad_norm", "reward", "reward_std", "rewards/length_reward/mean", "entropy",
              "completions/mean_length", "clip_ratio/region_mean")  # fmt: skip
DONE = "✅ Training completed."
SCRIPTS = ("dpo", "sft", "kto", "grpo", "rloo")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl_scripts")
    write_inputs(out)
    (out / "zero3.json").write_text(json.dumps(ZERO3))
    ported = {name: write_ported(name, out) for name in SCRIPTS}
    model = {"sft": "moe_model"}
    data = {"grpo": "prompts_data", "rloo": "prompts_data"}
    inputs = {name: ["--model_name_or_path", str(out / model.get(name, "model")), "--dataset_name",
                     str(out / data.get(name, f"{name}_data"))] for name in SCRIPTS}  # fmt: skip
    flags = {"dpo": [*inputs["dpo"], *COMMON, *DPO], "sft": [*inputs["sft"], *COMMON, *SFT],
             "kto": [*inputs["kto"], *COMMON, *KTO], "grpo": [*inputs["grpo"], *COMMON, *RL],
             "rloo": [*inputs["rloo"], *COMMON, *RL]}  # fmt: skip
    logs = {}

    def run(key: str, script: Path, name: str, launcher: str = "python", *extra: str) -> None:
        proc = launch([str(script), *flags[name], *extra, "--output_dir", str(out / key)], launcher=launcher)
        logs[key] = proc.stdout

    def one_process() -> None:
        for name in SCRIPTS:
            run(f"{name}_trl", trl_script(name), name)
            run(f"{name}_ours", ported[name], name)

    # Two ranks of 2 pairs each: the one-process run's global batch of 4.
    two_ranks = ["--per_device_train_batch_size", "2", "--deepspeed", str(out / "zero3.json")]
    together(lambda: run("dpo_zero3", ported["dpo"], "dpo", "deepspeed", *two_ranks), one_process)
    return out, logs


def theirs(out: Path, keys: tuple[str, ...]) -> dict[str, list[float]]:
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    rows = [r for r in state["log_history"] if "loss" in r]
    return {k: [r[k] for r in rows] for k in keys}


def ours(out: Path, keys: tuple[str, ...]) -> dict[str, list[float]]:
    rows = train_rows(out)
    return {k: [r[k] for r in rows] for k in keys}


@pytest.mark.parametrize(
    "name, keys",
    [
        ("dpo", DPO_METRICS),
        ("sft", SFT_METRICS),
        ("kto", KTO_METRICS),
        ("grpo", RL_METRICS),
        ("rloo", RL_METRICS),
    ],
)
def test_trls_script_with_our_import_gives_trls_numbers(runs, name, keys):
    out, logs = runs
    trl, got = theirs(out / f"{name}_trl", keys), ours(out / f"{name}_ours", keys)
    assert len(got["loss"]) == 4
    for key in keys:
        assert got[key] == pytest.approx(trl[key], rel=1e-5, abs=1e-6), key
    if name in ("grpo", "rloo"):  # an on-policy loss is advantages that cancel: the gradient moves
        assert trl["grad_norm"][0] > 0.1 and trl["reward"][0] != trl["reward"][-1]
    else:
        assert trl["loss"][-1] < trl["loss"][0]
    # The script's last lines ran: the accelerator's prints, the save, then trainer.end().
    assert DONE in logs[f"{name}_ours"] and "💾 Model saved to" in logs[f"{name}_ours"]


def test_a_lora_dpo_script_saves_the_adapters(runs):
    out, _ = runs
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in (out / "dpo_ours").iterdir()
    }


def test_the_dpo_script_on_two_ranks_under_zero3_follows_one_process(runs):
    out, logs = runs
    got, single = ours(out / "dpo_zero3", DPO_METRICS), ours(out / "dpo_ours", DPO_METRICS)
    for key in DPO_METRICS:
        assert got[key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), key
    assert json.loads((out / "dpo_zero3" / "ds_config.json").read_text())["zero_optimization"]["stage"] == 3
    assert logs["dpo_zero3"].count(DONE) == 1  # accelerate's print: once per node
