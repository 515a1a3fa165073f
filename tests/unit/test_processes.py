"""``trainer.accelerator`` (what TRL's and HF's scripts call on a trainer) and TRL's
``quantization_config`` argument, refused where it cannot apply."""

from __future__ import annotations

import pytest
import torch

from trainer import DPOConfig
from trainer.loop.preference import load_model
from trainer.runtime.processes import Processes


def test_the_view_answers_from_the_launchers_facts(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    view = Processes()
    assert (view.process_index, view.local_process_index, view.num_processes) == (3, 1, 4)
    assert not view.is_main_process and not view.is_local_main_process
    view.print("hidden")  # not the node's first process: accelerate's print stays silent
    assert capsys.readouterr().out == ""


def test_the_main_process_prints_once(monkeypatch, capsys):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    Processes().print("done", 1)
    assert capsys.readouterr().out == "done 1\n"


def test_unwrap_model_takes_off_every_wrapper():
    inner = torch.nn.Linear(2, 2)
    outer = torch.nn.Module()
    outer.module = torch.nn.Module()
    outer.module.module = inner
    assert Processes().unwrap_model(outer) is inner


def test_what_it_does_not_provide_is_refused_by_name():
    with pytest.raises(AttributeError, match=r"trainer.accelerator.gather_for_metrics: not provided.*print"):
        _ = Processes().gather_for_metrics


def test_a_quantization_config_for_a_built_model_is_refused():
    with pytest.raises(ValueError, match="quantization_config: the model is already built"):
        load_model(
            torch.nn.Linear(2, 2), DPOConfig(output_dir="unused"), None, quantization_config={"bits": 4}
        )


def test_a_quantization_config_given_twice_is_refused():
    args = DPOConfig(output_dir="unused", model_init_kwargs={"quantization_config": {"bits": 4}})
    with pytest.raises(ValueError, match="given both as the trainer's argument and in model_init_kwargs"):
        load_model("unused", args, None, quantization_config={"bits": 4})
