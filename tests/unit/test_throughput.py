"""Throughput metrics: FLOPs per token, peaks and MFU, throughput windows over one and two ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from trainer.data.collator import non_padding_tokens
from trainer.observe.throughput import (
    flops_per_token_for_model,
    lookup_params,
    model_flops_per_token,
    peak_tflops,
)
from trainer.observe.window import StepTimer

# ---- FLOPs and peaks


def test_flops_per_token_formula():
    # 6·N over the non-embedding parameters, plus 12·L·h·s for the attention scores.
    assert model_flops_per_token(1000, 2, 8, 16) == 6 * 1000 + 12 * 2 * 8 * 16
    assert model_flops_per_token(1000, 2, 8, 16, n_embedding_params=200) == 6 * 800 + 12 * 2 * 8 * 16
    # Llama-2-7B at 4096 tokens: 6 x 6.607e9 (without the 131M embedding table) + 12·32·4096·4096.
    flops = model_flops_per_token(6_738_415_616, 32, 4096, 4096, n_embedding_params=32000 * 4096)
    assert flops == pytest.approx(6 * 6_607_343_616 + 6_442_450_944)
    assert flops == pytest.approx(4.608e10, rel=1e-3)


def test_lookup_params_of_real_models():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=24))
    # wte is tied to the output layer (a real matmul); only the position table is a pure lookup.
    assert lookup_params(gpt2) == 24 * 32
    llama_config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, vocab_size=100)  # fmt: skip
    llama = LlamaForCausalLM(llama_config)
    assert lookup_params(llama) == 100 * 32  # untied: the input table is a lookup, lm_head a matmul
    n = sum(p.numel() for p in llama.parameters())
    assert flops_per_token_for_model(llama, 64) == 6 * (n - 100 * 32) + 12 * 2 * 32 * 64


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989),
        ("NVIDIA H100 PCIe", "bf16", 756),
        ("NVIDIA H100 NVL", "fp16", 835),
        ("NVIDIA H200", "torch.bfloat16", 989),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312),
        ("NVIDIA A100-SXM4-40GB", "tf32", 156),
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
        ("NVIDIA L4", "bf16", 121),
        ("NVIDIA L40S", "bf16", 362),
        ("NVIDIA L40", "bf16", None),  # not an L4
        ("NVIDIA A10G", "bf16", 125),
        ("NVIDIA A10", "float16", 125),
        ("Tesla V100-SXM2-16GB", "fp16", 125),
        ("Tesla V100-PCIE-32GB", "fp16", 112),
        ("Tesla V100-SXM2-16GB", "bf16", None),  # V100 has no bf16
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
        ("AMD Instinct MI300X", "bf16", 1307.4),
        ("cpu", "fp32", None),
    ],
)
def test_peak_tflops_table(name, dtype, peak):
    assert peak_tflops(name, dtype) == peak


# ---- throughput


class Clock:
    """A settable clock, so window lengths are exact."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_step_timer_window_metrics():
    clock = Clock()
    timer = StepTimer(flops_per_token=1e9, device_name="NVIDIA A100-SXM4-80GB", precision="bf16",
                      world_size=4, clock=clock)  # fmt: skip
    synced = []
    for _ in range(4):
        clock.now += 0.5
        timer.step_end(tokens=8192, samples=4)
    out = timer.flush(sync_fn=lambda: synced.append(True))
    assert synced == [True]  # the one sync, at the logging step
    assert out["step_time_s"] == 0.5
    assert out["tokens_per_second"] == 4 * 8192 / 2.0
    assert out["samples_per_second"] == 8.0
    assert out["tflops"] == pytest.approx(1e9 * 16384 / 4 / 1e12)  # per device
    assert out["mfu"] == pytest.approx(out["tflops"] / 312)
    assert (out["total_tokens"], out["train_time_s"]) == (32768, 2.0)
    # The next window starts at the flush; totals accumulate.
    clock.now += 1.0
    timer.step_end(tokens=1000, samples=1)
    out = timer.flush()
    assert (out["step_time_s"], out["tokens_per_second"]) == (1.0, 1000.0)
    assert (out["total_tokens"], out["train_time_s"]) == (33768, 3.0)
    assert timer.flush() == {}  # no step in the window


def test_step_timer_without_peak_reports_tflops_only():
    clock = Clock()
    timer = StepTimer(flops_per_token=2e9, device_name="cpu", clock=clock)
    clock.now += 2
    timer.step_end(tokens=torch.tensor(3), samples=torch.tensor(1))  # device counts, summed lazily
    out = timer.flush(world_size=2)
    assert out["tokens_per_second"] == 1.5
    assert out["tflops"] == pytest.approx(2e9 * 3 / 2 / 2 / 1e12)
    assert "mfu" not in out
    override = StepTimer(flops_per_token=1e12, device_name="cpu", peak_tflops_override=4.0, clock=clock)
    clock.now += 1
    override.step_end(1, 1)
    assert override.flush()["mfu"] == 0.25


def test_non_padding_tokens():
    batch = {
        "input_ids": torch.zeros(2, 4, dtype=torch.long),
        "attention_mask": torch.tensor([[1, 1, 0, 0], [1] * 4]),
    }
    assert int(non_padding_tokens(batch)) == 6
    assert non_padding_tokens({"input_ids": torch.zeros(2, 4)}) == 8
    assert non_padding_tokens({"pixel_values": torch.zeros(2, 3, 8, 8), "labels": torch.zeros(2)}) == 0


RANK_SCRIPT = textwrap.dedent(
    """
    import json, torch, torch.distributed as dist
    from trainer.data.collator import non_padding_tokens
    from trainer.observe.window import StepTimer
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    masks = {0: [[1, 1, 1, 1], [1, 0, 0, 0]], 1: [[1, 1, 1, 0], [1, 1, 1, 1]]}  # 5 and 7 real tokens
    ticks = iter([0.0, 2.0])
    timer = StepTimer(flops_per_token=100.0, world_size=2, clock=lambda: next(ticks))
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": torch.tensor(masks[rank])}
    timer.step_end(non_padding_tokens(batch), samples=len(batch["input_ids"]))

    def all_reduce_sum(values):
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    print(json.dumps(timer.flush(all_reduce_sum=all_reduce_sum)))
    dist.destroy_process_group()
    """
)


def test_tokens_per_second_counts_non_padding_tokens_of_all_ranks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    for out in outs:  # every rank reports the global figures
        assert out["tokens_per_second"] == (5 + 7) / 2.0
        assert out["samples_per_second"] == 4 / 2.0
        assert out["tflops"] == pytest.approx(100 * 12 / 2.0 / 2 / 1e12)
