//! The run loop's side of a vCPU's virtual PMU (`vpmu=`; the counting rules are
//! `hvprof_hypervisor::vcpu_pmu`'s): the guest's run measured at each exit, the instructions
//! exit handlers emulate, and PMIs handed to the vCPU's local APIC. The MSRs are
//! `vmexit/msr.rs`'s, RDPMC `vmexit/mod.rs`'s, CPUID leaf 0AH `vmexit/cpuid.rs`'s.
//!
//! **Telling the modes apart.** While an enabled counter counts one privilege mode only, every
//! change of mode must exit, or a run that makes a system call or takes an interrupt would count
//! wholly in one mode. The vCPU then runs on one of two EPTs of its own ([`ModeEpts`]), the VM's
//! mappings with execute permission only on the code pages seen run in that mode, and a page
//! executable in at most one of them: the first instruction fetched in the other mode is an EPT
//! violation (SDM Vol. 3C §29.3.3.2), at which the vCPU moves to the other EPT (a VMWRITE of the
//! EPTP: each EPT's cached translations are its own, tagged by its EP4TA, §29.4.1). A page seen
//! run in a mode becomes executable in that mode's EPT and stops being so in the other's (which
//! is then invalidated, §29.4.3.1). Each mode's code is learned once, page by page; after that a
//! change of mode costs one exit.

use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::GuestOps;
use crate::vm::{HostPhys, ModeEpts, Vm};
use alloc::format;
use alloc::string::String;
use hvprof_ept::{Access, Ept, EptViolation, Permissions};
use hvprof_hypervisor::vcpu_pmu::VcpuPmu;
use hvprof_hypervisor::vm_config::Vpmu;
use hvprof_pmu::virtual_pmu;
use hvprof_vmx::exit::InterruptionInfo;
use hvprof_vmx::instructions::{self, CurrentVmcs, InvEptType};
use hvprof_vmx::vmcs::{Control64, Guest32, GuestNatural, VmcsExt};

impl ModeEpts {
    fn new(vm: &Vm, single: bool) -> Result<ModeEpts, hvprof_ept::Error> {
        let copy = || -> Result<Ept<HostPhys>, hvprof_ept::Error> {
            let mut e = Ept::new(HostPhys, *vm.ept.caps())?;
            let mut result = Ok(());
            vm.ept.for_each_range(|r| {
                if result.is_ok() {
                    let mut perms = r.perms;
                    perms.remove(Permissions::EXECUTE);
                    let perms = if perms.is_empty() { r.perms } else { perms };
                    result = e.map(r.gpa, r.hpa, r.len, perms, r.memtype);
                }
            });
            result.map(|()| e)
        };
        let e = ModeEpts {
            user: copy()?,
            kernel: copy()?,
            single,
            pages: 0,
            switches: 0,
        };
        // Fresh tables at addresses an earlier EPT may have used (§29.4.3.1).
        e.invalidate(true);
        e.invalidate(false);
        Ok(e)
    }

    fn eptp(&self, user: bool) -> u64 {
        if user { &self.user } else { &self.kernel }.eptp(false)
    }

    /// INVEPT of mode `user`'s EPT on this pCPU.
    fn invalidate(&self, user: bool) {
        let kind = if self.single {
            InvEptType::SingleContext
        } else {
            InvEptType::AllContext
        };
        // SAFETY: VMX root operation (the run loop and exit handlers run in it); the VM's EPT
        // setup checked that INVEPT exists with this type; invalidating cached translations
        // cannot break memory safety.
        let r = unsafe { instructions::invept(kind, self.eptp(user)) };
        crate::vcpu::guest_ops::must(r, "INVEPT of a mode EPT");
    }

    /// Page `gpa` holds code of mode `user`: executable in its EPT, not in the other's.
    fn learn(&mut self, gpa: u64, user: bool) -> Result<(), hvprof_ept::Error> {
        let (this, other) = if user {
            (&mut self.user, &mut self.kernel)
        } else {
            (&mut self.kernel, &mut self.user)
        };
        if this.set_execute(gpa, true)? {
            self.pages += 1;
        }
        if other.set_execute(gpa, false)? {
            self.invalidate(!user);
        }
        Ok(())
    }
}

/// Before a VM entry of a vCPU with a virtual PMU: every change of mode exits while its counters
/// need it ([`hvprof_hypervisor::vcpu_pmu::VcpuPmu::wants_split`]), and no longer after.
pub fn sync_split(
    vm: &Vm,
    vcpu: &mut Vcpu,
    vmcs: &mut CurrentVmcs,
    single_invept: bool,
) -> Result<(), String> {
    let Some(pmu) = vcpu.pmu.as_mut() else {
        return Ok(());
    };
    let eptp = match (pmu.wants_split(), pmu.split()) {
        (true, None) => {
            let mut slot = vm.mode_epts[usize::from(vcpu.index)].lock();
            if slot.is_none() {
                *slot = Some(
                    ModeEpts::new(vm, single_invept)
                        .map_err(|e| format!("the virtual PMU's mode EPTs: {e}"))?,
                );
            }
            let user = vmcs.guest_cpl() != 0;
            pmu.set_split(Some(user));
            slot.as_ref().map_or(0, |e| e.eptp(user))
        }
        (false, Some(_)) => {
            pmu.set_split(None);
            vm.ept.eptp(false)
        }
        _ => return Ok(()),
    };
    vmcs.write64(Control64::EptPointer, eptp)
        .map_err(|e| format!("VMWRITE of the EPTP: {e}"))
}

/// An EPT violation of a vCPU whose modes are told apart: an instruction fetch from a page the
/// EPT of its mode does not let it run, where the VM's own EPT would. The guest changed mode (the
/// vCPU moves to the other EPT), or ran a page of its mode's code the first time. Either way the
/// page becomes code of the mode the guest is in, and the guest retries the fetch. `None`: not
/// such a violation; `Some(Err)`: the tables could not be changed.
pub fn on_fetch_violation(
    vm: &Vm,
    vcpu: &mut Vcpu,
    vmcs: &mut CurrentVmcs,
    v: &EptViolation,
) -> Option<Result<(), String>> {
    let pmu = vcpu.pmu.as_mut()?;
    let active = pmu.split()?;
    if !v.access().contains(Access::FETCH)
        || !vm
            .ept
            .translate(v.gpa)
            .is_some_and(|t| t.perms.contains(Permissions::EXECUTE))
    {
        return None;
    }
    // A fetch that faulted while an event was being delivered (IDT-vectoring information
    // valid, SDM Vol. 3C §28.2.4) is the handler's, in ring 0, though the saved CPL is still
    // the interrupted code's.
    let delivering = InterruptionInfo(
        vmcs.read32(hvprof_vmx::vmcs::ReadOnly32::IdtVectoringInfo)
            .unwrap_or(0),
    )
    .valid();
    let user = !delivering && vmcs.guest_cpl() != 0;
    let mut slot = vm.mode_epts[usize::from(vcpu.index)].lock();
    let epts = slot.as_mut()?;
    pmu.own_exit();
    if user != active {
        pmu.set_split(Some(user));
        epts.switches += 1;
        if let Err(e) = vmcs.write64(Control64::EptPointer, epts.eptp(user)) {
            return Some(Err(format!("VMWRITE of the EPTP: {e}")));
        }
    }
    Some(
        epts.learn(v.gpa, user)
            .map_err(|e| format!("the virtual PMU's mode EPTs at GPA {:#x}: {e}", v.gpa)),
    )
}

/// The vCPU runs on this pCPU after it ran on another: its mode EPTs' translations cached here
/// may be stale (the other pCPU took execute permissions away meanwhile).
pub fn after_move(vm: &Vm, vcpu: &Vcpu) {
    if let Some(e) = vm.mode_epts[usize::from(vcpu.index)].lock().as_ref() {
        e.invalidate(true);
        e.invalidate(false);
    }
}

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
    if pmu.hardware() {
        // A real counter of the guest's that wrapped (its NMI, if it asked for one, was this
        // exit or comes as one): its PMI is the guest's. A faulting RDMSR here would be a
        // hypervisor bug on a PMU its probe found counting; the next exit looks again.
        let _ = pmu.take_real_overflow(&mut crate::arch::msr::SafeMsrs);
    }
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

/// At a HLT: a PMI that waits for the rate limit goes to the local APIC now (`take_pmi_at_halt`).
pub fn deliver_pmi_at_halt(vm: &Vm, vcpu: &mut Vcpu) {
    deliver(vm, vcpu, VcpuPmu::take_pmi_at_halt);
}

/// Before a VM entry: a PMI that is due goes to the vCPU's local APIC. Returns whether one did
/// (its devices then need a look before the entry).
pub fn deliver_pmi(vm: &Vm, vcpu: &mut Vcpu) -> bool {
    deliver(vm, vcpu, VcpuPmu::take_pmi)
}

/// The PMI `take` gives, if any, to the vCPU's local APIC (its LVT performance counter entry),
/// counted as undelivered when nothing takes it (no local APIC, the entry masked). Whether it
/// was taken.
fn deliver(vm: &Vm, vcpu: &mut Vcpu, take: fn(&mut VcpuPmu) -> bool) -> bool {
    let Some(pmu) = vcpu.pmu.as_mut() else {
        return false;
    };
    if !take(pmu) {
        return false;
    }
    let taken =
        vm.apic && vm.devices.lock().lapics[usize::from(vcpu.index)].performance_interrupt();
    if !taken {
        pmu.undelivered();
    }
    taken
}

/// An exit that reads or writes the virtual PMU (its MSRs, RDPMC): the vCPU's PMU, with the
/// hardware backend its counters back from the real PMU first (the next entry puts them back),
/// and the exit booked as the vPMU's own. `Ok(None)`: the vCPU has none.
pub fn access(vcpu: &mut Vcpu) -> Result<Option<&mut VcpuPmu>, String> {
    save_hardware(vcpu)?;
    if let Some(p) = vcpu.pmu.as_mut() {
        p.own_exit();
        return Ok(Some(p));
    }
    Ok(None)
}

/// Ticks the guest may run before the PMU needs the run loop (its next PMI-enabled wrap, or a
/// held PMI's turn).
#[inline(always)]
pub fn ticks_to_next(vcpu: &Vcpu) -> Option<u64> {
    vcpu.pmu.as_ref().and_then(|p| p.ticks_to_next())
}

/// The hardware backend for a vCPU's virtual PMU, where the profiler's PMU sampler runs (its
/// probe found a counting PMU) and the CPU can load IA32_PERF_GLOBAL_CTRL at VM entry and exit
/// (SDM Vol. 3C §25.7.1, §25.8.1): the controls set in the vCPU's VMCS (`vmcs`, current) and the
/// counters placed. Elsewhere the emulated backend counts alone. `say`: print the boot-log line.
pub fn choose_backend(
    pmu: &mut hvprof_hypervisor::vcpu_pmu::VcpuPmu,
    vmcs: &mut CurrentVmcs,
    caps: &hvprof_vmx::caps::VmxCaps,
    name: &str,
    say: bool,
) -> Result<(), String> {
    use hvprof_vmx::caps::{entry, exit};
    use hvprof_vmx::vmcs::Control32;
    let Some((placement, host)) = crate::profiler::pmu::vpmu_backend() else {
        return Ok(());
    };
    if !caps.entry().allows(entry::LOAD_IA32_PERF_GLOBAL_CTRL)
        || !caps.exit().allows(exit::LOAD_IA32_PERF_GLOBAL_CTRL)
    {
        if say {
            crate::println!(
                "vm {name}: virtual PMU: emulated (the CPU cannot load IA32_PERF_GLOBAL_CTRL at VM entry and exit)"
            );
        }
        return Ok(());
    }
    let w = |vmcs: &mut CurrentVmcs, f: Control32, bit: u32| -> Result<(), String> {
        let v = vmcs.read32(f).map_err(|e| format!("VMREAD {f:?}: {e}"))?;
        vmcs.write32(f, v | bit)
            .map_err(|e| format!("VMWRITE {f:?}: {e}"))
    };
    w(
        vmcs,
        Control32::EntryControls,
        entry::LOAD_IA32_PERF_GLOBAL_CTRL,
    )?;
    w(
        vmcs,
        Control32::ExitControls,
        exit::LOAD_IA32_PERF_GLOBAL_CTRL,
    )?;
    pmu.set_hardware(placement, host);
    if say {
        crate::println!(
            "vm {name}: virtual PMU: hardware backend: its counters with IA32_PERF_GLOBAL_CTRL bits {:#x} are the real ones while a vCPU runs, the profiler's ({host:#x}) stays its own and the guest's counter of that index is emulated",
            placement.global_bits()
        );
    }
    Ok(())
}

/// Before the vCPU's first entry of a slice, with the hardware backend: its counters onto the
/// real PMU; and before each entry, IA32_PERF_GLOBAL_CTRL for the entry and the exit.
pub fn load_hardware(vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) -> Result<(), String> {
    use hvprof_vmx::vmcs::{Guest64, Host64};
    let Some(pmu) = vcpu.pmu.as_mut() else {
        return Ok(());
    };
    let Some((entry, exit)) = pmu.global_ctrl() else {
        return Ok(());
    };
    pmu.load_real(&mut crate::arch::msr::SafeMsrs)
        .map_err(|e| format!("the virtual PMU's counters: {e}"))?;
    vmcs.write64(Guest64::Ia32PerfGlobalCtrl, entry)
        .and_then(|()| vmcs.write64(Host64::Ia32PerfGlobalCtrl, exit))
        .map_err(|e| format!("VMWRITE of IA32_PERF_GLOBAL_CTRL: {e}"))
}

/// With the hardware backend: the vCPU's counters back from the real PMU (at the end of its
/// slice, or before its MSRs are read or written).
pub fn save_hardware(vcpu: &mut Vcpu) -> Result<(), String> {
    match vcpu.pmu.as_mut() {
        Some(pmu) if pmu.hardware() => pmu
            .save_real(&mut crate::arch::msr::SafeMsrs)
            .map_err(|e| format!("the virtual PMU's counters: {e}")),
        _ => Ok(()),
    }
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
         other architectural events count nothing; {pmi}, at most {} a second of the vCPU's own time and one per {} of its ticks",
        virtual_pmu::VERSION,
        virtual_pmu::GENERAL,
        virtual_pmu::FIXED,
        virtual_pmu::WIDTH,
        hvprof_hypervisor::vcpu_pmu::MAX_PMI_RATE,
        hvprof_hypervisor::vcpu_pmu::MIN_PMI_GAP
    );
}

/// The VM's virtual PMU for its end frame: the mode and each vCPU's counts.
pub fn end_frame(vm: &Vm) -> Option<hvprof_samplelog::VpmuEnd> {
    let mut end: Option<hvprof_samplelog::VpmuEnd> = None;
    for v in &vm.vcpus {
        let v = v.lock();
        let Some(pmu) = &v.pmu else {
            continue;
        };
        end.get_or_insert_with(|| hvprof_samplelog::VpmuEnd::new(pmu.mode() == Vpmu::Domain))
            .add(hvprof_samplelog::VpmuCounts {
                vcpu: v.index,
                ..pmu.stats
            });
    }
    end
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
            "vm {}: vCPU {} vpmu={}: {} guest ticks, {} emulated instructions, {} hypervisor ticks counted; {} PMIs delivered, {} held by the rate limit, {} with no taker; {} exits of its own, {} ticks",
            vm.name,
            v.index,
            pmu.mode().as_str(),
            s.guest_ticks,
            s.emulated,
            s.hypervisor_ticks,
            s.pmis,
            s.held,
            s.undelivered,
            s.exits,
            s.exit_ticks
        );
        if let Some(e) = vm.mode_epts[usize::from(v.index)].lock().as_ref() {
            crate::println!(
                "vm {}: vCPU {} vpmu: modes told apart by two EPTs: {} changes of mode, {} code pages learned",
                vm.name,
                v.index,
                e.switches,
                e.pages
            );
        }
    }
}
