"""Named presets (zero0 ... zero3_nvme) for each precision, and the files in ``ds_configs/``.

A preset fixes the ZeRO stage and offload. The precision block, batch sizes and the rest come
from the run when a preset is used by name (``deepspeed: zero3``); the files written to
``ds_configs/`` carry the batch sizes and clipping of the training arguments the caller passes (the
defaults, ``TrainingArguments()``) so DeepSpeed can read them on their own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from trainer.config.arguments import TrainingArgs
from trainer.config.schema import validate

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16", "fp16")

# Dynamic loss scaling as DeepSpeed and HF document it.
FP16_BLOCK = {
    "enabled": True,
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}
# Written into the zero3_nvme files; point it at a directory on a local NVMe drive.
NVME_PLACEHOLDER = "/local_nvme"
AIO_BLOCK = {
    "block_size": 1_048_576,
    "queue_depth": 8,
    "intra_op_parallelism": 1,
    "single_submit": False,
    "overlap_events": True,
}


@dataclass(frozen=True)
class Preset:
    name: str
    stage: int
    offload_optimizer: str
    offload_param: str
    summary: str


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("zero0", 0, "none", "none", "plain data parallelism; every rank holds everything"),
        Preset("zero1", 1, "none", "none", "optimizer states partitioned"),
        Preset("zero2", 2, "none", "none", "optimizer states and gradients partitioned"),
        Preset("zero3", 3, "none", "none", "optimizer states, gradients and parameters partitioned"),
        Preset("zero2_offload", 2, "cpu", "none", "ZeRO-2 with optimizer states and step on the CPU"),
        Preset("zero3_offload", 3, "cpu", "cpu", "ZeRO-3 with optimizer states and parameters on the CPU"),
        Preset("zero3_nvme", 3, "nvme", "nvme", "ZeRO-Infinity: optimizer states and parameters on NVMe"),
    )
}


def zero_section(
    stage: int, offload_optimizer: str = "none", offload_param: str = "none", nvme_path: str | None = None
) -> dict[str, Any]:
    """The ``zero_optimization`` block for a stage and offload choice."""
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 2:
        # Overlapping the reduction with backward is what makes stage 2/3 pay off; DeepSpeed turns it
        # on by default only for stage 3.
        zero.update(overlap_comm=True, contiguous_gradients=True)
    if stage == 3:
        # Without it save_16bit_model writes nothing under ZeRO-3.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    for key, device in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if device != "none":
            block: dict[str, Any] = {"device": device, "pin_memory": True}
            if device == "nvme" and nvme_path:
                block["nvme_path"] = nvme_path
            zero[key] = block
    return zero


def precision_sections(precision: str) -> dict[str, Any]:
    if precision == "bf16":
        return {"bf16": {"enabled": True}}
    if precision == "fp16":
        return {"fp16": dict(FP16_BLOCK)}
    return {}


def preset_base(name: str, nvme_path: str | None = None) -> dict[str, Any]:
    """The sections a preset fixes (ZeRO and async I/O), without batch sizes or precision."""
    preset = PRESETS[name]
    data: dict[str, Any] = {
        "zero_optimization": zero_section(
            preset.stage, preset.offload_optimizer, preset.offload_param, nvme_path
        )
    }
    if "nvme" in (preset.offload_optimizer, preset.offload_param):
        data["aio"] = dict(AIO_BLOCK)
    return data


def preset_config(name: str, precision: Precision, args: TrainingArgs) -> dict[str, Any]:
    """A complete preset as written to ``ds_configs/<name>_<precision>.json``, with the batch sizes
    and clipping of ``args`` (the files carry the defaults: ``TrainingArguments()``)."""
    data: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "gradient_clipping": args.max_grad_norm,
        **precision_sections(precision),
        **preset_base(name, NVME_PLACEHOLDER),
    }
    return validate(data).to_dict()


def preset_files(args: TrainingArgs) -> dict[str, dict[str, Any]]:
    """File name -> config, for every preset and precision."""
    return {
        f"{name}_{precision}.json": preset_config(name, precision, args)
        for name in PRESETS
        for precision in PRECISIONS
    }


def dump_json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2) + "\n"


def write_presets(out_dir: str | Path, args: TrainingArgs) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, data in preset_files(args).items():
        path = out / file_name
        path.write_text(dump_json(data))
        written.append(path)
    return written


def stale_presets(out_dir: str | Path, args: TrainingArgs) -> list[str]:
    """Files in ``out_dir`` that differ from what ``write_presets`` would write, or should not be there."""
    out = Path(out_dir)
    expected = {name: dump_json(data) for name, data in preset_files(args).items()}
    problems = []
    for name, text in expected.items():
        path = out / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.read_text() != text:
            problems.append(f"{path}: differs from the schema's preset")
    for path in sorted(out.glob("*.json")):
        if path.name not in expected:
            problems.append(f"{path}: not a preset")
    return problems
