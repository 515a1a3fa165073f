#!/usr/bin/env bash
# The C++ compiler `make test` gives DeepSpeed's JIT ops on a CPU box: c++ (or $TEST_CXX) without
# DeepSpeed's -g. Debug info is a third of each op's build time there, and -g never changes the code
# the compiler emits, so the ops compute what a build with it computes.
args=()
for arg in "$@"; do
    [[ $arg == -g ]] || args+=("$arg")
done
exec "${TEST_CXX:-c++}" "${args[@]}"
