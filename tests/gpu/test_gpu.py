"""GPU-only paths (``pytest -m gpu``; scripts/gpu_check.sh runs them): one process, one GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def train(tmp_path, name: str, **overrides):
    from tests.helpers.trainer_scenarios import learnable_dataset, run_trainer

    return run_trainer(tmp_path, name, learnable_dataset(64), max_steps=12, learning_rate=3e-3, **overrides)


def test_fp16_with_dynamic_loss_scaling(tmp_path):
    trainer, losses = train(tmp_path, "fp16", fp16=True, zero_stage=2)
    assert trainer.ds_config["fp16"]["enabled"] is True
    assert trainer.engine.loss_scale() is not None
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert all("loss_scale" in r and "skipped_steps" in r for r in rows)
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16(tmp_path, stage):
    trainer, losses = train(tmp_path, f"bf16_{stage}", bf16=True, zero_stage=stage)
    assert next(trainer.engine.module.parameters()).dtype == torch.bfloat16
    assert losses[-1] < 0.8 * losses[0]


def test_zero3_with_cpu_offload_of_optimizer_and_params(tmp_path):
    trainer, losses = train(
        tmp_path, "z3_offload", bf16=True, zero_stage=3, offload_optimizer="cpu", offload_param="cpu"
    )
    assert type(trainer.engine.ds.optimizer.optimizer).__name__ == "DeepSpeedCPUAdam"
    assert losses[-1] < 0.8 * losses[0]


def test_nvme_offload_where_libaio_exists(tmp_path):
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("libaio is not installed")
    trainer, losses = train(
        tmp_path,
        "nvme",
        bf16=True,
        zero_stage=3,
        offload_optimizer="nvme",
        offload_param="nvme",
        nvme_path=str(tmp_path / "nvme"),
    )
    assert losses[-1] < 0.8 * losses[0]


def test_fused_adam(tmp_path):
    trainer, losses = train(tmp_path, "fused", bf16=True, zero_stage=2, optim="adamw_fused")
    assert "torch_adam" not in trainer.ds_config["optimizer"]["params"]
    assert losses[-1] < 0.8 * losses[0]


def test_qlora_through_the_public_command(tmp_path):
    """A 4-bit NF4 base with LoRA adapters (bitsandbytes), ZeRO-2 then ZeRO-3, bf16, one GPU."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    from tests.helpers.launch import launch, run_env
    from tests.helpers.lora_base import make_base
    from tests.helpers.scaffold import load_weights, tiny_flags

    base = make_base(tmp_path)
    for stage in ("2", "3"):
        out = tmp_path / f"qlora{stage}"
        proc = launch(["scripts/train.py", "--output_dir", str(out), "--model_name_or_path", str(base["base"]),
                       "--dataset", str(base["corpus"]), "--use_peft", "--load_in_4bit", "--bf16",
                       "--zero_stage", stage,
                       *tiny_flags(max_train_samples=None, max_eval_samples=None, model_config_overrides=None,
                                   learning_rate="1e-2")],
                      launcher="python", env=run_env(DS_ACCELERATOR="cuda"))  # fmt: skip
        assert "Parameters: " in proc.stdout + proc.stderr
        adapter = load_weights(out / "final" / "adapter_model.safetensors")
        assert adapter and all(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k)


def test_tiled_loss_mlp_and_offload_on_a_long_block(tmp_path):
    """8192-token blocks, bf16, ZeRO-3, one GPU: the tiled loss, tiled MLPs and activations offloaded to
    pinned host memory follow the untiled run's losses, with a lower peak of GPU memory."""
    from tests.helpers.launch import launch, run_env
    from tests.helpers.scaffold import read_metrics, tiny_flags

    common = ["scripts/train.py",
              *tiny_flags(max_steps=3, save_steps=3, eval_steps=3, max_train_samples=8, max_eval_samples=2,
                          block_size=8192, vocab_size=8192, bf16=True, zero_stage=3, gradient_checkpointing=True,
                          model_config_overrides={"hidden_size": 512, "intermediate_size": 2048,
                                                  "num_hidden_layers": 4})]  # fmt: skip
    runs = {}
    for name, extra in (("plain", ["--tiled_loss", "false"]),
                        ("tiled", ["--tiled_loss", "true", "--tile_tokens", "1024", "--tiled_mlp",
                                   "--offload_activations"])):  # fmt: skip
        out = tmp_path / name
        launch(
            [*common, "--output_dir", str(out), *extra], launcher="python", env=run_env(DS_ACCELERATOR="cuda")
        )
        runs[name] = read_metrics(out)
    losses = {name: [r["loss"] for r in rows if "loss" in r] for name, rows in runs.items()}
    assert losses["tiled"] == pytest.approx(losses["plain"], rel=2e-2)  # bf16
    peak = {name: max(r.get("peak_memory_allocated_bytes", 0) for r in rows) for name, rows in runs.items()}
    assert peak["tiled"] < peak["plain"], peak


@pytest.mark.parametrize(
    "setup",
    [dict(zero_stage=2), dict(zero_stage=0), dict(zero_stage=2, offload_optimizer="cpu")],
    ids=["zero2", "zero0", "zero2_offload"],
)
def test_muon_under_bf16_steps_with_a_bf16_iteration(tmp_path, setup):
    """Muon on a GPU in bf16: the iteration in bf16 (torch's; the engine's choice for a bf16 run),
    on ZeRO-2's fp32 master slices (each step's matrices through the optimizer's gather), behind
    ZeRO-0's unfused wrapper, and on ZeRO-Offload's host slices (the iteration on the GPU)."""
    from trainer.engine.muon import Muon

    trainer, losses = train(tmp_path, "muon", bf16=True, optim="muon", optim_args="muon_lr=0.02", **setup)
    opt = trainer.engine.ds.basic_optimizer
    assert isinstance(opt, Muon) and opt.ns_precision == "bf16"
    assert bool(opt.layouts) == (setup["zero_stage"] > 0)
    assert losses[-1] < 0.8 * losses[0]


def test_ours_equals_torch_muon_on_cuda():
    """On CUDA with the iteration in bf16, five steps equal torch.optim.Muon and AdamW bit for bit."""
    from tests.unit.test_muon import _model, _train
    from trainer.engine.muon import Muon, muon_groups

    ours, theirs = _model().cuda(), _model().cuda()
    opt = Muon(muon_groups(ours, 0.1, 0.02, 0.003), ns_precision=None, betas=(0.9, 0.95))
    matrices, *rest = muon_groups(theirs, 0.1, 0.02, 0.003)
    reference = [
        torch.optim.Muon(matrices["params"], lr=0.02, weight_decay=0.1),
        torch.optim.AdamW([dict(params=g["params"], weight_decay=g["weight_decay"]) for g in rest],
                          lr=0.003, betas=(0.9, 0.95), foreach=False),
    ]  # fmt: skip
    _train(ours, [opt], 5)
    _train(theirs, reference, 5)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b), name
