//! A guest sample's record, from the VMCS of the vCPU that just exited: its RIP and CR3, and its
//! CPL and mode (real, protected, 64-bit code), taken from the guest-state area (SDM Vol. 3C
//! §25.4.1, "Guest Register State"). The VMCS is read through [`FastRead`]: `CurrentVmcs` in the
//! hypervisor, a fake VMCS in the host tests.

use hvprof_samplelog::{Chain, Sample, SampleKind};
use hvprof_vmx::vmcs::{Guest32, Guest64, GuestNatural, VmcsField};

/// A VMREAD with no error decoding, of a field every VMCS has (SDM Vol. 3C, Appendix B): the
/// sample path's only access to the VMCS.
pub trait FastRead {
    fn read_fast<F: VmcsField>(&self, field: F) -> u64;
}

#[cfg(target_arch = "x86_64")]
impl FastRead for hvprof_vmx::instructions::CurrentVmcs {
    #[inline(always)]
    fn read_fast<F: VmcsField>(&self, field: F) -> u64 {
        hvprof_vmx::instructions::CurrentVmcs::read_fast(self, field)
    }
}

/// CR0.PE (SDM Vol. 3A §2.5): protected mode.
const CR0_PE: u64 = 1 << 0;
/// IA32_EFER.LMA (SDM Vol. 3A §2.2.1, Table 2-1 "IA32_EFER"): IA-32e mode active.
const EFER_LMA: u64 = 1 << 10;

/// What the pCPU runs when the sample is taken: VM, vCPU, VPID and the vCPU's last exit reason.
pub type Running = (u16, u16, u16, u16);

/// The sample at TSC `now` of the guest whose VMCS `vmcs` is (no chain yet), with its CPL and
/// mode (`hvprof_samplelog::MODE_*`). The CPL is SS's DPL (SDM Vol. 3C §25.4.1: it equals the
/// CPL after a VM exit); the mode is real without CR0.PE, 64-bit with EFER.LMA and CS.L, and
/// protected otherwise (a 32-bit process of a 64-bit kernel included).
#[inline(always)]
pub fn guest_sample(
    vmcs: &impl FastRead,
    (vm, vcpu, vpid, exit): Running,
    now: u64,
) -> (Sample, u8, u8) {
    let rip = vmcs.read_fast(GuestNatural::Rip);
    let cr3 = vmcs.read_fast(GuestNatural::Cr3);
    let ss_ar = vmcs.read_fast(Guest32::SsAccessRights) as u32;
    let cs_ar = vmcs.read_fast(Guest32::CsAccessRights) as u32;
    let cr0 = vmcs.read_fast(GuestNatural::Cr0);
    let efer = vmcs.read_fast(Guest64::Ia32Efer);
    let cpl = hvprof_vmx::guest::cpl_from_ss_access_rights(ss_ar);
    let mode = if cr0 & CR0_PE == 0 {
        hvprof_samplelog::MODE_REAL
    } else if efer & EFER_LMA != 0 && hvprof_vmx::guest::long_code(cs_ar) {
        hvprof_samplelog::MODE_LONG
    } else {
        hvprof_samplelog::MODE_PROTECTED
    };
    let s = Sample {
        tsc: now,
        kind: SampleKind::Guest,
        vm,
        vcpu,
        vpid,
        guest_rip: rip,
        guest_cr3: cr3,
        guest_mode: hvprof_samplelog::guest_mode(cpl, mode),
        exit_reason: exit,
        host_rip: 0,
        cost: 0,
        host_chain: Chain::NOT_WALKED,
        guest_chain: Chain::NOT_WALKED,
    };
    (s, cpl, mode)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvprof_samplelog::{MODE_LONG, MODE_PROTECTED, MODE_REAL};
    use hvprof_vmx::fake::FakeVmcs;
    use hvprof_vmx::vmcs::{VmcsAccess, VmcsExt};

    impl FastRead for FakeVmcs {
        fn read_fast<F: VmcsField>(&self, field: F) -> u64 {
            self.read(field.encoding()).unwrap()
        }
    }

    /// Access rights (SDM Vol. 3C Table 25-2): type, S, DPL, P, L and D/B as given.
    fn rights(dpl: u32, long: bool, db: bool) -> u32 {
        0xb | 1 << 4 | dpl << 5 | 1 << 7 | u32::from(long) << 13 | u32::from(db) << 14
    }

    fn vmcs(cr0: u64, efer: u64, cs: u32, ss: u32) -> FakeVmcs {
        let mut v = FakeVmcs::new();
        v.write_natural(GuestNatural::Rip, 0xffff_ffff_8100_1234)
            .unwrap();
        v.write_natural(GuestNatural::Cr3, 0x1234_5000 | 0x12)
            .unwrap();
        v.write_natural(GuestNatural::Cr0, cr0).unwrap();
        v.write64(Guest64::Ia32Efer, efer).unwrap();
        v.write32(Guest32::CsAccessRights, cs).unwrap();
        v.write32(Guest32::SsAccessRights, ss).unwrap();
        v
    }

    /// Each mode a guest runs in, at CPL 0 and 3, read back from the sample as the analyzer
    /// reads it.
    #[test]
    fn the_sample_carries_the_guests_mode_and_cpl() {
        const PE_PG: u64 = 1 | 1 << 31;
        const LMA_LME: u64 = 1 << 10 | 1 << 8;
        let cases = [
            // (CR0, EFER, CS rights, SS rights) → (CPL, mode)
            (
                vmcs(0x10, 0, rights(0, false, false), rights(0, false, false)),
                (0, MODE_REAL),
            ),
            (
                vmcs(PE_PG, 0, rights(0, false, true), rights(0, false, true)),
                (0, MODE_PROTECTED),
            ),
            (
                vmcs(PE_PG, 0, rights(3, false, true), rights(3, false, true)),
                (3, MODE_PROTECTED),
            ),
            (
                vmcs(
                    PE_PG,
                    LMA_LME,
                    rights(0, true, false),
                    rights(0, false, true),
                ),
                (0, MODE_LONG),
            ),
            (
                vmcs(
                    PE_PG,
                    LMA_LME,
                    rights(3, true, false),
                    rights(3, false, true),
                ),
                (3, MODE_LONG),
            ),
            // A 32-bit process of a 64-bit kernel: IA-32e mode, compatibility code.
            (
                vmcs(
                    PE_PG,
                    LMA_LME,
                    rights(3, false, true),
                    rights(3, false, true),
                ),
                (3, MODE_PROTECTED),
            ),
            // LMA without 64-bit code yet (the far jump after enabling paging).
            (
                vmcs(
                    PE_PG,
                    LMA_LME,
                    rights(0, false, true),
                    rights(0, false, true),
                ),
                (0, MODE_PROTECTED),
            ),
        ];
        for (i, (v, (cpl, mode))) in cases.iter().enumerate() {
            let (s, c, m) = guest_sample(v, (2, 1, 7, 48), 99);
            assert_eq!((c, m), (*cpl, *mode), "case {i}");
            assert_eq!(
                s.guest_mode,
                hvprof_samplelog::guest_mode(*cpl, *mode),
                "case {i}"
            );
            assert_eq!(
                (s.tsc, s.vm, s.vcpu, s.vpid, s.exit_reason),
                (99, 2, 1, 7, 48)
            );
            assert_eq!(
                (s.guest_rip, s.guest_cr3),
                (0xffff_ffff_8100_1234, 0x1234_5012)
            );
            assert_eq!(s.kind, SampleKind::Guest);
            assert_eq!(
                (s.guest_chain, s.host_chain),
                (Chain::NOT_WALKED, Chain::NOT_WALKED)
            );
        }
    }
}
