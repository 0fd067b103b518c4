#!/usr/bin/env bash
# moeflux vs llama.cpp, side by side on identical weights (prefill pp512, decode tg128).
#
#   bench/vs-llama-cpp.sh [--model DIR | --preset NAME [--layers N]] [--threads T] [--reps R]
#                         [--warm|--cold] [--repack 0|1] [--pp P] [--tg G] [--json FILE] [--rm-gguf]
#                         [--q8]
#
# The issue-21 CPU target (gpt-oss-120b, 8 layers): bench/vs-llama-cpp.sh --preset gpt-oss-120b
#
# 1. moeflux: target/release/moeflux (built with cargo unless $MOEFLUX names a binary); it must
#    have the `bench` subcommand.
# 2. The model: --model DIR (a moeflux model directory), or the real-width random model that
#    `moeflux synth --preset NAME --layers N` writes into $CACHE/models/ (made once; default
#    qwen3.6-35b-a3b, 8 layers; e.g. gpt-oss-20b, gpt-oss-120b: see `moeflux synth --help`).
# 3. bench/setup.sh: llama.cpp's llama-bench and llama-quantize from the llama-cpp-python 0.3.36
#    sdist, no AMX, cached in $CACHE (default target/bench; about 5 minutes the first time).
# 4. The model as GGUF: Q4_1 by bench/moeflux2gguf.py (a lossless repack of moeflux's 4-bit
#    weights, and MXFP4 experts, gpt-oss's, as ggml MXFP4: identical weights), and Q4_0 by `llama-quantize --allow-requantize` from that Q4_1
#    (llama.cpp's standard Q4_0 recipe: what llama.cpp users run). Cached in $CACHE/gguf/, keyed
#    by the model's moeflux.json and the exporter; --rm-gguf deletes them at the end.
# 5. llama-bench -p P -n G (default 512 / 128) -t T -r R --repack 1 -o json on each GGUF, and
#    `moeflux bench --model DIR --prompt-len 512 --gen 128 --threads T --json --reps R`. Both
#    time pp from an empty context and tg as tokens fed one by one from an empty context, after
#    an untimed warm-up, and report the mean and sample std of the per-repetition tok/s.
# 6. One table (markdown) on stdout; progress and logs on stderr; --json FILE saves everything.
#    Every run goes through bench/run_measured.py, which records how many CPUs other processes
#    kept busy meanwhile; the table warns when that is above 0.1 (a shared machine is noisy).
#
# --q8 runs moeflux a second time with `--cpu-activations q8` (activations rounded to 8 bits, as
# llama.cpp's CPU products take them) and adds its column to the table.
#
# --warm (default) reads the model files once before each engine runs, so both start from the
# page cache; --cold evicts them (posix_fadvise DONTNEED, no root needed) before each run.
# llama.cpp loads all weights before it starts timing, so --cold changes only moeflux's side.
# With --cold, `moeflux bench --cold` also evicts the expert files before each repetition.
#
# Testing without `moeflux bench`: MOEFLUX_BENCH_JSON=FILE uses FILE (one JSON object with
# prefill_tok_s and decode_tok_s) instead of running moeflux; everything else runs for real.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${MOEFLUX_BENCH_CACHE:-$REPO/target/bench}
export MOEFLUX_BENCH_CACHE=$CACHE

THREADS=2
REPS=3
MODE=warm
REPACK=1
MODEL=
PRESET=qwen3.6-35b-a3b
LAYERS=8
JSON_OUT=
RM_GGUF=0
Q8=0
PP=512
TG=128

die() { echo "vs-llama-cpp: error: $*" >&2; exit 1; }
note() { echo "vs-llama-cpp: $*" >&2; }
usage() { sed -n '2,32p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case $1 in
    --model) MODEL=${2:?--model needs a directory}; shift 2 ;;
    --q8) Q8=1; shift ;;
    --preset) PRESET=${2:?--preset needs a name}; shift 2 ;;
    --layers) LAYERS=${2:?--layers needs a number}; shift 2 ;;
    --pp) PP=${2:?--pp needs a number}; shift 2 ;;
    --tg) TG=${2:?--tg needs a number}; shift 2 ;;
    --threads|-t) THREADS=${2:?--threads needs a number}; shift 2 ;;
    --reps|-r) REPS=${2:?--reps needs a number}; shift 2 ;;
    --warm) MODE=warm; shift ;;
    --cold) MODE=cold; shift ;;
    --repack) REPACK=${2:?--repack needs 0 or 1}; shift 2 ;;
    --json) JSON_OUT=${2:?--json needs a file}; shift 2 ;;
    --rm-gguf) RM_GGUF=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ $THREADS =~ ^[1-9][0-9]*$ ]] || die "--threads must be a positive integer"
[[ $REPS =~ ^[1-9][0-9]*$ ]] || die "--reps must be a positive integer"
[[ $REPACK == 0 || $REPACK == 1 ]] || die "--repack must be 0 or 1"
[[ $LAYERS =~ ^[1-9][0-9]*$ ]] || die "--layers must be a positive integer"
[[ $PP =~ ^[0-9]+$ && $TG =~ ^[0-9]+$ ]] || die "--pp and --tg must be non-negative integers"
[[ $PRESET =~ ^[A-Za-z0-9._-]+$ ]] || die "--preset '$PRESET' is not a preset name"

# --- moeflux, and its bench subcommand (checked first: fail before any long step) -----------
FAKE_JSON=${MOEFLUX_BENCH_JSON:-}
if [[ -n ${MOEFLUX:-} ]]; then
  [[ -x $MOEFLUX ]] || die "MOEFLUX=$MOEFLUX is not an executable"
else
  MOEFLUX=$REPO/target/release/moeflux
  note "building moeflux (cargo build --release -p moeflux-cli)"
  (cd "$REPO" && cargo build --release -p moeflux-cli --quiet) || die "cargo build failed"
fi
if [[ -n $FAKE_JSON ]]; then
  [[ -f $FAKE_JSON ]] || die "MOEFLUX_BENCH_JSON=$FAKE_JSON: no such file"
  note "MOEFLUX_BENCH_JSON is set: moeflux's numbers come from $FAKE_JSON, not from a run"
elif ! "$MOEFLUX" bench --help >/dev/null 2>&1; then
  die "'$MOEFLUX bench' is not a known subcommand in this build: the moeflux side of this benchmark
  needs 'moeflux bench --model DIR --prompt-len 512 --gen 128 --threads T --json' (being added).
  To run only llama.cpp's side now, set MOEFLUX_BENCH_JSON to a file holding
  {\"prefill_tok_s\": 0, \"decode_tok_s\": 0}."
fi

# --- the model ---------------------------------------------------------------------------------
if [[ -z $MODEL ]]; then
  MODEL=$CACHE/models/synth-$PRESET-${LAYERS}L
  if [[ ! -f $MODEL/moeflux.json ]]; then
    if ! "$MOEFLUX" synth --help >/dev/null 2>&1; then
      die "no --model given, and '$MOEFLUX synth' is not available in this build (it is coming on
  branch 'synth'); pass --model DIR with a moeflux model directory (e.g. from 'moeflux convert')"
    fi
    note "creating the model: moeflux synth --preset $PRESET --layers $LAYERS $MODEL"
    mkdir -p "$CACHE/models"
    "$MOEFLUX" synth --preset "$PRESET" --layers "$LAYERS" "$MODEL" >&2 || die "moeflux synth failed"
  fi
fi
[[ -f $MODEL/moeflux.json ]] || die "$MODEL is not a moeflux model directory (no moeflux.json)"
MODEL=$(cd "$MODEL" && pwd)

# --- llama.cpp ---------------------------------------------------------------------------------
"$REPO/bench/setup.sh" >/dev/null || die "bench/setup.sh failed"
PY=$CACHE/venv/bin/python
BIN=$CACHE/llama.cpp-build/bin

# --- GGUFs (cached; each written to a temporary name and renamed) ------------------------------
key=$(cat "$MODEL/moeflux.json" "$MODEL/config.json" "$REPO/bench/moeflux2gguf.py" | sha256sum | cut -c1-12)
GGUF_DIR=$CACHE/gguf
mkdir -p "$GGUF_DIR"
Q41=$GGUF_DIR/$(basename "$MODEL")-$key-q4_1.gguf
Q40=$GGUF_DIR/$(basename "$MODEL")-$key-q4_0.gguf
model_bytes=$(du -sb "$MODEL" | cut -f1)
need_space() {  # bytes needed in GGUF_DIR
  local avail
  avail=$(df -B1 --output=avail "$GGUF_DIR" | tail -1)
  ((avail > $1)) || die "not enough disk space in $GGUF_DIR: need about $(($1 / 1000000000 + 1)) GB, have $((avail / 1000000000)) GB"
}
if [[ ! -f $Q41 ]]; then
  # exports of an older version of this model or of the exporter are stale: drop them
  find "$GGUF_DIR" -maxdepth 1 -name "$(basename "$MODEL")-*-q4_[01].gguf" ! -name "$(basename "$Q41")" \
    ! -name "$(basename "$Q40")" -delete
  need_space $((model_bytes * 13 / 10))
  note "exporting $MODEL as GGUF Q4_1 -> $Q41"
  start=$SECONDS
  "$PY" "$REPO/bench/moeflux2gguf.py" "$MODEL" "$Q41" --type q4_1 --quiet >&2 || die "moeflux2gguf failed"
  note "Q4_1 export took $((SECONDS - start)) s"
fi
# gpt-oss's experts are MXFP4 as released, and its MXFP4 GGUF is what llama.cpp users run: a Q4_0
# requantization of it would be lossy and larger, so MXFP4-expert models get no Q4_0 column.
WITH_Q40=1
grep -q '"mode": *"mxfp4"' "$MODEL/moeflux.json" && WITH_Q40=0
if ((WITH_Q40)) && [[ ! -f $Q40 ]]; then
  need_space $((model_bytes * 12 / 10))
  note "requantizing to Q4_0 with llama-quantize -> $Q40"
  start=$SECONDS
  tmp=$Q40.tmp.$$
  trap 'rm -f "$tmp"' EXIT
  "$BIN/llama-quantize" --allow-requantize "$Q41" "$tmp" Q4_0 "$THREADS" >"$CACHE/llama-quantize.log" 2>&1 \
    || die "llama-quantize failed; see $CACHE/llama-quantize.log"
  mv -f "$tmp" "$Q40"
  trap - EXIT
  note "Q4_0 requantization took $((SECONDS - start)) s"
fi

# --- page cache --------------------------------------------------------------------------------
prepare_cache() {  # files...
  if [[ $MODE == cold ]]; then
    "$PY" - "$@" <<'EOF'
import os, sys
for p in sys.argv[1:]:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
EOF
  else
    cat "$@" >/dev/null
  fi
}
mapfile -t model_files < <(find "$MODEL" -type f \( -name '*.safetensors' -o -name '*.bin' -o -name '*.json' \))

# --- runs --------------------------------------------------------------------------------------
RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/vs-llama-cpp.XXXXXX")
cleanup() {
  rm -rf "$RUN_DIR"
  if ((RM_GGUF)); then rm -f "$Q41" "$Q40"; fi
}
trap cleanup EXIT

QUANTS=(q4_1); ((WITH_Q40)) && QUANTS+=(q4_0)
for q in "${QUANTS[@]}"; do
  f=$Q41; [[ $q == q4_0 ]] && f=$Q40
  note "llama-bench $q: -p $PP -n $TG -t $THREADS -r $REPS --repack $REPACK ($MODE)"
  prepare_cache "$f"
  "$PY" "$REPO/bench/run_measured.py" "$RUN_DIR/llama-$q.json" "$RUN_DIR/llama-$q.stats" -- \
    "$BIN/llama-bench" -m "$f" -p "$PP" -n "$TG" -t "$THREADS" -r "$REPS" --repack "$REPACK" -o json \
    2>"$RUN_DIR/llama-$q.log" \
    || { tail -20 "$RUN_DIR/llama-$q.log" >&2; die "llama-bench failed on $f"; }
done

# moeflux bench repeats itself (like llama-bench: an untimed warm-up, then --reps timed runs) and
# drops the expert files from the page cache before each repetition with --cold; both flags are
# used when its --help lists them, else it is run R times.
MOEFLUX_FLAGS=()
MOEFLUX_RUNS=$REPS
if [[ -z $FAKE_JSON ]]; then
  moeflux_help=$("$MOEFLUX" bench --help 2>&1 || true)
  if grep -q -- "--reps" <<<"$moeflux_help"; then
    MOEFLUX_FLAGS+=(--reps "$REPS")
    MOEFLUX_RUNS=1
  fi
  if grep -q -- "--$MODE\b" <<<"$moeflux_help"; then
    MOEFLUX_FLAGS+=("--$MODE")
  fi
fi
# One series of moeflux runs into $RUN_DIR/moeflux$1.jsonl, with the extra flags after $1.
moeflux_runs() {
  local tag=$1; shift
  : >"$RUN_DIR/moeflux$tag.jsonl"
  for ((r = 1; r <= MOEFLUX_RUNS; r++)); do
    if [[ -n $FAKE_JSON ]]; then
      tr -d '\n' <"$FAKE_JSON" >>"$RUN_DIR/moeflux$tag.jsonl"
    else
      note "moeflux bench --prompt-len $PP --gen $TG --threads $THREADS ${MOEFLUX_FLAGS[*]} $* ($MODE, run $r/$MOEFLUX_RUNS)"
      prepare_cache "${model_files[@]}"
      "$PY" "$REPO/bench/run_measured.py" "$RUN_DIR/moeflux$tag-$r.json" "$RUN_DIR/moeflux$tag-$r.stats" -- \
        "$MOEFLUX" bench --model "$MODEL" --prompt-len "$PP" --gen "$TG" --threads "$THREADS" --json \
        "${MOEFLUX_FLAGS[@]}" "$@" 2>"$RUN_DIR/moeflux$tag-$r.log" \
        || { tail -20 "$RUN_DIR/moeflux$tag-$r.log" >&2; die "moeflux bench failed"; }
      tr -d '\n' <"$RUN_DIR/moeflux$tag-$r.json" >>"$RUN_DIR/moeflux$tag.jsonl"
    fi
    echo >>"$RUN_DIR/moeflux$tag.jsonl"
  done
}
moeflux_runs ""
Q8_RESULTS=()
if ((Q8)); then
  moeflux_runs -q8 --cpu-activations q8
  Q8_RESULTS=(--moeflux-q8 "$RUN_DIR/moeflux-q8.jsonl")
fi

LLAMA_RESULTS=()
for q in "${QUANTS[@]}"; do LLAMA_RESULTS+=("--llama-$q" "$RUN_DIR/llama-$q.json"); done
"$PY" "$REPO/bench/bench_table.py" --model "$MODEL" --threads "$THREADS" --reps "$REPS" --mode "$MODE" \
  --repack "$REPACK" --pp "$PP" --tg "$TG" --moeflux "$RUN_DIR/moeflux.jsonl" "${Q8_RESULTS[@]}" \
  "${LLAMA_RESULTS[@]}" --stats-dir "$RUN_DIR" \
  ${FAKE_JSON:+--fake-moeflux} ${JSON_OUT:+--json "$JSON_OUT"}
