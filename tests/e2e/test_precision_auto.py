"""Precision "auto" through the user's command: on a CPU with bf16 matrix instructions (here the switch
the suite turns them off with, set on) the embedded default trains in bf16 and says why; without, fp32."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import launch, run_env, together
from tests.helpers.scaffold import tiny_flags, train_rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision")

    def run(units: str):
        flags = ["scripts/train.py", *tiny_flags(max_steps=2, save_steps=2, eval_steps=2), "--output_dir"]
        return launch([*flags, str(root / units)], launcher="python", env=run_env(TRAINER_CPU_BF16=units))

    on, off = together(lambda: run("on"), lambda: run("off"))
    return {"on": (root / "on", on), "off": (root / "off", off)}


@pytest.mark.parametrize(
    "units, chosen",
    [
        (
            "on",
            "precision auto: bf16 on cpu (bf16 matrix instructions) (its AMX or AVX-512 BF16 instructions",
        ),
        (
            "off",
            "precision auto: fp32 on cpu (without AMX or AVX-512 BF16 this CPU multiplies bf16 several",
        ),
    ],
)
def test_the_default_job_takes_the_cpus_fastest_precision(runs, units, chosen):
    out, proc = runs[units]
    assert chosen in proc.stdout + proc.stderr
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds.get("bf16", {}).get("enabled", False) is (units == "on")
    assert [r["step"] for r in train_rows(out)] == [1, 2]
