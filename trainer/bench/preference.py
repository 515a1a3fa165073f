"""The preference benchmark's two halves: the job it prepares once (a Llama saved with its tokenizer,
and pairs cut from the standard library's source), and the worker each rank of a system runs.

    python -m trainer.bench.preference prepare ROOT --hidden_size H --layers L --vocab_size V --pairs N
    torchrun ... -m trainer.bench.preference worker ROOT SYSTEM OUT --zero_stage S --steps N ...

Systems: ``ours`` (``trainer.DPOTrainer``: the reference scored once before the first step by the
training engine, then no reference model), ``ours_ref_model`` (the same with the base given as
``ref_model``: a frozen reference engine of its own, partitioned under ZeRO-3, scores the pass and is
let go) and ``trl`` (``trl.DPOTrainer`` on DeepSpeed through HF's Trainer, TRL's default: a
reference model beside the policy, a forward of it every step, under ZeRO-3 partitioned). The
worker writes ``OUT/result.json``: every step's wall time, the reference pass's time (ours) and the
losses. scripts/bench_preference.py runs both and reports the ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

SYSTEMS = ("ours", "ours_ref_model", "trl")


def prepare(root: Path, hidden_size: int, layers: int, vocab_size: int, pairs: int, seed: int,
            answer_chars: int = 0, model_vocab: int = 0) -> None:  # fmt: skip
    """``root/base`` (the model and its tokenizer) and ``root/pairs.jsonl``: prompts are lines of
    the standard library's source, chosen answers the line that follows, rejected ones a line drawn
    from elsewhere. ``answer_chars``: long pairs instead (for the longest-pair search), each answer
    that many characters of a source file, the chosen one the prompt's own file, the rejected one
    another's. ``model_vocab``: the model's vocabulary, when larger than the tokenizer's (logits as
    wide as a real model's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.args import DataArguments, ModelArguments
    from trainer.data import get_tokenizer
    from trainer.data.sources import corpus_files

    tokenizer = get_tokenizer(ModelArguments(vocab_size=vocab_size), DataArguments(dataset="stdlib"))
    lines = [
        line.strip()
        for path in corpus_files()[:400]
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines()
        if 20 <= len(line.strip()) <= 100
    ]
    rng = random.Random(seed)
    rows = []
    if answer_chars:
        texts = [t for t in (p.read_text(encoding="utf-8", errors="replace") for p in corpus_files())
                 if len(t) > 2 * answer_chars]  # fmt: skip
        for _ in range(pairs):
            text, other = rng.sample(texts, 2)
            prompt, chosen = text[:80], text[80 : 80 + answer_chars]
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": other[:answer_chars]})
    for _ in range(pairs if not answer_chars else 0):
        i = rng.randrange(len(lines) - 1)
        rows.append({"prompt": lines[i], "chosen": " " + lines[i + 1], "rejected": " " + rng.choice(lines)})
    root.mkdir(parents=True, exist_ok=True)
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = LlamaConfig(
        vocab_size=max(len(tokenizer), model_vocab), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=max(hidden_size // 64, 1),
        num_key_value_heads=max(hidden_size // 64, 1), max_position_embeddings=65536 if answer_chars else 1024,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")


def worker(root: Path, system: str, out: Path, opts: argparse.Namespace) -> None:
    import datasets
    import torch
    from transformers import AutoTokenizer

    from trainer.runtime.distributed import dist_info

    clock = StepClock()
    rows = datasets.load_dataset("json", data_files=str(root / "pairs.jsonl"), split="train")
    tokenizer = AutoTokenizer.from_pretrained(root / "base")
    common = dict(
        output_dir=str(out), max_steps=opts.steps, per_device_train_batch_size=opts.pairs_per_rank,
        learning_rate=opts.learning_rate, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0, gradient_checkpointing=opts.gradient_checkpointing,
        bf16=False, max_length=opts.max_length, beta=0.1, per_device_eval_batch_size=opts.eval_batch_size,
    )  # fmt: skip
    started = time.perf_counter()
    if system.startswith("ours"):
        from trainer import DPOConfig, DPOTrainer

        long = {
            "tiled_loss": "true" if opts.tiled else "false",
            "sequence_parallel_size": opts.sequence_parallel_size,
        }
        # fp32 as TRL's bf16=False: ours's precision "auto" would pick bf16 on a CPU with bf16 instructions.
        args = DPOConfig(**common, zero_stage=opts.zero_stage, precision="fp32", **long)
        reference = str(root / "base") if system == "ours_ref_model" else None
        trainer = DPOTrainer(str(root / "base"), reference, args=args, train_dataset=rows,
                             processing_class=tokenizer, callbacks=[clock.callback()])  # fmt: skip
    else:
        import trl

        # On CPU ranks accelerate counts one process unless told it runs on the CPU (then gloo, all ranks).
        args = trl.DPOConfig(
            **common, deepspeed=trl_deepspeed_config(opts.zero_stage), use_cpu=not torch.cuda.is_available()
        )
        trainer = trl.DPOTrainer(str(root / "base"), args=args, train_dataset=rows, processing_class=tokenizer,
                                 callbacks=[clock.callback()])  # fmt: skip
    trainer.train()
    total = time.perf_counter() - started
    # The stage DeepSpeed's engine ran: ours's resolved config, TRL's engine itself.
    stage = (
        trainer.ds_config["zero_optimization"]["stage"]
        if system.startswith("ours")
        else trainer.model_wrapped.zero_optimization_stage()
    )
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r and "train_runtime" not in r]
    if dist_info().is_main:
        result = {
            "system": system, "zero_stage": opts.zero_stage, "step_s": clock.times, "losses": losses,
            "engine_zero_stage": stage, "setup_s": clock.marks["train_begin"] - started, "wall_s": total, "world_size": dist_info().world_size,
            "torch": torch.__version__,
        }  # fmt: skip
        (out / "result.json").write_text(json.dumps(result, indent=1))


class StepClock:
    """Each training step's wall time and when training began, from HF's callback events (the
    same clock for ours and TRL's trainers). A step's time runs from the end of the one before (from
    the start of training for the first) to its own end: whatever makes its data counts, where each
    trainer puts it. TRL's trainers generate rollouts inside ``training_step``, after
    ``on_step_begin``; ours makes them before, in the producer stage."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.marks: dict[str, float] = {}

    def callback(self) -> Any:
        from transformers import TrainerCallback

        clock = self

        class Clock(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                clock.marks["train_begin"] = self.last = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                now = time.perf_counter()
                clock.times.append(now - self.last)
                self.last = now

        return Clock()


def trl_deepspeed_config(zero_stage: int) -> dict[str, Any]:
    """The DeepSpeed file TRL's trainers get, as users write it: the stage, the rest from the arguments."""
    return {
        "zero_optimization": {"stage": zero_stage},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.bench.preference")
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare")
    prep.add_argument("root", type=Path)
    for name, default in (
        ("hidden_size", 256),
        ("layers", 4),
        ("vocab_size", 4096),
        ("pairs", 256),
        ("seed", 0),
        ("answer_chars", 0),
        ("model_vocab", 0),
    ):
        prep.add_argument(f"--{name}", type=int, default=default)
    work = sub.add_parser("worker")
    work.add_argument("root", type=Path)
    work.add_argument("system", choices=SYSTEMS)
    work.add_argument("out", type=Path)
    for name, default in (("zero_stage", 2), ("steps", 12), ("pairs_per_rank", 4), ("max_length", 128)):
        work.add_argument(f"--{name}", type=int, default=default)
    work.add_argument("--learning_rate", type=float, default=1e-5)
    work.add_argument("--gradient_checkpointing", action="store_true")
    work.add_argument(
        "--eval_batch_size", type=int, default=8, help="pairs a forward of ours's reference pass"
    )
    work.add_argument("--tiled", action="store_true", help="ours: the tiled loss")
    work.add_argument("--sequence_parallel_size", type=int, default=1, help="ours: Ulysses SP")
    opts = p.parse_args(argv)
    if opts.command == "prepare":
        prepare(opts.root, opts.hidden_size, opts.layers, opts.vocab_size, opts.pairs, opts.seed,
                opts.answer_chars, opts.model_vocab)  # fmt: skip
    else:
        worker(opts.root, opts.system, opts.out, opts)
    return 0


def summary(result: dict[str, Any], warmup: int) -> dict[str, float]:
    """Median step time after the first ``warmup`` steps, and steps per second from it."""
    times = sorted(result["step_s"][warmup:]) or sorted(result["step_s"])
    median = times[len(times) // 2]
    return {"median_step_s": median, "steps_per_s": 1 / median}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
