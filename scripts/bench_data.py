"""Benchmark: streamed data against map-style data and against re-reading, side by side in one run.

    python scripts/bench_data.py [--scale 20] [--resume_steps 10,100,1000] [--json FILE]

The corpus is the standard library's source ``--scale`` times over, in JSON-lines shards (the
default job reads it once). With one tokenizer trained beforehand, and a cold tokenisation cache:
- **first step**: seconds from ``python scripts/train.py`` to its first training row, map-style (the
  whole corpus tokenised and packed first) and with ``--streaming true``;
- **resume**: at each of ``--resume_steps`` steps of ``--global_batch`` blocks: ours, from the
  position a checkpoint records, through one block of every lane (each opened at its cursor, its
  shuffle window read again), against the uninterrupted stream reading the same blocks; re-reading
  the stream up to the step (what a Trainer that skips the batches it already trained does); and
  ``datasets``' ``IterableDataset.load_state_dict`` to its next row (its tokenised stream restored
  after as many documents, unshuffled);
- **loader**: one rank's stream (rank 0 of ``--nproc``) in tokens/s against what the default model
  consumes a rank, trained on ``--nproc`` ranks under the deepspeed launcher from the stream.

docs/benchmarks.md records the figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from trainer.args import DataArguments
from trainer.bench.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_data.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--scale", type=int, default=20, help="copies of the standard library in the corpus")
    p.add_argument("--resume_steps", default="10,100,1000", help="comma-separated steps to resume at")
    p.add_argument("--global_batch", type=int, default=16, help="blocks a step")
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--nproc", type=int, default=2, help="ranks of the loader's and the model's run")
    p.add_argument("--lanes", type=int, default=64, help="the stream's canonical lanes (stream_lanes)")
    p.add_argument("--train_steps", type=int, default=12, help="steps of the model's run")
    p.add_argument("--max_files", type=int, help="only the first N files of the standard library (tests)")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    work = Path(tempfile.mkdtemp(prefix="bench_data."))
    try:
        results = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def run(args: argparse.Namespace, work: Path) -> dict:
    # Here, not at the top: --help and a bad argument are answered without torch and the tokenizers.
    from trainer.bench.data import first_step_seconds, loader_tokens_per_second, resume_costs, write_corpus
    from trainer.data.sources import corpus_files
    from trainer.data.tokenizer import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer((p.read_text() for p in corpus_files()), 4096)
    tokenizer.save_pretrained(work / "tokenizer")
    corpus = write_corpus(work, args.scale, max_files=args.max_files)
    size = sum(f.stat().st_size for f in corpus.iterdir())
    common = [str(BIN / "python"), "scripts/train.py", "--dataset", str(corpus), "--tokenizer_name_or_path",
              str(work / "tokenizer"), "--block_size", str(args.block_size), "--eval_strategy", "no",
              "--save_steps", "100000", "--logging_steps", "1"]  # fmt: skip
    streamed = ["--streaming", "true", "--stream_lanes", str(args.lanes)]
    first = {}
    for name, extra in (
        ("map_style", ["--validation_split_percentage", "0"]),
        ("streamed", streamed),
    ):
        out = work / name
        cmd = [
            *common,
            *extra,
            "--max_steps",
            "1",
            "--output_dir",
            str(out),
            "--cache_dir",
            str(work / f"cache-{name}"),
        ]
        first[name] = first_step_seconds(cmd, out, cwd=ROOT)
    data_args = DataArguments(
        dataset=str(corpus), streaming=True, block_size=args.block_size, stream_lanes=args.lanes
    )
    steps = [int(s) for s in args.resume_steps.split(",")]
    resume = resume_costs(data_args, tokenizer, steps, args.global_batch)
    loader = loader_tokens_per_second(data_args, tokenizer, args.nproc)
    out = work / "model"
    launch = [str(BIN / "deepspeed"), "--num_gpus", str(args.nproc), "--master_port", str(free_port())]
    cmd = [*launch, *common[1:], *streamed, "--max_steps", str(args.train_steps),
           "--output_dir", str(out), "--cache_dir", str(work / "cache-model")]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [r["tokens_per_second"] for r in rows if "loss" in r][2:]  # past the first steps' start-up
    model = sum(steady) / len(steady) / args.nproc
    return {
        "corpus": {"scale": args.scale, "bytes": size, "files": len(list(corpus.iterdir()))},
        "first_step_s": first,
        "resume_s": {str(k): v for k, v in resume.items()},
        "loader_tokens_per_second_per_rank": loader,
        "model_tokens_per_second_per_rank": model,
    }


def report(r: dict) -> str:
    first, corpus = r["first_step_s"], r["corpus"]
    lines = [
        f"corpus: the standard library x{corpus['scale']}, {corpus['bytes'] / 1e6:.0f} MB in {corpus['files']} shards",
        f"first step: map-style {first['map_style']:.1f} s, streamed {first['streamed']:.1f} s "
        f"({first['map_style'] / first['streamed']:.1f}x sooner)",
        "",
        "| resume at step | ours: a block of every lane | the same blocks, uninterrupted | re-reading to the step "
        "| HF's Trainer: skip_first_batches, then a batch | datasets' state_dict: its next row |",
        "|---|---|---|---|---|---|",
    ]
    for step, c in r["resume_s"].items():
        lines.append(
            f"| {step} | {c['ours_s']:.2f} s | {c['uninterrupted_s']:.2f} s | {c['reread_s']:.2f} s "
            f"| {c['hf_trainer_s']:.2f} s | {c['datasets_state_dict_s']:.2f} s |"
        )
    loader, model = r["loader_tokens_per_second_per_rank"], r["model_tokens_per_second_per_rank"]
    lines += [
        "",
        f"loader {loader:,.0f} tokens/s a rank, model {model:,.0f} tokens/s a rank ({loader / model:.1f}x)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
