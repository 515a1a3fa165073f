"""Objectives: what one optimizer step minimises, behind one contract the engines call.

A step's loss is ``sum(loss_sum(mb)) / sum(count(mb))`` over the micro-batches of its accumulation
window on all ranks. An objective says what a micro-batch counts for (``count``, on the host, so
the Trainer's vote can add it up over ranks before any forward) and what its summed loss is
(``loss_sum``, from a forward through DeepSpeed's engine). The engine divides once by the window's
total; the loop never branches on which objective runs.

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
from typing import Any

import torch
import torch.nn.functional as F
from transformers.trainer_utils import unwrap_peft_model
from transformers.utils import find_labels

from trainer.data import IGNORE_INDEX
from trainer.data.collator import is_causal_lm
from trainer.engine.loss import count_targets, next_token_targets, token_loss_sum
from trainer.runtime.distributed import all_reduce_sum

Batch = dict[str, torch.Tensor]
Forward = Callable[..., Any]  # DeepSpeed's engine (or the bare model): forward(**inputs) -> outputs
# A Trainer subclass's compute_loss, bound: (model, inputs, return_outputs=True, num_items_in_batch=N)
ComputeLoss = Callable[..., Any]


class Objective(ABC):
    """One micro-batch's contribution to its window's loss."""

    #: The next-token loss over shifted targets: what the pipeline, sequence parallelism and the
    #: tiled loss compute themselves (they never hold a whole row's logits on one rank).
    token_exact_causal: bool = False
    #: The batch keys that hold the targets (HF's ``label_names``).
    label_names: tuple[str, ...] = ("labels",)
    #: Evaluation counts each batch's mean loss once, not once per row. HF's ``Seq2SeqTrainer``
    #: gathers its losses with plain ``gather``, which keeps the repeats ``evaluation_loop`` pads a
    #: short last batch's mean to (``losses.repeat(eval_batch_size)``): every batch weighs alike.
    #: HF's ``Trainer`` gathers for metrics, which cuts them to the rows there are.
    eval_per_batch: bool = False

    #: The objective weighs each token's NLL itself (a preference loss sums each answer's), so the
    #: engine hands it the pieces long sequences need: ``loss_tiles`` (the head, tokens per tile)
    #: when the run tiles its loss, ``sequence_parallel`` (the group's ``SequenceParallel``) when
    #: sequences are split over ranks. Sequences a row holds: a pair's two.
    per_token_nll: bool = False
    loss_tiles: tuple[torch.nn.Module, int] | None = None
    sequence_parallel: Any = None
    sequences_per_row: int = 1

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

    def labelled(self, batch: Batch) -> bool:
        """HF's ``has_labels``: the batch carries every label (none named: no loss to compute)."""
        return bool(self.label_names) and all(batch.get(k) is not None for k in self.label_names)

    @abstractmethod
    def count(self, batch: Batch) -> float:
        """This micro-batch's share of the window's normaliser, from the batch on the host."""

    @abstractmethod
    def loss_sum(self, forward: Forward, batch: Batch, items: float) -> tuple[torch.Tensor, Any]:
        """(summed loss, model outputs) of a micro-batch on the device. ``items``: the window's
        normaliser on all ranks, which HF-style losses are divided by inside the forward."""

    def eval_sum(self, forward: Forward, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(summed loss, its count, model outputs) of one evaluation batch: by default HF's
        weighting, the batch's mean loss counted once per row (once, with ``eval_per_batch``).
        Without labels, the forward alone (a
        ``compute_loss`` override is not called, as HF's) and a zero loss over a zero count."""
        if not self.labelled(batch):
            outputs = forward(**batch)
            zero = torch.zeros((), device=next(v.device for v in batch.values() if torch.is_tensor(v)))
            return zero, zero, outputs
        # Counted first, and the forward given a copy: a compute_loss override may pop the labels.
        count = float(self.count(batch))
        loss, outputs = self.loss_sum(forward, dict(batch), count)
        loss = loss / max(count, 1.0)
        weight = torch.tensor(1.0 if self.eval_per_batch else float(batch_rows(batch)), device=loss.device)
        return loss * weight, weight, outputs


class CausalLM(Objective):
    """Summed next-token cross-entropy in fp32; ``label_smoothing`` as ``F.cross_entropy`` applies
    it (HF's label smoother mixes in the same uniform term), still summed over target tokens."""

    token_exact_causal = True

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing

    def count(self, batch: Batch) -> float:
        return float(count_targets(batch))

    def loss_sum(self, forward: Forward, batch: Batch, items: float) -> tuple[torch.Tensor, Any]:
        labels, inputs = causal_inputs(batch)
        outputs = forward(**inputs)
        return self.token_loss_sum(outputs.logits, next_token_targets(labels)), outputs

    def token_loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum of cross-entropy over non-ignored (already shifted) targets, in fp32."""
        return token_loss_sum(logits, targets, self.label_smoothing)

    def eval_sum(self, forward: Forward, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        loss, outputs = self.loss_sum(forward, batch, 1.0)
        targets = (batch["labels"][:, 1:] != IGNORE_INDEX).sum().float()
        return loss, targets, outputs


class SFT(CausalLM):
    """TRL's ``SFTTrainer`` loss and metrics: the causal-LM loss (``dft``: each target's NLL weighted
    by its detached probability), and per micro-batch the mean ``entropy`` of the predicted
    distribution and ``mean_token_accuracy`` (the share of targets that are the top prediction)
    over its targets, logged as the mean over micro-batches (evaluation: over batches), as TRL logs
    them. They come from a forward that holds the logits: the tiled loss and sequence parallelism
    log none."""

    metric_names = ("entropy", "mean_token_accuracy")

    def __init__(self, loss_type: str = "nll"):
        super().__init__()
        self.dft = loss_type == "dft"
        self.token_exact_causal = not self.dft  # the tiled, pipelined and SP losses are plain NLL

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

    def loss_sum(self, forward: Forward, batch: Batch, items: float) -> tuple[torch.Tensor, Any]:
        loss, outputs = super().loss_sum(forward, batch, items)
        self.record_metrics(self._token_metrics(outputs.logits, batch))
        return loss, outputs

    def eval_sum(self, forward: Forward, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """TRL's evaluation loss, which is HF's: each batch's token mean, weighted by its rows (HF
        weighs a padding-free batch, flattened into one row, by the rows it was made of)."""
        loss, outputs = super().loss_sum(forward, batch, 1.0)
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

    def loss_sum(self, forward: Forward, batch: Batch, items: float) -> tuple[torch.Tensor, Any]:
        per_item = self._counts_items(batch)
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
) -> Objective:
    """The objective a Trainer runs for ``model``: token-exact causal LM for a causal LM, the
    model's own loss otherwise, and a ``compute_loss`` override in place of either's forward.
    ``label_names``: HF's argument; by default the label arguments of the model's forward, as HF
    finds them (``labels``; ``start_positions``/``end_positions`` for question answering).
    ``eval_per_batch``: the model's own loss evaluates as HF's ``Seq2SeqTrainer`` (each batch's
    mean once); the causal-LM objective stays token-exact."""
    causal = is_causal_lm(model)
    if compute_loss is None and causal:
        objective: Objective = CausalLM(label_smoothing)
    else:
        config = getattr(unwrap_peft_model(model), "config", None)
        if getattr(config, "problem_type", None) == "multi_label_classification":
            label_smoothing = 0.0  # HF's Trainer turns it off there too: labels are not classes
        objective = ModelLoss(accepts_loss_kwargs(model), causal, compute_loss, label_smoothing)
        objective.eval_per_batch = eval_per_batch
    names = label_names if label_names is not None else find_labels(type(unwrap_peft_model(model)))
    objective.label_names = tuple(names)
    return objective
