"""A small adapter over ``deepspeed.initialize``: forward, token-normalised backward, step, save/load.

The Trainer owns *when* things happen; this module owns *how* DeepSpeed is driven:

- The accumulation boundary is set explicitly before every backward, so a short final window of an
  epoch is stepped like any other.
- The loss of a window is the sum of per-token losses divided by the number of target tokens in the
  whole window on all ranks. DeepSpeed averages gradients over data-parallel ranks and (by default)
  divides by the accumulation steps; we turn the latter off and pre-multiply by the world size, so
  the update equals one big batch however it is split into micro-batches and ranks.
"""

from __future__ import annotations

from typing import Any

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.runtime.utils import clip_grad_norm_

from trainer.checkpoint_writer import FileWriter
from trainer.distributed import host_all_reduce

IGNORE_INDEX = -100


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two parameter groups: decay for matrices, none for biases, norms and other 1-d tensors."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3 partitions keep the real shape here
        (no_decay if len(shape) < 2 or name.endswith(".bias") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Target tokens of a causal-LM batch: labels after the one-token shift, minus ignored ones."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over non-ignored targets, in fp32.

    The labels are shifted (and padded with -100) rather than the logits sliced: slicing would
    copy the largest activation in forward and write a full-size zero gradient in backward."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


class _ThroughWriter(CheckpointEngine):
    """DeepSpeed's checkpoint-engine interface over our FileWriter, used for the length of a save."""

    def __init__(self, writer: FileWriter, zipfile: bool):
        super().__init__()
        self.writer, self.zipfile = writer, zipfile

    def create(self, info: Any) -> None:
        pass

    def save(self, state_dict: Any, path: str) -> None:
        self.writer.save(state_dict, path, zipfile=self.zipfile)

    def load(self, path: str, map_location: Any = None) -> Any:
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: Any) -> bool:
        return True  # ours is the checkpoint-level commit, after every rank's writer is done

    def preserves_storage_sharing(self) -> bool:
        # An asynchronous writer copies tensor by tensor anyway, so DeepSpeed need not clone first.
        return not self.writer.asynchronous


def report_grad_norm(ds: Any) -> None:
    """DeepSpeed's ZeRO and mixed-precision optimizers report the gradient norm; plain ZeRO-0 in
    fp32 does not (it clips, when asked, and drops the norm), so ``get_global_grad_norm()`` stays
    None there. On that path the clipping moves here: one pass of DeepSpeed's own ``clip_grad_norm_``
    (same parameters, same all-stage, all-rank reduction) before every optimizer step measures the
    norm and clips, so grad_norm is reported whether clipping is on or off."""
    if ds.zero_optimization() or ds.fp16_enabled() or ds.bfloat16_enabled():
        return
    take_step = ds._take_model_step

    def measured_step(*args: Any, **kwargs: Any) -> None:
        max_norm = ds.gradient_clipping() or float("inf")  # inf: measure without clipping
        norm = clip_grad_norm_(parameters=ds.module.parameters(), max_norm=max_norm, mpu=ds.mpu)
        take_step(*args, **kwargs)
        ds._global_grad_norm = norm

    ds._take_model_step = measured_step
    ds.clip_fp32_gradients = lambda: None  # clipped above already; a second pass would only repeat it


class DeepSpeedDriver:
    """What the Engine and the pipeline adapter share: inputs, reporting, saving, the LR scale.
    Subclasses set ``ds`` (the DeepSpeed engine), ``device`` and ``lr_scale``."""

    ds: Any
    device: torch.device
    lr_scale: float

    def model_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(labels, model inputs) on the device. Packed rows carry position_ids that restart at each
        document: then the attention mask is left out, so HF models build a block-diagonal mask from
        the positions and documents do not attend to each other. Right padding needs no mask in a
        causal model (no real token looks right), and padded labels are ignored anyway."""
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        labels = batch.pop("labels")
        if "position_ids" in batch:
            batch.pop("attention_mask", None)
            batch["use_cache"] = False
        return labels, batch

    def train(self, mode: bool = True) -> None:
        self.ds.train(mode)

    def set_train_batch_size(self, total: int) -> None:
        """A new global batch (another world size on resume): the accumulation steps absorb it."""
        self.ds.set_train_batch_size(total)

    # ---- what a logging step reports -----------------------------------------------------------

    def learning_rate(self) -> float:
        return float(self.ds.get_lr()[0])

    def grad_norm(self) -> float | None:
        norm = self.ds.get_global_grad_norm()
        return None if norm is None else float(norm)

    def loss_scale(self) -> float | None:
        """Current fp16 loss scale; None outside fp16."""
        return float(self.ds.loss_scale()) if self.ds.fp16_enabled() else None

    @property
    def skipped_steps(self) -> int:
        return int(self.ds.skipped_steps)

    # ---- DeepSpeed state on disk ---------------------------------------------------------------

    def save(self, directory: str, tag: str, client_state: dict[str, Any], writer: FileWriter) -> None:
        """DeepSpeed's shards of this rank, every file through ``writer`` (which may copy to host
        memory and write in the background)."""
        # universal_checkpoint_info lets ds_to_universal convert this save for another world size.
        state = {"universal_checkpoint_info": {}, **client_state}
        own = self.ds.checkpoint_engine
        self.ds.checkpoint_engine = _ThroughWriter(writer, getattr(own, "zipfile_serialization", False))
        try:
            self.ds.save_checkpoint(directory, tag=tag, client_state=state, save_latest=False)
        finally:
            self.ds.checkpoint_engine = own

    def _apply_lr_scale(self) -> None:
        """A rollback's learning-rate cut: the scheduler sets each step's rate, then we scale it."""
        if self.lr_scale != 1.0:
            for group in self.ds.optimizer.param_groups:
                group["lr"] *= self.lr_scale


class Engine(DeepSpeedDriver):
    """Drives one DeepSpeed engine. ``module`` is the wrapped model; ``ds`` the DeepSpeed engine."""

    def __init__(
        self,
        model: torch.nn.Module,
        ds_config: dict[str, Any],
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        weight_decay: float = 0.0,
    ):
        if "activation_checkpointing" in ds_config:
            # Custom models that call deepspeed.checkpointing.checkpoint read these settings.
            deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)
        params = optimizer.param_groups if optimizer is not None else weight_decay_groups(model, weight_decay)
        self.ds, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
            model=model,
            config=ds_config,
            model_parameters=None if optimizer is not None else params,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
        )
        report_grad_norm(self.ds)
        self.device = self.ds.device
        self.world_size = self.ds.dp_world_size
        self.lr_scale = 1.0

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    # ---- one accumulation window ---------------------------------------------------------------

    def window_targets(self, batches: list[dict[str, torch.Tensor]]) -> float:
        """Target tokens in a whole window on all ranks. Counted on the host from the CPU batches
        and summed over the gloo control group, so the device stream is never waited on."""
        local = float(sum(count_targets(b) for b in batches))
        return max(host_all_reduce([local])[0], 1.0)

    def forward_backward(
        self, batch: dict[str, torch.Tensor], window_tokens: float, is_boundary: bool, poison: bool = False
    ) -> torch.Tensor:
        """One micro-batch; returns its detached summed loss (for logging, stays on device)."""
        self.ds.set_gradient_accumulation_boundary(is_boundary)
        labels, inputs = self.model_inputs(batch)
        loss_sum = causal_lm_loss_sum(self.ds(**inputs).logits, labels)
        if poison:  # fault injection: a non-finite loss, as a diverging run would produce
            loss_sum = loss_sum * float("nan")
        # DeepSpeed averages gradients over ranks; multiplying by the world size turns that into a sum.
        self.ds.backward(loss_sum * (self.world_size / window_tokens), scale_wrt_gas=False)
        return loss_sum.detach()

    def step(self) -> None:
        self.ds.step()
        self._apply_lr_scale()

    def train_window(
        self, window: list[dict[str, torch.Tensor]], poison: bool = False, window_tokens: float | None = None
    ) -> tuple[torch.Tensor, float]:
        """Forward/backward every micro-batch of one accumulation window, then one optimizer step.
        Returns (this rank's summed loss on device, target tokens of the window on all ranks).
        ``window_tokens``: that global count when the caller already summed it over ranks."""
        tokens = self.window_targets(window) if window_tokens is None else window_tokens
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(window):
            loss_sum += self.forward_backward(batch, tokens, i == len(window) - 1, poison=poison)
        self.step()
        return loss_sum, tokens

    @torch.no_grad()
    def logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The logits of this rank's batch (a collective under ZeRO-3, like every forward)."""
        return self.ds(**self.model_inputs(batch)[1]).logits

    @torch.no_grad()
    def eval_loss_sum(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, target count) of one batch, both on device."""
        labels, inputs = self.model_inputs(batch)
        count = (labels[:, 1:] != IGNORE_INDEX).sum().float()
        return causal_lm_loss_sum(self.ds(**inputs).logits, labels), count

    def load(self, directory: str, tag: str, load_optimizer_states: bool = True) -> dict[str, Any]:
        path, client_state = self.ds.load_checkpoint(
            directory,
            tag=tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=True,
        )
        if path is None:
            raise FileNotFoundError(f"{directory}/{tag}: DeepSpeed found no checkpoint to load")
        if load_optimizer_states:
            _replay_cpu_adam_bias_state(self.ds)
        return client_state or {}

    def load_universal(self, directory: str, tag: str) -> dict[str, Any]:
        """Load a universal checkpoint (``ds_to_universal`` output, saved on any number of ranks):
        weights, optimizer moments and scheduler, re-partitioned for this world size."""
        config = self.ds._config
        groups = self.ds.optimizer.optimizer.param_groups if hasattr(self.ds.optimizer, "optimizer") else []
        decay = [g.get("weight_decay") for g in groups]
        # The same switch as "checkpoint": {"load_universal": true}; DeepSpeed reads it only at load.
        config.load_universal_checkpoint = True
        try:
            client_state = self.load(directory, tag)
        finally:
            config.load_universal_checkpoint = False
        if self.ds.zero_optimization_partition_weights():
            # ZeRO-3's universal load copies the first group's hyperparameters to every group (which
            # would put weight decay on the no-decay group) and gives every group one shared step
            # tensor (which torch's Adam then advances once per group per step). Both are undone here.
            for group, value in zip(groups, decay, strict=True):
                group["weight_decay"] = value
            for state in self.ds.optimizer.optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
        return client_state

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on rank 0 (gathered under ZeRO-3); None on other ranks."""
        if self.ds.zero_optimization_partition_weights():
            state = self.ds._zero3_consolidated_16bit_state_dict()
            return state if self.ds.global_rank == 0 else None
        if self.ds.global_rank != 0:
            return None
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items()}


def _replay_cpu_adam_bias_state(ds: Any) -> None:
    """Make DeepSpeed's CPU Adam kernels resume bit-exactly.

    Both DeepSpeedCPUAdam (offload) and FusedAdam on the CPU accelerator keep beta1^t and beta2^t
    in a C++ optimizer object that outlives each call and is not part of any checkpoint. In a
    continuing run they are built up by one float multiplication per step; a fresh process that
    first sees step t computes them with pow() instead, which differs in the last bit, so every
    update after a resume drifts by ~1e-7. Replaying steps 1..t on empty tensors rebuilds the
    exact same products. CUDA's FusedAdam computes the powers per call and needs nothing.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    opt = getattr(ds, "basic_optimizer", None)
    if isinstance(opt, FusedAdam) and ds.device.type == "cpu":

        def call(k: int, group: dict[str, Any], t: list[torch.Tensor]) -> None:
            opt.multi_tensor_adam(2048 * 32, opt._dummy_overflow_buf, [[x] for x in t], 0.0, *group["betas"],
                                  group["eps"], k, opt.adam_w_mode, int(group["bias_correction"]), 0.0)  # fmt: skip
    elif isinstance(opt, DeepSpeedCPUAdam):

        def call(k: int, group: dict[str, Any], t: list[torch.Tensor]) -> None:
            opt.ds_opt_adam.adam_update(opt.opt_id, k, 0.0, *group["betas"], group["eps"], 0.0,
                                        group["bias_correction"], t[1], t[0], t[2], t[3])  # fmt: skip
    else:
        return
    steps = [int(s["step"]) for s in opt.state.values() if "step" in s]
    # Empty tensors: the kernel still advances its beta powers, but skips its OpenMP loop (~6 us a call).
    dummy = [torch.zeros(0) for _ in range(4)]  # grad, param, exp_avg, exp_avg_sq
    for k in range(1, max(steps, default=0) + 1):
        for group in opt.param_groups:  # in the order a real step visits them
            call(k, group, dummy)
