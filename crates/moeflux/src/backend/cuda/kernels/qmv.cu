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

// Bits of a code: the BITS of an instantiation, 4 for MXFP4 and B4Q8.
__host__ __device__ constexpr int code_bits(int bits) { return bits < 0 ? 4 : bits; }

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

// 8-bit activations, the CPU's `--cpu-activations q8` contract
// (backend/cpu/qmatmul/q8.rs): a lane's chunk of 4-bit codes covers 32
// columns, one block, whose activations become dx * xq with dx = max|x| /
// 127 and xq = round(x * (127 / max|x|)), half away from zero as Rust's
// `round` (here trunc(y + copysign(0.49999997, y)), the CPU's AVX2 form,
// unfused), 0 for a zero block. xv[0..4) takes the xq of the even columns of
// each code word (byte j of xv[k]: column 8k + 2j), xv[4..8) the odd ones,
// the order in which a word's nibbles masked in place (w & 0x0F0F0F0F,
// (w >> 4) & 0x0F0F0F0F) meet them in dp4a; xv[8] = dx, NaN when the sum
// of the block's activations (xs, which the biases take) is not finite, so
// a NaN or an infinity makes the dot NaN as a float dot would. The maximum
// is a tree, so the lane's first dot waits a few steps, not 32. The
// integer sum is exact, so against the CPU's q8 only the order of the float
// sums over blocks differs (and an activation within an f32 rounding of a
// half between two codes).
// One activation's code: round(v * inv) half away from zero, unfused.
__device__ __forceinline__ u32 q8_code(float v, float inv) {
    float y = __fmul_rn(v, inv);
    return (u32)__float2int_rz(__fadd_rn(y, copysignf(0.49999997f, y)));
}
// The low bytes of four codes as one int32's bytes 0..3.
__device__ __forceinline__ u32 q8_pack4(u32 a, u32 b, u32 c, u32 d) {
    return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

__device__ __forceinline__ void q8_prep(float* xv, float xs) {
    float m[16];
#pragma unroll
    for (int i = 0; i < 16; i++) m[i] = fmaxf(fabsf(xv[2 * i]), fabsf(xv[2 * i + 1]));
#pragma unroll
    for (int w = 8; w > 0; w >>= 1)
#pragma unroll
        for (int i = 0; i < w; i++) m[i] = fmaxf(m[i], m[i + w]);
    float inv = m[0] > 0.0f ? 127.0f / m[0] : 0.0f;
    u32 q[32];
#pragma unroll
    for (int i = 0; i < 32; i++) q[i] = q8_code(xv[i], inv);
#pragma unroll
    for (int k = 0; k < 4; k++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const u32* c = q + 8 * k + h;  // columns 8k + h, + 2, + 4, + 6
            xv[4 * h + k] = __uint_as_float(q8_pack4(c[0], c[2], c[4], c[6]));
        }
    xv[8] = m[0] / 127.0f + xs * 0.0f;
}

// A chunk's 32 codes dotted with q8_prep's activations: dx * sum(code * xq).
__device__ __forceinline__ float q8_dot(const uint4& wv, const float* xv) {
    int s = 0;
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        u32 word = kk == 0 ? wv.x : kk == 1 ? wv.y : kk == 2 ? wv.z : wv.w;
        s = dp4a_us(word & 0x0F0F0F0Fu, __float_as_uint(xv[kk]), s);
        s = dp4a_us((word >> 4) & 0x0F0F0F0Fu, __float_as_uint(xv[4 + kk]), s);
    }
    return (float)s * xv[8];
}

// A chunk's codes dotted with the lane's activations (as chunk_dot; MXFP4
// codes as twice their values, plain activations or mx_int_prep's digits).
template <int BITS>
__device__ __forceinline__ float chunk_dot_any(const uint4& wv, const float* xv) {
    if constexpr (BITS == MXB) return mx_chunk_dot(wv, xv);
    else if constexpr (BITS == MXI) return mx_int_dot(wv, xv);
    else if constexpr (BITS == B4Q8) return q8_dot(wv, xv);
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
    } else if constexpr (BITS == B4Q8) {
        q8_prep(xv, xs);
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
    constexpr int EPL = 128 / code_bits(BITS);
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
// SwiGLU of [gate | up] (an MLP's down product). `b4q8`: 4-bit codes with
// 8-bit activations (B4Q8).
#define QMV_KERNEL(NAME, B, NC, GLU)                                                              \
    extern "C" __global__ void __launch_bounds__(256) NAME(MultiMatmul mm, const float* x) {      \
        PDL_TRIGGER();                                                                            \
        qmv_stream_body<B, NC, GLU>(mm, x);                                                       \
    }
#define QMV_KERNELS(SFX, B)                             \
    QMV_KERNEL(qmv_##SFX, B, QMV_STREAM_NC, false)      \
    QMV_KERNEL(qmv_##SFX##_nc2, B, 2, false)            \
    QMV_KERNEL(qmv_##SFX##_glu, B, QMV_STREAM_NC, true) \
    QMV_KERNEL(qmv_##SFX##_nc2_glu, B, 2, true)
QMV_KERNELS(b4, 4)
QMV_KERNELS(b8, 8)
QMV_KERNELS(b2, 2)
QMV_KERNELS(b4q8, B4Q8)

// A few tokens (the decode steps of several sequences): QMV_TOKENS per
// blockIdx.y, two chunks per warp and set (the activations of four tokens
// take the registers), 4- and 8-bit codes, plain inputs.
#define QMV_TOKENS 4
#define QMV_MULTI_KERNEL(SFX, B)                                                                   \
    extern "C" __global__ void __launch_bounds__(256, 1) qmv_##SFX##_t4(MultiMatmul mm, const float* x, int n) { \
        PDL_TRIGGER();                                                                             \
        qmv_stream_body<B, 2, false, QMV_TOKENS>(mm, x, n);                                        \
    }
QMV_MULTI_KERNEL(b4, 4)
QMV_MULTI_KERNEL(b8, 8)
QMV_MULTI_KERNEL(b4q8, B4Q8)

// A group of 4- and 8-bit matrices in one launch (a MoE block's 8-bit
// router and gate with its 4-bit shared expert): the width is chosen per
// block. B4: how the 4-bit matrices are dotted (4, or B4Q8 for `qmv_b48q8`;
// the 8-bit ones keep f32 activations either way).
template <int NC, int B4>
__device__ __forceinline__ void qmv_b48_body(const MultiMatmul& mm, const float* x) {
    int m = set_matrix(mm, blockIdx.x);
    if (mm.q[m].bits == 8)
        qmv_body<8, NC, false>(mm, m, blockIdx.x, x);
    else
        qmv_body<B4, NC, false>(mm, m, blockIdx.x, x);
}
#define QMV_B48_KERNEL(NAME, NC, B4)                                                         \
    extern "C" __global__ void __launch_bounds__(256) NAME(MultiMatmul mm, const float* x) { \
        PDL_TRIGGER();                                                                       \
        qmv_b48_body<NC, B4>(mm, x);                                                         \
    }
QMV_B48_KERNEL(qmv_b48, QMV_NC, 4)
QMV_B48_KERNEL(qmv_b48_nc2, 2, 4)
QMV_B48_KERNEL(qmv_b48q8, QMV_NC, B4Q8)
QMV_B48_KERNEL(qmv_b48q8_nc2, 2, B4Q8)

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
