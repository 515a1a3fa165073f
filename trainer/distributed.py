"""Process-group facts and helpers. The only module that reads RANK / LOCAL_RANK / WORLD_SIZE.

Works the same under the ``deepspeed`` launcher, ``torchrun``, ``accelerate launch``, SLURM
(``SLURM_PROCID`` and friends) and plain ``python`` (a world of one).
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.config import Hardware


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(*names: str, default: int) -> int:
    for name in names:
        if os.environ.get(name, "") != "":
            return int(os.environ[name])
    return default


def dist_info() -> DistInfo:
    """Rank facts from the launcher's environment (torchrun/deepspeed first, then SLURM)."""
    return DistInfo(
        rank=_env_int("RANK", "SLURM_PROCID", default=0),
        local_rank=_env_int("LOCAL_RANK", "SLURM_LOCALID", default=0),
        world_size=_env_int("WORLD_SIZE", "SLURM_NTASKS", default=1),
    )


def detect_hardware() -> Hardware:
    """What this rank computes on; decides what precision "auto" means."""
    if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") == "cuda":
        return Hardware.cuda(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    return Hardware.cpu()


def init_distributed(hardware: Hardware, timeout_s: float = 1800.0) -> DistInfo:
    """Join the process group (idempotent). A world of one still gets a group: DeepSpeed wants one."""
    info = dist_info()
    if hardware.device == "cuda":
        torch.cuda.set_device(info.local_rank)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000) if info.world_size == 1 else "29500")
        os.environ.setdefault("RANK", str(info.rank))
        os.environ.setdefault("LOCAL_RANK", str(info.local_rank))
        os.environ.setdefault("WORLD_SIZE", str(info.world_size))
        import deepspeed

        deepspeed.init_distributed(
            dist_backend="nccl" if hardware.device == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            verbose=False,
        )
    return info


def device_for(hardware: Hardware, info: DistInfo) -> torch.device:
    return torch.device("cuda", info.local_rank) if hardware.device == "cuda" else torch.device("cpu")


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
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_agree(flag: bool) -> bool:
    """True only if every rank passes True: the collective vote behind atomic commits."""
    return int(all_reduce_sum(torch.tensor([0 if flag else 1])).item()) == 0


def print_main(*args: Any, **kwargs: Any) -> None:
    if dist_info().is_main:
        print(*args, **kwargs, flush=True)


def warn(message: str) -> None:
    print(f"[rank {dist_info().rank}] warning: {message}", file=sys.stderr, flush=True)
