"""How many of the trainer's source files one training step runs code from: a measure of how far a
step's work spreads across the package (docs/architecture.md).

Trains a tiny Llama through the public API on one process and traces, with ``sys.settrace``, every
function called from one step's ``on_step_end`` to the next one's, keeping the files under ``trainer/``. Two runs: a plain step (no logging), and a logging step with the tiled loss and tiled MLP.

Usage: ``python scripts/step_files.py [--list]``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import datasets
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer import Trainer, TrainerCallback, TrainingArguments

PACKAGE = Path(__file__).resolve().parents[1] / "trainer"


class StepTrace(TrainerCallback):
    """Records the trainer files whose code runs from the end of step ``step - 1`` to the end of step
    ``step`` (1-based): the previous step's logging and evaluation checks, the window's read and vote,
    the step itself."""

    def __init__(self, step: int):
        self.step, self.files = step, set()

    def _trace(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            self.files.add(str(Path(frame.f_code.co_filename).relative_to(PACKAGE.parent)))
        return None

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step - 1:
            sys.settrace(self._trace)
        elif state.global_step == self.step:
            sys.settrace(None)


def files_of_one_step(out: Path, **fields) -> list[str]:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    rows = torch.randint(0, 64, (32, 16)).tolist()
    data = datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})
    trace = StepTrace(step=3)
    args = TrainingArguments(output_dir=str(out), max_steps=4, per_device_train_batch_size=2,
                             save_strategy="no", report_to="none", disable_tqdm=True, **fields)  # fmt: skip
    Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=data, callbacks=[trace]).train()
    return sorted(trace.files)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        plain = files_of_one_step(Path(tmp, "plain"), logging_steps=1000)
        logged = files_of_one_step(Path(tmp, "logged"), logging_steps=1, tiled_loss="true", tiled_mlp=True)
    for name, files in (("plain step", plain), ("logging step, tiled loss and MLP", logged)):
        print(f"{name}: {len(files)} files")
        if "--list" in sys.argv:
            print("".join(f"  {f}\n" for f in files), end="")


if __name__ == "__main__":
    main()
