"""Fault campaign: the default job under ``torchrun --nproc_per_node 2 --max-restarts 3``, one random
fault per run, and a report per fault kind: recovered or not, final weights bitwise equal to an
uninterrupted run or not, steps lost, restart time.

    python scripts/fault_campaign.py --runs 30 --seed 1 --out output/fault_campaign

It first trains a reference run with the same flags, uninterrupted. Then each run gets one fault,
its kind taken round-robin from ``--kinds`` and its details drawn from ``--seed``:

- ``kill``: SIGKILL of a random rank, from outside once a random step is logged, or (TRAINER_FAULT)
  inside a checkpoint save, a flash snapshot or an evaluation. torchrun's agent restarts the ranks.
- ``sigterm``: SIGTERM to the agent and both ranks, as SLURM signals a job step on preemption. The
  ranks save and exit 75; the campaign starts the job again, as a requeue would.
- ``nan``: a NaN loss at a random step (TRAINER_FAULT) under ``--nonfinite_policy rollback``. A
  rollback lowers the learning rate, so these runs are not expected to match the reference.
- ``disk``: output_dir on a tmpfs that a filler file leaves just short of a checkpoint: its save
  fails (ENOSPC) and the job stops (74). The campaign removes the filler and starts it again.
- ``cache``: an Arrow file of the job's tokenisation cache is cut short before the run starts.

Times are the campaign's own: output lines and metrics.jsonl rows are stamped when read (every
50 ms). Steps lost: the last step logged before the fault minus the step the job went on from.
Restart time: from the fault to the first step logged after the resume the job finished from.
Runs use their own tokenisation cache under ``--out`` (seeded from the user's), never the shared one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("kill", "sigterm", "nan", "disk", "cache")
MAX_STEPS, SAVE_STEPS, EVAL_STEPS = 24, 8, 12
JOB_FLAGS = [
    "--max_steps", str(MAX_STEPS), "--save_steps", str(SAVE_STEPS), "--logging_steps", "1",
    "--eval_steps", str(EVAL_STEPS), "--max_eval_samples", "16", "--block_size", "64",
    "--model_config_overrides", '{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}',
]  # fmt: skip
POLL_S = 0.05
PAGE = 4096
DISK_SIZE = 128 << 20  # the tmpfs of a disk run; a filler takes what the fault does not leave
NAN_NOTE = "no (by design: rollback lowers the LR)"

RESUMED = re.compile(r"Resumed from (\S+) at step (\d+)\.")
SCRATCH = re.compile(r"No complete checkpoint in \S+; starting from scratch\.")
ROLLED_BACK = re.compile(r"Non-finite loss at step (\d+): rolled back to (checkpoint-(\d+))")
STOP_LINE = re.compile(r"(error: |Preempted: |Non-finite loss at step ).*")  # after a progress bar's \r
WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: \d+")  # torchrun's agent, per attempt
CACHE_USED = re.compile(r"(?:tokenised dataset cache hit: |; cached at )(\S+/final)")


# ---- one launch, and what the campaign sees of it ------------------------------------------------


class Rows(threading.Thread):
    """A run's metrics.jsonl as it grows (across launches): each row with the time it was read."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.rows, self._offset, self._done = path, [], 0, threading.Event()
        self.start()

    def run(self) -> None:
        while not self._done.is_set():
            self.poll()
            self._done.wait(POLL_S)

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        now = time.monotonic()
        for line in data[:end].splitlines():
            try:
                self.rows.append((now, json.loads(line)))
            except ValueError:
                continue  # a row torn by a kill

    def stop(self) -> None:
        self._done.set()
        self.join()
        self.poll()

    def steps(self) -> list[tuple[float, int]]:
        """(time read, step) of the training rows, in file order."""
        return [(t, row["step"]) for t, row in list(self.rows) if "loss" in row]

    def latest(self) -> int:
        return max((step for _, step in self.steps()), default=0)


class Job:
    """One torchrun launch: its output lines, stamped as read, go to ``lines`` and to ``log``."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, lines: list[tuple[float, str]]):
        self.started = time.monotonic()
        self.lines = lines
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, errors="replace",
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, args=(log, f"$ {' '.join(cmd)}\n"), daemon=True)
        self._reader.start()

    def _read(self, log: Path, header: str) -> None:
        with open(log, "a", encoding="utf-8") as f:
            f.write(header)
            for line in self.proc.stdout:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                f.write(line)
                f.flush()

    def workers(self) -> dict[int, psutil.Process]:
        """The live ranks, by rank."""
        found = {}
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return found
        for child in children:
            try:
                rank = child.environ().get("RANK")
                if rank is not None and "train.py" in " ".join(child.cmdline()) and child.is_running():
                    found[int(rank)] = child
            except psutil.Error:
                continue
        return found

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The agent and its ranks stopped (SIGSTOP) for the block's duration, resumed after."""
        try:
            agent = psutil.Process(self.proc.pid)
            procs = [agent, *agent.children(recursive=True)]
        except psutil.Error:
            procs = []
        for proc in procs:
            with suppress(psutil.Error):
                proc.suspend()
        try:
            yield
        finally:
            for proc in procs:
                with suppress(psutil.Error):
                    proc.resume()

    def wait(self, timeout: float) -> int | None:
        """The launch's exit code; None when it ran past ``timeout`` and was killed."""
        try:
            code = self.proc.wait(timeout=max(timeout - (time.monotonic() - self.started), 1))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            code = None
        self._reader.join(timeout=10)
        return code


def first_death(job: Job, rank: int, box: list[float]) -> None:
    """Thread body: the time the first process seen as ``rank`` ends (an in-process crash)."""
    victim = None
    while job.proc.poll() is None:
        if victim is None:
            victim = job.workers().get(rank)
        elif not _alive(victim):
            box.append(time.monotonic())
            return
        time.sleep(POLL_S)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_for_step(rows: Rows, job: Job, step: int, timeout: float) -> bool:
    """Until ``step`` is logged (True), or the launch ends or time runs out (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if rows.latest() >= step:
            return True
        if job.proc.poll() is not None:
            return False
        time.sleep(POLL_S)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- a run ---------------------------------------------------------------------------------------


@dataclass
class Run:
    """One run of the campaign: its directories, launches and observations."""

    index: int
    kind: str
    details: dict[str, Any]
    dir: Path
    output_dir: Path
    flags: list[str]
    timeout: float
    lines: list[tuple[float, str]] = field(default_factory=list)
    exit_codes: list[int | None] = field(default_factory=list)
    fault_t: float | None = None
    rows: Rows | None = None
    cleanups: list[Callable[[], Any]] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)

    def launch(self, **env: str) -> Job:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.rows is None:
            self.rows = Rows(self.output_dir / "metrics.jsonl")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "3",
               "--master_port", str(free_port()), "scripts/train.py", "--output_dir", str(self.output_dir),
               *self.flags]  # fmt: skip
        self.jobs.append(Job(cmd, job_env(**env), self.dir / "output.log", self.lines))
        return self.jobs[-1]

    def finish(self, job: Job) -> int | None:
        code = job.wait(self.timeout)
        self.exit_codes.append(code)
        return code

    def seen(self, pattern: re.Pattern[str] | str, since: float = 0.0) -> list[tuple[float, re.Match[str]]]:
        """Output lines matching ``pattern`` (from time ``since``), with their times."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        return [(t, m) for t, line in list(self.lines) if t >= since and (m := rx.search(line))]


def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(
        OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"
    )
    env.pop("TRAINER_FAULT", None)
    env.update(extra)
    return env


# ---- the faults ----------------------------------------------------------------------------------


def plan(kind: str, rng: random.Random, snapshots: bool, nth: int) -> dict[str, Any]:
    """The details of the ``nth`` fault of this kind, drawn from ``rng``. Where a kill lands (after a
    step, in a save, a snapshot, an evaluation), which save a full disk fails and how a cache file is
    cut go round in turn, so that a campaign covers each; ranks, steps and files are drawn."""
    if kind == "kill":
        phases = ["step", "save", *(["snapshot"] if snapshots else []), "eval"]
        phase = phases[nth % len(phases)]
        steps = {"step": range(2, MAX_STEPS - 1), "save": range(SAVE_STEPS, MAX_STEPS + 1, SAVE_STEPS),
                 "eval": range(EVAL_STEPS, MAX_STEPS + 1, EVAL_STEPS), "snapshot": range(2, MAX_STEPS)}  # fmt: skip
        return {"rank": rng.randint(0, 1), "step": rng.choice(steps[phase]), "phase": phase}
    if kind == "sigterm":
        return {"step": rng.randint(2, MAX_STEPS - 2)}
    if kind == "nan":
        return {"step": rng.randint(SAVE_STEPS + 1, MAX_STEPS - 1)}  # after a checkpoint to roll back to
    if kind == "disk":
        return {"save": [SAVE_STEPS, 2 * SAVE_STEPS][nth % 2]}
    cut = ["random", "batch", "empty"][nth % 3]
    return {"file": rng.choice(["train.arrow", "eval.arrow"]), "cut": cut, "fraction": round(rng.random(), 4)}


def fault_kill(run: Run) -> None:
    rank, step, phase = run.details["rank"], run.details["step"], run.details["phase"]
    if phase != "step":  # inside a save, a snapshot or an evaluation: the rank kills itself there
        job = run.launch(TRAINER_FAULT=f"crash:rank={rank}:step={step}:phase={phase}")
        died: list[float] = []
        watcher = threading.Thread(target=first_death, args=(job, rank, died), daemon=True)
        watcher.start()
        run.finish(job)
        watcher.join(timeout=5)
        run.fault_t = died[0] if died else None
        return
    job = run.launch()
    if wait_for_step(run.rows, job, step, run.timeout):
        victim = job.workers().get(rank)
        if victim is not None:
            victim.send_signal(signal.SIGKILL)  # from outside, as the OOM killer or a lost node would
            run.fault_t = time.monotonic()
    run.finish(job)


def fault_sigterm(run: Run) -> None:
    job = run.launch()
    if wait_for_step(run.rows, job, run.details["step"], run.timeout):
        workers = job.workers()
        run.fault_t = time.monotonic()
        for proc in [*workers.values(), psutil.Process(job.proc.pid)]:
            proc.send_signal(signal.SIGTERM)  # every process of the job step, as SLURM does
    run.finish(job)
    if run.seen("Preempted: saved checkpoint-"):
        run.finish(run.launch())  # the requeue


def fault_nan(run: Run) -> None:
    step = run.details["step"]
    run.finish(run.launch(TRAINER_FAULT=f"nan:step={step}"))
    before = [t for t, s in run.rows.steps() if s == step - 1]
    run.fault_t = before[0] if before else None  # the NaN step starts as the step before it is logged


def fault_cache(run: Run, cache_file: Path) -> None:
    run.details.update(cut_cache(cache_file, run.details))
    run.fault_t = None
    run.finish(run.launch())


def cut_cache(path: Path, details: dict[str, Any]) -> dict[str, Any]:
    """Cut an Arrow file short: at a random byte, at a record-batch boundary (it then reads without
    error, only shorter), or to nothing."""
    size = path.stat().st_size
    if details["cut"] == "empty":
        cut = 0
    elif details["cut"] == "batch":
        boundaries = arrow_boundaries(path)[:-1]  # not after the last batch: that leaves every row
        cut = boundaries[min(int(details["fraction"] * len(boundaries)), len(boundaries) - 1)]
    else:
        cut = int(details["fraction"] * size)
    with open(path, "r+b") as f:
        f.truncate(cut)
    return {"path": str(path), "size": size, "cut_at": cut}


def arrow_boundaries(path: Path) -> list[int]:
    """Byte offsets where the messages of an Arrow stream end (the schema first)."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    reader = pa.ipc.MessageReader.open_stream(source)
    ends = []
    while True:
        try:
            reader.read_next_message()
        except StopIteration:
            return ends
        ends.append(source.tell())


def fault_disk(run: Run, sizes: dict[str, int]) -> None:
    mount = run.dir / "disk"
    mount.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs", str(mount)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        run.details["skipped"] = f"cannot mount a tmpfs: {mounted.stderr.strip() or mounted.returncode}"
        return
    run.cleanups.append(lambda: subprocess.run(["umount", "-l", str(mount)], check=False))
    filler, save = mount / "filler", run.details["save"]
    job = run.launch()
    if wait_for_step(run.rows, job, save - 2, run.timeout):
        expected = (
            sizes["estimate"]
            if save == SAVE_STEPS
            else checkpoint_bytes(run.output_dir / f"checkpoint-{save - SAVE_STEPS}")
        )
        with job.paused():  # nothing the job writes lands between the measure and the allocation
            run.details.update(fill(mount, filler, expected, sizes["checkpoint"]))
    run.finish(job)
    failed = run.seen(r"error: checkpoint-\d+ not saved: ")
    run.fault_t = failed[0][0] if failed else None
    filler.unlink(missing_ok=True)  # the space is freed...
    if failed:
        run.finish(run.launch())  # ...and the job started again


def checkpoint_bytes(checkpoint: Path, pages: bool = False) -> int:
    """The bytes of a checkpoint's files, as its manifest lists them (rounded up to whole pages: what
    they take on a tmpfs)."""
    sizes = [
        entry["size"] for entry in json.loads((checkpoint / "manifest.json").read_text())["files"].values()
    ]
    return sum(math.ceil(size / PAGE) * PAGE for size in sizes) if pages else sum(sizes)


def fill(mount: Path, filler: Path, expected: int, needed: int) -> dict[str, Any]:
    """A filler file that leaves free space between what the save's check expects and what the
    checkpoint takes in pages, so the check passes and a write fails (ENOSPC). A metrics row may take
    a page before the save: when the two are too close for that, it leaves less than expected (the
    save is then refused before it writes)."""
    if needed - expected >= 4 * PAGE:
        mode, target = "fails while writing", (expected + needed) // 2
    else:
        mode, target = "refused before writing", expected - 16 * PAGE
    free = shutil.disk_usage(mount).free
    size = max(free - target, PAGE) // PAGE * PAGE
    try:
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, size)
    except OSError as err:
        raise OSError(err.errno, f"a filler of {size} bytes with {free} free on {mount}: {err}") from err
    left = shutil.disk_usage(mount).free
    return {"planned": mode, "expected_bytes": expected, "checkpoint_bytes": needed, "free_bytes": left}


# ---- what a run came to --------------------------------------------------------------------------


def outcome(run: Run, reference: dict[str, Any]) -> dict[str, Any]:
    """The run's record: exit codes, whether it recovered and matches the reference, steps lost and
    restart time."""
    from trainer.checkpoint.snapshots import snapshot_dir

    final = run.output_dir / "final" / "model.safetensors"
    recovered = bool(run.exit_codes) and run.exit_codes[-1] == 0 and final.is_file()
    record: dict[str, Any] = {
        "run": run.index, "kind": run.kind, "details": run.details, "exit_codes": run.exit_codes,
        "fault_hit": fault_hit(run), "recovered": recovered,
        "bitwise_equal": same_weights(final, reference["weights"]) if recovered else False,
    }  # fmt: skip
    record.update(resume_facts(run))
    record["worker_exit_codes"] = [int(m.group(1)) for _, m in run.seen(WORKER_FAILED)]
    record["stop_lines"] = [m.group(0) for _, m in run.seen(STOP_LINE)]
    record["cache_lines"] = [m.string for _, m in run.seen(r"tokenised dataset cache \S+ is damaged")]
    record["snapshots_left"] = snapshot_dir(run.output_dir).exists()  # a finished job removes them
    if not recovered:
        record["output_tail"] = [line for _, line in run.lines[-60:]]
    return record


def fault_hit(run: Run) -> bool:
    """Whether the fault took effect (a run it missed says nothing about recovery)."""
    if run.kind == "kill":
        return run.fault_t is not None and bool(
            run.seen(RESUMED, run.fault_t) or run.seen(SCRATCH, run.fault_t)
        )
    pattern = {"sigterm": r"Preempted: saved checkpoint-\d+; exiting with 75", "nan": ROLLED_BACK.pattern,
               "disk": r"error: checkpoint-\d+ not saved: ", "cache": r"tokenised dataset cache \S+ is damaged"}  # fmt: skip
    return bool(run.seen(pattern[run.kind]))


def resume_facts(run: Run) -> dict[str, Any]:
    """Steps lost and restart time, from the resume (or rollback) lines after the fault and the
    metrics rows around them: the last step logged before the first resume, the step the job went
    on from in the last one, and the first step logged after that."""
    if run.fault_t is None:
        return {"steps_lost": None, "restart_s": None}
    resumes = sorted(run.seen(RESUMED, run.fault_t) + run.seen(SCRATCH, run.fault_t)
                     + run.seen(ROLLED_BACK, run.fault_t), key=lambda item: item[0])  # fmt: skip
    if not resumes:
        return {"steps_lost": None, "restart_s": None}
    steps = run.rows.steps()
    reached = [step for t, step in steps if t < resumes[0][0]]
    last_t, last = resumes[-1]
    resumed = 0 if last.re is SCRATCH else int(last.group(3) if last.re is ROLLED_BACK else last.group(2))
    source = "scratch" if last.re is SCRATCH else last.group(2 if last.re is ROLLED_BACK else 1)
    after = [(t, step) for t, step in steps if t >= last_t]
    return {
        "reached_step": reached[-1] if reached else 0,
        "resumed_step": resumed,
        "resumed_from": source,
        "steps_lost": (reached[-1] if reached else 0) - resumed,
        "first_step_after": after[0][1] if after else None,
        "restart_s": round(after[0][0] - run.fault_t, 2) if after else None,
    }


def load_weights(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path))


def same_weights(path: Path, reference: dict[str, Any]) -> bool:
    """torch.equal on every tensor (and the same names)."""
    import torch

    weights = load_weights(path)
    return weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in weights)


# ---- the report ----------------------------------------------------------------------------------


def summary(records: list[dict[str, Any]]) -> str:
    """The Markdown table: one row per kind (and per kill phase)."""
    lines = [
        "| fault | runs | fault hit | recovered | bitwise equal to the reference | steps lost mean / max "
        "| restart s mean / max |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        mine = [r for r in records if r["kind"] == kind]
        if mine:
            lines.append(summary_row(kind, mine))
        if kind == "kill":
            for phase in ("step", "save", "snapshot", "eval"):
                some = [r for r in mine if r["details"]["phase"] == phase]
                if some and len(some) < len(mine):
                    lines.append(summary_row(f"kill: {KILL_PHASES[phase]}", some))
    return "\n".join(lines)


KILL_PHASES = {"step": "after a step", "save": "in a save", "snapshot": "in a snapshot", "eval": "in an eval"}


def summary_row(label: str, records: list[dict[str, Any]]) -> str:
    skipped = [r for r in records if r["details"].get("skipped")]
    done = [r for r in records if not r["details"].get("skipped")]
    n = len(done)
    equal = sum(1 for r in done if r["bitwise_equal"])
    bitwise = f"{equal} yes / {n - equal} no"
    if label == "nan" and equal == 0:
        bitwise = f"0 yes / {n} {NAN_NOTE}"
    note = f" ({len(skipped)} skipped: {skipped[0]['details']['skipped']})" if skipped else ""
    return (
        f"| {label} | {n}{note} | {sum(1 for r in done if r['fault_hit'])}/{n} "
        f"| {sum(1 for r in done if r['recovered'])}/{n} | {bitwise} "
        f"| {mean_max([r.get('steps_lost') for r in done])} | {mean_max([r.get('restart_s') for r in done])} |"
    )


def mean_max(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "n/a"
    return f"{statistics.mean(known):.1f} / {max(known):g}"


def progress(record: dict[str, Any], total: int) -> str:
    details = ", ".join(f"{k}={v}" for k, v in record["details"].items() if k in PLAN_KEYS)
    if record["details"].get("skipped"):
        return (
            f"[{record['run']}/{total}] {record['kind']} ({details}): skipped, {record['details']['skipped']}"
        )
    bitwise = "yes" if record["bitwise_equal"] else (NAN_NOTE if record["kind"] == "nan" else "NO")
    return (
        f"[{record['run']}/{total}] {record['kind']} ({details}): exit codes {record['exit_codes']}, "
        f"fault hit {'yes' if record['fault_hit'] else 'NO'}, recovered {'yes' if record['recovered'] else 'NO'}, "
        f"bitwise equal {bitwise}, steps lost {record.get('steps_lost')}, restart {record.get('restart_s')} s, "
        f"{record['duration_s']:.0f} s"
    )


PLAN_KEYS = ("rank", "step", "phase", "save", "file", "cut", "cut_at", "planned")


# ---- the campaign --------------------------------------------------------------------------------


def seed_cache(cache: Path) -> None:
    """The campaign's own tokenisation cache, seeded with the user's tokenizers and tokenised stdlib
    at block size 64, so the reference does not have to build them (it does when they are missing)."""
    from trainer.data.sources import default_cache_root

    if cache.exists():
        return
    cache.mkdir(parents=True)
    shared = default_cache_root()
    for entry in sorted(shared.glob("tokenizer-bpe-*")) + sorted(shared.glob("text-*")):
        if not entry.is_dir():
            continue
        if entry.name.startswith("text-"):
            info = entry / "final" / "info.json"
            facts = json.loads(info.read_text()) if info.is_file() else {}
            if (facts.get("dataset"), facts.get("block_size")) != ("stdlib", 64):
                continue
        shutil.copytree(entry, cache / entry.name)


def reference_run(out: Path, flags: list[str], timeout: float) -> dict[str, Any]:
    """The uninterrupted run, and what the faults need from it."""
    from trainer.checkpoint.disk import estimated_checkpoint_bytes

    run = Run(0, "reference", {}, out / "reference", out / "reference" / "run", flags, timeout)
    shutil.rmtree(run.dir, ignore_errors=True)
    started = time.monotonic()
    code = run.finish(run.launch())
    run.rows.stop()
    final = run.output_dir / "final" / "model.safetensors"
    if code != 0 or not final.is_file():
        tail = "\n".join(line for _, line in run.lines[-60:])
        raise SystemExit(f"error: the reference run failed (exit {code}):\n{tail}")
    weights = load_weights(final)
    used = run.seen(CACHE_USED)
    return {
        "weights": weights,
        "exit_codes": run.exit_codes,
        "duration_s": round(time.monotonic() - started, 1),
        "cache": used[-1][1].group(1) if used else None,
        "estimate": estimated_checkpoint_bytes(sum(t.numel() for t in weights.values()), "fp32"),
        "checkpoint": checkpoint_bytes(run.output_dir / f"checkpoint-{2 * SAVE_STEPS}", pages=True),
    }


def run_one(index: int, kind: str, details: dict[str, Any], args: argparse.Namespace, flags: list[str],
            reference: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    run_dir = Path(args.out).resolve() / "runs" / f"{index:02d}-{kind}"
    shutil.rmtree(run_dir, ignore_errors=True)
    output_dir = run_dir / ("disk/run" if kind == "disk" else "run")
    extra = ["--nonfinite_policy", "rollback"] if kind == "nan" else []
    run = Run(index, kind, details, run_dir, output_dir, [*flags, *extra], args.timeout)
    started = time.monotonic()
    try:
        if kind == "kill":
            fault_kill(run)
        elif kind == "sigterm":
            fault_sigterm(run)
        elif kind == "nan":
            fault_nan(run)
        elif kind == "disk":
            fault_disk(run, {"estimate": reference["estimate"], "checkpoint": reference["checkpoint"]})
        else:
            fault_cache(run, Path(reference["cache"]) / details["file"])
        if run.rows is not None:
            run.rows.stop()
        record = (
            outcome(run, reference)
            if not details.get("skipped")
            else {"run": index, "kind": kind, "details": details}
        )
    finally:
        for job in run.jobs:  # left running only when the campaign itself is interrupted
            if job.proc.poll() is None:
                os.killpg(job.proc.pid, signal.SIGKILL)
        if run.rows is not None:
            run.rows.stop()
        tidy(run.output_dir, keep=args.keep)
        for cleanup in run.cleanups:
            cleanup()
    record["duration_s"] = round(time.monotonic() - started, 1)
    return record


def tidy(output_dir: Path, keep: bool) -> None:
    """Drop a finished run's checkpoints, export and snapshots; its logs and metrics stay."""
    from trainer.checkpoint.snapshots import snapshot_dir

    shutil.rmtree(snapshot_dir(output_dir), ignore_errors=True)
    if keep or not output_dir.is_dir():
        return
    for path in output_dir.iterdir():
        if path.is_dir() and (path.name.startswith(("checkpoint-", ".staging-")) or path.name == "final"):
            shutil.rmtree(path, ignore_errors=True)


def schedule(kinds: list[str], runs: int) -> list[str]:
    return [kinds[i % len(kinds)] for i in range(runs)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=len(KINDS), help="faulted runs (after the reference)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, from {', '.join(KINDS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default="output/fault_campaign", help="runs, logs, campaign.json, summary.md"
    )
    parser.add_argument("--no-snapshots", dest="snapshots", action="store_false",
                        help="train without --snapshot_steps 1 (kills then resume from disk checkpoints)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=600, help="seconds one launch may take")
    parser.add_argument("--keep", action="store_true", help="keep every run's checkpoints and export")
    args = parser.parse_args(argv)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown or not args.kinds or args.runs < 1:
        parser.error(f"--kinds: unknown {unknown}" if unknown else "nothing to run")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    seed_cache(out / "cache")
    flags = [
        *JOB_FLAGS,
        *(["--snapshot_steps", "1"] if args.snapshots else []),
        "--cache_dir",
        str(out / "cache"),
    ]
    print(
        f"reference run: torchrun --nproc_per_node 2 --max-restarts 3 scripts/train.py {' '.join(flags)}",
        flush=True,
    )
    reference = reference_run(out, flags, args.timeout)
    print(f"reference: {reference['duration_s']:.0f} s, tokenisation cache {reference['cache']}", flush=True)
    rng = random.Random(args.seed)
    records: list[dict[str, Any]] = []
    kinds = schedule(args.kinds, args.runs)
    for index, kind in enumerate(kinds, start=1):
        details = plan(kind, rng, args.snapshots, nth=kinds[: index - 1].count(kind))
        records.append(run_one(index, kind, details, args, flags, reference))
        print(progress(records[-1], args.runs), flush=True)
        write_report(out, args, flags, reference, records)
    table = summary(records)
    print(table)
    (out / "summary.md").write_text(table + "\n")
    failed = [
        r for r in records if not r["details"].get("skipped") and not (r["recovered"] and r["fault_hit"])
    ]
    return 1 if failed else 0


def write_report(out: Path, args: argparse.Namespace, flags: list[str], reference: dict[str, Any],
                 records: list[dict[str, Any]]) -> None:  # fmt: skip
    report = {
        "command": shlex.join(["python", "scripts/fault_campaign.py", *sys.argv[1:]]),
        "seed": args.seed, "runs": args.runs, "kinds": args.kinds, "snapshots": args.snapshots,
        "job": ["torchrun", "--nproc_per_node", "2", "--max-restarts", "3", "scripts/train.py", *flags],
        "reference": {k: v for k, v in reference.items() if k != "weights"},
        "records": records,
    }  # fmt: skip
    (out / "campaign.json").write_text(json.dumps(report, indent=1, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
