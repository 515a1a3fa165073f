"""The job every system runs: model, data, batch sizes, DeepSpeed config, steps and seed.

The coordinator writes a ``Job`` as JSON; every rank of every system reads the same file, builds
the same model from the same seed, reads the same token blocks and resolves the same DeepSpeed
config. The DeepSpeed config is our resolver's output for the job's arguments (no ``"auto"``), and
the ``ours`` worker checks that the Trainer resolved exactly the same dict.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SYSTEMS = ("ours", "deepspeed", "hf_trainer", "accelerate", "ours_tp")

# Llama-style shapes. "1b" is TinyLlama's: 22 layers, hidden 2048, grouped-query attention,
# 1.1B parameters with a 32000-token vocabulary.
MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    ),
    "medium": dict(  # 107M parameters with a 4096-token vocabulary: model states outweigh the libraries
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        tie_word_embeddings=True,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}


@dataclass
class Job:
    device: str  # cpu | cuda
    model: str  # a key of MODELS
    vocab_size: int
    seq_len: int
    micro_batch: int
    grad_accum: int
    steps: int  # optimizer steps per system
    warmup: int  # first steps of each system left out of the medians
    chunk: int  # steps a system runs before the next one takes its turn
    zero_stage: int
    precision: str  # fp32 | bf16
    gradient_checkpointing: bool
    seed: int
    learning_rate: float
    lr_warmup_steps: int
    data_path: str
    world_size: int
    out_dir: str
    profile_dir: str | None = None
    profile_steps: int = 3
    release_cache: bool = False  # CUDA: hand cached blocks back while waiting for the turn
    # The ours_tp system: ours with AutoTP over this many ranks at this ZeRO stage, the same global batch.
    tensor_parallel: int = 1
    tensor_parallel_zero_stage: int = 1
    splits_layers: bool = False  # this job is the ours_tp system's (``tensor_parallel_job``)

    # ---- serialisation ---------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Job:
        return cls(**json.loads(Path(path).read_text()))

    @property
    def data_parallel(self) -> int:
        """The ranks that read rows of their own (a tensor-parallel group reads one set)."""
        return self.world_size // (self.tensor_parallel if self.splits_layers else 1)

    def tensor_parallel_job(self) -> Job:
        """The ours_tp system's job: AutoTP over ``tensor_parallel`` ranks, which read the same rows,
        so each reads that many times more of them (the global batch, and the data, stay the same)."""
        return dataclasses.replace(
            self,
            micro_batch=self.micro_batch * self.tensor_parallel,
            zero_stage=self.tensor_parallel_zero_stage,
            splits_layers=True,
        )

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step on all ranks (the blocks hold no padding)."""
        return self.micro_batch * self.grad_accum * self.data_parallel * self.seq_len

    @property
    def num_samples(self) -> int:
        """Blocks for exactly one epoch of ``steps`` optimizer steps."""
        return self.steps * self.micro_batch * self.grad_accum * self.data_parallel

    # ---- what every system shares ----------------------------------------------------------------

    def model_config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            **MODELS[self.model], vocab_size=self.vocab_size, max_position_embeddings=self.seq_len
        )

    def training_args(self, output_dir: str) -> Any:
        """Our TrainingArguments for the job; the other systems mirror these values."""
        from trainer.args import TrainingArguments

        return TrainingArguments(
            output_dir=output_dir,
            max_steps=self.steps,
            seed=self.seed,
            per_device_train_batch_size=self.micro_batch,
            gradient_accumulation_steps=self.grad_accum,
            optim="adamw_torch",
            learning_rate=self.learning_rate,
            # Zero: HF's DeepSpeed path hands all parameters to DeepSpeed as one group, so any
            # decay would also hit the norms there and the systems would differ in the update.
            weight_decay=0.0,
            max_grad_norm=1.0,
            lr_scheduler_type="cosine",
            warmup_steps=self.lr_warmup_steps,
            # DeepSpeed's own cosine, named as HF-style files name it, so that the hand-written loop
            # and accelerate's DummyScheduler run the same schedule from the same dict.
            deepspeed={
                "scheduler": {
                    "type": "WarmupCosineLR",
                    "params": {
                        "warmup_num_steps": "auto",
                        "total_num_steps": "auto",
                        "warmup_min_ratio": 0.0,
                        "cos_min_ratio": 0.0,
                        "warmup_type": "linear",
                    },
                }
            },
            # Logs only at the end (the step clock adds the step before it): a log is a host sync.
            logging_steps=self.steps,
            eval_strategy="no",
            save_strategy="no",
            disable_tqdm=True,
            report_to=[],
            zero_stage=self.zero_stage,
            precision=self.precision,
            gradient_checkpointing=self.gradient_checkpointing,
            **({"tensor_parallel_size": self.tensor_parallel} if self.splits_layers else {}),
        )

    def run_config(self, output_dir: str) -> Any:
        """The job as our run config (what ``build_run`` builds the "ours" system from)."""
        from trainer.args import ModelArguments, RunConfig

        return RunConfig(training=self.training_args(output_dir), model=ModelArguments(model_type="llama"))

    def ds_config(self) -> dict[str, Any]:
        """The DeepSpeed config of the job, as our run plans it for these arguments (``plan_run``,
        as ``build_run`` does): what the other systems are given."""
        from trainer.loop.plan import plan_run
        from trainer.runtime.distributed import DistInfo, detect_hardware

        return plan_run(
            self.training_args(self.out_dir),
            detect_hardware(),
            DistInfo(rank=0, local_rank=0, world_size=self.world_size),
            num_samples=None,
            total_steps=self.steps,
            hidden_size=MODELS[self.model]["hidden_size"],
        ).ds_config

    def build_model(self, ds_config: dict[str, Any]) -> Any:
        """The same weights in every system: each parameter drawn from its own seed (under ZeRO-3,
        partitioned at creation)."""
        from trainer.args import ModelArguments
        from trainer.model.modeling import build_model

        return build_model(
            ModelArguments(model_type="llama"),
            self.model_config(),
            ds_config,
            self.gradient_checkpointing,
            seed=self.seed,
        )

    def dataset(self) -> BlockDataset:
        import torch

        data = torch.load(self.data_path, weights_only=True)
        return BlockDataset(data["input_ids"])


class BlockDataset:
    """Fixed-length token blocks; labels are the inputs (the model shifts them). No padding, so every
    position is a target and per-batch means and per-window token sums weigh tokens alike."""

    def __init__(self, input_ids: Any):
        self.input_ids = input_ids

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.input_ids[index]
        return {"input_ids": row, "labels": row}


def collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def prepare_data(source: str, vocab_size: int, seq_len: int, num_samples: int, seed: int, path: Path) -> int:
    """Write ``num_samples`` token blocks of ``seq_len`` to ``path``; returns the vocabulary size.

    ``stdlib``: the Python standard library's source, tokenised and packed by our data pipeline
    (only the token ids are kept: no document boundaries, the same plain causal LM in every system).
    ``random``: uniform random tokens, for machines without the corpus tools or time to tokenise.
    """
    import torch

    if source == "random":
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab_size, (num_samples, seq_len), generator=gen)
    else:
        from trainer.args import DataArguments, ModelArguments
        from trainer.data import build_datasets, get_tokenizer

        data_args = DataArguments(dataset="stdlib", block_size=seq_len)
        tokenizer = get_tokenizer(ModelArguments(vocab_size=vocab_size), data_args)
        train, _ = build_datasets(data_args, tokenizer, seed=seed)
        if len(train) < num_samples:
            raise SystemExit(
                f"bench: the corpus has {len(train)} blocks of {seq_len}; the job needs {num_samples}"
            )
        ids = torch.tensor(train.select(range(num_samples))["input_ids"], dtype=torch.long)
        vocab_size = len(tokenizer)
    torch.save({"input_ids": ids.long().contiguous(), "source": source}, path)
    return vocab_size
