"""LARS, layer-wise adaptive rate scaling (You, Gitman and Ginsburg, 2017), exact under ZeRO.

Each matrix's step is SGD with momentum on ``trust * (g + wd * w)``, where
``trust = trust_coefficient * |w| / (|g| + wd * |w|)`` uses the norms of the whole matrix; vectors
and scalars (biases, norms) take plain SGD steps, without decay or scaling. These are the semantics
of ``pytorch_optimizer.LARS``, which the tests follow step by step.

A maintained LARS cannot run under ZeRO as it is: DeepSpeed hands a client optimizer one flat
tensor per parameter group, this rank's slice of all the group's parameters end to end, so its
"layer" norms would be norms of arbitrary slices. Here the engine tells the optimizer where each
parameter lies in its flat slice (``partitioned``); a step sums each parameter's squares over its
pieces, adds them up over the ranks that share the parameter with one all-reduce, and scales every
piece by its parameter's whole norm: the same update as on one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from trainer.engine.partitions import Partitioned, Piece, collective_device


class LARS(Partitioned):
    """SGD with momentum and per-matrix trust ratios. The defaults are ``pytorch_optimizer``'s."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        dampening: float = 0.0,
        trust_coefficient: float = 1e-3,
        nesterov: bool = False,
    ):
        if lr < 0 or weight_decay < 0 or trust_coefficient < 0 or not 0 <= momentum < 1:
            raise ValueError(
                f"LARS: lr={lr}, weight_decay={weight_decay} and trust_coefficient={trust_coefficient} "
                f"must be >= 0 and momentum={momentum} in [0, 1)"
            )
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("LARS: Nesterov momentum needs momentum > 0 and dampening 0")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            dampening=dampening,
            trust_coefficient=trust_coefficient,
            nesterov=nesterov,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        ratios = self._trust_ratios(stepped)
        for (group, p), trust in zip(stepped, ratios, strict=True):
            grad = p.grad.view(-1)
            for piece, ratio in trust:
                update = grad.narrow(0, piece.start, piece.length)
                update.add_(
                    p.detach().view(-1).narrow(0, piece.start, piece.length), alpha=group["weight_decay"]
                )
                update.mul_(ratio)
            if group["momentum"] > 0:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buffer = state["momentum_buffer"]
                buffer.mul_(group["momentum"]).add_(p.grad, alpha=1 - group["dampening"])
                if group["nesterov"]:
                    p.grad.add_(buffer, alpha=group["momentum"])
                else:
                    p.grad.copy_(buffer)
            p.add_(p.grad, alpha=-group["lr"])
        return loss

    def _trust_ratios(
        self, stepped: list[tuple[dict[str, Any], torch.Tensor]]
    ) -> list[list[tuple[Piece, torch.Tensor]]]:
        """For each stepped tensor, its matrix pieces with their parameter's trust ratio. The squared
        norms of every parameter of the tensors go in one vector, summed over ``group`` at once."""
        offsets, total = [], 0
        for _, p in stepped:
            offsets.append(total)
            total += self._layout(p).keys
        if not stepped:
            return []
        device = stepped[0][1].device
        squares = torch.zeros(2, total, dtype=torch.float32, device=device)  # |w|^2, |g|^2
        for (_, p), base in zip(stepped, offsets, strict=True):
            pieces = [piece for piece in self._layout(p).pieces if piece.matrix]
            if not pieces:
                continue
            index = torch.tensor([base + piece.key for piece in pieces], device=device)
            for row, tensor in enumerate((p.detach(), p.grad)):
                flat = tensor.view(-1)
                views = [flat.narrow(0, piece.start, piece.length).float() for piece in pieces]
                norms = torch.stack(torch._foreach_norm(views))
                squares[row].index_add_(0, index, norms.square())
        if self.group is not None and dist.get_world_size(self.group) > 1:
            summed = squares.to(collective_device(device))
            dist.all_reduce(summed, group=self.group)
            squares = summed.to(device)
        w_norm, g_norm = squares.sqrt()
        ratios = []
        for (group, p), base in zip(stepped, offsets, strict=True):
            mine = []
            for piece in self._layout(p).pieces:
                if not piece.matrix:
                    continue
                w, g = w_norm[base + piece.key], g_norm[base + piece.key]
                denominator = g + group["weight_decay"] * w
                ratio = torch.where(
                    (w > 0) & (denominator > 0), group["trust_coefficient"] * w / denominator, 1.0
                )
                mine.append((piece, ratio.to(p.dtype)))
            ratios.append(mine)
        return ratios
