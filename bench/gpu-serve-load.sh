#!/usr/bin/env bash
# Serving under load on one NVIDIA GPU: `moeflux serve --parallel N` against llama.cpp's CUDA
# `llama-server -np N` on the same weights (bench/serve-load.py at every N of --streams).
# Runs ON the GPU machine, from the repository root, after scripts/gpu/stage.sh and
# scripts/gpu/stage-llama.sh staged gpu-stage/ (carry ["gpu-stage"]); MOEFLUX names the moeflux
# binary (default gpu-stage/moeflux, else target/release/moeflux).
#
#   bash bench/gpu-serve-load.sh [options]
#
# Parts (--parts, in this order; each skips what an earlier call on the same machine already did,
# so a warm machine can run them in separate calls of the device tool):
#   build     llama-server with CUDA: bench/gpu-llama.sh --server --build-only, in DIR/llama
#             (skipped when that build is current); runs in the background during synth
#   synth     the qwen3.6-35b-a3b synth model, all 40 layers (as bench/gpu.sh part a), in DIR/a3b
#             (skipped when its stamp matches), and its GGUF Q4_1 export (bench/gpu-llama.sh
#             --export-only: cached in DIR/llama/gguf under a key of the model's files)
#   resident  moeflux `--backend cuda` (every expert in VRAM); llama-server `-ngl 99 -fa on`
#   host      moeflux `--backend cuda --gpu-memory B --host-cache 100G`, B = 25% of the expert
#             bytes (as bench/gpu.sh part b); llama-server `-ngl 99 --n-cpu-moe 30 -fa on` (the
#             experts of 30 of the 40 layers on the CPU: 25% of them on the GPU)
# Both servers use every core for their CPU threads (serve-load.py --threads: moeflux --threads,
# llama-server -t/-tb), a context of prompt + gen + 64 tokens per sequence (moeflux --ctx;
# llama-server -c N*(prompt+gen+64)), fresh prompts and no prompt caches (serve-load.py).
# Each config's table goes to stdout and OUT/serve-load-CONFIG.md, everything raw to
# OUT/serve-load-CONFIG.json (rewritten after every run, so a call cut short keeps what it
# measured). A finished config is kept in DIR/results under a key of its settings and shown
# again (not rerun) by a later call with the same settings; --force reruns it.
#
# options:
#   --parts LIST              build,synth,resident,host (default: all four)
#   --configs LIST            of the benchmark parts, run only these (default resident,host)
#   --streams LIST            concurrencies N (default 1,2,4,8,16)
#   --gen G                   generated tokens per request (default 64)
#   --prompt-len P            prompt tokens per request (default 128)
#   --requests-per-stream R   sequential requests per client (default 2)
#   --threads T               CPU threads of each server (default: nproc)
#   --time-cap S              seconds one config may take; then serve-load.py is stopped, and
#                             its table and JSON hold the runs done so far (default 510; 0: none)
#   --gpu-share PCT           host config: the share of the expert bytes in VRAM (default 25);
#                             llama-server's --n-cpu-moe is the rest of the layers
#   --host-cache SIZE         host config: moeflux --host-cache (default 100G)
#   --layers L                synth only the first L layers (default: all 40)
#   --router-skew SPEC        synth with this router skew (moeflux synth --router-skew, e.g.
#                             zipf:1: experts of unequal popularity, as real routers pick them;
#                             default: uniform), into DIR/a3b-SPEC
#   --dir DIR                 work directory, reused across calls (default /tmp/moeflux-serve-load)
#   --out DIR                 results (default $OUT, else ./gpu-out)
#   --stage DIR               staged llama.cpp (default gpu-stage/llama)
#   --model DIR               serve this moeflux model instead of synthesizing one (no synth)
#   --gguf FILE               llama-server's model instead of the export of the model
#   --llama-server PATH       this llama-server instead of building one (part build skipped)
#   --no-llama                moeflux only (no build, no export)
#   --moeflux-arg ARG         one more moeflux serve argument, every config (repeatable)
#   --llama-arg ARG           one more llama-server argument, every config (repeatable)
#   --cpu-only                no GPU: moeflux --backend cpu (the host config's GPU flags are
#                             passed and ignored) and llama-server without -ngl; to try the
#                             plumbing on a machine without one (e.g. with --layers 4, which
#                             llama.cpp needs at least: a 2-layer synth has no attention layer,
#                             and --llama-server PATH of a CPU build)
#   --force                   redo every part asked for (synth, export and runs), stamps or not
# Environment: MOEFLUX, PYTHON (default python3), and bench/gpu-llama.sh's (NVCC, CUDA_ARCH, ...).
# Exit status: 0 when every part asked for finished, 2 when a config hit --time-cap, 1 on errors.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
NPROC=$(nproc)

PARTS=build,synth,resident,host
CONFIGS=resident,host
STREAMS=1,2,4,8,16
GEN=64
PROMPT=128
RPS=2
THREADS=$NPROC
CAP=510
SHARE=25
HOST_CACHE=100G
LAYERS=
SKEW=
DIR=/tmp/moeflux-serve-load
OUTDIR=${OUT:-$PWD/gpu-out}
STAGE=$REPO/gpu-stage/llama
MODEL=
GGUF=
LLAMA_SERVER=
NO_LLAMA=0
CPU_ONLY=0
FORCE=0
M_EXTRA=()
L_EXTRA=()

die() { echo "gpu-serve-load: error: $*" >&2; exit 1; }
note() { echo "gpu-serve-load: $*" >&2; }
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; }
posint() { [[ $2 =~ ^[1-9][0-9]*$ ]] || die "$1 needs a positive integer, not '$2'"; }

while [[ $# -gt 0 ]]; do
  case $1 in
    --parts) PARTS=${2:?--parts needs a list}; shift 2 ;;
    --configs) CONFIGS=${2:?--configs needs a list}; shift 2 ;;
    --streams) STREAMS=${2:?--streams needs a list}; shift 2 ;;
    --gen) GEN=${2:?}; posint --gen "$GEN"; shift 2 ;;
    --prompt-len) PROMPT=${2:?}; posint --prompt-len "$PROMPT"; shift 2 ;;
    --requests-per-stream) RPS=${2:?}; posint --requests-per-stream "$RPS"; shift 2 ;;
    --threads) THREADS=${2:?}; posint --threads "$THREADS"; shift 2 ;;
    --time-cap) CAP=${2:?}; [[ $CAP =~ ^[0-9]+$ ]] || die "--time-cap needs seconds, not '$CAP'"; shift 2 ;;
    --gpu-share) SHARE=${2:?}; posint --gpu-share "$SHARE"; ((SHARE <= 100)) || die "--gpu-share is a percentage (1-100)"; shift 2 ;;
    --host-cache) HOST_CACHE=${2:?}; shift 2 ;;
    --layers) LAYERS=${2:?}; posint --layers "$LAYERS"; shift 2 ;;
    --router-skew) SKEW=${2:?--router-skew needs a spec}; [[ $SKEW =~ ^[a-z]+:[0-9.]+$ ]] || die "--router-skew: '$SKEW' is not KIND:EXPONENT (e.g. zipf:1)"; shift 2 ;;
    --dir) DIR=${2:?}; shift 2 ;;
    --out) OUTDIR=${2:?}; shift 2 ;;
    --stage) STAGE=${2:?}; shift 2 ;;
    --model) MODEL=${2:?}; shift 2 ;;
    --gguf) GGUF=${2:?}; shift 2 ;;
    --llama-server) LLAMA_SERVER=${2:?}; shift 2 ;;
    --no-llama) NO_LLAMA=1; shift ;;
    --moeflux-arg) M_EXTRA+=("${2?--moeflux-arg needs an argument}"); shift 2 ;;
    --llama-arg) L_EXTRA+=("${2?--llama-arg needs an argument}"); shift 2 ;;
    --cpu-only) CPU_ONLY=1; shift ;;
    --force) FORCE=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
for p in ${PARTS//,/ }; do
  [[ $p == build || $p == synth || $p == resident || $p == host ]] || die "--parts: unknown part '$p' (build, synth, resident, host)"
done
for c in ${CONFIGS//,/ }; do
  [[ $c == resident || $c == host ]] || die "--configs: unknown config '$c' (resident, host)"
done
[[ $STREAMS =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || die "--streams needs comma-separated positive integers, not '$STREAMS'"
has_part() { [[ ,$PARTS, == *,$1,* ]]; }
has_config() { has_part "$1" && [[ ,$CONFIGS, == *,$1,* ]]; }

if [[ -z ${MOEFLUX:-} ]]; then
  MOEFLUX=$REPO/target/release/moeflux
  [[ -f $REPO/gpu-stage/moeflux ]] && MOEFLUX=$REPO/gpu-stage/moeflux
fi
# the device tool carries files without their modes
[[ -f $MOEFLUX && ! -x $MOEFLUX ]] && chmod +x "$MOEFLUX"
[[ -x $MOEFLUX ]] || die "MOEFLUX=$MOEFLUX is not an executable (scripts/gpu/stage.sh, or cargo build --release)"
MOEFLUX=$(cd "$(dirname "$MOEFLUX")" && pwd)/$(basename "$MOEFLUX")
[[ -z $MODEL || -f $MODEL/moeflux.json ]] || die "--model $MODEL: not a moeflux model directory (no moeflux.json)"
[[ -z $GGUF || -f $GGUF ]] || die "--gguf $GGUF: no such file"
[[ -z $LLAMA_SERVER || -x $LLAMA_SERVER ]] || die "--llama-server $LLAMA_SERVER: not an executable"
command -v "$PY" >/dev/null || die "$PY not found"
mkdir -p "$DIR/stamps" "$DIR/results" "$OUTDIR"
DIR=$(cd "$DIR" && pwd)
OUTDIR=$(cd "$OUTDIR" && pwd)
# compiled CUDA kernels: once per machine, not once per server start
export MOEFLUX_CUDA_CACHE=${MOEFLUX_CUDA_CACHE:-$DIR/cuda-cache}

GPU_NAME=none
if ((!CPU_ONLY)); then
  command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver here (--cpu-only to try the script without a GPU)"
  GPU_NAME=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1) \
    || die "nvidia-smi sees no GPU"
  echo "$GPU_NAME" >"$OUTDIR/gpu.txt"
  note "GPU: $GPU_NAME"
fi

GL=(bash "$REPO/bench/gpu-llama.sh" --work "$DIR/llama" --stage "$STAGE" --out "$OUTDIR/llama")
((CPU_ONLY)) && GL+=(--cpu-only)
RC=0

# --- build: llama-server, in the background while the model is made --------------------------
# (the build is compiler-bound on every core, the synth and export mostly single-threaded and
# disk-bound: side by side they take little more than the build alone)
BUILD_PID=
BUILD_START=$SECONDS
stop_build() {
  if [[ -n $BUILD_PID ]] && kill -0 "$BUILD_PID" 2>/dev/null; then
    # its own process group (setsid): cmake, ninja and the compilers go with it
    kill -- -"$BUILD_PID" 2>/dev/null || kill "$BUILD_PID" 2>/dev/null || true
  fi
}
trap stop_build EXIT
if ((!NO_LLAMA)) && [[ -z $LLAMA_SERVER ]]; then
  if has_part build; then
    note "build: bench/gpu-llama.sh --server --build-only, in the background (log: $OUTDIR/llama-build-driver.log)"
    setsid=()
    command -v setsid >/dev/null && setsid=(setsid)
    "${setsid[@]}" "${GL[@]}" --server --build-only >"$DIR/llama-server.path" 2>"$OUTDIR/llama-build-driver.log" &
    BUILD_PID=$!
  elif [[ -x $DIR/llama/build/bin/llama-server ]]; then
    LLAMA_SERVER=$DIR/llama/build/bin/llama-server
  fi
fi

# --- synth: the model and its GGUF ---------------------------------------------------------------
SYNTH_ARGS=(--preset qwen3.6-35b-a3b)
[[ -n $LAYERS ]] && SYNTH_ARGS+=(--layers "$LAYERS")
[[ -n $SKEW ]] && SYNTH_ARGS+=(--router-skew "$SKEW")
if [[ -z $MODEL ]]; then
  MODEL=$DIR/a3b${LAYERS:+-$LAYERS}${SKEW:+-${SKEW/:/}}
  stamp=$DIR/stamps/synth-$(basename "$MODEL")
  want="$("$MOEFLUX" --version 2>/dev/null || echo '?') synth ${SYNTH_ARGS[*]}"
  # (--force redoes the synth only when the synth part is asked for)
  if [[ -f $stamp && "$(cat "$stamp")" == "$want" && -f $MODEL/moeflux.json ]] && { ((!FORCE)) || ! has_part synth; }; then
    note "synth: $MODEL is there (stamp $stamp)"
  elif has_part synth; then
    rm -f "$stamp"
    rm -rf "$MODEL" # a synth cut short leaves a partial directory
    # the exports of an earlier model of this name: stale (their key has the files' mtimes)
    [[ -d $DIR/llama/gguf ]] && find "$DIR/llama/gguf" -maxdepth 1 -name "$(basename "$MODEL")-*-q4_1.gguf" -delete
    # the model (19.5 GB at 40 layers) and its GGUF (about 1.1x) side by side
    need=$((45 * 1000 ** 3))
    [[ -n $LAYERS ]] && need=$((45 * 1000 ** 3 * LAYERS / 40))
    avail=$(df -B1 --output=avail "$DIR" | tail -1)
    ((avail > need)) || die "not enough disk space in $DIR for the model and its GGUF: need about $((need / 1000 ** 3)) GB, have $((avail / 1000 ** 3)) GB (--dir elsewhere)"
    note "synth: moeflux synth ${SYNTH_ARGS[*]} $MODEL"
    start=$SECONDS
    "$MOEFLUX" synth "${SYNTH_ARGS[@]}" "$MODEL" >"$OUTDIR/synth.log" 2>&1 \
      || { tail -20 "$OUTDIR/synth.log" >&2; die "moeflux synth failed; see $OUTDIR/synth.log"; }
    echo "$want" >"$stamp"
    note "synth took $((SECONDS - start)) s ($(du -sh "$MODEL" | cut -f1))"
  elif has_config resident || has_config host; then
    die "no model: run the synth part first (--parts synth), or pass --model DIR"
  fi
fi
[[ -d $MODEL ]] && MODEL=$(cd "$MODEL" && pwd)

if ((!NO_LLAMA)) && [[ -z $GGUF ]]; then
  gstamp=$DIR/stamps/gguf-$(basename "$MODEL")
  if has_part synth; then
    # an export cut short leaves its temporary directory (as large as the GGUF) behind
    [[ -d $DIR/llama/gguf ]] && find "$DIR/llama/gguf" -maxdepth 1 -name '.*.tmp.*' -exec rm -rf {} +
    ((FORCE)) && [[ -d $DIR/llama/gguf ]] && find "$DIR/llama/gguf" -maxdepth 1 -name "$(basename "$MODEL")-*-q4_1.gguf" -delete
    start=$SECONDS
    # (--export-only builds nothing: it runs beside the build)
    GGUF=$("${GL[@]}" --export-only "$MODEL" | tail -1) || die "exporting the GGUF failed (see above)"
    [[ -f $GGUF ]] || die "bench/gpu-llama.sh --export-only printed '$GGUF', which is no file"
    echo "$GGUF" >"$gstamp"
    note "GGUF: $GGUF ($((SECONDS - start)) s)"
  elif [[ -f $gstamp && -f "$(cat "$gstamp")" ]]; then
    GGUF=$(cat "$gstamp")
  elif has_config resident || has_config host; then
    die "no GGUF of $MODEL: run the synth part first (--parts synth), or pass --gguf FILE or --no-llama"
  fi
fi

if [[ -n $BUILD_PID ]]; then
  kill -0 "$BUILD_PID" 2>/dev/null && note "waiting for the llama-server build"
  rc=0
  wait "$BUILD_PID" || rc=$?
  BUILD_PID=
  grep '^gpu-llama:' "$OUTDIR/llama-build-driver.log" >&2 || true
  ((rc == 0)) || { tail -30 "$OUTDIR/llama-build-driver.log" >&2; die "building llama-server failed (status $rc); see $OUTDIR/llama-build-driver.log and $OUTDIR/llama/"; }
  LLAMA_SERVER=$(tail -1 "$DIR/llama-server.path")
  [[ -x $LLAMA_SERVER ]] || die "bench/gpu-llama.sh --build-only printed '$LLAMA_SERVER', which is not an executable"
  note "build: $LLAMA_SERVER (done $((SECONDS - BUILD_START)) s after it started)"
fi

# --- resident, host: serve-load.py ---------------------------------------------------------------
if has_config resident || has_config host; then
  if ((!NO_LLAMA)); then
    [[ -n $LLAMA_SERVER ]] || die "no llama-server: run the build part first (--parts build), or pass --llama-server PATH or --no-llama"
  fi
  # the model's layer count (its own, with --layers) and expert bytes
  NLAYERS=$("$PY" -c 'import json, sys
c = json.load(open(sys.argv[1]))
print(c.get("text_config", c)["num_hidden_layers"])' "$MODEL/config.json") || die "$MODEL/config.json: no num_hidden_layers"
  EXPERT_BYTES=$(du -cb "$MODEL"/experts* | tail -1 | cut -f1)
  BUDGET=$((EXPERT_BYTES * SHARE / 100))
  NCMOE=$((NLAYERS - NLAYERS * SHARE / 100))
  CTX=$((PROMPT + GEN + 64))
fi

run_config() {  # config
  local cfg=$1 m=() l=() notes=()
  if ((CPU_ONLY)); then
    m=(--backend cpu)
    notes+=("config $cfg, --cpu-only: moeflux on the CPU, llama-server without -ngl (a plumbing test)")
  else
    m=(--backend cuda)
    l=(-ngl 99)
  fi
  m+=(--ctx "$CTX")
  case $cfg in
    resident)
      l+=(-fa on)
      ((CPU_ONLY)) || notes+=("config resident: every expert in VRAM (moeflux --backend cuda; llama-server -ngl 99)")
      ;;
    host)
      # (on the CPU moeflux only warns that these have no effect: the plumbing is still tried)
      m+=(--gpu-memory "$BUDGET" --host-cache "$HOST_CACHE")
      l+=(--n-cpu-moe "$NCMOE" -fa on)
      ((CPU_ONLY)) || notes+=("config host: $SHARE% of the expert bytes in VRAM: moeflux --gpu-memory $BUDGET ($SHARE% of $EXPERT_BYTES) --host-cache $HOST_CACHE (misses copied from pinned host RAM); llama-server --n-cpu-moe $NCMOE of $NLAYERS layers (those experts computed by the CPU)")
      ;;
  esac
  m+=("${M_EXTRA[@]}")
  l+=("${L_EXTRA[@]}")
  ((CPU_ONLY)) || notes+=("GPU: $GPU_NAME")
  notes+=("routing: ${SKEW:-uniform} (synth --router-skew)")

  local args=(--bin "$MOEFLUX" --model "$MODEL" --streams "$STREAMS" --prompt-len "$PROMPT" --gen "$GEN"
    --requests-per-stream "$RPS" --threads "$THREADS")
  if ((NO_LLAMA)); then args+=(--no-llama); else args+=(--gguf "$GGUF" --llama-server "$LLAMA_SERVER"); fi
  local x
  for x in "${m[@]}"; do args+=("--moeflux-arg=$x"); done
  for x in "${l[@]}"; do args+=("--llama-arg=$x"); done
  for x in "${notes[@]}"; do args+=("--note=$x"); done

  # a finished run with the same settings, binaries and model is not repeated
  local key done_json json=$OUTDIR/serve-load-$cfg.json md=$OUTDIR/serve-load-$cfg.md
  # (the binaries by content: each device call copies the stage afresh, with new mtimes; the
  # GGUF's name holds a key of the model's files)
  key=$( { printf '%s\n' "${args[@]}"; sha256sum "$MOEFLUX" ${LLAMA_SERVER:+"$LLAMA_SERVER"};
           [[ -z $GGUF ]] || stat -c '%n %s' "$GGUF"; cat "$MODEL/moeflux.json"; } | sha256sum | cut -c1-12)
  done_json=$DIR/results/serve-load-$cfg-$key.json
  if [[ -f $done_json && -f ${done_json%.json}.md ]] && ((!FORCE)); then
    note "$cfg: done in an earlier call ($done_json); --force reruns it"
    cp "$done_json" "$json"
    cp "${done_json%.json}.md" "$md"
    cat "$md"
    return 0
  fi
  note "$cfg: python3 bench/serve-load.py ${args[*]}"
  local rc=0 start=$SECONDS tmo=()
  ((CAP > 0)) && tmo=(timeout -s TERM -k 30 "$CAP")
  rm -f "$json" "$md" # none of an earlier run may pass for this one's
  # serve-load.py stops its servers on SIGTERM and prints the runs it finished
  "${tmo[@]}" "$PY" "$REPO/bench/serve-load.py" "${args[@]}" --json "$json" | tee "$md" || rc=$?
  if ((rc == 0)); then
    cp "$json" "$done_json"
    cp "$md" "${done_json%.json}.md"
    note "$cfg took $((SECONDS - start)) s: $md, $json"
  elif ((rc == 124 || rc == 137 || rc == 143)); then
    note "$cfg: stopped by --time-cap $CAP s; $md and $json hold the runs it finished"
    ((RC == 1)) || RC=2
  else
    note "$cfg: serve-load.py failed (status $rc); see above"
    RC=1
  fi
}

for cfg in resident host; do
  has_config "$cfg" && run_config "$cfg"
done
exit $RC
