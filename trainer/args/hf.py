"""HF's helpers on ``TrainingArguments`` that example scripts call: process facts, logging and
saving roles, ``main_process_first``, and the dict/JSON views; and the dataclass face the argument
models show ``HfArgumentParser``.

Rank facts come from ``trainer.runtime.distributed``, imported when asked: it loads torch and DeepSpeed, which
reading or validating arguments (``trainer ds-config``) never needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, get_args, get_origin

from trainer.args import hf_fields
from trainer.config import ConfigError, for_zero_init, resolve
from trainer.config.files import load_source

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

logger = logging.getLogger(__name__)


class HFArgumentHelpers:
    """Mixed into ``TrainingArguments``; reads its batch-size and logging fields. (No annotations of
    those fields here: pydantic would take them for fields of this base, declared first.)"""

    @property
    def process_index(self) -> int:
        """This process's global rank."""
        return _dist_info().rank

    @property
    def local_process_index(self) -> int:
        """This process's rank on its node."""
        return _dist_info().local_rank

    @property
    def world_size(self) -> int:
        """Processes in the job (all of them: pipeline stages too)."""
        return _dist_info().world_size

    @property
    def device(self) -> torch.device:
        """This process's device: ``cuda:<local rank>`` on GPUs, else the CPU."""
        from trainer.runtime.distributed import process_device

        return process_device()

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: one on GPUs (one process per GPU, as HF's distributed mode), else 0."""
        return 1 if self.device.type == "cuda" else 0

    @property
    def parallel_mode(self) -> Any:
        """HF's ``ParallelMode``: ``distributed`` when a launcher started several processes."""
        from transformers.training_args import ParallelMode

        return ParallelMode.DISTRIBUTED if self.world_size > 1 else ParallelMode.NOT_PARALLEL

    @property
    def train_batch_size(self) -> int:
        return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        return self.per_device_eval_batch_size

    @property
    def should_log(self) -> bool:
        """Whether this process logs: the main process of each node (``log_on_each_node``) or of the job."""
        return self.local_process_index == 0 if self.log_on_each_node else self.process_index == 0

    @property
    def should_save(self) -> bool:
        """Whether this process writes files: the main process only (HF's save_on_each_node default)."""
        return self.process_index == 0

    def get_process_log_level(self) -> int:
        """This process's log level, as HF's: ``log_level`` where ``should_log``, ``log_level_replica``
        elsewhere; "passive" keeps transformers' current verbosity."""
        from transformers.utils import logging as hf_logging

        name = self.log_level if self.should_log else self.log_level_replica
        return hf_logging.get_verbosity() if name == "passive" else logging.getLevelName(name.upper())

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """The main process (of each node with ``local``, of the job otherwise) runs the block first;
        the others wait at a barrier and run it after, e.g. to reuse a ``datasets.map`` cache. Under
        a launcher it joins the process group if nothing has yet (HF's arguments do too); a world
        of one runs the block at once."""
        from trainer.runtime.distributed import barrier, join_process_group

        info = _dist_info()
        if info.world_size <= 1:
            yield
            return
        join_process_group()
        is_main = info.local_rank == 0 if local else info.is_main
        try:
            if not is_main:
                logger.debug("%d: waiting for the main process to perform %s", info.rank, desc)
                barrier(f"main_process_first: {desc}")
            yield
        finally:
            if is_main:
                logger.debug("%d: main process completed %s, releasing the others", info.rank, desc)
                barrier(f"main_process_first: {desc}")

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON-ready values; a ``*_token`` field that holds a token masked
        (``<HUB_TOKEN>``), as HF's. An unset one stays None (HF masks that too): a mask read back
        would be a token where none was given."""
        return {
            k: f"<{k.upper()}>" if k.endswith("_token") and v is not None else v
            for k, v in super().to_dict().items()
        }

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """``to_dict`` plus the batch sizes, with values other than bool/int/float/str as strings
        (TensorBoard's hparams), as HF's."""
        d = {
            **self.to_dict(),
            "train_batch_size": self.train_batch_size,
            "eval_batch_size": self.eval_batch_size,
        }
        return {k: v if type(v) in (bool, int, float, str) else str(v) for k, v in d.items()}


def _dist_info() -> Any:
    from trainer.runtime.distributed import dist_info

    return dist_info()


class Unstated:
    """The default ``HfArgumentParser`` gives a flag: a flag left out arrives as one, and the argument
    model drops it, so the field stays unset (a ``--deepspeed`` file's concrete values then fill it),
    as with our own flags. ``--help`` shows the real default."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)

    def __str__(self) -> str:
        return str(self.value)


def dataclass_fields(model: type[BaseModel]) -> dict[str, dataclasses.Field]:
    """The ``__dataclass_fields__`` that make an argument model a dataclass to ``HfArgumentParser``
    (and to ``dataclasses.fields``/``asdict``): one field per model field, its description as the
    flag's help. A bool defaulting to True keeps its default, so the parser adds ``--no_<field>``;
    HF's parser reads the default of a field it takes as a list (``list[str] | None`` too) from its
    factory. A refused HF field's help says so."""
    specs = []
    for name, info in model.model_fields.items():
        default = info.get_default(call_default_factory=True)
        shown: dict[str, Any] = {"default": default} if default is True else {"default": Unstated(default)}
        if list in {get_origin(t) for t in (info.annotation, *get_args(info.annotation))}:
            shown = {"default_factory": lambda default=default: Unstated(default)}
        help_text = " ".join(filter(None, (info.description, hf_fields.refused_note(name))))
        specs.append((name, info.annotation, dataclasses.field(**shown, metadata={"help": help_text})))
    return dataclasses.make_dataclass(model.__name__, specs).__dataclass_fields__


# ZeRO knobs sized from the model's hidden size, unknown until the model exists.
HIDDEN_SIZE_KNOBS = [
    f"{prefix}{knob}"
    for knob in ("reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold")
    for prefix in ("", "stage3_")
]


def zero3_init(args: Any) -> Any:
    """What HF's ``TrainingArguments`` does when given a ZeRO-3 DeepSpeed config: register it with
    transformers (``HfDeepSpeedConfig``), so the script's ``from_pretrained``/``from_config`` build the
    model already partitioned over the ranks (``deepspeed.zero.Init``), never whole on each. Returns
    the object to keep alive (transformers holds a weak reference), or None below stage 3.

    The config is resolved as the run's will be, except for the sizes that need the model's hidden
    size: an ``"auto"`` one is left to DeepSpeed's default while the model is built (the Trainer's
    engine then gets the resolved sizes). Nothing happens where transformers is not loaded (no model
    can be built through it yet, and a config tool stays free of torch), or when the config does not
    resolve: the Trainer reports that, naming the keys, before it builds its engine."""
    if (args.deepspeed is None and args.zero_stage != 3) or "transformers" not in sys.modules:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    from trainer.runtime.distributed import detect_hardware, join_process_group, set_world_env

    steps = args.max_steps if args.max_steps > 0 else args.warmup_steps + 1  # the length is not known yet
    try:
        source = load_source(args.deepspeed) if args.deepspeed is not None else None
        for knob in HIDDEN_SIZE_KNOBS:
            if source is not None and (source.get("zero_optimization") or {}).get(knob) == "auto":
                del source["zero_optimization"][knob]
        run = args.model_copy(update={"deepspeed": source})
        hardware = detect_hardware()
        config = resolve(run, _dist_info().world_size, hardware, total_steps=steps)
    except ConfigError:
        return None
    if config.get("zero_optimization", {}).get("stage") != 3:
        return None
    # zero.Init reads the world from the process group: under a launcher it is joined here, as HF's
    # arguments do. A plain `python script.py` only gets the launcher's variables (a world of one):
    # zero.Init then makes its group when a model is built, instead of trying MPI (no mpi4py here),
    # and building arguments in a process that builds no model opens no port.
    if _dist_info().world_size > 1:
        join_process_group()
    else:
        set_world_env()
    init_on_every_rank()
    return HfDeepSpeedConfig(for_zero_init(config))


def init_on_every_rank() -> None:
    """transformers' ``initialize_weights_zero3`` (what ``from_config`` runs under ZeRO-3) gathers
    each module, lets rank 0 initialise it, and marks it initialised on rank 0 alone. A model built
    directly around one built by ``from_config`` (``LlamaForSequenceClassification(config)`` builds
    its body with ``AutoModel.from_config``) then initialises the body again in its own
    ``post_init``, on the other ranks only, where the weights are empty partitions: ``weight[pad]``
    raised there while rank 0 went on and waited. Marked on every rank, the body is left as rank 0
    initialised it."""
    from transformers.integrations import deepspeed as hf_deepspeed

    initialize = hf_deepspeed.initialize_weights_zero3
    if getattr(initialize, "marks_every_rank", False):
        return

    def initialize_weights_zero3(model: Any) -> None:
        initialize(model)
        for module in model.modules():
            module._is_hf_initialized = True

    initialize_weights_zero3.marks_every_rank = True
    hf_deepspeed.initialize_weights_zero3 = initialize_weights_zero3


_ABSENT = object()


def finalize_zero3(args: Any, final: dict[str, Any]) -> dict[str, Any]:
    """What HF's Trainer does with the config its arguments registered (``trainer_config_finalize``):
    the run's final resolution is filled into that same dict, so the engine runs the very object
    ``zero.Init`` partitioned the script's model with. Only the hidden-size sizes left out at
    registration (``zero.Init`` ran with DeepSpeed's defaults for them, as under HF; the engine
    re-marks persistence with the final threshold) are set now. Any other difference in the ZeRO
    section or the dtype would train a model partitioned one way under a config saying another: it
    is refused, naming the key. Returns ``final`` itself where the arguments registered nothing."""
    registered = getattr(args, "_hf_deepspeed", None)
    if registered is None:
        return final
    used = registered.config
    problems = []
    zero_used, zero_final = used.get("zero_optimization", {}), final.get("zero_optimization", {})
    for key in sorted(set(zero_used) | set(zero_final)):
        was, now = zero_used.get(key, _ABSENT), zero_final.get(key, _ABSENT)
        if was != now and not (was is _ABSENT and key in HIDDEN_SIZE_KNOBS):
            problems.append((f"zero_optimization.{key}", _changed(was, now)))
    for dtype in ("bf16", "fp16"):
        was, now = (bool((c.get(dtype) or {}).get("enabled")) for c in (used, final))
        if was != now:
            problems.append((f"{dtype}.enabled", _changed(was, now)))
    if problems:
        raise ConfigError(problems)
    used.clear()
    used.update(final)
    return used


def _changed(was: Any, now: Any) -> str:
    show = lambda v: "unset" if v is _ABSENT else json.dumps(v)  # noqa: E731
    return (
        f"the model was partitioned (zero.Init, with the config the TrainingArguments registered when "
        f"created) with {show(was)}, but the run resolves {show(now)}; set it before creating the "
        "TrainingArguments, then build the model"
    )
