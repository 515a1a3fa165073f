"""Memory of this rank: device and host peaks, the bytes the engine holds in model states, and
emptying the device cache on a schedule.

Reading CUDA allocator counters does not synchronise the device, so these are safe at any step.
docs/observability.md defines each metric; docs/memory.md compares them with the planner.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.runtime.state import TrainerCallback

if TYPE_CHECKING:
    from trainer.engine import Engine


def _host_rss_bytes() -> int | None:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * resource.getpagesize()


def _host_peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def memory_stats(device: Any = None) -> dict[str, int]:
    """This rank's memory: device peak allocated (host peak RSS on CPU) and host RSS, in bytes.

    On a GPU the peak is since the last ``reset_peak_memory``; on CPU the process's peak RSS, which the
    OS never resets. Reading CUDA allocator counters does not synchronise the device.
    """
    device = torch.device(device) if device is not None else None
    rss = _host_rss_bytes()
    # The kernel updates the recorded peak lazily, so it can trail the current RSS by a few pages.
    out: dict[str, int] = {"host_peak_rss_bytes": max(_host_peak_rss_bytes(), rss or 0)}
    if rss is not None:
        out["host_rss_bytes"] = rss
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        out["peak_memory_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
        out["memory_allocated_bytes"] = int(torch.cuda.memory_allocated(device))
        out["peak_memory_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
    else:
        out["peak_memory_allocated_bytes"] = out["host_peak_rss_bytes"]
    return out


def reset_peak_memory(device: Any = None) -> None:
    """Start a new peak window on a GPU (a no-op on CPU, whose peak RSS cannot be reset)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)


def empty_device_cache() -> None:
    """Hand the caching allocator's unused blocks back to the GPU (a no-op on CPU, which has none)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class EmptyDeviceCache(TrainerCallback):
    """HF's ``torch_empty_cache_steps``: the device cache is emptied after every ``every``-th
    optimizer step, which trades a little speed for less fragmentation (fewer out-of-memory errors
    near the limit). ``empty`` is what empties it."""

    def __init__(self, every: int, empty: Callable[[], None] = empty_device_cache):
        self.every, self.empty = every, empty

    def on_step_end(self, args, state, control, **kw):
        if state.global_step % self.every == 0:
            self.empty()


def engine_state_bytes(engine: Engine) -> dict[str, int]:
    """Bytes this rank holds in model states (``Engine.state_bytes``): ``params`` (under ZeRO-3, this
    rank's partitions), ``grads``, ``optimizer`` (states and fp32 master weights) and ``other``
    (communication buckets). Compare with ``trainer.planner.model_state_bytes`` (docs/memory.md).
    """
    return engine.state_bytes()
