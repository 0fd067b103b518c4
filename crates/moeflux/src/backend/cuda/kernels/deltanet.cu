// GatedDeltaNet, token by token.

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
                                      int dv, float* out) {
    float wv = w[threadIdx.x];  // before the wait: weights never depend on the previous kernel
    PDL_ENTER();
    long base = ((long)blockIdx.y * gridDim.x + blockIdx.x) * dv;
    float v = y[base + threadIdx.x];
    float ss = block_sum(v * v);
    out[base + threadIdx.x] = v * rsqrtf(ss / dv + eps) * wv * siluf_(z[base + threadIdx.x]);
}
