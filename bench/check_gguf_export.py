#!/usr/bin/env python3
"""Show that bench/moeflux2gguf.py writes the same model llama.cpp runs (run by hand, not in CI).

usage (after bench/setup.sh and `cargo build --release -p moeflux-cli`):

    target/bench/venv/bin/python bench/check_gguf_export.py [--fixture tests/fixtures/qwen35moe-q4]
    target/bench/venv/bin/python bench/check_gguf_export.py --model-dir DIR [--tokens 1,2,3]
        [--tol 1e-3] [--keep DIR]
    ... [--mxfp4-experts] [--repack-only]

Fixtures: qwen35moe-q4 (default), qwen3next-q4, gptoss-q4 (llama.cpp arch gpt-oss).
--mxfp4-experts: after step 1, the model's routed experts are replaced by seeded random MXFP4
    ones (bench/mxfp4_experts.py, docs/FORMAT.md's layout), so the export writes them as ggml
    MXFP4 (gpt-oss's experts as released); the reference is then `moeflux logits` (the golden
    belongs to the original experts).
--repack-only: steps 1-3 only (no llama.cpp, no logits).

Steps:
  1. `moeflux convert FIXTURE/src TMP/model`. With --model-dir DIR instead, DIR is exported and
     the reference in step 4 is `moeflux logits` on DIR (moeflux itself matches mlx-lm to ~1e-4
     on the fixtures), for models that have no golden, e.g. real-width random ones.
  2. Export TMP/model as --type f32 and as --type q4_1.
  3. Repack check: every tensor of the Q4_1 export (Q4_1, MXFP4 and F32 tensors), dequantized
     with gguf-py's own ggml dequantizer, must equal the F32 export's tensor bit for bit (max
     |diff| = 0; for MXFP4, moeflux's -0 code reads as +0 in ggml and is compared as such), and
     every tensor name, shape and count must agree.
  4. llama.cpp check: the F32 GGUF runs in llama.cpp (the llama-cpp-python 0.3.36 bindings on the
     bench/setup.sh build) on the fixture's 32 golden tokens, with an f32 KV cache, no flash
     attention and no extra buffer types (use_extra_bufts=False; the repack/AMX buffers crash on
     tiny models, oracle.md section 4); every position's logits are compared with
     golden_logits.npy (mlx-lm, dequantized weights, f32). Fails when max |diff| > --tol. The
     same tokens also go through `moeflux logits`, and through llama.cpp with its default f16
     KV cache (about 1e-2 worse, oracle.md), for reference. The Q4_1 GGUF is run too, for
     information only: llama.cpp quantizes activations to Q8_1 for Q4_x matmuls, which random
     tiny models amplify (oracle.md), so its gap says nothing about the repack.

Exit status 0 when both checks pass. Prints one JSON summary line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CACHE = Path(os.environ.get("MOEFLUX_BENCH_CACHE", REPO / "target" / "bench"))
SDIST_DIR = CACHE / "src" / "llama_cpp_python-0.3.36"
LIB_DIR = CACHE / "llama.cpp-build" / "bin"


def fail(msg: str) -> None:
    print(f"check_gguf_export: error: {msg}", file=sys.stderr)
    sys.exit(1)


def load_llama_cpp():
    if not (LIB_DIR / "libllama.so").is_file() or not (SDIST_DIR / "llama_cpp").is_dir():
        fail(f"llama.cpp is not built under {CACHE}; run bench/setup.sh first")
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(LIB_DIR))
    sys.path.insert(0, str(SDIST_DIR))
    import llama_cpp  # noqa: E402
    import llama_cpp.llama as ll  # noqa: E402

    orig = llama_cpp.llama_model_default_params

    def no_extra_bufts():  # == llama-bench --repack 0
        p = orig()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = no_extra_bufts
    ll.llama_cpp.llama_model_default_params = no_extra_bufts
    return ll.Llama


def llama_logits(Llama, gguf_path: Path, tokens: list[int], kv_f32: bool = True) -> np.ndarray:
    kv = dict(type_k=0, type_v=0, flash_attn=False) if kv_f32 else {}  # 0 = GGML_TYPE_F32
    llm = Llama(model_path=str(gguf_path), n_ctx=max(64, len(tokens)), n_batch=max(64, len(tokens)),
                logits_all=True, n_threads=2, verbose=False, **kv)
    llm.eval(tokens)
    out = np.array(llm.scores[:len(tokens)], dtype=np.float32)
    llm.close()
    return out


def repack_check(f32_path: Path, q41_path: Path) -> dict:
    import gguf

    a = {t.name: t for t in gguf.GGUFReader(f32_path).tensors}
    b = {t.name: t for t in gguf.GGUFReader(q41_path).tensors}
    if set(a) != set(b):
        fail(f"tensor names differ: only in F32 {sorted(set(a) - set(b))[:5]}, only in Q4_1 {sorted(set(b) - set(a))[:5]}")
    n_q41, n_mx, worst, elems = 0, 0, 0.0, 0
    for name, ta in a.items():
        tb = b[name]
        if list(ta.shape) != list(tb.shape):
            fail(f"{name}: shape {list(ta.shape)} (F32) vs {list(tb.shape)} (Q4_1)")
        if ta.tensor_type != gguf.GGMLQuantizationType.F32:
            fail(f"{name}: F32 export holds a {ta.tensor_type.name} tensor")
        va = np.asarray(ta.data, dtype=np.float32)
        if tb.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            n_q41 += 1
            vb = gguf.quants.dequantize(np.asarray(tb.data), tb.tensor_type)
        elif tb.tensor_type == gguf.GGMLQuantizationType.MXFP4:
            n_mx += 1
            vb = gguf.quants.dequantize(np.asarray(tb.data), tb.tensor_type)
            # ggml's table has no -0 (moeflux's code 8): compare with -0 read as +0
            va = va + np.float32(0)
        elif tb.tensor_type == gguf.GGMLQuantizationType.F32:
            vb = np.asarray(tb.data, dtype=np.float32)
        else:
            fail(f"{name}: unexpected type {tb.tensor_type.name} in the Q4_1/MXFP4 export")
        vb = vb.reshape(va.shape)
        if not np.array_equal(va.view(np.uint32), vb.view(np.uint32)):
            d = float(np.max(np.abs(va - vb)))
            fail(f"{name}: {tb.tensor_type.name} dequantized != F32 export (max |diff| {d})")
        worst = max(worst, float(np.max(np.abs(va - vb))) if va.size else 0.0)
        elems += va.size
    return {"tensors": len(a), "q4_1_tensors": n_q41, "mxfp4_tensors": n_mx, "elements": int(elems),
            "max_abs_diff": worst, "bitwise_equal": True}


def run_moeflux_logits(moeflux: Path, model: Path, tokens: list[int], out: Path) -> np.ndarray | None:
    r = subprocess.run([str(moeflux), "logits", "--model", str(model), "--tokens", ",".join(map(str, tokens)),
                        "--output", str(out)], capture_output=True, text=True)
    if r.returncode:
        print(f"(moeflux logits failed: {r.stderr.strip()})")
        return None
    return np.load(out)


def compare(name: str, got: np.ndarray, ref: np.ndarray) -> dict:
    if got.shape != ref.shape:
        fail(f"{name}: logits shape {got.shape} != reference {ref.shape}")
    d = np.abs(got - ref)
    return {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()),
            "argmax_agree": float((got.argmax(-1) == ref.argmax(-1)).mean())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixture", type=Path, default=REPO / "tests" / "fixtures" / "qwen35moe-q4",
                    help="fixture with src/, golden.json and golden_logits.npy (default qwen35moe-q4)")
    ap.add_argument("--model-dir", type=Path,
                    help="check this moeflux model directory instead, against `moeflux logits` (no golden)")
    ap.add_argument("--tokens", help="comma-separated token ids for --model-dir (default: 32 fixed ids)")
    ap.add_argument("--moeflux", type=Path, default=REPO / "target" / "release" / "moeflux")
    ap.add_argument("--tol", type=float, default=1e-3, help="max |logit diff| allowed (default 1e-3)")
    ap.add_argument("--keep", type=Path, help="keep the GGUFs in this directory")
    ap.add_argument("--mxfp4-experts", action="store_true",
                    help="replace the routed experts by random MXFP4 ones first (reference: moeflux)")
    ap.add_argument("--repack-only", action="store_true", help="only the export and repack checks")
    args = ap.parse_args()

    if not args.moeflux.is_file():
        fail(f"{args.moeflux} not found; run `cargo build --release -p moeflux-cli`")
    golden = ref = None
    if args.model_dir is None and not args.mxfp4_experts:
        golden_json = args.fixture / "golden.json"
        if not golden_json.is_file():
            fail(f"{golden_json} not found")
        golden = json.loads(golden_json.read_text())
        tokens = [int(t) for t in golden["tokens"]]
        ref = np.load(args.fixture / golden.get("logits_file", "golden_logits.npy"))
        ref_name = "golden"
    else:
        if args.model_dir is not None and not (args.model_dir / "moeflux.json").is_file():
            fail(f"{args.model_dir} is not a moeflux model directory")
        if args.model_dir is not None:
            cfg = json.loads((args.model_dir / "config.json").read_text())
        else:
            src = args.fixture / json.loads((args.fixture / "golden.json").read_text()).get("checkpoint", "src")
            cfg = json.loads((src / "config.json").read_text())
        vocab = int(cfg.get("text_config", cfg)["vocab_size"])
        tokens = ([int(t) for t in args.tokens.split(",")] if args.tokens
                  else [(i * 7919 + 11) % vocab for i in range(32)])
        ref_name = "moeflux"

    Llama = None if args.repack_only else load_llama_cpp()
    work = Path(tempfile.mkdtemp(prefix="moeflux-gguf-check."))
    try:
        if args.model_dir:
            model = args.model_dir
        else:
            model = work / "model"
            src = args.fixture / json.loads((args.fixture / "golden.json").read_text()).get("checkpoint", "src")
            r = subprocess.run([str(args.moeflux), "convert", str(src), str(model)], capture_output=True, text=True)
            if r.returncode:
                fail(f"moeflux convert failed: {r.stderr.strip()}")
        if args.mxfp4_experts:
            mx = work / "model-mxfp4"
            r = subprocess.run([sys.executable, str(HERE / "mxfp4_experts.py"), str(model), str(mx)],
                               capture_output=True, text=True)
            if r.returncode:
                fail(f"mxfp4_experts.py failed: {r.stderr.strip()}")
            model = mx
        paths = {}
        for t in ("f32", "q4_1"):
            paths[t] = work / f"model-{t}.gguf"
            r = subprocess.run([sys.executable, str(HERE / "moeflux2gguf.py"), str(model), str(paths[t]),
                                "--type", t, "--quiet"], capture_output=True, text=True)
            if r.returncode:
                fail(f"moeflux2gguf --type {t} failed: {r.stderr.strip()}")
        res = {"model": str(args.model_dir or args.fixture), "reference": ref_name, "tokens": len(tokens),
               "mxfp4_experts": args.mxfp4_experts}
        res["repack"] = rep = repack_check(paths["f32"], paths["q4_1"])
        print(f"repack: {rep['tensors']} tensors ({rep['q4_1_tensors']} Q4_1, {rep['mxfp4_tensors']} MXFP4), "
              f"{rep['elements']} values: dequantized == F32 export bit for bit")
        if args.mxfp4_experts and rep["mxfp4_tensors"] == 0:
            fail("--mxfp4-experts: the export holds no MXFP4 tensor")
        if args.repack_only:
            print(json.dumps(res))
            print("check_gguf_export: PASS (repack only)")
            return 0

        ml = run_moeflux_logits(args.moeflux, model, tokens, work / "moeflux.npy")
        if ref is None:
            if ml is None:
                fail("no reference logits (moeflux logits failed" +
                     ("; does this moeflux read MXFP4 experts yet?)" if args.mxfp4_experts else ")"))
            ref = ml
        res["max_abs_reference_logit"] = float(np.abs(ref).max())

        lg = llama_logits(Llama, paths["f32"], tokens)
        res["llama_f32"] = c = compare("llama.cpp F32", lg, ref)
        print(f"llama.cpp F32 GGUF (f32 KV) vs {ref_name}: max |diff| {c['max_abs_diff']:.3g}, mean "
              f"{c['mean_abs_diff']:.3g}, argmax agree {c['argmax_agree']:.0%} "
              f"(max |logit| {res['max_abs_reference_logit']:.3g})")
        if golden is not None and ml is not None:
            res["moeflux_vs_golden_max_abs_diff"] = float(np.abs(ml - ref).max())
            res["llama_f32_vs_moeflux_max_abs_diff"] = float(np.abs(lg - ml).max())
            print(f"(info) moeflux vs golden: max |diff| {res['moeflux_vs_golden_max_abs_diff']:.3g}; "
                  f"llama.cpp F32 vs moeflux: {res['llama_f32_vs_moeflux_max_abs_diff']:.3g}")

        res["llama_f32_f16kv"] = c16 = compare("llama.cpp F32, f16 KV", llama_logits(Llama, paths["f32"], tokens, False), ref)
        print(f"(info) the same with llama.cpp's default f16 KV cache: max |diff| {c16['max_abs_diff']:.3g}")
        res["llama_q4_1"] = cq = compare("llama.cpp Q4_1", llama_logits(Llama, paths["q4_1"], tokens), ref)
        print(f"(info) llama.cpp Q4_1 GGUF vs {ref_name}: max |diff| {cq['max_abs_diff']:.3g}, argmax agree "
              f"{cq['argmax_agree']:.0%} (Q8_1 activations; not a repack error)")
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            for p in paths.values():
                shutil.copy2(p, args.keep / p.name)
        ok = c["max_abs_diff"] <= args.tol
        res["pass"] = bool(ok)
        print(json.dumps(res))
        if not ok:
            fail(f"llama.cpp F32 vs {ref_name} max |diff| {c['max_abs_diff']:.3g} > --tol {args.tol}")
        print("check_gguf_export: PASS")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
