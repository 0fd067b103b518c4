// One- and few-token products of 4-bit affine matrices on 8-bit activations
// (`--gpu-activations q8`), rows side by side in a warp (LPR lanes a row,
// R rows a lane group: the host picks them by the products' shape).
//
// The activation-stationary qmv kernels give each lane a fixed 16-byte slice
// of every row and stream the rows past it: with f32 activations that saves
// reloading them, but the per-chunk bookkeeping (row and group offsets, a
// block reduction per set) costs about as much as the 8-bit dot itself
// (kbench: qmv_b4q8 reaches 1.2-1.6 TB/s where a plain read reaches 3-4.4).
// Here a block first rounds its input into shared memory once (the q8
// contract of q8_prep, with its q8_code and q8_pack4: per 32 columns
// xq = round(x * 127 / max|x|), half away from zero, dx = max|x| / 127, and
// the f32 sum of the unrounded block for the biases), then each group of
// LPR lanes takes R whole rows at a time, lane s the 32-column blocks s,
// s + LPR, ... of each (16 bytes of codes a row), dotting codes and xq in
// integers (dp4a) and adding scale * dx * sum + bias * xsum per block in
// f32; a row's sum is a reduction over its lane group. Blocks loop over the
// row sets (grid-stride), so the rounding is paid once per block, not once
// per set.
//
// Every token's sums are computed the same way whatever T (tokens per
// launch), R and the grid (they depend on LPR only): a decode batch equals
// each sequence alone bit for bit. Shared memory per block: T * cols * 5 / 4 bytes (QD_MAX_COLS caps
// it at 40 KB for T = 4).
#define QD_MAX_COLS 8192  // QDOT_MAX_COLS in linear.rs

// The q8 contract for one code word (8 columns) of a 32-column block whose
// four words sit in four consecutive lanes (every lane of the warp calls it):
// the word's rounded inputs as two ints (even, odd: byte j column 2j,
// 2j + 1 of the word), the block's dx (NaN when it holds a NaN or an
// infinity) and the f32 sum of its unrounded inputs.
__device__ __forceinline__ void q8_round_word(const float (&v)[8], u32& even, u32& odd, float& dx, float& sum) {
    float m = fmaxf(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))),
                    fmaxf(fmaxf(fabsf(v[4]), fabsf(v[5])), fmaxf(fabsf(v[6]), fabsf(v[7]))));
    float s = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    float inv = m > 0.0f ? 127.0f / m : 0.0f;
    u32 q[8];
#pragma unroll
    for (int i = 0; i < 8; i++) q[i] = q8_code(v[i], inv);
    even = q8_pack4(q[0], q[2], q[4], q[6]);
    odd = q8_pack4(q[1], q[3], q[5], q[7]);
    dx = m / 127.0f + s * 0.0f;
    sum = s;
}

// Rounds tokens t0 .. t0 + T - 1 of x (n tokens of `cols`; tokens past n
// repeat the last) into smem: per token cols / 4 ints of xq (block b: ints
// 8b .. 8b + 4 the even columns of its four code words, byte j of int 8b + k
// column 32b + 8k + 2j; ints 8b + 4 .. 8b + 8 the odd ones), then cols / 32
// dx, then cols / 32 sums. GLU (one token): x holds [g | u] and the input
// is silu(g) * u. A thread takes one code word (8 columns) at a time.
template <int T, bool GLU>
__device__ __forceinline__ void qdot_round(const float* x, int cols, int n, int t0, int* smem) {
    const int words = cols / 8, nb = cols / 32;
    for (int base = 0; base < T * words; base += blockDim.x) {
        int j = base + threadIdx.x;
        bool on = j < T * words;
        int t = on ? j / words : 0, w = on ? j % words : 0;
        long tok = min(t0 + t, n - 1);
        float v[8];
        if (GLU) {
            const float* g = x + 8 * w;
            float4 a0 = ((const float4*)g)[0], a1 = ((const float4*)g)[1];
            float4 b0 = ((const float4*)(g + cols))[0], b1 = ((const float4*)(g + cols))[1];
            v[0] = siluf_(a0.x) * b0.x; v[1] = siluf_(a0.y) * b0.y; v[2] = siluf_(a0.z) * b0.z; v[3] = siluf_(a0.w) * b0.w;
            v[4] = siluf_(a1.x) * b1.x; v[5] = siluf_(a1.y) * b1.y; v[6] = siluf_(a1.z) * b1.z; v[7] = siluf_(a1.w) * b1.w;
        } else {
            const float4* p = (const float4*)(x + tok * cols + 8 * w);
            float4 a = p[0], b = p[1];
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        }
        if (!on)
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = 0.0f;
        u32 even, odd;
        float dx, sum;
        q8_round_word(v, even, odd, dx, sum);
        if (!on) continue;
        int b = w / 4, k = w % 4;
        int* xq = smem + t * (cols / 4);
        xq[8 * b + k] = (int)even;
        xq[8 * b + 4 + k] = (int)odd;
        if (k == 0) {
            float* dxs = (float*)(smem + T * (cols / 4)) + t * nb;
            dxs[b] = dx;
            dxs[T * nb + b] = sum;
        }
    }
}

// One 32-column block of a row: its 16 bytes of 4-bit codes c dotted with
// the block's rounded input (xe: the even columns of its four code words,
// xo: the odd ones, as qdot_round lays them out) in integers, added to acc
// as scale * dx * sum + bias * xs (xs: the unrounded block's sum).
__device__ __forceinline__ float qdot_block_acc(uint4 c, uint4 xe, uint4 xo, float scale, float bias, float dx,
                                                float xs, float acc) {
    int i = dp4a_us(c.x & 0x0F0F0F0Fu, xe.x, 0);
    i = dp4a_us((c.x >> 4) & 0x0F0F0F0Fu, xo.x, i);
    i = dp4a_us(c.y & 0x0F0F0F0Fu, xe.y, i);
    i = dp4a_us((c.y >> 4) & 0x0F0F0F0Fu, xo.y, i);
    i = dp4a_us(c.z & 0x0F0F0F0Fu, xe.z, i);
    i = dp4a_us((c.z >> 4) & 0x0F0F0F0Fu, xo.z, i);
    i = dp4a_us(c.w & 0x0F0F0F0Fu, xe.w, i);
    i = dp4a_us((c.w >> 4) & 0x0F0F0F0Fu, xo.w, i);
    acc = fmaf(scale * dx, (float)i, acc);
    return fmaf(bias, xs, acc);
}

// The sum of v over each aligned group of LPR lanes (every lane of a group
// ends with it; LPR 32: warp_sum).
template <int LPR>
__device__ __forceinline__ float lane_group_sum(float v) {
#pragma unroll
    for (int o = LPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Rows row[r] of the matrices *q[r] (all of one width; the same matrix may
// repeat) for the T tokens qdot_round left in smem, each lane group's share
// summed: acc[t][r] on every lane of the group (sub: the lane in its group).
template <int T, int R, int LPR>
__device__ __forceinline__ void qdot_rows(const QW* const (&q)[R], const long (&row)[R], const int* smem, int sub,
                                          float (&acc)[T][R]) {
    const int cols = q[0]->cols, nb = cols / 32;
    const float* dxs = (const float*)(smem + T * (cols / 4));
#pragma unroll
    for (int t = 0; t < T; t++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[t][r] = 0.0f;
    for (int b = sub; b < nb; b += LPR) {
        uint4 c[R];
        float sc[R], bi[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            const QW& w = *q[r];
            long g = row[r] * (cols / w.gs) + b / (w.gs / 32);
            c[r] = __ldg((const uint4*)w.w + row[r] * nb + b);
            sc[r] = qparam(w.s, g, w.sf32);
            bi[r] = qparam(w.b, g, w.sf32);
        }
#pragma unroll
        for (int t = 0; t < T; t++) {
            const uint4* xb = (const uint4*)(smem + t * (cols / 4) + 8 * b);
            uint4 xe = xb[0], xo = xb[1];
            float dx = dxs[t * nb + b], xs = dxs[(T + t) * nb + b];
#pragma unroll
            for (int r = 0; r < R; r++) acc[t][r] = qdot_block_acc(c[r], xe, xo, sc[r], bi[r], dx, xs, acc[t][r]);
        }
    }
#pragma unroll
    for (int t = 0; t < T; t++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[t][r] = lane_group_sum<LPR>(acc[t][r]);
}

// `out (+)= W x (+ bias)` for up to four 4-bit matrices of one input (a
// MultiMatmul whose first_block counts sets of 8 * (32 / LPR) * R rows),
// tokens T * blockIdx.y .. of n. LPR lanes a row: 32 / LPR row groups side
// by side in a warp. A row's sums depend on LPR only, not on T, R or the
// grid.
template <int T, bool GLU, int R, int LPR = 32>
__device__ __forceinline__ void qdot_body(const MultiMatmul& mm, const float* x, int n) {
    static_assert(T == 1 || !GLU, "SwiGLU inputs are one token's");
    extern __shared__ float qd_dyn[];  // 16-byte aligned, as attn_mma's uint4 tiles rely on
    int* qd_smem = (int*)qd_dyn;
    const int cols = mm.q[0].cols, t0 = blockIdx.y * T, nt = min(T, n - t0);
    const int nsets = mm.first_block[mm.count];
    constexpr int G = 32 / LPR;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sub = lane % LPR;
    PDL_WAIT();
    qdot_round<T, GLU>(x, cols, n, t0, qd_smem);
    __syncthreads();
    for (int set = blockIdx.x; set < nsets; set += gridDim.x) {
        int m = set_matrix(mm, set);
        const QW& q = mm.q[m];
        long r0 = ((long)(set - mm.first_block[m]) * 8 * G + warp * G + lane / LPR) * R;
        const QW* qs[R];
        long rows[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            qs[r] = &q;
            rows[r] = min(r0 + r, (long)q.rows - 1);
        }
        float acc[T][R];
        qdot_rows<T, R, LPR>(qs, rows, qd_smem, sub, acc);
        bool add = (mm.accumulate >> m) & 1;
        const float* bias = mm.bias[m];
#pragma unroll
        for (int t = 0; t < T; t++)
#pragma unroll
            for (int r = 0; r < R; r++) {
                float v = acc[t][r];
                long row = r0 + r;
                if (sub == 0 && t < nt && row < q.rows) {
                    float* out = mm.out[m] + (long)(t0 + t) * q.rows;
                    float o = add ? out[row] + v : v;
                    out[row] = bias ? o + bias[row] : o;
                }
            }
    }
}

#define QDOT_KERNEL(NAME, T, GLU, R, LPR)                                                              \
    extern "C" __global__ void __launch_bounds__(256) NAME(MultiMatmul mm, const float* x, int n) {    \
        PDL_TRIGGER();                                                                                 \
        qdot_body<T, GLU, R, LPR>(mm, x, n);                                                           \
    }
// Suffixes by lanes a row and rows a lane group (the host picks, qdot_shape
// in linear.rs): "" 32 lanes and two rows, _r1 32 and one, _l16 16 and two,
// _l8 8 and two.
#define QDOT_KERNELS(SFX, R, LPR)                         \
    QDOT_KERNEL(qdot_b4q8##SFX, 1, false, R, LPR)         \
    QDOT_KERNEL(qdot_b4q8_glu##SFX, 1, true, R, LPR)      \
    QDOT_KERNEL(qdot_b4q8_t4##SFX, 4, false, R, LPR)
QDOT_KERNELS(, 2, 32)
QDOT_KERNELS(_r1, 1, 32)
QDOT_KERNELS(_l16, 2, 16)
QDOT_KERNELS(_l8, 2, 8)
