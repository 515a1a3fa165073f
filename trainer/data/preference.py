"""Preference pairs: rows in TRL's preference formats, tokenised as TRL's ``DPOTrainer`` tokenises
them, and the collator that batches them as pairs.

Formats (TRL's):
- explicit prompt: ``prompt``, ``chosen`` and ``rejected``, all strings or all conversations (lists of
  ``{"role", "content"}`` messages);
- implicit prompt: ``chosen`` and ``rejected`` only, each holding the prompt. The prompt is their
  longest common prefix: whole messages for conversations, characters for text (a space that ends
  the shared text goes with the answers).

Tokenisation (TRL's rules, so a row gives the same ids in both): text is tokenised with the
tokenizer's special tokens, and each text answer ends with the EOS token (added when missing); a
conversation is rendered with the chat template, the prompt alone with the generation prompt. The
prompt is tokenised alone and with each answer, and the answers start where those ids first differ
(a template, or a merge across the boundary, can change the prompt's last tokens). Under
``keep_start`` truncation a pair whose prompt alone fills ``max_length`` is dropped: no answer token
would be left to learn from.

A batch of B pairs holds tensors of shape ``(B, 2, L)``: index 0 along the second axis is the chosen
sequence, 1 the rejected one (``input_ids``, ``attention_mask``, ``completion_mask``), and
``ref_logps`` of shape ``(B, 2)`` once the reference pass has run. A batch's rows are its pairs, so
the sampler, the epochs and the step's sample count all count pairs.

Padding-free (``padding_free``): the batch's 2B sequences are laid end to end in one row of
``input_ids`` with ``position_ids`` that restart at each sequence, so no padding is forwarded and
each sequence attends to itself alone (the model builds its mask from the restarting positions).
``token_index`` of shape ``(B, 2, L)`` says where each sequence's tokens sit in that row (-1 past its
end); the masks keep their ``(B, 2, L)`` shape.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import torch

from trainer.data.formats import RowProblem

PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
REFERENCE_COLUMN = "ref_logps"  # [chosen, rejected] summed log-probs under the reference model
TRUNCATION_MODES = ("keep_start", "keep_end")
logger = logging.getLogger(__name__)


def is_conversation(value: Any) -> bool:
    """A list of messages (dicts with a role), as TRL tells a conversational row."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def split_prompt(row: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a row in either form. A ``prompt`` column is taken as the prompt
    when it is of the same kind as the answers (both text or both conversations); otherwise the
    prompt is implicit in the answers (some datasets carry a text prompt beside full conversations)."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if not (isinstance(value, str) or is_conversation(value)):
            state = "missing" if value is None else "neither text nor a list of messages"
            raise RowProblem(f"{name} is {state}")
    if is_conversation(chosen) != is_conversation(rejected):
        raise RowProblem("chosen and rejected must both be text or both conversations")
    prompt = row.get("prompt")
    if prompt is not None and is_conversation(prompt) == is_conversation(chosen):
        return prompt, chosen, rejected
    shared = 0
    for a, b in zip(chosen, rejected, strict=False):
        if a != b:
            break
        shared += 1
    if shared and not is_conversation(chosen) and chosen[shared - 1] == " " and shared < len(chosen):
        shared -= 1  # the answers keep the space that leads them
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _ids(tokenizer: Any, value: Any, generation_prompt: bool = False) -> list[int]:
    if isinstance(value, list):
        try:
            out = tokenizer.apply_chat_template(
                value, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt
            )
        except Exception as err:  # a template may refuse a conversation, or fail on it
            raise RowProblem(f"the chat template failed: {str(err).splitlines()[0]}") from None
        return list(out["input_ids"])
    return list(tokenizer(text=value)["input_ids"])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def tokenize_pair(row: dict[str, Any], tokenizer: Any) -> dict[str, list[int]]:
    """One row as ``prompt_ids``, ``chosen_ids`` and ``rejected_ids``; RowProblem when it cannot be read."""
    prompt, chosen, rejected = split_prompt(row)
    if is_conversation(chosen):
        prompt_ids = _ids(tokenizer, prompt, generation_prompt=True) if prompt else []
        full = [_ids(tokenizer, prompt + answer) for answer in (chosen, rejected)]
    else:
        if not isinstance(prompt, str):
            raise RowProblem("prompt must be text when the answers are text")
        eos = tokenizer.eos_token or ""
        answers = [a if a.endswith(eos) else a + eos for a in (chosen, rejected)]
        prompt_ids = _ids(tokenizer, prompt)
        full = [_ids(tokenizer, prompt + answer) for answer in answers]
    start = min(_common_prefix(prompt_ids, ids) for ids in full)
    return {"prompt_ids": prompt_ids[:start], "chosen_ids": full[0][start:], "rejected_ids": full[1][start:]}


def tokenize_pair_with_bos(row: dict[str, Any], tokenizer: Any) -> dict[str, list[int]]:
    """One row as TRL's ORPO and CPO trainers tokenise it (an older rule than DPO's, which they
    keep): a conversation is rendered by the chat template to text first (the prompt with the
    generation prompt; each answer is what the whole conversation adds to it); text is tokenised
    without special tokens, the prompt alone and with each answer, and an answer starts at the
    prompt's length (one token earlier where the prompt's last token merged into the answer); then
    the tokenizer's BOS goes in front of the prompt and its EOS after each answer, where not there
    already."""
    prompt, chosen, rejected = split_prompt(row)
    if is_conversation(chosen):
        try:
            text = tokenizer.apply_chat_template(prompt or [], tokenize=False, add_generation_prompt=True)
            answers = [
                tokenizer.apply_chat_template((prompt or []) + a, tokenize=False) for a in (chosen, rejected)
            ]
        except Exception as err:  # a template may refuse a conversation, or fail on it
            raise RowProblem(f"the chat template failed: {str(err).splitlines()[0]}") from None
        prompt, chosen, rejected = text, *(a[len(text) :] if a.startswith(text) else a for a in answers)
    if not isinstance(prompt, str):
        raise RowProblem("prompt must be text when the answers are text")

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    prompt_ids, split = ids(prompt), []
    for answer in (chosen, rejected):
        full = ids(prompt + answer)
        start = len(prompt_ids) - (full[: len(prompt_ids)] != prompt_ids)
        split.append((full[:start], full[start:]))
    start = min(len(p) for p, _ in split)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    prompt_ids = split[0][0][:start]
    if bos is not None and prompt_ids[:1] != [bos]:
        prompt_ids = [bos, *prompt_ids]
    out = {"prompt_ids": prompt_ids}
    for key, (own_prompt, answer) in zip(("chosen_ids", "rejected_ids"), split, strict=True):
        answer = own_prompt[start:] + answer
        out[key] = answer if answer[-1:] == [eos] else [*answer, eos]
    return out


def tokenize_preferences(
    dataset: Any,
    tokenizer: Any,
    max_length: int | None,
    truncation_mode: str,
    name: str,
    num_proc: int | None = None,
    tokenize: Any = tokenize_pair,
) -> Any:
    """A ``datasets.Dataset`` of preference rows as token ids (``PAIR_COLUMNS``), its other
    columns dropped; ``tokenize``: the rule for one row (DPO's, or ``tokenize_pair_with_bos``). A
    row that cannot be read is one ValueError naming the set and the row."""
    columns = list(getattr(dataset, "column_names", None) or [])
    missing = [c for c in ("chosen", "rejected") if c not in columns]
    if missing:
        raise ValueError(
            f"the {name} set has no {' or '.join(missing)} column (columns: {', '.join(columns)}); a "
            "preference set has chosen and rejected, and a prompt unless it is implicit in them"
        )
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(f"truncation_mode: {truncation_mode!r} is not one of {', '.join(TRUNCATION_MODES)}")

    def one(row: dict[str, Any], index: int) -> dict[str, list[int]]:
        try:
            return tokenize(row, tokenizer)
        except RowProblem as problem:
            raise ValueError(f"the {name} set's row {index}: {problem}") from None

    out = dataset.map(
        one, with_indices=True, remove_columns=columns, num_proc=num_proc, desc=f"Tokenizing {name} pairs"
    )
    if max_length is not None and truncation_mode == "keep_start":
        total = len(out)
        out = out.filter(lambda row: len(row["prompt_ids"]) < max_length, num_proc=num_proc)
        if len(out) < total:
            logger.warning(
                "the %s set: %d of %d pairs dropped: the prompt alone fills max_length=%d, leaving no "
                "answer token",
                name,
                total - len(out),
                total,
                max_length,
            )
    return out


def pairs_digest(dataset: Any) -> str:
    """A digest of a tokenised preference set's ids, in order: what its reference log-probs depend on
    besides the model."""
    digest = hashlib.sha256()
    for batch in dataset.select_columns(list(PAIR_COLUMNS)).iter(batch_size=1024):
        digest.update(json.dumps([batch[c] for c in PAIR_COLUMNS]).encode())
    return digest.hexdigest()


@dataclass
class PreferenceCollator:
    """Pairs padded on the right to their batch's longest sequence (a multiple of
    ``pad_to_multiple_of`` when set), each sequence cut to ``max_length`` first: its start kept
    (``keep_start``) or its end (``keep_end``); ``padding_free``: their token ids in one row."""

    pad_token_id: int
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    pad_to_multiple_of: int | None = None
    padding_free: bool = False

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        cut = slice(None)
        if self.max_length is not None:
            cut = (
                slice(None, self.max_length)
                if self.truncation_mode == "keep_start"
                else slice(-self.max_length, None)
            )
        seqs, masks = [], []
        for row in rows:
            for answer in (row["chosen_ids"], row["rejected_ids"]):
                seqs.append((row["prompt_ids"] + answer)[cut])
                masks.append(([0] * len(row["prompt_ids"]) + [1] * len(answer))[cut])
        length = max(len(s) for s in seqs)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(seqs), length), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(seqs), length), dtype=torch.long)
        completion = torch.zeros((len(seqs), length), dtype=torch.long)
        for i, (seq, mask) in enumerate(zip(seqs, masks, strict=True)):
            input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            attention[i, : len(seq)] = 1
            completion[i, : len(mask)] = torch.tensor(mask, dtype=torch.long)
        shape = (len(rows), 2, length)
        batch = {
            "input_ids": input_ids.view(shape),
            "attention_mask": attention.view(shape),
            "completion_mask": completion.view(shape),
        }
        if self.padding_free:  # the one row replaces the padded ids; the masks lead, so that a
            # batch's rows (its first tensor's first dimension) are still its pairs
            packed = packed_pairs(seqs, length)
            packed["token_index"] = packed["token_index"].view(shape)
            batch = {
                "completion_mask": batch["completion_mask"],
                "attention_mask": batch["attention_mask"],
                **packed,
            }
        if REFERENCE_COLUMN in rows[0]:
            batch[REFERENCE_COLUMN] = torch.tensor(
                [row[REFERENCE_COLUMN] for row in rows], dtype=torch.float32
            )
        return batch


def packed_pairs(seqs: list[list[int]], length: int) -> dict[str, torch.Tensor]:
    """``seqs`` end to end in one row: ``input_ids`` and ``position_ids`` of shape (1, total), and
    ``token_index`` of shape (len(seqs), length), each token's place in that row (-1 past the end)."""
    starts = torch.tensor([0, *(len(s) for s in seqs)]).cumsum(0)
    index = torch.full((len(seqs), length), -1, dtype=torch.long)
    for i, seq in enumerate(seqs):
        index[i, : len(seq)] = torch.arange(int(starts[i]), int(starts[i]) + len(seq))
    return {
        "input_ids": torch.tensor([t for s in seqs for t in s], dtype=torch.long)[None],
        "position_ids": torch.tensor([p for s in seqs for p in range(len(s))], dtype=torch.long)[None],
        "token_index": index,
    }


def load_pairs(data_args: Any, seed: int) -> tuple[Any, Any]:
    """The raw preference rows of a run's ``dataset`` (a file, directory or hub name, as any run's),
    and its evaluation rows: the ``validation_file``'s, else the source's own validation split, else
    ``validation_split_percentage`` of the rows held out, drawn with ``seed``. Tokenised later, by
    the preference trainer."""
    from trainer.data.sources import load_raw, load_validation, resolve_source

    raw = load_raw(data_args)
    train, held = raw.train, raw.eval
    if data_args.validation_file is not None:
        source = resolve_source(data_args, data_args.validation_file, "validation_file")
        held = load_validation(data_args, source)
    elif held is None and data_args.validation_split_percentage:
        split = train.train_test_split(test_size=data_args.validation_split_percentage / 100, seed=seed)
        train, held = split["train"], split["test"]
    if data_args.max_train_samples is not None and data_args.max_train_samples < len(train):
        train = train.select(range(data_args.max_train_samples))
    return train, held
