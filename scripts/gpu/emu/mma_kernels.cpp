// Checks of the tensor-core prefill products (mma.cu) under cuda_emu.h (see run.sh), on
// random inputs against naive double-precision products of the dequantized weights
// (emu_check.h), through the emulated mma.sync (cuda_emu.h: PTX's fragment layout):
//   mma_split         x into the permuted bf16 hi/lo pairs and f32 group sums.
//   qmma              grouped products of one input (two matrices, one with a residual
//                     add), 4- and 8-bit codes, groups of 32, 64 and 128, token counts
//                     and row counts that are not multiples of the tiles.
//   moe_gate_up_mma   silu(gate x) * (up x) per expert task over its tokens (gathered
//   moe_down_mma      through the slot list), then the down product scattered to the
//                     slots; tasks of 1 to 70 tokens.
//   gpt-oss experts   MXFP4 (moe_*_mx, moe_*_slots_mx, the mma kernels' MXFP4 tiles) and
//                     affine experts with per-expert biases and the clamped SwiGLU through
//                     the grouped, per-slot (moe_*_slots, the activation-stationary
//                     moe_*_qmv and moe_*_stream, rows of uneven slices, MXFP4 by whole
//                     rows (moe_*_rows_mx*) equal to streamed bit for bit) and tensor-core
//                     paths (sums past the limit);
//                     MXFP4 scale extremes (0, 1, 254, 255 = NaN).
//   q8_rows, qmma_q8, the tensor-core products on 8-bit activations (mma.sync m16n8k32,
//   moe_*_mma_q8      u8 codes x s8 activations) against the CPU's q8 contract; the
//   (and *_q8s)       staged ones (mma_staged.cu) also against the unstaged ones.
//   experts, q8       Qwen's per-slot expert kernels with 8-bit activations (moe_*_qmv_b4q8,
//                     moe_*_stream_b4q8) against the CPU's q8 contract.
//   GGUF K-quants     groups of 16 (2-, 3-, 6- and 8-bit codes) through the general
//                     products (qmatmul1, qmatmul) and the embedding lookup (qgather_rows),
//                     and experts whose down projection has another width and group size
//                     than gate and up (llama.cpp's Q4_K_M: Q4_K gate/up, Q6_K down)
//                     through the grouped and per-slot kernels.
//   attn_kv_split     causal attention of a batch over the cache (head dims 32 to 256,
//   attention_mma     2 to 128 query heads per KV group, partial tiles, cache rows
//                     past the context poisoned) against a double-precision softmax.
#include "cuda_emu.h"
#include KERNELS_SOURCE  // the kernel parts of all.cuh, made by run.sh
#include "emu_check.h"
#include "../qmv_geometry.h"

// mma_split of x[n][cols] into xp / xs (sized by the caller's vectors).
static void split(const std::vector<float>& x, int n, int cols, int gs, std::vector<uint4>& xp,
                  std::vector<float>& xs) {
    xp.assign((size_t)n * cols / 4, uint4{});
    xs.assign((size_t)n * cols / gs, NAN);
    long total = (long)n * cols / 4;
    unsigned blocks = (unsigned)((total + 255) / 256);
    const float* px = x.data();
    uint4* pp = xp.data();
    float* ps = xs.data();
    emu_launch({blocks, 1, 1}, 256, [&] { mma_split(px, n, cols, gs, pp, ps); });
}

// Two matrices of one input in one qmma launch; the second adds to its output.
static void test_qmma(int rows_a, int rows_b, int cols, int n, int bits, int gs) {
    HostQ A(rows_a, cols, bits, gs), B(rows_b, cols, 4, gs);
    std::vector<float> x((size_t)n * cols);
    for (auto& v : x) v = urand(-2, 2);
    std::vector<uint4> xp;
    std::vector<float> xs;
    split(x, n, cols, gs, xp, xs);
    std::vector<float> oa((size_t)n * rows_a, NAN), ob((size_t)n * rows_b);
    for (auto& v : ob) v = urand();
    std::vector<float> ob0 = ob;
    int ba = (rows_a + 63) / 64, bb = (rows_b + 63) / 64;
    MultiMatmul mm = two_products(A, B, oa.data(), ob.data(), ba, bb);
    const uint4* pp = xp.data();
    const float* ps = xs.data();
    emu_launch({(unsigned)(ba + bb), (unsigned)((n + 63) / 64), 1}, 128, [&] { qmma(mm, pp, ps, n); });
    std::vector<float> got(oa);
    got.insert(got.end(), ob.begin(), ob.end());
    std::vector<double> want = two_products_ref(A, B, x, n, ob0);
    char name[128];
    snprintf(name, sizeof name, "qmma b%d+b4 g%d %dx%d + %dx%d, %d tokens", bits, gs, rows_a, cols, rows_b, cols, n);
    check(name, got, want, 1e-5);
    // qmma_m1 (32 rows a block): the same sums, bit for bit.
    std::vector<float> oa1((size_t)n * rows_a, NAN), ob1(ob0);
    int ba1 = (rows_a + 31) / 32, bb1 = (rows_b + 31) / 32;
    MultiMatmul mm1 = two_products(A, B, oa1.data(), ob1.data(), ba1, bb1);
    emu_launch({(unsigned)(ba1 + bb1), (unsigned)((n + 63) / 64), 1}, 128, [&] { qmma_m1(mm1, pp, ps, n); });
    oa1.insert(oa1.end(), ob1.begin(), ob1.end());
    snprintf(name, sizeof name, "  qmma_m1 = qmma");
    check(name, oa1, std::vector<double>(got.begin(), got.end()), 0.0);
}

// Random experts: gate and up (inter x hidden) at one width and group size,
// down (hidden x inter) at another.
struct HostExperts {
    std::vector<HostQ> gate, up, down;
};
static HostExperts random_experts(int ne, int hidden, int inter, int gbits, int ggs, int dbits, int dgs) {
    HostExperts x;
    for (int e = 0; e < ne; e++) {
        x.gate.emplace_back(inter, hidden, gbits, ggs);
        x.up.emplace_back(inter, hidden, gbits, ggs);
        x.down.emplace_back(hidden, inter, dbits, dgs);
    }
    return x;
}

// The routed experts of a batch: task e serves tokens 0 .. counts[e] - 1, each as its
// slot j = e (k = the number of tasks).
// One extent per expert: gate | up | down, each codes | scales | biases at
// 16-byte boundaries; sets L's offsets.
static std::vector<std::vector<uint4>> pack_extents(const std::vector<HostQ>& gate, const std::vector<HostQ>& up,
                                                    const std::vector<HostQ>& down, ExpertLayout& L) {
    long off = 0;
    long* fields[3][3] = {{&L.gate_w, &L.gate_s, &L.gate_b}, {&L.up_w, &L.up_s, &L.up_b},
                          {&L.down_w, &L.down_s, &L.down_b}};
    const HostQ* parts0[3] = {&gate[0], &up[0], &down[0]};
    for (int m = 0; m < 3; m++) {
        size_t b[3] = {parts0[m]->w.size() * 4, parts0[m]->s.size() * 2, parts0[m]->b.size() * 2};
        for (int f = 0; f < 3; f++) {
            *fields[m][f] = off;
            off += (long)((b[f] + 15) / 16 * 16);
        }
    }
    std::vector<std::vector<uint4>> extents(gate.size(), std::vector<uint4>((size_t)(off / 16)));
    for (size_t e = 0; e < gate.size(); e++) {
        char* base = (char*)extents[e].data();
        const HostQ* parts[3] = {&gate[e], &up[e], &down[e]};
        for (int m = 0; m < 3; m++) {
            memcpy(base + *fields[m][0], parts[m]->w.data(), parts[m]->w.size() * 4);
            memcpy(base + *fields[m][1], parts[m]->s.data(), parts[m]->s.size() * 2);
            memcpy(base + *fields[m][2], parts[m]->b.data(), parts[m]->b.size() * 2);
        }
    }
    return extents;
}

// The tensor-core experts' set-up: one expert per count (bits-bit codes in groups of gs),
// task e serving tokens 0 .. counts[e] - 1 (slot t * k + e, k = the experts), and x.
struct MmaExperts {
    std::vector<HostQ> gate, up, down;
    ExpertLayout L{};
    std::vector<std::vector<uint4>> extents;
    std::vector<ExpertTask> tasks;
    std::vector<int> slot_list;
    std::vector<float> x;
    int ne, k, n = 0, used;
};
static MmaExperts mma_experts(int hidden, int inter, int bits, int gs, const std::vector<int>& counts) {
    MmaExperts m;
    m.ne = m.k = (int)counts.size();
    for (int c : counts) m.n = std::max(m.n, c);
    auto ex = random_experts(m.ne, hidden, inter, bits, gs, bits, gs);
    m.gate = std::move(ex.gate), m.up = std::move(ex.up), m.down = std::move(ex.down);
    m.extents = pack_extents(m.gate, m.up, m.down, m.L);
    m.L.inter = inter, m.L.hidden = hidden, m.L.bits = bits, m.L.gs = gs, m.L.sf32 = 0;
    m.L.down_bits = bits, m.L.down_gs = gs, m.L.down_sf32 = 0;
    for (int e = 0; e < m.ne; e++) {
        m.tasks.push_back({(const char*)m.extents[e].data(), (int)m.slot_list.size(), counts[e]});
        for (int t = 0; t < counts[e]; t++) m.slot_list.push_back(t * m.k + e);
    }
    m.used = (int)m.slot_list.size();
    m.x.resize((size_t)m.n * hidden);
    for (auto& v : m.x) v = urand(-1, 1);
    return m;
}

static void test_moe_mma(int hidden, int inter, int bits, int gs, std::vector<int> counts) {
    MmaExperts m = mma_experts(hidden, inter, bits, gs, counts);
    auto& [gate, up, down, L, extents, tasks, slot_list, x, ne, k, n, used] = m;
    std::vector<uint4> xp;
    std::vector<float> xs;
    split(x, n, hidden, gs, xp, xs);
    std::vector<float> act((size_t)used * inter, NAN), slot_out((size_t)n * k * hidden, NAN);
    {
        const ExpertTask* pt = tasks.data();
        const int* ps = slot_list.data();
        const uint4* pxp = xp.data();
        const float* pxs = xs.data();
        float* pa = act.data();
        emu_launch({(unsigned)((inter + 63) / 64), (unsigned)ne, 1}, 128,
                   [&] { moe_gate_up_mma(pt, L, ps, k, pxp, pxs, pa); });
    }
    std::vector<double> want_act;
    for (int e = 0; e < ne; e++)
        for (int i = 0; i < counts[e]; i++) {
            int tok = slot_list[tasks[e].first + i] / k;
            for (int r = 0; r < inter; r++) {
                double g = 0, u = 0;
                for (int j = 0; j < hidden; j++) {
                    g += (double)gate[e].deq[(size_t)r * hidden + j] * x[(size_t)tok * hidden + j];
                    u += (double)up[e].deq[(size_t)r * hidden + j] * x[(size_t)tok * hidden + j];
                }
                want_act.push_back(g / (1.0 + exp(-g)) * u);
            }
        }
    char name[128];
    snprintf(name, sizeof name, "moe_gate_up_mma b%d g%d %dx%d, %d tasks", bits, gs, inter, hidden, ne);
    check(name, act, want_act, 1e-5);
    std::vector<uint4> ap;
    std::vector<float> as;
    split(act, used, inter, gs, ap, as);
    {
        const ExpertTask* pt = tasks.data();
        const int* ps = slot_list.data();
        const uint4* pap = ap.data();
        const float* pas = as.data();
        float* po = slot_out.data();
        emu_launch({(unsigned)((hidden + 127) / 128), (unsigned)ne, 1}, 128,
                   [&] { moe_down_mma(pt, L, ps, pap, pas, po); });
    }
    std::vector<float> got;
    std::vector<double> want;
    for (int e = 0; e < ne; e++)
        for (int i = 0; i < counts[e]; i++) {
            int pos = tasks[e].first + i, slot = slot_list[pos];
            for (int r = 0; r < hidden; r++) {
                double acc = 0;
                for (int j = 0; j < inter; j++) acc += (double)down[e].deq[(size_t)r * inter + j] * act[(size_t)pos * inter + j];
                want.push_back(acc);
                got.push_back(slot_out[(size_t)slot * hidden + r]);
            }
        }
    snprintf(name, sizeof name, "moe_down_mma b%d g%d %dx%d, %d tasks", bits, gs, hidden, inter, ne);
    check(name, got, want, 1e-5);
}


// q8_rows of x[n][cols] into xq / dxs (sized here).
static void round_rows(const std::vector<float>& x, int n, int cols, std::vector<u32>& xq, std::vector<float2>& dxs) {
    xq.assign((size_t)n * cols / 4, 0xdeadbeefu);
    dxs.assign((size_t)n * cols / 32, float2{NAN, NAN});
    long total = (long)n * cols / 8;
    const float* px = x.data();
    u32* pq = xq.data();
    float2* pd = dxs.data();
    emu_launch({(unsigned)((total + 255) / 256), 1, 1}, 256, [&] { q8_rows(px, n, cols, pq, pd); });
}

// qmma_q8: two 4-bit matrices of one input on 8-bit activations (the second adds to its
// output) against the CPU's q8 contract per token, in double, with mt row tiles a warp (2
// or 4), or (mt 0) the staged kernel qmma_q8s, which must also agree with qmma_q8 to f32
// rounding (the same integer sums, scaled in another order).
static void test_qmma_q8(int rows_a, int rows_b, int cols, int n, int gs, int mt) {
    HostQ A(rows_a, cols, 4, gs), B(rows_b, cols, 4, gs);
    std::vector<float> x((size_t)n * cols);
    for (auto& v : x) v = urand(-2, 2);
    for (int j = 0; j < 32; j++) x[j] = 0.0f;  // a block of zeros (dx 0)
    std::vector<u32> xq;
    std::vector<float2> dxs;
    round_rows(x, n, cols, xq, dxs);
    std::vector<float> ob0((size_t)n * rows_b);
    for (auto& v : ob0) v = urand();
    const u32* pq = xq.data();
    const float2* pd = dxs.data();
    auto run = [&](int kind, bool b_f32 = false) {
        std::vector<float> oa((size_t)n * rows_a, NAN), ob(ob0);
        int br = kind == 0 ? 128 : 32 * kind, ba = (rows_a + br - 1) / br, bb = (rows_b + br - 1) / br;
        MultiMatmul mm = two_products(A, B, oa.data(), ob.data(), ba, bb, b_f32);
        dim3 grid{(unsigned)(ba + bb), (unsigned)((n + 63) / 64), 1};
        if (kind == 0) emu_launch(grid, 256, [&] { qmma_q8s(mm, pq, pd, n); });
        else emu_launch(grid, 128, [&] { (kind == 4 ? qmma_q8_m4 : qmma_q8)(mm, pq, pd, n); });
        oa.insert(oa.end(), ob.begin(), ob.end());
        return oa;
    };
    std::vector<float> got = run(mt);
    std::vector<double> want;
    for (const HostQ* W : {&A, &B})
        for (int t = 0; t < n; t++) {
            std::vector<double> y = q8_product(*W, &x[(size_t)t * cols]);
            for (int r = 0; r < W->rows; r++) want.push_back(y[r] + (W == &B ? ob0[(size_t)t * W->rows + r] : 0.0));
        }
    char name[128];
    snprintf(name, sizeof name, "qmma_q8%s m%d g%d %dx%d + %dx%d, %d tokens", mt ? "" : "s", mt ? mt : 2, gs, rows_a,
             cols, rows_b, cols, n);
    check(name, got, want, 1e-5);
    if (mt == 0) {
        std::vector<float> two = run(2);
        snprintf(name, sizeof name, "qmma_q8s ~ qmma_q8: g%d %dx%d, %d tokens", gs, rows_a, cols, n);
        check(name, got, std::vector<double>(two.begin(), two.end()), 2e-6);
        // The same values as f32 scales and biases: the same result, bit for bit.
        std::vector<float> f32 = run(0, true);
        snprintf(name, sizeof name, "qmma_q8s f32 scales = bf16: g%d %dx%d, %d tokens", gs, rows_b, cols, n);
        check(name, f32, std::vector<double>(got.begin(), got.end()), 0.0);
    }
}

// moe_gate_up_mma_q8 / moe_down_mma_q8 (task e serves tokens 0 .. counts[e] - 1) against the
// q8 contract: gate and up on the rounded x, down on the rounded act as the kernel left it.
static void test_moe_mma_q8(int hidden, int inter, int gs, std::vector<int> counts, int mt) {
    MmaExperts m = mma_experts(hidden, inter, 4, gs, counts);
    auto& [gate, up, down, L, extents, tasks, slot_list, x, ne, k, n, used] = m;
    const ExpertTask* pt = tasks.data();
    const int* ps = slot_list.data();
    // kind: 2 or 4 row tiles a warp, 0 the staged kernels (mma_staged.cu).
    auto gate_up = [&](int kind) {
        std::vector<u32> xq;
        std::vector<float2> dxs;
        round_rows(x, n, hidden, xq, dxs);
        std::vector<float> act((size_t)used * inter, NAN);
        const u32* pq = xq.data();
        const float2* pd = dxs.data();
        float* pa = act.data();
        if (kind == 0) {
            emu_launch({(unsigned)(inter / 64), (unsigned)ne, 1}, 256,
                       [&] { moe_gate_up_mma_q8s(pt, L, ps, k, pq, pd, pa); });
        } else {
            auto kernel = kind == 4 ? moe_gate_up_mma_q8_m4 : moe_gate_up_mma_q8;
            unsigned br = 32 * kind;
            emu_launch({(unsigned)((inter + br - 1) / br), (unsigned)ne, 1}, 128,
                       [&] { kernel(pt, L, ps, k, pq, pd, pa); });
        }
        return act;
    };
    auto down_of = [&](int kind, const std::vector<float>& act) {
        std::vector<u32> xq;
        std::vector<float2> dxs;
        round_rows(act, used, inter, xq, dxs);
        std::vector<float> slot_out((size_t)n * k * hidden, NAN);
        const u32* pq = xq.data();
        const float2* pd = dxs.data();
        float* po = slot_out.data();
        if (kind == 0) {
            emu_launch({(unsigned)((hidden + 127) / 128), (unsigned)ne, 1}, 256,
                       [&] { moe_down_mma_q8s(pt, L, ps, pq, pd, po); });
        } else {
            auto kernel = kind == 4 ? moe_down_mma_q8_m4 : moe_down_mma_q8;
            unsigned br = 64 * kind;
            emu_launch({(unsigned)((hidden + br - 1) / br), (unsigned)ne, 1}, 128,
                       [&] { kernel(pt, L, ps, pq, pd, po); });
        }
        return slot_out;
    };
    std::vector<float> act = gate_up(mt);
    std::vector<double> want_act;
    for (int e = 0; e < ne; e++)
        for (int i = 0; i < counts[e]; i++) {
            const float* xt = &x[(size_t)(slot_list[tasks[e].first + i] / k) * hidden];
            std::vector<double> g = q8_product(gate[e], xt), u = q8_product(up[e], xt);
            for (int r = 0; r < inter; r++) want_act.push_back(g[r] / (1.0 + exp(-g[r])) * u[r]);
        }
    const char* kind = mt ? "" : "s";
    int tiles = mt ? mt : 2;
    char name[128];
    snprintf(name, sizeof name, "moe_gate_up_mma_q8%s m%d g%d %dx%d, %d tasks", kind, tiles, gs, inter, hidden, ne);
    check(name, act, want_act, 1e-5);
    std::vector<float> slot_out = down_of(mt, act);
    // Rows of the slots in task order (every slot's row is written once).
    auto by_task = [&](const std::vector<float>& so) {
        std::vector<float> rows;
        for (int e = 0; e < ne; e++)
            for (int i = 0; i < counts[e]; i++) {
                int slot = slot_list[tasks[e].first + i];
                rows.insert(rows.end(), so.begin() + (size_t)slot * hidden, so.begin() + (size_t)(slot + 1) * hidden);
            }
        return rows;
    };
    std::vector<double> want;
    for (int e = 0; e < ne; e++)
        for (int i = 0; i < counts[e]; i++) {
            std::vector<double> d = q8_product(down[e], &act[(size_t)(tasks[e].first + i) * inter]);
            want.insert(want.end(), d.begin(), d.end());
        }
    snprintf(name, sizeof name, "moe_down_mma_q8%s m%d g%d %dx%d, %d tasks", kind, tiles, gs, hidden, inter, ne);
    std::vector<float> got = by_task(slot_out);
    check(name, got, want, 1e-5);
    if (mt == 0) {  // the unstaged kernels' sums to f32 rounding
        std::vector<float> act2 = gate_up(2);
        snprintf(name, sizeof name, "moe_gate_up_mma_q8s ~ moe_gate_up_mma_q8: g%d", gs);
        check(name, act, std::vector<double>(act2.begin(), act2.end()), 2e-6);
        std::vector<float> two = by_task(down_of(2, act));
        snprintf(name, sizeof name, "moe_down_mma_q8s ~ moe_down_mma_q8: g%d", gs);
        check(name, got, std::vector<double>(two.begin(), two.end()), 2e-6);
    }
}

// ---------------------------------------------------------------------------------------
// gpt-oss's routed experts: MXFP4 or affine codes, per-expert biases, the clamped SwiGLU,
// through every expert path (grouped by expert, per slot, tensor cores).

static float e2m1(unsigned c) {
    static const float v[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    return (c & 8 ? -1.0f : 1.0f) * v[c & 7];
}

// A random MXFP4 matrix (codes LSB first, a scale byte per 32 columns, drawn from
// [s_lo, s_hi]) and its dequantized weights (in double: extreme scales stay exact).
struct HostMx {
    int rows, cols;
    std::vector<u32> w;
    std::vector<unsigned char> s;
    std::vector<double> deq;
    HostMx(int r, int c, int s_lo = 122, int s_hi = 127) : rows(r), cols(c) {
        w.assign((size_t)r * c / 8, 0);
        s.resize((size_t)r * c / 32);
        deq.resize((size_t)r * c);
        for (auto& x : s) x = (unsigned char)(s_lo + rng() % (s_hi - s_lo + 1));
        for (int i = 0; i < r; i++)
            for (int j = 0; j < c; j++) {
                unsigned code = rng() & 15;
                w[((size_t)i * c + j) / 8] |= code << (4 * (j % 8));
                deq[(size_t)i * c + j] = e2m1(code) * ldexp(1.0, (int)s[(size_t)i * c / 32 + j / 32] - 127);
            }
    }
};

static double oai_ref(double g, double u, double alpha, double limit) {
    g = std::min(g, limit);
    u = std::max(-limit, std::min(u, limit));
    return (u + 1.0) * g / (1.0 + exp(-alpha * g));
}

enum ExpertPath { GROUPED, SLOTS, MMA, QMV, STREAM, ROWS };

// The MXFP4 by-rows kernels of a row width (slices 2 to 4, as moe.rs picks them).
static int mx_rows_slices(int cols) { return (cols / 32 + 31) / 32; }
static void gate_up_rows(int ns, const unsigned long long* pb, ExpertLayout L, int k, const float* px, float* pa) {
    if (ns == 2) moe_gate_up_rows_mx2(pb, L, k, px, pa);
    else if (ns == 3) moe_gate_up_rows_mx3(pb, L, k, px, pa);
    else moe_gate_up_rows_mx4(pb, L, k, px, pa);
}
static void down_rows(int ns, const unsigned long long* pb, ExpertLayout L, const float* pa, float* po) {
    if (ns == 2) moe_down_rows_mx2(pb, L, pa, po);
    else if (ns == 3) moe_down_rows_mx3(pb, L, pa, po);
    else moe_down_rows_mx4(pb, L, pa, po);
}
// Whether two outputs are the same bit for bit (NaNs as written).
static void check_bitwise(const char* what, const std::vector<float>& a, const std::vector<float>& b) {
    size_t diff = 0;
    for (size_t i = 0; i < a.size(); i++) diff += memcmp(&a[i], &b[i], 4) != 0;
    if (diff) fails++;
    printf("%s: %zu of %zu differ %s\n", what, diff, a.size(), diff ? "FAIL" : "ok");
}

// ne experts of one layout (mx: MXFP4, else 4-bit affine, groups of 64) with biases and
// the clamped SwiGLU (alpha 1.702, limit 7; the inputs scaled so that some gate and up
// sums pass the limit); expert e serves tokens 0 .. counts[e] - 1 (slot t * k + e).
static void test_gptoss_experts(int hidden, int inter, bool mx, ExpertPath path, std::vector<int> counts,
                                bool biases = true) {
    int ne = (int)counts.size(), k = ne, n = 0;
    for (int c : counts) n = std::max(n, c);
    int gs = mx ? 32 : 64;
    // Each expert's extent: gate | up | down, each codes | scales (| biases).
    struct Part {
        std::vector<char> w, s, b;
        std::vector<double> deq;
    };
    auto make = [&](int r, int c) {
        Part p;
        if (mx) {
            HostMx m(r, c);
            p.w.assign((char*)m.w.data(), (char*)m.w.data() + m.w.size() * 4);
            p.s.assign((char*)m.s.data(), (char*)m.s.data() + m.s.size());
            p.deq = m.deq;
        } else {
            HostQ q(r, c, 4, gs);
            p.w.assign((char*)q.w.data(), (char*)q.w.data() + q.w.size() * 4);
            p.s.assign((char*)q.s.data(), (char*)q.s.data() + q.s.size() * 2);
            p.b.assign((char*)q.b.data(), (char*)q.b.data() + q.b.size() * 2);
            p.deq.assign(q.deq.begin(), q.deq.end());
        }
        return p;
    };
    std::vector<std::array<Part, 3>> ex;
    for (int e = 0; e < ne; e++) ex.push_back({make(inter, hidden), make(inter, hidden), make(hidden, inter)});
    ExpertLayout L{};
    memset(&L, 0, sizeof L);
    long off = 0;
    long* fields[3][3] = {{&L.gate_w, &L.gate_s, &L.gate_b}, {&L.up_w, &L.up_s, &L.up_b},
                          {&L.down_w, &L.down_s, &L.down_b}};
    for (int m = 0; m < 3; m++) {
        const Part& p = ex[0][m];
        size_t sz[3] = {p.w.size(), p.s.size(), p.b.size()};
        for (int f = 0; f < 3; f++) {
            *fields[m][f] = off;
            off += (long)((sz[f] + 15) / 16 * 16);
        }
    }
    L.inter = inter, L.hidden = hidden, L.bits = 4, L.gs = gs, L.sf32 = 0, L.mx = mx; L.down_bits = L.bits, L.down_gs = L.gs, L.down_sf32 = L.sf32;
    L.oai = 1, L.alpha = 1.702f, L.limit = 7.0f;
    std::vector<std::vector<uint4>> extents(ne, std::vector<uint4>((size_t)(off / 16) + 1));
    for (int e = 0; e < ne; e++) {
        char* base = (char*)extents[e].data();
        for (int m = 0; m < 3; m++) {
            const Part& p = ex[e][m];
            memcpy(base + *fields[m][0], p.w.data(), p.w.size());
            memcpy(base + *fields[m][1], p.s.data(), p.s.size());
            if (!p.b.empty()) memcpy(base + *fields[m][2], p.b.data(), p.b.size());
        }
    }
    // Bias tables of ne + 2 experts (slot e's expert id is e + 1: the row is the id's).
    std::vector<float> bg((size_t)(ne + 2) * inter), bu(bg.size()), bd((size_t)(ne + 2) * hidden);
    for (auto* t : {&bg, &bu, &bd})
        for (auto& v : *t) v = urand(-3, 3);
    std::vector<int> ids((size_t)n * k);
    for (int t = 0; t < n; t++)
        for (int e = 0; e < ne; e++) ids[(size_t)t * k + e] = e + 1;
    if (biases) L.bias_g = bg.data(), L.bias_u = bu.data(), L.bias_d = bd.data();
    L.ids = ids.data();
    std::vector<ExpertTask> tasks;
    std::vector<int> slot_list;
    for (int e = 0; e < ne; e++) {
        tasks.push_back({(const char*)extents[e].data(), (int)slot_list.size(), counts[e]});
        for (int t = 0; t < counts[e]; t++) slot_list.push_back(t * k + e);
    }
    int used = (int)slot_list.size();
    // Inputs wide enough that the clamps matter.
    std::vector<float> x((size_t)n * hidden);
    for (auto& v : x) v = urand(-1, 1) * (mx ? 0.5f : 2.0f);
    // act rows: by slot_list position (grouped, mma) or by slot (slots).
    std::vector<float> act((size_t)n * k * inter, NAN), slot_out((size_t)n * k * hidden, NAN);
    std::vector<unsigned long long> bases((size_t)n * k, 0);
    for (int e = 0; e < ne; e++)
        for (int t = 0; t < counts[e]; t++) bases[(size_t)t * k + e] = (unsigned long long)extents[e].data();
    bool per_slot = path == SLOTS || path == QMV || path == STREAM || path == ROWS;
    int one = path == SLOTS;
    auto rpb = [&](int cols) {  // rows_per_block in linear.rs
        int units = cols * 4 / 128;
        int split = !one ? 1 : units >= 256 ? 8 : units >= 128 ? 4 : units >= 64 ? 2 : 1;
        return 32 / split;
    };
    const ExpertTask* pt = tasks.data();
    const int* ps = slot_list.data();
    const char* pname = path == GROUPED  ? "grouped"
                        : path == SLOTS  ? "slots"
                        : path == QMV    ? "slots qmv"
                        : path == STREAM ? "slots streamed"
                        : path == ROWS   ? "slots by rows"
                                         : "mma";
    // The streaming kernels: 2 blocks per slot, so that each loops over several row
    // groups; the one-pass ones: a block per row group (QMV_CHUNKS = 8 chunks per warp).
    auto qmv_grid = [&](int rows, int cols, int chunks) {
        int per = qmv_rows_per_block(cols, 4, chunks);
        return path == STREAM ? 2u : (unsigned)((rows + per - 1) / per);
    };
    std::vector<uint4> xp;
    std::vector<float> xs;
    {
        const float* px = x.data();
        float* pa = act.data();
        const unsigned long long* pb = bases.data();
        if (path == MMA) {
            split(x, n, hidden, gs, xp, xs);
            const uint4* pxp = xp.data();
            const float* pxs = xs.data();
            emu_launch({(unsigned)((inter + 63) / 64), (unsigned)ne, 1}, 128,
                       [&] { moe_gate_up_mma(pt, L, ps, k, pxp, pxs, pa); });
        } else if (path == GROUPED) {
            emu_launch({(unsigned)((inter + rpb(hidden) - 1) / rpb(hidden)), (unsigned)ne, 1}, 256, [&] {
                if (mx) moe_gate_up_mx(pt, L, ps, k, px, pa);
                else moe_gate_up_b4(pt, L, ps, k, px, pa);
            });
        } else if (path == ROWS) {
            // Three blocks per slot, so that warps take several units and the grid
            // does not divide them; then the streaming kernel, the same bits.
            int ns = mx_rows_slices(hidden);
            emu_launch({3, (unsigned)(n * k), 1}, 256, [&] { gate_up_rows(ns, pb, L, k, px, pa); });
            std::vector<float> act2(act.size(), NAN);
            float* pa2 = act2.data();
            emu_launch({2, (unsigned)(n * k), 1}, qmv_threads(hidden, 4), [&] { moe_gate_up_stream_mx(pb, L, k, px, pa2); });
            check_bitwise("  mxfp4 gate_up by rows == streamed", act, act2);
        } else if (path == QMV || path == STREAM) {
            emu_launch({qmv_grid(inter, hidden, path == STREAM ? 2 : 4), (unsigned)(n * k), 1}, qmv_threads(hidden, 4),
                       [&] {
                           if (path == QMV && mx) moe_gate_up_qmv_mx(pb, L, k, px, pa);
                           else if (path == QMV) moe_gate_up_qmv_b4(pb, L, k, px, pa);
                           else if (mx) moe_gate_up_stream_mx(pb, L, k, px, pa);
                           else moe_gate_up_stream_b4(pb, L, k, px, pa);
                       });
        } else {
            emu_launch({(unsigned)((inter + rpb(hidden) - 1) / rpb(hidden)), (unsigned)(n * k), 1}, 256, [&] {
                if (mx) moe_gate_up_slots_mx(pb, L, k, px, pa);
                else moe_gate_up_slots_b4(pb, L, k, px, pa);
            });
        }
    }
    auto act_row = [&](int e, int i) {  // the act row of task e's i-th token
        return per_slot ? (size_t)slot_list[tasks[e].first + i] : (size_t)(tasks[e].first + i);
    };
    std::vector<float> got;
    std::vector<double> want;
    int clamped = 0;
    for (int e = 0; e < ne; e++)
        for (int i = 0; i < counts[e]; i++) {
            int tok = slot_list[tasks[e].first + i] / k, id = e + 1;
            for (int r = 0; r < inter; r++) {
                double g = 0, u = 0;
                for (int j = 0; j < hidden; j++) {
                    g += ex[e][0].deq[(size_t)r * hidden + j] * x[(size_t)tok * hidden + j];
                    u += ex[e][1].deq[(size_t)r * hidden + j] * x[(size_t)tok * hidden + j];
                }
                if (biases) g += bg[(size_t)id * inter + r], u += bu[(size_t)id * inter + r];
                clamped += g > 7 || std::fabs(u) > 7;
                want.push_back(oai_ref(g, u, 1.702, 7.0));
                got.push_back(act[act_row(e, i) * inter + r]);
            }
        }
    char name[160];
    snprintf(name, sizeof name, "%s gate_up %s %s%dx%d, %d tasks, %d clamped", mx ? "mxfp4" : "affine b4", pname,
             biases ? "biased " : "", inter, hidden, ne, clamped);
    check(name, got, want, 2e-5);
    if (clamped == 0) {
        fails++;
        printf("  no sum passed the limit: FAIL\n");
    }
    std::vector<float> act_in((size_t)used * inter);  // the down's input rows in slot_list order
    for (int e = 0; e < ne; e++)
        for (int i = 0; i < counts[e]; i++)
            memcpy(&act_in[(size_t)(tasks[e].first + i) * inter], &act[act_row(e, i) * inter], 4 * inter);
    {
        float* po = slot_out.data();
        const unsigned long long* pb = bases.data();
        if (path == MMA) {
            std::vector<uint4> ap;
            std::vector<float> as;
            split(act_in, used, inter, gs, ap, as);
            const uint4* pap = ap.data();
            const float* pas = as.data();
            emu_launch({(unsigned)((hidden + 127) / 128), (unsigned)ne, 1}, 128,
                       [&] { moe_down_mma(pt, L, ps, pap, pas, po); });
        } else if (path == GROUPED) {
            const float* pa = act_in.data();
            emu_launch({(unsigned)((hidden + rpb(inter) - 1) / rpb(inter)), (unsigned)ne, 1}, 256, [&] {
                if (mx) moe_down_mx(pt, L, ps, pa, po);
                else moe_down_b4(pt, L, ps, pa, po);
            });
        } else if (path == ROWS) {
            const float* pa = act.data();
            int ns = mx_rows_slices(inter);
            emu_launch({3, (unsigned)(n * k), 1}, 256, [&] { down_rows(ns, pb, L, pa, po); });
            std::vector<float> out2(slot_out.size(), NAN);
            float* po2 = out2.data();
            emu_launch({2, (unsigned)(n * k), 1}, qmv_threads(inter, 4), [&] { moe_down_stream_mx(pb, L, pa, po2); });
            check_bitwise("  mxfp4 down by rows == streamed", slot_out, out2);
        } else if (path == QMV || path == STREAM) {
            const float* pa = act.data();
            emu_launch({qmv_grid(hidden, inter, path == STREAM ? 4 : 8), (unsigned)(n * k), 1}, qmv_threads(inter, 4),
                       [&] {
                           if (path == QMV && mx) moe_down_qmv_mx(pb, L, pa, po);
                           else if (path == QMV) moe_down_qmv_b4(pb, L, pa, po);
                           else if (mx) moe_down_stream_mx(pb, L, pa, po);
                           else moe_down_stream_b4(pb, L, pa, po);
                       });
        } else {
            const float* pa = act.data();
            emu_launch({(unsigned)((hidden + rpb(inter) - 1) / rpb(inter)), (unsigned)(n * k), 1}, 256, [&] {
                if (mx) moe_down_slots_mx(pb, L, pa, po);
                else moe_down_slots_b4(pb, L, pa, po);
            });
        }
    }
    got.clear();
    want.clear();
    for (int e = 0; e < ne; e++)
        for (int i = 0; i < counts[e]; i++) {
            int pos = tasks[e].first + i, slot = slot_list[pos];
            for (int r = 0; r < hidden; r++) {
                double acc = biases ? bd[(size_t)(e + 1) * hidden + r] : 0.0;
                for (int j = 0; j < inter; j++) acc += ex[e][2].deq[(size_t)r * inter + j] * act_in[(size_t)pos * inter + j];
                want.push_back(acc);
                got.push_back(slot_out[(size_t)slot * hidden + r]);
            }
        }
    snprintf(name, sizeof name, "%s down %s %s%dx%d, %d tasks", mx ? "mxfp4" : "affine b4", pname,
             biases ? "biased " : "", hidden, inter, ne);
    check(name, got, want, 2e-5);
}

// MXFP4 scale extremes through the one-slot down product (no biases): every group's scale
// drawn from [s_lo, s_hi], the input scaled by 2^x_exp so that the products are normal
// f32 (scales 0 and 1 are the subnormal 2^-127 and 2^-126 / 2 halves); each output
// compared on its own. Scale 255 (row 1's first group): that row is NaN, others not.
static void test_mx_scales(int s_lo, int s_hi, int x_exp, bool nan_row) {
    int rows = 8, cols = 96;
    HostMx m(rows, cols, s_lo, s_hi);
    if (nan_row) m.s[(size_t)1 * cols / 32] = 255;
    std::vector<char> ext((m.w.size() * 4 + m.s.size() + 64) / 16 * 16 + 16);
    ExpertLayout L{};
    memset(&L, 0, sizeof L);
    L.down_w = 0, L.down_s = (long)m.w.size() * 4, L.inter = cols, L.hidden = rows;
    L.bits = 4, L.gs = 32, L.mx = 1; L.down_bits = L.bits, L.down_gs = L.gs, L.down_sf32 = L.sf32;
    std::vector<uint4> ext16(ext.size() / 16);
    memcpy((char*)ext16.data(), m.w.data(), m.w.size() * 4);
    memcpy((char*)ext16.data() + L.down_s, m.s.data(), m.s.size());
    std::vector<float> a(cols), out(rows, 0.0f);
    for (auto& v : a) v = ldexpf(urand(-1, 1), x_exp);
    unsigned long long base = (unsigned long long)ext16.data();
    {
        const unsigned long long* pb = &base;
        const float* pa = a.data();
        float* po = out.data();
        emu_launch({1, 1, 1}, 256, [&] { moe_down_slots_mx(pb, L, pa, po); });
    }
    int bad = 0;
    double worst = 0;
    for (int r = 0; r < rows; r++) {
        double want = 0, mag = 0;
        for (int j = 0; j < cols; j++) {
            want += m.deq[(size_t)r * cols + j] * a[j];
            mag += std::fabs(m.deq[(size_t)r * cols + j] * a[j]);
        }
        if (nan_row && r == 1) {
            bad += !std::isnan(out[r]);
            continue;
        }
        double d = std::fabs(out[r] - want) / std::max(mag, 1e-300);
        if (!(d <= 1e-6)) bad++;
        worst = std::max(worst, d == d ? d : 1e30);
    }
    if (bad) fails++;
    printf("mxfp4 scales %d..%d, x 2^%d%s: %d bad rows, worst rel %.2e %s\n", s_lo, s_hi, x_exp,
           nan_row ? ", a 255" : "", bad, worst, bad ? "FAIL" : "ok");
}

// attn_kv_split then attention_mma for n new tokens at positions start.. over
// the cache (rows past start + n poisoned with NaN: never read), against a
// double-precision softmax attention times sigmoid(gate) (or ungated).
// With `mma` false, the one-token kernel (`attention`, `attention_plain`) on
// the cache itself instead, against the same reference.
// With `sinks` (one-token kernel only), `attention_sinks`: a random logit
// per head joins each softmax, and with window > 0 a token sees only the
// last `window` positions; with `ring` > 0 (a power of two, at least window - 1 + n) the
// kernel reads a sliding-window layer's ring instead: position p at row p & (ring - 1),
// the ring holding the last `ring` positions (older ones overwritten), poisoned elsewhere.
static void test_attention_mma(int nh, int nkv, int hd, int start, int n, bool gated = true, bool mma = true,
                               bool sinks = false, int window = 0, int ring = 0) {
    int ctx = start + n, cap = ctx + 40, row = nkv * hd;
    std::vector<float> q((size_t)n * nh * hd), gate(q.size()), kc((size_t)cap * row, NAN), vc(kc.size(), NAN);
    for (auto& v : q) v = urand(-1.5f, 1.5f);
    for (auto& v : gate) v = urand(-3, 3);
    for (size_t i = 0; i < (size_t)ctx * row; i++) kc[i] = urand(-1.5f, 1.5f), vc[i] = urand(-2, 2);
    long ctx_pad = (ctx + 31) / 32 * 32, per = ctx_pad * hd / 4;
    std::vector<uint4> kp((size_t)per * nkv), vp(kp.size());
    long start_l = start;
    float scale = 1.0f / sqrtf((float)hd);
    {
        const float *pk = kc.data(), *pv = vc.data();
        uint4 *pkp = kp.data(), *pvp = vp.data();
        emu_launch({(unsigned)((per * nkv + 255) / 256), 2, 1}, 256,
                   [&] { attn_kv_split(pk, pv, nkv, hd, ctx, ctx_pad, pkp, pvp); });
    }
    std::vector<float> out(q.size(), NAN);
    std::vector<float> sink(nh);
    for (auto& v : sink) v = urand(-2, 4);
    int G = nh / nkv, hg = std::min(G, 64), qt = 64 / hg;
    if (sinks) {
        const float *pq = q.data(), *pk = kc.data(), *pv = vc.data(), *ps = sink.data();
        float* po = out.data();
        const long* pp = &start_l;
        std::vector<float> rk, rv;
        long mask = -1;
        if (ring) {
            rk.assign((size_t)ring * row, NAN), rv.assign(rk.size(), NAN);
            for (int p = std::max(0, ctx - ring); p < ctx; p++) {
                std::copy_n(&kc[(size_t)p * row], row, &rk[(size_t)(p & (ring - 1)) * row]);
                std::copy_n(&vc[(size_t)p * row], row, &rv[(size_t)(p & (ring - 1)) * row]);
            }
            pk = rk.data(), pv = rv.data(), mask = ring - 1;
        }
        emu_launch({(unsigned)nh, (unsigned)n, 1}, 256, [&] {
            attention_sinks(pq, pk, pv, ps, nh, nkv, hd, pp, scale, po, nullptr, window, mask, nullptr);
        });
    } else if (!mma) {
        const float *pq = q.data(), *pk = kc.data(), *pv = vc.data(), *pg = gated ? gate.data() : nullptr;
        float* po = out.data();
        const long* pp = &start_l;
        emu_launch({(unsigned)nh, (unsigned)n, 1}, 256, [&] {
            if (gated)
                attention(pq, pk, pv, pg, nh, nkv, hd, pp, scale, po, nullptr);
            else
                attention_plain(pq, pk, pv, pg, nh, nkv, hd, pp, scale, po, nullptr);
        });
    } else {
        const float *pq = q.data(), *pg = gated ? gate.data() : nullptr;
        const uint4 *pkp = kp.data(), *pvp = vp.data();
        float* po = out.data();
        const long* pp = &start_l;
        emu_launch({(unsigned)((n + qt - 1) / qt), (unsigned)(nkv * (G / hg)), 1}, 128,
                   [&] {
                       if (gated)
                           attention_mma(pq, pkp, pvp, pg, nh, nkv, hd, pp, ctx_pad, n, scale, po);
                       else
                           attention_mma_plain(pq, pkp, pvp, pg, nh, nkv, hd, pp, ctx_pad, n, scale, po);
                   });
    }
    std::vector<double> want(q.size());
    for (int t = 0; t < n; t++)
        for (int h = 0; h < nh; h++) {
            const float* qh = &q[((size_t)t * nh + h) * hd];
            int g = h / G, keys = start + t + 1;
            int first = window > 0 && keys > window ? keys - window : 0;
            std::vector<double> sc(keys, 0.0);
            double mx = sinks ? (double)sink[h] : -1e300, sum = 0;
            for (int p = first; p < keys; p++) {
                double d = 0;
                for (int i = 0; i < hd; i++) d += (double)qh[i] * kc[(size_t)p * row + g * hd + i];
                sc[p] = d * scale;
                mx = std::max(mx, sc[p]);
            }
            for (int p = first; p < keys; p++) sum += (sc[p] = exp(sc[p] - mx));
            if (sinks) sum += exp((double)sink[h] - mx);
            for (int i = 0; i < hd; i++) {
                double o = 0;
                for (int p = first; p < keys; p++) o += sc[p] * vc[(size_t)p * row + g * hd + i];
                size_t oi = ((size_t)t * nh + h) * hd + i;
                want[oi] = o / sum / (gated ? 1.0 + exp(-(double)gate[oi]) : 1.0);
            }
        }
    char name[128];
    snprintf(name, sizeof name, "%s nh%d nkv%d hd%d start%d n%d%s window%d ring%d",
             sinks ? "attention_sinks" : mma ? "attention_mma" : "attention", nh, nkv, hd, start, n,
             gated ? "" : " no gate", window, ring);
    check(name, out, want, 2e-5);
}

// ---------------------------------------------------------------------------------------
// GGUF's K-quants: Q6_K, Q3_K and Q2_K become 6-, 3- and 2-bit codes in groups of 16.

// Output rows per block of the general products (rows_per_block in linear.rs).
static int general_rows_per_block(int cols, int bits, bool one) {
    int units = cols * bits / 128;
    int split = !one ? 1 : units >= 256 ? 8 : units >= 128 ? 4 : units >= 64 ? 2 : 1;
    return 32 / split;
}

// Two matrices of one input (the second adding to its output) through qmatmul1 (n = 1)
// or qmatmul.
static void test_general(int rows_a, int rows_b, int cols, int n, int bits_a, int gs_a, int bits_b, int gs_b) {
    HostQ A(rows_a, cols, bits_a, gs_a), B(rows_b, cols, bits_b, gs_b);
    std::vector<float> x((size_t)n * cols);
    for (auto& v : x) v = urand(-2, 2);
    std::vector<float> oa((size_t)n * rows_a, NAN), ob((size_t)n * rows_b);
    for (auto& v : ob) v = urand();
    std::vector<float> ob0 = ob;
    bool one = n == 1;
    int ra = general_rows_per_block(cols, bits_a, one), rb = general_rows_per_block(cols, bits_b, one);
    int ba = (rows_a + ra - 1) / ra, bb = (rows_b + rb - 1) / rb;
    MultiMatmul mm = two_products(A, B, oa.data(), ob.data(), ba, bb);
    const float* px = x.data();
    unsigned ty = (unsigned)std::min((n + 3) / 4, 64);
    emu_launch({(unsigned)(ba + bb), one ? 1u : ty, 1}, 256, [&] {
        if (one) qmatmul1(mm, px, n);
        else qmatmul(mm, px, n);
    });
    std::vector<float> got(oa);
    got.insert(got.end(), ob.begin(), ob.end());
    char name[128];
    snprintf(name, sizeof name, "qmatmul b%d g%d + b%d g%d %dx%d, %d tokens", bits_a, gs_a, bits_b, gs_b, rows_a,
             cols, n);
    check(name, got, two_products_ref(A, B, x, n, ob0), 1e-5);
}

// The embedding lookup (qgather_rows) of a table of `bits`-bit codes in groups of `gs`.
static void test_gather(int rows, int cols, int bits, int gs) {
    HostQ E(rows, cols, bits, gs);
    std::vector<int> ids = {3, 0, rows - 1, 3};
    std::vector<float> out(ids.size() * cols, NAN);
    QW q = E.qw();
    const int* pi = ids.data();
    float* po = out.data();
    emu_launch({(unsigned)ids.size(), 1, 1}, 256, [&] { qgather_rows(q, pi, po); });
    std::vector<double> want;
    for (int id : ids)
        for (int j = 0; j < cols; j++) want.push_back(E.deq[(size_t)id * cols + j]);
    char name[96];
    snprintf(name, sizeof name, "qgather_rows b%d g%d %dx%d", bits, gs, rows, cols);
    check(name, out, want, 1e-6);
}

// The grouped (by expert task) or per-slot expert products with gate/up of one width and
// group size and down of another; expert e serves tokens 0 .. counts[e] - 1 (slot t * k + e).
static void test_mixed_experts(int hidden, int inter, int gbits, int ggs, int dbits, int dgs, bool per_slot,
                               std::vector<int> counts) {
    int ne = (int)counts.size(), k = ne, n = 0;
    for (int c : counts) n = std::max(n, c);
    auto [gate, up, down] = random_experts(ne, hidden, inter, gbits, ggs, dbits, dgs);
    ExpertLayout L{};
    auto extents = pack_extents(gate, up, down, L);
    L.inter = inter, L.hidden = hidden, L.bits = gbits, L.gs = ggs, L.sf32 = 0;
    L.down_bits = dbits, L.down_gs = dgs, L.down_sf32 = 0;
    std::vector<ExpertTask> tasks;
    std::vector<int> slot_list;
    std::vector<unsigned long long> bases((size_t)n * k, 0);
    for (int e = 0; e < ne; e++) {
        tasks.push_back({(const char*)extents[e].data(), (int)slot_list.size(), counts[e]});
        for (int t = 0; t < counts[e]; t++) {
            slot_list.push_back(t * k + e);
            bases[(size_t)t * k + e] = (unsigned long long)extents[e].data();
        }
    }
    std::vector<float> x((size_t)n * hidden);
    for (auto& v : x) v = urand(-1, 1);
    // act rows: by slot_list position (grouped) or by slot (per slot).
    std::vector<float> act((size_t)n * k * inter, NAN), slot_out((size_t)n * k * hidden, NAN);
    const ExpertTask* pt = tasks.data();
    const int* ps = slot_list.data();
    const unsigned long long* pb = bases.data();
    const float* px = x.data();
    float* pa = act.data();
    float* po = slot_out.data();
    unsigned gu_blocks = (unsigned)((inter + general_rows_per_block(hidden, gbits, per_slot) - 1) /
                                    general_rows_per_block(hidden, gbits, per_slot));
    unsigned d_blocks = (unsigned)((hidden + general_rows_per_block(inter, dbits, per_slot) - 1) /
                                   general_rows_per_block(inter, dbits, per_slot));
    // The kernels of each projection's width (kernel_suffix in linear.rs).
    if (per_slot) {
        emu_launch({gu_blocks, (unsigned)(n * k), 1}, 256, [&] {
            switch (gbits) {
                case 4: moe_gate_up_slots_b4(pb, L, k, px, pa); break;
                case 8: moe_gate_up_slots_b8(pb, L, k, px, pa); break;
                case 2: moe_gate_up_slots_b2(pb, L, k, px, pa); break;
                default: moe_gate_up_slots_bx(pb, L, k, px, pa);
            }
        });
    } else {
        emu_launch({gu_blocks, (unsigned)ne, 1}, 256, [&] {
            switch (gbits) {
                case 4: moe_gate_up_b4(pt, L, ps, k, px, pa); break;
                case 8: moe_gate_up_b8(pt, L, ps, k, px, pa); break;
                case 2: moe_gate_up_b2(pt, L, ps, k, px, pa); break;
                default: moe_gate_up_bx(pt, L, ps, k, px, pa);
            }
        });
    }
    auto act_row = [&](int e, int i) {
        return per_slot ? (size_t)slot_list[tasks[e].first + i] : (size_t)(tasks[e].first + i);
    };
    std::vector<float> got;
    std::vector<double> want;
    for (int e = 0; e < ne; e++)
        for (int i = 0; i < counts[e]; i++) {
            int tok = slot_list[tasks[e].first + i] / k;
            for (int r = 0; r < inter; r++) {
                double g = 0, u = 0;
                for (int j = 0; j < hidden; j++) {
                    g += (double)gate[e].deq[(size_t)r * hidden + j] * x[(size_t)tok * hidden + j];
                    u += (double)up[e].deq[(size_t)r * hidden + j] * x[(size_t)tok * hidden + j];
                }
                want.push_back(g / (1.0 + exp(-g)) * u);
                got.push_back(act[act_row(e, i) * inter + r]);
            }
        }
    char name[160];
    const char* pname = per_slot ? "slots" : "grouped";
    snprintf(name, sizeof name, "experts gate_up b%d g%d %s %dx%d", gbits, ggs, pname, inter, hidden);
    check(name, got, want, 1e-5);
    if (per_slot) {
        emu_launch({d_blocks, (unsigned)(n * k), 1}, 256, [&] {
            switch (dbits) {
                case 4: moe_down_slots_b4(pb, L, pa, po); break;
                case 8: moe_down_slots_b8(pb, L, pa, po); break;
                case 2: moe_down_slots_b2(pb, L, pa, po); break;
                default: moe_down_slots_bx(pb, L, pa, po);
            }
        });
    } else {
        emu_launch({d_blocks, (unsigned)ne, 1}, 256, [&] {
            switch (dbits) {
                case 4: moe_down_b4(pt, L, ps, pa, po); break;
                case 8: moe_down_b8(pt, L, ps, pa, po); break;
                case 2: moe_down_b2(pt, L, ps, pa, po); break;
                default: moe_down_bx(pt, L, ps, pa, po);
            }
        });
    }
    got.clear();
    want.clear();
    for (int e = 0; e < ne; e++)
        for (int i = 0; i < counts[e]; i++) {
            int slot = slot_list[tasks[e].first + i];
            size_t ar = act_row(e, i);
            for (int r = 0; r < hidden; r++) {
                double acc = 0;
                for (int j = 0; j < inter; j++) acc += (double)down[e].deq[(size_t)r * inter + j] * act[ar * inter + j];
                want.push_back(acc);
                got.push_back(slot_out[(size_t)slot * hidden + r]);
            }
        }
    snprintf(name, sizeof name, "experts down b%d g%d %s %dx%d", dbits, dgs, pname, hidden, inter);
    check(name, got, want, 1e-5);
}

// Qwen's routed experts (4-bit affine, SwiGLU, no biases) for one token in k slots with
// 8-bit activations (`--gpu-activations q8`): the one-pass (moe_*_qmv_b4q8), streamed
// (moe_*_stream_b4q8) and row (moe_*_qdot{lpr}, `blocks` per slot) per-slot kernels
// against the CPU's q8 contract (q8_product) in double: gate and up on the rounded x, down
// on the rounded act as the kernel left it; a slot with base 0 (the host's) left alone.
enum class Q8Slots { QMV, STREAM, QDOT };
static void test_experts_q8(int hidden, int inter, int k, Q8Slots path, int lpr = 16, int dlpr = 8,
                            unsigned blocks = 3, int gs = 64) {
    auto [gate, up, down] = random_experts(k, hidden, inter, 4, gs, 4, gs);  // slot e: expert e
    ExpertLayout L{};
    auto extents = pack_extents(gate, up, down, L);
    L.inter = inter, L.hidden = hidden, L.bits = 4, L.gs = gs, L.down_bits = 4, L.down_gs = gs;
    std::vector<unsigned long long> bases(k);
    for (int e = 0; e < k; e++) bases[e] = (unsigned long long)extents[e].data();
    bases[k - 1] = 0;  // computed by the host: the kernels skip it
    std::vector<float> x(hidden);
    for (auto& v : x) v = urand(-2, 2);
    const unsigned long long* pb = bases.data();
    const float* px = x.data();
    // The two products into act / out (NaN first, so that rows left unwritten show).
    auto run = [&](unsigned nblocks, std::vector<float>& act, std::vector<float>& out) {
        act.assign((size_t)k * inter, NAN);
        out.assign((size_t)k * hidden, NAN);
        float* pa = act.data();
        float* po = out.data();
        if (path == Q8Slots::QDOT) {
            // lpr: gate/up's lanes a row; down's: dlpr.
            auto gu = lpr == 16 ? moe_gate_up_qdot16 : lpr == 8 ? moe_gate_up_qdot8
                      : lpr == 4 ? moe_gate_up_qdot4 : moe_gate_up_qdot2;
            auto dn = dlpr == 16 ? moe_down_qdot16 : dlpr == 8 ? moe_down_qdot8
                      : dlpr == 4 ? moe_down_qdot4 : moe_down_qdot2;
            emu_launch({nblocks, (unsigned)k, 1}, 256, [&] { gu(pb, L, k, px, pa); });
            emu_launch({nblocks, (unsigned)k, 1}, 256, [&] { dn(pb, L, pa, po); });
            return;
        }
        bool stream = path == Q8Slots::STREAM;
        auto grid = [&](int rows, int cols, int chunks) {
            int per = qmv_rows_per_block(cols, 4, chunks);
            return stream ? 2u : (unsigned)((rows + per - 1) / per);
        };
        emu_launch({grid(inter, hidden, stream ? 2 : 4), (unsigned)k, 1}, qmv_threads(hidden, 4), [&] {
            if (stream) moe_gate_up_stream_b4q8(pb, L, k, px, pa); else moe_gate_up_qmv_b4q8(pb, L, k, px, pa);
        });
        emu_launch({grid(hidden, inter, stream ? 4 : 8), (unsigned)k, 1}, qmv_threads(inter, 4), [&] {
            if (stream) moe_down_stream_b4q8(pb, L, pa, po); else moe_down_qmv_b4q8(pb, L, pa, po);
        });
    };
    std::vector<float> act, out;
    run(blocks, act, out);
    // The computed slots' act rows, then their out rows.
    auto computed = [&](const std::vector<float>& a, const std::vector<float>& o) {
        std::vector<float> v(a.begin(), a.begin() + (size_t)(k - 1) * inter);
        v.insert(v.end(), o.begin(), o.begin() + (size_t)(k - 1) * hidden);
        return v;
    };
    std::vector<float> got = computed(act, out);
    std::vector<double> want_a, want_o;
    for (int e = 0; e < k - 1; e++) {
        std::vector<double> g = q8_product(gate[e], x.data()), u = q8_product(up[e], x.data());
        for (int r = 0; r < inter; r++) want_a.push_back(g[r] / (1.0 + exp(-g[r])) * u[r]);
        std::vector<double> d = q8_product(down[e], &act[(size_t)e * inter]);
        want_o.insert(want_o.end(), d.begin(), d.end());
    }
    bool skipped = true;
    for (int r = 0; r < inter; r++) skipped = skipped && std::isnan(act[(size_t)(k - 1) * inter + r]);
    for (int r = 0; r < hidden; r++) skipped = skipped && std::isnan(out[(size_t)(k - 1) * hidden + r]);
    char kind[32], name[160];
    if (path == Q8Slots::QDOT) snprintf(kind, sizeof kind, "qdot%d/%d", lpr, dlpr);
    else snprintf(kind, sizeof kind, "%s", path == Q8Slots::STREAM ? "stream" : "qmv");
    size_t na = want_a.size();
    snprintf(name, sizeof name, "experts q8 gate_up %s %dx%d, %d slots", kind, inter, hidden, k);
    check(name, std::vector<float>(got.begin(), got.begin() + na), want_a, 1e-5);
    snprintf(name, sizeof name, "experts q8 down %s %dx%d", kind, hidden, inter);
    check(name, std::vector<float>(got.begin() + na, got.end()), want_o, 1e-5);
    if (!skipped) fails++;
    printf("  %-46s %s\n", "the host's slot left alone:", skipped ? "ok" : "FAIL");
    if (path != Q8Slots::QDOT) return;
    // The row kernels' sums do not depend on the grid: one block a slot gives the same bits.
    std::vector<float> act1, out1;
    run(1, act1, out1);
    snprintf(name, sizeof name, "experts q8 %s: 1 block a slot = %u", kind, blocks);
    check(name, computed(act1, out1), std::vector<double>(got.begin(), got.end()), 0.0);
}

// The routed gate/up kernels that route their tokens themselves
// (moe_gate_up_qdot{lpr}_route_c{C}) against moe_route_c{C} followed by
// moe_gate_up_qdot{lpr}: the same ids, weights, expert addresses and act rows,
// bit for bit (n tokens of e experts, k slots each, logits with repeated
// values so ties are broken too).
static void test_routed_gate_up(int e, int k, int n, int lpr, int norm, int hidden = 256, int inter = 128) {
    auto [gate, up, down] = random_experts(e, hidden, inter, 4, 64, 4, 64);
    ExpertLayout L{};
    auto extents = pack_extents(gate, up, down, L);
    L.inter = inter, L.hidden = hidden, L.bits = 4, L.gs = 64, L.down_bits = 4, L.down_gs = 64;
    std::vector<unsigned long long> table(e);
    for (int i = 0; i < e; i++) table[i] = (unsigned long long)extents[i].data();
    std::vector<float> x((size_t)n * hidden), logits((size_t)n * e);
    for (auto& v : x) v = urand(-2, 2);
    for (auto& v : logits) v = (float)(int)urand(-6, 6) * 0.5f;  // ties
    int per = e <= 128 ? 4 : e <= 256 ? 8 : e <= 512 ? 16 : 32;
    int slots = n * k;
    struct Out {
        std::vector<int> ids;
        std::vector<float> wts, act;
        std::vector<unsigned long long> bases;
    };
    auto fresh = [&] {
        Out o{std::vector<int>(slots, -1), std::vector<float>(slots, NAN),
              std::vector<float>((size_t)slots * inter, NAN), std::vector<unsigned long long>(slots, 0)};
        return o;
    };
    const float *pl = logits.data(), *px = x.data();
    const unsigned long long* pt = table.data();
    Out a = fresh(), b = fresh();
    emu_launch({(unsigned)((n + 3) / 4), 1, 1}, 128, [&] {
        switch (per) {
            case 4: moe_route_c4(pl, n, e, k, norm, pt, a.ids.data(), a.wts.data(), a.bases.data()); break;
            case 8: moe_route_c8(pl, n, e, k, norm, pt, a.ids.data(), a.wts.data(), a.bases.data()); break;
            case 16: moe_route_c16(pl, n, e, k, norm, pt, a.ids.data(), a.wts.data(), a.bases.data()); break;
            default: moe_route_c32(pl, n, e, k, norm, pt, a.ids.data(), a.wts.data(), a.bases.data());
        }
    });
    auto gu = lpr == 16 ? moe_gate_up_qdot16 : lpr == 8 ? moe_gate_up_qdot8 : lpr == 4 ? moe_gate_up_qdot4 : moe_gate_up_qdot2;
    const unsigned long long* pa = a.bases.data();
    emu_launch({2, (unsigned)slots, 1}, 256, [&] { gu(pa, L, k, px, a.act.data()); });
#define ROUTED(P) (lpr == 16 ? moe_gate_up_qdot16_route_c##P : lpr == 8 ? moe_gate_up_qdot8_route_c##P : \
                   lpr == 4 ? moe_gate_up_qdot4_route_c##P : moe_gate_up_qdot2_route_c##P)
    auto routed = per == 4 ? ROUTED(4) : per == 8 ? ROUTED(8) : per == 16 ? ROUTED(16) : ROUTED(32);
#undef ROUTED
    emu_launch({2, (unsigned)slots, 1}, 256, [&] {
        routed(pl, e, k, norm, pt, b.ids.data(), b.wts.data(), b.bases.data(), L, px, b.act.data());
    });
    bool same = a.ids == b.ids && a.bases == b.bases && memcmp(a.wts.data(), b.wts.data(), 4 * slots) == 0 &&
                memcmp(a.act.data(), b.act.data(), 4 * a.act.size()) == 0;
    bool chosen = true;
    for (int i = 0; i < slots; i++) chosen = chosen && a.ids[i] >= 0 && a.ids[i] < e;
    for (float v : a.act) chosen = chosen && !std::isnan(v);
    if (!same || !chosen) fails++;
    printf("  routed gate/up qdot%d_route_c%d e%d k%d n%d norm%d = route + gate/up: %s\n", lpr, per, e, k, n, norm,
           same && chosen ? "ok" : "FAIL");
}

int main() {
    test_qmma(80, 48, 256, 37, 4, 64);   // partial row and token tiles
    test_qmma(64, 16, 128, 70, 8, 64);   // 8-bit codes, two token blocks
    test_qmma(40, 24, 256, 9, 4, 32);    // groups of 32
    test_qmma(16, 40, 256, 5, 8, 32);
    test_qmma(72, 8, 512, 20, 4, 128);   // groups of 128
    test_qmma(24, 16, 256, 33, 8, 128);
    for (int mt : {2, 4}) {  // row tiles a warp
        test_qmma_q8(80, 48, 256, 37, 64, mt);   // partial row and token tiles
        test_qmma_q8(40, 24, 256, 70, 32, mt);   // groups of 32, two token blocks
        test_qmma_q8(72, 8, 512, 9, 128, mt);    // groups of 128
        test_qmma_q8(136, 16, 128, 20, 64, mt);  // a second row block
    }
    // Staged: a stage is 64 columns; fewer stages than the ring's depth, more, and a ring
    // that wraps; partial row and token blocks; a second matrix whose rows start mid-block.
    test_qmma_q8(80, 48, 256, 37, 64, 0);
    test_qmma_q8(40, 24, 64, 70, 32, 0);
    test_qmma_q8(72, 8, 512, 9, 128, 0);
    test_qmma_q8(136, 16, 128, 20, 64, 0);
    test_qmma_q8(200, 72, 1024, 130, 128, 0);
    test_qmma_q8(128, 8, 192, 64, 32, 0);
    for (Q8Slots p : {Q8Slots::QMV, Q8Slots::STREAM}) {
        test_experts_q8(2048, 512, 4, p);  // Qwen3.6-35B-A3B's widths
        test_experts_q8(512, 256, 3, p);   // rows of 256 and 128 bytes: several rows per chunk
    }
    // By rows (lanes a row of gate/up and of down): A3B's widths (at 16 lanes a row, down's
    // 512 columns leave one block a lane), 397B's (4096 x 1024), rows of 8 to 10 blocks (four
    // rows a warp), groups of 32 and a partial last set of down (288 rows in sets of 64), the
    // GPU tests' model (256 x 64: down's rows of 2 blocks), rows of 4 and 3 blocks
    test_experts_q8(2048, 512, 3, Q8Slots::QDOT, 16, 8);
    test_experts_q8(2048, 512, 3, Q8Slots::QDOT, 8, 16);
    test_experts_q8(4096, 1024, 2, Q8Slots::QDOT, 16, 8, 5);
    test_experts_q8(4096, 1024, 2, Q8Slots::QDOT, 16, 16, 7);
    test_experts_q8(512, 256, 3, Q8Slots::QDOT, 16, 8);
    test_experts_q8(256, 320, 3, Q8Slots::QDOT, 8, 8, 2);
    test_experts_q8(288, 224, 2, Q8Slots::QDOT, 8, 4, 2, 32);
    test_experts_q8(256, 64, 4, Q8Slots::QDOT, 8, 2, 2);
    test_experts_q8(128, 96, 3, Q8Slots::QDOT, 4, 2, 2, 32);
    test_routed_gate_up(64, 4, 2, 16, 1);
    test_routed_gate_up(200, 8, 1, 16, 1);
    test_routed_gate_up(256, 8, 3, 8, 0);
    test_routed_gate_up(300, 10, 2, 4, 1, 128, 64);
    test_routed_gate_up(600, 6, 1, 2, 1, 64, 64);
    test_moe_mma(128, 64, 4, 64, {1, 9, 70, 3});
    test_moe_mma(64, 96, 8, 32, {5, 33});
    for (int mt : {2, 4}) {
        test_moe_mma_q8(128, 64, 64, {1, 9, 70, 3}, mt);
        test_moe_mma_q8(96, 160, 32, {5, 33}, mt);
        test_moe_mma_q8(288, 160, 32, {2, 17}, mt);  // partial row blocks in both
    }
    // Staged (widths a multiple of 64): several token blocks in a task, partial hidden
    // row blocks in down, groups of 32 and 128.
    test_moe_mma_q8(128, 64, 64, {1, 9, 70, 3}, 0);
    test_moe_mma_q8(320, 192, 32, {5, 33, 130}, 0);
    test_moe_mma_q8(256, 128, 128, {2, 17}, 0);
    // gpt-oss experts: MXFP4 and affine, biases and the clamped SwiGLU, each path
    for (ExpertPath p : {GROUPED, SLOTS, MMA}) {
        test_gptoss_experts(128, 64, true, p, {1, 6, 37});
        test_gptoss_experts(128, 192, false, p, {5, 2});
    }
    test_gptoss_experts(2880 / 10, 320, true, SLOTS, {1, 1});   // 9 groups per row, a partial warp
    test_gptoss_experts(1024, 64, true, SLOTS, {1, 1}, false);  // rows split across warps, no biases
    test_gptoss_experts(64, 96, true, GROUPED, {3}, false);
    // The activation-stationary per-slot kernels, one pass and streamed (MXFP4 dotted in
    // integers there): rows of 64 bytes, of 544 (two uneven slices)
    // and of 1,440 (gpt-oss's 2,880 columns: three slices, 6 warps).
    for (ExpertPath p : {QMV, STREAM}) {
        test_gptoss_experts(128, 256, true, p, {1, 1, 1});
        test_gptoss_experts(1088, 512, true, p, {1, 1});
        test_gptoss_experts(2880, 128, true, p, {1}, false);
        test_gptoss_experts(1088, 256, false, p, {1, 1});
    }
    // MXFP4 by whole rows: rows of 2, 3 (gpt-oss's 2,880 columns) and 4 slices, one
    // token's slots and two tokens' (a slot the host computes: base 0).
    test_gptoss_experts(2880, 1088, true, ROWS, {1, 1});
    test_gptoss_experts(1088, 4096, true, ROWS, {2, 1}, false);
    test_gptoss_experts(1088, 2880, true, ROWS, {1});
    // GGUF K-quants: groups of 16 at every width, one and several tokens, long rows
    // split across warps; Q4_K_M's experts (Q4_K gate/up, Q6_K or Q3_K/Q2_K down).
    for (int bits : {6, 3, 2, 8, 4})
        for (int n : {1, 5}) test_general(24, 12, 256, n, bits, 16, 4, 32);
    test_general(8, 4, 4096, 1, 6, 16, 6, 16);
    test_gather(9, 256, 6, 16);
    test_gather(9, 256, 3, 16);
    test_general(8, 4, 4096, 2, 3, 16, 8, 16);
    for (bool per_slot : {false, true}) {
        test_mixed_experts(256, 128, 4, 32, 6, 16, per_slot, {1, 3, 2});
        test_mixed_experts(256, 128, 2, 16, 3, 16, per_slot, {2, 1});
        test_mixed_experts(128, 256, 6, 16, 4, 32, per_slot, {1, 1});
    }
    test_mx_scales(0, 2, 100, false);     // subnormal halves of the smallest scales
    test_mx_scales(240, 254, -120, true);  // the largest finite scales, and a NaN one
    test_mx_scales(100, 150, 0, false);
    test_attention_mma(4, 2, 32, 5, 37);     // two heads per block row group, 2 token blocks
    test_attention_mma(8, 1, 64, 40, 20);    // 8 heads per group, several key steps
    test_attention_mma(128, 1, 128, 9, 2);   // 128 heads per group: two head blocks
    test_attention_mma(16, 2, 256, 50, 17);  // Qwen3.6-35B-A3B's shape
    test_attention_mma(12, 2, 128, 20, 21, false);  // GLM / Qwen3-MoE: no output gate
    test_attention_mma(4, 2, 32, 0, 20, false);            // qwen3moe-q4's shape
    test_attention_mma(16, 2, 256, 40, 2, true, false);   // the one-token kernel, gated
    test_attention_mma(12, 2, 128, 33, 1, false, false);  // and plain
    // gpt-oss: sinks, a window shorter than the context (several warps see
    // no key), one covering it, and none
    test_attention_mma(8, 2, 64, 37, 3, false, false, true, 5);
    test_attention_mma(8, 2, 64, 3, 4, false, false, true, 128);
    test_attention_mma(4, 1, 32, 20, 2, false, false, true, 0);
    // gpt-oss's window layers read a ring: decode after several wraps, and a chunk that
    // wraps within itself (its first query's keys still held)
    test_attention_mma(8, 2, 64, 70, 1, false, false, true, 8, 16);
    test_attention_mma(8, 2, 64, 45, 9, false, false, true, 8, 16);
    test_attention_mma(4, 1, 32, 100, 3, false, false, true, 128, 256);
    if (fails) {
        printf("%d FAILED\n", fails);
        return 1;
    }
    printf("all ok\n");
    return 0;
}
