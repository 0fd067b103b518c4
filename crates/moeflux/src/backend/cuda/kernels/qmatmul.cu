// The general quantized products (any width and group size, 1-64 tokens).

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
// (q/k/v, the GatedDeltaNet projections, router + shared expert; struct
// MultiMatmul in abi.cuh): out_m[t*rows_m + r] (+)= W_m[r] . x[t] for t < n.
// A block of 8 warps covers 32 rows of the concatenated row space, tokens
// four at a time. Bit `m` of `accumulate` adds to out_m instead of
// overwriting it (residual connections).
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
