"""Resolution: training arguments + world size + hardware -> one concrete DeepSpeed dict.

The DeepSpeed config can come from nowhere (generated from the arguments), a preset name, a dict,
or a JSON file written for HF Trainer, Accelerate, LLaMA-Factory or axolotl. All go the same way:

1. keys that the run determines (batch sizes, clipping, precision, optimizer and scheduler
   params, the ZeRO-3 bucket sizes) are filled in where missing or ``"auto"``;
2. an explicit value that contradicts the training arguments is an error showing both;
3. an ``"auto"`` the run cannot determine is an error naming the key;
4. the result goes through the schema, with the batch arithmetic at this world size.

Nothing here reads the environment or imports torch: the caller passes the world size and a
``Hardware`` description.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from trainer.config.arguments import RunArgs, Shortcuts, TrainingArgs
from trainer.config.base import ARGS_NOTE, Problem, dedupe, show_value
from trainer.config.errors import ConfigError
from trainer.config.files import MISSING, base_config, get_path, is_auto, positive_int
from trainer.config.hardware import Hardware
from trainer.config.optimizer_rules import OptimizerRules
from trainer.config.parallel import tensor_size_of
from trainer.config.presets import AIO_BLOCK, FP16_BLOCK, PRESETS
from trainer.config.schema import validate
from trainer.config.zero import STAGE3_KNOBS

# TrainingArguments.lr_scheduler_type -> DeepSpeed scheduler type; any other type (or any
# lr_scheduler_kwargs) is transformers' get_scheduler, which the Trainer passes as a client scheduler.
_SCHEDULERS = {
    "linear": "WarmupDecayLR",
    "cosine": "WarmupCosineLR",
    "constant": "WarmupLR",
    "constant_with_warmup": "WarmupLR",
}


def deepspeed_schedules(args: TrainingArgs) -> bool:
    """Whether DeepSpeed's own scheduler expresses the run's schedule (else transformers' does)."""
    return args.lr_scheduler_type in _SCHEDULERS and not args.lr_scheduler_kwargs


def transformers_schedule(args: TrainingArgs, data: dict[str, Any]) -> bool:
    """Whether transformers' scheduler runs the schedule rather than one DeepSpeed's config names.
    DeepSpeed's warmup schedulers apply each rate one step late (they start at their floor, then
    step k uses the rate of step k - 1 of HF's schedule), warm up over at least two steps, and
    ``WarmupDecayLR`` without warmup never decays; so every schedule but a constant rate is
    transformers' own (the rates HF's Trainer applies), unless the user's DeepSpeed file names a
    scheduler, or DeepSpeed cannot express the schedule at all; and under Muon, whose halves have
    two rates (a file's WarmupLR or WarmupDecayLR, which set one, is refused)."""
    if not deepspeed_schedules(args):
        return True
    # Muon's halves have rates of their own, which DeepSpeed's WarmupLR would set to one.
    muon = args.optim == "muon" or get_path(data, "optimizer.type") == "Muon"
    return "scheduler" not in data and (args.lr_scheduler_type != "constant" or muon)


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = data
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _same(have: Any, want: Any) -> bool | None:
    """Whether an explicit value equals the run's; None when ``have`` is malformed (the schema reports it)."""
    if isinstance(want, bool) or isinstance(have, bool):
        return have == want if isinstance(have, bool) else None
    if isinstance(want, list | tuple):
        if not isinstance(have, list | tuple) or len(have) != len(want):
            return None
        pairs = [_same(h, w) for h, w in zip(have, want, strict=True)]
        return None if None in pairs else all(pairs)
    if isinstance(want, int | float):
        number = _number(have)
        return None if number is None else math.isclose(number, want, rel_tol=1e-9, abs_tol=1e-12)
    return have == want


def _overlaps(path: str, problems: list[Problem]) -> bool:
    """Whether a problem at ``path`` is about a key (or under a key) some problem already names."""
    known = [k for p, _ in problems for k in p.split(", ")]
    return any(key == k or key.startswith(k + ".") for key in path.split(", ") for k in known)


@dataclass
class _Resolver(OptimizerRules):
    args: TrainingArgs
    world_size: int
    hardware: Hardware | None  # None: the target is unknown, so support is not checked
    hidden_size: int | None = None
    total_steps: int | None = None
    data_parallel: int | None = None  # the run's layout says; None: worked out from world_size
    check: bool = True  # compare explicit values with the training arguments
    fill_missing: bool = True  # add keys the run determines; off when checking a file on its own
    data: dict[str, Any] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

    def explicit(self, name: str) -> bool:
        return name in self.args.model_fields_set

    def settle(self, path: str, want: Any, source: str, *, fill: bool = True, compare: bool = True) -> None:
        """Make ``path`` equal the run's value ``want``: fill it in, replace ``"auto"``, or report a contradiction.

        ``want`` None means the run cannot tell; only an ``"auto"`` is then an error (``source`` says why).
        """
        have = get_path(self.data, path)
        if want is None:
            if is_auto(have):
                self.problems.append((path, f'"auto" cannot be resolved: {source}'))
            return
        if have is MISSING:
            if fill and self.fill_missing:
                _set(self.data, path, want)
            return
        if is_auto(have):
            _set(self.data, path, want)
            return
        if self.check and compare and _same(have, want) is False:
            self.problems.append(
                (
                    path,
                    f'{show_value(have)} contradicts {source}; remove the key, set it to "auto", or make them equal',
                )
            )

    def settle_arg(self, path: str, arg: str, want: Any = MISSING) -> None:
        """Settle a key that mirrors one training argument; only an explicitly set argument overrides the file."""
        value = getattr(self.args, arg) if want is MISSING else want
        given = self.explicit(arg)
        self.settle(path, value, f"{arg}={show_value(value)} {ARGS_NOTE}", fill=given, compare=given)

    # --- the steps -------------------------------------------------------------------------

    def parallelism(self) -> int:
        """Pipeline stages, sequence- and tensor-parallel groups, and the data-parallel size the batch
        keys are computed for (a sequence- or tensor-parallel group reads one set of rows)."""
        pp, sp = self.args.pipeline_parallel_size, self.args.sequence_parallel_size
        tp = getattr(self.args, "tensor_parallel_size", 1)
        if pp > 1 or self.explicit("pipeline_parallel_size"):
            self.settle_arg("pipeline.stages", "pipeline_parallel_size")
        if sp > 1 or self.explicit("sequence_parallel_size"):
            # Also read by zero.Init, whose config has no other way to learn the data-parallel size.
            self.settle_arg("sequence_parallel_size", "sequence_parallel_size")
        if tp > 1 or self.explicit("tensor_parallel_size"):
            self.settle_arg("tensor_parallel.autotp_size", "tensor_parallel_size")
        if getattr(self.args, "expert_parallel_size", 1) > 1 or self.explicit("expert_parallel_size"):
            self.settle_arg("expert_parallel.autoep_size", "expert_parallel_size")
            if self.args.expert_parallel_size > 1:
                self.settle("expert_parallel.enabled", True, "expert_parallel_size > 1 turns AutoEP on")
        if tensor_size_of(self.data) > 1:
            # Left unset, AutoTP splits a tied head by vocabulary, and every loss here reads whole rows.
            self.settle(
                "tensor_parallel.vocab_parallel_lm_head", False, "the trainer's losses read whole logits"
            )
        if self.data_parallel is not None:  # the run's Mesh computed it
            return self.data_parallel
        # Checking a config with no run behind it (``trainer ds-config``, ``check``): the file's sizes.
        stages, groups = get_path(self.data, "pipeline.stages"), get_path(self.data, "sequence_parallel_size")
        split = (stages if positive_int(stages) else pp) * (groups if positive_int(groups) else 1)
        split *= tensor_size_of(self.data)
        # A world size the stages or groups do not divide is reported by the schema's batch check.
        return self.world_size // split if self.world_size % split == 0 else 1

    def batch(self) -> None:
        a = self.args
        note = ARGS_NOTE
        mbs, gas = a.per_device_train_batch_size, a.gradient_accumulation_steps
        dp = self.parallelism()
        self.settle("train_micro_batch_size_per_gpu", mbs, f"per_device_train_batch_size={mbs} {note}")
        self.settle("gradient_accumulation_steps", gas, f"gradient_accumulation_steps={gas} {note}")
        if not self.check:
            # Nothing is compared, so the file's own micro batch and accumulation size the total.
            mbs = positive_int(get_path(self.data, "train_micro_batch_size_per_gpu")) or mbs
            gas = positive_int(get_path(self.data, "gradient_accumulation_steps")) or gas
        self.settle(
            "train_batch_size",
            mbs * gas * dp,
            f"per_device_train_batch_size × gradient_accumulation_steps × data-parallel world size "
            f"= {mbs} × {gas} × {dp} = {mbs * gas * dp}",
        )
        self.settle("gradient_clipping", a.max_grad_norm, f"max_grad_norm={a.max_grad_norm} {note}")

    def precision(self) -> None:
        requested = self.args.requested_precision
        flags = {p: get_path(self.data, f"{p}.enabled") for p in ("fp16", "bf16")}
        on = [p for p, v in flags.items() if v is True]
        if requested == "auto":
            precision = (
                on[0] if len(on) == 1 else self.hardware.default_precision() if self.hardware else "fp32"
            )
        else:
            precision = requested
        source = (
            f"precision={precision} {ARGS_NOTE}"
            if requested != "auto"
            else f"precision auto ({precision} here)"
        )
        for p in ("fp16", "bf16"):
            want = precision == p
            if flags[p] is MISSING:
                if not (want and self.fill_missing):
                    continue
                if isinstance(self.data.get(p), dict):
                    self.data[p]["enabled"] = True
                else:
                    self.data[p] = dict(FP16_BLOCK) if p == "fp16" else {"enabled": True}
            elif requested != "auto" or is_auto(flags[p]):
                self.settle(f"{p}.enabled", want, source)
        if self.hardware is not None and not self.hardware.supports(precision):
            other = "bf16 or fp32" if precision == "fp16" else "fp16 or fp32"
            self.problems.append(
                (f"{precision}.enabled", f"{precision} is not supported on {self.hardware.name}; use {other}")
            )

    def nonfinite_skip(self) -> None:
        """nonfinite_policy=skip trusts DeepSpeed's optimizer to drop a step whose gradients are not
        finite. Two setups never do: ZeRO-0 in fp32 (nothing wraps the optimizer) and bf16 with
        check_grad_overflow off. The step would be applied and the weights lost."""
        if getattr(self.args, "nonfinite_policy", None) != "skip":
            return
        stage = get_path(self.data, "zero_optimization.stage")
        fp16, bf16 = (get_path(self.data, f"{p}.enabled") is True for p in ("fp16", "bf16"))
        if stage in (0, MISSING) and not fp16 and not bf16:
            self.problems.append(
                ("nonfinite_policy", "skip needs an optimizer that drops non-finite steps, and ZeRO-0 in fp32 "
                 "applies them; use rollback or stop, or ZeRO stage 1-3")
            )  # fmt: skip
        elif bf16 and get_path(self.data, "bf16.check_grad_overflow") is False:
            self.problems.append(
                ("bf16.check_grad_overflow", "false makes DeepSpeed apply non-finite steps, which "
                 "nonfinite_policy=skip relies on it to drop; set it true, or use rollback or stop")
            )  # fmt: skip

    def zero(self) -> None:
        self.settle_arg("zero_optimization.stage", "zero_stage")
        for block in ("offload_optimizer", "offload_param"):
            if (
                getattr(self.args, block) != "none"
                or get_path(self.data, f"zero_optimization.{block}") is not MISSING
            ):
                self.settle_arg(f"zero_optimization.{block}.device", block)
            if get_path(self.data, f"zero_optimization.{block}.device") == "nvme" and self.args.nvme_path:
                self.settle_arg(f"zero_optimization.{block}.nvme_path", "nvme_path")
        if "nvme" in (
            get_path(self.data, f"zero_optimization.{b}.device")
            for b in ("offload_optimizer", "offload_param")
        ):
            self.data.setdefault("aio", dict(AIO_BLOCK))
        elif self.args.nvme_path:
            self.problems.append(
                ("nvme_path", "set, but nothing is offloaded to NVMe, so it would be ignored; add "
                 "offload_optimizer nvme or offload_param nvme, or drop nvme_path")
            )  # fmt: skip
        if (
            self.hardware is not None
            and self.hardware.device != "cuda"
            and get_path(self.data, "aio.use_gds") is True
        ):
            self.problems.append(
                ("aio.use_gds", f"GPUDirect Storage needs a CUDA GPU; this run is on {self.hardware.name}")
            )
        self.bucket_sizes()

    def bucket_sizes(self) -> None:
        """ZeRO bucket sizes from the hidden size h: reduce h², prefetch 0.9·h², persistence 10·h."""
        h = self.hidden_size
        stage3 = get_path(self.data, "zero_optimization.stage") == 3
        sizes = {
            "reduce_bucket_size": h * h if h else None,
            "prefetch_bucket_size": int(0.9 * h * h) if h else None,
            "param_persistence_threshold": 10 * h if h else None,
        }
        for key, want in sizes.items():
            names = [f"stage3_{key}", key] if key in STAGE3_KNOBS else [key]
            present = [n for n in names if get_path(self.data, f"zero_optimization.{n}") is not MISSING]
            path = f"zero_optimization.{present[0] if present else names[0]}"
            reason = (
                "needs the model's hidden size; pass hidden_size or set model_config_overrides.hidden_size"
            )
            # Explicit sizes are tuning choices, not run facts: they are kept, never compared.
            self.settle(path, want, reason, fill=stage3 and not present, compare=False)

    def steps(self) -> tuple[int | None, int | None, str]:
        """Total and warmup steps, and why they are unknown when they are."""
        a = self.args
        total = self.total_steps or (a.max_steps if a.max_steps > 0 else None)
        why = "max_steps is -1 and the run's number of training steps was not given; set max_steps"
        if a.warmup_steps > 0:
            return total, a.warmup_steps, why
        if a.warmup_ratio == 0:
            return total, 0, why
        return total, (math.ceil(a.warmup_ratio * total) if total else None), why

    def scheduler(self) -> None:
        a = self.args
        lr = a.learning_rate
        total, warmup, why = self.steps()
        sched_type = _SCHEDULERS[a.lr_scheduler_type]
        if get_path(self.data, "scheduler") is MISSING:
            # A constant rate, the one schedule DeepSpeed runs unasked (transformers_schedule).
            params = {
                "warmup_min_lr": lr,
                "warmup_max_lr": lr,
                "warmup_num_steps": 1,
                "warmup_type": "linear",
            }
            self.data["scheduler"] = {"type": sched_type, "params": params}
            return
        have = get_path(self.data, "scheduler.type")
        if is_auto(have) or (
            self.explicit("lr_scheduler_type") and isinstance(have, str) and have != sched_type
        ):
            self.settle_arg("scheduler.type", "lr_scheduler_type", sched_type)
        kind = get_path(self.data, "scheduler.type")
        warmup_steps = max(1, warmup) if warmup is not None else None
        warmup_src = f"warmup_steps={a.warmup_steps} / warmup_ratio={a.warmup_ratio} {ARGS_NOTE}"
        if kind in ("WarmupLR", "WarmupDecayLR"):
            self.settle("scheduler.params.warmup_min_lr", 0.0, "", fill=False, compare=False)
            self.settle("scheduler.params.warmup_max_lr", lr, f"learning_rate={lr} {ARGS_NOTE}")
        if kind == "WarmupCosineLR":
            self.settle("scheduler.params.warmup_min_ratio", 0.0, "", fill=False, compare=False)
        if kind in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
            self.settle(
                "scheduler.params.warmup_num_steps", warmup_steps, warmup_src if warmup is not None else why
            )
        if kind in ("WarmupDecayLR", "WarmupCosineLR"):
            self.settle(
                "scheduler.params.total_num_steps", total, f"the run's total steps={total}" if total else why
            )

    def leftover_autos(self, node: Any = None, prefix: str = "") -> None:
        node = self.data if node is None else node
        for key in list(node):
            path = f"{prefix}{key}"
            value = node[key]
            if path == "data_types.keep_in_fp32_modules" and is_auto(value):
                del node[key]  # leaving it out is DeepSpeed's own automatic choice
            elif is_auto(value) and not _overlaps(path, self.problems):
                self.problems.append(
                    (path, '"auto" cannot be resolved from the run for this key; give a value')
                )
            elif isinstance(value, dict):
                self.leftover_autos(value, f"{path}.")

    def finish(self) -> dict[str, Any]:
        try:
            config = validate(self.data, world_size=self.world_size)
        except ConfigError as err:
            # The schema often restates a problem found here (a contradiction breaks the batch rule).
            later = [p for p in err.problems if not _overlaps(p[0], self.problems)]
            raise ConfigError(dedupe(self.problems + later)) from None
        if self.problems:
            raise ConfigError(dedupe(self.problems))
        return config.to_dict()


def resolve(
    run: RunArgs | TrainingArgs,
    world_size: int,
    hardware: Hardware,
    *,
    hidden_size: int | None = None,
    total_steps: int | None = None,
    client_optimizer: bool = False,
    client_scheduler: bool = False,
    data_parallel: int | None = None,
) -> dict[str, Any]:
    """The concrete DeepSpeed dict for a run: no ``"auto"`` left, every rule checked, and the batch
    keys of a pipeline pooled over its stages (what the engine runs and ``ds_config.json`` records).

    ``run`` is a RunConfig or just its TrainingArguments. ``world_size`` counts all ranks;
    the batch keys use the data-parallel part of it. ``hidden_size`` (default: the model's
    ``model_config_overrides``) sizes the ZeRO-3 buckets; ``total_steps`` (default: max_steps)
    feeds the schedule. ``client_optimizer`` / ``client_scheduler``: the caller passes its own to
    ``deepspeed.initialize``, so the config must not define one. ``data_parallel``: the run's
    data-parallel size, from its ``Mesh`` (``parallel_sizes`` gives the mesh the stages
    and sequence groups this config will have); without it, worked out from ``world_size`` and the
    config. Raises ConfigError listing every problem.
    """
    args = run.training if hasattr(run, "training") else run
    if hidden_size is None and hasattr(run, "model"):
        hidden_size = run.model.model_config_overrides.get("hidden_size")
    ds = args.deepspeed
    if isinstance(ds, str) and ds not in PRESETS and not ds.endswith(".json") and not Path(ds).exists():
        raise ConfigError(
            [("deepspeed", f"{ds!r} is neither a JSON file nor a preset ({', '.join(PRESETS)})")]
        )
    data, check = base_config(args)
    r = _Resolver(args, world_size, hardware, hidden_size, total_steps, data_parallel, check=check, data=data)
    if not deepspeed_schedules(args) and not client_scheduler and "scheduler" in data:
        raise ConfigError(
            [("scheduler", f"lr_scheduler_type={args.lr_scheduler_type} (with lr_scheduler_kwargs={args.lr_scheduler_kwargs}) "
              "is built by transformers' get_scheduler, which DeepSpeed's schedulers cannot express; remove the section")]
        )  # fmt: skip
    client_scheduler = client_scheduler or transformers_schedule(args, data)
    return _pool_stages(_run(r, client_optimizer, client_scheduler))


def check(run: RunArgs | TrainingArgs, world_size: int, hardware: Hardware) -> None:
    """Every rule ``resolve`` applies, before anything is loaded (ConfigError otherwise). An
    epoch-based run's length is known only once its data is; until then any count past the warmup
    stands in for it."""
    args = run.training if hasattr(run, "training") else run
    steps = args.max_steps if args.max_steps > 0 else args.warmup_steps + 1
    resolve(run, world_size, hardware, total_steps=steps)


def _pool_stages(config: dict[str, Any]) -> dict[str, Any]:
    """What a pipeline runs: each pipeline's stages pool their micro-batches, so its accumulation
    steps and train batch are ``stages`` times the per-rank ones the run's arguments give."""
    stages = int((config.get("pipeline") or {}).get("stages") or 1)
    if stages > 1:
        config["gradient_accumulation_steps"] *= stages
        config["train_batch_size"] *= stages
    return config


def _run(
    r: _Resolver, client_optimizer: bool = False, client_scheduler: bool = False, add_sections: bool = True
) -> dict[str, Any]:
    r.batch()
    r.precision()
    r.zero()
    r.nonfinite_skip()
    for section, client, step in (
        ("optimizer", client_optimizer, r.optimizer),
        ("scheduler", client_scheduler, r.scheduler),
    ):
        if not client:
            if add_sections or section in r.data:
                step()
        elif section in r.data:
            r.problems.append(
                (section, f"the config defines a {section} and the caller passes its own; remove one")
            )
    r.leftover_autos()
    return r.finish()


def resolve_json(
    data: dict[str, Any],
    run: RunArgs | TrainingArgs,
    world_size: int = 1,
    hardware: Hardware | None = None,
    hidden_size: int | None = None,
    *,
    compare: bool = True,
) -> dict[str, Any]:
    """Check a DeepSpeed JSON on its own (``trainer ds-config validate``).

    ``"auto"`` comes from ``run``'s training arguments; with ``compare``, explicit values must agree
    with them, as in ``resolve``. Without (no run to check against: the caller passes the default
    arguments), only ``"auto"`` is replaced; nothing is added or compared. Sections the file leaves
    out (optimizer, scheduler) stay out. Without hardware, precision support is not checked.
    """
    args = run.training if hasattr(run, "training") else run
    if hidden_size is None and hasattr(run, "model"):
        hidden_size = run.model.model_config_overrides.get("hidden_size")
    copy = json.loads(json.dumps(data))
    r = _Resolver(args, world_size, hardware, hidden_size=hidden_size, check=compare, data=copy)
    r.fill_missing = compare
    return _run(r, add_sections=False)


def generate(
    *,
    zero_stage: int,
    precision: str,
    micro_batch: int,
    grad_accum: int = 1,
    world_size: int | None = None,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    nvme_path: str | None = None,
    gradient_clipping: float = 1.0,
    hidden_size: int | None = None,
    sequence_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
) -> dict[str, Any]:
    """One config for a target cluster (``trainer ds-config generate``): no optimizer or scheduler,
    which the training script supplies. With a world size it includes train_batch_size (counting a
    sequence-parallel group once); with a hidden size, the ZeRO-3 bucket sizes."""
    # Only the batch, precision and ZeRO steps run below, and they read no more than the shortcuts.
    args = cast(
        TrainingArgs,
        Shortcuts(
            per_device_train_batch_size=micro_batch,
            gradient_accumulation_steps=grad_accum,
            zero_stage=zero_stage,
            offload_optimizer=offload_optimizer,
            offload_param=offload_param,
            nvme_path=nvme_path,
            precision=precision,
            max_grad_norm=gradient_clipping,
            **({"sequence_parallel_size": sequence_parallel_size} if sequence_parallel_size > 1 else {}),
            **({"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {}),
        ),
    )
    data, _ = base_config(args)
    r = _Resolver(args, world_size or 1, hardware=None, hidden_size=hidden_size, check=False, data=data)
    r.batch()
    if world_size is None:
        del r.data["train_batch_size"]
    r.precision()
    r.zero()
    if r.problems:
        raise ConfigError(dedupe(r.problems))
    return validate(r.data, world_size=world_size).to_dict()
