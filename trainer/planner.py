"""The memory planner: bytes per GPU and per node for every ZeRO stage, offload and checkpointing choice.

Three parts are counted separately (docs/memory.md derives each term):

* model states as the ZeRO paper counts them (Rajbhandari et al., 2020): with mixed-precision Adam,
  2Ψ bytes of 16-bit parameters, 2Ψ of 16-bit gradients and KΨ = 12Ψ of optimizer states (fp32 master
  weights, momentum, variance), partitioned over the data-parallel degree Nd by the ZeRO stage;
* DeepSpeed's buffers and temporaries (gradient buckets, the fp32 gradient partition built for the
  optimizer step, ZeRO-3's gathered working set), sized from the DeepSpeed config the run would use;
* activations, from Korthikanti et al. (2022): s·b·h·(34 + 5·a·s/h) bytes per layer in 16-bit without
  recomputation, and 2·s·b·h per layer plus one layer's working set with full checkpointing.

Nothing here imports torch or deepspeed: the planner must answer in milliseconds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
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
        name, total, layers, h, heads, vocab, largest, (2 * layers + 1) * h, linear_io, embed + lm_head
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
        name, total, layers, h, heads, vocab, max(vocab * h, h * ffn), small, linear_io, embeddings
    )


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
    """A model given by its size alone; the largest layer is taken to be the embedding."""
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


def layer_activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, precision: str) -> float:
    """One transformer layer's stored activations without recomputation: s·b·h·(34 + 5·a·s/h)."""
    scale = 2 if precision == "fp32" else 1  # the formula counts 2-byte elements
    return scale * seq_len * micro_batch * hidden * (34 + 5 * heads * seq_len / hidden)


def activation_bytes(spec: ModelSpec, seq_len: int, micro_batch: int, precision: str,
                     checkpointing: bool) -> dict[str, float]:  # fmt: skip
    """Activations on one GPU for one micro-batch, plus the logits and their fp32 loss copies."""
    layer = layer_activation_bytes(seq_len, micro_batch, spec.hidden_size, spec.n_heads, precision)
    if checkpointing:
        # Each layer keeps only its input; backward recomputes one layer at a time.
        layers = spec.n_layers * param_bytes(precision) * seq_len * micro_batch * spec.hidden_size + layer
    else:
        layers = spec.n_layers * layer
    # Logits in the training dtype, their fp32 copy for the loss and the gradient of that copy.
    logits = seq_len * micro_batch * spec.vocab_size * (param_bytes(precision) + 4 + 4)
    return {"layers": layers, "logits": logits}


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
    adapters of that rank on a frozen base (``qlora``: a 4-bit base)."""
    dp = cluster.world_size
    if lora_r:
        states = lora_state_bytes(spec, lora_r, qlora, setup.zero_stage, dp, precision,
                                  setup.offload_optimizer, setup.offload_param)  # fmt: skip
    else:
        states = model_state_bytes(spec.n_params, setup.zero_stage, dp, precision,
                                   setup.offload_optimizer, setup.offload_param)  # fmt: skip
    trainable = lora_params(spec, lora_r) if lora_r else None
    buffers = buffer_bytes(spec, setup, dp, precision, knobs_from_config(ds_config), trainable)
    acts = activation_bytes(spec, seq_len, micro_batch, precision, setup.activation_checkpointing)
    model_gb = (states["params"] + states["grads"] + states["optimizer"]) / GB
    buffers_gb, acts_gb = sum(buffers.values()) / GB, sum(acts.values()) / GB
    total = model_gb + buffers_gb + acts_gb
    cpu_node = cpu_bytes_per_node(spec, setup, cluster, precision, states["cpu"]) / GB
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
        "total_gb_per_gpu": total,
        "gpu_gb_per_node": total * cluster.gpus_per_node,
        "cpu_gb_per_rank": states["cpu"] / GB,
        "cpu_gb_per_node": cpu_node,
        "fits_gpu": fits_gpu,
        "fits_cpu": fits_cpu,
        "fits": fits_gpu and fits_cpu,
    }


def plan(spec: ModelSpec, cluster: Cluster, seq_len: int, micro_batch: int, precision: str = "bf16",
         config_for: Callable[[Setup], dict[str, Any]] | None = None,
         lora_r: int | None = None, qlora: bool = False) -> dict[str, Any]:  # fmt: skip
    """Every configuration, fastest first, and the first that fits (or None).

    ``config_for`` gives the DeepSpeed config a setup would run with, so buffers are sized from the
    run's real bucket sizes; without it DeepSpeed's defaults are assumed.
    """
    rows = []
    for setup in setups():
        ds_config = config_for(setup) if config_for else None
        rows.append(estimate(spec, setup, cluster, seq_len, micro_batch, precision, ds_config, lora_r, qlora))
    recommended = next((row for row in rows if row["fits"]), None)
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
        "configurations": rows,
        "recommended": recommended,
    }


def no_fit_message(result: dict[str, Any]) -> str:
    """Why nothing fits, with the leanest configuration's needs and what to change."""
    leanest = min(result["configurations"], key=lambda r: (r["total_gb_per_gpu"], r["cpu_gb_per_node"]))
    return (
        "no configuration fits: the leanest (ZeRO-3, optimizer and parameter offload, activation "
        f"checkpointing) needs {leanest['total_gb_per_gpu']:.1f} GB per GPU of "
        f"{result['usable_gpu_memory_gb']:.1f} GB usable and {leanest['cpu_gb_per_node']:.1f} GB of host "
        f"memory per node of {result['usable_cpu_memory_gb']:.1f} GB usable; lower --micro-batch or "
        "--seq-len, or add GPUs or nodes"
    )


def format_table(result: dict[str, Any]) -> str:
    """The plan as a fixed-width table, one configuration a line."""
    head = (
        f"{'zero':>4} {'offload':>9} {'ckpt':>4} | {'model':>8} {'buffers':>8} {'activ.':>8} "
        f"{'total/GPU':>9} {'GPU/node':>9} {'CPU/node':>9} | fits"
    )
    lines = [head, "-" * len(head)]
    for r in result["configurations"]:
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
