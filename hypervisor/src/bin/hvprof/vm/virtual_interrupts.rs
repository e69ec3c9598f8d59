//! Virtual interrupts: the lines of a Linux guest's legacy devices (8254 PIT on IRQ 0, the 16550
//! on IRQ 4) go through its 8259 pair, and the vector the PICs deliver is injected at the next VM
//! entry when the guest can take it (RFLAGS.IF set, no STI or MOV SS blocking), else
//! "interrupt-window exiting" stops the guest as soon as it can (Intel SDM Vol. 3C §26.7.5,
//! §27.6 "Event Injection"). An event whose delivery a VM exit interrupted is delivered again
//! first (§28.2.4, IDT-vectoring information).

use super::Vm;
use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::must;
use hvprof_vmx::caps::{VmxCaps, proc1};
use hvprof_vmx::exit::{InterruptionInfo, InterruptionType};
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::vmcs::{Control32, Guest32, GuestNatural, Interruptibility, ReadOnly32, VmcsExt};

/// RFLAGS.IF.
const RFLAGS_IF: u64 = 1 << 9;

/// After a VM exit: an event the exit interrupted in delivery (an interrupt, an exception) is
/// set up to be delivered again at the next entry, as the SDM requires (§28.2.4, §27.6).
pub fn redeliver_interrupted_event(vmcs: &mut CurrentVmcs) {
    let info = InterruptionInfo(must(
        vmcs.read32(ReadOnly32::IdtVectoringInfo),
        "VMREAD IDT-vectoring info",
    ));
    if !info.valid() {
        return;
    }
    // Bit 12 is undefined in IDT-vectoring information and must be 0 at entry.
    must(
        vmcs.write32(
            Control32::EntryInterruptionInfo,
            info.0 & !InterruptionInfo::NMI_UNBLOCKING,
        ),
        "VMWRITE entry interruption info",
    );
    if info.error_code_valid() {
        let code = must(
            vmcs.read32(ReadOnly32::IdtVectoringErrorCode),
            "VMREAD IDT-vectoring error code",
        );
        must(
            vmcs.write32(Control32::EntryExceptionErrorCode, code),
            "VMWRITE entry error code",
        );
    }
    if matches!(
        info.kind(),
        InterruptionType::SoftwareInterrupt
            | InterruptionType::SoftwareException
            | InterruptionType::PrivilegedSoftwareException
    ) {
        let len = must(
            vmcs.read32(ReadOnly32::ExitInstructionLength),
            "VMREAD exit instruction length",
        );
        must(
            vmcs.write32(Control32::EntryInstructionLength, len),
            "VMWRITE entry instruction length",
        );
    }
}

/// Before a VM entry of a Linux guest: brings its devices up to `now`, then injects the vector
/// the PICs have for it, or asks for an exit as soon as it can take one. Returns the TSC of the
/// devices' next event (the guest must stop then, to raise it), and whether an interrupt is
/// still waiting after this entry (the devices must be looked at again at the next exit).
pub fn before_entry(
    vm: &Vm,
    vcpu: &mut Vcpu,
    vmcs: &mut CurrentVmcs,
    caps: &VmxCaps,
    now: u64,
) -> (Option<u64>, bool) {
    let mut guard = vm.devices.lock();
    let dev = &mut guard.board;
    dev.update(now);
    let next = dev.next_event(now);
    if dev.pic.pending().is_none() {
        set_window_exiting(vcpu, vmcs, false);
        return (next, false);
    }
    // Only vCPU 0 takes the PICs' interrupts (they are wired to the bootstrap processor).
    if vcpu.index != 0 {
        return (next, false);
    }
    let busy = InterruptionInfo(must(
        vmcs.read32(Control32::EntryInterruptionInfo),
        "VMREAD entry interruption info",
    ))
    .valid();
    let rflags = must(vmcs.read_natural(GuestNatural::Rflags), "VMREAD RFLAGS");
    let blocking = Interruptibility::from_bits_truncate(must(
        vmcs.read32(Guest32::InterruptibilityState),
        "VMREAD interruptibility",
    ));
    let open = rflags & RFLAGS_IF != 0
        && !blocking
            .intersects(Interruptibility::BLOCKING_BY_STI | Interruptibility::BLOCKING_BY_MOV_SS);
    if open && !busy {
        if let Some(vector) = dev.pic.acknowledge() {
            must(
                vmcs.write32(
                    Control32::EntryInterruptionInfo,
                    InterruptionInfo::external_interrupt(vector).0,
                ),
                "VMWRITE entry interruption info",
            );
            vcpu.interrupts_injected += 1;
        }
        // Another one may wait behind it: the window opens again after its delivery.
        set_window_exiting(vcpu, vmcs, dev.pic.pending().is_some());
    } else if caps.procbased().allows(proc1::INTERRUPT_WINDOW_EXITING) {
        set_window_exiting(vcpu, vmcs, true);
    }
    (next, dev.pic.pending().is_some())
}

/// Whether a Linux guest that executed HLT has something to wake it now (an interrupt the PICs
/// would deliver, with RFLAGS.IF set), and else when its devices' next event falls.
pub fn on_halt(vm: &Vm, vmcs: &CurrentVmcs, now: u64) -> Result<(), Option<u64>> {
    let mut guard = vm.devices.lock();
    let dev = &mut guard.board;
    dev.update(now);
    let rflags = must(vmcs.read_natural(GuestNatural::Rflags), "VMREAD RFLAGS");
    if rflags & RFLAGS_IF != 0 && dev.pic.pending().is_some() {
        return Ok(());
    }
    Err(if rflags & RFLAGS_IF != 0 {
        dev.next_event(now)
    } else {
        None
    })
}

fn set_window_exiting(vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs, on: bool) {
    let want = if on {
        vcpu.proc1 | proc1::INTERRUPT_WINDOW_EXITING
    } else {
        vcpu.proc1 & !proc1::INTERRUPT_WINDOW_EXITING
    };
    if want != vcpu.proc1 {
        vcpu.proc1 = want;
        must(
            vmcs.write32(Control32::PrimaryProcBasedControls, want),
            "VMWRITE primary processor-based controls",
        );
    }
}
