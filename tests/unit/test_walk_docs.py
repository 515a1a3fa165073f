"""scripts/walk_docs.py's pieces: launchers sized to the machine, a folder's training rows counted."""

from __future__ import annotations

import json
import runpy

from tests.helpers.launch import ROOT

WALK = runpy.run_path(str(ROOT / "scripts" / "walk_docs.py"))


def test_a_launcher_is_sized_to_the_machine_and_nothing_else_changes():
    sized = WALK["sized"]
    command = "torchrun --nproc_per_node 8 --max-restarts 3 scripts/train.py --zero_stage 3 --bf16"
    assert sized(command, 2, None) == [
        "torchrun", "--nproc_per_node", "2", "--max-restarts", "3", "scripts/train.py", "--zero_stage", "3", "--bf16"
    ]  # fmt: skip
    assert sized("deepspeed --num_gpus 8 scripts/train.py", 1, 20)[2:] == [
        "1",
        "scripts/train.py",
        "--max_steps",
        "20",
    ]
    assert (
        sized("python scripts/train.py --num_train_epochs 8", 2, None)[-1] == "8"
    )  # the script's own option


def test_a_folder_gains_training_rows_only(tmp_path):
    train_rows = WALK["train_rows"]
    assert train_rows(tmp_path) == 0
    rows = [
        {"step": 1, "loss": 2.0},
        {"step": 1, "eval_loss": 2.1},
        {"step": 1, "train_runtime": 3.0, "loss": 2.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert train_rows(tmp_path) == 1
