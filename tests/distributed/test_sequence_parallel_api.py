"""Sequence parallelism through ``from trainer import Trainer, TrainingArguments`` on 2 ranks,
against the same script on one process."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import launch

pytestmark = pytest.mark.distributed
SCRIPT = "tests/helpers/hf_sequence_parallel.py"


def test_the_trainer_api_splits_rows_and_keeps_the_losses(tmp_path):
    launch([SCRIPT, str(tmp_path / "one"), "1"], launcher="python")
    launch([SCRIPT, str(tmp_path / "sp"), "2"])
    one = json.loads((tmp_path / "one" / "rank0.json").read_text())
    for rank in range(2):
        sp = json.loads((tmp_path / "sp" / f"rank{rank}.json").read_text())
        assert len(sp["losses"]) == 3
        assert sp["losses"] == pytest.approx(one["losses"], rel=1e-4)
        assert sp["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-4)
