"""A tiny Mixtral trained on one process by HF's ``Trainer`` and by ours, from the same weights on
the same rows, with the router's load-balancing loss on (``output_router_logits``, HF's switch;
on by default here). Each micro-batch is one row, where HF's pooling and ours (each row's tokens)
agree. Ours trains again on the same rows as one batch of 4, as 2 micro-batches of 2 and as 4 of 1,
rows of different lengths (padding, which neither pool counts), and as one batch of 4 with activation
checkpointing (the routers run again in backward, their hooks disarmed). Both train LoRA adapters on
the attention (the router frozen, its loss still moving the adapters), micro-batches of one row.

Usage: ``python tests/helpers/moe_parity.py OUT``; writes ``OUT/parity.json``: per run, the losses
(and ours' ``aux_loss``) of each step.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import MixtralConfig, MixtralForCausalLM

from tests.helpers.trainer_scenarios import VOCAB, token_dataset
from trainer import Trainer, TrainingArguments
from trainer.data import CausalLMCollator

COMMON = dict(
    max_steps=4, learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
    report_to="none", disable_tqdm=True, seed=0, optim="adamw_torch",
)  # fmt: skip


def mixtral() -> MixtralForCausalLM:
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, router_aux_loss_coef=0.05, output_router_logits=True)  # fmt: skip
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def steps(history: list[dict]) -> dict[str, list[float]]:
    rows = [r for r in history if "loss" in r and "grad_norm" in r]
    return {key: [r[key] for r in rows if key in r] for key in ("loss", "grad_norm", "aux_loss")}


def main() -> int:
    out = Path(sys.argv[1])
    model = mixtral()
    collator = CausalLMCollator(0)
    results = {}
    data = token_dataset(16, seed=5, min_len=6, max_len=12)
    for name, trainer_class, batch, accumulate, recompute in (
        ("hf", transformers.Trainer, 1, 1, False),
        ("ours", Trainer, 1, 1, False),
        ("ours_batch4", Trainer, 4, 1, False),
        ("ours_2x2", Trainer, 2, 2, False),
        ("ours_4x1", Trainer, 1, 4, False),
        ("ours_batch4_checkpointed", Trainer, 4, 1, True),
        ("hf_lora", transformers.Trainer, 1, 1, False),
        ("ours_lora", Trainer, 1, 1, False),
    ):
        hf = trainer_class is transformers.Trainer
        arguments = (transformers.TrainingArguments if hf else TrainingArguments)(
            output_dir=str(out / name), per_device_train_batch_size=batch, gradient_accumulation_steps=accumulate,
            gradient_checkpointing=recompute, **COMMON, **({"use_cpu": True} if hf else {}),
        )  # fmt: skip
        policy = copy.deepcopy(model)
        if name.endswith("_lora"):  # adapters on the attention; the router and experts frozen
            policy = get_peft_model(
                policy, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
            )
        trainer = trainer_class(model=policy, args=arguments, train_dataset=data, data_collator=collator)
        trainer.train()
        results[name] = steps(trainer.state.log_history)
    (out / "parity.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
