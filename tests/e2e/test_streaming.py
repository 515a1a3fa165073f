"""Streamed mixtures through the user's command, with ``--log_data_fingerprint``: every step's row
carries a hash of its global batch, so runs are compared token for token.

One process (two accumulated micro-batches, two DataLoader workers) and two ranks under torchrun
read a mixture of JSON-lines shards and Markdown files at the default 64 lanes: both sources have
fewer rows than lanes (30 modules in 6 shards, 15 pages), so lanes take their rows from later
epochs. The two-rank run killed after step 4, and
killed inside a DataLoader worker, is started again by the same command; its checkpoint-3 resumes on
one process. The runs are shared by the tests below, each one-process run beside a launch of two
ranks; the one-process streams (a single lane against the map-style run, a URL, instruction rows,
the mixture recipe, a bad shard) are in ``test_streaming_one_process.py``.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.helpers.launch import ROOT, launch, run_env, together
from tests.helpers.scaffold import assert_same_weights, read_metrics, tiny_flags, train_rows
from trainer.args import DataArguments
from trainer.data.sources import corpus_files
from trainer.data.stream import STREAM_LENGTH, StreamedDataset
from trainer.data.stream_sources import stream_sources
from trainer.observe.plots import plot_runs

pytestmark = pytest.mark.distributed

STEPS = dict(max_steps=6, save_steps=3, eval_steps=100, max_train_samples=None, vocab_size=4096)
COMMON = ["scripts/train.py", *tiny_flags(**STEPS), "--per_device_train_batch_size", "4",
          "--log_data_fingerprint", "true"]  # fmt: skip


def _corpus(root: Path) -> dict[str, Path]:
    """A small sample, as a first try streams: 30 modules in 6 JSON-lines shards, and the docs."""
    code = root / "code"
    code.mkdir()
    files = [p for p in corpus_files() if p.stat().st_size < 20000][:30]
    for k in range(6):
        with (code / f"part-{k}.jsonl").open("w") as f:
            for path in files[k::6]:
                f.write(json.dumps({"content": path.read_text()}) + "\n")
    shutil.copytree(ROOT / "docs", root / "prose", ignore=shutil.ignore_patterns("img"))
    return {"code": code, "prose": root / "prose"}


def _mixture(corpus: dict[str, Path]) -> list[str]:
    sources = [{"dataset": str(corpus["code"]), "weight": 0.7, "text_column": "content"},
               {"dataset": str(corpus["prose"] / "*.md"), "weight": 0.3}]  # fmt: skip
    return ["--streaming", "true", "--dataset_mixture", json.dumps(sources)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("streams")
    corpus = _corpus(root)
    stream = [*COMMON, *_mixture(corpus)]
    out = {name: root / name for name in ("one", "two", "killed", "worker", "elsewhere")}
    together(
        lambda: launch([*stream, "--output_dir", str(out["one"]), "--gradient_accumulation_steps", "2",
                        "--dataloader_num_workers", "2"], launcher="python"),
        lambda: launch([*stream, "--output_dir", str(out["two"])]),
    )  # fmt: skip

    def killed_and_started_again() -> None:
        faults = {"killed": ("crash:rank=1:step=4", []),
                  "worker": ("crash:rank=1:phase=worker:sample=18", ["--dataloader_num_workers", "2"])}  # fmt: skip
        for name, (fault, extra) in faults.items():
            cmd = [*stream, "--output_dir", str(out[name]), *extra]
            first = launch(cmd, check=False, env=run_env(TRAINER_FAULT=fault))
            out[f"{name}_rc"], out[f"{name}_steps"] = (
                first.returncode,
                [r["step"] for r in train_rows(out[name])],
            )
            launch(cmd)

    def elsewhere() -> None:  # the two ranks' checkpoint-3 on one process
        out["elsewhere"].mkdir()
        shutil.copytree(out["two"] / "checkpoint-3", out["elsewhere"] / "checkpoint-3")
        launch([*stream, "--output_dir", str(out["elsewhere"]), "--gradient_accumulation_steps", "2"],
               launcher="python")  # fmt: skip

    together(killed_and_started_again, elsewhere)
    out["corpus"] = corpus
    return out


def _prints(out: Path) -> dict[int, str]:
    return {row["step"]: row["data_fingerprint"] for row in train_rows(out)}


def test_two_ranks_read_one_process_global_batches(runs):
    """The same tokens in every step's global batch, and the same losses: the order depends on the
    seed and the lanes, not on the ranks or the workers. The epoch is HF's for a dataset without a
    length: max_steps steps make one."""
    one, two = train_rows(runs["one"]), train_rows(runs["two"])
    assert [r["step"] for r in two] == [1, 2, 3, 4, 5, 6]
    for run in ("one", "two", "elsewhere"):
        assert [r["epoch"] for r in train_rows(runs[run])] == [r["step"] / 6 for r in train_rows(runs[run])]
    assert read_metrics(runs["two"])[-1]["epoch"] == 1.0  # the run's summary row
    assert _prints(runs["two"]) == _prints(runs["one"])
    assert len(set(_prints(runs["one"]).values())) == 6
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]


@pytest.mark.parametrize("name", ["killed", "worker"])
def test_a_killed_run_started_again_resumes_bitwise(runs, name):
    """Killed after step 4 (or in a DataLoader worker, during step 4 or 5), the same command resumes
    checkpoint-3: the same global batches, losses and grad norms, and the final weights bit for bit."""
    assert runs[f"{name}_rc"] != 0 and runs[f"{name}_steps"][:3] == [1, 2, 3]
    assert max(runs[f"{name}_steps"]) <= 5
    names = ("loss", "grad_norm", "data_fingerprint")
    again = {(r["step"], k): r[k] for r in train_rows(runs[name])[-3:] for k in names}
    whole = {(r["step"], k): r[k] for r in train_rows(runs["two"]) for k in names if r["step"] >= 4}
    assert again == whole
    assert_same_weights(runs[name] / "final", runs["two"] / "final")


def test_a_two_rank_checkpoint_resumes_on_one_process(runs):
    resumed = _prints(runs["elsewhere"])
    assert sorted(resumed) == [4, 5, 6]
    assert resumed == {step: value for step, value in _prints(runs["two"]).items() if step >= 4}
    state = json.loads((runs["two"] / "checkpoint-3" / "trainer_state.json").read_text())
    assert sorted(map(int, state["data_position"]["lanes"])) == list(range(24))  # lanes 0-23 started
    assert_same_weights(runs["elsewhere"] / "final", runs["two"] / "final", rtol=1e-5, atol=1e-6)


def test_each_row_logs_the_realised_share_of_each_source(runs, tmp_path):
    """``source_share/<name>``: each source's share of the blocks trained to the step, counted on
    every rank. The stream read again here (the run's settings, sources and tokenizer) gives the
    same shares; resumed runs carry the counts on from their checkpoint; ``trainer plot`` draws them."""
    state = json.loads((runs["two"] / "checkpoint-3" / "trainer_state.json").read_text())
    settings = state["data_position"]["fingerprint"]["settings"]
    mixture = _mixture(runs["corpus"])
    sources = stream_sources(DataArguments(streaming=True, dataset_mixture=json.loads(mixture[3])))
    tokenizer = AutoTokenizer.from_pretrained(runs["two"] / "final")
    stream = StreamedDataset(sources, tokenizer, settings.pop("block_size"), STREAM_LENGTH, **settings)
    names = [block["source"] for _, block in zip(range(6 * 8), stream, strict=False)]
    for run in ("one", "two", "killed", "worker", "elsewhere"):
        for row in train_rows(runs[run]):
            seen = Counter(names[: 8 * row["step"]])
            shares = {key: value for key, value in row.items() if key.startswith("source_share/")}
            assert shares == {f"source_share/{n}": pytest.approx(seen[n] / sum(seen.values()), abs=1e-6)
                              for n in ("code", "prose")}, (run, row["step"])  # fmt: skip
    assert 0.1 < shares["source_share/prose"] < 0.6  # both sources drawn
    assert str(tmp_path / "source_share.png") in plot_runs([str(runs["two"])], str(tmp_path))


def test_a_changed_source_is_refused_by_name(runs, tmp_path):
    """A page of the mixture's prose rewritten after the run (the launches are all done): resuming
    its checkpoint is refused, naming the source, before anything trains."""
    shutil.copytree(runs["two"] / "checkpoint-3", tmp_path / "checkpoint-3")
    with (runs["corpus"]["prose"] / "data.md").open("a") as f:
        f.write("\nOne more line.\n")
    proc = launch([*COMMON, *_mixture(runs["corpus"]), "--output_dir", str(tmp_path)], launcher="python",
                  check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "error: dataset_mixture.prose: its files changed since the checkpoint" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
