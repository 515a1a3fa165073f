"""Benchmark: expert parallelism against ZeRO-3 alone, on one mixture-of-experts model, in one run.

    python scripts/bench_moe.py [--json output/bench-moe.json]             # 2 ranks, the variants below
    python scripts/bench_moe.py --max_steps 4 --size tiny --launcher torchrun --variants zero3,zero3_ep2

Each variant trains the same Mixtral (``--model_type mixtral``; ``--size base``: the default model's
width and depth, 8 experts, 2 per token; ``tiny``: hidden 64, 2 layers, 4 experts) on the same
blocks through ``scripts/train.py`` on ``--ranks`` ranks, one variant after another:

- ``zero3``: ZeRO-3, every rank holding a slice of every expert (gathered whole in each layer);
- ``zero3_ep2``: ZeRO-3 with ``--expert_parallel_size 2`` (AutoEP: each rank holds whole experts,
  half of them, and tokens travel to them);
- ``zero2_ep2``: ZeRO-2 with ``--expert_parallel_size 2``: what ``trainer plan`` tries before ZeRO-3.

Reported per variant: tokens per second over the steps after the first logging window (all ranks,
from ``metrics.jsonl``), the peak memory of the largest process (host RSS on CPU, watched from
outside by ``trainer.bench.peak_rss``; on a GPU rank 0's peak allocated device memory, the ranks
holding equal shares), both as ratios to ``zero3``, the last step's loss, and the largest relative
gap between the variant's logged losses and ``zero3``'s. The variants train the same steps on the
same rows: in fp32 their losses agree to 1e-7 or so; in the precision the machine picks (bf16 where
it multiplies bf16 fast) each variant rounds its own way (AutoEP's grouped matrix multiplies, ZeRO's
partitions), to about 1e-3 over a few dozen steps. Each run's directory is OUT/<variant>, its log
OUT/<variant>.log.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from trainer.bench.muon import cores, has_gpu, launch_env
from trainer.observe.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = {
    "zero3": ["--zero_stage", "3"],
    "zero3_ep2": ["--zero_stage", "3", "--expert_parallel_size", "2"],
    "zero2_ep2": ["--zero_stage", "2", "--expert_parallel_size", "2"],
}
SIZES = {
    "base": {},  # scripts/train.py's mixtral: hidden 256, 4 layers, 8 experts of width 344, top-2
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_local_experts": 4},
}


def command(variant: str, args: argparse.Namespace, out: Path) -> list[str]:
    """``scripts/train.py`` for one variant under the launcher, watched by ``peak_rss``."""
    train = [
        "scripts/train.py", "--model_type", "mixtral", "--output_dir", str(out),
        "--model_config_overrides", json.dumps(SIZES[args.size]), "--max_steps", str(args.max_steps),
        "--logging_steps", str(args.logging_steps), "--save_strategy", "no", "--eval_strategy", "no",
        "--per_device_train_batch_size", str(args.batch), "--block_size", str(args.block_size),
        "--max_train_samples", str(args.max_steps * args.batch * args.ranks), "--optim", "adamw_torch",
        "--report_to", "none", *VARIANTS[variant],
    ]  # fmt: skip
    if args.launcher == "torchrun":
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}"]
    else:
        launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.ranks)]
    watch = [sys.executable, "-m", "trainer.bench.peak_rss", "--only", sys.executable,
             "--report", str(out.with_suffix(".rss.json")), "--"]  # fmt: skip
    return [*watch, *launcher, *train]


def measure(variant: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    out = args.out / variant
    shutil.rmtree(out, ignore_errors=True)  # a run left there would be resumed
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".log"), "w") as log:
        code = subprocess.run(
            command(variant, args, out), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        ).returncode
    if code != 0:
        return {"variant": variant, "returncode": code, "log": str(out.with_suffix(".log"))}
    rows = [r for r in read_metrics(out) if "loss" in r]
    later = [r["tokens_per_second"] for r in rows if r["step"] > args.logging_steps] or [
        rows[-1]["tokens_per_second"]
    ]
    rss = json.loads(out.with_suffix(".rss.json").read_text())
    gpu_peak = rows[-1].get("peak_memory_allocated_bytes") if env.get("DS_ACCELERATOR") != "cpu" else None
    return {
        "variant": variant,
        "returncode": 0,
        "tokens_per_second": statistics.mean(later),
        "peak_bytes": gpu_peak or rss["peak_rss_bytes"],
        "peak_of": "device (rank 0)" if gpu_peak else "host RSS (largest process)",
        "losses": [r["loss"] for r in rows],
        "aux_loss": rows[-1].get("aux_loss"),
    }


def summarise(results: dict[str, dict]) -> dict[str, dict]:
    """Each variant's figures with its ratios to ``zero3`` (or the first that ran) and the largest
    relative gap between its losses and that variant's."""
    ran = [r for r in results.values() if r["returncode"] == 0]
    if not ran:
        return results
    base = results.get("zero3") if results.get("zero3", {}).get("returncode") == 0 else ran[0]
    for r in ran:
        r["tokens_per_second_ratio"] = r["tokens_per_second"] / base["tokens_per_second"]
        r["peak_ratio"] = r["peak_bytes"] / base["peak_bytes"]
        r["loss_gap"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"], strict=True))
    return results


def table(results: dict[str, dict]) -> str:
    lines = [
        f"{'variant':<10} {'tokens/s':>9} {'ratio':>6} {'peak MB':>8} {'ratio':>6} {'last loss':>9} {'loss gap':>9}"
    ]
    for r in results.values():
        if r["returncode"] != 0:
            lines.append(f"{r['variant']:<10} failed with exit {r['returncode']}: {r['log']}")
            continue
        lines.append(
            f"{r['variant']:<10} {r['tokens_per_second']:9.0f} {r['tokens_per_second_ratio']:6.2f} "
            f"{r['peak_bytes'] / 1e6:8.0f} {r['peak_ratio']:6.2f} {r['losses'][-1]:9.4f} {r['loss_gap']:9.1e}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_moe.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    p.add_argument("--size", choices=SIZES, default="base")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--max_steps", type=int, default=40)
    p.add_argument("--logging_steps", type=int, help="default: max_steps / 4")
    p.add_argument("--batch", type=int, default=4, help="rows per rank per step")
    p.add_argument("--block_size", type=int, default=256)
    p.add_argument("--launcher", choices=["deepspeed", "torchrun"], default="deepspeed")
    p.add_argument("--out", type=Path, default=Path("output/bench-moe"))
    p.add_argument("--json", type=Path, help="write the results here, one object keyed by variant")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        p.error(
            f"--variants: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(VARIANTS)}"
        )
    if min(args.ranks, args.max_steps, args.batch, args.block_size) < 1 or args.ranks % 2:
        p.error(
            "--ranks (even: expert parallelism splits 2 ways), --max_steps, --batch and --block_size must be > 0"
        )
    args.logging_steps = args.logging_steps or max(1, args.max_steps // 4)
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    gpu = has_gpu()
    env = launch_env(max(1, cores() // args.ranks), gpu)
    env.pop("CUDA_VISIBLE_DEVICES", None)  # every GPU: one per rank
    env["PYTHONPATH"] = str(ROOT)
    results = {}
    for variant in args.variants:
        print(f"{variant}: training", flush=True)
        results[variant] = measure(variant, args, env)
    summarise(results)
    print(table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if all(r["returncode"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
