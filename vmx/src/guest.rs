//! Operations on a guest's state that exit handlers share, over any [`VmcsAccess`] (the CPU's
//! current VMCS, or a fake one in tests), and the architectural checks a hypervisor must make
//! before it writes a value the guest chose into the guest-state area: a value the CPU would
//! refuse at VM entry must become the fault the guest would have taken, not a failed entry.

use crate::errors::VmFail;
use crate::exit::{InterruptionInfo, InterruptionType};
use crate::vmcs::VmcsAccess;
use crate::vmcs::{
    Control32, Guest32, Guest64, GuestNatural, Interruptibility, ReadOnly32, Segment, VmcsExt,
};

/// The guest's CPL: the DPL of SS (SDM Vol. 3C §25.4.1: SS.DPL is the CPL).
pub fn cpl(v: &impl VmcsAccess) -> Result<u8, VmFail> {
    Ok(cpl_from_ss_access_rights(
        v.read32(Guest32::SsAccessRights)?,
    ))
}

/// The CPL in the guest's SS access rights as the VMCS holds them (SDM Vol. 3C §25.4.1, Table
/// 25-2: bits 6:5 are the DPL, and SS.DPL is the CPL), for a caller that read the field itself.
pub const fn cpl_from_ss_access_rights(access_rights: u32) -> u8 {
    ((access_rights >> 5) & 3) as u8
}

/// The VM-exit instruction-information field for INS and OUTS (SDM Vol. 3C §28.2.5, Table 28-8),
/// which the CPU stores when IA32_VMX_BASIC[54] is set: the instruction's address size and, for
/// OUTS, its source segment (INS always writes through ES).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InsOutsInfo {
    /// Bits 9:7: 0 16-bit, 1 32-bit, 2 64-bit; in bytes: 2, 4 or 8.
    pub address_bytes: u8,
    /// Bits 17:15 (undefined for INS: ES then).
    pub segment: Segment,
}

impl InsOutsInfo {
    /// Decodes the field of an INS (`input`) or an OUTS; `None` for an encoding the SDM reserves.
    pub const fn decode(info: u32, input: bool) -> Option<Self> {
        let address_bytes = match (info >> 7) & 7 {
            0 => 2,
            1 => 4,
            2 => 8,
            _ => return None,
        };
        let segment = if input {
            Segment::Es
        } else {
            match Segment::from_encoding((info >> 15) & 7) {
                Some(s) => s,
                None => return None,
            }
        };
        Some(InsOutsInfo {
            address_bytes,
            segment,
        })
    }
}

/// Whether a code segment with these access rights (the VMCS format) is 64-bit: the L bit, bit 13
/// (SDM Vol. 3C §25.4.1, Table 25-2).
pub const fn long_code(cs_access_rights: u32) -> bool {
    cs_access_rights & (1 << 13) != 0
}

/// Completes an instruction the hypervisor emulated: advances RIP by the VM-exit instruction
/// length (valid for exits caused by an instruction, SDM Vol. 3C §28.2.5) and ends the
/// interrupt shadow of a preceding STI or MOV SS. The shadow covers only the instruction after
/// STI/MOV SS (SDM Vol. 3C §25.4.2, "Interruptibility State"); that instruction has now
/// executed, as the processor would clear the blocking after executing it. Left set, it would
/// delay interrupts by one more instruction and make a VM entry that injects an event fail.
pub fn skip_instruction(v: &mut impl VmcsAccess) -> Result<(), VmFail> {
    let len = v.read32(ReadOnly32::ExitInstructionLength)?;
    advance_rip(v, len.into())
}

/// Moves the guest's RIP past an emulated instruction of `len` bytes whose length the exit did
/// not give (an EPT violation's): as `skip_instruction`.
///
/// Under single-step (RFLAGS.TF set, IA32_DEBUGCTL.BTF clear) the instruction ends with a
/// single-step trap, as it would have on the CPU: the BS bit of the pending debug exceptions
/// (SDM Vol. 3C §25.4.2, Table 25-4), which the CPU delivers as a #DB with DR6.BS set right
/// after the VM entry (§27.7.3), before the next instruction and before an external interrupt
/// (Vol. 3A §6.9: traps on the previous instruction come first).
pub fn advance_rip(v: &mut impl VmcsAccess, len: u64) -> Result<(), VmFail> {
    let rip = v.read_natural(GuestNatural::Rip)?;
    v.write_natural(GuestNatural::Rip, rip.wrapping_add(len))?;
    let state = Interruptibility::from_bits_retain(v.read32(Guest32::InterruptibilityState)?);
    let shadow = Interruptibility::BLOCKING_BY_STI | Interruptibility::BLOCKING_BY_MOV_SS;
    if state.intersects(shadow) {
        v.write32(Guest32::InterruptibilityState, (state - shadow).bits())?;
    }
    if v.read_natural(GuestNatural::Rflags)? & RFLAGS_TF != 0
        && v.read64(Guest64::Ia32Debugctl)? & DEBUGCTL_BTF == 0
    {
        let pending = v.read_natural(GuestNatural::PendingDebugExceptions)?;
        v.write_natural(GuestNatural::PendingDebugExceptions, pending | PENDING_BS)?;
    }
    Ok(())
}

/// RFLAGS.TF (SDM Vol. 3A §2.3).
const RFLAGS_TF: u64 = 1 << 8;
/// IA32_DEBUGCTL.BTF: TF single-steps branches only (SDM Vol. 3B §18.4.1).
const DEBUGCTL_BTF: u64 = 1 << 1;
/// The pending debug exceptions' BS bit: a single-step trap is pending (SDM Vol. 3C Table 25-4).
const PENDING_BS: u64 = 1 << 14;

/// Whether a single-step trap is pending at the next VM entry ([`advance_rip`] set it): the
/// instruction just emulated was single-stepped, and the #DB comes before anything else the
/// guest would do (a HLT does not halt: the trap ends it).
pub fn single_step_pending(v: &impl VmcsAccess) -> Result<bool, VmFail> {
    Ok(v.read_natural(GuestNatural::PendingDebugExceptions)? & PENDING_BS != 0)
}

/// The exceptions that are faults (SDM Vol. 3A §6.5, Table 6-1): #DE, #BR, #UD, #NM, #TS, #NP,
/// #SS, #GP, #PF, #MF, #AC, #XM, #VE, #CP. #DB is a fault or a trap depending on its cause; the
/// hypervisor injects it only as a trap (after an instruction it emulated).
const FAULTS: u32 = 1 << 0
    | 1 << 5
    | 1 << 6
    | 1 << 7
    | 1 << 10
    | 1 << 11
    | 1 << 12
    | 1 << 13
    | 1 << 14
    | 1 << 16
    | 1 << 17
    | 1 << 19
    | 1 << 20
    | 1 << 21;

/// RFLAGS.RF (SDM Vol. 3A §18.3.1.1).
const RFLAGS_RF: u64 = 1 << 16;

/// Whether `vector` is a fault-class exception.
pub const fn is_fault(vector: u8) -> bool {
    vector < 32 && FAULTS & (1 << vector) != 0
}

/// Injects a hardware exception at the next VM entry (SDM Vol. 3C §25.8.3, §27.6); RIP stays at
/// the faulting instruction, as for a real fault. For a fault the RFLAGS image the handler finds
/// on its stack has RF set, as the CPU delivers a fault (SDM Vol. 3A §18.3.1.1: "the processor
/// sets RF in the EFLAGS image saved on the stack for all faults"), so that an IRET back to the
/// instruction does not take an instruction breakpoint twice. VM entry delivers the injected
/// event with the guest's RFLAGS as it is in the VMCS (SDM Vol. 3C §27.6.1.2), so RF is set
/// there.
pub fn inject_exception(
    v: &mut impl VmcsAccess,
    vector: u8,
    error_code: Option<u32>,
) -> Result<(), VmFail> {
    if is_fault(vector) {
        let rflags = v.read_natural(GuestNatural::Rflags)?;
        v.write_natural(GuestNatural::Rflags, rflags | RFLAGS_RF)?;
    }
    let info = InterruptionInfo::inject(
        vector,
        InterruptionType::HardwareException,
        error_code.is_some(),
    );
    v.write32(Control32::EntryInterruptionInfo, info.0)?;
    if let Some(code) = error_code {
        v.write32(Control32::EntryExceptionErrorCode, code)?;
    }
    Ok(())
}

/// CR0 bits (SDM Vol. 3A §2.5).
pub mod cr0 {
    pub const PE: u64 = 1 << 0;
    pub const NW: u64 = 1 << 29;
    pub const CD: u64 = 1 << 30;
    pub const PG: u64 = 1 << 31;
}

/// CR4 bits (SDM Vol. 3A §2.5).
pub mod cr4 {
    pub const PAE: u64 = 1 << 5;
    pub const LA57: u64 = 1 << 12;
    pub const VMXE: u64 = 1 << 13;
    pub const PCIDE: u64 = 1 << 17;
}

/// IA32_EFER bits (SDM Vol. 3A §2.2.1).
pub mod efer {
    pub const LME: u64 = 1 << 8;
    pub const LMA: u64 = 1 << 10;
}

/// What the guest is doing when it writes a control register.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CrContext {
    /// The guest's CR0 and CR4 as it sees them (read shadows merged in).
    pub cr0: u64,
    pub cr4: u64,
    pub efer: u64,
    pub cr3: u64,
    /// CS.L: executing 64-bit code.
    pub cs_long: bool,
}

/// Whether MOV to CR0 of `value` raises #GP (SDM Vol. 2B, "MOV—Move to/from Control Registers",
/// and Vol. 3A §2.5, §10.8.5): a reserved bit (63:32) set, PG without PE, NW without CD, paging
/// enabled with EFER.LME but without CR4.PAE, or paging disabled in 64-bit code.
pub fn cr0_write_faults(value: u64, ctx: &CrContext) -> bool {
    let enabling_paging = value & cr0::PG != 0 && ctx.cr0 & cr0::PG == 0;
    value >> 32 != 0
        || (value & cr0::PG != 0 && value & cr0::PE == 0)
        || (value & cr0::NW != 0 && value & cr0::CD == 0)
        || (enabling_paging && ctx.efer & efer::LME != 0 && ctx.cr4 & cr4::PAE == 0)
        || (value & cr0::PG == 0 && ctx.cs_long && ctx.efer & efer::LMA != 0)
}

/// Whether MOV to CR4 of `value` raises #GP (SDM Vol. 2B, "MOV—Move to/from Control Registers";
/// Vol. 3A §2.5, §4.10.1): a bit the processor does not support (`allowed` holds those it does:
/// the IA32_VMX_CR4_FIXED1 bits, without VMXE, which the guest does not have), PAE cleared or
/// LA57 changed in IA-32e mode, or PCIDE set outside IA-32e mode or with CR3[11:0] not zero.
pub fn cr4_write_faults(value: u64, allowed: u64, ctx: &CrContext) -> bool {
    let long = ctx.efer & efer::LMA != 0;
    let setting_pcide = value & cr4::PCIDE != 0 && ctx.cr4 & cr4::PCIDE == 0;
    value & !(allowed & !cr4::VMXE) != 0
        || (long && value & cr4::PAE == 0)
        || (long && (value ^ ctx.cr4) & cr4::LA57 != 0)
        || (setting_pcide && (!long || ctx.cr3 & 0xfff != 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Table 28-8: address size in bits 9:7, segment in bits 17:15 (OUTS only).
    #[test]
    fn ins_outs_information() {
        let outs_fs_32 = (1 << 7) | (4 << 15);
        assert_eq!(
            InsOutsInfo::decode(outs_fs_32, false),
            Some(InsOutsInfo {
                address_bytes: 4,
                segment: Segment::Fs
            })
        );
        // INS writes through ES whatever bits 17:15 hold.
        let ins = InsOutsInfo::decode((2 << 7) | (4 << 15), true).unwrap();
        assert_eq!((ins.address_bytes, ins.segment), (8, Segment::Es));
        assert_eq!(InsOutsInfo::decode(0, false).unwrap().address_bytes, 2);
        assert_eq!(InsOutsInfo::decode(3 << 7, false), None);
        assert_eq!(InsOutsInfo::decode(6 << 15, false), None);
    }
    use crate::errors::{InstructionError, VmFail};
    use std::collections::HashMap;

    /// A VMCS where every field exists and holds what was last written.
    #[derive(Default)]
    struct MapVmcs(HashMap<u32, u64>);

    impl VmcsAccess for MapVmcs {
        fn read(&self, encoding: u32) -> Result<u64, VmFail> {
            self.0
                .get(&encoding)
                .copied()
                .ok_or(VmFail::Valid(InstructionError::UnsupportedComponent))
        }
        fn write(&mut self, encoding: u32, value: u64) -> Result<(), VmFail> {
            self.0.insert(encoding, value);
            Ok(())
        }
    }

    fn vmcs(rip: u64, len: u32, interruptibility: u32) -> MapVmcs {
        let mut v = MapVmcs::default();
        v.0.insert(GuestNatural::Rip as u32, rip);
        v.0.insert(ReadOnly32::ExitInstructionLength as u32, len.into());
        v.0.insert(
            Guest32::InterruptibilityState as u32,
            interruptibility.into(),
        );
        v.0.insert(GuestNatural::Rflags as u32, 2);
        v.0.insert(Guest64::Ia32Debugctl as u32, 0);
        v.0.insert(GuestNatural::PendingDebugExceptions as u32, 0);
        v
    }

    #[test]
    fn a_single_stepped_instruction_ends_with_its_trap() {
        // TF set: BS pending after the skip.
        let mut v = vmcs(0x1000, 1, 0);
        v.0.insert(GuestNatural::Rflags as u32, 0x302);
        assert_eq!(single_step_pending(&v), Ok(false));
        skip_instruction(&mut v).unwrap();
        assert_eq!(v.read_natural(GuestNatural::Rip), Ok(0x1001));
        assert_eq!(single_step_pending(&v), Ok(true));
        // BTF: only branches are stepped; an emulated CPUID or HLT is not one.
        let mut v = vmcs(0x1000, 1, 0);
        v.0.insert(GuestNatural::Rflags as u32, 0x302);
        v.0.insert(Guest64::Ia32Debugctl as u32, DEBUGCTL_BTF);
        skip_instruction(&mut v).unwrap();
        assert_eq!(single_step_pending(&v), Ok(false));
        // No TF: nothing pending.
        let mut v = vmcs(0x1000, 1, 0);
        skip_instruction(&mut v).unwrap();
        assert_eq!(single_step_pending(&v), Ok(false));
    }

    #[test]
    fn an_injected_fault_pushes_rf_and_a_trap_does_not() {
        for (vector, rf) in [
            (13, true),
            (6, true),
            (14, true),
            (0, true),
            (3, false),
            (1, false),
        ] {
            let mut v = MapVmcs::default();
            v.0.insert(GuestNatural::Rflags as u32, 0x246);
            let code = (vector == 13 || vector == 14).then_some(0);
            inject_exception(&mut v, vector, code).unwrap();
            let rflags = v.0[&(GuestNatural::Rflags as u32)];
            assert_eq!(rflags & RFLAGS_RF != 0, rf, "vector {vector}");
            assert_eq!(
                rflags & !RFLAGS_RF,
                0x246,
                "vector {vector}: other flags kept"
            );
            let info = v.0[&(Control32::EntryInterruptionInfo as u32)];
            assert_eq!(info & 0xff, u64::from(vector));
        }
    }

    #[test]
    fn the_cpl_is_the_dpl_of_ss() {
        // A flat writable data segment (type 3, S, present) at DPL 0 and 3; the other bits of
        // the access rights do not change it.
        for (rights, want) in [(0x93, 0), (0xf3, 3), (0xb3, 1), (0x1_c0d3, 2)] {
            assert_eq!(cpl_from_ss_access_rights(rights), want, "{rights:#x}");
            let mut v = MapVmcs::default();
            v.0.insert(Guest32::SsAccessRights as u32, rights.into());
            assert_eq!(cpl(&v), Ok(want));
        }
    }

    #[test]
    fn skipping_an_instruction_ends_the_sti_and_mov_ss_shadow() {
        for (before, after) in [(0, 0), (1, 0), (2, 0), (3, 0), (1 | 8, 8), (4, 4)] {
            let mut v = vmcs(0x1000, 2, before);
            skip_instruction(&mut v).unwrap();
            assert_eq!(v.read_natural(GuestNatural::Rip), Ok(0x1002));
            assert_eq!(
                v.read32(Guest32::InterruptibilityState),
                Ok(after),
                "blocking {before:#x}: NMI and SMI blocking stay, STI and MOV SS end"
            );
        }
        let mut v = vmcs(u64::MAX, 3, 0);
        skip_instruction(&mut v).unwrap();
        assert_eq!(v.read_natural(GuestNatural::Rip), Ok(2), "wraps");
    }

    #[test]
    fn injection_writes_the_entry_fields() {
        let mut v = MapVmcs::default();
        v.0.insert(GuestNatural::Rflags as u32, 2);
        inject_exception(&mut v, 13, Some(0)).unwrap();
        assert_eq!(
            v.read32(Control32::EntryInterruptionInfo),
            Ok(0x8000_0b0d),
            "valid, error code, hardware exception, #GP"
        );
        assert_eq!(v.read32(Control32::EntryExceptionErrorCode), Ok(0));
        v.0.insert(Guest32::SsAccessRights as u32, 0x60f3);
        assert_eq!(cpl(&v), Ok(3));
    }

    const LONG: CrContext = CrContext {
        cr0: cr0::PE | cr0::PG | (1 << 16),
        cr4: cr4::PAE | (1 << 9),
        efer: efer::LME | efer::LMA | 1,
        cr3: 0x1000,
        cs_long: true,
    };
    const REAL: CrContext = CrContext {
        cr0: 0x10,
        cr4: 0,
        efer: 0,
        cr3: 0,
        cs_long: false,
    };

    #[test]
    fn cr0_values_the_cpu_refuses_fault() {
        assert!(!cr0_write_faults(LONG.cr0, &LONG), "unchanged");
        assert!(!cr0_write_faults(LONG.cr0 | cr0::CD | cr0::NW, &LONG));
        assert!(cr0_write_faults(LONG.cr0 | cr0::NW, &LONG), "NW without CD");
        assert!(cr0_write_faults(cr0::PG, &REAL), "PG without PE");
        assert!(
            cr0_write_faults(LONG.cr0 | 1 << 40, &LONG),
            "reserved high bits"
        );
        assert!(
            cr0_write_faults(LONG.cr0 & !cr0::PG, &LONG),
            "paging off in 64-bit code"
        );
        let compat = CrContext {
            cs_long: false,
            ..LONG
        };
        assert!(
            !cr0_write_faults(LONG.cr0 & !cr0::PG, &compat),
            "leaving long mode"
        );
        let no_pae = CrContext {
            cr0: cr0::PE,
            cr4: 0,
            efer: efer::LME,
            cr3: 0,
            cs_long: false,
        };
        assert!(
            cr0_write_faults(cr0::PE | cr0::PG, &no_pae),
            "LME without PAE"
        );
        assert!(!cr0_write_faults(cr0::PE, &REAL));
        assert!(!cr0_write_faults(0, &REAL), "real mode again");
    }

    #[test]
    fn cr4_values_the_cpu_refuses_fault() {
        let allowed = 0x0037_27ff | cr4::VMXE | cr4::PCIDE;
        assert!(!cr4_write_faults(LONG.cr4, allowed, &LONG));
        assert!(
            cr4_write_faults(LONG.cr4 | 1 << 31, allowed, &LONG),
            "reserved"
        );
        assert!(
            cr4_write_faults(LONG.cr4 | cr4::VMXE, allowed, &LONG),
            "VMX is hidden"
        );
        assert!(
            cr4_write_faults(LONG.cr4 & !cr4::PAE, allowed, &LONG),
            "PAE off in IA-32e"
        );
        let pcid_bad = CrContext {
            cr3: 0x1005,
            ..LONG
        };
        assert!(
            cr4_write_faults(LONG.cr4 | cr4::PCIDE, allowed, &pcid_bad),
            "CR3[11:0] != 0"
        );
        let pcid_ok = CrContext {
            cr3: 0x2000,
            ..LONG
        };
        assert!(!cr4_write_faults(LONG.cr4 | cr4::PCIDE, allowed, &pcid_ok));
        assert!(
            cr4_write_faults(cr4::PCIDE, allowed, &REAL),
            "PCIDE outside IA-32e"
        );
        assert!(!cr4_write_faults(cr4::PAE, allowed, &REAL));
    }
}
