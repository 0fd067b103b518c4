// Causal attention of many tokens (prefill) on the tensor cores, sm_80+
//
// The function of `attention` (attention.cu) for n new tokens: per query head,
// softmax(q k^T * scale) v over the cache rows 0..pos+t, times
// sigmoid(gate) (not in attention_mma_plain). Both products are bf16
// mma.sync with every f32 operand as a hi + lo pair of bf16 (as mma.cu's
// activations), summing hi*hi + hi*lo +
// lo*hi: about 16 bits per operand (the lo*lo term is 2^-18 of a product),
// f32 accumulation, and an online softmax in f32 (FlashAttention-2).
//
// attn_kv_split writes the cache rows 0..ctx split, in the layouts the
// attention kernel copies to shared memory as they are (cp.async), then
// attention_mma: a block of 4 warps per 64 query rows, a row being a
// (token, head) pair of one KV group, tokens outer (so a batch of a few
// tokens still fills the tiles, and the group's heads share each K/V tile);
// 32 keys per step, the next step's keys in flight.
//
// The order of the k dimension of an mma is free as long as both operands
// use the same: in q k^T, lane t of a quad takes its four values of step s
// from one quarter of the head dims (t * hd/4 + 4s .. +3), so a lane's
// values are contiguous; in p v the keys are in the mma's own order (p
// comes from the accumulators of q k^T) and v is stored to match.

#define ATT_ROWS 64  // query rows per block
#define ATT_KT 32    // keys per step

// The cache rows 0..ctx of every KV group (caches: [row][nkv][hd] f32), split
// into ctx_pad rows (a multiple of ATT_KT; the rows past ctx zero, so masked
// keys meet finite values):
//   kp[g][key][t][s]      = split_hilo4 of dims t * hd/4 + 4s .. +3 of k
//   vp[g][key/16][d][t]   = split_hilo4 of v[., d] at keys 2t, 2t+1, 2t+8,
//                           2t+9 of the 16-key block (an mma B fragment)
// A thread per uint4; blockIdx.y: 0 for K, 1 for V.
extern "C" __global__ void attn_kv_split(const float* kc, const float* vc, int nkv, int hd, long ctx, long ctx_pad,
                                         uint4* kp, uint4* vp) {
    PDL_ENTER();
    long per = ctx_pad * hd / 4;  // uint4s per group
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= per * nkv) return;
    int g = (int)(i / per);
    long j = i % per;
    long row = (long)nkv * hd;
    if (blockIdx.y == 0) {
        int S = hd / 16;
        long key = j / (4 * S);
        int t = (int)(j / S % 4), s = (int)(j % S);
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (key < ctx) {
            float4 f = *(const float4*)(kc + key * row + (long)g * hd + t * (hd / 4) + 4 * s);
            v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
        }
        kp[i] = split_hilo4(v[0], v[1], v[2], v[3]);
    } else {
        long kb = j / (4 * hd);
        int d = (int)(j / 4 % hd), t = (int)(j % 4);
        long k0 = kb * 16 + 2 * t;
        long keys[4] = {k0, k0 + 1, k0 + 8, k0 + 9};
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; e++) v[e] = keys[e] < ctx ? vc[keys[e] * row + (long)g * hd + d] : 0.0f;
        vp[i] = split_hilo4(v[0], v[1], v[2], v[3]);
    }
}

// Dynamic shared memory of attention_mma for head dim `hd`, in uint4s: q
// (ATT_ROWS rows), then two buffers of k (ATT_KT rows) and of v. A row of q
// or k is four quarters of hd/16 uint4s plus one of padding, so the eight
// lanes of a quarter warp (two rows, four quarters) hit distinct banks.
#define ATT_QSTR(hd) ((hd) / 16 + 1)
#define ATT_SMEM_UINT4(hd) ((ATT_ROWS + 2 * ATT_KT) * 4 * ATT_QSTR(hd) + 2 * (ATT_KT / 16) * (hd) * 4)

template <int HD, bool GATED>
__device__ __forceinline__ void attention_mma_body(const float* q, const uint4* kp, const uint4* vp,
                                                   const float* gate, int nh, int nkv, long start, long ctx_pad,
                                                   int n, float scale, float* out) {
    constexpr int S = HD / 16;            // k-steps of q k^T (uint4s per quarter)
    constexpr int QSTR = ATT_QSTR(HD);    // uint4s per quarter in shared memory
    constexpr int RSTR = 4 * QSTR;        // per row
    constexpr int NT = HD / 8;            // output tiles of 8 dims
    constexpr int VT = (ATT_KT / 16) * HD * 4;  // uint4s of one v step
    extern __shared__ float att_smem[];
    uint4* qs = (uint4*)att_smem;
    uint4* ks = qs + ATT_ROWS * RSTR;
    uint4* vs = ks + 2 * ATT_KT * RSTR;
    int G = nh / nkv;
    int hg = G < ATT_ROWS ? G : ATT_ROWS;  // heads per block (the host checks divisibility)
    int qt = ATT_ROWS / hg;                // tokens per block
    int head_blocks = G / hg;
    int grp = blockIdx.y / head_blocks;
    int h0 = grp * G + (blockIdx.y % head_blocks) * hg;
    // The last tokens have the most keys: they start first.
    int t0 = (gridDim.x - 1 - blockIdx.x) * qt;
    int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, gq = lane >> 2, t = lane & 3;
    const uint4* kg = kp + (long)grp * ctx_pad * (HD / 4);
    const uint4* vg = vp + (long)grp * ctx_pad * (HD / 4);
    int last = min(t0 + qt, n);  // tokens t0..last-1 are real
    int steps = (int)((start + last + ATT_KT - 1) / ATT_KT);

    auto load_step = [&](int st, int buf) {
        const uint4* ksrc = kg + (long)st * ATT_KT * (4 * S);
        uint4* kdst = ks + buf * ATT_KT * RSTR;
        for (int i = tid; i < ATT_KT * 4 * S; i += 128) {
            int r = i / (4 * S), rest = i % (4 * S);
            cp_async16(kdst + r * RSTR + (rest / S) * QSTR + rest % S, ksrc + i);
        }
        const uint4* vsrc = vg + (long)st * VT;
        uint4* vdst = vs + buf * VT;
        for (int i = tid; i < VT; i += 128) cp_async16(vdst + i, vsrc + i);
    };
    load_step(0, 0);
    cp_async_commit();

    // q of the block's rows, split (once; rows past the batch repeat its last
    // token and are never stored).
    for (int i = tid; i < ATT_ROWS * 4 * S; i += 128) {
        int r = i / (4 * S), rest = i % (4 * S), qq = rest / S, s = rest % S;
        int tok = min(t0 + r / hg, n - 1), h = h0 + r % hg;
        float4 f = *(const float4*)(q + ((long)tok * nh + h) * HD + qq * (HD / 4) + 4 * s);
        qs[r * RSTR + qq * QSTR + s] = split_hilo4(f.x, f.y, f.z, f.w);
    }

    int ra = w * 16 + gq, rb = ra + 8;  // the lane's two rows
    long pa = start + min(t0 + ra / hg, n - 1), pb = start + min(t0 + rb / hg, n - 1);
    const float sl2 = scale * 1.4426950408889634f;  // scores in log2 units
    float o[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int c = 0; c < 4; c++) o[j][c] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    const uint4* qa = qs + ra * RSTR + t * QSTR;
    const uint4* qb = qs + rb * RSTR + t * QSTR;

    for (int st = 0; st < steps; st++) {
        int buf = st & 1;
        if (st + 1 < steps) load_step(st + 1, buf ^ 1);
        cp_async_commit();  // possibly empty: the wait below counts groups
        cp_async_wait<1>();
        __syncthreads();
        // Scores of the warp's 16 rows x 32 keys (tile j: keys 8j .. 8j+7).
        float sc[4][4];
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) sc[j][c] = 0.0f;
        const uint4* kb = ks + buf * ATT_KT * RSTR + gq * RSTR + t * QSTR;
#pragma unroll
        for (int s = 0; s < S; s++) {
            uint4 A = qa[s], B = qb[s];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                uint4 K = kb[j * 8 * RSTR + s];
                mma_bf16(sc[j], A.x, B.x, A.y, B.y, K.x, K.y);
                mma_bf16(sc[j], A.x, B.x, A.y, B.y, K.z, K.w);
                mma_bf16(sc[j], A.z, B.z, A.w, B.w, K.x, K.y);
            }
        }
        // Causal mask and the online softmax (rows a: c0, c1; b: c2, c3).
        long k0 = (long)st * ATT_KT;
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                long key = k0 + 8 * j + 2 * t + (c & 1);
                float v = key <= (c < 2 ? pa : pb) ? sc[j][c] * sl2 : NEG_INF;
                sc[j][c] = v;
                mx[c >> 1] = fmaxf(mx[c >> 1], v);
            }
        float corr[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            // Every row sees key 0 in the first step, so mx is finite.
            corr[r] = exp2f(m[r] - mx[r]);
            m[r] = mx[r];
            l[r] *= corr[r];
        }
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                float p = exp2f(sc[j][c] - m[c >> 1]);
                sc[j][c] = p;
                l[c >> 1] += p;
            }
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) o[j][c] *= corr[c >> 1];
        // o += p v, 16 keys per step: p's A fragment is the score tiles 2u
        // (keys 2t, 2t+1) and 2u + 1 (keys 2t+8, 2t+9) as they lie.
#pragma unroll
        for (int u = 0; u < ATT_KT / 16; u++) {
            u32 ph0, pl0, ph1, pl1, ph2, pl2, ph3, pl3;
            split_hilo2(sc[2 * u][0], sc[2 * u][1], ph0, pl0);
            split_hilo2(sc[2 * u][2], sc[2 * u][3], ph1, pl1);
            split_hilo2(sc[2 * u + 1][0], sc[2 * u + 1][1], ph2, pl2);
            split_hilo2(sc[2 * u + 1][2], sc[2 * u + 1][3], ph3, pl3);
            const uint4* vb = vs + buf * VT + u * HD * 4 + gq * 4 + t;
#pragma unroll
            for (int j = 0; j < NT; j++) {
                uint4 V = vb[j * 32];
                mma_bf16(o[j], ph0, ph1, ph2, ph3, V.x, V.y);
                mma_bf16(o[j], ph0, ph1, ph2, ph3, V.z, V.w);
                mma_bf16(o[j], pl0, pl1, pl2, pl3, V.x, V.y);
            }
        }
        __syncthreads();  // the buffer is refilled next step
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int row = r ? rb : ra, tok = t0 + row / hg;
        if (tok >= n) continue;
        long base = ((long)tok * nh + h0 + row % hg) * HD;
        float inv = 1.0f / l[r];
#pragma unroll
        for (int j = 0; j < NT; j++) {
            long oi = base + 8 * j + 2 * t;
            if constexpr (GATED) {
                out[oi] = o[j][2 * r] * inv * sigmoidf_(gate[oi]);
                out[oi + 1] = o[j][2 * r + 1] * inv * sigmoidf_(gate[oi + 1]);
            } else {
                out[oi] = o[j][2 * r] * inv;
                out[oi + 1] = o[j][2 * r + 1] * inv;
            }
        }
    }
}

template <bool GATED>
__device__ __forceinline__ void attention_mma_dispatch(const float* q, const uint4* kp, const uint4* vp,
                                                       const float* gate, int nh, int nkv, int hd,
                                                       const long* pos, long ctx_pad, int n, float scale,
                                                       float* out) {
    long start = *pos;
    switch (hd) {
        case 32: attention_mma_body<32, GATED>(q, kp, vp, gate, nh, nkv, start, ctx_pad, n, scale, out); break;
        case 64: attention_mma_body<64, GATED>(q, kp, vp, gate, nh, nkv, start, ctx_pad, n, scale, out); break;
        case 128: attention_mma_body<128, GATED>(q, kp, vp, gate, nh, nkv, start, ctx_pad, n, scale, out); break;
        default: attention_mma_body<256, GATED>(q, kp, vp, gate, nh, nkv, start, ctx_pad, n, scale, out); break;
    }
}

// Grid (token blocks, KV groups x head blocks), 128 threads,
// ATT_SMEM_UINT4(hd) * 16 bytes of dynamic shared memory. kp / vp: from
// attn_kv_split with the same ctx_pad (>= pos + n). hd is 32, 64, 128 or
// 256; the query heads per KV group divide 64 or are a multiple of it.
// `attention_mma` scales the output by sigmoid(gate), `attention_mma_plain`
// (gate unused) does not.
extern "C" __global__ void __launch_bounds__(128) attention_mma(const float* q, const uint4* kp, const uint4* vp,
                                                                 const float* gate, int nh, int nkv, int hd,
                                                                 const long* pos, long ctx_pad, int n, float scale,
                                                                 float* out) {
    PDL_ENTER();
    attention_mma_dispatch<true>(q, kp, vp, gate, nh, nkv, hd, pos, ctx_pad, n, scale, out);
}

extern "C" __global__ void __launch_bounds__(128) attention_mma_plain(const float* q, const uint4* kp,
                                                                       const uint4* vp, const float* gate,
                                                                       int nh, int nkv, int hd, const long* pos,
                                                                       long ctx_pad, int n, float scale,
                                                                       float* out) {
    PDL_ENTER();
    attention_mma_dispatch<false>(q, kp, vp, gate, nh, nkv, hd, pos, ctx_pad, n, scale, out);
}
