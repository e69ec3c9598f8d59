//! The profiler's sampling side: starting and stopping the sampling clock of each pCPU; its
//! state and sample path are `sampler`, task tracking `tasks`, the export `export`.
//!
//! Sampling follows the paper's Key Technique 1: everything is sampled centrally by the
//! hypervisor, with no delegation to guests and no virtual interrupt injected. Where no PMU
//! counts (Bochs, QEMU TCG) the source is a per-pCPU deadline clock: while a guest runs, the
//! VMX-preemption timer stops it exactly at the deadline (`run.rs` programs it); while the
//! hypervisor runs, the LAPIC timer interrupts it there (`on_timer`). On real hardware with a
//! counting PMU, counter overflows arrive as NMIs instead (`hvprof-pmu`'s sampler).
//!
//! The sample path reads the TSC and what ran — from the VMCS for a guest (RIP, CR3, CPL and
//! mode), from the interrupt frame for the hypervisor — writes one record into this pCPU's ring
//! and measures its own cost. No lock, no allocation, bounded time; a full ring counts a drop.
//! Encoding and export happen later, outside the path (`export`).

pub mod export;
pub mod pmu;
pub mod sampler;

pub use sampler::{KernelStacks, on_timer, this_cpu};

use crate::arch::host_apic::Lapic;

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
    let mut source = Source::Deadline;
    if let (Some(info), Some(l)) = (pmu, lapic) {
        match self::pmu::start(info, period, l) {
            Ok(()) => source = Source::Pmu,
            Err(e) => {
                crate::println!("profiler: the PMU cannot sample ({e}); using the deadline clock")
            }
        }
    }
    // The deadline clock's LAPIC timer, or none when the PMU's overflows take the samples.
    let deadline_lapic = match source {
        Source::Deadline => lapic,
        Source::Pmu => None,
    };
    this_cpu().begin(period, deadline_lapic, source == Source::Deadline);
    source
}

/// Stops sampling on this CPU.
pub fn stop() {
    this_cpu().end();
    self::pmu::stop();
}
