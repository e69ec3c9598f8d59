//! The VMX instructions the hypervisor needs besides VMLAUNCH/VMRESUME (which live in the entry
//! stub), as inline assembly (SDM Vol. 3C Chapter 32 "VMX Instruction Reference").
//!
//! Each returns the outcome decoded from RFLAGS per SDM Vol. 3C §32.2 "Conventions": CF = 1 is
//! VMfailInvalid, ZF = 1 is VMfailValid, whose error number these wrappers read from the current
//! VMCS's VM-instruction error field themselves (a VMfailValid implies a current VMCS).
//!
//! Compiled on every x86_64 target so that the host build type-checks them, but only executed by
//! the hypervisor: outside VMX operation each of them raises #UD, and VMXON/VMXOFF/VMCLEAR/VMPTRLD
//! raise #GP at CPL > 0.

use crate::errors::{InstructionError, VmFail};
use crate::vmcs::{ReadOnly32, VmcsAccess};
use core::arch::asm;
use core::marker::PhantomData;

/// Turns the CF and ZF bytes captured by `setc`/`setz` into the result.
///
/// # Safety
/// Only right after a VMX instruction, in VMX operation: on ZF = 1 it executes VMREAD.
#[inline]
unsafe fn outcome(cf: u8, zf: u8) -> Result<(), VmFail> {
    VmFail::from_flags(cf != 0, zf != 0, || {
        // SAFETY: VMfailValid means we are in VMX root operation with a current VMCS (SDM Vol. 3C
        // §32.2), so VMREAD of the VM-instruction error field is valid.
        match unsafe { vmread(ReadOnly32::VmInstructionError as u32) } {
            Ok(n) => (n & 0xffff_ffff) as u32,
            Err(_) => InstructionError::Unknown(0).number(),
        }
    })
}

/// VMXON: enters VMX root operation (SDM Vol. 3C §32.3 "VMXON"; §24.7-§24.8).
///
/// # Safety
/// CPL 0; CR4.VMXE = 1; CR0 and CR4 satisfy IA32_VMX_CR0/CR4_FIXED0/1; IA32_FEATURE_CONTROL is
/// locked with VMX outside SMX enabled. `vmxon_region` is the 4 KiB-aligned physical address of a
/// write-back region of `caps::VmxCaps::vmcs_size` bytes whose first 4 bytes hold the VMCS revision
/// identifier (bit 31 clear); that memory belongs to the processor until VMXOFF and must not be
/// touched or freed before.
pub unsafe fn vmxon(vmxon_region: u64) -> Result<(), VmFail> {
    let (cf, zf): (u8, u8);
    // SAFETY: the caller guarantees the preconditions above; the operand is a valid u64 on our
    // stack holding the physical address.
    unsafe {
        asm!(
            "vmxon qword ptr [{p}]",
            "setc {cf}",
            "setz {zf}",
            p = in(reg) &vmxon_region,
            cf = out(reg_byte) cf,
            zf = out(reg_byte) zf,
            options(nostack),
        );
        outcome(cf, zf)
    }
}

/// VMXOFF: leaves VMX operation (SDM Vol. 3C §32.3 "VMXOFF").
///
/// # Safety
/// In VMX root operation at CPL 0. Every VMCS this CPU used should have been VMCLEARed first, or
/// its data may not have been written back to memory (SDM Vol. 3C §25.11.3).
pub unsafe fn vmxoff() -> Result<(), VmFail> {
    let (cf, zf): (u8, u8);
    // SAFETY: the caller guarantees we are in VMX root operation; VMXOFF touches no memory of ours.
    unsafe {
        asm!(
            "vmxoff",
            "setc {cf}",
            "setz {zf}",
            cf = out(reg_byte) cf,
            zf = out(reg_byte) zf,
            options(nostack),
        );
        outcome(cf, zf)
    }
}

/// VMCLEAR: writes back and deactivates a VMCS, sets its launch state to clear (SDM Vol. 3C §32.3
/// "VMCLEAR"). Must precede the first VMPTRLD+VMLAUNCH of a VMCS and its migration to another CPU.
///
/// # Safety
/// In VMX root operation at CPL 0. `vmcs` is the 4 KiB-aligned physical address of a VMCS region
/// (revision identifier written), not the VMXON region, that stays allocated; the processor writes
/// to it.
pub unsafe fn vmclear(vmcs: u64) -> Result<(), VmFail> {
    let (cf, zf): (u8, u8);
    // SAFETY: the caller guarantees VMX root operation and a valid VMCS region; the operand is a
    // valid u64 on our stack.
    unsafe {
        asm!(
            "vmclear qword ptr [{p}]",
            "setc {cf}",
            "setz {zf}",
            p = in(reg) &vmcs,
            cf = out(reg_byte) cf,
            zf = out(reg_byte) zf,
            options(nostack),
        );
        outcome(cf, zf)
    }
}

/// VMPTRLD: makes a VMCS current and active on this CPU (SDM Vol. 3C §32.3 "VMPTRLD").
///
/// # Safety
/// As for [`vmclear`]; the region must not be active on another CPU, and it stays in use by the
/// processor until it is VMCLEARed.
pub unsafe fn vmptrld(vmcs: u64) -> Result<(), VmFail> {
    let (cf, zf): (u8, u8);
    // SAFETY: the caller guarantees VMX root operation and a valid VMCS region; the operand is a
    // valid u64 on our stack.
    unsafe {
        asm!(
            "vmptrld qword ptr [{p}]",
            "setc {cf}",
            "setz {zf}",
            p = in(reg) &vmcs,
            cf = out(reg_byte) cf,
            zf = out(reg_byte) zf,
            options(nostack),
        );
        outcome(cf, zf)
    }
}

/// VMPTRST: the physical address of the current VMCS, `u64::MAX` when there is none (SDM Vol. 3C
/// §32.3 "VMPTRST").
///
/// # Safety
/// In VMX root operation at CPL 0.
pub unsafe fn vmptrst() -> Result<u64, VmFail> {
    let mut pointer = 0u64;
    let (cf, zf): (u8, u8);
    // SAFETY: the caller guarantees VMX root operation; VMPTRST writes 8 bytes to `pointer`.
    unsafe {
        asm!(
            "vmptrst qword ptr [{p}]",
            "setc {cf}",
            "setz {zf}",
            p = in(reg) &mut pointer,
            cf = out(reg_byte) cf,
            zf = out(reg_byte) zf,
            options(nostack),
        );
        outcome(cf, zf)?;
    }
    Ok(pointer)
}

/// VMREAD of a field of the current VMCS (SDM Vol. 3C §32.3 "VMREAD"). Fails with VMfailInvalid
/// without a current VMCS, with error 12 for an unsupported encoding.
///
/// # Safety
/// In VMX operation (else #UD).
#[inline(always)]
pub unsafe fn vmread(encoding: u32) -> Result<u64, VmFail> {
    let value: u64;
    let (failed, cf): (u8, u8);
    // SAFETY: the caller guarantees VMX operation; VMREAD with a register destination touches no
    // memory.
    unsafe {
        asm!(
            "vmread {v}, {e}",
            // CF = 1 or ZF = 1: one test on the way that succeeds (every exit reads several).
            "setbe {failed}",
            "setc {cf}",
            v = out(reg) value,
            e = in(reg) u64::from(encoding),
            failed = out(reg_byte) failed,
            cf = out(reg_byte) cf,
            options(nostack, nomem),
        );
        if failed != 0 {
            // Not CF: ZF (VMfailValid).
            outcome(cf, u8::from(cf == 0))?;
        }
    }
    Ok(value)
}

/// VMREAD for the profiler's sample path: no error decoding, two instructions. A failed VMREAD
/// (no current VMCS, unsupported encoding) leaves its destination as it was: the value is then
/// whatever the register held, which the caller must accept as a possible value (a sample's RIP
/// is attributed, never trusted for control flow; a guest address is read within the VM's
/// memory or not at all). Not zeroed first: a zero costs an instruction per field on the sample
/// path, for a failure that a current VMCS and a field of every VMCS rule out.
///
/// # Safety
/// In VMX operation (else #UD).
#[inline(always)]
pub unsafe fn vmread_fast(encoding: u32) -> u64 {
    let value: u64;
    // SAFETY: the caller guarantees VMX operation; VMREAD with a register destination touches no
    // memory; on failure the destination keeps an unspecified integer, still a valid `u64`.
    unsafe {
        asm!(
            "vmread {v}, {e}",
            v = out(reg) value,
            e = in(reg) u64::from(encoding),
            options(nostack, nomem),
        );
    }
    value
}

/// [`vmread_fast`] of a typed field: the encoding comes from the field's type, so no caller
/// casts one.
///
/// # Safety
/// In VMX operation (else #UD).
#[inline(always)]
pub unsafe fn vmread_field_fast<F: crate::vmcs::VmcsField>(field: F) -> u64 {
    // SAFETY: the caller's contract is `vmread_fast`'s.
    unsafe { vmread_fast(field.encoding()) }
}

/// VMWRITE of a field of the current VMCS (SDM Vol. 3C §32.3 "VMWRITE"). Fails with error 12 for
/// an unsupported encoding and 13 for a read-only one.
///
/// # Safety
/// In VMX operation (else #UD). The value is the caller's responsibility: host-state fields decide
/// where and how the next VM exit lands, control fields what memory the guest can reach (EPTP,
/// bitmap and MSR-area addresses must stay valid while the VMCS is in use).
#[inline]
pub unsafe fn vmwrite(encoding: u32, value: u64) -> Result<(), VmFail> {
    // SAFETY: the caller guarantees VMX operation and a value that keeps the VMCS sound. The
    // branches leave on CF = 1 (VMfailInvalid) and ZF = 1 (VMfailValid), whose error number
    // `outcome` reads; the way that succeeds falls through.
    unsafe {
        asm!(
            "vmwrite {e}, {v}",
            "jc {invalid}",
            "jz {valid}",
            e = in(reg) u64::from(encoding),
            v = in(reg) value,
            invalid = label {
                // SAFETY: right after the VMWRITE, in VMX operation (see `outcome`).
                return unsafe { outcome(1, 0) };
            },
            valid = label {
                // SAFETY: as above; ZF = 1 means a current VMCS, whose error field it reads.
                return unsafe { outcome(0, 1) };
            },
            options(nostack, nomem),
        );
    }
    Ok(())
}

/// INVVPID types (SDM Vol. 3C §32.3 "INVVPID"); which ones the CPU supports is in
/// IA32_VMX_EPT_VPID_CAP bits 40-43 (`caps::ept_cap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InvVpidType {
    /// Mappings of one linear address for one VPID.
    IndividualAddress = 0,
    /// All mappings tagged with one VPID.
    SingleContext = 1,
    /// All mappings of all VPIDs except 0.
    AllContext = 2,
    /// As `SingleContext`, but global translations survive.
    SingleContextRetainingGlobals = 3,
}

/// INVVPID: invalidates TLB entries tagged with a VPID (SDM Vol. 3C §32.3 "INVVPID", §29.4.3.3).
/// The 128-bit descriptor is built here: bits 15:0 `vpid`, 63:16 zero, 127:64 `linear_address`
/// (used by `IndividualAddress` only). Fails with error 28 for an unsupported type, VPID 0 (except
/// with `AllContext`) or a non-canonical address.
///
/// # Safety
/// In VMX root operation at CPL 0, on a CPU with INVVPID (else #UD).
pub unsafe fn invvpid(kind: InvVpidType, vpid: u16, linear_address: u64) -> Result<(), VmFail> {
    let descriptor: [u64; 2] = [u64::from(vpid), linear_address];
    let (cf, zf): (u8, u8);
    // SAFETY: the caller guarantees VMX root operation and INVVPID support; the descriptor is 16
    // readable bytes on our stack. Invalidating TLB entries never breaks memory safety.
    unsafe {
        asm!(
            "invvpid {t}, xmmword ptr [{d}]",
            "setc {cf}",
            "setz {zf}",
            t = in(reg) kind as u64,
            d = in(reg) &descriptor,
            cf = out(reg_byte) cf,
            zf = out(reg_byte) zf,
            options(nostack, readonly),
        );
        outcome(cf, zf)
    }
}

/// INVEPT types (SDM Vol. 3C §32.3 "INVEPT"); support is in IA32_VMX_EPT_VPID_CAP bits 25-26.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InvEptType {
    /// Mappings derived from one EPTP.
    SingleContext = 1,
    /// Mappings derived from all EPTPs.
    AllContext = 2,
}

/// INVEPT: invalidates guest-physical and combined mappings derived from EPT (SDM Vol. 3C §32.3
/// "INVEPT", §29.4.3.1). The descriptor is `eptp` in bits 63:0 (used by `SingleContext` only),
/// zero in bits 127:64.
///
/// # Safety
/// In VMX root operation at CPL 0, on a CPU with INVEPT (else #UD).
pub unsafe fn invept(kind: InvEptType, eptp: u64) -> Result<(), VmFail> {
    let descriptor: [u64; 2] = [eptp, 0];
    let (cf, zf): (u8, u8);
    // SAFETY: the caller guarantees VMX root operation and INVEPT support; the descriptor is 16
    // readable bytes on our stack. Invalidating TLB entries never breaks memory safety.
    unsafe {
        asm!(
            "invept {t}, xmmword ptr [{d}]",
            "setc {cf}",
            "setz {zf}",
            t = in(reg) kind as u64,
            d = in(reg) &descriptor,
            cf = out(reg_byte) cf,
            zf = out(reg_byte) zf,
            options(nostack, readonly),
        );
        outcome(cf, zf)
    }
}

/// The current VMCS of this CPU, through VMREAD/VMWRITE: the hypervisor's [`VmcsAccess`].
///
/// Not `Send`: it stands for "the VMCS current on the CPU that created it".
pub struct CurrentVmcs {
    _not_send: PhantomData<*const ()>,
}

impl CurrentVmcs {
    /// # Safety
    /// For the lifetime of the value, this CPU stays in VMX root operation (so VMREAD/VMWRITE do
    /// not raise #UD) and the value is used only on this CPU. Writes through it have the
    /// obligations of [`vmwrite`].
    pub unsafe fn new() -> Self {
        CurrentVmcs {
            _not_send: PhantomData,
        }
    }

    /// [`vmread_fast`] of a field of this VMCS: no error decoding. A failed VMREAD (an encoding
    /// the processor does not have) yields an unspecified value, which the caller must accept;
    /// for the fields of every VMCS (SDM Vol. 3C, Appendix B) it cannot fail, the VMCS being
    /// current. For the paths taken at every sample and every exit.
    #[inline(always)]
    pub fn read_fast<F: crate::vmcs::VmcsField>(&self, field: F) -> u64 {
        // SAFETY: `CurrentVmcs::new`'s contract: we are in VMX operation on this CPU.
        unsafe { vmread_field_fast(field) }
    }
}

impl VmcsAccess for CurrentVmcs {
    #[inline]
    fn read(&self, encoding: u32) -> Result<u64, VmFail> {
        // SAFETY: `CurrentVmcs::new`'s contract: we are in VMX operation on this CPU.
        unsafe { vmread(encoding) }
    }
    #[inline]
    fn write(&mut self, encoding: u32, value: u64) -> Result<(), VmFail> {
        // SAFETY: `CurrentVmcs::new`'s contract: VMX operation, and its creator vouched for what
        // gets written.
        unsafe { vmwrite(encoding, value) }
    }
}
