"""The parts of ``scripts/bench_long_context.py`` that start no process: the setups, the length
search, the reading of one probe, the summary and the table.

A probe is one short training run at one sequence length; it fits when it ends normally with its
peak memory under the cap. Each setup's search doubles the length from ``start`` until a probe does
not fit (or ``max_len`` is reached), then bisects between the longest fit and the shortest miss
down to ``unit`` tokens. A probe that fails for another reason (an exception, a timeout) ends that
setup's search: its longest fit so far is reported with the error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

OUT_OF_MEMORY = ("out of memory", "OutOfMemoryError", "CUBLAS_STATUS_ALLOC_FAILED")


@dataclass
class Setup:
    name: str
    label: str  # the table's column heading
    system: str  # "ours" or "hf"
    ranks: int
    sp: int
    flags: list[str] = field(default_factory=list)  # ours: extra train.py flags
    skip: str | None = None  # why this setup does not run here


def lengths(start: int, unit: int, max_len: int) -> Generator[int, bool | None, None]:
    """The lengths to probe, one at a time; ``send`` each probe's verdict (True: fits, False: over the
    cap, None: failed otherwise, which ends the search). ``start`` and ``max_len`` are taken as
    multiples of ``unit`` (up and down)."""
    length, top = bounds(start, unit, max_len)
    fit = miss = None
    while True:
        verdict = yield length
        if verdict is None:
            return
        if not verdict:
            miss = length
            break
        fit = length
        if length >= top:
            return  # the search limit fits: the answer is "at least top"
        length = min(2 * length, top)
    if fit is None:
        return  # not even the first length fits
    while miss - fit > unit:
        middle = (fit + miss) // 2 // unit * unit
        if middle <= fit:
            break
        verdict = yield middle
        if verdict is None:
            return
        if verdict:
            fit = middle
        else:
            miss = middle


def bounds(start: int, unit: int, max_len: int) -> tuple[int, int]:
    """(first, last) length a search may probe: ``start`` rounded up and ``max_len`` rounded down to
    multiples of ``unit`` (never below the first)."""
    unit = max(1, unit)
    first = max(unit, math.ceil(start / unit) * unit)
    return first, max(first, max_len // unit * unit)


def classify(
    returncode: int, stopped: str | None, log_tail: str, peak: int | None, cap: int
) -> tuple[bool | None, str | None]:
    """(fits, error) of a finished probe: fits is False when the run went over the cap (stopped by
    the watcher, its peak past the cap, killed by the kernel, or an out-of-memory error), None with
    an error when it failed for another reason."""
    if stopped in ("cap", "over_cap_at_exit"):
        return False, None
    if stopped == "timeout":
        return None, "timed out"
    if returncode != 0:
        if any(marker in log_tail for marker in OUT_OF_MEMORY):
            return False, None
        if returncode in (-9, 137) or "exits with return code = -9" in log_tail:
            return False, None  # SIGKILL we did not send: the kernel's OOM killer
        return None, f"exit code {returncode}: {last_error_line(log_tail)}"
    if peak is None:
        return None, "no memory figure (no metrics rows)"
    return peak <= cap, None


def last_error_line(log: str) -> str:
    """The line that names the failure: the last ``SomeError: message`` line of a traceback (with
    the next line when the message continues there), else the last line of the log."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line.strip()) for line in log.splitlines() if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b:?", lines[i]):
            text = lines[i]
            if text.endswith(":") and i + 1 < len(lines):
                text += " " + lines[i + 1]
            return text[:400]
    return lines[-1][:400] if lines else "(no output)"


def memory_per_token(points: list[tuple[int, int]]) -> tuple[float | None, float | None]:
    """(bytes per token, baseline bytes): the least-squares line through (length, peak) of every
    fitting probe. The slope is what each added token costs; the intercept what the process holds
    whatever the length (interpreter, libraries, weights, optimizer states). None with fewer than
    two lengths."""
    if len({x for x, _ in points}) < 2:
        return None, None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return slope, my - slope * mx


def summarise(setups: list[Setup], probes: list[dict[str, Any]], top: int) -> dict[str, dict[str, Any]]:
    """Per setup: the longest length that fit, the shortest that did not, whether the search's last
    length ``top`` fit (the answer is then "at least top"), memory per token and baseline, tokens/s
    at each length that fit, and the error that ended the search, if any."""
    summary: dict[str, dict[str, Any]] = {}
    for setup in setups:
        mine = [p for p in probes if p["setup"] == setup.name]
        fits = sorted((p for p in mine if p["fits"]), key=lambda p: p["seq_len"])
        misses = sorted(p["seq_len"] for p in mine if p["fits"] is False)
        errors = [p for p in mine if p["error"]]
        slope, base = memory_per_token([(p["seq_len"], p["peak_bytes"]) for p in fits])
        longest = fits[-1]["seq_len"] if fits else None
        summary[setup.name] = {
            "label": setup.label,
            "ranks": setup.ranks,
            "sequence_parallel_size": setup.sp,
            "skipped": setup.skip,
            "longest_fit": longest,
            "first_over": misses[0] if misses else None,
            "limit_reached": longest == top,
            "bytes_per_token": slope,
            "baseline_bytes": base,
            "peak_bytes_at_longest": fits[-1]["peak_bytes"] if fits else None,
            "tokens_per_second": {str(p["seq_len"]): p["tokens_per_second"] for p in fits},
            "error": errors[-1]["error"] if errors else None,
        }
    first = next((s for s in summary.values() if s["longest_fit"]), None)
    for entry in summary.values():
        ok = first is not None and entry["longest_fit"]
        entry["longest_vs_first"] = entry["longest_fit"] / first["longest_fit"] if ok else None
    return summary


def _gb(n: float | None) -> str:
    return "" if n is None else f"{n / 1e9:.2f} GB"


def _cell(probe: dict[str, Any] | None) -> str:
    if probe is None:
        return ""
    if probe["fits"]:
        tps = probe["tokens_per_second"]
        speed = f"{tps:,.0f} tok/s" if tps else "? tok/s"
        return f"{speed}, {_gb(probe['peak_bytes'])}"
    if probe["fits"] is False:
        if not probe.get("peak_bytes"):
            return "over cap"
        # "+": stopped as it passed the cap, so its peak would have been higher still.
        return f"over cap ({_gb(probe['peak_bytes'])}{'+' if probe.get('stopped') == 'cap' else ''})"
    return "error"


def table(setups: list[Setup], probes: list[dict[str, Any]], summary: dict[str, dict[str, Any]]) -> str:
    """A markdown table: one row per length probed, one column per setup (tokens/s and peak memory
    where it fit), then the summary rows."""
    shown = [s for s in setups if not s.skip]
    head = ["seq_len", *(s.label for s in shown)]
    rows = []
    for length in sorted({p["seq_len"] for p in probes}):
        cells = [str(length)]
        for s in shown:
            found = [p for p in probes if p["setup"] == s.name and p["seq_len"] == length]
            cells.append(_cell(found[-1] if found else None))
        rows.append(cells)

    def longest(entry: dict[str, Any]) -> str:
        if entry["longest_fit"] is None:
            return "none" if not entry["error"] else "error"
        return (">= " if entry["limit_reached"] else "") + str(entry["longest_fit"])

    def ratio(entry: dict[str, Any]) -> str:
        r = entry["longest_vs_first"]
        return "" if r is None else (">= " if entry["limit_reached"] else "") + f"{r:.2f}x"

    def per_token(entry: dict[str, Any]) -> str:
        b = entry["bytes_per_token"]
        return "" if b is None else f"{b / 1024:.1f} KiB"

    for title, fn in (
        ("**longest fit**", longest),
        ("longest / first column", ratio),
        ("memory per token", per_token),
        ("baseline (intercept)", lambda e: _gb(e["baseline_bytes"])),
    ):
        rows.append([title, *(fn(summary[s.name]) for s in shown)])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    for s in setups:
        if s.skip:
            lines.append(f"- {s.label}: skipped ({s.skip})")
        elif summary[s.name]["error"]:
            lines.append(f"- {s.label}: {summary[s.name]['error']}")
    return "\n".join(lines)
