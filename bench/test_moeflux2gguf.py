#!/usr/bin/env python3
"""Tests of bench/moeflux2gguf.py (a few seconds; numpy + gguf, i.e. the bench/setup.sh venv):

    target/bench/venv/bin/python -m unittest bench/test_moeflux2gguf.py -v

* MXFP4 repack: every code (all 16, -0 included) at the extreme e8m0 scales, written in
  docs/FORMAT.md's layout, repacked by the exporter and dequantized by gguf-py's copy of ggml's
  dequantizer, equals FORMAT.md's formula e2m1(q) * 2^(s-127) computed independently in
  float64; scale byte 255 (NaN in moeflux) is refused.
* gpt-oss export: the gptoss-q4 fixture, converted by the moeflux binary (target/release or
  target/debug; skipped without one), with affine experts (-> Q4_1) and with its experts
  replaced by random MXFP4 ones (bench/mxfp4_experts.py; -> MXFP4): every tensor llama.cpp's
  gpt-oss loader asks for is there with its shape, the metadata it reads is there, and the
  native export dequantizes bit for bit to the F32 export (check_gguf_export.repack_check).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import gguf  # noqa: E402

import moeflux2gguf as m2g  # noqa: E402

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def format_md_value(code: int, s: int) -> float:
    """docs/FORMAT.md, independently of the exporter: sign bit 3, magnitude bits 0-2, 2^(s-127)."""
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7] * math.ldexp(1.0, s - 127)


def pack_codes(q: np.ndarray) -> np.ndarray:
    """uint8 codes (rows, cols) -> FORMAT.md's U32 words: element j at bits [4j, 4j+4), LSB first."""
    rows, cols = q.shape
    words = np.zeros((rows, cols // 8), dtype=np.uint32)
    for j in range(cols):
        words[:, j // 8] |= q[:, j].astype(np.uint32) << np.uint32(4 * (j % 8))
    return words


class Mxfp4Repack(unittest.TestCase):
    @np.errstate(over="ignore")  # 6 * 2^127 is inf in f32, in ggml and moeflux alike
    def test_every_code_and_extreme_scales_dequantize_exactly(self):
        scales = [0, 1, 2, 3, 100, 127, 128, 200, 253, 254]
        rows, cols = len(scales), 64
        rng = np.random.default_rng(1)
        q = np.empty((rows, cols), dtype=np.uint8)
        q[:, :16] = np.arange(16)          # group 0: every code in order
        q[:, 16:32] = np.arange(16)[::-1]
        q[:, 32:] = rng.integers(0, 16, (rows, 32))
        e = np.empty((rows, 2), dtype=np.uint8)
        e[:, 0] = scales
        e[:, 1] = scales[::-1]
        codes = pack_codes(q).view(np.uint8)
        blocks = m2g.convert_q(m2g.QTensor(codes, e, None, 4, 32, cols, "mxfp4"), True, "t")
        self.assertEqual(blocks.shape, (rows, cols // 32 * 17))
        ggml = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4).reshape(rows, cols)
        want = np.array([[format_md_value(int(q[r, j]), int(e[r, j // 32])) for j in range(cols)]
                         for r in range(rows)]).astype(np.float32)  # float64 -> f32: exact or inf
        self.assertTrue(np.array_equal(ggml, want))  # == treats -0 (code 8) as +0, ggml's value
        ours = m2g.convert_q(m2g.QTensor(codes, e, None, 4, 32, cols, "mxfp4"), False, "t")
        self.assertTrue(np.array_equal(ours.view(np.uint32), want.view(np.uint32)))  # -0 kept
        # the block bytes themselves: e unchanged, then element j and j+16 in one byte
        self.assertEqual(blocks[3, 0], scales[3])
        self.assertEqual(blocks[3, 1], q[3, 0] | q[3, 16] << 4)

    def test_scale_255_is_refused(self):
        codes = np.zeros((1, 16), dtype=np.uint8)
        e = np.array([[255]], dtype=np.uint8)
        with self.assertRaisesRegex(m2g.ExportError, "255"):
            m2g.convert_q(m2g.QTensor(codes, e, None, 4, 32, 32, "mxfp4"), True, "t")


def moeflux_binary() -> Path | None:
    for p in (REPO / "target" / "release" / "moeflux", REPO / "target" / "debug" / "moeflux"):
        if p.is_file():
            return p
    return None


@unittest.skipIf(moeflux_binary() is None, "no moeflux binary (cargo build -p moeflux-cli)")
class GptOssExport(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="moeflux2gguf-test.")
        t = Path(cls.tmp.name)
        cls.affine = t / "affine"
        r = subprocess.run([str(moeflux_binary()), "convert", str(REPO / "tests/fixtures/gptoss-q4/src"),
                            str(cls.affine)], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(r.stderr)
        cls.mx = t / "mxfp4"
        r = subprocess.run([sys.executable, str(HERE / "mxfp4_experts.py"), str(cls.affine), str(cls.mx)],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(r.stderr)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def export(self, model: Path, native: bool) -> Path:
        out = Path(self.tmp.name) / f"{model.name}-{'native' if native else 'f32'}.gguf"
        if not out.exists():
            m2g.write_gguf(m2g.Model(model), out, native, None, True)
        return out

    def check(self, model: Path, expert_type):
        import check_gguf_export as chk

        path = self.export(model, True)
        r = gguf.GGUFReader(path)
        cfg = json.loads((model / "config.json").read_text())
        L, H, E = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_local_experts"]
        ff, hd, nh, nkv, V = (cfg["intermediate_size"], cfg["head_dim"], cfg["num_attention_heads"],
                              cfg["num_key_value_heads"], cfg["vocab_size"])
        # ggml order (innermost first), as src/models/openai-moe.cpp creates them
        want = {"token_embd.weight": [H, V], "output_norm.weight": [H], "output.weight": [H, V]}
        for i in range(L):
            b = f"blk.{i}."
            want.update({
                b + "attn_norm.weight": [H], b + "post_attention_norm.weight": [H],
                b + "attn_q.weight": [H, nh * hd], b + "attn_q.bias": [nh * hd],
                b + "attn_k.weight": [H, nkv * hd], b + "attn_k.bias": [nkv * hd],
                b + "attn_v.weight": [H, nkv * hd], b + "attn_v.bias": [nkv * hd],
                b + "attn_output.weight": [nh * hd, H], b + "attn_output.bias": [H],
                b + "attn_sinks.weight": [nh],
                b + "ffn_gate_inp.weight": [H, E], b + "ffn_gate_inp.bias": [E],
                b + "ffn_gate_exps.weight": [H, ff, E], b + "ffn_gate_exps.bias": [ff, E],
                b + "ffn_up_exps.weight": [H, ff, E], b + "ffn_up_exps.bias": [ff, E],
                b + "ffn_down_exps.weight": [ff, H, E], b + "ffn_down_exps.bias": [H, E],
            })
        got = {t.name: [int(x) for x in t.shape] for t in r.tensors}
        self.assertEqual(got, want)
        types = {t.name: t.tensor_type for t in r.tensors}
        self.assertEqual(types["blk.0.ffn_up_exps.weight"], expert_type)
        self.assertEqual(types["blk.0.attn_sinks.weight"], gguf.GGMLQuantizationType.F32)
        kv = {k: f.contents() for k, f in r.fields.items()}
        self.assertEqual(kv["general.architecture"], "gpt-oss")
        self.assertEqual(kv["gpt-oss.attention.sliding_window"], cfg["sliding_window"])
        self.assertEqual(kv["gpt-oss.attention.sliding_window_pattern"],
                         [t == "sliding_attention" for t in cfg["layer_types"]])
        self.assertEqual(kv["gpt-oss.rope.scaling.type"], "yarn")
        self.assertEqual(kv["gpt-oss.rope.scaling.factor"], cfg["rope_scaling"]["factor"])
        self.assertEqual(kv["gpt-oss.rope.scaling.original_context_length"],
                         cfg["rope_scaling"]["original_max_position_embeddings"])
        self.assertEqual(kv["gpt-oss.rope.dimension_count"], hd)
        self.assertEqual(kv["gpt-oss.expert_count"], E)
        self.assertEqual(kv["gpt-oss.expert_feed_forward_length"], ff)
        rep = chk.repack_check(self.export(model, False), path)
        self.assertTrue(rep["bitwise_equal"])
        return rep

    def test_affine_experts_become_q4_1(self):
        rep = self.check(self.affine, gguf.GGMLQuantizationType.Q4_1)
        self.assertEqual(rep["mxfp4_tensors"], 0)

    def test_mxfp4_experts_stay_mxfp4(self):
        rep = self.check(self.mx, gguf.GGMLQuantizationType.MXFP4)
        self.assertEqual(rep["mxfp4_tensors"], 3 * 4)


if __name__ == "__main__":
    unittest.main()
