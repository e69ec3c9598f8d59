//! VMCS fields, typed by width and access (Intel SDM Vol. 3D Appendix B "Field Encoding in VMCS",
//! and SDM Vol. 3C §25.11.2 "VMREAD, VMWRITE, and Encodings of VMCS Fields").
//!
//! One enum per (type, width) pair of Appendix B; each variant's discriminant is its encoding.
//! A field encoding is a 32-bit value (SDM Vol. 3D Appendix B, introduction; Vol. 3C Table 25-21):
//! bit 0 access type (0 full, 1 high 32 bits of a 64-bit field), bits 9:1 index, bits 11:10 type
//! (0 control, 1 VM-exit information, 2 guest state, 3 host state), bit 12 reserved (0), bits 14:13
//! width (0 16-bit, 1 64-bit, 2 32-bit, 3 natural width), bits 31:15 reserved (0). A `const`
//! assertion per enum checks that every variant sits in the enum its width and type bits name.
//!
//! The VM-exit information fields (type 1) are read-only: their enums (`ReadOnly*`) do not
//! implement [`Writable`], so the typed writers of [`VmcsExt`] reject them at compile time. (SDM
//! Vol. 3C §25.11.2: VMWRITE to them fails with error 13 unless IA32_VMX_MISC\[29\] is set; hvprof
//! never needs to write them.)
//!
//! 64-bit fields are named by their "full" encoding: in 64-bit mode VMREAD/VMWRITE of it access
//! all 64 bits. Natural-width fields are 64 bits on a 64-bit host.

use crate::errors::{InstructionError, VmFail};
use crate::exit::ExitReason;

/// Bits 14:13 of a field encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Width {
    Bits16 = 0,
    Bits64 = 1,
    Bits32 = 2,
    Natural = 3,
}

/// Bits 11:10 of a field encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FieldType {
    Control = 0,
    /// VM-exit information (and the VM-instruction error field): read-only.
    ReadOnly = 1,
    Guest = 2,
    Host = 3,
}

/// Bits 14:13 of `encoding`.
pub const fn width_of(encoding: u32) -> Width {
    match (encoding >> 13) & 3 {
        0 => Width::Bits16,
        1 => Width::Bits64,
        2 => Width::Bits32,
        _ => Width::Natural,
    }
}

/// Bits 11:10 of `encoding`.
pub const fn type_of(encoding: u32) -> FieldType {
    match (encoding >> 10) & 3 {
        0 => FieldType::Control,
        1 => FieldType::ReadOnly,
        2 => FieldType::Guest,
        _ => FieldType::Host,
    }
}

/// Bits 9:1 of `encoding`.
pub const fn index_of(encoding: u32) -> u16 {
    ((encoding >> 1) & 0x1ff) as u16
}

/// Whether `encoding` is a well-formed "full" encoding of the given width and type: reserved bits
/// 31:15 and 12 clear, access type (bit 0) full, bits 14:13 = `width`, bits 11:10 = `ty`.
pub const fn encoding_matches(encoding: u32, width: Width, ty: FieldType) -> bool {
    encoding & !0x6ffe == 0
        && (encoding >> 13) & 3 == width as u32
        && (encoding >> 10) & 3 == ty as u32
}

/// A VMCS field: a typed encoding.
pub trait VmcsField: Copy {
    const WIDTH: Width;
    const TYPE: FieldType;
    /// The encoding operand of VMREAD/VMWRITE.
    fn encoding(self) -> u32;
    /// The variant name, for dumps (e.g. `"Rip"` in `GuestNatural`).
    fn name(self) -> &'static str;
}

/// A 16-bit field.
pub trait Field16: VmcsField {}
/// A 32-bit field.
pub trait Field32: VmcsField {}
/// A 64-bit field (full access).
pub trait Field64: VmcsField {}
/// A natural-width field (64 bits on hvprof's host).
pub trait FieldNatural: VmcsField {}
/// A field VMWRITE may write: every type but VM-exit information.
pub trait Writable: VmcsField {}

macro_rules! vmcs_fields {
    (
        $(#[$meta:meta])*
        $name:ident: $marker:ident, $width:ident, $ty:ident $(, $writable:ident)? {
            $( $(#[$vm:meta])* $variant:ident = $enc:literal, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u32)]
        pub enum $name {
            $( $(#[$vm])* $variant = $enc, )*
        }

        impl $name {
            /// Every field of this enum, in encoding order.
            pub const ALL: &'static [$name] = &[$($name::$variant),*];

            pub const fn encoding(self) -> u32 {
                self as u32
            }

            pub const fn name(self) -> &'static str {
                match self {
                    $( $name::$variant => stringify!($variant), )*
                }
            }
        }

        impl VmcsField for $name {
            const WIDTH: Width = Width::$width;
            const TYPE: FieldType = FieldType::$ty;
            fn encoding(self) -> u32 {
                self as u32
            }
            fn name(self) -> &'static str {
                $name::name(self)
            }
        }

        impl $marker for $name {}
        $( impl $writable for $name {} )?

        // SDM Vol. 3D Appendix B: width and type bits of each encoding agree with its enum.
        const _: () = {
            let all = $name::ALL;
            let mut i = 0;
            while i < all.len() {
                assert!(
                    encoding_matches(all[i] as u32, Width::$width, FieldType::$ty),
                    concat!("a ", stringify!($name), " encoding has the wrong width or type bits"),
                );
                i += 1;
            }
        };
    };
}

vmcs_fields! {
    /// 16-bit control fields (SDM Vol. 3D §B.1.1).
    Control16: Field16, Bits16, Control, Writable {
        /// Virtual-processor identifier (VPID); 0 is the host's and not allowed with "enable VPID".
        Vpid = 0x0000,
        PostedInterruptNotificationVector = 0x0002,
        EptpIndex = 0x0004,
    }
}

vmcs_fields! {
    /// 16-bit guest-state fields (SDM Vol. 3D §B.1.2).
    Guest16: Field16, Bits16, Guest, Writable {
        EsSelector = 0x0800,
        CsSelector = 0x0802,
        SsSelector = 0x0804,
        DsSelector = 0x0806,
        FsSelector = 0x0808,
        GsSelector = 0x080a,
        LdtrSelector = 0x080c,
        TrSelector = 0x080e,
        InterruptStatus = 0x0810,
        PmlIndex = 0x0812,
    }
}

vmcs_fields! {
    /// 16-bit host-state fields (SDM Vol. 3D §B.1.3). There is no host LDTR.
    Host16: Field16, Bits16, Host, Writable {
        EsSelector = 0x0c00,
        CsSelector = 0x0c02,
        SsSelector = 0x0c04,
        DsSelector = 0x0c06,
        FsSelector = 0x0c08,
        GsSelector = 0x0c0a,
        TrSelector = 0x0c0c,
    }
}

vmcs_fields! {
    /// 64-bit control fields (SDM Vol. 3D §B.2.1). Addresses are physical.
    Control64: Field64, Bits64, Control, Writable {
        IoBitmapA = 0x2000,
        IoBitmapB = 0x2002,
        MsrBitmaps = 0x2004,
        ExitMsrStoreAddress = 0x2006,
        ExitMsrLoadAddress = 0x2008,
        EntryMsrLoadAddress = 0x200a,
        ExecutiveVmcsPointer = 0x200c,
        PmlAddress = 0x200e,
        TscOffset = 0x2010,
        VirtualApicAddress = 0x2012,
        ApicAccessAddress = 0x2014,
        PostedInterruptDescriptorAddress = 0x2016,
        VmFunctionControls = 0x2018,
        /// EPT pointer (EPTP), SDM Vol. 3C §25.6.11.
        EptPointer = 0x201a,
        EoiExitBitmap0 = 0x201c,
        EoiExitBitmap1 = 0x201e,
        EoiExitBitmap2 = 0x2020,
        EoiExitBitmap3 = 0x2022,
        EptpListAddress = 0x2024,
        VmreadBitmapAddress = 0x2026,
        VmwriteBitmapAddress = 0x2028,
        VirtualizationExceptionInfoAddress = 0x202a,
        XssExitingBitmap = 0x202c,
        EnclsExitingBitmap = 0x202e,
        SubPagePermissionTablePointer = 0x2030,
        TscMultiplier = 0x2032,
        TertiaryProcBasedControls = 0x2034,
        EnclvExitingBitmap = 0x2036,
    }
}

vmcs_fields! {
    /// 64-bit read-only data field (SDM Vol. 3D §B.2.2).
    ReadOnly64: Field64, Bits64, ReadOnly {
        /// Guest-physical address of an EPT violation or misconfiguration.
        GuestPhysicalAddress = 0x2400,
    }
}

vmcs_fields! {
    /// 64-bit guest-state fields (SDM Vol. 3D §B.2.3).
    Guest64: Field64, Bits64, Guest, Writable {
        /// Must be all ones when VMCS shadowing is off (SDM Vol. 3C §27.3.1.5).
        VmcsLinkPointer = 0x2800,
        Ia32Debugctl = 0x2802,
        Ia32Pat = 0x2804,
        Ia32Efer = 0x2806,
        Ia32PerfGlobalCtrl = 0x2808,
        /// PDPTEs, used for PAE paging under EPT (SDM Vol. 3C §27.3.2.4).
        Pdpte0 = 0x280a,
        Pdpte1 = 0x280c,
        Pdpte2 = 0x280e,
        Pdpte3 = 0x2810,
        Ia32Bndcfgs = 0x2812,
        Ia32RtitCtl = 0x2814,
        Ia32LbrCtl = 0x2816,
        Ia32Pkrs = 0x2818,
    }
}

vmcs_fields! {
    /// 64-bit host-state fields (SDM Vol. 3D §B.2.4).
    Host64: Field64, Bits64, Host, Writable {
        Ia32Pat = 0x2c00,
        Ia32Efer = 0x2c02,
        Ia32PerfGlobalCtrl = 0x2c04,
        Ia32Pkrs = 0x2c06,
    }
}

vmcs_fields! {
    /// 32-bit control fields (SDM Vol. 3D §B.3.1).
    Control32: Field32, Bits32, Control, Writable {
        /// SDM Vol. 3C §25.6.1; adjust through `caps::VmxCaps::pinbased`.
        PinBasedControls = 0x4000,
        /// SDM Vol. 3C §25.6.2.
        PrimaryProcBasedControls = 0x4002,
        ExceptionBitmap = 0x4004,
        PageFaultErrorCodeMask = 0x4006,
        PageFaultErrorCodeMatch = 0x4008,
        Cr3TargetCount = 0x400a,
        /// SDM Vol. 3C §25.7.1.
        ExitControls = 0x400c,
        ExitMsrStoreCount = 0x400e,
        ExitMsrLoadCount = 0x4010,
        /// SDM Vol. 3C §25.8.1.
        EntryControls = 0x4012,
        EntryMsrLoadCount = 0x4014,
        /// See `exit::InterruptionInfo` (SDM Vol. 3C §25.8.3).
        EntryInterruptionInfo = 0x4016,
        EntryExceptionErrorCode = 0x4018,
        EntryInstructionLength = 0x401a,
        TprThreshold = 0x401c,
        SecondaryProcBasedControls = 0x401e,
        PleGap = 0x4020,
        PleWindow = 0x4022,
    }
}

vmcs_fields! {
    /// 32-bit read-only data fields (SDM Vol. 3D §B.3.2).
    ReadOnly32: Field32, Bits32, ReadOnly {
        /// See `errors::InstructionError`.
        VmInstructionError = 0x4400,
        /// See `exit::ExitReason`.
        ExitReason = 0x4402,
        /// See `exit::InterruptionInfo`.
        ExitInterruptionInfo = 0x4404,
        ExitInterruptionErrorCode = 0x4406,
        /// See `exit::InterruptionInfo`.
        IdtVectoringInfo = 0x4408,
        IdtVectoringErrorCode = 0x440a,
        ExitInstructionLength = 0x440c,
        ExitInstructionInfo = 0x440e,
    }
}

vmcs_fields! {
    /// 32-bit guest-state fields (SDM Vol. 3D §B.3.3).
    Guest32: Field32, Bits32, Guest, Writable {
        EsLimit = 0x4800,
        CsLimit = 0x4802,
        SsLimit = 0x4804,
        DsLimit = 0x4806,
        FsLimit = 0x4808,
        GsLimit = 0x480a,
        LdtrLimit = 0x480c,
        TrLimit = 0x480e,
        GdtrLimit = 0x4810,
        IdtrLimit = 0x4812,
        /// Access rights: the format of SDM Vol. 3C §25.4.1 Table 25-2 (see [`access_rights`]).
        EsAccessRights = 0x4814,
        CsAccessRights = 0x4816,
        SsAccessRights = 0x4818,
        DsAccessRights = 0x481a,
        FsAccessRights = 0x481c,
        GsAccessRights = 0x481e,
        LdtrAccessRights = 0x4820,
        TrAccessRights = 0x4822,
        /// See [`Interruptibility`].
        InterruptibilityState = 0x4824,
        /// See [`ActivityState`].
        ActivityState = 0x4826,
        Smbase = 0x4828,
        Ia32SysenterCs = 0x482a,
        /// SDM Vol. 3C §26.5.1.
        PreemptionTimerValue = 0x482e,
    }
}

vmcs_fields! {
    /// 32-bit host-state field (SDM Vol. 3D §B.3.4).
    Host32: Field32, Bits32, Host, Writable {
        Ia32SysenterCs = 0x4c00,
    }
}

vmcs_fields! {
    /// Natural-width control fields (SDM Vol. 3D §B.4.1).
    ControlNatural: FieldNatural, Natural, Control, Writable {
        /// Bits set here are host-owned: guest writes that change them exit (SDM Vol. 3C §25.6.6).
        Cr0GuestHostMask = 0x6000,
        Cr4GuestHostMask = 0x6002,
        /// What the guest reads for the host-owned bits.
        Cr0ReadShadow = 0x6004,
        Cr4ReadShadow = 0x6006,
        Cr3Target0 = 0x6008,
        Cr3Target1 = 0x600a,
        Cr3Target2 = 0x600c,
        Cr3Target3 = 0x600e,
    }
}

vmcs_fields! {
    /// Natural-width read-only data fields (SDM Vol. 3D §B.4.2).
    ReadOnlyNatural: FieldNatural, Natural, ReadOnly {
        /// SDM Vol. 3C §28.2.1.
        ExitQualification = 0x6400,
        IoRcx = 0x6402,
        IoRsi = 0x6404,
        IoRdi = 0x6406,
        IoRip = 0x6408,
        GuestLinearAddress = 0x640a,
    }
}

vmcs_fields! {
    /// Natural-width guest-state fields (SDM Vol. 3D §B.4.3).
    GuestNatural: FieldNatural, Natural, Guest, Writable {
        Cr0 = 0x6800,
        Cr3 = 0x6802,
        Cr4 = 0x6804,
        EsBase = 0x6806,
        CsBase = 0x6808,
        SsBase = 0x680a,
        DsBase = 0x680c,
        FsBase = 0x680e,
        GsBase = 0x6810,
        LdtrBase = 0x6812,
        TrBase = 0x6814,
        GdtrBase = 0x6816,
        IdtrBase = 0x6818,
        Dr7 = 0x681a,
        Rsp = 0x681c,
        Rip = 0x681e,
        Rflags = 0x6820,
        PendingDebugExceptions = 0x6822,
        Ia32SysenterEsp = 0x6824,
        Ia32SysenterEip = 0x6826,
        Ia32SCet = 0x6828,
        Ssp = 0x682a,
        Ia32InterruptSspTableAddr = 0x682c,
    }
}

vmcs_fields! {
    /// Natural-width host-state fields (SDM Vol. 3D §B.4.4).
    HostNatural: FieldNatural, Natural, Host, Writable {
        Cr0 = 0x6c00,
        Cr3 = 0x6c02,
        Cr4 = 0x6c04,
        FsBase = 0x6c06,
        GsBase = 0x6c08,
        TrBase = 0x6c0a,
        GdtrBase = 0x6c0c,
        IdtrBase = 0x6c0e,
        Ia32SysenterEsp = 0x6c10,
        Ia32SysenterEip = 0x6c12,
        /// Where a VM exit resumes the host (SDM Vol. 3C §28.5.3).
        Rsp = 0x6c14,
        Rip = 0x6c16,
        Ia32SCet = 0x6c18,
        Ssp = 0x6c1a,
        Ia32InterruptSspTableAddr = 0x6c1c,
    }
}

/// The guest segment registers, with their four VMCS fields each (SDM Vol. 3C §25.4.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Segment {
    Es,
    Cs,
    Ss,
    Ds,
    Fs,
    Gs,
    Ldtr,
    Tr,
}

impl Segment {
    pub const ALL: [Segment; 8] = [
        Segment::Es,
        Segment::Cs,
        Segment::Ss,
        Segment::Ds,
        Segment::Fs,
        Segment::Gs,
        Segment::Ldtr,
        Segment::Tr,
    ];

    /// The segment register of a 3-bit encoding (0 ES, 1 CS, 2 SS, 3 DS, 4 FS, 5 GS), as the
    /// VM-exit instruction-information field gives it (SDM Vol. 3C §28.2.5, Tables 28-8 to
    /// 28-13); `None` for 6 and 7.
    pub const fn from_encoding(n: u32) -> Option<Segment> {
        Some(match n {
            0 => Segment::Es,
            1 => Segment::Cs,
            2 => Segment::Ss,
            3 => Segment::Ds,
            4 => Segment::Fs,
            5 => Segment::Gs,
            _ => return None,
        })
    }

    pub const fn selector(self) -> Guest16 {
        match self {
            Segment::Es => Guest16::EsSelector,
            Segment::Cs => Guest16::CsSelector,
            Segment::Ss => Guest16::SsSelector,
            Segment::Ds => Guest16::DsSelector,
            Segment::Fs => Guest16::FsSelector,
            Segment::Gs => Guest16::GsSelector,
            Segment::Ldtr => Guest16::LdtrSelector,
            Segment::Tr => Guest16::TrSelector,
        }
    }
    pub const fn base(self) -> GuestNatural {
        match self {
            Segment::Es => GuestNatural::EsBase,
            Segment::Cs => GuestNatural::CsBase,
            Segment::Ss => GuestNatural::SsBase,
            Segment::Ds => GuestNatural::DsBase,
            Segment::Fs => GuestNatural::FsBase,
            Segment::Gs => GuestNatural::GsBase,
            Segment::Ldtr => GuestNatural::LdtrBase,
            Segment::Tr => GuestNatural::TrBase,
        }
    }
    pub const fn limit(self) -> Guest32 {
        match self {
            Segment::Es => Guest32::EsLimit,
            Segment::Cs => Guest32::CsLimit,
            Segment::Ss => Guest32::SsLimit,
            Segment::Ds => Guest32::DsLimit,
            Segment::Fs => Guest32::FsLimit,
            Segment::Gs => Guest32::GsLimit,
            Segment::Ldtr => Guest32::LdtrLimit,
            Segment::Tr => Guest32::TrLimit,
        }
    }
    pub const fn access_rights(self) -> Guest32 {
        match self {
            Segment::Es => Guest32::EsAccessRights,
            Segment::Cs => Guest32::CsAccessRights,
            Segment::Ss => Guest32::SsAccessRights,
            Segment::Ds => Guest32::DsAccessRights,
            Segment::Fs => Guest32::FsAccessRights,
            Segment::Gs => Guest32::GsAccessRights,
            Segment::Ldtr => Guest32::LdtrAccessRights,
            Segment::Tr => Guest32::TrAccessRights,
        }
    }
}

/// Bits of the guest segment access-rights format (SDM Vol. 3C §25.4.1, Table 25-2): bits 3:0
/// segment type, 4 S (code/data), 6:5 DPL, 7 P, 12 AVL, 13 L (64-bit code), 14 D/B, 15 G, 16
/// segment unusable.
pub mod access_rights {
    pub const ACCESSED: u32 = 1 << 0;
    pub const TYPE_MASK: u32 = 0xf;
    pub const CODE_OR_DATA: u32 = 1 << 4;
    pub const DPL_SHIFT: u32 = 5;
    pub const PRESENT: u32 = 1 << 7;
    pub const AVL: u32 = 1 << 12;
    pub const LONG_MODE: u32 = 1 << 13;
    pub const DEFAULT_BIG: u32 = 1 << 14;
    pub const GRANULARITY: u32 = 1 << 15;
    pub const UNUSABLE: u32 = 1 << 16;
}

bitflags::bitflags! {
    /// The guest interruptibility state (SDM Vol. 3C §25.4.2, Table 25-3).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct Interruptibility: u32 {
        const BLOCKING_BY_STI = 1 << 0;
        const BLOCKING_BY_MOV_SS = 1 << 1;
        const BLOCKING_BY_SMI = 1 << 2;
        const BLOCKING_BY_NMI = 1 << 3;
        const ENCLAVE_INTERRUPTION = 1 << 4;
    }
}

/// The guest activity state (SDM Vol. 3C §25.4.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActivityState {
    Active = 0,
    Hlt = 1,
    Shutdown = 2,
    WaitForSipi = 3,
}

impl ActivityState {
    /// `None` for values the SDM does not define.
    pub const fn from_raw(v: u32) -> Option<Self> {
        match v {
            0 => Some(ActivityState::Active),
            1 => Some(ActivityState::Hlt),
            2 => Some(ActivityState::Shutdown),
            3 => Some(ActivityState::WaitForSipi),
            _ => None,
        }
    }
}

/// Raw access to the current VMCS: VMREAD and VMWRITE (SDM Vol. 3C §32.3). The hypervisor
/// implements it with [`crate::instructions`]; tests implement it with a map.
///
/// The raw methods take any encoding; use the typed methods of [`VmcsExt`] instead, which check
/// width and writability at compile time.
pub trait VmcsAccess {
    fn read(&self, encoding: u32) -> Result<u64, VmFail>;
    fn write(&mut self, encoding: u32, value: u64) -> Result<(), VmFail>;
}

/// Typed VMCS access, for every [`VmcsAccess`] (including `dyn VmcsAccess`).
///
/// A read-only field cannot be written:
///
/// ```compile_fail
/// use hvprof_vmx::vmcs::{ReadOnly32, VmcsAccess, VmcsExt};
/// fn f(v: &mut impl VmcsAccess) {
///     let _ = v.write32(ReadOnly32::ExitReason, 0);
/// }
/// ```
///
/// while a guest-state field can:
///
/// ```
/// use hvprof_vmx::vmcs::{Guest32, ReadOnly32, VmcsAccess, VmcsExt};
/// fn f(v: &mut impl VmcsAccess) {
///     let _ = v.write32(Guest32::ActivityState, 0);
///     let _ = v.read32(ReadOnly32::ExitReason);
/// }
/// ```
pub trait VmcsExt: VmcsAccess {
    fn read16(&self, field: impl Field16) -> Result<u16, VmFail> {
        self.read(field.encoding()).map(|v| (v & 0xffff) as u16)
    }
    fn read32(&self, field: impl Field32) -> Result<u32, VmFail> {
        self.read(field.encoding())
            .map(|v| (v & 0xffff_ffff) as u32)
    }
    fn read64(&self, field: impl Field64) -> Result<u64, VmFail> {
        self.read(field.encoding())
    }
    fn read_natural(&self, field: impl FieldNatural) -> Result<u64, VmFail> {
        self.read(field.encoding())
    }
    fn write16(&mut self, field: impl Field16 + Writable, value: u16) -> Result<(), VmFail> {
        self.write(field.encoding(), value.into())
    }
    fn write32(&mut self, field: impl Field32 + Writable, value: u32) -> Result<(), VmFail> {
        self.write(field.encoding(), value.into())
    }
    fn write64(&mut self, field: impl Field64 + Writable, value: u64) -> Result<(), VmFail> {
        self.write(field.encoding(), value)
    }
    fn write_natural(
        &mut self,
        field: impl FieldNatural + Writable,
        value: u64,
    ) -> Result<(), VmFail> {
        self.write(field.encoding(), value)
    }

    /// `ReadOnly32::ExitReason`, decoded.
    fn exit_reason(&self) -> Result<ExitReason, VmFail> {
        self.read32(ReadOnly32::ExitReason).map(ExitReason)
    }
    /// `ReadOnlyNatural::ExitQualification`.
    fn exit_qualification(&self) -> Result<u64, VmFail> {
        self.read_natural(ReadOnlyNatural::ExitQualification)
    }
    /// `ReadOnly32::VmInstructionError`, decoded: the reason of the last VMfailValid.
    fn instruction_error(&self) -> Result<InstructionError, VmFail> {
        self.read32(ReadOnly32::VmInstructionError)
            .map(InstructionError::from_number)
    }
}

impl<T: VmcsAccess + ?Sized> VmcsExt for T {}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of every enum as (encoding, width, type, writable).
    fn all_fields() -> Vec<(u32, Width, FieldType, bool, &'static str)> {
        fn add<F: VmcsField>(
            out: &mut Vec<(u32, Width, FieldType, bool, &'static str)>,
            all: &[F],
            writable: bool,
        ) {
            for &f in all {
                out.push((f.encoding(), F::WIDTH, F::TYPE, writable, f.name()));
            }
        }
        let mut v = Vec::new();
        add(&mut v, Control16::ALL, true);
        add(&mut v, Guest16::ALL, true);
        add(&mut v, Host16::ALL, true);
        add(&mut v, Control64::ALL, true);
        add(&mut v, ReadOnly64::ALL, false);
        add(&mut v, Guest64::ALL, true);
        add(&mut v, Host64::ALL, true);
        add(&mut v, Control32::ALL, true);
        add(&mut v, ReadOnly32::ALL, false);
        add(&mut v, Guest32::ALL, true);
        add(&mut v, Host32::ALL, true);
        add(&mut v, ControlNatural::ALL, true);
        add(&mut v, ReadOnlyNatural::ALL, false);
        add(&mut v, GuestNatural::ALL, true);
        add(&mut v, HostNatural::ALL, true);
        v
    }

    #[test]
    fn hand_checked_encodings() {
        assert_eq!(GuestNatural::Rip.encoding(), 0x681e);
        assert_eq!(ReadOnly32::ExitReason.encoding(), 0x4402);
        assert_eq!(Control64::EptPointer.encoding(), 0x201a);
        assert_eq!(Control16::Vpid.encoding(), 0x0000);
        assert_eq!(Control32::PinBasedControls.encoding(), 0x4000);
        assert_eq!(Guest32::PreemptionTimerValue.encoding(), 0x482e);
        assert_eq!(Control32::PrimaryProcBasedControls.encoding(), 0x4002);
        assert_eq!(Control32::SecondaryProcBasedControls.encoding(), 0x401e);
        assert_eq!(Guest64::VmcsLinkPointer.encoding(), 0x2800);
        assert_eq!(Guest64::Ia32Efer.encoding(), 0x2806);
        assert_eq!(HostNatural::Rip.encoding(), 0x6c16);
        assert_eq!(HostNatural::Rsp.encoding(), 0x6c14);
        assert_eq!(Host16::TrSelector.encoding(), 0x0c0c);
        assert_eq!(Host32::Ia32SysenterCs.encoding(), 0x4c00);
        assert_eq!(ReadOnlyNatural::ExitQualification.encoding(), 0x6400);
        assert_eq!(ReadOnly64::GuestPhysicalAddress.encoding(), 0x2400);
        assert_eq!(ReadOnly32::VmInstructionError.encoding(), 0x4400);
        assert_eq!(Guest32::TrAccessRights.encoding(), 0x4822);
        assert_eq!(GuestNatural::Rflags.encoding(), 0x6820);
    }

    #[test]
    fn width_and_type_bits_match_every_enum() {
        let fields = all_fields();
        assert!(fields.len() > 150, "{}", fields.len());
        for &(enc, w, t, writable, name) in &fields {
            assert!(encoding_matches(enc, w, t), "{name} {enc:#x}");
            assert_eq!(width_of(enc), w, "{name}");
            assert_eq!(type_of(enc), t, "{name}");
            assert_eq!(enc & 1, 0, "{name}: full access");
            assert_eq!(writable, t != FieldType::ReadOnly, "{name}");
        }
        // Unique encodings, and within an enum, sorted by index.
        let mut encs: Vec<u32> = fields.iter().map(|f| f.0).collect();
        let n = encs.len();
        encs.sort_unstable();
        encs.dedup();
        assert_eq!(encs.len(), n, "duplicate encodings");
        for w in fields.windows(2) {
            if (w[0].1, w[0].2) == (w[1].1, w[1].2) {
                assert!(index_of(w[0].0) < index_of(w[1].0), "{} {}", w[0].4, w[1].4);
            }
        }
    }

    #[test]
    fn encoding_checks_reject_malformed_values() {
        assert!(encoding_matches(0x681e, Width::Natural, FieldType::Guest));
        assert!(!encoding_matches(0x681e, Width::Natural, FieldType::Host));
        assert!(!encoding_matches(0x681e, Width::Bits64, FieldType::Guest));
        assert!(!encoding_matches(0x2001, Width::Bits64, FieldType::Control)); // high access
        assert!(!encoding_matches(
            0x1_681e,
            Width::Natural,
            FieldType::Guest
        )); // bit 16
        assert!(!encoding_matches(0x781e, Width::Natural, FieldType::Guest)); // bit 12
        assert_eq!(index_of(0x681e), 0xf);
    }

    #[test]
    fn segments() {
        for s in Segment::ALL {
            let bits = [
                s.selector().encoding(),
                s.base().encoding(),
                s.limit().encoding(),
                s.access_rights().encoding(),
            ];
            let i = s as u16;
            assert_eq!(index_of(bits[0]), i);
            assert_eq!(index_of(bits[1]), 3 + i);
            assert_eq!(index_of(bits[2]), i);
            assert_eq!(index_of(bits[3]), 10 + i);
        }
    }

    use crate::fake::FakeVmcs;

    #[test]
    fn typed_access_through_a_fake_vmcs() {
        let mut v = FakeVmcs::new();
        v.write16(Control16::Vpid, 1).unwrap();
        v.write16(Guest16::CsSelector, 0xf000).unwrap();
        v.write32(Control32::PinBasedControls, 0x16).unwrap();
        v.write64(Control64::EptPointer, 0x1234_501e).unwrap();
        v.write64(Guest64::VmcsLinkPointer, u64::MAX).unwrap();
        v.write_natural(GuestNatural::Rip, 0xfff0).unwrap();
        v.write_natural(HostNatural::Rip, 0xffff_8000_0000_1000)
            .unwrap();
        assert_eq!(v.read16(Control16::Vpid), Ok(1));
        assert_eq!(v.read16(Guest16::CsSelector), Ok(0xf000));
        assert_eq!(v.read32(Control32::PinBasedControls), Ok(0x16));
        assert_eq!(v.read64(Control64::EptPointer), Ok(0x1234_501e));
        assert_eq!(v.read64(Guest64::VmcsLinkPointer), Ok(u64::MAX));
        assert_eq!(v.read_natural(GuestNatural::Rip), Ok(0xfff0));
        assert_eq!(v.0[&0x681e], 0xfff0);
        assert_eq!(v.0[&0x6c16], 0xffff_8000_0000_1000);

        // Read-only fields: the typed API only reads them; the raw API gets the CPU's error.
        v.0.insert(0x4402, 0x8000_0021);
        v.0.insert(0x6400, 4);
        v.0.insert(0x4400, 7);
        assert_eq!(v.exit_reason().map(|r| r.basic()), Ok(33));
        assert_eq!(v.exit_qualification(), Ok(4));
        assert_eq!(
            v.instruction_error(),
            Ok(InstructionError::InvalidControlFields)
        );
        assert_eq!(v.read64(ReadOnly64::GuestPhysicalAddress), Ok(0));
        assert_eq!(
            v.write(ReadOnly32::ExitReason.encoding(), 0),
            Err(VmFail::Valid(InstructionError::WriteReadOnlyComponent))
        );
        assert_eq!(
            v.read(0x2001),
            Err(VmFail::Valid(InstructionError::UnsupportedComponent))
        );

        // Through a trait object too.
        let d: &mut dyn VmcsAccess = &mut v;
        d.write32(Guest32::ActivityState, ActivityState::Hlt as u32)
            .unwrap();
        assert_eq!(
            d.read32(Guest32::ActivityState)
                .map(ActivityState::from_raw),
            Ok(Some(ActivityState::Hlt))
        );
    }

    #[test]
    fn narrow_reads_truncate() {
        let mut v = FakeVmcs::new();
        v.0.insert(Guest16::EsSelector.encoding(), 0x1_0008);
        v.0.insert(Guest32::EsLimit.encoding(), 0x1_ffff_ffff);
        assert_eq!(v.read16(Guest16::EsSelector), Ok(8));
        assert_eq!(v.read32(Guest32::EsLimit), Ok(0xffff_ffff));
    }

    #[test]
    fn interruptibility() {
        let i = Interruptibility::from_bits_truncate(0b1010);
        assert!(
            i.contains(Interruptibility::BLOCKING_BY_MOV_SS | Interruptibility::BLOCKING_BY_NMI)
        );
        assert!(!i.contains(Interruptibility::BLOCKING_BY_STI));
        assert_eq!(ActivityState::from_raw(4), None);
    }
}
