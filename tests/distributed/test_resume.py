"""Checkpoints through the real launcher: exact resume (ZeRO 0-3), corrupt checkpoints, a world-size
change (2 ranks -> 1, and -> 3 when slow tests run), HF export. One 2-rank launch and one 1-rank
launch serve every default test; ``tests/helpers/resume_scenarios.py`` does the runs, these tests only
compare."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.helpers.launch import launch
from tests.helpers.scaffold import assert_same_weights

pytestmark = pytest.mark.distributed

DRIVER = "tests/helpers/resume_scenarios.py"
SAVE_AT = 5


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    proc = launch([DRIVER, str(out), "exact", "optimizers", "corrupt", "world_src"], launcher="torchrun")
    return out, json.loads((out / "results-2.json").read_text()), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def one_rank(two_ranks):
    out, source, _ = two_ranks
    proc = launch([DRIVER, str(out), "world_dst"], nproc=1, launcher="torchrun")
    return out, source, json.loads((out / "results-1.json").read_text())["world_dst"], proc.stdout


def steps(rows: list[list[float]]) -> dict[int, float]:
    return {int(step): loss for step, loss in rows}


def max_rel_diff(got: dict[int, float], want: dict[int, float]) -> float:
    return max(abs(got[s] - want[s]) / abs(want[s]) for s in got)


def assert_resumed(log: str, ran: dict, checkpoint, step: int = SAVE_AT, last: int = 10) -> None:
    """The run resumed from exactly ``checkpoint`` at ``step``: the Trainer said so, its state
    began there, and it trained only the steps after it. A silent restart from scratch (which
    reproduces the same losses on these deterministic runs) begins at 0 and trains every step."""
    assert f"Resumed from {checkpoint} at step {step}." in log
    assert ran["began_at"] == step, ran
    assert ran["steps_run"] == list(range(step + 1, last + 1)), ran


# ---- exact resume --------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(two_ranks, stage):
    """Saved at step 5, resumed by a fresh Trainer (resume auto): losses 6-10 and final weights are
    identical. Accumulation 2 and an epoch boundary at step 6 make the data position matter."""
    out, res, log = two_ranks
    run = res["exact"][f"zero{stage}"]
    assert_resumed(log, run["resumed_ran"], out / "exact" / f"zero{stage}" / "resumed" / "checkpoint-5")
    assert run["resumed_metrics_steps"] == [6, 7, 8, 9, 10]
    assert run["reference_ran"] == {"began_at": 0, "steps_run": list(range(1, 11))}
    reference, resumed = steps(run["reference"]), steps(run["resumed"])
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    assert resumed == {s: reference[s] for s in resumed}  # exact float equality
    assert run["position"] == run["reference_position"] == [1, 16]
    assert_same_weights(
        out / "exact" / f"zero{stage}" / "reference.pt", out / "exact" / f"zero{stage}" / "resumed.pt"
    )


def test_a_zero1_checkpoint_resumes_at_zero2(two_ranks):
    """A stage change the checkpoint carries: ZeRO 1 and 2 cut the optimizer states alike, so the shards
    load as they are. Step 6 runs on ZeRO-1's step-5 weights bit for bit; then the run follows both
    uninterrupted runs, which differ from each other by summing gradients in another order (measured:
    7.3e-8 relative apart, the resumed run within 7.3e-8 of either). The final weights are within
    1e-7 of either run's, plus one rounding of the value itself (2**-23 of it): a norm weight near
    1.0 that rounded the other way in one order is one ulp, 1.19e-7, from the other (seen on one
    machine for three norm weights against ZeRO-2's run; the matrices within 1.5e-8)."""
    out, res, log = two_ranks
    run = res["exact"]["zero1_at_zero2"]
    assert_resumed(log, run["resumed_ran"], out / "exact" / "zero1_at_zero2" / "checkpoint-5")
    resumed = steps(run["resumed"])
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    zero1, zero2 = (steps(res["exact"][f"zero{stage}"]["reference"]) for stage in (1, 2))
    assert resumed[6] == zero1[6]  # ZeRO-1's weights, loaded as they were
    assert max_rel_diff(resumed, zero1) <= 1e-6 and max_rel_diff(resumed, zero2) <= 1e-6
    for stage in (1, 2):
        assert_same_weights(
            out / "exact" / f"zero{stage}" / "reference.pt",
            out / "exact" / "zero1_at_zero2.pt",
            rtol=2**-23,
            atol=1e-7,
        )


@pytest.mark.parametrize("name", ["fused_zero2", "offload_zero2"])
def test_deepspeed_cpu_adam_kernels_resume_bit_for_bit(two_ranks, name):
    """FusedAdam (optim adamw_fused) and the offload CPUAdam keep beta powers in C++ state that a
    checkpoint does not hold; the engine rebuilds it on load (without that: ~1e-7 drift)."""
    out, res, log = two_ranks
    run = res["optimizers"][name]
    assert_resumed(log, run["resumed_ran"], out / "optimizers" / name / "resumed" / "checkpoint-5")
    assert run["resumed_metrics_steps"] == [6, 7, 8, 9, 10]
    # The kernels named are the ones that ran: FusedAdam, or the CPU Adam of the offload.
    expected = {"fused_zero2": "fused_adam.FusedAdam", "offload_zero2": "cpu_adam.DeepSpeedCPUAdam"}
    assert run["engine"]["zero_stage"] == 2
    assert run["engine"]["optimizer"] == f"deepspeed.ops.adam.{expected[name]}"
    reference, resumed = steps(run["reference"]), steps(run["resumed"])
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    assert resumed == {s: reference[s] for s in resumed}
    assert_same_weights(out / "optimizers" / name / "reference.pt", out / "optimizers" / name / "resumed.pt")


@pytest.mark.slow
def test_fused_adam_without_zero_resumes_bit_for_bit(tmp_path):
    proc = launch([DRIVER, str(tmp_path), "optimizers_slow"], launcher="torchrun")
    run = json.loads((tmp_path / "results-2.json").read_text())["optimizers_slow"]["fused_zero0"]
    checkpoint = tmp_path / "optimizers" / "fused_zero0" / "resumed" / "checkpoint-5"
    assert_resumed(proc.stdout, run["resumed_ran"], checkpoint)
    assert run["engine"]["zero_stage"] == 0
    assert run["engine"]["optimizer"] == "deepspeed.ops.adam.fused_adam.FusedAdam"
    reference, resumed = steps(run["reference"]), steps(run["resumed"])
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    assert resumed == {s: reference[s] for s in resumed}
    assert_same_weights(
        tmp_path / "optimizers" / "fused_zero0" / "reference.pt",
        tmp_path / "optimizers" / "fused_zero0" / "resumed.pt",
    )


# ---- corrupt checkpoints -------------------------------------------------------------------------


def test_explicit_corrupt_checkpoint_is_one_error_naming_the_file(two_ranks):
    out, res, _ = two_ranks
    bad = out / "corrupt" / "flipped" / "checkpoint-10" / "ds" / "mp_rank_00_model_states.pt"
    expected = f"resume_from_checkpoint: {bad}: checksum does not match the manifest"
    assert res["corrupt"]["explicit_errors"] == [expected, expected]  # the same on both ranks


@pytest.mark.parametrize(
    ("case", "problem"),
    [
        ("flipped", "ds/mp_rank_00_model_states.pt: checksum does not match the manifest"),
        ("truncated", r"ds/zero_pp_rank_1_mp_rank_00_optim_states.pt: size \d+ bytes, the manifest says \d+"),
    ],
)
def test_auto_resume_falls_back_past_a_corrupt_checkpoint_with_a_warning_on_every_rank(
    two_ranks, case, problem
):
    out, res, log = two_ranks
    where = out / "corrupt" / case
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}\] warning: {re.escape(str(where))}/checkpoint-10/{problem}", log), (
            rank
        )
        fallback = f"[rank {rank}] warning: {where}/checkpoint-10: failed verification; falling back to {where}/checkpoint-5"
        assert fallback in log
    assert_resumed(log, res["corrupt"][f"{case}_ran"], where / "checkpoint-5")
    # The fallback run continues exactly like the uninterrupted one.
    reference = steps(res["exact"]["zero2"]["reference"])
    assert steps(res["corrupt"][case]) == {s: reference[s] for s in range(6, 11)}


def test_unmarked_and_staging_directories_are_never_loaded(two_ranks):
    """Next to the truncated checkpoint-10 lay a newer checkpoint-12 without COMPLETE and a staging
    dir: resume went to checkpoint-5, and the next save cleared the stale staging dir."""
    out, res, log = two_ranks
    where = out / "corrupt" / "truncated"
    assert f"{where}/checkpoint-12" not in log  # not even looked at
    assert_resumed(log, res["corrupt"]["truncated_ran"], where / "checkpoint-5")
    assert res["corrupt"]["truncated_listing"] == [
        ".trainer.lock",  # the run's hold on its output_dir
        "checkpoint-10",
        "checkpoint-12",
        "checkpoint-5",
        "ds_config.json",
        "metrics.jsonl",
        "run_config.yaml",
    ]
    assert not (where / "checkpoint-12" / "COMPLETE").exists()
    # checkpoint-10 was re-saved by the resumed run and is sound again.
    manifest = json.loads((where / "checkpoint-10" / "manifest.json").read_text())
    assert manifest["step"] == 10 and (where / "checkpoint-10" / "COMPLETE").is_file()


# ---- world-size change ---------------------------------------------------------------------------


def check_world_change(out, source, dst, world: int, name: str, gas: int, log: str) -> float:
    run = dst[name]
    assert_resumed(log, run["ran"], out / "world" / name / f"on{world}" / "checkpoint-5")
    assert run["gradient_accumulation_steps"] == run["engine_gas"] == gas
    assert run["ds_config_batch"] == [6, gas]  # the global batch is the checkpoint's
    assert run["universal_complete"]
    moments = run["moments"]
    if name.endswith("sgd"):  # the momentum under SGD's own name, nothing of Adam's left
        assert moments["max_abs_diff"] == {"fp32": 0.0, "momentum_buffer": 0.0}
        assert moments["state_keys"] == ["momentum_buffer"]
        assert [g["momentum"] for g in moments["groups"]] == [0.9, 0.9]
    else:
        assert moments["max_abs_diff"] == {"fp32": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    assert [g["weight_decay"] for g in moments["groups"]] == [0.1, 0.0]
    assert run["new_manifest_world"] == world
    got, want = steps(run["losses"]), steps(source["world_src"][name])
    assert sorted(got) == [6, 7, 8, 9, 10]
    rel = max_rel_diff(got, want)
    assert rel <= 1e-5, rel
    assert_same_weights(
        out / "world" / name / f"on{world}.pt",
        out / "world" / name / "source.pt",
        rtol=1e-5,
        atol=1e-6,
        same_keys=False,
    )
    return rel


@pytest.mark.parametrize("name", ["zero2", "zero3", "zero3_sgd"])
def test_two_rank_checkpoint_continues_on_one_rank(one_rank, name):
    """2 ranks × micro 1 × accumulation 3 resumed on 1 rank: accumulation 6, universal conversion,
    the optimizer's state kept (Adam's moments; torch SGD's momentum under its own name), and the
    loss trajectory of the run that stayed on 2 ranks (measured: ≤ 1.1e-7)."""
    out, source, dst, log = one_rank
    check_world_change(out, source, dst, 1, name, gas=6, log=log)
    assert "checkpoint-5: gradient_accumulation_steps 3 -> 6" in log


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero2", "zero3", "zero3_sgd"])
def test_two_rank_checkpoint_continues_on_three_ranks(two_ranks, name):
    out, source, _ = two_ranks
    if not (out / "results-3.json").exists():
        log = launch([DRIVER, str(out), "world_dst"], nproc=3, launcher="torchrun").stdout
        (out / "log-3.txt").write_text(log)
    dst = json.loads((out / "results-3.json").read_text())["world_dst"]
    check_world_change(out, source, dst, 3, name, gas=2, log=(out / "log-3.txt").read_text())


# ---- HF export -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hf_export_equals_the_gathered_weights_and_logits(two_ranks, stage):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, _, _ = two_ranks
    where = out / "exact" / f"zero{stage}"
    engine = torch.load(where / "engine.pt", weights_only=True)
    exported = load_file(where / "hf" / "model.safetensors")
    assert exported.keys() == engine["gathered"].keys()
    for name, tensor in engine["gathered"].items():
        assert tensor.numel() > 0 and exported[name].shape == tensor.shape, name
        assert torch.equal(exported[name], tensor), name
    model = AutoModelForCausalLM.from_pretrained(where / "hf", torch_dtype=torch.float32).eval()
    batch = engine["batch"]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(logits, engine["logits"], rtol=0, atol=1e-5)
