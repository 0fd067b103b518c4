#!/usr/bin/env python3
"""Second oracle: transformers' logits on the weights a moeflux model directory
holds (every quantized tensor dequantized), for fixed prompts.

    python3 tools/train-demo/oracle.py --model models/qwen35-demo --val DATA/val.txt \
        --out crates/moeflux/tests/fixtures/demo_oracle.json [--device cuda]

The model is transformers' own `Qwen3_5MoeForCausalLM` in float32, built from
the directory's `config.json`; its weights are read from `dense.safetensors`
and `experts/layer_NNN.bin` through `moeflux.json` and mapped back to Hugging
Face names (norms stored as 1 + w lose the 1 again, conv1d [C, K, 1] goes back
to [C, 1, K], the expert projections are stacked into `gate_up_proj` /
`down_proj`). So moeflux and transformers compute with identical numbers and
any difference is the forward pass.

For each prompt and position the golden keeps the 32 largest logits, 32 more at
fixed random ids, the full-vocabulary log-sum-exp and the argmax: small enough
to commit, and a wrong logit anywhere still moves the log-sum-exp.
"""

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from hfckpt import load_state, text_model
from ppl import perplexity

NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                 "model.norm.weight", ".q_norm.weight", ".k_norm.weight")
TOP, RANDOM = 32, 32


def dequantize(codes, scales, biases, bits, group):
    """MLX affine: LSB-first `bits`-bit codes in little-endian u32 words."""
    if 32 % bits:
        raise SystemExit(f"oracle.py: {bits}-bit codes are not handled")
    rows = codes.shape[0]
    words = codes.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    q = ((words[..., None] >> shifts) & ((1 << bits) - 1)).reshape(rows, -1).float()
    s = scales.float().repeat_interleave(group, dim=1)
    b = biases.float().repeat_interleave(group, dim=1)
    return q * s + b


def raw_tensor(buf, desc, shape):
    dtype = {"U32": torch.int32, "BF16": torch.bfloat16, "F32": torch.float32}[desc["dtype"]]
    t = torch.frombuffer(bytearray(buf[desc["offset"]:desc["offset"] + desc["bytes"]]), dtype=dtype)
    return t.reshape(shape)


def hf_weights(model_dir: Path):
    """Every tensor of the directory as the float32 Hugging Face parameter."""
    manifest = json.loads((model_dir / "moeflux.json").read_text())
    dense = load_file(str(model_dir / manifest["dense_file"]))
    out = {}
    for module, q in manifest["quantized"].items():
        out[module + ".weight"] = dequantize(dense.pop(module + ".weight"), dense.pop(module + ".scales"),
                                             dense.pop(module + ".biases"), q["bits"], q["group_size"])
    for name, t in dense.items():
        t = t.float()
        if name.endswith(NORM_SUFFIXES):
            t = t - 1.0
        if name.endswith("conv1d.weight"):
            t = t.transpose(1, 2)
        out[name] = t
    for layer in manifest["experts"]:
        buf = (model_dir / layer["file"]).read_bytes()
        proj = {c["name"]: [] for c in layer["components"]}
        for e in range(layer["num_experts"]):
            ext = buf[e * layer["stride"]:e * layer["stride"] + layer["expert_bytes"]]
            for c in layer["components"]:
                q, r, k = c["quant"], c["rows"], c["cols"]
                codes = raw_tensor(ext, c["weight"], (r, k * q["bits"] // 32))
                scales = raw_tensor(ext, c["scales"], (r, k // q["group_size"]))
                biases = raw_tensor(ext, c["biases"], (r, k // q["group_size"]))
                proj[c["name"]].append(dequantize(codes, scales, biases, q["bits"], q["group_size"]))
        p = f"model.layers.{layer['layer']}.mlp.experts."
        out[p + "gate_up_proj"] = torch.cat([torch.stack(proj["gate_proj"]), torch.stack(proj["up_proj"])], dim=1)
        out[p + "down_proj"] = torch.stack(proj["down_proj"])
    return out


def prompts(tok, val_text):
    chat = "<|im_start|>user\nTell me a fortune.<|im_end|>\n<|im_start|>assistant\n"
    held = tok.encode(val_text, add_special_tokens=False).ids
    return [
        ("kjv opening", tok.encode("In the beginning God created", add_special_tokens=False).ids),
        ("chat turn", tok.encode(chat, add_special_tokens=False).ids),
        ("held-out 128 tokens", held[:128]),
        ("held-out 40 tokens", held[5000:5040]),
    ]


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--val", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    model = load_state(text_model(args.model, torch.float32, dev),
                       {k: v.to(dev) for k, v in hf_weights(args.model).items()})
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    vocab = model.config.vocab_size
    pick = np.random.default_rng(20261123).choice(vocab, RANDOM, replace=False)
    golden = []
    for name, ids in prompts(tok, args.val.read_text()):
        logits = model(input_ids=torch.tensor([ids], device=dev)).logits[0].double().cpu()
        lse = torch.logsumexp(logits, dim=-1)
        rows = []
        for row, z in zip(logits, lse):
            keep = sorted(set(torch.topk(row, TOP).indices.tolist()) | set(pick.tolist()))
            rows.append({"ids": keep, "logits": [float(f"{row[i].item():.9g}") for i in keep],
                         "logsumexp": float(f"{z.item():.12g}"), "argmax": int(row.argmax())})
        golden.append({"name": name, "tokens": ids, "positions": rows})
    # Perplexity on the same weights: a short overlapping run the CPU test
    # repeats, and the whole held-out text (docs/DEMO.md).
    val_text = args.val.read_text()
    ppl = [perplexity(model, args.model / "tokenizer.json", val_text, ctx=w, dev=dev, stride=s,
                      max_tokens=m)
           for w, s, m in [(256, 96, 1500), (512, 512, None)]]
    manifest = (args.model / "moeflux.json").read_bytes()
    args.out.write_text(json.dumps({
        "oracle": f"transformers Qwen3_5MoeForCausalLM float32 on {args.device}, "
                  "weights dequantized from the moeflux directory",
        "moeflux_json_sha256": hashlib.sha256(manifest).hexdigest(),
        "held_out_sha256": hashlib.sha256(val_text.encode()).hexdigest(),
        "vocab_size": vocab,
        "prompts": golden,
        "perplexity": ppl,
    }, separators=(",", ":")) + "\n")
    print(f"wrote {args.out}: {sum(len(p['tokens']) for p in golden)} positions")


if __name__ == "__main__":
    main()
