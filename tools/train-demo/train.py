#!/usr/bin/env python3
"""Trains the demo Qwen3.5-MoE with transformers' own `qwen3_5_moe` code (GPU).

    python3 tools/train-demo/train.py --data DATA --out OUT [--steps 750]

DATA is prepare.py's output. OUT gets `hf/`, a Hugging Face checkpoint in the
layout of Qwen3.5's releases (`Qwen3_5MoeForConditionalGeneration` config with a
`text_config`, tensors under `model.language_model.`), which `moeflux convert`
reads, and `train.json` (settings, loss curve, held-out perplexity in float32
and bfloat16 from ppl.py's windows).
"""

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from hfckpt import load_checkpoint
from ppl import perplexity

SEED = 20261123


def text_config(vocab, specials):
    """About 20M parameters, 8 layers (2 full attention), 32 experts top-4."""
    return dict(
        vocab_size=vocab,
        hidden_size=256,
        num_hidden_layers=8,
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=256,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        hidden_act="silu",
        rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [4, 2, 2], "mrope_interleaved": True,
        },
        router_aux_loss_coef=0.01,
        eos_token_id=specials["<|im_end|>"],
        pad_token_id=specials["<|endoftext|>"],
        bos_token_id=None,
    )


def save_checkpoint(model, cfg, data, out):
    """Qwen3.5's release layout, which `moeflux convert` takes as is."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        hf = name if name.startswith("lm_head.") else "model.language_model." + name[len("model."):]
        tensors[hf] = t.detach().to(torch.bfloat16).contiguous().cpu()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    text = dict(cfg)
    text["model_type"] = "qwen3_5_moe_text"
    text["dtype"] = "bfloat16"
    text["layer_types"] = model.config.layer_types
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": text,
        "eos_token_id": cfg["eos_token_id"],
    }, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [cfg["eos_token_id"], cfg["pad_token_id"]],
        "do_sample": True, "temperature": 0.7, "top_p": 0.9,
    }, indent=2) + "\n")
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(data / f, out / f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=750)
    ap.add_argument("--max-seconds", type=float, default=float("inf"),
                    help="stop early (schedule intact) when training takes longer")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--experts-impl", default="grouped_mm")
    ap.add_argument("--device", default="cuda", help="cpu for a smoke test")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--no-eval", action="store_true", help="skip saving and the perplexity")
    args = ap.parse_args()

    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device(args.device)
    corpus = json.loads((args.data / "corpus.json").read_text())
    specials = corpus["special_ids"]
    cfg = text_config(corpus["vocab_size"], specials)
    config = Qwen3_5MoeTextConfig(**cfg)
    config.output_router_logits = True
    config._experts_implementation = args.experts_impl
    model = Qwen3_5MoeForCausalLM(config).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params / 1e6:.2f} M", flush=True)

    train = torch.from_numpy(np.fromfile(args.data / "train.bin", dtype="<u2").astype(np.int64))
    val = torch.from_numpy(np.fromfile(args.data / "val.bin", dtype="<u2").astype(np.int64))
    n_val = min(64, val.numel() // args.seq)
    val_x = val[:n_val * args.seq].view(n_val, args.seq).to(dev)

    @torch.no_grad()
    def val_loss():
        model.eval()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            losses = [float(model(input_ids=val_x[i:i + 8], labels=val_x[i:i + 8]).loss)
                      for i in range(0, n_val, 8)]
        model.train()
        return sum(losses) / len(losses)
    gen = torch.Generator().manual_seed(SEED)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=dev.type == "cuda")
    warmup = max(1, args.steps // 20)

    def lr_at(step):
        if step < warmup:
            return args.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    log, t0, step = [], time.time(), 0
    model.train()
    for step in range(args.steps):
        starts = torch.randint(0, train.numel() - args.seq, (args.batch,), generator=gen)
        x = torch.stack([train[s:s + args.seq] for s in starts.tolist()]).to(dev)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = model(input_ids=x, labels=x)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.time() - t0
            aux = out.aux_loss.item() if out.aux_loss is not None else float("nan")
            entry = {"step": step, "loss": loss.item(), "aux": aux, "lr": lr_at(step), "s": el}
            if step % 250 == 0 or step == args.steps - 1:
                entry["val_loss"] = val_loss()
            log.append(entry)
            print(json.dumps(entry), flush=True)
            if el > args.max_seconds:
                print(f"stopping at step {step}: time budget", flush=True)
                break

    model.eval()
    result_log = {"steps_done": step + 1, "train_seconds": time.time() - t0, "log": log}
    if args.no_eval:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "train.json").write_text(json.dumps(result_log, indent=2) + "\n")
        return
    save_checkpoint(model, cfg, args.data, args.out / "hf")
    val_text = (args.data / "val.txt").read_text()
    result = {
        "parameters": n_params,
        "settings": {**vars(args), "data": str(args.data), "out": str(args.out), "seed": SEED},
        **result_log,
        "held_out": {},
    }
    for dtype in [torch.float32, torch.bfloat16]:
        m = load_checkpoint(args.out / "hf", dtype, dev)
        result["held_out"][str(dtype).split(".")[-1]] = perplexity(
            m, args.data / "tokenizer.json", val_text, ctx=args.seq, dev=dev)
        print("held-out", dtype, result["held_out"], flush=True)
    (args.out / "train.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
