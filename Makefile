# The README's two commands are `make demo` and `make test`; each installs what it needs first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

# On a CPU box DeepSpeed must be told to use its CPU accelerator; on a GPU box it finds CUDA itself.
ifneq ($(HAS_GPU),1)
export DS_ACCELERATOR ?= cpu
# One thread per rank: two ranks share two cores.
export OMP_NUM_THREADS ?= 1
NUM_GPUS ?= 2
# CPU torch from the local wheel; a GPU box keeps (or pulls) its CUDA build.
TORCH_SPEC ?= torch==2.13.0
else
TORCH_SPEC ?= torch
endif
# A stable place for DeepSpeed's JIT-built ops, so they are compiled once per machine.
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/torch_extensions
# On a CPU box the tests' ops are built without debug info (scripts/cxx_no_debug.sh: a third of their
# build time), in a directory of their own: a build there and one with -g are never rebuilt in turn.
ifneq ($(HAS_GPU),1)
TEST_OPS := CXX=$(CURDIR)/scripts/cxx_no_debug.sh TORCH_EXTENSIONS_DIR=$(TORCH_EXTENSIONS_DIR)/tests
endif

LAUNCH := $(BIN)/deepspeed $(if $(NUM_GPUS),--num_gpus $(NUM_GPUS))
# The demo on a CPU box: one process using every core beats one single-threaded rank per core
# (no gloo all-reduce, no launcher start-up); the cores this process may use, whatever OMP_NUM_THREADS
# the shell has (nproc honours it). A GPU box launches one rank per GPU.
ifneq ($(HAS_GPU),1)
DEMO_LAUNCH ?= OMP_NUM_THREADS=$(shell env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) $(BIN)/python
else
DEMO_LAUNCH ?= $(LAUNCH)
endif

.PHONY: install install-dev demo sft-dpo grpo test test-cpu test-all lint format bench presets clean

# `install`: the project and what a run needs; `install-dev` adds what the tests and lint use (pytest,
# ruff, the optional integrations they exercise: peft, wandb, MLflow, and pytorch_optimizer, the LARS
# the tests follow).
# Both take the versions in .ci/constraints.txt (the ones the suite last passed with); a new release
# of a dependency reaches the venv when that file is refreshed, not on the day it is published.
# `make CONSTRAINTS= install` takes the newest instead.
install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev
CONSTRAINTS ?= .ci/constraints.txt
# A GPU box's venv sees the system's packages, so it keeps the CUDA torch there. A CPU box's venv holds
# only what the project installs: transformers and accelerate import scipy and boto3 whenever they
# are present, about a CPU-second more in every process that imports them.
VENV_FLAGS ?= $(if $(HAS_GPU),--system-site-packages)
PIP_INSTALL = $(BIN)/python -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -d $(VENV) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
# The distribution was called `trainer` before (a name PyPI gives to another project, which also
# installs a `trainer` package): remove that one from an old venv first.
	$(BIN)/python -m pip uninstall -q -y trainer 2>/dev/null || true
	$(PIP_INSTALL) -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP_INSTALL) -e ".[dev]"
	touch $@

demo: install
	$(DEMO_LAUNCH) scripts/train.py

# The offline SFT-then-DPO recipe on the default job's model (docs/sft.md): the stdlib's documented
# functions as instruction rows, then as preference pairs. make demo trains the model first.
sft-dpo: install
	test -d output/default/final || $(MAKE) demo
	$(BIN)/python scripts/recipes/stdlib_tasks.py output/stdlib_tasks
	$(DEMO_LAUNCH) scripts/train.py --config scripts/recipes/sft_stdlib.yaml
	$(DEMO_LAUNCH) scripts/train.py --config scripts/recipes/dpo_stdlib.yaml

# Online RL on the default job's model (docs/rl.md): GRPO on the stdlib's documented functions' def
# lines and docstrings, rewarded for bodies that parse; the share that parse on held-out prompts is
# measured before and after. make demo trains the model first.
grpo: install
	test -d output/default/final || $(MAKE) demo
	$(BIN)/python scripts/recipes/stdlib_tasks.py output/stdlib_tasks
	$(BIN)/python scripts/recipes/parse_share.py output/default/final output/stdlib_tasks/held_prompts.jsonl
	$(DEMO_LAUNCH) scripts/train.py --config scripts/recipes/grpo_stdlib.yaml
	$(BIN)/python scripts/recipes/parse_share.py output/grpo/final output/stdlib_tasks/held_prompts.jsonl

PYTEST := $(BIN)/python -m pytest -q

# The tests share two cores (tests/conftest.py): one worker runs the `distributed` tests (two or more
# ranks each) one at a time, the other the rest, a file at a time and at a lower priority, filling
# the cores a launch leaves idle. DeepSpeed's JIT ops that the tests load (offload's CPU Adam,
# adamw_fused's FusedAdam, and the collective op of HF's Trainer on CPU ranks) build meanwhile, two at
# a time, at the one-process worker's lower priority (the launches come first); a run that needs one
# first waits for its build. The demo needs none of them.
test: install-dev
# Byte-compiled once here, the project's modules load faster in each of the hundreds of processes
# the tests start (where PYTHONDONTWRITEBYTECODE is set, none would write its own).
	$(BIN)/python -m compileall -q -j 2 trainer tests >/dev/null
	$(TEST_OPS) nice -n 10 $(BIN)/python scripts/warm_ops.py & ops=$$!; \
	$(TEST_OPS) $(PYTEST) -m "not slow and not gpu" -n 2 --dist loadgroup tests; rc=$$?; \
	wait $$ops && exit $$rc

# Where the suite's CPU goes: the same run, every Python process logging its own CPU time and test
# at exit (scripts/cpu_account/sitecustomize.py), then the table by program and test module.
test-cpu: install-dev
	mkdir -p output && rm -f output/suite_cpu.jsonl
	SUITE_CPU_LOG=$(CURDIR)/output/suite_cpu.jsonl PYTHONPATH=$(CURDIR)/scripts/cpu_account $(MAKE) test
	$(BIN)/python scripts/suite_cpu.py output/suite_cpu.jsonl

test-all: install-dev
	$(BIN)/python scripts/warm_ops.py
	$(PYTEST)

lint: install-dev
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: install-dev
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: install
	$(BIN)/python scripts/bench.py --device $(if $(HAS_GPU),cuda,cpu)

presets: install
	$(BIN)/trainer ds-config presets

clean:
	rm -rf $(VENV) output .pytest_cache .ruff_cache
