"""GPT-2's byte -> printable character table, the alphabet of byte-level BPE vocabularies:
shared by moeflux2gguf.py (the placeholder GGUF vocabulary) and serve-load.py (the same
vocabulary as a tokenizer.json). Standard library only."""


def bytes_to_unicode() -> list[str]:
    """The printable character of each byte value 0..255."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]
