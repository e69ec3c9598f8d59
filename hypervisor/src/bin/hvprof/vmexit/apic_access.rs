//! A guest's accesses to its local APIC's and its I/O APIC's registers (`apic=on`): the xAPIC
//! page (GPA 0xfee00000, or where the vCPU moved its APIC's base) and the I/O APIC's at
//! 0xfec00000 are not in the VM's EPT, so each access is an EPT violation (SDM Vol. 3C §29.3.3,
//! exit reason 48). The instruction at the
//! guest's RIP is fetched through its own page tables and decoded
//! (`hvprof_hypervisor::mmio_decode`), the register is read or written in the vCPU's model
//! (`hvprof_hypervisor::devices::lapic`) or the VM's (`devices::ioapic`), and the guest goes on
//! after the instruction. What a write asks for next (an IPI, an EOI of a level-triggered
//! vector, an interrupt the I/O APIC now sends) goes on the VM's APIC bus (`vm/apic_bus.rs`).

use crate::tsc::rdtsc;
use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::must;
use crate::vm::{Stop, Vm, apic_bus};
use alloc::format;
use core::fmt::Write;
use hvprof_hypervisor::devices::lapic::Mmio;
use hvprof_hypervisor::guest_acpi::{IOAPIC_BASE, LAPIC_BASE};
use hvprof_hypervisor::mmio_decode::{self, Access, MAX_LEN, Op};
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::regs::Gpr;
use hvprof_vmx::vmcs::{Guest32, GuestNatural, VmcsExt};

/// Whether `gpa` is on a local APIC's or the I/O APIC's page of a VM that has them: the
/// architectural xAPIC page (whose accesses the model serves whether or not vCPU `index`'s APIC
/// answers there), or the page vCPU `index` moved its APIC to.
pub fn is_apic_page(vm: &Vm, index: u16, gpa: u64) -> bool {
    vm.apic
        && ((LAPIC_BASE..LAPIC_BASE + 0x1000).contains(&gpa)
            || (IOAPIC_BASE..IOAPIC_BASE + 0x1000).contains(&gpa)
            || vm.devices.lock().lapics[usize::from(index)].answers_at(gpa))
}

/// The access at `gpa` (on an APIC page) by the instruction at the guest's RIP.
pub fn mmio(vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs, gpa: u64) -> Option<Stop> {
    let rip = must(vmcs.read_natural(GuestNatural::Rip), "VMREAD RIP");
    let long = hvprof_vmx::guest::long_code(must(
        vmcs.read32(Guest32::CsAccessRights),
        "VMREAD CS rights",
    ));
    let mut code = [0u8; MAX_LEN];
    let n = super::guest_memory::read_linear(vm, vmcs, rip, &mut code);
    let access = match mmio_decode::decode(&code[..n], long) {
        Ok(a) => a,
        Err(e) => {
            let mut bytes = alloc::string::String::new();
            for b in &code[..n] {
                let _ = write!(bytes, " {b:02x}");
            }
            return Some(super::fatal::fatal(
                vcpu,
                vmcs,
                format!(
                    "APIC access at GPA {gpa:#x} by {e} at RIP {rip:#x} (bytes:{bytes}): not emulated"
                ),
            ));
        }
    };
    // The registers are 32 bits at 16-byte boundaries; other offsets read 0 and ignore writes
    // (the local APIC's model sees to that itself).
    let offset = (gpa & 0xfff) as u32;
    let aligned = offset & 0xf == 0;
    let now = rdtsc();
    let index = usize::from(vcpu.index);
    let local = vm.devices.lock().lapics[index].answers_at(gpa);
    if !local && (LAPIC_BASE..LAPIC_BASE + 0x1000).contains(&gpa) {
        // A globally disabled local APIC no longer answers at its page (SDM Vol. 3A §11.4.3),
        // nor does one moved elsewhere (§11.4.4): nothing does, and the bus gives all ones for
        // a read and drops a write, of any size.
        if let Op::Read { reg } = access.op {
            set_sized(vcpu, vmcs, reg, &access, u64::MAX);
        }
    } else if access.size != 4 {
        // The registers take 32-bit accesses only; others are undefined (§11.4.1).
        return Some(super::fatal::fatal(
            vcpu,
            vmcs,
            format!(
                "APIC access at GPA {gpa:#x} of {} bytes at RIP {rip:#x}: only 32-bit accesses reach the APIC's registers",
                access.size
            ),
        ));
    } else if !local && (IOAPIC_BASE..IOAPIC_BASE + 0x1000).contains(&gpa) {
        let mut dev = vm.devices.lock();
        match access.op {
            Op::Read { reg } => {
                let value = if aligned {
                    dev.board.ioapic.read(offset)
                } else {
                    0
                };
                set_gpr(vcpu, vmcs, reg, u64::from(value));
            }
            Op::Write { reg } => {
                if aligned {
                    let value = get_gpr(vcpu, vmcs, reg) as u32;
                    dev.board.ioapic.write(offset, value);
                    // An entry unmasked while its line is up sends now.
                    apic_bus::route_io_apic(vm, &mut dev);
                }
            }
            Op::WriteImm { imm } => {
                if aligned {
                    dev.board.ioapic.write(offset, imm);
                    apic_bus::route_io_apic(vm, &mut dev);
                }
            }
        }
    } else {
        let mut dev = vm.devices.lock();
        let done = dev.lapics[index].mmio(offset, access.op, |r| get_gpr(vcpu, vmcs, r), now);
        match done {
            Mmio::Load { reg, value } => set_gpr(vcpu, vmcs, reg, u64::from(value)),
            Mmio::Store(effect) => apic_bus::carry_out(vm, &mut dev, effect),
        }
    }
    vcpu.apic_accesses += 1;
    must(
        hvprof_vmx::guest::advance_rip(vmcs, access.len as u64),
        "move RIP past the APIC access",
    );
    None
}

/// An APIC-access VM exit (SDM Vol. 3C §29.4.4, exit reason 44): an access to the APIC-access
/// page that APIC-register virtualization does not serve (a read of PPR or the timer's current
/// count, CMCI, an access that is not 32 bits at a register), stopped before it happened. The
/// exit qualification gives the page offset (bits 11:0) and the access type (bits 15:12,
/// Table 28-6: 0 a linear read, 1 a linear write); it is emulated as without virtualization.
pub fn apic_access(vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) -> Option<Stop> {
    let q = must(vmcs.exit_qualification(), "VMREAD exit qualification");
    let offset = q & 0xfff;
    match (q >> 12) & 0xf {
        0 | 1 => mmio(vm, vcpu, vmcs, LAPIC_BASE + offset),
        kind => Some(super::fatal::fatal(
            vcpu,
            vmcs,
            format!(
                "APIC access of type {kind} (not a linear read or write: an instruction fetch or an access during event delivery) at offset {offset:#x}: not emulated"
            ),
        )),
    }
}

/// An APIC-write VM exit (§29.4.3.3, exit reason 56): the guest wrote a register in its
/// virtual-APIC page (offset in the exit qualification; the write is done and RIP past it),
/// and the model takes the write as from an emulated access.
pub fn apic_write(vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) -> Option<Stop> {
    let offset = (must(vmcs.exit_qualification(), "VMREAD exit qualification") & 0xffc) as u32;
    let value = crate::vm::virtual_apic::page_read(vcpu, offset);
    let mut dev = vm.devices.lock();
    // Registers are 32 bits at 16-byte boundaries; a write elsewhere on the page is ignored.
    if offset & 0xf == 0 {
        let effect = dev.lapics[usize::from(vcpu.index)].write(offset, value, rdtsc());
        apic_bus::carry_out(vm, &mut dev, effect);
    }
    vcpu.apic_accesses += 1;
    None
}

/// An EOI-induced VM exit (§29.1.4, exit reason 45): the CPU virtualized the EOI of a vector
/// in the EOI-exit bitmap (a level-triggered one: exit qualification bits 7:0), and what is
/// left is the I/O APIC's.
pub fn virtualized_eoi(vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) -> Option<Stop> {
    let vector = must(vmcs.exit_qualification(), "VMREAD exit qualification") as u8;
    let mut dev = vm.devices.lock();
    let effect = dev.lapics[usize::from(vcpu.index)].virtual_eoi(vector);
    apic_bus::carry_out(vm, &mut dev, effect);
    None
}

fn get_gpr(vcpu: &Vcpu, vmcs: &CurrentVmcs, reg: u8) -> u64 {
    match Gpr::from_number(reg) {
        Gpr::Rsp => must(vmcs.read_natural(GuestNatural::Rsp), "VMREAD RSP"),
        r => vcpu.regs.get(r).unwrap_or(0),
    }
}

/// A load of `access.size` bytes of `value` into general register `reg`: 4 zeroes the upper
/// half, 1 and 2 keep the rest of the register, a high-byte register takes bits 15:8 (SDM Vol.
/// 1 §3.4.1.1; `mmio_decode::Access`).
fn set_sized(vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs, reg: u8, access: &Access, value: u64) {
    let old = get_gpr(vcpu, vmcs, reg);
    let new = match (access.size, access.high_byte) {
        (1, true) => (old & !0xff00) | ((value & 0xff) << 8),
        (1, false) => (old & !0xff) | (value & 0xff),
        (2, _) => (old & !0xffff) | (value & 0xffff),
        (4, _) => value & 0xffff_ffff,
        _ => value,
    };
    set_gpr(vcpu, vmcs, reg, new);
}

/// A 32-bit load: the register's upper half becomes 0 (SDM Vol. 1 §3.4.1.1).
fn set_gpr(vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs, reg: u8, value: u64) {
    match Gpr::from_number(reg) {
        Gpr::Rsp => must(vmcs.write_natural(GuestNatural::Rsp, value), "VMWRITE RSP"),
        r => {
            if let Some(slot) = vcpu.regs.get_mut(r) {
                *slot = value;
            }
        }
    }
}
