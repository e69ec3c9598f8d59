//! The profiler's sampling side: per-pCPU state, the sample path, and the sampling clock.
//!
//! Sampling follows the paper's Key Technique 1: everything is sampled centrally by the
//! hypervisor, with no delegation to guests and no virtual interrupt injected. Where no PMU
//! counts (Bochs, QEMU TCG) the source is a per-pCPU deadline clock: while a guest runs, the
//! VMX-preemption timer stops it exactly at the deadline (`vm::run` programs it); while the
//! hypervisor runs, the LAPIC timer interrupts it there (`on_timer`). On real hardware with a
//! counting PMU, counter overflows arrive as NMIs instead (`hvprof-pmu`'s sampler).
//!
//! The sample path reads the TSC and what ran — from the VMCS for a guest (RIP, CR3, CPL and
//! mode), from the interrupt frame for the hypervisor — writes one record into this pCPU's ring
//! and measures its own cost. No lock, no allocation, bounded time; a full ring counts a drop.
//! Encoding and export happen later, outside the path (`export`).

pub mod export;
pub mod pmu;

use crate::arch::lapic::Lapic;
use crate::percpu::MAX_CPUS;
use crate::tsc::rdtsc;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use hvprof_hypervisor::ring::Ring;
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::vmcs::{Guest32, Guest64, GuestNatural};

/// What a record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Guest = 0,
    Hypervisor = 1,
    Idle = 2,
    VcpuIn = 3,
    VcpuOut = 4,
}

/// One record as the sample path writes it (encoding happens later, in `export`).
#[derive(Clone, Copy, Debug)]
pub struct RawRecord {
    pub tsc: u64,
    pub guest_rip: u64,
    pub guest_cr3: u64,
    pub host_rip: u64,
    pub cost: u32,
    pub exit_reason: u16,
    pub vm: u16,
    pub vcpu: u16,
    pub vpid: u16,
    pub kind: Kind,
    /// Samples: bits 1:0 CPL, bits 3:2 mode (0 real, 1 protected, 2 long). VcpuOut: the reason.
    pub mode: u8,
}

impl RawRecord {
    pub const ZERO: RawRecord = RawRecord {
        tsc: 0,
        guest_rip: 0,
        guest_cr3: 0,
        host_rip: 0,
        cost: 0,
        exit_reason: 0,
        vm: 0,
        vcpu: 0,
        vpid: 0,
        kind: Kind::Guest,
        mode: 0,
    };
}

pub const NO_VM: u16 = 0xffff;
pub const NO_EXIT: u16 = 0xffff;
pub const RING_RECORDS: usize = 4096;
pub const TASK_RECORDS: usize = 256;

/// This pCPU's profiler state. Shared between the run loop and the timer/NMI handlers of the
/// same CPU, so every field is atomic.
pub struct CpuProfiler {
    pub ring: Ring<RawRecord, RING_RECORDS>,
    /// Task changes of Linux guests read at samples (rare: only when the task differs).
    pub tasks: Ring<hvprof_samplelog::Task, TASK_RECORDS>,
    enabled: AtomicBool,
    period: AtomicU64,
    next_tick: AtomicU64,
    /// (vm, vcpu, vpid, last exit reason) of what this pCPU runs, packed in 16-bit fields.
    current: AtomicU64,
    /// Samples taken, and the total, smallest and largest cost of the sample path (TSC ticks).
    pub samples_taken: AtomicU64,
    cost_total: AtomicU64,
    cost_min: AtomicU64,
    cost_max: AtomicU64,
    lapic: spin::Once<Lapic>,
    /// This pCPU runs its idle loop.
    idle: AtomicBool,
    /// A push into `ring` is under way (see `offer`).
    pushing: AtomicBool,
}

impl CpuProfiler {
    pub const fn new() -> Self {
        CpuProfiler {
            ring: Ring::new(),
            tasks: Ring::new(),
            enabled: AtomicBool::new(false),
            period: AtomicU64::new(u64::MAX),
            next_tick: AtomicU64::new(u64::MAX),
            current: AtomicU64::new(pack(NO_VM, 0xffff, 0, NO_EXIT)),
            samples_taken: AtomicU64::new(0),
            cost_total: AtomicU64::new(0),
            cost_min: AtomicU64::new(u64::MAX),
            cost_max: AtomicU64::new(0),
            lapic: spin::Once::new(),
            idle: AtomicBool::new(false),
            pushing: AtomicBool::new(false),
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

/// Every pCPU's profiler, indexed by pCPU number.
static CPUS: [CpuProfiler; MAX_CPUS] = [const { CpuProfiler::new() }; MAX_CPUS];

/// This CPU's profiler.
#[inline]
pub fn this_cpu() -> &'static CpuProfiler {
    &CPUS[crate::percpu::index()]
}

impl CpuProfiler {
    /// The number of the pCPU this profiler belongs to.
    pub fn pcpu(&self) -> usize {
        (self as *const CpuProfiler as usize - CPUS.as_ptr() as usize)
            / core::mem::size_of::<CpuProfiler>()
    }
}

/// pCPU `index`'s profiler.
pub fn cpu(index: usize) -> &'static CpuProfiler {
    &CPUS[index]
}

/// The sampling source in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The VMX-preemption timer in guests, the LAPIC timer in the hypervisor.
    Deadline,
    /// Counter overflows of the PMU, delivered as NMIs.
    Pmu,
}

/// Starts sampling every `period` TSC ticks (or reference cycles) on this CPU: with the PMU when
/// `pmu` names a counting one, else with the deadline clock. Every pCPU calls it for itself.
pub fn start(
    period: u64,
    lapic: Option<Lapic>,
    pmu: Option<&hvprof_pmu::probe::PmuInfo>,
) -> Source {
    let p = this_cpu();
    p.period.store(period, Ordering::Relaxed);
    let mut source = Source::Deadline;
    if let (Some(info), Some(l)) = (pmu, lapic) {
        match self::pmu::start(info, period, l) {
            Ok(()) => source = Source::Pmu,
            Err(e) => {
                crate::println!("profiler: the PMU cannot sample ({e}); using the deadline clock")
            }
        }
    }
    if source == Source::Deadline {
        if let Some(l) = lapic {
            p.lapic.call_once(|| l);
        }
        p.next_tick
            .store(rdtsc().saturating_add(period), Ordering::Relaxed);
    } else {
        p.next_tick.store(u64::MAX, Ordering::Relaxed);
    }
    p.enabled.store(true, Ordering::Release);
    source
}

/// Stops sampling on this CPU.
pub fn stop() {
    let p = this_cpu();
    p.enabled.store(false, Ordering::Release);
    if let Some(l) = p.lapic.get() {
        l.disarm();
    }
    self::pmu::stop();
}

impl CpuProfiler {
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// The next sampling deadline (u64::MAX when off).
    pub fn next_tick(&self) -> u64 {
        if self.enabled() {
            self.next_tick.load(Ordering::Relaxed)
        } else {
            u64::MAX
        }
    }

    /// Whether a sample is due at `now`; if so, moves the deadline past `now` (ticks missed while
    /// the sample could not be taken are skipped, not bunched: one sample per elapsed deadline
    /// would fake time the CPU did not spend there).
    fn take_due(&self, now: u64) -> bool {
        if !self.enabled() {
            return false;
        }
        let next = self.next_tick.load(Ordering::Relaxed);
        if now < next {
            return false;
        }
        let period = self.period.load(Ordering::Relaxed).max(1);
        let missed = (now - next) / period;
        self.next_tick
            .store(next + (missed + 1) * period, Ordering::Relaxed);
        true
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

    /// Puts a record into the ring. The ring has one producer, but on one pCPU that producer runs
    /// in three contexts: the run loop and scheduler, the timer interrupt and the PMU's NMI. The
    /// interrupt is kept out while the others push; an NMI that lands inside a push finds the
    /// ring busy and its record is counted as a drop rather than corrupting the one in flight.
    fn offer(&self, r: RawRecord) {
        x86_64::instructions::interrupts::without_interrupts(|| {
            if self.pushing.swap(true, Ordering::Acquire) {
                self.ring.count_drop();
                return;
            }
            self.ring.push(r);
            self.pushing.store(false, Ordering::Release);
        });
    }

    fn push(&self, mut r: RawRecord, t0: u64) {
        let cost = rdtsc() - t0;
        r.cost = cost.min(u32::MAX as u64) as u32;
        self.offer(r);
        self.samples_taken.fetch_add(1, Ordering::Relaxed);
        self.cost_total.fetch_add(cost, Ordering::Relaxed);
        self.cost_min.fetch_min(cost, Ordering::Relaxed);
        self.cost_max.fetch_max(cost, Ordering::Relaxed);
    }

    /// (samples, mean, min, max) of the sample path's own cost in TSC ticks.
    pub fn cost(&self) -> (u64, u64, u64, u64) {
        let n = self.samples_taken.load(Ordering::Relaxed);
        let total = self.cost_total.load(Ordering::Relaxed);
        let min = self.cost_min.load(Ordering::Relaxed);
        (
            n,
            total.checked_div(n).unwrap_or(0),
            if n == 0 { 0 } else { min },
            self.cost_max.load(Ordering::Relaxed),
        )
    }

    /// The deadline clock's guest sample, at a VM exit taken at `now` (the VMX-preemption
    /// timer's, or any exit that finds the deadline passed).
    pub fn sample_guest_if_due(&self, vmcs: &CurrentVmcs, now: u64) -> bool {
        let due = self.take_due(now);
        if due {
            self.sample_guest(vmcs, now);
        }
        due
    }

    /// The sample path for a guest: reads its state from the current VMCS.
    pub fn sample_guest(&self, vmcs: &CurrentVmcs, now: u64) {
        let t0 = rdtsc();
        let (vm, vcpu, vpid, exit) = self.current();
        let _ = vmcs;
        // SAFETY: the caller is the run loop right after a VM exit, in VMX operation with this
        // vCPU's VMCS current; every encoding below exists in every VMCS.
        let read = |field: u32| unsafe { hvprof_vmx::instructions::vmread_fast(field) };
        let rip = read(GuestNatural::Rip as u32);
        let cr3 = read(GuestNatural::Cr3 as u32);
        let ss_ar = read(Guest32::SsAccessRights as u32) as u32;
        let cs_ar = read(Guest32::CsAccessRights as u32) as u32;
        let cr0 = read(GuestNatural::Cr0 as u32);
        let efer = read(Guest64::Ia32Efer as u32);
        let cpl = ((ss_ar >> 5) & 3) as u8;
        // Mode: real (CR0.PE = 0), long 64-bit (EFER.LMA and CS.L), else protected.
        let mode = if cr0 & 1 == 0 {
            0
        } else if efer & (1 << 10) != 0 && cs_ar & (1 << 13) != 0 {
            2
        } else {
            1
        };
        self.push(
            RawRecord {
                tsc: now,
                guest_rip: rip,
                guest_cr3: cr3,
                host_rip: 0,
                cost: 0,
                exit_reason: exit,
                vm,
                vcpu,
                vpid,
                kind: Kind::Guest,
                mode: cpl | mode << 2,
            },
            t0,
        );
    }

    /// The deadline clock's hypervisor sample, from the LAPIC timer's interrupt frame, or at a
    /// VM entry that finds the deadline passed (`rip` = the run loop).
    pub fn sample_host_if_due(&self, rip: u64, idle: bool) {
        let t0 = rdtsc();
        if self.take_due(t0) {
            self.sample_host(rip, idle, t0);
        }
    }

    /// The sample path for the hypervisor itself (`t0`: when the sample was triggered).
    pub fn sample_host(&self, rip: u64, idle: bool, t0: u64) {
        let (vm, vcpu, vpid, exit) = self.current();
        self.push(
            RawRecord {
                tsc: t0,
                guest_rip: 0,
                guest_cr3: 0,
                host_rip: rip,
                cost: 0,
                exit_reason: exit,
                vm,
                vcpu,
                vpid,
                kind: if idle { Kind::Idle } else { Kind::Hypervisor },
                mode: 0,
            },
            t0,
        );
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

    /// Disarms it (before VM entry: in the guest the VMX-preemption timer takes over).
    pub fn disarm_host_clock(&self) {
        if let Some(l) = self.lapic.get() {
            l.disarm();
        }
    }
}

/// `VcpuOut` reasons (the `mode` byte of the record).
pub const OUT_PREEMPTED: u8 = 0;
pub const OUT_HALTED: u8 = 1;
pub const OUT_STOPPED: u8 = 2;

impl CpuProfiler {
    /// A scheduling event: this pCPU starts (`VcpuIn`) or stops (`VcpuOut`, with its reason)
    /// running the current vCPU. Exact times for the steal/halt analysis, beside the samples.
    pub fn event(&self, kind: Kind, reason: u8) {
        if !self.enabled() {
            return;
        }
        let (vm, vcpu, vpid, exit) = self.current();
        self.offer(RawRecord {
            tsc: rdtsc(),
            guest_rip: 0,
            guest_cr3: 0,
            host_rip: 0,
            cost: 0,
            exit_reason: exit,
            vm,
            vcpu,
            vpid,
            kind,
            mode: reason,
        });
    }
}

impl CpuProfiler {
    /// Records that a vCPU of a Linux guest runs another task from the sample at `tsc` on.
    /// Called by the run loop (interrupts off) after a guest sample.
    pub fn task_changed(&self, t: hvprof_samplelog::Task) {
        if self.enabled() {
            self.tasks.push(t);
        }
    }

    /// Marks this pCPU as idle (its samples are `[idle]`) or busy.
    pub fn set_idle(&self, idle: bool) {
        self.idle.store(idle, Ordering::Relaxed);
    }
}

/// The LAPIC timer interrupt (vector `TIMER_VECTOR`): a hypervisor (or idle) sample at the
/// interrupted RIP, then the next deadline.
pub fn on_timer(rip: u64) {
    let p = this_cpu();
    p.sample_host_if_due(rip, p.idle.load(Ordering::Relaxed));
    if let Some(l) = p.lapic.get() {
        l.eoi();
    }
    p.arm_host_clock();
}
