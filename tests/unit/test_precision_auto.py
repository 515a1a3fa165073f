"""Precision "auto" on a CPU: bf16 where AMX or AVX-512 BF16 instructions multiply it faster than
fp32, fp32 elsewhere, decided from the CPU's flags (the same on every rank) and logged."""

from __future__ import annotations

import pytest

from trainer.args import TrainingArguments
from trainer.config import Hardware, resolve
from trainer.runtime.cpu_info import BF16_OVERRIDE, bf16_matrix_units

# The first processor's block of /proc/cpuinfo on an AMD EPYC with AVX-512 BF16 (no AMX), on one
# without (Zen 3), and on a Sapphire Rapids Xeon; flags shortened.
EPYC = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n\nprocessor\t: 1\n"
ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 fma\n"
XEON = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"


def test_the_flags_decide_without_an_override(monkeypatch):
    monkeypatch.setenv(BF16_OVERRIDE, "auto")
    assert bf16_matrix_units(XEON) is True
    assert bf16_matrix_units(EPYC) is True  # 208 GFLOP/s in bf16 against 89 in fp32 here
    assert bf16_matrix_units(ZEN3) is False
    assert bf16_matrix_units("processor\t: 0\n") is False


def test_the_override_wins_and_is_checked(monkeypatch):
    monkeypatch.setenv(BF16_OVERRIDE, "on")
    assert bf16_matrix_units(ZEN3) is True
    monkeypatch.setenv(BF16_OVERRIDE, "off")
    assert bf16_matrix_units(XEON) is False
    monkeypatch.setenv(BF16_OVERRIDE, "yes")
    with pytest.raises(ValueError, match="TRAINER_CPU_BF16='yes': use on, off or auto"):
        bf16_matrix_units(XEON)


@pytest.mark.parametrize("fast, want", [(True, "bf16"), (False, "fp32")])
def test_auto_resolves_to_what_the_cpu_runs_fastest(fast, want):
    hardware = Hardware.cpu(fast_bf16=fast)
    assert hardware.default_precision() == want
    ds = resolve(TrainingArguments(output_dir="out", max_steps=1), 1, hardware)
    assert ds.get("bf16", {}).get("enabled", False) is (want == "bf16")
    # An explicit choice stays what it says on either CPU.
    ds = resolve(TrainingArguments(output_dir="out", max_steps=1, precision="fp32"), 1, hardware)
    assert "bf16" not in ds or ds["bf16"]["enabled"] is False
    assert "AMX" in hardware.why_default()
