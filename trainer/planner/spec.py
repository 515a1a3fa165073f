"""What the planner plans for: the model (``ModelSpec``), the cluster (``Cluster``) and one
configuration (``Setup``); the model from a preset, an HF config.json (Llama-style or GPT-2, its
parameters counted exactly) or its size alone. Also the planner's unit (``GB``) and the share of each
memory kept free (``HEADROOM``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config.errors import ConfigError, unknown_key_message
from trainer.objectives import DEFAULT, OBJECTIVES

GB = 1e9  # the ZeRO paper's unit: its 120 GB for 7.5B parameters is 7.5e9 x 16 bytes
# Share of each stated memory size kept free for the CUDA context, NCCL, allocator fragmentation
# (or, on the host, the OS and data loaders).
HEADROOM = 0.10
# Share of the memory free beside the model states a ZeRO-3 rollout fills with weights gathered once
# (the rest is left to its KV cache and activations); the planner and the engine apply the same rule.
GENERATION_SHARE = 0.5

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
    # A mixture of experts: its experts per MoE layer, those each token runs, and the parameters of
    # every layer's experts together (0: a dense model).
    n_experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0
    expert_intermediate_size: int = 0

    @property
    def active_params(self) -> int:
        """The parameters one token runs through: all but the experts it was not routed to."""
        if not self.n_experts:
            return self.n_params
        return (
            self.n_params - self.expert_params + self.expert_params * self.experts_per_token // self.n_experts
        )

    @property
    def tensor_split_params(self) -> int:
        """The parameters AutoTP splits over a tensor-parallel group: a Llama-style decoder's
        projections (all but the embeddings, the head and the norms, which stay whole on each rank;
        an untied head that AutoTP splits too is counted whole, on the safe side). GPT-2: none, AutoTP
        has no plan for it."""
        return self.n_params - self.embedding_params - self.small_params if self.arch == "llama" else 0


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
    tensor_parallel: int = 1  # AutoTP: each projection split over N ranks, which read the same rows
    expert_parallel: int = 1  # AutoEP: each MoE layer's experts split over N data-parallel ranks


@dataclass(frozen=True)
class Objective:
    """What the run trains: a name of the objectives' registry, whose entry says how many sequences
    a micro-batch row forwards (a preference pair: two) and whether the policy generates its rows
    (``generation_rows`` at once on each GPU). ``reference_model``: an objective that
    scores a reference (DPO) holding a reference model beside the policy through training (TRL's
    default) instead of this trainer's cached pass, which holds none."""

    name: str = DEFAULT
    reference_model: bool = False
    #: Completions a GPU generates at once (online RL's rollouts; 0: the micro-batch).
    generation_rows: int = 0

    @property
    def sequences_per_row(self) -> int:
        return OBJECTIVES[self.name].sequences_per_row

    @property
    def generates(self) -> bool:
        """Whether the policy generates the step's data (online RL): a KV cache, and under ZeRO-3
        the weights gathered for the generation."""
        return OBJECTIVES[self.name].data == "prompts"


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
    attention += 2 * head_dim if str(cfg.get("model_type", "")).startswith("qwen3") else 0  # q and k norms
    if cfg.get("kv_lora_rank"):  # DeepSeek's multi-head latent attention
        attention = _latent_attention(cfg, h, heads)
    mlp = 3 * h * ffn  # gate, up and down projections
    experts, top_k, expert_ffn, moe_layers = _experts(cfg, layers, ffn)
    expert_params = moe_layers * experts * 3 * h * expert_ffn
    shared = int(cfg.get("n_shared_experts") or 0) * 3 * h * expert_ffn if experts else 0
    # An MoE layer's MLP is its experts (counted apart), a router with one row per expert and its
    # shared experts (DeepSeek's: every token passes them).
    mlps = (layers - moe_layers) * mlp + moe_layers * (h * experts + shared) + expert_params
    embed = vocab * h
    lm_head = 0 if cfg.get("tie_word_embeddings", False) else vocab * h
    total = embed + layers * (attention + 2 * h) + mlps + h + lm_head  # two RMSNorm weights a layer
    # HF keeps each layer's experts in one 3-D parameter, which ZeRO-3 gathers whole.
    largest = max(embed, h * ffn, h * q_out, 2 * experts * expert_ffn * h)
    linear_io = (h + q_out) * 2 + 2 * (h + kv_out) + 3 * (h + ffn)  # q, o, k, v; gate, up, down
    return ModelSpec(
        name, total, layers, h, heads, vocab, largest, (2 * layers + 1) * h, linear_io, embed + lm_head,
        n_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=ffn, n_experts=experts,
        experts_per_token=top_k, expert_params=expert_params, expert_intermediate_size=expert_ffn,
    )  # fmt: skip


def _latent_attention(cfg: dict[str, Any], h: int, heads: int) -> int:
    """A DeepSeek attention layer's parameters: queries (through a low-rank ``q_lora_rank`` with its
    norm, or directly), the joint key-value compression with its norm and the shared rotary key, the
    keys' and values' expansion, and the output projection."""
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    kv_rank, v_dim, q_rank = int(cfg["kv_lora_rank"]), int(cfg["v_head_dim"]), cfg.get("q_lora_rank")
    query = h * heads * (nope + rope) if not q_rank else h * q_rank + q_rank + q_rank * heads * (nope + rope)
    return query + h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim) + heads * v_dim * h


def _experts(cfg: dict[str, Any], layers: int, ffn: int) -> tuple[int, int, int, int]:
    """(experts per MoE layer, experts per token, an expert's MLP width, MoE layers) of an HF config:
    Mixtral's ``num_local_experts``, Qwen-MoE's ``num_experts`` (with ``moe_intermediate_size``,
    ``decoder_sparse_step`` and ``mlp_only_layers``), DeepSeek's ``n_routed_experts`` (its first
    ``first_k_dense_replace`` layers dense); (0, 0, 0, 0) for a dense model."""
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    if experts < 2:
        return 0, 0, 0, 0
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
    dense |= set(range(int(cfg.get("first_k_dense_replace") or 0)))
    moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return (
        experts,
        int(cfg.get("num_experts_per_tok") or 2),
        int(cfg.get("moe_intermediate_size") or ffn),
        moe_layers,
    )


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
