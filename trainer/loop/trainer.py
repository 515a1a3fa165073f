"""The HF-style ``Trainer``: one readable training loop over a DeepSpeed engine.

The host waits for the device only at logging steps: losses, token counts and the step count stay
as device tensors in between, so the loop never stalls the GPU queue just to print.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

# HF's own result types: what code written against transformers' Trainer expects back.
from transformers.trainer_utils import (
    EvalPrediction,
    PredictionOutput,
    TrainOutput,
)

from trainer.args import RunConfig, TrainingArguments
from trainer.data import ResumableDistributedSampler, default_collator_for, model_columns
from trainer.data.loader import epoch_at, row_length, sample_lengths
from trainer.data.stream_sources import readable
from trainer.engine import Engine, Objective, is_causal_lm, objective_for
from trainer.loop.auto_batch import AutoBatchSize, start_over
from trainer.loop.callbacks import (
    CallbackHandler,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    callback_states,
    default_callbacks,
    update_best_metric,
)
from trainer.loop.evaluation import evaluate_set
from trainer.loop.guard import NonfiniteGuard
from trainer.loop.hf_methods import HFMethods
from trainer.loop.plan import RunPlan
from trainer.loop.saving import Checkpoints, export_model
from trainer.loop.setup import ensure_engine, load_checkpoint, prepare_training, start, start_window
from trainer.loop.stages import DataStage, LoaderProducer, Producer, prepared
from trainer.loop.vote import Preemption, WindowCounts, add_source_blocks, poll, source_shares, weakly
from trainer.observe.metrics import summary_table
from trainer.observe.results import ResultsAPI
from trainer.observe.throughput import flops_per_token_for_model
from trainer.runtime.distributed import print_main
from trainer.runtime.ownership import claim_output_dir
from trainer.runtime.resilience import EXIT_PREEMPTED, PreemptionFlag, Watchdog, fault_plan


class Trainer(HFMethods, ResultsAPI):
    """HF's Trainer over a DeepSpeed engine. A subclass changes what trains through the public
    points below (``make_objective``, ``model_columns``, ``generation``, ``flops_per_token``,
    ``eval_per_batch``, ``tokens_seen_key``), the data stages and the producer (``stages``,
    ``producer``), and callbacks; never through a private method."""

    #: A model's own evaluation loss counts each batch's mean once, not per row (HF's Seq2SeqTrainer).
    eval_per_batch: bool = False
    #: The name under which each row carries ``state.num_input_tokens_seen`` (TRL's ``num_tokens``,
    #: an evaluation's prefixed), besides HF's ``include_num_input_tokens_seen``; None: not logged.
    tokens_seen_key: str | None = None

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        args: TrainingArguments | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        data_collator: Callable | None = None,
        processing_class: Any = None,
        tokenizer: Any = None,
        compute_metrics: Callable[[EvalPrediction], dict[str, float]] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
        run_config: RunConfig | None = None,
        plan: RunPlan | None = None,
    ):
        """HF's arguments, plus ``run_config`` (saved with every checkpoint) and ``plan``: the run
        already planned (``trainer.loop.build.build_run`` passes it, having built the model under its
        DeepSpeed config; its process group is up). Without one the Trainer starts the process group
        here and plans the run (``plan_run``) when ``train`` or ``evaluate`` first needs it."""
        if model is None:
            raise ValueError("Trainer: model is required")
        self.plan = plan
        self.args = plan.args if plan is not None else args or TrainingArguments()
        self.hardware, self.dist, self.mesh = start(self.args, plan)  # seeded, as HF's Trainer seeds
        self.model = model
        if getattr(model, "config", None) is not None:  # as HF's: no cache in training or evaluation
            model.config.use_cache = getattr(self.args, "use_cache", False)
        self.processing_class = processing_class or tokenizer
        self.train_lengths = sample_lengths(train_dataset, self.args)  # before a length column is cut
        self.train_dataset = readable(self.model_columns(train_dataset, "training"), self.args)
        self.eval_dataset = readable(self.model_columns(eval_dataset, "evaluation"), self.args, True)
        self.data_collator = data_collator or default_collator_for(model, self.processing_class)
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.client_optimizer, self.client_scheduler = optimizers
        self.run_config = run_config
        self.state = TrainerState(world_size=self.mesh.readers, is_world_process_zero=self.dist.is_main)
        self.state.is_local_process_zero = self.dist.local_rank == 0
        self.control = TrainerControl()
        default = default_callbacks(self.args, self.mesh)  # then the user's
        self.auto_batch = AutoBatchSize(self.args, model, self.dist.world_size)  # a callback when on
        default += [self.auto_batch] if self.auto_batch.enabled else []
        self.callback_handler = CallbackHandler(default + list(callbacks or []))
        self.producer: Producer = LoaderProducer()  # each step's micro-batches (trainer/loop/stages.py)
        self.stages: list[DataStage] = []  # what prepares a set before the objective reads it
        self.engine: Engine | None = None
        self.checkpoints: Checkpoints | None = None  # the saver and snapshots (trainer/loop/saving.py)
        self.watchdog = Watchdog(self.args.output_dir, self.args.hang_timeout_s, fault_plan())
        self.preemption = PreemptionFlag()
        self._fire("on_init_end")

    # ---- public API ----------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Train to ``max_steps``; returns HF's ``TrainOutput(global_step, training_loss, metrics)``
        (trainer/observe/results.py says what each metric means). ``self.state`` holds the log history."""
        args = self.args
        claim_output_dir(args.output_dir, wait_s=args.preemption_grace_s)  # one run per output_dir
        spec = resume_from_checkpoint if resume_from_checkpoint is not None else args.resume_from_checkpoint
        # auto_find_batch_size: a first step out of memory trains again at half the micro-batch.
        start = (self.state, self.control), args.per_device_train_batch_size
        return self.auto_batch.run(lambda: self._train(spec), partial(start_over, self), *start)

    def _train(self, spec: Any) -> TrainOutput:
        # The checkpoint is found before the engine is built: its global batch is part of the config.
        sampler = prepare_training(self, spec)
        args = self.args  # the plan's arguments: its accumulation steps
        self.window = start_window(self)  # the logging window, its step timer and the call's totals
        if self.state.global_step >= self.state.max_steps:  # a finished run, resumed: not one step more
            print_main(f"Step {self.state.max_steps} was reached already: nothing to train.")
            return self._train_output()
        if self.checkpoints is None:
            hf_files = (getattr(self.model, "config", None), self.processing_class)
            saver_args = (args, self.dist, self.ds_config, self.run_config, *hf_files)
            self.checkpoints = Checkpoints(args, saver_args, weakly(self._saved))
        self.checkpoints.start_snapshots()
        self.checkpoints.data = sampler  # a stream's position goes into every checkpoint
        self.checkpoints.producer = self.producer  # what it keeps (a rollout buffer) goes into each too
        self._fire("on_train_begin")
        if args.eval_on_start and self.eval_dataset is not None:
            self.evaluate()
        self.engine.train()
        self.guard = NonfiniteGuard(args, self.engine, weakly(self._finish_save), weakly(self._roll_back))
        self._preemption = Preemption(self.preemption, weakly(self._save_and_exit_on_preemption))
        self.guard.reset()
        # self.state is re-read every time: a rollback replaces it.
        while self.state.epoch_index < self.state.num_train_epochs and not self.control.should_training_stop:
            sampler.set_epoch(self.state.epoch_index, self.state.samples_into_epoch, self.state.data_position)
            if self.state.samples_into_epoch == 0:
                # HF's epoch starts a DataLoader iterator, which draws its workers' base seed from the
                # global generator; the same draw keeps dropout and masking on HF's numbers. A resume
                # inside an epoch restores the generator as it was after that draw.
                torch.empty((), dtype=torch.int64).random_()
            self._fire("on_epoch_begin")
            if self._train_epoch(sampler):
                self.state.epoch_index += 1
                self.state.samples_into_epoch = 0
                self.state.epoch = float(self.state.epoch_index)
                self._fire("on_epoch_end")
                if self.control.should_log and self._finite():  # logging_strategy="epoch"
                    self._log_train()
                self._maybe_evaluate_and_save()
        self._finish_save()
        self.checkpoints.release_snapshots()
        output = self._train_output()
        if args.load_best_model_at_end and self.state.best_model_checkpoint:
            load_checkpoint(self, Path(self.state.best_model_checkpoint), weights_only=True)
        self._fire("on_train_end")
        print_main(summary_table(self.state.log_history))
        return output

    def _train_epoch(self, sampler: ResumableDistributedSampler) -> bool:
        """Optimizer steps until the epoch ends (True) or the run stops or rolls back (False)."""
        for window in self.producer.windows(self, sampler):
            window_tokens, counts = self._vote(window)
            if not window_tokens:  # the data ends on every rank
                return True
            self._fire("on_step_begin")
            window_loss = self.engine.train_window(window, window_tokens)
            self._advance(window_loss, window_tokens, *counts)
            self._fire("on_step_end")
            every = self.args.snapshot_steps
            snapshot = bool(every) and self.state.global_step % every == 0
            checked = self.control.should_log or self.control.should_save or snapshot
            if checked and not self._finite():
                return False  # rolled back: the epoch restarts from the checkpoint's position
            if snapshot:  # the previous snapshot is committed before this step shows: at most K steps lost
                self.checkpoints.settle_snapshot()
            if self.control.should_log:
                self._log_train()
            if self._maybe_evaluate_and_save():
                self.window.timer.start()  # evaluation and checkpoint time is not training throughput
            if snapshot:  # its blocking time (the copy to host memory) counts as training time
                self.checkpoints.take_snapshot(self.engine, self.state)
            if self.control.should_training_stop:
                return False
        return True

    def _vote(self, window: list[dict[str, torch.Tensor]]) -> tuple[float, tuple[int, int]]:
        """The step's one host-only all-reduce, over its participants (trainer/loop/vote.py): the
        checkpoint and the snapshot in flight, preemption, and the window's target tokens, samples and
        input tokens. Returns the window's target tokens on all ranks (0: a rank's stream ended), and
        its (samples, input tokens) on this one."""
        counts = WindowCounts(window, self.engine, self.args, self.mesh, self.checkpoints.data)
        poll([*self.checkpoints.in_flight, self._preemption, counts])
        add_source_blocks(self.state.source_blocks, counts.sources)
        shared, self.window.fingerprint = self.mesh.sharing, counts.fingerprint  # a group: the same rows
        self.state.num_input_tokens_seen += int(counts.input_tokens) // shared
        self.window.totals.samples += counts.samples / shared
        # Each rank counts its rows whole; a group's ranks hold the same rows.
        return (0.0 if counts.ended else max(counts.tokens / shared, 1.0)), counts.local

    def _advance(self, loss: torch.Tensor, tokens: float, samples: int, input_tokens: int) -> None:
        """A step trained: its loss and the window's target tokens into the logging window (on the
        device until a logging step reads them), with this rank's samples and input tokens; the
        state's step, sample and epoch counters on."""
        shared = self.mesh.sharing  # a group's ranks count the same rows
        self.window.add(loss, tokens, samples / shared, input_tokens / shared)
        state = self.state
        state.global_step += 1
        state.samples_into_epoch += samples
        state.epoch = epoch_at(state, self.train_dataset, self.mesh.readers)

    def _finite(self, allow_rollback: bool = True) -> bool:
        """The non-finite guard's check (trainer/loop/guard.py); False: the run rolled back."""
        return self.guard.check(self.state, self.control, allow_rollback)

    def _roll_back(self, checkpoint: Path) -> TrainerState:
        """The non-finite guard's rollback: the run goes on from ``checkpoint``; its state is returned."""
        with self.watchdog.phase("load"):
            load_checkpoint(self, checkpoint)
        self.control = TrainerControl()
        self.window.reset()
        self.guard.reset()
        return self.state

    def _save_and_exit_on_preemption(self) -> None:
        if self._finite(allow_rollback=False):
            with self.watchdog.phase("save", self.args.preemption_grace_s):
                self._save_checkpoint(resumable=True)
                self.checkpoints.finish()
            step = self.state.global_step
            print_main(f"Preempted: saved checkpoint-{step}; exiting with {EXIT_PREEMPTED}.")
        raise SystemExit(EXIT_PREEMPTED)

    def evaluate(
        self,
        eval_dataset: Dataset | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """HF's evaluate: ``{prefix}_loss``, the ``compute_metrics`` results,
        ``{prefix}_runtime``/``_samples_per_second``/``_steps_per_second`` and ``epoch``, on every
        rank; logged as a row. ``ignore_keys``: model outputs left out of the predictions."""
        if (self.eval_dataset if eval_dataset is None else eval_dataset) is None:
            raise ValueError("Trainer.evaluate: no eval_dataset")
        ensure_engine(self, max(self.state.max_steps, 1))
        if eval_dataset is None:  # the Trainer's own set, prepared once
            dataset = self.eval_dataset = prepared(self, self.eval_dataset, "eval")
        else:
            dataset = prepared(self, self.model_columns(eval_dataset), None)
        predictions = self.compute_metrics is not None and not self.args.prediction_loss_only
        # With batch_eval_metrics, HF's evaluate keeps no predictions (that is its point); predict does.
        returned = not self.args.batch_eval_metrics
        output = evaluate_set(self, dataset, metric_key_prefix, predictions, ignore_keys, returned)
        metrics = {**output.metrics, "epoch": self.state.epoch}
        seen = {f"{metric_key_prefix}_{self.tokens_seen_key}": self.state.num_input_tokens_seen}
        self._log({**metrics, **(seen if self.tokens_seen_key else {}), "step": self.state.global_step})
        self._fire("on_evaluate", metrics=metrics)
        return metrics

    def predict(
        self, test_dataset: Dataset, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test"
    ) -> PredictionOutput:
        """HF's predict: the predictions (logits, or what ``preprocess_logits_for_metrics`` makes of
        them) and labels of every sample in dataset order, padded with -100, and the metrics
        (``{prefix}_loss``, ... where the set has labels), on every rank."""
        dataset = self.model_columns(test_dataset)
        ensure_engine(self, max(self.state.max_steps, 1))
        predictions = not self.args.prediction_loss_only
        output = evaluate_set(self, dataset, metric_key_prefix, predictions, ignore_keys)
        return PredictionOutput(
            predictions=output.predictions, label_ids=output.label_ids, metrics=output.metrics
        )

    def generation(self) -> Callable[[dict[str, torch.Tensor]], Any] | None:
        """What produces predictions in place of the logits: nothing here (``Seq2SeqTrainer``
        generates)."""
        return None

    def save_model(self, output_dir: str | None = None) -> Path | None:
        """An HF export (config, safetensors, tokenizer) of the current weights; default: output_dir."""
        return export_model(self, Path(output_dir or self.args.output_dir))

    @property
    def ds_config(self) -> dict[str, Any] | None:
        """The DeepSpeed config the engine runs (``ds_config.json``): the plan's."""
        return self.plan.ds_config if self.plan is not None else None

    # ---- what a subclass changes ------------------------------------------------------------------

    def model_columns(self, dataset: Any, description: str | None = None) -> Any:
        """``dataset`` cut to the columns the model's forward takes (HF's ``remove_unused_columns``);
        a Trainer whose collator reads other columns overrides this."""
        return model_columns(dataset, self.model, self.args, description)

    def make_objective(self) -> Objective:
        """What a step minimises: the model's (``objective_for``), with a ``compute_loss`` override,
        HF's point of change, in place of its forward. Trainers of other objectives override this."""
        overridden = type(self).compute_loss is not Trainer.compute_loss
        return objective_for(
            self.model,
            self.compute_loss if overridden else None,
            self.args.label_smoothing_factor,
            self.args.label_names,
            eval_per_batch=self.eval_per_batch,
            router_aux_loss_coef=self.args.router_aux_loss_coef,
        )

    # ---- logging, evaluation, saving -----------------------------------------------------------

    def _fire(self, event: str, **kwargs: Any) -> None:
        """Run ``event`` on every callback; as HF's, they get the model and processing class (and our engine)."""
        objects = {"model": self.model, "processing_class": self.processing_class, "engine": self.engine}
        self.control = self.callback_handler.fire(
            event, self.args, self.state, self.control, **objects, **kwargs
        )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """HF's log: ``logs`` gets the state's ``epoch`` (in place, as HF's), the row with the step
        goes into ``state.log_history``, and ``on_log`` fires (so it reaches ``metrics.jsonl`` and
        ``report_to``). The loop's own rows do not pass through here (an override changes what a
        caller logs, not what the loop logs)."""
        logs["epoch"] = self.state.epoch
        self._log({**logs, "step": self.state.global_step})

    def _log(self, logs: dict[str, Any]) -> None:
        if self.args.include_num_input_tokens_seen != "no":  # as HF's, in every row
            logs = {**logs, "num_input_tokens_seen": self.state.num_input_tokens_seen}
        self.state.log_history.append(logs)
        # As HF's: the history's rows carry the step; the callbacks' logs do not (state.global_step has it).
        self._fire("on_log", logs={k: v for k, v in logs.items() if k != "step"})

    def _log_train(self) -> None:
        logs = self.window.row(self.state, self.engine, self.hardware)
        logs.update(source_shares(self.state.source_blocks))
        if self.tokens_seen_key:
            logs[self.tokens_seen_key] = self.state.num_input_tokens_seen
        fingerprint = self.window.fingerprint
        self._log({**logs, "data_fingerprint": fingerprint} if fingerprint else logs)

    def _train_output(self) -> TrainOutput:
        """HF's end of a ``train`` call: its metrics, logged as one row, and the ``TrainOutput``."""
        metrics = self.window.train_metrics(self.state, self.flops_per_token())
        self._log({**metrics, "step": self.state.global_step})
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _maybe_evaluate_and_save(self) -> bool:
        """Evaluate and/or save as the control flags ask; True if anything ran."""
        ran = False
        if self.control.should_evaluate or self.control.should_save:
            self.checkpoints.settle_snapshot()
        if self.control.should_evaluate and self.eval_dataset is not None:
            self.evaluate()
            update_best_metric(self.state, self.args)
            ran = True
        if self.control.should_save:
            with self.watchdog.phase("save"):
                self._save_checkpoint()
            ran = True
        self.control.should_evaluate = self.control.should_save = self.control.should_log = False
        return ran

    def _save_checkpoint(self, resumable: bool = False) -> None:
        """Start a checkpoint of this step (trainer/loop/saving.py); on_save fires once it is committed."""
        states = lambda: callback_states(self.callback_handler.callbacks, self.control)  # noqa: E731
        self.checkpoints.save(self.engine, self.state, states, resumable)

    def _saved(self, checkpoint: Path) -> None:
        self._fire("on_save", checkpoint=str(checkpoint))

    def _finish_save(self) -> None:
        """Commit a pending asynchronous save (collective); a no-op when none is pending."""
        if self.checkpoints.pending:
            with self.watchdog.phase("save"):
                self.checkpoints.finish()

    def flops_per_token(self) -> float | None:
        """A causal LM's model FLOPs per token (MFU); None for other models, whose rows are not token blocks."""
        if not is_causal_lm(self.model) or self.train_dataset is None:
            return None
        return flops_per_token_for_model(self.model, row_length(self.train_dataset), self.mesh.tensor)
