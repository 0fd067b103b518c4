#!/usr/bin/env python3
"""Copy a moeflux model directory with its routed experts replaced by seeded random MXFP4 ones.

usage: mxfp4_experts.py SRC DST [--seed S] [--force]

Test data for bench/moeflux2gguf.py's MXFP4 path (gpt-oss's experts as released): every expert
component of SRC (gate_proj, up_proj, down_proj of every MoE layer) gets random e2m1 codes (all
16, -0 included) and random e8m0 scales (2^-9 .. 2^-5, so the model stays numerically tame),
laid out exactly as docs/FORMAT.md defines MXFP4 in an expert file: `weight` U32 `[rows, cols/8]`
(element j at bits [4j, 4j+4), LSB first), `scales` U8 `[rows, cols/32]`, no `biases`, each
piece 64-byte aligned, a stride that is a multiple of 4096, and the component's `quant`
`{"bits": 4, "group_size": 32, "mode": "mxfp4"}`. Everything else (dense file, config,
tokenizer) is copied unchanged. DST is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

ALIGN, PAGE = 64, 4096


def up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def rewrite(src: Path, dst: Path, seed: int) -> dict:
    manifest = json.loads((src / "moeflux.json").read_text())
    rng = np.random.default_rng(seed)
    n_comp = 0
    for e in manifest["experts"]:
        comps, off = [], 0
        for c in e["components"]:
            rows, cols = int(c["rows"]), int(c["cols"])
            if cols % 32:
                raise SystemExit(f"mxfp4_experts: layer {e['layer']} {c['name']}: cols {cols} is not a "
                                 "multiple of 32")
            w_bytes, s_bytes = rows * cols // 2, rows * cols // 32
            w_off = off
            s_off = up(w_off + w_bytes, ALIGN)
            off = up(s_off + s_bytes, ALIGN)
            comps.append({"name": c["name"], "rows": rows, "cols": cols,
                          "quant": {"bits": 4, "group_size": 32, "mode": "mxfp4"},
                          "weight": {"dtype": "U32", "offset": w_off, "bytes": w_bytes},
                          "scales": {"dtype": "U8", "offset": s_off, "bytes": s_bytes}})
        expert_bytes = comps[-1]["scales"]["offset"] + comps[-1]["scales"]["bytes"]
        stride = up(expert_bytes, PAGE)
        n = int(e["num_experts"])
        buf = np.zeros((n, stride), dtype=np.uint8)
        for c in comps:
            w, s = c["weight"], c["scales"]
            buf[:, w["offset"]:w["offset"] + w["bytes"]] = rng.integers(0, 256, (n, w["bytes"]), dtype=np.uint8)
            buf[:, s["offset"]:s["offset"] + s["bytes"]] = rng.integers(118, 123, (n, s["bytes"]), dtype=np.uint8)
            n_comp += 1
        (dst / e["file"]).write_bytes(buf.tobytes())
        e.update(expert_bytes=expert_bytes, stride=stride, components=comps)
    (dst / "moeflux.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return {"layers": len(manifest["experts"]), "components": n_comp}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="replace DST if it exists")
    args = ap.parse_args(argv)
    if not (args.src / "moeflux.json").is_file():
        print(f"mxfp4_experts: error: {args.src} is not a moeflux model directory", file=sys.stderr)
        return 1
    if args.dst.exists() and not args.force:
        print(f"mxfp4_experts: error: {args.dst} exists (use --force)", file=sys.stderr)
        return 1
    tmp = args.dst.with_name(f".{args.dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(args.src, tmp)
    try:
        info = rewrite(args.src, tmp, args.seed)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(args.dst, ignore_errors=True)
    tmp.rename(args.dst)
    print(json.dumps({"out": str(args.dst), **info}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
