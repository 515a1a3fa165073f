"""HF Trainer's public methods beyond the loop, mixed into our ``Trainer``: the data loaders, the
callbacks list, the optimizer and scheduler, the model card, ``accelerator`` and ``end()``
(what HF's and TRL's scripts call last; ``trainer.runtime.processes``), and the two HF features this
trainer refuses (``push_to_hub``, ``hyperparameter_search``), each with HF's signature.

The loaders are the ones the loop and the evaluation read: ``get_train_dataloader`` is this rank's
shard of the resumable sampler at the state's position, ``get_eval_dataloader`` this rank's padded
evaluation shard (``trainer.loop.evaluation.EvalShard``). DeepSpeed builds the optimizer and its
scheduler together with the engine, from the resolved config; ``create_optimizer`` and friends
return those, building the engine when it does not exist yet.

``compute_loss`` is HF's override point: the loop runs an override, never this one (its super). The
loop calls none of the others (nor the Trainer's ``log``): a subclass that overrides
``get_train_dataloader``, ``create_optimizer`` or ``log`` changes what a user calling them gets, not
what trains.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

from trainer.data.loader import train_dataloader, train_sampler
from trainer.engine import Objective, Tokens, is_decayed, objective_for
from trainer.loop.callbacks import TrainerCallback
from trainer.loop.evaluation import EvalShard, eval_dataloader
from trainer.loop.model_card import (
    CARD_NAME,
    TRAINER_TAG,
    ModelCard,
    as_list,
    dataset_defaults,
    existing_tags,
    hyperparameters,
    task_of,
)
from trainer.loop.setup import ensure_engine
from trainer.loop.steps import plan_steps
from trainer.runtime.processes import Processes

if TYPE_CHECKING:
    from trainer.args import RunConfig, TrainingArguments
    from trainer.engine import Engine
    from trainer.loop.callbacks import CallbackHandler, TrainerState
    from trainer.runtime.distributed import DistInfo, Hardware
    from trainer.runtime.mesh import Mesh

logger = logging.getLogger(__name__)

PUSH_REFUSED = (
    "Trainer.push_to_hub: nothing is uploaded from this trainer (no hub access; setting the "
    "push_to_hub field is refused for the same reason). save_model() and create_model_card() leave "
    "an HF model directory in output_dir: upload it with huggingface_hub's upload_folder."
)
SEARCH_REFUSED = (
    "Trainer.hyperparameter_search: not supported, as every trial needs its own DeepSpeed engine "
    "built from its own arguments; run one training per trial (scripts/train.py with the trial's "
    "--learning_rate ... and its own --output_dir) and compare their eval_results.json."
)


class HFMethods:
    """HF's Trainer methods over what the ``Trainer`` holds (the names below)."""

    args: TrainingArguments
    state: TrainerState
    model: torch.nn.Module
    train_dataset: Any
    eval_dataset: Any
    data_collator: Callable
    callback_handler: CallbackHandler
    engine: Engine | None
    hardware: Hardware
    dist: DistInfo
    client_optimizer: Any
    client_scheduler: Any
    run_config: RunConfig | None
    ds_config: dict[str, Any] | None
    mesh: Mesh

    # ---- HF's process checks and loss override point -----------------------------------------

    def is_world_process_zero(self) -> bool:
        return self.dist.is_main

    def is_local_process_zero(self) -> bool:
        return self.dist.local_rank == 0

    @cached_property
    def accelerator(self) -> Processes:
        """What scripts ask of HF's ``trainer.accelerator`` (``print``, ``is_main_process``, ...)."""
        return Processes()

    def end(self) -> None:
        """HF's last call of a script: every rank waits for the others, then leaves the process
        group. Nothing that communicates (train, evaluate, save_model) works after it."""
        self.accelerator.end_training()

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """HF's override point: one micro-batch's loss over ``num_items_in_batch``, the labelled items
        (target tokens for a causal LM) of its accumulation window on all ranks, so a window's
        micro-batches on all ranks add up to its mean; None where the model takes no loss kwargs (the
        micro-batch's own mean, as HF's). Only an override runs in the loop (this is its super)."""
        objective = self._model_objective
        items = float(num_items_in_batch or objective.count(inputs))
        loss_sum, outputs = objective.loss_sum(Tokens(model), inputs, items)
        loss = loss_sum / max(items, 1.0)
        return (loss, outputs) if return_outputs else loss

    @cached_property
    def _model_objective(self) -> Objective:
        """The objective of the model without an override: what ``compute_loss``'s super computes
        (built once: it inspects the model's forward)."""
        return objective_for(self.model, None, self.args.label_smoothing_factor, self.args.label_names)

    # ---- callbacks -----------------------------------------------------------------------------

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Add a callback (a class is instantiated)."""
        self.callback_handler.add(callback)

    def pop_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> TrainerCallback | None:
        """Remove and return a callback: the first instance of a class, or that instance; None if absent."""
        return self.callback_handler.pop(callback)

    def remove_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Remove a callback: the first instance of a class, or that instance."""
        self.callback_handler.remove(callback)

    # ---- data ----------------------------------------------------------------------------------

    def get_train_dataloader(self) -> DataLoader:
        """This rank's training micro-batches, as the loop reads them: the resumable sampler's
        shard from the state's position (the start, before training), the Trainer's collator,
        ``per_device_train_batch_size`` and the ``dataloader_*`` arguments. ``loader.sampler.set_epoch``
        moves it to another epoch."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        sampler = train_sampler(self.train_dataset, *self.mesh.data_ranks, self.args, self.train_lengths)
        sampler.set_epoch(self.state.epoch_index, self.state.samples_into_epoch)
        pin = self.hardware.device == "cuda"
        return train_dataloader(self.train_dataset, sampler, self.data_collator, self.args, pin_memory=pin)

    def get_eval_dataloader(self, eval_dataset: str | Dataset | None = None) -> DataLoader:
        """This rank's evaluation batches, as ``evaluate`` reads them (rows ``rank, rank + world,
        ...``, the shard padded with copies of row 0, which ``loader.dataset.indices`` marks -1), in
        batches of ``per_device_eval_batch_size``. A string picks one of a dict of eval datasets."""
        if isinstance(eval_dataset, str):
            dataset = self.model_columns(self.eval_dataset[eval_dataset])
        elif eval_dataset is not None:
            dataset = self.model_columns(eval_dataset)
        else:
            dataset = self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        return self._eval_loader(dataset)

    def get_test_dataloader(self, test_dataset: Dataset) -> DataLoader:
        """This rank's batches of ``test_dataset``, as ``predict`` reads them."""
        return self._eval_loader(self.model_columns(test_dataset))

    def _eval_loader(self, dataset: Any) -> DataLoader:
        world, rank = self.mesh.data_ranks
        a = self.args
        return eval_dataloader(
            dataset,
            self.data_collator,
            a.per_device_eval_batch_size,
            rank,
            world,
            num_workers=a.dataloader_num_workers,
            pin_memory=a.dataloader_pin_memory and self.hardware.device == "cuda",
            drop_last=a.dataloader_drop_last,
            persistent_workers=a.dataloader_persistent_workers,
            prefetch_factor=a.dataloader_prefetch_factor,
        )

    def num_examples(self, dataloader: DataLoader) -> int:
        """The samples of the loader's dataset (all ranks' together, as HF's); a loader whose dataset
        has no length is estimated as its batches times ``per_device_train_batch_size``."""
        dataset = getattr(dataloader, "dataset", None)
        if isinstance(dataset, EvalShard):  # one rank's shard of the whole set
            dataset = dataset.dataset
        try:
            return len(dataset)
        except TypeError:
            return len(dataloader) * self.args.per_device_train_batch_size

    @staticmethod
    def num_tokens(train_dl: DataLoader, max_steps: int | None = None) -> int:
        """The ``input_ids`` elements (padding included) of the loader's batches; with ``max_steps``,
        the first batch's times ``max_steps`` (an estimate that reads one batch), as HF's did."""
        tokens = 0
        for batch in train_dl:
            if "input_ids" not in batch:
                logger.warning("num_tokens: the batches carry no input_ids")
                return tokens
            count = batch["input_ids"].numel()
            if max_steps is not None:
                return count * max_steps
            tokens += count
        return tokens

    # ---- optimizer and scheduler ---------------------------------------------------------------

    @property
    def optimizer(self) -> Any:
        """The optimizer that steps: DeepSpeed's (ZeRO-wrapped) once the engine is built, else the
        one passed in ``optimizers`` (None without one)."""
        return self.engine.optimizer if self.engine is not None else self.client_optimizer

    @property
    def lr_scheduler(self) -> Any:
        """The learning-rate scheduler the engine steps (else the one passed in ``optimizers``)."""
        return self.engine.lr_scheduler if self.engine is not None else self.client_scheduler

    def get_decay_parameter_names(self, model: torch.nn.Module) -> list[str]:
        """The parameters weight decay applies to, by the rule the engine's parameter groups use:
        matrices, not biases, norms or other 1-d tensors."""
        return [name for name, param in model.named_parameters() if is_decayed(name, param)]

    def create_optimizer(self, model: torch.nn.Module | None = None) -> Any:
        """The optimizer that trains. DeepSpeed builds it with the engine, from the config
        (``optim``, ``learning_rate``, ``adam_*``, ``weight_decay`` or a ``--deepspeed`` file), so
        without one the engine is built now, its schedule over the run's planned steps."""
        self._check_own_model(model)
        if self.optimizer is None:
            ensure_engine(self, self._planned_steps())
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The learning-rate scheduler that trains; without an engine, it is built now with a
        schedule over ``num_training_steps`` (kept by ``train()``, as HF keeps a scheduler made
        before it). An existing scheduler is returned unchanged, as HF's."""
        if optimizer is not None and optimizer is not self.optimizer:
            raise ValueError(
                "Trainer.create_scheduler: DeepSpeed steps the scheduler with the optimizer it built; "
                "to train with another optimizer pass optimizers=(optimizer, scheduler) to the Trainer"
            )
        if self.lr_scheduler is None and self.engine is None:
            ensure_engine(self, num_training_steps)
        if self.lr_scheduler is None:
            raise ValueError(
                "Trainer.create_scheduler: the DeepSpeed config of this run has no scheduler and one "
                "cannot be added to a built engine; give the config a scheduler section"
            )
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """Both at once: the engine, if not built yet, with a schedule over ``num_training_steps``."""
        if self.engine is None and (self.optimizer is None or self.lr_scheduler is None):
            ensure_engine(self, num_training_steps)

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """The context ``compute_loss`` runs in: empty, as DeepSpeed casts the model itself for
        bf16/fp16 (no autocast is entered, as in HF's Trainer with accelerate)."""
        stack = contextlib.ExitStack()
        autocast = self.autocast_smart_context_manager()
        if not isinstance(autocast, contextlib.nullcontext):
            stack.enter_context(autocast)
        return stack

    def autocast_smart_context_manager(
        self, cache_enabled: bool | None = True
    ) -> contextlib.AbstractContextManager:
        """No autocast: DeepSpeed's bf16/fp16 engines hold the model in that precision."""
        return contextlib.nullcontext()

    def _check_own_model(self, model: torch.nn.Module | None) -> None:
        if model is not None and model is not self.model:
            raise ValueError(
                "Trainer.create_optimizer: DeepSpeed builds the optimizer for the Trainer's own model; "
                "to optimize another one, build a Trainer with it"
            )

    def _planned_steps(self) -> int:
        """The run's length as ``train()`` will plan it (the schedule's length)."""
        if self.train_dataset is not None:
            return plan_steps(self.args, len(self.train_dataset), self.mesh.readers).max_steps
        if self.args.max_steps > 0:
            return self.args.max_steps
        raise ValueError(
            "Trainer.create_optimizer: DeepSpeed builds the scheduler with the optimizer and needs the "
            "run's length: give a train_dataset or max_steps, or call "
            "create_optimizer_and_scheduler(num_training_steps)"
        )

    # ---- model card, hub, search ---------------------------------------------------------------

    def create_model_card(
        self,
        language: str | None = None,
        license: str | None = None,
        tags: str | list[str] | None = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
    ) -> None:
        """``output_dir/README.md``, on the main process only: HF's model card (trainer/loop/model_card.py)
        of this run. Defaults as HF's: the model's hub name as ``finetuned_from``, a hub dataset's
        builder as its tag, ``output_dir``'s name as the model name, the model class's task; tags
        of a card already there are kept."""
        if not self.is_world_process_zero():
            return
        path = Path(self.args.output_dir) / CARD_NAME
        all_tags = as_list(tags)
        all_tags += [t for t in [*existing_tags(path), TRAINER_TAG] if t not in all_tags]
        one = self.eval_dataset if self.eval_dataset is not None else self.train_dataset
        default_tags, default_args = dataset_defaults(one)
        dataset_tags = as_list(dataset_tags) if dataset_tags is not None else default_tags
        dataset_args = as_list(dataset_args) if dataset_args is not None else default_args
        names = as_list(dataset) or dataset_tags
        if not names and self.run_config is not None:
            names = [self.run_config.data.dataset]  # the recipe's --dataset
        finetuned_from = finetuned_from or _hub_name(self.model)
        card = ModelCard(
            model_name=model_name or Path(self.args.output_dir).name or finetuned_from or "model",
            finetuned_from=finetuned_from,
            language=as_list(language),
            license=license,
            tags=all_tags,
            tasks=as_list(tasks) if tasks is not None else task_of(self.model),
            dataset=names,
            dataset_tags=dataset_tags,
            dataset_args=dataset_args,
            hyperparameters=hyperparameters(self.args, self.ds_config, self.mesh, self.client_optimizer),
            log_history=self.state.log_history,
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(card.render(), encoding="utf-8")

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """Refused: this trainer has no hub access (see ``PUSH_REFUSED``)."""
        raise NotImplementedError(PUSH_REFUSED)

    def hyperparameter_search(
        self,
        hp_space: Callable[[Any], dict[str, float]] | None = None,
        compute_objective: Callable[[dict[str, float]], float] | None = None,
        n_trials: int = 20,
        direction: str | list[str] = "minimize",
        backend: Any = None,
        hp_name: Callable[[Any], str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Refused: each trial needs its own engine (see ``SEARCH_REFUSED``)."""
        raise NotImplementedError(SEARCH_REFUSED)


def _hub_name(model: torch.nn.Module) -> str | None:
    """The hub name the model was loaded from (HF's default ``finetuned_from``); None for a model
    built from a config or loaded from a local directory."""
    name = getattr(getattr(model, "config", None), "_name_or_path", None)
    return name if isinstance(name, str) and name and not os.path.isdir(name) else None
