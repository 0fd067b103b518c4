// GatedDeltaNet's delta rule over many tokens (prefill), in chunks
//
// delta_rule (deltanet.cu) walks the tokens one after another: exact, but a
// chain of dependent steps (warp reductions) per row block of the state.
// The chunked form (flash-linear-attention's, HF transformers'
// torch_chunk_gated_delta_rule) turns most of it into products. Per value
// head and chunk of C tokens, with G_i = sum_{j<=i} log g_j from the chunk's
// start and Gam_ij = exp(G_i - G_j):
//   A = strictly-lower(diag(beta) K K^T . Gam),  T = (I + A)^-1 (unit lower)
//   P = lower-incl-diag(Q K^T . Gam)
// and with S (dv x dk) the state at the chunk's start, the chunk's deltas
// D (C x dv, row t: the recurrence's beta_t (v_t - g_t S_{t-1} k_t)), its
// outputs and the state after it are
//   D = T (beta . (V - exp(G) . K S^T))
//   Y = exp(G) . Q S^T + P D
//   S = exp(G_last) S + D^T (K . exp(G_last - G)).
// T is applied in the scan (FLA folds it into U = T beta V and
// W = T beta exp(G) K beforehand): applying it costs what U would, W's
// product disappears, and the workspace holds two C x C matrices per (head,
// chunk) instead of C (dk + dv) + C^2 floats.
//
// gdn_chunk_prep, a block per (value head, chunk), all in parallel: G (in
// double: G_i - G_j of two late tokens of a strongly decaying chunk would
// otherwise lose the low bits of a large sum), beta, the two products over
// slabs of 32 channels, T by forward substitution; it writes a record
// [T^T | P^T | beta | exp(G) | exp(G_last - G)] per (value head, chunk).
// gdn_chunk_scan, a block per (value head, 32 rows of its state), the
// chunks in order: the rows of S are independent, so the chain is split
// over nv * dv / 32 blocks, and each chunk is a few products from shared
// memory. Everything is f32 on the CUDA cores (the same sums as the
// recurrence, in another order).
//
// Work (Qwen3-Next shapes: 32 value heads, 16 key heads, dk = dv = 128) per
// layer for a 4096-token prefill: prep 32 x 64 blocks of ~0.8 M FMA (two
// C x C x dk products less the tiles above the diagonal) and a 63-step
// solve; scan 128 blocks (one per SM) x 64 chunks of ~0.9 M FMA (2 C dk 32
// for K S^T and Q S^T, C^2 32 / 2 twice for T and P, 32 dk C for the state),
// ~9 G FMA in all against the recurrence's 6.4 G (3 dk dv per token and
// head), but as products out of shared memory instead of a chain of warp
// reductions. Workspace: nv * chunks * 33 KB (68 MB at 4096 tokens).


#define GDN_C 64           // tokens per chunk
#define GDN_R 32           // state rows per scan block
#define GDN_P (GDN_C + 4)  // row stride of the transposed q / k tiles (see gdn_stage_t)
// Floats per (value head, chunk) record: T^T, P^T ([j][i], C x C each), beta,
// exp(G), exp(G_last - G) (C each).
#define GDN_REC (2 * GDN_C * GDN_C + 3 * GDN_C)

// 4 bytes global -> shared without holding them in registers (sm_80+; a
// plain copy before). smem_addr, cp_async_commit, cp_async_wait: async_copy.cuh.
__device__ __forceinline__ void gdn_cp4(float* smem, const float* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(smem)), "l"(gmem));
#else
    *smem = *gmem;
#endif
}

// nc channels (a multiple of 8) of a chunk's GDN_C tokens, transposed into
// dst[channel][token] (row stride GDN_P) by asynchronous copies; src: the
// chunk's first token at channel 0, tokens cd apart; zeros from token L on.
// A warp copies 8 channels (32-byte sectors) of 4 tokens at a time: in
// shared memory lane (channel c, token i) lands in bank 4 c + i (mod 32),
// all distinct.
__device__ __forceinline__ void gdn_stage_t(float* dst, const float* src, long cd, int L, int nc) {
    int w = threadIdx.x >> 5, nw = blockDim.x >> 5, lane = threadIdx.x & 31;
    for (int i = lane >> 3; i < GDN_C; i += 4)
        for (int ch = w * 8 + (lane & 7); ch < nc; ch += nw * 8) {
            if (i < L)
                gdn_cp4(dst + ch * GDN_P + i, src + (long)i * cd + ch);
            else
                dst[ch * GDN_P + i] = 0.0f;
        }
}

__device__ __forceinline__ void gdn_f4(float (&d)[4], const float* p) {
    float4 v = *(const float4*)p;
    d[0] = v.x, d[1] = v.y, d[2] = v.z, d[3] = v.w;
}

// Per (value head, chunk): grid (nv, chunks), 256 threads. A thread owns a
// 4 x 4 tile (tokens i0.., j0..) of the C x C matrices; the warps whose
// tiles all lie above the diagonal (j > i) skip the products. ws: the
// records, [head][chunk].
extern "C" __global__ void __launch_bounds__(256)
    gdn_chunk_prep(const float* __restrict__ mixed, const float* __restrict__ a, const float* __restrict__ b,
                   const float* __restrict__ a_log, const float* __restrict__ dt_bias, int n, int nk, int nv,
                   int dk, int dv, float* __restrict__ ws) {
    PDL_ENTER();
    // The two 32-channel slabs (2 x 32 x GDN_P floats) while the products
    // run, then A^T and T's finished rows ([row][col], C x C each).
    __shared__ float4 pool4[2 * GDN_C * GDN_C / 4];
    __shared__ double sg[GDN_C];
    __shared__ float slg[GDN_C], sbeta[GDN_C];
    float* pool = (float*)pool4;
    int h = blockIdx.x, c = blockIdx.y, tid = threadIdx.x;
    int kh = h / (nv / nk), kd = nk * dk;
    long cd = 2L * kd + (long)nv * dv;
    int t0 = c * GDN_C, L = min(GDN_C, n - t0);
    float* rec = ws + ((long)h * gridDim.y + c) * GDN_REC;
    // Past the last token: g = 1, beta = 0 (and q = k = v = 0), so the
    // padding changes nothing.
    if (tid < GDN_C) {
        float lg = 0.0f, beta = 0.0f;
        if (tid < L) {
            long t = t0 + tid;
            float at = a[t * nv + h] + dt_bias[h];
            float sp = fmaxf(at, 0.0f) + log1pf(expf(-fabsf(at)));
            lg = -expf(a_log[h]) * sp;
            beta = sigmoidf_(b[t * nv + h]);
        }
        slg[tid] = lg;
        sbeta[tid] = beta;
    }
    __syncthreads();
    if (tid < GDN_C) {
        double g = 0.0;
        for (int j = 0; j <= tid; j++) g += slg[j];
        sg[tid] = g;
    }
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int i0 = (w >> 1) * 16 + (lane >> 3) * 4;  // warp: 16 tokens i x 32 tokens j
    int j0 = (w & 1) * 32 + (lane & 7) * 4;
    bool live = (w & 1) == 0 || (w >> 1) >= 2;
    float kk[4][4] = {}, qk[4][4] = {};
    float *sq = pool, *sk = pool + 32 * GDN_P;  // the slab
    const float* m0 = mixed + (long)t0 * cd;
    for (int c0 = 0; c0 < dk; c0 += 32) {
        // The slab, q then k: a thread loads 4 tokens of a channel (a warp
        // 32 channels, 128-byte rows) 4 times over, all loads in flight
        // together, and stores float4s down the transposed rows (68 floats
        // apart: each quarter-warp's 8 stores start 4 banks apart).
        float x[4][4];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int e = tid + r * 256, ch = e & 31, i = ((e >> 5) & 15) * 4;
            const float* p = m0 + (e < 512 ? 0 : kd) + kh * dk + c0 + ch;
#pragma unroll
            for (int u = 0; u < 4; u++) x[r][u] = i + u < L ? p[(long)(i + u) * cd] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int e = tid + r * 256, ch = e & 31, i = ((e >> 5) & 15) * 4;
            *(float4*)(pool + (e < 512 ? 0 : 32 * GDN_P) + ch * GDN_P + i) = make_float4(x[r][0], x[r][1], x[r][2], x[r][3]);
        }
        __syncthreads();
        if (live)
            for (int k = 0; k < 32; k++) {
                float ki[4], qi[4], kj[4];
                gdn_f4(ki, sk + k * GDN_P + i0);
                gdn_f4(qi, sq + k * GDN_P + i0);
                gdn_f4(kj, sk + k * GDN_P + j0);
#pragma unroll
                for (int u = 0; u < 4; u++)
#pragma unroll
                    for (int v = 0; v < 4; v++) {
                        kk[u][v] = fmaf(ki[u], kj[v], kk[u][v]);
                        qk[u][v] = fmaf(qi[u], kj[v], qk[u][v]);
                    }
            }
    }
    __syncthreads();  // the slabs' space becomes A^T and T
    float *sa = pool, *st = pool + GDN_C * GDN_C;
    float am[4][4], pm[4][4], tm[4][4];
#pragma unroll
    for (int u = 0; u < 4; u++)
#pragma unroll
        for (int v = 0; v < 4; v++) {
            int i = i0 + u, j = j0 + v;
            float gam = j <= i ? expf((float)(sg[i] - sg[j])) : 0.0f;
            am[u][v] = j < i ? sbeta[i] * kk[u][v] * gam : 0.0f;
            pm[u][v] = qk[u][v] * gam;
            tm[u][v] = i == j ? 1.0f : 0.0f;
        }
#pragma unroll
    for (int v = 0; v < 4; v++) {
        *(float4*)(sa + (j0 + v) * GDN_C + i0) = make_float4(am[0][v], am[1][v], am[2][v], am[3][v]);
        *(float4*)(rec + GDN_C * GDN_C + (j0 + v) * GDN_C + i0) = make_float4(pm[0][v], pm[1][v], pm[2][v], pm[3][v]);
    }
    // T = (I + A)^-1 by forward substitution, one column m of A per step:
    // row m of T is final once the steps before m are done; its owner
    // publishes it and every row below takes -A[i][m] T[m][:]. Rows are
    // written once, so one barrier per step. Rows from L on are I's.
    for (int m = 0; m < L - 1; m++) {
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (i0 + u == m) *(float4*)(st + m * GDN_C + j0) = make_float4(tm[u][0], tm[u][1], tm[u][2], tm[u][3]);
        __syncthreads();
        float av[4], tv[4];
        gdn_f4(av, sa + m * GDN_C + i0);
        gdn_f4(tv, st + m * GDN_C + j0);
#pragma unroll
        for (int u = 0; u < 4; u++)
#pragma unroll
            for (int v = 0; v < 4; v++) tm[u][v] = fmaf(-av[u], tv[v], tm[u][v]);
    }
#pragma unroll
    for (int v = 0; v < 4; v++)
        *(float4*)(rec + (j0 + v) * GDN_C + i0) = make_float4(tm[0][v], tm[1][v], tm[2][v], tm[3][v]);
    if (tid < GDN_C) {
        float* tail = rec + 2 * GDN_C * GDN_C;
        tail[tid] = sbeta[tid];
        tail[GDN_C + tid] = (float)exp(sg[tid]);
        tail[2 * GDN_C + tid] = (float)exp(sg[GDN_C - 1] - sg[tid]);
    }
}

// Per (value head, 32 rows of its state): grid (nv, dv / 32), 256 threads,
// the dynamic shared memory of qwen.rs's gdn_scan_smem (141 KB at dk = 128,
// 225 KB at 256): one block per SM. Per chunk, S being the rows' state at its start
// (S^T in shared memory):
//   1. X_Q = Q S^T, then X_K = K S^T (C x 32 each; a thread 4 tokens x 2
//      rows),
//   2. vb = beta (v - exp(G) X_K),  3. D = T vb, and D exp(G_last - G),
//   4. y = exp(G) X_Q + P D, and S = exp(G_last) S + D_last^T K (a thread
//      keeps channels tc + 32 m of 4 rows of S in registers and writes them
//      to S^T for the next chunk).
// The next chunk's inputs are copied asynchronously as soon as the current
// one is done with their buffers: q^T during 1 (after X_Q), T^T after 3,
// k^T, P^T and the decays after 4 (in flight during the next X_Q).
// The initial state is read from `state` and the final one written back.
extern "C" __global__ void __launch_bounds__(256)
    gdn_chunk_scan(const float* __restrict__ mixed, const float* __restrict__ ws, float* __restrict__ state, int n,
                   int nk, int nv, int dk, int dv, float* __restrict__ y) {
    PDL_ENTER();
    extern __shared__ float gdn_smem[];
    int h = blockIdx.x, rb = blockIdx.y * GDN_R, tid = threadIdx.x;
    int kh = h / (nv / nk), kd = nk * dk;
    long cd = 2L * kd + (long)nv * dv;
    int nch = (n + GDN_C - 1) / GDN_C;
    float* qt = gdn_smem;            // q^T [dk][GDN_P]
    float* kt = qt + dk * GDN_P;     // k^T
    float* tt = kt + dk * GDN_P;     // T^T [C][C]
    float* pt = tt + GDN_C * GDN_C;  // P^T
    float* st = pt + GDN_C * GDN_C;  // S^T [dk][32]
    float* vb = st + dk * GDN_R;     // [C][32]
    float* vp = vb + GDN_C * GDN_R;  // D
    float* vd = vp + GDN_C * GDN_R;  // D exp(G_last - G)
    float* sc = vd + GDN_C * GDN_R;  // beta, exp(G), exp(G_last - G)
    const float* qsrc = mixed + kh * dk;
    const float* ksrc = mixed + kd + kh * dk;
    const float* vsrc = mixed + 2 * kd + (long)h * dv + rb;
    const float* recs = ws + (long)h * nch * GDN_REC;
    // The copies of chunk c's inputs, in three groups: q^T; T^T; k^T, P^T
    // and beta / decays (the waits below count groups; past the last chunk
    // they are empty).
    auto copy_q = [&](int c) {
        if (c < nch) gdn_stage_t(qt, qsrc + (long)c * GDN_C * cd, cd, min(GDN_C, n - c * GDN_C), dk);
        cp_async_commit();
    };
    auto copy_t = [&](int c) {
        if (c < nch)
            for (int e = tid; e < GDN_C * GDN_C / 4; e += blockDim.x)
                cp_async16(tt + 4 * e, recs + (long)c * GDN_REC + 4 * e);
        cp_async_commit();
    };
    auto copy_kp = [&](int c) {
        if (c < nch) {
            gdn_stage_t(kt, ksrc + (long)c * GDN_C * cd, cd, min(GDN_C, n - c * GDN_C), dk);
            const float* rec = recs + (long)c * GDN_REC;
            for (int e = tid; e < GDN_C * GDN_C / 4; e += blockDim.x)
                cp_async16(pt + 4 * e, rec + GDN_C * GDN_C + 4 * e);
            for (int e = tid; e < 3 * GDN_C / 4; e += blockDim.x) cp_async16(sc + 4 * e, rec + 2 * GDN_C * GDN_C + 4 * e);
        }
        cp_async_commit();
    };
    copy_q(0);
    copy_t(0);
    copy_kp(0);
    int i0 = (tid >> 4) * 4, r0 = (tid & 15) * 2;  // steps 1-4: tokens i0.., rows r0..
    int tc = tid >> 3, s0 = (tid & 7) * 4;         // the state: channels tc + 32 m, rows s0..
    int per = dk / WARP;                           // <= 8
    float s[8][4];
#pragma unroll
    for (int m = 0; m < 8; m++)
#pragma unroll
        for (int u = 0; u < 4; u++)
            s[m][u] = m < per ? state[((long)h * dv + rb + s0 + u) * dk + tc + 32 * m] : 0.0f;
#pragma unroll
    for (int m = 0; m < 8; m++)
        if (m < per) *(float4*)(st + (tc + 32 * m) * GDN_R + s0) = make_float4(s[m][0], s[m][1], s[m][2], s[m][3]);
    for (int c = 0; c < nch; c++) {
        int t0 = c * GDN_C, L = min(GDN_C, n - t0);
        float v[4][2];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            float2 x = make_float2(0.0f, 0.0f);
            if (i0 + u < L) x = *(const float2*)(vsrc + (long)(t0 + i0 + u) * cd + r0);
            v[u][0] = x.x, v[u][1] = x.y;
        }
        cp_async_wait<2>();  // q^T
        __syncthreads();
        // 1. (tiles of padding tokens only are left out: their beta is 0
        // and their outputs are not written)
        float xq[4][2] = {}, xk[4][2] = {};
        if (i0 < L)
            for (int k = 0; k < dk; k++) {
                float q4[4];
                gdn_f4(q4, qt + k * GDN_P + i0);
                float2 s2 = *(const float2*)(st + k * GDN_R + r0);
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    xq[u][0] = fmaf(q4[u], s2.x, xq[u][0]);
                    xq[u][1] = fmaf(q4[u], s2.y, xq[u][1]);
                }
            }
        cp_async_wait<0>();  // T^T, k^T, P^T, the decays
        __syncthreads();
        copy_q(c + 1);
        if (i0 < L)
            for (int k = 0; k < dk; k++) {
                float k4[4];
                gdn_f4(k4, kt + k * GDN_P + i0);
                float2 s2 = *(const float2*)(st + k * GDN_R + r0);
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    xk[u][0] = fmaf(k4[u], s2.x, xk[u][0]);
                    xk[u][1] = fmaf(k4[u], s2.y, xk[u][1]);
                }
            }
        // 2.
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int i = i0 + u;
            float beta = sc[i], eg = sc[GDN_C + i];
            *(float2*)(vb + i * GDN_R + r0) =
                make_float2(beta * (v[u][0] - eg * xk[u][0]), beta * (v[u][1] - eg * xk[u][1]));
        }
        __syncthreads();
        // 3. T^T's rows j > i are zero and vb's from L on: j < min(i0 + 4, L).
        float d[4][2] = {};
        int jn = min(i0 + 4, L);
        for (int j = 0; j < jn; j++) {
            float t4[4];
            gdn_f4(t4, tt + j * GDN_C + i0);
            float2 b2 = *(const float2*)(vb + j * GDN_R + r0);
#pragma unroll
            for (int u = 0; u < 4; u++) {
                d[u][0] = fmaf(t4[u], b2.x, d[u][0]);
                d[u][1] = fmaf(t4[u], b2.y, d[u][1]);
            }
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int i = i0 + u;
            float el = sc[2 * GDN_C + i];
            *(float2*)(vp + i * GDN_R + r0) = make_float2(d[u][0], d[u][1]);
            *(float2*)(vd + i * GDN_R + r0) = make_float2(d[u][0] * el, d[u][1] * el);
        }
        __syncthreads();
        copy_t(c + 1);
        // 4. y
        float o[4][2];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            float eg = sc[GDN_C + i0 + u];
            o[u][0] = eg * xq[u][0];
            o[u][1] = eg * xq[u][1];
        }
        for (int j = 0; j < jn; j++) {
            float p4[4];
            gdn_f4(p4, pt + j * GDN_C + i0);
            float2 d2 = *(const float2*)(vp + j * GDN_R + r0);
#pragma unroll
            for (int u = 0; u < 4; u++) {
                o[u][0] = fmaf(p4[u], d2.x, o[u][0]);
                o[u][1] = fmaf(p4[u], d2.y, o[u][1]);
            }
        }
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (i0 + u < L)
                *(float2*)(y + ((long)(t0 + i0 + u) * nv + h) * dv + rb + r0) = make_float2(o[u][0], o[u][1]);
        // 4. the state (vd's rows from L on are zero)
        float el = sc[GDN_C + GDN_C - 1];
#pragma unroll
        for (int m = 0; m < 8; m++)
#pragma unroll
            for (int u = 0; u < 4; u++) s[m][u] *= el;
        for (int j = 0; j < L; j += 4) {
            float d0[4], d1[4], d2[4], d3[4];
            gdn_f4(d0, vd + j * GDN_R + s0);
            gdn_f4(d1, vd + (j + 1) * GDN_R + s0);
            gdn_f4(d2, vd + (j + 2) * GDN_R + s0);
            gdn_f4(d3, vd + (j + 3) * GDN_R + s0);
#pragma unroll
            for (int m = 0; m < 8; m++)
                if (m < per) {
                    float k4[4];
                    gdn_f4(k4, kt + (tc + 32 * m) * GDN_P + j);
#pragma unroll
                    for (int u = 0; u < 4; u++)
                        s[m][u] = fmaf(k4[3], d3[u], fmaf(k4[2], d2[u], fmaf(k4[1], d1[u], fmaf(k4[0], d0[u], s[m][u]))));
                }
        }
#pragma unroll
        for (int m = 0; m < 8; m++)
            if (m < per) *(float4*)(st + (tc + 32 * m) * GDN_R + s0) = make_float4(s[m][0], s[m][1], s[m][2], s[m][3]);
        __syncthreads();
        copy_kp(c + 1);
    }
#pragma unroll
    for (int m = 0; m < 8; m++)
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (m < per) state[((long)h * dv + rb + s0 + u) * dk + tc + 32 * m] = s[m][u];
}
