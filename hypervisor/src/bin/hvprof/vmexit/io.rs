//! I/O instructions (exit reason 30; every port exits through the I/O bitmaps, SDM Vol. 3C
//! §26.1.3). Port 0xf4 stops the VM; the VM's legacy devices (`devices::board`: COM1's 16550,
//! the PICs, the PIT, the CMOS clock), QEMU's firmware configuration ports (`devices::fw_cfg`)
//! and, with `testdev=on`, its pc-testdev (`devices::testdev`) take theirs; every other port
//! reads all ones and drops writes (docs/GUEST-ABI.md, "Devices").

use super::fatal::fatal;
use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::GuestOps;
use crate::vm::{Stop, Vm};
use alloc::format;
use hvprof_hypervisor::devices::acpi_pm::{self, AcpiPm, PmEffect};
use hvprof_hypervisor::devices::board::Access;
use hvprof_hypervisor::devices::fw_cfg::FwCfg;
use hvprof_hypervisor::devices::testdev::{self, PcTestdev};
use hvprof_vmx::exit::{IoAccess, IoDirection};
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::vmcs::VmcsExt;

pub const EXIT_PORT: u16 = 0xf4;

pub fn handle(vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) -> Option<Stop> {
    let io = IoAccess::decode(vmcs.exit_qualification().unwrap_or(0));
    vcpu.stats.record_port(io.port);
    if io.string {
        // INS/OUTS would need the guest's segments and page tables walked: not supported.
        return Some(fatal(
            vcpu,
            vmcs,
            format!(
                "string I/O ({}) on port {:#x} is not supported",
                if io.rep { "REP INS/OUTS" } else { "INS/OUTS" },
                io.port
            ),
        ));
    }
    let mask = match io.size {
        1 => 0xff,
        2 => 0xffff,
        _ => 0xffff_ffff,
    };
    let now = crate::tsc::rdtsc();
    if vm.apic && AcpiPm::claims(io.port) {
        return acpi_pm(vm, vcpu, vmcs, &io, mask);
    }
    // The PM timer: in every ACPI guest's FADT but a Linux guest's (`vm::build`, `acpi_tables`).
    if vm.apic && !vm.linux && acpi_pm::is_pm_timer(io.port) && io.direction == IoDirection::In {
        let v = acpi_pm::pm_timer_read(io.port, io.size, now, crate::tsc::hz());
        set_in_result(vcpu, io.size, mask, u64::from(v));
        vmcs.skip_instruction();
        return None;
    }
    if PcTestdev::claims(io.port) {
        let mut guard = vm.devices.lock();
        let dev = &mut *guard;
        if let Some(testdev) = dev.testdev.as_mut() {
            match io.direction {
                IoDirection::Out => {
                    let value = (vcpu.regs.rax & mask) as u32;
                    if let testdev::Effect::IrqLine { irq, level } =
                        testdev.write(io.port, value, io.size)
                    {
                        dev.board.set_isa_line(irq, level);
                        // An unmasked I/O APIC entry whose line rose sends now.
                        if vm.apic {
                            crate::vm::apic_bus::route_io_apic(vm, dev);
                        }
                    }
                }
                IoDirection::In => {
                    let v = testdev.read(io.port, io.size);
                    set_in_result(vcpu, io.size, mask, u64::from(v));
                }
            }
            drop(guard);
            vmcs.skip_instruction();
            return None;
        }
    }
    if FwCfg::claims(io.port) {
        let mut dev = vm.devices.lock();
        match io.direction {
            IoDirection::Out => dev
                .fw_cfg
                .write(io.port, (vcpu.regs.rax & mask) as u32, io.size),
            IoDirection::In => {
                let v = dev.fw_cfg.read(io.port, io.size);
                set_in_result(vcpu, io.size, mask, u64::from(v));
            }
        }
        drop(dev);
        vmcs.skip_instruction();
        return None;
    }
    match io.direction {
        IoDirection::Out => {
            let value = vcpu.regs.rax & mask;
            if io.port == EXIT_PORT {
                return Some(Stop::Exited {
                    code: value as u8,
                    how: "port 0xf4",
                });
            }
            let claimed = {
                let mut dev = vm.devices.lock();
                match dev.board.write(io.port, value as u8, now) {
                    Access::Line(line) => {
                        vm.console.lock().emit(&vm.name, line, now);
                        true
                    }
                    Access::Done(_) => true,
                    Access::Unclaimed => false,
                }
            };
            if !claimed {
                vm.log_port_once(io.port, true);
            }
        }
        IoDirection::In => {
            let read = match vm.devices.lock().board.read(io.port, now) {
                Access::Done(v) => Some(u64::from(v)),
                _ => None,
            };
            let value = read.unwrap_or_else(|| {
                vm.log_port_once(io.port, false);
                mask
            });
            set_in_result(vcpu, io.size, mask, value);
        }
    }
    vmcs.skip_instruction();
    None
}

/// IN writes AL/AX/EAX; a 32-bit IN zero-extends into RAX (SDM Vol. 2A, IN).
fn set_in_result(vcpu: &mut Vcpu, size: u8, mask: u64, value: u64) {
    let r = &mut vcpu.regs.rax;
    *r = if size == 4 {
        value
    } else {
        (*r & !mask) | value
    };
}

/// The ACPI PM1a blocks (`apic=on`): S5 powers the VM off.
fn acpi_pm(
    vm: &Vm,
    vcpu: &mut Vcpu,
    vmcs: &mut CurrentVmcs,
    io: &IoAccess,
    mask: u64,
) -> Option<Stop> {
    let size = io.size;
    match io.direction {
        IoDirection::Out => {
            let value = (vcpu.regs.rax & mask) as u32;
            match vm.devices.lock().pm.write(io.port, size, value) {
                PmEffect::PowerOff => {
                    return Some(Stop::Exited {
                        code: 0,
                        how: "ACPI S5 power-off",
                    });
                }
                PmEffect::SleepRefused(typ) => crate::vm_report!(
                    vm,
                    "ACPI sleep type {typ} requested: only S5 (power-off) is offered; ignored"
                ),
                PmEffect::None => {}
            }
        }
        IoDirection::In => {
            let value = u64::from(vm.devices.lock().pm.read(io.port, size));
            set_in_result(vcpu, size, mask, value);
        }
    }
    vmcs.skip_instruction();
    None
}
