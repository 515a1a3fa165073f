"""PNG plots of one or more runs' metrics.jsonl over steps: loss, learning rate, throughput, memory,
a streamed mixture's realised share of each source, an RL run's reward, and a mixture of experts'
router loss and expert imbalance per layer.

Several runs are overlaid in each plot, one colour per run. Figures are built with matplotlib's
object API on the Agg canvas, so plotting needs no display and touches no global pyplot state.
matplotlib is imported when a figure is built: every rank of a run imports this module, and only
the last rank plots, at the end, while rank 0 samples from the export.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

from trainer.observe.metrics import read_metrics
from trainer.runtime.run_files import METRICS

GB = 1e9

# file name -> (title, y label, [(row key, series label, line style, scale)]); a key ending in "/*"
# stands for every key with that prefix, each a series labelled by the rest of its name.
PLOTS: dict[str, tuple[str, str, list[tuple[str, str, str, float]]]] = {
    "loss": ("Loss", "loss", [("loss", "train", "-", 1.0), ("eval_loss", "eval", "--o", 1.0)]),
    "learning_rate": ("Learning rate", "learning rate", [("learning_rate", "", "-", 1.0)]),
    "throughput": ("Throughput", "tokens/s (all ranks)", [("tokens_per_second", "", "-", 1.0)]),
    "memory": (
        "Peak memory per rank",
        "GB",
        [
            ("peak_memory_allocated_bytes", "device peak", "-", 1 / GB),
            ("host_peak_rss_bytes", "host peak RSS", ":", 1 / GB),
        ],
    ),
    "source_share": (
        "Realised share of each source",
        "share of blocks trained",
        [("source_share/*", "", "-", 1.0)],
    ),
    "reward": (
        "Reward of each rollout (online RL)",
        "reward",
        [("reward", "mean", "-", 1.0), ("reward_std", "std", ":", 1.0)],
    ),
    "router_loss": ("Router load-balancing loss", "aux_loss", [("aux_loss", "", "-", 1.0)]),
    "expert_imbalance": (
        "Expert imbalance per MoE layer",
        "busiest expert's tokens / mean (1: balanced)",
        [("expert_imbalance/*", "layer", "-", 1.0)],
    ),
}


def expand(
    rows: list[dict[str, Any]], keys: list[tuple[str, str, str, float]]
) -> list[tuple[str, str, str, float]]:
    """``keys`` with each ``prefix/*`` replaced by the rows' keys of that prefix, in sorted order."""
    out = []
    for key, label, style, scale in keys:
        if not key.endswith("/*"):
            out.append((key, label, style, scale))
            continue
        found = sorted({k for row in rows for k in row if k.startswith(key[:-1])})
        out += [(k, f"{label} {k[len(key) - 1 :]}".strip(), style, scale) for k in found]
    return out


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of one metric; for a step logged twice (a resumed run) the later row wins."""
    by_step: dict[float, float] = {}
    for row in rows:
        if row.get(key) is not None and row.get("step") is not None:
            by_step[row["step"]] = row[key]
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def run_labels(run_dirs: list[str]) -> list[str]:
    """Each run's directory name, or its full path where two names collide."""
    names = [Path(d).resolve().name for d in run_dirs]
    return [n if names.count(n) == 1 else str(Path(d)) for n, d in zip(names, run_dirs, strict=True)]


def build_figures(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Figure]:
    """One figure per plot that has data in at least one run; each line is labelled ``run[ series]``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figures = {}
    for name, (title, ylabel, keys) in PLOTS.items():
        fig = Figure(figsize=(8, 4.5), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        drawn = 0
        for index, (run, rows) in enumerate(runs.items()):
            colour = f"C{index % 10}"  # one colour per run across its series
            for key, label, style, scale in expand(rows, keys):
                steps, values = series(rows, key)
                if not steps:
                    continue
                full = f"{run} {label}".strip() if len(runs) > 1 or not label else label
                marker = "o" if "o" in style else None
                ax.plot(steps, [v * scale for v in values], style.replace("o", ""), color=colour,
                        marker=marker, markersize=3, label=full)  # fmt: skip
                drawn += 1
        if not drawn:
            continue
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if drawn > 1 or len(runs) > 1:
            ax.legend()
        fig.tight_layout()
        figures[name] = fig
    return figures


def plot_runs(run_dirs: list[str], out_dir: str | None = None) -> list[str]:
    """Write loss, learning-rate, throughput, memory and source-share PNGs for the runs; returns the
    paths written.

    By default the plots of one run go to ``RUN/plots``; a comparison of several goes to ``./plots``.
    A plot with no data in any run is not written.
    """
    if not run_dirs:
        raise ValueError("no run directories given")
    runs, files = {}, []
    for label, run_dir in zip(run_labels(run_dirs), run_dirs, strict=True):
        path = Path(run_dir)
        path = path / METRICS if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no metrics.jsonl (is {run_dir} a run's output_dir?)")
        runs[label] = read_metrics(path)
        files.append(path)
    target = Path(out_dir) if out_dir else (files[0].parent / "plots" if len(files) == 1 else Path("plots"))
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in build_figures(runs).items():
        file = target / f"{name}.png"
        fig.savefig(file)
        written.append(str(file))
    return written
