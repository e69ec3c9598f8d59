//! A virtual CPU: its VMCS, set up for a 64-bit test guest under EPT with VPID (Intel SDM Vol. 3C
//! chapter 25, "Virtual-Machine Control Structures", and §27.2-27.3, the checks VM entry makes),
//! its general-purpose registers (saved by the entry/exit stub) and its FPU state.

pub mod entry;
pub mod fpu;
pub mod guest_ops;

use crate::arch::msr;
use fpu::FpuState;
use hvprof_boot::memory::PAGE_SIZE;
use hvprof_hypervisor::guest_image::{self, BootState, StartMode};
use hvprof_samplelog::ExitStats;
use hvprof_vmx::caps::{
    AllowedBits, VmxCaps, entry as entry_ctl, exit, msr as vmsr, pin, proc1, proc2,
};
use hvprof_vmx::errors::VmFail;
use hvprof_vmx::instructions::{self, CurrentVmcs};
use hvprof_vmx::regs::GuestRegisters;
use hvprof_vmx::vmcs::{
    Control16, Control32, Control64, ControlNatural, Guest16, Guest32, Guest64, GuestNatural,
    Host16, Host32, Host64, HostNatural, VmcsExt,
};
use x86_64::registers::control::{Cr0, Cr0Flags, Cr3, Cr4};

pub const IA32_PAT: u32 = 0x277;
pub const IA32_EFER: u32 = 0xc000_0080;
const PAT_DEFAULT: u64 = 0x0007_0406_0007_0406;

/// MSRs that VMX does not switch and the guest may use freely (docs/GUEST-ABI.md): the syscall
/// MSRs and KERNEL_GS_BASE. The hypervisor never uses them, so they are switched only when the
/// CPU changes vCPU.
pub const SWITCHED_MSRS: [u32; 5] = [
    0xc000_0081, // IA32_STAR
    0xc000_0082, // IA32_LSTAR
    0xc000_0083, // IA32_CSTAR
    0xc000_0084, // IA32_FMASK
    0xc000_0102, // IA32_KERNEL_GS_BASE
];
/// Where IA32_LSTAR (the guest kernel's system-call entry) sits in `SWITCHED_MSRS` and
/// `Vcpu::msrs`.
pub const LSTAR_SLOT: usize = 1;
const _: () = assert!(SWITCHED_MSRS[LSTAR_SLOT] == 0xc000_0082);

pub struct Vcpu {
    /// Host-physical address of the VMCS region.
    pub vmcs: u64,
    pub regs: GuestRegisters,
    pub launched: bool,
    /// Its x87/SSE/AVX state and XCR0.
    pub fpu: FpuState,
    /// DR0-DR3 and DR6, which VMX does not switch (DR7 is in the VMCS).
    pub debug: [u64; 5],
    /// Its task-priority register (CR8: MOV to and from CR8 exit, the physical TPR stays the
    /// hypervisor's).
    pub cr8: u64,
    pub msrs: [u64; SWITCHED_MSRS.len()],
    pub vpid: u16,
    /// Bits the guest may not change in CR0/CR4 and their forced values (SDM Vol. 3C §25.6.6).
    pub cr0_fixed: (u64, u64),
    pub cr4_fixed: (u64, u64),
    /// The last VM-exit basic reason (0xffff before the first).
    pub last_exit: u16,
    /// The TSC at which the virtual timer (SET_TIMER hypercall) wakes it from HLT.
    pub wake_at: Option<u64>,
    /// Its number in its VM.
    pub index: u16,
    /// Its exits (the VM's table adds up its vCPUs').
    pub stats: ExitStats,
    /// The pCPU whose host state the VMCS holds, and on which the VMCS is active (not cleared).
    pub host_cpu: Option<usize>,
    /// The pCPU it ran on last (to flush its VPID's stale translations when it moves).
    pub last_cpu: Option<usize>,
    /// The primary processor-based controls as set up (the interrupt-window bit toggles).
    pub proc1: u32,
    /// Virtual interrupts injected (`interrupts::before_entry`).
    pub interrupts_injected: u64,
    /// The Linux task seen at its last sample: its address and ids, the address space (CR3
    /// without its flag bits) and its name.
    pub last_task: Option<(
        hvprof_hypervisor::profiler::guest_walk::TaskIds,
        u64,
        [u8; 16],
    )>,
    /// Its guest's kernel-page translations, for reading the task at samples.
    pub tlb: hvprof_hypervisor::profiler::guest_walk::Tlb,
}

/// Bitmaps shared by every VM: every I/O port and every MSR exits, except the MSRs passed
/// through (SDM Vol. 3C §25.6.4 and §25.6.9).
pub struct Bitmaps {
    pub io_a: u64,
    pub io_b: u64,
    pub msr: u64,
}

impl Bitmaps {
    pub fn new() -> Option<Bitmaps> {
        let io_a = crate::memory::alloc_zeroed(PAGE_SIZE, PAGE_SIZE)?;
        let io_b = crate::memory::alloc_zeroed(PAGE_SIZE, PAGE_SIZE)?;
        let msr = crate::memory::alloc_zeroed(PAGE_SIZE, PAGE_SIZE)?;
        // SAFETY: three fresh identity-mapped frames owned by the bitmaps from now on.
        let (a, b, m) = unsafe {
            (
                &mut *(io_a as *mut [u8; 4096]),
                &mut *(io_b as *mut [u8; 4096]),
                &mut *(msr as *mut [u8; 4096]),
            )
        };
        a.fill(0xff);
        b.fill(0xff);
        m.fill(0xff);
        // §25.6.9: read-low at 0, read-high (0xc0000000-0xc0001fff) at 1024, write-low at 2048,
        // write-high at 3072; a clear bit lets the access through.
        let mut pass = |msr: u32, read: bool, write: bool| {
            let (base, index) = if msr >= 0xc000_0000 {
                (1024, msr - 0xc000_0000)
            } else {
                (0, msr)
            };
            let (byte, bit) = ((index / 8) as usize, index % 8);
            if read {
                m[base + byte] &= !(1 << bit);
            }
            if write {
                m[base + 2048 + byte] &= !(1 << bit);
            }
        };
        // Held in the VMCS guest-state area or switched by the hypervisor (docs/GUEST-ABI.md).
        for msr in [
            0x174,
            0x175,
            0x176,
            IA32_PAT,
            IA32_EFER,
            0xc000_0100,
            0xc000_0101,
        ] {
            pass(msr, true, true);
        }
        for msr in SWITCHED_MSRS {
            pass(msr, true, true);
        }
        pass(0x10, true, false); // IA32_TSC: reads pass, writes exit.
        Some(Bitmaps { io_a, io_b, msr })
    }
}

/// A VMCS field write that must not fail once the controls are checked: a failure is a bug.
fn w<E: core::fmt::Debug>(r: Result<(), VmFail>, what: E) -> Result<(), SetupError> {
    r.map_err(|e| SetupError::Vmwrite(alloc::format!("{what:?}: {e}")))
}

/// Writes the host-state fields that differ between pCPUs (SDM Vol. 3C §25.5.1-25.5.2): TR and
/// its base, GDTR and IDTR bases, and GS base (the per-CPU block), from the CPU this runs on.
/// The selectors of code and data are the same on every pCPU (each GDT has the same layout).
pub fn write_host_cpu_state(v: &mut CurrentVmcs) -> Result<(), SetupError> {
    let cpu = crate::percpu::this();
    let sel = cpu.selectors();
    w(v.write16(Host16::TrSelector, sel.tss), "host TR")?;
    w(
        v.write_natural(HostNatural::TrBase, sel.tss_base),
        "host TR base",
    )?;
    w(v.write16(Host16::GsSelector, 0), "host GS")?;
    w(
        v.write_natural(HostNatural::GsBase, cpu.base()),
        "host GS base",
    )?;
    let gdtr = x86_64::instructions::tables::sgdt();
    let idtr = x86_64::instructions::tables::sidt();
    w(
        v.write_natural(HostNatural::GdtrBase, gdtr.base.as_u64()),
        "host GDTR",
    )?;
    w(
        v.write_natural(HostNatural::IdtrBase, idtr.base.as_u64()),
        "host IDTR",
    )
}

#[derive(Debug)]
pub enum SetupError {
    NoMemory,
    Control { which: &'static str, missing: u32 },
    Vmclear(VmFail),
    Vmptrld(VmFail),
    Vmwrite(alloc::string::String),
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

impl Vcpu {
    /// Creates the VMCS of a vCPU that starts a test guest at `boot`, makes it current and fills
    /// every field VM entry checks.
    pub fn new(
        caps: &VmxCaps,
        bitmaps: &Bitmaps,
        eptp: u64,
        vpid: u16,
        boot: &BootState,
    ) -> Result<(Vcpu, CurrentVmcs), SetupError> {
        let vmcs = crate::memory::alloc_zeroed(PAGE_SIZE, PAGE_SIZE).ok_or(SetupError::NoMemory)?;
        // §25.2: the first 31 bits hold the VMCS revision identifier.
        // SAFETY: a fresh identity-mapped frame, owned by this vCPU.
        unsafe { core::ptr::write_volatile(vmcs as *mut u32, caps.vmcs_revision()) };
        // SAFETY: in VMX root operation (vmx_root::enable ran); the region is prepared (§25.11.3).
        unsafe { instructions::vmclear(vmcs) }.map_err(SetupError::Vmclear)?;
        // SAFETY: as above; the VMCS becomes current on this CPU.
        unsafe { instructions::vmptrld(vmcs) }.map_err(SetupError::Vmptrld)?;
        // SAFETY: VMX root operation on this CPU; the fields written below are the ones §27.2-27.3
        // check, with values built from the capability MSRs.
        let mut v = unsafe { CurrentVmcs::new() };

        // Controls (§25.6-25.8), each adjusted through the (TRUE) capability MSRs (Appendix A.3).
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
            0,
            "primary processor-based",
        )?;
        let proc2 = adjust(
            caps.procbased2(),
            proc2::ENABLE_EPT | proc2::ENABLE_VPID,
            // Not "enable RDTSCP": RDTSCP and RDPID would read the host's IA32_TSC_AUX; without
            // it they are #UD in the guest (SDM Vol. 3C §26.3), and CPUID does not offer them.
            proc2::ENABLE_INVPCID
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
        let real = boot.mode == StartMode::Real16;
        let unrestricted = proc2 & proc2::UNRESTRICTED_GUEST != 0;
        if real && !unrestricted {
            return Err(SetupError::Control {
                which: "secondary processor-based",
                missing: proc2::UNRESTRICTED_GUEST,
            });
        }
        let long_mode = if real { 0 } else { entry_ctl::IA32E_MODE_GUEST };
        let entry = adjust(
            caps.entry(),
            long_mode
                | entry_ctl::LOAD_DEBUG_CONTROLS
                | entry_ctl::LOAD_IA32_PAT
                | entry_ctl::LOAD_IA32_EFER,
            0,
            "VM-entry",
        )?;
        w(v.write32(Control32::PinBasedControls, pin), "pin controls")?;
        w(
            v.write32(Control32::PrimaryProcBasedControls, proc1),
            "primary controls",
        )?;
        w(
            v.write32(Control32::SecondaryProcBasedControls, proc2),
            "secondary controls",
        )?;
        w(v.write32(Control32::ExitControls, exit), "exit controls")?;
        w(v.write32(Control32::EntryControls, entry), "entry controls")?;
        w(v.write32(Control32::ExceptionBitmap, 0), "exception bitmap")?;
        w(v.write32(Control32::PageFaultErrorCodeMask, 0), "#PF mask")?;
        w(
            v.write32(Control32::PageFaultErrorCodeMatch, 0),
            "#PF match",
        )?;
        w(v.write32(Control32::Cr3TargetCount, 0), "CR3 target count")?;
        w(
            v.write32(Control32::ExitMsrStoreCount, 0),
            "exit MSR store count",
        )?;
        w(
            v.write32(Control32::ExitMsrLoadCount, 0),
            "exit MSR load count",
        )?;
        w(
            v.write32(Control32::EntryMsrLoadCount, 0),
            "entry MSR load count",
        )?;
        w(
            v.write32(Control32::EntryInterruptionInfo, 0),
            "entry interruption info",
        )?;
        w(
            v.write64(Control64::IoBitmapA, bitmaps.io_a),
            "I/O bitmap A",
        )?;
        w(
            v.write64(Control64::IoBitmapB, bitmaps.io_b),
            "I/O bitmap B",
        )?;
        w(v.write64(Control64::MsrBitmaps, bitmaps.msr), "MSR bitmap")?;
        w(v.write64(Control64::EptPointer, eptp), "EPTP")?;
        w(v.write16(Control16::Vpid, vpid), "VPID")?;
        w(v.write64(Control64::TscOffset, 0), "TSC offset")?;

        // CR0/CR4 (§25.6.6, Appendix A.7-A.8): the bits VMX fixes are owned by the host (set in
        // the mask) and read by the guest from the shadow as it wrote them.
        let read = |m| msr::read_safe(m).unwrap_or(0);
        let mut cr0_fixed = (
            read(vmsr::IA32_VMX_CR0_FIXED0),
            read(vmsr::IA32_VMX_CR0_FIXED1),
        );
        if unrestricted {
            // With unrestricted guest, CR0.PE and CR0.PG may be 0 (Appendix A.7): the guest owns
            // them.
            cr0_fixed.0 &= !(Cr0Flags::PROTECTED_MODE_ENABLE | Cr0Flags::PAGING).bits();
        }
        let cr4_fixed = (
            read(vmsr::IA32_VMX_CR4_FIXED0),
            read(vmsr::IA32_VMX_CR4_FIXED1),
        );
        let (guest_cr0, guest_cr4) = if real {
            // ET | NE: real mode, no paging.
            (0x30u64, 0u64)
        } else {
            // PE | MP | ET | NE | WP | PG; PAE | OSFXSR | OSXMMEXCPT.
            (0x8001_0033u64, 0x0620u64)
        };
        let vcpu = Vcpu {
            vmcs,
            regs: GuestRegisters {
                rdi: boot.rdi,
                rsi: boot.rsi,
                ..GuestRegisters::default()
            },
            launched: false,
            fpu: FpuState::initial(),
            // DR6's reserved bits read as 1 (SDM Vol. 3B §19.2.3).
            debug: [0, 0, 0, 0, 0xffff_0ff0],
            cr8: 0,
            msrs: [0; SWITCHED_MSRS.len()],
            vpid,
            cr0_fixed,
            cr4_fixed,
            last_exit: 0xffff,
            wake_at: None,
            index: 0,
            stats: ExitStats::default(),
            host_cpu: Some(crate::percpu::index()),
            last_cpu: None,
            proc1,
            interrupts_injected: 0,
            last_task: None,
            tlb: hvprof_hypervisor::profiler::guest_walk::Tlb::new(),
        };
        w(
            v.write_natural(ControlNatural::Cr0GuestHostMask, cr0_fixed.0 | !cr0_fixed.1),
            "CR0 mask",
        )?;
        w(
            v.write_natural(ControlNatural::Cr0ReadShadow, guest_cr0),
            "CR0 shadow",
        )?;
        w(
            v.write_natural(ControlNatural::Cr4GuestHostMask, cr4_fixed.0 | !cr4_fixed.1),
            "CR4 mask",
        )?;
        w(
            v.write_natural(ControlNatural::Cr4ReadShadow, guest_cr4),
            "CR4 shadow",
        )?;
        w(
            v.write_natural(GuestNatural::Cr0, vcpu.force_cr0(guest_cr0)),
            "guest CR0",
        )?;
        w(
            v.write_natural(GuestNatural::Cr4, vcpu.force_cr4(guest_cr4)),
            "guest CR4",
        )?;
        w(v.write_natural(GuestNatural::Cr3, boot.cr3), "guest CR3")?;

        // Host state (§25.5, checked by §27.2.2-27.2.4).
        w(
            v.write_natural(HostNatural::Cr0, Cr0::read_raw()),
            "host CR0",
        )?;
        w(
            v.write_natural(HostNatural::Cr3, Cr3::read_raw().0.start_address().as_u64()),
            "host CR3",
        )?;
        w(
            v.write_natural(HostNatural::Cr4, Cr4::read_raw()),
            "host CR4",
        )?;
        let sel = crate::percpu::this().selectors();
        w(v.write16(Host16::CsSelector, sel.code), "host CS")?;
        for f in [Host16::SsSelector, Host16::DsSelector, Host16::EsSelector] {
            w(v.write16(f, sel.data), f)?;
        }
        w(v.write16(Host16::FsSelector, 0), "host FS")?;
        w(v.write_natural(HostNatural::FsBase, 0), "host FS base")?;
        write_host_cpu_state(&mut v)?;
        w(v.write32(Host32::Ia32SysenterCs, 0), "host SYSENTER_CS")?;
        w(
            v.write_natural(HostNatural::Ia32SysenterEsp, 0),
            "host SYSENTER_ESP",
        )?;
        w(
            v.write_natural(HostNatural::Ia32SysenterEip, 0),
            "host SYSENTER_EIP",
        )?;
        w(v.write64(Host64::Ia32Pat, read(IA32_PAT)), "host PAT")?;
        w(v.write64(Host64::Ia32Efer, read(IA32_EFER)), "host EFER")?;
        w(
            v.write_natural(
                HostNatural::Rip,
                entry::vmx_exit_landing as *const () as u64,
            ),
            "host RIP",
        )?;

        // Guest state (§25.4, checked by §27.3.1): 64-bit mode as docs/GUEST-ABI.md describes,
        // or real mode (selectors 0, bases 0, 64 KiB limits) for a flat image.
        let (code_sel, data_sel, limit, code_ar, data_ar) = if real {
            (0, 0, 0xffff, 0x9b, 0x93)
        } else {
            (
                boot.code_selector,
                boot.data_selector,
                0xffff_ffff,
                guest_image::CODE_ACCESS_RIGHTS,
                guest_image::DATA_ACCESS_RIGHTS,
            )
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
        // LME | LMA, and NXE where the CPU has it (CPUID.80000001H:EDX.NX[bit 20]).
        let nx = raw_cpuid::CpuId::new()
            .get_extended_processor_and_feature_identifiers()
            .is_some_and(|f| f.has_execute_disable());
        let efer = if real {
            0
        } else {
            0x500 | if nx { 0x800 } else { 0 }
        };
        w(v.write64(Guest64::Ia32Efer, efer), "guest EFER")?;
        w(
            v.write32(Guest32::PreemptionTimerValue, u32::MAX),
            "preemption timer",
        )?;
        Ok((vcpu, v))
    }

    /// The CR0 value the CPU runs the guest with for a guest-visible `cr0`.
    pub fn force_cr0(&self, cr0: u64) -> u64 {
        (cr0 | self.cr0_fixed.0) & self.cr0_fixed.1
    }
    pub fn force_cr4(&self, cr4: u64) -> u64 {
        (cr4 | self.cr4_fixed.0) & self.cr4_fixed.1
    }

    /// Puts this vCPU's FPU state (and XCR0) and switched MSRs on the CPU (before it runs).
    pub fn load_state(&self) {
        self.fpu.load();
        // SAFETY: writing DR0-DR3 and DR6 arms nothing by itself: DR7 decides what the
        // breakpoints do, and the hypervisor runs with DR7 = 0x400 (a VM exit loads that value,
        // SDM Vol. 3C §28.5.1), the guest with its own DR7 from the VMCS.
        unsafe {
            core::arch::asm!(
                "mov dr0, {}", "mov dr1, {}", "mov dr2, {}", "mov dr3, {}", "mov dr6, {}",
                in(reg) self.debug[0], in(reg) self.debug[1], in(reg) self.debug[2],
                in(reg) self.debug[3], in(reg) self.debug[4], options(nostack, nomem)
            )
        };
        for (m, v) in SWITCHED_MSRS.iter().zip(self.msrs) {
            // SAFETY: these MSRs only matter to code running in the guest (syscall entry,
            // SWAPGS); the hypervisor uses none of them.
            let _ = unsafe { msr::write_safe(*m, v) };
        }
    }

    /// Takes this vCPU's FPU state and switched MSRs off the CPU (after it ran).
    pub fn save_state(&mut self) {
        self.fpu.save();
        let d = &mut self.debug;
        // SAFETY: reading debug registers has no effect.
        unsafe {
            core::arch::asm!(
                "mov {}, dr0", "mov {}, dr1", "mov {}, dr2", "mov {}, dr3", "mov {}, dr6",
                out(reg) d[0], out(reg) d[1], out(reg) d[2], out(reg) d[3], out(reg) d[4],
                options(nostack, nomem)
            )
        };
        for (m, v) in SWITCHED_MSRS.iter().zip(self.msrs.iter_mut()) {
            *v = msr::read_safe(*m).unwrap_or(0);
        }
    }
}
