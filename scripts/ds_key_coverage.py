"""How many DeepSpeed keys the schema covers, and how many of those DeepSpeed itself validates.

For every key of the schema (optimizer and scheduler params once per type), this gives DeepSpeed's
own parser (``deepspeed.runtime.config.DeepSpeedConfig``) a config where only that key is wrong and
records whether the parser refuses it:

- a wrong type: an object where a number, flag, word or list belongs;
- a misspelling: the key with one letter doubled.

The schema refuses both for every key. Run: ``python scripts/ds_key_coverage.py [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from trainer.config.base import ConfigModel, nested_model  # noqa: E402
from trainer.config.optim import OPTIMIZER_PARAMS, SCHEDULER_PARAMS  # noqa: E402
from trainer.config.schema import DSConfig  # noqa: E402

BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
# What a key needs around it to be read at all (offload is only read under ZeRO-3, and so on).
CONTEXT: dict[str, dict[str, Any]] = {
    "zero_optimization": {"zero_optimization": {"stage": 3}},
    "optimizer": {"optimizer": {"type": "Adam", "params": {}}},
    "scheduler": {"scheduler": {"type": "WarmupLR", "params": {}}},
}
WRONG = {"wrong": 1}


def leaf_keys(model: type[ConfigModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    keys = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        child = nested_model(field.annotation)
        if child is not None:
            keys += leaf_keys(child, prefix + (key,))
        elif key != "params":
            keys.append(prefix + (key,))
    return keys


def _put(config: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    node = config
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
    return config


def _config(path: tuple[str, ...], value: Any, key: str | None = None, section: dict | None = None) -> dict:
    config = json.loads(json.dumps({**BASE, **CONTEXT.get(path[0], {}), **(section or {})}))
    if key is not None:
        path = path[:-1] + (key,)
    return _put(config, path, value)


def deepspeed_refuses(config: dict[str, Any]) -> bool:
    from deepspeed.runtime.config import DeepSpeedConfig

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            DeepSpeedConfig(config)
        except Exception:
            return True
    return False


def cases() -> list[tuple[str, dict, dict]]:
    """(key name, config with a wrong type, config with a misspelled key)."""
    out = []
    for path in leaf_keys(DSConfig):
        out.append((".".join(path), _config(path, WRONG), _config(path, 1, key=path[-1] + path[-1][-1])))
    for table, kind in ((OPTIMIZER_PARAMS, "optimizer"), (SCHEDULER_PARAMS, "scheduler")):
        seen: set[type] = set()
        for type_name, model in table.items():
            if model in seen:
                continue
            seen.add(model)
            section = {kind: {"type": type_name, "params": {}}}
            for name in model.model_fields:
                path = (kind, "params", name)
                out.append(
                    (
                        f"{kind}.params.{name} ({type_name})",
                        _config(path, WRONG, section=section),
                        _config(path, 1, key=name + name[-1], section=section),
                    )
                )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    rows = [(name, deepspeed_refuses(wrong), deepspeed_refuses(typo)) for name, wrong, typo in cases()]
    summary = {
        "keys": len(rows),
        "deepspeed_rejects_wrong_type": sum(r[1] for r in rows),
        "deepspeed_rejects_misspelling": sum(r[2] for r in rows),
        "deepspeed_rejects_both": sum(r[1] and r[2] for r in rows),
        "unchecked_by_deepspeed": [r[0] for r in rows if not (r[1] or r[2])],
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{'key':<62} wrong type  misspelling")
    for name, wrong, typo in rows:
        print(f"{name:<62} {'refused' if wrong else 'ACCEPTED':<11} {'refused' if typo else 'ACCEPTED'}")
    print(
        f"\n{summary['keys']} keys in the schema; DeepSpeed's parser refuses a wrong type for "
        f"{summary['deepspeed_rejects_wrong_type']}, a misspelling for {summary['deepspeed_rejects_misspelling']}, "
        f"both for {summary['deepspeed_rejects_both']}; {len(summary['unchecked_by_deepspeed'])} it checks not at all."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
