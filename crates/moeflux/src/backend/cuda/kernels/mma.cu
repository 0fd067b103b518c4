// Tensor-core products of many tokens (prefill), sm_80 and later
//
// y[t][r] = sum_g scale[r][g] * (q[r][g] . x[t][g]) + bias[r][g] * sum(x[t][g])
// (the CPU's FMA form), with q . x on the tensor cores (mma.sync
// m16n8k16, bf16 in, f32 out). The integer codes are exact in bf16; x
// enters as two bf16 halves, hi = bf16(x) and lo = bf16(x - hi), whose
// products go to the same accumulator, so x keeps 16 of its 24 bits. Group
// sums and the scale / bias terms are f32.
//
// An mma sums over k, and lane t of a quad supplies k = 2t, 2t+1, 2t+8,
// 2t+9 of each 16-wide step. Only the sum matters, so lane t takes its
// codes from one contiguous chunk of each group (C = gs / 4 columns: a
// group is four chunks, one per t) and the activations are stored permuted
// to match (mma_split). A lane then loads its codes as whole words and
// unpacks two at a time: column c and c + 4 of an 8-column block sit 16 bits
// apart in a 4-bit word (one LOP3 makes a bf16 pair).
//
// Chunk layout, S = C / 4 steps: pair p in [0, 2S) is columns
// (col(p), col(p) + 4), col(p) = 8 (p / 4) + p % 4; step s takes pair s for
// k = 2t, 2t+1 and pair S + s for k = 2t+8, 2t+9.

__device__ __forceinline__ int mma_pair_col(int p) { return 8 * (p >> 2) + (p & 3); }

// bf16 of x, rounded to nearest even (finite x).
__device__ __forceinline__ u32 bf16_rn(float x) {
    u32 u = __float_as_uint(x);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// {hi(v0, v1), hi(v2, v3), lo(v0, v1), lo(v2, v3)}: bf16 pairs, the low
// half first, with hi + lo = v to about 16 bits.
__device__ __forceinline__ uint4 split_hilo4(float v0, float v1, float v2, float v3) {
    float v[4] = {v0, v1, v2, v3};
    u32 hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 4; e++) {
        hi[e] = bf16_rn(v[e]);
        lo[e] = bf16_rn(v[e] - __uint_as_float(hi[e] << 16));
    }
    return make_uint4(hi[0] | (hi[1] << 16), hi[2] | (hi[3] << 16), lo[0] | (lo[1] << 16), lo[2] | (lo[3] << 16));
}

// One pair as {hi, lo} (bf16x2 each).
__device__ __forceinline__ void split_hilo2(float a, float b, u32& hi, u32& lo) {
    u32 ha = bf16_rn(a), hb = bf16_rn(b);
    hi = ha | (hb << 16);
    lo = bf16_rn(a - __uint_as_float(ha << 16)) | (bf16_rn(b - __uint_as_float(hb << 16)) << 16);
}

// d += a . b for one 16x8x16 tile (bf16 in, f32 accumulate).
__device__ __forceinline__ void mma_bf16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#elif defined(__CUDA_ARCH__)
    __trap();  // the host never picks these kernels below sm_80
#elif defined(EMU_MMA)
    emu_mma_bf16(d, a0, a1, a2, a3, b0, b1);
#endif
}

// Two codes as a bf16 pair (low half: the first): pair i of an 8-column
// block whose codes are in `w` (4-bit: one word; 8-bit: w[0], w[1]).
template <int BITS>
__device__ __forceinline__ u32 mma_code_pair(const u32* w, int i) {
    if (BITS == 4) {
        // 128 + code in both halves (the code in the mantissa of bf16 128),
        // then 1 * v - 128: exact.
        u32 v;
#if defined(__CUDA_ARCH__)
        u32 mask = 0x000f000fu, magic = 0x43004300u;
        asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(v) : "r"(w[0] >> (4 * i)), "r"(mask), "r"(magic));
#if __CUDA_ARCH__ >= 800
        u32 one = 0x3f803f80u, m128 = 0xc300c300u;
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(v) : "r"(v), "r"(one), "r"(m128));
#endif
        return v;
#else
        v = ((w[0] >> (4 * i)) & 0x000f000fu);  // the codes themselves
        return (bf16_rn((float)(v & 0xffffu))) | (bf16_rn((float)(v >> 16)) << 16);
#endif
    } else {
        // Codes up to 255 are exact in bf16: the high half of their f32.
        float a = __uint_as_float(0x4b000000u | ((w[0] >> (8 * i)) & 0xffu)) - 8388608.0f;
        float b = __uint_as_float(0x4b000000u | ((w[1] >> (8 * i)) & 0xffu)) - 8388608.0f;
        return (__float_as_uint(a) >> 16) | (__float_as_uint(b) & 0xffff0000u);
    }
}

// MXFP4: pair i of an 8-column block (codes i and i + 4, twice their
// values) from the block's biased bytes (mx_bytes: codes 0-3 in r0, 4-7 in
// r1): bf16 128 + b in both halves (b <= 24 sits in the mantissa), then
// 1 * v - 140 = b - 12, exact.
__device__ __forceinline__ u32 mma_mx_pair(u32 r0, u32 r1, int i) {
#if defined(__CUDA_ARCH__)
    u32 v = __byte_perm(r0, r1, (u32)(i | ((4 + i) << 8)));  // bytes 0 and 2: r0's i, r1's i
    u32 mask = 0x001f001fu, magic = 0x43004300u;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(v) : "r"(v), "r"(mask), "r"(magic));
#if __CUDA_ARCH__ >= 800
    u32 one = 0x3f803f80u, m140 = 0xc30cc30cu;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(v) : "r"(v), "r"(one), "r"(m140));
#endif
    return v;
#else
    float a = (float)((r0 >> (8 * i)) & 0xffu) - 12.0f, b = (float)((r1 >> (8 * i)) & 0xffu) - 12.0f;
    return bf16_rn(a) | (bf16_rn(b) << 16);
#endif
}

// x[n][cols] (f32) into the permuted bf16 hi/lo layout the products read:
// per token, group and lane chunk, S uint4s {hi pair s, hi pair S+s, lo
// pair s, lo pair S+s}; and xs[n][cols / gs] = the group sums of x. A
// thread per uint4 (cols a multiple of gs, gs in {32, 64, 128}).
extern "C" __global__ void mma_split(const float* x, long n, int cols, int gs, uint4* xp, float* xs) {
    PDL_ENTER();
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    int per_group = gs / 4, S = gs / 16;
    long total = n * (cols / 4);
    long tok = i / (cols / 4);
    int j = (int)(i % (cols / 4));
    int g = j / per_group, within = j % per_group;
    int t = within / S, s = within % S;
    float sum = 0.0f;
    if (i < total) {
        const float* c = x + tok * cols + g * gs + t * (gs / 4);
        float v[4] = {c[mma_pair_col(s)], c[mma_pair_col(s) + 4], c[mma_pair_col(S + s)],
                      c[mma_pair_col(S + s) + 4]};
        sum = v[0] + v[1] + v[2] + v[3];
        xp[i] = split_hilo4(v[0], v[1], v[2], v[3]);
    }
    // The per_group threads of a group are consecutive and aligned.
    for (int o = per_group / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (i < total && within == 0) xs[tok * (cols / gs) + g] = sum;
}

// The words of a lane's chunk of row `row` in group `g`: C * BITS / 32 of
// them (16-byte aligned for 8 and more, 8 for 2, 4 for 1).
template <int N>
__device__ __forceinline__ void mma_load_words(const u32* p, u32 (&w)[N]) {
    if (N % 4 == 0) {
#pragma unroll
        for (int k = 0; k < N / 4; k++) {
            uint4 v = __ldg((const uint4*)p + k);
            w[4 * k] = v.x, w[4 * k + 1] = v.y, w[4 * k + 2] = v.z, w[4 * k + 3] = v.w;
        }
    } else if (N == 2) {
        uint2 v = __ldg((const uint2*)p);
        w[0] = v.x, w[1] = v.y;
    } else {
        w[0] = __ldg(p);
    }
}

// A warp's tile: MT 16-row tiles (tile m: rows row0[m] .. +15 of q[m],
// clamped to its rows) times NT 8-token tiles (the lane's token of tile n
// at xp_tok[n] / xs_tok[n], and its quad's tokens' group sums at
// xs_q[n][0..1]), summed over every group into acc (the mma C layout: c0,
// c1 row g tokens 2t, 2t+1; c2, c3 row g + 8). Tiles n >= nt_live are
// skipped. BITS 4 or 8, S = gs / 16; or MXB (MXFP4, S = 2): codes of 4
// bits looked up as twice their values, half the e8m0 scale, no bias term.
template <int BITS, int S, int MT, int NT>
__device__ __forceinline__ void mma_tile(const QW* const (&q)[MT], const int (&row0)[MT],
                                         const uint4* const (&xp_tok)[NT], const float* const (&xs_q)[NT][2],
                                         int nt_live, float (&acc)[MT][NT][4]) {
    constexpr bool MX = BITS == MXB;
    constexpr int CB = MX ? 4 : BITS;  // bits per code
    static_assert(!MX || S == 2, "MXFP4 groups are 32 columns");
    constexpr int C = 4 * S, WPC = C * CB / 32;  // columns and words of a lane's chunk
    int lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3;
    const int groups = q[0]->cols / (16 * S);
    const u32* wrow[MT][2];
    long prow[MT][2];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int r = min(row0[m] + gq + 8 * h, q[m]->rows - 1);
            wrow[m][h] = q[m]->w + (long)r * (q[0]->cols * CB / 32) + t * WPC;
            prow[m][h] = (long)r * groups;
        }
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[m][n][c] = 0.0f;
    for (int g = 0; g < groups; g++) {
        u32 w[MT][2][WPC];
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int h = 0; h < 2; h++) mma_load_words<WPC>(wrow[m][h] + (long)g * (4 * WPC), w[m][h]);
        // MXFP4: each word's codes as biased bytes, once for its four pairs.
        u32 mb[MT][2][MX ? WPC : 1][2];
        if constexpr (MX)
#pragma unroll
            for (int m = 0; m < MT; m++)
#pragma unroll
                for (int h = 0; h < 2; h++)
#pragma unroll
                    for (int j = 0; j < WPC; j++) mx_bytes(w[m][h][j], mb[m][h][j][0], mb[m][h][j][1]);
        float tmp[MT][NT][4];
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int c = 0; c < 4; c++) tmp[m][n][c] = 0.0f;
#pragma unroll
        for (int s = 0; s < S; s++) {
            // Pair p of the chunk lives in 8-column block p / 4: word p / 4
            // (4-bit) or words 2 (p / 4), +1 (8-bit).
            constexpr int WPB = CB / 4;  // words per 8-column block
            u32 a[MT][4];
#pragma unroll
            for (int m = 0; m < MT; m++) {
                if constexpr (MX) {
                    a[m][0] = mma_mx_pair(mb[m][0][s >> 2][0], mb[m][0][s >> 2][1], s & 3);
                    a[m][1] = mma_mx_pair(mb[m][1][s >> 2][0], mb[m][1][s >> 2][1], s & 3);
                    a[m][2] = mma_mx_pair(mb[m][0][(S + s) >> 2][0], mb[m][0][(S + s) >> 2][1], (S + s) & 3);
                    a[m][3] = mma_mx_pair(mb[m][1][(S + s) >> 2][0], mb[m][1][(S + s) >> 2][1], (S + s) & 3);
                } else {
                    a[m][0] = mma_code_pair<BITS>(&w[m][0][(s >> 2) * WPB], s & 3);
                    a[m][1] = mma_code_pair<BITS>(&w[m][1][(s >> 2) * WPB], s & 3);
                    a[m][2] = mma_code_pair<BITS>(&w[m][0][((S + s) >> 2) * WPB], (S + s) & 3);
                    a[m][3] = mma_code_pair<BITS>(&w[m][1][((S + s) >> 2) * WPB], (S + s) & 3);
                }
            }
#pragma unroll
            for (int n = 0; n < NT; n++) {
                if (n >= nt_live) break;
                uint4 b = xp_tok[n][(long)g * (4 * S) + t * S + s];
#pragma unroll
                for (int m = 0; m < MT; m++) {
                    mma_bf16(tmp[m][n], a[m][0], a[m][1], a[m][2], a[m][3], b.x, b.y);
                    mma_bf16(tmp[m][n], a[m][0], a[m][1], a[m][2], a[m][3], b.z, b.w);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < MT; m++) {
            float sc[2], bi[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if constexpr (MX) {
                    sc[h] = mx_half_scale(__ldg((const unsigned char*)q[m]->s + prow[m][h] + g));
                    bi[h] = 0.0f;
                } else {
                    sc[h] = qparam(q[m]->s, prow[m][h] + g, q[m]->sf32);
                    bi[h] = qparam(q[m]->b, prow[m][h] + g, q[m]->sf32);
                }
            }
#pragma unroll
            for (int n = 0; n < NT; n++) {
                if (n >= nt_live) break;
                if constexpr (MX) {
                    // (no bias term)
                    acc[m][n][0] += sc[0] * tmp[m][n][0];
                    acc[m][n][1] += sc[0] * tmp[m][n][1];
                    acc[m][n][2] += sc[1] * tmp[m][n][2];
                    acc[m][n][3] += sc[1] * tmp[m][n][3];
                } else {
                    float x0 = xs_q[n][0][g], x1 = xs_q[n][1][g];
                    acc[m][n][0] += sc[0] * tmp[m][n][0] + bi[0] * x0;
                    acc[m][n][1] += sc[0] * tmp[m][n][1] + bi[0] * x1;
                    acc[m][n][2] += sc[1] * tmp[m][n][2] + bi[1] * x0;
                    acc[m][n][3] += sc[1] * tmp[m][n][3] + bi[1] * x1;
                }
            }
        }
    }
}

// Which instantiation serves (bits, gs): the host only sends 4- and 8-bit
// matrices with groups of 32, 64 or 128 (mma_fits in linear.rs).
#define MMA_DISPATCH(BITS_, GS_, CALL)              \
    do {                                            \
        if ((BITS_) == 4) {                         \
            if ((GS_) == 64) CALL(4, 4);            \
            else if ((GS_) == 32) CALL(4, 2);       \
            else CALL(4, 8);                        \
        } else {                                    \
            if ((GS_) == 64) CALL(8, 4);            \
            else if ((GS_) == 32) CALL(8, 2);       \
            else CALL(8, 8);                        \
        }                                           \
    } while (0)

// The input rows the lane reads for 8-token tile nn from tok0 (count tokens;
// tok(i): a position's row; rows past the end read the last token, their
// results unused): its own token's (the B fragment's column) and its
// quad's two (the C fragment's columns).
template <class Tok>
__device__ __forceinline__ void mma_token_rows(int tok0, int nn, int count, Tok tok, long& mine, long& q0,
                                               long& q1) {
    int lane = threadIdx.x & 31;
    int c0 = min(tok0 + 8 * nn + 2 * (lane & 3), count - 1);
    mine = tok(min(tok0 + 8 * nn + (lane >> 2), count - 1));
    q0 = tok(c0);
    q1 = tok(min(c0 + 1, count - 1));
}

// mma_tile for tokens tok0 .. of `count` (see mma_token_rows) on
// mma_split's output, the matrices' width and group size (MXFP4 where MX_OK
// and mx).
template <int MT, int NT, bool MX_OK, class Tok>
__device__ __forceinline__ void mma_tokens(const QW* const (&q)[MT], const int (&row0)[MT], int tok0, int count,
                                           Tok tok, const uint4* xp, const float* xs, bool mx,
                                           float (&acc)[MT][NT][4]) {
    const int cols = q[0]->cols, gs = q[0]->gs;
    const uint4* xp_tok[NT];
    const float* xs_q[NT][2];
#pragma unroll
    for (int nn = 0; nn < NT; nn++) {
        long mine, q0, q1;
        mma_token_rows(tok0, nn, count, tok, mine, q0, q1);
        xp_tok[nn] = xp + mine * (cols / 4);
        xs_q[nn][0] = xs + q0 * (cols / gs);
        xs_q[nn][1] = xs + q1 * (cols / gs);
    }
    int live = min(NT, (count - tok0 + 7) / 8);
#define MMA_CALL(B, S) mma_tile<B, S, MT, NT>(q, row0, xp_tok, xs_q, live, acc)
    if constexpr (MX_OK) {
        if (mx) {
            MMA_CALL(MXB, 2);
            return;
        }
    }
    MMA_DISPATCH(q[0]->bits, gs, MMA_CALL);
#undef MMA_CALL
}

// Calls f(m, n, c, row, token) for every element acc[m][n][c] of a warp's
// tile, with the row and token it holds (the mma C layout: c0, c1 are row
// g, tokens 2t, 2t + 1; c2, c3 row g + 8).
template <int MT, int NT, class F>
__device__ __forceinline__ void mma_each(const int (&row0)[MT], int tok0, F f) {
    int lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nn = 0; nn < NT; nn++)
#pragma unroll
            for (int c = 0; c < 4; c++) f(mt, nn, c, row0[mt] + gq + 8 * (c >> 1), tok0 + 8 * nn + 2 * t + (c & 1));
}

