"""Tiled loss, tiled MLPs and activation offload against the untiled model, on a tiny real Llama.

Every check compares with the ordinary path (``model(...).logits`` and one cross-entropy over all
tokens): the same loss and the same gradient for every parameter. How the tiles run is checked by
counting the head's calls and the order of recompute and gradient in backward, not by measuring
memory (too noisy on a shared machine)."""

from __future__ import annotations

import copy
import math
import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.nn.functional as F
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from trainer.config.errors import ConfigError
from trainer.data import IGNORE_INDEX
from trainer.engine import tiling
from trainer.engine.tiling import decoder_and_head, offload_activations, tile_mlp, tile_size, tiled_loss_sum

BATCH, SEQ, VOCAB = 2, 128, 512


def tiny_llama(tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).float().train()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, shifted targets): a prompt of 10 ignored targets in row 0, 40 of padding in row 1."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    targets = F.pad(input_ids[:, 1:], (0, 1), value=IGNORE_INDEX)
    targets[0, :10] = IGNORE_INDEX
    targets[1, -40:] = IGNORE_INDEX
    return input_ids, targets


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def untiled_loss(model: torch.nn.Module) -> torch.Tensor:
    input_ids, targets = batch()
    logits = model(input_ids=input_ids).logits
    return F.cross_entropy(
        logits.float().reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def reference(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The untiled loss sum and every gradient (the model's grads are zeroed after)."""
    loss = untiled_loss(model)
    loss.backward()
    found = grads(model)
    model.zero_grad(set_to_none=True)
    return loss.detach(), found


def tiled(model: torch.nn.Module, tile: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    input_ids, targets = batch()
    decoder, head = decoder_and_head(model)
    hidden = decoder(input_ids=input_ids).last_hidden_state
    loss = tiled_loss_sum(hidden, head, targets, tile)
    loss.backward()
    return loss.detach(), grads(model)


def assert_same(got: tuple, want: tuple) -> None:
    """Equal loss (relative 1e-6) and, for every parameter, gradients equal to fp32 rounding (1e-6
    of that gradient's largest entry)."""
    (loss, got_grads), (want_loss, want_grads) = got, want
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0.0)
    assert got_grads.keys() == want_grads.keys()
    for name, want_grad in want_grads.items():
        scale = float(want_grad.abs().max()) or 1.0
        torch.testing.assert_close(got_grads[name], want_grad, rtol=0.0, atol=1e-6 * scale, msg=name)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("tile", [1, 7, 100, BATCH * SEQ, 1000])
def test_tiled_loss_equals_untiled(tile, tied):
    model = tiny_llama(tied)
    want = reference(model)
    assert_same(tiled(model, tile), want)


def test_loss_tiles_run_one_at_a_time():
    """The head sees at most one tile per call, every token once in forward; in backward each
    tile's logits are recomputed right before their gradient, one tile after another, so no two
    tiles' logits are alive together. A tile with no target (inside row 1's padding) is included."""
    model, tile = tiny_llama(), 7
    _, targets = batch()
    tiles = targets.reshape(-1).split(tile)
    assert any(bool((t == IGNORE_INDEX).all()) for t in tiles)
    events: list[tuple[str, int]] = []

    def on_head(module, args, output):
        events.append(("forward", args[0].shape[0]))
        if output.grad_fn is not None:
            output.register_hook(lambda g: events.append(("grad", g.shape[0])))

    model.lm_head.register_forward_hook(on_head)
    input_ids, _ = batch()
    hidden = model.model(input_ids=input_ids).last_hidden_state
    loss = tiled_loss_sum(hidden, model.lm_head, targets, tile)
    assert [rows for _, rows in events] == [len(t) for t in tiles]
    events.clear()
    loss.backward()
    assert [kind for kind, _ in events] == ["forward", "grad"] * len(tiles)
    assert [rows for _, rows in events[::2]] == [len(t) for t in reversed(tiles)]


def test_loss_saves_no_logits_for_backward():
    """Nothing the size of a tile's logits is saved for backward outside the per-tile checkpoints."""
    model, tile = tiny_llama(), 16
    input_ids, targets = batch()
    hidden = model.model(input_ids=input_ids).last_hidden_state
    saved: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = tiled_loss_sum(hidden, model.lm_head, targets, tile)
    loss.backward()
    assert max(saved, default=0) < tile * VOCAB


def test_agreed_tile_count_above_own(monkeypatch):
    """Under ZeRO-3 a rank with fewer tokens runs the count agreed with the others (shorter and empty
    tiles, padded MLP rows): still the same loss and gradients."""
    want = reference(tiny_llama())
    monkeypatch.setattr(tiling, "_agreed_tiles", lambda tiles, module, device: max(tiles, 60))
    model = tiny_llama()
    head_rows: list[int] = []
    model.lm_head.register_forward_hook(lambda m, args, out: head_rows.append(args[0].shape[0]))
    mlp_rows: list[int] = []
    model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, a, o: mlp_rows.append(a[0].shape[0]))
    assert tile_mlp(model, 100) == 2
    got = tiled(model, 100)
    assert head_rows[:60] == [100, 100, 56] + [0] * 57
    assert mlp_rows[:60] == [5] * 60  # 256 rows padded to 300: torch.chunk alone would make 52 tiles
    assert_same(got, want)


def test_loss_without_grad():
    model = tiny_llama()
    with torch.no_grad():
        want = untiled_loss(model)
        input_ids, targets = batch()
        hidden = model.model(input_ids=input_ids).last_hidden_state
        got = tiled_loss_sum(hidden, model.lm_head, targets, 50)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)


def test_tile_size_rule():
    assert tile_size(VOCAB) == 2**28 // (4 * VOCAB)
    assert tile_size(128_256) == 523  # Llama 3: 523 tokens of fp32 logits, just under 256 MiB
    assert tile_size(2**27) == 1
    assert tile_size(VOCAB, 7) == 7
    with pytest.raises(ValueError):
        tile_size(VOCAB, -1)
    with pytest.raises(ValueError):
        tiled_loss_sum(torch.zeros(1, 2, 4), torch.nn.Linear(4, 8), torch.zeros(1, 2, dtype=torch.long), 0)


def test_decoder_and_head_of_llama_and_peft():
    model = tiny_llama(tied=True)
    decoder, head = decoder_and_head(model)
    assert decoder is model.model and head is model.lm_head
    assert head.weight is model.model.embed_tokens.weight
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert decoder_and_head(peft_model) == (model.model, model.lm_head)


def test_decoder_and_head_refuses_softcapped_and_headless():
    config = Gemma2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=64,
    )
    with pytest.raises(ConfigError) as refused:
        decoder_and_head(Gemma2ForCausalLM(config))
    assert refused.value.problems[0][0] == "tiled_loss"
    assert "final_logit_softcapping=30.0" in str(refused.value)
    with pytest.raises(ConfigError, match="^tiled_loss: LlamaModel"):
        decoder_and_head(tiny_llama().model)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad-checkpointing"])
@pytest.mark.parametrize("tile", [0, 5])
def test_tiled_mlp_equals_untiled(tile, checkpointing):
    model = tiny_llama()
    input_ids, _ = batch()
    want_logits = model(input_ids=input_ids).logits.detach()
    want = reference(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rows: list[int] = []
    model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[0]))
    assert tile_mlp(model, tile) == 2
    assert tile_mlp(model, tile) == 2  # again: still one tiling per MLP
    torch.testing.assert_close(model(input_ids=input_ids).logits, want_logits, rtol=0.0, atol=1e-6)
    expected = tile or model.config.hidden_size
    assert rows and max(rows) == expected and len(rows) == math.ceil(BATCH * SEQ / expected)
    assert_same(reference(model), want)


def test_tile_mlp_refuses_model_without_mlp_or_with_dropout():
    with pytest.raises(ConfigError, match="^tiled_mlp: "):
        tile_mlp(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    gpt2 = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=16)
    with pytest.raises(ConfigError, match=r"^tiled_mlp: GPT2MLP applies dropout \(p=0.1\)"):
        tile_mlp(GPT2LMHeadModel(gpt2))
    gpt2.resid_pdrop = 0.0
    assert tile_mlp(GPT2LMHeadModel(gpt2)) == 2


def test_offload_activations_equal(monkeypatch):
    """Here every activation is on the host already; save_on_cpu is made to take them anyway, as it
    would on a GPU. The saved weights are recognised and left alone."""
    model = tiny_llama()
    want = reference(model)
    kept, sent = [], []

    def stays(tensor: torch.Tensor) -> bool:
        (kept if tiling._is_parameter(tensor) else sent).append(tensor)
        return tiling._is_parameter(tensor)

    monkeypatch.setattr(tiling, "_stays", stays)
    with offload_activations():
        loss = untiled_loss(model)
    loss.backward()
    assert_same((loss.detach(), grads(model)), want)
    weights = {p.data_ptr() for p in model.parameters()}
    assert {t.data_ptr() for t in kept} <= weights and len(kept) >= 7 * 2  # 7 linear layers a layer
    assert sent and not any(t.data_ptr() in weights for t in sent)


def test_all_three_together():
    """Offload, tiled MLPs, tiled loss and gradient checkpointing in one step: still the same."""
    model = tiny_llama(tied=True)
    want = reference(copy.deepcopy(model))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tile_mlp(model, 48)
    with offload_activations():
        got = tiled(model, 33)
    assert_same(got, want)
