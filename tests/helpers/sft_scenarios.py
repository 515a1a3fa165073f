"""Supervised fine-tuning through ``from trainer import SFTConfig, SFTTrainer`` against TRL's
``SFTTrainer``, on the same tiny Llama, tokenizer, rows, order and seed, in one process (TRL's
without DeepSpeed, ``use_cpu``).

Usage: ``python tests/helpers/sft_scenarios.py OUT SCENARIO [SCENARIO...]``; each scenario writes
``OUT/<scenario>.json`` for ``tests/unit/test_sft_trainer.py`` to read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, MixtralForCausalLM, set_seed
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from tests.helpers.preference_scenarios import COLOURS, SUBJECTS, base, lora, main
from tests.helpers.scaffold import read_metrics
from trainer import SFTConfig, SFTTrainer
from trainer.cli.main import exit_now

SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {}
METRICS = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")
EVAL_METRICS = ("eval_loss", "eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens")
# The default template with the assistant's turns marked for assistant_only_loss
MARKED_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
COMMON = dict(max_steps=4, per_device_train_batch_size=4, learning_rate=5e-3, lr_scheduler_type="constant",
              logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
              gradient_checkpointing=False, bf16=False, max_length=40)  # fmt: skip


def scenario(fn: Callable[[Path], dict[str, Any]]) -> Callable[[Path], dict[str, Any]]:
    SCENARIOS[fn.__name__] = fn
    return fn


def rows(kind: str, n: int = 32, start: int = 0) -> datasets.Dataset:
    """SFT rows in one of TRL's forms, of different lengths (so batches carry padding and packing
    has choices to make); ``start``: the first row's index (eval rows follow the training rows)."""
    out = []
    for i in range(start, start + n):
        subject, colour = SUBJECTS[i % 8], COLOURS[(i * 5) % 6]
        question = f"What colour is {subject}?"
        answer = f"It is {colour}." + f" Or {COLOURS[(i + 2) % 6]}, maybe." * (i % 4)
        if kind == "text":
            out.append({"text": f"{question} {answer}"})
        elif kind == "prompt_completion":
            out.append({"prompt": question, "completion": f" {answer}"})
        else:
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            if i % 3 == 0:  # some conversations go on for a second turn
                messages += [{"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes."}]
            out.append({"messages": messages})
    return datasets.Dataset.from_list(out)


def history(rows: list[dict]) -> dict[str, list[float]]:
    """Each metric's value at every logged training step (and a mixture of experts' ``aux_loss``)."""
    train = [r for r in rows if "loss" in r and "train_runtime" not in r]
    return {k: [r[k] for r in train] for k in (*METRICS, "aux_loss") if all(k in r for r in train)}


def model_and_tokenizer(out: Path, template: str | None, name: str = "base") -> tuple[Any, Any]:
    path = base(out, name)
    tok = AutoTokenizer.from_pretrained(path)
    if template:
        tok.chat_template = template
    return AutoModelForCausalLM.from_pretrained(path), tok


def evaluated(trainer: Any) -> dict[str, float]:
    """The trained model's evaluation: loss and TRL's token metrics, and the tokens trained so far
    that its logged row carries."""
    metrics, row = trainer.evaluate(), trainer.state.log_history[-1]
    return {k: metrics.get(k, row.get(k)) for k in EVAL_METRICS if k in metrics or k in row}


def run_trl(
    out: Path, data: dict, template: str | None, setup: dict, model: str = "base", **fields: Any
) -> tuple[dict, dict]:
    import trl

    unset_hf_deepspeed_config()
    model, tok = model_and_tokenizer(out, template, model)
    args = trl.SFTConfig(output_dir=str(out / "trl"), use_cpu=True, **{**COMMON, **fields})
    trainer = trl.SFTTrainer(model, args=args, processing_class=tok, **data, **setup)
    trainer.train()
    return history(trainer.state.log_history), evaluated(trainer)


def run_ours(
    out: Path,
    data: dict,
    template: str | None,
    setup: dict,
    name: str = "ours",
    model: str = "base",
    **fields: Any,
):
    """Our trainer on ``data`` (``train_dataset``, and ``eval_dataset``)."""
    model, tok = model_and_tokenizer(out, template, model)
    args = SFTConfig(output_dir=str(out / name), **{**COMMON, **fields})
    trainer = SFTTrainer(model, args=args, processing_class=tok, **data, **setup)
    trainer.train()
    return trainer, history(read_metrics(out / name))


def parity(
    out: Path,
    kind: str,
    template: str | None = None,
    setup: dict | None = None,
    model: str = "base",
    **fields: Any,
) -> dict:
    """TRL's run and ours on 32 training rows, then each one's evaluation on 12 others."""
    data = {"train_dataset": rows(kind), "eval_dataset": rows(kind, 12, start=32)}
    set_seed(0)
    theirs, their_eval = run_trl(out, data, template, setup or {}, model, **fields)
    set_seed(0)
    trainer, ours = run_ours(out, data, template, setup or {}, model=model, **fields)
    tokens = sum(len(ids) for ids in trainer.train_dataset["input_ids"])
    return {"ours": ours, "trl": theirs, "ours_eval": evaluated(trainer), "trl_eval": their_eval,
            "rows": len(trainer.train_dataset), "tokens": tokens}  # fmt: skip


@scenario
def text(out: Path) -> dict:
    return parity(out, "text")


@scenario
def text_packed(out: Path) -> dict:
    return parity(out, "text", packing=True)


@scenario
def text_packed_split(out: Path) -> dict:
    return parity(out, "text", packing=True, packing_strategy="bfd_split", max_length=16)


@scenario
def text_wrapped(out: Path) -> dict:
    return parity(out, "text", packing=True, packing_strategy="wrapped", max_length=32)


@scenario
def prompt_completion(out: Path) -> dict:
    return parity(out, "prompt_completion")


@scenario
def prompt_completion_packed(out: Path) -> dict:
    return parity(out, "prompt_completion", packing=True)


@scenario
def conversation(out: Path) -> dict:
    return parity(out, "messages", template=MARKED_TEMPLATE)


@scenario
def assistant_only(out: Path) -> dict:
    return parity(out, "messages", template=MARKED_TEMPLATE, assistant_only_loss=True)


@scenario
def assistant_only_packed(out: Path) -> dict:
    return parity(out, "messages", template=MARKED_TEMPLATE, assistant_only_loss=True, packing=True)


@scenario
def accumulated(out: Path) -> dict:
    """Two micro-batches of 2 rows a step: the loss is over the step's tokens, as TRL's."""
    return parity(out, "text", per_device_train_batch_size=2, gradient_accumulation_steps=2)


@scenario
def dft(out: Path) -> dict:
    return parity(out, "prompt_completion", loss_type="dft")


@scenario
def lora_adapters(out: Path) -> dict:
    return parity(out, "text", setup={"peft_config": lora()})


def moe_base(out: Path, tokenizer: str, name: str = "moe_base") -> str:
    """A tiny Mixtral (4 experts, 2 a token, router loss weight 0.05) with ``tokenizer``, saved once
    under ``out``."""
    path = out / name
    if not path.is_dir():
        tok = AutoTokenizer.from_pretrained(tokenizer)
        set_seed(0)
        config = MixtralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2, router_aux_loss_coef=0.05, max_position_embeddings=128,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
        MixtralForCausalLM(config).save_pretrained(path)
        tok.save_pretrained(path)
    return str(path)


@scenario
def mixture_of_experts(out: Path) -> dict:
    """The Mixtral of ``moe_base`` with its router loss on by default in both; one row a
    micro-batch (and an evaluation batch), where TRL's pool of a micro-batch's tokens and ours of a
    row's agree. Both evaluate with the router loss."""
    moe_base(out, base(out))
    return parity(out, "text", model="moe_base", per_device_train_batch_size=1, per_device_eval_batch_size=1)


if __name__ == "__main__":
    exit_now(main(SCENARIOS))
