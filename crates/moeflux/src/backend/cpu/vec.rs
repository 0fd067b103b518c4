//! Vector kernels on f32 rows (dot products, the delta-rule state update,
//! attention accumulation), dispatched once per call to the SIMD level of
//! [`simd_level`]. Each computes its result in a fixed order for a given
//! level, so a token's result never depends on the batch around it.

use super::simd::{simd_level, Isa, Scalar, SimdLevel};
#[cfg(target_arch = "x86_64")]
use super::simd::{Avx2, Avx512};

/// Defines `fn $name(level, args) -> ret` that runs `$generic::<ISA>(args)`
/// for the ISA of `level` (lowered to what the CPU supports), from an entry
/// point compiled with that ISA's target features (so the generic body
/// inlines with them).
macro_rules! dispatched {
    ($name:ident => $generic:ident ($($arg:ident : $ty:ty),*) $(-> $ret:ty)?) => {
        #[allow(clippy::too_many_arguments)]
        fn $name(level: SimdLevel, $($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[allow(clippy::too_many_arguments)]
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $generic::<Avx512>($($arg),*)
                }
                #[allow(clippy::too_many_arguments)]
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $generic::<Avx2>($($arg),*)
                }
                match level.clamped() {
                    // SAFETY: the level is clamped to what the CPU supports;
                    // callers check slice lengths.
                    SimdLevel::Avx512 => return unsafe { avx512($($arg),*) },
                    SimdLevel::Avx2 => return unsafe { avx2($($arg),*) },
                    SimdLevel::Scalar => {}
                }
            }
            // SAFETY: callers check slice lengths.
            unsafe { $generic::<Scalar>($($arg),*) }
        }
    };
}

dispatched!(dot_level => dot_impl(a: &[f32], b: &[f32]) -> f32);
dispatched!(axpy_level => axpy_impl(acc: &mut [f32], w: f32, x: &[f32]));
dispatched!(delta_rule_level => delta_rule_impl(
    s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: f32, beta: f32, y: &mut [f32]
));

#[inline(always)]
unsafe fn dot_impl<S: Isa>(a: &[f32], b: &[f32]) -> f32 {
    S::dot(a.as_ptr(), b.as_ptr(), a.len())
}

/// `sum a[i] * b[i]`.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: lengths differ");
    dot_level(simd_level(), a, b)
}

/// `acc[i] += w * x[i]`.
pub fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
    assert_eq!(acc.len(), x.len(), "axpy: lengths differ");
    axpy_level(simd_level(), acc, w, x)
}

#[inline(always)]
unsafe fn axpy_impl<S: Isa>(acc: &mut [f32], w: f32, x: &[f32]) {
    let n = acc.len();
    let full = n / S::LANES * S::LANES;
    let (a, xp, wv) = (acc.as_mut_ptr(), x.as_ptr(), S::splat(w));
    let mut i = 0;
    while i < full {
        S::store(a.add(i), S::fma(wv, S::load(xp.add(i)), S::load(a.add(i))));
        i += S::LANES;
    }
    while i < n {
        *a.add(i) += w * *xp.add(i);
        i += 1;
    }
}

/// One token of the gated delta rule on one value head's state `s`
/// (`[v_dim, k_dim]`, row-major), mlx-lm's recurrence:
///
/// ```text
/// S = g * S;  delta = (v - S k) * beta;  S += delta k^T;  y = S q
/// ```
///
/// computed per state row `r` as `d = (v_r - g * (r . k)) * beta`,
/// `r = g * r + d * k`, `y_r = r . q`: two passes over each row, the second
/// fusing the update with the readout.
pub fn delta_rule_step(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: f32,
    beta: f32,
    y: &mut [f32],
) {
    let dk = k.len();
    assert_eq!(q.len(), dk, "delta_rule_step: q and k differ in length");
    assert_eq!(
        s.len(),
        v.len() * dk,
        "delta_rule_step: state is not [v_dim, k_dim]"
    );
    assert_eq!(
        y.len(),
        v.len(),
        "delta_rule_step: y and v differ in length"
    );
    delta_rule_level(simd_level(), s, q, k, v, g, beta, y)
}

#[inline(always)]
unsafe fn delta_rule_impl<S: Isa>(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: f32,
    beta: f32,
    y: &mut [f32],
) {
    let dk = k.len();
    let full = dk / S::LANES * S::LANES;
    let (qp, kp) = (q.as_ptr(), k.as_ptr());
    let (gv, zero) = (S::splat(g), S::zero());
    for (i, row) in s.chunks_exact_mut(dk).enumerate() {
        let r = row.as_mut_ptr();
        let kd = S::dot(r, kp, dk);
        let d = (v[i] - g * kd) * beta;
        let dv = S::splat(d);
        let mut acc = zero;
        let mut j = 0;
        while j < full {
            let x = S::fma(dv, S::load(kp.add(j)), S::fma(gv, S::load(r.add(j)), zero));
            S::store(r.add(j), x);
            acc = S::fma(x, S::load(qp.add(j)), acc);
            j += S::LANES;
        }
        let mut out = S::hsum(acc);
        while j < dk {
            let x = d * *kp.add(j) + g * *r.add(j);
            *r.add(j) = x;
            out += x * *qp.add(j);
            j += 1;
        }
        y[i] = out;
    }
}

#[cfg(test)]
mod tests {
    use super::super::simd::supported_levels;
    use super::*;

    fn lcg(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    #[test]
    fn dot_and_axpy_match_f64() {
        for level in supported_levels() {
            for n in [0, 1, 7, 16, 33, 128, 257] {
                let (a, b) = (lcg(n, 1), lcg(n, 2));
                let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
                let got = dot_level(level, &a, &b) as f64;
                assert!((got - want).abs() < 1e-5, "{level} n={n}");
                let mut acc = lcg(n, 3);
                let orig = acc.clone();
                axpy_level(level, &mut acc, 0.75, &a);
                for i in 0..n {
                    assert!((acc[i] - (orig[i] + 0.75 * a[i])).abs() < 1e-6, "{level}");
                }
            }
        }
    }

    #[test]
    fn delta_rule_matches_the_textbook_form() {
        for ((dv, dk), level) in [(4, 16), (3, 20), (8, 128)]
            .into_iter()
            .flat_map(|d| supported_levels().into_iter().map(move |l| (d, l)))
        {
            let mut s = lcg(dv * dk, 4);
            let (q, k, v) = (lcg(dk, 5), lcg(dk, 6), lcg(dv, 7));
            let (g, beta) = (0.9f32, 0.6f32);
            // Reference in f64: S = g S; S += ((v - S k) * beta) k^T; y = S q.
            let mut r: Vec<f64> = s.iter().map(|&x| x as f64 * g as f64).collect();
            let mut want = vec![0.0f64; dv];
            for i in 0..dv {
                let row = &mut r[i * dk..(i + 1) * dk];
                let sk: f64 = row.iter().zip(&k).map(|(a, b)| a * *b as f64).sum();
                let d = (v[i] as f64 - sk) * beta as f64;
                for (x, kj) in row.iter_mut().zip(&k) {
                    *x += d * *kj as f64;
                }
                want[i] = row.iter().zip(&q).map(|(a, b)| a * *b as f64).sum();
            }
            let mut y = vec![0.0f32; dv];
            delta_rule_level(level, &mut s, &q, &k, &v, g, beta, &mut y);
            for i in 0..dv {
                assert!(
                    (y[i] as f64 - want[i]).abs() < 1e-5,
                    "{level} y[{i}] dv={dv} dk={dk}"
                );
            }
            for (a, b) in s.iter().zip(&r) {
                assert!((*a as f64 - b).abs() < 1e-5);
            }
        }
    }
}
