#!/usr/bin/env bash
# llama.cpp's CUDA build on a moeflux model (identical weights, GGUF Q4_1): the llama.cpp side of
# moeflux's GPU benchmark. Runs ON the GPU machine, from the repository root, after
# scripts/gpu/stage-llama.sh staged gpu-stage/llama/ (carry ["gpu-stage"]).
#
#   bash bench/gpu-llama.sh [options] MODEL_DIR [N ...]
#
# 1. Build: unpacks gpu-stage/llama/llama-src.tar.xz (llama.cpp vendored in llama-cpp-python
#    0.3.36, trimmed) into WORK/src and builds llama-bench with CUDA (sm_90, Release, ggml's CPU
#    backend without -march=native but with the AVX2/AVX-512 features /proc/cpuinfo lists, AMX
#    off, no curl/openssl, flash attention kernels for an f16 KV cache only) in WORK/build with
#    every core (and llama-server with --server). Logs: OUT/llama-configure.log,
#    OUT/llama-build.log. Skipped when WORK/build holds a build of the same tarball and flags (a
#    warm machine rebuilds nothing; a build with the server also serves a call without --server).
#    One build at a time per WORK (flock on WORK/.build-lock).
# 2. Export: MODEL_DIR -> GGUF Q4_1 with bench/moeflux2gguf.py (a lossless repack: identical
#    weights; MXFP4 experts, gpt-oss's, stay MXFP4), Python 3 with numpy and the staged gguf-py;
#    cached in WORK/gguf under a key of the model's files (names, sizes, mtimes) and the exporter.
# 3. llama-bench -m GGUF -p 512 -n 128 -ngl 99 -fa on -r R -t T -o json, fully resident, then with
#    --n-cpu-moe N for each N given (the routed experts of layers 0..N-1 stay in host memory and
#    run on the CPU; llama.cpp may still copy them to the GPU for large prompt batches). nvidia-smi
#    samples memory.used meanwhile (peak minus the value before the run).
# 4. A markdown table on stdout (weights on the GPU, estimated from the GGUF; peak VRAM; pp/tg
#    tok/s mean ± std) and OUT/llama-gpu.json with every raw result; logs in OUT.
#
# options:
#   --budget-gib G      also run the smallest --n-cpu-moe whose GPU weights (estimate) fit in G GiB
#   --expert-budget-gib E  also run the smallest --n-cpu-moe whose routed experts left on the GPU
#                       take at most E GiB (every other weight on top): the VRAM moeflux's
#                       `--gpu-memory E` gives its expert cache. E.g. gpt-oss-120b on a 24 GB card:
#                       `moeflux synth --preset gpt-oss-120b DIR` then `--expert-budget-gib 20 DIR`
#                       (and `moeflux bench --gpu-memory 20G --host-cache ...` on moeflux's side);
#                       gpt-oss-20b fits: `bash bench/gpu-llama.sh DIR` runs it resident
#   --reps R            llama-bench -r (default 3; each test also has an untimed warm-up)
#   --threads T         llama-bench -t (default: nproc)
#   --fa on|off|auto    flash attention (default on)
#   --ngl N             -ngl (default 99)
#   --pp P / --tg G     prompt / generation lengths (default 512 / 128)
#   --out DIR           results (default $OUT/llama when $OUT is set, else ./gpu-out/llama)
#   --work DIR          source, build and GGUF cache (default /tmp/moeflux-llama)
#   --stage DIR         staged files (default gpu-stage/llama)
#   --llama-bench PATH  use this llama-bench instead of building one
#   --gguf FILE         use this GGUF instead of exporting MODEL_DIR
#   --llama-arg ARG     one more llama-bench argument for every run (repeatable; e.g.
#                       --llama-arg -nopo --llama-arg 1 keeps host-resident experts off the GPU)
#   --tokenizer FILE    passed to moeflux2gguf.py (default: MODEL_DIR's, else a placeholder vocab)
#   --cpu-only          build without CUDA (to try the script on a machine without a GPU)
#   --server            also build llama-server (no web UI: -DLLAMA_BUILD_UI=OFF
#                       -DLLAMA_USE_PREBUILT_UI=OFF, so nothing is downloaded), for
#                       bench/gpu-serve-load.sh; with --build-only its path is printed on stdout
#   --build-only        build (or find the build current) and stop; MODEL_DIR not needed; prints
#                       the path of llama-bench (llama-server with --server) on stdout
#   --configure-only    unpack and configure, then stop (checks the toolchain in seconds)
#   --export-only       export the GGUF, then stop: no build (none needed) unless --build-only,
#                       no llama-bench runs; prints the GGUF's path on stdout
#   --no-resident       skip the fully resident run (only the --n-cpu-moe ones)
#   --jobs J            build jobs (default: nproc)
#   --rm-gguf           delete the exported GGUF at the end
# Environment: PYTHON (default python3), CUDA_ARCH (default 90), NVCC (default: nvcc on PATH,
# else /usr/local/cuda*/bin/nvcc), CMAKE_CUDA_FLAGS (extra nvcc flags, e.g.
# -allow-unsupported-compiler when nvcc refuses the host gcc; NVCC_CCBIN is honoured by nvcc).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
CUDA_ARCH=${CUDA_ARCH:-90}
LLAMA_COMMIT=0c1e57098  # the llama.cpp commit vendored in llama-cpp-python 0.3.36 (no .git in the sdist)
NPROC=$(nproc)

BUDGET=
EXPERT_BUDGET=
NO_RESIDENT=0
REPS=3
THREADS=$NPROC
FA=on
NGL=99
PP=512
TG=128
OUT_DIR=${OUT:+$OUT/llama}
OUT_DIR=${OUT_DIR:-$PWD/gpu-out/llama}
WORK=/tmp/moeflux-llama
STAGE=$REPO/gpu-stage/llama
LB=
GGUF=
TOKENIZER=
CUDA=1
BUILD_ONLY=0
SERVER=0
CONFIGURE_ONLY=0
EXPORT_ONLY=0
JOBS=$NPROC
RM_GGUF=0
MODEL=
NCMOE=()
LB_EXTRA=()

die() { echo "gpu-llama: error: $*" >&2; exit 1; }
note() { echo "gpu-llama: $*" >&2; }
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; }
posint() { [[ $2 =~ ^[0-9]+$ ]] || die "$1 needs a non-negative integer, not '$2'"; }

while [[ $# -gt 0 ]]; do
  case $1 in
    --budget-gib) BUDGET=${2:?--budget-gib needs a number}; shift 2 ;;
    --expert-budget-gib) EXPERT_BUDGET=${2:?--expert-budget-gib needs a number}; shift 2 ;;
    --no-resident) NO_RESIDENT=1; shift ;;
    --reps|-r) REPS=${2:?}; posint --reps "$REPS"; shift 2 ;;
    --threads|-t) THREADS=${2:?}; posint --threads "$THREADS"; shift 2 ;;
    --fa) FA=${2:?}; shift 2 ;;
    --ngl) NGL=${2:?}; posint --ngl "$NGL"; shift 2 ;;
    --pp) PP=${2:?}; posint --pp "$PP"; shift 2 ;;
    --tg) TG=${2:?}; posint --tg "$TG"; shift 2 ;;
    --out) OUT_DIR=${2:?}; shift 2 ;;
    --work) WORK=${2:?}; shift 2 ;;
    --stage) STAGE=${2:?}; shift 2 ;;
    --llama-bench) LB=${2:?}; shift 2 ;;
    --gguf) GGUF=${2:?}; shift 2 ;;
    --tokenizer) TOKENIZER=${2:?}; shift 2 ;;
    --llama-arg) LB_EXTRA+=("${2?--llama-arg needs an argument}"); shift 2 ;;
    --cpu-only) CUDA=0; shift ;;
    --build-only) BUILD_ONLY=1; shift ;;
    --server) SERVER=1; shift ;;
    --configure-only) CONFIGURE_ONLY=1; BUILD_ONLY=1; shift ;;
    --export-only) EXPORT_ONLY=1; shift ;;
    --jobs|-j) JOBS=${2:?}; posint --jobs "$JOBS"; shift 2 ;;
    --rm-gguf) RM_GGUF=1; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *)
      if [[ -z $MODEL ]]; then MODEL=$1; else posint "an --n-cpu-moe value" "$1"; NCMOE+=("$1"); fi
      shift ;;
  esac
done
[[ $FA == on || $FA == off || $FA == auto ]] || die "--fa must be on, off or auto"
((REPS >= 1)) || die "--reps must be at least 1"
((THREADS >= 1)) || die "--threads must be at least 1"
[[ -z $BUDGET || $BUDGET =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--budget-gib needs a number, not '$BUDGET'"
[[ -z $EXPERT_BUDGET || $EXPERT_BUDGET =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--expert-budget-gib needs a number, not '$EXPERT_BUDGET'"
[[ -z $BUDGET || -z $EXPERT_BUDGET ]] || die "give --budget-gib or --expert-budget-gib, not both"
if ((!BUILD_ONLY)); then
  [[ -n $MODEL ]] || die "no MODEL_DIR given (see --help)"
  [[ -f $MODEL/moeflux.json ]] || die "$MODEL is not a moeflux model directory (no moeflux.json)"
  MODEL=$(cd "$MODEL" && pwd)
  [[ -z $TOKENIZER || -f $TOKENIZER ]] || die "--tokenizer $TOKENIZER: no such file"
  [[ -z $GGUF || -f $GGUF ]] || die "--gguf $GGUF: no such file"
fi
mkdir -p "$OUT_DIR" "$WORK"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=$(cd "$WORK" && pwd)

# --- 1. llama-bench ----------------------------------------------------------------------------
build_llama() {
  local tarball=$STAGE/llama-src.tar.xz
  [[ -f $tarball ]] || die "$tarball not found: run scripts/gpu/stage-llama.sh here and carry gpu-stage"
  command -v cmake >/dev/null || die "cmake not found"
  command -v c++ >/dev/null || die "no C++ compiler (c++) found"

  local flags=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON "-DLLAMA_BUILD_COMMIT=$LLAMA_COMMIT"
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
    -DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_RPC=OFF)
  # the CPU backend: every x86 feature this CPU has (not -march=native, which would turn on AMX)
  local cpuflags feat flag
  cpuflags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
  for feat in AVX:avx AVX2:avx2 FMA:fma F16C:f16c BMI2:bmi2 AVX512:avx512f AVX512_VBMI:avx512vbmi \
              AVX512_VNNI:avx512_vnni AVX512_BF16:avx512_bf16 AVX_VNNI:avx_vnni; do
    flag=${feat#*:}
    if [[ $cpuflags == *" $flag "* ]]; then flags+=("-DGGML_${feat%%:*}=ON"); else flags+=("-DGGML_${feat%%:*}=OFF"); fi
  done
  local nvcc=
  if ((CUDA)); then
    if [[ -n ${NVCC:-} ]]; then
      nvcc=$NVCC
      [[ -x $nvcc ]] || die "NVCC=$nvcc is not an executable"
    else
      nvcc=$(command -v nvcc || true)
      [[ -n $nvcc ]] || nvcc=$(ls -d /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc 2>/dev/null | head -1 || true)
      [[ -n $nvcc && -x $nvcc ]] || die "nvcc not found (not on PATH, nor /usr/local/cuda*/bin/nvcc); set NVCC=/path/to/nvcc, or --cpu-only"
    fi
    [[ -n ${CMAKE_CUDA_FLAGS:-} ]] && flags+=("-DCMAKE_CUDA_FLAGS=$CMAKE_CUDA_FLAGS")
    # CMake leaves the toolkit's library directories (implicit to nvcc) out of the RUNPATH; put
    # them in, so that linking llama-bench and running it find libcudart/libcublas even when
    # neither ld.so.conf nor LD_LIBRARY_PATH names them
    local root d rpath=()
    root=$(cd "$(dirname "$nvcc")/.." && pwd)
    for d in "$root/lib64" "$root/lib" "$root/targets/x86_64-linux/lib"; do
      [[ -d $d ]] || continue
      d=$(cd "$d" && pwd -P)
      [[ " ${rpath[*]} " == *" $d "* ]] || rpath+=("$d")
    done
    ((${#rpath[@]})) && flags+=("-DCMAKE_BUILD_RPATH=$(IFS=';'; echo "${rpath[*]}")")
    # NCCL where the machine has it (found by CMake, else left out with a warning): llama.cpp's
    # `-sm tensor` all-reduces through it on several GPUs
    flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_COMPILER=$nvcc" "-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH"
      -DGGML_CUDA_FA=ON -DGGML_CUDA_FA_ALL_QUANTS=OFF -DGGML_CUDA_FA_QUANTS=f16-f16 -DGGML_CUDA_NCCL=ON
      -DGGML_CUDA_GRAPHS=ON)
  else
    flags+=(-DGGML_CUDA=OFF)
  fi
  local gen=()
  if command -v ninja >/dev/null; then gen=(-G Ninja); fi
  # llama-server without its web UI: LLAMA_USE_PREBUILT_UI would download it at build time
  # (the GPU machine has no network); the flags are last, so that the stamp of a build with the
  # server differs from one without and is still recognised as covering llama-bench
  local server_on=(-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF)
  local targets=(llama-bench) bins=(llama-bench)
  if ((SERVER)); then
    flags+=("${server_on[@]}")
    targets+=(llama-server)
    bins+=(llama-server)
  else
    flags+=(-DLLAMA_BUILD_SERVER=OFF)
  fi

  local sum key key_server stamp= b built=1 src=$WORK/src build=$WORK/build
  # one build at a time in WORK: a call cut short by the device's time limit can leave its
  # build running, and a second one in the same directory would corrupt both
  if command -v flock >/dev/null; then
    exec 9>"$WORK/.build-lock"
    flock -n 9 || { note "another build is running in $WORK; waiting for it"; flock 9; }
  fi
  sum=$(sha256sum "$tarball" | cut -d' ' -f1)
  key="$sum ${flags[*]} ${gen[*]}"
  # a build that has llama-server as well also serves a request without --server
  key_server="$sum ${flags[*]/%-DLLAMA_BUILD_SERVER=OFF/${server_on[*]}} ${gen[*]}"
  [[ -f $build/.moeflux-complete ]] && stamp=$(cat "$build/.moeflux-complete")
  for b in "${bins[@]}"; do [[ -x $build/bin/$b ]] || built=0; done
  if ((built)) && [[ -n $stamp && ( $stamp == "$key" || $stamp == "$key_server" ) ]]; then
    note "${bins[*]} current in $build (same sources and flags); not rebuilding"
  else
    rm -f "$build/.moeflux-complete"
    # the same sources: keep them and the build directory (ninja rebuilds what the flags change)
    if ! [[ -f $src/.moeflux-complete && "$(cat "$src/.moeflux-complete")" == "$sum" ]]; then
      note "unpacking $tarball into $src"
      rm -rf "$src" "$build"
      mkdir -p "$src"
      tar -xJf "$tarball" -C "$src" || die "cannot unpack $tarball"
      [[ -f $src/llama.cpp/CMakeLists.txt ]] || die "$tarball holds no llama.cpp/CMakeLists.txt"
      echo "$sum" >"$src/.moeflux-complete"
    fi
    if ((CUDA)); then note "nvcc: $("$nvcc" --version | tail -1)"; fi
    note "configuring (${gen[*]:-make}): ${flags[*]}"
    if ! cmake -S "$src/llama.cpp" -B "$build" "${gen[@]}" "${flags[@]}" >"$OUT_DIR/llama-configure.log" 2>&1; then
      if [[ -f $build/CMakeCache.txt ]]; then  # maybe the old cache: once more from scratch
        note "configure failed in the existing $build; trying again in an empty one"
        rm -rf "$build"
        cmake -S "$src/llama.cpp" -B "$build" "${gen[@]}" "${flags[@]}" >"$OUT_DIR/llama-configure.log" 2>&1 || true
      fi
      [[ -f $build/build.ninja || -f $build/Makefile ]] && grep -q "Generating done" "$OUT_DIR/llama-configure.log" \
        || { tail -30 "$OUT_DIR/llama-configure.log" >&2
             grep -q "unsupported GNU version" "$OUT_DIR/llama-configure.log" \
               && note "nvcc rejects this gcc: try CMAKE_CUDA_FLAGS=-allow-unsupported-compiler, or NVCC_CCBIN=/path/to/older/g++"
             die "cmake configure failed; see $OUT_DIR/llama-configure.log"; }
    fi
    if ((CUDA)) && ! grep -q "Including CUDA backend" "$OUT_DIR/llama-configure.log"; then
      die "the configure step did not include the CUDA backend; see $OUT_DIR/llama-configure.log"
    fi
    if ((CONFIGURE_ONLY)); then
      note "configured in $build (log: $OUT_DIR/llama-configure.log); --configure-only: stopping"
      exit 0
    fi
    note "building ${targets[*]} with $JOBS jobs (log: $OUT_DIR/llama-build.log)"
    local start=$SECONDS
    cmake --build "$build" -j "$JOBS" --target "${targets[@]}" >"$OUT_DIR/llama-build.log" 2>&1 \
      || { grep -E -m20 "error|Error" "$OUT_DIR/llama-build.log" >&2 || tail -30 "$OUT_DIR/llama-build.log" >&2
           grep -q "unsupported GNU version" "$OUT_DIR/llama-build.log" \
             && note "nvcc rejects this gcc: try CMAKE_CUDA_FLAGS=-allow-unsupported-compiler"
           die "the llama.cpp build failed; see $OUT_DIR/llama-build.log"; }
    for b in "${bins[@]}"; do
      [[ -x $build/bin/$b ]] || die "the build did not produce $build/bin/$b"
    done
    note "${targets[*]} built in $((SECONDS - start)) s"
    echo "$key" >"$build/.moeflux-complete"
  fi
  LB=$build/bin/llama-bench
  LS=$build/bin/llama-server
}

# --export-only needs no llama.cpp binary: it can run while another call builds
if ((EXPORT_ONLY && !BUILD_ONLY)) && [[ -z $LB ]]; then
  ((SERVER)) && die "--server builds llama-server; --export-only builds nothing (use --build-only --server)"
  note "--export-only: no build"
else
  LB_GIVEN=$LB
  LS=
  if [[ -n $LB ]]; then
    [[ -x $LB ]] || die "--llama-bench $LB is not an executable"
    ((SERVER)) && die "--server builds llama-server; it cannot be combined with --llama-bench"
    note "using $LB (no build)"
  else
    build_llama
  fi
  "$LB" --list-devices >"$OUT_DIR/llama-devices.txt" 2>&1 || { cat "$OUT_DIR/llama-devices.txt" >&2; die "$LB --list-devices failed"; }
  if ((CUDA)) && ! grep -qE '^[[:space:]]*CUDA[0-9]+:' "$OUT_DIR/llama-devices.txt"; then
    cat "$OUT_DIR/llama-devices.txt" >&2
    [[ -n $LB_GIVEN ]] || die "llama-bench sees no CUDA device (see above); is the GPU visible (nvidia-smi)?"
    note "warning: $LB lists no CUDA device (a CPU-only build?); going on"
  fi
  note "devices: $(grep -v '^$' "$OUT_DIR/llama-devices.txt" | tr '\n' ' ')"
  if ((SERVER)); then
    # a library missing at run time shows here, not in the middle of a benchmark
    "$LS" --version >"$OUT_DIR/llama-server-version.txt" 2>&1 \
      || { cat "$OUT_DIR/llama-server-version.txt" >&2; die "$LS --version failed"; }
    note "llama-server: $LS ($(grep -m1 '^version' "$OUT_DIR/llama-server-version.txt" || echo 'version ?'))"
  fi
  if ((BUILD_ONLY)); then
    if ((SERVER)); then echo "$LS"; else echo "$LB"; fi
    exit 0
  fi
fi

# --- 2. Python with numpy and the staged gguf-py -----------------------------------------------
command -v "$PY" >/dev/null || die "$PY not found"
[[ -d $STAGE/gguf-py/gguf ]] || die "$STAGE/gguf-py/gguf not found: run scripts/gpu/stage-llama.sh and carry gpu-stage"
"$PY" -c 'import numpy' 2>/dev/null || die "$PY has no numpy (needed by bench/moeflux2gguf.py)"
PYPATH=$STAGE/gguf-py
if ! "$PY" -c 'import yaml' 2>/dev/null; then
  # gguf/metadata.py imports yaml at the top but only uses it for model cards, which the exporter
  # never reads: a stub lets the import succeed and fails loudly if it is ever used.
  mkdir -p "$WORK/pystub"
  cat >"$WORK/pystub/yaml.py" <<'EOF'
"""Stub written by bench/gpu-llama.sh: PyYAML is not installed here."""
def _missing(*args, **kwargs):
    raise ImportError("PyYAML is not installed (bench/gpu-llama.sh put this stub in its place)")
safe_load = load = safe_dump = dump = _missing
class YAMLError(Exception):
    pass
EOF
  PYPATH=$PYPATH:$WORK/pystub
  note "PyYAML is missing; using a stub (gguf imports it, the exporter does not use it)"
fi
export PYTHONPATH=$PYPATH${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c 'import gguf, sys; sys.exit(0 if hasattr(gguf, "GGUFWriter") else 1)' \
  || die "cannot import gguf from $STAGE/gguf-py with $PY"

# --- 3. the GGUF -------------------------------------------------------------------------------
EXPORTED=0
if [[ -z $GGUF ]]; then
  key=$( (cd "$MODEL" && find . -type f -printf '%p %s %T@\n' | LC_ALL=C sort; cat moeflux.json config.json) \
    | cat - "$REPO/bench/moeflux2gguf.py" | sha256sum | cut -c1-12)
  mkdir -p "$WORK/gguf"
  GGUF=$WORK/gguf/$(basename "$MODEL")-$key-q4_1.gguf
  if [[ -f $GGUF ]]; then
    note "reusing $GGUF"
  else
    find "$WORK/gguf" -maxdepth 1 -name "$(basename "$MODEL")-*-q4_1.gguf" -delete
    need=$(($(du -sb "$MODEL" | cut -f1) * 12 / 10))
    avail=$(df -B1 --output=avail "$WORK/gguf" | tail -1)
    ((avail > need)) || die "not enough disk space in $WORK/gguf: need about $((need / 1000000000 + 1)) GB, have $((avail / 1000000000)) GB (--work DIR elsewhere, or --gguf FILE)"
    note "exporting $MODEL as GGUF Q4_1 -> $GGUF"
    start=$SECONDS
    "$PY" "$REPO/bench/moeflux2gguf.py" "$MODEL" "$GGUF" --type q4_1 ${TOKENIZER:+--tokenizer "$TOKENIZER"} \
      >"$OUT_DIR/moeflux2gguf.json" 2>"$OUT_DIR/moeflux2gguf.log" \
      || { tail -20 "$OUT_DIR/moeflux2gguf.log" >&2; die "moeflux2gguf failed; see $OUT_DIR/moeflux2gguf.log"; }
    note "Q4_1 export took $((SECONDS - start)) s: $(cat "$OUT_DIR/moeflux2gguf.json")"
    EXPORTED=1
  fi
fi
GGUF=$(cd "$(dirname "$GGUF")" && pwd)/$(basename "$GGUF")
if ((EXPORT_ONLY)); then
  note "--export-only: $GGUF is ready; stopping"
  echo "$GGUF"
  exit 0
fi
SMI_PID=
cleanup() {
  if [[ -n $SMI_PID ]]; then kill "$SMI_PID" 2>/dev/null || true; fi
  if ((RM_GGUF && EXPORTED)); then rm -f "$GGUF"; fi
}
trap cleanup EXIT

# --- 4. runs -----------------------------------------------------------------------------------
REPORT=$REPO/bench/gpu_llama_report.py
if [[ -n $BUDGET || -n $EXPERT_BUDGET ]]; then
  budget_arg=(--budget-gib "$BUDGET")
  [[ -n $EXPERT_BUDGET ]] && budget_arg=(--expert-budget-gib "$EXPERT_BUDGET")
  "$PY" "$REPORT" plan "$GGUF" "${budget_arg[@]}" --n-cpu-moe "${NCMOE[@]}" >"$OUT_DIR/plan.txt" \
    || die "no --n-cpu-moe fits the budget (${budget_arg[*]})"
  n=$(tail -1 "$OUT_DIR/plan.txt")
  sed '$d' "$OUT_DIR/plan.txt" >&2
  NCMOE+=("$n")
else
  "$PY" "$REPORT" plan "$GGUF" --n-cpu-moe "${NCMOE[@]}" >&2 || die "cannot read $GGUF"
fi

gpu_index=0
[[ ${CUDA_VISIBLE_DEVICES:-} =~ ^[0-9]+$ ]] && gpu_index=$CUDA_VISIBLE_DEVICES
have_smi=0
command -v nvidia-smi >/dev/null && nvidia-smi -i "$gpu_index" >/dev/null 2>&1 && have_smi=1

RUNS=()
run_bench() {  # name n_cpu_moe
  local name=$1 n=$2 args=() vram=
  ((n > 0)) && args=(-ncmoe "$n")
  args+=("${LB_EXTRA[@]}")
  note "llama-bench $name: -p $PP -n $TG -ngl $NGL -fa $FA -r $REPS -t $THREADS ${args[*]}"
  if ((have_smi)); then
    vram=$OUT_DIR/llama-$name.vram
    nvidia-smi -i "$gpu_index" --query-gpu=memory.used --format=csv,noheader,nounits >"$vram"
    nvidia-smi -i "$gpu_index" --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >>"$vram" 2>/dev/null &
    SMI_PID=$!
  fi
  local rc=0 start=$SECONDS
  "$LB" -m "$GGUF" -p "$PP" -n "$TG" -ngl "$NGL" -fa "$FA" -r "$REPS" -t "$THREADS" "${args[@]}" -o json \
    >"$OUT_DIR/llama-$name.json" 2>"$OUT_DIR/llama-$name.log" || rc=$?
  if [[ -n $SMI_PID ]]; then kill "$SMI_PID" 2>/dev/null || true; wait "$SMI_PID" 2>/dev/null || true; SMI_PID=; fi
  if ((rc != 0)); then
    tail -20 "$OUT_DIR/llama-$name.log" >&2
    die "llama-bench $name failed (status $rc); see $OUT_DIR/llama-$name.log"
  fi
  note "llama-bench $name took $((SECONDS - start)) s"
  RUNS+=("$name:$n:$OUT_DIR/llama-$name.json:$vram")
}

((NO_RESIDENT)) || run_bench resident 0
declare -A seen=()
for n in "${NCMOE[@]}"; do
  ((n > 0)) || continue
  [[ -z ${seen[$n]:-} ]] || continue
  seen[$n]=1
  run_bench "ncmoe$n" "$n"
done

"$PY" "$REPORT" report --gguf "$GGUF" --model "$MODEL" --out-json "$OUT_DIR/llama-gpu.json" "${RUNS[@]}" \
  | tee "$OUT_DIR/llama-gpu.md"
note "results: $OUT_DIR/llama-gpu.md, $OUT_DIR/llama-gpu.json (raw llama-bench JSON and logs beside them)"
