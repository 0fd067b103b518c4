// Elementwise kernels and norms.

// RMSNorm, a block per row: out = x * w / sqrt(mean(x^2) + eps). A thread
// keeps its first NORM_REGS columns (i = threadIdx.x + u * blockDim.x) in
// registers, the weights of those loaded before the programmatic-launch
// wait (weights never depend on the previous kernel), so after the
// reduction only wider rows' columns are read again.
#define NORM_REGS 4

__device__ __forceinline__ void norm_weights(const float* w, int width, float (&wr)[NORM_REGS]) {
#pragma unroll
    for (int u = 0; u < NORM_REGS; u++) {
        int i = threadIdx.x + u * blockDim.x;
        wr[u] = i < width ? w[i] : 0.0f;
    }
}

// out = xr * w / rms(xr), one row a block: xv and wr hold this thread's
// first NORM_REGS columns of xr and w (as norm_weights lays them out), ss
// its sum of squares of all its columns in increasing order (fmaf). rms_norm
// and moe_combine_norm both end here, so the two agree bit for bit.
__device__ __forceinline__ void rms_norm_row(const float* xr, const float (&xv)[NORM_REGS], const float* w,
                                             const float (&wr)[NORM_REGS], int width, float eps, float ss,
                                             float* out) {
    ss = block_sum(ss);
    float inv = rsqrtf(ss / width + eps);
#pragma unroll
    for (int u = 0; u < NORM_REGS; u++) {
        int i = threadIdx.x + u * blockDim.x;
        if (i < width) out[i] = xv[u] * inv * wr[u];
    }
    for (int i = threadIdx.x + NORM_REGS * blockDim.x; i < width; i += blockDim.x) out[i] = xr[i] * inv * w[i];
}

extern "C" __global__ void rms_norm(const float* x, const float* w, int width, float eps, float* out) {
    float wr[NORM_REGS];
    norm_weights(w, width, wr);
    PDL_ENTER();
    const float* xr = x + (long)blockIdx.x * width;
    float xv[NORM_REGS], ss = 0.0f;
#pragma unroll
    for (int u = 0; u < NORM_REGS; u++) {
        int i = threadIdx.x + u * blockDim.x;
        xv[u] = i < width ? xr[i] : 0.0f;
        ss = fmaf(xv[u], xv[u], ss);
    }
    for (int i = threadIdx.x + NORM_REGS * blockDim.x; i < width; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    rms_norm_row(xr, xv, w, wr, width, eps, ss, out + (long)blockIdx.x * width);
}

// The most likely token of each logits row: the index of the first of its
// largest values, what greedy sampling on the host picks; -1 when the row
// holds a NaN or an infinity (the host then reports non-finite logits, as
// for logits it reads itself). Two launches, so a row of a large vocabulary
// (248,320 logits) is read by many SMs rather than one: argmax_parts takes
// `span` values of row blockIdx.y per block, argmax_merge one row's parts.

// The block's (best, at, bad) into thread 0's: the largest value, the lowest
// index holding it, whether any thread saw a non-finite value. Any block size
// that is a multiple of 32, up to 1024.
__device__ __forceinline__ void block_argmax(float& best, int& at, int& bad) {
    __shared__ float sb[32];
    __shared__ int si[32], sbad[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int round = 0; round < 2; round++) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, at, o);
            bad |= __shfl_xor_sync(0xffffffffu, bad, o);
            if (ob > best || (ob == best && oi < at)) {
                best = ob;
                at = oi;
            }
        }
        if (round == 1) break;
        __syncthreads();
        if (lane == 0) {
            sb[w] = best;
            si[w] = at;
            sbad[w] = bad;
        }
        __syncthreads();
        int nw = blockDim.x >> 5;
        best = lane < nw ? sb[lane] : NEG_INF;
        at = lane < nw ? si[lane] : 0x7fffffff;
        bad = lane < nw ? sbad[lane] : 0;
    }
}

// Part blockIdx.x of row blockIdx.y (values part * span .. of v) into
// [row * gridDim.x + part] of pbest, pat, pbad.
extern "C" __global__ void argmax_parts(const float* x, int v, int span, float* pbest, int* pat, int* pbad) {
    PDL_ENTER();
    const float* r = x + (long)blockIdx.y * v;
    const int lo = blockIdx.x * span, hi = min(v, lo + span);
    float best = NEG_INF;
    int at = 0x7fffffff, bad = 0;
    // Each thread's indices ascend, so `>` keeps its first maximum.
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float a = r[i];
        if (!(fabsf(a) <= 3.402823466e38f)) bad = 1;  // NaN or an infinity
        else if (a > best) {
            best = a;
            at = i;
        }
    }
    block_argmax(best, at, bad);
    if (threadIdx.x == 0) {
        long o = (long)blockIdx.y * gridDim.x + blockIdx.x;
        pbest[o] = best;
        pat[o] = at;
        pbad[o] = bad;
    }
}

// Row blockIdx.x's `parts` partial answers into out[row].
extern "C" __global__ void argmax_merge(const float* pbest, const int* pat, const int* pbad, int parts, int* out) {
    PDL_ENTER();
    const long o = (long)blockIdx.x * parts;
    float best = NEG_INF;
    int at = 0x7fffffff, bad = 0;
    for (int p = threadIdx.x; p < parts; p += blockDim.x) {
        float b = pbest[o + p];
        int i = pat[o + p];
        bad |= pbad[o + p];
        if (b > best || (b == best && i < at)) {
            best = b;
            at = i;
        }
    }
    block_argmax(best, at, bad);
    if (threadIdx.x == 0) out[blockIdx.x] = bad ? -1 : at;
}

extern "C" __global__ void swiglu(const float* g, const float* u, float* out, long n) { PDL_ENTER();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        out[i] = siluf_(g[i]) * u[i];
}


// x[t, i] += b[i] for n rows of `cols` (a bias on a product's output: gpt-oss's
// o_proj and router). Grid (rows, column blocks).
extern "C" __global__ void add_rows(float* x, const float* b, int cols) {
    PDL_ENTER();
    long t = blockIdx.x;
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < cols; i += gridDim.y * blockDim.x)
        x[t * cols + i] += b[i];
}
