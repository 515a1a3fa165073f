"""LoRA through ``scripts/train.py`` on a local base model (an HF directory built here): ZeRO-3 on 2
ranks under torchrun (the deepspeed launcher's own start-up is the launch matrix's); ZeRO-0, ZeRO-1
and ZeRO-2 with CPU offload and activation checkpointing on one process, training the adapters alike;
rslora, DoRA, modules to save and dropout. final/ is a peft adapter that peft loads onto the base,
equal to the trained weights; ``trainer export --merge`` gives a full model with the same logits; a
resume is bit-exact; the optimizer holds state for the adapters only; and what LoRA cannot do is
refused by name. Only the tests of the 2-rank run are ``distributed``: the one-process ones run two
at a time in make test."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.helpers.launch import launch
from tests.helpers.lora_base import make_base
from tests.helpers.scaffold import assert_same_weights, load_weights, losses, read_metrics, tiny_flags

RUN = ["--use_peft", "--lora_target_modules", "all-linear", "--lora_r", "4", "--lora_alpha", "8",
       *tiny_flags(save_steps=2, max_train_samples=None, max_eval_samples=8, model_config_overrides=None,
                   learning_rate="1e-2", optim="adamw_torch")]  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict[str, Path]:
    return make_base(tmp_path_factory.mktemp("lora"))


def train(base, out: Path, *extra: str, launcher: str = "torchrun", check: bool = True):
    args = ["scripts/train.py", "--output_dir", str(out), "--model_name_or_path", str(base["base"]),
            "--dataset", str(base["corpus"]), *RUN, *extra]  # fmt: skip
    return launch(args, launcher=launcher, check=check)


@pytest.fixture(scope="module")
def zero3(base) -> tuple[Path, str]:
    out = base["root"] / "zero3"
    proc = train(base, out, "--zero_stage", "3")
    return out, proc.stdout + proc.stderr


def adapter(directory: Path) -> dict[str, torch.Tensor]:
    return load_weights(directory / "adapter_model.safetensors")


@pytest.mark.distributed
def test_final_is_a_peft_adapter_equal_to_the_trained_weights(zero3, tmp_path):
    out, _ = zero3
    final = adapter(out / "final")
    assert final and all(t.numel() > 0 for t in final.values())  # not empty under ZeRO-3
    assert all(t.abs().sum() > 0 for k, t in final.items() if "lora_B" in k)  # trained away from zero
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    # The same tensors as the checkpoint of that step, consolidated offline.
    launch(
        ["-m", "trainer.cli.main", "export", str(out / "checkpoint-4"), str(tmp_path / "a")],
        launcher="python",
    )
    assert_same_weights(adapter(tmp_path / "a"), final)


@pytest.mark.distributed
def test_merged_export_has_the_adapter_models_logits(zero3, tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    out, _ = zero3
    launch(["-m", "trainer.cli.main", "export", str(out / "checkpoint-4"), str(tmp_path / "m"), "--merge"],
           launcher="python")  # fmt: skip
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    with_adapter = AutoPeftModelForCausalLM.from_pretrained(out / "final")
    ids = torch.randint(3, 500, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, with_adapter(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    assert not any(k.startswith("base_model") or "lora" in k for k in load_weights(tmp_path / "m"))


@pytest.mark.distributed
def test_only_the_adapters_train_and_are_counted(zero3, base):
    out, text = zero3
    trainable = sum(t.numel() for t in adapter(out / "final").values())
    total = trainable + sum(p.numel() for p in LlamaForCausalLM.from_pretrained(base["base"]).parameters())
    assert f"Parameters: {trainable:,} trainable of {total:,} (" in text
    rows = read_metrics(out)
    assert {(r["trainable_params"], r["total_params"]) for r in rows if "loss" in r} == {(trainable, total)}
    # The optimizer's fp32 state (master copy and two moments) covers the adapters alone.
    optim = sum(f.stat().st_size for f in (out / "checkpoint-4" / "ds").glob("*optim_states.pt"))
    assert optim < 2 * 12 * trainable < 12 * total / 4


@pytest.mark.distributed
def test_resume_is_bit_exact(zero3, base):
    out, _ = zero3
    resumed = base["root"] / "resumed"
    shutil.copytree(out, resumed, ignore=shutil.ignore_patterns("checkpoint-4", "final", ".trainer.lock"))
    proc = train(base, resumed, "--zero_stage", "3")
    assert f"Resumed from {resumed / 'checkpoint-2'} at step 2" in proc.stdout + proc.stderr
    assert_same_weights(adapter(resumed / "final"), adapter(out / "final"))


# One process at each other stage: the same adapters, data and seed, so the same training.
STAGES = {
    "zero0": ["--zero_stage", "0"],
    "zero1": ["--zero_stage", "1"],
    "zero2_offload_checkpointing": ["--zero_stage", "2", "--offload_optimizer", "cpu", "--gradient_checkpointing"],
}  # fmt: skip


@pytest.fixture(scope="module")
def stages(base) -> dict[str, Path]:
    runs = {name: base["root"] / name for name in STAGES}
    for name, flags in STAGES.items():
        train(base, runs[name], *flags, launcher="python")
    return runs


def test_every_stage_trains_the_adapters_alike(stages, base):
    """Each stage's run moves every lora_B away from its zero start and learns (the last logged loss
    below the first); the stages agree on the losses and the adapters (ZeRO-2's offload steps
    DeepSpeed's CPU Adam, the others torch's AdamW: equal up to rounding)."""
    reference = losses(stages["zero0"])
    assert len(reference) == 4 and reference[-1] < reference[0], reference
    for name, out in stages.items():
        final = adapter(out / "final")
        lora_b = {k: t for k, t in final.items() if "lora_B" in k}
        assert lora_b and all(t.abs().sum() > 0 for t in lora_b.values()), name
        assert losses(out) == pytest.approx(reference, rel=1e-4), name
        assert_same_weights(final, adapter(stages["zero0"] / "final"), rtol=1e-3, atol=1e-5, what=name)


def test_lora_options_reach_the_adapter(base, tmp_path):
    """rslora, DoRA, modules trained in full and dropout: recorded in the adapter's config and in its
    weights (DoRA's magnitudes, lm_head's full copy, trained away from the base's)."""
    out = tmp_path / "options"
    train(base, out, "--zero_stage", "1", "--use_rslora", "true", "--use_dora", "true",
          "--lora_modules_to_save", "lm_head", "--lora_dropout", "0.2", launcher="python")  # fmt: skip
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert (config["use_rslora"], config["use_dora"], config["lora_dropout"]) == (True, True, 0.2)
    assert config["modules_to_save"] == ["lm_head"]
    final = adapter(out / "final")
    assert any("lora_magnitude_vector" in k for k in final), sorted(final)
    head = [t for k, t in final.items() if "lm_head" in k and "lora" not in k]
    base_head = LlamaForCausalLM.from_pretrained(base["base"]).lm_head.weight
    assert len(head) == 1 and head[0].shape == base_head.shape
    assert not torch.equal(head[0], base_head.detach())


def test_what_lora_cannot_do_is_refused_by_name_before_loading(base, tmp_path, capsys):
    from trainer.cli.train import main

    model = ["--model_name_or_path", str(base["base"])]
    cases = {
        "error: use_peft: LoRA adapts an existing model": ["--use_peft"],
        "error: use_peft: LoRA runs with ZeRO 0-3": ["--use_peft", *model, "--pipeline_parallel_size", "2"],
        r"error: use_peft, expert_parallel_size: .* not with expert parallelism \(DeepSpeed's ZeRO 1-2": [
            "--use_peft",
            *model,
            "--expert_parallel_size",
            "2",
        ],
        r"error: load_in_4bit: a 4-bit base \(QLoRA\) needs a CUDA GPU": [
            "--use_peft",
            "--load_in_4bit",
            *model,
        ],
        "error: load_in_4bit: a 4-bit base cannot be trained in full": ["--load_in_4bit", *model],
    }
    for message, flags in cases.items():
        assert main(["--output_dir", str(tmp_path / "o"), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.match(message, err[0]), err
    assert not (tmp_path / "o").exists()
