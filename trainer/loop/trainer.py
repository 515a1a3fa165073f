"""The HF-style ``Trainer``: one readable training loop over a DeepSpeed engine.

The host waits for the device only at logging steps: losses, token counts and the step count stay
as device tensors in between, so the loop never stalls the GPU queue just to print.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import enable_full_determinism, set_seed

# HF's own result types: what code written against transformers' Trainer expects back.
from transformers.trainer_utils import (
    EvalLoopOutput,
    EvalPrediction,
    PredictionOutput,
    TrainOutput,
    speed_metrics,
)
from transformers.utils import logging as hf_logging

from trainer import checkpoint as ckpt
from trainer.args import RunConfig, TrainingArguments
from trainer.args.recipe import dump_run_config
from trainer.checkpoint.export import export_hf
from trainer.config.files import precision_of
from trainer.data import ResumableDistributedSampler, default_collator_for, model_columns
from trainer.data.loader import row_length, sample_lengths, train_sampler
from trainer.data.stream_sources import readable
from trainer.engine import Engine, Objective, build_engine, is_causal_lm, objective_for
from trainer.loop.auto_batch import AutoBatchSize
from trainer.loop.callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    MetricsCallback,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    callback_states,
    restore_callback_states,
    update_best_metric,
)
from trainer.loop.evaluation import Predictions, eval_batches, evaluation_loop
from trainer.loop.guard import NonfiniteGuard
from trainer.loop.hf_methods import HFMethods
from trainer.loop.plan import RunPlan, plan_run
from trainer.loop.saving import Checkpoints, resumed_state
from trainer.loop.stages import DataStage, LoaderProducer, Producer, prepared
from trainer.loop.steps import client_scheduler, epoch_at, optimizer_for, tiling_for, torch_compile_for
from trainer.loop.vote import Preemption, WindowCounts, add_source_blocks, poll, source_shares, weakly
from trainer.model.liger import apply_liger_kernel, check_liger
from trainer.model.modeling import enable_gradient_checkpointing, is_adapter, model_hidden_size, param_counts
from trainer.model.neftune import NEFTune
from trainer.observe.metrics import summary_table
from trainer.observe.monitor import EmptyDeviceCache, memory_stats
from trainer.observe.reporting import reporting_callbacks
from trainer.observe.results import ResultsAPI, TrainTotals
from trainer.observe.throughput import StepTimer, device_sync, flops_per_token_for_model
from trainer.runtime.distributed import (
    all_reduce_sum,
    barrier,
    detect_hardware,
    host_all_reduce,
    init_distributed,
    print_main,
)
from trainer.runtime.mesh import Mesh, mesh_for
from trainer.runtime.ownership import claim_output_dir
from trainer.runtime.resilience import EXIT_PREEMPTED, PreemptionFlag, Watchdog, fault_plan
from trainer.runtime.run_files import DS_CONFIG, RUN_CONFIG


class Trainer(HFMethods, ResultsAPI):
    #: A model's own evaluation loss counts each batch's mean once, not per row (HF's Seq2SeqTrainer).
    _eval_per_batch: bool = False

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
        # Seeded here, as HF's Trainer seeds: what runs between this and the first step (building
        # the model's engine, a data collator's masks) draws from the same generator state as HF's.
        if self.args.full_determinism:
            enable_full_determinism(self.args.seed)
        else:
            set_seed(self.args.seed)
        if plan is not None:
            self.hardware, self.dist = plan.hardware, plan.dist
        else:
            self.hardware = detect_hardware()
            check_liger(self.args, self.hardware)  # before the process group, the engine or the data
            self.dist = init_distributed(self.hardware, timeout_s=self.args.ddp_timeout)
        self.mesh: Mesh = (
            plan.mesh if plan is not None else mesh_for(self.args, self.dist.world_size, self.dist.rank)
        )
        hf_logging.set_verbosity(self.args.get_process_log_level())
        if self.args.tf32 is not None and self.hardware.device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = self.args.tf32
        self.model = model
        if getattr(model, "config", None) is not None:  # as HF's: no cache in training or evaluation
            model.config.use_cache = getattr(self.args, "use_cache", False)
        self.processing_class = processing_class or tokenizer
        self._lengths = sample_lengths(train_dataset, self.args)  # before a length column is cut
        self.train_dataset = readable(self._model_columns(train_dataset, "training"), self.args)
        self.eval_dataset = readable(self._model_columns(eval_dataset, "evaluation"), self.args, True)
        self.data_collator = data_collator or default_collator_for(model, self.processing_class)
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.client_optimizer, self.client_scheduler = optimizers
        self.run_config = run_config
        self.state = TrainerState(
            is_world_process_zero=self.dist.is_main,
            is_local_process_zero=self.dist.local_rank == 0,
            world_size=self.mesh.readers,
        )
        self.control = TrainerControl()
        default = [DefaultFlowCallback(), MetricsCallback(), ProgressCallback()]
        default += reporting_callbacks(self.args)  # transformers' own, for report_to; then the user's
        if self.args.neftune_noise_alpha is not None:
            default.append(NEFTune(self.args, self.mesh))
        if self.args.torch_empty_cache_steps is not None:
            default.append(EmptyDeviceCache(self.args.torch_empty_cache_steps))
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
        # One run per output_dir, claimed once (not where the plan says `trainer train` or we hold it).
        if self.plan is None or not self.plan.output_dir_claimed:
            claim_output_dir(args.output_dir, wait_s=args.preemption_grace_s)
        spec = resume_from_checkpoint if resume_from_checkpoint is not None else args.resume_from_checkpoint
        # auto_find_batch_size: a first step out of memory trains again at half the micro-batch.
        start = (self.state, self.control), args.per_device_train_batch_size
        return self.auto_batch.run(lambda: self._train(spec), self._start_over, *start)

    def _train(self, spec: Any) -> TrainOutput:
        # The checkpoint is found before the engine is built: its global batch is part of the config.
        sampler = self._prepare_training(spec)
        args, checkpoint = self.args, self.plan.checkpoint  # the plan's arguments: its accumulation
        if checkpoint is not None:
            with self.watchdog.phase("load"):
                self._load_checkpoint(checkpoint)
            if args.restore_callback_states_from_checkpoint:
                stored = self.state.stateful_callbacks
                self.control = restore_callback_states(self.callback_handler, stored, self.control)
            print_main(f"Resumed from {checkpoint} at step {self.state.global_step}.")
        self._run = TrainTotals()
        self._params = dict(
            zip(("trainable_params", "total_params"), param_counts(self.model, self.mesh.tensor), strict=True)
        )
        trainable, total = self._params.values()
        print_main(
            f"Parameters: {trainable:,} trainable of {total:,} ({100 * trainable / max(total, 1):.2f}%)."
        )
        if self.state.global_step >= self.state.max_steps:  # a finished run, resumed: not one step more
            print_main(f"Step {self.state.max_steps} was reached already: nothing to train.")
            return self._train_output()
        if self.checkpoints is None:
            hf_files = (getattr(self.model, "config", None), self.processing_class)
            saver_args = (args, self.dist, self.ds_config, self.run_config, *hf_files)
            self.checkpoints = Checkpoints(args, saver_args, weakly(self._saved))
        self.checkpoints.start_snapshots()
        self.checkpoints.data = sampler  # a stream's position goes into every checkpoint
        self.timer = StepTimer(
            self._flops_per_token(),
            self.hardware.name,
            precision_of(self.ds_config),
            args.peak_tflops,
            self.dist.world_size,
        )
        self._fire("on_train_begin")
        if args.eval_on_start and self.eval_dataset is not None:
            self.evaluate()
        self.engine.train()
        self.guard = NonfiniteGuard(args, self.engine, weakly(self._finish_save), weakly(self._roll_back))
        self._preemption = Preemption(self.preemption, weakly(self._save_and_exit_on_preemption))
        self._reset_window_sums()
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
            self._load_checkpoint(Path(self.state.best_model_checkpoint), weights_only=True)
        self._fire("on_train_end")
        print_main(summary_table(self.state.log_history))
        return output

    def _start_over(self, micro_batch: int, saved: tuple[TrainerState, TrainerControl]) -> None:
        """auto_find_batch_size's retry (trainer/loop/auto_batch.py): the engine freed, the state as
        ``train`` found it, the arguments (and run config) copied with ``micro_batch``: planned again."""
        self.engine.close()
        self.checkpoints.release_snapshots()  # built before the first step
        self.engine = self.checkpoints = self.plan = None
        self.state, self.control = saved
        self.args = self.args.model_copy(update={"per_device_train_batch_size": micro_batch})
        if self.run_config is not None:
            self.run_config = self.run_config.model_copy(update={"training": self.args})

    def _train_epoch(self, sampler: ResumableDistributedSampler) -> bool:
        """Optimizer steps until the epoch ends (True) or the run stops or rolls back (False)."""
        for window in self.producer.windows(self, sampler):
            window_tokens, counts = self._vote(window)
            if not window_tokens:  # the data ends on every rank
                return True
            self._fire("on_step_begin")
            window_loss = self.engine.train_window(window, window_tokens)
            self._accumulate(window_loss, window_tokens, counts)
            self._fire("on_step_end")
            snapshot = self.checkpoints.snapshot_due(self.state.global_step)
            checked = self.control.should_log or self.control.should_save or snapshot
            if checked and not self._finite():
                return False  # rolled back: the epoch restarts from the checkpoint's position
            if snapshot:  # the previous snapshot is committed before this step shows: at most K steps lost
                self.checkpoints.settle_snapshot()
            if self.control.should_log:
                self._log_train()
            if self._maybe_evaluate_and_save():
                self.timer.start()  # evaluation and checkpoint time is not training throughput
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
        poll([*self.checkpoints.participants, self._preemption, counts])
        add_source_blocks(self.state.source_blocks, counts.sources)
        shared, self._batch_hash = self.mesh.sharing, counts.fingerprint  # a group's ranks: the same rows
        self.state.num_input_tokens_seen += int(counts.input_tokens) // shared
        self._run.samples += counts.samples / shared
        return (0.0 if counts.ended else max(counts.tokens / self.mesh.tensor, 1.0)), counts.local

    def _accumulate(self, loss: torch.Tensor, tokens: float, counts: tuple[int, int]) -> None:
        """Add a step to the logging window's sums (on the device until a logging step reads them)
        and advance the state's step, sample and epoch counters."""
        self._loss_sum += loss
        self._token_sum += tokens
        self.guard.observe(loss)
        self._advance(*counts)

    def _advance(self, samples: int, input_tokens: int) -> None:
        """One step more in the state and the step timer (this rank's samples and input tokens)."""
        shared = self.mesh.sharing  # a group's ranks count the same rows
        self.timer.step_end(tokens=input_tokens / shared, samples=samples / shared)
        state, self._run.steps = self.state, self._run.steps + 1
        state.global_step += 1
        state.samples_into_epoch += samples
        state.epoch = epoch_at(state, self.train_dataset, self.mesh.readers)

    def _reset_window_sums(self) -> None:
        self._loss_sum = torch.zeros((), device=self.engine.device)
        self._token_sum, self._batch_hash = 0.0, None
        self.guard.reset()

    def _finite(self, allow_rollback: bool = True) -> bool:
        """The non-finite guard's check (trainer/loop/guard.py); False: the run rolled back."""
        return self.guard.check(self.state, self.control, allow_rollback)

    def _roll_back(self, checkpoint: Path) -> TrainerState:
        """The non-finite guard's rollback: the run goes on from ``checkpoint``; its state is returned."""
        with self.watchdog.phase("load"):
            self._load_checkpoint(checkpoint)
        self.control = TrainerControl()
        self._reset_window_sums()
        return self.state

    def _save_and_exit_on_preemption(self) -> None:
        if self._finite(allow_rollback=False):
            with self.watchdog.phase("save", self.args.preemption_grace_s):
                self._save_checkpoint(resumable=True)
                self.checkpoints.finish()
            print_main(
                f"Preempted: saved checkpoint-{self.state.global_step}; exiting with {EXIT_PREEMPTED}."
            )
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
        self._ensure_engine(max(self.state.max_steps, 1))
        if eval_dataset is None:  # the Trainer's own set, prepared once
            dataset = self.eval_dataset = prepared(self, self.eval_dataset, "eval")
        else:
            dataset = prepared(self, self._model_columns(eval_dataset), None)
        predictions = self.compute_metrics is not None and not self.args.prediction_loss_only
        # With batch_eval_metrics, HF's evaluate keeps no predictions (that is its point); predict does.
        returned = not self.args.batch_eval_metrics
        output = self._evaluation_loop(dataset, metric_key_prefix, predictions, ignore_keys, returned)
        metrics = {**output.metrics, "epoch": self.state.epoch}
        self._log({**metrics, "step": self.state.global_step})
        self._fire("on_evaluate", metrics=metrics)
        return metrics

    def predict(
        self, test_dataset: Dataset, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test"
    ) -> PredictionOutput:
        """HF's predict: the predictions (logits, or what ``preprocess_logits_for_metrics`` makes of
        them) and labels of every sample in dataset order, padded with -100, and the metrics
        (``{prefix}_loss``, ... where the set has labels), on every rank."""
        dataset = self._model_columns(test_dataset)
        predictions = not self.args.prediction_loss_only
        output = self._evaluation_loop(dataset, metric_key_prefix, predictions, ignore_keys)
        return PredictionOutput(
            predictions=output.predictions, label_ids=output.label_ids, metrics=output.metrics
        )

    def _evaluation_loop(
        self,
        dataset: Dataset,
        prefix: str,
        with_predictions: bool,
        ignore_keys: list[str] | None = None,
        returned: bool = True,
    ) -> EvalLoopOutput:
        self._ensure_engine(max(self.state.max_steps, 1))
        start, bs, (world, rank) = time.time(), self.args.per_device_eval_batch_size, self.mesh.data_ranks
        hooks = (self.preprocess_logits_for_metrics, self.compute_metrics, ignore_keys, returned)
        output = evaluation_loop(
            self.engine,
            eval_batches(dataset, self.data_collator, bs, rank, world, self.args.dataloader_drop_last),
            len(dataset),
            prefix,
            Predictions.from_args(self.args, *hooks, self._generation()) if with_predictions else None,
            collectives=lambda: self.watchdog.phase("eval"),
        )
        shard = math.ceil(len(dataset) / world)  # each rank's rows, padding included
        steps = shard // bs if self.args.dataloader_drop_last else math.ceil(shard / bs)
        output.metrics.update(speed_metrics(prefix, start, num_samples=len(dataset), num_steps=steps))
        return output

    def _generation(self) -> Callable[[dict[str, torch.Tensor]], Any] | None:
        """What produces predictions in place of the logits: nothing here (``Seq2SeqTrainer``
        generates)."""
        return None

    def save_model(self, output_dir: str | None = None) -> Path | None:
        """An HF export (config, safetensors, tokenizer) of the current weights; default: output_dir."""
        target = Path(output_dir or self.args.output_dir)
        adapter = is_adapter(self.model)  # a LoRA run exports its adapter: the weights that train
        if self.engine:
            state_dict = self.engine.full_state_dict(trainable_only=adapter)
        else:
            trained = {k: p for k, p in self.model.named_parameters() if p.requires_grad}
            state_dict = trained if adapter else self.model.state_dict()
        if self.dist.is_main:
            module = self.engine.module if self.engine else self.model
            export_hf(module, state_dict, self.processing_class, target)
            torch.save(self.args, target / "training_args.bin")  # as HF's save_model
        barrier("save_model")
        return target

    def _prepare_training(self, spec: Any) -> ResumableDistributedSampler:
        """Plan the run for resuming ``spec`` (unless the plan given is for it and unused): the
        checkpoint, the global batch it keeps, the run's length from the data; then build the engine.
        An engine built already (a second ``train``, or ``evaluate`` first) keeps its config."""
        if self.train_dataset is None:
            raise ValueError("Trainer.train: train_dataset is required")
        plan = self.plan
        if plan is None or self.engine is not None or plan.steps is None or plan.resume != spec:
            self.plan = self._plan_run(spec, len(self.train_dataset), self.state.max_steps, held=True)
        self.args, state = self.plan.args, self.state
        state.steps_per_epoch, state.max_steps, state.num_train_epochs = self.plan.steps
        self._ensure_engine(state.max_steps)
        sampler = train_sampler(self.train_dataset, *self.mesh.data_ranks, self.args, self._lengths)
        self.train_dataset = prepared(self, self.train_dataset, "train")
        self.eval_dataset = prepared(self, self.eval_dataset, "eval")  # evaluated after updates
        for stage in self.stages:
            stage.started(self)
        return sampler

    def _plan_run(self, spec: Any, num_samples: int | None, total_steps: int, held: bool = False) -> RunPlan:
        return plan_run(
            self.args,
            self.hardware,
            self.dist,
            num_samples=num_samples,
            total_steps=max(total_steps, 1),
            hidden_size=model_hidden_size(self.model),
            resume=spec,
            client_optimizer=self.client_optimizer is not None,
            client_scheduler=self.client_scheduler is not None,
            ds_config=self.ds_config if self.engine is not None else None,
            output_dir_claimed=held,
        )

    @property
    def ds_config(self) -> dict[str, Any] | None:
        """The DeepSpeed config the engine runs (``ds_config.json``): the plan's."""
        return self.plan.ds_config if self.plan is not None else None

    # ---- engine and data -----------------------------------------------------------------------

    def _ensure_engine(self, total_steps: int) -> None:
        """Build the engine once, from the plan's DeepSpeed config (an evaluation-only plan first,
        where the Trainer has none yet)."""
        if self.engine is not None:
            return
        if self.plan is None:
            self.plan = self._plan_run(None, None, total_steps)
        objective = self._objective()
        if self.args.use_liger_kernel:
            apply_liger_kernel(self.model, self.args.liger_kernel_config)
        if self.args.gradient_checkpointing and hasattr(self.model, "gradient_checkpointing_enable"):
            enable_gradient_checkpointing(self.model)
        tiling = tiling_for(self.args, self.model, self.run_config, objective, self.mesh)
        with self.watchdog.phase("init"):
            self.engine = build_engine(
                self.model,
                self.ds_config,
                self.mesh,
                optimizer=optimizer_for(self.args, self.model, self.client_optimizer),
                lr_scheduler=self.client_scheduler
                or client_scheduler(self.args, total_steps, self.ds_config),
                weight_decay=self.args.weight_decay,
                gradient_checkpointing=self.args.gradient_checkpointing,
                objective=objective,
                tiling=tiling,
                torch_compile=torch_compile_for(self.args),
            )
        if self.dist.is_main:
            out = Path(self.args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / DS_CONFIG).write_text(json.dumps(self.ds_config, indent=2, sort_keys=True))
            if self.run_config is not None:
                dump_run_config(self.run_config, out / RUN_CONFIG)

    def _model_columns(self, dataset: Any, description: str | None = None) -> Any:
        """``dataset`` cut to the columns the model's forward takes (HF's ``remove_unused_columns``);
        a Trainer whose collator reads other columns overrides this."""
        return model_columns(dataset, self.model, self.args, description)

    def _objective(self) -> Objective:
        """What a step minimises: the model's (``objective_for``), with a ``compute_loss`` override,
        HF's point of change, in place of its forward. Trainers of other objectives override this."""
        overridden = type(self).compute_loss is not Trainer.compute_loss
        return objective_for(
            self.model,
            self.compute_loss if overridden else None,
            self.args.label_smoothing_factor,
            self.args.label_names,
            eval_per_batch=self._eval_per_batch,
        )

    # ---- logging, evaluation, saving -----------------------------------------------------------

    def _fire(self, event: str, **kwargs: Any) -> None:
        """Run ``event`` on every callback; as HF's, they get the model and processing class (and our engine)."""
        objects = {"model": self.model, "processing_class": self.processing_class, "engine": self.engine}
        self.control = self.callback_handler.fire(
            event, self.args, self.state, self.control, **objects, **kwargs
        )

    def _log(self, logs: dict[str, Any]) -> None:
        if self.args.include_num_input_tokens_seen != "no":  # as HF's, in every row
            logs = {**logs, "num_input_tokens_seen": self.state.num_input_tokens_seen}
        self.state.log_history.append(logs)
        # As HF's: the history's rows carry the step; the callbacks' logs do not (state.global_step has it).
        self._fire("on_log", logs={k: v for k, v in logs.items() if k != "step"})

    def _take_window_loss(self) -> tuple[float, float]:
        """The logging window's summed loss and target tokens on all ranks (the window's one
        host-device sync; the token count is already global), added to the call's totals; the
        window starts again."""
        loss_sum, tokens = all_reduce_sum(self._loss_sum * self.mesh.counts_rows).item(), self._token_sum
        self._run.add_window(loss_sum, tokens)
        self._loss_sum.zero_()
        self._token_sum = 0.0
        return loss_sum, tokens

    def _log_train(self) -> None:
        loss_sum, tokens = self._take_window_loss()
        loss = loss_sum / max(tokens, 1.0)
        logs = {
            "step": self.state.global_step,
            "epoch": self.state.epoch,  # HF's, unrounded
            "loss": loss,
            "learning_rate": self.engine.learning_rate(),
            "grad_norm": self.engine.grad_norm(),
        }
        scale = self.engine.loss_scale()
        if scale is not None:
            logs.update(loss_scale=scale, skipped_steps=self.engine.skipped_steps)
        logs.update(self.engine.objective.metric_means(self.engine.device))
        logs.update(self.timer.flush(sync_fn=device_sync(self.hardware), all_reduce_sum=host_all_reduce))
        logs.update(memory_stats(self.engine.device))
        logs.update(self._params, activation_checkpointing=self.engine.activation_checkpointing)
        logs.update(source_shares(self.state.source_blocks))
        self._log({**logs, "data_fingerprint": self._batch_hash} if self._batch_hash else logs)

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

    def _load_checkpoint(self, path: Path, weights_only: bool = False) -> None:
        saved = ckpt.load(self.engine, path, self.dist, restore_rng=not weights_only)
        if not weights_only:
            samples = len(self.train_dataset)
            self.state = resumed_state(saved, self.state, samples, self.mesh.data_ranks, self.args)

    def _flops_per_token(self) -> float | None:
        """A causal LM's model FLOPs per token (MFU); None for other models, whose rows are not token blocks."""
        if not is_causal_lm(self.model) or self.train_dataset is None:
            return None
        return flops_per_token_for_model(self.model, row_length(self.train_dataset), self.mesh.tensor)
