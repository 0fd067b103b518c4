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

MXFP4 (crates/moeflux/tests/quant_mlx.rs, `mxfp4_*`), prefix `mxfp4_{name}`:
  .codes    U32 [rows, cols/8]   packed e2m1 codes (mlx layout)
  .scales   U8  [rows, cols/32]  e8m0 scales
  .blocks   U8  [rows, cols/32, 16]  the Hugging Face `*_blocks` layout the
            codes were made from (case `random`), or the codes' bytes
  .dequant  F32 [rows, cols]     mx.dequantize(.., mode="mxfp4", dtype=float32)
  .y        F32 [MX_TOKENS, rows]  mx.quantized_matmul(mx_x, codes, scales,
            mode="mxfp4") in float32
with `mx_x` F32 [MX_TOKENS, cols] per case as `mxfp4_{name}.x`. Cases:
`quantized` (mx.quantize of normal weights, 6 x 256), `random` (uniform
random block bytes, so every code including -0, scales 100..150, row 1 with
scales 0 and 254, 7 x 2880). The script also checks transformers'
`convert_moe_packed_tensors` decoding of the blocks against mx.dequantize.

Deterministic (fixed numpy seeds); rerunning reproduces the file bit for bit
with mlx 0.32.4.
"""

import argparse
import os

import mlx.core as mx
import numpy as np

ROWS, COLS, TOKENS = 10, 256, 3
MX_TOKENS = 5

# transformers' FP4_VALUES (gpt-oss), by e2m1 code.
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def hf_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' convert_moe_packed_tensors (before its transpose), in
    float32: lut[lo nibble] at 0::2, lut[hi nibble] at 1::2, ldexp(scale-127)."""
    lut = np.array(FP4_VALUES, dtype=np.float32)
    rows, groups, _ = blocks.shape
    out = np.empty((rows, groups, 32), dtype=np.float32)
    out[:, :, 0::2] = lut[blocks & 0x0F]
    out[:, :, 1::2] = lut[blocks >> 4]
    with np.errstate(over="ignore"):  # scale 254 x 6 overflows, as in mlx
        out = np.ldexp(out, scales.astype(np.int32)[:, :, None] - 127)
    return out.reshape(rows, groups * 32)


def mxfp4_cases(out: dict) -> None:
    rng = np.random.default_rng(777)
    cases = []
    # mx.quantize of normal weights.
    w = mx.array((rng.standard_normal((6, 256)) * 0.05).astype(np.float32))
    codes, scales = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
    assert codes.dtype == mx.uint32 and scales.dtype == mx.uint8
    codes, scales = np.array(codes), np.array(scales)
    cases.append(("quantized", codes, scales, codes.view(np.uint8).reshape(6, 256 // 32, 16)))
    # Random Hugging Face blocks: every code, negative zero included.
    rows, cols = 7, 2880
    blocks = rng.integers(0, 256, size=(rows, cols // 32, 16), dtype=np.uint8)
    scales = rng.integers(100, 151, size=(rows, cols // 32), dtype=np.uint8)
    scales[1, 3] = 0
    scales[1, 7] = 254
    scales[1, 8] = 0
    codes = blocks.reshape(rows, cols // 2).view("<u4").reshape(rows, cols // 8)
    cases.append(("random", codes, scales, blocks))
    for name, codes, scales, blocks in cases:
        rows, cols = codes.shape[0], codes.shape[1] * 8
        d = mx.dequantize(
            mx.array(codes), mx.array(scales), group_size=32, bits=4, mode="mxfp4", dtype=mx.float32
        )
        assert d.dtype == mx.float32
        d = np.array(d)
        hf = hf_decode(blocks, scales)
        assert np.array_equal(hf.view(np.uint32), d.view(np.uint32)), f"{name}: HF decode != mlx"
        x = rng.standard_normal((MX_TOKENS, cols)).astype(np.float32)
        y = mx.quantized_matmul(
            mx.array(x), mx.array(codes), mx.array(scales),
            transpose=True, group_size=32, bits=4, mode="mxfp4",
        )
        assert y.dtype == mx.float32
        key = f"mxfp4_{name}"
        out[f"{key}.codes"] = mx.array(codes)
        out[f"{key}.scales"] = mx.array(scales)
        out[f"{key}.blocks"] = mx.array(blocks)
        out[f"{key}.dequant"] = mx.array(d)
        out[f"{key}.x"] = mx.array(x)
        out[f"{key}.y"] = y


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
    mxfp4_cases(out)
    mx.eval(out)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    mx.save_safetensors(args.out, out, metadata={"generator": "tools/goldens/quant_vectors.py", "mlx": mx.__version__})
    print(f"wrote {args.out}: {len(out)} tensors, {os.path.getsize(args.out)} bytes")


if __name__ == "__main__":
    main()
