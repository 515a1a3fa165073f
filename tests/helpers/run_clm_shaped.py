"""A causal-LM training script in the shape of transformers' language-modeling example (run_clm):
argument dataclasses parsed by ``HfArgumentParser`` (flags, or one ``.json`` file), local text files
through ``datasets``, tokenisation under ``main_process_first``, text grouped into blocks, a model
built from a config, then train / save / evaluate with the result files HF's examples write, and
the model card (``README.md``).

Its only trainer-specific line is the ``Trainer, TrainingArguments`` import below: the test runs it
as it is (HF's Trainer) and with that line swapped for ``from trainer import ...`` (ours).
Usage: ``run_clm_shaped.py --tokenizer_name DIR --train_file A.txt --validation_file B.txt
--output_dir OUT [--do_train] [--do_eval] ...`` or ``run_clm_shaped.py args.json``.
"""

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain

import datasets
import numpy as np
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

# isort: off
from transformers import Trainer, TrainingArguments  # the test swaps this line for ours
# isort: on

logger = logging.getLogger(__name__)

# A model small enough for two CPU ranks; --config_overrides changes any of it.
TINY_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
}


@dataclass
class ModelArguments:
    """Which model to build and with which tokenizer."""

    model_type: str = field(default="llama", metadata={"help": "Architecture built from scratch."})
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "Config fields over the tiny defaults, as 'hidden_size=32,num_hidden_layers=1'."},
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "A local tokenizer directory (save_pretrained's)."}
    )


@dataclass
class DataTrainingArguments:
    """Which text to train and evaluate on, and how to cut it."""

    train_file: str | None = field(default=None, metadata={"help": "A text file, one example a line."})
    validation_file: str | None = field(default=None, metadata={"help": "A text file to evaluate on."})
    block_size: int | None = field(default=None, metadata={"help": "Tokens per block (default: 128)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N train blocks."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N eval blocks."})
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "Processes for the dataset maps."}
    )
    overwrite_cache: bool = field(default=False, metadata={"help": "Redo the maps even if cached."})

    def __post_init__(self):
        for name in ("train_file", "validation_file"):
            path = getattr(self, name)
            if path is not None and not path.endswith((".txt", ".text")):
                raise ValueError(f"--{name} must be a .txt file, got {path}")


def parse_arguments():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        return parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    return parser.parse_args_into_dataclasses()


def setup_logging(training_args):
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()  # the main process tells more
    level = training_args.get_process_log_level()
    logger.setLevel(level)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()


def build_model(model_args, tokenizer):
    config = AutoConfig.for_model(
        model_args.model_type,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **TINY_LLAMA,
    )
    if model_args.config_overrides:
        logger.info(f"Overriding config: {model_args.config_overrides}")
        config.update_from_string(model_args.config_overrides)
    model = AutoModelForCausalLM.from_config(config)
    # Under ZeRO-3's zero.Init a parameter holds only its shard: ds_numel is its full size.
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    logger.info(f"Training a new model from scratch: {n_params / 2**20:.3f}M parameters")
    logger.warning(f"Built partitioned by ZeRO-3: {hasattr(next(model.parameters()), 'ds_id')}")
    return model


def lm_blocks(raw, tokenizer, data_args, training_args):
    """Tokenise every line, then cut the concatenated ids into ``block_size`` blocks (the remainder
    dropped), each with its ``labels`` (the model shifts them)."""
    columns = raw["train" if training_args.do_train else "validation"].column_names
    text_column = "text" if "text" in columns else columns[0]

    def tokenize(examples):
        return tokenizer(examples[text_column])

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized = raw.map(
            tokenize,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            remove_columns=columns,
            load_from_cache_file=not data_args.overwrite_cache,
            desc="Running tokenizer on dataset",
        )

    block_size = data_args.block_size or 128
    if block_size > tokenizer.model_max_length:
        logger.warning(f"block_size {block_size} exceeds the tokenizer's {tokenizer.model_max_length}")
        block_size = tokenizer.model_max_length

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples}
        usable = (len(joined["input_ids"]) // block_size) * block_size
        blocks = {
            k: [ids[i : i + block_size] for i in range(0, usable, block_size)] for k, ids in joined.items()
        }
        blocks["labels"] = [list(ids) for ids in blocks["input_ids"]]
        return blocks

    with training_args.main_process_first(desc="grouping texts together"):
        return tokenized.map(
            group_texts,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            load_from_cache_file=not data_args.overwrite_cache,
            desc=f"Grouping texts in chunks of {block_size}",
        )


def preprocess_logits_for_metrics(logits, labels):
    if isinstance(logits, tuple):  # a model may return extra tensors after the logits
        logits = logits[0]
    return logits.argmax(dim=-1)


def compute_metrics(eval_preds):
    """Next-token accuracy: the prediction at position t is scored against the label at t + 1."""
    preds, labels = eval_preds
    preds, labels = np.asarray(preds)[:, :-1], np.asarray(labels)[:, 1:]
    mask = labels != -100
    return {"accuracy": float((preds[mask] == labels[mask]).mean()) if mask.any() else 0.0}


def main():
    model_args, data_args, training_args = parse_arguments()
    setup_logging(training_args)
    logger.warning(
        f"Process rank: {training_args.process_index}, device: {training_args.device}, "
        f"world size: {training_args.world_size}, distributed training: {training_args.world_size > 1}"
    )
    logger.info(f"Training/evaluation parameters {training_args}")

    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
            logger.info(f"Checkpoint found at {last_checkpoint}: training resumes from it.")

    set_seed(training_args.seed)

    data_files = {}
    if data_args.train_file is not None:
        data_files["train"] = data_args.train_file
    if data_args.validation_file is not None:
        data_files["validation"] = data_args.validation_file
    raw = datasets.load_dataset("text", data_files=data_files)

    if model_args.tokenizer_name is None:
        raise ValueError("--tokenizer_name: this script trains from scratch and needs a tokenizer directory")
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    model = build_model(model_args, tokenizer)
    # Grow the embedding only if the tokenizer outgrew the config (the config's size: a weight
    # partitioned by ZeRO-3 shows no rows).
    if len(tokenizer) > model.config.vocab_size:
        model.resize_token_embeddings(len(tokenizer))

    lm_datasets = lm_blocks(raw, tokenizer, data_args, training_args)

    train_dataset = eval_dataset = None
    if training_args.do_train:
        if "train" not in lm_datasets:
            raise ValueError("--do_train requires a train_file")
        train_dataset = lm_datasets["train"]
        if data_args.max_train_samples is not None:
            train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))
    if training_args.do_eval:
        if "validation" not in lm_datasets:
            raise ValueError("--do_eval requires a validation_file")
        eval_dataset = lm_datasets["validation"]
        if data_args.max_eval_samples is not None:
            eval_dataset = eval_dataset.select(range(min(len(eval_dataset), data_args.max_eval_samples)))

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        compute_metrics=compute_metrics if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None,
    )

    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint or last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()  # the tokenizer goes with it

        metrics = train_result.metrics
        n_train = len(train_dataset)
        metrics["train_samples"] = min(n_train, data_args.max_train_samples or n_train)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        n_eval = len(eval_dataset)
        metrics["eval_samples"] = min(n_eval, data_args.max_eval_samples or n_eval)
        try:
            perplexity = math.exp(metrics["eval_loss"])
        except OverflowError:
            perplexity = float("inf")
        metrics["perplexity"] = perplexity
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    kwargs = {"finetuned_from": None, "tasks": "text-generation"}
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
