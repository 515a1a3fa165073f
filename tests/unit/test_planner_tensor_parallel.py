"""``trainer plan --tensor-parallel N``: a rank's slice of the projections, ZeRO over the world/T groups,
the narrower attention and MLP activations, the group's all-reduces, and TP before ZeRO-3."""

from __future__ import annotations

import json

import pytest

from trainer.cli.main import main
from trainer.config import generate
from trainer.planner import (
    Cluster,
    Setup,
    estimate,
    layer_saved_bytes,
    load_model_spec,
    model_state_bytes,
    tensor_parallel_problems,
)
from trainer.planner.memory import tensor_parallel_allreduce_bytes

SPEC = load_model_spec("llama-7b")
NODE = Cluster(gpus_per_node=8, nodes=1, gpu_memory_gb=80, cpu_memory_gb=1024)


def test_a_rank_holds_a_slice_of_the_projections_and_zero_shards_over_the_groups():
    h, ffn, layers, vocab = 4096, 11008, 32, 32000
    projections = layers * (4 * h * h + 3 * h * ffn)  # q, k, v, o and gate, up, down
    assert SPEC.tensor_split_params == projections
    held = projections / 2 + SPEC.n_params - projections
    assert SPEC.n_params - projections == 2 * vocab * h + (2 * layers + 1) * h  # embeddings, head, norms
    row = estimate(SPEC, Setup(1, "none", "none", True, tensor_parallel=2), NODE, 4096, 1)
    want = model_state_bytes(round(held), 1, 4, "bf16")  # ZeRO-1 over the 8 / 2 groups
    assert row["params_gb_per_gpu"] == pytest.approx(want["params"] / 1e9)
    assert row["optimizer_gb_per_gpu"] == pytest.approx(12 * held / 4 / 1e9, rel=1e-9)


def test_attention_and_the_mlp_keep_half_the_activations_the_norms_all():
    whole, half = (layer_saved_bytes(SPEC, "bf16", 4096, tp=tp) for tp in (1, 2))
    assert half["norms"] == whole["norms"]
    assert half["attention"] == pytest.approx(whole["attention"] / 2)
    assert half["mlp"] == pytest.approx(whole["mlp"] / 2)


def test_the_groups_all_reduces_four_a_layer():
    tokens = 4096
    # 32 layers x 4 all-reduces of [4096 x 4096] bf16, a ring sending 2(T-1)/T of each
    assert tensor_parallel_allreduce_bytes(SPEC, tokens, "bf16", 4) == 32 * 4 * tokens * 4096 * 2 * 1.5
    assert tensor_parallel_allreduce_bytes(SPEC, tokens, "bf16", 1) == 0


def test_a_size_autotp_cannot_use_is_named():
    assert tensor_parallel_problems(SPEC, NODE, 8) == []
    assert tensor_parallel_problems(SPEC, NODE, 3) == [
        "the 32 attention heads do not split 3 ways",
        "the 32 key/value heads do not split 3 ways",
        "the 4096 hidden size do not split 3 ways",
        "the 11008 MLP width do not split 3 ways",
        "the world of 8 GPUs does not split into groups of 3",
    ]
    assert "a group of 16 would span nodes of 8 GPUs" in tensor_parallel_problems(SPEC, Cluster(8, 2), 16)


def plan_json(capsys, *flags: str) -> dict:
    code = main(
        ["plan", "--model", "llama-13b", "--seq-len", "4096", "--gpus-per-node", "8", *flags, "--json"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def test_tensor_parallelism_is_recommended_where_it_spares_zero3_or_recomputation(capsys):
    alone = plan_json(capsys)["recommended"]
    assert (alone["zero_stage"], alone["activation_checkpointing"], alone["tensor_parallel"]) == (2, True, 1)
    best = plan_json(capsys, "--tensor-parallel", "8")["recommended"]
    assert (best["zero_stage"], best["activation_checkpointing"], best["tensor_parallel"]) == (1, False, 4)
    assert best["training_flags"] == ["--tensor_parallel_size 4"]
    assert best["deepspeed_config"]["tensor_parallel"] == {"autotp_size": 4, "vocab_parallel_lm_head": False}
    assert best["deepspeed_config"]["train_batch_size"] == 2  # the 8 GPUs are 2 groups of 4
    assert best["tp_allreduce_gb_per_micro_batch"] > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tensor-parallel", "3"], "3 cannot be used: the 40 attention heads do not split 3 ways"),
        (["--tensor-parallel", "2", "--lora-r", "8"], "LoRA does not run with tensor parallelism"),
    ],
)
def test_the_plan_refuses_a_size_it_cannot_use(capsys, flags, message):
    code = main(["plan", "--model", "llama-13b", "--gpus-per-node", "8", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "--tensor-parallel" in err


def test_a_generated_config_counts_a_group_once():
    config = generate(zero_stage=2, precision="bf16", micro_batch=2, world_size=8, tensor_parallel_size=4)
    assert config["train_batch_size"] == 2 * 2 and config["tensor_parallel"]["autotp_size"] == 4
