//! `hvprof-analyze record`: writes a live stream ([`crate::live::source`]) to a capture file verbatim,
//! every byte as it arrives (console text, damaged frames and all), so that every other
//! command reads the capture, while decoding it as it comes for a status line: bytes, frames,
//! samples, events, what was lost and damaged so far, the rate.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use hvprof_samplelog::{Collector, Decoded, StreamDecoder};

use crate::live::source::{Chunk, Reader};
use crate::live::window::{StreamStats, Totals, grouped};

/// How often the status is refreshed (and the capture flushed).
pub const REFRESH: Duration = Duration::from_millis(250);

/// When to stop besides the source's end and Ctrl-C.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordOptions {
    /// Stop once the end frame has arrived and the source has then been quiet for `after_end`
    /// (the hypervisor's closing console lines follow the end frame).
    pub until_end: bool,
    /// Stop after this long without a byte.
    pub idle_timeout: Option<Duration>,
    /// See `until_end`.
    pub after_end: Duration,
}

impl Default for RecordOptions {
    fn default() -> Self {
        RecordOptions {
            until_end: false,
            idle_timeout: None,
            after_end: Duration::from_secs(1),
        }
    }
}

/// The longest `record --until-end` waits for the source to fall quiet after the end frame.
const AFTER_END_MAX: Duration = Duration::from_secs(10);

/// Why recording stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// The source ended (a socket or pipe closed).
    SourceEnded,
    /// The end frame arrived (`--until-end`).
    EndFrame,
    /// Nothing arrived for the idle timeout.
    Idle(Duration),
    /// Ctrl-C (or a termination signal).
    Interrupted,
    /// Reading the source failed.
    Failed(String),
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stop::SourceEnded => write!(f, "the source ended"),
            Stop::EndFrame => write!(f, "the end frame arrived"),
            Stop::Idle(d) => write!(f, "nothing arrived for {:.1} s", d.as_secs_f64()),
            Stop::Interrupted => write!(f, "interrupted"),
            Stop::Failed(e) => write!(f, "reading failed: {e}"),
        }
    }
}

/// The state of a recording, as the status line shows it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Status {
    /// Wall time since recording started.
    pub elapsed: Duration,
    /// What arrived so far.
    pub totals: Totals,
    /// Samples per second of wall time, lately.
    pub rate: f64,
}

impl Status {
    /// One line: bytes, frames, samples, events, losses, damage, rate.
    pub fn line(&self) -> String {
        let t = &self.totals;
        format!(
            "{:.1} s: {} bytes, {} frames, {} samples, {} events; lost {} blocks, {} samples; {} damaged; {} samples/s{}",
            self.elapsed.as_secs_f64(),
            grouped(t.bytes),
            grouped(t.frames),
            grouped(t.samples),
            grouped(t.events),
            grouped(t.blocks_lost),
            grouped(t.samples_lost),
            grouped(t.damaged),
            grouped(self.rate.round() as u64),
            if t.end_seen {
                "; end frame received"
            } else {
                ""
            },
        )
    }
}

/// What a recording wrote.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// The capture's description, as `hvprof_samplelog::decode` gives it, without the records:
    /// frames, exact losses, damage, console text.
    pub decoded: Decoded,
    /// The last status.
    pub status: Status,
    /// Why it stopped.
    pub stop: Stop,
}

/// Samples per second over the last two seconds of wall time.
struct Rate {
    points: std::collections::VecDeque<(Instant, u64)>,
}

impl Rate {
    fn at(&mut self, now: Instant, samples: u64) -> f64 {
        self.points.push_back((now, samples));
        while self
            .points
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > Duration::from_secs(2))
            && self.points.len() > 2
        {
            self.points.pop_front();
        }
        match self.points.front() {
            Some(&(t, n)) if now > t => {
                samples.saturating_sub(n) as f64 / now.duration_since(t).as_secs_f64()
            }
            _ => 0.0,
        }
    }
}

/// The decoding on the way: the status's counts and the capture's description.
struct Tap {
    dec: StreamDecoder,
    stats: StreamStats,
    col: Collector,
}

impl Tap {
    /// Writes `bytes` to `out` and decodes them.
    fn take(&mut self, bytes: &[u8], out: &mut dyn Write) -> Result<()> {
        out.write_all(bytes).context("cannot write the capture")?;
        self.stats.add_bytes(bytes.len() as u64);
        let (stats, col) = (&mut self.stats, &mut self.col);
        self.dec.feed(bytes, &mut |item| {
            stats.push(&item);
            col.push(item);
        });
        Ok(())
    }
}

/// Copies what `reader` gives into `out` as it arrives, decoding it on the way, until the
/// source ends, `interrupted` is set, or `options` say to stop; `on_status` gets the status
/// every [`REFRESH`] (`out` is flushed then). What already arrived when it stops is written
/// too. Fails only when `out` cannot be written (reading errors end the recording: see
/// [`Recorded::stop`]).
pub fn record(
    reader: &Reader,
    out: &mut dyn Write,
    options: &RecordOptions,
    interrupted: &AtomicBool,
    on_status: &mut dyn FnMut(&Status),
) -> Result<Recorded> {
    let start = Instant::now();
    let mut tap = Tap {
        dec: StreamDecoder::new(),
        stats: StreamStats::new(),
        col: Collector::metadata_only(),
    };
    let mut rate = Rate {
        points: Default::default(),
    };
    let mut last_data = start;
    let mut end_seen_at: Option<Instant> = None;
    let mut next_status = start + REFRESH;
    let stop = loop {
        if interrupted.load(Ordering::Relaxed) {
            break Stop::Interrupted;
        }
        let now = Instant::now();
        match reader.recv_timeout(next_status.saturating_duration_since(now).min(REFRESH)) {
            Some(Chunk::Data(d)) => {
                tap.take(&d, out)?;
                last_data = Instant::now();
            }
            Some(Chunk::End) => break Stop::SourceEnded,
            Some(Chunk::Failed(e)) => break Stop::Failed(e.to_string()),
            None => {}
        }
        let now = Instant::now();
        if options.until_end {
            if end_seen_at.is_none() && tap.stats.totals().end_seen {
                end_seen_at = Some(now);
            }
            if let Some(t) = end_seen_at
                && (now.duration_since(last_data) >= options.after_end
                    || now.duration_since(t) >= AFTER_END_MAX)
            {
                break Stop::EndFrame;
            }
        }
        if let Some(idle) = options.idle_timeout
            && now.duration_since(last_data) >= idle
        {
            break Stop::Idle(idle);
        }
        if now >= next_status {
            out.flush().context("cannot write the capture")?;
            next_status = now + REFRESH;
            let totals = tap.stats.totals();
            on_status(&Status {
                elapsed: now.duration_since(start),
                totals,
                rate: rate.at(now, totals.samples),
            });
        }
    };
    // What already arrived belongs to the capture.
    if !matches!(stop, Stop::SourceEnded | Stop::Failed(_)) {
        while let Some(Chunk::Data(d)) = reader.try_recv() {
            tap.take(&d, out)?;
        }
    }
    let Tap {
        mut dec,
        mut stats,
        mut col,
    } = tap;
    dec.finish(&mut |item| {
        stats.push(&item);
        col.push(item);
    });
    out.flush().context("cannot write the capture")?;
    let elapsed = start.elapsed();
    let totals = stats.totals();
    let secs = elapsed.as_secs_f64();
    Ok(Recorded {
        decoded: col.finish(dec.position()),
        status: Status {
            elapsed,
            totals,
            rate: if secs > 0.0 {
                totals.samples as f64 / secs
            } else {
                0.0
            },
        },
        stop,
    })
}
