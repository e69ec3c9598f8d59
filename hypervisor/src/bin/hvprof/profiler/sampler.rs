//! One pCPU's profiler: its state (every field atomic: the run loop, the timer interrupt and the
//! PMU's NMI of the same pCPU share it), and its samples: the guest's at VM exits, the
//! hypervisor's from the timer, with their call chains. The path's core (the deadline clock, the
//! push into the ring, the path's own cost) is `hvprof_hypervisor::profiler::sample_path`,
//! host-tested, given the real processor here (`Cpu`).

use crate::arch::host_apic::Lapic;
use crate::percpu::MAX_CPUS;
use crate::tsc::rdtsc;
use core::mem::MaybeUninit;
use core::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use hvprof_hypervisor::guest_ram::GuestRam;
pub use hvprof_hypervisor::profiler::costs::{BudgetUse, Costs, Tally};
pub use hvprof_hypervisor::profiler::guest_chain::KernelStacks;
use hvprof_hypervisor::profiler::guest_chain::{GuestAt, GuestChains};
use hvprof_hypervisor::profiler::guest_sample;
use hvprof_hypervisor::profiler::kicks::KickState;
use hvprof_hypervisor::profiler::ring::Ring;
pub use hvprof_hypervisor::profiler::sample_path::GuestSampled;
use hvprof_hypervisor::profiler::sample_path::{Irqs, Processor, SamplePath};
use hvprof_hypervisor::profiler::stack_walk::{self, Bounds, FrameMemory};
use hvprof_hypervisor::profiler::table_walk::{KERNEL_WALK_READS, USER_WALK_READS};
use hvprof_linux_walk::UnwindTable;
use hvprof_samplelog::{
    Chain, ChainEnd, Event, EventKind, MAX_CHAIN_DEPTH, NO_EXIT, NO_VCPU, NO_VM, OutReason,
    PcpuCost, Record, Sample, SampleKind,
};
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::vmcs::{Guest32, GuestNatural};

pub use hvprof_hypervisor::profiler::slots::Slot;

/// Deepest call chain samples carry (`stacks=`; 0: none).
static STACK_DEPTH: AtomicU8 = AtomicU8::new(0);

/// Sets the depth of the call chains samples carry (0: none), before sampling starts.
pub fn set_stack_depth(depth: u8) {
    STACK_DEPTH.store(depth.min(MAX_CHAIN_DEPTH as u8), Ordering::Relaxed);
}

fn stack_depth() -> usize {
    usize::from(STACK_DEPTH.load(Ordering::Relaxed))
}

/// This function's frame pointer (the hypervisor is built with frame pointers: `.cargo/config`).
#[inline(always)]
pub fn frame_pointer() -> u64 {
    let fp: u64;
    // SAFETY: reads a register; no memory is touched.
    unsafe {
        core::arch::asm!("mov {}, rbp", out(reg) fp, options(nomem, nostack, preserves_flags))
    };
    fp
}

pub const RING_RECORDS: usize = 4096;
pub const TASK_RECORDS: usize = 256;

/// A pCPU's rings, apart from its `CpuProfiler`: all zero at start, so that they take no room
/// in the hypervisor's file (`.bss`). Inside the profilers, whose sentinels (`u64::MAX`, ...)
/// put them in `.data`, they made the file 4.5 MB larger, and a loader copies a file byte by
/// byte (GRUB: 11 instructions a byte in Bochs, 50 M instructions at every boot).
pub struct Rings {
    /// Samples and events, on their way to the export.
    pub samples: Ring<Slot, RING_RECORDS>,
    /// Task changes of Linux guests read at samples (rare: only when the task differs).
    pub tasks: Ring<hvprof_samplelog::Task, TASK_RECORDS>,
}

/// Every pCPU's rings, indexed by pCPU number.
static RINGS: [Rings; MAX_CPUS] = [const {
    Rings {
        samples: Ring::new(),
        tasks: Ring::new(),
    }
}; MAX_CPUS];

/// This pCPU's profiler state. Shared between the run loop and the timer/NMI handlers of the
/// same CPU, so every field is atomic. Its size is a power of two (the alignment), so that the
/// pCPU number of a profiler (`pcpu`, which finds its rings on the sample path) is a shift.
#[repr(align(8192))]
pub struct CpuProfiler {
    /// The sample path: the deadline clock (the one place that decides a deadline sample is
    /// due), the path's own cost, and the ring's producer (`SamplePath`).
    sampling: SamplePath,
    /// (vm, vcpu, vpid, last exit reason) of what this pCPU runs, packed in 16-bit fields.
    current: AtomicU64,
    lapic: spin::Once<Lapic>,
    /// This pCPU runs its idle loop.
    idle: AtomicBool,
    /// This pCPU is halted until its UART has sent what the console gave it
    /// (`halt_for_console`): its samples are `[idle]` too, as the CPU does nothing.
    console_wait: AtomicBool,
    /// What profiling cost this pCPU beyond the sample path itself.
    pub costs: Costs,
    /// TSC when sampling started and stopped on this pCPU (the span the costs are shares of).
    started_at: AtomicU64,
    stopped_at: AtomicU64,
    /// This pCPU's stack, `[lo, hi)`: where the hypervisor's frame records may lie.
    stack_lo: AtomicU64,
    stack_hi: AtomicU64,
    /// The guest this pCPU runs, as its walks see it (its memory, how its kernel-mode chains
    /// are walked, its RBP at its last exit) and the walks' caches.
    chains: GuestChains,
    /// Kicks for this pCPU (`kick_cpu`, `on_kick`), and kicks it sent others.
    pub kicks: KickState,
    pub kicks_sent: AtomicU64,
}

impl CpuProfiler {
    pub const fn new() -> Self {
        CpuProfiler {
            sampling: SamplePath::new(),
            current: AtomicU64::new(pack(NO_VM, NO_VCPU, 0, NO_EXIT)),
            lapic: spin::Once::new(),
            kicks: KickState::new(),
            kicks_sent: AtomicU64::new(0),
            idle: AtomicBool::new(false),
            console_wait: AtomicBool::new(false),
            costs: Costs::new(KERNEL_WALK_READS, USER_WALK_READS),
            started_at: AtomicU64::new(0),
            stopped_at: AtomicU64::new(0),
            stack_lo: AtomicU64::new(0),
            stack_hi: AtomicU64::new(0),
            chains: GuestChains::new(),
        }
    }
}

impl Default for CpuProfiler {
    fn default() -> Self {
        Self::new()
    }
}

const fn pack(vm: u16, vcpu: u16, vpid: u16, exit: u16) -> u64 {
    (vm as u64) | (vcpu as u64) << 16 | (vpid as u64) << 32 | (exit as u64) << 48
}

const _: () =
    assert!(core::mem::size_of::<CpuProfiler>().is_power_of_two() && MAX_CPUS.is_power_of_two());

/// Every pCPU's profiler, indexed by pCPU number.
static CPUS: [CpuProfiler; MAX_CPUS] = [const { CpuProfiler::new() }; MAX_CPUS];

/// Each VM's unwind tables for its programs built without frame pointers (`unwind=`), by VM
/// index: set once, before any vCPU runs, never changed.
static UNWIND_TABLES: spin::Once<alloc::vec::Vec<&'static [UnwindTable<'static>]>> =
    spin::Once::new();

/// Gives the walks every VM's unwind tables (by VM index), once, before the VMs run.
pub fn set_unwind_tables(per_vm: alloc::vec::Vec<&'static [UnwindTable<'static>]>) {
    UNWIND_TABLES.call_once(|| per_vm);
}

/// VM `vm`'s unwind tables (none before `set_unwind_tables` or for an unknown VM).
fn unwind_tables(vm: u16) -> &'static [UnwindTable<'static>] {
    UNWIND_TABLES
        .get()
        .and_then(|t| t.get(usize::from(vm)).copied())
        .unwrap_or(&[])
}

/// This CPU's profiler.
#[inline]
pub fn this_cpu() -> &'static CpuProfiler {
    &CPUS[crate::percpu::index()]
}

/// The processor the sample path runs on: its TSC and interrupt flag.
struct Cpu;

impl Processor for Cpu {
    #[inline(always)]
    fn tsc(&self) -> u64 {
        rdtsc()
    }

    #[inline(always)]
    fn without_interrupts<R>(&self, f: impl FnOnce() -> R) -> R {
        x86_64::instructions::interrupts::without_interrupts(f)
    }

    fn interrupts_enabled(&self) -> bool {
        x86_64::instructions::interrupts::are_enabled()
    }

    fn read_msr(&self, msr: u32) -> Option<u64> {
        crate::arch::msr::read_safe(msr).ok()
    }
}

impl CpuProfiler {
    /// The number of the pCPU this profiler belongs to.
    pub fn pcpu(&self) -> usize {
        (self as *const CpuProfiler as usize - CPUS.as_ptr() as usize)
            / core::mem::size_of::<CpuProfiler>()
    }
}

impl CpuProfiler {
    /// This pCPU's ring of samples and events.
    #[inline(always)]
    pub fn ring(&self) -> &'static Ring<Slot, RING_RECORDS> {
        // `% MAX_CPUS` (a power of two: a mask) keeps the index in bounds without a check on
        // the sample path; `pcpu` is below MAX_CPUS for every profiler of `CPUS`.
        &RINGS[self.pcpu() % MAX_CPUS].samples
    }

    /// This pCPU's ring of task changes.
    pub fn tasks(&self) -> &'static Ring<hvprof_samplelog::Task, TASK_RECORDS> {
        &RINGS[self.pcpu() % MAX_CPUS].tasks
    }
}

/// pCPU `index`'s profiler.
pub fn cpu(index: usize) -> &'static CpuProfiler {
    &CPUS[index]
}

/// Interrupts pCPU `target` (a kick, `KICK_VECTOR`): a vCPU it runs leaves the guest and looks
/// at its IPIs; a pCPU idling in `halt_until` wakes and looks at its run queue. Nothing when
/// `target` is this pCPU or has no local APIC, and no second interrupt while one is on its way
/// there (`kick_in_flight`): a guest that makes kicks in a loop costs a pCPU at most one exit
/// per look at its vCPUs, whatever the rate.
pub fn kick_cpu(target: usize) {
    let here = this_cpu();
    if target == here.pcpu() || target >= MAX_CPUS {
        return;
    }
    let to_cpu = &CPUS[target];
    if let (Some(from), Some(to)) = (here.lapic.get(), to_cpu.lapic.get()) {
        if !to_cpu.kicks.request() {
            return;
        }
        here.kicks_sent.fetch_add(1, Ordering::Relaxed);
        // Fixed delivery, physical destination, edge (SDM Vol. 3A, "Interrupt Command
        // Register").
        from.send_ipi(to.id(), u32::from(crate::arch::host_apic::KICK_VECTOR));
    }
}

/// A pCPU that idles and may run a vCPU pinned to `pin` (any pCPU for `None`), other than this
/// one: the one to wake for a vCPU that no pCPU runs now.
pub fn idle_cpu_for(pin: Option<usize>) -> Option<usize> {
    let here = this_cpu().pcpu();
    let idle = |i: usize| {
        i != here && CPUS[i].lapic.get().is_some() && CPUS[i].idle.load(Ordering::Relaxed)
    };
    match pin {
        Some(p) => (p < MAX_CPUS && idle(p)).then_some(p),
        None => (0..MAX_CPUS).find(|&i| idle(i)),
    }
}

/// The kick's interrupt on this pCPU (from the IDT, or from an external-interrupt exit, which
/// acknowledged it already: the EOI is due either way). The next kick sends an interrupt again.
pub fn on_kick() {
    let here = this_cpu();
    here.kicks.taken();
    here.eoi();
}

impl CpuProfiler {
    /// A sampling exit that began at TSC `start` ends at `end`; `inside` of its ticks were its
    /// sample path and task read (counted there too).
    pub fn sampling_exit_done(&self, start: u64, end: u64, inside: u64) {
        self.costs.sampling_exit_done(start, end, inside);
    }

    /// The whole cost so far, in disjoint parts (as the pCPU cost frame carries it).
    pub fn cost_report(&self) -> PcpuCost {
        self.costs
            .report(self.pcpu() as u16, self.span(), &self.sampling.cost)
    }

    /// TSC ticks from the start of sampling on this pCPU to its end (or to now, while running).
    pub fn span(&self) -> u64 {
        let end = match self.stopped_at.load(Ordering::Relaxed) {
            0 => rdtsc(),
            t => t,
        };
        end.saturating_sub(self.started_at.load(Ordering::Relaxed))
    }

    pub fn enabled(&self) -> bool {
        self.sampling.clock.enabled()
    }

    /// The sampling period, TSC ticks.
    pub fn period(&self) -> u64 {
        self.sampling.clock.period()
    }

    /// The next sampling deadline (u64::MAX when off).
    #[inline(always)]
    pub fn next_tick(&self) -> u64 {
        self.sampling.clock.next_tick()
    }

    /// Sets what this pCPU runs now (the run loop calls it on every VM exit).
    pub fn set_current(&self, vm: u16, vcpu: u16, vpid: u16, exit: u16) {
        self.current
            .store(pack(vm, vcpu, vpid, exit), Ordering::Relaxed);
    }

    fn current(&self) -> (u16, u16, u16, u16) {
        let c = self.current.load(Ordering::Relaxed);
        (
            c as u16,
            (c >> 16) as u16,
            (c >> 32) as u16,
            (c >> 48) as u16,
        )
    }

    /// Puts a record into this pCPU's ring (`SamplePath::offer`).
    #[inline(always)]
    fn offer(&self, record: Record, frames: &[u64], irqs: Irqs) {
        self.sampling.offer(&Cpu, self.ring(), record, frames, irqs);
    }

    /// Records a sample taken since `t0` (`SamplePath::push`); returns the TSC at its end.
    #[inline(always)]
    fn push(&self, s: Sample, frames: &[u64], t0: u64, irqs: Irqs) -> u64 {
        self.sampling
            .push(&Cpu, self.ring(), &self.costs, s, frames, t0, irqs)
    }

    /// (samples, mean, min, max) of the sample path's own cost in TSC ticks.
    pub fn cost(&self) -> (u64, u64, u64, u64) {
        self.sampling.cost.summary()
    }

    /// The deadline clock's guest sample, at a VM exit taken at `now` (the VMX-preemption
    /// timer's, or any exit that finds the deadline passed), if it was due.
    #[inline(always)]
    pub fn sample_guest_if_due(&self, vmcs: &CurrentVmcs, now: u64) -> Option<GuestSampled> {
        self.sampling
            .clock
            .take_due(now)
            .then(|| self.sample_guest(vmcs, now))
    }

    /// The sample path for a guest: reads its state from the current VMCS. With interrupts off
    /// (the run loop right after a VM exit, which clears RFLAGS.IF: SDM Vol. 3C §28.5.3; the
    /// NMI exit's handler turns them off around it).
    #[inline(always)]
    pub fn sample_guest(&self, vmcs: &CurrentVmcs, now: u64) -> GuestSampled {
        match stack_depth() {
            // Without a chain (the default): pushed where the compiler knows there are no
            // frames, so that the record goes straight into the ring (with a chain's frames
            // possible, it was built on the stack first and copied from there).
            0 => self
                .sampling
                .guest(&Cpu, vmcs, self.ring(), &self.costs, self.current(), now),
            depth => self.sample_guest_walked(vmcs, now, depth, rdtsc()),
        }
    }

    /// `sample_guest` with a call chain of at most `depth` frames. Out of line, so that its
    /// buffer and registers do not weigh on the path without chains.
    #[inline(never)]
    fn sample_guest_walked(
        &self,
        vmcs: &CurrentVmcs,
        now: u64,
        depth: usize,
        t0: u64,
    ) -> GuestSampled {
        let (mut s, cpl, mode) = self.guest_sample(vmcs, now);
        let mut buf = [MaybeUninit::uninit(); MAX_CHAIN_DEPTH];
        let t = rdtsc();
        let long = mode == hvprof_samplelog::MODE_LONG;
        // SAFETY: called by `sample_guest`, with this vCPU's VMCS current (GUEST_RSP exists in
        // every VMCS); not through `vmcs`, so that the closure passed to the walk holds nothing.
        let rsp = || unsafe { hvprof_vmx::instructions::vmread_field_fast(GuestNatural::Rsp) };
        let (rip, cr3) = (s.guest_rip, s.guest_cr3);
        let at = GuestAt {
            cr3,
            cpl,
            long,
            rip,
        };
        let (chain, frames) = self.walk_guest(at, rsp, depth, &mut buf);
        let c = &self.costs;
        walked_since(t, frames.len(), &c.guest_walks, &c.guest_frames);
        s.guest_chain = chain;
        let end = self.push(s, frames, t0, Irqs::Off);
        GuestSampled::new((now, rip, cr3, cpl), t0, end)
    }

    /// A guest sample at `now` (no chain yet), read from the current VMCS, with the guest's CPL
    /// and mode.
    #[inline(always)]
    fn guest_sample(&self, vmcs: &CurrentVmcs, now: u64) -> (Sample, u8, u8) {
        // The caller is the run loop right after a VM exit (or the NMI exit's handler), with this
        // vCPU's VMCS current.
        guest_sample::guest_sample(vmcs, self.current(), now)
    }

    /// The deadline clock's hypervisor sample, from the LAPIC timer's interrupt frame, or at a
    /// VM entry that finds the deadline passed (`rip` = the run loop).
    /// Its cost in ticks if it was due.
    /// `fp`: the frame pointer at `rip` (its callers are the sample's host chain), 0 if unknown.
    pub fn sample_host_if_due(&self, rip: u64, fp: u64, idle: bool) -> Option<u64> {
        self.sample_host_at(rip, fp, idle, rdtsc())
    }

    /// `sample_host_if_due` with the TSC already read (`now`).
    pub fn sample_host_at(&self, rip: u64, fp: u64, idle: bool, now: u64) -> Option<u64> {
        self.sampling
            .clock
            .take_due(now)
            .then(|| self.sample_host(rip, fp, idle, now))
    }

    /// The sample path for the hypervisor itself (`t0`: when the sample was triggered; `fp`: the
    /// frame pointer at `rip`, 0 if unknown). Returns its cost.
    pub fn sample_host(&self, rip: u64, fp: u64, idle: bool, t0: u64) -> u64 {
        let (vm, vcpu, vpid, exit) = self.current();
        let mut s = Sample {
            tsc: t0,
            kind: if idle {
                SampleKind::Idle
            } else {
                SampleKind::Hypervisor
            },
            vm,
            vcpu,
            vpid,
            guest_rip: 0,
            guest_cr3: 0,
            guest_mode: 0,
            exit_reason: exit,
            host_rip: rip,
            cost: 0,
            host_chain: Chain::NOT_WALKED,
            guest_chain: Chain::NOT_WALKED,
        };
        let depth = stack_depth();
        if depth == 0 {
            // No chain (the default): pushed where the compiler knows there are no frames (see
            // `sample_guest`).
            return self.push(s, &[], t0, Irqs::MayBeOn) - t0;
        }
        // The host chain's frames, then the guest chain's: the exit's RIP and its callers.
        let mut buf = [MaybeUninit::uninit(); 2 * MAX_CHAIN_DEPTH];
        let t = rdtsc();
        s.host_chain = self.walk_host(fp, depth, &mut buf[..MAX_CHAIN_DEPTH]).0;
        if s.vm != NO_VM {
            let h = s.host_chain.depth();
            let (chain, cr3) = self.walk_exit_cause(depth, &mut buf[h..h + MAX_CHAIN_DEPTH]);
            s.guest_chain = chain;
            // The guest's address space names the chain's frames (a Linux process's).
            s.guest_cr3 = cr3;
        }
        let c = &self.costs;
        walked_since(t, s.chain_frames(), &c.host_walks, &c.host_frames);
        let n = s.chain_frames();
        // SAFETY: the walks wrote the first `depth()` slots of the parts they were given, and
        // the guest part starts where the host chain's frames end; `MaybeUninit<u64>` has the
        // layout of `u64`.
        let frames = unsafe { &*(&buf[..n] as *const [MaybeUninit<u64>] as *const [u64]) };
        self.push(s, frames, t0, Irqs::MayBeOn) - t0
    }

    /// The hypervisor's callers from frame pointer `fp`, inside this pCPU's stack.
    fn walk_host<'a>(
        &self,
        fp: u64,
        depth: usize,
        out: &'a mut [MaybeUninit<u64>],
    ) -> (Chain, &'a [u64]) {
        let bounds = Bounds {
            lo: self.stack_lo.load(Ordering::Relaxed),
            hi: self.stack_hi.load(Ordering::Relaxed),
        };
        if fp == 0 || bounds.hi == 0 {
            return (Chain::NOT_WALKED, &[]);
        }
        stack_walk::walk(&mut HostStack(bounds), fp, bounds, depth, out)
    }

    /// The running vCPU's guest chain from `at` (`GuestChains::walk`, with its VM's unwind
    /// tables).
    fn walk_guest<'a>(
        &self,
        at: GuestAt,
        rsp: impl FnOnce() -> u64,
        depth: usize,
        out: &'a mut [MaybeUninit<u64>],
    ) -> (Chain, &'a [u64]) {
        let (vm, ..) = self.current();
        self.chains.walk(
            &Cpu,
            &self.costs,
            vm,
            || unwind_tables(vm),
            at,
            rsp,
            depth,
            out,
        )
    }

    /// At a hypervisor sample during a vCPU's exit: the guest RIP of the exit, then the guest's
    /// callers (what guest code path this hypervisor time serves), written to the start of `out`;
    /// and the guest's CR3 (0 when none was read).
    fn walk_exit_cause(&self, depth: usize, out: &mut [MaybeUninit<u64>]) -> (Chain, u64) {
        if !self.chains.has_memory() {
            return (Chain::NOT_WALKED, 0);
        }
        // SAFETY: `current()` names a vCPU only between `set_current` after its VMPTRLD and
        // `set_current(NO_VM, ..)` before its VMCLEAR (`run.rs`), so its VMCS is the current
        // one on this pCPU; VMREAD changes no state the interrupted code relies on (RFLAGS and
        // the destination register are saved by the interrupt entry). Every encoding below
        // exists in every VMCS.
        let (rip, cr3, ss_ar, cs_ar) = unsafe {
            use hvprof_vmx::instructions::vmread_field_fast as read;
            (
                read(GuestNatural::Rip),
                read(GuestNatural::Cr3),
                read(Guest32::SsAccessRights) as u32,
                read(Guest32::CsAccessRights) as u32,
            )
        };
        let cpl = hvprof_vmx::guest::cpl_from_ss_access_rights(ss_ar);
        let Some((first, rest)) = out.split_first_mut() else {
            return (Chain::NOT_WALKED, 0);
        };
        first.write(rip);
        // SAFETY: as above.
        let rsp = || unsafe { hvprof_vmx::instructions::vmread_field_fast(GuestNatural::Rsp) };
        let long = hvprof_vmx::guest::long_code(cs_ar);
        let at = GuestAt {
            cr3,
            cpl,
            long,
            rip,
        };
        let (callers, _) = self.walk_guest(at, rsp, depth - 1, rest);
        let end = match callers.end() {
            // The exit's RIP is known even where its callers are not.
            ChainEnd::NotWalked => ChainEnd::Complete,
            e => e,
        };
        (Chain::new(1 + callers.depth(), end), cr3)
    }

    /// The VM whose vCPU this pCPU runs now and its memory (`None`: none), and how its
    /// kernel-mode chains are walked (`orc`: where its kernel's ORC tables are, for
    /// `KernelStacks::Orc`). On this pCPU's own profiler only (checked).
    pub fn set_guest_memory(
        &self,
        ram: Option<(u16, GuestRam)>,
        kernel: KernelStacks,
        orc: Option<hvprof_linux_walk::OrcLayout>,
    ) {
        assert_eq!(
            self.pcpu(),
            crate::percpu::index(),
            "another pCPU's guest memory set"
        );
        // SAFETY: this is this pCPU's profiler (checked above); its walks run on this pCPU
        // only (its guest samples, its timer's and NMI's hypervisor samples: `walk_guest` is
        // called on `this_cpu()` alone), so none runs on another CPU meanwhile.
        unsafe { self.chains.set_memory(ram, kernel, orc) };
    }

    /// The running vCPU's RBP at its VM exit (where its guest chain starts).
    #[inline(always)]
    pub fn set_guest_rbp(&self, rbp: u64) {
        self.chains.set_rbp(rbp);
    }

    /// This pCPU's stack, `[lo, hi)` (where hypervisor chains are walked).
    pub fn set_stack(&self, lo: u64, hi: u64) {
        self.stack_lo.store(lo, Ordering::Relaxed);
        self.stack_hi.store(hi, Ordering::Relaxed);
    }

    /// Arms the LAPIC timer for the next deadline (while the hypervisor runs).
    pub fn arm_host_clock(&self) {
        if let (true, Some(l)) = (self.enabled(), self.lapic.get()) {
            l.arm(self.next_tick());
        }
    }

    /// Signals the end of an interrupt to this pCPU's local APIC.
    pub fn eoi(&self) {
        if let Some(l) = self.lapic.get() {
            l.eoi();
        }
    }

    /// Whether another pCPU kicked this one since the last call (and clears it).
    pub fn take_kicked(&self) -> bool {
        self.kicks.take()
    }

    /// Halts this pCPU until its next sampling deadline or TSC `t`, whichever comes first (the
    /// LAPIC timer wakes it; `on_timer` takes the sample and re-arms for the next deadline).
    /// Without a LAPIC timer, returns at once: the caller polls.
    pub fn halt_until(&self, t: u64) {
        let Some(l) = self.lapic.get() else {
            core::hint::spin_loop();
            return;
        };
        x86_64::instructions::interrupts::disable();
        let wake = t.min(self.next_tick());
        l.arm(wake);
        if rdtsc() < wake {
            // STI's interrupt shadow covers HLT: a timer interrupt that is already pending is
            // taken after the HLT starts, so it cannot be missed (SDM Vol. 2B, STI).
            x86_64::instructions::interrupts::enable_and_hlt();
        } else {
            x86_64::instructions::interrupts::enable();
        }
    }

    /// This pCPU's local APIC, for its timer before sampling starts (`halt_for_console`);
    /// `begin` keeps it.
    pub fn set_lapic(&self, lapic: Lapic) {
        self.lapic.call_once(|| lapic);
    }

    /// Halts this pCPU until TSC `t` (or its next sampling deadline, or another interrupt),
    /// leaving the interrupt flag as it found it: the console's wait for its UART to send what
    /// it holds, where it would otherwise spin for the line's 87 µs a byte. Without a LAPIC
    /// timer, returns at once (the caller polls). Samples taken meanwhile are `[idle]`: the CPU
    /// is halted, and the time is the line's, not the hypervisor's work.
    pub fn halt_for_console(&self, t: u64) {
        let was_enabled = x86_64::instructions::interrupts::are_enabled();
        self.console_wait.store(true, Ordering::Relaxed);
        // With a LAPIC timer `halt_until` returns with interrupts on; without one it spins once
        // and leaves the flag alone.
        self.halt_until(t);
        self.console_wait.store(false, Ordering::Relaxed);
        if !was_enabled {
            x86_64::instructions::interrupts::disable();
        }
    }

    /// Disarms it (before VM entry: in the guest the VMX-preemption timer takes over).
    pub fn disarm_host_clock(&self) {
        if let Some(l) = self.lapic.get() {
            l.disarm();
        }
    }

    /// Writes a register of this pCPU's local APIC, if it has one.
    pub fn write_lapic(&self, reg: u32, value: u32) {
        if let Some(l) = self.lapic.get() {
            l.write(reg, value);
        }
    }
}

impl CpuProfiler {
    /// A scheduling event: this pCPU starts (`VcpuIn`) or stops (`VcpuOut`, with its reason)
    /// running the current vCPU (`reason`: why it stops; ignored for `VcpuIn`). Exact times for the steal/halt analysis, beside the samples.
    pub fn event(&self, kind: EventKind, reason: OutReason) {
        if !self.enabled() {
            return;
        }
        let (vm, vcpu, _, _) = self.current();
        self.offer(
            Record::Event(Event {
                tsc: rdtsc(),
                kind,
                vm,
                vcpu,
                reason,
            }),
            &[],
            Irqs::MayBeOn,
        );
    }
}

impl CpuProfiler {
    /// Records that a vCPU of a Linux guest runs another task from the sample at `tsc` on.
    /// Called by the run loop (interrupts off) after a guest sample.
    pub fn task_changed(&self, t: hvprof_samplelog::Task) {
        if self.enabled() {
            self.tasks().push(t);
        }
    }

    /// Marks this pCPU as idle (its samples are `[idle]`) or busy.
    pub fn set_idle(&self, idle: bool) {
        self.idle.store(idle, Ordering::Relaxed);
    }
}

/// Counts a sample's walks, begun at TSC `t`, that found `frames` frames.
#[inline(always)]
fn walked_since(t: u64, frames: usize, walks: &Tally, total: &AtomicU64) {
    walks.add(rdtsc() - t);
    total.fetch_add(frames as u64, Ordering::Relaxed);
}

/// This pCPU's stack, as a frame walk reads it: a page inside `[lo, hi)` (rounded out to whole
/// pages) is readable.
struct HostStack(Bounds);

impl FrameMemory for HostStack {
    type Page = u64;

    #[inline(always)]
    fn page(&mut self, page: u64) -> Option<u64> {
        (page >= self.0.lo & !0xfff && page < self.0.hi).then_some(page)
    }

    #[inline(always)]
    fn word(&self, page: u64, offset: u64) -> u64 {
        // SAFETY: `page` lies in this pCPU's stack (`page` checked it), mapped for the machine's
        // life, and `offset` < 4096 keeps the 8-aligned word inside it. The code the sample
        // interrupted is stopped on this pCPU, and no other CPU writes this stack.
        unsafe { core::ptr::read_volatile((page + offset) as *const u64) }
    }
}

/// The LAPIC timer interrupt (vector `TIMER_VECTOR`): a hypervisor (or idle) sample at the
/// interrupted RIP, then the next deadline.
pub fn on_timer(rip: u64, fp: u64) {
    let t0 = rdtsc();
    let p = this_cpu();
    if !p.enabled() {
        // Not sampling (before the start or after the end): the console's wait for its UART
        // (`halt_for_console`) set the timer. Not the profiler's cost.
        p.eoi();
        return;
    }
    let halted = p.idle.load(Ordering::Relaxed) || p.console_wait.load(Ordering::Relaxed);
    let sample = p.sample_host_if_due(rip, fp, halted);
    if let Some(l) = p.lapic.get() {
        l.eoi();
    }
    p.arm_host_clock();
    p.costs.timer_interrupts.add(rdtsc() - t0);
    p.costs
        .inside
        .fetch_add(sample.unwrap_or(0), Ordering::Relaxed);
}

impl CpuProfiler {
    /// Starts sampling on this pCPU every `period` ticks; `lapic` is the deadline clock's timer
    /// in the hypervisor (none when the PMU samples), `deadline` whether the deadline clock is
    /// the source.
    pub fn begin(&self, period: u64, lapic: Option<Lapic>, deadline: bool) {
        if let Some(l) = lapic {
            self.lapic.call_once(|| l);
        }
        let now = rdtsc();
        self.started_at.store(now, Ordering::Relaxed);
        self.sampling.clock.begin(period, now, deadline);
    }

    /// Stops sampling on this pCPU.
    pub fn end(&self) {
        self.sampling.clock.stop();
        self.stopped_at.store(rdtsc(), Ordering::Relaxed);
        if let Some(l) = self.lapic.get() {
            l.disarm();
        }
    }
}
