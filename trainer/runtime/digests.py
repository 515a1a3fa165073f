"""File checksums: one function for every file the project fingerprints (checkpoint files, the data
files a run read). xxh3-128 reads at memory speed, many times sha256's rate (docs/checkpoints.md);
sha256 is still read in older checkpoint manifests."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import xxhash

CHECKSUM = "xxh3_128"  # a manifest entry's key names the hash that made it
LEGACY_CHECKSUM = "sha256"
HASHES = {CHECKSUM: xxhash.xxh3_128, LEGACY_CHECKSUM: hashlib.sha256}


def file_digest(path: Path, algorithm: str = CHECKSUM, fsync: bool = False) -> str:
    """A file's checksum, read in 4 MiB blocks; fsynced on the way when asked (a read-only
    descriptor is enough)."""
    h = HASHES[algorithm]()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()
