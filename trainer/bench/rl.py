"""The online RL benchmark's two halves: the job it prepares once (a Llama saved with its tokenizer,
and prompts that are the standard library's documented functions), and the worker each rank of a
system runs.

    python -m trainer.bench.rl prepare ROOT --hidden_size H --layers L --prompts N
    torchrun ... -m trainer.bench.rl worker ROOT SYSTEM OUT --zero_stage S --steps N ...

Systems: ``ours`` (``trainer.GRPOTrainer``: rollouts by the training engine, under ZeRO-3 the
weights gathered once per rollout where they fit) and ``trl`` (``trl.GRPOTrainer`` on DeepSpeed
through HF's Trainer, its default ``ds3_gather_for_generation``). Both train the same job with the
same arguments and rewards (``trainer.loop.rewards.python_body`` and ``variety``). The worker writes
``OUT/result.json``: every step's wall time, the time spent in ``generate`` and the tokens it
generated, the losses and rewards. scripts/bench_rl.py runs both and reports the ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from trainer.bench.preference import StepClock, trl_deepspeed_config
from trainer.bench.preference import summary as step_summary

SYSTEMS = ("ours", "trl")
# Ours at ZeRO-3 with less gathered for generation (opt in through --systems): half of the weights
# gathered once per rollout (generation_gather_gb), or none (ds3_gather_for_generation false).
VARIANTS = ("ours_half", "ours_layers")


def prepare(root: Path, hidden_size: int, layers: int, prompts: int, seed: int) -> None:
    """``root/base`` (the model and the stdlib tokenizer) and ``root/prompts.jsonl``: the def line and
    docstring of documented functions of the standard library, drawn with ``seed``."""
    import ast

    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.args import DataArguments, ModelArguments
    from trainer.data import get_tokenizer
    from trainer.data.sources import corpus_files

    tokenizer = get_tokenizer(ModelArguments(vocab_size=4096), DataArguments(dataset="stdlib"))
    found = []
    for path in corpus_files()[:300]:
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and node.col_offset == 0:
                head = lines[node.lineno - 1 : node.body[0].end_lineno]
                if len(head) <= 6:
                    found.append("\n".join(head) + "\n")
    random.Random(seed).shuffle(found)
    root.mkdir(parents=True, exist_ok=True)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in found[:prompts]))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=max(hidden_size // 64, 1),
        num_key_value_heads=max(hidden_size // 64, 1), max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")


def variety(completions: list[str], **kwargs: Any) -> list[float]:
    """A dense second reward: the distinct characters of a completion, over 20 (an untrained model
    rarely writes a body that parses, so ``python_body`` alone would give every completion 0)."""
    return [len(set(text)) / 20 for text in completions]


class GenerationClock:
    """Wraps a model's ``generate``: the wall time of each call and the positions it generated."""

    def __init__(self, model: Any):
        self.seconds: list[float] = []
        self.tokens: list[int] = []
        self.inner = model.generate
        model.generate = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = self.inner(*args, **kwargs)
        self.seconds.append(time.perf_counter() - start)
        prompt = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        self.tokens.append(int(out.shape[0] * (out.shape[1] - prompt.shape[1])))
        return out


def worker(root: Path, system: str, out: Path, opts: argparse.Namespace) -> None:
    import datasets
    import torch
    from transformers import AutoTokenizer

    from trainer.loop.rewards import python_body
    from trainer.runtime.distributed import dist_info

    clock = StepClock()
    rows = datasets.load_dataset("json", data_files=str(root / "prompts.jsonl"), split="train")
    tokenizer = AutoTokenizer.from_pretrained(root / "base")
    common = dict(
        output_dir=str(out), max_steps=opts.steps, per_device_train_batch_size=opts.rows_per_rank,
        num_generations=opts.num_generations, max_completion_length=opts.max_completion_length,
        learning_rate=opts.learning_rate, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0, gradient_checkpointing=opts.gradient_checkpointing, bf16=False,
        temperature=0.7,
    )  # fmt: skip
    started = time.perf_counter()
    if system.startswith("ours"):
        from trainer import GRPOConfig, GRPOTrainer

        gather = {
            "ours_half": {
                "generation_gather_gb": (root / "base" / "model.safetensors").stat().st_size / 2 / 1e9
            },
            "ours_layers": {"ds3_gather_for_generation": False},
        }.get(system, {})
        # fp32 as TRL's bf16=False: ours's precision "auto" would pick bf16 on a CPU with bf16 instructions.
        args = GRPOConfig(**common, **gather, zero_stage=opts.zero_stage, precision="fp32")
        trainer = GRPOTrainer(str(root / "base"), [python_body, variety], args=args, train_dataset=rows,
                              processing_class=tokenizer, callbacks=[clock.callback()])  # fmt: skip
    else:
        import trl

        # On CPU ranks accelerate counts one process unless told it runs on the CPU (then gloo, all ranks).
        args = trl.GRPOConfig(
            **common, deepspeed=trl_deepspeed_config(opts.zero_stage), use_cpu=not torch.cuda.is_available()
        )
        trainer = trl.GRPOTrainer(str(root / "base"), [python_body, variety], args=args, train_dataset=rows,
                                  processing_class=tokenizer, callbacks=[clock.callback()])  # fmt: skip
    generation = GenerationClock(trainer.model)
    trainer.train()
    total = time.perf_counter() - started
    stage = trainer.ds_config["zero_optimization"]["stage"] if system.startswith("ours") else (
        trainer.model_wrapped.zero_optimization_stage()
    )  # fmt: skip
    history = [r for r in trainer.state.log_history if "loss" in r and "train_runtime" not in r]
    if dist_info().is_main:
        result = {
            "system": system, "zero_stage": opts.zero_stage, "engine_zero_stage": stage, "step_s": clock.times,
            "generate_s": generation.seconds, "generated_tokens": generation.tokens, "losses": [r["loss"] for r in history],
            "rewards": [r.get("reward") for r in history], "grad_norms": [r["grad_norm"] for r in history], "setup_s": clock.marks["train_begin"] - started,
            "wall_s": total, "world_size": dist_info().world_size, "torch": torch.__version__,
        }  # fmt: skip
        (out / "result.json").write_text(json.dumps(result, indent=1))


def summary(result: dict[str, Any], warmup: int) -> dict[str, float]:
    """Median step time after the first ``warmup`` steps (steps/s from it), and generation tokens/s
    over the calls after the first ``warmup``."""
    seconds, tokens = result["generate_s"][warmup:], result["generated_tokens"][warmup:]
    if not seconds:
        seconds, tokens = result["generate_s"], result["generated_tokens"]
    return {
        **step_summary(result, warmup),
        "generate_mean_s": sum(seconds) / len(seconds),
        "generation_tokens_per_s": sum(tokens) / sum(seconds),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.bench.rl")
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare")
    prep.add_argument("root", type=Path)
    for name, default in (("hidden_size", 256), ("layers", 4), ("prompts", 256), ("seed", 0)):
        prep.add_argument(f"--{name}", type=int, default=default)
    work = sub.add_parser("worker")
    work.add_argument("root", type=Path)
    work.add_argument("system", choices=SYSTEMS + VARIANTS)
    work.add_argument("out", type=Path)
    for name, default in (("zero_stage", 2), ("steps", 8), ("rows_per_rank", 4), ("num_generations", 4),
                          ("max_completion_length", 32)):  # fmt: skip
        work.add_argument(f"--{name}", type=int, default=default)
    work.add_argument("--learning_rate", type=float, default=1e-5)
    work.add_argument("--gradient_checkpointing", action="store_true")
    opts = p.parse_args(argv)
    if opts.command == "prepare":
        prepare(opts.root, opts.hidden_size, opts.layers, opts.prompts, opts.seed)
    else:
        worker(opts.root, opts.system, opts.out, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
