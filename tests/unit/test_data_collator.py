"""CausalLMCollator padding and labels, and what packed position_ids do inside an HF Llama."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.data import IGNORE_INDEX, CausalLMCollator


def test_pads_right_with_pad_id_and_minus_100_labels():
    batch = CausalLMCollator(pad_token_id=9)([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}])
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert all(t.dtype == torch.long for t in batch.values())
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3], [4, IGNORE_INDEX, IGNORE_INDEX]]


def test_padding_is_found_by_position_so_an_eos_equal_to_pad_keeps_its_label():
    eos = 5
    batch = CausalLMCollator(pad_token_id=eos)([{"input_ids": [1, eos]}, {"input_ids": [2, 3, eos, 7]}])
    assert batch["labels"].tolist() == [[1, eos, IGNORE_INDEX, IGNORE_INDEX], [2, 3, eos, 7]]


def test_row_labels_and_position_ids_are_carried_and_padded():
    rows = [
        {
            "input_ids": [1, 2, 3, 4],
            "labels": [IGNORE_INDEX, IGNORE_INDEX, 3, 4],
            "position_ids": [0, 1, 0, 1],
        },
        {"input_ids": [5, 6], "labels": [5, 6], "position_ids": [0, 1]},
    ]
    batch = CausalLMCollator(0)(rows)
    assert batch["labels"].tolist() == [
        [IGNORE_INDEX, IGNORE_INDEX, 3, 4],
        [5, 6, IGNORE_INDEX, IGNORE_INDEX],
    ]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1], [0, 1, 0, 0]]


def test_pad_to_multiple_of_and_empty_batch():
    batch = CausalLMCollator(0, pad_to_multiple_of=8)([{"input_ids": [1, 2, 3]}])
    assert batch["input_ids"].shape == (1, 8)
    assert batch["labels"][0, 3:].tolist() == [IGNORE_INDEX] * 5
    with pytest.raises(ValueError, match="cannot collate an empty batch"):
        CausalLMCollator(0)([])


def test_packed_position_ids_isolate_documents_in_llama_when_attention_mask_is_omitted():
    """The documented choice: pass position_ids and no attention_mask (and no KV cache).

    HF Llama then builds a block-diagonal causal mask from the restarts in position_ids, so a
    document in a packed block gets exactly the logits it gets alone. Passing the all-ones
    attention_mask as well silently turns that off (attention crosses documents again).
    """
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
        attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    first, second = [3, 4, 5, 6, 1], [7, 8, 9, 10, 11, 1]
    batch = CausalLMCollator(0)(
        [{"input_ids": first + second, "position_ids": [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]}]
    )
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([second])).logits
        packed = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits
        with_mask = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            attention_mask=batch["attention_mask"],
            use_cache=False,
        ).logits
    torch.testing.assert_close(packed[:, len(first) :], alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(with_mask[:, len(first) :], alone, atol=1e-3)
