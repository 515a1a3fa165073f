"""Long-context memory: the loss and the MLPs computed in tiles over the tokens, and activation offload.

At long context the two largest activations of a decoder are the logits, ``[tokens x vocab]`` (in
fp32 for the loss, and again for its gradient), and each MLP's intermediate, ``[tokens x
intermediate_size]``. Neither has to exist whole: both are computed row by row, so any split of
the tokens gives the same result. Here each is computed one tile of tokens at a time, in forward
and again in backward, trading one extra forward of the head (or MLP) for memory that no longer
grows with the sequence.

Why the loss uses ``torch.utils.checkpoint`` per tile, not DeepSpeed's ``TiledFusedLogitsLoss``:
that class runs the backward inside its forward and only scales the hidden states' gradient by the
gradient that later arrives. The head's gradient is accumulated during the forward with a factor
of 1, so the engine's ``loss * world_size / window_tokens`` (and fp16's loss scale) would reach the
hidden states but not the head: a wrong update. A checkpoint per tile keeps every gradient inside
the ordinary autograd graph: each parameter's gradient is accumulated once per backward, scaled like
the rest, and ZeRO's gradient hooks fire once, as for an untiled model.

Why the MLPs use DeepSpeed's ``TiledMLP`` (ALST's): it works here, CPU included, and is a close
fit: it saves only the MLP's input for backward (through ``save_for_backward``, so
``offload_activations`` moves it to host memory), its backward writes each tile's input gradient
straight into one preallocated buffer, and, as it accumulates the parameters' gradients into
``.grad`` once per tile, it tells ZeRO through ``ds_grad_is_ready`` to reduce them only after the
last tile. It splits with ``torch.chunk``, which cannot make empty tiles; ``_tiled_rows`` pads the
rows when a tile count agreed with other ranks needs them.

Under ZeRO-3 every call of a partitioned module gathers its parameters, a collective, so all ranks
must make the same number of calls: the tile count is agreed (the maximum over the ranks) whenever
the module's parameters are partitioned, and a rank with fewer tokens runs shorter (or empty) tiles.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
from torch.utils.checkpoint import checkpoint

from trainer.config.errors import ConfigError
from trainer.data import IGNORE_INDEX

# fp32 logits of one loss tile, in bytes: big enough to keep the head's matmul efficient, small
# next to the weights and activations of any model that needs tiling.
LOSS_TILE_BYTES = 2**28

# Config fields that change the logits after the head (or the hidden states before it), with the
# value that changes nothing; a model with another value cannot use head(hidden) as its logits.
_LOGIT_TRANSFORMS = {
    "final_logit_softcapping": None,  # Gemma 2/3/4 and others: cap * tanh(logits / cap)
    "logits_soft_cap": None,  # RecurrentGemma
    "logit_scale": 1.0,  # Cohere: logits * scale
    "logits_scaling": 1.0,  # Granite, MiniCPM3: logits / scaling
    "lm_head_multiplier": 1.0,  # Falcon-H1
    "output_multiplier": 1.0,
    "logits_mup_width_multiplier": 1.0,  # hidden states divided before the head
    "unpadded_vocab_size": None,  # logits sliced to a smaller vocabulary
}


def tile_size(vocab: int, tile_tokens: int = 0) -> int:
    """Tokens per loss tile: ``tile_tokens`` when given (> 0), else as many as make about 256 MiB of
    fp32 logits (at least one token)."""
    if tile_tokens < 0:
        raise ValueError(f"tile_tokens must be 0 (automatic) or positive, got {tile_tokens}")
    return tile_tokens or max(1, LOSS_TILE_BYTES // (4 * vocab))


def _agreed_tiles(tiles: int, module: torch.nn.Module, device: torch.device) -> int:
    """``tiles``, or under ZeRO-3 the largest count of any rank in the module's partition group: a
    partitioned module gathers its parameters on every call, and ranks that call it a different
    number of times would wait on each other's collectives forever."""
    group = next((p.ds_process_group for p in module.parameters() if hasattr(p, "ds_process_group")), None)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tiles
    count = torch.tensor([tiles], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count.item())


def _tile_loss(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _tile_nll(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")


def _over_tiles(
    tile_fn: Any, hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, tile_tokens: int
) -> list[torch.Tensor]:
    """``tile_fn(head, hidden, targets)`` of each tile of ``tile_tokens`` tokens, in order.

    Each tile runs under a non-reentrant checkpoint: its logits (and their fp32 copy and
    log-softmax) are dropped as soon as its loss is known and recomputed in backward, where autograd
    finishes one tile before it starts the next. So at most one tile's logits and their gradient
    exist at any time. The head is called as a module (ZeRO-3 gathers its weight in its hooks; a
    tied head is the embedding's weight, whose gradients add up as usual)."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be positive, got {tile_tokens}; see tile_size()")
    rows = hidden.reshape(-1, hidden.size(-1))
    flat = targets.reshape(-1)
    count = rows.size(0)
    # At least one tile, so that a batch without tokens still returns a loss tied to the head.
    tiles = _agreed_tiles(max(1, math.ceil(count / tile_tokens)), head, hidden.device)
    sizes = [min(tile_tokens, max(count - i * tile_tokens, 0)) for i in range(tiles)]
    out = []
    for part, part_targets in zip(rows.split(sizes), flat.split(sizes), strict=True):
        if torch.is_grad_enabled():
            out.append(checkpoint(tile_fn, head, part, part_targets, use_reentrant=False))
        else:
            out.append(tile_fn(head, part, part_targets))
    return out


def tiled_loss_sum(
    hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, tile_tokens: int
) -> torch.Tensor:
    """Summed fp32 cross-entropy of ``head(hidden)`` against ``targets`` (already shifted; -100 is
    ignored), the logits computed ``tile_tokens`` tokens at a time (``_over_tiles``)."""
    return torch.stack(_over_tiles(_tile_loss, hidden, head, targets, tile_tokens)).sum()


def tiled_token_nll(
    hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, tile_tokens: int
) -> torch.Tensor:
    """Each target's fp32 cross-entropy under ``head(hidden)``, in ``targets``' shape (0 where it is
    -100), the logits computed ``tile_tokens`` tokens at a time: for objectives that weigh tokens
    themselves (a preference loss sums each answer's)."""
    return torch.cat(_over_tiles(_tile_nll, hidden, head, targets, tile_tokens)).view(targets.shape)


def token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Each target's log-probability and its distribution's entropy, stacked on a last axis of 2,
    from ``logits`` divided by ``temperature``, in fp32."""
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(logps.exp() * logps).sum(-1)
    return torch.stack([logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy], dim=-1)


def tiled_token_logps(
    hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, tile_tokens: int, temperature: float
) -> torch.Tensor:
    """Each target's fp32 log-probability under ``head(hidden) / temperature`` and that
    distribution's entropy, shape ``targets.shape + (2,)``, the logits computed ``tile_tokens``
    tokens at a time (what an RL objective weighs its tokens by)."""

    def tile(head: torch.nn.Module, part: torch.Tensor, part_targets: torch.Tensor) -> torch.Tensor:
        return token_logps(head(part), part_targets, temperature)

    return torch.cat(_over_tiles(tile, hidden, head, targets, tile_tokens)).view(*targets.shape, 2)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model under a peft wrapper (the LoRA layers stay inside it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _logit_transforms(config: Any) -> list[str]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = []
    for key, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(text, key, neutral)
        if value is not None and value != neutral:
            found.append(f"{key}={value}")
    return found


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder, output embedding) of an HF causal LM, possibly wrapped by peft: the decoder maps
    ``input_ids``/``position_ids``/... to ``last_hidden_state``, and the model's logits must be
    exactly ``head(last_hidden_state)``. Refuses (naming ``tiled_loss``) a model whose logits are
    not, since the tiled loss would then train another function than the model computes."""
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        raise ConfigError(
            "a prompt-learning peft model adds its virtual tokens in its own forward, which the tiled "
            "loss does not run; set tiled_loss to false",
            path="tiled_loss",
        )
    hf = _unwrapped(model)
    name = type(hf).__name__
    transforms = _logit_transforms(hf.config) if hasattr(hf, "config") else []
    if transforms:
        raise ConfigError(
            f"{name} changes its logits after the output head ({', '.join(transforms)}), so the tiled "
            "loss cannot compute them; set tiled_loss to false",
            path="tiled_loss",
        )
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    decoder = getattr(hf, "base_model", hf)
    if decoder is hf and hasattr(hf, "get_decoder"):
        decoder = hf.get_decoder()
    if head is None or decoder is hf:
        raise ConfigError(
            f"{name} has no separate decoder and output embedding, so the tiled loss cannot compute its "
            "logits; set tiled_loss to false",
            path="tiled_loss",
        )
    return decoder, head


def _tiled_rows(rows: torch.Tensor, tiles: int) -> torch.Tensor:
    """``rows`` padded with zero rows where needed so that ``torch.chunk`` (what TiledMLP splits
    with) makes exactly ``tiles`` tiles: a count agreed with other ranks may exceed what this rank's
    rows give. Padded rows get no gradient, so they change no parameter's."""
    step = max(1, math.ceil(rows.size(0) / tiles))
    if math.ceil(rows.size(0) / step) == tiles:
        return rows
    return torch.cat([rows, rows.new_zeros(step * tiles - rows.size(0), rows.size(1))])


def _call_untiled(mlp: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    return mlp.untiled_forward(rows)


def _tiled_mlp_forward(mlp: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The MLP's own forward, run by DeepSpeed's TiledMLP over tiles of the flattened tokens (so the
    forward and the backward split the same rows, whatever the batch size)."""
    forward = mlp.untiled_forward
    if args or kwargs or not torch.is_tensor(x):
        return forward(x, *args, **kwargs)
    rows = x.reshape(-1, x.size(-1))
    tile = mlp.tiled_mlp_tokens or x.size(-1)  # automatic: hidden-size tokens, as ALST does
    tiles = _agreed_tiles(math.ceil(rows.size(0) / tile), mlp, x.device)
    if tiles <= 1:
        return forward(x)
    padded = _tiled_rows(rows, tiles)
    out = TiledMLP.apply(_call_untiled, mlp, padded, tiles, list(mlp.parameters()))
    return out[: rows.size(0)].reshape(*x.shape[:-1], out.size(-1))


def _decoder_mlps(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Each decoder layer's dense MLP: the modules named ``mlp`` under the decoder. Mixture-of-experts
    blocks (which have ``experts``) are left alone: their routing returns more than a tensor."""
    hf = _unwrapped(model)
    root = hf.get_decoder() if hasattr(hf, "get_decoder") else hf
    for name, module in root.named_modules():
        if name.rpartition(".")[2] == "mlp" and not hasattr(module, "experts"):
            yield module


def _refuse_dropout(mlp: torch.nn.Module) -> None:
    """TiledMLP recomputes each tile in backward without replaying the random numbers of its
    forward: a dropout would draw another mask, and the gradients would belong to neither."""
    rates = [m.p for m in mlp.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    if rates:
        raise ConfigError(
            f"{type(mlp).__name__} applies dropout (p={rates[0]}), which a tile recomputed in backward "
            "would draw differently; set the model's dropout to 0 or tiled_mlp to false",
            path="tiled_mlp",
        )


def tile_mlp(model: torch.nn.Module, tile_tokens: int = 0) -> int:
    """Make every decoder layer's MLP run over the tokens ``tile_tokens`` at a time (0: as many as
    the hidden size), forward and backward, so its ``[tokens x intermediate_size]`` activations
    are never held whole. Returns how many MLPs were changed; calling it again only changes the
    tile. Refuses (naming ``tiled_mlp``) a model in which no MLP is found, or whose MLPs use dropout."""
    if tile_tokens < 0:
        raise ValueError(f"tile_tokens must be 0 (automatic) or positive, got {tile_tokens}")
    mlps = list(_decoder_mlps(model))
    if not mlps:
        raise ConfigError(
            f"{type(_unwrapped(model)).__name__} has no decoder MLP (a module named mlp) to tile; "
            "set tiled_mlp to false",
            path="tiled_mlp",
        )
    _refuse_dropout(mlps[0])
    for mlp in mlps:
        if not hasattr(mlp, "untiled_forward"):  # the forward in place (another wrapper's, maybe)
            mlp.untiled_forward = mlp.forward
            mlp.forward = types.MethodType(_tiled_mlp_forward, mlp)
        mlp.tiled_mlp_tokens = tile_tokens
    return len(mlps)


def _is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter, or a view of one (a linear layer saves its weight transposed)."""
    return isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)


def _stays(tensor: torch.Tensor) -> bool:
    """Whether a tensor saved for backward is kept where it is rather than copied to host memory."""
    return tensor.device.type == "cpu" or _is_parameter(tensor)


@contextmanager
def offload_activations() -> Iterator[None]:
    """Within it, tensors saved for backward are kept in host memory (pinned when CUDA is there, so
    the copies back overlap compute) and return to their device when backward needs them.

    ``save_on_cpu`` does the moving, for activations only: it would also copy every saved weight,
    which frees no device memory (the parameter stays) and, under ZeRO-3, would keep a gathered copy
    of each weight in host memory. Tensors already on the CPU stay as they are."""
    offload = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
    to_host, back = offload.pack_hook, offload.unpack_hook

    def pack(tensor: torch.Tensor) -> Any:
        return tensor if _stays(tensor) else to_host(tensor)

    def unpack(packed: Any) -> torch.Tensor:
        return packed if torch.is_tensor(packed) else back(packed)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class Tiling(NamedTuple):
    """What an engine tiles: ``loss``, tokens per loss tile (0: the logits whole); ``mlp``, tokens
    per MLP tile (None: untiled, 0: automatic); ``offload``, tensors saved for backward to host."""

    loss: int = 0
    mlp: int | None = None
    offload: bool = False


def plan_tiling(
    mode: str, mlp: bool, offload: bool, tile_tokens: int, vocab: int, micro_batch_tokens: int
) -> Tiling:
    """The run's tiling. ``mode`` is ``tiled_loss``: "auto" tiles when the largest micro-batch
    (``micro_batch_tokens`` on one rank, a fixed number, so every rank decides alike) has more
    tokens than one tile, that is when its whole fp32 logits would outgrow one tile's."""
    tile = tile_size(vocab, tile_tokens)
    loss = tile if mode == "true" or (mode == "auto" and micro_batch_tokens > tile) else 0
    return Tiling(loss, tile_tokens if mlp else None, offload)
