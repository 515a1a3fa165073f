"""``trainer plan``: memory per GPU and per node for each ZeRO stage, offload and checkpointing choice,
and for long sequences each sequence-parallel size and tiling or activation-offload choice."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from trainer.config import generate
from trainer.config.errors import ConfigError
from trainer.config.optim import OFFLOAD_NOTE
from trainer.objectives import DEFAULT, NAMES, OBJECTIVES
from trainer.planner import (
    PRESETS,
    Cluster,
    LongContext,
    ModelSpec,
    Objective,
    Setup,
    format_activation_table,
    format_table,
    leanest,
    load_model_spec,
    long_context_words,
    no_fit_message,
    reference_bytes,
    sequence_parallel_problems,
    spec_from_counts,
    tensor_parallel_problems,
)
from trainer.planner import plan as make_plan

SIZE_FLAGS = ("params", "layers", "hidden", "heads", "vocab")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (either --model, or all five size flags)")
    model.add_argument(
        "--model", help=f"an HF config.json, a directory holding one, or a preset: {', '.join(PRESETS)}"
    )
    model.add_argument("--params", type=float, help="parameter count, e.g. 7.5e9")
    model.add_argument("--layers", type=int, help="transformer layers")
    model.add_argument("--hidden", type=int, help="hidden size")
    model.add_argument("--heads", type=int, help="attention heads")
    model.add_argument("--vocab", type=int, help="vocabulary size")
    run = parser.add_argument_group("run and cluster")
    run.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    run.add_argument(
        "--micro-batch", type=int, default=1, help="sequences per GPU per micro-step (default 1)"
    )
    run.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    run.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    run.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU in GB (default 80)")
    run.add_argument(
        "--cpu-memory-gb", type=float, default=1024.0, help="host memory of one node in GB (default 1024)"
    )
    run.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16", help="default bf16")
    run.add_argument(
        "--lora-r", type=int, help="LoRA adapters of this rank on every linear layer, base frozen"
    )
    run.add_argument("--qlora", action="store_true", help="with --lora-r: the frozen base in 4-bit NF4")
    run.add_argument(
        "--optim", choices=["adamw", "muon"], default="adamw",
        help="muon: the hidden matrices keep one fp32 moment, not Adam's two (no NVMe offload, no TP)",
    )  # fmt: skip
    run.add_argument(
        "--objective", choices=NAMES, default=DEFAULT,
        help="what the run trains; a preference objective's micro-batch counts pairs (2 sequences each)",
    )  # fmt: skip
    run.add_argument(
        "--generation-batch", type=int, default=0, metavar="N",
        help="online RL (grpo, rloo): completions each GPU generates at once, its KV cache counted "
        "(default: --micro-batch; TRL's is micro-batch x steps_per_generation)",
    )  # fmt: skip
    run.add_argument(
        "--reference", choices=["cached", "model"], default="cached",
        help="DPO's reference: the cached pass (no model held in training; the default) or a reference "
        "model beside the policy, as TRL holds one",
    )  # fmt: skip
    run.add_argument(
        "--tensor-parallel", type=int, default=1, metavar="N",
        help="AutoTP tensor parallelism up to N ranks a layer, within a node (sizes dividing N are tried; "
        "default 1)",
    )  # fmt: skip
    run.add_argument(
        "--expert-parallel", type=int, metavar="N",
        help="a mixture of experts: AutoEP over up to N ranks (sizes dividing N, the experts and the world "
        "are tried; default: the GPUs of a node; 1 for a dense model)",
    )  # fmt: skip
    long = parser.add_argument_group(
        "long context (the plan picks the fewest features and smallest size that fit)"
    )
    long.add_argument(
        "--sequence-parallel", type=int, default=1, metavar="N",
        help="Ulysses sequence parallelism up to N ranks a sequence (sizes dividing N are tried; default 1)",
    )  # fmt: skip
    long.add_argument(
        "--tiled-loss", action=argparse.BooleanOptionalAction, default=None,
        help="compute the loss in 256 MiB tiles of logits (default: as the trainer's auto rule, "
        "tiled when one micro-batch's fp32 logits exceed 256 MiB)",
    )  # fmt: skip
    long.add_argument(
        "--tiled-mlp", action="store_true", help="allow each MLP to run over the sequence in tiles"
    )
    long.add_argument(
        "--offload-activations", action="store_true",
        help="allow checkpointed layer inputs to be kept in host memory",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _spec(args: argparse.Namespace) -> ModelSpec:
    given = [name for name in SIZE_FLAGS if getattr(args, name) is not None]
    if args.model and given:
        raise ConfigError(
            f"give --model or the size flags, not both (got --model and --{given[0]})", "--model"
        )
    if args.model:
        return load_model_spec(args.model)
    if not given:
        raise ConfigError("no model: give --model, or --params --layers --hidden --heads --vocab", "--model")
    missing = [f"--{name}" for name in SIZE_FLAGS if name not in given]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)} (all five size flags are needed)", missing[0])
    return spec_from_counts(args.params, args.layers, args.hidden, args.heads, args.vocab)


def _check_positive(args: argparse.Namespace) -> None:
    flags = [
        "seq_len",
        "micro_batch",
        "gpus_per_node",
        "nodes",
        "gpu_memory_gb",
        "cpu_memory_gb",
        "sequence_parallel",
        "tensor_parallel",
        "expert_parallel",
        *SIZE_FLAGS,
    ]
    problems = [
        (f"--{name.replace('_', '-')}", f"must be > 0, got {getattr(args, name)}")
        for name in flags
        if getattr(args, name) is not None and getattr(args, name) <= 0
    ]
    if problems:
        raise ConfigError(problems)


def _check_sequence_parallel(args: argparse.Namespace, spec: ModelSpec, cluster: Cluster) -> None:
    """The largest sequence-parallel size must itself be one Ulysses can use (smaller ones that cannot
    are skipped quietly)."""
    problems = sequence_parallel_problems(spec, cluster, args.seq_len, args.sequence_parallel)
    if problems:
        raise ConfigError(
            f"{args.sequence_parallel} cannot be used: {'; '.join(problems)}", "--sequence-parallel"
        )


def _check_tensor_parallel(args: argparse.Namespace, spec: ModelSpec, cluster: Cluster) -> None:
    """The largest tensor-parallel size must itself be one AutoTP can use, and not with what it does
    not run with."""
    if args.tensor_parallel == 1:
        return
    problems = tensor_parallel_problems(spec, cluster, args.tensor_parallel)
    if args.lora_r:
        problems.append("LoRA does not run with tensor parallelism")
    if args.sequence_parallel > 1:
        problems.append("sequence parallelism does not run with tensor parallelism")
    if problems:
        raise ConfigError(
            f"{args.tensor_parallel} cannot be used: {'; '.join(problems)}", "--tensor-parallel"
        )


def deepspeed_config(
    setup: Setup, precision: str, micro_batch: int, world_size: int, hidden: int
) -> dict[str, Any]:
    """The DeepSpeed config a setup runs with, built through the schema. Sequence- and tensor-parallel
    ranks share their rows, so the batch counts the data-parallel width, world_size / N."""
    return generate(
        zero_stage=setup.zero_stage,
        precision=precision,
        offload_optimizer=setup.offload_optimizer,
        offload_param=setup.offload_param,
        micro_batch=micro_batch,
        grad_accum=1,
        world_size=world_size,
        hidden_size=hidden,
        sequence_parallel_size=setup.sequence_parallel,
        tensor_parallel_size=setup.tensor_parallel,
    )


def training_flags(row: dict[str, Any], tiled_loss_given: bool) -> list[str]:
    """The training arguments a configuration needs beyond its DeepSpeed config. The loss tiling is
    spelled out only when --tiled-loss or --no-tiled-loss chose it: otherwise the plan followed the
    trainer's own ``--tiled_loss auto``."""
    flags = ["--gradient_checkpointing true"] if row["activation_checkpointing"] else []
    if row["sequence_parallel"] > 1:
        flags.append(f"--sequence_parallel_size {row['sequence_parallel']}")
    if row["tensor_parallel"] > 1:
        flags.append(f"--tensor_parallel_size {row['tensor_parallel']}")
    if row["expert_parallel"] > 1:
        flags.append(f"--expert_parallel_size {row['expert_parallel']}")
    if tiled_loss_given:
        flags.append(f"--tiled_loss {str(row['tiled_loss']).lower()}")
    flags += ["--tiled_mlp true"] if row["tiled_mlp"] else []
    flags += ["--offload_activations true"] if row["offload_activations"] else []
    return flags


def run(args: argparse.Namespace) -> int:
    try:
        _check_positive(args)
        if args.qlora and not args.lora_r:
            raise ConfigError("QLoRA trains LoRA adapters: give --lora-r too", "--qlora")
        if args.reference == "model" and not OBJECTIVES[args.objective].reference:
            scored = [name for name, entry in OBJECTIVES.items() if entry.reference]
            only = (
                f"only {scored[0]} does"
                if len(scored) == 1
                else f"only {', '.join(scored[:-1])} and {scored[-1]} do"
            )
            raise ConfigError(f"--objective {args.objective} has no reference model; {only}", "--reference")
        spec = _spec(args)
        cluster = Cluster(args.gpus_per_node, args.nodes, args.gpu_memory_gb, args.cpu_memory_gb)
        _check_sequence_parallel(args, spec, cluster)
        _check_tensor_parallel(args, spec, cluster)
    except ConfigError as err:
        print(f"trainer plan: {err}", file=sys.stderr)
        return 2
    options = LongContext(
        args.sequence_parallel,
        args.tiled_loss,
        args.tiled_mlp,
        args.offload_activations,
        args.tensor_parallel,
        (args.expert_parallel or cluster.gpus_per_node) if spec.n_experts else 1,
    )

    def config_for(setup: Setup) -> dict[str, Any]:
        return deepspeed_config(setup, args.precision, args.micro_batch, cluster.world_size, spec.hidden_size)

    objective = Objective(args.objective, args.reference == "model", args.generation_batch)
    result = make_plan(spec, cluster, args.seq_len, args.micro_batch, args.precision, config_for,
                       args.lora_r, args.qlora, options, objective, args.optim)  # fmt: skip
    best = result["recommended"]
    if best is not None:
        best["deepspeed_config"] = config_for(Setup(**{k: best[k] for k in Setup.__dataclass_fields__}))
        best["training_flags"] = training_flags(best, args.tiled_loss is not None)
        best["training_flags"] += ["--optim muon"] if args.optim == "muon" else []
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(_report(result, replace(options, tensor_parallel=1, expert_parallel=1) != LongContext()))
    if best is None:
        print(f"trainer plan: {no_fit_message(result)}", file=sys.stderr)
        return 1
    return 0


def _report(result: dict[str, Any], long_context: bool) -> str:
    """The text report: the run, the table, with long-context options their own table, the recommendation."""
    m, c = result["model"], result["cluster"]
    lines = [
        f"model {m['name']}: {m['n_params'] / 1e9:.2f}B parameters, {m['n_layers']} layers, hidden "
        f"{m['hidden_size']}, {m['n_heads']} heads, vocab {m['vocab_size']}",
        *(
            [
                f"a mixture of {m['n_experts']} experts a layer, {m['experts_per_token']} per token: "
                f"{m['expert_params'] / 1e9:.2f}B parameters in experts, {result['active_params'] / 1e9:.2f}B "
                "active per token; expert states per rank divided by the expert-parallel size"
            ]
            if m["n_experts"]
            else []
        ),
        f"run: {result['precision']}, seq_len {result['seq_len']}, micro-batch {result['micro_batch']}; "
        f"{c['nodes']} node(s) x {c['gpus_per_node']} GPUs of {c['gpu_memory_gb']:g} GB, "
        f"{c['cpu_memory_gb']:g} GB host memory per node (10% of each kept free)",
        *(
            [
                f"LoRA r={result['lora_r']}{' on a 4-bit base (QLoRA)' if result['qlora'] else ''}: "
                f"{result['trainable_params'] / 1e6:.1f}M trainable parameters of {m['n_params'] / 1e9:.2f}B"
            ]
            if result["lora_r"]
            else []
        ),
    ]
    lines += _objective_lines(result)
    if result["optim"] == "muon":
        lines.append(
            "optimizer states sized for Muon's one fp32 moment on the hidden matrices, AdamW's two on the rest"
        )
    else:
        lines.append(f"optimizer states sized for Adam's two fp32 moments; {OFFLOAD_NOTE}")
    if long_context:
        lines += [
            "activations and logits per GPU, GB, by sequence-parallel size (every combination, allowed or "
            f"not; loss tiles of {result['long_context']['loss_tile_tokens']} tokens):",
            "",
            format_activation_table(result),
            "",
        ]
    shown = long_context_words(result["recommended"] or leanest(result))
    with_ = f", with {', '.join(shown)}" if shown else ""
    lines += [
        f"GB per GPU (1 GB = 1e9 bytes), fastest configuration first{with_}:",
        "",
        format_table(result),
        "",
    ]
    return "\n".join(lines + _recommendation(result))


def _objective_lines(result: dict[str, Any]) -> list[str]:
    """What a preference objective changes: the pairs, and DPO's reference and what it costs."""
    objective, m = result["objective"], result["model"]
    entry = OBJECTIVES[objective["name"]]
    if entry.data == "prompts":
        return _generation_lines(result)
    if entry.sequences_per_row == 1:
        return []
    rows = "a pair" if entry.data == "pairs" else "a completion and its KL partner"
    lines = [f"objective {entry.name}: each micro-batch row is {rows}, 2 sequences of seq_len"]
    if not entry.reference:
        return lines + ["reference: none (the objective is reference-free)"]
    if result["lora_r"]:
        return lines + ["reference: the frozen base with the adapters off, no second model"]
    world = result["cluster"]["world_size"]
    whole, share = (
        reference_bytes(m["n_params"], stage, world, result["precision"]) / 1e9 for stage in (0, 3)
    )
    cost = f"{whole:.2f} GB per GPU at ZeRO 0-2, {share:.2f} GB at ZeRO-3"
    if objective["reference_model"]:
        return lines + [f"reference: a model beside the policy, in the model column ({cost})"]
    return lines + [
        f"reference: the cached pass, scored before step 0; no model held in training, where a reference "
        f"model would add {cost} (--reference model plans with one)"
    ]


def _generation_lines(result: dict[str, Any]) -> list[str]:
    """What online RL adds: a rollout's KV cache, and under ZeRO-3 the weights gathered to generate."""
    row = result["recommended"] or leanest(result)
    objective = result["objective"]
    rows = objective["generation_rows"] or result["micro_batch"]
    generation = row["generation"]
    lines = [
        f"objective {objective['name']}: the policy generates {rows} completions at once per GPU "
        f"(prompt and completion: seq_len tokens); KV cache {generation['kv_cache']:.2f} GB"
    ]
    if "gathered_layer" in generation:
        lines.append(
            f"generation under ZeRO-3: the whole weights do not fit, so {generation['gathered_weights']:.2f} GB "
            f"of them are gathered once per rollout and each forward gathers the rest a layer at a time "
            f"({generation['gathered_layer']:.2f} GB), as training does"
        )
    elif "gathered_weights" in generation:
        lines.append(
            f"generation under ZeRO-3: the weights gathered whole once per rollout, "
            f"{generation['gathered_weights']:.2f} GB"
        )
    lines.append(
        "a rollout is let go before the backward: the activations column holds the larger of the two"
    )
    return lines


def _recommendation(result: dict[str, Any]) -> list[str]:
    """The recommended configuration in words, the training flags it needs and its DeepSpeed config."""
    best = result["recommended"]
    if best is None:
        return []
    offload = "no offload"
    if best["offload_optimizer"] == "cpu":
        offload = (
            "optimizer and parameters offloaded to CPU"
            if best["offload_param"] == "cpu"
            else "optimizer offloaded to CPU"
        )
    ckpt = "on" if best["activation_checkpointing"] else "off"
    extra = "".join(f", {word}" for word in long_context_words(best))
    lines = [
        f"recommended: ZeRO-{best['zero_stage']}, {offload}, activation checkpointing {ckpt}{extra} "
        f"({best['total_gb_per_gpu']:.1f} GB of {result['usable_gpu_memory_gb']:.1f} GB usable per GPU)",
    ]
    if best["training_flags"]:
        lines.append(f"train with {' '.join(best['training_flags'])}")
    lines += ["DeepSpeed config (the optimizer and scheduler come from the training arguments):"]
    lines.append(json.dumps(best["deepspeed_config"], indent=2))
    return lines
