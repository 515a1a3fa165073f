"""What reaches a model, as HF's Trainer hands it over: the columns ``model_columns`` keeps (HF's
``remove_unused_columns``), the collator ``default_collator_for`` picks, and the training and
evaluation batches keeping everything the collator made. Tiny HF models built from configs."""

from __future__ import annotations

import json
import logging
import textwrap
from types import SimpleNamespace

import datasets
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    BertConfig,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
    ViTConfig,
    ViTForImageClassification,
    ViTImageProcessorPil,
    default_data_collator,
)

from tests.helpers.launch import launch
from tests.helpers.sft_data import tokenizer as bpe_tokenizer
from trainer.args import TrainingArguments
from trainer.data import CausalLMCollator, ResumableDistributedSampler, default_collator_for, model_columns
from trainer.data.loader import accumulation_windows
from trainer.loop.evaluation import eval_batches

ARGS = TrainingArguments(output_dir="unused")
BERT = BertConfig(
    vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37
)


def bert_classifier() -> BertForSequenceClassification:
    return BertForSequenceClassification(BERT)


def llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


def table(**columns: list) -> datasets.Dataset:
    return datasets.Dataset.from_dict(columns)


GLUE_ROWS = {
    "input_ids": [[5, 6, 7], [8, 9]],
    "token_type_ids": [[0, 0, 1], [0, 1]],
    "attention_mask": [[1, 1, 1], [1, 1]],
    "label": [0, 1],
    "sentence": ["a b", "c"],
    "idx": [0, 1],
}


# ---- columns ------------------------------------------------------------------------------------


def test_bert_keeps_token_type_ids_and_its_label_and_drops_raw_text():
    kept = model_columns(table(**GLUE_ROWS), bert_classifier(), ARGS)
    assert kept.column_names == ["input_ids", "token_type_ids", "attention_mask", "label"]


def test_a_vit_image_classifier_keeps_pixel_values_and_labels():
    config = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=37,
        num_labels=3,
    )
    rows = table(pixel_values=[[[[0.0] * 8] * 8] * 3] * 2, labels=[0, 2], image_file=["a.png", "b.png"])
    kept = model_columns(rows, ViTForImageClassification(config), ARGS)
    assert kept.column_names == ["pixel_values", "labels"]


def test_t5_keeps_its_decoder_inputs():
    config = T5Config(vocab_size=64, d_model=32, d_ff=37, d_kv=16, num_layers=1, num_heads=2)
    names = ["input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "labels"]
    rows = table(**{name: [[1, 2]] for name in names}, summary=["s"], document=["d"])
    assert model_columns(rows, T5ForConditionalGeneration(config), ARGS).column_names == names


def test_question_answering_keeps_start_and_end_positions():
    names = ["input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions"]
    rows = table(**{name: [[1, 2]] for name in names}, offset_mapping=[[[0, 1], [1, 2]]], example_id=["q"])
    assert model_columns(rows, BertForQuestionAnswering(BERT), ARGS).column_names == names


def test_dropped_columns_are_logged_as_hfs_trainer_logs_them(caplog):
    with caplog.at_level(logging.INFO, logger="trainer.data.columns"):
        model_columns(table(**GLUE_ROWS), bert_classifier(), ARGS, "training")
    (message,) = caplog.messages
    assert message.startswith(
        "The following columns in the training set don't have a corresponding argument in "
        "`BertForSequenceClassification.forward` and have been ignored: sentence, idx."
    )


def test_a_dataset_with_no_column_the_model_takes_is_refused():
    with pytest.raises(ValueError, match="No columns in the dataset match .* ignored: \\[text\\]"):
        model_columns(table(text=["a"]), bert_classifier(), ARGS)


def test_label_names_keep_a_label_column_the_forward_does_not_name():
    rows = table(**GLUE_ROWS, targets=[1, 0])
    kept = model_columns(rows, bert_classifier(), SimpleNamespace(label_names=["targets"]))
    assert "targets" in kept.column_names and "sentence" not in kept.column_names
    assert "targets" not in model_columns(rows, bert_classifier(), ARGS).column_names


def test_remove_unused_columns_false_keeps_every_column():
    rows = table(**GLUE_ROWS)
    args = TrainingArguments(output_dir="unused", remove_unused_columns=False)
    assert model_columns(rows, bert_classifier(), args) is rows


def test_a_torch_dataset_and_a_transformed_dataset_are_left_alone():
    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": [1], "sentence": "a"}

    rows = Rows()
    assert model_columns(rows, bert_classifier(), ARGS) is rows
    raw = table(image_file=["a.png"], label=[0])
    raw.set_transform(lambda batch: {"pixel_values": [[0.0]], "labels": batch["label"]})
    assert model_columns(raw, bert_classifier(), ARGS) is raw
    assert model_columns(None, bert_classifier(), ARGS) is None


def test_a_peft_model_is_judged_by_its_base_model():
    lora = LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query", "value"])
    model = get_peft_model(bert_classifier(), lora)
    kept = model_columns(table(**GLUE_ROWS), model, ARGS)
    assert kept.column_names == ["input_ids", "token_type_ids", "attention_mask", "label"]


# ---- the default collator -----------------------------------------------------------------------


def test_a_tokenizer_gets_hfs_padding_collator():
    tok = bpe_tokenizer()
    collate = default_collator_for(bert_classifier(), tok)
    assert isinstance(collate, DataCollatorWithPadding) and collate.tokenizer is tok
    batch = collate([{k: v[i] for k, v in GLUE_ROWS.items() if k != "sentence"} for i in (0, 1)])
    assert batch["token_type_ids"].tolist() == [[0, 0, 1], [0, 1, 0]]
    assert batch["labels"].tolist() == [0, 1]


def test_an_image_processor_or_none_gets_hfs_default_collator():
    assert default_collator_for(bert_classifier(), ViTImageProcessorPil()) is default_data_collator
    assert default_collator_for(bert_classifier(), None) is default_data_collator


def test_a_causal_lm_keeps_the_causal_lm_collator_bit_for_bit():
    tok = bpe_tokenizer()
    rows = [
        {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8], "position_ids": [0, 1, 0, 1]},
        {"input_ids": [9, 10], "labels": [9, 10], "position_ids": [0, 1]},
    ]
    plain = [{"input_ids": r["input_ids"]} for r in rows]
    peft_llama = get_peft_model(llama(), LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj"]))
    for model in (llama(), peft_llama):
        collate = default_collator_for(model, tok)
        assert type(collate) is CausalLMCollator
        for batch_rows in (rows, plain):
            got, want = collate(batch_rows), CausalLMCollator(pad_token_id=tok.pad_token_id)(batch_rows)
            assert list(got) == list(want)
            assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    assert default_collator_for(llama(), None).pad_token_id == 0


# ---- the batches reaching the model -------------------------------------------------------------


def test_training_and_evaluation_batches_keep_all_the_collator_made():
    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        ids = torch.tensor([r["input_ids"] for r in rows])
        return {"input_ids": ids, "labels": ids.clone(), "token_type_ids": torch.zeros_like(ids)}

    rows = [{"input_ids": [i, i + 1]} for i in range(4)]
    args = SimpleNamespace(
        seed=0,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        dataloader_num_workers=0,
        dataloader_drop_last=False,
        dataloader_pin_memory=False,
        dataloader_persistent_workers=False,
        dataloader_prefetch_factor=None,
    )
    sampler = ResumableDistributedSampler(len(rows), num_replicas=1, rank=0, shuffle=False)
    (window, *_) = accumulation_windows(rows, sampler, collate, args, pin_memory=False)
    assert set(window[0]) == {"input_ids", "labels", "token_type_ids"}
    (batch, _), *_ = eval_batches(rows, collate, 2, rank=0, world_size=1)
    assert set(batch) == {"input_ids", "labels", "token_type_ids"}


# ---- through the Trainer, as a user script builds it --------------------------------------------

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import datasets
    from transformers import BertConfig, BertForSequenceClassification, DataCollatorWithPadding
    from tests.helpers.sft_data import tokenizer
    from trainer import Trainer, TrainingArguments

    out = sys.argv[1]
    glue = datasets.Dataset.from_dict({"input_ids": [[5, 6]], "token_type_ids": [[0, 1]], "label": [1],
                                       "sentence": ["a b"]})
    model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=37))
    tok = tokenizer()

    def collate(rows):
        return {"rows": len(rows)}

    def build(**fields):
        return Trainer(model=model, args=TrainingArguments(output_dir=out, **fields), train_dataset=glue,
                       eval_dataset=glue, processing_class=tok)

    pruned, kept = build(), build(remove_unused_columns=False)
    given = Trainer(model=model, args=TrainingArguments(output_dir=out), train_dataset=glue, data_collator=collate)
    result = {
        "train": pruned.train_dataset.column_names,
        "eval": pruned.eval_dataset.column_names,
        "kept": kept.train_dataset.column_names,
        "padding": isinstance(pruned.data_collator, DataCollatorWithPadding),
        "given": given.data_collator is collate,
    }
    json.dump(result, open(f"{out}/result.json", "w"))
    """
)


def test_the_trainer_prunes_and_picks_its_collator_as_hfs_does(tmp_path):
    script = tmp_path / "columns.py"
    script.write_text(SCRIPT)
    launch([str(script), str(tmp_path)], launcher="python", timeout=600)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["train"] == result["eval"] == ["input_ids", "token_type_ids", "label"]
    assert result["kept"] == ["input_ids", "token_type_ids", "label", "sentence"]
    assert result["padding"] and result["given"]
