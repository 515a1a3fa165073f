"""HF export of live weights on one process (the checkpoint export runs in tests/distributed)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from trainer.checkpoint.export import export_hf
from trainer.cli.main import main


def test_export_refuses_an_empty_state_dict(tmp_path):
    with pytest.raises(ValueError, match="empty state dict"):
        export_hf(torch.nn.Linear(2, 2), {}, None, tmp_path / "out")


def test_export_writes_a_loadable_model_and_keeps_other_files(tmp_path):
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, vocab_size=32)  # fmt: skip
    model = LlamaForCausalLM(config)
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")  # an output_dir's other contents stay
    assert export_hf(model, model.state_dict(), None, out) == out
    assert (out / "metrics.jsonl").read_text() == "{}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no staging directory left behind
    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_trainer_export_of_an_incomplete_checkpoint_is_bad_input(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == (
        f"error: resume_from_checkpoint: {tmp_path / 'nope'}: not a complete checkpoint "
        "(no COMPLETE marker or manifest)\n"
    )
    assert not (tmp_path / "hf").exists()
