#!/usr/bin/env python3
"""A random, real-width, depth-truncated Qwen3.6-35B-A3B checkpoint in mlx-lm's layout (for
`moeflux convert`), written with numpy alone. (Written before `moeflux synth`, which generates
moeflux model directories directly; this one also makes shrunk and Qwen3-Next-layout variants
for bench/check_gguf_export.py --model-dir.)

usage: random_mlx_model.py OUT_DIR [--layers 8] [--seed 0] [--experts 256] [--vocab 248320]

Widths are Qwen3.6-35B-A3B's (moeflux-spec.md section 2): hidden 2048, vocab 248,320, 256
experts top-8 (norm_topk_prob), expert and shared-expert intermediate 512, linear attention
16 k-heads x 128 and 32 v-heads x 128 (conv kernel 4), full attention every 4th layer with
16 heads x 256 (2 KV heads, partial rotary 0.25, theta 1e7, mrope [11, 11, 10]). Quantization
as the real 4-bit MLX checkpoint: affine 4-bit g64 everywhere (embedding and LM head
included) except the router and shared-expert gate (8-bit g64); A_log in BF16.

Values are random and only meant for speed: codes uniform; per-group scales ~U(0.5, 1.5) x
1/(4.6 sqrt(fan_in)) with bias -8 x scale (so weights have mean ~0 and std ~1/sqrt(fan_in)),
all rounded to bf16; norms 1; A_log = log U(1, 16); dt_bias 1; conv ~N(0, 0.1). The text it
generates is gibberish; there is no tokenizer. Written to OUT_DIR.tmp.* and renamed at the end.
--experts and --vocab shrink the model (all other widths stay real) for export checks;
--arch qwen3_next writes the same widths in Qwen3-Next's layout (no dense-MLP layers).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

H, VOCAB, E, K, I_EXP, I_SH = 2048, 248320, 256, 8, 512, 512
NK, NV, DK, DV, CONV_K = 16, 32, 128, 128, 4
NH, NKV, HD = 16, 2, 256
GS = 64


def bf16(a: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bits (round to nearest even)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


class Writer:
    def __init__(self):
        self.plan = []  # (name, dtype, shape, producer)

    def add(self, name, dtype, shape, produce):
        self.plan.append((name, dtype, tuple(shape), produce))

    def quant(self, rng, name, rows, cols, bits=4):
        def codes():
            return rng.integers(0, 2**32, size=(rows, cols * bits // 32), dtype=np.uint32)

        base = 1.0 / (((2**bits - 1) / np.sqrt(12)) * np.sqrt(cols))
        scales = (base * rng.uniform(0.5, 1.5, size=(rows, cols // GS))).astype(np.float32)
        s16 = bf16(scales)
        s32 = (s16.astype(np.uint32) << 16).view(np.float32)
        b16 = bf16(-(2 ** (bits - 1)) * s32)
        self.add(name + ".weight", "U32", (rows, cols * bits // 32), codes)
        self.add(name + ".scales", "BF16", (rows, cols // GS), lambda: s16)
        self.add(name + ".biases", "BF16", (rows, cols // GS), lambda: b16)

    def quant_experts(self, rng, name, rows, cols, E):
        def codes():
            return rng.integers(0, 2**32, size=(E, rows, cols // 8), dtype=np.uint32)

        base = 1.0 / ((15 / np.sqrt(12)) * np.sqrt(cols))

        def scales():
            return bf16(base * rng.uniform(0.5, 1.5, size=(E, rows, cols // GS)))

        s16 = scales()
        s32 = (s16.astype(np.uint32) << 16).view(np.float32)
        b16 = bf16(-8 * s32)
        self.add(name + ".weight", "U32", (E, rows, cols // 8), codes)
        self.add(name + ".scales", "BF16", (E, rows, cols // GS), lambda: s16)
        self.add(name + ".biases", "BF16", (E, rows, cols // GS), lambda: b16)

    def write(self, path: Path):
        size = {"U32": 4, "BF16": 2, "F32": 4}
        header, off = {"__metadata__": {"format": "mlx"}}, 0
        for name, dt, shape, _ in self.plan:
            n = int(np.prod(shape)) * size[dt]
            header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        with open(path, "wb") as f:
            f.write(len(hb).to_bytes(8, "little"))
            f.write(hb)
            for name, dt, shape, produce in self.plan:
                a = np.ascontiguousarray(produce())
                assert a.shape == shape and a.nbytes == int(np.prod(shape)) * size[dt], name
                a.tofile(f)
        return off


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--arch", choices=["qwen3_5_moe", "qwen3_next"], default="qwen3_5_moe",
                    help="qwen3_next: the same widths in Qwen3-Next's layout (fused in_proj_qkvz/ba)")
    args = ap.parse_args()
    nxt = args.arch == "qwen3_next"
    E, VOCAB = args.experts, args.vocab
    if E < K or VOCAB < 512 or VOCAB % 64:
        print("random_mlx_model: error: need --experts >= 8 and --vocab a multiple of 64 >= 512", file=sys.stderr)
        return 1
    if args.out.exists():
        print(f"random_mlx_model: error: {args.out} exists", file=sys.stderr)
        return 1
    rng = np.random.default_rng(args.seed)
    L = args.layers
    P = "model." if nxt else "language_model.model."
    w = Writer()
    w.quant(rng, P + "embed_tokens", VOCAB, H)
    w.add(P + "norm.weight", "BF16", (H,), lambda: bf16(np.ones(H)))
    w.quant(rng, "lm_head" if nxt else "language_model.lm_head", VOCAB, H)
    qcfg = {"group_size": GS, "bits": 4, "mode": "affine"}
    for i in range(L):
        p = f"{P}layers.{i}."
        w.add(p + "input_layernorm.weight", "BF16", (H,), lambda: bf16(np.ones(H)))
        w.add(p + "post_attention_layernorm.weight", "BF16", (H,), lambda: bf16(np.ones(H)))
        if (i + 1) % 4 == 0:
            a = p + "self_attn."
            w.quant(rng, a + "q_proj", NH * HD * 2, H)
            w.quant(rng, a + "k_proj", NKV * HD, H)
            w.quant(rng, a + "v_proj", NKV * HD, H)
            w.quant(rng, a + "o_proj", H, NH * HD)
            w.add(a + "q_norm.weight", "BF16", (HD,), lambda: bf16(np.ones(HD)))
            w.add(a + "k_norm.weight", "BF16", (HD,), lambda: bf16(np.ones(HD)))
        else:
            la = p + "linear_attn."
            conv = 2 * NK * DK + NV * DV
            if nxt:
                w.quant(rng, la + "in_proj_qkvz", conv + NV * DV, H)
                w.quant(rng, la + "in_proj_ba", 2 * NV, H)
            else:
                w.quant(rng, la + "in_proj_qkv", conv, H)
                w.quant(rng, la + "in_proj_z", NV * DV, H)
                w.quant(rng, la + "in_proj_b", NV, H)
                w.quant(rng, la + "in_proj_a", NV, H)
            w.quant(rng, la + "out_proj", H, NV * DV)
            w.add(la + "conv1d.weight", "BF16", (conv, CONV_K, 1),
                  lambda conv=conv: bf16(rng.normal(0, 0.1, size=(conv, CONV_K, 1))))
            w.add(la + "A_log", "BF16", (NV,), lambda: bf16(np.log(rng.uniform(1, 16, size=NV))))
            w.add(la + "dt_bias", "BF16", (NV,), lambda: bf16(np.ones(NV)))
            w.add(la + "norm.weight", "BF16", (DV,), lambda: bf16(np.ones(DV)))
        m = p + "mlp."
        w.quant(rng, m + "gate", E, H, bits=8)
        w.quant(rng, m + "shared_expert_gate", 1, H, bits=8)
        qcfg[m + "gate"] = {"group_size": GS, "bits": 8}
        qcfg[m + "shared_expert_gate"] = {"group_size": GS, "bits": 8}
        w.quant_experts(rng, m + "switch_mlp.gate_proj", I_EXP, H, E)
        w.quant_experts(rng, m + "switch_mlp.up_proj", I_EXP, H, E)
        w.quant_experts(rng, m + "switch_mlp.down_proj", H, I_EXP, E)
        w.quant(rng, m + "shared_expert.gate_proj", I_SH, H)
        w.quant(rng, m + "shared_expert.up_proj", I_SH, H)
        w.quant(rng, m + "shared_expert.down_proj", H, I_SH)
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False, "eos_token_id": 248046,
        "quantization": qcfg, "quantization_config": qcfg,
        "text_config": {
            "model_type": "qwen3_5_moe_text", "hidden_size": H, "num_hidden_layers": L,
            "full_attention_interval": 4, "num_attention_heads": NH, "num_key_value_heads": NKV,
            "head_dim": HD, "linear_num_value_heads": NV, "linear_num_key_heads": NK,
            "linear_key_head_dim": DK, "linear_value_head_dim": DV, "linear_conv_kernel_dim": CONV_K,
            "num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": I_EXP,
            "shared_expert_intermediate_size": I_SH, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
            "vocab_size": VOCAB, "max_position_embeddings": 262144, "tie_word_embeddings": False,
            "hidden_act": "silu", "attention_bias": False, "eos_token_id": 248046,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        },
    }
    if nxt:
        tc = dict(config.pop("text_config"))
        tc.pop("rope_parameters")
        tc.update({"model_type": "qwen3_next", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                   "decoder_sparse_step": 1, "mlp_only_layers": [], "intermediate_size": I_SH})
        config.update(tc)
        config["architectures"] = ["Qwen3NextForCausalLM"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=args.out.name + ".tmp.", dir=args.out.parent))
    try:
        n = w.write(tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tmp.rename(args.out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote {args.out}: {L} layers, {n / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
