"""Streams that one process reads, through the user's command (``--log_data_fingerprint`` on every
step's row): an unshuffled one-lane stream of JSON-lines shards against the map-style run of the same
files and against the same files as a ``file://`` URL (streamed by ``datasets``); ShareGPT chats
streamed and tokenised up front; the offline mixture recipe; a shard that cannot be read. The
two-rank streams are in ``test_streaming.py``.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.e2e.test_streaming import COMMON, _corpus, _prints
from tests.helpers.launch import launch
from tests.helpers.scaffold import tiny_flags, train_rows
from tests.helpers.sft_data import SYSTEM, TURNS, sharegpt_row, write_jsonl
from tests.helpers.sft_data import tokenizer as sft_tokenizer


@pytest.fixture(scope="module")
def lanes(tmp_path_factory):
    root = tmp_path_factory.mktemp("lanes")
    corpus = _corpus(root)
    out = {name: root / name for name in ("map", "lane", "url")}
    sequential = [*COMMON, "--train_sampling_strategy", "sequential", "--dataset", str(corpus["code"]),
                  "--text_column", "content"]  # fmt: skip
    launch(
        [*sequential, "--output_dir", str(out["map"]), "--validation_split_percentage", "0"],
        launcher="python",
    )
    launch([*sequential, "--output_dir", str(out["lane"]), "--streaming", "true", "--stream_lanes", "1"],
           launcher="python")  # fmt: skip
    url = [*COMMON, "--train_sampling_strategy", "sequential", "--dataset", f"file://{corpus['code']}/*.jsonl",
           "--text_column", "content", "--streaming", "true", "--stream_lanes", "1"]  # fmt: skip
    launch([*url, "--output_dir", str(out["url"])], launcher="python")
    return {**out, "code": corpus["code"]}


def test_an_unshuffled_lane_reads_what_the_map_style_run_reads(lanes):
    """And a URL of the same files, which datasets streams (load_dataset(..., streaming=True)),
    reads what our file reader reads."""
    assert _prints(lanes["lane"]) == _prints(lanes["map"]) == _prints(lanes["url"])
    assert [r["loss"] for r in train_rows(lanes["lane"])] == pytest.approx(
        [r["loss"] for r in train_rows(lanes["map"])], rel=1e-6
    )


def test_an_unreadable_shard_is_named_with_the_rank(lanes, tmp_path):
    shards = tmp_path / "shards"
    shutil.copytree(lanes["code"], shards)
    (shards / "part-2.jsonl").write_text('{"content": "fine"}\n{not json\n')
    proc = launch([*COMMON, "--streaming", "true", "--dataset", str(shards), "--text_column", "content",
                   "--stream_lanes", "1", "--output_dir", str(tmp_path / "run")], launcher="python",
                  check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith("error: "))
    assert line.startswith(f"error: dataset: {shards}/part-2.jsonl cannot be read on rank 0 (JSONDecodeError")


def test_the_offline_mixture_recipe_streams(tmp_path):
    """python scripts/train.py --config scripts/recipes/stream_mixture.yaml, sized down: the standard
    library and the docs streamed, every step's row with its fingerprint, a checkpoint with every
    lane's cursor, an export."""
    recipe = ["scripts/train.py", "--config", "scripts/recipes/stream_mixture.yaml"]
    small = tiny_flags(max_steps=2, save_steps=2, max_train_samples=None, eval_steps=None)
    launch([*recipe, *small, "--output_dir", str(tmp_path)], launcher="python")
    rows = train_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(len(r["data_fingerprint"]) == 16 for r in rows)
    state = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    # 16 blocks read: one from each of lanes 0-15 (the global order takes the 64 in turn); the
    # other lanes have not started, which the position says by leaving them out.
    assert sorted(map(int, state["data_position"]["lanes"])) == list(range(16))
    assert sorted(state["data_position"]["fingerprint"]["sources"]) == ["docs", "stdlib"]
    assert (tmp_path / "final" / "model.safetensors").exists()


def test_instruction_data_streams_as_the_map_style_run_reads_it(tmp_path):
    """ShareGPT chats (``--data_format sft``) streamed in one unshuffled lane, and tokenised up front:
    the same packed rows (the fingerprints), the same losses."""
    chats = [sharegpt_row(TURNS[: 1 + i % 3], system=None if i % 2 else SYSTEM) for i in range(60)]
    write_jsonl(tmp_path / "chats.jsonl", chats)
    sft_tokenizer().save_pretrained(tmp_path / "tok")
    sft = [*COMMON, "--data_format", "sft", "--dataset", str(tmp_path / "chats.jsonl"), "--tokenizer_name_or_path",
           str(tmp_path / "tok"), "--train_sampling_strategy", "sequential", "--max_steps", "3", "--block_size", "128"]  # fmt: skip
    launch(
        [*sft, "--output_dir", str(tmp_path / "map"), "--validation_split_percentage", "0"], launcher="python"
    )
    launch([*sft, "--output_dir", str(tmp_path / "stream"), "--streaming", "true", "--stream_lanes", "1"],
           launcher="python")  # fmt: skip
    assert _prints(tmp_path / "stream") == _prints(tmp_path / "map")
    assert len(set(_prints(tmp_path / "map").values())) == 3
    assert [r["loss"] for r in train_rows(tmp_path / "stream")] == pytest.approx(
        [r["loss"] for r in train_rows(tmp_path / "map")], rel=1e-6
    )
