"""What a one-process run leaves behind, seen from one child process (plain python, one rank, the
collector off) that trains under ZeRO-3 with saving, evaluation and the non-finite guard on, drops
the Trainer, and builds the next model:

- a Trainer the user drops is freed at once, with its arguments, as HF's is: no reference cycle
  waits for a garbage collection. Under ZeRO-3 that matters beyond memory: the arguments registered
  their config with transformers, and while they live every model built next is partitioned by
  ``zero.Init``;
- no DeepSpeed op was compiled or loaded: one process has no use for the shared-memory collective,
  whose compile would be most of a fresh machine's ``make demo``.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.helpers.launch import launch, run_env

SCRIPT = textwrap.dedent(
    """
    import gc, json, sys, weakref
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    from trainer import Trainer, TrainingArguments

    gc.disable()
    out = sys.argv[1]
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    data = [{"input_ids": [(i + k) % 60 + 1 for k in range(16)]} for i in range(16)]

    def run():
        args = TrainingArguments(
            output_dir=out, max_steps=2, per_device_train_batch_size=4, deepspeed="zero3",
            save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2,
            logging_steps=1, report_to=[], disable_tqdm=True,
        )
        registered = is_deepspeed_zero3_enabled()
        trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=data, eval_dataset=data[:4])
        trainer.train()
        return registered, weakref.ref(trainer), weakref.ref(args)

    registered, trainer, args = run()
    after = LlamaForCausalLM(config)
    json.dump(
        {
            "registered_while_alive": registered,
            "trainer_alive": trainer() is not None,
            "args_alive": args() is not None,
            "registered_after": is_deepspeed_zero3_enabled(),
            "next_model_whole": all(p.numel() > 0 and not hasattr(p, "ds_id") for p in after.parameters()),
        },
        open(f"{out}/lifetime.json", "w"),
    )
    """
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_process")
    script = tmp / "lifetime.py"
    script.write_text(SCRIPT)
    extensions = tmp / "torch_extensions"  # empty: any op the run needs is built here
    launch([str(script), str(tmp / "out")], launcher="python", timeout=600,
           env=run_env(TORCH_EXTENSIONS_DIR=str(extensions)))  # fmt: skip
    return tmp / "out", extensions


def test_a_dropped_trainer_and_its_zero3_registration_go_at_once(run):
    out, _ = run
    assert json.loads((out / "lifetime.json").read_text()) == {
        "registered_while_alive": True,
        "trainer_alive": False,
        "args_alive": False,
        "registered_after": False,
        "next_model_whole": True,
    }


def test_no_deepspeed_op_is_built_for_one_process(run):
    _, extensions = run
    assert sorted(extensions.rglob("*")) == []
