"""``trainer train [--config R.yaml] [--field value ...]``, and what ``scripts/train.py`` runs.

The door of a training job: ``--help``, and arguments that cannot make a run (an unknown field, a bad
value, a recipe file that does not parse), are answered from the run schema alone, in under a second;
torch, transformers and DeepSpeed load only for a run (``trainer.cli.train_job``). Its flags are the
run schema's fields, so the dispatcher hands argv over untouched; argparse would stop at the first
``--field`` it does not know. A rerun whose output_dir's last stop was a full disk that is still full
stops here too (``trainer.runtime.full_disk``).
"""

from __future__ import annotations

import sys

from trainer.args.recipe import HELP_FLAGS, help_recipe, parse_run_config, run_help
from trainer.config.errors import ConfigError
from trainer.runtime.full_disk import still_full
from trainer.runtime.import_guard import heavy_imports
from trainer.runtime.ranks import EXIT_SAVE_FAILED, configure_logging, dist_info

RAW_ARGV = True

EXIT_BAD_INPUT = 2


def main(argv: list[str] | None = None, prog: str = "trainer train") -> int:
    argv = sys.argv[1:] if argv is None else argv
    configure_logging()
    if any(a in HELP_FLAGS for a in argv):
        if dist_info().is_main:
            print(run_help(prog, help_recipe(argv)))
        return 0
    try:
        run_config = parse_run_config(argv)
    except ConfigError as err:
        return refuse(err)
    args, is_main = run_config.training, dist_info().is_main
    if args.save_failure_policy == "stop" and (line := still_full(args.output_dir, is_main)):
        if is_main:
            print(f"error: {line}", file=sys.stderr, flush=True)
        return EXIT_SAVE_FAILED
    with heavy_imports():
        from trainer.cli.train_job import BAD_INPUT, run_job
        from trainer.data.stream import ShardError

    try:
        return run_job(run_config)
    except BAD_INPUT as err:  # a checkpoint, a shard, a setting the hardware refuses
        return refuse(err, every_rank=isinstance(err, ShardError))  # a shard is met by one rank


def refuse(err: Exception, every_rank: bool = False) -> int:
    """Bad input as one line on stderr, from rank 0 (every rank sees the same input) unless only some
    ranks met it; the exit code says it was the input."""
    if every_rank or dist_info().is_main:
        print(f"error: {err}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT
