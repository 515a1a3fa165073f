#!/usr/bin/env bash
# The GPU checks in one command, within 10 minutes:
#   1. the GPU-only tests (pytest -m gpu),
#   2. the --device cuda benchmark: the 1.1B Llama in bf16 on ZeRO-2 with all four systems (plus a
#      profile of ours), ZeRO-2 with activation checkpointing, and ZeRO-3 (ours and the raw loop),
#   3. the long-context search (scripts/bench_long_context.py): the longest sequence a ~1B Llama
#      trains on within the GPU's memory, ours without and with tiling, and HF Trainer,
#   4. with two GPUs or more, expert parallelism against ZeRO-3 alone (scripts/bench_moe.py).
# Everything goes under RESULTS_DIR: logs, JSON, profiles, and summary.txt with each phase's status.
#
#   scripts/gpu_check.sh RESULTS_DIR
#
# Python: $PYTHON, else .venv/bin/python, else python3. When deepspeed is not importable and a wheel
# folder exists ($WHEELS, .whl/, shared/device-wheels/ or ../shared/device-wheels/), the wheels are
# installed into .site/ (no index, no dependencies) and put on PYTHONPATH.
# Exits non-zero if any phase failed or was skipped for lack of time.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: scripts/gpu_check.sh RESULTS_DIR" >&2
    exit 2
fi
mkdir -p "$1"
out=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
repo=$(pwd)

BUDGET_S=${GPU_CHECK_BUDGET_S:-590}  # the whole script; each phase gets what is left, at most its own cap
status=0
summary="$out/summary.txt"
: >"$summary"

note() { echo "$*" | tee -a "$summary"; }

if [[ -n "${PYTHON:-}" ]]; then
    py=$PYTHON
elif [[ -x .venv/bin/python ]]; then
    py=.venv/bin/python
else
    py=python3
fi

if ! "$py" -c "import deepspeed" >/dev/null 2>&1; then
    for dir in "${WHEELS:-}" .whl shared/device-wheels ../shared/device-wheels; do
        if [[ -n "$dir" ]] && compgen -G "$dir/*.whl" >/dev/null; then
            "$py" -m pip install -q --no-index --no-deps --target .site "$dir"/*.whl >"$out/wheels.log" 2>&1
            export PYTHONPATH="$repo/.site:$repo${PYTHONPATH:+:$PYTHONPATH}"
            note "installed the wheels of $dir into .site/"
            break
        fi
    done
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$py" - <<'EOF' || true
import importlib
for name in ("torch", "deepspeed", "transformers", "accelerate", "datasets", "pydantic", "pytest", "peft", "bitsandbytes"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as err:  # noqa: BLE001 - a report of what is missing
        print(name, "MISSING:", type(err).__name__, err)
import torch
print("cuda", torch.version.cuda, "devices", torch.cuda.device_count())
EOF
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

# phase NAME CAP_S COMMAND...: run with the time left (at most CAP_S), log to NAME.log, record status.
phase() {
    local name=$1 cap=$2
    shift 2
    local left=$((BUDGET_S - SECONDS))
    local limit=$((left < cap ? left : cap))
    if ((limit < 45)); then
        note "$name: SKIPPED (only ${left}s left of ${BUDGET_S}s)"
        status=1
        return 0
    fi
    local start=$SECONDS rc=0
    timeout --signal=TERM --kill-after=30 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
    if ((rc == 0)); then
        note "$name: ok ($((SECONDS - start))s)"
    else
        note "$name: FAILED with exit code $rc after $((SECONDS - start))s (limit ${limit}s; see $name.log)"
        tail -n 20 "$out/$name.log" >&2 || true
        status=1
    fi
}

# bench NAME CAP_S ARGS...: one scripts/bench.py run; its work folder is work-NAME, its report NAME.txt.
bench() {
    local name=$1 cap=$2
    shift 2
    rm -f "$out/work-$name/report.txt"
    phase "$name" "$cap" "$py" scripts/bench.py --device cuda --step_timeout 240 --start_timeout 180 \
        --out "$out/work-$name" --json "$out/$name.json" "$@"
    if [[ -f "$out/work-$name/report.txt" ]]; then
        cp "$out/work-$name/report.txt" "$out/$name.txt"
        cat "$out/$name.txt"
    fi
    rm -f "$out/work-$name/data.pt"  # the token blocks; the logs and configs stay
}

# Only the files that hold GPU tests: collecting the others could fail on a missing dev dependency.
mapfile -t gpu_tests < <(grep -rlE "mark\.gpu\b" tests --include="test_*.py" || true)
if ! "$py" -c "import pytest" >/dev/null 2>&1; then
    note "pytest-gpu: SKIPPED (pytest is not installed for $py)"
    status=1
elif ((${#gpu_tests[@]} == 0)); then
    note "pytest-gpu: no tests are marked gpu"
else
    phase pytest-gpu 150 "$py" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$out/pytest-gpu.xml" "${gpu_tests[@]}"
fi

bench bench-z2 220 --zero_stage 2 --profile "$out/profile-z2"
bench bench-z2-ckpt 120 --zero_stage 2 --gradient_checkpointing --systems ours,deepspeed
bench bench-z3 130 --zero_stage 3 --systems ours,deepspeed
# Long context: 1-process setups on one GPU (the SP ones need two). --budget_s stops starting probes
# in time for the phase's cap; the report then covers the probes that ran.
phase long-context 240 "$py" scripts/bench_long_context.py --device cuda --setups ours,ours_sp_tiled,hf \
    --start 16384 --granularity 16384 --max_len 131072 --budget_s 200 --probe_timeout 150 \
    --out "$out/work-long-context" --json "$out/long-context.json"
if [[ -f "$out/work-long-context/report.md" ]]; then
    cp "$out/work-long-context/report.md" "$out/long-context.txt"
    cat "$out/long-context.txt"
fi
rm -rf "$out/work-long-context/data/cache"  # the tokenised corpus; logs, metrics and configs stay
# Expert parallelism against ZeRO-3 alone (scripts/bench_moe.py): one rank a GPU, so two GPUs at least.
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if ((gpus >= 2)); then
    phase bench-moe 150 "$py" scripts/bench_moe.py --max_steps 40 --out "$out/work-moe" --json "$out/bench-moe.json"
else
    note "bench-moe: not run (expert parallelism puts one rank on each of 2 GPUs; this machine has $gpus)"
fi
note "total: ${SECONDS}s; results in $out"
exit $status
