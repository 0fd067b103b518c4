//! Several sequences decoding together through one `Batch`: each step
//! evaluates one token of every sequence in one forward pass. Prints the
//! time per step, per token, and where it went, for 1 and N sequences.
//!
//!   cargo run --release --example batch_decode -- MODEL_DIR [N] [STEPS] [THREADS] [cpu|cuda] [nographs] [greedy]
//!
//! `nographs`: every GPU step eager (for `MOEFLUX_CUDA_PROFILE`, which times
//! eager launches only). `greedy`: each step asks for the sequences' greedy
//! tokens (`LogitsMode::Greedy`: picked where the logits are) instead of
//! their logits, which the example then reduces to the argmax itself.

use std::time::Instant;

use moeflux::{Backend, Batch, LogitsMode, Output, SessionOptions, Work};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().ok_or(
        "usage: batch_decode MODEL_DIR [N] [STEPS] [THREADS|all] [cpu|cuda] [nographs] [greedy]",
    )?;
    let n: usize = args.next().map_or(Ok(8), |s| s.parse())?;
    let steps: usize = args.next().map_or(Ok(16), |s| s.parse())?;
    let threads = match args.next().as_deref() {
        None | Some("all") => None,
        Some(t) => Some(t.parse()?),
    };
    let backend = args
        .next()
        .map_or(Some(Backend::Cpu), |b| Backend::parse(&b));
    let (mut cuda_graphs, mut greedy) = (true, false);
    for a in args {
        match a.as_str() {
            "nographs" => cuda_graphs = false,
            "greedy" => greedy = true,
            _ => return Err(format!("unknown argument '{a}' (nographs, greedy)").into()),
        }
    }
    let mode = if greedy {
        LogitsMode::Greedy
    } else {
        LogitsMode::Last
    };
    let opts = SessionOptions {
        threads,
        backend: backend.ok_or("the backend is cpu, cuda or auto")?,
        cuda_graphs,
        ..Default::default()
    };
    let mut batch = Batch::open(dir.as_ref(), opts)?;
    let vocab = batch.vocab_size() as u32;
    println!("{}", batch.backend());
    for seqs in [1, n] {
        let ids: Vec<_> = (0..seqs)
            .map(|_| batch.add_sequence())
            .collect::<Result<_, _>>()?;
        // A short prompt each, then one token per sequence per step.
        let mut next: Vec<u32> = (0..seqs as u32).map(|i| (i * 7919 + 13) % vocab).collect();
        for (id, &t) in ids.iter().zip(&next) {
            batch.eval(
                *id,
                &[t, (t + 1) % vocab, (t + 2) % vocab],
                LogitsMode::Last,
            )?;
        }
        batch.reset_times();
        let mut in_step = std::time::Duration::ZERO;
        let t0 = Instant::now();
        for _ in 0..steps {
            let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let work: Vec<Work> = ids
                .iter()
                .zip(&tokens)
                .map(|(&seq, t)| Work {
                    seq,
                    tokens: t,
                    logits: Some(mode),
                })
                .collect();
            let ts = Instant::now();
            let results = batch.step(&work)?;
            in_step += ts.elapsed();
            for (t, out) in next.iter_mut().zip(results) {
                *t = match out? {
                    Output::Token(tok) => tok,
                    // The argmax is the sequence's next token.
                    Output::Logits(logits) => (0..logits.len())
                        .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
                        .unwrap_or(0) as u32,
                };
            }
        }
        let dt = t0.elapsed().as_secs_f64();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / steps as f64;
        let t = batch.times();
        println!(
            "{seqs} sequences: {:.2} ms per step ({:.2} in Batch::step, the rest the argmax), \
             {:.1} tok/s; per step: attention {:.2} ms, \
             routing {:.2}, expert I/O {:.2}, experts {:.2}, shared {:.2}, LM head {:.2}, \
             embed+norms {:.2}, GPU graph {:.2}",
            dt * 1e3 / steps as f64,
            ms(in_step),
            (seqs * steps) as f64 / dt,
            ms(t.attention),
            ms(t.routing),
            ms(t.expert_io),
            ms(t.expert_compute),
            ms(t.shared_mlp),
            ms(t.lm_head),
            ms(t.embed_norm),
            ms(t.gpu_graph),
        );
        for id in ids {
            batch.remove_sequence(id)?;
        }
    }
    Ok(())
}
