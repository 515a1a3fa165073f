"""An HF example script in run_clm's shape (tests/helpers/run_clm_shaped.py), run through the user's
door: flags or one args.json parsed by HfArgumentParser, a ZeRO-3 DeepSpeed JSON with "auto" values
(as HF's docs write it) passed as --deepspeed, the real deepspeed launcher.

Three launches: the script with our Trainer import on 2 ranks (flags), the same on 2 ranks from an
args.json, and the original script (transformers' own Trainer) on one process as the reference.
HF's Trainer runs the same ZeRO-3 file there: DeepSpeed on one CPU process needs only the
environment a launcher would set (RANK, WORLD_SIZE, MASTER_ADDR, ...), as HF documents for notebooks.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import TrainerState as HFTrainerState

from tests.helpers.launch import ROOT, free_port, launch, run_env, together
from tests.helpers.scaffold import bpe_tokenizer

pytestmark = pytest.mark.distributed

SCRIPT = ROOT / "tests" / "helpers" / "run_clm_shaped.py"
HF_IMPORT = "from transformers import Trainer, TrainingArguments"
OUR_IMPORT = "from trainer import Trainer, TrainingArguments"

# The files of HF's output-dir layout that both Trainers write (results, state, model export).
HF_LAYOUT = {
    "train_results.json",
    "eval_results.json",
    "all_results.json",
    "trainer_state.json",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "training_args.bin",
    "README.md",  # the model card the script's last lines write
}
# What only ours writes: the DeepSpeed config it ran and the log rows (docs/observability.md).
OURS_ONLY_FILES = {"ds_config.json", "metrics.jsonl", ".trainer.lock"}

DS_CONFIG = {  # HF's ZeRO-3 example config: every batch, optimizer and scheduler value "auto"
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict:
    """Text files of stdlib source, a byte-level BPE tokenizer saved as an HF tokenizer directory,
    the DeepSpeed JSON, the script with our import, and the arguments both runs share."""
    import argparse
    import dataclasses

    root = tmp_path_factory.mktemp("run_clm")
    lines = [
        line
        for module in (argparse, dataclasses)
        for line in Path(module.__file__).read_text().splitlines()
        if line.strip()
    ]
    (root / "train.txt").write_text("\n".join(lines[:400]) + "\n")
    (root / "validation.txt").write_text("\n".join(lines[400:480]) + "\n")
    bpe_tokenizer(lines[:480], model_max_length=128).save_pretrained(root / "tokenizer")
    (root / "ds.json").write_text(json.dumps(DS_CONFIG, indent=2))

    source = SCRIPT.read_text()
    assert source.count(HF_IMPORT) == 1
    ours = root / "run_clm_ours.py"
    ours.write_text(source.replace(HF_IMPORT, OUR_IMPORT))

    args = {
        "tokenizer_name": str(root / "tokenizer"),
        "train_file": str(root / "train.txt"),
        "validation_file": str(root / "validation.txt"),
        "block_size": 32,
        "max_eval_samples": 16,
        "do_train": True,
        "do_eval": True,
        "max_steps": 4,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "learning_rate": 1e-2,
        "warmup_steps": 1,
        "logging_steps": 1,
        "eval_strategy": "no",
        "save_strategy": "no",
        "report_to": "none",
        "seed": 0,
        "deepspeed": str(root / "ds.json"),
    }
    # The datasets cache (load_dataset's and the maps') stays inside the test's directory.
    env = run_env(HF_DATASETS_CACHE=str(root / "hf_datasets"))
    return {"root": root, "ours": ours, "args": args, "env": env}


def flags(args: dict) -> list[str]:
    out = []
    for key, value in args.items():
        if value is True:
            out.append(f"--{key}")
        else:
            out += [f"--{key}", str(value)]
    return out


def run_ours(prepared) -> tuple[Path, str]:
    """The script with our import on 2 ranks, under the deepspeed launcher, from flags."""
    out = prepared["root"] / "ours"
    args = flags({**prepared["args"], "output_dir": str(out)})
    proc = launch([str(prepared["ours"]), *args], launcher="deepspeed", env=prepared["env"])
    return out, proc.stdout


def run_hf(prepared) -> tuple[Path, str]:
    """The original script, transformers' Trainer, on one process with the same ZeRO-3 file."""
    out = prepared["root"] / "hf"
    env = {
        **prepared["env"],
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    args = flags({**prepared["args"], "output_dir": str(out)})
    proc = launch([str(SCRIPT), *args], launcher="python", env=env)
    return out, proc.stdout


@pytest.fixture(scope="module")
def ours_and_hf(prepared) -> dict[str, tuple[Path, str]]:
    """Both runs at once: HF's one process beside our two ranks."""
    ours, hf = together(lambda: run_ours(prepared), lambda: run_hf(prepared))
    return {"ours": ours, "hf": hf}


@pytest.fixture(scope="module")
def ours(ours_and_hf) -> tuple[Path, str]:
    return ours_and_hf["ours"]


@pytest.fixture(scope="module")
def hf(ours_and_hf) -> tuple[Path, str]:
    return ours_and_hf["hf"]


@pytest.fixture(scope="module")
def ours_json(prepared) -> tuple[Path, str]:
    """The script with our import on 2 ranks, every argument in one args.json (HfArgumentParser's
    parse_json_file). --no_local_rank: the script must see its one .json argument alone."""
    out = prepared["root"] / "ours_json"
    path = prepared["root"] / "args.json"
    path.write_text(json.dumps({**prepared["args"], "output_dir": str(out)}, indent=2))
    proc = launch(
        ["--no_local_rank", str(prepared["ours"]), str(path)], launcher="deepspeed", env=prepared["env"]
    )
    return out, proc.stdout


def results(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def losses(out: Path) -> list[float]:
    return [row["loss"] for row in results(out, "trainer_state")["log_history"] if "loss" in row]


def test_both_trainers_write_hfs_output_layout(ours, hf):
    ours_files = {p.name for p in ours[0].iterdir()}
    hf_files = {p.name for p in hf[0].iterdir()}
    assert hf_files >= HF_LAYOUT, sorted(HF_LAYOUT - hf_files)
    assert ours_files >= HF_LAYOUT, sorted(HF_LAYOUT - ours_files)
    assert hf_files - ours_files == set()
    assert ours_files - hf_files <= OURS_ONLY_FILES
    args = torch.load(ours[0] / "training_args.bin", weights_only=False)  # as HF's are read back
    assert type(args).__module__ == "trainer.args.training" and args.zero_stage == 3


def test_result_files_have_hfs_keys(ours, hf):
    for name in ("train_results", "eval_results", "all_results"):
        assert set(results(ours[0], name)) == set(results(hf[0], name)), name
    for out in (ours[0], hf[0]):
        assert {"train_samples", "eval_samples", "perplexity", "eval_accuracy"} <= set(
            results(out, "all_results")
        )
        evals = results(out, "eval_results")
        assert 0 <= evals["eval_accuracy"] <= 1
        assert evals["perplexity"] == pytest.approx(math.exp(evals["eval_loss"]), rel=1e-9)
        assert evals["eval_samples"] == 16


def test_trainer_state_has_hfs_top_level_keys(ours, hf):
    state, hf_state = results(ours[0], "trainer_state"), results(hf[0], "trainer_state")
    assert set(state) == set(hf_state)
    assert HFTrainerState.load_from_json(str(ours[0] / "trainer_state.json")).global_step == 4
    for s in (state, hf_state):
        assert s["global_step"] == s["max_steps"] == 4
        assert s["is_world_process_zero"] is True
        assert s["train_batch_size"] == 2
        # As HF's: the state's FLOPs are the run's, the number train() reported.
        assert s["total_flos"] == results(ours[0] if s is state else hf[0], "train_results")["total_flos"]
    assert [row["step"] for row in state["log_history"] if "loss" in row] == [1, 2, 3, 4]
    assert state["log_history"][-1]["train_loss"] == results(ours[0], "train_results")["train_loss"]


def test_our_run_trained(ours, hf):
    out, stdout = ours
    train = results(out, "train_results")
    assert math.isfinite(train["train_loss"])
    assert train["epoch"] == pytest.approx(16 * 2 / train["train_samples"])  # 4 steps x 2 x 2 x 2 ranks
    steps = losses(out)
    assert len(steps) == 4 and steps[-1] < steps[0], steps
    assert results(out, "eval_results")["eval_loss"] < steps[0]
    assert losses(hf[0])[-1] < losses(hf[0])[0]  # the reference learned too
    # log_metrics prints HF's blocks, once: on the main process only.
    assert stdout.count("***** train metrics *****") == 1
    assert stdout.count("***** eval metrics *****") == 1
    assert "Process rank: 1, device: cpu, world size: 2" in stdout  # every rank's warning line
    # TrainingArguments given a ZeRO-3 config makes the script's from_config build the model
    # already partitioned over the ranks, as HF's does.
    assert stdout.count("Built partitioned by ZeRO-3: True") == 2
    assert "Built partitioned by ZeRO-3: True" in hf[1]


def card(out: Path) -> tuple[dict[str, str], str, str]:
    """A model card's hyperparameters, its text before them, and its results table's lines."""
    head, rest = (out / "README.md").read_text().split("### Training hyperparameters", 1)
    block, tail = rest.split("### Training results", 1)
    table = tail.strip().split("\n\n")[0].splitlines() if tail.strip().startswith("|") else []
    return dict(re.findall(r"^- (\w+): (.*)$", block, re.M)), head, table


def test_both_trainers_write_the_model_card_run_clm_ends_with(ours, hf):
    (hp, head, table), (hf_hp, hf_head, _) = card(ours[0]), card(hf[0])
    for key in ("learning_rate", "train_batch_size", "eval_batch_size", "seed", "gradient_accumulation_steps",
                "lr_scheduler_type", "lr_scheduler_warmup_steps", "training_steps"):  # fmt: skip
        # HF 5 writes warmup_steps as a float (a value below 1 is a ratio there); ours is a step count.
        assert hp[key] == hf_hp[key] or float(hp[key]) == float(hf_hp[key]), key
    assert (hp["num_devices"], hp["total_train_batch_size"]) == ("2", "8")  # 2 ranks x 2 x 2; HF ran 1
    assert hp["distributed_type"] == "DeepSpeed ZeRO-3"
    # HF's card links the model's empty _name_or_path as a base ("a fine-tuned version of [](...)").
    assert "This model was trained from scratch on an unknown dataset." in head
    for text in (head, hf_head):
        assert "on an unknown dataset.\n" in text and "- Loss: " in text and "- Accuracy: " in text
        assert "tags:\n- generated_from_trainer\nmetrics:\n- accuracy\n" in text
    # Ours tabulates every logging step (HF's table only evaluations inside training: none here).
    logged = [row for row in results(ours[0], "trainer_state")["log_history"] if "loss" in row]
    assert [int(line.split("|")[3]) for line in table[2:]] == [1, 2, 3, 4]
    for line, row in zip(table[2:], logged, strict=True):
        assert float(line.split("|")[1]) == pytest.approx(row["loss"], abs=5e-5)


def test_zero3_save_model_is_a_whole_hf_model(ours, hf):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    saved, reference = load_file(ours[0] / "model.safetensors"), load_file(hf[0] / "model.safetensors")
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in reference.items()}
    model = AutoModelForCausalLM.from_pretrained(ours[0])
    params = dict(model.named_parameters())
    assert params and all(p.numel() > 0 for p in params.values())
    for name, tensor in saved.items():
        assert torch.equal(params[name].detach(), tensor.to(params[name].dtype)), name
        assert tensor.abs().sum() > 0, name  # gathered from the ZeRO-3 shards, not left empty
    assert model.config.vocab_size == 512 and model.config.num_hidden_layers == 2


def test_arguments_from_a_json_file_run_the_same(ours_json, ours):
    out, stdout = ours_json
    state = results(out, "trainer_state")
    assert state["global_step"] == 4
    for name in ("train_results", "eval_results", "all_results"):
        assert set(results(out, name)) == set(results(ours[0], name)), name
    assert stdout.count("***** train metrics *****") == 1
    # The same arguments, whichever way they came: the same run, step by step.
    assert losses(out) == pytest.approx(losses(ours[0]), rel=1e-6)
    assert results(out, "eval_results")["eval_loss"] == pytest.approx(
        results(ours[0], "eval_results")["eval_loss"], rel=1e-6
    )
    ds_config = json.loads((out / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == 3
    assert ds_config["train_batch_size"] == 8  # "auto": 2 per rank x 2 accumulation x 2 ranks


def test_an_evaluation_only_run(prepared):
    """--do_eval without --do_train (one process, the ZeRO-3 file): HF's eval results, no training."""
    out = prepared["root"] / "eval_only"
    args = {k: v for k, v in prepared["args"].items() if k != "do_train"}
    launch(
        [str(prepared["ours"]), *flags({**args, "output_dir": str(out)})],
        launcher="python",
        env=prepared["env"],
    )
    evals = results(out, "eval_results")
    assert evals["eval_samples"] == 16 and evals["eval_loss"] > 0 and 0 <= evals["eval_accuracy"] <= 1
    assert set(results(out, "all_results")) == set(evals)
    assert not (out / "train_results.json").exists()
