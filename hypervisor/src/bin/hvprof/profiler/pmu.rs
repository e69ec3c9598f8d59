//! The PMU sampling source, where a functional probe found a counting PMU (real hardware, nested
//! KVM with `pmu=on`): the paper's CPU_CLK_UNHALTED.REF sampler. The counter overflows every
//! `period` reference cycles; its PMI arrives as an NMI through the LAPIC's LVT PMI entry. In a
//! guest, "NMI exiting" turns it into exit reason 0 and the guest is sampled from the VMCS
//! (`on_nmi_exit`); in the hypervisor, the NMI handler samples its own interrupt frame
//! (`on_nmi_host`). The counter logic (arming, overflow detection, re-arm and unmask) is
//! `hvprof_pmu::sampler`, unit-tested on the host against a model of the MSRs.

use crate::arch::host_apic::{self, Lapic};
use crate::arch::msr::SafeMsrs;
use crate::percpu::{self, MAX_CPUS};
use hvprof_pmu::hardware_vpmu::Placement;
use hvprof_pmu::percpu::PerCpuSamplers;
use hvprof_pmu::probe::PmuInfo;
use hvprof_pmu::sampler::{self, CounterChoice, Event, Sampler, SamplerCaps};
use hvprof_vmx::instructions::CurrentVmcs;

/// The LVT PMI entry of this CPU's local APIC, for the sampler.
struct LvtPmi(Lapic);

impl sampler::Lapic for LvtPmi {
    fn write_lvt_pmi(&mut self, value: u32) {
        self.0.write(host_apic::REG_LVT_PMI, value);
    }
    fn read_lvt_pmi(&self) -> u32 {
        self.0.read(host_apic::REG_LVT_PMI)
    }
}

/// Every pCPU's sampler, each armed and serviced by its own pCPU (`hvprof_pmu::percpu`).
static SAMPLERS: PerCpuSamplers<LvtPmi, MAX_CPUS> = PerCpuSamplers::new();

/// The guests' virtual PMUs' hardware backend (`hvprof_pmu::hardware_vpmu`), where this PMU
/// counts: the counters guests may have, and the profiler's bit in IA32_PERF_GLOBAL_CTRL.
static VPMU_BACKEND: spin::Once<(Placement, u64)> = spin::Once::new();

/// The counters a guest's virtual PMU may run on and the profiler's IA32_PERF_GLOBAL_CTRL bit,
/// where the PMU sampler is armed (the same on every pCPU).
pub fn vpmu_backend() -> Option<(Placement, u64)> {
    VPMU_BACKEND.get().copied()
}

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
    let counter = sampler.counter();
    VPMU_BACKEND.call_once(|| {
        let host = match counter {
            CounterChoice::Fixed(i) => 1 << (32 + u32::from(i)),
            CounterChoice::General(i) => 1 << i,
        };
        (
            Placement::new(info, caps.full_width_write, Some(counter)),
            host,
        )
    });
    // SAFETY: called by `profiler::start` on this pCPU, for this pCPU's number, with its own MSRs
    // and LAPIC, before its counter is armed (no PMI yet) and once.
    unsafe { SAMPLERS.arm(percpu::index(), sampler, LvtPmi(lapic), &mut SafeMsrs) }
        .map_err(|e| alloc::format!("{e}"))
}

fn ours() -> bool {
    // SAFETY: NMI context (the NMI handler, or the exit path right after an NMI VM exit, NMIs
    // blocked) on this pCPU, with its own MSRs.
    unsafe { SAMPLERS.on_nmi(percpu::index(), &mut SafeMsrs) }
}

/// After a PMI that was not the profiler's: if a guest's counter on the real PMU wrapped (its
/// bit in IA32_PERF_GLOBAL_STATUS, which the vCPU's run loop moves into its virtual PMU), the
/// LVT entry the PMI masked is unmasked, so that the profiler's PMIs go on. Whether it was one.
pub fn guest_overflow_nmi() -> bool {
    let Some((placement, _)) = vpmu_backend() else {
        return false;
    };
    let status = crate::arch::msr::read_safe(hvprof_pmu::probe::msr::IA32_PERF_GLOBAL_STATUS);
    if status.map_or(true, |s| s & placement.global_bits() == 0) {
        return false;
    }
    unmask_lvt();
    true
}

/// The LVT PMI entry back to NMI delivery, unmasked (a PMI masks it: Vol. 3A §12.5.1).
pub fn unmask_lvt() {
    super::sampler::this_cpu().write_lapic(host_apic::REG_LVT_PMI, sampler::lvt::NMI_UNMASKED);
}

/// From the NMI handler: `true` when the NMI was the counter's overflow (and the hypervisor was
/// sampled at `rip`), or a guest counter's (`guest_overflow_nmi`).
pub fn on_nmi_host(rip: u64, fp: u64) -> bool {
    if !ours() {
        return guest_overflow_nmi();
    }
    super::sampler::this_cpu().sample_host(rip, fp, false, crate::tsc::rdtsc());
    true
}

/// After an NMI VM exit: the guest's sample when the NMI was the counter's overflow.
pub fn on_nmi_exit(vmcs: &CurrentVmcs, now: u64) -> Option<super::sampler::GuestSampled> {
    if !ours() {
        return None;
    }
    // The exit's handler runs with interrupts on; the guest sample path wants them off.
    Some(x86_64::instructions::interrupts::without_interrupts(|| {
        super::sampler::this_cpu().sample_guest(vmcs, now)
    }))
}

/// Stops this pCPU's counter and restores what `start` changed.
pub fn stop() {
    // SAFETY: at the end of the run on this pCPU, for its own number and MSRs; its NMI path stops
    // looking at the sampler first.
    let _ = unsafe { SAMPLERS.disarm(percpu::index(), &mut SafeMsrs) };
}
