"""Keeps DeepSpeed's autotuner from importing mlflow, which costs every process about 2 s.

DeepSpeed imports its autotuner whenever it reads a config, and the autotuner imports mlflow at import
time if it is installed: 2.2 s of a 4.8 s ``import deepspeed`` here, paid by every rank of every
launch. This package never runs the autotuner, so the import of mlflow from that one module finds
nothing; every other importer, ``--report_to mlflow`` included, gets mlflow as usual.
"""

from __future__ import annotations

import importlib.abc
import sys

AUTOTUNER = "deepspeed.autotuning.autotuner"


class HideMlflowFromTheAutotuner(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mlflow" and _imported_by(AUTOTUNER):
            raise ModuleNotFoundError("mlflow is not imported by DeepSpeed's autotuner here", name=name)
        return None


def _imported_by(module: str) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") == module:
            return True
        frame = frame.f_back
    return False


def install() -> None:
    if not any(isinstance(f, HideMlflowFromTheAutotuner) for f in sys.meta_path):
        sys.meta_path.insert(0, HideMlflowFromTheAutotuner())
