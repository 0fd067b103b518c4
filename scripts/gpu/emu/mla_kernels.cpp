// Checks of the MLA and router kernels under cuda_emu.h (see run.sh): each kernel on
// random inputs against a naive double-precision reference of backend/cpu/mla.rs, model/rope.rs
// and backend/cpu/router.rs, at the fixtures' and DeepSeek-V3's widths; the softmax router
// (moe_route_c*) against backend/cpu/moe.rs Routing::from_logits at Qwen's widths; moe_group's tasks and
// runs against the choice; the grouped
// one-token products (qmv_b4, qmv_b4_nc2 and their _glu variants, which apply the SwiGLU of
// [gate | up] to their input) against dequantized dot products. The Qwen (GatedDeltaNet,
// attention, MoE combine) kernels are checked by qwen_kernels.cpp. The same products with
// 8-bit activations (qmv_b4q8*, qmv_b48q8*) against the CPU's q8 contract.
#include "cuda_emu.h"
#include KERNELS_SOURCE  // the kernel parts of all.cuh, made by run.sh
#include "emu_check.h"

// rows per block as the host computes it (linear.rs rows_per_block)
static int rpb(int cols, int bits, bool one) {
    int units = cols * bits / 128;
    int split = !one ? 1 : units >= 256 ? 8 : units >= 128 ? 4 : units >= 64 ? 2 : 1;
    return 4 * 8 / split;
}

static void test_heads(int nh, int rph, int cols, int x_head, int n) {
    HostQ W(nh * rph, cols);
    long x_tok = (long)nh * x_head;
    std::vector<float> x((size_t)n * x_tok + 16);
    for (auto& v : x) v = urand();
    std::vector<float> out((size_t)n * W.rows, NAN);
    QW q = W.qw();
    bool one = n == 1;
    unsigned blocks = (W.rows + rpb(cols, 4, one) - 1) / rpb(cols, 4, one);
    unsigned ty = std::min((n + 3) / 4, 64);
    float* o = out.data();
    const float* xp = x.data();
    emu_launch({blocks, ty, 1}, 256, [&] {
        if (one) qmatmul_heads1(q, xp, x_tok, x_head, rph, n, o);
        else qmatmul_heads(q, xp, x_tok, x_head, rph, n, o);
    });
    std::vector<double> want((size_t)n * W.rows);
    for (int t = 0; t < n; t++)
        for (int r = 0; r < W.rows; r++) {
            double acc = 0;
            int h = r / rph;
            for (int j = 0; j < cols; j++) acc += (double)W.deq[(size_t)r * cols + j] * x[t * x_tok + (long)h * x_head + j];
            want[(size_t)t * W.rows + r] = acc;
        }
    char name[128];
    snprintf(name, sizeof name, "qmatmul_heads nh%d rph%d cols%d n%d", nh, rph, cols, n);
    check(name, out, want, 1e-5);
}

// linear.rs qmv_rows_per_block (4-bit, chunks per warp nc)
static int qmv_rpb(int cols, int nc, int bits = 4) {
    int rb = cols * bits / 8;
    if (rb >= 512) {
        int parts = std::min(rb / 512, 8);
        int p2 = 1;
        while (p2 * 2 <= parts) p2 *= 2;
        return 8 / p2 * nc;
    }
    return 8 * nc * (512 / rb);
}

// The one-token activation-stationary per-head products (qmv_heads_b4).
static void test_qmv_heads(int nh, int rph, int cols, int x_head) {
    HostQ W(nh * rph, cols);
    std::vector<float> x((size_t)nh * x_head + 16);
    for (auto& v : x) v = urand();
    std::vector<float> out(W.rows, NAN);
    QW q = W.qw();
    unsigned blocks = (W.rows + qmv_rpb(cols, 8) - 1) / qmv_rpb(cols, 8);
    float* o = out.data();
    const float* xp = x.data();
    emu_launch({blocks, 1, 1}, 256, [&] { qmv_heads_b4(q, xp, x_head, rph, o); });
    std::vector<double> want(W.rows);
    for (int r = 0; r < W.rows; r++) {
        double acc = 0;
        for (int j = 0; j < cols; j++) acc += (double)W.deq[(size_t)r * cols + j] * x[(long)(r / rph) * x_head + j];
        want[r] = acc;
    }
    char name[128];
    snprintf(name, sizeof name, "qmv_heads_b4 nh%d rph%d cols%d", nh, rph, cols);
    check(name, out, want, 1e-5);
}

// Two matrices of one input as the grouped one-token kernels take them: A (8-bit codes with
// `b8`) into oa, B added to ob (random), the sets of `nc` chunks per warp (8 with b8) run over
// `grid` blocks (0, more than the sets, or b8: a block per set); x random, [g | u] with `glu`.
struct QmvGroup {
    HostQ A, B;
    std::vector<float> x, oa, ob, ob0;
    MultiMatmul mm;
    unsigned sets, grid;
    QmvGroup(int rows_a, int rows_b, int cols, bool nc2, bool glu, bool b8, unsigned blocks)
        : A(rows_a, cols, b8 ? 8 : 4), B(rows_b, cols), x(glu ? 2 * cols : cols), oa(rows_a, NAN), ob(rows_b) {
        for (auto& v : x) v = urand(glu ? -3 : -1, glu ? 3 : 1);
        for (auto& v : ob) v = urand();
        ob0 = ob;
        int nc = nc2 ? 2 : b8 ? 8 : 4;
        int ba = (rows_a + qmv_rpb(cols, nc, A.bits) - 1) / qmv_rpb(cols, nc, A.bits);
        int bb = (rows_b + qmv_rpb(cols, nc) - 1) / qmv_rpb(cols, nc);
        mm = two_products(A, B, oa.data(), ob.data(), ba, bb);
        sets = ba + bb;
        grid = b8 || blocks == 0 || blocks > sets ? sets : blocks;
    }
    // kernel(mm, x) over the grid.
    template <class K> void run(K kernel) {
        const float* xp = x.data();
        emu_launch({grid, 1, 1}, 256, [&] { kernel(mm, xp); });
    }
    std::vector<float> got() const {
        std::vector<float> g(oa);
        g.insert(g.end(), ob.begin(), ob.end());
        return g;
    }
};

// The one-token grouped products (qmv_b4 with 4 chunks per warp and set, qmv_b4_nc2 with 2):
// two matrices of one input in one launch, the second added to its output (a residual).
// `glu`: the _glu variants, whose x holds [g | u] (cols each) and whose input is silu(g) * u.
// `b8`: the first matrix has 8-bit codes and both go through qmv_b48 (widths mixed, 8 chunks,
// a block per set). `grid`: blocks of the streaming kernels (each loops over the sets), 0 for
// one per set.
static void test_qmv_group(int rows_a, int rows_b, int cols, bool nc2, bool glu = false, bool b8 = false,
                           unsigned grid = 0) {
    QmvGroup G(rows_a, rows_b, cols, nc2, glu, b8, grid);
    const HostQ &A = G.A, &B = G.B;
    const std::vector<float>& x = G.x;
    std::vector<double> in(cols);  // the product's input
    for (int j = 0; j < cols; j++)
        in[j] = glu ? (double)x[j] / (1.0 + exp(-(double)x[j])) * x[cols + j] : x[j];
    G.run([&](const MultiMatmul& mm, const float* xp) {
        if (b8) {
            if (nc2) qmv_b48_nc2(mm, xp); else qmv_b48(mm, xp);
        } else if (glu) {
            if (nc2) qmv_b4_nc2_glu(mm, xp); else qmv_b4_glu(mm, xp);
        } else {
            if (nc2) qmv_b4_nc2(mm, xp); else qmv_b4(mm, xp);
        }
    });
    std::vector<float> got = G.got(), ob0 = G.ob0;
    unsigned sets = G.sets;
    grid = G.grid;
    std::vector<double> want;
    for (int r = 0; r < rows_a; r++) {
        double acc = 0;
        for (int j = 0; j < cols; j++) acc += (double)A.deq[(size_t)r * cols + j] * in[j];
        want.push_back(acc);
    }
    for (int r = 0; r < rows_b; r++) {
        double acc = ob0[r];
        for (int j = 0; j < cols; j++) acc += (double)B.deq[(size_t)r * cols + j] * in[j];
        want.push_back(acc);
    }
    char name[128];
    snprintf(name, sizeof name, "qmv_b%s%s%s %dx%d + %dx%d, %u of %u blocks", b8 ? "48" : "4", nc2 ? "_nc2" : "",
             glu ? "_glu" : "", rows_a, cols, rows_b, cols, grid, sets);
    check(name, got, want, 1e-5);
}

// Products of a few tokens (qmv_b4_t4 / qmv_b8_t4: four tokens per blockIdx.y, two chunks
// per warp and set): every token's rows equal, bit for bit, the one-token kernel's (qmv_b4 or
// qmv_b8, four chunks) on that token alone, which is what makes a decode batch equal each
// sequence run alone; and the double-precision product within 1e-5.
static void test_qmv_tokens(int rows_a, int rows_b, int cols, int bits, int n, unsigned grid = 0) {
    HostQ A(rows_a, cols, bits), B(rows_b, cols, bits);
    std::vector<float> x((size_t)n * cols);
    for (auto& v : x) v = urand();
    std::vector<float> oa((size_t)n * rows_a, NAN), ob((size_t)n * rows_b);
    for (auto& v : ob) v = urand();
    std::vector<float> ob0 = ob;
    int ba = (rows_a + qmv_rpb(cols, 2, bits) - 1) / qmv_rpb(cols, 2, bits);
    int bb = (rows_b + qmv_rpb(cols, 2, bits) - 1) / qmv_rpb(cols, 2, bits);
    unsigned sets = ba + bb;
    if (grid == 0 || grid > sets) grid = sets;
    {
        MultiMatmul mm = two_products(A, B, oa.data(), ob.data(), ba, bb);
        mm.q[0].rows = rows_a; mm.q[1].rows = rows_b;
        const float* xp = x.data();
        emu_launch({grid, (unsigned)((n + 3) / 4), 1}, 256, [&] {
            if (bits == 8) qmv_b8_t4(mm, xp, n); else qmv_b4_t4(mm, xp, n);
        });
    }
    // Each token alone through the one-token kernel.
    std::vector<float> sa((size_t)n * rows_a, NAN), sb = ob0;
    int ba1 = (rows_a + qmv_rpb(cols, 4, bits) - 1) / qmv_rpb(cols, 4, bits);
    int bb1 = (rows_b + qmv_rpb(cols, 4, bits) - 1) / qmv_rpb(cols, 4, bits);
    for (int t = 0; t < n; t++) {
        MultiMatmul mm = two_products(A, B, &sa[(size_t)t * rows_a], &sb[(size_t)t * rows_b], ba1, bb1);
        const float* xp = &x[(size_t)t * cols];
        emu_launch({(unsigned)(ba1 + bb1), 1, 1}, 256, [&] {
            if (bits == 8) qmv_b8(mm, xp); else qmv_b4(mm, xp);
        });
    }
    std::vector<float> got(oa), alone(sa);
    got.insert(got.end(), ob.begin(), ob.end());
    alone.insert(alone.end(), sb.begin(), sb.end());
    std::vector<double> want = two_products_ref(A, B, x, n, ob0);
    char name[128];
    snprintf(name, sizeof name, "qmv_b%d_t4 %dx%d + %dx%d, n%d, %u of %u blocks", bits, rows_a, cols, rows_b, cols,
             n, grid, sets);
    check(name, got, want, 1e-5);
    snprintf(name, sizeof name, "qmv_b%d_t4 n%d = qmv_b%d per token", bits, n, bits);
    check(name, got, std::vector<double>(alone.begin(), alone.end()), 0.0);
}

// The one-token products with 8-bit activations (`--gpu-activations q8`: qmv_b4q8 and its
// _nc2 / _glu variants, qmv_b48q8 with an 8-bit matrix that keeps f32 activations) against
// the CPU's q8 contract in double (q8_product: the activations rounded per 32 as the CPU
// rounds them), and away from the f32 product (so the rounding did happen). A block of
// zeros stays exact; a non-finite activation makes its rows' sums NaN.
static void test_qmv_q8_group(int rows_a, int rows_b, int cols, bool nc2, bool glu = false, bool b8 = false,
                              unsigned grid = 0) {
    QmvGroup G(rows_a, rows_b, cols, nc2, glu, b8, grid);
    const HostQ &A = G.A, &B = G.B;
    std::vector<float>& x = G.x;
    for (int j = 0; j < 32; j++) x[j] = 0.0f;  // one block of zeros
    std::vector<float> in(cols);  // the product's input, as the kernel computes it
    for (int j = 0; j < cols; j++) in[j] = glu ? x[j] / (1.0f + expf(-x[j])) * x[cols + j] : x[j];
    G.run([&](const MultiMatmul& mm, const float* xp) {
        if (b8) {
            if (nc2) qmv_b48q8_nc2(mm, xp); else qmv_b48q8(mm, xp);
        } else if (glu) {
            if (nc2) qmv_b4q8_nc2_glu(mm, xp); else qmv_b4q8_glu(mm, xp);
        } else {
            if (nc2) qmv_b4q8_nc2(mm, xp); else qmv_b4q8(mm, xp);
        }
    });
    std::vector<float> got = G.got(), ob0 = G.ob0;
    unsigned sets = G.sets;
    grid = G.grid;
    std::vector<double> want, exact;
    std::vector<double> qa = q8_product(A, in.data()), qb = q8_product(B, in.data());
    for (int r = 0; r < rows_a; r++) {
        double e = 0;
        for (int j = 0; j < cols; j++) e += (double)A.deq[(size_t)r * cols + j] * in[j];
        exact.push_back(e);
        want.push_back(b8 ? e : qa[r]);  // the 8-bit matrix keeps f32 activations
    }
    for (int r = 0; r < rows_b; r++) {
        double e = ob0[r];
        for (int j = 0; j < cols; j++) e += (double)B.deq[(size_t)r * cols + j] * in[j];
        exact.push_back(e);
        want.push_back(ob0[r] + qb[r]);
    }
    char name[128];
    snprintf(name, sizeof name, "qmv_b%sq8%s%s %dx%d + %dx%d, %u of %u blocks", b8 ? "48" : "4", nc2 ? "_nc2" : "",
             glu ? "_glu" : "", rows_a, cols, rows_b, cols, grid, sets);
    check(name, got, want, 1e-5);
    double scale = 0, apart = 0;
    for (size_t i = 0; i < exact.size(); i++) {
        scale = std::max(scale, std::fabs(exact[i]));
        apart = std::max(apart, std::fabs(got[i] - exact[i]));
    }
    bool rounded = apart > 1e-4 * scale;
    if (!rounded) fails++;
    printf("  %-46s %.3e of %.3e from f32 %s\n", "rounded:", apart, scale, rounded ? "ok" : "FAIL");
    // A NaN or an infinity in the input: NaN sums for the 4-bit rows, no fault.
    x[40] = INFINITY;
    std::fill(G.ob.begin(), G.ob.end(), 0.0f);
    G.run([&](const MultiMatmul& mm, const float* xp) {
        if (b8) qmv_b48q8(mm, xp); else if (glu) qmv_b4q8_glu(mm, xp); else qmv_b4q8(mm, xp);
    });
    bool nan = true;
    for (float v : G.ob) nan = nan && std::isnan(v);
    if (!nan) fails++;
    printf("  %-46s %s\n", "an infinite input gives NaN:", nan ? "ok" : "FAIL");
}

// qmv_b4q8_t4: every token's rows equal, bit for bit, qmv_b4q8 on that token alone (the
// property that makes a decode batch equal each sequence alone), and the q8 contract.
static void test_qmv_q8_tokens(int rows_a, int rows_b, int cols, int n, unsigned grid = 0) {
    HostQ A(rows_a, cols), B(rows_b, cols);
    std::vector<float> x((size_t)n * cols);
    for (auto& v : x) v = urand();
    std::vector<float> oa((size_t)n * rows_a, NAN), ob((size_t)n * rows_b);
    for (auto& v : ob) v = urand();
    std::vector<float> ob0 = ob;
    int ba = (rows_a + qmv_rpb(cols, 2) - 1) / qmv_rpb(cols, 2);
    int bb = (rows_b + qmv_rpb(cols, 2) - 1) / qmv_rpb(cols, 2);
    unsigned sets = ba + bb;
    if (grid == 0 || grid > sets) grid = sets;
    {
        MultiMatmul mm = two_products(A, B, oa.data(), ob.data(), ba, bb);
        const float* xp = x.data();
        emu_launch({grid, (unsigned)((n + 3) / 4), 1}, 256, [&] { qmv_b4q8_t4(mm, xp, n); });
    }
    std::vector<float> sa((size_t)n * rows_a, NAN), sb = ob0;
    int ba1 = (rows_a + qmv_rpb(cols, 4) - 1) / qmv_rpb(cols, 4);
    int bb1 = (rows_b + qmv_rpb(cols, 4) - 1) / qmv_rpb(cols, 4);
    for (int t = 0; t < n; t++) {
        MultiMatmul mm = two_products(A, B, &sa[(size_t)t * rows_a], &sb[(size_t)t * rows_b], ba1, bb1);
        const float* xp = &x[(size_t)t * cols];
        emu_launch({(unsigned)(ba1 + bb1), 1, 1}, 256, [&] { qmv_b4q8(mm, xp); });
    }
    std::vector<float> got(oa), alone(sa);
    got.insert(got.end(), ob.begin(), ob.end());
    alone.insert(alone.end(), sb.begin(), sb.end());
    std::vector<double> want;
    for (const HostQ* W : {&A, &B})
        for (int t = 0; t < n; t++) {
            std::vector<double> p = q8_product(*W, &x[(size_t)t * cols]);
            for (int r = 0; r < W->rows; r++) want.push_back(p[r] + (W == &B ? ob0[(size_t)t * W->rows + r] : 0.0));
        }
    char name[128];
    snprintf(name, sizeof name, "qmv_b4q8_t4 %dx%d + %dx%d, n%d, %u of %u blocks", rows_a, cols, rows_b, cols, n,
             grid, sets);
    check(name, got, want, 1e-5);
    snprintf(name, sizeof name, "qmv_b4q8_t4 n%d = qmv_b4q8 per token", n);
    check(name, got, std::vector<double>(alone.begin(), alone.end()), 0.0);
}

// The one- and few-token q8 products in each launch shape (qdot_b4q8, _glu, _t4 with suffix ""
// 32 lanes a row and two rows, _r1 32 and one, _l16 16 and two, _l8 8 and two): the q8
// contract (q8_product) within 1e-5 over grids that loop over the sets (`grid` blocks), and
// the few-token kernels' tokens equal the shape's one-token kernel on each alone, bit for bit.
struct QdotShape {
    const char* sfx;
    int rows_a_set;
    void (*one)(MultiMatmul, const float*, int);
    void (*glu)(MultiMatmul, const float*, int);
    void (*t4)(MultiMatmul, const float*, int);
};
static const QdotShape QDOT_SHAPES[] = {
    {"", 16, qdot_b4q8, qdot_b4q8_glu, qdot_b4q8_t4},
    {"_r1", 8, qdot_b4q8_r1, qdot_b4q8_glu_r1, qdot_b4q8_t4_r1},
    {"_l16", 32, qdot_b4q8_l16, qdot_b4q8_glu_l16, qdot_b4q8_t4_l16},
    {"_l8", 64, qdot_b4q8_l8, qdot_b4q8_glu_l8, qdot_b4q8_t4_l8},
};
static void test_qdot(int rows_a, int rows_b, int cols, bool glu, unsigned grid, int n = 1, int shape = 0) {
    const QdotShape& sh = QDOT_SHAPES[shape];
    HostQ A(rows_a, cols), B(rows_b, cols);
    std::vector<float> x(glu ? 2 * cols : (size_t)n * cols);
    for (auto& v : x) v = urand(glu ? -3 : -1, glu ? 3 : 1);
    std::vector<float> in(x);  // the product's input, as the kernel computes it
    if (glu) {
        in.resize(cols);
        for (int j = 0; j < cols; j++) in[j] = x[j] / (1.0f + expf(-x[j])) * x[cols + j];
    }
    std::vector<float> oa((size_t)n * rows_a, NAN), ob((size_t)n * rows_b);
    for (auto& v : ob) v = urand();
    std::vector<float> ob0 = ob;
    int per = sh.rows_a_set;
    int ba = (rows_a + per - 1) / per, bb = (rows_b + per - 1) / per;
    unsigned sets = ba + bb;
    grid = std::min(grid, sets);
    MultiMatmul mm = two_products(A, B, oa.data(), ob.data(), ba, bb);
    const float* xp = x.data();
    emu_launch({grid, (unsigned)((n + 3) / 4), 1}, 256, [&] {
        if (glu) sh.glu(mm, xp, 1);
        else if (n > 1) sh.t4(mm, xp, n);
        else sh.one(mm, xp, 1);
    });
    std::vector<float> got(oa);
    got.insert(got.end(), ob.begin(), ob.end());
    std::vector<double> want;
    for (const HostQ* W : {&A, &B})
        for (int t = 0; t < n; t++) {
            std::vector<double> p = q8_product(*W, &in[(size_t)t * cols]);
            for (int r = 0; r < W->rows; r++) want.push_back(p[r] + (W == &B ? ob0[(size_t)t * W->rows + r] : 0.0));
        }
    char name[128];
    snprintf(name, sizeof name, "qdot_b4q8%s%s %dx%d + %dx%d, n%d, %u of %u blocks", glu ? "_glu" : n > 1 ? "_t4" : "",
             sh.sfx, rows_a, cols, rows_b, cols, n, grid, sets);
    check(name, got, want, 1e-5);
    if (n == 1) return;
    std::vector<float> sa((size_t)n * rows_a, NAN), sb = ob0;
    for (int t = 0; t < n; t++) {
        MultiMatmul m1 = two_products(A, B, &sa[(size_t)t * rows_a], &sb[(size_t)t * rows_b], ba, bb);
        const float* xt = &x[(size_t)t * cols];
        emu_launch({(unsigned)(ba + bb), 1, 1}, 256, [&] { sh.one(m1, xt, 1); });
    }
    std::vector<float> alone(sa);
    alone.insert(alone.end(), sb.begin(), sb.end());
    snprintf(name, sizeof name, "qdot_b4q8_t4%s n%d = qdot_b4q8%s per token", sh.sfx, n, sh.sfx);
    check(name, got, std::vector<double>(alone.begin(), alone.end()), 0.0);
}

// argmax_parts + argmax_merge: per row the first index of its largest value (sample.rs
// argmax on finite logits), -1 for a row with a NaN or an infinity; `parts` blocks a row (the
// engine's rule: ceil(v / 4096) up to 64), the merge in 64 threads.
static void test_argmax(int v, unsigned threads, int parts) {
    const int rows = 7;
    std::vector<float> x((size_t)rows * v);
    for (auto& a : x) a = urand(-4, 4);
    auto row = [&](int r) { return &x[(size_t)r * v]; };
    // Row 1: its maximum three times (the first wins); row 2: all equal; row 3: the maximum
    // last; row 4: a NaN; row 5: +inf; row 6: -inf beside the true maximum.
    for (int at : {v / 3, v / 2, v - 2}) row(1)[at] = 9.0f;
    for (int i = 0; i < v; i++) row(2)[i] = -1.5f;
    row(3)[v - 1] = 5.0f;
    row(4)[v / 4] = NAN;
    row(5)[v - 3] = INFINITY;
    row(6)[7] = -INFINITY;
    std::vector<int> got(rows, -7);
    {
        const int span = (v + parts - 1) / parts;
        std::vector<float> pbest((size_t)rows * parts, -7.0f);
        std::vector<int> pat((size_t)rows * parts, -7), pbad((size_t)rows * parts, -7);
        const float* xp = x.data();
        float* bp = pbest.data();
        int *ap = pat.data(), *dp = pbad.data(), *op = got.data();
        emu_launch({(unsigned)parts, (unsigned)rows, 1}, threads, [&] { argmax_parts(xp, v, span, bp, ap, dp); });
        emu_launch({(unsigned)rows, 1, 1}, 64, [&] { argmax_merge(bp, ap, dp, parts, op); });
    }
    int bad = 0;
    for (int r = 0; r < rows; r++) {
        const float* p = row(r);
        int want = 0;
        bool finite = true;
        for (int i = 0; i < v; i++) {
            if (!std::isfinite(p[i])) finite = false;
            if (p[i] > p[want]) want = i;
        }
        if (!finite) want = -1;
        if (got[r] != want) {
            bad++;
            printf("  row %d: got %d, want %d\n", r, got[r], want);
        }
    }
    if (bad) fails++;
    printf("argmax v%d, %d parts of %u threads: %d of %d rows wrong %s\n", v, parts, threads, bad, rows,
           bad ? "FAIL" : "ok");
}

// model/rope.rs Rope::apply
static void rope_ref(double* x, int r, long pos, double ps, const std::vector<double>& inv, float ms) {
    double p = pos * ps;
    for (int i = 0; i < r / 2; i++) {
        double s = sin(p * inv[i]), c = cos(p * inv[i]);
        double a = x[2 * i] * ms, b = x[2 * i + 1] * ms;
        x[2 * i] = a * c - b * s;
        x[2 * i + 1] = a * s + b * c;
    }
}

static void test_mla(int nh, int kvl, int r, int nope, int n, long start, int t0chunk) {
    int qhd = nope + r;
    float eps = 1e-6f, mscale = 1.3f, scale = 0.11f;
    double ps = 1.0;
    std::vector<double> inv(r / 2);
    for (int i = 0; i < r / 2; i++) inv[i] = pow(10000.0, -2.0 * i / r) / (i > r / 4 ? 40.0 : 1.0);
    long ctx = start + n;
    // Cache rows before start: random (earlier tokens).
    std::vector<float> lat((size_t)(ctx + 3) * kvl, NAN), rope((size_t)(ctx + 3) * r, NAN);
    for (long p = 0; p < start; p++) {
        for (int i = 0; i < kvl; i++) lat[p * kvl + i] = urand();
        for (int i = 0; i < r; i++) rope[p * r + i] = urand();
    }
    std::vector<float> kv((size_t)n * (kvl + r)), q((size_t)n * nh * qhd), knorm(kvl);
    for (auto& v : kv) v = urand(-2, 2);
    for (auto& v : q) v = urand();
    for (auto& v : knorm) v = urand(0.5, 1.5);
    std::vector<float> q0 = q;
    long pos = start;
    // prep
    {
        const float* kvp = kv.data(); float* qp = q.data(); const float* kn = knorm.data();
        const double* ip = inv.data(); float* lp = lat.data(); float* rp = rope.data(); const long* pp = &pos;
        emu_launch({(unsigned)(1 + nh), (unsigned)n, 1}, 256, [&] {
            mla_prep(kvp, qp, kn, ip, nh, kvl, r, qhd, nope, eps, mscale, pp, ps, lp, rp);
        });
    }
    // reference prep
    std::vector<double> rlat((size_t)ctx * kvl), rrope((size_t)ctx * r), rq(q0.begin(), q0.end());
    for (long p = 0; p < start; p++) {
        for (int i = 0; i < kvl; i++) rlat[p * kvl + i] = lat[p * kvl + i];
        for (int i = 0; i < r; i++) rrope[p * r + i] = rope[p * r + i];
    }
    for (int t = 0; t < n; t++) {
        long p = start + t;
        double ss = 0;
        for (int i = 0; i < kvl; i++) ss += (double)kv[t * (kvl + r) + i] * kv[t * (kvl + r) + i];
        double invr = 1.0 / sqrt(ss / kvl + eps);
        for (int i = 0; i < kvl; i++) rlat[p * kvl + i] = kv[t * (kvl + r) + i] * invr * knorm[i];
        for (int i = 0; i < r; i++) rrope[p * r + i] = kv[t * (kvl + r) + kvl + i];
        rope_ref(&rrope[p * r], r, p, ps, inv, mscale);
        for (int h = 0; h < nh; h++) rope_ref(&rq[((size_t)t * nh + h) * qhd + nope], r, p, ps, inv, mscale);
    }
    std::vector<float> glat(lat.begin(), lat.begin() + ctx * kvl), grope(rope.begin(), rope.begin() + ctx * r);
    check("mla_prep latent cache", glat, rlat, 1e-5);
    check("mla_prep rope cache", grope, rrope, 1e-5);
    check("mla_prep rotated queries", q, rq, 1e-5);
    // attention over chunks of t0chunk tokens: qa = absorbed queries (random here)
    std::vector<float> qa((size_t)n * nh * kvl);
    for (auto& v : qa) v = urand();
    std::vector<float> out((size_t)n * nh * kvl, NAN);
    for (int t0 = 0; t0 < n; t0 += t0chunk) {
        int m = std::min(t0chunk, n - t0);
        const float* qap = qa.data() + (size_t)t0 * nh * kvl;
        const float* qp = q.data() + (size_t)t0 * nh * qhd;
        const float* lp = lat.data(); const float* rp = rope.data(); const long* pp = &pos;
        float* op = out.data() + (size_t)t0 * nh * kvl;
        emu_launch({(unsigned)nh, (unsigned)m, 1}, 256, [&] {
            mla_attention(qap, qp, lp, rp, nh, kvl, r, qhd, nope, pp, t0, scale, op);
        });
    }
    std::vector<double> want((size_t)n * nh * kvl, 0.0);
    for (int t = 0; t < n; t++)
        for (int h = 0; h < nh; h++) {
            long cx = start + t + 1;
            std::vector<double> sc(cx);
            double mx = -1e300;
            for (long p = 0; p < cx; p++) {
                double d = 0;
                for (int i = 0; i < kvl; i++) d += (double)qa[((size_t)t * nh + h) * kvl + i] * rlat[p * kvl + i];
                for (int i = 0; i < r; i++) d += rq[((size_t)t * nh + h) * qhd + nope + i] * rrope[p * r + i];
                sc[p] = d * scale;
                mx = std::max(mx, sc[p]);
            }
            double sum = 0;
            for (auto& v : sc) { v = exp(v - mx); sum += v; }
            for (long p = 0; p < cx; p++)
                for (int i = 0; i < kvl; i++) want[((size_t)t * nh + h) * kvl + i] += sc[p] / sum * rlat[p * kvl + i];
        }
    char name[128];
    snprintf(name, sizeof name, "mla_attention nh%d kvl%d r%d n%d start%ld chunk%d", nh, kvl, r, n, start, t0chunk);
    check(name, out, want, 1e-5);
}

// backend/cpu/router.rs NoauxTc::route, with ops::top_k (stable, ties to the lower index)
static std::vector<int> top_k(const std::vector<float>& x, int k) {
    std::vector<int> idx(x.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return x[a] > x[b]; });
    idx.resize(k);
    return idx;
}

static void test_route(int e, int k, int n_group, int topk_group, bool norm, int n, bool ties) {
    std::vector<float> logits((size_t)n * e), bias(e);
    for (auto& v : logits) v = ties ? (float)(rng() % 5) - 2.0f : urand(-3, 3);
    for (auto& v : bias) v = ties ? 0.0f : urand(-0.2f, 0.2f);
    std::vector<unsigned long long> table(e);
    for (int i = 0; i < e; i++) table[i] = 1000 + i;
    std::vector<int> ids((size_t)n * k, -1);
    std::vector<float> wts((size_t)n * k, NAN);
    std::vector<unsigned long long> bases((size_t)n * k, 0);
    float scaling = 2.5f;
    int nrm = norm && k > 1;
    {
        const float* lp = logits.data(); const float* bp = bias.data(); const unsigned long long* tp = table.data();
        int* ip = ids.data(); float* wp = wts.data(); unsigned long long* bsp = bases.data();
        emu_launch({(unsigned)((n + 3) / 4), 1, 1}, 128, [&] {
            moe_route_noaux(lp, bp, n, e, k, n_group, topk_group, nrm, scaling, tp, ip, wp, bsp);
        });
    }
    int bad = 0;
    double wdiff = 0;
    for (int t = 0; t < n; t++) {
        std::vector<float> s(e), b(e);
        for (int i = 0; i < e; i++) {
            s[i] = 1.0f / (1.0f + expf(-logits[(size_t)t * e + i]));
            b[i] = s[i] + bias[i];
        }
        if (n_group > 1) {
            int per = e / n_group;
            std::vector<float> gs(n_group);
            for (int g = 0; g < n_group; g++) {
                std::vector<float> grp(b.begin() + g * per, b.begin() + (g + 1) * per);
                auto top = top_k(grp, 2);
                gs[g] = grp[top[0]] + grp[top[1]];
            }
            auto keep = top_k(gs, topk_group);
            for (int g = 0; g < n_group; g++)
                if (std::find(keep.begin(), keep.end(), g) == keep.end())
                    for (int i = g * per; i < (g + 1) * per; i++) b[i] = 0.0f;
        }
        auto ex = top_k(b, k);
        std::vector<float> w(k);
        for (int j = 0; j < k; j++) w[j] = s[ex[j]];
        if (k > 1 && norm) {
            float sum = 0;
            for (float x : w) sum += x;
            for (float& x : w) x /= sum;
        }
        for (int j = 0; j < k; j++) {
            w[j] *= scaling;
            if (ids[(size_t)t * k + j] != ex[j] || bases[(size_t)t * k + j] != 1000ull + ex[j]) bad++;
            wdiff = std::max(wdiff, (double)std::fabs(wts[(size_t)t * k + j] - w[j]));
        }
    }
    bool ok = bad == 0 && wdiff <= 1e-6;
    if (!ok) fails++;
    printf("moe_route_noaux e%d k%d g%d/%d norm%d ties%d: %d wrong ids, max|w diff| %.2e %s\n", e, k, n_group,
           topk_group, (int)norm, (int)ties, bad, wdiff, ok ? "ok" : "FAIL");
}

// backend/cpu/moe.rs Routing::from_logits: softmax, the k largest (stable), renormalised when `norm`.
static void test_route_softmax(int e, int k, bool norm, int n, bool ties) {
    std::vector<float> logits((size_t)n * e);
    for (auto& v : logits) v = ties ? (float)(rng() % 5) - 2.0f : urand(-4, 4);
    std::vector<unsigned long long> table(e);
    for (int i = 0; i < e; i++) table[i] = 1000 + i;
    std::vector<int> ids((size_t)n * k, -1);
    std::vector<float> wts((size_t)n * k, NAN);
    std::vector<unsigned long long> bases((size_t)n * k, 0);
    int per = e <= 128 ? 4 : e <= 256 ? 8 : e <= 512 ? 16 : 32;  // as moe.rs picks the variant
    {
        const float* lp = logits.data(); const unsigned long long* tp = table.data();
        int* ip = ids.data(); float* wp = wts.data(); unsigned long long* bsp = bases.data();
        int nrm = norm;
        emu_launch({(unsigned)((n + 3) / 4), 1, 1}, 128, [&] {
            switch (per) {
                case 4: moe_route_c4(lp, n, e, k, nrm, tp, ip, wp, bsp); break;
                case 8: moe_route_c8(lp, n, e, k, nrm, tp, ip, wp, bsp); break;
                case 16: moe_route_c16(lp, n, e, k, nrm, tp, ip, wp, bsp); break;
                default: moe_route_c32(lp, n, e, k, nrm, tp, ip, wp, bsp);
            }
        });
    }
    int bad = 0;
    double wdiff = 0;
    for (int t = 0; t < n; t++) {
        std::vector<float> p(logits.begin() + (size_t)t * e, logits.begin() + (size_t)(t + 1) * e);
        double mx = *std::max_element(p.begin(), p.end()), sum = 0;
        for (float v : p) sum += exp(v - mx);
        for (float& v : p) v = (float)(exp(v - mx) / sum);
        auto ex = top_k(p, k);
        double chosen = 0;
        for (int j = 0; j < k; j++) chosen += p[ex[j]];
        for (int j = 0; j < k; j++) {
            double w = norm ? p[ex[j]] / chosen : p[ex[j]];
            if (ids[(size_t)t * k + j] != ex[j] || bases[(size_t)t * k + j] != 1000ull + ex[j]) bad++;
            wdiff = std::max(wdiff, std::fabs(wts[(size_t)t * k + j] - w));
        }
    }
    bool ok = bad == 0 && wdiff <= 1e-6;
    if (!ok) fails++;
    printf("moe_route_c%d e%d k%d norm%d ties%d: %d wrong ids, max|w diff| %.2e %s\n", per, e, k, (int)norm,
           (int)ties, bad, wdiff, ok ? "ok" : "FAIL");
}

// moe_group: the choice of n_slots slots grouped by expert: a task per expert (its address,
// its run's start = the counts' prefix sum, its count) and runs that hold exactly its slots;
// with `shard`, every third expert another GPU's (not in the ownership mask: no run, its slots
// left out).
static void test_group(int e, int n_slots, bool skew, bool shard = false) {
    std::vector<int> ids(n_slots);
    // Skewed: most slots on a few experts, many experts never chosen.
    for (auto& v : ids) v = skew ? (int)(rng() % 7 == 0 ? rng() % e : rng() % 5) : (int)(rng() % e);
    std::vector<unsigned long long> table(e);
    std::vector<unsigned char> own(e);
    for (int i = 0; i < e; i++) table[i] = 1000 + 17ull * i, own[i] = i % 3 != 1;
    std::vector<ExpertTask> tasks(e, ExpertTask{nullptr, -1, -1});
    std::vector<int> slots(n_slots, -1);
    {
        const int* ip = ids.data(); const unsigned long long* tp = table.data();
        ExpertTask* out = tasks.data(); int* sp = slots.data();
        const unsigned char* op = shard ? own.data() : nullptr;
        emu_launch({1, 1, 1}, 1024, [&] { moe_group(ip, n_slots, e, tp, op, out, sp); });
    }
    int bad = 0, first = 0, owned = 0;
    for (int x = 0; x < e; x++) {
        std::vector<int> want, got;
        for (int j = 0; j < n_slots; j++)
            if (ids[j] == x && (!shard || own[x])) want.push_back(j);
        owned += want.size();
        const ExpertTask& t = tasks[x];
        if ((unsigned long long)t.base != table[x] || t.first != first || t.count != (int)want.size()) {
            bad++;
            continue;
        }
        got.assign(slots.begin() + first, slots.begin() + first + t.count);
        std::sort(got.begin(), got.end());
        bad += got != want;
        first += t.count;
    }
    bool ok = bad == 0 && first == owned && (shard ? owned < n_slots : owned == n_slots);
    if (!ok) fails++;
    printf("moe_group e%d slots%d skew%d shard%d: %d experts wrong %s\n", e, n_slots, (int)skew, (int)shard, bad,
           ok ? "ok" : "FAIL");
}

int main() {
    test_heads(4, 64, 64, 96, 1);     // fixture embed_q, one token
    test_heads(4, 64, 64, 96, 7);     // fixture embed_q, batch
    test_heads(4, 64, 64, 64, 5);     // fixture unembed_out (x_head = kvl)
    test_heads(3, 512, 128, 192, 1);  // DeepSeek-V3 embed_q widths, 3 heads
    test_heads(3, 128, 512, 512, 6);  // DeepSeek-V3 unembed_out widths
    test_heads(2, 128, 512, 512, 1);
    test_qmv_heads(3, 512, 128, 192);  // DeepSeek-V3 embed_q: 64 rows per warp
    test_qmv_heads(3, 128, 512, 512);  // DeepSeek-V3 unembed_out: 16 rows per warp
    test_qmv_heads(2, 128, 64, 96);    // the small synthetic model's embed_q
    test_qmv_heads(5, 16, 2048, 2048); // long rows: 2 slices, 2 warps per row group
    test_qmv_heads(5, 64, 128, 128);   // a partial last block (rows past the end)
    test_mla(4, 64, 32, 64, 7, 0, 64);
    test_mla(4, 64, 32, 64, 1, 9, 1);
    test_mla(3, 512, 64, 128, 5, 11, 2);   // chunks of 2
    test_mla(2, 512, 64, 128, 1, 20, 1);
    test_mla(2, 128, 32, 64, 9, 3, 4);
    test_route(16, 4, 4, 2, true, 9, false);
    test_route(16, 4, 4, 2, true, 9, true);
    test_route(16, 4, 1, 1, false, 5, false);  // kimi: one group
    test_route(8, 2, 2, 1, true, 6, false);
    test_route(256, 8, 8, 4, true, 6, false);  // DeepSeek-V3
    test_route(256, 8, 8, 4, true, 6, true);
    test_route(384, 8, 1, 1, true, 5, false);  // Kimi-K2
    test_route(64, 6, 8, 3, true, 5, false);
    test_route(64, 1, 8, 3, true, 5, false);   // k = 1: no renormalisation
    test_group(128, 17 * 8, false);     // the synthetic test model, a short prompt
    test_group(256, 512 * 8, false);    // A3B at 512 tokens
    test_group(256, 4096 * 8, true);    // A3B at 4096 tokens, skewed
    test_group(1024, 3000, false);      // the most experts, slots not a multiple of the block
    test_group(384, 100 * 8, true);     // Kimi-K2's expert count
    test_group(256, 512 * 8, false, true);  // a GPU of a group: others' experts left out
    test_group(128, 40 * 8, true, true);
    for (bool nc2 : {false, true}) {
        test_qmv_group(72, 40, 2048, nc2);  // rows of 1024 bytes: two warps per row
        test_qmv_group(40, 24, 4096, nc2);  // 2048 bytes: four warps per row
        test_qmv_group(96, 64, 512, nc2);   // 256 bytes: two rows per chunk
        // Fewer blocks than sets: each block streams several, across the two matrices
        test_qmv_group(72, 40, 2048, nc2, false, false, 3);
        test_qmv_group(200, 64, 512, nc2, false, false, 1);
        test_qmv_group(24, 16, 7168, nc2, false, false, 2);   // 7 slices: the set-by-set path
        test_qmv_group(16, 8, 16384, nc2, false, false, 2);   // 16 slices: likewise
        // SwiGLU applied while loading: the down products of Qwen's shared experts and dense MLPs
        test_qmv_group(64, 32, 2048, nc2, true);  // rows of 1024 bytes
        test_qmv_group(48, 40, 512, nc2, true);   // 256 bytes: two rows per chunk
        test_qmv_group(40, 24, 4096, nc2, true);  // 2048 bytes
        test_qmv_group(64, 32, 2048, nc2, true, false, 2);
        // An 8-bit router with the 4-bit shared expert's gate (qmv_b48: the width per block)
        test_qmv_group(256, 64, 2048, nc2, false, true);  // 8-bit rows of 2048 bytes, 4-bit of 1024
        test_qmv_group(40, 48, 512, nc2, false, true);    // 512 and 256 bytes
        test_qmv_group(24, 40, 256, nc2, false, true);    // 256 and 128 bytes: rows per chunk differ
    }
    // 8-bit activations (`--gpu-activations q8`)
    for (bool nc2 : {false, true}) {
        test_qmv_q8_group(72, 40, 2048, nc2);
        test_qmv_q8_group(96, 64, 512, nc2);                      // two rows per chunk
        test_qmv_q8_group(200, 64, 512, nc2, false, false, 1);    // one block streams every set
        test_qmv_q8_group(24, 16, 7168, nc2, false, false, 2);    // 7 slices: the set-by-set path
        test_qmv_q8_group(64, 32, 2048, nc2, true);               // SwiGLU input
        test_qmv_q8_group(48, 40, 512, nc2, true);
        test_qmv_q8_group(256, 64, 2048, nc2, false, true);       // 8-bit router + 4-bit gate
        test_qmv_q8_group(24, 40, 256, nc2, false, true);
    }
    test_qdot(72, 40, 2048, false, 100);   // a block per set
    test_qdot(72, 40, 2048, false, 3);     // three blocks looping over the sets
    test_qdot(100, 20, 4096, false, 2);    // partial sets at both matrices' ends
    test_qdot(40, 24, 512, false, 4);
    test_qdot(64, 32, 2048, true, 3);      // SwiGLU input
    test_qdot(48, 40, 1024, false, 3, 3);  // a few tokens: one partial token group
    test_qdot(40, 24, 2048, false, 2, 6);  // two token groups
    // One row a warp (matrices of few rows)
    test_qdot(72, 40, 2048, false, 3, 1, 1);
    test_qdot(64, 32, 2048, true, 5, 1, 1);
    test_qdot(40, 24, 2048, false, 2, 6, 1);
    // 16 lanes a row (products of many rows): partial sets, a grid looping, few tokens, SwiGLU
    test_qdot(72, 40, 2048, false, 3, 1, 2);
    test_qdot(100, 20, 4096, false, 2, 1, 2);
    test_qdot(64, 32, 1024, true, 2, 1, 2);
    test_qdot(40, 24, 2048, false, 2, 6, 2);
    // 8 lanes a row (inputs under 1024 columns)
    test_qdot(72, 40, 512, false, 1, 1, 3);
    test_qdot(100, 36, 256, false, 2, 1, 3);
    test_qdot(64, 32, 512, true, 1, 1, 3);
    test_qdot(40, 24, 768, false, 2, 5, 3);
    test_qmv_q8_tokens(72, 40, 2048, 3);
    test_qmv_q8_tokens(96, 64, 512, 8);
    test_qmv_q8_tokens(40, 24, 4096, 13, 3);
    test_argmax(1000, 256, 1);
    test_argmax(248320, 256, 61);  // Qwen3.5/3.6's vocabulary, as the engine splits it
    test_argmax(248320, 1024, 1);  // one block a row
    test_argmax(5000, 256, 2);     // parts that split the repeated maximum of row 1
    test_argmax(40, 64, 1);        // fewer values than threads
    test_argmax(40, 32, 7);        // parts of fewer values than threads
    // A few tokens at once (decode batches)
    test_qmv_tokens(72, 40, 2048, 4, 3);      // rows of 1024 bytes, one partial token group
    test_qmv_tokens(96, 64, 512, 4, 8);       // 256 bytes: two rows per chunk, two full groups
    test_qmv_tokens(40, 24, 4096, 4, 13, 3);  // 2048 bytes, fewer blocks than sets
    test_qmv_tokens(64, 40, 2048, 8, 5);      // 8-bit rows of 2048 bytes
    test_qmv_tokens(48, 16, 512, 8, 2, 1);    // 8-bit, one block streaming every set
    test_route_softmax(256, 8, true, 6, false);    // Qwen3.5/3.6 MoE
    test_route_softmax(256, 8, true, 6, true);
    test_route_softmax(512, 10, true, 5, false);   // Qwen3.5-397B
    test_route_softmax(128, 8, false, 5, false);   // Qwen3-30B-A3B style, no renormalisation
    test_route_softmax(32, 4, true, 9, true);      // the test fixtures
    test_route_softmax(384, 8, true, 3, false);
    test_route_softmax(1024, 8, true, 3, false);
    test_route_softmax(200, 1, false, 3, false);
    printf(fails ? "%d FAILED\n" : "all ok\n", fails);
    return fails != 0;
}
