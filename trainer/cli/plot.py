"""``trainer plot RUN [RUN ...]``: PNG plots of loss, learning rate, throughput and memory over steps."""

from __future__ import annotations

import argparse
import sys

from trainer.observe.plots import plot_runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN", help="a run's output_dir (or its metrics.jsonl)")
    parser.add_argument(
        "-o",
        "--output",
        metavar="DIR",
        help="where the PNGs go (default: RUN/plots for one run, ./plots for several)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        written = plot_runs(args.runs, args.output)
    except (FileNotFoundError, ValueError) as err:
        print(f"trainer plot: {err}", file=sys.stderr)
        return 2
    if not written:
        print("trainer plot: no metrics to plot (metrics.jsonl has no rows with a step)", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0
