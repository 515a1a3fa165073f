"""The reference stage: any objective that weighs the policy against a frozen reference (DPO, KTO)
uses it, as a ``DataStage`` of its Trainer (``trainer.loop.stages``).

The reference is one pass, not a second model. Before the first step (and before an evaluation set
is first evaluated), the training engine itself (its ZeRO-partitioned weights, as they are before
any update) scores every row of the set, each rank its share, as the objective asks
(``reference_logps``: DPO's two answers, KTO's completion and its KL partner); the log-probabilities
become the set's ``ref_logps`` column. Training then holds no reference model at all. The reference is:
- the initial policy (the model given), by default;
- the policy with its adapters turned off, for a PEFT model (the base model, as in TRL);
- ``ref_model`` when one is given: it scores the rows once and is let go. Under ZeRO-3 it is a
  DeepSpeed engine of its own, partitioned over the ranks like the policy (and offloaded with it), so
  no rank holds a second model whole; under ZeRO 0-2, it is whole on each rank's device while it scores.

The pass is written to ``output_dir/reference/<set>.safetensors`` with a fingerprint of the
reference (its class, config and weights, and which of the three it is) and of the tokenised rows.
A rerun or a resume with the same fingerprint reads it instead of scoring again; one whose
fingerprint differs is refused with one line naming the file, since reusing it would train
against another model's or another set's numbers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from trainer.data.preference import REFERENCE_COLUMN, pairs_digest
from trainer.engine.objectives import Tokens
from trainer.engine.zero import frozen_forward, gathered
from trainer.loop.evaluation import eval_batches
from trainer.loop.stages import DataStage
from trainer.runtime.distributed import all_gather_object, barrier, host_all_reduce, print_main
from trainer.runtime.run_files import write_whole

REFERENCE_DIR = "reference"
FLUSH_PAIRS = 4096  # rows a rank scores between two writes of its progress in the reference pass


class ReferenceStage(DataStage):
    """Each row's ``ref_logps`` under the reference: the initial policy, its base with the adapters
    off (a PEFT model), or ``ref_model``."""

    def __init__(self, model: torch.nn.Module, ref_model: torch.nn.Module | None, is_peft: bool):
        self.ref_model = ref_model
        self.source = "ref_model" if ref_model is not None else "adapters_off" if is_peft else "policy"
        # With the adapters off, the reference is the frozen base: the adapters' initial values
        # (drawn afresh by each run) are no part of it, so a rerun or a resume still matches.
        frozen_only = self.source == "adapters_off"
        self.can_score = True  # the reference is at hand until training starts
        self._frozen, self._frozen_forward = contextlib.ExitStack(), None  # ref_model's, once built
        self.digest = _weights_digest(ref_model if ref_model is not None else model, frozen_only)

    def started(self, trainer: Any) -> None:
        # From here the policy moves (or a checkpoint's weights replace it), and a given ref_model is
        # let go: only the frozen base of a PEFT model can still score a new set.
        self._frozen.close()
        self.ref_model = self._frozen_forward = None  # training holds no reference model
        self.can_score = self.source == "adapters_off"

    def prepare(self, trainer: Any, dataset: Any, name: str | None) -> Any:
        """``dataset`` with its ``ref_logps`` column: read from the cache when its fingerprint
        matches, else scored now (collective: every rank calls it). A Trainer's own set's cache of
        another fingerprint is refused; a set passed to one ``evaluate`` call is cached under its
        fingerprint."""
        if dataset is None or REFERENCE_COLUMN in dataset.column_names:
            return dataset
        fingerprint = self._fingerprint(trainer.args, dataset)
        name = name or f"set-{fingerprint[:16]}"
        path = Path(trainer.args.output_dir) / REFERENCE_DIR / f"{name}.safetensors"
        cached = _read_cache(path, fingerprint)
        if cached is None:
            if not self.can_score:
                raise ValueError(
                    f"the {name} set has no reference log-probabilities, and its reference (the "
                    f"{self.source}) is gone once training starts; pass the set to "
                    f"{type(trainer).__name__}(eval_dataset=...) or evaluate it before train()"
                )
            cached = self._score(trainer, dataset, name, path.with_suffix(".partial"), fingerprint)
            if trainer.dist.is_main:
                _write_cache(path, cached, fingerprint)
                shutil.rmtree(path.with_suffix(".partial"), ignore_errors=True)  # the pass is whole
            barrier("reference_cache")
        return dataset.add_column(REFERENCE_COLUMN, cached.tolist())

    def _fingerprint(self, args: Any, dataset: Any) -> str:
        parts = {
            "reference": self.source,
            "weights": self.digest,
            "pairs": pairs_digest(dataset),
            "max_length": args.max_length,
            "truncation_mode": args.truncation_mode,
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    @torch.no_grad()
    def _score(self, trainer: Any, dataset: Any, name: str, partial: Path, fingerprint: str) -> torch.Tensor:
        """The reference log-probabilities of every row of ``dataset`` (the objective's
        ``reference_logps``); each rank scores its share, and every rank gets all of them.

        The pass resumes: every ``FLUSH_PAIRS`` rows a rank writes what it scored since its last
        write to ``partial`` (a directory of chunks, keyed by ``fingerprint``). A pass that starts
        over reads every chunk there (any rank's, any world size's) and forwards only the batches a
        rank still needs; ranks agree on each batch, since ZeRO-3's forwards are collective."""
        engine, (world, rank), args = trainer.engine, trainer.mesh.data_ranks, trainer.args
        size = args.precompute_ref_batch_size or args.per_device_eval_batch_size
        scored = _read_partial(partial, fingerprint) if trainer.dist.is_main else {}
        scored = all_gather_object(scored)[0]  # the main rank's reading, so that every rank agrees
        done = f"; {len(scored):,} were scored by an earlier attempt" if scored else ""
        print_main(
            f"Scoring the {name} set's {len(dataset):,} pairs under the reference ({self.source}){done}."
        )
        if trainer.dist.is_main:
            _start_partial(partial, fingerprint)
        barrier("reference_partial")
        fresh: dict[int, list[float]] = {}
        # Only a resumed pass votes on each batch; a fresh one forwards them all, with no collective
        # beside the forward's own. Decided once, from what every rank read alike.
        resumed = bool(scored)
        engine.train(False)
        try:
            # The policy as it trains: its head in tiles, its sequences split over a group's ranks,
            # where the run does so; a ref_model whole on each rank.
            own = self.ref_model is None
            with self._reference_forward(trainer) as forward:
                tokens = engine.tokens if own else Tokens(forward)
                for batch, indices in eval_batches(dataset, trainer.data_collator, size, rank, world):
                    needed = any(i >= 0 and i not in scored for i in indices)
                    if resumed and not host_all_reduce([float(needed)])[0]:
                        continue  # no rank needs this batch: every rank skips its forward
                    logps = engine.objective.reference_logps(tokens, engine.to_device(batch))
                    fresh.update((i, row) for i, row in zip(indices, logps.tolist(), strict=True) if i >= 0)
                    if len(fresh) >= FLUSH_PAIRS:
                        _write_chunk(partial, rank, fresh)
                        scored.update(fresh)
                        fresh = {}
        finally:
            engine.train(True)
        scored.update(fresh)
        merged: dict[int, list[float]] = {}
        for part in all_gather_object(scored):
            merged.update(part)
        return torch.tensor([merged[i] for i in range(len(dataset))], dtype=torch.float32)

    @contextlib.contextmanager
    def _reference_forward(self, trainer: Any) -> Iterator[Callable]:
        """The forward that scores the reference: ``ref_model``'s (built once: under ZeRO-3 an
        engine of its own that partitions it like the policy, else whole on this rank's device), or
        the training engine's (with the adapters off for a PEFT model)."""
        engine = trainer.engine
        if self.ref_model is not None:
            if self._frozen_forward is None:
                frozen = frozen_forward(self.ref_model, trainer.ds_config, engine.device)
                self._frozen_forward = self._frozen.enter_context(frozen)
            yield self._frozen_forward
        elif self.source == "adapters_off":
            with engine.module.disable_adapter():
                yield engine.forward
        else:
            yield engine.forward


def _weights_digest(model: torch.nn.Module, frozen_only: bool = False) -> str:
    """A digest of a model's class, config and weights (each parameter's sum and sum of squares in
    float64, gathered first where ZeRO-3 has partitioned it): what tells one reference from another.
    ``frozen_only``: the parameters that do not train (a PEFT model's base)."""
    digest = hashlib.sha256(type(model).__name__.encode())
    config = getattr(model, "config", None)
    if config is not None:
        digest.update(config.to_json_string(use_diff=False).encode())
    for name, param in model.named_parameters():
        if frozen_only and param.requires_grad:
            continue
        with gathered([param]):
            values = param.detach().double()
            digest.update(f"{name}:{values.sum().item():.12e}:{(values * values).sum().item():.12e}".encode())
    return digest.hexdigest()


def _read_cache(path: Path, fingerprint: str) -> torch.Tensor | None:
    """The cached log-probabilities, None where there are none (or a pass stopped before its
    fingerprint was written); a cache of another fingerprint is refused."""
    meta = path.with_suffix(".json")
    if not (path.is_file() and meta.is_file()):
        return None
    stored = json.loads(meta.read_text()).get("fingerprint")
    if stored != fingerprint:
        raise ValueError(
            f"{path}: the reference log-probabilities there were computed for another model or set "
            f"(fingerprint {str(stored)[:12]}, this run's {fingerprint[:12]}); remove {path.parent} "
            "to score the reference again, or use another output_dir"
        )
    return load_file(path)[REFERENCE_COLUMN]


def _write_cache(path: Path, logps: torch.Tensor, fingerprint: str) -> None:
    """Written whole or not at all: the tensors, then the fingerprint beside them, each renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = path.with_suffix(".json")
    meta.unlink(missing_ok=True)
    write_whole(path, lambda partial: save_file({REFERENCE_COLUMN: logps.contiguous()}, partial))
    record = json.dumps({"fingerprint": fingerprint, "pairs": len(logps)})
    write_whole(meta, lambda partial: partial.write_text(record))


def _start_partial(partial: Path, fingerprint: str) -> None:
    """A directory for the pass's chunks, keyed by ``fingerprint``; one of another fingerprint (an
    earlier pass over other weights or pairs, never a finished cache) is emptied first."""
    meta = partial / "fingerprint.json"
    if partial.is_dir() and (
        not meta.is_file() or json.loads(meta.read_text()).get("fingerprint") != fingerprint
    ):
        shutil.rmtree(partial)
    if not meta.is_file():
        partial.mkdir(parents=True, exist_ok=True)
        write_whole(meta, lambda tmp: tmp.write_text(json.dumps({"fingerprint": fingerprint})))


def _read_partial(partial: Path, fingerprint: str) -> dict[int, list[float]]:
    """The pairs an earlier attempt of this pass scored (none if its fingerprint differs)."""
    meta = partial / "fingerprint.json"
    if not meta.is_file() or json.loads(meta.read_text()).get("fingerprint") != fingerprint:
        return {}
    scored: dict[int, list[float]] = {}
    for chunk in sorted(partial.glob("*.safetensors")):
        tensors = load_file(chunk)
        scored.update(zip(tensors["indices"].tolist(), tensors[REFERENCE_COLUMN].tolist(), strict=True))
    return scored


def _write_chunk(partial: Path, rank: int, fresh: dict[int, list[float]]) -> None:
    """This rank's pairs scored since its last chunk, as one more chunk (written whole)."""
    tensors = {
        "indices": torch.tensor(list(fresh), dtype=torch.int64),
        REFERENCE_COLUMN: torch.tensor(list(fresh.values()), dtype=torch.float32),
    }
    write_whole(partial / f"rank{rank}-{time.time_ns()}.safetensors", lambda tmp: save_file(tensors, tmp))
