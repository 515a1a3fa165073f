"""The training entry points' own flags: --help from the schema, and bad input refused at the door."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.launch import ROOT, launch
from trainer.args.recipe import run_help
from trainer.args.run import SECTIONS
from trainer.config.reference import type_name

RECIPE = "scripts/recipes/default.yaml"
DOORS = {
    "scripts/train.py": ["scripts/train.py"],
    "trainer train": ["-m", "trainer.cli.main", "train"],
}


def field_entries() -> list[tuple[str, str, str, str]]:
    """(name, type, default, description) of every run field, straight from the pydantic schema."""
    entries = []
    for model in SECTIONS.values():
        for name, field in model.model_fields.items():
            default = field.default_factory() if field.default_factory is not None else field.default
            entries.append((name, type_name(field.annotation, " | "), json.dumps(default), field.description))
    return entries


def test_help_text_lists_every_field_with_type_default_and_description():
    text = run_help("prog")
    lines = text.splitlines()
    assert lines[0] == "usage: prog [--config RECIPE.yaml] [--field value ...]"
    flowed = " ".join(line.strip() for line in lines)
    names = [name for name, *_ in field_entries()]
    assert len(names) == len(set(names)) > 60
    for name in (
        "output_dir",
        "max_steps",
        "zero_stage",
        "offload_optimizer",
        "offload_param",
        "pipeline_parallel_size",
        "report_to",
        "model_name_or_path",
        "dataset",
        "block_size",
    ):
        assert name in names
    for name, kind, default, description in field_entries():
        assert f"  --{name} {kind} (default: {default})" in lines, name
        assert description and description in flowed, name
    assert "  --zero_stage 0 | 1 | 2 | 3 (default: 0)" in lines
    assert "  --eval_steps int | null (default: null)" in lines


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_through_both_doors(door, flag):
    proc = launch([*DOORS[door], flag], launcher="python", timeout=300)
    assert proc.stdout.startswith(f"usage: {door} [--config RECIPE.yaml] [--field value ...]\n")
    # scripts/train.py without --config runs the default recipe: a field it sets shows its value too.
    recipe = yaml.safe_load((ROOT / RECIPE).read_text()) if door == "scripts/train.py" else {}
    for name, kind, default, _ in field_entries():
        given = f"; {ROOT / RECIPE}: {json.dumps(recipe[name])}" if name in recipe else ""
        assert f"  --{name} {kind} (default: {default}{given})\n" in proc.stdout, name
    if recipe:
        assert f'  --output_dir str (default: "output"; {ROOT / RECIPE}: "output/default")' in proc.stdout
    assert "unknown key" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("door", DOORS)
def test_unsupported_report_to_is_refused_at_the_door(door):
    proc = launch([*DOORS[door], "--report_to", "comet_ml"], launcher="python", timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: report_to: 'comet_ml' is not supported; supported: mlflow, tensorboard, wandb, trackio, none, "
        "all (those installed)"
    )
    assert "Traceback" not in proc.stderr


def test_trainer_train_takes_field_flags_first():
    # argparse's REMAINDER refused a leading --field ("unrecognized arguments"); the schema now parses it.
    proc = launch([*DOORS["trainer train"], "--max_step", "3"], launcher="python", timeout=300, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: max_step: unknown key; did you mean max_steps?"


@pytest.mark.parametrize(
    ("argv", "code"), [(["--help"], 0), (["--max_step", "3"], 2), (["--max_steps", "three"], 2)], ids=str
)
def test_help_and_a_bad_field_are_answered_before_torch_loads(argv, code):
    """The door parses the arguments first: torch, transformers, DeepSpeed and datasets load only for a
    run (each command would otherwise take seconds to print its help or name a typo)."""
    probe = (
        "import sys\nfrom trainer.cli.train import main\n"
        f"code = main({argv!r})\n"
        "print(code, [m for m in ('torch', 'transformers', 'deepspeed', 'datasets') if m in sys.modules])"
    )
    proc = launch(["-c", probe], launcher="python", timeout=300)
    assert proc.stdout.splitlines()[-1] == f"{code} []"


def test_a_refused_hf_field_is_refused_at_the_door_before_anything_loads(tmp_path):
    out = tmp_path / "out"
    argv = ["scripts/train.py", "--output_dir", str(out), "--push_to_hub", "--hub_model_id", "me/model"]
    proc = launch(argv, launcher="python", timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-2:] == [
        "error: push_to_hub: HF's field, refused: nothing is uploaded; output_dir/final is an HF model "
        "directory to push with huggingface_hub",
        "hub_model_id: HF's field, refused: nothing is uploaded; output_dir/final is an HF model directory "
        "to push with huggingface_hub",
    ]
    assert "Traceback" not in proc.stderr and not out.exists()


def test_a_command_ends_after_its_exit_handlers_with_its_code():
    """exit_now skips the interpreter's finalization, not the exit handlers (the group's leaving,
    the integrations' flushes) nor what was printed but not yet flushed."""
    script = (
        "import atexit, sys\n"
        "from trainer.cli.main import exit_now\n"
        "atexit.register(lambda: print('handler ran'))\n"
        "print('unflushed', end=''); sys.stderr.write('to stderr')\n"
        "exit_now(3)\n"
        "print('never')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "unflushedhandler ran\n", "to stderr")


@pytest.mark.parametrize(("stop", "code", "stderr"), [("74", 74, ""), ("'no room'", 1, "no room\n")])
def test_a_command_stopped_by_system_exit_skips_finalization_too(stop, code, stderr):
    """A rank's own stop (a full disk's 74, a non-finite loss's 77) is raised as SystemExit deep in
    the run; run_then_exit still ends the process after its exit handlers and without the
    interpreter's finalization, which would free a module's objects (here: print 'finalized')."""
    script = (
        "import atexit\n"
        "from trainer.cli.main import run_then_exit\n"
        "class Kept:\n"
        "    def __del__(self): print('finalized')\n"
        "kept = Kept()\n"
        "atexit.register(lambda: print('handler ran'))\n"
        f"def main(): raise SystemExit({stop})\n"
        "run_then_exit(main)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (code, "handler ran\n", stderr)


def test_the_sample_is_drawn_from_the_runs_seed(tmp_path):
    """The completion a run prints after its export is sampled (a small model's greedy decoding loops on
    one word) and the same for the same seed, so a rerun of the same run prints the same text."""
    from tests.helpers.preference_scenarios import base
    from trainer.cli.train_job import _sample

    model = Path(base(tmp_path))
    first, again, other = (_sample(model, torch.device("cpu"), seed, "What colour") for seed in (0, 0, 1))
    assert first.startswith("Sample completion:\nWhat colour") and first == again
    assert other != first
