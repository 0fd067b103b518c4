"""Loads a checkpoint in Qwen3.5's release layout into transformers' text-only
`Qwen3_5MoeForCausalLM` (the layout's `model.language_model.` prefix becomes
`model.`), without relying on a transformers version's key mapping."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig


def text_model(ckpt: Path, dtype, dev):
    cfg = json.loads((ckpt / "config.json").read_text())["text_config"]
    cfg = {k: v for k, v in cfg.items() if k not in ("model_type", "dtype", "torch_dtype")}
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**cfg))
    return model.to(dtype=dtype, device=dev).eval()


def to_text_names(tensors):
    out = {}
    for name, t in tensors.items():
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        out[name] = t
    return out


def load_state(model, tensors):
    """Every parameter must be given, and nothing else."""
    missing, unexpected = model.load_state_dict(to_text_names(tensors), strict=False)
    if missing or unexpected:
        raise SystemExit(f"checkpoint mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model


def load_checkpoint(ckpt: Path, dtype, dev):
    model = text_model(ckpt, dtype, dev)
    tensors = {k: v.to(dtype=dtype, device=dev) for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    return load_state(model, tensors)
