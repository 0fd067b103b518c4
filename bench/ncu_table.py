"""One markdown row per kernel of an Nsight Compute text report (`ncu --section SpeedOfLight
--section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats ...`): launches
captured, mean duration, DRAM throughput (Memory Workload Analysis's "Memory Throughput" in
bytes/s; nan without that section), achieved occupancy and registers a thread. Used by
bench/gpu-ncu.sh.

    python3 bench/ncu_table.py REPORT.txt
"""

import re
import sys
from collections import OrderedDict

UNITS = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
RATES = {"Kbyte/s": 1e-6, "Mbyte/s": 1e-3, "Gbyte/s": 1.0, "Tbyte/s": 1e3}


def metric(block, name):
    """(unit, value) of the first line `name  unit  value` in a kernel's block, or None."""
    m = re.search(r"\n\s+" + re.escape(name) + r"\s+(\S+)\s+([\d.,]+)[ \t]*(?:\n|$)", block)
    return (m.group(1), float(m.group(2).replace(",", ""))) if m else None


def rows(text):
    kernels = OrderedDict()
    for block in re.split(r"\n  (?=[A-Za-z_][\w<>,: ]* \(\d+, \d+, \d+\)x)", text)[1:]:
        name = block.split("\n", 1)[0].split(", Context")[0].strip()
        dur = metric(block, "Duration")
        if dur is None or dur[0] not in UNITS:
            continue
        rate = re.search(r"\n\s+Memory Throughput\s+(\S+/s)\s+([\d.,]+)", block)
        dram = None
        if rate and rate.group(1) in RATES:
            dram = float(rate.group(2).replace(",", "")) * RATES[rate.group(1)]
        occ = metric(block, "Achieved Occupancy")
        regs = metric(block, "Registers Per Thread")
        k = kernels.setdefault(name, {"us": [], "gbs": [], "occ": [], "regs": None})
        k["us"].append(dur[1] * UNITS[dur[0]])
        if dram is not None:
            k["gbs"].append(dram)
        if occ:
            k["occ"].append(occ[1])
        if regs:
            k["regs"] = regs[1]
    return kernels


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    kernels = rows(open(sys.argv[1], encoding="utf-8", errors="replace").read())
    if not kernels:
        sys.exit(f"{sys.argv[1]}: no kernel with a duration (did ncu run and read the counters?)")
    print("| kernel (grid x block) | launches | us alone | DRAM GB/s | achieved occupancy % | registers |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, k in kernels.items():
        regs = f"{k['regs']:.0f}" if k["regs"] is not None else "-"
        print(
            f"| `{name}` | {len(k['us'])} | {mean(k['us']):.2f} | {mean(k['gbs']):.1f} "
            f"| {mean(k['occ']):.1f} | {regs} |"
        )


if __name__ == "__main__":
    main()
