"""The tiled loss and tiled MLPs under ZeRO-2 and ZeRO-3 on ranks with different token counts,
against the untiled model: one backward each, then the loss and every full gradient of each rank
are recorded.

ZeRO-2 reduces each gradient from a hook when it is accumulated: the tiled MLPs accumulate once
per tile and must hold the reduction until the last one. ZeRO-3 is set to release every parameter
after each use, so each call of a partitioned module is a collective gather, and unequal tile
counts would break the run (a collective mismatch).
Usage: ``deepspeed --num_gpus 2 tests/helpers/tiling_zero.py OUT``; writes ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.utils import safe_get_full_grad
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.cli.main import exit_now
from trainer.data import IGNORE_INDEX
from trainer.engine.tiling import decoder_and_head, tile_mlp, tiled_loss_sum
from trainer.runtime.distributed import detect_hardware, dist_info, init_distributed

VOCAB, TILE = 512, 8
RUNS = (("untiled", False), ("tiled", True))
STAGE3 = {
    "stage3_param_persistence_threshold": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_prefetch_bucket_size": 0,
}
CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=True,
                     attn_implementation="sdpa")  # fmt: skip


def engine(stage: int, tiled: bool) -> deepspeed.DeepSpeedEngine:
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, **(STAGE3 if stage == 3 else {})},
    }
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=stage == 3):
        model = LlamaForCausalLM(CONFIG)
    if tiled:
        tile_mlp(model, TILE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    return deepspeed.initialize(model=model, config=config, optimizer=optimizer)[0]


def loss_and_grads(stage: int, tiled: bool, input_ids: torch.Tensor) -> tuple[float, dict[str, list[float]]]:
    ds = engine(stage, tiled)
    targets = F.pad(input_ids[:, 1:], (0, 1), value=IGNORE_INDEX)
    if tiled:
        decoder, head = decoder_and_head(ds.module)
        loss = tiled_loss_sum(decoder(input_ids=input_ids).last_hidden_state, head, targets, TILE)
    else:
        logits = ds(input_ids=input_ids).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
    ds.backward(loss)
    grads = {n: safe_get_full_grad(p).flatten().tolist() for n, p in ds.module.named_parameters()}
    return loss.item(), grads


def main() -> int:
    out = Path([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])
    init_distributed(detect_hardware())
    rank = dist_info().rank
    # 64 tokens on rank 0, 13 on rank 1: 8 tiles against 2, and 13 MLP rows cannot make 8 chunks.
    length = 64 if rank == 0 else 13
    input_ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(rank))
    result = {
        f"zero{stage}": {name: loss_and_grads(stage, tiled, input_ids) for name, tiled in RUNS}
        for stage in (2, 3)
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    exit_now(main())
