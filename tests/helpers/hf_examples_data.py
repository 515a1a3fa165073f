"""Small local inputs for the HF-example-shaped scripts (``run_*_shaped.py``): tokenizers trained here
with ``tokenizers`` and saved as HF tokenizer directories, and data files of made-up sentences, tagged
words, summaries and PNG images. Everything comes from one seeded generator, so a test builds the
same inputs every time.

``write_inputs(root)`` writes them all under ``root``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SUBJECTS = ["the cat", "a dog", "my friend", "the teacher", "our team", "a bird", "the farmer", "her brother"]
VERBS = ["likes", "sees", "finds", "paints", "visits", "follows", "reads", "builds"]
OBJECTS = [
    "the river",
    "a garden",
    "the old bridge",
    "a small boat",
    "the market",
    "a red house",
    "the hills",
]
GOOD = ["wonderful", "great", "lovely", "bright", "cheerful"]
BAD = ["terrible", "awful", "gloomy", "broken", "dull"]
TOPICS = {
    "animal": ["cat", "dog", "bird"],
    "place": ["river", "garden", "market", "hills"],
    "person": ["friend", "teacher", "farmer", "brother"],
}
PEOPLE = [["Alice"], ["Bob"], ["Maria", "Lopez"], ["Chen"], ["Omar", "Haddad"]]
PLACES = [["Paris"], ["Lagos"], ["New", "York"], ["Kyoto"], ["Rio", "de", "Janeiro"]]


def sentence(rng: random.Random, mood: str | None = None) -> str:
    words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
    if mood is not None:
        words += ["and it is", rng.choice(GOOD if mood == "positive" else BAD)]
    return " ".join(words)


def wordpiece_tokenizer(path: Path, corpus: list[str]) -> None:
    """A lower-casing WordPiece tokenizer with BERT's special tokens and ``[CLS] A [SEP] (B [SEP])``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.decoder = decoders.WordPiece()
    # A vocabulary smaller than the words: some words split into pieces, as real ones do.
    wordpiece.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=160, special_tokens=special))
    cls, sep = wordpiece.token_to_id("[CLS]"), wordpiece.token_to_id("[SEP]")
    wordpiece.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    PreTrainedTokenizerFast(
        tokenizer_object=wordpiece,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=64,
    ).save_pretrained(path)


def t5_bpe_tokenizer(path: Path, corpus: list[str]) -> None:
    """A byte-level BPE tokenizer with T5's special tokens (``<pad>`` 0, ``</s>`` 1) that ends every
    sequence with ``</s>`` (the T5's tokenizer, and the causal LM's: ``</s>`` ends each line)."""
    from tests.helpers.scaffold import bpe_tokenizer

    bpe_tokenizer(corpus, vocab_size=300, special_tokens=("<pad>", "</s>", "<unk>"), add_prefix_space=True,
                  end_with_eos=True, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                  model_max_length=64).save_pretrained(path)  # fmt: skip


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_csv(path: Path, rows: list[dict]) -> None:
    import csv

    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def classification_rows(rng: random.Random, n: int) -> dict[str, list[dict]]:
    """The three problems run_classification handles, on the same kind of sentences: a mood
    (single-label, two text columns), the topics named (multi-label), a score (regression)."""
    single, multi, regression = [], [], []
    for _ in range(n):
        mood = rng.choice(["positive", "negative", "neutral"])
        first, second = sentence(rng), sentence(rng, None if mood == "neutral" else mood)
        single.append({"sentence1": first, "sentence2": second, "label": mood})
        multi.append(
            {
                "sentence": second,
                "label": [t for t, words in TOPICS.items() if any(w in second.split() for w in words)],
            }
        )
        score = sum(w in GOOD for w in second.split()) - sum(w in BAD for w in second.split())
        regression.append({"sentence": second, "label": round(score + rng.uniform(-0.3, 0.3), 3)})
    return {"single": single, "multi": multi, "regression": regression}


def ner_row(rng: random.Random) -> dict:
    """Words and BIO tags: people (PER) who visit places (LOC)."""
    words, tags = [], []

    def add(span: list[str], kind: str | None) -> None:
        words.extend(span)
        tags.extend(["O"] * len(span) if kind is None else [f"B-{kind}"] + [f"I-{kind}"] * (len(span) - 1))

    add(rng.choice(PEOPLE), "PER")
    add([rng.choice(["visits", "leaves", "loves"])], None)
    add(rng.choice(PLACES), "LOC")
    if rng.random() < 0.5:
        add(["with"], None)
        add(rng.choice(PEOPLE), "PER")
    add(rng.choice([["today"], ["in", "spring"], ["again"]]), None)
    return {"tokens": words, "ner_tags": tags}


def summary_row(rng: random.Random) -> dict:
    subject, verb, obj = rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)
    mood = rng.choice(GOOD + BAD)
    text = f"this morning {subject} {verb} {obj} . everyone says the day is {mood} and the sky is {rng.choice(GOOD + BAD)}"
    return {"text": text, "summary": f"{subject} {verb} {obj}"}


def write_images(root: Path, rng: random.Random, per_class: dict[str, int]) -> None:
    """``root/<split>/<colour>/<n>.png``: 20x20 noisy images, each class one dominant colour."""
    from PIL import Image

    colours = {"red": (0, 200), "green": (1, 200), "blue": (2, 200)}
    for split, count in per_class.items():
        for name, (channel, level) in colours.items():
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = bytearray()
                for _ in range(20 * 20):
                    rgb = [rng.randrange(0, 90) for _ in range(3)]
                    rgb[channel] = rng.randrange(level - 60, level + 55)
                    pixels += bytes(rgb)
                Image.frombytes("RGB", (20, 20), bytes(pixels)).save(folder / f"{i}.png")


def write_inputs(root: Path) -> None:
    """Every script's inputs under ``root``: ``bert_tokenizer/``, ``bpe_tokenizer/``, ``mlm_*.txt``,
    ``classification_*`` (csv and jsonl), ``ner_*.jsonl``, ``summarization_*.jsonl`` and ``images/``."""
    rng = random.Random(0)
    splits = {"train": 40, "validation": 16, "test": 8}

    mlm = {
        split: [sentence(rng, rng.choice(["positive", "negative"])) for _ in range(n)]
        for split, n in splits.items()
    }
    for split in ("train", "validation"):
        (root / f"mlm_{split}.txt").write_text("\n".join(mlm[split]) + "\n")
    classes = {split: classification_rows(rng, n) for split, n in splits.items()}
    for split, problems in classes.items():
        write_csv(root / f"classification_single_{split}.csv", problems["single"])
        write_jsonl(root / f"classification_multi_{split}.jsonl", problems["multi"])
        write_csv(root / f"classification_regression_{split}.csv", problems["regression"])
    ner = {split: [ner_row(rng) for _ in range(n)] for split, n in splits.items()}
    for split, rows in ner.items():
        write_jsonl(root / f"ner_{split}.jsonl", rows)
    summaries = {split: [summary_row(rng) for _ in range(n)] for split, n in splits.items()}
    for split, rows in summaries.items():
        write_jsonl(root / f"summarization_{split}.jsonl", rows)
    write_images(root / "images", rng, {"train": 8, "validation": 4})

    bert_corpus = [
        *(line for lines in mlm.values() for line in lines),
        *(" ".join(row.values()) for problems in classes.values() for row in problems["single"]),
        *(" ".join(row["tokens"]) for rows in ner.values() for row in rows),
    ]
    wordpiece_tokenizer(root / "bert_tokenizer", bert_corpus)
    summary_texts = [text for rows in summaries.values() for row in rows for text in row.values()]
    t5_bpe_tokenizer(
        root / "bpe_tokenizer", [*summary_texts, *(line for lines in mlm.values() for line in lines)]
    )
