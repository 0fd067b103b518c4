#!/usr/bin/env bash
# Stages llama.cpp's source for the GPU machine (which has nvcc, CMake and ninja but no network):
#   gpu-stage/llama/llama-src.tar.xz   llama.cpp as vendored in llama-cpp-python==0.3.36, trimmed
#                                      to what llama-bench and llama-server (without its web UI)
#                                      with the CPU and CUDA backends need
#   gpu-stage/llama/gguf-py/gguf/      the vendored gguf-py package (pure Python), for
#                                      bench/moeflux2gguf.py (PYTHONPATH=gpu-stage/llama/gguf-py)
#   gpu-stage/llama/SOURCE             where it came from, what was kept, sha256 of the tarball
# Then, through the device tool, with carry ["gpu-stage"]:  bash bench/gpu-llama.sh MODEL_DIR [N...]
#
# The source is the sdist that bench/setup.sh downloads ($MOEFLUX_BENCH_CACHE/dl, default
# target/bench/dl); it is read, never modified. When it is missing it is downloaded the same way
# (pip download, sha256-pinned) into that cache.
#
# What is kept (everything else goes: other ggml backends, tests, examples, docs, models, the
# web UI's sources, the other tools, Python conversion scripts):
#   CMakeLists.txt LICENSE cmake/ include/ src/ common/ licenses/
#   vendor/{nlohmann,sheredom,cpp-httplib} (what llama-common links)
#   vendor/{hash,miniaudio,stb} (what mtmd links; llama-server links mtmd)
#   ggml/{CMakeLists.txt,cmake,include} ggml/src/* (files) ggml/src/{ggml-cpu,ggml-cuda}
#   tools/CMakeLists.txt tools/llama-bench
#   tools/server/ (its sources, not its tests), tools/mtmd/ (sources, models/, debug/; no test
#   media), tools/ui/{CMakeLists.txt,ui.cpp.in,ui.h.in} scripts/ui-assets.cmake: with
#   -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF llama-server embeds an empty UI table and
#   nothing is downloaded or built with npm
# tools/CMakeLists.txt and vendor/CMakeLists.txt are patched to add_subdirectory() only the
# directories that exist, so the trimmed tree configures with the usual options
# (LLAMA_BUILD_TOOLS=ON, tests/examples/app OFF; the server ON or OFF; tools/cli is left out).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CACHE=${MOEFLUX_BENCH_CACHE:-$REPO/target/bench}
PYTHON=${PYTHON:-python3}
SDIST_VERSION=0.3.36
SDIST=llama_cpp_python-$SDIST_VERSION.tar.gz
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
# MOEFLUX_STAGE=DIR stages into DIR/llama instead (as scripts/gpu/stage.sh honours it)
DEST=${MOEFLUX_STAGE:-$REPO/gpu-stage}/llama

die() { echo "stage-llama: error: $*" >&2; exit 1; }
note() { echo "stage-llama: $*" >&2; }

for tool in tar xz sha256sum; do
  command -v $tool >/dev/null || die "$tool not found"
done

# 1. the sdist (shared with bench/setup.sh; only read here)
sdist=$CACHE/dl/$SDIST
if ! [[ -f $sdist ]] || ! echo "$SDIST_SHA256  $sdist" | sha256sum -c --status; then
  note "$sdist missing or wrong; downloading llama-cpp-python==$SDIST_VERSION (sdist, 77 MB)"
  mkdir -p "$CACHE/dl"
  tmp=$(mktemp -d "$CACHE/dl/.tmp.XXXXXX")
  "$PYTHON" -m pip download --quiet --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$SDIST_VERSION" -d "$tmp" || { rm -rf "$tmp"; die "pip download failed"; }
  echo "$SDIST_SHA256  $tmp/$SDIST" | sha256sum -c --status || { rm -rf "$tmp"; die "sha256 mismatch for $SDIST"; }
  mv -f "$tmp/$SDIST" "$sdist"
  rm -rf "$tmp"
fi

# 2. extract the vendored llama.cpp into a scratch directory
work=$(mktemp -d "${TMPDIR:-/tmp}/stage-llama.XXXXXX")
trap 'rm -rf "$work"' EXIT
top=llama_cpp_python-$SDIST_VERSION/vendor/llama.cpp
tar -xzf "$sdist" -C "$work" "$top" || die "cannot extract $top from $sdist"
full=$work/$top
[[ -f $full/CMakeLists.txt && -d $full/ggml/src/ggml-cuda ]] || die "unexpected sdist layout in $sdist"

# 3. copy what the build needs
t=$work/llama.cpp
mkdir -p "$t/ggml/src" "$t/tools" "$t/vendor"
keep() {  # paths relative to the llama.cpp root
  local p
  for p in "$@"; do
    [[ -e $full/$p ]] || die "the sdist has no $p (layout changed?)"
    mkdir -p "$t/$(dirname "$p")"
    cp -a "$full/$p" "$t/$p"
  done
}
keep CMakeLists.txt LICENSE cmake include src common licenses
keep vendor/CMakeLists.txt vendor/nlohmann vendor/sheredom vendor/cpp-httplib
keep ggml/CMakeLists.txt ggml/cmake ggml/include ggml/src/ggml-cpu ggml/src/ggml-cuda
find "$full/ggml/src" -maxdepth 1 -type f -exec cp -a {} "$t/ggml/src/" \;
keep tools/CMakeLists.txt tools/llama-bench
# llama-server (LLAMA_BUILD_SERVER=ON): the server, the multimodal library it links, and the UI
# target without the UI (an empty asset table when neither npm nor a download may provide one)
keep vendor/hash vendor/miniaudio vendor/stb
keep tools/ui/CMakeLists.txt tools/ui/ui.cpp.in tools/ui/ui.h.in scripts/ui-assets.cmake
keep tools/server/CMakeLists.txt tools/mtmd/CMakeLists.txt tools/mtmd/models tools/mtmd/debug
find "$full/tools/server" "$full/tools/mtmd" -maxdepth 1 -type f \( -name '*.cpp' -o -name '*.h' \) |
  while read -r f; do cp -a "$f" "$t/${f#"$full"/}"; done

# add_subdirectory(X) -> only when X/CMakeLists.txt is there (the trimmed tools and vendor dirs)
for f in tools/CMakeLists.txt vendor/CMakeLists.txt; do
  sed -i -E 's|^([[:space:]]*)add_subdirectory\(([A-Za-z0-9_.-]+)\)[[:space:]]*$|\1if (EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/\2/CMakeLists.txt) # moeflux: trimmed tree\n\1    add_subdirectory(\2)\n\1endif()|' "$t/$f"
  grep -q "moeflux: trimmed tree" "$t/$f" || die "patching $f failed"
done
for d in llama-bench server ui mtmd; do
  grep -q "add_subdirectory($d)" "$t/tools/CMakeLists.txt" || die "tools/CMakeLists.txt has no $d"
done
cat >"$t/MOEFLUX-TRIMMED.txt" <<EOF
llama.cpp as vendored in llama-cpp-python==$SDIST_VERSION (sdist sha256 $SDIST_SHA256),
trimmed by moeflux's scripts/gpu/stage-llama.sh to what llama-bench and llama-server (built
with -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF: no web UI) with the CPU and CUDA
backends need. tools/CMakeLists.txt and vendor/CMakeLists.txt are patched to skip the
directories that were left out. Nothing else is changed.
EOF

# 4. pack (reproducible: sorted names, fixed owner and mtime)
rm -rf "$DEST"
mkdir -p "$DEST"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$work" -cf - llama.cpp |
  xz -9 -T0 >"$DEST/llama-src.tar.xz"

# 5. gguf-py (the package only, and its license)
mkdir -p "$DEST/gguf-py"
cp -a "$full/gguf-py/gguf" "$DEST/gguf-py/gguf"
cp -a "$full/gguf-py/LICENSE" "$DEST/gguf-py/LICENSE"
find "$DEST/gguf-py" -name __pycache__ -prune -exec rm -rf {} +

sum=$(sha256sum "$DEST/llama-src.tar.xz" | cut -d' ' -f1)
cat >"$DEST/SOURCE" <<EOF
llama-src.tar.xz: llama.cpp vendored in llama-cpp-python==$SDIST_VERSION ($SDIST, sha256 $SDIST_SHA256)
  trimmed by scripts/gpu/stage-llama.sh (see llama.cpp/MOEFLUX-TRIMMED.txt inside)
  sha256 $sum
gguf-py/: the same sdist's vendor/llama.cpp/gguf-py/gguf (+ LICENSE)
EOF

unpacked=$(du -sh "$t" | cut -f1)
note "trimmed llama.cpp: $unpacked unpacked, $(find "$t" -type f | wc -l) files"
tar_bytes=$(stat -c %s "$DEST/llama-src.tar.xz")
total_bytes=$(du -sb "$DEST" | cut -f1)
echo "gpu-stage/llama/llama-src.tar.xz: $tar_bytes bytes ($((tar_bytes / 1024)) KiB); gpu-stage/llama in all: $total_bytes bytes ($((total_bytes / 1024)) KiB)"
