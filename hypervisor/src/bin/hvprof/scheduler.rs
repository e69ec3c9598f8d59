//! The scheduler. Every pCPU in VMX operation runs [`run_cpu`], which takes vCPUs from one run
//! queue shared by all pCPUs: round-robin with a fixed time slice, each pCPU taking only the
//! vCPUs pinned to it (`pin=`) or free to move. More vCPUs than pCPUs is fine (overcommit).
//!
//! A vCPU that executes HLT blocks until its virtual timer fires; a pCPU with nothing it may run
//! idles (sampled as `[idle]`). Every switch is a scheduling event in that pCPU's sample log
//! (vCPU in, vCPU out with the reason), so the analysis can place each vCPU on the common
//! host-time axis.
//!
//! A vCPU that exits (exit port, EXIT hypercall) stops alone; the VM stops when its last vCPU
//! has, with vCPU 0's exit code. A fault, the budget, or a HLT nothing can end stops the whole
//! VM: its vCPUs running on other pCPUs stop before their next VM entry.
//!
//! The queue's lock is held only to pick a vCPU and to record how its slice ended, never while a
//! guest runs or while anything is printed.

use crate::percpu::MAX_CPUS;
use crate::run::{self, SliceEnd};
use crate::tsc::rdtsc;
use crate::vm::{self, Stop, Vm};
use crate::{println, profiler};
use alloc::vec::Vec;
use core::sync::atomic::Ordering;
use hvprof_hypervisor::vm_config::Ple;
use hvprof_vmx::caps::VmxCaps;
use spin::{Mutex, Once};

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Runnable,
    /// A pCPU runs it now.
    Running,
    Halted,
    /// An application processor that no start-up IPI has started yet: it never runs, and its
    /// time is neither steal nor idle of its own.
    WaitForSipi,
    Stopped,
}

/// One vCPU in the run queue.
struct Slot {
    vm: usize,
    vcpu: usize,
    /// The pCPU it is pinned to, if any.
    pin: Option<usize>,
    state: State,
    /// When its virtual timer wakes it (Halted only).
    wake_at: Option<u64>,
    /// TSC ticks it ran beyond the ends of its slices, when more than an eighth of a slice (an
    /// exit that took long: a slice ends only between exits), paid back by shorter slices and
    /// skipped turns, so that a guest whose exits are long does not take the pCPU from the others.
    debt: u64,
}

impl Slot {
    /// Whether pCPU `cpu` may run it now: runnable, and pinned to `cpu` or free to move.
    fn runnable_on(&self, cpu: usize) -> bool {
        self.state == State::Runnable && self.pin.is_none_or(|p| p == cpu)
    }
}

struct Queue {
    slots: Vec<Slot>,
    /// Per pCPU: the slot after the one it picked last (round-robin).
    next: [usize; MAX_CPUS],
    /// Per pCPU: the slot its next pick takes first if it can run there (a directed yield).
    prefer: [Option<usize>; MAX_CPUS],
    /// Per VM: the stop that ended it as a whole (the first one wins).
    vm_stop: Vec<Option<Stop>>,
    /// Per VM and vCPU: why that vCPU stopped alone.
    vcpu_stop: Vec<Vec<Option<Stop>>>,
    /// Per VM: its report was printed.
    finished: Vec<bool>,
}

/// What every pCPU's scheduler works on.
struct Machine {
    vms: &'static [Vm],
    caps: &'static VmxCaps,
    slice: u64,
    pcpus: usize,
}

static MACHINE: Once<Machine> = Once::new();
static QUEUE: Mutex<Option<Queue>> = Mutex::new(None);

/// Sets up the run queue: vCPU 0 of every VM, then vCPU 1, ... Call once, on the boot CPU,
/// before any pCPU calls `run_cpu`.
pub fn setup(vms: &'static [Vm], caps: &'static VmxCaps, slice: u64, pcpus: usize) {
    let max = vms.iter().map(|v| v.vcpus.len()).max().unwrap_or(0);
    let slots = (0..max)
        .flat_map(|c| (0..vms.len()).map(move |v| (v, c)))
        .filter(|&(v, c)| c < vms[v].vcpus.len())
        .map(|(v, c)| Slot {
            vm: v,
            vcpu: c,
            pin: vms[v].pin.and_then(|p| p.get(c)).map(usize::from),
            state: if vms[v].apic && c > 0 {
                State::WaitForSipi
            } else {
                State::Runnable
            },
            wake_at: None,
            debt: 0,
        })
        .collect();
    let now = rdtsc();
    for vm in vms {
        vm.wall_deadline
            .store(now.saturating_add(vm.wall_budget), Ordering::Relaxed);
        println!("vm {}: running ({} vCPUs)", vm.name, vm.vcpus.len());
    }
    *QUEUE.lock() = Some(Queue {
        slots,
        next: [0; MAX_CPUS],
        prefer: [None; MAX_CPUS],
        vm_stop: vms.iter().map(|_| None).collect(),
        vcpu_stop: vms
            .iter()
            .map(|v| v.vcpus.iter().map(|_| None).collect())
            .collect(),
        finished: alloc::vec![false; vms.len()],
    });
    MACHINE.call_once(|| Machine {
        vms,
        caps,
        slice,
        pcpus,
    });
}

/// What a pCPU does next.
enum Next {
    /// Run queue slot `slot`: vCPU `vcpu` of VM `vm`, pinned or free to move.
    Run {
        slot: usize,
        vm: usize,
        vcpu: usize,
        pinned: bool,
        /// The slice's length, TSC ticks (shorter while the vCPU pays back a debt).
        len: u64,
    },
    Idle(u64),
    Done,
}

/// This pCPU's scheduler: runs vCPUs until every vCPU of every VM has stopped.
pub fn run_cpu(cpu: usize) {
    let Some(m) = MACHINE.get() else {
        return;
    };
    // Another pCPU can make a vCPU runnable for this one at any time (a free vCPU preempted
    // there): an idle pCPU looks at the queue again this often.
    let poll = (m.slice / 8).max(1);
    let prof = profiler::this_cpu();
    // Between slices the scheduler's own work is hypervisor time, sampled by the LAPIC timer like
    // any other (`run_slice` switches to the VMX-preemption timer for the guest and back).
    prof.arm_host_clock();
    x86_64::instructions::interrupts::enable();
    loop {
        let now = rdtsc();
        let (next, done) = {
            let mut guard = QUEUE.lock();
            let Some(q) = guard.as_mut() else {
                return;
            };
            pick(q, m, cpu, now, poll)
        };
        for (v, stop) in done {
            vm::report::finish(&m.vms[v], &stop);
        }
        match next {
            Next::Done => return,
            Next::Idle(until) => idle_until(until),
            Next::Run {
                slot,
                vm: v,
                vcpu: c,
                pinned,
                len,
            } => {
                let vm = &m.vms[v];
                // A vCPU free to move gives its VMCS up at the end of the slice when another
                // pCPU could take it next.
                let release = !pinned && m.pcpus > 1;
                let slice_end = rdtsc().saturating_add(len);
                let (end, wake_at) = {
                    let mut vcpu = vm.vcpus[c].lock();
                    let end = run::run_slice(vm, &mut vcpu, cpu, release, m.caps, slice_end);
                    // The virtual timer belongs to the vCPU until it halts: a slice that ends
                    // otherwise keeps it armed for the HLT to come.
                    let wake_at = match end {
                        SliceEnd::Halted => vcpu.wake_at.take(),
                        _ => None,
                    };
                    (end, wake_at)
                };
                prof.arm_host_clock();
                x86_64::instructions::interrupts::enable();
                let done = {
                    let mut guard = QUEUE.lock();
                    let q = guard.as_mut().expect("set up");
                    // An overrun within an eighth of a slice is the ordinary end of a slice
                    // (the exit it ended at, the VMCS handed over): forgiven.
                    let over = rdtsc().saturating_sub(slice_end);
                    if matches!(end, SliceEnd::Preempted) && over > m.slice / 8 {
                        let s = &mut q.slots[slot];
                        s.debt = s.debt.saturating_add(over);
                    }
                    if matches!(end, SliceEnd::Yielded) && vm.ple == Ple::Directed {
                        q.prefer[cpu] = preempted_sibling(q, vm, slot, cpu);
                    }
                    slice_ended(q, m, slot, end, wake_at)
                };
                if let Some((v, stop)) = done {
                    vm::report::finish(&m.vms[v], &stop);
                }
            }
        }
        profiler::export::drain_if_full(prof);
        crate::console::pump();
    }
}

/// Stops the vCPUs pinned to `cpu`, which cannot run them (it could not enter VMX operation).
pub fn cpu_unavailable(cpu: usize, why: &str) {
    let Some(m) = MACHINE.get() else {
        return;
    };
    let done = {
        let mut guard = QUEUE.lock();
        let Some(q) = guard.as_mut() else {
            return;
        };
        let pinned: Vec<usize> = (0..q.slots.len())
            .filter(|&i| q.slots[i].pin == Some(cpu) && q.slots[i].state != State::Stopped)
            .collect();
        let mut done = Vec::new();
        for i in pinned {
            q.slots[i].state = State::Running;
            let stop = Stop::Fault(alloc::format!("its pCPU {cpu} is unavailable: {why}"));
            done.extend(slice_ended(q, m, i, SliceEnd::Stopped(stop), None));
        }
        done
    };
    for (v, stop) in done {
        vm::report::finish(&m.vms[v], &stop);
    }
}

/// Chooses what pCPU `cpu` does next; also returns the VMs that stopped for good (all their
/// vCPUs halted with nothing to wake them), to be reported outside the lock.
fn pick(q: &mut Queue, m: &Machine, cpu: usize, now: u64, poll: u64) -> (Next, Vec<(usize, Stop)>) {
    let mut done = Vec::new();
    for s in q.slots.iter_mut() {
        let vm = &m.vms[s.vm];
        match s.state {
            // Its timer, or another vCPU's IPI (a kick), wakes a halted vCPU.
            State::Halted if s.wake_at.is_some_and(|t| t <= now) || vm.take_kick(s.vcpu) => {
                s.wake_at = None;
                s.state = State::Runnable;
            }
            // A SIPI starts one that waits for it.
            State::WaitForSipi if vm.sipi_pending(s.vcpu) => {
                vm.take_kick(s.vcpu);
                s.state = State::Runnable;
            }
            _ => {}
        }
    }
    // A VM whose wall budget ran out stops even if its vCPUs only wait (a timer armed for the
    // end of time must not hold the machine): its halted vCPUs stop now, its running ones at
    // their next VM entry.
    for i in 0..q.slots.len() {
        let v = q.slots[i].vm;
        if matches!(q.slots[i].state, State::Halted | State::WaitForSipi)
            && now >= m.vms[v].wall_deadline.load(Ordering::Relaxed)
        {
            q.slots[i].state = State::Running;
            done.extend(slice_ended(
                q,
                m,
                i,
                SliceEnd::Stopped(Stop::WallBudget),
                None,
            ));
        }
    }
    if q.slots.iter().all(|s| s.state == State::Stopped) {
        return (Next::Done, done);
    }
    let n = q.slots.len();
    let mine = |s: &Slot| s.pin.is_none_or(|p| p == cpu);
    let candidates = || {
        (0..n)
            .map(|k| (q.next[cpu] + k) % n)
            .filter(|&i| q.slots[i].runnable_on(cpu))
    };
    // A directed yield's target first, when it is still runnable here; else round-robin,
    // except that a vCPU owing a whole slice or more gives its turn to the next one (and owes a
    // slice less), as long as another one can run.
    let slice = m.slice;
    let directed = q.prefer[cpu]
        .take()
        .filter(|&i| q.slots[i].runnable_on(cpu));
    let chosen = if directed.is_some() {
        directed
    } else {
        let round_robin = candidates().next().map(|first| {
            candidates()
                .find(|&i| q.slots[i].debt < slice)
                .unwrap_or(first)
        });
        if let Some(i) = round_robin {
            // Those passed over on the way to it (all owing a slice) have paid one.
            let start = q.next[cpu];
            for k in (0..n).map(|k| (start + k) % n).take_while(|&k| k != i) {
                let s = &mut q.slots[k];
                if s.runnable_on(cpu) {
                    s.debt -= slice;
                }
            }
            q.next[cpu] = i + 1;
        }
        round_robin
    };
    if let Some(i) = chosen {
        let s = &mut q.slots[i];
        s.state = State::Running;
        // What it still owes comes off this slice (which keeps an eighth at least).
        let len = slice.saturating_sub(s.debt).max(slice / 8);
        s.debt = s.debt.saturating_sub(slice - len);
        if directed.is_some() {
            // A turn out of order: it owes one, and so gives its next turn in the round up, so
            // that a directed yield changes who runs first, not who runs most.
            s.debt = s.debt.saturating_add(slice);
        }
        let next = Next::Run {
            slot: i,
            vm: s.vm,
            vcpu: s.vcpu,
            pinned: s.pin.is_some(),
            len,
        };
        return (next, done);
    }
    let active = q
        .slots
        .iter()
        .any(|s| matches!(s.state, State::Runnable | State::Running));
    let wake = q
        .slots
        .iter()
        .filter(|s| s.state == State::Halted)
        .filter_map(|s| s.wake_at)
        .min();
    if !active && wake.is_none() {
        // Nothing runs and nothing can wake: the halted vCPUs are stuck for good.
        let stuck: Vec<usize> = (0..n)
            .filter(|&i| matches!(q.slots[i].state, State::Halted | State::WaitForSipi))
            .collect();
        for i in stuck {
            q.slots[i].state = State::Running;
            done.extend(slice_ended(
                q,
                m,
                i,
                SliceEnd::Stopped(Stop::HaltedForever),
                None,
            ));
        }
        return (Next::Idle(now), done);
    }
    // Idle until the next wake-up this pCPU could take, looking again after `poll` when another
    // pCPU is at work (it may leave something runnable here).
    let my_wake = q
        .slots
        .iter()
        .filter(|s| s.state == State::Halted && mine(s))
        .filter_map(|s| s.wake_at)
        .min();
    let until = match (my_wake, m.pcpus > 1) {
        (Some(t), false) => t,
        (Some(t), true) => t.min(now.saturating_add(poll)),
        (None, _) => now.saturating_add(poll),
    };
    (Next::Idle(until), done)
}

/// The vCPU a directed yield of slot `i` on pCPU `cpu` goes to: another vCPU of the same VM that
/// lost its pCPU while runnable (preempted) and may run on `cpu`. First one an interrupt waits
/// for (the IPI the spinner likely waits to see taken: KVM boosts such a vCPU too, its `ready`
/// flag), else any (the lock holder, likely); each time the first after `i` in the queue's order,
/// as KVM's `kvm_vcpu_on_spin` takes the candidates after the spinner in turn.
fn preempted_sibling(q: &Queue, vm: &Vm, i: usize, cpu: usize) -> Option<usize> {
    let n = q.slots.len();
    let siblings = || {
        (1..n)
            .map(move |k| (i + k) % n)
            .filter(move |&j| q.slots[j].vm == q.slots[i].vm && q.slots[j].runnable_on(cpu))
    };
    siblings()
        .find(|&j| vm.kicked(q.slots[j].vcpu))
        .or_else(|| siblings().next())
}

/// Records how slot `i`'s slice ended; returns its VM and the VM's stop when that was the VM's
/// last running vCPU.
fn slice_ended(
    q: &mut Queue,
    m: &Machine,
    i: usize,
    end: SliceEnd,
    wake_at: Option<u64>,
) -> Option<(usize, Stop)> {
    let (v, c) = (q.slots[i].vm, q.slots[i].vcpu);
    let vm = &m.vms[v];
    match end {
        SliceEnd::Preempted | SliceEnd::Yielded => q.slots[i].state = State::Runnable,
        SliceEnd::Halted => {
            q.slots[i].state = State::Halted;
            // A halted vCPU's wake-up never lies beyond its VM's wall deadline.
            let end = vm.wall_deadline.load(Ordering::Relaxed);
            q.slots[i].wake_at = wake_at.map(|t| t.min(end));
        }
        SliceEnd::Stopped(stop) => {
            q.slots[i].state = State::Stopped;
            match stop {
                Stop::WithVm => {}
                // A whole machine's exit (port 0xf4, power-off) ends it, whichever vCPU did it.
                Stop::Exited { .. } if vm.machine_exit => {
                    vm.stopping.store(true, Ordering::Release);
                    if q.vm_stop[v].is_none() {
                        q.vm_stop[v] = Some(stop);
                    }
                }
                Stop::Exited { .. } => q.vcpu_stop[v][c] = Some(stop),
                _ => {
                    vm.stopping.store(true, Ordering::Release);
                    if q.vm_stop[v].is_none() {
                        q.vm_stop[v] = Some(stop);
                    }
                }
            }
        }
    }
    if vm.stopping.load(Ordering::Acquire) {
        // The whole VM stops: its vCPUs that no pCPU runs stop now, the running ones at their
        // next VM entry.
        for s in q.slots.iter_mut().filter(|s| s.vm == v) {
            if s.state != State::Running {
                s.state = State::Stopped;
            }
        }
    }
    let all_stopped = q
        .slots
        .iter()
        .filter(|s| s.vm == v)
        .all(|s| s.state == State::Stopped);
    if !all_stopped || q.finished[v] {
        return None;
    }
    q.finished[v] = true;
    let stop = q.vm_stop[v]
        .take()
        .or_else(|| q.vcpu_stop[v][0].take())
        .or_else(|| q.vcpu_stop[v].iter_mut().find_map(Option::take))?;
    Some((v, stop))
}

/// The idle loop: nothing to run until `t`. The pCPU halts until the LAPIC timer wakes it at the
/// next sampling deadline or at `t` (it spins where there is no LAPIC timer), so every deadline
/// in idle time is sampled on time, as `[idle]`; between halts it moves the ring and the console
/// on.
fn idle_until(t: u64) {
    let prof = profiler::this_cpu();
    prof.set_idle(true);
    loop {
        let now = rdtsc();
        // A kick: another pCPU made something runnable here (an IPI to a halted vCPU).
        if now >= t || prof.take_kicked() {
            break;
        }
        if now >= prof.next_tick() {
            let fp = profiler::sampler::frame_pointer();
            prof.sample_host_if_due(idle_until as *const () as u64, fp, true);
        }
        // The LAPIC timer may have taken the sample instead: move the ring on either way.
        profiler::export::drain_if_full(prof);
        crate::console::pump();
        prof.halt_until(t);
    }
    prof.set_idle(false);
}
