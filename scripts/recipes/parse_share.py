"""The RL recipe's measure (``make grpo``; docs/rl.md): the share of a model's completions of held-out
prompts whose every line continues the function as code that parses, and their mean reward.

    python scripts/recipes/parse_share.py MODEL PROMPTS [--samples N] [--max_new_tokens N] [--temperature T] [--batch N]

Each prompt of ``PROMPTS`` (a JSON-lines file of ``prompt`` rows: def lines and docstrings) is
completed ``--samples`` times with the recipe's sampling (``temperature`` 0.7, every token allowed),
seeded, and scored by ``trainer.loop.rewards.python_body``. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, set_seed

from trainer.loop.rewards import python_body


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("prompts", type=Path)
    parser.add_argument("--samples", type=int, default=4, help="completions of each prompt")
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=64, help="completions generated at once")
    args = parser.parse_args()
    set_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines()]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=args.temperature,
                              top_k=0, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    rows = [p for p in prompts for _ in range(args.samples)]
    logged: dict[str, float] = {}
    scores: list[float] = []
    parses = 0.0
    for start in range(0, len(rows), args.batch):
        batch = rows[start : start + args.batch]
        inputs = tokenizer(batch, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**inputs, generation_config=config)
        completions = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        scores += python_body(batch, completions, log_metric=logged.__setitem__)
        parses += logged["python/parses"] * len(batch)
    result = {"model": str(args.model), "completions": len(scores), "parse_share": parses / len(scores),
              "mean_reward": sum(scores) / len(scores)}  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
