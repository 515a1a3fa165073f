"""TRL's SFT loss behind the objective contract (``SFT``): the causal-LM loss or TRL's ``dft``, and
TRL's per-micro-batch ``entropy`` and ``mean_token_accuracy``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from trainer.data import IGNORE_INDEX
from trainer.engine.objectives import (
    Batch,
    CausalLM,
    Objective,
    Split,
    Tokens,
    batch_rows,
    count_targets,
    next_token_targets,
)


class SFT(CausalLM):
    """TRL's ``SFTTrainer`` loss and metrics: the causal-LM loss (``dft``: each target's NLL weighted
    by its detached probability), and per micro-batch the mean ``entropy`` of the predicted
    distribution and ``mean_token_accuracy`` (the share of targets that are the top prediction)
    over its targets, logged as the mean over micro-batches (evaluation: over batches), as TRL logs
    them. They come from a forward that holds the logits: the tiled loss and sequence parallelism
    log none (and evaluate token-weighted, as the causal LM does)."""

    metric_names = ("entropy", "mean_token_accuracy")

    def __init__(self, loss_type: str = "nll", router_aux_loss_coef: float | None = None):
        super().__init__(router_aux_loss_coef=router_aux_loss_coef)
        self.dft = loss_type == "dft"

    def check(self, split: Split) -> None:
        """``dft`` weighs each target by its probability from the whole logits: no split takes it."""
        if self.dft:
            Objective.check(self, split)
        else:
            super().check(split)

    # dft's evaluation is a model's own loss's: padding rows cut, each batch's mean from its sums.

    def eval_rows(self, batch: Batch, indices: list[int]) -> tuple[Batch, list[int]]:
        return Objective.eval_rows(self, batch, indices) if self.dft else super().eval_rows(batch, indices)

    def batch_mean(self, batch: Batch, outputs: Any, loss: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        if self.dft:
            return Objective.batch_mean(self, batch, outputs, loss, count)
        return super().batch_mean(batch, outputs, loss, count)

    def token_loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not self.dft:
            return super().token_loss_sum(logits, targets)
        nll = F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        return (nll * torch.exp(-nll).detach()).sum()

    def loss_sum(self, tokens: Tokens, batch: Batch, items: float) -> tuple[torch.Tensor, Any]:
        loss, outputs = super().loss_sum(tokens, batch, items)
        if tokens.whole_logits:
            self.record_metrics(self._token_metrics(outputs.logits, batch))
        return loss, outputs

    def eval_sum(self, tokens: Tokens, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """TRL's evaluation loss, which is HF's: each batch's token mean, weighted by its rows (HF
        weighs a padding-free batch, flattened into one row, by the rows it was made of)."""
        if not tokens.whole_logits:
            return super().eval_sum(tokens, batch)
        loss, outputs = self.next_token_loss_sum(tokens, batch, evaluation=True)
        self.record_metrics(self._token_metrics(outputs.logits, batch), evaluation=True)
        rows = float(batch_rows(batch))
        return loss / max(count_targets(batch), 1) * rows, loss.new_tensor(rows), outputs

    @torch.no_grad()
    def _token_metrics(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """[mean entropy, mean top-1 accuracy, 1] over the batch's targets (zeros without any)."""
        targets = next_token_targets(batch["labels"])
        valid = targets != IGNORE_INDEX
        logits = logits[valid].float()
        logps = logits.log_softmax(-1)
        entropy = -(logps.exp() * logps).sum()
        correct = (logits.argmax(-1) == targets[valid]).sum()
        tokens = valid.sum().clamp(min=1)
        return torch.stack([entropy / tokens, correct / tokens, torch.ones_like(entropy)])
