"""transformers' example scripts, ported by changing their import: scripts in the shape of
run_clm, run_mlm, run_classification (single-label, multi-label, regression), run_ner,
run_image_classification and run_summarization (``tests/helpers/run_*_shaped.py``) run with
transformers' Trainer as written and with the one import line swapped for ours.

- One process, no DeepSpeed file: each task's run with ours gives HF's numbers step by step (loss,
  grad norm, learning rate from ``trainer_state.json``) and HF's final eval loss, and writes what HF's
  writes (result keys, prediction files).
- Two ranks: each script with our import under ``deepspeed --num_gpus 2`` and a ZeRO-3 DeepSpeed
  JSON of "auto" values exits 0 and writes its result files and the model card.

Each run happens once (a module-scoped cache) and feeds every test that reads it. Only the two-rank
tests are ``distributed``: the one-process ones run two at a time in ``make test``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.distributed.test_run_clm_shaped import DS_CONFIG
from tests.helpers.hf_examples_data import write_inputs
from tests.helpers.launch import ROOT, launch, run_env

HELPERS = ROOT / "tests" / "helpers"
SWAP_MARK = "# the test swaps this line for ours"

# What every run shares: a handful of logged steps, evaluation batches of unequal size (16 rows as
# 6 + 6 + 4), no checkpoints.
COMMON = {
    "do_train": True,
    "do_eval": True,
    "max_steps": 6,
    "per_device_train_batch_size": 4,
    "per_device_eval_batch_size": 6,
    "learning_rate": 1e-2,
    "warmup_steps": 1,
    "logging_steps": 1,
    "eval_strategy": "no",
    "save_strategy": "no",
    "report_to": "none",
    "seed": 0,
}
# The files of HF's output-dir layout every script's run writes.
RESULT_FILES = {
    "train_results.json",
    "eval_results.json",
    "all_results.json",
    "trainer_state.json",
    "README.md",
    "config.json",
    "model.safetensors",
}


@dataclass(frozen=True)
class Task:
    script: str
    args: dict  # "{in}" in a value stands for the inputs' directory
    outputs: tuple[str, ...] = ()  # the script's files beyond RESULT_FILES
    predictions: tuple[str, ...] = ()  # of those, text files both Trainers must write alike
    two_ranks: bool = True  # one task of each script also runs on two ranks


CLASSIFICATION_OUTPUTS = {"outputs": ("predict_results.txt",), "predictions": ("predict_results.txt",)}
TASKS = {
    "clm": Task(
        "run_clm_shaped.py",
        {
            "tokenizer_name": "{in}/bpe_tokenizer",
            "train_file": "{in}/mlm_train.txt",
            "validation_file": "{in}/mlm_validation.txt",
            "block_size": 16,
            "gradient_accumulation_steps": 2,
        },
        two_ranks=False,  # tests/distributed/test_run_clm_shaped.py runs it on two ranks
    ),
    "mlm": Task(
        "run_mlm_shaped.py",
        {
            "tokenizer_name": "{in}/bert_tokenizer",
            "train_file": "{in}/mlm_train.txt",
            "validation_file": "{in}/mlm_validation.txt",
            "line_by_line": True,
            "gradient_accumulation_steps": 2,
        },
    ),
    "classification": Task(
        "run_classification_shaped.py",
        {
            "tokenizer_name": "{in}/bert_tokenizer",
            "train_file": "{in}/classification_single_train.csv",
            "validation_file": "{in}/classification_single_validation.csv",
            "test_file": "{in}/classification_single_test.csv",
            "text_column_names": "sentence1,sentence2",
            "do_predict": True,
        },
        **CLASSIFICATION_OUTPUTS,
        two_ranks=False,
    ),
    "multi_label": Task(
        "run_classification_shaped.py",
        {
            "tokenizer_name": "{in}/bert_tokenizer",
            "train_file": "{in}/classification_multi_train.jsonl",
            "validation_file": "{in}/classification_multi_validation.jsonl",
            "test_file": "{in}/classification_multi_test.jsonl",
            "text_column_names": "sentence",
            "do_predict": True,
        },
        **CLASSIFICATION_OUTPUTS,
    ),
    "regression": Task(
        "run_classification_shaped.py",
        {
            "tokenizer_name": "{in}/bert_tokenizer",
            "train_file": "{in}/classification_regression_train.csv",
            "validation_file": "{in}/classification_regression_validation.csv",
            "test_file": "{in}/classification_regression_test.csv",
            "text_column_names": "sentence",
            "do_predict": True,
        },
        **CLASSIFICATION_OUTPUTS,
        two_ranks=False,
    ),
    "ner": Task(
        "run_ner_shaped.py",
        {
            "tokenizer_name": "{in}/bert_tokenizer",
            "train_file": "{in}/ner_train.jsonl",
            "validation_file": "{in}/ner_validation.jsonl",
            "test_file": "{in}/ner_test.jsonl",
            "do_predict": True,
            "return_entity_level_metrics": True,
            "gradient_accumulation_steps": 2,
        },
        outputs=("predictions.txt", "predict_results.json"),
        predictions=("predictions.txt",),
    ),
    "image": Task(
        "run_image_classification_shaped.py",
        {
            "train_dir": "{in}/images/train",
            "validation_dir": "{in}/images/validation",
            "remove_unused_columns": False,  # the transform reads the image column, as HF's README says
            "gradient_accumulation_steps": 2,
        },
        outputs=("preprocessor_config.json",),
    ),
    "summarization": Task(
        "run_summarization_shaped.py",
        {
            "tokenizer_name": "{in}/bpe_tokenizer",
            "train_file": "{in}/summarization_train.jsonl",
            "validation_file": "{in}/summarization_validation.jsonl",
            "test_file": "{in}/summarization_test.jsonl",
            "source_prefix": "summarize: ",
            "do_predict": True,
            "predict_with_generate": True,
            "generation_max_length": 12,
        },
        outputs=("generated_predictions.txt", "predict_results.json", "generation_config.json"),
        predictions=("generated_predictions.txt",),
    ),
}
TWO_RANK_TASKS = [name for name, task in TASKS.items() if task.two_ranks]


def ours_source(source: str) -> str:
    """The script with its one marked import line taken from ``trainer`` instead of transformers."""
    lines = source.splitlines(keepends=True)
    marked = [i for i, line in enumerate(lines) if SWAP_MARK in line]
    assert len(marked) == 1, f"expected one line marked {SWAP_MARK!r}, found {len(marked)}"
    line = lines[marked[0]]
    assert line.startswith("from transformers import "), line
    lines[marked[0]] = line.replace("from transformers import ", "from trainer import ", 1)
    return "".join(lines)


def flags(args: dict) -> list[str]:
    out = []
    for key, value in args.items():
        out += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return out


class Runs:
    """Each (task, Trainer, launcher) run once, on first use; a failed run's error is kept and raised
    again for every test that reads it."""

    def __init__(self, root: Path):
        self.root = root
        self.env = run_env(HF_DATASETS_CACHE=str(root / "hf_datasets"))
        self.done: dict[tuple[str, str], Path | AssertionError] = {}
        (root / "ds.json").write_text(json.dumps(DS_CONFIG, indent=2))
        for script in {task.script for task in TASKS.values()}:
            (root / f"ours_{script}").write_text(ours_source((HELPERS / script).read_text()))

    def out(self, name: str, kind: str) -> Path:
        """``kind``: "hf" (transformers' Trainer, one process), "ours" (one process), "ours_2" (two ranks)."""
        key = (name, kind)
        if key not in self.done:
            try:
                self.done[key] = self._run(name, kind)
            except AssertionError as failure:
                self.done[key] = failure
        result = self.done[key]
        if isinstance(result, AssertionError):
            raise result
        return result

    def _run(self, name: str, kind: str) -> Path:
        task = TASKS[name]
        out = self.root / kind / name
        given = {
            k: v.replace("{in}", str(self.root)) if isinstance(v, str) else v for k, v in task.args.items()
        }
        args = {**COMMON, **given, "output_dir": str(out)}
        script = HELPERS / task.script if kind == "hf" else self.root / f"ours_{task.script}"
        if kind == "ours_2":
            args["deepspeed"] = str(self.root / "ds.json")
            launch([str(script), *flags(args)], nproc=2, launcher="torchrun", env=self.env, timeout=600)
        else:
            launch([str(script), *flags(args)], launcher="python", env=self.env, timeout=600)
        return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("hf_examples")
    write_inputs(root)
    return Runs(root)


def read(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


def step_rows(out: Path) -> list[dict]:
    return [row for row in read(out, "trainer_state.json")["log_history"] if "loss" in row]


@pytest.mark.parametrize("name", list(TASKS))
def test_hf_reference_run(runs, name):
    """The harness itself: each script runs end to end with transformers' Trainer."""
    out = runs.out(name, "hf")
    files = {p.name for p in out.iterdir()}
    expected = RESULT_FILES | set(TASKS[name].outputs)
    assert files >= expected, sorted(expected - files)
    rows = step_rows(out)
    assert [row["step"] for row in rows] == list(range(1, COMMON["max_steps"] + 1))
    assert all(math.isfinite(row["loss"]) and row["grad_norm"] > 0 for row in rows)
    assert math.isfinite(read(out, "eval_results.json")["eval_loss"])


@pytest.mark.parametrize("name", list(TASKS))
def test_one_process_matches_hf_step_by_step(runs, name):
    hf, ours = runs.out(name, "hf"), runs.out(name, "ours")
    hf_rows, our_rows = step_rows(hf), step_rows(ours)
    assert [row["step"] for row in our_rows] == [row["step"] for row in hf_rows]
    for key in ("loss", "grad_norm", "learning_rate"):
        expected = [row[key] for row in hf_rows]
        assert [row[key] for row in our_rows] == pytest.approx(expected, rel=1e-5, abs=1e-12), key


@pytest.mark.parametrize("name", list(TASKS))
def test_one_process_eval_loss_matches_hf(runs, name):
    hf, ours = runs.out(name, "hf"), runs.out(name, "ours")
    assert read(ours, "eval_results.json")["eval_loss"] == pytest.approx(
        read(hf, "eval_results.json")["eval_loss"], rel=1e-5
    )


@pytest.mark.parametrize("name", list(TASKS))
def test_one_process_writes_what_hf_writes(runs, name):
    hf, ours = runs.out(name, "hf"), runs.out(name, "ours")
    assert {p.name for p in hf.iterdir()} <= {p.name for p in ours.iterdir()}
    for results in ("train_results.json", "eval_results.json", "all_results.json"):
        assert set(read(ours, results)) == set(read(hf, results)), results
    for predictions in TASKS[name].predictions:
        assert (ours / predictions).read_text() == (hf / predictions).read_text(), predictions


@pytest.mark.distributed
@pytest.mark.parametrize("name", TWO_RANK_TASKS)
def test_two_ranks_zero3(runs, name):
    out = runs.out(name, "ours_2")
    files = {p.name for p in out.iterdir()}
    expected = RESULT_FILES | set(TASKS[name].outputs)
    assert files >= expected, sorted(expected - files)
    state = read(out, "trainer_state.json")
    assert state["global_step"] == COMMON["max_steps"]
    assert all(math.isfinite(row["loss"]) for row in step_rows(out))
    assert math.isfinite(read(out, "eval_results.json")["eval_loss"])
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and f"learning_rate: {COMMON['learning_rate']}" in card
    for predictions in TASKS[name].predictions:  # one line per test row, written once (rank 0)
        lines = (out / predictions).read_text().splitlines()
        assert len(lines) == 8 + (predictions == "predict_results.txt"), predictions
