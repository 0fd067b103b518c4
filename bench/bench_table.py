#!/usr/bin/env python3
"""Print vs-llama-cpp.sh's table from moeflux bench and llama-bench JSON results.

usage: bench_table.py --model DIR --moeflux RUNS.jsonl --llama-q4_1 A.json --llama-q4_0 B.json
                      [--threads T --reps R --mode warm|cold --repack 0|1 --pp 512 --tg 128]
                      [--fake-moeflux] [--json OUT.json]

RUNS.jsonl: one `moeflux bench --json` object per line (numeric prefill_tok_s, decode_tok_s;
prefill.tok_s_reps / decode.tok_s_reps, when present, give the per-repetition numbers).
A.json/B.json: `llama-bench -o json` output (a list with one entry per test).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path


def fail(msg: str):
    print(f"bench_table: error: {msg}", file=sys.stderr)
    sys.exit(1)


def mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, s


def llama_results(path: Path, pp: int, tg: int) -> dict:
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        fail(f"{path}: not llama-bench JSON ({e})")
    out = {"raw": rows}
    for r in rows:
        if r.get("n_prompt") == pp and r.get("n_gen") == 0:
            out["pp"] = (float(r["avg_ts"]), float(r["stddev_ts"]))
        elif r.get("n_gen") == tg and r.get("n_prompt") == 0:
            out["tg"] = (float(r["avg_ts"]), float(r["stddev_ts"]))
    for k in ("pp", "tg"):
        if k not in out:
            fail(f"{path}: no {k} result for pp{pp}/tg{tg}")
    return out


def moeflux_results(path: Path) -> dict:
    runs = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            o = json.loads(line)
        except json.JSONDecodeError as e:
            fail(f"moeflux bench output {i + 1} is not one JSON object: {e}")
        for k in ("prefill_tok_s", "decode_tok_s"):
            if not isinstance(o.get(k), (int, float)):
                fail(f"moeflux bench output {i + 1} lacks a numeric {k}: {line[:200]}")
        runs.append(o)
    if not runs:
        fail("no moeflux bench results")

    def samples(key: str, test: str) -> list[float]:
        # per-repetition tok/s when moeflux bench reports them (test.tok_s_reps), else the means
        xs: list[float] = []
        for o in runs:
            reps = (o.get(test) or {}).get("tok_s_reps")
            if isinstance(reps, list) and reps and all(isinstance(x, (int, float)) for x in reps):
                xs += [float(x) for x in reps]
            else:
                xs.append(float(o[key]))
        return xs

    return {"runs": runs, "pp": mean_std(samples("prefill_tok_s", "prefill")),
            "tg": mean_std(samples("decode_tok_s", "decode"))}


def mxfp4_experts(manifest: dict) -> bool:
    return any(c.get("quant", {}).get("mode") == "mxfp4"
               for e in manifest.get("experts", []) for c in e.get("components", []))


def native_label(model: Path) -> str:
    """The lossless export's ggml types: Q4_1, or MXFP4 experts + Q4_1 (gpt-oss as released)."""
    try:
        man = json.loads((model / "moeflux.json").read_text())
    except (OSError, json.JSONDecodeError):
        return "Q4_1"
    return "MXFP4+Q4_1" if mxfp4_experts(man) else "Q4_1"


def describe(model: Path) -> str:
    try:
        man = json.loads((model / "moeflux.json").read_text())
        cfg = json.loads((model / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        return f"{model} (unreadable: {e})"
    tc = cfg.get("text_config", cfg)
    size = sum(f.stat().st_size for f in model.rglob("*") if f.is_file())
    bits = "MXFP4" if mxfp4_experts(man) else f"{man.get('source', {}).get('expert_bits')}-bit"
    n_exp = tc.get("num_experts", tc.get("num_local_experts", tc.get("n_routed_experts")))
    return (f"{model.name}: {man.get('architecture')}, {tc.get('num_hidden_layers')} layers, hidden "
            f"{tc.get('hidden_size')}, {n_exp} experts top-{tc.get('num_experts_per_tok')}, "
            f"vocab {tc.get('vocab_size')}, experts {bits}, "
            + (f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB") + " on disk")


def fmt(ms: tuple[float, float]) -> str:
    m, s = ms
    return f"{m:.2f} ± {s:.2f}" if s else f"{m:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--moeflux", type=Path, required=True)
    ap.add_argument("--moeflux-q8", type=Path, help="moeflux runs with --cpu-activations q8 (an extra column)")
    ap.add_argument("--llama-q4_1", type=Path, required=True)
    ap.add_argument("--llama-q4_0", type=Path, help="omitted: no Q4_0 column (MXFP4-expert models)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mode", default="warm")
    ap.add_argument("--repack", default="1")
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--fake-moeflux", action="store_true")
    ap.add_argument("--stats-dir", type=Path, help="directory of run_measured.py *.stats files")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    mf = moeflux_results(a.moeflux)
    m8 = moeflux_results(a.moeflux_q8) if a.moeflux_q8 else None
    q1 = llama_results(a.llama_q4_1, a.pp, a.tg)
    q0 = llama_results(a.llama_q4_0, a.pp, a.tg) if a.llama_q4_0 else None
    info = q1["raw"][0] if q1["raw"] else {}
    lines = [
        f"model: {describe(a.model)}",
        f"threads {a.threads}, {a.reps} repetitions, {a.mode} page cache; llama.cpp "
        f"{info.get('build_commit', '?')} (llama-cpp-python 0.3.36 sdist, no AMX), --repack {a.repack}, "
        f"KV cache {info.get('type_k', '?')}; CPU: {info.get('cpu_info', '?')}",
    ]
    if a.mode == "cold":
        lines.append("cold: llama.cpp loads every weight into memory before it starts timing; moeflux reads "
                     "the routed experts from storage in every repetition")
    if a.fake_moeflux:
        lines.append("NOTE: moeflux numbers are NOT measured (MOEFLUX_BENCH_JSON was set)")
    stats = {}
    if a.stats_dir:
        for f in sorted(a.stats_dir.glob("*.stats")):
            try:
                stats[f.stem] = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError):
                pass
    if stats:
        worst = max(stats.items(), key=lambda kv: kv[1].get("other_cpus", 0))
        lines.append("other processes kept busy on average (CPUs): " + ", ".join(
            f"{k} {v.get('other_cpus', 0):.2f}" for k, v in stats.items()))
        if worst[1].get("other_cpus", 0) > 0.1:
            lines.append(f"WARNING: the machine was not idle (up to {worst[1]['other_cpus']:.2f} CPUs used by other "
                         f"processes during {worst[0]}): these numbers are noisy")
    nat = native_label(a.model)
    # Columns: (header, value per test key), moeflux's first, then llama.cpp's, then ratios.
    peers = [(f"llama.cpp {nat}", q1)] + ([("llama.cpp Q4_0", q0)] if q0 else [])
    ours = [("moeflux", mf)] + ([("moeflux q8", m8)] if m8 else [])
    ratio_cols = [(o, p) for o in ours for p in peers]
    head = [f"{n} tok/s" for n, _ in ours + peers] + [f"{o[0]} / {p[0].removeprefix('llama.cpp ')}"
                                                       for o, p in ratio_cols]
    lines += ["", "| test | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    rows = []
    for key, name in (("pp", f"pp{a.pp}"), ("tg", f"tg{a.tg}")):
        cells = [fmt(r[key]) for _, r in ours + peers]
        row = {"test": name, "moeflux_tok_s": mf[key], "llama_q4_1_tok_s": q1[key]}
        if q0:
            row["llama_q4_0_tok_s"] = q0[key]
        if m8:
            row["moeflux_q8_tok_s"] = m8[key]
        for (on, o), (pn, p) in ratio_cols:
            r = o[key][0] / p[key][0] if p[key][0] else float("nan")
            cells.append(f"{r:.2f}")
            suffix = "q4_0" if pn.endswith("Q4_0") else "q4_1"
            row[("ratio_q8_" if on.endswith("q8") else "ratio_") + suffix] = r
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        rows.append(row)
    lines += ["", f"{nat} = moeflux's weights repacked losslessly (identical weights: affine 4-bit as Q4_1, "
              "MXFP4 as MXFP4)" + (f"; Q4_0 = llama-quantize's standard Q4_0 recipe from that {nat}" if q0 else "")
              + ". Ratios > 1: moeflux is faster."]
    print("\n".join(lines))
    if a.json:
        res = {"model": str(a.model), "description": describe(a.model), "threads": a.threads, "reps": a.reps,
               "mode": a.mode, "repack": a.repack, "moeflux_fake": a.fake_moeflux, "rows": rows,
               "moeflux_runs": mf["runs"], "moeflux_q8_runs": m8["runs"] if m8 else None, "llama_q4_1": q1["raw"], "llama_q4_0": q0["raw"] if q0 else None,
               "other_cpu": stats}
        a.json.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=a.json.name + ".", dir=a.json.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
