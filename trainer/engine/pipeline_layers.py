"""An HF causal LM as DeepSpeed pipeline layers, and its stages gathered back for the export.

``pipeline_layers`` turns a Llama or GPT-2 model (built by ``trainer.model.modeling.build_model`` or
``from_pretrained``) into a list of layer specs: token embedding, (GPT-2: position embedding), one
spec per decoder block, final norm, LM head. Each layer wraps the HF submodule itself, so no weight
is copied and every layer knows its HF name for the export. With tied embeddings the embedding and
the head are one ``TiedLayerSpec``: the first and last stages each hold it and DeepSpeed sums its
gradient over them. Between stages travel ``(hidden_states, position_ids)``. No attention mask
travels: rows are right-padded and attention is causal, so padding never reaches a real token;
packed rows restart ``position_ids`` at each document, and every block rebuilds the block-diagonal
mask from them exactly as the HF model does when the engine leaves the mask out.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn
from transformers.masking_utils import create_causal_mask

SUPPORTED = ("llama", "gpt2")
# Only decoder blocks are checkpointed: DeepSpeed's (reentrant) checkpoint needs an input that
# requires grad, which the token ids entering the embedding never do.
CHECKPOINTABLE = ["DecoderBlockPipe"]


# ---- the model as pipeline layers ----------------------------------------------------------------


class HFPart(nn.Module):
    """A pipeline layer around one submodule of the HF model (``inner``), named ``hf_name`` there."""

    def __init__(self, inner: nn.Module, hf_name: str):
        super().__init__()
        self.inner = inner
        self.hf_name = hf_name

    def hf_state(self) -> dict[str, torch.Tensor]:
        return {f"{self.hf_name}.{k}": v.detach().cpu() for k, v in self.inner.state_dict().items()}


class TokenEmbeddingPipe(HFPart):
    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, position_ids = inputs
        return self.inner(input_ids), position_ids


class PositionEmbeddingPipe(HFPart):
    """GPT-2's learned positions, then its embedding dropout."""

    def __init__(self, inner: nn.Module, hf_name: str, dropout: nn.Module):
        super().__init__(inner, hf_name)
        self.dropout = dropout

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, position_ids = inputs
        return self.dropout(hidden + self.inner(position_ids)), position_ids


class DecoderBlockPipe(HFPart):
    """One HF decoder block. The mask and (Llama) rotary embeddings are rebuilt from position_ids
    in every block: they are cheap, and sending them would make the pipeline carry floats that
    need no gradient."""

    def __init__(self, inner: nn.Module, hf_name: str, config: Any, rotary: nn.Module | None = None):
        super().__init__(inner, hf_name)
        self.config = config
        self.rotary = rotary

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, position_ids = inputs
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=None,
            cache=None,
            position_ids=position_ids,
        )
        extra = {} if self.rotary is None else {"position_embeddings": self.rotary(hidden, position_ids)}
        return self.inner(hidden, attention_mask=mask, position_ids=position_ids, **extra), position_ids


class FinalNormPipe(HFPart):
    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.inner(inputs[0])


class LMHeadPipe(HFPart):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner(hidden)


def tied_lm_head(embedding: TokenEmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """The head of a tied model: logits against the (shared) token embedding matrix."""
    return F.linear(hidden, embedding.inner.weight)


def _parts(model: nn.Module) -> dict[str, Any]:
    kind = getattr(model.config, "model_type", None)
    if kind == "llama":
        base = model.model
        return dict(embed=base.embed_tokens, blocks=base.layers, norm=base.norm, rotary=base.rotary_emb)
    if kind == "gpt2":
        base = model.transformer
        return dict(embed=base.wte, positions=base.wpe, dropout=base.drop, blocks=base.h, norm=base.ln_f)
    raise ValueError(f"pipeline parallelism supports {', '.join(SUPPORTED)} models, got model_type {kind!r}")


def is_tied(model: nn.Module) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def pipeline_layers(model: nn.Module) -> list[LayerSpec]:
    """The layer specs of an HF Llama or GPT-2 causal LM, in forward order, wrapping its submodules."""
    parts = _parts(model)
    names = {id(m): n for n, m in model.named_modules()}
    embed, head = parts["embed"], model.get_output_embeddings()
    tied = is_tied(model)

    def embedding(**kw: Any) -> LayerSpec:
        if tied:
            return TiedLayerSpec(
                "embed", TokenEmbeddingPipe, embed, names[id(embed)], tied_weight_attr=["inner.weight"], **kw
            )
        return LayerSpec(TokenEmbeddingPipe, embed, names[id(embed)])

    specs = [embedding()]
    if "positions" in parts:
        positions = parts["positions"]
        specs.append(LayerSpec(PositionEmbeddingPipe, positions, names[id(positions)], parts["dropout"]))
    for block in parts["blocks"]:
        specs.append(LayerSpec(DecoderBlockPipe, block, names[id(block)], model.config, parts.get("rotary")))
    specs.append(LayerSpec(FinalNormPipe, parts["norm"], names[id(parts["norm"])]))
    specs.append(embedding(forward_fn=tied_lm_head) if tied else LayerSpec(LMHeadPipe, head, names[id(head)]))
    return specs


def build_pipeline_module(
    model: nn.Module,
    num_stages: int,
    loss_fn: Any = None,
    partition_method: str = "parameters",
    activation_checkpoint_interval: int = 0,
    seed_layers: bool = False,
) -> PipelineModule:
    """``model`` split over ``num_stages`` stages (needs the process group). ``partition_method``:
    ``parameters`` (balance trainable parameters), ``uniform`` (balance layer counts) or
    ``type:<regex>`` (balance layers whose class matches)."""
    return PipelineModule(
        layers=pipeline_layers(model),
        num_stages=num_stages,
        loss_fn=loss_fn,
        partition_method=partition_method,
        activation_checkpoint_interval=activation_checkpoint_interval,
        checkpointable_layers=CHECKPOINTABLE,
        seed_layers=seed_layers,
    )


# ---- export: the stages back into one HF state dict ----------------------------------------------


def stage_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """HF-named weights of the layers this rank holds."""
    state: dict[str, torch.Tensor] = {}
    for part in module.modules():
        if isinstance(part, HFPart):
            state.update(part.hf_state())
    return state


def assemble_hf_state_dict(model: nn.Module, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One state dict with ``model.state_dict()``'s keys from the stages' parts. Tied names share
    one tensor (so ``save_pretrained`` stores it once); buffers no stage holds (e.g. non-trainable
    constants) come from ``model``; a parameter no stage holds is an error."""
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    for names in aliases.values():
        found = next((merged[n] for n in names if n in merged), None)
        if found is not None:
            merged.update(dict.fromkeys(names, found))
    reference = model.state_dict()
    buffers = {name for name, _ in model.named_buffers()}
    missing = [k for k in reference if k not in merged and k not in buffers]
    if missing:
        raise RuntimeError(f"pipeline export: no stage holds {', '.join(missing[:5])}")
    return {k: merged[k] if k in merged else reference[k].detach().cpu() for k in reference}


def gather_hf_state_dict(module: PipelineModule, model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole model on rank 0, one stage at a time from data-parallel replica 0; None elsewhere."""
    grid = module.mpu()
    rank = dist.get_rank()
    parts = [stage_state_dict(module)] if rank == 0 else []
    for stage in range(1, grid.get_pipe_parallel_world_size()):
        source = grid.stage_to_global(stage_id=stage, data=0)
        box: list[Any] = [stage_state_dict(module) if rank == source else None]
        if rank == source:
            dist.send_object_list(box, dst=0)
        elif rank == 0:
            dist.recv_object_list(box, src=source)
            parts.append(box[0])
    return assemble_hf_state_dict(model, parts) if rank == 0 else None
