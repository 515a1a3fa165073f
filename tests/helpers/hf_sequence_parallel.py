"""Sequence parallelism through the HF-style API, written as a user writes it: a Llama built from its
config, a dataset of token rows, ``TrainingArguments(sequence_parallel_size=N)``, ``train()`` and
``evaluate()``. The rows and their vocabulary size are read from ``ROWS`` (JSON: ``rows``, a list of
token-id lists, and ``vocab_size``; the same file for every run compared). Writes the logged losses, the grad norms and the eval loss to ``OUT/rank<r>.json``.
Usage: ``deepspeed --num_gpus 2 tests/helpers/hf_sequence_parallel.py ROWS OUT 2`` (or ``python ... ROWS OUT 1``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer import Trainer, TrainingArguments

rows_file, out, size = (a for a in sys.argv[1:] if not a.startswith("--local_rank"))
args = TrainingArguments(
    output_dir=str(Path(out) / "run"),
    sequence_parallel_size=int(size),
    deepspeed={"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"},
    max_steps=3,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    logging_steps=1,
    learning_rate=3e-3,
    save_strategy="no",
    disable_tqdm=True,
    seed=0,
)
torch.manual_seed(0)
tokens = json.loads(Path(rows_file).read_text())
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=tokens["vocab_size"], max_position_embeddings=1024)  # fmt: skip
model = LlamaForCausalLM(config)
data = datasets.Dataset.from_dict({"input_ids": tokens["rows"], "labels": tokens["rows"]})
trainer = Trainer(
    model=model, args=args, train_dataset=data.select(range(12)), eval_dataset=data.select(range(12, 16))
)
trainer.train()
metrics = trainer.evaluate()
logged = [row for row in trainer.state.log_history if "loss" in row]
Path(out, f"rank{args.process_index}.json").write_text(
    json.dumps({
        "losses": [row["loss"] for row in logged],
        "grad_norms": [row["grad_norm"] for row in logged],
        "eval_loss": metrics["eval_loss"],
    })
)  # fmt: skip
