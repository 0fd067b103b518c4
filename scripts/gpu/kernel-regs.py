#!/usr/bin/env python3
"""Registers per thread of the CUDA kernels, without a GPU.

Compiles crates/moeflux/src/backend/cuda/kernels/all.cuh (its parts inlined, as the engine
concatenates them) with NVRTC to a CUBIN for one architecture and reads each kernel's register
count (EIATTR_REGCOUNT in the CUBIN's .nv.info section). A kernel's occupancy follows from it:
65,536 registers an SM, so 256-thread blocks of R registers fit floor(65536 / (256 R)) to an SM
(shared memory permitting). Use it to see what a kernel change does to occupancy before a GPU
run.

    python3 -m pip install --target /tmp/nvrtc --no-deps nvidia-cuda-nvrtc==13.0.88
    LD_LIBRARY_PATH=/tmp/nvrtc/nvidia/cu13/lib python3 scripts/gpu/kernel-regs.py [--arch 90] [--kernel-dir DIR] [--cubin FILE] [PREFIX ...]

Prints `kernel registers` (and the stack frame, where a kernel spills) for every kernel whose name starts with one of the PREFIXes (all
without any). `--kernel-dir DIR` compiles the parts DIR holds in place of the built-in ones (a
kernel variant, as `MOEFLUX_CUDA_KERNEL_DIR` runs it); NVRTC's errors are printed.
"""
import argparse
import ctypes
import ctypes.util
import os
import re
import struct
import sys

KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../crates/moeflux/src/backend/cuda/kernels")
EIATTR_REGCOUNT = 0x2F
EIATTR_FRAME_SIZE = 0x11
EIFMT_SVAL = 0x04


def source(path, variant=None):
    """The file with its includes inlined; a part that the directory `variant` holds is read from
    there (MOEFLUX_CUDA_KERNEL_DIR's rule)."""
    text = open(path).read()

    def part(m):
        name = m.group(1)
        mine = variant and os.path.join(variant, name)
        return source(mine if mine and os.path.exists(mine) else os.path.join(os.path.dirname(path), name), variant)

    return re.sub(r'#include "([^"]+)"', part, text)


def cubin(src, arch):
    name = ctypes.util.find_library("nvrtc") or "libnvrtc.so.13"
    try:
        lib = ctypes.CDLL(name)
    except OSError as e:
        sys.exit(f"cannot load NVRTC ({name}): {e}; install nvidia-cuda-nvrtc and set LD_LIBRARY_PATH")
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"all.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture=sm_{arch}".encode(), b"-std=c++17"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    if rc:
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        sys.exit(f"NVRTC failed:\n{log.value.decode()}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    out = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, out)
    return out.raw


def register_counts(elf):
    """(kernel, registers, frame bytes) from a CUBIN (ELF64): .nv.info's REGCOUNT and FRAME_SIZE
    entries name the kernel's symbol. A frame is local memory: spilled registers, or arrays the
    compiler could not keep in registers."""
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]

    def cstr(at):
        return elf[at : elf.index(b"\0", at)].decode()

    names = [cstr(sections[shstrndx][4] + s[0]) for s in sections]
    symtab = sections[names.index(".symtab")]
    strtab_off = sections[symtab[6]][4]

    def symbol(i):
        return cstr(strtab_off + struct.unpack_from("<I", elf, symtab[4] + 24 * i)[0])

    info = sections[names.index(".nv.info")]
    at, end = info[4], info[4] + info[5]
    regs, frames = {}, {}
    while at < end:
        fmt, attr = elf[at], elf[at + 1]
        if fmt == EIFMT_SVAL:
            size = struct.unpack_from("<H", elf, at + 2)[0]
            if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE):
                sym, value = struct.unpack_from("<II", elf, at + 4)
                (regs if attr == EIATTR_REGCOUNT else frames)[symbol(sym)] = value
            at += 4 + size
        else:
            at += 4  # EIFMT_NVAL, _BVAL, _HVAL: four bytes
    return [(name, n, frames.get(name, 0)) for name, n in regs.items()]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="90", help="compute capability without the dot (default 90)")
    p.add_argument("--kernel-dir", help="kernel parts read from this directory in place of the built-in ones")
    p.add_argument("--cubin", help="also write the CUBIN here (for cuobjdump -sass)")
    p.add_argument("prefixes", nargs="*", help="kernel name prefixes to list (default: all)")
    a = p.parse_args()
    elf = cubin(source(os.path.join(KERNELS, "all.cuh"), a.kernel_dir), a.arch)
    if a.cubin:
        with open(a.cubin, "wb") as f:
            f.write(elf)
    counts = sorted(register_counts(elf))
    for name, regs, frame in counts:
        if not a.prefixes or any(name.startswith(x) for x in a.prefixes):
            print(f"{name} {regs}" + (f" (frame {frame} bytes: local memory)" if frame else ""))


if __name__ == "__main__":
    main()
