"""Running ``scripts/train.py`` again into an output_dir that holds a run: a finished run trains
nothing, a changed model or dataset is refused before anything loads (a data file rewritten in place
too: same name, size and mtime, other bytes), safe changes go on (ZeRO-1 <-> 2 among them: the run
is at ZeRO-1).

A rerun that trains nothing leaves every file of the directory as it was, bar the lock file: the
directory was free, so the rerun took it and the lock names the rerun as its last holder (as any
run that takes a free directory does)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.launch import launch
from tests.helpers.scaffold import file_digests, loss_steps, tiny_flags
from trainer.runtime.ownership import LOCK_FILE

TINY = tiny_flags(logging_steps=2, max_train_samples=100, max_eval_samples=8, zero_stage=1)
DATA = "data.jsonl"  # beside the output_dir


def train(out: Path, *extra: str, check: bool = True):
    args = ["scripts/train.py", "--output_dir", str(out), "--dataset", str(out.parent / DATA), *TINY, *extra]
    proc = launch(args, launcher="python", check=check)
    return proc.returncode, proc.stdout + proc.stderr


def contents(out: Path) -> dict[str, str]:
    """Every file of ``out`` and its sha256, bar the lock file (which a rerun takes over)."""
    return {path: digest for path, digest in file_digests(out).items() if path != LOCK_FILE}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rerun") / "run"
    text = Path(json.__file__).parent.joinpath("decoder.py").read_text() * 2
    docs = [{"text": text[i : i + 300]} for i in range(0, len(text), 300)]
    (out.parent / DATA).write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    train(out)
    return out


def test_rerunning_a_finished_run_trains_nothing_and_keeps_final(finished):
    final = (finished / "final" / "model.safetensors").stat().st_mtime_ns
    before = contents(finished)
    code, text = train(finished)
    assert code == 0
    assert f"{finished / 'checkpoint-4'} already reached the end of this run: nothing to train" in text
    assert loss_steps(finished) == [2, 4]
    assert not (finished / "checkpoint-5").exists()
    assert (finished / "final" / "model.safetensors").stat().st_mtime_ns == final
    assert contents(finished) == before


def test_resuming_into_another_model_or_data_is_refused_before_loading(finished):
    before = contents(finished)
    code, text = train(
        finished,
        "--model_config_overrides", '{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}',
        "--block_size", "32",
        check=False,
    )  # fmt: skip
    assert code == 2, text
    assert (
        "error: block_size, model_config_overrides: differ from the run that wrote "
        f"{finished / 'checkpoint-4'}" in text
    )
    assert "--resume_from_checkpoint false" in text and "Traceback" not in text
    assert contents(finished) == before  # nothing written, added or removed


def test_safe_changes_resume_and_are_named(finished):
    code, text = train(
        finished, "--max_steps", "6", "--logging_steps", "1", "--max_eval_samples", "4", "--zero_stage", "2"
    )
    assert code == 0
    assert "with changed settings: logging_steps, max_eval_samples, max_steps, zero_stage" in text
    assert f"Resumed from {finished / 'checkpoint-4'} at step 4." in text
    assert loss_steps(finished) == [2, 4, 5, 6]


def test_a_data_file_rewritten_in_place_is_refused_naming_it(finished):
    # Same path, same size, mtime set back: only the bytes say the data changed.
    data = finished.parent / DATA
    stat = data.stat()
    data.write_text(data.read_text().replace("e", "E"))
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert data.stat().st_size == stat.st_size
    before = contents(finished)
    code, text = train(finished, "--max_steps", "8", check=False)
    assert code == 2, text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: dataset (the content of {data.resolve()}): differ from the run that wrote "
        f"{finished / 'checkpoint-6'}, so its weights and data position do not apply; use a new "
        "--output_dir, or --resume_from_checkpoint false to start over"
    ], text
    assert contents(finished) == before
