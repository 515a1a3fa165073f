"""``trainer ds-config``: write the presets, generate one config, validate a file, write the reference."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.args import RunConfig, TrainingArguments
from trainer.args.recipe import load_recipe
from trainer.config import ConfigError, generate, load_deepspeed_json, write_presets
from trainer.config.presets import dump_json, stale_presets
from trainer.config.reference import render_reference
from trainer.config.resolution import resolve_json

DEFAULT_PRESET_DIR = "ds_configs"
DEFAULT_REFERENCE = "docs/config.md"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    presets = sub.add_parser("presets", help="write every preset to ds_configs/<preset>_<precision>.json")
    presets.add_argument("--out-dir", default=DEFAULT_PRESET_DIR, help="directory (default: ds_configs)")
    presets.add_argument("--check", action="store_true", help="write nothing; exit 1 if the files differ")

    gen = sub.add_parser("generate", help="print or write one DeepSpeed config")
    gen.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], required=True)
    gen.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    gen.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default="none")
    gen.add_argument("--offload-param", choices=["none", "cpu", "nvme"], default="none")
    gen.add_argument("--nvme-path", help="directory on a local NVMe drive (for nvme offload)")
    gen.add_argument("--micro-batch", type=_positive, required=True, help="train_micro_batch_size_per_gpu")
    gen.add_argument("--grad-accum", type=_positive, default=1, help="gradient_accumulation_steps")
    gen.add_argument("--world-size", type=_positive, help="data-parallel ranks; adds train_batch_size")
    gen.add_argument("--hidden-size", type=_positive, help="model hidden size; sizes the ZeRO-3 buckets")
    gen.add_argument("--gradient-clipping", type=float, default=1.0)
    gen.add_argument("-o", "--output", help="write here instead of printing")

    val = sub.add_parser("validate", help="check a DeepSpeed JSON; exit 1 listing every problem")
    val.add_argument("file")
    val.add_argument(
        "--world-size", type=_positive, default=1, help="ranks the config will run on (default 1)"
    )
    val.add_argument("--config", help="a run recipe (YAML): check against its training arguments")
    val.add_argument(
        "--hidden-size", type=_positive, help='model hidden size, for ZeRO-3 bucket sizes given as "auto"'
    )
    val.add_argument("--resolved", action="store_true", help='print the config with every "auto" resolved')

    ref = sub.add_parser("reference", help="write the config reference generated from the schema")
    ref.add_argument("-o", "--output", default=DEFAULT_REFERENCE, help="default: docs/config.md")
    ref.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file differs")


def run(args: argparse.Namespace) -> int:
    action = {"presets": _presets, "generate": _generate, "validate": _validate, "reference": _reference}
    try:
        return action[args.action](args)
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 1


def _presets(args: argparse.Namespace) -> int:
    defaults = TrainingArguments()  # the files carry the default batch sizes and clipping
    if args.check:
        stale = stale_presets(args.out_dir, defaults)
        for line in stale:
            print(line, file=sys.stderr)
        if stale:
            print("regenerate with: trainer ds-config presets", file=sys.stderr)
        return 1 if stale else 0
    for path in write_presets(args.out_dir, defaults):
        print(path)
    return 0


def _generate(args: argparse.Namespace) -> int:
    config = generate(
        zero_stage=args.zero_stage,
        precision=args.precision,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        world_size=args.world_size,
        offload_optimizer=args.offload_optimizer,
        offload_param=args.offload_param,
        nvme_path=args.nvme_path,
        gradient_clipping=args.gradient_clipping,
        hidden_size=args.hidden_size,
    )
    text = dump_json(config)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    return 0


def _count_autos(node: object) -> int:
    if isinstance(node, dict):
        return sum(_count_autos(v) for v in node.values())
    return int(isinstance(node, str) and node.strip().lower() == "auto")


def _validate(args: argparse.Namespace) -> int:
    data = load_deepspeed_json(args.file)
    # Without a recipe, "auto" comes from the default arguments and nothing is compared.
    run = RunConfig.from_flat(load_recipe(args.config)) if args.config else TrainingArguments()
    try:
        resolved = resolve_json(
            data,
            run,
            world_size=args.world_size,
            hidden_size=args.hidden_size,
            compare=bool(args.config),
        )
    except ConfigError as err:
        count = len(err.problems)
        print(f"{args.file}: {count} problem{'s' if count != 1 else ''}", file=sys.stderr)
        print(str(err), file=sys.stderr)
        return 1
    autos = _count_autos(data)
    against = f"the training arguments of {args.config}" if args.config else "the default training arguments"
    note = f'; {autos} "auto" value{"s" if autos != 1 else ""} resolved from {against}' if autos else ""
    print(f"{args.file}: valid at world size {args.world_size}{note}")
    if args.resolved:
        sys.stdout.write(dump_json(resolved))
    return 0


def _reference(args: argparse.Namespace) -> int:
    text = render_reference()
    path = Path(args.output)
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(
                f"{path}: out of date; regenerate with: trainer ds-config reference -o {path}",
                file=sys.stderr,
            )
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return 0
