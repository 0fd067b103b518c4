// moeflux CUDA kernels of multi-head latent attention (DeepSeek-V3 family),
// after the common parts in all.cuh (they use their helpers).
// The absorbed form of model/mla.rs, launched by backend/cuda/mla.rs:
//
//   mla_prep        latent norm + rotary key into the cache, rotary queries
//   qmatmul_heads*, per-head products: q_nope -> latent space (embed_q),
//   qmv_heads_b*    attended latent -> values (unembed_out)
//   mla_attention   scores against the cached latents, softmax, weighted sum

// --------------------------------------------------------------------------
// Per-head quantized products

// out[t * rows + r] = W[r] . x_t,h for the rows r of head h = r / rph, whose
// input for token t is x + t * x_tok + h * x_head. rph is a multiple of RW
// (the host checks), so the rows of a warp share a head. Otherwise as
// qmatmul_body: 8 warps of RW rows per block, tokens TT at a time.
template <int TT>
__device__ __forceinline__ void qmatmul_heads_body(const QW& q, const float* x, long x_tok, long x_head,
                                                   int rph, int n, float* out) {
    int parts = col_split(q, TT), w = threadIdx.x >> 5;
    int part = w % parts;
    int r0 = (blockIdx.x * (8 / parts) + w / parts) * RW;
    bool active = r0 < q.rows;
    long xo = (long)(r0 / rph) * x_head;
    for (int t0 = blockIdx.y * TT; t0 < n; t0 += gridDim.y * TT) {
        int nt = min(TT, n - t0);
        const float* xp[TT];
#pragma unroll
        for (int t = 0; t < TT; t++) xp[t] = x + (long)(t0 + min(t, nt - 1)) * x_tok + xo;
        float acc[RW][TT];
        if (active) qrows_any<TT>(q, r0, xp, nt, acc, part, parts);
        reduce_parts<TT>(acc, parts);
        if (active && part == 0)
            store_rows<TT>(acc, r0, q.rows, nt, out + (long)t0 * q.rows, q.rows, nullptr, false);
    }
}

// Tokens four at a time (prefill).
extern "C" __global__ void __launch_bounds__(256) qmatmul_heads(QW q, const float* x, long x_tok, long x_head,
                                                                int rph, int n, float* out) {
    PDL_ENTER();
    qmatmul_heads_body<4>(q, x, x_tok, x_head, rph, n, out);
}
// One token (decode).
extern "C" __global__ void __launch_bounds__(256, 4) qmatmul_heads1(QW q, const float* x, long x_tok,
                                                                    long x_head, int rph, int n, float* out) {
    PDL_ENTER();
    qmatmul_heads_body<1>(q, x, x_tok, x_head, rph, n, out);
}

// One token with the activations in registers (qmv_chunks of qmv.cu):
// a warp's row group (QMV_NC chunks of G.rpc rows) lies inside one head, as
// the host checks (rph a multiple of its rows), so the warp reads that
// head's input x + h * x_head for all of them.
template <int BITS>
__device__ __forceinline__ void qmv_heads_body(const QW& q, const float* x, long x_head, int rph, float* out) {
    QmvGeom G = qmv_geom(q.cols, BITS);
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int part = w % G.parts;
    int rg = blockIdx.x * G.wpb + w / G.parts;
    // Row groups past the last row still load activations: keep them in range.
    int head = min(rg * QMV_NC * G.rpc / rph, q.rows / rph - 1);
    float acc[QMV_NC];
    qmv_chunks<BITS, QMV_NC>(q, q, QMV_NC, G, rg, part, x + (long)head * x_head, acc);
    if (!qmv_holds_sums(G)) return;
#pragma unroll
    for (int i = 0; i < QMV_NC; i++) {
        int r = (rg * QMV_NC + i) * G.rpc + lane / G.lpr;
        if (r < q.rows) out[r] = acc[i];
    }
}

#define QMV_HEADS_KERNEL(B)                                                                               \
    extern "C" __global__ void __launch_bounds__(256)                                                     \
        qmv_heads_b##B(QW q, const float* x, long x_head, int rph, float* out) {                          \
        PDL_ENTER();                                                                                      \
        qmv_heads_body<B>(q, x, x_head, rph, out);                                                        \
    }
QMV_HEADS_KERNEL(4)
QMV_HEADS_KERNEL(8)
QMV_HEADS_KERNEL(2)

// --------------------------------------------------------------------------
// Cache and rotary inputs

// Rotates interleaved pairs (2i, 2i+1) of src into dst (may be src), both
// channels scaled by mscale first, angle p * inv_freq[i] in f64: YarnRoPE as
// model/yarn.rs, products rounded one by one like the CPU (no contraction).
__device__ __forceinline__ void rope_interleaved(const float* src, float* dst, int half, double p,
                                                 const double* inv_freq, float mscale) {
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double ang = p * inv_freq[i];
        float c = (float)cos(ang), s = (float)sin(ang);
        float a = __fmul_rn(src[2 * i], mscale), b = __fmul_rn(src[2 * i + 1], mscale);
        dst[2 * i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        dst[2 * i + 1] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    }
}

// Token t (blockIdx.y) at position *pos + t; kv[t] = [latent (kvl) | shared
// rotary key (r)], q[t] = heads x [nope | rotary (r)]. Block x = 0 writes the
// latent cache row (RMSNorm with weight kv_norm and eps) and the rotary
// cache row (the rotated key); block x = 1 + h rotates query head h's rotary
// part in place.
extern "C" __global__ void mla_prep(const float* kv, float* q, const float* kv_norm, const double* inv_freq,
                                    int nh, int kvl, int r, int qhd, int nope, float eps, float mscale,
                                    const long* pos, double pos_scale, float* lat, float* rope) {
    PDL_ENTER();
    int t = blockIdx.y, h = blockIdx.x;
    long p = *pos + t;
    double angle = (double)p * pos_scale;
    if (h == 0) {
        const float* src = kv + (long)t * (kvl + r);
        float ss = 0.0f;
        for (int i = threadIdx.x; i < kvl; i += blockDim.x) ss += src[i] * src[i];
        ss = block_sum(ss);
        float inv = 1.0f / sqrtf(ss / kvl + eps);
        for (int i = threadIdx.x; i < kvl; i += blockDim.x) lat[p * kvl + i] = src[i] * inv * kv_norm[i];
        rope_interleaved(src + kvl, rope + p * r, r / 2, angle, inv_freq, mscale);
    } else {
        float* x = q + ((long)t * nh + (h - 1)) * qhd + nope;
        rope_interleaved(x, x, r / 2, angle, inv_freq, mscale);
    }
}

// --------------------------------------------------------------------------
// Attention in latent space

#define MLA_LAT 16   // latent channels per lane: kv_lora_rank <= 512 (MAX_KV_LORA in mla.rs)
#define MLA_ROPE 4   // rotary channels per lane: qk_rope_head_dim <= 128 (MAX_ROPE)
#define MLA_WARPS 8  // warps per block (the host sizes shared memory for them)

// Token t of the chunk (blockIdx.y; position *pos + t0 + t), head h
// (blockIdx.x): score_p = scale * (qa[t,h] . lat[p] + q[t,h,nope:] . rope[p])
// over cache rows p = 0 ..= that position, out[t,h] = sum_p softmax_p lat[p].
// Each warp keeps an online softmax over positions w, w + 8, ...; lane l
// holds channels l + 32c. Dynamic shared memory: MLA_WARPS x kvl floats.
extern "C" __global__ void __launch_bounds__(256) mla_attention(const float* qa, const float* q, const float* lat,
                                                                const float* rope, int nh, int kvl, int r,
                                                                int qhd, int nope, const long* pos, int t0,
                                                                float scale, float* out) {
    PDL_ENTER();
    extern __shared__ float sacc[];
    __shared__ float sm[MLA_WARPS], sl[MLA_WARPS];
    int h = blockIdx.x, t = blockIdx.y;
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* qh = qa + ((long)t * nh + h) * kvl;
    const float* qr = q + ((long)t * nh + h) * qhd + nope;
    float qv[MLA_LAT], acc[MLA_LAT], qp[MLA_ROPE];
#pragma unroll
    for (int c = 0; c < MLA_LAT; c++) {
        int ch = lane + c * WARP;
        qv[c] = ch < kvl ? qh[ch] : 0.0f;
        acc[c] = 0.0f;
    }
#pragma unroll
    for (int c = 0; c < MLA_ROPE; c++) {
        int ch = lane + c * WARP;
        qp[c] = ch < r ? qr[ch] : 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    long ctx = *pos + t0 + t + 1;
    for (long p = w; p < ctx; p += MLA_WARPS) {
        const float* lr = lat + p * kvl;
        const float* rr = rope + p * r;
        float lv[MLA_LAT];
        float d = 0.0f;
#pragma unroll
        for (int c = 0; c < MLA_LAT; c++) {
            int ch = lane + c * WARP;
            lv[c] = ch < kvl ? lr[ch] : 0.0f;
            d = fmaf(qv[c], lv[c], d);
        }
#pragma unroll
        for (int c = 0; c < MLA_ROPE; c++) {
            int ch = lane + c * WARP;
            if (ch < r) d = fmaf(qp[c], rr[ch], d);
        }
        d = warp_sum(d) * scale;
        float mn = fmaxf(m, d);
        float corr = expf(m - mn), e = expf(d - mn);
        l = l * corr + e;
#pragma unroll
        for (int c = 0; c < MLA_LAT; c++) acc[c] = fmaf(e, lv[c], acc[c] * corr);
        m = mn;
    }
    if (lane == 0) {
        sm[w] = m;
        sl[w] = l;
    }
#pragma unroll
    for (int c = 0; c < MLA_LAT; c++) {
        int ch = lane + c * WARP;
        if (ch < kvl) sacc[w * kvl + ch] = acc[c];
    }
    __syncthreads();
    // Warps that saw no position (short contexts) hold m = -inf: weight 0.
    float M = NEG_INF;
#pragma unroll
    for (int i = 0; i < MLA_WARPS; i++) M = fmaxf(M, sm[i]);
    float f[MLA_WARPS], L = 0.0f;
#pragma unroll
    for (int i = 0; i < MLA_WARPS; i++) {
        f[i] = sm[i] == NEG_INF ? 0.0f : expf(sm[i] - M);
        L += sl[i] * f[i];
    }
    float* o = out + ((long)t * nh + h) * kvl;
    for (int ch = threadIdx.x; ch < kvl; ch += blockDim.x) {
        float v = 0.0f;
#pragma unroll
        for (int i = 0; i < MLA_WARPS; i++) v += sacc[i * kvl + ch] * f[i];
        o[ch] = v / L;
    }
}
