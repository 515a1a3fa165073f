"""Cross-field rules: each is checked by the schema, and each message names the conflicting keys."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, validate

BASE = {"train_micro_batch_size_per_gpu": 2}


def problems(data: dict, world_size: int | None = None) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        validate(data, world_size)
    return err.value.problems


def zero(stage: int, **extra) -> dict:
    return {**BASE, "zero_optimization": {"stage": stage, **extra}}


def test_fp16_and_bf16_both_enabled():
    data = {**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}}
    assert problems(data) == [("fp16.enabled, bf16.enabled", "both enabled; choose one precision")]


def test_one_precision_enabled_and_the_other_disabled_is_fine():
    assert validate({**BASE, "fp16": {"enabled": False}, "bf16": {"enabled": True}}).precision == "bf16"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_param_needs_stage_3(stage):
    assert problems(zero(stage, offload_param={"device": "cpu"})) == [
        (
            "zero_optimization.offload_param.device, zero_optimization.stage",
            f"parameter offload needs ZeRO stage 3, got stage {stage}",
        )
    ]


def test_offload_param_device_none_is_no_offload():
    validate(zero(1, offload_param={"device": "none"}))


def test_offload_optimizer_with_stage_0():
    assert problems(zero(0, offload_optimizer={"device": "cpu"})) == [
        (
            "zero_optimization.offload_optimizer.device, zero_optimization.stage",
            "optimizer offload needs ZeRO stage 1, 2 or 3, got stage 0",
        )
    ]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_optimizer_with_stages_1_to_3(stage):
    assert validate(zero(stage, offload_optimizer={"device": "cpu"})).zero_stage == stage


@pytest.mark.parametrize("block", ["offload_optimizer", "offload_param"])
def test_nvme_without_nvme_path(block):
    assert problems(zero(3, **{block: {"device": "nvme"}})) == [
        (
            f"zero_optimization.{block}.device, zero_optimization.{block}.nvme_path",
            "device nvme needs an nvme_path (a directory on a fast local NVMe)",
        )
    ]


def test_nvme_with_nvme_path():
    validate(zero(3, offload_optimizer={"device": "nvme", "nvme_path": "/nvme"}))


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_ratio_below_1_needs_stage_3(stage):
    assert problems(zero(stage, offload_optimizer={"device": "cpu", "ratio": 0.3})) == [
        (
            "zero_optimization.offload_optimizer.ratio, zero_optimization.stage",
            f"a ratio below 1 (partial optimizer offload) needs ZeRO stage 3, got stage {stage}",
        )
    ]


def test_offload_ratio_below_1_with_stage_3():
    validate(zero(3, offload_optimizer={"device": "cpu", "ratio": 0.3}))


def test_several_zero_rules_are_reported_together():
    data = zero(1, offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu", "ratio": 0.5})
    assert [path for path, _ in problems(data)] == [
        "zero_optimization.offload_param.device, zero_optimization.stage",
        "zero_optimization.offload_optimizer.ratio, zero_optimization.stage",
    ]


# --- batch arithmetic --------------------------------------------------------------------------


def test_batch_integer_division_trap():
    data = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
    assert problems(data, world_size=3) == [
        (
            "train_batch_size, train_micro_batch_size_per_gpu",
            "8 = 2 × g × 3 has no integer solution for gradient_accumulation_steps g at data-parallel world size 3",
        )
    ]


def test_batch_two_keys_that_divide():
    validate({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2}, world_size=3)


def test_batch_all_three_must_multiply_out():
    data = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}
    assert problems(data, world_size=2) == [
        (
            "train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps",
            "32 != 2 × 4 × 2; train_batch_size must equal micro batch × accumulation steps × data-parallel "
            "world size = 16 at data-parallel world size 2",
        )
    ]
    validate(data, world_size=4)


def test_batch_train_batch_and_accumulation():
    data = {"train_batch_size": 10, "gradient_accumulation_steps": 2}
    assert problems(data, world_size=2) == [
        (
            "train_batch_size, gradient_accumulation_steps",
            "10 = m × 2 × 2 has no integer solution for train_micro_batch_size_per_gpu m at data-parallel world size 2",
        )
    ]


def test_batch_train_batch_alone():
    assert problems({"train_batch_size": 7}, world_size=2) == [
        (
            "train_batch_size",
            "7 = m × 1 × 2 has no integer solution for train_micro_batch_size_per_gpu m at data-parallel world size 2",
        )
    ]


def test_batch_needs_train_batch_or_micro_batch():
    assert problems({"gradient_accumulation_steps": 2}, world_size=1) == [
        (
            "train_batch_size, train_micro_batch_size_per_gpu",
            "give at least one; DeepSpeed needs it to size batches",
        )
    ]


def test_batch_is_per_data_parallel_rank_under_pipeline():
    data = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "pipeline": {"stages": 2}}
    validate(data, world_size=4)  # 2 stages x 2 data-parallel ranks: 8 = 2 x 2 x 2
    assert problems(data, world_size=6) == [
        (
            "train_batch_size, train_micro_batch_size_per_gpu",
            "8 = 2 × g × 3 has no integer solution for gradient_accumulation_steps g at data-parallel world size 3",
        )
    ]
    assert problems(data, world_size=3) == [
        ("pipeline.stages", "world size 3 is not divisible by 2 pipeline stages")
    ]


def test_batch_counts_a_sequence_parallel_group_once():
    data = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "sequence_parallel_size": 2}  # fmt: skip
    validate(data, world_size=4)  # 2 groups of 2 ranks read 2 sets of rows: 4 = 2 x 1 x 2
    [(keys, message)] = problems(data, world_size=2)
    assert message.startswith("4 != 2 × 1 × 1;") and message.endswith("at data-parallel world size 1")
    assert problems(data, world_size=3) == [("sequence_parallel_size", "world size 3 is not divisible by 2")]


def test_zero3_sequence_parallelism_keeps_reduce_scatter():
    data = {**zero(3, reduce_scatter=False), "sequence_parallel_size": 2}
    assert problems(data) == [
        (
            "zero_optimization.reduce_scatter, sequence_parallel_size",
            "ZeRO-3 with sequence parallelism averages gradients by reduce-scatter; leave reduce_scatter true",
        )
    ]
    validate({**zero(3), "sequence_parallel_size": 2})
    validate({**zero(2, reduce_scatter=False), "sequence_parallel_size": 2})


def test_batch_problem_is_reported_alongside_other_errors():
    data = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "fp16": {"enabeld": True}}
    assert [path for path, _ in problems(data, world_size=3)] == [
        "fp16.enabeld",
        "train_batch_size, train_micro_batch_size_per_gpu",
    ]


# --- other rules ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [2, 3])
def test_pipeline_with_zero_2_or_3(stage):
    assert problems({**zero(stage), "pipeline": {"stages": 2}}) == [
        (
            "pipeline, zero_optimization.stage",
            f"pipeline parallelism needs ZeRO stage 0 or 1, got stage {stage}",
        )
    ]


@pytest.mark.parametrize("stage", [0, 1])
def test_pipeline_with_zero_0_or_1(stage):
    validate({**zero(stage), "pipeline": {"stages": 2}})


def test_untested_optimizer_under_zero():
    data = {**zero(2), "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    assert problems(data) == [
        (
            "optimizer.type, zero_allow_untested_optimizer",
            "ZeRO refuses SGD unless zero_allow_untested_optimizer is true (tested: Adam, AdamW, Adagrad, Lion, Muon)",
        )
    ]
    validate({**data, "zero_allow_untested_optimizer": True})
    validate({**zero(0), "optimizer": {"type": "SGD"}})


def test_adam_w_mode_false_with_adamw_is_ignored_by_deepspeed():
    data = {**BASE, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}
    assert problems(data) == [
        (
            "optimizer.params.adam_w_mode, optimizer.type",
            "adam_w_mode=false has no effect with type AdamW (DeepSpeed always decouples weight decay for it); "
            "use type Adam for L2-regularised Adam",
        )
    ]
    validate({**BASE, "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})


def test_bf16_master_weights_need_zero():
    assert problems({**zero(0), "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}) == [
        (
            "bf16.bf16_master_weights_and_grads, zero_optimization.stage",
            "bf16 master weights need ZeRO stage 1, 2 or 3, got stage 0",
        )
    ]


def test_bf16_optimizer_states_need_master_weights():
    assert problems({**zero(2), "bf16": {"enabled": True, "bf16_optimizer_states": True}}) == [
        (
            "bf16.bf16_optimizer_states, bf16.bf16_master_weights_and_grads",
            "bf16 optimizer states need bf16_master_weights_and_grads: true",
        )
    ]


def test_schedule_shorter_than_its_warmup():
    data = {**BASE, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 500}}}
    assert problems(data) == [
        (
            "scheduler.params.total_num_steps, scheduler.params.warmup_num_steps",
            "total_num_steps 500 is less than warmup_num_steps 1000",
        )
    ]


def test_schedule_missing_its_total():
    assert problems({**BASE, "scheduler": {"type": "WarmupDecayLR"}}) == [
        ("scheduler.params.total_num_steps", "required")
    ]


def test_nesterov_needs_momentum():
    data = {**BASE, "optimizer": {"type": "SGD", "params": {"nesterov": True}}}
    assert problems(data) == [
        (
            "optimizer.params.nesterov, optimizer.params.momentum, optimizer.params.dampening",
            "Nesterov momentum needs momentum > 0 and dampening 0",
        )
    ]


def test_one_cycle_bounds_in_order():
    data = {**BASE, "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 0.01}}}
    assert problems(data) == [
        (
            "scheduler.params.cycle_min_lr, scheduler.params.cycle_max_lr",
            "cycle_min_lr 0.1 is above cycle_max_lr 0.01",
        )
    ]


def test_betas_in_range():
    data = {**BASE, "optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}}
    assert problems(data) == [("optimizer.params.betas", "each beta must be in [0, 1); got [0.9, 1.5]")]


def test_pipeline_timing_needs_steps_per_print():
    data = {**BASE, "pipeline": {"stages": 2}, "wall_clock_breakdown": True}
    assert problems(data) == [
        (
            "pipeline, wall_clock_breakdown, steps_per_print",
            "the pipeline engine's timing needs steps_per_print; set it (e.g. 10)",
        )
    ]
    validate({**data, "steps_per_print": 10})


def test_lamb_needs_dynamic_loss_scaling():
    data = {**BASE, "optimizer": {"type": "Lamb"}, "fp16": {"enabled": True, "loss_scale": 128}}
    assert problems(data) == [
        ("optimizer.type, fp16.loss_scale", "DeepSpeed's Lamb needs dynamic loss scaling (fp16.loss_scale 0)")
    ]
