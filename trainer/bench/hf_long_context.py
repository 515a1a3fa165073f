"""HF's side of ``scripts/bench_long_context.py``: a few steps of ``transformers.Trainer`` on long rows.

    python -m trainer.bench.hf_long_context --output_dir D --blocks B.npy --model_config C.json \
        --ds_config DS.json --steps 2 [--sp 2] [--gradient_checkpointing] [--bf16]
    deepspeed --num_gpus 2 --module trainer.bench.hf_long_context ... --sp 2

An ordinary HF training script, written as its users write one: a Llama built from a config
(``LlamaForCausalLM(config)``), a ``datasets.Dataset`` of token rows whose labels are the inputs,
``TrainingArguments(deepspeed=<dict>)`` and ``Trainer(...).train()``. Nothing of ``trainer`` (our
package) is imported; the benchmark hands over the same model config, DeepSpeed dict and token rows
that our run gets, as files.

``--sp N`` turns on HF's own Ulysses sequence parallelism (ALST): ``TrainingArguments(
parallelism_config=ParallelismConfig(sp_size=N, sp_backend="deepspeed"))`` from accelerate, which
registers DeepSpeed's ``UlyssesSPAttentionHF`` with transformers and shards each row over the N ranks
with ``UlyssesSPDataLoaderAdapter``.

Each step's wall time is taken at ``on_step_end``; rank 0 writes ``OUTPUT_DIR/metrics.jsonl`` with
the fields the benchmark reads from our runs: ``step``, ``step_time_s``, ``tokens_per_second``
(tokens of one optimizer step over its time), ``host_peak_rss_bytes`` and, on a GPU,
``peak_memory_allocated_bytes``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m trainer.bench.hf_long_context", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--output_dir", required=True)
    p.add_argument("--blocks", required=True, help=".npy of token rows [rows, seq_len]")
    p.add_argument("--model_config", required=True, help="JSON of the LlamaConfig fields")
    p.add_argument("--ds_config", required=True, help="JSON of the DeepSpeed config")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--sp", type=int, default=1, help="Ulysses sequence parallel size (HF's ALST)")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return p.parse_args(argv)


def _host_peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    rows = np.load(args.blocks)
    seq_len = int(rows.shape[1])
    dataset = Dataset.from_dict({"input_ids": rows.tolist()})

    def collate(batch: list[dict]) -> dict:
        ids = torch.tensor([row["input_ids"] for row in batch], dtype=torch.long)
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}

    config = LlamaConfig(**json.loads(Path(args.model_config).read_text()))
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    ds_config = json.loads(Path(args.ds_config).read_text())

    extra = {}
    if args.sp > 1:
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        extra["parallelism_config"] = ParallelismConfig(
            sp_size=args.sp,
            sp_backend="deepspeed",
            sp_handler=DeepSpeedSequenceParallelConfig(
                sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"
            ),
        )
    if args.gradient_checkpointing:  # only when asked: transformers 5 warns that the name is deprecated
        extra.update(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    # HF refuses a DeepSpeed value that differs from its own argument: state the dict's values.
    adam = ds_config.get("optimizer", {}).get("params", {})
    schedule = ds_config.get("scheduler", {}).get("params", {})
    betas = adam.get("betas", (0.9, 0.999))
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=ds_config,
        max_steps=args.steps,
        per_device_train_batch_size=ds_config.get("train_micro_batch_size_per_gpu", 1),
        gradient_accumulation_steps=ds_config.get("gradient_accumulation_steps", 1),
        learning_rate=adam.get("lr", args.learning_rate),
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_epsilon=adam.get("eps", 1e-8),
        weight_decay=adam.get("weight_decay", 0.0),
        max_grad_norm=ds_config.get("gradient_clipping", 1.0),
        lr_scheduler_type="cosine",
        warmup_steps=schedule.get("warmup_num_steps", 0),
        bf16=args.bf16,
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        **extra,
    )

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokens_per_step = seq_len * max(1, world // args.sp)
    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            times.append(time.perf_counter())

        def on_step_end(self, a, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter())

    # The row length the model is given: seq_len, or seq_len / sp when HF's SP shards the rows.
    seen: list[int] = []
    model.register_forward_pre_hook(
        lambda module, a, kw: seen.append(int(kw["input_ids"].shape[1])) if "input_ids" in kw else None,
        with_kwargs=True,
    )
    trainer = Trainer(
        model=model, args=training_args, train_dataset=dataset, data_collator=collate, callbacks=[StepTimes()]
    )
    trainer.train()

    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        with (out / "metrics.jsonl").open("w") as f:
            for step, (begin, end) in enumerate(zip(times, times[1:], strict=False), start=1):
                row = {
                    "step": step,
                    "step_time_s": end - begin,
                    "tokens_per_second": tokens_per_step / (end - begin),
                    "host_peak_rss_bytes": _host_peak_rss(),
                    "sp_size": args.sp,
                    "accelerate_processes": trainer.accelerator.num_processes,
                    "model_input_tokens": seen[step - 1] if step <= len(seen) else None,
                }
                if torch.cuda.is_available():
                    row["peak_memory_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
                f.write(json.dumps(row) + "\n")
    # Leave the process group before the interpreter's teardown, as our CLI does: gloo's threads
    # destroyed at exit aborted a finished run now and then ("terminate called without an active
    # exception").
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
