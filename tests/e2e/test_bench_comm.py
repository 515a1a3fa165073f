"""scripts/bench_comm.py: bus-bandwidth arithmetic, and a short real run on 2 gloo ranks."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.helpers.launch import ROOT, launch


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_comm", ROOT / "scripts" / "bench_comm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bus_factors_are_nccl_tests(bench):
    assert bench.bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bench.bus_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert bench.bus_factor("reduce_scatter", 4) == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        bench.bus_factor("broadcast", 2)


def test_sizes_are_whole_elements_per_rank(bench):
    assert bench.parse_bytes("64K") == 65536 and bench.parse_bytes("1MiB") == 1 << 20
    assert bench.parse_bytes("1.5M") == 3 << 19
    assert bench.message_sizes(1024, 16384, 4, 2, 4) == [1024, 4096, 16384]
    # 3 ranks × 4-byte floats: every size is a multiple of 12 bytes, the smallest one element each.
    assert bench.message_sizes(1, 100, 4, 3, 4) == [12, 48]


def test_row_turns_time_into_algbw_and_busbw(bench):
    row = bench.row("all_reduce", 8_000_000, 0.004, world=4, elem=4)
    assert row["algbw_gbps"] == pytest.approx(2.0)
    assert row["busbw_gbps"] == pytest.approx(3.0)
    assert row["count"] == 2_000_000 and row["time_us"] == pytest.approx(4000)


def test_step_estimate_puts_zero3_at_one_and_a_half_times_ddp(bench):
    est = bench.step_estimate(1e9, 2, 8, {"all_reduce": 10.0, "all_gather": 10.0, "reduce_scatter": 10.0})
    assert est["zero3_gb_per_rank"] == pytest.approx(1.5 * est["ddp_zero12_gb_per_rank"])
    assert est["ddp_zero12_gb_per_rank"] == pytest.approx(2 * 2 * 7 / 8)
    assert est["zero3_seconds"] == pytest.approx(1.5 * est["ddp_zero12_seconds"])


def test_unknown_collective_is_one_clear_error(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--ops", "all_reduce,alltoall"])
    assert exit_info.value.code == 2
    assert "--ops: unknown collective 'alltoall'" in capsys.readouterr().err


@pytest.mark.distributed
def test_two_gloo_ranks_write_the_json_report(tmp_path):
    report = tmp_path / "comm.json"
    proc = launch(
        ["scripts/bench_comm.py", "--min-bytes", "4K", "--max-bytes", "64K", "--iters", "3", "--warmup", "1",
         "--model-params", "1e6", "--json", str(report)],
        launcher="torchrun",
    )  # fmt: skip
    data = json.loads(report.read_text())
    assert (data["backend"], data["device"], data["world_size"]) == ("gloo", "cpu", 2)
    assert set(data["results"]) == {"all_reduce", "all_gather", "reduce_scatter"}
    for op, rows in data["results"].items():
        assert [r["bytes"] for r in rows] == [4096, 16384, 65536]
        factor = 1.0 if op == "all_reduce" else 0.5  # 2(n-1)/n and (n-1)/n at n = 2
        for r in rows:
            assert r["time_us"] > 0
            assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)
            assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3)
        assert data["peak_busbw_gbps"][op] == max(r["busbw_gbps"] for r in rows)
    assert data["estimate"]["zero3_gb_per_rank"] == pytest.approx(
        1.5 * data["estimate"]["ddp_zero12_gb_per_rank"]
    )
    assert "busbw GB/s" in proc.stdout
