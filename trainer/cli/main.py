"""``trainer <subcommand>``: dispatch to the subcommand modules, importing only the one used, and end
the process of a command once it is done (``exit_now``)."""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys
from collections.abc import Callable
from contextlib import suppress
from typing import Any, NoReturn

# name -> (module, one-line help). Each module defines add_arguments(parser) and run(args) -> int,
# or sets RAW_ARGV and defines main(argv) -> int to parse its own arguments.
SUBCOMMANDS = {
    "train": ("trainer.cli.train", "train a model (same flags as scripts/train.py)"),
    "ds-config": ("trainer.cli.ds_config", "generate, validate and write DeepSpeed configs"),
    "plan": ("trainer.cli.plan", "plan memory per GPU for each ZeRO stage and offload"),
    "export": ("trainer.cli.export", "export a checkpoint to an HF model directory"),
    "plot": ("trainer.cli.plot", "plot metrics of one or more runs"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="trainer", description="DeepSpeed-based LLM trainer")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if argv and argv[0] in SUBCOMMANDS:
        # Only import the subcommand that runs: the config tools must not pay for torch.
        name = argv[0]
        module = importlib.import_module(SUBCOMMANDS[name][0])
        if getattr(module, "RAW_ARGV", False):
            return int(module.main(argv[1:]) or 0)
        module.add_arguments(sub.add_parser(name, help=SUBCOMMANDS[name][1]))
    else:
        for name, (_, help_text) in SUBCOMMANDS.items():
            sub.add_parser(name, help=help_text)
    args = parser.parse_args(argv)
    return int(module.run(args) or 0)


def exit_now(code: int | str | None = 0) -> NoReturn:
    """End a command's process once its work is done: the exit handlers run (the process group is
    left, the reporting integrations and logging flush), then the process ends without the
    interpreter's finalization. ``code`` is read as ``SystemExit`` reads it (None is 0; a message is
    printed and exits 1).

    Finalization frees every object left alive in arbitrary order, and a thread that asks for the
    GIL meanwhile is ended inside C++: with gloo groups created (some still referenced by DeepSpeed
    after the group is left) it was seen to abort a rank that had finished its run ("terminate
    called without an active exception", exit -6; docs/fault-tolerance.md says how). It also
    walks millions of module-level objects, 3-4 s on 2 cores that every launch would pay. Only a
    process's entry point calls this; a user's own script keeps Python's usual shutdown, and an
    uncaught exception still ends a process the usual way.
    """
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):
            stream.flush()
    os._exit(int(code or 0))


EXIT_BROKEN_PIPE = 141  # what a shell reports for a writer that SIGPIPE ended (128 + 13)


def run_then_exit(main: Callable[..., int | None], *args: Any, **kwargs: Any) -> NoReturn:
    """``exit_now(main(...))``, also when ``main`` stops the rank with ``SystemExit`` (a save on a
    full disk exits 74 that way, a non-finite loss 77): that exit skips finalization too. A reader
    that stopped reading (``trainer plan ... | head``) ends the command quietly, as it ends any
    other program that writes to a closed pipe."""
    try:
        code = main(*args, **kwargs)
    except SystemExit as stop:
        code = stop.code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is still buffered goes nowhere
        code = EXIT_BROKEN_PIPE
    exit_now(code)


def entry() -> NoReturn:
    """The ``trainer`` console script."""
    run_then_exit(main)


if __name__ == "__main__":
    entry()
