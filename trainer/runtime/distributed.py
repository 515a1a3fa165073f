"""The process group: the hardware a rank computes on, starting and leaving the group, collectives and
printing from rank 0. A rank's facts (RANK / LOCAL_RANK / WORLD_SIZE, read only in
``trainer.runtime.ranks``) and the logging set up for it are re-exported from there.

What a run does when something goes wrong (exit codes, preemption, the hang watchdog) lives in
``trainer.runtime.resilience``, which builds on this module; this one imports nothing of it, so the
process group can be set up without pulling in signal handlers or timer threads.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import os
import sys
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import numa

from trainer.config import Hardware
from trainer.runtime.cpu_info import bf16_matrix_units, keep_the_first_cpu_info
from trainer.runtime.ranks import DistInfo, configure_logging, dist_info, settle_gloo_workers  # noqa: F401  (re-exported)


def detect_hardware() -> Hardware:
    """What this rank computes on; decides what precision "auto" means."""
    if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") == "cuda":
        return Hardware.cuda(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    units = bf16_matrix_units()
    return Hardware.cpu("cpu (bf16 matrix instructions)" if units else "cpu", fast_bf16=units)


def process_device() -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` on GPUs, else the CPU."""
    if detect_hardware().device == "cuda":
        return torch.device("cuda", dist_info().local_rank)
    return torch.device("cpu")


def join_process_group() -> None:
    """Join the process group where a launcher started several processes (idempotent); a world
    of one is left without one. What HF's ``TrainingArguments`` does when first asked for the world."""
    if dist_info().world_size > 1 and not dist.is_initialized():
        init_distributed(detect_hardware())


def keep_the_first_numa_answer() -> None:
    """Make DeepSpeed's NUMA layout answer from this process's first answer. Its CPU accelerator
    counts its devices by running ``numactl --hardware`` on every ``device_count()`` call, and ZeRO-3
    asks in every step's gradient reduction: a fork of the whole rank per call, and a subprocess call
    whose ``warnings.catch_warnings`` makes Python show again the warnings it had shown once (torch's
    FutureWarning for the deprecated collectives DeepSpeed calls, on every step)."""
    if not hasattr(numa.get_numa_cores, "cache_info"):
        numa.get_numa_cores = functools.cache(numa.get_numa_cores)


def set_world_env() -> None:
    """The variables a launcher sets (rank, world size, master address and port), where none did:
    a plain ``python`` process is a world of one, with a port of its own."""
    info = dist_info()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000) if info.world_size == 1 else "29500")
    os.environ.setdefault("RANK", str(info.rank))
    os.environ.setdefault("LOCAL_RANK", str(info.local_rank))
    os.environ.setdefault("WORLD_SIZE", str(info.world_size))


def init_distributed(hardware: Hardware, timeout_s: float = 1800.0) -> DistInfo:
    """Join the process group (idempotent). A world of one still gets a group: DeepSpeed wants one."""
    info = dist_info()
    if hardware.device == "cuda":
        torch.cuda.set_device(info.local_rank)
    keep_the_first_cpu_info()
    keep_the_first_numa_answer()
    if not dist.is_initialized():
        set_world_env()
        backend = "nccl" if hardware.device == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restart != "0":
            # After an elastic restart the agent's store still holds the previous attempt's
            # rendezvous keys, and gloo dials the dead ranks' ports (seen with torch 2.13). A
            # per-attempt key prefix gives the new group a clean namespace.
            agent_store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.world_size, False, timeout
            )
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(f"trainer/attempt_{restart}", agent_store),
                rank=info.rank,
                world_size=info.world_size,
                timeout=timeout,
            )
        elif info.world_size == 1:
            # A world of one has no peer to meet: an in-process store, so no port is taken (two
            # one-process runs on a machine could pick the same one).
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        if hardware.device == "cpu":
            # DeepSpeed's shared-memory all-reduce op serves inference_all_reduce only, which
            # training never calls: it is neither built (two minutes' compile on a fresh machine)
            # nor loaded, and no rank maps a /dev/shm buffer (66 MiB each, never unlinked by
            # DeepSpeed; one left by a killed rank held its restarted peers on stale flags).
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout, verbose=False)
        # A script that never leaves the group (any HF-style script) still must not leave gloo's
        # threads to interpreter exit.
        atexit.register(_leave_at_exit)
    return info


def leave_process_group(wait: bool = True) -> None:
    """Tear the process group down before the interpreter exits (a no-op without one): left to
    interpreter exit, gloo's threads can abort the process ("terminate called without an active
    exception"). ``wait``: every rank first waits for the others, as at the end of a successful run;
    an error exit does not wait for ranks that may never come."""
    if dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


def _leave_at_exit() -> None:
    """Leave the group as the interpreter exits. A script that ends normally waits for the other
    ranks first, as a command's run does; one that ends on an uncaught exception does not wait for
    ranks that may never come. Then gloo's workers are let finish before finalization begins."""
    leave_process_group(wait=getattr(sys, "last_value", None) is None)
    settle_gloo_workers()


# ---- DeepSpeed's CPU all-reduce buffers ---------------------------------------------------------

SHM_BUFFER_PREFIX = "deepspeed_allreduce_buffer_"


def sweep_orphan_shm_buffers() -> list[str]:
    """Remove this user's DeepSpeed all-reduce buffers that no live process maps: what runs that
    did not come through init_distributed (plain DeepSpeed, HF Trainer) leave in RAM. Returns the
    names removed."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return []
    mine = [p for p in shm.glob(f"{SHM_BUFFER_PREFIX}{os.getuid()}_*") if p.is_file()]
    if not mine:
        return []
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(
                line.rsplit(" ", 1)[-1].strip()
                for line in maps.read_text().splitlines()
                if "/dev/shm/" in line
            )
        except OSError:  # the process exited or is not ours to read
            continue
    removed = []
    for path in mine:
        if str(path) not in mapped:
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def barrier(label: str) -> None:
    """A barrier with a name, so logs and hang reports say which phase stalled."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place where possible. CPU tensors work under NCCL too (copied over)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return tensor
    if tensor.device.type == "cpu" and dist.get_backend() == "nccl":
        on_device = tensor.cuda()
        dist.all_reduce(on_device, op=dist.ReduceOp.SUM)
        return tensor.copy_(on_device.cpu())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order; a world of one, or no group yet, needs no collective."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_agree(flag: bool) -> bool:
    """True only if every rank passes True: the collective vote behind atomic commits."""
    return int(all_reduce_sum(torch.tensor([0 if flag else 1])).item()) == 0


# ---- host-side agreement ------------------------------------------------------------------------

_CONTROL_GROUP: Any = None


def _control_group() -> Any:
    """A gloo group for small host-side votes, so they never wait on the GPU stream."""
    global _CONTROL_GROUP
    if _CONTROL_GROUP is None:
        _CONTROL_GROUP = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return _CONTROL_GROUP


def host_all_reduce(values: list[float]) -> list[float]:
    """Sum small host numbers over ranks on the gloo control group: no device synchronisation."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=_control_group())
    return t.tolist()


def print_main(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only, flushed: one line per job, not one per rank."""
    if dist_info().is_main:
        print(*args, **kwargs, flush=True)


def warn(message: str) -> None:
    """A warning every rank prints, tagged with its rank, since ranks can disagree."""
    print(f"[rank {dist_info().rank}] warning: {message}", file=sys.stderr, flush=True)
