//! The dense weights file with a hostile safetensors header in front of
//! the fixture's real tensor bytes: opening the model must give an error
//! naming the file or tensor, never a panic or an out-of-bounds view.
#![no_main]

use libfuzzer_sys::fuzz_target;

mod common;

fuzz_target!(|header: &[u8]| {
    let path = common::model_dir().join(moeflux::format::DENSE_FILE);
    let original = std::fs::read(&path).expect("dense file");
    let n = u64::from_le_bytes(original[..8].try_into().unwrap()) as usize;
    let data = &original[8 + n..];
    let mut bytes = Vec::with_capacity(8 + header.len() + data.len());
    bytes.extend_from_slice(&(header.len() as u64).to_le_bytes());
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(data);
    let _swap = common::Swapped::new(moeflux::format::DENSE_FILE, &bytes);
    if let Ok(mut s) = moeflux::Session::open(common::model_dir(), common::session_options()) {
        let _ = s.eval(&[1, 2], moeflux::LogitsMode::Last);
    }
});
