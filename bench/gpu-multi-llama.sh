#!/usr/bin/env bash
# Several GPUs of one host against llama.cpp's own multi-GPU splits, identical weights, one run:
# Qwen3.5-397B-A17B widths with every expert resident on the GPUs, as many layers as the disk
# holds in both formats, extrapolated to the model's 60 layers. Runs ON the GPU machine (four
# GPUs, e.g. the device tool's nvidia-h200-x4), from the repository root, after
# scripts/gpu/stage.sh (moeflux) and scripts/gpu/stage-llama.sh (llama.cpp's source) staged
# gpu-stage/ (carry ["gpu-stage"]).
#
#   bash bench/gpu-multi-llama.sh [--parts build,synth,run] [--layers L] [--gpus 0,1,2,3]
#                                 [--reps R] [--pp P] [--tg G] [--pp-long N] [--dir DIR]
#
# parts (default all, in this order; a device call of 10 minutes fits build+synth, another run):
#   build  llama-bench with CUDA (bench/gpu-llama.sh --build-only), in DIR/llama
#   synth  `moeflux synth --preset qwen3.5-397b-a17b --layers L` (default 24: 3.6 GB of experts a
#          layer, 86 GB in each format, both on a 235 GB disk) and its GGUF Q4_1 export (a lossless
#          repack of the same codes)
#   run    moeflux bench on the GPUs (--gpus; the default, which replicates the experts when every
#          GPU holds them all, and --replicate-experts off, each GPU holding its quarter, the layout
#          the full 60 layers need) and on the first GPU alone, then llama-bench -sm layer, -sm row
#          and -sm tensor on the same GPUs and on the first alone (CUDA_VISIBLE_DEVICES; a split the
#          llama.cpp build refuses for this model is reported with its error); pp P (default 512)
#          and tg G (64), and a long prefill of N tokens (--pp-long, default 4096; 0 skips it) on
#          all GPUs; moeflux's default layout and one GPU also with --gpu-activations q8. One table: tok/s at L layers, pp and tg also extrapolated to 60 layers by the
#          time per layer (t * 60 / L, the LM head counted as layers: the same conservative rule for
#          both engines), and per test moeflux's better layout over llama.cpp's best split.
# Timing on four H200 (64 cores), 16 layers (57 GB in each format): the build 103-151 s beside
# synth (70-95 s) and export (164-169 s), about 270 s; the run part without the long prefill
# and one-GPU rows about 3.5 minutes, with them about 5.5 (estimated): two device calls on one
# warm machine (--parts build,synth, then --parts run), or --pp-long 0 in one.
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
PPL=4096
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
    --pp-long) PPL=${2:?}; shift 2 ;;
    --dir) DIR=${2:?}; shift 2 ;;
    -h | --help) sed -n '2,/^set /{/^#/p}' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ -x $MOEFLUX ]] || die "no moeflux binary at $MOEFLUX (scripts/gpu/stage.sh, or set MOEFLUX)"
[[ $LAYERS =~ ^[1-9][0-9]*$ ]] || die "--layers must be a positive integer"
[[ $PPL =~ ^[0-9]+$ ]] || die "--pp-long must be a number of tokens (0: none)"
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
  mf() { # NAME PP TG ARGS...
    local name=$1 pp=$2 tg=$3
    shift 3
    note "$name: moeflux bench --prompt-len $pp --gen $tg $*"
    "$MOEFLUX" bench --model "$MODEL" --backend cuda --reps "$REPS" --prompt-len "$pp" --gen "$tg" \
      --json "$@" >"$OUTDIR/$name.json" 2>"$OUTDIR/$name.log" ||
      { tail -20 "$OUTDIR/$name.log" >&2; die "$name failed"; }
  }
  mf moeflux "$PP" "$TG" --gpus "$GPUS"
  mf moeflux-sharded "$PP" "$TG" --gpus "$GPUS" --replicate-experts off
  mf moeflux-1gpu "$PP" "$TG" --gpus "${GPUS%%,*}"
  # Decode's 4-bit products on 8-bit activations, as llama.cpp's CUDA kernels compute them.
  mf moeflux-q8 "$PP" "$TG" --gpus "$GPUS" --gpu-activations q8
  mf moeflux-1gpu-q8 "$PP" "$TG" --gpus "${GPUS%%,*}" --gpu-activations q8
  if ((PPL > 0)); then
    mf moeflux-pp$PPL "$PPL" 0 --gpus "$GPUS"
    mf moeflux-sharded-pp$PPL "$PPL" 0 --gpus "$GPUS" --replicate-experts off
  fi
  for sm in layer row tensor 1gpu; do
    rm -rf "$OUTDIR/llama-$sm"
    if [[ $sm == 1gpu ]]; then devs=${GPUS%%,*} split=(); else devs=$GPUS split=(--llama-arg -sm --llama-arg "$sm"); fi
    if ! CUDA_VISIBLE_DEVICES=$devs "${LLAMA[@]}" --out "$OUTDIR/llama-$sm" "${split[@]}" "$MODEL" >&2; then
      # A split this llama.cpp cannot run on this model is a row of the table, not the end of
      # it; llama-bench says why only when verbose, so the load is tried once more with -v.
      gguf=$(ls "$DIR"/llama/gguf/"$(basename "$MODEL")"-*-q4_1.gguf 2>/dev/null | head -1)
      why=$(CUDA_VISIBLE_DEVICES=$devs "$DIR/llama/build/bin/llama-bench" -m "$gguf" -p 0 -n 1 -r 1 \
        -ngl 99 -sm "${sm/1gpu/none}" -v 2>&1 | grep -m1 -E "error loading model|not implemented|not supported" || true)
      mkdir -p "$OUTDIR/llama-$sm"
      echo "${why:-llama-bench failed; see its log}" >"$OUTDIR/llama-$sm/failed.txt"
      note "llama-bench -sm $sm failed: ${why:-see $OUTDIR/llama-$sm}"
    elif ((PPL > 0)) && [[ $sm != 1gpu ]]; then
      # The long prefill straight from llama-bench (the build and GGUF the script made).
      gguf=$(ls "$DIR"/llama/gguf/"$(basename "$MODEL")"-*-q4_1.gguf | head -1)
      CUDA_VISIBLE_DEVICES=$devs "$DIR/llama/build/bin/llama-bench" -m "$gguf" -p "$PPL" -n 0 -ngl 99 \
        -fa on -r "$REPS" -sm "$sm" -o json >"$OUTDIR/llama-$sm/pp$PPL.json" 2>"$OUTDIR/llama-$sm/pp$PPL.log" ||
        note "llama-bench -sm $sm -p $PPL failed (see $OUTDIR/llama-$sm/pp$PPL.log)"
    fi
  done
fi

python3 - "$OUTDIR" "$LAYERS" "$GPUS" "$PP" "$TG" "$PPL" <<'EOF' | tee "$OUTDIR/multi-llama.md"
import json, os, sys
out, layers, gpus, pp_n, tg_n, ppl_n = sys.argv[1], int(sys.argv[2]), sys.argv[3], *map(int, sys.argv[4:7])
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except (OSError, ValueError):
        return None
def llama_long(sm):
    r = load(f"llama-{sm}/pp{ppl_n}.json")
    runs = [x for x in (r or []) if x.get("n_prompt") == ppl_n and x.get("n_gen") == 0]
    return runs[0]["avg_ts"] if runs else None
rows, failed = [], []  # (label, pp, pp long, tg, on every GPU)
for name, label, every in (("moeflux", "moeflux (default)", True),
                           ("moeflux-sharded", "moeflux, --replicate-experts off", True),
                           ("moeflux-1gpu", "moeflux, 1 GPU", False),
                           ("moeflux-q8", "moeflux (default), --gpu-activations q8", True),
                           ("moeflux-1gpu-q8", "moeflux, 1 GPU, --gpu-activations q8", False)):
    r = load(f"{name}.json")
    long = load(f"{name}-pp{ppl_n}.json")
    if r:
        rows.append((label, r.get("prefill_tok_s"), long and long.get("prefill_tok_s"),
                     r.get("decode_tok_s"), every))
for sm in ("layer", "row", "tensor", "1gpu"):
    label = "llama.cpp, 1 GPU" if sm == "1gpu" else f"llama.cpp -sm {sm}"
    try:
        failed.append((label, open(os.path.join(out, f"llama-{sm}", "failed.txt")).read().strip()))
        continue
    except OSError:
        pass
    r = load(f"llama-{sm}/llama-gpu.json")
    if r and r["runs"]:
        run = r["runs"][0]
        rows.append((label, run["pp"] and run["pp"]["avg_ts"], llama_long(sm),
                     run["tg"] and run["tg"]["avg_ts"], sm != "1gpu"))
if not rows:
    sys.exit(0)
at60 = lambda v: v and v * layers / 60
f = lambda v: "-" if not v else f"{v:.1f}"
print(f"Qwen3.5-397B-A17B widths, {layers} layers, every expert on GPUs {gpus}; "
      f"tok/s, and extrapolated to 60 layers")
print()
print(f"| run | pp{pp_n} | pp{ppl_n} | tg{tg_n} | pp{pp_n} at 60 layers | tg{tg_n} at 60 layers |")
print("|---|---:|---:|---:|---:|---:|")
for label, pp, ppl, tg, _ in rows:
    print(f"| {label} | {f(pp)} | {f(ppl)} | {f(tg)} | {f(at60(pp))} | {f(at60(tg))} |")
# moeflux's better layout on the GPUs against llama.cpp's best split, test by test (the full 60
# layers, 216 GB of experts, need the sharded layout; the default replicates what fits here).
mine = [r for r in rows if r[0].startswith("moeflux") and r[4]]
ll = [r for r in rows if r[0].startswith("llama.cpp") and r[4]]
for i, what in ((1, f"pp{pp_n}"), (2, f"pp{ppl_n}"), (3, f"tg{tg_n}")):
    best_mine = max((r[i] or 0) for r in mine) if mine else 0
    best_ll = max((r[i] or 0) for r in ll) if ll else 0
    if best_mine and best_ll:
        print(f"{what}: moeflux's better layout / llama.cpp's best split = {best_mine / best_ll:.2f}x")
for label, why in failed:
    print(f"{label}: did not run ({why})")
EOF
