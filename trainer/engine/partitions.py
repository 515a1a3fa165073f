"""Where each parameter lies in the flat tensors DeepSpeed's ZeRO optimizers hand a client optimizer.

Under ZeRO a client optimizer does not step the model's parameters: it steps one flat fp32 tensor
per parameter group, this rank's slice of the group's parameters end to end (stages 1-2), or of
each parameter cut into equal slices (stage 3). An optimizer whose update needs a whole parameter
(LARS's norms, Muon's orthogonalisation) is told here which pieces of which parameters its flat
tensors hold, and over which process group the other pieces lie.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

from trainer.config.errors import ConfigError


@dataclass(frozen=True)
class Piece:
    """Part of one parameter inside a tensor the optimizer steps: ``length`` elements from ``start``,
    which are the parameter's own elements from ``offset`` on (stage 3's last slice of a parameter
    runs past its end into padding). ``key`` numbers the parameter among those of the tensor, the
    same on every rank; ``matrix``: the parameter has two or more dimensions."""

    start: int
    length: int
    key: int
    matrix: bool
    offset: int = 0


@dataclass(frozen=True)
class Layout:
    """Where the parameters of a flat tensor lie: its ``pieces``, the number of parameters it holds
    pieces of on all ranks together (``keys``), where known each one's shape (``shapes``), and the
    optimizer's parameter group it steps in (``param_group``)."""

    pieces: tuple[Piece, ...]
    keys: int
    shapes: tuple[torch.Size, ...] = ()
    param_group: int = 0


class Partitioned(torch.optim.Optimizer):
    """An optimizer of ours that steps whole parameters, told where their pieces lie."""

    layouts: dict[torch.Tensor, Layout]
    group: Any  # the ranks whose pieces make up a parameter; None: each holds it all

    def __init__(self, params: Any, defaults: dict[str, Any]):
        super().__init__(params, defaults)
        self.layouts, self.group = {}, None

    def partitioned(self, layouts: dict[torch.Tensor, Layout], group: Any) -> None:
        """Step flat tensors: ``layouts`` maps each to its pieces; ``group`` shares the parameters."""
        self.layouts, self.group = layouts, group

    def _layout(self, p: torch.Tensor) -> Layout:
        return self.layouts.get(p) or whole(p)

    def keeps_momentum_alone(self, group: dict[str, Any]) -> bool:
        """Whether ``group``'s state is one momentum buffer (``momentum_buffer``), no Adam moments."""
        return True

    def after_universal_load(self) -> None:
        """DeepSpeed's universal load fills every flat tensor's state with Adam's moments from the
        copy ``convert_to_universal`` made: a group that keeps a momentum alone gets it back under
        its own name, without the zero second moment or the step that came with it."""
        for flat, layout in self.layouts.items():
            if self.keeps_momentum_alone(self.param_groups[layout.param_group]):
                adam_names_undone(self.state[flat], momentum=True)


def adam_names_undone(state: dict[str, Any], momentum: bool) -> None:
    """One flat tensor's state as ``zero.convert_to_universal``'s copy named it, back to a momentum-only
    optimizer's: the ``exp_avg`` made of the momentum buffer is the buffer again where the group keeps
    one (``momentum``), and nothing where it keeps none; the zero second moment and the step that
    came with it go."""
    buffer = state.pop("exp_avg", None)
    state.pop("exp_avg_sq", None)
    state.pop("step", None)
    if momentum and buffer is not None:
        state["momentum_buffer"] = buffer


def collective_device(device: torch.device) -> torch.device:
    """Where the sums over ranks (and Muon's iteration) run for tensors on ``device``: under
    optimizer offload ZeRO's flat slices lie in host memory, and the group's collectives (NCCL)
    and the matrix products belong on the accelerator when there is one."""
    if device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def whole(p: torch.Tensor) -> Layout:
    """The layout of a parameter stepped as itself."""
    return Layout((Piece(0, p.numel(), 0, p.dim() > 1),), 1, (p.shape,))


def zero_layouts(zero_optimizer: Any) -> tuple[dict[torch.Tensor, Layout], Any]:
    """Where each parameter lies in the flat fp32 slices DeepSpeed's ZeRO optimizer steps, and the
    group its slices are cut over. Stages 1-2: each group's parameters end to end (with alignment
    padding) in one flat tensor, of which a rank holds one equal slice. Stage 3: each parameter is
    cut into equal slices itself; a rank's flat tensor is its slices of a sub-group end to end."""
    layouts: dict[torch.Tensor, Layout] = {}
    if hasattr(zero_optimizer, "fp32_partitioned_groups_flat"):  # stage 3
        group = zero_optimizer.dp_process_group
        rank = dist.get_rank(group=group)
        for sub, (flat, params) in enumerate(
            zip(zero_optimizer.fp32_partitioned_groups_flat, zero_optimizer.fp16_groups, strict=True)
        ):
            pieces, start = [], 0
            for key, param in enumerate(params):
                length = param.partition_numel()
                pieces.append(Piece(start, length, key, len(param.ds_shape) > 1, rank * length))
                start += length
            shapes = tuple(p.ds_shape for p in params)
            layouts[flat] = Layout(
                tuple(pieces), len(params), shapes, zero_optimizer.sub_group_to_group_id[sub]
            )
        return layouts, group
    groups = zero_optimizer.real_dp_process_group
    for i, flat in enumerate(zero_optimizer.single_partition_of_fp32_groups):
        size = zero_optimizer.partition_size[i]
        low = dist.get_rank(group=groups[i]) * size
        metas = zero_optimizer.round_robin_bit16_meta[i]  # the parameters' shapes, whatever holds their data
        pieces = []
        for key, (meta, offset) in enumerate(
            zip(metas, zero_optimizer.round_robin_bit16_offsets[i], strict=True)
        ):
            start, end = max(offset, low), min(offset + meta.numel(), low + size)
            if start < end:
                pieces.append(Piece(start - low, end - start, key, meta.dim() > 1, start - offset))
        layouts[flat] = Layout(tuple(pieces), len(metas), tuple(meta.shape for meta in metas), i)
    return layouts, groups[0]


# What holds each rank's fp32 slices in DeepSpeed's ZeRO-3 and ZeRO-1/2 optimizers.
FLAT_SLICES = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups")


def show_partitions(optimizer: Any, stepper: Any) -> None:
    """Tell ``optimizer`` (where it is ``Partitioned``) what DeepSpeed's ``stepper``
    (the optimizer ``deepspeed.initialize`` returned) hands it: the model's own parameters (ZeRO-0
    in fp32), an fp32 copy of each (the unfused mixed-precision wrapper of ZeRO-0 in bf16/fp16) or
    ZeRO 1-3's flat slices. Any other wrapper (the BF16_Optimizer of ZeRO-1 with fp32 gradient
    accumulation) is refused, naming the optim."""
    if (
        not isinstance(optimizer, Partitioned)
        or stepper is optimizer
        or isinstance(stepper, FP16_UnfusedOptimizer)
    ):
        return
    if any(hasattr(stepper, flats) for flats in FLAT_SLICES):
        optimizer.partitioned(*zero_layouts(stepper))
        return
    raise ConfigError(
        f"optim {type(optimizer).__name__.lower()}: DeepSpeed wraps it in {type(stepper).__name__}, whose flat tensors hide the "
        "parameters' shapes; use zero_stage 0-3 with the default gradient accumulation dtype",
        path="optim",
    )
