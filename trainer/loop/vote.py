"""The step's vote: one host-only all-reduce that every rank takes part in before each step.

A participant puts a few numbers on the vote (``ballot``) and acts on their sums over the ranks
(``tally``): every rank sees the same sums, so every rank decides alike (commits the same save,
stops at the same step). The step's participants, in the order they act:

- the asynchronous checkpoint in flight (``trainer.loop.saving.Checkpoints``): each rank's "my files
  are written"; committed once every rank's are;
- the pending snapshot (``trainer.checkpoint.snapshots.Snapshots``), the same way;
- preemption (``Preemption``): any rank's signal saves and exits every rank, before this window trains;
- the window itself (``WindowCounts``): its target tokens (what every rank divides its loss by), its
  samples and input tokens (``state.num_input_tokens_seen``, the run's FLOPs).

A participant with nothing to say puts nothing on the vote; that is the same on every rank (a save
is pending on all of them or on none). The non-finite guard (``trainer.loop.guard``) takes part in
a vote of its own, at the steps that log, save or snapshot: it judges the step just trained.
"""

from __future__ import annotations

import hashlib
import struct
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from trainer.engine import Engine, batch_rows
from trainer.runtime.distributed import host_all_reduce
from trainer.runtime.mesh import Mesh
from trainer.runtime.resilience import PreemptionFlag


class Participant(Protocol):
    def ballot(self) -> list[float]:
        """This rank's numbers for the vote ([] for none)."""
        ...

    def tally(self, totals: list[float]) -> None:
        """Act on the sums over the ranks of what ``ballot`` put on the vote (the same on every rank)."""
        ...


def weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """A bound ``method`` that holds its object weakly. The participants call back into the Trainer
    that owns them; a strong reference would make a cycle, and a Trainer the user dropped (with the
    ZeRO-3 config its arguments registered with transformers) would live on until the next garbage
    collection."""
    ref = weakref.WeakMethod(method)
    return lambda *args, **kwargs: ref()(*args, **kwargs)


def poll(participants: Sequence[Participant]) -> None:
    """One host all-reduce of every participant's ballot; then each acts on its sums, in order."""
    ballots = [p.ballot() for p in participants]
    totals = host_all_reduce([value for ballot in ballots for value in ballot])
    at = 0
    for participant, ballot in zip(participants, ballots, strict=True):
        participant.tally(totals[at : at + len(ballot)])
        at += len(ballot)


class WindowCounts:
    """An accumulation window's part: its normaliser (target tokens for a causal LM) and its samples
    and input tokens, counted on the host from the CPU batches: the non-padding ones, or every input
    id with ``include_num_input_tokens_seen="all"``, as HF counts. An empty window (a rank's stream
    ended) ends the data on every rank (``ended``). ``sources``: a stream's blocks of each source in
    the window (what ``order``, the rank's ``StreamPosition``, counted), summed over the ranks. With
    ``log_data_fingerprint``, the global batch's ``fingerprint``: each row hashed with its place in
    the global batch, the hashes added up over the ranks in 16-bit parts (exact in the vote's float64
    sums), so it does not depend on how many ranks read the batch."""

    def __init__(
        self,
        window: list[dict[str, Any]],
        engine: Engine,
        args: Any,
        mesh: Mesh,
        order: Any = None,
    ):
        # This rank's (samples, non-padding tokens): the step timer's numbers.
        objective = engine.objective
        self.local = (sum(batch_rows(b) for b in window), sum(objective.input_tokens(b) for b in window))
        every_id = args.include_num_input_tokens_seen == "all"
        seen = sum(objective.input_tokens(b, every_id=True) for b in window) if every_id else self.local[1]
        self._ballot = [engine.local_targets(window), float(self.local[0]), float(seen), float(not window)]
        self.sources, self.mesh = getattr(order, "take_counts", dict)(), mesh
        self._ballot += [float(n) for n in self.sources.values()]
        self.sharing = mesh.sharing if getattr(args, "log_data_fingerprint", False) else 0
        if self.sharing:
            self._ballot += row_hashes(window, *reversed(mesh.data_ranks))
        self.tokens = self.samples = self.input_tokens = 0.0
        self.ended, self.fingerprint = False, None

    def ballot(self) -> list[float]:
        return self._ballot

    def tally(self, totals: list[float]) -> None:
        self.tokens, self.samples, self.input_tokens = totals[:3]
        self.ended = totals[3] > 0
        n = len(self.sources)  # the ranks of a group that reads the same rows each added them
        self.sources = {
            k: v / self.mesh.sharing for k, v in zip(self.sources, totals[4 : 4 + n], strict=True)
        }
        if self.sharing:
            self.fingerprint = "".join(f"{int(v) // self.sharing % 65536:04x}" for v in totals[4 + n :])


def add_source_blocks(total: dict[str, float], window: dict[str, float]) -> None:
    """Add a window's blocks of each source to the run's (``TrainerState.source_blocks``)."""
    for name, blocks in window.items():
        total[name] = total.get(name, 0.0) + blocks


def source_shares(total: dict[str, float]) -> dict[str, float]:
    """The realised share of each source in the blocks trained so far, as ``source_share/<name>``
    metrics (none for a run that does not stream)."""
    blocks = sum(total.values())
    return {f"source_share/{name}": round(n / blocks, 6) for name, n in total.items()} if blocks else {}


def row_hashes(window: list[dict[str, Any]], rank: int, readers: int) -> list[float]:
    """The sums of four 16-bit parts of each row's hash (its real tokens and its place in the global
    batch: rank ``rank`` of ``readers`` holds places ``rank, rank + readers, ...``)."""
    parts = [0.0] * 4
    q = 0
    for batch in window:
        mask = batch.get("attention_mask")
        for i, row in enumerate(batch["input_ids"]):
            ids = row[mask[i].bool()] if mask is not None else row
            place = (q * readers + rank).to_bytes(8, "little")
            digest = hashlib.blake2b(place + ids.to(torch.int64).numpy().tobytes(), digest_size=8).digest()
            for k, part in enumerate(struct.unpack("<4H", digest)):
                parts[k] += part
            q += 1
    return parts


class Preemption:
    """The preemption flag's part: a signal on any rank stops every rank at the same step."""

    def __init__(self, flag: PreemptionFlag, stop: Callable[[], None]):
        self.flag, self.stop = flag, stop

    def ballot(self) -> list[float]:
        return [1.0 if self.flag.received else 0.0]

    def tally(self, totals: list[float]) -> None:
        if totals[0]:
            self.stop()
