// Host mirrors of the activation-stationary kernels' geometry (qmv_slices,
// qmv_threads and qmv_rows_per_block in crates/moeflux/src/backend/cuda/linear.rs)
// for rows of `cols` codes of `bits` bits, shared by the CPU emulation's checks
// and the micro-benchmark.
#pragma once
#include <algorithm>

// Warps sharing a row of at least 512 bytes (1 below).
static int qmv_parts(int cols, int bits) {
    int rb = cols * bits / 8;
    if (rb < 512) return 1;
    int slices = (rb + 511) / 512;
    if (rb % 512) return std::min(slices, 8);
    int p = 1;
    while (p * 2 <= std::min(slices, 8)) p *= 2;
    return p;
}
static int qmv_threads(int cols, int bits) { return 32 * (8 / qmv_parts(cols, bits)) * qmv_parts(cols, bits); }
// Output rows per block (per set, for the streaming kernels) with `nc` chunks per warp.
static int qmv_rows_per_block(int cols, int bits, int nc) {
    int rb = cols * bits / 8;
    return rb >= 512 ? 8 / qmv_parts(cols, bits) * nc : 8 * nc * (512 / rb);
}
