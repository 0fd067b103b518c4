#!/usr/bin/env python3
"""Regenerate moeflux's Qwen3-MoE, GLM-4.5 (glm4_moe) and Kimi-K2.5 (kimi_k25) fixtures:
tiny random checkpoints plus float32 golden logits.

    HF_HUB_OFFLINE=1 python tools/goldens/make_family_fixtures.py            # -> tests/fixtures/
    HF_HUB_OFFLINE=1 python tools/goldens/make_family_fixtures.py --out DIR

Uses the helpers of make_fixtures.py (tokenizer, random init, cast/quantize like
mlx_lm.convert, HF checkpoint writing, the real `mlx_lm convert`, golden procedure) and of
make_deepseek_fixtures.py (random router + e_score_correction_bias, f32 dequantization of
QuantizedMultiLinear, the noaux_tc router probe, MLA un-sanitize). What is new here:

* the router probes are pointed at qwen3_moe's Qwen3MoeSparseMoeBlock (softmax top-k) and
  glm4_moe's MoE (sigmoid noaux_tc with groups) instead of the classes they were written for;
* glm4_moe attention biases (q/k/v) are drawn as N(0, 0.5) so that a dropped bias moves the
  logits (mlx's default Linear bias init is tiny);
* in qwen3_moe and glm4_moe, `o_proj` keeps mlx's default init instead of x16 (see
  O_PROJ_GAIN: x16 made every late position predict the same token);
* un-sanitizers for the three Hugging Face layouts (per-expert tensors; GLM's MTP layer at
  model.layers.<num_hidden_layers>; Kimi-K2.5's `language_model.` prefix, unsplit kv_b_proj,
  vision_tower.* and mm_projector.*).

Fixtures (see tests/fixtures/README.md):
* qwen3moe-q4/: qwen3_moe, 4 layers (layer 1 dense via mlp_only_layers), 16 experts top-4,
  q/k RMSNorm, full rotary, untied; 4-bit g64, router 8-bit (quant_predicate).
* qwen3moe-hf/: HF bf16 qwen3_moe, decoder_sparse_step 2, 8 experts top-2, norm_topk_prob
  false, tied embeddings; expected_mlx/ from the real mlx_lm convert.
* glm4moe-q4/: glm4_moe, 4 layers (layer 0 dense), q/k/v biases, q/k norm, partial rotary 0.5,
  16 experts top-4 in 4 groups (topk_group 2), routed scaling 2.5, 1 shared expert; 4-bit g64.
* glm4moe-hf/: HF bf16 glm4_moe GLM-4.5-Air style (no qk norm, 1 group), MTP layer tensors
  at model.layers.3; expected_mlx/ from the real mlx_lm convert.
* kimik25-q4/: kimi_k25 (deepseek_v3 text model under text_config, `language_model.`
  prefix), q_lora 64, 16 experts top-4, 1 group, 1 shared expert; 4-bit g64.
* kimik25-hf/: HF bf16 kimi_k25 with vision_tower.* / mm_projector.* to drop; expected_mlx/
  from the real mlx_lm convert.
"""
import argparse
import copy
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402
import make_deepseek_fixtures as ds  # noqa: E402
from make_fixtures import BF16, F32, GS, H, V, mx  # noqa: E402
from mlx.utils import tree_flatten, tree_map_with_path  # noqa: E402

ATTN_BIAS_STD = 0.5
# o_proj gain of the GQA families (qwen3_moe, glm4_moe). make_fixtures multiplies every
# residual writer by 16; for plain softmax attention over random q/k that makes the
# attention output (a near-uniform running mean of the values, plus GLM's constant v bias)
# dominate the residual stream, so late positions all predict the same token (measured:
# qwen3moe-q4 continued with 8 identical tokens; glm4moe-hf's argmax took 4 distinct values
# over 32 positions) and the q/k-norm ablation moved the logits by only ~2.5. With o_proj at
# mlx's default init (gain 1) the continuations vary and that ablation moves them by ~10-18.
# down_proj keeps x16 and lm_head x8. kimi_k25 (MLA) keeps make_fixtures' x16 everywhere.
O_PROJ_GAIN = 1.0
# The Hugging Face fixtures use a smaller hidden size so that src/ (bf16) + expected_mlx/ +
# golden stay under ~1.5 MB per fixture (the embedding and lm_head alone are 256 KB each
# in bf16 at hidden 128).
H_HF = 64


# --------------------------------------------------------------------------------------
# configs (field sets as the real releases' config.json files carry them)
# --------------------------------------------------------------------------------------
def qwen3moe_config(*, hidden=H, layers=4, experts=16, topk=4, norm_topk=True, mlp_only=(1,),
                    sparse_step=1, tie=False, intermediate=192):
    """Qwen3-30B-A3B-style config.json (as transformers 4.51 wrote it: flat `rope_theta`,
    `num_experts`; transformers 5 writes `rope_parameters` / `num_local_experts`, which
    mlx-lm's qwen3_moe.ModelArgs cannot read)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 2,
        "decoder_sparse_step": sparse_step, "mlp_only_layers": list(mlp_only),
        "head_dim": 32, "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02,
        "intermediate_size": intermediate, "max_position_embeddings": 4096,
        "max_window_layers": layers, "moe_intermediate_size": 64, "norm_topk_prob": norm_topk,
        "num_attention_heads": 4, "num_experts": experts, "num_experts_per_tok": topk,
        "num_hidden_layers": layers, "num_key_value_heads": 2, "output_router_logits": False,
        "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": tie,
        "use_cache": True, "use_sliding_window": False, "vocab_size": V,
    }


def glm4moe_config(*, hidden=H, layers=4, experts=16, topk=4, n_group=4, topk_group=2,
                   scaling=2.5, shared=1, qk_norm=True, first_dense=1, intermediate=192, nextn=1):
    """GLM-4.5-style config.json (flat `rope_theta` / `partial_rotary_factor`,
    `rope_scaling: null`, explicit `head_dim`; mlx-lm's glm4_moe.ModelArgs requires all of
    them)."""
    return {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "attention_bias": True, "attention_dropout": 0.0, "pad_token_id": 0, "eos_token_id": [2, 0],
        "head_dim": 32, "hidden_act": "silu", "hidden_size": hidden, "partial_rotary_factor": 0.5,
        "initializer_range": 0.02, "intermediate_size": intermediate,
        "max_position_embeddings": 4096, "moe_intermediate_size": 64, "norm_topk_prob": True,
        "num_attention_heads": 4, "n_group": n_group, "topk_group": topk_group,
        "n_routed_experts": experts, "n_shared_experts": shared, "routed_scaling_factor": scaling,
        "num_experts_per_tok": topk, "first_k_dense_replace": first_dense,
        "num_hidden_layers": layers, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_scaling": None, "rope_theta": 1000000, "num_nextn_predict_layers": nextn,
        "tie_word_embeddings": False, "use_cache": True, "use_qk_norm": qk_norm, "vocab_size": V,
    }


def kimi_text_config(*, hidden=H, layers=3, experts=16, topk=4, heads=4):
    """Kimi-K2.5 text_config: the deepseek_v3 fields of make_deepseek_fixtures.deepseek_config
    with K2.5's scalar choices (1 group, 1 shared expert, routed scaling 2.827, rope_theta
    50000, YaRN factor 64, rms_norm_eps 1e-5; q_a/kv_a layernorms stay at mlx's fixed 1e-6)."""
    tc = ds.deepseek_config(model_type="kimi_k2", q_lora=64, n_group=1, topk_group=1, shared=1,
                            norm_topk=True, layers=layers, experts=experts, topk=topk)
    tc.update({
        "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
        "routed_scaling_factor": 2.827, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
        "max_position_embeddings": 4096 * 64, "num_nextn_predict_layers": 0,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    })
    return tc


def kimi_vision_config(hidden):
    """A miniature of Kimi-K2.5's MoonViT vision_config (same field names)."""
    return {
        "init_pos_emb_height": 4, "init_pos_emb_time": 4, "init_pos_emb_width": 4,
        "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_hidden_size": 16,
        "mm_projector_type": "patchmerger", "model_type": "", "patch_size": 4,
        "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
        "text_hidden_size": hidden, "video_attn_type": "spatial_temporal", "vt_hidden_size": 16,
        "vt_intermediate_size": 32, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1,
    }


def kimi_config(text_config):
    return {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0, "ignore_index": -100,
        "media_placeholder_token_id": 1000, "tie_word_embeddings": False,
        "use_unified_vision_chunk": True, "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "text_config": text_config, "vision_config": kimi_vision_config(text_config["hidden_size"]),
    }


def hf_fields(cfg, transformers_version):
    cfg = copy.deepcopy(cfg)
    cfg["torch_dtype"] = "bfloat16"
    cfg["transformers_version"] = transformers_version
    return cfg


# --------------------------------------------------------------------------------------
# random models
# --------------------------------------------------------------------------------------
def build_random(config, seed):
    """make_fixtures' random model (norms, residual gains, lm_head x8); for the sigmoid-router
    families also make_deepseek_fixtures' random router + correction bias; for glm4_moe
    q/k/v biases ~ N(0, 0.5)."""
    mt = config["model_type"]
    if mt == "qwen3_moe":
        model = mf.build_random_model(config, seed)  # router is an nn.Linear: random already
    else:
        model = ds.build_random_deepseek(config, seed)
    if mt in ("qwen3_moe", "glm4_moe"):
        rng = np.random.default_rng(seed + 29)
        repl = {}
        for k, v in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
            if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                repl[k] = mx.array((ATTN_BIAS_STD * rng.standard_normal(v.shape)).astype(np.float32))
            elif k.endswith("self_attn.o_proj.weight"):
                repl[k] = v * (O_PROJ_GAIN / mf.RESIDUAL_GAIN)  # exact: powers of two
        assert any(k.endswith("proj.bias") for k in repl) == bool(config.get("attention_bias"))
        model.update(tree_map_with_path(lambda p, v: repl.get(p, v), model.parameters()))
        mx.eval(model.parameters())
    return model


def build_mlx_fixture(src: Path, config, seed, tok_json, bits=4):
    model = build_random(config, seed)
    mf.cast_like_convert(model, config)
    model, qconfig = mf.quantize_model(model, config, GS, bits)
    mx.eval(model.parameters())
    mf.save_model(src, model)
    mf.save_config(qconfig, src / "config.json")
    mf.write_tokenizer(src, tok_json)
    return qconfig


# --------------------------------------------------------------------------------------
# router probes and golden
# --------------------------------------------------------------------------------------
def retarget_probe(probe_cls, attr, target_cls):
    """A router probe of make_fixtures / make_deepseek_fixtures patched onto another MoE
    block class with the same router attributes. The base probe patches its own class; we
    move that patched __call__ onto `target_cls` (its closure calls `probe.orig`, which now
    is target_cls's original __call__) and restore the base class."""
    class Retargeted(probe_cls):
        def __enter__(self):
            super().__enter__()
            base = getattr(self, attr)
            patched = base.__call__
            base.__call__ = self.orig
            setattr(self, attr, target_cls)
            self.orig = target_cls.__call__
            target_cls.__call__ = patched
            return self
    return Retargeted


def probe_for(model_type):
    if model_type == "qwen3_moe":
        from mlx_lm.models.qwen3_moe import Qwen3MoeSparseMoeBlock
        return retarget_probe(mf.RouterProbe, "blk", Qwen3MoeSparseMoeBlock)
    if model_type == "glm4_moe":
        from mlx_lm.models.glm4_moe import MoE
        return retarget_probe(ds.RouterProbe, "cls", MoE)
    return ds.RouterProbe  # kimi_k25 runs deepseek_v3's DeepseekV3MoE


def golden(fixdir, ckpt, seed, model_type, description, checkpoint_rel, extra):
    """make_fixtures' golden procedure with make_deepseek_fixtures' dequantizer (handles
    QuantizedMultiLinear too) and the family's router probe."""
    saved = (mf.dequantize_f32, mf.RouterProbe)
    mf.dequantize_f32, mf.RouterProbe = ds.dequantize_f32, probe_for(model_type)
    try:
        return mf.golden_from_checkpoint(fixdir, ckpt, seed, description, checkpoint_rel, extra=extra)
    finally:
        mf.dequantize_f32, mf.RouterProbe = saved


# --------------------------------------------------------------------------------------
# Hugging Face layouts (un-sanitize)
# --------------------------------------------------------------------------------------
def unstack_experts(params):
    """mlx `mlp.switch_mlp.{gate,up,down}_proj.weight` [E, out, in] -> HF per-expert
    `mlp.experts.{e}.{gate,up,down}_proj.weight` [out, in]."""
    hf = {}
    for k, v in params.items():
        if ".mlp.switch_mlp." in k:
            p, proj = k.split(".mlp.switch_mlp.")
            for e in range(v.shape[0]):
                hf[f"{p}.mlp.experts.{e}.{proj}"] = v[e]
        else:
            hf[k] = v
    return hf


def rand_bf16(rng, shape, std=0.02):
    return mx.array((std * rng.standard_normal(shape)).astype(np.float32)).astype(BF16)


def rand_norm_bf16(rng, shape):
    return mx.array(np.clip(1.0 + 0.1 * rng.standard_normal(shape), 0.5, 1.98).astype(np.float32)).astype(BF16)


def unsanitize_qwen3moe(params, cfg, rng):
    # Qwen3 RMSNorm weights are plain (not zero-centred); tied models have no lm_head.weight.
    return unstack_experts(params)


def unsanitize_glm4moe(params, cfg, rng):
    """GLM norms are plain; the router is `mlp.gate.weight` (bf16) +
    `mlp.gate.e_score_correction_bias` (F32). Adds the MTP ("nextn") layer a real GLM-4.5
    checkpoint carries at index num_hidden_layers, which conversion must drop."""
    hf = unstack_experts(params)
    h, E = cfg["hidden_size"], cfg["n_routed_experts"]
    nh, hd = cfg["num_attention_heads"], cfg["head_dim"]
    # (a few of the MTP layer's tensors, the small ones: the fixture stays < 1.5 MB)
    p = f"model.layers.{cfg['num_hidden_layers']}"
    hf[f"{p}.eh_proj.weight"] = rand_bf16(rng, (h, 2 * h))
    for n in ("enorm", "hnorm", "shared_head.norm", "input_layernorm", "post_attention_layernorm"):
        hf[f"{p}.{n}.weight"] = rand_norm_bf16(rng, (h,))
    hf[f"{p}.self_attn.q_proj.bias"] = rand_bf16(rng, (nh * hd,), 0.5)
    hf[f"{p}.mlp.gate.weight"] = rand_bf16(rng, (E, h))
    hf[f"{p}.mlp.gate.e_score_correction_bias"] = mx.array(rng.uniform(-0.1, 0.1, (E,)).astype(np.float32))
    hf[f"{p}.mlp.experts.0.gate_proj.weight"] = rand_bf16(rng, (cfg["moe_intermediate_size"], h))
    hf[f"{p}.mlp.shared_experts.down_proj.weight"] = rand_bf16(rng, (h, cfg["moe_intermediate_size"]))
    return hf


def unsanitize_kimi(params, cfg, rng):
    """Kimi-K2.5 layout: `language_model.model.*` / `language_model.lm_head.weight`, DeepSeek
    text weights (unsplit kv_b_proj, per-expert tensors), plus MoonViT `vision_tower.*` and
    the `mm_projector.*` patch merger (names as in the real release), which mlx-lm drops."""
    pre = "language_model."
    text = {}
    for k, v in params.items():
        assert k.startswith(pre), k
        text[k[len(pre):]] = v
    hf_text = ds.unsanitize(text, cfg["text_config"], rng)
    hf_text.pop("model.layers.61.eh_proj.weight")  # Kimi-K2.5 ships no MTP layer
    hf = {pre + k: v for k, v in hf_text.items()}
    vc = cfg["vision_config"]
    d, inter, p = vc["vt_hidden_size"], vc["vt_intermediate_size"], vc["patch_size"]
    mk = vc["merge_kernel_size"][0] * vc["merge_kernel_size"][1]
    hf["vision_tower.patch_embed.proj.weight"] = rand_bf16(rng, (d, 3, p, p))
    hf["vision_tower.patch_embed.proj.bias"] = rand_bf16(rng, (d,))
    hf["vision_tower.patch_embed.pos_emb.weight"] = rand_bf16(
        rng, (vc["init_pos_emb_height"], vc["init_pos_emb_width"], d))
    for b in range(vc["vt_num_hidden_layers"]):
        q = f"vision_tower.encoder.blocks.{b}"
        for n in ("norm0", "norm1"):
            hf[f"{q}.{n}.weight"] = rand_norm_bf16(rng, (d,))
            hf[f"{q}.{n}.bias"] = rand_bf16(rng, (d,))
        hf[f"{q}.wqkv.weight"] = rand_bf16(rng, (3 * d, d))
        hf[f"{q}.wqkv.bias"] = rand_bf16(rng, (3 * d,))
        hf[f"{q}.wo.weight"] = rand_bf16(rng, (d, d))
        hf[f"{q}.wo.bias"] = rand_bf16(rng, (d,))
        hf[f"{q}.mlp.fc0.weight"] = rand_bf16(rng, (inter, d))
        hf[f"{q}.mlp.fc0.bias"] = rand_bf16(rng, (inter,))
        hf[f"{q}.mlp.fc1.weight"] = rand_bf16(rng, (d, inter))
        hf[f"{q}.mlp.fc1.bias"] = rand_bf16(rng, (d,))
    hf["vision_tower.encoder.final_layernorm.weight"] = rand_norm_bf16(rng, (d,))
    hf["vision_tower.encoder.final_layernorm.bias"] = rand_bf16(rng, (d,))
    hf["mm_projector.pre_norm.weight"] = rand_norm_bf16(rng, (vc["mm_hidden_size"],))
    hf["mm_projector.pre_norm.bias"] = rand_bf16(rng, (vc["mm_hidden_size"],))
    hf["mm_projector.proj.0.weight"] = rand_bf16(rng, (d * mk, d * mk))
    hf["mm_projector.proj.0.bias"] = rand_bf16(rng, (d * mk,))
    hf["mm_projector.proj.2.weight"] = rand_bf16(rng, (vc["text_hidden_size"], d * mk))
    hf["mm_projector.proj.2.bias"] = rand_bf16(rng, (vc["text_hidden_size"],))
    return hf


UNSANITIZE = {"qwen3_moe": unsanitize_qwen3moe, "glm4_moe": unsanitize_glm4moe,
              "kimi_k25": unsanitize_kimi}


def build_hf_fixture(fixdir: Path, hf_config, seed, tok_json):
    """make_fixtures.build_hf_fixture for these families: random model -> cast like convert ->
    HF names -> 2 shards; check sanitize(src) == model, run the real converter, check its
    output == quantize_model(model)."""
    src, exp = fixdir / "src", fixdir / "expected_mlx"
    mlx_cfg = copy.deepcopy(hf_config)
    model = build_random(mlx_cfg, seed)
    mf.cast_like_convert(model, mlx_cfg)
    params = dict(tree_flatten(model.parameters()))
    hf = UNSANITIZE[hf_config["model_type"]](params, hf_config, np.random.default_rng(seed + 1))
    mx.eval(hf)
    mf.write_hf_checkpoint(src, hf, hf_config, tok_json)
    m2, _ = mf.load_model(src)
    mf.compare_params(dict(tree_flatten(m2.parameters())), params, "load_model(HF src) vs built model")
    cmd = mf.run_convert(src, exp)
    qmodel, _ = mf.quantize_model(model, mlx_cfg, GS, 4)
    mf.compare_params(mx.load(str(exp / "model.safetensors")), dict(tree_flatten(qmodel.parameters())),
                      "expected_mlx vs quantize_model(built model)")
    return cmd, len(hf)


# --------------------------------------------------------------------------------------
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

    # 1. qwen3moe-q4 ------------------------------------------------------------------
    d = fresh("qwen3moe-q4")
    build_mlx_fixture(d / "src", qwen3moe_config(), 301, tok_json)
    golden(d, d / "src", 3001, "qwen3_moe",
           "qwen3_moe, 4 layers (layer 1 dense SwiGLU 192 via mlp_only_layers=[1], "
           "decoder_sparse_step 1), 4 q heads x 32, 2 kv heads, q/k RMSNorm, full rotary theta 1e6, "
           "16 experts top-4 (moe_intermediate 64), norm_topk_prob, untied; 4-bit g64, router 8-bit",
           "src", common)

    # 2. qwen3moe-hf ------------------------------------------------------------------
    d = fresh("qwen3moe-hf")
    cfg = hf_fields(qwen3moe_config(hidden=H_HF, layers=3, experts=8, topk=2, norm_topk=False,
                                    mlp_only=(), sparse_step=2, tie=True, intermediate=128), "4.51.0")
    cmd, n = build_hf_fixture(d, cfg, 302, tok_json)
    golden(d, d / "expected_mlx", 3002, "qwen3_moe",
           f"HF-layout bf16 qwen3_moe (hidden {H_HF}, 3 layers, decoder_sparse_step 2: layers 0 and 2 "
           "dense SwiGLU 128, layer 1 MoE with 8 per-expert tensors top-2, norm_topk_prob false, tied "
           "embeddings) in src/; expected_mlx/ is the real mlx_lm convert 4-bit g64 output (router 8-bit); "
           "golden is for expected_mlx", "expected_mlx", {**common, "convert_command": cmd})

    # 3. glm4moe-q4 -------------------------------------------------------------------
    d = fresh("glm4moe-q4")
    build_mlx_fixture(d / "src", glm4moe_config(), 303, tok_json)
    golden(d, d / "src", 3003, "glm4_moe",
           "glm4_moe, 4 layers (layer 0 dense SwiGLU 192, first_k_dense_replace 1), 4 q heads x 32 "
           "(head_dim explicit), 2 kv heads, q/k/v biases, q/k RMSNorm, partial rotary 0.5 (16 of 32 dims, "
           "theta 1e6), 16 experts top-4 in 4 groups (topk_group 2), sigmoid noaux_tc, routed_scaling 2.5, "
           "1 shared expert, norm_topk_prob, rms_norm_eps 1e-5, num_nextn_predict_layers 1 (no MTP tensors), "
           "untied; 4-bit g64, router bf16 + F32 correction bias", "src", common)

    # 4. glm4moe-hf -------------------------------------------------------------------
    d = fresh("glm4moe-hf")
    cfg = hf_fields(glm4moe_config(hidden=H_HF, layers=3, experts=8, topk=2, n_group=1, topk_group=1,
                                   scaling=1.0, qk_norm=False, intermediate=128), "4.54.0")
    cmd, n = build_hf_fixture(d, cfg, 304, tok_json)
    golden(d, d / "expected_mlx", 3004, "glm4_moe",
           f"HF-layout bf16 glm4_moe GLM-4.5-Air style (hidden {H_HF}, 3 layers, layer 0 dense 128, "
           "8 per-expert tensors top-2, 1 group, routed_scaling 1.0, 1 shared expert, q/k/v biases, no "
           "q/k norm, partial rotary 0.5, MTP tensors at model.layers.3 to drop) in src/; expected_mlx/ is "
           "the real mlx_lm convert 4-bit g64 output; golden is for expected_mlx", "expected_mlx",
           {**common, "convert_command": cmd})

    # 5. kimik25-q4 -------------------------------------------------------------------
    d = fresh("kimik25-q4")
    build_mlx_fixture(d / "src", kimi_config(kimi_text_config()), 305, tok_json)
    golden(d, d / "src", 3005, "kimi_k25",
           "kimi_k25 (deepseek_v3 text model under text_config, language_model. prefix), 3 layers "
           "(layer 0 dense 192), MLA q_lora 64 kv_lora 64 nope 64 rope 32 v 64, 4 heads, 16 experts top-4, "
           "1 group, routed_scaling 2.827, 1 shared expert, YaRN factor 64 (mscale = mscale_all_dim = 1), "
           "rope_theta 5e4, rms_norm_eps 1e-5; 4-bit g64, router bf16 + F32 correction bias",
           "src", common)

    # 6. kimik25-hf -------------------------------------------------------------------
    d = fresh("kimik25-hf")
    cfg = hf_fields(kimi_config(kimi_text_config(hidden=H_HF, layers=2, experts=8, topk=2, heads=2)),
                    "4.57.1")
    cmd, n = build_hf_fixture(d, cfg, 306, tok_json)
    golden(d, d / "expected_mlx", 3006, "kimi_k25",
           f"HF-layout bf16 kimi_k25 (hidden {H_HF}, 2 layers: layer 0 dense 192, layer 1 MoE with 8 "
           "per-expert tensors top-2, 1 group, 1 shared expert; MLA with 2 heads, q_lora 64, unsplit "
           "kv_b_proj; vision_tower.* and mm_projector.* to drop) in src/; expected_mlx/ is the real "
           "mlx_lm convert 4-bit g64 output; golden is for expected_mlx", "expected_mlx",
           {**common, "convert_command": cmd})

    dirs = [("qwen3moe-q4/src (MLX layout, as mlx_lm.convert writes it)", "qwen3moe-q4/src"),
            ("qwen3moe-hf/src (Hugging Face layout, bf16, 2 shards)", "qwen3moe-hf/src"),
            ("qwen3moe-hf/expected_mlx (mlx_lm convert -q --q-bits 4 --q-group-size 64 of src)",
             "qwen3moe-hf/expected_mlx"),
            ("glm4moe-q4/src (MLX layout, as mlx_lm.convert writes it)", "glm4moe-q4/src"),
            ("glm4moe-hf/src (Hugging Face layout, bf16, 2 shards)", "glm4moe-hf/src"),
            ("glm4moe-hf/expected_mlx (mlx_lm convert -q --q-bits 4 --q-group-size 64 of src)",
             "glm4moe-hf/expected_mlx"),
            ("kimik25-q4/src (MLX layout, as mlx_lm.convert writes it)", "kimik25-q4/src"),
            ("kimik25-hf/src (Hugging Face layout, bf16, 2 shards)", "kimik25-hf/src"),
            ("kimik25-hf/expected_mlx (mlx_lm convert -q --q-bits 4 --q-group-size 64 of src)",
             "kimik25-hf/expected_mlx")]
    (root / "TENSORS-families.txt").write_text(mf.tensors_report([(t, root / p) for t, p in dirs]))
    print("done:", root)


if __name__ == "__main__":
    main()
