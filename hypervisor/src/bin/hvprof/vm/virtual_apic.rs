//! The CPU's APIC virtualization for a vCPU with a local APIC (`apic=on`), where the CPU has
//! all of it (SDM Vol. 3C Chapter 29, "APIC Virtualization and Virtual Interrupts"):
//! - **TPR shadow** (§29.1.2): the guest's TPR lives in its virtual-APIC page;
//! - **virtualize APIC accesses** with **APIC-register virtualization** (§29.4): the guest's
//!   xAPIC page (GPA 0xfee00000) is mapped by EPT onto the VM's APIC-access page, and reads of
//!   most registers are served from the vCPU's virtual-APIC page without a VM exit; a write is
//!   done there and then exits, trap-like, with its offset (APIC-write exit, §29.4.3.3), which
//!   needs no instruction decoding; other accesses (PPR, the timer's current count, CMCI, odd
//!   sizes) exit fault-like before they happen (APIC-access exit) and are decoded and emulated
//!   as without virtualization;
//! - **virtual-interrupt delivery** (§29.2): the CPU delivers the vCPU's interrupts itself from
//!   its VIRR (at VM entry, and whenever the guest's TPR or EOI lets one through), and
//!   virtualizes EOI (§29.1.4) except for level-triggered vectors, whose EOI exits for the I/O
//!   APIC (EOI-exit bitmap), and self-IPIs (§29.1.5: a fixed, edge IPI to self goes into VIRR).
//!   No interrupt-window exits, no EOI exits for edge vectors, no exits for self-IPIs.
//!
//! The local APIC model (`hvprof_hypervisor::devices::lapic`) stays the one truth outside guest
//! time: before a VM entry it hands its TPR, IRR and ISR over (`Lapic::hand_over`: what differs
//! from what the page and the guest interrupt status hold is written here, nothing after an
//! exit that touched no interrupt), and the first look at the model after an exit takes them
//! back (`Lapic::take_back`: a VMREAD of the guest interrupt status and 19 reads of the page,
//! VTPR, ICR and every word of VIRR and VISR: besides delivering and ending interrupts, the CPU
//! sets a VIRR bit for each self-IPI the guest sends (§29.1.5), in any word, without an exit
//! and without moving RVI when the vector is below it).
//! The other registers are written to the page only after they changed (`Lapic::generation`).
//! Without all four controls every access is an EPT violation, decoded and emulated
//! (`vmexit::apic_access::mmio`), as with `apic=emulated`.

use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::must;
use hvprof_hypervisor::devices::lapic::{Lapic, reg};
use hvprof_vmx::caps::{VmxCaps, pin, proc1, proc2};
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::vmcs::{Control32, Control64, Guest16, VmcsExt};

/// The controls APIC virtualization takes, as (primary, secondary).
const CONTROLS: (u32, u32) = (
    proc1::USE_TPR_SHADOW,
    proc2::VIRTUALIZE_APIC_ACCESSES
        | proc2::APIC_REGISTER_VIRTUALIZATION
        | proc2::VIRTUAL_INTERRUPT_DELIVERY,
);

/// Why the CPU's APIC virtualization cannot be used (none: it can). Virtual-interrupt delivery
/// needs external-interrupt exiting too (§27.2.1.1), which every vCPU has.
pub fn missing(caps: &VmxCaps) -> Option<&'static str> {
    if !caps.procbased().allows(CONTROLS.0) {
        Some("no TPR shadow")
    } else if !caps.procbased().allows(proc1::ACTIVATE_SECONDARY) {
        Some("no secondary controls")
    } else if !caps.procbased2().allows(proc2::VIRTUALIZE_APIC_ACCESSES) {
        Some("no APIC-access virtualization")
    } else if !caps
        .procbased2()
        .allows(proc2::APIC_REGISTER_VIRTUALIZATION)
    {
        Some("no APIC-register virtualization")
    } else if !caps.procbased2().allows(proc2::VIRTUAL_INTERRUPT_DELIVERY) {
        Some("no virtual-interrupt delivery")
    } else if !caps.pinbased().allows(pin::EXTERNAL_INTERRUPT_EXITING) {
        Some("no external-interrupt exiting")
    } else {
        None
    }
}

/// Follows the vCPU's IA32_APIC_BASE in its current VMCS: "virtualize APIC accesses" is on
/// only while its local APIC answers at GPA 0xfee00000 (`at_default`: globally enabled, not
/// moved). Otherwise the vCPU's accesses to that page are no longer the APIC's (SDM Vol. 3A
/// §11.4.3: a globally disabled APIC does not answer at its page; §11.4.4: a moved one answers
/// at its new base, where EPT maps nothing, so that each access there is an EPT violation the
/// model serves, `vmexit::apic_access::mmio`). They reach the APIC-access page EPT maps at
/// 0xfee00000 as ordinary memory: the VM's own page, whose content the CPU never uses while it
/// virtualizes (§29.4), so it holds nothing but what such accesses put there. The TPR shadow
/// (CR8) and virtual-interrupt delivery stay. Other vCPUs' controls are their own.
pub fn follow_apic_base(vmcs: &mut CurrentVmcs, at_default: bool) {
    let proc2 = must(
        vmcs.read32(Control32::SecondaryProcBasedControls),
        "VMREAD secondary controls",
    );
    let proc2 = if at_default {
        proc2 | proc2::VIRTUALIZE_APIC_ACCESSES
    } else {
        proc2 & !proc2::VIRTUALIZE_APIC_ACCESSES
    };
    must(
        vmcs.write32(Control32::SecondaryProcBasedControls, proc2),
        "VMWRITE secondary controls",
    );
}

/// Turns APIC virtualization on in the current VMCS of `vcpu` (§25.6.8, "Controls for APIC
/// Virtualization"): its virtual-APIC page `virtual_apic` (4 KiB, zeroed, its own) and the VM's
/// APIC-access page `access` (where EPT maps the guest's xAPIC page). TPR threshold 0, RVI and
/// SVI 0, no EOI exits: the model's state reaches them at the first entry (`hand_over`).
pub fn enable(
    caps: &VmxCaps,
    vcpu: &mut Vcpu,
    vmcs: &mut CurrentVmcs,
    virtual_apic: u64,
    access: u64,
) {
    // With a TPR shadow, MOV to and from CR8 use the virtual TPR (§29.3) when CR8 exiting is
    // off: the guest's CR8 is its APIC's TPR, with no exit (where the CPU lets the controls be
    // 0; otherwise the CR8 exits go to the model, vmexit/mod.rs).
    let cr8 =
        (proc1::CR8_LOAD_EXITING | proc1::CR8_STORE_EXITING) & !caps.procbased().must_be_one();
    vcpu.proc1 = (vcpu.proc1 | CONTROLS.0) & !cr8;
    must(
        vmcs.write32(Control32::PrimaryProcBasedControls, vcpu.proc1),
        "VMWRITE primary controls",
    );
    let proc2 = must(
        vmcs.read32(Control32::SecondaryProcBasedControls),
        "VMREAD secondary controls",
    );
    must(
        vmcs.write32(Control32::SecondaryProcBasedControls, proc2 | CONTROLS.1),
        "VMWRITE secondary controls",
    );
    must(
        vmcs.write64(Control64::VirtualApicAddress, virtual_apic),
        "VMWRITE virtual-APIC address",
    );
    must(
        vmcs.write64(Control64::ApicAccessAddress, access),
        "VMWRITE APIC-access address",
    );
    must(
        vmcs.write32(Control32::TprThreshold, 0),
        "VMWRITE TPR threshold",
    );
    for f in [
        Control64::EoiExitBitmap0,
        Control64::EoiExitBitmap1,
        Control64::EoiExitBitmap2,
        Control64::EoiExitBitmap3,
    ] {
        must(vmcs.write64(f, 0), "VMWRITE EOI-exit bitmap");
    }
    must(
        vmcs.write16(Guest16::InterruptStatus, 0),
        "VMWRITE guest interrupt status",
    );
    vcpu.virtual_apic = virtual_apic;
    vcpu.apic_generation = u64::MAX;
}

/// The 32-bit word at `offset` of the vCPU's virtual-APIC page.
pub fn page_read(vcpu: &Vcpu, offset: u32) -> u32 {
    debug_assert!(vcpu.virtual_apic != 0 && offset < 0x1000 && offset.is_multiple_of(4));
    // SAFETY: `virtual_apic` is this vCPU's own 4 KiB page (allocated for it, identity-mapped,
    // never freed) and `offset` is 4-aligned inside it; the CPU writes it only while this vCPU
    // runs, which it does not now (this pCPU is in VMX root operation for it).
    unsafe { core::ptr::read_volatile((vcpu.virtual_apic + u64::from(offset)) as *const u32) }
}

fn page_write(vcpu: &Vcpu, offset: u32, value: u32) {
    debug_assert!(vcpu.virtual_apic != 0 && offset < 0x1000 && offset.is_multiple_of(4));
    // SAFETY: as in `page_read`.
    unsafe {
        core::ptr::write_volatile((vcpu.virtual_apic + u64::from(offset)) as *mut u32, value);
    }
}

/// `take_back` under the VM's device lock, taken only when `vcpu` handed its state over
/// (callers that hold the lock call `take_back`).
pub fn take_back_locked(vm: &crate::vm::Vm, vcpu: &mut Vcpu, vmcs: &CurrentVmcs) {
    if vcpu.apic_handed {
        let mut dev = vm.devices.lock();
        take_back(vcpu, vmcs, &mut dev.lapics[usize::from(vcpu.index)]);
    }
}

/// After a VM exit, before the model is looked at: takes back what the CPU held (a no-op when
/// nothing was handed over, or without APIC virtualization).
pub fn take_back(vcpu: &mut Vcpu, vmcs: &CurrentVmcs, lapic: &mut Lapic) {
    // An INIT may have reset the model meanwhile: then it has nothing handed over, and knows
    // nothing of the page (its next `hand_over` writes all of it).
    if !core::mem::take(&mut vcpu.apic_handed) || !lapic.handed_over() {
        return;
    }
    let status = must(
        vmcs.read16(Guest16::InterruptStatus),
        "VMREAD guest interrupt status",
    );
    let v: &Vcpu = vcpu;
    lapic.take_back(status, page_read(v, reg::TPR), |o| page_read(v, o));
}

/// Before a VM entry: hands the model's TPR, IRR and ISR to the CPU (the words of the page, the
/// guest interrupt status and the EOI-exit bitmaps that differ from what they hold), and the
/// registers reads are served from after any change of theirs.
pub fn hand_over(vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs, lapic: &mut Lapic) {
    if vcpu.virtual_apic == 0 {
        return;
    }
    if lapic.generation() != vcpu.apic_generation {
        lapic.page_registers(|o, v| page_write(vcpu, o, v));
        vcpu.apic_generation = lapic.generation();
    }
    vcpu.apic_handed = true;
    let Some((new, before)) = lapic.hand_over() else {
        // The page and the VMCS hold it already.
        return;
    };
    // What the page and the VMCS hold; unknown (`all`): every field is written.
    let all = before.is_none();
    let old = before.unwrap_or_default();
    if all || old.tpr != new.tpr {
        page_write(vcpu, reg::TPR, new.tpr);
    }
    for i in 0..8 {
        let at = 0x10 * i as u32;
        if all || old.irr[i] != new.irr[i] {
            page_write(vcpu, reg::IRR + at, new.irr[i]);
        }
        if all || old.isr[i] != new.isr[i] {
            page_write(vcpu, reg::ISR + at, new.isr[i]);
        }
    }
    if all || old.status != new.status {
        must(
            vmcs.write16(Guest16::InterruptStatus, new.status),
            "VMWRITE guest interrupt status",
        );
    }
    for (i, f) in [
        Control64::EoiExitBitmap0,
        Control64::EoiExitBitmap1,
        Control64::EoiExitBitmap2,
        Control64::EoiExitBitmap3,
    ]
    .into_iter()
    .enumerate()
    {
        if all || old.eoi_exit[i] != new.eoi_exit[i] {
            must(vmcs.write64(f, new.eoi_exit[i]), "VMWRITE EOI-exit bitmap");
        }
    }
}
