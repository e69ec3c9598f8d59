//! RDMSR/WRMSR (exit reasons 31/32) for the MSRs the bitmap does not pass through (SDM Vol. 3C
//! §26.1.3, §25.6.9). The policy is docs/GUEST-ABI.md, "MSRs": a few MSRs are emulated, every
//! other one injects #GP and is reported once.

use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::GuestOps;
use crate::vm::{Stop, Vm};
use hvprof_hypervisor::guest_acpi::LAPIC_BASE;
use hvprof_pmu::virtual_pmu::VirtualPmu;
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::vmcs::VmcsExt;

const IA32_TSC: u32 = 0x10;
const IA32_PLATFORM_ID: u32 = 0x17;
const IA32_TSC_ADJUST: u32 = 0x3b;
const IA32_MCG_CAP: u32 = 0x179;
const IA32_MCG_STATUS: u32 = 0x17a;
const IA32_FEATURE_CONTROL: u32 = 0x3a;
const IA32_APIC_BASE: u32 = 0x1b;
const IA32_BIOS_SIGN_ID: u32 = 0x8b;
const IA32_MISC_ENABLE: u32 = 0x1a0;
/// A realistic microcode revision (in the high half): with 0, Linux distrusts the CPU's
/// TSC-deadline timer and some errata checks.
const MICROCODE_REVISION: u64 = 0x28 << 32;
/// The bits of IA32_MISC_ENABLE a guest may change (Table 2-2): fast strings (0), automatic
/// thermal control (3), Enhanced SpeedStep (16), ENABLE MONITOR FSM (18), limit CPUID maxval
/// (22), xTPR message disable (23), XD bit disable (34). Bits 7, 11 and 12 are read-only, the
/// others reserved: changing any of them is #GP. Only 22 and 34 change what the guest sees
/// (`cpuid::policy`); the others have nothing behind them here.
const MISC_ENABLE_WRITABLE: u64 = 1 | 1 << 3 | 1 << 16 | 1 << 18 | 1 << 22 | 1 << 23 | 1 << 34;
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
        IA32_TSC_DEADLINE if vm.apic => vcpu
            .tsc
            .deadline_to_guest(vm.devices.lock().lapics[usize::from(vcpu.index)].deadline()),
        IA32_TSC_ADJUST if tsc_adjust(vm, vcpu) => vcpu.tsc.adjust,
        // No machine-check banks (MCG_CAP.Count = 0, so every IA32_MCi_* is #GP) and no
        // machine check in progress.
        IA32_MCG_CAP | IA32_MCG_STATUS => 0,
        IA32_PLATFORM_ID if vm.machine_exit => 0,
        IA32_BIOS_SIGN_ID if vm.machine_exit => MICROCODE_REVISION,
        IA32_MISC_ENABLE if vm.machine_exit => vcpu.misc_enable,
        // The virtual PMU's MSRs (`vpmu=`; SDM Vol. 3B §21.2.2), none of them the real ones.
        m if vcpu.pmu.is_some() && VirtualPmu::handles(m) => {
            let pmu = match crate::vm::vpmu::access(vcpu) {
                Ok(pmu) => pmu?,
                Err(e) => return Some(Stop::Fault(e)),
            };
            match pmu.model().read(m) {
                Ok(v) => v,
                Err(_) => {
                    vmcs.inject_exception(13, Some(0));
                    return None;
                }
            }
        }
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
        // With local APICs: the global enable may be cleared and set again (§11.4.3), and the
        // base moved (§11.4.4).
        IA32_APIC_BASE if vm.apic => {
            let mut dev = vm.devices.lock();
            let lapic = &mut dev.lapics[usize::from(vcpu.index)];
            if !lapic.write_apic_base(value, crate::vm::build::phys_addr_bits()) {
                drop(dev);
                vm.log_msr_once(msr, "write of a reserved bit or x2APIC mode to");
                vmcs.inject_exception(13, Some(0));
                return None;
            }
            if vm.apic_access != 0 {
                crate::vm::virtual_apic::follow_apic_base(vmcs, lapic.answers_at(LAPIC_BASE));
            }
        }
        // Without: rewriting the value it reads is harmless; anything else would move the APIC.
        IA32_APIC_BASE if value == apic_base(vcpu.index) => {}
        // The timer's deadline (SDM Vol. 3A, "TSC-Deadline Mode"), in the guest's time; the
        // next VM entry arms it on the host's.
        IA32_TSC_DEADLINE if vm.apic => {
            let now = crate::tsc::rdtsc();
            let host = vcpu.tsc.deadline_to_host(value, now);
            vm.devices.lock().lapics[usize::from(vcpu.index)].write_deadline(host, now);
        }
        // The guest's own counter (`hvprof_hypervisor::guest_tsc`): the VMCS's TSC offset.
        IA32_TSC if offsetting(vcpu) => {
            vcpu.tsc.write_tsc(value, crate::tsc::rdtsc());
            set_offset(vcpu, vmcs);
        }
        IA32_TSC_ADJUST if tsc_adjust(vm, vcpu) => {
            vcpu.tsc.write_adjust(value);
            set_offset(vcpu, vmcs);
        }
        IA32_MCG_STATUS if value == 0 => {}
        // Writing 0 before reading the revision is how the revision is read (SDM Vol. 3A
        // §10.11.7.1); loading microcode is not offered.
        IA32_BIOS_SIGN_ID if vm.machine_exit => {}
        IA32_MISC_ENABLE if vm.machine_exit => {
            if (value ^ vcpu.misc_enable) & !MISC_ENABLE_WRITABLE != 0 {
                vm.log_msr_once(msr, "write of read-only or reserved bits to");
                vmcs.inject_exception(13, Some(0));
                return None;
            }
            vcpu.misc_enable = value;
        }
        // A reserved bit, or a write to IA32_PERF_GLOBAL_STATUS, is #GP and changes nothing
        // (`VirtualPmu::write`).
        m if vcpu.pmu.is_some() && VirtualPmu::handles(m) => {
            let pmu = match crate::vm::vpmu::access(vcpu) {
                Ok(pmu) => pmu?,
                Err(e) => return Some(Stop::Fault(e)),
            };
            if pmu.write_msr(m, value).is_err() {
                vm.log_msr_once(m, "write of reserved bits to virtual PMU");
                vmcs.inject_exception(13, Some(0));
                return None;
            }
        }
        _ => {
            vm.log_msr_once(msr, "write to unhandled");
            vmcs.inject_exception(13, Some(0));
            return None;
        }
    }
    vmcs.skip_instruction();
    None
}

/// The CPU applies a TSC offset to this vCPU (the control is allowed: `vmcs_setup::Controls`).
fn offsetting(vcpu: &Vcpu) -> bool {
    vcpu.proc1 & hvprof_vmx::caps::proc1::USE_TSC_OFFSETTING != 0
}

/// IA32_TSC_ADJUST exists for this vCPU: CPUID.(EAX=07H,ECX=0):EBX[1] says so (the host has it
/// and `cpuid_policy::offers_tsc_adjust`).
fn tsc_adjust(vm: &Vm, vcpu: &Vcpu) -> bool {
    hvprof_hypervisor::cpuid_policy::offers_tsc_adjust(vm.linux, offsetting(vcpu))
        && super::cpuid::host_has_tsc_adjust()
}

/// The VMCS's TSC offset (SDM Vol. 3C §25.6.5) from the vCPU's.
fn set_offset(vcpu: &Vcpu, vmcs: &mut CurrentVmcs) {
    crate::vcpu::guest_ops::must(
        vmcs.write64(hvprof_vmx::vmcs::Control64::TscOffset, vcpu.tsc.offset),
        "VMWRITE TSC offset",
    );
}
