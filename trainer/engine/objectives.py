"""Objectives: what one optimizer step minimises, behind one contract the engines call.

A step's loss is ``sum(loss_sum(mb)) / sum(count(mb))`` over the micro-batches of its accumulation
window on all ranks. An objective says what a micro-batch counts for (``count``, on the host, so
the Trainer's vote can add it up over ranks before any forward) and what its summed loss is
(``loss_sum``, from a forward through DeepSpeed's engine). The engine divides once by the window's
total; the loop never branches on which objective runs. ``count`` counts whole rows; the ranks of a
sequence- or tensor-parallel group read the same rows, and the loop divides the window's total by
the group's size.

The engine hands each objective its per-token service (``Tokens``, the first argument of
``loss_sum`` and ``eval_sum``): the model's forward, and next-token losses and NLL computed as the
run's features require (the head in tiles, rows split over a sequence-parallel group). An objective
is a function over that service or over the model's own output; what a feature cannot do with it,
the objective says once (``check``), before the engine is built.

- ``CausalLM``: next-token cross-entropy summed over target tokens (token-exact over
  micro-batches and ranks), optionally label-smoothed.
- ``ModelLoss``: any HF model's own ``outputs.loss``, with HF Trainer's accumulation semantics:
  where the model's forward takes loss kwargs, ``num_items_in_batch`` (the window's labelled items
  on all ranks) goes to the model and each micro-batch counts its items; otherwise every
  micro-batch's mean loss counts once. A Trainer subclass's ``compute_loss`` runs in place of the
  model's forward under the same rules, as HF's does.

Evaluation asks ``eval_sum``: HF's evaluation loss is the mean of batch losses weighted by their
rows (``eval_per_batch``: each batch's mean counted once, as HF's ``Seq2SeqTrainer`` counts them);
the causal-LM objective keeps its token-weighted mean. A batch without its labels
(``label_names``: predicting on a test set) is forwarded alone and counts for nothing, as HF's
``prediction_step`` reports no loss for it.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed.nn.functional import all_reduce
from transformers.trainer_utils import unwrap_peft_model
from transformers.utils import find_labels

from trainer.config.errors import ConfigError
from trainer.data import IGNORE_INDEX
from trainer.data.collator import input_ids_count, is_causal_lm, non_padding_tokens
from trainer.engine.routers import Balance, Routers
from trainer.engine.tiling import tiled_loss_sum, tiled_token_logps, tiled_token_nll, token_logps
from trainer.runtime.distributed import all_reduce_sum

Batch = dict[str, torch.Tensor]
Forward = Callable[..., Any]  # DeepSpeed's engine (or the bare model): forward(**inputs) -> outputs
# A Trainer subclass's compute_loss, bound: (model, inputs, return_outputs=True, num_items_in_batch=N)
ComputeLoss = Callable[..., Any]
Tiles = tuple[torch.nn.Module, int] | None  # (the output head, tokens per tile): a tiled loss


# ---- the causal-LM loss: a per-token sum, so windows and ranks add up exactly ----------------
# A summed (not averaged) loss lets an engine divide once by the target tokens of the whole window
# on all ranks; the update then equals one big batch however it is split into micro-batches and ranks.


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


class Split(NamedTuple):
    """What a run splits that a loss must know of: rows over a sequence-parallel group, the head's
    logits into tiles, the model into pipeline stages."""

    sequence: bool = False
    tiles: bool = False
    stages: bool = False


SPLIT_FEATURES = (
    ("sequence", "sequence_parallel_size > 1 (each rank holds a slice of every row)"),
    ("tiles", "a tiled loss (never the whole logits at once)"),
    ("stages", "pipeline_parallel_size > 1 (the last stage computes the loss)"),
)


class Tokens:
    """The engine's per-token service, the first argument of an objective's ``loss_sum`` and
    ``eval_sum``: the model's forward (``tokens(**inputs)``, or ``tokens.forward``) and next-token
    losses computed as the run's features require. ``tiles``: from the last hidden states a tile
    at a time, never holding a micro-batch's logits whole (the model's own head computes one
    position); ``sp``: each rank of the sequence-parallel group forwards its slice of every row.
    A plain model is the service without either: ``Tokens(model)``."""

    def __init__(self, forward: Forward, tiles: Tiles = None, sp: Any = None):
        self.forward, self.tiles, self.sp = forward, tiles, sp
        #: What one rank carries of a row that every rank of a sequence-parallel group computes whole
        #: (from NLL gathered over the group): 1/N, so the group's sums count it once.
        self.share = 1.0 / sp.size if sp is not None else 1.0
        #: Whether the model's outputs hold every position's logits (no tiles, no split rows).
        self.whole_logits = tiles is None and sp is None

    def __call__(self, **inputs: Any) -> Any:
        return self.forward(**inputs)

    def next_token_loss(
        self, batch: Batch, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss_sum
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(the summed loss of this rank's next-token targets, those targets, the model's outputs)
        of a causal-LM batch on the device: ``loss(logits, targets)`` over whole logits; tiled, plain
        cross-entropy a tile at a time. Under sequence parallelism, this rank's slice of every row."""
        if self.sp is not None:
            targets, inputs = self.sp.model_inputs(batch)
        else:
            labels, inputs = causal_inputs(batch)
            targets = next_token_targets(labels)
        if self.tiles is not None:
            head, size = self.tiles
            # Through the engine still: ZeRO-3 keeps a step's bookkeeping there (with the decoder
            # called alone, gradients of a tied head were lost).
            outputs = self.forward(**inputs, output_hidden_states=True, logits_to_keep=1)
            return tiled_loss_sum(outputs.hidden_states[-1], head, targets, size), targets, outputs
        outputs = self.forward(**inputs)
        return loss(outputs.logits, targets), targets, outputs

    def row_nll(self, inputs: Batch) -> tuple[torch.Tensor, Any]:
        """(each row's next-token NLL, shape (rows, width - 1), in fp32; the model's outputs), whole
        on every rank: under sequence parallelism each rank forwards its slice of every row and the
        slices' NLL are summed over the group into whole rows (a differentiable all-reduce, whose
        backward sums the ranks' gradients); its outputs are its slice's."""
        width, sp = inputs["input_ids"].shape[1], self.sp
        if sp is None:
            inputs, targets = {**inputs, "use_cache": False}, inputs["input_ids"][:, 1:]
        else:
            targets, inputs = sp.model_inputs({**inputs, "labels": inputs["input_ids"]})
        if self.tiles is not None:
            head, size = self.tiles
            outputs = self.forward(**inputs, output_hidden_states=True, logits_to_keep=1)
            hidden = outputs.hidden_states[-1]
            nll = tiled_token_nll(hidden if sp else hidden[:, :-1], head, targets, size)
        else:
            outputs = self.forward(**inputs)
            logits = outputs.logits if sp else outputs.logits[:, :-1]
            nll = F.cross_entropy(
                logits.float().transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none"
            )
        if sp is not None:
            before = sp.rank * nll.shape[1]
            nll = F.pad(nll, (before, (sp.size - 1 - sp.rank) * nll.shape[1]))
            nll = all_reduce(nll, group=sp.mpu.get_sequence_parallel_group())[:, : width - 1]
        return nll, outputs

    def completion_logps(
        self, inputs: Batch, keep: int, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(the log-probability of each of the last ``keep`` tokens of every row, and the entropy of
        the distribution that predicted it, both shape (rows, keep) in fp32; the model's outputs),
        under the logits divided by ``temperature``: a completion's tokens after its prompt. Only
        those positions' logits are computed: from the head's last ``keep + 1`` positions, or tiled
        from the last hidden states, a tile at a time."""
        targets = inputs["input_ids"][:, -keep:]
        if self.tiles is not None:
            head, size = self.tiles
            outputs = self.forward(**inputs, use_cache=False, output_hidden_states=True, logits_to_keep=1)
            hidden = outputs.hidden_states[-1][:, -keep - 1 : -1]
            both = tiled_token_logps(hidden, head, targets, size, temperature)
        else:
            outputs = self.forward(**inputs, use_cache=False, logits_to_keep=keep + 1)
            both = token_logps(outputs.logits[:, :-1], targets, temperature)
        return both[..., 0], both[..., 1], outputs


def takes(objective: Objective, split: Split) -> bool:
    """Whether ``objective`` runs with what ``split`` splits (its ``check`` refuses nothing)."""
    try:
        objective.check(split)
    except ConfigError:
        return False
    return True


def refused(objective: Any, feature: str) -> ConfigError:
    """One line: ``feature`` computes per-token losses that ``objective`` does not take."""
    model_loss = isinstance(objective, ModelLoss)
    why = " (a model that is not a causal LM, or a Trainer subclass's compute_loss)" if model_loss else ""
    return ConfigError(
        f"{feature} computes the causal-LM loss itself; this run's objective is "
        f"{type(objective).__name__}{why}. Run without that feature.",
        path="compute_loss" if model_loss and objective.compute_loss else "model",
    )


class Objective(ABC):
    """One micro-batch's contribution to its window's loss."""

    #: The batch keys that hold the targets (HF's ``label_names``).
    label_names: tuple[str, ...] = ("labels",)
    #: Evaluation counts each batch's mean loss once, not once per row. HF's ``Seq2SeqTrainer``
    #: gathers its losses with plain ``gather``, which keeps the repeats ``evaluation_loop`` pads a
    #: short last batch's mean to (``losses.repeat(eval_batch_size)``): every batch weighs alike.
    #: HF's ``Trainer`` gathers for metrics, which cuts them to the rows there are.
    eval_per_batch: bool = False

    #: What the objective logs besides the loss (TRL's metric names); ``record_metrics`` adds to them.
    metric_names: tuple[str, ...] = ()

    def record_metrics(self, sums: torch.Tensor, evaluation: bool = False) -> None:
        """Add ``sums`` (each metric's sum over some items, then the item count) to what the
        training steps, or the evaluation, have measured since the last ``metric_means``."""
        buffers = self.__dict__.setdefault("_metric_sums", {})
        held = buffers.get(evaluation)
        buffers[evaluation] = sums.detach() if held is None else held + sums.detach()

    def metric_means(self, device: torch.device, evaluation: bool = False) -> dict[str, float]:
        """The means, over the items of every rank since the last call, of what the objective logs
        besides the loss (a preference objective's rewards), from the training steps or from an
        evaluation; {} where nothing was measured (a loss that does not hold the logits). A
        collective: every rank calls it at each logging step and at the end of each evaluation."""
        if not self.metric_names:
            return {}
        sums = self.__dict__.get("_metric_sums", {}).pop(evaluation, None)
        if sums is None:  # this rank measured nothing since the last call
            sums = torch.zeros(len(self.metric_names) + 1, device=device)
        *totals, items = all_reduce_sum(sums.double()).tolist()
        if not items:
            return {}
        return {name: total / items for name, total in zip(self.metric_names, totals, strict=True)}

    def check(self, split: Split) -> None:
        """Refuse, in one line, what the run splits that this loss cannot take (the engine asks
        before it is built). By default a loss over the model's own output takes none of it."""
        for name, feature in SPLIT_FEATURES:
            if getattr(split, name):
                raise refused(self, feature)

    def route(self, routers: Routers, split: Split) -> None:
        """What the loss does with a mixture-of-experts model's ``routers`` (the engine asks once,
        before it is built). By default nothing: a model's own loss adds its router loss itself."""
        return None

    def eval_rows(self, batch: Batch, indices: list[int]) -> tuple[Batch, list[int]]:
        """(the evaluation batch to forward, the dataset index of each of its rows, -1 for a
        padding row). Ranks run the same number of forwards (ZeRO-3 and the pipeline need it), so a
        shard that ran out forwards padding rows. A loss that is a mean cannot leave rows out, so
        they are cut, and a batch of padding alone forwards one padding row (whose loss the
        evaluation weighs by zero)."""
        real = torch.tensor([i >= 0 for i in indices])
        if bool(real.all()):
            return batch, indices
        if not bool(real.any()):
            return {k: v[:1] if torch.is_tensor(v) else v for k, v in batch.items()}, [-1]
        rows = len(indices)
        cut = {k: v[real] if torch.is_tensor(v) and len(v) == rows else v for k, v in batch.items()}
        return cut, [i for i in indices if i >= 0]

    def batch_mean(self, batch: Batch, outputs: Any, loss: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """An evaluation batch's mean loss on this rank (HF's per-row ``losses``), from its
        ``eval_sum``."""
        return loss.float() / count.float()

    def labelled(self, batch: Batch) -> bool:
        """HF's ``has_labels``: the batch carries every label (none named: no loss to compute)."""
        return bool(self.label_names) and all(batch.get(k) is not None for k in self.label_names)

    @abstractmethod
    def count(self, batch: Batch) -> float:
        """This micro-batch's share of the window's normaliser, from its whole rows on the host."""

    def input_tokens(self, batch: Batch, every_id: bool = False) -> int:
        """The batch's input tokens as HF's ``num_input_tokens_seen`` counts them (and TRL's
        ``num_tokens``): the non-padding ones, or with ``every_id`` every input id, padding too."""
        return int(input_ids_count(batch) if every_id else non_padding_tokens(batch))

    @abstractmethod
    def loss_sum(self, tokens: Tokens, batch: Batch, items: float) -> tuple[torch.Tensor, Any]:
        """(summed loss, model outputs) of a micro-batch on the device. ``items``: the window's
        normaliser on all ranks, which HF-style losses are divided by inside the forward."""

    def eval_sum(self, tokens: Tokens, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(summed loss, its count, model outputs) of one evaluation batch: by default HF's
        weighting, the batch's mean loss counted once per row (once, with ``eval_per_batch``).
        Without labels, the forward alone (a
        ``compute_loss`` override is not called, as HF's) and a zero loss over a zero count."""
        if not self.labelled(batch):
            outputs = tokens(**batch)
            zero = torch.zeros((), device=next(v.device for v in batch.values() if torch.is_tensor(v)))
            return zero, zero, outputs
        # Counted first, and the forward given a copy: a compute_loss override may pop the labels.
        count = float(self.count(batch))
        loss, outputs = self.loss_sum(tokens, dict(batch), count)
        loss = loss / max(count, 1.0)
        weight = torch.tensor(1.0 if self.eval_per_batch else float(batch_rows(batch)), device=loss.device)
        return loss * weight, weight, outputs


class CausalLM(Objective):
    """Summed next-token cross-entropy in fp32; ``label_smoothing`` as ``F.cross_entropy`` applies
    it (HF's label smoother mixes in the same uniform term), still summed over target tokens. A
    mixture-of-experts model adds its routers' load-balancing loss (``trainer.engine.routers``)
    times ``router_aux_loss_coef`` (None: the model config's), in training and in evaluation."""

    def __init__(self, label_smoothing: float = 0.0, router_aux_loss_coef: float | None = None):
        self.label_smoothing = label_smoothing
        self.router_aux_loss_coef = router_aux_loss_coef
        self.balance: Balance | None = None  # set by ``route`` where the run adds the router loss

    def check(self, split: Split) -> None:
        """Every split computes the next-token loss; the tiles' is plain cross-entropy."""
        if split.tiles and self.label_smoothing:
            raise ConfigError(
                "label_smoothing_factor with a tiled loss: the tiles compute plain cross-entropy; set "
                "tiled_loss false or label_smoothing_factor 0",
                path="label_smoothing_factor",
            )

    def count(self, batch: Batch) -> float:
        return float(count_targets(batch))

    def route(self, routers: Routers, split: Split) -> None:
        """The load-balancing loss on, where the model has routers and a coefficient for it."""
        if self.router_aux_loss_coef:  # asked for: the model must have routers to weight
            routers.check("router_aux_loss_coef")
        coefficient = self.router_aux_loss_coef
        coefficient = routers.coefficient if coefficient is None else coefficient
        if not routers or not coefficient:
            return
        routers.check("router_aux_loss_coef")
        if split.sequence or split.stages:
            raise ConfigError(
                "router_aux_loss_coef: the load-balancing loss pools each row's router logits, which "
                "sequence_parallel_size > 1 and pipeline stages split; set router_aux_loss_coef 0",
                path="router_aux_loss_coef",
            )
        self.coefficient, self.balance = float(coefficient), Balance(routers)

    def loss_sum(self, tokens: Tokens, batch: Batch, items: float) -> tuple[torch.Tensor, Any]:
        return self.next_token_loss_sum(tokens, batch)

    def next_token_loss_sum(
        self, tokens: Tokens, batch: Batch, evaluation: bool = False
    ) -> tuple[torch.Tensor, Any]:
        """(the summed next-token loss, with the router loss on its weighted rows' router losses
        added; the model's outputs). ``evaluation``: what the router loss measures goes to the
        evaluation's log."""
        if self.balance is None:
            loss, _, outputs = tokens.next_token_loss(batch, self.token_loss_sum)
            return loss, outputs
        with self.balance.routers.capture() as logits:
            loss, _, outputs = tokens.next_token_loss(batch, self.token_loss_sum)
        return loss + self.coefficient * self.balance.loss_sum(logits, batch, evaluation), outputs

    def metric_means(self, device: torch.device, evaluation: bool = False) -> dict[str, float]:
        """With the router loss, its mean (``aux_loss``) and each layer's expert imbalance."""
        means = super().metric_means(device, evaluation)
        if self.balance is not None:
            means.update(self.balance.means(device, evaluation))
        return means

    def token_loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum of cross-entropy over non-ignored (already shifted) targets, in fp32."""
        return token_loss_sum(logits, targets, self.label_smoothing)

    def eval_sum(self, tokens: Tokens, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The token-weighted loss; with the router loss on, it counts as in training (HF's model
        and TRL's evaluate it with the router loss too)."""
        if self.balance is not None:  # never split over a sequence-parallel group (``route``)
            loss, outputs = self.next_token_loss_sum(tokens, batch, evaluation=True)
            return loss, loss.new_tensor(float(count_targets(batch))), outputs
        loss, targets, outputs = tokens.next_token_loss(batch, self.token_loss_sum)
        return loss, (targets != IGNORE_INDEX).sum().float(), outputs

    def eval_rows(self, batch: Batch, indices: list[int]) -> tuple[Batch, list[int]]:
        """A token-exact loss masks the labels of padding rows, keeping every rank's shapes; a batch
        without labels gets ignored ones (no target: the loss is 0 over 0)."""
        if not self.labelled(batch):
            batch = {**batch, "labels": torch.full_like(batch["input_ids"], IGNORE_INDEX)}
        real = torch.tensor([i >= 0 for i in indices])
        if not bool(real.all()):
            batch = {**batch, "labels": batch["labels"].masked_fill(~real[:, None], IGNORE_INDEX)}
        return batch, indices

    def batch_mean(self, batch: Batch, outputs: Any, loss: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """From the batch's own logits: a pipeline's stages return the loss of the batches pooled
        over them (on the last stage), not their own batch's."""
        labels = batch["labels"].to(outputs["logits"].device)
        loss = self.token_loss_sum(outputs["logits"], next_token_targets(labels))
        return loss.float() / target_count(labels).float()


class ModelLoss(Objective):
    """The model's own loss (or a ``compute_loss`` override's), as HF's Trainer accumulates it.

    ``per_item``: the forward takes loss kwargs (HF's ``model_accepts_loss_kwargs``), so it gets
    ``num_items_in_batch`` and returns a loss already divided by it; multiplied back, micro-batches
    add up to the window's. ``shifted``: the model's loss shifts its labels (a causal LM), so
    position 0 of each row is never counted, as HF counts."""

    def __init__(
        self,
        per_item: bool,
        shifted: bool = False,
        compute_loss: ComputeLoss | None = None,
        label_smoothing: float = 0.0,
    ):
        self.per_item, self.shifted, self.compute_loss = per_item, shifted, compute_loss
        self.label_smoothing = label_smoothing

    def _counts_items(self, batch: Batch) -> bool:
        return self.per_item and "labels" in batch

    def count(self, batch: Batch) -> float:
        if not self._counts_items(batch):
            return 1.0  # the micro-batch's mean counts once
        if "shift_labels" in batch or self.shifted:
            return float(count_targets(batch))
        return float((batch["labels"] != IGNORE_INDEX).sum())

    def loss_sum(self, tokens: Tokens, batch: Batch, items: float) -> tuple[torch.Tensor, Any]:
        per_item, forward = self._counts_items(batch), tokens.forward
        items = max(items, 1.0)  # a window with no labelled item: its loss is 0 either way
        if self.compute_loss is not None:
            loss, outputs = self.compute_loss(
                forward, batch, return_outputs=True, num_items_in_batch=items if per_item else None
            )
        elif self.label_smoothing and "labels" in batch:
            # As HF's label smoother: the model gets no labels and the smoothed loss is taken from
            # its logits, over the window's items (or this micro-batch's, without loss kwargs).
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            outputs = forward(**inputs, **({"num_items_in_batch": items} if per_item else {}))
            labels = batch["labels"]
            logits = outputs["logits"]
            if self.shifted:
                logits, labels = logits[..., :-1, :], labels[..., 1:]
            total, active = smoothed_loss_sum(logits, labels, self.label_smoothing)
            return (total if per_item else total / active.clamp(min=1)), outputs
        else:
            outputs = forward(**batch, **({"num_items_in_batch": items} if per_item else {}))
            loss = _model_loss(outputs, batch)
        return (loss * items if per_item else loss), outputs


def smoothed_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over labelled items of the label-smoothed cross-entropy, the items): each item's loss
    is (1 - epsilon) * its NLL + epsilon * the mean NLL over all classes, as HF's label smoother."""
    logits = logits.float().reshape(-1, logits.size(-1))
    labels = labels.reshape(-1)
    loss = F.cross_entropy(
        logits, labels, ignore_index=IGNORE_INDEX, reduction="sum", label_smoothing=epsilon
    )
    return loss, (labels != IGNORE_INDEX).sum()


def _model_loss(outputs: Any, batch: Batch) -> torch.Tensor:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs[0]
    if loss is None:
        raise ValueError(
            f"the model returned no loss for a batch with keys {sorted(batch)}: give it its labels "
            "(label_names, or a 'label'/'labels' column), or override Trainer.compute_loss"
        )
    return loss


def causal_inputs(batch: Batch) -> tuple[torch.Tensor, Batch]:
    """(labels, model inputs) of a causal-LM batch. Packed rows carry position_ids that restart at
    each document: then the attention mask is left out, so HF models build a block-diagonal mask
    from the positions and documents do not attend to each other. Right padding needs no mask in a
    causal model (no real token looks right), and padded labels are ignored anyway."""
    inputs = dict(batch)
    labels = inputs.pop("labels")
    if "position_ids" in inputs:
        inputs.pop("attention_mask", None)
        inputs["use_cache"] = False
    return labels, inputs


def batch_rows(batch: Batch) -> int:
    """The rows (samples) of a batch: the first dimension of its first tensor."""
    return next(len(v) for v in batch.values() if torch.is_tensor(v) and v.dim() > 0)


def accepts_loss_kwargs(model: torch.nn.Module) -> bool:
    """HF Trainer's test: a model's ``accepts_loss_kwargs``, else whether its forward takes **kwargs."""
    model = unwrap_peft_model(model)
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    params = inspect.signature(model.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


def objective_for(
    model: torch.nn.Module,
    compute_loss: ComputeLoss | None = None,
    label_smoothing: float = 0.0,
    label_names: list[str] | None = None,
    eval_per_batch: bool = False,
    router_aux_loss_coef: float | None = None,
) -> Objective:
    """The objective a Trainer runs for ``model``: token-exact causal LM for a causal LM, the
    model's own loss otherwise, and a ``compute_loss`` override in place of either's forward.
    ``label_names``: HF's argument; by default the label arguments of the model's forward, as HF
    finds them (``labels``; ``start_positions``/``end_positions`` for question answering).
    ``eval_per_batch``: the model's own loss evaluates as HF's ``Seq2SeqTrainer`` (each batch's
    mean once); the causal-LM objective stays token-exact."""
    causal = is_causal_lm(model)
    if compute_loss is None and causal:
        objective: Objective = CausalLM(label_smoothing, router_aux_loss_coef)
    else:
        config = getattr(unwrap_peft_model(model), "config", None)
        if getattr(config, "problem_type", None) == "multi_label_classification":
            label_smoothing = 0.0  # HF's Trainer turns it off there too: labels are not classes
        objective = ModelLoss(accepts_loss_kwargs(model), causal, compute_loss, label_smoothing)
        objective.eval_per_batch = eval_per_batch
    names = label_names if label_names is not None else find_labels(type(unwrap_peft_model(model)))
    objective.label_names = tuple(names)
    return objective
