"""Run DeepSpeed configs through DeepSpeed's own parser at a given world size.

``deepspeed.runtime.config.DeepSpeedConfig`` honours an ``mpu``'s data-parallel world size only once
``deepspeed.comm`` is initialised (without it, it assumes world size 1). So the parsing happens in a
child process that joins a one-rank gloo group, keeping the test process free of process groups.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def deepspeed_errors(cases: list[tuple[dict[str, Any], int]], timeout: int = 600) -> list[str | None]:
    """For each (config, data-parallel world size): None if DeepSpeed accepts it, else its error message."""
    return [r["error"] for r in deepspeed_parse(cases, timeout)]


def deepspeed_parse(cases: list[tuple[dict[str, Any], int]], timeout: int = 600) -> list[dict[str, Any]]:
    """For each case, DeepSpeed's reading of it: ``error`` (None when accepted), and when accepted the
    batch triple it settled on, the ZeRO stage and the precision flags."""
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    payload = json.dumps([{"config": c, "world_size": w} for c, w in cases])
    proc = subprocess.run(
        [sys.executable, __file__], input=payload, capture_output=True, text=True, env=env, timeout=timeout
    )
    assert proc.returncode == 0, f"parser child failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    return json.loads(last)


class _DataParallel:
    """Just enough of an mpu for DeepSpeedConfig: the data-parallel world size."""

    def __init__(self, size: int):
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size


def _child() -> None:
    cases = json.loads(sys.stdin.read())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    import deepspeed.comm as dist
    from deepspeed.runtime.config import DeepSpeedConfig

    dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    results = []
    for case in cases:
        try:
            parsed = DeepSpeedConfig(case["config"], mpu=_DataParallel(case["world_size"]))
            assert parsed.world_size == case["world_size"], f"parsed at world size {parsed.world_size}"
            results.append(
                {
                    "error": None,
                    "batch": [
                        parsed.train_batch_size,
                        parsed.train_micro_batch_size_per_gpu,
                        parsed.gradient_accumulation_steps,
                    ],
                    "stage": int(parsed.zero_optimization_stage),
                    "fp16": bool(parsed.float16_config.enabled),
                    "bf16": bool(parsed.bfloat16_config.enabled),
                }
            )
        except Exception as err:  # any refusal is the answer we report
            results.append({"error": f"{type(err).__name__}: {err}"})
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    _child()
