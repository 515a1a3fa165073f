"""Mixture-of-experts blocks under ZeRO-3, found from the model.

ZeRO-3 gathers a module's parameters when the module runs. An MoE block runs each expert on the
tokens routed to it, so ranks holding different tokens run different experts and ask for different
gathers: the collectives no longer line up and the run hangs. Marked as a leaf, a block is gathered
whole when it is entered, the same on every rank. DeepSpeed's ``zero_optimization.leaf_module``
knows three HF classes by name (Mixtral, Qwen2-MoE, Qwen3-MoE); here a block is recognised by its
shape instead, so a class no list knows (a remote-code model, a new architecture) is marked too.

A block is a module holding a list of two or more experts of one class beside a router: a matrix
(its own or a child's, outside the experts) with one row per expert. HF's fused experts (one 3-D
parameter for all of them, transformers 5) are gathered whole already and need no mark.

ZeRO 1-2 reduce gradients in buckets filled in the order the gradients arrive, and an expert no
token of a rank picked has none there: ranks whose tokens picked different experts reduce buckets
that do not line up (a collective mismatch on gloo, a hang or silently mixed gradients elsewhere).
ZeRO-0 reduces every parameter, zeros for the unused, in one order; ZeRO-3 as above. So such a
model on several data-parallel ranks is refused under ZeRO 1-2, naming the block.
"""

from __future__ import annotations

import torch
from deepspeed.utils import set_z3_leaf_modules

from trainer.config.errors import ConfigError
from trainer.runtime.distributed import print_main
from trainer.runtime.mesh import Mesh


def expert_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that route tokens to a subset of their experts."""
    return [module for module in model.modules() if _experts(module) is not None]


def mark_expert_blocks(model: torch.nn.Module) -> list[str]:
    """Every expert block's class made a ZeRO-3 leaf (all its instances); their names, for the log."""
    classes = list(dict.fromkeys(type(block) for block in expert_blocks(model)))
    if classes:
        set_z3_leaf_modules(model, classes)
    return [f"{c.__module__}.{c.__qualname__}" for c in classes]


def check_expert_blocks(model: torch.nn.Module, stage: int, mesh: Mesh) -> None:
    """Before DeepSpeed builds the engine: ZeRO-3 marks the expert blocks as leaves; ZeRO 1-2 on
    several data-parallel ranks refuse them (see above)."""
    if stage == 3 and (marked := mark_expert_blocks(model)):
        print_main(f"ZeRO-3 gathers each expert block whole (leaf modules): {', '.join(marked)}")
    elif stage in (1, 2) and mesh.data_parallel_size > 1 and (blocks := expert_blocks(model)):
        name = next(n for n, m in model.named_modules() if m is blocks[0])
        raise ConfigError(
            f"{name} ({type(blocks[0]).__name__}) runs a subset of its experts for each rank's tokens, "
            f"and ZeRO-{stage} reduces gradients in the order they arrive, which then differs between "
            "ranks; use zero_stage 0 or 3",
            path="zero_optimization.stage",
        )


def router_of(block: torch.nn.Module) -> torch.nn.Module | None:
    """The child of an expert block that holds its router matrix (whose output is the router's
    logits); None where the block holds that matrix itself."""
    experts = _experts(block)
    for child in block.children():
        if child is not experts and _routes(child, experts, own=True):
            return child
    return None


def _experts(module: torch.nn.Module) -> torch.nn.ModuleList | None:
    """``module``'s list of experts, where it has one and a router for it."""
    for child in module.children():
        if (
            isinstance(child, torch.nn.ModuleList)
            and len(child) >= 2
            and len({type(expert) for expert in child}) == 1
            and _routes(module, child)
        ):
            return child
    return None


def _routes(module: torch.nn.Module, experts: torch.nn.ModuleList, own: bool = False) -> bool:
    """Whether ``module`` holds (``own``: as its own parameter), outside ``experts`` and its
    embeddings (a model whose position table has as many rows as it has layers is no block), a
    matrix with one row per expert."""
    embeddings = (m for m in module.modules() if isinstance(m, torch.nn.Embedding))
    inside = {id(p) for owner in (experts, *embeddings) for p in owner.parameters()}
    return any(
        len(shape := getattr(p, "ds_shape", p.shape)) == 2 and shape[0] == len(experts)
        for p in module.parameters(recurse=not own)
        if id(p) not in inside
    )
