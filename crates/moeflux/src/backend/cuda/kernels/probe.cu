// Bandwidth probe: reads n 16-byte words; the sum is written only if it is
// impossible (keeps the loads).
extern "C" __global__ void read_probe(const uint4* p, long n, u32* sink) { PDL_ENTER();
    u32 acc = 0;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        uint4 v = p[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) *sink = acc;
}
