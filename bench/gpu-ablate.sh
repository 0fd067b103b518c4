#!/usr/bin/env bash
# Where a captured (CUDA-graph) decode step's time goes, by ablation: the step is timed with each class
# of kernels left out in turn (MOEFLUX_CUDA_SKIP_KERNELS, name prefixes), alternated with the whole
# step, and the time a class's absence saves is its share: launches, its body and the boundary it
# adds. The per-launch profile (MOEFLUX_CUDA_PROFILE) times each kernel alone, eagerly, and so
# charges every kernel its launch latency. Outputs of an ablated step are wrong: timing only.
# Left-out classes can change what others do (a skipped router leaves its expert addresses
# unwritten, and the expert kernels then skip their slots), so read each row as an upper bound.
#
#   bench/gpu-ablate.sh MODEL_DIR [--q8] [--gen N] [--rounds R] [--classes "a b,c ..."]
#
# Runs on the GPU machine; moeflux from $MOEFLUX (default gpu-stage/moeflux).
set -euo pipefail
MODEL=${1:?usage: bench/gpu-ablate.sh MODEL_DIR [--q8] [--gen N] [--rounds R] [--classes LIST]}
shift
M=${MOEFLUX:-gpu-stage/moeflux}
ACTS=() GEN=128 ROUNDS=2
CLASSES="rms_norm qdot qmv moe_gate_up moe_down moe_route moe_combine conv_qk_norm,delta_rule,gated_norm,deltanet_split attn_,attention argmax"
while [ $# -gt 0 ]; do
  case $1 in
    --q8) ACTS=(--gpu-activations q8) ;;
    --gen) GEN=$2; shift ;;
    --rounds) ROUNDS=$2; shift ;;
    --classes) CLASSES=$2; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ -d "$MODEL" ] || { echo "no model directory $MODEL" >&2; exit 2; }
step_us() {
  MOEFLUX_CUDA_SKIP_KERNELS="$1" "$M" bench --model "$MODEL" --backend cuda --prompt-len 0 --gen "$GEN" \
    --reps 2 --json "${ACTS[@]}" 2>/dev/null |
    python3 -c "import json,sys; print(1e6 / json.load(sys.stdin)['decode_tok_s'])"
}
declare -A SUM
BASE=0
for r in $(seq "$ROUNDS"); do
  BASE=$(python3 -c "print($BASE + $(step_us ''))")
  for c in $CLASSES; do
    SUM[$c]=$(python3 -c "print(${SUM[$c]:-0} + $(step_us "$c"))")
  done
  echo "round $r of $ROUNDS done" >&2
done
python3 - "$BASE" "$ROUNDS" "$GEN" "${ACTS[*]:-f32}" "$CLASSES" "$(for c in $CLASSES; do echo -n "${SUM[$c]} "; done)" <<'PY'
import sys
base, rounds, gen, acts = float(sys.argv[1]) / int(sys.argv[2]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
classes, sums = sys.argv[5].split(), [float(s) / rounds for s in sys.argv[6].split()]
print(f"decode step, tg{gen}, {acts}, mean of {rounds} rounds: {base:.1f} us/token ({1e6 / base:.1f} tok/s)")
print(f"| kernels left out | us/token | saved us/token | share of the step |")
print(f"|---|---:|---:|---:|")
for c, t in zip(classes, sums):
    print(f"| `{c}` | {t:.1f} | {base - t:.1f} | {100 * (base - t) / base:.1f}% |")
PY
