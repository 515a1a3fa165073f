"""HF ``TrainingArguments`` features users turn on, with HF's meaning, through the public API.

The scenarios run in one child process (tests/helpers/hf_features.py, plain python, one rank):
only those the selected tests read, all in one launch. Where HF's Trainer is the reference it runs in
the same child without DeepSpeed, on the same model, data, order and seed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.launch import launch

SCRIPT = "tests/helpers/hf_features.py"


def uses(name: str) -> Callable[[Callable], Callable]:
    """Mark a test as reading the results of scenario ``name``."""

    def mark(test: Callable) -> Callable:
        test.scenario = name
        return test

    return mark


@pytest.fixture(scope="module")
def results(request, tmp_path_factory) -> dict[str, Any]:
    """The scenarios the selected tests of this module read, run in one child process."""
    module = request.module.__name__
    names = sorted(
        {
            item.function.scenario
            for item in request.session.items
            if item.module.__name__ == module and hasattr(item.function, "scenario")
        }
    )
    out = tmp_path_factory.mktemp("hf_features")
    launch([SCRIPT, str(out), *names], launcher="python", timeout=1800)
    return {name: json.loads((out / f"{name}.json").read_text()) for name in names} | {"out": out}


def close(ours: list[float], theirs: list[float], rel: float = 1e-5) -> bool:
    return len(ours) == len(theirs) > 0 and all(
        abs(a - b) <= rel * abs(b) for a, b in zip(ours, theirs, strict=True)
    )


@uses("label_smoothing")
def test_label_smoothing_follows_hfs_trainer_step_by_step(results):
    """label_smoothing_factor: a causal LM's per-step losses and grad norms equal HF's Trainer's
    (accumulating 2 micro-batches of padded rows), and smoothing changes them."""
    runs = results["label_smoothing"]
    for factor, run in runs.items():
        for key in ("loss", "grad_norm"):
            assert close(run["ours"][key], run["hf"][key]), (factor, key, run)
    assert runs["0.2"]["ours"]["loss"][0] > runs["0.0"]["ours"]["loss"][0] + 1e-3


@uses("neftune")
def test_neftune_follows_hfs_trainer_and_is_removed_after_training(results):
    """neftune_noise_alpha: with the RNG seeded alike at each step, losses and grad norms equal HF's
    Trainer's (noise of HF's magnitude, in training only), evaluations too (no noise there), and no
    hook is left on the embeddings after train()."""
    run = results["neftune"]
    for key in ("loss", "grad_norm", "eval_loss"):
        assert close(run["ours"][key], run["hf"][key]), (key, run)
    assert len(run["ours"]["eval_loss"]) == 2
    assert run["ours"]["hooks_after"] == 0
    assert abs(run["ours"]["loss"][0] - run["plain"]["loss"][0]) > 1e-3  # the noise is there


def path(results: dict[str, Any], *parts: str) -> Path:
    return Path(results["out"], *parts)


def test_neftune_noise_has_hfs_magnitude_for_the_whole_row_in_training_only():
    """Uniform noise within alpha / sqrt(seq_len * hidden), seq_len the whole row's length under
    sequence parallelism (a rank embeds half of each row with 2); none in eval mode."""
    import torch

    from trainer.model.neftune import activate_neftune

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 8)

        def get_input_embeddings(self) -> torch.nn.Module:
            return self.embed

    model, ids = Model(), torch.arange(8).reshape(2, 4)
    clean = model.embed(ids)
    handle = activate_neftune(model, alpha=4.0, sequence_parallel=2)
    torch.manual_seed(0)
    noisy = model.embed(ids)
    torch.manual_seed(0)
    expected = torch.zeros_like(clean).uniform_(-4.0 / (4 * 2 * 8) ** 0.5, 4.0 / (4 * 2 * 8) ** 0.5)
    torch.testing.assert_close(noisy - clean, expected, rtol=0, atol=1e-6)
    model.eval()
    assert torch.equal(model.embed(ids), clean)
    handle.remove()
    model.train()
    assert torch.equal(model.embed(ids), clean)


def test_neftune_takes_its_sizes_from_the_mesh_a_deepspeed_file_gave():
    """A pipeline or a sequence split stated only in the DeepSpeed file reaches NEFTune as the
    argument's would: through the run's mesh."""
    from trainer.args import TrainingArguments
    from trainer.config.errors import ConfigError
    from trainer.model.neftune import NEFTune
    from trainer.runtime.mesh import mesh_for

    for stated in ({"pipeline_parallel_size": 2}, {"deepspeed": {"pipeline": {"stages": 2}}}):
        args = TrainingArguments(neftune_noise_alpha=5.0, **stated)
        with pytest.raises(ConfigError, match="neftune_noise_alpha: the pipeline's stages are rebuilt"):
            NEFTune(args, mesh_for(args, 2, 0))
    args = TrainingArguments(neftune_noise_alpha=5.0, deepspeed={"sequence_parallel_size": 2})
    assert NEFTune(args, mesh_for(args, 2, 0)).sequence_parallel == 2


@uses("tokens_seen")
def test_num_input_tokens_seen_is_logged_as_hfs_trainer_logs_it(results):
    """include_num_input_tokens_seen: "all" counts padding, "non_padding" does not, True is "all";
    every row (train, eval, the run's summary) carries the count HF's Trainer logs, and so does
    metrics.jsonl; "no" logs none."""
    runs = results["tokens_seen"]
    for mode in ("all", "non_padding"):
        ours, theirs = runs[f"ours-{mode}"], runs[f"hf-{mode}"]
        assert ours["rows"] == theirs["rows"], mode
        assert len(ours["rows"]) == 7 and all(isinstance(n, int) and n > 0 for n in ours["rows"])
        assert ours["jsonl"] == ours["rows"]
    assert runs["ours-all"]["rows"][-1] > runs["ours-non_padding"]["rows"][-1]  # the padding
    assert runs["ours-True"]["rows"] == runs["ours-all"]["rows"]
    assert set(runs["ours-no"]["rows"]) == {None} and set(runs["ours-no"]["jsonl"]) == {None}


@uses("empty_cache")
def test_the_device_cache_is_emptied_every_n_steps(results):
    """torch_empty_cache_steps=2 over 5 steps: after steps 2 and 4."""
    assert results["empty_cache"]["emptied"] == [2, 4]


def evaluations(callback: Any, args: Any, state: Any, control_type: type, steps: int, per_epoch: int) -> list:
    """Where ``callback`` evaluates, walking ``steps`` steps of ``per_epoch`` each: ("step", n) and ("epoch", e)."""
    found = []
    for step in range(1, steps + 1):
        state.global_step, state.epoch = step, step / per_epoch
        control = control_type()
        callback.on_step_end(args, state, control)
        if control.should_evaluate:
            found.append(("step", step))
        if step % per_epoch == 0:
            control = control_type()
            callback.on_epoch_end(args, state, control)
            if control.should_evaluate:
                found.append(("epoch", state.epoch))
    return found


@pytest.mark.parametrize(
    ("strategy", "delay"),
    [("steps", 0), ("steps", 5), ("steps", 6), ("epoch", 0), ("epoch", 2), ("epoch", 1.5)],
)
def test_eval_delay_holds_evaluation_back_as_hfs_flow_does(tmp_path, strategy, delay):
    """eval_delay: no evaluation before that many steps (eval_strategy steps) or epochs (epoch), the
    same decisions as transformers' own DefaultFlowCallback over 12 steps of 4 per epoch."""
    import transformers

    from trainer.args import TrainingArguments
    from trainer.loop.callbacks import DefaultFlowCallback, TrainerControl, TrainerState

    fields = dict(eval_strategy=strategy, eval_steps=2, eval_delay=delay, save_strategy="no")
    ours = evaluations(DefaultFlowCallback(), TrainingArguments(**fields), TrainerState(max_steps=12),
                       TrainerControl, 12, 4)  # fmt: skip
    hf_args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", **fields
    )
    hf_state = transformers.TrainerState(max_steps=12, eval_steps=2, logging_steps=500, save_steps=500)
    theirs = evaluations(
        transformers.DefaultFlowCallback(), hf_args, hf_state, transformers.TrainerControl, 12, 4
    )
    assert ours == theirs
    first = {
        ("steps", 0): 2,
        ("steps", 5): 6,
        ("steps", 6): 6,
        ("epoch", 0): 1,
        ("epoch", 2): 2,
        ("epoch", 1.5): 2,
    }
    assert ours[0][1] == first[(strategy, delay)]


@uses("save_only_model")
def test_save_only_model_checkpoints_hold_the_weights_and_refuse_a_resume(results):
    """save_only_model: each checkpoint is an HF model directory (weights, config, trainer state; no
    DeepSpeed shards, no RNG states) under the usual manifest and marker; load_best_model_at_end
    reloads the best one's weights (step 2's: its evaluation repeats after training), under ZeRO 0
    and 3; a resume from it is refused with one line, by path and by "auto"."""
    files = [
        "COMPLETE",
        "config.json",
        "ds_config.json",
        "manifest.json",
        "model.safetensors",
        "trainer_state.json",
    ]
    for stage in ("zero0", "zero3"):
        run = results["save_only_model"][stage]
        assert run["files"] == {"checkpoint-2": files, "checkpoint-4": files}, stage
        assert run["best"] == "checkpoint-2" and run["evals"]["2"] != run["evals"]["4"], stage
        assert run["eval_after"] == pytest.approx(run["evals"]["2"], rel=1e-6), stage
        assert run["from_pretrained_equal"] and run["export_equal"], stage
    refusals = results["save_only_model"]["refusals"]
    assert len(refusals) == 2
    for line in refusals:
        assert "\n" not in line and line.startswith("resume_from_checkpoint: ")
        assert "checkpoint-4: saved with save_only_model" in line


@uses("callback_states")
def test_stateful_callbacks_are_saved_and_restored_when_asked(results):
    """restore_callback_states_from_checkpoint: every checkpoint's state holds HF's stateful_callbacks
    (transformers' EarlyStoppingCallback and the TrainerControl); resumed with the flag, the saved
    callback replaces the one passed in (its patience and its count of bad evaluations), so the run
    stops where the uninterrupted one did; without it the count starts again."""
    run = results["callback_states"]
    assert run["first"] == 6
    assert run["saved"]["EarlyStoppingCallback"] == {
        "args": {"early_stopping_patience": 2, "early_stopping_threshold": 10.0},
        "attributes": {"early_stopping_patience_counter": 1},
    }
    assert run["saved"]["TrainerControl"]["attributes"] == {}
    assert set(run["saved"]["TrainerControl"]["args"]) == {
        "should_training_stop", "should_epoch_stop", "should_save", "should_evaluate", "should_log"
    }  # fmt: skip
    assert run["restored"] == {"stopped_at": 6, "patience": 2}
    assert run["fresh"] == {"stopped_at": 8, "patience": 2}


@uses("group_by_length")
def test_group_by_length_reads_hfs_length_grouped_order_and_resumes_it(results):
    """train_sampling_strategy="group_by_length" with length_column_name: each epoch's rows come in
    the order HF's LengthGroupedSampler gives (batch 2 x accumulation 2 on one process) over the
    column's lengths, the longest first; resumed mid-epoch (checkpoint-9, 36 rows in), the run
    reads exactly the rest of that order."""
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    run = results["group_by_length"]
    column = {int(first): n for first, n in run["column"].items()}
    lengths = [column[i + 1] for i in range(24)]  # row i starts with token i + 1
    for epoch in (0, 1):
        hf = get_length_grouped_indices(lengths, 4, generator=torch.Generator().manual_seed(epoch))
        assert run["whole"][24 * epoch : 24 * (epoch + 1)] == [i + 1 for i in hf], epoch
        assert column[run["whole"][24 * epoch]] == max(lengths)
    assert run["resumed"] == run["whole"][36:]
    assert run["random"] != run["whole"]


@uses("torch_compile")
def test_torch_compile_trains_the_same_steps(results):
    """torch_compile with the aot_eager backend: DeepSpeed's engine compiles the model, dynamo
    captures its graphs, and the per-step losses and grad norms equal the uncompiled run's."""
    assert_compiled_like_eager(results["torch_compile"])


@pytest.mark.slow
@uses("torch_compile_inductor")
def test_torch_compile_with_inductor_trains_the_same_steps(results):
    """The default backend, its kernels built on this CPU: the same steps as the uncompiled run."""
    assert_compiled_like_eager(results["torch_compile_inductor"])


def test_torch_compile_is_inductor_unless_another_backend_is_named():
    from trainer.args import TrainingArguments
    from trainer.loop.steps import torch_compile_for

    assert torch_compile_for(TrainingArguments(output_dir="o")) is None
    assert torch_compile_for(TrainingArguments(output_dir="o", torch_compile=True)).backend == "inductor"
    named = torch_compile_for(TrainingArguments(output_dir="o", torch_compile_backend="aot_eager"))
    assert named.backend == "aot_eager"
    assert torch_compile_for(
        TrainingArguments(output_dir="o", torch_compile_mode="max-autotune")
    ).options == {"mode": "max-autotune"}


def assert_compiled_like_eager(run: dict[str, Any]) -> None:
    for key in ("loss", "grad_norm"):
        assert close(run["compiled"][key], run["eager"][key]), (key, run)
    assert run["compiled"]["is_compiled"] and not run["eager"]["is_compiled"]
    assert run["graphs"] > 0


LIGER_ON_CPU = (
    "use_liger_kernel: Liger's kernels are Triton kernels for GPUs and this run is on a CPU; "
    "set use_liger_kernel false"
)


def test_use_liger_kernel_is_refused_on_a_cpu_before_anything_loads(tmp_path):
    """use_liger_kernel on this CPU: one line from the Trainer (before its process group or engine)
    and from build_run (before the tokenizer, the data or the model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer import Trainer, TrainingArguments
    from trainer.args import RunConfig
    from trainer.config.errors import ConfigError
    from trainer.loop.build import build_run

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))  # fmt: skip
    with pytest.raises(ConfigError) as err:
        Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "api"), use_liger_kernel=True))
    assert str(err.value) == LIGER_ON_CPU
    with pytest.raises(ConfigError) as err:
        build_run(RunConfig.from_flat({"output_dir": str(tmp_path / "run"), "use_liger_kernel": True}))
    assert str(err.value) == LIGER_ON_CPU
    assert not (tmp_path / "api").exists() and not (tmp_path / "run").exists()


def test_use_liger_kernel_on_a_gpu_names_the_package_when_it_is_missing():
    import importlib.util

    from trainer.args import TrainingArguments
    from trainer.config.errors import ConfigError
    from trainer.config.hardware import Hardware
    from trainer.model.liger import check_liger

    if importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger-kernel is installed here")
    with pytest.raises(ConfigError) as err:
        check_liger(TrainingArguments(use_liger_kernel=True), Hardware.cuda("NVIDIA H100", (9, 0)))
    assert str(err.value) == "use_liger_kernel: needs the liger-kernel package: pip install liger-kernel"


def test_use_liger_kernel_is_refused_at_the_command_line_door(tmp_path):
    proc = launch(["scripts/train.py", "--output_dir", str(tmp_path / "run"), "--use_liger_kernel", "true"],
                  launcher="python", timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"error: {LIGER_ON_CPU}"
    assert "Traceback" not in proc.stderr
    assert {p.name for p in (tmp_path / "run").iterdir()} <= {".trainer.lock"}  # the door's claim, no more
