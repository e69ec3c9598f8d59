//! VM-exit dispatch: one function per exit reason the test guests can cause (docs/GUEST-ABI.md
//! says what each does from the guest's side). Exit reasons and qualifications are decoded by the
//! `hvprof-vmx` crate (Intel SDM Vol. 3C chapter 28, Appendix C).
//!
//! A handler either resumes the guest (returns `None`) or stops this VM with a report
//! (`Some(Stop)`); a guest can never stop the hypervisor or another VM. HLT blocks the vCPU
//! ([`Flow::Halt`]).

pub mod apic_access;
mod cpuid;
mod fatal;
mod guest_memory;
mod io;
mod msr;
mod output;
mod string_io;
mod vmcall;

use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::{GuestOps, must};
use crate::vm::virtual_interrupts;
use crate::vm::{Stop, Vm};
use alloc::format;
use alloc::string::String;
use core::fmt::Write;
use fatal::fatal;
use hvprof_ept::EptViolation;
use hvprof_vmx::exit::{BasicExit, ExitReason, InterruptionInfo, InterruptionType};
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::vmcs::{GuestNatural, ReadOnly32, ReadOnly64, ReadOnlyNatural, VmcsExt};

/// What the run loop does after an exit.
pub enum Flow {
    /// Enter the guest again.
    Resume,
    /// The vCPU executed HLT: it blocks until its virtual timer fires.
    Halt,
    /// The vCPU spun (a pause-loop exit): it gives up the rest of its slice.
    Yield,
    /// The VM (or this vCPU, for an exit code) stops.
    Stop(Stop),
}

/// Handles one VM exit of `vm`, whose VMCS is current.
pub fn handle(vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs, reason: ExitReason) -> Flow {
    // The local APIC's state is the CPU's while the guest runs with virtual-interrupt delivery:
    // the model has it back before a handler that reads it (HLT asks whether an interrupt
    // waits; the APIC exits read and write registers; an EPT violation may be an access on the
    // page). The others at most add vectors (`Lapic::accept` keeps them apart) or set the
    // TSC deadline, and leave the taking back to the next VM entry's look (`before_entry`).
    let kind = reason.kind();
    if vcpu.virtual_apic != 0
        && matches!(
            kind,
            Some(
                BasicExit::Hlt
                    | BasicExit::ApicAccess
                    | BasicExit::ApicWrite
                    | BasicExit::VirtualizedEoi
                    | BasicExit::EptViolation
            )
        )
    {
        crate::vm::virtual_apic::take_back_locked(vm, vcpu, vmcs);
    }
    if kind == Some(BasicExit::Hlt) {
        // HLT blocks the vCPU until an event: the scheduler runs something else and resumes it
        // after the HLT when its virtual timer fires (docs/GUEST-ABI.md, "Time"), or, for a
        // VM with interrupt controllers (Linux, `apic=on`), when its devices raise an
        // interrupt it takes (none pending now). A single-stepped HLT does not block: its
        // #DB trap is an event, delivered at once (SDM Vol. 3A §6.9).
        vmcs.skip_instruction();
        if hvprof_vmx::guest::single_step_pending(vmcs).unwrap_or(false) {
            return Flow::Resume;
        }
        // A virtual PMU's PMI that waits for the rate limit goes now: a halted vCPU runs no
        // guest time to let it through.
        crate::vm::vpmu::deliver_pmi_at_halt(vm, vcpu);
        if vm.delivers_interrupts() {
            match virtual_interrupts::on_halt(vm, vcpu.index, vmcs, crate::tsc::rdtsc()) {
                Ok(()) => return Flow::Resume,
                Err(wake) => {
                    vcpu.wake_at = match (vcpu.wake_at, wake) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                }
            }
        }
        return Flow::Halt;
    }
    if kind == Some(BasicExit::Pause) {
        // Only pause-loop exiting makes PAUSE exit (`vm/pause_loop.rs`; "PAUSE exiting" is
        // off): the guest spun at CPL 0 for PLE_Window ticks. KVM skips the PAUSE too: the loop
        // goes on with its next test when the vCPU runs again.
        vcpu.spins
            .record(vmcs.read_natural(GuestNatural::Rip).unwrap_or(0));
        vmcs.skip_instruction();
        return Flow::Yield;
    }
    match handle_exit(vm, vcpu, vmcs, reason, kind) {
        None => Flow::Resume,
        Some(stop) => Flow::Stop(stop),
    }
}

fn handle_exit(
    vm: &Vm,
    vcpu: &mut Vcpu,
    vmcs: &mut CurrentVmcs,
    reason: ExitReason,
    kind: Option<BasicExit>,
) -> Option<Stop> {
    match kind {
        Some(BasicExit::Cpuid) => cpuid::handle(vm, vcpu, vmcs),
        Some(BasicExit::IoInstruction) => {
            let access = hvprof_vmx::exit::IoAccess::decode(vmcs.exit_qualification().unwrap_or(0));
            vcpu.stats.record_port(access.port);
            if access.string {
                string_io::handle(vm, vcpu, vmcs, &access)
            } else {
                io::handle(vm, vcpu, vmcs, &access)
            }
        }
        Some(BasicExit::Rdmsr) => msr::rdmsr(vm, vcpu, vmcs),
        Some(BasicExit::Wrmsr) => msr::wrmsr(vm, vcpu, vmcs),
        Some(BasicExit::Vmcall) => vmcall::handle(vm, vcpu, vmcs),
        // The deadline check before the next VM entry decides whether the budget is spent.
        Some(BasicExit::PreemptionTimer) => None,
        // The guest can take an interrupt now: the next VM entry injects it.
        Some(BasicExit::InterruptWindow) => None,
        // The guest stopped blocking NMIs: the next VM entry injects the waiting one.
        Some(BasicExit::NmiWindow) => None,
        Some(BasicExit::ExternalInterrupt) => {
            // "Acknowledge interrupt on exit" took the vector (SDM Vol. 3C §28.2.2), so it is
            // in service at the local APIC and needs its EOI. The sources the hypervisor
            // enables are the profiler's LAPIC timer (one that fired just before the VM entry
            // arrives here; the guest's sample is taken by the exit path) and other pCPUs'
            // kicks. Anything else is noted.
            let info = InterruptionInfo(vmcs.read32(ReadOnly32::ExitInterruptionInfo).unwrap_or(0));
            let vector = info.vector();
            if vector == crate::arch::host_apic::KICK_VECTOR {
                // Another pCPU's kick: the run loop looks at this vCPU's IPIs before the entry.
                crate::profiler::sampler::on_kick();
                return None;
            }
            if vector != crate::arch::host_apic::TIMER_VECTOR {
                crate::vm_report!(
                    vm,
                    "note: external interrupt vector {vector} while the guest ran"
                );
            }
            if vector != crate::arch::host_apic::SPURIOUS_VECTOR {
                crate::profiler::this_cpu().eoi();
            }
            None
        }
        Some(BasicExit::ExceptionNmi) => {
            let info = InterruptionInfo(vmcs.read32(ReadOnly32::ExitInterruptionInfo).unwrap_or(0));
            if info.kind() == InterruptionType::Nmi {
                // NMI exiting: an NMI that hit the guest. The PMU's overflow is a guest sample;
                // any other NMI belongs to the platform, not to the guest, and is reported.
                let now = crate::tsc::rdtsc();
                if let Some(sampled) = crate::profiler::pmu::on_nmi_exit(vmcs, now) {
                    // A Linux guest's sample is followed by its task, as at a deadline's exit.
                    let prof = crate::profiler::this_cpu();
                    crate::vm::linux_tasks::after_guest_sample(prof, vm, vcpu, vmcs, &sampled);
                } else if vcpu.pmu.as_mut().is_some_and(|p| p.took_overflow()) {
                    // A guest counter's overflow on the real PMU (the hardware backend): its PMI
                    // is the guest's; the host's LVT entry, which the PMI masked, opens again.
                    crate::profiler::pmu::unmask_lvt();
                } else if !crate::profiler::pmu::guest_overflow_nmi() {
                    crate::vm_report!(
                        vm,
                        "note: an NMI not from the profiler's counter hit the guest"
                    );
                }
                None
            } else {
                // The exception bitmap is 0: no guest exception should exit.
                Some(fatal(
                    vcpu,
                    vmcs,
                    format!("unexpected exception exit ({info:?})"),
                ))
            }
        }
        Some(BasicExit::Invd | BasicExit::Wbinvd) => {
            // Caches are coherent and the guest owns no device: nothing to do (and a guest may
            // not stall the pCPU writing back every cache line).
            vmcs.skip_instruction();
            None
        }
        Some(BasicExit::Monitor | BasicExit::Mwait) => {
            // MONITOR arms nothing and MWAIT returns at once: MWAIT may always return early
            // (SDM Vol. 2B, MWAIT), and a guest may not put the pCPU into a C-state where the
            // VMX-preemption timer stops. CPUID does not offer them.
            vmcs.skip_instruction();
            None
        }
        Some(BasicExit::Rdpmc) => {
            // The real performance counters are the profiler's: a guest reads only its virtual
            // PMU's (`vpmu=`), as RDPMC allows at its CPL (SDM Vol. 2B, RDPMC), and without one
            // RDPMC is #GP.
            const CR4_PCE: u64 = 1 << 8;
            let pce = cr_context(vmcs).cr4 & CR4_PCE != 0;
            let cpl = vmcs.guest_cpl();
            let ecx = vcpu.regs.rcx as u32;
            let value = match crate::vm::vpmu::access(vcpu) {
                Ok(pmu) => pmu.and_then(|p| p.rdpmc(ecx, cpl, pce)),
                Err(e) => return Some(Stop::Fault(e)),
            };
            match value {
                Some(v) => {
                    vcpu.regs.rax = v & 0xffff_ffff;
                    vcpu.regs.rdx = v >> 32;
                    vmcs.skip_instruction();
                }
                None => vmcs.inject_exception(13, Some(0)),
            }
            None
        }
        Some(BasicExit::Xsetbv) => xsetbv(vcpu, vmcs),
        Some(
            BasicExit::Vmclear
            | BasicExit::Vmlaunch
            | BasicExit::Vmptrld
            | BasicExit::Vmptrst
            | BasicExit::Vmread
            | BasicExit::Vmresume
            | BasicExit::Vmwrite
            | BasicExit::Vmxoff
            | BasicExit::Vmxon
            | BasicExit::Invept
            | BasicExit::Invvpid
            | BasicExit::Getsec
            | BasicExit::Vmfunc,
        ) => {
            // VMX is hidden from guests (CPUID.1:ECX.VMX = 0): these are invalid opcodes.
            vmcs.inject_exception(6, None);
            None
        }
        Some(BasicExit::CrAccess) => cr_access(vm, vcpu, vmcs),
        Some(BasicExit::TripleFault) => Some(fatal(vcpu, vmcs, String::from("triple fault"))),
        // With the CPU's APIC virtualization (vm/virtual_apic.rs, SDM Vol. 3C §29.4-29.1.4).
        Some(BasicExit::ApicAccess) => apic_access::apic_access(vm, vcpu, vmcs),
        Some(BasicExit::ApicWrite) => apic_access::apic_write(vm, vcpu, vmcs),
        Some(BasicExit::VirtualizedEoi) => apic_access::virtualized_eoi(vm, vcpu, vmcs),
        Some(BasicExit::EptViolation)
            if apic_access::is_apic_page(
                vm,
                vcpu.index,
                vmcs.read64(ReadOnly64::GuestPhysicalAddress).unwrap_or(0),
            ) =>
        {
            let gpa = vmcs.read64(ReadOnly64::GuestPhysicalAddress).unwrap_or(0);
            apic_access::mmio(vm, vcpu, vmcs, gpa)
        }
        Some(BasicExit::EptViolation) => {
            let v = EptViolation::new(
                vmcs.exit_qualification().unwrap_or(0),
                vmcs.read64(ReadOnly64::GuestPhysicalAddress).unwrap_or(0),
            );
            // A virtual PMU's change of mode, or a page of its mode's code met first.
            match crate::vm::vpmu::on_fetch_violation(vm, vcpu, vmcs, &v) {
                Some(Ok(())) => return None,
                Some(Err(e)) => return Some(fatal(vcpu, vmcs, e)),
                None => {}
            }
            let mut what = format!("EPT violation: {v}");
            if v.linear_address_valid() {
                let la = vmcs
                    .read_natural(ReadOnlyNatural::GuestLinearAddress)
                    .unwrap_or(0);
                let _ = write!(what, ", guest linear address {la:#x}");
            }
            let _ = write!(what, "; guest memory is GPA 0x0-{:#x}", vm.mem_size);
            Some(fatal(vcpu, vmcs, what))
        }
        Some(BasicExit::EptMisconfig) => {
            let gpa = vmcs.read64(ReadOnly64::GuestPhysicalAddress).unwrap_or(0);
            let walk = vm.ept.walk(gpa);
            Some(fatal(
                vcpu,
                vmcs,
                format!("EPT misconfiguration at GPA {gpa:#x} (a hypervisor bug): {walk:?}"),
            ))
        }
        _ => Some(fatal(
            vcpu,
            vmcs,
            format!(
                "unhandled VM exit {reason} (qualification {:#x})",
                vmcs.exit_qualification().unwrap_or(0)
            ),
        )),
    }
}

/// XSETBV (exit reason 55, unconditional): the guest's XCR0, kept per vCPU and on the CPU while
/// the vCPU runs (`vcpu::fpu`): x87|SSE, and AVX where the host has it.
fn xsetbv(vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) -> Option<Stop> {
    use crate::vcpu::fpu;
    let index = vcpu.regs.rcx as u32;
    let value = (vcpu.regs.rdx << 32) | (vcpu.regs.rax & 0xffff_ffff);
    // SDM Vol. 2D, XSETBV: #GP for CPL > 0, index != 0, bit 0 clear, AVX without SSE, and bits
    // not supported (here: anything but x87, SSE and AVX).
    if vmcs.guest_cpl() != 0 || index != 0 || !fpu::valid_guest_xcr0(value) {
        vmcs.inject_exception(13, Some(0));
        return None;
    }
    vcpu.fpu.xcr0 = value;
    // SAFETY: the vCPU's state is on this CPU (loaded for its slice); `value` is a valid XCR0
    // (checked above), and CR4.OSXSAVE is set wherever a guest can reach XSETBV.
    unsafe { fpu::xsetbv(value) };
    vmcs.skip_instruction();
    None
}

/// MOV to CR0/CR4 touching bits the host owns (SDM Vol. 3C §28.2.1 Table 28-3, §25.6.6): the guest
/// sees what it wrote (read shadow); the CPU runs with the VMX fixed bits forced.
fn cr_access(vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) -> Option<Stop> {
    use hvprof_vmx::exit::{CrAccess, CrAccessType};
    use hvprof_vmx::vmcs::ControlNatural;
    let q = CrAccess::decode(vmcs.exit_qualification().unwrap_or(0));
    if q.cr == 8 {
        return cr8_access(vm, vcpu, vmcs, &q);
    }
    if q.access != CrAccessType::MovToCr {
        return Some(fatal(
            vcpu,
            vmcs,
            format!("unexpected control-register access {q:?}"),
        ));
    }
    let value = cr_source(vcpu, vmcs, q.gpr);
    // A value the CPU itself would refuse is the guest's #GP, not a failed VM entry.
    let ctx = cr_context(vmcs);
    let faults = match q.cr {
        0 => hvprof_vmx::guest::cr0_write_faults(value, &ctx),
        4 => hvprof_vmx::guest::cr4_write_faults(value, vcpu.fixed.cr4.1, &ctx),
        _ => false,
    };
    if faults {
        vmcs.inject_exception(13, Some(0));
        return None;
    }
    match q.cr {
        0 => {
            must(
                vmcs.write_natural(ControlNatural::Cr0ReadShadow, value),
                "VMWRITE CR0 shadow",
            );
            must(
                vmcs.write_natural(GuestNatural::Cr0, vcpu.force_cr0(value)),
                "VMWRITE guest CR0",
            );
        }
        4 => {
            must(
                vmcs.write_natural(ControlNatural::Cr4ReadShadow, value),
                "VMWRITE CR4 shadow",
            );
            must(
                vmcs.write_natural(GuestNatural::Cr4, vcpu.force_cr4(value)),
                "VMWRITE guest CR4",
            );
        }
        _ => return Some(fatal(vcpu, vmcs, format!("unexpected MOV to CR{}", q.cr))),
    }
    vmcs.skip_instruction();
    None
}

/// The general register a MOV to a control register reads (RSP lives in the VMCS, the others in
/// the saved registers).
fn cr_source(vcpu: &Vcpu, vmcs: &CurrentVmcs, gpr: hvprof_vmx::regs::Gpr) -> u64 {
    if gpr == hvprof_vmx::regs::Gpr::Rsp {
        vmcs.read_natural(GuestNatural::Rsp).unwrap_or(0)
    } else {
        vcpu.regs.get(gpr).unwrap_or(0)
    }
}

/// MOV to and from CR8 (CR8-load and CR8-store exiting): the guest's own task-priority register,
/// which never reaches the physical one (where it would mask the hypervisor's timer interrupt,
/// and stay set for the next VM). Bits 63:4 are reserved: MOV to CR8 of a value with any of them
/// set is #GP (SDM Vol. 3A §11.8.6.5, Vol. 2B MOV). With a local APIC (`apic=on`) CR8 is its
/// TPR's bits 7:4 (§11.8.6.5: CR8[3:0] = TPR[7:4], TPR[3:0] = 0 on a write), so a write
/// changes which interrupts the vCPU takes; with the CPU's APIC virtualization the CPU serves
/// CR8 from the virtual TPR without an exit (vm/virtual_apic.rs), and an exit here means it
/// could not turn CR8 exiting off.
fn cr8_access(
    vm: &Vm,
    vcpu: &mut Vcpu,
    vmcs: &mut CurrentVmcs,
    q: &hvprof_vmx::exit::CrAccess,
) -> Option<Stop> {
    use hvprof_hypervisor::devices::lapic::reg;
    use hvprof_vmx::exit::CrAccessType;
    use hvprof_vmx::regs::Gpr;
    match q.access {
        CrAccessType::MovToCr => {
            let value = cr_source(vcpu, vmcs, q.gpr);
            if value >> 4 != 0 {
                vmcs.inject_exception(13, Some(0));
                return None;
            }
            if vm.apic {
                // A TPR write has no effect to carry out (no IPI, no EOI, no timer change).
                let _ = with_lapic(vm, vcpu, vmcs, |l, now| {
                    l.write(reg::TPR, (value as u32) << 4, now)
                });
            } else {
                vcpu.cr8 = value;
            }
        }
        CrAccessType::MovFromCr => {
            let cr8 = if vm.apic {
                with_lapic(vm, vcpu, vmcs, |l, now| {
                    u64::from(l.read(reg::TPR, now) >> 4)
                })
            } else {
                vcpu.cr8
            };
            if q.gpr == Gpr::Rsp {
                must(
                    vmcs.write_natural(GuestNatural::Rsp, cr8),
                    "VMWRITE guest RSP",
                );
            } else if let Some(r) = vcpu.regs.get_mut(q.gpr) {
                *r = cr8;
            }
        }
        other => {
            return Some(fatal(
                vcpu,
                vmcs,
                format!("unexpected CR8 access {other:?}"),
            ));
        }
    }
    vmcs.skip_instruction();
    None
}

/// `f` on vCPU `vcpu`'s local APIC model, under the VM's device lock, after the model took back
/// what the CPU's APIC virtualization held (a no-op without it), at TSC `now`.
fn with_lapic<R>(
    vm: &Vm,
    vcpu: &mut Vcpu,
    vmcs: &CurrentVmcs,
    f: impl FnOnce(&mut hvprof_hypervisor::devices::lapic::Lapic, u64) -> R,
) -> R {
    let mut dev = vm.devices.lock();
    let lapic = &mut dev.lapics[usize::from(vcpu.index)];
    crate::vm::virtual_apic::take_back(vcpu, vmcs, lapic);
    f(lapic, crate::tsc::rdtsc())
}

/// The guest's view of its control registers (host-owned bits from the read shadows, SDM Vol. 3C
/// §25.6.6), EFER, CR3 and CS.L: what a MOV to CR0/CR4 is checked against.
fn cr_context(vmcs: &CurrentVmcs) -> hvprof_vmx::guest::CrContext {
    use hvprof_vmx::vmcs::{ControlNatural, Guest64};
    let ctl = |f: ControlNatural| vmcs.read_natural(f).unwrap_or(0);
    let guest = |f: GuestNatural| vmcs.read_natural(f).unwrap_or(0);
    let view = |real: u64, mask: ControlNatural, shadow: ControlNatural| {
        let m = ctl(mask);
        (real & !m) | (ctl(shadow) & m)
    };
    hvprof_vmx::guest::CrContext {
        cr0: view(
            guest(GuestNatural::Cr0),
            ControlNatural::Cr0GuestHostMask,
            ControlNatural::Cr0ReadShadow,
        ),
        cr4: view(
            guest(GuestNatural::Cr4),
            ControlNatural::Cr4GuestHostMask,
            ControlNatural::Cr4ReadShadow,
        ),
        efer: vmcs.read64(Guest64::Ia32Efer).unwrap_or(0),
        cr3: guest(GuestNatural::Cr3),
        cs_long: vmcs
            .read32(hvprof_vmx::vmcs::Guest32::CsAccessRights)
            .unwrap_or(0)
            & (1 << 13)
            != 0,
    }
}
