//! A hostile GGUF file: parsing it, reading its config and vocabulary, and
//! producing the first row of every tensor must give an error naming the
//! file or tensor, never a panic, an out-of-bounds read or a huge allocation.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use moeflux::convert::gguf::{file, ggml, tokenizer, Part, View};

fuzz_target!(|bytes: &[u8]| {
    let path = Path::new("fuzz.gguf");
    let Ok(p) = file::parse(bytes, path) else {
        return;
    };
    let _ = tokenizer::files(&p.kv, path);
    for t in &p.tensors {
        let cols = t.dims[0];
        let Some(mapping) = t.ty.mapping else {
            continue;
        };
        // One row (the parser checked the whole tensor lies in the file).
        let row_bytes = cols / t.ty.block * t.ty.bytes;
        let mut out = vec![0f32; cols.min(1 << 16)];
        if cols <= out.len() {
            ggml::dequant_rows(&t.ty, &bytes[t.start..t.start + row_bytes], &mut out);
        }
        if mapping != ggml::Mapping::Float && cols % 32 == 0 && cols <= 1 << 16 {
            for part in [Part::Codes, Part::Scales, Part::Biases] {
                let v = View {
                    ty: t.ty,
                    part,
                    cols,
                    src_start: t.start,
                    src_len: t.len,
                };
                let _ = v.rows(bytes, 0, 1);
            }
        }
    }
});
