"""One rank's checkpoint files: written now, or copied to host memory and written by a thread.

Every file a rank writes for a checkpoint goes through a ``FileWriter``. It checksums each file
while serialising (the bytes are hashed as they go to the file, never read back) and fsyncs it, so
the manifest that rank 0 commits is built from every rank's own records (checksummed in parallel,
by the rank that wrote the bytes) and no marker is ever written ahead of durable data.

The checksum is xxh3-128 (``CHECKSUM``), which runs at memory speed: a save costs about what a plain
write of its bytes costs. torch's zip writer would take a CRC-32 of every record as well, a second
pass over the bytes that nothing reads (``torch.load`` does not check it); it is switched off while
a checkpoint file is serialised, as the manifest checks the whole file. Manifests written before
the switch hold sha256 sums (``LEGACY_CHECKSUM``), which still verify.

Asynchronous mode (``async_save``): ``save`` takes a host copy of the state before it returns: the
training loop is blocked only for that copy. A single background thread then serialises the copies
in order. Nothing is committed until every rank's thread has finished; the commit itself is the
same as for a synchronous save.

``save_weights`` writes a ``save_only_model`` checkpoint's one weights file on rank 0 (after the
gather, which blocks anyway); the manifest checksums and fsyncs it like any file without a record.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from trainer.runtime.digests import CHECKSUM, HASHES, file_digest


def file_entry(path: Path) -> dict[str, Any]:
    """Size and checksum of a file written without a record, which is fsynced on the way."""
    return {"size": path.stat().st_size, CHECKSUM: file_digest(path, fsync=True)}


_crc_lock = threading.Lock()
_crc_writers = 0  # checkpoint files being serialised now, on any thread
_crc_before = True


@contextlib.contextmanager
def _without_zip_crc() -> Iterator[None]:
    """torch's zip CRC off while any checkpoint file is serialised. The switch is process-wide and
    writer threads overlap, so the first writer in turns it off and the last one out restores it."""
    global _crc_writers, _crc_before
    with _crc_lock:
        if _crc_writers == 0:
            _crc_before = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc_writers += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_writers -= 1
            if _crc_writers == 0:
                torch.serialization.set_crc32_options(_crc_before)


def host_copy(obj: Any, memo: dict[int, Any] | None = None) -> Any:
    """A copy of a state dict that later training cannot change: tensors are cloned into host
    memory (a tensor met twice is copied once, so shared entries stay shared), containers are
    rebuilt, and anything else is deep-copied."""
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        out = obj.detach().to("cpu", copy=True)
    elif isinstance(obj, dict):
        out = copy.copy(obj)  # keeps OrderedDict/defaultdict types
        for key, value in obj.items():
            out[key] = host_copy(value, memo)
    elif isinstance(obj, list):
        out = [host_copy(v, memo) for v in obj]
    elif isinstance(obj, tuple):
        items = [host_copy(v, memo) for v in obj]
        out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    else:
        out = copy.deepcopy(obj)
    memo[id(obj)] = out
    return out


class _HashingFile:
    """A binary file that checksums what goes through it, as it goes. A tensor's bytes go in 1 MiB
    slices, each hashed and then written while it is still in the CPU's cache, so memory is read
    once rather than twice."""

    SLICE = 1 << 20

    def __init__(self, file: Any):
        self.file = file
        self.hash = HASHES[CHECKSUM]()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, self.SLICE):
            part = view[start : start + self.SLICE]
            self.hash.update(part)
            self.file.write(part)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self.file.flush()


class FileWriter:
    """The files one rank writes for one checkpoint, and their manifest entries."""

    def __init__(self, root: Path, asynchronous: bool = False):
        self.root = root
        self.asynchronous = asynchronous
        self.entries: dict[str, dict[str, Any]] = {}
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer") if asynchronous else None
        )
        self._jobs: list[Future] = []
        self.failed: Exception | None = None  # set by the caller when a synchronous part failed

    def save(self, obj: Any, path: str | Path, zipfile: bool = True) -> None:
        """``torch.save`` of ``obj``; when asynchronous, of a host copy taken now."""
        path = Path(path)
        if self._pool is None:
            self._write(obj, path, zipfile)
        else:
            self._jobs.append(self._pool.submit(self._write, host_copy(obj), path, zipfile))

    def write_text(self, path: Path, text: str) -> None:
        """Small files (configs, trainer state) are written at once in both modes."""
        path.write_text(text)
        self._record(path)

    def done(self) -> bool:
        return all(job.done() for job in self._jobs)

    def wait(self) -> dict[str, dict[str, Any]]:
        """Block until every file is written; re-raises the first error. Returns the entries."""
        try:
            for job in self._jobs:
                job.result()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
        return self.entries

    def _write(self, obj: Any, path: Path, zipfile: bool) -> None:
        """Serialise, hashing on the way (no read back), then fsync."""
        with path.open("wb") as f, _without_zip_crc():
            out = _HashingFile(f)
            torch.save(obj, out, _use_new_zipfile_serialization=zipfile)
            f.flush()
            os.fsync(f.fileno())
        self.entries[str(path.relative_to(self.root))] = {"size": out.size, CHECKSUM: out.hash.hexdigest()}

    def _record(self, path: Path) -> None:
        self.entries[str(path.relative_to(self.root))] = file_entry(path)


def save_weights(state_dict: dict[str, torch.Tensor] | None, path: Path) -> None:
    """A whole model's weights as one safetensors file (``state_dict`` is None on ranks other than
    0, which write nothing). Tied weights are stored under each name, as the state dict has them."""
    if state_dict is None:
        return
    seen: set[int] = set()
    tensors = {}
    for name, tensor in state_dict.items():
        pointer = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.contiguous() if pointer not in seen else tensor.clone()
        seen.add(pointer)
    save_file(tensors, str(path), metadata={"format": "pt"})
