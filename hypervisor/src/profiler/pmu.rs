//! The PMU sampling source, where a functional probe found a counting PMU (real hardware, nested
//! KVM with `pmu=on`): the paper's CPU_CLK_UNHALTED.REF sampler. The counter overflows every
//! `period` reference cycles; its PMI arrives as an NMI through the LAPIC's LVT PMI entry. In a
//! guest, "NMI exiting" turns it into exit reason 0 and the guest is sampled from the VMCS
//! (`on_nmi_exit`); in the hypervisor, the NMI handler samples its own interrupt frame
//! (`on_nmi_host`). The counter logic (arming, overflow detection, re-arm and unmask) is
//! `hvprof_pmu::sampler`, unit-tested on the host against a model of the MSRs.

use crate::arch::lapic::{self, Lapic};
use crate::arch::msr::SafeMsrs;
use core::cell::UnsafeCell;
use hvprof_pmu::probe::PmuInfo;
use hvprof_pmu::sampler::{self, Event, Sampler, SamplerCaps};
use hvprof_vmx::instructions::CurrentVmcs;

/// The LVT PMI entry of this CPU's local APIC, for the sampler.
struct LvtPmi(Lapic);

impl sampler::Lapic for LvtPmi {
    fn write_lvt_pmi(&mut self, value: u32) {
        self.0.write(lapic::REG_LVT_PMI, value);
    }
    fn read_lvt_pmi(&self) -> u32 {
        self.0.read(lapic::REG_LVT_PMI)
    }
}

struct PmuCell {
    sampler: UnsafeCell<Sampler>,
    lapic: UnsafeCell<LvtPmi>,
}

// SAFETY: the cell is used only on the CPU that armed it, and only from NMI context (the NMI
// handler, or the run loop right after an NMI VM exit, while NMIs are blocked): never twice at
// once.
unsafe impl Sync for PmuCell {}

static BSP_PMU: spin::Once<PmuCell> = spin::Once::new();

/// Arms the PMU sampler on this CPU. `Err` says why it cannot be used (the deadline clock then
/// stays the source).
pub fn start(info: &PmuInfo, period: u64, lapic: Lapic) -> Result<(), alloc::string::String> {
    let cpuid = raw_cpuid::native_cpuid::cpuid_count(0xa, 0);
    let mut caps = SamplerCaps::from_cpuid(cpuid.eax, cpuid.ebx);
    // IA32_PERF_CAPABILITIES exists when CPUID.01H:ECX.PDCM[bit 15] = 1.
    if raw_cpuid::CpuId::new()
        .get_feature_info()
        .is_some_and(|f| f.has_pdcm())
    {
        caps = caps.with_perf_capabilities(crate::arch::msr::read_safe(0x345).unwrap_or(0));
    }
    let sampler = Sampler::with_caps(info, caps, Event::RefCycles, period)
        .map_err(|e| alloc::format!("{e:?}"))?;
    let cell = BSP_PMU.call_once(|| PmuCell {
        sampler: UnsafeCell::new(sampler),
        lapic: UnsafeCell::new(LvtPmi(lapic)),
    });
    // SAFETY: before arming no PMI can arrive, so nothing else touches the cell.
    let (s, l) = unsafe { (&mut *cell.sampler.get(), &mut *cell.lapic.get()) };
    s.arm(&mut SafeMsrs, l).map_err(|e| alloc::format!("{e}"))?;
    Ok(())
}

fn ours() -> bool {
    let Some(cell) = BSP_PMU.get() else {
        return false;
    };
    // SAFETY: NMI context on the CPU that armed it (see `PmuCell`).
    let (s, l) = unsafe { (&mut *cell.sampler.get(), &mut *cell.lapic.get()) };
    s.on_nmi(&mut SafeMsrs, l).unwrap_or(false)
}

/// From the NMI handler: `true` when the NMI was the counter's overflow (and the hypervisor was
/// sampled at `rip`).
pub fn on_nmi_host(rip: u64) -> bool {
    if !ours() {
        return false;
    }
    super::this_cpu().sample_host(rip, false, crate::tsc::rdtsc());
    true
}

/// After an NMI VM exit: `true` when the NMI was the counter's overflow (and the guest was
/// sampled).
pub fn on_nmi_exit(vmcs: &CurrentVmcs, now: u64) -> bool {
    if !ours() {
        return false;
    }
    super::this_cpu().sample_guest(vmcs, now);
    true
}

/// Stops the counter and restores what `start` changed.
pub fn stop() {
    if let Some(cell) = BSP_PMU.get() {
        // SAFETY: at the end of the run, with NMIs from the counter about to stop; called once.
        let (s, l) = unsafe { (&mut *cell.sampler.get(), &mut *cell.lapic.get()) };
        let _ = s.disarm(&mut SafeMsrs, l);
    }
}
