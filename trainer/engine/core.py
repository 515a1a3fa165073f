"""The engine contract the Trainer talks to, and what every DeepSpeed-driven engine shares.

The Trainer owns *when* things happen; an engine owns *how* DeepSpeed is driven: one optimizer step
over an accumulation window, evaluation forwards, the numbers a logging step reports, and saving
and loading DeepSpeed's shards. ``DeepSpeedEngine`` (ZeRO 0-3) and ``PipelineEngine`` (pipeline
stages) implement the four abstract methods; everything else here is written once for both.

The loss of a window is the sum of its micro-batches' losses divided by the window's normaliser on
all ranks; ``objective`` (``trainer.engine.objectives``) says what both are, so the causal-LM
token-exact loss, any HF model's own loss or a ``compute_loss`` override plug in without a subclass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.runtime.zero.utils import get_norm_dtype
from deepspeed.utils import groups

from trainer.engine import zero
from trainer.engine.mixed_precision import no_warmup_step
from trainer.engine.objectives import Batch, Objective
from trainer.engine.partitions import show_partitions
from trainer.runtime.mesh import Mesh

if TYPE_CHECKING:
    from trainer.checkpoint.writer import FileWriter  # the checkpoint layer hands its writer in


def is_decayed(name: str, param: torch.nn.Parameter) -> bool:
    """Whether weight decay applies to a parameter: matrices yes; biases, norms and other 1-d
    tensors no (the one rule the engines' groups and ``Trainer.get_decay_parameter_names`` share)."""
    shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3 partitions keep the real shape here
    return len(shape) >= 2 and not name.endswith(".bias")


@dataclass(frozen=True)
class TorchCompile:
    """HF's torch_compile: the backend and ``torch.compile``'s other options (``mode``)."""

    backend: str = "inductor"
    options: dict[str, Any] = field(default_factory=dict)


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two parameter groups: decay for matrices, none for biases, norms and other 1-d tensors."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if is_decayed(name, param) else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


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
    None there. On that path the clipping moves here: one pass of ``clip_grad_norm`` (DeepSpeed's
    parameters and reductions, ZeRO's fp64 sums) before every optimizer step measures the norm and
    clips, so grad_norm is reported whether clipping is on or off."""
    if ds.zero_optimization() or ds.fp16_enabled() or ds.bfloat16_enabled():
        return
    take_step = ds._take_model_step

    def measured_step(*args: Any, **kwargs: Any) -> None:
        max_norm = ds.gradient_clipping() or float("inf")  # inf: measure without clipping
        norm = clip_grad_norm(list(ds.module.parameters()), max_norm=max_norm, mpu=ds.mpu)
        take_step(*args, **kwargs)
        ds._global_grad_norm = norm

    ds._take_model_step = measured_step
    ds.clip_fp32_gradients = lambda: None  # clipped above already; a second pass would only repeat it


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float, mpu: Any = None) -> torch.Tensor:
    """DeepSpeed's ``clip_grad_norm_`` (L2) with each gradient's norm taken in fp64, as ZeRO 1-3 take
    it. Taken in fp32, torch's CPU norm of a million-element gradient was seen 1e-5 off, and one
    process at ZeRO-0 logged (and clipped by) a norm 8e-5 to 1.8e-4 below ZeRO 1-3's and AutoTP's
    on the default model's gradients. As in DeepSpeed's: a gradient counts on the model-parallel
    group's first rank unless it is marked model-parallel (each rank's own slice), the squares are
    summed over that group, the norm is averaged over the data-parallel group (experts differ
    there), and every gradient is clipped."""
    grads = [p.grad for p in parameters if p.grad is not None]
    first = mpu is None or mpu.get_model_parallel_rank() == 0
    counted = [p.grad for p in parameters if p.grad is not None and (first or is_model_parallel_parameter(p))]
    norms = [torch.linalg.vector_norm(g.detach().to(get_norm_dtype())) for g in counted]
    squares = torch.stack(norms).pow(2).sum().float() if norms else torch.zeros((), device=grads[0].device)
    if mpu is not None:
        dist.all_reduce(squares, group=mpu.get_model_parallel_group())
    data = groups._get_data_parallel_group()
    norm = squares.sqrt() / dist.get_world_size(group=data)
    dist.all_reduce(norm, group=data)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        grad.detach().mul_(coef)
    return norm


def checkpoints_activations(model: torch.nn.Module) -> bool:
    """Whether an HF model recomputes its activations in backward. transformers renamed the property
    ``is_gradient_checkpointing`` to ``is_activation_checkpointing`` (the old name warns); a model
    that has neither never checkpoints."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


class Engine(ABC):
    """One DeepSpeed engine behind the interface the Trainer uses.

    ``ds`` is DeepSpeed's engine, which only engines touch; ``module`` the HF model (what the
    export is written from); ``objective`` what a step minimises; ``mesh`` the run's parallel sizes
    (with the process groups the engine made); ``lr_scale`` a rollback's
    learning-rate cut, applied after the scheduler sets each step's rate. What callers outside
    ``trainer/engine/`` need of DeepSpeed and ZeRO (parameter counts, state bytes, the whole
    weights, checkpoint shards) they ask of this contract or of ``trainer.engine.zero``."""

    ds: Any
    module: torch.nn.Module
    optimizer: Any  # what deepspeed.initialize returned: the (ZeRO-wrapped) optimizer that steps
    lr_scheduler: Any  # and its scheduler (None when the config has none)
    objective: Objective
    mesh: Mesh

    def _initialize(
        self,
        model: torch.nn.Module,
        config: dict[str, Any],
        torch_compile: TorchCompile | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("optimizer") is not None and (config.get("optimizer") or {}).get("type") == "Muon":
            # Ours, built from this section (trainer/engine/muon.py); DeepSpeed's Muon is not used.
            config = {key: value for key, value in config.items() if key != "optimizer"}
        with no_warmup_step():
            self.ds, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
                model=model, config=config, **kwargs
            )
        if torch_compile is not None:
            # DeepSpeed's own compile: the module is compiled in place (its parameter names, the
            # checkpoints and the export stay as they are) and its ZeRO hooks keep working.
            self.ds.compile(backend=torch_compile.backend, compile_kwargs=dict(torch_compile.options))
        report_grad_norm(self.ds)
        show_partitions(self.ds.basic_optimizer, self.ds.optimizer)
        self.device: torch.device = self.ds.device
        self.lr_scale = 1.0
        self.step_lr: float | None = None
        #: Whether a step's loss was NaN/Inf since the loop's guard last cleared it (on the device).
        self.nonfinite_loss = torch.zeros((), dtype=torch.bool, device=self.device)

    # ---- what each engine does its own way ------------------------------------------------------

    @abstractmethod
    def train_window(self, window: list[Batch], window_tokens: float) -> torch.Tensor:
        """Forward/backward every micro-batch of one accumulation window, then one optimizer step.
        ``window_tokens``: the window's target tokens on all ranks. Returns this rank's summed
        loss, on the device."""

    def eval_step(self, batch: Batch, outputs: bool = False) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(summed loss, its count, the model's outputs when ``outputs``, else None) of this rank's
        evaluation batch, on the device; a sum over ranks counts every batch once. A collective, like
        every forward under ZeRO-3 or a pipeline."""
        result = self._eval_step(batch, outputs)
        self._after("eval_step", batch, outputs=outputs)
        return result

    @abstractmethod
    def _eval_step(self, batch: Batch, outputs: bool) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``eval_step`` as each engine carries it out."""

    def forward(self, **inputs: Any) -> Any:
        """The model's forward through DeepSpeed's engine (ZeRO-3 gathers the weights as it goes),
        outside any objective: preference training's reference pass. The caller sets ``no_grad``."""
        return self.ds(**inputs)

    def generate(self, batch: Batch, **kwargs: Any) -> torch.Tensor:
        """The model's ``generate`` on this rank's batch (``predict_with_generate``)."""
        raise NotImplementedError(f"{type(self).__name__}: generation is not supported with this engine")

    @abstractmethod
    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
        """The whole HF model's weights on rank 0 (collective); None on other ranks. ``trainable_only``:
        only the parameters that train (a LoRA adapter's)."""

    # ---- shared ---------------------------------------------------------------------------------

    @property
    def activation_checkpointing(self) -> bool:
        """Whether backward recomputes the activations a forward did not keep: the HF model's
        gradient checkpointing (a pipeline's interval, ``PipelineEngine``)."""
        return checkpoints_activations(self.module)

    def parameter_counts(self) -> tuple[int, int]:
        """(trainable, total) parameters of the HF model; a ZeRO-3 partition counts its full size."""
        return zero.parameter_counts(self.module, self.mesh.tensor)

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in model states: ``params``, ``grads``, ``optimizer``, ``other``
        (``trainer.engine.zero.state_bytes``; compare with ``trainer.planner.model_state_bytes``)."""
        return zero.state_bytes(self.module, self.optimizer)

    def close(self) -> None:
        """Free DeepSpeed's engine: its optimizer's hooks leave the model's parameters and its states
        go (``auto_find_batch_size`` builds another engine around the same model)."""
        self.ds.destroy()
        self.ds = self.optimizer = self.lr_scheduler = None

    def after(self, method: str, hook: Callable[..., None]) -> None:
        """Run ``hook`` after every call of ``method`` (``"save"`` or ``"eval_step"``) returns, with
        that call's arguments (a save's directory first, an evaluation's batch). Fault injection
        (``trainer.loop.faults``) crashes a rank there; nothing else in training uses it."""
        if method not in ("save", "eval_step"):
            raise ValueError(f"no hook point {method!r}; there are 'save' and 'eval_step'")
        self.__dict__.setdefault("_hooks", {}).setdefault(method, []).append(hook)

    def _after(self, method: str, *args: Any, **kwargs: Any) -> None:
        for hook in self.__dict__.get("_hooks", {}).get(method, ()):
            hook(*args, **kwargs)

    def local_targets(self, window: list[Batch]) -> float:
        """This rank's share of the window's normaliser (target tokens for a causal LM), counted on
        the host from the CPU batches, so it can ride the Trainer's host-only vote and never waits
        on the device stream."""
        return float(sum(self.objective.count(b) for b in window))

    def to_device(self, batch: Batch) -> Batch:
        return {
            k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()
        }

    def train(self, mode: bool = True) -> None:
        self.ds.train(mode)

    def learning_rate(self) -> float:
        """The rate the last optimizer step applied (what HF's Trainer logs for a step); before any
        step, the rate the next one will apply."""
        return self.step_lr if self.step_lr is not None else float(self.ds.get_lr()[0])

    def _about_to_step(self) -> None:
        """Called just before the optimizer steps: the scheduler then moves the rate on."""
        self.step_lr = float(self.ds.get_lr()[0])

    def grad_norm(self) -> float | None:
        norm = self.ds.get_global_grad_norm()
        return None if norm is None else float(norm)

    def loss_scale(self) -> float | None:
        """Current fp16 loss scale; None outside fp16."""
        return float(self.ds.loss_scale()) if self.ds.fp16_enabled() else None

    @property
    def skipped_steps(self) -> int:
        return int(self.ds.skipped_steps)

    def set_lr_scale(self, scale: float) -> None:
        """A rollback's learning-rate cut: every later step's rate (as the scheduler sets it) times ``scale``."""
        self.lr_scale = scale

    def _stepped(self, loss: torch.Tensor) -> torch.Tensor:
        """After the optimizer step: a rollback's rate cut applied to the next, and a non-finite
        ``loss`` noted for the guard (on the device: nothing waits). Returns ``loss``."""
        self.nonfinite_loss |= ~torch.isfinite(loss)
        if self.lr_scale != 1.0:
            for group in self.ds.optimizer.param_groups:
                group["lr"] *= self.lr_scale
        return loss

    # ---- DeepSpeed state on disk ---------------------------------------------------------------

    def save(self, directory: str, tag: str, client_state: dict[str, Any], writer: FileWriter) -> None:
        """DeepSpeed's shards of this rank, every file through ``writer`` (which may copy to host
        memory and write in the background)."""
        # universal_checkpoint_info lets ds_to_universal convert this save for another world size;
        # AutoTP's says how its split weights join (empty otherwise, as DeepSpeed leaves it out).
        # With expert-parallel layers DeepSpeed writes its own and refuses the key from a client.
        info = getattr(self.module, UNIVERSAL_CHECKPOINT_INFO, None) or {}
        moe = getattr(self.ds, "has_moe_layers", False)
        state = client_state if moe else {UNIVERSAL_CHECKPOINT_INFO: dict(info), **client_state}
        own = self.ds.checkpoint_engine
        self.ds.checkpoint_engine = _ThroughWriter(writer, getattr(own, "zipfile_serialization", False))
        try:
            self.ds.save_checkpoint(directory, tag=tag, client_state=state, save_latest=False)
        finally:
            self.ds.checkpoint_engine = own
        self._after("save", directory, tag, client_state=client_state, writer=writer)

    def load(self, directory: str, tag: str, load_optimizer_states: bool = True) -> dict[str, Any]:
        path, client_state = self.ds.load_checkpoint(
            directory, tag=tag, load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=True
        )
        if path is None:
            raise FileNotFoundError(f"{directory}/{tag}: DeepSpeed found no checkpoint to load")
        self._loaded(load_optimizer_states)
        return client_state or {}

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy a whole model's weights (named as ``full_state_dict`` names them) into the module,
        for evaluation and the export (``load_best_model_at_end`` from a ``save_only_model``
        checkpoint); optimizer states are left as they are. Under ZeRO-3 rank 0's copy is
        partitioned over the ranks as the gather ends."""
        partitioned = self.ds.zero_optimization_partition_weights()
        tensors = dict(self.module.named_parameters())
        missing = sorted(set(tensors) - set(weights))
        # Buffers the state dict holds (non-persistent ones, like rotary frequencies, it does not).
        tensors |= {name: b for name, b in self.module.named_buffers() if name in weights}
        if missing:
            raise ValueError(f"the saved weights do not match the model: missing {missing[:5]}")
        for name, tensor in tensors.items():
            gather = partitioned and isinstance(tensor, torch.nn.Parameter)
            with torch.no_grad(), zero.gathered([tensor], modifier_rank=0, enabled=gather):
                if not gather or self.ds.global_rank == 0:
                    tensor.copy_(weights[name].to(tensor.dtype))

    @abstractmethod
    def _loaded(self, optimizer_states: bool) -> None:
        """What an engine redoes after DeepSpeed loaded a checkpoint into it."""

    @abstractmethod
    def load_universal(self, directory: str, tag: str) -> dict[str, Any]:
        """Load a universal checkpoint (saved on any number of ranks), re-partitioned for this one."""
