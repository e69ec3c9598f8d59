//! Virtual interrupts: the lines of a Linux guest's legacy devices (8254 PIT on IRQ 0, the 16550
//! on IRQ 4) go through its 8259 pair; with `apic=on` each vCPU also has a local APIC (its timer,
//! IPIs), through whose LINT0 the 8259 reaches vCPU 0. The vector the local APIC or the PICs
//! deliver is injected at the next VM entry when the guest can take it (RFLAGS.IF set, no STI or MOV SS blocking), else
//! "interrupt-window exiting" stops the guest as soon as it can (Intel SDM Vol. 3C §26.7.5,
//! §27.6 "Event Injection"). An event whose delivery a VM exit interrupted is delivered again
//! first (§28.2.4, IDT-vectoring information). An NMI the local APIC latched (an NMI IPI) goes
//! before them all, when the guest is not blocking NMIs; else "NMI-window exiting" stops it when
//! it stops blocking them (§26.7.6, with "virtual NMIs", which track the guest's blocking).

use super::virtual_apic;
use super::{Vm, VmDevices};
use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::must;
use hvprof_vmx::caps::{VmxCaps, pin, proc1};
use hvprof_vmx::exit::{InterruptionInfo, InterruptionType};
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::vmcs::{Control32, Guest32, GuestNatural, Interruptibility, ReadOnly32, VmcsExt};

/// RFLAGS.IF.
const RFLAGS_IF: u64 = 1 << 9;

/// After a VM exit: an event the exit interrupted in delivery (an interrupt, an exception) is
/// set up to be delivered again at the next entry, as the SDM requires (§28.2.4, §27.6).
/// Inlined to its test of the IDT-vectoring information's valid bit, which most exits find clear.
#[inline(always)]
pub fn redeliver_interrupted_event(vmcs: &mut CurrentVmcs) {
    // Right after a VM exit, with this vCPU's VMCS current: the field is in every VMCS
    // (SDM Vol. 3C, Appendix B.3.2), so the VMREAD cannot fail.
    let info = InterruptionInfo(vmcs.read_fast(ReadOnly32::IdtVectoringInfo) as u32);
    if info.valid() {
        redeliver(vmcs, info);
    }
}

/// [`redeliver_interrupted_event`] for an exit that interrupted an event's delivery.
#[inline(never)]
fn redeliver(vmcs: &mut CurrentVmcs, info: InterruptionInfo) {
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

/// The earlier of two optional TSC deadlines.
fn earlier(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

/// What a vCPU has to take: its local APIC's vector (`apic=on`; none to inject where the CPU
/// delivers them itself, `delivered_by_cpu`), and whether the 8259 pair's INTR reaches it (vCPU
/// 0 only, through LINT0 in ExtINT mode when it has a local APIC) with a request up. Runs the
/// APIC's timer to `now` first; also the TSC of the APIC's next timer event.
fn waiting(
    dev: &mut VmDevices,
    index: usize,
    now: u64,
    delivered_by_cpu: bool,
) -> (Option<u8>, bool, Option<u64>) {
    let (vector, through, next) = match dev.lapics.get_mut(index) {
        Some(l) => {
            l.run_timer(now);
            let vector = if delivered_by_cpu { None } else { l.pending() };
            (vector, index == 0 && l.accepts_pic(), l.next_event())
        }
        None => (None, index == 0, None),
    };
    (vector, through && dev.board.pic.pending().is_some(), next)
}

/// Before a VM entry of a Linux guest: brings its devices up to `now`, then injects the vector
/// its local APIC or the PICs have for it, or asks for an exit as soon as it can take one; with
/// the CPU's virtual-interrupt delivery, hands the local APIC's state to the CPU instead, which
/// delivers its vectors itself (`vm/virtual_apic.rs`). Returns the TSC of the devices' next
/// event (the guest must stop then, to raise it), and whether an interrupt is still waiting
/// after this entry (the devices must be looked at again at the next exit).
pub fn before_entry(
    vm: &Vm,
    vcpu: &mut Vcpu,
    vmcs: &mut CurrentVmcs,
    caps: &VmxCaps,
    now: u64,
) -> (Option<u64>, bool) {
    let mut guard = vm.devices.lock();
    let dev = &mut *guard;
    let index = usize::from(vcpu.index);
    let by_cpu = vcpu.virtual_apic != 0;
    if by_cpu {
        virtual_apic::take_back(vcpu, vmcs, &mut dev.lapics[index]);
    }
    let next = inject(vm, vcpu, vmcs, caps, now, dev, by_cpu);
    if by_cpu {
        virtual_apic::hand_over(vcpu, vmcs, &mut dev.lapics[index]);
    }
    next
}

/// `before_entry`'s work on the devices, with its lock held; `by_cpu`: the local APIC's vectors
/// are the CPU's to deliver.
fn inject(
    vm: &Vm,
    vcpu: &mut Vcpu,
    vmcs: &mut CurrentVmcs,
    caps: &VmxCaps,
    now: u64,
    dev: &mut VmDevices,
    by_cpu: bool,
) -> (Option<u64>, bool) {
    dev.board.update(now);
    if vm.apic {
        super::apic_bus::route_io_apic(vm, dev);
    }
    let index = usize::from(vcpu.index);
    let (vector, pic, apic_next) = waiting(dev, index, now, by_cpu);
    let next = earlier(dev.board.next_event(now), apic_next);
    let nmi = dev.lapics.get(index).is_some_and(|l| l.nmi_pending());
    if vector.is_none() && !pic && !nmi {
        set_window_exiting(vcpu, vmcs, false);
        set_exiting(vcpu, vmcs, proc1::NMI_WINDOW_EXITING, false);
        return (next, false);
    }
    let entering = InterruptionInfo(must(
        vmcs.read32(Control32::EntryInterruptionInfo),
        "VMREAD entry interruption info",
    ));
    let mut busy = entering.valid();
    let rflags = must(vmcs.read_natural(GuestNatural::Rflags), "VMREAD RFLAGS");
    let blocking = Interruptibility::from_bits_truncate(must(
        vmcs.read32(Guest32::InterruptibilityState),
        "VMREAD interruptibility",
    ));
    let mut nmi_waits = false;
    if nmi {
        // While the guest is in an NMI's handler (until IRET), or one is on its way in, those
        // that wait are one (SDM Vol. 3A §6.7.1).
        if blocking.contains(Interruptibility::BLOCKING_BY_NMI)
            || entering == InterruptionInfo::nmi()
        {
            dev.lapics[index].nmi_in_service();
        }
        // An NMI is not injected over another event, nor while the guest blocks NMIs (in its
        // handler until IRET) or events (STI, MOV SS): SDM Vol. 3C §27.3.1.5.
        let blocked = busy
            || blocking.intersects(
                Interruptibility::BLOCKING_BY_NMI
                    | Interruptibility::BLOCKING_BY_STI
                    | Interruptibility::BLOCKING_BY_MOV_SS,
            );
        if blocked {
            nmi_waits = true;
        } else {
            dev.lapics[index].take_nmi();
            must(
                vmcs.write32(Control32::EntryInterruptionInfo, InterruptionInfo::nmi().0),
                "VMWRITE entry interruption info",
            );
            vcpu.nmis_injected += 1;
            busy = true;
            // Another one behind it is due when the handler's IRET ends the NMI blocking, before
            // any interrupt (an NMI-window exit comes first, §26.7.6): it must not wait for a
            // later exit, by which time the CPU may have delivered an interrupt it sent after
            // it (virtual-interrupt delivery needs no exit).
            nmi_waits = dev.lapics[index].nmi_pending();
        }
    }
    // NMI-window exiting needs virtual NMIs (§27.2.1.1); without, the NMI waits for the next
    // exit (at the latest the next sampling deadline).
    let nmi_window = nmi_waits
        && caps.pinbased().allows(pin::VIRTUAL_NMIS)
        && caps.procbased().allows(proc1::NMI_WINDOW_EXITING);
    set_exiting(vcpu, vmcs, proc1::NMI_WINDOW_EXITING, nmi_window);
    if vector.is_none() && !pic {
        set_window_exiting(vcpu, vmcs, false);
        return (next, nmi_waits);
    }
    let open = rflags & RFLAGS_IF != 0
        && !blocking
            .intersects(Interruptibility::BLOCKING_BY_STI | Interruptibility::BLOCKING_BY_MOV_SS);
    if open && !busy {
        // The local APIC's vector first (SDM Vol. 3A: the APIC delivers the highest-priority
        // interrupt it holds; an ExtINT from the 8259 comes through it when nothing else is).
        let given = match vector {
            Some(v) => {
                dev.lapics[index].acknowledge(v);
                Some(v)
            }
            None => dev.board.pic.acknowledge(),
        };
        if let Some(v) = given {
            must(
                vmcs.write32(
                    Control32::EntryInterruptionInfo,
                    InterruptionInfo::external_interrupt(v).0,
                ),
                "VMWRITE entry interruption info",
            );
            vcpu.interrupts_injected += 1;
        }
    } else if !caps.procbased().allows(proc1::INTERRUPT_WINDOW_EXITING) {
        return (next, true);
    }
    // Another one may wait behind it: the window opens again after its delivery.
    let (vector, pic, _) = waiting(dev, index, now, by_cpu);
    let still = vector.is_some() || pic;
    set_window_exiting(vcpu, vmcs, still);
    (next, still || nmi_waits)
}

/// Whether vCPU `index` of a VM with interrupt controllers (`Vm::delivers_interrupts`) that
/// executed HLT has something to wake it now (an interrupt its local APIC or the PICs would
/// deliver, with RFLAGS.IF set), and else when its devices' next event falls.
pub fn on_halt(vm: &Vm, index: u16, vmcs: &CurrentVmcs, now: u64) -> Result<(), Option<u64>> {
    let mut guard = vm.devices.lock();
    let dev = &mut *guard;
    dev.board.update(now);
    if vm.apic {
        super::apic_bus::route_io_apic(vm, dev);
    }
    let (vector, pic, apic_next) = waiting(dev, usize::from(index), now, false);
    // An NMI wakes a halted CPU whatever RFLAGS.IF says.
    if dev
        .lapics
        .get(usize::from(index))
        .is_some_and(|l| l.nmi_pending())
    {
        return Ok(());
    }
    let rflags = must(vmcs.read_natural(GuestNatural::Rflags), "VMREAD RFLAGS");
    if rflags & RFLAGS_IF != 0 && (vector.is_some() || pic) {
        return Ok(());
    }
    Err(if rflags & RFLAGS_IF != 0 {
        earlier(dev.board.next_event(now), apic_next)
    } else {
        None
    })
}

fn set_window_exiting(vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs, on: bool) {
    set_exiting(vcpu, vmcs, proc1::INTERRUPT_WINDOW_EXITING, on);
}

/// Sets or clears the primary processor-based control `bit` (a window-exiting control).
fn set_exiting(vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs, bit: u32, on: bool) {
    let want = if on {
        vcpu.proc1 | bit
    } else {
        vcpu.proc1 & !bit
    };
    if want != vcpu.proc1 {
        vcpu.proc1 = want;
        must(
            vmcs.write32(Control32::PrimaryProcBasedControls, want),
            "VMWRITE primary processor-based controls",
        );
    }
}
