"""One run, on one process, counting what the run plan promises to do once: resolutions of the
DeepSpeed config, process-group starts, the sequence-split check, the claim on output_dir (its lock taken), and the
config ``zero.Init`` partitions with against the one the engine is built from (a copy of each as it
was then, and the object's id). ``python tests/helpers/count_run.py cli OUT [scripts/train.py
flags]`` runs ``scripts/train.py`` as the launcher would; ``... api OUT`` a hand-built ``Trainer``;
``... api-zero3 OUT`` one under ZeRO-3, its model built (``from_config``, so under ``zero.Init``)
after its ``TrainingArguments``, as HF's scripts do. Writes ``OUT/counts.json``.
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

import trainer.cli.main
import trainer.cli.train_job  # noqa: F401  (every module that binds the functions counted below)
import trainer.config.resolution
import trainer.engine.sequence_parallel
import trainer.loop.build
import trainer.runtime.distributed
import trainer.runtime.ownership

ROOT = Path(__file__).resolve().parents[2]
mode, out = sys.argv[1], Path(sys.argv[2])
counts: Counter[str] = Counter()
configs: dict[str, list] = {"zero_init": [], "engine": [], "zero_init_ids": [], "engine_ids": []}


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
rebind(
    trainer.engine.sequence_parallel.check_layout,
    counted("check_layout", trainer.engine.sequence_parallel.check_layout),
)
rebind(
    trainer.runtime.ownership.claim_output_dir,
    counted("claim_output_dir", trainer.runtime.ownership.claim_output_dir),
)
# What a claim does the first time only: rank 0 takes output_dir's lock (a later claim in the process returns).
trainer.runtime.ownership._lock = counted("lock", trainer.runtime.ownership._lock)
dist.init_process_group = counted("init_process_group", dist.init_process_group)


def record(kind: str, config) -> None:
    configs[kind].append(copy.deepcopy(config))
    configs[f"{kind}_ids"].append(id(config))


deepspeed.zero.Init.__init__ = counted(
    "zero.Init",
    deepspeed.zero.Init.__init__,
    lambda self, *a, config_dict_or_path=None, **k: record("zero_init", config_dict_or_path),
)
deepspeed.initialize = counted(
    "deepspeed.initialize", deepspeed.initialize, lambda *a, config=None, **k: record("engine", config)
)

if mode == "cli":
    sys.argv = [str(ROOT / "scripts" / "train.py"), *sys.argv[3:]]
    trainer.cli.main.exit_now = sys.exit  # the script's end returns here, for the counts to be written
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exit_:
        assert not exit_.code, exit_.code
else:
    import datasets
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainer import Trainer, TrainingArguments

    zero3 = {"zero_stage": 3} if mode == "api-zero3" else {}
    args = TrainingArguments(
        output_dir=str(out / "run"), max_steps=2, per_device_train_batch_size=2, logging_steps=1,
        save_strategy="no", disable_tqdm=True, report_to="none", **zero3,
    )  # fmt: skip
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    rows = datasets.Dataset.from_dict(
        {"input_ids": [[(i + k) % 60 + 1 for k in range(16)] for i in range(8)]}
    )
    model = AutoModelForCausalLM.from_config(config)  # after the arguments, as HF's scripts build it
    Trainer(model=model, args=args, train_dataset=rows).train()

(out / "counts.json").write_text(json.dumps({"counts": counts, "configs": configs}, default=str))
