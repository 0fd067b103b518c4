#!/usr/bin/env bash
# moeflux on one NVIDIA GPU: the benchmarks of docs/PERFORMANCE.md's GPU section.
# Runs on the GPU machine (scripts/gpu/run.sh bench), with synth models made there.
#
#   bench/gpu.sh [--parts a,b,c,d,e,f,g,l] [--reps R] [--dir DIR] [--out DIR] [--quick]
#
#   a  qwen3.6-35b-a3b widths, all 40 layers, every expert in VRAM: pp512, pp4096, tg128;
#      decode against the roofline (weight bytes per token / measured device-memory bandwidth);
#      tg128 without CUDA graphs, and tg128, pp512 and pp4096 with --gpu-activations q8
#   b  the same model with --gpu-memory holding 25% of the expert bytes: tg128 with uniform
#      routing and with --router-skew zipf:1, LFU-DA and LRU, staging reads or the pinned host
#      tier (with and without prefetch); decode against the PCIe ceiling
#      (resident time + missed expert bytes / measured pinned host-to-GPU bandwidth)
#   c  qwen3.5-397b-a17b widths, the first 12 layers (what the disk holds), --gpu-memory set
#      to hold 30% of the experts (an 80 GB card's share of the 60-layer model), experts from
#      the pinned host tier: ms per layer and tok/s extrapolated to 60 layers, at top-10 and
#      K=4, with and without prefetch; top-10 with --gpu-activations q8
#   d  cogito-v2-671b widths (DeepSeek-V3: MLA, 256 experts top-8), the first 4 and 8 layers
#      (3 dense + 1 or 5 MoE): every expert in VRAM (pp and tg), then the 8 layers with one
#      layer's worth of expert slots (20% of them; an 80 GB card holds ~18% of the 61-layer
#      model's) and misses from the pinned host tier or from staging reads; ms per MoE layer
#      (the difference of the two depths) and s/token extrapolated to 61 layers; then the
#      GPU time per kernel of 8 resident layers (MOEFLUX_CUDA_PROFILE, no graphs)
#   e  the Qwen3-MoE and GLM-4.5/4.6 families at real widths: qwen3-30b-a3b whole (48 layers,
#      17 GB: every expert in VRAM, pp and tg); glm-4.5-air (fits an 80 GB card: resident),
#      qwen3-235b-a22b and glm-4.6 (do not: 128 and 188 GB of experts) at two depths,
#      resident, then the deeper one with --gpu-memory holding the share of the experts an
#      80 GB card has for the full model (54% and 34%: 77 GB less the dense part and a 3 GB
#      reserve), misses from the pinned host tier; ms per MoE layer (the difference of the
#      two depths) extrapolated to the full depth
#   g  the disk path: qwen3.6-35b-a3b widths, the first 16 layers, zipf:1 routing, 25% of the
#      expert bytes in VRAM, every miss read with --direct-io: a host tier of 25% of the experts
#      in between (three levels; --prefetch auto and off), then no host tier with and without
#      the read-ahead of the next layer's predicted experts (--prefetch); decode against the disk-bound
#      ceiling (needed file bytes per token / the sequential O_DIRECT bandwidth measured in
#      the same run, plus host-tier bytes / pinned H2D bandwidth, plus the resident time:
#      the token's time outside the expert wait). --dir must be on a real disk (not tmpfs).
#      Then the same three ways at qwen3.5-397b-a17b widths, G397_LAYERS layers (default 8,
#      27 GB of experts; 0 skips them); G_A3B=0 skips the A3B rows. G_GDS=1 adds, at each
#      depth, the misses read by cuFile (--gds on: GPUDirect Storage where nvidia-fs is
#      loaded, cuFile's compatibility mode elsewhere; needs libcufile and a file system cuFile
#      can register: on a VM whose /run/udev has no record of the disk it cannot).
#   f  two GPUs (--gpus 0,1) against one, in the same run (needs 2 GPUs): c's 397B widths (12
#      layers, top-10) with each GPU's --gpu-memory holding 30% of the experts (60% together),
#      the rest in the pinned host tier, extrapolated to 60 layers; the same with a host tier
#      of 25% of the experts (one arena the GPUs share) and the rest read from the disk
#      (--direct-io; in part g's disk table, rows `-arena`); qwen3.6-35b-a3b widths
#      fully resident: pp4096 and tg128 (CUDA graphs) with every expert on both GPUs (the
#      default: prefill split by tokens), pp4096 split by experts only (MOEFLUX_TOKEN_SPLIT=0),
#      pp512 on 1 and 2 GPUs, on a host of 4 GPUs pp4096 and tg128 on all four, and sharded
#      (--replicate-experts off), and sharded tg128 eager
#      (MOEFLUX_EP_GRAPHS=0); the NCCL all-reduce's share of a sharded decode step
#      (MOEFLUX_CUDA_PROFILE, eager); one GPU's
#      prefill profile (the shares an expert split and a token split divide) and two GPUs'
#      (the broadcasts' share); with F_MLA=1, cogito-v2-671b widths (MLA, 4 layers, resident)
#      prefill on 1 and 2 GPUs, split by tokens and by experts only. F397=0 skips the
#      397B rows (their 43 GB synth), F_A3B=0 the A3B rows.
#   l  low-width copies (--low-width-experts): qwen3.5-397b-a17b widths, L_LAYERS layers (default
#      4), `moeflux convert --model DIR --low-width-copies 2`, then c's set-up (--gpu-memory 30% of
#      the 4-bit experts' bytes, the rest in the pinned host tier, top-10) decoded with the 4-bit
#      experts, with their 2-bit copies, and with 4-bit experts cached and misses uploaded as
#      copies (--low-width-misses; with and without the prefetch that replaces copies at full
#      width, and only for misses weighed below the mean weight 1/K, --low-width-below 0.1):
#      hit rate, MB uploaded per token, tok/s, share of expert uses on copies
#
# $MOEFLUX names the binary (default: target/release/moeflux). Models go to --dir (default
# /tmp/moeflux-bench) and are deleted when their part ends (the disk holds one at a time).
# Each run's JSON goes to --out (default $OUT or ./gpu-out); one markdown table on stdout.
# --quick: one repetition, shorter tests (a smoke run).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MOEFLUX=${MOEFLUX:-$REPO/target/release/moeflux}
PARTS=a,b,c
REPS=3
DIR=/tmp/moeflux-bench
OUTDIR=${OUT:-$PWD/gpu-out}
QUICK=0

die() { echo "bench/gpu.sh: error: $*" >&2; exit 1; }
note() { echo "bench/gpu.sh: $*" >&2; }

while [[ $# -gt 0 ]]; do
  case $1 in
    --parts) PARTS=${2:?}; shift 2 ;;
    --reps) REPS=${2:?}; shift 2 ;;
    --dir) DIR=${2:?}; shift 2 ;;
    --out) OUTDIR=${2:?}; shift 2 ;;
    --quick) QUICK=1; REPS=1; shift ;;
    -h|--help) sed -n '2,57p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ -x $MOEFLUX ]] || die "MOEFLUX=$MOEFLUX is not an executable (build it, or scripts/gpu/stage.sh)"
[[ $REPS =~ ^[1-9][0-9]*$ ]] || die "--reps must be a positive integer"
mkdir -p "$DIR" "$OUTDIR"
has() { [[ ,$PARTS, == *,$1,* ]]; }

ROWS=()
# bench NAME MODEL ARGS...: one `moeflux bench --json` run, saved as NAME.json, one table row.
bench() {
  local name=$1 model=$2
  shift 2
  note "$name: moeflux bench $*"
  "$MOEFLUX" bench --model "$model" --backend cuda --reps "$REPS" --json "$@" \
    >"$OUTDIR/$name.json" 2>"$OUTDIR/$name.log" ||
    { cat "$OUTDIR/$name.log" >&2; die "$name failed"; }
  ROWS+=("$(python3 - "$name" "$OUTDIR/$name.json" <<'EOF'
import json, sys
name, path = sys.argv[1], sys.argv[2]
r = json.load(open(path))
def f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)
pp, tg = r.get("prefill"), r.get("decode")
roof = r.get("decode_roofline_tok_s")
ceil = r.get("decode_pcie_ceiling_tok_s")
tgv = r.get("decode_tok_s")
cells = [
    name,
    f(r.get("prefill_tok_s")) + (f" (pp{pp['tokens']})" if pp else ""),
    f(tgv),
    f(tg and tg["ms_per_token"].get("expert_io_wait"), "{:.2f}") if tg else "-",
    f(tgv / roof * 100, "{:.0f}%") if tgv and roof else "-",
    f(tg and tg.get("gpu_cache_hit_rate") and tg["gpu_cache_hit_rate"] * 100, "{:.1f}%") if tg else "-",
    f(tg and tg["uploaded_bytes_per_token"] / 1e6, "{:.1f}") if tg else "-",
    f(ceil) + (f" ({tgv / ceil * 100:.0f}%)" if ceil and tgv else ""),
    f(r.get("h2d_pinned_gb_s")),
    f(r.get("memory_gb_s"), "{:.0f}"),
]
print("| " + " | ".join(cells) + " |")
EOF
)")
}

synth() {
  local dst=$1
  shift
  note "synth $* -> $dst"
  local t0=$SECONDS
  rm -rf "$dst" # the disk holds one model at a time
  "$MOEFLUX" synth "$@" "$dst" >&2 || die "synth failed"
  note "synth took $((SECONDS - t0)) s ($(du -sh "$dst" | cut -f1))"
}

# Expert bytes of a model directory (the expert files).
expert_bytes() { du -cb "$1"/experts* 2>/dev/null | tail -n 1 | cut -f1; }

if [[ $QUICK == 1 ]]; then PP=128; PPL=512; TG=32; PPD=32; else PP=512; PPL=4096; TG=128; PPD=128; fi

if has a || has b; then
  A3B=$DIR/a3b-40
  synth "$A3B" --preset qwen3.6-35b-a3b
fi

if has a; then
  bench a-resident-pp$PP "$A3B" --prompt-len $PP --gen $TG
  bench a-resident-pp$PPL "$A3B" --prompt-len $PPL --gen 0
  bench a-resident-no-graphs "$A3B" --prompt-len 0 --gen $TG --no-cuda-graphs
  bench a-resident-q8 "$A3B" --prompt-len 0 --gen $TG --gpu-activations q8
  bench a-resident-q8-pp$PP "$A3B" --prompt-len $PP --gen 0 --gpu-activations q8
  bench a-resident-q8-pp$PPL "$A3B" --prompt-len $PPL --gen 0 --gpu-activations q8
fi

if has b; then
  budget=$(( $(expert_bytes "$A3B") / 4 ))
  note "b: --gpu-memory $budget (25% of the expert bytes)"
  for policy in lfu lru; do
    bench b-25pct-uniform-$policy "$A3B" --prompt-len 0 --gen $TG --gpu-memory $budget --cache-policy $policy
  done
  # Misses from the pinned host tier instead of staging reads, with (the default for
  # experts this large) and without uploads of the next layer's predicted experts.
  bench b-25pct-uniform-lfu-host "$A3B" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G
  bench b-25pct-uniform-lfu-host-noprefetch "$A3B" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G --prefetch off
  synth "$A3B-zipf" --preset qwen3.6-35b-a3b --router-skew zipf:1
  rm -rf "$A3B"
  for policy in lfu lru; do
    bench b-25pct-zipf1-$policy "$A3B-zipf" --prompt-len 0 --gen $TG --gpu-memory $budget --cache-policy $policy
  done
  bench b-25pct-zipf1-lfu-host "$A3B-zipf" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G
  bench b-25pct-zipf1-lfu-host-noprefetch "$A3B-zipf" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G --prefetch off
  rm -rf "$A3B-zipf"
fi
has a && rm -rf "$A3B"

if has c; then
  BIG=$DIR/397b-12
  synth "$BIG" --preset qwen3.5-397b-a17b --layers 12
  # 30% of the 12 layers' experts: an 80 GB card holds ~30% of the full model's experts.
  budget=$(( $(expert_bytes "$BIG") * 3 / 10 ))
  # Warm the page cache (the experts live in host RAM).
  find "$BIG"/experts -type f -exec cat {} + >/dev/null
  bench c-397b-12l-top10 "$BIG" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G
  bench c-397b-12l-k4 "$BIG" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G --experts-per-token 4
  bench c-397b-12l-top10-noprefetch "$BIG" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G --prefetch off
  bench c-397b-12l-k4-noprefetch "$BIG" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G --experts-per-token 4 --prefetch off
  bench c-397b-12l-top10-q8 "$BIG" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G --gpu-activations q8
  rm -rf "$BIG"
fi

if has d; then
  for L in 4 8; do
    DS=$DIR/cogito-$L
    synth "$DS" --preset cogito-v2-671b --layers $L
    bench d-cogito-${L}l-resident "$DS" --prompt-len $PPD --gen $TG
    if [[ $L == 8 ]]; then
      # One MoE layer's worth of slots (the cache's minimum): 20% of the 5 layers' experts.
      budget=$(( $(expert_bytes "$DS") / 5 ))
      bench d-cogito-8l-host "$DS" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G
      bench d-cogito-8l-staging "$DS" --prompt-len 0 --gen $TG --gpu-memory $budget
      # Where a resident decode step goes: GPU time per kernel, launched one by one.
      export MOEFLUX_CUDA_PROFILE=1
      bench d-cogito-8l-profile "$DS" --prompt-len 0 --gen 32 --no-cuda-graphs
      unset MOEFLUX_CUDA_PROFILE
    fi
    rm -rf "$DS"
  done
fi

if has e; then
  Q30=$DIR/qwen3-30b
  synth "$Q30" --preset qwen3-30b-a3b
  bench e-qwen3-30b-resident "$Q30" --prompt-len $PP --gen $TG
  rm -rf "$Q30"
  # preset, two depths, its dense first layers, the full model's MoE layers, and the share
  # of the experts an 80 GB card holds (percent; 100: all of them, resident).
  for spec in "glm-4.5-air 4 8 1 45 100" "qwen3-235b-a22b 4 8 0 94 54" "glm-4.6 6 10 3 89 34"; do
    read -r preset l1 l2 dense moe share <<<"$spec"
    for L in $l1 $l2; do
      M=$DIR/$preset-$L
      synth "$M" --preset "$preset" --layers "$L"
      bench "e-$preset-${L}l-resident" "$M" --prompt-len $PPD --gen $TG
      if [[ $L == "$l2" && $share != 100 ]]; then
        budget=$(( $(expert_bytes "$M") * share / 100 ))
        find "$M"/experts -type f -exec cat {} + >/dev/null
        bench "e-$preset-${L}l-host" "$M" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G
      fi
      rm -rf "$M"
    done
    echo "$preset $l1 $l2 $dense $moe" >>"$OUTDIR/e-depths.txt"
  done
fi

if has l; then
  LW=$DIR/397b-low
  synth "$LW" --preset qwen3.5-397b-a17b --layers "${L_LAYERS:-4}"
  # The same VRAM bytes for both rows: 30% of the 4-bit experts (measured before the copies).
  budget=$(( $(expert_bytes "$LW") * 3 / 10 ))
  t0=$SECONDS
  "$MOEFLUX" convert --model "$LW" --low-width-copies 2 >&2 || die "low-width copies failed"
  note "l: 2-bit copies took $((SECONDS - t0)) s"
  find "$LW"/experts -type f -exec cat {} + >/dev/null
  bench l-397b-4bit "$LW" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G
  bench l-397b-2bit-copies "$LW" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G --low-width-experts
  bench l-397b-2bit-misses "$LW" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G --low-width-misses
  bench l-397b-2bit-misses-noprefetch "$LW" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G --low-width-misses --prefetch off
  bench l-397b-2bit-misses-below-0.1 "$LW" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G --low-width-misses --low-width-below 0.1
  for name in l-397b-2bit-misses l-397b-2bit-misses-noprefetch l-397b-2bit-misses-below-0.1; do
    note "$name: $(python3 - "$OUTDIR/$name.json" <<'EOF'
import json, sys
t = json.load(open(sys.argv[1]))["decode"]
print("%.1f%% of expert uses on 2-bit copies, %d copies replaced by prefetches"
      % (t["gpu_low_width_share"] * 100, t["gpu_promoted"]))
EOF
)"
  done
  rm -rf "$LW"
fi

if has g; then
  if [[ ${G_A3B:-1} != 0 ]]; then
    D16=$DIR/a3b-16-zipf
    synth "$D16" --preset qwen3.6-35b-a3b --layers 16 --router-skew zipf:1
    sync
    budget=$(( $(expert_bytes "$D16") / 4 ))
    df -h "$D16" >&2
    G=(--prompt-len 0 --gen 64 --gpu-memory $budget --direct-io)
    bench g-disk-host25 "$D16" "${G[@]}" --host-cache $budget
    bench g-disk-host25-noprefetch "$D16" "${G[@]}" --host-cache $budget --prefetch off
    bench g-disk "$D16" "${G[@]}" --prefetch off
    bench g-disk-ahead "$D16" "${G[@]}" --prefetch on
    bench g-disk-ahead-io16 "$D16" "${G[@]}" --prefetch on --io-threads 16
    [[ ${G_GDS:-0} == 0 ]] || bench g-disk-gds "$D16" "${G[@]}" --prefetch off --gds on
    rm -rf "$D16"
  fi
  if [[ ${G397_LAYERS:-8} != 0 ]]; then
    # 397B widths (6.75 MB experts, top-10), as many layers as a 64 GB disk holds beside
    # nothing else: 8 by default (27 GB of experts).
    D397=$DIR/397b-zipf
    synth "$D397" --preset qwen3.5-397b-a17b --layers "${G397_LAYERS:-8}" --router-skew zipf:1
    sync
    budget=$(( $(expert_bytes "$D397") / 4 ))
    df -h "$D397" >&2
    G=(--prompt-len 0 --gen 64 --gpu-memory $budget --direct-io)
    bench g-397b-disk-host25 "$D397" "${G[@]}" --host-cache $budget
    bench g-397b-disk "$D397" "${G[@]}" --prefetch off
    bench g-397b-disk-ahead "$D397" "${G[@]}" --prefetch on
    [[ ${G_GDS:-0} == 0 ]] || bench g-397b-disk-gds "$D397" "${G[@]}" --prefetch off --gds on
    rm -rf "$D397"
  fi
fi

if has f; then
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
  if ((ngpu < 2)); then
    note "f: skipped: needs 2 GPUs, found $ngpu"
  else
    if [[ ${F397:-1} != 0 ]]; then
      BIG=$DIR/397b-12
      synth "$BIG" --preset qwen3.5-397b-a17b --layers 12
      budget=$(( $(expert_bytes "$BIG") * 3 / 10 ))
      find "$BIG"/experts -type f -exec cat {} + >/dev/null
      bench f-397b-12l-top10-1gpu "$BIG" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G
      bench f-397b-12l-top10-2gpu "$BIG" --prompt-len 0 --gen $TG --gpu-memory $budget --host-cache 100G --gpus 0,1
      # The same VRAM shares over an expert-granular host tier of 25% of the experts (one
      # arena, shared by the GPUs), every other miss read from the disk with O_DIRECT.
      arena=$(( $(expert_bytes "$BIG") / 4 ))
      sync
      A=(--prompt-len 0 --gen 64 --gpu-memory $budget --host-cache $arena --direct-io)
      bench f-397b-12l-top10-1gpu-arena "$BIG" "${A[@]}"
      bench f-397b-12l-top10-2gpu-arena "$BIG" "${A[@]}" --gpus 0,1
      rm -rf "$BIG"
    fi
    if [[ ${F_A3B:-1} != 0 ]]; then
    A3B=$DIR/a3b-40
    synth "$A3B" --preset qwen3.6-35b-a3b
    bench f-a3b-resident-1gpu "$A3B" --prompt-len $PPL --gen $TG
    bench f-a3b-resident-2gpu "$A3B" --prompt-len $PPL --gen $TG --gpus 0,1
    if (( ngpu >= 4 )); then
      bench f-a3b-resident-4gpu "$A3B" --prompt-len $PPL --gen $TG --gpus 0,1,2,3
    fi
    bench f-a3b-resident-2gpu-sharded "$A3B" --prompt-len $PPL --gen $TG --gpus 0,1 --replicate-experts off
    # Prefill split by experts only (what the group did before splitting by tokens).
    MOEFLUX_TOKEN_SPLIT=0 bench f-a3b-resident-2gpu-expert-split "$A3B" --prompt-len $PPL --gen 0 --gpus 0,1
    bench f-a3b-pp$PP-1gpu "$A3B" --prompt-len $PP --gen 0
    bench f-a3b-pp$PP-2gpu "$A3B" --prompt-len $PP --gen 0 --gpus 0,1
    export MOEFLUX_CUDA_PROFILE=1
    bench f-a3b-2gpu-profile "$A3B" --prompt-len 0 --gen 32 --gpus 0,1 --no-cuda-graphs --replicate-experts off
    bench f-a3b-1gpu-prefill-profile "$A3B" --prompt-len $PPL --gen 1 --no-cuda-graphs
    bench f-a3b-2gpu-prefill-profile "$A3B" --prompt-len $PPL --gen 1 --gpus 0,1 --no-cuda-graphs
    unset MOEFLUX_CUDA_PROFILE
    MOEFLUX_EP_GRAPHS=0 bench f-a3b-resident-2gpu-eager "$A3B" --prompt-len 0 --gen $TG --gpus 0,1 --replicate-experts off
    rm -rf "$A3B"
    fi
    if [[ ${F_MLA:-0} != 0 ]]; then
    # MLA prefill split by tokens: cogito-v2-671b widths, 4 layers (3 dense, 1 MoE), resident.
    DS=$DIR/cogito-4
    synth "$DS" --preset cogito-v2-671b --layers 4
    bench f-mla-4l-1gpu "$DS" --prompt-len $PPL --gen 0
    bench f-mla-4l-2gpu "$DS" --prompt-len $PPL --gen 0 --gpus 0,1
    MOEFLUX_TOKEN_SPLIT=0 bench f-mla-4l-2gpu-expert-split "$DS" --prompt-len $PPL --gen 0 --gpus 0,1
    rm -rf "$DS"
    fi
  fi
fi

echo
echo "| run | prefill tok/s | decode tok/s | expert I/O ms/tok | of roofline | cache hits | MB uploaded/tok | PCIe ceiling tok/s | H2D GB/s | HBM GB/s |"
echo "|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
if has g || has f; then
  echo
  echo "| run | decode tok/s | VRAM hits | host-tier MB/tok | file MB/tok (needed) | read-ahead used/read | seq O_DIRECT GB/s | disk ceiling tok/s | reached | disk + host + resident ms/tok | expert wait ms/tok |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|"
  python3 - "$OUTDIR" <<'EOF'
import json, sys, os
out = sys.argv[1]
for name in sorted(n[:-5] for n in os.listdir(out)
                   if (n.startswith("g-") or n.endswith("-arena.json")) and n.endswith(".json")):
    r = json.load(open(os.path.join(out, name + ".json")))
    t, c = r["decode"], r.get("decode_disk_ceiling") or {}
    f = lambda x, fmt="{:.1f}": "-" if x is None else fmt.format(x)
    print("| " + " | ".join([
        name, f(r["decode_tok_s"]), f(t["gpu_cache_hit_rate"] * 100, "{:.1f}%"),
        f(t["gpu_host_tier_bytes_per_token"] / 1e6),
        f"{t['gpu_file_bytes_per_token'] / 1e6:.1f} ({t['gpu_needed_file_bytes_per_token'] / 1e6:.1f})",
        f"{t['gpu_ahead_used']}/{t['gpu_ahead_reads']}",
        f(r["sequential_direct_gb_s"], "{:.2f}"), f(c.get("tok_s")),
        f(c.get("reached") and c["reached"] * 100, "{:.0f}%"),
        " + ".join(f(c.get(k), "{:.2f}") for k in ("disk_ms_per_token", "host_tier_ms_per_token", "resident_ms_per_token")),
        f(c.get("expert_wait_ms_per_token"), "{:.2f}"),
    ]) + " |")
EOF
fi
if has c; then
  python3 - "$OUTDIR" <<'EOF'
import json, sys, os
for name in ("c-397b-12l-top10", "c-397b-12l-k4", "c-397b-12l-top10-q8"):
    p = os.path.join(sys.argv[1], name + ".json")
    if not os.path.exists(p):
        continue
    r = json.load(open(p))
    tg = r["decode_tok_s"]
    ms_layer = 1e3 / tg / r["layers"]
    print(f"{name}: {ms_layer:.2f} ms per layer -> {1e3 / (ms_layer * 60):.2f} tok/s extrapolated to 60 layers")
EOF
fi
if has d; then
  python3 - "$OUTDIR" <<'EOF'
import json, sys, os
def load(name):
    p = os.path.join(sys.argv[1], name + ".json")
    return json.load(open(p)) if os.path.exists(p) else None
r4, r8 = load("d-cogito-4l-resident"), load("d-cogito-8l-resident")
if r4 and r8:
    # 4 layers = 3 dense + 1 MoE (+ embedding, LM head); each further layer is MoE.
    ms4, ms8 = 1e3 / r4["decode_tok_s"], 1e3 / r8["decode_tok_s"]
    slope = (ms8 - ms4) / 4
    full = ms4 + 57 * slope
    print(f"d resident: {ms4:.2f} ms/token at 4 layers, {ms8:.2f} at 8: {slope:.3f} ms per MoE layer "
          f"-> {full:.1f} ms/token ({1e3 / full:.1f} tok/s) extrapolated to 61 layers")
    if r4.get("prefill_tok_s") and r8.get("prefill_tok_s"):
        p4, p8 = 1e3 / r4["prefill_tok_s"], 1e3 / r8["prefill_tok_s"]
        pf = p4 + 57 * (p8 - p4) / 4
        print(f"d resident prefill: {(p8 - p4) / 4:.3f} ms per MoE layer per token -> "
              f"{1e3 / pf:.1f} tok/s extrapolated to 61 layers")
    for name in ("d-cogito-8l-host", "d-cogito-8l-staging"):
        r = load(name)
        if not r:
            continue
        extra = (1e3 / r["decode_tok_s"] - ms8) / 5
        t = full + 58 * extra
        hit = r["decode"]["gpu_cache_hit_rate"] or 0
        print(f"{name}: +{extra:.2f} ms per MoE layer over resident at a {hit * 100:.1f}% VRAM hit "
              f"rate -> {t / 1e3:.2f} s/token ({1e3 / t:.1f} tok/s) extrapolated to 61 layers")
EOF
  grep -A 30 "GPU time per kernel" "$OUTDIR/d-cogito-8l-profile.log" || true
fi
if has e; then
  python3 - "$OUTDIR" <<'EOF'
import json, sys, os
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name + ".json")
    return json.load(open(p)) if os.path.exists(p) else None
for line in open(os.path.join(out, "e-depths.txt")):
    preset, l1, l2, dense, moe = line.split()
    l1, l2, dense, moe = int(l1), int(l2), int(dense), int(moe)
    a, b = load(f"e-{preset}-{l1}l-resident"), load(f"e-{preset}-{l2}l-resident")
    if not (a and b):
        continue
    # Both depths hold the dense layers; every further layer is MoE.
    ms1, ms2 = 1e3 / a["decode_tok_s"], 1e3 / b["decode_tok_s"]
    slope = (ms2 - ms1) / (l2 - l1)
    full = ms1 + (moe - (l1 - dense)) * slope
    msg = (f"{preset} resident: {ms1:.2f} ms/token at {l1} layers, {ms2:.2f} at {l2}: "
           f"{slope:.3f} ms per MoE layer -> {full:.1f} ms/token ({1e3 / full:.1f} tok/s) "
           f"at {moe} MoE layers")
    if a.get("prefill_tok_s") and b.get("prefill_tok_s"):
        p1, p2 = 1e3 / a["prefill_tok_s"], 1e3 / b["prefill_tok_s"]
        pf = p1 + (moe - (l1 - dense)) * (p2 - p1) / (l2 - l1)
        msg += f"; prefill {1e3 / pf:.0f} tok/s"
    print(msg)
    h = load(f"e-{preset}-{l2}l-host")
    if h:
        extra = (1e3 / h["decode_tok_s"] - ms2) / (l2 - dense)
        t = full + moe * extra
        hit = h["decode"]["gpu_cache_hit_rate"] or 0
        print(f"{preset} host tier: +{extra:.2f} ms per MoE layer over resident at a "
              f"{hit * 100:.1f}% VRAM hit rate -> {t:.1f} ms/token ({1e3 / t:.1f} tok/s) "
              f"at {moe} MoE layers")
EOF
fi
if has f; then
  python3 - "$OUTDIR" <<'EOF'
import json, sys, os
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name + ".json")
    return json.load(open(p)) if os.path.exists(p) else None
one, two = load("f-397b-12l-top10-1gpu"), load("f-397b-12l-top10-2gpu")
if one and two:
    for name, r in (("1 GPU", one), ("2 GPUs", two)):
        ms = 1e3 / r["decode_tok_s"] / r["layers"]
        print(f"f 397B {name}: {ms:.2f} ms per layer -> {1e3 / (ms * 60):.2f} tok/s at 60 layers")
    print(f"f 397B: 2 GPUs / 1 GPU decode = {two['decode_tok_s'] / one['decode_tok_s']:.2f}x")
one, two = load("f-397b-12l-top10-1gpu-arena"), load("f-397b-12l-top10-2gpu-arena")
if one and two:
    print(f"f 397B, host-tier arena + disk: 2 GPUs / 1 GPU decode = "
          f"{two['decode_tok_s'] / one['decode_tok_s']:.2f}x")
a = load("f-a3b-resident-1gpu")
c, e = load("f-a3b-resident-2gpu-sharded"), load("f-a3b-resident-2gpu-eager")
for name, what in (("f-a3b-resident-2gpu", "experts on both GPUs (the default)"),
                   ("f-a3b-resident-4gpu", "4 GPUs, experts on each")):
    b = load(name)
    if a and b:
        print(f"f A3B resident, {what}: decode {b['decode_tok_s'] / a['decode_tok_s']:.2f}x "
              f"one GPU; pp{a['prefill']['tokens']} {b['prefill_tok_s'] / a['prefill_tok_s']:.2f}x")
m1, m2, mx = load("f-mla-4l-1gpu"), load("f-mla-4l-2gpu"), load("f-mla-4l-2gpu-expert-split")
if m1 and m2 and mx:
    print(f"f MLA (cogito widths, 4 layers) pp{m1['prefill']['tokens']}: 2 GPUs split by tokens "
          f"{m2['prefill_tok_s'] / m1['prefill_tok_s']:.2f}x one GPU, by experts only "
          f"{mx['prefill_tok_s'] / m1['prefill_tok_s']:.2f}x")
x = load("f-a3b-resident-2gpu-expert-split")
if a and x:
    print(f"f A3B resident, prefill split by experts only (MOEFLUX_TOKEN_SPLIT=0): "
          f"pp{a['prefill']['tokens']} {x['prefill_tok_s'] / a['prefill_tok_s']:.2f}x one GPU")
for name in os.listdir(out):
    if name.startswith("f-a3b-pp") and name.endswith("-1gpu.json"):
        p1, p2 = load(name[:-5]), load(name[:-10] + "-2gpu")
        if p1 and p2:
            print(f"f A3B resident, pp{p1['prefill']['tokens']}: 2 GPUs "
                  f"{p2['prefill_tok_s']:.0f} / 1 GPU {p1['prefill_tok_s']:.0f} tok/s = "
                  f"{p2['prefill_tok_s'] / p1['prefill_tok_s']:.2f}x")
if a and c:
    print(f"f A3B resident, sharded (--replicate-experts off): decode "
          f"{c['decode_tok_s'] / a['decode_tok_s']:.2f}x one GPU (graphs)"
          + (f", {e['decode_tok_s'] / a['decode_tok_s']:.2f}x eager" if e else "")
          + f"; pp{a['prefill']['tokens']} {c['prefill_tok_s'] / a['prefill_tok_s']:.2f}x")
# A profile's kernels: (name, ms).
def profile(log):
    rows = []
    for line in open(log):
        f = line.split()
        if "ms" in f and "launches" in f:
            rows.append((f[0], float(f[f.index("ms") - 1])))
    return rows
# One GPU's prefill: the routed experts' share of the GPU time, the part an expert split
# divides (every GPU runs the rest: attention, GatedDeltaNet, routers, shared expert, LM head).
log = os.path.join(out, "f-a3b-1gpu-prefill-profile.log")
if os.path.exists(log):
    rows = profile(log)
    total = sum(ms for _, ms in rows)
    routed = sum(ms for k, ms in rows if k.startswith(("moe_gate_up", "moe_down")))
    if total:
        s = routed / total
        print(f"f A3B 1-GPU prefill profile: routed experts {routed:.0f} of {total:.0f} ms GPU time "
              f"({s * 100:.0f}%); splitting only them over 2 GPUs bounds prefill at "
              f"{1 / ((1 - s) + s / 2):.2f}x")
# Split by tokens, every GPU repeats only the mixers' sequence part (rotary and the KV
# append, attention, the conv, the delta rule) and the LM head's rows: its share of one GPU's
# prefill bounds what two GPUs gain.
SEQ = ("attn_prep", "attn_kv_split", "attention", "conv_", "gdn_chunk", "delta_rule")
if os.path.exists(log):
    rows = profile(log)
    total = sum(ms for _, ms in rows)
    seq = sum(ms for k, ms in rows if k.startswith(SEQ))
    if total:
        s = seq / total
        print(f"f A3B 1-GPU prefill profile: the mixers' sequence part {seq:.0f} of {total:.0f} ms "
              f"({s * 100:.0f}%); splitting the rest by tokens over 2 GPUs bounds prefill at "
              f"{1 / (s + (1 - s) / 2):.2f}x")
log = os.path.join(out, "f-a3b-2gpu-prefill-profile.log")
if os.path.exists(log):
    rows = profile(log)
    share = sum(ms for k, ms in rows if k.startswith("nccl_share_rows"))
    total = sum(ms for _, ms in rows)
    if total:
        print(f"f A3B 2-GPU prefill profile (both GPUs' lines): broadcasts of the projections "
              f"{share:.0f} of {total:.0f} ms GPU time ({share / total * 100:.0f}%)")
# The profile's all-reduce line per GPU: name, ms, share of the GPU's time, launches.
log = os.path.join(out, "f-a3b-2gpu-profile.log")
if os.path.exists(log):
    for line in open(log):
        if "nccl_all_reduce" in line:
            print("f all-reduce (per GPU, share of the eager decode's GPU time):", line.strip())
EOF
fi
