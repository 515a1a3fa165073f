"""A token-classification (NER) training script in the shape of transformers' token-classification
example (run_ner): argument dataclasses parsed by ``HfArgumentParser``, local JSON files of words and
their tags through ``datasets``, words tokenised under ``main_process_first`` with each word's tag on
its first sub-token (or on all of them, ``--label_all_tokens``), a BERT built from a config with a
token-classification head, ``DataCollatorForTokenClassification``, entity-level metrics from a plain
function, then train / save / evaluate / predict (``predictions.txt``) and the model card.

Its only trainer-specific line is the ``Trainer, TrainingArguments`` import below: the tests run it
as it is (HF's Trainer) and with that line swapped for ``from trainer import ...`` (ours).
"""

import logging
import os
from dataclasses import dataclass, field

import datasets
import numpy as np
from transformers import (
    AutoConfig,
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    set_seed,
)

from tests.helpers.hf_example_common import (
    data_files,
    detect_last_checkpoint,
    first_rows,
    parse_arguments,
    setup_logging,
)

# isort: off
from transformers import Trainer, TrainingArguments  # the test swaps this line for ours
# isort: on

logger = logging.getLogger(__name__)

TINY_BERT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_position_embeddings": 64,
}


@dataclass
class ModelArguments:
    model_type: str = field(default="bert", metadata={"help": "Architecture built from scratch."})
    config_overrides: str | None = field(
        default=None, metadata={"help": "Config fields over the tiny defaults, as 'hidden_size=16'."}
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "A local (fast) tokenizer directory."})


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None, metadata={"help": "A .json file: words and their tags."})
    validation_file: str | None = field(default=None, metadata={"help": "A file to evaluate on."})
    test_file: str | None = field(default=None, metadata={"help": "A file to predict on."})
    text_column_name: str = field(default="tokens", metadata={"help": "The column of words."})
    label_column_name: str = field(default="ner_tags", metadata={"help": "The column of tags."})
    max_seq_length: int | None = field(default=None, metadata={"help": "Truncate rows beyond this."})
    pad_to_max_length: bool = field(default=False, metadata={"help": "Pad every row to max_seq_length."})
    label_all_tokens: bool = field(
        default=False, metadata={"help": "Tag every sub-token of a word, not only its first."}
    )
    return_entity_level_metrics: bool = field(
        default=False, metadata={"help": "Report each entity type's precision, recall and F1 too."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N train rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N eval rows."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Keep the first N test rows."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for maps."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Redo the maps even if cached."})


def entities(tags: list[str]) -> set[tuple[str, int, int]]:
    """The (type, first, last) spans of a BIO tag sequence: a B- tag, or an I- tag after another
    type, opens a span; an I- of the same type extends it."""
    spans, current = [], None
    for i, tag in enumerate([*tags, "O"]):
        kind = tag[2:] if tag[:2] in ("B-", "I-") else None
        if current and (kind != current[0] or tag.startswith("B-")):
            spans.append((current[0], current[1], i - 1))
            current = None
        if kind and current is None:
            current = (kind, i)
    return set(spans)


def entity_scores(predicted: list[list[str]], truth: list[list[str]], kind: str | None = None) -> dict:
    pred = {(row, *s) for row, tags in enumerate(predicted) for s in entities(tags) if kind in (None, s[0])}
    gold = {(row, *s) for row, tags in enumerate(truth) for s in entities(tags) if kind in (None, s[0])}
    hits = len(pred & gold)
    precision = hits / len(pred) if pred else 0.0
    recall = hits / len(gold) if gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "number": len(gold)}


def main():
    model_args, data_args, training_args = parse_arguments(
        ModelArguments, DataTrainingArguments, TrainingArguments
    )
    setup_logging(training_args, logger)
    last_checkpoint = detect_last_checkpoint(training_args, logger)
    set_seed(training_args.seed)

    files, builder = data_files(data_args, "train", "validation", "test")
    raw = datasets.load_dataset(builder, data_files=files)
    text_column, label_column = data_args.text_column_name, data_args.label_column_name

    # Tags as strings: the classes are the sorted distinct tags of the train split.
    label_list = sorted({tag for row in raw["train"][label_column] for tag in row})
    label_to_id = {label: i for i, label in enumerate(label_list)}
    # The I- tag of each B- tag, for --label_all_tokens (a word's later pieces continue its entity).
    b_to_i = [
        label_to_id.get("I-" + label[2:], i) if label.startswith("B-") else i
        for i, label in enumerate(label_list)
    ]

    if model_args.tokenizer_name is None:
        raise ValueError("--tokenizer_name: this script trains from scratch and needs a tokenizer directory")
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    if not tokenizer.is_fast:
        raise ValueError("this script needs a fast tokenizer (word_ids) to align tags with sub-tokens")
    config = AutoConfig.for_model(
        model_args.model_type,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        num_labels=len(label_list),
        label2id=label_to_id,
        id2label=dict(enumerate(label_list)),
        **TINY_BERT,
    )
    if model_args.config_overrides:
        config.update_from_string(model_args.config_overrides)
    model = AutoModelForTokenClassification.from_config(config)

    padding = "max_length" if data_args.pad_to_max_length else False

    def tokenize_and_align_labels(examples):
        tokenized = tokenizer(
            examples[text_column],
            padding=padding,
            truncation=True,
            max_length=data_args.max_seq_length,
            is_split_into_words=True,
        )
        labels = []
        for i, tags in enumerate(examples[label_column]):
            row, previous = [], None
            for word in tokenized.word_ids(batch_index=i):
                if word is None:  # special tokens and padding: no tag
                    row.append(-100)
                elif word != previous:
                    row.append(label_to_id[tags[word]])
                else:
                    row.append(b_to_i[label_to_id[tags[word]]] if data_args.label_all_tokens else -100)
                previous = word
            labels.append(row)
        tokenized["labels"] = labels
        return tokenized

    with training_args.main_process_first(desc="dataset map pre-processing"):
        processed = raw.map(
            tokenize_and_align_labels,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            remove_columns=raw["train"].column_names,
            load_from_cache_file=not data_args.overwrite_cache,
            desc="Running tokenizer on dataset",
        )

    train_dataset = eval_dataset = predict_dataset = None
    if training_args.do_train:
        train_dataset = first_rows(processed["train"], data_args.max_train_samples)
    if training_args.do_eval:
        if "validation" not in processed:
            raise ValueError("--do_eval requires a validation_file")
        eval_dataset = first_rows(processed["validation"], data_args.max_eval_samples)
    if training_args.do_predict:
        if "test" not in processed:
            raise ValueError("--do_predict requires a test_file")
        predict_dataset = first_rows(processed["test"], data_args.max_predict_samples)

    data_collator = DataCollatorForTokenClassification(
        tokenizer, pad_to_multiple_of=8 if training_args.fp16 else None
    )

    def tags_of(predictions, labels):
        """Each row's predicted and true tags where a label exists (not -100)."""
        predictions = np.argmax(predictions, axis=2)
        kept = [
            [(p, t) for p, t in zip(pr, lr, strict=True) if t != -100]
            for pr, lr in zip(predictions, labels, strict=True)
        ]
        return (
            [[label_list[p] for p, _ in row] for row in kept],
            [[label_list[t] for _, t in row] for row in kept],
        )

    def compute_metrics(p):
        predicted, truth = tags_of(p.predictions, p.label_ids)
        overall = entity_scores(predicted, truth)
        pairs = [(a, b) for pr, tr in zip(predicted, truth, strict=True) for a, b in zip(pr, tr, strict=True)]
        metrics = {
            "precision": overall["precision"],
            "recall": overall["recall"],
            "f1": overall["f1"],
            "accuracy": sum(a == b for a, b in pairs) / len(pairs) if pairs else 0.0,
        }
        if data_args.return_entity_level_metrics:
            for kind in sorted({label[2:] for label in label_list if label != "O"}):
                for key, value in entity_scores(predicted, truth, kind).items():
                    metrics[f"{kind}_{key}"] = value
        return metrics

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics,
    )

    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint or last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        metrics = train_result.metrics
        trainer.save_model()
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    if training_args.do_predict:
        logger.info("*** Predict ***")
        predictions, labels, metrics = trainer.predict(predict_dataset, metric_key_prefix="predict")
        predicted, _ = tags_of(predictions, labels)
        trainer.log_metrics("predict", metrics)
        trainer.save_metrics("predict", metrics)
        if trainer.is_world_process_zero():
            with open(os.path.join(training_args.output_dir, "predictions.txt"), "w") as writer:
                for row in predicted:
                    writer.write(" ".join(row) + "\n")

    kwargs = {"finetuned_from": None, "tasks": "token-classification"}
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
