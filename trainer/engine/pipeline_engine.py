"""Pipeline parallelism: DeepSpeed's ``PipelineEngine`` over an HF causal LM, behind the engine contract.

The Trainer's data. The Trainer gives every rank its own micro-batches (the sampler shards over all
ranks, as without a pipeline). The stages of one pipeline pool theirs, so each pipeline runs
``stages × gradient_accumulation_steps`` micro-batches per optimizer step and one step consumes the
same samples as the non-pipelined run on the same ranks. The resolved DeepSpeed config says so
(``trainer.config.resolve`` multiplies its accumulation steps and train batch by the stages).

The loss, as in ``DeepSpeedEngine``: a step's loss is the sum of per-token losses over every
micro-batch on every rank, divided by the target tokens of the whole window on all ranks.
DeepSpeed's pipeline divides each micro-batch loss by the accumulation steps and averages gradients
over the data-parallel replicas; the loss function multiplies both back, so the update is the same.
"""

from __future__ import annotations

from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from trainer.engine.core import Batch, Engine, checkpoints_activations, weight_decay_groups
from trainer.engine.objectives import CausalLM, next_token_targets, target_count
from trainer.engine.pipeline_layers import build_pipeline_module, gather_hf_state_dict
from trainer.runtime.mesh import Mesh


class WindowLoss:
    """The PipelineModule's ``loss_fn``. Returns the engine's summed token loss times ``scale`` (to
    undo DeepSpeed's divisions) and keeps the unscaled sum and target count of the current window
    for logging and evaluation, and, when asked, each micro-batch's logits (for predict)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.start(1.0)

    def start(self, scale: float, keep_logits: bool = False) -> None:
        self.scale, self.keep_logits = scale, keep_logits
        self.total: torch.Tensor | None = None
        self.count: torch.Tensor | None = None
        self.logits: list[torch.Tensor] = []  # on the host

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.keep_logits:
            self.logits.append(logits.detach().float().cpu())
        loss_sum = self.engine.objective.token_loss_sum(logits, next_token_targets(labels))
        count = target_count(labels)
        self.total = loss_sum.detach() if self.total is None else self.total + loss_sum.detach()
        self.count = count if self.count is None else self.count + count
        return loss_sum * self.scale

    def result(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        zero = torch.zeros((), device=device)
        return (zero if self.total is None else self.total), (
            zero.clone() if self.count is None else self.count
        )


class PipelineEngine(Engine):
    """``module`` is the HF model (the shell the export is written from); ``ds`` DeepSpeed's
    PipelineEngine over its layers. ``ds_config`` is the
    resolved config of a pipeline (``pipeline.stages`` of at least 2, batch keys pooled)."""

    def __init__(
        self,
        model: nn.Module,
        ds_config: dict[str, Any],
        mesh: Mesh,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        weight_decay: float = 0.0,
        gradient_checkpointing: bool = False,
        objective: CausalLM | None = None,
    ):
        self.objective = objective or CausalLM()
        if optimizer is not None:
            raise ValueError(
                "pipeline_parallel_size > 1: the optimizer is built per stage from the DeepSpeed config; "
                "pass optimizer settings (optim, learning_rate, ...) instead of a client optimizer"
            )
        section = ds_config.get("pipeline") or {}
        self.mesh, self.stages = mesh, mesh.pipeline
        if self.stages < 2:
            raise ValueError(f"pipeline.stages must be at least 2 for a pipeline, got {self.stages}")
        interval = int(section.get("activation_checkpoint_interval") or 0) or int(gradient_checkpointing)
        if interval and checkpoints_activations(model):
            # The pipeline checkpoints; HF's would recompute twice.
            (
                getattr(model, "activation_checkpointing_disable", None)
                or model.gradient_checkpointing_disable
            )()
        self.module = model
        self.loss = WindowLoss(self)
        pipe = build_pipeline_module(
            model,
            self.stages,
            self.loss,
            partition_method=_partition_method(section.get("partition")),
            activation_checkpoint_interval=interval,
            seed_layers=bool(section.get("seed_layers", False)),
        )
        if "activation_checkpointing" in ds_config:
            deepspeed.checkpointing.configure(pipe.mpu(), deepspeed_config=ds_config)
        self._initialize(
            pipe,
            ds_config,
            model_parameters=weight_decay_groups(pipe, weight_decay),
            lr_scheduler=lr_scheduler,
        )
        _norm_over_all_stages(self.ds)
        self._shape: tuple[int, ...] | None = None

    def train_window(self, window: list[Batch], window_tokens: float) -> torch.Tensor:
        """One optimizer step over this rank's window, pooled with the other stages' windows.
        Returns the summed loss this rank computed: the last stage's, zero on the others."""
        pooled = self._pool(window)
        self.loss.start(self.mesh.data_parallel_size * self.ds.gradient_accumulation_steps() / window_tokens)
        self._fit_shapes(pooled)
        self.ds.micro_batches = len(pooled)  # a short last window of an epoch runs fewer
        try:
            self._about_to_step()
            self.ds.train_batch(self._micro_batches(pooled))
        finally:
            self.ds.micro_batches = self.ds.gradient_accumulation_steps()
        return self._stepped(self.loss.result(self.device)[0])

    @torch.no_grad()
    def _eval_step(self, batch: Batch, outputs: bool = False) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The pipeline's pooled batches on its last stage (zero loss and count on the others). With
        ``outputs``, the last stage computes the logits of all of them and each stage takes its own
        back."""
        self._forward(batch, keep_logits=outputs)
        loss, count = self.loss.result(self.device)
        if not outputs:
            return loss, count, None
        last = self.loss.logits if self.ds.is_last_stage() else None
        gathered: list[Any] = [None] * self.stages
        dist.all_gather_object(gathered, last, group=self.ds.grid.get_pipe_parallel_group())
        return loss, count, {"logits": gathered[-1][self.ds.stage_id].to(self.device)}

    @property
    def activation_checkpointing(self) -> bool:
        """The pipeline recomputes each interval of layers in backward (the HF model's own
        checkpointing is off then: it would recompute twice)."""
        return self.ds.module.activation_checkpoint_interval > 0

    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
        # LoRA (the one use of trainable_only) is refused with a pipeline: every weight trains here.
        return gather_hf_state_dict(self.ds.module, self.module)

    def _loaded(self, optimizer_states: bool) -> None:
        self._shape = None

    def load_universal(self, directory: str, tag: str) -> dict[str, Any]:
        raise RuntimeError(
            f"{directory}: a pipeline checkpoint resumes only on the same world size and "
            "pipeline_parallel_size it was saved with"
        )

    # ---- feeding the pipeline ----------------------------------------------------------------

    def _forward(self, batch: Batch, keep_logits: bool = False) -> None:
        """One evaluation forward of the pipeline's pooled batches; the loss function records them."""
        pooled = self._pool([batch])
        self.loss.start(1.0, keep_logits=keep_logits)
        self._fit_shapes(pooled)
        self.ds.eval_batch(
            self._micro_batches(pooled),
            compute_loss=True,
            reduce_output=None,
            bcast_loss=False,
            num_micro_batches=len(pooled),
        )

    def _pool(self, batches: list[Batch]) -> list[Batch]:
        """Every stage's micro-batches, in stage order, on every stage of this pipeline."""
        keep = ("input_ids", "position_ids", "labels")
        mine = [{k: b[k] for k in keep if k in b} for b in batches]
        gathered: list[Any] = [None] * self.stages
        dist.all_gather_object(gathered, mine, group=self.ds.grid.get_pipe_parallel_group())
        return [b for part in gathered for b in part]

    def _micro_batches(self, pooled: list[Batch]) -> Any:
        return iter([((b["input_ids"], _positions(b)), b["labels"]) for b in pooled])

    def _fit_shapes(self, pooled: list[Batch]) -> None:
        """DeepSpeed sizes its stage-to-stage buffers once; a new shape resets them, and a window
        of mixed shapes (padded to each batch's longest row) sends shapes with every micro-batch."""
        shapes = {tuple(b["input_ids"].shape) for b in pooled}
        if shapes == {self._shape}:
            return
        self.ds.reset_activation_shape()
        self._shape = next(iter(shapes)) if len(shapes) == 1 else None
        self.ds.dynamic_shape = self._shape is None


def _partition_method(value: Any) -> str:
    return "parameters" if value in (None, "best") else str(value)


def _positions(batch: Batch) -> torch.Tensor:
    if "position_ids" in batch:
        return batch["position_ids"]
    rows, length = batch["input_ids"].shape
    return torch.arange(length).expand(rows, length).contiguous()


def _norm_over_all_stages(ds: Any) -> None:
    """Make fp32 ZeRO-0 gradient clipping see every stage's gradients.

    That path (``deepspeed.runtime.utils.clip_grad_norm_``) counts a parameter only on the first rank
    of the model-parallel group, which for a pipeline is its first stage, unless the parameter is
    marked model-parallel. Marking each stage's own parameters (not the tied copies that stage
    does not own) makes the norm, and so the clipping, that of the whole model. ZeRO-1 and bf16
    compute the norm per stage already; with no tensor parallelism the mark changes nothing else.
    """
    if ds.zero_optimization() or ds.fp16_enabled() or ds.bfloat16_enabled():
        return
    for param in ds.module.parameters():
        if not getattr(param, "ds_pipe_replicated", False):
            param.model_parallel = True
