"""Instruction rows and preference pairs from the standard library's functions, for the offline
SFT-then-DPO recipe (``make sft-dpo``; docs/sft.md).

    python scripts/recipes/stdlib_tasks.py OUT_DIR [--sft N] [--pairs N] [--prompts N] [--held_prompts N] [--max_chars N] [--seed S]

Each documented function of the stdlib corpus (the default job's own text) becomes a task: the
prompt is its ``def`` line and docstring, the completion its body. ``OUT_DIR/sft.jsonl`` holds
``prompt``/``completion`` rows; ``OUT_DIR/prefs.jsonl`` holds ``prompt``/``chosen``/``rejected`` pairs
of other functions (of two lines or more), whose chosen answer is the function's body and whose
rejected answer is the same lines in a shuffled order; ``OUT_DIR/prompts.jsonl`` holds the prompts
alone of functions in neither, for online RL (``make grpo``; docs/rl.md), and
``OUT_DIR/held_prompts.jsonl`` more, held out to measure it. The sets share no function.
The rows depend only on the Python installation and the arguments.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import textwrap
from pathlib import Path

from trainer.data.sources import corpus_files


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
    parser.add_argument(
        "--prompts", type=int, default=512, help="prompts for online RL (def line and docstring)"
    )
    parser.add_argument("--held_prompts", type=int, default=64, help="prompts held out to measure the RL")
    parser.add_argument("--max_chars", type=int, default=360, help="longest function (prompt and body)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tasks = sorted({t for f in corpus_files() for t in function_tasks(f, args.max_chars)})
    random.Random(args.seed).shuffle(tasks)
    sft, rest = tasks[: args.sft], tasks[args.sft :]
    shuffled = [
        (prompt, body, scrambled(body, random.Random(args.seed + i))) for i, (prompt, body) in enumerate(rest)
    ]
    pairs = [{"prompt": p, "chosen": b, "rejected": r} for p, b, r in shuffled if r is not None][: args.pairs]
    paired = {row["prompt"] for row in pairs}
    unpaired = [{"prompt": p} for p, _ in rest if p not in paired]
    prompts, held = unpaired[: args.prompts], unpaired[args.prompts : args.prompts + args.held_prompts]
    if (
        len(sft) < args.sft
        or len(pairs) < args.pairs
        or len(prompts) + len(held) < args.prompts + args.held_prompts
    ):
        print(
            f"stdlib_tasks: {len(tasks)} functions, too few for --sft {args.sft}, --pairs {args.pairs} "
            f"and --prompts {args.prompts} + --held_prompts {args.held_prompts}",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "sft.jsonl", [{"prompt": p, "completion": c} for p, c in sft])
    write_jsonl(args.out / "prefs.jsonl", pairs)
    write_jsonl(args.out / "prompts.jsonl", prompts)
    write_jsonl(args.out / "held_prompts.jsonl", held)
    print(
        f"stdlib_tasks: {len(sft)} rows in {args.out / 'sft.jsonl'}, {len(pairs)} pairs in {args.out / 'prefs.jsonl'}, "
        f"{len(prompts)} prompts in {args.out / 'prompts.jsonl'}"
    )
    return 0


def scrambled(body: str, rng: random.Random) -> str | None:
    """The body's lines in another order (None for a body whose lines cannot be reordered)."""
    lines = body.splitlines(keepends=True)
    if len(set(lines)) < 2:
        return None
    order = list(range(len(lines)))
    while order == sorted(order):
        rng.shuffle(order)
    return "".join(lines[i] for i in order)


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
