//! Exit reasons, in one table (Intel SDM Vol. 3D Appendix C, Table C-1 "Basic Exit Reasons"), and
//! the decoders of the VM-exit information the hypervisor acts on: the exit-reason format (SDM Vol.
//! 3C §25.9.1, Table 25-18), the exit qualifications for control-register accesses and I/O
//! instructions (SDM Vol. 3C §28.2.1, Tables 28-3 and 28-5), and the interruption-information
//! format shared by VM-exit interruption information, IDT-vectoring information (SDM Vol. 3C
//! §25.9.2-§25.9.3, Tables 25-19 and 25-20) and VM-entry interruption information (§25.8.3,
//! Table 25-17).
//!
//! Every decoder is total: any 32- or 64-bit value decodes without panicking, undefined encodings
//! come back as `Unknown`/`Reserved`/raw values.

use crate::regs::Gpr;
use core::fmt;

macro_rules! basic_exits {
    ($( $(#[$m:meta])* $variant:ident = $num:literal => $name:literal, )*) => {
        /// A basic exit reason (exit reason bits 15:0), SDM Vol. 3D Table C-1. Numbers the table
        /// leaves unused (35, 38, 42) or newer than it have no variant: see [`ExitReason::kind`].
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u16)]
        pub enum BasicExit {
            $( $(#[$m])* $variant = $num, )*
        }

        impl BasicExit {
            /// Every basic exit reason, in number order.
            pub const ALL: &'static [BasicExit] = &[$(BasicExit::$variant),*];

            pub const fn from_number(n: u16) -> Option<Self> {
                match n {
                    $( $num => Some(BasicExit::$variant), )*
                    _ => None,
                }
            }

            /// The name used in reports and exit statistics, in the style of Linux `perf kvm
            /// stat` (e.g. `"EPT_VIOLATION"`).
            pub const fn name(self) -> &'static str {
                match self {
                    $( BasicExit::$variant => $name, )*
                }
            }
        }
    };
}

basic_exits! {
    /// Exception or non-maskable interrupt; see the VM-exit interruption information.
    ExceptionNmi = 0 => "EXCEPTION_NMI",
    ExternalInterrupt = 1 => "EXTERNAL_INTERRUPT",
    TripleFault = 2 => "TRIPLE_FAULT",
    InitSignal = 3 => "INIT_SIGNAL",
    StartupIpi = 4 => "SIPI",
    IoSmi = 5 => "IO_SMI",
    OtherSmi = 6 => "OTHER_SMI",
    InterruptWindow = 7 => "INTERRUPT_WINDOW",
    NmiWindow = 8 => "NMI_WINDOW",
    TaskSwitch = 9 => "TASK_SWITCH",
    Cpuid = 10 => "CPUID",
    Getsec = 11 => "GETSEC",
    Hlt = 12 => "HLT",
    Invd = 13 => "INVD",
    Invlpg = 14 => "INVLPG",
    Rdpmc = 15 => "RDPMC",
    Rdtsc = 16 => "RDTSC",
    Rsm = 17 => "RSM",
    Vmcall = 18 => "VMCALL",
    Vmclear = 19 => "VMCLEAR",
    Vmlaunch = 20 => "VMLAUNCH",
    Vmptrld = 21 => "VMPTRLD",
    Vmptrst = 22 => "VMPTRST",
    Vmread = 23 => "VMREAD",
    Vmresume = 24 => "VMRESUME",
    Vmwrite = 25 => "VMWRITE",
    Vmxoff = 26 => "VMXOFF",
    Vmxon = 27 => "VMXON",
    /// Control-register accesses; see [`CrAccess`].
    CrAccess = 28 => "CR_ACCESS",
    DrAccess = 29 => "DR_ACCESS",
    /// I/O instruction; see [`IoAccess`].
    IoInstruction = 30 => "IO_INSTRUCTION",
    Rdmsr = 31 => "RDMSR",
    Wrmsr = 32 => "WRMSR",
    /// VM-entry failure due to invalid guest state (with exit-reason bit 31 set).
    InvalidGuestState = 33 => "INVALID_GUEST_STATE",
    /// VM-entry failure due to MSR loading (with exit-reason bit 31 set).
    MsrLoading = 34 => "MSR_LOAD_FAIL",
    Mwait = 36 => "MWAIT",
    MonitorTrapFlag = 37 => "MONITOR_TRAP_FLAG",
    Monitor = 39 => "MONITOR",
    Pause = 40 => "PAUSE",
    /// VM-entry failure due to a machine-check event (with exit-reason bit 31 set).
    MachineCheckDuringEntry = 41 => "MCE_DURING_VMENTRY",
    TprBelowThreshold = 43 => "TPR_BELOW_THRESHOLD",
    ApicAccess = 44 => "APIC_ACCESS",
    VirtualizedEoi = 45 => "EOI_INDUCED",
    GdtrIdtrAccess = 46 => "GDTR_IDTR",
    LdtrTrAccess = 47 => "LDTR_TR",
    /// EPT violation; the qualification is decoded by `hvprof-ept`.
    EptViolation = 48 => "EPT_VIOLATION",
    EptMisconfig = 49 => "EPT_MISCONFIG",
    Invept = 50 => "INVEPT",
    Rdtscp = 51 => "RDTSCP",
    /// The VMX-preemption timer counted down to zero (SDM Vol. 3C §26.5.1).
    PreemptionTimer = 52 => "PREEMPTION_TIMER",
    Invvpid = 53 => "INVVPID",
    /// WBINVD or WBNOINVD.
    Wbinvd = 54 => "WBINVD",
    Xsetbv = 55 => "XSETBV",
    ApicWrite = 56 => "APIC_WRITE",
    Rdrand = 57 => "RDRAND",
    Invpcid = 58 => "INVPCID",
    Vmfunc = 59 => "VMFUNC",
    Encls = 60 => "ENCLS",
    Rdseed = 61 => "RDSEED",
    PmlFull = 62 => "PML_FULL",
    Xsaves = 63 => "XSAVES",
    Xrstors = 64 => "XRSTORS",
    Pconfig = 65 => "PCONFIG",
    SppEvent = 66 => "SPP_EVENT",
    Umwait = 67 => "UMWAIT",
    Tpause = 68 => "TPAUSE",
    Loadiwkey = 69 => "LOADIWKEY",
    Enclv = 70 => "ENCLV",
    SgxConflict = 71 => "SGX_CONFLICT",
    EnqcmdPasidFailure = 72 => "ENQCMD_PASID_FAIL",
    EnqcmdsPasidFailure = 73 => "ENQCMDS_PASID_FAIL",
    BusLock = 74 => "BUS_LOCK",
    /// Instruction timeout ("notify" VM exit).
    Notify = 75 => "NOTIFY",
    Seamcall = 76 => "SEAMCALL",
    Tdcall = 77 => "TDCALL",
}

impl BasicExit {
    /// One more than the largest basic exit reason in the table: the length of a per-reason
    /// counter array indexed by [`ExitReason::basic`] (reasons at or above it need a bounds
    /// check).
    pub const TABLE_LEN: usize = {
        let mut max = 0;
        let mut i = 0;
        while i < Self::ALL.len() {
            if Self::ALL[i] as usize > max {
                max = Self::ALL[i] as usize;
            }
            i += 1;
        }
        max + 1
    };

    pub const fn number(self) -> u16 {
        self as u16
    }
}

impl fmt::Display for BasicExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The exit-reason field (`ReadOnly32::ExitReason`), SDM Vol. 3C §25.9.1, Table 25-18: bits 15:0
/// the basic exit reason, bit 27 "exit from enclave mode", bit 31 "VM-entry failure" (§27.8).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ExitReason(pub u32);

impl ExitReason {
    pub const ENCLAVE_MODE: u32 = 1 << 27;
    pub const ENTRY_FAILURE: u32 = 1 << 31;

    /// Bits 15:0.
    pub const fn basic(self) -> u16 {
        (self.0 & 0xffff) as u16
    }
    /// Bit 31: VM entry failed during or after loading guest state (SDM Vol. 3C §27.8); see
    /// [`crate::errors::EntryFailure`].
    pub const fn entry_failure(self) -> bool {
        self.0 & Self::ENTRY_FAILURE != 0
    }
    /// Bit 27: the exit was incident to enclave mode.
    pub const fn enclave_mode(self) -> bool {
        self.0 & Self::ENCLAVE_MODE != 0
    }
    /// The basic reason as a table entry; `None` for numbers Table C-1 does not define.
    pub const fn kind(self) -> Option<BasicExit> {
        BasicExit::from_number(self.basic())
    }
    /// The table name of the basic reason, `"UNKNOWN"` for an undefined number.
    pub const fn name(self) -> &'static str {
        match self.kind() {
            Some(b) => b.name(),
            None => "UNKNOWN",
        }
    }
}

impl From<BasicExit> for ExitReason {
    fn from(b: BasicExit) -> Self {
        ExitReason(b as u32)
    }
}

impl fmt::Display for ExitReason {
    /// `HLT`, `INVALID_GUEST_STATE (VM-entry failure)`, `UNKNOWN(35)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind() {
            Some(b) => f.write_str(b.name())?,
            None => write!(f, "UNKNOWN({})", self.basic())?,
        }
        if self.entry_failure() {
            f.write_str(" (VM-entry failure)")?;
        }
        Ok(())
    }
}

/// How a control register was accessed (exit qualification bits 5:4, SDM Vol. 3C Table 28-3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CrAccessType {
    MovToCr = 0,
    MovFromCr = 1,
    Clts = 2,
    Lmsw = 3,
}

/// The exit qualification of a control-register access (basic reason 28), SDM Vol. 3C §28.2.1,
/// Table 28-3.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CrAccess {
    /// Bits 3:0: the control register (0 for CLTS and LMSW).
    pub cr: u8,
    /// Bits 5:4.
    pub access: CrAccessType,
    /// Bit 6: for LMSW, the source operand was memory (else a register).
    pub lmsw_memory_operand: bool,
    /// Bits 11:8: the general-purpose register of MOV CR (RSP lives in the VMCS, not in
    /// [`crate::regs::GuestRegisters`]).
    pub gpr: Gpr,
    /// Bits 31:16: the LMSW source data.
    pub lmsw_source: u16,
}

impl CrAccess {
    pub const fn decode(q: u64) -> Self {
        CrAccess {
            cr: (q & 0xf) as u8,
            access: match (q >> 4) & 3 {
                0 => CrAccessType::MovToCr,
                1 => CrAccessType::MovFromCr,
                2 => CrAccessType::Clts,
                _ => CrAccessType::Lmsw,
            },
            lmsw_memory_operand: q & (1 << 6) != 0,
            gpr: Gpr::from_number(((q >> 8) & 0xf) as u8),
            lmsw_source: ((q >> 16) & 0xffff) as u16,
        }
    }
}

/// Direction of an I/O instruction (exit qualification bit 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IoDirection {
    Out = 0,
    In = 1,
}

/// The exit qualification of an I/O instruction (basic reason 30), SDM Vol. 3C §28.2.1, Table
/// 28-5.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IoAccess {
    /// Size of the access in bytes: bits 2:0 plus one, so 1, 2 or 4 for the encodings the SDM
    /// defines (0, 1, 3); other encodings give 3 or 5-8, which hardware does not report.
    pub size: u8,
    /// Bit 3.
    pub direction: IoDirection,
    /// Bit 4: INS/OUTS.
    pub string: bool,
    /// Bit 5: REP prefix.
    pub rep: bool,
    /// Bit 6: the port came from an immediate operand (else from DX).
    pub immediate: bool,
    /// Bits 31:16.
    pub port: u16,
}

impl IoAccess {
    pub const fn decode(q: u64) -> Self {
        IoAccess {
            size: (q & 7) as u8 + 1,
            direction: if q & (1 << 3) != 0 {
                IoDirection::In
            } else {
                IoDirection::Out
            },
            string: q & (1 << 4) != 0,
            rep: q & (1 << 5) != 0,
            immediate: q & (1 << 6) != 0,
            port: ((q >> 16) & 0xffff) as u16,
        }
    }
}

/// Interruption type, bits 10:8 of the interruption-information format (SDM Vol. 3C Tables
/// 25-17, 25-19, 25-20).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InterruptionType {
    ExternalInterrupt = 0,
    /// 1: not used by VM exits; reserved for VM entry.
    Reserved = 1,
    Nmi = 2,
    HardwareException = 3,
    /// INT n (VM entry needs the instruction length).
    SoftwareInterrupt = 4,
    /// INT1 (VM entry needs the instruction length).
    PrivilegedSoftwareException = 5,
    /// INT3 or INTO (VM entry needs the instruction length).
    SoftwareException = 6,
    /// VM entry only: e.g. a pending MTF VM exit.
    OtherEvent = 7,
}

impl InterruptionType {
    pub const fn from_bits(b: u32) -> Self {
        match b & 7 {
            0 => InterruptionType::ExternalInterrupt,
            1 => InterruptionType::Reserved,
            2 => InterruptionType::Nmi,
            3 => InterruptionType::HardwareException,
            4 => InterruptionType::SoftwareInterrupt,
            5 => InterruptionType::PrivilegedSoftwareException,
            6 => InterruptionType::SoftwareException,
            _ => InterruptionType::OtherEvent,
        }
    }
}

/// The interruption-information format (SDM Vol. 3C §25.9.2 Table 25-19, §25.9.3 Table 25-20,
/// §25.8.3 Table 25-17): bits 7:0 vector, 10:8 type, 11 error code valid (for VM entry: deliver
/// an error code), 12 NMI unblocking due to IRET (VM-exit interruption information only; must be 0
/// for VM entry), 31 valid.
///
/// Read `ReadOnly32::ExitInterruptionInfo` / `IdtVectoringInfo` into it after an exit; build one
/// with [`InterruptionInfo::inject`] and write it to `Control32::EntryInterruptionInfo` to inject.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct InterruptionInfo(pub u32);

impl InterruptionInfo {
    pub const ERROR_CODE_VALID: u32 = 1 << 11;
    pub const NMI_UNBLOCKING: u32 = 1 << 12;
    pub const VALID: u32 = 1 << 31;

    /// A valid VM-entry interruption-information value (SDM Vol. 3C §25.8.3). When
    /// `deliver_error_code`, also write `Control32::EntryExceptionErrorCode`; for software
    /// interrupts and software/privileged exceptions write `Control32::EntryInstructionLength`.
    /// The VM-entry checks (SDM Vol. 3C §27.2.1.3) demand an error code exactly for hardware
    /// exceptions that push one ([`exception_has_error_code`]) while the guest is in protected
    /// mode (CR0.PE = 1), and never for real mode.
    pub const fn inject(vector: u8, kind: InterruptionType, deliver_error_code: bool) -> Self {
        let mut v = Self::VALID | (kind as u32) << 8 | vector as u32;
        if deliver_error_code {
            v |= Self::ERROR_CODE_VALID;
        }
        InterruptionInfo(v)
    }
    /// Injects an NMI (vector 2).
    pub const fn nmi() -> Self {
        Self::inject(2, InterruptionType::Nmi, false)
    }
    pub const fn external_interrupt(vector: u8) -> Self {
        Self::inject(vector, InterruptionType::ExternalInterrupt, false)
    }
    /// A hardware exception, with an error code when `protected_mode` and the vector pushes one.
    pub const fn hardware_exception(vector: u8, protected_mode: bool) -> Self {
        Self::inject(
            vector,
            InterruptionType::HardwareException,
            protected_mode && exception_has_error_code(vector),
        )
    }

    /// Bits 7:0.
    pub const fn vector(self) -> u8 {
        (self.0 & 0xff) as u8
    }
    /// Bits 10:8.
    pub const fn kind(self) -> InterruptionType {
        InterruptionType::from_bits(self.0 >> 8)
    }
    /// Bit 11: an error code was pushed (exit: read `ReadOnly32::ExitInterruptionErrorCode` or
    /// `IdtVectoringErrorCode`) or is to be delivered (entry).
    pub const fn error_code_valid(self) -> bool {
        self.0 & Self::ERROR_CODE_VALID != 0
    }
    /// Bit 12 (VM-exit interruption information): NMI unblocking due to IRET; the hypervisor
    /// must re-establish blocking by NMI before resuming (SDM Vol. 3C §28.2.3). Undefined in
    /// IDT-vectoring information.
    pub const fn nmi_unblocking(self) -> bool {
        self.0 & Self::NMI_UNBLOCKING != 0
    }
    /// Bit 31.
    pub const fn valid(self) -> bool {
        self.0 & Self::VALID != 0
    }
}

impl fmt::Debug for InterruptionInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.valid() {
            return write!(f, "InterruptionInfo(invalid, {:#x})", self.0);
        }
        write!(
            f,
            "InterruptionInfo({:?} vector {}{}{})",
            self.kind(),
            self.vector(),
            if self.error_code_valid() {
                ", error code"
            } else {
                ""
            },
            if self.nmi_unblocking() {
                ", NMI unblocking"
            } else {
                ""
            },
        )
    }
}

/// Exceptions that push an error code in protected mode: #DF (8), #TS (10), #NP (11), #SS (12),
/// #GP (13), #PF (14), #AC (17) (SDM Vol. 3C §27.2.1.3; #CP (21) also does on CPUs with CET,
/// which hvprof does not expose to guests).
pub const fn exception_has_error_code(vector: u8) -> bool {
    matches!(vector, 8 | 10..=14 | 17)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn table_is_sorted_unique_and_named() {
        for w in BasicExit::ALL.windows(2) {
            assert!(w[0] < w[1], "{:?} {:?}", w[0], w[1]);
        }
        for &b in BasicExit::ALL {
            assert_eq!(BasicExit::from_number(b as u16), Some(b));
            assert!(!b.name().is_empty());
            assert!(
                b.name()
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
            );
        }
        assert_eq!(BasicExit::TABLE_LEN, 78);
        for unused in [35, 38, 42] {
            assert_eq!(BasicExit::from_number(unused), None);
        }
    }

    #[test]
    fn names_from_table_c1() {
        let cases = [
            (0, "EXCEPTION_NMI"),
            (1, "EXTERNAL_INTERRUPT"),
            (2, "TRIPLE_FAULT"),
            (10, "CPUID"),
            (12, "HLT"),
            (18, "VMCALL"),
            (28, "CR_ACCESS"),
            (30, "IO_INSTRUCTION"),
            (31, "RDMSR"),
            (32, "WRMSR"),
            (48, "EPT_VIOLATION"),
            (49, "EPT_MISCONFIG"),
            (52, "PREEMPTION_TIMER"),
        ];
        for (n, name) in cases {
            assert_eq!(ExitReason(n).name(), name);
            assert_eq!(ExitReason(n).to_string(), name);
        }
        assert_eq!(ExitReason(12).kind(), Some(BasicExit::Hlt));
        assert_eq!(ExitReason(35).name(), "UNKNOWN");
        assert_eq!(ExitReason(35).to_string(), "UNKNOWN(35)");
        assert_eq!(ExitReason::from(BasicExit::Cpuid), ExitReason(10));
    }

    #[test]
    fn entry_failure_bit() {
        let r = ExitReason(0x8000_0021);
        assert!(r.entry_failure());
        assert_eq!(r.basic(), 33);
        assert_eq!(r.kind(), Some(BasicExit::InvalidGuestState));
        assert_eq!(r.to_string(), "INVALID_GUEST_STATE (VM-entry failure)");
        assert!(!ExitReason(33).entry_failure());
        let enclave = ExitReason((1 << 27) | 10);
        assert!(enclave.enclave_mode() && !enclave.entry_failure());
        assert_eq!(enclave.kind(), Some(BasicExit::Cpuid));
    }

    #[test]
    fn cr_access() {
        // mov cr3, rbx: CR 3, type 0, GPR 3.
        let q = CrAccess::decode(0x0303);
        assert_eq!(q.cr, 3);
        assert_eq!(q.access, CrAccessType::MovToCr);
        assert_eq!(q.gpr, Gpr::Rbx);
        // mov r12, cr0.
        let q = CrAccess::decode(0x0c10);
        assert_eq!(
            (q.cr, q.access, q.gpr),
            (0, CrAccessType::MovFromCr, Gpr::R12)
        );
        // mov cr4, rsp.
        assert_eq!(CrAccess::decode(0x0404).gpr, Gpr::Rsp);
        // clts.
        assert_eq!(CrAccess::decode(0x20).access, CrAccessType::Clts);
        // lmsw word [mem] with source 0x0011.
        let q = CrAccess::decode(0x0011_0070);
        assert_eq!(q.access, CrAccessType::Lmsw);
        assert!(q.lmsw_memory_operand);
        assert_eq!(q.lmsw_source, 0x11);
    }

    #[test]
    fn io_access() {
        // out dx, al to 0x3f8 (COM1).
        let q = IoAccess::decode(0x03f8_0000);
        assert_eq!(
            q,
            IoAccess {
                size: 1,
                direction: IoDirection::Out,
                string: false,
                rep: false,
                immediate: false,
                port: 0x3f8
            }
        );
        // in eax, 0x71 (immediate).
        let q = IoAccess::decode(0x0071_0000 | (1 << 6) | (1 << 3) | 3);
        assert_eq!(
            (q.size, q.direction, q.immediate, q.port),
            (4, IoDirection::In, true, 0x71)
        );
        // rep outsw to dx = 0x1f0.
        let q = IoAccess::decode(0x01f0_0000 | (1 << 5) | (1 << 4) | 1);
        assert_eq!((q.size, q.string, q.rep, q.port), (2, true, true, 0x1f0));
        // Bits 63:32 are ignored.
        assert_eq!(IoAccess::decode(u64::MAX << 32).port, 0);
    }

    #[test]
    fn interruption_info() {
        // NMI exit: vector 2, type NMI, valid.
        let i = InterruptionInfo(0x8000_0202);
        assert!(i.valid());
        assert_eq!(i.kind(), InterruptionType::Nmi);
        assert_eq!(i.vector(), 2);
        assert!(!i.error_code_valid());
        // #PF with error code and NMI unblocking.
        let i = InterruptionInfo(0x8000_1b0e);
        assert_eq!(
            (
                i.vector(),
                i.kind(),
                i.error_code_valid(),
                i.nmi_unblocking()
            ),
            (14, InterruptionType::HardwareException, true, true)
        );
        assert!(!InterruptionInfo(0x30e).valid());
        assert_eq!(InterruptionInfo::nmi(), InterruptionInfo(0x8000_0202));
        assert_eq!(InterruptionInfo::external_interrupt(0x20).0, 0x8000_0020);
        assert_eq!(
            InterruptionInfo::hardware_exception(13, true).0,
            0x8000_0b0d
        );
        assert_eq!(
            InterruptionInfo::hardware_exception(13, false).0,
            0x8000_030d
        );
        assert_eq!(InterruptionInfo::hardware_exception(6, true).0, 0x8000_0306);
        assert_eq!(
            InterruptionInfo::inject(3, InterruptionType::SoftwareException, false).0,
            0x8000_0603
        );
        assert_eq!(
            format!("{:?}", InterruptionInfo(0x8000_0b0d)),
            "InterruptionInfo(HardwareException vector 13, error code)"
        );
    }

    proptest! {
        #[test]
        fn decoders_never_panic(q in any::<u64>()) {
            let cr = CrAccess::decode(q);
            prop_assert!(cr.cr < 16);
            let io = IoAccess::decode(q);
            prop_assert!((1..=8).contains(&io.size));
            let info = InterruptionInfo((q & 0xffff_ffff) as u32);
            let _ = (info.vector(), info.kind(), format!("{info:?}"));
            let r = ExitReason((q >> 32) as u32);
            let _ = (r.name(), r.kind(), r.to_string());
            if let Some(k) = r.kind() {
                prop_assert_eq!(k.number(), r.basic());
            }
        }
    }
}
