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
use hvprof_pmu::percpu::PerCpuSamplers;
use hvprof_pmu::probe::PmuInfo;
use hvprof_pmu::sampler::{self, Event, Sampler, SamplerCaps};
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

/// From the NMI handler: `true` when the NMI was the counter's overflow (and the hypervisor was
/// sampled at `rip`).
pub fn on_nmi_host(rip: u64, fp: u64) -> bool {
    if !ours() {
        return false;
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
