"""``auto_find_batch_size`` as a user meets it: ``from trainer import Trainer, TrainingArguments`` and
a small Llama that does not fit a micro-batch of more than ``MAX_ROWS`` rows (its forward raises
``torch.OutOfMemoryError``, as a GPU's would).

Each run writes ``OUT/<name>/rank<r>.json``: the training rows of the log history, the micro-batch the
Trainer ran at and the one ``ds_config.json`` records, or the error ``train()`` raised.

Usage: ``python tests/helpers/auto_batch_scenario.py OUT one_rank`` (the retry on one process, after
an out-of-memory forward and after an optimizer step that ran out of memory once it had updated the
weights, the same run started at the batch that fits, the error without auto_find_batch_size, the ZeRO-3
refusal), or ``deepspeed --num_gpus 2 tests/helpers/auto_batch_scenario.py OUT two_ranks`` (only
rank 1 runs out of memory; then the run started directly at the batch that fits).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import datasets
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from transformers import LlamaConfig, LlamaForCausalLM

from trainer import Trainer, TrainingArguments
from trainer.cli.main import exit_now

out, case = (
    Path(a) if i == 0 else a for i, a in enumerate(a for a in sys.argv[1:] if not a.startswith("--local"))
)
DATA = datasets.Dataset.from_dict(
    {"input_ids": [[(i * 7 + k) % 31 + 1 for k in range(24)] for i in range(64)]}
)
CONFIG = LlamaConfig(
    vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, tie_word_embeddings=False,
)  # fmt: skip


def model_that_fits(max_rows: int | None, where: str = "forward") -> torch.nn.Module:
    """The user's model: a step of more than ``max_rows`` rows per forward runs out of memory (None:
    any fits), in the forward or, ``where="step"``, in the optimizer step once it has updated the
    weights (the optimizer's states of a larger batch did not fit, say)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)
    rows_seen = [0]

    def out_of_memory(rows: int) -> torch.OutOfMemoryError:
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate 2.00 GiB ({rows} rows; this model fits {max_rows})"
        )

    def too_big(module, args, kwargs):
        rows_seen[0] = kwargs["input_ids"].shape[0] if "input_ids" in kwargs else args[0].shape[0]
        if where == "forward" and max_rows is not None and rows_seen[0] > max_rows:
            raise out_of_memory(rows_seen[0])

    def updated_too_big(optimizer, args, kwargs):
        if max_rows is not None and rows_seen[0] > max_rows:
            raise out_of_memory(rows_seen[0])

    model.register_forward_pre_hook(too_big, with_kwargs=True)
    if where == "step":
        STEP_HOOKS.append(register_optimizer_step_post_hook(updated_too_big))
    return model


STEP_HOOKS: list = []  # removed when their run ends


def run(name: str, max_rows: int | None, where: str = "forward", **fields) -> None:
    args = TrainingArguments(
        output_dir=str(out / name), max_steps=3, gradient_accumulation_steps=2, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, **fields,
    )  # fmt: skip
    rank = args.process_index
    result: dict = {"user_micro_batch": None}
    trainer = Trainer(model=model_that_fits(max_rows, where), args=args, train_dataset=DATA)
    try:
        trainer.train()
        rows = [r for r in trainer.state.log_history if "loss" in r]
        ds_config = json.loads((out / name / "ds_config.json").read_text())
        result.update(
            losses=[r["loss"] for r in rows],
            grad_norms=[r["grad_norm"] for r in rows],
            steps=[r["step"] for r in rows],
            micro_batch=trainer.args.per_device_train_batch_size,
            ds_micro_batch=ds_config["train_micro_batch_size_per_gpu"],
            ds_accumulation=ds_config["gradient_accumulation_steps"],
        )
    except Exception as err:  # what the user's script would see
        result["error"] = [type(err).__name__, str(err)]
    result["user_micro_batch"] = args.per_device_train_batch_size  # the user's arguments, unchanged
    (out / name).mkdir(parents=True, exist_ok=True)
    (out / name / f"rank{rank}.json").write_text(json.dumps(result))
    while STEP_HOOKS:
        STEP_HOOKS.pop().remove()
    del trainer


if case == "one_rank":
    # 8 rows do not fit, nor 4: two halvings, to 2.
    run("auto", 3, per_device_train_batch_size=8, auto_find_batch_size=True)
    # Out of memory after the first optimizer step updated the weights: the retry starts from the
    # weights train() began with.
    run("auto_step", 3, "step", per_device_train_batch_size=8, auto_find_batch_size=True)
    run("direct", 3, per_device_train_batch_size=2)
    run("no_auto", 3, per_device_train_batch_size=8)
    run("zero3", 3, per_device_train_batch_size=8, auto_find_batch_size=True, zero_stage=3)
elif case == "two_ranks":
    rank = int(os.environ["RANK"])
    # Only rank 1's model runs out of memory at 8 rows (its memory is smaller, say).
    fields = {"zero_stage": 2}
    oom_at = 5 if rank == 1 else None
    run("auto", oom_at, per_device_train_batch_size=8, auto_find_batch_size=True, **fields)
    run("direct", None, per_device_train_batch_size=4, **fields)
else:
    raise SystemExit(f"unknown case {case!r}")

# Its ranks end as the commands do: exit handlers, then no interpreter teardown (gloo aborts seen there).
exit_now(0)
