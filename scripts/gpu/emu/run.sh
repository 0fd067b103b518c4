#!/usr/bin/env bash
# Runs moeflux's CUDA kernels (crates/moeflux/src/backend/cuda/kernels/) on the CPU
# under a small CUDA emulation (cuda_emu.h: a fiber per CUDA thread, blocks one after
# another, barriers for __syncthreads, __syncwarp and warp shuffles) against naive
# double-precision references (emu_check.h), so their indexing and logic can be checked
# without a GPU:
#   mla_kernels.cpp   MLA (mla_prep, mla_attention, the per-head products), the routers
#                     (moe_route_noaux, moe_route_c*), the grouping by expert (moe_group), the one-token grouped products
#                     (qmv_b4, qmv_b4_nc2, their SwiGLU-input _glu variants, and
#                     qmv_b48/_nc2 over 4- and 8-bit matrices in one launch), the few-token
#                     products (qmv_b4_t4, qmv_b8_t4) equal to the one-token ones per token,
#                     argmax_parts + argmax_merge (greedy picks on the device); with 8-bit activations
#                     (qmv_b4q8*, qmv_b48q8*, qmv_b4q8_t4, qdot_b4q8/_glu/_t4) against the CPU's q8
#                     contract, the few-token ones equal the one-token ones per token
#   qwen_kernels.cpp  GatedDeltaNet (conv_qk_norm, delta_rule, gated_norm), moe_combine,
#                     moe_combine_norm (equal to moe_combine + rms_norm bit for bit),
#                     attn_prep; decode batches (the sequence table of conv_qk_norm,
#                     delta_rule, attn_prep and attention) equal to each sequence alone
#   mma_kernels.cpp   the tensor-core kernels (mma_split, qmma, moe_gate_up_mma,
#                     moe_down_mma, attn_kv_split, attention_mma; on 8-bit activations q8_rows,
#                     qmma_q8*, moe_*_mma_q8* against the CPU's q8 contract, 2 and 4 row tiles, and
#                     staged in shared memory, qmma_q8s and moe_*_mma_q8s, also against those)
#                     through an emulated mma.sync; gpt-oss's experts (MXFP4 and affine,
#                     per-expert biases, the clamped SwiGLU) through the grouped, per-slot
#                     (one-pass, streamed and MXFP4 by whole rows, MXFP4 dotted in
#                     integers; by rows equal to streamed bit for bit; Qwen's per-slot
#                     kernels with 8-bit activations, moe_*_qmv_b4q8, moe_*_stream_b4q8 and moe_*_qdot*; the
#                     gate/up ones that route their tokens, moe_gate_up_qdot*_route_c*, equal to moe_route_c*
#                     and moe_gate_up_qdot* bit for bit) and tensor-core
#                     paths, MXFP4 scale extremes; GGUF's K-quants (groups of 16 at 2, 3,
#                     6 and 8 bits through the general products and the embedding lookup,
#                     experts whose down projection differs from gate/up)
#   deltanet_kernels.cpp  the chunked delta rule of a prefill (gdn_chunk_prep,
#                     gdn_chunk_scan) against the recurrence and against delta_rule
# Each program ends with "all ok"; the script fails if any fails. Needs g++ with
# C++20; takes a minute or two on two cores (deltanet_kernels, where delta_rule's warp
# reductions are slow to emulate, most of it).
#   [MOEFLUX_CUDA_KERNEL_DIR=DIR] scripts/gpu/emu/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$here/../../../crates/moeflux/src/backend/cuda/kernels
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The parts in all.cuh's order, as NVRTC gets them; dynamic shared memory
# becomes one host buffer.
# With MOEFLUX_CUDA_KERNEL_DIR set, a part that directory holds replaces the built-in one (a
# kernel variant, as the engine compiles it).
parts=$(sed -nE 's/^#include "(.+)"$/\1/p' "$src/all.cuh")
variant=${MOEFLUX_CUDA_KERNEL_DIR:+$(cd "$MOEFLUX_CUDA_KERNEL_DIR" && pwd)}
for p in $parts; do
  if [ -n "$variant" ] && [ -f "$variant/$p" ]; then cat "$variant/$p"; else cat "$src/$p"; fi
done |
  sed -E 's/extern __shared__ float (\w+)\[\];/float* \1 = g_dyn_smem.data();/' >"$tmp/kernels.inc"
progs=(mla_kernels qwen_kernels mma_kernels deltanet_kernels)
# Two at a time (CI has two cores), each program's output kept apart and
# printed in order.
printf '%s\n' "${progs[@]}" | xargs -P 2 -I{} \
  g++ -std=c++20 -O1 -w -I"$here" -DKERNELS_SOURCE="\"$tmp/kernels.inc\"" "$here/{}.cpp" -o "$tmp/{}"
printf '%s\n' "${progs[@]}" | xargs -P 2 -I{} sh -c '"$1/$2" >"$1/$2.log" 2>&1; echo $? >"$1/$2.rc"' _ "$tmp" {}
status=0
for t in "${progs[@]}"; do
  echo "== $t"
  cat "$tmp/$t.log"
  [[ $(cat "$tmp/$t.rc") == 0 ]] || { echo "$t failed"; status=1; }
done
exit $status
