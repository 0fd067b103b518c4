#!/usr/bin/env bash
# Runs the MLA, router and one-token product kernels (crates/moeflux/src/backend/cuda/{kernels,mla}.cu) on the
# CPU under a small CUDA emulation (cuda_emu.h: a thread per CUDA thread, barriers for
# __syncthreads, __syncwarp and warp shuffles) against naive references, so their indexing
# and logic can be checked without a GPU. Needs g++ with C++20; takes ~1 minute.
#   scripts/gpu/emu/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$here/../../../crates/moeflux/src/backend/cuda
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Dynamic shared memory becomes one host buffer.
cat "$src/kernels.cu" "$src/mla.cu" |
  sed -E 's/extern __shared__ float (\w+)\[\];/float* \1 = g_dyn_smem.data();/' >"$tmp/kernels.inc"
g++ -std=c++20 -O1 -pthread -w -I"$here" -DKERNELS_SOURCE="\"$tmp/kernels.inc\"" \
  "$here/mla_kernels.cpp" -o "$tmp/mla_kernels"
"$tmp/mla_kernels"
