"""Models that are not causal LMs, trained through the public API as a user writes it:
``Trainer(model=..., args=TrainingArguments(...), train_dataset=..., eval_dataset=...)`` with HF's
collators, under one ZeRO stage per run. Each model trains 3 steps, evaluates and predicts; rank 0
writes what it saw to ``OUT/<task>-zero<stage>.json``.

Usage: ``[torchrun --nproc_per_node 2] tests/helpers/any_model_scenario.py OUT GRAD_ACC STAGE:TASK[,TASK...] ...``.
One process with twice the accumulation steps of two ranks sees the same micro-batches (one row
each) in each step, so both runs must log the same losses and gradient norms.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import numpy as np
import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForTokenClassification,
    DataCollatorForSeq2Seq,
    DataCollatorWithPadding,
    LlamaConfig,
    LlamaForSequenceClassification,
    T5Config,
    T5ForConditionalGeneration,
    ViTConfig,
    ViTForImageClassification,
    default_data_collator,
)

from trainer import Trainer, TrainingArguments
from trainer.cli.main import exit_now

VOCAB, ROWS = 48, 16


class Pad:
    """A tokenizer's padding face, all HF's padding collators need (``pad`` on lists of ids)."""

    pad_token_id, padding_side, model_input_names = 0, "right", ["input_ids", "attention_mask"]

    def pad(self, rows, padding=True, max_length=None, pad_to_multiple_of=None, return_tensors="pt", **_):
        width = max(len(r["input_ids"]) for r in rows)
        out = {"input_ids": [], "attention_mask": []}
        for r in rows:
            n = len(r["input_ids"])
            out["input_ids"].append(list(r["input_ids"]) + [0] * (width - n))
            out["attention_mask"].append([1] * n + [0] * (width - n))
        extra = {k: [r[k] for r in rows] for k in rows[0] if k not in out}
        return {k: torch.tensor(v) for k, v in {**out, **extra}.items()}


def ids(g: np.random.Generator, n: int) -> list[int]:
    return g.integers(2, VOCAB, n).tolist()


def task(name: str):
    """(model, train set, collator) of one task: tiny models built from their configs, local data."""
    g = np.random.default_rng(0)
    torch.manual_seed(0)
    lengths = g.integers(4, 12, ROWS)
    text = [ids(g, int(n)) for n in lengths]
    llama = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2, pad_token_id=0)  # fmt: skip
    # No dropout: one process and two ranks draw different masks for the same row.
    bert = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=32, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)  # fmt: skip
    if name == "single_label":
        model = LlamaForSequenceClassification(LlamaConfig(num_labels=3, **llama))
        rows = {"input_ids": text, "label": g.integers(0, 3, ROWS).tolist()}
        return model, rows, DataCollatorWithPadding(Pad())
    if name == "multi_label":
        config = LlamaConfig(num_labels=3, problem_type="multi_label_classification", **llama)
        rows = {"input_ids": text, "label": g.integers(0, 2, (ROWS, 3)).astype(np.float32).tolist()}
        return LlamaForSequenceClassification(config), rows, DataCollatorWithPadding(Pad())
    if name == "regression":
        model = LlamaForSequenceClassification(LlamaConfig(num_labels=1, **llama))
        rows = {"input_ids": text, "label": g.normal(size=ROWS).astype(np.float32).tolist()}
        return model, rows, DataCollatorWithPadding(Pad())
    if name == "token_classification":
        model = BertForTokenClassification(BertConfig(num_labels=5, **bert))
        labels = [g.integers(0, 5, len(t)).tolist() for t in text]
        width = max(map(len, text))
        rows = {
            "input_ids": [t + [0] * (width - len(t)) for t in text],
            "attention_mask": [[1] * len(t) + [0] * (width - len(t)) for t in text],
            "labels": [x + [-100] * (width - len(x)) for x in labels],
        }
        return model, rows, default_data_collator
    if name == "masked_lm":
        model = BertForMaskedLM(BertConfig(**bert))
        width = max(map(len, text))
        # At least one masked token a row: a row's mean loss over no tokens is 0/0.
        masked = [[t if k == 0 or g.random() < 0.3 else -100 for k, t in enumerate(row)] for row in text]
        hidden = [
            [1 if m != -100 else t for t, m in zip(r, mr, strict=True)]
            for r, mr in zip(text, masked, strict=True)
        ]
        rows = {
            "input_ids": [r + [0] * (width - len(r)) for r in hidden],
            "attention_mask": [[1] * len(t) + [0] * (width - len(t)) for t in text],
            "labels": [m + [-100] * (width - len(m)) for m in masked],
        }
        return model, rows, default_data_collator
    if name == "seq2seq":
        config = T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2,
                          decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)  # fmt: skip
        targets = [ids(g, int(n)) for n in g.integers(2, 6, ROWS)]
        rows = {"input_ids": text, "attention_mask": [[1] * len(t) for t in text], "labels": targets}
        model = T5ForConditionalGeneration(config)
        return model, rows, DataCollatorForSeq2Seq(Pad(), model=model)
    if name == "image_classification":
        config = ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_labels=4)  # fmt: skip
        pixels = g.normal(size=(ROWS, 3, 16, 16)).astype(np.float32)
        rows = {"pixel_values": pixels.tolist(), "label": g.integers(0, 4, ROWS).tolist()}
        return ViTForImageClassification(config), rows, default_data_collator
    raise ValueError(name)


TASKS = ["single_label", "multi_label", "regression", "token_classification", "masked_lm", "seq2seq",
         "image_classification"]  # fmt: skip


def run(out: Path, name: str, grad_acc: int, stage: int) -> None:
    zero = {"stage": stage} | ({"stage3_gather_16bit_weights_on_model_save": True} if stage == 3 else {})
    args = TrainingArguments(
        output_dir=str(out / f"{name}-zero{stage}"),
        max_steps=3,
        per_device_train_batch_size=1,
        per_device_eval_batch_size=1,  # HF weights batch means by rows: one row a batch, any layout
        gradient_accumulation_steps=grad_acc,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        deepspeed={
            "zero_optimization": zero,
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
        },  # fmt: skip
    )
    # Built after the arguments, as a user's script does: under ZeRO-3 their config is registered, so
    # a model built directly (its body by from_config, partitioned) is built on every rank.
    model, rows, collator = task(name)
    data = datasets.Dataset.from_dict(rows).with_format("torch" if name == "image_classification" else None)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data, data_collator=collator)
    trainer.train()
    metrics = trainer.evaluate()
    predictions = trainer.predict(data.select(range(5)))
    if trainer.is_world_process_zero():
        history = [r for r in trainer.state.log_history if "loss" in r and "grad_norm" in r]
        first = predictions.predictions
        first = first[0] if isinstance(first, tuple) else first
        (out / f"{name}-zero{stage}.json").write_text(json.dumps({
            "loss": [r["loss"] for r in history],
            "grad_norm": [r["grad_norm"] for r in history],
            "eval_loss": metrics["eval_loss"],
            "prediction_shape": list(np.shape(first)),
            "label_shape": list(np.shape(predictions.label_ids)),
        }))  # fmt: skip


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out, grad_acc = Path(argv[0]), int(argv[1])
    for spec in argv[2:]:
        stage, names = spec.split(":")
        for name in names.split(","):
            run(out, name, grad_acc, int(stage))  # its Trainer, arguments and ZeRO-3 registration go here
    exit_now(0)
