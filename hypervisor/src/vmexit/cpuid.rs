//! CPUID (exit reason 10, unconditional in VMX non-root operation: SDM Vol. 3C §26.1.2). The
//! policy (docs/GUEST-ABI.md, "CPUID"): the host's values, with VMX hidden, the hypervisor bit
//! set, and hvprof's signature at 0x40000000.

use super::skip_instruction;
use crate::vcpu::Vcpu;
use crate::vm::Stop;
use hvprof_vmx::instructions::CurrentVmcs;

/// "hvprofhvprof" in EBX, ECX, EDX.
pub const SIGNATURE: [u32; 3] = [
    u32::from_le_bytes(*b"hvpr"),
    u32::from_le_bytes(*b"ofhv"),
    u32::from_le_bytes(*b"prof"),
];
pub const HV_LEAF_MAX: u32 = 0x4000_0001;
pub const ABI_VERSION: u32 = 1;

pub fn handle(vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) -> Option<Stop> {
    let leaf = vcpu.regs.rax as u32;
    let subleaf = vcpu.regs.rcx as u32;
    let (a, b, c, d) = match leaf {
        0x4000_0000 => (HV_LEAF_MAX, SIGNATURE[0], SIGNATURE[1], SIGNATURE[2]),
        0x4000_0001 => (ABI_VERSION, 0, 0, 0),
        0x4000_0002..=0x4fff_ffff => (0, 0, 0, 0),
        _ => {
            let r = raw_cpuid::native_cpuid::cpuid_count(leaf, subleaf);
            let (mut a, b, mut c, d) = (r.eax, r.ebx, r.ecx, r.edx);
            if leaf == 1 {
                // ECX bit 5: VMX hidden; bit 31: running under a hypervisor.
                c = (c & !(1 << 5)) | (1 << 31);
            }
            if leaf == 0xa {
                // No PMU for guests: the hypervisor owns the counters (it samples with them).
                a = 0;
                return finish(vcpu, vmcs, (a, 0, 0, 0));
            }
            (a, b, c, d)
        }
    };
    finish(vcpu, vmcs, (a, b, c, d))
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
    skip_instruction(vmcs);
    None
}
