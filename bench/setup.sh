#!/usr/bin/env bash
# Prepare the llama.cpp side of moeflux's side-by-side benchmark, once; later runs reuse it.
#
#   bench/setup.sh            # prints the cache directory on stdout when everything is ready
#
# What it makes under $MOEFLUX_BENCH_CACHE (default: <repo>/target/bench):
#   dl/llama_cpp_python-0.3.36.tar.gz   the llama-cpp-python sdist from PyPI (sha256-pinned)
#   src/llama_cpp_python-0.3.36/        its extracted source (vendored llama.cpp @0c1e57098)
#   venv/                               Python venv: bench/requirements.txt + vendored gguf-py
#   llama.cpp-build/bin/                llama-bench, llama-quantize, llama-server, libllama.so,
#                                       libggml*.so (llama-server is for bench/serve-load.py)
#
# llama.cpp is built without -march=native and with AMX off (oracle.md section 4): the native
# build enables AMX on this machine's Xeon and then crashes on quantized models whenever ggml's
# extra buffer types (repack/AMX) are on. The build takes about 5 minutes on 2 cores.
#
# Each step writes a stamp file last and is skipped when its stamp is current, so the script is
# idempotent and an interrupted step is redone from scratch on the next run. An flock on
# CACHE/.lock serialises concurrent runs.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${MOEFLUX_BENCH_CACHE:-$REPO/target/bench}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-2}

SDIST_VERSION=0.3.36
SDIST=llama_cpp_python-$SDIST_VERSION.tar.gz
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
SRC=$CACHE/src/llama_cpp_python-$SDIST_VERSION
LLAMA_SRC=$SRC/vendor/llama.cpp
VENV=$CACHE/venv
BUILD=$CACHE/llama.cpp-build

# oracle.md section 4's no-AMX configuration, with each AVX-512 / VNNI extension on only
# where this CPU has it (an AVX2-only machine, e.g. an AMD EPYC without AVX-512, would
# otherwise get illegal instructions).
cpu_has() { grep -qw "$1" /proc/cpuinfo 2>/dev/null; }
onoff() { if cpu_has "$1"; then echo ON; else echo OFF; fi; }
CMAKE_FLAGS=(
  -G Ninja -DCMAKE_BUILD_TYPE=Release
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
  -DGGML_AVX512="$(onoff avx512f)" -DGGML_AVX512_VBMI="$(onoff avx512vbmi)"
  -DGGML_AVX512_VNNI="$(onoff avx512_vnni)" -DGGML_AVX512_BF16="$(onoff avx512_bf16)"
  -DGGML_AVX_VNNI="$(onoff avx_vnni)" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
  # llama-server without its web UI: the prebuilt UI would be downloaded from a Hugging Face
  # bucket at build time, and the benchmark only uses the HTTP API.
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
)
TARGETS=(llama-bench llama-quantize llama-server llama)

die() { echo "bench/setup.sh: error: $*" >&2; exit 1; }
note() { echo "bench/setup.sh: $*" >&2; }

stamp_ok() { [[ -f $1 && "$(cat "$1")" == "$2" ]]; }

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9

command -v "$PYTHON" >/dev/null || die "$PYTHON not found (Python 3.10+ with venv and pip is needed)"
command -v c++ >/dev/null || die "no C++ compiler (c++) found; install g++"

# 1. the sdist
if ! [[ -f $CACHE/dl/$SDIST ]] || ! echo "$SDIST_SHA256  $CACHE/dl/$SDIST" | sha256sum -c --status; then
  note "downloading llama-cpp-python==$SDIST_VERSION (sdist, 77 MB) from PyPI"
  mkdir -p "$CACHE/dl"
  tmp=$(mktemp -d "$CACHE/dl/.tmp.XXXXXX")
  # --no-binary for this one package only: --no-binary :all: would make pip build cmake from source.
  "$PYTHON" -m pip download --quiet --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$SDIST_VERSION" -d "$tmp" || { rm -rf "$tmp"; die "pip download failed"; }
  echo "$SDIST_SHA256  $tmp/$SDIST" | sha256sum -c --status || { rm -rf "$tmp"; die "sha256 mismatch for $SDIST"; }
  mv -f "$tmp/$SDIST" "$CACHE/dl/$SDIST"
  rm -rf "$tmp"
fi

# 2. the extracted source
if ! stamp_ok "$SRC/.moeflux-complete" "$SDIST_SHA256"; then
  note "extracting $SDIST"
  mkdir -p "$CACHE/src"
  tmp=$(mktemp -d "$CACHE/src/.tmp.XXXXXX")
  tar -xzf "$CACHE/dl/$SDIST" -C "$tmp"
  echo "$SDIST_SHA256" >"$tmp/llama_cpp_python-$SDIST_VERSION/.moeflux-complete"
  rm -rf "$SRC"
  mv "$tmp/llama_cpp_python-$SDIST_VERSION" "$SRC"
  rm -rf "$tmp"
  rm -f "$VENV/.moeflux-complete" "$BUILD/.moeflux-complete"
fi

# 3. the venv (built in place: venvs cannot be moved; the stamp is written last)
venv_key="$(sha256sum "$REPO/bench/requirements.txt" | cut -d' ' -f1) $SDIST_SHA256"
if ! stamp_ok "$VENV/.moeflux-complete" "$venv_key"; then
  note "creating the Python venv $VENV"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV" || die "python3 -m venv failed (on Debian: apt-get install python3-venv)"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$REPO/bench/requirements.txt" \
    || die "pip install -r bench/requirements.txt failed"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$LLAMA_SRC/gguf-py" \
    || die "pip install of the vendored gguf-py failed"
  echo "$venv_key" >"$VENV/.moeflux-complete"
fi

# 4. llama.cpp (ninja is incremental; the stamp skips even the configure step when current)
build_key="$SDIST_SHA256 ${CMAKE_FLAGS[*]} ${TARGETS[*]}"
if ! stamp_ok "$BUILD/.moeflux-complete" "$build_key"; then
  rm -f "$BUILD/.moeflux-complete"
  if [[ -f $BUILD/CMakeCache.txt ]] && ! grep -q "GGML_AMX_INT8:BOOL=OFF" "$BUILD/CMakeCache.txt"; then
    rm -rf "$BUILD"
  fi
  note "building llama.cpp (${TARGETS[*]}) without AMX in $BUILD; about 5 minutes on 2 cores"
  start=$SECONDS
  PATH="$VENV/bin:$PATH" cmake -S "$LLAMA_SRC" -B "$BUILD" "${CMAKE_FLAGS[@]}" >"$CACHE/cmake-configure.log" 2>&1 \
    || die "cmake configure failed; see $CACHE/cmake-configure.log"
  PATH="$VENV/bin:$PATH" cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}" >"$CACHE/cmake-build.log" 2>&1 \
    || die "llama.cpp build failed; see $CACHE/cmake-build.log"
  for f in llama-bench llama-quantize llama-server libllama.so; do
    [[ -e $BUILD/bin/$f ]] || die "the build did not produce $BUILD/bin/$f"
  done
  note "llama.cpp built in $((SECONDS - start)) s"
  echo "$build_key" >"$BUILD/.moeflux-complete"
fi

echo "$CACHE"
