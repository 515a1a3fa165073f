"""``scripts/train.py --report_to wandb mlflow tensorboard``, as a user types it: transformers' own
callbacks get every logged row, and each integration's store reads back what metrics.jsonl holds.

wandb runs offline (no network) and its run file is read back record by record; MLflow writes to a
file store in the test's directory; TensorBoard's event files are read with TensorBoard's reader.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.helpers.launch import launch, run_env
from tests.helpers.scaffold import read_metrics, tiny_flags

TINY = tiny_flags(logging_steps=2, vocab_size=4096)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("report_to")
    out, store = root / "out", (root / "mlruns").as_uri()
    env = run_env(WANDB_MODE="offline", MLFLOW_TRACKING_URI=store, MLFLOW_ALLOW_FILE_STORE="true")
    env.pop("WANDB_DIR", None)
    proc = launch(
        ["scripts/train.py", "--output_dir", str(out), "--report_to", "wandb", "mlflow", "tensorboard",
         "--run_name", "tiny-run", *TINY],
        launcher="python", timeout=600, env=env,
    )  # fmt: skip
    rows = read_metrics(out)
    return out, store, rows, proc


def test_metrics_jsonl_is_kept(run):
    _, _, rows, proc = run
    assert "Traceback" not in proc.stdout + proc.stderr
    assert [r["step"] for r in rows if "loss" in r] == [2, 4]
    assert [r["step"] for r in rows if "eval_loss" in r] == [4]


def wandb_records(path: Path):
    """The records of a wandb run file (LevelDB's log format: 32 KiB blocks of 7-byte-headed chunks,
    after wandb's 7-byte file header), each parsed with wandb's own protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_holds_the_metrics(run):
    out, _, rows, _ = run
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")  # WANDB_DIR defaults to output_dir
    history, names = [], []
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            )
        elif kind == "run":
            names.append(record.run.display_name)
    assert names and set(names) == {"tiny-run"}
    train = [(h["train/global_step"], h["train/loss"]) for h in history if "train/loss" in h]
    assert train == [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(h["train/global_step"], h["eval/loss"]) for h in history if "eval/loss" in h]
    assert evals == [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    assert "train/tokens_per_second" in history[0]


def test_mlflow_file_store_holds_the_metrics(run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    _, store, rows, _ = run
    client = MlflowClient(store)
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert (found.info.run_name, found.info.status) == ("tiny-run", "FINISHED")
    history = client.get_metric_history(found.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = client.get_metric_history(found.info.run_id, "eval_loss")
    assert [(m.step, m.value) for m in evals] == [
        (r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r
    ]
    assert found.data.params["run_name"] == "tiny-run" and found.data.params["hidden_size"] == "64"


def test_tensorboard_event_files_hold_the_metrics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, rows, _ = run
    (run_dir,) = (out / "runs").iterdir()  # transformers' default: runs/DATETIME_HOSTNAME
    events = EventAccumulator(str(run_dir))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert losses == [(r["step"], pytest.approx(r["loss"])) for r in rows if "loss" in r]
    assert [e.step for e in events.Scalars("eval/loss")] == [4]
