"""Benchmark: time to quality of the default job under different optimizers, in one run.

    python scripts/bench_muon.py [--json output/bench-muon.json]           # the full job, 7 runs
    python scripts/bench_muon.py --adamw_lrs 2e-3,5e-3 --muon_lrs 0.01,0.02,0.04 --muon_adam_lr 3e-3 \
        [--muon_args update_scale=match_rms_adamw] [--no-hf_trainer]
    python scripts/bench_muon.py --max_steps 60 --eval_steps 20 --muon_lrs ""      # a quick check
    python scripts/bench_muon.py --job_flags '--max_eval_samples 32'   # every run's recipe changed

The job is ``make demo``'s (scripts/recipes/default.yaml: a 4.2M-parameter Llama on the standard
library's source), 600 steps by default, run through ``python scripts/train.py`` with every core as
OpenMP threads (``DS_ACCELERATOR=cpu`` where there is no GPU; one GPU where there is), evaluated every
``--eval_steps`` steps (default 50; with ``--max_steps N``, N/12). The variants, one process each,
one after another:

- ``adamw``: the recipe with ``--optim adamw_torch`` (AdamW at lr 3e-3, 600 steps: the default job
  as the recipe trains it): the baseline, whose final eval loss is the target;
- ``adamw_lr<X>``: AdamW at each rate of ``--adamw_lrs``;
- ``muon_lr<X>``: ``--optim muon --optim_args muon_lr=X,adam_lr=<--muon_adam_lr>[,<--muon_args>]``;
- ``hf_trainer``: transformers' Trainer with its default optimizer on the same job (model, weights,
  blocks, eval rows, seed, batch, schedule), ``python -m trainer.bench.muon hf_trainer``.

Reported per variant: final eval loss and perplexity, the first evaluated step at or below the
target (``--tolerance F``: or at most F of it above), the training seconds to it (evaluation and
checkpoint time left out; see ``trainer.bench.muon``), the training seconds of the whole run, the
process's wall seconds, and the ratio of the time to target to the baseline's; "not reached" when
no evaluation gets there. A variant that fails is reported with its exit status and last log line;
the others still run. Each run's directory is OUT/<variant> (replaced, default
output/bench-muon/<variant>), its output OUT/<variant>.log.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from trainer.bench.muon import (
    ADAMW_STEPS,
    cores,
    has_gpu,
    launch_env,
    run_variant,
    schedule,
    summarise,
    table,
    variants,
)


def rates(text: str) -> list[float]:
    """A comma-separated list of positive rates ("" is none)."""
    values = [float(v) for v in text.split(",") if v.strip()]
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"rates must be > 0: {text}")
    return values


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_muon.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--max_steps",
        type=int,
        default=ADAMW_STEPS,
        help=f"steps of every run (the AdamW job's {ADAMW_STEPS})",
    )
    p.add_argument("--eval_steps", type=int, help="evaluate every this many steps (default: max_steps / 12)")
    p.add_argument("--adamw_lrs", type=rates, default=[2e-3, 5e-3], help="AdamW's other rates")
    p.add_argument("--muon_lrs", type=rates, default=[0.01, 0.02, 0.04], help='Muon\'s rates ("": none)')
    p.add_argument("--muon_adam_lr", type=float, default=3e-3, help="AdamW's rate in the Muon runs")
    p.add_argument("--muon_args", default="", help="key=value,... appended to every Muon run's optim_args")
    p.add_argument("--hf_trainer", action=argparse.BooleanOptionalAction, default=True,
                   help="also train the job with HF's Trainer")  # fmt: skip
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="an eval loss this fraction above the target counts as reached")  # fmt: skip
    p.add_argument("--job_flags", type=shlex.split, default=[],
                   help="flags every run adds to the recipe's, e.g. a smaller model: "
                   "'--model_config_overrides {\"num_hidden_layers\": 2} --max_eval_samples 16'")  # fmt: skip
    p.add_argument("--threads", type=int, default=cores(), help="OpenMP threads of each run (all cores)")
    p.add_argument("--out", type=Path, default=Path("output/bench-muon"), help="where the runs go")
    p.add_argument("--json", type=Path, help="write the results here, one object keyed by variant")
    args = p.parse_args(argv)
    if args.max_steps < 1 or args.threads < 1 or args.muon_adam_lr <= 0:
        p.error("--max_steps, --threads and --muon_adam_lr must be > 0")
    if args.tolerance < 0:
        p.error("--tolerance must be >= 0")
    try:
        args.plan = schedule(args.max_steps, args.eval_steps)
        args.variants = variants(
            args.adamw_lrs, args.muon_lrs, args.muon_adam_lr, args.muon_args, args.hf_trainer
        )
    except ValueError as err:
        p.error(str(err))
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    env = launch_env(args.threads, has_gpu())
    plan = args.plan
    print(f"{len(args.variants)} runs of {plan.max_steps} steps, evaluated every {plan.eval_steps}, "
          f"{args.threads} threads each; in {args.out}", flush=True)  # fmt: skip
    runs = {}
    for variant in args.variants:
        print(f"{variant.name}: training", flush=True)
        runs[variant.name] = run_variant(variant, args.out, plan, env, args.job_flags)
        run = runs[variant.name]
        print(f"{variant.name}: exit {run.returncode} after {run.wall_s:.0f} s", flush=True)
    summary = summarise(runs, tolerance=args.tolerance)
    print(table(summary))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
