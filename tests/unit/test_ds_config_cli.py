"""``trainer ds-config`` and ``scripts/make_ds_config.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.launch import ROOT
from trainer.args import TrainingArguments
from trainer.cli.main import main
from trainer.config import preset_config

THIRD_PARTY = Path(__file__).parent / "ds_json"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["ds-config", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_prints_the_config(capsys):
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--zero-stage", "3",
        "--precision", "bf16",
        "--offload-optimizer", "cpu",
        "--micro-batch", "4",
        "--grad-accum", "8",
        "--world-size", "16",
    )  # fmt: skip
    assert code == 0
    config = json.loads(out)
    assert (
        config["train_batch_size"],
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
    ) == (512, 4, 8)
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert config["bf16"] == {"enabled": True}


def test_generate_writes_a_file(capsys, tmp_path):
    target = tmp_path / "ds.json"
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--zero-stage",
        "2",
        "--precision",
        "fp32",
        "--micro-batch",
        "2",
        "-o",
        str(target),
    )
    assert code == 0 and out == f"wrote {target}\n"
    assert json.loads(target.read_text()) == {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True},
    }


def test_generate_refuses_a_broken_combination(capsys):
    code, out, err = run_cli(
        capsys, "generate", "--zero-stage", "0", "--offload-optimizer", "cpu", "--micro-batch", "1"
    )
    assert code == 1 and out == ""
    assert err == (
        "zero_optimization.offload_optimizer.device, zero_optimization.stage: "
        "optimizer offload needs ZeRO stage 1, 2 or 3, got stage 0\n"
    )


def test_validate_a_good_file(capsys, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(preset_config("zero2", "bf16", TrainingArguments())))
    code, out, err = run_cli(capsys, "validate", str(path), "--world-size", "4")
    assert (code, out, err) == (0, f"{path}: valid at world size 4\n", "")


def test_validate_lists_every_problem(capsys, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_batch_size": 8,
                "train_micro_batch_size_per_gpu": 2,
                "zero_optimisation": {"stage": 2},
                "fp16": {"enabled": True, "loss_scale": -1},
                "elasticity": {"enabled": True},
            }
        )
    )
    code, out, err = run_cli(capsys, "validate", str(path), "--world-size", "3")
    assert code == 1 and out == ""
    assert err.splitlines() == [
        f"{path}: 4 problems",
        "fp16.loss_scale: Input should be greater than or equal to 0; got -1",
        "zero_optimisation: unknown key; did you mean zero_optimization?",
        "elasticity: removed in DeepSpeed 0.19: elastic training was removed; set train_batch_size / "
        "train_micro_batch_size_per_gpu / gradient_accumulation_steps directly",
        "train_batch_size, train_micro_batch_size_per_gpu: 8 = 2 × g × 3 has no integer solution for "
        "gradient_accumulation_steps g at data-parallel world size 3",
    ]


def test_validate_a_third_party_file_with_autos(capsys):
    path = THIRD_PARTY / "hf_zero3.json"
    code, out, _ = run_cli(
        capsys, "validate", str(path), "--world-size", "2", "--hidden-size", "64", "--resolved"
    )
    assert code == 0
    first, rest = out.split("\n", 1)
    assert (
        first
        == f'{path}: valid at world size 2; 16 "auto" values resolved from the default training arguments'
    )
    assert json.loads(rest)["zero_optimization"]["reduce_bucket_size"] == 4096


def test_validate_against_a_recipe_finds_contradictions(capsys, tmp_path):
    recipe = tmp_path / "run.yaml"
    recipe.write_text("per_device_train_batch_size: 4\nmax_steps: 10\n")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"}))
    code, _, err = run_cli(capsys, "validate", str(path), "--config", str(recipe))
    assert code == 1
    assert err.splitlines() == [
        f"{path}: 1 problem",
        "train_micro_batch_size_per_gpu: 2 contradicts per_device_train_batch_size=4 in the training arguments; "
        'remove the key, set it to "auto", or make them equal',
    ]


def test_validate_a_missing_file(capsys, tmp_path):
    code, _, err = run_cli(capsys, "validate", str(tmp_path / "nope.json"))
    assert code == 1 and err == f"deepspeed: DeepSpeed config file not found: {tmp_path / 'nope.json'}\n"


def test_presets_and_check(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "presets", "--out-dir", str(tmp_path))
    assert code == 0 and len(out.splitlines()) == 21
    assert run_cli(capsys, "presets", "--out-dir", str(tmp_path), "--check")[0] == 0
    (tmp_path / "zero1_fp16.json").write_text("{}\n")
    code, _, err = run_cli(capsys, "presets", "--out-dir", str(tmp_path), "--check")
    assert code == 1
    assert err.splitlines() == [
        f"{tmp_path / 'zero1_fp16.json'}: differs from the schema's preset",
        "regenerate with: trainer ds-config presets",
    ]


def test_reference_check(capsys, tmp_path):
    assert run_cli(capsys, "reference", "--check", "-o", str(ROOT / "docs" / "config.md"))[0] == 0
    stale = tmp_path / "config.md"
    stale.write_text("old\n")
    code, _, err = run_cli(capsys, "reference", "--check", "-o", str(stale))
    assert (
        code == 1
        and err == f"{stale}: out of date; regenerate with: trainer ds-config reference -o {stale}\n"
    )


def test_make_ds_config_script_writes_the_presets(tmp_path):
    script = ROOT / "scripts" / "make_ds_config.py"
    proc = subprocess.run(
        [sys.executable, str(script), "presets", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.glob("*.json")) == sorted(
        p.name for p in (ROOT / "ds_configs").glob("*.json")
    )
    for path in tmp_path.glob("*.json"):
        assert path.read_text() == (ROOT / "ds_configs" / path.name).read_text()


def test_config_tools_never_import_torch_or_deepspeed(tmp_path):
    code = (
        "import sys\n"
        "from trainer.cli.main import main\n"
        "from trainer.config import resolve, Hardware\n"
        "from trainer.args import TrainingArguments\n"
        "resolve(TrainingArguments(max_steps=1, zero_stage=3), 2, Hardware.cpu())\n"
        f"assert main(['ds-config', 'presets', '--out-dir', {str(tmp_path)!r}]) == 0\n"
        "loaded = sorted(m for m in ('torch', 'deepspeed') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
