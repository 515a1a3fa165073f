"""Instruction data through the public command: ShareGPT chats, packed, evaluated on --validation_file."""

from __future__ import annotations

import json
import math

import yaml

from tests.helpers.launch import launch
from tests.helpers.scaffold import read_metrics, tiny_flags
from trainer.data import DEFAULT_CHAT_TEMPLATE

NAMES = ["apple", "river", "cloud", "stone", "tiger", "maple", "ocean", "piano"]


def chat(i: int) -> dict:
    """A two-exchange ShareGPT conversation."""
    a, b = NAMES[i % 8], NAMES[(3 * i + 1) % 8]
    turns = [("human", f"{a}?"), ("gpt", b), ("human", "Another?"), ("gpt", a)]
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_sharegpt_chats_train_packed_and_evaluate_on_the_validation_file(tmp_path):
    from transformers import AutoTokenizer

    train = write_jsonl(tmp_path / "train.jsonl", [chat(i) for i in range(40)])
    val = write_jsonl(tmp_path / "val.jsonl", [chat(100 + i) for i in range(5)])
    out, cache = tmp_path / "run", tmp_path / "cache"
    launch(
        ["scripts/train.py", "--output_dir", str(out), "--dataset", train, "--validation_file", val,
         "--data_format", "sharegpt", "--packing", "true", "--cache_dir", str(cache),
         *tiny_flags(max_steps=3, eval_steps=3, save_steps=3, max_train_samples=None, max_eval_samples=None,
                     per_device_train_batch_size=2, vocab_size=4096)],
        launcher="python",
    )  # fmt: skip
    rows = read_metrics(out)
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3] and math.isfinite(evals[0]["eval_loss"])
    # What was built: all 40 train chats (none held out), packed (fewer blocks than chats); the
    # eval set is the 5 chats of the validation file.
    (info_file,) = cache.glob("sharegpt-*/final/info.json")
    info = json.loads(info_file.read_text())
    assert (info["format"], info["packing"], info["validation_file"]) == ("sharegpt", True, val)
    assert info["train"]["documents"] == 40 and info["train"]["samples"] < 40
    assert info["eval"]["documents"] == 5
    assert yaml.safe_load((out / "run_config.yaml").read_text())["validation_file"] == val
    # The export carries the template the chats were rendered with.
    assert (out / "final" / "model.safetensors").is_file()
    assert AutoTokenizer.from_pretrained(out / "final").chat_template == DEFAULT_CHAT_TEMPLATE
