//! `Session::state_load` of hostile bytes: an error leaves the session as
//! it was, a snapshot that loads must also run. An input is raw bytes (first
//! byte even) or edits of a valid snapshot of the session (first byte odd:
//! then 5-byte records, a 32-bit little-endian offset and the byte to put
//! there), which reaches past the header checks.
#![no_main]

use std::cell::RefCell;

use libfuzzer_sys::fuzz_target;
use moeflux::{LogitsMode, Session};

mod common;

thread_local! {
    // A session stays on the thread that opened it; libFuzzer runs inputs
    // on one thread.
    static SESSION: RefCell<Option<Session>> = const { RefCell::new(None) };
}

fuzz_target!(|data: &[u8]| {
    SESSION.with_borrow_mut(|slot| {
        let s = slot.get_or_insert_with(|| {
            Session::open(common::model_dir(), common::session_options()).expect("fixture")
        });
        run(s, data);
    });
});

fn run(s: &mut Session, data: &[u8]) {
    s.clear();
    s.eval(&[3, 4, 5], LogitsMode::Last).expect("fixture eval");
    let before = s.tokens().to_vec();
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let bytes = if mode % 2 == 0 {
        rest.to_vec()
    } else {
        let mut b = s.state_save().expect("snapshot of the fixture");
        for edit in rest.chunks_exact(5) {
            let at = u32::from_le_bytes(edit[..4].try_into().unwrap()) as usize;
            let n = b.len();
            b[at % n] = edit[4];
        }
        b
    };
    match s.state_load(&bytes) {
        Ok(()) => {
            let _ = s.eval(&[6], LogitsMode::Last);
        }
        Err(_) => assert_eq!(
            s.tokens(),
            before.as_slice(),
            "a refused snapshot changed the session"
        ),
    }
}
