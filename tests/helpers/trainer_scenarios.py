"""Runs engine/Trainer scenarios on 2 ranks under a real launcher (torchrun in the tests; ``deepspeed``
works the same).

One launch serves many tests (each launch costs start-up time): every scenario writes its numbers
into ``<out>/results.json`` and its weights into ``<out>/<scenario>/*.pt``; the pytest side only
compares.
Usage: ``deepspeed --num_gpus 2 tests/helpers/trainer_scenarios.py OUT SCENARIO [SCENARIO ...]``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import cpuinfo
import datasets
import deepspeed
import torch
from transformers import LlamaConfig, LlamaForCausalLM, set_seed

from trainer import Trainer, TrainingArguments
from trainer.args import RunConfig
from trainer.checkpoint.writer import FileWriter
from trainer.cli.main import exit_now
from trainer.data import CausalLMCollator, ResumableDistributedSampler
from trainer.engine import DeepSpeedEngine, causal_lm_loss_sum, count_targets
from trainer.loop.build import build_run
from trainer.loop.callbacks import TrainerCallback
from trainer.loop.faults import FaultInjection
from trainer.model.modeling import init_weights
from trainer.runtime.distributed import (
    SHM_BUFFER_PREFIX,
    all_gather_object,
    barrier,
    detect_hardware,
    dist_info,
    init_distributed,
)
from trainer.runtime.mesh import Mesh
from trainer.runtime.ranks import EXIT_NONFINITE

VOCAB = 256
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4
)


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False, **TINY
    )


def token_dataset(n: int, seed: int = 0, min_len: int = 8, max_len: int = 32) -> datasets.Dataset:
    """Sequences of varying length, so batches carry different amounts of padding."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        rows.append(torch.randint(1, VOCAB, (length,), generator=g).tolist())
    return datasets.Dataset.from_dict({"input_ids": rows})


def learnable_dataset(n: int) -> datasets.Dataset:
    """Repeating patterns: a tiny model's loss falls fast on these."""
    return datasets.Dataset.from_dict(
        {"input_ids": [[(i + k) % 16 + 1 for k in range(24)] for i in range(n)]}
    )


def build_tiny_run(
    args: TrainingArguments, train_ds=None, eval_ds=None, callbacks=None, config=None
) -> Trainer:
    """The tiny model's run, built as every run is (``build_run``), on token datasets of our own."""
    run = RunConfig(training=args)
    return build_run(
        run,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        config=config or tiny_config(),
        data_collator=CausalLMCollator(0),
        callbacks=callbacks,
    )


def run_trainer(
    out: Path,
    name: str,
    train_ds,
    callbacks: list[TrainerCallback] | None = None,
    prepare: Callable[[torch.nn.Module], None] | None = None,
    **overrides,
) -> tuple[Trainer, list[float]]:
    """Train through the public API; ``prepare`` sees the model before the Trainer does."""
    fields = dict(
        output_dir=str(out / name),
        max_steps=20,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = build_tiny_run(TrainingArguments(**{**fields, **overrides}), train_ds, callbacks=callbacks)
    if prepare is not None:
        prepare(trainer.model)
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return trainer, losses


def grad_norms(trainer: Trainer) -> list[float | None]:
    return [row.get("grad_norm") for row in trainer.state.log_history if "loss" in row]


def engine_kind(trainer: Trainer) -> dict:
    """What DeepSpeed actually built: the ZeRO stage it runs, its optimizer wrapper, the base optimizer."""
    ds = trainer.engine.ds
    return {
        "zero_stage": ds.zero_optimization_stage(),
        "wrapper": type(ds.optimizer).__name__,
        "optimizer": f"{type(ds.basic_optimizer).__module__}.{type(ds.basic_optimizer).__name__}",
    }


class StepsRun(TrainerCallback):
    """What this process trained: the step it began at (after any resume) and each step it finished.
    A run that silently restarted from scratch begins at 0 and re-runs steps the checkpoint holds."""

    def __init__(self) -> None:
        self.began_at: int | None = None
        self.steps: list[int] = []

    def on_train_begin(self, args, state, control, **kw):
        self.began_at = state.global_step

    def on_step_end(self, args, state, control, **kw):
        self.steps.append(state.global_step)

    def report(self) -> dict:
        return {"began_at": self.began_at, "steps_run": self.steps}


class AsyncSaveProbe(TrainerCallback):
    """Holds the background writes of ``checkpoint-<save_step>`` until the loop has finished a later
    step, and records when that checkpoint was committed (on_save fires at the commit).

    A save that really runs in the background lets the loop step on, which opens the gate at once.
    A save that writes on the loop's thread waits out the timeout: the gate stays shut, and the
    commit happens at the save's own step."""

    def __init__(self, save_step: int, timeout: float = 30.0):
        self.save_step = save_step
        self.timeout = timeout
        self.stepped = threading.Event()
        self.writes: list[dict] = []
        self.steps_while_held: list[int] = []
        self.commits: dict[str, int] = {}
        self._holding = 0

    def on_step_end(self, args, state, control, **kw):
        if self._holding:
            self.steps_while_held.append(state.global_step)
        if state.global_step > self.save_step:
            self.stepped.set()

    def on_save(self, args, state, control, checkpoint=None, **kw):
        self.commits[Path(checkpoint).name] = state.global_step

    def install(self) -> Callable[[], None]:
        """Wrap FileWriter._write (test-side only); returns the undo."""
        original = FileWriter._write
        probe = self

        def held(writer, obj, path, zipfile):
            if writer.root.name.endswith(f"checkpoint-{probe.save_step}"):
                probe._holding += 1
                opened = probe.stepped.wait(probe.timeout)
                probe.stepped.set()  # after one timeout the rest need not wait: the result is known
                probe._holding -= 1
                probe.writes.append(
                    {"file": Path(path).name, "thread": threading.current_thread().name, "opened": opened}
                )
            return original(writer, obj, path, zipfile)

        FileWriter._write = held
        return lambda: setattr(FileWriter, "_write", original)

    def report(self) -> dict:
        return {"writes": self.writes, "steps_while_held": self.steps_while_held, "commits": self.commits}


def save_weights(trainer: Trainer, path: Path) -> None:
    state = trainer.engine.full_state_dict()
    if state is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.float() for k, v in state.items()}, path)


# ---- scenarios -----------------------------------------------------------------------------------


def zero_stages(out: Path) -> dict:
    data = token_dataset(96)
    result = {"engine": {}, "async": {}}
    for stage in (0, 1, 2, 3):
        # Checkpoints at steps 10 and 20 (the latter for the export round trip): asynchronous on
        # ZeRO 1 and 3, where the writes of checkpoint-10 are held until the loop has stepped on.
        asynchronous = stage % 2 == 1
        probe = AsyncSaveProbe(save_step=10) if asynchronous else None
        undo = probe.install() if probe else None
        try:
            trainer, losses = run_trainer(
                out,
                f"zero{stage}",
                data,
                callbacks=[probe] if probe else None,
                zero_stage=stage,
                save_strategy="steps",
                save_steps=10,
                async_save=asynchronous,
            )
        finally:
            if undo:
                undo()
        save_weights(trainer, out / "zero_stages" / f"zero{stage}.pt")
        result[f"zero{stage}"] = losses
        result["engine"][f"zero{stage}"] = engine_kind(trainer)
        if probe:
            result["async"][f"zero{stage}"] = probe.report()
    return result


def grad_accum(out: Path) -> dict:
    """micro 2 x accum 4 x 2 ranks against one big-batch step computed by plain torch."""
    data = token_dataset(64, seed=1)
    result = {}
    for stage in (2, 3):
        steps = 3
        trainer, losses = run_trainer(
            out,
            f"accum{stage}",
            data,
            zero_stage=stage,
            max_steps=steps,
            gradient_accumulation_steps=4,
            weight_decay=0.1,
            max_grad_norm=0.5,  # below the norms of these steps (~0.8): clipping is at work
        )
        save_weights(trainer, out / "grad_accum" / f"zero{stage}.pt")
        result[f"zero{stage}"] = losses
        result[f"zero{stage}_grad_norm"] = grad_norms(trainer)
    if dist_info().is_main:
        ref, ref_losses, ref_norms = reference_big_batch(data, steps=3, micro=2, accum=4, world=2, clip=0.5)
        torch.save(ref, out / "grad_accum" / "reference.pt")
        result["reference"] = ref_losses
        result["reference_grad_norm"] = ref_norms
    return result


def reference_big_batch(
    data, steps: int | None, micro: int, accum: int, world: int, weight_decay: float = 0.1, clip: float = 1.0
):
    """What one process with the whole global batch computes in plain torch (no DeepSpeed, none of
    the trainer's loss code): per optimizer step, the sum of every target token's loss over the
    window's rows on all ranks, divided by their number; torch AdamW, decay on matrices only.
    ``steps=None``: one epoch, whose last window holds whatever rows are left.
    Returns (final weights, loss per step, gradient norm before clipping per step)."""
    model = LlamaForCausalLM(tiny_config())
    init_weights(model, seed=0)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    # Which rows each rank reads, in order: the distributed sampler's epoch-0 shards.
    shards = [list(ResumableDistributedSampler(len(data), world, r, seed=0)) for r in range(world)]
    per_step = micro * accum
    if steps is None:
        steps = -(-len(shards[0]) // per_step)
    losses, norms = [], []
    for step in range(steps):
        rows = [
            data[i]["input_ids"] for shard in shards for i in shard[step * per_step : (step + 1) * per_step]
        ]
        tokens = sum(len(row) - 1 for row in rows)
        opt.zero_grad()
        total = 0.0
        for row in rows:
            ids = torch.tensor([row])
            logits = model(input_ids=ids).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum") / tokens
            loss.backward()
            total += loss.item()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total)
        norms.append(norm.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms


def partial_window(out: Path) -> dict:
    """One epoch of 20 rows on 2 ranks, micro 2 x accumulation 2: windows of 8, 8 and then 4 rows
    (one micro-batch per rank) against the plain-torch loop over the same rows. No clipping, so a
    wrongly scaled short window changes the update as well as the norm; ZeRO-2, which reports the
    norm even when it does not clip."""
    data = token_dataset(20, seed=6)
    trainer, losses = run_trainer(
        out,
        "partial",
        data,
        zero_stage=2,
        max_steps=-1,
        num_train_epochs=1,
        weight_decay=0.1,
        max_grad_norm=0.0,
    )
    save_weights(trainer, out / "partial_window" / "trainer.pt")
    result = {
        "losses": losses,
        "grad_norm": grad_norms(trainer),
        "steps": trainer.state.global_step,
        "epoch": trainer.state.epoch,
    }
    if dist_info().is_main:
        ref, ref_losses, ref_norms = reference_big_batch(data, None, micro=2, accum=2, world=2, clip=0.0)
        torch.save(ref, out / "partial_window" / "reference.pt")
        result.update(reference=ref_losses, reference_grad_norm=ref_norms)
    return result


def activation_checkpointing(out: Path) -> dict:
    """Gradients with and without recomputation: an HF model, and a custom one on DeepSpeed's API."""
    batch = CausalLMCollator(0)([token_dataset(4, seed=2)[i] for i in range(4)])

    def hf_grads(checkpointing: bool) -> dict:
        set_seed(0)
        model = LlamaForCausalLM(tiny_config())
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        causal_lm_loss_sum(logits, batch["labels"]).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, ckpt = hf_grads(False), hf_grads(True)
    hf_diff = max((plain[n] - ckpt[n]).abs().max().item() for n in plain)
    custom = {mode: custom_model_grads(mode) for mode in ("off", "on")}
    custom_diff = max(
        (custom["off"][n] - custom["on"][n]).abs().max().item() for n in custom["off"] if n != "_used"
    )
    return {
        "hf_max_abs_diff": hf_diff,
        "custom_max_abs_diff": custom_diff,
        "custom_used_checkpoint": custom["on"]["_used"].item(),
        "trainer": {mode: trainer_checkpointing(out, mode) for mode in (False, True)},
    }


def trainer_checkpointing(out: Path, enabled: bool) -> dict:
    """TrainingArguments(gradient_checkpointing=...) through the Trainer: 3 steps x 2 micro-batches
    per rank (ZeRO-2, which reports the gradient norm), counting how often the first decoder
    layer's MLP starts a forward: once per micro-batch, and again in backward when recomputed.

    A pre-hook on a sub-module, because transformers checkpoints the layer's ``forward`` (hooks on
    the layer itself stay outside the checkpoint and fire once) and torch's non-reentrant
    recomputation stops early, inside the last module whose activations it needs (so a post-hook
    there never fires on the replay)."""
    calls = [0]

    def count(module, inputs):
        if module.training and torch.is_grad_enabled():
            calls[0] += 1

    def prepare(model):
        model.model.layers[0].mlp.register_forward_pre_hook(count)

    trainer, losses = run_trainer(
        out, f"ac_{'on' if enabled else 'off'}", token_dataset(32, seed=7), prepare=prepare,
        zero_stage=2, max_steps=3, gradient_checkpointing=enabled,
    )  # fmt: skip
    return {
        "mlp0_forwards": calls[0],
        "micro_batches": 3 * 2,
        "losses": losses,
        "grad_norm": grad_norms(trainer),
    }


class CheckpointedMLP(torch.nn.Module):
    """A custom model whose blocks go through ``deepspeed.checkpointing.checkpoint`` when enabled."""

    def __init__(self, use_checkpointing: bool):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
            for _ in range(3)
        )
        self.use_checkpointing = use_checkpointing
        self.calls = 0

    def forward(self, x):
        for block in self.blocks:
            if self.use_checkpointing:
                self.calls += 1
                x = x + deepspeed.checkpointing.checkpoint(block, x)
            else:
                x = x + block(x)
        return x


def custom_model_grads(mode: str, section: dict | None = None) -> dict:
    set_seed(0)
    model = CheckpointedMLP(use_checkpointing=mode == "on")
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        # DeepSpeed 0.19 mis-shapes partitioned and CPU-checkpointed activations when there is no
        # model-parallel group (seen here), so the plain recomputation path is what is checked.
        "activation_checkpointing": section or {"partition_activations": False, "cpu_checkpointing": False},
        "steps_per_print": 10**9,
    }
    engine = DeepSpeedEngine(model, config, Mesh(world_size=1))
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
    engine.ds.set_gradient_accumulation_boundary(True)
    loss = engine.ds(x).pow(2).sum()
    engine.ds.backward(loss)
    grads = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
    grads["_used"] = torch.tensor(float(model.calls))
    return grads


def bf16(out: Path) -> dict:
    data = learnable_dataset(64)
    result = {}
    for stage in (0, 2, 3):
        trainer, losses = run_trainer(
            out, f"bf16_z{stage}", data, zero_stage=stage, bf16=True, max_steps=10, learning_rate=3e-3
        )
        trainer.save_model(str(out / f"bf16_z{stage}" / "final"))
        result[f"zero{stage}"] = {
            "losses": losses,
            "export": str(out / f"bf16_z{stage}" / "final"),
            "precision": trainer.ds_config.get("bf16", {}),
            "wrapper": type(trainer.engine.ds.optimizer).__name__,
            # Adam's step count, which its bias correction reads
            "adam_steps": sorted({int(s["step"]) for s in trainer.engine.ds.basic_optimizer.state.values()}),
        }
    return result


def offload(out: Path) -> dict:
    data = learnable_dataset(64)
    result = {}
    for stage in (2, 3):
        trainer, losses = run_trainer(
            out,
            f"offload_z{stage}",
            data,
            zero_stage=stage,
            offload_optimizer="cpu",
            max_steps=10,
            learning_rate=3e-3,
        )
        opt_name = type(trainer.engine.ds.optimizer).__name__
        inner = getattr(trainer.engine.ds.optimizer, "optimizer", None)
        result[f"zero{stage}"] = {
            "losses": losses,
            "optimizer": opt_name,
            "inner": type(inner).__name__ if inner is not None else None,
            "engine": engine_kind(trainer),
        }
    # optim=adamw_fused (DeepSpeed's FusedAdam) under ZeRO-3: two steps are enough to see the engine.
    trainer, losses = run_trainer(out, "fused_z3", data, zero_stage=3, optim="adamw_fused", max_steps=2)
    result["fused_zero3"] = {"losses": losses, "engine": engine_kind(trainer)}
    return result


def evaluate_zero3(out: Path) -> dict:
    """evaluate() under ZeRO-3 with 13 samples on 2 ranks (one padded row) against plain torch."""
    data = token_dataset(13, seed=4)
    args = TrainingArguments(
        output_dir=str(out / "eval_z3"), zero_stage=3, per_device_eval_batch_size=4, disable_tqdm=True, seed=0
    )
    metrics = build_tiny_run(args, eval_ds=data).evaluate()
    per_rank = all_gather_object(metrics["eval_loss"])
    model = LlamaForCausalLM(tiny_config())
    init_weights(model, seed=0)
    total, count = 0.0, 0
    with torch.no_grad():
        for row in data:
            b = CausalLMCollator(0)([row])
            total += causal_lm_loss_sum(model(input_ids=b["input_ids"]).logits, b["labels"]).item()
            count += count_targets(b)
    return {"per_rank": per_rank, "reference": total / count}


def nonfinite(out: Path) -> dict:
    """A NaN loss injected at step 6 under each policy (checkpoints every 4 steps)."""
    data = learnable_dataset(64)
    result = {}
    for policy in ("skip", "rollback", "stop"):
        try:
            trainer, losses = run_trainer(
                out,
                f"nan_{policy}",
                data,
                callbacks=[FaultInjection({"kind": "nan", "step": 6})],
                zero_stage=2,
                max_steps=10,
                save_steps=4,
                logging_steps=2,
                save_strategy="steps",
                learning_rate=3e-3,
                nonfinite_policy=policy,
            )
            state = trainer.state
            weights = trainer.engine.full_state_dict()
            finite = None if weights is None else all(bool(torch.isfinite(v).all()) for v in weights.values())
            rows = state.log_history
            result[policy] = {
                "exit": 0,
                "steps": state.global_step,
                "rollbacks": state.rollbacks,
                "lr_scale": state.lr_scale,
                "nonfinite_windows": state.nonfinite_windows,
                "weights_finite": finite,
                "lrs": [r["learning_rate"] for r in rows if "learning_rate" in r],
                "losses": [None if not math.isfinite(x) else x for x in losses],
            }
        except SystemExit as stop:
            result[policy] = {"exit": stop.code, "expected": EXIT_NONFINITE}
        saved = sorted(p.name for p in (out / f"nan_{policy}").glob("checkpoint-*"))
        result[policy]["checkpoints"] = saved
    return result


SCENARIOS = {
    f.__name__: f
    for f in (
        zero_stages,
        grad_accum,
        partial_window,
        activation_checkpointing,
        bf16,
        offload,
        evaluate_zero3,
        nonfinite,
    )
}


def main() -> int:
    out, *names = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out = Path(out)
    init_distributed(detect_hardware())
    # DeepSpeed's shared-memory all-reduce (inference only): neither loaded nor given a buffer
    port = os.environ["MASTER_PORT"]
    results = {
        "shm_op_loaded": getattr(deepspeed.comm.comm.cdb, "shm_comm_op", None) is not None,
        "shm_buffers": sorted(p.name for p in Path("/dev/shm").glob(f"{SHM_BUFFER_PREFIX}*_{port}_*")),
    }
    for name in names:
        results[name] = SCENARIOS[name](out)
        barrier(name)
    # py-cpuinfo's answers asked by the op loads (CPU Adam, FusedAdam): fresh interpreters, and hits
    results["cpu_info_asked"] = getattr(cpuinfo.get_cpu_info, "cache_info", lambda: None)()
    if dist_info().is_main:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    exit_now(main())
