"""The planner's LoRA figures: adapter counts against peft's own on real tiny models, the states
LoRA and QLoRA keep, and `trainer plan --lora-r` through the CLI."""

from __future__ import annotations

import json

import peft
import pytest
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from trainer.cli.main import main
from trainer.planner import Cluster, Setup, estimate, load_model_spec, lora_params, spec_from_hf_config

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3,
         "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 300}  # fmt: skip
GPT2 = {"model_type": "gpt2", "n_embd": 48, "n_layer": 2, "n_head": 4, "vocab_size": 300, "n_positions": 64}


@pytest.mark.parametrize("cfg, build", [(LLAMA, lambda c: LlamaForCausalLM(LlamaConfig(**c))),
                                        (GPT2, lambda c: GPT2LMHeadModel(GPT2Config(**c)))])  # fmt: skip
def test_adapter_count_is_pefts(cfg, build):
    model = peft.get_peft_model(build(cfg), peft.LoraConfig(r=8, target_modules="all-linear"))
    trainable, total = model.get_nb_trainable_parameters()
    spec = spec_from_hf_config(cfg)
    assert lora_params(spec, 8) == trainable
    assert spec.n_params == total - trainable


def test_lora_keeps_gradients_and_optimizer_states_for_the_adapters_only():
    spec, one_gpu = load_model_spec("llama-7b"), Cluster(gpus_per_node=1)
    full = estimate(spec, Setup(0, "none", "none", False), one_gpu, 2048, 1)
    lora = estimate(spec, Setup(0, "none", "none", False), one_gpu, 2048, 1, lora_r=16)
    qlora = estimate(spec, Setup(0, "none", "none", False), one_gpu, 2048, 1, lora_r=16, qlora=True)
    n, a = spec.n_params, lora_params(spec, 16)
    assert a == 39_976_960  # peft's count for Llama-2-7B, all-linear, r=16
    assert full["model_states_gb_per_gpu"] == pytest.approx((2 + 2 + 12) * n / 1e9)
    assert lora["params_gb_per_gpu"] == pytest.approx((2 * n + 2 * a) / 1e9)
    assert lora["grads_gb_per_gpu"] == pytest.approx(2 * a / 1e9)
    assert lora["optimizer_gb_per_gpu"] == pytest.approx(12 * a / 1e9)
    embeddings = 2 * spec.vocab_size * spec.hidden_size
    assert qlora["params_gb_per_gpu"] == pytest.approx(
        (0.52 * (n - embeddings) + 2 * embeddings + 2 * a) / 1e9
    )
    assert lora["activations_gb_per_gpu"] == full["activations_gb_per_gpu"]
    assert full["total_gb_per_gpu"] > 140 > 80 > lora["total_gb_per_gpu"] > qlora["total_gb_per_gpu"]


def test_plan_cli_with_lora(capsys):
    assert main(["plan", "--model", "llama-70b", "--lora-r", "16", "--qlora", "--json"]) in (0, 1)
    result = json.loads(capsys.readouterr().out)
    assert (result["lora_r"], result["qlora"], result["trainable_params"]) == (16, True, 207_093_760)
    assert main(["plan", "--model", "llama-7b", "--qlora"]) == 2
    assert "--qlora: QLoRA trains LoRA adapters: give --lora-r too" in capsys.readouterr().err


@pytest.mark.parametrize(
    "model, gpus, stage, checkpointing",
    [("llama-7b", 1, 0, False), ("llama-70b", 8, 3, True)],
)
def test_the_finetuning_pages_table_is_the_planners(capsys, model, gpus, stage, checkpointing):
    """docs/finetuning.md's per-GPU figures, as `trainer plan` prints them today."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "finetuning.md").read_text()
    name = "Llama-" + model.split("-")[1].upper()
    (row,) = [line for line in page.splitlines() if line.startswith(f"| {name} on {gpus} GPU")]
    documented = [float(cell.split()[0]) for cell in row.strip("|").split("|")[1:]]
    figures = []
    for extra in ([], ["--lora-r", "16"], ["--lora-r", "16", "--qlora"]):
        main(["plan", "--model", model, "--gpus-per-node", str(gpus), *extra, "--json"])
        rows = json.loads(capsys.readouterr().out)["configurations"]
        (chosen,) = [r for r in rows if (r["zero_stage"], r["activation_checkpointing"]) == (stage, checkpointing)
                     and r["offload_optimizer"] == r["offload_param"] == "none"]  # fmt: skip
        figures.append(round(chosen["total_gb_per_gpu"], 1))
    assert documented == figures
