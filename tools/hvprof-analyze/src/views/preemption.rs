//! `report --preemptions`: where each vCPU was when it lost its pCPU, weighted by the steal that
//! followed. A vCPU's time out while runnable (preempted at the end of its slice, or yielding)
//! is steal; the function of its last own guest sample before it went out says what it was
//! doing then. A lock holder preempted with the lock held shows as steal "preempted in" the
//! function of its critical section, while the vCPU that waits for it spins: the whole
//! machine's profile answers why the spinning lasted (lock-holder preemption).
//!
//! The events give each preemption's exact length (from the vCPU's "out" to its next "in");
//! the samples are read again in TSC order (`Profile::replay`) and each out event is given the
//! frame of the vCPU's latest guest sample before it (a vCPU in for less than a sampling period
//! resumed where its previous sample was, near enough); one with no sample before it at all is
//! `[no sample]`. Reading the samples again costs a second pass, so the view is asked for.

use anyhow::Result;
use hvprof_samplelog::{EventKind, OutReason};
use rustc_hash::FxHashMap as HashMap;
use serde::Serialize;

use crate::model::profile::Profile;
use crate::model::samples::{Sampled, What};

/// One place a vCPU was preempted in.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Place {
    pub function: String,
    pub module: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub process: String,
    /// Preemptions there, and the TSC ticks out that followed them.
    pub times: u64,
    pub ticks: u64,
    /// Share of the vCPU's preempted ticks.
    pub percent: f64,
}

/// One vCPU's preemptions.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct VcpuPreemptions {
    pub vm: String,
    pub vcpu: u16,
    /// Preemptions (and yields) that ended, and the ticks out they took.
    pub times: u64,
    pub ticks: u64,
    /// By place, most ticks first.
    pub places: Vec<Place>,
}

/// A vCPU's stretch out while runnable: from `out` to its next "in", `ticks` long.
#[derive(Clone, Copy)]
struct Out {
    tsc: u64,
    vcpu: (u16, u16),
    ticks: u64,
}

/// Each vCPU's ended preemptions, in TSC order.
fn outs(p: &Profile) -> Vec<Out> {
    let mut open: HashMap<(u16, u16), u64> = HashMap::default();
    let mut outs = Vec::new();
    for (_, e) in &p.events {
        let key = (e.vm, e.vcpu);
        match (e.kind, e.reason) {
            (EventKind::VcpuOut, OutReason::Preempted | OutReason::Yielded) => {
                open.insert(key, e.tsc);
            }
            (EventKind::VcpuOut, _) => {
                open.remove(&key);
            }
            (EventKind::VcpuIn, _) => {
                if let Some(t) = open.remove(&key) {
                    outs.push(Out {
                        tsc: t,
                        vcpu: key,
                        ticks: e.tsc.saturating_sub(t),
                    });
                }
            }
        }
    }
    outs.sort_by_key(|o| o.tsc);
    outs
}

/// Where every vCPU was preempted, per vCPU (those preempted at least once).
pub fn build(p: &Profile) -> Result<Vec<VcpuPreemptions>> {
    let outs = outs(p);
    if outs.is_empty() {
        return Ok(Vec::new());
    }
    let stacks = p.samples.stacks();
    // The vCPU's latest guest sample's frame (None: none since it last came in).
    let mut latest: HashMap<(u16, u16), Option<u32>> = HashMap::default();
    // Per vCPU, per frame (u32::MAX: no sample): preemptions and ticks.
    let mut tally: HashMap<(u16, u16), HashMap<u32, (u64, u64)>> = HashMap::default();
    let mut next = 0;
    let mut settle = |upto: u64, latest: &HashMap<(u16, u16), Option<u32>>, next: &mut usize| {
        while let Some(o) = outs.get(*next).filter(|o| o.tsc <= upto) {
            let frame = latest.get(&o.vcpu).copied().flatten().unwrap_or(u32::MAX);
            let t = tally.entry(o.vcpu).or_default().entry(frame).or_default();
            t.0 += 1;
            t.1 += o.ticks;
            *next += 1;
        }
    };
    p.replay(
        |run: &[Sampled], guest: &mut Vec<(u64, u16, u16, u32)>| {
            guest.clear();
            for s in run {
                let st = &stacks[s.stack as usize];
                if matches!(st.what, What::GuestKernel | What::GuestUser) {
                    guest.push((s.tsc, st.vm, st.vcpu, s.frame));
                }
            }
        },
        |guest| {
            for &(tsc, vm, vcpu, frame) in guest.iter() {
                // Out events before this sample are the state up to it.
                settle(tsc.saturating_sub(1), &latest, &mut next);
                latest.insert((vm, vcpu), Some(frame));
            }
            Ok(())
        },
    )?;
    settle(u64::MAX, &latest, &mut next);
    let mut out: Vec<VcpuPreemptions> = tally
        .into_iter()
        .map(|((vm, vcpu), by_frame)| {
            let times = by_frame.values().map(|t| t.0).sum();
            let ticks: u64 = by_frame.values().map(|t| t.1).sum();
            let mut merged: HashMap<(String, String, String), (u64, u64)> = HashMap::default();
            for (frame, (n, t)) in by_frame {
                let key = match p.frames.get(frame as usize) {
                    Some(f) => (f.function.clone(), f.module.clone(), f.process.clone()),
                    None => ("[no sample]".into(), String::new(), String::new()),
                };
                let m = merged.entry(key).or_default();
                m.0 += n;
                m.1 += t;
            }
            let mut places: Vec<Place> = merged
                .into_iter()
                .map(|((function, module, process), (n, t))| Place {
                    function,
                    module,
                    process,
                    times: n,
                    ticks: t,
                    percent: if ticks == 0 {
                        0.0
                    } else {
                        100.0 * t as f64 / ticks as f64
                    },
                })
                .collect();
            places.sort_by(|a, b| {
                b.ticks
                    .cmp(&a.ticks)
                    .then_with(|| a.function.cmp(&b.function))
                    .then_with(|| a.process.cmp(&b.process))
            });
            VcpuPreemptions {
                vm: p.vm_name(vm),
                vcpu,
                times,
                ticks,
                places,
            }
        })
        .collect();
    out.sort_by(|a, b| (a.vm.as_str(), a.vcpu).cmp(&(b.vm.as_str(), b.vcpu)));
    Ok(out)
}

/// The text view: per vCPU, its preemptions and the places, `top` rows each.
pub fn render(v: &[VcpuPreemptions], top: usize, hz: u64) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let ms = |t: u64| t as f64 * 1000.0 / hz.max(1) as f64;
    for c in v {
        let _ = writeln!(
            s,
            "\nPreempted in: VM {} vCPU {}: {} preemptions, {:.3} ms out (each weighted by the steal that followed)",
            c.vm,
            c.vcpu,
            c.times,
            ms(c.ticks)
        );
        let _ = writeln!(s, " %Steal     Times  Function  Module  Process");
        for p in c.places.iter().take(top) {
            let _ = writeln!(
                s,
                " {:>6.2}  {:>8}  {}  {}  {}",
                p.percent, p.times, p.function, p.module, p.process
            );
        }
        if c.places.len() > top {
            let _ = writeln!(s, "  ... {} more places (--top)", c.places.len() - top);
        }
    }
    s
}
