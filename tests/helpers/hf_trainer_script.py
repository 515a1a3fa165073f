"""An ordinary HF Trainer script. The test swaps its Trainer import for ours and runs it unchanged."""

import json
import sys
import tempfile
from pathlib import Path

import datasets
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    DataCollatorForLanguageModeling,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

# isort: off
from transformers import Trainer, TrainingArguments  # the test swaps this line for ours
# isort: on

output_dir = [a for a in sys.argv[1:] if not a.startswith("--local_rank")][
    0
]  # the launcher adds --local_rank
source = Path(datasets.__file__).with_name("arrow_dataset.py").read_text()
lines = [line for line in source.splitlines() if line.strip()][:600]

bpe = Tokenizer(models.BPE(unk_token="<unk>"))
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
bpe.train_from_iterator(
    lines, trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<pad>", "<eos>"])
)
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=bpe, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
)

raw = datasets.Dataset.from_dict({"text": lines}).train_test_split(test_size=0.1, seed=0)
tokenized = raw.map(
    lambda b: tokenizer(b["text"], truncation=True, max_length=32), batched=True, remove_columns=["text"]
)

model = LlamaForCausalLM(
    LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
    )
)
ds_config = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
}
args = TrainingArguments(
    output_dir=output_dir,
    per_device_train_batch_size=8,
    per_device_eval_batch_size=8,
    gradient_accumulation_steps=2,
    learning_rate=2e-3,
    warmup_steps=2,
    max_steps=12,
    logging_steps=4,
    eval_strategy="steps",
    eval_steps=6,
    save_strategy="no",
    report_to="none",
    seed=0,
    deepspeed=ds_config,
)
trainer = Trainer(
    model=model,
    args=args,
    train_dataset=tokenized["train"],
    eval_dataset=tokenized["test"],
    data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    processing_class=tokenizer,
)
train_result = trainer.train()
trainer.save_model()
trainer.log_metrics("train", train_result.metrics)
trainer.save_metrics("train", train_result.metrics)
trainer.save_state()
metrics = trainer.evaluate()
trainer.log_metrics("eval", metrics)
trainer.save_metrics("eval", metrics)
if trainer.is_world_process_zero():
    with tempfile.NamedTemporaryFile("w", dir=output_dir, suffix=".json", delete=False) as f:
        json.dump(metrics, f)
    print("METRICS", json.dumps(metrics))
