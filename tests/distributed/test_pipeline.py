"""Pipeline parallelism on 2 CPU ranks under torchrun (one launch, many checks).

Every pipeline run is compared with the non-pipelined run of the same model, data and settings on
the same 2 ranks: 10 optimizer steps of the Trainer, gradient clipping active (norms above 1).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.launch import launch
from tests.helpers.scaffold import assert_same_weights

pytestmark = pytest.mark.distributed

SCENARIOS = ["llama", "gpt2", "checkpoint"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    proc = launch(["tests/helpers/pipeline_scenarios.py", str(out), *SCENARIOS], launcher="torchrun")
    (out / "log.txt").write_text(proc.stdout)
    return out, json.loads((out / "results.json").read_text())


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def weights(out, scenario: str, run: str) -> dict[str, torch.Tensor]:
    return torch.load(out / scenario / f"{run}.pt", weights_only=True)


@pytest.mark.parametrize("run", ["pipe", "pipe_ckpt", "pipe_zero1_uniform"])
def test_two_stages_follow_the_non_pipelined_loss_trajectory(results, run):
    """With and without activation checkpointing, ZeRO 0 and 1, both partition methods."""
    _, res = results
    base = res["llama"]["base"]["loss"]
    assert len(base) == 10 and base[-1] < base[0]
    assert max_rel_diff(res["llama"][run]["loss"], base) <= 1e-4


@pytest.mark.parametrize("run", ["pipe", "pipe_ckpt", "pipe_zero1_uniform"])
def test_two_stages_end_with_the_same_weights(results, run):
    out, _ = results
    assert_same_weights(
        weights(out, "llama", run), weights(out, "llama", "base"), rtol=1e-4, atol=1e-5, what=run
    )


@pytest.mark.parametrize("run", ["pipe", "pipe_ckpt", "pipe_zero1_uniform"])
def test_predict_under_the_pipeline_matches_the_plain_engine(results, run):
    """Trainer.predict through a 2-stage pipeline: every rank gets the logits and labels of the
    whole set, in order, equal to the non-pipelined model's at every real token (their weights
    agree to 1e-4)."""
    out, _ = results
    base = torch.load(out / "llama" / "base_pred_rank0.pt", weights_only=True)
    assert base["logits"].shape[0] == 6 and base["logits"].shape[-1] == 256
    for rank in (0, 1):
        got = torch.load(out / "llama" / f"{run}_pred_rank{rank}.pt", weights_only=True)
        torch.testing.assert_close(got["labels"], base["labels"], rtol=0, atol=0)
        # Padding positions differ (the pipeline sends no attention mask; they are never scored).
        real = base["labels"] != -100
        assert real.sum() > 100
        torch.testing.assert_close(got["logits"][real], base["logits"][real], rtol=1e-3, atol=1e-3)


def test_clipping_sees_the_whole_model(results):
    """ZeRO-1 reports the clipped norm: the same as a non-pipelined ZeRO-1 step would see, and
    above max_grad_norm, so the runs above agree with clipping at work."""
    _, res = results
    norms = res["llama"]["pipe_zero1_uniform"]["grad_norm"]
    assert all(n is not None and n > 0 for n in norms)
    assert max(norms) > 1.0


def test_layers_are_split_by_parameters_or_uniformly(results):
    """7 layers: embedding, 4 blocks, norm, head. By parameters the embedding (16k) and two
    blocks (41k each) balance the other two blocks, the norm and the head; uniformly it is 4 + 3."""
    _, res = results
    assert res["llama"]["pipe"]["parts"] == [0, 3, 7]
    assert res["llama"]["pipe_zero1_uniform"]["parts"] == [0, 4, 7]


def test_the_engine_config_pools_each_stages_micro_batches(results):
    _, res = results
    base, pipe = res["llama"]["base"]["ds_config"], res["llama"]["pipe"]["ds_config"]
    assert (base["train_micro_batch_size_per_gpu"], base["gradient_accumulation_steps"]) == (2, 2)
    assert pipe["pipeline"]["stages"] == 2
    assert pipe["gradient_accumulation_steps"] == 4  # 2 per rank × 2 stages
    assert pipe["train_batch_size"] == base["train_batch_size"] == 8


def test_tied_gpt2_with_checkpointing_matches(results):
    out, res = results
    assert max_rel_diff(res["gpt2"]["pipe_ckpt"]["loss"], res["gpt2"]["base"]["loss"]) <= 1e-4
    base, got = weights(out, "gpt2", "base"), weights(out, "gpt2", "pipe_ckpt")
    assert got.keys() == base.keys() and "lm_head.weight" in got
    torch.testing.assert_close(got["lm_head.weight"], got["transformer.wte.weight"], rtol=0, atol=0)
    for name in base:
        # The key part of c_attn.bias has a zero gradient in exact arithmetic (softmax ignores a
        # shift common to all keys): it is rounding noise, which Adam scales up to ~lr-sized steps.
        atol = 1e-4 if name.endswith("attn.c_attn.bias") else 1e-5
        torch.testing.assert_close(got[name], base[name], rtol=1e-4, atol=atol, msg=name)


def test_resume_reproduces_the_uninterrupted_run(results):
    out, res = results
    ckpt = res["checkpoint"]
    # It resumed from checkpoint-5 and trained only steps 6-10 (steps 1-5 come from the checkpoint's
    # log history); a restart from scratch would log the same losses.
    assert (
        f"Resumed from {out / 'checkpoint' / 'full' / 'checkpoint-5'} at step 5."
        in (out / "log.txt").read_text()
    )
    assert ckpt["resumed_ran"] == {"began_at": 5, "steps_run": [6, 7, 8, 9, 10]}
    assert ckpt["resumed_steps"] == list(range(1, 11))
    assert ckpt["resumed"] == ckpt["full"]
    assert ckpt["eval_resumed"] == ckpt["eval_full"]
    assert max_rel_diff(ckpt["full"], ckpt["base"]) <= 1e-4


def test_checkpoint_holds_one_file_per_layer_and_stage(results):
    _, res = results
    files = res["checkpoint"]["files"]
    # Tied Llama: embedding, 4 blocks, norm. The head shares the embedding file; stages keep their
    # own model-states files.
    assert [f for f in files if f.startswith("layer_")] == [
        f"layer_{i:02d}-model_states.pt" for i in range(6)
    ]
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= set(files)


def test_evaluation_matches_the_non_pipelined_run(results):
    _, res = results
    ckpt = res["checkpoint"]
    assert len(ckpt["eval_full"]) == 2
    assert max_rel_diff(ckpt["eval_full"], ckpt["eval_base"]) <= 1e-5


def test_export_is_an_hf_model_with_the_trained_weights(results):
    out, res = results
    ckpt = res["checkpoint"]
    keys = ckpt["export_keys"]
    assert "model.embed_tokens.weight" in keys and "model.layers.3.mlp.down_proj.weight" in keys
    assert_same_weights(
        out / "checkpoint" / "export.pt", out / "checkpoint" / "full.pt", rtol=0, atol=0, same_keys=False
    )
    # The exported model, loaded by transformers, scores the eval set as the pipeline did.
    assert abs(ckpt["export_eval_loss"] - ckpt["eval_full"][-1]) <= 1e-5 * ckpt["eval_full"][-1]


def test_predict_returns_the_trained_models_logits_in_dataset_order(results):
    """The plain engine's predict() against an HF forward of the exported weights, row by row."""
    from transformers import LlamaForCausalLM

    from tests.helpers.pipeline_scenarios import llama_config, padded_dataset

    out, _ = results
    model = LlamaForCausalLM(llama_config(tied=False)).eval()
    model.load_state_dict(weights(out, "llama", "base"))
    pred = torch.load(out / "llama" / "base_pred_rank1.pt", weights_only=True)
    for i, row in enumerate(padded_dataset(36).select(range(6))["input_ids"]):
        with torch.no_grad():
            expected = model(torch.tensor([row])).logits[0]
        torch.testing.assert_close(pred["logits"][i, : len(row)], expected, rtol=1e-4, atol=1e-4)
        assert pred["labels"][i, : len(row)].tolist() == row
        assert (pred["labels"][i, len(row) :] == -100).all()
