"""The objectives' arithmetic against HF Trainer's accumulation, in one process on real tiny models:
a window's loss is sum(loss_sum) / sum(count) over its micro-batches, and that must equal what HF's
Trainer backpropagates for the same window."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    BertConfig,
    BertForTokenClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

from trainer.config.errors import ConfigError
from trainer.engine import CausalLM, ModelLoss, Tiling, Tokens, build_engine, objective_for
from trainer.runtime.mesh import Mesh

LLAMA = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, pad_token_id=0)  # fmt: skip


def window_loss(objective, model, window):
    items = sum(objective.count(b) for b in window)
    return sum(objective.loss_sum(Tokens(model), b, items)[0] for b in window) / items


def causal_window():
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, 40, (2, n), generator=g) for n in (5, 9)]
    labels = [x.clone() for x in ids]
    labels[0][1, 3:] = -100  # padding in one micro-batch only
    return [{"input_ids": x, "labels": y} for x, y in zip(ids, labels, strict=True)]


def test_a_causal_lm_own_loss_with_num_items_equals_the_token_exact_objective():
    """HF's model-loss path (num_items_in_batch over the window, labels shifted) and our causal-LM
    objective are the same number for a causal LM; both are the window's token mean."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    window = causal_window()
    exact = window_loss(CausalLM(), model, window)
    own = window_loss(ModelLoss(per_item=True, shifted=True), model, window)
    torch.testing.assert_close(own, exact)
    flat = torch.cat([model(**b).logits[:, :-1].reshape(-1, 40) for b in window])
    targets = torch.cat([b["labels"][:, 1:].reshape(-1) for b in window])
    torch.testing.assert_close(exact, torch.nn.functional.cross_entropy(flat, targets))


def test_a_loss_that_ignores_num_items_sums_its_micro_batch_means_as_hfs_trainer():
    """BERT's token-classification loss is a mean whatever num_items_in_batch says; HF's Trainer
    then backpropagates the sum of the micro-batches' means (no division by the accumulation
    steps), and so does the objective."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)  # fmt: skip
    model = BertForTokenClassification(config)
    g = torch.Generator().manual_seed(1)
    window = [
        {
            "input_ids": torch.randint(1, 40, (2, n), generator=g),
            "labels": torch.randint(0, 3, (2, n), generator=g),
        }
        for n in (4, 7)
    ]
    window[1]["labels"][0, 5:] = -100
    objective = objective_for(model)
    assert isinstance(objective, ModelLoss) and objective.per_item
    means = sum(model(**b).loss for b in window)
    torch.testing.assert_close(window_loss(objective, model, window), means)
    assert objective.count(window[1]) == 12  # labelled items, unshifted


def test_a_forward_without_loss_kwargs_averages_its_micro_batches():
    """A model whose forward takes no **kwargs gets no num_items_in_batch: HF divides each
    micro-batch's mean by the accumulation steps, so the window's loss is their mean."""

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 1)

        def forward(self, x, labels):
            return {"loss": ((self.linear(x).squeeze(-1) - labels) ** 2).mean()}

    model = Plain()
    objective = objective_for(model)
    assert isinstance(objective, ModelLoss) and not objective.per_item
    window = [{"x": torch.randn(2, 3), "labels": torch.randn(2)} for _ in range(3)]
    assert [objective.count(b) for b in window] == [1.0, 1.0, 1.0]
    expected = sum(model(**b)["loss"] for b in window) / 3
    torch.testing.assert_close(window_loss(objective, model, window), expected)


def test_evaluation_weights_each_batch_mean_by_its_rows_as_hf():
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(num_labels=3, **LLAMA)).eval()
    batch = {"input_ids": torch.randint(1, 40, (3, 6)), "labels": torch.tensor([0, 2, 1])}
    loss, rows, _ = objective_for(model).eval_sum(Tokens(model), batch)
    assert rows.item() == 3
    torch.testing.assert_close(loss, model(**batch).loss * 3)


def test_seq2seq_evaluation_counts_each_batch_mean_once_and_causal_stays_token_exact():
    """HF's Seq2SeqTrainer weighs every batch's mean alike (a short last batch too); a causal LM
    keeps its token-weighted sum under the same flag."""
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(num_labels=3, **LLAMA)).eval()
    batch = {"input_ids": torch.randint(1, 40, (3, 6)), "labels": torch.tensor([0, 2, 1])}
    loss, count, _ = objective_for(model, eval_per_batch=True).eval_sum(Tokens(model), batch)
    assert count.item() == 1
    torch.testing.assert_close(loss, model(**batch).loss)
    causal = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    input_ids = torch.randint(1, 40, (2, 6))
    tokens = {"input_ids": input_ids, "labels": input_ids.clone()}
    tokens["labels"][1, 3:] = -100
    loss, count, _ = objective_for(causal, eval_per_batch=True).eval_sum(Tokens(causal), tokens)
    assert count.item() == 5 + 2  # the shifted targets that are not -100
    torch.testing.assert_close(loss / count, causal(**tokens).loss)


def test_features_that_compute_the_causal_loss_themselves_refuse_other_objectives():
    model = LlamaForSequenceClassification(LlamaConfig(num_labels=3, **LLAMA))
    for ds_config, mesh, feature in (
        ({"sequence_parallel_size": 2}, Mesh(2, sequence=2), "sequence_parallel_size > 1"),
        ({"pipeline": {"stages": 2}}, Mesh(2, pipeline=2), "pipeline_parallel_size > 1"),
    ):
        with pytest.raises(ConfigError, match=f"^model: {feature}.*ModelLoss"):
            build_engine(model, ds_config, mesh, objective=objective_for(model))
    with pytest.raises(ConfigError, match="^label_smoothing_factor: .*tiled loss"):
        build_engine(model, {}, Mesh(1), objective=CausalLM(0.1), tiling=Tiling(loss=1024))
