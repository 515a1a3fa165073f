"""Tokenizers: load one from a model directory, or train a byte-level BPE on the corpus.

A trained tokenizer is cached under ``<cache root>/tokenizer-bpe-<key>/`` where the key covers the
corpus fingerprint, the vocabulary size and the data format, so a second run (and every other rank)
loads it instead of training again. It is saved with ``save_pretrained``, so the same directory (and
any export that copies it) loads with ``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from filelock import FileLock
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from trainer.args import DataArguments, ModelArguments
from trainer.data.chat import DEFAULT_CHAT_TEMPLATE
from trainer.data.formats import iter_texts
from trainer.data.sources import DataError, cache_root, load_raw, resolve_source, stable_hash
from trainer.data.stream_sources import stream_sources, stream_texts, streams_fingerprint

logger = logging.getLogger(__name__)

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# Bump when the training recipe below changes, so old cached tokenizers are not reused.
_BPE_VERSION = 1
# Train on at most this many characters (a deterministic prefix of the corpus) to stay fast.
MAX_TRAIN_CHARS = 64 * 1024 * 1024
# Any one of these marks a directory that AutoTokenizer can load.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def get_tokenizer(model_args: ModelArguments, data_args: DataArguments) -> PreTrainedTokenizerFast:
    """The run's tokenizer: a local (or hub) one when named, else a BPE trained on the corpus.

    A tokenizer trained here, and one without a chat template given instruction data that may be
    rendered as a chat (every format but ``text`` and ``prompt_response``), get
    :data:`DEFAULT_CHAT_TEMPLATE`: what the run saves with the model carries the template it was
    trained with, and a model pretrained here can be fine-tuned on conversations next.
    """
    tokenizer = _load_or_train(model_args, data_args)
    trained = not (model_args.tokenizer_name_or_path or model_args.model_name_or_path)
    chat = data_args.data_format not in ("text", "prompt_response")
    if (trained or chat) and not tokenizer.chat_template:
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer


def _load_or_train(model_args: ModelArguments, data_args: DataArguments) -> PreTrainedTokenizerFast:
    name = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    if name:
        key = "tokenizer_name_or_path" if model_args.tokenizer_name_or_path else "model_name_or_path"
        local = Path(name).expanduser()
        if name.startswith((".", "/", "~")) and not local.is_dir():
            raise DataError([(key, f"directory not found: {name}")])
        if local.is_dir() and not any((local / f).exists() for f in _TOKENIZER_FILES):
            raise DataError([(key, f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {name}")])
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=model_args.trust_remote_code)
        except (OSError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise DataError([(key, f"could not load a tokenizer from {name}: {first}")]) from None
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            # Padding positions are masked out of the loss, so reusing EOS as pad is harmless.
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer
    streams = stream_sources(data_args) if data_args.streaming else None
    source = None if streams else resolve_source(data_args)
    key = stable_hash(
        {
            "v": _BPE_VERSION,
            "data": streams_fingerprint(streams) if streams else source.fingerprint,
            "vocab": model_args.vocab_size,
            "format": data_args.data_format,
            "column": data_args.text_column,
        }
    )
    target = cache_root(data_args) / f"tokenizer-bpe-{key[:16]}"
    target.parent.mkdir(parents=True, exist_ok=True)
    # One process trains while the other ranks of the node wait for it, then load its result.
    with FileLock(str(target) + ".lock"):
        if (target / "tokenizer.json").exists():
            logger.info("tokenizer cache hit: %s", target)
        else:
            if streams:  # the stream's own texts, as far as the cap reads: nothing is loaded up front
                texts = stream_texts(streams, data_args.unreadable_shards)
            else:
                raw = load_raw(data_args, source)
                texts = iter_texts(raw.train, data_args.data_format, data_args.text_column, data_args.dataset)
            tokenizer = train_bpe_tokenizer(texts, model_args.vocab_size)
            _save_atomically(tokenizer, target)
            logger.info("trained a %d-token byte-level BPE tokenizer; cached at %s", len(tokenizer), target)
    return AutoTokenizer.from_pretrained(str(target))


def _capped(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    total = 0
    for text in texts:
        if total >= max_chars:
            return
        total += len(text)
        yield text


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (GPT-2 style pre-tokenisation, no added BOS/EOS) on ``texts``.

    ``vocab_size`` counts everything: the 256 byte symbols, the three special tokens and the
    merges. The special tokens take ids 0, 1, 2 (bos, eos, pad).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_capped(texts, MAX_TRAIN_CHARS), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def _save_atomically(tokenizer: PreTrainedTokenizerFast, target: Path) -> None:
    """Write to a temporary sibling and rename, so a reader never sees half a tokenizer.

    Several ranks may train the same tokenizer at once; the first rename wins and the others
    discard their identical copy.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    tokenizer.save_pretrained(str(tmp))
    try:
        os.rename(tmp, target)
    except OSError:
        if not (target / "tokenizer.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerFast) -> str:
    """Changes whenever the tokenizer would produce different ids for the same text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items())
    return stable_hash(
        {
            "class": type(tokenizer).__name__,
            "vocab": vocab,
            "special": tokenizer.special_tokens_map,
            "chat_template": getattr(tokenizer, "chat_template", None),
        }
    )
