"""A masked-LM training script in the shape of transformers' language-modeling example (run_mlm):
argument dataclasses parsed by ``HfArgumentParser``, local text files through ``datasets``,
tokenisation under ``main_process_first``, lines either kept one example each (``--line_by_line``)
or joined and cut into blocks, a BERT built from a config, HF's masking collator, then train / save /
evaluate and the model card.

Its only trainer-specific line is the ``Trainer, TrainingArguments`` import below: the tests run it
as it is (HF's Trainer) and with that line swapped for ``from trainer import ...`` (ours).
Usage: ``run_mlm_shaped.py --tokenizer_name DIR --train_file A.txt --validation_file B.txt
--output_dir OUT [--do_train] [--do_eval] ...`` or ``run_mlm_shaped.py args.json``.
"""

import logging
import math
from dataclasses import dataclass, field
from itertools import chain

import datasets
import numpy as np
from transformers import (
    AutoConfig,
    AutoModelForMaskedLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
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
    """Which model to build and with which tokenizer."""

    model_type: str = field(default="bert", metadata={"help": "Architecture built from scratch."})
    config_overrides: str | None = field(
        default=None, metadata={"help": "Config fields over the tiny defaults, as 'hidden_size=16'."}
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "A local tokenizer directory."})


@dataclass
class DataTrainingArguments:
    """Which text to train and evaluate on, how to cut it and how much of it to mask."""

    train_file: str | None = field(default=None, metadata={"help": "A .txt, .csv or .json file."})
    validation_file: str | None = field(default=None, metadata={"help": "A file to evaluate on."})
    max_seq_length: int | None = field(default=None, metadata={"help": "Tokens per example (default 64)."})
    line_by_line: bool = field(default=False, metadata={"help": "One example per line, not blocks."})
    pad_to_max_length: bool = field(default=False, metadata={"help": "Pad every line to max_seq_length."})
    mlm_probability: float = field(default=0.15, metadata={"help": "Share of tokens masked."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N train rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N eval rows."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for maps."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Redo the maps even if cached."})


def build_model(model_args, tokenizer):
    config = AutoConfig.for_model(
        model_args.model_type, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **TINY_BERT
    )
    if model_args.config_overrides:
        logger.info(f"Overriding config: {model_args.config_overrides}")
        config.update_from_string(model_args.config_overrides)
    model = AutoModelForMaskedLM.from_config(config)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    logger.info(f"Training a new model from scratch: {n_params / 2**20:.3f}M parameters")
    return model


def tokenize_datasets(raw, tokenizer, data_args, training_args):
    """Lines as examples (``--line_by_line``), or every line's tokens joined and cut into
    ``max_seq_length`` blocks. The special-tokens mask tells the collator what not to mask."""
    columns = raw["train" if training_args.do_train else "validation"].column_names
    text_column = "text" if "text" in columns else columns[0]
    max_seq_length = min(data_args.max_seq_length or 64, tokenizer.model_max_length)
    map_options = {
        "batched": True,
        "num_proc": data_args.preprocessing_num_workers,
        "load_from_cache_file": not data_args.overwrite_cache,
    }

    if data_args.line_by_line:
        padding = "max_length" if data_args.pad_to_max_length else False

        def tokenize_lines(examples):
            lines = [line for line in examples[text_column] if len(line) > 0 and not line.isspace()]
            return tokenizer(
                lines,
                padding=padding,
                truncation=True,
                max_length=max_seq_length,
                return_special_tokens_mask=True,
            )

        with training_args.main_process_first(desc="dataset map tokenization"):
            return raw.map(tokenize_lines, remove_columns=columns, desc="Tokenizing lines", **map_options)

    def tokenize(examples):
        return tokenizer(examples[text_column], return_special_tokens_mask=True)

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples}
        usable = (len(joined["input_ids"]) // max_seq_length) * max_seq_length
        return {
            k: [ids[i : i + max_seq_length] for i in range(0, usable, max_seq_length)]
            for k, ids in joined.items()
        }

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized = raw.map(tokenize, remove_columns=columns, desc="Tokenizing", **map_options)
    with training_args.main_process_first(desc="grouping texts together"):
        return tokenized.map(group_texts, desc=f"Grouping texts in blocks of {max_seq_length}", **map_options)


def preprocess_logits_for_metrics(logits, labels):
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def compute_metrics(eval_preds):
    """Accuracy on the masked positions (the only labels not -100)."""
    preds, labels = (np.asarray(a) for a in eval_preds)
    mask = labels != -100
    return {"accuracy": float((preds[mask] == labels[mask]).mean()) if mask.any() else 0.0}


def main():
    model_args, data_args, training_args = parse_arguments(
        ModelArguments, DataTrainingArguments, TrainingArguments
    )
    setup_logging(training_args, logger)
    last_checkpoint = detect_last_checkpoint(training_args, logger)
    set_seed(training_args.seed)

    files, builder = data_files(data_args, "train", "validation")
    raw = datasets.load_dataset(builder, data_files=files)

    if model_args.tokenizer_name is None:
        raise ValueError("--tokenizer_name: this script trains from scratch and needs a tokenizer directory")
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    model = build_model(model_args, tokenizer)
    if len(tokenizer) > model.config.vocab_size:
        model.resize_token_embeddings(len(tokenizer))

    tokenized = tokenize_datasets(raw, tokenizer, data_args, training_args)
    train_dataset = eval_dataset = None
    if training_args.do_train:
        if "train" not in tokenized:
            raise ValueError("--do_train requires a train_file")
        train_dataset = first_rows(tokenized["train"], data_args.max_train_samples)
    if training_args.do_eval:
        if "validation" not in tokenized:
            raise ValueError("--do_eval requires a validation_file")
        eval_dataset = first_rows(tokenized["validation"], data_args.max_eval_samples)

    pad_to_multiple_of_8 = data_args.line_by_line and training_args.fp16 and not data_args.pad_to_max_length
    data_collator = DataCollatorForLanguageModeling(
        tokenizer=tokenizer,
        mlm_probability=data_args.mlm_probability,
        pad_to_multiple_of=8 if pad_to_multiple_of_8 else None,
    )

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None,
    )

    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint or last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            perplexity = math.exp(metrics["eval_loss"])
        except OverflowError:
            perplexity = float("inf")
        metrics["perplexity"] = perplexity
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    kwargs = {"finetuned_from": None, "tasks": "fill-mask"}
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
