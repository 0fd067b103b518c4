// Mixture of experts: the routers.

// Router: per token, softmax over the e logits, the k largest (ties to the
// lower index, like the CPU), their probabilities (renormalised to sum 1
// when `norm`), and, when `table` is not null, each chosen expert's address
// table[expert] into bases. A warp per token; a lane holds C logits
// (expert lane + 32c), so e <= 32 C: moe_route_c{4,8,16,32} for up to 128,
// 256, 512 and 1024 experts (the loops are the whole cost of this kernel).
// One token's choice by a warp: softmax over the e logits l, the k largest
// (ties to the lower index, like the CPU) and their probabilities
// (renormalised to sum 1 when `norm`): lane s < k ends with slot s's
// expert and weight. A lane holds C logits (expert lane + 32c), e <= 32 C.
template <int C>
__device__ __forceinline__ void route_token(const float* l, int e, int k, int norm, int& myid, float& myw) {
    int lane = threadIdx.x & 31;
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
    float chosen = 0.0f;
    myw = 0.0f;
    myid = 0;
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
    if (norm) myw = myw / chosen;
}

// Router: per token, route_token's choice, and, when `table` is not null,
// each chosen expert's address table[expert] into bases. A warp per token;
// moe_route_c{4,8,16,32} for up to 128, 256, 512 and 1024 experts (the
// loops are the whole cost of this kernel).
template <int C>
__device__ void moe_route_body(const float* logits, int n, int e, int k, int norm,
                               const unsigned long long* table, int* ids, float* wts,
                               unsigned long long* bases) {
    int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= n) return;
    int lane = threadIdx.x & 31, myid;
    float w;
    route_token<C>(logits + (long)t * e, e, k, norm, myid, w);
    if (lane < k) {
        ids[(long)t * k + lane] = myid;
        wts[(long)t * k + lane] = w;
        if (table) bases[(long)t * k + lane] = table[myid];
    }
}

// The address table is weights (built once every expert is resident, never
// written by a kernel): the block copies its first min(e, 32 C) entries
// (every id a lane can pick) into shared memory before the wait, and the
// chosen entries are read from there after it.
template <int N>
__device__ __forceinline__ const unsigned long long* route_table_early(const unsigned long long* table, int e,
                                                                       unsigned long long (&st)[N]) {
    if (!table) return nullptr;
    for (int i = threadIdx.x; i < min(e, N); i += blockDim.x) st[i] = table[i];
    __syncthreads();
    return st;
}

#define ROUTE_KERNEL(C)                                                                                      \
    extern "C" __global__ void moe_route_c##C(const float* logits, int n, int e, int k, int norm,            \
                                              const unsigned long long* table, int* ids, float* wts,         \
                                              unsigned long long* bases) {                                   \
        __shared__ unsigned long long st[32 * C];                                                            \
        const unsigned long long* tab = route_table_early(table, e, st);                                     \
        PDL_ENTER();                                                                                         \
        moe_route_body<C>(logits, n, e, k, norm, tab, ids, wts, bases);                                      \
    }
ROUTE_KERNEL(4)
ROUTE_KERNEL(8)
ROUTE_KERNEL(16)
ROUTE_KERNEL(32)

// The top-K and the routed experts' gate/up of a few tokens on 8-bit
// activations in one launch, where every expert is resident (one launch
// fewer in a decode step's chain): each block of slot j = blockIdx.y (token
// j / k, its slot j % k) routes the token itself (warp 0, route_token: the
// choice moe_route_c* makes, bit for bit) while it rounds x, takes its
// slot's expert address from the table, then runs moe_gate_up_qdot's body;
// block (0, token * k) writes the token's ids, weights and addresses for the
// down product and the combine.
template <int C, int LPR>
__device__ __forceinline__ void moe_gate_up_qdot_routed(const float* logits, int e, int k, int norm,
                                                        const unsigned long long* table, int* ids, float* wts,
                                                        unsigned long long* bases, const ExpertLayout& L,
                                                        const float* x, float* act) {
    __shared__ unsigned long long st[32 * C];
    __shared__ unsigned long long chosen;
    route_table_early(table, e, st);
    PDL_ENTER();
    const int j = blockIdx.y, t = j / k, slot = j % k;
    extern __shared__ float qd_dyn[];
    qdot_round<1, false>(x + (long)t * L.hidden, L.hidden, 1, 0, (int*)qd_dyn);
    if (threadIdx.x < WARP) {
        int lane = threadIdx.x, myid;
        float w;
        route_token<C>(logits + (long)t * e, e, k, norm, myid, w);
        if (lane == slot) chosen = st[myid];
        if (blockIdx.x == 0 && slot == 0 && lane < k) {
            ids[(long)t * k + lane] = myid;
            wts[(long)t * k + lane] = w;
            bases[(long)t * k + lane] = st[myid];
        }
    }
    __syncthreads();
    moe_gate_up_qdot_rows<LPR>((const char*)chosen, L, j, act);
}

#define ROUTED_GATE_UP(C, LPR)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) moe_gate_up_qdot##LPR##_route_c##C(                     \
        const float* logits, int e, int k, int norm, const unsigned long long* table, int* ids, float* wts,   \
        unsigned long long* bases, ExpertLayout L, const float* x, float* a) {                                \
        moe_gate_up_qdot_routed<C, LPR>(logits, e, k, norm, table, ids, wts, bases, L, x, a);                 \
    }
#define ROUTED_GATE_UPS(LPR) ROUTED_GATE_UP(4, LPR) ROUTED_GATE_UP(8, LPR) ROUTED_GATE_UP(16, LPR) ROUTED_GATE_UP(32, LPR)
ROUTED_GATE_UPS(16)
ROUTED_GATE_UPS(8)
ROUTED_GATE_UPS(4)
ROUTED_GATE_UPS(2)

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
                                           unsigned long long* bases) {
    __shared__ float sb[4][1024];
    // Before the wait, the weights: the address table (as moe_route_c*) and
    // the lane's bias terms, into the warp's own scratch row (each lane its
    // entries lane + 32 c, which only it reads back and, with groups,
    // overwrites with b; in registers they took the kernel from 123 to 178).
    __shared__ unsigned long long st[1024];
    const unsigned long long* tab = route_table_early(table, e, st);
    int wi = threadIdx.x >> 5;
    int lane = threadIdx.x & 31;
    float* sbias = sb[wi];
#pragma unroll
    for (int c = 0; c < 32; c++) {
        int i = lane + c * WARP;
        if (i < e) sbias[i] = bias[i];
    }
    PDL_ENTER();
    int t = blockIdx.x * (blockDim.x >> 5) + wi;
    if (t >= n) return;
    const float* l = logits + (long)t * e;
    float s[32], b[32];
#pragma unroll
    for (int c = 0; c < 32; c++) {
        int i = lane + c * WARP;
        s[c] = i < e ? sigmoidf_(l[i]) : 0.0f;
        b[c] = i < e ? s[c] + sbias[i] : NEG_INF;
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
        if (tab) bases[(long)t * k + lane] = tab[myid];
    }
}

// A batch's router choice grouped by expert on the device, for a layer whose
// experts are resident (`table`: their addresses), so that a prefill never
// waits for the host between its layers: tasks[x] = (table[x], first, count)
// for every expert x < e in order, and slot_list[first .. first + count) the
// slots (token * k + j) whose choice is x. In a group of GPUs `own` (not
// null) marks this GPU's experts: the others' slots are left out (count 0).
// One block of 1024 threads (e <= 1024). Within an expert's run the slots'
// order is the atomics', which no value depends on: each slot is its own
// column of the expert kernels' tiles, its own row of their outputs.
extern "C" __global__ void __launch_bounds__(1024) moe_group(const int* ids, int n_slots, int e,
                                                               const unsigned long long* table,
                                                               const unsigned char* own, ExpertTask* tasks,
                                                               int* slot_list) {
    __shared__ int count[1024], cursor[1024], warp_total[32];
    __shared__ bool here[1024];
    const int t = threadIdx.x, lane = t & 31, w = t >> 5;
    const unsigned long long base = t < e ? table[t] : 0ull;
    count[t] = 0;
    here[t] = t < e && (!own || own[t]);
    PDL_ENTER();
    __syncthreads();
    for (int j = t; j < n_slots; j += blockDim.x)
        if (here[ids[j]]) atomicAdd(&count[ids[j]], 1);
    __syncthreads();
    // Exclusive prefix sum of the counts: within each warp, then the warps'.
    const int c = count[t];
    int v = c;
    for (int o = 1; o < 32; o <<= 1) {
        int u = __shfl_sync(0xffffffffu, v, max(lane - o, 0));
        if (lane >= o) v += u;
    }
    if (lane == 31) warp_total[w] = v;
    __syncthreads();
    if (w == 0) {
        int s = warp_total[lane];
        for (int o = 1; o < 32; o <<= 1) {
            int u = __shfl_sync(0xffffffffu, s, max(lane - o, 0));
            if (lane >= o) s += u;
        }
        warp_total[lane] = s;
    }
    __syncthreads();
    const int first = v - c + (w ? warp_total[w - 1] : 0);
    if (t < e) tasks[t] = ExpertTask{(const char*)base, first, c};
    cursor[t] = first;
    __syncthreads();
    for (int j = t; j < n_slots; j += blockDim.x)
        if (here[ids[j]]) slot_list[atomicAdd(&cursor[ids[j]], 1)] = j;
}
