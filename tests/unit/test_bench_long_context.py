"""The pieces of scripts/bench_long_context.py that need no training run: the length search, how a
probe is judged, memory per token, and the RSS watcher on small child processes."""

from __future__ import annotations

import sys

import pytest

from trainer.bench.long_context import Setup, classify, last_error_line, lengths, memory_per_token, summarise
from trainer.bench.peak_rss import watch


def _search(limit: int, start: int = 1024, unit: int = 512, max_len: int = 65536) -> list[int]:
    """The lengths probed when everything up to ``limit`` fits."""
    search = lengths(start, unit, max_len)
    probed = [next(search)]
    try:
        while True:
            probed.append(search.send(probed[-1] <= limit))
    except StopIteration:
        return probed


def test_doubles_then_bisects_to_the_unit():
    assert _search(5000) == [1024, 2048, 4096, 8192, 6144, 5120, 4608]
    assert _search(3000, unit=1024) == [1024, 2048, 4096, 3072]


def test_stops_at_the_limit_or_below_the_start():
    assert _search(10**9, max_len=12000) == [1024, 2048, 4096, 8192, 11776]
    assert _search(100) == [1024]


def test_lengths_are_multiples_of_the_unit():
    assert _search(5000, start=1000, unit=768) == [1536, 3072, 6144, 4608, 5376]


def test_an_error_ends_the_search():
    search = lengths(1024, 512, 65536)
    assert next(search) == 1024
    assert search.send(True) == 2048
    with pytest.raises(StopIteration):
        search.send(None)


def test_classify_over_the_cap_out_of_memory_and_errors():
    assert classify(0, None, "", 900, 1000) == (True, None)
    assert classify(0, None, "", 1100, 1000) == (False, None)
    assert classify(-9, "cap", "", 1100, 1000) == (False, None)
    assert classify(1, None, "torch.OutOfMemoryError: CUDA out of memory.", None, 1000) == (False, None)
    fits, error = classify(1, None, "Traceback\n[rank0]: ValueError: bad thing\nlauncher line", None, 1000)
    assert fits is None and error == "exit code 1: ValueError: bad thing"
    assert classify(-9, "timeout", "", None, 1000) == (None, "timed out")


def test_last_error_line_continues_a_message_ending_in_a_colon():
    log = "x\n[rank1]: ValueError: these differ:\n[rank1]: - a=1 vs b=2\n[ERROR] launcher: exits"
    assert last_error_line(log) == "ValueError: these differ: - a=1 vs b=2"


def test_memory_per_token_is_the_least_squares_slope():
    slope, base = memory_per_token([(1000, 1_100_000), (2000, 1_200_000), (4000, 1_400_000)])
    assert slope == pytest.approx(100.0) and base == pytest.approx(1_000_000)
    assert memory_per_token([(1000, 5)]) == (None, None)


def test_summary_per_setup():
    setups = [Setup("a", "A", "ours", 1, 1), Setup("b", "B", "ours", 2, 2), Setup("c", "C", "hf", 2, 2)]
    probe = dict(tokens_per_second=10.0, error=None)
    probes = [
        {**probe, "setup": "a", "seq_len": 1024, "fits": True, "peak_bytes": 2000},
        {**probe, "setup": "a", "seq_len": 2048, "fits": False, "peak_bytes": 9000},
        {**probe, "setup": "b", "seq_len": 1024, "fits": True, "peak_bytes": 1500},
        {**probe, "setup": "b", "seq_len": 2048, "fits": True, "peak_bytes": 2500},
        {**probe, "setup": "c", "seq_len": 1024, "fits": None, "peak_bytes": None, "error": "boom"},
    ]
    s = summarise(setups, probes, top=2048)
    assert (s["a"]["longest_fit"], s["a"]["first_over"], s["a"]["limit_reached"]) == (1024, 2048, False)
    assert (s["b"]["longest_fit"], s["b"]["limit_reached"], s["b"]["longest_vs_first"]) == (2048, True, 2.0)
    assert s["b"]["bytes_per_token"] == pytest.approx(1000 / 1024)
    assert s["c"]["longest_fit"] is None and s["c"]["error"] == "boom"


ALLOCATE = (
    "import time; block = bytearray(300 * 2**20); block[::4096] = b'x' * len(block[::4096]); time.sleep(1)"
)


def test_watcher_reports_the_largest_descendant_not_the_parent():
    # The parent (a small python) starts a child that touches 300 MiB and waits for it.
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {ALLOCATE!r}], check=True)"
    report = watch([sys.executable, "-c", child], interval=0.05)
    assert report["returncode"] == 0 and report["stopped"] is None
    assert report["peak_rss_bytes"] >= 300 * 2**20
    assert report["launcher_peak_rss_bytes"] < 100 * 2**20
    assert report["largest"]["cmd"].startswith(sys.executable) and "bytearray" in report["largest"]["cmd"]


def test_watcher_stops_the_tree_at_the_cap():
    report = watch([sys.executable, "-c", ALLOCATE.replace("time.sleep(1)", "time.sleep(30)")],
                   cap_bytes=200 * 2**20, interval=0.05)  # fmt: skip
    assert report["stopped"] == "cap" and report["returncode"] == -9
    assert report["wall_s"] < 20 and report["peak_rss_bytes"] > 200 * 2**20


def test_watcher_leaves_out_processes_of_another_program():
    # The child runs python under another argv[0], as a compiler would be another program.
    child = f"import subprocess, sys; subprocess.run(['allocator', '-c', {ALLOCATE!r}], executable=sys.executable)"
    report = watch([sys.executable, "-c", child], cap_bytes=200 * 2**20, interval=0.05, only=sys.executable)
    assert report["stopped"] is None and report["returncode"] == 0  # the cap holds the counted ones only
    assert report["peak_rss_bytes"] < 100 * 2**20 <= 300 * 2**20 <= report["excluded_peak_rss_bytes"]
    assert [row["counted"] for row in report["processes"]] == [False, True]


def test_a_watcher_of_several_commands_reports_each_ones_own_peak():
    """ru_maxrss of the children is a maximum over every command this process has waited for: a small
    command watched after a large one must not report the large one's peak."""
    large = watch([sys.executable, "-c", ALLOCATE], interval=0.05)
    small = watch([sys.executable, "-c", "import time; time.sleep(0.5)"], interval=0.05)
    assert large["peak_rss_bytes"] >= 300 * 2**20
    assert small["peak_rss_bytes"] < 100 * 2**20
