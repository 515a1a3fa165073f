"""HF ``TrainingArguments`` fields this trainer refuses, each with the reason and what to use.

Every field of transformers' ``TrainingArguments`` is either a field of ours with HF's meaning or
listed here (``tests/unit/test_hf_fields.py`` enumerates the installed transformers' fields, so a new
release cannot add one that is silently ignored). ``REFUSED`` fields are refused whatever their value;
``ONLY`` fields are accepted at the one value that is this trainer's behaviour (HF's default), and
refused at any other.
"""

from __future__ import annotations

from typing import Any

_DEEPSPEED_BACKEND = "DeepSpeed is the distributed backend here; use zero_stage, offload_* or --deepspeed"
_DDP = "DeepSpeed's engine does the data-parallel reduction, not DDP; tune reduce_bucket_size in --deepspeed"
_HUB = "nothing is uploaded; output_dir/final is an HF model directory to push with huggingface_hub"
_NOT_WIRED = "not supported with the DeepSpeed engine here"

REFUSED: dict[str, str] = {
    "optim_args": "DeepSpeed's optimizer takes named fields (adam_beta1, adam_beta2, adam_epsilon, "
    "weight_decay) or a --deepspeed file's optimizer.params",
    "optim_target_modules": "only GaLore/APOLLO use it, and those optimizers are refused",
    "bf16_full_eval": "evaluation runs in the precision DeepSpeed trains in (bf16/fp16/precision)",
    "fp16_full_eval": "evaluation runs in the precision DeepSpeed trains in (bf16/fp16/precision)",
    "activation_checkpointing": "use gradient_checkpointing (the same switch here)",
    "activation_checkpointing_kwargs": "checkpointing is always non-reentrant (what ZeRO-3 needs); "
    "use gradient_checkpointing",
    "gradient_checkpointing_kwargs": "checkpointing is always non-reentrant (use_reentrant=False, what "
    "ZeRO-3 needs); no other kwargs are passed",
    "use_cache": "the KV cache is off while training (packed rows need it off); generation after "
    "training uses the model config's own use_cache",
    "auto_find_batch_size": "DeepSpeed fixes the batch when the engine is built; "
    "`trainer plan` finds a micro-batch that fits",
    "logging_nan_inf_filter": "non-finite losses are handled by nonfinite_policy (skip, rollback or stop)",
    "save_on_each_node": "every rank writes its own shards into the shared output_dir, rank 0 the rest",
    "enable_jit_checkpoint": "a checkpoint on SIGTERM/SIGUSR1 is built in (preemption_grace_s)",
    "push_to_hub": _HUB,
    "hub_token": _HUB,
    "hub_model_id": _HUB,
    "hub_strategy": _HUB,
    "hub_always_push": _HUB,
    "hub_revision": _HUB,
    "ignore_data_skip": "a resume restores the sampler's position exactly: nothing is skipped or replayed",
    "use_cpu": "DeepSpeed picks the accelerator: set DS_ACCELERATOR=cpu",
    "accelerator_config": _DEEPSPEED_BACKEND,
    "parallelism_config": f"{_DEEPSPEED_BACKEND}, pipeline_parallel_size",
    "fsdp": _DEEPSPEED_BACKEND,
    "fsdp_config": _DEEPSPEED_BACKEND,
    "ddp_find_unused_parameters": _DDP,
    "ddp_bucket_cap_mb": _DDP,
    "ddp_broadcast_buffers": _DDP,
    "ddp_static_graph": _DDP,
    "ddp_backend": "the launcher and DeepSpeed choose the backend (nccl on GPUs, gloo on CPUs)",
    "dataloader_multiprocessing_context": f"{_NOT_WIRED}; the DataLoader uses the platform's default",
    "dataloader_in_order": f"{_NOT_WIRED}; batches always come in order (resume depends on it)",
    "debug": f"HF's debug modes (underflow_overflow, tpu_metrics_debug) are {_NOT_WIRED}",
    "skip_memory_metrics": "memory figures are always in the log rows (metrics.jsonl)",
}

ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "remove_unused_columns": (
        (True,),
        "datasets are always cut to the model's inputs (input_ids, labels, position_ids, attention_mask)",
    ),
    "label_names": ((None, ["labels"]), "the labels are always the `labels` column"),
    "eval_do_concat_batches": ((True,), "predictions are always concatenated over batches"),
    "eval_use_gather_object": ((False,), "predictions are gathered as arrays, padded with -100"),
    "eval_accumulation_steps": (
        (None,),
        "predictions stay on the device until the end of predict; "
        "use preprocess_logits_for_metrics to shrink them",
    ),
    "include_for_metrics": (((), []), "compute_metrics gets predictions and labels only"),
    "batch_eval_metrics": ((False,), "compute_metrics runs once, over the whole evaluation set"),
    "average_tokens_across_devices": (
        (True,),
        "the loss is always divided by the window's target tokens on all ranks, which is what keeps "
        "accumulation and ranks exact",
    ),
}


def refusal(name: str, value: Any) -> str | None:
    """Why the HF field ``name`` set to ``value`` is refused; None when it is not."""
    if name in REFUSED:
        return f"HF's field, refused: {REFUSED[name]}"
    if name in ONLY and value not in ONLY[name][0]:
        accepted = " or ".join(repr(v) for v in ONLY[name][0])
        return f"only {accepted} is supported: {ONLY[name][1]}"
    return None


# HF optimizer names (by prefix) with no DeepSpeed optimizer behind them, and what to use instead.
_ADAMW = "use adamw_torch (or adamw_fused)"
REFUSED_OPTIMIZERS = {
    "adamw_torch_xla": f"needs torch_xla, not DeepSpeed; {_ADAMW}",
    "adamw_torch_npu": f"needs an Ascend NPU, not DeepSpeed; {_ADAMW}",
    "adamw_torch_4bit": f"a torchao low-bit optimizer, which DeepSpeed's ZeRO does not partition; {_ADAMW}",
    "adamw_torch_8bit": f"a torchao low-bit optimizer, which DeepSpeed's ZeRO does not partition; {_ADAMW}",
    "adamw_anyprecision": f"a torchdistx optimizer DeepSpeed does not drive; {_ADAMW}",
    "adafactor": f"DeepSpeed has no Adafactor; {_ADAMW}",
    "ademamix": f"DeepSpeed has no AdEMAMix; {_ADAMW}",
    "adamw_bnb": f"bitsandbytes optimizers are not supported with DeepSpeed's ZeRO here; {_ADAMW}",
    "adamw_8bit": f"bitsandbytes optimizers are not supported with DeepSpeed's ZeRO here; {_ADAMW}",
    "paged_": f"bitsandbytes paged optimizers are not supported with DeepSpeed here; {_ADAMW}",
    "lion_8bit": "bitsandbytes optimizers are not supported with DeepSpeed's ZeRO here; use lion",
    "rmsprop": f"DeepSpeed has no RMSprop; {_ADAMW}",
    "adagrad": f"not offered with DeepSpeed here; {_ADAMW}",
    "galore": f"GaLore projects gradients outside DeepSpeed's optimizer; {_ADAMW}",
    "apollo": f"APOLLO projects gradients outside DeepSpeed's optimizer; {_ADAMW}",
    "lomo": f"LOMO fuses the update into backward, which DeepSpeed's engine owns; {_ADAMW}",
    "adalomo": f"AdaLomo fuses the update into backward, which DeepSpeed's engine owns; {_ADAMW}",
    "grokadamw": f"DeepSpeed has no GrokAdamW; {_ADAMW}",
    "schedule_free": f"schedule-free optimizers need train/eval mode switches DeepSpeed does not make; {_ADAMW}",
    "stable_adamw": f"DeepSpeed has no StableAdamW; {_ADAMW}",
}
REFUSED_SCHEDULERS = {
    "reduce_lr_on_plateau": "steps on evaluation metrics, but DeepSpeed steps the scheduler after every "
    "optimizer step; use cosine or linear",
    "greedy": "steps on training-loss plateaus, but DeepSpeed steps the scheduler after every optimizer "
    "step; use cosine or linear",
}
