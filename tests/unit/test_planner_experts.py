"""``trainer plan`` for a mixture of experts: the parameters counted as HF builds them (total, in
experts, active per token), expert states divided by the expert-parallel size and partitioned over
the ranks that hold the same experts, the router's and the experts' activations, and an
expert-parallel size recommended before ZeRO-3."""

from __future__ import annotations

import json

import pytest
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from trainer.cli.main import main
from trainer.planner import Cluster, Setup, estimate, layer_saved_bytes, model_state_bytes
from trainer.planner.search import expert_parallel_sizes
from trainer.planner.spec import spec_from_hf_config

SMALL = dict(vocab_size=64, hidden_size=16, intermediate_size=40, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=2, num_experts_per_tok=2)  # fmt: skip
MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
                "num_experts_per_tok": 2}  # fmt: skip


@pytest.mark.parametrize(
    "config, model",
    [
        (MixtralConfig(**SMALL, num_local_experts=4), MixtralForCausalLM),
        # experts every second layer, the first dense: Qwen-MoE's decoder_sparse_step and mlp_only_layers
        (
            Qwen3MoeConfig(
                **SMALL,
                num_experts=4,
                moe_intermediate_size=24,
                head_dim=8,
                decoder_sparse_step=2,
                mlp_only_layers=[0],
            ),
            Qwen3MoeForCausalLM,
        ),  # fmt: skip
        # DeepSeek-V3: the first layer dense, a shared expert beside the routed ones, latent attention
        # with and without the queries' low rank
        *(
            (
                DeepseekV3Config(
                    **SMALL,
                    n_routed_experts=4,
                    moe_intermediate_size=24,
                    n_shared_experts=1,
                    first_k_dense_replace=1,
                    n_group=2,
                    topk_group=1,
                    kv_lora_rank=8,
                    q_lora_rank=q_rank,
                    qk_rope_head_dim=4,
                    qk_nope_head_dim=8,
                    v_head_dim=8,
                ),
                DeepseekV3ForCausalLM,
            )  # fmt: skip
            for q_rank in (None, 12)
        ),
    ],
)
def test_parameters_are_counted_as_hf_builds_them(config, model):
    built = model(config)
    spec = spec_from_hf_config(config.to_dict())
    experts = sum(p.numel() for name, p in built.named_parameters() if ".experts." in name)
    assert spec.n_params == sum(p.numel() for p in built.parameters())
    assert spec.expert_params == experts
    assert spec.active_params == spec.n_params - experts + experts * 2 // 4  # 2 of 4 experts a token
    biggest = max(p.numel() for p in built.parameters())
    assert spec.largest_layer_params >= biggest  # the fused experts, gathered whole under ZeRO-3


def test_mixtral_8x7b_is_46_7b_with_12_9b_active():
    spec = spec_from_hf_config(MIXTRAL_8X7B)
    assert round(spec.n_params / 1e9, 1) == 46.7 and round(spec.active_params / 1e9, 1) == 12.9


def test_expert_states_divide_by_the_expert_parallel_size():
    """ZeRO-1 on 8 GPUs: the rest over all 8; each rank's quarter of the experts (EP=4) over the 2
    ranks that hold the same experts."""
    spec = spec_from_hf_config(MIXTRAL_8X7B)
    node = Cluster(gpus_per_node=8, nodes=1, gpu_memory_gb=80, cpu_memory_gb=1024)
    row = estimate(spec, Setup(1, "none", "none", True, expert_parallel=4), node, 4096, 1)
    dense = model_state_bytes(spec.n_params - spec.expert_params, 1, 8, "bf16")
    experts = model_state_bytes(spec.expert_params / 4, 1, 2, "bf16")
    assert row["optimizer_gb_per_gpu"] == pytest.approx((dense["optimizer"] + experts["optimizer"]) / 1e9)
    assert row["params_gb_per_gpu"] == pytest.approx(
        2 * (spec.n_params - spec.expert_params + spec.expert_params / 4) / 1e9
    )
    without = estimate(spec, Setup(1, "none", "none", True), node, 4096, 1)
    assert row["model_states_gb_per_gpu"] < without["model_states_gb_per_gpu"] / 2
    assert expert_parallel_sizes(spec, node, 8) == [1, 2, 4, 8]
    assert expert_parallel_sizes(spec, Cluster(gpus_per_node=6), 6) == [1, 2]  # 8 experts: not 3 or 6


def test_a_token_keeps_its_experts_activations_and_the_router_its_logits():
    spec = spec_from_hf_config(MIXTRAL_8X7B)
    saved = layer_saved_bytes(spec, "bf16", 4096)
    assert saved["mlp"] == 2 * (2 * 4096 + 4 * 2 * 14336)  # 2 experts: the input and 4 tensors each
    assert saved["router"] == (2 + 4) * 8  # bf16 logits and fp32 probabilities, one per expert


def test_the_plan_recommends_an_expert_parallel_size(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    code = main(["plan", "--model", str(tmp_path), "--seq-len", "4096", "--nodes", "4", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    best = result["recommended"]
    assert (best["zero_stage"], best["expert_parallel"]) == (2, 4)
    assert "--expert_parallel_size 4" in best["training_flags"]
    assert result["active_params"] == spec_from_hf_config(MIXTRAL_8X7B).active_params
    code = main(
        ["plan", "--model", str(tmp_path), "--seq-len", "4096", "--nodes", "4", "--expert-parallel", "1"]
    )
    text = capsys.readouterr().out
    assert "expert parallel" not in text.split("recommended:")[1].splitlines()[0]
    assert "12.88B active per token" in text


def test_a_dense_model_is_planned_without_experts():
    spec = spec_from_hf_config({**MIXTRAL_8X7B, "num_local_experts": 0})
    assert (spec.n_experts, spec.expert_params, spec.active_params) == (0, 0, spec.n_params)
    assert expert_parallel_sizes(spec, Cluster(), 8) == [1]
    assert "router" not in layer_saved_bytes(spec, "bf16", 4096)
