"""KTO through ``from trainer import KTOConfig, KTOTrainer`` against TRL 1.16's ``KTOTrainer``, on the
same tiny Llama, tokenizer, rows, order and seed, in one process (TRL's without DeepSpeed,
``use_cpu``), and our own runs on any launcher.

Usage: ``python tests/helpers/kto_scenarios.py OUT SCENARIO [SCENARIO...]``; each scenario writes
``OUT/<scenario>.json`` (from the main rank) for ``tests/unit/test_kto.py`` and
``tests/distributed/test_kto_zero.py`` to read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import torch.distributed as dist
from transformers import set_seed
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from tests.helpers.preference_scenarios import COLOURS, SUBJECTS, base, evaluation, lora, main, pairs
from tests.helpers.scaffold import read_metrics
from trainer import KTOConfig, KTOTrainer
from trainer.cli.main import exit_now
from trainer.runtime.distributed import dist_info

METRICS = ("loss", "grad_norm", "kl", "entropy", "logits/chosen", "logits/rejected", "rewards/chosen",
           "logps/chosen", "rewards/rejected", "logps/rejected", "rewards/margins", "num_tokens")  # fmt: skip
# Plain SGD, large enough a rate to move the policy and make the KL estimate positive: Adam's first
# step divides each gradient by its own size, so rounding-level differences in a near-zero gradient
# become whole-step differences in a weight (kto_adamw measures that apart).
COMMON = dict(max_steps=4, per_device_train_batch_size=4, optim="sgd", learning_rate=1.0,
              lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
              disable_tqdm=True, seed=0, gradient_checkpointing=False, bf16=False, max_length=24)  # fmt: skip
SCENARIOS: dict[str, Any] = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def completions(n: int = 24, kind: str = "text") -> datasets.Dataset:
    """Unpaired rows, desirable and not mixed within micro-batches, of different lengths."""
    rows = []
    for i in range(n):
        prompt = f"What colour is {SUBJECTS[i % 8]}?"
        good = i % 3 != 1
        answer = (
            f" It is {COLOURS[i % 6]}."
            if good
            else f" It is {COLOURS[(i + 2) % 6]}, or maybe {COLOURS[i % 5]}."
        )
        if kind == "conversation":
            rows.append({"prompt": [{"role": "user", "content": prompt}],
                         "completion": [{"role": "assistant", "content": answer.strip()}], "label": good})  # fmt: skip
        else:
            rows.append({"prompt": prompt, "completion": answer, "label": good})
    return datasets.Dataset.from_list(rows)


def history(rows: list[dict]) -> dict[str, list[float | None]]:
    """Each metric at every logged training step (None where that step did not log it)."""
    train = [r for r in rows if "loss" in r and "train_runtime" not in r]
    return {k: [r.get(k) for r in train] for k in METRICS}


def run_trl(out: Path, data: datasets.Dataset, evaluated: dict, peft_config: Any = None, **fields: Any):
    import trl

    unset_hf_deepspeed_config()
    set_seed(0)
    args = trl.KTOConfig(output_dir=str(out / "trl"), use_cpu=True, **{**COMMON, **fields})
    trainer = trl.KTOTrainer(base(out), args=args, train_dataset=data, eval_dataset=completions(32).select(range(24, 32)),
                             peft_config=peft_config)  # fmt: skip
    trainer.train()
    evaluated.update(evaluation(trainer))
    return history(trainer.state.log_history)


def run_ours(out: Path, data: datasets.Dataset, name: str = "ours", peft_config: Any = None, **fields: Any):
    set_seed(0)
    args = KTOConfig(output_dir=str(out / name), **{**COMMON, **fields})
    trainer = KTOTrainer(base(out), args=args, train_dataset=data, eval_dataset=completions(32).select(range(24, 32)),
                         peft_config=peft_config)  # fmt: skip
    trainer.train()
    evaluated = evaluation(trainer)
    if dist.is_initialized():
        dist.barrier()  # rank 0 writes metrics.jsonl: every rank reads it once that writer is done
    return history(read_metrics(out / name)), evaluated


def parity(out: Path, data: datasets.Dataset, **fields: Any) -> dict[str, Any]:
    theirs: dict[str, float] = {}
    trl = run_trl(out, data, theirs, **fields)
    ours, evaluated = run_ours(out, data, **fields)
    return {"ours": ours, "trl": trl, "ours_eval": evaluated, "trl_eval": theirs}


@scenario
def kto_text(out: Path) -> dict[str, Any]:
    return parity(out, completions())


@scenario
def kto_adamw(out: Path) -> dict[str, Any]:
    """TRL's default optimizer family, at the rate the DPO comparisons use."""
    return parity(out, completions(), optim="adamw_torch", learning_rate=1e-2)


@scenario
def kto_conversation(out: Path) -> dict[str, Any]:
    return parity(out, completions(kind="conversation"))


@scenario
def kto_weighted_accumulated(out: Path) -> dict[str, Any]:
    """Two micro-batches of 2 rows a step (each its own KL estimate, as TRL's), weights apart."""
    fields = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, desirable_weight=1.5,
                  undesirable_weight=0.5, beta=0.5)  # fmt: skip
    return parity(out, completions(), **fields)


@scenario
def apo_zero_unpaired(out: Path) -> dict[str, Any]:
    return parity(out, completions(), loss_type="apo_zero_unpaired")


@scenario
def kto_from_pairs(out: Path) -> dict[str, Any]:
    """A preference set unpaired as TRL unpairs it (chosen rows, then rejected ones)."""
    return parity(out, pairs("implicit", 12))


@scenario
def kto_lora(out: Path) -> dict[str, Any]:
    """LoRA without a ref_model: the reference is the base with its adapters off, in both."""
    return parity(out, completions(), peft_config=lora())


@scenario
def kto_ranks(out: Path) -> dict[str, Any]:
    """Under a launcher, every rank a share of the same global micro-batch of 4 rows (kto_text's and
    kto_lora's): the KL pairs, the estimate and the loss are one process's. ZeRO-3 (the reference
    pass scores with the partitioned weights), ZeRO-3 with LoRA (the base, adapters off, is the
    reference), and last sequence parallelism (SP=2: both ranks every row, each half of every
    sequence; its groups are set up once per process)."""
    world = dist_info().world_size
    per_rank = COMMON["per_device_train_batch_size"] // world
    base(out)  # saved whole before ZeRO-3 arguments register (a model built under them is partitioned)
    runs = {
        "zero3": run_ours(out, completions(), "zero3", zero_stage=3, per_device_train_batch_size=per_rank)[0],
        "zero3_lora": run_ours(out, completions(), "zero3_lora", peft_config=lora(), zero_stage=3,
                               per_device_train_batch_size=per_rank)[0],
        "sp2_zero3": run_ours(out, completions(), "sp2", zero_stage=3, sequence_parallel_size=2)[0],
    }  # fmt: skip
    return {"world_size": world, **runs}


if __name__ == "__main__":
    exit_now(main(SCENARIOS))
