//! RDMSR/WRMSR (exit reasons 31/32) for the MSRs the bitmap does not pass through (SDM Vol. 3C
//! §26.1.3, §25.6.9). The policy is docs/GUEST-ABI.md, "MSRs": a few MSRs are emulated, every
//! other one injects #GP and is reported once.

use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::GuestOps;
use crate::vm::{Stop, Vm};
use hvprof_vmx::instructions::CurrentVmcs;

const IA32_PLATFORM_ID: u32 = 0x17;
const IA32_FEATURE_CONTROL: u32 = 0x3a;
const IA32_APIC_BASE: u32 = 0x1b;
const IA32_BIOS_SIGN_ID: u32 = 0x8b;
const IA32_MISC_ENABLE: u32 = 0x1a0;
/// A realistic microcode revision (in the high half): with 0, Linux distrusts the CPU's
/// TSC-deadline timer and some errata checks.
const MICROCODE_REVISION: u64 = 0x28 << 32;
/// Fast strings enabled; branch trace and PEBS unavailable (SDM Vol. 4, Table 2-2).
const MISC_ENABLE_VALUE: u64 = 1 | 1 << 11 | 1 << 12;
/// Locked, VMX off: what a guest that cannot use VMX should see.
const FEATURE_CONTROL_VALUE: u64 = 1;
const IA32_TSC_DEADLINE: u32 = 0x6e0;

/// IA32_APIC_BASE as vCPU `index` of a VM without local APICs reads it: enabled, and only
/// vCPU 0 is the bootstrap processor.
fn apic_base(index: u16) -> u64 {
    hvprof_hypervisor::devices::lapic::apic_base_value(true, index == 0)
}

pub fn rdmsr(vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) -> Option<Stop> {
    let msr = vcpu.regs.rcx as u32;
    let value = match msr {
        IA32_FEATURE_CONTROL => FEATURE_CONTROL_VALUE,
        IA32_APIC_BASE if vm.apic => {
            vm.devices.lock().lapics[usize::from(vcpu.index)].apic_base(vcpu.index == 0)
        }
        IA32_APIC_BASE => apic_base(vcpu.index),
        IA32_TSC_DEADLINE if vm.apic => {
            vm.devices.lock().lapics[usize::from(vcpu.index)].deadline()
        }
        IA32_PLATFORM_ID if vm.machine_exit => 0,
        IA32_BIOS_SIGN_ID if vm.machine_exit => MICROCODE_REVISION,
        IA32_MISC_ENABLE if vm.machine_exit => MISC_ENABLE_VALUE,
        _ => {
            vm.log_msr_once(msr, "read of unhandled");
            vmcs.inject_exception(13, Some(0));
            return None;
        }
    };
    let r = &mut vcpu.regs;
    r.rax = value & 0xffff_ffff;
    r.rdx = value >> 32;
    vmcs.skip_instruction();
    None
}

pub fn wrmsr(vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) -> Option<Stop> {
    let msr = vcpu.regs.rcx as u32;
    let value = (vcpu.regs.rdx << 32) | (vcpu.regs.rax & 0xffff_ffff);
    match msr {
        // With local APICs: the global enable may be cleared and set again (§11.4.3).
        IA32_APIC_BASE if vm.apic => {
            if !vm.devices.lock().lapics[usize::from(vcpu.index)].write_apic_base(value) {
                vm.log_msr_once(
                    msr,
                    "write of an unsupported value (another base, x2APIC) to",
                );
                vmcs.inject_exception(13, Some(0));
                return None;
            }
        }
        // Without: rewriting the value it reads is harmless; anything else would move the APIC.
        IA32_APIC_BASE if value == apic_base(vcpu.index) => {}
        // The timer's deadline (SDM Vol. 3A, "TSC-Deadline Mode"); the next VM entry arms it.
        IA32_TSC_DEADLINE if vm.apic => {
            vm.devices.lock().lapics[usize::from(vcpu.index)]
                .write_deadline(value, crate::tsc::rdtsc());
        }
        // Writing 0 before reading the revision is how the revision is read (SDM Vol. 3A
        // §10.11.7.1); loading microcode is not offered. MISC_ENABLE writes change nothing.
        IA32_BIOS_SIGN_ID | IA32_MISC_ENABLE if vm.machine_exit => {}
        _ => {
            vm.log_msr_once(msr, "write to unhandled");
            vmcs.inject_exception(13, Some(0));
            return None;
        }
    }
    vmcs.skip_instruction();
    None
}
