#!/usr/bin/env bash
# Several GPUs of one host against llama.cpp's own multi-GPU splits, identical weights, one run:
# Qwen3.5-397B-A17B widths with every expert resident on the GPUs, as many layers as the disk
# holds in both formats, extrapolated to the model's 60 layers. Runs ON the GPU machine (four
# GPUs, e.g. the device tool's nvidia-h200-x4), from the repository root, after
# scripts/gpu/stage.sh (moeflux) and scripts/gpu/stage-llama.sh (llama.cpp's source) staged
# gpu-stage/ (carry ["gpu-stage"]).
#
#   bash bench/gpu-multi-llama.sh [--parts build,synth,run] [--layers L] [--gpus 0,1,2,3]
#                                 [--reps R] [--pp P] [--tg G] [--dir DIR]
#
# parts (default all, in this order; a device call of 10 minutes fits build+synth, another run):
#   build  llama-bench with CUDA (bench/gpu-llama.sh --build-only), in DIR/llama
#   synth  `moeflux synth --preset qwen3.5-397b-a17b --layers L` (default 24: 3.6 GB of experts a
#          layer, 86 GB in each format, both on a 235 GB disk) and its GGUF Q4_1 export (a lossless
#          repack of the same codes)
#   run    moeflux bench on the GPUs (--gpus; the default, which replicates the experts when every
#          GPU holds them all, and --replicate-experts off, each GPU holding its quarter, the layout
#          the full 60 layers need), then llama-bench -sm layer, -sm row and -sm tensor on the
#          same GPUs (CUDA_VISIBLE_DEVICES; a split the llama.cpp build refuses for this model is
#          reported with its error); one table: pp and tg tok/s at L layers, each extrapolated to
#          60 layers by its time per layer (t * 60 / L, the LM head counted as layers: the same
#          conservative rule for both engines), and moeflux with the experts sharded (what 60
#          layers need) over llama.cpp's best split.
# Timing on four H200 (64 cores): the build 103 s, synth 70 s and export 164 s at 16 layers (57 GB
# each), the run part about 2.5 minutes; --layers 16 fits one 10-minute call with the build
# beside synth and export (parts build and synth started as two processes).
#
# $MOEFLUX names the binary (default gpu-stage/moeflux, else target/release/moeflux). Results in
# $OUT/multi-llama (or ./gpu-out/multi-llama).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MOEFLUX=${MOEFLUX:-$REPO/gpu-stage/moeflux}
[[ -x $MOEFLUX ]] || MOEFLUX=$REPO/target/release/moeflux
PARTS=build,synth,run
LAYERS=24
GPUS=0,1,2,3
REPS=2
PP=512
TG=64
DIR=/tmp/moeflux-multi
OUTDIR=${OUT:-$PWD/gpu-out}/multi-llama

die() { echo "bench/gpu-multi-llama.sh: error: $*" >&2; exit 1; }
note() { echo "bench/gpu-multi-llama.sh: $*" >&2; }

while [[ $# -gt 0 ]]; do
  case $1 in
    --parts) PARTS=${2:?}; shift 2 ;;
    --layers) LAYERS=${2:?}; shift 2 ;;
    --gpus) GPUS=${2:?}; shift 2 ;;
    --reps) REPS=${2:?}; shift 2 ;;
    --pp) PP=${2:?}; shift 2 ;;
    --tg) TG=${2:?}; shift 2 ;;
    --dir) DIR=${2:?}; shift 2 ;;
    -h | --help) sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ -x $MOEFLUX ]] || die "no moeflux binary at $MOEFLUX (scripts/gpu/stage.sh, or set MOEFLUX)"
[[ $LAYERS =~ ^[1-9][0-9]*$ ]] || die "--layers must be a positive integer"
[[ $GPUS =~ ^[0-9]+(,[0-9]+)+$ ]] || die "--gpus takes two or more GPU numbers, e.g. 0,1,2,3"
has() { [[ ,$PARTS, == *,$1,* ]]; }
mkdir -p "$DIR" "$OUTDIR"
MODEL=$DIR/397b-${LAYERS}l
LLAMA=(bash "$REPO/bench/gpu-llama.sh" --work "$DIR/llama" --reps "$REPS" --pp "$PP" --tg "$TG")

if has build; then
  "${LLAMA[@]}" --build-only >/dev/null || die "llama.cpp build failed"
fi
if has synth; then
  if [[ ! -f $MODEL/.stamp ]]; then
    rm -rf "$DIR"/397b-* "$DIR"/llama/gguf/*397b* # the disk holds one model and its GGUF
    note "synth qwen3.5-397b-a17b, $LAYERS layers -> $MODEL"
    t0=$SECONDS
    "$MOEFLUX" synth --preset qwen3.5-397b-a17b --layers "$LAYERS" "$MODEL" >&2 || die "synth failed"
    touch "$MODEL/.stamp"
    note "synth took $((SECONDS - t0)) s ($(du -sh "$MODEL" | cut -f1))"
  fi
  "${LLAMA[@]}" --export-only "$MODEL" >/dev/null || die "GGUF export failed"
fi
if has run; then
  [[ -f $MODEL/.stamp ]] || die "no model at $MODEL (run the synth part first)"
  mf() { # NAME ARGS...
    local name=$1
    shift
    note "$name: moeflux bench $*"
    "$MOEFLUX" bench --model "$MODEL" --backend cuda --reps "$REPS" --prompt-len "$PP" --gen "$TG" \
      --gpus "$GPUS" --json "$@" >"$OUTDIR/$name.json" 2>"$OUTDIR/$name.log" ||
      { tail -20 "$OUTDIR/$name.log" >&2; die "$name failed"; }
  }
  mf moeflux
  mf moeflux-sharded --replicate-experts off
  for sm in layer row tensor; do
    rm -rf "$OUTDIR/llama-$sm"
    if ! CUDA_VISIBLE_DEVICES=$GPUS "${LLAMA[@]}" --out "$OUTDIR/llama-$sm" \
      --llama-arg -sm --llama-arg "$sm" "$MODEL" >&2; then
      # a split this llama.cpp cannot run on this model is a row of the table, not the end of it
      why=$(grep -h -m1 -E "error loading model|not implemented|not supported|error:" \
        "$OUTDIR/llama-$sm"/*.log 2>/dev/null | head -1)
      mkdir -p "$OUTDIR/llama-$sm"
      echo "${why:-llama-bench failed}" >"$OUTDIR/llama-$sm/failed.txt"
      note "llama-bench -sm $sm failed: ${why:-see $OUTDIR/llama-$sm}"
    fi
  done
fi

python3 - "$OUTDIR" "$LAYERS" "$GPUS" <<'EOF' | tee "$OUTDIR/multi-llama.md"
import json, os, sys
out, layers, gpus = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except (OSError, ValueError):
        return None
rows = []
for name, label in (("moeflux.json", "moeflux (default)"),
                    ("moeflux-sharded.json", "moeflux, --replicate-experts off")):
    r = load(name)
    if r:
        rows.append((label, r.get("prefill_tok_s"), r.get("decode_tok_s")))
failed = []
for sm in ("layer", "row", "tensor"):
    r = load(f"llama-{sm}/llama-gpu.json")
    try:
        failed.append((sm, open(os.path.join(out, f"llama-{sm}", "failed.txt")).read().strip()))
        continue
    except OSError:
        pass
    if r and r["runs"]:
        run = r["runs"][0]
        rows.append((f"llama.cpp -sm {sm}", run["pp"] and run["pp"]["avg_ts"],
                     run["tg"] and run["tg"]["avg_ts"]))
if not rows:
    sys.exit(0)
at60 = lambda v: v and v * layers / 60
f = lambda v: "-" if not v else f"{v:.1f}"
print(f"Qwen3.5-397B-A17B widths, {layers} layers, every expert on GPUs {gpus}; "
      f"tok/s, and extrapolated to 60 layers")
print()
print(f"| run | pp tok/s | tg tok/s | pp at 60 layers | tg at 60 layers |")
print("|---|---:|---:|---:|---:|")
for label, pp, tg in rows:
    print(f"| {label} | {f(pp)} | {f(tg)} | {f(at60(pp))} | {f(at60(tg))} |")
# The full 60 layers (216 GB of experts) do not fit one card, so the sharded row is the one
# that extrapolates; the default row replicates what fits at this depth.
sharded = [r for r in rows if r[0].endswith("--replicate-experts off")]
ll = [r for r in rows if r[0].startswith("llama.cpp")]
if sharded and ll:
    for i, what in ((1, "pp"), (2, "tg")):
        mine = sharded[0][i]
        best_ll = max((r[i] or 0) for r in ll)
        if mine and best_ll:
            print(f"{what}: moeflux (experts sharded) / llama.cpp's best split = "
                  f"{mine / best_ll:.2f}x")
for sm, why in failed:
    print(f"llama.cpp -sm {sm}: did not run ({why})")
EOF
