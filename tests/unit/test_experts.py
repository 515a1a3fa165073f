"""Expert blocks found from a model's shape (trainer/engine/experts.py): a list of experts of one
class beside a router with one row per expert; dense models and HF's fused experts have none."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from tests.helpers.moe_scenario import RoutedMLP, model
from trainer.engine.experts import expert_blocks


def test_a_list_of_experts_beside_a_router_is_a_block():
    routed = model()
    assert expert_blocks(routed) == [layer.mlp for layer in routed.model.layers]
    assert all(isinstance(block, RoutedMLP) for block in expert_blocks(routed))


def test_dense_layers_and_fused_experts_are_not():
    small = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                 num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    assert expert_blocks(LlamaForCausalLM(LlamaConfig(**small))) == []
    # HF's Mixtral keeps its experts in 3-D parameters: gathered whole, every rank, with no mark
    assert expert_blocks(MixtralForCausalLM(MixtralConfig(**small, num_local_experts=4))) == []


def test_a_position_table_as_long_as_the_layers_is_no_router():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=4, n_embd=16, n_layer=4, n_head=2))
    assert expert_blocks(gpt2) == []


def test_a_list_without_a_router_is_not():
    routed = model()
    for layer in routed.model.layers:
        del layer.mlp.router
    assert expert_blocks(routed) == []
