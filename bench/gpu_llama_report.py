#!/usr/bin/env python3
"""Helpers of bench/gpu-llama.sh (llama.cpp's CUDA build on a moeflux model exported as GGUF).

  gpu_llama_report.py plan GGUF [--budget-gib G | --expert-budget-gib E] [--n-cpu-moe N ...]
      Prints, for each --n-cpu-moe N (and for the smallest N whose estimate fits in G GiB), the
      bytes of weights llama.cpp keeps on the GPU with -ngl 99. With --budget-gib, the last line
      of stdout is that N alone (the shell script reads it). --expert-budget-gib E instead picks
      the smallest N whose routed experts left on the GPU take at most E GiB (the other weights
      on top), which is what moeflux's `--gpu-memory E` gives its expert cache.
  gpu_llama_report.py report --gguf GGUF --model DIR --out-json FILE RUN...
      RUN is NAME:N_CPU_MOE:BENCH_JSON:VRAM_SAMPLES (VRAM_SAMPLES may be empty: not measured).
      Prints a markdown table on stdout and writes every raw result to FILE.

The estimate: llama.cpp with every layer offloaded (-ngl 99) keeps all tensors on the GPU except
the token embedding (always in host memory, it is only read by get_rows) and, with --n-cpu-moe N,
the routed-expert tensors of layers 0..N-1 (blk.I.ffn_{up,down,gate,gate_up}_(ch)exps, the
pattern llama-bench uses). KV cache, recurrent state and compute buffers come on top; the
measured peak (nvidia-smi memory.used during the run, minus the value before it) includes them
and the CUDA context.

Needs numpy and gguf (gpu-llama.sh puts the staged gguf-py on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

try:
    import gguf
except ImportError:
    sys.exit("gpu_llama_report: error: the Python package `gguf` is missing (PYTHONPATH=gpu-stage/llama/gguf-py)")

GIB = 1024 ** 3
EXPS = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps\b")


def weight_label(path: Path) -> str:
    """The export's quantized types: Q4_1, or MXFP4 experts + Q4_1 (gpt-oss as released)."""
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors} - {"F32"}
    return "+".join(sorted(types, key=lambda t: t != "MXFP4")) or "F32"


def tensor_bytes(path: Path) -> tuple[dict[str, int], int]:
    r = gguf.GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in r.tensors}
    n_layer = None
    for key, field in r.fields.items():
        if key.endswith(".block_count"):
            n_layer = int(field.parts[field.data[0]][0])
    if n_layer is None:
        n_layer = 1 + max((int(m.group(1)) for n in sizes if (m := EXPS.match(n))), default=-1)
    return sizes, n_layer


def gpu_weight_bytes(sizes: dict[str, int], n_cpu_moe: int, experts_only: bool = False) -> int:
    total = 0
    for name, b in sizes.items():
        if name == "token_embd.weight":
            continue
        m = EXPS.match(name)
        if m and int(m.group(1)) < n_cpu_moe:
            continue
        if experts_only and not m:
            continue
        total += b
    return total


def cmd_plan(a) -> int:
    sizes, n_layer = tensor_bytes(Path(a.gguf))
    total = sum(sizes.values())
    exps = sum(b for n, b in sizes.items() if EXPS.match(n))
    print(f"GGUF {a.gguf}: {total / GIB:.2f} GiB of tensors, {n_layer} layers, routed experts "
          f"{exps / GIB:.2f} GiB ({exps / max(n_layer, 1) / GIB:.3f} GiB a layer), token embedding "
          f"{sizes.get('token_embd.weight', 0) / GIB:.2f} GiB (stays in host memory)")
    for n in a.n_cpu_moe:
        print(f"  --n-cpu-moe {n}: weights on the GPU {gpu_weight_bytes(sizes, n) / GIB:.2f} GiB (estimate)")
    if a.budget_gib is not None and a.expert_budget_gib is not None:
        print("gpu_llama_report: error: give --budget-gib or --expert-budget-gib, not both", file=sys.stderr)
        return 1
    if a.budget_gib is not None or a.expert_budget_gib is not None:
        experts_only = a.expert_budget_gib is not None
        g = a.expert_budget_gib if experts_only else a.budget_gib
        what = "routed experts" if experts_only else "weights"
        pick = None
        for n in range(0, n_layer + 1):
            if gpu_weight_bytes(sizes, n, experts_only) <= g * GIB:
                pick = n
                break
        if pick is None:
            print(f"gpu_llama_report: error: even with every layer's experts on the CPU the weights on "
                  f"the GPU ({gpu_weight_bytes(sizes, n_layer) / GIB:.2f} GiB) exceed {g} GiB",
                  file=sys.stderr)
            return 1
        print(f"  budget {g} GiB of {what} -> --n-cpu-moe {pick}: weights on the GPU "
              f"{gpu_weight_bytes(sizes, pick) / GIB:.2f} GiB, of which routed experts "
              f"{gpu_weight_bytes(sizes, pick, True) / GIB:.2f} GiB (estimate)")
        print(pick)
    return 0


def fmt_ts(t: dict | None) -> str:
    if not t:
        return "-"
    return f"{t['avg_ts']:.2f} ± {t['stddev_ts']:.2f}"


def cmd_report(a) -> int:
    sizes, n_layer = tensor_bytes(Path(a.gguf))
    runs = []
    for spec in a.runs:
        name, ncmoe, bench_json, vram = spec.split(":", 3)
        ncmoe = int(ncmoe)
        with open(bench_json) as f:
            rows = json.load(f)
        if not rows:
            print(f"gpu_llama_report: error: {bench_json} holds no results", file=sys.stderr)
            return 1
        pp = next((r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0), None)
        tg = next((r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0), None)
        peak = None
        if vram and Path(vram).is_file():
            vals = [float(x) for x in Path(vram).read_text().split() if re.fullmatch(r"[0-9.]+", x)]
            if len(vals) >= 2:
                peak = (max(vals[1:]) - vals[0]) * 1024 * 1024  # MiB; the first value is the baseline
        runs.append({
            "name": name, "n_cpu_moe": ncmoe,
            "gpu_weight_bytes_est": gpu_weight_bytes(sizes, ncmoe),
            "peak_vram_bytes": peak,
            "pp": {k: pp[k] for k in ("n_prompt", "avg_ts", "stddev_ts", "samples_ts")} if pp else None,
            "tg": {k: tg[k] for k in ("n_gen", "avg_ts", "stddev_ts", "samples_ts")} if tg else None,
            "llama_bench": rows,
        })
    first = runs[0]["llama_bench"][0]
    pp_n = next((r["pp"]["n_prompt"] for r in runs if r["pp"]), 0)
    tg_n = next((r["tg"]["n_gen"] for r in runs if r["tg"]), 0)
    fa = {-1: "auto", 0: "off", 1: "on"}.get(first.get("flash_attn"), first.get("flash_attn"))
    print(f"model: {a.model} -> {Path(a.gguf).name} ({Path(a.gguf).stat().st_size / GIB:.2f} GiB, "
          f"{n_layer} layers, {first.get('model_type', '?')})")
    print(f"llama.cpp {first.get('build_commit', '?')} ({first.get('backends', '?')}); GPU: "
          f"{first.get('gpu_info') or 'none'}; CPU: {first.get('cpu_info', '?')}")
    print(f"llama-bench: -ngl {first.get('n_gpu_layers')} -t {first.get('n_threads')} -fa {fa} "
          f"-b {first.get('n_batch')} -ub {first.get('n_ubatch')} KV {first.get('type_k')}/{first.get('type_v')}, "
          f"{len(runs[0]['pp']['samples_ts']) if runs[0]['pp'] else '?'} repetitions (mean ± std)")
    print()
    print(f"| llama.cpp {first.get('backends', '?')}, {weight_label(Path(a.gguf))} | --n-cpu-moe | weights on GPU (GiB, est.) | peak VRAM (GiB) | "
          f"pp{pp_n} tok/s | tg{tg_n} tok/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in runs:
        peak = f"{r['peak_vram_bytes'] / GIB:.2f}" if r["peak_vram_bytes"] is not None else "-"
        print(f"| {r['name']} | {r['n_cpu_moe']} | {r['gpu_weight_bytes_est'] / GIB:.2f} | {peak} | "
              f"{fmt_ts(r['pp'])} | {fmt_ts(r['tg'])} |")
    out = {"model": str(a.model), "gguf": str(a.gguf), "n_layer": n_layer, "runs": runs}
    Path(a.out_json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("gguf")
    p.add_argument("--budget-gib", type=float)
    p.add_argument("--expert-budget-gib", type=float)
    p.add_argument("--n-cpu-moe", type=int, nargs="*", default=[])
    r = sub.add_parser("report")
    r.add_argument("--gguf", required=True)
    r.add_argument("--model", required=True)
    r.add_argument("--out-json", required=True)
    r.add_argument("runs", nargs="+")
    a = ap.parse_args(argv)
    return cmd_plan(a) if a.cmd == "plan" else cmd_report(a)


if __name__ == "__main__":
    sys.exit(main())
