"""Pipeline parallelism: an HF causal LM as a DeepSpeed ``PipelineModule``, driven by
``PipelineAdapter`` with the same interface as ``trainer.engine.Engine``.

The model as layers. ``pipeline_layers`` turns a Llama or GPT-2 model (built by
``trainer.modeling.build_model`` or ``from_pretrained``) into a list of layer specs: token embedding,
(GPT-2: position embedding), one spec per decoder block, final norm, LM head. Each layer wraps the HF
submodule itself, so no weight is copied and every layer knows its HF name for the export. With tied
embeddings the embedding and the head are one ``TiedLayerSpec``: the first and last stages each hold
it and DeepSpeed sums its gradient over them. Between stages travel ``(hidden_states, position_ids)``.
No attention mask travels: rows are right-padded and attention is causal, so padding never reaches
a real token; packed rows restart ``position_ids`` at each document, and every block rebuilds the
block-diagonal mask from them exactly as the HF model does when the Engine leaves the mask out.

The Trainer's data. The Trainer gives every rank its own micro-batches (the sampler shards over all
ranks, as without a pipeline). The stages of one pipeline pool theirs, so each pipeline runs
``stages × gradient_accumulation_steps`` micro-batches per optimizer step and one step consumes the
same samples as the non-pipelined run on the same ranks. The DeepSpeed config handed to the engine
(and written to ``ds_config.json``) says so: its accumulation steps and train batch are multiplied
by the number of stages.

The loss, as in the Engine: a step's loss is the sum of per-token losses over every micro-batch on
every rank, divided by the target tokens of the whole window on all ranks. DeepSpeed's pipeline
divides each micro-batch loss by the accumulation steps and averages gradients over the
data-parallel replicas; the loss function multiplies both back, so the update equals the Engine's.
"""

from __future__ import annotations

import copy
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn
from transformers.masking_utils import create_causal_mask

from trainer.distributed import host_all_reduce
from trainer.engine import (
    IGNORE_INDEX,
    DeepSpeedDriver,
    causal_lm_loss_sum,
    count_targets,
    report_grad_norm,
    weight_decay_groups,
)

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


# ---- the adapter ---------------------------------------------------------------------------------


def pooled_config(ds_config: dict[str, Any], stages: int) -> dict[str, Any]:
    """The DeepSpeed config a pipeline runs: each pipeline's stages pool their micro-batches, so the
    accumulation steps and the train batch are ``stages`` times the per-rank ones."""
    config = copy.deepcopy(ds_config)
    config["gradient_accumulation_steps"] = ds_config["gradient_accumulation_steps"] * stages
    config["train_batch_size"] = ds_config["train_batch_size"] * stages
    config.setdefault("pipeline", {})["stages"] = stages
    return config


class WindowLoss:
    """The PipelineModule's ``loss_fn``. Returns the summed token loss times ``scale`` (to undo
    DeepSpeed's divisions, see the module docstring) and keeps the unscaled sum and target count
    of the current window for logging and evaluation."""

    def __init__(self) -> None:
        self.start(1.0)

    def start(self, scale: float, poison: bool = False, keep_logits: bool = False) -> None:
        self.scale, self.poison, self.keep_logits = scale, poison, keep_logits
        self.total: torch.Tensor | None = None
        self.count: torch.Tensor | None = None
        self.logits: list[torch.Tensor] = []  # each micro-batch's, on the host, when kept (predict)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.keep_logits:
            self.logits.append(logits.detach().float().cpu())
        loss_sum = causal_lm_loss_sum(logits, labels)
        if self.poison:  # fault injection: a non-finite loss, as a diverging run would produce
            loss_sum = loss_sum * float("nan")
        count = (labels[:, 1:] != IGNORE_INDEX).sum().float()
        self.total = loss_sum.detach() if self.total is None else self.total + loss_sum.detach()
        self.count = count if self.count is None else self.count + count
        return loss_sum * self.scale

    def result(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        zero = torch.zeros((), device=device)
        return (zero if self.total is None else self.total), (
            zero.clone() if self.count is None else self.count
        )


def _partition_method(value: Any) -> str:
    return "parameters" if value in (None, "best") else str(value)


def _positions(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if "position_ids" in batch:
        return batch["position_ids"]
    rows, length = batch["input_ids"].shape
    return torch.arange(length).expand(rows, length).contiguous()


class PipelineAdapter(DeepSpeedDriver):
    """``Engine``'s interface over DeepSpeed's ``PipelineEngine`` (``ds``). ``module`` is the HF model
    (the shell the export is written from); ``world_size`` is the data-parallel size."""

    def __init__(
        self,
        model: nn.Module,
        ds_config: dict[str, Any],
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        weight_decay: float = 0.0,
        gradient_checkpointing: bool = False,
    ):
        if optimizer is not None:
            raise ValueError(
                "pipeline_parallel_size > 1: the optimizer is built per stage from the DeepSpeed config; "
                "pass optimizer settings (optim, learning_rate, ...) instead of a client optimizer"
            )
        section = ds_config.get("pipeline") or {}
        self.stages = int(section.get("stages") or 1)
        if self.stages < 2:
            raise ValueError(f"pipeline.stages must be at least 2 for a pipeline, got {self.stages}")
        interval = int(section.get("activation_checkpoint_interval") or 0) or int(gradient_checkpointing)
        if interval and getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()  # the pipeline checkpoints; HF's would recompute twice
        self.ds_config = pooled_config(ds_config, self.stages)
        self.hf_model = model
        self.loss = WindowLoss()
        pipe = build_pipeline_module(
            model,
            self.stages,
            self.loss,
            partition_method=_partition_method(section.get("partition")),
            activation_checkpoint_interval=interval,
            seed_layers=bool(section.get("seed_layers", False)),
        )
        if "activation_checkpointing" in ds_config:
            deepspeed.checkpointing.configure(pipe.mpu(), deepspeed_config=self.ds_config)
        self.ds, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
            model=pipe,
            config=self.ds_config,
            model_parameters=weight_decay_groups(pipe, weight_decay),
            lr_scheduler=lr_scheduler,
        )
        _norm_over_all_stages(self.ds)
        report_grad_norm(self.ds)
        self.device = self.ds.device
        self.world_size = self.ds.dp_world_size
        self.lr_scale = 1.0
        self._shape: tuple[int, ...] | None = None

    @property
    def module(self) -> nn.Module:
        return self.hf_model

    # ---- one accumulation window ---------------------------------------------------------------

    def train_window(
        self, window: list[dict[str, torch.Tensor]], poison: bool = False, window_tokens: float | None = None
    ) -> tuple[torch.Tensor, float]:
        """One optimizer step over this rank's window (pooled with the other stages' windows).
        Returns (the summed loss this rank computed: the last stage's, zero on the others; the
        window's target tokens on all ranks), like ``Engine.train_window``."""
        if window_tokens is None:
            window_tokens = max(host_all_reduce([float(sum(count_targets(b) for b in window))])[0], 1.0)
        tokens = window_tokens
        pooled = self._pool(window)
        self.loss.start(self.world_size * self.ds.gradient_accumulation_steps() / tokens, poison)
        self._fit_shapes(pooled)
        self.ds.micro_batches = len(pooled)  # a short last window of an epoch runs fewer
        try:
            self.ds.train_batch(self._micro_batches(pooled))
        finally:
            self.ds.micro_batches = self.ds.gradient_accumulation_steps()
        self._apply_lr_scale()
        return self.loss.result(self.device)[0], tokens

    @torch.no_grad()
    def eval_loss_sum(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, target count) of the pipeline's pooled batches on its last stage; zeros on
        the other stages, so a sum over all ranks counts every batch once."""
        self._forward(batch)
        return self.loss.result(self.device)

    @torch.no_grad()
    def logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The logits of this rank's batch. The stages pool their batches, the last stage computes
        the logits of all of them, and each stage takes its own back (collective in the pipeline)."""
        self._forward(batch, keep_logits=True)  # the loss function sees each micro-batch's logits
        last = self.loss.logits if self.ds.is_last_stage() else None
        gathered: list[Any] = [None] * self.stages
        dist.all_gather_object(gathered, last, group=self.ds.grid.get_pipe_parallel_group())
        return gathered[-1][self.ds.stage_id].to(self.device)

    def _forward(self, batch: dict[str, torch.Tensor], keep_logits: bool = False) -> None:
        """One evaluation forward of the pipeline's pooled batches; the loss function records them."""
        pooled = self._pool([batch])
        self.loss.start(1.0, keep_logits=keep_logits)
        self._fit_shapes(pooled)
        self.ds.eval_batch(
            self._micro_batches(pooled),
            compute_loss=True,
            reduce_output=None,
            bcast_loss=False,
            num_micro_batches=len(pooled),
        )

    def _pool(self, batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """Every stage's micro-batches, in stage order, on every stage of this pipeline."""
        keep = ("input_ids", "position_ids", "labels")
        mine = [{k: b[k] for k in keep if k in b} for b in batches]
        gathered: list[Any] = [None] * self.stages
        dist.all_gather_object(gathered, mine, group=self.ds.grid.get_pipe_parallel_group())
        return [b for part in gathered for b in part]

    def _micro_batches(self, pooled: list[dict[str, torch.Tensor]]) -> Any:
        return iter([((b["input_ids"], _positions(b)), b["labels"]) for b in pooled])

    def _fit_shapes(self, pooled: list[dict[str, torch.Tensor]]) -> None:
        """DeepSpeed sizes its stage-to-stage buffers once; a new shape resets them, and a window
        of mixed shapes (padded to each batch's longest row) sends shapes with every micro-batch."""
        shapes = {tuple(b["input_ids"].shape) for b in pooled}
        if shapes == {self._shape}:
            return
        self.ds.reset_activation_shape()
        self._shape = next(iter(shapes)) if len(shapes) == 1 else None
        self.ds.dynamic_shape = self._shape is None

    def load(self, directory: str, tag: str, load_optimizer_states: bool = True) -> dict[str, Any]:
        path, client_state = self.ds.load_checkpoint(
            directory, tag=tag, load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=True
        )
        if path is None:
            raise FileNotFoundError(f"{directory}/{tag}: DeepSpeed found no checkpoint to load")
        self._shape = None
        return client_state or {}

    def load_universal(self, directory: str, tag: str) -> dict[str, Any]:
        raise RuntimeError(
            f"{directory}: a pipeline checkpoint resumes only on the same world size and "
            "pipeline_parallel_size it was saved with"
        )

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole HF model's weights on rank 0 (collective: every rank calls it); None elsewhere."""
        return gather_hf_state_dict(self.ds.module, self.hf_model)


def _norm_over_all_stages(ds: Any) -> None:
    """Make fp32 ZeRO-0 gradient clipping see every stage's gradients.

    That path (``deepspeed.runtime.utils.clip_grad_norm_``) counts a parameter only on the first rank
    of the model-parallel group, which for a pipeline is its first stage, unless the parameter is
    marked model-parallel. Marking each stage's own parameters (not the tied copies that stage
    does not own) makes the norm, and so the clipping, that of the whole model. ZeRO-1 and bf16
    compute the norm per stage already; with no tensor parallelism the mark changes nothing else.
    """
    if ds.zero_optimization() or ds.fp16_enabled() or ds.bfloat16_enabled():
        return
    for param in ds.module.parameters():
        if not getattr(param, "ds_pipe_replicated", False):
            param.model_parallel = True
