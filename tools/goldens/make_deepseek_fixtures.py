#!/usr/bin/env python3
"""Regenerate moeflux's DeepSeek-V3-family fixtures (MLA, noaux_tc routing, dense first
layers, YaRN): tiny random checkpoints plus float32 golden logits.

    HF_HUB_OFFLINE=1 python tools/goldens/make_deepseek_fixtures.py            # -> tests/fixtures/
    HF_HUB_OFFLINE=1 python tools/goldens/make_deepseek_fixtures.py --out DIR

Uses the helpers of make_fixtures.py (same tokenizer, same golden procedure) and adds what
DeepSeek needs:

* dequantize_f32 also dequantizes mlx-lm's QuantizedMultiLinear (MLA `embed_q` /
  `unembed_out`), in float32;
* the router (`mlp.gate.weight`, a plain parameter mlx-lm never quantizes) and the
  `e_score_correction_bias` are drawn at random (mlx initialises both to zeros, which would
  make every expert tie);
* the prompt is chosen so that every group choice and every top-k choice of the noaux_tc
  router is separated by a margin (RouterProbe below);
* the goldens run in float32 because mlx's bf16 MLA decode (absorbed) and prefill
  (decompressed) paths disagree by ~0.8 logits (see /work/shared/reference/oracle.md).

Fixtures:
* deepseekv3-q4/: deepseek_v3, 3 layers (layer 0 dense), q_lora 64, kv_lora 64, nope 64,
  rope 32, v 64, 4 heads, 16 experts top-4 in 4 groups (topk_group 2), routed scaling 2.5,
  1 shared expert, YaRN factor 40 (mscale = mscale_all_dim = 1), 4-bit g64.
* kimik2-q4/: model_type kimi_k2 (same architecture): q_lora_rank null (plain q_proj),
  1 group, 2 shared experts, YaRN with mscale 1.0 vs mscale_all_dim 0.707 (so the rope
  input scaling is not 1), norm_topk_prob false, 4-bit g64.
* deepseekv3-legacy-q4/: an older mlx-lm checkpoint with kv_b_proj quantized unsplit;
  expected_split.safetensors is current mlx-lm's split and re-quantized embed_q/unembed_out.
* deepseekv3-fp8/: Hugging Face layout in FP8 e4m3 with 128x128 block scales
  (`weight_scale_inv`), unsplit `kv_b_proj`, per-expert tensors, an MTP layer to drop;
  expected_mlx/ is the real `mlx_lm.convert -q` output, and the golden is for it;
  e4m3_table.npy is mlx's float32 decode of all 256 e4m3 codes.
"""
import argparse
import copy
import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402
from make_fixtures import BF16, F32, GS, H, V, mx, nn  # noqa: E402
from mlx.utils import tree_flatten, tree_map, tree_map_with_path, tree_unflatten  # noqa: E402

_BASE_DEQUANTIZE_F32 = mf.dequantize_f32
FP8_BLOCK = 128
# Linear weights a DeepSeek-V3 FP8 release stores as e4m3 (everything in the layers except
# norms, the router and its bias).
FP8_SUFFIXES = ("q_a_proj.weight", "q_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight",
                "kv_b_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight",
                "down_proj.weight")


def deepseek_config(*, model_type="deepseek_v3", q_lora=64, n_group=4, topk_group=2, shared=1,
                    mscale=1.0, mscale_all_dim=1.0, norm_topk=True, layers=3, experts=16, topk=4):
    return {
        "model_type": model_type, "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": V, "hidden_size": H, "intermediate_size": 192, "moe_intermediate_size": 64,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_shared_experts": shared, "n_routed_experts": experts, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 64, "q_lora_rank": q_lora, "qk_rope_head_dim": 32, "v_head_dim": 64,
        "qk_nope_head_dim": 64, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": norm_topk, "n_group": n_group, "topk_group": topk_group,
        "num_experts_per_tok": topk, "moe_layer_freq": 1, "first_k_dense_replace": 1,
        "max_position_embeddings": 4096 * 40, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": mscale,
                         "mscale_all_dim": mscale_all_dim},
        "attention_bias": False, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 2,
    }


def build_random_deepseek(config, seed):
    """make_fixtures.build_random_model plus a random router and correction bias."""
    model = mf.build_random_model(config, seed)
    rng = np.random.default_rng(seed + 17)
    repl = {}
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("mlp.gate.weight"):
            repl[k] = mx.array((rng.uniform(-1, 1, v.shape) / np.sqrt(H) * 2).astype(np.float32))
        elif k.endswith("e_score_correction_bias"):
            repl[k] = mx.array(rng.uniform(-0.1, 0.1, v.shape).astype(np.float32))
    model.update(tree_map_with_path(lambda p, v: repl.get(p, v), model.parameters()))
    mx.eval(model.parameters())
    return model


def dequantize_f32(model):
    """make_fixtures.dequantize_f32 plus QuantizedMultiLinear -> MultiLinear in f32."""
    from mlx_lm.models.mla import MultiLinear, QuantizedMultiLinear
    layers = []
    for name, m in model.named_modules():
        if isinstance(m, QuantizedMultiLinear):
            w = mx.dequantize(m.weight, m.scales.astype(F32), m.biases.astype(F32),
                              m.group_size, m.bits, m.mode, dtype=F32)
            nm = MultiLinear(w.shape[2], w.shape[1], w.shape[0])
            nm.weight = w
            layers.append((name, nm))
    if layers:
        model.update_modules(tree_unflatten(layers))
    return _BASE_DEQUANTIZE_F32(model)


class RouterProbe:
    """Smallest separation of the noaux_tc router's decisions over tokens and layers: the
    topk_group-th vs the next group score, and the k-th vs (k+1)-th masked biased score."""

    def __enter__(self):
        from mlx_lm.models import deepseek_v3 as ds
        self.cls, self.orig, self.gaps = ds.DeepseekV3MoE, ds.DeepseekV3MoE.__call__, []
        probe = self

        def patched(s, x):
            g = s.gate
            logits = np.array((x @ g.weight.T).astype(F32)).reshape(-1, g.n_routed_experts)
            sc = 1 / (1 + np.exp(-logits.astype(np.float64))) + np.array(g.e_score_correction_bias)
            if g.n_group > 1:
                grp = sc.reshape(sc.shape[0], g.n_group, -1)
                gscore = np.sort(grp, -1)[..., -2:].sum(-1)  # [tokens, groups]
                gs = np.sort(gscore, -1)
                probe.gaps.append(float((gs[:, -g.topk_group] - gs[:, -g.topk_group - 1]).min()))
                drop = np.argsort(gscore, -1)[:, : g.n_group - g.topk_group]
                for r in range(sc.shape[0]):
                    grp[r, drop[r], :] = 0.0  # mlx-lm fills dropped groups with 0.0
                sc = grp.reshape(sc.shape)
            srt = np.sort(sc, -1)
            probe.gaps.append(float((srt[:, -g.top_k] - srt[:, -g.top_k - 1]).min()))
            return probe.orig(s, x)

        ds.DeepseekV3MoE.__call__ = patched
        return self

    def __exit__(self, *a):
        self.cls.__call__ = self.orig


def golden(fixdir, ckpt, seed, description, checkpoint_rel, extra):
    # make_fixtures' golden procedure with this module's dequantizer and router probe.
    saved = (mf.dequantize_f32, mf.RouterProbe)
    mf.dequantize_f32, mf.RouterProbe = dequantize_f32, RouterProbe
    try:
        return mf.golden_from_checkpoint(fixdir, ckpt, seed, description, checkpoint_rel, extra=extra)
    finally:
        mf.dequantize_f32, mf.RouterProbe = saved


def build_mlx_fixture(src: Path, config, seed, tok_json):
    model = build_random_deepseek(config, seed)
    mf.cast_like_convert(model, config)
    model, qconfig = mf.quantize_model(model, config, GS, 4)
    mx.eval(model.parameters())
    mf.save_model(src, model)
    mf.save_config(qconfig, src / "config.json")
    mf.write_tokenizer(src, tok_json)


# --------------------------------------------------------------------------------------
# Hugging Face FP8 layout
# --------------------------------------------------------------------------------------
def unsanitize(params, cfg, rng):
    """mlx-lm parameter dict -> DeepSeek-V3 HF names: kv_b_proj re-fused per head
    ([k_nope rows (embed_q transposed) | v rows]), experts unstacked, plus an MTP layer."""
    hf = {}
    nope, heads = cfg["qk_nope_head_dim"], cfg["num_attention_heads"]
    for k, v in params.items():
        if k.endswith("self_attn.embed_q.weight"):
            p = k[: -len("embed_q.weight")]
            wk = v.swapaxes(-1, -2)  # [heads, nope, kv_lora]
            wv = params[p + "unembed_out.weight"]  # [heads, v, kv_lora]
            hf[p + "kv_b_proj.weight"] = mx.concatenate([wk, wv], axis=1).reshape(heads * (nope + wv.shape[1]), -1)
        elif k.endswith("self_attn.unembed_out.weight"):
            continue
        elif ".mlp.switch_mlp." in k:
            p, proj = k.split(".mlp.switch_mlp.")
            proj = proj[: -len(".weight")]
            for e in range(v.shape[0]):
                hf[f"{p}.mlp.experts.{e}.{proj}.weight"] = v[e]
        else:
            hf[k] = v
    # DeepSeek-V3's multi-token-prediction layer is `model.layers.61` (mlx-lm drops that
    # index literally; moeflux drops every layer index >= num_hidden_layers).
    hf["model.layers.61.eh_proj.weight"] = mx.array(
        (0.02 * rng.standard_normal((H, 2 * H))).astype(np.float32)).astype(BF16)
    return hf


def fp8_encode(w: np.ndarray):
    """float [m, n] -> (e4m3 codes uint8 [m, n], f32 scale_inv [ceil(m/128), ceil(n/128)])
    with w ~= decode(codes) * scale_inv per 128x128 block (amax maps to 448)."""
    m, n = w.shape
    bm, bn = -(-m // FP8_BLOCK), -(-n // FP8_BLOCK)
    scale = np.zeros((bm, bn), np.float32)
    codes = np.zeros((m, n), np.uint8)
    for i in range(bm):
        for j in range(bn):
            blk = w[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK]
            s = np.float32(max(float(np.abs(blk).max()), 1e-12) / 448.0)
            scale[i, j] = s
            codes[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] = np.array(
                mx.to_fp8(mx.array((blk / s).astype(np.float32))))
    return codes, scale


def write_e4m3_table(path: Path):
    """mlx's decode of every e4m3 code (mx.from_fp8, float32) as a [256] .npy: the
    reference the engine's FP8 decoder is tested against."""
    codes = mx.array(np.arange(256, dtype=np.uint8))
    np.save(path, np.array(mx.from_fp8(codes, dtype=F32)).astype(np.float32))


def write_safetensors(path: Path, tensors):
    """tensors: name -> (dtype string, shape, bytes). Writes F8_E4M3, which mx cannot."""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for k in sorted(tensors, key=mf.natural_key):
        dt, shape, b = tensors[k]
        header[k] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for k in sorted(tensors, key=mf.natural_key):
            f.write(tensors[k][2])


def build_fp8_fixture(fixdir: Path, config, seed, tok_json):
    src, exp = fixdir / "src", fixdir / "expected_mlx"
    src.mkdir(parents=True)
    model = build_random_deepseek(copy.deepcopy(config), seed)
    mf.cast_like_convert(model, copy.deepcopy(config))
    params = dict(tree_flatten(model.parameters()))
    hf = unsanitize(params, config, np.random.default_rng(seed + 1))
    out = {}
    n_fp8 = 0
    for k, v in hf.items():
        if k.startswith("model.layers.") and k.endswith(FP8_SUFFIXES) and v.ndim == 2:
            codes, scale = fp8_encode(np.array(v.astype(F32)))
            out[k] = ("F8_E4M3", codes.shape, codes.tobytes())
            out[k + "_scale_inv"] = ("F32", scale.shape, scale.tobytes())
            n_fp8 += 1
        else:
            a = np.array(v.astype(F32))
            if v.dtype == BF16:
                out[k] = ("BF16", a.shape, (a.view(np.uint32) >> 16).astype(np.uint16).tobytes())
            else:
                out[k] = ("F32", a.shape, a.astype(np.float32).tobytes())
    write_safetensors(src / "model.safetensors", out)
    index = {"metadata": {"total_size": sum(len(t[2]) for t in out.values())},
             "weight_map": {k: "model.safetensors" for k in sorted(out, key=mf.natural_key)}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    cfg = copy.deepcopy(config)
    cfg["torch_dtype"] = "bfloat16"
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                  "quant_method": "fp8", "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (src / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 2, "do_sample": False}, indent=2) + "\n")
    mf.write_tokenizer(src, tok_json)
    print(f"  fp8: {n_fp8} e4m3 tensors with 128x128 block scales")
    write_e4m3_table(fixdir / "e4m3_table.npy")
    # mlx_lm.convert dequantizes the e4m3 blocks in sanitize(); check it quantized the result.
    cmd = mf.run_convert(src, exp)
    got = json.loads((exp / "config.json").read_text())
    assert got["quantization"]["bits"] == 4, got.get("quantization")
    return cmd


def build_legacy_mlx_fixture(fixdir: Path, config, seed, tok_json):
    """An mlx-lm checkpoint as older mlx-lm wrote it: kv_b_proj fused and quantized as one
    linear layer (no embed_q / unembed_out). expected_split.safetensors holds what current
    mlx-lm's sanitize makes of it (dequantize in bf16, split, quantize again)."""
    src = fixdir / "src"
    src.mkdir(parents=True)
    model = build_random_deepseek(config, seed)
    mf.cast_like_convert(model, config)
    params = dict(tree_flatten(model.parameters()))
    heads, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
    fused = {}
    for k, v in params.items():
        if k.endswith("self_attn.embed_q.weight"):
            p = k[: -len("embed_q.weight")]
            wv = params[p + "unembed_out.weight"]
            fused[p + "kv_b_proj"] = mx.concatenate([v.swapaxes(-1, -2), wv], axis=1).reshape(
                heads * (nope + wv.shape[1]), -1)
    qmodel, qconfig = mf.quantize_model(model, config, GS, 4)
    q = {k: v for k, v in tree_flatten(qmodel.parameters())
         if ".embed_q." not in k and ".unembed_out." not in k}
    for p, w in fused.items():
        q[p + ".weight"], q[p + ".scales"], q[p + ".biases"] = mx.quantize(w, GS, 4)
    mx.eval(q)
    mx.save_safetensors(str(src / "model.safetensors"), q, metadata={"format": "mlx"})
    mf.save_config(qconfig, src / "config.json")
    mf.write_tokenizer(src, tok_json)
    m, _ = mf.load_model(src)
    exp = {k: v for k, v in tree_flatten(m.parameters()) if ".embed_q." in k or ".unembed_out." in k}
    mx.save_safetensors(str(fixdir / "expected_split.safetensors"), exp, metadata={"format": "mlx"})
    print(f"  legacy: {len(fused)} quantized kv_b_proj, {len(exp)} split tensors expected")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=mf.REPO / "tests" / "fixtures")
    args = ap.parse_args()
    root = args.out
    root.mkdir(parents=True, exist_ok=True)
    mx.set_default_device(mx.cpu)
    tok_json, tok_info = mf.train_tokenizer()
    common = {"tokenizer": tok_info}

    def fresh(name):
        d = root / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        return d

    d = fresh("deepseekv3-q4")
    build_mlx_fixture(d / "src", deepseek_config(), 201, tok_json)
    golden(d, d / "src", 2001,
           "deepseek_v3, 3 layers (layer 0 dense MLP 192), MLA q_lora 64 kv_lora 64 nope 64 rope 32 "
           "v 64, 4 heads, 16 experts top-4 in 4 groups (topk_group 2), routed_scaling 2.5, "
           "1 shared expert, YaRN factor 40 (mscale = mscale_all_dim = 1), 4-bit g64, router bf16",
           "src", common)

    d = fresh("kimik2-q4")
    build_mlx_fixture(d / "src", deepseek_config(model_type="kimi_k2", q_lora=None, n_group=1,
                                                 topk_group=1, shared=2, mscale=1.0,
                                                 mscale_all_dim=0.707, norm_topk=False),
                      202, tok_json)
    golden(d, d / "src", 2002,
           "kimi_k2 (deepseek_v3 architecture), 3 layers (layer 0 dense), q_lora_rank null (q_proj), "
           "1 group, 2 shared experts, YaRN factor 40 with mscale 1.0 / mscale_all_dim 0.707, "
           "norm_topk_prob false, 4-bit g64", "src", common)

    d = fresh("deepseekv3-legacy-q4")
    build_legacy_mlx_fixture(d, deepseek_config(layers=2, experts=8, topk=2, n_group=2, topk_group=1),
                             204, tok_json)
    golden(d, d / "src", 2004,
           "deepseek_v3 as older mlx-lm wrote it: kv_b_proj quantized unsplit (4-bit g64); 2 layers "
           "(layer 0 dense), 8 experts top-2 in 2 groups; golden through current mlx-lm, whose "
           "sanitize splits kv_b_proj (expected_split.safetensors)", "src", common)

    d = fresh("deepseekv3-fp8")
    cmd = build_fp8_fixture(d, deepseek_config(experts=8, topk=2, n_group=2, topk_group=1), 203, tok_json)
    golden(d, d / "expected_mlx", 2003,
           "HF-layout deepseek_v3 in FP8 e4m3 with 128x128 weight_scale_inv blocks (kv_b_proj "
           "unsplit, per-expert tensors, MTP layer 61) in src/; expected_mlx/ is the real mlx_lm "
           "convert 4-bit g64 output; golden is for expected_mlx", "expected_mlx",
           {**common, "convert_command": cmd})
    print("done:", root)


if __name__ == "__main__":
    main()
