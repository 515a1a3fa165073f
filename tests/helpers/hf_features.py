"""HF ``TrainingArguments`` features through the public API, each scenario a few steps of a tiny
Llama on rows of different lengths (so batches carry padding), written as a user writes them.

Usage: ``python tests/helpers/hf_features.py OUT SCENARIO [SCENARIO...]`` (one process, no launcher);
each scenario writes ``OUT/<scenario>.json`` for ``tests/unit/test_hf_features.py`` to read.
Where HF's Trainer is the reference it runs in the same process without DeepSpeed (``use_cpu``),
on the same model, data, order and seed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from tests.helpers.scaffold import read_metrics, weights_equal
from trainer import Trainer, TrainingArguments
from trainer.cli.main import exit_now
from trainer.data import CausalLMCollator, ResumableDistributedSampler

VOCAB, ROWS = 32, 32
SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {}


def scenario(fn: Callable[[Path], dict[str, Any]]) -> Callable[[Path], dict[str, Any]]:
    SCENARIOS[fn.__name__] = fn
    return fn


def model() -> LlamaForCausalLM:
    """The same tiny model every time it is built."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0)  # fmt: skip
    return LlamaForCausalLM(config)


def rows(n: int = ROWS, seed: int = 0) -> datasets.Dataset:
    """Rows of 6 to 24 tokens; row i starts with the token ``1 + i % 31`` (a recorder tells them apart)."""
    g = np.random.default_rng(seed)
    ids = [[1 + i % (VOCAB - 1), *g.integers(1, VOCAB, int(g.integers(5, 24))).tolist()] for i in range(n)]
    return datasets.Dataset.from_dict({"input_ids": ids})


COMMON = dict(max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-2,
              lr_scheduler_type="constant", weight_decay=0.0, logging_steps=1, save_strategy="no", report_to="none",
              disable_tqdm=True, seed=0)  # fmt: skip


def ours(
    out: Path,
    data: datasets.Dataset | None = None,
    callbacks: list | None = None,
    collator: Any = None,
    **fields: Any,
) -> Trainer:
    args = TrainingArguments(output_dir=str(out), **{**COMMON, **fields})
    evals = rows(4, seed=1) if args.eval_strategy != "no" else None
    data = data if data is not None else rows()
    collator = collator or CausalLMCollator(pad_token_id=0)
    return Trainer(model=model(), args=args, train_dataset=data, eval_dataset=evals, data_collator=collator,
                   callbacks=callbacks)  # fmt: skip


class HFTrainer(transformers.Trainer):
    """transformers' Trainer reading the rows in our sampler's order (one process, seed 0)."""

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        return ResumableDistributedSampler(len(self.train_dataset), 1, 0, seed=0)


class Reseed(transformers.TrainerCallback):
    """The torch RNG seeded at each step's start, in both Trainers: NEFTune's noise is its only draw."""

    def on_step_begin(self, args, state, control, **kwargs):
        torch.manual_seed(1000 + state.global_step)


def hf(out: Path, callbacks: list | None = None, **fields: Any) -> HFTrainer:
    args = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, optim="adamw_torch",
                                          **{**COMMON, **fields})  # fmt: skip
    evals = rows(4, seed=1) if args.eval_strategy != "no" else None
    return HFTrainer(
        model=model(),
        args=args,
        train_dataset=rows(),
        eval_dataset=evals,
        data_collator=CausalLMCollator(pad_token_id=0),
        callbacks=callbacks,
    )


def steps(trainer: Any) -> dict[str, list[float]]:
    history = [r for r in trainer.state.log_history if "loss" in r and "grad_norm" in r]
    return {"loss": [r["loss"] for r in history], "grad_norm": [float(r["grad_norm"]) for r in history]}


@scenario
def label_smoothing(out: Path) -> dict[str, Any]:
    """Per-step losses and grad norms of ours and HF's Trainer, label-smoothed, accumulating 2."""
    found = {}
    for factor in (0.0, 0.2):
        theirs = hf(out / f"hf-{factor}", label_smoothing_factor=factor)
        theirs.train()
        mine = ours(out / f"ours-{factor}", label_smoothing_factor=factor)
        mine.train()
        found[str(factor)] = {"hf": steps(theirs), "ours": steps(mine)}
    return found


@scenario
def neftune(out: Path) -> dict[str, Any]:
    """NEFTune on ours and HF's Trainer: per-step losses, grad norms and the evaluations at steps 2
    and 4 (4 rows in one batch, where HF's batch mean is the token mean); the hooks left after training."""
    fields = dict(neftune_noise_alpha=5.0, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8)
    found = {}
    for name, build in (("hf", hf), ("ours", ours)):
        trainer = build(out / name, callbacks=[Reseed()], **fields)
        trainer.train()
        evals = [r["eval_loss"] for r in trainer.state.log_history if "eval_loss" in r]
        hooks = len(trainer.model.get_input_embeddings()._forward_hooks)
        found[name] = {**steps(trainer), "eval_loss": evals, "hooks_after": hooks}
    plain = ours(out / "plain")
    plain.train()
    found["plain"] = steps(plain)
    return found


@scenario
def tokens_seen(out: Path) -> dict[str, Any]:
    """include_num_input_tokens_seen: the count in every logged row (train, eval, the run's summary)
    of ours and HF's Trainer, and in our metrics.jsonl."""
    found: dict[str, Any] = {}
    runs = [("hf", "all"), ("ours", "all"), ("hf", "non_padding"), ("ours", "non_padding"), ("ours", True)]
    for name, mode in runs + [("ours", "no")]:
        trainer = (hf if name == "hf" else ours)(
            out / f"{name}-{mode}", include_num_input_tokens_seen=mode, eval_strategy="steps", eval_steps=2
        )
        trainer.train()
        seen = [r.get("num_input_tokens_seen") for r in trainer.state.log_history]
        found[f"{name}-{mode}"] = {"rows": seen, "keys": [sorted(r) for r in trainer.state.log_history]}
        if name == "ours":
            found[f"{name}-{mode}"]["jsonl"] = [
                row.get("num_input_tokens_seen") for row in read_metrics(out / f"{name}-{mode}")
            ]
    return found


@scenario
def empty_cache(out: Path) -> dict[str, Any]:
    """torch_empty_cache_steps=2 over 5 steps: the steps at which the device cache is emptied (the
    callback's emptying function replaced by a recorder; on a CPU it is a no-op anyway)."""
    from trainer.observe.monitor import EmptyDeviceCache

    trainer = ours(out, torch_empty_cache_steps=2, max_steps=5)
    emptied: list[int] = []
    (callback,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, EmptyDeviceCache)]
    callback.empty = lambda: emptied.append(trainer.state.global_step)
    trainer.train()
    return {"emptied": emptied}


@scenario
def save_only_model(out: Path) -> dict[str, Any]:
    """save_only_model with load_best_model_at_end, under ZeRO 0 and 3: what each checkpoint holds, the
    evaluations, the weights after training against the best checkpoint's (read by transformers'
    from_pretrained and by `trainer export`), and the refused resumes. The higher eval loss ranks best
    here, so the weights reloaded at the end are not the last step's."""
    from trainer.checkpoint import CheckpointError
    from trainer.checkpoint.export import export_checkpoint

    fields = dict(save_only_model=True, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                  load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True)  # fmt: skip
    found: dict[str, Any] = {}
    for stage in (0, 3):
        run = out / f"zero{stage}"
        trainer = ours(run, zero_stage=stage, **fields)
        trainer.train()
        evals = {r["step"]: r["eval_loss"] for r in trainer.state.log_history if "eval_loss" in r}
        best = Path(trainer.state.best_model_checkpoint)
        weights = trainer.engine.full_state_dict()  # gathered under ZeRO-3
        unset_hf_deepspeed_config()  # models built below are whole (ZeRO-3's arguments registered theirs)
        found[f"zero{stage}"] = {
            "evals": evals,
            "best": best.name,
            "eval_after": trainer.evaluate()["eval_loss"],
            "files": {p.name: sorted(f.name for f in p.iterdir()) for p in sorted(run.glob("checkpoint-*"))},
            "from_pretrained_equal": weights_equal(
                LlamaForCausalLM.from_pretrained(best).state_dict(), weights
            ),
            "export_equal": weights_equal(
                LlamaForCausalLM.from_pretrained(
                    export_checkpoint(best, out / f"export{stage}")
                ).state_dict(),
                weights,
            ),
        }
    found["refusals"] = []
    for spec in (str(out / "zero0" / "checkpoint-4"), "auto"):
        try:
            ours(out / "zero0", resume_from_checkpoint=spec, max_steps=6).train()
        except CheckpointError as err:
            found["refusals"].append(str(err))
    return found


@scenario
def callback_states(out: Path) -> dict[str, Any]:
    """restore_callback_states_from_checkpoint with transformers' EarlyStoppingCallback (patience 2, no
    evaluation improves by its threshold): a run stops at step 6 (its evaluations at 2, 4, 6); resumed
    from checkpoint-4 (one evaluation without improvement counted there), where it stops with and
    without the flag, and what the checkpoint's trainer_state.json holds."""
    fields = dict(
        max_steps=10,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        metric_for_best_model="eval_loss",
    )

    def stop(patience: int) -> transformers.EarlyStoppingCallback:
        return transformers.EarlyStoppingCallback(
            early_stopping_patience=patience, early_stopping_threshold=10.0
        )

    first = ours(out / "first", callbacks=[stop(2)], **fields)
    first.train()
    checkpoint = out / "first" / "checkpoint-4"
    found: dict[str, Any] = {"first": first.state.global_step}
    found["saved"] = json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]
    # Restored, the saved callback (patience 2, one bad evaluation) replaces the one passed in (patience 5).
    for name, restore in (("restored", True), ("fresh", False)):
        trainer = ours(out / name, callbacks=[stop(5 if restore else 2)], resume_from_checkpoint=str(checkpoint),
                       restore_callback_states_from_checkpoint=restore, **fields)  # fmt: skip
        trainer.train()
        (callback,) = [
            cb
            for cb in trainer.callback_handler.callbacks
            if isinstance(cb, transformers.EarlyStoppingCallback)
        ]
        found[name] = {"stopped_at": trainer.state.global_step, "patience": callback.early_stopping_patience}
    return found


class Recorder(CausalLMCollator):
    """The collator, noting the rows it batches by their first token (each row's is its own)."""

    def __init__(self) -> None:
        super().__init__(pad_token_id=0)
        self.seen: list[int] = []

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        self.seen += [int(row["input_ids"][0]) for row in batch]
        return super().__call__(batch)


@scenario
def group_by_length(out: Path) -> dict[str, Any]:
    """train_sampling_strategy="group_by_length" with length_column_name: the rows two epochs read,
    uninterrupted and resumed from a checkpoint in the middle of the second, and their lengths as
    the column states them (the reverse of the true lengths, so the column is what counts)."""
    data = rows(24)
    data = data.add_column("n_tokens", [100 - len(ids) for ids in data["input_ids"]])
    fields = dict(train_sampling_strategy="group_by_length", length_column_name="n_tokens", max_steps=12,
                  save_strategy="steps", save_steps=9)  # fmt: skip
    found: dict[str, Any] = {"column": {int(r["input_ids"][0]): r["n_tokens"] for r in data}}
    whole = Recorder()
    ours(out / "whole", data, collator=whole, **fields).train()
    resumed = Recorder()
    ours(out / "resumed", data, collator=resumed, resume_from_checkpoint=str(out / "whole" / "checkpoint-9"),
         **fields).train()  # fmt: skip
    random = Recorder()
    ours(out / "random", data, collator=random, **{**fields, "train_sampling_strategy": "random"}).train()
    return found | {"whole": whole.seen, "resumed": resumed.seen, "random": random.seen}


def compiled_steps(out: Path, backend: str) -> dict[str, Any]:
    """torch_compile through DeepSpeed's engine: per-step losses and grad norms, compiled with
    ``backend`` and not, whether DeepSpeed's engine says it is compiled, and the graphs dynamo
    captured."""
    found: dict[str, Any] = {}
    for name, fields in (
        ("eager", {}),
        ("compiled", {"torch_compile": True, "torch_compile_backend": backend}),
    ):
        trainer = ours(out / name, **fields)
        trainer.train()
        found[name] = {**steps(trainer), "is_compiled": trainer.engine.ds.is_compiled}
    found["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # dynamo's captures
    return found


@scenario
def torch_compile(out: Path) -> dict[str, Any]:
    """aot_eager: dynamo's graphs and AOT autograd's forward and backward, without generating code."""
    return compiled_steps(out, "aot_eager")


@scenario
def torch_compile_inductor(out: Path) -> dict[str, Any]:
    """inductor, the default backend: its kernels are generated and built with the C++ compiler of
    this CPU (about a CPU-minute)."""
    return compiled_steps(out, "inductor")


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    root = Path(argv[0])
    for name in argv[1:]:
        result = SCENARIOS[name](root / name)
        (root / f"{name}.json").write_text(json.dumps(result, indent=1))
    exit_now(0)
