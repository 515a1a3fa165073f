"""Launcher entry point: ``deepspeed [--num_gpus N] scripts/train.py [--config R.yaml] [--field value ...]``.

Also runs under torchrun, ``accelerate launch`` and plain python. With no arguments it trains the
embedded default: a small Llama-style model on the Python standard library source, resuming from
the newest complete checkpoint in output_dir if there is one.
"""

import sys
from pathlib import Path

from trainer.cli.train import main

DEFAULT_RECIPE = Path(__file__).parent / "recipes" / "default.yaml"

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = ["--config", str(DEFAULT_RECIPE), *argv]
    if not any(a == "--resume_from_checkpoint" or a.startswith("--resume_from_checkpoint=") for a in argv):
        argv = [*argv, "--resume_from_checkpoint", "auto"]
    sys.exit(main(argv, prog="scripts/train.py"))
