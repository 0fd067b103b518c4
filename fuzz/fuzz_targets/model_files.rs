//! A model directory whose `config.json`, `moeflux.json`, `tokenizer.json`,
//! `tokenizer_config.json` (special tokens, chat template) or
//! `generation_config.json` is hostile: opening the model, its tokenizer
//! and its chat template (and rendering with it) must give an error or a
//! result, never a panic, an abort or a huge allocation (libFuzzer's RSS
//! limit catches those).
#![no_main]

use libfuzzer_sys::fuzz_target;
use moeflux::text::chat::{ChatMessage, ChatTemplate, RenderOptions};
use moeflux::text::tokenizer::Tokenizer;

mod common;

const FILES: [&str; 5] = [
    "config.json",
    "moeflux.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
];

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    let name = FILES[which as usize % FILES.len()];
    let _swap = common::Swapped::new(name, body);
    let dir = common::model_dir();
    match name {
        "config.json" | "moeflux.json" => {
            if let Ok(mut s) = moeflux::Session::open(dir, common::session_options()) {
                // A model that opens must also run.
                let _ = s.eval(&[1, 2], moeflux::LogitsMode::Last);
            }
        }
        _ => {
            if let Ok(t) = Tokenizer::from_model_dir(dir) {
                let _ = t.encode("hi <|im_start|> there", false);
            }
            if let Ok(t) = ChatTemplate::from_model_dir(dir) {
                // The smallest budget, so a hostile template stops fast.
                let t = t.with_context_window(0);
                let _ = t.render(&[ChatMessage::user("hi")], &RenderOptions::default());
            }
        }
    }
});
