"""``trainer plan``: flags, the JSON object, the recommendation with its DeepSpeed config, exit codes."""

from __future__ import annotations

import json

import pytest

from trainer.cli.main import main

PAPER = ["--params", "7.5e9", "--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab", "32000",
         "--seq-len", "2048", "--micro-batch", "1", "--gpus-per-node", "8", "--nodes", "8",
         "--gpu-memory-gb", "80", "--cpu-memory-gb", "1024"]  # fmt: skip
ROW_KEYS = {
    "zero_stage", "offload_optimizer", "offload_param", "activation_checkpointing", "model_states_gb_per_gpu",
    "activations_gb_per_gpu", "total_gb_per_gpu", "buffers_gb_per_gpu", "cpu_gb_per_node", "fits",
}  # fmt: skip


def plan_json(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["plan", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_json_shape_and_paper_figures(capsys):
    code, result = plan_json(capsys, *PAPER)
    assert code == 0
    rows = result["configurations"]
    assert len(rows) == 16
    assert all(row.keys() >= ROW_KEYS for row in rows)
    plain = {
        r["zero_stage"]: r
        for r in rows
        if r["offload_optimizer"] == "none" and not r["activation_checkpointing"]
    }
    assert [round(plain[s]["model_states_gb_per_gpu"], 1) for s in range(4)] == [120.0, 31.4, 16.6, 1.9]
    assert result["cluster"]["world_size"] == 64
    best = result["recommended"]
    # ZeRO-1's 31.4 GB of model states leave room for the activations of one 2048-token sequence.
    assert (best["zero_stage"], best["offload_optimizer"], best["activation_checkpointing"]) == (
        1,
        "none",
        False,
    )


def test_recommendation_carries_a_deepspeed_config(capsys):
    code, result = plan_json(capsys, "--model", "llama-7b", "--micro-batch", "8")
    assert code == 0
    best = result["recommended"]
    ds = best["deepspeed_config"]
    # Eight sequences' activations (104 GB) do not fit without checkpointing; ZeRO-1 with it is the fastest.
    assert (best["zero_stage"], best["activation_checkpointing"]) == (1, True)
    assert ds["zero_optimization"]["stage"] == 1
    assert (
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
        ds["train_batch_size"],
    ) == (8, 1, 64)
    assert ds["bf16"] == {"enabled": True}
    assert "auto" not in json.dumps(ds)


def test_only_offload_fits(capsys):
    code, result = plan_json(capsys, "--model", "llama-13b", "--gpus-per-node", "1", "--cpu-memory-gb", "512")
    assert code == 0
    assert not any(r["fits"] for r in result["configurations"] if r["offload_optimizer"] == "none")
    best = result["recommended"]
    assert best["offload_optimizer"] == "cpu"
    assert best["deepspeed_config"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_text_report(capsys):
    argv = [
        "plan",
        "--model",
        "llama-13b",
        "--gpus-per-node",
        "1",
        "--cpu-memory-gb",
        "512",
        "--seq-len",
        "8192",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "model llama-13b: 13.02B parameters, 40 layers, hidden 5120, 40 heads, vocab 32000\n"
    )
    # The loss is tiled by the trainer's auto rule (1 GB of fp32 logits), so no flag asks for it.
    assert (
        "\nrecommended: ZeRO-1, optimizer offloaded to CPU, activation checkpointing on, tiled loss (" in out
    )
    assert "\ntrain with --gradient_checkpointing true\n" in out
    config = out.split("the training arguments):\n", 1)[1]
    assert json.loads(config)["zero_optimization"]["stage"] == 1


def test_nothing_fits_exits_non_zero_with_a_clear_message(capsys):
    argv = [
        "plan",
        "--model",
        "llama-70b",
        "--gpus-per-node",
        "1",
        "--gpu-memory-gb",
        "24",
        "--cpu-memory-gb",
        "64",
    ]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "recommended:" not in captured.out
    assert captured.err.startswith("trainer plan: no configuration fits: the leanest (ZeRO-3, optimizer and")
    assert captured.err.endswith("lower --micro-batch or --seq-len, or add GPUs or nodes\n")
    assert main([*argv, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["recommended"] is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-7"], "--model: no such file or preset (not a preset; did you mean llama-7b?); presets: "),
        (["--model", "gpt2", "--params", "1e9"], "--model: give --model or the size flags, not both (got --model and --params)"),
        (["--params", "1e9", "--layers", "4"], "--hidden: missing --hidden, --heads, --vocab (all five size flags are needed)"),
        ([], "--model: no model: give --model, or --params --layers --hidden --heads --vocab"),
        (["--model", "gpt2", "--seq-len", "0"], "--seq-len: must be > 0, got 0"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_naming_the_flag(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"trainer plan: {message}")


def test_a_reader_that_stops_early_ends_the_report_quietly():
    """``trainer plan ... | head``: the command ends as a writer to a closed pipe does, with no
    traceback. The reader here (``true``) is gone before the report's first line, whatever the timing."""
    import subprocess
    import sys

    from tests.helpers.launch import ROOT, run_env

    plan = [sys.executable, "-c", "from trainer.cli.main import entry; entry()", "plan", *PAPER]
    proc = subprocess.run(
        ["bash", "-c", '"$@" | true; echo "status ${PIPESTATUS[0]}" >&2', "pipe", *plan],
        cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.stderr.splitlines() == ["status 141"]
