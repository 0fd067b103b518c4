// The tensor-core kernels of many tokens (prefill): grouped dense products
// and the routed experts' gate/up and down per expert task, each on either
// input: x split into bf16 hi/lo pairs (mma.cu's tiles, f32 activations,
// `qmma`, `moe_*_mma`) or rounded to 8 bits (mma_q8.cu's, 4-bit affine
// matrices under `--gpu-activations q8`, `*_q8`, with 4 row tiles a warp
// `*_q8_m4`). The layout of blocks and warps is the same for both.

#define MMA_NT 4  // 8-token tiles a warp

// A warp's tile over tokens tok0 .. of count on either input (xp / xs:
// mma_split's pairs and group sums, or q8_rows' bytes and {dx, sum}).
template <bool Q8, int MT, bool MX_OK, class Tok>
__device__ __forceinline__ void mma_tokens_any(const QW* const (&q)[MT], const int (&row0)[MT], int tok0, int count,
                                               Tok tok, const void* xp, const void* xs, bool mx,
                                               float (&acc)[MT][MMA_NT][4]) {
    if constexpr (Q8)
        mma_tokens_q8<MT, MMA_NT>(q, row0, tok0, count, tok, (const u32*)xp, (const float2*)xs, acc);
    else
        mma_tokens<MT, MMA_NT, MX_OK>(q, row0, tok0, count, tok, (const uint4*)xp, (const float*)xs, mx, acc);
}

// Grouped products of one input for n tokens (like qmatmul): a block of 4
// warps covers 32 MT rows x 64 tokens (2 x 2 warps of 16 MT rows x 32
// tokens); blockIdx.x picks the matrix and row block, blockIdx.y the token
// block.
template <bool Q8, int MT>
__device__ __forceinline__ void qmma_body(const MultiMatmul& mm, const void* xp, const void* xs, int n) {
    PDL_ENTER();
    int m = 0;
    while (m + 1 < mm.count && (int)blockIdx.x >= mm.first_block[m + 1]) m++;
    const QW& q = mm.q[m];
    int w = threadIdx.x >> 5;
    int r0 = (blockIdx.x - mm.first_block[m]) * 32 * MT + (w & 1) * 16 * MT;
    int tok0 = blockIdx.y * 64 + (w >> 1) * 32;
    if (r0 >= q.rows || tok0 >= n) return;
    const QW* qs[MT];
    int row0[MT];
#pragma unroll
    for (int i = 0; i < MT; i++) qs[i] = &q, row0[i] = r0 + 16 * i;
    float acc[MT][MMA_NT][4];
    mma_tokens_any<Q8, MT, false>(qs, row0, tok0, n, [](int i) { return i; }, xp, xs, false, acc);
    bool add = (mm.accumulate >> m) & 1;
    float* out = mm.out[m];
    mma_each<MT, MMA_NT>(row0, tok0, [&](int mt, int nn, int c, int r, int tk) {
        if (r < q.rows && tk < n) {
            long oi = (long)tk * q.rows + r;
            out[oi] = add ? out[oi] + acc[mt][nn][c] : acc[mt][nn][c];
        }
    });
}

// act = silu(gate_e x) * (up_e x) for every expert task and its tokens (like
// moe_gate_up_b*): blockIdx.y = task, a warp GT 16-row tiles of gate and the
// same of up (a block of 4 warps 64 GT intermediate rows), the task's tokens
// 32 at a time; x's rows are tokens (slot / k).
template <bool Q8, int GT>
__device__ __forceinline__ void moe_gate_up_mma_body(const ExpertTask* tasks, const ExpertLayout& L,
                                                     const int* slot_list, int k, const void* xp, const void* xs,
                                                     float* act) {
    PDL_ENTER();
    ExpertTask T = tasks[blockIdx.y];
    int w = threadIdx.x >> 5;
    QW gq = expert_qw(T.base, L.gate_w, L.gate_s, L.gate_b, L.inter, L.hidden, L);
    QW uq = expert_qw(T.base, L.up_w, L.up_s, L.up_b, L.inter, L.hidden, L);
    int r0 = blockIdx.x * 64 * GT + w * 16 * GT;
    if (r0 >= L.inter) return;
    const int* sl = slot_list + T.first;
    const QW* qs[2 * GT];
    int row0[2 * GT], gate_rows[GT];
#pragma unroll
    for (int i = 0; i < GT; i++) {
        qs[i] = &gq, qs[GT + i] = &uq;
        row0[i] = row0[GT + i] = gate_rows[i] = r0 + 16 * i;
    }
    for (int tok0 = 0; tok0 < T.count; tok0 += 8 * MMA_NT) {
        float acc[2 * GT][MMA_NT][4];
        mma_tokens_any<Q8, 2 * GT, true>(qs, row0, tok0, T.count, [&](int i) { return sl[i] / k; }, xp, xs,
                                         L.mx != 0, acc);
        mma_each<GT, MMA_NT>(gate_rows, tok0, [&](int mt, int nn, int c, int r, int i) {
            if (r < L.inter && i < T.count)
                act[(long)(T.first + i) * L.inter + r] =
                    expert_glu(L, sl[i], r, acc[mt][nn][c], acc[GT + mt][nn][c]);
        });
    }
}

// slot_out[slot] = down_e act for every task and its tokens (like
// moe_down_b*): a warp MT 16-row tiles (a block 64 MT hidden rows), the
// task's tokens 32 at a time; act's rows are slot positions.
template <bool Q8, int MT>
__device__ __forceinline__ void moe_down_mma_body(const ExpertTask* tasks, const ExpertLayout& L,
                                                  const int* slot_list, const void* xp, const void* xs,
                                                  float* slot_out) {
    PDL_ENTER();
    ExpertTask T = tasks[blockIdx.y];
    int w = threadIdx.x >> 5;
    QW dq = expert_down_qw(T.base, L);
    int r0 = blockIdx.x * 64 * MT + w * 16 * MT;
    if (r0 >= L.hidden) return;
    const QW* qs[MT];
    int row0[MT];
#pragma unroll
    for (int i = 0; i < MT; i++) qs[i] = &dq, row0[i] = r0 + 16 * i;
    for (int tok0 = 0; tok0 < T.count; tok0 += 8 * MMA_NT) {
        float acc[MT][MMA_NT][4];
        mma_tokens_any<Q8, MT, true>(qs, row0, tok0, T.count, [&](int i) { return T.first + i; }, xp, xs,
                                     L.mx != 0, acc);
        mma_each<MT, MMA_NT>(row0, tok0, [&](int mt, int nn, int c, int r, int i) {
            if (r < L.hidden && i < T.count) {
                int slot = slot_list[T.first + i];
                slot_out[(long)slot * L.hidden + r] = acc[mt][nn][c] + expert_down_bias(L, slot, r);
            }
        });
    }
}

// Entry points: XP / XS the input's pointer types, Q8 the tile kind, MT the row
// tiles a warp (gate/up: half of them gate's).
#define MMA_KERNELS(SFX, XP, XS, Q8, MT)                                                                   \
    extern "C" __global__ void __launch_bounds__(128) qmma##SFX(MultiMatmul mm, XP xp, XS xs, int n) {     \
        qmma_body<Q8, MT>(mm, xp, xs, n);                                                                  \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(128)                                                     \
        moe_gate_up_mma##SFX(const ExpertTask* tasks, ExpertLayout L, const int* slot_list, int k, XP xp,  \
                             XS xs, float* act) {                                                          \
        moe_gate_up_mma_body<Q8, MT / 2>(tasks, L, slot_list, k, xp, xs, act);                             \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(128)                                                     \
        moe_down_mma##SFX(const ExpertTask* tasks, ExpertLayout L, const int* slot_list, XP xp, XS xs,     \
                          float* slot_out) {                                                               \
        moe_down_mma_body<Q8, MT>(tasks, L, slot_list, xp, xs, slot_out);                                  \
    }
MMA_KERNELS(, const uint4*, const float*, false, 2)
// qmma with one 16-row tile a warp (32 rows a block): twice the blocks, for
// launches too small to fill the SMs (the routers of a short prefill). Each
// output's sum is the same, in the same order, as qmma's.
extern "C" __global__ void __launch_bounds__(128) qmma_m1(MultiMatmul mm, const uint4* xp, const float* xs, int n) {
    qmma_body<false, 1>(mm, xp, xs, n);
}
MMA_KERNELS(_q8, const u32*, const float2*, true, 2)
MMA_KERNELS(_q8_m4, const u32*, const float2*, true, 4)
