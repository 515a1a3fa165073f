"""One rank of one system, started by the DeepSpeed launcher as a module (``--module``):
``python -m trainer.bench.worker --system SYSTEM --job JOB.json --gate HOST:PORT`` (plus the
launcher's ``--local_rank``).

It joins the process group, trains the job with its system while the step clock takes turns with the
other systems, and sends the coordinator its step times, final loss and peak memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from trainer.bench.gate import GateClient, StepClock
from trainer.bench.job import Job
from trainer.bench.systems import RUNNERS

PROFILED_SYSTEMS = ("ours",)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.bench.worker")
    parser.add_argument("--system", choices=sorted(RUNNERS), required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--gate", required=True)
    parser.add_argument("--local_rank", type=int, default=None)  # the launcher's; LOCAL_RANK is read instead
    args = parser.parse_args(argv)

    from trainer.runtime.distributed import dist_info

    info = dist_info()
    job = Job.load(args.job)
    gate = GateClient(args.gate, os.environ["BENCH_TOKEN"], args.system, info.rank)
    try:
        result = run(args.system, job, gate, info.rank, info.local_rank)
    except BaseException:
        with contextlib.suppress(OSError):
            gate.send({"error": traceback.format_exc()[-6000:]})
        raise
    gate.send({"result": result})
    _leave_group()
    return 0


def _leave_group() -> None:
    """Ranks leave the process group together. A rank that tore gloo down while its peer was still
    in it was seen to abort at exit (SIGABRT, "terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _import_all() -> None:
    """Every worker loads the same libraries, so peak memory compares training state, not imports."""
    import accelerate  # noqa: F401
    import deepspeed  # noqa: F401
    import transformers.trainer  # noqa: F401

    import trainer.loop.trainer  # noqa: F401


def run(system: str, job: Job, gate: GateClient, rank: int, local_rank: int) -> dict[str, Any]:
    import deepspeed
    import torch

    from trainer.engine.zero import numel
    from trainer.observe.monitor import memory_stats
    from trainer.observe.throughput import flops_per_token_for_model

    _import_all()
    cuda = job.device == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    if system == "ours_tp":
        job = job.tensor_parallel_job()
    ds_config = job.ds_config()
    dataset = job.dataset()
    profiling = job.profile_dir is not None and system in PROFILED_SYSTEMS and rank == 0
    clock = StepClock(
        gate,
        job.steps,
        job.chunk,
        sync=torch.cuda.synchronize if cuda else (lambda: None),
        # While others take their turn, hand back cached blocks: four systems share one GPU.
        release=torch.cuda.empty_cache if cuda and job.release_cache else (lambda: None),
        profile=(lambda: _start_profiler(cuda)) if profiling else None,
        profile_after=job.warmup,
        profile_steps=job.profile_steps,
        on_profile_done=lambda prof, wall: _write_profile(
            prof, wall, Path(job.profile_dir or "."), system, cuda
        ),
    )
    out = Path(job.out_dir) / system
    outcome = RUNNERS[system](job, ds_config, dataset, clock, str(out))
    split = job.tensor_parallel if job.splits_layers else 1  # the ranks AutoTP split each layer over
    return {
        "times": clock.times,
        "cpu_times": clock.cpu_times,
        "profiled": clock.profiled,
        "final_loss": outcome.final_loss,
        "dp_world_size": outcome.dp_world_size,
        "flops_per_token": flops_per_token_for_model(outcome.model, job.seq_len, split),
        "n_params": sum({id(p): numel(p, split) for p in outcome.model.parameters()}.values()),
        "peak_memory_bytes": int(memory_stats(device)["peak_memory_allocated_bytes"]),
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "notes": outcome.notes,
        "ds_config": ds_config if rank == 0 else None,
    }


# ---------------------------------------------------------------- profile (where the time goes)


def _start_profiler(cuda: bool) -> Any:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities)
    prof.__enter__()
    return prof


CATEGORIES = (
    (
        "matmul",
        ("gemm", "matmul", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "sm90_"),
    ),
    ("attention", ("flash", "fmha", "attention", "scaled_dot_product", "efficient")),
    (
        "communication",
        ("nccl", "all_reduce", "allreduce", "reduce_scatter", "all_gather", "broadcast", "gloo"),
    ),
    ("optimizer", ("adam", "multi_tensor", "foreach", "_fused")),
    ("copies", ("memcpy", "memset", "aten::copy_", "aten::to", "aten::_to_copy")),
)


def _category(name: str) -> str:
    lowered = name.lower()
    for category, needles in CATEGORIES:
        if any(needle in lowered for needle in needles):
            return category
    return "other"


def _write_profile(prof: Any, wall_s: float, directory: Path, system: str, cuda: bool) -> None:
    """The top operators, a Chrome trace, and a summary: busy time by category against wall time.

    On a GPU, busy time is the sum of kernel (and copy) durations; the rest of the wall time is the
    device idling while the host works. On CPU it is the self time of the aten operators; the rest
    is Python and framework code between them.
    """
    from torch.autograd import DeviceType

    directory.mkdir(parents=True, exist_ok=True)
    events = prof.key_averages()
    if cuda:
        rows = [(e.key, e.self_device_time_total) for e in events if e.device_type == DeviceType.CUDA]
        sort = "self_device_time_total"
    else:
        rows = [(e.key, e.self_cpu_time_total) for e in events if e.key.startswith("aten::")]
        sort = "self_cpu_time_total"
    by_category: dict[str, float] = {}
    for name, micros in rows:
        by_category[_category(name)] = by_category.get(_category(name), 0.0) + micros / 1e6
    busy = sum(by_category.values())
    summary = {
        "system": system,
        "wall_s": wall_s,
        "busy_s": busy,
        "busy_fraction": busy / wall_s if wall_s > 0 else None,
        "busy_s_by_category": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "measure": "device kernel time" if cuda else "aten operator self CPU time",
    }
    (directory / f"{system}_profile_summary.json").write_text(json.dumps(summary, indent=1))
    (directory / f"{system}_profile.txt").write_text(events.table(sort_by=sort, row_limit=30))
    prof.export_chrome_trace(str(directory / f"{system}_trace.json.gz"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
