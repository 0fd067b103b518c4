"""Held-out perplexity with the same windows as `moeflux perplexity`.

The text is tokenized whole (no special tokens added) and cut into windows of
`ctx` tokens starting every `stride` tokens; each window scores the tokens no
earlier window scored, except its own first (it has no context). With
stride == ctx the windows do not overlap and each scores ctx - 1 tokens.
"""

import math

import torch
from tokenizers import Tokenizer


def windows(n, ctx, stride):
    """(begin, end, first scored position) for each window."""
    out, scored_to = [], 1
    for begin in range(0, n, stride):
        end = min(begin + ctx, n)
        first = max(begin + 1, scored_to)
        if first < end:
            out.append((begin, end, first))
        scored_to = end
        if end == n:
            break
    return out


@torch.no_grad()
def perplexity(model, tokenizer_json, text, ctx, dev, stride=None, max_tokens=None):
    ids = Tokenizer.from_file(str(tokenizer_json)).encode(text, add_special_tokens=False).ids
    ids = ids[:max_tokens]
    nll, count = 0.0, 0
    for begin, end, first in windows(len(ids), ctx, stride or ctx):
        x = torch.tensor([ids[begin:end]], device=dev)
        logp = torch.log_softmax(model(input_ids=x).logits[0].double(), dim=-1)
        targets = x[0, first - begin:]
        nll -= logp[first - begin - 1:end - begin - 1].gather(1, targets[:, None]).sum().item()
        count += end - first
    return {"tokens": len(ids), "scored": count, "nll_per_token": nll / count,
            "perplexity": math.exp(nll / count), "ctx": ctx, "stride": stride or ctx,
            "max_tokens": max_tokens}
