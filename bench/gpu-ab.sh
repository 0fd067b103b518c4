#!/usr/bin/env bash
# Builds of moeflux against each other on one GPU, alternated: each build's kernels are compiled
# first (a short warm-up run, outside the timing: a build's first run compiles its kernel source
# with NVRTC, which takes minutes), then R rounds of `moeflux bench` per build in turn, a table of
# tok/s per run and the mean. Compare builds only within one run (cards differ by up to ~8%).
#
#   bench/gpu-ab.sh MODEL_DIR BUILD [BUILD ...] [-- BENCH_ARGS ...]
#
# A BUILD is a moeflux binary, or BINARY:DIR to run it with MOEFLUX_CUDA_KERNEL_DIR=DIR (the
# kernel parts in DIR replace the built-in ones: kernel variants against one binary; an environment
# knob such as MOEFLUX_CUDA_MMA_STAGED=0 is compared through an executable wrapper script,
# `VAR=VALUE exec /path/to/moeflux "$@"`, given as a BINARY). The
# warm-ups run side by side (NVRTC compiles on one core each), on WARM_MODEL if set (a small model
# of the same family, e.g. `moeflux synth --preset ... --layers 2`: the kernels compiled are the
# same, and several large models loaded at once may not fit the card). A build whose warm-up fails
# is left out with its error shown.
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
# Runs build $1 (BINARY or BINARY:KERNEL_DIR) with the remaining arguments.
run_build() {
  local bin=${1%%:*} dir=
  [ "$bin" != "$1" ] && dir=${1#*:}
  shift
  if [ -n "$dir" ]; then MOEFLUX_CUDA_KERNEL_DIR=$dir "$bin" "$@"; else "$bin" "$@"; fi
}
for b in "${BUILDS[@]}"; do
  bin=${b%%:*}
  [ -x "$bin" ] || { echo "$bin is not an executable moeflux build" >&2; exit 2; }
  if [ "$bin" != "$b" ] && [ ! -d "${b#*:}" ]; then echo "${b#*:} is not a directory" >&2; exit 2; fi
done
pids=()
logs=$(mktemp -d)
for i in "${!BUILDS[@]}"; do
  run_build "${BUILDS[$i]}" bench --model "${WARM_MODEL:-$MODEL}" --backend cuda --prompt-len 16 --gen 4 \
    --reps 1 >"$logs/$i" 2>&1 &
  pids+=($!)
done
OK=()
for i in "${!BUILDS[@]}"; do
  if wait "${pids[$i]}"; then
    OK+=("${BUILDS[$i]}")
  else
    echo "${BUILDS[$i]}: warm-up run failed, left out:" >&2
    tail -5 "$logs/$i" >&2
  fi
done
rm -r "$logs"
[ ${#OK[@]} -ge 1 ] || exit 1
BUILDS=("${OK[@]}")
rate() {
  run_build "$1" bench --model "$MODEL" --backend cuda --json "${ARGS[@]}" 2>/dev/null | python3 -c '
import json, sys
r = json.load(sys.stdin)
print(round(r["decode_tok_s"] if r.get("decode_tok_s") else r["prefill_tok_s"], 1))'
}
declare -A RUNS
# Each round starts with the next build, so no build always runs first.
nb=${#BUILDS[@]}
for r in $(seq "$ROUNDS"); do
  for j in $(seq 0 $((nb - 1))); do
    b=${BUILDS[$(((r - 1 + j) % nb))]}
    v=$(rate "$b")
    RUNS[$b]="${RUNS[$b]:-} $v"
    echo "round $r: $b $v tok/s" >&2  # kept if a time limit cuts the run short
  done
  echo "round $r of $ROUNDS done" >&2
done
echo "$MODEL, bench ${ARGS[*]}, $ROUNDS rounds alternated (each round starting one build later)"
echo "| build | tok/s per run | mean |"
echo "|---|---|---:|"
for b in "${BUILDS[@]}"; do
  python3 -c "import sys; v = [float(x) for x in sys.argv[2].split()]; print(f'| {sys.argv[1]} | {\", \".join(map(str, v))} | {sum(v) / len(v):.1f} |')" "$b" "${RUNS[$b]}"
done
