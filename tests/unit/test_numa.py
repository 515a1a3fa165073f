"""DeepSpeed's NUMA layout, asked once per process (``trainer.runtime.distributed``)."""

from __future__ import annotations


def test_the_numa_layout_is_asked_once_per_process(monkeypatch):
    """DeepSpeed's CPU accelerator asks ``numactl`` for the layout on each device count."""
    import subprocess

    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.utils import numa

    from trainer.runtime.distributed import keep_the_first_numa_answer

    calls = []
    original = getattr(numa.get_numa_cores, "__wrapped__", numa.get_numa_cores)
    monkeypatch.setattr(numa, "get_numa_cores", original)  # the answer asked afresh, restored after
    layout = b"available: 1 nodes (0)\nnode 0 cpus: 0 1\n"
    monkeypatch.setattr(subprocess, "check_output", lambda *a, **k: calls.append(a) or layout)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    keep_the_first_numa_answer()
    counts = [CPU_Accelerator().device_count() for _ in range(3)]
    assert counts == [1, 1, 1] and len(calls) == 1
