"""`logprobs` through the official `openai` client: the values against
log-softmax of `moeflux logits` for the same tokens, streamed against not,
chat against completions, and the refusals."""

import ast
import json
import math
import struct
import subprocess

import openai
import pytest

from conftest import BIN
from test_openai_client import NO_THINK, client

MESSAGE = "Logprobs, please: how many legs do 3 ducks have?"
# The fixture's Qwen3.5 template for MESSAGE with thinking off.
RENDERED = (f"<|im_start|>user\n{MESSAGE}<|im_end|>\n<|im_start|>assistant\n"
            "<think>\n\n</think>\n\n")
STEPS = 4
TOP = 5
# Both sides take log-softmax in f64 of the same f32 logits (the CPU's are
# bit-identical batched or not); only the summation order differs (~1e-15).
TOL = 1e-9


def byte_level_table():
    """GPT-2's bytes_to_unicode, inverted (character -> byte)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD))
                 + list(range(0xAE, 0x100)))
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table


def token_bytes(model_dir):
    """Every token id's bytes, from tokenizer.json (byte-level BPE)."""
    t = json.loads((model_dir / "tokenizer.json").read_text())
    table = byte_level_table()
    out = {i: bytes(table[c] for c in tok) for tok, i in t["model"]["vocab"].items()}
    out.update({a["id"]: a["content"].encode() for a in t["added_tokens"]})
    return out


def logits_rows(model_dir, ids):
    """`moeflux logits` of `ids`: one row per position (an .npy on stdout)."""
    out = subprocess.run(
        [str(BIN), "logits", "--model", str(model_dir), "--backend", "cpu",
         "--tokens", ",".join(map(str, ids)), "--output", "-"],
        check=True, capture_output=True).stdout
    assert out[:6] == b"\x93NUMPY"
    header_len = struct.unpack("<H", out[8:10])[0]
    header = ast.literal_eval(out[10:10 + header_len].decode())
    assert header["descr"] == "<f4" and not header["fortran_order"], header
    rows, vocab = header["shape"]
    data = out[10 + header_len:]
    assert rows == len(ids) and len(data) == rows * vocab * 4
    return [struct.unpack_from(f"<{vocab}f", data, r * vocab * 4) for r in range(rows)]


def log_softmax(row):
    m = max(row)
    lse = m + math.log(math.fsum(math.exp(x - m) for x in row))
    return [x - lse for x in row]


def prompt_ids(model_dir):
    out = subprocess.run([str(BIN), "tokenize", "--model", str(model_dir), "--json", RENDERED],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def chat(c, **kw):
    return c.chat.completions.create(
        model="tiny-qwen", messages=[{"role": "user", "content": MESSAGE}], temperature=0,
        max_tokens=STEPS, logprobs=True, top_logprobs=TOP,
        extra_body={**NO_THINK, "ignore_eos": True}, **kw)


@pytest.fixture(scope="module")
def greedy(server):
    """The non-streamed chat answer with logprobs."""
    return chat(client(server))


def test_logprobs_match_moeflux_logits(server, model_dir, greedy):
    ids = prompt_ids(model_dir)
    assert greedy.usage.prompt_tokens == len(ids), "the hand-rendered prompt differs"
    content = greedy.choices[0].logprobs.content
    assert len(content) == STEPS == greedy.usage.completion_tokens
    table = token_bytes(model_dir)
    by_bytes = {b: i for i, b in table.items()}
    assert len(by_bytes) == len(table)
    generated = [by_bytes[bytes(e.bytes)] for e in content]
    # Row len(ids) - 1 + k: the logits after the prompt and the first k
    # generated tokens (the model is causal: later tokens do not change it).
    rows = logits_rows(model_dir, ids + generated[:-1])[len(ids) - 1:]
    for step, (entry, row) in enumerate(zip(content, rows)):
        lp = log_softmax(row)
        order = sorted(range(len(lp)), key=lambda i: (-lp[i], i))
        # Greedy: the token is the argmax.
        chosen = order[0]
        assert generated[step] == chosen, step
        assert entry.token == table[chosen].decode("utf-8", "replace")
        assert abs(entry.logprob - lp[chosen]) < TOL, (step, entry.logprob, lp[chosen])
        assert len(entry.top_logprobs) == TOP
        for alt, want in zip(entry.top_logprobs, order[:TOP]):
            assert bytes(alt.bytes) == table[want], step
            assert abs(alt.logprob - lp[want]) < TOL, step


def streamed(c, **kw):
    """A streamed chat answer: its text, logprobs entries and finish reason."""
    entries, text, finish = [], "", None
    for chunk in chat(c, stream=True, **kw):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
            if ch.logprobs is not None:
                entries += ch.logprobs.content
    return text, [e.model_dump() for e in entries], finish


def test_streamed_logprobs_are_the_same(server, greedy):
    text, entries, _ = streamed(client(server))
    assert text == greedy.choices[0].message.content
    assert entries == [e.model_dump() for e in greedy.choices[0].logprobs.content]


def test_streamed_logprobs_with_a_stop_string(server, greedy):
    # A stop string across the second and third tokens: the second's text
    # is held back (it may grow into the stop string), the third's never
    # shows; both tokens still come, on later chunks.
    e = greedy.choices[0].logprobs.content
    stop = e[1].token + e[2].token[:1]
    c = client(server)
    full = chat(c, stop=[stop])
    assert full.choices[0].finish_reason == "stop"
    entries = [x.model_dump() for x in full.choices[0].logprobs.content]
    assert entries == [x.model_dump() for x in e[:3]]
    assert streamed(c, stop=[stop]) == (full.choices[0].message.content, entries, "stop")


def test_completions_logprobs(server, model_dir, greedy):
    # The chat prompt's ids as a completions prompt: the same distribution.
    c = client(server)
    kw = dict(model="tiny-qwen", prompt=prompt_ids(model_dir), temperature=0, max_tokens=STEPS,
              logprobs=3, extra_body={"ignore_eos": True})
    r = c.completions.create(**kw)
    lp = r.choices[0].logprobs
    chat_entries = greedy.choices[0].logprobs.content
    assert lp.tokens == [e.token for e in chat_entries]
    assert lp.token_logprobs == [e.logprob for e in chat_entries]
    offset = 0
    for i, e in enumerate(chat_entries):
        assert lp.text_offset[i] == offset
        offset += len(e.token)
        want = {}
        for a in e.top_logprobs[:3]:
            want.setdefault(a.token, a.logprob)
        want.setdefault(e.token, e.logprob)
        assert lp.top_logprobs[i] == want
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in c.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for k in streamed:
                streamed[k] += getattr(chunk.choices[0].logprobs, k)
    assert streamed == {k: getattr(lp, k) for k in streamed}


def test_no_logprobs_unless_asked(server, greedy):
    r = client(server).chat.completions.create(
        model="tiny-qwen", messages=[{"role": "user", "content": MESSAGE}], temperature=0,
        max_tokens=STEPS, extra_body={**NO_THINK, "ignore_eos": True})
    assert r.choices[0].logprobs is None
    assert r.choices[0].message.content == greedy.choices[0].message.content


def test_logprobs_refusals(server):
    c = client(server)
    m = [{"role": "user", "content": "x"}]
    for kw, param in [(dict(logprobs=True, top_logprobs=21), "top_logprobs"),
                      (dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
                      (dict(top_logprobs=2), "top_logprobs")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="m", messages=m, max_tokens=1, **kw)
        assert e.value.body["param"] == param, e.value.body
    for kw, param in [(dict(logprobs=6), "logprobs"), (dict(logprobs=1, echo=True), "echo")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="m", prompt="x", max_tokens=1, **kw)
        assert e.value.body["param"] == param, e.value.body


def test_logprobs_under_a_grammar_are_the_raw_distribution(server, model_dir):
    # A JSON answer from a model whose free answer is not JSON: the grammar's
    # mask picks other tokens than the argmax, yet their logprobs are those
    # of the logits the model gave (the mask only decides which token).
    r = chat(client(server), response_format={"type": "json_object"})
    content = r.choices[0].logprobs.content
    table = token_bytes(model_dir)
    by_bytes = {b: i for i, b in table.items()}
    generated = [by_bytes[bytes(e.bytes)] for e in content]
    assert r.choices[0].message.content.startswith("{")
    ids = prompt_ids(model_dir)
    rows = logits_rows(model_dir, ids + generated[:-1])[len(ids) - 1:]
    masked_steps = 0
    for step, (entry, row) in enumerate(zip(content, rows)):
        lp = log_softmax(row)
        order = sorted(range(len(lp)), key=lambda i: (-lp[i], i))
        masked_steps += generated[step] != order[0]
        assert abs(entry.logprob - lp[generated[step]]) < TOL, step
        for alt, want in zip(entry.top_logprobs, order[:TOP]):
            assert bytes(alt.bytes) == table[want], step
            assert abs(alt.logprob - lp[want]) < TOL, step
    assert masked_steps > 0, "the grammar never changed the greedy token"
