"""Instruction rows and preference pairs from the standard library's functions, for the offline
SFT-then-DPO recipe (``make sft-dpo``; docs/sft.md).

    python scripts/recipes/stdlib_tasks.py OUT_DIR [--sft N] [--pairs N] [--max_chars N] [--seed S]

Each documented function of the stdlib corpus (the default job's own text) becomes a task: the
prompt is its ``def`` line and docstring, the completion its body. ``OUT_DIR/sft.jsonl`` holds
``prompt``/``completion`` rows; ``OUT_DIR/prefs.jsonl`` holds ``prompt``/``chosen``/``rejected`` pairs
of other functions, whose chosen answer is the function's own body and whose rejected answer is the
body of the next function in the shuffled order whose body differs. The two sets share no function. The rows
depend only on the Python installation and the arguments.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from trainer.data.sources import corpus_files  # noqa: E402


def function_tasks(path: Path, max_chars: int) -> list[tuple[str, str]]:
    """(prompt, completion) of each documented function in ``path`` whose source fits ``max_chars``."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    tasks = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or len(node.body) < 2:
            continue
        if ast.get_docstring(node) is None:
            continue
        source = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno])).splitlines()
        split = node.body[0].end_lineno - node.lineno + 1  # the lines up to the docstring's end
        prompt, body = "\n".join(source[:split]) + "\n", "\n".join(source[split:]) + "\n"
        if len(prompt) + len(body) <= max_chars and len(body.strip()) >= 20:
            tasks.append((prompt, body))
    return tasks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--sft", type=int, default=1500, help="instruction rows")
    parser.add_argument("--pairs", type=int, default=800, help="preference pairs")
    parser.add_argument("--max_chars", type=int, default=360, help="longest function (prompt and body)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tasks = sorted({t for f in corpus_files() for t in function_tasks(f, args.max_chars)})
    random.Random(args.seed).shuffle(tasks)
    if len(tasks) < args.sft + args.pairs + 8:
        print(f"stdlib_tasks: {len(tasks)} functions, fewer than --sft plus --pairs", file=sys.stderr)
        return 2
    sft, rest = tasks[: args.sft], tasks[args.sft :]
    pairs = [
        {"prompt": prompt, "chosen": body, "rejected": next(b for _, b in rest[i + 1 :] if b != body)}
        for i, (prompt, body) in enumerate(rest[: args.pairs])
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "sft.jsonl", [{"prompt": p, "completion": c} for p, c in sft])
    write_jsonl(args.out / "prefs.jsonl", pairs)
    print(
        f"stdlib_tasks: {len(sft)} rows in {args.out / 'sft.jsonl'}, {len(pairs)} pairs in {args.out / 'prefs.jsonl'}"
    )
    return 0


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
