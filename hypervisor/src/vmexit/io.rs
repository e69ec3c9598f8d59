//! I/O instructions (exit reason 30; every port exits through the I/O bitmaps, SDM Vol. 3C
//! §26.1.3). COM1 is the VM's virtual 16550, port 0xf4 stops the VM, every other port reads
//! all ones and drops writes (docs/GUEST-ABI.md, "Devices").

use super::{fatal, skip_instruction};
use crate::vcpu::Vcpu;
use crate::vm::{Stop, Vm};
use alloc::format;
use hvprof_vmx::exit::{IoAccess, IoDirection};
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::vmcs::VmcsExt;

pub const COM1: u16 = 0x3f8;
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
    match io.direction {
        IoDirection::Out => {
            let value = vcpu.regs.rax & mask;
            match io.port {
                EXIT_PORT => {
                    return Some(Stop::Exited {
                        code: value as u8,
                        how: "port 0xf4",
                    });
                }
                p if (COM1..COM1 + 8).contains(&p) => {
                    let mut console = vm.console.lock();
                    if let Some(line) = console.uart.write((p - COM1) as u8, value as u8) {
                        crate::vm::print_guest_line(&vm.name, line);
                    }
                }
                p => vm.log_port_once(p, true),
            }
        }
        IoDirection::In => {
            let value = match io.port {
                p if (COM1..COM1 + 8).contains(&p) => {
                    vm.console.lock().uart.read((p - COM1) as u8) as u64
                }
                p => {
                    vm.log_port_once(p, false);
                    mask
                }
            };
            // IN writes AL/AX/EAX; a 32-bit IN zero-extends into RAX (SDM Vol. 2A, IN).
            let r = &mut vcpu.regs.rax;
            *r = if io.size == 4 {
                value
            } else {
                (*r & !mask) | value
            };
        }
    }
    skip_instruction(vmcs);
    None
}
