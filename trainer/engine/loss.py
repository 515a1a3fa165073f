"""The causal-LM loss every engine computes: a per-token sum, so windows and ranks add up exactly.

A summed (not averaged) loss lets an engine divide once by the target tokens of the whole window on
all ranks; the update then equals one big batch however it is split into micro-batches and ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.data import IGNORE_INDEX


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Target tokens of a causal-LM batch: labels after the one-token shift, minus ignored ones (a
    sequence-parallel shard carries its targets shifted already, as ``shift_labels``)."""
    if "shift_labels" in batch:
        return int((batch["shift_labels"] != IGNORE_INDEX).sum())
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def target_count(labels: torch.Tensor) -> torch.Tensor:
    """``count_targets`` on the device, for evaluation sums that stay there."""
    return (labels[:, 1:] != IGNORE_INDEX).sum().float()


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """Position i's target is label i+1; the last position has none (-100).

    The labels are shifted (and padded) rather than the logits sliced: slicing would copy the
    largest activation in forward and write a full-size zero gradient in backward."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Sum (not mean) of cross-entropy over non-ignored targets (already shifted), in fp32;
    ``label_smoothing`` as ``F.cross_entropy`` applies it (HF's label smoother's uniform term)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        label_smoothing=label_smoothing,
    )


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over non-ignored targets, in fp32."""
    return token_loss_sum(logits, next_token_targets(labels))
