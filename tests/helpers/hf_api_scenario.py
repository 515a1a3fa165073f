"""HF's result API on 2 ranks, written as a user writes it: ``from trainer import Trainer,
TrainingArguments``, then ``main_process_first``, ``train()``'s TrainOutput, ``log_metrics``,
``save_metrics``, ``save_state``, ``evaluate``/``predict`` with ``preprocess_logits_for_metrics``, a
finished run resumed, and HF's evaluation arguments (``include_for_metrics``,
``eval_accumulation_steps``, ``batch_eval_metrics``, ``prediction_loss_only``, a set without labels). Each rank writes what it saw to ``OUT/rank<r>.json``; the test compares.
Usage: ``deepspeed --num_gpus 2 tests/helpers/hf_api_scenario.py OUT``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.trainer_utils import EvalPrediction, PredictionOutput, TrainOutput

import trainer.loop.predictions
from trainer import Trainer, TrainingArguments
from trainer.data import CausalLMCollator
from trainer.engine import causal_lm_loss_sum
from trainer.observe.throughput import flops_per_token_for_model

out = Path([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])
args = TrainingArguments(
    output_dir=str(out / "run"),
    max_steps=4,
    per_device_train_batch_size=2,
    per_device_eval_batch_size=4,
    logging_steps=1,
    learning_rate=1e-3,
    lr_scheduler_type="constant",
    save_strategy="steps",
    save_steps=4,
    disable_tqdm=True,
    seed=0,
)
rank = args.process_index

# Before any Trainer exists: the arguments join the process group and rank 0 goes first.
with args.main_process_first(desc="prepare data"):
    with (out / "order.txt").open("a") as f:
        f.write(f"enter {rank}\n")
    if rank == 0:
        time.sleep(1.0)  # without the barrier, rank 1 would enter meanwhile
    with (out / "order.txt").open("a") as f:
        f.write(f"exit {rank}\n")

# 32 rows of 24 tokens (every step has the same number of target tokens); 13 rows of 8-32 tokens
# to predict (rank 1's shard is padded with a masked row, batches have different widths).
train = datasets.Dataset.from_dict({"input_ids": [[(i + k) % 16 + 1 for k in range(24)] for i in range(32)]})
g = torch.Generator().manual_seed(4)
lengths = [int(n) for n in torch.randint(8, 33, (13,), generator=g)]
test = datasets.Dataset.from_dict(
    {"input_ids": [torch.randint(1, 256, (n,), generator=g).tolist() for n in lengths]}
)

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False,
)  # fmt: skip
model = LlamaForCausalLM(config)

seen: list[dict] = []  # what preprocess_logits_for_metrics got, on this rank
metric_inputs: list[str] = []


def argmax(logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    shape = None if labels is None else list(labels.shape)
    seen.append({"logits": list(logits.shape), "labels": shape, "dtype": str(logits.dtype)})
    return logits.argmax(-1)


def accuracy(p: EvalPrediction) -> dict:
    metric_inputs.append(f"{type(p).__module__}.{type(p).__name__}")
    preds, labels = p.predictions[:, :-1], p.label_ids[:, 1:]
    mask = labels != -100
    return {"accuracy": np.float32((preds[mask] == labels[mask]).mean())}


gathered: list[list[str]] = []  # (shape, dtype) of the predictions this rank sent to the gather
_gather = trainer.loop.predictions.all_gather_object


def recording_gather(parts):
    gathered.append([f"{np.shape(p['predictions'])}:{np.asarray(p['predictions']).dtype}" for p in parts])
    return _gather(parts)


trainer.loop.predictions.all_gather_object = recording_gather

hf = Trainer(
    model=model,
    args=args,
    train_dataset=train,
    eval_dataset=test,
    data_collator=CausalLMCollator(0),
    compute_metrics=accuracy,
    preprocess_logits_for_metrics=argmax,
)
result = hf.train()
hf.log_metrics("train", result.metrics)
hf.save_metrics("train", result.metrics)
eval_metrics = hf.evaluate()
hf.log_metrics("eval", eval_metrics)
hf.save_metrics("eval", eval_metrics)
hf.save_state()
hf.save_metrics("probe", {"rank": rank}, combined=False)  # only rank 0's may land
seen_by_evaluate = list(seen)
pred = hf.predict(test)
seen_by_predict, gathered_by_predict = list(seen), list(gathered)
state_log = list(hf.state.log_history)

# The reference: each row alone through the trained model (ZeRO-0: every rank holds it whole).
hf.model.eval()
ref_sums, ref_preds = [], []
with torch.no_grad():
    for row in test["input_ids"]:
        ids = torch.tensor([row])
        logits = hf.model(input_ids=ids).logits[0]
        ref_sums.append(torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum").item())
        ref_preds.append(logits.argmax(-1).tolist())
ref_loss, ref_targets = sum(ref_sums), sum(len(row) - 1 for row in test["input_ids"])

resumed = hf.train(resume_from_checkpoint=True)  # checkpoint-4 ends the run: nothing to train


# HF's evaluation arguments, set on the Trainer's arguments as a script would.
class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, p, compute_result=None):
        rows = {"labels": np.asarray(p.label_ids).tolist(), "compute_result": compute_result,
                "tensors": isinstance(p.predictions, torch.Tensor)}  # fmt: skip
        if p.inputs is not None:
            rows["inputs"] = np.asarray(p.inputs).tolist()
        if p.losses is not None:
            rows["losses"] = np.asarray(p.losses).tolist()
        self.calls.append(rows)
        return {"calls": len(self.calls)}


options = {}
hf.compute_metrics = included = Recorder()
hf.args.include_for_metrics, hf.args.eval_accumulation_steps = ["inputs", "loss"], 1
found = hf.predict(test)
options["include"] = {
    "calls": included.calls,
    "same": found.predictions.tolist() == pred.predictions.tolist(),
}
hf.args.include_for_metrics, hf.args.eval_accumulation_steps = [], None
hf.compute_metrics, hf.args.batch_eval_metrics = (batched := Recorder()), True
metrics = hf.evaluate()
found = hf.predict(test)
options["batch"] = {"calls": batched.calls, "eval_calls": metrics["eval_calls"], "predict_kept":
                    found.predictions.tolist() == pred.predictions.tolist()}  # fmt: skip
hf.args.batch_eval_metrics, hf.args.prediction_loss_only = False, True
found = hf.predict(test)
options["loss_only"] = {
    "none": found.predictions is None and found.label_ids is None,
    "metrics": found.metrics,
}
hf.args.prediction_loss_only = False


def unlabelled(rows):  # a collator that makes no labels: predicting on a test set
    width = max(len(r["input_ids"]) for r in rows)
    pads = [width - len(r["input_ids"]) for r in rows]
    ids = [list(r["input_ids"]) + [0] * n for r, n in zip(rows, pads, strict=True)]
    mask = [[1] * (width - n) + [0] * n for n in pads]
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


hf.data_collator = unlabelled
found = hf.predict(test)
options["no_labels"] = {"labels": found.label_ids, "metrics": found.metrics,
                        "same": found.predictions.tolist() == pred.predictions.tolist()}  # fmt: skip


# compute_loss overrides with HF's signature, on uneven rows (padding) with accumulation: the loss
# written by hand over num_items_in_batch, and one through super(). Each must train what the
# built-in loss trains.
class HandLoss(Trainer):
    items: list[list[float]] = []  # (num_items_in_batch, this batch's targets) of each call

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        )
        self.items.append([float(num_items_in_batch), float((labels[:, 1:] != -100).sum())])
        loss = loss / num_items_in_batch
        return (loss, outputs) if return_outputs else loss


class SuperLoss(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        assert outputs.logits.shape[:2] == inputs["input_ids"].shape
        return (loss, outputs) if return_outputs else loss


def loss_run(cls, name):
    torch.manual_seed(0)
    run_args = TrainingArguments(
        output_dir=str(out / name), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        logging_steps=1, learning_rate=1e-2, lr_scheduler_type="constant", save_strategy="no",
        disable_tqdm=True, seed=0, report_to="none",
    )  # fmt: skip
    t = cls(model=LlamaForCausalLM(config), args=run_args, train_dataset=uneven, eval_dataset=test,
            data_collator=CausalLMCollator(0))  # fmt: skip
    t.train()
    losses = [r["loss"] for r in t.state.log_history if "loss" in r]
    weights = torch.cat([p.detach().flatten() for p in t.model.parameters()]).tolist()[::97]
    eval_loss = t.evaluate()["eval_loss"]
    t.model.eval()
    with torch.no_grad():  # each test row's summed token loss, alone through the trained model
        sums = [float(causal_lm_loss_sum(t.model(input_ids=torch.tensor([r])).logits, torch.tensor([r])))
                for r in test["input_ids"]]  # fmt: skip
    return {"losses": losses, "eval_loss": eval_loss, "weights": weights, "row_sums": sums}


uneven = test.select(list(range(13)) * 2)  # 26 rows of 8-32 tokens: 2 windows of 2 x 2 rows per rank
compute_loss_runs = {name: loss_run(cls, name) for name, cls in
                     [("builtin", Trainer), ("hand", HandLoss), ("super", SuperLoss)]}  # fmt: skip
compute_loss_runs["hand_items"] = HandLoss.items

report = {
    "compute_loss": compute_loss_runs,
    "is_train_output": isinstance(result, TrainOutput),
    "train_output": [result.global_step, result.training_loss, result.metrics],
    "state_global_step": hf.state.global_step,
    "state_epoch": hf.state.epoch,
    "log_history": state_log,
    "flops_per_token": flops_per_token_for_model(hf.model, 24),
    "eval_metrics": eval_metrics,
    "is_prediction_output": isinstance(pred, PredictionOutput),
    "predictions": pred.predictions.tolist(),
    "predictions_dtype": str(pred.predictions.dtype),
    "label_ids": pred.label_ids.tolist(),
    "predict_metrics": pred.metrics,
    "preprocess_seen": seen_by_predict,
    "preprocess_calls_in_evaluate": len(seen_by_evaluate),
    "gathered": gathered_by_predict,
    "options": options,
    "metric_inputs": metric_inputs,
    "reference": {
        "loss": ref_loss / ref_targets,
        "predictions": ref_preds,
        "rows": list(test["input_ids"]),
        "sums": ref_sums,
    },  # fmt: skip
    "resumed": {"is_train_output": isinstance(resumed, TrainOutput), "output": list(resumed)},
    "is_world_process_zero": hf.is_world_process_zero(),
    "is_local_process_zero": hf.is_local_process_zero(),
    "args": {
        "process_index": args.process_index,
        "local_process_index": args.local_process_index,
        "world_size": args.world_size,
        "should_log": args.should_log,
        "should_save": args.should_save,
        "n_gpu": args.n_gpu,
        "device": str(args.device),
        "parallel_mode": args.parallel_mode.value,
    },
}
(out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
