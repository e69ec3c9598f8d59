//! VMCALL (exit reason 18): the hypercall interface of docs/GUEST-ABI.md, "Hypercalls".

use super::{guest_cpl, inject_exception, skip_instruction};
use crate::vm::{Stop, Vm};
use hvprof_vmx::instructions::CurrentVmcs;

pub const VERSION: u64 = 0;
pub const PRINT: u64 = 1;
pub const EXIT: u64 = 2;
pub const SET_TIMER: u64 = 3;
pub const PRINT_MAX: u64 = 4096;
pub const ERR_BAD_BUFFER: u64 = u64::MAX;
pub const ERR_UNKNOWN: u64 = u64::MAX - 1;

pub fn handle(vm: &mut Vm, vmcs: &mut CurrentVmcs) -> Option<Stop> {
    if guest_cpl(vmcs) != 0 {
        inject_exception(vmcs, 6, None);
        return None;
    }
    let (function, a, b) = (
        vm.cur_mut().regs.rax,
        vm.cur_mut().regs.rdi,
        vm.cur_mut().regs.rsi,
    );
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
            vm.cur_mut().wake_at = (a != 0).then(|| crate::tsc::rdtsc().saturating_add(a));
            0
        }
        _ => ERR_UNKNOWN,
    };
    vm.cur_mut().regs.rax = result;
    skip_instruction(vmcs);
    None
}

/// PRINT: the bytes go through the VM's UART line buffer, so they interleave with its output.
fn print(vm: &mut Vm, gpa: u64, len: u64) -> u64 {
    let in_memory = len <= PRINT_MAX && gpa.checked_add(len).is_some_and(|end| end <= vm.mem_size);
    if !in_memory {
        return ERR_BAD_BUFFER;
    }
    let mut buf = [0u8; PRINT_MAX as usize];
    let len = len as usize;
    buf[..len].copy_from_slice(&vm.memory()[gpa as usize..gpa as usize + len]);
    for &byte in &buf[..len] {
        if let Some(line) = vm.uart.send(byte) {
            crate::vm::print_guest_line(&vm.name, line);
        }
    }
    0
}
