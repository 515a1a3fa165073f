"""scripts/walk_docs.py's pieces: launchers sized to the machine, a folder's training rows counted."""

from __future__ import annotations

import json
import runpy
import time

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


def test_a_folders_last_logged_step_is_read(tmp_path):
    last_step = WALK["last_step"]
    assert last_step(tmp_path) == 0
    rows = [
        {"step": 1, "loss": 2.0},
        {"step": 2, "eval_loss": 2.1},
        {"step": 2, "train_runtime": 3.0},
        {"x": 1},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert last_step(tmp_path) == 2


def test_a_launch_past_its_timeout_is_stopped_with_every_process_under_it(tmp_path):
    """A rank in a session of its own (as the launchers start them) is stopped too."""
    started, marker = tmp_path / "started", tmp_path / "still_running"
    # The rank says it is up at once; the timeout leaves a loaded machine seconds to start it.
    script = f"setsid bash -c 'touch {started}; sleep 8; touch {marker}' & sleep 60"
    code, seconds = WALK["run"](["bash", "-c", script], tmp_path, tmp_path / "log", timeout=5)
    assert code is None and seconds < 15
    assert started.exists()  # it was running when the timeout came
    time.sleep(8)
    assert not marker.exists()
