"""Liger's kernels (HF's ``use_liger_kernel``, ``liger_kernel_config``), an optional integration.

liger-kernel patches a transformers model instance with fused Triton kernels (RMSNorm, RoPE, SwiGLU,
...), which run on GPUs only. The run is refused with one line before anything loads where that
cannot work: on a CPU, or without the package.
"""

from __future__ import annotations

import importlib.util

import torch

from trainer.args import TrainingArguments
from trainer.config import ConfigError
from trainer.config.hardware import Hardware
from trainer.model.modeling import is_adapter


def check_liger(args: TrainingArguments, hardware: Hardware) -> None:
    """``use_liger_kernel`` refused before anything loads where it cannot work: Liger's kernels are
    Triton GPU kernels, and liger-kernel is an optional package."""
    if not args.use_liger_kernel:
        return
    if hardware.device != "cuda":
        raise ConfigError(
            "Liger's kernels are Triton kernels for GPUs and this run is on a CPU; set use_liger_kernel false",
            path="use_liger_kernel",
        )
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("needs the liger-kernel package: pip install liger-kernel", path="use_liger_kernel")


def apply_liger_kernel(model: torch.nn.Module, config: dict[str, bool] | None) -> None:
    """HF's ``use_liger_kernel``: Liger's kernels patched into the model instance (the base model under
    a peft wrapper), with ``liger_kernel_config`` as the options of ``_apply_liger_kernel_to_instance``."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance  # optional: check_liger ran

    base = model.get_base_model() if is_adapter(model) else model
    _apply_liger_kernel_to_instance(model=base, **(config or {}))
