"""Where the test suite's CPU goes: the table of ``make test-cpu``'s log, by program and by test
module (docs/testing.md).

    python scripts/suite_cpu.py output/suite_cpu.jsonl [--top 25]

Each line of the log is one Python process the suite started, with its own CPU seconds; the
compilers of DeepSpeed's JIT ops, and processes killed without running their exit handlers (the
fault tests' SIGKILLs), are not in it.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def program(argv: list[str]) -> str:
    """A process's program: the file name of its script (of its module's file under ``-m``), or ``-c``."""
    return Path(argv[0]).name if argv else "?"


def table(rows: list[dict], key, top: int) -> list[str]:
    cpu: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for row in rows:
        cpu[key(row)] += row["cpu_s"]
        count[key(row)] += 1
    ranked = sorted(cpu, key=cpu.get, reverse=True)[:top]
    return [f"| {name} | {count[name]} | {cpu[name]:.0f} |" for name in ranked]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="the JSON lines make test-cpu wrote")
    parser.add_argument("--top", type=int, default=25, help="rows per table")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.log.read_text().splitlines() if line.strip()]
    total = sum(r["cpu_s"] for r in rows)
    print(f"{len(rows)} Python processes, {total / 60:.1f} CPU-minutes of their own\n")
    print("| program | processes | CPU s |\n|---|---|---|")
    print("\n".join(table(rows, lambda r: program(r["argv"]), args.top)))
    print("\n| test module | processes | CPU s |\n|---|---|---|")
    print("\n".join(table(rows, lambda r: r["test"].split("::")[0] or "(outside a test)", args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
