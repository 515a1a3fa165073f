"""An HF Trainer script over a streamed corpus, in the shape of run_clm's ``--streaming``: JSON-lines
shards through ``load_dataset(..., streaming=True)``, tokenised and grouped into blocks by
``IterableDataset.map``, given to the Trainer with ``max_steps`` and HF's default
``train_sampling_strategy`` ("random", which HF's Trainer does not apply to an IterableDataset). Its
only trainer-specific line is the import below: the test runs it with HF's Trainer and with ours.

Usage: ``hf_stream_scenario.py OUT SHARDS_DIR TOKENIZER_DIR [CHECKPOINT]``; every logged row goes to
``OUT/history.json``. With CHECKPOINT the run resumes from it.
"""

import json
import os
import sys
from itertools import chain
from pathlib import Path

import datasets
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, default_data_collator, set_seed

# isort: off
from transformers import Trainer, TrainingArguments  # the test swaps this line for ours
# isort: on

out, shards, tokenizer_dir, *resume = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
BLOCK = 32

tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
raw = datasets.load_dataset("json", data_files=sorted(map(str, Path(shards).glob("*.jsonl"))), streaming=True)


def group_texts(examples):
    joined = {k: list(chain(*examples[k])) for k in examples}
    usable = len(joined["input_ids"]) // BLOCK * BLOCK
    blocks = {k: [ids[i : i + BLOCK] for i in range(0, usable, BLOCK)] for k, ids in joined.items()}
    blocks["labels"] = [list(ids) for ids in blocks["input_ids"]]
    return blocks


tokenized = raw["train"].map(lambda b: tokenizer(b["content"]), batched=True, remove_columns=["content"])
train = tokenized.map(group_texts, batched=True)

set_seed(0)  # the model's initial weights
model = LlamaForCausalLM(
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=BLOCK)
)  # fmt: skip
args = TrainingArguments(
    output_dir=out,
    per_device_train_batch_size=4 // int(os.environ.get("WORLD_SIZE", "1")),  # a global batch of 4
    max_steps=24,
    learning_rate=2e-3,
    logging_steps=1,
    save_strategy="steps",
    save_steps=18,  # past the 64 lanes' first blocks: a resume reopens lanes mid-way
    report_to="none",
    seed=0,
)
trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=default_data_collator)
trainer.train(resume_from_checkpoint=resume[0] if resume else None)
if trainer.is_world_process_zero():
    (Path(out) / "history.json").write_text(json.dumps(trainer.state.log_history))
