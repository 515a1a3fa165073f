"""Time to quality of the default job (``scripts/recipes/default.yaml``) under different optimizers.

Each variant trains the whole job in a process of its own, one after another (never two at once),
evaluating every ``eval_steps`` steps; its eval-loss curve is read from its ``metrics.jsonl``:

- ``ours``: ``python scripts/train.py --output_dir DIR --max_steps N --eval_steps E --logging_steps L
  [flags]``, the public command, one process (``make demo``'s launch on a CPU box: every core as
  OpenMP threads);
- ``hf_trainer``: transformers' ``Trainer`` with its default optimizer on the same job
  (``python -m trainer.bench.muon hf_trainer --output_dir DIR ...``, the same flags, read through
  the same recipe parser): the model built by the function our run builds it with (the same
  weights), the same tokenised blocks and eval rows, our collator's batches, the same seed, batch,
  schedule, clipping and evaluation. It writes the same ``metrics.jsonl`` rows.

The target is the baseline's (``adamw``, the recipe's learning rate) final eval loss. For each
variant: the first evaluated step whose eval loss is at or below the target, the training seconds
to that step, and their ratio to the baseline's.

Training seconds exclude evaluation (and our checkpoint saves): ours's ``train_time_s``, the step
timer's sum over logging windows, which restarts after each evaluation and save; HF's, the seconds
from ``on_train_begin`` to the logging step less the ``eval_runtime`` of the evaluations before it.
Both include data loading and logging. ``logging_steps`` divides ``eval_steps`` and ``max_steps``,
so every evaluated step has its training time logged right before the evaluation. ``wall_s`` is
the whole process: start-up, data, evaluations, saves and the export included.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.observe.metrics import MetricsWriter, read_metrics

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "scripts" / "recipes" / "default.yaml"
BASELINE = "adamw"
HF_TRAINER = "hf_trainer"
# The default job's optimizer, named so the baseline stays AdamW whatever a recipe says: torch's
# AdamW at the recipe's rate (3e-3) for its 600 steps.
ADAMW = ("--optim", "adamw_torch")
ADAMW_STEPS = 600
EVALS_PER_RUN = 12  # the default eval_steps: 50 of the AdamW job's 600 steps
RECIPE_LOGGING_STEPS = 20


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...] = ()  # scripts/train.py's flags on top of the recipe
    system: str = "ours"  # ours | hf_trainer


@dataclass(frozen=True)
class Schedule:
    max_steps: int
    eval_steps: int
    logging_steps: int

    def flags(self) -> list[str]:
        return ["--max_steps", str(self.max_steps), "--eval_steps", str(self.eval_steps),
                "--logging_steps", str(self.logging_steps)]  # fmt: skip


@dataclass
class Run:
    """One variant's finished process: its exit status, wall seconds and metrics rows."""

    returncode: int
    wall_s: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    log: str = ""
    command: list[str] = field(default_factory=list)


def schedule(max_steps: int, eval_steps: int | None = None) -> Schedule:
    """Evaluate every ``eval_steps`` (default: ``max_steps`` / 12, the AdamW job's 600 steps: 50); log
    every step that divides both (at most the recipe's 20) so each evaluated step is logged."""
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    eval_steps = eval_steps or max(1, round(max_steps / EVALS_PER_RUN))
    if not 1 <= eval_steps <= max_steps:
        raise ValueError(f"eval_steps must be in 1..max_steps ({max_steps}), got {eval_steps}")
    return Schedule(max_steps, eval_steps, math.gcd(RECIPE_LOGGING_STEPS, eval_steps, max_steps))


def variants(
    adamw_lrs: list[float],
    muon_lrs: list[float],
    muon_adam_lr: float,
    muon_args: str = "",
    hf_trainer: bool = True,
) -> list[Variant]:
    """The baseline (AdamW at the recipe's rate: the default job) first, AdamW at
    ``adamw_lrs``, Muon at each of ``muon_lrs`` (AdamW at ``muon_adam_lr`` for the parameters Muon
    leaves, ``muon_args`` appended to its optim_args), then HF's Trainer."""
    runs = [Variant(BASELINE, ADAMW)]
    runs += [Variant(f"adamw_lr{lr:g}", (*ADAMW, "--learning_rate", f"{lr:g}")) for lr in adamw_lrs]
    extra = f",{muon_args}" if muon_args else ""
    for lr in muon_lrs:
        optim_args = f"muon_lr={lr:g},adam_lr={muon_adam_lr:g}{extra}"
        runs.append(Variant(f"muon_lr{lr:g}", ("--optim", "muon", "--optim_args", optim_args)))
    if hf_trainer:
        runs.append(Variant(HF_TRAINER, system=HF_TRAINER))
    names = [v.name for v in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"two variants share a name: {names}")
    return runs


def has_gpu() -> bool:
    """A CUDA GPU, as the Makefile tells: ``nvidia-smi -L`` lists one."""
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def cores() -> int:
    """The cores this process may use (``nproc``, whatever OMP_NUM_THREADS says)."""
    return len(os.sched_getaffinity(0))


def launch_env(threads: int, gpu: bool) -> dict[str, str]:
    """``make demo``'s environment: every core as OpenMP threads; DeepSpeed told to use its CPU
    accelerator where there is no GPU; on a GPU box one GPU, so HF's Trainer runs no DataParallel."""
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    env["OMP_NUM_THREADS"] = str(threads)
    if gpu:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    else:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def command(variant: Variant, out: Path, plan: Schedule, job: Sequence[str] = ()) -> list[str]:
    """``variant``'s process; ``job``: flags every variant adds to the recipe (another model, fewer
    evaluation rows)."""
    common = ["--output_dir", str(out), *plan.flags(), *job, *variant.flags]
    if variant.system == HF_TRAINER:
        return [sys.executable, "-m", "trainer.bench.muon", HF_TRAINER, *common]
    return [sys.executable, str(ROOT / "scripts" / "train.py"), *common]


def run_variant(
    variant: Variant, root: Path, plan: Schedule, env: dict[str, str], job: Sequence[str] = ()
) -> Run:
    """Train ``variant`` in ``root/<name>`` (emptied first: a leftover checkpoint would be resumed);
    its output goes to ``root/<name>.log``."""
    out, log_path = root / variant.name, root / f"{variant.name}.log"
    if out.exists():
        shutil.rmtree(out)
    root.mkdir(parents=True, exist_ok=True)
    cmd = command(variant, out, plan, job)
    started = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    wall = time.perf_counter() - started
    rows = read_metrics(out) if (out / "metrics.jsonl").is_file() else []
    return Run(proc.returncode, wall, rows, str(log_path), cmd)


# ---------------------------------------------------------------- time to target


def eval_points(rows: list[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """(step, eval loss, training seconds to that step) of each evaluation, in step order. The
    seconds are the ``train_time_s`` of the training row logged at the same step."""
    train_s = {int(r["step"]): float(r["train_time_s"]) for r in rows if r.get("train_time_s") is not None}
    points = {}
    for row in rows:
        if row.get("eval_loss") is None:
            continue
        step = int(row["step"])
        if step not in train_s:
            raise ValueError(f"step {step} was evaluated but no training time was logged there")
        points[step] = (step, float(row["eval_loss"]), train_s[step])  # a step's last row wins
    return [points[s] for s in sorted(points)]


def time_to_target(
    points: list[tuple[int, float, float]], target: float, tolerance: float = 0.0
) -> tuple[int, float] | None:
    """(step, training seconds) of the first evaluation at or below ``target`` (raised by
    ``tolerance`` of itself); None if none is."""
    bar = target + tolerance * abs(target)
    return next(((step, seconds) for step, loss, seconds in points if loss <= bar), None)


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


def last_line(log: str) -> str:
    """The last non-empty line of a log file: a failed run's reason."""
    path = Path(log)
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


def summarise(
    runs: dict[str, Run], baseline: str = BASELINE, tolerance: float = 0.0
) -> dict[str, dict[str, Any]]:
    """One entry per variant: final eval loss and perplexity, the step and training seconds to the
    baseline's final eval loss (None when never reached; ``tolerance``: a relative margin above
    it that counts as reached), total training and wall seconds, and the ratio of the time to
    target to the baseline's."""
    curves: dict[str, list[tuple[int, float, float]]] = {}
    out: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        entry: dict[str, Any] = {"returncode": run.returncode, "wall_s": run.wall_s, "command": run.command}
        try:
            curves[name] = eval_points(run.rows)
        except ValueError as err:
            entry["error"] = str(err)
        if run.returncode != 0 or not curves.get(name):
            entry.setdefault("error", f"exit {run.returncode}: {last_line(run.log)}")
            curves.pop(name, None)
        out[name] = entry
    if baseline not in curves:
        raise RuntimeError(f"the baseline {baseline} did not finish: {out[baseline].get('error')}")
    target = curves[baseline][-1][1]
    base_s = time_to_target(curves[baseline], target, tolerance)[1]  # type: ignore[index]
    for name, points in curves.items():
        reached = time_to_target(points, target, tolerance)
        step_to, seconds_to = reached or (None, None)
        step, loss, total = points[-1]
        out[name].update(
            target_eval_loss=target, tolerance=tolerance, final_step=step, final_eval_loss=loss,
            perplexity=perplexity(loss), train_s=total, reached=reached is not None, step_to_target=step_to,
            train_s_to_target=seconds_to, ratio=None if seconds_to is None else seconds_to / base_s,
            curve=[list(p) for p in points],
        )  # fmt: skip
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    """The summary as markdown; a final eval loss from another step than the baseline's last (a
    run whose last evaluations were not finite) names its step."""
    e = summary[BASELINE]
    target, tolerance, last_step = e["target_eval_loss"], e["tolerance"], e["final_step"]
    margin = f" (reached at or below {target + tolerance * abs(target):.4f})" if tolerance else ""
    rows = [f"target: the {BASELINE} run's final eval loss, {target:.4f}{margin}", "",
            "| variant | final eval loss | perplexity | step at target | train s to target | train s total "
            f"| wall s | time to target / {BASELINE} |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, e in summary.items():
        if "error" in e:
            rows.append(f"| {name} | failed: {e['error'][:120]} | | | | | {e['wall_s']:.0f} | |")
            continue
        reached = (
            [str(e["step_to_target"]), f"{e['train_s_to_target']:.1f}"]
            if e["reached"]
            else ["not reached", ""]
        )
        ratio = f"{e['ratio']:.2f}" if e["reached"] else ""
        final = f"{e['final_eval_loss']:.4f}" + (
            f" (step {e['final_step']})" if e["final_step"] != last_step else ""
        )
        rows.append(f"| {name} | {final} | {e['perplexity']:.2f} | {' | '.join(reached)} "
                    f"| {e['train_s']:.1f} | {e['wall_s']:.0f} | {ratio} |")  # fmt: skip
    return "\n".join(rows)


# ---------------------------------------------------------------- HF's Trainer on the same job


class PackedCollator:
    """Our causal-LM collator's batches, without the attention mask when the rows are packed (as
    our objective forwards them): the model then builds a block-diagonal mask from the positions,
    so documents do not attend to each other."""

    def __init__(self, tokenizer: Any):
        from trainer.data import default_collator

        self.inner = default_collator(tokenizer)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.inner(rows)
        if "position_ids" in batch:
            batch.pop("attention_mask", None)
        return batch


def hf_job(run: Any) -> tuple[Any, Any, Any, PackedCollator]:
    """(model, train blocks, eval rows, collator) of the job, as ``build_run`` makes them for ours:
    the same tokenizer and cached blocks, the eval rows cut to ``max_eval_samples``, the model from
    the same config and per-parameter seeds."""
    from transformers import set_seed

    from trainer.data import build_datasets, get_tokenizer
    from trainer.model.modeling import build_model, model_config

    args, model_args, data_args = run.training, run.model, run.data
    tokenizer = get_tokenizer(model_args, data_args)
    train, held_out = build_datasets(data_args, tokenizer, seed=args.seed)
    if held_out is not None and data_args.max_eval_samples:
        held_out = held_out.select(range(min(data_args.max_eval_samples, len(held_out))))
    config = model_config(model_args, tokenizer, data_args.block_size)
    set_seed(args.seed)
    stage0 = {"zero_optimization": {"stage": 0}}
    model = build_model(model_args, config, stage0, args.gradient_checkpointing, seed=args.seed)
    return model, train, held_out, PackedCollator(tokenizer)


def hf_arguments(run: Any) -> Any:
    """HF's TrainingArguments with the job's values and precision (``auto``: what ours picks on this
    hardware); the optimizer is HF's default."""
    from transformers import TrainingArguments

    from trainer.runtime.distributed import detect_hardware

    a = run.training
    hardware = detect_hardware()
    precision = hardware.default_precision() if a.precision == "auto" else a.precision
    return TrainingArguments(
        output_dir=a.output_dir, max_steps=a.max_steps, seed=a.seed,
        per_device_train_batch_size=a.per_device_train_batch_size,
        per_device_eval_batch_size=a.per_device_eval_batch_size,
        gradient_accumulation_steps=a.gradient_accumulation_steps,
        learning_rate=a.learning_rate, adam_beta1=a.adam_beta1, adam_beta2=a.adam_beta2,
        adam_epsilon=a.adam_epsilon, weight_decay=a.weight_decay, max_grad_norm=a.max_grad_norm,
        lr_scheduler_type=str(a.lr_scheduler_type),
        warmup_steps=a.warmup_steps if a.warmup_steps > 0 else a.warmup_ratio,  # a float < 1: a ratio
        bf16=precision == "bf16", fp16=precision == "fp16", use_cpu=hardware.device == "cpu",
        eval_strategy="steps", eval_steps=a.eval_steps, logging_steps=a.logging_steps,
        save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=a.dataloader_num_workers,
    )  # fmt: skip


def hf_clock(out: Path) -> Any:
    """A callback that writes HF's logged rows to ``out/metrics.jsonl`` as ours does, training
    rows with ``train_time_s``: seconds since ``on_train_begin`` less the evaluations'
    ``eval_runtime``. The last step is logged and evaluated, as ours's is."""
    import torch
    from transformers import TrainerCallback

    writer = MetricsWriter(str(out))

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.start, self.eval_s = 0.0, 0.0

        def on_train_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step >= state.max_steps:
                control.should_log = control.should_evaluate = True
            return control

        def on_log(self, args, state, control, logs=None, **kw):
            row = {"step": state.global_step, **(logs or {})}
            if "loss" in row:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                row["train_time_s"] = time.perf_counter() - self.start - self.eval_s
            self.eval_s += float(row.get("eval_runtime", 0.0))
            writer.write(row)

    return Clock()


def hf_train(argv: list[str]) -> int:
    """``python -m trainer.bench.muon hf_trainer --output_dir DIR [--field value ...]``: the default
    recipe with these flags, trained by HF's Trainer."""
    from transformers import Trainer

    from trainer.args.recipe import parse_run_config

    run = parse_run_config(["--config", str(RECIPE), *argv])
    out = Path(run.training.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, train, held_out, collate = hf_job(run)
    args = hf_arguments(run)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=held_out,
                      data_collator=collate, callbacks=[hf_clock(out)])  # fmt: skip
    trainer.train()
    print(
        f"hf_trainer: optim {getattr(args.optim, 'value', args.optim)}, {trainer.state.global_step} steps",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != [HF_TRAINER]:
        raise SystemExit(
            f"usage: python -m trainer.bench.muon {HF_TRAINER} --output_dir DIR [--field value ...]"
        )
    raise SystemExit(hf_train(sys.argv[2:]))
