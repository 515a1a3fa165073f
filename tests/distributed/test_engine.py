"""Engine and Trainer on 2 CPU ranks under torchrun (one launch, shared with test_nonfinite.py: the
``trainer_scenarios`` fixture in conftest.py)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.scaffold import assert_same_weights, load_weights

pytestmark = pytest.mark.distributed


def test_no_shared_memory_op_or_buffer_in_a_cpu_run(trainer_scenarios):
    """DeepSpeed's shared-memory all-reduce serves inference only: a training run on CPU ranks
    neither loads it (a two-minute compile on a fresh machine) nor maps its 66 MiB buffers in
    RAM-backed /dev/shm, during the run or after."""
    out, res = trainer_scenarios
    assert res["shm_op_loaded"] is False and res["shm_buffers"] == []
    assert json.loads((out / "shm_left.json").read_text()) == []


def test_the_op_loads_ask_for_the_cpu_once(trainer_scenarios):
    """Each op load (CPU Adam under offload, FusedAdam) asks py-cpuinfo twice for the CPU; each
    answer is a fresh interpreter (1.2 s). Kept after the first, a rank asks once."""
    _, res = trainer_scenarios
    hits, misses, *_ = res["cpu_info_asked"]
    assert misses == 1 and hits >= 3, res["cpu_info_asked"]


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def test_zero_stages_share_loss_trajectory(trainer_scenarios):
    _, res = trainer_scenarios
    base = res["zero_stages"]["zero0"]
    assert len(base) == 20
    for stage in (1, 2, 3):
        assert max_rel_diff(res["zero_stages"][f"zero{stage}"], base) <= 1e-4, stage
    assert base[-1] < base[0]


def test_zero_stages_share_final_weights(trainer_scenarios):
    out, _ = trainer_scenarios
    base = load_weights(out / "zero_stages" / "zero0.pt")
    for stage in (1, 2, 3):
        other = out / "zero_stages" / f"zero{stage}.pt"
        assert_same_weights(other, base, rtol=1e-4, atol=1e-5, what=f"zero{stage}")


TORCH_ADAMW = "torch.optim.adamw.AdamW"
FUSED_ADAM = "deepspeed.ops.adam.fused_adam.FusedAdam"
CPU_ADAM = "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam"
ZERO_WRAPPER = {1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}


@pytest.mark.parametrize(
    ("run", "stage", "optimizer"),
    [
        (("zero_stages", "engine", "zero0"), 0, TORCH_ADAMW),  # optim=adamw_torch (the default)
        (("zero_stages", "engine", "zero1"), 1, TORCH_ADAMW),
        (("zero_stages", "engine", "zero2"), 2, TORCH_ADAMW),
        (("zero_stages", "engine", "zero3"), 3, TORCH_ADAMW),
        (("offload", "zero2", "engine"), 2, CPU_ADAM),  # offload_optimizer=cpu
        (("offload", "zero3", "engine"), 3, CPU_ADAM),
        (("offload", "fused_zero3", "engine"), 3, FUSED_ADAM),  # optim=adamw_fused
    ],
)
def test_engine_runs_the_requested_zero_stage_and_optimizer(trainer_scenarios, run, stage, optimizer):
    """Read back from the DeepSpeed engine each Trainer built, not from the config it was given."""
    _, res = trainer_scenarios
    kind = res
    for key in run:
        kind = kind[key]
    assert kind["zero_stage"] == stage
    assert kind["optimizer"] == optimizer
    # ZeRO 1-3 wrap the optimizer in their partitioning optimizer; stage 0 in fp32 steps it directly.
    assert kind["wrapper"] == ZERO_WRAPPER.get(stage, optimizer.rsplit(".", 1)[1])


@pytest.mark.parametrize("stage", [1, 3])
def test_async_save_commits_after_the_loop_stepped_on(trainer_scenarios, stage):
    """async_save: checkpoint-10's files are written on the writer thread, which is held until the
    loop has finished step 11; the commit (on_save) comes later still. A save written on the loop's
    thread could not let step 11 finish before it returned."""
    out, res = trainer_scenarios
    probe = res["zero_stages"]["async"][f"zero{stage}"]
    assert probe["writes"], "no file of checkpoint-10 went through the writer"
    assert all(w["thread"].startswith("ckpt-writer") for w in probe["writes"]), probe["writes"]
    assert all(w["opened"] for w in probe["writes"]), probe["writes"]  # step 11 ended mid-write
    assert 11 in probe["steps_while_held"]
    committed_at = probe["commits"]["checkpoint-10"]
    assert committed_at > 10  # steps 11..committed_at finished between the save's start and its commit
    assert probe["commits"]["checkpoint-20"] == 20  # the last one is committed at the end of training
    assert (out / f"zero{stage}" / "checkpoint-10" / "COMPLETE").is_file()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_trainer_export_of_each_zero_stage_gives_the_engines_logits(trainer_scenarios, stage, tmp_path):
    # checkpoint-20 of ZeRO 1 and 3 was saved asynchronously; 0 and 2 synchronously.
    from transformers import AutoModelForCausalLM

    from tests.helpers.trainer_scenarios import tiny_config
    from trainer.checkpoint.export import export_checkpoint

    out, _ = trainer_scenarios
    hf = export_checkpoint(out / f"zero{stage}" / "checkpoint-20", tmp_path / "hf", max_shard_size="100KB")
    assert len(list(hf.glob("model-*.safetensors"))) > 1  # sharded above the size asked for
    exported = AutoModelForCausalLM.from_pretrained(hf).eval()
    engine = AutoModelForCausalLM.from_config(tiny_config()).eval()
    engine.load_state_dict(
        torch.load(out / "zero_stages" / f"zero{stage}.pt", weights_only=True), strict=False
    )
    ids = torch.randint(0, tiny_config().vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, engine(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("stage", [2, 3])
def test_grad_accum_equals_one_big_batch(trainer_scenarios, stage):
    """micro 2 x accum 4 x 2 ranks == one 16-sample batch, with variable padding."""
    out, res = trainer_scenarios
    ref = {name: tensor.float() for name, tensor in load_weights(out / "grad_accum" / "reference.pt").items()}
    got = out / "grad_accum" / f"zero{stage}.pt"
    assert_same_weights(got, ref, rtol=1e-4, atol=2e-6, same_keys=False)
    assert max_rel_diff(res["grad_accum"][f"zero{stage}"], res["grad_accum"]["reference"]) <= 1e-5
    # Clipped AdamW hides a constant gradient scale; the norm before clipping does not.
    norms, ref_norms = res["grad_accum"][f"zero{stage}_grad_norm"], res["grad_accum"]["reference_grad_norm"]
    assert len(norms) == 3 and min(ref_norms) > 0.5  # above max_grad_norm: clipping was at work
    assert max_rel_diff(norms, ref_norms) <= 1e-5, (norms, ref_norms)


def test_short_last_window_of_an_epoch_matches_a_plain_torch_loop(trainer_scenarios):
    """20 rows, 2 ranks x micro 2 x accumulation 2: steps of 8, 8 and 4 rows. Loss, gradient norm
    and final weights equal a plain torch loop (token-normalised loss, torch AdamW) over those rows."""
    out, res = trainer_scenarios
    run = res["partial_window"]
    assert run["steps"] == 3 and run["epoch"] == 1.0
    assert len(run["reference"]) == 3
    assert max_rel_diff(run["losses"], run["reference"]) <= 1e-5
    assert max_rel_diff(run["grad_norm"], run["reference_grad_norm"]) <= 1e-5
    assert_same_weights(
        out / "partial_window" / "trainer.pt", out / "partial_window" / "reference.pt", rtol=1e-4, atol=2e-6
    )


def test_activation_checkpointing_keeps_gradients(trainer_scenarios):
    _, res = trainer_scenarios
    ac = res["activation_checkpointing"]
    assert ac["hf_max_abs_diff"] <= 1e-5
    assert ac["custom_max_abs_diff"] <= 1e-5
    assert ac["custom_used_checkpoint"] == 3  # the DeepSpeed API was really on the path


def test_gradient_checkpointing_argument_recomputes_and_keeps_losses(trainer_scenarios):
    """Trainer(model, TrainingArguments(gradient_checkpointing=True)): the first decoder layer's MLP
    runs twice per micro-batch (forward, then recomputed in backward), once without; same losses."""
    _, res = trainer_scenarios
    off, on = (
        res["activation_checkpointing"]["trainer"]["false"],
        res["activation_checkpointing"]["trainer"]["true"],
    )
    assert off["mlp0_forwards"] == off["micro_batches"] == 6
    assert on["mlp0_forwards"] == 2 * on["micro_batches"] == 12
    assert len(on["losses"]) == 3
    assert max_rel_diff(on["losses"], off["losses"]) <= 1e-6
    assert max_rel_diff(on["grad_norm"], off["grad_norm"]) <= 1e-5


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_trains_and_exports_loadable_in_fp32(trainer_scenarios, stage):
    from transformers import AutoModelForCausalLM

    _, res = trainer_scenarios
    run = res["bf16"][f"zero{stage}"]
    assert run["precision"] == {"enabled": True}
    assert run["losses"][-1] < 0.8 * run["losses"][0]
    model = AutoModelForCausalLM.from_pretrained(run["export"], torch_dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bf16_at_zero0_counts_only_the_steps_it_took(trainer_scenarios):
    """ZeRO-0 in bf16 puts AdamW behind DeepSpeed's unfused mixed-precision wrapper, which steps it
    once on zero gradients when it is built (DeepSpeed PR #5104): Adam would count 11 steps after 10,
    its first update 0.74 of torch's, and the fp32 masters decayed once. The engine holds that step
    back, so the count is the steps taken, as under ZeRO 2-3."""
    _, res = trainer_scenarios
    assert res["bf16"]["zero0"]["wrapper"] == "FP16_UnfusedOptimizer"
    for stage in (0, 2, 3):
        assert res["bf16"][f"zero{stage}"]["adam_steps"] == [10], stage


@pytest.mark.parametrize("stage", [2, 3])
def test_cpu_offload_trains(trainer_scenarios, stage):
    _, res = trainer_scenarios
    run = res["offload"][f"zero{stage}"]
    assert "DeepSpeedCPUAdam" in (run["optimizer"], run["inner"])
    assert run["losses"][-1] < 0.8 * run["losses"][0]


def test_evaluate_under_zero3_is_exact_on_every_rank(trainer_scenarios):
    _, res = trainer_scenarios
    ev = res["evaluate_zero3"]
    assert len(ev["per_rank"]) == 2 and ev["per_rank"][0] == ev["per_rank"][1]
    assert abs(ev["per_rank"][0] - ev["reference"]) <= 1e-5 * ev["reference"]
