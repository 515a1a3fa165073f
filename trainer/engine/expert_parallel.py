"""Expert parallelism through DeepSpeed's AutoEP.

Inside ``deepspeed.initialize`` AutoEP replaces each mixture-of-experts block of an HF model with
an expert-parallel one (``AutoEPMoELayer``): each of the ``autoep_size`` ranks of an expert group
holds ``experts / autoep_size`` of every layer's experts, and each token travels to the rank that
holds its expert and back (all-to-all). Expert groups split the data-parallel ranks; everything
outside the experts stays data-parallel. The blocks are found by the model's HF type (DeepSpeed's
presets: Mixtral, Qwen3-MoE, Qwen3.5-MoE, DeepSeek-V2/V3, MiniMax-M3) or the section's patterns.

What this module adds around it:

- transformers 5.24 defines its output-capture registry's ``get(model)`` with one argument, and
  AutoEP calls ``get(key, default)`` (a ``TypeError`` in ``deepspeed.initialize``):
  ``allow_registry_default`` lets the call take its default, keeping the one-argument form.
- each block's HF layout, read before it is replaced, so the export gives HF's names and shapes
  back: every expert gathered from the ranks of its group, the fused gate/up matrix joined again,
  the router's weight under its own name. DeepSpeed's own consolidation refuses AutoEP.
- the parts of a block AutoEP keeps as they are, under their HF names again: shared experts (and
  their gate), and the router's score correction bias (DeepSeek-V3).
- the refusal, before DeepSpeed builds anything, of blocks whose experts are a list of modules,
  which the export cannot give back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.utils import groups

from trainer.args.run import LORA_WITH_EXPERT_PARALLEL
from trainer.config.errors import ConfigError
from trainer.engine import zero

PATH = "expert_parallel.autoep_size"


def allow_registry_default() -> None:
    """transformers' ``_CanRecordRegistry.get`` taking AutoEP's ``(key, default)`` call as well as
    its own ``(model)``: a key it does not hold gives the default."""
    from transformers.utils import output_capturing

    registry = getattr(output_capturing, "_CanRecordRegistry", None)
    get = getattr(registry, "get", None)
    if get is None or getattr(get, "_takes_default", False):
        return

    def get_or_default(self: Any, key: Any, *default: Any) -> Any:
        if not default:
            return get(self, key)
        try:
            return get(self, key)
        except (KeyError, TypeError, AttributeError):
            return default[0]

    get_or_default._takes_default = True  # type: ignore[attr-defined]
    registry.get = get_or_default


@dataclass(frozen=True)
class Layout:
    """One MoE block as the HF model holds it: where its experts and router are, the names and
    shapes of the experts' fused matrices (``gate_up``: gate and up projections stacked)."""

    block: str  # the block's module name, e.g. model.layers.0.mlp
    router: str  # the router's name inside the block
    experts: str  # the experts module's name inside the block
    gate_up: str
    down: str
    gate_up_shape: tuple[int, ...]
    down_shape: tuple[int, ...]
    ffn: int
    router_bias: bool
    # Modules AutoEP keeps as they are, (HF's name in the block, AutoEP's attribute): shared experts, their gate.
    shared: tuple[tuple[str, str], ...] = ()
    correction: str | None = None  # the router's score correction bias, by its HF name in the block

    def hf_tensors(self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> dict[str, torch.Tensor]:
        """HF's expert matrices from AutoEP's whole ``w1``/``w3`` [experts, ffn, hidden] and ``w2``
        [experts, hidden, ffn]."""
        if self.gate_up_shape[1] == 2 * self.ffn:  # [experts, 2 ffn, hidden]
            gate_up = torch.cat([w1, w3], dim=1)
        else:  # [experts, hidden, 2 ffn]
            gate_up = torch.cat([w1.transpose(1, 2), w3.transpose(1, 2)], dim=2)
        down = w2 if tuple(self.down_shape[1:]) == tuple(w2.shape[1:]) else w2.transpose(1, 2)
        prefix = f"{self.block}.{self.experts}"
        return {f"{prefix}.{self.gate_up}": gate_up.contiguous(), f"{prefix}.{self.down}": down.contiguous()}


class ExpertParallel:
    """AutoEP for one engine: the blocks' layouts read from ``model`` before DeepSpeed replaces
    them, the group once made, and the whole model's HF state dict for the export."""

    def __init__(self, model: torch.nn.Module, ds_config: dict[str, Any], size: int):
        if isinstance(getattr(model, "peft_config", None), dict):
            raise ConfigError(LORA_WITH_EXPERT_PARALLEL, path=f"use_peft, {PATH}")
        allow_registry_default()
        self.size = size
        self.layouts = layouts(model, ds_config)
        self.group: Any = None

    @staticmethod
    def named_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The optimizer's parameter groups, each named: DeepSpeed splits each into its expert and
        other parameters under the group's name."""
        return [{"name": f"group{i}", **group} for i, group in enumerate(groups)]

    def made(self) -> Any:
        """The expert-parallel group DeepSpeed made (for the mesh), once the engine is built."""
        self.group = groups._get_expert_parallel_group(f"ep_size_{self.size}")
        return self.group

    def full_state_dict(self, module: torch.nn.Module, partitioned: bool) -> dict[str, torch.Tensor] | None:
        """The HF model's weights on rank 0 (a collective; None elsewhere): each block's experts
        gathered over its expert group and put back in HF's layout; the rest as the module holds it
        (ZeRO-3's partitions gathered)."""
        rank0 = dist.get_rank() == 0
        blocks = {layout.block: layout for layout in self.layouts}
        state: dict[str, torch.Tensor] = {}
        copies: dict[int, torch.Tensor] = {}  # a tied weight stays one tensor under both names
        for name, tensor in module.state_dict(keep_vars=True).items():
            if any(name.startswith(f"{block}.") for block in blocks):
                continue
            if id(tensor) not in copies:
                with zero.gathered([tensor], enabled=partitioned and hasattr(tensor, "ds_id")):
                    copies[id(tensor)] = tensor.detach().cpu().clone() if rank0 else tensor
            if rank0:
                state[name] = copies[id(tensor)]
        for layout in self.layouts:
            layer = module.get_submodule(layout.block)
            experts = [self._whole(getattr(layer.experts, w), partitioned) for w in ("w1", "w2", "w3")]
            gate = layer.router.gate
            with zero.gathered(list(gate.parameters()), enabled=partitioned):
                if rank0:
                    state[f"{layout.block}.{layout.router}.weight"] = gate.weight.detach().cpu().clone()
                    if layout.router_bias:
                        state[f"{layout.block}.{layout.router}.bias"] = gate.bias.detach().cpu().clone()
            if layout.correction is not None:  # a buffer, or a parameter partitioned like any other
                bias = layer.router.e_score_correction_bias
                with zero.gathered([bias], enabled=partitioned and hasattr(bias, "ds_id")):
                    if rank0:
                        state[f"{layout.block}.{layout.correction}"] = bias.detach().cpu().clone()
            for name, attribute in layout.shared:
                for key, tensor in getattr(layer, attribute).state_dict(keep_vars=True).items():
                    with zero.gathered([tensor], enabled=partitioned and hasattr(tensor, "ds_id")):
                        if rank0:
                            state[f"{layout.block}.{name}.{key}"] = tensor.detach().cpu().clone()
            if rank0:
                state.update(layout.hf_tensors(*experts))
        return state if rank0 else None

    def _whole(self, param: torch.Tensor, partitioned: bool) -> torch.Tensor:
        """Every expert of one of a layer's matrices: this rank's, gathered over the expert group."""
        with zero.gathered([param], enabled=partitioned and hasattr(param, "ds_id")):
            local = param.detach().clone()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts).cpu()


def layouts(model: torch.nn.Module, ds_config: dict[str, Any]) -> list[Layout]:
    """The MoE blocks AutoEP will replace in ``model``, as HF holds them; refused, naming the
    block, where the export could not give one back."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    specs = AutoEP(model, parse_autoep_config(ds_config.get("expert_parallel") or {})).ep_parser()
    if not specs:
        raise ConfigError(
            f"AutoEP found no mixture-of-experts block in {type(model).__name__} (its presets "
            "know Mixtral, Qwen3-MoE, Qwen3.5-MoE, DeepSeek-V2/V3 and MiniMax-M3; name others with "
            "expert_parallel.moe_layer_pattern, router_pattern and expert_pattern)",
            path=PATH,
        )
    found = []
    for spec in specs:
        if spec.expert_storage != "fused_3d" or spec.expert_w3_name:
            raise ConfigError(
                f"{spec.moe_module_name} ({spec.model_family}): its experts are a list of modules, "
                "which the export does not put back in HF's layout yet; run without expert_parallel_size",
                path=PATH,
            )
        block = model.get_submodule(spec.moe_module_name)
        shared = {
            "shared_experts": spec.shared_experts_name if spec.has_shared_experts else None,
            "shared_experts_gate": spec.shared_experts_gate_name,
        }  # AutoEP's attribute: HF's name
        owner = (
            spec.router_name
            if spec.e_score_correction_bias_path is None
            else spec.e_score_correction_bias_path
        )
        has_correction = getattr(block.get_submodule(owner), "e_score_correction_bias", None) is not None
        experts = model.get_submodule(f"{spec.moe_module_name}.{spec.experts_name}")
        gate_up, down = getattr(experts, spec.expert_w1_name), getattr(experts, spec.expert_w2_name)
        found.append(
            Layout(
                block=spec.moe_module_name,
                router=spec.router_name,
                experts=spec.experts_name,
                gate_up=spec.expert_w1_name,
                down=spec.expert_w2_name,
                gate_up_shape=tuple(getattr(gate_up, "ds_shape", gate_up.shape)),
                down_shape=tuple(getattr(down, "ds_shape", down.shape)),
                ffn=spec.ffn_hidden_size,
                router_bias=spec.gate_bias,
                shared=tuple((name, attribute) for attribute, name in shared.items() if name),
                correction=f"{owner}.e_score_correction_bias".lstrip(".") if has_correction else None,
            )
        )
    return found
