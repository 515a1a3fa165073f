"""Run arguments: HF-style ``TrainingArguments`` (and ``Seq2SeqTrainingArguments``); ``RunConfig``,
which groups them with the model and data arguments, is in ``trainer.args.run``.

A run is described by one flat YAML recipe plus ``--field value`` overrides. Every key belongs to
exactly one of the three argument models; an unknown key is an error that names it and suggests the
nearest valid one. No DeepSpeed calls happen here: ``trainer.config.resolve`` turns these arguments
into a DeepSpeed dict.

Where the rest lives: ``args_base.py`` the shared base and value helpers, ``hf_fields.py`` HF's
fields with no implementation here (at HF's defaults, refused when set), ``args_model_data.py`` the
model and data arguments, ``args_hf.py`` HF's helper methods and the dataclass face.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import (
    Field,
    PrivateAttr,
    field_serializer,
    field_validator,
    model_validator,
)

from trainer.args import hf_fields
from trainer.args.base import (
    IN_RUN_CONFIG,
    PRECISION_FIELDS,
    ArgsModel,
    json_object,
    stated_by_deepspeed,
    validation_problems,
)
from trainer.args.hf import HFArgumentHelpers, zero3_init
from trainer.args.model_data import DataArguments, ModelArguments
from trainer.config.files import STATED_ARGUMENTS
from trainer.config.optim import OPTIM_ARGS, optim_params
from trainer.objectives import DEFAULT, NAMES, OBJECTIVES, names_for

__all__ = [
    "PRECISION_FIELDS",
    "REPORT_TO",
    "DataArguments",
    "ModelArguments",
    "Seq2SeqTrainingArguments",
    "TrainingArguments",
    "json_object",
    "stated_by_deepspeed",
    "validation_problems",
]

logger = logging.getLogger(__name__)

Precision = Literal["auto", "fp32", "bf16", "fp16"]
Objective = Literal[NAMES]  # the registry's (trainer/objectives/)
OBJECTIVE_HELP = "; ".join(f"{name}, {entry.summary}" for name, entry in OBJECTIVES.items())
OffloadDevice = Literal["none", "cpu", "nvme"]
Strategy = Literal["no", "steps", "epoch"]
LogLevel = Literal["passive", "debug", "info", "warning", "error", "critical"]
# The integrations report_to can name (transformers' own callbacks drive them; trainer/observe/reporting.py),
# each with the module it needs, in the order HF lists them for "all". Rows always go to
# output_dir/metrics.jsonl as well.
REPORT_TO = {"mlflow": "mlflow", "tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


class TrainingFields(HFArgumentHelpers, ArgsModel):
    """The fields of ``TrainingArguments`` this trainer implements: HF's, with HF's names and
    meanings, and its own; and their validation."""

    #: The objectives this class's fields describe (a preference config names its own).
    OBJECTIVES: ClassVar[tuple[str, ...]] = names_for(f"{__name__}:TrainingArguments")

    output_dir: str = Field("output", description="Where metrics, checkpoints and the final export go.")
    num_train_epochs: float = Field(3.0, gt=0, description="Epochs to train when max_steps is -1.")
    max_steps: int = Field(-1, ge=-1, description="Optimizer steps to train; -1 means use num_train_epochs.")
    seed: int = Field(42, description="Seed for model init, data order and dropout.")

    per_device_train_batch_size: int = Field(8, ge=1, description="Micro-batch size per rank.")
    per_device_eval_batch_size: int = Field(8, ge=1, description="Evaluation batch size per rank.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    dataloader_num_workers: int = Field(0, ge=0, description="DataLoader worker processes per rank.")
    dataloader_drop_last: bool = Field(
        False, description="Drop the last incomplete batch of each rank instead of keeping it."
    )
    dataloader_pin_memory: bool = Field(True, description="Pin the host memory of batches (on GPUs).")
    dataloader_persistent_workers: bool = Field(
        False, description="Keep DataLoader workers alive between epochs (with dataloader_num_workers > 0)."
    )
    dataloader_prefetch_factor: int | None = Field(
        None,
        ge=1,
        description="Batches each DataLoader worker loads ahead (with dataloader_num_workers > 0).",
    )
    data_seed: int | None = Field(
        None, description="Seed of the data order (the sampler's shuffle); default: seed."
    )
    do_train: bool = Field(
        False, description="HF's flag for scripts (whether to train); the Trainer does not read it."
    )
    do_eval: bool = Field(
        False, description="HF's flag for scripts (whether to evaluate); the Trainer does not read it."
    )
    do_predict: bool = Field(
        False, description="HF's flag for scripts (whether to predict); the Trainer does not read it."
    )
    local_rank: int = Field(
        -1, description="Set by launchers; ranks are read from the environment (RANK, LOCAL_RANK)."
    )
    ddp_timeout: int = Field(1800, ge=1, description="Timeout in seconds of the process group's collectives.")
    tf32: bool | None = Field(
        None, description="TF32 matmuls on Ampere and newer GPUs; None keeps torch's default."
    )
    full_determinism: bool = Field(
        False, description="transformers' enable_full_determinism(seed): deterministic kernels, slower."
    )

    optim: Literal[
        "adamw_torch", "adamw_torch_fused", "adamw_fused", "lion", "lion_32bit", "sgd", "lars", "muon"
    ] = Field(
        "adamw_torch",
        description="Optimizer. adamw_torch (and HF's adamw_torch_fused) is DeepSpeed's Adam with torch_adam, "
        "torch's AdamW (resumes bit-exactly); adamw_fused is DeepSpeed's FusedAdam; lion (lion_32bit) and "
        "sgd are DeepSpeed's. Under optimizer offload DeepSpeed steps Adam/AdamW, Adagrad and Lion with its "
        "CPU kernels, and nothing else. lars is ours (DeepSpeed has none): per-matrix trust ratios, exact "
        "under ZeRO 1-3, set by optim_args. muon is ours too: Muon on the hidden matrices and AdamW on "
        "the rest, exact under ZeRO 0-3, set by optim_args (muon_lr, adam_lr, momentum, ...). HF's other "
        "optimizers are refused with the reason.",
    )
    learning_rate: float = Field(5e-5, ge=0, description="Peak learning rate.")
    weight_decay: float = Field(
        0.0, ge=0, description="Decoupled weight decay (not applied to biases and norms)."
    )
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="Adam beta2.")
    adam_epsilon: float = Field(1e-8, gt=0, description="Adam epsilon.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm; 0 disables clipping.")
    lr_scheduler_type: Literal[
        "linear",
        "cosine",
        "constant",
        "constant_with_warmup",
        "cosine_with_restarts",
        "polynomial",
        "inverse_sqrt",
        "cosine_with_min_lr",
        "cosine_warmup_with_min_lr",
        "warmup_stable_decay",
    ] = Field(
        "linear",
        description="Learning-rate schedule, with HF's names and meaning. linear, cosine, constant and "
        "constant_with_warmup run as DeepSpeed's schedulers; the others (and any lr_scheduler_kwargs) as "
        "transformers' get_scheduler.",
    )
    lr_scheduler_kwargs: dict[str, Any] | str | None = Field(  # str: JSON (HF's typing, for its parser)
        default_factory=dict,
        description="Extra arguments of transformers' scheduler, e.g. {min_lr_rate: 0.1} for "
        "cosine_with_min_lr or {num_decay_steps: 100} for warmup_stable_decay.",
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps; overrides warmup_ratio when > 0.")
    warmup_ratio: float = Field(0.0, ge=0, le=1, description="Warmup as a fraction of total steps.")

    logging_steps: int = Field(500, ge=1, description="Log metrics every N optimizer steps.")
    logging_strategy: Strategy = Field(
        "steps",
        description="When to log: steps (every logging_steps), epoch, or no; the last step always logs.",
    )
    logging_first_step: bool = Field(False, description="Also log the first step.")
    log_level: LogLevel = Field(
        "passive",
        description="transformers' log level on the logging process; passive keeps its current one.",
    )
    log_level_replica: LogLevel = Field(
        "warning", description="transformers' log level on the other processes."
    )
    log_on_each_node: bool = Field(
        True, description="Log on the main process of each node, not only of the job."
    )
    prediction_loss_only: bool = Field(
        False, description="evaluate() computes the loss only: no predictions gathered, no compute_metrics."
    )
    label_names: list[str] | None = Field(
        None,
        description="The batch keys holding the labels (predict returns them as label_ids, a tuple for several); "
        "default: the label arguments of the model's forward (labels; start_positions and end_positions "
        "for question answering).",
    )
    include_for_metrics: list[str] = Field(
        default_factory=list,
        description="What compute_metrics also gets: inputs (the model's main input, gathered as the "
        "predictions are), loss (each row's batch loss).",
    )
    batch_eval_metrics: bool = Field(
        False,
        description="Call compute_metrics(EvalPrediction, compute_result) after every evaluation batch, "
        "compute_result true on the last, instead of once over the set: evaluate holds no predictions.",
    )
    eval_accumulation_steps: int | None = Field(
        None,
        ge=1,
        description="Move the predictions kept so far to host memory every N evaluation batches; "
        "default: they stay on the device until the end.",
    )
    eval_on_start: bool = Field(False, description="Evaluate once before the first step.")
    eval_strategy: Strategy = Field("no", description="When to evaluate: no, steps or epoch.")
    eval_steps: int | None = Field(None, ge=1, description="Evaluate every N steps (default: logging_steps).")
    save_strategy: Strategy = Field("steps", description="When to checkpoint: no, steps or epoch.")
    save_steps: int = Field(500, ge=1, description="Checkpoint every N optimizer steps.")
    save_total_limit: int | None = Field(
        None, ge=1, description="Keep at most N checkpoints; never deletes the newest or the best."
    )
    async_save: bool = Field(
        False,
        description=(
            "Checkpoint in the background: the loop waits only for a copy of the state in host "
            "memory (needs that much free RAM); the checkpoint is committed once every rank has written it."
        ),
    )
    snapshot_steps: int = Field(
        0,
        ge=0,
        description="Every N steps, a flash snapshot of the whole training state in host shared memory "
        "(/dev/shm), written in the background: a crashed rank restarted by its launcher resumes from it. 0: off.",
    )
    report_to: list[str] = Field(
        default_factory=list,
        description="Integrations that get the logs besides metrics.jsonl, through transformers' own callbacks: "
        "tensorboard, wandb, mlflow, trackio; none, or all (those installed). Others are refused.",
    )
    run_name: str | None = Field(
        None, description="A descriptor for the run: its name in wandb, mlflow and trackio."
    )
    logging_dir: str | None = Field(
        None,
        description="TensorBoard log directory (default: TENSORBOARD_LOGGING_DIR, else "
        "output_dir/runs/DATETIME_HOSTNAME, as transformers does).",
    )
    project: str = Field("huggingface", description="The trackio project the run is logged to.")
    trackio_space_id: str | None = Field(
        None, description="Hugging Face Space for live trackio logging; None logs locally only."
    )
    trackio_bucket_id: str | None = Field(
        None, description="Hugging Face Bucket for trackio with a Space; None lets trackio choose."
    )
    trackio_static_space_id: str | None | Literal[False] = Field(
        None, description="Static trackio Space made after training; false for none."
    )
    hub_private_repo: bool | None = Field(
        None,
        description="Whether a trackio Space made for the run is private (None: the account's default). "
        "Only trackio reads it: nothing is pushed to the Hub.",
    )
    load_best_model_at_end: bool = Field(False, description="Reload the best checkpoint when training ends.")
    metric_for_best_model: str | None = Field(
        None, description="Metric that ranks checkpoints (default: loss)."
    )
    greater_is_better: bool | None = Field(None, description="Whether a larger metric is better.")
    disable_tqdm: bool = Field(False, description="Hide the progress bar.")

    bf16: bool = Field(False, description="Train in bf16 mixed precision.")
    fp16: bool = Field(False, description="Train in fp16 mixed precision with dynamic loss scaling.")
    precision: Precision = Field(
        "auto",
        description="fp32, bf16, fp16, or auto: bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward to save memory."
    )

    deepspeed: dict[str, Any] | str | None = Field(
        None, description="A DeepSpeed JSON path, a dict, or a preset name (zero2, zero3_offload, ...)."
    )
    resume_from_checkpoint: str | None = Field(
        None,
        description="A checkpoint dir, 'auto' (newest complete one in output_dir; also true), or None (also false).",
    )
    objective: Objective = Field(
        DEFAULT,
        description="What a run of scripts/train.py minimises: "
        + OBJECTIVE_HELP
        + ". Each but causal_lm takes the fields of its TRL config (docs/preference.md).",
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="ZeRO stage when no DeepSpeed config is given.")
    offload_optimizer: OffloadDevice = Field("none", description="Offload optimizer states to cpu or nvme.")
    offload_param: OffloadDevice = Field("none", description="Offload parameters to cpu or nvme (ZeRO-3).")
    nvme_path: str | None = Field(None, description="Directory for NVMe offload.")
    pipeline_parallel_size: int = Field(1, ge=1, description="Pipeline stages (ZeRO stage 0 or 1 only).")
    sequence_parallel_size: int = Field(
        1,
        ge=1,
        description="Ulysses sequence parallelism: ranks that split each sequence (world = this × data parallel).",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="AutoTP tensor parallelism: ranks that split each layer's matrices and read the same rows "
        "(world = this × data parallel).",
    )
    expert_parallel_size: int = Field(
        1,
        ge=1,
        description="AutoEP expert parallelism: data-parallel ranks that split each mixture-of-experts layer's "
        "experts (docs/moe.md); it divides the data-parallel size.",
    )
    tiled_loss: Literal["auto", "true", "false"] = Field(
        "auto",
        description="The LM loss in token tiles, never the whole logits tensor: auto (when one micro-batch's fp32 "
        "logits pass 256 MiB), true or false.",
    )
    tiled_mlp: bool = Field(False, description="Run each decoder MLP over the sequence in tiles.")
    offload_activations: bool = Field(
        False,
        description="Keep tensors saved for backward (with gradient_checkpointing, each layer's input) on the CPU.",
    )
    tile_tokens: int = Field(0, ge=0, description="Tokens per tile of tiled_loss and tiled_mlp; 0 chooses.")
    peak_tflops: float | None = Field(
        None, gt=0, description="Device peak TFLOP/s for MFU when not in the table."
    )

    hang_timeout_s: float = Field(
        1800.0, gt=0, description="A collective phase (init, save, load, eval) slower than this is a hang."
    )
    preemption_grace_s: float = Field(
        120.0, gt=0, description="Time allowed for the checkpoint saved on SIGTERM/SIGUSR1."
    )
    nonfinite_policy: Literal["skip", "rollback", "stop"] = Field(
        "stop",
        description="On a NaN/Inf loss or grad norm: skip (the optimizer's overflow check drops the step; "
        "not ZeRO-0 in fp32), rollback (reload the last checkpoint, lower the learning rate) or stop.",
    )
    nonfinite_lr_factor: float = Field(0.5, gt=0, le=1, description="Learning-rate factor on each rollback.")
    nonfinite_max_rollbacks: int = Field(3, ge=0, description="Rollbacks allowed before the run stops.")
    save_failure_policy: Literal["stop", "continue"] = Field(
        "stop",
        description="When a checkpoint cannot be written (a full disk, a rank's write error; its partial files "
        "are removed, complete checkpoints kept): stop (exit code 74) or continue training and try the next save.",
    )
    label_smoothing_factor: float = Field(0.0, ge=0, le=1, description="Label smoothing; 0: none.")
    router_aux_loss_coef: float | None = Field(
        None,
        ge=0,
        description="Weight of a mixture-of-experts model's router load-balancing loss (docs/moe.md); "
        "None: the model config's router_aux_loss_coef; 0: off.",
    )
    neftune_noise_alpha: float | None = Field(None, gt=0, description="NEFTune's noise on input embeddings.")
    torch_empty_cache_steps: int | None = Field(None, ge=1, description="Empty GPU cache every N steps.")
    eval_delay: float = Field(0.0, ge=0, description="Epochs or steps (eval_strategy) before evaluating.")
    save_only_model: bool = Field(False, description="Checkpoints hold only the weights (no resume).")
    restore_callback_states_from_checkpoint: bool = Field(False, description="Resume callback states.")
    train_sampling_strategy: Literal["random", "sequential", "group_by_length"] = Field(
        "random", description="Training order: random, sequential, or group_by_length (length_column_name)."
    )
    length_column_name: str = Field("length", description="Column of lengths for group_by_length.")
    torch_compile: bool = Field(False, description="Compile the model (torch.compile, via DeepSpeed).")
    torch_compile_backend: str | None = Field(None, description="torch.compile's backend (inductor).")
    torch_compile_mode: str | None = Field(None, description="torch.compile's mode (max-autotune, ...).")
    use_liger_kernel: bool = Field(False, description="Liger's Triton kernels in the model (GPUs).")
    liger_kernel_config: dict[str, bool] | None = Field(None, description="Options of Liger's kernels.")
    include_num_input_tokens_seen: str | bool = Field(
        "no", description="Log tokens seen: all/non_padding/no."
    )
    log_data_fingerprint: bool = Field(
        False,
        description="Each logged step's metrics row carries data_fingerprint: a hash of its global batch's "
        "tokens (each row with its place in the batch), the same on any number of ranks.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_deepspeed_config(cls, data: Any) -> Any:
        """Fields left unset take the values the DeepSpeed config states, as users of
        ``--deepspeed my.json`` expect; a field that is set must agree with it (``resolve`` checks)."""
        if not isinstance(data, dict) or data.get("deepspeed") is None:
            return data
        precision_set = any(k in data for k in PRECISION_FIELDS)
        if precision_set and all(k in data for k in STATED_ARGUMENTS):
            return data  # nothing left unset (an assignment validates every field): no file to read
        stated = stated_by_deepspeed(data["deepspeed"])
        if precision_set:
            stated = {k: v for k, v in stated.items() if k not in PRECISION_FIELDS}
        return {**stated, **data}

    @field_validator("optim", "lr_scheduler_type", mode="before")
    @classmethod
    def _hf_names_we_refuse(cls, value: Any, info: Any) -> Any:
        """HF's names that have no DeepSpeed counterpart here: one line saying why and what to use."""
        refused = hf_fields.REFUSED_OPTIMIZERS if info.field_name == "optim" else hf_fields.REFUSED_SCHEDULERS
        for prefix, reason in refused.items():
            if isinstance(value, str) and value.startswith(prefix):
                raise ValueError(f"{value!r}: {reason}")
        return value

    @field_validator("lr_scheduler_kwargs", mode="before")
    @classmethod
    def _kwargs_json(cls, value: Any) -> Any:
        return json_object(value)

    @field_validator("resume_from_checkpoint", mode="before")
    @classmethod
    def _resume_switch(cls, value: Any) -> Any:
        # true means the newest complete checkpoint, false none: as a bool (a recipe) or a word (HF's parser).
        switch = {"true": "auto", "false": None}.get(str(value).lower(), value)
        return switch if isinstance(value, bool | str) else value

    @field_validator("include_num_input_tokens_seen")
    @classmethod
    def _tokens_seen(cls, value: str | bool) -> str:
        """HF's values: all (every input id), non_padding or no; true is all and false no, as HF maps them."""
        value = {True: "all", False: "no"}.get(value, value) if isinstance(value, bool) else value
        if value not in ("all", "non_padding", "no"):
            raise ValueError(f"{value!r}: choose all, non_padding or no (true: all, false: no)")
        return value

    @field_validator("tiled_loss", mode="before")
    @classmethod
    def _tiled_switch(cls, value: Any) -> Any:
        return str(value).lower() if isinstance(value, bool) else value

    @field_validator("eval_strategy", "save_strategy", "logging_strategy", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `no` in a recipe as False.
        return "no" if value is False else value

    @field_validator("include_for_metrics")
    @classmethod
    def _metric_inputs(cls, value: list[str]) -> list[str]:
        unknown = [repr(v) for v in value if v not in ("inputs", "loss")]
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: include_for_metrics takes inputs and loss")
        return value

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, value: Any) -> Any:
        # HF's spellings: one name or a list, "none" for no sink, "all" for every sink there is.
        if value is None:
            return []
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list | tuple):
            return value  # pydantic reports the wrong type
        if list(names) == ["none"]:
            return []
        if "none" in names:
            raise ValueError(f"{list(names)}: 'none' cannot be combined with an integration")
        unknown = [repr(n) for n in names if n not in REPORT_TO and n != "all"]
        if unknown:
            verb = "is" if len(unknown) == 1 else "are"
            raise ValueError(
                f"{', '.join(unknown)} {verb} not supported; supported: {', '.join(REPORT_TO)}, none, "
                "all (those installed)"
            )
        if "all" in names:  # as HF: every integration whose package is installed
            installed = [n for n, module in REPORT_TO.items() if importlib.util.find_spec(module) is not None]
            names = [n for name in names for n in (installed if name == "all" else [name])]
        return list(dict.fromkeys(names))

    @model_validator(mode="before")
    @classmethod
    def _best_model_defaults(cls, data: Any) -> Any:
        """HF's defaults: load_best_model_at_end ranks by loss, and a metric not ending in "loss" is
        one where greater is better."""
        if not isinstance(data, dict):
            return data
        if data.get("load_best_model_at_end") and data.get("metric_for_best_model") is None:
            data = {**data, "metric_for_best_model": "loss"}
        metric = data.get("metric_for_best_model")
        if data.get("greater_is_better") is None and isinstance(metric, str):
            data = {**data, "greater_is_better": not metric.endswith("loss")}
        return data

    @model_validator(mode="after")
    def _objective_fits(self) -> TrainingFields:
        if self.objective not in self.OBJECTIVES:
            raise ValueError(
                f"objective: {self.objective} is not what {type(self).__name__} trains "
                f"({', '.join(self.OBJECTIVES)}); scripts/train.py and RunConfig pick the class from it"
            )
        return self

    @model_validator(mode="after")
    def _optim_args_read(self) -> TrainingFields:
        optim_args = getattr(self, "optim_args", None)  # HF's field (TrainingArguments)
        if self.optim in OPTIM_ARGS:
            optim_params(self.optim, optim_args)
        elif optim_args:
            raise ValueError(
                f"optim_args: read by optim {' and '.join(OPTIM_ARGS)} only; {self.optim} takes adam_beta1, "
                "adam_beta2, adam_epsilon, weight_decay or a --deepspeed file's optimizer.params"
            )
        return self

    @model_validator(mode="after")
    def _precision_flags(self) -> TrainingFields:
        if self.bf16 and self.fp16:
            raise ValueError("bf16, fp16: both enabled; choose one")
        flag = "bf16" if self.bf16 else "fp16" if self.fp16 else None
        if flag and self.precision not in ("auto", flag):
            raise ValueError(f"precision, {flag}: precision={self.precision} contradicts {flag}=true")
        return self

    @model_validator(mode="after")
    def _tile_size_needs_tiling(self) -> TrainingFields:
        if self.tile_tokens and self.tiled_loss == "false" and not self.tiled_mlp:
            raise ValueError(
                "tile_tokens, tiled_loss, tiled_mlp: a tile size with nothing tiled (tiled_loss false, "
                "tiled_mlp false) would be ignored; turn one of them on, or drop tile_tokens"
            )
        return self

    @model_validator(mode="after")
    def _best_model_is_checkpointed(self) -> TrainingFields:
        """As HF's: the best model is reloaded from the checkpoint saved when it was evaluated, so
        checkpoints must be saved at evaluations."""
        if not self.load_best_model_at_end:
            return self
        if self.eval_strategy != self.save_strategy:
            raise ValueError(
                f"load_best_model_at_end, eval_strategy, save_strategy: eval_strategy={self.eval_strategy} "
                f"and save_strategy={self.save_strategy} must match (the best model is reloaded from a "
                "checkpoint saved when it was evaluated)"
            )
        eval_every = self.eval_steps or self.logging_steps
        if self.save_strategy == "steps" and self.save_steps % eval_every:
            raise ValueError(
                f"load_best_model_at_end, save_steps: {self.save_steps} is not a multiple of the "
                f"evaluation interval ({eval_every})"
            )
        return self

    @property
    def requested_precision(self) -> Precision:
        """The precision asked for: the HF-style flags win over the ``precision`` field's default."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else self.precision


class TrainingArguments(hf_fields.HFFields, TrainingFields):
    """HF's ``TrainingArguments``: every HF field at HF's default (those with no implementation here
    from ``hf_fields.HFFields``, after ours in ``to_dict`` and ``--help``), plus this trainer's own."""

    _hf_deepspeed: Any = PrivateAttr(None)

    def __init__(self, /, **data: Any) -> None:
        """Built in code or by HfArgumentParser, under ZeRO-3 a script's model is then built
        partitioned, as with HF's. Not as part of a ``RunConfig``: a run builds its model itself."""
        super().__init__(**data)
        if not IN_RUN_CONFIG.get():
            self._hf_deepspeed = zero3_init(self)


class Seq2SeqTrainingArguments(TrainingArguments):
    """HF's ``Seq2SeqTrainingArguments``: the training arguments plus how evaluation generates. The
    values are kept as given, for the Trainer's generation to read."""

    sortish_sampler: bool = Field(False, description="Sample batches of similar lengths, roughly sorted.")
    predict_with_generate: bool = Field(
        False, description="Evaluate and predict with generate(), for metrics such as ROUGE and BLEU."
    )
    generation_max_length: int | None = Field(
        None, ge=1, description="max_length of generate() in evaluation; None: the model's generation config."
    )
    generation_num_beams: int | None = Field(
        None, ge=1, description="num_beams of generate() in evaluation; None: the model's generation config."
    )
    # Any: a transformers GenerationConfig object, kept as it is (this module does not import transformers).
    generation_config: str | Path | Any | None = Field(
        None, description="A GenerationConfig, or a model id or directory that holds one, for predictions."
    )

    @field_serializer("generation_config", when_used="json")
    def _generation_config_json(self, value: Any) -> Any:
        """A GenerationConfig object as its dict, as HF's ``to_dict`` writes it."""
        return value.to_dict() if hasattr(value, "to_dict") else value
