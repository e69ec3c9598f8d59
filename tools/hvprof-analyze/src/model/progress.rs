//! A progress bar for long runs (indicatif): drawn on stderr only when stderr is a terminal, and
//! only once the work has taken more than a second, so short runs, pipes, files and tests never
//! see it.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How long the work runs before the bar appears.
const DELAY: Duration = Duration::from_secs(1);

pub struct Progress {
    bar: ProgressBar,
    start: Instant,
    tty: bool,
    shown: AtomicBool,
    /// `HVPROF_TIMINGS` set: each phase's wall time is printed on stderr when it ends.
    timings: Option<std::sync::Mutex<(String, Instant)>>,
}

impl Progress {
    /// A bar that may appear on stderr (a terminal) after a second.
    pub fn new() -> Self {
        Self::with_terminal(std::io::stderr().is_terminal())
    }

    /// A bar that never draws (libraries, tests).
    pub fn hidden() -> Self {
        Self::with_terminal(false)
    }

    fn with_terminal(tty: bool) -> Self {
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
        Progress {
            bar,
            start: Instant::now(),
            tty,
            shown: AtomicBool::new(false),
            timings: std::env::var_os("HVPROF_TIMINGS")
                .map(|_| std::sync::Mutex::new((String::new(), Instant::now()))),
        }
    }

    /// Starts a phase: `what` with `len` steps of `unit` (a spinner with a count when the
    /// length is unknown).
    pub fn phase(&self, what: &str, len: Option<u64>, unit: &str) {
        self.time_phase(what);
        let template = if len.is_some() {
            format!(
                "{{msg:12}} [{{bar:40}}] {{human_pos}}/{{human_len}} {unit} ({{elapsed}}, {{eta}} left)"
            )
        } else {
            format!("{{spinner}} {{msg:12}} {{human_pos}} {unit} ({{elapsed}})")
        };
        self.bar.set_position(0);
        match len {
            Some(n) => self.bar.set_length(n),
            None => self.bar.unset_length(),
        }
        if let Ok(style) = ProgressStyle::with_template(&template) {
            self.bar.set_style(style.progress_chars("=> "));
        }
        self.bar.set_message(what.to_owned());
        self.maybe_show();
    }

    /// `n` more steps done. Free without a terminal (no bar is ever drawn); on one, the bar's
    /// position is shared by every thread, so callers on hot paths add up their steps and
    /// report them a few times a second, not per item.
    pub fn inc(&self, n: u64) {
        if !self.tty {
            return;
        }
        self.bar.inc(n);
        self.maybe_show();
    }

    fn maybe_show(&self) {
        if self.tty
            && !self.shown.load(Ordering::Relaxed)
            && self.start.elapsed() >= DELAY
            && !self.shown.swap(true, Ordering::Relaxed)
        {
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
        }
    }

    /// Prints a line on stderr without tearing the bar.
    pub fn warn(&self, line: &str) {
        self.bar.suspend(|| eprintln!("{line}"));
    }

    /// With `HVPROF_TIMINGS` set: prints the wall time of the phase that ends, and starts `next`.
    fn time_phase(&self, next: &str) {
        if let Some(t) = &self.timings {
            let mut t = t.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if !t.0.is_empty() {
                // Resident memory at the phase's end (Linux; 0 elsewhere).
                let rss_mb = std::fs::read_to_string("/proc/self/statm")
                    .ok()
                    .and_then(|m| m.split_whitespace().nth(1)?.parse::<u64>().ok())
                    .map_or(0, |pages| (pages * 4096) >> 20);
                eprintln!(
                    "timing: {:<12} {:>8.1} ms, {rss_mb} MB resident",
                    t.0,
                    t.1.elapsed().as_secs_f64() * 1e3
                );
            }
            *t = (next.to_owned(), Instant::now());
        }
    }

    /// Removes the bar (if it was drawn).
    pub fn finish(&self) {
        self.time_phase("");
        self.bar.finish_and_clear();
    }
}

impl Default for Progress {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_drawn_without_a_terminal() {
        let p = Progress::hidden();
        p.phase("decoding", None, "records");
        p.inc(10);
        p.phase("writing", Some(100), "samples");
        p.inc(100);
        assert!(!p.shown.load(Ordering::Relaxed));
        assert!(p.bar.is_hidden());
        p.finish();
    }

    #[test]
    fn drawn_on_a_terminal_only_after_the_delay() {
        let p = Progress::with_terminal(true);
        p.phase("decoding", None, "records");
        p.inc(1);
        assert!(
            !p.shown.load(Ordering::Relaxed),
            "not within the first second"
        );
        // Pretend the work started long ago.
        let p = Progress {
            start: Instant::now() - Duration::from_secs(2),
            ..Progress::with_terminal(true)
        };
        p.inc(1);
        assert!(p.shown.load(Ordering::Relaxed));
        p.finish();
    }
}
