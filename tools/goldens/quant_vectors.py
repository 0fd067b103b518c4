#!/usr/bin/env python3
"""Writes tests/fixtures/quant/quant_vectors.safetensors: `mx.quantize` outputs
for the Rust quantizer's bit-exactness test (crates/moeflux/tests/quant_mlx.rs).

    /work/venv-mlx/bin/python tools/goldens/quant_vectors.py [--out PATH]

For every bits in {2,3,4,5,6,8} x group size {32,64,128}, key prefix
`b{bits}_g{gs}_f32`:
  .input   F32 [10, 256]  weights (rows 0-4 normal*0.05, then special rows)
  .weight  U32 [10, 256*bits/32]   mx.quantize packed codes
  .scales  F32 [10, 256/gs]
  .biases  F32 [10, 256/gs]
  .y       F32 [3, 10]    mx.dequantize(weight, scales, biases) @ x.T
and for bits {2,4,8}, group 64, prefix `b{bits}_g64_bf16`: the same with a BF16
input, whose scales/biases mx.quantize returns as BF16 (y is computed from the
scales/biases upcast to f32). `x` F32 [3, 256] is shared.

Deterministic (fixed numpy seeds); rerunning reproduces the file bit for bit
with mlx 0.32.4.
"""

import argparse
import os

import mlx.core as mx
import numpy as np

ROWS, COLS, TOKENS = 10, 256, 3


def input_matrix(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((ROWS, COLS)) * 0.05).astype(np.float32)
    w[5] = np.linspace(-1, 1, COLS, dtype=np.float32)  # the oracle.md example row
    w[6] = np.float32(-0.7)  # all equal: max == min, scale clamps to 1e-7
    w[7, ::2] = 0.0  # half zeros
    w[7, :37] = 0.0
    w[8] = 0.0  # all zeros
    w[9] = (rng.standard_normal(COLS) * 1e-9).astype(np.float32)  # range below 1e-7
    # A few exact ties at the edges of groups and repeated extremes.
    w[4, 10] = w[4, 11] = w[4].max()
    return w


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    default = os.path.join(here, "..", "..", "tests", "fixtures", "quant", "quant_vectors.safetensors")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.normpath(default))
    args = ap.parse_args()

    x = (np.random.default_rng(12345).standard_normal((TOKENS, COLS))).astype(np.float32)
    xm = mx.array(x)
    out = {"x": xm}
    seed = 100
    cases = [(b, g, "f32") for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]
    cases += [(b, 64, "bf16") for b in (2, 4, 8)]
    for bits, gs, dt in cases:
        seed += 1
        w = mx.array(input_matrix(seed))
        if dt == "bf16":
            w = w.astype(mx.bfloat16)
        wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
        assert wq.dtype == mx.uint32 and s.dtype == w.dtype and b.dtype == w.dtype
        wd = mx.dequantize(
            wq, s.astype(mx.float32), b.astype(mx.float32), group_size=gs, bits=bits
        )
        assert wd.dtype == mx.float32
        y = xm @ wd.T
        key = f"b{bits}_g{gs}_{dt}"
        out[f"{key}.input"] = w
        out[f"{key}.weight"] = wq
        out[f"{key}.scales"] = s
        out[f"{key}.biases"] = b
        out[f"{key}.y"] = y
    mx.eval(out)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    mx.save_safetensors(args.out, out, metadata={"generator": "tools/goldens/quant_vectors.py", "mlx": mx.__version__})
    print(f"wrote {args.out}: {len(out)} tensors, {os.path.getsize(args.out)} bytes")


if __name__ == "__main__":
    main()
