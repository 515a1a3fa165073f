"""One function builds a run from a ``RunConfig``: what ``trainer train``, the test scenarios and the
benchmarks all call.

The order is the contract: the process group first (ZeRO-3 partitions over it, and one process must
not fall back to DeepSpeed's MPI discovery), then the tokenizer and the model's HF config (which the
sequence-parallel layout is checked against), then the data, then the run's plan (``plan_run``: the
layout, the run's length, the checkpoint to resume and its global batch, the one resolution of the
DeepSpeed config), then the model built under that config (partitioned at creation under ZeRO-3), then
the Trainer, which runs the plan as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import set_seed

from trainer.args import RunConfig
from trainer.config import Hardware
from trainer.data import build_datasets, get_tokenizer
from trainer.data.loader import data_seed
from trainer.data.preference import load_pairs
from trainer.data.sources import DataError
from trainer.data.stream import STREAM_LENGTH, StreamedDataset
from trainer.data.stream_sources import build_stream
from trainer.loop.callbacks import TrainerCallback
from trainer.loop.plan import plan_run
from trainer.loop.preference import PreferenceTrainer
from trainer.loop.trainer import Trainer
from trainer.model.liger import check_liger
from trainer.model.modeling import build_model, hidden_size_of, model_config
from trainer.objectives import OBJECTIVES
from trainer.runtime.distributed import DistInfo, detect_hardware, init_distributed


def build_run(
    run_config: RunConfig,
    *,
    tokenizer: Any = None,
    train_dataset: Dataset | None = None,
    eval_dataset: Dataset | None = None,
    config: Any = None,
    data_collator: Callable | None = None,
    callbacks: list[TrainerCallback] | None = None,
    hardware: Hardware | None = None,
    dist: DistInfo | None = None,
) -> Trainer:
    """A Trainer for ``run_config``, its model built. The tokenizer, the datasets and the model's HF
    config come from ``run_config`` unless given (tests and benchmarks bring their own; either
    dataset alone counts as given, so an evaluation-only run loads no training data). ``hardware``
    and ``dist``: the caller detected the one and started the process group already (``trainer
    train``); otherwise both happen here, once. The sequence and tensor split is checked against the
    model's config at the CLI's door, before anything loads, and by the engine that splits it."""
    args, model_args, data_args = run_config.training, run_config.model, run_config.data
    hardware = hardware or detect_hardware()
    check_liger(args, hardware)  # before anything loads
    if dist is None:
        dist = init_distributed(hardware, timeout_s=args.ddp_timeout)
    given_data = train_dataset is not None or eval_dataset is not None
    if tokenizer is None and (not given_data or config is None):
        tokenizer = get_tokenizer(model_args, data_args)
    config = config if config is not None else model_config(model_args, tokenizer, data_args.block_size)
    entry = OBJECTIVES[args.objective]
    trainer_class, rows_of_its_own = entry.trainer_class(), entry.data != "rows"
    if not given_data:
        if rows_of_its_own:  # preference pairs, labelled completions: tokenised by the trainer
            train_dataset, eval_dataset = load_pairs(data_args, args.seed)
        elif data_args.streaming:
            train_dataset, eval_dataset = _streamed(run_config, tokenizer)
        else:
            train_dataset, eval_dataset = build_datasets(data_args, tokenizer, seed=args.seed)
        if eval_dataset is not None and data_args.max_eval_samples:
            eval_dataset = eval_dataset.select(range(min(data_args.max_eval_samples, len(eval_dataset))))
    if rows_of_its_own:  # before the plan, which counts the rows kept
        eval_key = "validation_file" if data_args.validation_file else "dataset"
        train_dataset = _pairs(trainer_class, train_dataset, "train", "dataset", args, tokenizer)
        eval_dataset = _pairs(trainer_class, eval_dataset, "eval", eval_key, args, tokenizer)
    plan = plan_run(
        run_config,
        hardware,
        dist,
        num_samples=len(train_dataset) if train_dataset is not None else None,
        hidden_size=hidden_size_of(config),
    )
    set_seed(args.seed)
    model: torch.nn.Module = build_model(
        model_args, config, plan.ds_config, args.gradient_checkpointing, seed=args.seed
    )
    return trainer_class(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=data_collator,
        processing_class=tokenizer,
        callbacks=callbacks,
        run_config=run_config,
        plan=plan,
    )


def _streamed(run_config: RunConfig, tokenizer: Any) -> tuple[StreamedDataset, Dataset | None]:
    """A streamed training set (nothing read yet) and the ``validation_file``'s rows, tokenised."""
    args, data_args = run_config.training, run_config.data
    if args.max_steps <= 0:
        raise DataError([("max_steps", "a stream has no length to count epochs by; set max_steps")])
    shuffle = args.train_sampling_strategy != "sequential"
    # Endless for the plan: max_steps ends the run (one epoch, which a stream never finishes).
    stream = build_stream(data_args, tokenizer, data_seed(args), STREAM_LENGTH, shuffle)
    if not data_args.validation_file:
        return stream, None
    held = data_args.model_copy(
        update={"dataset": data_args.validation_file, "validation_file": None, "streaming": False,
                "validation_split_percentage": 0.0, "max_train_samples": data_args.max_eval_samples}
    )  # fmt: skip
    return stream, build_datasets(held, tokenizer, seed=args.seed)[0]


def _pairs(
    trainer_class: type[PreferenceTrainer], dataset: Any, name: str, key: str, args: Any, tokenizer: Any
):
    """A preference set tokenised; a bad row or a missing column is one line naming the run's key."""
    try:
        return trainer_class.pairs(dataset, name, args, tokenizer)
    except DataError:
        raise
    except ValueError as err:
        raise DataError([(key, str(err))]) from None
