"""The four systems. Each trains the job and returns its final loss; all time steps with the same clock.

- ``ours``: ``trainer.Trainer``, as a user runs it.
- ``deepspeed``: ``deepspeed.initialize`` and a hand-written loop, the floor for overhead. It
  normalises the loss as our engine does (summed token losses, from the engine's loss function,
  over the window's target tokens on all ranks) and reads the same blocks in the same order, so its
  final loss must equal ours.
- ``hf_trainer``: ``transformers.Trainer`` with the same DeepSpeed config.
- ``accelerate``: ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))`` and the loop from
  accelerate's DeepSpeed examples (``accumulate``, ``backward``, DummyOptim/DummyScheduler, as the
  config defines the optimizer and scheduler). Its batches come from the same sampler as ours.

Each system builds the model with the same function and seed and gets the same DeepSpeed dict.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from trainer.bench.gate import StepClock
from trainer.bench.job import Job, collate


@dataclass
class Outcome:
    final_loss: float
    dp_world_size: int
    model: Any  # the trained module, for its size and FLOPs per token
    notes: list[str] = field(default_factory=list)


def _last_loss(log_history: list[dict[str, Any]]) -> float:
    losses = [row["loss"] for row in log_history if "loss" in row]
    if not losses:
        raise RuntimeError("the trainer logged no training loss")
    return float(losses[-1])


# ---------------------------------------------------------------- ours


def run_ours(job: Job, ds_config: dict[str, Any], dataset: Any, clock: StepClock, out: str) -> Outcome:
    from trainer.loop.build import build_run
    from trainer.loop.callbacks import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock.begin()

        def on_step_end(self, args, state, control, **kw):
            clock.step_end()
            # Log the last two steps, so the last row's loss is the last step's alone.
            if state.global_step >= state.max_steps - 1:
                control.should_log = True
            return control

    trainer = build_run(
        job.run_config(out),
        train_dataset=dataset,
        config=job.model_config(),
        data_collator=collate,
        callbacks=[Clock()],
    )
    trainer.train()
    if trainer.ds_config != ds_config:
        raise RuntimeError(
            f"ours resolved another DeepSpeed config:\n{trainer.ds_config}\nvs the job's\n{ds_config}"
        )
    return Outcome(_last_loss(trainer.state.log_history), trainer.mesh.data_parallel_size, trainer.model)


# ---------------------------------------------------------------- raw DeepSpeed


def _same_order_loader(job: Job, dataset: Any, rank: int) -> Any:
    """Our sampler: every rank's blocks in the order our Trainer reads them."""
    import torch
    from torch.utils.data import DataLoader

    from trainer.data import ResumableDistributedSampler

    sampler = ResumableDistributedSampler(len(dataset), job.world_size, rank, seed=job.seed)
    sampler.set_epoch(0)
    return DataLoader(
        dataset,
        batch_size=job.micro_batch,
        sampler=sampler,
        collate_fn=collate,
        pin_memory=job.device == "cuda",
        generator=torch.Generator().manual_seed(job.seed),
    )


def _windows(loader: Any, size: int) -> Any:
    window = []
    for batch in loader:
        window.append(batch)
        if len(window) == size:
            yield window
            window = []


def _seed_all(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_deepspeed(job: Job, ds_config: dict[str, Any], dataset: Any, clock: StepClock, out: str) -> Outcome:
    import deepspeed
    import torch
    import torch.distributed as dist

    # The engine's loss is a pure function of (logits, labels): summed next-token cross-entropy.
    # Sharing it keeps the two bit-equal if its formula changes; the loop is what is measured.
    from trainer.engine import causal_lm_loss_sum

    _seed_all(job.seed)
    model = job.build_model(ds_config)
    # The usual two groups (no decay on 1-d tensors), as our engine builds them.
    params = [p for p in model.parameters() if p.requires_grad]
    matrices = [p for p in params if len(getattr(p, "ds_shape", p.shape)) >= 2]
    vectors = [p for p in params if len(getattr(p, "ds_shape", p.shape)) < 2]
    groups = [{"params": matrices, "weight_decay": 0.0}, {"params": vectors, "weight_decay": 0.0}]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config)
    world = engine.dp_world_size
    host_group = dist.new_group(backend="gloo")  # host numbers are summed without touching the GPU
    loader = _same_order_loader(job, dataset, dist.get_rank())
    clock.begin()
    for step, window in enumerate(_windows(loader, job.grad_accum), start=1):
        # Target tokens of the whole window on all ranks: the loss is their mean, however the
        # window is split into micro-batches and ranks (DeepSpeed's own averaging undone below).
        count = torch.tensor([float(sum(b["labels"][:, 1:].numel() for b in window))], dtype=torch.float64)
        dist.all_reduce(count, group=host_group)
        tokens = max(count.item(), 1.0)
        loss_sum = torch.zeros((), device=engine.device)
        for batch in window:
            input_ids = batch["input_ids"].to(engine.device, non_blocking=True)
            labels = batch["labels"].to(engine.device, non_blocking=True)
            loss = causal_lm_loss_sum(engine(input_ids=input_ids).logits, labels)
            engine.backward(loss * (world / tokens), scale_wrt_gas=False)
            engine.step()  # DeepSpeed steps the optimizer only at the window's last micro-batch
            loss_sum += loss.detach()
        clock.step_end()
        if step == job.steps:
            break
    dist.all_reduce(loss_sum)
    return Outcome(loss_sum.item() / tokens, world, engine.module)


# ---------------------------------------------------------------- HF Trainer


def run_hf_trainer(job: Job, ds_config: dict[str, Any], dataset: Any, clock: StepClock, out: str) -> Outcome:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock.begin()

        def on_step_end(self, args, state, control, **kw):
            clock.step_end()
            if state.global_step >= state.max_steps - 1:
                control.should_log = True
            return control

    model = job.build_model(ds_config)
    config = copy.deepcopy(ds_config)
    # HF checks train_batch_size against its own world size, which accelerate gets wrong on CPU
    # ranks (it sees 1); without the key DeepSpeed derives the same value from micro x accum x world.
    config.pop("train_batch_size", None)
    args = TrainingArguments(
        output_dir=out,
        deepspeed=config,
        max_steps=job.steps,
        per_device_train_batch_size=job.micro_batch,
        gradient_accumulation_steps=job.grad_accum,
        learning_rate=job.learning_rate,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        lr_scheduler_type="cosine",
        warmup_steps=job.lr_warmup_steps,
        bf16=job.precision == "bf16",
        seed=job.seed,
        logging_steps=job.steps,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        gradient_checkpointing=job.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if job.gradient_checkpointing else None,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=dataset, data_collator=collate, callbacks=[Clock()]
    )
    trainer.train()
    world = trainer.model_wrapped.dp_world_size
    notes = []
    if trainer.accelerator.num_processes != world:
        notes.append(
            f"accelerate saw {trainer.accelerator.num_processes} process(es) of {world}: every rank read the "
            "same batches and the logged loss is rank 0's"
        )
    return Outcome(_last_loss(trainer.state.log_history), world, trainer.model, notes)


# ---------------------------------------------------------------- Accelerate


def run_accelerate(job: Job, ds_config: dict[str, Any], dataset: Any, clock: StepClock, out: str) -> Outcome:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import DummyOptim, DummyScheduler

    _seed_all(job.seed)
    plugin = DeepSpeedPlugin(hf_ds_config=copy.deepcopy(ds_config))
    accelerator = Accelerator(
        deepspeed_plugin=plugin, mixed_precision="bf16" if job.precision == "bf16" else "no"
    )
    model = job.build_model(ds_config)
    optimizer = DummyOptim(model.parameters(), lr=job.learning_rate)
    scheduler = DummyScheduler(optimizer, total_num_steps=job.steps, warmup_num_steps=job.lr_warmup_steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    loader = _same_order_loader(job, dataset, dist.get_rank())
    model.train()
    clock.begin()
    losses = []
    for step, window in enumerate(_windows(loader, job.grad_accum), start=1):
        losses = []
        for batch in window:
            batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.detach())
        clock.step_end()
        if step == job.steps:
            break
    final = torch.stack(losses).mean()
    dist.all_reduce(final)
    world = model.dp_world_size
    notes = []
    if accelerator.num_processes != world:
        notes.append(f"accelerate saw {accelerator.num_processes} process(es) of {world}")
    return Outcome(final.item() / dist.get_world_size(), world, model.module, notes)


RUNNERS = {
    "ours": run_ours,
    "deepspeed": run_deepspeed,
    "hf_trainer": run_hf_trainer,
    "accelerate": run_accelerate,
    "ours_tp": run_ours,  # on the job's tensor_parallel_job()
}
