"""The cost of the loop around the engine, without the model: our Trainer against a bare loop.

    deepspeed --num_gpus 2 --module trainer.bench.loop_overhead [--steps 2000]

Both read the same blocks through the same DataLoader and sampler and sum the window's target
tokens over the ranks with one host all-reduce, as our Trainer's per-step vote does; the forward,
backward and optimizer step are left out (once the Trainer has built its engine, a callback wraps it
in ``CountOnlyEngine``, whose ``train_window`` returns a zero loss and runs nothing). What remains per
step is the Python and host work a loop adds: callbacks, state, the throughput timer, the per-step
vote. A third line times one host all-reduce on the gloo control group, the unit that vote costs.

The full benchmark (scripts/bench.py) cannot resolve differences this small on a shared CPU; this
measures them directly. Results are printed per rank.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from trainer.bench.job import BlockDataset, Job, collate
from trainer.cli.main import exit_now
from trainer.loop.callbacks import TrainerCallback
from trainer.runtime.distributed import host_all_reduce


def count_only(engine: Any, window: list[dict[str, Any]]) -> float:
    """The bare loop's step: the window's target tokens on all ranks (the engine's host-side count,
    summed over the gloo control group), as the Trainer's vote has them before each step."""
    return max(host_all_reduce([engine.local_targets(window)])[0], 1.0)


class CountOnlyEngine:
    """The Trainer's engine with the model left out: ``train_window`` returns a zero loss without a
    forward, backward or optimizer step (the loop's vote has counted the window's tokens already);
    every other attribute, read or written, is the wrapped engine's."""

    def __init__(self, engine: Any):
        object.__setattr__(self, "_engine", engine)

    def train_window(self, window: list[dict[str, Any]], *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros((), device=self._engine.device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._engine, name, value)


class LeaveOutTheModel(TrainerCallback):
    """At train begin (the Trainer has built its engine by then), wraps ``trainer.engine`` in a
    ``CountOnlyEngine``; ``engine`` keeps the engine itself."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.engine: Any = None

    def on_train_begin(self, *a, **k):
        if self.engine is None:
            self.engine = self.trainer.engine
            self.trainer.engine = CountOnlyEngine(self.engine)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", default="output/loop-overhead")
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()

    import deepspeed
    from torch.utils.data import DataLoader

    from trainer.data import ResumableDistributedSampler
    from trainer.loop.build import build_run
    from trainer.runtime.distributed import dist_info

    info = dist_info()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    steps, micro = args.steps, 4
    dataset = BlockDataset(torch.randint(0, 100, (steps * micro * info.world_size, 32)))

    job = Job(
        device="cpu", model="tiny", vocab_size=100, seq_len=32, micro_batch=micro, grad_accum=1, steps=steps,
        warmup=0, chunk=steps, zero_stage=0, precision="fp32", gradient_checkpointing=False, seed=42,
        learning_rate=1e-3, lr_warmup_steps=1, data_path="", world_size=info.world_size,
        out_dir=f"{args.out}/rank{info.rank}",
    )  # fmt: skip

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_train_end(self, *a, **k):
            self.wall, self.cpu = time.perf_counter() - self.t0, time.process_time() - self.c0

    trainer = build_run(
        job.run_config(job.out_dir), train_dataset=dataset, config=job.model_config(), data_collator=collate
    )
    without_model, clock = LeaveOutTheModel(trainer), Clock()
    trainer.add_callback(without_model)  # before the clock: the clock starts on the wrapped engine
    trainer.add_callback(clock)
    trainer.train()
    report(info.rank, "our Trainer loop", clock.wall, clock.cpu, steps)
    sampler = ResumableDistributedSampler(len(dataset), info.world_size, info.rank, seed=42)
    loader = DataLoader(dataset, batch_size=micro, sampler=sampler, collate_fn=collate)
    engine = without_model.engine  # the bare loop counts with the engine itself, not the wrapper
    timed(info.rank, "bare loop", steps, lambda: [count_only(engine, [batch]) for batch in loader])
    timed(info.rank, "one host all-reduce", steps, lambda: [host_all_reduce([0.0]) for _ in range(steps)])


def timed(rank: int, what: str, steps: int, body) -> None:
    import torch.distributed as dist

    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    body()
    report(rank, what, time.perf_counter() - t0, time.process_time() - c0, steps)


def report(rank: int, what: str, wall: float, cpu: float, steps: int) -> None:
    print(
        f"rank {rank}: {what:<20} {wall / steps * 1e6:8.1f} us wall {cpu / steps * 1e6:8.1f} us CPU per step",
        flush=True,
    )


if __name__ == "__main__":
    exit_now(main())
