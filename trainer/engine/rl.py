"""Online RL objectives behind the objective contract, with TRL 1.16's formulas: ``GRPO`` (its loss
types, GSPO's sequence-level ratio) and ``RLOO``.

A micro-batch is a slice of a rollout buffer (``trainer.loop.rollouts``): left-padded prompts, the
completions the policy sampled for them (right-padded, cut after the first EOS), each completion's
advantage, and where the step needs them the sampling policy's per-token log-probabilities
(``old_logps``: off-policy reuse) and the reference's (``ref_logps``, when ``beta`` > 0). The
current policy's log-probabilities and entropies come from the engine's per-token service
(``Tokens.completion_logps``: the completion's positions only, tiled where the run tiles).

Each loss is a sum over the micro-batch with a count, so a step's loss is TRL's however its window
is split over micro-batches and ranks. The count comes with the batch (``count``), set by the
producer from the objective's rule (``count_of``):
- ``grpo``: each completion's token mean, counted once per completion;
- ``bnpo``: the micro-batch's token mean, counted once per micro-batch (TRL's per-micro-batch mean);
- ``dr_grpo``: tokens summed over ``max_completion_length``, counted once per completion;
- ``dapo``: tokens summed, counted by the generation batch's completion tokens on every rank, over
  the micro-batches that share it (TRL's ``num_items_in_batch`` rescaled to one step).
``RLOO`` sums each completion's log-probability, one ratio per completion, counted once per completion.

Metrics are TRL's: each micro-batch's global mean over every rank (``entropy``, ``kl``,
``clip_ratio/*``), logged as their mean over the micro-batches of the logging window; the rollout's
own (``reward``, ``completions/*``) are recorded by the producer (``record_rollout``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainer.config.errors import ConfigError
from trainer.engine.objectives import Batch, Objective, Split, Tokens
from trainer.runtime.distributed import all_reduce_sum

ROLLOUT_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")


class PolicyObjective(Objective):
    """What GRPO and RLOO share: the forward over prompts and completions, the clipped ratio, the
    count that comes with the batch, and the rollout metrics."""

    label_names = ("advantages",)

    def __init__(self, args: Any):
        self.temperature = args.temperature
        self.epsilon_low = args.epsilon
        self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        self.beta = args.beta
        self.rollout_metrics: dict[str, list[float]] = {}

    @classmethod
    def from_args(cls, args: Any) -> PolicyObjective:
        return cls(args)

    def check(self, split: Split) -> None:
        """Generation needs whole rows on every rank, and one stage that holds the whole model."""
        for name, feature in (
            ("sequence", "sequence_parallel_size > 1"),
            ("stages", "pipeline_parallel_size > 1"),
        ):
            if getattr(split, name):
                raise ConfigError(
                    f"{feature}: online RL generates completions with the whole model on each rank; "
                    "run it without that split",
                    path="objective",
                )

    def count(self, batch: Batch) -> float:
        return float(batch["count"])

    def count_of(self, rows: int, tokens: float, micro_batches: int) -> float:
        """A rollout micro-batch's count (``count`` reads it from the batch): its ``rows``, by
        default. ``tokens``: the generation batch's completion tokens on every rank, shared by its
        ``micro_batches`` (every rank's)."""
        return float(rows)

    def input_tokens(self, batch: Batch, every_id: bool = False) -> int:
        """The tokens the rollout read and wrote, counted once per generation (TRL's ``num_tokens``)."""
        return int(batch["input_tokens"])

    def policy_logps(self, tokens: Tokens, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(per-token log-probabilities, entropies, outputs) of the batch's completions."""
        inputs = {
            "input_ids": torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
            "attention_mask": torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
        }
        return tokens.completion_logps(inputs, batch["completion_ids"].shape[1], self.temperature)

    def record_rollout(self, metrics: dict[str, float]) -> None:
        """A rollout's metrics (the same on every rank), averaged over the rollouts of a logging window."""
        for name, value in metrics.items():
            self.rollout_metrics.setdefault(name, []).append(value)

    def metric_means(self, device: torch.device, evaluation: bool = False) -> dict[str, float]:
        means = super().metric_means(device, evaluation)
        if not evaluation:  # as TRL: a rollout's NaN (no completion scored) is left out of the mean
            kept = {k: [x for x in v if not math.isnan(x)] for k, v in self.rollout_metrics.items()}
            means.update({k: sum(v) / len(v) if v else float("nan") for k, v in kept.items()})
            self.rollout_metrics = {}
        return means

    def record_global(
        self, values: list[tuple[torch.Tensor, torch.Tensor]], low: torch.Tensor, high: torch.Tensor
    ) -> None:
        """This micro-batch's metrics over every rank, recorded as one item that each rank holds
        alike: each (sum, count) pair's mean, then the least of ``low`` and the most of ``high``
        (per-completion values, NaN where a completion has no token) over every rank's."""
        sums = torch.stack([torch.stack([s.double(), c.double()]) for s, c in values]).flatten()
        sums = all_reduce_sum(sums.detach()).view(-1, 2)
        means = sums[:, 0] / sums[:, 1].clamp(min=1.0)
        inf = float("inf")  # NaN left out: +inf under a minimum (the maximum is the negatives' minimum)
        least = torch.stack(
            [low.double().nan_to_num(nan=inf).min(), (-high.double()).nan_to_num(nan=inf).min()]
        )
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
        extremes = (least * least.new_tensor([1.0, -1.0])).detach()
        extremes = extremes.masked_fill(torch.isinf(extremes), float("nan"))  # no completion had a token
        self.record_metrics(torch.cat([means, extremes, means.new_ones(1)]).float())


def clip_flags(coef: torch.Tensor, advantages: torch.Tensor, low: float, high: float) -> list[torch.Tensor]:
    """Where the ratio is clipped from below (a negative advantage), from above (a positive one), either."""
    below = (coef < 1 - low) & (advantages < 0)
    above = (coef > 1 + high) & (advantages > 0)
    return [below.float(), above.float(), (below | above).float()]


CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


class GRPO(PolicyObjective):
    """TRL's ``GRPOTrainer`` loss: the clipped importance ratio times each completion's advantage,
    per token (or per completion: ``importance_sampling_level="sequence"``, GSPO), plus ``beta``
    times the per-token KL to the reference (k3), normalised by ``loss_type``."""

    def __init__(self, args: Any):
        super().__init__(args)
        self.loss_type, self.level = args.loss_type, args.importance_sampling_level
        self.max_completion_length = args.max_completion_length
        self.delta, self.bias_correction = args.delta, args.use_bias_correction_kl
        kl = ("kl",) if self.beta else ()
        self.metric_names = (*kl, "entropy", *CLIP_METRICS, "clip_ratio/low_min", "clip_ratio/high_max")

    def count_of(self, rows: int, tokens: float, micro_batches: int) -> float:
        """By ``loss_type`` (the module's docstring): one per micro-batch (bnpo), the generation's
        tokens shared by its micro-batches (dapo), else one per completion."""
        if self.loss_type == "bnpo":
            return 1.0
        if self.loss_type == "dapo":
            return max(tokens, 1.0) / micro_batches
        return float(rows)

    def loss_sum(self, tokens: Tokens, batch: Batch, items: float) -> tuple[torch.Tensor, Any]:
        logps, entropy, outputs = self.policy_logps(tokens, batch)
        mask = batch["completion_mask"].to(logps.dtype)
        old = batch.get("old_logps")
        log_ratio = logps - (logps.detach() if old is None else old)
        if self.level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        coef = torch.exp(log_ratio)
        advantages = batch["advantages"].to(logps.dtype).unsqueeze(-1)
        clipped = torch.clamp(coef, 1 - self.epsilon_low, 1 + self.epsilon_high)
        unclipped = coef if self.delta is None else torch.clamp(coef, max=self.delta)
        per_token = -torch.min(unclipped * advantages, clipped * advantages)
        kl = None
        if self.beta:
            gap = batch["ref_logps"] - logps
            kl = torch.exp(gap) - gap - 1
            kl = kl * coef if self.bias_correction else kl
            per_token = per_token + self.beta * kl
        masked = (per_token * mask).sum(-1)
        if self.loss_type == "grpo":
            loss = (masked / mask.sum(-1).clamp(min=1.0)).sum()
        elif self.loss_type == "bnpo":
            loss = masked.sum() / mask.sum().clamp(min=1.0)
        elif self.loss_type == "dr_grpo":
            loss = masked.sum() / self.max_completion_length
        else:  # dapo
            loss = masked.sum()
        self._metrics(mask, entropy, kl, coef, advantages)
        return loss, outputs

    def _metrics(
        self, mask: torch.Tensor, entropy: torch.Tensor, kl: Any, coef: torch.Tensor, advantages: torch.Tensor
    ) -> None:
        def masked(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if x.shape[-1] == 1:  # one value per completion
                return x.sum(), x.new_tensor(float(x.shape[0]))
            return (x * mask).sum(), mask.sum()

        def per_completion(x: torch.Tensor) -> torch.Tensor:
            return x.squeeze(-1) if x.shape[-1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        flags = clip_flags(coef.detach(), advantages, self.epsilon_low, self.epsilon_high)
        values = ([masked(kl.detach())] if kl is not None else []) + [masked(entropy.detach())]
        values += [masked(f) for f in flags]
        self.record_global(values, per_completion(flags[0]), per_completion(flags[1]))


class RLOO(PolicyObjective):
    """TRL's ``RLOOTrainer`` loss: each completion's summed log-probability ratio to the sampling
    policy's, clipped, times its leave-one-out advantage (the KL is in the reward); the mean over
    completions."""

    metric_names = ("entropy", *CLIP_METRICS, "clip_ratio/low_min", "clip_ratio/high_max")

    def loss_sum(self, tokens: Tokens, batch: Batch, items: float) -> tuple[torch.Tensor, Any]:
        logps, entropy, outputs = self.policy_logps(tokens, batch)
        mask = batch["completion_mask"].to(logps.dtype)
        coef = torch.exp((logps * mask).sum(-1) - batch["old_logps"])
        advantages = batch["advantages"].to(logps.dtype)
        clipped = torch.clamp(coef, 1 - self.epsilon_low, 1 + self.epsilon_high)
        loss = -torch.min(coef * advantages, clipped * advantages).sum()
        flags = clip_flags(coef.detach(), advantages, self.epsilon_low, self.epsilon_high)
        rows = mask.new_tensor(float(mask.shape[0]))
        values = [((entropy.detach() * mask).sum(), mask.sum())] + [(f.sum(), rows) for f in flags]
        self.record_global(values, flags[0], flags[1])
        return loss, outputs
