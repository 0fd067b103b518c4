// The all-reduce of a group's GPUs in one process (backend/cuda/peer.rs):
// each GPU reads the others' partial sums straight from their memory over
// NVLink or PCIe peer access. A decode step sums one 2048-float row per MoE
// layer, where NCCL's latency (not bandwidth) is the cost; this kernel is the
// layer's combine, one signal exchange and one read.
//
// Per call, block b of every rank writes its chunk of its partial sum to
// its exchange buffer (the half the call's parity picks), announces the call
// in block b's signal word at every peer, waits for every peer's
// announcement, and sums chunk b of all ranks in rank order (so every rank gets the same bits, and
// two ranks the bits of any two-rank sum). The halves alternate because a
// peer may still read the previous call's half when this rank starts the
// next; it cannot still read the one before (it announced the previous call
// after finishing it).

#define PEER_MAX_RANKS 8
#define PEER_MAX_BLOCKS 32

__device__ __forceinline__ u32 peer_load_acquire(const u32* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
#else
    u32 v = *(const volatile u32*)p;
    __threadfence();
    return v;
#endif
}

__device__ __forceinline__ void peer_store_release(u32* p, u32 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
    __threadfence();
    *(volatile u32*)p = v;
#endif
}

// A MoE layer's output on a group's GPUs: out = sum over ranks of each
// rank's combine (C: its own experts, the lead's with the residual as base
// and the shared expert), [tokens, hidden], count = tokens * hidden floats,
// h and count multiples of 4 (the host checks; out 16-byte aligned), count
// at most P.cap. out may be C.base. Grid: at most PEER_MAX_BLOCKS blocks,
// the same on every rank.
extern "C" __global__ void moe_combine_peer(PeerReduce P, MoeCombine C, float* out, int count) {
    PDL_ENTER();
    __shared__ u32 epoch;
    int b = blockIdx.x;
    int n4 = count >> 2, chunk = (n4 + gridDim.x - 1) / gridDim.x;
    int lo = b * chunk, hi = min(n4, lo + chunk);
    if (threadIdx.x == 0) epoch = P.epoch[b] + 1;
    __syncthreads();
    u32 e = epoch;
    long half = (long)(e & 1) * P.cap;
    float4* mine = (float4*)(P.data[P.rank] + half);
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        int t = (4 * i) / C.h, c = 4 * i - t * C.h;
        float s = moe_shared_scale(C, t);
        float v[4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            long o = (long)t * C.h + c + q;
            v[q] = (C.base ? C.base[o] : 0.0f) + moe_combine_at(C, s, t, c + q);
        }
        mine[i] = make_float4(v[0], v[1], v[2], v[3]);
    }
    __syncthreads();
    int r = threadIdx.x;
    if (r < P.world && r != P.rank) {
        peer_store_release(P.sig[r] + b * PEER_MAX_RANKS + P.rank, e);
        const u32* w = P.sig[P.rank] + b * PEER_MAX_RANKS + r;
        // Signed difference: a peer may already announce the next call.
        for (u32 spins = 1; (int)(peer_load_acquire(w) - e) < 0; spins++)
            if ((spins & 1023) == 0 && *(const volatile u32*)P.abort) break;
    }
    __syncthreads();
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        // Every peer's load issued before the first add.
        float4 v[PEER_MAX_RANKS];
#pragma unroll
        for (int q = 0; q < PEER_MAX_RANKS; q++)
            if (q < P.world) v[q] = q == P.rank ? mine[i] : __ldcv((const float4*)(P.data[q] + half) + i);
        float4 acc = v[0];
#pragma unroll
        for (int q = 1; q < PEER_MAX_RANKS; q++) {
            if (q < P.world) {
                acc.x += v[q].x;
                acc.y += v[q].y;
                acc.z += v[q].z;
                acc.w += v[q].w;
            }
        }
        ((float4*)out)[i] = acc;
    }
    if (threadIdx.x == 0) P.epoch[b] = e;
}
