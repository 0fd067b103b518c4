// moeflux CUDA kernels, compiled at run time by NVRTC for the device found.
//
// Conventions: activations are f32, row-major [tokens, width]. Quantized
// weights are MLX affine: per row, `cols * bits / 32` u32 words holding the
// codes LSB-first, and per group of `gs` columns a scale and a bias (bf16 or
// f32), w = q * scale + bias. Every kernel accumulates in f32.

typedef unsigned int u32;
typedef unsigned short u16;

#define WARP 32
#define NEG_INF __int_as_float(0xff800000u)

// Programmatic dependent launch (Hopper+): a kernel may be launched while
// the previous one finishes; it waits for it (and its writes) before doing
// anything, and lets the next one launch at once. Without the launch
// attribute (or before sm_90) both are no-ops.
// The one-token dense products split the two: they load their weights
// (never written once the model is loaded) before waiting, so the fetch
// overlaps the previous kernel's tail.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" :::)
#else
#define PDL_WAIT() \
    do {           \
    } while (0)
#define PDL_TRIGGER() \
    do {              \
    } while (0)
#endif
#define PDL_ENTER()     \
    do {                \
        PDL_WAIT();     \
        PDL_TRIGGER();  \
    } while (0)

__device__ __forceinline__ float bf16f(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x * sigmoidf_(x); }

// Sum over a block (blockDim.x a multiple of 32, at most 1024); every thread
// gets the result.
__device__ float block_sum(float v) {
    __shared__ float part[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) part[w] = v;
    __syncthreads();
    int nw = blockDim.x >> 5;
    float t = lane < nw ? part[lane] : 0.0f;
    return warp_sum(t);
}

// --------------------------------------------------------------------------
// Quantized weights

struct QW {
    const u32* w;       // packed codes, rows * words_per_row
    const void* s;      // scales, rows * groups (bf16 or f32)
    const void* b;      // biases, like scales
    int rows, cols, bits, gs, sf32;
};

__device__ __forceinline__ float qparam(const void* p, long i, int f32) {
    return f32 ? ((const float*)p)[i] : bf16f(((const u16*)p)[i]);
}

// Code of element j of a row (any bit width: a code may straddle words).
__device__ __forceinline__ u32 qcode(const u32* row, long j, int bits) {
    long bit = j * bits;
    long wi = bit >> 5;
    int sh = (int)(bit & 31);
    unsigned long long v = row[wi];
    if (sh + bits > 32) v |= ((unsigned long long)row[wi + 1]) << 32;
    return (u32)(v >> sh) & ((1u << bits) - 1u);
}

// (a & mask) | 2^23 as one LOP3: left to itself the compiler folds both
// constants into immediates, which takes two LOP3s (one immediate each).
__device__ __forceinline__ float mask_into_2p23(u32 a, u32 mask) {
#ifdef __CUDA_ARCH__
    u32 d, magic = 0x4B000000u;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(magic));
    return __uint_as_float(d);
#else
    return __uint_as_float((a & mask) | 0x4B000000u);
#endif
}

// Code e of a packed word as a float, without an int->float conversion:
// 2^23 + code has the code in its mantissa.
template <int BITS>
__device__ __forceinline__ float qcodef(u32 word, int e) {
    return mask_into_2p23(word >> (e * BITS), (1u << BITS) - 1u) - 8388608.0f;
}

// Code e of a packed word as an exact float times 2^(BITS*j), j = e % P,
// in two instructions (no shift for most codes): the code is masked in
// place into the mantissa of 2^23, which holds P codes below bit 23. The
// activation it meets is pre-scaled by 2^-(BITS*j) (code_prescale): exact
// unless it falls below the normal range (|x| < 2^-110 for 4-bit codes).
template <int BITS>
__device__ __forceinline__ float qcode_scaled(u32 word, int e) {
    constexpr int P = 23 / BITS;
    return mask_into_2p23(word >> ((e / P) * P * BITS), ((1u << BITS) - 1u) << ((e % P) * BITS)) - 8388608.0f;
}
template <int BITS>
__device__ __forceinline__ float code_prescale(int e) {
    return __uint_as_float((u32)(127 - (e % (23 / BITS)) * BITS) << 23);
}

// A lane's 16-byte chunk of codes dotted with its activations, pre-scaled
// by code_prescale (xv[k * 32 / BITS + e] meets code e of word k).
template <int BITS>
__device__ __forceinline__ float chunk_dot(const uint4& wv, const float* xv) {
    constexpr int EPW = 32 / BITS;
    float d = 0.0f;
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        u32 word = kk == 0 ? wv.x : kk == 1 ? wv.y : kk == 2 ? wv.z : wv.w;
#pragma unroll
        for (int e = 0; e < EPW; e++) d = fmaf(qcode_scaled<BITS>(word, e), xv[kk * EPW + e], d);
    }
    return d;
}

// N activations from p (16-byte aligned) into xv; returns their sum.
// Activations are plain loads, never __ldg: they come from the previous
// kernel, and a non-coherent load counts as invariant, which lets the
// compiler hoist it above the PDL wait (stale values).
template <int N>
__device__ __forceinline__ float load_acts(const float* p, float* xv) {
    float xs = 0.0f;
#pragma unroll
    for (int e4 = 0; e4 < N / 4; e4++) {
        float4 f = ((const float4*)p)[e4];
        xv[4 * e4] = f.x;
        xv[4 * e4 + 1] = f.y;
        xv[4 * e4 + 2] = f.z;
        xv[4 * e4 + 3] = f.w;
        xs += (f.x + f.y) + (f.z + f.w);
    }
    return xs;
}

// N gated activations silu(g) * u from g and u (16-byte aligned) into xv;
// returns their sum (the SwiGLU of an MLP applied as its down product loads
// its input).
template <int N>
__device__ __forceinline__ float load_glu(const float* g, const float* u, float* xv) {
    float xs = 0.0f;
#pragma unroll
    for (int e4 = 0; e4 < N / 4; e4++) {
        float4 a = ((const float4*)g)[e4], b = ((const float4*)u)[e4];
        xv[4 * e4] = siluf_(a.x) * b.x;
        xv[4 * e4 + 1] = siluf_(a.y) * b.y;
        xv[4 * e4 + 2] = siluf_(a.z) * b.z;
        xv[4 * e4 + 3] = siluf_(a.w) * b.w;
        xs += (xv[4 * e4] + xv[4 * e4 + 1]) + (xv[4 * e4 + 2] + xv[4 * e4 + 3]);
    }
    return xs;
}

// A warp's share of a quantized product: acc[rr][t] = W[r0 + rr] . x_t for
// the warp's RW rows and up to TT tokens (x_t = xp[t], t < nt), summed over
// the warp (every lane holds the sums). Lane l takes words l, l+32, ... of
// each row, so a warp reads 128 contiguous bytes of a row per step, and
// the activations it loads (float4s, reused by all RW rows) serve every
// row. Per word: sum_e (q_e s + b) x_e = s (q . x) + b sum(x).
#define RW 4

// --------------------------------------------------------------------------
// MXFP4 (gpt-oss's experts): per row, cols / 8 u32 words of 4-bit e2m1 codes
// (LSB first; bit 3 the sign, bits 0-2 index 0, .5, 1, 1.5, 2, 3, 4, 6) and a
// scale byte s per group of 32 columns worth 2^(s - 127). As on the CPU
// (qmatmul/mxfp4.rs) a code enters as twice its value, an exact small
// integer, and the 1/2 is folded into the power-of-two scale. A group is 16
// bytes of codes: one uint4 per lane and group.
#define MXB (-1)  // the BITS of the MXFP4 instantiations
#define MXI (-2)  // MXFP4 dotted in integers (mx_int_dot): the streaming expert kernels
__host__ __device__ constexpr bool is_mx(int bits) { return bits == MXB || bits == MXI; }

// Twice the code's value plus 12 (0..24) by code, as bytes for
// __byte_perm: codes 0-3, 4-7 (positive), 8-11, 12-15 (negative).
#define MX_T0 0x0F0E0D0Cu  // 12 13 14 15  (0 1 2 3)
#define MX_T1 0x18141210u  // 16 18 20 24  (4 6 8 12)
#define MX_T2 0x090A0B0Cu  // 12 11 10 9   (-0 -1 -2 -3)
#define MX_T3 0x00040608u  // 8 6 4 0      (-4 -6 -8 -12)

// The eight codes of a word as biased bytes: codes 0-3 in r0, 4-7 in r1 (byte
// j of each: code j). Two lookups of the magnitude (three selector bits, the
// sign masked off), then the sign picks between them.
__device__ __forceinline__ void mx_bytes(u32 w, u32& r0, u32& r1) {
    u32 idx = w & 0x77777777u;
    u32 sel = ((w >> 1) & 0x44444444u) | 0x32103210u;  // byte j of lo, or of hi when negative
    u32 lo = __byte_perm(MX_T0, MX_T1, idx), hi = __byte_perm(MX_T2, MX_T3, idx);
    r0 = __byte_perm(lo, hi, sel);
    lo = __byte_perm(MX_T0, MX_T1, idx >> 16);
    hi = __byte_perm(MX_T2, MX_T3, idx >> 16);
    r1 = __byte_perm(lo, hi, sel >> 16);
}

// Byte j of r (a biased code) as twice the code's value: 2^23 + b, less
// 2^23 + 12, exact.
__device__ __forceinline__ float mx_code(u32 r, int j) {
    return mask_into_2p23(r >> (8 * j), 0x1Fu) - 8388620.0f;
}

// Half the e8m0 scale s, exactly: 2^(s - 128) (2^-128 and 2^-127 are
// subnormal), NaN for 255 (the CPU's half_scale_f32).
__device__ __forceinline__ float mx_half_scale(u32 s) {
    if (s >= 2u) return s == 255u ? __int_as_float(0x7fc00000) : __uint_as_float((s - 1u) << 23);
    return __uint_as_float(0x200000u << s);
}

// The 32 codes of a 16-byte chunk (one group), twice their values, dotted
// with x[0..32).
__device__ __forceinline__ float mx_chunk_dot(const uint4& wv, const float* xv) {
    float d = 0.0f;
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        u32 word = kk == 0 ? wv.x : kk == 1 ? wv.y : kk == 2 ? wv.z : wv.w;
        u32 r0, r1;
        mx_bytes(word, r0, r1);
#pragma unroll
        for (int e = 0; e < 4; e++) d = fmaf(mx_code(r0, e), xv[8 * kk + e], d);
#pragma unroll
        for (int e = 0; e < 4; e++) d = fmaf(mx_code(r1, e), xv[8 * kk + 4 + e], d);
    }
    return d;
}

// qrows for an MXFP4 matrix (q.s: the scale bytes; q.b unused): lane l of
// warp part `part` takes groups part * 32 + l, + parts * 32, ... of each of
// the RW rows (16-byte loads, a warp reading 512 contiguous bytes of a row),
// its activations 32 floats per group (16-byte aligned rows: cols is a
// multiple of 32). Several tokens: each row's codes are decoded once into
// registers and meet every token.
template <int TT>
__device__ __forceinline__ void mx_rows(const QW& q, int r0, const float* const* xp, int nt,
                                        float (&acc)[RW][TT], int part, int parts) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int rr = 0; rr < RW; rr++)
#pragma unroll
        for (int t = 0; t < TT; t++) acc[rr][t] = 0.0f;
    int G = q.cols >> 5;  // groups (16-byte chunks) per row
    int nr = min(RW, q.rows - r0);
    const unsigned char* sc = (const unsigned char*)q.s;
    for (int v = part * WARP + lane; v < G; v += parts * WARP) {
        uint4 wv[RW];
        float hs[RW];
#pragma unroll
        for (int rr = 0; rr < RW; rr++)
            wv[rr] = rr < nr ? __ldg((const uint4*)(q.w + (long)(r0 + rr) * G * 4) + v) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int rr = 0; rr < RW; rr++) hs[rr] = rr < nr ? mx_half_scale(__ldg(sc + (long)(r0 + rr) * G + v)) : 0.0f;
        if constexpr (TT == 1) {
            float xv[32];
            load_acts<32>(xp[0] + 32 * v, xv);
#pragma unroll
            for (int rr = 0; rr < RW; rr++) acc[rr][0] = fmaf(hs[rr], mx_chunk_dot(wv[rr], xv), acc[rr][0]);
        } else {
#pragma unroll
            for (int rr = 0; rr < RW; rr++) {
                if (rr >= nr) break;
                float cf[32];
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    u32 word = kk == 0 ? wv[rr].x : kk == 1 ? wv[rr].y : kk == 2 ? wv[rr].z : wv[rr].w;
                    u32 b0, b1;
                    mx_bytes(word, b0, b1);
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        cf[8 * kk + e] = mx_code(b0, e);
                        cf[8 * kk + 4 + e] = mx_code(b1, e);
                    }
                }
#pragma unroll
                for (int t = 0; t < TT; t++) {
                    if (t >= nt) break;
                    const float4* xt = (const float4*)(xp[t] + 32 * v);
                    float d = 0.0f;
#pragma unroll
                    for (int e4 = 0; e4 < 8; e4++) {
                        float4 f = xt[e4];
                        d = fmaf(cf[4 * e4], f.x, d);
                        d = fmaf(cf[4 * e4 + 1], f.y, d);
                        d = fmaf(cf[4 * e4 + 2], f.z, d);
                        d = fmaf(cf[4 * e4 + 3], f.w, d);
                    }
                    acc[rr][t] = fmaf(hs[rr], d, acc[rr][t]);
                }
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < RW; rr++)
#pragma unroll
        for (int t = 0; t < TT; t++) acc[rr][t] = warp_sum(acc[rr][t]);
}

template <int BITS, int TT>
__device__ __forceinline__ void qrows(const QW& q, int r0, const float* const* xp, int nt,
                                      float (&acc)[RW][TT], int part, int parts) {
    if constexpr (BITS == MXB) {
        mx_rows<TT>(q, r0, xp, nt, acc, part, parts);
        return;
    }
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int rr = 0; rr < RW; rr++)
#pragma unroll
        for (int t = 0; t < TT; t++) acc[rr][t] = 0.0f;
    long wpr = ((long)q.cols * q.bits) >> 5;
    int gpr = q.cols / q.gs;
    int nr = min(RW, q.rows - r0);
    bool aligned = true;
#pragma unroll
    for (int t = 0; t < TT; t++)
        if (t < nt) aligned &= ((((unsigned long long)xp[t]) & 15) == 0);
    if constexpr (BITS == 2 || BITS == 4 || BITS == 8) {
        if (aligned) {
            const int EPW = 32 / BITS;
            // Words per group: a power of two in every MLX layout (shift),
            // else a division.
            int wpg = q.gs / EPW;
            int lw = __ffs(wpg) - 1;
            bool pow2 = (wpg & (wpg - 1)) == 0;
            int iwpr = (int)wpr;
            // One token: each lane reads 16 bytes (4 words) of each row per
            // step, so a warp keeps 2 KB of weights in flight.
            bool v16 = TT == 1 && (wpr & 3) == 0 && ((((unsigned long long)q.w) & 15) == 0);
            if (v16) {
                int n4 = iwpr >> 2;
                for (int v = part * WARP + lane; v < n4; v += parts * WARP) {
                    uint4 wv[RW];
#pragma unroll
                    for (int rr = 0; rr < RW; rr++)
                        wv[rr] = rr < nr ? ((const uint4*)(q.w + (long)(r0 + rr) * wpr))[v] : make_uint4(0, 0, 0, 0);
#pragma unroll
                    for (int kk = 0; kk < 4; kk++) {
                        int wi = v * 4 + kk;
                        int c0 = wi * EPW;
                        int g = pow2 ? (wi >> lw) : wi / wpg;
                        float xv[EPW];
                        float xs = load_acts<EPW>(xp[0] + c0, xv);
#pragma unroll
                        for (int rr = 0; rr < RW; rr++) {
                            if (rr < nr) {
                                u32 word = kk == 0 ? wv[rr].x : kk == 1 ? wv[rr].y : kk == 2 ? wv[rr].z : wv[rr].w;
                                long pi = (long)(r0 + rr) * gpr + g;
                                float sc = qparam(q.s, pi, q.sf32), bi = qparam(q.b, pi, q.sf32);
                                float d = 0.0f;
#pragma unroll
                                for (int e = 0; e < EPW; e++)
                                    d = fmaf(qcodef<BITS>(word, e), xv[e], d);
                                acc[rr][0] = fmaf(sc, d, fmaf(bi, xs, acc[rr][0]));
                            }
                        }
                    }
                }
                goto reduce;
            }
            for (int wi = part * WARP + lane; wi < iwpr; wi += parts * WARP) {
                int c0 = wi * EPW;
                int g = pow2 ? (wi >> lw) : wi / wpg;
                float xv[TT][EPW], xs[TT];
#pragma unroll
                for (int t = 0; t < TT; t++) {
                    xs[t] = 0.0f;
#pragma unroll
                    for (int e4 = 0; e4 < EPW / 4; e4++) {
                        float4 v = t < nt ? ((const float4*)(xp[t] + c0))[e4] : make_float4(0, 0, 0, 0);
                        xv[t][4 * e4] = v.x;
                        xv[t][4 * e4 + 1] = v.y;
                        xv[t][4 * e4 + 2] = v.z;
                        xv[t][4 * e4 + 3] = v.w;
                        xs[t] += (v.x + v.y) + (v.z + v.w);
                    }
                }
#pragma unroll
                for (int rr = 0; rr < RW; rr++) {
                    if (rr < nr) {
                        long r = r0 + rr;
                        u32 word = q.w[r * wpr + wi];
                        long pi = r * gpr + g;
                        float s = qparam(q.s, pi, q.sf32), b = qparam(q.b, pi, q.sf32);
                        float cf[EPW];
#pragma unroll
                        for (int e = 0; e < EPW; e++) cf[e] = qcodef<BITS>(word, e);
#pragma unroll
                        for (int t = 0; t < TT; t++) {
                            if (t < nt) {
                                float d = 0.0f;
#pragma unroll
                                for (int e = 0; e < EPW; e++) d = fmaf(cf[e], xv[t][e], d);
                                acc[rr][t] = fmaf(s, d, fmaf(b, xs[t], acc[rr][t]));
                            }
                        }
                    }
                }
            }
            goto reduce;
        }
    }
    // Any width (codes may straddle words) or unaligned activations.
    for (long j = part * WARP + lane; j < q.cols; j += parts * WARP) {
        int g = (int)(j / q.gs);
        float xj[TT];
#pragma unroll
        for (int t = 0; t < TT; t++) xj[t] = t < nt ? xp[t][j] : 0.0f;
#pragma unroll
        for (int rr = 0; rr < RW; rr++) {
            if (rr < nr) {
                long r = r0 + rr;
                float w = fmaf((float)qcode(q.w + r * wpr, j, q.bits), qparam(q.s, r * gpr + g, q.sf32),
                               qparam(q.b, r * gpr + g, q.sf32));
#pragma unroll
                for (int t = 0; t < TT; t++) acc[rr][t] = fmaf(w, xj[t], acc[rr][t]);
            }
        }
    }
reduce:
#pragma unroll
    for (int rr = 0; rr < RW; rr++)
#pragma unroll
        for (int t = 0; t < TT; t++) acc[rr][t] = warp_sum(acc[rr][t]);
}

// qrows for any supported width (chosen at run time).
template <int TT>
__device__ __forceinline__ void qrows_any(const QW& q, int r0, const float* const* xp, int nt,
                                          float (&acc)[RW][TT], int part, int parts) {
    switch (q.bits) {
        case 4: qrows<4, TT>(q, r0, xp, nt, acc, part, parts); break;
        case 8: qrows<8, TT>(q, r0, xp, nt, acc, part, parts); break;
        case 2: qrows<2, TT>(q, r0, xp, nt, acc, part, parts); break;
        default: qrows<0, TT>(q, r0, xp, nt, acc, part, parts); break;
    }
}

// Warps that share a group of RW rows, each taking every parts-th stretch
// of the row: enough that a row gives every lane work (short rows leave
// more groups per block). The host computes the same (rows per block =
// RW * 8 / col_split).
// One token only: products of several tokens (prefill) keep whole rows per
// warp, which already has work enough.
__device__ __forceinline__ int col_split(const QW& q, int tt) {
    long u4 = ((long)q.cols * q.bits) >> 7;  // 16-byte units per row
    if (tt > 1) return 1;
    return u4 >= 256 ? 8 : u4 >= 128 ? 4 : u4 >= 64 ? 2 : 1;
}

// Sums the partial results of the `parts` consecutive warps of each row
// group; the first warp of a group ends up with the totals. Every thread of
// the block must call it (it synchronises).
template <int TT>
__device__ __forceinline__ void reduce_parts(float (&acc)[RW][TT], int parts) {
    __shared__ float red[8][RW][TT];
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (parts > 1) {
        if (lane == 0)
#pragma unroll
            for (int rr = 0; rr < RW; rr++)
#pragma unroll
                for (int t = 0; t < TT; t++) red[w][rr][t] = acc[rr][t];
        __syncthreads();
        if (w % parts == 0)
#pragma unroll
            for (int rr = 0; rr < RW; rr++)
#pragma unroll
                for (int t = 0; t < TT; t++) {
                    float v = 0.0f;
                    for (int c = 0; c < parts; c++) v += red[w + c][rr][t];
                    acc[rr][t] = v;
                }
        __syncthreads();
    }
}

// Writes a warp's results: lane rr*TT + t stores acc[rr][t] (all lanes hold
// every sum), to out[t_index(t) * rows + r0 + rr], adding when `add`.
template <int TT>
__device__ __forceinline__ void store_rows(const float (&acc)[RW][TT], int r0, int rows, int nt,
                                           float* out, long out_stride, const int* tok, bool add) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int rr = 0; rr < RW; rr++)
#pragma unroll
        for (int t = 0; t < TT; t++)
            if (lane == rr * TT + t && t < nt && r0 + rr < rows) {
                long oi = (long)(tok ? tok[t] : t) * out_stride + r0 + rr;
                out[oi] = add ? out[oi] + acc[rr][t] : acc[rr][t];
            }
}

// Up to four quantized matrices applied to the same input in one launch
// (q/k/v, the GatedDeltaNet projections, router + shared expert):
// out_m[t*rows_m + r] (+)= W_m[r] . x[t] for t < n. A block of 8 warps
// covers 32 rows of the concatenated row space, tokens four at a time.
// Bit `m` of `accumulate` adds to out_m instead of overwriting it
// (residual connections).
struct MultiMatmul {
    QW q[4];
    float* out[4];
    // A bias per output row added after the product, or null; only the
    // one-token qmv kernels take one (the host adds it after the others).
    const float* bias[4];
    int first_block[5];  // blocks of matrix m: first_block[m] .. first_block[m+1]
    int count;
    int accumulate;
};


template <int TT>
__device__ void qmatmul_body(const MultiMatmul& mm, const float* x, int n) {
    int m = 0;
    while (m + 1 < mm.count && (int)blockIdx.x >= mm.first_block[m + 1]) m++;
    const QW& q = mm.q[m];
    int parts = col_split(q, TT), w = threadIdx.x >> 5;
    int part = w % parts;
    int r0 = ((blockIdx.x - mm.first_block[m]) * (8 / parts) + w / parts) * RW;
    bool active = r0 < q.rows;
    bool add = (mm.accumulate >> m) & 1;
    for (int t0 = blockIdx.y * TT; t0 < n; t0 += gridDim.y * TT) {
        int nt = min(TT, n - t0);
        const float* xp[TT];
#pragma unroll
        for (int t = 0; t < TT; t++) xp[t] = x + (long)(t0 + min(t, nt - 1)) * q.cols;
        float acc[RW][TT];
        if (active) qrows_any<TT>(q, r0, xp, nt, acc, part, parts);
        reduce_parts<TT>(acc, parts);
        if (active && part == 0)
            store_rows<TT>(acc, r0, q.rows, nt, mm.out[m] + (long)t0 * q.rows, q.rows, nullptr, add);
    }
}

// Tokens four at a time (each weight word decoded once for four tokens).
extern "C" __global__ void __launch_bounds__(256) qmatmul(MultiMatmul mm, const float* x, int n) { PDL_ENTER(); qmatmul_body<4>(mm, x, n); }
// One token (decode).
extern "C" __global__ void __launch_bounds__(256, 4) qmatmul1(MultiMatmul mm, const float* x, int n) { PDL_ENTER(); qmatmul_body<1>(mm, x, n); }

// --------------------------------------------------------------------------
// One-token products with the activations held in registers.
//
// A warp reads a matrix in slices of up to 512 bytes, lane l taking bytes
// 16l..16l+15 of each, always at the same columns: rows of at least 512
// bytes are cut into `slices` slices of `sb` bytes (512, or as evenly as
// 16-byte units allow when 512 does not divide the row: the lanes past a
// slice's end idle), the slices of a row going to `parts` warps of a block
// (summed in shared memory); shorter rows (a power of two of bytes) fill a
// chunk with 512/rb rows. So a lane loads its activations once and reuses
// them for every row it meets, and it issues the loads of NC chunks before
// using any (NC * 16 bytes in flight per lane). A chunk lies inside one
// quantization group (gs * bits >= 128, checked by the host; an MXFP4 chunk
// is one group), so it needs one scale and one bias.
struct QmvGeom {
    int rb;      // bytes per row
    int slices;  // slices per row (1 for short rows)
    int sb;      // bytes per slice (512 for short rows)
    int rpc;     // rows per chunk (1 for long rows)
    int lpr;     // lanes per row in a chunk
    int parts;   // warps sharing a row group (<= min(8, slices); a power of two when 512 divides rb)
    int wpb;     // row groups per block of 8 warps: warps from wpb * parts on idle
};

// Bits of a code: the BITS of an instantiation, 4 for MXFP4.
__host__ __device__ constexpr int code_bits(int bits) { return is_mx(bits) ? 4 : bits; }

__device__ __forceinline__ QmvGeom qmv_geom(int cols, int bits) {
    QmvGeom g;
    g.rb = cols * code_bits(bits) / 8;
    if (g.rb >= 512) {
        g.slices = (g.rb + 511) / 512;
        g.rpc = 1;
        g.lpr = 32;
        if (g.rb % 512 == 0) {
            g.sb = 512;
            g.parts = g.slices >= 8 ? 8 : g.slices >= 4 ? 4 : g.slices >= 2 ? 2 : 1;
        } else {
            g.sb = 16 * ((g.rb / 16 + g.slices - 1) / g.slices);
            g.parts = min(g.slices, 8);
        }
    } else {
        g.slices = 1;
        g.sb = 512;
        g.rpc = 512 / g.rb;
        g.lpr = g.rb / 16;
        g.parts = 1;
    }
    g.wpb = 8 / g.parts;
    return g;
}

// Byte offset in its row of the chunk lane `lane` takes in slice s, or -1
// when the lane has none (past the slice's or the row's end).
__device__ __forceinline__ int qmv_chunk_byte(const QmvGeom& G, int s, int lane) {
    if (G.rb < 512) return (16 * lane) % G.rb;
    int cb = s * G.sb + 16 * lane;
    return 16 * lane < G.sb && cb < G.rb ? cb : -1;
}

// A chunk's scale and bias (MXFP4: half the e8m0 scale, no bias).
template <int BITS>
__device__ __forceinline__ void chunk_params(const QW& q, long pi, float& s, float& b) {
    if constexpr (is_mx(BITS)) {
        s = mx_half_scale(__ldg((const unsigned char*)q.s + pi));
        b = 0.0f;
    } else {
        s = qparam(q.s, pi, q.sf32);
        b = qparam(q.b, pi, q.sf32);
    }
}

// MXFP4 in integers. A lane's 32 activations (one group's columns, the same
// for every row it meets) become 23-bit fixed point relative to their
// largest power of two, X = rint(x 2^(23 - e)) with |x| < 2^e (clamped to
// 24-bit two's complement), held as three byte digits X = d0 + 2^8 d1 +
// 2^16 d2 (d2 signed), four columns to a register (mx_bytes' order), in
// place of the floats: digit k of columns 4q.. in xv[8k + q], sum(X) in
// xv[24], 2^(e - 23) in xv[25]. A group's codes (mx_bytes: 2v + 12 as
// bytes) then meet them in 24 dp4a; the integer sum less 12 sum(X) is
// exact in 64 bits and rounds once to float. Against the float dot the
// only error is each activation's rounding to 23 bits of the group's
// largest (2^-24 of it, as an f32 rounding of that largest), and no
// rounding along the sum; groups whose largest is below 2^-100 count as 0.
// A NaN or infinite activation makes the dot NaN, as a float dot would.
__device__ __forceinline__ void mx_int_prep(float* xv) {
    float m = 0.0f, bad = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; i++) {
        m = fmaxf(m, fabsf(xv[i]));
        bad += xv[i] * 0.0f;  // NaN for a NaN or an infinity
    }
    int e = 0;
    frexpf(m, &e);  // m < 2^e (0 for m = 0: every X is 0)
    e = max(e, -100);
    float up = ldexpf(1.0f, 23 - e);
    u32 d[3][8];
    int sumx = 0;
#pragma unroll
    for (int q = 0; q < 8; q++) {
        d[0][q] = d[1][q] = d[2][q] = 0u;
#pragma unroll
        for (int b = 0; b < 4; b++) {
            int X = max(min(__float2int_rn(xv[4 * q + b] * up), 0x7FFFFF), -0x800000);
            sumx += X;
            d[0][q] |= (u32)(X & 0xFF) << (8 * b);
            d[1][q] |= (u32)((X >> 8) & 0xFF) << (8 * b);
            d[2][q] |= (u32)((X >> 16) & 0xFF) << (8 * b);
        }
    }
#pragma unroll
    for (int k = 0; k < 3; k++)
#pragma unroll
        for (int q = 0; q < 8; q++) xv[8 * k + q] = __uint_as_float(d[k][q]);
    xv[24] = __int_as_float(sumx);
    xv[25] = ldexpf(1.0f, e - 23) + bad;
}

// c plus the dot of a's unsigned bytes with b's (unsigned / signed) bytes.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ u32 dp4a_uu(u32 a, u32 b, u32 c) {
    u32 d;
    asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ int dp4a_us(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
#else  // the CPU emulation (scripts/gpu/emu)
__device__ __forceinline__ u32 dp4a_uu(u32 a, u32 b, u32 c) {
    for (int i = 0; i < 32; i += 8) c += ((a >> i) & 0xFFu) * ((b >> i) & 0xFFu);
    return c;
}
__device__ __forceinline__ int dp4a_us(u32 a, u32 b, int c) {
    for (int i = 0; i < 32; i += 8) c += (int)((a >> i) & 0xFFu) * (int)(signed char)((b >> i) & 0xFFu);
    return c;
}
#endif

// A group's codes (twice their values) dotted with mx_int_prep's digits.
__device__ __forceinline__ float mx_int_dot(const uint4& wv, const float* xv) {
    u32 s0 = 0u, s1 = 0u;
    int s2 = 0;
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        u32 word = kk == 0 ? wv.x : kk == 1 ? wv.y : kk == 2 ? wv.z : wv.w;
        u32 r[2];
        mx_bytes(word, r[0], r[1]);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int q = 2 * kk + h;
            s0 = dp4a_uu(r[h], __float_as_uint(xv[q]), s0);
            s1 = dp4a_uu(r[h], __float_as_uint(xv[8 + q]), s1);
            s2 = dp4a_us(r[h], __float_as_uint(xv[16 + q]), s2);
        }
    }
    long long t = (long long)s2 * 65536 + (long long)s1 * 256 + (long long)s0 -
                  12LL * __float_as_int(xv[24]);
    return (float)t * xv[25];
}

// A chunk's codes dotted with the lane's activations (as chunk_dot; MXFP4
// codes as twice their values, plain activations or mx_int_prep's digits).
template <int BITS>
__device__ __forceinline__ float chunk_dot_any(const uint4& wv, const float* xv) {
    if constexpr (BITS == MXB) return mx_chunk_dot(wv, xv);
    else if constexpr (BITS == MXI) return mx_int_dot(wv, xv);
    else return chunk_dot<BITS>(wv, xv);
}

// A lane's activations for the chunk at column c0 (zeros when it has none:
// on < 0), pre-scaled for chunk_dot; returns their sum.
template <int BITS, bool GLU>
__device__ __forceinline__ float qmv_load_acts(const float* x, int cols, int c0, bool on, float* xv) {
    constexpr int EPL = 128 / code_bits(BITS);
    float xs = 0.0f;
    if (on) {
        xs = GLU ? load_glu<EPL>(x + c0, x + cols + c0, xv) : load_acts<EPL>(x + c0, xv);
    } else {
#pragma unroll
        for (int e = 0; e < EPL; e++) xv[e] = 0.0f;
    }
    if constexpr (BITS == MXI) {
        mx_int_prep(xv);
    } else if constexpr (BITS != MXB) {
        constexpr int EPW = 32 / BITS;
#pragma unroll
        for (int e = 0; e < EPL; e++) xv[e] *= code_prescale<BITS>(e % EPW);
    }
    return xs;
}

// A warp's chunks: chunk i < na is row group `rg` of matrix a, chunk i >= na
// the same rows of matrix b (gate and up of an expert); acc[i] ends up
// reduced over the lanes of its row (every lane of those lanes holds it)
// and over the warps of the row group (warp `part` 0 of the group holds it).
// Warps past G.wpb * G.parts (idle) load nothing but join the barrier.
// LATE_WAIT: the caller has not waited for the previous kernel yet (see
// PDL_WAIT): wait once the first slice's weights are requested. GLU: x
// holds [g | u] (a.cols each) and the input is silu(g) * u.
template <int BITS, int NC, bool LATE_WAIT = false, bool GLU = false>
__device__ __forceinline__ void qmv_chunks(const QW& a, const QW& b, int na, const QmvGeom& G, int rg, int part,
                                           const float* x, float (&acc)[NC]) {
    bool waited = !LATE_WAIT;
    constexpr int EPL = 128 / code_bits(BITS);
    int lane = threadIdx.x & 31;
    bool idle = (int)(threadIdx.x >> 5) >= G.wpb * G.parts;
    long wpr = G.rb >> 2;
    int gpr = a.cols / a.gs;
    int rsub = G.rb >= 512 ? 0 : (16 * lane) / G.rb;
#pragma unroll
    for (int i = 0; i < NC; i++) acc[i] = 0.0f;
    for (int s = part; s < G.slices && !idle; s += G.parts) {
        int cb = qmv_chunk_byte(G, s, lane);
        bool on = cb >= 0;
        int c0 = max(cb, 0) * 8 / code_bits(BITS);
        int g = c0 / a.gs;
        uint4 wv[NC];
        float sc[NC], bi[NC];
#pragma unroll
        for (int i = 0; i < NC; i++) {
            const QW& q = i < na ? a : b;
            int r = (rg * (i < na ? na : NC - na) + (i < na ? i : i - na)) * G.rpc + rsub;
            wv[i] = on && r < q.rows ? __ldg((const uint4*)(q.w + (long)r * wpr) + (cb >> 4)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < NC; i++) {
            const QW& q = i < na ? a : b;
            int r = (rg * (i < na ? na : NC - na) + (i < na ? i : i - na)) * G.rpc + rsub;
            chunk_params<BITS>(q, (long)min(r, q.rows - 1) * gpr + g, sc[i], bi[i]);
        }
        if (!waited) {
            PDL_WAIT();
            waited = true;
        }
        float xv[EPL];
        float xs = qmv_load_acts<BITS, GLU>(x, a.cols, c0, on, xv);
#pragma unroll
        for (int i = 0; i < NC; i++)
            acc[i] = fmaf(sc[i], chunk_dot_any<BITS>(wv[i], xv), is_mx(BITS) ? acc[i] : fmaf(bi[i], xs, acc[i]));
    }
    if (!waited) PDL_WAIT();
    // Over the lanes of a row: all 32 for long rows, lpr for short ones.
#pragma unroll
    for (int i = 0; i < NC; i++)
        for (int o = G.lpr >> 1; o > 0; o >>= 1) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], o);
    if (G.parts > 1) {
        __shared__ float red[8][NC];
        int w = threadIdx.x >> 5;
        if (lane == 0 && !idle)
#pragma unroll
            for (int i = 0; i < NC; i++) red[w][i] = acc[i];
        __syncthreads();
        if (part == 0 && !idle)
#pragma unroll
            for (int i = 0; i < NC; i++) {
                float v = 0.0f;
                for (int c = 0; c < G.parts; c++) v += red[w + c][i];
                acc[i] = v;
            }
    }
}

// Whether this lane stores its row's sums after qmv_chunks: lane 0 of its
// row in warp part 0 of a row group that is not idle.
__device__ __forceinline__ bool qmv_holds_sums(const QmvGeom& G) {
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    return w < G.wpb * G.parts && w % G.parts == 0 && lane % G.lpr == 0;
}

// The matrix of a MultiMatmul that set `set` (a block's share of the rows:
// `first_block` counts sets) belongs to.
__device__ __forceinline__ int set_matrix(const MultiMatmul& mm, int set) {
    int m = 0;
    while (m + 1 < mm.count && set >= mm.first_block[m + 1]) m++;
    return m;
}

// Set `set` of matrix m, by the block: each warp one row group (or one
// slice of it) through qmv_chunks, the sums stored by the warps of slice 0.
template <int BITS, int NC, bool GLU>
__device__ __forceinline__ void qmv_body(const MultiMatmul& mm, int m, int set, const float* x) {
    const QW& q = mm.q[m];
    QmvGeom G = qmv_geom(q.cols, q.bits);
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int part = w % G.parts;
    int rg = (set - mm.first_block[m]) * G.wpb + w / G.parts;
    float acc[NC];
    qmv_chunks<BITS, NC, true, GLU>(q, q, NC, G, rg, part, x, acc);
    if (!qmv_holds_sums(G)) return;
    bool add = (mm.accumulate >> m) & 1;
    float* out = mm.out[m];
    const float* bias = mm.bias[m];
#pragma unroll
    for (int i = 0; i < NC; i++) {
        int r = (rg * NC + i) * G.rpc + lane / G.lpr;
        if (r < q.rows) {
            float v = add ? out[r] + acc[i] : acc[i];
            out[r] = bias ? v + bias[r] : v;
        }
    }
}

// A set's weights, scales and biases as one warp's lanes hold them.
template <int NC>
struct QmvFetch {
    uint4 w[NC];
    float s[NC], b[NC];
};

// Where a warp and lane of a streaming kernel read: the warp's part of its
// row group, the row within a short-row chunk, and the byte (cb, -1 for
// none: idle warps and lanes past their slice) and column c0 of its chunk.
struct QmvLane {
    int w, lane, part, rsub, cb, c0;
};

template <int BITS>
__device__ __forceinline__ QmvLane qmv_lane(const QmvGeom& G) {
    QmvLane l;
    l.w = threadIdx.x >> 5;
    l.lane = threadIdx.x & 31;
    l.part = l.w % G.parts;
    l.rsub = G.rb >= 512 ? 0 : (16 * l.lane) / G.rb;
    l.cb = l.w < G.wpb * G.parts ? qmv_chunk_byte(G, l.part, l.lane) : -1;
    l.c0 = max(l.cb, 0) * 8 / code_bits(BITS);
    return l;
}

// Chunk i of a warp's set: row r of q (zero codes past its rows or where
// the lane has no chunk), with its scale and bias.
template <int BITS, int NC>
__device__ __forceinline__ void qmv_fetch_chunk(const QW& q, long r, const QmvLane& l, const QmvGeom& G,
                                                QmvFetch<NC>& f, int i) {
    long wpr = G.rb >> 2;
    f.w[i] = l.cb >= 0 && r < q.rows ? __ldg((const uint4*)(q.w + r * wpr) + (l.cb >> 4)) : make_uint4(0, 0, 0, 0);
    chunk_params<BITS>(q, (r < q.rows ? r : q.rows - 1) * (q.cols / q.gs) + l.c0 / q.gs, f.s[i], f.b[i]);
}

// The streaming loop of the one-token kernels: block b computes sets b,
// b + gridDim.x, ... of nsets and requests the next set's weights and
// parameters (fetch(set, f)) before it computes the current one, so the
// loads of one set overlap the arithmetic of the other; every warp always
// reads the same slice of its rows, so the activations (load(xv, xs), T
// tokens) are loaded once, after the first fetch and the wait for the
// previous kernel. store(set, acc) runs in the lanes that hold a row's
// sums (qmv_holds_sums).
template <int BITS, int NC, int T, class Fetch, class Load, class Store>
__device__ __forceinline__ void qmv_stream_sets(const QmvGeom& G, int nsets, Fetch fetch, Load load,
                                                Store store) {
    constexpr int EPL = 128 / code_bits(BITS);
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    bool active = w < G.wpb * G.parts, holds = qmv_holds_sums(G);
    QmvFetch<NC> cur, next;
    int set = blockIdx.x;
    if (set < nsets) fetch(set, cur);
    PDL_WAIT();
    float xv[T][EPL], xs[T];
    load(xv, xs);
    __shared__ float red[2][8][T][NC];  // two, so one barrier per set suffices
    for (int it = 0; set < nsets; set += gridDim.x, it ^= 1) {
        if (set + (int)gridDim.x < nsets) fetch(set + gridDim.x, next);
        float acc[T][NC];
#pragma unroll
        for (int t = 0; t < T; t++)
#pragma unroll
            for (int i = 0; i < NC; i++) {
                float d = chunk_dot_any<BITS>(cur.w[i], xv[t]);
                acc[t][i] = is_mx(BITS) ? cur.s[i] * d : fmaf(cur.s[i], d, cur.b[i] * xs[t]);
            }
#pragma unroll
        for (int t = 0; t < T; t++)
#pragma unroll
            for (int i = 0; i < NC; i++)
#pragma unroll
                for (int o = 16; o > 0; o >>= 1)
                    if (o < G.lpr) acc[t][i] += __shfl_xor_sync(0xffffffffu, acc[t][i], o);
        if (G.parts > 1) {
            if (lane == 0 && active)
#pragma unroll
                for (int t = 0; t < T; t++)
#pragma unroll
                    for (int i = 0; i < NC; i++) red[it][w][t][i] = acc[t][i];
            __syncthreads();
            if (holds)
#pragma unroll
                for (int t = 0; t < T; t++)
#pragma unroll
                    for (int i = 0; i < NC; i++) {
                        float v = 0.0f;
                        for (int c = 0; c < G.parts; c++) v += red[it][w + c][t][i];
                        acc[t][i] = v;
                    }
        }
        if (holds) store(set, acc);
        cur = next;
    }
}

// One token, every matrix of the group of width BITS (the host checks the
// layout; else qmatmul1), streamed through a grid of a few blocks per SM
// (qmv_stream_sets). The matrices of a group share their input, so every
// set has the same geometry. Rows with more slices than a row group has
// warps take the sets one by one (qmv_body).
// T > 1: tokens T * blockIdx.y .. of the n in x, each with its activations
// in registers (the host sends only the streaming layout, plain inputs),
// every token's sums computed as the one-token kernel computes them.
template <int BITS, int NC, bool GLU, int T = 1>
__device__ __forceinline__ void qmv_stream_body(const MultiMatmul& mm, const float* x, int n = 1) {
    static_assert(T == 1 || !GLU, "SwiGLU inputs are one token's");
    constexpr int EPL = 128 / BITS;
    const int nsets = mm.first_block[mm.count];
    QmvGeom G = qmv_geom(mm.q[0].cols, BITS);
    if (G.slices > G.parts) {
        if constexpr (T == 1) {
            for (int set = blockIdx.x; set < nsets; set += gridDim.x) {
                qmv_body<BITS, NC, GLU>(mm, set_matrix(mm, set), set, x);
                __syncthreads();  // qmv_chunks' shared sums are reused
            }
        }
        return;
    }
    const int t0 = blockIdx.y * T, nt = min(T, n - t0);
    const QmvLane l = qmv_lane<BITS>(G);
    auto row_group = [&](int set, int m) { return (long)(set - mm.first_block[m]) * G.wpb + l.w / G.parts; };
    auto fetch = [&](int set, QmvFetch<NC>& f) {
        int m = set_matrix(mm, set);
        long rg = row_group(set, m);
#pragma unroll
        for (int i = 0; i < NC; i++) qmv_fetch_chunk<BITS, NC>(mm.q[m], (rg * NC + i) * G.rpc + l.rsub, l, G, f, i);
    };
    const int cols = mm.q[0].cols;
    auto load = [&](float (&xv)[T][EPL], float (&xs)[T]) {
#pragma unroll
        for (int t = 0; t < T; t++) {
            // (tokens past n repeat the last one; their sums are not stored)
            const float* xt = x + (long)(t0 + min(t, nt - 1)) * cols;
            xs[t] = qmv_load_acts<BITS, GLU>(xt, cols, l.c0, l.cb >= 0, xv[t]);
        }
    };
    auto store = [&](int set, float (&acc)[T][NC]) {
        int m = set_matrix(mm, set);
        int rows = mm.q[m].rows;
        bool add = (mm.accumulate >> m) & 1;
        const float* bias = mm.bias[m];
        long rg = row_group(set, m);
#pragma unroll
        for (int t = 0; t < T; t++) {
            if (t >= nt) break;
            float* out = mm.out[m] + (long)(t0 + t) * rows;
#pragma unroll
            for (int i = 0; i < NC; i++) {
                long r = (rg * NC + i) * G.rpc + l.lane / G.lpr;
                if (r < rows) {
                    float v = add ? out[r] + acc[t][i] : acc[t][i];
                    out[r] = bias ? v + bias[r] : v;
                }
            }
        }
    };
    qmv_stream_sets<BITS, NC, T>(G, nsets, fetch, load, store);
}

#ifndef QMV_NC
#define QMV_NC 8  // chunks per warp of qmv_b48: QMV_CHUNKS in linear.rs
#endif
#ifndef QMV_STREAM_NC
#define QMV_STREAM_NC 4  // chunks per warp and set of qmv_b*: QMV_STREAM_CHUNKS in linear.rs
#endif
// One token, one code width per launch: QMV_STREAM_NC chunks per warp and
// set, or two (`_nc2`: four times the warps for the same rows, so products
// of a few hundred KB, routers and shared experts, spread over every SM and
// each warp's chain of loads and FMAs is shorter); `_glu`: the input is the
// SwiGLU of [gate | up] (an MLP's down product).
#define QMV_KERNEL(NAME, B, NC, GLU)                                                              \
    extern "C" __global__ void __launch_bounds__(256) NAME(MultiMatmul mm, const float* x) {      \
        PDL_TRIGGER();                                                                            \
        qmv_stream_body<B, NC, GLU>(mm, x);                                                       \
    }
#define QMV_KERNELS(B)                                 \
    QMV_KERNEL(qmv_b##B, B, QMV_STREAM_NC, false)      \
    QMV_KERNEL(qmv_b##B##_nc2, B, 2, false)            \
    QMV_KERNEL(qmv_b##B##_glu, B, QMV_STREAM_NC, true) \
    QMV_KERNEL(qmv_b##B##_nc2_glu, B, 2, true)
QMV_KERNELS(4)
QMV_KERNELS(8)
QMV_KERNELS(2)

// A few tokens (the decode steps of several sequences): QMV_TOKENS per
// blockIdx.y, two chunks per warp and set (the activations of four tokens
// take the registers), 4- and 8-bit codes, plain inputs.
#define QMV_TOKENS 4
#define QMV_MULTI_KERNEL(B)                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 1) qmv_b##B##_t4(MultiMatmul mm, const float* x, int n) { \
        PDL_TRIGGER();                                                                             \
        qmv_stream_body<B, 2, false, QMV_TOKENS>(mm, x, n);                                        \
    }
QMV_MULTI_KERNEL(4)
QMV_MULTI_KERNEL(8)

// A group of 4- and 8-bit matrices in one launch (a MoE block's 8-bit
// router and gate with its 4-bit shared expert): the width is chosen per
// block.
template <int NC>
__device__ __forceinline__ void qmv_b48_body(const MultiMatmul& mm, const float* x) {
    int m = set_matrix(mm, blockIdx.x);
    if (mm.q[m].bits == 8)
        qmv_body<8, NC, false>(mm, m, blockIdx.x, x);
    else
        qmv_body<4, NC, false>(mm, m, blockIdx.x, x);
}
extern "C" __global__ void __launch_bounds__(256) qmv_b48(MultiMatmul mm, const float* x) {
    PDL_TRIGGER();
    qmv_b48_body<QMV_NC>(mm, x);
}
extern "C" __global__ void __launch_bounds__(256) qmv_b48_nc2(MultiMatmul mm, const float* x) {
    PDL_TRIGGER();
    qmv_b48_body<2>(mm, x);
}

// Dense (bf16 or f32) weights: a warp per row, 8 rows per block.
extern "C" __global__ void dmatmul(const void* w, int f32, int rows, int cols, const float* x, int n,
                                   int accumulate, float* out) { PDL_ENTER();
    int r = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (r >= rows) return;
    int lane = threadIdx.x & 31;
    for (int t = blockIdx.y; t < n; t += gridDim.y) {
        float acc = 0.0f;
        for (long j = lane; j < cols; j += WARP) {
            float wv = f32 ? ((const float*)w)[(long)r * cols + j]
                           : bf16f(((const u16*)w)[(long)r * cols + j]);
            acc = fmaf(wv, x[(long)t * cols + j], acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) {
            long oi = (long)t * rows + r;
            out[oi] = accumulate ? out[oi] + acc : acc;
        }
    }
}

// Rows `ids[t]` of a quantized matrix, dequantized: out[t, :] (embedding).
extern "C" __global__ void qgather_rows(QW q, const int* ids, float* out) { PDL_ENTER();
    int t = blockIdx.x;
    long r = ids[t];
    long wpr = ((long)q.cols * q.bits) >> 5;
    int gpr = q.cols / q.gs;
    for (long j = threadIdx.x; j < q.cols; j += blockDim.x) {
        int g = (int)(j / q.gs);
        float s = qparam(q.s, r * gpr + g, q.sf32), b = qparam(q.b, r * gpr + g, q.sf32);
        out[(long)t * q.cols + j] = fmaf((float)qcode(q.w + r * wpr, j, q.bits), s, b);
    }
}

// --------------------------------------------------------------------------
// Elementwise and norms

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, a block per row.
extern "C" __global__ void rms_norm(const float* x, const float* w, int width, float eps, float* out) { PDL_ENTER();
    const float* xr = x + (long)blockIdx.x * width;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    float inv = rsqrtf(ss / width + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x)
        out[(long)blockIdx.x * width + i] = xr[i] * inv * w[i];
}

// The most likely token of each logits row (blockIdx.x, `v` floats): the
// index of the first of its largest values, what greedy sampling on the
// host picks; -1 when the row holds a NaN or an infinity (the host then
// reports non-finite logits, as for logits it reads itself). Any block
// size that is a multiple of 32, up to 1024.
extern "C" __global__ void argmax_rows(const float* x, int v, int* out) { PDL_ENTER();
    const float* r = x + (long)blockIdx.x * v;
    float best = NEG_INF;
    int at = 0x7fffffff, bad = 0;
    // Each thread's indices ascend, so `>` keeps its first maximum.
    for (int i = threadIdx.x; i < v; i += blockDim.x) {
        float a = r[i];
        if (!(fabsf(a) <= 3.402823466e38f)) bad = 1;  // NaN or an infinity
        else if (a > best) {
            best = a;
            at = i;
        }
    }
    __shared__ float sb[32];
    __shared__ int si[32], sbad[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int round = 0; round < 2; round++) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, at, o);
            bad |= __shfl_xor_sync(0xffffffffu, bad, o);
            if (ob > best || (ob == best && oi < at)) {
                best = ob;
                at = oi;
            }
        }
        if (round == 1) break;
        __syncthreads();
        if (lane == 0) {
            sb[w] = best;
            si[w] = at;
            sbad[w] = bad;
        }
        __syncthreads();
        int nw = blockDim.x >> 5;
        best = lane < nw ? sb[lane] : NEG_INF;
        at = lane < nw ? si[lane] : 0x7fffffff;
        bad = lane < nw ? sbad[lane] : 0;
    }
    if (threadIdx.x == 0) out[blockIdx.x] = bad ? -1 : at;
}

extern "C" __global__ void swiglu(const float* g, const float* u, float* out, long n) { PDL_ENTER();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        out[i] = siluf_(g[i]) * u[i];
}

// --------------------------------------------------------------------------
// Gated full attention

// The biases, norms and output gate of a grouped-query attention layer
// (each pointer null where the family has none): q/k/v biases (rows of the
// projections), the per-head q/k RMSNorm weights, and whether q_proj's rows
// are per head [q | gate] (Qwen3.5 / Qwen3-Next) rather than q alone.
struct AttnParts {
    const float* q_bias;
    const float* k_bias;
    const float* v_bias;
    const float* q_norm;
    const float* k_norm;
    int gated;
    float mscale;  // YaRN's magnitude factor of the rotated channels (1 without YaRN)
};

// Per (token, head): q = rope(rms_norm(qg[.., q] + bias, q_norm)), the gate
// half (when gated) copied out; per (token, kv head): rope(rms_norm(k + bias,
// k_norm)) and v + bias appended to the caches kc and vc at row
// (*pos + token) & mask (a row: nkv * hd floats; mask: all ones, or a
// sliding-window layer's ring capacity - 1); no norm where its weight is null. A block of
// `hd` threads (a power of two, <= 1024) per (token, head); blockIdx.y is
// the token, heads nh then nkv along blockIdx.x.
extern "C" __global__ void attn_prep(const float* qg, const float* k, const float* v, AttnParts P,
                                     const double* inv_freq, int half_rot, int nh, int nkv, int hd,
                                     float eps, const long* pos, double pos_scale, float* q_out,
                                     float* gate_out, float* kc, float* vc,
                                     const unsigned long long* seqs, long mask,
                                     const long* masks) { PDL_ENTER();
    extern __shared__ float sh[];
    int t = blockIdx.y, h = blockIdx.x, i = threadIdx.x;
    // `seqs`: a decode batch, row t its own sequence's token (its KV cache
    // seqs[2t], seqs[2t+1], its row mask masks[t], its position pos[t]);
    // else one sequence's rows.
    long start = seqs ? pos[t] : *pos;
    long tl = seqs ? 0 : t;
    if (seqs) {
        kc = (float*)seqs[2 * t];
        vc = (float*)seqs[2 * t + 1];
        mask = masks[t];
    }
    int q_stride = P.gated ? 2 * hd : hd;
    const float* src;
    const float* bias;
    float* dst;
    const float* nw;
    if (h < nh) {
        long row = (long)h * q_stride;
        src = qg + (long)t * nh * q_stride + row;
        bias = P.q_bias ? P.q_bias + row : nullptr;
        dst = q_out + ((long)t * nh + h) * hd;
        nw = P.q_norm;
        if (P.gated) {
            float gv = src[hd + i];
            if (bias) gv += bias[hd + i];
            gate_out[((long)t * nh + h) * hd + i] = gv;
        }
    } else {
        long kv_row = (long)(h - nh) * hd;
        long in = (long)t * nkv * hd + kv_row;
        long at = ((start + tl) & mask) * nkv * hd + kv_row;
        src = k + in;
        bias = P.k_bias ? P.k_bias + kv_row : nullptr;
        dst = kc + at;
        nw = P.k_norm;
        float vv = v[in + i];
        if (P.v_bias) vv += P.v_bias[kv_row + i];
        vc[at + i] = vv;
    }
    float x = src[i];
    if (bias) x += bias[i];
    if (nw) {  // the same for the whole block
        float ss = block_sum(x * x);
        float inv = rsqrtf(ss / hd + eps);
        x = x * inv * nw[i];
    }
    sh[i] = x;
    __syncthreads();
    float o = sh[i];
    if (i < 2 * half_rot) {
        int j = i < half_rot ? i : i - half_rot;
        double ang = (double)(start + tl) * pos_scale * inv_freq[j];
        float c = (float)cos(ang), s = (float)sin(ang);
        float a = sh[j] * P.mscale, b = sh[j + half_rot] * P.mscale;  // as Rope::apply
        o = i < half_rot ? a * c - b * s : a * s + b * c;
    }
    __syncthreads();
    dst[i] = o;
}

// Causal attention of n new tokens (positions start..start+n) over the KV
// cache's positions 0..start+t (position p at row p & mask, as attn_prep
// wrote it), output times sigmoid(gate) when GATED. A block of 8 warps per
// (head, token) with an online softmax per warp over positions p = warp,
// warp+8, ...; each lane holds hd/32 output channels (hd <= 256). Two
// kernels rather than a test of gate at run time, which made the gated one
// 8% slower on the H200. SINKS (gpt-oss): a logit per head joins the softmax
// without a value, and with window > 0 a token sees only the last `window`
// positions, itself included.
template <bool GATED, bool SINKS>
__device__ __forceinline__ void attention_body(const float* q, const float* kc, const float* vc,
                                               const float* gate, int nh, int nkv, int hd,
                                               const long* pos, float scale, float* out,
                                               const unsigned long long* seqs,
                                               const float* sinks, int window, long mask,
                                               const long* masks) {
    const int NW = 8;
    int h = blockIdx.x, t = blockIdx.y;
    // `seqs`: a decode batch, as in attn_prep.
    long start = seqs ? pos[t] : *pos;
    long tl = seqs ? 0 : t;
    if (seqs) {
        kc = (const float*)seqs[2 * t];
        vc = (const float*)seqs[2 * t + 1];
        if (masks) mask = masks[t];
    }
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int g = h / (nh / nkv);
    int per = hd / WARP;  // channels per lane, <= 8
    long row = (long)nkv * hd;
    const float* qh = q + ((long)t * nh + h) * hd;
    float qv[8], acc[8];
#pragma unroll
    for (int c = 0; c < 8; c++) {
        qv[c] = c < per ? qh[lane + c * WARP] : 0.0f;
        acc[c] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    long ctx = start + tl + 1;
    long first = SINKS && window > 0 && ctx > window ? ctx - window : 0;
    for (long p = first + w; p < ctx; p += NW) {
        const float* kr = kc + (p & mask) * row + (long)g * hd;
        float d = 0.0f;
#pragma unroll
        for (int c = 0; c < 8; c++)
            if (c < per) d = fmaf(qv[c], kr[lane + c * WARP], d);
        d = warp_sum(d) * scale;
        float mn = fmaxf(m, d);
        float corr = expf(m - mn), e = expf(d - mn);
        l = l * corr + e;
        const float* vr = vc + (p & mask) * row + (long)g * hd;
#pragma unroll
        for (int c = 0; c < 8; c++)
            if (c < per) acc[c] = fmaf(e, vr[lane + c * WARP], acc[c] * corr);
        m = mn;
    }
    __shared__ float sm[NW], sl[NW], sacc[NW][256];
    if (lane == 0) {
        sm[w] = m;
        sl[w] = l;
    }
#pragma unroll
    for (int c = 0; c < 8; c++)
        if (c < per) sacc[w][lane + c * WARP] = acc[c];
    __syncthreads();
    if (w == 0) {
        float M = NEG_INF;
        for (int i = 0; i < NW; i++) M = fmaxf(M, sm[i]);
        if constexpr (SINKS) M = fmaxf(M, sinks[h]);
        float L = 0.0f;
        for (int i = 0; i < NW; i++) L += sm[i] == NEG_INF ? 0.0f : sl[i] * expf(sm[i] - M);
        if constexpr (SINKS) L += expf(sinks[h] - M);
        for (int c = 0; c < per; c++) {
            int ch = lane + c * WARP;
            float o = 0.0f;
            for (int i = 0; i < NW; i++)
                if (sm[i] != NEG_INF) o += sacc[i][ch] * expf(sm[i] - M);
            long oi = ((long)t * nh + h) * hd + ch;
            if constexpr (GATED)
                out[oi] = o / L * sigmoidf_(gate[oi]);
            else
                out[oi] = o / L;
        }
    }
}

extern "C" __global__ void attention(const float* q, const float* kc, const float* vc,
                                     const float* gate, int nh, int nkv, int hd, const long* pos,
                                     float scale, float* out, const unsigned long long* seqs) {
    PDL_ENTER();
    attention_body<true, false>(q, kc, vc, gate, nh, nkv, hd, pos, scale, out, seqs, nullptr, 0, -1,
                                nullptr);
}

extern "C" __global__ void attention_plain(const float* q, const float* kc, const float* vc,
                                           const float* gate, int nh, int nkv, int hd,
                                           const long* pos, float scale, float* out,
                                           const unsigned long long* seqs) {
    PDL_ENTER();
    attention_body<false, false>(q, kc, vc, gate, nh, nkv, hd, pos, scale, out, seqs, nullptr, 0, -1,
                                 nullptr);
}

// Ungated attention with a sink logit per head and an optional sliding
// window (gpt-oss), whose rows are in a ring (row of p: p & mask; a decode
// batch's masks[t]); otherwise as `attention_plain`.
extern "C" __global__ void attention_sinks(const float* q, const float* kc, const float* vc,
                                           const float* sinks, int nh, int nkv, int hd,
                                           const long* pos, float scale, float* out,
                                           const unsigned long long* seqs, int window, long mask,
                                           const long* masks) {
    PDL_ENTER();
    attention_body<false, true>(q, kc, vc, nullptr, nh, nkv, hd, pos, scale, out, seqs, sinks,
                                window, mask, masks);
}


// --------------------------------------------------------------------------
// GatedDeltaNet

// Qwen3-Next fused projections, per key head [q dk | k dk | v r*dv | z r*dv]
// and [b r | a r], into mixed = [q (kd) | k (kd) | v (vd)], z, b, a.
extern "C" __global__ void deltanet_split(const float* f, const float* gba, int nk, int dk, int dv,
                                          int r, float* mixed, float* z, float* b, float* a) { PDL_ENTER();
    int t = blockIdx.y, kh = blockIdx.x;
    int kd = nk * dk, vd = nk * r * dv, w = 2 * kd + 2 * vd, cd = 2 * kd + vd, nv = nk * r;
    const float* s = f + (long)t * w + (long)kh * (2 * dk + 2 * r * dv);
    float* m = mixed + (long)t * cd;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        m[kh * dk + i] = s[i];
        m[kd + kh * dk + i] = s[dk + i];
    }
    for (int i = threadIdx.x; i < r * dv; i += blockDim.x) {
        m[2 * kd + kh * r * dv + i] = s[2 * dk + i];
        z[(long)t * vd + kh * r * dv + i] = s[2 * dk + r * dv + i];
    }
    const float* sb = gba + (long)t * 2 * nv + kh * 2 * r;
    for (int i = threadIdx.x; i < r; i += blockDim.x) {
        b[(long)t * nv + kh * r + i] = sb[i];
        a[(long)t * nv + kh * r + i] = sb[r + i];
    }
}

// A thread's channel of the GatedDeltaNet conv: a block per head of
// `mixed` = [q (nk x dk) | k (nk x dk) | v (nv x dv)], a thread per channel
// (blocks as wide as the widest head, so some threads are idle), and the
// q/k norm's constants.
struct ConvLane {
    int cd, ch, hist, dk;
    bool qk, live;
    float eps, scale;
};

__device__ __forceinline__ ConvLane conv_lane(int nk, int dk, int nv, int dv, int kk) {
    ConvLane c;
    int b = blockIdx.x, i = threadIdx.x, kd = nk * dk;
    c.cd = 2 * kd + nv * dv;
    c.qk = b < 2 * nk;
    c.live = i < (c.qk ? dk : dv);
    c.ch = c.qk ? b * dk + i : 2 * kd + (b - 2 * nk) * dv + i;
    c.hist = kk - 1;
    c.dk = dk;
    float inv = rsqrtf((float)dk);
    c.eps = 1e-6f * inv * inv;
    c.scale = b < nk ? inv * inv : inv;
    return c;
}

// One token of the channel: causal depthwise conv over st (the hist raw
// inputs before it, shifted in place to take x) and x, then SiLU; q and k
// RMS-normalised over their head (eps = 1e-6 / dk) and scaled by 1/dk (q)
// or 1/sqrt(dk) (k). Every thread of the block calls it (block_sum).
__device__ __forceinline__ float conv_step(const ConvLane& c, const float* w, float (&st)[8], float x) {
    int kk = c.hist + 1;
    float acc = 0.0f;
    if (c.live) {
        for (int j = 0; j < c.hist; j++) acc += w[c.ch * kk + j] * st[j];
        acc += w[c.ch * kk + c.hist] * x;
    }
    for (int j = 0; j + 1 < c.hist; j++) st[j] = st[j + 1];
    if (c.hist > 0) st[c.hist - 1] = x;
    float o = siluf_(acc);
    if (c.qk) {
        float ss = block_sum(c.live ? o * o : 0.0f);
        o = o * rsqrtf(ss / c.dk + c.eps) * c.scale;
    }
    return o;
}

// The conv and the q/k norms in place over n tokens in order, the state
// keeping the last kk-1 raw inputs (one-token decode: a chain over the
// tokens otherwise). `seqs`: a decode batch (n = 1), blockIdx.y its row and
// sequence, whose conv state is seqs[2 * row].
extern "C" __global__ void conv_qk_norm(float* mixed, const float* w, float* state, int nk, int dk, int nv,
                                        int dv, int kk, int n, const unsigned long long* seqs) { PDL_ENTER();
    ConvLane c = conv_lane(nk, dk, nv, dv, kk);
    if (seqs) {
        mixed += (long)blockIdx.y * c.cd;
        state = (float*)seqs[2 * blockIdx.y];
    }
    float st[8];
    for (int j = 0; j < c.hist; j++) st[j] = c.live ? state[(long)j * c.cd + c.ch] : 0.0f;
    // The next token's input is loaded before this one is computed.
    float next = c.live && n > 0 ? mixed[c.ch] : 0.0f;
    for (int t = 0; t < n; t++) {
        float x = next;
        if (c.live && t + 1 < n) next = mixed[(long)(t + 1) * c.cd + c.ch];
        float o = conv_step(c, w, st, x);
        if (c.live) mixed[(long)t * c.cd + c.ch] = o;
    }
    if (c.live)
        for (int j = 0; j < c.hist; j++) state[(long)j * c.cd + c.ch] = st[j];
}

// conv_qk_norm for a batch, parallel over the tokens (the one-token kernel's
// chain over a 4096-token prefill took 2.5 ms per layer): the raw inputs
// `raw` and the conv state are only read, the result goes to `mixed`, and
// conv_state_update moves the state afterwards (blocks of early tokens read
// it here). Grid (heads, tiles of CONV_TILE tokens); the same sums in the
// same order as conv_qk_norm.
#define CONV_TILE 16
extern "C" __global__ void conv_qk_norm_batch(const float* raw, float* mixed, const float* w, const float* state,
                                              int nk, int dk, int nv, int dv, int kk, int n) { PDL_ENTER();
    ConvLane c = conv_lane(nk, dk, nv, dv, kk);
    int t0 = blockIdx.y * CONV_TILE, t1 = min(n, t0 + CONV_TILE);
    // The hist raw inputs before token t0: the state's (its row hist - 1 is
    // the input just before this batch) or the batch's own.
    float st[8];
    for (int j = 0; j < c.hist; j++) {
        int tj = t0 - c.hist + j;
        st[j] = !c.live ? 0.0f : tj >= 0 ? raw[(long)tj * c.cd + c.ch] : state[(long)(c.hist + tj) * c.cd + c.ch];
    }
    for (int t = t0; t < t1; t++) {
        float o = conv_step(c, w, st, c.live ? raw[(long)t * c.cd + c.ch] : 0.0f);
        if (c.live) mixed[(long)t * c.cd + c.ch] = o;
    }
}

// The conv state after a batch of n raw inputs: its last kk - 1 inputs,
// older rows of the state where n < kk - 1. A thread per channel, rows in
// increasing order (row j reads row j + n, which it writes later).
extern "C" __global__ void conv_state_update(const float* raw, float* state, int cd, int kk, int n) { PDL_ENTER();
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= cd) return;
    int hist = kk - 1;
    for (int j = 0; j < hist; j++) {
        int tj = n - hist + j;
        state[(long)j * cd + ch] = tj >= 0 ? raw[(long)tj * cd + ch] : state[(long)(hist + tj) * cd + ch];
    }
}

// The delta rule over n tokens. Grid (value head, row block); a block of 8
// warps owns 32 rows of the head's state (dv x dk), 4 per warp; a lane
// keeps dk/32 columns of each of its rows in registers (dk <= 256).
// y layout: [t][nv][dv]. `seqs`: a decode batch (n = 1), blockIdx.z its
// row and sequence, whose state is seqs[2 * row + 1].
#define DR_ROWS_PER_WARP 4
extern "C" __global__ void delta_rule(const float* mixed, const float* a, const float* b,
                                      const float* a_log, const float* dt_bias, float* state,
                                      int n, int nk, int nv, int dk, int dv, float* y,
                                      const unsigned long long* seqs) { PDL_ENTER();
    int h = blockIdx.x;
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int kh = h / (nv / nk);
    int kd = nk * dk, cd = 2 * kd + nv * dv;
    if (seqs) {
        long r = blockIdx.z;
        mixed += r * cd;
        a += r * nv;
        b += r * nv;
        y += r * nv * dv;
        state = (float*)seqs[2 * r + 1];
    }
    int per = dk / WARP;  // <= 8
    int row0 = blockIdx.y * 32 + w * DR_ROWS_PER_WARP;
    float st[DR_ROWS_PER_WARP][8];
#pragma unroll
    for (int r = 0; r < DR_ROWS_PER_WARP; r++)
#pragma unroll
        for (int c = 0; c < 8; c++)
            st[r][c] = (c < per && row0 + r < dv) ? state[((long)h * dv + row0 + r) * dk + lane + c * WARP] : 0.0f;
    float decay_rate = expf(a_log[h]);
    // Token t + 1's inputs are loaded while token t is computed: over a
    // prefill the loop is a chain of dependent steps, and an input load
    // from L2 would otherwise start each one.
    float qv[8], kv[8], vv[DR_ROWS_PER_WARP], av, bv;
    auto load = [&](int t) {
        const float* m = mixed + (long)t * cd;
#pragma unroll
        for (int c = 0; c < 8; c++) {
            qv[c] = c < per ? m[kh * dk + lane + c * WARP] : 0.0f;
            kv[c] = c < per ? m[kd + kh * dk + lane + c * WARP] : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < DR_ROWS_PER_WARP; r++) vv[r] = row0 + r < dv ? m[2 * kd + h * dv + row0 + r] : 0.0f;
        av = a[(long)t * nv + h];
        bv = b[(long)t * nv + h];
    };
    if (n > 0) load(0);
    for (int t = 0; t < n; t++) {
        float q[8], k[8], v[DR_ROWS_PER_WARP];
#pragma unroll
        for (int c = 0; c < 8; c++) q[c] = qv[c], k[c] = kv[c];
#pragma unroll
        for (int r = 0; r < DR_ROWS_PER_WARP; r++) v[r] = vv[r];
        float at = av + dt_bias[h], bt = bv;
        if (t + 1 < n) load(t + 1);
        float sp = fmaxf(at, 0.0f) + log1pf(expf(-fabsf(at)));
        float g = expf(-decay_rate * sp);
        float beta = sigmoidf_(bt);
#pragma unroll
        for (int r = 0; r < DR_ROWS_PER_WARP; r++) {
            int row = row0 + r;
            float kdot = 0.0f;
#pragma unroll
            for (int c = 0; c < 8; c++) kdot = fmaf(st[r][c], k[c], kdot);
            kdot = warp_sum(kdot);
            float d = (v[r] - g * kdot) * beta;
            float o = 0.0f;
#pragma unroll
            for (int c = 0; c < 8; c++) {
                st[r][c] = fmaf(d, k[c], g * st[r][c]);
                o = fmaf(st[r][c], q[c], o);
            }
            o = warp_sum(o);
            if (lane == 0 && row < dv) y[((long)t * nv + h) * dv + row] = o;
        }
    }
#pragma unroll
    for (int r = 0; r < DR_ROWS_PER_WARP; r++)
#pragma unroll
        for (int c = 0; c < 8; c++)
            if (c < per && row0 + r < dv) state[((long)h * dv + row0 + r) * dk + lane + c * WARP] = st[r][c];
}

// Gated RMSNorm per (token, value head): out = rms_norm(y, w) * silu(z); a
// block of dv threads.
extern "C" __global__ void gated_norm(const float* y, const float* z, const float* w, float eps,
                                      int dv, float* out) { PDL_ENTER();
    long base = ((long)blockIdx.y * gridDim.x + blockIdx.x) * dv;
    float v = y[base + threadIdx.x];
    float ss = block_sum(v * v);
    out[base + threadIdx.x] = v * rsqrtf(ss / dv + eps) * w[threadIdx.x] * siluf_(z[base + threadIdx.x]);
}

// --------------------------------------------------------------------------
// Mixture of experts

// One routed expert of a batch: where its projections live (device
// pointers into the expert cache) and which (token, slot)s it serves.
struct ExpertTask {
    const char* base;  // the expert's extent
    int first;         // its entries in slot_list: first .. first + count
    int count;
};

struct ExpertLayout {
    long gate_w, gate_s, gate_b, up_w, up_s, up_b, down_w, down_s, down_b;
    int inter, hidden, bits, gs, sf32;
    int mx;   // MXFP4 codes with e8m0 scale bytes (bits 4, gs 32, no biases): the _mx kernels
    int oai;  // gpt-oss's clamped SwiGLU (alpha, limit) rather than silu(g) * u
    float alpha, limit;
    // Per-expert biases (gpt-oss), [experts, inter] for gate and up and
    // [experts, hidden] for down, or null; row ids[slot] is the slot's expert
    // (the router's choice).
    const float* bias_g;
    const float* bias_u;
    const float* bias_d;
    const int* ids;
};

// The activation of one intermediate row of a slot from its gate and up
// sums: the biases added, then silu(g) * u, or gpt-oss's
// (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'), g' = min(g, limit)
// (ops::swiglu_oai).
__device__ __forceinline__ float expert_glu(const ExpertLayout& L, int slot, int r, float g, float u) {
    if (L.bias_g) {
        long e = L.ids[slot];
        g += L.bias_g[e * L.inter + r];
        u += L.bias_u[e * L.inter + r];
    }
    if (L.oai) {
        g = fminf(g, L.limit);
        u = fminf(fmaxf(u, -L.limit), L.limit);
        return (u + 1.0f) * (g * sigmoidf_(L.alpha * g));
    }
    return siluf_(g) * u;
}

// The down bias of hidden row r of a slot's expert (0 without biases).
__device__ __forceinline__ float expert_down_bias(const ExpertLayout& L, int slot, int r) {
    return L.bias_d ? L.bias_d[(long)L.ids[slot] * L.hidden + r] : 0.0f;
}

__device__ __forceinline__ QW expert_qw(const char* base, long wo, long so, long bo, int rows, int cols,
                                        const ExpertLayout& L) {
    QW q;
    q.w = (const u32*)(base + wo);
    q.s = base + so;
    q.b = base + bo;
    q.rows = rows;
    q.cols = cols;
    q.bits = L.bits;
    q.gs = L.gs;
    q.sf32 = L.sf32;
    return q;
}

// act[e] = silu(gate_e x) * (up_e x) for every (expert task, its tokens);
// blockIdx.y = task, a warp per RW intermediate rows, the task's tokens four
// at a time. `slot_list` holds slot = token * k + j; act rows are indexed by
// the position in slot_list.
template <int BITS>
__device__ void moe_gate_up_body(const ExpertTask* tasks, ExpertLayout L, const int* slot_list, int k,
                                 const float* x, float* act) {
    ExpertTask T = tasks[blockIdx.y];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    QW gq = expert_qw(T.base, L.gate_w, L.gate_s, L.gate_b, L.inter, L.hidden, L);
    QW uq = expert_qw(T.base, L.up_w, L.up_s, L.up_b, L.inter, L.hidden, L);
    int parts = col_split(gq, 4), part = w % parts;
    int r0 = (blockIdx.x * (8 / parts) + w / parts) * RW;
    bool active = r0 < L.inter;
    for (int i0 = 0; i0 < T.count; i0 += 4) {
        int nt = min(4, T.count - i0);
        const float* xp[4];
#pragma unroll
        for (int t = 0; t < 4; t++) xp[t] = x + (long)(slot_list[T.first + i0 + min(t, nt - 1)] / k) * L.hidden;
        float ga[RW][4], ua[RW][4];
        if (active) {
            qrows<BITS, 4>(gq, r0, xp, nt, ga, part, parts);
            qrows<BITS, 4>(uq, r0, xp, nt, ua, part, parts);
        }
        reduce_parts<4>(ga, parts);
        reduce_parts<4>(ua, parts);
        if (active && part == 0)
#pragma unroll
            for (int rr = 0; rr < RW; rr++)
#pragma unroll
                for (int t = 0; t < 4; t++)
                    if (lane == rr * 4 + t && t < nt && r0 + rr < L.inter)
                        act[(long)(T.first + i0 + t) * L.inter + r0 + rr] =
                            expert_glu(L, slot_list[T.first + i0 + t], r0 + rr, ga[rr][t], ua[rr][t]);
    }
}

// y[slot] = down_e act for every (task, its tokens).
template <int BITS>
__device__ void moe_down_body(const ExpertTask* tasks, ExpertLayout L, const int* slot_list,
                              const float* act, float* slot_out) {
    ExpertTask T = tasks[blockIdx.y];
    int w = threadIdx.x >> 5;
    QW dq = expert_qw(T.base, L.down_w, L.down_s, L.down_b, L.hidden, L.inter, L);
    int parts = col_split(dq, 4), part = w % parts;
    int r0 = (blockIdx.x * (8 / parts) + w / parts) * RW;
    bool active = r0 < L.hidden;
    for (int i0 = 0; i0 < T.count; i0 += 4) {
        int nt = min(4, T.count - i0);
        const float* xp[4];
#pragma unroll
        for (int t = 0; t < 4; t++) xp[t] = act + (long)(T.first + i0 + min(t, nt - 1)) * L.inter;
        float acc[RW][4];
        if (active) qrows<BITS, 4>(dq, r0, xp, nt, acc, part, parts);
        reduce_parts<4>(acc, parts);
        if (active && part == 0 && L.bias_d)
#pragma unroll
            for (int rr = 0; rr < RW; rr++)
#pragma unroll
                for (int t = 0; t < 4; t++)
                    if (t < nt && r0 + rr < L.hidden)
                        acc[rr][t] += expert_down_bias(L, slot_list[T.first + i0 + t], r0 + rr);
        if (active && part == 0)
            store_rows<4>(acc, r0, L.hidden, nt, slot_out, L.hidden, slot_list + T.first + i0, false);
    }
}

extern "C" __global__ void moe_gate_up_b4(const ExpertTask* t, ExpertLayout L, const int* s, int k, const float* x, float* a) { PDL_ENTER(); moe_gate_up_body<4>(t, L, s, k, x, a); }
extern "C" __global__ void moe_gate_up_b8(const ExpertTask* t, ExpertLayout L, const int* s, int k, const float* x, float* a) { PDL_ENTER(); moe_gate_up_body<8>(t, L, s, k, x, a); }
extern "C" __global__ void moe_gate_up_b2(const ExpertTask* t, ExpertLayout L, const int* s, int k, const float* x, float* a) { PDL_ENTER(); moe_gate_up_body<2>(t, L, s, k, x, a); }
extern "C" __global__ void moe_gate_up_bx(const ExpertTask* t, ExpertLayout L, const int* s, int k, const float* x, float* a) { PDL_ENTER(); moe_gate_up_body<0>(t, L, s, k, x, a); }
extern "C" __global__ void moe_down_b4(const ExpertTask* t, ExpertLayout L, const int* s, const float* a, float* y) { PDL_ENTER(); moe_down_body<4>(t, L, s, a, y); }
extern "C" __global__ void moe_down_b8(const ExpertTask* t, ExpertLayout L, const int* s, const float* a, float* y) { PDL_ENTER(); moe_down_body<8>(t, L, s, a, y); }
extern "C" __global__ void moe_down_b2(const ExpertTask* t, ExpertLayout L, const int* s, const float* a, float* y) { PDL_ENTER(); moe_down_body<2>(t, L, s, a, y); }
extern "C" __global__ void moe_down_bx(const ExpertTask* t, ExpertLayout L, const int* s, const float* a, float* y) { PDL_ENTER(); moe_down_body<0>(t, L, s, a, y); }
// MXFP4 experts (the _mx kernels read L.mx's layout).
extern "C" __global__ void moe_gate_up_mx(const ExpertTask* t, ExpertLayout L, const int* s, int k, const float* x, float* a) { PDL_ENTER(); moe_gate_up_body<MXB>(t, L, s, k, x, a); }
extern "C" __global__ void moe_down_mx(const ExpertTask* t, ExpertLayout L, const int* s, const float* a, float* y) { PDL_ENTER(); moe_down_body<MXB>(t, L, s, a, y); }

// out[t] += sum_j w[t,j] * slot_out[t*k+j] (slot order) + g[t] * shared[t]
// (when `shared` is not null), g = sigmoid(sg[t]) for Qwen's gated shared
// expert, 1 for DeepSeek's ungated ones (`sg` null): the MoE block's output
// added to the residual stream. Grid (token, column blocks).
extern "C" __global__ void moe_combine(const float* slot_out, const float* wts, int k, int h,
                                       const float* shared, const float* sg, float* out) { PDL_ENTER();
    int t = blockIdx.x;
    float s = shared ? (sg ? sigmoidf_(sg[t]) : 1.0f) : 0.0f;
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < h; i += gridDim.y * blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++) acc += wts[t * k + j] * slot_out[((long)t * k + j) * h + i];
        if (shared) acc += s * shared[(long)t * h + i];
        out[(long)t * h + i] += acc;
    }
}

// x[t, i] += b[i] for n rows of `cols` (a bias on a product's output: gpt-oss's
// o_proj and router). Grid (rows, column blocks).
extern "C" __global__ void add_rows(float* x, const float* b, int cols) {
    PDL_ENTER();
    long t = blockIdx.x;
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < cols; i += gridDim.y * blockDim.x)
        x[t * cols + i] += b[i];
}

// Router: per token, softmax over the e logits, the k largest (ties to the
// lower index, like the CPU), their probabilities (renormalised to sum 1
// when `norm`), and, when `table` is not null, each chosen expert's address
// table[expert] into bases. A warp per token; a lane holds C logits
// (expert lane + 32c), so e <= 32 C: moe_route_c{4,8,16,32} for up to 128,
// 256, 512 and 1024 experts (the loops are the whole cost of this kernel).
template <int C>
__device__ void moe_route_body(const float* logits, int n, int e, int k, int norm,
                               const unsigned long long* table, int* ids, float* wts,
                               unsigned long long* bases) {
    int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= n) return;
    int lane = threadIdx.x & 31;
    const float* l = logits + (long)t * e;
    float v[C];
    float m = NEG_INF;
#pragma unroll
    for (int c = 0; c < C; c++) {
        int i = lane + c * WARP;
        v[c] = i < e ? l[i] : NEG_INF;
        m = fmaxf(m, v[c]);
    }
    m = warp_max(m);
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < C; c++) {
        int i = lane + c * WARP;
        v[c] = i < e ? expf(v[c] - m) : -1.0f;
        sum += i < e ? v[c] : 0.0f;
    }
    sum = warp_sum(sum);
    float inv = 1.0f / sum;
    float chosen = 0.0f, myw = 0.0f;
    int myid = 0;
    for (int j = 0; j < k; j++) {
        // Lane-local best (largest value, lowest index), then across lanes.
        float bv = -2.0f;
        int bi = 0x7fffffff;
#pragma unroll
        for (int c = 0; c < C; c++) {
            int i = lane + c * WARP;
            if (v[c] > bv) { bv = v[c]; bi = i; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        float p = bv * inv;
        if (lane == j) { myw = p; myid = bi; }
        chosen += p;
#pragma unroll
        for (int c = 0; c < C; c++)
            if (lane + c * WARP == bi) v[c] = -2.0f;
    }
    if (lane < k) {
        float w = norm ? myw / chosen : myw;
        ids[(long)t * k + lane] = myid;
        wts[(long)t * k + lane] = w;
        if (table) bases[(long)t * k + lane] = table[myid];
    }
}

#define ROUTE_KERNEL(C)                                                                                      \
    extern "C" __global__ void moe_route_c##C(const float* logits, int n, int e, int k, int norm,            \
                                              const unsigned long long* table, int* ids, float* wts,         \
                                              unsigned long long* bases) {                                   \
        PDL_ENTER();                                                                                         \
        moe_route_body<C>(logits, n, e, k, norm, table, ids, wts, bases);                                    \
    }
ROUTE_KERNEL(4)
ROUTE_KERNEL(8)
ROUTE_KERNEL(16)
ROUTE_KERNEL(32)

// Lane-local best of a warp's values v[c] (expert lane + 32c, c < 32) not
// yet taken (NEG_INF), then across the warp: the largest value, ties to the
// lower index; every lane ends with the same (value, index, payload).
__device__ __forceinline__ void warp_argmax(const float (&v)[32], const float (&pay)[32], float& bv, int& bi,
                                           float& bp) {
    int lane = threadIdx.x & 31;
    bv = NEG_INF;
    bi = 0x7fffffff;
    bp = 0.0f;
#pragma unroll
    for (int c = 0; c < 32; c++)
        if (v[c] > bv) {
            bv = v[c];
            bi = lane + c * WARP;
            bp = pay[c];
        }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        float op = __shfl_xor_sync(0xffffffffu, bp, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
            bp = op;
        }
    }
}

// DeepSeek-V3 `noaux_tc` router, as model/router.rs: per token s =
// sigmoid(logit), b = s + bias (for the choice only); with n_group > 1 a
// group's score is the sum of its two largest b, the topk_group best groups
// are kept (ties to the lower index) and every b of the others becomes 0.0
// (as mlx-lm); the k largest b (ties to the lower index) are the experts,
// weighted by their s, divided by the sum of those in choice order when
// `norm`, times `scaling`; with `table`, each expert's address into bases.
// A warp per token, 4 warps per block; e <= 1024, n_group <= 32 (a lane per
// group), k <= 32. Valid b are finite, so NEG_INF marks taken or absent.
extern "C" __global__ void moe_route_noaux(const float* logits, const float* bias, int n, int e, int k,
                                           int n_group, int topk_group, int norm, float scaling,
                                           const unsigned long long* table, int* ids, float* wts,
                                           unsigned long long* bases) { PDL_ENTER();
    __shared__ float sb[4][1024];
    int wi = threadIdx.x >> 5;
    int t = blockIdx.x * (blockDim.x >> 5) + wi;
    if (t >= n) return;
    int lane = threadIdx.x & 31;
    const float* l = logits + (long)t * e;
    float s[32], b[32];
#pragma unroll
    for (int c = 0; c < 32; c++) {
        int i = lane + c * WARP;
        s[c] = i < e ? sigmoidf_(l[i]) : 0.0f;
        b[c] = i < e ? s[c] + bias[i] : NEG_INF;
    }
    if (n_group > 1) {
        int per = e / n_group;
        float* sw = sb[wi];
#pragma unroll
        for (int c = 0; c < 32; c++)
            if (lane + c * WARP < e) sw[lane + c * WARP] = b[c];
        __syncwarp();
        // Lane g: group g's two largest (the second may equal the first).
        float gv[32], none[32];
#pragma unroll
        for (int c = 0; c < 32; c++) gv[c] = none[c] = NEG_INF;
        if (lane < n_group) {
            float m1 = NEG_INF, m2 = NEG_INF;
            for (int j = 0; j < per; j++) {
                float x = sw[lane * per + j];
                if (x > m1) {
                    m2 = m1;
                    m1 = x;
                } else if (x > m2) {
                    m2 = x;
                }
            }
            gv[0] = m1 + m2;
        }
        unsigned keep = 0;
        for (int j = 0; j < topk_group; j++) {
            float bv, bp;
            int bi;
            warp_argmax(gv, none, bv, bi, bp);
            if (bi < 32) keep |= 1u << bi;
            if (lane == bi) gv[0] = NEG_INF;
        }
#pragma unroll
        for (int c = 0; c < 32; c++) {
            int i = lane + c * WARP;
            if (i < e && !((keep >> (i / per)) & 1u)) b[c] = 0.0f;
        }
    }
    float chosen = 0.0f, myw = 0.0f;
    int myid = 0;
    for (int j = 0; j < k; j++) {
        float bv, bs;
        int bi;
        warp_argmax(b, s, bv, bi, bs);
        if (lane == j) {
            myw = bs;
            myid = bi < e ? bi : 0;  // only NaN logits leave nothing to pick
        }
        chosen += bs;
#pragma unroll
        for (int c = 0; c < 32; c++)
            if (lane + c * WARP == bi) b[c] = NEG_INF;
    }
    if (lane < k) {
        float w = norm ? myw / chosen : myw;
        ids[(long)t * k + lane] = myid;
        wts[(long)t * k + lane] = w * scaling;
        if (table) bases[(long)t * k + lane] = table[myid];
    }
}

// Per (token, slot) expert work, for decode: slot j = token * k + jj uses
// the expert at bases[j]. act[j] = silu(gate x) * (up x); a warp per RW
// intermediate rows, blockIdx.y = slot.
template <int BITS>
__device__ void moe_gate_up_slots_body(const unsigned long long* bases, ExpertLayout L, int k,
                                       const float* x, float* act) {
    int j = blockIdx.y;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const char* base = (const char*)bases[j];
    QW gq = expert_qw(base, L.gate_w, L.gate_s, L.gate_b, L.inter, L.hidden, L);
    QW uq = expert_qw(base, L.up_w, L.up_s, L.up_b, L.inter, L.hidden, L);
    int parts = col_split(gq, 1), part = w % parts;
    int r0 = (blockIdx.x * (8 / parts) + w / parts) * RW;
    bool active = r0 < L.inter;
    const float* xp[1] = {x + (long)(j / k) * L.hidden};
    float ga[RW][1], ua[RW][1];
    if (active) {
        qrows<BITS, 1>(gq, r0, xp, 1, ga, part, parts);
        qrows<BITS, 1>(uq, r0, xp, 1, ua, part, parts);
    }
    reduce_parts<1>(ga, parts);
    reduce_parts<1>(ua, parts);
    if (active && part == 0)
#pragma unroll
        for (int rr = 0; rr < RW; rr++)
            if (lane == rr && r0 + rr < L.inter)
                act[(long)j * L.inter + r0 + rr] = expert_glu(L, j, r0 + rr, ga[rr][0], ua[rr][0]);
}

// slot_out[j] = down act[j]; blockIdx.y = slot.
template <int BITS>
__device__ void moe_down_slots_body(const unsigned long long* bases, ExpertLayout L, const float* act,
                                    float* slot_out) {
    int j = blockIdx.y;
    int w = threadIdx.x >> 5;
    QW dq = expert_qw((const char*)bases[j], L.down_w, L.down_s, L.down_b, L.hidden, L.inter, L);
    int parts = col_split(dq, 1), part = w % parts;
    int r0 = (blockIdx.x * (8 / parts) + w / parts) * RW;
    bool active = r0 < L.hidden;
    const float* xp[1] = {act + (long)j * L.inter};
    float acc[RW][1];
    if (active) qrows<BITS, 1>(dq, r0, xp, 1, acc, part, parts);
    reduce_parts<1>(acc, parts);
    if (active && part == 0 && L.bias_d)
#pragma unroll
        for (int rr = 0; rr < RW; rr++)
            if (r0 + rr < L.hidden) acc[rr][0] += expert_down_bias(L, j, r0 + rr);
    if (active && part == 0) store_rows<1>(acc, r0, L.hidden, 1, slot_out + (long)j * L.hidden, 0, nullptr, false);
}

// The same per-slot products with activations in registers (qmv_chunks):
// a warp takes NC/2 intermediate rows of gate and the same rows of up.
template <int BITS>
__device__ void moe_gate_up_qmv_body(const unsigned long long* bases, ExpertLayout L, int k, const float* x,
                                     float* act) {
    int j = blockIdx.y;
    const char* base = (const char*)bases[j];
    QW gq = expert_qw(base, L.gate_w, L.gate_s, L.gate_b, L.inter, L.hidden, L);
    QW uq = expert_qw(base, L.up_w, L.up_s, L.up_b, L.inter, L.hidden, L);
    QmvGeom G = qmv_geom(L.hidden, BITS);
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int part = w % G.parts;
    int rg = blockIdx.x * G.wpb + w / G.parts;
    float acc[QMV_NC];
    qmv_chunks<BITS, QMV_NC>(gq, uq, QMV_NC / 2, G, rg, part, x + (long)(j / k) * L.hidden, acc);
    if (!qmv_holds_sums(G)) return;
#pragma unroll
    for (int i = 0; i < QMV_NC / 2; i++) {
        int r = (rg * (QMV_NC / 2) + i) * G.rpc + lane / G.lpr;
        if (r < L.inter) act[(long)j * L.inter + r] = expert_glu(L, j, r, acc[i], acc[i + QMV_NC / 2]);
    }
}

template <int BITS>
__device__ void moe_down_qmv_body(const unsigned long long* bases, ExpertLayout L, const float* act,
                                  float* slot_out) {
    int j = blockIdx.y;
    QW dq = expert_qw((const char*)bases[j], L.down_w, L.down_s, L.down_b, L.hidden, L.inter, L);
    QmvGeom G = qmv_geom(L.inter, BITS);
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int part = w % G.parts;
    int rg = blockIdx.x * G.wpb + w / G.parts;
    float acc[QMV_NC];
    qmv_chunks<BITS, QMV_NC>(dq, dq, QMV_NC, G, rg, part, act + (long)j * L.inter, acc);
    if (!qmv_holds_sums(G)) return;
#pragma unroll
    for (int i = 0; i < QMV_NC; i++) {
        int r = (rg * QMV_NC + i) * G.rpc + lane / G.lpr;
        if (r < L.hidden) slot_out[(long)j * L.hidden + r] = acc[i] + expert_down_bias(L, j, r);
    }
}

// The per-slot products streamed (qmv_stream_sets): grid (blocks, slots),
// the blocks of a slot taking its row groups in turn, each group's weights
// requested while the previous group is computed. Rows with more slices
// than a row group has warps are not taken (the host checks: the _qmv
// kernels above take them). Gate and up: NC/2 intermediate rows of each
// per warp and set; down: NC hidden rows.
template <int BITS, int NC>
__device__ void moe_gate_up_stream_body(const unsigned long long* bases, ExpertLayout L, int k, const float* x,
                                        float* act) {
    constexpr int NA = NC / 2, EPL = 128 / code_bits(BITS);
    int j = blockIdx.y;
    const char* base = (const char*)bases[j];
    QW gq = expert_qw(base, L.gate_w, L.gate_s, L.gate_b, L.inter, L.hidden, L);
    QW uq = expert_qw(base, L.up_w, L.up_s, L.up_b, L.inter, L.hidden, L);
    QmvGeom G = qmv_geom(L.hidden, BITS);
    const QmvLane l = qmv_lane<BITS>(G);
    int per_set = NA * G.rpc * G.wpb;
    int nsets = (L.inter + per_set - 1) / per_set;
    auto row_group = [&](int set) { return (long)set * G.wpb + l.w / G.parts; };
    auto fetch = [&](int set, QmvFetch<NC>& f) {
        long rg = row_group(set);
#pragma unroll
        for (int i = 0; i < NC; i++)
            qmv_fetch_chunk<BITS, NC>(i < NA ? gq : uq, (rg * NA + i % NA) * G.rpc + l.rsub, l, G, f, i);
    };
    auto load = [&](float (&xv)[1][EPL], float (&xs)[1]) {
        xs[0] = qmv_load_acts<BITS, false>(x + (long)(j / k) * L.hidden, L.hidden, l.c0, l.cb >= 0, xv[0]);
    };
    auto store = [&](int set, float (&acc)[1][NC]) {
        long rg = row_group(set);
#pragma unroll
        for (int i = 0; i < NA; i++) {
            int r = (int)((rg * NA + i) * G.rpc + l.lane / G.lpr);
            if (r < L.inter) act[(long)j * L.inter + r] = expert_glu(L, j, r, acc[0][i], acc[0][i + NA]);
        }
    };
    qmv_stream_sets<BITS, NC, 1>(G, nsets, fetch, load, store);
}

template <int BITS, int NC>
__device__ void moe_down_stream_body(const unsigned long long* bases, ExpertLayout L, const float* act,
                                     float* slot_out) {
    constexpr int EPL = 128 / code_bits(BITS);
    int j = blockIdx.y;
    QW dq = expert_qw((const char*)bases[j], L.down_w, L.down_s, L.down_b, L.hidden, L.inter, L);
    QmvGeom G = qmv_geom(L.inter, BITS);
    const QmvLane l = qmv_lane<BITS>(G);
    int per_set = NC * G.rpc * G.wpb;
    int nsets = (L.hidden + per_set - 1) / per_set;
    auto row_group = [&](int set) { return (long)set * G.wpb + l.w / G.parts; };
    auto fetch = [&](int set, QmvFetch<NC>& f) {
        long rg = row_group(set);
#pragma unroll
        for (int i = 0; i < NC; i++) qmv_fetch_chunk<BITS, NC>(dq, (rg * NC + i) * G.rpc + l.rsub, l, G, f, i);
    };
    auto load = [&](float (&xv)[1][EPL], float (&xs)[1]) {
        xs[0] = qmv_load_acts<BITS, false>(act + (long)j * L.inter, L.inter, l.c0, l.cb >= 0, xv[0]);
    };
    auto store = [&](int set, float (&acc)[1][NC]) {
        long rg = row_group(set);
#pragma unroll
        for (int i = 0; i < NC; i++) {
            int r = (int)((rg * NC + i) * G.rpc + l.lane / G.lpr);
            if (r < L.hidden) slot_out[(long)j * L.hidden + r] = acc[0][i] + expert_down_bias(L, j, r);
        }
    };
    qmv_stream_sets<BITS, NC, 1>(G, nsets, fetch, load, store);
}

#define STREAM_SLOT_KERNELS(B, SFX, NC)                                                                     \
    extern "C" __global__ void __launch_bounds__(256) moe_gate_up_stream_##SFX(                            \
        const unsigned long long* bs, ExpertLayout L, int k, const float* x, float* a) {                   \
        PDL_ENTER(); /* the bases are the router's: wait before any read */                                \
        if (bs[blockIdx.y] == 0) return; /* a slot the host computes */                                    \
        moe_gate_up_stream_body<B, NC>(bs, L, k, x, a);                                                     \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256) moe_down_stream_##SFX(                               \
        const unsigned long long* bs, ExpertLayout L, const float* a, float* y) {                          \
        PDL_ENTER();                                                                                        \
        if (bs[blockIdx.y] == 0) return;                                                                    \
        moe_down_stream_body<B, NC>(bs, L, a, y);                                                           \
    }
#ifndef MX_STREAM_NC
// Chunks per warp and set of the MXFP4 ones (MX_STREAM_CHUNKS in moe.rs): with
// two, twice the blocks fit an SM (the integer dot's registers), and on the
// H200 gpt-oss's experts read 15% faster than with four.
#define MX_STREAM_NC 2
#endif
STREAM_SLOT_KERNELS(4, b4, QMV_STREAM_NC)
STREAM_SLOT_KERNELS(8, b8, QMV_STREAM_NC)
STREAM_SLOT_KERNELS(MXI, mx, MX_STREAM_NC)

#define QMV_SLOT_KERNELS(B, SFX)                                                                            \
    extern "C" __global__ void __launch_bounds__(256) moe_gate_up_qmv_##SFX(                               \
        const unsigned long long* bs, ExpertLayout L, int k, const float* x, float* a) {                   \
        PDL_ENTER();                                                                                        \
        if (bs[blockIdx.y] == 0) return; /* a slot the host computes */                                    \
        moe_gate_up_qmv_body<B>(bs, L, k, x, a);                                                            \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256) moe_down_qmv_##SFX(                                  \
        const unsigned long long* bs, ExpertLayout L, const float* a, float* y) {                          \
        PDL_ENTER();                                                                                        \
        if (bs[blockIdx.y] == 0) return;                                                                    \
        moe_down_qmv_body<B>(bs, L, a, y);                                                                  \
    }
QMV_SLOT_KERNELS(4, b4)
QMV_SLOT_KERNELS(8, b8)
QMV_SLOT_KERNELS(2, b2)
QMV_SLOT_KERNELS(MXB, mx)

#define SLOT_KERNELS(B, SFX)                                                                          \
    extern "C" __global__ void moe_gate_up_slots_##SFX(const unsigned long long* bs, ExpertLayout L,  \
                                                       int k, const float* x, float* a) { PDL_ENTER();             \
        if (bs[blockIdx.y] == 0) return; /* a slot the host computes */                               \
        moe_gate_up_slots_body<B>(bs, L, k, x, a);                                                    \
    }                                                                                                 \
    extern "C" __global__ void moe_down_slots_##SFX(const unsigned long long* bs, ExpertLayout L,     \
                                                    const float* a, float* y) { PDL_ENTER();                       \
        if (bs[blockIdx.y] == 0) return;                                                              \
        moe_down_slots_body<B>(bs, L, a, y);                                                          \
    }
SLOT_KERNELS(4, b4)
SLOT_KERNELS(8, b8)
SLOT_KERNELS(2, b2)
SLOT_KERNELS(0, bx)
SLOT_KERNELS(MXB, mx)

// --------------------------------------------------------------------------
// Bandwidth probe: reads n 16-byte words; the sum is written only if it is
// impossible (keeps the loads).
extern "C" __global__ void read_probe(const uint4* p, long n, u32* sink) { PDL_ENTER();
    u32 acc = 0;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        uint4 v = p[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) *sink = acc;
}
