// Mixture of experts: expert layouts, the grouped and per-slot expert
// products, the combine.

// The activation of one intermediate row of a slot from its gate and up
// sums: the biases added, then silu(g) * u, or gpt-oss's
// (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'), g' = min(g, limit)
// (ops::swiglu_oai); bg, bu: the row's gate and up biases (read only with
// L.bias_g).
__device__ __forceinline__ float expert_glu_b(const ExpertLayout& L, float g, float u, float bg, float bu) {
    if (L.bias_g) {
        g += bg;
        u += bu;
    }
    if (L.oai) {
        g = fminf(g, L.limit);
        u = fminf(fmaxf(u, -L.limit), L.limit);
        return (u + 1.0f) * (g * sigmoidf_(L.alpha * g));
    }
    return siluf_(g) * u;
}
// The same with the slot's biases read from the tables here.
__device__ __forceinline__ float expert_glu(const ExpertLayout& L, int slot, int r, float g, float u) {
    long e = L.bias_g ? L.ids[slot] : 0;
    return L.bias_g ? expert_glu_b(L, g, u, L.bias_g[e * L.inter + r], L.bias_u[e * L.inter + r])
                    : expert_glu_b(L, g, u, 0.0f, 0.0f);
}

// The down bias of hidden row r of a slot's expert (0 without biases).
__device__ __forceinline__ float expert_down_bias(const ExpertLayout& L, int slot, int r) {
    return L.bias_d ? L.bias_d[(long)L.ids[slot] * L.hidden + r] : 0.0f;
}

__device__ __forceinline__ QW expert_qw_of(const char* base, long wo, long so, long bo, int rows, int cols,
                                           int bits, int gs, int sf32) {
    QW q;
    q.w = (const u32*)(base + wo);
    q.s = base + so;
    q.b = base + bo;
    q.rows = rows;
    q.cols = cols;
    q.bits = bits;
    q.gs = gs;
    q.sf32 = sf32;
    return q;
}

// The gate or up projection of an expert at base (offsets wo, so, bo).
__device__ __forceinline__ QW expert_qw(const char* base, long wo, long so, long bo, int rows, int cols,
                                        const ExpertLayout& L) {
    return expert_qw_of(base, wo, so, bo, rows, cols, L.bits, L.gs, L.sf32);
}

// The down projection of an expert at base (its own width and group size).
__device__ __forceinline__ QW expert_down_qw(const char* base, const ExpertLayout& L) {
    return expert_qw_of(base, L.down_w, L.down_s, L.down_b, L.hidden, L.inter, L.down_bits, L.down_gs, L.down_sf32);
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
    QW dq = expert_down_qw(T.base, L);
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

// The MoE block's output, column i of token t, before it is added to the
// residual stream: sum_j w[t,j] * slot_out[t*k+j] in slot order (this GPU's
// experts only, in a group), then s * shared[t], s = sigmoid(sg[t]) for
// Qwen's gated shared expert, 1 for DeepSeek's ungated ones (`sg` null).
// The slots' values are requested COMBINE_BATCH at a time before the first
// is added (an add waiting for each slot's load was an L2 round trip a slot
// on the decode step's critical path); the sums stay in slot order.
#define COMBINE_BATCH 8
__device__ __forceinline__ float moe_combine_at(const MoeCombine& C, float s, int t, int i) {
    float acc = 0.0f;
    float sh = C.shared ? C.shared[(long)t * C.h + i] : 0.0f;
    for (int j0 = 0; j0 < C.k; j0 += COMBINE_BATCH) {
        bool on[COMBINE_BATCH];
        float wv[COMBINE_BATCH], v[COMBINE_BATCH];
#pragma unroll
        for (int u = 0; u < COMBINE_BATCH; u++) {
            int j = j0 + u;
            on[u] = j < C.k && (!C.own || C.own[C.ids[t * C.k + j]]);
            wv[u] = on[u] ? C.wts[t * C.k + j] : 0.0f;
            v[u] = on[u] ? C.slot_out[((long)t * C.k + j) * C.h + i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < COMBINE_BATCH; u++)
            if (on[u]) acc += wv[u] * v[u];
    }
    if (C.shared) acc += s * sh;
    return acc;
}

__device__ __forceinline__ float moe_shared_scale(const MoeCombine& C, int t) {
    return C.shared ? (C.sg ? sigmoidf_(C.sg[t]) : 1.0f) : 0.0f;
}

// out = base (or zero) + the combine, [tokens, hidden]; out may be base.
// Grid (token, column blocks).
extern "C" __global__ void moe_combine(MoeCombine C, float* out) { PDL_ENTER();
    int t = blockIdx.x;
    float s = moe_shared_scale(C, t);
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < C.h; i += gridDim.y * blockDim.x) {
        long o = (long)t * C.h + i;
        out[o] = (C.base ? C.base[o] : 0.0f) + moe_combine_at(C, s, t, i);
    }
}

// moe_combine, then xn = rms_norm(out) with w: the next block's input norm in
// the same launch (one boundary fewer a layer). One token a block, as
// rms_norm; every value and the norm equal the two kernels' bit for bit.
extern "C" __global__ void __launch_bounds__(1024) moe_combine_norm(MoeCombine C, float* out, const float* w, float eps, float* xn) {
    float wr[NORM_REGS];
    norm_weights(w, C.h, wr);
    PDL_ENTER();
    int t = blockIdx.x;
    float s = moe_shared_scale(C, t), ss = 0.0f, xv[NORM_REGS];
    float* row = out + (long)t * C.h;
    const float* base = C.base ? C.base + (long)t * C.h : nullptr;
    // Every column's value before any is stored (a store could alias the
    // slots' loads, which then could not be issued ahead of it).
#pragma unroll
    for (int u = 0; u < NORM_REGS; u++) {
        int i = threadIdx.x + u * blockDim.x;
        xv[u] = i < C.h ? (base ? base[i] : 0.0f) + moe_combine_at(C, s, t, i) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < NORM_REGS; u++) {
        int i = threadIdx.x + u * blockDim.x;
        if (i < C.h) row[i] = xv[u];
        ss = fmaf(xv[u], xv[u], ss);
    }
    for (int i = threadIdx.x + NORM_REGS * blockDim.x; i < C.h; i += blockDim.x) {
        float v = (base ? base[i] : 0.0f) + moe_combine_at(C, s, t, i);
        row[i] = v;
        ss = fmaf(v, v, ss);
    }
    rms_norm_row(row, xv, w, wr, C.h, eps, ss, xn + (long)t * C.h);
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
    QW dq = expert_down_qw((const char*)bases[j], L);
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
    QW dq = expert_down_qw((const char*)bases[j], L);
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
    QW dq = expert_down_qw((const char*)bases[j], L);
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
STREAM_SLOT_KERNELS(B4Q8, b4q8, QMV_STREAM_NC)

// --------------------------------------------------------------------------
// MXFP4 per-slot products by whole rows (gpt-oss's decode). The streaming
// kernels above give each of a row's slices its own warp, so every set ends
// in a block barrier, and a warp has only its next set's chunks in flight.
// Here a block first turns its slot's input into mx_int_prep's digits, once,
// in shared memory; then each warp takes units in turn (one intermediate row
// of gate and of up, or two hidden rows of down) with the NS slices of its
// rows all its own (lane l of slice p takes group p * gps + l: the streaming
// kernels' columns), so it needs no barrier, and its loads for the units
// DEPTH ahead are in flight while it computes one. A row's sum is the
// streaming kernels' bit for bit: each slice's products reduced over the
// lanes in the xor butterfly's order (four or eight sums at once,
// mx_rows_reduce), the slice sums then added in slice order.

#define MXR_MAX_SLICES 4
#define MXR_W 28  // words per group in shared memory: 24 digits, sum(X), 2^(e-23), 2 pad

// Two matrices' rows (gate and up, or two down rows) of a unit: each lane's
// chunk and raw scale byte per slice, and the biases of the lanes that store
// (gate/up: lane 0 both; down: each of its two lanes its row's in b[0]).
template <int NS>
struct MxRowsFetch {
    uint4 w[2 * NS];
    u32 s[2 * NS];
    float b[2];
};

// The slot's input x (ng groups of 32) as digits in sm, group g at MXR_W * g.
__device__ __forceinline__ void mx_rows_prep(const float* x, int ng, u32* sm) {
    for (int g = threadIdx.x; g < ng; g += blockDim.x) {
        float xv[32];
        load_acts<32>(x + 32 * g, xv);
        mx_int_prep(xv);
        uint4* d = (uint4*)(sm + MXR_W * g);
#pragma unroll
        for (int q = 0; q < 6; q++)
            d[q] = make_uint4(__float_as_uint(xv[4 * q]), __float_as_uint(xv[4 * q + 1]),
                              __float_as_uint(xv[4 * q + 2]), __float_as_uint(xv[4 * q + 3]));
        d[6] = make_uint4(__float_as_uint(xv[24]), __float_as_uint(xv[25]), 0u, 0u);
    }
}

// The lane's group in slice p (-1: none).
__device__ __forceinline__ int mx_rows_group(int p, int gps, int ng, int lane) {
    int c = p * gps + lane;
    return lane < gps && c < ng ? c : -1;
}

// Rows ra of a and rb of b (a row past `rows` reads as zeros), as a unit.
template <int NS>
__device__ __forceinline__ void mx_rows_fetch(const char* aw, const unsigned char* as, long ra, const char* bw,
                                              const unsigned char* bs, long rb, int rows, int gps, int ng,
                                              int lane, MxRowsFetch<NS>& f) {
#pragma unroll
    for (int p = 0; p < NS; p++) {
        int c = mx_rows_group(p, gps, ng, lane);
        bool oa = c >= 0 && ra < rows, ob = c >= 0 && rb < rows;
        f.w[p] = oa ? __ldg((const uint4*)aw + ra * ng + c) : make_uint4(0, 0, 0, 0);
        f.w[NS + p] = ob ? __ldg((const uint4*)bw + rb * ng + c) : make_uint4(0, 0, 0, 0);
        f.s[p] = oa ? __ldg(as + ra * ng + c) : 127u;
        f.s[NS + p] = ob ? __ldg(bs + rb * ng + c) : 127u;
    }
}

// v[h * P + p] (h < 2, p < P, P = 2 or 4), a lane's products of slice p of
// row h, summed over the warp as warp_sum would sum each, in 2P - 1 + (5 -
// log2(2P)) shuffles instead of 10P: a reduce-scatter (each step's partner
// sends the half of the sums this lane keeps; fp addition commutes, so each
// partial is the butterfly's), then butterfly steps on the one left. Then
// (P shuffles) every lane of half h (lane & (16 / P)) returns 0 + S_0 + ...
// + S_(ns-1) of its row, the slice sums in order.
template <int P>
__device__ __forceinline__ float mx_rows_reduce(float (&v)[2 * P], int ns) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int st = 0, m = 2 * P; m > 1; st++, m >>= 1) {
        int o = 16 >> st;
        bool hi = lane & o;
#pragma unroll
        for (int i = 0; i < m / 2; i++) {
            float keep = hi ? v[2 * i + 1] : v[2 * i], send = hi ? v[2 * i] : v[2 * i + 1];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
    }
    constexpr int LOG = P == 2 ? 2 : 3;  // log2(2P) steps done
#pragma unroll
    for (int o = 16 >> LOG; o > 0; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
    // Index m = h P + p is held by the lanes whose bit (16 >> i) is bit i of m.
    int h = (lane & (16 / P)) ? 1 : 0;
    float s = 0.0f;
#pragma unroll
    for (int p = 0; p < P; p++) {
        int m = h * P + p, src = 0;
#pragma unroll
        for (int i = 0; i < LOG; i++) src |= ((m >> i) & 1) * (16 >> i);
        float t = __shfl_sync(0xffffffffu, v[0], src);
        if (p < ns) s += t;
    }
    return s;
}

// A unit's two rows: row h's slices dotted with the lane's digits, reduced.
template <int NS>
__device__ __forceinline__ float mx_rows_dot(const MxRowsFetch<NS>& f, const u32* sm, int gps, int ng) {
    constexpr int P = NS <= 2 ? 2 : 4;
    int lane = threadIdx.x & 31;
    float v[2 * P];
#pragma unroll
    for (int i = 0; i < 2 * P; i++) v[i] = 0.0f;
#pragma unroll
    for (int p = 0; p < NS; p++) {
        int c = mx_rows_group(p, gps, ng, lane);
        if (c >= 0) {
            float xv[26];
            const uint4* d = (const uint4*)(sm + MXR_W * c);
#pragma unroll
            for (int q = 0; q < 7; q++) {
                uint4 t = d[q];
                xv[4 * q] = __uint_as_float(t.x);
                xv[4 * q + 1] = __uint_as_float(t.y);
                if (q < 6) {
                    xv[4 * q + 2] = __uint_as_float(t.z);
                    xv[4 * q + 3] = __uint_as_float(t.w);
                }
            }
            v[p] = mx_half_scale(f.s[p]) * mx_int_dot(f.w[p], xv);
            v[P + p] = mx_half_scale(f.s[NS + p]) * mx_int_dot(f.w[NS + p], xv);
        }
    }
    return mx_rows_reduce<P>(v, NS);
}

// The unit loop of a warp: units u0, u0 + stride, ... below nu, fetched
// DEPTH (1 or 2) ahead (the first ones already in f0, f1).
template <int NS, int DEPTH, class Fetch, class Unit>
__device__ __forceinline__ void mx_rows_loop(int u, int stride, int nu, MxRowsFetch<NS>& f0, MxRowsFetch<NS>& f1,
                                             Fetch fetch, Unit unit) {
    MxRowsFetch<NS> f2;
    for (; u < nu; u += stride) {
        int ahead = u + DEPTH * stride;
        if (ahead < nu) fetch(ahead, DEPTH == 1 ? f1 : f2);
        unit(u, f0);
        f0 = f1;
        if (DEPTH > 1) f1 = f2;
    }
}

template <int NS, int DEPTH>
__device__ __forceinline__ void moe_gate_up_rows_body(const unsigned long long* bases, const ExpertLayout& L, int k,
                                                      const float* x, float* act) {
    __shared__ uint4 smv[MXR_MAX_SLICES * 32 * MXR_W / 4];
    u32* sm = (u32*)smv;
    int j = blockIdx.y, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const char* base = (const char*)bases[j];
    int ng = L.hidden / 32, gps = (ng + NS - 1) / NS;
    const char *gw = base + L.gate_w, *uw = base + L.up_w;
    const unsigned char *gsc = (const unsigned char*)base + L.gate_s, *usc = (const unsigned char*)base + L.up_s;
    long e = L.bias_g ? L.ids[j] : 0;
    auto fetch = [&](int r, MxRowsFetch<NS>& f) {
        mx_rows_fetch<NS>(gw, gsc, r, uw, usc, r, L.inter, gps, ng, lane, f);
        if (L.bias_g && lane == 0) {
            f.b[0] = __ldg(L.bias_g + e * L.inter + r);
            f.b[1] = __ldg(L.bias_u + e * L.inter + r);
        }
    };
    int u = blockIdx.x * nw + (threadIdx.x >> 5), stride = gridDim.x * nw;
    MxRowsFetch<NS> f0, f1;
    if (u < L.inter) fetch(u, f0);
    if (DEPTH > 1 && u + stride < L.inter) fetch(u + stride, f1);
    mx_rows_prep(x + (long)(j / k) * L.hidden, ng, sm);
    __syncthreads();
    mx_rows_loop<NS, DEPTH>(u, stride, L.inter, f0, f1, fetch, [&](int r, const MxRowsFetch<NS>& f) {
        float s = mx_rows_dot<NS>(f, sm, gps, ng);
        float up = __shfl_sync(0xffffffffu, s, NS <= 2 ? 8 : 4);  // half 1's lanes hold up
        if (lane == 0) act[(long)j * L.inter + r] = expert_glu_b(L, s, up, f.b[0], f.b[1]);
    });
}

template <int NS, int DEPTH, bool EARLY>
__device__ __forceinline__ void moe_down_rows_body(const unsigned long long* bases, const ExpertLayout& L,
                                                   const float* act, float* slot_out) {
    __shared__ uint4 smv[MXR_MAX_SLICES * 32 * MXR_W / 4];
    u32* sm = (u32*)smv;
    int j = blockIdx.y, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    // EARLY: the bases (and ids) are the router's, two kernels back: the
    // gate/up kernel this one follows waited for it before letting this one
    // start, so they are read (past L1) and the first units fetched before
    // the wait for gate/up's act. A block always waits before it ends, so
    // that this grid never completes before the one it follows.
    if (!EARLY) PDL_ENTER();
    const char* base = (const char*)(EARLY ? __ldcg(bases + j) : bases[j]);
    if (base == nullptr) { /* a slot the host computes */
        if (EARLY) PDL_ENTER();
        return;
    }
    int ng = L.inter / 32, gps = (ng + NS - 1) / NS;
    const char* dw = base + L.down_w;
    const unsigned char* dsc = (const unsigned char*)base + L.down_s;
    long e = L.bias_d ? (EARLY ? __ldcg(L.ids + j) : L.ids[j]) : 0;
    int nu = (L.hidden + 1) / 2;
    constexpr int H1 = NS <= 2 ? 8 : 4;  // a lane of half 1 (the second row), mx_rows_reduce
    auto fetch = [&](int u, MxRowsFetch<NS>& f) {
        mx_rows_fetch<NS>(dw, dsc, 2L * u, dw, dsc, 2L * u + 1, L.hidden, gps, ng, lane, f);
        int r = 2 * u + (lane == H1);
        if (L.bias_d && (lane == 0 || lane == H1)) f.b[0] = r < L.hidden ? __ldg(L.bias_d + e * L.hidden + r) : 0.0f;
    };
    int u = blockIdx.x * nw + (threadIdx.x >> 5), stride = gridDim.x * nw;
    MxRowsFetch<NS> f0, f1;
    if (u < nu) fetch(u, f0);
    if (DEPTH > 1 && u + stride < nu) fetch(u + stride, f1);
    if (EARLY) PDL_ENTER();
    mx_rows_prep(act + (long)j * L.inter, ng, sm);
    __syncthreads();
    mx_rows_loop<NS, DEPTH>(u, stride, nu, f0, f1, fetch, [&](int u, const MxRowsFetch<NS>& f) {
        float s = mx_rows_dot<NS>(f, sm, gps, ng);
        int r = 2 * u + (lane == H1);
        if ((lane == 0 || lane == H1) && r < L.hidden)
            slot_out[(long)j * L.hidden + r] = s + (L.bias_d ? f.b[0] : 0.0f);
    });
}

// Slices per row (NS) 2 to 4: rows of 513 to 2,048 bytes (gpt-oss's 2,880
// columns: 3). Measured on an H200 with gpt-oss's experts (kbench, four slots
// of 2880 x 2880): gate/up 24.0 us with units fetched one ahead (118
// registers, two blocks per SM), 24.8 two ahead (capped at 128 registers) or
// 25.2 (157 registers, one block per SM); down 12.1 one ahead, 11.3 two ahead
// capped at two blocks per SM, 13.4 with its first units fetched after the
// wait (not EARLY). Rows of 4 slices take more registers: one ahead.
#define MX_ROWS_KERNELS(NS)                                                                               \
    extern "C" __global__ void __launch_bounds__(256) moe_gate_up_rows_mx##NS(                           \
        const unsigned long long* bs, ExpertLayout L, int k, const float* x, float* a) {                 \
        PDL_ENTER(); /* the bases are the router's */                                                     \
        if (bs[blockIdx.y] == 0) return;                                                                  \
        moe_gate_up_rows_body<NS, 1>(bs, L, k, x, a);                                                     \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(256, NS <= 3 ? 2 : 1) moe_down_rows_mx##NS(             \
        const unsigned long long* bs, ExpertLayout L, const float* a, float* y) {                        \
        moe_down_rows_body<NS, NS <= 3 ? 2 : 1, true>(bs, L, a, y);                                       \
    }
MX_ROWS_KERNELS(2)
MX_ROWS_KERNELS(3)
MX_ROWS_KERNELS(4)

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
QMV_SLOT_KERNELS(B4Q8, b4q8)

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

// Per-slot products of 4-bit affine experts on 8-bit activations
// (`--gpu-activations q8`), in qdot.cu's form: blockIdx.y = slot; a block
// rounds the slot's input into shared memory once (gate/up: its token's
// x; down: its act row; the q8 contract of qdot_round) and loops over the
// slot's row sets (qdot_rows); LPR lanes take a row (32 / LPR rows side by
// side in a warp: more rows' loads in flight, and every lane busy on narrow
// inputs; the host picks LPR). Gate/up: a lane group takes intermediate row
// r of gate and of up, and its SwiGLU; down: two hidden rows (kbench, H200:
// one row a lane group read 1.4-1.6x slower). A row's sums do not depend on
// the grid. Shared memory: cols * 5 / 4 bytes.

// Slot j's gate/up rows once its input is rounded into shared memory
// (qdot_round; the caller syncs the block first), expert at `base`.
template <int LPR>
__device__ __forceinline__ void moe_gate_up_qdot_rows(const char* base, const ExpertLayout& L, int j, float* act) {
    extern __shared__ float qd_dyn[];
    const int* smem = (const int*)qd_dyn;
    constexpr int G = 32 / LPR;
    const int lane = threadIdx.x & 31, sub = lane % LPR;
    const QW gq = expert_qw(base, L.gate_w, L.gate_s, L.gate_b, L.inter, L.hidden, L);
    const QW uq = expert_qw(base, L.up_w, L.up_s, L.up_b, L.inter, L.hidden, L);
    const QW* const q[2] = {&gq, &uq};
    const int unit = (threadIdx.x >> 5) * G + lane / LPR, per_set = 8 * G;
    const int nsets = (L.inter + per_set - 1) / per_set;
    for (int set = blockIdx.x; set < nsets; set += gridDim.x) {
        int r = set * per_set + unit;
        long row = min(r, L.inter - 1);
        const long rows[2] = {row, row};
        float acc[1][2];
        qdot_rows<1, 2, LPR>(q, rows, smem, sub, acc);
        if (sub == 0 && r < L.inter) act[(long)j * L.inter + r] = expert_glu(L, j, r, acc[0][0], acc[0][1]);
    }
}

template <int LPR>
__device__ void moe_gate_up_qdot_body(const unsigned long long* bases, const ExpertLayout& L, int k, const float* x,
                                      float* act) {
    extern __shared__ float qd_dyn[];
    const int j = blockIdx.y;
    qdot_round<1, false>(x + (long)(j / k) * L.hidden, L.hidden, 1, 0, (int*)qd_dyn);
    __syncthreads();
    moe_gate_up_qdot_rows<LPR>((const char*)bases[j], L, j, act);
}

template <int LPR>
__device__ void moe_down_qdot_body(const unsigned long long* bases, const ExpertLayout& L, const float* act,
                                   float* slot_out) {
    extern __shared__ float qd_dyn[];
    int* smem = (int*)qd_dyn;
    constexpr int G = 32 / LPR, R = 2;
    const int j = blockIdx.y, lane = threadIdx.x & 31, sub = lane % LPR;
    const QW dq = expert_down_qw((const char*)bases[j], L);
    const QW* q[R];
#pragma unroll
    for (int r = 0; r < R; r++) q[r] = &dq;
    qdot_round<1, false>(act + (long)j * L.inter, L.inter, 1, 0, smem);
    __syncthreads();
    const int unit = (threadIdx.x >> 5) * G + lane / LPR, per_set = 8 * G * R;
    const int nsets = (L.hidden + per_set - 1) / per_set;
    for (int set = blockIdx.x; set < nsets; set += gridDim.x) {
        long r0 = ((long)set * 8 * G + unit) * R;
        long rows[R];
#pragma unroll
        for (int r = 0; r < R; r++) rows[r] = min(r0 + r, (long)L.hidden - 1);
        float acc[1][R];
        qdot_rows<1, R, LPR>(q, rows, smem, sub, acc);
#pragma unroll
        for (int r = 0; r < R; r++)
            if (sub == 0 && r0 + r < L.hidden)
                slot_out[(long)j * L.hidden + r0 + r] = acc[0][r] + expert_down_bias(L, j, (int)(r0 + r));
    }
}

// moe_gate_up_qdot{LPR} and moe_down_qdot{LPR}: 256 threads, the other
// slot kernels' arguments.
#define QDOT_SLOT_KERNELS(LPR)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) moe_gate_up_qdot##LPR(                               \
        const unsigned long long* bs, ExpertLayout L, int k, const float* x, float* a) {                   \
        PDL_ENTER(); /* the bases are the router's */                                                       \
        if (bs[blockIdx.y] == 0) return; /* a slot the host computes */                                    \
        moe_gate_up_qdot_body<LPR>(bs, L, k, x, a);                                                         \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256) moe_down_qdot##LPR(                                  \
        const unsigned long long* bs, ExpertLayout L, const float* a, float* y) {                          \
        PDL_ENTER();                                                                                        \
        if (bs[blockIdx.y] == 0) return;                                                                    \
        moe_down_qdot_body<LPR>(bs, L, a, y);                                                               \
    }
QDOT_SLOT_KERNELS(16)
QDOT_SLOT_KERNELS(8)
QDOT_SLOT_KERNELS(4)
QDOT_SLOT_KERNELS(2)
