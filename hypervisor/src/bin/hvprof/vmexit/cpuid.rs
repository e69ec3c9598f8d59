//! CPUID (exit reason 10, unconditional in VMX non-root operation: SDM Vol. 3C §26.1.2). The
//! answer is `hvprof_hypervisor::cpuid_policy` (docs/GUEST-ABI.md, "CPUID"): the host's values,
//! with VMX hidden, the hypervisor bit set, hvprof's signature at 0x40000000, and the bits
//! that report the vCPU's own state.

use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::{GuestOps, must};
use crate::vm::{Stop, Vm};
use hvprof_vmx::caps::proc2;
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::vmcs::{Control32, GuestNatural, VmcsExt};

pub use hvprof_hypervisor::cpuid_policy::ABI_VERSION;
use hvprof_hypervisor::cpuid_policy::{Seen, policy};

pub fn handle(vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) -> Option<Stop> {
    let leaf = vcpu.regs.rax as u32;
    let subleaf = vcpu.regs.rcx as u32;
    if leaf == super::output::OUTPUT_LEAF {
        let r = super::output::cpuid(vm, vcpu, vmcs, subleaf);
        return finish(vcpu, vmcs, r);
    }
    // The vCPU's state, read only for the leaves that report it (the exit stays short for the
    // others).
    let cr4 = if matches!(leaf, 1 | 7) {
        must(vmcs.read_natural(GuestNatural::Cr4), "VMREAD CR4")
    } else {
        0
    };
    let proc2 = if matches!(leaf, 7 | 0x8000_0001) {
        must(
            vmcs.read32(Control32::SecondaryProcBasedControls),
            "VMREAD secondary controls",
        )
    } else {
        0
    };
    let seen = Seen {
        linux: vm.linux,
        apic: vm.apic,
        apic_enabled: !vm.apic
            || leaf != 1
            || vm.devices.lock().lapics[usize::from(vcpu.index)].globally_enabled(),
        vcpu: vcpu.index,
        vcpus: vm.vcpus.len() as u32,
        cr4,
        misc_enable: vcpu.misc_enable,
        rdtscp: proc2 & proc2::ENABLE_RDTSCP != 0,
        tsc_offsetting: vcpu.proc1 & hvprof_vmx::caps::proc1::USE_TSC_OFFSETTING != 0,
        tsc_hz: crate::tsc::hz(),
        pmu: vcpu.pmu.as_ref().map(|p| p.model().cpuid()),
    };
    let r = policy(leaf, subleaf, &seen, |l, s| {
        let r = raw_cpuid::native_cpuid::cpuid_count(l, s);
        (r.eax, r.ebx, r.ecx, r.edx)
    });
    finish(vcpu, vmcs, r)
}

/// Whether the host offers IA32_TSC_ADJUST (CPUID.(EAX=07H,ECX=0):EBX[1]), which every guest but
/// Linux then sees (`vmexit::msr`).
pub fn host_has_tsc_adjust() -> bool {
    let host = raw_cpuid::native_cpuid::cpuid_count(0, 0);
    host.eax >= 7 && raw_cpuid::native_cpuid::cpuid_count(7, 0).ebx & (1 << 1) != 0
}

fn finish(
    vcpu: &mut Vcpu,
    vmcs: &mut CurrentVmcs,
    (a, b, c, d): (u32, u32, u32, u32),
) -> Option<Stop> {
    let r = &mut vcpu.regs;
    r.rax = a.into();
    r.rbx = b.into();
    r.rcx = c.into();
    r.rdx = d.into();
    vmcs.skip_instruction();
    None
}
