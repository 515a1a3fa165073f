"""Benchmark: GRPO through ours and through TRL on the same job, side by side in one run.

    python scripts/bench_rl.py [--stages 2,3] [--steps 8] [--warmup 2] [--json FILE]

The job: a Llama (hidden 256, 4 layers by default) saved with the standard library's tokenizer, and
prompts that are the library's documented functions (``trainer.bench.rl prepare``), rewarded by
``trainer.loop.rewards.python_body`` and ``trainer.bench.rl.variety``. Each system trains it for ``--steps`` steps, each rank
generating ``--num_generations`` completions of ``--max_completion_length`` tokens for its
``--rows_per_rank`` rows, on ``--nproc`` ranks under torchrun, on each ZeRO stage asked for, with
the same arguments:
- ``ours``: ``trainer.GRPOTrainer``: the training engine generates; under ZeRO-3 it gathers the
  weights once per rollout where they fit, and its hooks stay off meanwhile;
- ``trl``: ``trl.GRPOTrainer`` on DeepSpeed through HF's Trainer (``ds3_gather_for_generation``
  at its default, true);
- at ZeRO-3, asked for by name: ``ours_half``, ours with half of the weights gathered once per
  rollout (``generation_gather_gb``) and the rest by each forward, and ``ours_layers``, ours with
  every forward gathering (``ds3_gather_for_generation`` false).

Runs take turns, each alone on the machine. Reported per system and stage: the median step time
after ``--warmup`` steps (steps/s), the mean time of a ``generate`` call and the tokens it
generates per second (rows x new positions), and the peak resident memory of the largest rank,
watched from outside (``trainer.bench.peak_rss``). The ratios are each system's over ours, and for
ours ZeRO-3's generation time over ZeRO-2's. docs/benchmarks.md records the figures.
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
from trainer.bench.rl import SYSTEMS, summary

ROOT = Path(__file__).resolve().parents[1]
JOB = ("hidden_size", "layers", "prompts")
RUN = ("steps", "rows_per_rank", "num_generations", "max_completion_length")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_rl.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--stages", default="2,3", help="comma-separated ZeRO stages")
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma-separated systems, ours first; at ZeRO-3 also ours_half, ours_layers",
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    for name, default in (("steps", 8), ("rows_per_rank", 4), ("num_generations", 4),
                          ("max_completion_length", 32), ("hidden_size", 256), ("layers", 4), ("prompts", 256)):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--learning_rate", type=float, default=1e-5)
    p.add_argument("--root", type=Path, help="where the job and the runs go (default: a temporary directory)")
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


def run(args: argparse.Namespace, root: Path) -> list[dict]:
    job = [item for name in JOB for item in (f"--{name}", str(getattr(args, name)))]
    subprocess.run([sys.executable, "-m", "trainer.bench.rl", "prepare", str(root), *job], check=True)
    options = [item for name in RUN for item in (f"--{name}", str(getattr(args, name)))]
    results = []
    for stage in [int(s) for s in args.stages.split(",")]:
        for system in args.systems.split(","):
            out = root / f"{system}-zero{stage}"
            out.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
                   f"--master_port={free_port()}", "-m", "trainer.bench.rl", "worker", str(root), system, str(out),
                   "--zero_stage", str(stage), "--learning_rate", str(args.learning_rate), *options]  # fmt: skip
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
    rows = ["| ZeRO | system | steps/s | generate (s) | generation tokens/s | peak RSS, largest rank (MiB) "
            "| over ours: steps/s | over ours: tokens/s | over ours: memory |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    by = {(r["zero_stage"], r["system"]): r for r in results}
    for (stage, system), r in by.items():
        ours = by.get((stage, "ours"))
        ratios = ("", "", "")
        if system != "ours" and ours is not None:
            ratios = (f"{r['steps_per_s'] / ours['steps_per_s']:.2f}",
                      f"{r['generation_tokens_per_s'] / ours['generation_tokens_per_s']:.2f}",
                      f"{r['peak_rss_bytes'] / ours['peak_rss_bytes']:.2f}")  # fmt: skip
        rows.append(f"| {stage} | {system} | {r['steps_per_s']:.2f} | {r['generate_mean_s']:.2f} | "
                    f"{r['generation_tokens_per_s']:.0f} | {r['peak_rss_bytes'] / 2**20:.0f} | {' | '.join(ratios)} |")  # fmt: skip
    zero2, zero3 = by.get((2, "ours")), by.get((3, "ours"))
    if zero2 and zero3:
        rows.append(
            f"\nours, ZeRO-3's generate time over ZeRO-2's: {zero3['generate_mean_s'] / zero2['generate_mean_s']:.2f}"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_rl_") as tmp:
        results = run(args, args.root or Path(tmp))
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
