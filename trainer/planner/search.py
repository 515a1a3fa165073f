"""The search: every configuration (ZeRO stage, offload, checkpointing and, for long sequences, the
sequence-parallel size, tiling and activation offload) in the order the recommendation tries them, one
configuration's estimate against the cluster's memory, and the plan with the first that fits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from itertools import product
from typing import Any

from trainer.planner.memory import (
    activation_bytes,
    buffer_bytes,
    cpu_bytes_per_node,
    expert_state_bytes,
    knobs_from_config,
    kv_cache_bytes,
    lora_params,
    lora_state_bytes,
    loss_tile_tokens,
    param_bytes,
    reference_bytes,
    tensor_parallel_allreduce_bytes,
    tensor_parallel_params,
    tiled_loss_auto,
)
from trainer.planner.spec import GB, GENERATION_SHARE, HEADROOM, Cluster, ModelSpec, Objective, Setup

# (offload_optimizer, offload_param) choices, cheapest first.
OFFLOADS = (("none", "none"), ("cpu", "none"), ("cpu", "cpu"))


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


def estimate(spec: ModelSpec, setup: Setup, cluster: Cluster, seq_len: int, micro_batch: int,
             precision: str = "bf16", ds_config: dict[str, Any] | None = None,
             lora_r: int | None = None, qlora: bool = False, objective: Objective = Objective(),
             optim: str = "adamw") -> dict[str, Any]:  # fmt: skip
    """One row of the plan: every figure in GB (1e9 bytes), per GPU and per node. ``optim`` muon:
    the hidden matrices keep one fp32 moment instead of Adam's two. ``lora_r``: LoRA
    adapters of that rank on a frozen base (``qlora``: a 4-bit base). ZeRO partitions over the whole
    world, sequence-parallel ranks included: they hold the same model and average their gradients.
    ``objective``: pairs double the sequences a micro-batch forwards; a reference model (never under
    LoRA, whose reference is the frozen base) adds its weights to the model column. Under tensor
    parallelism (T ranks) a rank holds a 1/T slice of the projections and ZeRO partitions over the
    world/T groups; the group's all-reduces are counted per micro-batch."""
    tp = setup.tensor_parallel
    dp = cluster.world_size // tp
    held = round(tensor_parallel_params(spec, tp))
    if lora_r:
        states = lora_state_bytes(spec, lora_r, qlora, setup.zero_stage, dp, precision,
                                  setup.offload_optimizer, setup.offload_param)  # fmt: skip
    else:
        states = expert_state_bytes(spec, held, setup, dp, precision, optim == "muon")
    trainable = lora_params(spec, lora_r) if lora_r else held
    buffers = buffer_bytes(spec, setup, dp, precision, knobs_from_config(ds_config), trainable)
    acts = activation_bytes(spec, seq_len, micro_batch * objective.sequences_per_row, precision, setup)
    reference = 0
    if objective.reference_model and not lora_r:
        reference = reference_bytes(held, setup.zero_stage, dp, precision)
    model_gb = (states["params"] + states["grads"] + states["optimizer"] + reference) / GB
    buffers_gb, acts_gb = sum(buffers.values()) / GB, acts["gpu"] / GB
    generation = generation_bytes(spec, setup, seq_len, micro_batch, precision, objective,
                                  cluster.gpu_memory_gb * (1 - HEADROOM) * GB - (model_gb + buffers_gb) * GB)  # fmt: skip
    # A rollout is generated before the step's forwards, and let go before the backward: the larger
    # of the two counts.
    acts_gb = max(acts_gb, sum(generation.values()) / GB)
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
        "reference_gb_per_gpu": reference / GB,
        "model_states_gb_per_gpu": model_gb,
        "buffers_gb_per_gpu": buffers_gb,
        "buffers": {k: v / GB for k, v in buffers.items()},
        "activations_gb_per_gpu": acts_gb,
        "activations": {k: v / GB for k, v in acts.items() if k not in ("gpu", "cpu")},
        "generation": {k: v / GB for k, v in generation.items()},
        "total_gb_per_gpu": total,
        "gpu_gb_per_node": total * cluster.gpus_per_node,
        "activations_cpu_gb_per_rank": acts["cpu"] / GB,
        "cpu_gb_per_rank": host / GB,
        "cpu_gb_per_node": cpu_node,
        "fits_gpu": fits_gpu,
        "fits_cpu": fits_cpu,
        "fits": fits_gpu and fits_cpu,
        "tp_allreduce_gb_per_micro_batch": tensor_parallel_allreduce_bytes(
            spec, micro_batch * objective.sequences_per_row * seq_len / setup.sequence_parallel, precision, tp
        )
        / GB,
    }


def generation_bytes(
    spec: ModelSpec, setup: Setup, seq_len: int, micro_batch: int, precision: str, objective: Objective,
    room: float,
) -> dict[str, int]:  # fmt: skip
    """What a rollout holds on one GPU beside the model states ({} for an objective that does not
    generate): ``kv_cache`` for its rows of ``seq_len`` tokens, and under ZeRO-3 the weights gathered
    once (``gathered_weights``, whole tensors beside this GPU's partitions): as many as
    ``GENERATION_SHARE`` of the ``room`` left beside the model states holds, the whole model where it
    fits, as the trainer gathers them (``trainer.engine.zero.generation_weights``). Where not all
    fit, each forward gathers the rest a layer at a time (``gathered_layer``), as training does."""
    if not objective.generates:
        return {}
    rows = objective.generation_rows or micro_batch
    out = {"kv_cache": kv_cache_bytes(spec, seq_len, rows, precision)}
    if setup.zero_stage == 3:
        whole = param_bytes(precision) * spec.n_params
        kept = min(whole, max(GENERATION_SHARE * room, 0))
        out["gathered_weights"] = round(kept)
        if kept < whole:
            out["gathered_layer"] = param_bytes(precision) * spec.largest_layer_params
    return out


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


def tensor_parallel_problems(spec: ModelSpec, cluster: Cluster, n: int) -> list[str]:
    """Why AutoTP cannot split this model N ways (empty when it can), as the trainer refuses a run:
    heads, key/value heads, hidden and MLP widths split evenly; the groups tile the world and stay
    within a node (their all-reduces run every layer, on its fastest links)."""
    if n == 1:
        return []
    problems = []
    if spec.arch != "llama":
        problems.append(f"AutoTP has no sharding plan for {spec.arch}")
    sizes = {"attention heads": spec.n_heads, "key/value heads": spec.n_kv_heads or spec.n_heads,
             "hidden size": spec.hidden_size, "MLP width": spec.intermediate_size or 4 * spec.hidden_size}  # fmt: skip
    problems += [f"the {value} {name} do not split {n} ways" for name, value in sizes.items() if value % n]
    if cluster.world_size % n:
        problems.append(f"the world of {cluster.world_size} GPUs does not split into groups of {n}")
    if n > cluster.gpus_per_node:
        problems.append(f"a group of {n} would span nodes of {cluster.gpus_per_node} GPUs")
    return problems


def tensor_parallel_sizes(spec: ModelSpec, cluster: Cluster, largest: int) -> list[int]:
    """The tensor-parallel sizes up to ``largest`` a run could use, smallest first."""
    return [
        n
        for n in range(1, largest + 1)
        if largest % n == 0 and not tensor_parallel_problems(spec, cluster, n)
    ]


def sequence_parallel_sizes(spec: ModelSpec, cluster: Cluster, seq_len: int, largest: int) -> list[int]:
    """The sequence-parallel sizes up to ``largest`` a run could use, smallest first: the divisors of
    ``largest`` that ``sequence_parallel_problems`` accepts."""
    return [n for n in range(1, largest + 1)
            if largest % n == 0 and not sequence_parallel_problems(spec, cluster, seq_len, n)]  # fmt: skip


@dataclass(frozen=True)
class LongContext:
    """What a plan may use beyond ZeRO and offload (``trainer plan``'s flags): sequence-parallel sizes up
    to ``sequence_parallel``, a tiled MLP, offloaded checkpointed inputs; the loss tiled as given, or by
    the trainer's auto rule when None; tensor-parallel sizes up to ``tensor_parallel``, expert-parallel
    ones up to ``expert_parallel``."""

    sequence_parallel: int = 1
    tiled_loss: bool | None = None
    tiled_mlp: bool = False
    offload_activations: bool = False
    tensor_parallel: int = 1
    expert_parallel: int = 1  # expert-parallel sizes up to this, for a mixture of experts


def expert_parallel_sizes(spec: ModelSpec, cluster: Cluster, largest: int) -> list[int]:
    """The expert-parallel sizes up to ``largest`` a run could use, smallest first: the divisors of
    ``largest`` that divide the experts and the world (1 alone for a dense model)."""
    if not spec.n_experts:
        return [1]
    return [
        n
        for n in range(1, largest + 1)
        if largest % n == 0 and not spec.n_experts % n and not cluster.world_size % n
    ]


def candidate_setups(spec: ModelSpec, cluster: Cluster, seq_len: int, sequences: int,
                     options: LongContext = LongContext()) -> list[Setup]:  # fmt: skip
    """Every setup the options allow, in the order the recommendation tries them.

    Optimizer offload decides first (as in ``setups``), then the fewest features that cost compute or
    transfers (checkpointing, a tiled MLP, activation offload, preferred in that order), then the
    smallest sequence-parallel size, then ZeRO 0-2 with the smallest tensor- and expert-parallel sizes
    before ZeRO-3 (within a node TP's all-reduces cost less than ZeRO-3's gathers of every weight, and
    EP's exchange of a layer's tokens less than the gathers of its experts; neither runs with sequence
    parallelism, nor with the other), then the lowest ZeRO stage. The loss tiling is no choice: it
    follows the flag, or the trainer's auto rule for the tokens a rank holds (``sequences`` of a
    micro-batch: its rows, a pair's two for a preference objective). Without long-context
    options this is ``setups()`` in its own order.
    """
    out = []
    tensor_sizes = tensor_parallel_sizes(spec, cluster, options.tensor_parallel)
    expert_sizes = expert_parallel_sizes(spec, cluster, options.expert_parallel)
    for base in setups():
        for sp in sequence_parallel_sizes(spec, cluster, seq_len, options.sequence_parallel):
            tiled_loss = options.tiled_loss
            if tiled_loss is None:
                tiled_loss = tiled_loss_auto(spec.vocab_size, sequences * seq_len // sp)
            for tiled_mlp in sorted({False, options.tiled_mlp}):
                for offload in sorted({False, options.offload_activations and base.activation_checkpointing}):
                    for tp in tensor_sizes if sp == 1 else [1]:
                        for ep in expert_sizes if sp == tp == 1 else [1]:  # AutoEP runs with DP alone
                            out.append(replace(base, sequence_parallel=sp, tiled_loss=tiled_loss, tiled_mlp=tiled_mlp,
                                               offload_activations=offload, tensor_parallel=tp, expert_parallel=ep))  # fmt: skip

    def order(s: Setup) -> tuple[Any, ...]:
        features = (s.activation_checkpointing, s.tiled_mlp, s.offload_activations)
        tier = OFFLOADS.index((s.offload_optimizer, s.offload_param))
        return (tier, sum(features), s.sequence_parallel, tuple(not f for f in features), s.zero_stage == 3,
                s.tensor_parallel, s.expert_parallel, s.zero_stage)  # fmt: skip

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
         long_context: LongContext = LongContext(), objective: Objective = Objective(),
         optim: str = "adamw") -> dict[str, Any]:  # fmt: skip
    """Every configuration, in the order ``candidate_setups`` tries them, and the first that fits (or None).

    ``config_for`` gives the DeepSpeed config a setup would run with, so buffers are sized from the
    run's real bucket sizes; without it DeepSpeed's defaults are assumed.
    """
    rows = []
    sequences = micro_batch * objective.sequences_per_row  # what the loss's auto tiling judges
    for setup in candidate_setups(spec, cluster, seq_len, sequences, long_context):
        if optim == "muon" and (setup.offload_optimizer == "nvme" or setup.tensor_parallel > 1):
            continue  # refused by the run: Muon needs whole matrices, its states in memory
        if lora_r and setup.expert_parallel > 1:
            continue  # refused by the run: AutoEP replaces the blocks LoRA wraps
        ds_config = config_for(setup) if config_for else None
        rows.append(
            estimate(
                spec,
                setup,
                cluster,
                seq_len,
                micro_batch,
                precision,
                ds_config,
                lora_r,
                qlora,
                objective,
                optim,
            )
        )
    sizes = sequence_parallel_sizes(spec, cluster, seq_len, long_context.sequence_parallel)
    return {
        "model": asdict(spec),
        "cluster": {**asdict(cluster), "world_size": cluster.world_size},
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "precision": precision,
        "lora_r": lora_r,
        "qlora": qlora,
        "objective": asdict(objective),
        "optim": optim,
        "trainable_params": lora_params(spec, lora_r) if lora_r else spec.n_params,
        "active_params": spec.active_params,
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
