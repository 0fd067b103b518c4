//! A model directory whose `config.json` or `moeflux.json` is hostile:
//! opening it must give an error, never a panic, an abort or a huge
//! allocation (libFuzzer's RSS limit catches those).
#![no_main]

use libfuzzer_sys::fuzz_target;

mod common;

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    let name = if which % 2 == 0 {
        "config.json"
    } else {
        "moeflux.json"
    };
    let _swap = common::Swapped::new(name, body);
    if let Ok(mut s) = moeflux::Session::open(common::model_dir(), common::session_options()) {
        // A model that opens must also run.
        let _ = s.eval(&[1, 2], moeflux::LogitsMode::Last);
    }
});
