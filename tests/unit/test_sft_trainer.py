"""Supervised fine-tuning: ``from trainer import SFTConfig, SFTTrainer`` against TRL's ``SFTTrainer``,
step by step, and TRL's data rules piece by piece (the same rows give the same tokens, labels and
packed rows), and the arguments' refusals.

The training runs happen in one child process (tests/helpers/sft_scenarios.py, plain python, one
rank), TRL's and ours on the same tiny Llama, tokenizer, rows, order and seed.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import datasets
import pytest
import torch

from tests.helpers.launch import launch
from tests.helpers.preference_scenarios import tokenizer
from tests.helpers.sft_scenarios import EVAL_METRICS, MARKED_TEMPLATE, METRICS, SCENARIOS, rows
from trainer import SFTConfig, SFTTrainer, TrainingArguments
from trainer.config.errors import ConfigError
from trainer.data import DEFAULT_CHAT_TEMPLATE, IGNORE_INDEX
from trainer.data.sft import best_fit_decreasing, prepare_sft

SCRIPT = "tests/helpers/sft_scenarios.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    launch([SCRIPT, str(out), *SCENARIOS], launcher="python", timeout=900)
    return {name: json.loads((out / f"{name}.json").read_text()) for name in SCENARIOS}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_step_matches_trls_sft_trainer(results, name):
    """Loss, grad norm, entropy and token accuracy at every one of 4 steps, then the evaluation:
    text, prompt-completion and conversations; packed (bfd, bfd_split, wrapped) and not;
    assistant-only and completion-only losses; two accumulated micro-batches; dft; LoRA; a mixture of
    experts with its router loss."""
    ours, trl = results[name]["ours"], results[name]["trl"]
    metrics = (*METRICS, "aux_loss") if name == "mixture_of_experts" else METRICS  # the router's loss
    assert set(trl) == set(metrics) and set(ours) == set(metrics)
    for key in metrics:
        assert len(trl[key]) == 4, key
        assert ours[key] == pytest.approx(trl[key], rel=1e-5, abs=1e-6), key
    assert trl["loss"][3] != trl["loss"][0]
    # The trained model's evaluation of 12 other rows: HF's loss weighting and TRL's metrics
    assert set(results[name]["trl_eval"]) == set(EVAL_METRICS)
    assert results[name]["ours_eval"] == pytest.approx(results[name]["trl_eval"], rel=1e-5, abs=1e-6)


def test_packing_fills_fewer_rows_with_the_same_tokens(results):
    plain, packed = results["text"], results["text_packed"]
    assert packed["tokens"] == plain["tokens"] and packed["rows"] < plain["rows"]


# ---- TRL's data rules, piece by piece ---------------------------------------------------------


def trl_prepared(data, tok, packing=False, formatting_func=None, **fields):
    """TRL's own preparation of ``data`` (its SFTTrainer's, called on a stand-in trainer)."""
    from trl import SFTConfig as TRLConfig
    from trl import SFTTrainer as TRLTrainer

    args = TRLConfig(output_dir="unused", use_cpu=True, report_to="none", **fields)
    sample = data[0]
    completion_only = fields.get("completion_only_loss")
    if completion_only is None:
        completion_only = "prompt" in sample and "completion" in sample
    trainer = SimpleNamespace(_tokenizer=tok, completion_only_loss=completion_only, chat_template=None)
    return TRLTrainer._prepare_dataset(trainer, data, tok, args, packing, formatting_func, "train")


def ours_prepared(data, tok, packing=False, formatting_func=None, **fields):
    args = SFTConfig(output_dir="unused", **fields)
    sample = data[0]
    completion_only = args.completion_only_loss
    if completion_only is None:
        completion_only = "prompt" in sample and "completion" in sample
    return prepare_sft(data, tok, args, "train", packing, completion_only, formatting_func)


def marked_tokenizer():
    tok = tokenizer()
    tok.chat_template = MARKED_TEMPLATE
    return tok


def sharegpt(n: int = 6) -> datasets.Dataset:
    rename = {"role": "from", "content": "value"}
    return datasets.Dataset.from_list(
        [
            {"conversations": [{rename[k]: v for k, v in m.items()} for m in r["messages"]]}
            for r in rows("messages", n)
        ]
    )


CASES = {
    "text": lambda: (rows("text"), {}),
    "text_cut": lambda: (rows("text"), {"max_length": 12}),
    "prompt_completion": lambda: (rows("prompt_completion"), {}),
    "prompt_completion_whole": lambda: (rows("prompt_completion"), {"completion_only_loss": False}),
    "messages": lambda: (rows("messages"), {}),
    "assistant_only": lambda: (rows("messages"), {"assistant_only_loss": True}),
    "sharegpt": lambda: (sharegpt(), {}),
    "pretokenised": lambda: (
        datasets.Dataset.from_list([{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10]}]),
        {},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rows_give_trls_tokens_and_labels(case):
    data, fields = CASES[case]()
    tok = marked_tokenizer()
    theirs = trl_prepared(data, tok, **fields)
    ours = ours_prepared(data, marked_tokenizer(), **fields)
    assert ours["input_ids"] == theirs["input_ids"]
    assert ours["labels"] == theirs["labels"]
    if case == "prompt_completion":  # the prompt is not trained on; the completion and its EOS are
        first = ours[0]
        assert first["labels"][0] == IGNORE_INDEX and first["labels"][-1] == tok.eos_token_id
    if case == "assistant_only":
        assert all(IGNORE_INDEX in labels for labels in ours["labels"])  # the user's turns are masked


def test_a_formatting_function_writes_the_text():
    data = rows("prompt_completion")
    fmt = lambda row: f"Q: {row['prompt']} A:{row['completion']}"  # noqa: E731
    theirs = trl_prepared(data, tokenizer(), formatting_func=fmt, completion_only_loss=False)
    ours = ours_prepared(data, tokenizer(), formatting_func=fmt, completion_only_loss=False)
    assert ours["input_ids"] == theirs["input_ids"] and ours["labels"] == theirs["labels"]


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_packed_rows_are_trls(strategy):
    """The same rows in the same packed rows, in the same order; bfd's positions restart at each
    sequence (TRL's seq_lengths), whose first token is no target (TRL's padding-free collator)."""
    rng = random.Random(0)
    ids = [[rng.randint(3, 200) for _ in range(rng.randint(1, 40))] for _ in range(300)]
    data = datasets.Dataset.from_list([{"input_ids": row} for row in ids])
    theirs = trl_prepared(data, tokenizer(), packing=True, packing_strategy=strategy, max_length=32)
    ours = ours_prepared(data, tokenizer(), packing=True, packing_strategy=strategy, max_length=32)
    assert ours["input_ids"] == theirs["input_ids"]
    if strategy == "wrapped":
        assert ours["labels"] == theirs["labels"] and "position_ids" not in ours.column_names
        return
    for row, their in zip(ours, theirs, strict=True):
        positions = [p for n in their["seq_lengths"] for p in range(n)]
        assert row["position_ids"] == positions
        expected = [IGNORE_INDEX if p == 0 else t for p, t in zip(positions, their["labels"], strict=True)]
        assert row["labels"] == expected


def test_best_fit_decreasing_places_each_length_where_it_fits_tightest():
    assert best_fit_decreasing([3, 5, 2, 5, 1], 6) == [[1, 4], [3], [0, 2]]
    assert best_fit_decreasing([4, 3, 1], 6) == [[0, 2], [1]]  # 1 goes where 2 are free, not 3
    rng = random.Random(0)
    lengths = [rng.randint(1, 16) for _ in range(300)]
    bins = best_fit_decreasing(lengths, 16)
    assert sorted(i for b in bins for i in b) == list(range(300))
    assert all(sum(lengths[i] for i in b) <= 16 for b in bins)
    assert len(bins) <= sum(lengths) // 16 + 2  # nearly full: no more than two rows to spare here


# ---- arguments and refusals -------------------------------------------------------------------


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(config), tok


def test_trls_defaults_and_names():
    args = SFTConfig(
        output_dir="x", pad_to_multiple_of="auto", loss_type="chunked_nll", packing_strategy="bfd-requeue"
    )
    assert (args.learning_rate, args.gradient_checkpointing, args.max_length) == (2e-5, True, 1024)
    assert (args.pad_to_multiple_of, args.loss_type, args.packing_strategy) == (None, "nll", "bfd_split")


@pytest.mark.parametrize(
    "fields, message",
    [({"packing": True, "max_length": None}, "packing, max_length: packing needs max_length"),
     ({"padding_free": True}, "padding_free, max_length: without packing"),
     ({"activation_offloading": True}, "activation_offloading=True: not supported"),
     ({"packing_stratgy": "bfd"}, "packing_stratgy: unknown key")],
)  # fmt: skip
def test_bad_fields_are_refused_by_name(fields, message):
    with pytest.raises(ConfigError) as err:
        SFTConfig(output_dir="x", **fields)
    assert message in str(err.value)


def test_a_training_arguments_keeps_its_values(tmp_path):
    model, tok = tiny_model()
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=3e-4, max_steps=1, report_to="none")
    trainer = SFTTrainer(model, args=args, train_dataset=rows("text", 4), processing_class=tok)
    assert isinstance(trainer.args, SFTConfig)
    assert (trainer.args.learning_rate, trainer.args.max_steps, trainer.args.gradient_checkpointing) == (
        3e-4,
        1,
        False,
    )


UNMARKED = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@pytest.mark.parametrize(
    "data, fields, setup, message",
    [("text", {"assistant_only_loss": True}, {}, "assistant_only_loss: the train set is not conversational"),
     ("messages", {"assistant_only_loss": True}, {"template": UNMARKED}, "the chat template has no {% generation %}"),
     ("messages", {}, {"template": None}, "SFTTrainer: the rows are conversations and the tokenizer has no chat template"),
     ("text", {"chat_template_path": "template.txt"}, {}, "chat_template_path: template.txt is not a .jinja"),
     ("text", {}, {"compute_loss_func": lambda *a, **k: 0}, "compute_loss_func is not supported"),
     ("text", {"eos_token": "<nope>"}, {}, "eos_token: '<nope>' is not in the tokenizer's vocabulary")],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused_before_training(tmp_path, data, fields, setup, message):
    model, tok = tiny_model()
    tok.chat_template = setup.pop("template", MARKED_TEMPLATE)
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", **fields)
    with pytest.raises((ValueError, TypeError)) as err:
        SFTTrainer(model, args=args, train_dataset=rows(data, 4), processing_class=tok, **setup)
    assert message in str(err.value)


def test_the_projects_own_template_trains_the_assistants_content_and_eos(tmp_path):
    """DEFAULT_CHAT_TEMPLATE (what a tokenizer trained here carries) marks the assistant's turns."""
    model, tok = tiny_model()
    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", assistant_only_loss=True)
    data = rows("messages", 4)
    trainer = SFTTrainer(model, args=args, train_dataset=data, processing_class=tok)
    for row, prepared in zip(data, trainer.train_dataset, strict=True):
        trained = [
            t
            for t, label in zip(prepared["input_ids"], prepared["labels"], strict=True)
            if label != IGNORE_INDEX
        ]
        turns = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        expected = "".join(f"{turn}{tok.eos_token}" for turn in turns)
        assert tok.decode(trained) == tok.decode(
            tok(expected)["input_ids"]
        )  # the tiny vocabulary's <unk>s too


def test_a_row_without_assistant_tokens_is_named(tmp_path):
    model, tok = tiny_model()
    tok.chat_template = MARKED_TEMPLATE
    data = rows("messages", 4).to_list()
    data[2] = {"messages": [{"role": "user", "content": "Hello?"}]}
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", assistant_only_loss=True)
    with pytest.raises(ValueError, match="the train set's row 2: assistant_only_loss is set"):
        SFTTrainer(model, args=args, train_dataset=datasets.Dataset.from_list(data), processing_class=tok)


def test_a_jinja_template_file_replaces_the_tokenizers(tmp_path):
    model, tok = tiny_model()
    path = tmp_path / "chat.jinja"
    path.write_text(MARKED_TEMPLATE)
    args = SFTConfig(output_dir=str(tmp_path / "out"), report_to="none", chat_template_path=str(path),
                     assistant_only_loss=True)  # fmt: skip
    trainer = SFTTrainer(model, args=args, train_dataset=rows("messages", 4), processing_class=tok)
    assert trainer.processing_class.chat_template == MARKED_TEMPLATE
    labels = torch.tensor(trainer.train_dataset[0]["labels"])
    assert (labels == IGNORE_INDEX).any() and (labels != IGNORE_INDEX).any()
