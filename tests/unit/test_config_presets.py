"""Presets: ds_configs/ is what the schema writes, DeepSpeed's parser accepts each, docs are current."""

from __future__ import annotations

import json

import pytest

from tests.helpers.deepspeed_config_parser import deepspeed_errors
from tests.helpers.launch import ROOT
from trainer.args import TrainingArguments
from trainer.config import PRECISIONS, PRESETS, Hardware, preset_config, resolve, validate
from trainer.config.presets import preset_files, stale_presets, write_presets
from trainer.config.reference import render_reference

DS_CONFIGS = ROOT / "ds_configs"
DEFAULTS = TrainingArguments()  # the files carry the default batch sizes and clipping
WORLD_SIZES = (1, 2, 3, 8)


def test_ds_configs_directory_is_what_the_schema_generates(tmp_path):
    assert stale_presets(DS_CONFIGS, DEFAULTS) == []
    written = write_presets(tmp_path, DEFAULTS)
    assert sorted(p.name for p in written) == sorted(p.name for p in DS_CONFIGS.glob("*.json"))
    for path in written:
        assert path.read_text() == (DS_CONFIGS / path.name).read_text()


def test_a_hand_edit_is_detected(tmp_path):
    write_presets(tmp_path, DEFAULTS)
    edited = tmp_path / "zero2_bf16.json"
    edited.write_text(edited.read_text().replace('"stage": 2', '"stage": 1'))
    (tmp_path / "mine.json").write_text("{}")
    assert stale_presets(tmp_path, DEFAULTS) == [
        f"{edited}: differs from the schema's preset",
        f"{tmp_path / 'mine.json'}: not a preset",
    ]


def test_every_preset_in_every_precision():
    files = preset_files(DEFAULTS)
    assert len(files) == len(PRESETS) * len(PRECISIONS) == 21
    for name, preset in PRESETS.items():
        for precision in PRECISIONS:
            config = validate(files[f"{name}_{precision}.json"], world_size=4)
            assert config.zero_stage == preset.stage
            assert config.precision == precision
            assert config.zero_optimization.offload_device("optimizer") == preset.offload_optimizer
            assert config.zero_optimization.offload_device("param") == preset.offload_param


def test_zero3_presets_gather_weights_for_save_16bit_model():
    for name in ("zero3", "zero3_offload", "zero3_nvme"):
        assert (
            preset_config(name, "bf16", DEFAULTS)["zero_optimization"][
                "stage3_gather_16bit_weights_on_model_save"
            ]
            is True
        )


def test_deepspeed_parser_accepts_every_preset_and_resolved_config():
    cases = [(data, ws) for data in preset_files(DEFAULTS).values() for ws in WORLD_SIZES]
    # Resolved configs carry the optimizer and scheduler sections too.
    for name in PRESETS:
        for precision, hardware in (("fp32", Hardware.cpu()), ("bf16", Hardware.cpu())):
            run_args = {"deepspeed": name, "precision": precision, "max_steps": 10}
            run_args |= {"nvme_path": "/nvme"} if "nvme" in name else {}
            cases.append((resolve(TrainingArguments(**run_args), 2, hardware, hidden_size=64), 2))
    # And the trap DeepSpeed only finds late: our schema and DeepSpeed agree on it.
    trap = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
    cases.append((trap, 3))
    errors = deepspeed_errors(cases)
    assert errors[:-1] == [None] * (len(cases) - 1), [
        (json.dumps(c), e) for (c, _), e in zip(cases, errors, strict=True) if e
    ]
    assert "8 != 2 * 1 * 3" in errors[-1]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_preset_files_are_stable_json(precision):
    text = (DS_CONFIGS / f"zero2_{precision}.json").read_text()
    assert text.endswith("}\n") and json.loads(text) == preset_config("zero2", precision, DEFAULTS)


def test_docs_config_reference_is_current():
    assert (ROOT / "docs" / "config.md").read_text() == render_reference(), (
        "docs/config.md is out of date; run: trainer ds-config reference -o docs/config.md"
    )


def test_reference_lists_every_key():
    text = render_reference()
    for key in (
        "stage3_prefetch_bucket_size",
        "offload_optimizer",
        "ratio",
        "initial_scale_power",
        "torch_adam",
        "adam_w_mode",
        "cycle_min_lr",
        "lr_range_test_min_lr",
        "prof_ops",
        "use_gds",
        "tag_validation",
    ):
        assert f"`{key}`" in text, key
