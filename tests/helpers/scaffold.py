"""What many tests share around a run: the flags of a tiny ``scripts/train.py`` run, the reader of an
output_dir's ``metrics.jsonl``, weight comparisons, a small tmpfs, and a byte-level BPE tokenizer
trained here.

Each is strict where a test needs it to be: ``read_metrics`` parses every line (a torn line fails the
test), ``assert_same_weights`` is bitwise unless given tolerances.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# ---- tiny runs of scripts/train.py -----------------------------------------------------------------

# The model of most tiny runs: the recipe's Llama with 2 layers of width 64 (--model_config_overrides).
TINY_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}

# A tiny run of the embedded default recipe: four steps, each logged, one eval and one checkpoint at
# the end, 64-token blocks.
TINY_RUN: dict[str, Any] = {
    "max_steps": 4,
    "logging_steps": 1,
    "save_steps": 4,
    "eval_steps": 4,
    "max_train_samples": 200,
    "max_eval_samples": 16,
    "block_size": 64,
    "model_config_overrides": TINY_MODEL,
}


def tiny_flags(**overrides: Any) -> list[str]:
    """The command-line flags of ``TINY_RUN`` with ``overrides`` (flag names without ``--``).

    An override of None leaves the flag out, True passes it bare (``--bf16``), a dict goes as JSON,
    anything else as ``str(value)``. Flags ``TINY_RUN`` does not have follow its own, in the order given.
    """
    flags: list[str] = []
    for name, value in {**TINY_RUN, **overrides}.items():
        if value is None:
            continue
        flags.append(f"--{name}")
        if value is not True:
            flags.append(json.dumps(value) if isinstance(value, dict) else str(value))
    return flags


# ---- metrics.jsonl ---------------------------------------------------------------------------------


def read_metrics(out: str | Path, missing_ok: bool = False) -> list[dict]:
    """The rows of ``out/metrics.jsonl``, every line parsed; ``missing_ok``: no file reads as no rows."""
    path = Path(out) / "metrics.jsonl"
    if missing_ok and not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_rows(out: str | Path) -> list[dict]:
    """The rows of ``out/metrics.jsonl`` that log a training loss."""
    return [row for row in read_metrics(out) if "loss" in row]


def loss_steps(out: str | Path, missing_ok: bool = False) -> list[int]:
    """The steps of the loss rows, in the order logged (a resumed run appends its own)."""
    return [row["step"] for row in read_metrics(out, missing_ok) if "loss" in row]


def losses(out: str | Path) -> list[float]:
    """The training losses, in the order logged."""
    return [row["loss"] for row in train_rows(out)]


# ---- weights ---------------------------------------------------------------------------------------


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict: a ``.safetensors`` file, a ``torch.save``d one, or an HF model directory's
    ``model.safetensors`` (a run's ``final/``)."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = path / "model.safetensors"
    if path.suffix == ".safetensors":
        return load_file(path)
    return torch.load(path, weights_only=True)


def weights_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same names, each tensor bitwise equal."""
    return a.keys() == b.keys() and all(torch.equal(a[k], v) for k, v in b.items())


def assert_same_weights(
    got: dict[str, torch.Tensor] | str | Path,
    want: dict[str, torch.Tensor] | str | Path,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    same_keys: bool = True,
    what: str = "",
) -> None:
    """``got`` matches ``want`` tensor by tensor (either a state dict or a path for ``load_weights``).

    Bitwise (``torch.equal``) without tolerances, else ``torch.testing.assert_close`` with ``rtol`` and
    ``atol``. ``same_keys``: both hold the same names; without it every tensor of ``want`` must be in
    ``got`` and match. A failure names the tensor (after ``what``, where given).
    """
    got = got if isinstance(got, dict) else load_weights(got)
    want = want if isinstance(want, dict) else load_weights(want)
    if same_keys:
        assert got.keys() == want.keys(), what
    for name, tensor in want.items():
        msg = f"{what} {name}".strip()
        assert name in got, msg
        if rtol is None and atol is None:
            assert torch.equal(got[name], tensor), msg
        else:
            torch.testing.assert_close(got[name], tensor, rtol=rtol, atol=atol, msg=msg)


# ---- a small filesystem ----------------------------------------------------------------------------


def _mount_tmpfs(path: Path, size: int | str) -> str | None:
    """Mount a tmpfs of ``size`` at ``path`` (made here); None once mounted, else the system's reason."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        return mounted.stderr.decode().strip() or f"mount exited {mounted.returncode}"
    return None


def _unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=True)


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size: int | str) -> Iterator[Path]:
    """``path``, a new directory with a tmpfs of ``size`` bytes mounted on it for the block; the test
    is skipped, with the system's reason, where this process may not mount one."""
    refused = _mount_tmpfs(path, size)
    if refused is not None:
        pytest.skip(f"cannot mount a tmpfs here: {refused}")
    try:
        yield path
    finally:
        _unmount(path)


def tmpfs_refusal(path: Path) -> str | None:
    """None when a tmpfs can be mounted here (tried at ``path``, a new directory, and unmounted again),
    else the system's reason."""
    refused = _mount_tmpfs(path, "1m")
    if refused is None:
        _unmount(path)
    return refused


# ---- tokenizers ------------------------------------------------------------------------------------


def bpe_tokenizer(
    lines: Iterable[str],
    *,
    vocab_size: int = 512,
    special_tokens: tuple[str, ...] = ("<unk>", "<pad>", "<eos>"),
    add_prefix_space: bool = False,
    end_with_eos: bool = False,
    **names: Any,
):
    """A byte-level BPE tokenizer trained here on ``lines``, as an HF ``PreTrainedTokenizerFast``.

    ``special_tokens`` get the first ids, in order. ``names`` are the HF tokenizer's arguments
    (``unk_token``, ``pad_token``, ``eos_token``, ``model_max_length``, ...); by default the three
    special tokens are unk, pad and eos, in that order. ``end_with_eos``: every sequence ends with the eos token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    names = {**dict(zip(("unk_token", "pad_token", "eos_token"), special_tokens[:3], strict=True)), **names}
    bpe = Tokenizer(models.BPE(unk_token=names["unk_token"]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        lines, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens))
    )
    if end_with_eos:
        eos = names["eos_token"]
        bpe.post_processor = processors.TemplateProcessing(
            single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, bpe.token_to_id(eos))]
        )
    return PreTrainedTokenizerFast(tokenizer_object=bpe, **names)


# ---- a directory's contents ------------------------------------------------------------------------


def file_digests(root: str | Path) -> dict[str, str]:
    """Every file under ``root`` (relative path) with the sha256 of its bytes: two calls compare equal
    exactly when no file was written, added or removed in between."""
    import hashlib

    root = Path(root)
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
