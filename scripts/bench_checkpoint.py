"""Checkpoint save speed against the disk, and how long a save blocks the training loop.

    python scripts/bench_checkpoint.py [--hidden_size 512 --layers 8] [--zero_stage 0] [--json FILE]
    deepspeed --num_gpus N scripts/bench_checkpoint.py ...      (every rank writes its shards)

One run measures, side by side and in alternating order (``--repeats`` rounds of each):

- **raw disk**: the checkpoint's byte count written to the same directory as one plain file,
  in 4 MiB writes, then fsynced; and ``dd`` with ``conv=fsync`` when the machine has it;
- **sync save**: ``Saver.save`` with ``async_save`` off: DeepSpeed's shards, RNG and trainer state
  through the staging directory, every file checksummed and fsynced, manifest, rename, marker;
- **async save**: the same save with ``async_save`` on. The loop is blocked while the state is
  copied to host memory, then trains on while the writer thread writes; once every rank is written
  the commit runs. Blocked time = the copy + the commit, not the steps trained in between;
- **snapshot**: a flash snapshot (``--snapshot_steps``): the async save into ``/dev/shm``.

The plain write runs next to the sync save in every round, and ``save_vs_raw`` is the median of
the rounds' paired ratios (plain write time / save time): on a machine whose disk others share,
a ratio of medians taken minutes apart says more about the neighbours than about the save.

Throughput is the checkpoint's bytes (all ranks) over the slowest rank's wall time. The model is
a Llama built from a config; one optimizer step runs first so that the Adam moments exist.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from trainer import checkpoint as ckpt
from trainer.args import TrainingArguments
from trainer.checkpoint.snapshots import Snapshots
from trainer.engine import DeepSpeedEngine, Engine
from trainer.loop.callbacks import TrainerState
from trainer.loop.plan import plan_run
from trainer.runtime.distributed import DistInfo, barrier, detect_hardware, host_all_reduce, init_distributed

CHUNK = 4 << 20


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden_size", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab_size", type=int, default=32000)
    p.add_argument("--zero_stage", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--repeats", type=int, default=3, help="rounds of each measurement (median reported)")
    p.add_argument(
        "--out", default="output/bench-checkpoint", help="directory written to (on the disk measured)"
    )
    p.add_argument("--json", type=Path, help="also write the figures as one JSON object")
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return p.parse_args(argv)


def build_engine(
    args: argparse.Namespace, train_args: TrainingArguments, info: DistInfo
) -> tuple[Engine, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden_size // 64, 1),
        vocab_size=args.vocab_size,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    # The run's plan, as a run of these arguments makes it (no data: a 10-step schedule).
    plan = plan_run(
        train_args, detect_hardware(), info, num_samples=None, total_steps=10, hidden_size=args.hidden_size
    )
    ds_config = plan.ds_config
    engine = DeepSpeedEngine(LlamaForCausalLM(config), ds_config, plan.mesh, weight_decay=0.0)
    train_step(engine, one_batch(args.vocab_size))
    return engine, ds_config


def train_step(engine: Engine, batch: dict[str, torch.Tensor]) -> None:
    """One optimizer step on one micro-batch, its target tokens summed over the ranks first (the
    Trainer's per-step vote)."""
    window = [batch]
    engine.train_window(window, max(host_all_reduce([engine.local_targets(window)])[0], 1.0))


def one_batch(vocab_size: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab_size, (1, 32))
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def slowest(seconds: float) -> float:
    """The slowest rank's time: a save is done when its last rank is."""
    t = torch.tensor([seconds], dtype=torch.float64)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def raw_write(directory: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` of incompressible data as one file and fsync it."""
    block = os.urandom(CHUNK)
    path = directory / f"raw-{os.getpid()}.bin"
    start = time.perf_counter()
    with path.open("wb") as f:
        for offset in range(0, nbytes, CHUNK):
            f.write(block[: min(CHUNK, nbytes - offset)])
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def dd_write(directory: Path, nbytes: int) -> float | None:
    if shutil.which("dd") is None:
        return None
    path = directory / f"dd-{os.getpid()}.bin"
    count = max(nbytes // CHUNK, 1)
    start = time.perf_counter()
    cmd = ["dd", "if=/dev/zero", f"of={path}", f"bs={CHUNK}", f"count={count}", "conv=fsync", "status=none"]
    subprocess.run(cmd, check=True)
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed * nbytes / (count * CHUNK)


def checkpoint_bytes(path: Path) -> int:
    return sum(entry["size"] for entry in ckpt.read_manifest(path)["files"].values())


def timed_raw(out: Path, world: int) -> float:
    """The newest checkpoint's byte count as plain writes: every rank writes its share at once, as
    in a save; the slowest rank's time."""
    share = checkpoint_bytes(ckpt.complete_checkpoints(out)[-1]) // world
    barrier("bench:raw")
    return slowest(raw_write(out, share))


def timed_save(engine: Engine, saver: ckpt.Saver, state: TrainerState) -> dict[str, float]:
    """One save; for an async one, the loop trains on until every rank has written."""
    barrier("bench:save")
    start = time.perf_counter()
    committed = saver.save(engine, state)
    blocked = time.perf_counter() - start
    steps = 0
    if committed is None:  # asynchronous: train while the writer works, voting as the Trainer's loop does
        batch = one_batch(engine.module.config.vocab_size)
        while committed is None:
            (written,) = host_all_reduce([float(saver.written())])
            before_commit = time.perf_counter()
            committed = saver.commit_if_written(written)
            if committed is None:
                train_step(engine, batch)
                steps += 1
        blocked += time.perf_counter() - before_commit
    total = time.perf_counter() - start
    return {"blocked_s": slowest(blocked), "total_s": slowest(total), "steps_meanwhile": steps}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    info = init_distributed(detect_hardware())
    out = Path(args.out).resolve()
    if info.is_main:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    barrier("bench:prepare")
    base = dict(output_dir=str(out), zero_stage=args.zero_stage, per_device_train_batch_size=1)
    engines_args = {mode: TrainingArguments(**base, async_save=mode == "async") for mode in ("sync", "async")}
    engine, ds_config = build_engine(args, engines_args["sync"], info)
    savers = {mode: ckpt.Saver(a, info, ds_config, None) for mode, a in engines_args.items()}
    snapshots = Snapshots(TrainingArguments(**base, snapshot_steps=1), info, ds_config, None)
    savers["snapshot"] = snapshots.saver
    state = TrainerState()
    rows: dict[str, list[dict[str, float]]] = {"sync": [], "async": [], "snapshot": []}
    raw: list[float] = []
    dd: list[float] = []
    for repeat in range(args.repeats):
        # The plain write runs right after the synchronous save (right before it in odd rounds), so
        # both see the same load on a shared machine; save_vs_raw is the median of the rounds' ratios.
        for mode in ("snapshot", "async", "sync", "raw")[:: 1 if repeat % 2 == 0 else -1]:
            if mode == "raw":
                raw.append(timed_raw(out, info.world_size))
            else:
                state.global_step += 1
                rows[mode].append(timed_save(engine, savers[mode], state))
        if info.is_main:  # old checkpoints go outside the timed part
            for old in ckpt.complete_checkpoints(out)[:-1]:
                shutil.rmtree(old)
        barrier("bench:dd")
        took = dd_write(out, checkpoint_bytes(ckpt.complete_checkpoints(out)[-1]) // info.world_size)
        if took is not None:
            dd.append(slowest(took))
    nbytes = checkpoint_bytes(ckpt.complete_checkpoints(out)[-1])
    snapshots.release()
    report = summarise(args, info.world_size, nbytes, rows, raw, dd, engine)
    if info.is_main:
        print(format_report(report))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1) + "\n")
    barrier("bench:done")
    return 0


def summarise(args, world, nbytes, rows, raw, dd, engine) -> dict:
    gb = nbytes / 1e9
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in rows.items()}
    report = {
        "model_params": engine.parameter_counts()[1],
        "zero_stage": args.zero_stage,
        "world_size": world,
        "checkpoint_bytes": nbytes,
        "repeats": args.repeats,
        "raw_write_gbps": gb / statistics.median(raw),
        "dd_gbps": gb / statistics.median(dd) if dd else None,
        "sync_save_gbps": gb / med["sync"]["total_s"],
        "async_save_gbps": gb / med["async"]["total_s"],
        "sync": med["sync"],
        "async": med["async"],
        "snapshot": med["snapshot"],
    }
    report["save_vs_raw_rounds"] = [t / r["total_s"] for t, r in zip(raw, rows["sync"], strict=True)]
    report["save_vs_raw"] = statistics.median(report["save_vs_raw_rounds"])
    report["async_blocked_vs_sync"] = med["async"]["blocked_s"] / med["sync"]["blocked_s"]
    report["snapshot_blocked_vs_sync"] = med["snapshot"]["blocked_s"] / med["sync"]["blocked_s"]
    return report


def format_report(r: dict) -> str:
    dd = f"{r['dd_gbps']:.2f} GB/s" if r["dd_gbps"] else "n/a"
    return "\n".join(
        [
            f"checkpoint: {r['checkpoint_bytes'] / 1e9:.3f} GB ({r['model_params'] / 1e6:.1f}M params, ZeRO-{r['zero_stage']}, "
            f"{r['world_size']} rank(s)), median of {r['repeats']}",
            f"raw disk write + fsync: {r['raw_write_gbps']:.2f} GB/s   dd conv=fsync: {dd}",
            f"sync save:  {r['sync_save_gbps']:.2f} GB/s ({r['save_vs_raw']:.2f}x the plain write beside it); loop blocked {r['sync']['blocked_s']:.2f} s",
            f"async save: loop blocked {r['async']['blocked_s']:.2f} s ({r['async_blocked_vs_sync']:.2f}x sync), "
            f"committed after {r['async']['total_s']:.2f} s, {r['async']['steps_meanwhile']:.0f} steps trained meanwhile",
            f"snapshot (/dev/shm): loop blocked {r['snapshot']['blocked_s']:.2f} s ({r['snapshot_blocked_vs_sync']:.2f}x "
            f"sync), committed after {r['snapshot']['total_s']:.2f} s",
        ]
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
