"""The CPU's description that DeepSpeed's op loads ask py-cpuinfo for, asked once per machine.

An op's builder asks ``cpuinfo.get_cpu_info()`` for the architecture and vector width each time the op
loads (CPU Adam, FusedAdam: twice per op, cached build or not), and CPU Adam asks for the vendor. Each
answer is a fresh interpreter (docs/architecture.md has its cost), per question. The answer is kept for
the process and in a file for the processes after it, named by what identifies the CPU in
``/proc/cpuinfo`` (vendor, family, model, stepping, flags); a machine with another CPU, a node of a
cluster that shares the home directory, reads another file. Without ``/proc/cpuinfo`` the answer is
kept for the process only.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from pathlib import Path

from trainer.runtime.run_files import write_whole

IDENTITY = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainer" / "cpu_info"


def identity(cpuinfo_text: str) -> str | None:
    """A name for the CPU that ``/proc/cpuinfo``'s text describes (its first processor's fields in
    IDENTITY, and the machine's architecture); None if it has none of them."""
    first = cpuinfo_text.split("\n\n", 1)[0]
    fields = {}
    for line in first.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in IDENTITY:
            fields[key.strip()] = value.strip()
    if not fields:
        return None
    fields["machine"] = platform.machine()
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


# Set to on or off, the answer of ``bf16_matrix_units``; unset (or auto), the CPU's flags decide.
# The test suite sets it off, so its fp32 comparisons run the same on every machine.
BF16_OVERRIDE = "TRAINER_CPU_BF16"


# The flags of the instructions that multiply bf16 matrices faster than fp32: Intel's AMX tiles, and
# AVX-512 BF16 (Intel since Cooper Lake, AMD since Zen 4). On a 2-core AMD EPYC with AVX-512 BF16 one
# thread multiplied 1024x1024 matrices at 208 GFLOP/s in bf16 against 89 in fp32 (torch 2.13).
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def bf16_matrix_units(cpuinfo_text: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 matrices faster than fp32: one of BF16_FLAGS in
    ``/proc/cpuinfo``'s flags. Without them bf16 is emulated, several times slower than fp32. The
    flags are the same on every rank of a node, so ranks never choose apart."""
    override = os.environ.get(BF16_OVERRIDE, "auto").strip().lower()
    if override in ("on", "off"):
        return override == "on"
    if override != "auto":
        raise ValueError(f"{BF16_OVERRIDE}={override!r}: use on, off or auto")
    if cpuinfo_text is None:
        try:
            cpuinfo_text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo_text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return any(flag in value.split() for flag in BF16_FLAGS)
    return False


def keep_the_first_cpu_info() -> None:
    """Make ``cpuinfo.get_cpu_info`` answer from this process's first answer, or the machine's file."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then reads lscpu
        return
    if hasattr(cpuinfo.get_cpu_info, "cache_info"):
        return
    ask = cpuinfo.get_cpu_info
    try:
        name = identity(Path("/proc/cpuinfo").read_text())
    except OSError:
        name = None
    path = cache_dir() / f"{name}.json" if name else None

    @functools.cache
    def get_cpu_info() -> dict:
        if path is not None:
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError):  # not asked yet on this machine, or a damaged file
                pass
        info = ask()
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_whole(path, lambda p: p.write_text(json.dumps(info)))
            except OSError:  # a read-only home: asked again by the next process
                pass
        return info

    cpuinfo.get_cpu_info = get_cpu_info
