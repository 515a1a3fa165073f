"""Tensor parallelism before anything loads: the mesh a TP group reads rows in, the sizes and the
DeepSpeed dict a run resolves, and the refusals that name their keys."""

from __future__ import annotations

import pytest
from transformers import GPT2Config, LlamaConfig

from trainer.args import RunConfig, TrainingArguments
from trainer.config import ConfigError, Hardware, parallel_sizes, resolve, validate
from trainer.engine.tensor_parallel import check_tensor_layout
from trainer.runtime.mesh import Mesh

CPU = Hardware.cpu()


def test_a_tensor_parallel_group_reads_one_set_of_rows_and_counts_them_once():
    first, second = Mesh(world_size=4, rank=2, tensor=2), Mesh(world_size=4, rank=3, tensor=2)
    assert (first.data_parallel_size, first.readers, first.data_ranks) == (2, 2, (2, 1))
    assert second.data_ranks == first.data_ranks  # consecutive ranks: AutoTP's (data, tensor) mesh
    assert (first.counts_rows, second.counts_rows) == (True, False)
    assert Mesh(world_size=4, rank=1, sequence=2).counts_rows  # an SP rank counts its own slice
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        Mesh(world_size=6, tensor=4)


def test_the_size_comes_from_the_argument_else_the_deepspeed_file():
    stated = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2}}
    assert parallel_sizes(TrainingArguments(output_dir="o", deepspeed=stated)) == (1, 1, 2, 1)
    assert parallel_sizes(TrainingArguments(output_dir="o", tensor_parallel_size=4)) == (1, 1, 4, 1)


def test_a_run_resolves_autotp_with_whole_logits_and_a_data_parallel_batch():
    args = TrainingArguments(
        output_dir="o", tensor_parallel_size=2, per_device_train_batch_size=3, gradient_accumulation_steps=2
    )
    ds = resolve(args, world_size=4, hardware=CPU, data_parallel=2)
    assert ds["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": False}
    assert ds["train_batch_size"] == 3 * 2 * 2  # the two TP groups, not the four ranks


def test_an_argument_that_contradicts_the_file_is_named():
    file = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 4}}
    with pytest.raises(
        ConfigError, match="tensor_parallel.autotp_size: 4 contradicts tensor_parallel_size=2"
    ):
        resolve(TrainingArguments(output_dir="o", deepspeed=file, tensor_parallel_size=2), 4, CPU)


@pytest.mark.parametrize(
    ("extra", "keys"),
    [
        ({"sequence_parallel_size": 2}, "tensor_parallel.autotp_size, sequence_parallel_size"),
        ({"pipeline": {"stages": 2}}, "tensor_parallel.autotp_size, pipeline.stages"),
        ({"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True}}, "vocab_parallel_lm_head"),
        ({"tensor_parallel": {"autotp_size": 2, "tp_sise": 2}}, "tensor_parallel.tp_sise"),
    ],
)
def test_the_schema_refuses_what_autotp_does_not_run_with(extra, keys):
    config = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2}, **extra}
    with pytest.raises(ConfigError) as err:
        validate(config)
    assert keys in str(err.value)


def test_a_world_the_group_does_not_divide_is_refused_by_the_batch_check():
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    with pytest.raises(ConfigError, match="tensor_parallel.autotp_size: world size 3 is not divisible by 2"):
        validate({**config, "tensor_parallel": {"autotp_size": 2}}, world_size=3)


def llama(**sizes) -> LlamaConfig:
    base = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    return LlamaConfig(**{**base, **sizes})


def test_the_models_sizes_must_split_evenly():
    check_tensor_layout(llama(), 2)
    with pytest.raises(ConfigError) as err:
        check_tensor_layout(llama(num_attention_heads=6, hidden_size=132, intermediate_size=102), 8)
    text = str(err.value)
    assert (
        "tensor_parallel_size, num_attention_heads: 8 does not divide the model's num_attention_heads 6"
        in text
    )
    assert "intermediate_size 102" in text and "hidden_size 132" in text and "num_key_value_heads 2" in text
    with pytest.raises(ConfigError) as err:  # fewer key/value heads than ranks: each needs a whole one
        check_tensor_layout(llama(), 4)
    assert str(err.value).count("does not divide") == 1 and "num_key_value_heads 2" in str(err.value)


def test_a_model_autotp_has_no_plan_for_is_refused_unless_the_config_gives_one():
    with pytest.raises(ConfigError, match="model_type gpt2: AutoTP has no sharding plan"):
        check_tensor_layout(GPT2Config(n_embd=64, n_head=4), 2)
    check_tensor_layout(GPT2Config(n_embd=64, n_head=4), 2, custom_plan=True)


def test_lora_with_tensor_parallelism_is_refused_naming_both():
    flat = {"use_peft": True, "model_name_or_path": "base", "tensor_parallel_size": 2}
    with pytest.raises(ConfigError, match="use_peft, tensor_parallel_size: LoRA runs with ZeRO 0-3"):
        RunConfig.from_flat(flat)
