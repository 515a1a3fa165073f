"""From the ranks' step times to the figures: medians, tokens/s, memory, loss, MFU and ratios to ours."""

from __future__ import annotations

import statistics
from typing import Any

from trainer.bench.job import SYSTEMS, Job

METRICS = ("step_time_median_s", "tokens_per_second", "peak_memory_bytes", "final_loss")


def summarise(job: Job, results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One entry per system (in SYSTEMS order) with the four contract keys, spread, MFU and ratios.

    A step's time is the slowest rank's (a step ends for the job when it ends on every rank). The
    first ``job.warmup`` steps and any profiled steps are left out of the median.
    """
    summary: dict[str, dict[str, Any]] = {}
    for system in (s for s in SYSTEMS if s in results):
        ranks = results[system]
        steady = list(_steady(job, ranks, "times").values())
        if not steady:
            raise SystemExit(f"bench: {system} has no steady steps; raise --steps above --warmup")
        median = statistics.median(steady)
        entry: dict[str, Any] = {
            "step_time_median_s": median,
            "tokens_per_second": job.tokens_per_step / median,
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in ranks),
            "final_loss": ranks[0]["final_loss"],
            "step_time_p25_s": _quantile(steady, 0.25),
            "step_time_p75_s": _quantile(steady, 0.75),
            "steps_measured": len(steady),
            "peak_memory_bytes_per_rank": [r["peak_memory_bytes"] for r in ranks],
            "dp_world_size": ranks[0]["dp_world_size"],
        }
        if job.device == "cpu":
            entry["cpu_time_median_s"] = statistics.median(_steady(job, ranks, "cpu_times").values())
        notes = sorted({n for r in ranks for n in r["notes"]})
        profiled = sorted({s for r in ranks for s in r["profiled"]})
        if profiled:
            notes.append(
                f"steps {profiled[0]}-{profiled[-1]} were profiled and left out of the medians; "
                "the profiler's buffers count in this system's host memory"
            )
        if notes:
            entry["notes"] = notes
        if job.device == "cuda":
            entry.update(_mfu(job, entry["tokens_per_second"], ranks[0]))
        summary[system] = entry
    if "ours" in summary:
        ours = summary["ours"]
        keys = METRICS + (("cpu_time_median_s",) if job.device == "cpu" else ())
        ours_steps = _steady(job, results["ours"], "times")
        for system, entry in summary.items():
            entry["ratio_to_ours"] = {m: entry[m] / ours[m] if ours[m] else None for m in keys}
            # Step k of every system ran within one round of the others: the median of the
            # per-step ratios cancels load that drifts over the run.
            theirs = _steady(job, results[system], "times")
            pairs = [theirs[k] / ours_steps[k] for k in theirs.keys() & ours_steps.keys()]
            entry["ratio_to_ours"]["step_time_paired"] = statistics.median(pairs) if pairs else None
    return summary


def _steady(job: Job, ranks: list[dict[str, Any]], key: str) -> dict[int, float]:
    """Step number -> the slowest rank's value, without the warm-up and profiled steps."""
    per_step = [max(r[key][i] for r in ranks) for i in range(len(ranks[0][key]))]
    skipped = set(range(1, job.warmup + 1)) | {s for r in ranks for s in r["profiled"]}
    return {step: t for step, t in enumerate(per_step, start=1) if step not in skipped}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _mfu(job: Job, tokens_per_second: float, rank0: dict[str, Any]) -> dict[str, Any]:
    """Model TFLOP/s per GPU and MFU against the GPU's dense peak (trainer.observe.throughput's table)."""
    from trainer.observe.throughput import peak_tflops

    tflops = rank0["flops_per_token"] * tokens_per_second / job.world_size / 1e12
    peak = peak_tflops(rank0["device_name"], job.precision)
    return {
        "model_tflops_per_gpu": tflops,
        "peak_tflops": peak,
        "mfu": tflops / peak if peak else None,
        "device_name": rank0["device_name"],
    }


def describe(job: Job, summary: dict[str, dict[str, Any]], results: dict[str, list[dict[str, Any]]]) -> str:
    """The report's first line: the job, in words."""
    first = next(iter(results.values()))[0]
    gc = "on" if job.gradient_checkpointing else "off"
    return (
        f"job: Llama '{job.model}' {first['n_params'] / 1e6:.1f}M params, {job.precision}, ZeRO-{job.zero_stage}, "
        f"activation checkpointing {gc}, {job.world_size} rank(s) ({first['device_name']}), seq {job.seq_len}, "
        f"micro-batch {job.micro_batch} x accumulation {job.grad_accum} = {job.tokens_per_step} tokens/step, "
        f"{job.steps} steps per system ({job.warmup} warm-up), {job.chunk} steps a turn, seed {job.seed}"
    )


def table(job: Job, summary: dict[str, dict[str, Any]]) -> str:
    cuda = job.device == "cuda"
    head = f"{'system':<11} {'step s (median)':>15} {'p25-p75':>15} {'tokens/s':>10} {'peak mem/rank':>14} {'final loss':>11}"
    head += f" {'MFU':>6}" if cuda else f" {'CPU s/step':>10}"
    head += "   ratio to ours: step time / tokens/s / memory" + ("" if cuda else " / CPU time")
    lines = [head]
    for system, e in summary.items():
        spread = f"{e['step_time_p25_s']:.4f}-{e['step_time_p75_s']:.4f}"
        line = (
            f"{system:<11} {e['step_time_median_s']:>15.4f} {spread:>15} {e['tokens_per_second']:>10.0f}"
            f" {e['peak_memory_bytes'] / 2**20:>10.0f} MiB {e['final_loss']:>11.6f}"
        )
        if cuda:
            line += f" {e['mfu'] * 100:>5.1f}%" if e.get("mfu") is not None else f" {'n/a':>6}"
        else:
            line += f" {e['cpu_time_median_s']:>10.4f}"
        r = e.get("ratio_to_ours")
        if r:
            line += f"   {r['step_time_median_s']:.3f} / {r['tokens_per_second']:.3f} / {r['peak_memory_bytes']:.3f}"
            line += "" if cuda else f" / {r['cpu_time_median_s']:.3f}"
        lines.append(line)
    for system, e in summary.items():
        for note in e.get("notes", []):
            lines.append(f"note ({system}): {note}")
    return "\n".join(lines)


def verdicts(summary: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's goals, measured: overhead vs the raw loop, speed vs the peers, same work."""
    if "ours" not in summary:
        return []
    ours = summary["ours"]
    out = []
    if "deepspeed" in summary:
        raw = summary["deepspeed"]
        overhead = ours["step_time_median_s"] / raw["step_time_median_s"] - 1
        paired = raw["ratio_to_ours"]["step_time_paired"]
        line = f"overhead vs the raw DeepSpeed loop: {overhead * 100:+.1f}% step time"
        line += f" ({(1 / paired - 1) * 100:+.1f}% paired step by step)" if paired else ""
        if "cpu_time_median_s" in ours:
            cpu = ours["cpu_time_median_s"] / raw["cpu_time_median_s"] - 1
            line += f", {cpu * 100:+.1f}% CPU time per step"
        out.append(line + " (goal: within 2%)")
        diff = abs(ours["final_loss"] - raw["final_loss"])
        same = "equal" if diff == 0 else f"differ by {diff:.3g}"
        out.append(
            f"same work: final loss ours {ours['final_loss']:.6f}, raw loop {raw['final_loss']:.6f} ({same})"
        )
    for peer in ("hf_trainer", "accelerate"):
        if peer in summary:
            ratio = summary[peer]["step_time_median_s"] / ours["step_time_median_s"]
            word = "faster" if ratio > 1 else "slower"
            out.append(f"{peer}: step time {ratio:.3f}x ours (we are {word})")
    return out
