//! Text generation with the library, as in the README:
//! `cargo run --release -p moeflux --example generate -- MODEL_DIR "prompt"`.

use std::io::Write;
use std::path::PathBuf;

use moeflux::generate::{generate, Event, GenerateOptions};
use moeflux::sample::SamplerConfig;
use moeflux::text::chat::{ChatMessage, ChatTemplate, RenderOptions};
use moeflux::text::tokenizer::Tokenizer;
use moeflux::{Session, SessionOptions};

fn main() -> moeflux::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(dir), Some(question)) = (args.next().map(PathBuf::from), args.next()) else {
        eprintln!("usage: generate MODEL_DIR PROMPT");
        std::process::exit(2);
    };

    let mut s = Session::open(&dir, SessionOptions::default())?;
    let tok = Tokenizer::from_model_dir(&dir)?;
    let prompt = ChatTemplate::from_model_dir(&dir)?.render(
        &[ChatMessage::user(question)],
        &RenderOptions {
            add_generation_prompt: true,
            ..Default::default()
        },
    )?;
    let opts = GenerateOptions {
        max_tokens: 200,
        sampler: SamplerConfig {
            temperature: 0.7,
            top_p: 0.9,
            seed: 42,
            ..Default::default()
        },
        ..Default::default()
    };
    let ids = tok.encode(&prompt, false)?;
    let stats = generate(&mut s, &tok, &ids, &opts, None, &mut |e| {
        if let Event::Text { text, .. } = e {
            print!("{text}");
            let _ = std::io::stdout().flush();
        }
    })?;
    println!();
    eprintln!(
        "{} tokens, {:.1} tok/s",
        stats.generated_tokens,
        stats.decode_tok_s()
    );
    Ok(())
}
