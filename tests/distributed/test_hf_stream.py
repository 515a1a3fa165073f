"""A ``datasets.IterableDataset`` given to the Trainer (tests/helpers/hf_stream_scenario.py: JSON-lines
shards streamed by ``load_dataset``, tokenised and grouped by ``IterableDataset.map``), against HF's
Trainer on the same script.

Three launches: the script as it is (HF's Trainer, one process), with our import on one process
(checkpoints at steps 18 and 24), and with our import on 2 ranks under the deepspeed launcher,
resuming a copy of the one-process run's checkpoint-18.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.launch import ROOT, launch, run_env, together
from tests.helpers.scaffold import bpe_tokenizer, train_rows
from trainer.data.sources import corpus_files

pytestmark = pytest.mark.distributed

SCRIPT = ROOT / "tests" / "helpers" / "hf_stream_scenario.py"
HF_IMPORT = "from transformers import Trainer, TrainingArguments"
OUR_IMPORT = "from trainer import Trainer, TrainingArguments"


def _rows(out: Path) -> list[dict]:
    return json.loads((out / "history.json").read_text())


def _history(out: Path) -> dict[int, dict]:
    return {row["step"]: row for row in _rows(out) if "loss" in row}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_stream")
    files = [p for p in corpus_files() if 2000 < p.stat().st_size < 12000][:24]
    (root / "shards").mkdir()
    for k in range(4):
        with (root / "shards" / f"part-{k}.jsonl").open("w") as f:
            for path in files[k::4]:
                f.write(json.dumps({"content": path.read_text()}) + "\n")
    bpe_tokenizer([p.read_text() for p in files[:6]], model_max_length=64).save_pretrained(root / "tok")
    source = SCRIPT.read_text()
    assert source.count(HF_IMPORT) == 1
    (root / "ours.py").write_text(source.replace(HF_IMPORT, OUR_IMPORT))
    env = run_env(HF_DATASETS_CACHE=str(root / "hf_datasets"))
    common = [str(root / "shards"), str(root / "tok")]
    out = {name: root / name for name in ("hf", "ours", "resumed")}

    def ours_then_resumed() -> None:
        launch([str(root / "ours.py"), str(out["ours"]), *common], launcher="python", env=env)
        out["resumed"].mkdir()
        shutil.copytree(out["ours"] / "checkpoint-18", out["resumed"] / "checkpoint-18")
        checkpoint = str(out["resumed"] / "checkpoint-18")
        launch(
            [str(root / "ours.py"), str(out["resumed"]), *common, checkpoint], launcher="deepspeed", env=env
        )

    # HF's run (one process) beside ours and its resume.
    together(
        lambda: launch([str(SCRIPT), str(out["hf"]), *common], launcher="python", env=env), ours_then_resumed
    )
    return out


def test_an_iterable_dataset_trains_as_hfs_trainer_trains_it(runs):
    """Step by step, HF's losses and grad norms on one process: the same blocks in the same order
    (the dataset's, as HF reads an IterableDataset, though train_sampling_strategy is "random"), and
    HF's epoch, max_steps steps to one, to the last bit."""
    hf, ours = _history(runs["hf"]), _history(runs["ours"])
    assert sorted(ours) == sorted(hf) == list(range(1, 25))
    for step, row in hf.items():
        assert ours[step]["loss"] == pytest.approx(row["loss"], rel=1e-5), step
        assert ours[step]["grad_norm"] == pytest.approx(row["grad_norm"], rel=1e-4), step
        assert ours[step]["epoch"] == row["epoch"] == step / 24, step
    assert _rows(runs["ours"])[-1]["epoch"] == _rows(runs["hf"])[-1]["epoch"] == 1.0  # train()'s summary


def test_its_checkpoint_resumes_on_two_ranks_where_it_stopped(runs):
    """The one-process checkpoint-18 on 2 ranks: steps 19-24 read the blocks the one process read
    next (72 blocks in, each of the 64 lanes reopened where it was, from datasets' state), with
    its losses."""
    ours = _history(runs["ours"])
    resumed = {row["step"]: row for row in train_rows(runs["resumed"])}  # the steps this launch trained
    assert sorted(resumed) == list(range(19, 25))
    for step, row in resumed.items():
        assert row["loss"] == pytest.approx(ours[step]["loss"], rel=1e-5), step
        assert row["epoch"] == ours[step]["epoch"], step
    state = json.loads((runs["ours"] / "checkpoint-18" / "trainer_state.json").read_text())
    assert state["source_blocks"] == {"train_dataset": 72.0}
