"""HF ``TrainingArguments`` fields with an effect of their own, on our Trainer and transformers' in one
process (plain python, a world of one): a few steps of the tiny Llama of tests/helpers/hf_features.py
on rows of different lengths, each starting with its own index + 1, so a recording collator sees
the order they were read in.

Usage: ``python tests/helpers/hf_fields_scenario.py OUT``; writes ``OUT/results.json`` for
``tests/unit/test_hf_fields_behaviour.py``. The first Trainer built here starts the process group,
so ``ddp_timeout`` is read from that group.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import HfArgumentParser
from transformers.utils import logging as hf_logging

from tests.helpers.hf_features import VOCAB, model
from trainer import Trainer, TrainingArguments
from trainer.data import CausalLMCollator

ROWS = 10
WEIGHTS = "weights.safetensors"
COMMON = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=1e-2,
              lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
              disable_tqdm=True, seed=0)  # fmt: skip


def rows(n: int = ROWS, seed: int = 0) -> datasets.Dataset:
    """Rows of 6 to 15 tokens; row i starts with token i + 1."""
    g = np.random.default_rng(seed)
    ids = [[i + 1, *g.integers(1, VOCAB, int(g.integers(5, 15))).tolist()] for i in range(n)]
    return datasets.Dataset.from_dict({"input_ids": ids})


class Recording(CausalLMCollator):
    """Pads as ours does, and records the rows of every batch it makes (their indices)."""

    def __init__(self) -> None:
        super().__init__(pad_token_id=0)
        self.batches: list[list[int]] = []

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        self.batches.append([int(f["input_ids"][0]) - 1 for f in features])
        return super().__call__(features)


def build(kind: str, out: Path, eval_rows: int = 0, **fields: Any) -> Any:
    """Our Trainer (``kind="ours"``) or transformers' (``"hf"``, on the CPU with torch's AdamW, what
    ours runs for ``adamw_torch``) on the same model, data and seed, with ``fields`` set."""
    values = {"output_dir": str(out / kind), **COMMON, **fields}
    if kind == "ours":
        args, cls = TrainingArguments(**values), Trainer
    else:
        args = transformers.TrainingArguments(use_cpu=True, optim="adamw_torch", **values)
        cls = transformers.Trainer
    evals = rows(eval_rows, seed=1) if eval_rows else None
    return cls(model=model(), args=args, train_dataset=rows(), eval_dataset=evals, data_collator=Recording())


def trained(kind: str, out: Path, **fields: Any) -> dict[str, Any]:
    """Train; the steps' losses and grad norms, the batches read (the first ``global_step``: both
    Trainers read one ahead) and the optimizer's eps. The final weights go to
    ``<output_dir>/weights.safetensors``."""
    trainer = build(kind, out, **fields)
    trainer.train()
    history = [r for r in trainer.state.log_history if "loss" in r and "grad_norm" in r]
    weights = trainer.engine.full_state_dict() if kind == "ours" else trainer.model.state_dict()
    save_file({k: v.contiguous() for k, v in weights.items()}, Path(trainer.args.output_dir, WEIGHTS))
    return {
        "steps": trainer.state.global_step,
        "loss": [r["loss"] for r in history],
        "grad_norm": [float(r["grad_norm"]) for r in history],
        "batches": trainer.data_collator.batches[: trainer.state.global_step],
        "eps": sorted({g["eps"] for g in trainer.optimizer.param_groups}),
    }


def dataloader_drop_last_eval(out: Path) -> dict[str, Any]:
    """10 evaluation rows in batches of 4, untrained: evaluate and predict read the last batch of 2,
    or leave it out, as the flag says."""
    found: dict[str, Any] = {}
    for drop in (False, True):
        for kind in ("ours", "hf"):
            trainer = build(kind, out / f"eval-drop-{drop}", eval_rows=ROWS, dataloader_drop_last=drop)
            loss = trainer.evaluate()["eval_loss"]
            batches = list(trainer.data_collator.batches)
            predicted = trainer.predict(trainer.eval_dataset)
            found.setdefault(f"{drop}", {})[kind] = {
                "eval_loss": loss,
                "batches": batches,
                "predict_loss": predicted.metrics["test_loss"],
                "predicted_rows": len(predicted.predictions),
                "first_8_loss": trainer.evaluate(trainer.eval_dataset.select(range(8)))["eval_loss"],
            }
    return found


def data_seed(out: Path) -> dict[str, Any]:
    """Two steps with data_seed 7, ours and HF's, and ours without (the order from seed 0); with
    each, the torch RNG's first draws once the Trainer is built (what a model built then would
    start from). The first of our Trainers also sets ddp_timeout, read back from the process group
    it starts."""
    found: dict[str, Any] = {}
    for name, kind, fields in (("ours-7", "ours", {"data_seed": 7, "ddp_timeout": 1234}),
                               ("hf-7", "hf", {"data_seed": 7}), ("ours-none", "ours", {})):  # fmt: skip
        trainer = build(kind, out / name, max_steps=2, **fields)
        draw = torch.rand(4).tolist()
        if name == "ours-7":
            group = torch.distributed.distributed_c10d._get_default_group()
            found["ddp_timeout"] = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        trainer.train()
        history = [r["loss"] for r in trainer.state.log_history if "loss" in r and "grad_norm" in r]
        found[name] = {"batches": trainer.data_collator.batches[:2], "loss": history, "draw": draw}
    return found


def dataloader_drop_last(out: Path) -> dict[str, Any]:
    """One epoch of 10 rows in batches of 4, the last partial batch kept or dropped."""
    return {
        f"{drop}": {k: trained(k, out / f"drop-{drop}", num_train_epochs=1, dataloader_drop_last=drop)
                    for k in ("ours", "hf")}
        for drop in (False, True)
    }  # fmt: skip


def adam_epsilon(out: Path) -> dict[str, Any]:
    """Three steps with eps 0.1 (larger than the gradients, so it damps the update), ours and HF's,
    and ours at the default eps."""
    found = {k: trained(k, out / "eps", max_steps=3, adam_epsilon=0.1) for k in ("ours", "hf")}
    return found | {"default": trained("ours", out / "eps-default", max_steps=3)}


def evaluated(kind: str, out: Path, **fields: Any) -> dict[str, Any]:
    """evaluate() and predict() on 6 rows with a compute_metrics that counts its calls."""
    calls: list[int] = []
    trainer = build(kind, out, eval_rows=6, **fields)
    trainer.compute_metrics = lambda p: calls.append(1) or {"rows": float(len(p.predictions))}
    metrics = trainer.evaluate()
    predicted = trainer.predict(rows(6, seed=1))
    timing = ("runtime", "per_second")
    return {
        "eval": {k: v for k, v in metrics.items() if not any(t in k for t in timing)},
        "test": {k: v for k, v in predicted.metrics.items() if not any(t in k for t in timing)},
        "predictions": None if predicted.predictions is None else list(np.shape(predicted.predictions)),
        "label_ids": None if predicted.label_ids is None else list(np.shape(predicted.label_ids)),
        "compute_metrics_calls": len(calls),
    }


def prediction_loss_only(out: Path) -> dict[str, Any]:
    return {
        f"{only}": {k: evaluated(k, out / f"plo-{only}", prediction_loss_only=only) for k in ("ours", "hf")}
        for only in (False, True)
    }


def full_determinism(out: Path) -> dict[str, Any]:
    """The global switches and the RNG right after each Trainer is built with full_determinism on
    (seed 5), then off; each is undone before the next."""
    found = {}
    for kind, on in (("ours", True), ("hf", True), ("ours", False)):
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        build(kind, out / f"fd-{on}", max_steps=1, seed=5, full_determinism=on)
        found[f"{kind}-{on}"] = {
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "draw": torch.rand(4).tolist(),
        }
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
    return found


def log_level(out: Path) -> dict[str, Any]:
    """transformers' verbosity after a Trainer is built: on this process (the main one) from
    log_level, ours and HF's; as rank 1 of 2 (the launcher's variables, as a launcher sets them)
    from log_level_replica."""
    found = {}
    for kind, level in (("ours", "info"), ("hf", "info"), ("ours", "error"), ("ours", "passive")):
        hf_logging.set_verbosity(logging.WARNING)
        build(kind, out / f"log-{level}", log_level=level, log_level_replica="critical")
        found[f"{kind}-{level}"] = hf_logging.get_verbosity()
    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    os.environ.update(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2")
    try:
        for replica in ("error", "passive"):
            hf_logging.set_verbosity(logging.WARNING)
            build("ours", out / f"replica-{replica}", log_level="debug", log_level_replica=replica)
            found[f"replica-{replica}"] = hf_logging.get_verbosity()
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return found


def do_predict(out: Path) -> dict[str, Any]:
    """A script in the shape of HF's examples, parsing its flags with ``HfArgumentParser`` and
    predicting where ``--do_predict`` says so: the files each Trainer leaves, and what they hold."""
    found = {}
    for kind, args_cls, trainer_cls in (("ours", TrainingArguments, Trainer),
                                        ("hf", transformers.TrainingArguments, transformers.Trainer)):  # fmt: skip
        for flags in ([], ["--do_predict"]):
            where = out / f"predict-{kind}-{len(flags)}"
            argv = ["--output_dir", str(where), "--report_to", "none", "--per_device_eval_batch_size", "4"]
            argv += ["--use_cpu", "true"] if kind == "hf" else []
            (args,) = HfArgumentParser(args_cls).parse_args_into_dataclasses([*argv, *flags])
            trainer = trainer_cls(model=model(), args=args, data_collator=Recording())
            if args.do_predict:
                metrics = trainer.predict(rows(6, seed=1), metric_key_prefix="predict").metrics
                trainer.log_metrics("predict", metrics)
                trainer.save_metrics("predict", metrics)
            files = sorted(p.name for p in where.glob("*_results.json")) if where.exists() else []
            result = json.loads((where / "predict_results.json").read_text()) if files else {}
            found[f"{kind}-{len(flags)}"] = {"files": files, "predict_loss": result.get("predict_loss")}
    return found


SCENARIOS = [
    data_seed,
    dataloader_drop_last,
    dataloader_drop_last_eval,
    adam_epsilon,
    prediction_loss_only,
    full_determinism,
    log_level,
    do_predict,
]

if __name__ == "__main__":
    out = Path(sys.argv[1])
    results = {fn.__name__: fn(out) for fn in SCENARIOS}
    (out / "results.json").write_text(json.dumps(results, indent=1))
