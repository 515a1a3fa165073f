"""``trainer train [--config R.yaml] [--field value ...]``: the same as scripts/train.py.

Its flags are the run schema's fields, so its argv goes to ``trainer.run.main`` untouched (which also
answers ``--help`` from the schema); argparse would stop at the first ``--field`` it does not know.
"""

from __future__ import annotations

RAW_ARGV = True


def main(argv: list[str]) -> int:
    from trainer.run import main as run_main

    return run_main(argv, prog="trainer train")
