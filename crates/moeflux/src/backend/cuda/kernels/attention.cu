// Gated full attention (decode and short batches).

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
