"""Memory metrics: this rank's device and host peaks."""

from __future__ import annotations

import pytest
import torch

from trainer.observe.monitor import memory_stats, reset_peak_memory


def test_memory_stats_on_cpu():
    stats = memory_stats("cpu")
    assert stats["host_rss_bytes"] > 0
    assert stats["host_peak_rss_bytes"] >= stats["host_rss_bytes"]
    assert stats["peak_memory_allocated_bytes"] == stats["host_peak_rss_bytes"]  # CPU: the process peak
    before = stats["host_peak_rss_bytes"]
    big = torch.ones(64 * 2**20 // 8, dtype=torch.float64)  # 64 MiB, touched
    assert memory_stats("cpu")["host_peak_rss_bytes"] >= before
    assert memory_stats("cpu")["host_rss_bytes"] >= 64 * 2**20
    del big
    reset_peak_memory("cpu")  # a no-op on CPU, but callable


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_stats_on_gpu():
    reset_peak_memory("cuda")
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    stats = memory_stats("cuda")
    assert stats["peak_memory_allocated_bytes"] >= 256 * 2**20
    del x
    reset_peak_memory("cuda")
    assert memory_stats("cuda")["peak_memory_allocated_bytes"] < 256 * 2**20
