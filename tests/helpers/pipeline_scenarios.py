"""Runs pipeline scenarios under a real launcher (2 or 4 ranks) and records what the tests compare.

Each scenario trains the same tiny model with and without a pipeline through the real ``Trainer``
and writes losses into ``<out>/results.json`` and final weights into ``<out>/<scenario>/<run>.pt``.
Usage: ``deepspeed --num_gpus N tests/helpers/pipeline_scenarios.py OUT SCENARIO [SCENARIO ...]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import deepspeed
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from tests.helpers.trainer_scenarios import StepsRun, build_tiny_run, grad_norms
from trainer import Trainer, TrainingArguments
from trainer.cli.main import exit_now
from trainer.data import CausalLMCollator
from trainer.engine import causal_lm_loss_sum
from trainer.runtime.distributed import barrier, detect_hardware, dist_info, init_distributed

VOCAB = 256
LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4
)


def llama_config(tied: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=tied, **LLAMA
    )


def gpt2_config() -> GPT2Config:
    # No dropout: the two runs draw their random numbers in different orders.
    return GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=4, n_head=4, pad_token_id=0,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)  # fmt: skip


def padded_dataset(n: int, seed: int = 0) -> datasets.Dataset:
    """Rows of 8-32 tokens: every micro-batch has its own padded width (the dynamic-shape path)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(8, 33, (1,), generator=g))
        rows.append(torch.randint(1, VOCAB, (length,), generator=g).tolist())
    return datasets.Dataset.from_dict({"input_ids": rows})


def packed_dataset(n: int) -> datasets.Dataset:
    """Fixed-width rows of two or three documents whose position_ids restart at each one."""
    ids, positions = [], []
    for i in range(n):
        cuts = [0, 7 + i % 5, 16 + i % 3, 24]
        ids.append([(i * 7 + k * 3) % (VOCAB - 1) + 1 for k in range(24)])
        positions.append(
            [k - start for start, stop in zip(cuts, cuts[1:], strict=False) for k in range(start, stop)]
        )
    return datasets.Dataset.from_dict({"input_ids": ids, "position_ids": positions})


def learnable_dataset(n: int) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {"input_ids": [[(i + k) % 16 + 1 for k in range(24)] for i in range(n)]}
    )


def train(out: Path, name: str, config, train_ds, eval_ds=None, **overrides) -> Trainer:
    fields = dict(
        output_dir=str(out / name),
        max_steps=10,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        zero_stage=0,
    )
    args = TrainingArguments(**{**fields, **overrides})
    if args.pipeline_parallel_size == 1:
        # A PipelineEngine leaves its topology in DeepSpeed's process-wide groups; a plain engine
        # built later in the same process would read it (wrong data-parallel size, then a crash).
        deepspeed.utils.groups.mpu = None
    ran = StepsRun()
    trainer = build_tiny_run(args, train_ds, eval_ds, callbacks=[ran], config=config)
    trainer.train()
    trainer.ran = ran.report()  # the step this process began at, and the steps it trained
    return trainer


def losses(trainer: Trainer) -> list[float]:
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def save_weights(trainer: Trainer, path: Path) -> None:
    state = trainer.engine.full_state_dict()  # collective
    if state is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.float().clone() for k, v in state.items()}, path)


def compare_runs(out: Path, scenario: str, config, dataset, runs: dict[str, dict]) -> dict:
    result = {}
    for name, overrides in runs.items():
        trainer = train(out / scenario, name, config, dataset, **overrides)
        pipe = trainer.engine.ds.module if trainer.args.pipeline_parallel_size > 1 else None
        result[name] = {
            "loss": losses(trainer),
            "grad_norm": grad_norms(trainer),
            "ds_config": trainer.ds_config,
            "parts": None if pipe is None else [int(p) for p in pipe.parts],
        }
        save_weights(trainer, out / scenario / f"{name}.pt")
        # predict() on every rank (the pipeline's stages each take their own rows' logits back).
        pred = trainer.predict(dataset.select(range(6)))
        torch.save(
            {"logits": torch.from_numpy(pred.predictions), "labels": torch.from_numpy(pred.label_ids)},
            out / scenario / f"{name}_pred_rank{dist_info().rank}.pt",
        )
    return result


def scenario_llama(out: Path) -> dict:
    """Untied Llama on padded rows; 36 rows make a short last window in each epoch."""
    pp = dict(pipeline_parallel_size=2)
    runs = {
        "base": {},
        "pipe": pp,
        "pipe_ckpt": {**pp, "gradient_checkpointing": True},
        "pipe_zero1_uniform": {**pp, "zero_stage": 1, "deepspeed": {"pipeline": {"partition": "uniform"}}},
    }
    return compare_runs(out, "llama", llama_config(tied=False), padded_dataset(36), runs)


def scenario_gpt2(out: Path) -> dict:
    """Tied GPT-2 on packed rows (fixed shapes, position_ids restarting inside rows)."""
    runs = {"base": {}, "pipe_ckpt": dict(pipeline_parallel_size=2, gradient_checkpointing=True)}
    return compare_runs(out, "gpt2", gpt2_config(), packed_dataset(32), runs)


def scenario_dp(out: Path) -> dict:
    """Four ranks: 2 stages x 2-way data parallelism against 4-way data parallelism."""
    runs = {
        "base": {},
        "pipe": dict(pipeline_parallel_size=2),
        "pipe_zero1": dict(pipeline_parallel_size=2, zero_stage=1),
    }
    return compare_runs(out, "dp", llama_config(tied=True), padded_dataset(40), runs)


def scenario_checkpoint(out: Path) -> dict:
    """Tied Llama, 2 stages: save at step 5, resume to 10, evaluate, export, reload with HF."""
    root = out / "checkpoint"
    train_ds, eval_ds = learnable_dataset(64), learnable_dataset(12)
    pp = dict(pipeline_parallel_size=2, eval_strategy="steps", eval_steps=5, per_device_eval_batch_size=3)
    base = train(
        root, "base", llama_config(tied=True), train_ds, eval_ds, eval_strategy="steps", eval_steps=5
    )
    full = train(
        root, "full", llama_config(tied=True), train_ds, eval_ds, save_strategy="steps", save_steps=5, **pp
    )
    resumed = train(root, "resumed", llama_config(tied=True), train_ds, eval_ds, max_steps=10,
                    resume_from_checkpoint=str(root / "full" / "checkpoint-5"), **pp)  # fmt: skip
    export = root / "export"
    full.save_model(str(export))  # collective
    save_weights(full, root / "full.pt")
    result = {
        "full": losses(full),
        "resumed": [row["loss"] for row in resumed.state.log_history if "loss" in row],
        "resumed_steps": [row["step"] for row in resumed.state.log_history if "loss" in row],
        "resumed_ran": resumed.ran,
        "eval_full": [row["eval_loss"] for row in full.state.log_history if "eval_loss" in row],
        "eval_resumed": [row["eval_loss"] for row in resumed.state.log_history if "eval_loss" in row],
        "eval_base": [row["eval_loss"] for row in base.state.log_history if "eval_loss" in row],
        "base": losses(base),
        "files": sorted(p.name for p in (root / "full" / "checkpoint-5" / "ds").rglob("*") if p.is_file()),
    }
    if dist_info().is_main:
        model = AutoModelForCausalLM.from_pretrained(export).eval()
        batch = CausalLMCollator(0)([eval_ds[i] for i in range(len(eval_ds))])
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"]).logits
        total = causal_lm_loss_sum(logits, batch["labels"]).item()
        result["export_eval_loss"] = total / int((batch["labels"][:, 1:] != -100).sum())
        result["export_keys"] = sorted(model.state_dict())
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, root / "export.pt")
    return result


SCENARIOS = {
    "llama": scenario_llama,
    "gpt2": scenario_gpt2,
    "dp": scenario_dp,
    "checkpoint": scenario_checkpoint,
}


def main() -> None:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out, names = Path(argv[0]), argv[1:]
    init_distributed(detect_hardware())
    results = {name: SCENARIOS[name](out) for name in names}
    barrier("pipeline_scenarios:done")
    if dist_info().is_main:
        (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    exit_now(main())
