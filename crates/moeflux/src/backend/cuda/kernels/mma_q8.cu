// Tensor-core products of many tokens on 8-bit activations
// (`--gpu-activations q8`, 4-bit affine matrices): the q8 contract of the
// one-token kernels (qdot.cu) with the integer dots on the tensor cores.
//
// x is rounded once per product (q8_rows: per token and 32 columns, xq =
// round(x * 127 / max|x|), dx = max|x| / 127 and the f32 sum of the
// unrounded block), then one mma.sync m16n8k32 (u8 codes, s8 xq, s32 out)
// sums a 32-column block of 16 rows x 8 tokens exactly. A lane t of a quad
// supplies k = 4t .. 4t + 3 and 16 + 4t .. of each step; only the sum
// matters, so lane t takes word t of the block's four code words: its even
// nibbles (w & 0x0F0F0F0F) as the first four k and its odd ones as the
// last, which meet xq's ints 8b + t and 8b + 4 + t in qdot_round's layout
// without any permutation. Per block the int sums become f32 times the
// token's dx; per group, times the row's scale, plus its bias times the
// group's sum of x. Against the bf16 hi/lo path (mma.cu) an activation is
// one byte instead of four and a block one MMA instead of four.

// d += a . b for one 16x8x32 tile (u8 a, s8 b, s32 accumulate).
__device__ __forceinline__ void mma_u8s8(int (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#elif defined(__CUDA_ARCH__)
    __trap();  // the host never picks these kernels below sm_80
#elif defined(EMU_MMA)
    emu_mma_u8s8(d, a0, a1, a2, a3, b0, b1);
#endif
}

// x[n][cols] rounded by the q8 contract: xq[n][cols / 4] (qdot_round's
// layout per token) and dxs[n][cols / 32] = {dx, sum}. A thread per code
// word; the four words of a block are consecutive lanes.
extern "C" __global__ void q8_rows(const float* x, long n, int cols, u32* xq, float2* dxs) {
    PDL_ENTER();
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const int words = cols / 8;
    bool on = i < n * words;
    long tok = on ? i / words : 0;
    int w = on ? (int)(i % words) : 0;
    float v[8];
    const float4* p = (const float4*)(x + tok * cols + 8 * w);
    float4 a = on ? p[0] : make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = on ? p[1] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    u32 even, odd;
    float dx, sum;
    q8_round_word(v, even, odd, dx, sum);
    if (!on) return;
    int blk = w / 4, k = w % 4;
    u32* row = xq + tok * (cols / 4);
    row[8 * blk + k] = even;
    row[8 * blk + 4 + k] = odd;
    if (k == 0) dxs[tok * (cols / 32) + blk] = make_float2(dx, sum);
}

// A warp's tile as mma_tile's (MT 16-row tiles of q[m] from row0[m] times
// NT 8-token tiles, the mma C layout in acc; tiles n >= nt_live skipped) on
// q8_rows' input: the lane's token of tile n at xq_tok[n], its quad's
// tokens' {dx, sum} rows at dxs_q[n][0..1]. G = gs / 32 blocks a group.
template <int G, int MT, int NT>
__device__ __forceinline__ void mma_tile_q8(const QW* const (&q)[MT], const int (&row0)[MT],
                                            const u32* const (&xq_tok)[NT], const float2* const (&dxs_q)[NT][2],
                                            int nt_live, float (&acc)[MT][NT][4]) {
    int lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3;
    const int cols = q[0]->cols, groups = cols / (32 * G);
    const u32* wrow[MT][2];
    long prow[MT][2];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int r = min(row0[m] + gq + 8 * h, q[m]->rows - 1);
            wrow[m][h] = q[m]->w + (long)r * (cols / 8) + t;
            prow[m][h] = (long)r * groups;
        }
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[m][n][c] = 0.0f;
    for (int g = 0; g < groups; g++) {
        float part[MT][NT][4], xsum[NT][2];
#pragma unroll
        for (int n = 0; n < NT; n++) {
            xsum[n][0] = xsum[n][1] = 0.0f;
#pragma unroll
            for (int m = 0; m < MT; m++)
#pragma unroll
                for (int c = 0; c < 4; c++) part[m][n][c] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < G; j++) {
            const int b = g * G + j;
            u32 a[MT][4];
#pragma unroll
            for (int m = 0; m < MT; m++) {
                u32 w0 = __ldg(wrow[m][0] + 4 * b), w1 = __ldg(wrow[m][1] + 4 * b);
                a[m][0] = w0 & 0x0F0F0F0Fu;
                a[m][1] = w1 & 0x0F0F0F0Fu;
                a[m][2] = (w0 >> 4) & 0x0F0F0F0Fu;
                a[m][3] = (w1 >> 4) & 0x0F0F0F0Fu;
            }
#pragma unroll
            for (int n = 0; n < NT; n++) {
                if (n >= nt_live) break;
                u32 b0 = xq_tok[n][8 * b + t], b1 = xq_tok[n][8 * b + 4 + t];
                float2 d0 = dxs_q[n][0][b], d1 = dxs_q[n][1][b];
                xsum[n][0] += d0.y;
                xsum[n][1] += d1.y;
#pragma unroll
                for (int m = 0; m < MT; m++) {
                    int s[4] = {0, 0, 0, 0};
                    mma_u8s8(s, a[m][0], a[m][1], a[m][2], a[m][3], b0, b1);
                    part[m][n][0] = fmaf((float)s[0], d0.x, part[m][n][0]);
                    part[m][n][1] = fmaf((float)s[1], d1.x, part[m][n][1]);
                    part[m][n][2] = fmaf((float)s[2], d0.x, part[m][n][2]);
                    part[m][n][3] = fmaf((float)s[3], d1.x, part[m][n][3]);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < MT; m++) {
            float sc[2], bi[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                sc[h] = qparam(q[m]->s, prow[m][h] + g, q[m]->sf32);
                bi[h] = qparam(q[m]->b, prow[m][h] + g, q[m]->sf32);
            }
#pragma unroll
            for (int n = 0; n < NT; n++) {
                if (n >= nt_live) break;
                acc[m][n][0] += sc[0] * part[m][n][0] + bi[0] * xsum[n][0];
                acc[m][n][1] += sc[0] * part[m][n][1] + bi[0] * xsum[n][1];
                acc[m][n][2] += sc[1] * part[m][n][2] + bi[1] * xsum[n][0];
                acc[m][n][3] += sc[1] * part[m][n][3] + bi[1] * xsum[n][1];
            }
        }
    }
}

// mma_tile_q8 for tokens tok0 .. of `count` (see mma_token_rows) on
// q8_rows' output, groups of gs in {32, 64, 128}.
template <int MT, int NT, class Tok>
__device__ __forceinline__ void mma_tokens_q8(const QW* const (&q)[MT], const int (&row0)[MT], int tok0, int count,
                                              Tok tok, const u32* xq, const float2* dxs, float (&acc)[MT][NT][4]) {
    const int cols = q[0]->cols;
    const u32* xq_tok[NT];
    const float2* dxs_q[NT][2];
#pragma unroll
    for (int nn = 0; nn < NT; nn++) {
        long mine, q0, q1;
        mma_token_rows(tok0, nn, count, tok, mine, q0, q1);
        xq_tok[nn] = xq + mine * (cols / 4);
        dxs_q[nn][0] = dxs + q0 * (cols / 32);
        dxs_q[nn][1] = dxs + q1 * (cols / 32);
    }
    int live = min(NT, (count - tok0 + 7) / 8);
    if (q[0]->gs == 64)
        mma_tile_q8<2, MT, NT>(q, row0, xq_tok, dxs_q, live, acc);
    else if (q[0]->gs == 32)
        mma_tile_q8<1, MT, NT>(q, row0, xq_tok, dxs_q, live, acc);
    else
        mma_tile_q8<4, MT, NT>(q, row0, xq_tok, dxs_q, live, acc);
}

