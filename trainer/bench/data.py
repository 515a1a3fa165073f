"""The data benchmark's parts (``scripts/bench_data.py``): a corpus ``scale`` times the default job's,
the time from launch to the first step (streamed against map-style), the cost of resuming a stream
at a step (ours against re-reading to it, against HF's Trainer resuming run_clm's streamed pipeline
and against ``datasets``' own ``state_dict``), and the loader's tokens/s against the model's."""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
import time
from itertools import chain
from pathlib import Path
from typing import Any

from trainer.data.sources import corpus_files
from trainer.data.stream import StreamPosition
from trainer.data.stream_sources import build_stream, stream_sources


def write_corpus(root: Path, scale: int, shards: int = 16, max_files: int | None = None) -> Path:
    """The standard library's source (its first ``max_files`` files) ``scale`` times over, each copy
    in another order of files, as ``shards`` JSON-lines files: a corpus ``scale`` times the default
    job's."""
    folder = root / f"corpus-x{scale}"
    folder.mkdir(parents=True, exist_ok=True)
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in corpus_files()[:max_files]]
    outs = [(folder / f"part-{k:03d}.jsonl").open("w") for k in range(shards)]
    n = 0
    for copy in range(scale):
        order = list(range(len(texts)))
        random.Random(copy).shuffle(order)
        for i in order:
            outs[n % shards].write(json.dumps({"text": texts[i]}) + "\n")
            n += 1
    for f in outs:
        f.close()
    return folder


def first_step_seconds(cmd: list[str], out: Path, cwd: Path, timeout: float = 3600) -> float:
    """Seconds from starting ``cmd`` (in ``cwd``) to the first training row in ``out/metrics.jsonl``."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    while time.perf_counter() - start < timeout:
        if metrics.exists() and '"loss"' in metrics.read_text():
            seconds = time.perf_counter() - start
            proc.wait(timeout=timeout)
            return seconds
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(cmd)} ended without a step: {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    proc.kill()
    raise TimeoutError(" ".join(cmd))


def _timed(blocks: Any, n: int) -> tuple[float, list[dict[str, Any]]]:
    start = time.perf_counter()
    got = [next(blocks) for _ in range(n)]
    return time.perf_counter() - start, got


def resume_costs(
    data_args: Any, tokenizer: Any, steps: list[int], global_batch: int
) -> dict[int, dict[str, Any]]:
    """Per step: ours (a resume from the recorded position through one block of every lane, against
    the uninterrupted stream reading the same blocks), re-reading the stream to the step (what a
    Trainer that skips batches does) and ``datasets``' ``load_state_dict`` (its streamed, tokenised
    dataset restored after the same number of documents, to its next row)."""
    import datasets

    costs: dict[int, dict[str, Any]] = {}
    files = [str(f) for s in stream_sources(data_args) for f in s.files]
    for step in steps:
        samples = step * global_batch
        reader = StreamPosition(build_stream(data_args, tokenizer, 0, 1 << 60, shuffle=True), 1, 0)
        reader.set_epoch(0)
        start = time.perf_counter()
        blocks = reader.blocks()
        for _ in range(samples):
            next(blocks)
        reread = time.perf_counter() - start
        saved = reader.position(samples)
        resumed = StreamPosition(build_stream(data_args, tokenizer, 0, 1 << 60, shuffle=True), 1, 0)
        resumed.set_epoch(0, samples, saved)
        # A round of the lanes (each opened at its cursor, its window read again), against the same
        # blocks read on by the uninterrupted stream.
        ours, got = _timed(resumed.blocks(), resumed.stream.lanes)
        steady, want = _timed(blocks, resumed.stream.lanes)
        hf = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
        hf = hf.map(lambda row: {"ids": tokenizer(row["text"])["input_ids"]}, remove_columns=["text"])
        it = iter(hf)
        for _ in range(documents_read(saved, resumed.stream)):  # as many documents as ours had read
            next(it)
        state = hf.state_dict()
        again = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
        again = again.map(lambda row: {"ids": tokenizer(row["text"])["input_ids"]}, remove_columns=["text"])
        start = time.perf_counter()
        again.load_state_dict(state)
        first = next(iter(again))
        costs[step] = {
            "ours_s": ours,
            "uninterrupted_s": steady,
            "reread_s": reread,
            "hf_trainer_s": hf_trainer_resume_seconds(
                files, tokenizer, data_args.block_size, global_batch, step
            ),
            "datasets_state_dict_s": time.perf_counter() - start,
            "ours_same_block": got == want,
            "datasets_same_row": first == next(it),
        }
    return costs


def hf_trainer_resume_seconds(
    files: list[str], tokenizer: Any, block_size: int, batch: int, step: int
) -> float:
    """What HF's Trainer does with the data to resume at ``step`` (one process, no accumulation):
    its train DataLoader over run_clm's ``--streaming`` pipeline (the files streamed by
    ``load_dataset``, tokenised, grouped into blocks), ``step`` batches skipped by accelerate's
    ``skip_first_batches`` as its resume skips them, then its next batch."""
    import datasets
    import transformers
    from accelerate import skip_first_batches

    def group(examples: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        joined = {k: list(chain(*examples[k])) for k in examples}
        usable = len(joined["input_ids"]) // block_size * block_size
        return {
            k: [ids[i : i + block_size] for i in range(0, usable, block_size)] for k, ids in joined.items()
        }

    raw = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
    blocks = raw.map(lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"]).map(
        group, batched=True
    )
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=batch, max_steps=step + 1,
                                              report_to="none", use_cpu=True)  # fmt: skip
        trainer = transformers.Trainer(model=transformers.LlamaForCausalLM(config), args=args, train_dataset=blocks,
                                       data_collator=transformers.default_data_collator)  # fmt: skip
        loader = trainer.get_train_dataloader()
        start = time.perf_counter()
        next(iter(skip_first_batches(loader, step)))
        return time.perf_counter() - start


def documents_read(saved: dict[str, Any], stream: Any) -> int:
    """The documents a recorded position had read (at its lanes' window starts), at least 1: with
    fewer files than lanes, every lane passes every row and keeps one in ``lanes``."""
    every = {s.name: 1 if len(s.files) >= stream.lanes else stream.lanes for s in stream.sources}
    starts = [lane["start"]["sources"] for lane in saved["lanes"].values()]
    return max(sum(c[name]["seen"] // every[name] for c in starts for name in c), 1)


def loader_tokens_per_second(data_args: Any, tokenizer: Any, readers: int, blocks: int = 400) -> float:
    """One rank's stream (rank 0 of ``readers``) read on its own: tokens a second."""
    position = StreamPosition(build_stream(data_args, tokenizer, 0, 1 << 60, shuffle=True), readers, 0)
    position.set_epoch(0)
    it = position.blocks()
    next(it)  # the files opened
    start = time.perf_counter()
    tokens = sum(len(next(it)["input_ids"]) for _ in range(blocks))
    return tokens / (time.perf_counter() - start)
