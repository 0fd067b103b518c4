#!/usr/bin/env python3
"""Corpus, held-out split and tokenizer of the demo model (CPU, under a minute).

    apt-get install bible-kjv fortunes fortunes-min    # the text (Debian packages)
    pip install tokenizers==0.23.3 numpy
    python3 tools/train-demo/prepare.py OUT

Writes OUT/{tokenizer.json, tokenizer_config.json, train.bin, val.bin, val.txt,
corpus.json}. `train.bin` / `val.bin` are little-endian uint16 token streams,
documents separated by <|endoftext|>; `val.txt` is the held-out text as plain
text (what `moeflux perplexity` and `train.py --ppl` both read).

Everything is a function of the packages' text and SEED: running it twice gives
the same bytes.
"""

import argparse
import hashlib
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SEED = 20261123
VOCAB = 8192
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FORTUNES_DIR = Path("/usr/share/games/fortunes")
# fortune files of `fortunes` and `fortunes-min`, minus ascii art and the
# files that are not English prose (translate-me, disclaimer, knghtbrd).
FORTUNE_FILES = [
    "art", "computers", "cookie", "debian", "definitions", "drugs", "education",
    "ethnic", "food", "fortunes", "goedel", "humorists", "kids", "law", "linux",
    "linuxcookie", "literature", "love", "magic", "medicine", "men-women",
    "miscellaneous", "news", "paradoxum", "people", "perl", "pets", "platitudes",
    "politics", "pratchett", "riddles", "science", "songs-poems", "sports",
    "startrek", "tao", "wisdom", "work", "zippy",
]
BOOKS = [
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges",
    "Ruth", "1 Samuel", "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles",
    "2 Chronicles", "Ezra", "Nehemiah", "Esther", "Job", "Psalms", "Proverbs",
    "Ecclesiastes", "Song of Solomon", "Isaiah", "Jeremiah", "Lamentations",
    "Ezekiel", "Daniel", "Hosea", "Joel", "Amos", "Obadiah", "Jonah", "Micah",
    "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah", "Malachi", "Matthew",
    "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians", "2 Corinthians",
    "Galatians", "Ephesians", "Philippians", "Colossians", "1 Thessalonians",
    "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews",
    "James", "1 Peter", "2 Peter", "1 John", "2 John", "3 John", "Jude", "Revelation",
]
FORTUNE_PROMPTS = [
    "Tell me a fortune.",
    "Give me a fortune cookie.",
    "Say something about {topic}.",
    "Tell me something about {topic}.",
    "Share a saying about {topic}.",
]
# ChatML, as Qwen's templates render it (no system prompt unless given).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def chat(user, assistant):
    return (f"<|im_start|>user\n{user}<|im_end|>\n"
            f"<|im_start|>assistant\n{assistant}<|im_end|>\n")


def held_out(text):
    """About 5% of documents, chosen by content so the split needs no order."""
    return hashlib.sha256(text.encode()).digest()[0] < 13


def kjv():
    """Chapters as documents ("Genesis 1" then numbered verses) and verses."""
    try:
        out = subprocess.run(["bible", "-f", "gen1:1-rev22:21"], check=True,
                             capture_output=True, text=True).stdout
    except FileNotFoundError:
        sys.exit("prepare.py: `bible` not found: apt-get install bible-kjv")
    line_re = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")
    abbrevs, chapters, verses = [], {}, []
    for line in out.splitlines():
        m = line_re.match(line)
        if not m:
            sys.exit(f"prepare.py: unexpected line from `bible`: {line!r}")
        abbrev, ch, v, text = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        if not abbrevs or abbrevs[-1] != abbrev:
            abbrevs.append(abbrev)
        book = BOOKS[len(abbrevs) - 1]
        chapters.setdefault((book, ch), []).append(f"{v} {text}")
        verses.append((book, ch, v, text))
    if len(abbrevs) != len(BOOKS):
        sys.exit(f"prepare.py: `bible` gave {len(abbrevs)} books, expected 66")
    docs = [f"{book} {ch}\n\n" + "\n".join(vs) for (book, ch), vs in chapters.items()]
    return docs, verses


def fortunes():
    """(topic, text) for every fortune; tabs expanded, trailing space cut."""
    out = []
    for name in FORTUNE_FILES:
        path = FORTUNES_DIR / name
        if not path.exists():
            sys.exit(f"prepare.py: {path} missing: apt-get install fortunes fortunes-min")
        raw = path.read_text(encoding="latin-1")
        for item in raw.split("\n%\n"):
            text = "\n".join(l.expandtabs(8).rstrip() for l in item.strip("\n%").split("\n"))
            if text.strip():
                out.append((name.replace("-", " and "), text.strip("\n")))
    return out


def train_tokenizer(texts):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def stream(tok, docs, eot):
    ids = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.asarray(ids, dtype="<u2")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    rng = random.Random(SEED)

    chapters, verses = kjv()
    fort = fortunes()
    train_docs, val_docs = [], []
    for d in chapters:
        (val_docs if held_out(d) else train_docs).append(d)
    held_chapters = {d.split("\n", 1)[0] for d in val_docs}
    for _, text in fort:
        (val_docs if held_out(text) else train_docs).append(text)
    # Chat turns only from training text, so held-out text stays unseen.
    chats = []
    for topic, text in fort:
        if not held_out(text):
            q = rng.choice(FORTUNE_PROMPTS).format(topic=topic)
            chats.append(chat(q, text))
    for book, ch, v, text in verses:
        if f"{book} {ch}" not in held_chapters and rng.random() < 0.25:
            chats.append(chat(f"Quote {book} {ch}:{v}.", text))
    train_all = train_docs + chats
    rng.shuffle(train_all)

    tok = train_tokenizer(train_all)
    eot = tok.token_to_id("<|endoftext|>")
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 2048,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")

    train = stream(tok, train_all, eot)
    val_text = "\n\n".join(val_docs) + "\n"
    val = stream(tok, val_docs, eot)
    train.tofile(args.out / "train.bin")
    val.tofile(args.out / "val.bin")
    (args.out / "val.txt").write_text(val_text)
    info = {
        "seed": SEED,
        "vocab_size": tok.get_vocab_size(),
        "special_ids": {s: tok.token_to_id(s) for s in SPECIALS},
        "sources": {
            "bible-kjv-text": "King James Version (1611), public domain; Debian package bible-kjv-text 4.38",
            "fortunes": "fortune-mod 1.99.1 data files (BSD licence); Debian packages fortunes, fortunes-min 1:1.99.1-7.3",
        },
        "documents": {"kjv_chapters": len(chapters), "fortunes": len(fort),
                      "chat_turns": len(chats), "train": len(train_docs), "held_out": len(val_docs)},
        "tokens": {"train": int(train.size), "held_out": int(val.size)},
        "bytes": {"held_out_text": len(val_text.encode())},
        "sha256": {name: hashlib.sha256((args.out / name).read_bytes()).hexdigest()
                   for name in ["tokenizer.json", "train.bin", "val.bin", "val.txt"]},
    }
    (args.out / "corpus.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info["documents"]), json.dumps(info["tokens"]))


if __name__ == "__main__":
    main()
