"""The routers of a mixture-of-experts model, and the load-balancing loss over their logits.

**Which modules route.** An HF MoE model names its router class where it records
``router_logits`` (``_can_record_outputs``, with the index of the logits in the router's output);
a model no recorder knows (remote code, a new architecture) has its routers found from its
expert blocks (``trainer.engine.experts``): the child that holds the matrix with one row per
expert. ``Routers`` hooks each router once and, while armed (``capture``), keeps what it returns:
one ``[tokens, experts]`` tensor of logits per MoE layer of a forward. A recomputation in backward
(activation checkpointing) runs with the hooks disarmed.

**The loss** is the Switch Transformer's, as HF's ``load_balancing_loss_func`` computes it:
``experts * sum_e f_e * P_e``, where ``f_e`` is the share of top-k picks that went to expert ``e``
(a count, no gradient) and ``P_e`` the mean router probability of ``e``, both pooled over the
layers and the tokens that are not padding. The probabilities come from one softmax of the logits.

HF pools a micro-batch's tokens. That value depends on how a batch is cut into micro-batches and
ranks, and no split of one pass can give the gradient of a window-wide pool (``f`` of later
micro-batches is unknown when earlier ones run backward). Here each row pools its own tokens: a
row's loss depends on that row alone, so summed over rows, each weighted by its target tokens, it
adds up over micro-batches and ranks exactly as the next-token loss does, and the engine's one
division gives the token-weighted mean over the window, however it is split. A micro-batch of one
row gets HF's value.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
from transformers.trainer_utils import unwrap_peft_model

from trainer.config.errors import ConfigError
from trainer.data import IGNORE_INDEX
from trainer.engine.experts import expert_blocks, router_of
from trainer.runtime.distributed import all_reduce_sum


class Routers:
    """The routers of a model, hooked: ``capture()`` yields the logits of each of them in a forward.
    ``Routers.of(model)``: one per model, so engines built again over it do not hook it twice. The
    hooks go on at the first capture, into the model as the engine left it: expert parallelism
    (``trainer.engine.expert_parallel``) replaces the blocks, routers included, when it is built."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> Routers:
        model = unwrap_peft_model(model)
        if not isinstance(found := model.__dict__.get("_trainer_routers"), cls):
            found = model.__dict__["_trainer_routers"] = cls(model)
        return found

    def __init__(self, model: torch.nn.Module):
        # Weakly: the model holds this object, and a cycle would keep a dropped model (and, under
        # ZeRO-3, its registration with transformers) alive until a garbage collection.
        self._model = weakref.ref(model)
        self.modules, _, owners = _routers(model)
        self.experts = _experts_of(self.modules[0]) if self.modules else 0
        config = getattr(model, "config", None)
        get = getattr(config, "get_text_config", None)
        config = get() if get is not None else config
        #: The model's own coefficient of the loss (HF's ``router_aux_loss_coef``); None: it names none.
        self.coefficient: float | None = getattr(config, "router_aux_loss_coef", None)
        self.top_k = _top_k(owners, config)
        self._armed: list[torch.Tensor] | None = None
        self._hooked: list[torch.nn.Module] = []

    def __bool__(self) -> bool:
        return bool(self.modules)

    def _keep(self, index: int) -> Any:
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            if self._armed is not None:
                self._armed.append(output[index] if isinstance(output, (tuple, list)) else output)

        return hook

    @contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Within the block, each router's logits of the forwards run, in order."""
        if not self._hooked:
            self._hooked, index, _ = _routers(self._model())
            for module in self._hooked:
                module.register_forward_hook(self._keep(index))
        self._armed = taken = []
        try:
            yield taken
        finally:
            self._armed = None

    def check(self, name: str) -> None:
        """Refuse, naming ``name`` (the argument that asked for the loss), a model whose routers'
        top-k is nowhere to be read."""
        if not self.modules:
            raise ConfigError(
                f"{name}: the model has no mixture-of-experts router, so there is no load-balancing "
                "loss to weight",
                path=name,
            )
        if self.top_k is None:
            raise ConfigError(
                f"{name}: the experts each token picks in {type(self.modules[0]).__name__} are not "
                "named (no top_k on the router or its block, no num_experts_per_tok in the config)",
                path=name,
            )


class Balance:
    """The load-balancing loss of a micro-batch (``loss_sum``), and what was measured for the log
    since the last logging step: the loss's weighted sum and weight, and the tokens each expert of
    each layer received."""

    def __init__(self, routers: Routers):
        self.routers = routers
        self.layers, self.experts, self.top_k = len(routers.modules), routers.experts, routers.top_k
        self._sums: dict[bool, torch.Tensor] = {}  # by evaluation (True) or training (False)

    def loss_sum(
        self, logits: list[torch.Tensor], batch: dict[str, torch.Tensor], evaluation: bool = False
    ) -> torch.Tensor:
        """Each row's loss (see the module's note) times its target tokens, summed over rows;
        measured for the training's log, or the evaluation's."""
        loss, weights, load = row_balance(logits, batch, self.top_k)
        weighted = (loss * weights).sum()
        measured = torch.cat([torch.stack([weighted.detach(), weights.sum()]), load.flatten()])
        held = self._sums.get(evaluation)
        self._sums[evaluation] = measured if held is None else held + measured
        return weighted

    def means(self, device: torch.device, evaluation: bool = False) -> dict[str, float]:
        """``aux_loss``, the target-weighted mean of the rows' losses, and per layer the expert
        imbalance: the busiest expert's tokens over the mean expert's (1: balanced; ``experts /
        top_k``: every pick on the same experts); over every rank since the last call, of the
        training steps or of an evaluation. A collective."""
        sums = self._sums.pop(evaluation, None)
        if sums is None:
            sums = torch.zeros(2 + self.layers * self.experts, device=device)
        total, weight, *load = all_reduce_sum(sums.double()).tolist()
        if not weight:
            return {}
        logs = {"aux_loss": total / weight}
        for layer in range(self.layers):
            counts = load[layer * self.experts : (layer + 1) * self.experts]
            mean = sum(counts) / self.experts
            logs[f"expert_imbalance/{layer}"] = max(counts) / mean if mean else 1.0
        return logs


def row_balance(
    logits: list[torch.Tensor], batch: dict[str, torch.Tensor], top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each row's load-balancing loss, each row's target tokens, each layer's tokens per expert
    without gradient) of a causal-LM micro-batch, from each MoE layer's router logits."""
    rows, width = batch["input_ids"].shape
    mask = batch.get("attention_mask")
    mask = (
        torch.ones(rows, width, device=logits[0].device)
        if mask is None
        else mask.to(logits[0].device).float()
    )
    picks = probs = 0.0
    load = []
    for layer in logits:
        p = layer.float().reshape(rows, width, -1).softmax(-1)
        chosen = torch.zeros_like(p).scatter_(-1, p.topk(top_k, dim=-1).indices, 1.0) * mask[..., None]
        picks = picks + chosen.sum(1)
        probs = probs + (p * mask[..., None]).sum(1)
        load.append(chosen.sum((0, 1)))
    pooled = (mask.sum(1) * len(logits)).clamp(min=1.0)[:, None]  # each row's tokens over all layers
    loss = p.shape[-1] * ((picks / pooled) * (probs / pooled)).sum(-1)
    targets = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(1).to(loss.dtype)
    return loss, targets, torch.stack(load).detach()


def _routers(model: torch.nn.Module) -> tuple[list[torch.nn.Module], int, list[Any]]:
    """(the model's routers in forward order, the index of the logits in their output, where to
    read the experts each token picks: the routers, or the blocks that hold them). AutoEP's blocks
    keep the router's matrix as a linear layer, ``router.gate``, whose output is the logits."""
    replaced = [m for m in model.modules() if isinstance(m, AutoEPMoELayer)]
    if replaced:
        return [layer.router.gate for layer in replaced], 0, replaced
    for module in model.modules():
        recorded = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        if recorded is not None:
            target = getattr(recorded, "target_class", recorded)
            found = [m for m in model.modules() if isinstance(m, target)]
            if found:
                return found, int(getattr(recorded, "index", 0) or 0), found
    blocks = expert_blocks(model)
    routers = [router_of(block) for block in blocks]
    return ([], 0, []) if None in routers else (routers, 0, [*routers, *blocks])


def _experts_of(router: torch.nn.Module) -> int:
    named = getattr(router, "num_experts", None)
    if named:
        return int(named)
    weight = next(p for p in router.parameters() if p.dim() == 2 or len(getattr(p, "ds_shape", ())) == 2)
    return int(getattr(weight, "ds_shape", weight.shape)[0])


def _top_k(owners: list[Any], config: Any) -> int | None:
    for source in (*owners, config):
        for name in ("top_k", "num_experts_per_tok"):
            if isinstance(value := getattr(source, name, None), int):
                return value
    return None
