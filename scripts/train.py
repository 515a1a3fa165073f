"""Launcher entry point: ``deepspeed [--num_gpus N] scripts/train.py [--config R.yaml] [--field value ...]``.

Also runs under torchrun, ``accelerate launch`` and plain python. With no arguments it trains the
embedded default: a small Llama-style model on the Python standard library source, resuming from
the newest complete checkpoint in output_dir if there is one. A preference objective
(``--objective dpo``, ``orpo``, ``cpo`` or ``simpo``) starts from TRL's defaults instead of that
recipe, whose learning rate and length are the pretraining job's.
"""

import sys
from pathlib import Path

from trainer.cli.main import run_then_exit
from trainer.cli.train import main

DEFAULT_RECIPE = Path(__file__).parent / "recipes" / "default.yaml"


def flag(argv: list[str], name: str) -> str | None:
    """The value ``--name`` has in ``argv`` (``--name v`` or ``--name=v``); None when it is absent."""
    for i, arg in enumerate(argv):
        if arg == f"--{name}":
            return argv[i + 1] if i + 1 < len(argv) else ""
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    return None


if __name__ == "__main__":
    argv = sys.argv[1:]
    if flag(argv, "config") is None and flag(argv, "objective") in (None, "causal_lm"):
        argv = ["--config", str(DEFAULT_RECIPE), *argv]
    if flag(argv, "resume_from_checkpoint") is None:
        argv = [*argv, "--resume_from_checkpoint", "auto"]
    run_then_exit(main, argv, prog="scripts/train.py")
