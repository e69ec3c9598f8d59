//! The boot CPU's scheduler: round-robin over every VM's vCPUs with a fixed time slice. A vCPU
//! that executes HLT blocks until its virtual timer fires; when nothing is runnable the pCPU
//! idles (sampled as `[idle]`). Every switch is a scheduling event in the sample log (vCPU in,
//! vCPU out with the reason), so the analysis can place each vCPU on the common host-time axis.
//!
//! A vCPU that exits (exit port, EXIT hypercall) stops alone; the VM stops when its last vCPU
//! has, with vCPU 0's exit code. A fault, the budget, or a HLT nothing can end stops the whole VM.

use crate::tsc::rdtsc;
use crate::vm::{self, SliceEnd, Stop};
use crate::{println, profiler};
use alloc::vec::Vec;
use hvprof_vmx::caps::VmxCaps;

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Runnable,
    Halted,
    Stopped,
}

/// Runs every VM to its stop, `slice` TSC ticks at a time.
pub fn run_all(vms: &mut [vm::Vm], caps: &VmxCaps, slice: u64) {
    // (vm, vcpu) in round-robin order: vCPU 0 of every VM, then vCPU 1, ...
    let max = vms.iter().map(|v| v.vcpus.len()).max().unwrap_or(0);
    let slots: Vec<(usize, usize)> = (0..max)
        .flat_map(|c| (0..vms.len()).map(move |v| (v, c)))
        .filter(|&(v, c)| c < vms[v].vcpus.len())
        .collect();
    let mut state = alloc::vec![State::Runnable; slots.len()];
    // Why each vCPU stopped (vCPU 0's is the VM's exit code).
    let mut stops: Vec<Vec<Option<Stop>>> = vms
        .iter()
        .map(|v| v.vcpus.iter().map(|_| None).collect())
        .collect();
    let mut next = 0usize;
    for vm in vms.iter() {
        println!("vm {}: running ({} vCPUs)", vm.name, vm.vcpus.len());
    }
    loop {
        let now = rdtsc();
        for (s, st) in slots.iter().zip(state.iter_mut()) {
            let v = &mut vms[s.0].vcpus[s.1];
            if *st == State::Halted && v.wake_at.is_some_and(|t| t <= now) {
                v.wake_at = None;
                *st = State::Runnable;
            }
        }
        let pick = (0..slots.len())
            .map(|i| (next + i) % slots.len().max(1))
            .find(|&i| state[i] == State::Runnable);
        match pick {
            Some(i) => {
                next = i + 1;
                let (v, c) = slots[i];
                match vm::run_slice(&mut vms[v], c, caps, now.saturating_add(slice)) {
                    SliceEnd::Preempted => {}
                    SliceEnd::Halted => state[i] = State::Halted,
                    SliceEnd::Stopped(stop) => {
                        let whole_vm = !matches!(stop, Stop::Exited { .. });
                        stops[v][c] = Some(stop);
                        for (j, s) in slots.iter().enumerate() {
                            if s.0 == v && (whole_vm || j == i) {
                                state[j] = State::Stopped;
                            }
                        }
                        finish_if_done(vms, &slots, &state, &mut stops, v, whole_vm);
                    }
                }
            }
            None => {
                let wake = slots
                    .iter()
                    .zip(&state)
                    .filter(|(_, s)| **s == State::Halted)
                    .filter_map(|(s, _)| vms[s.0].vcpus[s.1].wake_at)
                    .min();
                match wake {
                    Some(t) => idle_until(t),
                    None => {
                        // Nothing runnable and nothing that could wake: the halted vCPUs are
                        // stuck for good.
                        let stuck: Vec<usize> = (0..slots.len())
                            .filter(|&j| state[j] == State::Halted)
                            .collect();
                        if stuck.is_empty() {
                            return;
                        }
                        for j in stuck {
                            let (v, c) = slots[j];
                            state[j] = State::Stopped;
                            stops[v][c] = Some(Stop::HaltedForever);
                            finish_if_done(vms, &slots, &state, &mut stops, v, true);
                        }
                    }
                }
            }
        }
        profiler::export::drain_if_full(profiler::this_cpu());
    }
}

/// Reports VM `v` once all its vCPUs have stopped: the stop that ended it (a whole-VM one), or
/// vCPU 0's.
fn finish_if_done(
    vms: &mut [vm::Vm],
    slots: &[(usize, usize)],
    state: &[State],
    stops: &mut [Vec<Option<Stop>>],
    v: usize,
    whole_vm: bool,
) {
    let done = slots
        .iter()
        .zip(state)
        .filter(|(s, _)| s.0 == v)
        .all(|(_, st)| *st == State::Stopped);
    if !done || stops[v].iter().all(Option::is_none) {
        return;
    }
    let stop = if whole_vm {
        stops[v].iter_mut().rev().find_map(Option::take)
    } else {
        stops[v][0]
            .take()
            .or_else(|| stops[v].iter_mut().find_map(Option::take))
    };
    if let Some(stop) = stop {
        for s in stops[v].iter_mut() {
            *s = None;
        }
        vm::finish(&mut vms[v], &stop);
    }
}

/// The idle loop: nothing to run until `t`. It polls the sampling deadline itself (it has nothing
/// else to do), so every deadline in idle time is sampled exactly on time, as `[idle]`, and
/// moves the ring on as it fills.
fn idle_until(t: u64) {
    let prof = profiler::this_cpu();
    prof.set_idle(true);
    loop {
        let now = rdtsc();
        if now >= t {
            break;
        }
        if now >= prof.next_tick() {
            prof.sample_host_if_due(idle_until as *const () as u64, true);
            profiler::export::drain_if_full(prof);
        }
        core::hint::spin_loop();
    }
    prof.set_idle(false);
}
