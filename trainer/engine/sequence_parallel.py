"""Ulysses sequence parallelism: every sequence split over the N ranks of a group.

Ranks ``g*N .. g*N+N-1`` form group ``g`` (DeepSpeed's ``parallel_state_sp`` layout) and read the
same rows; each keeps its N-th of every row. Attention needs the whole sequence, so DeepSpeed's
``UlyssesSPAttentionHF`` trades the split: an all-to-all before the core attention gives each rank
the whole sequence for 1/N of the heads, and one after it gives back the rank's tokens for all
heads. It is installed in place of the model's attention function (sdpa or flash attention).

What a rank keeps of a row (``shard``): its slice of the input ids, of the positions (global
ones, so RoPE and causal masking see where each token really is) and of the next-token targets,
shifted *before* the split so the last token of a slice predicts the first of the next. The loss
is each rank's sum over its slice; the slices' target counts add up over all ranks to the rows'
own, so the window's loss stays the token mean it is without sequence parallelism.

Packed rows (positions restarting at each document) keep their documents apart: with sdpa the
core attention gets a block-causal mask built from the gathered positions (its size grows with the
square of the sequence; flash attention isolates documents from the positions alone).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from deepspeed.runtime.sequence_parallel import parallel_state_sp
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
from transformers import PretrainedConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from trainer.config.errors import ConfigError
from trainer.data import IGNORE_INDEX
from trainer.engine.objectives import next_token_targets
from trainer.runtime.mesh import Mesh

Batch = dict[str, torch.Tensor]
# Models whose attention is not handed the position ids, which the exchange needs.
WITHOUT_POSITIONS = {"gpt2"}


def check_layout(config: PretrainedConfig, size: int, world_size: int | None = None) -> None:
    """The rules the split has to satisfy, checked before a model or any data loads."""
    if size == 1:
        return
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", 1)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    problems = []
    if heads % size:
        problems.append(
            ("sequence_parallel_size", f"{size} does not divide the model's {heads} attention heads")
        )
    if kv_heads % size and size % kv_heads:
        problems.append(
            ("sequence_parallel_size", f"{size} and the model's {kv_heads} key/value heads do not divide "
             "one another (each rank needs whole key/value heads, or copies of them)")
        )  # fmt: skip
    if text.model_type in WITHOUT_POSITIONS:
        problems.append(
            ("sequence_parallel_size", f"model_type {text.model_type}: its attention does not receive "
             "position ids; use a Llama-style model (llama, mistral, qwen2, ...)")
        )  # fmt: skip
    if getattr(config, "_attn_implementation", None) == "eager":
        problems.append(
            ("attn_implementation", "eager attention builds the whole [sequence x sequence] mask; use sdpa "
             "or flash_attention_2 with sequence_parallel_size > 1")
        )  # fmt: skip
    if world_size is not None and world_size % size:
        problems.append(
            ("sequence_parallel_size", f"{size} does not divide the {world_size} ranks of this run")
        )
    if problems:
        raise ConfigError(problems)


class _AnyBatch(UlyssesSPAttentionHF):
    """DeepSpeed's exchange fixes the batch size at construction; evaluation batches and an epoch's
    last micro-batch may hold fewer rows, so the expected shapes follow each call's batch."""

    def forward(self, module: torch.nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        rows = query.shape[0]
        if rows != self.batch_size:
            self.batch_size = rows
            for name in ("required_query_shape", "required_key_value_shape", "required_context_shape"):
                shape = list(getattr(self, name))
                setattr(self, name, torch.Size([shape[0], rows, *shape[2:]]))
        return super().forward(module, query, *args, **kwargs)


def _isolating(core: Any, implementation: str) -> Any:
    """The core attention, given a block-causal mask for packed rows under sdpa.

    The mask is made once per forward and shared by its layers, as an additive mask in the query's
    dtype: sdpa keeps its mask for backward, and turns a boolean one into a float copy of its own
    at every call, which would keep one ``rows x sequence²`` tensor per layer. A weak reference
    holds it: it lives as long as the step's graph does, and an evaluation's goes after each call."""
    made: list[Any] = [None, lambda: None]  # the positions of the last mask, and a weak reference to it

    def shared_mask(positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        mask = made[1]()
        if mask is not None and mask.dtype == dtype and torch.equal(made[0], positions):
            return mask
        allowed = block_causal_mask(positions)
        if allowed is None:
            return None
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        made[:] = [positions, weakref.ref(mask)]
        return mask

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  mask: Any, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        positions = kwargs.get("position_ids")
        if mask is None and implementation == "sdpa" and positions is not None:
            mask = shared_mask(positions, query.dtype)
        return core(module, query, key, value, mask, *args, **kwargs)

    return attention


def block_causal_mask(positions: torch.Tensor) -> torch.Tensor | None:
    """[rows, 1, seq, seq] (True: may attend) where a token sees earlier tokens of its own document;
    None when no row restarts its positions (plain causal attention then does)."""
    restarts = positions[:, 1:] <= positions[:, :-1]
    if not bool(restarts.any()):
        return None
    document = F.pad(restarts.long().cumsum(1), (1, 0))
    same = document[:, :, None] == document[:, None, :]
    causal = torch.ones(
        positions.shape[1], positions.shape[1], dtype=torch.bool, device=positions.device
    ).tril()
    return (same & causal)[:, None]


class SequenceParallel:
    """The process groups and the installed attention of one run (installed once per process)."""

    _installed: Any = None

    def __init__(self, model: torch.nn.Module, mesh: Mesh):
        size = mesh.sequence
        check_layout(model.config, size, mesh.world_size)
        if SequenceParallel._installed is None:
            SequenceParallel._installed = _install(model.config, size)
        self.mpu = SequenceParallel._installed
        for module in model.modules():  # only this model's attention goes through the exchange
            module._sequence_parallel = True
        self.size = size
        self.rank = mesh.sequence_rank

    def shard(self, batch: Batch) -> Batch:
        """This rank's slice of every row: ``input_ids``, ``position_ids`` and ``shift_labels``
        (next-token targets). Rows are first padded (ignored targets) to a multiple of the size."""
        ids = batch["input_ids"]
        rows, length = ids.shape
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=ids.device).expand(rows, length)
        targets = next_token_targets(batch["labels"])
        pad = -length % self.size
        if pad:
            ids = F.pad(ids, (0, pad), value=0)
            more = torch.arange(1, pad + 1, device=ids.device)
            positions = torch.cat([positions, positions[:, -1:] + more], dim=1)
            targets = F.pad(targets, (0, pad), value=IGNORE_INDEX)
        piece = (length + pad) // self.size
        keep = slice(self.rank * piece, (self.rank + 1) * piece)
        return {
            "input_ids": ids[:, keep],
            "position_ids": positions[:, keep],
            "shift_labels": targets[:, keep],
        }

    def model_inputs(self, batch: Batch) -> tuple[torch.Tensor, Batch]:
        """(next-token targets, model inputs) of this rank's slice, where the batch is."""
        shard = self.shard(batch)
        return shard.pop("shift_labels"), {**shard, "use_cache": False}


def _install(config: PretrainedConfig, size: int) -> Any:
    """Make the groups and put the exchange in place of the model's attention function."""
    parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=size)
    implementation = config._attn_implementation
    core = ALL_ATTENTION_FUNCTIONS[implementation]
    text = config.get_text_config()
    heads = text.num_attention_heads
    exchange = _AnyBatch(
        attn=_isolating(core, implementation),
        batch_size=1,
        attn_head_count=heads,
        attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
        kv_head_count=getattr(text, "num_key_value_heads", None) or heads,
        num_hidden_layers=text.num_hidden_layers,
        process_group=parallel_state_sp.get_sequence_parallel_group(),
        seq_length_is_variable=True,
    )
    exchange.core_attn_implementation = implementation

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  mask: Any, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        # HF's mask covers this rank's slice only; the core attention gets the whole sequence.
        return exchange(module, query, key, value, None, *args, **kwargs)

    def routed(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        # Another model in this process (a sample generated on one rank) attends on its own.
        if getattr(module, "_sequence_parallel", False):
            return attention(module, *args, **kwargs)
        return core(module, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[implementation] = routed
    return parallel_state_sp
