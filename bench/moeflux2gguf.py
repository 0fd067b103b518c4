#!/usr/bin/env python3
"""Write a GGUF (for llama.cpp) holding the same weights as a moeflux model directory.

usage: moeflux2gguf.py MODEL_DIR OUT.gguf [--type q4_1|q4_0|f32] [--tokenizer TOKENIZER.json]
                       [--llama-quantize PATH] [--threads N]

MODEL_DIR is what `moeflux convert` (or `moeflux synth`) writes: moeflux.json, config.json,
dense.safetensors and experts/layer_NNN.bin (docs/FORMAT.md). Supported architectures:
qwen3_5_moe -> llama.cpp `qwen35moe`, qwen3_next -> `qwen3next` (models whose every layer is
MoE: llama.cpp's qwen3next has no dense-MLP layers), qwen3_moe -> `qwen3moe` (dense-MLP layers as
blk.N.ffn_{gate,up,down}, which moeflux reads and llama.cpp does not), glm4_moe -> `glm4moe` (n_group
1, no multi-token-prediction block), and gpt_oss -> `gpt-oss` (q/k/v/o with
their biases, attention sinks, router weight and bias, gate/up/down experts with their bias
tables; sliding window and per-layer pattern from config.json's layer_types; YaRN factor and
original context; llama.cpp hard-codes gpt-oss's SwiGLU alpha 1.702 / limit 7.0 and YaRN beta
32 / 1, so other values are refused).

--type q4_1 (default): every MXFP4 tensor (docs/FORMAT.md, `"mode": "mxfp4"`: gpt-oss's experts
    as released) becomes ggml MXFP4 bit for bit: one 32-element group is one block_mxfp4, its
    e8m0 byte unchanged and qs[j] = q[j] | q[j+16] << 4 with the e2m1 codes unchanged (ggml's
    kvalues_mxfp4 are the e2m1 values doubled and GGML_E8M0_TO_FP32_HALF(e) = 2^(e-128), so
    its weights are exactly moeflux's e2m1(q) * 2^(e-127); moeflux's -0 reads as +0; a scale
    byte 255, NaN in moeflux and finite in ggml, is refused). Every MLX affine 4-bit tensor whose
    group size is a multiple of 32 is repacked losslessly into ggml Q4_1: each group splits into 32-element blocks that all carry
    the group's d = scale and m = bias (bf16 -> f16 must be exact, which is checked), with
    qs[j] = q[j] | q[j+16] << 4. Every other quantized tensor (8-bit routers and shared-expert
    gates, other widths) is dequantized exactly to F32 (w = q * scale + bias in f32); float
    tensors are written as F32.
--type f32: every tensor as F32; quantized ones dequantized exactly as above (MXFP4: e2m1(q) *
    2^(s-127) in f32, exact). The dequantized values of a Q4_1 export equal the F32 export bit for
    bit (bench/check_gguf_export.py, bench/test_moeflux2gguf.py).
--type q4_0: the Q4_1 export requantized with llama.cpp's own `llama-quantize --allow-requantize
    ... Q4_0` (llama.cpp's standard Q4_0 recipe: it keeps routers and SSM tensors unquantized and
    gives the output head a higher precision type; MXFP4 experts become Q4_0 too). Needs --llama-quantize (default: the binary
    bench/setup.sh builds, or $LLAMA_QUANTIZE).

Layout changes (all lossless): Qwen3.5 linear-attention V heads are reordered from grouped to
llama.cpp's "tiled" order (a row permutation of in_proj_qkv's V part, in_proj_z, in_proj_a/b,
conv1d, A_log, dt_bias, and a permutation of out_proj's columns in whole heads, i.e. whole
32-blocks on Q4_1); ssm_a = -exp(A_log); ssm_conv1d = conv1d[..., 0]; norms are copied as they
are (moeflux/MLX norm weights already include the +1 of Qwen's zero-centred norms).

Memory stays bounded: tensors are produced one at a time (experts one layer projection at a
time) and streamed into OUT.gguf.tmp.*, which is renamed to OUT.gguf only when complete.

Vocabulary: MODEL_DIR/tokenizer.json (or --tokenizer FILE), padded with unused "[PADn]" tokens
up to the config's vocab_size. Without either, a byte-level vocabulary (256 byte tokens,
one merge, the rest "[PADn]") is written: llama.cpp loads it and llama-bench does not tokenize, but
text generation with it is meaningless. tools/tokenizer/prepare.py DIR writes the real Qwen3.5
tokenizer (DIR/qwen3_5.tokenizer.json).

Dependencies: numpy and gguf (bench/requirements.txt; bench/setup.sh makes a venv with both).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from byte_level import bytes_to_unicode  # bench/, beside this script

import numpy as np

try:
    import gguf
except ImportError:  # pragma: no cover - message for people running it outside the venv
    sys.exit("moeflux2gguf: error: the Python package `gguf` is missing; run bench/setup.sh and use "
             "target/bench/venv/bin/python (or pip install numpy and gguf)")

QK = 32  # ggml Q4_0/Q4_1 block size


class ExportError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# reading a moeflux model directory


def _bf16_to_f32(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32)


def to_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "F32":
        return np.asarray(a, dtype=np.float32)
    if dtype == "BF16":
        return _bf16_to_f32(np.asarray(a))
    if dtype == "F16":
        return np.asarray(a).astype(np.float32)
    raise ExportError(f"unexpected float dtype {dtype}")


_NP_DTYPES = {"U32": np.uint32, "F32": np.float32, "BF16": np.uint16, "F16": np.float16,
              "U8": np.uint8, "I32": np.int32}


class DenseFile:
    """dense.safetensors, read tensor by tensor with pread (bf16 kept as raw uint16); no memory
    map, so pages read once do not stay in the process's resident set."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self.base = 8 + n
        self.header = header
        self.size = path.stat().st_size

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def raw(self, name: str) -> np.ndarray:
        h = self.header.get(name)
        if h is None:
            raise ExportError(f"tensor {name} missing from {self.path}")
        dt = _NP_DTYPES.get(h["dtype"])
        if dt is None:
            raise ExportError(f"tensor {name}: unsupported dtype {h['dtype']}")
        a, b = h["data_offsets"]
        if self.base + b > self.size:
            raise ExportError(f"{self.path} is truncated (tensor {name})")
        return read_at(self.path, self.base + a, b - a).view(dt).reshape(h["shape"])

    def f32(self, name: str) -> np.ndarray:
        return to_f32(self.raw(name), self.dtype(name))


def read_into(f, offset: int, out: np.ndarray, path: Path) -> None:
    f.seek(offset)
    view, done = memoryview(out).cast("B"), 0
    while done < out.nbytes:
        k = f.readinto(view[done:])
        if not k:
            raise ExportError(f"{path}: unexpected end of file")
        done += k


def read_at(path: Path, offset: int, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, dtype=np.uint8)
    with open(path, "rb", buffering=0) as f:
        read_into(f, offset, out, path)
    return out


class QTensor:
    """A quantized matrix (or a stack of them) of a moeflux model directory: codes as bytes and,
    for MLX affine, f32 scales/biases; for MXFP4 (mode "mxfp4"), the raw e8m0 scale bytes
    (uint8) and no biases."""

    def __init__(self, codes: np.ndarray, scales: np.ndarray, biases: np.ndarray | None, bits: int,
                 group_size: int, cols: int, mode: str = "affine"):
        # codes: uint8 (..., rows, cols*bits/8); scales/biases: (..., rows, cols/group_size)
        self.codes, self.scales, self.biases = codes, scales, biases
        self.bits, self.group_size, self.cols, self.mode = bits, group_size, cols, mode
        self.shape = tuple(codes.shape[:-1]) + (cols,)


def quant_mode(q: dict, what: str) -> str:
    """The `mode` of a `quantized` entry or an expert component's `quant` (docs/FORMAT.md):
    absent or "affine" = MLX affine; "mxfp4" = 4-bit e2m1 codes with e8m0 scales per 32."""
    mode = q.get("mode", "affine")
    if mode == "affine":
        return mode
    if mode == "mxfp4":
        if int(q["bits"]) != 4 or int(q["group_size"]) != 32:
            raise ExportError(f"{what}: mxfp4 with bits {q['bits']} group_size {q['group_size']} "
                              "(MXFP4 is 4 bits in groups of 32)")
        return mode
    raise ExportError(f"{what}: unknown quantization mode {mode!r} (affine, mxfp4)")


def unpack_codes(codes: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """MLX codes: an LSB-first bitstream per row in little-endian words -> uint8 (..., cols)."""
    if bits == 8:
        return np.asarray(codes)
    if bits == 4:
        c = np.asarray(codes)
        out = np.empty(c.shape[:-1] + (c.shape[-1], 2), dtype=np.uint8)
        out[..., 0] = c & 0xF
        out[..., 1] = c >> 4
        return out.reshape(c.shape[:-1] + (cols,))
    if bits == 2:
        c = np.asarray(codes)
        out = np.empty(c.shape[:-1] + (c.shape[-1], 4), dtype=np.uint8)
        for k in range(4):
            out[..., k] = (c >> (2 * k)) & 3
        return out.reshape(c.shape[:-1] + (cols,))
    bitstream = np.unpackbits(np.asarray(codes), axis=-1, bitorder="little")
    bitstream = bitstream[..., :cols * bits].reshape(codes.shape[:-1] + (cols, bits))
    weights = (1 << np.arange(bits)).astype(np.uint8)
    return (bitstream * weights).sum(-1, dtype=np.uint32).astype(np.uint8)


class Model:
    def __init__(self, root: Path):
        self.root = root
        mpath = root / "moeflux.json"
        if not mpath.is_file():
            raise ExportError(f"{root} is not a moeflux model directory (no moeflux.json); "
                              "make one with `moeflux convert SRC DIR`")
        self.manifest = json.loads(mpath.read_text())
        if self.manifest.get("format") != "moeflux-model":
            raise ExportError(f"{mpath}: format is {self.manifest.get('format')!r}, not 'moeflux-model'")
        if self.manifest.get("format_version") != 1:
            raise ExportError(f"{mpath}: format_version {self.manifest.get('format_version')} "
                              "(this exporter reads version 1)")
        self.config = json.loads((root / "config.json").read_text())
        self.arch = self.manifest["architecture"]
        if self.config.get("model_type") != self.arch:
            raise ExportError(f"config.json model_type {self.config.get('model_type')!r} does not "
                              f"match moeflux.json architecture {self.arch!r}")
        self.tc = self.config.get("text_config", self.config)
        self.dense = DenseFile(root / self.manifest.get("dense_file", "dense.safetensors"))
        self.quant = self.manifest.get("quantized", {})
        self.experts = {e["layer"]: e for e in self.manifest.get("experts", [])}

    # dense tensors -----------------------------------------------------------------------
    def has(self, module: str) -> bool:
        return module in self.quant or module + ".weight" in self.dense or module in self.dense

    def is_quantized(self, module: str) -> bool:
        return module in self.quant

    def qinfo(self, module: str) -> tuple[int, int, str]:
        q = self.quant[module]
        return int(q["bits"]), int(q["group_size"]), quant_mode(q, f"quantized[{module}]")

    def dense_q(self, module: str) -> QTensor:
        bits, gs, mode = self.qinfo(module)
        w = self.dense.raw(module + ".weight")  # U32 (rows, cols*bits/32)
        cols = w.shape[-1] * 32 // bits
        if mode == "mxfp4":
            s = self.dense.raw(module + ".scales")
            if self.dense.dtype(module + ".scales") != "U8" or s.shape != (w.shape[0], cols // 32):
                raise ExportError(f"{module}.scales: {self.dense.dtype(module + '.scales')} "
                                  f"{list(s.shape)}, expected U8 {[w.shape[0], cols // 32]} (mxfp4)")
            return QTensor(w.view(np.uint8), s, None, bits, gs, cols, mode)
        return QTensor(w.view(np.uint8), self.dense.f32(module + ".scales"),
                       self.dense.f32(module + ".biases"), bits, gs, cols)

    def dense_float(self, name: str) -> np.ndarray:
        """A float tensor, by its full name or its module name (+ '.weight')."""
        if name in self.dense:
            return self.dense.f32(name)
        return self.dense.f32(name + ".weight")

    def module(self, module: str):
        """QTensor when quantized, else the f32 array."""
        return self.dense_q(module) if self.is_quantized(module) else self.dense_float(module)

    # experts -----------------------------------------------------------------------------
    def expert_q(self, layer: int, proj: str) -> QTensor:
        e = self.experts.get(layer)
        if e is None:
            raise ExportError(f"layer {layer} has no routed experts in moeflux.json")
        comp = next((c for c in e["components"] if c["name"] == proj), None)
        if comp is None:
            raise ExportError(f"layer {layer}: expert component {proj} missing")
        path = self.root / e["file"]
        n, stride = int(e["num_experts"]), int(e["stride"])
        if path.stat().st_size < (n - 1) * stride + int(e["expert_bytes"]):
            raise ExportError(f"{path} is shorter than {n} experts of stride {stride}")
        rows, cols = int(comp["rows"]), int(comp["cols"])
        bits, gs = int(comp["quant"]["bits"]), int(comp["quant"]["group_size"])
        mode = quant_mode(comp["quant"], f"layer {layer} {proj}")

        def piece(key: str, width: int) -> np.ndarray:
            p = comp[key]
            if p["bytes"] != rows * width:
                raise ExportError(f"layer {layer} {proj}.{key}: {p['bytes']} bytes, expected {rows * width}")
            out = np.empty((n, rows * width), dtype=np.uint8)
            with open(path, "rb", buffering=0) as f:
                for x in range(n):
                    read_into(f, x * stride + int(p["offset"]), out[x], path)
            return out.reshape(n, rows, width)

        codes = piece("weight", cols * bits // 8)
        ng = cols // gs
        fl = {"F32": (np.float32, 4), "BF16": (np.uint16, 2), "F16": (np.float16, 2)}

        def floats(key: str) -> np.ndarray:
            dt = comp[key]["dtype"]
            if dt not in fl:
                raise ExportError(f"layer {layer} {proj}.{key}: unsupported dtype {dt}")
            view, size = fl[dt]
            return to_f32(piece(key, ng * size).view(view), dt)

        if mode == "mxfp4":
            if comp["scales"].get("dtype") != "U8":
                raise ExportError(f"layer {layer} {proj}.scales: dtype {comp['scales'].get('dtype')}, "
                                  "expected U8 (mxfp4 e8m0)")
            return QTensor(codes, piece("scales", ng), None, bits, gs, cols, mode)
        s, b = floats("scales"), floats("biases")
        return QTensor(codes, s, b, bits, gs, cols)


# ---------------------------------------------------------------------------------------------
# conversion of one tensor


def q41_ok(q: QTensor) -> bool:
    return q.bits == 4 and q.group_size % QK == 0 and q.cols % QK == 0


def dequant_rows(codes, scales, biases, bits, gs, cols) -> np.ndarray:
    """Exact dequantization of a block of rows: f32 q * scale + bias (the same operations, in
    the same order, as ggml's Q4_1 dequantization, so a Q4_1 repack dequantizes identically)."""
    q = unpack_codes(codes, bits, cols).astype(np.float32)
    q = q.reshape(q.shape[:-1] + (cols // gs, gs))
    out = q * scales[..., None] + biases[..., None]
    return out.reshape(out.shape[:-2] + (cols,))


def q41_rows(codes, scales, biases, gs, cols, what: str) -> np.ndarray:
    """Lossless MLX 4-bit -> ggml Q4_1 blocks, uint8 (..., cols/32*20)."""
    d = scales.astype(np.float16)
    m = biases.astype(np.float16)
    if not (np.array_equal(d.astype(np.float32), scales) and np.array_equal(m.astype(np.float32), biases)):
        bad = np.flatnonzero((d.astype(np.float32) != scales) | (m.astype(np.float32) != biases))
        raise ExportError(f"{what}: a scale or bias is not exactly representable in f16 (e.g. "
                          f"scale {scales.flat[bad[0]]!r}, bias {biases.flat[bad[0]]!r}); Q4_1 would "
                          "not hold the same weights (use --type f32)")
    rep = gs // QK
    nblk = cols // QK
    q = unpack_codes(codes, 4, cols).reshape(codes.shape[:-1] + (nblk, QK))
    lead = codes.shape[:-1]
    out = np.empty(lead + (nblk, 20), dtype=np.uint8)
    out[..., 0:2] = np.repeat(d, rep, axis=-1).view(np.uint8).reshape(lead + (nblk, 2))
    out[..., 2:4] = np.repeat(m, rep, axis=-1).view(np.uint8).reshape(lead + (nblk, 2))
    out[..., 4:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(lead + (nblk * 20,))


# MXFP4 (docs/FORMAT.md): code bit 3 is the sign, bits 0-2 index the e2m1 magnitudes (code 8 is -0)
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
# 2^(s-127) for every e8m0 byte s, exactly: the f32 with exponent field s for s >= 1, the subnormal
# 2^-127 for s = 0. (255 is NaN in moeflux and is refused before this table is used.)
E8M0 = np.concatenate([[0x00400000], np.arange(1, 256, dtype=np.uint32) << 23]).astype(np.uint32).view(np.float32)
MXFP4_BLOCK = 17  # ggml block_mxfp4: 1 e8m0 byte + 16 bytes of codes


def check_e8m0(e: np.ndarray, what: str) -> None:
    """Scale byte 255 makes moeflux's weights NaN (docs/FORMAT.md) but ggml reads it as a finite
    2^127 (ggml_e8m0_to_fp32_half handles no NaN), so such a tensor has no lossless export."""
    if (e == 255).any():
        raise ExportError(f"{what}: an MXFP4 scale byte is 255 (NaN in moeflux, finite in ggml): "
                          "no ggml type holds the same weights")


def mxfp4_dequant_rows(codes, e, cols) -> np.ndarray:
    """Exact MXFP4 dequantization: e2m1(q) * 2^(s-127) in f32 (exact: every product is a
    representable f32, 2^-128 at the smallest)."""
    q = unpack_codes(codes, 4, cols).reshape(codes.shape[:-1] + (cols // 32, 32))
    out = E2M1[q] * E8M0[e][..., None]
    return out.reshape(out.shape[:-2] + (cols,))


def mxfp4_rows(codes, e, cols) -> np.ndarray:
    """moeflux MXFP4 -> ggml block_mxfp4, uint8 (..., cols/32*17). A bit-level repack: each
    32-element group is one block, e = the group's e8m0 byte unchanged, qs[j] = q[j] | q[j+16] << 4
    with the codes unchanged. ggml's kvalues_mxfp4 table is the e2m1 magnitudes doubled (0, 1, 2,
    3, 4, 6, 8, 12, sign in bit 3) and GGML_E8M0_TO_FP32_HALF(e) = 2^(e-128), so ggml's value
    2*v * 2^(e-128) equals moeflux's v * 2^(e-127) exactly (code 8, -0 in moeflux, is +0 in ggml)."""
    nblk = cols // 32
    lead = codes.shape[:-1]
    q = unpack_codes(codes, 4, cols).reshape(lead + (nblk, 32))
    out = np.empty(lead + (nblk, MXFP4_BLOCK), dtype=np.uint8)
    out[..., 0] = e
    out[..., 1:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(lead + (nblk * MXFP4_BLOCK,))


ROW_CHUNK = 8192
_POOL = None


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
    return _POOL


def convert_q(q: QTensor, native: bool, what: str) -> np.ndarray:
    """QTensor -> ggml blocks when `native` (Q4_1 for affine 4-bit, MXFP4 for mxfp4; uint8
    (..., rows, bytes per row)) or f32 (..., rows, cols), in row chunks."""
    mx = q.mode == "mxfp4"
    if mx:
        check_e8m0(q.scales, what)
    lead = q.codes.shape[:-1]
    width = (q.cols // QK * (MXFP4_BLOCK if mx else 20)) if native else q.cols
    out = np.empty(lead + (width,), dtype=np.uint8 if native else np.float32)
    codes = q.codes.reshape((-1,) + q.codes.shape[-2:]) if q.codes.ndim == 3 else q.codes[None]
    sc = q.scales.reshape((-1,) + q.scales.shape[-2:])
    bi = None if mx else q.biases.reshape((-1,) + q.biases.shape[-2:])
    o = out.reshape((-1,) + out.shape[-2:])

    def chunk(job):
        e, r0, r1 = job
        c = np.asarray(codes[e, r0:r1])
        if mx:
            o[e, r0:r1] = (mxfp4_rows(c, sc[e, r0:r1], q.cols) if native
                           else mxfp4_dequant_rows(c, sc[e, r0:r1], q.cols))
        elif native:
            o[e, r0:r1] = q41_rows(c, sc[e, r0:r1], bi[e, r0:r1], q.group_size, q.cols, what)
        else:
            o[e, r0:r1] = dequant_rows(c, sc[e, r0:r1], bi[e, r0:r1], q.bits, q.group_size, q.cols)

    rows = codes.shape[1]
    jobs = [(e, r0, min(r0 + ROW_CHUNK, rows)) for e in range(codes.shape[0]) for r0 in range(0, rows, ROW_CHUNK)]
    # Chunks write disjoint rows and numpy drops the GIL in their element loops, so threads
    # spread a stacked expert tensor (hundreds of chunks) over the cores.
    run = _pool().map if len(jobs) > 1 else map
    for _ in run(chunk, jobs):
        pass
    return out


class Out:
    """A tensor to write: its llama.cpp name, logical (numpy-order) shape, ggml type, producer."""

    def __init__(self, name: str, shape, qtype, produce):
        self.name, self.shape, self.qtype, self.produce = name, tuple(int(x) for x in shape), qtype, produce

    @property
    def nbytes(self) -> int:
        n = int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1
        if self.qtype == gguf.GGMLQuantizationType.Q4_1:
            return n * (self.shape[-1] // QK) * 20
        if self.qtype == gguf.GGMLQuantizationType.MXFP4:
            return n * (self.shape[-1] // QK) * MXFP4_BLOCK
        return n * self.shape[-1] * 4


# ---------------------------------------------------------------------------------------------
# the architecture mapping


class Exporter:
    def __init__(self, model: Model, want_q41: bool):
        self.m = model
        self.want_q41 = want_q41
        self.tc = model.tc
        self.outs: list[Out] = []
        self.counts = {"Q4_1": 0, "MXFP4": 0, "F32": 0}

    # generic adders ----------------------------------------------------------------------
    def _type_for(self, q: QTensor | None, col_head: int | None = None):
        """The ggml type a quantized tensor is repacked into losslessly (unless --type f32):
        MXFP4 for mxfp4, Q4_1 for affine 4-bit in groups of a multiple of 32; else F32."""
        if q is None or not self.want_q41 or (col_head is not None and col_head % QK):
            return gguf.GGMLQuantizationType.F32
        if q.mode == "mxfp4" and q.cols % QK == 0:
            return gguf.GGMLQuantizationType.MXFP4
        if q.mode == "affine" and q41_ok(q):
            return gguf.GGMLQuantizationType.Q4_1
        return gguf.GGMLQuantizationType.F32

    def add_float(self, name: str, shape, produce):
        self.outs.append(Out(name, shape, gguf.GGMLQuantizationType.F32,
                             lambda: np.ascontiguousarray(produce(), dtype=np.float32)))

    def add_module(self, name: str, module: str, row_perm: np.ndarray | None = None,
                   col_perm_heads: tuple[int, np.ndarray] | None = None, flatten: bool = False):
        """A dense module (quantized or float). row_perm permutes output rows; col_perm_heads =
        (head_dim, head order) permutes input columns in whole heads."""
        m = self.m
        if not m.has(module):
            raise ExportError(f"tensor {module} missing from the model directory")
        if m.is_quantized(module):
            bits, gs, mode = m.qinfo(module)
            w = m.dense.raw(module + ".weight")
            shape = (w.shape[0], w.shape[1] * 32 // bits)
            probe = QTensor(np.empty((0, 0), np.uint8), None, None, bits, gs, shape[1], mode)
            qtype = (gguf.GGMLQuantizationType.F32 if flatten else
                     self._type_for(probe, col_perm_heads[0] if col_perm_heads else None))
        else:
            shape = m.dense.shape(module + ".weight" if module + ".weight" in m.dense else module)
            qtype = gguf.GGMLQuantizationType.F32
        native = qtype != gguf.GGMLQuantizationType.F32  # Q4_1 or MXFP4 blocks
        if row_perm is not None:
            shape = (len(row_perm),) + tuple(shape[1:])

        def produce():
            if m.is_quantized(module):
                a = convert_q(m.dense_q(module), native, module)
            else:
                a = m.dense_float(module)
            if row_perm is not None:
                a = a[row_perm]
            if col_perm_heads is not None:
                hd, order = col_perm_heads
                blk = MXFP4_BLOCK if qtype == gguf.GGMLQuantizationType.MXFP4 else 20
                unit = hd // QK * blk if native else hd
                a = a.reshape(a.shape[0], len(order), unit)[:, order].reshape(a.shape[0], -1)
            if native:
                return np.ascontiguousarray(a)
            a = np.ascontiguousarray(a, dtype=np.float32)
            return a.reshape(-1) if flatten else a

        out_shape = (int(np.prod(shape)),) if flatten else shape
        self.outs.append(Out(name, out_shape, qtype, produce))

    def add_experts(self, name: str, layer: int, proj: str):
        m = self.m
        e = m.experts.get(layer)
        if e is None:
            raise ExportError(f"layer {layer}: no experts entry in moeflux.json")
        comp = next((c for c in e["components"] if c["name"] == proj), None)
        if comp is None:
            raise ExportError(f"layer {layer}: expert component {proj} missing")
        bits, gs = int(comp["quant"]["bits"]), int(comp["quant"]["group_size"])
        mode = quant_mode(comp["quant"], f"layer {layer} {proj}")
        probe = QTensor(np.empty((0, 0), np.uint8), None, None, bits, gs, int(comp["cols"]), mode)
        qtype = self._type_for(probe)
        shape = (int(e["num_experts"]), int(comp["rows"]), int(comp["cols"]))
        native = qtype != gguf.GGMLQuantizationType.F32  # Q4_1 or MXFP4 blocks
        if not native and self.want_q41:
            print(f"moeflux2gguf: note: layer {layer} experts are {bits}-bit g{gs}: no lossless ggml "
                  "type, written as F32", file=sys.stderr)
        self.outs.append(Out(name, shape, qtype,
                             lambda: convert_q(m.expert_q(layer, proj), native, f"layer {layer} {proj}")))

    # qwen3_5_moe / qwen3_next --------------------------------------------------------------
    def v_tiled(self, n: int, unit: int) -> np.ndarray:
        """Row order that turns grouped V heads (k-group major) into llama.cpp's tiled order."""
        nk, nv = self.tc["linear_num_key_heads"], self.tc["linear_num_value_heads"]
        idx = np.arange(n)
        if nk == nv:
            return idx
        assert n == nv * unit
        return idx.reshape(nk, nv // nk, unit).swapaxes(0, 1).reshape(-1)

    def build(self):
        m, tc = self.m, self.tc
        arch = m.arch
        if arch == "gpt_oss":
            return self._build_gpt_oss()
        if arch == "qwen3_moe":
            return self._build_qwen3_moe()
        if arch == "glm4_moe":
            return self._build_glm4_moe()
        L = int(tc["num_hidden_layers"])
        interval = int(tc.get("full_attention_interval", 4))
        if arch == "qwen3_5_moe":
            if not tc.get("norm_topk_prob", True):
                raise ExportError("norm_topk_prob is false: llama.cpp's qwen35moe always renormalizes "
                                  "the top-k router weights, so it would not run the same model")
        elif arch == "qwen3_next":
            if tc.get("mlp_only_layers"):
                raise ExportError(f"mlp_only_layers {tc['mlp_only_layers']}: llama.cpp's qwen3next has "
                                  "no dense-MLP layers, so this model cannot be exported")
            if int(tc.get("decoder_sparse_step", 1)) != 1:
                raise ExportError("decoder_sparse_step != 1 is not supported by llama.cpp's qwen3next")
            if not tc.get("norm_topk_prob", True):
                raise ExportError("norm_topk_prob is false: llama.cpp's qwen3next always renormalizes")
        else:
            raise ExportError(f"architecture {arch!r} is not supported (qwen3_5_moe, qwen3_next, gpt_oss)")
        nk, nv = int(tc["linear_num_key_heads"]), int(tc["linear_num_value_heads"])
        dk, dv = int(tc["linear_key_head_dim"]), int(tc["linear_value_head_dim"])
        if dk != dv:
            raise ExportError(f"linear_key_head_dim {dk} != linear_value_head_dim {dv}: llama.cpp "
                              "assumes equal key and value head dims")
        if nv % nk:
            raise ExportError("linear_num_value_heads is not a multiple of linear_num_key_heads")

        self.add_module("token_embd.weight", "model.embed_tokens")
        self.add_module("output_norm.weight", "model.norm.weight")
        if m.has("lm_head"):
            self.add_module("output.weight", "lm_head")
        # else: tied embeddings; llama.cpp reuses token_embd

        for i in range(L):
            p = f"model.layers.{i}."
            self.add_module(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight")
            self.add_module(f"blk.{i}.post_attention_norm.weight", p + "post_attention_layernorm.weight")
            if (i + 1) % interval == 0:
                a = p + "self_attn."
                self.add_module(f"blk.{i}.attn_q.weight", a + "q_proj")
                self.add_module(f"blk.{i}.attn_k.weight", a + "k_proj")
                self.add_module(f"blk.{i}.attn_v.weight", a + "v_proj")
                self.add_module(f"blk.{i}.attn_output.weight", a + "o_proj")
                self.add_module(f"blk.{i}.attn_q_norm.weight", a + "q_norm.weight")
                self.add_module(f"blk.{i}.attn_k_norm.weight", a + "k_norm.weight")
            elif arch == "qwen3_5_moe":
                self._linear_qwen35(i, p + "linear_attn.", nk, nv, dk, dv)
            else:
                self._linear_qwen3next(i, p + "linear_attn.", nk, nv, dk, dv)
            mlp = p + "mlp."
            self.add_module(f"blk.{i}.ffn_gate_inp.weight", mlp + "gate")
            self.add_experts(f"blk.{i}.ffn_gate_exps.weight", i, "gate_proj")
            self.add_experts(f"blk.{i}.ffn_up_exps.weight", i, "up_proj")
            self.add_experts(f"blk.{i}.ffn_down_exps.weight", i, "down_proj")
            self.add_module(f"blk.{i}.ffn_gate_inp_shexp.weight", mlp + "shared_expert_gate", flatten=True)
            self.add_module(f"blk.{i}.ffn_gate_shexp.weight", mlp + "shared_expert.gate_proj")
            self.add_module(f"blk.{i}.ffn_up_shexp.weight", mlp + "shared_expert.up_proj")
            self.add_module(f"blk.{i}.ffn_down_shexp.weight", mlp + "shared_expert.down_proj")

    # gpt_oss -------------------------------------------------------------------------------
    def gpt_oss_layer_swa(self) -> list[bool]:
        """Per layer: sliding-window attention? (config.json `layer_types`, else sliding/full
        alternating from layer 0, as moeflux's config parser reads it)."""
        L = int(self.tc["num_hidden_layers"])
        types = self.tc.get("layer_types")
        if types is None:
            return [i % 2 == 0 for i in range(L)]
        if len(types) != L or any(t not in ("sliding_attention", "full_attention") for t in types):
            raise ExportError(f"config.json layer_types {types!r}: expected {L} entries of "
                              "sliding_attention / full_attention")
        return [t == "sliding_attention" for t in types]

    def _build_gpt_oss(self):
        m, tc = self.m, self.tc
        L = int(tc["num_hidden_layers"])
        # llama.cpp hard-codes gpt-oss's SwiGLU (alpha 1.702, limit 7.0), as moeflux does.
        if float(tc.get("swiglu_limit", 7.0)) != 7.0:
            raise ExportError(f"swiglu_limit {tc['swiglu_limit']}: llama.cpp's gpt-oss uses 7.0")
        self.gpt_oss_layer_swa()
        self.add_module("token_embd.weight", "model.embed_tokens")
        self.add_module("output_norm.weight", "model.norm.weight")
        # llama.cpp's gpt-oss requires output.weight: tied embeddings are written twice.
        self.add_module("output.weight", "lm_head" if m.has("lm_head") else "model.embed_tokens")
        for i in range(L):
            p = f"model.layers.{i}."
            a, mlp = p + "self_attn.", p + "mlp."
            self.add_module(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight")
            self.add_module(f"blk.{i}.post_attention_norm.weight", p + "post_attention_layernorm.weight")
            for x, proj in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")):
                self.add_module(f"blk.{i}.attn_{x}.weight", a + proj)
                self.add_module(f"blk.{i}.attn_{x}.bias", a + proj + ".bias")
            self.add_module(f"blk.{i}.attn_sinks.weight", a + "sinks")
            self.add_module(f"blk.{i}.ffn_gate_inp.weight", mlp + "router")
            self.add_module(f"blk.{i}.ffn_gate_inp.bias", mlp + "router.bias")
            # moeflux keeps gate and up apart (mlx-lm's sanitize splits the checkpoint's
            # interleaved gate_up_proj into [::2] and [1::2]), as llama.cpp's loader wants them.
            for x in ("gate", "up", "down"):
                self.add_experts(f"blk.{i}.ffn_{x}_exps.weight", i, f"{x}_proj")
                self.add_module(f"blk.{i}.ffn_{x}_exps.bias", mlp + f"switch_mlp.{x}_proj.bias")

    # qwen3_moe ----------------------------------------------------------------------------
    def _build_qwen3_moe(self):
        """llama.cpp's qwen3moe names. Dense-MLP layers (mlp_only_layers / decoder_sparse_step)
        are written as blk.N.ffn_{gate,up,down}: llama.cpp's own qwen3moe has none and will not
        load such a file, but its tensor names are the ones llama.cpp's converter uses, and
        moeflux reads them (tests/fixtures/gguf)."""
        m, tc = self.m, self.tc
        L = int(tc["num_hidden_layers"])
        self.add_module("token_embd.weight", "model.embed_tokens")
        self.add_module("output_norm.weight", "model.norm.weight")
        if m.has("lm_head"):
            self.add_module("output.weight", "lm_head")
        for i in range(L):
            p = f"model.layers.{i}."
            a, mlp = p + "self_attn.", p + "mlp."
            self.add_module(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight")
            self.add_module(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight")
            for x, proj in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")):
                self.add_module(f"blk.{i}.attn_{x}.weight", a + proj)
            self.add_module(f"blk.{i}.attn_q_norm.weight", a + "q_norm.weight")
            self.add_module(f"blk.{i}.attn_k_norm.weight", a + "k_norm.weight")
            if m.has(mlp + "gate"):
                self.add_module(f"blk.{i}.ffn_gate_inp.weight", mlp + "gate")
                for x in ("gate", "up", "down"):
                    self.add_experts(f"blk.{i}.ffn_{x}_exps.weight", i, f"{x}_proj")
            else:
                for x in ("gate", "up", "down"):
                    self.add_module(f"blk.{i}.ffn_{x}.weight", mlp + f"{x}_proj")

    # glm4_moe -----------------------------------------------------------------------------
    def _build_glm4_moe(self):
        """llama.cpp's glm4moe names (conversion/glm.py); no multi-token-prediction block (moeflux
        drops it on convert), so nextn_predict_layers is 0."""
        m, tc = self.m, self.tc
        L = int(tc["num_hidden_layers"])
        self.add_module("token_embd.weight", "model.embed_tokens")
        self.add_module("output_norm.weight", "model.norm.weight")
        if m.has("lm_head"):
            self.add_module("output.weight", "lm_head")
        for i in range(L):
            p = f"model.layers.{i}."
            a, mlp = p + "self_attn.", p + "mlp."
            self.add_module(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight")
            self.add_module(f"blk.{i}.post_attention_norm.weight", p + "post_attention_layernorm.weight")
            for x, proj in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
                self.add_module(f"blk.{i}.attn_{x}.weight", a + proj)
                self.add_module(f"blk.{i}.attn_{x}.bias", a + proj + ".bias")
            self.add_module(f"blk.{i}.attn_output.weight", a + "o_proj")
            if m.has(a + "q_norm.weight"):
                self.add_module(f"blk.{i}.attn_q_norm.weight", a + "q_norm.weight")
                self.add_module(f"blk.{i}.attn_k_norm.weight", a + "k_norm.weight")
            if m.has(mlp + "gate"):
                self.add_module(f"blk.{i}.ffn_gate_inp.weight", mlp + "gate")
                self.add_module(f"blk.{i}.exp_probs_b.bias", mlp + "gate.e_score_correction_bias")
                for x in ("gate", "up", "down"):
                    self.add_experts(f"blk.{i}.ffn_{x}_exps.weight", i, f"{x}_proj")
                    self.add_module(f"blk.{i}.ffn_{x}_shexp.weight", mlp + f"shared_experts.{x}_proj")
            else:
                for x in ("gate", "up", "down"):
                    self.add_module(f"blk.{i}.ffn_{x}.weight", mlp + f"{x}_proj")

    def _ssm_common(self, i: int, la: str, vperm_heads: np.ndarray | None, conv_perm: np.ndarray | None):
        m = self.m

        def conv():
            c = m.dense_float(la + "conv1d.weight")  # (C, K, 1)
            c = c[..., 0] if c.ndim == 3 else c
            return c[conv_perm] if conv_perm is not None else c

        def a():
            x = -np.exp(m.dense_float(la + "A_log").astype(np.float32))
            return x[vperm_heads] if vperm_heads is not None else x

        def dt():
            x = m.dense_float(la + "dt_bias")
            return x[vperm_heads] if vperm_heads is not None else x

        cshape = m.dense.shape(la + "conv1d.weight")
        nheads = m.dense.shape(la + "A_log")[0]
        self.add_float(f"blk.{i}.ssm_conv1d.weight", cshape[:2], conv)
        self.add_float(f"blk.{i}.ssm_a", (nheads,), a)
        self.add_float(f"blk.{i}.ssm_dt.bias", (nheads,), dt)
        self.add_module(f"blk.{i}.ssm_norm.weight", la + "norm.weight")

    def _linear_qwen35(self, i, la, nk, nv, dk, dv):
        qd = nk * dk
        vrows = self.v_tiled(nv * dv, dv)
        vheads = self.v_tiled(nv, 1)
        qkv_perm = np.concatenate([np.arange(2 * qd), 2 * qd + vrows])
        self.add_module(f"blk.{i}.attn_qkv.weight", la + "in_proj_qkv", row_perm=qkv_perm)
        self.add_module(f"blk.{i}.attn_gate.weight", la + "in_proj_z", row_perm=vrows)
        self.add_module(f"blk.{i}.ssm_beta.weight", la + "in_proj_b", row_perm=vheads)
        self.add_module(f"blk.{i}.ssm_alpha.weight", la + "in_proj_a", row_perm=vheads)
        self.add_module(f"blk.{i}.ssm_out.weight", la + "out_proj", col_perm_heads=(dv, vheads))
        self._ssm_common(i, la, vheads, qkv_perm)

    def _linear_qwen3next(self, i, la, nk, nv, dk, dv):
        # in_proj_qkvz rows, per k-head g: [q (dk), k (dk), v (nv/nk*dv), z (nv/nk*dv)];
        # llama.cpp: attn_qkv = [q all heads, k all heads, v all heads], attn_gate = z (both V
        # in the grouped order, as the oracle's validated mapping writes them).
        r = nv // nk * dv
        per = 2 * dk + 2 * r
        base = np.arange(nk)[:, None] * per
        q_rows = (base + np.arange(dk)).reshape(-1)
        k_rows = (base + dk + np.arange(dk)).reshape(-1)
        v_rows = (base + 2 * dk + np.arange(r)).reshape(-1)
        z_rows = (base + 2 * dk + r + np.arange(r)).reshape(-1)
        self.add_module(f"blk.{i}.attn_qkv.weight", la + "in_proj_qkvz",
                        row_perm=np.concatenate([q_rows, k_rows, v_rows]))
        self.add_module(f"blk.{i}.attn_gate.weight", la + "in_proj_qkvz", row_perm=z_rows)
        self.add_module(f"blk.{i}.ssm_ba.weight", la + "in_proj_ba")
        self.add_module(f"blk.{i}.ssm_out.weight", la + "out_proj")
        self._ssm_common(i, la, None, None)

    # metadata ------------------------------------------------------------------------------
    def write_kv(self, w: gguf.GGUFWriter, name: str):
        tc, arch = self.tc, self.m.arch
        if arch == "gpt_oss":
            return self._write_kv_gpt_oss(w, name)
        if arch == "qwen3_moe":
            return self._write_kv_qwen3_moe(w, name)
        if arch == "glm4_moe":
            return self._write_kv_glm4_moe(w, name)
        w.add_name(name)
        w.add_block_count(int(tc["num_hidden_layers"]))
        w.add_context_length(int(tc.get("max_position_embeddings", 4096)))
        w.add_embedding_length(int(tc["hidden_size"]))
        w.add_feed_forward_length(int(tc.get("intermediate_size", tc["moe_intermediate_size"])))
        w.add_head_count(int(tc["num_attention_heads"]))
        w.add_head_count_kv(int(tc["num_key_value_heads"]))
        hd = int(tc.get("head_dim", tc["hidden_size"] // tc["num_attention_heads"]))
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_layer_norm_rms_eps(float(tc["rms_norm_eps"]))
        w.add_expert_count(int(tc["num_experts"]))
        w.add_expert_used_count(int(tc["num_experts_per_tok"]))
        w.add_expert_feed_forward_length(int(tc["moe_intermediate_size"]))
        w.add_expert_shared_feed_forward_length(int(tc["shared_expert_intermediate_size"]))
        if arch == "qwen3_5_moe":
            rp = tc.get("rope_parameters") or {}
            theta = rp.get("rope_theta", tc.get("rope_theta", 10000000))
            prf = rp.get("partial_rotary_factor", tc.get("partial_rotary_factor", 0.25))
            sections = list(rp.get("mrope_section", [11, 11, 10]))
            w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])
        else:
            theta = tc.get("rope_theta", 10000000)
            prf = tc.get("partial_rotary_factor", 0.25)
        w.add_rope_freq_base(float(theta))
        w.add_rope_dimension_count(int(hd * prf))
        w.add_ssm_conv_kernel(int(tc["linear_conv_kernel_dim"]))
        w.add_ssm_state_size(int(tc["linear_key_head_dim"]))
        w.add_ssm_group_count(int(tc["linear_num_key_heads"]))
        w.add_ssm_time_step_rank(int(tc["linear_num_value_heads"]))
        w.add_ssm_inner_size(int(tc["linear_value_head_dim"]) * int(tc["linear_num_value_heads"]))
        w.add_full_attention_interval(int(tc.get("full_attention_interval", 4)))

    def _write_kv_qwen3_moe(self, w: gguf.GGUFWriter, name: str):
        """What llama.cpp's convert_hf_to_gguf.py writes for Qwen3MoeForCausalLM."""
        tc = self.tc
        hd = int(tc.get("head_dim", tc["hidden_size"] // tc["num_attention_heads"]))
        w.add_name(name)
        w.add_block_count(int(tc["num_hidden_layers"]))
        w.add_context_length(int(tc.get("max_position_embeddings", 4096)))
        w.add_embedding_length(int(tc["hidden_size"]))
        w.add_feed_forward_length(int(tc["intermediate_size"]))
        w.add_head_count(int(tc["num_attention_heads"]))
        w.add_head_count_kv(int(tc["num_key_value_heads"]))
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_layer_norm_rms_eps(float(tc["rms_norm_eps"]))
        w.add_expert_count(int(tc["num_experts"]))
        w.add_expert_used_count(int(tc["num_experts_per_tok"]))
        w.add_expert_feed_forward_length(int(tc["moe_intermediate_size"]))
        w.add_expert_weights_norm(bool(tc.get("norm_topk_prob", False)))
        w.add_rope_freq_base(float(tc.get("rope_theta", 1000000.0)))
        if tc.get("rope_scaling"):
            raise ExportError(f"rope_scaling {tc['rope_scaling']!r} is not exported for qwen3_moe")

    def _write_kv_glm4_moe(self, w: gguf.GGUFWriter, name: str):
        """What llama.cpp's conversion/glm.py writes for Glm4MoeForCausalLM (without MTP)."""
        tc = self.tc
        hd = int(tc.get("head_dim", tc["hidden_size"] // tc["num_attention_heads"]))
        if int(tc.get("n_group", 1)) != 1 or int(tc.get("topk_group", 1)) != 1:
            raise ExportError("n_group/topk_group other than 1 are not exported for glm4_moe")
        w.add_name(name)
        w.add_block_count(int(tc["num_hidden_layers"]))
        w.add_context_length(int(tc.get("max_position_embeddings", 4096)))
        w.add_embedding_length(int(tc["hidden_size"]))
        w.add_feed_forward_length(int(tc["intermediate_size"]))
        w.add_head_count(int(tc["num_attention_heads"]))
        w.add_head_count_kv(int(tc["num_key_value_heads"]))
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_layer_norm_rms_eps(float(tc["rms_norm_eps"]))
        w.add_rope_dimension_count(int(hd * float(tc.get("partial_rotary_factor", 0.5))))
        w.add_rope_freq_base(float(tc.get("rope_theta", 1000000.0)))
        w.add_expert_count(int(tc["n_routed_experts"]))
        w.add_expert_used_count(int(tc["num_experts_per_tok"]))
        w.add_expert_feed_forward_length(int(tc["moe_intermediate_size"]))
        w.add_expert_shared_count(int(tc.get("n_shared_experts", 0)))
        w.add_leading_dense_block_count(int(tc.get("first_k_dense_replace", 0)))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(float(tc.get("routed_scaling_factor", 1.0)))
        w.add_expert_weights_norm(bool(tc.get("norm_topk_prob", True)))
        if tc.get("rope_scaling"):
            raise ExportError(f"rope_scaling {tc['rope_scaling']!r} is not exported for glm4_moe")

    def _write_kv_gpt_oss(self, w: gguf.GGUFWriter, name: str):
        """What llama.cpp's gpt-oss loader (src/models/openai-moe.cpp and the generic hparams)
        reads, from config.json as moeflux's config parser reads it (config/gpt_oss.rs)."""
        tc = self.tc
        hd = int(tc.get("head_dim", tc["hidden_size"] // tc["num_attention_heads"]))
        width = int(tc["intermediate_size"])
        w.add_name(name)
        w.add_block_count(int(tc["num_hidden_layers"]))
        w.add_context_length(int(tc.get("max_position_embeddings", 131072)))
        w.add_embedding_length(int(tc["hidden_size"]))
        w.add_feed_forward_length(width)
        w.add_head_count(int(tc["num_attention_heads"]))
        w.add_head_count_kv(int(tc["num_key_value_heads"]))
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_layer_norm_rms_eps(float(tc["rms_norm_eps"]))
        w.add_expert_count(int(tc.get("num_local_experts", 128)))
        w.add_expert_used_count(int(tc.get("num_experts_per_tok", 4)))
        w.add_expert_feed_forward_length(width)
        w.add_sliding_window(int(tc.get("sliding_window", 128)))
        # the exact per-layer pattern (llama.cpp's default, 2, means the same alternation)
        w.add_sliding_window_pattern(self.gpt_oss_layer_swa())
        w.add_rope_freq_base(float(tc.get("rope_theta", 150000)))
        w.add_rope_dimension_count(hd)  # full rotary; llama.cpp's gpt-oss sizes q/k by n_rot
        rs = tc.get("rope_scaling") or {}
        kind = rs.get("rope_type", rs.get("type", "default"))
        if kind == "yarn":
            # llama.cpp reads factor and original context from the GGUF; beta_fast/slow keys
            # exist but its loader ignores them (32 and 1 are built in), and its attention factor
            # is mlx-lm's (mscale 1) unless yarn_log_multiplier (= mscale_all_dim) is given. Its
            # correction range is floored/ceiled, as mlx-lm's YarnRoPE and moeflux do (HF's
            # `truncate: false` is ignored by both).
            bf, bs = float(rs.get("beta_fast", 32.0)), float(rs.get("beta_slow", 1.0))
            if (bf, bs) != (32.0, 1.0):
                raise ExportError(f"rope_scaling beta_fast {bf} / beta_slow {bs}: llama.cpp's loader "
                                  "always uses 32 / 1")
            if float(rs.get("mscale", 1.0)) != 1.0:
                raise ExportError(f"rope_scaling.mscale {rs['mscale']}: llama.cpp assumes 1")
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(float(rs["factor"]))
            w.add_rope_scaling_orig_ctx_len(int(rs.get("original_max_position_embeddings", 4096)))
            w.add_rope_scaling_yarn_beta_fast(bf)
            w.add_rope_scaling_yarn_beta_slow(bs)
            if float(rs.get("mscale_all_dim", 0.0)):
                w.add_rope_scaling_yarn_log_mul(float(rs["mscale_all_dim"]))
        elif kind == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(rs["factor"]))
        elif kind == "default":
            w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        else:
            raise ExportError(f"rope_scaling type {kind!r} is not supported for gpt_oss (yarn, linear)")


# ---------------------------------------------------------------------------------------------
# vocabulary


QWEN35_MARK = r"[\p{L}\p{M}]+"
GPT4O_MARK = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"  # o200k (gpt-oss)


def write_vocab(w: gguf.GGUFWriter, model: Model, tokenizer: Path | None) -> str:
    vocab_size = int(model.tc["vocab_size"])
    tt = gguf.TokenType
    tok_path = tokenizer or (model.root / "tokenizer.json")
    eos = model.config.get("eos_token_id", model.tc.get("eos_token_id"))
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if tok_path.is_file():
        tj = json.loads(tok_path.read_text(encoding="utf-8"))
        mdl = tj.get("model", {})
        if mdl.get("type") != "BPE":
            raise ExportError(f"{tok_path}: tokenizer model {mdl.get('type')!r}, expected BPE")
        tokens: list[str | None] = [None] * vocab_size
        types = [tt.NORMAL] * vocab_size
        for t, i in mdl["vocab"].items():
            if i < vocab_size:
                tokens[i] = t
        for a in tj.get("added_tokens", []):
            if a["id"] < vocab_size:
                tokens[a["id"]] = a["content"]
                types[a["id"]] = tt.CONTROL if a.get("special") else tt.USER_DEFINED
        n_real = sum(t is not None for t in tokens)
        if max([i for i in mdl["vocab"].values()] + [a["id"] for a in tj.get("added_tokens", [])]) >= vocab_size:
            raise ExportError(f"{tok_path} has token ids >= the model's vocab_size {vocab_size}")
        for i in range(vocab_size):
            if tokens[i] is None:
                tokens[i] = f"[PAD{i}]"
                types[i] = tt.UNUSED
        merges = [" ".join(x) if isinstance(x, list) else x for x in mdl.get("merges", [])]
        pt = json.dumps(tj.get("pre_tokenizer")).replace("\\\\", "\\")
        pre = "gpt-4o" if GPT4O_MARK in pt else "qwen35" if QWEN35_MARK in pt else "qwen2"
        desc = f"{tok_path} ({n_real} tokens, {len(merges)} merges, pre-tokenizer {pre})"
        template = None
        tcfg = tok_path.parent / "tokenizer_config.json"
        jinja = tok_path.parent / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        elif tcfg.is_file():
            template = json.loads(tcfg.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            w.add_chat_template(template)
    else:
        byte_tokens = bytes_to_unicode()
        if vocab_size < 257:
            raise ExportError(f"vocab_size {vocab_size} is too small for a byte-level vocabulary")
        # llama.cpp refuses a BPE vocabulary without merges: one merge, "Ġ Ġ" -> "ĠĠ" (id 256)
        tokens = [byte_tokens[i] if i < 256 else f"[PAD{i}]" for i in range(vocab_size)]
        types = [tt.NORMAL if i < 257 else tt.UNUSED for i in range(vocab_size)]
        space = byte_tokens[ord(" ")]
        tokens[256] = space + space
        merges = [f"{space} {space}"]
        pre = "qwen2"
        if eos is not None and 257 <= eos < vocab_size:
            tokens[eos] = "<|endoftext|>"
            types[eos] = tt.CONTROL
        desc = (f"byte-level placeholder ({vocab_size} ids: 256 bytes, one merge, padding; no tokenizer.json "
                "in the model directory and no --tokenizer)")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    w.add_token_merges(merges)
    if eos is not None and 0 <= int(eos) < vocab_size:
        w.add_eos_token_id(int(eos))
        w.add_bos_token_id(int(eos))
        w.add_pad_token_id(int(eos))
    w.add_add_bos_token(False)
    return desc


# ---------------------------------------------------------------------------------------------


def default_llama_quantize() -> str | None:
    env = os.environ.get("LLAMA_QUANTIZE")
    if env:
        return env
    cache = Path(os.environ.get("MOEFLUX_BENCH_CACHE", Path(__file__).resolve().parent.parent / "target" / "bench"))
    cand = cache / "llama.cpp-build" / "bin" / "llama-quantize"
    return str(cand) if cand.is_file() else None


GGUF_ARCH = {"qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next", "gpt_oss": "gpt-oss",
             "qwen3_moe": "qwen3moe", "glm4_moe": "glm4moe"}


def write_gguf(model: Model, out: Path, want_q41: bool, tokenizer: Path | None, quiet: bool) -> dict:
    ex = Exporter(model, want_q41)
    ex.build()
    w = gguf.GGUFWriter(None, GGUF_ARCH[model.arch])
    ex.write_kv(w, model.root.name)
    vocab_desc = write_vocab(w, model, tokenizer)
    types = {o.qtype for o in ex.outs}
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE if gguf.GGMLQuantizationType.MXFP4 in types
                    else gguf.LlamaFileType.MOSTLY_Q4_1 if gguf.GGMLQuantizationType.Q4_1 in types
                    else gguf.LlamaFileType.ALL_F32)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for o in ex.outs:
        w.add_tensor_info(o.name, o.shape, np.dtype(np.float32), o.nbytes, raw_dtype=o.qtype)
    w.write_header_to_file(out)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.time()
    total = sum(o.nbytes for o in ex.outs)
    done = 0
    for k, o in enumerate(ex.outs):
        a = o.produce()
        if a.nbytes != o.nbytes:
            raise ExportError(f"{o.name}: produced {a.nbytes} bytes, planned {o.nbytes}")
        w.write_tensor_data(a)
        ex.counts[o.qtype.name] += 1
        done += o.nbytes
        del a
        if not quiet and sys.stderr.isatty() and (k % 16 == 15 or k == len(ex.outs) - 1):
            print(f"\rmoeflux2gguf: {done / 1e9:.2f} / {total / 1e9:.2f} GB "
                  f"({time.time() - t0:.0f} s)", end="", file=sys.stderr, flush=True)
    if not quiet and sys.stderr.isatty():
        print(file=sys.stderr)
    w.close()
    return {"tensors": dict(ex.counts), "bytes": total, "vocab": vocab_desc}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Export a moeflux model directory as a GGUF for llama.cpp.",
                                 epilog="See the module docstring (head of this file) for the exact mapping.")
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", choices=["q4_1", "q4_0", "f32"], default="q4_1")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer.json to use when MODEL_DIR has none")
    ap.add_argument("--llama-quantize", help="llama-quantize binary for --type q4_0 "
                    "(default: $LLAMA_QUANTIZE, else the one bench/setup.sh builds)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="threads for llama-quantize")
    ap.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)

    out: Path = args.out
    if out.exists() and not args.force:
        print(f"moeflux2gguf: error: {out} exists (use --force to overwrite)", file=sys.stderr)
        return 1
    if args.tokenizer is not None and not args.tokenizer.is_file():
        print(f"moeflux2gguf: error: --tokenizer {args.tokenizer}: no such file", file=sys.stderr)
        return 1
    quantize_bin = None
    if args.type == "q4_0":
        quantize_bin = args.llama_quantize or default_llama_quantize()
        if not quantize_bin or not Path(quantize_bin).is_file():
            print("moeflux2gguf: error: --type q4_0 needs llama.cpp's llama-quantize: run bench/setup.sh "
                  "or pass --llama-quantize PATH", file=sys.stderr)
            return 1
    out.parent.mkdir(parents=True, exist_ok=True)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    tmpdir = tempfile.mkdtemp(prefix=f".{out.name}.tmp.", dir=out.parent)
    t0 = time.time()
    try:
        model = Model(args.model_dir)
        tmp = Path(tmpdir) / "model.gguf"
        info = write_gguf(model, tmp, args.type != "f32", args.tokenizer, args.quiet)
        if args.type == "q4_0":
            tmp0 = Path(tmpdir) / "model-q4_0.gguf"
            r = subprocess.run([quantize_bin, "--allow-requantize", str(tmp), str(tmp0), "Q4_0",
                                str(args.threads)], capture_output=True, text=True)
            if r.returncode != 0 or not tmp0.is_file():
                raise ExportError(f"llama-quantize failed (status {r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
            tmp.unlink()
            tmp = tmp0
            info["requantized_with"] = f"{quantize_bin} --allow-requantize Q4_1 -> Q4_0"
        os.replace(tmp, out)
    except ExportError as e:
        print(f"moeflux2gguf: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("moeflux2gguf: interrupted; nothing written", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    info.update({"out": str(out), "type": args.type, "arch": model.arch, "seconds": round(time.time() - t0, 1),
                 "size_bytes": out.stat().st_size})
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
