//! VMCALL (exit reason 18): the hypercall interface of docs/GUEST-ABI.md, "Hypercalls".

use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::GuestOps;
use crate::vm::{Stop, Vm};
use hvprof_vmx::instructions::CurrentVmcs;

pub const VERSION: u64 = 0;
pub const PRINT: u64 = 1;
pub const EXIT: u64 = 2;
pub const SET_TIMER: u64 = 3;
pub const PRINT_MAX: u64 = 4096;
pub const ERR_BAD_BUFFER: u64 = u64::MAX;
pub const ERR_UNKNOWN: u64 = u64::MAX - 1;

pub fn handle(vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) -> Option<Stop> {
    if vmcs.guest_cpl() != 0 {
        vmcs.inject_exception(6, None);
        return None;
    }
    let (function, a, b) = (vcpu.regs.rax, vcpu.regs.rdi, vcpu.regs.rsi);
    let result = match function {
        VERSION => u64::from(super::cpuid::ABI_VERSION),
        PRINT => print(vm, a, b),
        EXIT => {
            return Some(Stop::Exited {
                code: a as u8,
                how: "EXIT hypercall",
            });
        }
        SET_TIMER => {
            // Wake the vCPU from its next HLT `a` TSC ticks from now (0 disarms).
            vcpu.wake_at = (a != 0).then(|| crate::tsc::rdtsc().saturating_add(a));
            0
        }
        _ => ERR_UNKNOWN,
    };
    vcpu.regs.rax = result;
    vmcs.skip_instruction();
    None
}

/// PRINT: the bytes go through the VM's UART line buffer, so they interleave with its output.
fn print(vm: &Vm, gpa: u64, len: u64) -> u64 {
    let mut buf = [0u8; PRINT_MAX as usize];
    let Some(buf) = buf.get_mut(..len.min(PRINT_MAX + 1) as usize) else {
        return ERR_BAD_BUFFER;
    };
    if len > PRINT_MAX || !vm.read_guest(gpa, buf) {
        return ERR_BAD_BUFFER;
    }
    let now = crate::tsc::rdtsc();
    let mut devices = vm.devices.lock();
    for &byte in buf.iter() {
        if let Some(line) = devices.board.uart.send(byte) {
            vm.console.lock().emit(&vm.name, line, now);
        }
    }
    0
}
