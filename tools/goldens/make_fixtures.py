#!/usr/bin/env python3
"""Regenerate moeflux's test fixtures: tiny random MoE checkpoints plus golden logits.

Everything is deterministic (fixed seeds; MLX's counter-based RNG on CPU) and runs
offline in a few seconds:

    HF_HUB_OFFLINE=1 python tools/goldens/make_fixtures.py            # -> tests/fixtures/
    HF_HUB_OFFLINE=1 python tools/goldens/make_fixtures.py --out DIR  # anywhere else

See tools/goldens/README.md and tests/fixtures/README.md for what each fixture holds.

Golden procedure (all fixtures): reload the saved MLX checkpoint with
mlx_lm.utils.load_model, dequantize every quantized layer in float32
(w = q*scale + bias with scale/bias upcast to f32 *before* the product), cast every
other floating parameter to f32, greedily continue a 24-token random prompt by 8
tokens (argmax, KV/SSM cache path), then run one full-sequence forward without
cache over the 32 tokens and store those logits. The prompt seed is the first of a
fixed deterministic sequence whose golden is robust (every top-k router choice and
every greedy argmax separated by a margin, see MIN_ROUTER_GAP / MIN_GREEDY_MARGIN).
"""
import argparse
import copy
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import numpy as np  # noqa: E402
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx_lm  # noqa: E402
from mlx.utils import tree_flatten, tree_map, tree_map_with_path, tree_unflatten  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import (  # noqa: E402
    _get_classes,
    load_model,
    quantize_model,
    save_config,
    save_model,
)

REPO = Path(__file__).resolve().parents[2]
V = 1024  # vocab
H = 128  # hidden
GS = 64  # quantization group size
N_PROMPT = 24
N_DECODE = 8
RESIDUAL_GAIN = 16.0
RESIDUAL_OUT_PROJ = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
MIN_ROUTER_GAP = 1e-4
MIN_GREEDY_MARGIN = 0.05
MAX_PROMPT_TRIES = 64
PROMPT_SEED_STRIDE = 7919
F32 = mx.float32
BF16 = mx.bfloat16

# --------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------
# Qwen2 / Qwen3 pre-tokenizer regex (the one in Qwen's tokenizer.json Split pre-tokenizer)
QWEN2_PAT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Training corpus: a fixed list of CPython stdlib modules (of the running interpreter).
TOKENIZER_CORPUS = [
    "abc.py", "argparse.py", "ast.py", "base64.py", "bisect.py", "calendar.py",
    "contextlib.py", "copy.py", "csv.py", "dataclasses.py", "datetime.py", "difflib.py",
    "enum.py", "fractions.py", "functools.py", "glob.py", "heapq.py", "inspect.py",
    "json/decoder.py", "json/encoder.py", "keyword.py", "operator.py", "os.py",
    "pathlib.py", "pprint.py", "queue.py", "random.py", "shlex.py", "shutil.py",
    "statistics.py", "string.py", "textwrap.py", "threading.py", "tokenize.py",
    "typing.py", "uuid.py", "weakref.py",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOKENIZER_CONFIG = {
    "tokenizer_class": "Qwen2Tokenizer",
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": None,
    "add_bos_token": False,
    "add_prefix_space": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 4096,
    "chat_template": CHATML_TEMPLATE,
}


def train_tokenizer():
    """1024-token byte-level BPE, Qwen2-style (NFC + regex Split + ByteLevel)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    std = Path(sysconfig.get_paths()["stdlib"])
    files = [str(std / f) for f in TOKENIZER_CORPUS]
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).read_bytes())
    tk = Tokenizer(models.BPE())
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PAT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(
        vocab_size=V, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train(files, tr)
    assert tk.get_vocab_size() == V, tk.get_vocab_size()
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tk.token_to_id(s) == i
    js = tk.to_str(pretty=True)
    info = {"corpus_sha256": h.hexdigest(), "corpus_python": sys.version.split()[0],
            "tokenizer_json_sha256": hashlib.sha256(js.encode()).hexdigest()}
    return js, info


def write_tokenizer(d: Path, tok_json: str):
    (d / "tokenizer.json").write_text(tok_json)
    (d / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")


# --------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------
def rope35():
    # text-only: all 3 mrope position streams are equal, so this is plain partial rope
    # over int(32 * 0.25) = 8 dims; mrope_section sums to 8/2 = 4 rotary pairs.
    return {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True}


def qwen35_text(*, layers=4, interval=4, experts=16, topk=4, norm_topk=True, tie=False):
    return {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": H, "num_hidden_layers": layers, "full_attention_interval": interval,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
        "num_experts": experts, "num_experts_per_tok": topk, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64, "intermediate_size": 256,
        "norm_topk_prob": norm_topk, "rms_norm_eps": 1e-6, "vocab_size": V,
        "max_position_embeddings": 4096, "tie_word_embeddings": tie,
        "hidden_act": "silu", "attention_bias": False,
        "eos_token_id": 2,
        "rope_parameters": rope35(),
    }


def qwen35_mlx_config(**kw):
    tie = kw.get("tie", False)
    return {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "tie_word_embeddings": tie, "eos_token_id": 2, "text_config": qwen35_text(**kw)}


def qwen3next_config(*, layers=4, interval=2, experts=8, topk=2, mlp_only=(), tie=False,
                     norm_topk=True, intermediate=128):
    return {
        "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
        "hidden_size": H, "num_hidden_layers": layers, "full_attention_interval": interval,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
        "num_experts": experts, "num_experts_per_tok": topk, "decoder_sparse_step": 1,
        "mlp_only_layers": list(mlp_only), "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64, "intermediate_size": intermediate,
        "norm_topk_prob": norm_topk, "rms_norm_eps": 1e-6, "vocab_size": V,
        "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
        "max_position_embeddings": 4096, "tie_word_embeddings": tie,
        "hidden_act": "silu", "attention_bias": False, "eos_token_id": 2,
    }


def layer_types(n, interval):
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def qwen35_hf_config():
    """config.json of a Hugging Face Qwen3_5MoeForConditionalGeneration checkpoint."""
    tc = qwen35_text(layers=2, interval=2, experts=4, topk=2, norm_topk=True, tie=False)
    tc.update({"layer_types": layer_types(2, 2), "dtype": "bfloat16", "bos_token_id": None,
               "pad_token_id": None, "initializer_range": 0.02, "attention_dropout": 0.0,
               "router_aux_loss_coef": 0.001, "output_router_logits": False, "use_cache": True,
               "mtp_num_hidden_layers": 1})
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "image_token_id": 1000, "video_token_id": 1001,
        "vision_start_token_id": 1002, "vision_end_token_id": 1003,
        "text_config": tc,
        "vision_config": {
            "model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 16,
            "intermediate_size": 32, "num_heads": 2, "out_hidden_size": H, "in_channels": 3,
            "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2,
            "hidden_act": "gelu_pytorch_tanh", "num_position_embeddings": 64,
            "initializer_range": 0.02},
        "transformers_version": "5.23.0",
    }


def qwen3next_hf_config():
    c = qwen3next_config(layers=2, interval=2, experts=4, topk=2, mlp_only=(), tie=False,
                         intermediate=128)
    c.update({"torch_dtype": "bfloat16", "layer_types": layer_types(2, 2), "bos_token_id": 0,
              "initializer_range": 0.02, "attention_dropout": 0.0,
              "router_aux_loss_coef": 0.001, "output_router_logits": False, "use_cache": True,
              "rope_scaling": None, "transformers_version": "4.57.0.dev0"})
    return c


# --------------------------------------------------------------------------------------
# model building
# --------------------------------------------------------------------------------------
NORM_SHIFTED = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                ".q_norm.weight", ".k_norm.weight")


def build_random_model(config, seed):
    """Random model from `config` (mutated in place by ModelArgs.from_dict exactly like
    mlx_lm.load_model/convert do, e.g. rope_parameters.rope_type -> type).

    On top of mlx's default init: every RMSNorm weight (incl. linear_attn.norm, q/k_norm)
    is drawn as bf16(1 + 0.1*N(0,1)) in [0.5, 2), dt_bias ~ U(-1, 1), lm_head (or the
    embedding when tied) is multiplied by 8 so logits are peaked, and every projection that
    writes into the residual stream (o_proj, linear_attn.out_proj, all down_proj) is
    multiplied by RESIDUAL_GAIN so the blocks, not the current token's embedding, dominate
    the final hidden state (with mlx's default init a tied model just copies its input token)."""
    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    tied = bool(config.get("text_config", config).get("tie_word_embeddings", False))
    rng = np.random.default_rng(seed)
    repl = {}
    for k, v in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        if k.endswith("norm.weight"):
            w = np.clip(1.0 + 0.1 * rng.standard_normal(v.shape), 0.5, 1.98).astype(np.float32)
            repl[k] = mx.array(w).astype(BF16).astype(F32)
        elif k.endswith("dt_bias"):
            repl[k] = mx.array(rng.uniform(-1.0, 1.0, v.shape).astype(np.float32))
        elif k.endswith("lm_head.weight") or (tied and k.endswith("embed_tokens.weight")):
            repl[k] = v * 8.0
        elif k.endswith(RESIDUAL_OUT_PROJ):
            repl[k] = v * RESIDUAL_GAIN
    model.update(tree_map_with_path(lambda p, v: repl.get(p, v), model.parameters()))
    mx.eval(model.parameters())
    return model


def cast_like_convert(model, config, dtype="bfloat16"):
    """mlx_lm.convert: torch_dtype -> astype for every floating param passing cast_predicate."""
    config["torch_dtype"] = dtype
    dt = getattr(mx, dtype)
    cast_pred = getattr(model, "cast_predicate", lambda _: True)
    model.update(tree_map_with_path(
        lambda k, v: v.astype(dt) if cast_pred(k) and mx.issubdtype(v.dtype, mx.floating) else v,
        model.parameters()))
    mx.eval(model.parameters())


def build_mlx_fixture(src: Path, config, bits, seed, tok_json):
    model = build_random_model(config, seed)
    cast_like_convert(model, config)
    model, qconfig = quantize_model(model, config, GS, bits)
    mx.eval(model.parameters())
    save_model(src, model)
    save_config(qconfig, src / "config.json")
    write_tokenizer(src, tok_json)
    return qconfig


# --------------------------------------------------------------------------------------
# golden
# --------------------------------------------------------------------------------------
def dequantize_f32(model):
    """Like mlx_lm.utils.dequantize_model, but w = q*scale + bias is evaluated in float32
    (mlx_lm's version returns weights rounded to the bf16 dtype of the scales)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
    layers = []
    for name, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            cls, kw = nn.Linear, {"bias": "bias" in m}
        elif isinstance(m, nn.QuantizedEmbedding):
            cls, kw = nn.Embedding, {}
        elif isinstance(m, QuantizedSwitchLinear):
            cls, kw = SwitchLinear, {"bias": "bias" in m}
        else:
            continue
        w = mx.dequantize(m.weight, m.scales.astype(F32), m.biases.astype(F32),
                          m.group_size, m.bits, m.mode, dtype=F32)
        nm = cls(*w.shape[::-1], **kw)
        if kw.get("bias"):
            nm.bias = m.bias
        nm.weight = w
        layers.append((name, nm))
    model.update_modules(tree_unflatten(layers))
    model.update(tree_map(lambda v: v.astype(F32) if mx.issubdtype(v.dtype, mx.floating) else v,
                          model.parameters()))
    mx.eval(model.parameters())
    return model


class RouterProbe:
    """Records min over tokens/layers of (k-th largest - (k+1)-th largest) router prob."""

    def __enter__(self):
        from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock as Blk
        self.blk, self.orig, self.gaps = Blk, Blk.__call__, []
        probe = self

        def patched(s, x):
            g = mx.sort(mx.softmax(s.gate(x).astype(F32), axis=-1, precise=True), axis=-1)
            probe.gaps.append(float((g[..., -s.top_k] - g[..., -s.top_k - 1]).min().item()))
            return probe.orig(s, x)
        Blk.__call__ = patched
        return self

    def __exit__(self, *a):
        self.blk.__call__ = self.orig


def run_golden(model, prompt):
    """Greedy continuation with cache, then one full no-cache forward. Returns dict."""
    cache = make_prompt_cache(model)
    pre = model(mx.array([prompt]), cache=cache).astype(F32)
    mx.eval(pre)
    cached = [np.array(pre[0])]  # positions 0..23
    toks = []
    last = cached[0][-1]
    for _ in range(N_DECODE):
        t = int(np.argmax(last))
        toks.append(t)
        lg = model(mx.array([[t]]), cache=cache).astype(F32)  # position 24.. 31
        mx.eval(lg)
        last = np.array(lg[0, -1])
        cached.append(last[None])
    cached = np.concatenate(cached, axis=0)  # [32, V]
    tokens = prompt + toks
    with RouterProbe() as probe:
        full = model(mx.array([tokens])).astype(F32)
        mx.eval(full)
    full = np.array(full[0])
    assert full.shape == (N_PROMPT + N_DECODE, V) and full.dtype == np.float32
    diff = float(np.abs(full - cached).max())
    full_argmax = full[N_PROMPT - 1:N_PROMPT - 1 + N_DECODE].argmax(-1).tolist()
    srt = np.sort(full, axis=-1)
    margins = (srt[:, -1] - srt[:, -2])
    return {
        "prompt": prompt, "continuation": toks, "tokens": tokens, "logits": full,
        "cached_vs_full_max_abs_diff": diff,
        "full_forward_argmax_matches_continuation": full_argmax == toks,
        "greedy_top2_margin_min": float(margins[N_PROMPT - 1:N_PROMPT - 1 + N_DECODE].min()),
        "top2_margin_min_all_positions": float(margins.min()),
        "router_topk_gap_min": float(min(probe.gaps)) if probe.gaps else None,
    }


def write_golden(fixdir: Path, res, seed, description, checkpoint, extra=None):
    np.save(fixdir / "golden_logits.npy", res["logits"])
    g = {
        "description": description,
        "checkpoint": checkpoint,
        "prompt_seed": seed,
        "prompt_seed_selection": f"first of seed0 + {PROMPT_SEED_STRIDE}*i (i < {MAX_PROMPT_TRIES}) with "
                                 f"router_topk_gap_min >= {MIN_ROUTER_GAP} and greedy_top2_margin_min >= "
                                 f"{MIN_GREEDY_MARGIN}; tries used: {res['prompt_seed_tries']}",
        "prompt_rng": f"numpy.random.default_rng({seed}).integers(0, {V}, {N_PROMPT})",
        "prompt": res["prompt"],
        "continuation": res["continuation"],
        "tokens": res["tokens"],
        "logits_file": "golden_logits.npy",
        "logits_shape": list(res["logits"].shape),
        "logits_positions": "row i = next-token logits after tokens[0..=i] (one full forward, no cache)",
        "max_abs_logit": float(np.abs(res["logits"]).max()),
        "golden_procedure": "load_model -> dequantize every quantized layer in f32 "
                            "(mx.dequantize(w, scales.astype(f32), biases.astype(f32), dtype=f32)) -> "
                            "all other float params astype(f32) -> greedy argmax 8 tokens with cache -> "
                            "one full no-cache forward over the 32 tokens",
        "cached_vs_full_max_abs_diff": res["cached_vs_full_max_abs_diff"],
        "greedy_top2_margin_min": res["greedy_top2_margin_min"],
        "top2_margin_min_all_positions": res["top2_margin_min_all_positions"],
        "router_topk_gap_min": res["router_topk_gap_min"],
        "mlx_version": mx.__version__,
        "mlx_lm_version": mlx_lm.__version__,
    }
    if extra:
        g.update(extra)
    (fixdir / "golden.json").write_text(json.dumps(g, indent=1) + "\n")


def golden_from_checkpoint(fixdir, ckpt, seed, description, checkpoint_rel, mutate=None, extra=None):
    model, _ = load_model(ckpt)
    if mutate is not None:
        mutate(model)
    model = dequantize_f32(model)
    # Deterministic search over prompt seeds for a prompt whose golden is robust to
    # f32 rounding differences: every top-k router decision separated by >= MIN_ROUTER_GAP
    # in probability and every greedy argmax by >= MIN_GREEDY_MARGIN in logit.
    best = None
    for i in range(MAX_PROMPT_TRIES):
        s = seed + PROMPT_SEED_STRIDE * i
        prompt = np.random.default_rng(s).integers(0, V, N_PROMPT).tolist()
        res = run_golden(model, prompt)
        score = min(res["router_topk_gap_min"] / MIN_ROUTER_GAP,
                    res["greedy_top2_margin_min"] / MIN_GREEDY_MARGIN)
        if best is None or score > best[0]:
            best = (score, s, res)
        if score >= 1.0:
            break
    score, seed, res = best
    res["prompt_seed_tries"] = i + 1
    ok = res["full_forward_argmax_matches_continuation"]
    print(f"  golden {fixdir.name}: cached-vs-full max|diff| = {res['cached_vs_full_max_abs_diff']:.3g}, "
          f"max|logit| = {np.abs(res['logits']).max():.2f}, greedy margin min = "
          f"{res['greedy_top2_margin_min']:.3g}, router gap min = {res['router_topk_gap_min']:.3g}, "
          f"argmax(full)==continuation: {ok}, prompt seed {seed} after {res['prompt_seed_tries']} tries")
    assert ok, "greedy continuation from the cache path disagrees with the full forward"
    assert res["cached_vs_full_max_abs_diff"] < 1e-3
    write_golden(fixdir, res, seed, description, checkpoint_rel, extra)
    return res


# --------------------------------------------------------------------------------------
# 2-bit expert requantization (flash-moe seed algorithm)
# --------------------------------------------------------------------------------------
def unpack(wq: np.ndarray, bits: int) -> np.ndarray:
    """LSB-first bitstream in little-endian u32 words (bits divides 32)."""
    per = 32 // bits
    sh = (np.arange(per, dtype=np.uint32) * bits)
    q = (wq[..., None] >> sh) & np.uint32((1 << bits) - 1)
    return q.reshape(*wq.shape[:-1], wq.shape[-1] * per)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    per = 32 // bits
    q = q.astype(np.uint32).reshape(*q.shape[:-1], q.shape[-1] // per, per)
    sh = (np.arange(per, dtype=np.uint32) * bits)
    return np.bitwise_or.reduce(q << sh, axis=-1).astype(np.uint32)


def round_half_away_from_zero(x: np.ndarray) -> np.ndarray:
    t = np.trunc(x)
    frac = x - t  # exact in float arithmetic
    return (t + np.where(np.abs(frac) >= np.float32(0.5), np.sign(x), np.float32(0.0))).astype(np.float32)


def bf16_truncate(x: np.ndarray) -> np.ndarray:
    """f32 -> bf16 by keeping the top 16 bits (no rounding); returned as f32 values."""
    return (x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def requant_2bit(w4: np.ndarray, s4: np.ndarray, b4: np.ndarray):
    """w4: u32 [..., rows, cols/8]; s4/b4: f32 (upcast from bf16) [..., rows, cols/64]."""
    q = unpack(w4, 4).astype(np.float32)
    cols = q.shape[-1]
    g = q.reshape(*q.shape[:-1], cols // GS, GS)
    f = (g * s4[..., None]).astype(np.float32) + b4[..., None]  # two roundings, no FMA
    f = f.astype(np.float32)
    hi, lo = f.max(-1), f.min(-1)
    s2 = ((hi - lo) / np.float32(3.0)).astype(np.float32)
    s2 = np.where(hi == lo, np.float32(1.0), s2).astype(np.float32)
    b2 = lo
    x = ((f - b2[..., None]) / s2[..., None]).astype(np.float32)
    q2 = np.clip(round_half_away_from_zero(x), 0, 3).astype(np.uint32)
    w2 = pack(q2.reshape(*q.shape[:-1], cols), 2)
    return w2, bf16_truncate(s2), bf16_truncate(b2), f.reshape(q.shape)


def e2_requantize_checkpoint(src: Path):
    """Returns {module_path: (w2 u32, s2 f32-exact-bf16, b2 ...)} for every routed expert
    projection of the 4-bit checkpoint at `src`, plus the max |numpy f32 dequant -
    mx.dequantize f32| over the 4-bit inputs."""
    weights = mx.load(str(src / "model.safetensors"))
    out, max_dq_diff = {}, 0.0
    for k in sorted(weights):
        if ".switch_mlp." in k and k.endswith(".weight"):
            p = k[: -len(".weight")]
            w4 = np.array(weights[k])
            s4 = np.array(weights[p + ".scales"].astype(F32))
            b4 = np.array(weights[p + ".biases"].astype(F32))
            w2, s2, b2, f = requant_2bit(w4, s4, b4)
            ref = np.array(mx.dequantize(weights[k], weights[p + ".scales"].astype(F32),
                                         weights[p + ".biases"].astype(F32), GS, 4, dtype=F32))
            max_dq_diff = max(max_dq_diff, float(np.abs(ref - f).max()))
            out[p] = (w2, s2, b2)
    return out, max_dq_diff


def e2_mutator(requant):
    def mutate(model):
        for p, (w2, s2, b2) in requant.items():
            mod = model
            for part in p.split("."):
                mod = mod[int(part)] if part.isdigit() else getattr(mod, part)
            mod.weight = mx.array(w2)
            mod.scales = mx.array(s2).astype(BF16)  # exact: values are bf16-representable
            mod.biases = mx.array(b2).astype(BF16)
            mod.bits = 2
        mx.eval(model.parameters())
    return mutate


# --------------------------------------------------------------------------------------
# Hugging Face layout (un-sanitize)
# --------------------------------------------------------------------------------------
def st_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def natural_key(k):
    return [int(t) if t.isdigit() else t for t in k.split(".")]


def minus_one_bf16(v):
    hf = (v.astype(F32) - 1.0).astype(BF16)
    # exactness: w in [0.5, 2) as bf16 => w - 1 is exact in bf16 and bf16(hf + 1) == w
    assert mx.array_equal((hf + 1.0), v).item(), "norm weight not exactly representable"
    return hf


def unsanitize_qwen35(params, num_layers, rng):
    """mlx qwen3_5_moe parameters -> transformers Qwen3_5MoeForConditionalGeneration keys."""
    hf = {}
    for k, v in params.items():
        if k == "language_model.lm_head.weight":
            nk = "lm_head.weight"
        else:
            assert k.startswith("language_model.model."), k
            nk = "model.language_model." + k[len("language_model.model."):]
        if "conv1d.weight" in nk:
            v = v.swapaxes(1, 2)  # mlx [C, K, 1] -> HF [C, 1, K]
        elif any(nk.endswith(s) for s in NORM_SHIFTED) and v.ndim == 1:
            v = minus_one_bf16(v)
        hf[nk] = v
    for l in range(num_layers):
        p = f"model.language_model.layers.{l}.mlp"
        g = hf.pop(f"{p}.switch_mlp.gate_proj.weight")
        u = hf.pop(f"{p}.switch_mlp.up_proj.weight")
        hf[f"{p}.experts.gate_up_proj"] = mx.concatenate([g, u], axis=1)  # [E, 2I, H]
        hf[f"{p}.experts.down_proj"] = hf.pop(f"{p}.switch_mlp.down_proj.weight")  # [E, H, I]
    # tensors a real checkpoint carries that the text-only engine must drop
    hf["mtp.fc.weight"] = mx.array((0.02 * rng.standard_normal((H, 2 * H))).astype(np.float32)).astype(BF16)
    hf["model.visual.patch_embed.proj.weight"] = mx.array(
        (0.02 * rng.standard_normal((16, 3, 2, 4, 4))).astype(np.float32)).astype(BF16)
    return hf


def unsanitize_qwen3next(params, num_layers, num_experts, rng):
    """mlx qwen3_next parameters -> transformers Qwen3NextForCausalLM keys (per-expert)."""
    hf = {}
    for k, v in params.items():
        if "conv1d.weight" in k:
            v = v.swapaxes(1, 2)
        elif any(k.endswith(s) for s in NORM_SHIFTED) and v.ndim == 1:
            v = minus_one_bf16(v)
        hf[k] = v
    for l in range(num_layers):
        p = f"model.layers.{l}.mlp"
        for n in ("gate_proj", "up_proj", "down_proj"):
            key = f"{p}.switch_mlp.{n}.weight"
            if key in hf:
                w = hf.pop(key)
                for e in range(num_experts):
                    hf[f"{p}.experts.{e}.{n}.weight"] = w[e]
    hf["mtp.fc.weight"] = mx.array((0.02 * rng.standard_normal((H, 2 * H))).astype(np.float32)).astype(BF16)
    return hf


def write_hf_checkpoint(d: Path, tensors, config, tok_json):
    d.mkdir(parents=True, exist_ok=True)
    keys = sorted(tensors, key=natural_key)
    total = sum(tensors[k].nbytes for k in keys)
    shards, acc = ([], []), 0
    for k in keys:
        shards[0 if acc < total / 2 else 1].append(k)
        acc += tensors[k].nbytes
    wm = {}
    for i, ks in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        mx.save_safetensors(str(d / name), {k: tensors[k] for k in ks}, metadata={"format": "pt"})
        wm.update({k: name for k in ks})
    index = {"metadata": {"total_size": total}, "weight_map": {k: wm[k] for k in sorted(wm)}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": [2, 0], "do_sample": False,
         "transformers_version": config.get("transformers_version")}, indent=2) + "\n")
    write_tokenizer(d, tok_json)


def run_convert(hf_dir: Path, mlx_dir: Path, bits=4):
    cmd = [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(hf_dir),
           "--mlx-path", str(mlx_dir), "-q", "--q-bits", str(bits), "--q-group-size", str(GS)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stdout, r.stderr)
        raise SystemExit(f"mlx_lm convert failed for {hf_dir}")
    return "mlx_lm.convert --hf-path <src> --mlx-path <expected_mlx> -q --q-bits 4 --q-group-size 64"


def compare_params(a: dict, b: dict, what):
    assert sorted(a) == sorted(b), (what, sorted(set(a) ^ set(b))[:10])
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (what, k, a[k].dtype, b[k].dtype)
        assert mx.array_equal(a[k], b[k]).item(), (what, k)
    print(f"  {what}: {len(a)} tensors bit-identical")


def build_hf_fixture(fixdir: Path, hf_config, seed, tok_json, arch):
    src, exp = fixdir / "src", fixdir / "expected_mlx"
    mlx_cfg = copy.deepcopy(hf_config)
    model = build_random_model(mlx_cfg, seed)
    cast_like_convert(model, mlx_cfg)
    params = dict(tree_flatten(model.parameters()))
    rng = np.random.default_rng(seed + 1)
    if arch == "qwen3_5_moe":
        n = hf_config["text_config"]["num_hidden_layers"]
        hf = unsanitize_qwen35(params, n, rng)
    else:
        hf = unsanitize_qwen3next(params, hf_config["num_hidden_layers"], hf_config["num_experts"], rng)
    mx.eval(hf)
    write_hf_checkpoint(src, hf, hf_config, tok_json)
    # 1. mlx_lm's own sanitize() must give back exactly the model we started from
    m2, _ = load_model(src)
    compare_params(dict(tree_flatten(m2.parameters())), params, "load_model(HF src) vs built model")
    # 2. the real converter
    cmd = run_convert(src, exp)
    # 3. convert output == quantize_model() applied directly to the built model
    qmodel, _ = quantize_model(model, mlx_cfg, GS, 4)
    compare_params(mx.load(str(exp / "model.safetensors")), dict(tree_flatten(qmodel.parameters())),
                   "expected_mlx vs quantize_model(built model)")
    return cmd


# --------------------------------------------------------------------------------------
def tensors_report(paths):
    lines = []
    for title, d in paths:
        lines.append(f"## {title}")
        files = sorted(Path(d).glob("*.safetensors"))
        for f in files:
            hdr = st_header(f)
            meta = hdr.pop("__metadata__", None)
            lines.append(f"# file {f.name}  metadata={json.dumps(meta)}  tensors={len(hdr)}")
            for k in sorted(hdr, key=natural_key):
                lines.append(f"{k:<78} {hdr[k]['dtype']:<5} {hdr[k]['shape']}")
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures")
    args = ap.parse_args()
    root = args.out
    root.mkdir(parents=True, exist_ok=True)
    mx.set_default_device(mx.cpu)

    tok_json, tok_info = train_tokenizer()
    print("tokenizer:", tok_info)

    def fresh(name):
        d = root / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        return d

    common = {"tokenizer": tok_info}

    # 1. qwen35moe-q4 ----------------------------------------------------------------
    d = fresh("qwen35moe-q4")
    build_mlx_fixture(d / "src", qwen35_mlx_config(interval=4, experts=16, topk=4, norm_topk=True,
                                                   tie=False), 4, seed=101, tok_json=tok_json)
    golden_from_checkpoint(d, d / "src", 1001,
                           "qwen3_5_moe, 4 layers (linear,linear,linear,full), 16 experts top-4, "
                           "norm_topk_prob, untied, 4-bit g64 (router + shared_expert_gate 8-bit)",
                           "src", extra=common)

    # 2. qwen3next-q4 ----------------------------------------------------------------
    d = fresh("qwen3next-q4")
    build_mlx_fixture(d / "src", qwen3next_config(interval=2, experts=8, topk=2, mlp_only=[2], tie=True,
                                                  norm_topk=True, intermediate=128),
                      4, seed=102, tok_json=tok_json)
    golden_from_checkpoint(d, d / "src", 1002,
                           "qwen3_next, 4 layers (linear,full,linear,full), 8 experts top-2, "
                           "layer 2 dense MLP (mlp_only_layers=[2], intermediate 128), tied embeddings, "
                           "norm_topk_prob, 4-bit g64 (router + shared_expert_gate 8-bit)",
                           "src", extra=common)

    # 3. qwen35moe-q8 ----------------------------------------------------------------
    d = fresh("qwen35moe-q8")
    build_mlx_fixture(d / "src", qwen35_mlx_config(interval=2, experts=8, topk=2, norm_topk=False,
                                                   tie=True), 8, seed=103, tok_json=tok_json)
    golden_from_checkpoint(d, d / "src", 1003,
                           "qwen3_5_moe, 4 layers (linear,full,linear,full), 16 experts top-4, "
                           "norm_topk_prob=false, tied embeddings, 8-bit g64 everywhere",
                           "src", extra=common)

    # 4. qwen35moe-q2 ----------------------------------------------------------------
    d = fresh("qwen35moe-q2")
    build_mlx_fixture(d / "src", qwen35_mlx_config(interval=4, experts=16, topk=4, norm_topk=True,
                                                   tie=False), 2, seed=104, tok_json=tok_json)
    golden_from_checkpoint(d, d / "src", 1004,
                           "qwen3_5_moe like qwen35moe-q4 (other random weights), 2-bit g64 "
                           "(router + shared_expert_gate 8-bit)", "src", extra=common)

    # 5. qwen35moe-q4-e2 -------------------------------------------------------------
    d = fresh("qwen35moe-q4-e2")
    base = root / "qwen35moe-q4" / "src"
    requant, dq_diff = e2_requantize_checkpoint(base)
    print(f"  e2: numpy f32 dequant (q*s+b, no FMA) vs mx.dequantize f32: max|diff| = {dq_diff}")
    l0 = {}
    for p, (w2, s2, b2) in requant.items():
        if p.startswith("language_model.model.layers.0.mlp.switch_mlp."):
            n = p.split(".")[-1]
            l0[f"{n}.weight"] = mx.array(w2)
            l0[f"{n}.scales"] = mx.array(s2).astype(BF16)
            l0[f"{n}.biases"] = mx.array(b2).astype(BF16)
    mx.save_safetensors(str(d / "layer0_experts_2bit.safetensors"), l0, metadata={"format": "mlx"})
    overrides = {p: {"group_size": GS, "bits": 2} for p in sorted(requant)}
    base_cfg = json.loads((base / "config.json").read_text())
    res = golden_from_checkpoint(
        d, base, 1005,
        "qwen35moe-q4 weights with every routed expert (switch_mlp.{gate,up,down}_proj) re-quantized "
        "4-bit -> 2-bit with the flash-moe seed algorithm (requant.json); everything else unchanged",
        "../qwen35moe-q4/src + requant.json", mutate=e2_mutator(requant),
        extra={**common, "quantization_overrides": overrides})
    # cross-check: a real checkpoint with per-module overrides in config.json loads to the same logits
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        m, _ = load_model(base)
        e2_mutator(requant)(m)
        save_model(td, m)
        cfg = copy.deepcopy(base_cfg)
        cfg["quantization"].update(overrides)
        save_config(cfg, td / "config.json")
        m2 = dequantize_f32(load_model(td)[0])
        lg = np.array(m2(mx.array([res["tokens"]])).astype(F32)[0])
        xd = float(np.abs(lg - res["logits"]).max())
        print(f"  e2: checkpoint with per-module bits=2 overrides vs in-memory golden: max|diff| = {xd}")
        assert xd == 0.0
    (d / "requant.json").write_text(json.dumps({
        "name": "flash-moe seed 4-bit -> 2-bit expert requantization",
        "source_checkpoint": "../qwen35moe-q4/src",
        "modules": sorted(requant),
        "applies_to": "routed experts only: language_model.model.layers.N.mlp.switch_mlp.{gate,up,down}_proj",
        "group_size": GS,
        "algorithm": [
            "for each group of 64 consecutive input-dim elements of one output row of one expert:",
            "  f[j] = float32(q4[j]) * float32(scale_bf16) + float32(bias_bf16)   (f32 multiply then f32 add, two roundings, no FMA)",
            "  hi = max(f), lo = min(f)",
            "  s2 = (hi - lo) / 3   (f32; hi-lo rounded to f32 first); if hi == lo: s2 = 1.0",
            "  b2 = lo",
            "  q2[j] = clamp(round_half_away_from_zero((f[j] - b2) / s2), 0, 3)   (f32 subtract, f32 divide, using the f32 s2)",
            "  store s2 and b2 as bf16 by TRUNCATION: bf16_bits = f32_bits >> 16 (no rounding)",
            "  pack q2 LSB-first, 16 codes per little-endian u32 (code j of a row at bit 2*(j%16) of word j/16)",
        ],
        "dequantization": "w = q2 * f32(s2_bf16) + f32(b2_bf16)",
        "numpy_dequant_vs_mx_dequantize_f32_max_abs_diff": dq_diff,
        "config_json_equivalent": {"quantization": overrides},
        "layer0_file": "layer0_experts_2bit.safetensors",
        "layer0_keys": {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in sorted(l0.items())},
        "layer0_source_keys": "language_model.model.layers.0.mlp.switch_mlp.{gate,up,down}_proj.{weight,scales,biases} in ../qwen35moe-q4/src/model.safetensors",
    }, indent=1) + "\n")

    # 6. qwen35moe-hf ----------------------------------------------------------------
    d = fresh("qwen35moe-hf")
    cmd = build_hf_fixture(d, qwen35_hf_config(), 106, tok_json, "qwen3_5_moe")
    golden_from_checkpoint(d, d / "expected_mlx", 1006,
                           "HF-layout bf16 qwen3_5_moe (4 layers linear,linear,linear,full; 8 experts top-2; "
                           "untied) in src/; expected_mlx/ is the output of the real mlx_lm convert 4-bit g64; "
                           "golden is for expected_mlx",
                           "expected_mlx", extra={**common, "convert_command": cmd})

    # 7. qwen3next-hf ----------------------------------------------------------------
    d = fresh("qwen3next-hf")
    cmd = build_hf_fixture(d, qwen3next_hf_config(), 107, tok_json, "qwen3_next")
    golden_from_checkpoint(d, d / "expected_mlx", 1007,
                           "HF-layout bf16 qwen3_next (4 layers linear,full,linear,full; 8 experts top-2, "
                           "per-expert tensors; untied) in src/; expected_mlx/ is the output of the real "
                           "mlx_lm convert 4-bit g64; golden is for expected_mlx",
                           "expected_mlx", extra={**common, "convert_command": cmd})

    (root / "TENSORS.txt").write_text(tensors_report([
        ("qwen35moe-q4/src (MLX layout, as mlx_lm.convert writes it)", root / "qwen35moe-q4" / "src"),
        ("qwen35moe-hf/src (Hugging Face layout, bf16, 2 shards)", root / "qwen35moe-hf" / "src"),
        ("qwen35moe-hf/expected_mlx (mlx_lm convert -q --q-bits 4 --q-group-size 64 of src)",
         root / "qwen35moe-hf" / "expected_mlx"),
        ("qwen3next-hf/src (Hugging Face layout, bf16, 2 shards)", root / "qwen3next-hf" / "src"),
        ("qwen3next-hf/expected_mlx (mlx_lm convert -q --q-bits 4 --q-group-size 64 of src)",
         root / "qwen3next-hf" / "expected_mlx"),
        ("qwen35moe-q4-e2/layer0_experts_2bit.safetensors", root / "qwen35moe-q4-e2"),
    ]))
    print("done:", root)


if __name__ == "__main__":
    main()
