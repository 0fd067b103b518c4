#!/usr/bin/env python3
"""Regenerate moeflux's gpt-oss (gpt_oss) fixture: a tiny random checkpoint in mlx-lm's
layout plus float32 golden logits.

    HF_HUB_OFFLINE=1 python tools/goldens/make_gptoss_fixtures.py            # -> tests/fixtures/
    HF_HUB_OFFLINE=1 python tools/goldens/make_gptoss_fixtures.py --out DIR

Uses make_fixtures.py's helpers (tokenizer, random init, cast/quantize like mlx_lm.convert,
golden procedure) and make_deepseek_fixtures.py's f32 dequantizer. mlx-lm initialises to
constants what an engine could ignore and still match: the attention sinks (zeros), every
linear bias of q/k/v/o, the router and the experts (zeros or near zero). All are drawn here,
and `ablations` in golden.json records how far the logits move when each is dropped (or the
SwiGLU clamp is lifted), so the golden shows that each one matters.

Fixture (see tests/fixtures/README.md):
* gptoss-q4/: gpt_oss, 4 layers alternating sliding (window 8, shorter than the 32-token
  golden) and full attention, 4 q heads x 32, 2 kv heads, learned sinks, q/k/v/o biases, YaRN
  rotary (factor 32, half-split), 16 experts top-4 with biases and the clamped SwiGLU, router
  with bias; 4-bit g64, router 8-bit (gpt_oss.quant_predicate).
* gptoss-mxfp4/: the same architecture (other random weights), quantized as mlx-community's
  gpt-oss "MXFP4-Q8" checkpoints are: the routed experts MXFP4 (e2m1 codes, groups of 32, e8m0
  scales), everything else 8-bit affine g64.
* gptoss-hf/: Hugging Face's release layout (hidden 64): bf16 dense tensors, the experts as
  MXFP4 `*_blocks` [E, rows, cols/32, 16] / `*_scales` [E, rows, cols/32] with gate and up
  interleaved row by row in `gate_up_proj*`, biases `*_bias`, `quantization_config`
  `quant_method: mxfp4`; expected_mlx/ is the real `mlx_lm convert -q` of it (experts stay MXFP4,
  the rest 4-bit affine g64, router 8-bit).
"""
import argparse
import shutil
import sys
from pathlib import Path

import mlx.nn as nn
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402
import make_deepseek_fixtures as ds  # noqa: E402
from make_fixtures import BF16, F32, GS, H, V, mx  # noqa: E402
from mlx.utils import tree_flatten, tree_map_with_path  # noqa: E402

# Spreads of the parameters mlx-lm starts at constants. Expert gate/up biases are wide so
# that the SwiGLU clamp (|x| > 7) engages for some tokens.
SINK_STD = 1.0
ATTN_BIAS_STD = 0.5
ROUTER_BIAS_STD = 0.5
EXPERT_BIAS_STD = {"gate_proj": 4.0, "up_proj": 4.0, "down_proj": 0.1}


def gptoss_config(*, hidden=H, layers=4, experts=16, topk=4, window=8):
    return {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
        "num_hidden_layers": layers, "num_local_experts": experts, "num_experts_per_tok": topk,
        "vocab_size": V, "rms_norm_eps": 1e-5, "hidden_size": hidden, "intermediate_size": 64,
        "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "sliding_window": window, "rope_theta": 150000,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "eos_token_id": 2, "pad_token_id": 1,
    }


def build_random(config, seed):
    model = mf.build_random_model(config, seed)
    rng = np.random.default_rng(seed + 41)
    repl = {}
    for k, v in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        if k.endswith("self_attn.sinks"):
            std = SINK_STD
        elif k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias")):
            std = ATTN_BIAS_STD
        elif k.endswith("router.bias"):
            std = ROUTER_BIAS_STD
        elif ".experts." in k and k.endswith(".bias"):
            std = EXPERT_BIAS_STD[k.split(".")[-2]]
        else:
            continue
        repl[k] = mx.array((std * rng.standard_normal(v.shape)).astype(np.float32))
    drawn = {k.split(".")[-1] if k.endswith("sinks") else k.split(".")[-2] for k in repl}
    assert {"sinks", "q_proj", "k_proj", "v_proj", "o_proj", "router", "gate_proj", "up_proj",
            "down_proj"} <= drawn, drawn
    model.update(tree_map_with_path(lambda p, v: repl.get(p, v), model.parameters()))
    mx.eval(model.parameters())
    return model


class RouterProbe:
    """Records min over tokens/layers of (k-th largest - (k+1)-th largest) router logit:
    gpt_oss takes the top-k of the raw logits, then a softmax over those k."""

    def __enter__(self):
        from mlx_lm.models.gpt_oss import MLPBlock
        self.cls, self.orig, self.gaps = MLPBlock, MLPBlock.__call__, []
        probe = self

        def patched(s, x):
            g = mx.sort(s.router(x).astype(F32), axis=-1)
            k = s.num_experts_per_tok
            probe.gaps.append(float((g[..., -k] - g[..., -k - 1]).min().item()))
            return probe.orig(s, x)
        MLPBlock.__call__ = patched
        return self

    def __exit__(self, *a):
        self.cls.__call__ = self.orig


def dequantize_f32(model):
    """make_deepseek_fixtures' f32 dequantizer, for layers without quantization biases too
    (MXFP4: w = e2m1 code * 2^(scale - 127))."""
    from mlx.utils import tree_unflatten
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear
    fixed = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, QuantizedSwitchLinear)) and m.mode == "mxfp4":
            w = mx.dequantize(m.weight, m.scales, None, m.group_size, m.bits, m.mode, dtype=F32)
            # A float layer in place of the quantized one.
            nm = (nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
                  if isinstance(m, nn.QuantizedLinear) else None)
            if nm is None:
                from mlx_lm.models.switch_layers import SwitchLinear
                nm = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], bias="bias" in m)
            nm.weight = w
            if "bias" in m:
                nm.bias = m.bias
            fixed.append((name, nm))
    if fixed:
        model.update_modules(tree_unflatten(fixed))
    return ds.dequantize_f32(model)


def quantize_mxfp4_q8(model, config):
    """Experts MXFP4, the rest 8-bit affine g64 (mlx-community's gpt-oss MXFP4-Q8 layout)."""
    from mlx_lm.utils import quantize_model

    def predicate(path, _module):
        if ".experts." in path:
            return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        return {"group_size": 64, "bits": 8, "mode": "affine"}
    return quantize_model(model, config, 64, 8, mode="affine", quant_predicate=predicate)


def to_hf_gptoss(params, layers):
    """mlx gpt_oss parameters (experts already MXFP4) -> Hugging Face tensor names and layout:
    the inverse of gpt_oss.sanitize."""
    hf = {}
    for k, v in params.items():
        if ".mlp.experts." not in k:
            hf[k] = v
    for l in range(layers):
        p = f"model.layers.{l}.mlp.experts"

        def blocks(w):  # uint32 [E, R, C/8] -> uint8 [E, R, C/32, 16], same bytes
            e, r, c8 = w.shape
            return w.view(mx.uint8).reshape(e, r, c8 // 4, 16)

        def interleave(a, b):  # rows of a at even, of b at odd indices
            return mx.stack([a, b], axis=2).reshape(a.shape[0], 2 * a.shape[1], *a.shape[2:])
        g, u, d = (f"{p}.{c}" for c in ("gate_proj", "up_proj", "down_proj"))
        hf[f"{p}.gate_up_proj_blocks"] = interleave(blocks(params[f"{g}.weight"]),
                                                    blocks(params[f"{u}.weight"]))
        hf[f"{p}.gate_up_proj_scales"] = interleave(params[f"{g}.scales"], params[f"{u}.scales"])
        hf[f"{p}.gate_up_proj_bias"] = interleave(params[f"{g}.bias"], params[f"{u}.bias"])
        hf[f"{p}.down_proj_blocks"] = blocks(params[f"{d}.weight"])
        hf[f"{p}.down_proj_scales"] = params[f"{d}.scales"]
        hf[f"{p}.down_proj_bias"] = params[f"{d}.bias"]
    return hf


def build_hf_fixture(d, seed, golden_seed, tok_json, tok_info):
    from mlx_lm.utils import load_model
    config = gptoss_config(hidden=64, layers=2, experts=8, topk=2)
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    config["transformers_version"] = "4.55.0.dev0"
    model = build_random({k: v for k, v in config.items() if k != "quantization_config"}, seed)
    mf.cast_like_convert(model, config)
    # The release's experts: MXFP4 from the bf16 weights (as mlx quantizes them).
    nn.quantize(model, 32, 4, mode="mxfp4",
                class_predicate=lambda p, m: ".experts." in p and hasattr(m, "to_quantized"))
    mx.eval(model.parameters())
    params = dict(tree_flatten(model.parameters()))
    hf = to_hf_gptoss(params, config["num_hidden_layers"])
    mx.eval(hf)
    mf.write_hf_checkpoint(d / "src", hf, config, tok_json)
    # 1. mlx-lm's sanitize gives back exactly the model we started from
    m2, _ = load_model(d / "src")
    mf.compare_params(dict(tree_flatten(m2.parameters())), params, "load_model(HF src) vs built model")
    # 2. the real converter: experts stay MXFP4, the rest is quantized 4-bit (router 8-bit)
    cmd = mf.run_convert(d / "src", d / "expected_mlx")
    return cmd


def logits_of(model, tokens):
    out = model(mx.array([tokens])).astype(F32)
    mx.eval(out)
    return np.array(out[0])


def ablations(ckpt, tokens, reference):
    """max |logit change| when each drawn parameter is reset to mlx's constant, and when the
    SwiGLU clamp is lifted."""
    from mlx_lm.models import activations, gpt_oss
    from mlx_lm.utils import load_model

    def run(mutate):
        model, _ = load_model(ckpt)
        mutate(model)
        model = dequantize_f32(model)
        return float(np.abs(logits_of(model, tokens) - reference).max())

    def zero(suffixes):
        def m(model):
            model.update(tree_map_with_path(
                lambda p, v: mx.zeros_like(v) if p.endswith(suffixes) else v, model.parameters()))
        return m

    out = {}
    for name, suffixes in [("sinks", ("self_attn.sinks",)),
                           ("attention biases", ("q_proj.bias", "k_proj.bias", "v_proj.bias",
                                                 "o_proj.bias")),
                           ("router bias", ("router.bias",)),
                           ("expert biases", ("gate_proj.bias", "up_proj.bias", "down_proj.bias"))]:
        out[name] = run(zero(suffixes))
    orig = activations.swiglu_oai

    def unclamped(gate, x, alpha=1.702, limit=7.0):
        return orig(gate, x, alpha=alpha, limit=1e30)
    activations.swiglu_oai = unclamped
    try:
        out["swiglu clamp"] = run(lambda m: None)
    finally:
        activations.swiglu_oai = orig
    saved = gpt_oss.GptOssMoeModel.__init__

    def no_window(self, args):
        saved(self, args)
        self.window_size = None
    gpt_oss.GptOssMoeModel.__init__ = no_window
    try:
        out["sliding window"] = run(lambda m: None)
    finally:
        gpt_oss.GptOssMoeModel.__init__ = saved
    for k, v in out.items():
        print(f"  ablation {k}: max|dlogit| = {v:.3g}")
        assert v > 1e-2, f"dropping {k} does not move the logits"
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=mf.REPO / "tests" / "fixtures")
    args = ap.parse_args()
    root = args.out
    root.mkdir(parents=True, exist_ok=True)
    mx.set_default_device(mx.cpu)
    tok_json, tok_info = mf.train_tokenizer()

    def make(name, seed, golden_seed, quantize, description):
        d = root / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        config = gptoss_config()
        model = build_random(config, seed)
        mf.cast_like_convert(model, config)
        model, qconfig = quantize(model, config)
        mx.eval(model.parameters())
        mf.save_model(d / "src", model)
        mf.save_config(qconfig, d / "src" / "config.json")
        mf.write_tokenizer(d / "src", tok_json)
        saved = (mf.dequantize_f32, mf.RouterProbe)
        mf.dequantize_f32, mf.RouterProbe = dequantize_f32, RouterProbe
        try:
            res = mf.golden_from_checkpoint(d, d / "src", golden_seed, description, "src",
                                            extra={"tokenizer": tok_info})
        finally:
            mf.dequantize_f32, mf.RouterProbe = saved
        extra = ablations(d / "src", res["tokens"], res["logits"])
        import json
        g = json.loads((d / "golden.json").read_text())
        g["ablations_max_abs_logit_change"] = extra
        (d / "golden.json").write_text(json.dumps(g, indent=1) + "\n")
        print("done:", d)

    shape = ("gpt_oss, 4 layers alternating sliding (window 8) / full attention, 4 q heads x 32, "
             "2 kv heads, learned sinks, q/k/v/o biases, YaRN rotary (factor 32, half-split, theta "
             "1.5e5), 16 experts top-4 (intermediate 64) with biases and the clamped SwiGLU "
             "(alpha 1.702, limit 7), router with bias (softmax over the top-4 logits), untied; ")
    make("gptoss-q4", 401, 4001, lambda m, c: mf.quantize_model(m, c, GS, 4),
         shape + "4-bit g64, router 8-bit; router_topk_gap_min is in logits")
    make("gptoss-mxfp4", 402, 4002, quantize_mxfp4_q8,
         shape + "experts MXFP4 (groups of 32, e8m0 scales), everything else 8-bit affine g64; "
         "router_topk_gap_min is in logits")

    d = root / "gptoss-hf"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    cmd = build_hf_fixture(d, 403, 4003, tok_json, tok_info)
    saved = (mf.dequantize_f32, mf.RouterProbe)
    mf.dequantize_f32, mf.RouterProbe = dequantize_f32, RouterProbe
    try:
        mf.golden_from_checkpoint(
            d, d / "expected_mlx", 4003,
            "HF-layout gpt_oss (hidden 64, 2 layers sliding/full window 8, 8 experts top-2 as MXFP4 "
            "_blocks/_scales with gate/up interleaved, bf16 elsewhere) in src/; expected_mlx/ is the "
            "real mlx_lm convert 4-bit g64 output (experts stay MXFP4, router 8-bit); golden is for "
            "expected_mlx", "expected_mlx", extra={"tokenizer": tok_info, "convert_command": cmd})
    finally:
        mf.dequantize_f32, mf.RouterProbe = saved
    print("done:", d)



if __name__ == "__main__":
    main()
