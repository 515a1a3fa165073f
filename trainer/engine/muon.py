"""Muon for the hidden matrices and AdamW for the rest, as one optimizer, exact under ZeRO.

Muon (Jordan et al., 2024) keeps a momentum of each matrix's gradient and steps along its
orthogonalisation: a quintic Newton-Schulz iteration pushes the singular values of the (Nesterov)
momentum towards 1. Its updates are those of ``torch.optim.Muon``: the same iteration, the same
``adjust_lr_fn`` scales ('original': ``sqrt(max(1, A/B))``; 'match_rms_adamw', Moonlight's:
``0.2 * sqrt(max(A, B))``) and decoupled weight decay. Embeddings, the head, norms and biases take
``torch.optim.AdamW``'s steps, as Keller Jordan's and Moonlight's reference runs split them; a
parameter group says which half it is in (``muon``).

Under ZeRO a rank steps flat slices, and a slice holds pieces of matrices, never a whole one to
orthogonalise. The momentum is elementwise, so each rank keeps its slice's; the update then goes
round once: every rank writes its pieces of the step's matrices into one buffer, zeros elsewhere,
and a sum over the data-parallel group gives each rank every matrix whole (each element comes from
the one rank that holds it, plus zeros, so the sum is exact). A rank orthogonalises the matrices it
holds pieces of and keeps its pieces of the result: one process's update. (Stage 3 cuts every
parameter over every rank, so there each rank orthogonalises every matrix.)

This runs at DeepSpeed's optimizer step, once per accumulation window, on the window's gradient.
DeepSpeed's own Muon folds the gradient into the momentum as ZeRO-1/2 partitions it, which made it
apply once per micro-batch under accumulation (DeepSpeed PR #8600).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.adam import adam

from trainer.engine.core import is_decayed
from trainer.engine.partitions import Layout, Partitioned, Piece, collective_device

# The quintic iteration's coefficients (Keller Jordan's, also torch.optim.Muon's).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# The most matrix elements gathered at once: 32M fp32 values, 128 MiB a buffer.
BUCKET_ELEMENTS = 1 << 25
PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}


def orthogonalise(matrix: torch.Tensor, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """``steps`` Newton-Schulz iterations on ``matrix`` in ``dtype``: about U V^T of its SVD U S V^T
    (the singular values land near 1, in roughly [0.7, 1.2], not exactly on it)."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # the spectral norm is then at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def update_scale(shape: torch.Size, rule: str) -> float:
    """How much the rate is scaled for a matrix of ``shape`` (out, in)."""
    rows, cols = shape[0], shape[1]
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


class Muon(Partitioned):
    """Muon on the groups with ``muon=True`` (2-D parameters only), AdamW on the others. The
    defaults are ``torch.optim.Muon``'s and ``torch.optim.AdamW``'s; ``weight_decay`` is decoupled
    in both halves. ``ns_precision``: what the iteration runs in, bf16 (torch's), fp32, or None:
    bf16 on a GPU, fp32 elsewhere (the engine passes bf16 where the run trains in bf16/fp16)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        eps: float = 1e-7,
        update_scale: str = "original",
        ns_precision: str | None = "bf16",
        betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
    ):
        if ns_precision not in PRECISIONS:
            raise ValueError(f"Muon: ns_precision {ns_precision!r} is not bf16, fp32 or None")
        if update_scale not in ("original", "match_rms_adamw"):
            raise ValueError(f"Muon: update_scale {update_scale!r} is not 'original' or 'match_rms_adamw'")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            muon=False,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            eps=eps,
            update_scale=update_scale,
            betas=betas,
            adam_eps=adam_eps,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            flat = [tuple(_shape(p)) for p in group["params"] if group["muon"] and len(_shape(p)) != 2]
            if flat:
                raise ValueError(f"Muon: its groups take matrices only; got shapes {flat}")
        self.ns_precision = ns_precision

    def keeps_momentum_alone(self, group: dict[str, Any]) -> bool:
        return group["muon"]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = [(g, p) for g in self.param_groups if g["muon"] for p in g["params"] if p.grad is not None]
        updates = [self._momentum(group, p) for group, p in stepped]
        self._orthogonalise(stepped, updates)
        for (group, p), update in zip(stepped, updates, strict=True):
            layout = self._layout(p)
            p.mul_(1 - group["lr"] * group["weight_decay"])
            flat, change = p.view(-1), update.view(-1)
            for piece in layout.pieces:
                rate = group["lr"] * update_scale(layout.shapes[piece.key], group["update_scale"])
                n = _valid(piece, layout)
                flat.narrow(0, piece.start, n).add_(change.narrow(0, piece.start, n), alpha=-rate)
        for group in self.param_groups:
            if not group["muon"]:
                self._adamw(group)
        return loss

    def _momentum(self, group: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """The momentum buffer moved towards this gradient; the update to orthogonalise (Nesterov's
        look-ahead, or the buffer itself)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buffer = state["momentum_buffer"]
        buffer.lerp_(p.grad, 1 - group["momentum"])
        return p.grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer.clone()

    def _orthogonalise(
        self, stepped: list[tuple[dict[str, Any], torch.Tensor]], updates: list[torch.Tensor]
    ) -> None:
        """Each update's matrix pieces replaced by their piece of the whole matrix's
        orthogonalisation. Every rank walks the same matrices in the same order (the layouts' keys),
        a bucket of them at a time, so their sums over the group line up."""
        entries: deque = deque()  # (which update, its group and layout, a matrix's shape, this rank's pieces)
        for i, (group, p) in enumerate(stepped):
            layout = self._layout(p)
            mine: dict[int, list[Piece]] = {}
            for piece in layout.pieces:
                mine.setdefault(piece.key, []).append(piece)
            entries.extend(
                (i, group, layout, shape, mine.get(key, [])) for key, shape in enumerate(layout.shapes)
            )
        shared = self.group is not None and dist.get_world_size(self.group) > 1
        while entries:
            bucket, size = [], 0
            while entries and (not bucket or size + entries[0][3].numel() <= BUCKET_ELEMENTS):
                bucket.append(entries.popleft())
                size += bucket[-1][3].numel()
            device = collective_device(updates[bucket[0][0]].device)
            dtype = PRECISIONS[self.ns_precision] or (
                torch.bfloat16 if device.type == "cuda" else torch.float32
            )
            buffer = torch.zeros(size, dtype=torch.float32, device=device)
            base = 0
            for i, _, layout, shape, pieces in bucket:
                for piece in pieces:
                    n = _valid(piece, layout)
                    buffer.narrow(0, base + piece.offset, n).copy_(
                        updates[i].view(-1).narrow(0, piece.start, n)
                    )
                base += shape.numel()
            if shared:
                dist.all_reduce(buffer, group=self.group)
            base = 0
            for i, group, layout, shape, pieces in bucket:
                if pieces:
                    matrix = buffer.narrow(0, base, shape.numel()).view(shape)
                    result = orthogonalise(matrix, group["ns_steps"], group["eps"], dtype).reshape(-1)
                    for piece in pieces:
                        n = _valid(piece, layout)
                        updates[i].view(-1).narrow(0, piece.start, n).copy_(result.narrow(0, piece.offset, n))
                base += shape.numel()

    def _adamw(self, group: dict[str, Any]) -> None:
        """torch.optim.AdamW's step (its single-tensor code) on the group's parameters."""
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            foreach=False,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["adam_eps"],
            maximize=False,
        )


def muon_groups(
    model: torch.nn.Module, weight_decay: float, muon_lr: float, adam_lr: float
) -> list[dict[str, Any]]:
    """The trainable parameters in Muon's half (the matrices, but the embeddings' and the head's)
    and AdamW's (those, norms and biases), each with the run's decay rule (``is_decayed``)."""
    edges = {
        id(p)
        for module in (model.get_input_embeddings(), model.get_output_embeddings())
        if module is not None
        for p in module.parameters()
    }
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if len(_shape(p)) == 2 and id(p) not in edges and not name.endswith(".bias"):
            muon.append(p)
        else:
            (decay if is_decayed(name, p) else no_decay).append(p)
    groups = [
        dict(params=muon, muon=True, lr=muon_lr, weight_decay=weight_decay),
        dict(params=decay, muon=False, lr=adam_lr, weight_decay=weight_decay),
        dict(params=no_decay, muon=False, lr=adam_lr, weight_decay=0.0),
    ]
    return [g for g in groups if g["params"]]


def _shape(p: torch.Tensor) -> torch.Size:
    return getattr(p, "ds_shape", p.shape)  # ZeRO-3 partitions keep the real shape here


def _valid(piece: Piece, layout: Layout) -> int:
    """How many of ``piece``'s elements are its parameter's (stage 3 pads the last slice)."""
    return max(0, min(piece.length, layout.shapes[piece.key].numel() - piece.offset))
