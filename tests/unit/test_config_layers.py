"""trainer.config is the bottom layer: it never imports trainer.args, and what it reads of the
training arguments (trainer.config.arguments) stays in step with TrainingArguments."""

from __future__ import annotations

import ast
import subprocess
import sys
import typing

from tests.helpers.launch import ROOT
from trainer.args import TrainingArguments
from trainer.config.arguments import Shortcuts, TrainingArgs


def test_config_imports_nothing_above_it():
    for path in sorted((ROOT / "trainer" / "config").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            above = [n for n in names if n.startswith("trainer.") and not n.startswith("trainer.config")]
            assert not above, f"{path.name}:{node.lineno} imports {above}"


def test_importing_config_loads_neither_torch_nor_the_arguments():
    code = (
        "import sys, trainer.config\n"
        "loaded = [m for m in ('torch', 'deepspeed', 'trainer.args') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_training_arguments_have_everything_config_reads():
    args = TrainingArguments()
    members = [*typing.get_type_hints(TrainingArgs), "model_fields_set", "requested_precision"]
    assert [m for m in members if not hasattr(args, m)] == []


def test_shortcuts_are_checked_as_the_training_arguments_check_them():
    fields = TrainingArguments.model_fields
    for name, field in Shortcuts.model_fields.items():
        if name in ("deepspeed", "pipeline_parallel_size"):
            continue  # fixed: a generated config has neither
        assert (field.annotation, field.metadata) == (fields[name].annotation, fields[name].metadata), name
