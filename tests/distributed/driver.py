"""Runs engine/Trainer scenarios on 2 ranks under the real ``deepspeed`` launcher.

One launch serves many tests (each launch costs start-up time): every scenario writes its numbers
into ``<out>/results.json`` and its weights into ``<out>/<scenario>/*.pt``; the pytest side only
compares. Usage: ``deepspeed --num_gpus 2 tests/distributed/driver.py OUT SCENARIO [SCENARIO ...]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer import Trainer, TrainingArguments
from trainer.args import ModelArguments
from trainer.config import resolve
from trainer.data import CausalLMCollator, ResumableDistributedSampler
from trainer.distributed import barrier, detect_hardware, dist_info, init_distributed
from trainer.engine import Engine, causal_lm_loss_sum, count_targets, weight_decay_groups
from trainer.modeling import build_model, init_weights
from trainer.trainer import set_seed

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


def make_model(ds_config: dict) -> torch.nn.Module:
    set_seed(0)
    return build_model(ModelArguments(), tiny_config(), ds_config, seed=0)


def run_trainer(out: Path, name: str, train_ds, **overrides) -> tuple[Trainer, list[float]]:
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
    args = TrainingArguments(**{**fields, **overrides})
    ds_config = resolve(
        args, dist_info().world_size, detect_hardware(), hidden_size=TINY["hidden_size"], total_steps=1
    )
    trainer = Trainer(
        model=make_model(ds_config), args=args, train_dataset=train_ds, data_collator=CausalLMCollator(0)
    )
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return trainer, losses


def save_weights(trainer: Trainer, path: Path) -> None:
    state = trainer.engine.full_state_dict()
    if state is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.float() for k, v in state.items()}, path)


# ---- scenarios -----------------------------------------------------------------------------------


def zero_stages(out: Path) -> dict:
    data = token_dataset(96)
    result = {}
    for stage in (0, 1, 2, 3):
        # A checkpoint at the last step, for the export round trip: asynchronous on ZeRO 1 and 3.
        trainer, losses = run_trainer(
            out,
            f"zero{stage}",
            data,
            zero_stage=stage,
            save_strategy="steps",
            save_steps=20,
            async_save=stage % 2 == 1,
        )
        save_weights(trainer, out / "zero_stages" / f"zero{stage}.pt")
        result[f"zero{stage}"] = losses
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
            max_grad_norm=1.0,
        )
        save_weights(trainer, out / "grad_accum" / f"zero{stage}.pt")
        result[f"zero{stage}"] = losses
    if dist_info().is_main:
        ref, ref_losses = reference_big_batch(data, steps=3, micro=2, accum=4, world=2)
        torch.save(ref, out / "grad_accum" / "reference.pt")
        result["reference"] = ref_losses
    return result


def reference_big_batch(data, steps: int, micro: int, accum: int, world: int):
    """What one rank with the whole global batch would compute: sum of token losses / tokens."""
    model = LlamaForCausalLM(tiny_config())
    init_weights(model, seed=0)
    groups = weight_decay_groups(model, 0.1)
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    shards = [list(ResumableDistributedSampler(len(data), world, r, seed=0)) for r in range(world)]
    per_step = micro * accum
    losses = []
    for step in range(steps):
        rows = [data[i] for shard in shards for i in shard[step * per_step : (step + 1) * per_step]]
        batches = [CausalLMCollator(0)([row]) for row in rows]
        tokens = sum(count_targets(b) for b in batches)
        opt.zero_grad()
        total = 0.0
        for b in batches:
            loss = causal_lm_loss_sum(model(input_ids=b["input_ids"]).logits, b["labels"]) / tokens
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(total)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


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
        import deepspeed

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
    engine = Engine(model, config)
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
    for stage in (2, 3):
        trainer, losses = run_trainer(
            out, f"bf16_z{stage}", data, zero_stage=stage, bf16=True, max_steps=10, learning_rate=3e-3
        )
        trainer.save_model(str(out / f"bf16_z{stage}" / "final"))
        result[f"zero{stage}"] = {
            "losses": losses,
            "export": str(out / f"bf16_z{stage}" / "final"),
            "precision": trainer.ds_config.get("bf16", {}),
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
        }
    return result


def evaluate_zero3(out: Path) -> dict:
    """evaluate() under ZeRO-3 with 13 samples on 2 ranks (one padded row) against plain torch."""
    data = token_dataset(13, seed=4)
    args = TrainingArguments(
        output_dir=str(out / "eval_z3"), zero_stage=3, per_device_eval_batch_size=4, disable_tqdm=True
    )
    ds_config = resolve(
        args, dist_info().world_size, detect_hardware(), hidden_size=TINY["hidden_size"], total_steps=1
    )
    trainer = Trainer(
        model=make_model(ds_config), args=args, eval_dataset=data, data_collator=CausalLMCollator(0)
    )
    metrics = trainer.evaluate()
    from trainer.distributed import all_gather_object

    per_rank = all_gather_object(metrics["eval_loss"])
    model = LlamaForCausalLM(tiny_config())
    init_weights(model, seed=0)
    total, count = 0.0, 0
    with torch.no_grad():
        for row in data:
            b = CausalLMCollator(0)([row])
            total += causal_lm_loss_sum(model(input_ids=b["input_ids"]).logits, b["labels"]).item()
            count += count_targets(b)
    return {"per_rank": per_rank, "reference": total / count, "perplexity": metrics["eval_perplexity"]}


def nonfinite(out: Path) -> dict:
    """A NaN loss injected at step 6 under each policy (checkpoints every 4 steps)."""
    import math
    import os

    from trainer.distributed import EXIT_NONFINITE

    data = learnable_dataset(64)
    result = {}
    for policy in ("skip", "rollback", "stop"):
        os.environ["TRAINER_FAULT"] = "nan:step=6"
        try:
            trainer, losses = run_trainer(
                out,
                f"nan_{policy}",
                data,
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
        finally:
            del os.environ["TRAINER_FAULT"]
        saved = sorted(p.name for p in (out / f"nan_{policy}").glob("checkpoint-*"))
        result[policy]["checkpoints"] = saved
    return result


SCENARIOS = {
    f.__name__: f
    for f in (zero_stages, grad_accum, activation_checkpointing, bf16, offload, evaluate_zero3, nonfinite)
}


def main() -> int:
    out, *names = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out = Path(out)
    init_distributed(detect_hardware())
    results = {}
    for name in names:
        results[name] = SCENARIOS[name](out)
        barrier(name)
    if dist_info().is_main:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
