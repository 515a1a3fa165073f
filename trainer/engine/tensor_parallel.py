"""Tensor parallelism through DeepSpeed's AutoTP: each decoder layer's projections are split over
``tensor_parallel_size`` consecutive ranks (column-wise for q/k/v and the MLP's up and gate,
row-wise for the attention output and the MLP's down, whose partial outputs an all-reduce sums).
The ranks of a group read the same rows; the engine builds the split from the DeepSpeed dict's
``tensor_parallel.autotp_size``.

What is here: the rules a split must satisfy, checked from the model's config before anything
loads, and the warning for a head that stays whole on every rank.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from deepspeed.utils import groups
from transformers import PretrainedConfig

from trainer.config.errors import ConfigError
from trainer.runtime.distributed import dist_info

log = logging.getLogger(__name__)

# The sizes AutoTP cuts: each must split evenly over the group (the attention heads whole).
SPLIT_SIZES = ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size")
# Model types DeepSpeed 0.19 carries a sharding preset for; any other needs the model's own HF
# tensor-parallel plan, or a ``tensor_parallel.partition_config``.
AUTOTP_PRESETS = ("llama", "bloom", "chatglm", "mixtral", "deepseek_v2", "qwen2", "phi3")


def check_tensor_layout(config: PretrainedConfig, size: int, custom_plan: bool = False) -> None:
    """The rules the split has to satisfy, from the model's config alone. ``custom_plan``: the
    DeepSpeed dict gives its own sharding rules (``partition_config`` or ``preset_model``)."""
    if size == 1:
        return
    text = config.get_text_config()
    problems = []
    for name in SPLIT_SIZES:
        value = getattr(text, name, None)  # None: absent (multi-head attention has no KV count)
        if isinstance(value, int) and value % size:
            problems.append(
                (f"tensor_parallel_size, {name}", f"{size} does not divide the model's {name} {value}")
            )
    planned = bool(getattr(text, "base_model_tp_plan", None)) or text.model_type in AUTOTP_PRESETS
    if not (planned or custom_plan):
        problems.append(
            ("tensor_parallel_size", f"model_type {text.model_type}: AutoTP has no sharding plan for its layers "
             "(no HF tp_plan, no DeepSpeed preset); give tensor_parallel.partition_config in the DeepSpeed "
             "config, or use a Llama-style model")
        )  # fmt: skip
    if problems:
        raise ConfigError(problems)


def warn_whole_head(module: torch.nn.Module, size: int) -> None:
    """A head AutoTP left whole (a tied embedding) costs every rank of the group its full weight."""
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    text = module.config.get_text_config() if hasattr(module, "config") else None
    if weight is None or text is None:
        return
    numel = getattr(weight, "ds_numel", weight.numel())
    whole = text.vocab_size * text.hidden_size
    if size > 1 and numel >= whole and dist_info().is_main:
        mib = whole * weight.element_size() / 2**20
        log.warning(
            "tensor_parallel_size %d: the output head (%d x %d%s) stays whole on every rank of the group: "
            "%.1f MiB of weights on each, and its gradients and optimizer states",
            size,
            text.vocab_size,
            text.hidden_size,
            ", tied to the embedding" if getattr(text, "tie_word_embeddings", False) else "",
            mib,
        )


def tensor_groups(size: int) -> Any:
    """DeepSpeed's tensor- and data-parallel groups for a split over ``size`` consecutive ranks, made
    before its engine is: handed to ``deepspeed.initialize`` as the ``mpu``, they make its batch
    check count data-parallel ranks (world / size), as the engine then does."""
    groups._init_tp_mesh_device(tensor_model_parallel_size=size)
    return groups
