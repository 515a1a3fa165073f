"""One rank's checkpoint files: written now, or copied to host memory and written by a thread.

Every file a rank writes for a checkpoint goes through a ``FileWriter``. It takes each file's sha256
while serialising (on a helper thread, chunk by chunk, so hashing overlaps writing) and fsyncs it,
so the manifest that rank 0 commits is built from every rank's own records (checksummed in
parallel, by the rank that wrote the bytes) and no marker is ever written ahead of durable data.

Asynchronous mode (``async_save``): ``save`` takes a host copy of the state before it returns: the
training loop is blocked only for that copy. A single background thread then serialises the copies
in order. Nothing is committed until every rank's thread has finished; the commit itself is the
same as for a synchronous save.

``save_weights`` writes a ``save_only_model`` checkpoint's one weights file on rank 0 (after the
gather, which blocks anyway); the manifest checksums and fsyncs it like any file without a record.
"""

from __future__ import annotations

import copy
import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def file_entry(path: Path) -> dict[str, Any]:
    """Size and sha256 of a file, which is fsynced on the way (a read-only descriptor is enough)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
        os.fsync(f.fileno())
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


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
    """A binary file that takes the sha256 of what goes through it. A large chunk is hashed on a
    helper thread while this one writes it (both release the GIL), and both finish before
    ``write`` returns, so the caller's buffer is never read after that."""

    PARALLEL_BYTES = 1 << 20

    def __init__(self, file: Any, helper: ThreadPoolExecutor):
        self.file, self.helper = file, helper
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if n >= self.PARALLEL_BYTES:
            hashed = self.helper.submit(self.sha256.update, data)
            self.file.write(data)
            hashed.result()
        else:
            self.sha256.update(data)
            self.file.write(data)
        self.size += n
        return n

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
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-hash")
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
            self._hasher.shutdown(wait=True)
        return self.entries

    def _write(self, obj: Any, path: Path, zipfile: bool) -> None:
        """Serialise, hashing on the way (no read back), then fsync."""
        with path.open("wb") as f:
            out = _HashingFile(f, self._hasher)
            torch.save(obj, out, _use_new_zipfile_serialization=zipfile)
            f.flush()
            os.fsync(f.fileno())
        self.entries[str(path.relative_to(self.root))] = {"size": out.size, "sha256": out.sha256.hexdigest()}

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
