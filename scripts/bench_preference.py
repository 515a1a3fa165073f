"""Benchmark: DPO through ours and through TRL on the same job, side by side in one run.

    python scripts/bench_preference.py [--stages 2,3] [--steps 12] [--warmup 3] [--json FILE]

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
    return p.parse_args(argv)


def run(args: argparse.Namespace, root: Path) -> list[dict]:
    job = ["--hidden_size", str(args.hidden_size), "--layers", str(args.layers), "--pairs", str(args.pairs)]
    subprocess.run([sys.executable, "-m", "trainer.bench.preference", "prepare", str(root), *job], check=True)
    results = []
    for stage in [int(s) for s in args.stages.split(",")]:
        for system in args.systems.split(","):
            out = root / f"{system}-zero{stage}"
            out.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
                   f"--master_port={free_port()}", "-m", "trainer.bench.preference", "worker", str(root), system, str(out),
                   "--zero_stage", str(stage), "--steps", str(args.steps), "--pairs_per_rank",
                   str(args.pairs_per_rank), "--max_length", str(args.max_length),
                   "--learning_rate", str(args.learning_rate)]  # fmt: skip
            with (out / "log.txt").open("w") as log:
                rss = watch(cmd, stdout=log, cwd=str(ROOT), only=sys.executable)
            if rss["returncode"] != 0:
                tail = (out / "log.txt").read_text(errors="replace")[-3000:]
                raise SystemExit(f"bench: {system} on ZeRO-{stage} failed ({rss['returncode']}):\n{tail}")
            result = json.loads((out / "result.json").read_text())
            results.append(
                {**result, **summary(result, args.warmup), "peak_rss_bytes": rss["peak_rss_bytes"]}
            )
    return results


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
        results = run(args, args.root or Path(tmp))
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
