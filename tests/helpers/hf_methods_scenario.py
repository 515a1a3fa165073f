"""HF's Trainer methods beyond the loop on 2 ranks, called as a user calls them: the loaders
(before training, against the batches the loop and the evaluations then forward), ``log`` during
and after training, the callbacks list, the optimizer and scheduler (after training, and built before
it), the model card of the run, and the refusals. Each rank writes what it saw to
``OUT/rank<r>.json``; tests/distributed/test_hf_methods.py compares.
Usage: ``deepspeed --num_gpus 2 tests/helpers/hf_methods_scenario.py OUT``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import numpy as np
import torch
from transformers import LlamaForCausalLM
from transformers.trainer_utils import EvalPrediction

from tests.helpers.trainer_scenarios import VOCAB, tiny_config
from trainer import Trainer, TrainingArguments
from trainer.cli.main import exit_now
from trainer.data import CausalLMCollator
from trainer.loop.callbacks import MetricsCallback, ProgressCallback, TrainerCallback
from trainer.runtime.distributed import barrier

KEYS = ("input_ids", "attention_mask", "labels")


def schedule_length(scheduler) -> int:
    """The steps a schedule spans: DeepSpeed's (a named scheduler) or transformers' (a LambdaLR)."""
    if hasattr(scheduler, "total_num_steps"):
        return scheduler.total_num_steps
    return scheduler.lr_lambdas[0].keywords["num_training_steps"]


def rows(n: int, seed: int, first_is_index: bool = False) -> datasets.Dataset:
    """Rows of 8-32 tokens; with ``first_is_index`` a row's first token is its index + 1, so a
    batch says which rows it holds."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for i in range(n):
        row = torch.randint(1, VOCAB, (int(torch.randint(8, 33, (1,), generator=g)),), generator=g).tolist()
        ids.append([i + 1, *row[1:]] if first_is_index else row)
    return datasets.Dataset.from_dict({"input_ids": ids})


def plain(batch: dict) -> dict:
    return {k: batch[k].tolist() for k in KEYS}


class Forwards(TrainerCallback):
    """What the engine is given, by phase: each training window's micro-batches, and each
    evaluation forward's batch (``engine.eval_step``: evaluate and predict)."""

    def __init__(self) -> None:
        self.phase = "train"
        self.windows: list[list[dict]] = []
        self.evals: dict[str, list[dict]] = {}
        self.wrapped = False

    def on_train_begin(self, args, state, control, engine=None, **kw):
        if self.wrapped:
            return
        self.wrapped = True
        train_window, eval_step = engine.train_window, engine.eval_step

        def recording_window(window, tokens):
            self.windows.append([plain(b) for b in window])
            return train_window(window, tokens)

        def recording_eval_step(batch, outputs=False):
            self.evals.setdefault(self.phase, []).append(plain(batch))
            return eval_step(batch, outputs=outputs)

        engine.train_window, engine.eval_step = recording_window, recording_eval_step

    def on_step_end(self, args, state, control, **kw):
        self.phase = f"eval@{state.global_step}"


class LogAtStep(TrainerCallback):
    """Calls ``Trainer.log`` from inside training (as a custom loss or callback would), and keeps
    the logs every ``on_log`` was given."""

    def __init__(self, step: int) -> None:
        self.step, self.trainer, self.seen = step, None, []

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            self.trainer.log({"during_training": float(self.step)})

    def on_log(self, args, state, control, logs=None, **kw):
        self.seen.append(dict(logs))


def accuracy(p: EvalPrediction) -> dict:
    preds, labels = p.predictions[:, :-1], p.label_ids[:, 1:]
    mask = labels != -100
    return {"accuracy": float((preds[mask] == labels[mask]).mean())}


def refusal(call) -> str:
    try:
        call()
    except (NotImplementedError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def main() -> None:
    out = Path([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])
    report: dict = {}
    args = TrainingArguments(
        output_dir=str(out / "run"), max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        per_device_eval_batch_size=4, logging_steps=1, eval_strategy="steps", eval_steps=2, save_strategy="no",
        learning_rate=1e-3, lr_scheduler_type="constant", zero_stage=1, disable_tqdm=True, seed=0,
        report_to="none",
    )  # fmt: skip
    rank = args.process_index
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config())
    model.config._name_or_path = "org/tiny-base"  # as if loaded from the hub: the card's default base
    forwards, log_at = Forwards(), LogAtStep(3)
    train_ds, eval_ds, test_ds = rows(40, 1, first_is_index=True), rows(13, 2), rows(9, 3)
    t = Trainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                data_collator=CausalLMCollator(0), compute_metrics=accuracy,
                preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
                callbacks=[forwards, log_at])  # fmt: skip
    log_at.trainer = t

    # ---- the loaders, before training -----------------------------------------------------------
    train_dl = t.get_train_dataloader()
    report["train_loader"] = {
        "indices": list(train_dl.sampler),
        "batches": [plain(b) for b in train_dl],
        "num_examples": t.num_examples(train_dl),
        "num_tokens": t.num_tokens(train_dl),
        "num_tokens_3": t.num_tokens(train_dl, max_steps=3),
    }
    eval_dl = t.get_eval_dataloader()
    report["eval_loader"] = {
        "batches": [plain(b) for b in eval_dl],
        "indices": eval_dl.dataset.indices,
        "num_examples": t.num_examples(eval_dl),
    }
    report["eval_row0"] = eval_ds[0]["input_ids"]
    test_dl = t.get_test_dataloader(test_ds)
    report["test_loader"] = {
        "batches": [plain(b) for b in test_dl],
        "indices": test_dl.dataset.indices,
        "num_examples": t.num_examples(test_dl),
    }

    t.train()
    forwards.phase = "evaluate"
    eval_metrics = t.evaluate()
    forwards.phase = "predict"
    t.predict(test_ds)
    report["windows"], report["forwards"] = forwards.windows, forwards.evals
    report["eval_metrics"] = eval_metrics

    # ---- log, and the callbacks list ----------------------------------------------------------
    t.log({"after_training": 2.5})
    metrics_cb = t.pop_callback(MetricsCallback)
    t.log({"without_writer": 1.0})  # in the history, not in metrics.jsonl
    t.add_callback(metrics_cb)
    t.log({"writer_back": 1.0})
    t.remove_callback(ProgressCallback)
    report["callbacks"] = [type(cb).__name__ for cb in t.callback_handler.callbacks]
    report["popped_is_instance"] = isinstance(metrics_cb, MetricsCallback)
    report["pop_absent"] = type(t.pop_callback(ProgressCallback)).__name__  # NoneType: none was left
    report["on_log_seen"] = log_at.seen
    report["state_epoch"] = t.state.epoch

    # ---- optimizer and scheduler of a built engine ----------------------------------------------
    engine = t.engine
    t.create_optimizer_and_scheduler(100)
    report["optimizer"] = {
        "create_optimizer_is_engines": t.create_optimizer() is engine.optimizer is t.optimizer,
        "create_scheduler_is_engines": t.create_scheduler(100) is engine.lr_scheduler is t.lr_scheduler,
        "engine_kept": t.engine is engine,
        "other_model": refusal(lambda: t.create_optimizer(LlamaForCausalLM(tiny_config()))),
        "other_optimizer": refusal(
            lambda: t.create_scheduler(10, torch.optim.SGD(model.parameters(), lr=0.1))
        ),
    }
    report["refusals"] = {"push_to_hub": refusal(t.push_to_hub),
                          "hyperparameter_search": refusal(t.hyperparameter_search)}  # fmt: skip

    # ---- the model card: rank 1's call writes nothing; rank 0's keeps a card's tags --------------
    card = Path(args.output_dir) / "README.md"
    if rank == 1:
        t.create_model_card(model_name="from-rank-1")
    barrier("card1")
    report["card_after_rank1"] = card.exists()
    barrier("card_checked")
    if rank == 0:
        card.write_text("---\ntags:\n- kept-tag\n---\nan older card\n")
        t.create_model_card(language="en", license="apache-2.0", tags="tiny", dataset_tags="toy-corpus",
                            dataset="toy corpus")  # fmt: skip
    barrier("card0")
    report["log_history"] = t.state.log_history

    # ---- an engine built before train(): create_optimizer_and_scheduler's schedule is kept --------
    early_args = TrainingArguments(
        output_dir=str(out / "early"), max_steps=4, per_device_train_batch_size=2, logging_steps=1,
        save_strategy="no", learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2, disable_tqdm=True,
        seed=0,
        report_to="none",
    )  # fmt: skip
    early = Trainer(model=LlamaForCausalLM(tiny_config()), args=early_args, train_dataset=train_ds,
                    data_collator=CausalLMCollator(0))  # fmt: skip
    early.create_optimizer_and_scheduler(num_training_steps=8)
    built = early.engine
    early.train()
    report["early"] = {
        "engine_kept": early.engine is built is not None,
        "total_num_steps": schedule_length(early.lr_scheduler),
        "learning_rates": [r["learning_rate"] for r in early.state.log_history if "loss" in r],
    }
    # create_optimizer alone: the engine's schedule is the run's planned length (HF's default 3 epochs).
    planned_args = TrainingArguments(
        output_dir=str(out / "planned"), per_device_train_batch_size=2, save_strategy="no",
        learning_rate=1e-2, lr_scheduler_type="linear", weight_decay=0.1, disable_tqdm=True, seed=0,
        report_to="none",
    )  # fmt: skip
    planned = Trainer(model=LlamaForCausalLM(tiny_config()), args=planned_args, train_dataset=train_ds,
                      data_collator=CausalLMCollator(0))  # fmt: skip
    optimizer = planned.create_optimizer()
    report["planned"] = {
        "is_engines": optimizer is planned.engine.optimizer,
        "total_num_steps": schedule_length(planned.lr_scheduler),
        "decay_names": planned.get_decay_parameter_names(planned.model),
        "param_groups": [
            {"weight_decay": g["weight_decay"], "numel": sum(int(p.numel()) for p in g["params"])}
            for g in planned.optimizer.param_groups
        ],
        "numels": {n: int(p.numel()) for n, p in planned.model.named_parameters()},
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1, default=_json))


def _json(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(type(value))


if __name__ == "__main__":
    exit_now(main())
