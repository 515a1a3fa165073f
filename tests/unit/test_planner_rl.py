"""The planner's online RL figures: a rollout's KV cache, and under ZeRO-3 the weights gathered once
to generate (whole where they fit in half the memory left beside the model states, else as much as
fits there, the rest a layer at a time by each forward), counted against the step's activations (a
rollout is let go before the backward); `trainer plan --objective grpo`."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from trainer.cli.main import main
from trainer.planner import HEADROOM, Cluster, Objective, Setup, estimate, load_model_spec
from trainer.planner.memory import kv_cache_bytes

SPEC = load_model_spec("llama-7b")
GRPO = Objective("grpo", generation_rows=16)


def test_the_kv_cache_is_keys_and_values_of_every_layer():
    # llama-7b: 32 layers x 32 heads x 128 dims; 16 rows of 1024 tokens in bf16.
    assert kv_cache_bytes(SPEC, 1024, 16, "bf16") == 2 * 32 * 32 * 128 * 1024 * 16 * 2


def test_zero3_gathers_the_whole_weights_where_they_fit_else_what_half_the_room_holds():
    roomy = estimate(SPEC, Setup(3, "none", "none", False), Cluster(gpus_per_node=8), 1024, 1, objective=GRPO)
    whole = roomy["generation"]
    assert whole["kv_cache"] == pytest.approx(8.59, abs=0.01)
    # Every weight in bf16, gathered beside this GPU's partitions.
    assert whole["gathered_weights"] == pytest.approx(2 * SPEC.n_params / 1e9)
    assert "gathered_layer" not in whole
    assert roomy["activations_gb_per_gpu"] == pytest.approx(whole["kv_cache"] + whole["gathered_weights"])
    tight = estimate(
        SPEC,
        Setup(3, "none", "none", False),
        Cluster(gpus_per_node=8, gpu_memory_gb=24),
        1024,
        1,
        objective=GRPO,
    )
    part = tight["generation"]
    room = 24 * (1 - HEADROOM) - tight["model_states_gb_per_gpu"] - tight["buffers_gb_per_gpu"]
    assert 0 < room / 2 < 2 * SPEC.n_params / 1e9
    assert part["gathered_weights"] == pytest.approx(room / 2)
    assert part["gathered_layer"] == pytest.approx(2 * SPEC.largest_layer_params / 1e9)
    assert tight["activations_gb_per_gpu"] == pytest.approx(sum(part.values()))


def test_zero2_holds_the_weights_whole_already_and_other_objectives_generate_nothing():
    zero2 = estimate(SPEC, Setup(2, "none", "none", False), Cluster(gpus_per_node=8), 1024, 1, objective=GRPO)
    assert set(zero2["generation"]) == {"kv_cache"}
    assert (
        estimate(SPEC, Setup(3, "none", "none", False), Cluster(gpus_per_node=8), 1024, 1)["generation"] == {}
    )


def test_plan_cli_names_the_generation(capsys):
    argv = [
        "plan",
        "--model",
        "llama-7b",
        "--objective",
        "grpo",
        "--generation-batch",
        "16",
        "--seq-len",
        "1024",
    ]
    assert main([*argv, "--gpu-memory-gb", "24"]) == 0
    out = capsys.readouterr().out
    assert "objective grpo: the policy generates 16 completions at once per GPU" in out
    assert "KV cache 8.59 GB" in out
    assert "the whole weights do not fit, so " in out and "GB of them are gathered once per rollout" in out
    with contextlib.redirect_stdout(io.StringIO()) as text:
        assert main([*argv, "--json"]) == 0
    result = json.loads(text.getvalue())
    assert result["objective"] == {"name": "grpo", "reference_model": False, "generation_rows": 16}
    assert result["recommended"]["generation"]["kv_cache"] == pytest.approx(8.59, abs=0.01)
