#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, after scripts/gpu/stage.sh
# staged gpu-stage/ here. Writes logs and results under $OUT (or ./gpu-out).
#   bash scripts/gpu/run.sh tests   GPU tests (goldens, GPU vs CPU, snapshots, cache)
#   bash scripts/gpu/run.sh bench   synth models and GPU benchmarks (bench/gpu.sh)
#   bash scripts/gpu/run.sh all     both
# Arguments after the first go to bench/gpu.sh (e.g. `bench --parts a --quick`).
# A stage made elsewhere (MOEFLUX_STAGE=DIR scripts/gpu/stage.sh copies this script and
# bench/gpu.sh into it) runs with its own scripts from any checkout:
#   MOEFLUX_STAGE=$PWD/DIR bash DIR/run.sh all --parts d
set -uo pipefail
what=${1:-all}
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
export MOEFLUX_FIXTURES=$PWD/tests/fixtures
export MOEFLUX_CUDA_CACHE=/tmp/moeflux-cuda
export RUST_BACKTRACE=1
stage=${MOEFLUX_STAGE:-$PWD/gpu-stage}
# The stage's own copy of bench/gpu.sh when it has one (see above).
bench_script=$PWD/bench/gpu.sh
[[ -f $stage/gpu.sh ]] && bench_script=$stage/gpu.sh
chmod +x "$stage"/*
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
rc=0
if [[ $what == tests || $what == all ]]; then
  "$stage/lib-tests" backend::cuda --include-ignored 2>&1 | tee "$out/lib-tests.log" || rc=1
  "$stage/gpu-tests" --ignored --test-threads=1 --nocapture 2>&1 | tee "$out/gpu-tests.log" || rc=1
fi
if [[ $what == bench || $what == all ]]; then
  MOEFLUX=$stage/moeflux bash "$bench_script" "${@:2}" 2>&1 | tee "$out/bench.log" || rc=1
fi
exit $rc
