// Copies global -> shared memory without holding the bytes in registers
// (cp.async, sm_80+: the host never picks a kernel that uses them below; the
// CPU emulation copies at once).

// The shared-memory address of p, as cp.async takes it. The intrinsic, not
// an `asm volatile` cvta: the compiler then forms the address of a known
// __shared__ array directly and may share the work between copies (NVRTC
// sm_90: 9% fewer instructions in qmma_q8s's code, 5% in moe_gate_up_mma_q8s's).
__device__ __forceinline__ unsigned smem_addr(const void* p) {
#if defined(__CUDA_ARCH__)
    return (unsigned)__cvta_generic_to_shared(p);
#else
    return 0;
#endif
}

// 16 bytes, bypassing L1 (streamed operands).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(smem)), "l"(gmem));
#else
    *(uint4*)smem = *(const uint4*)gmem;
#endif
}

// 8 bytes (through L1: .cg takes only 16).
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_addr(smem)), "l"(gmem));
#else
    *(uint2*)smem = *(const uint2*)gmem;
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;");
#endif
}

// Waits until at most N groups of this thread's copies are in flight (a
// barrier then makes every thread's visible).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}
