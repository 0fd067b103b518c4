// Checks of the Qwen3.5 / Qwen3-Next decode kernels under cuda_emu.h (see run.sh), each on
// random inputs against a naive double-precision reference of the CPU model:
//   conv_qk_norm  backend/cpu/deltanet.rs conv_silu, then the q/k RMS norms with their 1/dk and
//                 1/sqrt(dk) scales; mixed and the updated conv state; the batch kernels
//                 (conv_qk_norm_batch + conv_state_update) equal to it bit for bit.
//   delta_rule    backend/cpu/deltanet.rs recurrence (backend/cpu/vec.rs delta_rule_step), then
//   gated_norm    the gated RMSNorm; y, out and the state over two launches in a row.
//   moe_combine   the routed experts' weighted sum plus the (gated or plain) shared expert
//                 added to the residual.
//                 In a group: only this GPU's experts, from zero.
//   moe_combine_norm  moe_combine then rms_norm in one launch: both outputs equal to the two
//                 kernels' bit for bit, the norm against the reference.
//   attn_prep     backend/cpu/attention.rs: q/k/v biases, q/k RMS norms (each optional),
//                 half-split rope (partial or full), the gate copied when gated, k and v
//                 appended to the caches at rows pos..pos+n, the other cache rows untouched.
#include "cuda_emu.h"
#include KERNELS_SOURCE  // the kernel parts of all.cuh, made by run.sh
#include "emu_check.h"

static double sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }
static double silu_d(double x) { return x * sigmoid_d(x); }
static double softplus_d(double x) { return std::max(x, 0.0) + log1p(exp(-std::fabs(x))); }

// Channels [c0, c1) of every token of a [n, cd] buffer.
template <class T> static std::vector<T> cols_of(const std::vector<T>& m, int n, int cd, int c0, int c1) {
    std::vector<T> r;
    for (int t = 0; t < n; t++) r.insert(r.end(), m.begin() + (size_t)t * cd + c0, m.begin() + (size_t)t * cd + c1);
    return r;
}

// ---------------------------------------------------------------------------------------
// conv_qk_norm

static void test_conv_qk_norm(int nk, int nv, int dk, int dv, int kk, int n) {
    int kd = nk * dk, cd = 2 * kd + nv * dv, hist = kk - 1;
    std::vector<float> mixed((size_t)n * cd), w((size_t)cd * kk), state((size_t)hist * cd);
    for (auto& v : mixed) v = urand(-2, 2);
    for (auto& v : w) v = urand(-0.6f, 0.6f);
    for (auto& v : state) v = urand(-2, 2);
    std::vector<float> m0 = mixed, s0 = state;
    // The batch kernels (parallel over token tiles, not in place) on copies.
    std::vector<float> bmixed(mixed.size(), NAN), bstate = state;
    {
        float* mp = mixed.data(); const float* wp = w.data(); float* sp = state.data();
        emu_launch({(unsigned)(2 * nk + nv), 1, 1}, (unsigned)std::max(dk, dv),
                   [&] { conv_qk_norm(mp, wp, sp, nk, dk, nv, dv, kk, n, nullptr); });
        const float* rp = m0.data(); float *bp = bmixed.data(), *bsp = bstate.data();
        emu_launch({(unsigned)(2 * nk + nv), (unsigned)((n + CONV_TILE - 1) / CONV_TILE), 1},
                   (unsigned)std::max(dk, dv), [&] { conv_qk_norm_batch(rp, bp, wp, bsp, nk, dk, nv, dv, kk, n); });
        emu_launch({(unsigned)((cd + 255) / 256), 1, 1}, 256, [&] { conv_state_update(rp, bsp, cd, kk, n); });
    }
    std::vector<double> rm((size_t)n * cd), rs(s0.begin(), s0.end());
    for (int t = 0; t < n; t++)
        for (int ch = 0; ch < cd; ch++) {
            double x = m0[(size_t)t * cd + ch], acc = 0;
            for (int j = 0; j < hist; j++) acc += (double)w[(size_t)ch * kk + j] * rs[(size_t)j * cd + ch];
            acc += (double)w[(size_t)ch * kk + hist] * x;
            for (int j = 0; j + 1 < hist; j++) rs[(size_t)j * cd + ch] = rs[(size_t)(j + 1) * cd + ch];
            if (hist > 0) rs[(size_t)(hist - 1) * cd + ch] = x;
            rm[(size_t)t * cd + ch] = silu_d(acc);
        }
    for (int t = 0; t < n; t++)
        for (int h = 0; h < 2 * nk; h++) {
            double* p = &rm[(size_t)t * cd + (size_t)h * dk];
            double ss = 0;
            for (int i = 0; i < dk; i++) ss += p[i] * p[i];
            double f = 1.0 / sqrt(ss / dk + 1e-6 / dk) * (h < nk ? 1.0 / dk : 1.0 / sqrt((double)dk));
            for (int i = 0; i < dk; i++) p[i] *= f;
        }
    char name[128];
    const char* part[3] = {"q", "k", "v"};
    int lim[4] = {0, kd, 2 * kd, cd};
    for (int p = 0; p < 3; p++) {
        snprintf(name, sizeof name, "conv_qk_norm nk%d nv%d dk%d dv%d k%d n%d %s", nk, nv, dk, dv, kk, n, part[p]);
        check(name, cols_of(mixed, n, cd, lim[p], lim[p + 1]), cols_of(rm, n, cd, lim[p], lim[p + 1]), 1e-5);
    }
    snprintf(name, sizeof name, "conv_qk_norm nk%d nv%d dk%d dv%d k%d n%d state", nk, nv, dk, dv, kk, n);
    check(name, state, rs, 0.0);  // raw inputs: exact
    // The batch kernels do the same sums in the same order: equal bit for bit.
    snprintf(name, sizeof name, "conv_qk_norm_batch n%d = conv_qk_norm", n);
    check(name, bmixed, std::vector<double>(mixed.begin(), mixed.end()), 0.0);
    snprintf(name, sizeof name, "conv_state_update n%d state", n);
    check(name, bstate, rs, 0.0);
}

// ---------------------------------------------------------------------------------------
// delta_rule, then gated_norm

static void test_delta_rule(int nk, int nv, int dk, int dv, int n, int calls) {
    int kd = nk * dk, cd = 2 * kd + nv * dv, vd = nv * dv, r = nv / nk;
    float eps = 1e-6f;
    std::vector<float> state((size_t)nv * dv * dk), a_log(nv), dt_bias(nv), norm_w(dv);
    for (auto& v : state) v = urand(-0.5f, 0.5f);
    for (auto& v : a_log) v = urand(-1, 1);
    for (auto& v : dt_bias) v = urand(-1, 1);
    for (auto& v : norm_w) v = urand(0.5f, 1.5f);
    std::vector<double> rstate(state.begin(), state.end());
    for (int call = 0; call < calls; call++) {
        // Inputs as conv_qk_norm leaves them: |q| = 1/sqrt(dk), |k| = 1 per key head.
        std::vector<float> mixed((size_t)n * cd), a((size_t)n * nv), b((size_t)n * nv), z((size_t)n * vd);
        for (int t = 0; t < n; t++)
            for (int h = 0; h < 2 * nk; h++) {
                float* p = &mixed[(size_t)t * cd + (size_t)h * dk];
                double ss = 0;
                for (int i = 0; i < dk; i++) { p[i] = urand(); ss += (double)p[i] * p[i]; }
                double f = (h < nk ? 1.0 / sqrt((double)dk) : 1.0) / sqrt(ss);
                for (int i = 0; i < dk; i++) p[i] = (float)(p[i] * f);
            }
        for (int t = 0; t < n; t++)
            for (int i = 2 * kd; i < cd; i++) mixed[(size_t)t * cd + i] = urand();
        for (auto& v : a) v = urand(-3, 3);
        for (auto& v : b) v = urand(-3, 3);
        for (auto& v : z) v = urand(-3, 3);
        std::vector<float> y((size_t)n * vd, NAN), out((size_t)n * vd, NAN);
        {
            const float *mp = mixed.data(), *ap = a.data(), *bp = b.data(), *alp = a_log.data(),
                        *dtp = dt_bias.data(), *zp = z.data(), *nwp = norm_w.data();
            float *sp = state.data(), *yp = y.data(), *op = out.data();
            emu_launch({(unsigned)nv, (unsigned)((dv + 31) / 32), 1}, 256,
                       [&] { delta_rule(mp, ap, bp, alp, dtp, sp, n, nk, nv, dk, dv, yp, nullptr); });
            emu_launch({(unsigned)nv, (unsigned)n, 1}, dv, [&] { gated_norm(yp, zp, nwp, eps, dv, op); });
        }
        std::vector<double> ry((size_t)n * vd), rout((size_t)n * vd);
        for (int h = 0; h < nv; h++) {
            int kh = h / r;
            double decay = exp((double)a_log[h]);
            for (int t = 0; t < n; t++) {
                const float* m = &mixed[(size_t)t * cd];
                const float *q = m + (size_t)kh * dk, *k = m + kd + (size_t)kh * dk, *v = m + 2 * kd + (size_t)h * dv;
                double g = exp(-decay * softplus_d((double)a[(size_t)t * nv + h] + dt_bias[h]));
                double beta = sigmoid_d(b[(size_t)t * nv + h]);
                for (int row = 0; row < dv; row++) {
                    double* s = &rstate[((size_t)h * dv + row) * dk];
                    double kdot = 0, o = 0;
                    for (int c = 0; c < dk; c++) kdot += s[c] * k[c];
                    double d = (v[row] - g * kdot) * beta;
                    for (int c = 0; c < dk; c++) {
                        s[c] = g * s[c] + d * k[c];
                        o += s[c] * q[c];
                    }
                    ry[((size_t)t * nv + h) * dv + row] = o;
                }
            }
        }
        for (int t = 0; t < n; t++)
            for (int h = 0; h < nv; h++) {
                size_t base = ((size_t)t * nv + h) * dv;
                double ss = 0;
                for (int i = 0; i < dv; i++) ss += ry[base + i] * ry[base + i];
                double inv = 1.0 / sqrt(ss / dv + eps);
                for (int i = 0; i < dv; i++) rout[base + i] = ry[base + i] * inv * norm_w[i] * silu_d(z[base + i]);
            }
        char name[128];
        snprintf(name, sizeof name, "delta_rule nk%d nv%d dk%d dv%d n%d call%d y", nk, nv, dk, dv, n, call + 1);
        check(name, y, ry, 1e-5);
        snprintf(name, sizeof name, "delta_rule nk%d nv%d dk%d dv%d n%d call%d out", nk, nv, dk, dv, n, call + 1);
        check(name, out, rout, 1e-5);
        snprintf(name, sizeof name, "delta_rule nk%d nv%d dk%d dv%d n%d call%d state", nk, nv, dk, dv, n, call + 1);
        check(name, state, rstate, 1e-5);
    }
}

// ---------------------------------------------------------------------------------------
// moe_combine

enum Shared { NONE, GATED, PLAIN };

// The inputs of a MoE layer's combine: slot rows, weights, experts
// (of `experts`), the shared expert and its gate, a base.
struct CombineCase {
    int h, k, n, experts;
    std::vector<float> slot_out, wts, shared, sg, base;
    std::vector<int> ids;
    std::vector<unsigned char> own;
    CombineCase(int h_, int k_, int n_, int experts_) : h(h_), k(k_), n(n_), experts(experts_) {
        slot_out.resize((size_t)n * k * h), wts.resize((size_t)n * k), ids.resize((size_t)n * k);
        shared.resize((size_t)n * h), sg.resize(n), base.resize((size_t)n * h), own.resize(experts);
        for (auto& v : slot_out) v = urand();
        for (auto& v : wts) v = urand(0, 1);
        for (auto& v : ids) v = (int)(rng() % experts);
        for (auto& v : shared) v = urand();
        for (auto& v : sg) v = urand(-3, 3);
        for (auto& v : base) v = urand(-2, 2);
        for (auto& v : own) v = rng() % 2;
    }
    // `grouped`: only the experts of `own`; with or without the base.
    MoeCombine args(Shared sh, bool grouped, bool with_base) const {
        MoeCombine C{};
        C.slot_out = slot_out.data(), C.wts = wts.data(), C.ids = ids.data();
        C.own = grouped ? own.data() : nullptr;
        C.shared = sh == NONE ? nullptr : shared.data();
        C.sg = sh == GATED ? sg.data() : nullptr;
        C.base = with_base ? base.data() : nullptr;
        C.k = k, C.h = h;
        return C;
    }
};

static void test_moe_combine(int h, int k, int n, Shared sh, bool grouped) {
    CombineCase cc(h, k, n, 16);
    std::vector<float> out = cc.base;
    {
        // Without a group: in place on the base, as on the residual stream.
        MoeCombine C = cc.args(sh, grouped, !grouped);
        if (!grouped) C.base = out.data();
        float* op = out.data();
        emu_launch({(unsigned)n, (unsigned)((h + 255) / 256), 1}, 256, [&] { moe_combine(C, op); });
    }
    std::vector<double> rout((size_t)n * h);
    for (int t = 0; t < n; t++) {
        double gate = sh == NONE ? 0.0 : sh == GATED ? sigmoid_d(cc.sg[t]) : 1.0;
        for (int i = 0; i < h; i++) {
            double acc = grouped ? 0.0 : cc.base[(size_t)t * h + i];
            for (int j = 0; j < k; j++) {
                if (grouped && !cc.own[cc.ids[(size_t)t * k + j]]) continue;
                acc += (double)cc.wts[(size_t)t * k + j] * cc.slot_out[((size_t)t * k + j) * h + i];
            }
            acc += gate * cc.shared[(size_t)t * h + i];
            rout[(size_t)t * h + i] = acc;
        }
    }
    const char* shn[3] = {"no shared", "gated shared", "plain shared"};
    char name[128];
    snprintf(name, sizeof name, "moe_combine h%d k%d n%d %s%s", h, k, n, shn[sh], grouped ? " grouped" : "");
    check(name, out, rout, 1e-5);
}

// moe_combine_norm: moe_combine then rms_norm in one launch, equal to the two bit for bit (out
// and xn), and xn against the double reference of the norm.
static void test_moe_combine_norm(int h, int k, int n, Shared sh) {
    CombineCase cc(h, k, n, 16);
    std::vector<float> w(h);
    for (auto& v : w) v = urand(0.5f, 1.5f);
    const float eps = 1e-6f;
    std::vector<float> out2 = cc.base, xn2((size_t)n * h), out1 = cc.base, xn1((size_t)n * h, NAN);
    {
        MoeCombine C = cc.args(sh, false, true);
        C.base = out2.data();
        float *op = out2.data(), *xp = xn2.data();
        const float* wp = w.data();
        emu_launch({(unsigned)n, (unsigned)((h + 255) / 256), 1}, 256, [&] { moe_combine(C, op); });
        emu_launch({(unsigned)n, 1, 1}, 1024, [&] { rms_norm(op, wp, h, eps, xp); });
    }
    {
        MoeCombine C = cc.args(sh, false, true);
        C.base = out1.data();
        float *op = out1.data(), *xp = xn1.data();
        const float* wp = w.data();
        emu_launch({(unsigned)n, 1, 1}, 1024, [&] { moe_combine_norm(C, op, wp, eps, xp); });
    }
    std::vector<double> rxn((size_t)n * h);
    for (int t = 0; t < n; t++) {
        double ss = 0;
        for (int i = 0; i < h; i++) ss += (double)out2[(size_t)t * h + i] * out2[(size_t)t * h + i];
        double inv = 1.0 / sqrt(ss / h + eps);
        for (int i = 0; i < h; i++) rxn[(size_t)t * h + i] = out2[(size_t)t * h + i] * inv * w[i];
    }
    const char* shn[3] = {"no shared", "gated shared", "plain shared"};
    char name[128];
    snprintf(name, sizeof name, "moe_combine_norm h%d k%d n%d %s out", h, k, n, shn[sh]);
    check(name, out1, std::vector<double>(out2.begin(), out2.end()), 0.0);
    snprintf(name, sizeof name, "moe_combine_norm h%d k%d n%d %s xn", h, k, n, shn[sh]);
    check(name, xn1, std::vector<double>(xn2.begin(), xn2.end()), 0.0);
    snprintf(name, sizeof name, "rms_norm h%d n%d vs reference", h, n);
    check(name, xn2, rxn, 1e-5);
}

// ---------------------------------------------------------------------------------------
// add_rows

static void test_add_rows(int n, int cols) {
    std::vector<float> x((size_t)n * cols), b(cols);
    for (auto& v : x) v = urand(-2, 2);
    for (auto& v : b) v = urand(-1, 1);
    std::vector<double> want(x.size());
    for (int t = 0; t < n; t++)
        for (int i = 0; i < cols; i++) want[(size_t)t * cols + i] = (double)x[(size_t)t * cols + i] + b[i];
    {
        float* px = x.data();
        const float* pb = b.data();
        emu_launch({(unsigned)n, (unsigned)((cols + 255) / 256), 1}, 256, [&] { add_rows(px, pb, cols); });
    }
    char name[64];
    snprintf(name, sizeof name, "add_rows n%d cols%d", n, cols);
    check(name, x, want, 1e-7);
}

// ---------------------------------------------------------------------------------------
// attn_prep

// The flavour of a grouped-query attention layer: Qwen3.5's gated q_proj
// with q/k norms, Qwen3-MoE's plain one with norms, GLM's with q/k/v biases
// with or without norms.
struct AttnFlavour {
    bool gated, norms, bias;
    float mscale = 1.0f;  // YaRN's (gpt-oss: 1.3466)
};

// With `ring` > 0 (a power of two) the caches are a sliding-window layer's ring of that many
// rows: position p goes to row p & (ring - 1).
static void test_attn_prep(int nh, int nkv, int hd, int half_rot, int n, long start, double theta, double ps,
                           AttnFlavour f, long ring = 0) {
    float eps = 1e-6f;
    int qs = f.gated ? 2 * hd : hd;  // q_proj floats per head
    std::vector<float> qg((size_t)n * nh * qs), k((size_t)n * nkv * hd), v((size_t)n * nkv * hd), q_norm(hd),
        k_norm(hd), qb((size_t)nh * qs), kb((size_t)nkv * hd), vb((size_t)nkv * hd);
    for (auto& x : qg) x = urand(-2, 2);
    for (auto& x : k) x = urand(-2, 2);
    for (auto& x : v) x = urand(-2, 2);
    for (auto& x : q_norm) x = urand(0.5f, 1.5f);
    for (auto& x : k_norm) x = urand(0.5f, 1.5f);
    for (auto* b : {&qb, &kb, &vb})
        for (auto& x : *b) x = urand(-1, 1);
    std::vector<double> inv(half_rot);  // model Rope::new over 2 * half_rot channels
    for (int i = 0; i < half_rot; i++) inv[i] = pow(theta, -2.0 * i / (2.0 * half_rot));
    long row = (long)nkv * hd, rows = ring ? ring : start + n + 3, mask = ring ? ring - 1 : -1;
    std::vector<float> kc((size_t)(rows * row)), vc((size_t)(rows * row));
    for (auto& x : kc) x = urand();
    for (auto& x : vc) x = urand();
    std::vector<float> kc0 = kc, vc0 = vc;
    std::vector<float> q_out((size_t)n * nh * hd, NAN), gate_out(f.gated ? (size_t)n * nh * hd : 0, NAN);
    long pos = start;
    {
        const float *qp = qg.data(), *kp = k.data(), *vp = v.data();
        AttnParts P{f.bias ? qb.data() : nullptr, f.bias ? kb.data() : nullptr, f.bias ? vb.data() : nullptr,
                    f.norms ? q_norm.data() : nullptr, f.norms ? k_norm.data() : nullptr, f.gated, f.mscale};
        const double* ip = inv.data();
        const long* pp = &pos;
        float *qo = q_out.data(), *go = f.gated ? gate_out.data() : nullptr, *kcp = kc.data(), *vcp = vc.data();
        emu_launch({(unsigned)(nh + nkv), (unsigned)n, 1}, (unsigned)hd, [&] {
            attn_prep(qp, kp, vp, P, ip, half_rot, nh, nkv, hd, eps, pp, ps, qo, go, kcp, vcp, nullptr, mask,
                      nullptr);
        });
    }
    // (src + bias), rms_norm with w (when norms), then Rope::apply at position p * ps.
    auto norm_rope = [&](const float* src, const float* bias, const std::vector<float>& w, long p, double* dst) {
        for (int i = 0; i < hd; i++) dst[i] = (double)src[i] + (f.bias ? bias[i] : 0.0);
        if (f.norms) {
            double ss = 0;
            for (int i = 0; i < hd; i++) ss += dst[i] * dst[i];
            double r = 1.0 / sqrt(ss / hd + eps);
            for (int i = 0; i < hd; i++) dst[i] *= r * w[i];
        }
        for (int i = 0; i < half_rot; i++) {
            double ang = p * ps * inv[i], c = cos(ang), s = sin(ang), a = dst[i] * f.mscale,
                   b = dst[i + half_rot] * f.mscale;
            dst[i] = a * c - b * s;
            dst[i + half_rot] = a * s + b * c;
        }
    };
    std::vector<double> rq((size_t)n * nh * hd), rgate(gate_out.size()), rk((size_t)n * row), rv((size_t)n * row);
    for (int t = 0; t < n; t++) {
        for (int h = 0; h < nh; h++) {
            const float* src = &qg[((size_t)t * nh + h) * qs];
            const float* bias = &qb[(size_t)h * qs];
            norm_rope(src, bias, q_norm, start + t, &rq[((size_t)t * nh + h) * hd]);
            if (f.gated)
                for (int i = 0; i < hd; i++)
                    rgate[((size_t)t * nh + h) * hd + i] = (double)src[hd + i] + (f.bias ? bias[hd + i] : 0.0);
        }
        for (int g = 0; g < nkv; g++) {
            norm_rope(&k[((size_t)t * nkv + g) * hd], &kb[(size_t)g * hd], k_norm, start + t,
                      &rk[(size_t)t * row + (size_t)g * hd]);
            for (int i = 0; i < hd; i++)
                rv[(size_t)t * row + (size_t)g * hd + i] =
                    (double)v[((size_t)t * nkv + g) * hd + i] + (f.bias ? vb[(size_t)g * hd + i] : 0.0);
        }
    }
    std::vector<float> gk, gv;
    std::vector<bool> written(rows, false);
    for (long p = start; p < start + n; p++) {
        long r = p & mask;
        written[r] = true;
        gk.insert(gk.end(), kc.begin() + r * row, kc.begin() + (r + 1) * row);
        gv.insert(gv.end(), vc.begin() + r * row, vc.begin() + (r + 1) * row);
    }
    char name[160], tag[96];
    snprintf(tag, sizeof tag, "nh%d nkv%d hd%d rot%d n%d pos%ld%s%s%s ring%ld", nh, nkv, hd, 2 * half_rot, n, start,
             f.gated ? " gated" : "", f.norms ? " norms" : "", f.bias ? " bias" : "", ring);
    snprintf(name, sizeof name, "attn_prep %s q", tag);
    check(name, q_out, rq, 1e-5);
    if (f.gated) {
        snprintf(name, sizeof name, "attn_prep %s gate", tag);
        check(name, gate_out, rgate, f.bias ? 1e-6 : 0.0);
    }
    snprintf(name, sizeof name, "attn_prep %s kc rows", tag);
    check(name, gk, rk, 1e-5);
    snprintf(name, sizeof name, "attn_prep %s vc rows", tag);
    check(name, gv, rv, f.bias ? 1e-6 : 0.0);
    long changed = 0;
    for (long p = 0; p < rows; p++) {
        if (written[p]) continue;
        changed += memcmp(&kc[p * row], &kc0[p * row], 4 * row) != 0;
        changed += memcmp(&vc[p * row], &vc0[p * row], 4 * row) != 0;
    }
    if (changed) fails++;
    printf("%-48s %ld changed %s\n", "  other cache rows", changed, changed ? "FAIL" : "ok");
}

// ---------------------------------------------------------------------------------------
// Decode batches: one launch over `b` sequences' one tokens, each row's states (conv and
// recurrent, or K/V caches) and position from the sequence table, equal bit for bit to each
// sequence's token run alone (conv_qk_norm, delta_rule, attn_prep, attention).

static void eq_bits(const char* what, const std::vector<float>& got, const std::vector<float>& alone) {
    check(what, got, std::vector<double>(alone.begin(), alone.end()), 0.0);
}

static void test_deltanet_batch(int nk, int nv, int dk, int dv, int kk, int b) {
    int kd = nk * dk, cd = 2 * kd + nv * dv, vd = nv * dv, hist = kk - 1;
    size_t conv_n = (size_t)hist * cd, rec_n = (size_t)nv * dv * dk;
    std::vector<float> w((size_t)cd * kk), a_log(nv), dt_bias(nv);
    for (auto& v : w) v = urand(-0.6f, 0.6f);
    for (auto& v : a_log) v = urand(-1, 1);
    for (auto& v : dt_bias) v = urand(-1, 1);
    std::vector<float> mixed((size_t)b * cd), a((size_t)b * nv), bb((size_t)b * nv);
    for (auto& v : mixed) v = urand(-2, 2);
    for (auto& v : a) v = urand(-3, 3);
    for (auto& v : bb) v = urand(-3, 3);
    // Each sequence's states in their own buffers, in an order unlike the rows'.
    std::vector<std::vector<float>> conv(b, std::vector<float>(conv_n)), rec(b, std::vector<float>(rec_n));
    for (auto& st : conv) for (auto& v : st) v = urand(-2, 2);
    for (auto& st : rec) for (auto& v : st) v = urand(-0.5f, 0.5f);
    auto conv1 = conv, rec1 = rec;
    std::vector<unsigned long long> tab(2 * b);
    for (int r = 0; r < b; r++) {
        tab[2 * r] = (unsigned long long)conv[b - 1 - r].data();
        tab[2 * r + 1] = (unsigned long long)rec[b - 1 - r].data();
    }
    std::vector<float> y((size_t)b * vd, NAN), bmixed = mixed;
    {
        float* mp = bmixed.data();
        const float *wp = w.data(), *ap = a.data(), *bp = bb.data(), *alp = a_log.data(), *dtp = dt_bias.data();
        const unsigned long long* tp = tab.data();
        float* yp = y.data();
        emu_launch({(unsigned)(2 * nk + nv), (unsigned)b, 1}, (unsigned)std::max(dk, dv),
                   [&] { conv_qk_norm(mp, wp, nullptr, nk, dk, nv, dv, kk, 1, tp); });
        emu_launch({(unsigned)nv, (unsigned)((dv + 31) / 32), (unsigned)b}, 256,
                   [&] { delta_rule(mp, ap, bp, alp, dtp, nullptr, 1, nk, nv, dk, dv, yp, tp); });
    }
    std::vector<float> y1((size_t)b * vd, NAN), mixed1 = mixed;
    for (int r = 0; r < b; r++) {
        int s = b - 1 - r;
        float* mp = &mixed1[(size_t)r * cd];
        const float *wp = w.data(), *ap = &a[(size_t)r * nv], *bp = &bb[(size_t)r * nv], *alp = a_log.data(),
                    *dtp = dt_bias.data();
        float *cp = conv1[s].data(), *sp = rec1[s].data(), *yp = &y1[(size_t)r * vd];
        emu_launch({(unsigned)(2 * nk + nv), 1, 1}, (unsigned)std::max(dk, dv),
                   [&] { conv_qk_norm(mp, wp, cp, nk, dk, nv, dv, kk, 1, nullptr); });
        emu_launch({(unsigned)nv, (unsigned)((dv + 31) / 32), 1}, 256,
                   [&] { delta_rule(mp, ap, bp, alp, dtp, sp, 1, nk, nv, dk, dv, yp, nullptr); });
    }
    char name[128];
    snprintf(name, sizeof name, "decode batch b%d conv_qk_norm mixed", b);
    eq_bits(name, bmixed, mixed1);
    snprintf(name, sizeof name, "decode batch b%d delta_rule y", b);
    eq_bits(name, y, y1);
    for (int s = 0; s < b; s++) {
        snprintf(name, sizeof name, "decode batch b%d seq%d conv state", b, s);
        eq_bits(name, conv[s], conv1[s]);
        snprintf(name, sizeof name, "decode batch b%d seq%d recurrent state", b, s);
        eq_bits(name, rec[s], rec1[s]);
    }
}

static void test_attention_batch(int nh, int nkv, int hd, int half_rot, AttnFlavour f, std::vector<long> pos) {
    int b = (int)pos.size(), qs = f.gated ? 2 * hd : hd;
    long row = (long)nkv * hd;
    float eps = 1e-6f, scale = 1.0f / sqrtf((float)hd);
    std::vector<float> qg((size_t)b * nh * qs), k((size_t)b * row), v((size_t)b * row), q_norm(hd), k_norm(hd),
        qb((size_t)nh * qs), kb(row), vb(row);
    for (auto* buf : {&qg, &k, &v, &qb, &kb, &vb}) for (auto& x : *buf) x = urand(-2, 2);
    for (auto& x : q_norm) x = urand(0.5f, 1.5f);
    for (auto& x : k_norm) x = urand(0.5f, 1.5f);
    std::vector<double> inv(half_rot);
    for (int i = 0; i < half_rot; i++) inv[i] = pow(1e6, -2.0 * i / (2.0 * half_rot));
    // Sequence r's caches: its earlier rows random, room past its position.
    std::vector<std::vector<float>> kc(b), vc(b);
    for (int r = 0; r < b; r++) {
        kc[r].resize((size_t)(pos[r] + 4) * row);
        vc[r].resize(kc[r].size());
        for (auto& x : kc[r]) x = urand(-1.5f, 1.5f);
        for (auto& x : vc[r]) x = urand(-2, 2);
    }
    auto kc1 = kc, vc1 = vc;
    std::vector<long> masks(b, -1);  // rows at their positions (a full layer)
    std::vector<unsigned long long> tab(2 * b);
    for (int r = 0; r < b; r++) tab[2 * r] = (unsigned long long)kc[r].data(), tab[2 * r + 1] = (unsigned long long)vc[r].data();
    AttnParts P{f.bias ? qb.data() : nullptr, f.bias ? kb.data() : nullptr, f.bias ? vb.data() : nullptr,
                f.norms ? q_norm.data() : nullptr, f.norms ? k_norm.data() : nullptr, f.gated, f.mscale};
    size_t qn = (size_t)b * nh * hd;
    std::vector<float> q(qn, NAN), gate(f.gated ? qn : 0, NAN), out(qn, NAN);
    {
        const float *qp = qg.data(), *kp = k.data(), *vp = v.data();
        const double* ip = inv.data();
        const long* pp = pos.data();
        const unsigned long long* tp = tab.data();
        const long* mp = masks.data();
        float *qo = q.data(), *go = f.gated ? gate.data() : nullptr, *op = out.data();
        emu_launch({(unsigned)(nh + nkv), (unsigned)b, 1}, (unsigned)hd, [&] {
            attn_prep(qp, kp, vp, P, ip, half_rot, nh, nkv, hd, eps, pp, 1.0, qo, go, nullptr, nullptr, tp, 0, mp);
        });
        emu_launch({(unsigned)nh, (unsigned)b, 1}, 256, [&] {
            if (f.gated) attention(qo, nullptr, nullptr, go, nh, nkv, hd, pp, scale, op, tp);
            else attention_plain(qo, nullptr, nullptr, go, nh, nkv, hd, pp, scale, op, tp);
        });
    }
    std::vector<float> q1(qn, NAN), gate1(gate.size(), NAN), out1(qn, NAN);
    for (int r = 0; r < b; r++) {
        const float *qp = &qg[(size_t)r * nh * qs], *kp = &k[(size_t)r * row], *vp = &v[(size_t)r * row];
        const double* ip = inv.data();
        const long* pp = &pos[r];
        float *qo = &q1[(size_t)r * nh * hd], *go = f.gated ? &gate1[(size_t)r * nh * hd] : nullptr,
              *op = &out1[(size_t)r * nh * hd], *kcp = kc1[r].data(), *vcp = vc1[r].data();
        emu_launch({(unsigned)(nh + nkv), 1, 1}, (unsigned)hd, [&] {
            attn_prep(qp, kp, vp, P, ip, half_rot, nh, nkv, hd, eps, pp, 1.0, qo, go, kcp, vcp, nullptr, -1,
                      nullptr);
        });
        emu_launch({(unsigned)nh, 1, 1}, 256, [&] {
            if (f.gated) attention(qo, kcp, vcp, go, nh, nkv, hd, pp, scale, op, nullptr);
            else attention_plain(qo, kcp, vcp, go, nh, nkv, hd, pp, scale, op, nullptr);
        });
    }
    char name[128];
    snprintf(name, sizeof name, "decode batch b%d nh%d nkv%d hd%d%s q", b, nh, nkv, hd, f.gated ? " gated" : "");
    eq_bits(name, q, q1);
    if (f.gated) {
        snprintf(name, sizeof name, "decode batch b%d gate", b);
        eq_bits(name, gate, gate1);
    }
    snprintf(name, sizeof name, "decode batch b%d attention out", b);
    eq_bits(name, out, out1);
    for (int r = 0; r < b; r++) {
        snprintf(name, sizeof name, "decode batch b%d seq%d pos%ld caches", b, r, pos[r]);
        std::vector<float> both(kc[r]), both1(kc1[r]);
        both.insert(both.end(), vc[r].begin(), vc[r].end());
        both1.insert(both1.end(), vc1[r].begin(), vc1[r].end());
        eq_bits(name, both, both1);
    }
}

int main() {
    // Qwen3.5-style: 16 key heads, 32 value heads of 128, kernel 4
    test_conv_qk_norm(16, 32, 128, 128, 4, 1);
    test_conv_qk_norm(16, 32, 128, 128, 4, 5);
    test_conv_qk_norm(2, 4, 64, 128, 4, 3);   // dk < dv: q/k blocks with idle threads
    test_conv_qk_norm(2, 4, 128, 64, 4, 2);   // dk > dv: v blocks with idle threads
    test_conv_qk_norm(2, 2, 64, 64, 4, 37);   // several token tiles and a partial one
    test_conv_qk_norm(2, 2, 64, 32, 3, 16);   // one whole tile, a shorter kernel
    test_delta_rule(16, 32, 128, 128, 1, 2);  // Qwen3.5 decode
    test_delta_rule(2, 4, 128, 64, 4, 2);     // dv < dk: two row blocks per head
    test_delta_rule(2, 4, 64, 128, 3, 2);     // dk < dv: two columns per lane, four row blocks
    for (auto [h, n] : {std::pair{2048, 1}, std::pair{7168, 3}})
        for (Shared s : {NONE, GATED, PLAIN})
            for (bool grouped : {false, true}) test_moe_combine(h, 8, n, s, grouped);
    test_moe_combine_norm(2048, 8, 1, GATED);   // Qwen3.6-35B-A3B decode
    test_moe_combine_norm(4096, 10, 3, PLAIN);  // Qwen3.5-397B widths, a batch
    test_moe_combine_norm(7168, 8, 2, NONE);    // wider than the block (7 values a thread)
    test_moe_combine_norm(2880, 4, 1, NONE);    // gpt-oss: not a multiple of 1024
    test_add_rows(3, 2880);  // gpt-oss's o_proj bias (cols past a block of 256)
    test_add_rows(5, 16);    // a router bias
    AttnFlavour qwen35{true, true, false}, qwen3{false, true, false}, glm{false, true, true},
        glm_air{false, false, true};
    test_attn_prep(16, 2, 256, 32, 3, 5, 1e7, 1.0, qwen35);    // Qwen3.5: partial rotary (64 of 256)
    test_attn_prep(16, 2, 256, 32, 1, 40, 1e7, 1.0, qwen35);
    test_attn_prep(8, 4, 128, 64, 2, 0, 1e4, 1.0, qwen35);     // full rotary, from position 0
    test_attn_prep(8, 2, 128, 64, 3, 17, 1e6, 0.25, qwen35);   // a position scale
    test_attn_prep(8, 2, 128, 64, 3, 9, 1e6, 1.0, qwen3);      // Qwen3-MoE: no gate, full rotary
    test_attn_prep(12, 2, 128, 32, 2, 6, 1e6, 1.0, glm);       // GLM-4.6: biases, norms, half rotary
    test_attn_prep(12, 4, 128, 32, 3, 0, 1e6, 1.0, glm_air);   // GLM-4.5-Air: biases, no norms
    test_attn_prep(4, 2, 64, 16, 2, 3, 1e4, 1.0, {true, false, true});  // every part independent
    test_attn_prep(8, 2, 64, 32, 3, 11, 1.5e5, 1.0, {false, false, true, 1.3466f});  // gpt-oss: YaRN's mscale, biases
    test_attn_prep(8, 2, 64, 32, 5, 30, 1.5e5, 1.0, {false, false, true, 1.3466f}, 16);  // a window's ring, wrapping
    test_attn_prep(8, 2, 64, 32, 1, 47, 1.5e5, 1.0, {false, false, true, 1.3466f}, 16);  // its last row
    test_deltanet_batch(2, 4, 128, 64, 4, 3);  // dv < dk: two row blocks per head
    test_deltanet_batch(4, 8, 64, 128, 4, 5);  // dk < dv
    test_attention_batch(8, 2, 128, 32, qwen35, {5, 0, 23, 9});  // positions apart, one at 0
    test_attention_batch(12, 4, 64, 32, glm, {3, 17});
    printf(fails ? "%d FAILED\n" : "all ok\n", fails);
    return fails != 0;
}
