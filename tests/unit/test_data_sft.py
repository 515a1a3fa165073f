"""Instruction formats: each format's rows as token ids and labels, checked token by token on a real
locally trained tokenizer; every assistant turn of a chat trained, nothing else."""

from __future__ import annotations

import pytest

from tests.helpers.sft_data import (
    SYSTEM,
    TURNS,
    messages_of,
    plain,
    sft_args,
    sharegpt_row,
    trained_runs,
)
from tests.helpers.sft_data import tokenizer as make_tokenizer
from trainer.args import DataArguments, ModelArguments
from trainer.data import (
    DEFAULT_CHAT_TEMPLATE,
    IGNORE_INDEX,
    DataError,
    SFTCollator,
    build_datasets,
    get_tokenizer,
    prepare_datasets,
)

ROWS = [
    {"prompt": "Write a function that adds two numbers.\n", "response": "def add(a, b):\n    return a + b\n"},
    {"prompt": "What does len([1, 2]) return?\n", "response": "It returns 2."},
    {"prompt": "Reverse a string s.\n", "response": "s[::-1]"},
]
# ChatML, as the tokenizer of a chat model carries it (its markers are special tokens there).
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def rendered(tok, messages) -> str:
    """The default template's rendering, as a row holds it: up to the last answer's end marker."""
    return tok.apply_chat_template(messages, chat_template=DEFAULT_CHAT_TEMPLATE, tokenize=False).rstrip("\n")


def answers(tok, turns=TURNS, end=None) -> list[list[int]]:
    """What each assistant turn should train: its content as plain text, then the end marker."""
    return [plain(tok, a) + [tok.eos_token_id if end is None else end] for _, a in turns]


# ---- verbatim pairs --------------------------------------------------------------------------------


@pytest.mark.parametrize("second", ["response", "completion"])
def test_prompt_pairs_are_verbatim_and_train_the_answer_and_eos(tmp_path, tok, second):
    rows = [{"prompt": r["prompt"], second: r["response"]} for r in ROWS]
    train, _ = build_datasets(sft_args(tmp_path, rows), tok, seed=0)
    assert sorted(train.column_names) == ["input_ids", "labels"]
    for source, row in zip(ROWS, train, strict=True):
        prompt_ids = plain(tok, source["prompt"])
        n = len(prompt_ids)
        assert row["input_ids"][:n] == prompt_ids
        assert row["labels"][:n] == [IGNORE_INDEX] * n
        assert trained_runs(row) == [plain(tok, source["response"]) + [tok.eos_token_id]]
        assert tok.decode(row["input_ids"]) == source["prompt"] + source["response"] + "<|eos|>"


# ---- chats -----------------------------------------------------------------------------------------


def test_sharegpt_trains_every_assistant_turn_and_nothing_else(tmp_path, tok):
    assert tok.chat_template is None  # so the default template applies
    train, _ = build_datasets(sft_args(tmp_path, [sharegpt_row()]), tok, seed=0)
    row = train[0]
    assert tok.decode(row["input_ids"]) == rendered(tok, messages_of())
    assert tok.decode(row["input_ids"]).startswith(
        f"<|system|>\n{SYSTEM}<|eos|>\n<|user|>\nSquare x.<|eos|>\n"
    )
    assert trained_runs(row) == answers(tok)
    # The EOS an answer spells is text; the template's EOS ends each of the 7 messages.
    assert row["input_ids"].count(tok.eos_token_id) == 7
    assert tok.decode([t for t in row["labels"] if t != IGNORE_INDEX]) == "".join(
        f"{a}<|eos|>" for _, a in TURNS
    )
    # The turn's trailing newline and the next turn's header are not trained.
    first_end = row["labels"].index(tok.eos_token_id)
    assert row["labels"][first_end + 1] == IGNORE_INDEX


def test_sharegpt_speaker_names_user_and_assistant_and_messages_rows_give_the_same_tokens(tmp_path, tok):
    reference = build_datasets(sft_args(tmp_path / "a", [sharegpt_row()]), tok, seed=0)[0][0]
    renamed = sharegpt_row()
    for m in renamed["conversations"]:
        m["from"] = {"human": "user", "gpt": "assistant"}.get(m["from"], m["from"])
    assert build_datasets(sft_args(tmp_path / "b", [renamed]), tok, seed=0)[0][0] == reference
    messages = build_datasets(sft_args(tmp_path / "c", [{"messages": messages_of()}]), tok, seed=0)[0][0]
    assert messages == reference


def test_alpaca_rows_ask_the_instruction_and_its_input(tmp_path, tok):
    rows = [
        {"instruction": "Reverse a string s.", "input": "s = 'abc'", "output": "s[::-1]"},
        {"instruction": "Square x.", "input": "", "output": "x ** 2"},
        {"instruction": "And the cube?", "output": "x ** 3"},  # no input at all
    ]
    train, _ = build_datasets(sft_args(tmp_path, rows), tok, seed=0)
    users = ["Reverse a string s.\n\ns = 'abc'", "Square x.", "And the cube?"]
    for source, user, row in zip(rows, users, train, strict=True):
        chat = [{"role": "user", "content": user}, {"role": "assistant", "content": source["output"]}]
        assert tok.decode(row["input_ids"]) == rendered(tok, chat)
        assert trained_runs(row) == [plain(tok, source["output"]) + [tok.eos_token_id]]


def test_a_tokenizer_chat_template_is_used_and_its_end_marker_trained(tmp_path):
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    train, _ = build_datasets(sft_args(tmp_path, [{"messages": messages_of()}]), tok, seed=0)
    row = train[0]
    assert tok.decode(row["input_ids"]) == tok.apply_chat_template(messages_of(), tokenize=False).rstrip("\n")
    # The template's markers are single special tokens; the content's '<|eos|>' stays text.
    assert row["input_ids"].count(start) == row["input_ids"].count(end) == 7
    assert row["input_ids"][-1] == end  # the row ends with the last answer's end marker
    assert tok.eos_token_id not in row["input_ids"]
    assert trained_runs(row) == answers(tok, end=end)


def test_conversational_prompt_completion_trains_only_the_completion(tmp_path, tok):
    example = [{"role": "user", "content": "Square x."}, {"role": "assistant", "content": "x ** 2"}]
    prompt = [{"role": "system", "content": SYSTEM}, *example, {"role": "user", "content": "And the cube?"}]
    completion = [{"role": "assistant", "content": "x ** 3"}]
    rows = [{"prompt": prompt, "completion": completion}]
    train, _ = build_datasets(sft_args(tmp_path, rows, data_format="prompt_completion"), tok, seed=0)
    assert tok.decode(train[0]["input_ids"]) == rendered(tok, prompt + completion)
    assert trained_runs(train[0]) == [plain(tok, "x ** 3") + [tok.eos_token_id]]


def test_a_row_ends_with_its_last_answer(tmp_path, tok):
    """What follows the last answer carries no loss, and nothing attends to it."""
    chat = sharegpt_row(TURNS[:1])
    chat["conversations"].append({"from": "human", "value": "Thanks."})
    train, _ = build_datasets(sft_args(tmp_path, [chat, sharegpt_row(TURNS[:1])]), tok, seed=0)
    assert train[0] == train[1]
    assert train[0]["input_ids"][-1] == train[0]["labels"][-1] == tok.eos_token_id


def test_an_assistant_message_that_opens_a_chat_is_context(tmp_path, tok):
    chat = [{"from": "gpt", "value": "Hello."}, *sharegpt_row(TURNS[:1], system=None)["conversations"]]
    train, _ = build_datasets(sft_args(tmp_path, [{"conversations": chat}]), tok, seed=0)
    assert trained_runs(train[0]) == answers(tok, TURNS[:1])


def test_sft_batch_pads_with_minus_100_and_keeps_row_labels(tmp_path, tok):
    train, _ = build_datasets(sft_args(tmp_path, ROWS), tok, seed=0)
    rows = [train[0], train[2]]
    batch = SFTCollator(tok.pad_token_id)(rows)
    width = max(len(r["input_ids"]) for r in rows)
    assert batch["labels"].shape == (2, width)
    short = len(rows[1]["input_ids"])
    assert batch["labels"][1, :short].tolist() == rows[1]["labels"]
    assert batch["labels"][1, short:].tolist() == [IGNORE_INDEX] * (width - short)
    assert batch["input_ids"][1, short:].tolist() == [tok.pad_token_id] * (width - short)


# ---- telling the format ---------------------------------------------------------------------------

FORMAT_ROWS = {
    "alpaca": {"instruction": "Square x.", "input": "", "output": "x ** 2"},
    "sharegpt": sharegpt_row(TURNS[:1]),
    "messages": {"messages": messages_of(TURNS[:1])},
    "prompt_completion": {"prompt": "Square x.\n", "completion": "x ** 2"},
    "prompt_response": {"prompt": "Square x.\n", "response": "x ** 2"},
}


@pytest.mark.parametrize("fmt", sorted(FORMAT_ROWS))
def test_sft_tells_each_format_from_its_columns_and_matches_naming_it(tmp_path, tok, fmt):
    told = prepare_datasets(sft_args(tmp_path / "told", [FORMAT_ROWS[fmt]] * 2), tok, seed=0)
    named = prepare_datasets(
        sft_args(tmp_path / "named", [FORMAT_ROWS[fmt]] * 2, data_format=fmt), tok, seed=0
    )
    assert (told.info["data_format"], told.info["format"], named.info["format"]) == ("sft", fmt, fmt)
    assert told.train["labels"] == named.train["labels"]
    assert told.train["input_ids"] == named.train["input_ids"]


KNOWN = (
    "Known formats: alpaca (instruction, output, optional input); sharegpt (conversations); "
    "messages (messages); prompt_completion (prompt, completion); prompt_response (prompt, response); "
    "text (text; data_format: text)"
)


def test_columns_that_fit_no_format_or_two_are_one_error(tmp_path, tok):
    args = sft_args(tmp_path, [{"question": "Square x.", "answer": "x ** 2"}])
    with pytest.raises(DataError) as err:
        build_datasets(args, tok, seed=0)
    assert str(err.value) == (
        f"data_format: sft: cannot tell the format of {args.dataset} from its columns (question, answer): "
        f"no instruction format fits them. {KNOWN}"
    )
    both = {**FORMAT_ROWS["messages"], **FORMAT_ROWS["prompt_completion"]}
    args = sft_args(tmp_path, [both])
    with pytest.raises(DataError) as err:
        build_datasets(args, tok, seed=0)
    assert str(err.value) == (
        f"data_format: sft: cannot tell the format of {args.dataset} from its columns "
        f"(messages, prompt, completion): they fit messages and prompt_completion, name one. {KNOWN}"
    )
    assert len(err.value.problems) == 1


def test_a_named_format_needs_its_columns(tmp_path, tok):
    args = sft_args(tmp_path, [sharegpt_row()], data_format="alpaca")
    with pytest.raises(DataError) as err:
        build_datasets(args, tok, seed=0)
    assert str(err.value) == (
        f"data_format: column 'instruction' not found in {args.dataset} (columns: conversations)"
    )


def test_rows_that_cannot_be_read_are_named_by_index_one_line_each(tmp_path, tok):
    rows = [
        sharegpt_row(),
        {"conversations": [{"from": "human", "value": "Hi."}, {"from": "bot", "value": "Hello."}]},
        sharegpt_row(),
        {"conversations": [{"from": "human", "value": "Hi."}]},
        {"conversations": [{"from": "human", "value": "Hi."}, {"from": "gpt"}]},
        {"conversations": []},
    ]
    with pytest.raises(DataError) as err:
        build_datasets(sft_args(tmp_path, rows), tok, seed=0)
    assert err.value.problems == [
        (
            "dataset",
            "row 1: conversations[1]: unknown role 'bot' (known: human, user, gpt, assistant, system)",
        ),
        ("dataset", "row 3: no assistant message to train on (one that follows a prompt)"),
        ("dataset", "row 4: conversations[1].value is missing"),
        ("dataset", "row 5: conversations is empty"),
    ]
    alpaca = [{"instruction": "Square x.", "output": "x ** 2"}, {"instruction": "Cube x."}]
    with pytest.raises(DataError, match=r"^dataset: row 1: output is missing$"):
        build_datasets(sft_args(tmp_path, alpaca, name="alpaca.jsonl"), tok, seed=0)


def test_past_ten_rows_with_a_problem_the_rest_are_counted(tmp_path, tok):
    rows = [{"prompt": f"q{i}", "completion": None} for i in range(13)]
    with pytest.raises(DataError) as err:
        build_datasets(sft_args(tmp_path, rows), tok, seed=0)
    lines = str(err.value).splitlines()
    assert lines[0] == "dataset: row 0: completion is missing"
    assert lines[9] == "dataset: row 9: completion is missing"
    assert lines[10:] == ["dataset: and 3 more rows with a problem"]


# ---- the tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_trained_on_instruction_data_reads_its_fields_and_gets_the_default_template(tmp_path):
    rows = [*ROWS, {"prompt": "zqzqzq " * 50, "response": "wkwkwk " * 50}]
    tok = get_tokenizer(ModelArguments(vocab_size=300), sft_args(tmp_path, rows))
    # Frequent strings from both columns became single tokens.
    assert len(tok("zqzqzq")["input_ids"]) < 3 and len(tok("wkwkwk")["input_ids"]) < 3
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE  # saved with the model, for inference
    chat = sharegpt_row([("vbvbvb " * 50, "ok")], system=None)
    tok = get_tokenizer(ModelArguments(vocab_size=300), sft_args(tmp_path / "s", [chat]))
    assert len(tok("vbvbvb")["input_ids"]) < 3
    assert len(tok("<|user|>\n")["input_ids"]) <= 4  # the template's markers were seen too
    alpaca = [{"instruction": "jxjxjx " * 50, "output": "ok"}]
    tok = get_tokenizer(ModelArguments(vocab_size=300), sft_args(tmp_path / "a", alpaca))
    assert len(tok("jxjxjx")["input_ids"]) < 3


def test_text_and_verbatim_pairs_keep_a_tokenizer_without_template(tmp_path, tok):
    tok.save_pretrained(tmp_path / "tok")
    named = ModelArguments(tokenizer_name_or_path=str(tmp_path / "tok"))
    assert get_tokenizer(named, DataArguments()).chat_template is None
    assert get_tokenizer(named, DataArguments(data_format="prompt_response")).chat_template is None
    assert get_tokenizer(named, DataArguments(data_format="sharegpt")).chat_template == DEFAULT_CHAT_TEMPLATE
