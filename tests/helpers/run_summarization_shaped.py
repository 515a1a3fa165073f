"""A summarization training script in the shape of transformers' summarization example
(run_summarization): argument dataclasses parsed by ``HfArgumentParser``, local CSV or JSON files of
texts and summaries through ``datasets``, sources (with an optional prefix, as T5 takes) and targets
tokenised under ``main_process_first``, a T5 built from a config, ``DataCollatorForSeq2Seq``,
``Seq2SeqTrainer`` with ``--predict_with_generate`` scoring generated summaries by a plain ROUGE-1
function, then train / save / evaluate / predict (``generated_predictions.txt``) and the model card.

Its only trainer-specific line is the ``Seq2SeqTrainer, Seq2SeqTrainingArguments`` import below: the
tests run it as it is (HF's) and with that line swapped for ``from trainer import ...`` (ours).
"""

import logging
import os
from collections import Counter
from dataclasses import dataclass, field

import datasets
import numpy as np
from transformers import (
    AutoConfig,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
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
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments  # the test swaps this line for ours
# isort: on

logger = logging.getLogger(__name__)

TINY_T5 = {
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
}


@dataclass
class ModelArguments:
    model_type: str = field(default="t5", metadata={"help": "Architecture built from scratch."})
    config_overrides: str | None = field(
        default=None, metadata={"help": "Config fields over the tiny defaults, as 'd_model=16'."}
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "A local tokenizer directory."})


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None, metadata={"help": "A .csv or .json file."})
    validation_file: str | None = field(default=None, metadata={"help": "A file to evaluate on."})
    test_file: str | None = field(default=None, metadata={"help": "A file to predict on."})
    text_column: str = field(default="text", metadata={"help": "The column of full texts."})
    summary_column: str = field(default="summary", metadata={"help": "The column of summaries."})
    source_prefix: str = field(default="", metadata={"help": "Put before every source ('summarize: ')."})
    max_source_length: int = field(default=64, metadata={"help": "Source tokens, truncated beyond."})
    max_target_length: int = field(default=16, metadata={"help": "Target tokens for training."})
    val_max_target_length: int | None = field(
        default=None,
        metadata={"help": "Target tokens when evaluating and generating (default: max_target_length)."},
    )
    pad_to_max_length: bool = field(default=False, metadata={"help": "Pad to the maximum lengths."})
    ignore_pad_token_for_loss: bool = field(
        default=True, metadata={"help": "Padded label positions are left out of the loss."}
    )
    num_beams: int | None = field(default=None, metadata={"help": "Beams for evaluate and predict."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N train rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N eval rows."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Keep the first N test rows."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for maps."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Redo the maps even if cached."})

    def __post_init__(self):
        if self.val_max_target_length is None:
            self.val_max_target_length = self.max_target_length


def rouge1(prediction: str, reference: str) -> float:
    """ROUGE-1 F-measure: the unigrams two texts share, over each one's count."""
    pred, ref = Counter(prediction.split()), Counter(reference.split())
    overlap = sum((pred & ref).values())
    if not overlap:
        return 0.0
    precision, recall = overlap / sum(pred.values()), overlap / sum(ref.values())
    return 2 * precision * recall / (precision + recall)


def main():
    model_args, data_args, training_args = parse_arguments(
        ModelArguments, DataTrainingArguments, Seq2SeqTrainingArguments
    )
    setup_logging(training_args, logger)
    last_checkpoint = detect_last_checkpoint(training_args, logger)
    set_seed(training_args.seed)

    files, builder = data_files(data_args, "train", "validation", "test")
    raw = datasets.load_dataset(builder, data_files=files)

    if model_args.tokenizer_name is None:
        raise ValueError("--tokenizer_name: this script trains from scratch and needs a tokenizer directory")
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    config = AutoConfig.for_model(
        model_args.model_type,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        **TINY_T5,
    )
    if model_args.config_overrides:
        config.update_from_string(model_args.config_overrides)
    model = AutoModelForSeq2SeqLM.from_config(config)
    if model.config.decoder_start_token_id is None:
        raise ValueError("the model's config needs a decoder_start_token_id")

    prefix = data_args.source_prefix
    padding = "max_length" if data_args.pad_to_max_length else False

    def preprocess(examples, max_target_length):
        pairs = [
            (text, summary)
            for text, summary in zip(
                examples[data_args.text_column], examples[data_args.summary_column], strict=True
            )
            if text and summary
        ]
        inputs = [prefix + text for text, _ in pairs]
        model_inputs = tokenizer(
            inputs, max_length=data_args.max_source_length, padding=padding, truncation=True
        )
        labels = tokenizer(
            text_target=[summary for _, summary in pairs],
            max_length=max_target_length,
            padding=padding,
            truncation=True,
        )["input_ids"]
        if padding == "max_length" and data_args.ignore_pad_token_for_loss:
            labels = [[(t if t != tokenizer.pad_token_id else -100) for t in row] for row in labels]
        model_inputs["labels"] = labels
        return model_inputs

    def tokenized(split: str, max_samples: int | None, max_target_length: int):
        if split not in raw:
            raise ValueError(f"--do_{'predict' if split == 'test' else split} needs a {split}_file")
        rows = first_rows(raw[split], max_samples)
        with training_args.main_process_first(desc=f"{split} dataset map pre-processing"):
            return rows.map(
                preprocess,
                fn_kwargs={"max_target_length": max_target_length},
                batched=True,
                num_proc=data_args.preprocessing_num_workers,
                remove_columns=rows.column_names,
                load_from_cache_file=not data_args.overwrite_cache,
                desc=f"Running tokenizer on the {split} split",
            )

    train_dataset = eval_dataset = predict_dataset = None
    if training_args.do_train:
        train_dataset = tokenized("train", data_args.max_train_samples, data_args.max_target_length)
    if training_args.do_eval:
        eval_dataset = tokenized("validation", data_args.max_eval_samples, data_args.val_max_target_length)
    if training_args.do_predict:
        predict_dataset = tokenized("test", data_args.max_predict_samples, data_args.val_max_target_length)

    label_pad_token_id = -100 if data_args.ignore_pad_token_for_loss else tokenizer.pad_token_id
    data_collator = DataCollatorForSeq2Seq(
        tokenizer,
        model=model,
        label_pad_token_id=label_pad_token_id,
        pad_to_multiple_of=8 if training_args.fp16 else None,
    )

    def decode(ids) -> list[str]:
        ids = np.where(np.asarray(ids) != -100, ids, tokenizer.pad_token_id)
        return [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        if isinstance(preds, tuple):
            preds = preds[0]
        predictions, references = decode(preds), decode(labels)
        scores = [rouge1(p, r) for p, r in zip(predictions, references, strict=True)]
        lengths = [np.count_nonzero(row != tokenizer.pad_token_id) for row in np.asarray(preds)]
        return {"rouge1": round(100 * float(np.mean(scores)), 4), "gen_len": float(np.mean(lengths))}

    # The generation settings evaluate and predict use: the script's, else the arguments'.
    training_args.generation_max_length = (
        training_args.generation_max_length or data_args.val_max_target_length
    )
    training_args.generation_num_beams = data_args.num_beams or training_args.generation_num_beams

    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics if training_args.predict_with_generate else None,
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

    max_length = training_args.generation_max_length
    num_beams = training_args.generation_num_beams
    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate(max_length=max_length, num_beams=num_beams, metric_key_prefix="eval")
        metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    if training_args.do_predict:
        logger.info("*** Predict ***")
        results = trainer.predict(
            predict_dataset, metric_key_prefix="predict", max_length=max_length, num_beams=num_beams
        )
        metrics = results.metrics
        metrics["predict_samples"] = len(predict_dataset)
        trainer.log_metrics("predict", metrics)
        trainer.save_metrics("predict", metrics)
        if trainer.is_world_process_zero() and training_args.predict_with_generate:
            with open(os.path.join(training_args.output_dir, "generated_predictions.txt"), "w") as writer:
                writer.write("\n".join(decode(results.predictions)) + "\n")

    kwargs = {"finetuned_from": None, "tasks": "summarization"}
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
