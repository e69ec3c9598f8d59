//! The common host-time axis (the paper's Key Technique 3, §3.5): each vCPU gets a virtual sample
//! stream on the host's time axis. At every sample taken on the pCPU the vCPU belongs to (the
//! pCPU of its latest "vCPU in"), while the vCPU exists, the vCPU either ran (its own guest
//! sample) or was blank. A blank slot is `[idle]` when the vCPU was out because it halted (its
//! last exit was HLT), else `[steal]`: `(on vcpuN)` when another vCPU of the same VM held the
//! pCPU (its guest, or the hypervisor handling its exits), `(hypervisor)` when the hypervisor
//! worked for no VM there (the scheduler between slices), `(outside)` otherwise (another VM, or
//! the hypervisor handling that VM's exits). The hypervisor's time on the vCPU's own exits while
//! it was in is `[steal] (hypervisor)` too, though the events count it as running. The exact
//! figures come from the scheduling events beside the sample-based ones.

use hvprof_samplelog::{Event, EventKind, OutReason};
use rustc_hash::FxHashMap as HashMap;

/// Who a sample belongs to: a vCPU's guest, the hypervisor (on behalf of a vCPU or not), idle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    Guest { vm: u16, vcpu: u16 },
    Hypervisor { vm: u16, vcpu: u16 },
    Idle,
}

/// What a vCPU's virtual stream holds besides its own samples.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Blanks {
    /// Slots while it was out halted.
    pub idle: u64,
    /// Slots while another vCPU of its VM held its pCPU, per that vCPU.
    pub steal_on: HashMap<u16, u64>,
    /// Every other blank slot while it was out.
    pub steal_outside: u64,
    /// Slots on its pCPU while it was in that are not its own: the hypervisor handling its exits.
    pub hypervisor: u64,
    /// Slots on its pCPU while it was out (not halted) in which the hypervisor worked for no VM.
    pub hypervisor_out: u64,
    /// Exact TSC ticks from the events: out halted, out otherwise (preempted), in.
    pub ticks_halted: u64,
    pub ticks_out: u64,
    pub ticks_in: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    In(u16),
    Out { pcpu: u16, halted: bool },
    Gone,
}

/// One vCPU's events in time order, with the pCPU each came from.
struct Track {
    events: Vec<(u64, u16, Event)>,
}

impl Track {
    /// The state just after the last event at or before `t` (`None`: not started yet).
    fn state_at(&self, t: u64, cursor: &mut usize) -> Option<State> {
        while *cursor < self.events.len() && self.events[*cursor].0 <= t {
            *cursor += 1;
        }
        let (_, pcpu, e) = self.events.get(cursor.checked_sub(1)?)?;
        Some(match (e.kind, e.reason) {
            (EventKind::VcpuIn, _) => State::In(*pcpu),
            (EventKind::VcpuOut, OutReason::Stopped) => State::Gone,
            (EventKind::VcpuOut, reason) => State::Out {
                pcpu: *pcpu,
                halted: reason == OutReason::Halted,
            },
        })
    }
}

/// What one slot of a vCPU's virtual stream holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// Its own guest sample.
    Own,
    /// On its pCPU while it was in, not its own: the hypervisor handling its exits.
    Hypervisor,
    /// Out, halted.
    Idle,
    /// Out, its pCPU held by vCPU N of the same VM.
    StealOn(u16),
    /// Out, its pCPU held by the hypervisor working for no VM (the scheduler).
    HypervisorOut,
    /// Out, anything else (another VM, or the hypervisor handling that VM's exits).
    StealOutside,
}

/// Classifies every slot of every vCPU's virtual stream. `samples`: per pCPU, (TSC, owner) in
/// TSC order; `events`: every scheduling event with its pCPU. `visit` gets the vCPU, the pCPU,
/// the index of the sample in that pCPU's list, and the slot.
pub fn classify(
    samples: &HashMap<u16, Vec<(u64, Owner)>>,
    events: &[(u16, Event)],
    mut visit: impl FnMut((u16, u16), u16, usize, Slot),
) {
    for (&key, track) in &tracks(events) {
        let (vm, vcpu) = key;
        for (&pcpu, list) in samples {
            let mut cursor = 0;
            for (i, &(t, owner)) in list.iter().enumerate() {
                let Some(state) = track.state_at(t, &mut cursor) else {
                    continue;
                };
                let own =
                    |o: Owner| matches!(o, Owner::Guest { vm: v, vcpu: c } if v == vm && c == vcpu);
                let slot = match state {
                    State::Gone => break,
                    State::In(p) if p != pcpu => continue,
                    State::In(_) if own(owner) => Slot::Own,
                    // Its pCPU, while it was in: the hypervisor handling its exit.
                    State::In(_) => Slot::Hypervisor,
                    State::Out { pcpu: p, .. } if p != pcpu => continue,
                    State::Out { halted: true, .. } => Slot::Idle,
                    // The pCPU held by a sibling vCPU: running its guest, or the hypervisor
                    // handling its exits.
                    State::Out { halted: false, .. } => match owner {
                        Owner::Guest { vm: v, vcpu: c } | Owner::Hypervisor { vm: v, vcpu: c }
                            if v == vm && c != vcpu =>
                        {
                            Slot::StealOn(c)
                        }
                        Owner::Hypervisor {
                            vm: hvprof_samplelog::NO_VM,
                            ..
                        } => Slot::HypervisorOut,
                        _ => Slot::StealOutside,
                    },
                };
                visit(key, pcpu, i, slot);
            }
        }
    }
}

/// Each vCPU's events in TSC order.
fn tracks(events: &[(u16, Event)]) -> HashMap<(u16, u16), Track> {
    let mut tracks: HashMap<(u16, u16), Track> = HashMap::default();
    for &(pcpu, e) in events {
        tracks
            .entry((e.vm, e.vcpu))
            .or_insert_with(|| Track { events: Vec::new() })
            .events
            .push((e.tsc, pcpu, e));
    }
    for track in tracks.values_mut() {
        track.events.sort_by_key(|(t, _, _)| *t);
    }
    tracks
}

/// Classifies every vCPU's blank slots. `samples`: per pCPU, (TSC, owner) in TSC order;
/// `events`: every scheduling event with its pCPU.
pub fn blanks(
    samples: &HashMap<u16, Vec<(u64, Owner)>>,
    events: &[(u16, Event)],
) -> HashMap<(u16, u16), Blanks> {
    let mut out: HashMap<(u16, u16), Blanks> = HashMap::default();
    for (&key, track) in &tracks(events) {
        let b = out.entry(key).or_default();
        // Exact time, from the events.
        for w in track.events.windows(2) {
            let span = w[1].0.saturating_sub(w[0].0);
            match (w[0].2.kind, w[0].2.reason) {
                (EventKind::VcpuIn, _) => b.ticks_in += span,
                (EventKind::VcpuOut, OutReason::Halted) => b.ticks_halted += span,
                (EventKind::VcpuOut, OutReason::Stopped) => {}
                (EventKind::VcpuOut, _) => b.ticks_out += span,
            }
        }
    }
    classify(samples, events, |key, _, _, slot| {
        let b = out.entry(key).or_default();
        match slot {
            Slot::Own => {}
            Slot::Hypervisor => b.hypervisor += 1,
            Slot::Idle => b.idle += 1,
            Slot::StealOn(c) => *b.steal_on.entry(c).or_default() += 1,
            Slot::HypervisorOut => b.hypervisor_out += 1,
            Slot::StealOutside => b.steal_outside += 1,
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(tsc: u64, vm: u16, vcpu: u16, kind: EventKind, reason: OutReason) -> (u16, Event) {
        (
            0,
            Event {
                tsc,
                kind,
                vm,
                vcpu,
                reason,
            },
        )
    }

    #[test]
    fn three_vms_round_robin_on_one_pcpu() {
        // Slices of 10 ticks: vm0, vm1, vm2, vm0, ...; a sample every tick owned by the runner.
        let mut events = Vec::new();
        let mut samples = Vec::new();
        for slice in 0..30u64 {
            let vm = (slice % 3) as u16;
            let start = slice * 10;
            events.push(ev(start, vm, 0, EventKind::VcpuIn, OutReason::Preempted));
            for t in start..start + 10 {
                samples.push((t, Owner::Guest { vm, vcpu: 0 }));
            }
            let reason = if slice >= 27 {
                OutReason::Stopped
            } else {
                OutReason::Preempted
            };
            events.push(ev(start + 10, vm, 0, EventKind::VcpuOut, reason));
        }
        let mut per: HashMap<u16, Vec<(u64, Owner)>> = HashMap::default();
        per.insert(0, samples);
        let b = blanks(&per, &events);
        for vm in 0..3u16 {
            let x = &b[&(vm, 0)];
            // Each VM: 100 own samples; blanks are the others' samples during its life.
            assert_eq!(x.idle, 0);
            assert!(x.steal_on.is_empty());
            let life_end = 280 + 10 * u64::from(vm);
            let blank = (life_end - 10 * u64::from(vm)) - 100;
            assert_eq!(x.steal_outside, blank, "vm {vm}");
            assert_eq!(x.ticks_in, 100);
        }
    }

    #[test]
    fn halted_and_sibling_vcpus() {
        // vCPU 0 and 1 of VM 0 share pCPU 0: 0 runs [0,10), 1 runs [10,20), 0 runs [20,30) then
        // halts [30,50), then stops.
        let events = vec![
            ev(0, 0, 0, EventKind::VcpuIn, OutReason::Preempted),
            ev(10, 0, 0, EventKind::VcpuOut, OutReason::Preempted),
            ev(10, 0, 1, EventKind::VcpuIn, OutReason::Preempted),
            ev(20, 0, 1, EventKind::VcpuOut, OutReason::Stopped),
            ev(20, 0, 0, EventKind::VcpuIn, OutReason::Preempted),
            ev(30, 0, 0, EventKind::VcpuOut, OutReason::Halted),
            ev(50, 0, 0, EventKind::VcpuIn, OutReason::Preempted),
            ev(51, 0, 0, EventKind::VcpuOut, OutReason::Stopped),
        ];
        let mut samples = Vec::new();
        for t in 0..50u64 {
            let owner = match t {
                0..10 | 20..30 => Owner::Guest { vm: 0, vcpu: 0 },
                10..20 => Owner::Guest { vm: 0, vcpu: 1 },
                _ => Owner::Idle,
            };
            samples.push((t, owner));
        }
        let mut per: HashMap<u16, Vec<(u64, Owner)>> = HashMap::default();
        per.insert(0, samples);
        let b = blanks(&per, &events);
        let v0 = &b[&(0, 0)];
        assert_eq!(v0.steal_on.get(&1), Some(&10));
        assert_eq!(v0.idle, 20);
        assert_eq!(v0.steal_outside, 0);
        assert_eq!((v0.ticks_in, v0.ticks_out, v0.ticks_halted), (21, 10, 20));
        let v1 = &b[&(0, 1)];
        assert_eq!(
            v1.steal_outside + v1.idle,
            0,
            "vCPU 1 is blank before it starts: not counted"
        );
    }

    #[test]
    fn two_pcpus_pinned_and_scheduler_time() {
        // vCPU 0 on pCPU 0 and vCPU 1 on pCPU 1, each in [0,10) and [12,20), out preempted in
        // [10,12) while its pCPU's scheduler works for no VM; pCPU 1's samples never count for
        // vCPU 0 and the other way round.
        let mut events = Vec::new();
        let mut per: HashMap<u16, Vec<(u64, Owner)>> = HashMap::default();
        for cpu in 0..2u16 {
            let e = |t, kind, reason| {
                let (_, e) = ev(t, 0, cpu, kind, reason);
                (cpu, e)
            };
            events.push(e(0, EventKind::VcpuIn, OutReason::Preempted));
            events.push(e(10, EventKind::VcpuOut, OutReason::Preempted));
            events.push(e(12, EventKind::VcpuIn, OutReason::Preempted));
            events.push(e(20, EventKind::VcpuOut, OutReason::Stopped));
            let samples = (0..20u64)
                .map(|t| {
                    let owner = match t {
                        10 | 11 => Owner::Hypervisor {
                            vm: hvprof_samplelog::NO_VM,
                            vcpu: 0xffff,
                        },
                        5 => Owner::Hypervisor { vm: 0, vcpu: cpu },
                        _ => Owner::Guest { vm: 0, vcpu: cpu },
                    };
                    (t, owner)
                })
                .collect();
            per.insert(cpu, samples);
        }
        let b = blanks(&per, &events);
        for cpu in 0..2u16 {
            let x = &b[&(0, cpu)];
            assert_eq!(x.hypervisor, 1, "its own exit, while in");
            assert_eq!(x.hypervisor_out, 2, "the scheduler, while out");
            assert_eq!(x.steal_outside, 0);
            assert!(x.steal_on.is_empty(), "the sibling runs on another pCPU");
            assert_eq!((x.ticks_in, x.ticks_out), (18, 2));
        }
    }
}
