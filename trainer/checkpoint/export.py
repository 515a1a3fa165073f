"""HF model directories (config, safetensors, tokenizer): every export the trainer writes.

Two sources, one writer. ``export_hf`` writes the live weights a run holds (``Trainer.save_model``).
``export_checkpoint`` is the offline export of a checkpoint directory, in one process: the checkpoint
carries the model's HF config and the tokenizer (or, if written without them, a run config they are
rebuilt from), so nothing but the checkpoint is needed. Its weights come from DeepSpeed's shards
(consolidated to fp32 by DeepSpeed's own ``zero_to_fp32``, through ``trainer.engine.zero``, for ZeRO 1-3, read from the model-states
file for ZeRO-0, joined by the universal conversion where tensor parallelism split them; a
``save_only_model`` checkpoint's from its safetensors). Files are checked against
the manifest first: DeepSpeed's shards are pickles, and only verified files are unpickled.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from trainer.args import RunConfig
from trainer.checkpoint import layout
from trainer.checkpoint.resume import refuse_unconvertible
from trainer.data import get_tokenizer
from trainer.engine.zero import convert_to_universal, fp32_state_dict, universal_state_dict
from trainer.model.modeling import model_config
from trainer.runtime.mesh import saved_mesh
from trainer.runtime.run_files import RUN_CONFIG

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_hf(
    model: torch.nn.Module, state_dict: dict[str, torch.Tensor], tokenizer: Any, out_dir: str | Path
) -> Path:
    """Write an HF model directory of ``model`` with the weights ``state_dict``.

    Files are written into a staging directory first and then moved in one by one, so a crash never
    leaves a truncated weights file, and other contents of ``out_dir`` (e.g. output_dir) are kept.
    """
    if not state_dict:
        raise ValueError(f"{out_dir}: refusing to export an empty state dict")
    out = Path(out_dir)
    tmp = out.parent / f"{layout.STAGING}export-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _save_pretrained(model, tokenizer, tmp, state_dict=state_dict)
    out.mkdir(parents=True, exist_ok=True)
    for file in tmp.iterdir():
        os.replace(file, out / file.name)
    tmp.rmdir()
    return out


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    dtype: str = "fp32",
    max_shard_size: str = "5GB",
    merge: bool = False,
) -> Path:
    """Write an HF model directory of a verified checkpoint's weights, cast to ``dtype``. A LoRA
    checkpoint gives its peft adapter directory, or with ``merge`` the base with the adapters folded in."""
    path = Path(checkpoint)
    if not layout.is_complete(path):
        raise layout.CheckpointError(
            f"{path}: not a complete checkpoint (no {layout.MARKER} marker or manifest)"
        )
    problems = layout.verify(path)
    if problems:
        raise layout.CheckpointError("; ".join(problems))
    config, tokenizer = _model_and_tokenizer(path)
    state = _consolidated_state(path, layout.read_manifest(path))
    run = _run_config(path)
    adapter = run is not None and run.model.use_peft
    if merge and not adapter:
        raise layout.CheckpointError(
            f"{path}: --merge folds LoRA adapters into their base; this run trained no adapters"
        )
    if adapter:
        from trainer.model.lora import apply_lora  # peft is an optional extra

        base = AutoModelForCausalLM.from_pretrained(run.model.model_name_or_path, dtype=torch.float32)
        model = apply_lora(base, run.model.model_copy(update={"load_in_4bit": False}))
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied weights are stored once; anything else missing means the checkpoint does not fit the model.
    missing = [k for k in missing if k not in _tied_keys(model)]
    if missing or unexpected:
        raise layout.CheckpointError(
            f"{path}: weights do not match the model (missing {missing}, unexpected {unexpected})"
        )
    if merge:
        model = model.merge_and_unload()  # peft folds the adapters into the base: a plain HF model
    model = model.to(DTYPES[dtype])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    options = {} if adapter and not merge else {"max_shard_size": max_shard_size}
    _save_pretrained(model, tokenizer, out, **options)
    return out


def _save_pretrained(model: Any, tokenizer: Any, out: Path, **options: Any) -> None:
    """The files of an HF model directory, as both exports write them: safetensors, and the tokenizer
    when there is one. ``options`` go to the model's ``save_pretrained``."""
    model.save_pretrained(out, safe_serialization=True, **options)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def _run_config(path: Path) -> RunConfig | None:
    file = path / RUN_CONFIG
    return RunConfig.from_flat(yaml.safe_load(file.read_text())) if file.is_file() else None


def _model_and_tokenizer(path: Path) -> tuple[Any, Any]:
    """The model config and tokenizer the checkpoint carries (every save writes them for an HF
    model); checkpoints without them are rebuilt from their run config."""
    if (path / "config.json").is_file():
        config = AutoConfig.from_pretrained(path)
        has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        return config, AutoTokenizer.from_pretrained(path) if has_tokenizer else None
    if not (path / RUN_CONFIG).is_file():
        raise layout.CheckpointError(
            f"{path}: neither a model config.json nor a run_config.yaml to rebuild the model from"
        )
    run = _run_config(path)
    tokenizer = get_tokenizer(run.model, run.data)
    return model_config(run.model, tokenizer, run.data.block_size), tokenizer


def _consolidated_state(path: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    if manifest.get("model_only"):  # save_only_model: the whole model's weights in one file
        return {k: v.float() for k, v in load_file(str(path / layout.WEIGHTS)).items()}
    if saved_mesh(manifest).tensor > 1:  # split weights: joined by the universal conversion
        refuse_unconvertible(path)
        with tempfile.TemporaryDirectory() as tmp:
            convert_to_universal(path / layout.DS_TAG, Path(tmp) / layout.DS_TAG)
            return universal_state_dict(Path(tmp) / layout.DS_TAG)
    if manifest.get("zero_stage", 0) == 0:
        saved = torch.load(
            path / layout.DS_TAG / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False
        )
        return {k: v.float() for k, v in saved["module"].items()}
    return fp32_state_dict(path, tag=layout.DS_TAG)


def _tied_keys(model: torch.nn.Module) -> set[str]:
    names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {n for group in names.values() if len(group) > 1 for n in group[1:]}
