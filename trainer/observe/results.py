"""What a run reports as HF's Trainer does: the metrics of a ``train()`` call, and the result files.

``train()`` returns HF's ``TrainOutput(global_step, training_loss, metrics)`` with HF's keys:

- ``train_runtime``: seconds of this ``train()`` call, from after the engine is built and any
  checkpoint loaded, to the end of training (evaluations and saves inside the loop included, as HF);
- ``train_samples_per_second``, ``train_steps_per_second``: the samples (all ranks) and optimizer
  steps this call actually ran, over ``train_runtime``;
- ``total_flos``: model FLOPs of the whole run so far, resumed sessions included: the
  ``6·N + 12·L·h·s`` FLOPs per token of ``trainer.observe.throughput`` times ``state.num_input_tokens_seen``
  (the non-padding tokens trained on all ranks, saved in every checkpoint); 0 for a model without
  an HF config;
- ``train_loss``: the token-weighted mean loss of this call's steps (the sum of every target
  token's loss over the number of target tokens, as each logged ``loss`` is); a logging window whose
  loss is not finite is left out, and a finished run resumed, which trains no step, reports 0.0;
- ``epoch``: ``state.epoch`` at the end.

``log_metrics``, ``save_metrics`` and ``save_state`` write what HF's do, on the main process only;
``metrics_format`` formats as ``log_metrics`` prints.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerState as HFTrainerState
from transformers.trainer_pt_utils import metrics_format
from transformers.trainer_utils import speed_metrics

if TYPE_CHECKING:
    from trainer.runtime.state import TrainerState

TRAINER_STATE_NAME = "trainer_state.json"
ALL_RESULTS_NAME = "all_results.json"


@dataclass
class TrainTotals:
    """What one ``train()`` call did: its start, steps, samples, and its logged loss sums."""

    start_time: float = field(default_factory=time.time)
    steps: int = 0
    samples: float = 0.0
    loss_sum: float = 0.0
    tokens: float = 0.0

    def add_window(self, loss_sum: float, tokens: float) -> None:
        """A logging window's summed loss and target tokens, both over all ranks."""
        if math.isfinite(loss_sum):
            self.loss_sum += loss_sum
            self.tokens += tokens

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.tokens if self.tokens > 0 else 0.0


def train_metrics(totals: TrainTotals, total_flos: float, epoch: float) -> dict[str, float]:
    """HF's metrics of a ``train()`` call (see the module docstring for what each one means)."""
    metrics = speed_metrics("train", totals.start_time, num_samples=totals.samples, num_steps=totals.steps)
    metrics["total_flos"] = float(total_flos)
    metrics["train_loss"] = totals.mean_loss
    metrics["epoch"] = epoch
    return metrics


def format_metrics(split: str, metrics: dict[str, Any]) -> str:
    """HF's ``log_metrics`` block: a header, then one ``key = value`` line per metric, sorted,
    formatted as HF formats them (runtimes as h:mm:ss, total_flos in GF, floats to 4 places)."""
    formatted = metrics_format(metrics)
    lines = [f"***** {split} metrics *****"]
    if formatted:
        k_width = max(len(str(k)) for k in formatted)
        v_width = max(len(str(v)) for v in formatted.values())
        lines += [f"  {k: <{k_width}} = {formatted[k]:>{v_width}}" for k in sorted(formatted)]
    return "\n".join(lines)


def save_metrics(output_dir: str | Path, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
    """``{split}_results.json``, and with ``combined`` the same keys merged into ``all_results.json``
    (a later split's value of a key replaces an earlier one's)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / f"{split}_results.json", metrics)
    if combined:
        path = out / ALL_RESULTS_NAME
        merged = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        merged.update(metrics)
        _write_json(path, merged)


def save_state(output_dir: str | Path, state: TrainerState) -> Path:
    """``trainer_state.json`` in ``output_dir``, in HF's shape: the fields of transformers'
    ``TrainerState`` (its ``load_from_json`` reads the file), ours where they are the same. A
    checkpoint's own copy also holds what an exact resume needs (the data position, the guard's counters)."""
    hf = dataclasses.asdict(HFTrainerState())
    hf.update({k: v for k, v in dataclasses.asdict(state).items() if k in hf})
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / TRAINER_STATE_NAME).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return out / TRAINER_STATE_NAME


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=4, sort_keys=True), encoding="utf-8")


class ResultsAPI:
    """HF's result methods, mixed into the Trainer (which has ``args``, ``state`` and
    ``is_world_process_zero``): each writes or prints on the main process only."""

    def log_metrics(self, split: str, metrics: dict[str, float]) -> None:
        """HF's metrics block: ``***** train metrics *****``, then ``key = value`` lines."""
        if self.is_world_process_zero():
            print(format_metrics(split, metrics), flush=True)

    def save_metrics(self, split: str, metrics: dict[str, float], combined: bool = True) -> None:
        """``{output_dir}/{split}_results.json`` and, with ``combined``, the keys merged into ``all_results.json``."""
        if self.is_world_process_zero():
            save_metrics(self.args.output_dir, split, metrics, combined)

    def save_state(self) -> None:
        """``{output_dir}/trainer_state.json`` (the TrainerState)."""
        if self.is_world_process_zero():
            save_state(self.args.output_dir, self.state)

    def metrics_format(self, metrics: dict[str, float]) -> dict[str, Any]:
        """The metrics as ``log_metrics`` prints them: runtimes as h:mm:ss, ``total_flos`` in GF,
        floats to 4 places (a method, as in HF's Trainer)."""
        return metrics_format(metrics)
