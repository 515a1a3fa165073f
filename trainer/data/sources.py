"""Where raw documents come from: the stdlib corpus, local files, or a hub dataset.

A *source* is resolved (and fingerprinted) before anything is loaded, so a warm tokenisation cache
is found without reading a local dataset again. Every failure a user can cause (missing path,
unreadable file, empty dataset, missing column) is a :class:`DataError` naming the offending key.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import datasets

from trainer.args import DataArguments
from trainer.config.errors import ConfigError, suggest
from trainer.runtime.digests import CHECKSUM, file_digest
from trainer.runtime.run_files import write_whole

logger = logging.getLogger(__name__)

STDLIB = "stdlib"

# File suffix -> `datasets` builder. Plain-text files are read one document per file.
BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".py": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}

# Directory names skipped in the stdlib corpus: test suites and third-party code.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "idle_test"}


class DataError(ConfigError):
    """Bad data input. A ConfigError, so the CLI prints it as ``key: message`` and exits non-zero."""


def default_cache_root() -> Path:
    return Path.home() / ".cache" / "trainer" / "datasets"


def cache_root(data_args: DataArguments) -> Path:
    return Path(data_args.cache_dir).expanduser() if data_args.cache_dir else default_cache_root()


def corpus_files(root: str | Path | None = None) -> list[Path]:
    """The .py files of the running interpreter's standard library, in a fixed order.

    Test suites (any directory whose name starts with ``test``, plus ``idle_test``) and
    site-packages are left out. Order is the sorted POSIX relative path, so it is the same on
    every machine with the same Python.
    """
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith("test")]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(base).as_posix())


@dataclass
class Source:
    """A resolved data source: what to load and a fingerprint that changes when the data does."""

    kind: str  # "stdlib", "files", "saved" (a save_to_disk directory) or "hub"
    name: str
    files: list[Path]
    builder: str | None
    fingerprint: str
    key: str = "dataset"  # the argument that named it, for its error messages


def stable_hash(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def looks_local(name: str) -> bool:
    return (
        name.startswith(("/", "./", "../", "~"))
        or Path(name).suffix.lower() in BUILDERS
        or name.count("/") > 1  # hub names are "name" or "owner/name"
    )


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    names = (datasets.config.DATASET_STATE_JSON_FILENAME, datasets.config.DATASETDICT_JSON_FILENAME)
    return path.is_dir() and any((path / n).is_file() for n in names)


def _local_files(path: Path, key: str) -> tuple[list[Path], str]:
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS)
        saved = next((f.parent for f in files if is_saved_dataset(f.parent)), None)
        if saved is not None:  # its state.json would be read as data
            raise DataError([(key, f"{saved} holds a dataset saved with save_to_disk; pass that directory")])
        if not files:
            kinds = ", ".join(sorted(BUILDERS))
            raise DataError([(key, f"no data files ({kinds}) under directory {path}")])
    builders = {BUILDERS.get(p.suffix.lower()) for p in files}
    if None in builders:
        raise DataError([(key, f"unsupported file type {path.suffix!r}; use one of {', '.join(BUILDERS)}")])
    if len(builders) > 1:
        raise DataError([(key, f"{path} mixes file formats ({', '.join(sorted(builders))}); use one")])
    return files, builders.pop()


def _stat_fingerprint(files: list[Path]) -> str:
    # Local files are fingerprinted by path, size and mtime (like make), not by content, so a
    # warm cache is found without reading a large corpus again.
    return stable_hash([(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files])


def content_digests(data_args: DataArguments) -> dict[str, dict[str, str]]:
    """The xxh3-128 of every local data file a run reads, by the argument that names it (``dataset``,
    ``validation_file``): what a resume compares, since a file rewritten in place keeps its name.

    Each file is read once per version: its digest is kept in the tokenisation cache, keyed by path,
    size, mtime, ctime and inode (a rewrite changes ctime, which no user call sets back). The stdlib
    corpus and hub datasets are left out (their fingerprints are already of their content)."""
    store = cache_root(data_args) / "file_digests.json"
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):
        known = {}
    found: dict[str, dict[str, str]] = {}
    for key, name in (("dataset", data_args.dataset), ("validation_file", data_args.validation_file)):
        if not name or name == STDLIB or not Path(name).expanduser().exists():
            continue
        digests = found[key] = {}
        for file in resolve_source(data_args, name, key).files:
            st = file.stat()
            version = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
            path = str(file.resolve())
            if known.get(path, {}).get("version") != version or CHECKSUM not in known[path]:
                known[path] = {"version": version, CHECKSUM: file_digest(file)}
            digests[path] = known[path][CHECKSUM]
    with contextlib.suppress(OSError):  # a read-only cache: the digests are only computed again
        store.parent.mkdir(parents=True, exist_ok=True)
        write_whole(store, lambda partial: partial.write_text(json.dumps(known)))  # ranks share it
    return found


def resolve_source(data_args: DataArguments, name: str | None = None, key: str = "dataset") -> Source:
    """Decide where the data comes from, without loading it (except its fingerprint inputs).

    ``name`` defaults to ``data_args.dataset``; another one (``validation_file``) must be local.
    """
    name = data_args.dataset if name is None else name
    if name == STDLIB and key == "dataset":
        files = corpus_files()
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.name.encode())
            digest.update(f.read_bytes())
        return Source("stdlib", name, files, None, digest.hexdigest())
    path = Path(name).expanduser()
    if is_saved_dataset(path):
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return Source("saved", name, files, None, _stat_fingerprint(files), key)
    if path.exists():
        files, builder = _local_files(path, key)
        return Source("files", name, files, builder, _stat_fingerprint(files), key)
    if looks_local(name) or key != "dataset":
        raise DataError([(key, f"file not found: {name}")])
    return Source("hub", name, [], None, "")  # fingerprint filled in by load_raw


@dataclass
class RawData:
    train: datasets.Dataset
    eval: datasets.Dataset | None  # a validation split that the source itself provides
    source: Source


def _stdlib_dataset(files: list[Path]) -> datasets.Dataset:
    base = Path(sysconfig.get_paths()["stdlib"])
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    paths = [f.relative_to(base).as_posix() for f in files]
    return datasets.Dataset.from_dict({"text": texts, "path": paths})


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_raw(data_args: DataArguments, source: Source | None = None) -> RawData:
    """Load the raw documents of a source as `datasets` objects."""
    source = source or resolve_source(data_args)
    if source.kind == "stdlib":
        return RawData(_stdlib_dataset(source.files), None, source)
    hf_cache = str(cache_root(data_args) / "hf")
    if source.kind == "files":
        kwargs = {"sample_by": "document"} if source.builder == "text" else {}
        try:
            loaded = datasets.load_dataset(
                source.builder,
                data_files={"train": [str(f) for f in source.files]},
                cache_dir=hf_cache,
                **kwargs,
            )
        except Exception as err:  # malformed JSON/parquet: one line naming the file
            raise DataError([(source.key, f"could not read {source.name}: {_first_line(err)}")]) from None
        return RawData(loaded["train"], None, source)
    if source.kind == "saved":
        try:
            loaded = datasets.load_from_disk(str(Path(source.name).expanduser()))
        except Exception as err:
            raise DataError(
                [(source.key, f"could not load the saved dataset {source.name}: {_first_line(err)}")]
            ) from None
        if isinstance(loaded, datasets.Dataset):
            return RawData(loaded, None, source)
        return _splits(loaded, source)
    try:
        loaded = datasets.load_dataset(source.name, data_args.dataset_config, cache_dir=hf_cache)
    except Exception as err:
        raise DataError(
            [
                (
                    "dataset",
                    f"{source.name!r} is not a local path and could not be loaded from the hub: {_first_line(err)}",
                )
            ]
        ) from None
    raw = _splits(loaded, source)
    source.fingerprint = stable_hash([raw.train._fingerprint, raw.eval._fingerprint if raw.eval else None])
    return raw


def _splits(loaded: datasets.DatasetDict, source: Source) -> RawData:
    """The train split of a DatasetDict, and its validation (or valid, or test) split as the eval set."""
    if "train" not in loaded:
        raise DataError([(source.key, f"{source.name!r} has no train split (splits: {', '.join(loaded)})")])
    eval_split = next((loaded[s] for s in ("validation", "valid", "test") if s in loaded), None)
    return RawData(loaded["train"], eval_split, source)


def require_columns(present: list[str], key: str, columns: list[str], source: str) -> None:
    """Raise a DataError naming the first missing column and the nearest existing one."""
    for col in columns:
        if col not in present:
            hint = suggest(col, present)
            msg = f"column {col!r} not found in {source} (columns: {', '.join(present)})"
            raise DataError([(key, msg + (f"; did you mean {hint}?" if hint else ""))])


def load_validation(data_args: DataArguments, source: Source) -> datasets.Dataset:
    """The rows of a ``validation_file``: the file's rows, or a saved DatasetDict's eval split."""
    raw = load_raw(data_args, source)
    return raw.eval if raw.eval is not None else raw.train
