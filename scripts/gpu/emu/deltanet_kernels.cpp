// Checks of the chunked GatedDeltaNet delta rule (deltanet_chunk.cu: gdn_chunk_prep, then
// gdn_chunk_scan) under cuda_emu.h (see run.sh): y and the state after each of two calls in
// a row (the state carried from the first to the second), against a double-precision
// reference of the recurrence (backend/cpu/deltanet.rs, as qwen_kernels.cpp's delta_rule check)
// and against the token-by-token delta_rule kernel run on the same inputs. Token counts
// from one to several chunks plus a partial one, dk != dv, one and two value heads per key
// head, random initial states, decays from weak to strong.
#include "cuda_emu.h"
#include KERNELS_SOURCE  // the .cu files, made by run.sh
#include "emu_check.h"

static double sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }
static double softplus_d(double x) { return std::max(x, 0.0) + log1p(exp(-std::fabs(x))); }

struct Shape {
    int nk, nv, dk, dv;
};

// Random inputs of one call, as conv_qk_norm leaves them: |q| = 1/sqrt(dk), |k| = 1 per key
// head; v, a, b uniform.
struct Inputs {
    std::vector<float> mixed, a, b;
    Inputs(const Shape& s, int n, float a_lim) {
        int kd = s.nk * s.dk, cd = 2 * kd + s.nv * s.dv;
        mixed.resize((size_t)n * cd);
        a.resize((size_t)n * s.nv);
        b.resize((size_t)n * s.nv);
        for (int t = 0; t < n; t++)
            for (int h = 0; h < 2 * s.nk; h++) {
                float* p = &mixed[(size_t)t * cd + (size_t)h * s.dk];
                double ss = 0;
                for (int i = 0; i < s.dk; i++) { p[i] = urand(); ss += (double)p[i] * p[i]; }
                double f = (h < s.nk ? 1.0 / sqrt((double)s.dk) : 1.0) / sqrt(ss);
                for (int i = 0; i < s.dk; i++) p[i] = (float)(p[i] * f);
            }
        for (int t = 0; t < n; t++)
            for (int i = 2 * kd; i < cd; i++) mixed[(size_t)t * cd + i] = urand();
        for (auto& v : a) v = urand(-a_lim, a_lim);
        for (auto& v : b) v = urand(-3, 3);
    }
};

// The recurrence in double: per value head, token, row of the state.
static void reference(const Shape& s, int n, const Inputs& in, const std::vector<float>& a_log,
                      const std::vector<float>& dt_bias, std::vector<double>& st, std::vector<double>& y) {
    int kd = s.nk * s.dk, cd = 2 * kd + s.nv * s.dv, r = s.nv / s.nk;
    y.assign((size_t)n * s.nv * s.dv, 0.0);
    for (int h = 0; h < s.nv; h++) {
        int kh = h / r;
        double decay = exp((double)a_log[h]);
        for (int t = 0; t < n; t++) {
            const float* m = &in.mixed[(size_t)t * cd];
            const float *q = m + (size_t)kh * s.dk, *k = m + kd + (size_t)kh * s.dk, *v = m + 2 * kd + (size_t)h * s.dv;
            double g = exp(-decay * softplus_d((double)in.a[(size_t)t * s.nv + h] + dt_bias[h]));
            double beta = sigmoid_d(in.b[(size_t)t * s.nv + h]);
            for (int row = 0; row < s.dv; row++) {
                double* sr = &st[((size_t)h * s.dv + row) * s.dk];
                double kdot = 0, o = 0;
                for (int c = 0; c < s.dk; c++) kdot += sr[c] * k[c];
                double d = (v[row] - g * kdot) * beta;
                for (int c = 0; c < s.dk; c++) {
                    sr[c] = g * sr[c] + d * k[c];
                    o += sr[c] * q[c];
                }
                y[((size_t)t * s.nv + h) * s.dv + row] = o;
            }
        }
    }
}

static std::vector<double> as_double(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// Two calls in a row of n1 then n2 tokens; decays from a in [-a_lim, a_lim] and
// a_log in [log_lo, log_hi].
static void test_chunked(Shape s, int n1, int n2, float a_lim, float log_lo, float log_hi, double tol) {
    std::vector<float> state((size_t)s.nv * s.dv * s.dk), a_log(s.nv), dt_bias(s.nv);
    for (auto& v : state) v = urand(-0.5f, 0.5f);
    for (auto& v : a_log) v = urand(log_lo, log_hi);
    for (auto& v : dt_bias) v = urand(-1, 1);
    std::vector<float> state_dr = state;  // delta_rule's
    std::vector<double> rstate = as_double(state);
    int call = 0;
    for (int n : {n1, n2}) {
        call++;
        Inputs in(s, n, a_lim);
        int nch = (n + GDN_C - 1) / GDN_C;
        // NaN-filled: every record entry the scan reads and every output must be written.
        std::vector<float> ws((size_t)s.nv * nch * GDN_REC, NAN), y((size_t)n * s.nv * s.dv, NAN),
            y_dr((size_t)n * s.nv * s.dv, NAN);
        const float *mp = in.mixed.data(), *ap = in.a.data(), *bp = in.b.data(), *alp = a_log.data(),
                    *dtp = dt_bias.data();
        float *wsp = ws.data(), *sp = state.data(), *yp = y.data(), *sdp = state_dr.data(), *ydp = y_dr.data();
        emu_launch({(unsigned)s.nv, (unsigned)nch, 1}, 256,
                   [&] { gdn_chunk_prep(mp, ap, bp, alp, dtp, n, s.nk, s.nv, s.dk, s.dv, wsp); });
        emu_launch({(unsigned)s.nv, (unsigned)(s.dv / GDN_R), 1}, 256,
                   [&] { gdn_chunk_scan(mp, wsp, sp, n, s.nk, s.nv, s.dk, s.dv, yp); });
        emu_launch({(unsigned)s.nv, (unsigned)((s.dv + 31) / 32), 1}, 256,
                   [&] { delta_rule(mp, ap, bp, alp, dtp, sdp, n, s.nk, s.nv, s.dk, s.dv, ydp, nullptr); });
        std::vector<double> ry;
        reference(s, n, in, a_log, dt_bias, rstate, ry);
        char tag[96], name[160];
        snprintf(tag, sizeof tag, "nk%d nv%d dk%d dv%d n%d call%d a_log %g..%g", s.nk, s.nv, s.dk, s.dv, n,
                 call, log_lo, log_hi);
        snprintf(name, sizeof name, "gdn_chunk %s y", tag);
        check(name, y, ry, tol);
        snprintf(name, sizeof name, "gdn_chunk %s state", tag);
        check(name, state, rstate, tol);
        snprintf(name, sizeof name, "  vs delta_rule y");
        check(name, y, as_double(y_dr), tol);
        snprintf(name, sizeof name, "  vs delta_rule state");
        check(name, state, as_double(state_dr), tol);
    }
}

int main() {
    double tol = 1e-5;  // qwen_kernels.cpp's delta_rule level
    // Per value head log(decay rate) = a_log in [-6, 1] (a chunk's state mostly carried to
    // the next one, or mostly forgotten), a in [-3, 3].
    // Two value heads per key head, dk > dv: 2.3 chunks, then a partial one.
    test_chunked({2, 4, 64, 32}, 150, 37, 3, -6, 1, tol);
    // One per key head, dk < dv: a whole chunk, then one token.
    test_chunked({2, 2, 32, 64}, 64, 1, 3, -6, 1, tol);
    // One token, then 2 chunks plus one token.
    test_chunked({1, 2, 64, 96}, 1, 129, 3, -6, 1, tol);
    // Qwen3-Next's head dims (128, 128), two value heads per key head.
    test_chunked({1, 2, 128, 128}, 100, 64, 3, -6, 1, tol);
    // dk = 256: eight channels per lane in the scan's state.
    test_chunked({1, 1, 256, 32}, 70, 5, 3, -6, 1, tol);
    // Weak decays only (g ~ 0.99: the state carried over every chunk).
    test_chunked({1, 2, 64, 32}, 150, 37, 3, -8, -5, tol);
    // Strong ones only (a_log in [1, 2]: log g down to ~ -30 a token, exp(G) underflowing
    // within a chunk).
    test_chunked({1, 2, 64, 32}, 150, 37, 3, 1, 2, tol);
    printf(fails ? "%d FAILED\n" : "all ok\n", fails);
    return fails != 0;
}
