// Types, launch conventions (programmatic dependent launch) and the warp
// and block reductions every part uses.

typedef unsigned int u32;
typedef unsigned short u16;

#define WARP 32
#define NEG_INF __int_as_float(0xff800000u)

// Programmatic dependent launch (Hopper+): a kernel may be launched while
// the previous one finishes; it waits for it (and its writes) before doing
// anything, and lets the next one launch at once. Without the launch
// attribute (or before sm_90) both are no-ops.
// The one-token dense products split the two: they load their weights
// (never written once the model is loaded) before waiting, so the fetch
// overlaps the previous kernel's tail. Other kernels may read weights
// before their PDL_ENTER likewise (the norms' weights, the routers' expert
// address table), never anything a kernel writes. Only the dense products
// trigger before they wait; every other kernel waits first and every kernel
// waits before it ends, so kernels complete in launch order.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" :::)
#else
#define PDL_WAIT() \
    do {           \
    } while (0)
#define PDL_TRIGGER() \
    do {              \
    } while (0)
#endif
#define PDL_ENTER()     \
    do {                \
        PDL_WAIT();     \
        PDL_TRIGGER();  \
    } while (0)

__device__ __forceinline__ float bf16f(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x * sigmoidf_(x); }

// Sum over a block (blockDim.x a multiple of 32, at most 1024); every thread
// gets the result.
__device__ float block_sum(float v) {
    __shared__ float part[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) part[w] = v;
    __syncthreads();
    int nw = blockDim.x >> 5;
    float t = lane < nw ? part[lane] : 0.0f;
    return warp_sum(t);
}
