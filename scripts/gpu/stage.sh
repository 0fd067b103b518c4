#!/usr/bin/env bash
# Builds what the GPU machine runs and stages it in gpu-stage/ (git-ignored,
# carried to the device; the fixtures travel with the working tree):
#   gpu-stage/moeflux       the release binary
#   gpu-stage/gpu-tests     the GPU test executable (crates/moeflux/tests/gpu.rs)
#   gpu-stage/lib-tests     the library's unit tests (the NVRTC compile check)
#   (gpu-stage/llama/ from scripts/gpu/stage-llama.sh is left as it is)
# Binaries are stripped of debug info to fit the 64 MiB carry limit.
# Then, through the device tool, with carry ["gpu-stage"]:
#   bash scripts/gpu/run.sh [tests|bench|all]
# MOEFLUX_STAGE=DIR stages into DIR instead, with copies of run.sh and bench/gpu.sh, so
# that the stage runs its own scripts from another checkout (scripts/gpu/README.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
stage=${MOEFLUX_STAGE:-gpu-stage}
# gpu-stage/llama/ (scripts/gpu/stage-llama.sh: llama.cpp's source for bench/gpu-llama.sh) is kept.
mkdir -p "$stage"
find "$stage" -mindepth 1 -maxdepth 1 ! -name llama -exec rm -rf {} +

cargo build --release -p moeflux-cli
cp target/release/moeflux "$stage/moeflux"

# `cargo test --no-run` prints the executables it built.
exe() {
  cargo test --release -p moeflux "$@" --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])' | tail -n 1
}
cp "$(exe --test gpu)" "$stage/gpu-tests"
cp "$(exe --lib)" "$stage/lib-tests"
strip --strip-debug "$stage/moeflux" "$stage/gpu-tests" "$stage/lib-tests"
if [[ $stage != gpu-stage ]]; then
  cp scripts/gpu/run.sh "$stage/run.sh"
  cp bench/gpu.sh "$stage/gpu.sh"
fi
du -sh "$stage"/*
