"""A Trainer the user drops is freed at once, with its arguments, as HF's is: no reference cycle waits
for a garbage collection. Under ZeRO-3 that matters beyond memory: the arguments registered their
config with transformers, and while they live every model built next is partitioned by ``zero.Init``.

One child process (plain python, one rank, the collector off) trains under ZeRO-3 with saving,
evaluation and the non-finite guard on, drops the Trainer, and builds the next model.
"""

from __future__ import annotations

import json
import textwrap

from tests.helpers.launch import launch

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


def test_a_dropped_trainer_and_its_zero3_registration_go_at_once(tmp_path):
    script = tmp_path / "lifetime.py"
    script.write_text(SCRIPT)
    launch([str(script), str(tmp_path / "out")], launcher="python", timeout=600)
    assert json.loads((tmp_path / "out" / "lifetime.json").read_text()) == {
        "registered_while_alive": True,
        "trainer_alive": False,
        "args_alive": False,
        "registered_after": False,
        "next_model_whole": True,
    }
