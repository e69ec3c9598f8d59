//! I/O instructions (exit reason 30; every port exits through the I/O bitmaps, SDM Vol. 3C
//! §26.1.3). Port 0xf4 stops the VM; the VM's legacy devices (`devices::board`: COM1's 16550,
//! the PICs, the PIT, the CMOS clock), QEMU's firmware configuration ports (`devices::fw_cfg`)
//! and, with `testdev=on`, its pc-testdev (`devices::testdev`) take theirs; every other port
//! reads all ones and drops writes (docs/GUEST-ABI.md, "Devices").

use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::GuestOps;
use crate::vm::{Stop, Vm};
use hvprof_hypervisor::devices::acpi_pm::{self, AcpiPm, PmEffect};
use hvprof_hypervisor::devices::board::Access;
use hvprof_hypervisor::devices::fw_cfg::FwCfg;
use hvprof_hypervisor::devices::testdev::{self, PcTestdev};
use hvprof_vmx::exit::{IoAccess, IoDirection};
use hvprof_vmx::instructions::CurrentVmcs;

pub const EXIT_PORT: u16 = 0xf4;

/// IN or OUT, as the exit qualification `io` gives it (INS and OUTS go to `string_io`).
pub fn handle(vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs, io: &IoAccess) -> Option<Stop> {
    let mask = mask(io.size);
    let now = crate::tsc::rdtsc();
    match io.direction {
        IoDirection::Out => {
            let value = (vcpu.regs.rax & mask) as u32;
            if let Some(stop) = port_out(vm, io.port, io.size, value, now) {
                return Some(stop);
            }
        }
        IoDirection::In => {
            let value = port_in(vm, io.port, io.size, now);
            set_in_result(vcpu, io.size, mask, u64::from(value));
        }
    }
    vmcs.skip_instruction();
    None
}

/// The bits of an access of `size` bytes.
fn mask(size: u8) -> u64 {
    match size {
        1 => 0xff,
        2 => 0xffff,
        _ => 0xffff_ffff,
    }
}

/// An OUT of `value` (`size` bytes) to `port` at TSC `now`, to the device that claims it; what
/// stops the VM (the exit port, ACPI S5).
pub fn port_out(vm: &Vm, port: u16, size: u8, value: u32, now: u64) -> Option<Stop> {
    if vm.apic && AcpiPm::claims(port) {
        match vm.devices.lock().pm.write(port, size, value) {
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
        return None;
    }
    if PcTestdev::claims(port) {
        let mut guard = vm.devices.lock();
        let dev = &mut *guard;
        if let Some(testdev) = dev.testdev.as_mut() {
            if let testdev::Effect::IrqLine { irq, level } = testdev.write(port, value, size) {
                dev.board.set_isa_line(irq, level);
                // An unmasked I/O APIC entry whose line rose sends now.
                if vm.apic {
                    crate::vm::apic_bus::route_io_apic(vm, dev);
                }
            }
            return None;
        }
    }
    if FwCfg::claims(port) {
        vm.devices.lock().fw_cfg.write(port, value, size);
        return None;
    }
    if port == EXIT_PORT {
        return Some(Stop::Exited {
            code: value as u8,
            how: "port 0xf4",
        });
    }
    let claimed = {
        let mut dev = vm.devices.lock();
        match dev.board.write(port, value as u8, now) {
            Access::Line(line) => {
                vm.console.lock().emit(&vm.name, line, now);
                true
            }
            Access::Done(_) => true,
            Access::Unclaimed => false,
        }
    };
    if !claimed {
        vm.log_port_once(port, true);
    }
    None
}

/// An IN of `size` bytes from `port` at TSC `now`: the claiming device's value, all ones where
/// none claims it.
pub fn port_in(vm: &Vm, port: u16, size: u8, now: u64) -> u32 {
    if vm.apic && AcpiPm::claims(port) {
        return vm.devices.lock().pm.read(port, size);
    }
    // The PM timer: in every ACPI guest's FADT but a Linux guest's (`vm::build`, `acpi_tables`).
    if vm.apic && !vm.linux && acpi_pm::is_pm_timer(port) {
        return acpi_pm::pm_timer_read(port, size, now, crate::tsc::hz());
    }
    if PcTestdev::claims(port)
        && let Some(testdev) = vm.devices.lock().testdev.as_ref()
    {
        return testdev.read(port, size);
    }
    if FwCfg::claims(port) {
        return vm.devices.lock().fw_cfg.read(port, size);
    }
    // (The devices' lock is let go before the log takes it again.)
    let read = match vm.devices.lock().board.read(port, now) {
        Access::Done(v) => Some(u32::from(v)),
        _ => None,
    };
    read.unwrap_or_else(|| {
        vm.log_port_once(port, false);
        mask(size) as u32
    })
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
