//! How a model's routers spread random tokens over experts, per MoE layer:
//! `cargo run --release -p moeflux --example expert_popularity -- MODEL_DIR [TOKENS]`.
//! Tokens are evaluated one at a time, so expert reads are selections.
//! For a `moeflux synth --router-skew zipf:ALPHA` model the Zipf target
//! is printed beside the measured shares.

use std::path::PathBuf;

use moeflux::synth::skew::zipf_frequencies;
use moeflux::{LogitsMode, Session, SessionOptions};

/// Shares of all selections taken by the most popular 1%, 10%, 25%, 50%.
fn shares(freq: &[f64]) -> Vec<f64> {
    let mut f = freq.to_vec();
    f.sort_unstable_by(|a, b| b.total_cmp(a));
    let total: f64 = f.iter().sum();
    [0.01, 0.1, 0.25, 0.5]
        .iter()
        .map(|p| {
            let n = (f.len() as f64 * p).ceil() as usize;
            f[..n].iter().sum::<f64>() / total
        })
        .collect()
}

fn row(label: &str, s: &[f64], extra: &str) {
    let pct: Vec<String> = s.iter().map(|x| format!("{:5.1}%", 100.0 * x)).collect();
    println!("{label:<8} {}  {extra}", pct.join("  "));
}

fn main() -> moeflux::Result<()> {
    let mut args = std::env::args().skip(1);
    let Some(dir) = args.next().map(PathBuf::from) else {
        eprintln!("usage: expert_popularity MODEL_DIR [TOKENS]");
        std::process::exit(2);
    };
    let n: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(300);

    let mut s = Session::open(&dir, SessionOptions::default())?;
    let (vocab, k) = (s.vocab_size() as u64, s.experts_per_token());
    let mut x = 12345u64;
    for _ in 0..n {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        s.eval(&[((x >> 33) % vocab) as u32], LogitsMode::Last)?;
    }

    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap_or_default())
            .unwrap_or_default();
    let alpha = config["moeflux_synth"]["router_skew"]
        .as_str()
        .and_then(|r| r.strip_prefix("zipf:")?.parse::<f64>().ok());
    println!("{n} random tokens, top-{k}; share of selections taken by the most popular");
    println!("layer       1%     10%     25%     50%   unused experts");
    let mut experts = 0;
    for l in 0..s.config().num_layers {
        let Some(c) = s.expert_reads(l) else { continue };
        experts = c.len();
        let f: Vec<f64> = c.iter().map(|&x| x as f64).collect();
        let unused = c.iter().filter(|&&x| x == 0).count();
        row(
            &l.to_string(),
            &shares(&f),
            &format!("{unused}/{}", c.len()),
        );
    }
    if let Some(a) = alpha {
        row(
            &format!("zipf:{a}"),
            &shares(&zipf_frequencies(experts, k, a)),
            "target",
        );
    }
    Ok(())
}
