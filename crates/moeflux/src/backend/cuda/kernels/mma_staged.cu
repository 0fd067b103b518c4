// Tensor-core products of many tokens on 8-bit activations with their
// operands staged in shared memory: the q8 contract and integer sums of
// mma_q8.cu, with a block's weight and activation tiles brought in by
// cp.async several stages ahead and shared by its warps. The kernels of
// mma_products.cu load each warp's operands from L1/L2 as it needs them, so
// a warp waits out one round trip per 32 columns and the same bytes are
// fetched by every warp that uses them.
//
// A block: 8 warps, SQ_ROWS rows x SQ_TOKS tokens; warp w covers 32 rows
// (two 16-row tiles, from row 32 (w & 3)) by 32 tokens (four 8-token tiles,
// from token 32 (w >> 2)). A stage: 64 columns (two 32-column blocks) of the
// block's rows and tokens. A block's int sum goes straight into the output
// accumulator times dx x scale (mma_q8.cu sums a group's blocks times dx
// first, then scales): 32 registers fewer, which keeps the kernel at two
// blocks an SM without spilling; the same contract, another f32 order.

#define SQ_ROWS 128
#define SQ_TOKS 64
#define SQ_STAGES 5
#define SQ_THREADS 256

// 2^23 + 2^22 as float bits: an int sum s (|s| < 2^22) added to it is the
// float 12582912 + s, so one subtraction converts it exactly (no I2F, which
// runs at a fraction of the FMA rate).
#define SQ_MAGIC 0x4B400000
#define SQ_MAGIC_F 12582912.0f

// One stage in shared memory. Weights: a row's two 16-byte blocks, the pair
// swapped in rows 4-7 of every 8 so that a warp's reads of word t of one
// block of 8 rows hit 32 different banks. Activations: a token's four
// 16-byte chunks (block 0 even and odd words, block 1 likewise), chunk c
// stored at c ^ ((token >> 1) & 3) for the same reason. {dx, sum} per block
// and token, tokens consecutive so a lane reads its two tokens' at once.
struct alignas(16) SqStage {
    u32 w[SQ_ROWS * 8];
    u32 x[SQ_TOKS * 16];
    float2 d[2 * SQ_TOKS];
};

// Where a thread's share of every stage comes from and goes: weight row
// i >> 1, block i & 1; token i >> 2, chunk i & 3; and (threads < 128) the
// {dx, sum} of block i >> 6 of token i & 63. The source pointers start at
// column 0 of the thread's share and move on 64 columns with each stage
// loaded (stages load in order: weights and activations each keep their
// own place), so no stage index is multiplied out per copy; the offsets
// within a stage are fixed.
struct SqSource {
    const u32* w;
    const u32* x;
    const float2* d;
    int ow, ox;   // u32 offsets in SqStage::w, SqStage::x
    bool x_live;  // this thread's token is real
    bool d_live;  // this thread copies a real token's {dx, sum}
};

__device__ __forceinline__ void sq_load_weights(SqStage& st, SqSource& src) {
    cp_async16(&st.w[src.ow], src.w);
    src.w += 8;
}

__device__ __forceinline__ void sq_load_acts(SqStage& st, SqSource& src) {
    if (src.x_live) cp_async16(&st.x[src.ox], src.x);
    if (src.d_live) cp_async8(&st.d[threadIdx.x], src.d);
    src.x += 16;
    src.d += 2;
}

// Scale or bias i of p (bf16, or f32 when f32) as f32 bits: one address for
// either width (a load of each width at its own address, both predicated,
// took twice the address arithmetic).
__device__ __forceinline__ u32 sq_param(const void* p, int i, int f32) {
    const char* a = (const char*)p + ((unsigned)i << (1 + f32));
    return f32 ? *(const u32*)a : (u32)(*(const u16*)a) << 16;
}

// A block's tile of 32-column blocks 0 .. cols / 32 on q8_rows' output. The
// block's SQ_ROWS staged rows: row r's codes (4 bits) at wrow(r). A warp's
// 16-row tile m starts at staged row 32 (w & 3) + 16 m, or with SPLIT at
// 64 m + 16 (w & 3) (gate/up: the first 64 staged rows gate's, the rest
// up's); its scales and biases are qm[m]'s at index pidx(m, h) + group for
// the lane's rows gq + 8 h. Tokens j of SQ_TOKS at xrow(j) (an input row),
// j < live real (the others' rows are not staged: their columns hold
// garbage and are never stored); FULL: live >= SQ_TOKS (no tile is left
// out, which saves a branch per 8-token tile). acc in the mma C layout
// (mma_each). With EARLY the first stages' weights and the first group's
// scales are requested before waiting for the previous kernel (weights are
// never written by a kernel); otherwise the caller has waited. Ends with a
// barrier, so the caller may stage again.
//
// A group's scales are loaded a group ahead and its biases at its start
// (they are used at its end), so that neither L2 round trip stalls the
// warp at the group's start. The scales are kept as f32 bits (a bf16's
// shifted) rather than through qparam: converted at the load, gate/up
// spilled and qmma_q8s's stage took 10 instructions more (NVRTC sm_90).
template <int G, bool EARLY, bool SPLIT, bool FULL, class WRow, class PIdx, class XRow>
__device__ __forceinline__ void sq_tile(SqStage* st, int cols, const QW* const (&qm)[2], WRow wrow, PIdx pidx,
                                        XRow xrow, const u32* xq, const float2* dxs, int live,
                                        float (&acc)[2][4][4]) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3, w = threadIdx.x >> 5;
    const int wr = w & 3, wc = w >> 2, i = threadIdx.x;
    SqSource src;
    {
        const int r = i >> 1, c = i & 1, tk = i >> 2, cx = i & 3;
        src.w = wrow(r) + 4 * c;
        src.x = xq + xrow(tk) * (cols / 4) + 4 * cx;
        src.d = dxs + xrow(i & 63) * (cols / 32) + (i >> 6);
        src.ow = r * 8 + 4 * (c ^ ((r >> 2) & 1));
        src.ox = tk * 16 + 4 * (cx ^ ((tk >> 1) & 3));
        src.x_live = tk < live;
        src.d_live = i < 2 * SQ_TOKS && (i & 63) < live;
    }
    const int stages = cols / 64, groups = cols / (32 * G);
    // Both matrices of a tile have one parameter type (gate and up: their
    // layout's); read once, not per group from the kernel's parameters.
    const int f32 = qm[0]->sf32;
    int pi[2][2];
    u32 next_s[2][2];
    auto fetch = [&]() {
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                next_s[m][h] = sq_param(qm[m]->s, pi[m][h], f32);
    };
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) pi[m][h] = (int)pidx(m, h);  // a matrix has < 2^31 groups
    if constexpr (EARLY) {
#pragma unroll
        for (int s = 0; s < SQ_STAGES - 1; s++)
            if (s < stages) sq_load_weights(st[s], src);
        fetch();
        PDL_ENTER();
    }
#pragma unroll
    for (int s = 0; s < SQ_STAGES - 1; s++) {
        if (s < stages) {
            if constexpr (!EARLY) sq_load_weights(st[s], src);
            sq_load_acts(st[s], src);
        }
        cp_async_commit();
    }
    if constexpr (!EARLY) fetch();
    // Warp-uniform: the warp's 8-token tiles that hold real tokens.
    const int nt_live = FULL ? 4 : min(4, max(0, (live - 32 * wc + 7) / 8));
    float xsum[4][2], sc[2][2], bi[2][2];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int n = 0; n < 4; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[m][n][c] = 0.0f;
    const int sw = (gq >> 2) & 1, sx = (gq >> 1) & 3;
    int slot = 0;  // ks % SQ_STAGES
    for (int ks = 0; ks < stages; ks++) {
        cp_async_wait<SQ_STAGES - 2>();
        __syncthreads();
        {
            int nx = ks + SQ_STAGES - 1, ns = slot == 0 ? SQ_STAGES - 1 : slot - 1;
            if (nx < stages) {
                sq_load_weights(st[ns], src);
                sq_load_acts(st[ns], src);
            }
            cp_async_commit();
        }
        const SqStage& S = st[slot];
        slot = slot == SQ_STAGES - 1 ? 0 : slot + 1;
#pragma unroll
        for (int b = 0; b < 2; b++) {
            const int blk = 2 * ks + b;
            if (blk % G == 0) {
#pragma unroll
                for (int m = 0; m < 2; m++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        sc[m][h] = __uint_as_float(next_s[m][h]);
                        bi[m][h] = __uint_as_float(sq_param(qm[m]->b, pi[m][h], f32));
                        pi[m][h]++;
                    }
                if (blk / G + 1 < groups) fetch();
#pragma unroll
                for (int n = 0; n < 4; n++) xsum[n][0] = xsum[n][1] = 0.0f;
            }
            u32 a[2][4];
#pragma unroll
            for (int m = 0; m < 2; m++) {
                const int r = (SPLIT ? 64 * m + 16 * wr : 32 * wr + 16 * m) + gq;
                u32 w0 = S.w[r * 8 + 4 * (b ^ sw) + t], w1 = S.w[(r + 8) * 8 + 4 * (b ^ sw) + t];
                a[m][0] = w0 & 0x0F0F0F0Fu;
                a[m][1] = w1 & 0x0F0F0F0Fu;
                a[m][2] = (w0 >> 4) & 0x0F0F0F0Fu;
                a[m][3] = (w1 >> 4) & 0x0F0F0F0Fu;
            }
#pragma unroll
            for (int n = 0; n < 4; n++) {
                if (!FULL && n >= nt_live) break;
                const int tk = 32 * wc + 8 * n + gq;
                u32 b0 = S.x[tk * 16 + 4 * ((2 * b) ^ sx) + t], b1 = S.x[tk * 16 + 4 * ((2 * b + 1) ^ sx) + t];
                float4 d = *(const float4*)&S.d[b * SQ_TOKS + 32 * wc + 8 * n + 2 * t];
                xsum[n][0] += d.y;
                xsum[n][1] += d.w;
#pragma unroll
                for (int m = 0; m < 2; m++) {
                    int s[4] = {SQ_MAGIC, SQ_MAGIC, SQ_MAGIC, SQ_MAGIC};
                    mma_u8s8(s, a[m][0], a[m][1], a[m][2], a[m][3], b0, b1);
                    acc[m][n][0] = fmaf(__int_as_float(s[0]) - SQ_MAGIC_F, sc[m][0] * d.x, acc[m][n][0]);
                    acc[m][n][1] = fmaf(__int_as_float(s[1]) - SQ_MAGIC_F, sc[m][0] * d.z, acc[m][n][1]);
                    acc[m][n][2] = fmaf(__int_as_float(s[2]) - SQ_MAGIC_F, sc[m][1] * d.x, acc[m][n][2]);
                    acc[m][n][3] = fmaf(__int_as_float(s[3]) - SQ_MAGIC_F, sc[m][1] * d.z, acc[m][n][3]);
                }
            }
            if ((blk + 1) % G == 0) {
#pragma unroll
                for (int m = 0; m < 2; m++)
#pragma unroll
                    for (int n = 0; n < 4; n++) {
                        if (!FULL && n >= nt_live) break;
                        acc[m][n][0] = fmaf(bi[m][0], xsum[n][0], acc[m][n][0]);
                        acc[m][n][1] = fmaf(bi[m][0], xsum[n][1], acc[m][n][1]);
                        acc[m][n][2] = fmaf(bi[m][1], xsum[n][0], acc[m][n][2]);
                        acc[m][n][3] = fmaf(bi[m][1], xsum[n][1], acc[m][n][3]);
                    }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();
}

// sq_tile for the group size gs (32, 64 or 128); with FULL_OK, the FULL
// variant where the block's tokens are all real (it spills at 128
// registers in the kernels whose warps cover two 16-row tiles of one
// matrix: there it is not taken).
template <bool EARLY, bool SPLIT, bool FULL_OK, class WRow, class PIdx, class XRow>
__device__ __forceinline__ void sq_tile_gs(SqStage* st, int gs, int cols, const QW* const (&qm)[2], WRow wrow,
                                           PIdx pidx, XRow xrow, const u32* xq, const float2* dxs, int live,
                                           float (&acc)[2][4][4]) {
    if (FULL_OK && live >= SQ_TOKS) {
        if (gs == 64)
            sq_tile<2, EARLY, SPLIT, FULL_OK>(st, cols, qm, wrow, pidx, xrow, xq, dxs, live, acc);
        else if (gs == 32)
            sq_tile<1, EARLY, SPLIT, FULL_OK>(st, cols, qm, wrow, pidx, xrow, xq, dxs, live, acc);
        else
            sq_tile<4, EARLY, SPLIT, FULL_OK>(st, cols, qm, wrow, pidx, xrow, xq, dxs, live, acc);
    } else if (gs == 64)
        sq_tile<2, EARLY, SPLIT, false>(st, cols, qm, wrow, pidx, xrow, xq, dxs, live, acc);
    else if (gs == 32)
        sq_tile<1, EARLY, SPLIT, false>(st, cols, qm, wrow, pidx, xrow, xq, dxs, live, acc);
    else
        sq_tile<4, EARLY, SPLIT, false>(st, cols, qm, wrow, pidx, xrow, xq, dxs, live, acc);
}

// Grouped products of one input for n tokens on q8_rows' output (like
// qmma_q8): blockIdx.x picks the matrix and its block of SQ_ROWS rows,
// blockIdx.y the block of SQ_TOKS tokens. Columns a multiple of 64.
extern "C" __global__ void __launch_bounds__(SQ_THREADS, 2)
    qmma_q8s(MultiMatmul mm, const u32* xq, const float2* dxs, int n) {
    __shared__ SqStage st[SQ_STAGES];
    int m = 0;
    while (m + 1 < mm.count && (int)blockIdx.x >= mm.first_block[m + 1]) m++;
    const QW& q = mm.q[m];
    const int r0 = (blockIdx.x - mm.first_block[m]) * SQ_ROWS, tok0 = blockIdx.y * SQ_TOKS;
    const int w = threadIdx.x >> 5, gq = (threadIdx.x & 31) >> 2, groups = q.cols / q.gs;
    const QW* qm[2] = {&q, &q};
    auto row = [&](int r) { return min(r0 + r, q.rows - 1); };
    float acc[2][4][4];
    sq_tile_gs<true, false, false>(
        st, q.gs, q.cols, qm, [&](int r) { return q.w + (long)row(r) * (q.cols / 8); },
        [&](int mt, int h) { return (long)row(32 * (w & 3) + 16 * mt + gq + 8 * h) * groups; },
        [&](int j) { return (long)min(tok0 + j, n - 1); }, xq, dxs, n - tok0, acc);
    const int row0[2] = {r0 + 32 * (w & 3), r0 + 32 * (w & 3) + 16};
    bool add = (mm.accumulate >> m) & 1;
    float* out = mm.out[m];
    mma_each<2, 4>(row0, tok0 + 32 * (w >> 2), [&](int mt, int nn, int c, int r, int tk) {
        if (r < q.rows && tk < n) {
            long oi = (long)tk * q.rows + r;
            out[oi] = add ? out[oi] + acc[mt][nn][c] : acc[mt][nn][c];
        }
    });
}

// act = silu(gate_e x) * (up_e x) for every expert task and its tokens (like
// moe_gate_up_mma_q8): blockIdx.y = task, blockIdx.x a block of 64
// intermediate rows of gate and the same of up (a warp 16 of each), the
// task's tokens SQ_TOKS at a time; x's rows are tokens (slot / k).
extern "C" __global__ void __launch_bounds__(SQ_THREADS, 2)
    moe_gate_up_mma_q8s(const ExpertTask* tasks, ExpertLayout L, const int* slot_list, int k, const u32* xq,
                        const float2* dxs, float* act) {
    __shared__ SqStage st[SQ_STAGES];
    PDL_ENTER();
    const ExpertTask T = tasks[blockIdx.y];
    const QW gq_ = expert_qw(T.base, L.gate_w, L.gate_s, L.gate_b, L.inter, L.hidden, L);
    const QW uq = expert_qw(T.base, L.up_w, L.up_s, L.up_b, L.inter, L.hidden, L);
    const QW* qm[2] = {&gq_, &uq};
    const int r0 = blockIdx.x * 64, w = threadIdx.x >> 5, gq = (threadIdx.x & 31) >> 2;
    const int groups = L.hidden / L.gs;
    const int* sl = slot_list + T.first;
    auto row = [&](int r) { return min(r0 + r, L.inter - 1); };
    const int row0[1] = {r0 + 16 * (w & 3)};
    for (int tok0 = 0; tok0 < T.count; tok0 += SQ_TOKS) {
        float acc[2][4][4];
        sq_tile_gs<false, true, true>(
            st, L.gs, L.hidden, qm,
            [&](int r) { return (r < 64 ? gq_.w : uq.w) + (long)row(r & 63) * (L.hidden / 8); },
            [&](int, int h) { return (long)row(16 * (w & 3) + gq + 8 * h) * groups; },
            [&](int j) { return (long)(sl[min(tok0 + j, T.count - 1)] / k); }, xq, dxs, T.count - tok0, acc);
        mma_each<1, 4>(row0, tok0 + 32 * (w >> 2), [&](int, int nn, int c, int r, int i) {
            if (r < L.inter && i < T.count)
                act[(long)(T.first + i) * L.inter + r] = expert_glu(L, sl[i], r, acc[0][nn][c], acc[1][nn][c]);
        });
    }
}

// slot_out[slot] = down_e act for every task and its tokens (like
// moe_down_mma_q8): blockIdx.y = task, blockIdx.x a block of SQ_ROWS hidden
// rows, the task's tokens SQ_TOKS at a time; act's rows are slot positions.
extern "C" __global__ void __launch_bounds__(SQ_THREADS, 2)
    moe_down_mma_q8s(const ExpertTask* tasks, ExpertLayout L, const int* slot_list, const u32* xq,
                     const float2* dxs, float* slot_out) {
    __shared__ SqStage st[SQ_STAGES];
    PDL_ENTER();
    const ExpertTask T = tasks[blockIdx.y];
    const QW dq = expert_down_qw(T.base, L);
    const QW* qm[2] = {&dq, &dq};
    const int r0 = blockIdx.x * SQ_ROWS, w = threadIdx.x >> 5, gq = (threadIdx.x & 31) >> 2;
    const int groups = L.inter / L.down_gs;
    auto row = [&](int r) { return min(r0 + r, L.hidden - 1); };
    const int row0[2] = {r0 + 32 * (w & 3), r0 + 32 * (w & 3) + 16};
    for (int tok0 = 0; tok0 < T.count; tok0 += SQ_TOKS) {
        float acc[2][4][4];
        sq_tile_gs<false, false, false>(
            st, L.down_gs, L.inter, qm, [&](int r) { return dq.w + (long)row(r) * (L.inter / 8); },
            [&](int mt, int h) { return (long)row(32 * (w & 3) + 16 * mt + gq + 8 * h) * groups; },
            [&](int j) { return (long)(T.first + min(tok0 + j, T.count - 1)); }, xq, dxs, T.count - tok0, acc);
        mma_each<2, 4>(row0, tok0 + 32 * (w >> 2), [&](int mt, int nn, int c, int r, int i) {
            if (r < L.hidden && i < T.count) {
                int slot = slot_list[T.first + i];
                slot_out[(long)slot * L.hidden + r] = acc[mt][nn][c] + expert_down_bias(L, slot, r);
            }
        });
    }
}
