//! `--step-log FILE`: one JSON line per engine step, for finding where a
//! served run's time goes (the forward pass, the per-job work after it, or
//! between steps: admissions and waiting for requests). Each line is
//! flushed as it is written, so a server stopped in any way keeps what it
//! logged.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::time::Instant;

use serde::Serialize;

/// One step, its times in milliseconds.
#[derive(Serialize)]
pub(crate) struct StepRecord {
    /// Seconds from the engine's start to the step's forward pass.
    pub t: f64,
    pub sequences: usize,
    /// Of them, sequences with one token (decoding).
    pub decoding: usize,
    pub tokens: usize,
    /// Since the end of the previous step's work: admissions, and time
    /// with nothing to run.
    pub before_ms: f64,
    /// `Batch::step`.
    pub forward_ms: f64,
    /// Sampling, streaming and ending jobs.
    pub after_ms: f64,
}

pub(crate) struct StepLog {
    out: BufWriter<File>,
    start: Instant,
}

impl StepLog {
    /// Creates (or truncates) `path`.
    pub fn create(path: &Path) -> Result<Self, String> {
        let file = File::create(path).map_err(|e| format!("step log {}: {e}", path.display()))?;
        Ok(StepLog {
            out: BufWriter::new(file),
            start: Instant::now(),
        })
    }

    pub fn start(&self) -> Instant {
        self.start
    }

    /// Appends `r`; a failed write stops nothing (the log is a diagnostic).
    pub fn write(&mut self, r: &StepRecord) {
        if let Ok(line) = serde_json::to_string(r) {
            let _ = writeln!(self.out, "{line}").and_then(|_| self.out.flush());
        }
    }
}
