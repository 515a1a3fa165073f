"""Loading, tokeniser training, cached tokenisation, packing and splitting on small real corpora."""

from __future__ import annotations

import json
import logging
import sysconfig
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from trainer.args import DataArguments, ModelArguments
from trainer.data import DataError, build_datasets, corpus_files, get_tokenizer, prepare_datasets
from trainer.data.chat import DEFAULT_CHAT_TEMPLATE
from trainer.data.sft import has_generation_marks
from trainer.data.sources import load_raw

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# A few small standard-library modules: a real code corpus that trains a tokenizer in milliseconds.
SAMPLE_MODULES = ["abc.py", "bisect.py", "colorsys.py", "keyword.py", "this.py"]


@pytest.fixture()
def code_dir(tmp_path: Path) -> Path:
    """A directory of .py documents plus an empty one (which is skipped)."""
    d = tmp_path / "code"
    d.mkdir()
    for name in SAMPLE_MODULES:
        (d / name).write_text((STDLIB / name).read_text(encoding="utf-8"), encoding="utf-8")
    (d / "zz_empty.py").write_text("")
    return d


def docs_of(directory: Path) -> list[str]:
    return [p.read_text(encoding="utf-8") for p in sorted(directory.iterdir()) if p.read_text()]


def args_for(dataset: Path | str, tmp_path: Path, **kw) -> DataArguments:
    return DataArguments(dataset=str(dataset), cache_dir=str(tmp_path / "cache"), **kw)


@pytest.fixture()
def tokenizer(code_dir, tmp_path):
    return get_tokenizer(ModelArguments(vocab_size=300), args_for(code_dir, tmp_path))


def encode_doc(tok, text: str) -> list[int]:
    return tok(text, split_special_tokens=True)["input_ids"] + [tok.eos_token_id]


# ---- the stdlib corpus ---------------------------------------------------------------------------


def test_stdlib_corpus_is_sorted_and_leaves_out_tests_and_site_packages():
    files = corpus_files()
    rel = [f.relative_to(STDLIB).as_posix() for f in files]
    assert rel == sorted(rel)
    assert "os.py" in rel and "json/decoder.py" in rel
    assert not [r for r in rel if r.startswith("test/") or "/test/" in r or "/tests/" in r]
    assert not [r for r in rel if "site-packages" in r or "idle_test" in r]
    assert len(files) > 300


def test_stdlib_source_loads_one_document_per_file():
    raw = load_raw(DataArguments())
    files = corpus_files()
    assert raw.eval is None
    assert len(raw.train) == len(files)
    assert raw.train[0]["path"] == files[0].relative_to(STDLIB).as_posix()
    assert raw.train[0]["text"] == files[0].read_text(encoding="utf-8", errors="replace")


# ---- tokenizer -----------------------------------------------------------------------------------


def test_trained_tokenizer_round_trips_and_is_cached(code_dir, tmp_path, caplog):
    data_args = args_for(code_dir, tmp_path)
    tok = get_tokenizer(ModelArguments(vocab_size=300), data_args)
    assert len(tok) == 300
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    text = (code_dir / "bisect.py").read_text()
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # byte-level: lossless, no BOS/EOS added
    tok.save_pretrained(tmp_path / "export")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert reloaded(text)["input_ids"] == ids
    assert reloaded.pad_token_id == 2 and reloaded.eos_token == "<|eos|>"

    with caplog.at_level(logging.INFO, logger="trainer.data"):
        again = get_tokenizer(ModelArguments(vocab_size=300), data_args)
    assert "tokenizer cache hit" in caplog.text
    assert again(text)["input_ids"] == ids
    cached = list((tmp_path / "cache").glob("tokenizer-bpe-*/tokenizer.json"))
    assert len(cached) == 1
    # A different vocabulary size is a different tokenizer.
    assert len(get_tokenizer(ModelArguments(vocab_size=320), data_args)) == 320


def test_a_tokenizer_trained_here_carries_the_marked_chat_template(tokenizer):
    """A model pretrained here is fine-tuned on conversations next (assistant_only_loss included)."""
    assert tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE
    assert has_generation_marks(tokenizer.chat_template)


def test_named_tokenizer_directory_is_loaded(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = get_tokenizer(ModelArguments(tokenizer_name_or_path=str(tmp_path / "tok")), DataArguments())
    assert loaded.get_vocab() == tokenizer.get_vocab()


# ---- tokenisation cache --------------------------------------------------------------------------


def test_second_build_hits_the_tokenisation_cache(code_dir, tmp_path, tokenizer, caplog):
    data_args = args_for(code_dir, tmp_path, block_size=64)
    first = prepare_datasets(data_args, tokenizer, seed=1)
    assert not first.cache_hit
    assert (first.cache_dir / "info.json").exists()
    assert list(first.cache_dir.parent.glob("tokens*.arrow"))
    with caplog.at_level(logging.INFO, logger="trainer.data"):
        second = prepare_datasets(data_args, tokenizer, seed=1)
    assert second.cache_hit
    assert f"tokenised dataset cache hit: {first.cache_dir}" in caplog.text
    assert "Tokenising" not in caplog.text
    assert second.train["input_ids"] == first.train["input_ids"]
    assert second.eval["input_ids"] == first.eval["input_ids"]
    assert second.info == first.info
    # The rows are memory-mapped from the cache itself.
    assert second.train.cache_files[0]["filename"] == str(first.cache_dir / "train.arrow")


def test_cache_misses_when_data_block_size_or_seed_change(code_dir, tmp_path, tokenizer):
    data_args = args_for(code_dir, tmp_path, block_size=64)
    base = prepare_datasets(data_args, tokenizer, seed=1).cache_dir
    assert prepare_datasets(args_for(code_dir, tmp_path, block_size=32), tokenizer, 1).cache_dir != base
    assert prepare_datasets(data_args, tokenizer, seed=2).cache_dir != base
    doc = code_dir / "this.py"
    doc.write_text(doc.read_text() + "\n# edited\n")
    changed = prepare_datasets(data_args, tokenizer, seed=1)
    assert not changed.cache_hit and changed.cache_dir != base


def schema_only(path: Path) -> int:
    """The length of an Arrow stream's schema message: cut there, it reads as zero rows, no error."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    pa.ipc.MessageReader.open_stream(source).read_next_message()
    return source.tell()


@pytest.mark.parametrize("split", ["train", "eval"])
@pytest.mark.parametrize("cut", ["empty", "mid-batch", "schema only"])
def test_a_damaged_cache_is_rebuilt_with_one_warning(code_dir, tmp_path, tokenizer, caplog, split, cut):
    data_args = args_for(code_dir, tmp_path, block_size=64)
    first = prepare_datasets(data_args, tokenizer, seed=1)
    rows = first.train["input_ids"], first.eval["input_ids"]
    damaged, cache_dir = first.cache_dir / f"{split}.arrow", first.cache_dir
    good = damaged.read_bytes()
    size = {"empty": 0, "mid-batch": len(good) // 2, "schema only": schema_only(damaged)}[cut]
    # A new file in its place: `first` memory-maps the old one, which must stay whole.
    (cache_dir / "cut.arrow").write_bytes(good[:size])
    (cache_dir / "cut.arrow").replace(damaged)
    with caplog.at_level(logging.INFO, logger="trainer.data"):
        again = prepare_datasets(data_args, tokenizer, seed=1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"tokenised dataset cache {cache_dir} is damaged" in warnings[0]
    assert warnings[0].endswith("removing it and tokenising again"), warnings[0]
    assert not again.cache_hit and damaged.read_bytes() == good
    assert (again.train["input_ids"], again.eval["input_ids"]) == rows
    assert prepare_datasets(data_args, tokenizer, seed=1).cache_hit


# ---- packing -------------------------------------------------------------------------------------


def test_packing_keeps_every_token_and_restarts_positions(code_dir, tmp_path, tokenizer):
    block = 48
    data_args = args_for(code_dir, tmp_path, block_size=block, validation_split_percentage=0)
    train, eval_ds = build_datasets(data_args, tokenizer, seed=0)
    assert eval_ds is None
    stream: list[int] = []
    expected_pos: list[int] = []
    for text in docs_of(code_dir):
        ids = encode_doc(tokenizer, text)
        stream += ids
        expected_pos += list(range(len(ids)))
    blocks = train["input_ids"]
    assert [t for b in blocks for t in b] == stream
    assert all(len(b) == block for b in blocks[:-1])
    assert 0 < len(blocks[-1]) <= block  # the partial tail block is kept
    assert len(blocks) == -(-len(stream) // block)
    # Positions count within each document, and also restart at every block start.
    want = [min(p, i % block) for i, p in enumerate(expected_pos)]
    assert [p for b in train["position_ids"] for p in b] == want
    assert all(b[0] == 0 for b in train["position_ids"])


def test_without_packing_each_document_is_one_truncated_sample(code_dir, tmp_path, tokenizer):
    data_args = args_for(code_dir, tmp_path, block_size=40, packing=False, validation_split_percentage=0)
    train, _ = build_datasets(data_args, tokenizer, seed=0)
    assert train.column_names == ["input_ids"]
    docs = docs_of(code_dir)
    assert train["input_ids"] == [encode_doc(tokenizer, t)[:40] for t in docs]
    short = args_for(code_dir, tmp_path, block_size=100_000, packing=False, validation_split_percentage=0)
    whole, _ = build_datasets(short, tokenizer, seed=0)
    assert [row[-1] for row in whole["input_ids"]] == [tokenizer.eos_token_id] * len(docs)


def test_validation_split_is_by_document_and_deterministic(code_dir, tmp_path, tokenizer):
    for i in range(15):
        (code_dir / f"extra_{i:02d}.txt.py").write_text(f"value_{i} = {i} * 2\n")
    data_args = args_for(
        code_dir, tmp_path, block_size=100_000, packing=False, validation_split_percentage=20
    )
    train, eval_ds = build_datasets(data_args, tokenizer, seed=3)
    docs = [encode_doc(tokenizer, t) for t in docs_of(code_dir)]
    assert len(eval_ds) == round(len(docs) * 0.2)
    train_rows, eval_rows = list(train["input_ids"]), list(eval_ds["input_ids"])
    assert sorted(train_rows + eval_rows) == sorted(docs)
    # Both splits keep corpus order.
    assert [docs.index(r) for r in train_rows] == sorted(docs.index(r) for r in train_rows)
    assert [docs.index(r) for r in eval_rows] == sorted(docs.index(r) for r in eval_rows)
    _, same = build_datasets(data_args, tokenizer, seed=3)
    _, other = build_datasets(data_args, tokenizer, seed=4)
    assert same["input_ids"] == eval_ds["input_ids"]
    assert other["input_ids"] != eval_ds["input_ids"]


def test_max_train_samples_truncates_the_train_set(code_dir, tmp_path, tokenizer):
    full, _ = build_datasets(args_for(code_dir, tmp_path, block_size=32), tokenizer, seed=0)
    cut, _ = build_datasets(
        args_for(code_dir, tmp_path, block_size=32, max_train_samples=5), tokenizer, seed=0
    )
    assert len(full) > 5 and cut["input_ids"] == full["input_ids"][:5]


# ---- file formats --------------------------------------------------------------------------------


def write_format(directory: Path, fmt: str, texts: list[str]) -> Path:
    rows = [{"text": t, "id": i} for i, t in enumerate(texts)]
    if fmt == "jsonl":
        path = directory / "data.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path = directory / "data.json"
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        path = directory / "data.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif fmt == "csv":
        path = directory / "data.csv"
        datasets.Dataset.from_list(rows).to_csv(str(path), index=False)
    else:  # a directory of text files, one document each
        path = directory / "texts"
        path.mkdir()
        for i, t in enumerate(texts):
            (path / f"doc{i:02d}.txt").write_text(t)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "txt"])
def test_local_formats_give_the_same_documents(fmt, code_dir, tmp_path, tokenizer):
    texts = docs_of(code_dir)
    src = tmp_path / "src"
    src.mkdir()
    path = write_format(src, fmt, texts)
    data_args = args_for(path, tmp_path, block_size=10_000, packing=False, validation_split_percentage=0)
    train, _ = build_datasets(data_args, tokenizer, seed=0)
    assert train["input_ids"] == [encode_doc(tokenizer, t) for t in texts]


def test_dataset_saved_to_disk_loads_its_rows(tmp_path):
    texts = ["def f():\n    return 1\n", "x = [i for i in range(3)]\n", "class A:\n    pass\n"]
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": texts, "id": [0, 1, 2]}).save_to_disk(str(saved))
    raw = load_raw(args_for(saved, tmp_path))
    assert raw.source.kind == "saved" and raw.eval is None
    assert raw.train["text"] == texts  # not the rows of state.json / dataset_info.json


def test_dataset_dict_saved_to_disk_gives_train_and_eval_splits(tmp_path, tokenizer):
    splits = {"train": ["a = 1\n", "b = 2\n", "c = 3\n"], "validation": ["d = 4\n"]}
    saved = tmp_path / "saved_dict"
    datasets.DatasetDict(
        {name: datasets.Dataset.from_dict({"text": rows}) for name, rows in splits.items()}
    ).save_to_disk(str(saved))
    raw = load_raw(args_for(saved, tmp_path))
    assert raw.train["text"] == splits["train"] and raw.eval["text"] == splits["validation"]
    data_args = args_for(saved, tmp_path, block_size=10_000, packing=False)
    train, eval_ds = build_datasets(data_args, tokenizer, seed=0)
    assert train["input_ids"] == [encode_doc(tokenizer, t) for t in splits["train"]]
    assert eval_ds["input_ids"] == [encode_doc(tokenizer, t) for t in splits["validation"]]


def test_directory_holding_a_saved_dataset_names_it(tmp_path):
    datasets.Dataset.from_dict({"text": ["a = 1\n"]}).save_to_disk(str(tmp_path / "corpus" / "saved"))
    with pytest.raises(DataError) as err:
        load_raw(args_for(tmp_path / "corpus", tmp_path))
    assert str(err.value) == (
        f"dataset: {tmp_path / 'corpus' / 'saved'} holds a dataset saved with save_to_disk; pass that directory"
    )


# ---- bad input -----------------------------------------------------------------------------------


def test_missing_file_is_one_clear_error(tmp_path, tokenizer):
    missing = tmp_path / "nope" / "train.jsonl"
    with pytest.raises(DataError) as err:
        build_datasets(args_for(missing, tmp_path), tokenizer, seed=0)
    assert str(err.value) == f"dataset: file not found: {missing}"
    assert err.value.problems == [("dataset", f"file not found: {missing}")]


def test_missing_column_names_the_columns_and_suggests(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text('{"txt": "a = 1", "id": 0}\n')
    with pytest.raises(DataError) as err:
        build_datasets(args_for(path, tmp_path, text_column="text"), tokenizer, seed=0)
    assert (
        str(err.value)
        == f"text_column: column 'text' not found in {path} (columns: txt, id); did you mean txt?"
    )


def test_empty_dataset_and_empty_documents_are_errors(tmp_path, tokenizer):
    empty_dir = tmp_path / "blank"
    empty_dir.mkdir()
    (empty_dir / "a.txt").write_text("")
    with pytest.raises(DataError, match=f"^dataset: {empty_dir}: no non-empty documents$"):
        build_datasets(args_for(empty_dir, tmp_path), tokenizer, seed=0)
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    with pytest.raises(DataError, match="^dataset: no data files .* under directory"):
        build_datasets(args_for(nothing, tmp_path), tokenizer, seed=0)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text("x")
    (mixed / "b.jsonl").write_text('{"text": "y"}\n')
    with pytest.raises(DataError, match="mixes file formats \\(json, text\\)"):
        build_datasets(args_for(mixed, tmp_path), tokenizer, seed=0)


def test_unreadable_json_names_the_file(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(DataError, match=f"^dataset: could not read {path}: "):
        build_datasets(args_for(path, tmp_path), tokenizer, seed=0)


def test_corpus_text_that_spells_a_special_token_stays_plain_text(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "s = '<|eos|>'"}) + "\n")
    train, _ = build_datasets(
        args_for(path, tmp_path, packing=False, validation_split_percentage=0), tokenizer, seed=0
    )
    ids = train["input_ids"][0]
    assert ids.count(tokenizer.eos_token_id) == 1 and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[:-1]) == "s = '<|eos|>'"


def test_parallel_tokenisation_matches_single_process(code_dir, tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    one, _ = build_datasets(args_for(code_dir, tmp_path / "a", block_size=32), tokenizer, seed=0)
    two_args = args_for(code_dir, tmp_path / "b", block_size=32, preprocessing_num_workers=2)
    two, _ = build_datasets(two_args, tokenizer, seed=0)
    assert two["input_ids"] == one["input_ids"]


def test_bad_tokenizer_paths_are_clear_errors(tmp_path):
    with pytest.raises(DataError) as err:
        get_tokenizer(ModelArguments(tokenizer_name_or_path=str(tmp_path / "none")), DataArguments())
    assert str(err.value) == f"tokenizer_name_or_path: directory not found: {tmp_path / 'none'}"
    (tmp_path / "model").mkdir()
    with pytest.raises(DataError) as err:
        get_tokenizer(ModelArguments(model_name_or_path=str(tmp_path / "model")), DataArguments())
    assert str(err.value) == (
        "model_name_or_path: no tokenizer files (tokenizer.json, tokenizer_config.json, vocab.json, "
        f"tokenizer.model) in {tmp_path / 'model'}"
    )
