"""Preference training through ``from trainer import ...``: DPO against TRL's ``DPOTrainer``, ORPO and
CPO/SimPO against TRL's experimental ``ORPOTrainer`` and ``CPOTrainer``, on the same tiny Llama,
tokenizer, pairs, order and seed, in one process (TRL's without DeepSpeed, ``use_cpu``).

Usage: ``python tests/helpers/preference_scenarios.py OUT SCENARIO [SCENARIO...]``; each scenario
writes ``OUT/<scenario>.json`` for ``tests/unit/test_preference.py`` to read.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, set_seed
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from tests.helpers.scaffold import bpe_tokenizer, read_metrics
from trainer import CPOConfig, CPOTrainer, DPOConfig, DPOTrainer, ORPOConfig, ORPOTrainer
from trainer.cli.main import exit_now
from trainer.data.chat import DEFAULT_CHAT_TEMPLATE
from trainer.runtime.distributed import dist_info

SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {}
METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")  # fmt: skip
# Each method's own metrics, beside the reward metrics; those that read the whole logits are not
# logged with the tiled loss, sequence parallelism or padding-free batches
LOGIT_METRICS = {"entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy"}
EXTRA_METRICS = {"dpo": ("entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy", "num_tokens"),
                 "orpo": ("nll_loss", "log_odds_ratio", "log_odds_chosen", "logits/chosen", "logits/rejected"),
                 "cpo": ("nll_loss", "logits/chosen", "logits/rejected")}  # fmt: skip
OURS = {"dpo": (DPOConfig, DPOTrainer), "orpo": (ORPOConfig, ORPOTrainer), "cpo": (CPOConfig, CPOTrainer)}
SUBJECTS = ["the sky", "a cat", "the sea", "an apple", "the road", "a song", "the moon", "a tree"]
COLOURS = ["blue", "grey", "green", "red", "black", "white"]


def reference_stage(trainer: Any) -> Any:
    """The trainer's reference stage (trainer/loop/reference.py)."""
    from trainer.loop.reference import ReferenceStage

    return next(stage for stage in trainer.stages if isinstance(stage, ReferenceStage))


def scenario(fn: Callable[[Path], dict[str, Any]]) -> Callable[[Path], dict[str, Any]]:
    SCENARIOS[fn.__name__] = fn
    return fn


def tokenizer(bos: bool = False):
    """The tiny BPE tokenizer; ``bos``: with a BOS token it does not add itself (as GPT-2's, or a
    Llama tokenizer told not to), which TRL's ORPO and CPO put in front of a text prompt."""
    lines = [f"What colour is {s}? It is {c}." for s in SUBJECTS for c in COLOURS]
    special = {"special_tokens": ("<unk>", "<pad>", "<eos>", "<s>"), "bos_token": "<s>"} if bos else {}
    tok = bpe_tokenizer(lines * 4 + ["<|user|>\n", "<|assistant|>\n"], vocab_size=300, **special)
    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    return tok


def base(out: Path, name: str = "base", seed: int = 0, bos: bool = False) -> str:
    """A tiny Llama and its tokenizer saved once under ``out``: both trainers load it by path (TRL
    builds its reference model from the path). ``seed``: its initial weights."""
    path = out / name
    if not path.is_dir():  # every rank builds the same one; the first rename wins, whole
        tmp = out / f"{name}.{os.getpid()}"
        tok = tokenizer(bos)
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
        LlamaForCausalLM(config).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another rank's is in place
            shutil.rmtree(tmp)
    return str(path)


def pairs(kind: str, n: int = 24) -> datasets.Dataset:
    """Preference rows in one of TRL's forms: explicit text prompt, implicit text prompt, or
    conversations; answers of different lengths, so batches carry padding."""
    rows = []
    for i in range(n):
        subject, good, bad = SUBJECTS[i % 8], COLOURS[i % 6], COLOURS[(i + 1 + i // 8) % 6]
        prompt, chosen = f"What colour is {subject}?", f" It is {good}."
        rejected = f" It is {bad}, or maybe {COLOURS[(i + 3) % 6]}." if i % 3 else f" {bad}."
        if kind == "text":
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        elif kind == "implicit":
            rows.append({"chosen": prompt + chosen, "rejected": prompt + rejected})
        else:
            user = [{"role": "user", "content": prompt}]
            rows.append({"prompt": user, "chosen": [{"role": "assistant", "content": chosen.strip()}],
                         "rejected": [{"role": "assistant", "content": rejected.strip()}]})  # fmt: skip
    return datasets.Dataset.from_list(rows)


COMMON = dict(max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, lr_scheduler_type="constant",
              logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
              gradient_checkpointing=False, bf16=False, max_length=24)  # fmt: skip


def history(rows: list[dict], method: str = "dpo") -> dict[str, list[float]]:
    """Each metric's value at every logged training step."""
    train = [r for r in rows if "loss" in r and "train_runtime" not in r]
    keys = (*METRICS, *EXTRA_METRICS.get(method, ()))
    return {k: [r[k] for r in train] for k in keys if all(k in r for r in train)}


def lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )


def trl_classes(method: str) -> tuple[type, type]:
    import trl

    if method == "dpo":
        return trl.DPOConfig, trl.DPOTrainer
    if method == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        return ORPOConfig, ORPOTrainer
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    return CPOConfig, CPOTrainer


def run_trl(
    out: Path,
    kind: str,
    peft_config: Any = None,
    method: str = "dpo",
    evaluated: dict | None = None,
    ref_model: str | None = None,
    **fields: Any,
) -> dict[str, list[float]]:
    """TRL's run; ``evaluated``: filled with its evaluation of ``eval_pairs`` after training."""
    unset_hf_deepspeed_config()
    set_seed(0)
    config, trainer_class = trl_classes(method)
    args = config(output_dir=str(out / "trl"), use_cpu=True, **{**COMMON, **fields})
    model, tok = base(out), None
    if method != "dpo":  # TRL's experimental trainers take a model object and its tokenizer
        from transformers import AutoTokenizer

        model, tok = AutoModelForCausalLM.from_pretrained(model), AutoTokenizer.from_pretrained(model)
    eval_dataset = eval_pairs(kind) if evaluated is not None else None
    reference = {"ref_model": AutoModelForCausalLM.from_pretrained(ref_model)} if ref_model else {}
    trainer = trainer_class(model, args=args, train_dataset=pairs(kind), eval_dataset=eval_dataset,
                            processing_class=tok, peft_config=peft_config, **reference)  # fmt: skip
    trainer.train()
    if evaluated is not None:
        evaluated.update(evaluation(trainer))
    return history(trainer.state.log_history, method)


def evaluation(trainer: Any) -> dict[str, Any]:
    """The trained model's evaluation, with what its logged row adds (TRL's ``eval_num_tokens``)."""
    metrics = trainer.evaluate()
    return {**trainer.state.log_history[-1], **metrics}


def eval_pairs(kind: str) -> datasets.Dataset:
    """8 pairs past the 24 training ones."""
    return pairs(kind, 32).select(range(24, 32))


def run_ours(
    out: Path,
    kind: str,
    name: str = "ours",
    data: datasets.Dataset | None = None,
    setup: dict | None = None,
    method: str = "dpo",
    watched: dict | None = None,
    **fields: Any,
):
    """Our run; ``setup``: the trainer's own arguments (``ref_model``, ``peft_config``);
    ``watched``: filled with what ``watch`` saw."""
    set_seed(0)
    config, trainer_class = OURS[method]
    args = config(output_dir=str(out / name), **{**COMMON, **fields})
    trainer = trainer_class(base(out), args=args, train_dataset=data or pairs(kind), **(setup or {}))
    if watched is not None:
        watched.update(watch(trainer.model))
    trainer.train()
    return trainer, history(read_metrics(out / name), method)


def parity(
    out: Path, kind: str, setup: dict | None = None, method: str = "dpo", **fields: Any
) -> dict[str, Any]:
    """Both runs, step by step, and each one's evaluation of ``eval_pairs`` after training."""
    their_eval: dict[str, float] = {}
    theirs = run_trl(out, kind, method=method, evaluated=their_eval, **(setup or {}), **fields)
    trainer, ours = run_ours(out, kind, setup={**(setup or {}), "eval_dataset": eval_pairs(kind)}, method=method,
                             **fields)  # fmt: skip
    return {"ours": ours, "trl": theirs, "ours_eval": evaluation(trainer), "trl_eval": their_eval}


@scenario
def sigmoid_text(out: Path) -> dict[str, Any]:
    return parity(out, "text")


@scenario
def sigmoid_implicit(out: Path) -> dict[str, Any]:
    return parity(out, "implicit")


@scenario
def sigmoid_conversation(out: Path) -> dict[str, Any]:
    return parity(out, "conversation")


@scenario
def ipo(out: Path) -> dict[str, Any]:
    return parity(out, "text", loss_type="ipo", beta=0.5)


@scenario
def hinge(out: Path) -> dict[str, Any]:
    return parity(out, "text", loss_type="hinge")


@scenario
def robust(out: Path) -> dict[str, Any]:
    return parity(out, "text", loss_type="robust", label_smoothing=0.2)


@scenario
def orpo(out: Path) -> dict[str, Any]:
    return parity(out, "text", method="orpo", beta=0.5)


@scenario
def orpo_accumulated(out: Path) -> dict[str, Any]:
    """Two micro-batches of 2 pairs a step: the NLL term is each micro-batch's token mean, as TRL's."""
    return parity(
        out, "text", method="orpo", beta=0.5, per_device_train_batch_size=2, gradient_accumulation_steps=2
    )


@scenario
def orpo_bos(out: Path) -> dict[str, Any]:
    """A tokenizer with a BOS token it does not add itself: TRL's ORPO puts it in front of each
    prompt, and so does ours (tokenize_pair_with_bos)."""
    base(out, bos=True)
    return parity(out, "text", method="orpo", beta=0.5)


@scenario
def cpo_bos(out: Path) -> dict[str, Any]:
    base(out, bos=True)
    return parity(out, "text", method="cpo")


@scenario
def cpo(out: Path) -> dict[str, Any]:
    return parity(out, "text", method="cpo")


SIMPO = dict(loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.5, beta=2.0)


@scenario
def simpo(out: Path) -> dict[str, Any]:
    return parity(out, "text", method="cpo", **SIMPO)


@scenario
def cpo_ipo(out: Path) -> dict[str, Any]:
    return parity(out, "text", method="cpo", loss_type="ipo", beta=0.5)


@scenario
def lora_adapters_off(out: Path) -> dict[str, Any]:
    """LoRA without a ref_model: the reference is the policy with its adapters off, in both. Its
    fingerprint is the base's: adapters drawn from another seed (a rerun's) leave it as it is."""
    digests = []
    for seed in (1, 2):
        set_seed(seed)
        args = DPOConfig(output_dir=str(out / f"digest{seed}"), **COMMON)
        digests.append(
            reference_stage(
                DPOTrainer(base(out), args=args, train_dataset=pairs("text"), peft_config=lora())
            ).digest
        )
    return {**parity(out, "text", setup={"peft_config": lora()}), "same_digest": digests[0] == digests[1]}


@scenario
def ref_model(out: Path) -> dict[str, Any]:
    """A ref_model given (the same base, loaded apart): it scores the pairs once and is let go;
    TRL's reference is its own copy of the base."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from trainer.engine import Tokens
    from trainer.engine.preference import sequence_logps

    their_eval: dict[str, float] = {}
    theirs = run_trl(out, "text", evaluated=their_eval)
    trainer, ours = run_ours(out, "text", setup={"ref_model": base(out), "eval_dataset": eval_pairs("text")})
    ours_eval = evaluation(trainer)
    # A reference unlike the policy (other initial weights): both sets' cached log-probs are its own.
    torch.manual_seed(1)
    other = LlamaForCausalLM(AutoConfig.from_pretrained(base(out)))
    set_seed(0)
    args = DPOConfig(output_dir=str(out / "other"), **{**COMMON, "max_steps": 1})
    apart = DPOTrainer(base(out), ref_model=other, args=args, train_dataset=pairs("text"),
                       eval_dataset=pairs("conversation", 8))  # fmt: skip
    apart.train()
    gaps = {}
    for name, rows in (("train", apart.train_dataset), ("eval", apart.eval_dataset)):
        cached = load_file(out / "other" / "reference" / f"{name}.safetensors")["ref_logps"]
        with torch.no_grad():
            direct, _ = sequence_logps(
                Tokens(other.eval()), apart.data_collator([rows[i] for i in range(len(rows))])
            )
        gaps[name] = (cached - direct).abs().max().item()
    return {
        "ours": ours,
        "trl": theirs,
        "ours_eval": ours_eval,
        "trl_eval": their_eval,
        "ref_model_kept": reference_stage(trainer).ref_model is not None,
        "other_ref_gaps": gaps,
    }


@scenario
def other_reference(out: Path) -> dict[str, Any]:
    """A ref_model unlike the policy (the base's config, other initial weights), by path: TRL's
    forwards it at every step, ours scores the pairs once."""
    return parity(out, "text", setup={"ref_model": base(out, "other", seed=1)})


def watch(model: torch.nn.Module) -> dict[str, list[int]]:
    """Filled as ``model`` trains: ``head_calls``, one entry per call of its output head; ``rows``
    and ``widths``, the shape of each forward's input ids under autograd (a training step's)."""
    seen: dict[str, list[int]] = {"head_calls": [], "rows": [], "widths": []}
    model.get_output_embeddings().register_forward_hook(lambda *_: seen["head_calls"].append(1))

    def rows(module, args, kwargs):
        if torch.is_grad_enabled():
            seen["rows"].append(kwargs["input_ids"].shape[0])
            seen["widths"].append(kwargs["input_ids"].shape[1])

    model.register_forward_pre_hook(rows, with_kwargs=True)
    return seen


@scenario
def layouts(out: Path) -> dict[str, Any]:
    """DPO and ORPO with a tiled loss of 7 tokens a tile, and with padding-free batches: the steps
    of sigmoid_text's and orpo's padded, untiled runs, with what ``watch`` saw."""
    results: dict[str, Any] = {}
    layouts = {"tiled": {"tiled_loss": "true", "tile_tokens": 7}, "padding_free": {"padding_free": True}}
    for method, fields in (("dpo", {}), ("orpo", {"beta": 0.5})):
        for layout, options in layouts.items():
            set_seed(0)
            config, trainer_class = OURS[method]
            name = f"{method}_{layout}"
            args = config(output_dir=str(out / name), **{**COMMON, **fields, **options})
            trainer = trainer_class(base(out), args=args, train_dataset=pairs("text"))
            seen = watch(trainer.model)
            trainer.train()
            results[name] = {**history(read_metrics(out / name), method), **seen}
    return results


@scenario
def resume(out: Path) -> dict[str, Any]:
    """Stopped after step 2's checkpoint and resumed in another output_dir that holds only that
    checkpoint: the reference is scored again, from the initial weights (before the checkpoint is
    loaded), and steps 3-4 and the final weights equal the uninterrupted run's."""
    from safetensors.torch import load_file

    saving = dict(save_strategy="steps", save_steps=2)
    whole, rows = run_ours(out, "text", "whole", **saving)
    (out / "resumed").mkdir()
    shutil.copytree(out / "whole" / "checkpoint-2", out / "resumed" / "checkpoint-2")
    set_seed(0)
    args = DPOConfig(output_dir=str(out / "resumed"), **{**COMMON, **saving})
    resumed = DPOTrainer(base(out), args=args, train_dataset=pairs("text"))
    resumed.train(resume_from_checkpoint=True)
    weights = []
    for trainer, name in ((whole, "whole"), (resumed, "resumed")):
        trainer.save_model(str(out / name / "export"))
        weights.append(load_file(out / name / "export" / "model.safetensors"))
    return {
        "whole": rows,
        "resumed": history(read_metrics(out / "resumed")),
        "same_weights": weights[0].keys() == weights[1].keys()
        and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]),
    }


@scenario
def reference_cache(out: Path) -> dict[str, Any]:
    """A first run scores the reference of its train and eval sets before the first step; a second
    in the same output_dir reads them back; one whose pairs differ is refused, its cache left as it
    was. A set of its own passed to evaluate() is scored before training, and refused after it."""
    set_seed(0)
    args = DPOConfig(output_dir=str(out / "cached"), **{**COMMON, "max_steps": 1})
    first = DPOTrainer(
        base(out), args=args, train_dataset=pairs("text"), eval_dataset=pairs("conversation", 8)
    )
    other_set = first.evaluate(pairs("implicit"))  # before training: scored and cached apart
    first.train()
    rows = history(read_metrics(out / "cached"))
    after = first.evaluate()  # the eval set, scored before the step: against the initial policy
    try:
        first.evaluate(pairs("implicit", 12))
        late = ""
    except ValueError as err:
        late = str(err)
    cache = out / "cached" / "reference" / "train.safetensors"
    stamp = cache.stat().st_mtime_ns
    run_ours(out, "text", "cached", max_steps=2)
    try:
        run_ours(out, "text", "cached", data=pairs("implicit"), max_steps=3)
        refusal = ""
    except ValueError as err:
        refusal = str(err)
    return {
        "first_loss": rows["loss"][0],
        "ln2": math.log(2),
        "first_rewards": [rows[k][0] for k in ("rewards/chosen", "rewards/rejected", "rewards/margins")],
        "rescored": cache.stat().st_mtime_ns != stamp,
        "refusal": refusal,
        "cache_file": str(cache),
        "other_set_loss": other_set.get("eval_loss"),
        "eval_after_a_step": after["eval_loss"],
        "late_set_refusal": late,
        "reference_files": sorted(p.name for p in cache.parent.glob("*.safetensors")),
    }


@scenario
def reference_resume(out: Path) -> dict[str, Any]:
    """The reference pass stopped after 3 of its 6 batches (of 4 pairs, each written as it is
    scored), then the run again in the same output_dir: the pass forwards only the 3 batches left,
    and its cache and the steps equal an uninterrupted run's, bitwise."""
    from safetensors.torch import load_file

    import trainer.loop.reference as reference
    from trainer.engine.preference import PairObjective

    reference.FLUSH_PAIRS = 4
    calls, real = [], PairObjective.reference_logps  # what the reference stage asks of each batch

    def counted(objective, tokens, batch, stop_after=None):
        calls.append(1)
        if stop_after is not None and len(calls) > stop_after:
            raise KeyboardInterrupt("stopped in the reference pass")
        return real(objective, tokens, batch)

    fields = dict(precompute_ref_batch_size=4, max_steps=2)
    _, whole = run_ours(out, "text", "whole", **fields)
    PairObjective.reference_logps = lambda *args: counted(*args, stop_after=3)
    try:
        run_ours(out, "text", "resumed", **fields)
        stopped = False
    except KeyboardInterrupt:
        stopped = True
    chunks = len(list((out / "resumed" / "reference" / "train.partial").glob("*.safetensors")))
    calls.clear()
    PairObjective.reference_logps = counted
    _, resumed = run_ours(out, "text", "resumed", **fields)
    PairObjective.reference_logps = real
    caches = [
        load_file(out / name / "reference" / "train.safetensors")["ref_logps"]
        for name in ("whole", "resumed")
    ]
    return {
        "stopped": stopped,
        "chunks_left": chunks,
        "forwards_after": len(
            calls
        ),  # the pass's (6 batches, 3 done) and nothing else: the steps call the objective
        "partial_left": (out / "resumed" / "reference" / "train.partial").exists(),
        "same_cache": bool(torch.equal(caches[0], caches[1])),
        "whole": whole,
        "resumed": resumed,
    }


@scenario
def zero_stages(out: Path) -> dict[str, Any]:
    """Under a launcher: the text pairs, every rank a share of the same global batch of 4 pairs:
    under ZeRO-2 in one micro-batch, under ZeRO-3 in two accumulated ones (the reference pass
    scores with the partitioned weights)."""
    per_rank = COMMON["per_device_train_batch_size"] // dist_info().world_size
    reference = AutoModelForCausalLM.from_pretrained(base(out, "other", seed=1))
    runs = {
        "zero2": run_ours(out, "text", "zero2", zero_stage=2, per_device_train_batch_size=per_rank)[1],
        "zero3_accumulated": run_ours(out, "text", "zero3", zero_stage=3, per_device_train_batch_size=per_rank // 2,
                                      gradient_accumulation_steps=2)[1],
        # ORPO's micro-batches hold the pairs one process's two accumulated ones hold (orpo_accumulated)
        "orpo_zero2": run_ours(out, "text", "orpo_zero2", method="orpo", zero_stage=2, beta=0.5,
                               per_device_train_batch_size=per_rank)[1],
        "simpo_zero3_accumulated": run_ours(out, "text", "simpo_zero3", method="cpo", zero_stage=3,
                                            per_device_train_batch_size=per_rank // 2, gradient_accumulation_steps=2,
                                            **SIMPO)[1],
        # SFTTrainer on packed text (tests/helpers/sft_scenarios.py's text_packed)
        "sft_packed_zero3_accumulated": sft_zero3(out, per_rank // 2),
    }  # fmt: skip
    # The tiled loss under ZeRO-3: the partitioned head is gathered by each tile's call, its
    # gradient reduced once (sigmoid_text's steps)
    runs["tiled_zero3"] = run_ours(out, "text", "tiled_zero3", zero_stage=3, per_device_train_batch_size=per_rank,
                                   tiled_loss="true", tile_tokens=7)[1]  # fmt: skip
    # other_reference's ref_model (built before any ZeRO-3 run: HF's loading reads that run's
    # config), partitioned over the ranks by an engine of its own while it scores
    runs["ref_model_zero3"] = run_ours(out, "text", "ref_zero3", setup={"ref_model": reference}, zero_stage=3,
                                       per_device_train_batch_size=per_rank)[1]  # fmt: skip
    # Sequence parallelism, last: its groups and attention are set up once per process. SP=2: both
    # ranks hold every pair, each its half of every sequence, the NLL summed over the two. DPO with
    # ZeRO-3 and tiles (sigmoid_text's steps); ORPO padding-free, its packed sequences kept apart
    # (orpo_accumulated's)
    sp = dict(sequence_parallel_size=2, per_device_train_batch_size=COMMON["per_device_train_batch_size"])
    split: dict[str, list[int]] = {}
    runs["sp2_tiled_zero3"] = run_ours(out, "text", "sp2_tiled", zero_stage=3, tiled_loss="true", tile_tokens=7,
                                       watched=split, **sp)[1]  # fmt: skip
    runs["orpo_sp2_padding_free"] = run_ours(out, "text", "orpo_sp2", method="orpo", beta=0.5, zero_stage=2,
                                             padding_free=True, **{**sp, "per_device_train_batch_size": 2},
                                             gradient_accumulation_steps=2)[1]  # fmt: skip
    held = sum(int(getattr(p, "ds_tensor", p).numel()) for p in reference.parameters())
    whole = sum(int(getattr(p, "ds_numel", p.numel())) for p in reference.parameters())
    return {
        **runs,
        "world_size": dist_info().world_size,
        "ref_model_share": held / whole,
        "sp_widths": split["widths"],
    }


def sft_zero3(out: Path, per_rank: int) -> dict[str, list[float]]:
    from tests.helpers.sft_scenarios import rows, run_ours

    fields = dict(
        zero_stage=3, per_device_train_batch_size=per_rank, gradient_accumulation_steps=2, packing=True
    )
    return run_ours(out, {"train_dataset": rows("text")}, None, {}, "sft_zero3", **fields)[1]


def main(scenarios: dict[str, Callable[[Path], dict[str, Any]]] = SCENARIOS) -> int:
    """Run the scenarios argv names (after OUT), each writing OUT/<scenario>.json on the main rank."""
    out, *names = sys.argv[1:]
    for name in names:
        result = scenarios[name](Path(out) / name)
        if dist_info().is_main:
            (Path(out) / f"{name}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    exit_now(main())
