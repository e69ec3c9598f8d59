//! CPUID (exit reason 10, unconditional in VMX non-root operation: SDM Vol. 3C §26.1.2). The
//! policy (docs/GUEST-ABI.md, "CPUID"): the host's values, with VMX hidden, the hypervisor bit
//! set, and hvprof's signature at 0x40000000.

use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::GuestOps;
use crate::vm::{Stop, Vm};
use hvprof_vmx::instructions::CurrentVmcs;

/// "hvprofhvprof" in EBX, ECX, EDX.
pub const SIGNATURE: [u32; 3] = [
    u32::from_le_bytes(*b"hvpr"),
    u32::from_le_bytes(*b"ofhv"),
    u32::from_le_bytes(*b"prof"),
];
pub const HV_LEAF_MAX: u32 = super::output::OUTPUT_LEAF;
pub const ABI_VERSION: u32 = 1;

/// Leaves up to this one are answered (0x15 and 0x16 are synthesized: the TSC's frequency).
pub const BASIC_LEAF_MAX: u32 = 0x16;

pub fn handle(vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) -> Option<Stop> {
    let leaf = vcpu.regs.rax as u32;
    let subleaf = vcpu.regs.rcx as u32;
    if leaf == super::output::OUTPUT_LEAF {
        let r = super::output::cpuid(vm, vcpu, vmcs, subleaf);
        return finish(vcpu, vmcs, r);
    }
    let r = policy(
        leaf,
        subleaf,
        vm.linux,
        vm.apic,
        vcpu.index,
        vm.vcpus.len() as u32,
    );
    finish(vcpu, vmcs, r)
}

/// The CPUID a guest sees (docs/GUEST-ABI.md, "CPUID"): the host's leaves, with what the
/// hypervisor does not virtualize hidden, and the TSC frequency in leaves 15H/16H. A Linux guest
/// also loses what it would drive without an emulation behind it here (the local APIC, MTRRs,
/// machine checks, RDTSCP, speculation-control MSRs, thermal and power leaves); with `apic`
/// (`apic=on`) it keeps the local APIC and its TSC-deadline timer, which the hypervisor emulates.
fn policy(
    leaf: u32,
    subleaf: u32,
    linux: bool,
    apic: bool,
    vcpu: u16,
    vcpus: u32,
) -> (u32, u32, u32, u32) {
    let host = |l, s| {
        let r = raw_cpuid::native_cpuid::cpuid_count(l, s);
        (r.eax, r.ebx, r.ecx, r.edx)
    };
    let host_max = host(0, 0).0;
    match leaf {
        0x4000_0000 => (HV_LEAF_MAX, SIGNATURE[0], SIGNATURE[1], SIGNATURE[2]),
        0x4000_0001 => (ABI_VERSION, 0, 0, 0),
        0x4000_0002..=0x4fff_ffff => (0, 0, 0, 0),
        0 => {
            let (a, b, c, d) = host(0, 0);
            (a.max(BASIC_LEAF_MAX), b, c, d)
        }
        1 => {
            let (a, mut b, mut c, mut d) = host(1, 0);
            // ECX bit 5: VMX hidden; bit 3: MONITOR/MWAIT (they exit and do nothing); bit 31:
            // running under a hypervisor.
            c = (c & !(1 << 5 | 1 << 3)) | (1 << 31);
            // PDCM (15: IA32_PERF_CAPABILITIES is not emulated) and x2APIC (21: only xAPIC
            // is): no guest gets them.
            c &= !(1 << 15 | 1 << 21);
            // EBX: initial APIC id (31:24) = the vCPU, logical processors (23:16) = the VM's
            // vCPUs: never the host's.
            b = (b & 0xffff) | (vcpus.min(255) << 16) | (u32::from(vcpu) << 24);
            if linux {
                // XSAVE (26), OSXSAVE (27), AVX (28) with FMA (12) and F16C (29): a Linux guest
                // gets the x87/SSE state only.
                c &= !(1 << 12 | 0xf << 26);
                // MCE (7), MTRR (12), MCA (14), ACPI thermal (22).
                d &= !(1 << 7 | 1 << 12 | 1 << 14 | 1 << 22);
                // Without `apic=on`: no local APIC (EDX 9), no TSC-deadline timer (ECX 24).
                if !apic {
                    c &= !(1 << 24);
                    d &= !(1 << 9);
                }
            }
            (a, b, c, d)
        }
        4 => {
            // Deterministic cache parameters: the caches as the host has them, but cores per
            // package (EAX 31:26) and threads sharing each cache (EAX 25:14) as one core per
            // vCPU, none shared: not the host's topology.
            let (a, b, c, d) = host(4, subleaf);
            let cores = vcpus.clamp(1, 64) - 1;
            (a & 0x3fff | cores << 26, b, c, d)
        }
        // Thermal and power management: nothing behind it for a guest.
        6 if linux => (0, 0, 0, 0),
        7 => {
            let (a, b, mut c, mut d) = host(7, subleaf);
            if subleaf == 0 {
                // RDPID (ECX 22): #UD in every guest ("enable RDTSCP" is off: it would read the
                // host's IA32_TSC_AUX).
                c &= !(1 << 22);
            }
            if linux && subleaf == 0 {
                // RDPID (ECX 22); MD_CLEAR (10), IBRS/IBPB (26), STIBP (27), L1D_FLUSH (28),
                // ARCH_CAPABILITIES (29), CORE_CAPABILITIES (30), SSBD (31) in EDX: their
                // MSRs are not passed through.
                c &= !(1 << 22);
                d &= !(1 << 10 | 0xfc00_0000);
                // TSC_ADJUST (EBX 1), AVX2 (EBX 5) and the AVX-512 family (EBX 16, 17, 21,
                // 26-28, 30, 31): see leaf 1.
                let avx = 1 << 5 | 1 << 16 | 1 << 17 | 1 << 21 | 0b111 << 26 | 0b11 << 30;
                return (a, b & !(1 << 1 | avx), c, d);
            }
            (a, b, c, d)
        }
        // No PMU for guests: the hypervisor owns the counters (it samples with them).
        0xa => (0, 0, 0, 0),
        // XSAVE state components: none (see leaf 1).
        0xd if linux => (0, 0, 0, 0),
        // Topology: not described (one core per vCPU), so Linux falls back to leaves 1 and 4; no
        // guest sees the host's x2APIC ids.
        0xb | 0x1f => (0, 0, 0, 0),
        // TSC/crystal ratio 1:1 and the crystal at the TSC's frequency; the base frequency in MHz.
        0x15 => (1, 1, crate::tsc::hz() as u32, 0),
        0x16 => {
            let mhz = (crate::tsc::hz() / 1_000_000).max(1) as u32;
            (mhz, mhz, 100, 0)
        }
        l if l < 0x4000_0000 && l > host_max => (0, 0, 0, 0),
        0x8000_0001 => {
            let (a, b, c, d) = host(leaf, subleaf);
            // RDTSCP (EDX 27): #UD in every guest (see leaf 7's RDPID).
            (a, b, c, d & !(1 << 27))
        }
        0x8000_0007 => {
            let (a, b, c, d) = host(leaf, subleaf);
            // Invariant TSC (EDX 8): the TSC the guest reads is the host's, which is invariant
            // where the host says so; nothing else of power management.
            (a, b, c, d & (1 << 8))
        }
        _ => host(leaf, subleaf),
    }
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
