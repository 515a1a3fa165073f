"""``trainer train [--config R.yaml] [--field value ...]``: the same as scripts/train.py."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("fields", nargs=argparse.REMAINDER, help="--config FILE and --field value pairs")


def run(args: argparse.Namespace) -> int:
    from trainer.run import main

    return main(args.fields)
