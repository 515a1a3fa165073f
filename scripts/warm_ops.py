"""Compile DeepSpeed's JIT ops ahead of the runs that load them, so the tests do not pay for it.

``python scripts/warm_ops.py [BUILDER ...]`` (default: all three, in this order). On CPU: the CPU
Adam of optimizer offload, the CPU FusedAdam of ``optim=adamw_fused``, and the shared-memory
collective op, which this project's runs never load (it serves DeepSpeed's inference all-reduce) but
HF's Trainer and plain DeepSpeed on two or more CPU ranks do (the benchmarks' baselines and HF's
scripts in the tests). ``make test`` runs it; ``make demo`` loads none of them. The builds go to TORCH_EXTENSIONS_DIR (the Makefile pins it to a stable path,
and ``make test`` to its ``tests`` folder, built without debug info); one already built loads in a
second. On a GPU box nothing is forced: ops build on first use there.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

BUILDERS = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder")


def build(name: str) -> str:
    from deepspeed.accelerator import get_accelerator

    start = time.time()
    get_accelerator().create_op_builder(name).load(verbose=False)
    return f"{name}: ready in {time.time() - start:.0f}s"


def main() -> int:
    if os.environ.get("DS_ACCELERATOR") != "cpu":
        print("warm_ops: not a CPU run; DeepSpeed ops build on first use")
        return 0
    # Independent builds, two at a time with one compiler each: one per core, and each compiler
    # can take gigabytes, which ninja's default of cores + 2 jobs per build multiplies.
    os.environ.setdefault("MAX_JOBS", "1")
    names = sys.argv[1:] or list(BUILDERS)
    unknown = sorted(set(names) - set(BUILDERS))
    if unknown:
        print(
            f"warm_ops: unknown builder {', '.join(unknown)} (known: {', '.join(BUILDERS)})", file=sys.stderr
        )
        return 2
    with ThreadPoolExecutor(max_workers=2) as pool:
        for line in pool.map(build, names):
            print("warm_ops:", line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
