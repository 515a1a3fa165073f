"""One run, on one process, counting what the run plan promises to do once: resolutions of the
DeepSpeed config, process-group starts, and the config ``zero.Init`` partitions with against the
one the engine is built from. ``python tests/helpers/count_run.py cli OUT [scripts/train.py flags]``
runs ``scripts/train.py`` as the launcher would; ``... api OUT`` a hand-built ``Trainer``. Writes
``OUT/counts.json``.
"""

from __future__ import annotations

import copy
import inspect
import json
import runpy
import sys
from collections import Counter
from pathlib import Path

import deepspeed
import torch.distributed as dist

import trainer.cli.train  # noqa: F401  (every module that binds the functions counted below)
import trainer.config.resolution
import trainer.loop.build
import trainer.runtime.distributed

ROOT = Path(__file__).resolve().parents[2]
mode, out = sys.argv[1], Path(sys.argv[2])
counts: Counter[str] = Counter()
configs: dict[str, list] = {"zero_init": [], "engine": []}


def counted(name, original, record=None):
    def wrapper(*args, **kwargs):
        caller = inspect.stack()[1].function
        counts[name] += 1
        counts[f"{name} from {caller}"] += 1
        if record:
            record(*args, **kwargs)
        return original(*args, **kwargs)

    return wrapper


def rebind(original, replacement) -> None:
    """Every module attribute bound to ``original`` (``from x import f`` copies included)."""
    for module in list(sys.modules.values()):
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            if value is original:
                setattr(module, attr, replacement)


rebind(trainer.config.resolution.resolve, counted("resolve", trainer.config.resolution.resolve))
rebind(
    trainer.runtime.distributed.init_distributed,
    counted("init_distributed", trainer.runtime.distributed.init_distributed),
)
dist.init_process_group = counted("init_process_group", dist.init_process_group)
deepspeed.zero.Init.__init__ = counted(
    "zero.Init",
    deepspeed.zero.Init.__init__,
    lambda self, *a, config_dict_or_path=None, **k: configs["zero_init"].append(
        copy.deepcopy(config_dict_or_path)
    ),
)
deepspeed.initialize = counted(
    "deepspeed.initialize",
    deepspeed.initialize,
    lambda *a, config=None, **k: configs["engine"].append(copy.deepcopy(config)),
)

if mode == "cli":
    sys.argv = [str(ROOT / "scripts" / "train.py"), *sys.argv[3:]]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exit_:
        assert not exit_.code, exit_.code
else:
    import datasets
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out / "run"), max_steps=2, per_device_train_batch_size=2, logging_steps=1,
        save_strategy="no", disable_tqdm=True, report_to="none",
    )  # fmt: skip
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    rows = datasets.Dataset.from_dict(
        {"input_ids": [[(i + k) % 60 + 1 for k in range(16)] for i in range(8)]}
    )
    Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=rows).train()

(out / "counts.json").write_text(json.dumps({"counts": counts, "configs": configs}, default=str))
