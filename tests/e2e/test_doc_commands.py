"""Every command that README.md and docs/ show is run by a test, or its doc says why not.

A command is a line of a fenced code block (after a ``$ `` prompt, if any) or a backticked span of
prose that starts a program users type, after any ``NAME=value`` environment words. Each kind has
one rule:

- every command, marked and synopsis (placeholders such as ``CHECKPOINT``, ``N``, ``[...]``) included:
  each ``--option`` it names is in the ``--help`` of the program it belongs to (the installed
  ``trainer`` console script, the launcher, the script); a module it names exists. A synopsis or a
  bare mention (a launcher and its options, no script) is checked this way alone;
- a launch of ``scripts/train.py``: ``--help`` runs as written; otherwise it is a case of the launch
  matrix (``test_launch_matrix.CASES``: the same launcher and arguments, the job sized to 2 CPU
  ranks and a tiny model appended), or ``TEST_NODES`` names the test that runs it;
- ``trainer ds-config``, ``trainer plan`` and ``trainer ... --help`` run as written, through the
  installed ``trainer`` console script, and so do the scripts of ``CHEAP_SCRIPTS``; a ``$`` line's
  output shown below it must be what it prints;
- other scripts (benchmarks, the fault campaign) are run, scaled down, by the test ``TEST_NODES``
  names: that test exists, and its module passes the script every option the command names;
- ``make`` targets: ``MAKE_TARGETS`` says which test or CI step runs each, and that is checked
  against the Makefile and ``.ci/run``;
- a block line that cannot run on one CPU machine (GPUs, several nodes, a SLURM cluster) is preceded
  in its block by a comment ``# not run by the tests: <why>``.
"""

from __future__ import annotations

import ast
import functools
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.test_launch_matrix import CASES
from tests.helpers.launch import BIN, ROOT, run_env
from trainer.cli.main import SUBCOMMANDS

PROGRAMS = ("deepspeed", "torchrun", "accelerate", "python", "trainer", "make", "sbatch")
NOT_RUN = "# not run by the tests:"
ENV_WORD = re.compile(r"[A-Za-z_]\w*=\S*")
# Words that stand for something the user fills in: CHECKPOINT, N, [--qlora], ..., $JOB.
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*|\.\.\.|\[.*|.*\]|\$\w+.*")
# Launcher options that only size the job (the matrix sizes it to 2 CPU ranks) or restart it.
SIZING = {"--num_gpus", "--nproc_per_node", "--num_processes", "--max-restarts", "--max_restarts"}
SIZING_FLAGS = {"--multi_gpu"}
# Commands a test other than the launch matrix runs (scaled down): the test node, whose module must
# pass the script (or module) and every option of the command.
TEST_NODES = {
    "scripts/suite_cpu.py": "tests/unit/test_suite_cpu.py::test_the_report_sums_by_program_and_by_test_module",
    "scripts/bench.py": "tests/e2e/test_bench.py::test_json_holds_the_five_systems_with_the_contract_keys",
    "scripts/bench_checkpoint.py": "tests/e2e/test_bench_checkpoint.py::test_reports_save_and_raw_speeds_and_blocked_times",
    "scripts/bench_comm.py": "tests/e2e/test_bench_comm.py::test_two_gloo_ranks_write_the_json_report",
    "scripts/bench_preference.py": "tests/e2e/test_bench_preference.py::test_ours_and_trl_train_the_same_dpo_job_on_zero3",
    "scripts/bench_data.py": "tests/e2e/test_bench_data.py::test_the_report_holds_every_figure_and_resumes_were_exact",
    "scripts/bench_long_context.py": "tests/e2e/test_bench_long_context.py::test_json_holds_every_probe_and_sp_trains_at_least_as_long",
    "scripts/fault_campaign.py": "tests/e2e/test_fault_campaign.py::test_every_fault_hits_and_every_run_recovers",
    # scripts/train.py launches the matrix does not hold
    "python scripts/train.py": "tests/e2e/test_rerun.py::test_safe_changes_resume_and_are_named",
    "deepspeed --num_gpus 2 scripts/train.py --sequence_parallel_size 2": (
        "tests/e2e/test_sequence_parallel.py::test_two_ranks_follow_the_one_rank_losses_and_grad_norms"
    ),
    "deepspeed --num_gpus 2 scripts/train.py --model_type mixtral --expert_parallel_size 2 --zero_stage 3": (
        "tests/e2e/test_moe.py::test_two_ranks_accumulating_take_one_process_steps"
    ),
    "scripts/bench_moe.py": "tests/e2e/test_bench_moe.py::test_expert_parallelism_is_measured_against_zero3",
    "deepspeed --num_gpus 2 scripts/train.py --tensor_parallel_size 2 --zero_stage 2": (
        "tests/e2e/test_tensor_parallel.py::test_a_group_of_two_follows_one_process"
    ),
    "python scripts/train.py --config scripts/recipes/stream_mixture.yaml": (
        "tests/e2e/test_streaming_one_process.py::test_the_offline_mixture_recipe_streams"
    ),
    "python scripts/train.py --report_to wandb mlflow tensorboard --run_name demo": (
        "tests/e2e/test_report_to.py::test_wandb_offline_run_holds_the_metrics"
    ),
    **dict.fromkeys(
        [
            "deepspeed --num_gpus 2 scripts/train.py --objective dpo --beta 0.1 --zero_stage 3 "
            "--model_name_or_path BASE --dataset prefs.jsonl",
            "deepspeed --num_gpus 2 scripts/train.py --objective dpo --zero_stage 3 --use_peft true --lora_r 4 "
            "--model_name_or_path BASE --dataset prefs.jsonl",
            "python scripts/train.py --objective orpo --beta 0.5 --gradient_accumulation_steps 2 "
            "--model_name_or_path BASE --dataset prefs.jsonl",
            "python scripts/train.py --objective simpo --beta 2.0 --model_name_or_path BASE --dataset prefs.jsonl",
        ],
        "tests/e2e/test_preference_cli.py::test_dpo_on_two_ranks_follows_one_process",
    ),
    "deepspeed --num_gpus 2 scripts/train.py --objective dpo --zero_stage 3 --tiled_loss true --tile_tokens 7 "
    "--model_name_or_path BASE --dataset prefs.jsonl": "tests/e2e/test_preference_cli.py::test_the_zero3_run_tiled_its_loss",
    "deepspeed --num_gpus 2 scripts/train.py --objective dpo --sequence_parallel_size 2 --model_name_or_path BASE "
    "--dataset prefs.jsonl": "tests/e2e/test_preference_cli.py::test_dpo_on_two_ranks_follows_one_process",
    **dict.fromkeys(
        [
            "deepspeed --num_gpus 2 scripts/train.py --objective grpo --zero_stage 3 --model_name_or_path BASE "
            "--dataset prompts.jsonl --reward_funcs my_rewards:parses,my_rewards:length --num_generations 8",
            "deepspeed --num_gpus 2 scripts/train.py --objective grpo --zero_stage 3 --use_peft true --lora_r 4 "
            "--beta 0.2 --model_name_or_path BASE --dataset prompts.jsonl --reward_funcs my_rewards:parses",
            "python scripts/train.py --objective rloo --model_name_or_path BASE --dataset prompts.jsonl "
            "--reward_funcs my_rewards:parses",
        ],
        "tests/e2e/test_grpo_cli.py::test_trls_metric_names_are_logged",
    ),
    "scripts/bench_rl.py": "tests/e2e/test_bench_rl.py::test_ours_and_trl_train_the_same_grpo_job",
    "scripts/recipes/parse_share.py": "tests/e2e/test_recipe_sft_dpo.py::test_grpo_recipe_trains_on_the_prompts",
}
# make targets: who runs each (a test node, CI, a prerequisite), or why nothing does.
MAKE_TARGETS = {
    "make demo": "tests/e2e/test_launch_matrix.py::test_command_trains_and_exports_a_loadable_model[deepspeed-default]",
    "make test": ".ci/run",
    "make install": "prerequisite of make demo",
    "make test-cpu": "not run by the tests: make test again (over half an hour), each process logging its CPU",
    "make test-all": "not run by the tests: the whole suite, slow and GPU tests included (hours on CPU)",
    "make lint": "not run by the tests: ruff over the tree, run before each commit",
    "make bench": "not run by the tests: the full benchmark (minutes); test_bench.py runs it scaled down",
    "make sft-dpo": "tests/e2e/test_recipe_sft_dpo.py::test_sft_trains_the_default_model_and_dpo_starts_from_it_at_ln2",
    "make grpo": "tests/e2e/test_recipe_sft_dpo.py::test_grpo_recipe_trains_on_the_prompts",
}
# Files a command shown with its output needs, so that it prints what the doc shows.
EXAMPLE_FILES = {
    "trainer ds-config validate my_ds.json --world-size 3": {
        "my_ds.json": '{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimisation": {}}'
    },
}


@dataclass(frozen=True)
class DocCommand:
    doc: str
    command: str  # without prompt, environment words or trailing comment
    env: tuple[str, ...] = ()
    marked: bool = False  # preceded by a NOT_RUN comment
    inline: bool = False
    output: tuple[str, ...] = ()  # the lines a `$ ` line shows below it

    def __str__(self) -> str:
        return f"{self.doc}: `{' '.join([*self.env, self.command])}`"


def _split_env(line: str) -> tuple[tuple[str, ...], str]:
    words = line.split()
    n = next((i for i, w in enumerate(words) if not ENV_WORD.fullmatch(w)), len(words))
    return tuple(words[:n]), " ".join(words[n:])


def _is_command(command: str) -> bool:
    words = command.split()
    return bool(words) and words[0] in PROGRAMS and not (len(words) > 1 and words[1].endswith(":"))


def doc_commands() -> list[DocCommand]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for lang, block in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            if lang not in ("", "bash", "sh", "console"):
                continue  # Python examples, YAML recipes
            marked = False
            lines = [line.strip() for line in block.replace("\\\n", " ").splitlines()]
            for i, line in enumerate(lines):
                if line.startswith(NOT_RUN):
                    marked = True
                    continue
                env, command = _split_env(line.removeprefix("$ ").split(" #")[0])
                if not _is_command(command):
                    continue
                shown = ()
                if line.startswith("$ "):
                    rest = lines[i + 1 :]
                    end = next((j for j, o in enumerate(rest) if o.startswith("$ ")), len(rest))
                    shown = tuple(o for o in rest[:end] if o)
                found.append(DocCommand(path.name, " ".join(command.split()), env, marked, False, shown))
                marked = False
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for span in re.findall(r"`([^`\n]+)`", prose):
            env, command = _split_env(span)
            if _is_command(command) and len(command.split()) > 1:
                found.append(DocCommand(path.name, command, env, inline=True))
    return found


COMMANDS = doc_commands()


def _words(command: str) -> list[str]:
    return shlex.split(command.replace("[", " [").replace("]", "] "))


def is_synopsis(command: str) -> bool:
    """A form to fill in, or a program named with options but nothing to run."""
    words = _words(command)
    if any(PLACEHOLDER.fullmatch(w) for w in words[1:]):
        return True
    at = script_at(words)
    if words[0] in ("deepspeed", "torchrun", "accelerate", "python") and (
        at is None or words[at - 1] in ("-m", "--module")
    ):
        return True  # a launcher's options, or a module the benchmarks start: named, not shown whole
    return words[0] == "trainer" and not runs_as_written(command)


# Each example of the docs writes to a folder of its own (after `make demo`, one without would resume
# output/default's finished run); the tests choose their own.
OWN_FOLDER = re.compile(r" --output_dir \S+")


def launch_case(command: str) -> tuple[str, tuple[str, ...]] | None:
    """(launcher, script arguments) of a scripts/train.py launch, its --output_dir left out; None for
    other commands."""
    words = shlex.split(OWN_FOLDER.sub("", command))
    if "scripts/train.py" not in words:
        return None
    at = words.index("scripts/train.py")
    launcher, options = words[0], words[1:at]
    if launcher == "accelerate":
        assert options[:1] == ["launch"], command
        options = options[1:]
    i = 0
    while i < len(options):
        name = options[i].split("=")[0]
        if name in SIZING_FLAGS:
            i += 1
        elif name in SIZING:
            i += 1 if "=" in options[i] else 2
        else:
            return None  # not a matrix case
    return launcher, tuple(words[at + 1 :])


# Scripts cheap enough to run as the docs show them.
CHEAP_SCRIPTS = {"scripts/ds_key_coverage.py"}


def runs_as_written(command: str) -> bool:
    words = command.split()
    if words[0] == "trainer":  # a subcommand alone is a name in prose
        return len(words) > 2 and (words[1] in ("ds-config", "plan") or "--help" in words)
    return words[0] == "python" and (
        words[1] in CHEAP_SCRIPTS or (words[1] == "scripts/train.py" and "--help" in words)
    )


def options(words: list[str]) -> list[str]:
    return [w.split("=")[0] for w in words if w.startswith("--") and w != "--help"]


def script_at(words: list[str]) -> int | None:
    """Where the script (or ``-m``/``--module`` module) of a launch is in its words; None for none."""
    for i, w in enumerate(words):
        if w.endswith((".py", ".sbatch")) or (i and words[i - 1] in ("-m", "--module")):
            return i
    return None


def helps(command: str) -> list[tuple[tuple[str, ...] | None, list[str]]]:
    """(the program whose --help lists them, options) for each part of a command: the launcher's
    options, the script's. None: a module or a cluster script, which only has to exist."""
    words = _words(command)
    if words[0] == "trainer":
        assert words[1] in SUBCOMMANDS, f"trainer has no subcommand {words[1]!r}"
        nested = words[1] == "ds-config" and len(words) > 2 and words[2].isalpha()
        return [((str(BIN / "trainer"), *words[1 : 3 if nested else 2]), options(words))]
    at = script_at(words)
    script, before, after = (words[at], words[:at], words[at + 1 :]) if at is not None else (None, words, [])
    parts = []
    if words[0] in ("deepspeed", "torchrun", "accelerate"):
        program = (str(BIN / "accelerate"), "launch") if words[0] == "accelerate" else (str(BIN / words[0]),)
        parts.append((program, options(before)))
    if script is not None and script.endswith(".py"):
        parts.append(((sys.executable, script), options(after)))
    elif script is not None:
        found = (ROOT / script).is_file() or (ROOT / script.replace(".", "/")).with_suffix(".py").is_file()
        assert found, f"no script or module {script}"
    return parts


@functools.cache
def help_text(program: tuple[str, ...]) -> str:
    """A program's ``--help``, run once per program (each run imports torch and more: seconds)."""
    proc = subprocess.run(
        [*program, "--help"], cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (
        f"{' '.join(program)} --help failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    )
    return proc.stdout + proc.stderr


def node_module(node: str) -> Path:
    """The test module of ``node`` (``path::function[id]``), once its function is found there."""
    path, name = node.split("::")
    module = ROOT / path
    function = name.split("[")[0]
    tree = ast.parse(module.read_text())
    assert function in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, node
    return module


def test_the_docs_show_commands():
    launches = [c for c in COMMANDS if not c.marked and launch_case(c.command)]
    assert len(launches) >= 6, launches
    assert (
        any(c.inline for c in COMMANDS) and any(c.env for c in COMMANDS) and any(c.output for c in COMMANDS)
    )


# Each command once (several docs show some of them).
RUN_HERE = list(
    {
        c.command: c
        for c in reversed(COMMANDS)
        if not (c.marked or is_synopsis(c.command)) and runs_as_written(c.command)
    }.values()
)


@pytest.mark.parametrize("c", [c for c in COMMANDS if not c.command.startswith("make")], ids=str)
def test_every_option_a_command_names_exists(c):
    """Marked commands and synopses included: a renamed option fails wherever a doc shows it."""
    for program, names in helps(c.command):
        text = help_text(program)
        for name in names:
            assert re.search(rf"{re.escape(name)}\b", text), f"{c}: {' '.join(program)} has no option {name}"


@pytest.mark.parametrize(
    "c",
    [c for c in COMMANDS if not (c.marked or is_synopsis(c.command) or runs_as_written(c.command))],
    ids=str,
)
def test_every_runnable_command_is_run_by_a_test(c):
    command = c.command
    if command.startswith("make"):
        return check_make_target(c)
    case = launch_case(command)
    if case is not None and case in {(k.launcher, k.args) for k in CASES.values()}:
        return
    command = OWN_FOLDER.sub("", command)
    key = command if "scripts/train.py" in command else next((s for s in TEST_NODES if s in command), None)
    assert key in TEST_NODES, f"{c} is run by no test; add it to TEST_NODES or mark it `{NOT_RUN} <why>`"
    text = node_module(TEST_NODES[key]).read_text()
    words = _words(command)
    at = script_at(words)
    assert at is not None, f"{c}: no script"
    for word in [words[at], *options(words[at + 1 :]), *(e.split("=")[0] for e in c.env)]:
        passed = re.search(rf'"{re.escape(word)}"|\b{re.escape(word)}=', text)
        assert passed, f"{c}: {TEST_NODES[key]}'s module never passes {word}"


def check_make_target(c: DocCommand) -> None:
    assert c.command in MAKE_TARGETS, f"{c}: say in MAKE_TARGETS what runs it"
    makefile = (ROOT / "Makefile").read_text()
    target = c.command.split()[1]
    recipe = re.search(rf"^{re.escape(target)}:(.*)\n((?:\t.*\n)*)", makefile, re.M)
    assert recipe, f"{c}: the Makefile has no target {target}"
    runner = MAKE_TARGETS[c.command]
    if runner == ".ci/run":
        assert c.command in (ROOT / ".ci/run").read_text().splitlines(), f"{c}: .ci/run does not run it"
    elif runner.startswith("prerequisite of"):
        dependent = runner.split()[-1]
        assert re.search(rf"^{dependent}:.*\b{target}\b", makefile, re.M), f"{c}: {runner} is not so"
    elif runner.startswith("tests/") and target != "demo":
        # A recipe of several commands, scaled down by its test: the test runs each script and config.
        text = node_module(runner).read_text()
        for line in recipe.group(2).splitlines():
            files = [w for w in line.split() if w.startswith("scripts/")]
            assert all(Path(f).name.split(".")[0] in text for f in files), (
                f"{c}: {runner} does not run `{line.strip()}`"
            )
    elif runner.startswith("tests/"):
        # make demo is the embedded default: scripts/train.py with no arguments, the matrix's case.
        node_module(runner)
        shown = recipe.group(2).strip()
        assert shown.split()[-1] == "scripts/train.py", (
            f"{c}: the recipe is no longer the default run: {shown}"
        )
        assert CASES[runner.split("[")[1].rstrip("]")].args == ()
    else:
        assert runner.startswith(NOT_RUN.removeprefix("# ")) and len(runner) > len(NOT_RUN) + 8, runner


@pytest.mark.parametrize("c", RUN_HERE, ids=str)
def test_commands_run_as_written(c, tmp_path):
    """Through the installed console script (or python for scripts/train.py), in a scratch copy of
    the repository's ds_configs (``presets`` rewrites them) with the placeholder files the docs name."""
    shutil.copytree(ROOT / "ds_configs", tmp_path / "ds_configs")
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "ds_configs" / "zero2_bf16.json", tmp_path / "my_ds.json")
    for name, content in EXAMPLE_FILES.get(c.command, {}).items():
        (tmp_path / name).write_text(content)
    words = shlex.split(c.command)
    if words[0] == "trainer":
        argv, cwd = [str(BIN / "trainer"), *words[1:]], tmp_path
    else:
        argv, cwd = [sys.executable, *words[1:]], ROOT
    proc = subprocess.run(argv, cwd=cwd, env=run_env(), capture_output=True, text=True, timeout=300)
    printed = (proc.stdout + proc.stderr).splitlines()
    if c.output:  # shown with what it prints
        assert [line.strip() for line in printed if line.strip()] == list(c.output), f"{c}:\n{printed}"
    else:
        assert proc.returncode == 0, f"{c} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert proc.stdout.strip(), c
    for preset in (ROOT / "ds_configs").glob("*.json"):
        assert (tmp_path / "ds_configs" / preset.name).read_text() == preset.read_text(), preset.name


def test_the_console_script_is_the_projects_entry_point():
    """``trainer`` on PATH is the entry point pyproject.toml names, and answers --help."""
    entry = re.search(r'^trainer = "([\w.]+):(\w+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert entry, "pyproject.toml: no trainer console script"
    assert f"from {entry[1]} import {entry[2]}" in (BIN / "trainer").read_text()
    text = help_text((str(BIN / "trainer"),))
    assert all(name in text for name in SUBCOMMANDS), text


def test_marked_commands_say_why():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in path.read_text().splitlines():
            if line.strip().startswith(NOT_RUN):
                assert len(line.strip()) > len(NOT_RUN) + 8, f"{path.name}: {line}"


def written_folder(command: str) -> str | None:
    """The folder a scripts/train.py launch writes: its --output_dir, else its --config recipe's,
    else the embedded default's; None for a form whose recipe is a placeholder."""
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word.startswith("--output_dir"):
            return word.split("=", 1)[1] if "=" in word else words[i + 1]
    if "--config" in words:
        recipe = ROOT / words[words.index("--config") + 1]
        if recipe.is_file():
            found = re.search(r"^output_dir: *(\S+)", recipe.read_text(), re.M)
            if found:
                return found.group(1)
        else:
            return None
    return "output/default"


@pytest.mark.parametrize("doc", sorted({c.doc for c in COMMANDS}))
def test_walking_a_page_in_order_after_make_demo_no_example_lands_in_an_earlier_ones_folder(doc):
    """Every scripts/train.py launch of a page's blocks in order (GPU and multi-node ones too), as a
    newcomer types them after ``make demo``: each writes a folder no earlier one wrote, so none
    resumes another's run (a finished one trains nothing; another objective's is refused), unless it
    says it resumes."""
    written = {"output/default": "make demo"}
    for c in COMMANDS:
        if c.doc != doc or c.inline or "scripts/train.py" not in c.command or "--help" in c.command:
            continue
        folder = written_folder(c.command)
        if folder is None:
            continue
        if "--resume_from_checkpoint" not in c.command:
            assert folder not in written, f"{c} writes {folder}, as {written[folder]} did before it"
        written.setdefault(folder, str(c))
