"""Compile DeepSpeed's JIT ops once at install time, so runs and tests do not pay for it.

On CPU that is the shared-memory collective op (built at every init otherwise), the CPU Adam used
by optimizer offload and the CPU FusedAdam. The builds go to TORCH_EXTENSIONS_DIR (the Makefile pins it to a stable path).
On a GPU box nothing is forced: ops build on first use there.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor


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
    # FusedAdam backs optim=adamw_fused.
    with ThreadPoolExecutor(max_workers=2) as pool:
        for line in pool.map(build, ["ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder"]):
            print("warm_ops:", line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
