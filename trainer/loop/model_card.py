"""The model card ``Trainer.create_model_card`` writes: ``output_dir/README.md`` in the shape of HF's
(YAML metadata, what the model is, the training hyperparameters, the results table, the framework
versions), made from what the run itself knows: its arguments, the DeepSpeed config it ran, its
world, and ``state.log_history``. Nothing is looked up on the hub, so a card written offline is the
same as one written online.

The hyperparameters are the ones that ran: the optimizer and precision come from the resolved
DeepSpeed config (a ``--deepspeed`` file's values included), not from defaults the config overrode.
"""

from __future__ import annotations

import importlib.metadata
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from transformers.modelcard import METRIC_TAGS, TASK_MAPPING, TASK_TAG_TO_NAME_MAPPING

from trainer.runtime.mesh import Mesh

CARD_NAME = "README.md"
TRAINER_TAG = "generated_from_trainer"  # HF's tag for a card its Trainer wrote; hub filters use it
# Dataset builders that name a file format, not a dataset (HF leaves them out of the card too).
LOCAL_BUILDERS = frozenset({"csv", "json", "pandas", "parquet", "text", "arrow", "generator"})
# Eval-row keys that describe the evaluation run, not the model.
EVAL_SPEED_KEYS = frozenset({"runtime", "samples_per_second", "steps_per_second", "epoch", "step"})
FRAMEWORKS = {
    "ds-llm-trainer": "ds-llm-trainer",
    "Transformers": "transformers",
    "PyTorch": "torch",
    "DeepSpeed": "deepspeed",
    "Datasets": "datasets",
    "Tokenizers": "tokenizers",
}


@dataclass
class ModelCard:
    """Everything a card says; ``render`` writes it as markdown."""

    model_name: str
    finetuned_from: str | None = None
    language: list[str] = field(default_factory=list)
    license: str | None = None
    tags: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    dataset: list[str] = field(default_factory=list)
    dataset_tags: list[str] = field(default_factory=list)
    dataset_args: list[str] = field(default_factory=list)
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    log_history: list[dict[str, Any]] = field(default_factory=list)

    def render(self) -> str:
        results = eval_results(self.log_history)
        parts = [f"---\n{yaml.safe_dump(self.metadata(results), sort_keys=False)}---\n\n"]
        parts.append(
            "<!-- Written by the Trainer's create_model_card from the run's arguments, its DeepSpeed "
            "config and its log history. Proofread and complete it. -->\n\n"
        )
        parts.append(f"# {self.model_name}\n\n{self._summary()}")
        if results:
            parts.append("It achieves the following results on the evaluation set:\n")
            parts.append("".join(f"- {_title(k)}: {_cell(v)}\n" for k, v in results.items()))
        parts.append("\n## Model description\n\nMore information needed\n")
        parts.append("\n## Intended uses & limitations\n\nMore information needed\n")
        parts.append("\n## Training and evaluation data\n\nMore information needed\n")
        parts.append("\n## Training procedure\n\n### Training hyperparameters\n\n")
        parts.append("The following hyperparameters were used during training:\n")
        parts.append("".join(f"- {k}: {v}\n" for k, v in self.hyperparameters.items()))
        rows = results_rows(self.log_history)
        if rows:
            parts.append(f"\n### Training results\n\n{markdown_table(rows)}")
        parts.append("\n### Framework versions\n\n")
        parts.append("".join(f"- {name} {version}\n" for name, version in framework_versions().items()))
        return "".join(parts)

    def _summary(self) -> str:
        if self.finetuned_from:
            origin = (
                f"This model is a fine-tuned version of [{self.finetuned_from}]"
                f"(https://huggingface.co/{self.finetuned_from}) on "
            )
        else:
            origin = "This model was trained from scratch on "
        names = [f"the {name}" for name in self.dataset]
        if not names:
            data = "an unknown dataset."
        elif len(names) == 1:
            data = f"{names[0]} dataset."
        else:
            data = f"{', '.join(names[:-1])} and {names[-1]} datasets."
        return f"{origin}{data}\n"

    def metadata(self, results: dict[str, Any] | None) -> dict[str, Any]:
        """The card's YAML header, with HF's keys (the hub reads them)."""
        meta: dict[str, Any] = {"library_name": "transformers"}
        if self.language:
            meta["language"] = self.language
        if self.license:
            meta["license"] = self.license
        if self.finetuned_from:
            meta["base_model"] = self.finetuned_from
        meta["tags"] = self.tags
        if self.dataset_tags:
            meta["datasets"] = self.dataset_tags
        tagged = {k: v for k, v in (results or {}).items() if k in METRIC_TAGS}  # metrics the hub knows
        if tagged:
            meta["metrics"] = list(tagged)
        meta["model-index"] = [{"name": self.model_name, "results": self._index_results(tagged)}]
        return meta

    def _index_results(self, results: dict[str, Any]) -> list[dict[str, Any]]:
        """One entry per (task, dataset) with the final eval metrics the hub knows (accuracy, f1,
        ...; not the loss); an entry without all three is left out, as the hub rejects it."""
        metrics = [{"name": _title(k), "type": k, "value": _plain(v)} for k, v in results.items()]
        if not (self.tasks and self.dataset_tags and metrics):
            return []
        entries = []
        names = self.dataset or self.dataset_tags
        for task in self.tasks:
            for i, tag in enumerate(self.dataset_tags):
                dataset: dict[str, Any] = {"name": names[min(i, len(names) - 1)], "type": tag}
                if i < len(self.dataset_args) and self.dataset_args[i]:
                    dataset["args"] = self.dataset_args[i]
                task_entry = {"type": task, "name": TASK_TAG_TO_NAME_MAPPING.get(task, task)}
                entries.append({"task": task_entry, "dataset": dataset, "metrics": metrics})
        return entries


def hyperparameters(
    args: Any, ds_config: dict[str, Any] | None, mesh: Mesh, client_optimizer: Any
) -> dict[str, Any]:
    """The hyperparameters of the run, HF's names first, then DeepSpeed's layout."""
    ds, world_size, data_ranks = ds_config or {}, mesh.world_size, mesh.readers
    hp: dict[str, Any] = {
        "learning_rate": args.learning_rate,
        "train_batch_size": args.per_device_train_batch_size,
        "eval_batch_size": args.per_device_eval_batch_size,
        "seed": args.seed,
    }
    if args.data_seed is not None:
        hp["data_seed"] = args.data_seed
    hp["distributed_type"] = _distributed_type(args, ds, mesh)
    if world_size > 1:
        hp["num_devices"] = world_size
    if args.gradient_accumulation_steps > 1:
        hp["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    total = ds.get("train_batch_size") or (
        args.per_device_train_batch_size * args.gradient_accumulation_steps * data_ranks
    )
    if total != args.per_device_train_batch_size:
        hp["total_train_batch_size"] = total
    if args.per_device_eval_batch_size * data_ranks != args.per_device_eval_batch_size:
        hp["total_eval_batch_size"] = args.per_device_eval_batch_size * data_ranks
    hp["optimizer"] = _optimizer(args, ds, client_optimizer)
    if args.weight_decay:
        hp["weight_decay"] = args.weight_decay
    hp["max_grad_norm"] = ds.get("gradient_clipping", args.max_grad_norm)
    hp["lr_scheduler_type"] = args.lr_scheduler_type
    if args.lr_scheduler_kwargs:
        hp["lr_scheduler_kwargs"] = args.lr_scheduler_kwargs
    if args.warmup_steps:
        hp["lr_scheduler_warmup_steps"] = args.warmup_steps
    elif args.warmup_ratio:
        hp["lr_scheduler_warmup_ratio"] = args.warmup_ratio
    if args.max_steps != -1:
        hp["training_steps"] = args.max_steps
    else:
        hp["num_epochs"] = args.num_train_epochs
    precision = next((p for p in ("bf16", "fp16") if (ds.get(p) or {}).get("enabled") is True), None)
    if precision is None and not ds:
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    if precision:
        hp["mixed_precision_training"] = precision
    if args.gradient_checkpointing:
        hp["gradient_checkpointing"] = True
    return hp


def _distributed_type(args: Any, ds: dict[str, Any], mesh: Mesh) -> str:
    """DeepSpeed's layout: the ZeRO stage, offload, and the mesh's pipeline, sequence and tensor sizes."""
    zero = ds.get("zero_optimization") or {}
    if ds:
        stage = zero.get("stage", 0)
    elif args.deepspeed is None:
        stage = args.zero_stage
    else:
        return (
            f"DeepSpeed (config {args.deepspeed if isinstance(args.deepspeed, str) else 'given as a dict'})"
        )
    parts = [f"DeepSpeed ZeRO-{stage}"]
    for what in ("optimizer", "param"):
        device = (zero.get(f"offload_{what}") or {}).get("device") if ds else getattr(args, f"offload_{what}")
        if device not in (None, "none"):
            parts.append(f"{what} offload to {device}")
    for name in ("pipeline", "sequence", "tensor"):
        if getattr(mesh, name) > 1:
            parts.append(f"{name}_parallel_size {getattr(mesh, name)}")
    return ", ".join(parts)


def _optimizer(args: Any, ds: dict[str, Any], client_optimizer: Any) -> str:
    if client_optimizer is not None:
        return f"{type(client_optimizer).__name__}, passed to the Trainer"
    section = ds.get("optimizer")
    if section:
        params = ", ".join(f"{k}={_plain(v)}" for k, v in (section.get("params") or {}).items())
        if section.get("type") == "Muon":  # ours, built from the section
            return f"Use Muon on the hidden matrices and AdamW on the rest ({params})"
        return f"Use {args.optim} (DeepSpeed {section.get('type')}: {params})"
    if args.optim == "lars":
        return f"Use lars with weight_decay={args.weight_decay} and optim_args={args.optim_args or 'its defaults'}"
    return (
        f"Use {args.optim} with betas=({args.adam_beta1},{args.adam_beta2}) and epsilon={args.adam_epsilon}"
    )


def eval_results(log_history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The metrics of the last evaluation (``eval_`` stripped), without its speed."""
    last = next((row for row in reversed(log_history) if "eval_loss" in row), None)
    if last is None:
        return None
    results = {}
    for key, value in last.items():
        name = key.removeprefix("eval_")
        if key.startswith("eval_") and name not in EVAL_SPEED_KEYS:
            results[name] = value
    return results


def results_rows(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step that logged a training loss or an evaluation, in the order they were
    logged: the step's training loss ("No log" if it logged none), epoch, step, the validation loss
    and any other eval metric (columns only when some evaluation ran). A step logged twice (a
    rollback re-ran it) keeps its last values."""
    by_step: dict[int, dict[str, Any]] = {}
    metric_names: list[str] = []
    for row in log_history:
        is_train = "loss" in row and "train_runtime" not in row
        if not (is_train or "eval_loss" in row) or "step" not in row:
            continue
        line = by_step.setdefault(row["step"], {"Training Loss": "No log"})
        line["Epoch"], line["Step"] = row.get("epoch", "-"), row["step"]
        if is_train:
            line["Training Loss"] = row["loss"]
            continue
        line["Validation Loss"] = row["eval_loss"]
        for key, value in row.items():
            name = key.removeprefix("eval_")
            if key.startswith("eval_") and name not in EVAL_SPEED_KEYS | {"loss"}:
                line[_title(name)] = value
                if _title(name) not in metric_names:
                    metric_names.append(_title(name))
    columns = ["Training Loss", "Epoch", "Step"]
    if any("Validation Loss" in line for line in by_step.values()):
        columns += ["Validation Loss", *metric_names]
    return [{c: line.get(c, "-") for c in columns} for line in by_step.values()]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table, columns centred and padded to their widest cell."""
    columns = list(rows[0])
    cells = [[_cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(columns)]

    def line(values: list[str]) -> str:
        return "".join(f"| {v:<{w}} " for v, w in zip(values, widths, strict=True)) + "|\n"

    rule = "".join(f"|:{'-' * w}:" for w in widths) + "|\n"
    return line(columns) + rule + "".join(line(values) for values in cells)


def framework_versions() -> dict[str, str]:
    """The installed versions of this project and the libraries a run depends on."""
    versions = {}
    for name, dist in FRAMEWORKS.items():
        try:
            versions[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def task_of(model: Any) -> list[str]:
    """HF's task tag of a model class (``text-generation`` for a causal LM, ...), if it has one."""
    name = type(model).__name__
    return [task for task, mapping in TASK_MAPPING.items() if name in _class_names(mapping)][:1]


def dataset_defaults(dataset: Any) -> tuple[list[str], list[str]]:
    """(tags, args) of a hub dataset as HF's card takes them: its builder and configuration. Local
    files and in-memory datasets name no dataset."""
    builder = getattr(dataset, "builder_name", None)
    if not builder or builder in LOCAL_BUILDERS:
        return [], []
    config = getattr(dataset, "config_name", None)
    return [builder], [config] if config else []


def existing_tags(path: Path) -> list[str]:
    """The tags of a card already at ``path`` (HF keeps them when it writes a new one)."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8")
    if not text.startswith("---\n") or "\n---" not in text[4:]:
        return []
    header = yaml.safe_load(text[4 : text.index("\n---", 4)]) or {}
    tags = header.get("tags") if isinstance(header, dict) else None
    return [str(t) for t in tags] if isinstance(tags, list) else []


def as_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _class_names(mapping: dict[str, Any]) -> set[str]:
    names: set[str] = set()
    for value in mapping.values():
        names.update(value if isinstance(value, tuple | list) else [value])
    return names


def _title(key: str) -> str:
    return " ".join(part.capitalize() for part in key.split("_"))


def _plain(value: Any) -> Any:
    """A YAML-safe scalar (numpy and torch numbers become Python's)."""
    return value.item() if hasattr(value, "item") and callable(value.item) else value


def _cell(value: Any) -> str:
    """A table cell: floats to at most 4 decimals, as HF's card shows them."""
    value = _plain(value)
    if isinstance(value, float) and math.isfinite(value) and len(repr(value).partition(".")[2]) > 4:
        return f"{value:.4f}"
    return str(value)
