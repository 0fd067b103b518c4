// Helpers shared by the kernel checks under cuda_emu.h (see run.sh): random
// inputs, bf16 conversions, quantized test matrices and the comparison
// against a double-precision reference. Include after KERNELS_SOURCE (it uses
// the kernels' u16, u32 and QW).
#pragma once
#include <cstdio>
#include <random>
#include <numeric>
#include <algorithm>
#include <cmath>

static std::mt19937_64 rng(42);
static float urand(float a = -1, float b = 1) { return std::uniform_real_distribution<float>(a, b)(rng); }
static u16 to_bf16(float f) { unsigned u; memcpy(&u, &f, 4); return (u16)(u >> 16); }
static float from_bf16(u16 h) { unsigned u = ((unsigned)h) << 16; float f; memcpy(&f, &u, 4); return f; }

// A random MLX-affine matrix (4-bit codes in groups of 64 unless told; bf16
// scales and biases) and its dequantized weights for references.
struct HostQ {
    int rows, cols, bits = 4, gs = 64;
    std::vector<u32> w;
    std::vector<u16> s, b;
    std::vector<float> deq;  // reference weights
    std::vector<float> s32, b32;  // the same scales and biases as f32 (qw_f32)
    HostQ(int r, int c, int code_bits = 4, int group = 64) : rows(r), cols(c), bits(code_bits), gs(group) {
        int wpr = c * bits / 32, gpr = c / gs;
        w.assign((size_t)r * wpr, 0);
        s.resize((size_t)r * gpr);
        b.resize((size_t)r * gpr);
        deq.resize((size_t)r * c);
        for (auto& x : s) x = to_bf16(urand(0.01f, 0.1f));
        for (auto& x : b) x = to_bf16(urand(-0.3f, 0.3f));
        for (int i = 0; i < r; i++)
            for (int j = 0; j < c; j++) {
                u32 code = rng() & ((1u << bits) - 1);
                // LSB first; a code of 3, 5 or 6 bits may straddle two words.
                size_t at = (size_t)i * wpr + (size_t)j * bits / 32;
                int sh = (j * bits) % 32;
                w[at] |= code << sh;
                if (sh + bits > 32) w[at + 1] |= code >> (32 - sh);
                float sc = from_bf16(s[(size_t)i * gpr + j / gs]), bi = from_bf16(b[(size_t)i * gpr + j / gs]);
                deq[(size_t)i * c + j] = code * sc + bi;
            }
        for (u16 x : s) s32.push_back(from_bf16(x));
        for (u16 x : b) b32.push_back(from_bf16(x));
    }
    u32 code(int r, int j) const {
        size_t at = (size_t)r * (cols * bits / 32) + (size_t)j * bits / 32;
        int sh = (j * bits) % 32;
        u32 c = w[at] >> sh;
        if (sh + bits > 32) c |= w[at + 1] << (32 - sh);
        return c & ((1u << bits) - 1);
    }
    float scale(int r, int j) const { return from_bf16(s[(size_t)r * (cols / gs) + j / gs]); }
    float bias(int r, int j) const { return from_bf16(b[(size_t)r * (cols / gs) + j / gs]); }
    QW qw() const {
        QW q;
        q.w = w.data(); q.s = s.data(); q.b = b.data();
        q.rows = rows; q.cols = cols; q.bits = bits; q.gs = gs; q.sf32 = 0;
        return q;
    }
    // The same matrix with f32 scales and biases (the kernels' other parameter type).
    QW qw_f32() const {
        QW q = qw();
        q.s = s32.data(); q.b = b32.data(); q.sf32 = 1;
        return q;
    }
};

// The launch parameters of two matrices of one input: A into oa over its ba
// blocks, then B added to ob over its bb blocks (B's scales and biases f32 with b_f32).
static MultiMatmul two_products(const HostQ& A, const HostQ& B, float* oa, float* ob, int ba, int bb,
                                bool b_f32 = false) {
    MultiMatmul mm;
    memset(&mm, 0, sizeof mm);
    mm.q[0] = A.qw(); mm.q[1] = b_f32 ? B.qw_f32() : B.qw();
    mm.out[0] = oa; mm.out[1] = ob;
    mm.count = 2;
    mm.accumulate = 2;
    for (int j = 0; j < 5; j++) mm.first_block[j] = j == 0 ? 0 : j == 1 ? ba : ba + bb;
    return mm;
}

// The double-precision result of `two_products` over n tokens of x ([n][cols]): A x, then
// B x added to ob0, each token-major (the order of oa followed by ob).
static std::vector<double> two_products_ref(const HostQ& A, const HostQ& B, const std::vector<float>& x, int n,
                                            const std::vector<float>& ob0) {
    std::vector<double> want;
    for (const HostQ* W : {&A, &B})
        for (int t = 0; t < n; t++)
            for (int r = 0; r < W->rows; r++) {
                double acc = W == &B ? ob0[(size_t)t * W->rows + r] : 0.0;
                for (int j = 0; j < W->cols; j++)
                    acc += (double)W->deq[(size_t)r * W->cols + j] * x[(size_t)t * W->cols + j];
                want.push_back(acc);
            }
    return want;
}

// The CPU's q8 rounding of a token's activations (backend/cpu/qmatmul/q8.rs
// quantize_block): per 32, xq = round(x * (127 / max|x|)) in f32, dx = max|x| / 127;
// returns xq * dx per input, in double.
static std::vector<double> q8_round(const float* x, int cols) {
    std::vector<double> r(cols);
    for (int b = 0; b < cols; b += 32) {
        float m = 0.0f;
        for (int j = b; j < b + 32; j++) m = std::max(m, std::fabs(x[j]));
        float inv = m > 0.0f ? 127.0f / m : 0.0f, dx = m / 127.0f;
        for (int j = b; j < b + 32; j++) r[j] = (double)std::clamp(std::round(x[j] * inv), -127.0f, 127.0f) * dx;
    }
    return r;
}

// W x under the q8 contract (`--gpu-activations q8`, 4-bit W): the codes times the rounded
// activations, by their scales, plus the biases times the sums of the unrounded ones.
static std::vector<double> q8_product(const HostQ& W, const float* x) {
    std::vector<double> xr = q8_round(x, W.cols), out(W.rows);
    for (int r = 0; r < W.rows; r++) {
        double acc = 0;
        for (int j = 0; j < W.cols; j++)
            acc += (double)W.code(r, j) * W.scale(r, j) * xr[j] + (double)W.bias(r, j) * x[j];
        out[r] = acc;
    }
    return out;
}

// Passes when max |got - want| <= rel * max |want| (a NaN in got fails).
static int fails = 0;
static void check(const char* what, const std::vector<float>& got, const std::vector<double>& want, double rel) {
    double scale = 0, worst = 0;
    for (double v : want) scale = std::max(scale, std::fabs(v));
    for (size_t i = 0; i < want.size(); i++) {
        double d = std::fabs(got[i] - want[i]);
        if (!(d == d)) d = 1e30;
        worst = std::max(worst, d);
    }
    bool ok = worst <= rel * scale;
    if (!ok) fails++;
    printf("%-48s max|diff| %.3e of %.3e %s\n", what, worst, scale, ok ? "ok" : "FAIL");
}
