"""``report_to``: transformers' own integration callbacks (TensorBoard, wandb, MLflow, trackio).

Nothing here writes metrics: each integration is the callback transformers ships
(``INTEGRATION_TO_CALLBACK``), driven by our Trainer with the arguments, state and logs HF's
Trainer gives it. What is ours is what must happen before anything loads: a requested integration
whose package is missing, or an MLflow store that cannot work, is refused with one clear message;
and wandb's files go to ``output_dir`` unless ``WANDB_DIR`` says otherwise.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any
from urllib.parse import urlparse

from transformers.integrations import INTEGRATION_TO_CALLBACK, TensorBoardCallback

from trainer.args.training import REPORT_TO, TrainingArguments
from trainer.config.errors import ConfigError

# The distribution pip installs for each integration, and this project's extra that pulls it.
DISTRIBUTION = "ds-llm-trainer"
PACKAGES = {
    "mlflow": ("mlflow-skinny", "mlflow"),
    "tensorboard": ("tensorboard", None),  # a dependency of this project
    "wandb": ("wandb", "wandb"),
    "trackio": ("trackio", "trackio"),
}


def reporting_callbacks(args: TrainingArguments) -> list[Any]:
    """One transformers callback per ``args.report_to`` integration, in that order."""
    check_report_to(args)
    if "wandb" in args.report_to and "WANDB_DIR" not in os.environ:
        # Nothing is written outside output_dir unless the user says where: wandb's run files
        # (./wandb by default) go to output_dir/wandb. An explicit WANDB_DIR wins.
        os.environ["WANDB_DIR"] = os.path.abspath(args.output_dir)
    callbacks = []
    for name in args.report_to:
        callback = INTEGRATION_TO_CALLBACK[name]()
        if isinstance(callback, TensorBoardCallback) and args.logging_dir:
            # HF 4's field; transformers 5 reads TENSORBOARD_LOGGING_DIR only. The argument wins.
            callback.logging_dir = os.path.expanduser(args.logging_dir)
        callbacks.append(callback)
    return callbacks


def check_report_to(args: TrainingArguments) -> None:
    """Refuse, before anything loads, an integration that would fail once training starts."""
    problems = [("report_to", message) for name in args.report_to if (message := _missing(name))]
    if "mlflow" in args.report_to and not problems:
        problems += [("report_to", message) for message in _mlflow_store_problems()]
    log_model = os.environ.get("WANDB_LOG_MODEL", "false").lower()
    if "wandb" in args.report_to and log_model in ("end", "checkpoint"):
        # At the end of training transformers' WandbCallback saves the model with a transformers
        # Trainer of its own, which cannot take these arguments.
        problems.append(
            (
                "WANDB_LOG_MODEL",
                f"{log_model!r} is not supported; unset it and log output_dir/final as an artifact",
            )
        )
    if problems:
        raise ConfigError(problems)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _missing(name: str) -> str | None:
    if _installed(REPORT_TO[name]):
        return None
    package, extra = PACKAGES[name]
    install = f"pip install '{DISTRIBUTION}[{extra}]'" if extra else f"pip install {package}"
    return f"{name} needs the {package} package, which is not installed; install it with: {install}"


def _mlflow_store_problems() -> list[str]:
    """MLflow's tracking URI must be set (its default store is a file in the working directory)
    and usable: MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE=true, and a
    database store needs the full mlflow package (mlflow-skinny has no SQLAlchemy)."""
    import mlflow  # optional: loaded only for a run that reports to MLflow (checked installed above)

    if not mlflow.is_tracking_uri_set():
        return [
            "mlflow: set MLFLOW_TRACKING_URI to a tracking server (http://HOST:5000), a file store "
            "(file:///PATH, with MLFLOW_ALLOW_FILE_STORE=true) or sqlite:///PATH/mlflow.db (full mlflow package)"
        ]
    uri = mlflow.get_tracking_uri()
    scheme = urlparse(uri).scheme
    allow = getattr(mlflow.environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)
    if scheme in ("", "file") and allow is not None and not allow.get():
        return [
            f"mlflow: {uri} is a file store, which this MLflow refuses unless MLFLOW_ALLOW_FILE_STORE=true; "
            "set that, or use a tracking server or sqlite:///PATH/mlflow.db"
        ]
    if scheme in ("sqlite", "postgresql", "mysql", "mssql") and not _installed("sqlalchemy"):
        return [f"mlflow: the {scheme} store needs the full mlflow package (pip install mlflow)"]
    return []
