//! How VMX instructions fail (Intel SDM Vol. 3C §32.2 "Conventions" and §32.4 "VM Instruction
//! Error Numbers") and how a VM entry fails after the VM-entry checks on controls and host state
//! have passed (SDM Vol. 3C §27.8 "VM-Entry Failures During or After Loading Guest State").

use crate::exit::{BasicExit, ExitReason};
use core::fmt;

/// A failed VMX instruction (SDM Vol. 3C §32.2).
///
/// - `Invalid` is VMfailInvalid: RFLAGS.CF = 1. There is no current VMCS (or the operand was
///   rejected before one could be involved), so no error number is recorded anywhere.
/// - `Valid` is VMfailValid: RFLAGS.ZF = 1. The processor stored an error number in the
///   VM-instruction error field of the current VMCS (`ReadOnly32::VmInstructionError`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VmFail {
    Invalid,
    Valid(InstructionError),
}

impl VmFail {
    /// Decodes the arithmetic flags a VMX instruction left behind (SDM Vol. 3C §32.2):
    /// CF = 1 is VMfailInvalid, else ZF = 1 is VMfailValid, whose error number `read_error`
    /// fetches from the current VMCS (it is only called in that case), else VMsucceed.
    #[inline]
    pub fn from_flags(cf: bool, zf: bool, read_error: impl FnOnce() -> u32) -> Result<(), VmFail> {
        if cf {
            Err(VmFail::Invalid)
        } else if zf {
            Err(VmFail::Valid(InstructionError::from_number(read_error())))
        } else {
            Ok(())
        }
    }

    /// [`VmFail::from_flags`] on a whole RFLAGS value (CF is bit 0, ZF bit 6).
    pub fn from_rflags(rflags: u64, read_error: impl FnOnce() -> u32) -> Result<(), VmFail> {
        Self::from_flags(rflags & 1 != 0, rflags & (1 << 6) != 0, read_error)
    }
}

impl fmt::Display for VmFail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VmFail::Invalid => f.write_str("VMfailInvalid: no current VMCS, or an invalid operand"),
            VmFail::Valid(e) => write!(f, "VMfailValid({}): {}", e.number(), e.description()),
        }
    }
}

macro_rules! instruction_errors {
    ($( $variant:ident = $num:literal => $text:literal, )*) => {
        /// The VM-instruction error numbers (SDM Vol. 3C §32.4, Table 32-1). Numbers 14, 21 and 27
        /// are reserved; they and any number newer than this table decode to `Unknown`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum InstructionError {
            $( #[doc = $text] $variant, )*
            /// A number Table 32-1 does not define.
            Unknown(u32),
        }

        impl InstructionError {
            /// Every defined error, in table order.
            pub const ALL: &'static [InstructionError] = &[$(InstructionError::$variant),*];

            pub const fn from_number(n: u32) -> Self {
                match n {
                    $( $num => InstructionError::$variant, )*
                    _ => InstructionError::Unknown(n),
                }
            }

            /// The number the processor stores in the VM-instruction error field.
            pub const fn number(self) -> u32 {
                match self {
                    $( InstructionError::$variant => $num, )*
                    InstructionError::Unknown(n) => n,
                }
            }

            /// The description of Table 32-1.
            pub const fn description(self) -> &'static str {
                match self {
                    $( InstructionError::$variant => $text, )*
                    InstructionError::Unknown(_) => "unknown VM-instruction error number",
                }
            }
        }
    };
}

instruction_errors! {
    VmcallInVmxRoot = 1 => "VMCALL executed in VMX root operation",
    VmclearInvalidAddress = 2 => "VMCLEAR with invalid physical address",
    VmclearVmxonPointer = 3 => "VMCLEAR with VMXON pointer",
    VmlaunchNonClear = 4 => "VMLAUNCH with non-clear VMCS",
    VmresumeNonLaunched = 5 => "VMRESUME with non-launched VMCS",
    VmresumeAfterVmxoff = 6 => "VMRESUME after VMXOFF (VMXOFF and VMXON between VMLAUNCH and VMRESUME)",
    InvalidControlFields = 7 => "VM entry with invalid control field(s)",
    InvalidHostStateFields = 8 => "VM entry with invalid host-state field(s)",
    VmptrldInvalidAddress = 9 => "VMPTRLD with invalid physical address",
    VmptrldVmxonPointer = 10 => "VMPTRLD with VMXON pointer",
    VmptrldBadRevision = 11 => "VMPTRLD with incorrect VMCS revision identifier",
    UnsupportedComponent = 12 => "VMREAD/VMWRITE from/to unsupported VMCS component",
    WriteReadOnlyComponent = 13 => "VMWRITE to read-only VMCS component",
    VmxonInVmxRoot = 15 => "VMXON executed in VMX root operation",
    InvalidExecutiveVmcsPointer = 16 => "VM entry with invalid executive-VMCS pointer",
    NonLaunchedExecutiveVmcs = 17 => "VM entry with non-launched executive VMCS",
    ExecutiveVmcsNotVmxonPointer = 18 => "VM entry with executive-VMCS pointer not VMXON pointer",
    VmcallNonClearVmcs = 19 => "VMCALL with non-clear VMCS",
    VmcallInvalidExitControls = 20 => "VMCALL with invalid VM-exit control fields",
    VmcallBadMsegRevision = 22 => "VMCALL with incorrect MSEG revision identifier",
    VmxoffUnderDualMonitor = 23 => "VMXOFF under dual-monitor treatment of SMIs and SMM",
    VmcallInvalidSmmMonitorFeatures = 24 => "VMCALL with invalid SMM-monitor features",
    InvalidExecutiveControls = 25 => "VM entry with invalid VM-execution control fields in executive VMCS",
    EntryBlockedByMovSs = 26 => "VM entry with events blocked by MOV SS",
    InvalidInveptInvvpidOperand = 28 => "invalid operand to INVEPT/INVVPID",
}

impl fmt::Display for InstructionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "VM-instruction error {}: {}",
            self.number(),
            self.description()
        )
    }
}

/// A VM entry that failed during or after loading guest state (SDM Vol. 3C §27.8): VMLAUNCH or
/// VMRESUME does not fall through but "exits" to the host like a VM exit, with bit 31 of the exit
/// reason set. Only the exit reason and the exit qualification are meaningful then; the VMCS is
/// not launched by a failed VMLAUNCH.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EntryFailure {
    /// Basic exit reason 33: a check on guest state failed (SDM Vol. 3C §27.3.1).
    InvalidGuestState(GuestStateFailure),
    /// Basic exit reason 34: loading an MSR from the VM-entry MSR-load area failed (SDM Vol. 3C
    /// §27.4); `entry` is the 1-based index of the failing entry (the exit qualification).
    MsrLoading { entry: u64 },
    /// Basic exit reason 41: a machine-check event during VM entry (SDM Vol. 3C §27.9).
    MachineCheck,
    /// Bit 31 set with any other basic reason: not defined by the SDM.
    Other { basic: u16, qualification: u64 },
}

/// The exit qualification of a VM-entry failure due to invalid guest state (SDM Vol. 3C §27.8).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GuestStateFailure {
    /// 0: default (most guest-state checks, §27.3.1).
    Default,
    /// 2: loading the PDPTEs failed (§27.3.1.6).
    PdpteLoading,
    /// 3: injecting an NMI into a guest blocking events by STI.
    NmiBlockedBySti,
    /// 4: invalid VMCS link pointer (§27.3.1.5).
    InvalidVmcsLinkPointer,
    /// Any other value (1 is documented as not used).
    Other(u64),
}

impl GuestStateFailure {
    pub const fn from_qualification(q: u64) -> Self {
        match q {
            0 => GuestStateFailure::Default,
            2 => GuestStateFailure::PdpteLoading,
            3 => GuestStateFailure::NmiBlockedBySti,
            4 => GuestStateFailure::InvalidVmcsLinkPointer,
            other => GuestStateFailure::Other(other),
        }
    }
}

impl EntryFailure {
    /// `None` when bit 31 of the exit reason is clear (an ordinary VM exit).
    pub fn decode(reason: ExitReason, qualification: u64) -> Option<Self> {
        if !reason.entry_failure() {
            return None;
        }
        Some(match reason.kind() {
            Some(BasicExit::InvalidGuestState) => EntryFailure::InvalidGuestState(
                GuestStateFailure::from_qualification(qualification),
            ),
            Some(BasicExit::MsrLoading) => EntryFailure::MsrLoading {
                entry: qualification,
            },
            Some(BasicExit::MachineCheckDuringEntry) => EntryFailure::MachineCheck,
            _ => EntryFailure::Other {
                basic: reason.basic(),
                qualification,
            },
        })
    }
}

impl fmt::Display for EntryFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("VM entry failed: ")?;
        match self {
            EntryFailure::InvalidGuestState(g) => {
                f.write_str("invalid guest state")?;
                match g {
                    GuestStateFailure::Default => Ok(()),
                    GuestStateFailure::PdpteLoading => f.write_str(" (loading the PDPTEs)"),
                    GuestStateFailure::NmiBlockedBySti => {
                        f.write_str(" (NMI injection while blocked by STI)")
                    }
                    GuestStateFailure::InvalidVmcsLinkPointer => {
                        f.write_str(" (invalid VMCS link pointer)")
                    }
                    GuestStateFailure::Other(q) => write!(f, " (qualification {q})"),
                }
            }
            EntryFailure::MsrLoading { entry } => {
                write!(f, "loading MSR entry {entry} of the VM-entry MSR-load area")
            }
            EntryFailure::MachineCheck => f.write_str("machine-check event during VM entry"),
            EntryFailure::Other {
                basic,
                qualification,
            } => write!(
                f,
                "basic exit reason {basic}, qualification {qualification:#x}"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn display_matches_the_sdm_wording() {
        let e = VmFail::Valid(InstructionError::from_number(7));
        assert_eq!(
            e.to_string(),
            "VMfailValid(7): VM entry with invalid control field(s)"
        );
        assert_eq!(
            VmFail::Valid(InstructionError::from_number(28)).to_string(),
            "VMfailValid(28): invalid operand to INVEPT/INVVPID"
        );
        assert!(VmFail::Invalid.to_string().starts_with("VMfailInvalid"));
        assert_eq!(
            VmFail::Valid(InstructionError::from_number(14)).to_string(),
            "VMfailValid(14): unknown VM-instruction error number"
        );
    }

    #[test]
    fn numbers_round_trip_and_reserved_ones_are_unknown() {
        assert_eq!(InstructionError::ALL.len(), 25);
        for &e in InstructionError::ALL {
            assert_eq!(InstructionError::from_number(e.number()), e);
        }
        for n in [0, 14, 21, 27, 29, u32::MAX] {
            assert_eq!(
                InstructionError::from_number(n),
                InstructionError::Unknown(n)
            );
        }
        assert_eq!(
            InstructionError::from_number(12),
            InstructionError::UnsupportedComponent
        );
        assert_eq!(
            InstructionError::from_number(13),
            InstructionError::WriteReadOnlyComponent
        );
    }

    #[test]
    fn flags() {
        let never = || -> u32 { panic!("error field read without ZF") };
        assert_eq!(VmFail::from_rflags(0x2, never), Ok(()));
        assert_eq!(VmFail::from_rflags(0x3, never), Err(VmFail::Invalid));
        // CF wins over ZF (they are never both set, but CF means there is no VMCS to read).
        assert_eq!(VmFail::from_rflags(0x43, never), Err(VmFail::Invalid));
        assert_eq!(
            VmFail::from_rflags(0x42, || 5),
            Err(VmFail::Valid(InstructionError::VmresumeNonLaunched))
        );
    }

    #[test]
    fn entry_failures() {
        assert_eq!(EntryFailure::decode(ExitReason(33), 0), None);
        assert_eq!(
            EntryFailure::decode(ExitReason(0x8000_0021), 0),
            Some(EntryFailure::InvalidGuestState(GuestStateFailure::Default))
        );
        assert_eq!(
            EntryFailure::decode(ExitReason(0x8000_0021), 4),
            Some(EntryFailure::InvalidGuestState(
                GuestStateFailure::InvalidVmcsLinkPointer
            ))
        );
        let msr = EntryFailure::decode(ExitReason(0x8000_0022), 2).unwrap();
        assert_eq!(msr, EntryFailure::MsrLoading { entry: 2 });
        assert_eq!(
            msr.to_string(),
            "VM entry failed: loading MSR entry 2 of the VM-entry MSR-load area"
        );
        assert_eq!(
            EntryFailure::decode(ExitReason(0x8000_0029), 0),
            Some(EntryFailure::MachineCheck)
        );
        assert_eq!(
            EntryFailure::decode(ExitReason(0x8000_000c), 7),
            Some(EntryFailure::Other {
                basic: 12,
                qualification: 7
            })
        );
    }

    proptest! {
        #[test]
        fn decoding_never_panics(reason in any::<u32>(), q in any::<u64>(), n in any::<u32>()) {
            if let Some(e) = EntryFailure::decode(ExitReason(reason), q) {
                let _ = e.to_string();
            }
            let e = InstructionError::from_number(n);
            prop_assert_eq!(e.number(), n);
            let _ = VmFail::Valid(e).to_string();
        }
    }
}
