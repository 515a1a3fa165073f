"""What a sequence-parallel rank keeps of a batch, the packed rows' mask, and the layout rules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from trainer.args import RunConfig
from trainer.config.errors import ConfigError
from trainer.engine.objectives import causal_lm_loss_sum, count_targets, token_loss_sum
from trainer.engine.sequence_parallel import SequenceParallel, _isolating, block_causal_mask, check_layout


def _rank(rank: int, size: int) -> SequenceParallel:
    sp = object.__new__(SequenceParallel)  # the slicing needs no process group
    sp.rank, sp.size = rank, size
    return sp


def test_the_slices_of_all_ranks_make_up_the_rows_and_their_targets():
    ids = torch.arange(20).reshape(2, 10)
    labels = ids.clone()
    labels[1, 7:] = -100  # padding
    batch = {"input_ids": ids, "labels": labels}
    shards = [_rank(r, 2).shard(batch) for r in range(2)]
    assert torch.equal(torch.cat([s["input_ids"] for s in shards], 1), ids)
    assert torch.equal(torch.cat([s["position_ids"] for s in shards], 1), torch.arange(10).expand(2, 10))
    targets = torch.cat([s["shift_labels"] for s in shards], 1)
    assert torch.equal(targets, F.pad(labels[:, 1:], (0, 1), value=-100))  # shifted before the split
    assert sum(count_targets(s) for s in shards) == count_targets(batch)


def test_rows_that_do_not_split_evenly_are_padded_with_ignored_targets():
    batch = {"input_ids": torch.arange(7)[None], "labels": torch.arange(7)[None],
             "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3]])}  # fmt: skip
    shards = [_rank(r, 3).shard(batch) for r in range(3)]
    assert [s["input_ids"].shape[1] for s in shards] == [3, 3, 3]
    assert torch.cat([s["position_ids"] for s in shards], 1).tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5]]
    assert torch.cat([s["shift_labels"] for s in shards], 1).tolist() == [
        [1, 2, 3, 4, 5, 6, -100, -100, -100]
    ]


def test_the_loss_of_the_slices_adds_up_to_the_rows_loss():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 8, 11), torch.randint(0, 11, (2, 8))
    batch = {"input_ids": labels, "labels": labels}
    total = sum(
        token_loss_sum(logits[:, r * 4 : (r + 1) * 4], _rank(r, 2).shard(batch)["shift_labels"])
        for r in range(2)
    )
    torch.testing.assert_close(total, causal_lm_loss_sum(logits, labels))


def test_packed_rows_attend_within_their_documents():
    mask = block_causal_mask(torch.tensor([[0, 1, 2, 0, 1]]))
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]],
        dtype=torch.bool,
    )
    assert mask.shape == (1, 1, 5, 5) and torch.equal(mask[0, 0], expected)
    assert block_causal_mask(torch.arange(5)[None]) is None  # one document: plain causal attention


def test_a_packed_document_gets_the_logits_it_has_alone():
    """As under SP: HF's own mask is dropped and the core sdpa gets the mask built from the positions."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=50, attn_implementation="sdpa")  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids, positions = torch.randint(0, 50, (1, 7)), torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    core = ALL_ATTENTION_FUNCTIONS["sdpa"]
    isolating = _isolating(core, "sdpa")
    with torch.no_grad():
        alone = model(input_ids=ids[:, 4:]).logits
        ALL_ATTENTION_FUNCTIONS["sdpa"] = lambda module, q, k, v, mask, *a, **kw: isolating(
            module, q, k, v, None, *a, **kw
        )
        try:
            packed = model(input_ids=ids, position_ids=positions).logits
            ALL_ATTENTION_FUNCTIONS["sdpa"] = lambda module, q, k, v, mask, *a, **kw: core(
                module, q, k, v, None, *a, **kw
            )
            leaking = model(input_ids=ids, position_ids=positions).logits
        finally:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = core
    torch.testing.assert_close(packed[:, 4:], alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(leaking[:, 4:], alone, atol=1e-3)  # without the mask, documents mix


def test_the_layout_rules_name_the_keys():
    check_layout(
        LlamaConfig(num_attention_heads=8, num_key_value_heads=2), 4, world_size=8
    )  # KV heads copied
    with pytest.raises(ConfigError) as err:
        check_layout(
            LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=6), 4, world_size=6
        )
    messages = str(err.value)
    assert "4 does not divide the model's 6 attention heads" in messages
    assert "4 and the model's 6 key/value heads do not divide one another" in messages
    assert "4 does not divide the 6 ranks of this run" in messages
    with pytest.raises(ConfigError, match="model_type gpt2: its attention does not receive position ids"):
        check_layout(GPT2Config(n_head=4), 2)
    with pytest.raises(ConfigError, match="attn_implementation: eager attention"):
        check_layout(LlamaConfig(num_attention_heads=4, attn_implementation="eager"), 2)


def test_the_block_size_and_the_pipeline_are_checked_with_the_arguments():
    with pytest.raises(
        ConfigError, match="block_size, sequence_parallel_size: 100 tokens do not split over 3"
    ):
        RunConfig.from_flat({"sequence_parallel_size": 3, "block_size": 100})
    with pytest.raises(ConfigError, match="not with pipeline stages"):
        RunConfig.from_flat({"sequence_parallel_size": 2, "pipeline_parallel_size": 2})
    assert RunConfig.from_flat({"tiled_loss": True}).training.tiled_loss == "true"


def test_the_layers_of_a_forward_share_one_mask():
    """sdpa keeps its mask for backward, a boolean one as a float copy made at every call: the
    layers of a forward get one additive mask, made again for other positions."""
    seen = []
    isolating = _isolating(lambda module, q, k, v, mask, *a, **kw: seen.append(mask), "sdpa")
    query = torch.ones(1, 1, 6, 2)
    for positions in ([[0, 1, 2, 0, 1, 2]],) * 3 + ([[0, 1, 0, 1, 2, 3]],):
        isolating(None, query, query, query, None, position_ids=torch.tensor(positions))
    assert seen[0] is seen[1] is seen[2] and seen[3] is not seen[0]
    assert seen[0].dtype == query.dtype
    assert torch.equal(seen[0] == 0, block_causal_mask(torch.tensor([[0, 1, 2, 0, 1, 2]])))
    assert torch.equal(seen[3] == 0, block_causal_mask(torch.tensor([[0, 1, 0, 1, 2, 3]])))
