"""Instruction rows in the builder: rows longer than block_size, packing with each row isolated, and
an eval set from --validation_file."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers.sft_data import TURNS, sft_args, sharegpt_row, trained_runs, write_jsonl
from tests.helpers.sft_data import tokenizer as make_tokenizer
from trainer.args import DataArguments
from trainer.data import IGNORE_INDEX, CausalLMCollator, DataError, build_datasets, prepare_datasets
from trainer.engine.objectives import causal_lm_loss_sum

# Chats of one to three exchanges, so rows differ in length.
CHATS = [sharegpt_row(TURNS[: 1 + i % 3], system=None if i % 2 else "You write Python.") for i in range(9)]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def unpacked(tmp_path, tok, rows=CHATS, **kw):
    return build_datasets(sft_args(tmp_path / "unpacked", rows, block_size=1024, **kw), tok, seed=0)[0]


# ---- rows longer than block_size -----------------------------------------------------------------


def test_rows_longer_than_block_size_are_an_error_naming_each(tmp_path, tok):
    lengths = [len(r) for r in unpacked(tmp_path, tok)["input_ids"]]
    block = sorted(set(lengths))[1] - 1  # only the shortest chats fit
    with pytest.raises(DataError) as err:
        build_datasets(sft_args(tmp_path, CHATS, block_size=block), tok, seed=0)
    assert err.value.problems == [
        ("dataset", f"row {i}: {n} tokens, longer than block_size {block}")
        for i, n in enumerate(lengths)
        if n > block
    ]


def test_long_rows_can_be_dropped_or_cut(tmp_path, tok):
    full = unpacked(tmp_path, tok)
    block = min(len(r) for r in full["input_ids"])
    fits = [r for r in full if len(r["input_ids"]) <= block]
    dropped, _ = build_datasets(sft_args(tmp_path / "d", CHATS, block_size=block, long_rows="drop"), tok, 0)
    assert dropped["input_ids"] == [r["input_ids"] for r in fits] and len(fits) < len(CHATS)

    block = sorted(set(map(len, full["input_ids"])))[1]
    cut, _ = build_datasets(sft_args(tmp_path / "t", CHATS, block_size=block, long_rows="truncate"), tok, 0)
    assert cut["input_ids"] == [r[:block] for r in full["input_ids"]]
    assert cut["labels"] == [r[:block] for r in full["labels"]]
    # A row whose trained tokens all lie past the cut is left out; with no row left, an error.
    late = sharegpt_row([("Square x. " * 20, "x ** 2")])
    args = sft_args(tmp_path / "l", [late, CHATS[0]], block_size=block, long_rows="truncate")
    assert build_datasets(args, tok, 0)[0]["input_ids"] == [full["input_ids"][0]]
    with pytest.raises(DataError, match=r"^dataset: .*sft.jsonl: no rows that fit block_size$"):
        build_datasets(sft_args(tmp_path / "l1", [late], block_size=block, long_rows="truncate"), tok, 0)


# ---- packing -------------------------------------------------------------------------------------


def row_lengths(positions: list[int]) -> list[int]:
    """The rows of a packed block, by length: each starts where the positions restart at 0."""
    starts = [j for j, p in enumerate(positions) if p == 0] + [len(positions)]
    return [b - a for a, b in zip(starts, starts[1:], strict=False)]


def test_packed_rows_stay_whole_in_order_with_positions_restarting_per_row(tmp_path, tok):
    rows = unpacked(tmp_path, tok)
    block = 2 * max(len(r) for r in rows["input_ids"])
    packed, _ = build_datasets(sft_args(tmp_path, CHATS, block_size=block, packing=True), tok, seed=0)
    assert packed.column_names == ["input_ids", "labels", "position_ids"]
    assert len(packed) < len(rows)
    assert [t for b in packed["input_ids"] for t in b] == [t for r in rows["input_ids"] for t in r]
    assert [t for b in packed["labels"] for t in b] == [t for r in rows["labels"] for t in r]
    per_block = [row_lengths(p) for p in packed["position_ids"]]
    assert [n for b in per_block for n in b] == [len(r) for r in rows["input_ids"]]
    for positions, lengths in zip(packed["position_ids"], per_block, strict=True):
        assert positions == [p for n in lengths for p in range(n)]
    # A block closes only when the next row does not fit.
    for this, following in zip(per_block, per_block[1:], strict=False):
        assert sum(this) <= block < sum(this) + following[0]


def test_a_packed_block_gives_each_row_its_own_logits_and_loss(tmp_path, tok):
    """The rows of a packed block, passed the way the engines do (position_ids, no attention mask),
    get exactly the logits and the summed loss they get alone."""
    rows = unpacked(tmp_path, tok)
    block = sum(len(r) for r in rows["input_ids"][:3])
    packed, _ = build_datasets(sft_args(tmp_path, CHATS, block_size=block, packing=True), tok, seed=0)
    batch = CausalLMCollator(tok.pad_token_id)([packed[0], packed[1]])
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=block,
        attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits
        alone = [model(input_ids=torch.tensor([r])).logits for r in rows["input_ids"][:3]]
        start = 0
        for row_logits in alone:
            n = row_logits.shape[1]
            torch.testing.assert_close(logits[:1, start : start + n], row_logits, rtol=1e-5, atol=1e-5)
            start += n
        packed_loss = causal_lm_loss_sum(logits[:1], batch["labels"][:1])
        row_losses = sum(
            causal_lm_loss_sum(row_logits, torch.tensor([labels]))
            for row_logits, labels in zip(alone, rows["labels"][:3], strict=True)
        )
    torch.testing.assert_close(packed_loss, row_losses, rtol=1e-5, atol=1e-4)


def test_no_row_trains_its_first_token(tmp_path, tok):
    """Nothing precedes it; packed, it would be predicted from the row before."""
    rows = [{"prompt": "", "completion": "x ** 2"}, {"prompt": "", "completion": "x ** 3"}]
    train, _ = build_datasets(sft_args(tmp_path, rows, packing=True), tok, seed=0)
    eos = tok.eos_token_id
    assert train["input_ids"][0] == [t for r in ("x ** 2", "x ** 3") for t in tok(r)["input_ids"] + [eos]]
    first = len(tok("x ** 2")["input_ids"]) + 1
    assert train["labels"][0][0] == train["labels"][0][first] == IGNORE_INDEX
    assert train["position_ids"][0][first] == 0
    with pytest.raises(DataError) as err:
        build_datasets(sft_args(tmp_path / "e", [{"prompt": "", "completion": ""}]), tok, seed=0)
    assert err.value.problems == [
        ("dataset", "row 0: no token to train on (an empty answer that opens the row)")
    ]


# ---- validation_file -----------------------------------------------------------------------------


def test_validation_file_is_the_eval_set_and_nothing_is_held_out(tmp_path, tok):
    val = write_jsonl(tmp_path / "val.jsonl", [sharegpt_row(TURNS[:1]), sharegpt_row(TURNS[1:2])])
    args = sft_args(tmp_path, CHATS, validation_file=str(val), validation_split_percentage=20)
    built = prepare_datasets(args, tok, seed=0)
    assert built.train["input_ids"] == unpacked(tmp_path, tok)["input_ids"]  # all 9 rows train
    alone = build_datasets(
        sft_args(tmp_path / "v", [sharegpt_row(TURNS[:1]), sharegpt_row(TURNS[1:2])]), tok, 0
    )
    assert built.eval["input_ids"] == alone[0]["input_ids"]
    assert built.eval["labels"] == alone[0]["labels"]
    assert trained_runs(built.eval[1]) == trained_runs(alone[0][1])
    assert built.info["eval"] == {
        "documents": 2,
        "samples": 2,
        "tokens": sum(map(len, alone[0]["input_ids"])),
    }
    # Editing the validation file rebuilds.
    write_jsonl(val, [sharegpt_row(TURNS[:1])])
    again = prepare_datasets(args, tok, seed=0)
    assert not again.cache_hit and len(again.eval) == 1


def test_validation_file_packs_and_is_read_in_the_train_format(tmp_path, tok):
    val = write_jsonl(tmp_path / "val.jsonl", CHATS[:4])
    args = sft_args(tmp_path, CHATS, validation_file=str(val), packing=True, block_size=512)
    train, eval_ds = build_datasets(args, tok, seed=0)
    assert eval_ds.column_names == ["input_ids", "labels", "position_ids"]
    assert [t for b in eval_ds["input_ids"] for t in b] == [t for b in train["input_ids"] for t in b][
        : sum(map(len, eval_ds["input_ids"]))
    ]


def test_validation_file_errors_name_it(tmp_path, tok):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError) as err:
        build_datasets(sft_args(tmp_path, CHATS, validation_file=str(missing)), tok, seed=0)
    assert str(err.value) == f"validation_file: file not found: {missing}"
    other = write_jsonl(tmp_path / "other.jsonl", [{"messages": [{"role": "user", "content": "Hi."}]}])
    with pytest.raises(DataError) as err:
        build_datasets(sft_args(tmp_path, CHATS, validation_file=str(other)), tok, seed=0)
    assert str(err.value) == (
        f"validation_file: column 'conversations' not found in {other} (columns: messages)"
    )
    bad = write_jsonl(tmp_path / "bad.jsonl", [sharegpt_row(), {"conversations": [{"from": "gpt"}]}])
    with pytest.raises(DataError) as err:
        build_datasets(sft_args(tmp_path, CHATS, validation_file=str(bad)), tok, seed=0)
    assert err.value.problems == [("validation_file", "row 1: conversations[0].value is missing")]


def test_validation_file_with_plain_text(tmp_path, tok):
    train_file = write_jsonl(tmp_path / "train.jsonl", [{"text": f"x = {i}\n"} for i in range(10)])
    val = write_jsonl(tmp_path / "val.jsonl", [{"text": "y = 1\n"}, {"text": "y = 2\n"}])
    args = DataArguments(
        dataset=str(train_file), validation_file=str(val), cache_dir=str(tmp_path / "c"), block_size=8
    )
    built = prepare_datasets(args, tok, seed=0)
    assert built.info["train"]["documents"] == 10 and built.info["eval"]["documents"] == 2
    want = [t for s in ("y = 1\n", "y = 2\n") for t in tok(s)["input_ids"] + [tok.eos_token_id]]
    assert [t for b in built.eval["input_ids"] for t in b] == want


def test_two_workers_give_the_same_rows_and_name_rows_by_their_index_in_the_whole_dataset(
    tmp_path, tok, monkeypatch
):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    one, _ = build_datasets(sft_args(tmp_path / "a", CHATS * 2), tok, seed=0)
    two, _ = build_datasets(sft_args(tmp_path / "b", CHATS * 2, preprocessing_num_workers=2), tok, seed=0)
    assert (two["input_ids"], two["labels"]) == (one["input_ids"], one["labels"])
    bad = [*CHATS * 2, {"conversations": [{"from": "human", "value": "Hi."}]}]
    with pytest.raises(DataError) as err:
        build_datasets(sft_args(tmp_path / "c", bad, preprocessing_num_workers=2), tok, seed=0)
    assert err.value.problems == [
        ("dataset", "row 18: no assistant message to train on (one that follows a prompt)")
    ]
