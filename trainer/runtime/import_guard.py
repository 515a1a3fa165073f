"""What a process pays to import its libraries: the collector paused while they load
(``heavy_imports``), and DeepSpeed's autotuner kept from importing mlflow (``install``).

torch, transformers and DeepSpeed leave hundreds of thousands of objects behind as they import, and
the cyclic collector walks them again and again while they load and at every full collection after.
Pausing it for the imports, then moving what they made to the permanent generation (``gc.freeze``, as
a fork server does), saves every rank that CPU time (docs/architecture.md has the figures). What is
frozen is never collected as a cycle: that is mostly modules, which live as long as the process, and
what the process made before (refcounting still frees those objects that are not in a cycle).

DeepSpeed imports its autotuner whenever it reads a config, and the autotuner imports mlflow at import
time if it is installed: close to half of ``import deepspeed``, paid by every rank of every launch. This package never runs the autotuner, so the import of mlflow from that one module finds
nothing; every other importer, ``--report_to mlflow`` included, gets mlflow as usual.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.abc
import sys
from collections.abc import Iterator

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


@contextlib.contextmanager
def heavy_imports() -> Iterator[None]:
    """Import torch and the libraries above it with the cyclic collector paused; what they made is
    then frozen (never walked again) and the collector is back as it was."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.freeze()
            gc.enable()
