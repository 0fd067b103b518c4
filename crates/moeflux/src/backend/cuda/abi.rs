//! The structs the kernels take by value, defined once: each entry below
//! makes the Rust `#[repr(C)]` type and its C declaration, which
//! `kernels/abi.cuh` holds for the compilers (NVRTC, the CPU emulation,
//! the micro-benchmark). A test keeps that file equal to the text the
//! entries generate, which asserts the size of every struct and the
//! offset of every field as Rust lays them out: a C type that does not match
//! its Rust field fails the kernels' compile.
//!
//! Device addresses are `u64` here and typed pointers in C.

macro_rules! kernel_structs {
    ($(
        $(#[doc = $doc:literal])*
        struct $name:ident as $cname:literal {
            $( $(#[doc = $fdoc:literal])* $field:ident : $ty:ty => $cdecl:literal, )*
        }
    )*) => {
        $(
            $(#[doc = $doc])*
            #[repr(C)]
            #[derive(Clone, Copy, Debug)]
            pub(super) struct $name {
                $( $(#[doc = $fdoc])* pub $field: $ty, )*
            }
        )*

        /// The C declarations of the structs above, with static asserts of
        /// their Rust layout (`kernels/abi.cuh`).
        #[cfg(test)]
        fn c_declarations() -> String {
            let mut s = String::from(HEADER);
            $(
                s.push('\n');
                $( s.push_str(&format!("//{}\n", $doc)); )*
                s.push_str(concat!("struct ", $cname, " {\n"));
                $(
                    $( s.push_str(&format!("    //{}\n", $fdoc)); )*
                    s.push_str(concat!("    ", $cdecl, ";\n"));
                )*
                s.push_str("};\n");
                s.push_str(&format!(
                    "static_assert(sizeof({}) == {}, \"{} as Rust lays it out\");\n",
                    $cname,
                    std::mem::size_of::<$name>(),
                    $cname
                ));
                s.push_str(OFFSETS_FROM);
                $(
                    s.push_str(&format!(
                        "static_assert(offsetof({}, {}) == {}, \"{}.{}\");\n",
                        $cname,
                        stringify!($field),
                        std::mem::offset_of!($name, $field),
                        $cname,
                        stringify!($field)
                    ));
                )*
                s.push_str("#endif\n");
            )*
            s
        }

        #[cfg(test)]
        /// Each C declaration names its field (so the offsets above refer to it).
        fn declared_fields() -> Vec<(&'static str, &'static str)> {
            vec![$( $( (stringify!($field), $cdecl), )* )*]
        }
    };
}

/// NVRTC has no `offsetof` (nor `<cstddef>`): there the sizes are
/// checked, and the field offsets where the same text meets a host
/// compiler (the CPU emulation in CI, nvcc for the micro-benchmark).
#[cfg(test)]
const OFFSETS_FROM: &str = "#ifndef __CUDACC_RTC__\n";

#[cfg(test)]
const HEADER: &str = "\
// The structs the kernels take by value. Generated from
// crates/moeflux/src/backend/cuda/abi.rs (the Rust side's #[repr(C)] types):
// edit that file, then `MOEFLUX_WRITE_ABI=1 cargo test -p moeflux --lib abi`.
#ifndef __CUDACC_RTC__
#include <cstddef>
#endif
";

kernel_structs! {
    /// A quantized matrix: affine codes with scales and biases, or MXFP4
    /// codes with scale bytes (`s`; `b` unused).
    struct Qw as "QW" {
        /// Packed codes, rows x words per row.
        w: u64 => "const u32* w",
        /// Scales, rows x groups (bf16, or f32 when `sf32`).
        s: u64 => "const void* s",
        /// Biases, like the scales.
        b: u64 => "const void* b",
        rows: i32 => "int rows",
        cols: i32 => "int cols",
        bits: i32 => "int bits",
        gs: i32 => "int gs",
        sf32: i32 => "int sf32",
    }

    /// Up to four products of one input in one launch (`qmatmul_body` in
    /// kernels/qmatmul.cu).
    struct MultiMatmul as "MultiMatmul" {
        q: [Qw; 4] => "QW q[4]",
        out: [u64; 4] => "float* out[4]",
        /// A bias per output row added after the product, or null; only the
        /// one-token qmv kernels take one (the host adds it after the others).
        bias: [u64; 4] => "const float* bias[4]",
        /// Blocks of matrix m: first_block[m] .. first_block[m + 1].
        first_block: [i32; 5] => "int first_block[5]",
        count: i32 => "int count",
        /// Bit m: add matrix m's product to its output rather than store it.
        accumulate: i32 => "int accumulate",
    }

    /// The biases, norms and output gate of a grouped-query attention layer
    /// (each pointer null where the family has none): q/k/v biases (rows of
    /// the projections), the per-head q/k RMSNorm weights, and whether
    /// q_proj's rows are per head [q | gate] (Qwen3.5 / Qwen3-Next) rather
    /// than q alone.
    struct AttnParts as "AttnParts" {
        q_bias: u64 => "const float* q_bias",
        k_bias: u64 => "const float* k_bias",
        v_bias: u64 => "const float* v_bias",
        q_norm: u64 => "const float* q_norm",
        k_norm: u64 => "const float* k_norm",
        gated: i32 => "int gated",
        /// YaRN's magnitude factor of the rotated channels (1 without YaRN).
        mscale: f32 => "float mscale",
    }

    /// One routed expert of a batch: where its projections live and which
    /// (token, slot)s it serves.
    struct ExpertTask as "ExpertTask" {
        /// The expert's extent.
        base: u64 => "const char* base",
        /// Its entries in slot_list: first .. first + count.
        first: i32 => "int first",
        count: i32 => "int count",
    }

    /// Where an expert extent holds each projection's codes, scales and
    /// biases (byte offsets), and how the expert computes.
    struct ExpertLayoutC as "ExpertLayout" {
        gate_w: i64 => "long gate_w",
        gate_s: i64 => "long gate_s",
        gate_b: i64 => "long gate_b",
        up_w: i64 => "long up_w",
        up_s: i64 => "long up_s",
        up_b: i64 => "long up_b",
        down_w: i64 => "long down_w",
        down_s: i64 => "long down_s",
        down_b: i64 => "long down_b",
        inter: i32 => "int inter",
        hidden: i32 => "int hidden",
        /// Gate and up projections' code width, group size, F32 scales.
        bits: i32 => "int bits",
        gs: i32 => "int gs",
        sf32: i32 => "int sf32",
        /// The down projection's, which may differ (llama.cpp's Q4_K_M
        /// keeps some `ffn_down_exps` as Q6_K: 6-bit codes in groups of 16).
        down_bits: i32 => "int down_bits",
        down_gs: i32 => "int down_gs",
        down_sf32: i32 => "int down_sf32",
        /// MXFP4 codes with e8m0 scale bytes (bits 4, gs 32, no biases): the
        /// `_mx` kernels.
        mx: i32 => "int mx",
        /// gpt-oss's clamped SwiGLU (alpha, limit) rather than silu(g) * u.
        oai: i32 => "int oai",
        alpha: f32 => "float alpha",
        limit: f32 => "float limit",
        /// Per-expert biases (gpt-oss), [experts, inter] for gate and up and
        /// [experts, hidden] for down, or null; row ids[slot] is the slot's
        /// expert (the router's choice).
        bias_g: u64 => "const float* bias_g",
        bias_u: u64 => "const float* bias_u",
        bias_d: u64 => "const float* bias_d",
        ids: u64 => "const int* ids",
    }

    /// A MoE layer's output rows (`moe_combine_at` in kernels/moe.cu):
    /// `base` (or zero) plus the routed experts' rows weighted by the
    /// router, plus the shared expert (times sigmoid of its gate logit).
    struct MoeCombineC as "MoeCombine" {
        /// [tokens x k, hidden]: each (token, slot)'s expert output.
        slot_out: u64 => "const float* slot_out",
        /// [tokens x k]: the router's weights and experts.
        wts: u64 => "const float* wts",
        ids: u64 => "const int* ids",
        /// In a group: this GPU's experts of the layer (a byte each); the
        /// other slots are skipped. Null: every slot counts.
        own: u64 => "const unsigned char* own",
        /// [tokens, hidden] and [tokens], or null.
        shared: u64 => "const float* shared",
        sg: u64 => "const float* sg",
        /// [tokens, hidden], or null for zero.
        base: u64 => "const float* base",
        k: i32 => "int k",
        h: i32 => "int h",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `kernels/abi.cuh` is the generated text (`MOEFLUX_WRITE_ABI=1`
    /// rewrites it), and every C declaration names its Rust field.
    #[test]
    fn abi_header_is_generated() {
        for (field, decl) in declared_fields() {
            let name = decl
                .rsplit([' ', '*'])
                .next()
                .and_then(|n| n.split('[').next());
            assert_eq!(name, Some(field), "{decl}");
        }
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("src/backend/cuda/kernels/abi.cuh");
        let want = c_declarations();
        if std::env::var_os("MOEFLUX_WRITE_ABI").is_some() {
            std::fs::write(&path, &want).unwrap();
        }
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            have == want,
            "{} is stale: run MOEFLUX_WRITE_ABI=1 cargo test -p moeflux --lib abi",
            path.display()
        );
    }
}
