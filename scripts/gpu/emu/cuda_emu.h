// A tiny CPU emulation of the CUDA features moeflux's kernels use: one fiber
// (a ucontext with its own stack) per CUDA thread, the fibers of a block run
// in turns on one OS thread, blocks one after another; barriers for
// __syncthreads / __syncwarp and warp shuffles switch fibers. Fibers rather
// than OS threads: hundreds of threads meeting at barriers on a 2-core
// machine spend their time in the kernel's scheduler (minutes of CI), and a
// fiber switch costs about a microsecond. For logic checks only.
#pragma once
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <ucontext.h>
#include <vector>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }

inline dim3 threadIdx;  // the running fiber's (set at each switch)
inline dim3 blockIdx, blockDim, gridDim;
inline std::vector<float> g_dyn_smem(1 << 20);

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
// Round to nearest even (the default rounding mode), saturating like the device.
inline int __float2int_rn(float f) {
    if (std::isnan(f)) return 0;
    if (f >= 2147483648.0f) return 0x7fffffff;
    if (f <= -2147483648.0f) return (int)0x80000000;
    return (int)std::nearbyint(f);
}
template <class T> T __ldg(const T* p) { return *p; }
template <class T> T __ldcg(const T* p) { return *p; }
// Blocks run one after another, so a fence only has to order the threads of a
// block (and the atomics below make their updates visible to each other).
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline int __ffs(int x) { return __builtin_ffs(x); }
// Byte n of the result: byte (s >> 4n) & 7 of y:x (the CUDA intrinsic reads three selector bits).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int n = 0; n < 4; n++) r |= (unsigned)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
    return r;
}
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline int __float2int_rz(float x) { return (int)x; }
inline float __fsub_rn(float a, float b) { return a - b; }
using std::min;
using std::max;
inline long min(long a, int b) { return a < b ? a : b; }

// The fibers of the running block and the scheduler they return to.
struct EmuFiber {
    ucontext_t ctx;
    std::unique_ptr<char[]> stack;
    bool done;
};
inline constexpr size_t EMU_STACK = 256 << 10;
inline std::vector<EmuFiber> g_fibers;
inline ucontext_t g_sched;
inline unsigned g_cur;
inline void* g_kernel;  // the launch's functor, called by emu_fiber_entry
inline void emu_yield() { swapcontext(&g_fibers[g_cur].ctx, &g_sched); }

// A barrier of `count` fibers: the last to arrive opens it, the others yield
// until it has opened (a generation count, so it can be reused at once).
struct EmuBarrier {
    unsigned count, arrived = 0;
    unsigned long long gen = 0;
    explicit EmuBarrier(unsigned n) : count(n) {}
    void arrive_and_wait() {
        if (++arrived == count) {
            arrived = 0;
            gen++;
            return;
        }
        for (auto g = gen; gen == g;) emu_yield();
    }
};

struct WarpSync {
    EmuBarrier bar{32};
    unsigned long long slot[32];
    unsigned mma_a[32][4], mma_b[32][2];
};
inline std::vector<std::unique_ptr<WarpSync>> g_warps;
inline EmuBarrier* g_block_bar = nullptr;
template <class T> T __shfl_xor_sync(unsigned, T v, int o) {
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    auto& ws = *g_warps[w];
    memcpy(&ws.slot[l], &v, sizeof(T));
    ws.bar.arrive_and_wait();
    T r;
    memcpy(&r, &ws.slot[l ^ o], sizeof(T));
    ws.bar.arrive_and_wait();
    return r;
}
template <class T> T __shfl_sync(unsigned, T v, int src) {
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    auto& ws = *g_warps[w];
    memcpy(&ws.slot[l], &v, sizeof(T));
    ws.bar.arrive_and_wait();
    T r;
    memcpy(&r, &ws.slot[src & 31], sizeof(T));
    ws.bar.arrive_and_wait();
    return r;
}
// One mma.sync over the warp's fragments, as PTX lays them out for P elements
// a register (bf16: 2, 8-bit: 4; K = 8 P): lane = 4 g + t holds A rows g and
// g + 8 (regs 0, 1) at k = P t .. P t + P - 1 and those + 4 P (regs 2, 3), B
// column g at the same k (regs 0, 1), D rows g, g + 8 at columns 2t, 2t + 1.
// fa / fb give element e of a register; products summed in S.
template <int P, class S, class D, class FA, class FB>
inline void emu_mma(D (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1,
                    FA fa, FB fb) {
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    auto& ws = *g_warps[w];
    unsigned a[4] = {a0, a1, a2, a3};
    memcpy(ws.mma_a[l], a, sizeof a);
    ws.mma_b[l][0] = b0, ws.mma_b[l][1] = b1;
    ws.bar.arrive_and_wait();
    auto A = [&](int row, int k) {
        return fa(ws.mma_a[(row % 8) * 4 + (k % (4 * P)) / P][(row >= 8) + 2 * (k >= 4 * P)], k % P);
    };
    auto B = [&](int k, int col) { return fb(ws.mma_b[col * 4 + (k % (4 * P)) / P][k >= 4 * P], k % P); };
    int g = l / 4, t = l % 4;
    for (int c = 0; c < 4; c++) {
        int row = g + 8 * (c / 2), col = 2 * t + c % 2;
        S s = 0;
        for (int k = 0; k < 8 * P; k++) s += (S)A(row, k) * (S)B(k, col);
        d[c] += (D)s;
    }
    ws.bar.arrive_and_wait();
}
// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 (d += a b): sums in double, so
// only the inputs' bf16 rounding shows.
#define EMU_MMA 1
inline float emu_bf16(unsigned h) { unsigned u = (h & 0xffffu) << 16; float f; memcpy(&f, &u, 4); return f; }
inline void emu_mma_bf16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                         unsigned b1) {
    auto half = [](unsigned r, int e) { return emu_bf16(r >> (16 * e)); };
    emu_mma<2, double>(d, a0, a1, a2, a3, b0, b1, half, half);
}
// mma.sync m16n8k32 (u8 a, s8 b, s32 accumulate): exact in integers.
inline void emu_mma_u8s8(int (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                         unsigned b1) {
    emu_mma<4, int>(
        d, a0, a1, a2, a3, b0, b1, [](unsigned r, int e) { return (int)((r >> (8 * e)) & 0xffu); },
        [](unsigned r, int e) { return (int)(signed char)((r >> (8 * e)) & 0xffu); });
}
inline void __syncwarp(unsigned = 0xffffffffu) { g_warps[threadIdx.x / 32]->bar.arrive_and_wait(); }
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }

template <class F> void emu_fiber_entry() {
    (*static_cast<F*>(g_kernel))();
    g_fibers[g_cur].done = true;  // then uc_link returns to the scheduler
}

template <class F> void emu_launch(dim3 grid, unsigned threads, F f) {
    gridDim = grid;
    blockDim = {threads, 1, 1};
    g_kernel = &f;
    if (g_fibers.size() < threads) g_fibers.resize(threads);
    for (auto& fb : g_fibers)
        if (!fb.stack) fb.stack = std::make_unique<char[]>(EMU_STACK);
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                blockIdx = {bx, by, bz};
                EmuBarrier bar(threads);
                g_block_bar = &bar;
                g_warps.clear();
                for (unsigned w = 0; w < threads / 32; w++) g_warps.push_back(std::make_unique<WarpSync>());
                for (unsigned i = 0; i < threads; i++) {
                    auto& fb = g_fibers[i];
                    getcontext(&fb.ctx);
                    fb.ctx.uc_stack.ss_sp = fb.stack.get();
                    fb.ctx.uc_stack.ss_size = EMU_STACK;
                    fb.ctx.uc_link = &g_sched;
                    fb.done = false;
                    makecontext(&fb.ctx, emu_fiber_entry<F>, 0);
                }
                // Round robin until every fiber has returned; a fiber runs
                // until it finishes or waits at a barrier.
                for (unsigned left = threads; left > 0;)
                    for (unsigned i = 0; i < threads; i++) {
                        if (g_fibers[i].done) continue;
                        g_cur = i;
                        threadIdx = {i, 0, 0};
                        swapcontext(&g_sched, &g_fibers[i].ctx);
                        left -= g_fibers[i].done;
                    }
            }
}
