//! The VMX capability MSRs, decoded (Intel SDM Vol. 3D, Appendix A, "VMX Capability Reporting
//! Facility"), and the check of what hvprof needs from them.
//!
//! Everything here is pure: the caller reads the MSRs (only after CPUID.1:ECX.VMX\[bit 5\] = 1,
//! since they raise #GP otherwise) and hands the raw values in, so the logic is unit-tested on the
//! host against the values real CPU models report.

use core::fmt;

/// MSR numbers (SDM Vol. 4, Table 2-2, and Vol. 3D Appendix A).
pub mod msr {
    pub const IA32_FEATURE_CONTROL: u32 = 0x3a;
    pub const IA32_VMX_BASIC: u32 = 0x480;
    pub const IA32_VMX_PINBASED_CTLS: u32 = 0x481;
    pub const IA32_VMX_PROCBASED_CTLS: u32 = 0x482;
    pub const IA32_VMX_EXIT_CTLS: u32 = 0x483;
    pub const IA32_VMX_ENTRY_CTLS: u32 = 0x484;
    pub const IA32_VMX_MISC: u32 = 0x485;
    pub const IA32_VMX_CR0_FIXED0: u32 = 0x486;
    pub const IA32_VMX_CR0_FIXED1: u32 = 0x487;
    pub const IA32_VMX_CR4_FIXED0: u32 = 0x488;
    pub const IA32_VMX_CR4_FIXED1: u32 = 0x489;
    pub const IA32_VMX_PROCBASED_CTLS2: u32 = 0x48b;
    pub const IA32_VMX_EPT_VPID_CAP: u32 = 0x48c;
    pub const IA32_VMX_TRUE_PINBASED_CTLS: u32 = 0x48d;
    pub const IA32_VMX_TRUE_PROCBASED_CTLS: u32 = 0x48e;
    pub const IA32_VMX_TRUE_EXIT_CTLS: u32 = 0x48f;
    pub const IA32_VMX_TRUE_ENTRY_CTLS: u32 = 0x490;
}

/// IA32_FEATURE_CONTROL (SDM Vol. 3C §24.7, "Enabling and Entering VMX Operation").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FeatureControl(pub u64);

impl FeatureControl {
    pub const LOCK: u64 = 1 << 0;
    pub const VMX_INSIDE_SMX: u64 = 1 << 1;
    pub const VMX_OUTSIDE_SMX: u64 = 1 << 2;

    pub fn locked(self) -> bool {
        self.0 & Self::LOCK != 0
    }
    pub fn vmx_outside_smx(self) -> bool {
        self.0 & Self::VMX_OUTSIDE_SMX != 0
    }
    /// VMXON outside SMX is impossible until the next reset: the MSR is locked with the enable bit
    /// clear (a firmware setting).
    pub fn vmx_locked_off(self) -> bool {
        self.locked() && !self.vmx_outside_smx()
    }
}

/// A VMX control MSR: bits 31:0 are the allowed 0-settings (a 1 there means the control must be
/// 1), bits 63:32 the allowed 1-settings (a 0 there means the control must be 0). SDM Vol. 3D
/// §A.3-A.5.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AllowedBits(pub u64);

impl AllowedBits {
    pub fn must_be_one(self) -> u32 {
        (self.0 & 0xffff_ffff) as u32
    }
    pub fn may_be_one(self) -> u32 {
        (self.0 >> 32) as u32
    }
    pub fn allows(self, bit: u32) -> bool {
        self.may_be_one() & bit != 0
    }
    /// Adjusts a wanted control value: sets the bits that must be one and reports the wanted bits
    /// that may not be one (SDM Vol. 3D §A.3.1, and Vol. 3C §25.6 "VM-Execution Control Fields").
    pub fn adjust(self, wanted: u32) -> Result<u32, u32> {
        let missing = wanted & !self.may_be_one();
        if missing != 0 {
            Err(missing)
        } else {
            Ok(wanted | self.must_be_one())
        }
    }
}

/// Pin-based VM-execution controls (SDM Vol. 3C §25.6.1, Table 25-5).
pub mod pin {
    pub const EXTERNAL_INTERRUPT_EXITING: u32 = 1 << 0;
    pub const NMI_EXITING: u32 = 1 << 3;
    pub const VIRTUAL_NMIS: u32 = 1 << 5;
    pub const PREEMPTION_TIMER: u32 = 1 << 6;
}

/// Primary processor-based VM-execution controls (SDM Vol. 3C §25.6.2, Table 25-6).
pub mod proc1 {
    pub const INTERRUPT_WINDOW_EXITING: u32 = 1 << 2;
    /// The guest's RDTSC, RDTSCP and RDMSR of IA32_TSC add the TSC-offset field (SDM Vol. 3C
    /// §25.6.5, §26.3).
    pub const USE_TSC_OFFSETTING: u32 = 1 << 3;
    pub const HLT_EXITING: u32 = 1 << 7;
    pub const MWAIT_EXITING: u32 = 1 << 10;
    pub const RDPMC_EXITING: u32 = 1 << 11;
    pub const CR8_LOAD_EXITING: u32 = 1 << 19;
    /// The virtual-APIC page holds the guest's TPR (SDM Vol. 3C §29.1).
    pub const USE_TPR_SHADOW: u32 = 1 << 21;
    pub const CR8_STORE_EXITING: u32 = 1 << 20;
    pub const USE_IO_BITMAPS: u32 = 1 << 25;
    /// Allowed only with the pin-based "virtual NMIs" (SDM Vol. 3C §27.2.1.1).
    pub const NMI_WINDOW_EXITING: u32 = 1 << 22;
    pub const MONITOR_TRAP_FLAG: u32 = 1 << 27;
    pub const USE_MSR_BITMAPS: u32 = 1 << 28;
    pub const MONITOR_EXITING: u32 = 1 << 29;
    pub const ACTIVATE_SECONDARY: u32 = 1 << 31;
}

/// Secondary processor-based VM-execution controls (SDM Vol. 3C §25.6.2, Table 25-7).
pub mod proc2 {
    /// Accesses to the APIC-access page are virtualized or exit (SDM Vol. 3C §29.4).
    pub const VIRTUALIZE_APIC_ACCESSES: u32 = 1 << 0;
    /// Reads of most APIC registers come from the virtual-APIC page; writes exit after they
    /// are done there (§29.4.2-29.4.3).
    pub const APIC_REGISTER_VIRTUALIZATION: u32 = 1 << 8;
    /// The CPU delivers virtual interrupts and virtualizes EOI (§29.1.2-29.2).
    pub const VIRTUAL_INTERRUPT_DELIVERY: u32 = 1 << 9;
    pub const ENABLE_EPT: u32 = 1 << 1;
    pub const ENABLE_RDTSCP: u32 = 1 << 3;
    pub const ENABLE_VPID: u32 = 1 << 5;
    pub const WBINVD_EXITING: u32 = 1 << 6;
    pub const UNRESTRICTED_GUEST: u32 = 1 << 7;
    /// A PAUSE loop at CPL 0 longer than PLE_Window exits (§25.6.13, §26.1.3).
    pub const PAUSE_LOOP_EXITING: u32 = 1 << 10;
    pub const ENABLE_INVPCID: u32 = 1 << 12;
    pub const ENABLE_PML: u32 = 1 << 17;
    pub const ENABLE_XSAVES: u32 = 1 << 20;
}

/// VM-exit controls (SDM Vol. 3C §25.7.1, Table 25-13).
pub mod exit {
    pub const SAVE_DEBUG_CONTROLS: u32 = 1 << 2;
    pub const HOST_ADDRESS_SPACE_SIZE: u32 = 1 << 9;
    /// Load IA32_PERF_GLOBAL_CTRL from the host-state area at VM exit (SDM Vol. 3C §25.7.1).
    pub const LOAD_IA32_PERF_GLOBAL_CTRL: u32 = 1 << 12;
    pub const ACK_INTERRUPT_ON_EXIT: u32 = 1 << 15;
    pub const SAVE_IA32_PAT: u32 = 1 << 18;
    pub const LOAD_IA32_PAT: u32 = 1 << 19;
    pub const SAVE_IA32_EFER: u32 = 1 << 20;
    pub const LOAD_IA32_EFER: u32 = 1 << 21;
    pub const SAVE_PREEMPTION_TIMER: u32 = 1 << 22;
}

/// VM-entry controls (SDM Vol. 3C §25.8.1, Table 25-15).
pub mod entry {
    pub const LOAD_DEBUG_CONTROLS: u32 = 1 << 2;
    pub const IA32E_MODE_GUEST: u32 = 1 << 9;
    /// Load IA32_PERF_GLOBAL_CTRL from the guest-state area at VM entry (SDM Vol. 3C §25.8.1).
    pub const LOAD_IA32_PERF_GLOBAL_CTRL: u32 = 1 << 13;
    pub const LOAD_IA32_PAT: u32 = 1 << 14;
    pub const LOAD_IA32_EFER: u32 = 1 << 15;
}

/// IA32_VMX_EPT_VPID_CAP bits (SDM Vol. 3D §A.10).
pub mod ept_cap {
    pub const EXECUTE_ONLY: u64 = 1 << 0;
    pub const WALK_LENGTH_4: u64 = 1 << 6;
    pub const MEMTYPE_UC: u64 = 1 << 8;
    pub const MEMTYPE_WB: u64 = 1 << 14;
    pub const PAGE_2M: u64 = 1 << 16;
    pub const PAGE_1G: u64 = 1 << 17;
    pub const INVEPT: u64 = 1 << 20;
    pub const ACCESSED_DIRTY: u64 = 1 << 21;
    pub const INVEPT_SINGLE: u64 = 1 << 25;
    pub const INVEPT_ALL: u64 = 1 << 26;
    pub const INVVPID: u64 = 1 << 32;
    pub const INVVPID_ADDRESS: u64 = 1 << 40;
    pub const INVVPID_SINGLE: u64 = 1 << 41;
    pub const INVVPID_ALL: u64 = 1 << 42;
}

/// The raw capability MSR values of one CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RawCaps {
    pub basic: u64,
    pub pinbased: u64,
    pub procbased: u64,
    pub exit: u64,
    pub entry: u64,
    pub misc: u64,
    /// IA32_VMX_PROCBASED_CTLS2, read only when the primary controls allow "activate secondary
    /// controls" (the MSR does not exist otherwise); 0 when absent.
    pub procbased2: u64,
    /// IA32_VMX_EPT_VPID_CAP, read only when the secondary controls allow EPT or VPID; 0 when
    /// absent.
    pub ept_vpid: u64,
    /// The TRUE_* MSRs, read only when IA32_VMX_BASIC bit 55 is set; 0 when absent.
    pub true_pinbased: u64,
    pub true_procbased: u64,
    pub true_exit: u64,
    pub true_entry: u64,
}

/// Decoded capabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmxCaps {
    pub raw: RawCaps,
}

impl VmxCaps {
    pub fn new(raw: RawCaps) -> Self {
        Self { raw }
    }

    /// VMCS revision identifier (IA32_VMX_BASIC bits 30:0).
    pub fn vmcs_revision(&self) -> u32 {
        (self.raw.basic & 0x7fff_ffff) as u32
    }
    /// VMXON/VMCS region size in bytes (bits 44:32).
    pub fn vmcs_size(&self) -> u32 {
        ((self.raw.basic >> 32) & 0x1fff) as u32
    }
    /// Bit 48: physical addresses in VMX structures are limited to 32 bits.
    pub fn addresses_32bit_only(&self) -> bool {
        self.raw.basic & (1 << 48) != 0
    }
    /// Bits 53:50: memory type for VMX structures (6 = write-back).
    pub fn vmcs_memory_type(&self) -> u8 {
        ((self.raw.basic >> 50) & 0xf) as u8
    }
    /// Bit 54: VM exits due to INS/OUTS report instruction information.
    pub fn ins_outs_info(&self) -> bool {
        self.raw.basic & (1 << 54) != 0
    }
    /// Bit 55: the TRUE_* control MSRs exist (SDM Vol. 3D §A.2).
    pub fn has_true_controls(&self) -> bool {
        self.raw.basic & (1 << 55) != 0
    }

    fn pick(&self, plain: u64, true_: u64) -> AllowedBits {
        AllowedBits(if self.has_true_controls() {
            true_
        } else {
            plain
        })
    }
    /// The pin-based controls, through the TRUE MSR when it exists (SDM Vol. 3D §A.3.1).
    pub fn pinbased(&self) -> AllowedBits {
        self.pick(self.raw.pinbased, self.raw.true_pinbased)
    }
    pub fn procbased(&self) -> AllowedBits {
        self.pick(self.raw.procbased, self.raw.true_procbased)
    }
    pub fn procbased2(&self) -> AllowedBits {
        if self.has_secondary() {
            AllowedBits(self.raw.procbased2)
        } else {
            AllowedBits(0)
        }
    }
    pub fn exit(&self) -> AllowedBits {
        self.pick(self.raw.exit, self.raw.true_exit)
    }
    pub fn entry(&self) -> AllowedBits {
        self.pick(self.raw.entry, self.raw.true_entry)
    }

    pub fn has_secondary(&self) -> bool {
        AllowedBits(self.raw.procbased).allows(proc1::ACTIVATE_SECONDARY)
    }
    pub fn has_ept(&self) -> bool {
        self.procbased2().allows(proc2::ENABLE_EPT)
    }
    pub fn has_vpid(&self) -> bool {
        self.procbased2().allows(proc2::ENABLE_VPID)
    }
    pub fn has_unrestricted_guest(&self) -> bool {
        self.has_ept() && self.procbased2().allows(proc2::UNRESTRICTED_GUEST)
    }
    pub fn has_preemption_timer(&self) -> bool {
        self.pinbased().allows(pin::PREEMPTION_TIMER)
            && self.exit().allows(exit::SAVE_PREEMPTION_TIMER)
    }
    /// The VMX-preemption timer counts down by 1 every time bit N of the TSC changes, N being
    /// IA32_VMX_MISC bits 4:0 (SDM Vol. 3C §26.5.1).
    pub fn preemption_timer_shift(&self) -> u8 {
        (self.raw.misc & 0x1f) as u8
    }
    pub fn has_monitor_trap_flag(&self) -> bool {
        self.procbased().allows(proc1::MONITOR_TRAP_FLAG)
    }
    pub fn has_pml(&self) -> bool {
        self.procbased2().allows(proc2::ENABLE_PML)
    }
    pub fn ept_cap(&self, bit: u64) -> bool {
        (self.has_ept() || self.has_vpid()) && self.raw.ept_vpid & bit != 0
    }

    /// What hvprof cannot run without, first missing item first. `None` when everything is there.
    pub fn missing_requirement(&self) -> Option<Missing> {
        if !self.has_secondary() {
            return Some(Missing::Ept(
                "the CPU has no secondary processor-based controls",
            ));
        }
        if !self.has_ept() {
            return Some(Missing::Ept(
                "the secondary control 'enable EPT' is not allowed",
            ));
        }
        if !self.ept_cap(ept_cap::WALK_LENGTH_4) {
            return Some(Missing::Ept("EPT has no 4-level page walk"));
        }
        if !self.ept_cap(ept_cap::MEMTYPE_WB) {
            return Some(Missing::Ept("EPT paging structures cannot be write-back"));
        }
        if !self.ept_cap(ept_cap::INVEPT)
            || !(self.ept_cap(ept_cap::INVEPT_SINGLE) || self.ept_cap(ept_cap::INVEPT_ALL))
        {
            return Some(Missing::Ept("the CPU has no usable INVEPT"));
        }
        if !self.exit().allows(exit::HOST_ADDRESS_SPACE_SIZE) {
            return Some(Missing::Other("VM exits cannot return to a 64-bit host"));
        }
        if !self.entry().allows(entry::IA32E_MODE_GUEST) {
            return Some(Missing::Other("VM entries cannot start a 64-bit guest"));
        }
        if self.vmcs_memory_type() != 6 {
            return Some(Missing::Other("VMX structures must be write-back memory"));
        }
        None
    }
}

/// A hard requirement the CPU lacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Missing {
    Ept(&'static str),
    Other(&'static str),
}

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Missing::Ept(why) => write!(f, "this CPU has VMX but no usable EPT ({why})"),
            Missing::Other(why) => write!(f, "this CPU's VMX lacks a required feature ({why})"),
        }
    }
}

/// One line per feature, for the boot report: `cpu: EPT yes (4 KiB, 2 MiB, 1 GiB pages; ...)`.
pub struct Report<'a>(pub &'a VmxCaps);

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

impl fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = self.0;
        let r = &c.raw;
        writeln!(
            f,
            "cpu: VMX MSRs basic {:#x} pin {:#x}/{:#x} proc {:#x}/{:#x} proc2 {:#x} exit {:#x}/{:#x} entry {:#x}/{:#x} misc {:#x} ept_vpid {:#x}",
            r.basic,
            r.pinbased,
            r.true_pinbased,
            r.procbased,
            r.true_procbased,
            r.procbased2,
            r.exit,
            r.true_exit,
            r.entry,
            r.true_entry,
            r.misc,
            r.ept_vpid
        )?;
        writeln!(
            f,
            "cpu: VMCS revision {:#x}, region {} bytes, true controls {}, INS/OUTS info {}",
            c.vmcs_revision(),
            c.vmcs_size(),
            yes(c.has_true_controls()),
            yes(c.ins_outs_info())
        )?;
        if c.has_ept() {
            write!(f, "cpu: EPT yes (4 KiB")?;
            if c.ept_cap(ept_cap::PAGE_2M) {
                write!(f, ", 2 MiB")?;
            }
            if c.ept_cap(ept_cap::PAGE_1G) {
                write!(f, ", 1 GiB")?;
            }
            writeln!(
                f,
                " pages; 4-level walk {}; WB {}; A/D bits {}; execute-only {}; INVEPT single {} all {})",
                yes(c.ept_cap(ept_cap::WALK_LENGTH_4)),
                yes(c.ept_cap(ept_cap::MEMTYPE_WB)),
                yes(c.ept_cap(ept_cap::ACCESSED_DIRTY)),
                yes(c.ept_cap(ept_cap::EXECUTE_ONLY)),
                yes(c.ept_cap(ept_cap::INVEPT_SINGLE)),
                yes(c.ept_cap(ept_cap::INVEPT_ALL)),
            )?;
        } else {
            writeln!(f, "cpu: EPT no")?;
        }
        if c.has_vpid() {
            writeln!(
                f,
                "cpu: VPID yes (INVVPID {}, single-context {}, all-context {})",
                yes(c.ept_cap(ept_cap::INVVPID)),
                yes(c.ept_cap(ept_cap::INVVPID_SINGLE)),
                yes(c.ept_cap(ept_cap::INVVPID_ALL)),
            )?;
        } else {
            writeln!(f, "cpu: VPID no")?;
        }
        writeln!(
            f,
            "cpu: unrestricted guest {}",
            yes(c.has_unrestricted_guest())
        )?;
        if c.has_preemption_timer() {
            writeln!(
                f,
                "cpu: VMX-preemption timer yes (counts every 2^{} TSC ticks)",
                c.preemption_timer_shift()
            )?;
        } else {
            writeln!(f, "cpu: VMX-preemption timer no")?;
        }
        write!(
            f,
            "cpu: monitor trap flag {}, PML {}",
            yes(c.has_monitor_trap_flag()),
            yes(c.has_pml())
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bochs 2.7 `corei7_haswell_4770`, as the hypervisor's `cpu: VMX MSRs` boot line printed
    /// them (`cargo xtask run --emulator bochs`).
    pub(crate) fn haswell() -> RawCaps {
        RawCaps {
            basic: 0x00d8_1000_0000_002b,
            pinbased: 0x0000_007f_0000_0016,
            procbased: 0xf7f9_fffe_0401_e172,
            exit: 0x007f_ffff_0003_6dff,
            entry: 0x0000_ffff_0000_11ff,
            misc: 0x2004_01e0,
            procbased2: 0x0004_7fff_0000_0000,
            ept_vpid: 0x0000_0f01_0633_4141,
            true_pinbased: 0x0000_007f_0000_0016,
            true_procbased: 0xf7f9_fffe_0400_6172,
            true_exit: 0x007f_ffff_0003_6dfb,
            true_entry: 0x0000_ffff_0000_11fb,
        }
    }

    #[test]
    fn haswell_has_everything() {
        let c = VmxCaps::new(haswell());
        assert_eq!(c.vmcs_revision(), 0x2b);
        assert_eq!(c.vmcs_size(), 0x1000);
        assert!(c.has_true_controls());
        assert_eq!(c.vmcs_memory_type(), 6);
        assert!(c.has_ept() && c.has_vpid() && c.has_unrestricted_guest());
        assert!(c.has_preemption_timer());
        assert_eq!(c.preemption_timer_shift(), 0);
        assert!(c.ept_cap(ept_cap::PAGE_2M) && c.ept_cap(ept_cap::PAGE_1G));
        assert!(c.ept_cap(ept_cap::ACCESSED_DIRTY));
        assert_eq!(c.missing_requirement(), None);
        let text = alloc_report(&c);
        assert!(
            text.contains("cpu: EPT yes (4 KiB, 2 MiB, 1 GiB pages"),
            "{text}"
        );
        assert!(text.contains("cpu: VMX-preemption timer yes (counts every 2^0 TSC ticks)"));
    }

    #[test]
    fn no_secondary_controls_means_no_ept() {
        let mut raw = haswell();
        raw.procbased &= !(u64::from(proc1::ACTIVATE_SECONDARY) << 32);
        raw.true_procbased &= !(u64::from(proc1::ACTIVATE_SECONDARY) << 32);
        let c = VmxCaps::new(raw);
        assert!(!c.has_ept());
        assert!(!c.has_vpid());
        assert!(matches!(c.missing_requirement(), Some(Missing::Ept(_))));
        let msg = c.missing_requirement().unwrap().to_string();
        assert!(msg.contains("no usable EPT"), "{msg}");
    }

    #[test]
    fn ept_without_wb_is_refused() {
        let mut raw = haswell();
        raw.ept_vpid &= !ept_cap::MEMTYPE_WB;
        assert_eq!(
            VmxCaps::new(raw).missing_requirement(),
            Some(Missing::Ept("EPT paging structures cannot be write-back"))
        );
    }

    #[test]
    fn true_controls_are_used_when_present() {
        let c = VmxCaps::new(haswell());
        // CR3-load/-store exiting (bits 15, 16) are default1: only the TRUE MSR lets them be 0.
        let cr3_exiting = (1 << 15) | (1 << 16);
        assert_eq!(c.procbased().must_be_one() & cr3_exiting, 0);
        let mut raw = haswell();
        raw.basic &= !(1 << 55);
        assert_eq!(
            VmxCaps::new(raw).procbased().must_be_one() & cr3_exiting,
            cr3_exiting
        );
    }

    #[test]
    fn adjust_sets_required_and_reports_missing() {
        let a = AllowedBits(0x0000_00ff_0000_0016);
        assert_eq!(a.adjust(0x1), Ok(0x17));
        assert_eq!(a.adjust(0x100 | 0x1), Err(0x100));
    }

    #[test]
    fn feature_control() {
        assert!(FeatureControl(0x1).vmx_locked_off());
        assert!(!FeatureControl(0x5).vmx_locked_off());
        assert!(!FeatureControl(0x0).vmx_locked_off());
    }

    fn alloc_report(c: &VmxCaps) -> String {
        format!("{}", Report(c))
    }
}
