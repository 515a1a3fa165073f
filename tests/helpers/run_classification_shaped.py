"""A text-classification training script in the shape of transformers' text-classification example
(run_classification): argument dataclasses parsed by ``HfArgumentParser``, local CSV or JSON files
through ``datasets``, one or more text columns, and the three problems that example handles:

- single-label classification (a label per row, any strings: the sorted distinct labels are the classes),
- multi-label classification (a list of labels per row, given in JSON files),
- regression (``--do_regression``, or float labels).

A BERT built from a config with the problem's head, tokenisation under ``main_process_first``,
``DataCollatorWithPadding`` (or ``default_data_collator`` when padded to the maximum length), then
train / save / evaluate / predict (``predict_results.txt``) and the model card.

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
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    default_data_collator,
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
    tokenizer_name: str | None = field(default=None, metadata={"help": "A local tokenizer directory."})


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None, metadata={"help": "A .csv or .json file."})
    validation_file: str | None = field(default=None, metadata={"help": "A file to evaluate on."})
    test_file: str | None = field(default=None, metadata={"help": "A file to predict on."})
    text_column_names: str = field(
        default="sentence", metadata={"help": "Text columns, comma-separated; joined with the delimiter."}
    )
    text_column_delimiter: str = field(default=" ", metadata={"help": "What joins the text columns."})
    label_column_name: str = field(default="label", metadata={"help": "The label column."})
    do_regression: bool = field(default=False, metadata={"help": "Regression on float labels."})
    max_seq_length: int = field(default=64, metadata={"help": "Tokens per example, truncated beyond."})
    pad_to_max_length: bool = field(default=False, metadata={"help": "Pad every row to max_seq_length."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N train rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N eval rows."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Keep the first N test rows."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for maps."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Redo the maps even if cached."})


def label_list(raw, label_column: str, multi_label: bool) -> list[str]:
    """The classes: every distinct label of the train split (of every row's list when multi-label), sorted."""
    column = raw["train"][label_column]
    labels = {label for row in column for label in row} if multi_label else set(column)
    return sorted(str(label) for label in labels)


def problem_type(raw, data_args) -> str:
    feature = raw["train"].features[data_args.label_column_name]
    if isinstance(feature, datasets.Sequence | datasets.List):
        return "multi_label_classification"
    if data_args.do_regression or feature.dtype in ("float32", "float64"):
        return "regression"
    return "single_label_classification"


def build_model(model_args, tokenizer, problem: str, labels: list[str]):
    num_labels = 1 if problem == "regression" else len(labels)
    config = AutoConfig.for_model(
        model_args.model_type,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        num_labels=num_labels,
        problem_type=problem,
        **TINY_BERT,
    )
    if problem != "regression":
        config.label2id = {label: i for i, label in enumerate(labels)}
        config.id2label = dict(enumerate(labels))
    if model_args.config_overrides:
        config.update_from_string(model_args.config_overrides)
    return AutoModelForSequenceClassification.from_config(config)


def make_compute_metrics(problem: str):
    def compute_metrics(p):
        preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        labels = np.asarray(p.label_ids)
        if problem == "regression":
            return {"mse": float(((np.squeeze(preds, -1) - labels) ** 2).mean())}
        if problem == "multi_label_classification":
            chosen, truth = preds > 0, labels > 0.5
            true_pos = float((chosen & truth).sum())
            denominator = float(chosen.sum() + truth.sum())
            return {"f1": 2 * true_pos / denominator if denominator else 1.0}
        return {"accuracy": float((np.argmax(preds, axis=1) == labels).mean())}

    return compute_metrics


def main():
    model_args, data_args, training_args = parse_arguments(
        ModelArguments, DataTrainingArguments, TrainingArguments
    )
    setup_logging(training_args, logger)
    last_checkpoint = detect_last_checkpoint(training_args, logger)
    set_seed(training_args.seed)

    files, builder = data_files(data_args, "train", "validation", "test")
    raw = datasets.load_dataset(builder, data_files=files)
    problem = problem_type(raw, data_args)
    labels = (
        [] if problem == "regression" else label_list(raw, data_args.label_column_name, "multi" in problem)
    )
    logger.info(f"Problem: {problem}; labels: {labels}")

    if model_args.tokenizer_name is None:
        raise ValueError("--tokenizer_name: this script trains from scratch and needs a tokenizer directory")
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    model = build_model(model_args, tokenizer, problem, labels)

    label_to_id = {label: i for i, label in enumerate(labels)}
    text_columns = data_args.text_column_names.split(",")
    label_column = data_args.label_column_name
    padding = "max_length" if data_args.pad_to_max_length else False
    max_seq_length = min(data_args.max_seq_length, tokenizer.model_max_length)

    def preprocess(examples):
        texts = [
            data_args.text_column_delimiter.join(str(examples[c][i]) for c in text_columns)
            for i in range(len(examples[text_columns[0]]))
        ]
        result = tokenizer(texts, padding=padding, max_length=max_seq_length, truncation=True)
        # "labels", a new column: datasets would cast ids written back into a string "label" column.
        if label_column in examples:
            if problem == "regression":
                result["labels"] = [float(v) for v in examples[label_column]]
            elif problem == "multi_label_classification":
                result["labels"] = [
                    [1.0 if label in row else 0.0 for label in labels] for row in examples[label_column]
                ]
            else:
                result["labels"] = [label_to_id[str(v)] for v in examples[label_column]]
        return result

    with training_args.main_process_first(desc="dataset map pre-processing"):
        processed = raw.map(
            preprocess,
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

    if data_args.pad_to_max_length:
        data_collator = default_data_collator
    else:
        pad_to = 8 if training_args.fp16 else None
        data_collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        compute_metrics=make_compute_metrics(problem),
        processing_class=tokenizer,
        data_collator=data_collator,
    )

    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint or last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.save_model()
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate(eval_dataset=eval_dataset)
        metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    if training_args.do_predict:
        logger.info("*** Predict ***")
        if "labels" in predict_dataset.features:  # as HF's example: predict without the labels
            predict_dataset = predict_dataset.remove_columns("labels")
        predictions = trainer.predict(predict_dataset, metric_key_prefix="predict").predictions
        if problem == "regression":
            predictions = np.squeeze(predictions, -1)
        elif problem == "multi_label_classification":
            predictions = [[labels[i] for i in np.flatnonzero(row > 0)] for row in predictions]
        else:
            predictions = np.argmax(predictions, axis=1)
        if trainer.is_world_process_zero():
            with open(os.path.join(training_args.output_dir, "predict_results.txt"), "w") as writer:
                writer.write("index\tprediction\n")
                for index, item in enumerate(predictions):
                    if problem == "regression":
                        writer.write(f"{index}\t{item:3.3f}\n")
                    elif problem == "multi_label_classification":
                        writer.write(f"{index}\t{item}\n")
                    else:
                        writer.write(f"{index}\t{labels[item]}\n")
        logger.info(f"Predict results saved in {training_args.output_dir}")

    kwargs = {"finetuned_from": None, "tasks": "text-classification"}
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
