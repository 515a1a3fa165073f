"""Walk the docs as a newcomer does: ``make demo``, then each page's ``scripts/train.py`` launches in
the order the page shows them, as written, each page in a scratch copy of the repository that holds
the demo's finished run (``output/default``).

    python -m scripts.walk_docs [--pages README.md parallelism.md] [--max_steps N] [--timeout S] [--report F]

Launchers are sized to this machine (its GPUs, or 2 CPU ranks: ``--num_gpus``, ``--nproc_per_node``
and ``--num_processes``); nothing else is changed, except ``--max_steps N`` when given, which caps a
launch that would take hours here. A launch passes when it exits 0 and its folder's metrics reach a
later step than before, so one that resumed a finished run ("nothing to train"), was refused or died
late fails. ``--timeout S`` stops a launch after S seconds and reports it as too long for this
machine (GPT-2's recipe on a CPU), neither passed nor failed. Commands marked ``# not run by the
tests`` (GPU-only features, several nodes, SLURM) and forms with placeholders are listed as skipped.
One line per launch; ``--report``: the same as JSON. Exit 1 when a launch failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.e2e.test_doc_commands import COMMANDS, is_synopsis, written_folder

ROOT = Path(__file__).resolve().parent.parent

SIZING = {"--num_gpus", "--nproc_per_node", "--num_processes"}
BIN = Path(sys.executable).parent


def gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def sized(command: str, ranks: int, max_steps: int | None) -> list[str]:
    """The command's words with its launcher's rank count set to ``ranks`` (and ``--max_steps``)."""
    words = shlex.split(command)
    for i, word in enumerate(words[: words.index("scripts/train.py")]):
        if word in SIZING:
            words[i + 1] = str(ranks)
    if max_steps is not None:
        words += ["--max_steps", str(max_steps)]
    return words


def last_step(folder: Path) -> int:
    """The latest step the folder's metrics logged (0: none)."""
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    return max((json.loads(line).get("step", 0) for line in metrics.open() if line.strip()), default=0)


def scratch_copy(into: Path) -> None:
    """The repository's tracked files (what a clone holds) under ``into``."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, target)


def environment(single_process: bool, words: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's, with the launch's own ``NAME=value`` words (``words``)."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.update(word.split("=", 1) for word in words)
    if not gpus():
        env["DS_ACCELERATOR"] = "cpu"
        # As the Makefile: one process uses every core, ranks one thread each.
        env["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)) if single_process else 1)
    return env


def stopped_tree(pid: int) -> list[int]:
    """``pid`` and every process under it, each stopped (SIGSTOP) before its children are listed.

    A stopped process can neither start a new child nor go on when its child is killed (a shell
    would run its next command), so the tree is still whole when it is killed."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [p for child in found for p in stopped_tree(int(child))]


def run(
    words: list[str], cwd: Path, log: Path, timeout: float | None = None, env_words: tuple[str, ...] = ()
) -> tuple[int | None, float]:
    """(exit code, or None when stopped at ``timeout``; seconds)."""
    start = time.monotonic()
    env = environment(Path(words[0]).name == "python", env_words)
    with log.open("w") as out:
        proc = subprocess.Popen(
            words, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in stopped_tree(proc.pid):  # the launcher and its ranks (in sessions of their own)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", nargs="*", help="README.md and docs/ page names (default: all)")
    parser.add_argument("--max_steps", type=int, help="cap each launch at this many steps")
    parser.add_argument("--timeout", type=float, help="stop a launch after this many seconds")
    parser.add_argument("--report", type=Path, help="write the results as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copies")
    args = parser.parse_args()
    ranks = gpus() or 2
    pages = list(dict.fromkeys(c.doc for c in COMMANDS if not args.pages or c.doc in args.pages))
    work = Path(tempfile.mkdtemp(prefix="walk_docs_"))
    demo = work / "demo"
    scratch_copy(demo)
    code, seconds = run([str(BIN / "python"), "scripts/train.py"], demo, work / "demo.log")
    print(f"make demo: exit {code} in {seconds:.0f} s", flush=True)
    results, failed = [], code != 0
    for page in pages if not failed else []:
        here = work / page.removesuffix(".md")
        shutil.copytree(demo, here, symlinks=True)
        for c in COMMANDS:
            if c.doc != page or c.inline or "scripts/train.py" not in c.command or "--help" in c.command:
                continue
            row = {"page": page, "command": c.command}
            if c.marked or is_synopsis(c.command):
                results.append({**row, "skipped": "marked not run" if c.marked else "a form to fill in"})
                continue
            folder = here / (written_folder(c.command) or "output/default")
            before = last_step(folder)
            log = here / f"walk_{len(results)}.log"
            words = sized(c.command, ranks, args.max_steps)
            code, seconds = run([str(BIN / words[0]), *words[1:]], here, log, args.timeout, c.env)
            trained = last_step(folder) > before
            ok = None if code is None else code == 0 and trained
            failed |= ok is False
            results.append({**row, "exit": code, "seconds": round(seconds, 1), "trained": trained, "ok": ok})
            verdict = {True: "ok  ", False: "FAIL", None: "slow"}[ok]
            tail = "" if ok else f"  (log: {log})"
            print(f"{verdict} {page}: {c.command}  [{seconds:.0f} s]{tail}", flush=True)
    for row in results:
        if "skipped" in row:
            print(f"skip {row['page']}: {row['command']}  ({row['skipped']})")
    if args.report:
        args.report.write_text(
            json.dumps({"ranks": ranks, "max_steps": args.max_steps, "results": results}, indent=1)
        )
    if not (args.keep or failed):
        shutil.rmtree(work)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
