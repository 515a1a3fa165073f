"""Preference objectives behind the objective contract, with TRL's formulas: DPO against a
reference, and the reference-free ORPO and CPO (whose ``simpo`` loss is SimPO).

A micro-batch holds pairs (``trainer.data.preference``): one forward through the engine scores both
sequences of every pair. A sequence's log-probability is the sum of its answer tokens'
log-probabilities (DPO, CPO's ``sigmoid`` and ``hinge``) or their mean (ORPO, CPO's ``ipo`` and
``simpo``: length-normalised, as TRL computes them). A pair counts once (``count``), so a step's
loss is the mean over the pairs of its window on every rank: TRL's per-batch mean when micro-batches
hold as many pairs, and exact when they do not.

- ``DPO``: with the reference's log-probabilities (``ref_logps``, from the reference pass), each
  pair's implicit reward margin is ``beta * ((chosen - ref_chosen) - (rejected - ref_rejected))``.
  Loss types: ``sigmoid`` (the paper's), ``hinge``, ``ipo`` (on log-ratios averaged over each
  answer's tokens) and ``robust`` (with ``label_smoothing``, the assumed rate of flipped labels).
  Several types add up with their weights.
- ``ORPO``: the chosen sequence's negative log-likelihood (every token after the first, prompt
  included) minus ``beta`` times the log-sigmoid of the log odds ratio of chosen over rejected.
- ``CPO``: a DPO-style loss on the policy's own log-probabilities (no reference), plus ``cpo_alpha``
  times the chosen answers' negative log-likelihood. ``simpo`` subtracts the target margin
  ``simpo_gamma / beta`` first; SimPO proper has ``cpo_alpha = 0``.

The likelihood terms follow TRL: a token mean within each micro-batch (over its chosen sequences),
which every pair of the micro-batch carries. Each objective sums TRL's metrics over the pairs it
trains on (the six reward metrics, and ORPO's and CPO's ``nll_loss``, ORPO's ``log_odds_ratio`` and
``log_odds_chosen``); the Trainer takes their means at each logging step.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
import torch.nn.functional as F

from trainer.args.preference import CPO_LOSS_TYPES, LOSS_TYPES
from trainer.data.preference import REFERENCE_COLUMN
from trainer.engine.objectives import Batch, Objective, Split, Tokens, refused
from trainer.runtime.distributed import all_reduce_sum

REWARD_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
MODEL_KEYS = ("input_ids", "attention_mask")


def token_nll(tokens: Tokens, batch: Batch) -> tuple[torch.Tensor, Any]:
    """(the next-token negative log-likelihood at every position of both sequences of every pair,
    shape (pairs, 2, L - 1), in fp32; the model's outputs), from the engine's per-token service
    (tiled, split over a sequence-parallel group, as the run is). A padding-free batch forwards
    its one row, and each sequence's NLL is read from it (``token_index``)."""
    pairs, _, length = batch["completion_mask"].shape
    index = batch.get("token_index")
    if index is None:
        inputs = {k: batch[k].reshape(2 * pairs, length) for k in MODEL_KEYS}
    else:
        inputs = {k: batch[k] for k in ("input_ids", "position_ids")}
    nll, outputs = tokens.row_nll(inputs)
    if index is not None:
        # Position j predicts token j + 1 of the same sequence; where j is a sequence's last token
        # (or past it, -1) the value is the appended 0, or the next sequence's first token's NLL,
        # which the shifted masks never select.
        nll = torch.cat([nll.reshape(-1), nll.new_zeros(1)])[index[..., :-1]]
    return nll.view(pairs, 2, length - 1), outputs


def half_logps(tokens: Tokens, batch: Batch, half: int) -> tuple[torch.Tensor, Any]:
    """(each row's summed answer log-probability for one sequence of its pair, shape (rows,); the
    model's outputs), from a forward of those sequences alone, padded to their own longest."""
    width = int(batch["attention_mask"][:, half].sum(dim=1).max())
    nll, outputs = tokens.row_nll({k: batch[k][:, half, :width] for k in MODEL_KEYS})
    return -(nll * batch["completion_mask"][:, half, 1:width]).sum(dim=1), outputs


def answer_mask(batch: Batch) -> torch.Tensor:
    """Which shifted targets are answer tokens, shape (pairs, 2, L - 1)."""
    return batch["completion_mask"][..., 1:]


def sequence_logps(tokens: Tokens, batch: Batch) -> tuple[torch.Tensor, Any]:
    """(summed answer-token log-probabilities of shape (pairs, 2), the model's outputs)."""
    nll, outputs = token_nll(tokens, batch)
    return -(nll * answer_mask(batch)).sum(dim=2), outputs


def mean_logps(nll: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Log-probabilities averaged over the tokens ``mask`` selects, shape (pairs, 2)."""
    return -(nll * mask).sum(dim=2) / mask.sum(dim=2).clamp(min=1)


def chosen_nll(nll: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The micro-batch's token mean of the chosen sequences' NLL over ``mask``'s tokens (a scalar)."""
    return (nll[:, 0] * mask[:, 0]).sum() / mask[:, 0].sum().clamp(min=1)


def reward_rows(rewards: torch.Tensor, logps: torch.Tensor) -> list[torch.Tensor]:
    """TRL's six reward metrics, one value per pair each, from (pairs, 2) rewards and log-probs."""
    margins = rewards[:, 0] - rewards[:, 1]
    return [rewards[:, 0], rewards[:, 1], (margins > 0).to(rewards), margins, logps[:, 0], logps[:, 1]]


def sigmoid_loss(logits: torch.Tensor, beta: float, smoothing: float) -> torch.Tensor:
    """The Bradley-Terry loss, conservative under a rate ``smoothing`` of flipped labels."""
    return -F.logsigmoid(beta * logits) * (1 - smoothing) - F.logsigmoid(-beta * logits) * smoothing


class PairObjective(Objective):
    """A loss per pair from one forward over both sequences. Its metrics are TRL's: each measured over
    the global micro-batch (every rank's pairs) and logged as the mean over the micro-batches that
    measured it. Those that read the whole logits (``logit_sums``: the logits' mean, entropy and
    top-1 accuracy over the answers) are not measured with the tiled loss, sequence parallelism or
    padding-free batches: no rank holds them."""

    label_names = ("completion_mask",)  # every pair batch has one: the loss needs no other labels
    metric_names: tuple[str, ...] = REWARD_METRICS

    @classmethod
    @abstractmethod
    def from_args(cls, args: Any) -> PairObjective:
        """The loss its arguments (a TRL config) describe."""

    @abstractmethod
    def pair_terms(self, batch: Batch, nll: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(each pair's loss, each metric's value per pair) from the per-token NLL."""

    def check(self, split: Split) -> None:
        """Per-token NLL comes tiled and from split rows; no pipeline stage holds both sequences."""
        if split.stages:
            raise refused(self, "pipeline_parallel_size > 1 (the last stage computes the loss)")

    def reference_logps(self, tokens: Tokens, batch: Batch) -> torch.Tensor:
        """What the reference stage records of a batch under the reference: each sequence's summed
        answer log-probability, shape (rows, 2), from one forward of both."""
        return sequence_logps(tokens, batch)[0]

    def count(self, batch: Batch) -> float:
        return float(batch["completion_mask"].shape[0])

    # Every rank of a sequence-parallel group computes the same pairs' losses (from NLL gathered over
    # the group), so each carries ``tokens.share`` of them and the group's sums count a pair once.

    def loss_sum(self, tokens: Tokens, batch: Batch, items: float) -> tuple[torch.Tensor, Any]:
        loss, outputs = self._pairs(tokens, batch, evaluation=False)
        return loss.sum() * tokens.share, outputs

    def eval_sum(self, tokens: Tokens, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        loss, outputs = self._pairs(tokens, batch, evaluation=True)
        return loss.sum() * tokens.share, loss.new_tensor(len(loss) * tokens.share), outputs

    def _pairs(self, tokens: Tokens, batch: Batch, evaluation: bool) -> tuple[torch.Tensor, Any]:
        """(each pair's loss, the model's outputs); the micro-batch's metrics are recorded."""
        nll, outputs = token_nll(tokens, batch)
        loss, metrics = self.pair_terms(batch, nll)
        pairs = nll.new_tensor(float(len(loss)))
        sums = [(m.detach().float().sum(), pairs) for m in metrics]
        sums += self.logit_sums(batch, outputs, tokens)
        self.record_global(torch.stack([x for pair in sums for x in pair]), evaluation, tokens.share)
        return loss, outputs

    def logit_sums(
        self, batch: Batch, outputs: Any, tokens: Tokens
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(sum, count) over this rank's pairs of each metric after the pair metrics that reads
        the whole logits; zero counts where they are not whole."""
        return []

    def whole_logits(self, batch: Batch, outputs: Any, tokens: Tokens) -> torch.Tensor | None:
        """The logits of both sequences of every pair, shape (pairs, 2, L, vocab), where this rank
        holds them whole (padded batches, untiled, no sequence split); else None."""
        logits = getattr(outputs, "logits", None)
        if logits is None or not tokens.whole_logits:
            return None
        if "token_index" in batch:  # padding-free: one packed row
            return None
        return logits.view(*batch["completion_mask"].shape, -1)

    def record_global(self, sums: torch.Tensor, evaluation: bool, share: float) -> None:
        """Record one micro-batch's metrics from this rank's (sum, count) per metric, interleaved:
        summed over every rank (a collective: every rank records each micro-batch; ``share``: this
        rank's part of its pairs), each becomes its mean over the global micro-batch, or is not
        measured where its count is 0."""
        totals = all_reduce_sum(sums.detach().double() * share).view(-1, 2)
        present = (totals[:, 1] > 0).double()
        self.record_values(totals[:, 0] / totals[:, 1].clamp(min=1e-30) * present, present, evaluation)

    def record_values(self, values: torch.Tensor, present: torch.Tensor, evaluation: bool) -> None:
        """One micro-batch's value of each metric, the same on every rank, and whether it was
        measured; each rank keeps its share, so that the logging step's sum over ranks restores them."""
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.record_metrics(torch.stack([values, present], dim=1).reshape(-1) / world, evaluation)

    def metric_means(self, device: torch.device, evaluation: bool = False) -> dict[str, float]:
        """Each metric's mean over the micro-batches that measured it since the last call."""
        sums = self.__dict__.get("_metric_sums", {}).pop(evaluation, None)
        if sums is None:
            sums = torch.zeros(2 * len(self.metric_names), device=device)
        totals = all_reduce_sum(sums.double()).tolist()
        return {
            name: totals[2 * i] / totals[2 * i + 1]
            for i, name in enumerate(self.metric_names)
            if totals[2 * i + 1] > 0.5
        }


class DPO(PairObjective):
    """TRL's DPO losses over a pair's log-ratios against the reference."""

    label_names = (REFERENCE_COLUMN,)  # a batch without the reference's log-probs has no loss
    metric_names = (*REWARD_METRICS, "entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy")

    def logit_sums(
        self, batch: Batch, outputs: Any, tokens: Tokens
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """TRL's DPO: the predicted distribution's entropy over both answers' targets, the mean logit
        (over the vocabulary) over each answer's targets, and the chosen answers' top-1 accuracy."""
        logits, zero = self.whole_logits(batch, outputs, tokens), outputs.logits.new_zeros(())
        if logits is None:
            return [(zero, zero)] * 4
        with torch.no_grad():
            targets, mask = batch["input_ids"][..., 1:], answer_mask(batch).to(torch.float32)
            logits = logits[:, :, :-1].float()
            logp = logits.log_softmax(-1)
            entropy = -(logp.exp() * logp).sum(-1)
            mean_logit = logits.mean(-1)
            top1 = (logits.argmax(-1) == targets).to(torch.float32)
        chosen, rejected = mask[:, 0], mask[:, 1]
        return [
            ((entropy * mask).sum(), mask.sum()),
            ((mean_logit[:, 0] * chosen).sum(), chosen.sum()),
            ((mean_logit[:, 1] * rejected).sum(), rejected.sum()),
            ((top1[:, 0] * chosen).sum(), chosen.sum()),
        ]

    def __init__(
        self,
        beta: float = 0.1,
        loss_types: tuple[str, ...] = ("sigmoid",),
        loss_weights: tuple[float, ...] | None = None,
        label_smoothing: float = 0.0,
    ):
        super().__init__()
        unknown = [t for t in loss_types if t not in LOSS_TYPES]
        if unknown:
            raise ValueError(f"loss_type: {', '.join(unknown)} is not one of {', '.join(LOSS_TYPES)}")
        self.beta, self.loss_types, self.label_smoothing = beta, tuple(loss_types), label_smoothing
        self.loss_weights = tuple(loss_weights) if loss_weights is not None else (1.0,) * len(loss_types)

    @classmethod
    def from_args(cls, args: Any) -> DPO:
        return cls(args.beta, tuple(args.loss_type), args.loss_weights, args.label_smoothing)

    def pair_terms(self, batch: Batch, nll: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        logps = -(nll * answer_mask(batch)).sum(dim=2)
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
        return loss, reward_rows(beta * ratios, logps)


class ORPO(PairObjective):
    """Odds-ratio preference optimisation: supervised NLL plus ``beta`` times the odds-ratio term."""

    metric_names = (
        *REWARD_METRICS,
        "nll_loss",
        "log_odds_ratio",
        "log_odds_chosen",
        "logits/chosen",
        "logits/rejected",
    )

    def logit_sums(
        self, batch: Batch, outputs: Any, tokens: Tokens
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return whole_mean_logits(self.whole_logits(batch, outputs, tokens), outputs, last=False)

    def __init__(self, beta: float = 0.1):
        super().__init__()
        self.beta = beta

    @classmethod
    def from_args(cls, args: Any) -> ORPO:
        return cls(args.beta)

    def pair_terms(self, batch: Batch, nll: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        logps = mean_logps(nll, answer_mask(batch))
        log_odds = (logps[:, 0] - logps[:, 1]) - (log1mexp(logps[:, 0]) - log1mexp(logps[:, 1]))
        ratio = F.logsigmoid(log_odds)
        sft = chosen_nll(nll, batch["attention_mask"][..., 1:])  # the prompt's tokens too, as TRL's
        loss = sft - self.beta * ratio
        return loss, [*reward_rows(self.beta * logps, logps), sft.expand_as(ratio), ratio, log_odds]


class CPO(PairObjective):
    """Contrastive preference optimisation; its ``simpo`` loss type is SimPO."""

    metric_names = (*REWARD_METRICS, "nll_loss", "logits/chosen", "logits/rejected")

    def logit_sums(
        self, batch: Batch, outputs: Any, tokens: Tokens
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return whole_mean_logits(self.whole_logits(batch, outputs, tokens), outputs, last=True)

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        cpo_alpha: float = 1.0,
        simpo_gamma: float = 0.5,
        label_smoothing: float = 0.0,
    ):
        super().__init__()
        if loss_type not in CPO_LOSS_TYPES:
            raise ValueError(f"loss_type: {loss_type} is not one of {', '.join(CPO_LOSS_TYPES)}")
        self.beta, self.loss_type, self.cpo_alpha = beta, loss_type, cpo_alpha
        self.simpo_gamma, self.label_smoothing = simpo_gamma, label_smoothing

    @classmethod
    def from_args(cls, args: Any) -> CPO:
        return cls(args.beta, args.loss_type, args.cpo_alpha, args.simpo_gamma, args.label_smoothing)

    def pair_terms(self, batch: Batch, nll: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        answers = answer_mask(batch)
        if self.loss_type in ("ipo", "simpo"):
            logps = mean_logps(nll, answers)
        else:
            logps = -(nll * answers).sum(dim=2)
        logits, beta = logps[:, 0] - logps[:, 1], self.beta
        if self.loss_type == "simpo":
            loss = sigmoid_loss(logits - self.simpo_gamma / beta, beta, self.label_smoothing)
        elif self.loss_type == "sigmoid":
            loss = sigmoid_loss(logits, beta, self.label_smoothing)
        elif self.loss_type == "hinge":
            loss = torch.relu(1 - beta * logits)
        else:  # ipo
            loss = (logits - 1 / (2 * beta)) ** 2
        sft = chosen_nll(nll, answers) if self.cpo_alpha else logits.new_zeros(())
        loss = loss + self.cpo_alpha * sft
        return loss, [*reward_rows(beta * logps, logps), sft.expand_as(logits)]


def whole_mean_logits(
    logits: torch.Tensor | None, outputs: Any, last: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """TRL's ORPO and CPO ``logits/chosen`` and ``logits/rejected``: the mean of each answer's
    sequences' logits over their positions (prompt and padding included; the last one too where
    ``last``, as CPO's) and the vocabulary, as (sum, count); zero counts where they are not whole."""
    if logits is None:
        zero = outputs.logits.new_zeros(())
        return [(zero, zero)] * 2
    with torch.no_grad():
        halves = (logits if last else logits[:, :, :-1]).float()
        return [(halves[:, i].sum(), halves.new_tensor(float(halves[:, i].numel()))) for i in (0, 1)]


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


KTO_METRICS = (
    "kl",
    "entropy",
    "logits/chosen",
    "logits/rejected",
    "rewards/chosen",
    "logps/chosen",
    "rewards/rejected",
    "logps/rejected",
    "rewards/margins",
)


class KTO(PairObjective):
    """TRL's KTO over labelled completions. A row is two sequences: the prompt with its completion,
    and the prompt with a neighbour's completion (its KL partner); ``label`` says whether the
    completion is desirable. Each completion's log-ratio ``r`` to the reference is weighed against
    the KL estimate: the mean log-ratio of the KL partners over the global micro-batch (every rank's,
    as TRL gathers it over processes; clamped at 0, never differentiated). ``kto``: a desirable
    completion's loss is ``1 - sigmoid(beta (r - kl))``, an undesirable one's ``1 - sigmoid(beta
    (kl - r))``; ``apo_zero_unpaired``: ``1 - sigmoid(beta r)`` and ``sigmoid(beta r)``, no KL. Each
    is weighted by ``desirable_weight`` or ``undesirable_weight`` and counts once, so a step's loss
    is TRL's mean over its rows.

    The metrics are TRL's: each is measured over the global micro-batch and logged as the mean over
    the micro-batches that had it (a micro-batch with no desirable row has no ``rewards/chosen``).
    ``entropy`` and ``logits/*`` need the whole logits: the tiled loss and sequence parallelism log
    none."""

    label_names = (REFERENCE_COLUMN,)
    metric_names = KTO_METRICS

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str = "kto",
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
    ):
        super().__init__()
        self.beta, self.loss_type = beta, loss_type
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight

    @classmethod
    def from_args(cls, args: Any) -> KTO:
        return cls(args.beta, args.loss_type, args.desirable_weight, args.undesirable_weight)

    def input_tokens(self, batch: Batch, every_id: bool = False) -> int:
        """The completions' sequences alone, as TRL and HF count them: the KL partners' are not."""
        mask = batch["attention_mask"][:, 0]
        return mask.numel() if every_id else int(mask.sum())

    def pair_terms(self, batch: Batch, nll: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        raise NotImplementedError("KTO weighs its rows over the global micro-batch (_pairs)")

    def _pairs(self, tokens: Tokens, batch: Batch, evaluation: bool) -> tuple[torch.Tensor, Any]:
        # As TRL's: the KL partners in a forward of their own, without gradients (the estimate is
        # never differentiated), then the completions; each padded to its own longest sequence.
        with torch.no_grad():
            partners, _ = half_logps(tokens, batch, 1)
        completions, outputs = half_logps(tokens, batch, 0)
        logps = torch.stack([completions, partners], dim=1)  # (rows, 2)
        ratios = logps - batch[REFERENCE_COLUMN].to(logps)
        chosen = batch["label"].to(device=logps.device, dtype=torch.bool)
        r, beta = ratios[:, 0], self.beta
        stats = self._global_stats(batch, outputs, logps, ratios, chosen, tokens)
        kl = stats[0] / stats[1].clamp(min=1)
        kl = kl.clamp(min=0) if self.loss_type == "kto" else torch.zeros_like(kl)
        if self.loss_type == "kto":
            desirable, undesirable = 1 - torch.sigmoid(beta * (r - kl)), 1 - torch.sigmoid(beta * (kl - r))
        else:
            desirable, undesirable = 1 - torch.sigmoid(beta * r), torch.sigmoid(beta * r)
        loss = torch.where(chosen, self.desirable_weight * desirable, self.undesirable_weight * undesirable)
        self.record_values(*_kto_metric_values(stats, kl), evaluation)
        return loss, outputs

    def reference_logps(self, tokens: Tokens, batch: Batch) -> torch.Tensor:
        """As TRL scores them: the KL partners in a forward of their own, then the completions."""
        partners = half_logps(tokens, batch, 1)[0]
        return torch.stack([half_logps(tokens, batch, 0)[0], partners], dim=1)

    def _global_stats(
        self,
        batch: Batch,
        outputs: Any,
        logps: torch.Tensor,
        ratios: torch.Tensor,
        chosen: torch.Tensor,
        tokens: Tokens,
    ) -> torch.Tensor:
        """The micro-batch's sums over every rank (detached, float64): [KL log-ratio sum, rows,
        entropy sum and its tokens, the chosen and the rejected rows' mean-logit sums and tokens,
        then for chosen and for rejected rows: reward sum, rows, logp sum]."""
        desirable = chosen.to(logps.dtype)
        undesirable = 1 - desirable
        entropy, mean_logit, targets = self._token_sums(batch, outputs, logps, tokens.whole_logits)
        rewards = self.beta * ratios[:, 0]
        sums = [ratios[:, 1].sum(), logps.new_tensor(float(len(logps))), entropy.sum(), targets.sum()]
        for rows in (desirable, undesirable):
            sums += [(mean_logit * rows).sum(), (targets * rows).sum()]
        for rows in (desirable, undesirable):
            sums += [(rewards * rows).sum(), rows.sum(), (logps[:, 0] * rows).sum()]
        return all_reduce_sum(torch.stack(sums).detach().double() * tokens.share)

    @torch.no_grad()
    def _token_sums(
        self, batch: Batch, outputs: Any, logps: torch.Tensor, whole: bool
    ) -> tuple[torch.Tensor, ...]:
        """Per row, over its completion's targets: the predicted distribution's entropy summed, the
        mean logit (over the vocabulary) summed, and the targets counted; zeros where the logits are
        not ``whole`` (tiled, or split over a sequence-parallel group)."""
        logits = getattr(outputs, "logits", None)
        if logits is None or not whole:
            zeros = logps.new_zeros(len(logps))
            return zeros, zeros, zeros
        main = logits[:, :-1].float()
        tokens = batch["completion_mask"][:, 0, 1 : main.shape[1] + 1].to(logps.dtype)
        logp = main.log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return (entropy * tokens).sum(-1), (main.mean(-1) * tokens).sum(-1), tokens.sum(-1)


def _kto_metric_values(stats: torch.Tensor, kl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, measured or not) of each KTO metric for one global micro-batch, from its sums."""

    def mean(total: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        present = (count > 0).double()
        return total / count.clamp(min=1) * present, present

    chosen, rejected = mean(stats[8], stats[9]), mean(stats[11], stats[12])
    both = chosen[1] * rejected[1]
    pairs = [
        (kl.double(), torch.ones_like(both)),
        mean(stats[2], stats[3]),
        mean(stats[4], stats[5]),
        mean(stats[6], stats[7]),
        chosen,
        mean(stats[10], stats[9]),
        rejected,
        mean(stats[13], stats[12]),
        ((chosen[0] - rejected[0]) * both, both),
    ]
    return torch.stack([v for v, _ in pairs]), torch.stack([p for _, p in pairs])
