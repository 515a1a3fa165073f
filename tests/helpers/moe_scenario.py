"""A mixture-of-experts model of a class no list knows, trained through the public API.

A tiny Llama whose MLPs are ``RoutedMLP`` blocks: a router and a ``ModuleList`` of eight experts,
each token sent to its top expert (scaled by the router's probability, so the router learns). Ranks
see different tokens, so they run different experts: under ZeRO-3 each expert's gather would be
asked for by some ranks only, and the run would hang, unless the block is gathered whole.

The router's load-balancing loss is on (``router_aux_loss_coef``; the block names its ``top_k``).

Usage: ``[torchrun --nproc_per_node 2] tests/helpers/moe_scenario.py OUT BATCH GRAD_ACC STAGE [STAGE ...]``
(runs whose ranks x BATCH x GRAD_ACC agree see the same rows in each step, however grouped). Rank
0 writes ``OUT/zero<STAGE>.json``: the losses, router losses and grad norms of 3 steps, the blocks
the engine made ZeRO-3 leaves, and which experts each rank ran in its first forward; or the error
a stage was refused with.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP

from tests.helpers.trainer_scenarios import VOCAB, token_dataset
from trainer import Trainer, TrainingArguments
from trainer.cli.main import exit_now
from trainer.config import ConfigError
from trainer.data import CausalLMCollator
from trainer.engine.experts import expert_blocks

EXPERTS = 8


class RoutedMLP(torch.nn.Module):
    """Top-1 routing over a list of Llama MLPs."""

    top_k = 1  # what the router loss reads: each token's picks

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.router = torch.nn.Linear(config.hidden_size, EXPERTS, bias=False)
        self.experts = torch.nn.ModuleList(LlamaMLP(config) for _ in range(EXPERTS))
        self.first: list[int] | None = None  # the experts the first forward ran

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        probs = self.router(flat).softmax(-1)
        weight, chosen = probs.max(-1)
        out = torch.zeros_like(flat)
        picked = chosen.unique().tolist()  # only the experts some token of this rank picked
        self.first = picked if self.first is None else self.first
        for e in picked:
            rows = chosen == e
            out[rows] = self.experts[e](flat[rows]) * weight[rows, None]
        return out.reshape(hidden.shape)


def model() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    llama = LlamaForCausalLM(config)
    for layer in llama.model.layers:
        layer.mlp = RoutedMLP(config)
    return llama


def run(out: Path, batch: int, grad_acc: int, stage: int) -> None:
    policy = model()
    args = TrainingArguments(
        output_dir=str(out / f"zero{stage}"), max_steps=3, per_device_train_batch_size=batch, gradient_accumulation_steps=grad_acc,
        learning_rate=1e-2,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=0, zero_stage=stage, router_aux_loss_coef=0.1,
    )  # fmt: skip
    data = token_dataset(16, seed=3, min_len=4, max_len=8)  # a few tokens a rank: few experts
    trainer = Trainer(model=policy, args=args, train_dataset=data, data_collator=CausalLMCollator(0))
    blocks = trainer.model.model.layers[0].mlp
    try:
        trainer.train()  # the engine is built here
    except ConfigError as err:
        if dist.get_rank() == 0:
            (out / f"zero{stage}.json").write_text(json.dumps({"refused": str(err)}))
        return
    ran = [None] * dist.get_world_size()
    dist.all_gather_object(ran, blocks.first)
    leaves = sorted({type(b).__name__ for b in expert_blocks(trainer.model) if getattr(b, "_z3_leaf", False)})
    if trainer.is_world_process_zero():
        history = [r for r in trainer.state.log_history if "loss" in r and "grad_norm" in r]
        (out / f"zero{stage}.json").write_text(json.dumps({
            "loss": [r["loss"] for r in history],
            "grad_norm": [r["grad_norm"] for r in history],
            "aux_loss": [r["aux_loss"] for r in history],
            "leaves": leaves,
            "experts_ran": ran,
        }))  # fmt: skip


def main() -> int:
    out, batch, grad_acc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    for stage in sys.argv[4:]:
        run(out, batch, grad_acc, int(stage))
    return 0


if __name__ == "__main__":
    exit_now(main())
