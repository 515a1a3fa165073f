"""Rendering instruction rows into token ids and loss labels.

A :class:`~trainer.data.formats.Chat` is rendered with the tokenizer's chat template, or with
:data:`DEFAULT_CHAT_TEMPLATE` when the tokenizer has none. The rendering is cut into segments by
rendering the conversation one message at a time: each message adds a suffix to the text so far,
and an assistant message is rendered twice, once as the generation prompt (``add_generation_prompt``)
and once complete, so its content and end marker sit alone in one segment. Each segment is
tokenised on its own, so the labels cover exactly the assistant tokens: the content of every
trained assistant message and the end marker the template writes after it (whitespace after the
marker is not trained). Message contents are tokenised as plain text (a ``<|eos|>`` typed in a
message stays text); the template's own text is parsed for special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.data.formats import Chat, Pair, RowProblem

IGNORE_INDEX = -100

# Our template for a tokenizer without one: each message is `<|role|>`, a newline, the content,
# the tokenizer's EOS token and a newline. The markers are plain text (not special tokens); the
# EOS is the one special token, so an assistant turn ends as generation should stop. An assistant's
# content and EOS are marked `{% generation %}` (they render the same): the tokens this project's
# chat rows train are the ones TRL's assistant_only_loss trains.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{{ eos_token }}"
    "{% endgeneration %}{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class Segment:
    """A piece of a row: its text (or fixed ``ids``), whether it carries the loss, and whether the
    tokenizer's special-token strings in it are parsed as special tokens (``control``)."""

    text: str = ""
    trained: bool = False
    control: bool = True
    ids: tuple[int, ...] = ()


def _render(tokenizer: Any, messages: list[dict[str, str]], prompt: bool = False) -> str:
    # None lets the tokenizer pick its own template (also one of several named ones).
    template = None if getattr(tokenizer, "chat_template", None) else DEFAULT_CHAT_TEMPLATE
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=prompt
        )
    except Exception as err:  # a template may refuse a conversation (raise_exception) or fail on it
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RowProblem(f"the chat template failed: {first}") from None
    return text


def _added(before: str, after: str, index: int) -> str:
    if not after.startswith(before):
        raise RowProblem(
            f"the chat template does not render message {index} as a continuation of the ones before it"
        )
    return after[len(before) :]


def _split(added: str, content: str, trained: bool = False) -> list[Segment]:
    """The text one message added: template text around its content (found verbatim, else the
    whole piece is template text). A trained message trains its content and the marker after it."""
    at = added.find(content) if content else -1
    if at < 0:
        body = added.rstrip() if trained else added
        return [Segment(body, trained), Segment(added[len(body) :])]
    head, tail = added[:at], added[at + len(content) :]
    marker = tail.rstrip() if trained else tail
    return [
        Segment(head),
        Segment(content, trained, control=False),
        Segment(marker, trained),
        Segment(tail[len(marker) :]),
    ]


def chat_segments(chat: Chat, tokenizer: Any) -> list[Segment]:
    """A conversation as segments whose concatenated text is the template's full rendering."""
    segments: list[Segment] = []
    done = ""
    for i, (message, trained) in enumerate(zip(chat.messages, chat.trained, strict=True)):
        if trained:  # the generation prompt ("<|assistant|>\n") is template text
            head = _render(tokenizer, chat.messages[:i], prompt=True)
            segments.append(Segment(_added(done, head, i)))
            done = head
        text = _render(tokenizer, chat.messages[: i + 1])
        segments += _split(_added(done, text, i), message["content"], trained)
        done = text
    return segments


def leading_ids(tokenizer: Any) -> tuple[int, ...]:
    """The special tokens the tokenizer puts before a text of its own accord (a BOS, or none)."""
    lead = tokenizer("", add_special_tokens=True)["input_ids"]
    if lead and lead[-1] == tokenizer.eos_token_id:  # some tokenizers append EOS to every encoding
        lead = lead[:-1]
    return tuple(lead)


def pair_segments(pair: Pair, lead: tuple[int, ...], eos: int) -> list[Segment]:
    """The tokenizer's leading special tokens, then the prompt, the completion and EOS verbatim."""
    return [
        Segment(ids=lead),
        Segment(pair.prompt, control=False),
        Segment(pair.completion, True, control=False),
        Segment(ids=(eos,), trained=True),
    ]


def _tokenise(tokenizer: Any, texts: list[str], control: bool) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False, split_special_tokens=not control, verbose=False)[
        "input_ids"
    ]


def encode_segments(rows: list[list[Segment]], tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each row: one tokenizer call for all template text, one for all
    content; labels are the ids on trained segments and -100 elsewhere."""
    texts: dict[bool, list[str]] = {True: [], False: []}
    for segments in rows:
        for s in segments:
            if s.text:
                texts[s.control].append(s.text)
    encoded = {control: iter(_tokenise(tokenizer, batch, control)) for control, batch in texts.items()}
    out = []
    for segments in rows:
        ids: list[int] = []
        labels: list[int] = []
        for s in segments:
            piece = list(s.ids) if s.ids else next(encoded[s.control]) if s.text else []
            ids += piece
            labels += piece if s.trained else [IGNORE_INDEX] * len(piece)
        out.append((ids, labels))
    return out
