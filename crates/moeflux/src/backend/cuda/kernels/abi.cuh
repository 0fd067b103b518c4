// The structs the kernels take by value. Generated from
// crates/moeflux/src/backend/cuda/abi.rs (the Rust side's #[repr(C)] types):
// edit that file, then `MOEFLUX_WRITE_ABI=1 cargo test -p moeflux --lib abi`.
#ifndef __CUDACC_RTC__
#include <cstddef>
#endif

// A quantized matrix: affine codes with scales and biases, or MXFP4
// codes with scale bytes (`s`; `b` unused).
struct QW {
    // Packed codes, rows x words per row.
    const u32* w;
    // Scales, rows x groups (bf16, or f32 when `sf32`).
    const void* s;
    // Biases, like the scales.
    const void* b;
    int rows;
    int cols;
    int bits;
    int gs;
    int sf32;
};
static_assert(sizeof(QW) == 48, "QW as Rust lays it out");
#ifndef __CUDACC_RTC__
static_assert(offsetof(QW, w) == 0, "QW.w");
static_assert(offsetof(QW, s) == 8, "QW.s");
static_assert(offsetof(QW, b) == 16, "QW.b");
static_assert(offsetof(QW, rows) == 24, "QW.rows");
static_assert(offsetof(QW, cols) == 28, "QW.cols");
static_assert(offsetof(QW, bits) == 32, "QW.bits");
static_assert(offsetof(QW, gs) == 36, "QW.gs");
static_assert(offsetof(QW, sf32) == 40, "QW.sf32");
#endif

// Up to four products of one input in one launch (`qmatmul_body` in
// kernels/qmatmul.cu).
struct MultiMatmul {
    QW q[4];
    float* out[4];
    // A bias per output row added after the product, or null; only the
    // one-token qmv kernels take one (the host adds it after the others).
    const float* bias[4];
    // Blocks of matrix m: first_block[m] .. first_block[m + 1].
    int first_block[5];
    int count;
    // Bit m: add matrix m's product to its output rather than store it.
    int accumulate;
};
static_assert(sizeof(MultiMatmul) == 288, "MultiMatmul as Rust lays it out");
#ifndef __CUDACC_RTC__
static_assert(offsetof(MultiMatmul, q) == 0, "MultiMatmul.q");
static_assert(offsetof(MultiMatmul, out) == 192, "MultiMatmul.out");
static_assert(offsetof(MultiMatmul, bias) == 224, "MultiMatmul.bias");
static_assert(offsetof(MultiMatmul, first_block) == 256, "MultiMatmul.first_block");
static_assert(offsetof(MultiMatmul, count) == 276, "MultiMatmul.count");
static_assert(offsetof(MultiMatmul, accumulate) == 280, "MultiMatmul.accumulate");
#endif

// The biases, norms and output gate of a grouped-query attention layer
// (each pointer null where the family has none): q/k/v biases (rows of
// the projections), the per-head q/k RMSNorm weights, and whether
// q_proj's rows are per head [q | gate] (Qwen3.5 / Qwen3-Next) rather
// than q alone.
struct AttnParts {
    const float* q_bias;
    const float* k_bias;
    const float* v_bias;
    const float* q_norm;
    const float* k_norm;
    int gated;
    // YaRN's magnitude factor of the rotated channels (1 without YaRN).
    float mscale;
};
static_assert(sizeof(AttnParts) == 48, "AttnParts as Rust lays it out");
#ifndef __CUDACC_RTC__
static_assert(offsetof(AttnParts, q_bias) == 0, "AttnParts.q_bias");
static_assert(offsetof(AttnParts, k_bias) == 8, "AttnParts.k_bias");
static_assert(offsetof(AttnParts, v_bias) == 16, "AttnParts.v_bias");
static_assert(offsetof(AttnParts, q_norm) == 24, "AttnParts.q_norm");
static_assert(offsetof(AttnParts, k_norm) == 32, "AttnParts.k_norm");
static_assert(offsetof(AttnParts, gated) == 40, "AttnParts.gated");
static_assert(offsetof(AttnParts, mscale) == 44, "AttnParts.mscale");
#endif

// One routed expert of a batch: where its projections live and which
// (token, slot)s it serves.
struct ExpertTask {
    // The expert's extent.
    const char* base;
    // Its entries in slot_list: first .. first + count.
    int first;
    int count;
};
static_assert(sizeof(ExpertTask) == 16, "ExpertTask as Rust lays it out");
#ifndef __CUDACC_RTC__
static_assert(offsetof(ExpertTask, base) == 0, "ExpertTask.base");
static_assert(offsetof(ExpertTask, first) == 8, "ExpertTask.first");
static_assert(offsetof(ExpertTask, count) == 12, "ExpertTask.count");
#endif

// Where an expert extent holds each projection's codes, scales and
// biases (byte offsets), and how the expert computes.
struct ExpertLayout {
    long gate_w;
    long gate_s;
    long gate_b;
    long up_w;
    long up_s;
    long up_b;
    long down_w;
    long down_s;
    long down_b;
    int inter;
    int hidden;
    // Gate and up projections' code width, group size, F32 scales.
    int bits;
    int gs;
    int sf32;
    // The down projection's, which may differ (llama.cpp's Q4_K_M
    // keeps some `ffn_down_exps` as Q6_K: 6-bit codes in groups of 16).
    int down_bits;
    int down_gs;
    int down_sf32;
    // MXFP4 codes with e8m0 scale bytes (bits 4, gs 32, no biases): the
    // `_mx` kernels.
    int mx;
    // gpt-oss's clamped SwiGLU (alpha, limit) rather than silu(g) * u.
    int oai;
    float alpha;
    float limit;
    // Per-expert biases (gpt-oss), [experts, inter] for gate and up and
    // [experts, hidden] for down, or null; row ids[slot] is the slot's
    // expert (the router's choice).
    const float* bias_g;
    const float* bias_u;
    const float* bias_d;
    const int* ids;
};
static_assert(sizeof(ExpertLayout) == 152, "ExpertLayout as Rust lays it out");
#ifndef __CUDACC_RTC__
static_assert(offsetof(ExpertLayout, gate_w) == 0, "ExpertLayout.gate_w");
static_assert(offsetof(ExpertLayout, gate_s) == 8, "ExpertLayout.gate_s");
static_assert(offsetof(ExpertLayout, gate_b) == 16, "ExpertLayout.gate_b");
static_assert(offsetof(ExpertLayout, up_w) == 24, "ExpertLayout.up_w");
static_assert(offsetof(ExpertLayout, up_s) == 32, "ExpertLayout.up_s");
static_assert(offsetof(ExpertLayout, up_b) == 40, "ExpertLayout.up_b");
static_assert(offsetof(ExpertLayout, down_w) == 48, "ExpertLayout.down_w");
static_assert(offsetof(ExpertLayout, down_s) == 56, "ExpertLayout.down_s");
static_assert(offsetof(ExpertLayout, down_b) == 64, "ExpertLayout.down_b");
static_assert(offsetof(ExpertLayout, inter) == 72, "ExpertLayout.inter");
static_assert(offsetof(ExpertLayout, hidden) == 76, "ExpertLayout.hidden");
static_assert(offsetof(ExpertLayout, bits) == 80, "ExpertLayout.bits");
static_assert(offsetof(ExpertLayout, gs) == 84, "ExpertLayout.gs");
static_assert(offsetof(ExpertLayout, sf32) == 88, "ExpertLayout.sf32");
static_assert(offsetof(ExpertLayout, down_bits) == 92, "ExpertLayout.down_bits");
static_assert(offsetof(ExpertLayout, down_gs) == 96, "ExpertLayout.down_gs");
static_assert(offsetof(ExpertLayout, down_sf32) == 100, "ExpertLayout.down_sf32");
static_assert(offsetof(ExpertLayout, mx) == 104, "ExpertLayout.mx");
static_assert(offsetof(ExpertLayout, oai) == 108, "ExpertLayout.oai");
static_assert(offsetof(ExpertLayout, alpha) == 112, "ExpertLayout.alpha");
static_assert(offsetof(ExpertLayout, limit) == 116, "ExpertLayout.limit");
static_assert(offsetof(ExpertLayout, bias_g) == 120, "ExpertLayout.bias_g");
static_assert(offsetof(ExpertLayout, bias_u) == 128, "ExpertLayout.bias_u");
static_assert(offsetof(ExpertLayout, bias_d) == 136, "ExpertLayout.bias_d");
static_assert(offsetof(ExpertLayout, ids) == 144, "ExpertLayout.ids");
#endif

// A MoE layer's output rows (`moe_combine_at` in kernels/moe.cu):
// `base` (or zero) plus the routed experts' rows weighted by the
// router, plus the shared expert (times sigmoid of its gate logit).
struct MoeCombine {
    // [tokens x k, hidden]: each (token, slot)'s expert output.
    const float* slot_out;
    // [tokens x k]: the router's weights and experts.
    const float* wts;
    const int* ids;
    // In a group: this GPU's experts of the layer (a byte each); the
    // other slots are skipped. Null: every slot counts.
    const unsigned char* own;
    // [tokens, hidden] and [tokens], or null.
    const float* shared;
    const float* sg;
    // [tokens, hidden], or null for zero.
    const float* base;
    int k;
    int h;
};
static_assert(sizeof(MoeCombine) == 64, "MoeCombine as Rust lays it out");
#ifndef __CUDACC_RTC__
static_assert(offsetof(MoeCombine, slot_out) == 0, "MoeCombine.slot_out");
static_assert(offsetof(MoeCombine, wts) == 8, "MoeCombine.wts");
static_assert(offsetof(MoeCombine, ids) == 16, "MoeCombine.ids");
static_assert(offsetof(MoeCombine, own) == 24, "MoeCombine.own");
static_assert(offsetof(MoeCombine, shared) == 32, "MoeCombine.shared");
static_assert(offsetof(MoeCombine, sg) == 40, "MoeCombine.sg");
static_assert(offsetof(MoeCombine, base) == 48, "MoeCombine.base");
static_assert(offsetof(MoeCombine, k) == 56, "MoeCombine.k");
static_assert(offsetof(MoeCombine, h) == 60, "MoeCombine.h");
#endif
