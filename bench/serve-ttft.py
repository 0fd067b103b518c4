#!/usr/bin/env python3
"""Time to first token of turn 10 of a 10-turn chat through `moeflux serve`,
with and without prefix reuse (docs/PERFORMANCE.md has the results).

Three runs of the same conversation (greedy, fixed-length replies with
`ignore_eos`), each on a fresh server:

  no reuse       --no-prefix-reuse: every turn prefills its whole prompt
  reuse          the session keeps the conversation between turns
  reuse, mixed   another conversation runs before every turn, so the
                 session holds something else and the turn restores the
                 prefix-cache snapshot taken at its last message boundary

TTFT is measured by the client (request sent -> first streamed text) and
reported by the server (`timings.ttft_ms`: start of the job -> first token).
Without --model, a model is made with `moeflux synth` (Qwen3.6-35B-A3B
widths, first --layers layers, the Qwen3.5 tokenizer, built-in ChatML
template).
Only the standard library is used.

  python3 bench/serve-ttft.py [--bin target/release/moeflux] [--model DIR]
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORDS = ("the model streams experts from disk while the dense part stays resident and "
         "every token reads a few routed experts per layer so the cache and the page "
         "cache decide how fast decoding runs on a machine with little memory").split()


def user_message(turn, words):
    # Deterministic, different every turn.
    return " ".join(WORDS[(turn * 7 + i) % len(WORDS)] for i in range(words)) + f" (turn {turn})"


class Server:
    def __init__(self, binary, model, args):
        self.proc = subprocess.Popen(
            [binary, "serve", "--model", str(model), "--port", "0", "--backend", "cpu", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for _ in range(200):
            line = self.proc.stderr.readline().decode()
            m = re.search(r"listening on (http://[\d.]+:\d+)", line)
            if m:
                self.url = m.group(1)
                return
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError("server did not start")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


def chat(url, messages, reply_tokens):
    """Streams one answer; returns (text, client TTFT s, final chunk)."""
    body = {"messages": messages, "max_tokens": reply_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, last = None, "", None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            for ch in chunk["choices"]:
                piece = ch["delta"].get("content") or ch["delta"].get("reasoning_content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text += ch["delta"].get("content") or ""
            if "usage" in chunk:
                last = chunk
    return text, ttft if ttft is not None else time.perf_counter() - t0, last


def conversation(url, turns, words, reply_tokens, mixed):
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    other = [{"role": "system", "content": "You answer questions about boats."}]
    result = None
    for turn in range(1, turns + 1):
        if mixed:
            other.append({"role": "user", "content": user_message(100 + turn, words)})
            reply, _, _ = chat(url, other, reply_tokens)
            other.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": user_message(turn, words)})
        reply, ttft, last = chat(url, messages, reply_tokens)
        messages.append({"role": "assistant", "content": reply})
        result = (ttft, last)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "moeflux"))
    ap.add_argument("--model", help="model directory (default: synth one)")
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--words", type=int, default=40, help="words per user message")
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--tokenizer", default=str(ROOT / "target/tokenizer-data/qwen3_5.tokenizer.json"),
                    help="tokenizer.json for the synth model (default: the Qwen3.5 one the "
                         "tokenizer truth test fetches; `python3 tools/tokenizer/prepare.py DIR` "
                         "writes it)")
    a = ap.parse_args()

    tmp = None
    model = a.model
    if model is None:
        tmp = tempfile.TemporaryDirectory(prefix="moeflux-serve-ttft-")
        model = Path(tmp.name) / "model"
        print(f"synth {a.preset} --layers {a.layers} -> {model}", file=sys.stderr)
        if not Path(a.tokenizer).is_file():
            sys.exit(f"no tokenizer at {a.tokenizer}; see --help")
        subprocess.run([a.bin, "synth", "--preset", a.preset, str(model), "--layers",
                        str(a.layers), "--tokenizer", a.tokenizer],
                       check=True, stdout=subprocess.DEVNULL)
    extra = ["--threads", str(a.threads)] if a.threads else []

    rows = []
    for name, args, mixed in [("no reuse", ["--no-prefix-reuse"], False),
                              ("reuse", [], False),
                              ("reuse, mixed", [], True)]:
        s = Server(a.bin, model, args + extra)
        try:
            ttft, last = conversation(s.url, a.turns, a.words, a.reply_tokens, mixed)
        finally:
            s.stop()
        u, t = last["usage"], last["timings"]
        rows.append((name, u["prompt_tokens"], t["prompt_tokens_evaluated"],
                     u["prompt_tokens_details"]["cached_tokens"], t["ttft_ms"], ttft * 1e3))
        print(f"{name}: done", file=sys.stderr)

    print(f"\nturn {a.turns} of a {a.turns}-turn chat ({a.words}-word user messages, "
          f"{a.reply_tokens}-token replies), model {Path(model).name if a.model else a.preset + ' x' + str(a.layers) + ' layers'}\n")
    print("| mode | prompt tokens | prefilled | reused | server TTFT ms | client TTFT ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.1f} | {r[5]:.1f} |")
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
