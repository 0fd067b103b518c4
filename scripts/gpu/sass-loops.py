#!/usr/bin/env python3
"""The loops of a kernel's SASS and what each body issues, without a GPU.

Reads `cuobjdump -sass -fun KERNEL` output (a CUBIN from `kernel-regs.py --cubin`; the tools
from NVIDIA's PyPI wheels, scripts/gpu/README.md) and prints every loop (a backward branch and
the code it jumps back over) that holds a tensor-core or FMA instruction: its length, the
instructions per tensor-core instruction and the most common opcodes. A static count, but a
kernel's main loop runs once per k-step, so its body's length is what each step issues:
compare variants here before device time is spent on them.

    cuobjdump -sass -fun qmma_q8s /tmp/k.cubin | python3 scripts/gpu/sass-loops.py
"""
import collections
import re
import sys


def main():
    code = []
    for line in sys.stdin:
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2)))
    at = {a: i for i, (a, _) in enumerate(code)}
    for i, (a, ins) in enumerate(code):
        m = re.search(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)", ins)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= a or target not in at:
            continue
        body = [op for _, op in code[at[target] : i + 1]]
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", op).split()[0].split(".")[0] for op in body)
        mma = ops["IMMA"] + ops["HMMA"]
        if not mma and not ops["FFMA"]:
            continue
        per = f", {len(body) / mma:.1f} a tensor-core instruction" if mma else ""
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(12))
        print(f"loop {target:#x}-{a:#x}: {len(body)} instructions{per}; {top}")


if __name__ == "__main__":
    main()
