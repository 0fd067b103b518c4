// Kernel micro-benchmark for the one-token (decode) products, and the prefill products
// of many tokens (section `prefill`): moeflux's kernels (kernels/all.cuh) on synthetic
// weights of real model widths, each timed as a CUDA graph of back-to-back launches (the
// decode products over rotating weight copies, so the reads come from device memory, not
// L2), and checked against each other. Built and run on the GPU machine by run.sh here.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <random>
#include <string>
#include <algorithm>
#include <cuda_runtime.h>

#include "../../../crates/moeflux/src/backend/cuda/kernels/all.cuh"
#include "../qmv_geometry.h"

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

static std::mt19937_64 rng(12345);
static int g_sms = 132;

static void* dev_random(size_t bytes) {
    std::vector<unsigned char> h(bytes);
    for (size_t i = 0; i < bytes; i += 8) { unsigned long long v = rng(); memcpy(&h[i], &v, std::min<size_t>(8, bytes - i)); }
    void* d; CK(cudaMalloc(&d, bytes)); CK(cudaMemcpy(d, h.data(), bytes, cudaMemcpyHostToDevice));
    return d;
}
static u16 to_bf16(float f) { u32 u; memcpy(&u, &f, 4); return (u16)(u >> 16); }
static void* dev_params(size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<u16> h(n); for (auto& v : h) v = to_bf16(d(rng));
    void* p; CK(cudaMalloc(&p, n * 2)); CK(cudaMemcpy(p, h.data(), n * 2, cudaMemcpyHostToDevice));
    return p;
}
static float* dev_floats(size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> h(n); for (auto& v : h) v = d(rng);
    float* p; CK(cudaMalloc(&p, n * 4)); CK(cudaMemcpy(p, h.data(), n * 4, cudaMemcpyHostToDevice));
    return p;
}
static QW make_qw(int rows, int cols, int bits, int gs) {
    QW q; size_t wb = (size_t)rows * cols * bits / 8; size_t np = (size_t)rows * (cols / gs);
    q.w = (const u32*)dev_random(wb); q.s = dev_params(np, 0.005f, 0.02f); q.b = dev_params(np, -0.1f, -0.02f);
    q.rows = rows; q.cols = cols; q.bits = bits; q.gs = gs; q.sf32 = 0; return q;
}
static size_t qw_bytes(const QW& q) { return (size_t)q.rows * q.cols * q.bits / 8 + (size_t)q.rows * (q.cols / q.gs) * 4; }

// Host mirror of the kernels' geometries.
static int old_rows_per_block(int cols, int bits) {
    int units = cols * bits / 128; int split = units >= 256 ? 8 : units >= 128 ? 4 : units >= 64 ? 2 : 1; return 32 / split;
}
template <class F>
static double time_graph(F launch_i, int n) {
    cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    launch_i(s, 0); CK(cudaStreamSynchronize(s)); CK(cudaGetLastError());
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < n; i++) launch_i(s, i);
    CK(cudaStreamEndCapture(s, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    double best = 1e30;
    for (int r = 0; r < 7; r++) {
        CK(cudaEventRecord(a, s)); CK(cudaGraphLaunch(ge, s)); CK(cudaEventRecord(b, s)); CK(cudaEventSynchronize(b));
        float ms; CK(cudaEventElapsedTime(&ms, a, b)); best = std::min(best, (double)ms);
    }
    CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g)); CK(cudaStreamDestroy(s));
    return best * 1e3 / n;  // us per launch
}

// rel: the largest difference allowed, relative to the largest |reference|.
static void compare(const char* what, const float* da, const float* db, size_t n, double rel = 1e-4) {
    std::vector<float> a(n), b(n);
    CK(cudaMemcpy(a.data(), da, n * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(), db, n * 4, cudaMemcpyDeviceToHost));
    double md = 0, mx = 0; for (size_t i = 0; i < n; i++) { md = std::max(md, (double)fabsf(a[i] - b[i])); mx = std::max(mx, (double)fabsf(a[i])); }
    printf("    check %-10s max|diff| %.3g  max|ref| %.3g  rel %.2e %s\n", what, md, mx, md / std::max(mx, 1e-30), md <= rel * mx ? "ok" : "MISMATCH");
}

// Launches with programmatic dependent launch (as moeflux does on sm_90).
template <class... A>
static void launch_pdl_smem(void (*k)(A...), dim3 grid, int block, size_t smem, cudaStream_t s, A... args) {
    cudaLaunchConfig_t c = {};
    c.gridDim = grid; c.blockDim = dim3(block); c.dynamicSmemBytes = smem; c.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
    c.attrs = at; c.numAttrs = 1;
    CK(cudaLaunchKernelEx(&c, k, args...));
}
template <class... A>
static void launch_pdl(void (*k)(A...), dim3 grid, int block, cudaStream_t s, A... args) {
    launch_pdl_smem(k, grid, block, 0, s, args...);
}

static MultiMatmul one(const QW& q, float* out, int blocks) {
    MultiMatmul mm; memset(&mm, 0, sizeof mm); mm.q[0] = q; mm.out[0] = out; mm.count = 1; mm.accumulate = 0;
    mm.first_block[0] = 0; for (int j = 1; j < 5; j++) mm.first_block[j] = blocks; return mm;
}


// ---- Experiment: 8-bit activations and dp4a for 4-bit affine products (not in moeflux) ----
// The one-token products above multiply exact f32 activations: about 7 instructions a weight
// (docs/PERFORMANCE.md), instruction-bound at 1.0-1.6 TB/s. llama.cpp quantizes the activations
// to 8 bits per 32 (q8_1) and sums codes x activations with dp4a, four a instruction. Here the
// same: x -> xq (int8, dx = max|x|/127 per block of 32, plus the block's exact f32 sum for the
// biases), laid out so that a code word's even nibbles (w & 0x0F0F0F0F: codes 0,2,4,6) and odd
// ones ((w >> 4) & 0x0F0F0F0F) each meet one int32 of activations. A lane takes one block of
// 32 codes (one 16-byte load) per step; a warp R rows (their loads issued together).
__global__ void kb_quant_x_q8(const float* x, int cols, int* xq, float* dx, float* xsum) {
    int b = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (b >= cols / 32) return;
    float v = x[b * 32 + lane];
    float m = warp_max(fabsf(v)), sum = warp_sum(v);
    float d = m / 127.0f;
    int q = m > 0.0f ? (int)roundf(v * (127.0f / m)) : 0;  // the q8 contract's rounding (q8_prep)
    int word = (lane & 1) ? 4 + lane / 8 : lane / 8;
    ((signed char*)(xq + b * 8))[word * 4 + (lane % 8) / 2] = (signed char)q;
    if (lane == 0) { dx[b] = d; xsum[b] = sum; }
}

template <int R>
__global__ void kb_qmv_dp4a_b4(QW q, const int* __restrict__ xq, const float* __restrict__ dx,
                               const float* __restrict__ xsum, float* __restrict__ out) {
    int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    int r0 = warp * R;
    if (r0 >= q.rows) return;
    int nb = q.cols / 32, groups = q.cols / q.gs, bpg = q.gs / 32;
    const uint4* w = (const uint4*)q.w;
    const u16* sc = (const u16*)q.s;
    const u16* bi = (const u16*)q.b;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.0f;
    for (int b = lane; b < nb; b += 32) {
        uint4 c[R];
#pragma unroll
        for (int r = 0; r < R; r++) c[r] = r0 + r < q.rows ? __ldg(w + (size_t)(r0 + r) * nb + b) : make_uint4(0, 0, 0, 0);
        const int4* xb = (const int4*)(xq + b * 8);
        int4 xe = __ldg(xb), xo = __ldg(xb + 1);
        float d = __ldg(dx + b), xs = __ldg(xsum + b);
        int g = b / bpg;
#pragma unroll
        for (int r = 0; r < R; r++) {
            int i = 0;
            i = __dp4a((int)(c[r].x & 0x0F0F0F0Fu), xe.x, i); i = __dp4a((int)((c[r].x >> 4) & 0x0F0F0F0Fu), xo.x, i);
            i = __dp4a((int)(c[r].y & 0x0F0F0F0Fu), xe.y, i); i = __dp4a((int)((c[r].y >> 4) & 0x0F0F0F0Fu), xo.y, i);
            i = __dp4a((int)(c[r].z & 0x0F0F0F0Fu), xe.z, i); i = __dp4a((int)((c[r].z >> 4) & 0x0F0F0F0Fu), xo.z, i);
            i = __dp4a((int)(c[r].w & 0x0F0F0F0Fu), xe.w, i); i = __dp4a((int)((c[r].w >> 4) & 0x0F0F0F0Fu), xo.w, i);
            size_t k = (size_t)(r0 + r) * groups + g;
            acc[r] = fmaf(bf16f(__ldg(sc + k)) * d, (float)i, acc[r]);
            acc[r] = fmaf(bf16f(__ldg(bi + k)), xs, acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        float v = warp_sum(acc[r]);
        if (lane == 0 && r0 + r < q.rows) out[r0 + r] = v;
    }
}

// moeflux's streaming one-token kernel with 8-bit activations (qmv_b4q8) at other chunk counts
// and register bounds (MINB blocks per SM guaranteed by __launch_bounds__).
template <int NC, int MINB>
__global__ void __launch_bounds__(256, MINB) kb_qmv_q8(MultiMatmul mm, const float* x) {
    PDL_TRIGGER();
    qmv_stream_body<B4Q8, NC, false>(mm, x);
}
template <int NC, int MINB>
__global__ void __launch_bounds__(256, MINB) kb_gate_up_stream_q8(const unsigned long long* bs, ExpertLayout L, int k,
                                                                  const float* x, float* a) {
    PDL_ENTER();
    moe_gate_up_stream_body<B4Q8, NC>(bs, L, k, x, a);
}
template <int NC, int MINB>
__global__ void __launch_bounds__(256, MINB) kb_down_stream_q8(const unsigned long long* bs, ExpertLayout L,
                                                               const float* a, float* y) {
    PDL_ENTER();
    moe_down_stream_body<B4Q8, NC>(bs, L, a, y);
}
// qdot_b4q8 (one token) at other lanes a row than moeflux's.
template <int R, int LPR>
__global__ void __launch_bounds__(256) kb_qdot(MultiMatmul mm, const float* x, int n) {
    PDL_TRIGGER();
    qdot_body<1, false, R, LPR>(mm, x, n);
}

template <class K>
static int resident_blocks(K kernel, int threads) {
    int b = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, threads, 0));
    return b;
}

// The dp4a products against qmv_b4 (f32 activations) on one product's weights: time per launch
// (rotating weight copies, as above) and the relative difference the rounding of x costs.
static void bench_dp4a(const std::vector<QW>& qs, int copies, const float* x, const float* ref, float* o, size_t bytes, int n) {
    const QW& q0 = qs[0];
    if (q0.bits != 4 || q0.gs % 32 || q0.cols % 32) return;
    int nb = q0.cols / 32;
    int* xq; float *dxs, *xs;
    CK(cudaMalloc(&xq, nb * 32)); CK(cudaMalloc(&dxs, nb * 4)); CK(cudaMalloc(&xs, nb * 4));
    double tq = time_graph([&](cudaStream_t s, int) { kb_quant_x_q8<<<(nb + 7) / 8, 256, 0, s>>>(x, q0.cols, xq, dxs, xs); }, n);
    auto run = [&](auto kernel, int R) {
        int blocks = (q0.rows + 8 * R - 1) / (8 * R);
        double t = time_graph([&](cudaStream_t s, int i) { kernel<<<blocks, 256, 0, s>>>(qs[i % copies], (const int*)xq, (const float*)dxs, (const float*)xs, o); }, n);
        CK(cudaMemset(o, 0, q0.rows * 4)); kernel<<<blocks, 256>>>(q0, (const int*)xq, (const float*)dxs, (const float*)xs, o); CK(cudaDeviceSynchronize());
        std::vector<float> a(q0.rows), b(q0.rows);
        CK(cudaMemcpy(a.data(), ref, q0.rows * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(), o, q0.rows * 4, cudaMemcpyDeviceToHost));
        double md = 0, mx = 0; for (int i = 0; i < q0.rows; i++) { md = std::max(md, (double)fabsf(a[i] - b[i])); mx = std::max(mx, (double)fabsf(a[i])); }
        double rel = md / std::max(mx, 1e-30);
        printf("    dp4a, 8-bit x, %d row%s a warp  %8.2f us %6.0f GB/s (+ x quantized: %.2f us)  vs f32 x: rel %.2e %s\n",
               R, R > 1 ? "s" : " ", t, bytes / t / 1e3, tq, rel, rel < 0.05 ? "(rounding)" : "WRONG");
    };
    run(kb_qmv_dp4a_b4<1>, 1);
    run(kb_qmv_dp4a_b4<2>, 2);
    run(kb_qmv_dp4a_b4<4>, 4);
    // The dp4a reference (one row a warp) for the streaming q8 kernels: the same rounding.
    float* ref8; CK(cudaMalloc(&ref8, q0.rows * 4));
    kb_quant_x_q8<<<(nb + 7) / 8, 256>>>(x, q0.cols, xq, dxs, xs);
    kb_qmv_dp4a_b4<1><<<(q0.rows + 7) / 8, 256>>>(q0, (const int*)xq, (const float*)dxs, (const float*)xs, ref8);
    CK(cudaDeviceSynchronize());
    auto q8 = [&](auto kernel, const char* what, int nc) {
        int threads = qmv_threads(q0.cols, 4);
        int sets = (q0.rows + qmv_rows_per_block(q0.cols, 4, nc) - 1) / qmv_rows_per_block(q0.cols, 4, nc);
        int per_sm = resident_blocks(kernel, threads);
        int blocks = std::min(sets, g_sms * per_sm);
        double t = time_graph([&](cudaStream_t s, int i) { launch_pdl(kernel, dim3(blocks), threads, s, one(qs[i % copies], o, sets), (const float*)x); }, n);
        CK(cudaMemset(o, 0, q0.rows * 4)); kernel<<<blocks, threads>>>(one(q0, o, sets), x); CK(cudaDeviceSynchronize());
        printf("    %-22s %d/SM PDL (%5d of %5d sets) %8.2f us %6.0f GB/s", what, per_sm, blocks, sets, t, bytes / t / 1e3);
        compare("vs dp4a", ref8, o, q0.rows);
    };
    // qdot_b4q8 (a warp per two rows, the input rounded into shared memory once per block,
    // blocks looping over the sets of 16 rows) over grids of 2, 4, 8 blocks per SM and one per set.
    if (q0.cols <= QD_MAX_COLS) {
        size_t smem = (size_t)q0.cols * 5 / 4;
        for (int rw : {2, 1}) {
            auto k = rw == 2 ? qdot_b4q8 : qdot_b4q8_r1;
            int sets = (q0.rows + 8 * rw - 1) / (8 * rw);
            for (int bps : {4, 8, 0}) {
                int blocks = bps ? std::min(sets, g_sms * bps) : sets;
                double t = time_graph([&](cudaStream_t s, int i) { launch_pdl_smem(k, dim3(blocks), 256, smem, s, one(qs[i % copies], o, sets), (const float*)x, 1); }, n);
                CK(cudaMemset(o, 0, q0.rows * 4)); k<<<blocks, 256, smem>>>(one(q0, o, sets), x, 1); CK(cudaDeviceSynchronize());
                printf("    qdot_b4q8 R%d %d/SM PDL   (%5d of %5d sets) %8.2f us %6.0f GB/s", rw, bps, blocks, sets, t, bytes / t / 1e3);
                compare("vs dp4a", ref8, o, q0.rows);
            }
        }
    }
    // qdot_b4q8 with LPR lanes a row (32 / LPR rows side by side in a warp; moeflux's: 32), R
    // rows a lane group, grids balanced over the fewest waves of the resident blocks.
    if (q0.cols <= QD_MAX_COLS) {
        size_t smem = (size_t)q0.cols * 5 / 4;
        auto lanes = [&](auto k, int lpr, int rw) {
            int sets = (q0.rows + 8 * 32 / lpr * rw - 1) / (8 * 32 / lpr * rw);
            int cap = std::max(1, resident_blocks(k, 256)) * g_sms, waves = std::max(1, (sets + cap - 1) / cap);
            int blocks = (sets + waves - 1) / waves;
            double t = time_graph([&](cudaStream_t s, int i) { launch_pdl_smem(k, dim3(blocks), 256, smem, s, one(qs[i % copies], o, sets), (const float*)x, 1); }, n);
            CK(cudaMemset(o, 0, q0.rows * 4)); k<<<blocks, 256, smem>>>(one(q0, o, sets), x, 1); CK(cudaDeviceSynchronize());
            printf("    qdot LPR%-2d R%d balanced (%5d of %5d sets) %8.2f us %6.0f GB/s", lpr, rw, blocks, sets, t, bytes / t / 1e3);
            compare("vs dp4a", ref8, o, q0.rows);
        };
        lanes(kb_qdot<2, 32>, 32, 2);
        lanes(kb_qdot<1, 32>, 32, 1);
        lanes(kb_qdot<2, 16>, 16, 2);
        lanes(kb_qdot<1, 16>, 16, 1);
        lanes(kb_qdot<2, 8>, 8, 2);
        lanes(kb_qdot<1, 8>, 8, 1);
    }
    q8(qmv_b4q8, "qmv_b4q8 (moeflux)", QMV_STREAM_NC);
    q8(kb_qmv_q8<8, 2>, "q8 NC8 minB2", 8);
    CK(cudaFree(ref8));
    CK(cudaFree(xq)); CK(cudaFree(dxs)); CK(cudaFree(xs));
}

static void bench_product(const char* name, int rows, int cols, int bits, int gs) {
    QW probe = make_qw(rows, cols, bits, gs);
    size_t bytes = qw_bytes(probe);
    int copies = (int)std::max<size_t>(1, std::min<size_t>(16, (size_t)256e6 / bytes + 1));
    std::vector<QW> qs{probe}; for (int c = 1; c < copies; c++) qs.push_back(make_qw(rows, cols, bits, gs));
    float* x = dev_floats(cols, -1, 1); float *o1, *o2; CK(cudaMalloc(&o1, rows * 4)); CK(cudaMalloc(&o2, rows * 4));
    int b_old = (rows + old_rows_per_block(cols, bits) - 1) / old_rows_per_block(cols, bits);
    int b_set = (rows + qmv_rows_per_block(cols, bits, QMV_NC) - 1) / qmv_rows_per_block(cols, bits, QMV_NC);
    int n = rows > 100000 ? 20 : 200;
    double t_old = time_graph([&](cudaStream_t s, int i) { qmatmul1<<<dim3(b_old, 1), 256, 0, s>>>(one(qs[i % copies], o1, b_old), x, 1); }, n);
    double t_set = time_graph([&](cudaStream_t s, int i) { qmv_b48<<<dim3(b_set), 256, 0, s>>>(one(qs[i % copies], o2, b_set), x); }, n);
    qmatmul1<<<dim3(b_old, 1), 256>>>(one(qs[0], o1, b_old), x, 1); qmv_b48<<<b_set, 256>>>(one(qs[0], o2, b_set), x); CK(cudaDeviceSynchronize());
    printf("%-28s %7.1f MB | qmatmul1 %8.2f us %6.0f GB/s (%d blocks) | a block per set (qmv_b48, %d chunks) %8.2f us %6.0f GB/s (%d blocks)\n",
           name, bytes / 1e6, t_old, bytes / t_old / 1e3, b_old, QMV_NC, t_set, bytes / t_set / 1e3, b_set);
    compare("qmv_b48", o1, o2, rows);
    // The streaming kernels (as moeflux launches them: QMV_STREAM_NC chunks, or 2 for small
    // products) over grids of 1-8 blocks per SM.
    for (int nc : {QMV_STREAM_NC, 2}) {
        auto k = nc == 2 ? qmv_b4_nc2 : qmv_b4;
        int sets = (rows + qmv_rows_per_block(cols, bits, nc) - 1) / qmv_rows_per_block(cols, bits, nc);
        for (int bps : {1, 2, 3, 4, 8}) {
            int blocks = std::min(sets, g_sms * bps);
            MultiMatmul mm0 = one(qs[0], o2, sets);
            double t = time_graph([&](cudaStream_t s, int i) { MultiMatmul mm = one(qs[i % copies], o2, sets); k<<<dim3(blocks), 256, 0, s>>>(mm, x); }, n);
            CK(cudaMemset(o2, 0, rows * 4)); k<<<blocks, 256>>>(mm0, x); CK(cudaDeviceSynchronize());
            printf("    qmv_b4%s %d/SM (%5d of %5d sets) %8.2f us %6.0f GB/s", nc == 2 ? "_nc2" : "    ", bps, blocks, sets, t, bytes / t / 1e3);
            compare("", o1, o2, rows);
            if (blocks == sets) break;
        }
    }
    {
        // The CUDA-core streaming kernel as moeflux launches it (PDL), for comparison.
        int sets = (rows + qmv_rows_per_block(cols, bits, QMV_STREAM_NC) - 1) / qmv_rows_per_block(cols, bits, QMV_STREAM_NC);
        int sg = std::min(sets, g_sms * 2);
        double tb = time_graph([&](cudaStream_t s, int i) { launch_pdl(qmv_b4, dim3(sg), 256, s, one(qs[i % copies], o2, sets), (const float*)x); }, n);
        printf("    qmv_b4 2/SM, PDL                         %8.2f us %6.0f GB/s\n", tb, bytes / tb / 1e3);
    }
    bench_dp4a(qs, copies, x, o1, o2, bytes, n);
    // The same bytes (codes only) read by a plain grid-stride loop: what this size allows.
    size_t wb = (size_t)rows * cols * bits / 8;
    u32* sink; CK(cudaMalloc(&sink, 4));
    for (int bps : {4, 8}) {
        double t = time_graph([&](cudaStream_t s, int i) { read_probe<<<g_sms * bps, 256, 0, s>>>((const uint4*)qs[i % copies].w, (long)(wb / 16), sink); }, n);
        printf("    read_probe %d/SM, codes only (%.1f MB)   %8.2f us %6.0f GB/s\n", bps, wb / 1e6, t, wb / t / 1e3);
    }
}

// Experts of one layer in one buffer (MLX layout per expert: gate, up, down;
// each weights, scales, biases), `k` random distinct experts per token.
// n_exp experts of one layer in one buffer of extents `ext` apart (MLX layout per expert:
// gate, up, down; each weights, scales, biases): random codes, bf16 scales and biases in a
// sane range.
static char* make_experts(int n_exp, int hidden, int inter, int bits, int gs, ExpertLayout& L, long& ext) {
    memset(&L, 0, sizeof L);  // no biases, plain SwiGLU
    long off = 0;
    auto seg = [&](long n) { long o = off; off += (n + 255) / 256 * 256; return o; };
    L.gate_w = seg((long)inter * hidden * bits / 8); L.gate_s = seg((long)inter * (hidden / gs) * 2); L.gate_b = seg((long)inter * (hidden / gs) * 2);
    L.up_w = seg((long)inter * hidden * bits / 8); L.up_s = seg((long)inter * (hidden / gs) * 2); L.up_b = seg((long)inter * (hidden / gs) * 2);
    L.down_w = seg((long)hidden * inter * bits / 8); L.down_s = seg((long)hidden * (inter / gs) * 2); L.down_b = seg((long)hidden * (inter / gs) * 2);
    L.inter = inter; L.hidden = hidden; L.bits = bits; L.gs = gs; L.sf32 = 0;
    L.down_bits = bits; L.down_gs = gs; L.down_sf32 = 0;
    ext = off;
    // Fill whole extents, then overwrite the parameter segments.
    char* all = (char*)dev_random((size_t)ext * n_exp);
    std::uniform_real_distribution<float> ds(0.005f, 0.02f), db(-0.1f, -0.02f);
    std::vector<u16> hs(inter * (hidden / gs)), hd(hidden * (inter / gs));
    for (int e = 0; e < n_exp; e++) {
        for (auto& v : hs) v = to_bf16(ds(rng)); CK(cudaMemcpy(all + e * ext + L.gate_s, hs.data(), hs.size() * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(all + e * ext + L.up_s, hs.data(), hs.size() * 2, cudaMemcpyHostToDevice));
        for (auto& v : hs) v = to_bf16(db(rng)); CK(cudaMemcpy(all + e * ext + L.gate_b, hs.data(), hs.size() * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(all + e * ext + L.up_b, hs.data(), hs.size() * 2, cudaMemcpyHostToDevice));
        for (auto& v : hd) v = to_bf16(ds(rng)); CK(cudaMemcpy(all + e * ext + L.down_s, hd.data(), hd.size() * 2, cudaMemcpyHostToDevice));
        for (auto& v : hd) v = to_bf16(db(rng)); CK(cudaMemcpy(all + e * ext + L.down_b, hd.data(), hd.size() * 2, cudaMemcpyHostToDevice));
    }
    return all;
}

static void bench_slots(const char* name, int n_exp, int k, int hidden, int inter, int bits, int gs) {
    ExpertLayout L;
    long ext;
    char* all = make_experts(n_exp, hidden, inter, bits, gs, L, ext);
    const int T = 64;
    std::vector<unsigned long long> hb(T * k);
    for (int t = 0; t < T; t++) {
        std::vector<int> ids(n_exp); for (int e = 0; e < n_exp; e++) ids[e] = e; std::shuffle(ids.begin(), ids.end(), rng);
        for (int j = 0; j < k; j++) hb[t * k + j] = (unsigned long long)(all + (long)ids[j] * ext);
    }
    unsigned long long* bases; CK(cudaMalloc(&bases, hb.size() * 8)); CK(cudaMemcpy(bases, hb.data(), hb.size() * 8, cudaMemcpyHostToDevice));
    float* x = dev_floats(hidden, -1, 1);
    float *a1, *a2, *y1, *y2; CK(cudaMalloc(&a1, k * inter * 4)); CK(cudaMalloc(&a2, k * inter * 4)); CK(cudaMalloc(&y1, k * hidden * 4)); CK(cudaMalloc(&y2, k * hidden * 4));
    size_t gu_bytes = (size_t)k * 2 * ((size_t)inter * hidden * bits / 8 + (size_t)inter * (hidden / gs) * 4);
    size_t dn_bytes = (size_t)k * ((size_t)hidden * inter * bits / 8 + (size_t)hidden * (inter / gs) * 4);
    int gu_old = (inter + old_rows_per_block(hidden, bits) - 1) / old_rows_per_block(hidden, bits);
    int dn_old = (hidden + old_rows_per_block(inter, bits) - 1) / old_rows_per_block(inter, bits);
    int gu_new = (inter + qmv_rows_per_block(hidden, bits, QMV_NC / 2) - 1) / qmv_rows_per_block(hidden, bits, QMV_NC / 2);
    int dn_new = (hidden + qmv_rows_per_block(inter, bits, QMV_NC) - 1) / qmv_rows_per_block(inter, bits, QMV_NC);
    int n = 200;
    double g_old = time_graph([&](cudaStream_t s, int i) { moe_gate_up_slots_b4<<<dim3(gu_old, k), 256, 0, s>>>(bases + (i % T) * k, L, k, x, a1); }, n);
    double g_new = time_graph([&](cudaStream_t s, int i) { moe_gate_up_qmv_b4<<<dim3(gu_new, k), 256, 0, s>>>(bases + (i % T) * k, L, k, x, a2); }, n);
    double d_old = time_graph([&](cudaStream_t s, int i) { moe_down_slots_b4<<<dim3(dn_old, k), 256, 0, s>>>(bases + (i % T) * k, L, a1, y1); }, n);
    double d_new = time_graph([&](cudaStream_t s, int i) { moe_down_qmv_b4<<<dim3(dn_new, k), 256, 0, s>>>(bases + (i % T) * k, L, a1, y2); }, n);
    moe_gate_up_slots_b4<<<dim3(gu_old, k), 256>>>(bases, L, k, x, a1); moe_gate_up_qmv_b4<<<dim3(gu_new, k), 256>>>(bases, L, k, x, a2);
    moe_down_slots_b4<<<dim3(dn_old, k), 256>>>(bases, L, a1, y1); moe_down_qmv_b4<<<dim3(dn_new, k), 256>>>(bases, L, a1, y2);
    CK(cudaDeviceSynchronize());
    printf("%-28s gate/up %6.1f MB | old %7.2f us %6.0f GB/s (%dx%d) | qmv %7.2f us %6.0f GB/s (%dx%d)\n", name, gu_bytes / 1e6, g_old, gu_bytes / g_old / 1e3, gu_old, k, g_new, gu_bytes / g_new / 1e3, gu_new, k);
    compare("gate/up", a1, a2, (size_t)k * inter);
    printf("%-28s down    %6.1f MB | old %7.2f us %6.0f GB/s (%dx%d) | qmv %7.2f us %6.0f GB/s (%dx%d)\n", name, dn_bytes / 1e6, d_old, dn_bytes / d_old / 1e3, dn_old, k, d_new, dn_bytes / d_new / 1e3, dn_new, k);
    compare("down", y1, y2, (size_t)k * hidden);
    // The streaming per-slot kernels as moeflux launches them (as many blocks as fit, shared by
    // the slots), f32 and 8-bit activations, and the q8 ones at other chunk counts and bounds.
    auto stream = [&](const char* what, auto gu, auto dn, int nc, float* yref) {
        int tg = qmv_threads(hidden, bits), td = qmv_threads(inter, bits);
        int sg = (inter + qmv_rows_per_block(hidden, bits, nc / 2) - 1) / qmv_rows_per_block(hidden, bits, nc / 2);
        int sd = (hidden + qmv_rows_per_block(inter, bits, nc) - 1) / qmv_rows_per_block(inter, bits, nc);
        int bg = std::max(1, std::min(sg, resident_blocks(gu, tg) * g_sms / k));
        int bd = std::max(1, std::min(sd, resident_blocks(dn, td) * g_sms / k));
        double tgu = time_graph([&](cudaStream_t s, int i) { launch_pdl(gu, dim3(bg, k), tg, s, (const unsigned long long*)bases + (i % T) * k, L, k, (const float*)x, a2); }, n);
        double tdn = time_graph([&](cudaStream_t s, int i) { launch_pdl(dn, dim3(bd, k), td, s, (const unsigned long long*)bases + (i % T) * k, L, (const float*)a1, y2); }, n);
        gu<<<dim3(bg, k), tg>>>(bases, L, k, x, a2); dn<<<dim3(bd, k), td>>>(bases, L, a1, y2); CK(cudaDeviceSynchronize());
        printf("    %-26s gate/up %7.2f us %6.0f GB/s (%dx%d) | down %7.2f us %6.0f GB/s (%dx%d)", what, tgu, gu_bytes / tgu / 1e3, bg, k, tdn, dn_bytes / tdn / 1e3, bd, k);
        if (yref) compare("down", yref, y2, (size_t)k * hidden); else printf("\n");
    };
    stream("stream_b4 (moeflux)", moe_gate_up_stream_b4, moe_down_stream_b4, QMV_STREAM_NC, y1);
    float* yq; CK(cudaMalloc(&yq, k * hidden * 4));
    stream("stream_b4q8 (moeflux)", moe_gate_up_stream_b4q8, moe_down_stream_b4q8, QMV_STREAM_NC, nullptr);
    CK(cudaMemcpy(yq, y2, (size_t)k * hidden * 4, cudaMemcpyDeviceToDevice));
    float* aq; CK(cudaMalloc(&aq, k * inter * 4));
    CK(cudaMemcpy(aq, a2, (size_t)k * inter * 4, cudaMemcpyDeviceToDevice));
    stream("q8 NC4 minB4", kb_gate_up_stream_q8<4, 4>, kb_down_stream_q8<4, 4>, 4, yq);
    stream("q8 NC8 minB2", kb_gate_up_stream_q8<8, 2>, kb_down_stream_q8<8, 2>, 8, yq);
    // By rows on 8-bit activations (moe_*_qdot{LPR}: LPR lanes a row; gate/up a row of each in
    // a lane group, down two rows), blocks per slot as moeflux sizes them: every set in one
    // wave of the resident blocks where they fit, else the fewest waves with every block
    // taking the same number of sets. Checked against the streaming q8 kernels (other order).
    auto qdot = [&](auto gu, auto dn, int gl, int dl) {
        auto balanced = [&](auto kern, int sets) {
            int cap = resident_blocks(kern, 256) * g_sms, waves = std::max(1, (sets * k + cap - 1) / cap);
            return (sets + waves - 1) / waves;
        };
        int bg = balanced(gu, (inter + 8 * 32 / gl - 1) / (8 * 32 / gl));
        int bd = balanced(dn, (hidden + 8 * 32 / dl * 2 - 1) / (8 * 32 / dl * 2));
        size_t sg = (size_t)hidden * 5 / 4, sd = (size_t)inter * 5 / 4;
        double tgu = time_graph([&](cudaStream_t s, int i) { launch_pdl_smem(gu, dim3(bg, k), 256, sg, s, (const unsigned long long*)bases + (i % T) * k, L, k, (const float*)x, a2); }, n);
        double tdn = time_graph([&](cudaStream_t s, int i) { launch_pdl_smem(dn, dim3(bd, k), 256, sd, s, (const unsigned long long*)bases + (i % T) * k, L, (const float*)a1, y2); }, n);
        gu<<<dim3(bg, k), 256, sg>>>(bases, L, k, x, a2); dn<<<dim3(bd, k), 256, sd>>>(bases, L, a1, y2); CK(cudaDeviceSynchronize());
        char what[64]; snprintf(what, sizeof what, "qdot%d / qdot%d (%d, %d/SM)", gl, dl, resident_blocks(gu, 256), resident_blocks(dn, 256));
        printf("    %-26s gate/up %7.2f us %6.0f GB/s (%dx%d) | down %7.2f us %6.0f GB/s (%dx%d)\n", what, tgu, gu_bytes / tgu / 1e3, bg, k, tdn, dn_bytes / tdn / 1e3, bd, k);
        compare("gate/up", aq, a2, (size_t)k * inter);
        compare("down", yq, y2, (size_t)k * hidden);
    };
    qdot(moe_gate_up_qdot16, moe_down_qdot16, 16, 16);
    qdot(moe_gate_up_qdot8, moe_down_qdot8, 8, 8);
    qdot(moe_gate_up_qdot16, moe_down_qdot8, 16, 8);  // as moeflux takes them
    CK(cudaFree(yq)); CK(cudaFree(aq));
}

// The by-rows MXFP4 kernels (moe.cu) at other unit depths, register
// bounds and PDL placements than moeflux's build of them, for comparison.
template <int NS, int D, int MINB>
__global__ void __launch_bounds__(256, MINB) kb_gate_up_rows(const unsigned long long* bs, ExpertLayout L, int k,
                                                             const float* x, float* a) {
    PDL_ENTER();
    if (bs[blockIdx.y] == 0) return;
    moe_gate_up_rows_body<NS, D>(bs, L, k, x, a);
}
template <int NS, int D, bool E, int MINB>
__global__ void __launch_bounds__(256, MINB) kb_down_rows(const unsigned long long* bs, ExpertLayout L,
                                                          const float* a, float* y) {
    moe_down_rows_body<NS, D, E>(bs, L, a, y);
}
static size_t count_bit_diffs(const float* da, const float* db, size_t n) {
    std::vector<u32> a(n), b(n);
    CK(cudaMemcpy(a.data(), da, n * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(), db, n * 4, cudaMemcpyDeviceToHost));
    size_t d = 0; for (size_t i = 0; i < n; i++) d += a[i] != b[i];
    return d;
}
template <class K>
static void print_attrs(const char* what, K k, int threads, int* occ) {
    cudaFuncAttributes fa; CK(cudaFuncGetAttributes(&fa, k));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(occ, k, threads, 0));
    printf("    %-34s %3d regs, %zu B local, %zu B smem, %d blocks/SM\n", what, fa.numRegs, (size_t)fa.localSizeBytes, (size_t)fa.sharedSizeBytes, *occ);
}

// gpt-oss's MXFP4 experts (codes, then e8m0 scale bytes per projection; no
// group biases, per-expert bias tables, the clamped SwiGLU): the one-pass
// per-slot kernels (a block per row group) against the streaming ones over
// grids of 1-8 blocks per SM shared by the slots, and a plain read of the
// same bytes.
static void bench_slots_mx(const char* name, int n_exp, int k, int hidden, int inter) {
    ExpertLayout L; memset(&L, 0, sizeof L); long off = 0;
    auto seg = [&](long n) { long o = off; off += (n + 255) / 256 * 256; return o; };
    L.gate_w = seg((long)inter * hidden / 2); L.gate_s = seg((long)inter * (hidden / 32));
    L.up_w = seg((long)inter * hidden / 2); L.up_s = seg((long)inter * (hidden / 32));
    L.down_w = seg((long)hidden * inter / 2); L.down_s = seg((long)hidden * (inter / 32));
    L.inter = inter; L.hidden = hidden; L.bits = 4; L.gs = 32; L.sf32 = 0; L.mx = 1;
    L.down_bits = 4; L.down_gs = 32; L.down_sf32 = 0;
    L.oai = 1; L.alpha = 1.702f; L.limit = 7.0f;
    long ext = off;
    char* all = (char*)dev_random((size_t)ext * n_exp);
    {
        // Scale bytes near 2^-7 so sums stay in range.
        std::vector<unsigned char> sg((size_t)inter * (hidden / 32)), sd((size_t)hidden * (inter / 32));
        for (int e = 0; e < n_exp; e++) {
            for (auto& v : sg) v = 118 + rng() % 4;
            for (auto& v : sd) v = 118 + rng() % 4;
            CK(cudaMemcpy(all + e * ext + L.gate_s, sg.data(), sg.size(), cudaMemcpyHostToDevice));
            CK(cudaMemcpy(all + e * ext + L.up_s, sg.data(), sg.size(), cudaMemcpyHostToDevice));
            CK(cudaMemcpy(all + e * ext + L.down_s, sd.data(), sd.size(), cudaMemcpyHostToDevice));
        }
    }
    float* bg = dev_floats((size_t)n_exp * inter, -0.5f, 0.5f);
    float* bu = dev_floats((size_t)n_exp * inter, -0.5f, 0.5f);
    float* bd = dev_floats((size_t)n_exp * hidden, -0.5f, 0.5f);
    L.bias_g = bg; L.bias_u = bu; L.bias_d = bd;
    const int T = 64;
    std::vector<unsigned long long> hb(T * k);
    std::vector<int> hid(T * k);
    for (int t = 0; t < T; t++) {
        std::vector<int> ids(n_exp); for (int e = 0; e < n_exp; e++) ids[e] = e; std::shuffle(ids.begin(), ids.end(), rng);
        for (int j = 0; j < k; j++) { hb[t * k + j] = (unsigned long long)(all + (long)ids[j] * ext); hid[t * k + j] = ids[j]; }
    }
    unsigned long long* bases; CK(cudaMalloc(&bases, hb.size() * 8)); CK(cudaMemcpy(bases, hb.data(), hb.size() * 8, cudaMemcpyHostToDevice));
    int* dids; CK(cudaMalloc(&dids, hid.size() * 4)); CK(cudaMemcpy(dids, hid.data(), hid.size() * 4, cudaMemcpyHostToDevice));
    float* x = dev_floats(hidden, -1, 1);
    float *a1, *a2, *y1, *y2; CK(cudaMalloc(&a1, k * inter * 4)); CK(cudaMalloc(&a2, k * inter * 4)); CK(cudaMalloc(&y1, k * hidden * 4)); CK(cudaMalloc(&y2, k * hidden * 4));
    size_t gu_bytes = (size_t)k * 2 * ((size_t)inter * hidden / 2 + (size_t)inter * (hidden / 32));
    size_t dn_bytes = (size_t)k * ((size_t)hidden * inter / 2 + (size_t)hidden * (inter / 32));
    int gth = qmv_threads(hidden, 4), dth = qmv_threads(inter, 4);
    int gu_one = (inter + qmv_rows_per_block(hidden, 4, QMV_NC / 2) - 1) / qmv_rows_per_block(hidden, 4, QMV_NC / 2);
    int dn_one = (hidden + qmv_rows_per_block(inter, 4, QMV_NC) - 1) / qmv_rows_per_block(inter, 4, QMV_NC);
    int gu_sets = (inter + qmv_rows_per_block(hidden, 4, MX_STREAM_NC / 2) - 1) / qmv_rows_per_block(hidden, 4, MX_STREAM_NC / 2);
    int dn_sets = (hidden + qmv_rows_per_block(inter, 4, MX_STREAM_NC) - 1) / qmv_rows_per_block(inter, 4, MX_STREAM_NC);
    int n = 200;
    auto Lt = [&](int i) { ExpertLayout l = L; l.ids = dids + (i % T) * k; return l; };
    double g1 = time_graph([&](cudaStream_t s, int i) { launch_pdl(moe_gate_up_qmv_mx, dim3(gu_one, k), gth, s, (const unsigned long long*)(bases + (i % T) * k), Lt(i), k, (const float*)x, a1); }, n);
    double d1 = time_graph([&](cudaStream_t s, int i) { launch_pdl(moe_down_qmv_mx, dim3(dn_one, k), dth, s, (const unsigned long long*)(bases + (i % T) * k), Lt(i), (const float*)a1, y1); }, n);
    printf("%-26s one-pass  gate/up %6.1f MB %7.2f us %5.0f GB/s (%dx%d, %d thr) | down %6.1f MB %7.2f us %5.0f GB/s (%dx%d, %d thr)\n",
           name, gu_bytes / 1e6, g1, gu_bytes / g1 / 1e3, gu_one, k, gth, dn_bytes / 1e6, d1, dn_bytes / d1 / 1e3, dn_one, k, dth);
    int occ_g = 0, occ_d = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_g, moe_gate_up_stream_mx, gth, 0));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_d, moe_down_stream_mx, dth, 0));
    printf("    stream occupancy: gate/up %d blocks/SM, down %d blocks/SM; sets per slot %d, %d\n", occ_g, occ_d, gu_sets, dn_sets);
    for (int bps = 1; bps <= 8; bps *= 2) {
        int gb = std::max(1, std::min(gu_sets, bps * g_sms / k)), db = std::max(1, std::min(dn_sets, bps * g_sms / k));
        double g2 = time_graph([&](cudaStream_t s, int i) { launch_pdl(moe_gate_up_stream_mx, dim3(gb, k), gth, s, (const unsigned long long*)(bases + (i % T) * k), Lt(i), k, (const float*)x, a2); }, n);
        double d2 = time_graph([&](cudaStream_t s, int i) { launch_pdl(moe_down_stream_mx, dim3(db, k), dth, s, (const unsigned long long*)(bases + (i % T) * k), Lt(i), (const float*)a1, y2); }, n);
        printf("    stream %d/SM: gate/up %7.2f us %5.0f GB/s (%dx%d) | down %7.2f us %5.0f GB/s (%dx%d)\n", bps, g2, gu_bytes / g2 / 1e3, gb, k, d2, dn_bytes / d2 / 1e3, db, k);
    }
    launch_pdl(moe_gate_up_qmv_mx, dim3(gu_one, k), gth, 0, (const unsigned long long*)bases, Lt(0), k, (const float*)x, a1);
    launch_pdl(moe_gate_up_stream_mx, dim3(std::min(gu_sets, 2 * g_sms / k), k), gth, 0, (const unsigned long long*)bases, Lt(0), k, (const float*)x, a2);
    launch_pdl(moe_down_qmv_mx, dim3(dn_one, k), dth, 0, (const unsigned long long*)bases, Lt(0), (const float*)a1, y1);
    launch_pdl(moe_down_stream_mx, dim3(std::min(dn_sets, 2 * g_sms / k), k), dth, 0, (const unsigned long long*)bases, Lt(0), (const float*)a1, y2);
    CK(cudaDeviceSynchronize());
    compare("gate/up", a1, a2, (size_t)k * inter);
    compare("down", y1, y2, (size_t)k * hidden);
    // By whole rows (moe_*_rows_mx3 and variants), against the streaming kernels'
    // outputs bit for bit, one block per SM's share per slot; then gate/up and down
    // in turn (as a layer runs them), streamed and by rows.
    {
        float *a3, *y3; CK(cudaMalloc(&a3, k * inter * 4)); CK(cudaMalloc(&y3, k * hidden * 4));
        const unsigned long long* b0 = bases;
        int gs2 = std::min(gu_sets, 2 * g_sms / k), ds2 = std::min(dn_sets, 2 * g_sms / k);
        // The streaming reference outputs (a2 from x, y2 from a1) once more.
        launch_pdl(moe_gate_up_stream_mx, dim3(gs2, k), gth, 0, b0, Lt(0), k, (const float*)x, a2);
        launch_pdl(moe_down_stream_mx, dim3(ds2, k), dth, 0, b0, Lt(0), (const float*)a1, y2);
        CK(cudaDeviceSynchronize());
        auto run_gu = [&](const char* what, auto kern) {
            int occ; print_attrs(what, kern, 256, &occ);
            int gb = std::max(1, std::min((inter + 7) / 8, occ * g_sms / k));
            double t = time_graph([&](cudaStream_t s, int i) { launch_pdl(kern, dim3(gb, k), 256, s, (const unsigned long long*)(bases + (i % T) * k), Lt(i), k, (const float*)x, a3); }, n);
            CK(cudaMemset(a3, 0xff, k * inter * 4));
            launch_pdl(kern, dim3(gb, k), 256, 0, b0, Lt(0), k, (const float*)x, a3); CK(cudaDeviceSynchronize()); CK(cudaGetLastError());
            size_t d = count_bit_diffs(a2, a3, (size_t)k * inter);
            printf("    rows gate/up %-22s %7.2f us %5.0f GB/s (%dx%d) | %zu of %d differ from streamed %s\n", what, t, gu_bytes / t / 1e3, gb, k, d, k * inter, d ? "MISMATCH" : "ok");
            return t;
        };
        auto run_dn = [&](const char* what, auto kern) {
            int occ; print_attrs(what, kern, 256, &occ);
            int db = std::max(1, std::min((hidden / 2 + 7) / 8, occ * g_sms / k));
            double t = time_graph([&](cudaStream_t s, int i) { launch_pdl(kern, dim3(db, k), 256, s, (const unsigned long long*)(bases + (i % T) * k), Lt(i), (const float*)a1, y3); }, n);
            CK(cudaMemset(y3, 0xff, k * hidden * 4));
            launch_pdl(kern, dim3(db, k), 256, 0, b0, Lt(0), (const float*)a1, y3); CK(cudaDeviceSynchronize()); CK(cudaGetLastError());
            size_t d = count_bit_diffs(y2, y3, (size_t)k * hidden);
            printf("    rows down    %-22s %7.2f us %5.0f GB/s (%dx%d) | %zu of %d differ from streamed %s\n", what, t, dn_bytes / t / 1e3, db, k, d, k * hidden, d ? "MISMATCH" : "ok");
            return t;
        };
        run_gu("moeflux (rows_mx3)", moe_gate_up_rows_mx3);
        run_gu("depth 1, 2 blocks/SM", kb_gate_up_rows<3, 1, 2>);
        run_gu("depth 2", kb_gate_up_rows<3, 2, 1>);
        run_gu("depth 2, 2 blocks/SM", kb_gate_up_rows<3, 2, 2>);
        run_dn("moeflux (rows_mx3)", moe_down_rows_mx3);
        run_dn("depth 1, late", kb_down_rows<3, 1, false, 1>);
        run_dn("depth 1, 2 blocks/SM", kb_down_rows<3, 1, true, 2>);
        run_dn("depth 2", kb_down_rows<3, 2, true, 1>);
        run_dn("depth 2, 2 blocks/SM", kb_down_rows<3, 2, true, 2>);
        // A layer's pair: gate/up then down (its input the gate/up's output).
        int occ_gr, occ_dr;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_gr, moe_gate_up_rows_mx3, 256, 0));
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_dr, moe_down_rows_mx3, 256, 0));
        int gbr = std::min((inter + 7) / 8, occ_gr * g_sms / k), dbr = std::min((hidden / 2 + 7) / 8, occ_dr * g_sms / k);
        int gbs = std::min(gu_sets, occ_g * g_sms / k), dbs = std::min(dn_sets, occ_d * g_sms / k);
        double ps = time_graph([&](cudaStream_t s, int i) {
            launch_pdl(moe_gate_up_stream_mx, dim3(gbs, k), gth, s, (const unsigned long long*)(bases + (i % T) * k), Lt(i), k, (const float*)x, a2);
            launch_pdl(moe_down_stream_mx, dim3(dbs, k), dth, s, (const unsigned long long*)(bases + (i % T) * k), Lt(i), (const float*)a2, y2); }, n);
        double pr = time_graph([&](cudaStream_t s, int i) {
            launch_pdl(moe_gate_up_rows_mx3, dim3(gbr, k), 256, s, (const unsigned long long*)(bases + (i % T) * k), Lt(i), k, (const float*)x, a3);
            launch_pdl(moe_down_rows_mx3, dim3(dbr, k), 256, s, (const unsigned long long*)(bases + (i % T) * k), Lt(i), (const float*)a3, y3); }, n);
        printf("    pair gate/up + down: streamed %7.2f us, by rows %7.2f us (%.2fx)\n", ps, pr, ps / pr);
        size_t d = count_bit_diffs(y2, y3, (size_t)k * hidden);
        printf("    pair outputs (last launch): %zu of %d differ %s\n", d, k * hidden, d ? "MISMATCH" : "ok");
        CK(cudaFree(a3)); CK(cudaFree(y3));
    }
    // The same bytes read plainly (one contiguous buffer per kernel's share).
    u32* sink; CK(cudaMalloc(&sink, 4));
    for (size_t bytes : {gu_bytes, dn_bytes}) {
        const int copies = 8;
        std::vector<void*> bufs; for (int c = 0; c < copies; c++) bufs.push_back(dev_random(bytes));
        for (int bps = 2; bps <= 8; bps *= 2) {
            double t = time_graph([&](cudaStream_t s, int i) { read_probe<<<g_sms * bps, 256, 0, s>>>((const uint4*)bufs[i % copies], (long)(bytes / 16), sink); }, n);
            printf("    read_probe %d/SM (%.1f MB) %7.2f us %5.0f GB/s\n", bps, bytes / 1e6, t, bytes / t / 1e3);
        }
        for (void* b : bufs) CK(cudaFree(b));
    }
}

extern "C" __global__ void null_kernel(int* p) { PDL_ENTER(); if (p) *p = 1; }

// Per-launch floor of a graph of dependent launches, with and without PDL,
// and a small product both ways.
// ---- Prefill: the tensor-core products of n tokens, bf16 hi/lo (qmma, moe_*_mma, f32
// activations) against 8-bit activations (qmma_q8, moe_*_mma_q8, and staged in shared
// memory, qmma_q8s, moe_*_mma_q8s), each with its input's preparation (mma_split / q8_rows)
// in the timed launches. Checked: the q8 kernels against the one-token q8 kernels
// (qdot_b4q8_t4 / the slots' rows: the same contract), the staged ones against the others.
static void bench_prefill(const char* name, int rows, int cols, int n) {
    QW q = make_qw(rows, cols, 4, 64);
    float* x = dev_floats((size_t)n * cols, -1, 1);
    float *o1, *o2, *o3; CK(cudaMalloc(&o1, (size_t)n * rows * 4)); CK(cudaMalloc(&o2, (size_t)n * rows * 4)); CK(cudaMalloc(&o3, (size_t)n * rows * 4));
    uint4* xp; float* xs; CK(cudaMalloc(&xp, (size_t)n * cols * 4)); CK(cudaMalloc(&xs, (size_t)n * cols / 64 * 4));
    u32* xq; float2* dxs; CK(cudaMalloc(&xq, (size_t)n * cols)); CK(cudaMalloc(&dxs, (size_t)n * cols / 32 * 8));
    int blocks = (rows + 63) / 64, ty = (n + 63) / 64;
    MultiMatmul mm1 = one(q, o1, blocks), mm2 = one(q, o2, blocks);
    auto bf16 = [&](cudaStream_t s) {
        mma_split<<<(unsigned)(((size_t)n * cols / 4 + 255) / 256), 256, 0, s>>>(x, n, cols, 64, xp, xs);
        qmma<<<dim3(blocks, ty), 128, 0, s>>>(mm1, xp, xs, n);
    };
    int blocks4 = (rows + 127) / 128;
    MultiMatmul mm4 = one(q, o3, blocks4);
    auto q8 = [&](cudaStream_t s, int mt) {
        q8_rows<<<(unsigned)(((size_t)n * cols / 8 + 255) / 256), 256, 0, s>>>(x, n, cols, xq, dxs);
        if (mt == 4) qmma_q8_m4<<<dim3(blocks4, ty), 128, 0, s>>>(mm4, xq, dxs, n);
        else qmma_q8<<<dim3(blocks, ty), 128, 0, s>>>(mm2, xq, dxs, n);
    };
    int reps = 20;
    double tb = time_graph([&](cudaStream_t s, int) { bf16(s); }, reps), tq = time_graph([&](cudaStream_t s, int) { q8(s, 2); }, reps);
    double t4 = time_graph([&](cudaStream_t s, int) { q8(s, 4); }, reps);
    double flop = 2.0 * rows * cols * n;
    printf("%-34s %5d tokens | bf16 hi/lo %8.1f us %6.1f TFLOP/s | q8 %8.1f us %6.1f TFLOP/s | %.2fx | q8 4 row tiles %8.1f us %6.1f TFLOP/s (%d x %d blocks)\n", name, n, tb,
           flop / tb / 1e6, tq, flop / tq / 1e6, tb / tq, t4, flop / t4 / 1e6, blocks4, ty);
    CK(cudaDeviceSynchronize());
    compare("q8 m4 vs m2", o2, o3, (size_t)n * rows);
    // Staged in shared memory (qmma_q8s): qmma_q8's integer sums, scaled in another f32 order.
    {
        int bs = (rows + 127) / 128;
        MultiMatmul mms = one(q, o3, bs);
        double ts = time_graph([&](cudaStream_t s, int) {
            q8_rows<<<(unsigned)(((size_t)n * cols / 8 + 255) / 256), 256, 0, s>>>(x, n, cols, xq, dxs);
            qmma_q8s<<<dim3(bs, ty), 256, 0, s>>>(mms, xq, dxs, n);
        }, reps);
        CK(cudaDeviceSynchronize());
        printf("    q8 staged (qmma_q8s, %d x %d blocks) %8.1f us %6.1f TFLOP/s | %.2fx q8 m2, %.2fx q8 m4\n", bs, ty, ts,
               flop / ts / 1e6, tq / ts, t4 / ts);
        compare("staged vs q8 m2", o2, o3, (size_t)n * rows);
    }
    // The one-token q8 contract (four tokens a block row) as the reference.
    int sets = (rows + 15) / 16;
    size_t smem = (size_t)4 * cols * 5 / 4;
    CK(cudaFuncSetAttribute(qdot_b4q8_t4, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    qdot_b4q8_t4<<<dim3(std::min(sets, g_sms * 4), (n + 3) / 4), 256, smem>>>(one(q, o3, sets), x, n);
    CK(cudaDeviceSynchronize());
    compare("q8 vs qdot", o3, o2, (size_t)n * rows);
    std::vector<float> a((size_t)n * rows), b((size_t)n * rows);
    CK(cudaMemcpy(a.data(), o1, a.size() * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(), o2, b.size() * 4, cudaMemcpyDeviceToHost));
    double md = 0, mx = 0; for (size_t i = 0; i < a.size(); i++) { md = std::max(md, (double)fabsf(a[i] - b[i])); mx = std::max(mx, (double)fabsf(a[i])); }
    printf("    q8 vs bf16 hi/lo (the rounding of 8-bit activations): max|diff| %.3g of %.3g (%.2e)\n", md, mx, md / mx);
    CK(cudaFree(o1)); CK(cudaFree(o2)); CK(cudaFree(o3)); CK(cudaFree(xp)); CK(cudaFree(xs)); CK(cudaFree(xq)); CK(cudaFree(dxs)); CK(cudaFree(x));
}

// One layer's routed experts for a prefill of n tokens, k distinct random experts each.
static void bench_prefill_experts(const char* name, int n_exp, int k, int hidden, int inter, int n) {
    ExpertLayout L;
    long ext;
    char* all = make_experts(n_exp, hidden, inter, 4, 64, L, ext);
    std::vector<std::vector<int>> users(n_exp);
    for (int t = 0; t < n; t++) {
        std::vector<int> ids(n_exp); for (int e = 0; e < n_exp; e++) ids[e] = e; std::shuffle(ids.begin(), ids.end(), rng);
        for (int j = 0; j < k; j++) users[ids[j]].push_back(t * k + j);
    }
    std::vector<ExpertTask> tasks; std::vector<int> slots;
    for (int e = 0; e < n_exp; e++) {
        if (users[e].empty()) continue;
        tasks.push_back({all + (long)e * ext, (int)slots.size(), (int)users[e].size()});
        slots.insert(slots.end(), users[e].begin(), users[e].end());
    }
    int nt = (int)tasks.size(), used = (int)slots.size();
    ExpertTask* dt; int* ds; CK(cudaMalloc(&dt, nt * sizeof(ExpertTask))); CK(cudaMalloc(&ds, used * 4));
    CK(cudaMemcpy(dt, tasks.data(), nt * sizeof(ExpertTask), cudaMemcpyHostToDevice)); CK(cudaMemcpy(ds, slots.data(), used * 4, cudaMemcpyHostToDevice));
    float* x = dev_floats((size_t)n * hidden, -1, 1);
    float *act, *out1, *out2; CK(cudaMalloc(&act, (size_t)used * inter * 4)); CK(cudaMalloc(&out1, (size_t)n * k * hidden * 4)); CK(cudaMalloc(&out2, (size_t)n * k * hidden * 4));
    size_t big = (size_t)std::max(n * hidden, used * inter);
    uint4* xp; float* xs; CK(cudaMalloc(&xp, big * 4)); CK(cudaMalloc(&xs, big / 64 * 4));
    u32* xq; float2* dxs; CK(cudaMalloc(&xq, big)); CK(cudaMalloc(&dxs, big / 32 * 8));
    dim3 ggu((inter + 63) / 64, nt), gdn((hidden + 127) / 128, nt);
    auto bf16 = [&](cudaStream_t s, float* out) {
        mma_split<<<(unsigned)(((size_t)n * hidden / 4 + 255) / 256), 256, 0, s>>>(x, n, hidden, 64, xp, xs);
        moe_gate_up_mma<<<ggu, 128, 0, s>>>(dt, L, ds, k, xp, xs, act);
        mma_split<<<(unsigned)(((size_t)used * inter / 4 + 255) / 256), 256, 0, s>>>(act, used, inter, 64, xp, xs);
        moe_down_mma<<<gdn, 128, 0, s>>>(dt, L, ds, xp, xs, out);
    };
    dim3 ggu4((inter + 127) / 128, nt), gdn4((hidden + 255) / 256, nt);
    // mt: row tiles a warp; part: 1 gate/up only, 2 down only, 3 both.
    auto q8 = [&](cudaStream_t s, float* out, int mt, int part) {
        if (part & 1) {
            q8_rows<<<(unsigned)(((size_t)n * hidden / 8 + 255) / 256), 256, 0, s>>>(x, n, hidden, xq, dxs);
            if (mt == 4) moe_gate_up_mma_q8_m4<<<ggu4, 128, 0, s>>>(dt, L, ds, k, xq, dxs, act);
            else moe_gate_up_mma_q8<<<ggu, 128, 0, s>>>(dt, L, ds, k, xq, dxs, act);
        }
        if (part & 2) {
            q8_rows<<<(unsigned)(((size_t)used * inter / 8 + 255) / 256), 256, 0, s>>>(act, used, inter, xq, dxs);
            if (mt == 4) moe_down_mma_q8_m4<<<gdn4, 128, 0, s>>>(dt, L, ds, xq, dxs, out);
            else moe_down_mma_q8<<<gdn, 128, 0, s>>>(dt, L, ds, xq, dxs, out);
        }
    };
    int reps = 10;
    double tb = time_graph([&](cudaStream_t s, int) { bf16(s, out1); }, reps), tq = time_graph([&](cudaStream_t s, int) { q8(s, out2, 2, 3); }, reps);
    double flop = 2.0 * 3 * hidden * inter * (double)n * k;
    printf("%-34s %5d tokens, %3d experts | bf16 hi/lo %8.1f us %6.1f TFLOP/s | q8 %8.1f us %6.1f TFLOP/s | %.2fx\n", name, n, nt,
           tb, flop / tb / 1e6, tq, flop / tq / 1e6, tb / tq);
    for (int mt : {2, 4}) {
        double tg = time_graph([&](cudaStream_t s, int) { q8(s, out2, mt, 1); }, reps);
        double td = time_graph([&](cudaStream_t s, int) { q8(s, out2, mt, 2); }, reps);
        printf("    q8, %d row tiles a warp: gate/up %8.1f us %6.1f TFLOP/s, down %8.1f us %6.1f TFLOP/s\n", mt, tg,
               flop * 2 / 3 / tg / 1e6, td, flop / 3 / td / 1e6);
    }
    float* out4; CK(cudaMalloc(&out4, (size_t)n * k * hidden * 4));
    q8(0, out2, 2, 3); q8(0, out4, 4, 3); CK(cudaDeviceSynchronize());
    compare("q8 m4 vs m2", out2, out4, (size_t)n * k * hidden);
    // Staged in shared memory (moe_*_mma_q8s): the m2 kernels' integer sums, scaled in another order.
    {
        dim3 ggs(inter / 64, nt), gds((hidden + 127) / 128, nt);
        auto staged = [&](cudaStream_t s, int part) {
            if (part & 1) {
                q8_rows<<<(unsigned)(((size_t)n * hidden / 8 + 255) / 256), 256, 0, s>>>(x, n, hidden, xq, dxs);
                moe_gate_up_mma_q8s<<<ggs, 256, 0, s>>>(dt, L, ds, k, xq, dxs, act);
            }
            if (part & 2) {
                q8_rows<<<(unsigned)(((size_t)used * inter / 8 + 255) / 256), 256, 0, s>>>(act, used, inter, xq, dxs);
                moe_down_mma_q8s<<<gds, 256, 0, s>>>(dt, L, ds, xq, dxs, out4);
            }
        };
        double tg = time_graph([&](cudaStream_t s, int) { staged(s, 1); }, reps);
        double td = time_graph([&](cudaStream_t s, int) { staged(s, 2); }, reps);
        printf("    q8 staged: gate/up %8.1f us %6.1f TFLOP/s, down %8.1f us %6.1f TFLOP/s\n", tg, flop * 2 / 3 / tg / 1e6,
               td, flop / 3 / td / 1e6);
        q8(0, out2, 2, 3); staged(0, 3); CK(cudaDeviceSynchronize());
        // Down's input is gate/up's output rounded to 8 bits again: gate/up's other f32 order
        // moves a few of its roundings by one step (~2e-4 of the largest output).
        compare("staged vs q8 m2", out2, out4, (size_t)n * k * hidden, 1e-3);
    }
    CK(cudaFree(out4));
    // Reference: the one-token q8 row kernels per slot (bases per slot; slots of a token
    // consecutive), on the same x.
    std::vector<unsigned long long> hb((size_t)n * k);
    for (int e = 0; e < n_exp; e++)
        for (int sl : users[e]) hb[sl] = (unsigned long long)(all + (long)e * ext);
    unsigned long long* bases; CK(cudaMalloc(&bases, hb.size() * 8)); CK(cudaMemcpy(bases, hb.data(), hb.size() * 8, cudaMemcpyHostToDevice));
    float *a3, *out3; CK(cudaMalloc(&a3, (size_t)k * inter * 4)); CK(cudaMalloc(&out3, (size_t)n * k * hidden * 4));
    size_t sgu = (size_t)hidden * 5 / 4, sdn = (size_t)inter * 5 / 4;
    CK(cudaFuncSetAttribute(moe_gate_up_qdot16, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sgu));
    CK(cudaFuncSetAttribute(moe_down_qdot8, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sdn));
    for (int t = 0; t < n; t++) {
        moe_gate_up_qdot16<<<dim3(8, k), 256, sgu>>>(bases + (size_t)t * k, L, k, x + (size_t)t * hidden, a3);
        moe_down_qdot8<<<dim3(8, k), 256, sdn>>>(bases + (size_t)t * k, L, a3, out3 + (size_t)t * k * hidden);
    }
    CK(cudaDeviceSynchronize());
    compare("q8 vs rows", out3, out2, (size_t)n * k * hidden, 1e-3);  // likewise
    std::vector<float> a((size_t)n * k * hidden), b(a.size());
    CK(cudaMemcpy(a.data(), out1, a.size() * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(), out2, b.size() * 4, cudaMemcpyDeviceToHost));
    double md = 0, mx = 0; for (size_t i = 0; i < a.size(); i++) { md = std::max(md, (double)fabsf(a[i] - b[i])); mx = std::max(mx, (double)fabsf(a[i])); }
    printf("    q8 vs bf16 hi/lo (the rounding of 8-bit activations): max|diff| %.3g of %.3g (%.2e)\n", md, mx, md / mx);
    CK(cudaFree(all)); CK(cudaFree(dt)); CK(cudaFree(ds)); CK(cudaFree(x)); CK(cudaFree(act)); CK(cudaFree(out1)); CK(cudaFree(out2));
    CK(cudaFree(xp)); CK(cudaFree(xs)); CK(cudaFree(xq)); CK(cudaFree(dxs)); CK(cudaFree(bases)); CK(cudaFree(a3)); CK(cudaFree(out3));
}

static void bench_floor() {
    int* sink; CK(cudaMalloc(&sink, 4));
    double plain = time_graph([&](cudaStream_t s, int) { null_kernel<<<1, 32, 0, s>>>(nullptr); }, 500);
    double pdl = time_graph([&](cudaStream_t s, int) { launch_pdl(null_kernel, dim3(1), 32, s, (int*)nullptr); }, 500);
    double wide = time_graph([&](cudaStream_t s, int) { launch_pdl(null_kernel, dim3(264), 256, s, (int*)nullptr); }, 500);
    printf("floor: empty kernel %.2f us plain, %.2f us PDL, %.2f us PDL 264x256\n", plain, pdl, wide);
    QW q = make_qw(1280, 2048, 4, 64); float* x = dev_floats(2048, -1, 1); float* o; CK(cudaMalloc(&o, 1280 * 4));
    int b = (1280 + qmv_rows_per_block(2048, 4, QMV_STREAM_NC) - 1) / qmv_rows_per_block(2048, 4, QMV_STREAM_NC);
    MultiMatmul mm = one(q, o, b);
    double p1 = time_graph([&](cudaStream_t s, int) { qmv_b4<<<b, 256, 0, s>>>(mm, x); }, 500);
    double p2 = time_graph([&](cudaStream_t s, int) { launch_pdl(qmv_b4, dim3(b), 256, s, mm, (const float*)x); }, 500);
    printf("floor: qmv 1280x2048 (1.3 MB, L2-resident) %.2f us plain, %.2f us PDL\n", p1, p2);
}

int main(int argc, char** argv) {
    const char* only = argc > 1 ? argv[1] : "";
    cudaDeviceProp p; CK(cudaGetDeviceProperties(&p, 0));
    g_sms = p.multiProcessorCount;
    printf("%s, %d SMs, L2 %d MB, QMV_NC %d, QMV_STREAM_NC %d, MX_STREAM_NC %d\n", p.name, p.multiProcessorCount, p.l2CacheSize >> 20, QMV_NC, QMV_STREAM_NC, MX_STREAM_NC);
    if (!*only) bench_floor();
    if (strstr("A3B deltanet in (12288x2048)", only)) bench_product("A3B deltanet in (12288x2048)", 12288, 2048, 4, 64);
    if (strstr("A3B out proj (2048x4096)", only)) bench_product("A3B out proj (2048x4096)", 2048, 4096, 4, 64);
    if (strstr("A3B shared gate (512x2048)", only)) bench_product("A3B shared gate (512x2048)", 512, 2048, 4, 64);
    if (strstr("A3B shared down (2048x512)", only)) bench_product("A3B shared down (2048x512)", 2048, 512, 4, 64);
    if (strstr("A3B router (256x2048)", only)) bench_product("A3B router (256x2048)", 256, 2048, 4, 64);
    if (strstr("397B deltanet in (16384x4096)", only)) bench_product("397B deltanet in (16384x4096)", 16384, 4096, 4, 64);
    if (strstr("397B out proj (4096x8192)", only)) bench_product("397B out proj (4096x8192)", 4096, 8192, 4, 64);
    if (strstr("397B LM head (248320x4096)", only)) bench_product("397B LM head (248320x4096)", 248320, 4096, 4, 64);
    if (strstr("A3B LM head (248320x2048)", only)) bench_product("A3B LM head (248320x2048)", 248320, 2048, 4, 64);
    if (strstr("A3B experts (256, top-8)", only)) bench_slots("A3B experts (256, top-8)", 256, 8, 2048, 512, 4, 64);
    if (strstr("gpt-oss-20b experts (32, top-4)", only)) bench_slots_mx("gpt-oss-20b experts (32, top-4)", 32, 4, 2880, 2880);
    if (strstr("gpt-oss-120b experts (128, top-4)", only)) bench_slots_mx("gpt-oss-120b experts (128, top-4)", 128, 4, 2880, 2880);
    if (strstr("prefill", only)) {
        for (int n : {512, 4096}) {
            bench_prefill("prefill A3B deltanet in (12288x2048)", 12288, 2048, n);
            bench_prefill("prefill A3B out proj (2048x4096)", 2048, 4096, n);
            bench_prefill("prefill A3B shared gate/up (1024x2048)", 1024, 2048, n);
            bench_prefill_experts("prefill A3B experts (256, top-8)", 256, 8, 2048, 512, n);
        }
        bench_prefill("prefill 397B deltanet in (16384x4096)", 16384, 4096, 512);
        bench_prefill_experts("prefill 397B experts (512, top-10)", 512, 10, 4096, 1024, 512);
    }
    if (strstr("397B experts (512, top-10)", only)) bench_slots("397B experts (512, top-10)", 256, 10, 4096, 1024, 4, 64);
    return 0;
}
