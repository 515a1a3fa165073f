"""How many of the trainer's source files one training step runs code from: a measure of how far a
step's work spreads across the package (docs/architecture.md).

Trains a tiny Llama through the public API on one process and traces, with ``sys.settrace``, every
function called from one step's ``on_step_end`` to the next one's, keeping the files under
``trainer/``. Four runs: a plain step (no logging), a logging step with the tiled loss and tiled
MLP, and plain steps of ``DPOTrainer`` and ``KTOTrainer`` (their reference scored before step 1).

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


def files_of_one_preference_step(out: Path, objective: str) -> list[str]:
    """A plain step of ``DPOTrainer`` (pairs) or ``KTOTrainer`` (labelled completions), on rows
    given as token ids and a word-level tokenizer of the model's 64 ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    import trainer

    vocab = {f"t{i}": i for i in range(64)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")), pad_token="t0", eos_token="t2"
    )
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, eos_token_id=2)  # fmt: skip
    ids = torch.randint(3, 64, (32, 12)).tolist()
    if objective == "dpo":
        columns = {"prompt_ids": [r[:4] for r in ids], "chosen_ids": [r[4:8] for r in ids], "rejected_ids": [r[8:] for r in ids]}  # fmt: skip
    else:
        columns = {"prompt_ids": [r[:4] for r in ids], "chosen_ids": [r[4:] for r in ids], "label": [i % 3 > 0 for i in range(32)]}  # fmt: skip
    config_class, trainer_class = (
        getattr(trainer, f"{objective.upper()}{kind}") for kind in ("Config", "Trainer")
    )
    trace = StepTrace(step=3)
    args = config_class(output_dir=str(out), max_steps=4, per_device_train_batch_size=2, save_strategy="no",
                        report_to="none", disable_tqdm=True, logging_steps=1000, gradient_checkpointing=False)  # fmt: skip
    run = trainer_class(LlamaForCausalLM(config), args=args, train_dataset=datasets.Dataset.from_dict(columns),
                        processing_class=tokenizer, callbacks=[trace])  # fmt: skip
    run.train()
    return sorted(trace.files)


def measured() -> dict[str, list[str]]:
    with tempfile.TemporaryDirectory() as tmp:
        return {
            "plain step": files_of_one_step(Path(tmp, "plain"), logging_steps=1000),
            "logging step, tiled loss and MLP": files_of_one_step(
                Path(tmp, "logged"), logging_steps=1, tiled_loss="true", tiled_mlp=True
            ),
            "DPOTrainer's plain step": files_of_one_preference_step(Path(tmp, "dpo"), "dpo"),
            "KTOTrainer's plain step": files_of_one_preference_step(Path(tmp, "kto"), "kto"),
        }


def main() -> None:
    for name, files in measured().items():
        print(f"{name}: {len(files)} files")
        if "--list" in sys.argv:
            print("".join(f"  {f}\n" for f in files), end="")


if __name__ == "__main__":
    main()
