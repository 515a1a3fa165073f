"""The resolver's optimizer rules: ``optim`` and a DeepSpeed file's ``optimizer`` section into one
concrete section, filled from the training arguments, and what our own optimizers (LARS, Muon: built
by the engine and handed to DeepSpeed) cannot run with, refused by key."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.config.base import ARGS_NOTE, Problem, show_value
from trainer.config.files import MISSING, get_path, is_auto
from trainer.config.optim import OPTIMIZER_PARAMS, ZERO_TESTED_OPTIMIZERS, MuonParams, optim_params
from trainer.config.parallel import tensor_size_of
from trainer.config.precision import normalise_dtype

if TYPE_CHECKING:
    from trainer.config.arguments import TrainingArgs

# TrainingArguments.optim -> (optimizer type, extra params)
OPTIMIZERS = {
    "adamw_torch": ("Adam", {"torch_adam": True}),
    "adamw_torch_fused": ("Adam", {"torch_adam": True}),  # torch's AdamW; fused is its kernel choice
    "adamw_fused": ("Adam", {}),
    "lion": ("Lion", {}),
    "lion_32bit": ("Lion", {}),
    "sgd": ("SGD", {}),
    "muon": ("Muon", {}),
}


class OptimizerRules:
    """Mixed into the resolver, whose fields and ``settle`` these rules use."""

    args: TrainingArgs
    data: dict[str, Any]
    problems: list[Problem]

    def optimizer(self) -> None:
        a = self.args
        offload = get_path(self.data, "zero_optimization.offload_optimizer.device") in ("cpu", "nvme")
        if a.optim == "lars":
            return self.lars(offload)
        opt_type, extra = OPTIMIZERS[a.optim]
        if offload:
            extra = {}  # CPU offload runs DeepSpeed's CPU Adam; torch_adam would bypass it
        if get_path(self.data, "optimizer") is MISSING:
            self.data["optimizer"] = {"type": opt_type, "params": dict(extra)}
            stage = get_path(self.data, "zero_optimization.stage")
            if isinstance(stage, int) and stage >= 1 and opt_type not in ZERO_TESTED_OPTIMIZERS:
                self.data["zero_allow_untested_optimizer"] = True
        have = get_path(self.data, "optimizer.type")
        # DeepSpeed runs both Adam and AdamW in AdamW mode unless adam_w_mode is false.
        same = {"adam", "adamw"} if opt_type == "Adam" else {opt_type.lower()}
        if is_auto(have) or (self.explicit("optim") and isinstance(have, str) and have.lower() not in same):
            self.settle_arg("optimizer.type", "optim", opt_type)
        model = OPTIMIZER_PARAMS.get(str(get_path(self.data, "optimizer.type")))
        if model is None:
            return  # an unknown type: the schema names it
        wants = {
            "lr": ("learning_rate", a.learning_rate),
            "betas": ("adam_beta1, adam_beta2", [a.adam_beta1, a.adam_beta2]),
            "eps": ("adam_epsilon", a.adam_epsilon),
            "weight_decay": ("weight_decay", a.weight_decay),
        }
        for key, (arg, want) in wants.items():
            if key in model.model_fields:
                self.settle(f"optimizer.params.{key}", want, f"{arg}={show_value(want)} {ARGS_NOTE}")
        if model is MuonParams:
            self.muon(offload)

    def lars(self, offload: bool) -> None:
        """optim lars: the engine builds our LARS (DeepSpeed has none) and hands it to DeepSpeed."""
        if get_path(self.data, "optimizer") is not MISSING:
            self.problems.append(("optimizer, optim", "optim lars is built here (DeepSpeed has no LARS); remove "
                                  "the optimizer section or choose another optim"))  # fmt: skip
        self.ours("LARS", "optim", offload, "LARS's trust ratio needs each matrix's whole norm")

    def muon(self, offload: bool) -> None:
        """Muon (optim muon, or a file's Muon section): the engine builds ours from this section (see
        trainer/engine/muon.py) and hands it to DeepSpeed; optim_args fill its own settings."""
        if self.args.optim == "muon":
            for key, value in optim_params("muon", getattr(self.args, "optim_args", None)).items():
                self.settle(
                    f"optimizer.params.{key}", value, f"optim_args {key}={show_value(value)} {ARGS_NOTE}"
                )
        if get_path(self.data, "scheduler.type") in ("WarmupLR", "WarmupDecayLR"):
            self.problems.append(("scheduler.type, optimizer.type", "DeepSpeed's WarmupLR and WarmupDecayLR set "
                                  "one rate for all groups, and Muon's halves have two; use WarmupCosineLR or leave "
                                  "the schedule to lr_scheduler_type"))  # fmt: skip
        self.ours("Muon", "optimizer.type", offload, "Muon orthogonalises each whole matrix")

    def ours(self, name: str, key: str, offload: bool, whole: str) -> None:
        """What an optimizer of ours (built by the engine and handed to DeepSpeed, stepping whole
        parameters from ZeRO's flat slices) cannot run with, refused naming ``key``."""
        stage = get_path(self.data, "zero_optimization.stage")
        device = get_path(self.data, "zero_optimization.offload_optimizer.device")
        forced = get_path(self.data, "zero_force_ds_cpu_optimizer") is True
        # DeepSpeed's BF16_Optimizer: flat fp32 slices of its own, whose parameters' places it does not tell
        bf16_optimizer = (
            stage == 1
            and get_path(self.data, "bf16.enabled") is True
            and normalise_dtype(get_path(self.data, "data_types.grad_accum_dtype")) == "fp32"
            and not offload
        )
        refusals = [
            (device == "nvme", f"zero_optimization.offload_optimizer.device, {key}",
             f"NVMe offload swaps Adam's moments; {name} steps from host memory (offload_optimizer cpu)"),
            (offload and forced, f"zero_force_ds_cpu_optimizer, {key}",
             f"true refuses every optimizer but DeepSpeed's CPU Adam and Lion under offload; {name} is ours"),
            (tensor_size_of(self.data) > 1, f"tensor_parallel.autotp_size, {key}",
             f"{whole}, which AutoTP splits over ranks"),
            (int((self.data.get("pipeline") or {}).get("stages") or 1) > 1, f"pipeline.stages, {key}",
             f"pipeline stages build their optimizer from DeepSpeed's config, which has no {name} of ours"),
            (bf16_optimizer, f"data_types.grad_accum_dtype, {key}",
             f"fp32 at ZeRO-1 in bf16 puts {name} behind DeepSpeed's BF16_Optimizer, whose flat slices hide the "
             "parameters' shapes; leave it unset, or use ZeRO 0 or 2-3"),
        ]  # fmt: skip
        self.problems.extend((path, why) for on, path, why in refusals if on)
        if isinstance(stage, int) and stage >= 1:
            self.data["zero_allow_untested_optimizer"] = True
        if offload:  # ZeRO-Offload steps it on the host, as it does torch's SGD
            self.data["zero_force_ds_cpu_optimizer"] = False
