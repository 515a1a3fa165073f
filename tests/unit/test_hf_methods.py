"""HF's Trainer methods without a launcher: the signatures against the installed transformers', the
callbacks list against transformers' own handler, the decay rule, the loaders' helpers, and the model
card written from a log history. tests/distributed/test_hf_methods.py runs them on a real 2-rank run."""

from __future__ import annotations

import contextlib
import inspect
import logging

import pytest
import torch
import transformers
import yaml
from torch.utils.data import DataLoader, Sampler
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.trainer_callback import CallbackHandler as HFCallbackHandler
from transformers.trainer_pt_utils import metrics_format as hf_metrics_format

from trainer import Trainer, TrainingArguments
from trainer.data import CausalLMCollator
from trainer.engine import weight_decay_groups
from trainer.loop.callbacks import CallbackHandler, TrainerCallback
from trainer.loop.evaluation import eval_batches, eval_dataloader
from trainer.loop.hf_methods import HFMethods
from trainer.loop.model_card import ModelCard, dataset_defaults, existing_tags, hyperparameters, results_rows
from trainer.runtime.mesh import Mesh

# HF's public Trainer methods this Trainer has, with HF's parameters (names, kinds, defaults).
HF_METHODS = [
    "create_model_card", "push_to_hub", "get_train_dataloader", "get_eval_dataloader", "get_test_dataloader",
    "num_examples", "add_callback", "pop_callback", "remove_callback", "log", "hyperparameter_search",
    "is_local_process_zero", "is_world_process_zero", "get_decay_parameter_names", "create_optimizer",
    "create_scheduler", "create_optimizer_and_scheduler", "compute_loss_context_manager",
    "autocast_smart_context_manager", "evaluate", "predict", "save_state", "log_metrics", "save_metrics",
    "compute_loss",
]  # fmt: skip


def _params(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", HF_METHODS)
def test_methods_take_hfs_parameters(name):
    assert _params(getattr(Trainer, name)) == _params(getattr(transformers.Trainer, name))


def test_num_tokens_and_metrics_format_as_hf_had_them():
    # transformers 5 dropped num_tokens; 4.x had it as a static method of these parameters.
    assert isinstance(inspect.getattr_static(Trainer, "num_tokens"), staticmethod)
    assert [p.name for p in inspect.signature(Trainer.num_tokens).parameters.values()] == [
        "train_dl",
        "max_steps",
    ]
    metrics = {"train_runtime": 3725.5, "total_flos": 3.5e12, "train_loss": 1.234567, "epoch": 2}
    assert Trainer.metrics_format(None, metrics) == hf_metrics_format(metrics)  # a method here, as in 4.x


class A(TrainerCallback):
    pass


class B(TrainerCallback):
    pass


def _handlers():
    """Ours and transformers' handler over the same three callbacks (two of class A)."""
    a1, b, a2 = A(), B(), A()
    ours = CallbackHandler([a1, b, a2])
    hf = HFCallbackHandler([a1, b, a2], None, None, None, None)
    return ours, hf, (a1, b, a2)


def test_pop_callback_as_transformers_handler():
    ours, hf, (a1, b, a2) = _handlers()
    for target in (A, b, B, b, A, A, A()):  # a class, an instance, absent ones
        assert ours.pop(target) is hf.pop_callback(target)
        assert ours.callbacks == hf.callbacks
    assert ours.callbacks == []


def test_remove_callback_as_transformers_handler():
    ours, hf, (a1, b, a2) = _handlers()
    ours.remove(A), hf.remove_callback(A)
    assert ours.callbacks == hf.callbacks == [b, a2]
    ours.remove(a2), hf.remove_callback(a2)
    ours.remove(A), hf.remove_callback(A)  # none left: no error
    assert ours.callbacks == hf.callbacks == [b]
    with pytest.raises(ValueError):
        ours.remove(a1)  # an instance that is not there, as transformers' handler
    with pytest.raises(ValueError):
        hf.remove_callback(a1)


def test_add_callback_instantiates_a_class_and_warns_of_a_second(caplog):
    handler = CallbackHandler([A()])
    with caplog.at_level(logging.WARNING, logger="trainer.loop.callbacks"):
        handler.add(B)
        handler.add(A)
    assert [type(cb) for cb in handler.callbacks] == [A, B, A]
    assert [r.getMessage() for r in caplog.records] == ["a second A was added to the Trainer's callbacks"]


def test_decay_parameter_names_are_the_matrices_the_engine_decays():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    names = HFMethods().get_decay_parameter_names(model)
    assert names == [
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.attn.c_proj.weight",
        "transformer.h.0.mlp.c_fc.weight",
        "transformer.h.0.mlp.c_proj.weight",
    ]  # no bias, no LayerNorm (ln_1, ln_2, ln_f), the tied lm_head counted once
    decay, _ = weight_decay_groups(model, 0.1)
    by_id = {id(p): n for n, p in model.named_parameters()}
    assert [by_id[id(p)] for p in decay["params"]] == names


def test_context_managers_enter_nothing():
    methods = HFMethods()
    assert isinstance(methods.autocast_smart_context_manager(), contextlib.nullcontext)
    stack = methods.compute_loss_context_manager()
    assert isinstance(stack, contextlib.ExitStack)
    with stack:
        assert torch.is_autocast_enabled() is False


ROWS = [{"input_ids": [(5 * i + k) % 60 + 1 for k in range(3 + 2 * i)]} for i in range(7)]


def test_the_eval_loader_is_what_eval_batches_reads_and_honours_drop_last():
    collator = CausalLMCollator(0)
    for rank in (0, 1):
        loader = eval_dataloader(ROWS, collator, 3, rank, 2)
        read = list(eval_batches(ROWS, collator, 3, rank, 2))
        assert [idx for _, idx in read] == [[0, 2, 4], [6]] if rank == 0 else [[1, 3, 5], [-1]]
        for got, (want, _) in zip(loader, read, strict=True):
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert HFMethods().num_examples(loader) == 7  # the whole set, as HF's
    # Rank 1's padding row is a copy of row 0, marked -1 (evaluate keeps it out of the loss).
    padded = eval_dataloader(ROWS, collator, 3, 1, 2)
    *_, last = padded
    assert padded.dataset.indices[-1] == -1 and last["input_ids"][0].tolist() == ROWS[0]["input_ids"]
    dropped = eval_dataloader(ROWS, collator, 3, 0, 2, drop_last=True)
    assert [len(b["input_ids"]) for b in dropped] == [3]


class Sized(Sampler[int]):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class NoLength:
    def __getitem__(self, i):
        return ROWS[i]


def test_num_tokens_and_num_examples():
    loader = DataLoader(ROWS, batch_size=2, collate_fn=CausalLMCollator(0))
    widths = [5, 9, 13, 15]  # the longest row of each batch of 2 (1 at the end)
    assert Trainer.num_tokens(loader) == sum(n * w for n, w in zip([2, 2, 2, 1], widths, strict=True))
    assert Trainer.num_tokens(loader, max_steps=10) == 2 * 5 * 10  # the first batch's, times the steps
    no_ids = DataLoader([{"x": torch.zeros(2)}] * 3, batch_size=2)
    assert Trainer.num_tokens(no_ids) == 0
    methods = HFMethods()
    methods.args = TrainingArguments(per_device_train_batch_size=4)
    assert methods.num_examples(loader) == 7
    estimated = DataLoader(NoLength(), batch_size=2, sampler=Sized(5), collate_fn=CausalLMCollator(0))
    assert methods.num_examples(estimated) == 3 * 4  # its batches times per_device_train_batch_size


HISTORY = [
    {"loss": 3.123456, "epoch": 0.25, "step": 1},
    {"loss": 2.5, "epoch": 0.5, "step": 2},
    {"eval_loss": 2.4, "eval_accuracy": 0.1, "eval_runtime": 1.0, "epoch": 0.5, "step": 2},
    {"custom": 1.0, "epoch": 0.5, "step": 2},
    {"loss": 2.0, "epoch": 0.75, "step": 3},
    {"eval_loss": 1.9, "eval_accuracy": 0.3, "eval_samples_per_second": 9.0, "epoch": 0.75, "step": 3},
    {"train_runtime": 5.0, "train_loss": 2.5, "epoch": 0.75, "step": 3},
]


def test_the_results_rows_merge_a_steps_training_loss_and_evaluation():
    assert results_rows(HISTORY) == [
        {"Training Loss": 3.123456, "Epoch": 0.25, "Step": 1, "Validation Loss": "-", "Accuracy": "-"},
        {"Training Loss": 2.5, "Epoch": 0.5, "Step": 2, "Validation Loss": 2.4, "Accuracy": 0.1},
        {"Training Loss": 2.0, "Epoch": 0.75, "Step": 3, "Validation Loss": 1.9, "Accuracy": 0.3},
    ]
    without_eval = [r for r in HISTORY if "eval_loss" not in r]
    assert list(results_rows(without_eval)[0]) == ["Training Loss", "Epoch", "Step"]
    assert results_rows([{"eval_loss": 1.0, "epoch": 0.0, "step": 0}])[0]["Training Loss"] == "No log"


def test_a_card_rendered_from_a_history():
    card = ModelCard(model_name="m", tags=["t"], tasks=["text-generation"], log_history=HISTORY).render()
    header, body = card.split("---\n", 2)[1:]
    meta = yaml.safe_load(header)
    assert meta == {
        "library_name": "transformers",
        "tags": ["t"],
        "metrics": ["accuracy"],  # the hub's metric tags among the eval results (not the loss)
        "model-index": [{"name": "m", "results": []}],  # no dataset: no result entry
    }
    assert "This model was trained from scratch on an unknown dataset.\n" in body
    assert "- Loss: 1.9\n- Accuracy: 0.3\n" in body
    table = body.split("### Training results\n\n")[1]
    assert table.splitlines()[:3] == [
        "| Training Loss | Epoch | Step | Validation Loss | Accuracy |",
        "|:-------------:|:-----:|:----:|:---------------:|:--------:|",
        "| 3.1235        | 0.25  | 1    | -               | -        |",
    ]


def test_hyperparameters_come_from_the_deepspeed_config_that_ran():
    args = TrainingArguments(
        learning_rate=3e-4, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=-1,
        num_train_epochs=2, warmup_ratio=0.1, bf16=True, zero_stage=3,
    )  # fmt: skip
    ds = {"train_batch_size": 32, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "bf16": {"enabled": False},
          "gradient_clipping": 0.5}  # fmt: skip
    hp = hyperparameters(args, ds, Mesh(world_size=4), client_optimizer=None)
    assert hp["distributed_type"] == "DeepSpeed ZeRO-2, optimizer offload to cpu"  # the config's, not args'
    assert (hp["num_devices"], hp["total_train_batch_size"], hp["total_eval_batch_size"]) == (4, 32, 32)
    assert hp["optimizer"] == "Use adamw_torch (DeepSpeed AdamW: lr=0.0003)"
    assert hp["max_grad_norm"] == 0.5 and "mixed_precision_training" not in hp
    assert (hp["num_epochs"], hp["lr_scheduler_warmup_ratio"]) == (2, 0.1) and "training_steps" not in hp
    before_engine = hyperparameters(args, None, Mesh(world_size=1), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    assert before_engine["distributed_type"] == "DeepSpeed ZeRO-3"
    assert before_engine["optimizer"] == "SGD, passed to the Trainer"
    assert before_engine["mixed_precision_training"] == "bf16" and "num_devices" not in before_engine
    # The sizes are the mesh's, wherever they were stated (an argument or the DeepSpeed file).
    tp = hyperparameters(
        TrainingArguments(), {"zero_optimization": {"stage": 1}}, Mesh(world_size=4, tensor=2), None
    )
    assert tp["distributed_type"] == "DeepSpeed ZeRO-1, tensor_parallel_size 2"
    assert (tp["num_devices"], tp["total_eval_batch_size"]) == (4, 16)  # 2 reading groups of 8 rows


def test_card_defaults_from_datasets_and_an_existing_card(tmp_path):
    class HubDataset:
        builder_name, config_name = "wikitext", "wikitext-2-raw-v1"

    class LocalFiles:
        builder_name, config_name = "json", "default"

    assert dataset_defaults(HubDataset()) == (["wikitext"], ["wikitext-2-raw-v1"])
    assert dataset_defaults(LocalFiles()) == dataset_defaults(ROWS) == ([], [])
    card = tmp_path / "README.md"
    assert existing_tags(card) == []
    card.write_text("---\nlicense: mit\ntags:\n- a\n- b\n---\n# old\n")
    assert existing_tags(card) == ["a", "b"]
