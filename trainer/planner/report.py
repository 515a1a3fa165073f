"""The plan for people: a configuration in words, the configurations table and the activations table,
why nothing fits; and DeepSpeed's own model-state estimators to compare with (they import deepspeed,
which the rest of the planner never does).
"""

from __future__ import annotations

from typing import Any


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
    words += [f"tensor parallel {row['tensor_parallel']}"] if row.get("tensor_parallel", 1) > 1 else []
    words += [f"expert parallel {row['expert_parallel']}"] if row.get("expert_parallel", 1) > 1 else []
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
        f"{'zero':>4} {'tp':>2} {'ep':>2} {'offload':>9} {'ckpt':>4} | {'model':>8} {'buffers':>8} {'activ.':>8} "
        f"{'total/GPU':>9} {'GPU/node':>9} {'CPU/node':>9} | fits"
    )
    lines = [head, "-" * len(head)]
    for r in table_rows(result):
        offload = {"none": "-", "cpu": "opt"}[r["offload_optimizer"]] + (
            "+param" if r["offload_param"] == "cpu" else ""
        )
        fits = "yes" if r["fits"] else ("no (GPU)" if not r["fits_gpu"] else "no (CPU)")
        lines.append(
            f"{r['zero_stage']:>4} {r['tensor_parallel']:>2} {r['expert_parallel']:>2} {offload:>9} "
            f"{'on' if r['activation_checkpointing'] else 'off':>4} | "
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
