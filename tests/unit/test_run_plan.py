"""The run plan: the mesh (the one place every parallel size lives), the sizes it takes from the
arguments and the DeepSpeed file alike, and a plan that keeps a resumed
checkpoint's global batch without touching the user's arguments."""

from __future__ import annotations

import pytest

from tests.unit.test_checkpoint import ONE, make_checkpoint, saved_with
from trainer.args import TrainingArguments
from trainer.config import ConfigError, Hardware, parallel_sizes
from trainer.loop.plan import plan_run
from trainer.runtime.distributed import DistInfo
from trainer.runtime.mesh import Mesh, mesh_for, saved_mesh


def test_the_mesh_derives_the_data_parallel_size_and_this_ranks_coordinates():
    mesh = Mesh(world_size=8, rank=5, pipeline=2, sequence=2)
    assert mesh.data_parallel_size == 2
    assert mesh.data_ranks == (4, 2)  # a sequence group shares rows; a pipeline's stages do not
    assert mesh.sequence_rank == 1
    assert mesh.zero_shards == 4  # ZeRO shards over a sequence group's ranks too
    assert Mesh(world_size=3).data_parallel_size == 3


def test_the_mesh_records_its_groups_and_round_trips_through_a_manifest():
    mesh = Mesh(world_size=8, rank=1, tensor=2, expert=2)
    grouped = mesh.with_groups(tensor="its group")
    assert grouped == mesh and grouped.groups == {"tensor": "its group"} and mesh.groups == {}
    with pytest.raises(ValueError, match="no mesh dimension named model"):
        mesh.with_groups(model="a group")
    saved = saved_mesh(mesh.manifest_sizes())
    assert (saved.world_size, saved.data_parallel_size, saved.zero_shards, saved.tensor) == (8, 4, 4, 2)
    older = saved_mesh({"world_size": 4})  # a manifest from before the data-parallel size was kept
    assert (older.data_parallel_size, older.zero_shards, older.tensor, older.pipeline) == (4, 4, 1, 1)


def test_experts_split_the_data_parallel_ranks():
    assert Mesh(world_size=8, tensor=2, expert=4).data_parallel_size == 4
    with pytest.raises(
        ConfigError, match="expert_parallel_size: 3 does not divide the 4 data-parallel ranks"
    ):
        Mesh(world_size=8, tensor=2, expert=3)


@pytest.mark.parametrize(
    ("sizes", "key"), [({"sequence": 4}, "sequence_parallel_size"), ({"pipeline": 4}, "pipeline")]
)
def test_the_mesh_refuses_sizes_that_do_not_divide_the_world(sizes, key):
    with pytest.raises(ConfigError, match="world size 6 is not divisible") as err:
        Mesh(world_size=6, **sizes)
    assert key in str(err.value)


def test_the_mesh_refuses_a_rank_outside_the_world():
    with pytest.raises(ConfigError, match="rank"):
        Mesh(world_size=2, rank=2)


def test_sizes_come_from_an_explicit_argument_else_the_deepspeed_file():
    stated = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2, "pipeline": {"stages": 2}}
    assert parallel_sizes(TrainingArguments(output_dir="o", deepspeed=stated)) == (2, 2, 1, 1)
    assert parallel_sizes(TrainingArguments(output_dir="o")) == (1, 1, 1, 1)
    assert parallel_sizes(TrainingArguments(output_dir="o", sequence_parallel_size=4)) == (1, 4, 1, 1)
    experts = {"train_micro_batch_size_per_gpu": 1, "expert_parallel": {"enabled": True, "autoep_size": 2}}
    assert parallel_sizes(TrainingArguments(output_dir="o", deepspeed=experts)) == (1, 1, 1, 2)
    disabled = {**experts, "expert_parallel": {"enabled": False, "autoep_size": 2}}
    assert parallel_sizes(TrainingArguments(output_dir="o", deepspeed=disabled)) == (1, 1, 1, 1)
    assert parallel_sizes(TrainingArguments(output_dir="o", expert_parallel_size=4)) == (1, 1, 1, 4)
    mesh = mesh_for(TrainingArguments(output_dir="o", deepspeed=stated), 8, 3)
    assert (mesh.data_parallel_size, mesh.pipeline, mesh.sequence, mesh.rank) == (2, 2, 2, 3)


def test_a_plan_keeps_the_checkpoints_global_batch_without_changing_the_arguments(tmp_path):
    make_checkpoint(tmp_path, 5, world=2, batch=12)  # 2 ranks × micro-batch 2 × accumulation 3
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=3,
        max_steps=10, resume_from_checkpoint="auto",
    )  # fmt: skip
    plan = plan_run(args, Hardware.cpu(), ONE, num_samples=100)
    assert args.gradient_accumulation_steps == 3  # the user's arguments stay as they were
    assert plan.args.gradient_accumulation_steps == 6  # 1 rank × 2 × 6 = the checkpoint's 12
    assert plan.checkpoint == tmp_path / "checkpoint-5"
    assert plan.ds_config["gradient_accumulation_steps"] == 6
    assert plan.ds_config["train_batch_size"] == 12
    assert plan.steps.steps_per_epoch == 9 and plan.total_steps == 10  # ceil(100 / 2 / 6)


def test_a_plan_without_a_checkpoint_runs_the_arguments_as_they_are(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, num_train_epochs=2)
    plan = plan_run(args, Hardware.cpu(), DistInfo(0, 0, 1), num_samples=10)
    assert plan.args is args and plan.checkpoint is None
    assert (plan.steps.steps_per_epoch, plan.total_steps) == (5, 10)
    assert plan.mesh == Mesh(world_size=1)


@pytest.fixture
def zero3_args(tmp_path):
    """Hand-built ZeRO-3 arguments, which register their config with transformers when created."""
    from transformers.integrations.deepspeed import deepspeed_config, unset_hf_deepspeed_config

    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=4, zero_stage=3
    )
    assert deepspeed_config() is args._hf_deepspeed.config  # the dict zero.Init gets for a model built now
    yield args
    unset_hf_deepspeed_config()


def test_a_zero3_plan_fills_the_dict_its_arguments_registered_for_zero_init(zero3_args):
    registered = zero3_args._hf_deepspeed.config
    zero_before = dict(registered["zero_optimization"])
    plan = plan_run(zero3_args, Hardware.cpu(), ONE, num_samples=16, hidden_size=32)
    assert plan.ds_config is registered  # zero.Init's config and the engine's: one object
    zero = plan.ds_config["zero_optimization"]
    assert {k: v for k, v in zero.items() if k in zero_before} == zero_before
    assert zero["stage3_param_persistence_threshold"] == 320  # the hidden-size sizes, filled now
    assert plan.ds_config["train_batch_size"] == 2


@pytest.mark.parametrize(
    ("section", "value", "key"),
    [
        ("zero_optimization", {"stage": 3, "overlap_comm": False}, "zero_optimization.overlap_comm"),
        ("bf16", {"enabled": True}, "bf16.enabled"),
    ],
)
def test_a_zero3_plan_refuses_to_change_what_zero_init_partitioned_with(zero3_args, section, value, key):
    zero3_args._hf_deepspeed.config[section] = value  # as if zero.Init had partitioned with this
    with pytest.raises(ConfigError, match="the model was partitioned") as err:
        plan_run(zero3_args, Hardware.cpu(), ONE, num_samples=16, hidden_size=32)
    assert key in str(err.value)


def test_a_plan_refuses_a_checkpoint_this_run_cannot_carry(tmp_path):
    """``Trainer.train(resume_from_checkpoint=...)`` plans before the engine loads anything: a
    checkpoint of another ZeRO stage it cannot load is one line naming the setting, as at the CLI's door."""
    saved_with(make_checkpoint(tmp_path, 5, world=1, batch=8), zero_stage=3, objective="causal_lm")
    args = TrainingArguments(
        output_dir=str(tmp_path), zero_stage=1, per_device_train_batch_size=8, max_steps=10
    )
    with pytest.raises(
        ConfigError, match="zero_stage: .* was saved with zero_stage 3 and this run asks for 1"
    ):
        plan_run(args, Hardware.cpu(), ONE, num_samples=100, resume="auto")
    assert plan_run(args, Hardware.cpu(), ONE, num_samples=100, resume=False).checkpoint is None
