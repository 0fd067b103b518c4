// Quantized weights: MLX affine codes and MXFP4, and how a lane turns a
// 16-byte chunk of codes into a dot product with its activations.

__device__ __forceinline__ float qparam(const void* p, long i, int f32) {
    return f32 ? ((const float*)p)[i] : bf16f(((const u16*)p)[i]);
}

// Code of element j of a row (any bit width: a code may straddle words).
__device__ __forceinline__ u32 qcode(const u32* row, long j, int bits) {
    long bit = j * bits;
    long wi = bit >> 5;
    int sh = (int)(bit & 31);
    unsigned long long v = row[wi];
    if (sh + bits > 32) v |= ((unsigned long long)row[wi + 1]) << 32;
    return (u32)(v >> sh) & ((1u << bits) - 1u);
}

// (a & mask) | 2^23 as one LOP3: left to itself the compiler folds both
// constants into immediates, which takes two LOP3s (one immediate each).
__device__ __forceinline__ float mask_into_2p23(u32 a, u32 mask) {
#ifdef __CUDA_ARCH__
    u32 d, magic = 0x4B000000u;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(magic));
    return __uint_as_float(d);
#else
    return __uint_as_float((a & mask) | 0x4B000000u);
#endif
}

// Code e of a packed word as a float, without an int->float conversion:
// 2^23 + code has the code in its mantissa.
template <int BITS>
__device__ __forceinline__ float qcodef(u32 word, int e) {
    return mask_into_2p23(word >> (e * BITS), (1u << BITS) - 1u) - 8388608.0f;
}

// Code e of a packed word as an exact float times 2^(BITS*j), j = e % P,
// in two instructions (no shift for most codes): the code is masked in
// place into the mantissa of 2^23, which holds P codes below bit 23. The
// activation it meets is pre-scaled by 2^-(BITS*j) (code_prescale): exact
// unless it falls below the normal range (|x| < 2^-110 for 4-bit codes).
template <int BITS>
__device__ __forceinline__ float qcode_scaled(u32 word, int e) {
    constexpr int P = 23 / BITS;
    return mask_into_2p23(word >> ((e / P) * P * BITS), ((1u << BITS) - 1u) << ((e % P) * BITS)) - 8388608.0f;
}
template <int BITS>
__device__ __forceinline__ float code_prescale(int e) {
    return __uint_as_float((u32)(127 - (e % (23 / BITS)) * BITS) << 23);
}

// A lane's 16-byte chunk of codes dotted with its activations, pre-scaled
// by code_prescale (xv[k * 32 / BITS + e] meets code e of word k).
template <int BITS>
__device__ __forceinline__ float chunk_dot(const uint4& wv, const float* xv) {
    constexpr int EPW = 32 / BITS;
    float d = 0.0f;
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        u32 word = kk == 0 ? wv.x : kk == 1 ? wv.y : kk == 2 ? wv.z : wv.w;
#pragma unroll
        for (int e = 0; e < EPW; e++) d = fmaf(qcode_scaled<BITS>(word, e), xv[kk * EPW + e], d);
    }
    return d;
}

// N activations from p (16-byte aligned) into xv; returns their sum.
// Activations are plain loads, never __ldg: they come from the previous
// kernel, and a non-coherent load counts as invariant, which lets the
// compiler hoist it above the PDL wait (stale values).
template <int N>
__device__ __forceinline__ float load_acts(const float* p, float* xv) {
    float xs = 0.0f;
#pragma unroll
    for (int e4 = 0; e4 < N / 4; e4++) {
        float4 f = ((const float4*)p)[e4];
        xv[4 * e4] = f.x;
        xv[4 * e4 + 1] = f.y;
        xv[4 * e4 + 2] = f.z;
        xv[4 * e4 + 3] = f.w;
        xs += (f.x + f.y) + (f.z + f.w);
    }
    return xs;
}

// N gated activations silu(g) * u from g and u (16-byte aligned) into xv;
// returns their sum (the SwiGLU of an MLP applied as its down product loads
// its input).
template <int N>
__device__ __forceinline__ float load_glu(const float* g, const float* u, float* xv) {
    float xs = 0.0f;
#pragma unroll
    for (int e4 = 0; e4 < N / 4; e4++) {
        float4 a = ((const float4*)g)[e4], b = ((const float4*)u)[e4];
        xv[4 * e4] = siluf_(a.x) * b.x;
        xv[4 * e4 + 1] = siluf_(a.y) * b.y;
        xv[4 * e4 + 2] = siluf_(a.z) * b.z;
        xv[4 * e4 + 3] = siluf_(a.w) * b.w;
        xs += (xv[4 * e4] + xv[4 * e4 + 1]) + (xv[4 * e4 + 2] + xv[4 * e4 + 3]);
    }
    return xs;
}

// A warp's share of a quantized product: acc[rr][t] = W[r0 + rr] . x_t for
// the warp's RW rows and up to TT tokens (x_t = xp[t], t < nt), summed over
// the warp (every lane holds the sums). Lane l takes words l, l+32, ... of
// each row, so a warp reads 128 contiguous bytes of a row per step, and
// the activations it loads (float4s, reused by all RW rows) serve every
// row. Per word: sum_e (q_e s + b) x_e = s (q . x) + b sum(x).
#define RW 4

// --------------------------------------------------------------------------
// MXFP4 (gpt-oss's experts): per row, cols / 8 u32 words of 4-bit e2m1 codes
// (LSB first; bit 3 the sign, bits 0-2 index 0, .5, 1, 1.5, 2, 3, 4, 6) and a
// scale byte s per group of 32 columns worth 2^(s - 127). As on the CPU
// (qmatmul/mxfp4.rs) a code enters as twice its value, an exact small
// integer, and the 1/2 is folded into the power-of-two scale. A group is 16
// bytes of codes: one uint4 per lane and group.
#define MXB (-1)  // the BITS of the MXFP4 instantiations
#define MXI (-2)  // MXFP4 dotted in integers (mx_int_dot): the streaming expert kernels
__host__ __device__ constexpr bool is_mx(int bits) { return bits == MXB || bits == MXI; }
// 4-bit affine codes with the activations rounded to 8 bits per 32 columns
// and dotted in integers (q8_prep, q8_dot in qmv.cu): the one-token kernels
// under `--gpu-activations q8`.
#define B4Q8 (-3)

// Twice the code's value plus 12 (0..24) by code, as bytes for
// __byte_perm: codes 0-3, 4-7 (positive), 8-11, 12-15 (negative).
#define MX_T0 0x0F0E0D0Cu  // 12 13 14 15  (0 1 2 3)
#define MX_T1 0x18141210u  // 16 18 20 24  (4 6 8 12)
#define MX_T2 0x090A0B0Cu  // 12 11 10 9   (-0 -1 -2 -3)
#define MX_T3 0x00040608u  // 8 6 4 0      (-4 -6 -8 -12)

// The eight codes of a word as biased bytes: codes 0-3 in r0, 4-7 in r1 (byte
// j of each: code j). Two lookups of the magnitude (three selector bits, the
// sign masked off), then the sign picks between them.
__device__ __forceinline__ void mx_bytes(u32 w, u32& r0, u32& r1) {
    u32 idx = w & 0x77777777u;
    u32 sel = ((w >> 1) & 0x44444444u) | 0x32103210u;  // byte j of lo, or of hi when negative
    u32 lo = __byte_perm(MX_T0, MX_T1, idx), hi = __byte_perm(MX_T2, MX_T3, idx);
    r0 = __byte_perm(lo, hi, sel);
    lo = __byte_perm(MX_T0, MX_T1, idx >> 16);
    hi = __byte_perm(MX_T2, MX_T3, idx >> 16);
    r1 = __byte_perm(lo, hi, sel >> 16);
}

// Byte j of r (a biased code) as twice the code's value: 2^23 + b, less
// 2^23 + 12, exact.
__device__ __forceinline__ float mx_code(u32 r, int j) {
    return mask_into_2p23(r >> (8 * j), 0x1Fu) - 8388620.0f;
}

// Half the e8m0 scale s, exactly: 2^(s - 128) (2^-128 and 2^-127 are
// subnormal), NaN for 255 (the CPU's half_scale_f32).
__device__ __forceinline__ float mx_half_scale(u32 s) {
    if (s >= 2u) return s == 255u ? __int_as_float(0x7fc00000) : __uint_as_float((s - 1u) << 23);
    return __uint_as_float(0x200000u << s);
}

// The 32 codes of a 16-byte chunk (one group), twice their values, dotted
// with x[0..32).
__device__ __forceinline__ float mx_chunk_dot(const uint4& wv, const float* xv) {
    float d = 0.0f;
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        u32 word = kk == 0 ? wv.x : kk == 1 ? wv.y : kk == 2 ? wv.z : wv.w;
        u32 r0, r1;
        mx_bytes(word, r0, r1);
#pragma unroll
        for (int e = 0; e < 4; e++) d = fmaf(mx_code(r0, e), xv[8 * kk + e], d);
#pragma unroll
        for (int e = 0; e < 4; e++) d = fmaf(mx_code(r1, e), xv[8 * kk + 4 + e], d);
    }
    return d;
}
