"""``trainer.accelerator``: the part of accelerate's ``Accelerator`` that scripts call on an HF or
TRL trainer (TRL's own scripts print through it; HF's end with ``trainer.end()``, which ends it).

The run is driven by DeepSpeed through this project's engine, not by an ``Accelerator``; this view
answers the process questions from the launcher's facts (``trainer.runtime.ranks``) and the process
group. Any other attribute is refused by name, never answered with a guess.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.runtime.distributed import barrier, dist_info, leave_process_group, process_device

PROVIDED = (
    "print, is_main_process, is_local_main_process, process_index, local_process_index, num_processes, "
    "device, wait_for_everyone, unwrap_model, end_training"
)


class Processes:
    """The processes of the run, as accelerate's ``Accelerator`` names them."""

    def __init__(self) -> None:
        self._info = dist_info()

    @property
    def process_index(self) -> int:
        return self._info.rank

    @property
    def local_process_index(self) -> int:
        return self._info.local_rank

    @property
    def num_processes(self) -> int:
        return self._info.world_size

    @property
    def is_main_process(self) -> bool:
        return self._info.is_main

    @property
    def is_local_main_process(self) -> bool:
        return self._info.local_rank == 0

    @property
    def device(self) -> torch.device:
        return process_device()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per node, as accelerate's."""
        if self.is_local_main_process:
            print(*args, **kwargs, flush=True)

    def wait_for_everyone(self) -> None:
        barrier("wait_for_everyone")

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True) -> torch.nn.Module:
        """The model without the engine's wrappers (DeepSpeed's and DDP's ``module``)."""
        while isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        return model

    def end_training(self) -> None:
        """Leave the process group once every rank is here; nothing that communicates works after."""
        leave_process_group(wait=True)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"trainer.accelerator.{name}: not provided (the run is driven by DeepSpeed, not by an "
            f"accelerate Accelerator); what it answers: {PROVIDED}"
        )
