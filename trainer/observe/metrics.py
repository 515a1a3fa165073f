"""The metrics.jsonl writer, its reader, and the end-of-training summary.

TensorBoard and the other ``report_to`` integrations are transformers' own callbacks
(trainer/observe/reporting.py).

Only the standard library is imported here, so reading and plotting metrics never loads torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from trainer.runtime.run_files import METRICS


def _plain(value: Any) -> Any:
    """A JSON-safe scalar: tensors and numpy numbers become Python numbers, NaN and inf become None."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends one JSON object per row to ``output_dir/metrics.jsonl`` on the main rank.

    Each row is flushed as it is written, so a crashed run keeps every row logged before the crash.
    The file is appended to, so a resumed run continues it; readers keep the last row of each step.
    """

    def __init__(self, output_dir: str, is_main: bool = True):
        self.is_main = is_main
        self.path = Path(output_dir) / METRICS
        self._file = None
        if not is_main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        if self._file is None:
            return
        row = {key: _plain(value) for key, value in row.items()}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (a file or a run directory); a torn last line is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(row, dict):
            rows.append(row)
    return rows


def summary_table(rows: list[dict[str, Any]]) -> str:
    """End-of-training summary: total time, tokens, mean throughput, final and best eval loss."""
    train = [r for r in rows if r.get("loss") is not None or r.get("tokens_per_second") is not None]
    evals = [r for r in rows if r.get("eval_loss") is not None]
    timed = [r for r in train if r.get("train_time_s") is not None]
    items: list[tuple[str, str]] = []
    if train:
        items.append(("steps", str(max(int(r.get("step", 0)) for r in train))))
    if timed:
        last = timed[-1]
        seconds, tokens = float(last["train_time_s"]), float(last.get("total_tokens", 0))
        items.append(("train time", _duration(seconds)))
        items.append(("tokens", f"{tokens:,.0f}"))
        if seconds > 0:
            items.append(("mean tokens/s", f"{tokens / seconds:,.1f}"))
    mfus = [r["mfu"] for r in train if r.get("mfu") is not None]
    if mfus:
        items.append(("mean MFU", f"{100 * sum(mfus) / len(mfus):.1f}%"))
    losses = [r for r in train if r.get("loss") is not None]
    if losses:
        items.append(("final train loss", f"{losses[-1]['loss']:.4f}"))
    if evals:
        best = min(evals, key=lambda r: r["eval_loss"])
        items.append(("best eval loss", f"{best['eval_loss']:.4f} (step {best.get('step', '?')})"))
    if not items:
        return "no metrics logged"
    width = max(len(k) for k, _ in items)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in items)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"
