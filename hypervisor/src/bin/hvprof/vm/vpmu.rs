//! The run loop's side of a vCPU's virtual PMU (`vpmu=`; the counting rules are
//! `hvprof_hypervisor::vcpu_pmu`'s): the guest's run measured at each exit, the instructions
//! exit handlers emulate, and PMIs handed to the vCPU's local APIC. The MSRs are
//! `vmexit/msr.rs`'s, RDPMC `vmexit/mod.rs`'s, CPUID leaf 0AH `vmexit/cpuid.rs`'s.

use crate::vcpu::Vcpu;
use crate::vm::Vm;
use hvprof_hypervisor::vm_config::Vpmu;
use hvprof_pmu::virtual_pmu;
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::vmcs::{Guest32, GuestNatural};

/// The timer ticks of a run that are not the guest's: the VM-entry instruction's own tick,
/// which Bochs counts after it started the timer (with `clock: sync=none` every instruction
/// retired is one tick, and a run of `k` guest instructions leaves `k + 1` ticks on the timer:
/// measured by the `pmu` guest's exact counts, `bochs-vpmu`). On hardware the timer starts with
/// the guest, and a tick per entry is a bias far below the emulated backend's precision there.
const ENTRY_TICK: u64 = 1;

/// After a VM exit: the guest's run since the entry, which the VMX-preemption timer measured
/// (`written` at the entry, what is left saved by the exit: SDM Vol. 3C §28.3.3; it counts down
/// once every 2^`shift` TSC ticks in VMX non-root operation only, §26.5.1), counted in the mode
/// of the exit.
#[inline(never)]
pub fn after_run(vcpu: &mut Vcpu, vmcs: &CurrentVmcs, written: u32, shift: u8) {
    let Some(pmu) = vcpu.pmu.as_mut() else {
        return;
    };
    let left = vmcs.read_fast(Guest32::PreemptionTimerValue) as u32;
    let ticks = (u64::from(written.saturating_sub(left)) << shift).saturating_sub(ENTRY_TICK);
    let ss = vmcs.read_fast(Guest32::SsAccessRights) as u32;
    let user = hvprof_vmx::guest::cpl_from_ss_access_rights(ss) != 0;
    pmu.guest_ran(ticks, user);
}

/// The guest's RIP before an exit handler runs, for a vCPU with a virtual PMU.
#[inline(always)]
pub fn rip_before(vcpu: &Vcpu, vmcs: &CurrentVmcs) -> Option<u64> {
    vcpu.pmu
        .is_some()
        .then(|| vmcs.read_fast(GuestNatural::Rip))
}

/// After the handler: an instruction it emulated (it moved RIP on) retired in the guest.
pub fn after_handler(vcpu: &mut Vcpu, vmcs: &CurrentVmcs, rip: u64) {
    if let Some(pmu) = vcpu.pmu.as_mut()
        && vmcs.read_fast(GuestNatural::Rip) != rip
    {
        pmu.emulated_instruction();
    }
}

/// The hypervisor's `ticks` on one of the vCPU's exits (counted in `vpmu=domain`).
#[inline(always)]
pub fn hypervisor_worked(vcpu: &mut Vcpu, ticks: u64) {
    if let Some(pmu) = vcpu.pmu.as_mut() {
        pmu.hypervisor_worked(ticks);
    }
}

/// Before a VM entry: a PMI that is due goes to the vCPU's local APIC. Returns whether one did
/// (its devices then need a look before the entry).
pub fn deliver_pmi(vm: &Vm, vcpu: &mut Vcpu) -> bool {
    let Some(pmu) = vcpu.pmu.as_mut() else {
        return false;
    };
    if !pmu.take_pmi() {
        return false;
    }
    let taken =
        vm.apic && vm.devices.lock().lapics[usize::from(vcpu.index)].performance_interrupt();
    if !taken {
        pmu.undelivered();
    }
    taken
}

/// Ticks the guest may run before the PMU needs the run loop (its next PMI-enabled wrap, or a
/// held PMI's turn).
#[inline(always)]
pub fn ticks_to_next(vcpu: &Vcpu) -> Option<u64> {
    vcpu.pmu.as_ref().and_then(|p| p.ticks_to_next())
}

/// The VM's boot-log line about its virtual PMU (`vpmu=`), if it has one.
pub fn describe(name: &str, vpmu: Vpmu, apic: bool) {
    let what = match vpmu {
        Vpmu::Off => return,
        Vpmu::Cpu => "cpu: the counters run while the vCPU runs guest code",
        Vpmu::Domain => {
            "domain: the counters run while the vCPU runs guest code and while the hypervisor \
             handles its exits (as OS-mode time)"
        }
    };
    let pmi = if apic {
        "PMIs through each vCPU's LVT performance counter entry"
    } else {
        "no PMIs (they need apic=on)"
    };
    crate::println!(
        "vm {name}: virtual PMU (vpmu={what}); version {}, {} general and {} fixed counters of {} \
         bits; emulated: instructions retired, core cycles and reference cycles from the vCPU's \
         own time, one TSC tick each (exact where a tick is an instruction, as in Bochs), the \
         other architectural events count nothing; {pmi}, at most {} a second of the vCPU's own time",
        virtual_pmu::VERSION,
        virtual_pmu::GENERAL,
        virtual_pmu::FIXED,
        virtual_pmu::WIDTH,
        hvprof_hypervisor::vcpu_pmu::MAX_PMI_RATE
    );
}

/// Each vCPU's virtual PMU at the end: what it counted and the PMIs it raised.
pub fn print_stats(vm: &Vm) {
    for v in &vm.vcpus {
        let v = v.lock();
        let Some(pmu) = &v.pmu else {
            continue;
        };
        let s = pmu.stats;
        crate::println!(
            "vm {}: vCPU {} vpmu={}: {} guest ticks, {} emulated instructions, {} hypervisor ticks counted; {} PMIs delivered, {} held by the rate limit, {} with no taker",
            vm.name,
            v.index,
            pmu.mode().as_str(),
            s.guest_ticks,
            s.emulated,
            s.hypervisor_ticks,
            s.pmis,
            s.held,
            s.undelivered
        );
    }
}
