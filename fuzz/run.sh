#!/usr/bin/env bash
# Builds the fuzz targets with libFuzzer's coverage instrumentation (the
# flags `cargo fuzz build -s none` passes; stable Rust, no sanitizer, so no
# nightly) and runs each for a bounded time from its committed corpus.
#
#   fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]    (default 60, every target)
#
# A crash, panic, timeout (10 s per input) or an input using over 2 GB stops
# the run with a non-zero exit; the input is saved under fuzz/artifacts/.
# New corpus entries go to a scratch directory (the committed corpus is not
# rewritten; merge interesting ones with libFuzzer's -merge=1 by hand).
set -euo pipefail
cd "$(dirname "$0")"

seconds=${1:-60}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(model_files safetensors_header snapshot chat_template server_request tool_calls gguf)
fi

export RUSTFLAGS="${RUSTFLAGS:-} --cfg fuzzing -Cpasses=sancov-module \
  -Cllvm-args=-sanitizer-coverage-level=4 \
  -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
  -Cllvm-args=-sanitizer-coverage-pc-table \
  -Cllvm-args=-sanitizer-coverage-trace-compares"
# Its own target directory: these flags must not touch the workspace's build.
export CARGO_TARGET_DIR="$PWD/target"
# An explicit --target keeps the flags off build scripts and proc macros.
host=$(rustc -vV | sed -n 's/^host: //p')
cargo build --locked --release --bins --target "$host"
bin="$CARGO_TARGET_DIR/$host/release"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p artifacts
for t in "${targets[@]}"; do
  echo "== fuzz $t (${seconds}s)"
  mkdir -p "$scratch/$t" "corpus/$t" "artifacts/$t"
  "$bin/$t" "$scratch/$t" "corpus/$t" \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=2048 \
    -max_len=65536 -print_final_stats=1 -artifact_prefix="artifacts/$t/" 2>&1 |
    grep -v '^#[0-9]' || { echo "fuzz $t failed"; exit 1; }
done
