"""Throughput, model FLOPs and MFU: what a training step achieves against what the GPU could do.

The step timer that measures them over a logging window is ``trainer.observe.window``'s.
docs/observability.md defines each metric.
"""

from __future__ import annotations

import re
from typing import Any

import torch

# ---------------------------------------------------------------- FLOPs and peaks


def model_flops_per_token(
    n_params: int, n_layers: int, hidden_size: int, seq_len: int, n_embedding_params: int = 0
) -> float:
    """Training FLOPs per token: 6·N + 12·L·h·s.

    N is the parameters that take part in matrix multiplies: all parameters minus
    ``n_embedding_params``, the lookup tables (token embeddings not tied to the output layer, position
    embeddings), which cost no multiply. Each such parameter costs 2 FLOPs per token forward and 4
    backward. The attention scores (Q·Kᵀ) and their product with V add 2·2·s·h FLOPs per layer and
    token forward, 3x that with backward: 12·L·h·s (the full s x s matrix, as the PaLM paper counts).
    Activation recomputation is not counted: this is model FLOPs, the numerator of MFU.
    """
    return 6.0 * (n_params - n_embedding_params) + 12.0 * n_layers * hidden_size * seq_len


def lookup_params(model: Any, tensor: int = 1) -> int:
    """Parameters of ``model``'s embedding tables that are only looked up (not tied to the output
    layer); ``tensor``: the ranks AutoTP split the model over."""
    from trainer.engine.zero import numel  # a ZeRO-3 stub's real size; DeepSpeed loads only when counting

    out_weight = None
    if hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None:
        out_weight = model.get_output_embeddings().weight
    return sum(
        numel(m.weight, tensor)
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and m.weight is not out_weight
    )


def flops_per_token_for_model(model: Any, seq_len: int, tensor: int = 1) -> float:
    """``model_flops_per_token`` for an HF causal LM, reading layers and hidden size from its config;
    ``tensor``: the ranks AutoTP split the model over."""
    from trainer.engine.zero import numel  # a ZeRO-3 stub's real size; DeepSpeed loads only when counting

    unique = {id(p): numel(p, tensor) for p in model.parameters()}  # tied weights once
    cfg = model.config
    return model_flops_per_token(
        sum(unique.values()), cfg.num_hidden_layers, cfg.hidden_size, seq_len, lookup_params(model, tensor)
    )


# Dense (no 2:4 sparsity) peak TFLOP/s per GPU from the vendors' datasheets. "fp32" is the plain
# (non-tensor-core) rate, which is what fp32 matmuls get unless TF32 is enabled; "tf32" the TF32
# tensor-core rate. Entries are matched in order on the device name, so specific names come first.
# A10G: AWS publishes no datasheet of its own; the A10's figures are used.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    (r"H100.*NVL|H200.*NVL", {"bf16": 835, "fp16": 835, "tf32": 417.5, "fp32": 60}),
    (r"H100.*PCIe", {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51}),
    (r"H100|H200|H800|GH200", {"bf16": 989, "fp16": 989, "tf32": 494.5, "fp32": 67}),
    (r"A100|A800", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
    (r"B200", {"bf16": 2250, "fp16": 2250}),
    (r"L40S", {"bf16": 362, "fp16": 362, "tf32": 183, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3}),
    (r"\bA10G?\b", {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2}),
    (r"V100.*PCI", {"fp16": 112, "fp32": 14}),
    (r"V100", {"fp16": 125, "fp32": 15.7}),
    (r"\bT4\b", {"fp16": 65, "fp32": 8.1}),
    (r"RTX 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (r"MI300X|MI325X", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
]
_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s of a GPU for a compute dtype (bf16, fp16, tf32, fp32), or None if unknown."""
    dtype = _DTYPE_NAMES.get(dtype.removeprefix("torch."), dtype)
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peaks.get(dtype)
    return None


# ---------------------------------------------------------------- throughput
