"""Two numbers DeepSpeed's mixed-precision wrappers of ZeRO-0 (bf16/fp16) get wrong, set right.

At ZeRO-0, bf16 and fp16 wrap the optimizer in ``FP16_UnfusedOptimizer`` (``FP16_Optimizer`` for
FusedAdam), which keeps an fp32 copy of each parameter for the optimizer to step.

- Built, the wrapper steps the optimizer once on zero gradients to create its state (DeepSpeed PR
  #5104, open, removes that step). The step is not inert: Adam counts it, so the first real
  update takes the second step's bias correction (0.74 of torch's), and decoupled weight decay
  shrinks the fp32 masters, which then differ from the model's weights. ``no_warmup_step`` holds
  it back; torch's optimizers create their state on the first real step, as without DeepSpeed.
- The unfused wrapper takes the gradient norm (which it logs and clips by) as fp32 norms of each
  gradient: on a CPU that was 2.4e-5 off the exact norm of a small Llama's bf16 gradients, where
  ZeRO 1-3 were within 1e-7. ``fp64_weight_norm`` takes each norm in fp64, as ZeRO does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.fp16 import unfused_optimizer
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.utils import get_weight_norm, is_model_parallel_parameter
from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank


@contextmanager
def no_warmup_step() -> Iterator[None]:
    """While DeepSpeed builds the engine, its ZeRO-0 mixed-precision wrappers do not step the
    optimizer on zero gradients."""
    wrappers = (FP16_Optimizer, FP16_UnfusedOptimizer)
    saved = [w.initialize_optimizer_states for w in wrappers]
    for wrapper in wrappers:
        wrapper.initialize_optimizer_states = lambda self: None
    try:
        yield
    finally:
        for wrapper, method in zip(wrappers, saved, strict=True):
            wrapper.initialize_optimizer_states = method


def fp64_weight_norm(tensors: Any, norm_type: float = 2, mpu: Any = None) -> float:
    """DeepSpeed's ``get_weight_norm`` (the unfused wrapper's gradient norm) with each tensor's L2
    norm taken in fp64: the same tensors counted (on the model-parallel group's first rank unless
    marked model-parallel), the squares summed over that group, -1 for a non-finite norm."""
    if norm_type != 2:
        return get_weight_norm(tensors, norm_type, mpu)
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    first = bwc_tensor_model_parallel_rank(mpu=mpu) == 0
    counted = [
        t
        for t in tensors
        if not getattr(t, "ds_pipe_replicated", False) and (first or is_model_parallel_parameter(t))
    ]
    squares = sum(
        (torch.linalg.vector_norm(t.detach().double()) ** 2 for t in counted),
        torch.zeros((), dtype=torch.float64),
    )
    total = torch.tensor(
        [float(squares)], dtype=torch.float64, device=get_accelerator().current_device_name()
    )
    if mpu is not None:
        dist.all_reduce(total, group=mpu.get_model_parallel_group())
    norm = total.item() ** 0.5
    return norm if math.isfinite(norm) else -1


unfused_optimizer.get_weight_norm = fp64_weight_norm
