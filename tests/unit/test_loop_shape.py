"""The loop's shape, from its source and one traced step: ``loop/trainer.py`` stays readable, the
HF mixins read nothing private of the Trainer, subclasses change what trains through public points
only, and a plain step runs code from at most 10 files of the package (docs/architecture.md)."""

from __future__ import annotations

import ast
import inspect
import runpy
from pathlib import Path

import pytest

from trainer.loop.hf_methods import HFMethods
from trainer.loop.trainer import Trainer
from trainer.objectives import OBJECTIVES
from trainer.observe.results import ResultsAPI

ROOT = Path(__file__).resolve().parents[2]


def test_the_trainer_module_is_at_most_400_lines_without_joined_ones():
    source = (ROOT / "trainer" / "loop" / "trainer.py").read_text()
    assert len(source.splitlines()) <= 400
    assert "fmt: skip" not in source


@pytest.mark.parametrize("mixin", [HFMethods, ResultsAPI])
def test_the_hf_mixins_read_no_private_attribute_of_the_trainer(mixin):
    tree = ast.parse(inspect.getsource(mixin))
    own = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    read = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
    }
    assert {name for name in read if name.startswith("_")} <= own


def test_trainers_override_no_private_method_of_the_loop():
    from trainer.loop.seq2seq import Seq2SeqTrainer

    trainers = {entry.trainer_class() for entry in OBJECTIVES.values()} | {Seq2SeqTrainer}
    private = {name for name in dir(Trainer) if name.startswith("_") and not name.startswith("__")}
    for cls in trainers:
        for klass in cls.__mro__[: cls.__mro__.index(Trainer)]:
            assert not private & set(vars(klass)), (klass.__name__, private & set(vars(klass)))


def test_a_plain_step_runs_code_from_at_most_10_files(tmp_path):
    files_of_one_step = runpy.run_path(str(ROOT / "scripts" / "step_files.py"))["files_of_one_step"]
    files = files_of_one_step(tmp_path)
    assert "trainer/loop/trainer.py" in files and "trainer/engine/deepspeed_engine.py" in files
    assert len(files) <= 10, files
