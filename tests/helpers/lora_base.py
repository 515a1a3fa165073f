"""A user's material for LoRA: a small Llama with its tokenizer in an HF directory, and a text corpus."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers.scaffold import bpe_tokenizer


def make_base(root: Path) -> dict[str, Path]:
    """``root/base`` (the model directory) and ``root/corpus.txt``, built from the standard library."""
    lines = [
        line for line in Path(json.__file__).with_name("decoder.py").read_text().splitlines() if line.strip()
    ]
    lines += [line for line in Path(shutil.__file__).read_text().splitlines() if line.strip()]
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(lines) + "\n")
    tokenizer = bpe_tokenizer(lines, special_tokens=("<unk>", "<pad>", "</s>"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    )  # fmt: skip
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    return {"root": root, "base": root / "base", "corpus": corpus}
