#!/usr/bin/env bash
# gpt-oss on one NVIDIA GPU, moeflux against llama.cpp's CUDA build on identical weights (the
# MXFP4 experts exported as ggml MXFP4, bench/moeflux2gguf.py). Runs ON the GPU machine from
# the repository root, after scripts/gpu/stage.sh and scripts/gpu/stage-llama.sh (carry
# ["gpu-stage"]); MOEFLUX names the moeflux binary (default gpu-stage/moeflux).
#
#   bash bench/gpu-gptoss.sh [--parts LIST] [--reps R] [--dir DIR] [--layers120 L] [--tg G] [--pp P]
#
# Parts (in this order; each skips what an earlier call on the same warm machine already did):
#   build    llama-bench with CUDA (bench/gpu-llama.sh --build-only), in DIR/llama
#   synth20  gpt-oss-20b, all 24 layers, and its GGUF export
#   r20      20b with every expert in VRAM: moeflux --backend cuda; llama-bench -ngl 99 -fa on
#   synth120 gpt-oss-120b widths, the first L layers (default 12: what the disk holds with the
#            GGUF beside it), and its GGUF export (the 20b model is deleted first)
#   h120     the 120b layers with the experts a 24 GB card cannot hold in host memory: both
#            engines get the same VRAM for routed experts, the share a 24 GB card has for the
#            whole 36-layer model (24 GiB less 2 GiB of dense weights and 1 GiB of reserve, over
#            its 60.9 GB of experts) times these layers' expert bytes.
#            moeflux: --gpu-memory E --host-cache 100G (misses from the pinned host tier),
#            uniform routing and --router-skew zipf:1 (a second model directory is not made:
#            the skew is a synth option, so only uniform routing is run unless
#            --skewed is given, which synthesizes the skewed copy instead of the uniform one).
#            llama.cpp: --n-cpu-moe N, the smallest N whose experts left on the GPU fit E
#            (bench/gpu-llama.sh --expert-budget-gib), the host experts computed on the CPU.
# Tables: stdout, OUT/gptoss.md; raw JSON and logs under OUT.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MOEFLUX=${MOEFLUX:-$REPO/gpu-stage/moeflux}
PARTS=build,synth20,r20,synth120,h120
REPS=3
DIR=/tmp/moeflux-gptoss
L120=12
PP=512
TG=128
SKEW=
OUTDIR=${OUT:-$PWD/gpu-out}

die() { echo "bench/gpu-gptoss.sh: error: $*" >&2; exit 1; }
note() { echo "bench/gpu-gptoss.sh: $*" >&2; }

while [[ $# -gt 0 ]]; do
  case $1 in
    --parts) PARTS=${2:?}; shift 2 ;;
    --reps) REPS=${2:?}; shift 2 ;;
    --dir) DIR=${2:?}; shift 2 ;;
    --layers120) L120=${2:?}; shift 2 ;;
    --pp) PP=${2:?}; shift 2 ;;
    --tg) TG=${2:?}; shift 2 ;;
    --skewed) SKEW=zipf:1; shift ;;
    -h | --help) sed -n '2,27p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ -x $MOEFLUX ]] || die "no moeflux binary at $MOEFLUX (scripts/gpu/stage.sh, or set MOEFLUX)"
has() { [[ ,$PARTS, == *,$1,* ]]; }
mkdir -p "$DIR" "$OUTDIR"
M20=$DIR/gpt-oss-20b
M120=$DIR/gpt-oss-120b-${L120}L${SKEW:+-skew}
LLAMA=(bash "$REPO/bench/gpu-llama.sh" --work "$DIR/llama" --reps "$REPS" --pp "$PP" --tg "$TG")

synth() {  # DST ARGS...: made once (a stamp file holds its arguments)
  local dst=$1
  shift
  [[ -f $dst/.stamp && $(cat "$dst/.stamp") == "$*" ]] && return
  rm -rf "$dst"
  note "synth $* -> $dst"
  local t0=$SECONDS
  "$MOEFLUX" synth "$@" "$dst" >&2 || die "synth failed"
  echo "$*" >"$dst/.stamp"
  note "synth took $((SECONDS - t0)) s ($(du -sh "$dst" | cut -f1))"
}

expert_bytes() { du -cb "$1"/experts/*.bin | tail -1 | cut -f1; }

mf() {  # NAME MODEL ARGS...: one moeflux bench run, its JSON in OUT/NAME.json
  local name=$1 model=$2
  shift 2
  note "$name: moeflux bench $*"
  "$MOEFLUX" bench --model "$model" --backend cuda --reps "$REPS" --prompt-len "$PP" --gen "$TG" \
    --json "$@" >"$OUTDIR/$name.json" 2>"$OUTDIR/$name.log" ||
    { tail -20 "$OUTDIR/$name.log" >&2; die "$name failed"; }
}

if has build; then
  "${LLAMA[@]}" --build-only >/dev/null || die "llama.cpp build failed"
fi
if has synth20; then
  synth "$M20" --preset gpt-oss-20b
  "${LLAMA[@]}" --export-only "$M20" >/dev/null || die "GGUF export failed"
fi
if has r20; then
  mf r20-moeflux "$M20"
  "${LLAMA[@]}" --out "$OUTDIR/r20-llama" "$M20" >&2 || die "llama-bench failed"
fi
if has synth120; then
  rm -rf "$M20" "$DIR"/llama/gguf/*gpt-oss-20b* # the disk holds one model and its GGUF
  synth "$M120" --preset gpt-oss-120b --layers "$L120" ${SKEW:+--router-skew $SKEW}
  "${LLAMA[@]}" --export-only "$M120" >/dev/null || die "GGUF export failed"
fi
if has h120; then
  eb=$(expert_bytes "$M120")
  # (24 GiB - 2 GiB dense - 1 GiB reserve) / 60.9e9 expert bytes of the whole model.
  budget=$(python3 -c "print(int($eb * (21 * 2**30) / 60.9e9))")
  gib=$(python3 -c "print(round($budget / 2**30, 2))")
  note "h120: $gib GiB of VRAM for routed experts ($budget of $eb expert bytes)"
  mf h120-moeflux${SKEW:+-skew} "$M120" --gpu-memory "$budget" --host-cache 100G
  "${LLAMA[@]}" --out "$OUTDIR/h120-llama" --no-resident --expert-budget-gib "$gib" "$M120" >&2 \
    || die "llama-bench failed"
fi

# One table of every run present in OUT.
python3 - "$OUTDIR" <<'EOF' | tee "$OUTDIR/gptoss.md"
import json, os, sys
out = sys.argv[1]
def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return None
def f(x):
    return "-" if x is None else f"{x:.1f}"
print("| config | moeflux pp tok/s | llama.cpp pp tok/s | moeflux tg tok/s | llama.cpp tg tok/s | tg ratio |")
print("|---|---:|---:|---:|---:|---:|")
for name, mfile, ldir in (("20b resident", "r20-moeflux", "r20-llama"),
                          ("120b host tier, uniform routing", "h120-moeflux", "h120-llama"),
                          ("120b host tier, zipf:1 routing", "h120-moeflux-skew", "h120-llama")):
    m = load(os.path.join(out, mfile + ".json"))
    if m is None:
        continue
    l = load(os.path.join(out, ldir, "llama-gpu.json"))
    run = l["runs"][-1] if l and l.get("runs") else {}
    lp = (run.get("pp") or {}).get("avg_ts")
    lt = (run.get("tg") or {}).get("avg_ts")
    mt = m.get("decode_tok_s")
    ratio = f"{mt / lt:.2f}" if mt and lt else "-"
    label = name + (f" (llama.cpp --n-cpu-moe {run.get('n_cpu_moe')})" if run.get("n_cpu_moe") else "")
    print(f"| {label} | {f(m.get('prefill_tok_s'))} | {f(lp)} | {f(mt)} | {f(lt)} | {ratio} |")
EOF
