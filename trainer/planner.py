"""The memory planner: bytes per GPU and per node for every ZeRO stage, offload and checkpointing choice.

Three parts are counted separately (docs/memory.md derives each term):

* model states as the ZeRO paper counts them (Rajbhandari et al., 2020): with mixed-precision Adam,
  2Ψ bytes of 16-bit parameters, 2Ψ of 16-bit gradients and KΨ = 12Ψ of optimizer states (fp32 master
  weights, momentum, variance), partitioned over the data-parallel degree Nd by the ZeRO stage;
* DeepSpeed's buffers and temporaries (gradient buckets, the fp32 gradient partition built for the
  optimizer step, ZeRO-3's gathered working set), sized from the DeepSpeed config the run would use;
* activations and logits for one micro-batch, per GPU: what each decoder layer keeps for backward
  (counted tensor by tensor for HF's Llama with SDPA attention, linear in the tokens a rank holds;
  Korthikanti et al. (2022) for GPT-2), the logits and their fp32 loss, and the working set of the
  layer being back-propagated; long-context runs divide the tokens by the sequence-parallel size,
  tile the loss or the MLP, and may keep checkpointed layer inputs on the host.

Nothing here imports torch or deepspeed: the planner must answer in milliseconds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from itertools import product
from pathlib import Path
from typing import Any

from trainer.config.errors import ConfigError, unknown_key_message

GB = 1e9  # the ZeRO paper's unit: its 120 GB for 7.5B parameters is 7.5e9 x 16 bytes
# Share of each stated memory size kept free for the CUDA context, NCCL, allocator fragmentation
# (or, on the host, the OS and data loaders).
HEADROOM = 0.10

# HF-style configs of well-known architectures, counted by the same code as a user's config.json.
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
             "n_positions": 1024},
    "gpt2-xl": {"model_type": "gpt2", "n_embd": 1600, "n_layer": 48, "n_head": 25, "vocab_size": 50257,
                "n_positions": 1024},
    "llama-1b": {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
                 "vocab_size": 128256, "tie_word_embeddings": True},
    "llama-7b": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "intermediate_size": 11008, "vocab_size": 32000},
    # Llama 3 8B: grouped-query attention, a 128K vocabulary, untied embeddings.
    "llama-8b": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                 "vocab_size": 128256},
    "llama-13b": {"model_type": "llama", "hidden_size": 5120, "num_hidden_layers": 40,
                  "num_attention_heads": 40, "intermediate_size": 13824, "vocab_size": 32000},
    "llama-70b": {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80,
                  "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
                  "vocab_size": 32000},
}  # fmt: skip

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

# (offload_optimizer, offload_param) choices, cheapest first.
OFFLOADS = (("none", "none"), ("cpu", "none"), ("cpu", "cpu"))


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a model."""

    name: str
    n_params: int
    n_layers: int
    hidden_size: int
    n_heads: int
    vocab_size: int
    largest_layer_params: int  # the biggest single module, gathered whole under ZeRO-3
    small_params: int = 0  # norms and biases: few elements each, kept whole under ZeRO-3
    linear_io_per_layer: int = 0  # in + out features summed over a layer's linear modules (LoRA's size)
    embedding_params: int = 0  # embeddings and an untied head: kept in 16 bits by QLoRA
    n_kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as n_heads
    head_dim: int = 0  # 0: hidden_size // n_heads
    intermediate_size: int = 0  # the MLP's width; 0: 4 x hidden_size
    arch: str = "llama"  # "llama" (HF Llama-style decoder) or "gpt2": which activation count applies


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int = 8
    nodes: int = 1
    gpu_memory_gb: float = 80.0
    cpu_memory_gb: float = 1024.0

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Setup:
    zero_stage: int
    offload_optimizer: str  # "none" or "cpu"
    offload_param: str  # "none" or "cpu"; "cpu" only with ZeRO-3
    activation_checkpointing: bool
    # Long context (the trainer's --sequence_parallel_size, --tiled_loss, --tiled_mlp, --offload_activations).
    sequence_parallel: int = 1  # Ulysses: each rank holds seq_len / N tokens of every sequence
    tiled_loss: bool = False  # the logits and their loss one tile of tokens at a time
    tiled_mlp: bool = False  # each MLP over the sequence in tiles
    offload_activations: bool = False  # checkpointed layer inputs kept on the host (needs checkpointing)


# ---------------------------------------------------------------- model specs


def _llama_like(cfg: dict[str, Any], name: str) -> ModelSpec:
    h, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or h // heads)
    ffn = int(cfg.get("intermediate_size") or 4 * h)
    vocab = int(cfg["vocab_size"])
    attn_bias = bool(cfg.get("attention_bias", False))
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    attention = h * q_out + 2 * h * kv_out + q_out * h + (q_out + 2 * kv_out + h if attn_bias else 0)
    mlp = 3 * h * ffn  # gate, up and down projections
    per_layer = attention + mlp + 2 * h  # two RMSNorm weights
    embed = vocab * h
    lm_head = 0 if cfg.get("tie_word_embeddings", False) else vocab * h
    total = embed + layers * per_layer + h + lm_head
    largest = max(embed, h * ffn, h * q_out)
    linear_io = (h + q_out) * 2 + 2 * (h + kv_out) + 3 * (h + ffn)  # q, o, k, v; gate, up, down
    return ModelSpec(
        name, total, layers, h, heads, vocab, largest, (2 * layers + 1) * h, linear_io, embed + lm_head,
        n_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=ffn,
    )  # fmt: skip


def _gpt2(cfg: dict[str, Any], name: str) -> ModelSpec:
    h, layers, heads = int(cfg["n_embd"]), int(cfg["n_layer"]), int(cfg["n_head"])
    vocab, positions = int(cfg["vocab_size"]), int(cfg.get("n_positions", 1024))
    ffn = int(cfg.get("n_inner") or 4 * h)
    attention = h * 3 * h + 3 * h + h * h + h
    mlp = h * ffn + ffn + ffn * h + h
    per_layer = attention + mlp + 4 * h  # two LayerNorms, weight and bias
    total = vocab * h + positions * h + layers * per_layer + 2 * h  # the lm_head is tied to wte
    small = layers * (3 * h + h + ffn + h + 4 * h) + 2 * h
    linear_io = (h + 3 * h) + 2 * h + 2 * (h + ffn)  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    embeddings = (vocab + positions) * h
    return ModelSpec(
        name, total, layers, h, heads, vocab, max(vocab * h, h * ffn), small, linear_io, embeddings,
        intermediate_size=ffn, arch="gpt2",
    )  # fmt: skip


def spec_from_hf_config(cfg: dict[str, Any], name: str = "model") -> ModelSpec:
    """Count the parameters of a Llama-style or GPT-2 HF config (a config.json as a dict)."""
    try:
        if cfg.get("model_type") == "gpt2" or "n_embd" in cfg:
            return _gpt2(cfg, name)
        return _llama_like(cfg, name)
    except KeyError as err:
        raise ConfigError(
            f"missing key {err.args[0]}; the planner reads Llama-style (hidden_size, num_hidden_layers, "
            "num_attention_heads, vocab_size) and GPT-2 (n_embd, n_layer, n_head) configs",
            path=name,
        ) from None


def spec_from_counts(params: float, layers: int, hidden: int, heads: int, vocab: int) -> ModelSpec:
    """A model given by its size alone: a Llama-style decoder (full multi-head attention, a gated MLP as wide
    as the parameters left over imply); the largest layer is taken to be the embedding."""
    # Linear layers: four h x h in attention, three h x ffn in the MLP, ffn from what is left.
    ffn = max(int(params) - 2 * vocab * hidden, 0) // max(layers, 1) // (3 * hidden) - 4 * hidden // 3
    return ModelSpec(
        f"{params / 1e9:g}B",
        int(params),
        layers,
        hidden,
        heads,
        vocab,
        largest_layer_params=vocab * hidden,
        small_params=(2 * layers + 1) * hidden,
        linear_io_per_layer=8 * hidden + 3 * (hidden + max(ffn, hidden)),
        embedding_params=vocab * hidden,
        intermediate_size=max(ffn, hidden),
    )


def load_model_spec(model: str) -> ModelSpec:
    """A preset name, an HF config.json, or a directory holding one."""
    if model in PRESETS:
        return spec_from_hf_config(PRESETS[model], model)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        hint = unknown_key_message(model, PRESETS).replace("unknown key", "not a preset")
        raise ConfigError(f"no such file or preset ({hint}); presets: {', '.join(PRESETS)}", path="--model")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read {path} as JSON: {err}", path="--model") from None
    return spec_from_hf_config(cfg, str(path))


# ---------------------------------------------------------------- the three parts


def param_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def model_state_bytes(n_params: int, stage: int, dp: int, precision: str = "bf16",
                      offload_optimizer: str = "none", offload_param: str = "none") -> dict[str, float]:  # fmt: skip
    """Bytes of parameters, gradients and optimizer states on one GPU, and on the host for that rank.

    16-bit params (2Ψ) and grads (2Ψ) plus K=12 bytes of Adam states per parameter (fp32 master copy,
    momentum, variance); in fp32 params and grads take 4Ψ each and only a plain stage-0 run steps the
    parameters in place (K=8): the ZeRO optimizer keeps its own fp32 partition even in fp32.
    Stage 1 partitions the optimizer states, stage 2 the gradients too, stage 3 the parameters too.
    """
    p = param_bytes(precision)
    k = 8 if precision == "fp32" and stage == 0 else 12
    params = p * n_params / (dp if stage == 3 else 1)
    grads = p * n_params / (dp if stage >= 2 else 1)
    optimizer = k * n_params / (dp if stage >= 1 else 1)
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


def _widths(spec: ModelSpec, sp: int) -> tuple[int, int, int]:
    """(query features, key/value features, MLP width) per token a rank holds. Ulysses gives each rank
    heads/N of the whole sequence, the same bytes as all heads of its own tokens; with fewer kv heads than
    N, DeepSpeed replicates them so that each rank gets one."""
    head_dim = spec.head_dim or spec.hidden_size // spec.n_heads
    kv_heads = spec.n_kv_heads or spec.n_heads
    if sp > 1:
        kv_heads = max(kv_heads, sp)
    return spec.n_heads * head_dim, kv_heads * head_dim, spec.intermediate_size or 4 * spec.hidden_size


def layer_saved_bytes(spec: ModelSpec, precision: str, seq_len: int, sp: int = 1,
                      tiled_mlp: bool = False) -> dict[str, float]:  # fmt: skip
    """What one decoder layer keeps for backward, per token this rank holds, by part.

    Llama-style (counted on HF's LlamaDecoderLayer with SDPA; tests/unit/test_planner_long_context.py
    walks the autograd graph to check): each RMSNorm keeps its input in fp32, its normalised input and its
    output (the next projections' input); attention keeps the rotated query and key, the value, its output
    (which is also o_proj's input) and a log-sum-exp per head, never the s x s scores; the gated MLP keeps
    the gate and up projections, the activation and their product. Under Ulysses, o_proj's input is the
    all-to-all's output, a tensor of its own. A tiled MLP keeps only its input (the norm's output).
    GPT-2 keeps Korthikanti et al.'s count (34·h + 5·a·s per token in 16-bit), scores included.
    """
    p, h = param_bytes(precision), spec.hidden_size
    q, kv, ffn = _widths(spec, sp)
    if spec.arch == "gpt2":
        scale = p / 2  # the paper counts 2-byte elements
        mlp = 0.0 if tiled_mlp else 16 * h * scale  # the GeLU's input and output, 4h wide each
        return {"norms": 4 * h * scale, "attention": 11 * h * scale,
                "scores": 5 * spec.n_heads * seq_len * scale, "mlp": mlp + 3 * h * scale}  # fmt: skip
    norm = 4 * h + 2 * p * h + 4  # fp32 input, normalised input, output; an fp32 rsqrt per token
    attention = p * (2 * q + 2 * kv) + 4 * spec.n_heads + (p * q if sp > 1 else 0)
    return {
        "norms": 2 * norm,
        "attention": attention,
        "scores": 0.0,
        "mlp": 0.0 if tiled_mlp else 4 * p * ffn,
    }


def layer_working_bytes(spec: ModelSpec, precision: str, tokens: int, sp: int = 1,
                        tiled_mlp: bool = False) -> float:  # fmt: skip
    """Bytes per token live beyond a layer's saved tensors while it is back-propagated (or recomputed).

    The MLP's backward holds the gradient of the product and of both its factors while the product is
    gone (two MLP widths more); a tiled MLP holds one tile's recomputed MLP and its gradients (six MLP
    widths of one tile) and the whole gradient of its input assembled tile by tile. Attention's backward
    holds the gradients of its output and of query, key and value; Ulysses adds a staging copy and the
    all-to-all's output of the tensor in flight. The residual stream's gradient in and out of the layer
    is live throughout.
    """
    p, h = param_bytes(precision), spec.hidden_size
    q, kv, ffn = _widths(spec, sp)
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
    sp = setup.sequence_parallel
    tokens = micro_batch * seq_len / sp
    p, h = param_bytes(precision), spec.hidden_size
    saved = sum(layer_saved_bytes(spec, precision, seq_len, sp, setup.tiled_mlp).values())
    working = layer_working_bytes(spec, precision, int(tokens), sp, setup.tiled_mlp)
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


# ---------------------------------------------------------------- the plan


def setups() -> list[Setup]:
    """Every valid configuration, fastest first.

    Offload costs most (host Adam and PCIe traffic), then recomputation (about one more forward pass),
    then the ZeRO stage (stage 3 adds parameter all-gathers: 1.5x the communication of stages 0-2).
    """
    out = []
    for offload_optimizer, offload_param in OFFLOADS:
        for checkpointing in (False, True):
            for stage in range(4):
                if offload_optimizer == "cpu" and stage == 0:
                    continue  # offload needs ZeRO
                if offload_param == "cpu" and stage != 3:
                    continue  # parameters are partitioned only by stage 3
                out.append(Setup(stage, offload_optimizer, offload_param, checkpointing))
    return out


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


def estimate(spec: ModelSpec, setup: Setup, cluster: Cluster, seq_len: int, micro_batch: int,
             precision: str = "bf16", ds_config: dict[str, Any] | None = None,
             lora_r: int | None = None, qlora: bool = False) -> dict[str, Any]:  # fmt: skip
    """One row of the plan: every figure in GB (1e9 bytes), per GPU and per node. ``lora_r``: LoRA
    adapters of that rank on a frozen base (``qlora``: a 4-bit base). ZeRO partitions over the whole
    world, sequence-parallel ranks included: they hold the same model and average their gradients."""
    dp = cluster.world_size
    if lora_r:
        states = lora_state_bytes(spec, lora_r, qlora, setup.zero_stage, dp, precision,
                                  setup.offload_optimizer, setup.offload_param)  # fmt: skip
    else:
        states = model_state_bytes(spec.n_params, setup.zero_stage, dp, precision,
                                   setup.offload_optimizer, setup.offload_param)  # fmt: skip
    trainable = lora_params(spec, lora_r) if lora_r else None
    buffers = buffer_bytes(spec, setup, dp, precision, knobs_from_config(ds_config), trainable)
    acts = activation_bytes(spec, seq_len, micro_batch, precision, setup)
    model_gb = (states["params"] + states["grads"] + states["optimizer"]) / GB
    buffers_gb, acts_gb = sum(buffers.values()) / GB, acts["gpu"] / GB
    total = model_gb + buffers_gb + acts_gb
    host = states["cpu"] + acts["cpu"]
    cpu_node = cpu_bytes_per_node(spec, setup, cluster, precision, host) / GB
    fits_gpu = total <= cluster.gpu_memory_gb * (1 - HEADROOM)
    fits_cpu = cpu_node <= cluster.cpu_memory_gb * (1 - HEADROOM)
    return {
        **asdict(setup),
        "params_gb_per_gpu": states["params"] / GB,
        "grads_gb_per_gpu": states["grads"] / GB,
        "optimizer_gb_per_gpu": states["optimizer"] / GB,
        "model_states_gb_per_gpu": model_gb,
        "buffers_gb_per_gpu": buffers_gb,
        "buffers": {k: v / GB for k, v in buffers.items()},
        "activations_gb_per_gpu": acts_gb,
        "activations": {k: v / GB for k, v in acts.items() if k not in ("gpu", "cpu")},
        "total_gb_per_gpu": total,
        "gpu_gb_per_node": total * cluster.gpus_per_node,
        "activations_cpu_gb_per_rank": acts["cpu"] / GB,
        "cpu_gb_per_rank": host / GB,
        "cpu_gb_per_node": cpu_node,
        "fits_gpu": fits_gpu,
        "fits_cpu": fits_cpu,
        "fits": fits_gpu and fits_cpu,
    }


def sequence_parallel_problems(spec: ModelSpec, cluster: Cluster, seq_len: int, n: int) -> list[str]:
    """Why Ulysses cannot split this run N ways (empty when it can), as DeepSpeed's checks put it: each
    rank takes heads/N query heads and seq_len/N tokens; kv heads split N ways or, when fewer than N,
    are replicated so that each rank gets one; the sequence-parallel groups tile the world."""
    kv_heads = spec.n_kv_heads or spec.n_heads
    problems = []
    if spec.n_heads % n:
        problems.append(f"the {spec.n_heads} attention heads do not split {n} ways")
    if kv_heads % n and n % kv_heads:
        problems.append(f"the {kv_heads} key/value heads neither split {n} ways nor divide {n}")
    if seq_len % n:
        problems.append(f"--seq-len {seq_len} does not split {n} ways")
    if cluster.world_size % n:
        problems.append(f"the world of {cluster.world_size} GPUs does not split into groups of {n}")
    return problems


def sequence_parallel_sizes(spec: ModelSpec, cluster: Cluster, seq_len: int, largest: int) -> list[int]:
    """The sequence-parallel sizes up to ``largest`` a run could use, smallest first: the divisors of
    ``largest`` that ``sequence_parallel_problems`` accepts."""
    return [n for n in range(1, largest + 1)
            if largest % n == 0 and not sequence_parallel_problems(spec, cluster, seq_len, n)]  # fmt: skip


@dataclass(frozen=True)
class LongContext:
    """What a plan may use for long sequences (``trainer plan``'s flags): sequence-parallel sizes up to
    ``sequence_parallel``, a tiled MLP, offloaded checkpointed inputs; the loss tiled as given, or by
    the trainer's auto rule when None."""

    sequence_parallel: int = 1
    tiled_loss: bool | None = None
    tiled_mlp: bool = False
    offload_activations: bool = False


def candidate_setups(spec: ModelSpec, cluster: Cluster, seq_len: int, micro_batch: int,
                     options: LongContext = LongContext()) -> list[Setup]:  # fmt: skip
    """Every setup the options allow, in the order the recommendation tries them.

    Optimizer offload decides first (as in ``setups``), then the fewest features that cost compute or
    transfers (checkpointing, a tiled MLP, activation offload, preferred in that order), then the
    smallest sequence-parallel size, then the lowest ZeRO stage. The loss tiling is no choice: it
    follows the flag, or the trainer's auto rule for the tokens a rank holds. Without long-context
    options this is ``setups()`` in its own order.
    """
    out = []
    for base in setups():
        for sp in sequence_parallel_sizes(spec, cluster, seq_len, options.sequence_parallel):
            tiled_loss = options.tiled_loss
            if tiled_loss is None:
                tiled_loss = tiled_loss_auto(spec.vocab_size, micro_batch * seq_len // sp)
            for tiled_mlp in sorted({False, options.tiled_mlp}):
                for offload in sorted({False, options.offload_activations and base.activation_checkpointing}):
                    out.append(replace(base, sequence_parallel=sp, tiled_loss=tiled_loss,
                                       tiled_mlp=tiled_mlp, offload_activations=offload))  # fmt: skip

    def order(s: Setup) -> tuple[Any, ...]:
        features = (s.activation_checkpointing, s.tiled_mlp, s.offload_activations)
        tier = OFFLOADS.index((s.offload_optimizer, s.offload_param))
        return tier, sum(features), s.sequence_parallel, tuple(not f for f in features), s.zero_stage

    return sorted(out, key=order)


def activation_table(spec: ModelSpec, cluster: Cluster, seq_len: int, micro_batch: int, precision: str,
                     sizes: list[int]) -> list[dict[str, Any]]:  # fmt: skip
    """Activation and logits memory per GPU of every long-context combination at each sequence-parallel
    size, allowed by the flags or not: what each option would save for this model."""
    rows = []
    for checkpointing, offload, tiled_mlp, tiled_loss in product((False, True), repeat=4):
        if offload and not checkpointing:
            continue  # activation offload moves checkpointed inputs
        row: dict[str, Any] = {"activation_checkpointing": checkpointing, "tiled_loss": tiled_loss,
                               "tiled_mlp": tiled_mlp, "offload_activations": offload, "by_sp": {}}  # fmt: skip
        for sp in sizes:
            setup = Setup(0, "none", "none", checkpointing, sp, tiled_loss, tiled_mlp, offload)
            acts = activation_bytes(spec, seq_len, micro_batch, precision, setup)
            row["by_sp"][sp] = {"gpu_gb": acts["gpu"] / GB, "logits_gb": acts["logits"] / GB,
                                "cpu_gb_per_node": acts["cpu"] * cluster.gpus_per_node / GB}  # fmt: skip
        rows.append(row)
    return rows


def plan(spec: ModelSpec, cluster: Cluster, seq_len: int, micro_batch: int, precision: str = "bf16",
         config_for: Callable[[Setup], dict[str, Any]] | None = None,
         lora_r: int | None = None, qlora: bool = False,
         long_context: LongContext = LongContext()) -> dict[str, Any]:  # fmt: skip
    """Every configuration, in the order ``candidate_setups`` tries them, and the first that fits (or None).

    ``config_for`` gives the DeepSpeed config a setup would run with, so buffers are sized from the
    run's real bucket sizes; without it DeepSpeed's defaults are assumed.
    """
    rows = []
    for setup in candidate_setups(spec, cluster, seq_len, micro_batch, long_context):
        ds_config = config_for(setup) if config_for else None
        rows.append(estimate(spec, setup, cluster, seq_len, micro_batch, precision, ds_config, lora_r, qlora))
    sizes = sequence_parallel_sizes(spec, cluster, seq_len, long_context.sequence_parallel)
    return {
        "model": asdict(spec),
        "cluster": {**asdict(cluster), "world_size": cluster.world_size},
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "precision": precision,
        "lora_r": lora_r,
        "qlora": qlora,
        "trainable_params": lora_params(spec, lora_r) if lora_r else spec.n_params,
        "usable_gpu_memory_gb": cluster.gpu_memory_gb * (1 - HEADROOM),
        "usable_cpu_memory_gb": cluster.cpu_memory_gb * (1 - HEADROOM),
        "long_context": {
            **asdict(long_context),
            "sequence_parallel_sizes": sizes,
            "loss_tile_tokens": loss_tile_tokens(spec.vocab_size),
            "activations": activation_table(spec, cluster, seq_len, micro_batch, precision, sizes),
        },
        "configurations": rows,
        "recommended": next((row for row in rows if row["fits"]), None),
    }


def describe(row: dict[str, Any]) -> str:
    """A configuration in words: "ZeRO-3, optimizer offload, activation checkpointing, sequence parallel 8"."""
    offload = "no offload"
    if row["offload_optimizer"] == "cpu":
        offload = "optimizer and parameter offload" if row["offload_param"] == "cpu" else "optimizer offload"
    parts = [f"ZeRO-{row['zero_stage']}", offload]
    parts.append("activation checkpointing" if row["activation_checkpointing"] else "no checkpointing")
    return ", ".join(parts + long_context_words(row))


def long_context_words(row: dict[str, Any]) -> list[str]:
    """The long-context features a configuration turns on, in words (none for a plain run)."""
    words = [f"sequence parallel {row['sequence_parallel']}"] if row["sequence_parallel"] > 1 else []
    names = ("tiled loss", "tiled MLP", "activation offload")
    flags = (row["tiled_loss"], row["tiled_mlp"], row["offload_activations"])
    return words + [name for name, on in zip(names, flags, strict=True) if on]


def leanest(result: dict[str, Any]) -> dict[str, Any]:
    """The configuration needing the least GPU memory (then host memory)."""
    return min(result["configurations"], key=lambda r: (r["total_gb_per_gpu"], r["cpu_gb_per_node"]))


def no_fit_message(result: dict[str, Any]) -> str:
    """Why nothing fits, with the leanest configuration's needs and what to change."""
    lean = leanest(result)
    hint = ""
    options = result["long_context"]
    unused = [flag for flag, used in (("--sequence-parallel", options["sequence_parallel"] > 1),
                                      ("--tiled-mlp", options["tiled_mlp"]),
                                      ("--offload-activations", options["offload_activations"])) if not used]  # fmt: skip
    if unused and lean["activations_gb_per_gpu"] >= lean["total_gb_per_gpu"] / 2:
        hint = f"activations are most of it: {', '.join(unused)} would cut them; "
    return (
        f"no configuration fits: the leanest ({describe(lean)}) needs {lean['total_gb_per_gpu']:.1f} GB "
        f"per GPU of {result['usable_gpu_memory_gb']:.1f} GB usable and {lean['cpu_gb_per_node']:.1f} GB "
        f"of host memory per node of {result['usable_cpu_memory_gb']:.1f} GB usable; {hint}lower "
        "--micro-batch or --seq-len, or add GPUs or nodes"
    )


def table_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The configurations the table shows: every ZeRO stage, offload and checkpointing choice with the
    long-context features of the recommendation (of the leanest when nothing fits). Without
    long-context options that is every configuration."""
    pick = result["recommended"] or leanest(result)

    def same(r: dict[str, Any]) -> bool:
        offload = pick["offload_activations"] and r["activation_checkpointing"]
        keys = ("sequence_parallel", "tiled_loss", "tiled_mlp")
        return all(r[k] == pick[k] for k in keys) and r["offload_activations"] == offload

    return [r for r in result["configurations"] if same(r)]


def format_table(result: dict[str, Any]) -> str:
    """The plan as a fixed-width table, one configuration a line."""
    head = (
        f"{'zero':>4} {'offload':>9} {'ckpt':>4} | {'model':>8} {'buffers':>8} {'activ.':>8} "
        f"{'total/GPU':>9} {'GPU/node':>9} {'CPU/node':>9} | fits"
    )
    lines = [head, "-" * len(head)]
    for r in table_rows(result):
        offload = {"none": "-", "cpu": "opt"}[r["offload_optimizer"]] + (
            "+param" if r["offload_param"] == "cpu" else ""
        )
        fits = "yes" if r["fits"] else ("no (GPU)" if not r["fits_gpu"] else "no (CPU)")
        lines.append(
            f"{r['zero_stage']:>4} {offload:>9} {'on' if r['activation_checkpointing'] else 'off':>4} | "
            f"{r['model_states_gb_per_gpu']:8.2f} {r['buffers_gb_per_gpu']:8.2f} "
            f"{r['activations_gb_per_gpu']:8.2f} {r['total_gb_per_gpu']:9.2f} {r['gpu_gb_per_node']:9.1f} "
            f"{r['cpu_gb_per_node']:9.1f} | {fits}"
        )
    return "\n".join(lines)


def format_activation_table(result: dict[str, Any]) -> str:
    """Activations and logits per GPU for every long-context combination, one column per
    sequence-parallel size; the host memory activation offload takes, per node, below."""
    lc = result["long_context"]
    sizes = lc["sequence_parallel_sizes"]
    cells = "".join(f"{f'SP={sp}':>9}" for sp in sizes)
    head = f"{'ckpt':>4} {'loss':>5} {'mlp':>5} {'offload':>7} |{cells}"
    lines = [head, "-" * len(head)]
    host = None
    for row in lc["activations"]:
        loss, mlp, offload = (word if row[key] else "-" for key, word in
                              (("tiled_loss", "tiled"), ("tiled_mlp", "tiled"), ("offload_activations", "host")))  # fmt: skip
        label = f"{'on' if row['activation_checkpointing'] else 'off':>4} {loss:>5} {mlp:>5} {offload:>7} |"
        lines.append(label + "".join(f"{row['by_sp'][sp]['gpu_gb']:9.2f}" for sp in sizes))
        if row["offload_activations"] and host is None:
            host = row
    for tiled in (False, True):  # the logits and their loss, whole and tiled (the same in every row)
        row = next(r for r in lc["activations"] if r["tiled_loss"] == tiled)
        name = f"logits + loss, {'tiled' if tiled else 'whole'}"
        lines.append(f"{name:>24} |" + "".join(f"{row['by_sp'][sp]['logits_gb']:9.2f}" for sp in sizes))
    if host is not None:
        offloaded = "".join(f"{host['by_sp'][sp]['cpu_gb_per_node']:9.2f}" for sp in sizes)
        lines.append(f"{'offload: host per node':>24} |{offloaded}")
    return "\n".join(lines)


def deepspeed_estimates(spec: ModelSpec, cluster: Cluster) -> dict[str, dict[str, float]]:
    """DeepSpeed's own model-state estimators for the same model and cluster, in GB per GPU / per node.

    Imports deepspeed, so it is kept out of the planner's path; docs/memory.md compares the two.
    """
    # Function-local on purpose: deepspeed is optional to the planner, which must answer without it.
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    common = {"num_gpus_per_node": cluster.gpus_per_node, "num_nodes": cluster.nodes}
    out = {}
    for offload in (False, True):
        cpu, gpu = estimate_zero2_model_states_mem_needs(spec.n_params, cpu_offload=offload, **common)
        out[f"zero2{'_offload_optimizer' if offload else ''}"] = {"gpu_gb": gpu / GB, "cpu_gb": cpu / GB}
    for offload_optimizer, offload_param in ((False, False), (True, False), (True, True)):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            spec.n_params, spec.largest_layer_params, cpu_offload=offload_optimizer,
            cpu_offload_params=offload_param, **common,
        )  # fmt: skip
        name = (
            "zero3"
            + ("_offload_optimizer" if offload_optimizer else "")
            + ("_param" if offload_param else "")
        )
        out[name] = {"gpu_gb": gpu / GB, "cpu_gb": cpu / GB}
    return out
