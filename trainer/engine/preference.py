"""Direct preference optimisation (DPO) behind the objective contract, with TRL's loss types.

A micro-batch holds pairs (``trainer.data.preference``): one forward through the engine scores both
sequences of every pair, and each sequence's log-probability is the sum of its answer tokens'
log-probabilities. With the reference's log-probabilities (``ref_logps``, from the reference pass),
each pair's implicit reward margin is ``beta * ((chosen - ref_chosen) - (rejected - ref_rejected))``.
A pair counts once (``count``), so a step's loss is the mean over the pairs of its window on every
rank: TRL's per-batch mean when micro-batches hold as many pairs, and exact when they do not.

Loss types (TRL's names and formulas): ``sigmoid`` (the DPO paper's), ``hinge``, ``ipo`` (on
log-ratios averaged over each answer's tokens, as TRL computes it) and ``robust`` (with
``label_smoothing``, the assumed rate of flipped labels). Several types add up with their weights.

The objective also sums TRL's reward metrics over the pairs it trains on (``rewards/chosen``,
``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
``logps/rejected``); the Trainer takes their means at each logging step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from trainer.args.preference import LOSS_TYPES
from trainer.data import IGNORE_INDEX
from trainer.data.preference import REFERENCE_COLUMN
from trainer.engine.objectives import Batch, Forward, Objective

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
MODEL_KEYS = ("input_ids", "attention_mask")


def sequence_logps(forward: Forward, batch: Batch) -> tuple[torch.Tensor, Any]:
    """(summed answer-token log-probabilities of shape (pairs, 2), the model's outputs): both
    sequences of every pair in one forward, in fp32."""
    pairs, _, length = batch["input_ids"].shape
    inputs = {k: batch[k].reshape(2 * pairs, length) for k in MODEL_KEYS}
    outputs = forward(**inputs, use_cache=False)
    targets = inputs["input_ids"][:, 1:].masked_fill(
        batch["completion_mask"].reshape(2 * pairs, length)[:, 1:] == 0, IGNORE_INDEX
    )
    logits = outputs.logits[:, :-1].float()
    token_nll = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")
    return -token_nll.sum(dim=1).view(pairs, 2), outputs


class DPO(Objective):
    """TRL's DPO losses over a pair's log-ratios against the reference."""

    label_names = (REFERENCE_COLUMN,)  # a batch without the reference's log-probs has no loss

    def __init__(
        self,
        beta: float = 0.1,
        loss_types: tuple[str, ...] = ("sigmoid",),
        loss_weights: tuple[float, ...] | None = None,
        label_smoothing: float = 0.0,
    ):
        unknown = [t for t in loss_types if t not in LOSS_TYPES]
        if unknown:
            raise ValueError(f"loss_type: {', '.join(unknown)} is not one of {', '.join(LOSS_TYPES)}")
        self.beta, self.loss_types, self.label_smoothing = beta, tuple(loss_types), label_smoothing
        self.loss_weights = tuple(loss_weights) if loss_weights is not None else (1.0,) * len(loss_types)
        self._sums: torch.Tensor | None = None  # METRICS summed over pairs, then the pairs

    def count(self, batch: Batch) -> float:
        return float(batch["input_ids"].shape[0])

    def pair_losses(self, batch: Batch, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each pair's loss, each pair's log-ratios [chosen, rejected])."""
        ratios = logps - batch[REFERENCE_COLUMN].to(logps)
        delta = ratios[:, 0] - ratios[:, 1]
        beta, smoothing = self.beta, self.label_smoothing
        loss = torch.zeros_like(delta)
        for loss_type, weight in zip(self.loss_types, self.loss_weights, strict=True):
            if loss_type == "sigmoid":
                term = -F.logsigmoid(beta * delta)
            elif loss_type == "hinge":
                term = torch.relu(1 - beta * delta)
            elif loss_type == "ipo":  # per-token log-ratios: the answer lengths from the unshifted mask
                lengths = batch["completion_mask"].sum(dim=2).clamp(min=1).to(ratios)
                averaged = ratios / lengths
                term = (averaged[:, 0] - averaged[:, 1] - 1 / (2 * beta)) ** 2
            else:  # robust: unbiased under a rate `label_smoothing` of flipped preferences
                term = (
                    -(1 - smoothing) * F.logsigmoid(beta * delta) + smoothing * F.logsigmoid(-beta * delta)
                ) / (1 - 2 * smoothing)
            loss = loss + weight * term
        return loss, ratios

    def loss_sum(self, forward: Forward, batch: Batch, items: float) -> tuple[torch.Tensor, Any]:
        logps, outputs = sequence_logps(forward, batch)
        loss, ratios = self.pair_losses(batch, logps)
        self._record(logps.detach(), ratios.detach())
        return loss.sum(), outputs

    def eval_sum(self, forward: Forward, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        logps, outputs = sequence_logps(forward, batch)
        loss, _ = self.pair_losses(batch, logps)
        return loss.sum(), loss.new_tensor(float(len(loss))), outputs

    def _record(self, logps: torch.Tensor, ratios: torch.Tensor) -> None:
        rewards = self.beta * ratios
        margins = rewards[:, 0] - rewards[:, 1]
        values = torch.stack(
            [rewards[:, 0], rewards[:, 1], (margins > 0).to(rewards), margins, logps[:, 0], logps[:, 1]]
        ).sum(dim=1)
        sums = torch.cat([values, values.new_tensor([float(len(margins))])])
        self._sums = sums if self._sums is None else self._sums + sums

    def take_metric_sums(self) -> tuple[tuple[str, ...], torch.Tensor | None]:
        """(metric names, their sums over the pairs trained on since the last call, then the pair
        count); the sums start again."""
        sums, self._sums = self._sums, None
        return METRICS, sums
