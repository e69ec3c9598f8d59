//! RDMSR/WRMSR (exit reasons 31/32) for the MSRs the bitmap does not pass through (SDM Vol. 3C
//! §26.1.3, §25.6.9). The policy is docs/GUEST-ABI.md, "MSRs": a few MSRs are emulated, every
//! other one injects #GP and is reported once.

use super::{inject_exception, skip_instruction};
use crate::vcpu::Vcpu;
use crate::vm::{Stop, Vm};
use hvprof_vmx::instructions::CurrentVmcs;

const IA32_FEATURE_CONTROL: u32 = 0x3a;
const IA32_APIC_BASE: u32 = 0x1b;
/// Locked, VMX off: what a guest that cannot use VMX should see.
const FEATURE_CONTROL_VALUE: u64 = 1;
/// xAPIC at the architectural base, enabled, bootstrap processor.
const APIC_BASE_VALUE: u64 = 0xfee0_0900;

pub fn rdmsr(vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) -> Option<Stop> {
    let msr = vcpu.regs.rcx as u32;
    let value = match msr {
        IA32_FEATURE_CONTROL => FEATURE_CONTROL_VALUE,
        IA32_APIC_BASE => APIC_BASE_VALUE,
        _ => {
            vm.log_msr_once(msr, "read of unhandled");
            inject_exception(vmcs, 13, Some(0));
            return None;
        }
    };
    let r = &mut vcpu.regs;
    r.rax = value & 0xffff_ffff;
    r.rdx = value >> 32;
    skip_instruction(vmcs);
    None
}

pub fn wrmsr(vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) -> Option<Stop> {
    let msr = vcpu.regs.rcx as u32;
    let value = (vcpu.regs.rdx << 32) | (vcpu.regs.rax & 0xffff_ffff);
    match msr {
        // Rewriting the value it reads is harmless; anything else would move the APIC.
        IA32_APIC_BASE if value == APIC_BASE_VALUE => {}
        _ => {
            vm.log_msr_once(msr, "write to unhandled");
            inject_exception(vmcs, 13, Some(0));
            return None;
        }
    }
    skip_instruction(vmcs);
    None
}
