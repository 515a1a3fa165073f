"""LoRA fine-tuning through peft: adapters on a frozen base model, under ZeRO 0-3.

The base comes from ``model_name_or_path`` (with ``load_in_4bit``, quantised to NF4 by bitsandbytes:
QLoRA, CUDA only). ``apply_lora`` wraps it in peft's ``PeftModel`` with the run's ``LoraConfig``
(TRL's argument names); only the adapters (and ``lora_modules_to_save``) require gradients, so
DeepSpeed's optimizer holds state for them alone. A checkpoint keeps the whole wrapped model's state
(resume is exact as for a full model); ``final/`` is a peft adapter directory, written by peft's
``save_pretrained`` from the trainable weights (gathered one by one under ZeRO-3), which
``peft.AutoPeftModelForCausalLM`` loads onto the base. ``trainer export --merge`` folds the adapters
into the base (``merge_and_unload``).
"""

from __future__ import annotations

import peft
import torch

from trainer.args import ModelArguments


def lora_config(model_args: ModelArguments) -> peft.LoraConfig:
    targets = model_args.lora_target_modules
    return peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM,
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        modules_to_save=model_args.lora_modules_to_save,
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
    )


def apply_lora(model: torch.nn.Module, model_args: ModelArguments) -> peft.PeftModel:
    """The base frozen, adapters added (a 4-bit base is first prepared as peft recommends)."""
    if model_args.load_in_4bit:
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return peft.get_peft_model(model, lora_config(model_args))
