//! The CPUID a guest sees (docs/GUEST-ABI.md, "CPUID"): the exit handler
//! (`bin/hvprof/vmexit/cpuid.rs`) gathers what the answer depends on ([`Seen`]) and asks
//! [`policy`], which starts from the host's leaves, given as a function so that the host tests
//! can give any CPU's.

/// "hvprofhvprof" in EBX, ECX, EDX.
pub const SIGNATURE: [u32; 3] = [
    u32::from_le_bytes(*b"hvpr"),
    u32::from_le_bytes(*b"ofhv"),
    u32::from_le_bytes(*b"prof"),
];
/// The output leaf (docs/GUEST-ABI.md, "Output"), the last of the hypervisor's.
pub const OUTPUT_LEAF: u32 = 0x4000_0002;
pub const HV_LEAF_MAX: u32 = OUTPUT_LEAF;
pub const ABI_VERSION: u32 = 1;

/// Leaves up to this one are answered (0x15 and 0x16 are synthesized: the TSC's frequency).
pub const BASIC_LEAF_MAX: u32 = 0x16;

/// A leaf's EAX, EBX, ECX, EDX.
pub type Regs = (u32, u32, u32, u32);

/// What the answer depends on besides the leaf: the kind of VM, and the vCPU's own state (CPUID
/// reports some of it: the APIC's global enable, CR4.OSXSAVE and CR4.PKE, two IA32_MISC_ENABLE
/// bits).
pub struct Seen {
    pub linux: bool,
    /// The VM has local APICs (`apic=on`).
    pub apic: bool,
    /// This vCPU's local APIC is globally enabled (IA32_APIC_BASE[11]; always without `apic`).
    pub apic_enabled: bool,
    pub vcpu: u16,
    pub vcpus: u32,
    /// The guest's CR4.
    pub cr4: u64,
    /// Its IA32_MISC_ENABLE.
    pub misc_enable: u64,
    /// "Enable RDTSCP" is on: RDTSCP and RDPID run in the guest, with its own IA32_TSC_AUX.
    pub rdtscp: bool,
    /// "Use TSC offsetting" is on: the guest may write IA32_TSC and IA32_TSC_ADJUST.
    pub tsc_offsetting: bool,
    /// The TSC's frequency (leaves 15H and 16H).
    pub tsc_hz: u64,
    /// Leaf 0AH of the vCPU's virtual PMU (`vpmu=`), or none.
    pub pmu: Option<Regs>,
}

/// CR4.OSXSAVE and CR4.PKE (SDM Vol. 3A §2.5).
const CR4_OSXSAVE: u64 = 1 << 18;
const CR4_PKE: u64 = 1 << 22;
/// IA32_MISC_ENABLE's "limit CPUID maxval" (22) and "XD bit disable" (34) (SDM Vol. 4, Table 2-2).
const MISC_LIMIT_CPUID: u64 = 1 << 22;
const MISC_XD_DISABLE: u64 = 1 << 34;

/// RDTSCP and RDPID are offered (where the host has them): the CPU runs them with the vCPU's
/// own IA32_TSC_AUX ("enable RDTSCP"), and the guest is not Linux, whose CPUID stays as its
/// scenarios measured it.
fn offers_rdtscp(seen: &Seen) -> bool {
    seen.rdtscp && !seen.linux
}

/// IA32_TSC_ADJUST is offered where the host has it (CPUID.(EAX=07H,ECX=0):EBX[1]): its writes
/// move the vCPU's TSC, which needs TSC offsetting, and the guest is not Linux (as
/// [`offers_rdtscp`]). The MSR exit handler asks the same.
#[must_use]
pub fn offers_tsc_adjust(linux: bool, tsc_offsetting: bool) -> bool {
    tsc_offsetting && !linux
}

/// The CPUID a guest sees (docs/GUEST-ABI.md, "CPUID"): the host's leaves, with what the
/// hypervisor does not virtualize hidden, and the TSC frequency in leaves 15H/16H. A Linux guest
/// also loses what it would drive without an emulation behind it here (the local APIC, MTRRs,
/// machine checks, RDTSCP, speculation-control MSRs, thermal and power leaves); with `apic`
/// (`apic=on`) it keeps the local APIC and its TSC-deadline timer, which the hypervisor emulates.
/// Bits that report the vCPU's state follow it: OSXSAVE and OSPKE its CR4 (SDM Vol. 2A, CPUID),
/// the APIC bit its APIC's global enable (SDM Vol. 3A §11.4.3: "CPUID.01H:EDX[9] is 0" while
/// disabled), and leaf 0's maximum and the NX bit two IA32_MISC_ENABLE bits.
pub fn policy(leaf: u32, subleaf: u32, seen: &Seen, host: impl Fn(u32, u32) -> Regs) -> Regs {
    let Seen {
        linux,
        apic,
        vcpu,
        vcpus,
        ..
    } = *seen;
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
            let (a, mut b, mut c, mut d) = host(7, subleaf);
            if subleaf == 0 {
                // RDPID (ECX 22): without "enable RDTSCP", #UD.
                if !offers_rdtscp(seen) {
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
                // TSC_ADJUST (EBX 1).
                if !offers_tsc_adjust(linux, seen.tsc_offsetting) {
                    b &= !(1 << 1);
                }
                // AVX2 (EBX 5) and the AVX-512 family (EBX 16, 17, 21, 26-28, 30, 31): not for
                // Linux, see leaf 1.
                if linux {
                    b &= !(1 << 5 | 1 << 16 | 1 << 17 | 1 << 21 | 0b111 << 26 | 0b11 << 30);
                }
            }
            (a, b, c, d)
        }
        // A PMU only where the VM has a virtual one (`vpmu=`): the hypervisor owns the real
        // counters (it samples with them).
        0xa => seen.pmu.unwrap_or((0, 0, 0, 0)),
        // XSAVE state components: none (see leaf 1).
        0xd if linux => (0, 0, 0, 0),
        // Topology: not described (one core per vCPU), so Linux falls back to leaves 1 and 4; no
        // guest sees the host's x2APIC ids.
        0xb | 0x1f => (0, 0, 0, 0),
        // TSC/crystal ratio 1:1 and the crystal at the TSC's frequency; the base frequency in MHz.
        0x15 => (1, 1, seen.tsc_hz as u32, 0),
        0x16 => {
            let mhz = (seen.tsc_hz / 1_000_000).max(1) as u32;
            (mhz, mhz, 100, 0)
        }
        l if l < 0x4000_0000 && l > host_max => (0, 0, 0, 0),
        0x8000_0001 => {
            let (a, b, c, d) = host(leaf, subleaf);
            // RDTSCP (EDX 27): without "enable RDTSCP", #UD. NX (EDX 20) gone while
            // IA32_MISC_ENABLE's XD bit disable is set.
            let mut d = d;
            if !offers_rdtscp(seen) {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A Haswell as Bochs emulates it, in the bits the policy looks at: max leaf 0xd; leaf 1 with
    /// VMX, MONITOR, PDCM, x2APIC, XSAVE, OSXSAVE (the host's CR4) and APIC; leaf 7 with
    /// TSC_ADJUST, PKU, OSPKE, RDPID and the speculation-control bits; RDTSCP and NX.
    fn haswell(leaf: u32, _subleaf: u32) -> Regs {
        match leaf {
            0 => (0xd, 0x756e_6547, 0x6c65_746e, 0x4965_6e69),
            1 => (
                0x306c3,
                0x0001_0800,
                1 << 3 | 1 << 5 | 1 << 15 | 1 << 21 | 1 << 26 | 1 << 27,
                1 << 9 | 1,
            ),
            7 => (0, 1 << 1 | 1 << 5, 1 << 3 | 1 << 4 | 1 << 22, 0xfc00_0400),
            0x8000_0001 => (0, 0, 0, 1 << 20 | 1 << 27),
            _ => (0, 0, 0, 0),
        }
    }

    fn seen() -> Seen {
        Seen {
            linux: false,
            apic: true,
            apic_enabled: true,
            vcpu: 1,
            vcpus: 2,
            cr4: 0,
            misc_enable: 1,
            rdtscp: true,
            tsc_offsetting: true,
            tsc_hz: 1_000_000_000,
            pmu: None,
        }
    }

    fn ask(leaf: u32, s: &Seen) -> Regs {
        policy(leaf, 0, s, haswell)
    }

    #[test]
    fn the_bits_that_report_the_vcpus_state_follow_it() {
        let mut s = seen();
        // OSXSAVE is the guest's CR4.OSXSAVE, not the host's.
        assert_eq!(ask(1, &s).2 & 1 << 27, 0);
        s.cr4 = CR4_OSXSAVE;
        assert_ne!(ask(1, &s).2 & 1 << 27, 0);
        // OSPKE likewise.
        assert_eq!(ask(7, &seen()).2 & 1 << 4, 0);
        s.cr4 = CR4_PKE;
        assert_ne!(ask(7, &s).2 & 1 << 4, 0);
        // The APIC bit follows the global enable.
        assert_ne!(ask(1, &s).3 & 1 << 9, 0);
        s.apic_enabled = false;
        assert_eq!(
            ask(1, &s).3 & 1 << 9,
            0,
            "CPUID.1:EDX[9] clear while disabled"
        );
        // IA32_MISC_ENABLE: limit CPUID maxval, XD disable.
        let mut s = seen();
        assert_eq!(ask(0, &s).0, BASIC_LEAF_MAX);
        s.misc_enable |= MISC_LIMIT_CPUID;
        assert_eq!(ask(0, &s).0, 2);
        assert_ne!(ask(0x8000_0001, &s).3 & 1 << 20, 0);
        s.misc_enable |= MISC_XD_DISABLE;
        assert_eq!(
            ask(0x8000_0001, &s).3 & 1 << 20,
            0,
            "no NX while XD is disabled"
        );
    }

    #[test]
    fn what_the_hypervisor_does_not_virtualize_is_hidden() {
        let s = seen();
        let (_, b, c, _) = ask(1, &s);
        assert_eq!(
            c & (1 << 5 | 1 << 3 | 1 << 15 | 1 << 21),
            0,
            "VMX MONITOR PDCM x2APIC"
        );
        assert_ne!(c & 1 << 31, 0, "the hypervisor bit");
        assert_eq!(b >> 24, 1, "the vCPU's initial APIC id");
        assert_eq!((b >> 16) & 0xff, 2, "the VM's vCPUs");
        let (_, _, _, d) = ask(7, &s);
        assert_eq!(d, 0, "speculation-control MSRs are #GP: their bits go");
        assert_eq!(ask(0xa, &s), (0, 0, 0, 0), "no PMU");
        let with = Seen {
            pmu: Some((0x0730_0402, 0x78, 0, 0x0603)),
            ..seen()
        };
        assert_eq!(
            ask(0xa, &with),
            (0x0730_0402, 0x78, 0, 0x0603),
            "the vPMU's"
        );
        assert_eq!(ask(0x4000_0000, &s).1, SIGNATURE[0]);
    }

    #[test]
    fn rdtscp_rdpid_and_tsc_adjust_go_with_the_controls_behind_them() {
        let mut s = seen();
        assert_ne!(ask(0x8000_0001, &s).3 & 1 << 27, 0, "RDTSCP");
        assert_ne!(ask(7, &s).2 & 1 << 22, 0, "RDPID");
        assert_ne!(ask(7, &s).1 & 1 << 1, 0, "TSC_ADJUST");
        s.rdtscp = false;
        s.tsc_offsetting = false;
        assert_eq!(ask(0x8000_0001, &s).3 & 1 << 27, 0);
        assert_eq!(ask(7, &s).2 & 1 << 22, 0);
        assert_eq!(ask(7, &s).1 & 1 << 1, 0);
        // Linux keeps the CPUID its scenarios measured: none of them, and no XSAVE.
        let mut l = seen();
        l.linux = true;
        l.cr4 = CR4_OSXSAVE;
        assert_eq!(ask(0x8000_0001, &l).3 & 1 << 27, 0);
        assert_eq!(ask(7, &l).2 & 1 << 22, 0);
        assert_eq!(ask(7, &l).1 & (1 << 1 | 1 << 5), 0);
        assert_eq!(ask(1, &l).2 & (0xf << 26), 0);
        // ... whether or not the CPU offsets the TSC (AVX2 stays hidden either way).
        l.tsc_offsetting = false;
        assert_eq!(ask(7, &l).1 & (1 << 1 | 1 << 5), 0);
    }
}
