"""What the HF-example-shaped scripts (``run_*_shaped.py``) share, as transformers' examples each
write it inline: parsing the argument dataclasses (flags, or one ``.json`` file), logging set-up, the
checkpoint to resume, and cutting a split to its first N rows.

Nothing here touches a Trainer: each script's own import line decides whose Trainer runs.
"""

import logging
import os
import sys

import datasets
import transformers
from transformers import HfArgumentParser
from transformers.trainer_utils import get_last_checkpoint


def parse_arguments(*dataclass_types):
    """The dataclasses parsed by ``HfArgumentParser``: from one ``.json`` argument, else from flags."""
    parser = HfArgumentParser(dataclass_types)
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        return parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    return parser.parse_args_into_dataclasses()


def setup_logging(training_args, logger: logging.Logger) -> None:
    """HF's examples' logging: the main process tells more; every rank states where it runs."""
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    level = training_args.get_process_log_level()
    logger.setLevel(level)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()
    logger.warning(
        f"Process rank: {training_args.process_index}, device: {training_args.device}, "
        f"world size: {training_args.world_size}, distributed training: {training_args.world_size > 1}"
    )
    logger.info(f"Training/evaluation parameters {training_args}")


def detect_last_checkpoint(training_args, logger: logging.Logger) -> str | None:
    """The newest checkpoint in ``output_dir`` when training, which ``train()`` then resumes."""
    if not (os.path.isdir(training_args.output_dir) and training_args.do_train):
        return None
    last_checkpoint = get_last_checkpoint(training_args.output_dir)
    if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
        logger.info(f"Checkpoint found at {last_checkpoint}: training resumes from it.")
    return last_checkpoint


def first_rows(dataset, max_samples: int | None):
    """The dataset's first ``max_samples`` rows (all of them when ``None``)."""
    if max_samples is None:
        return dataset
    return dataset.select(range(min(len(dataset), max_samples)))


def data_files(data_args, *splits: str) -> tuple[dict[str, str], str]:
    """``{"train": path, ...}`` for the ``<split>_file`` arguments given, and the ``datasets`` builder
    their extension names (``.txt`` is the ``text`` builder; ``.jsonl`` is ``json``)."""
    files = {split: getattr(data_args, f"{split}_file") for split in splits}
    files = {split: path for split, path in files.items() if path is not None}
    if not files:
        raise ValueError(f"give at least one of: {', '.join(f'--{s}_file' for s in splits)}")
    extensions = {path.rsplit(".", 1)[-1] for path in files.values()}
    if len(extensions) != 1:
        raise ValueError(f"the data files must share one extension, got {sorted(extensions)}")
    extension = extensions.pop()
    builder = {"txt": "text", "jsonl": "json"}.get(extension, extension)
    if builder not in ("text", "csv", "json"):
        raise ValueError(f"data files must be .txt, .csv, .json or .jsonl, got .{extension}")
    return files, builder
