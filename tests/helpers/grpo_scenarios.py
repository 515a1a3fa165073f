"""Online RL through ``from trainer import GRPOTrainer, RLOOTrainer`` against TRL 1.16's, on the same
tiny Llama, tokenizer, prompts, reward functions and seed, in one process (TRL's without DeepSpeed,
``use_cpu``); and our own runs on any launcher.

Usage: ``python tests/helpers/grpo_scenarios.py OUT SCENARIO [SCENARIO...]``; each scenario writes
``OUT/<scenario>.json`` (from the main rank) for ``tests/unit/test_grpo.py`` and
``tests/distributed/test_grpo_zero.py`` to read.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import datasets
import torch.distributed as dist
from transformers import set_seed
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from tests.helpers.preference_scenarios import COLOURS, SUBJECTS, base, lora, main
from tests.helpers.scaffold import read_metrics
from trainer import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer, TrainerCallback
from trainer.cli.main import exit_now
from trainer.runtime.distributed import dist_info

METRICS = ("loss", "grad_norm", "reward", "reward_std", "rewards/colour_named/mean", "rewards/length_reward/mean",
           "frac_reward_zero_std", "entropy", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean",
           "completions/mean_length", "completions/clipped_ratio", "num_tokens")  # fmt: skip
# Plain SGD at a rate that moves the tiny policy between generations.
COMMON = dict(max_steps=3, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
              optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
              report_to="none", disable_tqdm=True, seed=0, gradient_checkpointing=False, bf16=False)  # fmt: skip
SCENARIOS: dict[str, Any] = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def text_of(completion: Any) -> str:
    """A completion's text: as it is, or a conversation's assistant message."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def colour_named(completions: list[Any], subject: list[str], **kwargs: Any) -> list[float | None]:
    """1 for a completion that names a colour, 0 if not; None (unscored) for the sea's."""
    return [
        None if s == "the sea" else float(any(c in text_of(t) for c in COLOURS))
        for t, s in zip(completions, subject, strict=True)
    ]


def length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Longer completions score more (the tiny model's EOS cuts some short)."""
    return [len(text_of(t)) / 10 for t in completions]


async def vowels(completions: list[Any], **kwargs: Any) -> list[float]:
    await asyncio.sleep(0)
    return [sum(ch in "aeiou" for ch in text_of(t)) / 5 for t in completions]


def prompts(n: int = 16, kind: str = "text") -> datasets.Dataset:
    rows = []
    for i in range(n):
        subject = SUBJECTS[i % 8]
        prompt = f"What colour is {subject}?"
        if kind == "conversation":
            prompt = [{"role": "user", "content": prompt}]
        rows.append({"prompt": prompt, "subject": subject})
    return datasets.Dataset.from_list(rows)


EXTRA = ("kl", "clip_ratio/low_min", "clip_ratio/high_max")  # logged by some runs only


def history(rows: list[dict], keys: tuple[str, ...] = METRICS + EXTRA) -> dict[str, list[float | None]]:
    train = [r for r in rows if "loss" in r and "train_runtime" not in r]
    return {k: [r.get(k) for r in train] for k in keys}


def classes(method: str, ours: bool) -> tuple[type, type]:
    if ours:
        return (GRPOConfig, GRPOTrainer) if method == "grpo" else (RLOOConfig, RLOOTrainer)
    import trl

    return (trl.GRPOConfig, trl.GRPOTrainer) if method == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)


def run(out: Path, name: str, method: str, ours: bool, data: Any = None, peft_config: Any = None,
        funcs: Any = None, **fields: Any) -> dict[str, list]:  # fmt: skip
    config, trainer_class = classes(method, ours)
    extra = {} if ours else {"use_cpu": True}
    if not ours:
        unset_hf_deepspeed_config()
    set_seed(0)
    args = config(output_dir=str(out / name), **extra, **{**COMMON, **fields})
    trainer = trainer_class(base(out), reward_funcs=funcs or [colour_named, length_reward], args=args,
                            train_dataset=data if data is not None else prompts(), peft_config=peft_config)  # fmt: skip
    watch = WatchGeneration()
    if ours:
        trainer.add_callback(watch)
    trainer.train()
    if ours:
        if dist.is_initialized():
            dist.barrier()
        tiles = trainer.engine.tokens.tiles  # (head, tokens a tile) where the log-probabilities were tiled
        # The last rollout's weights under ZeRO-3: (bytes gathered once, the whole model's).
        gathered = list(trainer.engine.gathered)
        return {
            **history(read_metrics(out / name)),
            "tile_tokens": tiles[1] if tiles else None,
            "gathered": gathered,
            "generation_status": sorted(watch.seen),
        }
    return history(trainer.state.log_history)


class WatchGeneration(TrainerCallback):
    """``seen``, filled as the engine's model generates: at each forward of a generation (one given a
    KV cache), before ZeRO-3's hooks fetch anything, the status of its first and last partitioned
    parameters that ZeRO-3 releases after use (not persistent): AVAILABLE where held gathered,
    NOT_AVAILABLE where not."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()

    def on_train_begin(self, args: Any, state: Any, control: Any, engine: Any = None, **kwargs: Any) -> None:
        engine.module.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        params = [p for p in module.parameters() if hasattr(p, "ds_status") and not p.ds_persist]
        if params and kwargs.get("cache", kwargs.get("past_key_values")) is not None:
            self.seen.add((params[0].ds_status.name, params[-1].ds_status.name))


def parity(
    out: Path, method: str = "grpo", ours: dict[str, Any] | None = None, **fields: Any
) -> dict[str, Any]:
    """TRL's run and ours of the same fields; ``ours``: fields only ours has."""
    return {
        "trl": run(out, "trl", method, False, **fields),
        "ours": run(out, "ours", method, True, **fields, **(ours or {})),
    }


@scenario
def grpo_dapo(out: Path) -> dict[str, Any]:
    """TRL's default loss; two micro-batches a step, one generation a step."""
    return parity(out, gradient_accumulation_steps=2, per_device_train_batch_size=2)


@scenario
def grpo_grpo(out: Path) -> dict[str, Any]:
    """On-policy, one pass: the ratio is exactly 1, so even a clip range of 1e-7 clips nothing."""
    return parity(out, loss_type="grpo", epsilon=1e-7)


@scenario
def grpo_bnpo(out: Path) -> dict[str, Any]:
    return parity(out, loss_type="bnpo", gradient_accumulation_steps=2, per_device_train_batch_size=2)


@scenario
def grpo_dr_grpo(out: Path) -> dict[str, Any]:
    return parity(out, loss_type="dr_grpo")


@scenario
def gspo_buffer(out: Path) -> dict[str, Any]:
    """GSPO's sequence-level ratio over a buffer reused: 2 steps a generation, 2 passes over it, so
    the ratio moves off 1 and clips (a tight epsilon); the KL to the reference (beta > 0)."""
    fields = dict(importance_sampling_level="sequence", steps_per_generation=2, num_iterations=2,
                  epsilon=0.02, beta=0.1, max_steps=4, per_device_train_batch_size=2)  # fmt: skip
    return parity(out, **fields)


@scenario
def grpo_scaled_masked(out: Path) -> dict[str, Any]:
    """Batch-scaled advantages, truncated completions masked, weighted rewards with an async one."""
    fields = dict(scale_rewards="batch", mask_truncated_completions=True, reward_weights=[1.0, 0.5, 2.0],
                  temperature=0.7, top_k=50)  # fmt: skip
    return parity(out, funcs=[colour_named, length_reward, vowels], **fields)


@scenario
def grpo_lora_beta(out: Path) -> dict[str, Any]:
    """LoRA with beta > 0: the reference is the base with its adapters off, in both."""
    return parity(out, peft_config=lora(), beta=0.2, learning_rate=1.0)


@scenario
def grpo_tiled(out: Path) -> dict[str, Any]:
    """Ours computes the completions' log-probabilities and entropies from the last hidden states 5
    tokens at a time (the tiled per-token service), never the whole logits; TRL's its own way."""
    return parity(out, ours={"tiled_loss": "true", "tile_tokens": 5}, temperature=0.8, beta=0.1)


@scenario
def grpo_conversation(out: Path) -> dict[str, Any]:
    return parity(out, data=prompts(kind="conversation"))


@scenario
def rloo(out: Path) -> dict[str, Any]:
    """RLOO at TRL's defaults (beta 0.05: the KL in the reward), two micro-batches a step."""
    return parity(out, "rloo", gradient_accumulation_steps=2, per_device_train_batch_size=2)


@scenario
def rloo_normalized(out: Path) -> dict[str, Any]:
    return parity(out, "rloo", beta=0.0, normalize_advantages=True, reward_clip_range=(0.0, 2.0))


@scenario
def dapo_splits(out: Path) -> dict[str, Any]:
    """The same generation batch of 4 completions a step, as 1, 2 or 4 micro-batches."""
    return {
        f"{micro}x{4 // micro}": run(
            out,
            f"m{micro}",
            "grpo",
            True,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=4 // micro,
        )  # fmt: skip
        for micro in (4, 2, 1)
    }


@scenario
def seeds(out: Path) -> dict[str, Any]:
    """Our runs from seed 0 twice and from seed 1."""
    return {name: run(out, name, "grpo", True, seed=seed) for name, seed in (("a", 0), ("b", 0), ("c", 1))}


@scenario
def grpo_ranks(out: Path) -> dict[str, Any]:
    """Under a launcher: TRL's trainer (DDP) and ours on the same global batch, each rank its share:
    ours at ZeRO-2 and at ZeRO-3 (the weights gathered once for generation; half of them, the rest
    gathered by each forward; all gathered by each forward: ``ds3_gather_for_generation=False``)."""
    world = dist_info().world_size
    per_rank = dict(per_device_train_batch_size=COMMON["per_device_train_batch_size"] // world)
    if dist_info().is_main:  # one rank writes the model (save_pretrained writes on the main process only)
        base(out)
    while not (out / "base" / "config.json").is_file():
        time.sleep(0.1)
    return {
        "world_size": world,
        "trl": run(out, "trl", "grpo", False, **per_rank),
        "zero2": run(out, "zero2", "grpo", True, zero_stage=2, **per_rank),
        "zero3": run(out, "zero3", "grpo", True, zero_stage=3, **per_rank),
        "zero3_half": run(
            out,
            "zero3_half",
            "grpo",
            True,
            zero_stage=3,
            generation_gather_gb=(out / "base" / "model.safetensors").stat().st_size / 2 / 1e9,
            **per_rank,
        ),
        "zero3_layers": run(
            out, "zero3_layers", "grpo", True, zero_stage=3, ds3_gather_for_generation=False, **per_rank
        ),  # fmt: skip
    }


@scenario
def grpo_one(out: Path) -> dict[str, Any]:
    """Our run alone on one process, as ``grpo_ranks`` runs it on several."""
    return {"ours": run(out, "ours", "grpo", True)}


if __name__ == "__main__":
    exit_now(main(SCENARIOS))
