"""Callbacks written for transformers' Trainer, unchanged, on ours: EarlyStoppingCallback stops it, a
callback that returns a new transformers TrainerControl is obeyed, and the events fire as HF's do.

One child process (plain python, one rank) builds two Trainers the HF way, as a user script would.
"""

from __future__ import annotations

import json
import textwrap

from tests.helpers.launch import launch

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import datasets, transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    from trainer import Trainer, TrainingArguments

    out = sys.argv[1]
    data = datasets.Dataset.from_dict({"input_ids": [[(i + k) % 16 + 1 for k in range(24)] for i in range(64)]})
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0)

    class Recorder(transformers.TrainerCallback):
        def __init__(self):
            self.events, self.step_in_logs, self.evals = [], [], []
        def on_init_end(self, args, state, control, **kwargs):
            self.events.append("init_end")
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.events.append(f"train_begin {type(model).__name__}")
        def on_log(self, args, state, control, logs=None, **kwargs):
            self.step_in_logs.append("step" in logs)
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            self.evals.append([state.global_step, metrics["eval_loss"], state.best_metric])
        def on_train_end(self, args, state, control, **kwargs):
            self.events.append("train_end")

    class StopWithANewControl(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                return transformers.TrainerControl(should_training_stop=True)

    def run(name, callbacks, **fields):
        args = TrainingArguments(
            output_dir=f"{out}/{name}", max_steps=20, per_device_train_batch_size=4, learning_rate=1e-3,
            logging_steps=1, eval_strategy="steps", eval_steps=2, save_strategy="no", disable_tqdm=True,
            seed=0, **fields,
        )
        trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=data,
                          eval_dataset=data.select(range(8)), callbacks=callbacks)
        trainer.train()
        return trainer.state.global_step

    recorder = Recorder()
    # No evaluation improves on the best by more than the threshold: the second one stops the run.
    early = transformers.EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=10.0)
    results = {"early_stop": run("early", [early, recorder], metric_for_best_model="eval_loss")}
    results["recorder"] = vars(recorder)
    results["new_control"] = run("new_control", [StopWithANewControl()])
    with open(f"{out}/results.json", "w") as f:
        json.dump(results, f)
    """
)


def test_transformers_callbacks_run_unchanged_on_our_trainer(tmp_path):
    script = tmp_path / "hf_callbacks.py"
    script.write_text(SCRIPT)
    launch([str(script), str(tmp_path)], launcher="python", timeout=600)
    results = json.loads((tmp_path / "results.json").read_text())

    # transformers' EarlyStoppingCallback, with no checkpoint saved (the best metric is kept at each
    # evaluation, as HF's Trainer does): the evaluation at step 4 is no better, and the run stops.
    assert results["early_stop"] == 4
    recorder = results["recorder"]
    (step2, loss2, best2), (step4, _, best4) = recorder["evals"]
    assert (step2, best2, step4, best4) == (2, None, 4, loss2)
    # Events as HF fires them; the model comes with them; logs carry no step (HF's don't).
    assert recorder["events"] == ["init_end", "train_begin LlamaForCausalLM", "train_end"]
    # 4 train rows, 2 eval rows and, as HF logs it, the train summary row (train_runtime, ...)
    assert len(recorder["step_in_logs"]) == 7 and not any(recorder["step_in_logs"])
    # A callback that returns a new transformers.TrainerControl is obeyed.
    assert results["new_control"] == 3
