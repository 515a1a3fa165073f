"""Benchmark: one training job through our Trainer, a raw DeepSpeed loop, HF Trainer and HF Accelerate.

    python scripts/bench.py --device cpu  [--json FILE]      # 2 ranks, fp32, a small Llama
    python scripts/bench.py --device cuda [--json FILE]      # bf16, a 1.1B Llama, MFU
        [--zero_stage 3] [--gradient_checkpointing] [--profile DIR]
    python scripts/bench.py --tensor_parallel_size 2         # ours at ZeRO-3 against ours with AutoTP

The job (model, data, batch sizes, DeepSpeed config, steps, seed) is the same for every system.
Each system runs under its own ``deepspeed`` launcher with the same number of ranks; all are started
together and take turns, ``--chunk`` steps at a time (A B C D A B C D ...), so only one computes at
any moment. The first ``--warmup`` steps of each are left out; the report gives the median step
time, tokens/s, peak memory per rank, final loss (and on GPUs the MFU), each also as a ratio to
ours. ``--json FILE`` writes one object keyed by system (ours, deepspeed, hf_trainer, accelerate).
With ``--tensor_parallel_size N`` the systems are ours (at ZeRO-3 unless ``--zero_stage`` says
otherwise) and ours_tp: the same model, data and global batch with each layer split over N ranks
(ZeRO ``--tensor_parallel_zero_stage`` over the world/N groups, each rank reading N times the rows).
docs/benchmarks.md explains the method and records the figures.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from trainer.bench.job import MODELS, SYSTEMS, Job, prepare_data
from trainer.bench.launch import run_systems, say
from trainer.bench.report import describe, summarise, table, verdicts
from trainer.runtime.distributed import sweep_orphan_shm_buffers

ROOT = Path(__file__).resolve().parents[1]

DEFAULTS = {
    "cpu": dict(
        model="small", seq_len=128, micro_batch=4, grad_accum=1, precision="fp32", data="stdlib",
        vocab_size=4096, learning_rate=1e-3, steps=30, warmup=5, chunk=1,
    ),
    "cuda": dict(
        model="1b", seq_len=2048, micro_batch=4, grad_accum=2, precision="bf16", data="random",
        vocab_size=32000, learning_rate=3e-4, steps=20, warmup=5, chunk=5,
    ),
}  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--systems", help="comma-separated subset of " + ", ".join(SYSTEMS))
    p.add_argument("--model", choices=sorted(MODELS), help="Llama shape (cpu: small, cuda: 1b)")
    p.add_argument("--seq_len", type=_positive)
    p.add_argument("--micro_batch", type=_positive, help="per rank")
    p.add_argument("--grad_accum", type=_positive)
    p.add_argument("--steps", type=_positive, help="optimizer steps per system")
    p.add_argument("--warmup", type=_non_negative, help="first steps of each system left out of the medians")
    p.add_argument("--chunk", type=_positive, help="steps per turn")
    p.add_argument(
        "--zero_stage", type=int, choices=(0, 1, 2, 3), help="default 2; 3 with --tensor_parallel_size"
    )
    p.add_argument("--tensor_parallel_size", type=_positive, default=1, help="ours_tp's AutoTP ranks a layer")
    p.add_argument(
        "--tensor_parallel_zero_stage", type=int, choices=(0, 1, 2), default=1, help="ours_tp's ZeRO stage"
    )
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--precision", choices=("fp32", "bf16"))
    p.add_argument("--data", choices=("stdlib", "random"), help="token source (cpu: stdlib, cuda: random)")
    p.add_argument("--vocab_size", type=_positive)
    p.add_argument("--learning_rate", type=float)
    p.add_argument("--nproc", type=_positive, help="ranks per system (cpu: 2, cuda: the GPUs present)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--out", help="work directory: job, data, logs, each system's output (default output/bench-...)"
    )
    p.add_argument("--json", help="write the results here, one object keyed by system")
    p.add_argument(
        "--profile", help="profile 3 of ours' steps after the warm-up (left out of the medians) into DIR"
    )
    p.add_argument("--start_timeout", type=float, default=900.0, help="seconds for all ranks to start")
    p.add_argument("--step_timeout", type=float, default=600.0, help="seconds one turn may take")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.nproc is None:
        args.nproc = 2 if args.device == "cpu" else _gpu_count()
    split = args.tensor_parallel_size > 1
    if args.zero_stage is None:
        args.zero_stage = 3 if split else 2
    default = ("ours", "ours_tp") if split else tuple(s for s in SYSTEMS if s != "ours_tp")
    args.systems = [s.strip() for s in (args.systems or ",".join(default)).split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or not args.systems:
        p.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    if "ours_tp" in args.systems and not split:
        p.error("--systems ours_tp: give --tensor_parallel_size N (N > 1)")
    if split and args.nproc % args.tensor_parallel_size:
        p.error(f"--tensor_parallel_size {args.tensor_parallel_size} does not divide --nproc {args.nproc}")
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    return args


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _gpu_count() -> int:
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise SystemExit("bench: --device cuda but no CUDA device is visible")
    return count


def make_job(args: argparse.Namespace, out: Path) -> Job:
    return Job(
        device=args.device,
        model=args.model,
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        steps=args.steps,
        warmup=args.warmup,
        chunk=args.chunk,
        zero_stage=args.zero_stage,
        precision=args.precision,
        gradient_checkpointing=args.gradient_checkpointing,
        seed=args.seed,
        learning_rate=args.learning_rate,
        lr_warmup_steps=min(3, args.steps - 1),
        data_path=str(out / "data.pt"),
        world_size=args.nproc,
        out_dir=str(out),
        profile_dir=str(Path(args.profile).resolve()) if args.profile else None,
        release_cache=args.device == "cuda",
        tensor_parallel=args.tensor_parallel_size,
        tensor_parallel_zero_stage=args.tensor_parallel_zero_stage,
    )


# ---------------------------------------------------------------- main


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    # A timeout's SIGTERM must still stop the launchers: they run in sessions of their own.
    signal.signal(signal.SIGTERM, _terminated)
    gc = "-ckpt" if args.gradient_checkpointing else ""
    tp = f"-tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    out = Path(args.out or ROOT / "output" / f"bench-{args.device}-z{args.zero_stage}{gc}{tp}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    job = make_job(args, out)
    say(f"preparing {job.num_samples} blocks of {job.seq_len} tokens ({args.data})")
    job.vocab_size = prepare_data(
        args.data, args.vocab_size, job.seq_len, job.num_samples, job.seed, out / "data.pt"
    )
    job.save(out / "job.json")
    results = run_systems(job, args.systems, out, args.start_timeout, args.step_timeout)
    # The baselines' plain DeepSpeed init leaves its all-reduce buffers in /dev/shm (RAM).
    sweep_orphan_shm_buffers()
    summary = summarise(job, results)
    report = "\n".join([describe(job, summary, results), table(job, summary), *verdicts(summary)])
    print(report)
    (out / "report.txt").write_text(report + "\n")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    # Every rank's step times, for a closer look than medians give.
    steps = {
        system: [{k: r[k] for k in ("times", "cpu_times", "profiled")} for r in ranks]
        for system, ranks in results.items()
    }
    (out / "steps.json").write_text(json.dumps(steps) + "\n")
    ds_config = next(r for r in results.values())[0]["ds_config"]
    (out / "ds_config.json").write_text(json.dumps(ds_config, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
