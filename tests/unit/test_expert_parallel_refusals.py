"""What expert parallelism refuses before DeepSpeed builds anything (trainer/engine/expert_parallel.py),
each in one line that names the key and, where there is one, the block: a model with no block AutoEP
finds, a block whose experts are a list of modules, and a LoRA model."""

from __future__ import annotations

import pytest
from peft import LoraConfig, get_peft_model
from transformers import MixtralConfig, MixtralForCausalLM

from tests.helpers.moe_scenario import model
from trainer.config.errors import ConfigError
from trainer.engine.expert_parallel import ExpertParallel

SECTION = {"enabled": True, "autoep_size": 2}


def refusal(module, section=SECTION) -> str:
    with pytest.raises(ConfigError) as err:
        ExpertParallel(module, {"expert_parallel": section}, 2)
    message = str(err.value)
    assert "\n" not in message and message.count("expert_parallel.autoep_size") == 1, message
    return message


def test_a_model_without_a_block_autoep_finds_is_refused():
    message = refusal(model())  # a Llama whose routed blocks no preset knows
    assert message.startswith("expert_parallel.autoep_size: AutoEP found no mixture-of-experts block in ")
    assert "LlamaForCausalLM" in message and "moe_layer_pattern" in message


def test_a_block_of_listed_experts_is_refused_naming_it():
    routed = model()
    routed.config.num_experts_per_tok = 1
    section = {**SECTION, "moe_layer_pattern": r"model\.layers\.\d+\.mlp", "router_pattern": "router",
               "expert_pattern": "experts", "expert_w1": "gate_proj", "expert_w2": "down_proj",
               "expert_w3": "up_proj"}  # fmt: skip
    message = refusal(routed, section)
    assert message.startswith(
        "expert_parallel.autoep_size: model.layers.0.mlp (custom): its experts are a list"
    )


def test_a_lora_model_is_refused_naming_both_keys():
    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2, num_local_experts=4)  # fmt: skip
    lora = get_peft_model(MixtralForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj"]))
    message = refusal(lora)
    assert message.startswith("use_peft, expert_parallel.autoep_size: LoRA runs with ZeRO 0-3")
    assert "frozen experts" in message
