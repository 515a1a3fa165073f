"""Benchmark: DPO through ours and through TRL on the same job, side by side in one run.

    python scripts/bench_preference.py [--stages 2,3] [--steps 12] [--warmup 3] [--json FILE]
    python scripts/bench_preference.py --longest CAP_MIB [--lengths 1024,2048,4096,8192] [--json FILE]

The job: a Llama (hidden 256, 4 layers by default) saved with its tokenizer, and pairs cut from the
standard library's source (``trainer.bench.preference prepare``). Each system trains it for
``--steps`` steps of ``--pairs_per_rank`` pairs a rank on ``--nproc`` ranks under torchrun, on each
ZeRO stage asked for, with the same arguments:
- ``ours``: ``trainer.DPOTrainer``, whose training engine scores the reference once before the
  first step; it then holds no reference model;
- ``ours_ref_model``: the same with the base given as ``ref_model``: a frozen reference engine of
  its own (partitioned under ZeRO-3) scores the pass and is let go;
- ``trl``: ``trl.DPOTrainer`` on DeepSpeed through HF's Trainer, with its default reference: a
  second model, forwarded every step (under ZeRO-3 partitioned too).

Runs take turns, in that order per stage (``--systems`` picks), each alone on the machine. Reported
per system and stage: the median step time after ``--warmup`` steps (steps/s), the set-up time
before the first step (the reference pass is ours's part of it), and the peak resident memory of
the largest rank, watched from outside (``trainer.bench.peak_rss``). The ratios are each system's
over ours. docs/benchmarks.md records the figures.

``--longest CAP_MIB`` searches instead for each system's longest pair under a cap on the largest
rank's peak resident memory: long pairs (a short prompt, answers cut from source files), a model
whose logits are ``--model_vocab`` wide, one pair a rank (in the reference pass too), 2 steps on
ZeRO-3 with activation checkpointing, at each of ``--lengths`` tokens a sequence in turn until a
run passes the cap:
ours untiled (the whole logits), with the tiled loss, with the tiled loss and SP=2 (each rank half
of every sequence), and TRL (its DPOTrainer computes the log-probabilities in chunks of its own).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from trainer.bench.launch import free_port
from trainer.bench.peak_rss import watch
from trainer.bench.preference import SYSTEMS, summary

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_preference.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--stages", default="2,3", help="comma-separated ZeRO stages")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated systems, ours first")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pairs_per_rank", type=int, default=4)
    p.add_argument("--max_length", type=int, default=128)
    p.add_argument("--learning_rate", type=float, default=1e-5)
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--pairs", type=int, default=256, help="pairs in the data set")
    p.add_argument("--root", type=Path, help="where the job and the runs go (default: a temporary directory)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument(
        "--longest",
        type=int,
        metavar="CAP_MIB",
        help="search each system's longest pair under this peak RSS of the largest rank instead",
    )
    p.add_argument(
        "--lengths",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1024, 2048, 4096, 8192],
        help="the longest-pair search's sequence lengths, in order",
    )
    p.add_argument(
        "--model_vocab",
        type=int,
        default=32000,
        help="the longest-pair search's model vocabulary (the width of its logits)",
    )
    return p.parse_args(argv)


def prepare(args: argparse.Namespace, root: Path, *extra: str) -> None:
    job = ["--hidden_size", str(args.hidden_size), "--layers", str(args.layers), "--pairs", str(args.pairs)]
    cmd = [sys.executable, "-m", "trainer.bench.preference", "prepare", str(root), *job, *extra]
    subprocess.run(cmd, check=True)


def worker(args: argparse.Namespace, root: Path, system: str, out: Path, options: list[str],
           cap_mib: int | None = None) -> dict:  # fmt: skip
    """One system's run under torchrun, watched from outside; ``cap_mib``: stopped past that peak."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
           f"--master_port={free_port()}", "-m", "trainer.bench.preference", "worker", str(root), system, str(out),
           "--learning_rate", str(args.learning_rate), *options]  # fmt: skip
    with (out / "log.txt").open("w") as log:
        cap = cap_mib * 2**20 if cap_mib else None
        return watch(cmd, cap_bytes=cap, stdout=log, cwd=str(ROOT), only=sys.executable)


def run(args: argparse.Namespace, root: Path) -> list[dict]:
    prepare(args, root)
    results = []
    for stage in [int(s) for s in args.stages.split(",")]:
        for system in args.systems.split(","):
            out = root / f"{system}-zero{stage}"
            options = ["--zero_stage", str(stage), "--steps", str(args.steps), "--pairs_per_rank",
                       str(args.pairs_per_rank), "--max_length", str(args.max_length)]  # fmt: skip
            rss = worker(args, root, system, out, options)
            if rss["returncode"] != 0:
                tail = (out / "log.txt").read_text(errors="replace")[-3000:]
                raise SystemExit(f"bench: {system} on ZeRO-{stage} failed ({rss['returncode']}):\n{tail}")
            result = json.loads((out / "result.json").read_text())
            results.append(
                {**result, **summary(result, args.warmup), "peak_rss_bytes": rss["peak_rss_bytes"]}
            )
    return results


# The longest-pair search's systems: (name, worker system, its options); all with activation
# checkpointing, one pair a rank, on ZeRO-3.
LONG_SYSTEMS = (
    ("ours, untiled", "ours", []),
    ("ours, tiled loss", "ours", ["--tiled"]),
    ("ours, tiled loss, SP=2", "ours", ["--tiled", "--sequence_parallel_size", "2"]),
    ("trl", "trl", []),
)


def longest(args: argparse.Namespace, root: Path) -> list[dict]:
    """Each system's longest pair under the cap: sequences of each length of ``--lengths`` in turn
    (both answers long enough to be cut there), 2 steps of one pair a rank, until a run passes the
    cap or fails; the last length that trained is the system's."""
    # As many pairs as the 2 steps train; the reference pass forwards one pair at a time, as training.
    pairs = str(2 * args.nproc)
    prepare(args, root, "--answer_chars", str(8 * max(args.lengths)), "--model_vocab", str(args.model_vocab),
            "--pairs", pairs)  # fmt: skip
    results = []
    for index, (name, system, extra) in enumerate(LONG_SYSTEMS):
        row: dict = {"system": name, "cap_mib": args.longest, "longest": None, "probes": []}
        for length in args.lengths:
            out = root / f"long{index}-{length}"
            options = ["--zero_stage", "3", "--steps", "2", "--pairs_per_rank", "1", "--eval_batch_size", "1",
                       "--max_length", str(length), "--gradient_checkpointing", *extra]  # fmt: skip
            rss = worker(args, root, system, out, options, cap_mib=args.longest)
            trained = rss["returncode"] == 0 and rss["stopped"] is None
            probe = {"length": length, "trained": trained, "peak_rss_bytes": rss["peak_rss_bytes"],
                     "stopped": rss["stopped"], "returncode": rss["returncode"]}  # fmt: skip
            if trained:
                probe["step_s"] = json.loads((out / "result.json").read_text())["step_s"]
                row.update(longest=length, peak_rss_bytes=rss["peak_rss_bytes"], step_s=probe["step_s"][-1])
            row["probes"].append(probe)
            if not trained:
                break
        results.append(row)
    return results


def longest_table(results: list[dict]) -> str:
    rows = [f"| system | longest pair under {results[0]['cap_mib']} MiB (tokens a sequence) | peak RSS there, "
            "largest rank (MiB) | step there (s) | first length over the cap |", "|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        over = next(
            (f"{p['length']} ({p['stopped'] or 'failed'})" for p in r["probes"] if not p["trained"]), "none"
        )
        peak = f"{r['peak_rss_bytes'] / 2**20:.0f}" if r["longest"] else ""
        step = f"{r['step_s']:.1f}" if r["longest"] else ""
        rows.append(f"| {r['system']} | {r['longest'] or 'none'} | {peak} | {step} | {over} |")
    return "\n".join(rows)


def table(results: list[dict]) -> str:
    rows = ["| ZeRO | system | steps/s | set-up (s) | peak RSS, largest rank (MiB) | over ours: steps/s | over ours: memory |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    by = {(r["zero_stage"], r["system"]): r for r in results}
    for (stage, system), r in by.items():
        ours = by.get((stage, "ours"))
        ratios = ("", "")
        if system != "ours" and (stage, "ours") in by:
            ratios = (
                f"{r['steps_per_s'] / ours['steps_per_s']:.2f}",
                f"{r['peak_rss_bytes'] / ours['peak_rss_bytes']:.2f}",
            )
        rows.append(f"| {stage} | {system} | {r['steps_per_s']:.2f} | {r['setup_s']:.1f} | "
                    f"{r['peak_rss_bytes'] / 2**20:.0f} | {ratios[0]} | {ratios[1]} |")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_preference_") as tmp:
        results = (longest if args.longest else run)(args, args.root or Path(tmp))
    print((longest_table if args.longest else table)(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
