//! INVEPT: descriptor, types and (on x86_64) the instruction (SDM Vol. 3C §29.4.3; the
//! instruction reference "INVEPT—Invalidate Translations Derived from EPT").

use core::fmt;

/// The INVEPT type, the register operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub enum InveptType {
    /// Invalidates mappings derived from the EPTP in the descriptor (IA32_VMX_EPT_VPID_CAP
    /// bit 25).
    SingleContext = 1,
    /// Invalidates mappings derived from all EPTPs (IA32_VMX_EPT_VPID_CAP bit 26).
    AllContext = 2,
}

/// The 128-bit INVEPT descriptor in memory: bits 63:0 the EPTP, bits 127:64 reserved, must be 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, align(16))]
pub struct InveptDescriptor {
    pub eptp: u64,
    pub reserved: u64,
}

impl InveptDescriptor {
    pub const fn new(eptp: u64) -> Self {
        Self { eptp, reserved: 0 }
    }
}

/// How a VMX instruction failed (SDM Vol. 3C §32.2 "Conventions").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InveptError {
    /// VMfailInvalid: CF set (no current VMCS to hold an error number).
    FailInvalid,
    /// VMfailValid: ZF set; the reason is in the VM-instruction error field of the current
    /// VMCS (28 = invalid operand to INVEPT/INVVPID).
    FailValid,
}

impl fmt::Display for InveptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::FailInvalid => "INVEPT failed (VMfailInvalid)",
            Self::FailValid => "INVEPT failed (VMfailValid; see the VM-instruction error field)",
        })
    }
}

/// Executes INVEPT.
///
/// # Safety
/// The caller must be in VMX root operation at CPL 0 (otherwise INVEPT raises #UD or #GP) and
/// the CPU must support INVEPT and `kind` (IA32_VMX_EPT_VPID_CAP bits 20, 25, 26); an
/// unsupported type or a bad EPTP in a single-context descriptor makes it VMfail, which is
/// reported, not a fault.
#[cfg(target_arch = "x86_64")]
pub unsafe fn invept(kind: InveptType, desc: &InveptDescriptor) -> Result<(), InveptError> {
    let cf: u8;
    let zf: u8;
    // SAFETY: the caller guarantees VMX root operation at CPL 0 and INVEPT support (the
    // function's contract); `desc` is a valid, readable 16-byte descriptor for the duration of
    // the instruction, which writes no memory and no register but the flags read right after.
    unsafe {
        core::arch::asm!(
            "invept {kind}, [{desc}]",
            "setc {cf}",
            "setz {zf}",
            kind = in(reg) kind as u64,
            desc = in(reg) desc as *const InveptDescriptor,
            cf = out(reg_byte) cf,
            zf = out(reg_byte) zf,
            options(nostack),
        );
    }
    if cf != 0 {
        Err(InveptError::FailInvalid)
    } else if zf != 0 {
        Err(InveptError::FailValid)
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_layout() {
        assert_eq!(core::mem::size_of::<InveptDescriptor>(), 16);
        let d = InveptDescriptor::new(0x1234_501e);
        assert_eq!(d.reserved, 0);
        assert_eq!(InveptType::SingleContext as u64, 1);
        assert_eq!(InveptType::AllContext as u64, 2);
    }
}
