"""Building HF causal-LM models: from a config (pretraining) or a local directory (fine-tuning).

Under ZeRO-3 the model is created already partitioned: an ``HfDeepSpeedConfig`` kept alive for the
model's lifetime makes ``from_config``/``from_pretrained`` run inside ``deepspeed.zero.Init``, so no
rank ever holds the full model.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BitsAndBytesConfig,
    DeepseekV3Config,
    GPT2Config,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen3MoeConfig,
)
from transformers.integrations import HfDeepSpeedConfig
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from trainer.args import ModelArguments
from trainer.config import for_zero_init
from trainer.engine import zero

# A small Llama that trains visibly on two CPU cores in a few minutes.
DEFAULT_LLAMA = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    tie_word_embeddings=True,
)
DEFAULT_GPT2 = dict(n_embd=256, n_layer=4, n_head=4, tie_word_embeddings=True)
# Mixtures of experts of the same width and depth: 8 experts, each token routed to 2 of half the
# Llama's MLP width, so a token's active parameters match the Llama's.
_MOE = dict(DEFAULT_LLAMA, intermediate_size=344, num_experts_per_tok=2)
DEFAULT_MOE = {
    "mixtral": (MixtralConfig, dict(_MOE, num_local_experts=8)),
    "qwen3_moe": (Qwen3MoeConfig, dict(_MOE, moe_intermediate_size=344, num_experts=8, head_dim=64)),
    # DeepSeek-V3's shape: a dense first layer, then 8 routed experts (2 per token, chosen within the
    # best of 2 groups, with the router's correction bias) beside one shared expert, and multi-head
    # latent attention.
    "deepseek_v3": (
        DeepseekV3Config,
        dict(
            DEFAULT_LLAMA,
            moe_intermediate_size=172,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            kv_lora_rank=64,
            q_lora_rank=None,
            qk_rope_head_dim=32,
            qk_nope_head_dim=32,
            v_head_dim=64,
        ),
    ),  # fmt: skip
}


def model_config(model_args: ModelArguments, tokenizer: Any, block_size: int) -> PretrainedConfig:
    """The model's HF config; without a tokenizer (a check of the architecture before anything
    loads) a new model's vocabulary and special tokens are left at their defaults."""
    if model_args.model_name_or_path:
        return AutoConfig.from_pretrained(
            model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code
        )
    special = (
        {}
        if tokenizer is None
        else dict(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    if model_args.model_type == "gpt2":
        return GPT2Config(
            **{**DEFAULT_GPT2, "n_positions": block_size, **special, **model_args.model_config_overrides}
        )
    config_class, defaults = DEFAULT_MOE.get(model_args.model_type, (LlamaConfig, DEFAULT_LLAMA))
    return config_class(
        **{
            **defaults,
            "max_position_embeddings": block_size,
            **special,
            **model_args.model_config_overrides,
        }
    )


def hidden_size_of(config: PretrainedConfig) -> int:
    return int(getattr(config, "hidden_size", None) or config.n_embd)


def model_hidden_size(model: torch.nn.Module) -> int | None:
    """A model's hidden size where its config names one the way decoders do; None otherwise."""
    config = getattr(model, "config", None)
    return getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)


def build_model(
    model_args: ModelArguments,
    config: PretrainedConfig,
    ds_config: dict[str, Any],
    gradient_checkpointing: bool = False,
    seed: int = 42,
) -> torch.nn.Module:
    """The model, partitioned at creation under ZeRO-3, in fp32 (DeepSpeed casts for bf16/fp16)."""
    zero3 = ds_config.get("zero_optimization", {}).get("stage", 0) == 3
    # Held by the model: transformers consults it (through a weak reference) while building.
    # A stage below 3 clears any earlier one, or this model would be partitioned too.
    unset_hf_deepspeed_config()
    hf_ds = HfDeepSpeedConfig(for_zero_init(ds_config)) if zero3 else None
    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(
            model_args.model_name_or_path,
            config=config,
            dtype=torch.bfloat16 if model_args.load_in_4bit else torch.float32,
            trust_remote_code=model_args.trust_remote_code,
            quantization_config=quantization(model_args),
        )
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        init_weights(model, seed, zero3)
    if model_args.use_peft:
        from trainer.model.lora import apply_lora  # peft is an optional extra

        model = apply_lora(model, model_args)
    model._trainer_hf_ds_config = hf_ds
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model


def is_adapter(model: Any) -> bool:
    """A peft model (LoRA): its export is the adapter, not the whole model."""
    return isinstance(getattr(model, "peft_config", None), dict)


def param_counts(model: torch.nn.Module, tensor: int = 1) -> tuple[int, int]:
    """(trainable, total) parameters; a ZeRO-3 partition counts its full size, an AutoTP slice over
    ``tensor`` ranks its whole weight's."""
    return zero.parameter_counts(model, tensor)


def quantization(model_args: ModelArguments) -> Any:
    """QLoRA's 4-bit base: NF4 with double quantisation, bf16 compute, and bf16 storage so that
    ZeRO-3 can shard the packed weights like any bf16 tensor."""
    if not model_args.load_in_4bit:
        return None
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16,
    )


def init_weights(model: torch.nn.Module, seed: int, zero3: bool = False) -> None:
    """Initialise every parameter from its own seed (seed + name): the same weights whether the
    model was built whole or partitioned by ZeRO-3, on any number of ranks.

    Matrices get N(0, initializer_range), biases zeros and 1-d weights (norm scales) ones. Each
    parameter is gathered alone under ZeRO-3, so peak memory stays one tensor.
    """
    std = getattr(model.config, "initializer_range", 0.02)
    for name, param in model.named_parameters():
        with (
            zero.gathered([param], modifier_rank=0, enabled=zero3),
            torch.no_grad(),
            torch.random.fork_rng(devices=[]),
        ):
            torch.manual_seed(seed + zlib.crc32(name.encode()))
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() < 2:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std)


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    # Non-reentrant checkpointing works with ZeRO-3 hooks and inputs that need no grad. transformers
    # 5 calls it activation checkpointing (the old name warns); a model of its own may have only the
    # old name.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
