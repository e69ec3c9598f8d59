//! The boot CPU's scheduler: round-robin over the VMs' vCPUs with a fixed time slice. A vCPU
//! that executes HLT blocks until its virtual timer fires; when nothing is runnable the pCPU
//! idles (sampled as `[idle]`). Every switch is a scheduling event in the sample log (vCPU in,
//! vCPU out with the reason), so the analysis can place each vCPU on the common host-time axis.

use crate::tsc::rdtsc;
use crate::vm::{self, SliceEnd, Stop, Vm};
use crate::{println, profiler};
use hvprof_vmx::caps::VmxCaps;

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Runnable,
    Halted,
    Stopped,
}

/// Runs every VM to its stop, `slice` TSC ticks at a time.
pub fn run_all(vms: &mut [vm::Vm], caps: &VmxCaps, slice: u64) {
    let mut state = alloc::vec![State::Runnable; vms.len()];
    let mut next = 0usize;
    for vm in vms.iter() {
        println!("vm {}: running", vm.name);
    }
    loop {
        let now = rdtsc();
        // Wake halted vCPUs whose timer has fired.
        for (vm, st) in vms.iter_mut().zip(state.iter_mut()) {
            if *st == State::Halted && vm.wake_at.is_some_and(|t| t <= now) {
                vm.wake_at = None;
                *st = State::Runnable;
            }
        }
        let pick = (0..vms.len())
            .map(|i| (next + i) % vms.len().max(1))
            .find(|&i| state[i] == State::Runnable);
        match pick {
            Some(i) => {
                next = i + 1;
                let end = run(&mut vms[i], caps, now.saturating_add(slice));
                match end {
                    SliceEnd::Preempted => {}
                    SliceEnd::Halted => state[i] = State::Halted,
                    SliceEnd::Stopped(stop) => {
                        state[i] = State::Stopped;
                        vm::finish(&mut vms[i], &stop);
                    }
                }
            }
            None => {
                let wake = vms
                    .iter()
                    .zip(&state)
                    .filter(|(_, s)| **s == State::Halted)
                    .filter_map(|(v, _)| v.wake_at)
                    .min();
                match wake {
                    Some(t) => idle_until(t),
                    None => {
                        // Nothing runnable and nothing that could wake: the halted vCPUs are
                        // stuck for good.
                        let mut any = false;
                        for (vm, st) in vms.iter_mut().zip(state.iter_mut()) {
                            if *st == State::Halted {
                                *st = State::Stopped;
                                vm::finish(vm, &Stop::HaltedForever);
                                any = true;
                            }
                        }
                        if !any {
                            return;
                        }
                    }
                }
            }
        }
        profiler::export::drain_if_full(profiler::this_cpu());
    }
}

fn run(vm: &mut Vm, caps: &VmxCaps, slice_end: u64) -> SliceEnd {
    vm::run_slice(vm, caps, slice_end)
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
