//! The progress of a run on stderr.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;

/// The progress of a run: the bar when one is drawn, else a line on
/// stderr every `every`.
pub(super) struct Progress {
    pub(super) bar: ProgressBar,
    pub(super) every: Duration,
    pub(super) start: Instant,
    pub(super) last: Mutex<Instant>,
    pub(super) total: usize,
}

impl Progress {
    /// Step `n` (0-based) of the run is done.
    pub(super) fn step(&self, n: usize, steps: usize) {
        let what = match n {
            0 => "warm-up",
            n if n <= steps => "timed steps",
            _ => "phase steps",
        };
        self.bar.set_message(what);
        self.bar.inc(1);
        if !self.bar.is_hidden() {
            return;
        }
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.elapsed() >= self.every {
            *last = Instant::now();
            eprintln!(
                "xcall moe: {}/{} steps done ({what}), {:.1} s",
                n + 1,
                self.total,
                self.start.elapsed().as_secs_f64()
            );
        }
    }
}
