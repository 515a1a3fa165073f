"""The memory planner's arithmetic: model states, buffers, activations, parameter counts, the plan."""

from __future__ import annotations

import dataclasses
import json

import pytest

from trainer.config.errors import ConfigError
from trainer.planner import (
    GB,
    PRESETS,
    Cluster,
    ModelSpec,
    Setup,
    activation_bytes,
    buffer_bytes,
    estimate,
    format_table,
    knobs_from_config,
    load_model_spec,
    model_state_bytes,
    no_fit_message,
    plan,
    setups,
    spec_from_counts,
    spec_from_hf_config,
)


def states_gb(n: float, stage: int, dp: int, **kw) -> float:
    s = model_state_bytes(int(n), stage, dp, **kw)
    return (s["params"] + s["grads"] + s["optimizer"]) / GB


def test_zero_paper_figures_for_7_5b_on_64_gpus():
    # Rajbhandari et al. 2020, Figure 1: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device.
    got = [round(states_gb(7.5e9, stage, 64), 1) for stage in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9]


def test_model_states_split_by_stage():
    n, dp = 1000, 10
    assert model_state_bytes(n, 0, dp) == {"params": 2000, "grads": 2000, "optimizer": 12000, "cpu": 0.0}
    assert model_state_bytes(n, 1, dp) == {"params": 2000, "grads": 2000, "optimizer": 1200, "cpu": 0.0}
    assert model_state_bytes(n, 2, dp) == {"params": 2000, "grads": 200, "optimizer": 1200, "cpu": 0.0}
    assert model_state_bytes(n, 3, dp) == {"params": 200, "grads": 200, "optimizer": 1200, "cpu": 0.0}


def test_fp32_model_states():
    # fp32: 4-byte params and grads; a plain stage-0 run keeps only Adam's two moments (K=8) ...
    assert model_state_bytes(1000, 0, 2, "fp32") == {
        "params": 4000,
        "grads": 4000,
        "optimizer": 8000,
        "cpu": 0.0,
    }
    # ... while the ZeRO optimizer keeps its own fp32 partition besides them (K=12).
    assert model_state_bytes(1000, 1, 2, "fp32")["optimizer"] == 6000


def test_offload_moves_optimizer_and_fp32_grads_to_host():
    n, dp = 1000, 10
    s = model_state_bytes(n, 2, dp, offload_optimizer="cpu")
    # GPU: the 16-bit parameters only; host: 12Ψ/Nd Adam states + 4Ψ/Nd fp32 gradient partition.
    assert s == {"params": 2000, "grads": 0.0, "optimizer": 0.0, "cpu": 1600}
    s = model_state_bytes(n, 1, dp, offload_optimizer="cpu")
    assert (s["grads"], s["cpu"]) == (2000, 1600)  # stage 1 accumulates full gradients on the GPU
    s = model_state_bytes(n, 3, dp, offload_optimizer="cpu", offload_param="cpu")
    assert s == {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "cpu": 1800}


def test_setups_are_the_valid_combinations_fastest_first():
    all_setups = setups()
    assert len(all_setups) == 16  # 4 stages x ckpt, 3 offloadable stages x ckpt, stage 3 param offload x ckpt
    assert all_setups[0] == Setup(0, "none", "none", False)
    assert all_setups[-1] == Setup(3, "cpu", "cpu", True)
    assert not any(s.offload_param == "cpu" and s.zero_stage != 3 for s in all_setups)
    assert not any(s.offload_optimizer == "cpu" and s.zero_stage == 0 for s in all_setups)
    # No offload before any offload; without checkpointing before with; lower stage first.
    keys = [(("none", "cpu").index(s.offload_optimizer), s.offload_param == "cpu") for s in all_setups]
    assert keys == sorted(keys)


TINY = ModelSpec("tiny", n_params=10_000, n_layers=2, hidden_size=64, n_heads=4, vocab_size=100,
                 largest_layer_params=6400, small_params=320)  # fmt: skip


def test_activation_formula_by_hand():
    # TINY is Llama-style: h=64, 4 heads of 16 (q = kv = 64), MLP width 4h = 256; s=16, b=2: 32 tokens.
    plain, ckpt = Setup(0, "none", "none", False), Setup(0, "none", "none", True)
    norms = 2 * (4 * 64 + 2 * 2 * 64 + 4)  # per RMSNorm: fp32 input, normalised input, output, rsqrt
    attention = 2 * (2 * 64 + 2 * 64) + 4 * 4  # rotated q and k, v, output; a log-sum-exp per head
    layer = norms + attention + 4 * 2 * 256  # gate, up, activation, product
    working = 2 * 2 * 256 + 2 * 2 * 64  # the MLP's backward, the residual stream's gradients
    rope, head = 2 * 2 * 16, (4 * 64 + 2 * 2 * 64 + 4) + 12 * 100  # cos/sin; final norm, loss
    got = activation_bytes(TINY, 16, 2, "bf16", plain)
    assert got["gpu"] == 32 * (2 * layer + rope + max(head, working))
    assert got["logits"] == 32 * 12 * 100 and got["cpu"] == 0
    # Checkpointing keeps each layer's 16-bit input; backward recomputes one layer at a time.
    got = activation_bytes(TINY, 16, 2, "bf16", ckpt)
    assert got["gpu"] == 32 * (2 * 2 * 64 + rope + max(head, layer + working))
    # GPT-2 keeps Korthikanti et al.'s count: s·b·h·(34 + 5·a·s/h) bytes a layer in 16-bit.
    gpt2 = dataclasses.replace(TINY, arch="gpt2")
    korthikanti = 16 * 2 * 64 * (34 + 5 * 4 * 16 / 64)
    stored = activation_bytes(gpt2, 16, 2, "bf16", plain)["stored"]
    assert stored == pytest.approx(2 * korthikanti)
    assert activation_bytes(gpt2, 16, 2, "fp32", plain)["stored"] == pytest.approx(4 * korthikanti)


def test_buffers_by_stage_with_explicit_bucket_sizes():
    knobs = knobs_from_config({
        "zero_optimization": {"reduce_bucket_size": 500, "stage3_prefetch_bucket_size": 100,
                              "stage3_param_persistence_threshold": 10, "overlap_comm": True}
    })  # fmt: skip
    b0 = buffer_bytes(TINY, Setup(0, "none", "none", False), 4, "bf16", knobs)
    assert b0 == {"allreduce_bucket": 2 * 10_000, "fp32_grad_flat": 4 * 10_000}
    b2 = buffer_bytes(TINY, Setup(2, "none", "none", False), 4, "bf16", knobs)
    assert b2 == {"reduce_bucket": 2 * 500 * 2, "fp32_grad_partition": 4 * 10_000 / 4}
    b2_offload = buffer_bytes(TINY, Setup(2, "cpu", "none", False), 4, "bf16", knobs)
    assert b2_offload == {"reduce_bucket": 2 * 500 * 2}  # the fp32 partition lives on the host
    b3 = buffer_bytes(TINY, Setup(3, "none", "none", False), 4, "bf16", knobs)
    assert b3 == {
        "reduce_bucket": 2000,
        "fp32_grad_partition": 10_000,
        "stage3_gathered_params": 2 * (100 + 6400),
        "stage3_layer_grad": 2 * 6400,
        "stage3_persistent_params": 2 * 320,
    }


def test_knobs_accept_both_spellings_and_default_to_deepspeed():
    assert knobs_from_config(None)["reduce_bucket_size"] == 5e8
    assert knobs_from_config(None)["overlap_comm"] is None
    short = knobs_from_config({"zero_optimization": {"prefetch_bucket_size": 7}})
    assert short["stage3_prefetch_bucket_size"] == 7


# Parameter counts: the presets against the published sizes, and configs against real HF models.


@pytest.mark.parametrize(
    ("name", "params"),
    [("gpt2", 124_439_808), ("llama-7b", 6_738_415_616), ("llama-13b", 13_015_864_320),
     ("llama-70b", 68_976_648_192), ("llama-1b", 1_235_814_400), ("llama-8b", 8_030_261_248)],
)  # fmt: skip
def test_preset_parameter_counts(name, params):
    assert load_model_spec(name).n_params == params


def _hf_count(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields tied weights once


def test_parameter_count_matches_real_hf_models():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    llama = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=300)  # fmt: skip
    gpt2 = GPT2Config(n_embd=48, n_layer=2, n_head=4, vocab_size=257, n_positions=40)
    for config, cls in ((llama, LlamaForCausalLM), (gpt2, GPT2LMHeadModel)):
        spec = spec_from_hf_config(config.to_dict())
        assert spec.n_params == _hf_count(cls(config))
    tied = LlamaConfig(**{**llama.to_dict(), "tie_word_embeddings": True})
    assert spec_from_hf_config(tied.to_dict()).n_params == _hf_count(LlamaForCausalLM(tied))


def test_load_model_spec_from_file_and_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["llama-7b"]))
    assert load_model_spec(str(tmp_path)).n_params == 6_738_415_616
    assert load_model_spec(str(tmp_path / "config.json")).n_layers == 32


def test_load_model_spec_errors(tmp_path):
    with pytest.raises(
        ConfigError, match=r"--model: no such file or preset \(not a preset; did you mean llama-7b\?\)"
    ):
        load_model_spec("llama-7")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read .*config.json as JSON"):
        load_model_spec(str(tmp_path))
    with pytest.raises(ConfigError, match="missing key hidden_size"):
        spec_from_hf_config({"model_type": "llama", "num_hidden_layers": 2})


def test_spec_from_counts():
    spec = spec_from_counts(7.5e9, 32, 4096, 32, 32000)
    assert (spec.name, spec.n_params, spec.largest_layer_params) == ("7.5B", 7_500_000_000, 32000 * 4096)


# The plan and its recommendation.


def test_estimate_row_totals_add_up():
    cluster = Cluster(gpus_per_node=8, nodes=2, gpu_memory_gb=80, cpu_memory_gb=512)
    row = estimate(load_model_spec("llama-7b"), Setup(2, "none", "none", True), cluster, 2048, 1)
    parts = row["model_states_gb_per_gpu"] + row["buffers_gb_per_gpu"] + row["activations_gb_per_gpu"]
    assert row["total_gb_per_gpu"] == pytest.approx(parts)
    assert row["model_states_gb_per_gpu"] == pytest.approx(
        row["params_gb_per_gpu"] + row["grads_gb_per_gpu"] + row["optimizer_gb_per_gpu"]
    )
    assert row["buffers_gb_per_gpu"] == pytest.approx(sum(row["buffers"].values()))
    assert row["gpu_gb_per_node"] == pytest.approx(8 * row["total_gb_per_gpu"])
    assert row["fits"] is True


def test_recommends_the_first_configuration_that_fits():
    result = plan(load_model_spec("llama-7b"), Cluster(8, 1, 80, 1024), 2048, 1)
    rows = result["configurations"]
    best = result["recommended"]
    assert best is not None and best["fits"]
    assert all(not r["fits"] for r in rows[: rows.index(best)])
    # 7B on 8 x 80 GB: ZeRO-1 without offload or checkpointing is the fastest that fits (13 GB of
    # activations; ZeRO-0's 108 GB of model states do not).
    assert (best["zero_stage"], best["offload_optimizer"], best["activation_checkpointing"]) == (
        1,
        "none",
        False,
    )


def test_only_offload_fits():
    # 13B on one 80 GB GPU: 16 bytes a parameter cannot stay on the GPU.
    result = plan(load_model_spec("llama-13b"), Cluster(1, 1, 80, 512), 2048, 1)
    without_offload = [r for r in result["configurations"] if r["offload_optimizer"] == "none"]
    assert not any(r["fits"] for r in without_offload)
    best = result["recommended"]
    assert best["offload_optimizer"] == "cpu" and best["fits"]


def test_nothing_fits_message():
    result = plan(load_model_spec("llama-70b"), Cluster(1, 1, 24, 64), 4096, 1)
    assert result["recommended"] is None
    message = no_fit_message(result)
    assert message.startswith("no configuration fits: the leanest (ZeRO-3, optimizer and parameter offload")
    assert "of 21.6 GB usable" in message and "of 57.6 GB usable" in message
    assert message.endswith("lower --micro-batch or --seq-len, or add GPUs or nodes")


def test_host_memory_decides_fit_for_offload():
    # Same GPUs, too little host memory for the offloaded states: offload rows fail on the CPU side.
    result = plan(load_model_spec("llama-13b"), Cluster(1, 1, 80, 64), 2048, 1)
    offload = [r for r in result["configurations"] if r["offload_optimizer"] == "cpu"]
    assert any(r["fits_gpu"] for r in offload)
    assert all(not r["fits_cpu"] and not r["fits"] for r in offload)
    assert result["recommended"] is None


def test_plan_sizes_buffers_from_the_given_config():
    spec = load_model_spec("llama-7b")
    small = {"zero_optimization": {"reduce_bucket_size": 1000}}
    default = plan(spec, Cluster(), 2048, 1)["configurations"][2]
    sized = plan(spec, Cluster(), 2048, 1, config_for=lambda setup: small)["configurations"][2]
    assert default["buffers"]["reduce_bucket"] == pytest.approx(2 * 5e8 / GB)
    assert sized["buffers"]["reduce_bucket"] == pytest.approx(2 * 1000 / GB)


def test_format_table_has_one_line_per_configuration():
    result = plan(load_model_spec("gpt2"), Cluster(2, 1, 16, 64), 1024, 4)
    lines = format_table(result).splitlines()
    assert len(lines) == 2 + 16
    assert lines[0].split() == ["zero", "tp", "ep", "offload", "ckpt", "|", "model", "buffers", "activ.", "total/GPU",
                                "GPU/node", "CPU/node", "|", "fits"]  # fmt: skip
    assert lines[-1].split()[:5] == ["3", "1", "1", "opt+param", "on"]
