//! CPUID (exit reason 10, unconditional in VMX non-root operation: SDM Vol. 3C §26.1.2). The
//! policy (docs/GUEST-ABI.md, "CPUID"): the host's values, with VMX hidden, the hypervisor bit
//! set, and hvprof's signature at 0x40000000.

use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::{GuestOps, must};
use crate::vm::{Stop, Vm};
use hvprof_vmx::caps::proc2;
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::vmcs::{Control32, GuestNatural, VmcsExt};

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
    let cr4 = must(vmcs.read_natural(GuestNatural::Cr4), "VMREAD CR4");
    let proc2 = must(
        vmcs.read32(Control32::SecondaryProcBasedControls),
        "VMREAD secondary controls",
    );
    let seen = Seen {
        linux: vm.linux,
        apic: vm.apic,
        apic_enabled: !vm.apic
            || vm.devices.lock().lapics[usize::from(vcpu.index)].globally_enabled(),
        vcpu: vcpu.index,
        vcpus: vm.vcpus.len() as u32,
        cr4,
        misc_enable: vcpu.misc_enable,
        rdtscp: proc2 & proc2::ENABLE_RDTSCP != 0,
        tsc_offsetting: vcpu.proc1 & hvprof_vmx::caps::proc1::USE_TSC_OFFSETTING != 0,
    };
    let r = policy(leaf, subleaf, &seen);
    finish(vcpu, vmcs, r)
}

/// What the answer depends on besides the leaf: the kind of VM, and the vCPU's own state (CPUID
/// reports some of it: the APIC's global enable, CR4.OSXSAVE and CR4.PKE, two IA32_MISC_ENABLE
/// bits).
struct Seen {
    linux: bool,
    /// The VM has local APICs (`apic=on`).
    apic: bool,
    /// This vCPU's local APIC is globally enabled (IA32_APIC_BASE[11]; always without `apic`).
    apic_enabled: bool,
    vcpu: u16,
    vcpus: u32,
    /// The guest's CR4.
    cr4: u64,
    /// Its IA32_MISC_ENABLE.
    misc_enable: u64,
    /// "Enable RDTSCP" is on: RDTSCP and RDPID run in the guest, with its own IA32_TSC_AUX.
    rdtscp: bool,
    /// "Use TSC offsetting" is on: the guest may write IA32_TSC and IA32_TSC_ADJUST.
    tsc_offsetting: bool,
}

/// CR4.OSXSAVE and CR4.PKE (SDM Vol. 3A §2.5).
const CR4_OSXSAVE: u64 = 1 << 18;
const CR4_PKE: u64 = 1 << 22;
/// IA32_MISC_ENABLE's "limit CPUID maxval" (22) and "XD bit disable" (34) (SDM Vol. 4, Table 2-2).
const MISC_LIMIT_CPUID: u64 = 1 << 22;
const MISC_XD_DISABLE: u64 = 1 << 34;

/// Whether the host offers IA32_TSC_ADJUST (CPUID.(EAX=07H,ECX=0):EBX[1]), which every guest but
/// Linux then sees (`vmexit::msr`).
pub fn host_has_tsc_adjust() -> bool {
    let host = raw_cpuid::native_cpuid::cpuid_count(0, 0);
    host.eax >= 7 && raw_cpuid::native_cpuid::cpuid_count(7, 0).ebx & (1 << 1) != 0
}

/// The CPUID a guest sees (docs/GUEST-ABI.md, "CPUID"): the host's leaves, with what the
/// hypervisor does not virtualize hidden, and the TSC frequency in leaves 15H/16H. A Linux guest
/// also loses what it would drive without an emulation behind it here (the local APIC, MTRRs,
/// machine checks, RDTSCP, speculation-control MSRs, thermal and power leaves); with `apic`
/// (`apic=on`) it keeps the local APIC and its TSC-deadline timer, which the hypervisor emulates.
/// Bits that report the vCPU's state follow it: OSXSAVE and OSPKE its CR4 (SDM Vol. 2A, CPUID),
/// the APIC bit its APIC's global enable (SDM Vol. 3A §11.4.3: "CPUID.01H:EDX[9] is 0" while
/// disabled), and leaf 0's maximum and the NX bit two IA32_MISC_ENABLE bits.
fn policy(leaf: u32, subleaf: u32, seen: &Seen) -> (u32, u32, u32, u32) {
    let Seen {
        linux,
        apic,
        vcpu,
        vcpus,
        ..
    } = *seen;
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
            let max = if seen.misc_enable & MISC_LIMIT_CPUID != 0 {
                2
            } else {
                a.max(BASIC_LEAF_MAX)
            };
            (max, b, c, d)
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
            // OSXSAVE (27): CR4.OSXSAVE, where XSAVE (26) is offered.
            c &= !(1 << 27);
            if c & (1 << 26) != 0 && seen.cr4 & CR4_OSXSAVE != 0 {
                c |= 1 << 27;
            }
            if !seen.apic_enabled {
                d &= !(1 << 9);
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
                // RDPID (ECX 22): where the host has it, offered with "enable RDTSCP" (without
                // it, #UD), but not to Linux (see 80000001H).
                if !seen.rdtscp || linux {
                    c &= !(1 << 22);
                }
                // OSPKE (ECX 4): CR4.PKE, where PKU (3) is offered.
                c &= !(1 << 4);
                if c & (1 << 3) != 0 && seen.cr4 & CR4_PKE != 0 {
                    c |= 1 << 4;
                }
                // MD_CLEAR (10), IBRS/IBPB (26), STIBP (27), L1D_FLUSH (28),
                // ARCH_CAPABILITIES (29), CORE_CAPABILITIES (30), SSBD (31) in EDX: their
                // MSRs are not passed through (a guest's access is #GP).
                d &= !(1 << 10 | 0xfc00_0000);
            }
            if !seen.tsc_offsetting && subleaf == 0 {
                // TSC_ADJUST (EBX 1): its writes move the guest's TSC (`vmexit::msr`).
                return (a, b & !(1 << 1), c, d);
            }
            if linux && subleaf == 0 {
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
            // RDTSCP (EDX 27): with "enable RDTSCP", each vCPU reading its own IA32_TSC_AUX;
            // not for Linux, whose CPUID stays as its scenarios measured it. NX (EDX 20) gone
            // while IA32_MISC_ENABLE's XD bit disable is set.
            let mut d = d;
            if !seen.rdtscp || linux {
                d &= !(1 << 27);
            }
            if seen.misc_enable & MISC_XD_DISABLE != 0 {
                d &= !(1 << 20);
            }
            (a, b, c, d)
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
