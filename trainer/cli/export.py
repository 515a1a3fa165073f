"""``trainer export CHECKPOINT_DIR OUT_DIR [--dtype bf16|fp16|fp32] [--merge]``: a checkpoint to an HF
model directory (a LoRA run's: its adapter, or with ``--merge`` the base with the adapters folded in)."""

from __future__ import annotations

import argparse
import sys

from trainer.config.errors import ConfigError
from trainer.runtime.import_guard import heavy_imports


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a complete checkpoint-<step> directory")
    parser.add_argument("out", help="the HF model directory to write")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="weights dtype")
    parser.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (HF notation)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="LoRA checkpoints: fold the adapters into the base (a full model)",
    )


def run(args: argparse.Namespace) -> int:
    with heavy_imports():  # torch, transformers and DeepSpeed load here, not for --help
        from trainer.checkpoint import CheckpointError
        from trainer.checkpoint.export import export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out, args.dtype, args.max_shard_size, args.merge)
    except (CheckpointError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"Exported {args.checkpoint} to {out}")
    return 0
