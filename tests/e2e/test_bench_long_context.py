"""scripts/bench_long_context.py end to end on a tiny Llama: no SP and SP=2 (2 CPU ranks), two
doublings. Checks the JSON's contract and that splitting the sequence never trains a shorter one;
timings and exact lengths are never asserted (RSS on a shared machine moves)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

TINY = '{"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}'


def test_json_holds_every_probe_and_sp_trains_at_least_as_long(tmp_path):
    result_file = tmp_path / "result.json"
    proc = launch(
        ["scripts/bench_long_context.py", "--device", "cpu", "--setups", "ours,ours_sp",
         "--model_config", TINY, "--vocab_size", "2048", "--cap_gb", "1.0",
         "--start", "512", "--granularity", "512", "--doublings", "2",
         "--out", str(tmp_path / "work"), "--json", str(result_file)],
        launcher="python", timeout=900,
    )  # fmt: skip
    result = json.loads(result_file.read_text())
    assert result["device"] == "cpu" and result["cap_bytes"] == 10**9 and result["max_len"] == 2048
    assert set(result["setups"]) == {"ours", "ours_sp"}
    assert result["setups"]["ours_sp"]["ranks"] == 2 and result["setups"]["ours_sp"]["sp"] == 2
    for probe in result["probes"]:
        assert probe["setup"] in ("ours", "ours_sp") and probe["seq_len"] % 512 == 0
        assert probe["fits"] is not None, probe["error"]
        assert probe["peak_bytes"] > 0
        if probe["fits"]:
            assert probe["tokens_per_second"] > 0 and probe["peak_bytes"] <= result["cap_bytes"]
        if probe["setup"] == "ours_sp":  # the largest process is a rank, not the launcher
            assert probe["launcher_is_largest"] is False and "train.py" in probe["largest_process"]
    summary = result["summary"]
    assert summary["ours"]["longest_fit"] is not None
    assert summary["ours_sp"]["longest_fit"] >= summary["ours"]["longest_fit"]
    for entry in summary.values():
        assert set(entry["tokens_per_second"]) <= {"512", "1024", "2048"}
    # The table: one column per setup, the summary rows under it.
    assert "| seq_len | ours, 1 process | ours, SP=2 |" in proc.stdout and "**longest fit**" in proc.stdout
