"""The planner's preference figures: pairs double what a micro-batch forwards, and DPO's reference
costs nothing held in training when cached, a model's weights when held beside the policy (whole
under ZeRO 0-2, a share under ZeRO-3), and nothing under LoRA; `trainer plan --objective` through the CLI."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from trainer.cli.main import main
from trainer.planner import Cluster, Objective, Setup, estimate, load_model_spec

SPEC, EIGHT = load_model_spec("llama-7b"), Cluster(gpus_per_node=8)


@pytest.mark.parametrize("stage, share", [(0, 1), (2, 1), (3, 8)])
def test_a_reference_model_adds_its_weights_and_the_cached_pass_nothing(stage, share):
    setup = Setup(stage, "none", "none", True)
    causal = estimate(SPEC, setup, EIGHT, 2048, 2)
    cached = estimate(SPEC, setup, EIGHT, 2048, 1, objective=Objective("dpo"))
    held = estimate(SPEC, setup, EIGHT, 2048, 1, objective=Objective("dpo", reference_model=True))
    lora = estimate(SPEC, setup, EIGHT, 2048, 1, lora_r=16, objective=Objective("dpo", reference_model=True))
    # One pair is two sequences: the activations of a causal LM's micro-batch of 2.
    assert cached["activations_gb_per_gpu"] == causal["activations_gb_per_gpu"]
    assert cached["reference_gb_per_gpu"] == 0 and lora["reference_gb_per_gpu"] == 0
    assert held["reference_gb_per_gpu"] == pytest.approx(2 * SPEC.n_params / share / 1e9, rel=1e-6)
    assert held["total_gb_per_gpu"] - cached["total_gb_per_gpu"] == pytest.approx(
        held["reference_gb_per_gpu"]
    )


def test_plan_cli_names_the_reference_and_what_the_cache_saves(capsys):
    assert main(["plan", "--model", "llama-7b", "--objective", "dpo", "--micro-batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "objective dpo: each micro-batch row is a pair, 2 sequences of seq_len" in out
    assert (
        "no model held in training, where a reference model would add 13.48 GB per GPU at ZeRO 0-2, 1.68 GB"
        in out
    )
    assert main(["plan", "--model", "llama-7b", "--objective", "dpo", "--reference", "model", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["objective"] == {"name": "dpo", "reference_model": True, "generation_rows": 0}
    assert result["recommended"]["reference_gb_per_gpu"] > 0
    assert main(["plan", "--model", "llama-7b", "--objective", "orpo", "--reference", "model"]) == 2
    assert (
        "--reference: --objective orpo has no reference model; only dpo and kto do" in capsys.readouterr().err
    )


def test_plan_counts_a_pairs_two_sequences_for_the_auto_tiling_and_splits_them():
    """1536 tokens a sequence, one row a GPU: a causal row's fp32 logits (1536 x 32000) fit one
    256 MiB tile, a pair's two do not, so the auto rule tiles the pair's loss alone; sequence
    parallelism is planned for pairs as for rows."""
    argv = ["plan", "--model", "llama-7b", "--seq-len", "1536", "--micro-batch", "1", "--json"]
    tiled = {}
    for objective in ("causal_lm", "dpo"):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main([*argv, "--objective", objective]) == 0
        tiled[objective] = json.loads(out.getvalue())["recommended"]["tiled_loss"]
    assert tiled == {"causal_lm": False, "dpo": True}
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*argv, "--objective", "dpo", "--sequence-parallel", "2"]) == 0
