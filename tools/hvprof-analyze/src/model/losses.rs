//! What the capture lost: blocks lost on the way, samples the hypervisor dropped, the end
//! frame missing; in all ([`Lost`]) and per pCPU over host time ([`LossRange`]).

use hvprof_samplelog::Decoded;
use serde::Serialize;

/// What the capture lost, in all.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Lost {
    pub blocks: u64,
    pub samples: u64,
    pub events: u64,
    pub dropped: u64,
    pub damaged_frames: u64,
    pub truncated: bool,
}

impl Lost {
    /// The line that says what the capture lost, in all (the text report's and the HTML page's):
    /// `Lost: N blocks (N samples, N events), N samples dropped in the hypervisor (ring or buffer
    /// full), N damaged frames`, and `; TRUNCATED (no end frame)` without its end frame.
    pub fn line(&self) -> String {
        format!(
            "Lost: {} blocks ({} samples, {} events), {} samples dropped in the hypervisor (ring or buffer full), {} damaged frames{}",
            self.blocks,
            self.samples,
            self.events,
            self.dropped,
            self.damaged_frames,
            if self.truncated {
                "; TRUNCATED (no end frame)"
            } else {
                ""
            }
        )
    }

    /// What a decoded capture lost.
    pub(crate) fn of(decoded: &Decoded) -> Lost {
        Lost {
            blocks: decoded.blocks_lost(),
            samples: decoded.samples_lost(),
            events: decoded.events_lost(),
            dropped: decoded.ring_drops(),
            damaged_frames: decoded.damaged.len() as u64,
            truncated: !decoded.end_seen(),
        }
    }
}

/// Where a pCPU's records are missing, in host time (one per decoder `Gap`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LossRange {
    pub pcpu: u16,
    /// TSC of the last record received before the loss (`None`: from the start of the log).
    pub from_tsc: Option<u64>,
    /// TSC of the first record received after it (`None`: until the end of the log).
    pub to_tsc: Option<u64>,
    /// The same in seconds since the capture's first sample (`None` also when the TSC
    /// frequency is unknown).
    pub from_seconds: Option<f64>,
    pub to_seconds: Option<f64>,
    /// Blocks lost on the way, and the samples and events they held.
    pub blocks: u64,
    pub samples: u64,
    pub events: u64,
    /// Samples the hypervisor dropped (ring full).
    pub dropped: u64,
    /// The log ends here without an end frame: what followed is unknown.
    pub truncated: bool,
}

impl LossRange {
    /// Samples missing here (lost in blocks and dropped), saturating.
    pub fn samples_missing(&self) -> u64 {
        self.samples.saturating_add(self.dropped)
    }

    /// One line for the reader: how many samples, on which pCPU, over which host time.
    pub fn describe(&self) -> String {
        let at = |tsc: Option<u64>, s: Option<f64>, none: &str| match (tsc, s) {
            (Some(t), Some(s)) => format!("TSC {t} ({s:.6} s)"),
            (Some(t), None) => format!("TSC {t}"),
            (None, _) => none.to_owned(),
        };
        let from = at(self.from_tsc, self.from_seconds, "the start of the log");
        let to = at(self.to_tsc, self.to_seconds, "the end of the log");
        let mut what = Vec::new();
        if self.blocks > 0 || self.samples > 0 {
            what.push(format!(
                "{} samples and {} events lost in {} block(s)",
                self.samples, self.events, self.blocks
            ));
        }
        if self.dropped > 0 {
            what.push(format!(
                "{} samples dropped by the hypervisor (ring full)",
                self.dropped
            ));
        }
        if self.truncated {
            what.push("no end frame: what it recorded is unknown".into());
        }
        format!(
            "pCPU {}: {} from {from} to {to}",
            self.pcpu,
            what.join("; ")
        )
    }
}

/// The capture's losses, in host time, and the warnings that open the report: one per range
/// (the first `MAX_LOSS_LINES`, then their total).
pub(crate) fn losses(
    decoded: &Decoded,
    first_tsc: Option<u64>,
    tsc_hz: u64,
) -> (Vec<LossRange>, Vec<String>) {
    let seconds = |tsc: Option<u64>| {
        let (t, first) = (tsc?, first_tsc?);
        (tsc_hz > 0).then(|| t.saturating_sub(first) as f64 / tsc_hz as f64)
    };
    let ranges: Vec<LossRange> = decoded
        .gaps()
        .map(|g| LossRange {
            pcpu: g.pcpu,
            from_tsc: g.after_tsc,
            to_tsc: g.before_tsc,
            from_seconds: seconds(g.after_tsc),
            to_seconds: seconds(g.before_tsc),
            blocks: g.blocks,
            samples: g.samples,
            events: g.events,
            dropped: g.dropped,
            truncated: g.truncated,
        })
        .collect();
    let mut lines: Vec<String> = ranges
        .iter()
        .take(MAX_LOSS_LINES)
        .map(|l| format!("records lost: {}", l.describe()))
        .collect();
    if ranges.len() > MAX_LOSS_LINES {
        let rest = &ranges[MAX_LOSS_LINES..];
        let n = rest
            .iter()
            .fold(0u64, |n, l| n.saturating_add(l.samples_missing()));
        lines.push(format!(
            "records lost: {} more ranges ({n} samples): see the JSON report's \"losses\"",
            rest.len()
        ));
    }
    (ranges, lines)
}

/// Loss ranges the report's warnings list one by one.
pub const MAX_LOSS_LINES: usize = 20;
