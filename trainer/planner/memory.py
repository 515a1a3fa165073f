"""The planner's byte models, each on one GPU (or its host) for one configuration: model states
(ZeRO's partitioning, CPU offload, LoRA's adapters on a frozen or 4-bit base), DeepSpeed's buffers and
temporaries, activations and logits (per decoder layer, the loss head, tiling, activation offload) and a
node's host memory. docs/memory.md derives each term.
"""

from __future__ import annotations

from typing import Any

from trainer.planner.spec import Cluster, ModelSpec, Setup

# DeepSpeed 0.19's defaults for the zero_optimization knobs that size its buffers (in elements).
DS_DEFAULT_KNOBS = {
    "reduce_bucket_size": 5e8,
    "stage3_prefetch_bucket_size": 5e7,
    "stage3_param_persistence_threshold": 1e5,
    "stage3_max_live_parameters": 1e9,
}
# Without ZeRO the engine all-reduces gradients flattened into buckets of this many elements (fixed).
DS_ALLREDUCE_BUCKET = 5e8

# The trainer's loss tile: 256 MiB of fp32 logits (--tiled_loss auto tiles once one micro-batch's fp32
# logits would exceed one tile).
LOSS_TILE_BYTES = 2**28
# fp32 logits (or their fp32 copy), their log-softmax kept for backward, and in backward the gradient of
# that log-softmax and the gradient of the logits: three fp32 [tokens x vocab] tensors are live at once.
LOSS_BYTES_PER_LOGIT = 12


# ---------------------------------------------------------------- the three parts


def param_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def model_state_bytes(n_params: int, stage: int, dp: int, precision: str = "bf16",
                      offload_optimizer: str = "none", offload_param: str = "none",
                      one_moment: int = 0) -> dict[str, float]:  # fmt: skip
    """Bytes of parameters, gradients and optimizer states on one GPU, and on the host for that rank.

    16-bit params (2Ψ) and grads (2Ψ) plus K=12 bytes of Adam states per parameter (fp32 master copy,
    momentum, variance); in fp32 params and grads take 4Ψ each and only a plain stage-0 run steps the
    parameters in place (K=8): the ZeRO optimizer keeps its own fp32 partition even in fp32.
    ``one_moment`` of the parameters keep a single fp32 moment (Muon's matrices: K 4 bytes less).
    Stage 1 partitions the optimizer states, stage 2 the gradients too, stage 3 the parameters too.
    """
    p = param_bytes(precision)
    k = 8 if precision == "fp32" and stage == 0 else 12
    params = p * n_params / (dp if stage == 3 else 1)
    grads = p * n_params / (dp if stage >= 2 else 1)
    optimizer = (k * n_params - 4 * one_moment) / (dp if stage >= 1 else 1)
    cpu = 0.0
    if offload_optimizer == "cpu":
        # CPU Adam steps on the host: the optimizer states and an fp32 gradient partition live there.
        cpu += optimizer + 4 * n_params / dp
        optimizer = 0.0
        if stage >= 2:  # reduced gradients are copied straight into that host partition
            grads = 0.0
    if offload_param == "cpu":
        cpu += params
        params = 0.0
    return {"params": params, "grads": grads, "optimizer": optimizer, "cpu": cpu}


def knobs_from_config(ds_config: dict[str, Any] | None) -> dict[str, Any]:
    """Buffer sizes (in elements) from a DeepSpeed config, with DeepSpeed's defaults where unset."""
    zero = (ds_config or {}).get("zero_optimization", {})
    knobs: dict[str, Any] = {}
    for key, default in DS_DEFAULT_KNOBS.items():
        short = key.removeprefix("stage3_")  # DeepSpeed accepts either spelling
        knobs[key] = float(zero.get(key, zero.get(short, default)))
    knobs["overlap_comm"] = zero.get("overlap_comm")  # None: DeepSpeed's default (on for stage 3 only)
    return knobs


def buffer_bytes(spec: ModelSpec, setup: Setup, dp: int, precision: str,
                 knobs: dict[str, Any] | None = None, trainable: int | None = None) -> dict[str, float]:  # fmt: skip
    """DeepSpeed's buffers and temporaries on one GPU, by name (see docs/memory.md). ``trainable``:
    the parameters that get gradients (LoRA's adapters), which size the gradient buffers; default all."""
    knobs = knobs or knobs_from_config(None)
    n, p, stage = trainable or spec.n_params, param_bytes(precision), setup.zero_stage
    offloaded = setup.offload_optimizer == "cpu"
    overlap = knobs.get("overlap_comm")
    overlap = stage == 3 if overlap is None else bool(overlap)  # DeepSpeed's default
    out: dict[str, float] = {}
    if stage == 0:
        out["allreduce_bucket"] = p * min(DS_ALLREDUCE_BUCKET, n)
        if precision != "fp32":  # the mixed-precision wrapper flattens gradients to fp32 for its step
            out["fp32_grad_flat"] = 4.0 * n
        return out
    out["reduce_bucket"] = p * min(knobs["reduce_bucket_size"], n) * (2 if overlap else 1)
    if not offloaded:  # the fp32 gradient partition the optimizer step reads
        out["fp32_grad_partition"] = 4.0 * n / dp
    if stage == 3:
        persistent = spec.small_params if knobs["stage3_param_persistence_threshold"] > 0 else 0
        gathered = min(knobs["stage3_prefetch_bucket_size"] + spec.largest_layer_params,
                       knobs["stage3_max_live_parameters"])  # fmt: skip
        out["stage3_gathered_params"] = p * gathered
        out["stage3_layer_grad"] = p * min(spec.largest_layer_params, n)  # whole grad before reduce-scatter
        out["stage3_persistent_params"] = p * persistent
    return out


# ---------------------------------------------------------------- activations and logits
#
# Bytes per token a rank holds (tokens = micro_batch * seq_len / sequence_parallel) unless a docstring
# says otherwise; docs/memory.md derives each term.


def loss_tile_tokens(vocab: int, tile_bytes: int = LOSS_TILE_BYTES) -> int:
    """Tokens in one loss tile: as many as make ``tile_bytes`` of fp32 logits."""
    return max(1, tile_bytes // (4 * vocab))


def tiled_loss_auto(vocab: int, tokens: int, tile_bytes: int = LOSS_TILE_BYTES) -> bool:
    """The trainer's ``--tiled_loss auto``: tile once one micro-batch's fp32 logits exceed one tile."""
    return 4 * vocab * tokens > tile_bytes


def mlp_tile_tokens(spec: ModelSpec, tokens: int) -> int:
    """Tokens in one MLP tile: about hidden_size, as DeepSpeed's TiledMLP picks with its ``auto`` shards
    (ceil(tokens / hidden) tiles of equal length)."""
    tiles = -(-tokens // spec.hidden_size)
    return -(-tokens // tiles)


def _widths(spec: ModelSpec, sp: int, tp: int = 1) -> tuple[float, float, float]:
    """(query features, key/value features, MLP width) per token a rank holds. Ulysses gives each rank
    heads/N of the whole sequence, the same bytes as all heads of its own tokens; with fewer kv heads than
    N, DeepSpeed replicates them so that each rank gets one. Tensor parallelism gives each rank heads/T
    and an MLP T times narrower, of every token."""
    head_dim = spec.head_dim or spec.hidden_size // spec.n_heads
    kv_heads = spec.n_kv_heads or spec.n_heads
    if sp > 1:
        kv_heads = max(kv_heads, sp)
    ffn = spec.intermediate_size or 4 * spec.hidden_size
    return spec.n_heads * head_dim / tp, kv_heads * head_dim / tp, ffn / tp


def layer_saved_bytes(spec: ModelSpec, precision: str, seq_len: int, sp: int = 1,
                      tiled_mlp: bool = False, tp: int = 1) -> dict[str, float]:  # fmt: skip
    """What one decoder layer keeps for backward, per token this rank holds, by part.

    Llama-style (counted on HF's LlamaDecoderLayer with SDPA; tests/unit/test_planner_long_context.py
    walks the autograd graph to check): each RMSNorm keeps its input in fp32, its normalised input and its
    output (the next projections' input); attention keeps the rotated query and key, the value, its output
    (which is also o_proj's input) and a log-sum-exp per head, never the s x s scores; the gated MLP keeps
    the gate and up projections, the activation and their product. Under Ulysses, o_proj's input is the
    all-to-all's output, a tensor of its own. A tiled MLP keeps only its input (the norm's output).
    GPT-2 keeps Korthikanti et al.'s count (34·h + 5·a·s per token in 16-bit), scores included. Under
    tensor parallelism attention and the MLP keep a 1/T slice; the norms, on the whole residual, do not.
    """
    p, h = param_bytes(precision), spec.hidden_size
    q, kv, ffn = _widths(spec, sp, tp)
    if spec.arch == "gpt2":
        scale = p / 2  # the paper counts 2-byte elements
        mlp = 0.0 if tiled_mlp else 16 * h * scale  # the GeLU's input and output, 4h wide each
        return {"norms": 4 * h * scale, "attention": 11 * h * scale,
                "scores": 5 * spec.n_heads * seq_len * scale, "mlp": mlp + 3 * h * scale}  # fmt: skip
    norm = 4 * h + 2 * p * h + 4  # fp32 input, normalised input, output; an fp32 rsqrt per token
    attention = p * (2 * q + 2 * kv) + 4 * spec.n_heads / tp + (p * q if sp > 1 else 0)
    saved = {
        "norms": 2 * norm,
        "attention": attention,
        "scores": 0.0,
        "mlp": 0.0 if tiled_mlp else 4 * p * ffn,
    }
    if spec.n_experts:
        # Each of a token's k experts keeps the token's gathered input and the gated MLP's four
        # tensors at its width; the router keeps its logits and their fp32 softmax, one per expert.
        k, width = spec.experts_per_token, spec.expert_intermediate_size
        saved["mlp"] = k * (p * h + 4 * p * width)
        saved["router"] = (p + 4) * spec.n_experts
    return saved


def layer_working_bytes(spec: ModelSpec, precision: str, tokens: int, sp: int = 1,
                        tiled_mlp: bool = False, tp: int = 1) -> float:  # fmt: skip
    """Bytes per token live beyond a layer's saved tensors while it is back-propagated (or recomputed).

    The MLP's backward holds the gradient of the product and of both its factors while the product is
    gone (two MLP widths more); a tiled MLP holds one tile's recomputed MLP and its gradients (six MLP
    widths of one tile) and the whole gradient of its input assembled tile by tile. Attention's backward
    holds the gradients of its output and of query, key and value; Ulysses adds a staging copy and the
    all-to-all's output of the tensor in flight. The residual stream's gradient in and out of the layer
    is live throughout.
    """
    p, h = param_bytes(precision), spec.hidden_size
    q, kv, ffn = _widths(spec, sp, tp)
    mlp = p * h + 6 * p * ffn * mlp_tile_tokens(spec, tokens) / tokens if tiled_mlp else 2 * p * ffn
    attention = p * (2 * q + 2 * kv) + (2 * p * q if sp > 1 else 0)
    return max(mlp, attention) + 2 * p * h


def head_bytes(spec: ModelSpec, precision: str, tokens: int, tiled_loss: bool,
               tile_bytes: int = LOSS_TILE_BYTES) -> dict[str, float]:  # fmt: skip
    """Bytes (not per token) of the final norm and of the logits and their loss at the loss's peak.

    Whole: at the start of backward three fp32 [tokens x vocab] tensors are live (the log-softmax kept
    for backward, its gradient, the logits' gradient; in forward the 16-bit logits, their fp32 copy and
    the log-softmax weigh less). Tiled: the same for one tile, plus the gradient of the hidden states,
    computed tile by tile and joined into one tensor.
    """
    p, h, vocab = param_bytes(precision), spec.hidden_size, spec.vocab_size
    final_norm = (2 * p * h if spec.arch == "gpt2" else 4 * h + 2 * p * h + 4) * tokens
    if tiled_loss:
        tile = min(tokens, loss_tile_tokens(vocab, tile_bytes))
        logits = LOSS_BYTES_PER_LOGIT * vocab * tile + 2 * p * h * tokens
    else:
        logits = LOSS_BYTES_PER_LOGIT * vocab * tokens
    return {"final_norm": final_norm, "logits": logits}


def activation_bytes(spec: ModelSpec, seq_len: int, micro_batch: int, precision: str, setup: Setup,
                     tile_bytes: int = LOSS_TILE_BYTES) -> dict[str, float]:  # fmt: skip
    """Peak activation bytes of one micro-batch on one GPU, and the bytes offload keeps on its host.

    The peak is what stays stored across the whole step (every layer's saved tensors, or with
    checkpointing each layer's input, the embeddings' output being the first) plus the larger of two
    moments that never overlap: the loss's peak at the start of backward, and one layer's backward
    (recomputed first under checkpointing). Activation offload keeps the checkpointed inputs on the host
    and one on the GPU, fetched back for its layer's recompute.
    """
    sp, tp = setup.sequence_parallel, setup.tensor_parallel
    tokens = micro_batch * seq_len / sp
    p, h = param_bytes(precision), spec.hidden_size
    saved = sum(layer_saved_bytes(spec, precision, seq_len, sp, setup.tiled_mlp, tp).values())
    working = layer_working_bytes(spec, precision, int(tokens), sp, setup.tiled_mlp, tp)
    # Rotary cos/sin tables, computed once per forward for the rank's tokens and shared by every layer.
    rope = 0.0 if spec.arch == "gpt2" else 2 * p * (spec.head_dim or h // spec.n_heads) * tokens
    head = head_bytes(spec, precision, int(tokens), setup.tiled_loss, tile_bytes)
    if setup.activation_checkpointing:
        stored, layer = spec.n_layers * p * h * tokens, (saved + working) * tokens
    else:
        stored, layer = spec.n_layers * saved * tokens, working * tokens
    cpu = 0.0
    if setup.offload_activations and setup.activation_checkpointing:
        cpu, stored = stored, p * h * tokens
    gpu = stored + rope + max(sum(head.values()), layer)
    return {"stored": stored, "rope": rope, **head, "layer_backward": layer, "gpu": gpu, "cpu": cpu}


def cpu_bytes_per_node(spec: ModelSpec, setup: Setup, cluster: Cluster, precision: str,
                       offloaded_per_rank: float) -> float:  # fmt: skip
    """Host memory of one node: the offloaded states of its ranks, or the load peak if larger.

    While the model is built each rank holds it once in the training dtype on the host; under ZeRO-3,
    zero.Init partitions it as it is built.
    """
    load = param_bytes(precision) * spec.n_params
    if setup.zero_stage == 3:
        load /= cluster.world_size
    return cluster.gpus_per_node * max(load, offloaded_per_rank)


# ---------------------------------------------------------------- LoRA


def lora_params(spec: ModelSpec, r: int) -> int:
    """Adapter parameters of LoRA rank ``r`` on every linear layer (peft's all-linear): r x (in + out) each."""
    return r * spec.n_layers * spec.linear_io_per_layer


def lora_state_bytes(spec: ModelSpec, r: int, qlora: bool, stage: int, dp: int, precision: str,
                     offload_optimizer: str, offload_param: str) -> dict[str, float]:  # fmt: skip
    """``model_state_bytes`` for LoRA: gradients and optimizer states for the adapters alone; the frozen
    base in 16 bits (QLoRA: its linear weights in 4-bit NF4, about 0.52 bytes a parameter with the
    quantisation constants), partitioned by ZeRO-3 like any parameter."""
    states = model_state_bytes(lora_params(spec, r), stage, dp, precision, offload_optimizer, "none")
    linear = spec.n_params - spec.embedding_params
    base = 0.52 * linear + 2 * spec.embedding_params if qlora else param_bytes(precision) * spec.n_params
    base /= dp if stage == 3 else 1
    states["cpu" if offload_param == "cpu" else "params"] += base
    return states


def expert_state_bytes(
    spec: ModelSpec, held: int, setup: Setup, dp: int, precision: str, muon: bool
) -> dict[str, float]:
    """Model states of a rank holding ``held`` parameters: those outside the experts partitioned by
    ZeRO over the data-parallel ranks; a mixture's experts split over the expert-parallel group first,
    each rank's share partitioned over the dp / ep ranks that hold the same experts. ``muon``: every
    matrix keeps one moment (the experts are matrices)."""
    ep = setup.expert_parallel
    dense, experts = held - spec.expert_params, spec.expert_params / ep
    matrices = max(0, dense - spec.embedding_params - spec.small_params) if muon else 0
    offload = (setup.offload_optimizer, setup.offload_param)
    states = model_state_bytes(dense, setup.zero_stage, dp, precision, *offload, matrices)
    if not experts:
        return states
    split = model_state_bytes(
        experts, setup.zero_stage, dp // ep, precision, *offload, experts if muon else 0
    )
    return {key: states[key] + split[key] for key in states}


def tensor_parallel_params(spec: ModelSpec, tp: int) -> float:
    """The parameters one rank of a tensor-parallel group holds: a 1/T slice of the projections, the
    rest whole."""
    split = spec.tensor_split_params
    return split / tp + spec.n_params - split


def tensor_parallel_allreduce_bytes(spec: ModelSpec, tokens: float, precision: str, tp: int) -> float:
    """Bytes one rank sends per micro-batch in its group's all-reduces: the attention output and the
    MLP output of every layer in forward, and their input gradients in backward (four [tokens x hidden]
    all-reduces a layer, 2(T-1)/T of each sent by a ring)."""
    if tp == 1:
        return 0.0
    return 4 * spec.n_layers * tokens * spec.hidden_size * param_bytes(precision) * 2 * (tp - 1) / tp


def kv_cache_bytes(spec: ModelSpec, seq_len: int, rows: int, precision: str) -> int:
    """A generation's KV cache on one GPU: keys and values of every layer for ``rows`` sequences of
    ``seq_len`` tokens (prompt and completion), in the run's precision."""
    kv_heads = spec.n_kv_heads or spec.n_heads
    head_dim = spec.head_dim or spec.hidden_size // spec.n_heads
    return 2 * spec.n_layers * kv_heads * head_dim * seq_len * rows * param_bytes(precision)


def reference_bytes(n_params: int, stage: int, dp: int, precision: str) -> int:
    """A frozen reference model's weights on one GPU: whole under ZeRO 0-2, a 1/dp share under
    ZeRO-3 (as DeepSpeed partitions a second engine's), in the training precision."""
    return param_bytes(precision) * n_params // (dp if stage == 3 else 1)
