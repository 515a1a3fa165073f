"""DeepSpeed's own engine (ZeRO stages 0-3, offload, mixed precision) behind the engine contract.

The accumulation boundary is set explicitly before every backward, so a short final window of an
epoch is stepped like any other. DeepSpeed averages gradients over data-parallel ranks and (by
default) divides by the accumulation steps; we turn the latter off and pre-multiply by the world
size, so the update equals one big batch however it is split into micro-batches and ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import deepspeed
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

from trainer.config.errors import ConfigError
from trainer.engine import zero
from trainer.engine.core import Batch, Engine, TorchCompile, weight_decay_groups
from trainer.engine.expert_parallel import ExpertParallel
from trainer.engine.experts import check_expert_blocks
from trainer.engine.objectives import CausalLM, Objective, Tokens
from trainer.engine.partitions import Partitioned
from trainer.engine.sequence_parallel import SequenceParallel
from trainer.engine.tensor_parallel import tensor_groups, warn_whole_head
from trainer.engine.tiling import Tiling, decoder_and_head, offload_activations, tile_mlp
from trainer.planner import GENERATION_SHARE
from trainer.runtime.distributed import all_gather_object
from trainer.runtime.mesh import Mesh


class DeepSpeedEngine(Engine):
    """``module`` is the wrapped HF model; ``ds`` DeepSpeed's engine around it."""

    def __init__(
        self,
        model: torch.nn.Module,
        ds_config: dict[str, Any],
        mesh: Mesh,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        weight_decay: float = 0.0,
        objective: Objective | None = None,
        tiling: Tiling = Tiling(),
        torch_compile: TorchCompile | None = None,
    ):
        self.objective = objective or CausalLM()
        self.tiling = tiling
        if tiling.mlp is not None:
            tile_mlp(model, tiling.mlp)
        # Groups and the attention exchange exist before DeepSpeed, which reduces over them.
        self.sp = SequenceParallel(model, mesh) if mesh.sequence > 1 else None
        if "activation_checkpointing" in ds_config:
            # Custom models that call deepspeed.checkpointing.checkpoint read these settings.
            deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)
        params = optimizer.param_groups if optimizer is not None else weight_decay_groups(model, weight_decay)
        if mesh.tensor > 1 and isinstance(getattr(model, "peft_config", None), dict):
            raise ConfigError(
                "LoRA runs with ZeRO 0-3 and data parallelism, not with tensor parallelism (AutoTP does "
                "not split peft's wrapped layers)",
                path="tensor_parallel.autotp_size",
            )
        groups = (
            {"sequence": self.sp.mpu}
            if self.sp
            else {"tensor": tensor_groups(mesh.tensor)}
            if mesh.tensor > 1
            else {}
        )
        self.mesh = mesh.with_groups(**groups)
        check_expert_blocks(model, (ds_config.get("zero_optimization") or {}).get("stage", 0), mesh)
        self.experts = ExpertParallel(model, ds_config, mesh.expert) if mesh.expert > 1 else None
        if self.experts is not None and optimizer is None:
            params = self.experts.named_groups(params)
        self._initialize(
            model,
            ds_config,
            model_parameters=None if optimizer is not None else params,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            mpu=next(iter(groups.values()), None),
            torch_compile=torch_compile,
        )
        if self.experts is not None:
            self.mesh = self.mesh.with_groups(expert=self.experts.made())
        # What DeepSpeed divides the summed gradients by: the data-parallel size, except that
        # ZeRO-3's reduce-scatter averages over every rank, sequence-parallel ones too (0.19).
        zero3_sp = self.sp is not None and self.ds.zero_optimization_partition_weights()
        self.grad_divisor = mesh.zero_shards if zero3_sp else mesh.data_parallel_size
        # The objectives' per-token service; predictions read the logits, so they forward untiled.
        # A tiled loss runs the head as the engine left it (AutoTP replaces the layers it splits).
        tiles = (decoder_and_head(self.module)[1], tiling.loss) if tiling.loss else None
        self.tokens = Tokens(self.ds, tiles, self.sp)
        self.untiled = Tokens(self.ds, None, self.sp)
        self.gathered = (0, 0)  # by the last rollout: bytes of weights gathered once, of the whole
        if mesh.tensor > 1:
            warn_whole_head(self.module, mesh.tensor)

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    def train_window(self, window: list[Batch], window_tokens: float) -> torch.Tensor:
        # DeepSpeed averages gradients over ranks; multiplying by its divisor turns that into a sum.
        scale = self.grad_divisor / window_tokens
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(window):
            self.ds.set_gradient_accumulation_boundary(i == len(window) - 1)
            loss = self.loss_sum(batch, window_tokens)
            self.ds.backward(loss * scale, scale_wrt_gas=False)
            loss_sum += loss.detach()
        self._about_to_step()
        self.ds.step()
        return self._stepped(loss_sum)

    def loss_sum(self, batch: Batch, items: float) -> torch.Tensor:
        """One micro-batch's summed loss; ``items``: the window's normaliser on all ranks."""
        with offload_activations() if self.tiling.offload else nullcontext():
            return self.objective.loss_sum(self.tokens, self.to_device(batch), items)[0]

    @torch.no_grad()
    def _eval_step(self, batch: Batch, outputs: bool = False) -> tuple[torch.Tensor, torch.Tensor, Any]:
        if self.sp is not None and outputs:
            raise NotImplementedError(
                "predictions (predict, compute_metrics) with sequence_parallel_size > 1: each rank holds a "
                "slice of every row's logits; evaluate the loss, or predict in a run without it"
            )
        tokens = self.untiled if outputs else self.tokens
        loss, count, out = self.objective.eval_sum(tokens, self.to_device(batch))
        return loss, count, out if outputs else None

    @torch.no_grad()
    def generate(self, batch: Batch, **kwargs: Any) -> torch.Tensor:
        """The HF model's ``generate`` on this rank's batch, labels left out. Under ZeRO-3 every
        forward gathers weights from all ranks, so a rank that finished keeps stepping until all
        have (HF's ``synced_gpus``)."""
        if self.sp is not None:
            raise NotImplementedError("generation with sequence_parallel_size > 1: no rank holds a whole row")
        inputs = {k: v for k, v in self.to_device(batch).items() if k != "labels"}
        kwargs.setdefault("synced_gpus", bool(self.ds.zero_optimization_partition_weights()))
        return self.module.generate(**inputs, **kwargs)

    @torch.no_grad()
    def rollout(
        self, inputs: Batch, config: Any, gather: bool = True, max_bytes: float | None = None
    ) -> torch.Tensor:
        """Prompts and completions the HF model samples from this rank's left-padded prompts
        (``config``: a ``GenerationConfig``), with its KV cache: activation checkpointing is off
        meanwhile, the module's mode as it is. Under ZeRO-3, ``gather``: as much of the weights as
        ``max_bytes`` hold (default: ``GENERATION_SHARE`` of the free device memory, the least over
        the ranks) gathered once for the generation, the whole model where it fits
        (``zero.generation_weights``); the rest is gathered by each forward as in training, the ranks
        stepping together until all are done. ``self.gathered``: (bytes gathered once, whole bytes)."""
        partitioned = bool(self.ds.zero_optimization_partition_weights())
        budget = 0.0
        if gather and partitioned:
            own = GENERATION_SHARE * zero.device_free_bytes(self.device) if max_bytes is None else max_bytes
            budget = min(all_gather_object(own))  # every rank gathers the same parameters
        with zero.generation_weights(self.ds, budget) as self.gathered, checkpointing_off(self.module):
            whole = self.gathered[0] == self.gathered[1]
            return self.module.generate(
                **self.to_device(inputs), generation_config=config, synced_gpus=partitioned and not whole
            )

    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
        """Gathered under ZeRO-3; on rank 0 only. ``trainable_only``: the parameters that train (a
        LoRA adapter's), each gathered alone, so the frozen base is never assembled."""
        partitioned = self.ds.zero_optimization_partition_weights()
        if trainable_only:
            state = {}
            for name, param in self.module.named_parameters():
                if param.requires_grad:
                    with zero.gathered([param], enabled=partitioned):
                        state[name] = param.detach().cpu().clone()
            return state if self.ds.global_rank == 0 else None
        if self.experts is not None:  # every expert from the ranks of its group, in HF's layout
            return self.experts.full_state_dict(self.module, partitioned)
        if partitioned or self.mesh.tensor > 1:  # DeepSpeed gathers ZeRO-3's and AutoTP's pieces
            state = self.ds._consolidated_16bit_state_dict()
            return state if self.ds.global_rank == 0 else None
        if self.ds.global_rank != 0:
            return None
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items()}

    def _loaded(self, optimizer_states: bool) -> None:
        if optimizer_states:
            _replay_cpu_adam_bias_state(self.ds)

    def load_universal(self, directory: str, tag: str) -> dict[str, Any]:
        """Weights, optimizer moments and scheduler of a ``ds_to_universal`` output."""
        config = self.ds._config
        groups = self.ds.optimizer.optimizer.param_groups if hasattr(self.ds.optimizer, "optimizer") else []
        # The same switch as "checkpoint": {"load_universal": true}; DeepSpeed reads it only at load.
        config.load_universal_checkpoint = True
        try:
            client_state = self.load(directory, tag)
        finally:
            config.load_universal_checkpoint = False
        if self.ds.zero_optimization_partition_weights():
            # ZeRO-3's universal load copies the first group's saved settings to every group (which
            # would put weight decay on the no-decay group, or Muon's rate and half on AdamW's) and
            # gives every group one shared step tensor (which torch's Adam then advances once per
            # group per step). Both are undone here: each group takes its own saved settings.
            for group, saved in zip(groups, zero.universal_param_groups(directory, tag), strict=True):
                group.update({key: value for key, value in saved.items() if key != "params"})
            for state in self.ds.optimizer.optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
        if isinstance(self.ds.basic_optimizer, Partitioned):
            self.ds.basic_optimizer.after_universal_load()
        elif isinstance(self.ds.basic_optimizer, torch.optim.SGD):
            zero.momentum_from_adam_names(self.ds.optimizer)
        return client_state


def _replay_cpu_adam_bias_state(ds: Any) -> None:
    """Make DeepSpeed's CPU Adam kernels resume bit-exactly.

    Both DeepSpeedCPUAdam (offload) and FusedAdam on the CPU accelerator keep beta1^t and beta2^t
    in a C++ optimizer object that outlives each call and is not part of any checkpoint. In a
    continuing run they are built up by one float multiplication per step; a fresh process that
    first sees step t computes them with pow() instead, which differs in the last bit, so every
    update after a resume drifts by ~1e-7. Replaying steps 1..t on empty tensors rebuilds the
    exact same products. CUDA's FusedAdam computes the powers per call and needs nothing.
    """
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


@contextmanager
def checkpointing_off(module: torch.nn.Module) -> Iterator[None]:
    """Inside: the HF model's activation checkpointing off (a generation keeps its KV cache, which
    HF turns off under checkpointing in training mode); back on, as it was, on exit. transformers 5
    calls it activation checkpointing; a model of its own may have only the old names."""
    model = module.get_base_model() if hasattr(module, "get_base_model") else module
    new = hasattr(model, "activation_checkpointing_enable")
    on = bool(getattr(model, "is_activation_checkpointing" if new else "is_gradient_checkpointing", False))
    if on:
        (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()
    try:
        yield
    finally:
        if on:
            kwargs = {"use_reentrant": False}
            if new:
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
