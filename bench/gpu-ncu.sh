#!/usr/bin/env bash
# Each kernel of a decode step alone, under Nsight Compute's hardware counters: its duration, DRAM
# throughput, achieved occupancy and registers, one table row per kernel (the mean over the
# instances captured). ncu serializes the launches, so a row is what the kernel takes alone, not
# its share of a captured step (bench/gpu-ablate.sh measures that); the sum of a layer's rows
# against the step's time per layer shows how much the graph overlaps. Clocks are left alone
# (--clock-control none), as the lent machines ask. The raw report (with the warp stall reasons,
# WarpStateStats) is kept beside the table.
#
#   bench/gpu-ncu.sh MODEL_DIR [--q8] [--kernels REGEX] [--skip N] [--count N] [--out FILE]
#
# Runs on the GPU machine; moeflux from $MOEFLUX (default gpu-stage/moeflux), ncu from the PATH.
# A small model of the family (e.g. `moeflux synth --preset qwen3.6-35b-a3b --layers 4`) has the
# same kernels at the same widths and is quicker to step through.
set -euo pipefail
MODEL=${1:?usage: bench/gpu-ncu.sh MODEL_DIR [--q8] [--kernels REGEX] [--skip N] [--count N] [--out FILE]}
shift
M=${MOEFLUX:-gpu-stage/moeflux}
ACTS=() SKIP=400 COUNT=60 OUTF=ncu-report.txt
KERNELS='^(qdot|qmv|moe_|rms_norm|conv_qk_norm|delta_rule|gated_norm|gdn_|attn_prep|attention|argmax)'
while [ $# -gt 0 ]; do
  case $1 in
    --q8) ACTS=(--gpu-activations q8) ;;
    --kernels) KERNELS=$2; shift ;;
    --skip) SKIP=$2; shift ;;
    --count) COUNT=$2; shift ;;
    --out) OUTF=$2; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ -d "$MODEL" ] || { echo "no model directory $MODEL" >&2; exit 2; }
[ -x "$M" ] || { echo "no moeflux build at $M (set MOEFLUX)" >&2; exit 2; }
command -v ncu >/dev/null || { echo "ncu is not on the PATH" >&2; exit 2; }
# The kernels are compiled once outside the profiler (NVRTC takes minutes under it).
"$M" bench --model "$MODEL" --backend cuda --prompt-len 0 --gen 4 --reps 1 --no-cuda-graphs "${ACTS[@]}" >/dev/null
ncu --clock-control none -k "regex:$KERNELS" --launch-skip "$SKIP" --launch-count "$COUNT" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
  --section WarpStateStats \
  "$M" bench --model "$MODEL" --backend cuda --prompt-len 0 --gen $((SKIP / 8 + COUNT / 4 + 8)) --reps 1 \
  --no-cuda-graphs "${ACTS[@]}" >"$OUTF" 2>&1
python3 "$(dirname "$0")/ncu_table.py" "$OUTF"
