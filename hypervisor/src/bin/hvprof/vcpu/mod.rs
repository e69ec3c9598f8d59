//! A virtual CPU: its VMCS, set up for a 64-bit test guest under EPT with VPID (Intel SDM Vol. 3C
//! chapter 25, "Virtual-Machine Control Structures", and §27.2-27.3, the checks VM entry makes),
//! its general-purpose registers (saved by the entry/exit stub) and its FPU state.

pub mod entry;
pub mod fpu;
pub mod guest_ops;

use crate::arch::msr;
use fpu::FpuState;
use hvprof_boot::memory::PAGE_SIZE;
use hvprof_hypervisor::guest_image::BootState;
use hvprof_hypervisor::vmcs_setup::{
    self, ControlTargets, Controls, FixedCrs, HostState, SetupError,
};
use hvprof_samplelog::ExitStats;
use hvprof_vmx::caps::{VmxCaps, msr as vmsr};
use hvprof_vmx::errors::VmFail;
use hvprof_vmx::instructions::{self, CurrentVmcs};
use hvprof_vmx::regs::GuestRegisters;
use hvprof_vmx::vmcs::{Host16, HostNatural, VmcsExt};
use x86_64::registers::control::{Cr0, Cr3, Cr4};

pub const IA32_PAT: u32 = 0x277;
pub const IA32_EFER: u32 = 0xc000_0080;

/// MSRs that VMX does not switch and the guest may use freely (docs/GUEST-ABI.md): the syscall
/// MSRs and KERNEL_GS_BASE. The hypervisor never uses them, so they are switched only when the
/// CPU changes vCPU.
pub const SWITCHED_MSRS: [u32; 6] = [
    0xc000_0081, // IA32_STAR
    0xc000_0082, // IA32_LSTAR
    0xc000_0083, // IA32_CSTAR
    0xc000_0084, // IA32_FMASK
    0xc000_0102, // IA32_KERNEL_GS_BASE
    0xc000_0103, // IA32_TSC_AUX (RDTSCP, RDPID)
];
/// Where IA32_LSTAR (the guest kernel's system-call entry) sits in `SWITCHED_MSRS` and
/// `Vcpu::msrs`.
pub const LSTAR_SLOT: usize = 1;
const _: () = assert!(SWITCHED_MSRS[LSTAR_SLOT] == 0xc000_0082);

/// IA32_MISC_ENABLE at reset: fast strings enabled; branch trace and PEBS unavailable (SDM
/// Vol. 4, Table 2-2). `vmexit::msr` says which bits the guest may change.
pub const MISC_ENABLE_RESET: u64 = 1 | 1 << 11 | 1 << 12;

/// An empty `Vcpu::settled_range`.
pub const NO_RANGE: (u64, u64) = (0, 0);

pub struct Vcpu {
    /// Host-physical address of the VMCS region.
    pub vmcs: u64,
    pub regs: GuestRegisters,
    pub launched: bool,
    /// Its x87/SSE/AVX state and XCR0.
    pub fpu: FpuState,
    /// DR0-DR3 and DR6, which VMX does not switch (DR7 is in the VMCS).
    pub debug: [u64; 5],
    /// Host address of its virtual-APIC page, with the CPU's APIC virtualization (0: none;
    /// `virtual_apic.rs`).
    pub virtual_apic: u64,
    /// The local APIC's `generation` the page's other registers were written at.
    pub apic_generation: u64,
    /// Its local APIC's TPR, IRR and ISR are the CPU's (handed over at the last entry).
    pub apic_handed: bool,
    /// Its task-priority register (CR8: MOV to and from CR8 exit, the physical TPR stays the
    /// hypervisor's).
    pub cr8: u64,
    /// Its TSC offset and IA32_TSC_ADJUST (`hvprof_hypervisor::guest_tsc`).
    pub tsc: hvprof_hypervisor::guest_tsc::GuestTsc,
    /// IA32_MISC_ENABLE as it wrote it (`vmexit::msr`).
    pub misc_enable: u64,
    pub msrs: [u64; SWITCHED_MSRS.len()],
    pub vpid: u16,
    /// Bits the guest may not change in CR0/CR4 and their forced values (SDM Vol. 3C §25.6.6).
    pub fixed: FixedCrs,
    /// The last VM-exit basic reason (0xffff before the first).
    pub last_exit: u16,
    /// The TSC at which the virtual timer (SET_TIMER hypercall) wakes it from HLT.
    pub wake_at: Option<u64>,
    /// Its number in its VM.
    pub index: u16,
    /// Its exits (the VM's table adds up its vCPUs').
    pub stats: ExitStats,
    /// Where its pause-loop exits were (`ple=`).
    pub spins: hvprof_hypervisor::spin_sites::SpinSites,
    /// The pCPU whose host state the VMCS holds, and on which the VMCS is active (not cleared).
    pub host_cpu: Option<usize>,
    /// The pCPU it ran on last (to flush its VPID's stale translations when it moves).
    pub last_cpu: Option<usize>,
    /// The primary processor-based controls as set up (the interrupt-window bit toggles).
    pub proc1: u32,
    /// Virtual interrupts injected (`interrupts::before_entry`).
    pub interrupts_injected: u64,
    /// NMIs injected (NMI IPIs).
    pub nmis_injected: u64,
    /// Accesses to its local APIC's registers (`apic=on`), each an EPT violation.
    pub apic_accesses: u64,
    /// An application processor of a VM with local APICs: it waits for a start-up IPI and then
    /// starts in real mode at its vector (SDM Vol. 3A, "MP Initialization Protocol").
    pub wait_for_sipi: bool,
    /// Started by a SIPI and not yet in 64-bit mode: the VM-entry control "IA-32e mode guest"
    /// follows the guest's EFER.LMA (set by the guest's own CR0.PG write, which does not exit).
    pub mode_switching: bool,
    /// The Linux task seen at its last sample: its address and ids, the address space (CR3
    /// without its flag bits), its name, and whether that name is settled (`guest_walk::name_state`:
    /// while an exec may be under way the name is read again at the next sample).
    pub last_task: Option<(
        hvprof_hypervisor::profiler::guest_walk::TaskIds,
        u64,
        [u8; 16],
        hvprof_hypervisor::profiler::guest_walk::NameState,
    )>,
    /// That task as the next sample checks it (`guest_walk::SameTask`: with its name's two words
    /// while the name is not settled; `None`: the next sample reads the task in full).
    pub same_task: Option<
        hvprof_hypervisor::profiler::guest_walk::SameTask<hvprof_hypervisor::guest_ram::RamWord>,
    >,
    /// The process of that task in its VM's table of process maps (`None` before the first
    /// task, for a VM without `mm-layout=`, or when the table is full).
    pub maps_process: Option<hvprof_hypervisor::profiler::guest_maps::ProcessIndex>,
    /// A known executable range of that process where it waits for no build id
    /// (`ProcessMaps::settled_range`), `[start, end)`: its user-mode samples there need no look
    /// at the table. Empty (`NO_RANGE`) when there is none: the sample path's test is then the
    /// same two compares.
    pub settled_range: (u64, u64),
    /// Its guest's kernel-page translations, for reading the task at samples.
    pub tlb: hvprof_hypervisor::profiler::guest_walk::Tlb,
    /// A CR3's address space to the task check and the process table
    /// (`guest_walk::space_mask`: without bit 12 once the VM is found isolating its page
    /// tables).
    pub space_mask: u64,
    /// Its virtual PMU (`vpmu=`; `hvprof_hypervisor::vcpu_pmu`, driven by `vm/vpmu.rs`).
    pub pmu: Option<hvprof_hypervisor::vcpu_pmu::VcpuPmu>,
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
        let controls = Controls::new(caps, boot.mode.legacy())?;
        vmcs_setup::write_controls(
            &mut v,
            &controls,
            &ControlTargets {
                io_bitmap_a: bitmaps.io_a,
                io_bitmap_b: bitmaps.io_b,
                msr_bitmap: bitmaps.msr,
                eptp,
                vpid,
            },
        )?;
        let read = |m| msr::read_safe(m).unwrap_or(0);
        let fixed = FixedCrs::new(
            (
                read(vmsr::IA32_VMX_CR0_FIXED0),
                read(vmsr::IA32_VMX_CR0_FIXED1),
            ),
            (
                read(vmsr::IA32_VMX_CR4_FIXED0),
                read(vmsr::IA32_VMX_CR4_FIXED1),
            ),
            controls.unrestricted(),
        );
        vmcs_setup::write_control_registers(&mut v, &fixed, boot.mode, boot.cr3)?;
        let sel = crate::percpu::this().selectors();
        vmcs_setup::write_host_state(
            &mut v,
            &HostState {
                cr0: Cr0::read_raw(),
                cr3: Cr3::read_raw().0.start_address().as_u64(),
                cr4: Cr4::read_raw(),
                code_selector: sel.code,
                data_selector: sel.data,
                pat: read(IA32_PAT),
                efer: read(IA32_EFER),
                rip: entry::vmx_exit_landing as *const () as u64,
            },
        )?;
        write_host_cpu_state(&mut v)?;
        // CPUID.80000001H:EDX.NX[bit 20]: the guest's EFER.NXE where the CPU has it.
        let nx = raw_cpuid::CpuId::new()
            .get_extended_processor_and_feature_identifiers()
            .is_some_and(|f| f.has_execute_disable());
        vmcs_setup::write_guest_state(&mut v, boot, nx)?;
        let vcpu = Vcpu {
            vmcs,
            regs: GuestRegisters {
                rax: boot.rax,
                rbx: boot.rbx,
                rdi: boot.rdi,
                rsi: boot.rsi,
                ..GuestRegisters::default()
            },
            launched: false,
            fpu: FpuState::initial(),
            // DR6's reserved bits read as 1 (SDM Vol. 3B §19.2.3).
            debug: [0, 0, 0, 0, 0xffff_0ff0],
            virtual_apic: 0,
            apic_generation: 0,
            apic_handed: false,
            cr8: 0,
            tsc: hvprof_hypervisor::guest_tsc::GuestTsc::default(),
            misc_enable: MISC_ENABLE_RESET,
            msrs: [0; SWITCHED_MSRS.len()],
            vpid,
            fixed,
            last_exit: 0xffff,
            wake_at: None,
            index: 0,
            stats: ExitStats::default(),
            spins: hvprof_hypervisor::spin_sites::SpinSites::new(),
            host_cpu: Some(crate::percpu::index()),
            last_cpu: None,
            proc1: controls.proc1,
            interrupts_injected: 0,
            nmis_injected: 0,
            apic_accesses: 0,
            wait_for_sipi: false,
            mode_switching: false,
            last_task: None,
            same_task: None,
            maps_process: None,
            settled_range: NO_RANGE,
            tlb: hvprof_hypervisor::profiler::guest_walk::Tlb::new(),
            space_mask: hvprof_hypervisor::profiler::guest_walk::space_mask(false),
            pmu: None,
        };
        Ok((vcpu, v))
    }

    /// The CR0 value the CPU runs the guest with for a guest-visible `cr0`.
    pub fn force_cr0(&self, cr0: u64) -> u64 {
        self.fixed.force_cr0(cr0)
    }
    pub fn force_cr4(&self, cr4: u64) -> u64 {
        self.fixed.force_cr4(cr4)
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
            // SWAPGS, RDTSCP); the hypervisor uses none of them.
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
