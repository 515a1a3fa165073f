"""scripts/train.py through the real launchers: outputs, export, bad input, an HF script ported.

The outputs are those of the launch matrix's run of the README's command (``deepspeed-default``). The
refusals of bad input on one process are not ``distributed``."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers.launch import ROOT, launch
from tests.helpers.matrix import CASES, RECIPE, STEPS, TINY
from tests.helpers.scaffold import loss_steps, read_metrics

DEFAULT = "deepspeed-default"  # the launch matrix's run of the README's command, as written


@pytest.fixture
def default_run(matrix_runs):
    run = matrix_runs(DEFAULT)
    return run.out, run


@pytest.mark.distributed
def test_metrics_rows_have_the_contract_fields(default_run):
    out, _ = default_run
    rows = read_metrics(out)
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for row in train:
        for key in ("step", "epoch", "loss", "learning_rate", "grad_norm", "tokens_per_second"):
            assert key in row, key
    assert train[-1]["loss"] < train[0]["loss"]
    assert any("eval_loss" in r for r in rows)


@pytest.mark.distributed
def test_output_dir_holds_configs_and_checkpoints(default_run):
    out, _ = default_run
    ds = json.loads((out / "ds_config.json").read_text())
    micro = RECIPE["per_device_train_batch_size"]
    assert ds["train_micro_batch_size_per_gpu"] == micro
    assert ds["train_batch_size"] == 2 * micro * ds["gradient_accumulation_steps"]  # 2 ranks
    assert "auto" not in json.dumps(ds)
    run = yaml.safe_load((out / "run_config.yaml").read_text())
    assert run["max_steps"] == STEPS and run["dataset"] == "stdlib"
    assert (out / f"checkpoint-{STEPS}" / "COMPLETE").is_file()
    manifest = json.loads((out / f"checkpoint-{STEPS}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["step"] == STEPS
    assert any(name.startswith("ds/") for name in manifest["files"])


@pytest.mark.distributed
def test_trainer_export_of_a_checkpoint_matches_the_final_export(default_run, tmp_path):
    """`trainer export` rebuilds the model from the last checkpoint alone: same logits as final/."""
    from transformers import AutoModelForCausalLM

    out, _ = default_run
    proc = launch(
        ["-m", "trainer.cli.main", "export", str(out / f"checkpoint-{STEPS}"), str(tmp_path / "hf")],
        launcher="python",
    )
    assert "Exported" in proc.stdout
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    ids = torch.arange(1, 33)[None]
    torch.testing.assert_close(exported(ids).logits, final(ids).logits, rtol=0, atol=1e-5)
    bad = launch(
        ["-m", "trainer.cli.main", "export", str(out / "nope"), str(tmp_path / "x")],
        launcher="python",
        check=False,
    )
    assert bad.returncode == 2 and "not a complete checkpoint" in bad.stderr


@pytest.mark.distributed
def test_rerun_resumes_from_newest_complete_checkpoint(default_run, tmp_path):
    """The same command again, with more steps, on a copy of the run (the matrix's stays as it is)."""
    out = tmp_path / "run"
    shutil.copytree(default_run[0], out)
    more = STEPS + 2
    proc = launch(
        ["scripts/train.py", "--output_dir", str(out), *TINY, *CASES[DEFAULT].args, "--max_steps", str(more)],
        launcher=CASES[DEFAULT].launcher,
    )
    assert f"Resumed from {out / f'checkpoint-{STEPS}'} at step {STEPS}" in proc.stdout
    assert loss_steps(out)[-1] == more
    # The summary's best eval loss counts every evaluation, the final one (at step 6) included.
    evals = [row for row in read_metrics(out) if "eval_loss" in row]
    assert [row["step"] for row in evals] == [STEPS, more]
    best = min(evals, key=lambda row: row["eval_loss"])
    assert f"best eval loss    {best['eval_loss']:.4f} (step {best['step']})" in proc.stdout
    assert f"eval_loss {evals[-1]['eval_loss']:.4f}" in proc.stdout


def _plain(args: list[str], **env) -> tuple[int, str]:
    proc = launch(args, launcher="python", check=False)
    return proc.returncode, proc.stdout + proc.stderr


def test_unknown_recipe_field_is_one_clear_error(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("max_step: 10\n")
    code, out = _plain(["scripts/train.py", "--config", str(recipe), "--output_dir", str(tmp_path / "o")])
    assert code == 2
    assert "error: max_step: unknown key; did you mean max_steps?" in out
    assert "Traceback" not in out
    assert not (tmp_path / "o").exists()  # nothing was built or written


@pytest.mark.distributed
def test_impossible_batch_for_world_size_fails_before_model_build(tmp_path):
    proc = launch(
        [
            "scripts/train.py",
            "--output_dir",
            str(tmp_path / "o"),
            "--deepspeed",
            json.dumps({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2}),  # 6 / (2 x 2 ranks)
        ],
        launcher="deepspeed",  # torchrun prints a traceback of its own for a failed rank
        check=False,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "train_batch_size" in text and "Traceback" not in text
    assert not (tmp_path / "o").exists()


def test_fp16_on_cpu_is_refused_by_name(tmp_path):
    code, out = _plain(["scripts/train.py", "--output_dir", str(tmp_path / "o"), "--fp16"])
    assert code == 2
    assert re.search(r"error: fp16\S*: ", out), out
    assert "Traceback" not in out


@pytest.mark.distributed
def test_hf_trainer_script_runs_with_our_import(tmp_path):
    source = (ROOT / "tests" / "helpers" / "hf_trainer_script.py").read_text()
    hf_import = "from transformers import Trainer, TrainingArguments"
    assert hf_import in source
    ported = tmp_path / "ported.py"
    ported.write_text(source.replace(hf_import, "from trainer import Trainer, TrainingArguments"))
    proc = launch([str(ported), str(tmp_path / "out")])
    metrics = json.loads(proc.stdout.split("METRICS", 1)[1].strip().splitlines()[0])
    assert metrics["eval_loss"] > 0
    out = tmp_path / "out"
    assert loss_steps(out) == [4, 8, 12]
    # Under ZeRO-3, in HF's layout: the gathered weights (not empty shards) and the results files.
    weights = load_file(out / "model.safetensors")
    assert weights["model.embed_tokens.weight"].shape[1] == 64
    assert all(t.numel() > 0 for t in weights.values())
    assert (out / "config.json").is_file()
    train = json.loads((out / "train_results.json").read_text())
    assert train["train_loss"] > 0 and {"train_runtime", "total_flos"} <= set(train)
    assert json.loads((out / "eval_results.json").read_text()) == metrics
    assert json.loads((out / "all_results.json").read_text()) == {**train, **metrics}
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 12
    assert json.loads((out / "ds_config.json").read_text())["zero_optimization"]["stage"] == 3
