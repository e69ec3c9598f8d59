//! The VMCS of a new vCPU, written field by field (Intel SDM Vol. 3C chapter 25, "Virtual-Machine
//! Control Structures", with the values §27.2-27.3 — the checks VM entry makes — accept): small
//! writers over any [`VmcsAccess`], so that the bare-metal binary runs them on the current VMCS
//! and the host tests run them on `hvprof_vmx::fake::FakeVmcs`. Everything read from hardware
//! (capability MSRs, control registers, selectors) is passed in.

use alloc::format;
use alloc::string::String;

use hvprof_vmx::caps::{AllowedBits, VmxCaps, entry as entry_ctl, exit, pin, proc1, proc2};
use hvprof_vmx::errors::VmFail;
use hvprof_vmx::vmcs::{
    Control16, Control32, Control64, ControlNatural, Guest16, Guest32, Guest64, GuestNatural,
    Host16, Host32, Host64, HostNatural, VmcsAccess, VmcsExt,
};

use crate::guest_image::{self, BootState, StartMode};

/// The guest's IA32_PAT at reset (SDM Vol. 3A §13.12.4: WB, WT, UC-, UC, twice).
pub const PAT_DEFAULT: u64 = 0x0007_0406_0007_0406;

#[derive(Debug)]
pub enum SetupError {
    NoMemory,
    Control { which: &'static str, missing: u32 },
    Vmclear(VmFail),
    Vmptrld(VmFail),
    Vmwrite(String),
}

impl core::fmt::Display for SetupError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            SetupError::NoMemory => f.write_str("no memory for the VMCS"),
            SetupError::Control { which, missing } => {
                write!(f, "the CPU does not allow the {which} control(s)")?;
                for bit in 0..32 {
                    if missing & (1 << bit) != 0 {
                        write!(f, " '{}'", control_name(which, 1 << bit))?;
                    }
                }
                f.write_str(" that hvprof needs")
            }
            SetupError::Vmclear(e) => write!(f, "VMCLEAR failed: {e}"),
            SetupError::Vmptrld(e) => write!(f, "VMPTRLD failed: {e}"),
            SetupError::Vmwrite(e) => write!(f, "VMWRITE failed: {e}"),
        }
    }
}

/// The SDM's name of a control bit hvprof asks for (Vol. 3C Tables 25-5, 25-6, 25-7, 25-13, 25-15).
fn control_name(which: &str, bit: u32) -> &'static str {
    match (which, bit) {
        ("pin-based", pin::EXTERNAL_INTERRUPT_EXITING) => "external-interrupt exiting",
        ("pin-based", pin::NMI_EXITING) => "NMI exiting",
        ("pin-based", pin::PREEMPTION_TIMER) => "activate VMX-preemption timer",
        ("primary processor-based", proc1::HLT_EXITING) => "HLT exiting",
        ("primary processor-based", proc1::USE_IO_BITMAPS) => "use I/O bitmaps",
        ("primary processor-based", proc1::USE_MSR_BITMAPS) => "use MSR bitmaps",
        ("primary processor-based", proc1::ACTIVATE_SECONDARY) => "activate secondary controls",
        ("secondary processor-based", proc2::ENABLE_EPT) => "enable EPT",
        ("secondary processor-based", proc2::ENABLE_VPID) => "enable VPID",
        ("secondary processor-based", proc2::UNRESTRICTED_GUEST) => "unrestricted guest",
        ("VM-exit", exit::HOST_ADDRESS_SPACE_SIZE) => "host address-space size",
        ("VM-exit", exit::ACK_INTERRUPT_ON_EXIT) => "acknowledge interrupt on exit",
        ("VM-exit", exit::SAVE_IA32_PAT) => "save IA32_PAT",
        ("VM-exit", exit::LOAD_IA32_PAT) => "load IA32_PAT",
        ("VM-exit", exit::SAVE_IA32_EFER) => "save IA32_EFER",
        ("VM-exit", exit::LOAD_IA32_EFER) => "load IA32_EFER",
        ("VM-exit", exit::SAVE_PREEMPTION_TIMER) => "save VMX-preemption timer value",
        ("VM-entry", entry_ctl::IA32E_MODE_GUEST) => "IA-32e mode guest",
        ("VM-entry", entry_ctl::LOAD_IA32_PAT) => "load IA32_PAT",
        ("VM-entry", entry_ctl::LOAD_IA32_EFER) => "load IA32_EFER",
        _ => "(unnamed bit)",
    }
}

fn adjust(
    bits: AllowedBits,
    wanted: u32,
    optional: u32,
    which: &'static str,
) -> Result<u32, SetupError> {
    let optional = optional & bits.may_be_one();
    bits.adjust(wanted | optional)
        .map_err(|missing| SetupError::Control { which, missing })
}

fn w<E: core::fmt::Debug>(r: Result<(), VmFail>, what: E) -> Result<(), SetupError> {
    r.map_err(|e| SetupError::Vmwrite(format!("{what:?}: {e}")))
}

/// The VM-execution, VM-exit and VM-entry controls of a vCPU (§25.6-25.8), each adjusted
/// through the (TRUE) capability MSRs (Appendix A.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Controls {
    pub pin: u32,
    pub proc1: u32,
    pub proc2: u32,
    pub exit: u32,
    pub entry: u32,
}

impl Controls {
    /// The controls for a vCPU that starts outside IA-32e mode (`legacy`: real mode, or 32-bit
    /// protected mode without paging) or in 64-bit mode.
    ///
    /// # Errors
    /// `SetupError::Control` naming the controls the CPU does not allow (for a legacy start,
    /// unrestricted guest is required: SDM Vol. 3C §26.6).
    pub fn new(caps: &VmxCaps, legacy: bool) -> Result<Controls, SetupError> {
        let pin = adjust(
            caps.pinbased(),
            pin::EXTERNAL_INTERRUPT_EXITING | pin::NMI_EXITING | pin::PREEMPTION_TIMER,
            pin::VIRTUAL_NMIS,
            "pin-based",
        )?;
        let proc1 = adjust(
            caps.procbased(),
            // Everything a guest could otherwise do to the physical CPU for the others: the TPR
            // (CR8), the performance counters (RDPMC), MONITOR/MWAIT (a deep C-state stops the
            // VMX-preemption timer on hardware).
            proc1::HLT_EXITING
                | proc1::MWAIT_EXITING
                | proc1::MONITOR_EXITING
                | proc1::RDPMC_EXITING
                | proc1::CR8_LOAD_EXITING
                | proc1::CR8_STORE_EXITING
                | proc1::USE_IO_BITMAPS
                | proc1::USE_MSR_BITMAPS
                | proc1::ACTIVATE_SECONDARY,
            // A guest's writes of IA32_TSC and IA32_TSC_ADJUST (`guest_tsc`); without it they
            // are #GP.
            proc1::USE_TSC_OFFSETTING,
            "primary processor-based",
        )?;
        let proc2 = adjust(
            caps.procbased2(),
            proc2::ENABLE_EPT | proc2::ENABLE_VPID,
            // "Enable RDTSCP": RDTSCP and RDPID read IA32_TSC_AUX, which each vCPU has its own
            // of (switched with its state); without the control they are #UD in the guest (SDM
            // Vol. 3C §26.3), and CPUID does not offer them.
            proc2::ENABLE_RDTSCP
                | proc2::ENABLE_INVPCID
                | proc2::ENABLE_XSAVES
                | proc2::WBINVD_EXITING
                | proc2::UNRESTRICTED_GUEST,
            "secondary processor-based",
        )?;
        let exit = adjust(
            caps.exit(),
            // DR7 and IA32_DEBUGCTL per vCPU (DR0-3 and DR6 are switched with the FPU state).
            exit::SAVE_DEBUG_CONTROLS
                | exit::HOST_ADDRESS_SPACE_SIZE
                | exit::ACK_INTERRUPT_ON_EXIT
                | exit::SAVE_IA32_PAT
                | exit::LOAD_IA32_PAT
                | exit::SAVE_IA32_EFER
                | exit::LOAD_IA32_EFER
                | exit::SAVE_PREEMPTION_TIMER,
            0,
            "VM-exit",
        )?;
        if legacy && proc2 & proc2::UNRESTRICTED_GUEST == 0 {
            return Err(SetupError::Control {
                which: "secondary processor-based",
                missing: proc2::UNRESTRICTED_GUEST,
            });
        }
        let long_mode = if legacy {
            0
        } else {
            entry_ctl::IA32E_MODE_GUEST
        };
        let entry = adjust(
            caps.entry(),
            long_mode
                | entry_ctl::LOAD_DEBUG_CONTROLS
                | entry_ctl::LOAD_IA32_PAT
                | entry_ctl::LOAD_IA32_EFER,
            0,
            "VM-entry",
        )?;
        Ok(Controls {
            pin,
            proc1,
            proc2,
            exit,
            entry,
        })
    }

    /// "Unrestricted guest" is on: the guest may run with CR0.PE or CR0.PG clear.
    #[must_use]
    pub fn unrestricted(&self) -> bool {
        self.proc2 & proc2::UNRESTRICTED_GUEST != 0
    }
}

/// The physical addresses and identifiers the controls point to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControlTargets {
    pub io_bitmap_a: u64,
    pub io_bitmap_b: u64,
    pub msr_bitmap: u64,
    pub eptp: u64,
    pub vpid: u16,
}

/// Writes the controls and what they point to (§25.6-25.8): no exception exits, no CR3 targets,
/// no MSR load/store lists, nothing to inject, no TSC offset.
///
/// # Errors
/// The first VMWRITE that failed.
pub fn write_controls(
    v: &mut impl VmcsAccess,
    c: &Controls,
    t: &ControlTargets,
) -> Result<(), SetupError> {
    w(
        v.write32(Control32::PinBasedControls, c.pin),
        "pin controls",
    )?;
    w(
        v.write32(Control32::PrimaryProcBasedControls, c.proc1),
        "primary controls",
    )?;
    w(
        v.write32(Control32::SecondaryProcBasedControls, c.proc2),
        "secondary controls",
    )?;
    w(v.write32(Control32::ExitControls, c.exit), "exit controls")?;
    w(
        v.write32(Control32::EntryControls, c.entry),
        "entry controls",
    )?;
    for f in [
        Control32::ExceptionBitmap,
        Control32::PageFaultErrorCodeMask,
        Control32::PageFaultErrorCodeMatch,
        Control32::Cr3TargetCount,
        Control32::ExitMsrStoreCount,
        Control32::ExitMsrLoadCount,
        Control32::EntryMsrLoadCount,
        Control32::EntryInterruptionInfo,
    ] {
        w(v.write32(f, 0), f)?;
    }
    w(
        v.write64(Control64::IoBitmapA, t.io_bitmap_a),
        "I/O bitmap A",
    )?;
    w(
        v.write64(Control64::IoBitmapB, t.io_bitmap_b),
        "I/O bitmap B",
    )?;
    w(v.write64(Control64::MsrBitmaps, t.msr_bitmap), "MSR bitmap")?;
    w(v.write64(Control64::EptPointer, t.eptp), "EPTP")?;
    w(v.write16(Control16::Vpid, t.vpid), "VPID")?;
    w(v.write64(Control64::TscOffset, 0), "TSC offset")
}

/// The CR0 and CR4 bits VMX fixes (Appendix A.7-A.8), as (must be 1, may be 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FixedCrs {
    pub cr0: (u64, u64),
    pub cr4: (u64, u64),
}

/// CR0.PE and CR0.PG (SDM Vol. 3A §2.5).
const CR0_PE_PG: u64 = 1 | 1 << 31;

impl FixedCrs {
    /// From the IA32_VMX_CR0_FIXED0/1 and IA32_VMX_CR4_FIXED0/1 MSRs; with unrestricted guest,
    /// CR0.PE and CR0.PG may be 0 (Appendix A.7): the guest owns them.
    #[must_use]
    pub fn new(cr0_fixed: (u64, u64), cr4_fixed: (u64, u64), unrestricted: bool) -> Self {
        let mut cr0 = cr0_fixed;
        if unrestricted {
            cr0.0 &= !CR0_PE_PG;
        }
        FixedCrs {
            cr0,
            cr4: cr4_fixed,
        }
    }

    /// The CR0 value the CPU runs the guest with for a guest-visible `cr0`.
    #[must_use]
    pub fn force_cr0(&self, cr0: u64) -> u64 {
        (cr0 | self.cr0.0) & self.cr0.1
    }

    /// The same for CR4.
    #[must_use]
    pub fn force_cr4(&self, cr4: u64) -> u64 {
        (cr4 | self.cr4.0) & self.cr4.1
    }
}

/// Writes the guest's control registers and their masks and shadows (§25.6.6): the bits VMX
/// fixes are owned by the host (set in the mask) and read by the guest from the shadow as it
/// wrote them. Real mode: ET | NE, no paging; 64-bit mode: PE | MP | ET | NE | WP | PG and
/// PAE | OSFXSR | OSXMMEXCPT.
///
/// # Errors
/// The first VMWRITE that failed.
pub fn write_control_registers(
    v: &mut impl VmcsAccess,
    fixed: &FixedCrs,
    mode: StartMode,
    cr3: u64,
) -> Result<(), SetupError> {
    // Real mode: ET | NE; protected mode adds PE; 64-bit mode PG | WP | MP too, with PAE,
    // OSFXSR and OSXMMEXCPT in CR4.
    let (guest_cr0, guest_cr4) = match mode {
        StartMode::Real16 => (0x30u64, 0u64),
        StartMode::Protected32 => (0x31, 0),
        StartMode::Long64 => (0x8001_0033, 0x0620),
    };
    w(
        v.write_natural(ControlNatural::Cr0GuestHostMask, fixed.cr0.0 | !fixed.cr0.1),
        "CR0 mask",
    )?;
    w(
        v.write_natural(ControlNatural::Cr0ReadShadow, guest_cr0),
        "CR0 shadow",
    )?;
    w(
        v.write_natural(ControlNatural::Cr4GuestHostMask, fixed.cr4.0 | !fixed.cr4.1),
        "CR4 mask",
    )?;
    w(
        v.write_natural(ControlNatural::Cr4ReadShadow, guest_cr4),
        "CR4 shadow",
    )?;
    w(
        v.write_natural(GuestNatural::Cr0, fixed.force_cr0(guest_cr0)),
        "guest CR0",
    )?;
    w(
        v.write_natural(GuestNatural::Cr4, fixed.force_cr4(guest_cr4)),
        "guest CR4",
    )?;
    w(v.write_natural(GuestNatural::Cr3, cr3), "guest CR3")
}

/// The host state every VM exit loads that is the same on every pCPU (§25.5, checked by
/// §27.2.2-27.2.4); the per-pCPU part (TR, GDTR, IDTR, GS base) is written where the vCPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostState {
    pub cr0: u64,
    pub cr3: u64,
    pub cr4: u64,
    pub code_selector: u16,
    pub data_selector: u16,
    pub pat: u64,
    pub efer: u64,
    /// Where a VM exit lands.
    pub rip: u64,
}

/// Writes [`HostState`]: FS 0 with base 0, no SYSENTER.
///
/// # Errors
/// The first VMWRITE that failed.
pub fn write_host_state(v: &mut impl VmcsAccess, h: &HostState) -> Result<(), SetupError> {
    w(v.write_natural(HostNatural::Cr0, h.cr0), "host CR0")?;
    w(v.write_natural(HostNatural::Cr3, h.cr3), "host CR3")?;
    w(v.write_natural(HostNatural::Cr4, h.cr4), "host CR4")?;
    w(v.write16(Host16::CsSelector, h.code_selector), "host CS")?;
    for f in [Host16::SsSelector, Host16::DsSelector, Host16::EsSelector] {
        w(v.write16(f, h.data_selector), f)?;
    }
    w(v.write16(Host16::FsSelector, 0), "host FS")?;
    w(v.write_natural(HostNatural::FsBase, 0), "host FS base")?;
    w(v.write32(Host32::Ia32SysenterCs, 0), "host SYSENTER_CS")?;
    w(
        v.write_natural(HostNatural::Ia32SysenterEsp, 0),
        "host SYSENTER_ESP",
    )?;
    w(
        v.write_natural(HostNatural::Ia32SysenterEip, 0),
        "host SYSENTER_EIP",
    )?;
    w(v.write64(Host64::Ia32Pat, h.pat), "host PAT")?;
    w(v.write64(Host64::Ia32Efer, h.efer), "host EFER")?;
    w(v.write_natural(HostNatural::Rip, h.rip), "host RIP")
}

/// Writes the guest state a vCPU starts in (§25.4, checked by §27.3.1): 64-bit mode as
/// docs/GUEST-ABI.md describes (EFER LME | LMA, and NXE when `nx`: CPUID.80000001H:EDX.NX), or
/// real mode (selectors 0, bases 0, 64 KiB limits, the interrupt vector table at 0) for a flat
/// image; LDTR unusable, TR a busy TSS, DR7 0x400, RFLAGS 0x2, active, no VMCS shadowing, the
/// VMX-preemption timer at its largest value.
///
/// # Errors
/// The first VMWRITE that failed.
pub fn write_guest_state(
    v: &mut impl VmcsAccess,
    boot: &BootState,
    nx: bool,
) -> Result<(), SetupError> {
    let real = boot.mode == StartMode::Real16;
    let (code_sel, data_sel, limit, code_ar, data_ar) = match boot.mode {
        StartMode::Real16 => (0, 0, 0xffff, 0x9b, 0x93),
        // 32-bit code (D/B 1, L 0) and data, 4 GiB (G 1), as the GDT at `gdt_base` says.
        StartMode::Protected32 => (
            boot.code_selector,
            boot.data_selector,
            0xffff_ffff,
            0xc09b,
            guest_image::DATA_ACCESS_RIGHTS,
        ),
        StartMode::Long64 => (
            boot.code_selector,
            boot.data_selector,
            0xffff_ffff,
            guest_image::CODE_ACCESS_RIGHTS,
            guest_image::DATA_ACCESS_RIGHTS,
        ),
    };
    let segments = [
        (
            Guest16::EsSelector,
            Guest32::EsLimit,
            Guest32::EsAccessRights,
            GuestNatural::EsBase,
        ),
        (
            Guest16::SsSelector,
            Guest32::SsLimit,
            Guest32::SsAccessRights,
            GuestNatural::SsBase,
        ),
        (
            Guest16::DsSelector,
            Guest32::DsLimit,
            Guest32::DsAccessRights,
            GuestNatural::DsBase,
        ),
        (
            Guest16::FsSelector,
            Guest32::FsLimit,
            Guest32::FsAccessRights,
            GuestNatural::FsBase,
        ),
        (
            Guest16::GsSelector,
            Guest32::GsLimit,
            Guest32::GsAccessRights,
            GuestNatural::GsBase,
        ),
    ];
    for (s, l, a, b) in segments {
        w(v.write16(s, data_sel), s)?;
        w(v.write32(l, limit), l)?;
        w(v.write32(a, data_ar), a)?;
        w(v.write_natural(b, 0), b)?;
    }
    w(v.write16(Guest16::CsSelector, code_sel), "guest CS")?;
    w(v.write32(Guest32::CsLimit, limit), "guest CS limit")?;
    w(v.write32(Guest32::CsAccessRights, code_ar), "guest CS AR")?;
    w(v.write_natural(GuestNatural::CsBase, 0), "guest CS base")?;
    // LDTR unusable (bit 16); TR a busy TSS (64-bit in IA-32e mode, §27.3.1.2).
    w(v.write16(Guest16::LdtrSelector, 0), "guest LDTR")?;
    w(v.write32(Guest32::LdtrLimit, 0), "guest LDTR limit")?;
    w(
        v.write32(Guest32::LdtrAccessRights, 0x1_0000),
        "guest LDTR AR",
    )?;
    w(
        v.write_natural(GuestNatural::LdtrBase, 0),
        "guest LDTR base",
    )?;
    w(v.write16(Guest16::TrSelector, 0), "guest TR")?;
    w(v.write32(Guest32::TrLimit, 0x67), "guest TR limit")?;
    w(v.write32(Guest32::TrAccessRights, 0x8b), "guest TR AR")?;
    w(v.write_natural(GuestNatural::TrBase, 0), "guest TR base")?;
    w(
        v.write_natural(GuestNatural::GdtrBase, boot.gdt_base),
        "guest GDTR base",
    )?;
    w(
        v.write32(Guest32::GdtrLimit, boot.gdt_limit.into()),
        "guest GDTR limit",
    )?;
    // Real mode: the interrupt vector table at 0 (256 vectors of 4 bytes).
    w(
        v.write_natural(GuestNatural::IdtrBase, 0),
        "guest IDTR base",
    )?;
    w(
        v.write32(Guest32::IdtrLimit, if real { 0x3ff } else { 0 }),
        "guest IDTR limit",
    )?;
    w(v.write_natural(GuestNatural::Dr7, 0x400), "guest DR7")?;
    w(v.write_natural(GuestNatural::Rsp, boot.rsp), "guest RSP")?;
    w(v.write_natural(GuestNatural::Rip, boot.entry), "guest RIP")?;
    w(v.write_natural(GuestNatural::Rflags, 0x2), "guest RFLAGS")?;
    w(
        v.write_natural(GuestNatural::PendingDebugExceptions, 0),
        "guest pending #DB",
    )?;
    w(
        v.write_natural(GuestNatural::Ia32SysenterEsp, 0),
        "guest SYSENTER_ESP",
    )?;
    w(
        v.write_natural(GuestNatural::Ia32SysenterEip, 0),
        "guest SYSENTER_EIP",
    )?;
    w(v.write32(Guest32::Ia32SysenterCs, 0), "guest SYSENTER_CS")?;
    w(
        v.write32(Guest32::InterruptibilityState, 0),
        "guest interruptibility",
    )?;
    w(v.write32(Guest32::ActivityState, 0), "guest activity state")?;
    w(
        v.write64(Guest64::VmcsLinkPointer, u64::MAX),
        "VMCS link pointer",
    )?;
    w(v.write64(Guest64::Ia32Debugctl, 0), "guest DEBUGCTL")?;
    w(v.write64(Guest64::Ia32Pat, PAT_DEFAULT), "guest PAT")?;
    // LME | LMA, and NXE where the CPU has it.
    let efer = if boot.mode.legacy() {
        0
    } else {
        0x500 | if nx { 0x800 } else { 0 }
    };
    w(v.write64(Guest64::Ia32Efer, efer), "guest EFER")?;
    w(
        v.write32(Guest32::PreemptionTimerValue, u32::MAX),
        "preemption timer",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvprof_vmx::caps::RawCaps;
    use hvprof_vmx::fake::FakeVmcs;

    /// Capabilities that allow everything (may-be-one all set, must-be-one none), with the TRUE
    /// MSRs (bit 55).
    fn generous() -> VmxCaps {
        let all = 0xffff_ffff_0000_0000;
        VmxCaps::new(RawCaps {
            basic: 1 << 55,
            pinbased: all,
            procbased: all,
            procbased2: all,
            exit: all,
            entry: all,
            true_pinbased: all,
            true_procbased: all,
            true_exit: all,
            true_entry: all,
            ..RawCaps::default()
        })
    }

    fn boot(mode: StartMode) -> BootState {
        BootState {
            mode,
            entry: 0x20_1000,
            rsp: 0x30_0000,
            cr3: 0x1000,
            gdt_base: 0x2000,
            gdt_limit: 0x17,
            rax: 0,
            rbx: 0,
            rdi: 0,
            rsi: 0,
            code_selector: 8,
            data_selector: 16,
        }
    }

    #[test]
    fn controls_ask_for_what_sampling_and_isolation_need() {
        let c = Controls::new(&generous(), false).unwrap();
        assert!(c.pin & pin::PREEMPTION_TIMER != 0 && c.pin & pin::NMI_EXITING != 0);
        assert!(c.proc1 & proc1::RDPMC_EXITING != 0 && c.proc1 & proc1::HLT_EXITING != 0);
        assert!(
            c.proc1 & proc1::USE_TSC_OFFSETTING != 0,
            "a guest may write its TSC"
        );
        assert!(c.proc2 & proc2::ENABLE_EPT != 0 && c.unrestricted());
        assert!(
            c.proc2 & proc2::ENABLE_RDTSCP != 0,
            "RDTSCP with the vCPU's TSC_AUX"
        );
        assert!(c.exit & exit::SAVE_PREEMPTION_TIMER != 0);
        assert!(c.entry & entry_ctl::IA32E_MODE_GUEST != 0);
        let real = Controls::new(&generous(), true).unwrap();
        assert_eq!(real.entry & entry_ctl::IA32E_MODE_GUEST, 0);
    }

    #[test]
    fn a_missing_control_is_named() {
        let mut raw = generous().raw;
        // No preemption timer: pin-based may-be-one without bit 6.
        raw.true_pinbased &= !(u64::from(pin::PREEMPTION_TIMER) << 32);
        let e = Controls::new(&VmxCaps::new(raw), false).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("activate VMX-preemption timer"), "{text}");
        // A real-mode start without unrestricted guest.
        let mut raw = generous().raw;
        raw.procbased2 &= !(u64::from(proc2::UNRESTRICTED_GUEST) << 32);
        let e = Controls::new(&VmxCaps::new(raw), true).unwrap_err();
        assert!(e.to_string().contains("unrestricted guest"), "{e}");
    }

    #[test]
    fn a_64_bit_vcpu_is_written_whole() {
        let mut v = FakeVmcs::new();
        let c = Controls::new(&generous(), false).unwrap();
        let t = ControlTargets {
            io_bitmap_a: 0x1000,
            io_bitmap_b: 0x2000,
            msr_bitmap: 0x3000,
            eptp: 0x4000_005e,
            vpid: 7,
        };
        write_controls(&mut v, &c, &t).unwrap();
        // Bochs' fixed bits: CR0 PE, NE, PG must be 1; CR4 VMXE.
        let fixed = FixedCrs::new(
            (0x8000_0021, u64::MAX),
            (0x2000, u64::MAX),
            c.unrestricted(),
        );
        write_control_registers(&mut v, &fixed, StartMode::Long64, 0x9000).unwrap();
        let host = HostState {
            cr0: 0x8005_0033,
            cr3: 0x10_0000,
            cr4: 0x2620,
            code_selector: 8,
            data_selector: 16,
            pat: PAT_DEFAULT,
            efer: 0xd01,
            rip: 0xffff_8000_0000_1000,
        };
        write_host_state(&mut v, &host).unwrap();
        write_guest_state(&mut v, &boot(StartMode::Long64), true).unwrap();
        assert_eq!(v.read16(Control16::Vpid), Ok(7));
        assert_eq!(v.read64(Control64::EptPointer), Ok(0x4000_005e));
        assert_eq!(v.read32(Control32::PinBasedControls), Ok(c.pin));
        // With unrestricted guest, PE and PG are the guest's: only NE stays forced in the mask.
        assert_eq!(v.read_natural(ControlNatural::Cr0GuestHostMask), Ok(0x20));
        assert_eq!(v.read_natural(GuestNatural::Cr0), Ok(0x8001_0033));
        assert_eq!(v.read_natural(GuestNatural::Cr4), Ok(0x2620));
        assert_eq!(v.read_natural(ControlNatural::Cr4ReadShadow), Ok(0x620));
        assert_eq!(v.read_natural(GuestNatural::Cr3), Ok(0x9000));
        assert_eq!(v.read_natural(HostNatural::Rip), Ok(host.rip));
        assert_eq!(v.read16(Host16::DsSelector), Ok(16));
        assert_eq!(v.read16(Guest16::CsSelector), Ok(8));
        assert_eq!(
            v.read32(Guest32::CsAccessRights),
            Ok(guest_image::CODE_ACCESS_RIGHTS)
        );
        assert_eq!(v.read32(Guest32::LdtrAccessRights), Ok(0x1_0000));
        assert_eq!(v.read64(Guest64::VmcsLinkPointer), Ok(u64::MAX));
        assert_eq!(v.read64(Guest64::Ia32Efer), Ok(0xd00));
        assert_eq!(v.read_natural(GuestNatural::Rip), Ok(0x20_1000));
        assert_eq!(v.read32(Guest32::PreemptionTimerValue), Ok(u32::MAX));
    }

    #[test]
    fn a_real_mode_vcpu_starts_flat_without_paging() {
        let mut v = FakeVmcs::new();
        let fixed = FixedCrs::new((0x8000_0021, u64::MAX), (0x2000, u64::MAX), true);
        write_control_registers(&mut v, &fixed, StartMode::Real16, 0).unwrap();
        write_guest_state(&mut v, &boot(StartMode::Real16), true).unwrap();
        assert_eq!(v.read_natural(GuestNatural::Cr0), Ok(0x30));
        assert_eq!(v.read16(Guest16::CsSelector), Ok(0));
        assert_eq!(v.read32(Guest32::CsLimit), Ok(0xffff));
        assert_eq!(v.read32(Guest32::CsAccessRights), Ok(0x9b));
        assert_eq!(v.read32(Guest32::IdtrLimit), Ok(0x3ff));
        assert_eq!(v.read64(Guest64::Ia32Efer), Ok(0));
        // Without unrestricted guest, PE and PG would be forced on.
        let strict = FixedCrs::new((0x8000_0021, u64::MAX), (0x2000, u64::MAX), false);
        assert_eq!(strict.force_cr0(0x30), 0x8000_0031);
    }

    #[test]
    fn a_failing_vmwrite_is_named() {
        let mut v = FakeVmcs::new();
        // A VMCS that lacks the EPT pointer field (a CPU without EPT).
        v.0.remove(&Control64::EptPointer.encoding());
        let c = Controls::new(&generous(), false).unwrap();
        let t = ControlTargets {
            io_bitmap_a: 0,
            io_bitmap_b: 0,
            msr_bitmap: 0,
            eptp: 0,
            vpid: 1,
        };
        let e = write_controls(&mut v, &c, &t).unwrap_err().to_string();
        assert!(e.contains("EPTP"), "{e}");
    }
}
