"""configure_logging: the INFO lines the docs promise appear on rank 0, and only warnings elsewhere."""

from __future__ import annotations

import logging
import os

import datasets
import pytest
import transformers

from tests.helpers.launch import launch
from tests.unit.test_data_build import SAMPLE_MODULES, STDLIB
from trainer.args import DataArguments, ModelArguments
from trainer.data import get_tokenizer, prepare_datasets
from trainer.runtime.ranks import LOG_HANDLER, configure_logging

ENV = (
    "TRANSFORMERS_VERBOSITY",
    "DATASETS_VERBOSITY",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "HF_DATASETS_DISABLE_PROGRESS_BARS",
)


@pytest.fixture(autouse=True)
def restore_logging():
    env = {name: os.environ.pop(name, None) for name in ENV}
    trainer_level = logging.getLogger("trainer").level
    levels = transformers.logging.get_verbosity(), datasets.logging.get_verbosity()
    bars = datasets.is_progress_bar_enabled(), transformers.logging.is_progress_bar_enabled()
    yield
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == LOG_HANDLER]:
        root.removeHandler(handler)
    logging.getLogger("trainer").setLevel(trainer_level)
    transformers.logging.set_verbosity(levels[0])
    datasets.logging.set_verbosity(levels[1])
    datasets.enable_progress_bars() if bars[0] else datasets.disable_progress_bars()
    transformers.logging.enable_progress_bar() if bars[1] else transformers.logging.disable_progress_bar()
    for name, value in env.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


def build_twice(tmp_path) -> None:
    """Tokenise a small corpus twice: the second build logs the cache hit the docs promise."""
    corpus = tmp_path / "code"
    corpus.mkdir()
    for name in SAMPLE_MODULES:
        (corpus / name).write_text((STDLIB / name).read_text(encoding="utf-8"), encoding="utf-8")
    data_args = DataArguments(dataset=str(corpus), cache_dir=str(tmp_path / "cache"), block_size=32)
    tokenizer = get_tokenizer(ModelArguments(vocab_size=300), data_args)
    for _ in range(2):
        prepare_datasets(data_args, tokenizer, seed=0)


def test_rank0_shows_the_info_lines(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    configure_logging()
    build_twice(tmp_path)
    err = capfd.readouterr().err
    assert "[rank 0] INFO trainer.data.tokenizer: trained a " in err
    assert "[rank 0] INFO trainer.data.build: tokenised " in err
    assert f"[rank 0] INFO trainer.data.build: tokenised dataset cache hit: {tmp_path / 'cache'}" in err
    assert transformers.logging.get_verbosity() == logging.WARNING
    assert datasets.logging.get_verbosity() == logging.WARNING
    assert os.environ["TRANSFORMERS_VERBOSITY"] == os.environ["DATASETS_VERBOSITY"] == "warning"


def test_other_ranks_show_only_warnings(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    configure_logging()
    build_twice(tmp_path)
    logging.getLogger("trainer.data.sampler").warning("a warning")
    err = capfd.readouterr().err
    assert " INFO " not in err
    assert "[rank 1] WARNING trainer.data.sampler: a warning" in err
    assert transformers.logging.get_verbosity() == logging.ERROR
    assert datasets.logging.get_verbosity() == logging.ERROR
    assert not datasets.is_progress_bar_enabled() and not transformers.logging.is_progress_bar_enabled()


def test_calling_it_again_keeps_one_handler(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")  # the user's choice stands
    configure_logging()
    configure_logging()
    assert [h.get_name() for h in logging.getLogger().handlers].count(LOG_HANDLER) == 1
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "info"


def test_a_warning_shows_once_though_a_catch_warnings_block_forgets_it():
    """Python alone prints it again after every ``catch_warnings`` block (subprocess has one)."""
    probe = (
        "import warnings\n"
        "from trainer.runtime.ranks import configure_logging\n"
        "configure_logging()\n"
        "for _ in range(3):\n"
        "    warnings.warn('deprecated collective', FutureWarning)\n"
        "    with warnings.catch_warnings():\n"
        "        pass\n"
    )
    proc = launch(["-c", probe], launcher="python", timeout=120)
    assert proc.stderr.count("FutureWarning: deprecated collective") == 1
    chosen = launch(["-W", "always", "-c", probe], launcher="python", timeout=120)  # the user's choice wins
    assert chosen.stderr.count("FutureWarning: deprecated collective") == 3
