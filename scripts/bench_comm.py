"""Bus bandwidth of all-reduce, all-gather and reduce-scatter across message sizes.

    torchrun --nproc_per_node N scripts/bench_comm.py [--max-bytes 256M] [--json FILE]
    deepspeed --num_gpus N scripts/bench_comm.py ...          (also over a hostfile: multi-node)

gloo on CPU, NCCL on GPUs (``--backend`` overrides). Figures follow nccl-tests: ``size`` is the
whole buffer (all-gather's output, reduce-scatter's input), ``time`` the slowest rank's mean per
call, ``algbw = size / time`` and ``busbw = algbw × 2(n−1)/n`` for all-reduce and ``× (n−1)/n`` for
all-gather and reduce-scatter: the rate each link sustains, comparable across world sizes.

What it is for: choosing bucket sizes (``reduce_bucket_size``, ``allgather_bucket_size``: the
smallest size at which busbw is near its peak), and costing ZeRO stages. With ``--model-params P``
it estimates one step's gradient/parameter traffic time: DDP and ZeRO-1/2 move 2P(n−1)/n elements
per rank (one all-reduce, or reduce-scatter + all-gather); ZeRO-3 moves 3P(n−1)/n (all-gather
for forward and backward, reduce-scatter of gradients): 1.5× the bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.runtime.distributed import dist_info

OPS = ("all_reduce", "all_gather", "reduce_scatter")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' busbw / algbw ratio."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter"):
        return (world - 1) / world
    raise ValueError(f"unknown collective {op!r}; choose from {', '.join(OPS)}")


def parse_bytes(text: str) -> int:
    """``4096``, ``64K``, ``16M``, ``1G`` (powers of two)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in UNITS else ""
    try:
        value = float(text[: len(text) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64K, 16M, 1G)") from None
    return int(value * UNITS[unit])


def message_sizes(min_bytes: int, max_bytes: int, factor: int, world: int, elem: int) -> list[int]:
    """Sizes from min to max (multiplied by ``factor``), each a whole number of per-rank elements."""
    if factor < 2:
        raise ValueError(f"--factor must be at least 2, got {factor}")
    quantum = world * elem
    sizes, size = [], max(min_bytes, quantum)
    while size <= max_bytes:
        sizes.append(max(quantum, size // quantum * quantum))
        size *= factor
    return sorted(set(sizes))


# Newer torch names the flat-tensor collectives *_single and deprecates the *_tensor names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _call(op: str, full: torch.Tensor, part: torch.Tensor) -> None:
    if op == "all_reduce":
        dist.all_reduce(full)
    elif op == "all_gather":
        _ALL_GATHER(full, part)
    else:
        _REDUCE_SCATTER(part, full)


def measure(op: str, size: int, dtype: torch.dtype, device: torch.device, iters: int, warmup: int) -> float:
    """Mean seconds per call on the slowest rank."""
    world = dist.get_world_size()
    elem = torch.tensor([], dtype=dtype).element_size()
    full = torch.ones(size // elem, dtype=dtype, device=device)
    part = torch.ones(size // elem // world, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        _call(op, full, part)
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        _call(op, full, part)
    sync()
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def row(op: str, size: int, seconds: float, world: int, elem: int) -> dict:
    algbw = size / seconds / 1e9
    return {
        "bytes": size,
        "count": size // elem,
        "time_us": seconds * 1e6,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * bus_factor(op, world),
    }


def step_estimate(params: float, elem: int, world: int, peak: dict[str, float]) -> dict:
    """Seconds of collective traffic per optimizer step at the measured peak bus bandwidths."""
    share = params * elem * (world - 1) / world / 1e9  # GB per rank for one pass over the model
    ddp = 2 * share / peak["all_reduce"] if "all_reduce" in peak else None
    zero3 = None
    if "all_gather" in peak and "reduce_scatter" in peak:
        zero3 = 2 * share / peak["all_gather"] + share / peak["reduce_scatter"]
    return {
        "model_params": params,
        "bytes_per_element": elem,
        "ddp_zero12_gb_per_rank": 2 * share,
        "zero3_gb_per_rank": 3 * share,
        "ddp_zero12_seconds": ddp,
        "zero3_seconds": zero3,
    }


def print_table(results: dict[str, list[dict]], header: str) -> None:
    print(header)
    print(f"{'op':<15}{'size (B)':>12}{'time (us)':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}")
    for op, rows in results.items():
        for r in rows:
            print(
                f"{op:<15}{r['bytes']:>12}{r['time_us']:>12.1f}{r['algbw_gbps']:>12.3f}{r['busbw_gbps']:>12.3f}"
            )


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated collectives")
    p.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("4K"))
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("64M"))
    p.add_argument("--factor", type=int, default=4, help="size multiplier between measurements")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument(
        "--model-params", type=float, default=None, help="estimate per-step traffic for P parameters"
    )
    p.add_argument("--json", type=Path, default=None, help="write one JSON object to FILE (rank 0)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    for op in args.ops:
        if op not in OPS:
            p.error(f"--ops: unknown collective {op!r}; choose from {', '.join(OPS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    info = dist_info()
    backend = args.backend if args.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", info.local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    world = dist.get_world_size()
    dtype = DTYPES[args.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    sizes = message_sizes(args.min_bytes, args.max_bytes, args.factor, world, elem)
    results = {op: [row(op, s, measure(op, s, dtype, device, args.iters, args.warmup), world, elem) for s in sizes]
               for op in args.ops}  # fmt: skip
    peak = {op: max(r["busbw_gbps"] for r in rows) for op, rows in results.items() if rows}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {
        "backend": backend,
        "device": name,
        "world_size": world,
        "dtype": args.dtype,
        "iters": args.iters,
        "results": results,
        "peak_busbw_gbps": peak,
    }
    if args.model_params:
        report["estimate"] = step_estimate(args.model_params, elem, world, peak)
    if dist.get_rank() == 0:
        print_table(results, f"{backend} on {name}, {world} ranks, {args.dtype}, {args.iters} iterations")
        if "estimate" in report:
            print(json.dumps(report["estimate"], indent=1))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
