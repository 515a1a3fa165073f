"""SFT rows: prompt tokens are masked out of the loss, checked on a real locally trained tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.args import DataArguments
from trainer.data import (
    IGNORE_INDEX,
    DataError,
    SFTCollator,
    build_datasets,
    render_messages,
    train_bpe_tokenizer,
)

ROWS = [
    {"prompt": "Write a function that adds two numbers.\n", "response": "def add(a, b):\n    return a + b\n"},
    {"prompt": "What does len([1, 2]) return?\n", "response": "It returns 2."},
    {"prompt": "Reverse a string s.\n", "response": "s[::-1]"},
]
CHATS = [
    [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Square x."},
        {"role": "assistant", "content": "x ** 2"},
    ],
    [{"role": "user", "content": "Empty list?"}, {"role": "assistant", "content": "[]"}],
]
# A small ChatML-style template, as a tokenizer from a chat model would carry.
CHATML = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    corpus = [r["prompt"] + r["response"] for r in ROWS] * 20 + [m["content"] for c in CHATS for m in c] * 20
    return train_bpe_tokenizer(corpus, vocab_size=320)


def sft_args(tmp_path: Path, rows: list[dict], **kw) -> DataArguments:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kw.setdefault("validation_split_percentage", 0)
    return DataArguments(dataset=str(path), data_format="sft", cache_dir=str(tmp_path / "cache"), **kw)


def response_of(tokenizer, row: dict) -> str:
    """Decode the tokens that carry a loss."""
    kept = [t for t in row["labels"] if t != IGNORE_INDEX]
    return tokenizer.decode(kept, skip_special_tokens=True)


def test_prompt_response_rows_mask_the_prompt(tmp_path, tokenizer):
    train, _ = build_datasets(sft_args(tmp_path, ROWS), tokenizer, seed=0)
    assert sorted(train.column_names) == ["input_ids", "labels"]
    for source, row in zip(ROWS, train, strict=True):
        prompt_ids = tokenizer(source["prompt"])["input_ids"]
        n = len(prompt_ids)
        assert row["input_ids"][:n] == prompt_ids
        assert row["labels"][:n] == [IGNORE_INDEX] * n
        assert row["labels"][n:] == row["input_ids"][n:]
        assert row["labels"][-1] == tokenizer.eos_token_id  # the model learns to stop
        assert response_of(tokenizer, row) == source["response"]
        assert (
            tokenizer.decode(row["input_ids"], skip_special_tokens=True)
            == source["prompt"] + source["response"]
        )


def test_messages_without_a_chat_template_use_the_plain_template(tmp_path, tokenizer):
    assert tokenizer.chat_template is None
    prompt, response = render_messages(CHATS[0], tokenizer)
    assert prompt == "<|system|>\nYou write Python.\n<|user|>\nSquare x.\n<|assistant|>\n"
    assert response == "x ** 2"
    train, _ = build_datasets(sft_args(tmp_path, [{"messages": c} for c in CHATS]), tokenizer, seed=0)
    for chat, row in zip(CHATS, train, strict=True):
        assert response_of(tokenizer, row) == chat[-1]["content"]
        n_prompt = row["labels"].index(next(t for t in row["labels"] if t != IGNORE_INDEX))
        assert tokenizer.decode(row["input_ids"][:n_prompt]) == render_messages(chat, tokenizer)[0]


def test_messages_with_a_chat_template_mask_the_rendered_prompt(tmp_path, tokenizer):
    tokenizer.chat_template = CHATML
    try:
        prompt, response = render_messages(CHATS[1], tokenizer)
        assert prompt == "<|bos|>user\nEmpty list?<|eos|>\n<|bos|>assistant\n"
        assert response == "[]<|eos|>\n"
        train, _ = build_datasets(sft_args(tmp_path, [{"messages": c} for c in CHATS]), tokenizer, seed=0)
        for chat, row in zip(CHATS, train, strict=True):
            # The template's control strings are parsed as the special tokens themselves.
            assert tokenizer.bos_token_id in row["input_ids"]
            assert response_of(tokenizer, row) == chat[-1]["content"] + "\n"
            kept = [t for t in row["labels"] if t != IGNORE_INDEX]
            assert tokenizer.decode(kept) == chat[-1]["content"] + "<|eos|>\n<|eos|>"
    finally:
        tokenizer.chat_template = None


def test_rows_are_truncated_and_rows_without_a_response_token_are_dropped(tmp_path, tokenizer):
    long_prompt = {"prompt": "x = 1\n" * 200, "response": "ok"}
    rows = [ROWS[0], long_prompt, ROWS[1]]
    train, _ = build_datasets(sft_args(tmp_path, rows, block_size=24), tokenizer, seed=0)
    assert len(train) == 2
    assert all(len(r) <= 24 for r in train["input_ids"])
    assert response_of(tokenizer, train[1]) == ROWS[1]["response"]
    with pytest.raises(DataError, match="no rows with a response that fits block_size"):
        build_datasets(sft_args(tmp_path, [long_prompt], block_size=24), tokenizer, seed=0)


def test_sft_batch_pads_with_minus_100_and_keeps_row_labels(tmp_path, tokenizer):
    train, _ = build_datasets(sft_args(tmp_path, ROWS), tokenizer, seed=0)
    rows = [train[0], train[2]]
    batch = SFTCollator(tokenizer.pad_token_id)(rows)
    width = max(len(r["input_ids"]) for r in rows)
    assert batch["labels"].shape == (2, width)
    short = len(rows[1]["input_ids"])
    assert batch["labels"][1, :short].tolist() == rows[1]["labels"]
    assert batch["labels"][1, short:].tolist() == [IGNORE_INDEX] * (width - short)
    assert batch["input_ids"][1, short:].tolist() == [tokenizer.pad_token_id] * (width - short)


def test_sft_needs_its_columns(tmp_path, tokenizer):
    with pytest.raises(DataError) as err:
        build_datasets(sft_args(tmp_path, [{"prompt": "a"}]), tokenizer, seed=0)
    assert str(err.value).startswith("data_format: column 'response' not found in ")
    with pytest.raises(
        DataError, match="^data_format: sft needs a 'messages' column or 'prompt' and 'response'"
    ):
        build_datasets(sft_args(tmp_path, [{"text": "a"}]), tokenizer, seed=0)
    with pytest.raises(DataError, match="last message of every 'messages' row must be the assistant's"):
        build_datasets(sft_args(tmp_path, [{"messages": CHATS[0][:2]}]), tokenizer, seed=0)


def test_tokenizer_trained_on_an_sft_corpus_reads_prompts_responses_and_messages(tmp_path):
    from trainer.args import ModelArguments
    from trainer.data import get_tokenizer

    rows = [*ROWS, {"prompt": "zqzqzq " * 50, "response": "wkwkwk " * 50}]
    tok = get_tokenizer(ModelArguments(vocab_size=300), sft_args(tmp_path, rows))
    # Frequent strings from both columns became single tokens.
    assert len(tok("zqzqzq")["input_ids"]) < 3 and len(tok("wkwkwk")["input_ids"]) < 3
    chats = [
        {"messages": [{"role": "user", "content": "vbvbvb " * 50}, {"role": "assistant", "content": "ok"}]}
    ]
    (tmp_path / "m").mkdir()
    tok2 = get_tokenizer(ModelArguments(vocab_size=300), sft_args(tmp_path / "m", chats))
    assert len(tok2("vbvbvb")["input_ids"]) < 3
