"""The per-sample outputs of the evaluation loop: kept by each rank, gathered, put in dataset order.

A model's outputs may be any structure: a tensor, or tuples, lists and dicts of them, nested, each
leaf with the batch's rows first (classification ``[n, C]``, regression ``[n]``, token tasks
``[n, T, C]``, a seq2seq model's logits and encoder states). HF's Trainer concatenates batches leaf
by leaf and pads a leaf whose batches differ in length after the first dimension with -100 (token
tasks pad each batch to its own longest row); so do these helpers, for predictions, labels, inputs
and per-row losses alike.

Each rank keeps its rows as parts (one per batch, with the dataset index of every row) on the device
until ``to_host`` moves them to host numpy (HF's ``eval_accumulation_steps``). ``gather`` joins
every rank's parts and sorts them by dataset index: the result is the dataset's order on every rank,
whichever rank forwarded which row, and the sampler's padding rows never enter it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from trainer.runtime.distributed import all_gather_object

PAD_INDEX = -100  # HF's padding of predictions, labels and inputs of different lengths
Nested = Any  # a tensor or array, or a tuple, list or dict of Nested
Part = dict[str, Nested]  # "index": the rows' dataset indices; the other keys, their values by stream


def nested_map(fn: Callable[[Any], Any], value: Nested) -> Nested:
    """``fn`` on every leaf, keeping the structure (tuples, lists, dicts)."""
    if isinstance(value, Mapping):
        return type(value)({k: nested_map(fn, v) for k, v in value.items()})
    if isinstance(value, tuple | list):
        return type(value)(nested_map(fn, v) for v in value)
    return fn(value)


def to_numpy(value: Nested) -> Nested:
    """Leaves to host arrays; bf16, which numpy lacks, as fp32 (as HF's ``nested_numpify``)."""

    def leaf(x: Any) -> np.ndarray:
        if isinstance(x, torch.Tensor):
            x = x.detach()
            return (x.float() if x.dtype == torch.bfloat16 else x).cpu().numpy()
        return np.asarray(x)

    return nested_map(leaf, value)


def to_tensors(value: Nested, device: torch.device) -> Nested:
    return nested_map(lambda x: torch.as_tensor(x, device=device), value)


def select_rows(value: Nested, keep: torch.Tensor, path: str = "") -> Nested:
    """The rows ``keep`` (a boolean mask over the batch's rows) of every leaf. A leaf without one
    row per sample first cannot be put in dataset order, so it is refused, naming it."""
    if isinstance(value, Mapping):
        return type(value)({k: select_rows(v, keep, f"{path}[{k!r}]") for k, v in value.items()})
    if isinstance(value, tuple | list):
        return type(value)(select_rows(v, keep, f"{path}[{i}]") for i, v in enumerate(value))
    if np.ndim(value) == 0 or len(value) != len(keep):
        raise ValueError(
            f"an evaluation output{path or ''} has shape {tuple(np.shape(value))}, not one row per sample "
            f"of the batch ({len(keep)} rows): leave it out with ignore_keys, or reduce it per row in "
            "preprocess_logits_for_metrics"
        )
    return value[keep.to(value.device)] if isinstance(value, torch.Tensor) else value[keep.numpy()]


def concat(values: list[Nested], fill: float = PAD_INDEX) -> Nested:
    """One structure of the rows of all ``values`` (same structure each), leaves joined along the
    first dimension; a leaf whose parts differ in a later dimension is padded with ``fill``."""
    first = values[0]
    if isinstance(first, Mapping):
        return type(first)({k: concat([v[k] for v in values], fill) for k in first})
    if isinstance(first, tuple | list):
        return type(first)(concat([v[i] for v in values], fill) for i in range(len(first)))
    arrays = [np.asarray(v) for v in values]
    shape = tuple(max(sizes) for sizes in zip(*(a.shape[1:] for a in arrays), strict=True))
    if all(a.shape[1:] == shape for a in arrays):
        return np.concatenate(arrays)
    out = np.full((sum(len(a) for a in arrays), *shape), fill, dtype=arrays[0].dtype)
    start = 0
    for a in arrays:
        out[(slice(start, start + len(a)), *(slice(0, n) for n in a.shape[1:]))] = a
        start += len(a)
    return out


def take(value: Nested, order: np.ndarray) -> Nested:
    return nested_map(lambda a: a[order], value)


def gather(parts: list[Part]) -> dict[str, Nested]:
    """Every rank's parts (host arrays), joined in dataset order on every rank; a collective. A
    stream some part lacks (a batch without labels) is None."""
    joined = [part for rank_parts in all_gather_object(parts) for part in rank_parts]
    if not joined:
        return {}
    order = np.argsort(np.concatenate([part["index"] for part in joined]), kind="stable")
    names = [name for name in joined[0] if name != "index"]
    return {
        name: take(concat([part[name] for part in joined]), order)
        if all(part.get(name) is not None for part in joined)
        else None
        for name in names
    }


class RowStore:
    """This rank's rows, one part per batch: on the device as the forwards made them until
    ``to_host`` (every ``eval_accumulation_steps`` steps, as HF's, and before the gather)."""

    def __init__(self) -> None:
        self.on_device: list[Part] = []
        self.on_host: list[Part] = []

    def add(self, part: Part) -> None:
        if len(part["index"]):
            self.on_device.append(part)

    def to_host(self) -> None:
        self.on_host += [to_numpy(part) for part in self.on_device]
        self.on_device = []

    def gather(self) -> dict[str, Nested]:
        self.to_host()
        return gather(self.on_host)
