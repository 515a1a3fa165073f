"""Preference training through the public command: ``scripts/train.py --objective dpo|orpo|simpo``
on a saved tiny Llama and a JSON-lines file of pairs, under the deepspeed launcher (ZeRO-3, with
LoRA and without) and plain python. (ORPO and SimPO on 2 ranks under torchrun, through the Python
API: tests/distributed/test_preference_zero.py.)

One launch each, shared by the tests: DPO on one process (the reference run), DPO on 2 ranks under
ZeRO-3 with a tiled loss of 7 tokens a tile (the same global batches; tiled or not, the same steps),
DPO on 2 ranks with sequence parallelism (both ranks every pair, each half of every sequence), DPO
with LoRA on 2 ranks under ZeRO-3 with the optimizer offloaded to the CPU, ORPO on one process with
two accumulated micro-batches, SimPO on one process in padding-free batches. Each one-process run
goes beside a launch of two ranks."""

from __future__ import annotations

import functools
import math
import shutil

import pytest

from tests.helpers.kto_scenarios import METRICS as KTO_METRICS
from tests.helpers.kto_scenarios import completions
from tests.helpers.launch import launch, together
from tests.helpers.preference_scenarios import EXTRA_METRICS, LOGIT_METRICS, METRICS, base, pairs
from tests.helpers.scaffold import file_digests, read_metrics

pytestmark = pytest.mark.distributed

COMMON = ["--max_steps", "4", "--learning_rate", "1e-2", "--lr_scheduler_type", "constant", "--warmup_ratio", "0",
          "--logging_steps", "1", "--max_length", "24", "--eval_steps", "4", "--save_steps", "4"]  # fmt: skip


def train_rows(out) -> list[dict]:
    return [r for r in read_metrics(out) if "loss" in r and "train_runtime" not in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference_cli")
    model = base(root)
    data = root / "prefs.jsonl"
    pairs("text", 34).to_json(data)  # 32 train pairs, 2 held out (validation_split_percentage 5)
    completions(34).to_json(root / "kto.jsonl")  # KTO's labelled completions, as many
    start = ["scripts/train.py", "--model_name_or_path", model, "--cache_dir", str(root / "cache"), *COMMON]
    specs = {
        "dpo_one": ("python", 1, ["--objective", "dpo", "--per_device_train_batch_size", "4"]),
        "dpo_zero3": ("deepspeed", 2, ["--objective", "dpo", "--zero_stage", "3", "--per_device_train_batch_size", "2",
                                       "--tiled_loss", "true", "--tile_tokens", "7"]),
        "dpo_sp2": ("deepspeed", 2, ["--objective", "dpo", "--sequence_parallel_size", "2",
                                     "--per_device_train_batch_size", "4"]),
        "dpo_lora_zero3": ("deepspeed", 2, ["--objective", "dpo", "--zero_stage", "3", "--per_device_train_batch_size",
                                            "2", "--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8",
                                            "--offload_optimizer", "cpu"]),
        "orpo_accumulated": ("python", 1, ["--objective", "orpo", "--beta", "0.5", "--per_device_train_batch_size",
                                           "2", "--gradient_accumulation_steps", "2"]),
        "simpo_one": ("python", 1, ["--objective", "simpo", "--beta", "2.0", "--per_device_train_batch_size", "4",
                                    "--padding_free", "true"]),
        "kto_one": ("python", 1, ["--objective", "kto", "--per_device_train_batch_size", "4"]),
        "kto_zero3": ("deepspeed", 2, ["--objective", "kto", "--zero_stage", "3", "--per_device_train_batch_size", "2"]),
    }  # fmt: skip
    out = {name: root / name for name in specs}
    out["start"] = [*start, "--dataset", str(data)]

    def run(name: str) -> None:
        launcher, nproc, extra = specs[name]
        dataset = root / ("kto.jsonl" if name.startswith("kto") else "prefs.jsonl")
        command = [*start, "--dataset", str(dataset), "--output_dir", str(out[name]), *extra]
        proc = launch(command, nproc=nproc, launcher=launcher)
        out[f"{name}.stdout"] = proc.stdout

    ones = [name for name in specs if specs[name][1] == 1]
    ranks = [name for name in specs if specs[name][1] > 1]
    for pair in zip(ones, ranks, strict=True):  # each one-process run beside a launch of two ranks
        together(*(functools.partial(run, name) for name in pair))
    return out


@pytest.mark.parametrize("name", ["dpo_zero3", "dpo_sp2"])
def test_dpo_on_two_ranks_follows_one_process(runs, name):
    """Under ZeRO-3 with a tiled loss (each rank 2 of the 4 pairs), and with sequence parallelism
    (both ranks the 4 pairs, each half of every sequence). TRL's num_tokens counts every rank's."""
    one, three = train_rows(runs["dpo_one"]), train_rows(runs[name])
    assert [r["step"] for r in one] == [r["step"] for r in three] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", *METRICS[2:], "num_tokens"):
        first = 1 if key == "rewards/accuracies" else 0  # step 1's margins are 0 up to rounding
        ours = [r[key] for r in three][first:]
        assert ours == pytest.approx([r[key] for r in one][first:], rel=1e-5, abs=1e-6), key


def test_the_zero3_run_tiled_its_loss(runs):
    assert "The loss in tiles of 7 tokens" in runs["dpo_zero3.stdout"]
    assert "The loss in tiles" not in runs["dpo_one.stdout"]


def test_the_first_dpo_step_is_at_the_reference(runs):
    for name in ("dpo_one", "dpo_zero3", "dpo_sp2", "dpo_lora_zero3"):
        first = train_rows(runs[name])[0]
        assert first["loss"] == pytest.approx(math.log(2), abs=1e-6), name
        assert [first["rewards/chosen"], first["rewards/rejected"]] == pytest.approx([0, 0], abs=1e-6), name
        assert train_rows(runs[name])[-1]["loss"] < first["loss"], name


def test_the_reference_is_scored_once_and_cached_and_the_eval_set_against_it(runs):
    for name, source in (("dpo_zero3", "policy"), ("dpo_lora_zero3", "adapters_off")):
        stdout = runs[f"{name}.stdout"]
        assert f"Scoring the train set's 32 pairs under the reference ({source})." in stdout, name
        assert f"Scoring the eval set's 2 pairs under the reference ({source})." in stdout, name
        cached = sorted(p.name for p in (runs[name] / "reference").iterdir())
        assert cached == ["eval.json", "eval.safetensors", "train.json", "train.safetensors"], name
        (evaluation,) = [r for r in read_metrics(runs[name]) if "eval_loss" in r]
        assert abs(evaluation["eval_loss"] - math.log(2)) > 1e-4, (
            name
        )  # the trained policy, the initial reference
        assert f"eval_loss {evaluation['eval_loss']:.4f}\n" in stdout  # no perplexity for a preference loss


def test_lora_trains_the_adapters_only_and_exports_them(runs):
    stdout = runs["dpo_lora_zero3.stdout"]
    assert "Parameters: " in stdout and "(100.00%)" not in stdout
    final = runs["dpo_lora_zero3"] / "final"
    assert (final / "adapter_model.safetensors").is_file() or (final / "model.safetensors").is_file()


@pytest.mark.parametrize("name, method", [("orpo_accumulated", "orpo"), ("simpo_one", "cpo")])
def test_reference_free_objectives_log_trls_metrics_and_learn(runs, name, method):
    rows = train_rows(runs[name])
    # simpo_one's batches are padding-free: no rank holds the whole logits the logits/* metrics read
    keys = [k for k in (*METRICS, *EXTRA_METRICS[method]) if name != "simpo_one" or k not in LOGIT_METRICS]
    assert len(rows) == 4 and all(k in rows[0] for k in keys), rows[0]
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"]
    assert not (runs[name] / "reference").exists()  # no reference pass
    if name == "simpo_one":
        assert [r["nll_loss"] for r in rows] == [0.0] * 4  # SimPO: cpo_alpha 0


@pytest.mark.parametrize(
    "flags, refusal",
    [
        (  # docs/preference.md's ORPO command after its DPO command, in the same output folder
            ["--objective", "orpo", "--beta", "0.5", "--gradient_accumulation_steps", "2"],
            "objective: {ckpt} was saved with objective dpo and this run asks for orpo; another objective is "
            "another run: resume with objective dpo",
        ),
        (  # the same objective at ZeRO-0 on one process
            ["--objective", "dpo", "--per_device_train_batch_size", "2"],
            "zero_stage: {ckpt} was saved with zero_stage 3 and this run asks for 0; ZeRO 1 and 2 resume each "
            "other's checkpoints, ZeRO 0 and 3 only their own: resume with zero_stage 3",
        ),
    ],
    ids=["objective", "zero_stage"],
)
def test_a_change_the_checkpoint_cannot_carry_is_one_line_before_the_model_loads(
    runs, tmp_path, flags, refusal
):
    """The 2-rank ZeRO-3 DPO run's checkpoint, resumed (auto) by one process with another objective or
    ZeRO stage: refused at the door, naming the setting and both values, with nothing written to it
    (DeepSpeed's loader otherwise died after the model loaded: a bare AssertionError)."""
    out = tmp_path / "out"
    checkpoint = out / "checkpoint-4"
    shutil.copytree(runs["dpo_zero3"] / "checkpoint-4", checkpoint)
    before = file_digests(checkpoint)
    proc = launch([*runs["start"], "--output_dir", str(out), "--max_steps", "8", *flags], launcher="python",
                  check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {refusal.format(ckpt=checkpoint)}, or use a new --output_dir, or --resume_from_checkpoint false "
        "to start over"
    ], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Parameters: " not in proc.stdout  # no model was built
    assert file_digests(checkpoint) == before


def test_a_bad_pair_is_one_line_naming_the_row(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Q", "chosen": " A", "rejected": " B"}\n{"prompt": "Q", "chosen": " A"}\n')
    proc = launch(["scripts/train.py", "--objective", "dpo", "--model_name_or_path", base(tmp_path),
                   "--dataset", str(bad), "--validation_split_percentage", "0", "--output_dir", str(tmp_path / "o"),
                   "--cache_dir", str(tmp_path / "cache")], launcher="python", check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        proc.stderr.strip().splitlines()[-1] == "error: dataset: the train set's row 1: rejected is missing"
    )
    assert "Traceback" not in proc.stderr


def test_kto_on_two_ranks_under_zero3_follows_one_process(runs):
    """``--objective kto`` on a JSON-lines file of labelled completions: 2 ranks of 2 rows are the
    4-row global micro-batch of one process (its KL pairs, estimate and loss), and the run
    evaluates its held-out rows and exports a loadable model."""
    one, three = train_rows(runs["kto_one"]), train_rows(runs["kto_zero3"])
    assert [r["step"] for r in one] == [r["step"] for r in three] == [1, 2, 3, 4]
    for key in KTO_METRICS:
        tolerance = 7.6e-6 if key == "kl" else 1e-6  # kl: test_kto_zero.py says why
        assert [r[key] for r in three] == pytest.approx([r[key] for r in one], rel=1e-5, abs=tolerance), key
    assert any("eval_loss" in r and "eval_kl" in r for r in read_metrics(runs["kto_zero3"]))
    assert (runs["kto_zero3"] / "final" / "model.safetensors").is_file()
