"""The evaluation loop on outputs of every structure, against HF's own Trainer on the same model
and data in this process: classification ``[n, C]``, regression, token classification ``[n, T, C]``
with batches of different widths, question answering (two label names, a tuple of logits), an
encoder-decoder (logits and encoder states of different lengths), a causal LM, nested dicts from
``preprocess_logits_for_metrics``; sets without labels; ``include_for_metrics``,
``batch_eval_metrics``, ``eval_accumulation_steps``, ``label_names`` and ``ignore_keys``.

Two ranks are played in this process: rank 1 runs first and its collectives record what it sends,
then rank 0's collectives receive it, so rank 0 sees what a real 2-rank run would (a launched run
covers the same through the public API: tests/distributed/test_hf_api.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import transformers
from transformers import (
    BertConfig,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    DataCollatorForSeq2Seq,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)
from transformers.trainer_pt_utils import nested_concat

import trainer.loop.evaluation
import trainer.loop.predictions
from trainer.data import CausalLMCollator
from trainer.engine import Tokens, objective_for
from trainer.loop.evaluation import Predictions, eval_batches, evaluation_loop
from trainer.loop.predictions import RowStore, concat
from trainer.runtime.mesh import Mesh

VOCAB, BATCH = 40, 3
LENGTHS = [3, 9, 5, 4, 11, 6, 7]  # batches of 3 are 9, 11 and 7 wide


class Pad:
    """A tokenizer's padding face, all HF's padding collators need (``pad`` on lists of ids)."""

    pad_token_id, padding_side, model_input_names = 0, "right", ["input_ids", "attention_mask"]

    def pad(self, rows, padding=True, max_length=None, pad_to_multiple_of=None, return_tensors="pt", **_):
        width = max(len(r["input_ids"]) for r in rows)
        out = {"input_ids": [], "attention_mask": []}
        for r in rows:
            n = len(r["input_ids"])
            out["input_ids"].append(list(r["input_ids"]) + [0] * (width - n))
            out["attention_mask"].append([1] * n + [0] * (width - n))
        extra = {k: [r[k] for r in rows] for k in rows[0] if k not in out}
        return {k: torch.tensor(v) for k, v in {**out, **extra}.items()}


BERT = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=32)  # fmt: skip


def task(name: str) -> tuple[torch.nn.Module, list[dict[str, Any]], Any]:
    """(model, rows, collator) of one output structure: tiny models from their configs."""
    g = np.random.default_rng(0)
    torch.manual_seed(0)
    text = [g.integers(2, VOCAB, n).tolist() for n in LENGTHS]
    if name == "classification":
        model = BertForSequenceClassification(BertConfig(num_labels=3, **BERT))
        rows = [{"input_ids": t, "labels": int(g.integers(0, 3))} for t in text]
        return model, rows, DataCollatorWithPadding(Pad())
    if name == "regression":
        model = BertForSequenceClassification(BertConfig(num_labels=1, **BERT))
        rows = [{"input_ids": t, "labels": float(g.normal())} for t in text]
        return model, rows, DataCollatorWithPadding(Pad())
    if name == "token_classification":
        model = BertForTokenClassification(BertConfig(num_labels=5, **BERT))
        rows = [{"input_ids": t, "labels": g.integers(0, 5, len(t)).tolist()} for t in text]
        return model, rows, DataCollatorForTokenClassification(Pad())
    if name == "question_answering":
        model = BertForQuestionAnswering(BertConfig(**BERT))
        rows = [{"input_ids": t, "start_positions": 1, "end_positions": len(t) - 1} for t in text]
        return model, rows, DataCollatorWithPadding(Pad())
    if name == "seq2seq":
        config = T5Config(vocab_size=VOCAB, d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2,
                          decoder_start_token_id=0, pad_token_id=0, use_cache=False)  # fmt: skip
        model = T5ForConditionalGeneration(config)
        rows = [
            {"input_ids": t, "labels": g.integers(2, VOCAB, 2 + i % 4).tolist()} for i, t in enumerate(text)
        ]
        return model, rows, DataCollatorForSeq2Seq(Pad(), model=model)
    if name == "causal_lm":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, use_cache=False)  # fmt: skip
        return LlamaForCausalLM(config), [{"input_ids": t} for t in text], CausalLMCollator(0)
    raise ValueError(name)


class ModelEngine:
    """The engine members the evaluation loop uses, over a model in this process: its objective's
    ``eval_sum`` on the model, as ``DeepSpeedEngine.eval_step`` runs it on DeepSpeed's engine."""

    device = torch.device("cpu")
    mesh = Mesh(world_size=1)  # no tensor-parallel group: its rows count

    def __init__(self, model: torch.nn.Module, label_names: list[str] | None = None) -> None:
        self.module, self.objective = model, objective_for(model, label_names=label_names)
        self.forwards = 0

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    @torch.no_grad()
    def eval_step(self, batch, outputs=False):
        self.forwards += 1
        loss, count, out = self.objective.eval_sum(Tokens(self.module), batch)
        return loss, count, out if outputs else None


def ours(model, rows, collator, rank=0, world=1, label_names=None, prefix="test", **options):
    engine = ModelEngine(model, label_names)
    batches = eval_batches(rows, collator, BATCH, rank, world)
    return evaluation_loop(engine, batches, len(rows), prefix, Predictions(**options))


def on_rank_zero_of_two(monkeypatch, run):
    """``run(rank, world)`` as rank 0 of a 2-rank world: rank 1 runs first, recording what its
    collectives send; rank 0's then receive it, in the same order."""
    sent: list[Any] = []
    sums: list[torch.Tensor] = []
    monkeypatch.setattr(trainer.loop.predictions, "all_gather_object", lambda obj: sent.append(obj) or [obj])
    monkeypatch.setattr(trainer.loop.evaluation, "all_reduce_sum", lambda t: sums.append(t.clone()) or t)
    run(1, 2)
    sent_by_one, sums_by_one = iter(sent), iter(sums)
    monkeypatch.setattr(trainer.loop.predictions, "all_gather_object", lambda obj: [obj, next(sent_by_one)])
    monkeypatch.setattr(trainer.loop.evaluation, "all_reduce_sum", lambda t: t + next(sums_by_one))
    return run(0, 2)


def hf_predict(
    tmp_path, model, rows, collator, ignore_keys=None, compute_metrics=None, preprocess=None, **args
):
    hf_args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True, per_device_eval_batch_size=BATCH,
        disable_tqdm=True, **args,
    )  # fmt: skip
    hf = transformers.Trainer(
        model, hf_args, data_collator=collator, compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess,
    )  # fmt: skip
    return hf.predict(rows, ignore_keys=ignore_keys)


def assert_same(a: Any, b: Any, path: str = "", up_to_padding: bool = False) -> None:
    """Equal structures of equal shapes and dtypes, values within float tolerance. ``up_to_padding``:
    a row batched with longer rows has outputs past its end where the other has -100 (the
    positions a model computes over padding)."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]", up_to_padding)
    elif isinstance(a, tuple | list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]", up_to_padding)
    else:
        assert (a.shape, a.dtype) == (b.shape, b.dtype), (path, a.shape, b.shape, a.dtype, b.dtype)
        if up_to_padding:
            both = (a != -100) & (b != -100)
            a, b = a[both], b[both]
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=path)


# ---- every structure, as HF's Trainer.predict gives it ------------------------------------------

STRUCTURES = ["classification", "regression", "token_classification", "question_answering", "seq2seq",
              "causal_lm"]  # fmt: skip
SHAPES = {  # HF's predictions and labels for 7 rows in batches of 3
    "classification": ((7, 3), (7,)),
    "regression": ((7, 1), (7,)),
    "token_classification": ((7, 11, 5), (7, 11)),
    "question_answering": (((7, 11), (7, 11)), ((7,), (7,))),
    "seq2seq": (((7, 5, VOCAB), (7, 11, 16)), (7, 5)),
    "causal_lm": ((7, 11, VOCAB), (7, 11)),
}


def shapes(value: Any) -> Any:
    return tuple(shapes(v) for v in value) if isinstance(value, tuple) else np.shape(value)


@pytest.mark.parametrize("name", STRUCTURES)
def test_predictions_and_labels_of_every_structure_are_hfs(tmp_path, monkeypatch, name):
    model, rows, collator = task(name)
    hf = hf_predict(tmp_path, model, rows, collator)
    one = ours(model, rows, collator)
    assert (shapes(one.predictions), shapes(one.label_ids)) == SHAPES[name]
    assert_same(one.predictions, hf.predictions)
    assert_same(one.label_ids, hf.label_ids)
    if name != "causal_lm":  # a causal LM's loss is token-weighted here (HF: the mean of batch means)
        assert one.metrics["test_loss"] == pytest.approx(hf.metrics["test_loss"], rel=1e-5)
    # Two ranks: each forwards every other row, rank 1's shard ends in a padding row; rank 0 gets
    # the same rows back, in dataset order, padded to the longest of both ranks.
    two = on_rank_zero_of_two(monkeypatch, lambda rank, world: ours(model, rows, collator, rank, world))
    assert_same(two.predictions, hf.predictions, up_to_padding=True)
    assert_same(two.label_ids, hf.label_ids)


def test_nested_dicts_and_lists_from_preprocess_are_gathered_as_hf_gathers_them(tmp_path, monkeypatch):
    model, rows, collator = task("token_classification")

    def preprocess(logits, labels):
        return {"ids": logits.argmax(-1), "parts": [logits[..., :2], (logits.mean(-1), labels)]}

    hf = hf_predict(tmp_path, model, rows, collator, preprocess=preprocess)
    one = ours(model, rows, collator, preprocess=preprocess)
    assert isinstance(one.predictions, dict) and one.predictions["ids"].dtype == np.int64
    assert one.predictions["parts"][0].shape == (7, 11, 2)
    assert_same(one.predictions, hf.predictions)
    two = on_rank_zero_of_two(
        monkeypatch, lambda rank, world: ours(model, rows, collator, rank, world, preprocess=preprocess)
    )
    assert_same(two.predictions, hf.predictions, up_to_padding=True)


@pytest.mark.parametrize("name", ["classification", "causal_lm"])
def test_a_set_without_labels_has_predictions_and_no_loss(tmp_path, name):
    model, rows, _ = task(name)
    unlabelled = [{"input_ids": r["input_ids"]} for r in rows]
    collator = DataCollatorWithPadding(Pad())
    hf = hf_predict(tmp_path, model, unlabelled, collator)
    one = ours(model, unlabelled, collator, compute_metrics=lambda p: pytest.fail("no labels: no metrics"))
    assert hf.label_ids is None and one.label_ids is None
    assert "test_loss" not in hf.metrics and one.metrics == {}
    assert_same(one.predictions, hf.predictions)


def test_without_labels_a_compute_loss_override_is_not_called():
    model, rows, collator = task("classification")

    def compute_loss(*args, **kwargs):
        raise AssertionError("called without labels")

    objective = objective_for(model, compute_loss=compute_loss)
    batch = collator([{"input_ids": r["input_ids"]} for r in rows[:2]])
    loss, count, outputs = objective.eval_sum(Tokens(model), batch)
    assert (float(loss), float(count), outputs.logits.shape) == (0.0, 0.0, (2, 3))


def test_a_compute_loss_override_that_pops_the_labels_evaluates_the_builtin_loss():
    """HF's documented override pops ``labels`` from its inputs; the batch's count must not change."""
    model, rows, collator = task("classification")

    def popping(model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = torch.nn.functional.cross_entropy(outputs.logits, labels, reduction="sum")
        loss = loss / (num_items_in_batch or len(labels))
        return (loss, outputs) if return_outputs else loss

    batch = collator(rows[:3])
    model.eval()
    with torch.no_grad():
        builtin = objective_for(model).eval_sum(Tokens(model), dict(batch))
        override = objective_for(model, compute_loss=popping).eval_sum(Tokens(model), batch)
    assert "labels" in batch and float(override[1]) == float(builtin[1]) == 3.0
    assert float(override[0]) == pytest.approx(float(builtin[0]), rel=1e-6)


# ---- label_names and ignore_keys ---------------------------------------------------------------


def test_label_names_choose_the_labels_as_hfs_do(tmp_path):
    model, rows, collator = task("question_answering")
    start_only = hf_predict(tmp_path, model, rows, collator, label_names=["start_positions"])
    one = ours(model, rows, collator, label_names=["start_positions"])
    assert one.label_ids.shape == (7,) and one.label_ids.tolist() == [1] * 7
    assert_same(one.label_ids, start_only.label_ids)
    missing = hf_predict(tmp_path, model, rows, collator, label_names=["answer"])
    none = ours(model, rows, collator, label_names=["answer"])
    assert missing.label_ids is None and none.label_ids is None  # named labels absent: no labels
    assert "test_loss" not in missing.metrics and "test_loss" not in none.metrics
    # HF's keeps the loss the model still computed (from start/end positions) as a prediction, one
    # per batch; here a loss is never a prediction.
    assert missing.predictions[0].shape == (3,)
    assert_same(none.predictions, missing.predictions[1:])


def test_ignore_keys_and_the_configs_keys_to_ignore_at_inference_leave_outputs_out(tmp_path):
    model, rows, collator = task("seq2seq")
    hf = hf_predict(tmp_path, model, rows, collator, ignore_keys=["encoder_last_hidden_state"])
    one = ours(model, rows, collator, ignore_keys=("encoder_last_hidden_state",))
    assert isinstance(one.predictions, np.ndarray) and one.predictions.shape == (7, 5, VOCAB)
    assert_same(one.predictions, hf.predictions)
    model.config.keys_to_ignore_at_inference = ["encoder_last_hidden_state"]
    assert_same(ours(model, rows, collator).predictions, hf.predictions)


def test_an_output_without_a_row_per_sample_is_refused_naming_it():
    model, rows, collator = task("classification")
    with pytest.raises(ValueError, match=r"an evaluation output\[1\] has shape \(\), not one row per sample"):
        ours(model, rows, collator, preprocess=lambda logits, labels: (logits, logits.mean()))


# ---- include_for_metrics, batch_eval_metrics, eval_accumulation_steps ------------------------------


class Recorder:
    """A compute_metrics that keeps what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, bool | None]] = []

    def __call__(self, p, compute_result=None):
        self.calls.append((p, compute_result))
        return {"calls": len(self.calls)}


def numpy_of(value: Any) -> Any:
    return value.numpy() if isinstance(value, torch.Tensor) else value


def test_include_for_metrics_gives_the_inputs_and_each_rows_batch_loss_as_hf(tmp_path, monkeypatch):
    model, rows, collator = task("token_classification")
    theirs, mine = Recorder(), Recorder()
    hf_predict(
        tmp_path, model, rows, collator, compute_metrics=theirs, include_for_metrics=["inputs", "loss"]
    )
    ours(model, rows, collator, compute_metrics=mine, include=("inputs", "loss"))
    (hf, _), (p, _) = theirs.calls[0], mine.calls[0]
    # Row 0 (3 ids) came in a batch 9 wide (the collator's padding), then HF's -100 up to 11.
    assert p.inputs.shape == (7, 11) and p.inputs[0, 3:].tolist() == [0] * 6 + [-100] * 2
    assert_same(p.inputs, hf.inputs)
    assert p.losses.shape == (7,) and len(set(p.losses[:3].tolist())) == 1  # a batch shares its loss
    assert_same(p.losses, hf.losses)
    assert len(list(p)) == len(list(hf)) == 4  # predictions, labels, inputs, losses
    two = Recorder()
    on_rank_zero_of_two(
        monkeypatch,
        lambda rank, world: ours(
            model, rows, collator, rank, world, compute_metrics=two, include=("inputs",)
        ),
    )
    assert_same(two.calls[-1][0].inputs, hf.inputs, up_to_padding=True)


def test_batch_eval_metrics_sees_each_batch_then_computes_the_result_as_hf(tmp_path, monkeypatch):
    model, rows, collator = task("token_classification")
    theirs, mine = Recorder(), Recorder()
    hf = hf_predict(tmp_path, model, rows, collator, compute_metrics=theirs, batch_eval_metrics=True,
                    include_for_metrics=["loss"])  # fmt: skip
    one = ours(model, rows, collator, compute_metrics=mine, per_batch=True, include=("loss",))
    assert [r for _, r in mine.calls] == [r for _, r in theirs.calls] == [False, False, True]
    for (p, _), (h, _) in zip(mine.calls, theirs.calls, strict=True):
        assert isinstance(p.predictions, torch.Tensor) and isinstance(p.label_ids, torch.Tensor)
        for ours_value, hfs in (
            (p.predictions, h.predictions),
            (p.label_ids, h.label_ids),
            (p.losses, h.losses),
        ):
            assert_same(numpy_of(ours_value), numpy_of(hfs))
    assert one.metrics["test_calls"] == hf.metrics["test_calls"] == 3  # the last call's result
    assert_same(one.predictions, hf.predictions)  # predict keeps the predictions
    held: list[int] = []
    add = RowStore.add
    monkeypatch.setattr(
        RowStore, "add", lambda store, part: held.append(len(part["index"])) or add(store, part)
    )
    kept = ours(model, rows, collator, compute_metrics=Recorder(), per_batch=True, returned=False)
    assert kept.predictions is None and kept.label_ids is None and held == []  # evaluate: never held
    # Two ranks: each step's rows of both ranks, in dataset order; every row once.
    two = Recorder()
    on_rank_zero_of_two(
        monkeypatch,
        lambda rank, world: ours(model, rows, collator, rank, world, compute_metrics=two, per_batch=True),
    )
    rank0 = two.calls[len(two.calls) // 2 :]
    assert [r for _, r in rank0] == [False, True]  # 4 rows per rank: batches of 3 and 1
    assert [len(p.label_ids) for p, _ in rank0] == [6, 1]
    labels = [p.label_ids[i, : LENGTHS[6 * s + i]].tolist() for s, (p, _) in enumerate(rank0)
              for i in range(len(p.label_ids))]  # fmt: skip
    assert labels == [r["labels"] for r in rows]


def test_eval_accumulation_steps_moves_predictions_to_the_host_every_n_batches(monkeypatch):
    model, rows, collator = task("token_classification")
    rows = rows * 2  # 5 batches of 3, 3, 3, 3, 2
    moved: list[int] = []  # batches on the device at each move to the host
    to_host = RowStore.to_host

    def recording(store):
        moved.append(len(store.on_device))
        to_host(store)

    monkeypatch.setattr(RowStore, "to_host", recording)
    every_two = ours(model, rows, collator, accumulation_steps=2)
    assert moved == [2, 2, 1]
    moved.clear()
    at_the_end = ours(model, rows, collator)
    assert moved == [5]  # HF's default: on the device until the end
    assert_same(every_two.predictions, at_the_end.predictions)
    assert_same(every_two.label_ids, at_the_end.label_ids)


def test_prediction_loss_only_gathers_nothing():
    model, rows, collator = task("classification")
    engine = ModelEngine(model)
    out = evaluation_loop(engine, eval_batches(rows, collator, BATCH, 0, 1), len(rows), "eval", None)
    assert (out.predictions, out.label_ids, set(out.metrics)) == (None, None, {"eval_loss"})


# ---- concatenation ------------------------------------------------------------------------------


def test_concat_pads_as_hfs_nested_concat():
    g = np.random.default_rng(1)
    parts = [
        (
            g.normal(size=(2, w, 3)).astype(np.float32),
            {"ids": g.integers(0, 9, (2, w)), "y": g.normal(size=2)},
        )
        for w in (4, 7, 5)
    ]
    theirs = parts[0]
    for part in parts[1:]:
        theirs = nested_concat(theirs, part, padding_index=-100)
    assert_same(concat(parts), theirs)


def test_a_tuple_output_loses_its_loss_as_hfs_does(tmp_path):
    """A model returning tuples (``return_dict=False``) puts its loss first; HF's drops it."""
    model, rows, collator = task("classification")
    model.config.return_dict = False
    hf = hf_predict(tmp_path, model, rows, collator)
    one = ours(model, rows, collator)
    assert one.predictions.shape == (7, 3)
    assert_same(one.predictions, hf.predictions)
