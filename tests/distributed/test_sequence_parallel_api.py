"""Sequence parallelism through ``from trainer import Trainer, TrainingArguments`` on 2 ranks,
against the same script on one process.

The rows are Python source (the standard library's, tokenised with a BPE trained here): on text a
token's prediction depends on the tokens before it, so what attention computes shows in the losses
and gradients. On uniform random tokens a fresh model's loss is about ln(vocab) whatever attention
does, and a wrong exchange of the sequence between ranks could pass unseen.
"""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import pytest

from tests.helpers.launch import launch, together
from tests.helpers.scaffold import bpe_tokenizer

pytestmark = pytest.mark.distributed
SCRIPT = "tests/helpers/hf_sequence_parallel.py"
SOURCES = ("argparse.py", "textwrap.py", "shlex.py")
ROWS, LENGTH, VOCAB = 16, 1024, 512


def source_rows(path: Path) -> Path:
    """``ROWS`` rows of ``LENGTH`` tokens of standard library source and the tokenizer's vocabulary
    size, written to ``path`` as JSON."""
    texts = [(Path(sysconfig.get_paths()["stdlib"]) / name).read_text() for name in SOURCES]
    tokenizer = bpe_tokenizer(texts, vocab_size=VOCAB)
    ids = [i for text in texts for i in tokenizer(text)["input_ids"]]
    assert len(ids) >= ROWS * LENGTH, len(ids)
    rows = [ids[r * LENGTH : (r + 1) * LENGTH] for r in range(ROWS)]
    path.write_text(json.dumps({"vocab_size": VOCAB, "rows": rows}))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp_api")
    rows = source_rows(root / "rows.json")
    together(
        lambda: launch([SCRIPT, str(rows), str(root / "one"), "1"], launcher="python"),
        lambda: launch([SCRIPT, str(rows), str(root / "sp"), "2"]),
    )
    one = json.loads((root / "one" / "rank0.json").read_text())
    return one, [json.loads((root / "sp" / f"rank{r}.json").read_text()) for r in range(2)]


def test_the_rows_are_text_the_model_learns_from(runs):
    one, _ = runs
    # On uniform random tokens no model's expected loss on unseen rows is below ln(vocab); on text
    # the token statistics pull it under within the three steps.
    assert one["eval_loss"] < math.log(VOCAB) - 0.15, one
    assert one["losses"][-1] < one["losses"][0] - 0.1, one["losses"]


@pytest.mark.parametrize("rank", [0, 1])
def test_the_trainer_api_splits_rows_and_keeps_losses_and_grad_norms(runs, rank):
    one, sp = runs[0], runs[1][rank]
    assert len(sp["losses"]) == len(sp["grad_norms"]) == 3
    # fp32 on both sides; the sums only run in another order. Adam (and clipping, once a norm passes
    # max_grad_norm 1.0) would hide a gradient off by a constant factor from the losses, never from its norm.
    assert sp["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
    assert sp["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert sp["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
