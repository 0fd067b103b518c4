#!/usr/bin/env bash
# Builds of moeflux against each other on one GPU, alternated: each build's kernels are compiled
# first (a short warm-up run, outside the timing: a build's first run compiles its kernel source
# with NVRTC, which takes minutes), then R rounds of `moeflux bench` per build in turn, a table of
# tok/s per run and the mean. Compare builds only within one run (cards differ by up to ~8%).
#
#   bench/gpu-ab.sh MODEL_DIR BUILD [BUILD ...] [-- BENCH_ARGS ...]
#
# BENCH_ARGS default to a decode step: --prompt-len 0 --gen 128 --reps 2 (add e.g.
# --gpu-activations q8); with --prompt-len P --gen 0 the prefill rate is compared instead.
set -euo pipefail
MODEL=${1:?usage: bench/gpu-ab.sh MODEL_DIR BUILD [BUILD ...] [-- BENCH_ARGS ...]}
shift
BUILDS=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do BUILDS+=("$1"); shift; done
[ $# -gt 0 ] && shift
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(--prompt-len 0 --gen 128 --reps 2)
ROUNDS=${ROUNDS:-3}
[ ${#BUILDS[@]} -ge 1 ] || { echo "no build given" >&2; exit 2; }
[ -d "$MODEL" ] || { echo "no model directory $MODEL" >&2; exit 2; }
for b in "${BUILDS[@]}"; do
  [ -x "$b" ] || { echo "$b is not an executable moeflux build" >&2; exit 2; }
  "$b" bench --model "$MODEL" --backend cuda --prompt-len 16 --gen 4 --reps 1 >/dev/null 2>&1 ||
    { echo "$b: warm-up run failed" >&2; exit 1; }
done
rate() {
  "$1" bench --model "$MODEL" --backend cuda --json "${ARGS[@]}" 2>/dev/null | python3 -c '
import json, sys
r = json.load(sys.stdin)
print(round(r["decode_tok_s"] if r.get("decode_tok_s") else r["prefill_tok_s"], 1))'
}
declare -A RUNS
for r in $(seq "$ROUNDS"); do
  for b in "${BUILDS[@]}"; do RUNS[$b]="${RUNS[$b]:-} $(rate "$b")"; done
  echo "round $r of $ROUNDS done" >&2
done
echo "$MODEL, bench ${ARGS[*]}, $ROUNDS rounds alternated"
echo "| build | tok/s per run | mean |"
echo "|---|---|---:|"
for b in "${BUILDS[@]}"; do
  python3 -c "import sys; v = [float(x) for x in sys.argv[2].split()]; print(f'| {sys.argv[1]} | {\", \".join(map(str, v))} | {sum(v) / len(v):.1f} |')" "$b" "${RUNS[$b]}"
done
