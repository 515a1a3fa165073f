"""The pipeline's layer list, export assembly, config and loss, in one process (no launcher).

Chaining the layer specs in order must reproduce the HF model's logits exactly; that is what
makes the split across stages a pure re-arrangement of the same computation.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from trainer.args import TrainingArguments
from trainer.config import Hardware, resolve
from trainer.engine import CausalLM, PipelineEngine, causal_lm_loss_sum
from trainer.engine.pipeline_engine import WindowLoss
from trainer.engine.pipeline_layers import assemble_hf_state_dict, pipeline_layers, stage_state_dict
from trainer.runtime.mesh import Mesh

VOCAB = 96
PACKED = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2]])


def llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=tied)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=32, bos_token_id=1, eos_token_id=1
    )
    return GPT2LMHeadModel(config).eval()


def run_layers(specs: list[LayerSpec], input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """What the stages compute one after another, with one copy of each tied module."""
    x, tied = (input_ids, position_ids), {}
    for spec in specs:
        if isinstance(spec, TiedLayerSpec):
            module = tied.setdefault(spec.key, spec.build())
            x = spec.forward_fn(module, x) if spec.forward_fn else module(x)
        else:
            x = spec.build()(x)
    return x


@pytest.mark.parametrize(
    "make", [lambda: llama(True), lambda: llama(False), gpt2], ids=["llama-tied", "llama", "gpt2"]
)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_layers_in_order_reproduce_the_hf_logits(make, packed):
    model = make()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = PACKED if packed else torch.arange(12).expand(2, 12)
    # The Engine's inputs: packed rows carry position_ids and no mask; plain rows (right-padded,
    # causal) need neither.
    inputs = dict(input_ids=ids, position_ids=PACKED, use_cache=False) if packed else dict(input_ids=ids)
    with torch.no_grad():
        expected = model(**inputs).logits
        got = run_layers(pipeline_layers(model), ids, positions)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_packed_rows_do_not_attend_across_documents():
    model = llama(False)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        packed = run_layers(pipeline_layers(model), ids, PACKED)
        plain = run_layers(pipeline_layers(model), ids, torch.arange(12).expand(2, 12))
    # The first document of row 0 (4 tokens) sees the same context either way; the second does not.
    torch.testing.assert_close(packed[0, :4], plain[0, :4], rtol=0, atol=0)
    assert not torch.allclose(packed[0, 4:10], plain[0, 4:10])


def test_tied_models_share_one_tied_spec_at_both_ends():
    names = [type(s).__name__ + ":" + s.typename.__name__ for s in pipeline_layers(llama(True))]
    assert names == ["TiedLayerSpec:TokenEmbeddingPipe"] + ["LayerSpec:DecoderBlockPipe"] * 3 + [
        "LayerSpec:FinalNormPipe",
        "TiedLayerSpec:TokenEmbeddingPipe",
    ]
    untied = [s.typename.__name__ for s in pipeline_layers(llama(False))]
    assert untied[0] == "TokenEmbeddingPipe" and untied[-1] == "LMHeadPipe"
    gpt = [s.typename.__name__ for s in pipeline_layers(gpt2())]
    assert gpt[:2] == ["TokenEmbeddingPipe", "PositionEmbeddingPipe"] and gpt[-1] == "TokenEmbeddingPipe"


@pytest.mark.parametrize(
    "make", [lambda: llama(True), lambda: llama(False), gpt2], ids=["llama-tied", "llama", "gpt2"]
)
def test_export_reassembles_the_hf_state_dict(make):
    model = make()
    specs = pipeline_layers(model)
    # Two "stages": the first three layers and the rest, each holding its own built layers.
    stages = [
        torch.nn.ModuleList(s.build() for s in specs[:3]),
        torch.nn.ModuleList(s.build() for s in specs[3:]),
    ]
    state = assemble_hf_state_dict(model, [stage_state_dict(stage) for stage in stages])
    reference = model.state_dict()
    assert list(state) == list(reference)
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        assert state["lm_head.weight"] is state[next(iter(state))]  # tied: one tensor, saved once


def test_export_names_a_parameter_no_stage_holds():
    model = llama(False)
    first_layers = torch.nn.ModuleList(s.build() for s in pipeline_layers(model)[:2])
    with pytest.raises(RuntimeError, match=r"pipeline export: no stage holds model\.layers\.1\."):
        assemble_hf_state_dict(model, [stage_state_dict(first_layers)])


def test_unsupported_architecture_is_refused_by_name():
    model = llama(False)
    model.config.model_type = "mistral"
    with pytest.raises(ValueError, match="supports llama, gpt2 models, got model_type 'mistral'"):
        pipeline_layers(model)


def test_resolved_pipeline_config_pools_accumulation_and_batch_over_the_stages():
    args = TrainingArguments(
        pipeline_parallel_size=2, per_device_train_batch_size=2, gradient_accumulation_steps=2
    )
    pooled = resolve(args, world_size=4, hardware=Hardware.cpu(), total_steps=1)
    # 2 data-parallel pipelines × micro 2 × accumulation 2 per rank, × 2 stages pooling theirs
    assert pooled["gradient_accumulation_steps"] == 4 and pooled["train_batch_size"] == 16
    assert pooled["pipeline"]["stages"] == 2
    plain = resolve(
        args.model_copy(update={"pipeline_parallel_size": 1}),
        world_size=4,
        hardware=Hardware.cpu(),
        total_steps=1,
    )
    assert plain["gradient_accumulation_steps"] == 2 and plain["train_batch_size"] == 16


def test_window_loss_scales_for_deepspeed_and_keeps_the_plain_sum():
    logits = torch.randn(2, 5, VOCAB, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[1, 2, 3, -100, -100], [4, 5, 6, 7, 8]])
    loss = WindowLoss(SimpleNamespace(objective=CausalLM()))
    loss.start(scale=0.25)
    out1, out2 = loss(logits, labels), loss(logits[:1], labels[:1])
    plain = causal_lm_loss_sum(logits, labels)
    torch.testing.assert_close(out1, plain * 0.25)
    total, count = loss.result(torch.device("cpu"))
    torch.testing.assert_close(total, plain + causal_lm_loss_sum(logits[:1], labels[:1]))
    assert count.item() == 6 + 2 and out2.requires_grad is False


def test_pipeline_engine_refuses_a_client_optimizer_and_a_single_stage():
    model = llama(False)
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "pipeline": {"stages": 2}}  # fmt: skip
    with pytest.raises(ValueError, match="pass optimizer settings .* instead of a client optimizer"):
        PipelineEngine(
            model, config, Mesh(2, pipeline=2), optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
        )
    with pytest.raises(ValueError, match="pipeline.stages must be at least 2 for a pipeline, got 1"):
        PipelineEngine(model, {**config, "pipeline": {"stages": 1}}, Mesh(2))
