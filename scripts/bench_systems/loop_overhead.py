"""The cost of the loop around the engine, without the model: our Trainer against a bare loop.

    deepspeed --num_gpus 2 scripts/bench_systems/loop_overhead.py [--steps 2000]

Both read the same blocks through the same DataLoader and sampler and sum the window's target
tokens over the ranks as our engine does; the forward, backward and optimizer step are left out
(the Trainer's engine gets a ``train_window`` that only counts tokens). What remains per step is the
Python and host work a loop adds: callbacks, state, the throughput timer, the per-step votes. A
third line times one host all-reduce on the gloo control group, the unit those votes cost.

The full benchmark (scripts/bench.py) cannot resolve differences this small on a shared CPU; this
measures them directly. Results are printed per rank.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_systems.job import BlockDataset, Job, collate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", default="output/loop-overhead")
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()

    import deepspeed
    import torch
    from torch.utils.data import DataLoader

    import trainer.engine as engine_module
    from trainer import Trainer
    from trainer.callbacks import TrainerCallback
    from trainer.data import ResumableDistributedSampler
    from trainer.distributed import dist_info, host_all_reduce

    info = dist_info()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    steps, micro = args.steps, 4
    dataset = BlockDataset(torch.randint(0, 100, (steps * micro * info.world_size, 32)))

    def count_only(self, window, **_):
        return torch.zeros(()), self.window_targets(window)

    engine_module.Engine.train_window = count_only
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

    clock = Clock()
    trainer = Trainer(
        model=job.build_model(job.ds_config()),
        args=job.training_args(job.out_dir),
        train_dataset=dataset,
        data_collator=collate,
        callbacks=[clock],
    )
    trainer.train()
    report(info.rank, "our Trainer loop", clock.wall, clock.cpu, steps)
    sampler = ResumableDistributedSampler(len(dataset), info.world_size, info.rank, seed=42)
    loader = DataLoader(dataset, batch_size=micro, sampler=sampler, collate_fn=collate)
    timed(info.rank, "bare loop", steps, lambda: [count_only(trainer.engine, [batch]) for batch in loader])
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
    main()
