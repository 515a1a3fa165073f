"""DeepSpeed's ZeRO internals, behind the engine layer: the one place outside the engines that reads
a partitioned parameter's attributes or calls DeepSpeed's ZeRO tools.

Under ZeRO-3 a parameter is a stub whose real size is ``ds_numel`` and whose local shard is
``ds_tensor``; reading or changing its values needs a gather. Offline, a ZeRO checkpoint is
consolidated by DeepSpeed's ``zero_to_fp32`` and converted for another world size by its
``ds_to_universal``. Callers outside ``trainer/engine/`` use these helpers (or the ``Engine`` that
wraps them) and never DeepSpeed itself.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import deepspeed
import torch
from deepspeed.checkpoint import ds_to_universal
from deepspeed.module_inject.layers import DS_TENSOR_MODEL_PARALLEL
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from trainer.config.files import precision_of
from trainer.engine.partitions import adam_names_undone
from trainer.planner import GB

if TYPE_CHECKING:
    from trainer.planner import Cluster, ModelSpec


def numel(param: torch.Tensor, tensor: int = 1) -> int:
    """A parameter's full number of elements: under ZeRO-3 a partitioned stub's real size, and under
    AutoTP over ``tensor`` ranks (it tags the weights it splits) its slices' on all of them."""
    split = tensor if getattr(param, DS_TENSOR_MODEL_PARALLEL, False) else 1
    return int(getattr(param, "ds_numel", param.numel())) * split


def parameter_counts(model: torch.nn.Module, tensor: int = 1) -> tuple[int, int]:
    """(trainable, total) parameters of ``model`` (tied ones once); a ZeRO-3 partition counts its
    full size, an AutoTP slice over ``tensor`` ranks its whole weight's."""
    trainable = total = 0
    for param in model.parameters():
        n = numel(param, tensor)
        total += n
        trainable += n if param.requires_grad else 0
    return trainable, total


@contextlib.contextmanager
def gathered(
    params: Sequence[torch.Tensor], modifier_rank: int | None = None, enabled: bool = True
) -> Iterator[None]:
    """Inside: the whole of each ZeRO-3 partitioned parameter on every rank (``modifier_rank``:
    the rank whose changes are partitioned back as the block ends). A no-op for parameters that are
    not partitioned, or when not ``enabled``."""
    if not enabled:
        yield
        return
    with deepspeed.zero.GatheredParameters(list(params), modifier_rank=modifier_rank):
        yield


def partitioned(module: torch.nn.Module) -> bool:
    """Whether ZeRO-3 partitioned the module's parameters (at creation, or by its engine)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def device_free_bytes(device: torch.device) -> int:
    """The device's free memory (a CPU's: its available RAM)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


@contextlib.contextmanager
def generation_weights(ds_engine: Any, budget: float) -> Iterator[tuple[int, int]]:
    """Inside: as much of a ZeRO-3 engine's weights as ``budget`` bytes hold, gathered once on every
    rank for a generation. Where all fit, the whole model (``whole_model``: the generation forwards
    as a ZeRO-2 model does); else the parameters in the module's order up to the budget, kept
    gathered (``kept_gathered``) while each forward gathers and releases the rest as training does.
    Yields (bytes gathered once, the whole weights' bytes); every rank must pass the same budget.
    A no-op, yielding (0, 0), where nothing is partitioned."""
    params = [p for p in ds_engine.module.parameters() if hasattr(p, "ds_numel")]
    sizes = [p.ds_numel * p.element_size() for p in params]
    total = sum(sizes)
    if total and budget >= total:
        with whole_model(ds_engine):
            yield total, total
        return
    kept = used = 0
    while kept < len(params) and used + sizes[kept] <= budget:
        used, kept = used + sizes[kept], kept + 1
    with kept_gathered(ds_engine, params[:kept]):
        yield used, total


# Marks the parameters a generation keeps gathered: ZeRO-3 releases a parameter only when no module
# is using it (``ds_active_sub_modules`` empty), and no module's ``ds_id`` is negative.
_KEPT = -1


@contextlib.contextmanager
def kept_gathered(ds_engine: Any, params: list[torch.Tensor]) -> Iterator[None]:
    """Inside: ``params`` gathered once on every rank and kept so, while ZeRO-3's hooks gather and
    release the other parameters at each forward (they pass over parameters that are whole already);
    on exit they are partitioned again and the trace the forwards recorded is dropped."""
    with deepspeed.zero.GatheredParameters(params, enabled=bool(params)):
        for param in params:
            param.ds_active_sub_modules.add(_KEPT)
        try:
            yield
        finally:
            for param in params:
                param.ds_active_sub_modules.discard(_KEPT)
            _drop_trace(ds_engine)


def _drop_trace(ds_engine: Any) -> None:
    """Forget the module order ZeRO-3 recorded: a generation's forwards are not the training step's,
    whose prefetching follows it."""
    offload = getattr(getattr(ds_engine, "optimizer", None), "parameter_offload", None)
    coordinator = getattr(offload, "param_coordinator", None)
    if coordinator is not None and not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()


@contextlib.contextmanager
def whole_model(ds_engine: Any) -> Iterator[None]:
    """Inside: a ZeRO-3 engine's weights gathered whole on every rank, once, with its per-module
    gathering hooks taken off (each forward would otherwise release what it used and gather it
    again); the hooks are put back and the weights partitioned again on exit. A generation then
    forwards as a ZeRO-2 model does."""
    offload = ds_engine.optimizer.parameter_offload
    params = list(ds_engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        for param in params:
            param.ds_active_sub_modules.clear()
        for hook in [*offload.forward_hooks, *offload.backward_hooks]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            _drop_trace(ds_engine)
            offload._register_deepspeed_module(offload.module)


# What a frozen model's engine keeps of the training run's DeepSpeed config: the batch and
# precision settings and ZeRO's partitioning (with its parameter offload); no optimizer, scheduler
# or training-only features.
FROZEN_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
               "bf16", "fp16", "zero_optimization")  # fmt: skip


@contextlib.contextmanager
def frozen_forward(model: torch.nn.Module, ds_config: dict[str, Any], device: torch.device) -> Iterator[Any]:
    """A frozen model's forward (a reference that scores pairs), let go on exit.

    Under ZeRO-3 the model is a DeepSpeed engine with no optimizer whose weights are partitioned
    over the ranks as the training engine's are (and offloaded where those are, ``offload_param``):
    no rank holds it whole, and every rank must forward in step, since each forward gathers. Under
    ZeRO 0-2 it is whole on ``device``, in the run's precision. Either way it is in eval mode."""
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    if stage != 3:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision_of(ds_config))
        yield model.to(device=device, dtype=dtype).eval()
        return
    config = {k: ds_config[k] for k in FROZEN_KEYS if k in ds_config}
    config["zero_optimization"] = {
        k: v for k, v in config["zero_optimization"].items() if k != "offload_optimizer"
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    try:
        yield engine
    finally:
        engine.destroy()


def state_bytes(module: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes this rank holds in model states, summed over the tensors (each storage once).

    ``params``: the module's parameters (under ZeRO-3, this rank's partitions). ``optimizer``: the
    inner optimizer's states and the fp32 master weights it steps, when those are not the module's
    parameters, and the wrapper's fp32 partitions (attributes named ``*fp32*``). ``grads``: gradients
    of either, and the wrapper's gradient partitions and buffers (attributes named ``*grad*``).
    ``other``: any further tensors of the wrapper (communication buckets). Meta tensors hold no
    memory and are skipped. ``optimizer`` is what ``deepspeed.initialize`` returned (DeepSpeed's
    ZeRO or mixed-precision wrapper, or a plain optimizer).
    """
    seen: set[int] = set()
    out = {"params": 0, "grads": 0, "optimizer": 0, "other": 0}

    def add(tensor: Any, kind: str) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta" or tensor.numel() == 0:
            return
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out[kind] += storage.nbytes()
        if tensor.grad is not None:
            add(tensor.grad, "grads")

    for p in module.parameters():
        add(getattr(p, "ds_tensor", None), "params")
        add(p, "params")
    inner = getattr(optimizer, "optimizer", optimizer)
    for group in inner.param_groups:
        for p in group["params"]:
            add(p, "optimizer")
    for state in inner.state.values():
        for value in state.values():
            add(value, "optimizer")
    if optimizer is not inner:
        for name, value in vars(optimizer).items():
            for tensor in _tensors_in(value):
                kind = "grads" if "grad" in name else "optimizer" if "fp32" in name else "other"
                add(tensor, kind)
    return out


def _tensors_in(value: Any, depth: int = 0) -> Iterable[Any]:
    """Tensors inside nested lists, tuples and dicts (not inside other objects)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, depth + 1)


# ---- checkpoints, offline ------------------------------------------------------------------------


def fp32_state_dict(checkpoint_dir: str | Path, tag: str) -> dict[str, torch.Tensor]:
    """The whole model's fp32 weights from a ZeRO 1-3 checkpoint's shards (DeepSpeed's ``zero_to_fp32``),
    in one process."""
    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)


def universal_state_dict(universal_dir: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's fp32 weights from a universal checkpoint (a ``convert_to_universal`` target):
    one ``zero/<name>/fp32.pt`` per parameter, tensor-parallel slices already joined."""
    params = Path(universal_dir) / "zero"
    return {
        d.name: torch.load(d / "fp32.pt", map_location="cpu", weights_only=False)["param"]
        for d in sorted(params.iterdir())
        if (d / "fp32.pt").is_file()
    }


def convert_to_universal(source: str | Path, target: str | Path) -> None:
    """DeepSpeed's ``ds_to_universal`` of the checkpoint ``source`` (a tag directory) into ``target``,
    in this process (no worker processes forked from a training rank); it writes ``latest_universal``
    next to ``target``. The tool reads Adam's two moments of every group: a checkpoint of our LARS or
    Muon, or torch's SGD, whose groups keep a momentum alone (or no state), is converted from a copy
    that names it ``exp_avg`` (zeros where there is none) beside a zero ``exp_avg_sq``
    (``Partitioned.after_universal_load`` and ``momentum_from_adam_names`` name it back)."""
    source, target = Path(source), Path(target)
    scratch = target.parent / f"{target.name}.adam-named"
    try:
        options = argparse.Namespace(
            input_folder=str(_with_adam_names(source, scratch)),
            output_folder=str(target),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=False,
        )
        ds_to_universal.main(options)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def universal_param_groups(directory: str | Path, tag: str) -> list[dict[str, Any]]:
    """The optimizer's parameter groups (their settings) as a universal checkpoint saved them."""
    saved = torch.load(
        Path(directory) / tag / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=False
    )
    return saved["optimizer_state_dict"]["param_groups"]


def momentum_from_adam_names(zero_optimizer: Any) -> None:
    """After a universal load into torch's SGD under ZeRO, its state under its own names again
    (``adam_names_undone``). The state is keyed by ZeRO's fp32 partition of each group (ZeRO-3
    empties the groups' own parameter lists between steps)."""
    optimizer = zero_optimizer.optimizer
    names = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition")
    flats = next(getattr(zero_optimizer, n) for n in names if hasattr(zero_optimizer, n))  # ZeRO-3, 1-2, bf16
    for group, flat in zip(optimizer.param_groups, flats, strict=True):
        adam_names_undone(optimizer.state.get(flat, {}), bool(group.get("momentum")))


def _with_adam_names(source: Path, scratch: Path) -> Path:
    """``source``, or ``scratch``: links to its files, but for copies of the optimizer shards whose
    group states each hold ``exp_avg``, ``exp_avg_sq`` and ``step``."""
    patched = {}
    for shard in sorted(source.glob("*optim_states.pt")):
        saved = torch.load(shard, map_location="cpu", weights_only=False)
        optim = saved["optimizer_state_dict"]
        if "fp32_flat_groups" in optim:  # stage 3
            states, flats = optim["optimizer_state_dict"]["state"], optim["fp32_flat_groups"]
        else:
            states, flats = optim["base_optimizer_state"]["state"], optim["single_partition_of_fp32_groups"]
        # A group with no state (plain SGD keeps none) counts as not Adam-named.
        if all(
            "exp_avg" in states.get(i, {}) and "exp_avg_sq" in states.get(i, {}) for i in range(len(flats))
        ):
            continue
        # ZeRO-3's universal load reads the first group's step: a momentum alone takes another's (or 0).
        step = next((state["step"] for state in states.values() if "step" in state), torch.tensor(0.0))
        for i, flat in enumerate(flats):
            state = states.setdefault(i, {})
            if "exp_avg" not in state:
                state["exp_avg"] = state.pop("momentum_buffer", None)
                if state["exp_avg"] is None:
                    state["exp_avg"] = torch.zeros_like(flat)
            state.setdefault("exp_avg_sq", torch.zeros_like(flat))
            state.setdefault("step", step)
        patched[shard.name] = saved
    if not patched:
        return source
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    for path in source.iterdir():
        if path.name in patched:
            torch.save(patched[path.name], scratch / path.name)
        else:
            (scratch / path.name).symlink_to(path.resolve())
    return scratch


# ---- DeepSpeed's own memory estimators (the planner compares with them) ---------------------------


def deepspeed_estimates(spec: ModelSpec, cluster: Cluster) -> dict[str, dict[str, float]]:
    """DeepSpeed's own model-state estimators for the planner's model and cluster, in GB per GPU / per
    node: here, beside DeepSpeed, so the planner answers without it; docs/memory.md compares the two.
    """
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    common = {"num_gpus_per_node": cluster.gpus_per_node, "num_nodes": cluster.nodes}
    out = {}
    for offload in (False, True):
        cpu, gpu = estimate_zero2_model_states_mem_needs(spec.n_params, cpu_offload=offload, **common)
        out[f"zero2{'_offload_optimizer' if offload else ''}"] = {"gpu_gb": gpu / GB, "cpu_gb": cpu / GB}
    for offload_optimizer, offload_param in ((False, False), (True, False), (True, True)):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            spec.n_params, spec.largest_layer_params, cpu_offload=offload_optimizer,
            cpu_offload_params=offload_param, **common,
        )  # fmt: skip
        name = (
            "zero3"
            + ("_offload_optimizer" if offload_optimizer else "")
            + ("_param" if offload_param else "")
        )
        out[name] = {"gpu_gb": gpu / GB, "cpu_gb": cpu / GB}
    return out
