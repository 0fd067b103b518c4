//! Printing generated text (reasoning dimmed, tagged or hidden) and the
//! statistics line after an answer.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use moeflux::generate::GenerationStats;

use crate::progress::human_bytes;

const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

/// Writes streamed text to stdout: reasoning dimmed on a terminal, wrapped
/// in `<think>`…`</think>` otherwise, or dropped when hidden.
pub struct TextPrinter {
    hide_reasoning: bool,
    terminal: bool,
    in_reasoning: bool,
}

impl TextPrinter {
    pub fn new(hide_reasoning: bool) -> Self {
        TextPrinter {
            hide_reasoning,
            terminal: std::io::stdout().is_terminal(),
            in_reasoning: false,
        }
    }

    pub fn text(&mut self, text: &str, reasoning: bool) {
        let mut out = std::io::stdout().lock();
        if reasoning != self.in_reasoning {
            self.switch(&mut out, reasoning);
        }
        if !(reasoning && self.hide_reasoning) {
            let _ = out.write_all(text.as_bytes());
        }
        let _ = out.flush();
    }

    fn switch(&mut self, out: &mut impl Write, reasoning: bool) {
        self.in_reasoning = reasoning;
        if self.hide_reasoning {
            return;
        }
        let _ = match (self.terminal, reasoning) {
            (true, true) => out.write_all(DIM.as_bytes()),
            (true, false) => out.write_all(format!("{RESET}\n").as_bytes()),
            (false, true) => out.write_all(b"<think>\n"),
            (false, false) => out.write_all(b"\n</think>\n"),
        };
    }

    /// Closes an open reasoning block and ends the line.
    pub fn end(&mut self) {
        let mut out = std::io::stdout().lock();
        if self.in_reasoning {
            self.switch(&mut out, false);
        }
        let _ = out.write_all(b"\n");
        let _ = out.flush();
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// The one-line summary printed on stderr after an answer.
pub fn stats_line(load: Option<Duration>, s: &GenerationStats) -> String {
    let mut parts = Vec::new();
    if let Some(l) = load {
        parts.push(format!("load {:.2} s", secs(l)));
    }
    let mut prompt = format!(
        "prompt {} tok, {:.1} tok/s",
        s.prompt_tokens,
        s.prefill_tok_s()
    );
    if s.reused_tokens > 0 {
        prompt.push_str(&format!(" ({} reused)", s.reused_tokens));
    }
    parts.push(prompt);
    parts.push(format!(
        "generated {} tok, {:.1} tok/s",
        s.generated_tokens,
        s.decode_tok_s()
    ));
    let mut io = format!("experts {} read", human_bytes(s.io.bytes));
    if let Some(h) = s.cache_hit_rate() {
        io.push_str(&format!(", page cache ~{:.0}%", h * 100.0));
    }
    parts.push(io);
    parts.push(format!("finish {}", s.finish.as_str()));
    parts.join(" | ")
}

/// Per-phase breakdown, in ms per evaluated token.
pub fn timing_report(s: &GenerationStats, seed: u64) -> String {
    let tokens = (s.prompt_tokens + s.generated_tokens).max(1) as f64;
    let mut out = format!(
        "timing: prefill {:.3} s, decode {:.3} s, seed {seed}\n",
        secs(s.prefill_time),
        secs(s.decode_time)
    );
    let total = s.times.total();
    for (name, d) in s.times.phases() {
        let pct = if total.is_zero() {
            0.0
        } else {
            100.0 * secs(d) / secs(total)
        };
        out.push_str(&format!(
            "  {name:<18} {:>9.3} ms/token {:>5.1}%\n",
            1e3 * secs(d) / tokens,
            pct
        ));
    }
    out.push_str(&format!(
        "  expert reads: {} in {} calls, {:.2} GB/s while reading",
        s.io.reads,
        s.io.calls,
        s.io.gb_per_s()
    ));
    out
}
