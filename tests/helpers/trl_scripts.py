"""TRL's own example scripts (``trl/scripts/dpo.py``, ``sft.py``, ``kto.py``, ``grpo.py`` and ``rloo.py``, as the installed TRL
ships them), ported as a user ports them: the ``from trl import ...`` lines that name a trainer or its
config name ours instead, nothing else changes. The ported file is written at test time beside the
run's data, never into the project.

Usage: ``python tests/helpers/trl_scripts.py OUT`` writes ``OUT/model`` (a tiny Llama and its
tokenizer) and ``OUT/dpo_data``, ``OUT/sft_data``, ``OUT/kto_data``, ``OUT/prompts_data`` (JSON lines a
``load_dataset`` of the directory reads).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

# What a port takes from this project instead of TRL; the rest of each import stays TRL's.
OURS = {"DPOTrainer", "DPOConfig", "SFTTrainer", "SFTConfig", "KTOTrainer", "KTOConfig", "GRPOTrainer", "GRPOConfig",
        "RLOOTrainer", "RLOOConfig"}  # fmt: skip
_FROM_TRL = re.compile(r"^(?P<indent>\s*)from trl import (?P<names>[^()\n]+)$", re.MULTILINE)


def trl_script(name: str) -> Path:
    """The installed TRL's ``trl/scripts/<name>.py``."""
    return Path(importlib.util.find_spec("trl").origin).parent / "scripts" / f"{name}.py"


def port(source: str) -> str:
    """``source`` with each ``from trl import`` line split in two: our names from ``trainer``."""

    def swap(match: re.Match) -> str:
        indent, names = match["indent"], [n.strip() for n in match["names"].split(",")]
        ours, theirs = [n for n in names if n in OURS], [n for n in names if n not in OURS]
        lines = [f"{indent}from trainer import {', '.join(ours)}"] if ours else []
        lines += [f"{indent}from trl import {', '.join(theirs)}"] if theirs else []
        return "\n".join(lines)

    ported, count = _FROM_TRL.subn(swap, source)
    if count < 2 or "from trainer import" not in ported:
        raise ValueError("TRL's script no longer imports its trainer and config in the shape this port knows")
    return ported


def write_ported(name: str, out: Path) -> Path:
    path = out / f"{name}_ported.py"
    path.write_text(port(trl_script(name).read_text()))
    return path


def write_inputs(out: Path) -> None:
    """The base models (a Llama, and a Mixtral for SFT) and the data directories."""
    from tests.helpers.grpo_scenarios import prompts
    from tests.helpers.kto_scenarios import completions
    from tests.helpers.preference_scenarios import base, pairs
    from tests.helpers.sft_scenarios import moe_base, rows

    out.mkdir(parents=True, exist_ok=True)
    moe_base(out, base(out, "model"), "moe_model")  # SFT trains a mixture of experts
    data_sets = (
        ("dpo_data", pairs("text")),
        ("sft_data", rows("prompt_completion")),
        ("kto_data", completions()),
        ("prompts_data", prompts()),
    )
    for name, data in data_sets:
        (out / name).mkdir(exist_ok=True)
        data.to_json(out / name / "train.jsonl")


if __name__ == "__main__":
    write_inputs(Path(sys.argv[1]))
