"""report_to through transformers' own callbacks, and HF callbacks in our CallbackHandler (no engine).

A Trainer run with them is in tests/e2e/test_report_to.py; this file checks the pieces: TensorBoard
is transformers' TensorBoardCallback fed our arguments and state, a missing package or an unusable
MLflow store is refused before anything loads, and HF controls work in our handler.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import transformers
from transformers import LlamaConfig
from transformers.integrations import MLflowCallback, TensorBoardCallback, WandbCallback

from trainer.args import TrainingArguments
from trainer.cli.train import main
from trainer.config.errors import ConfigError
from trainer.loop.callbacks import CallbackHandler, TrainerControl, TrainerState
from trainer.observe import reporting


def _events(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return events


def test_tensorboard_is_transformers_callback_on_our_state(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to="tensorboard", logging_dir=str(tmp_path / "tb")
    )
    callbacks = reporting.reporting_callbacks(args)
    assert [type(cb) for cb in callbacks] == [TensorBoardCallback]
    handler, state, control = CallbackHandler(callbacks), TrainerState(), TrainerControl()
    model = SimpleNamespace(
        config=LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1)
    )
    handler.fire("on_train_begin", args, state, control, model=model, engine=None)
    for step in (1, 2):
        state.global_step = step
        logs = {"epoch": step / 2, "loss": 4.0 - step, "learning_rate": 1e-3 * step}
        handler.fire("on_log", args, state, control, logs=logs, model=model, engine=None)
    handler.fire("on_log", args, state, control, logs={"epoch": 1.0, "eval_loss": 2.5}, model=model)
    handler.fire("on_train_end", args, state, control, model=model, engine=None)

    events = _events(tmp_path / "tb")  # logging_dir wins over transformers' default
    assert sorted(events.Tags()["scalars"]) == [
        "eval/loss",
        "train/epoch",
        "train/learning_rate",
        "train/loss",
    ]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 3.0), (2, 2.0)]
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(2, 2.5)]
    assert "args/text_summary" in events.Tags()["tensors"]  # args.to_json_string(), as HF records it

    # Without logging_dir: transformers' default, output_dir/runs/DATETIME_HOSTNAME.
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="tensorboard")
    (callback,) = reporting.reporting_callbacks(args)
    callback.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
    callback.on_train_end(args, TrainerState(), TrainerControl())
    (run_dir,) = (tmp_path / "out" / "runs").iterdir()
    assert list(run_dir.glob("events.out.tfevents.*"))


def test_integrations_are_transformers_callbacks(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_DIR", "set")
    monkeypatch.delenv("WANDB_DIR")  # unset, and unset again after the test
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=["wandb", "mlflow"])
    assert [type(cb) for cb in reporting.reporting_callbacks(args)] == [WandbCallback, MLflowCallback]
    assert reporting.os.environ["WANDB_DIR"] == str(tmp_path / "out")  # wandb's files stay in output_dir


def test_a_missing_package_is_named_with_its_extra(monkeypatch):
    monkeypatch.setattr(reporting, "_installed", lambda module: module not in ("wandb", "mlflow"))
    with pytest.raises(ConfigError) as err:
        reporting.check_report_to(TrainingArguments(report_to=["tensorboard", "wandb", "mlflow"]))
    assert str(err.value).splitlines() == [
        "report_to: wandb needs the wandb package, which is not installed; install it with: "
        "pip install 'ds-llm-trainer[wandb]'",
        "report_to: mlflow needs the mlflow-skinny package, which is not installed; install it with: "
        "pip install 'ds-llm-trainer[mlflow]'",
    ]


def test_the_cli_refuses_a_missing_package_before_anything_loads(monkeypatch, capsys):
    monkeypatch.setattr(reporting, "_installed", lambda module: module != "wandb")
    monkeypatch.setattr("trainer.cli.train_job.build_run", lambda *a, **k: pytest.fail("a model was built"))
    monkeypatch.setattr("trainer.cli.train_job.init_distributed", lambda *a: pytest.fail("the group started"))
    assert main(["--report_to", "wandb", "--max_steps", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: report_to: wandb needs the wandb package, which is not installed; install it with: "
        "pip install 'ds-llm-trainer[wandb]'"
    )


def test_an_mlflow_store_that_cannot_work_is_refused(tmp_path, monkeypatch):
    import mlflow

    args = TrainingArguments(report_to="mlflow")
    monkeypatch.setattr(mlflow, "is_tracking_uri_set", lambda: False)
    with pytest.raises(ConfigError, match="^report_to: mlflow: set MLFLOW_TRACKING_URI to a tracking server"):
        reporting.check_report_to(args)
    monkeypatch.undo()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(
        ConfigError, match="is a file store, which this MLflow refuses unless MLFLOW_ALLOW_FILE"
    ):
        reporting.check_report_to(args)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    reporting.check_report_to(args)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")  # a server: nothing to check here
    reporting.check_report_to(args)


class _Returns(transformers.TrainerCallback):
    """An HF callback: returns a new transformers TrainerControl, the one it got, or None."""

    def __init__(self, mode: str):
        self.mode = mode

    def on_step_end(self, args, state, control, **kwargs):
        if self.mode == "new":
            return transformers.TrainerControl(should_training_stop=True, should_save=True)
        if self.mode == "mutate":
            control.should_evaluate = True
            return control
        control.should_log = True  # mutates and returns None


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("new", {"should_training_stop": True, "should_save": True}),
        ("mutate", {"should_evaluate": True}),
        ("none", {"should_log": True}),
    ],
)
def test_hf_callbacks_controls_reach_ours(mode, expected):
    control = CallbackHandler([_Returns(mode)]).fire(
        "on_step_end", TrainingArguments(), TrainerState(), TrainerControl(), model=None, engine=None
    )
    assert isinstance(control, TrainerControl)
    assert {k: v for k, v in vars(control).items() if v} == expected


def test_arguments_and_state_carry_what_hf_callbacks_read():
    args = TrainingArguments(run_name="r1", report_to="none")
    assert json.loads(args.to_json_string())["run_name"] == "r1"
    assert (args.project, args.trackio_space_id, args.hub_private_repo) == ("huggingface", None, None)
    state = TrainerState()
    assert (state.is_hyper_param_search, state.trial_name, state.is_local_process_zero) == (False, None, True)
    assert state.best_global_step is None and state.total_flos == 0.0


def test_wandb_log_model_is_refused(monkeypatch):
    for value in ("end", "checkpoint"):
        monkeypatch.setenv("WANDB_LOG_MODEL", value)
        with pytest.raises(ConfigError, match=f"^WANDB_LOG_MODEL: '{value}' is not supported; unset it"):
            reporting.check_report_to(TrainingArguments(report_to="wandb"))
    monkeypatch.setenv("WANDB_LOG_MODEL", "false")
    reporting.check_report_to(TrainingArguments(report_to="wandb"))


def test_each_integration_has_its_extra_and_dev_pulls_the_tested_ones():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from tests.helpers.launch import ROOT

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = {extra: {r.split(">")[0] for r in reqs} for extra, reqs in extras.items()}
    for package, extra in reporting.PACKAGES.values():
        if extra is not None:
            assert named[extra] == {package}, extra
    assert {"wandb", "mlflow-skinny"} <= named["dev"]
