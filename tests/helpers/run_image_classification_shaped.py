"""An image-classification training script in the shape of transformers' image-classification example
(run_image_classification): argument dataclasses parsed by ``HfArgumentParser``, local image folders
(``<dir>/<label>/<image>``) through ``datasets``' ``imagefolder`` builder, the classes from the
folder names, a ViT built from a config, an image processor built here from its arguments, images
turned into pixel values on the fly (``with_transform``), a collate function stacking them, then
train / save / evaluate and the model card.

transformers' example augments training images with torchvision; this one gives every image the
image processor's resize and normalisation only, so it needs no torchvision. As with HF's example,
run it with ``--remove_unused_columns false``: the transform reads the ``image`` column.

Its only trainer-specific line is the ``Trainer, TrainingArguments`` import below: the tests run it
as it is (HF's Trainer) and with that line swapped for ``from trainer import ...`` (ours).
"""

import logging
import os
from dataclasses import dataclass, field

import datasets
import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoModelForImageClassification,
    ViTImageProcessor,
    set_seed,
)

from tests.helpers.hf_example_common import (
    detect_last_checkpoint,
    first_rows,
    parse_arguments,
    setup_logging,
)

# isort: off
from transformers import Trainer, TrainingArguments  # the test swaps this line for ours
# isort: on

logger = logging.getLogger(__name__)

TINY_VIT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 4,
    "num_channels": 3,
}


@dataclass
class ModelArguments:
    model_type: str = field(default="vit", metadata={"help": "Architecture built from scratch."})
    config_overrides: str | None = field(
        default=None, metadata={"help": "Config fields over the tiny defaults, as 'hidden_size=16'."}
    )
    image_size: int = field(default=16, metadata={"help": "Height and width the images are resized to."})


@dataclass
class DataTrainingArguments:
    train_dir: str | None = field(default=None, metadata={"help": "A folder of <label>/<image> files."})
    validation_dir: str | None = field(default=None, metadata={"help": "The same, to evaluate on."})
    image_column_name: str = field(default="image", metadata={"help": "The column of images."})
    label_column_name: str = field(default="label", metadata={"help": "The column of labels."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N train rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N eval rows."})

    def __post_init__(self):
        if self.train_dir is None and self.validation_dir is None:
            raise ValueError("give --train_dir, --validation_dir or both")


def collate_fn(examples):
    return {
        "pixel_values": torch.stack([example["pixel_values"] for example in examples]),
        "labels": torch.tensor([example["label"] for example in examples]),
    }


def compute_metrics(p):
    return {"accuracy": float((np.argmax(p.predictions, axis=1) == p.label_ids).mean())}


def main():
    model_args, data_args, training_args = parse_arguments(
        ModelArguments, DataTrainingArguments, TrainingArguments
    )
    setup_logging(training_args, logger)
    last_checkpoint = detect_last_checkpoint(training_args, logger)
    set_seed(training_args.seed)

    files = {}
    if data_args.train_dir is not None:
        files["train"] = os.path.join(data_args.train_dir, "**")
    if data_args.validation_dir is not None:
        files["validation"] = os.path.join(data_args.validation_dir, "**")
    dataset = datasets.load_dataset("imagefolder", data_files=files)

    first_split = "train" if "train" in dataset else "validation"
    labels = dataset[first_split].features[data_args.label_column_name].names
    label2id = {label: i for i, label in enumerate(labels)}
    config = AutoConfig.for_model(
        model_args.model_type,
        num_labels=len(labels),
        label2id=label2id,
        id2label=dict(enumerate(labels)),
        image_size=model_args.image_size,
        **TINY_VIT,
    )
    if model_args.config_overrides:
        config.update_from_string(model_args.config_overrides)
    model = AutoModelForImageClassification.from_config(config)
    image_processor = ViTImageProcessor(
        do_resize=True,
        size={"height": model_args.image_size, "width": model_args.image_size},
        do_normalize=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )

    def transforms(batch):
        images = [image.convert("RGB") for image in batch[data_args.image_column_name]]
        pixels = image_processor(images, return_tensors="pt")["pixel_values"]
        batch["pixel_values"] = list(pixels)
        return batch

    train_dataset = eval_dataset = None
    if training_args.do_train:
        if "train" not in dataset:
            raise ValueError("--do_train requires a train_dir")
        with training_args.main_process_first(desc="train split"):
            if data_args.max_train_samples is not None:
                dataset["train"] = dataset["train"].shuffle(seed=training_args.seed)
            train_dataset = first_rows(dataset["train"], data_args.max_train_samples).with_transform(
                transforms
            )
    if training_args.do_eval:
        if "validation" not in dataset:
            raise ValueError("--do_eval requires a validation_dir")
        eval_dataset = first_rows(dataset["validation"], data_args.max_eval_samples).with_transform(
            transforms
        )

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        compute_metrics=compute_metrics,
        processing_class=image_processor,
        data_collator=collate_fn,
    )

    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint or last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", train_result.metrics)
        trainer.save_metrics("train", train_result.metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    kwargs = {
        "finetuned_from": None,
        "tasks": "image-classification",
        "tags": ["image-classification", "vision"],
    }
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
