"""HF ``TrainingArguments`` fields with no implementation of ours: each is an attribute at HF's
default (so a script reading ``training_args.push_to_hub`` works), and those this trainer cannot
honour are refused, with the reason and what to use, only when set away from that default.

``HFFields`` declares them with HF's names, types and defaults; ``TrainingArguments`` inherits it.
``REFUSED`` fields are refused at any value but HF's default (or what HF's own ``to_dict`` writes
for it, ``SAME_AS_DEFAULT``), so that a JSON HF wrote loads; ``ONLY`` fields are accepted at the
listed values that are this trainer's behaviour. A change that honours a field deletes its line
from ``REFUSED`` or ``ONLY``; the field itself stays. ``tests/unit/test_hf_fields.py`` compares the
field list and defaults with the installed transformers', so a new release cannot add a field that
is missing or silently ignored.

This module imports nothing of the package: the argument models and their dataclass face build on it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

_DEEPSPEED_BACKEND = "DeepSpeed is the distributed backend here; use zero_stage, offload_* or --deepspeed"
_DDP = "DeepSpeed's engine does the data-parallel reduction, not DDP; tune reduce_bucket_size in --deepspeed"
_HUB = "nothing is uploaded; output_dir/final is an HF model directory to push with huggingface_hub"
_NOT_WIRED = "not supported with the DeepSpeed engine here"

# Refused unless left at HF's default. A change that honours one of these deletes its line here.
REFUSED: dict[str, str] = {
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
    "eval_do_concat_batches": ((True,), "predictions are always concatenated over batches"),
    "eval_use_gather_object": ((False,), "predictions are gathered as arrays, padded with -100"),
    "average_tokens_across_devices": (
        (True,),
        "the loss is always divided by the window's target tokens on all ranks, which is what keeps "
        "accumulation and ranks exact",
    ),
}


# Fields of ours whose default is not HF's (HF's default, then why); every other field has HF's.
OWN_DEFAULTS: dict[str, tuple[Any, str]] = {
    "output_dir": ("trainer_output", "runs write under output/ unless a recipe or flag says otherwise"),
    "optim": ("adamw_torch_fused", "the same optimizer (torch's AdamW); adamw_torch names it here"),
    "lr_scheduler_kwargs": (None, "{} and HF's None both mean no extra arguments"),
}

# Values HF's own to_dict writes for a field left at its default (and a token, always masked): they
# mean the default here too.
SAME_AS_DEFAULT: dict[str, tuple[Any, ...]] = {
    "activation_checkpointing": (False,),
    "debug": ([],),
    "include_num_input_tokens_seen": (False,),
    "hub_token": ("<HUB_TOKEN>",),
}


def refusal(name: str, value: Any, default: Any) -> str | None:
    """Why the HF field ``name`` set to ``value`` is refused (its HF default is ``default``); None
    when it is accepted."""
    if name in ONLY and value not in ONLY[name][0]:
        accepted = " or ".join(repr(v) for v in ONLY[name][0])
        return f"only {accepted} is supported: {ONLY[name][1]}"
    if name in REFUSED and value != default and value not in SAME_AS_DEFAULT.get(name, ()):
        return f"HF's field, refused: {REFUSED[name]}"
    return None


def refused_note(name: str) -> str:
    """What ``--help`` adds to a refused field's description."""
    if name in ONLY:
        return f"Only {' or '.join(repr(v) for v in ONLY[name][0])} is supported: {ONLY[name][1]}."
    if name in REFUSED:
        return f"Refused unless left at HF's default: {REFUSED[name]}."
    return ""


_DICT = dict[str, Any] | str | None  # str: JSON, as HF's parser hands it over


class HFFields(BaseModel):
    """The HF fields above, at HF's defaults. Types are HF's, with its enums as plain strings and its
    config objects as JSON objects, so that this stays free of torch and transformers."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    optim_args: str | None = Field(
        None,
        description="Extra optimizer arguments, as 'key=value,...': LARS's momentum, dampening, nesterov "
        "and trust_coefficient (optim lars); Muon's muon_lr, adam_lr, momentum, nesterov, ns_steps, update_scale "
        "and ns_precision (optim muon); refused with any other optimizer.",
    )
    optim_target_modules: None | str | list[str] = Field(
        None, description="Modules that GaLore/APOLLO optimize."
    )
    average_tokens_across_devices: bool = Field(
        True, description="Normalise the loss by the target tokens counted over all ranks."
    )
    label_smoothing_factor: float = Field(0.0, description="Label smoothing of the loss; 0 means none.")
    bf16_full_eval: bool = Field(False, description="Evaluate with the model in bf16, not mixed precision.")
    fp16_full_eval: bool = Field(False, description="Evaluate with the model in fp16, not mixed precision.")
    activation_checkpointing: bool | None = Field(
        None, description="HF's newer name of gradient_checkpointing."
    )
    activation_checkpointing_kwargs: _DICT = Field(
        None, description="Arguments of the model's activation checkpointing."
    )
    gradient_checkpointing_kwargs: _DICT = Field(
        None, description="Arguments of the model's gradient checkpointing."
    )
    torch_compile: bool = Field(False, description="Compile the model with torch.compile.")
    torch_compile_backend: str | None = Field(None, description="torch.compile's backend.")
    torch_compile_mode: str | None = Field(None, description="torch.compile's mode.")
    use_liger_kernel: bool = Field(False, description="Patch the model with Liger's Triton kernels.")
    liger_kernel_config: _DICT = Field(None, description="Which Liger kernels to apply.")
    use_cache: bool = Field(False, description="The model's KV cache while training.")
    neftune_noise_alpha: float | None = Field(
        None, description="NEFTune: noise added to the input embeddings while training, of this scale."
    )
    torch_empty_cache_steps: int | None = Field(
        None, description="Empty the accelerator's cache every N steps."
    )
    auto_find_batch_size: bool = Field(
        False,
        description="On out-of-memory in the first step, train again from step 0 at half "
        "per_device_train_batch_size (down to 1); gradient_accumulation_steps is kept, as HF's.",
    )
    logging_nan_inf_filter: bool = Field(True, description="Leave NaN/Inf losses out of the logged average.")
    include_num_input_tokens_seen: str | bool = Field(
        "no", description="Log the input tokens seen so far: all, non_padding or no (true: all)."
    )
    eval_delay: float = Field(0.0, description="Epochs or steps to wait before the first evaluation.")
    eval_do_concat_batches: bool = Field(
        True, description="Concatenate predictions over batches (not keep a list of batches)."
    )
    eval_use_gather_object: bool = Field(
        False, description="Gather nested Python objects from every rank in evaluation."
    )
    save_only_model: bool = Field(
        False, description="Checkpoints hold the model only, not the optimizer, scheduler and RNG states."
    )
    save_on_each_node: bool = Field(False, description="Save on the main process of every node.")
    enable_jit_checkpoint: bool = Field(False, description="Save a checkpoint on SIGTERM.")
    push_to_hub: bool = Field(False, description="Upload the model to the Hugging Face Hub when it is saved.")
    hub_token: str | None = Field(None, description="The Hub token for uploads.")
    hub_model_id: str | None = Field(None, description="The Hub repository uploads go to.")
    hub_strategy: str = Field(
        "every_save", description="What is uploaded and when: end, every_save, checkpoint, all_checkpoints."
    )
    hub_always_push: bool = Field(False, description="Upload even while the previous upload runs.")
    hub_revision: str | None = Field(None, description="The Hub branch, tag or commit uploads go to.")
    ignore_data_skip: bool = Field(
        False, description="On resume, start the data from its beginning instead of skipping what was seen."
    )
    restore_callback_states_from_checkpoint: bool = Field(
        False, description="On resume, restore the callbacks' states saved in the checkpoint."
    )
    use_cpu: bool = Field(False, description="Train on the CPU even when an accelerator is present.")
    accelerator_config: _DICT = Field(None, description="Accelerate's settings for the Trainer.")
    parallelism_config: _DICT = Field(None, description="Accelerate's parallelism layout.")
    dataloader_multiprocessing_context: str | None = Field(
        None, description="Start method of DataLoader workers: fork, spawn or forkserver."
    )
    dataloader_in_order: bool = Field(
        True, description="Yield batches in the order workers were given them, not as they finish."
    )
    remove_unused_columns: bool = Field(
        True, description="Drop the dataset columns the model's forward does not take."
    )
    train_sampling_strategy: str = Field(
        "random", description="The training sampler: random, sequential, group_by_length, batch_rebalance."
    )
    length_column_name: str = Field(
        "length", description="The column of precomputed lengths for length-grouped sampling."
    )
    ddp_find_unused_parameters: bool | None = Field(None, description="DDP's find_unused_parameters.")
    ddp_bucket_cap_mb: int | None = Field(None, description="DDP's bucket_cap_mb.")
    ddp_broadcast_buffers: bool | None = Field(None, description="DDP's broadcast_buffers.")
    ddp_static_graph: bool | None = Field(None, description="DDP's static_graph.")
    ddp_backend: str | None = Field(None, description="The process group's backend.")
    fsdp: str | None = Field(None, description="PyTorch FSDP and its options.")
    fsdp_config: _DICT = Field(None, description="FSDP's settings.")
    debug: str | list[str] = Field("", description="Debug modes: underflow_overflow, tpu_metrics_debug.")
    skip_memory_metrics: bool = Field(True, description="Leave memory profiling out of the metrics.")

    @field_validator(*REFUSED, *ONLY, mode="wrap")
    @classmethod
    def _refused_unless_default(cls, value: Any, handler: Any, info: Any) -> Any:
        """Set away from HF's default, a field this trainer cannot honour is refused here, while the
        arguments are read: before any data or model loads."""
        name, default = info.field_name, cls.model_fields[info.field_name].default
        try:
            checked = handler(value)
        except ValidationError:
            problem = refusal(name, value, default)  # an invalid value is no default: say why it is refused
            if problem is None:
                raise
            raise ValueError(problem) from None
        problem = refusal(name, checked, default)
        if problem:
            raise ValueError(problem)
        return checked


def hf_fields_doc(args_model: type[BaseModel]) -> str:
    """docs/training.md's account of HF's fields in ``args_model`` (``TrainingArguments``): the
    counts, the refused fields with their reasons, and the defaults that differ from HF's (a test
    keeps the page equal to this)."""
    import dataclasses

    import transformers

    hf_total = sum(1 for f in dataclasses.fields(transformers.TrainingArguments) if f.init)
    refused = sorted(set(REFUSED) | set(ONLY))
    lines = [
        f"Of transformers {transformers.__version__}'s {hf_total} `TrainingArguments` fields, "
        f"{hf_total - len(refused)} are honoured and {len(refused)} are refused when set away from "
        "HF's default. The refused ones:",
        "",
        "| field | accepted | why it is refused otherwise |",
        "|---|---|---|",
    ]
    for name in refused:
        accepted = ONLY[name][0] if name in ONLY else (args_model.model_fields[name].default,)
        reason = ONLY[name][1] if name in ONLY else REFUSED[name]
        shown = " or ".join(f"`{v!r}`" for v in accepted)
        lines.append(f"| `{name}` | {shown} | {_cell(reason)} |")
    lines += ["", "Defaults that differ from HF's:", "", "| field | here | HF's | why |", "|---|---|---|---|"]
    for name, (theirs, why) in OWN_DEFAULTS.items():
        ours = args_model.model_fields[name].get_default(call_default_factory=True)
        lines.append(f"| `{name}` | `{ours!r}` | `{theirs!r}` | {_cell(why)} |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


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
