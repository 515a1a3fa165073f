"""Measured against predicted: the bytes each of 2 CPU ranks holds in model states, ZeRO 0-3.

One torchrun launch runs every stage in fp32 and bf16 on a tiny Llama; each rank sums the bytes of the
engine's tensors (``trainer.engine.zero.state_bytes``, what ``Engine.state_bytes`` reports) after the
backward of a micro-step inside a gradient-accumulation window, when gradients are held as the stage
keeps them between micro-steps.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.helpers.launch import launch
from trainer.planner import model_state_bytes

pytestmark = pytest.mark.distributed

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import deepspeed, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from trainer.engine.zero import state_bytes

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    results = {}
    for precision in ("fp32", "bf16"):
        for stage in range(4):
            torch.manual_seed(0)
            config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, vocab_size=128)
            model = LlamaForCausalLM(config)
            ds_config = {
                "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 8,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                "zero_optimization": {"stage": stage, "reduce_bucket_size": 1000, "allgather_bucket_size": 1000,
                                      "stage3_prefetch_bucket_size": 1000, "stage3_param_persistence_threshold": 0},
                "bf16": {"enabled": precision == "bf16"},
                "steps_per_print": 10**9,
            }
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
            ids = torch.randint(0, 128, (2, 16))
            for micro in range(3):  # one full step (creates Adam's states), then one micro-step into the next
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                if micro < 2:
                    engine.step()
            results[f"{precision}/{stage}"] = {
                "n_params": sum(p.numel() for p in model.parameters()) if stage < 3 else
                            sum(p.ds_numel for p in model.parameters()),
                **state_bytes(engine.module, engine.optimizer),
            }
            engine.destroy()
            del engine, model
    with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    """
)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("measured")
    script = out / "measure.py"
    script.write_text(SCRIPT)
    launch([str(script), str(out)], launcher="torchrun", timeout=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_measured_model_states_match_the_planner(measured, precision, stage):
    for rank, results in enumerate(measured):
        got = results[f"{precision}/{stage}"]
        predicted = model_state_bytes(got["n_params"], stage, 2, precision)
        for kind in ("params", "grads", "optimizer"):
            assert got[kind] == pytest.approx(predicted[kind], rel=0.10), (rank, kind, got, predicted)
        total = got["params"] + got["grads"] + got["optimizer"] + got["other"]
        assert total == pytest.approx(
            predicted["params"] + predicted["grads"] + predicted["optimizer"], rel=0.10
        )
