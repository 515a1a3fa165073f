"""Checkpoint scenarios under a real launcher (torchrun in the tests; ``deepspeed`` works the same):
exact resume, corruption, world-size change, HF export. One launch runs many scenarios; the pytest side only compares.

Usage: ``deepspeed --num_gpus N tests/helpers/resume_scenarios.py OUT SCENARIO [SCENARIO ...]``.
Each scenario returns a JSON-able dict; rank 0 writes ``OUT/results-<world size>.json``. Weights go
to ``OUT/<scenario>/*.pt``. ``world_dst`` runs on 1 or 3 ranks and reads what ``world_src`` left.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import deepspeed
import torch

from tests.helpers.scaffold import loss_steps
from tests.helpers.trainer_scenarios import (
    StepsRun,
    build_tiny_run,
    engine_kind,
    save_weights,
    token_dataset,
)
from trainer import Trainer, TrainingArguments
from trainer.checkpoint import CheckpointError
from trainer.cli.main import exit_now
from trainer.data import CausalLMCollator
from trainer.loop.callbacks import TrainerCallback
from trainer.runtime.distributed import (
    all_gather_object,
    barrier,
    detect_hardware,
    dist_info,
    init_distributed,
)

STEPS, SAVE_AT = 10, 5
# 48 samples: the 10 steps cross an epoch boundary after the save (6 or 8 steps per epoch).
DATA = 48


def build(out_dir: Path, resume: str | None = None, callbacks=None, **overrides) -> Trainer:
    fields = dict(
        output_dir=str(out_dir),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        weight_decay=0.1,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_AT,
        disable_tqdm=True,
        seed=0,
        resume_from_checkpoint=resume,
    )
    return build_tiny_run(
        TrainingArguments(**{**fields, **overrides}), token_dataset(DATA), callbacks=callbacks
    )


def losses_of(trainer: Trainer) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in trainer.state.log_history if "loss" in row}


def train(out_dir: Path, resume: str | None = None, **overrides) -> tuple[Trainer, dict[int, float]]:
    """Train; ``trainer.ran`` reports the step this process began at and the steps it trained."""
    probe = StepsRun()
    trainer = build(out_dir, resume, callbacks=[probe], **overrides)
    trainer.train()
    trainer.ran = probe.report()
    return trainer, losses_of(trainer)


def copy_checkpoints(src: Path, dst: Path, steps: list[int]) -> None:
    if dist_info().is_main:
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        for step in steps:
            shutil.copytree(src / f"checkpoint-{step}", dst / f"checkpoint-{step}")
    barrier("copy")


def after(losses: dict[int, float], step: int) -> list[list[float]]:
    return [[s, loss] for s, loss in sorted(losses.items()) if s > step]


def resume_pair(out: Path, name: str, **overrides) -> dict:
    """An uninterrupted run (saving at SAVE_AT and STEPS) and a fresh Trainer resumed from SAVE_AT."""
    ref, ref_losses = train(out / name / "reference", **overrides)
    save_weights(ref, out / name / "reference.pt")
    copy_checkpoints(out / name / "reference", out / name / "resumed", [SAVE_AT])
    res, res_losses = train(out / name / "resumed", resume="auto", **overrides)
    save_weights(res, out / name / "resumed.pt")
    return {
        "reference": after(ref_losses, 0),
        "resumed": after(res_losses, SAVE_AT),
        "position": [res.state.epoch_index, res.state.samples_into_epoch],
        "reference_position": [ref.state.epoch_index, ref.state.samples_into_epoch],
        "reference_ran": ref.ran,
        "resumed_ran": res.ran,
        # Only checkpoint-5 was copied over: the metrics file is the resumed run's own.
        "resumed_metrics_steps": loss_steps(out / name / "resumed") if dist_info().is_main else None,
        "engine": engine_kind(res),
        "trainer": ref,
    }


# ---- scenarios -----------------------------------------------------------------------------------


def exact(out: Path) -> dict:
    """ZeRO 0-3 with the default optimizer; each reference run is also exported to HF. Then ZeRO-1's
    checkpoint-5 resumed at ZeRO-2 (a stage change a checkpoint carries)."""
    result = {}
    for stage in (0, 1, 2, 3):
        pair = resume_pair(out / "exact", f"zero{stage}", zero_stage=stage)
        export(pair.pop("trainer"), out / "exact" / f"zero{stage}")
        result[f"zero{stage}"] = pair
    where = out / "exact" / "zero1_at_zero2"
    copy_checkpoints(out / "exact" / "zero1" / "reference", where, [SAVE_AT])
    trainer, losses = train(where, resume="auto", zero_stage=2)
    save_weights(trainer, out / "exact" / "zero1_at_zero2.pt")
    result["zero1_at_zero2"] = {"resumed": after(losses, SAVE_AT), "resumed_ran": trainer.ran}
    return result


def export(trainer: Trainer, where: Path) -> None:
    """Trainer.save_model next to weights gathered independently and the engine's own logits."""
    trainer.save_model(str(where / "hf"))
    gathered = {}
    for name, param in trainer.engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            gathered[name] = param.detach().clone().cpu()
    batch = CausalLMCollator(0)([token_dataset(4, seed=5)[i] for i in range(4)])
    trainer.engine.train(False)
    with torch.no_grad():
        logits = trainer.engine.ds(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits
    if dist_info().is_main:
        torch.save(
            {"gathered": gathered, "logits": logits.float().cpu(), "batch": dict(batch)}, where / "engine.pt"
        )
    barrier("export")


OPTIMIZERS = {
    "fused_zero2": dict(zero_stage=2, optim="adamw_fused"),
    "offload_zero2": dict(zero_stage=2, offload_optimizer="cpu"),
    "fused_zero0": dict(zero_stage=0, optim="adamw_fused"),  # slow variant: one more optimizer path
}


def optimizers(out: Path, names: tuple[str, ...] = ("fused_zero2", "offload_zero2")) -> dict:
    """DeepSpeed's own CPU Adam kernels: FusedAdam (optim adamw_fused) and the offload CPUAdam."""
    result = {}
    for name in names:
        pair = resume_pair(out / "optimizers", name, **OPTIMIZERS[name])
        pair.pop("trainer")
        result[name] = pair
    return result


def optimizers_slow(out: Path) -> dict:
    return optimizers(out, ("fused_zero0",))


def corrupt(out: Path) -> dict:
    """Damaged copies of the ZeRO-2 run of ``exact`` (checkpoints 5 and 10)."""
    src = out / "exact" / "zero2" / "reference"
    result: dict = {}
    # An explicit path to a corrupt checkpoint: one error, the same on every rank, nothing trained.
    flipped = out / "corrupt" / "flipped"
    copy_checkpoints(src, flipped, [SAVE_AT, STEPS])
    if dist_info().is_main:
        flip_byte(flipped / f"checkpoint-{STEPS}" / "ds" / "mp_rank_00_model_states.pt")
    barrier("flip")
    try:
        train(flipped, resume=str(flipped / f"checkpoint-{STEPS}"), zero_stage=2)
        message = None
    except CheckpointError as err:
        message = str(err)
    result["explicit_errors"] = all_gather_object(message)
    # auto: the flipped checkpoint-10 is skipped, checkpoint-5 resumed.
    trainer, losses = train(flipped, resume="auto", zero_stage=2)
    result["flipped"] = after(losses, SAVE_AT)
    result["flipped_ran"] = trainer.ran
    # auto with a truncated shard owned by rank 1, plus an unmarked and a staging directory that
    # look newer but must never be loaded.
    truncated = out / "corrupt" / "truncated"
    copy_checkpoints(src, truncated, [SAVE_AT, STEPS])
    if dist_info().is_main:
        shard = truncated / f"checkpoint-{STEPS}" / "ds" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        for name in ("checkpoint-12", ".staging-checkpoint-14"):
            shutil.copytree(src / f"checkpoint-{STEPS}", truncated / name)
            (truncated / name / "COMPLETE").unlink()
    barrier("truncate")
    trainer, losses = train(truncated, resume="auto", zero_stage=2)
    result["truncated"] = after(losses, SAVE_AT)
    result["truncated_ran"] = trainer.ran
    result["truncated_listing"] = sorted(p.name for p in truncated.iterdir())
    return result


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# World-size change: micro-batch 1 and a global batch of 6 divide into 1, 2 and 3 ranks.
WORLD = dict(per_device_train_batch_size=1, gradient_accumulation_steps=3)
# The runs that change world size: ZeRO 2 and 3 with the default AdamW, and ZeRO-3 with torch's SGD
# and a momentum (a DeepSpeed file's optimizer), whose state the universal conversion names as Adam's.
SGD = {
    "optimizer": {"type": "SGD", "params": {"lr": "auto", "momentum": 0.9}},
    "zero_allow_untested_optimizer": True,
}
WORLD_RUNS = {"zero2": dict(zero_stage=2), "zero3": dict(zero_stage=3),
              "zero3_sgd": dict(zero_stage=3, optim="sgd", deepspeed=SGD)}  # fmt: skip


def world_src(out: Path) -> dict:
    """On 2 ranks: the runs that 1 or 3 ranks will continue, and their trajectories to match."""
    result = {}
    for name, fields in WORLD_RUNS.items():
        run = out / "world" / name
        trainer, losses = train(run / "source", **fields, **WORLD)
        save_weights(trainer, run / "source.pt")
        result[name] = after(losses, 0)
    return result


class MomentProbe(TrainerCallback):
    """At train begin (after the resume), compares a parameter's optimizer state with the converted
    file: Adam's two moments, or SGD's momentum buffer (the conversion's ``exp_avg``)."""

    def __init__(self, moments: dict[str, str]):
        self.trainer: Trainer | None = None
        self.moments = moments  # the live state's name: the universal file's
        self.report: dict = {}

    def on_train_begin(self, args, state, control, **kw):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        universal = Path(args.output_dir) / f"checkpoint-{SAVE_AT}" / "universal" / "ds" / "zero"
        files = {"fp32": "fp32", **self.moments}
        worst = dict.fromkeys(files, 0.0)
        for name, param in self.trainer.engine.module.named_parameters():
            for key, file in files.items():
                live = (
                    safe_get_full_fp32_param(param)
                    if key == "fp32"
                    else safe_get_full_optimizer_state(param, key)
                )
                saved = torch.load(
                    universal / name / f"{file}.pt", weights_only=False
                )  # ZeRO-3: a flat tensor
                saved = (saved["param"] if isinstance(saved, dict) else saved).flatten()
                worst[key] = max(worst[key], (live.flatten().float() - saved.float()).abs().max().item())
        opt = self.trainer.engine.ds.optimizer
        groups = getattr(opt, "optimizer", opt).param_groups
        self.report = {
            "max_abs_diff": worst,
            "state_keys": sorted({k for s in getattr(opt, "optimizer", opt).state.values() for k in s}),
            "groups": [
                {k: v for k, v in g.items() if k in ("lr", "weight_decay", "betas", "eps", "momentum")}
                for g in groups
            ],
        }


def world_dst(out: Path) -> dict:
    """On 1 or 3 ranks: resume each 2-rank checkpoint-5 with the same arguments."""
    world = dist_info().world_size
    result = {}
    for name, fields in WORLD_RUNS.items():
        run = out / "world" / name
        target = run / f"on{world}"
        copy_checkpoints(run / "source", target, [SAVE_AT])
        moments = (
            {"momentum_buffer": "exp_avg"}
            if "sgd" in name
            else {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
        )
        probe, ran = MomentProbe(moments), StepsRun()
        trainer = probe.trainer = build(target, resume="auto", callbacks=[probe, ran], **fields, **WORLD)
        trainer.train()
        losses = losses_of(trainer)
        save_weights(trainer, run / f"on{world}.pt")
        ds_config = json.loads((target / "ds_config.json").read_text())
        result[name] = {
            "losses": after(losses, SAVE_AT),
            "ran": ran.report(),
            "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
            "engine_gas": trainer.engine.ds.gradient_accumulation_steps(),
            "ds_config_batch": [ds_config["train_batch_size"], ds_config["gradient_accumulation_steps"]],
            "universal_complete": (target / f"checkpoint-{SAVE_AT}" / "universal" / "COMPLETE").is_file(),
            "moments": probe.report,
            "new_manifest_world": json.loads((target / f"checkpoint-{STEPS}" / "manifest.json").read_text())[
                "world_size"
            ],
        }
    return result


SCENARIOS = {f.__name__: f for f in (exact, optimizers, optimizers_slow, corrupt, world_src, world_dst)}


def main() -> int:
    out, *names = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out = Path(out)
    init_distributed(detect_hardware())
    results = {}
    for name in names:
        results[name] = SCENARIOS[name](out)
        barrier(name)
    if dist_info().is_main:
        path = out / f"results-{dist_info().world_size}.json"
        earlier = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**earlier, **results}, indent=1))
    return 0


if __name__ == "__main__":
    exit_now(main())
