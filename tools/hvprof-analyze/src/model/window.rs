//! `--time START,END`: every view of a stretch of host time only, as `perf report --time` does.
//!
//! The stretch is given in seconds of host time, the unit `script` prints (the TSC divided by
//! the header's TSC frequency), either end left open: `--time 2.5,4`, `--time 2.5,`,
//! `--time ,4`. Samples outside it are left out where the capture is decoded (every view then
//! agrees); the scheduling events are cut to it (see [`clip_events`]), so each vCPU's exact
//! split is of the same stretch as its samples. Figures the hypervisor kept for the whole run
//! (exit statistics, the profiler's cost) stay whole-run figures.

use std::fmt;
use std::str::FromStr;

use hvprof_samplelog::{Event, EventKind, Item, OutReason, StreamDecoder};

/// A stretch of host time in seconds, as the user gave it (JSON: `{"from": s, "to": s}`, an
/// open end `null`).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct TimeRange {
    pub from: Option<f64>,
    pub to: Option<f64>,
}

impl FromStr for TimeRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (a, b) = s.split_once(',').ok_or_else(|| {
            format!("\"{s}\": expected START,END in seconds (either may be empty)")
        })?;
        let end = |v: &str, what: &str| -> Result<Option<f64>, String> {
            let v = v.trim();
            if v.is_empty() {
                return Ok(None);
            }
            match v.parse::<f64>() {
                Ok(x) if x.is_finite() && x >= 0.0 => Ok(Some(x)),
                _ => Err(format!(
                    "\"{s}\": the {what} \"{v}\" is not a number of seconds"
                )),
            }
        };
        let range = TimeRange {
            from: end(a, "start")?,
            to: end(b, "end")?,
        };
        if let (Some(f), Some(t)) = (range.from, range.to)
            && f >= t
        {
            return Err(format!("\"{s}\": the start must come before the end"));
        }
        Ok(range)
    }
}

impl fmt::Display for TimeRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let end = |v: Option<f64>| v.map(|x| format!("{x}")).unwrap_or_default();
        write!(f, "{},{}", end(self.from), end(self.to))
    }
}

impl TimeRange {
    /// In words: `from 2.5 s to 4 s`, `from 2.5 s to the end`, `from the start to 4 s`.
    #[must_use]
    pub fn describe(&self) -> String {
        let end = |v: Option<f64>, open: &str| v.map_or(open.to_owned(), |x| format!("{x} s"));
        format!(
            "from {} to {}",
            end(self.from, "the start"),
            end(self.to, "the end")
        )
    }

    /// The stretch in TSC ticks at `tsc_hz`.
    #[must_use]
    pub fn ticks(&self, tsc_hz: u64) -> Window {
        let tick = |s: f64| (s * tsc_hz as f64).round() as u64;
        Window {
            from: self.from.map_or(0, tick),
            to: self.to.map_or(u64::MAX, tick),
        }
    }
}

/// The host TSC stretch `from <= tsc < to` a profile is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub from: u64,
    pub to: u64,
}

impl Default for Window {
    fn default() -> Self {
        Self::ALL
    }
}

impl Window {
    /// The whole capture.
    pub const ALL: Window = Window {
        from: 0,
        to: u64::MAX,
    };

    /// Whether a record at `tsc` is in the stretch.
    #[inline]
    #[must_use]
    pub const fn contains(&self, tsc: u64) -> bool {
        tsc >= self.from && tsc < self.to
    }

    #[must_use]
    pub fn is_all(&self) -> bool {
        *self == Self::ALL
    }
}

/// The TSC frequency of the capture's first header frame (the unit of `--time`).
#[must_use]
pub fn tsc_hz(bytes: &[u8]) -> Option<u64> {
    let mut decoder = StreamDecoder::new();
    let mut hz = None;
    for chunk in bytes.chunks(1 << 16) {
        decoder.feed(chunk, &mut |item| {
            if let Item::Header { header, .. } = item
                && hz.is_none()
            {
                hz = Some(header.tsc_hz);
            }
        });
        if hz.is_some() {
            return hz.filter(|&h| h > 0);
        }
    }
    decoder.finish(&mut |item| {
        if let Item::Header { header, .. } = item
            && hz.is_none()
        {
            hz = Some(header.tsc_hz);
        }
    });
    hz.filter(|&h| h > 0)
}

/// The scheduling events (in TSC order, each with its pCPU) cut to `w`: each vCPU's state when
/// the stretch starts is an event at its start (the last one before it, moved there), the events
/// inside are kept, and a vCPU still there when a bounded stretch ends leaves at its end
/// (`Stopped`: nothing after it counts). Then a vCPU's exact time in, out and halted is of the
/// stretch alone, as its samples are.
#[must_use]
pub fn clip_events(events: Vec<(u16, Event)>, w: Window) -> Vec<(u16, Event)> {
    if w.is_all() {
        return events;
    }
    let mut before: std::collections::BTreeMap<(u16, u16), (u16, Event)> = Default::default();
    let mut inside = Vec::new();
    let mut last: std::collections::BTreeMap<(u16, u16), (u16, Event)> = Default::default();
    for (pcpu, e) in events {
        let key = (e.vm, e.vcpu);
        if e.tsc < w.from {
            before.insert(key, (pcpu, e));
        } else if e.tsc < w.to {
            last.insert(key, (pcpu, e));
            inside.push((pcpu, e));
        }
    }
    let mut out: Vec<(u16, Event)> = before
        .into_iter()
        .filter(|(_, (_, e))| !(e.kind == EventKind::VcpuOut && e.reason == OutReason::Stopped))
        .map(|(key, (pcpu, e))| {
            last.entry(key).or_insert((pcpu, e));
            (pcpu, Event { tsc: w.from, ..e })
        })
        .collect();
    out.extend(inside);
    if w.to != u64::MAX {
        for (pcpu, e) in last.into_values() {
            if !(e.kind == EventKind::VcpuOut && e.reason == OutReason::Stopped) {
                out.push((
                    pcpu,
                    Event {
                        tsc: w.to,
                        kind: EventKind::VcpuOut,
                        reason: OutReason::Stopped,
                        ..e
                    },
                ));
            }
        }
    }
    crate::model::merge::sort_events(&mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(tsc: u64, vcpu: u16, kind: EventKind, reason: OutReason) -> (u16, Event) {
        (
            0,
            Event {
                tsc,
                kind,
                vm: 0,
                vcpu,
                reason,
            },
        )
    }

    #[test]
    fn ranges_parse_with_open_ends_and_refuse_nonsense() {
        let r = |s: &str| s.parse::<TimeRange>();
        assert_eq!(
            r("1.5,2").unwrap(),
            TimeRange {
                from: Some(1.5),
                to: Some(2.0)
            }
        );
        assert_eq!(r(",2").unwrap().from, None);
        assert_eq!(r("1,").unwrap().to, None);
        for bad in ["", "1", "2,1", "1,1", "x,2", "-1,2", "1,inf", "nan,"] {
            assert!(r(bad).is_err(), "{bad:?} was taken");
        }
        let w = r("0.5,1.5").unwrap().ticks(1_000_000_000);
        assert_eq!((w.from, w.to), (500_000_000, 1_500_000_000));
        assert!(w.contains(500_000_000) && !w.contains(1_500_000_000));
        assert!(r(",").unwrap().ticks(1000).is_all());
    }

    #[test]
    fn events_are_cut_to_the_stretch() {
        use EventKind::{VcpuIn, VcpuOut};
        use OutReason::{Halted, Preempted, Stopped};
        let events = vec![
            ev(0, 0, VcpuIn, Preempted),
            ev(0, 1, VcpuOut, Preempted),
            ev(10, 0, VcpuOut, Halted),
            ev(10, 1, VcpuIn, Preempted),
            ev(30, 1, VcpuOut, Preempted),
            ev(30, 0, VcpuIn, Preempted),
            ev(50, 0, VcpuOut, Stopped),
            ev(50, 1, VcpuOut, Stopped),
        ];
        let w = Window { from: 20, to: 40 };
        let got = clip_events(events.clone(), w);
        let want = vec![
            ev(20, 0, VcpuOut, Halted),
            ev(20, 1, VcpuIn, Preempted),
            ev(30, 1, VcpuOut, Preempted),
            ev(30, 0, VcpuIn, Preempted),
            ev(40, 0, VcpuOut, Stopped),
            ev(40, 1, VcpuOut, Stopped),
        ];
        assert_eq!(got, want);
        // A vCPU stopped before the stretch is not in it; the whole capture is left as it is.
        assert!(clip_events(events.clone(), Window { from: 60, to: 70 }).is_empty());
        assert_eq!(clip_events(events.clone(), Window::ALL), events);
        // An open end keeps the events after the last one inside.
        let open = clip_events(
            events,
            Window {
                from: 20,
                to: u64::MAX,
            },
        );
        assert_eq!(open.last(), Some(&ev(50, 1, VcpuOut, Stopped)));
    }
}
