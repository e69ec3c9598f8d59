//! Virtual machines: each owns its memory (taken from the frame allocator, never shared), its EPT
//! and its vCPUs. This module is the VM model; the flow runs one way through its submodules:
//! `build` makes the VMs from the boot modules on the boot CPU, then the scheduler of every pCPU
//! runs their vCPUs (`run::run_slice`, several pCPUs at once), which hands each VM exit to
//! `crate::vmexit`; `virtual_interrupts` delivers a Linux guest's device interrupts, and `report`
//! prints why a VM stopped and its exit statistics.
//!
//! What several pCPUs share is split by who may touch it: a vCPU (registers, VMCS, exit
//! statistics) is locked by the pCPU running it; the VM's console and once-only logs are behind
//! their own lock, taken only by the exits that use them; the rest is fixed after `build` or
//! atomic.

pub mod apic_bus;
pub mod build;
pub mod linux_tasks;
pub mod pause_loop;
pub mod report;
pub mod virtual_apic;
pub mod virtual_interrupts;
pub mod vpmu;

use crate::memory;
use crate::vcpu::Vcpu;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt::{self, Write};
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use hvprof_ept::{Ept, FrameSource, PhysMem};
use hvprof_hypervisor::devices::board::Board;
use hvprof_hypervisor::guest_ram::GuestRam;
use hvprof_hypervisor::rate::TokenBucket;
use hvprof_hypervisor::vm_config::Pins;
use hvprof_samplelog::TaskOffsets;
use spin::Mutex;

/// Host-physical memory as the EPT builder sees it: identity-mapped, frames from the allocator.
pub struct HostPhys;

impl FrameSource for HostPhys {
    fn alloc_zeroed_frame(&mut self) -> Option<u64> {
        memory::alloc_zeroed(4096, 4096)
    }
}

impl PhysMem for HostPhys {
    fn read_u64(&self, hpa: u64) -> u64 {
        // SAFETY: the EPT builder only reads its own table frames, which came from
        // `alloc_zeroed_frame` and are identity-mapped and 8-byte aligned.
        unsafe { core::ptr::read_volatile(hpa as *const u64) }
    }
    fn write_u64(&mut self, hpa: u64, v: u64) {
        // SAFETY: as for `read_u64`: only its own table frames.
        unsafe { core::ptr::write_volatile(hpa as *mut u64, v) }
    }
}

/// A vCPU's two EPTs for telling its privilege modes apart (`vm/vpmu.rs`, which makes and
/// changes them): the VM's mappings without execute permission, but on the pages run in that
/// mode.
pub struct ModeEpts {
    pub(crate) user: Ept<HostPhys>,
    pub(crate) kernel: Ept<HostPhys>,
    /// INVEPT's single-context type exists (else all-context).
    pub(crate) single: bool,
    /// Code pages learned, and changes of mode, so far.
    pub pages: u64,
    pub switches: u64,
}

/// Why a VM stopped.
pub enum Stop {
    /// The guest asked: exit port 0xf4 or the EXIT hypercall.
    Exited { code: u8, how: &'static str },
    /// The guest did something it may not: the report says what.
    Fault(String),
    /// The run budget ran out.
    Budget,
    /// The wall budget ran out (the VM was started that long ago, running or not).
    WallBudget,
    /// The vCPU halted with nothing that could ever wake it.
    HaltedForever,
    /// Another vCPU stopped the whole VM (that vCPU's stop is the VM's).
    WithVm,
}

/// What an attack guest aims at, and the checksum of that host page before it ran.
pub struct AttackTarget {
    pub hpa: u64,
    pub what: String,
    pub checksum: Option<u64>,
}

pub struct Vm {
    /// Index in the VM table of the sample log's header.
    pub index: u16,
    pub name: String,
    pub mem_hpa: u64,
    pub mem_size: u64,
    pub ept: Ept<HostPhys>,
    /// Its vCPUs, each locked by the pCPU that runs it.
    pub vcpus: Vec<Mutex<Vcpu>>,
    /// `pin=`: the pCPU of each vCPU, or free to move.
    pub pin: Option<Pins>,
    /// A Linux guest (booted from a bzImage): its CPUID, MSR and device policy.
    pub linux: bool,
    /// A whole machine's guest (Linux, or a Multiboot kernel): one vCPU's exit (port 0xf4,
    /// ACPI power-off) ends the VM, as it ends a PC; a test guest's vCPUs exit one by one.
    pub machine_exit: bool,
    /// Where its running task sits (`task-offsets=`), to name guest processes in samples.
    pub task_offsets: Option<TaskOffsets>,
    /// Where its processes' memory maps are (`mm-layout=`), to name the files they run.
    pub mm_layout: Option<hvprof_linux_walk::MmLayout>,
    /// Where its kernel's module list is (`module-layout=`).
    pub module_layout: Option<hvprof_linux_walk::ModuleLayout>,
    /// Where its kernel's ORC tables are (`orc-layout=`), to walk its kernel call chains.
    pub orc_layout: Option<hvprof_linux_walk::OrcLayout>,
    /// A local APIC per vCPU, the I/O APIC, ACPI PM1 and ACPI tables (`apic=on`).
    pub apic: bool,
    /// `ple=`: what a PAUSE loop does (`Off` also where the CPU has no pause-loop exiting).
    pub ple: hvprof_hypervisor::vm_config::Ple,
    /// Host address of its APIC-access page, where EPT maps the guest's xAPIC page, when its
    /// vCPUs use the CPU's APIC virtualization (`vm/virtual_apic.rs`); 0: every APIC access
    /// is an EPT violation, emulated.
    pub apic_access: u64,
    /// Host address of pc-testdev's 64 KiB of memory (`testdev=on`; `devices::testdev::IOMEM`),
    /// or 0.
    pub testdev_memory: u64,
    /// The CPU stores instruction information for INS/OUTS exits (IA32_VMX_BASIC[54]), which
    /// string I/O needs (`vmexit/string_io.rs`).
    pub ins_outs_info: bool,
    /// Bit i: something another vCPU sent vCPU i (an IPI, a SIPI) that its run loop or, while
    /// it halts or waits for a SIPI, the scheduler must look at.
    pub kicks: AtomicU64,
    /// Per vCPU: the pCPU that runs it now (`run_slice` sets it for the slice), or `NOT_RUNNING`.
    pub running_on: Vec<core::sync::atomic::AtomicU8>,
    /// Per vCPU: a start-up IPI's vector waiting to start it (`SIPI_PENDING | vector`), or 0.
    pub sipi: Vec<core::sync::atomic::AtomicU16>,
    /// Unwind tables of its programs built without frame pointers (`unwind=`).
    pub unwind: &'static [hvprof_linux_walk::UnwindTable<'static>],
    /// Per vCPU: its two EPTs for telling its privilege modes apart, made when its virtual PMU
    /// first needs them (`vm/vpmu.rs`).
    pub mode_epts: Vec<Mutex<Option<ModeEpts>>>,
    /// Its processes' executable file mappings, read once per process, sent at the end.
    pub maps: Mutex<hvprof_hypervisor::profiler::guest_maps::ProcessMaps>,
    /// What its programs hand over through the output leaf (`output=`), sent at the end.
    pub output: Option<Mutex<hvprof_hypervisor::output_store::OutputStore>>,
    /// Its legacy devices (the UART, the PICs, the PIT, the CMOS clock) and the once-only logs.
    pub devices: Mutex<VmDevices>,
    /// Its share of the console: the guest's lines and the hypervisor's lines about it that the
    /// guest can cause (`vm_report!`). A leaf lock: taken under `devices`, never the other way.
    pub console: Mutex<GuestConsole>,
    pub budget: u64,
    /// `wall-budget=`: how long after its start the VM is stopped, running or not.
    pub wall_budget: u64,
    /// The TSC at which the wall budget runs out (`u64::MAX` before the scheduler starts it).
    pub wall_deadline: AtomicU64,
    pub target: Option<AttackTarget>,
    /// TSC ticks its vCPUs ran, added up at the end of each slice.
    pub run_ticks: AtomicU64,
    /// The whole VM stops: its other vCPUs stop before their next VM entry.
    pub stopping: AtomicBool,
    /// Whether a Linux guest isolates its page tables (KPTI), once a user-mode sample's CR3 told
    /// (`guest_walk::isolation_shown`): then a user-mode CR3 is the user PGD of a pair, the
    /// same address space as the kernel's PGD below it (`guest_walk::space_mask`).
    pub isolation: spin::Once<bool>,
    /// The module's image name and its GNU build id (for the sample log's VM table).
    pub image: String,
    pub build_id: Vec<u8>,
}

/// What the VM's exits reach, under `Vm::devices`.
pub struct VmDevices {
    pub board: Board,
    /// Each vCPU's local APIC, by vCPU index (`apic=on`; empty otherwise).
    pub lapics: Vec<hvprof_hypervisor::devices::lapic::Lapic>,
    /// The ACPI PM1a blocks (`apic=on`, which brings ACPI tables).
    pub pm: hvprof_hypervisor::devices::acpi_pm::AcpiPm,
    /// QEMU's firmware configuration ports: the VM's vCPUs and memory.
    pub fw_cfg: hvprof_hypervisor::devices::fw_cfg::FwCfg,
    /// QEMU's pc-testdev (`testdev=on`).
    pub testdev: Option<hvprof_hypervisor::devices::testdev::PcTestdev>,
    /// IPIs sent (INITs, SIPIs and NMIs among them; `nmis` counts each target), and the
    /// delivery modes not emulated that were reported.
    pub ipis: u64,
    pub inits: u64,
    pub sipis: u64,
    pub nmis: u64,
    /// Interrupt messages the I/O APIC sent.
    pub io_apic_messages: u64,
    pub logged_ipis: Vec<hvprof_hypervisor::devices::lapic::Delivery>,
    /// MSRs and ports already reported once.
    logged_msrs: Vec<u32>,
    logged_ports: Vec<u16>,
}

/// A VM's share of the console line: its output is queued (never waited for) and limited to the
/// line's rate with a burst of `GuestConsole::BURST` bytes; what is over is dropped and counted.
pub struct GuestConsole {
    bucket: TokenBucket,
    /// The rate of the hypervisor's lines about the VM that its guest can cause (`vm_report!`),
    /// in lines: `REPORT_BURST` at once, then `REPORTS_PER_SECOND`.
    reports: TokenBucket,
    pub lines_dropped: u64,
    pub bytes_dropped: u64,
    /// The hypervisor's lines about the VM (`vm_report!`) over its rate, not printed.
    pub reports_dropped: u64,
}

impl GuestConsole {
    /// Bytes a VM may print at once before the line rate applies.
    pub const BURST: u64 = 8 * 1024;
    /// The console's line rate: 115,200 baud, 10 bits per byte.
    pub const LINE_BYTES_PER_SECOND: u64 = 11_520;
    /// Lines about the VM (`vm_report!`) printed at once before their rate applies, and their
    /// rate: a guest that causes one at every exit gets a few lines a second, not the console.
    pub const REPORT_BURST: u64 = 16;
    pub const REPORTS_PER_SECOND: u64 = 10;

    fn new(tsc_hz: u64, now: u64) -> Self {
        GuestConsole {
            bucket: TokenBucket::new(Self::BURST, tsc_hz / Self::LINE_BYTES_PER_SECOND, now),
            reports: TokenBucket::new(Self::REPORT_BURST, tsc_hz / Self::REPORTS_PER_SECOND, now),
            lines_dropped: 0,
            bytes_dropped: 0,
            reports_dropped: 0,
        }
    }

    /// Queues `[vm] line` (escaped) on the console, or counts it as dropped when the VM is over
    /// its rate or the console queue is full.
    pub fn emit(&mut self, vm: &str, line: &[u8], now: u64) {
        let cost = line.len() as u64 + vm.len() as u64 + 5;
        if !self.bucket.take(cost, now) || crate::console::try_print_guest_line(vm, line).is_err() {
            self.lines_dropped += 1;
            self.bytes_dropped += line.len() as u64;
        }
    }

    /// Queues the hypervisor's line `vm <name>: <text>` about a VM, as `vm_report!` asks,
    /// within the VM's rate of such lines (`REPORT_BURST`, `REPORTS_PER_SECOND`); over it, or
    /// when the console queue is full, it is counted as dropped. Never waits for the console.
    pub fn report(&mut self, vm: &str, text: fmt::Arguments, now: u64) {
        if !self.reports.take(1, now) {
            self.reports_dropped += 1;
            return;
        }
        let mut line = String::new();
        let _ = write!(line, "vm {vm}: {text}");
        if crate::console::try_print_line(&line).is_err() {
            self.reports_dropped += 1;
        }
    }
}

/// A line on the console about VM `vm` that its guest can cause (anything an exit handler or
/// a device model reports): `vm_report!(vm, "format", args...)` prints `vm <name>: ...` within
/// the VM's console rate, never waiting for the console, so that no guest can flood the console
/// or stall another VM's exits through it; what is over the rate is counted and its number
/// printed when the VM stops. Exit handlers print through it only (xtask's `handlers_print`
/// test keeps `println!` out of `vmexit/` and the device paths).
#[macro_export]
macro_rules! vm_report {
    ($vm:expr, $($arg:tt)*) => {
        $vm.report(format_args!($($arg)*))
    };
}

/// `Vm::sipi`'s flags: a SIPI's vector waits (in the low byte); an INIT waits for a vCPU that
/// runs (it goes back to wait-for-SIPI); the vCPU left wait-for-SIPI (later SIPIs are ignored,
/// until an INIT).
const SIPI_PENDING: u16 = 0x100;
const INIT_PENDING: u16 = 0x200;
const STARTED: u16 = 0x400;

/// `Vm::running_on` of a vCPU no pCPU runs.
pub const NOT_RUNNING: u8 = u8::MAX;

/// vCPU `index`'s bit in a VM's kicks.
pub const fn kick_bit(index: usize) -> u64 {
    1 << (index % 64)
}

impl Vm {
    /// It has interrupt controllers whose interrupts the hypervisor delivers (a Linux guest's
    /// 8259 pair and PIT; with `apic=on`, local APICs and the I/O APIC): the run loop looks at
    /// them before VM entries, and its HLT waits for them.
    pub fn delivers_interrupts(&self) -> bool {
        self.linux || self.apic
    }

    /// Tells vCPU `index` that something waits for it (see `kicks`); whether it was not told
    /// already (only then does its pCPU need an interrupt: a guest that sends IPIs in a loop
    /// costs another pCPU one kick per look, not one per IPI).
    pub fn kick(&self, index: usize) -> bool {
        let bit = 1 << (index % 64);
        self.kicks.fetch_or(bit, Ordering::Release) & bit == 0
    }

    /// Tells vCPU `index` that something waits for it (an IPI, an INIT, a SIPI, an interrupt
    /// the I/O APIC routed to it) and makes sure a pCPU looks soon, at the cost of no one else:
    /// the pCPU that runs it now gets a host interrupt (a kick), unless that is this pCPU (its
    /// run loop looks before the next VM entry) or a kick is on its way there already; a vCPU
    /// that no pCPU runs wakes an idle pCPU that may run it (its pinned one, or any), and
    /// otherwise waits for the next pCPU to look at the run queue. No pCPU that runs another
    /// VM's vCPU is ever interrupted for it (docs/SECURITY.md, "Local APIC").
    pub fn notify(&self, index: usize) {
        if !self.kick(index) {
            // Told already and not looked yet: the kick that told it is on its way.
            return;
        }
        match self.running_on(index) {
            Some(cpu) => crate::profiler::sampler::kick_cpu(cpu),
            None => {
                let pin = self
                    .pin
                    .as_ref()
                    .and_then(|p| p.get(index))
                    .map(usize::from);
                if let Some(cpu) = crate::profiler::sampler::idle_cpu_for(pin) {
                    crate::profiler::sampler::kick_cpu(cpu);
                }
            }
        }
    }

    /// The pCPU that runs vCPU `index` now, if any.
    pub fn running_on(&self, index: usize) -> Option<usize> {
        self.running_on
            .get(index)
            .map(|r| r.load(Ordering::Acquire))
            .filter(|&c| c != NOT_RUNNING)
            .map(usize::from)
    }

    /// Records that pCPU `cpu` runs vCPU `index` from now on (`None`: it stopped running it).
    pub fn set_running_on(&self, index: usize, cpu: Option<usize>) {
        if let Some(r) = self.running_on.get(index) {
            r.store(
                cpu.map_or(NOT_RUNNING, |c| c.min(usize::from(NOT_RUNNING - 1)) as u8),
                Ordering::Release,
            );
        }
    }

    /// Whether something waits for vCPU `index` (an IPI, an interrupt; see `kicks`) that its run
    /// loop has not looked at yet; the kick stays.
    pub fn kicked(&self, index: usize) -> bool {
        self.kicks.load(Ordering::Relaxed) & kick_bit(index) != 0
    }

    /// Whether vCPU `index` was kicked since the last call (and clears it).
    pub fn take_kick(&self, index: usize) -> bool {
        self.take_kicks(kick_bit(index))
    }

    /// Whether a vCPU of `bits` (`kick_bit`s; none: never) was kicked since the last call (and
    /// clears it): the run loop's `take_kick`, with its vCPU's bit made once per slice.
    #[inline(always)]
    pub fn take_kicks(&self, bits: u64) -> bool {
        self.kicks.load(Ordering::Relaxed) & bits != 0
            && self.kicks.fetch_and(!bits, Ordering::Acquire) & bits != 0
    }

    /// A SIPI with `vector` for vCPU `index` (the first one counts: SDM Vol. 3A, a processor
    /// that has left wait-for-SIPI ignores the second).
    pub fn send_sipi(&self, index: usize, vector: u8) {
        if let Some(s) = self.sipi.get(index) {
            let _ = s.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |v| {
                (v & (STARTED | SIPI_PENDING) == 0).then_some(v | SIPI_PENDING | u16::from(vector))
            });
            self.notify(index);
        }
    }

    /// An INIT for vCPU `index` (SDM Vol. 3A §11.6.1, delivery mode 101B): one that runs goes
    /// back to wait-for-SIPI at its next look (`take_init`), and the next SIPI starts it again.
    pub fn send_init(&self, index: usize) {
        if let Some(s) = self.sipi.get(index) {
            s.store(INIT_PENDING, Ordering::Release);
            self.notify(index);
        }
    }

    /// Whether an INIT waits for vCPU `index` (and clears it; a SIPI after it stays).
    pub fn take_init(&self, index: usize) -> bool {
        self.sipi.get(index).is_some_and(|s| {
            s.load(Ordering::Relaxed) & INIT_PENDING != 0
                && s.fetch_and(!INIT_PENDING, Ordering::AcqRel) & INIT_PENDING != 0
        })
    }

    /// Whether a SIPI waits for vCPU `index`.
    pub fn sipi_pending(&self, index: usize) -> bool {
        self.sipi
            .get(index)
            .is_some_and(|s| s.load(Ordering::Acquire) & SIPI_PENDING != 0)
    }

    /// The vector of the SIPI waiting for vCPU `index`, taken (later ones are then ignored
    /// until an INIT; an INIT before it is done with).
    pub fn take_sipi(&self, index: usize) -> Option<u8> {
        let s = self.sipi.get(index)?;
        let v = s
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |v| {
                (v & SIPI_PENDING != 0).then_some(STARTED)
            })
            .ok()?;
        Some(v as u8)
    }
}

/// The CMOS clock of every VM starts at 2026-01-01 00:00:00 UTC (runs are reproducible).
pub const CLOCK_START: u64 = 1_767_225_600;

impl Vm {
    /// Copies guest-physical `[gpa, gpa + buf.len())` into `buf`; false if it is not all guest
    /// memory.
    pub fn read_guest(&self, gpa: u64, buf: &mut [u8]) -> bool {
        self.ram().read(gpa, buf)
    }

    /// The 8 bytes at guest-physical `gpa` (little-endian), or `None` outside guest memory.
    #[inline]
    pub fn read_guest_u64(&self, gpa: u64) -> Option<u64> {
        self.ram().read_u64(gpa)
    }

    /// Its memory, as the hypervisor reads it.
    pub fn ram(&self) -> GuestRam {
        // SAFETY: `[mem_hpa, mem_hpa + mem_size)` is this VM's memory, taken from the frame
        // allocator for it alone, identity-mapped and never freed (the VM's EPT maps the same
        // range, so a read through it is a read of the VM's own memory and nothing else).
        unsafe { GuestRam::new(self.mem_hpa, self.mem_size) }
    }

    /// `vm_report!`'s work: a line about this VM, within its console rate.
    pub fn report(&self, text: fmt::Arguments) {
        self.console
            .lock()
            .report(&self.name, text, crate::tsc::rdtsc());
    }

    /// Logs `what` the first time `msr` is seen.
    pub fn log_msr_once(&self, msr: u32, what: &str) {
        if first_time(&mut self.devices.lock().logged_msrs, msr) {
            crate::vm_report!(self, "{what} MSR {msr:#x}: #GP injected (reported once)");
        }
    }

    pub fn log_port_once(&self, port: u16, write: bool) {
        if first_time(&mut self.devices.lock().logged_ports, port) {
            let access = if write { "write to" } else { "read from" };
            crate::vm_report!(
                self,
                "{access} unhandled I/O port {port:#x} (reads all ones, writes dropped; reported once)"
            );
        }
    }
}

/// Whether `item` is reported for the first time (and notes it in `seen`): each once, and at most
/// `REPORTED_ONCE_MAX` of a kind per VM, so that a guest that tries every MSR or port fills no
/// memory.
pub fn first_time<T: PartialEq>(seen: &mut Vec<T>, item: T) -> bool {
    let first = !seen.contains(&item) && seen.len() < REPORTED_ONCE_MAX;
    if first {
        seen.push(item);
    }
    first
}

/// The most items of a kind reported once per VM (`first_time`).
const REPORTED_ONCE_MAX: usize = 64;

/// FNV-1a over the 4 KiB host page at `hpa` (RAM only).
pub fn page_checksum(hpa: u64) -> u64 {
    // SAFETY: called only for pages of RAM the hypervisor owns (its image, a VM's memory), all
    // identity-mapped; read-only.
    let page = unsafe { core::slice::from_raw_parts((hpa & !0xfff) as *const u8, 4096) };
    page.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}
