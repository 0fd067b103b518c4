//! Progress display on stderr (only when stderr is a terminal).

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use moeflux::convert::{ConvertProgress, ConvertStage};
use moeflux::hub::PullProgress;

/// Sizes for people: GB from 1 GB up, else MB or KB (decimal units).
pub fn human_bytes(b: u64) -> String {
    let f = b as f64;
    if f >= 1e9 {
        format!("{:.2} GB", f / 1e9)
    } else if f >= 1e6 {
        format!("{:.1} MB", f / 1e6)
    } else {
        format!("{:.1} KB", f / 1e3)
    }
}

/// A byte-count bar for `moeflux convert`: bytes written / total, rate,
/// ETA and the current stage (dense tensors, expert layer N, finishing).
pub struct ConvertBar {
    bar: Option<ProgressBar>,
    /// (stage, layer) last shown, to set the message only when it changes.
    shown: AtomicU64,
}

impl ConvertBar {
    /// A visible bar when stderr is a terminal, else a silent one.
    pub fn new() -> Self {
        let bar = std::io::stderr().is_terminal().then(byte_bar);
        ConvertBar {
            bar,
            shown: AtomicU64::new(u64::MAX),
        }
    }

    pub fn update(&self, p: &ConvertProgress) {
        let Some(bar) = &self.bar else { return };
        bar.set_length(p.bytes_total);
        bar.set_position(p.bytes_done);
        let key = ((p.stage as u64) << 32) | p.layer.map_or(0xffff_ffff, |l| l as u64);
        if self.shown.swap(key, Ordering::Relaxed) != key {
            bar.set_message(stage_message(p));
        }
    }

    /// Removes the bar (before printing the summary or an error).
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

fn stage_message(p: &ConvertProgress) -> String {
    match p.stage {
        ConvertStage::Dense => "dense tensors".to_string(),
        ConvertStage::Experts => format!(
            "experts: layer {} ({}/{})",
            p.layer.unwrap_or(0),
            p.moe_layers_done + 1,
            p.moe_layers_total
        ),
        ConvertStage::Finishing => "finishing".to_string(),
    }
}

fn byte_bar() -> ProgressBar {
    let style = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {wide_bar} {decimal_bytes}/{decimal_total_bytes} \
         {decimal_bytes_per_sec} ETA {eta} {msg}",
    )
    .expect("valid template")
    .progress_chars("=> ");
    let bar =
        ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr()).with_style(style);
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// `moeflux pull`: one byte bar for the downloads (all files together),
/// then for the conversion.
pub struct PullBar {
    bar: Option<ProgressBar>,
    converting: std::sync::atomic::AtomicBool,
}

impl PullBar {
    /// A visible bar when stderr is a terminal, else a silent one.
    pub fn new() -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = byte_bar();
            b.set_message("listing");
            b
        });
        PullBar {
            bar,
            converting: std::sync::atomic::AtomicBool::new(false),
        }
    }

    pub fn update(&self, p: &PullProgress) {
        let Some(bar) = &self.bar else { return };
        match p {
            PullProgress::Resolved { commit } => {
                bar.set_message(format!("commit {}", &commit[..commit.len().min(12)]))
            }
            PullProgress::Download {
                bytes_done,
                bytes_total,
            } => {
                bar.set_length(*bytes_total);
                bar.set_position(*bytes_done);
                bar.set_message("downloading");
            }
            PullProgress::Convert(c) => {
                if !self.converting.swap(true, Ordering::Relaxed) {
                    bar.reset();
                }
                bar.set_length(c.bytes_total);
                bar.set_position(c.bytes_done);
                bar.set_message(format!("converting: {}", stage_message(c)));
            }
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

impl Drop for PullBar {
    fn drop(&mut self) {
        self.finish();
    }
}

impl Default for ConvertBar {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for ConvertBar {
    fn drop(&mut self) {
        self.finish();
    }
}

/// A spinner with a message on stderr when it is a terminal, else hidden.
pub fn spinner(msg: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("valid template"),
    );
    bar.set_message(msg.to_string());
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// A bar counting tokens, `label` first, on stderr when it is a terminal,
/// else hidden; its length is set by the caller.
pub fn token_bar(label: &str) -> ProgressBar {
    count_bar(label, "tokens")
}

/// A bar counting `unit`s, as [`token_bar`] does tokens.
pub fn count_bar(label: &str, unit: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{label} [{{elapsed_precise}}] {{wide_bar}} {{pos}}/{{len}} {unit} {{per_sec}} ETA {{eta}}"
        ))
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// Prompt-processing progress (tokens), shown only for long prompts on a terminal.
pub struct PrefillBar {
    bar: Option<ProgressBar>,
}

impl PrefillBar {
    pub fn new() -> Self {
        PrefillBar { bar: None }
    }

    pub fn update(&mut self, done: usize, total: usize) {
        if self.bar.is_none() && done < total && total >= 256 && std::io::stderr().is_terminal() {
            let bar =
                ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "prompt {wide_bar} {pos}/{len} tokens {per_sec} ETA {eta}",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            self.bar = Some(bar);
        }
        if let Some(bar) = &self.bar {
            bar.set_position(done as u64);
            if done >= total {
                bar.finish_and_clear();
                self.bar = None;
            }
        }
    }
}

impl Default for PrefillBar {
    fn default() -> Self {
        Self::new()
    }
}
