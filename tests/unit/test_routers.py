"""The router's load-balancing loss (trainer/engine/routers.py): which modules route, the loss of
each row against HF's ``load_balancing_loss_func`` and against a count by hand, and one process's
training against HF's Trainer and across splits of one batch (tests/helpers/moe_parity.py)."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from tests.helpers.launch import launch, run_env
from tests.helpers.moe_scenario import RoutedMLP
from tests.helpers.moe_scenario import model as routed_llama
from trainer.config import ConfigError
from trainer.engine.objectives import CausalLM, Split
from trainer.engine.routers import Routers, row_balance

SMALL = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, num_experts_per_tok=2)  # fmt: skip


def mixtral() -> MixtralForCausalLM:
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(**SMALL, num_local_experts=4, router_aux_loss_coef=0.02))


def qwen3_moe() -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**SMALL, num_experts=4, moe_intermediate_size=8, head_dim=8))


def padded_batch(lengths: list[int], width: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_routers_are_found_from_hf_recorders_and_from_expert_blocks():
    for model, layers, experts, top_k, coefficient in (
        (mixtral(), 2, 4, 2, 0.02),
        (qwen3_moe(), 2, 4, 2, 0.001),
    ):
        routers = Routers.of(model)
        assert (len(routers.modules), routers.experts, routers.top_k, routers.coefficient) == (
            layers, experts, top_k, coefficient
        )  # fmt: skip
        assert Routers.of(model) is routers  # hooked once however many engines are built over it
    generic = Routers.of(routed_llama())
    assert [type(m) for m in generic.modules] == [torch.nn.Linear, torch.nn.Linear]
    assert (generic.experts, generic.top_k, generic.coefficient) == (8, RoutedMLP.top_k, None)
    assert not Routers.of(
        LlamaForCausalLM(LlamaConfig(**{k: v for k, v in SMALL.items() if "experts" not in k}))
    )


@pytest.mark.parametrize("build", [mixtral, qwen3_moe])
def test_each_rows_loss_is_hfs_over_that_row_alone(build):
    """Rows of 9, 5 and 7 tokens padded to 9: each row's loss is HF's function over its own tokens,
    and padding counts for nothing. The weights are the rows' target tokens."""
    model, batch = build(), padded_batch([9, 5, 7], 9)
    routers = Routers.of(model)
    with routers.capture() as logits:
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert len(logits) == 2 and logits[0].shape == (27, 4)
    loss, weights, load = row_balance(logits, batch, routers.top_k)
    for row, length in enumerate([9, 5, 7]):
        alone = tuple(layer.reshape(3, 9, 4)[row, :length] for layer in logits)
        assert float(loss[row]) == pytest.approx(float(load_balancing_loss_func(alone, 4, 2)), rel=1e-6)
    assert weights.tolist() == [8, 4, 6]
    assert load.sum(1).tolist() == [2 * 21, 2 * 21]  # every layer: 21 tokens, 2 picks each
    with torch.no_grad():
        model(input_ids=batch["input_ids"])
    assert len(logits) == 2  # disarmed outside the block


def test_a_rows_loss_by_hand():
    """Two layers, three tokens, three experts, top-1: experts * sum_e (picks_e / 6) * (mean p_e)."""
    logits = [
        torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]]),
        torch.tensor([[1.0, 0.0, 0.0]] * 3),
    ]
    batch = {"input_ids": torch.zeros(1, 3, dtype=torch.long), "labels": torch.zeros(1, 3, dtype=torch.long)}
    probs = [[float(v) for v in layer.softmax(-1)[t]] for layer in logits for t in range(3)]
    picks = [sum(max(range(3), key=lambda e: p[e]) == e for p in probs) for e in range(3)]  # [4, 1, 1]
    mean_p = [sum(p[e] for p in probs) / 6 for e in range(3)]
    by_hand = 3 * sum(picks[e] / 6 * mean_p[e] for e in range(3))
    loss, _, load = row_balance(logits, batch, 1)
    assert picks == [4, 1, 1]
    assert float(loss[0]) == pytest.approx(by_hand, rel=1e-6)
    assert load.tolist() == [[1, 1, 1], [3, 0, 0]]


def test_a_coefficient_without_routers_or_with_split_rows_is_refused():
    dense = Routers.of(
        LlamaForCausalLM(LlamaConfig(**{k: v for k, v in SMALL.items() if "experts" not in k}))
    )
    with pytest.raises(ConfigError, match="router_aux_loss_coef: the model has no mixture-of-experts router"):
        CausalLM(router_aux_loss_coef=0.01).route(dense, Split())
    CausalLM().route(dense, Split())  # the default asks for nothing
    with pytest.raises(ConfigError, match="sequence_parallel_size > 1 and pipeline stages split"):
        CausalLM().route(Routers.of(mixtral()), Split(sequence=True))
    off = CausalLM(router_aux_loss_coef=0.0)
    off.route(Routers.of(mixtral()), Split(sequence=True))  # 0 turns it off
    assert off.balance is None


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_parity")
    launch(["tests/helpers/moe_parity.py", str(out)], launcher="python", env=run_env(TRAINER_CPU_BF16="off"))
    return json.loads((out / "parity.json").read_text())


@pytest.mark.parametrize("run", ["", "_lora"])
def test_one_process_takes_hfs_steps_with_the_router_loss(parity, run):
    """A micro-batch of one row: HF's Trainer (its loss plus 0.05 x its router loss) and ours, step
    by step, the whole model or LoRA adapters; without the router loss ours would be 0.1 lower."""
    hf, ours = parity[f"hf{run}"], parity[f"ours{run}"]
    assert len(hf["loss"]) == len(ours["loss"]) == 4 and len(ours["aux_loss"]) == 4
    for key in ("loss", "grad_norm"):
        assert ours[key] == pytest.approx(hf[key], rel=1e-5), key
    assert all(1.9 < aux < 2.2 for aux in ours["aux_loss"])  # 4 experts, top-2: 2 when balanced


@pytest.mark.parametrize("split", ["ours_2x2", "ours_4x1", "ours_batch4_checkpointed"])
def test_a_batch_split_into_micro_batches_gives_the_same_steps(parity, split):
    one, parts = parity["ours_batch4"], parity[split]
    for key in ("loss", "aux_loss", "grad_norm"):
        assert parts[key] == pytest.approx(one[key], rel=1e-5), key


def test_a_dropped_model_is_freed_at_once():
    """The model holds its routers; the routers hold it weakly, so dropping it frees it without a
    garbage collection (under ZeRO-3 a model that lives on keeps transformers' zero.Init switch on)."""
    model = mixtral()
    with Routers.of(model).capture():
        model(input_ids=torch.ones(1, 4, dtype=torch.long))
    held = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert held() is None
    finally:
        gc.enable()
