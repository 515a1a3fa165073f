"""Resolution of a run into one concrete DeepSpeed dict, and loading third-party JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.args import RunConfig, TrainingArguments
from trainer.config import ConfigError, Hardware, generate, load_deepspeed_json, resolve
from trainer.config.resolution import resolve_json

CPU = Hardware.cpu()
A100 = Hardware.cuda("NVIDIA A100-SXM4-80GB", (8, 0))
V100 = Hardware.cuda("Tesla V100-SXM2-32GB", (7, 0))
P100 = Hardware.cuda("Tesla P100-PCIE-16GB", (6, 0))
THIRD_PARTY = Path(__file__).parent / "ds_json"


def args(**fields) -> TrainingArguments:
    return TrainingArguments(**fields)


def problems(fn, *a, **kw) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        fn(*a, **kw)
    return err.value.problems


def autos(node) -> list[str]:
    if isinstance(node, dict):
        return [k for k, v in node.items() if v == "auto"] + [x for v in node.values() for x in autos(v)]
    return []


def test_generated_from_the_training_arguments():
    """The schedule (linear, warmup 10) is transformers' own: the config names no scheduler."""
    ds = resolve(args(max_steps=100, learning_rate=3e-4, weight_decay=0.1, warmup_steps=10), 2, CPU)
    assert ds == {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 3e-4,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": 0.1,
                "torch_adam": True,
            },
        },
    }


def test_batch_keys_come_from_the_arguments_and_world_size():
    ds = resolve(args(per_device_train_batch_size=4, gradient_accumulation_steps=8, max_steps=1), 16, CPU)
    assert (
        ds["train_batch_size"],
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
    ) == (512, 4, 8)


def test_batch_keys_count_data_parallel_ranks_only_under_pipeline():
    ds = resolve(args(per_device_train_batch_size=2, pipeline_parallel_size=2, max_steps=1), 4, CPU)
    # 2 pipelines × micro 2 × accumulation 1 per rank; each pipeline's 2 stages pool their batches
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (4 * 2, 1 * 2)
    assert ds["pipeline"] == {"stages": 2}


def test_world_size_not_divisible_by_pipeline_stages():
    assert problems(resolve, args(pipeline_parallel_size=2, max_steps=1), 3, CPU) == [
        ("pipeline.stages", "world size 3 is not divisible by 2 pipeline stages")
    ]


def test_pipeline_with_zero_3_from_the_arguments():
    assert problems(resolve, args(pipeline_parallel_size=2, zero_stage=3, max_steps=1), 2, CPU) == [
        ("pipeline, zero_optimization.stage", "pipeline parallelism needs ZeRO stage 0 or 1, got stage 3")
    ]


@pytest.mark.parametrize(
    "hardware, precision",
    [
        (CPU, "fp32"),
        (A100, "bf16"),
        (V100, "fp16"),
        (Hardware.cuda("Tesla T4", (7, 5)), "fp16"),
        (P100, "fp32"),
    ],
)
def test_precision_auto_follows_the_hardware(hardware, precision):
    ds = resolve(args(max_steps=1), 1, hardware)
    enabled = [p for p in ("fp16", "bf16") if ds.get(p, {}).get("enabled")]
    assert enabled == ([] if precision == "fp32" else [precision])


def test_fp16_block_has_dynamic_loss_scaling():
    ds = resolve(args(fp16=True, max_steps=1), 1, V100)
    assert ds["fp16"] == {
        "enabled": True,
        "loss_scale": 0.0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }


def test_fp16_on_cpu_is_refused_at_resolve_time():
    assert problems(resolve, args(fp16=True, max_steps=1), 1, CPU) == [
        ("fp16.enabled", "fp16 is not supported on cpu; use bf16 or fp32")
    ]


def test_fp16_on_pascal_and_bf16_on_volta_are_refused():
    assert problems(resolve, args(precision="fp16", max_steps=1), 1, P100) == [
        (
            "fp16.enabled",
            "fp16 is not supported on Tesla P100-PCIE-16GB (compute capability 6.0); use bf16 or fp32",
        )
    ]
    assert problems(resolve, args(bf16=True, max_steps=1), 1, V100) == [
        (
            "bf16.enabled",
            "bf16 is not supported on Tesla V100-SXM2-32GB (compute capability 7.0); use fp16 or fp32",
        )
    ]


def test_fp16_in_a_json_on_cpu_is_refused_too():
    assert problems(resolve, args(deepspeed={"fp16": {"enabled": True}}, max_steps=1), 1, CPU) == [
        ("fp16.enabled", "fp16 is not supported on cpu; use bf16 or fp32")
    ]


def test_zero3_bucket_sizes_come_from_the_hidden_size():
    ds = resolve(args(zero_stage=3, max_steps=1), 2, CPU, hidden_size=1024)
    zero = ds["zero_optimization"]
    assert zero["reduce_bucket_size"] == 1024 * 1024
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 1024 * 1024)
    assert zero["stage3_param_persistence_threshold"] == 10 * 1024


def test_hidden_size_from_the_model_arguments():
    run = RunConfig.from_flat(
        {"zero_stage": 3, "max_steps": 1, "model_config_overrides": {"hidden_size": 64}}
    )
    assert resolve(run, 1, CPU)["zero_optimization"]["reduce_bucket_size"] == 4096


def test_explicit_bucket_sizes_are_kept():
    ds_json = {"zero_optimization": {"stage": 3, "prefetch_bucket_size": 123, "reduce_bucket_size": 456}}
    zero = resolve(args(deepspeed=ds_json, max_steps=1), 1, CPU, hidden_size=64)["zero_optimization"]
    assert (
        zero["prefetch_bucket_size"]
        if "prefetch_bucket_size" in zero
        else zero["stage3_prefetch_bucket_size"]
    ) == 123
    assert zero["reduce_bucket_size"] == 456
    assert zero["stage3_param_persistence_threshold"] == 640


@pytest.mark.parametrize(
    "schedule, given, expected",
    [
        (
            "constant_with_warmup",
            ["warmup_min_lr", "warmup_max_lr", "warmup_num_steps"],
            {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 20}},
        ),
        (
            "cosine",
            ["warmup_num_steps", "total_num_steps"],
            {"type": "WarmupCosineLR", "params": {"total_num_steps": 200, "warmup_num_steps": 20}},
        ),
        (
            "linear",
            ["warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"],
            {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                 "warmup_num_steps": 20, "total_num_steps": 200}},
        ),
    ],
)  # fmt: skip
def test_a_scheduler_the_file_names_is_filled_from_the_arguments(schedule, given, expected):
    """HF-style files name DeepSpeed's scheduler with "auto" values; then DeepSpeed's runs it."""
    named = {"scheduler": {"type": "auto", "params": dict.fromkeys(given, "auto")}}
    run = args(
        lr_scheduler_type=schedule, learning_rate=1e-3, warmup_ratio=0.1, max_steps=200, deepspeed=named
    )
    assert resolve(run, 1, CPU)["scheduler"] == expected
    unnamed = resolve(args(lr_scheduler_type=schedule, warmup_ratio=0.1, max_steps=200), 1, CPU)
    assert "scheduler" not in unnamed  # transformers' own, the rates HF's Trainer applies


def test_a_constant_rate_is_deepspeeds_warmup_lr():
    ds = resolve(args(lr_scheduler_type="constant", learning_rate=1e-3, max_steps=200), 1, CPU)
    assert ds["scheduler"] == {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 1e-3,
            "warmup_max_lr": 1e-3,
            "warmup_num_steps": 1,
            "warmup_type": "linear",
        },
    }


def test_no_warmup_is_transformers_schedule_and_a_constant_rate_deepspeeds():
    """Without warmup DeepSpeed's WarmupDecayLR would hold the peak for the whole run (its floor is
    the peak) and its cosine would hold it for two steps: transformers' schedules run instead."""
    for kind in ("linear", "cosine"):
        assert "scheduler" not in resolve(
            args(learning_rate=1e-3, max_steps=50, lr_scheduler_type=kind), 1, CPU
        )
    ds = resolve(args(learning_rate=1e-3, max_steps=50, lr_scheduler_type="constant"), 1, CPU)
    assert ds["scheduler"]["params"]["warmup_min_lr"] == ds["scheduler"]["params"]["warmup_max_lr"] == 1e-3


def test_total_steps_given_by_the_trainer_win_over_max_steps():
    named = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}
    ds = resolve(args(max_steps=-1, warmup_steps=5, deepspeed=named), 1, CPU, total_steps=321)
    assert ds["scheduler"]["params"]["total_num_steps"] == 321


def test_total_steps_unknown():
    named = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}
    assert problems(resolve, args(warmup_steps=5, deepspeed=named), 1, CPU) == [
        (
            "scheduler.params.total_num_steps",
            '"auto" cannot be resolved: max_steps is -1 and the run\'s number of training steps was not given; set max_steps',
        )
    ]


@pytest.mark.parametrize(
    "optim, expected",
    [
        (
            "adamw_fused",
            {
                "type": "Adam",
                "params": {"lr": 5e-05, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.0},
            },
        ),
        ("lion", {"type": "Lion", "params": {"lr": 5e-05, "betas": [0.9, 0.999], "weight_decay": 0.0}}),
        ("sgd", {"type": "SGD", "params": {"lr": 5e-05, "weight_decay": 0.0}}),
    ],
)
def test_optimizers(optim, expected):
    ds = resolve(args(optim=optim, max_steps=1, zero_stage=2), 1, CPU)
    assert ds["optimizer"] == expected
    assert ds.get("zero_allow_untested_optimizer", False) == (optim == "sgd")


def test_cpu_offload_uses_deepspeeds_cpu_adam_not_torch_adam():
    ds = resolve(args(zero_stage=2, offload_optimizer="cpu", max_steps=1), 1, CPU)
    assert "torch_adam" not in ds["optimizer"]["params"]
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


def test_client_optimizer_and_scheduler_leave_the_sections_out():
    ds = resolve(args(), 1, CPU, client_optimizer=True, client_scheduler=True)
    assert "optimizer" not in ds and "scheduler" not in ds


def test_client_optimizer_with_one_in_the_json():
    ds_json = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    assert problems(resolve, args(deepspeed=ds_json, max_steps=1), 1, CPU, client_optimizer=True) == [
        ("optimizer", "the config defines a optimizer and the caller passes its own; remove one")
    ]


def test_preset_by_name():
    ds = resolve(args(deepspeed="zero3_offload", bf16=True, max_steps=1), 2, CPU)
    assert ds["bf16"] == {"enabled": True}
    assert ds["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert ds["train_batch_size"] == 16


def test_nvme_preset_takes_nvme_path_from_the_arguments():
    ds = resolve(args(deepspeed="zero3_nvme", nvme_path="/scratch", max_steps=1), 1, CPU)
    assert ds["zero_optimization"]["offload_param"]["nvme_path"] == "/scratch"
    assert ds["aio"]["block_size"] == 1_048_576


def test_nvme_without_a_path_from_the_arguments():
    assert problems(resolve, args(offload_optimizer="nvme", zero_stage=3, max_steps=1), 1, CPU) == [
        (
            "zero_optimization.offload_optimizer.device, zero_optimization.offload_optimizer.nvme_path",
            "device nvme needs an nvme_path (a directory on a fast local NVMe)",
        )
    ]


def test_unknown_deepspeed_setting():
    assert problems(resolve, args(deepspeed="zero4"), 1, CPU) == [
        (
            "deepspeed",
            "'zero4' is neither a JSON file nor a preset (zero0, zero1, zero2, zero3, zero2_offload, zero3_offload, zero3_nvme)",
        )
    ]


def test_offload_param_without_stage_3_from_the_arguments():
    assert problems(resolve, args(offload_param="cpu", zero_stage=2, max_steps=1), 1, CPU) == [
        (
            "zero_optimization.offload_param.device, zero_optimization.stage",
            "parameter offload needs ZeRO stage 3, got stage 2",
        )
    ]


def test_gds_needs_cuda():
    ds_json = {"aio": {"use_gds": True}}
    assert problems(resolve, args(deepspeed=ds_json, max_steps=1), 1, CPU) == [
        ("aio.use_gds", "GPUDirect Storage needs a CUDA GPU; this run is on cpu")
    ]


# --- third-party JSON -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.name for p in THIRD_PARTY.glob("*.json")))
def test_third_party_configs_resolve_without_any_auto(name):
    run = args(deepspeed=str(THIRD_PARTY / name), max_steps=100, bf16=True)
    ds = resolve(run, 2, A100, hidden_size=512)
    assert autos(ds) == []
    assert ds["bf16"]["enabled"] is True
    assert ds["train_batch_size"] == 16


def test_hf_zero3_autos_take_the_runs_values():
    run = args(
        deepspeed=str(THIRD_PARTY / "hf_zero3.json"),
        max_steps=100,
        learning_rate=2e-5,
        warmup_steps=7,
        adam_beta2=0.95,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        max_grad_norm=0.5,
    )
    ds = resolve(run, 4, A100, hidden_size=256)
    assert ds["train_batch_size"] == 32
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0},
    }
    assert ds["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-5, "warmup_num_steps": 7}
    assert ds["fp16"]["enabled"] is False and ds["bf16"]["enabled"] is True
    zero = ds["zero_optimization"]
    assert (
        zero["reduce_bucket_size"],
        zero["stage3_prefetch_bucket_size"],
        zero["stage3_param_persistence_threshold"],
    ) == (65536, 58982, 2560)
    assert zero["sub_group_size"] == 1_000_000_000 and zero["stage3_max_live_parameters"] == 1_000_000_000


def test_auto_the_run_cannot_resolve_names_the_key():
    run = args(deepspeed=str(THIRD_PARTY / "llamafactory_z3.json"), max_steps=10)
    assert problems(resolve, run, 1, CPU) == [
        (
            f"zero_optimization.{key}",
            '"auto" cannot be resolved: needs the model\'s hidden size; pass hidden_size or set model_config_overrides.hidden_size',
        )
        for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    ]


def test_auto_on_a_key_the_run_does_not_determine():
    ds_json = {"aio": {"queue_depth": "auto"}, "data_types": {"keep_in_fp32_modules": "auto"}}
    assert problems(resolve, args(deepspeed=ds_json, max_steps=1), 1, CPU) == [
        ("aio.queue_depth", '"auto" cannot be resolved from the run for this key; give a value')
    ]


def test_auto_stage_takes_zero_stage():
    ds_json = {"zero_optimization": {"stage": "auto"}}
    assert resolve(args(deepspeed=ds_json, zero_stage=2, max_steps=1), 1, CPU)["zero_optimization"] == {
        "stage": 2
    }


def test_explicit_values_contradicting_the_arguments_show_both():
    ds_json = {
        "train_micro_batch_size_per_gpu": 4,
        "train_batch_size": 64,
        "gradient_clipping": 0.3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95]}},
    }
    # Arguments set in code (or as flags) are kept and checked; unset ones would take the file's values.
    given = args(
        deepspeed=ds_json, max_steps=1, per_device_train_batch_size=8, max_grad_norm=1.0, learning_rate=5e-5
    )
    assert problems(resolve, given, 2, CPU) == [
        (
            "train_micro_batch_size_per_gpu",
            '4 contradicts per_device_train_batch_size=8 in the training arguments; remove the key, set it to "auto", or make them equal',
        ),
        (
            "train_batch_size",
            "64 contradicts per_device_train_batch_size × gradient_accumulation_steps × data-parallel world size = 8 × 1 × 2 = 16; "
            'remove the key, set it to "auto", or make them equal',
        ),
        (
            "gradient_clipping",
            '0.3 contradicts max_grad_norm=1.0 in the training arguments; remove the key, set it to "auto", or make them equal',
        ),
        (
            "optimizer.params.lr",
            '0.0001 contradicts learning_rate=5e-05 in the training arguments; remove the key, set it to "auto", or make them equal',
        ),
        (
            "optimizer.params.betas",
            '[0.9, 0.95] contradicts adam_beta1, adam_beta2=[0.9, 0.999] in the training arguments; remove the key, set it to "auto", or make them equal',
        ),
    ]


def test_unset_arguments_take_what_the_file_states():
    ds_json = {"train_micro_batch_size_per_gpu": 4, "train_batch_size": 8, "gradient_clipping": 0.3}
    ds_json["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
    config = resolve(args(deepspeed=ds_json, max_steps=1), 2, CPU)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_clipping"]) == (4, 0.3)
    assert config["optimizer"]["params"]["lr"] == 1e-4


def test_explicit_values_that_agree_are_fine_even_as_strings():
    ds_json = {
        "train_micro_batch_size_per_gpu": "8",
        "optimizer": {"type": "adamw", "params": {"lr": "5e-5"}},
    }
    ds = resolve(args(deepspeed=ds_json, max_steps=1), 1, CPU)
    assert ds["train_micro_batch_size_per_gpu"] == 8
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["lr"] == 5e-5


def test_precision_contradiction():
    ds_json = {"fp16": {"enabled": True}}
    assert problems(resolve, args(deepspeed=ds_json, bf16=True, max_steps=1), 1, A100) == [
        (
            "fp16.enabled",
            'true contradicts precision=bf16 in the training arguments; remove the key, set it to "auto", or make them equal',
        )
    ]


def test_explicit_zero_stage_argument_contradicting_the_json():
    ds_json = {"zero_optimization": {"stage": 3}}
    assert problems(resolve, args(deepspeed=ds_json, zero_stage=2, max_steps=1), 1, CPU) == [
        (
            "zero_optimization.stage",
            '3 contradicts zero_stage=2 in the training arguments; remove the key, set it to "auto", or make them equal',
        )
    ]
    # an argument left at its default does not override the file
    assert resolve(args(deepspeed=ds_json, max_steps=1), 1, CPU)["zero_optimization"]["stage"] == 3


def test_warmup_and_total_steps_in_a_json_scheduler():
    ds_json = {
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 100, "total_num_steps": "auto"}}
    }
    assert problems(resolve, args(deepspeed=ds_json, max_steps=1000, warmup_steps=10), 1, CPU) == [
        (
            "scheduler.params.warmup_num_steps",
            '100 contradicts warmup_steps=10 / warmup_ratio=0.0 in the training arguments; remove the key, set it to "auto", or make them equal',
        )
    ]


def test_caller_dict_is_not_modified():
    ds_json = {"train_micro_batch_size_per_gpu": "auto"}
    resolve(args(deepspeed=ds_json, max_steps=1), 1, CPU)
    assert ds_json == {"train_micro_batch_size_per_gpu": "auto"}


def test_json_file_errors(tmp_path):
    missing = tmp_path / "nope.json"
    assert problems(load_deepspeed_json, missing) == [
        ("deepspeed", f"DeepSpeed config file not found: {missing}")
    ]
    bad = tmp_path / "bad.json"
    bad.write_text('{"fp16": {"enabled": true,}}')
    [(path, msg)] = problems(load_deepspeed_json, bad)
    assert path == str(bad) and msg.startswith("invalid JSON: ")
    dup = tmp_path / "dup.json"
    dup.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    assert problems(load_deepspeed_json, dup) == [(str(dup), "duplicate key train_batch_size")]


def test_resolve_json_without_a_run_does_not_compare_or_add_sections():
    data = json.loads((THIRD_PARTY / "axolotl_zero1.json").read_text())
    data["train_micro_batch_size_per_gpu"] = 3
    ds = resolve_json(data, TrainingArguments(), world_size=2, compare=False)
    assert ds["train_batch_size"] == 6
    assert "optimizer" not in ds and "scheduler" not in ds


def test_generate_matches_the_cli_example():
    ds = generate(
        zero_stage=3, precision="bf16", offload_optimizer="cpu", micro_batch=4, grad_accum=8, world_size=16
    )
    assert ds == {
        "train_batch_size": 512,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 8,
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "contiguous_gradients": True,
            "overlap_comm": True,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "bf16": {"enabled": True},
    }


def test_generate_checks_the_rules():
    assert problems(generate, zero_stage=1, precision="fp32", offload_param="cpu", micro_batch=1) == [
        (
            "zero_optimization.offload_param.device, zero_optimization.stage",
            "parameter offload needs ZeRO stage 3, got stage 1",
        )
    ]


def test_skip_policy_is_refused_where_deepspeed_applies_non_finite_steps():
    with pytest.raises(ConfigError) as err:
        resolve(args(nonfinite_policy="skip", zero_stage=0), 2, CPU)
    assert err.value.problems[0][0] == "nonfinite_policy" and "ZeRO-0 in fp32" in err.value.problems[0][1]
    config = {"bf16": {"enabled": True, "check_grad_overflow": False}, "zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError) as err:
        resolve(args(nonfinite_policy="skip", deepspeed=config), 2, A100)
    assert "bf16.check_grad_overflow" in [p[0] for p in err.value.problems]
    # Where the optimizer drops such steps, and under the other policies, nothing is refused.
    for ok in (
        args(nonfinite_policy="skip", zero_stage=2, max_steps=10),
        args(nonfinite_policy="skip", zero_stage=0, precision="fp16", max_steps=10),
        args(nonfinite_policy="stop", zero_stage=0, max_steps=10),
    ):
        resolve(ok, 2, A100 if ok.precision == "fp16" else CPU)


def test_short_warmups_are_transformers_schedule_unless_the_file_names_one():
    """DeepSpeed's warmup schedulers warm up over at least two steps, and WarmupDecayLR without a
    warmup never decays; HF's one-step warmup (0, then the peak) and no warmup (the peak, then
    down) are transformers' scheduler, so the resolved config has none."""
    from trainer.loop.steps import client_scheduler

    expected = {1: [0.0, 1e-2, 1e-2 * 8 / 9], 0: [1e-2, 1e-2 * 9 / 10, 1e-2 * 8 / 10]}
    for warmup, fields in ((1, {"warmup_steps": 1}), (1, {"warmup_ratio": 0.1}), (0, {})):
        run = args(max_steps=10, learning_rate=1e-2, **fields)
        ds = resolve(run, 1, CPU)
        assert "scheduler" not in ds
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-2)
        schedule = client_scheduler(run, 10, ds)(optimizer)
        rates = []
        for _ in range(3):
            rates.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            schedule.step()
        assert rates == pytest.approx(expected[warmup])
    given = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto"}}}
    ds = resolve(args(max_steps=10, warmup_steps=1, deepspeed=given), 1, CPU)
    assert ds["scheduler"]["params"]["warmup_num_steps"] == 1 and client_scheduler(args(), 10, ds) is None
