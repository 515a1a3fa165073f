"""Run a command and report the peak resident memory of its largest process, watched from outside.

    python -m trainer.bench.peak_rss [--cap_bytes N] [--timeout S] [--report FILE] -- CMD ARGS...

A launcher's ranks are grandchildren of this process, so their memory is not ours to ask for with
``RUSAGE_SELF``. Two sources are combined:

- while the command runs, every ``--interval`` seconds, each descendant's ``VmHWM`` (the kernel's
  record of that process's peak RSS) from ``/proc/PID/status``. This names the process that holds the
  most (a launcher must not be the one measured) and lets ``--cap_bytes`` stop the whole tree as soon
  as one process passes the cap, instead of waiting for a run that is already over it to finish;
- after the command has exited, ``getrusage(RUSAGE_CHILDREN).ru_maxrss``: the peak of the largest
  single descendant that was waited for (the launchers wait for their ranks), which also covers a
  peak reached after the last poll. It is a maximum over every child this process has ever waited
  for, so a process that watches several commands in turn (a benchmark's runs) counts it only when
  it grew during this command: otherwise it may be an earlier command's peak.

``--only PROGRAM`` measures only the processes started as ``PROGRAM`` (``argv[0]``): DeepSpeed
may compile an op just in time under a rank, and a compiler's peak is not the run's. When it
leaves any process out, ``ru_maxrss`` (which may be that process's) is reported but not used; a
training rank reaches its peak during its steps, long before it exits, so the polled figure holds it.

The report (JSON, to ``--report`` or stdout) holds ``peak_rss_bytes``, every process seen with its
own peak, the launcher's (the command's own process) peak, whether the tree was stopped (for the
cap, the timeout, or a SIGTERM/SIGINT sent to this process), the exit code and the wall time. This
module imports nothing but the standard library, so it adds little to the machine's memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

PAGE_KIB = 1024


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, short name) of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name_end = text.rfind(")")  # the name may hold spaces and parentheses
    fields = text[name_end + 2 :].split()
    return int(fields[1]), text[text.find("(") + 1 : name_end]


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(stat[0], []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def peak_rss_kib(pid: int) -> int | None:
    """The process's peak RSS so far (``VmHWM``), in KiB; None when it is gone or a zombie."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _argv(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _kill_tree(root: int) -> None:
    """SIGKILL every process of the tree, children first seen; the session too (the command was
    started in a session of its own, so nothing outside it is touched)."""
    for pid in reversed(descendants(root)):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.killpg(root, signal.SIGKILL)


def watch(
    cmd: list[str],
    cap_bytes: int | None = None,
    timeout: float | None = None,
    interval: float = 0.1,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    stdout: object = None,
    only: str | None = None,
) -> dict:
    """Run ``cmd`` to its end (or until the cap or the timeout stops it) and return the report.

    ``only``: count only the processes whose program (``argv[0]``) is this one, say the Python
    interpreter of a training run and its ranks; others (a compiler DeepSpeed runs to build an op
    just in time) are listed with ``counted: false`` and neither measured nor held to the cap."""
    start = time.monotonic()
    earlier = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * PAGE_KIB  # earlier commands' peak
    # A SIGTERM or SIGINT to this process stops the command's tree too: it runs in a session of
    # its own, so a signal to our process group (a timeout, ^C) would not reach it.
    signalled: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: signalled.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
        start_new_session=True,
    )  # fmt: skip
    seen: dict[int, dict] = {}
    stopped = None
    while proc.poll() is None:
        for pid in descendants(proc.pid):
            kib = peak_rss_kib(pid)
            if kib is None:
                continue
            row = seen.setdefault(pid, {"pid": pid, "cmd": "", "counted": True, "peak_rss_bytes": 0})
            row["peak_rss_bytes"] = max(row["peak_rss_bytes"], kib * PAGE_KIB)
            if not row["cmd"]:  # read once; a fork shows its parent's until it execs
                argv = _argv(pid)
                row["cmd"] = " ".join(argv)[:300]
                row["counted"] = only is None or (bool(argv) and argv[0] == only)
            over = cap_bytes is not None and row["peak_rss_bytes"] > cap_bytes
            if over and row["counted"] and stopped is None:
                stopped = "cap"
        if stopped is None and timeout is not None and time.monotonic() - start > timeout:
            stopped = "timeout"
        if stopped is None and signalled:
            stopped = f"signal {signalled[0]}"
        if stopped is not None:
            _kill_tree(proc.pid)
            break
        time.sleep(interval)
    returncode = proc.wait()
    wall = time.monotonic() - start
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    children_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * PAGE_KIB
    processes = sorted(seen.values(), key=lambda row: -row["peak_rss_bytes"])
    counted = [row for row in processes if row["counted"]]
    excluded = max((row["peak_rss_bytes"] for row in processes if not row["counted"]), default=0)
    polled = counted[0]["peak_rss_bytes"] if counted else 0
    launcher = seen.get(proc.pid, {}).get("peak_rss_bytes", 0)
    # ru_maxrss is the largest of all descendants, excluded ones too: with any process left out it
    # may be that one's (its last peak after the last look), so only the polled figures count.
    left_out = any(not row["counted"] for row in processes)
    ours = children_peak if children_peak > earlier else 0  # a larger maximum came from this command
    peak = polled if left_out else max(ours, polled)
    if stopped is None and cap_bytes is not None and peak > cap_bytes:
        stopped = "over_cap_at_exit"  # the peak came after the last poll; the run itself finished
    return {
        "cmd": cmd,
        "returncode": returncode,
        "wall_s": wall,
        "peak_rss_bytes": peak,
        "largest": counted[0] if counted else None,
        "excluded_peak_rss_bytes": excluded,
        "children_ru_maxrss_bytes": children_peak,
        "launcher_peak_rss_bytes": launcher,
        # Only meaningful when the command is a launcher of other processes.
        "launcher_is_largest": bool(counted) and counted[0]["pid"] == proc.pid and len(counted) > 1,
        "processes": processes,
        "cap_bytes": cap_bytes,
        "stopped": stopped,
    }


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: python -m trainer.bench.peak_rss [options] -- CMD ARGS...", file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m trainer.bench.peak_rss", description=__doc__.split("\n\n")[0])
    p.add_argument("--cap_bytes", type=int, help="stop the whole tree once one process's RSS passes this")
    p.add_argument("--timeout", type=float, help="stop the whole tree after this many seconds")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between two looks at /proc")
    p.add_argument("--report", type=Path, help="write the JSON report here (default: stdout)")
    p.add_argument(
        "--only", help="measure only processes whose argv[0] is this program (e.g. the interpreter)"
    )
    args = p.parse_args(argv[:split])
    cmd = argv[split + 1 :]
    if not cmd:
        p.error("no command after --")
    report = watch(cmd, args.cap_bytes, args.timeout, args.interval, only=args.only)
    text = json.dumps(report, indent=1)
    if args.report:
        args.report.write_text(text + "\n")
    else:
        print(text)
    return report["returncode"] if report["returncode"] >= 0 else 128 - report["returncode"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
