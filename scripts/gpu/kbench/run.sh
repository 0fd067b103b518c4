#!/usr/bin/env bash
# On the GPU machine: build and run the kernel micro-benchmark.
#   [KBENCH_ONLY=NAME] bash scripts/gpu/kbench/run.sh [extra nvcc flags]
# KBENCH_ONLY runs the sections whose names contain it (e.g. `prefill`); unset, all of them.
set -euo pipefail
cd "$(dirname "$0")"
out=${OUT:-/tmp}
nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo "$@" -o "$out/kbench" kbench.cu
"$out/kbench" "${KBENCH_ONLY:-}"
