//! Virtual machines: each owns its memory (taken from the frame allocator, never shared), its EPT
//! and its vCPUs. VMs are built from the boot modules on the boot CPU; then the scheduler of every
//! pCPU runs their vCPUs (`run_slice`), several pCPUs at once.
//!
//! What several pCPUs share is split by who may touch it: a vCPU (registers, VMCS, exit
//! statistics) is locked by the pCPU running it; the VM's console and once-only logs are behind
//! their own lock, taken only by the exits that use them; the rest is fixed after `build` or
//! atomic.

use crate::tsc::rdtsc;
use crate::vcpu::{Bitmaps, Vcpu};
use crate::{memory, print, println, profiler, vmexit};
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use hvprof_boot::info::ModuleTag;
use hvprof_ept::{Ept, EptCaps, FrameSource, MemoryType, PageSizes, Permissions, PhysMem};
use hvprof_hypervisor::devices::board::Board;
use hvprof_hypervisor::exit_stats::ExitStats;
use hvprof_hypervisor::guest_walk::{self, TaskOffsets};
use hvprof_hypervisor::rate::TokenBucket;
use hvprof_hypervisor::vm_config::Pins;
use hvprof_hypervisor::vm_config::{self, MEM_GRANULE, Target};
use hvprof_hypervisor::{guest_image, linux_boot};
use hvprof_vmx::caps::{VmxCaps, ept_cap};
use hvprof_vmx::exit::BasicExit;
use hvprof_vmx::instructions::{self, CurrentVmcs};
use hvprof_vmx::vmcs::{Guest32, VmcsExt};
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
    /// Where its running task sits (`task-offsets=`), to name guest processes in samples.
    pub task_offsets: Option<TaskOffsets>,
    /// Its legacy devices (the UART, the PICs, the PIT, the CMOS clock) and the once-only logs.
    pub devices: Mutex<VmDevices>,
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
    /// The module's image name and its GNU build id (for the sample log's VM table).
    pub image: String,
    pub build_id: Vec<u8>,
}

/// What the VM's exits reach, under `Vm::devices`.
pub struct VmDevices {
    pub board: Board,
    /// Its lines on the hypervisor's console.
    pub console: GuestConsole,
    /// MSRs and ports already reported once.
    logged_msrs: Vec<u32>,
    logged_ports: Vec<u16>,
}

/// A VM's share of the console line: its output is queued (never waited for) and limited to the
/// line's rate with a burst of `GuestConsole::BURST` bytes; what is over is dropped and counted.
pub struct GuestConsole {
    bucket: TokenBucket,
    pub lines_dropped: u64,
    pub bytes_dropped: u64,
}

impl GuestConsole {
    /// Bytes a VM may print at once before the line rate applies.
    pub const BURST: u64 = 8 * 1024;
    /// The console's line rate: 115,200 baud, 10 bits per byte.
    pub const LINE_BYTES_PER_SECOND: u64 = 11_520;

    fn new(tsc_hz: u64, now: u64) -> Self {
        GuestConsole {
            bucket: TokenBucket::new(Self::BURST, tsc_hz / Self::LINE_BYTES_PER_SECOND, now),
            lines_dropped: 0,
            bytes_dropped: 0,
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
}

/// The CMOS clock of every VM starts at 2026-01-01 00:00:00 UTC (runs are reproducible).
pub const CLOCK_START: u64 = 1_767_225_600;

impl Vm {
    /// Copies guest-physical `[gpa, gpa + buf.len())` into `buf`; false if it is not all guest
    /// memory.
    pub fn read_guest(&self, gpa: u64, buf: &mut [u8]) -> bool {
        let fits = gpa
            .checked_add(buf.len() as u64)
            .is_some_and(|end| end <= self.mem_size);
        if fits {
            // SAFETY: [mem_hpa, mem_hpa + mem_size) was taken from the frame allocator for this
            // VM alone and is identity-mapped; the range was checked to lie inside it. Guest
            // vCPUs may write it meanwhile: the copy is of bytes, any value is valid.
            unsafe {
                core::ptr::copy_nonoverlapping(
                    (self.mem_hpa + gpa) as *const u8,
                    buf.as_mut_ptr(),
                    buf.len(),
                )
            };
        }
        fits
    }

    /// The 8 bytes at guest-physical `gpa` (little-endian), or `None` outside guest memory.
    #[inline]
    pub fn read_guest_u64(&self, gpa: u64) -> Option<u64> {
        if gpa.checked_add(8).is_some_and(|end| end <= self.mem_size) {
            // SAFETY: as in `read_guest`: the 8 bytes lie inside this VM's own memory,
            // identity-mapped; any bit pattern is a valid u64, and the read is unaligned-safe.
            Some(unsafe { core::ptr::read_unaligned((self.mem_hpa + gpa) as *const u64) })
        } else {
            None
        }
    }

    /// Logs `what` the first time `msr` is seen.
    pub fn log_msr_once(&self, msr: u32, what: &str) {
        let mut c = self.devices.lock();
        if !c.logged_msrs.contains(&msr) && c.logged_msrs.len() < 64 {
            c.logged_msrs.push(msr);
            println!(
                "vm {}: {what} MSR {msr:#x}: #GP injected (reported once)",
                self.name
            );
        }
    }

    pub fn log_port_once(&self, port: u16, write: bool) {
        let mut c = self.devices.lock();
        if !c.logged_ports.contains(&port) && c.logged_ports.len() < 64 {
            c.logged_ports.push(port);
            let access = if write { "write to" } else { "read from" };
            println!(
                "vm {}: {access} unhandled I/O port {port:#x} (reads all ones, writes dropped; reported once)",
                self.name
            );
        }
    }
}

/// Builds every VM from the boot modules that passed `check_module`. A module that cannot
/// become a VM is reported and skipped, as is one pinned to a pCPU that is not online (`pcpus`
/// are).
pub fn build_all(
    caps: &VmxCaps,
    modules: &[(usize, ModuleTag<'static>)],
    initrds: &[ModuleTag<'static>],
    pcpus: usize,
) -> Vec<Vm> {
    let Some(bitmaps) = Bitmaps::new() else {
        println!("hvprof: error: no memory for the I/O and MSR bitmaps");
        return Vec::new();
    };
    let bitmaps = alloc::boxed::Box::leak(alloc::boxed::Box::new(bitmaps));
    let mut vms: Vec<Vm> = Vec::new();
    for (index, module) in modules {
        let cmdline = module.cmdline_str().unwrap_or("");
        let config = match vm_config::parse(cmdline) {
            Ok(c) => c,
            Err(e) => {
                println!("module {index}: error: {e}; VM not created");
                continue;
            }
        };
        if let Some(&cpu) = config
            .pin
            .as_ref()
            .and_then(|p| p.as_slice().iter().find(|&&c| usize::from(c) >= pcpus))
        {
            println!(
                "vm {}: error: pin={}: pCPU {cpu} is not online ({pcpus} pCPU{} online, numbered from 0); VM not created",
                config.name,
                PinList(config.pin.as_ref()),
                if pcpus == 1 { "" } else { "s" }
            );
            continue;
        }
        if vms.iter().any(|v| v.name == config.name) {
            println!(
                "module {index}: error: a VM named {:?} exists already; VM not created",
                config.name
            );
            continue;
        }
        // An attack target naming a VM must name one built before (an earlier module).
        let target = match config.target.map(|t| resolve(&vms, t)).transpose() {
            Ok(t) => t,
            Err(e) => {
                println!("vm {}: error: {e}; VM not created", config.name);
                continue;
            }
        };
        // SAFETY: the caller passes modules that `check_module` accepted: inside available
        // memory, excluded from the frame allocator, unchanged since GRUB loaded them.
        let image = unsafe {
            core::slice::from_raw_parts(module.start as *const u8, module.len() as usize)
        };
        let image_name = module.name().unwrap_or("?");
        let initrd: &[u8] = match config.initrd {
            None => &[],
            Some(name) => match initrds.iter().find(|m| m.name() == Some(name)) {
                // SAFETY: as for `image`: a module `check_module` accepted, left as GRUB loaded
                // it.
                Some(m) => unsafe {
                    core::slice::from_raw_parts(m.start as *const u8, m.len() as usize)
                },
                None => {
                    println!(
                        "vm {}: error: initrd={name}: no boot module of that name; VM not created",
                        config.name
                    );
                    continue;
                }
            },
        };
        match build(
            caps,
            bitmaps,
            vms.len(),
            &config,
            image,
            image_name,
            initrd,
            target,
        ) {
            Ok(vm) => {
                println!(
                    "vm {}: created from module {index}: {} MiB of guest memory at host {:#x}-{:#x}, EPT {}, VPID {}, budget {} ticks, {} vCPU{} {}",
                    vm.name,
                    vm.mem_size >> 20,
                    vm.mem_hpa,
                    vm.mem_hpa + vm.mem_size,
                    vm.ept.stats(),
                    vm.vcpus.first().map_or(0, |v| v.lock().vpid),
                    vm.budget,
                    vm.vcpus.len(),
                    if vm.vcpus.len() == 1 { "" } else { "s" },
                    match &vm.pin {
                        Some(_) => format!("pinned to pCPU {}", PinList(vm.pin.as_ref())),
                        None => String::from("free to move between pCPUs"),
                    }
                );
                if let Some(t) = &vm.target {
                    println!(
                        "vm {}: attack target: {} at host {:#x}{}",
                        vm.name,
                        t.what,
                        t.hpa,
                        if t.hpa < vm.mem_size {
                            " (inside this VM's own guest-physical range: the access reaches its own memory)"
                        } else {
                            ""
                        }
                    );
                }
                vms.push(vm);
            }
            Err(e) => println!(
                "vm {}: error: {e}; VM not created, the others go on",
                config.name
            ),
        }
    }
    vms
}

/// Each vCPU's initial stack lies this far below the previous one's.
pub const VCPU_STACK: u64 = 64 * 1024;

/// VPIDs are handed out in order, one per vCPU (0 is the host's).
static NEXT_VPID: core::sync::atomic::AtomicU16 = core::sync::atomic::AtomicU16::new(1);

/// Where no memory or device sits on the test machines (Bochs and QEMU with 512 MiB).
pub const UNMAPPED_TARGET: u64 = 0xc000_0000;
pub const LAPIC_BASE: u64 = 0xfee0_0000;

fn resolve(vms: &[Vm], t: Target) -> Result<AttackTarget, String> {
    let (hpa, what, ram) = match t {
        Target::Hypervisor => (
            memory::image_range().start,
            String::from("the hypervisor image"),
            true,
        ),
        Target::Vm(name) => {
            let vm = vms
                .iter()
                .find(|v| v.name == name)
                .ok_or_else(|| format!("target=vm:{name}: no VM of that name before this one"))?;
            (vm.mem_hpa, format!("VM {name}'s memory"), true)
        }
        Target::Unmapped => (UNMAPPED_TARGET, String::from("unmapped space"), false),
        Target::Mmio => (LAPIC_BASE, String::from("the local APIC"), false),
    };
    Ok(AttackTarget {
        hpa,
        what,
        checksum: ram.then(|| page_checksum(hpa)),
    })
}

/// FNV-1a over the 4 KiB host page at `hpa` (RAM only).
pub fn page_checksum(hpa: u64) -> u64 {
    // SAFETY: called only for pages of RAM the hypervisor owns (its image, a VM's memory), all
    // identity-mapped; read-only.
    let page = unsafe { core::slice::from_raw_parts((hpa & !0xfff) as *const u8, 4096) };
    page.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

#[allow(clippy::too_many_arguments)]
fn build(
    caps: &VmxCaps,
    bitmaps: &Bitmaps,
    index: usize,
    config: &vm_config::VmConfig,
    image: &[u8],
    image_name: &str,
    initrd: &[u8],
    target: Option<AttackTarget>,
) -> Result<Vm, String> {
    let mem_hpa = memory::alloc_zeroed(config.mem, MEM_GRANULE)
        .ok_or_else(|| format!("no {} MiB of contiguous memory left", config.mem >> 20))?;
    // The attack guest learns its target's address through its arguments.
    let mut args = String::from(config.args);
    if let Some(t) = &target {
        args.push_str(&format!(" addr={:#x}", t.hpa));
    }
    // SAFETY: the range was just allocated for this VM (zeroed, identity-mapped).
    let mem = unsafe { core::slice::from_raw_parts_mut(mem_hpa as *mut u8, config.mem as usize) };
    let linux = config.format == vm_config::Format::Linux || linux_boot::is_bzimage(image);
    let boot = if linux {
        let cmdline = vm_config::guest_args(config.args)
            .collect::<Vec<_>>()
            .join(" ");
        let (boot, l) =
            linux_boot::load(mem, image, initrd, &cmdline).map_err(|e| format!("{e}"))?;
        println!(
            "vm {}: Linux kernel ({} bytes) at GPA {:#x}, entry {:#x}; initrd ({} bytes) at GPA {:#x}; boot_params at {:#x}; command line \"{cmdline}\"",
            config.name,
            l.kernel_len,
            l.kernel_gpa,
            l.entry,
            l.initrd_len,
            l.initrd_gpa,
            linux_boot::BOOT_PARAMS_GPA
        );
        boot
    } else {
        match config.format {
            vm_config::Format::Real16 => guest_image::load_real16(mem, image, &args),
            _ => guest_image::load(mem, image, &args),
        }
        .map_err(|e| format!("{e}"))?
    };

    let ept_caps = EptCaps {
        pages: PageSizes {
            two_mib: caps.ept_cap(ept_cap::PAGE_2M),
            one_gib: caps.ept_cap(ept_cap::PAGE_1G),
        },
        execute_only: caps.ept_cap(ept_cap::EXECUTE_ONLY),
        phys_addr_bits: phys_addr_bits(),
    };
    let mut ept = Ept::new(HostPhys, ept_caps).map_err(|e| format!("EPT: {e}"))?;
    ept.map(
        0,
        mem_hpa,
        config.mem,
        Permissions::all(),
        MemoryType::WriteBack,
    )
    .map_err(|e| format!("EPT: {e}"))?;
    let eptp = ept.eptp(false);
    // No translation derived from this EPTP may survive from an earlier use of the same tables'
    // addresses (SDM Vol. 3C §29.4.3.1): invalidate before the first VM entry.
    let kind = if caps.ept_cap(ept_cap::INVEPT_SINGLE) {
        instructions::InvEptType::SingleContext
    } else {
        instructions::InvEptType::AllContext
    };
    // SAFETY: VMX root operation; `missing_requirement` checked that INVEPT exists with one of
    // these types; invalidating TLB entries cannot break memory safety.
    unsafe { instructions::invept(kind, eptp) }.map_err(|e| format!("INVEPT: {e}"))?;
    // One VMCS per vCPU, each with its own VPID; vCPU i starts at the same entry with its stack
    // 64 KiB below vCPU i-1's (docs/GUEST-ABI.md, "Entry state").
    let mut vcpus = Vec::new();
    for i in 0..config.vcpus {
        let mut start = boot;
        start.rsp = boot.rsp - u64::from(i) * VCPU_STACK;
        let vpid = NEXT_VPID.fetch_add(1, core::sync::atomic::Ordering::Relaxed);
        let (mut vcpu, _vmcs) =
            Vcpu::new(caps, bitmaps, eptp, vpid, &start).map_err(|e| format!("vCPU {i}: {e}"))?;
        // Made on the boot CPU, it may run on any pCPU: clear it (SDM Vol. 3C §25.11.3), so the
        // pCPU that runs it first loads it and writes its own host state.
        // SAFETY: VMX root operation; the VMCS was just made current on this CPU.
        unsafe { instructions::vmclear(vcpu.vmcs) }.map_err(|e| format!("VMCLEAR: {e}"))?;
        vcpu.host_cpu = None;
        // The guest learns which vCPU it is in RDX.
        vcpu.regs.rdx = u64::from(i);
        vcpu.index = i;
        vcpus.push(Mutex::new(vcpu));
    }
    Ok(Vm {
        index: index as u16,
        vcpus,
        pin: config.pin,
        linux,
        task_offsets: config.task_offsets,
        name: String::from(config.name),
        mem_hpa,
        mem_size: config.mem,
        ept,
        devices: Mutex::new(VmDevices {
            board: Board::new(crate::tsc::hz(), CLOCK_START),
            console: GuestConsole::new(crate::tsc::hz(), rdtsc()),
            logged_msrs: Vec::new(),
            logged_ports: Vec::new(),
        }),
        budget: config.budget,
        wall_budget: config.wall_budget,
        wall_deadline: AtomicU64::new(u64::MAX),
        target,
        run_ticks: AtomicU64::new(0),
        stopping: AtomicBool::new(false),
        image: String::from(image_name),
        build_id: guest_image::build_id(image)
            .map(<[u8]>::to_vec)
            .unwrap_or_default(),
    })
}

/// `a,b,...` of a `pin=` list.
struct PinList<'a>(Option<&'a Pins>);

impl core::fmt::Display for PinList<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        for (i, c) in self.0.map_or(&[][..], Pins::as_slice).iter().enumerate() {
            write!(f, "{}{c}", if i == 0 { "" } else { "," })?;
        }
        Ok(())
    }
}

/// MAXPHYADDR (CPUID.80000008H:EAX[7:0]), 36 when the leaf is missing (SDM Vol. 3A §4.1.4).
fn phys_addr_bits() -> u8 {
    raw_cpuid::CpuId::new()
        .get_processor_capacity_feature_info()
        .map_or(36, |c| c.physical_address_bits())
}

/// How a slice of a vCPU's time ended.
pub enum SliceEnd {
    /// The slice ran out: the vCPU is still runnable.
    Preempted,
    /// The guest executed HLT: the vCPU blocks until its virtual timer (if any) fires.
    Halted,
    /// The VM stopped.
    Stopped(Stop),
}

/// Runs vCPU `vcpu` of `vm` on this pCPU (`cpu`) until `slice_end` (TSC), a HLT, or its stop.
/// The VMX-preemption timer stops the guest at the profiler's next sampling deadline, at the end
/// of the slice and at the end of the VM's budget; while the hypervisor handles an exit,
/// interrupts are on and the LAPIC timer takes the samples. With `release`, the VMCS is cleared
/// at the end so that the vCPU may run on another pCPU next.
pub fn run_slice(
    vm: &Vm,
    vcpu: &mut Vcpu,
    cpu: usize,
    release: bool,
    caps: &VmxCaps,
    slice_end: u64,
) -> SliceEnd {
    let here = crate::percpu::this();
    if here.enter_vm(vm.index) {
        crate::isolation::switch_vm(here.selectors().data);
    }
    let mut vmcs = match activate(vcpu, cpu, caps) {
        Ok(v) => v,
        Err(e) => return SliceEnd::Stopped(Stop::Fault(e)),
    };
    let end = run_loaded(vm, vcpu, &mut vmcs, caps, slice_end);
    if release {
        // SAFETY: VMX root operation; the VMCS is active on this CPU. VMCLEAR writes its state
        // to memory and makes it inactive, so another CPU may VMPTRLD it (SDM Vol. 3C §25.11.1).
        if let Err(e) = unsafe { instructions::vmclear(vcpu.vmcs) } {
            return SliceEnd::Stopped(Stop::Fault(format!("VMCLEAR failed: {e}")));
        }
        vcpu.launched = false;
        vcpu.host_cpu = None;
    }
    end
}

/// Makes the vCPU's VMCS current on pCPU `cpu`: VMPTRLD, and when the VMCS last held another
/// pCPU's host state (it was cleared there), this pCPU's; when the vCPU last ran elsewhere, its
/// VPID's cached translations here may be stale and are flushed (SDM Vol. 3C §29.4.3.3).
fn activate(vcpu: &mut Vcpu, cpu: usize, caps: &VmxCaps) -> Result<CurrentVmcs, String> {
    if let Some(other) = vcpu.host_cpu.filter(|&c| c != cpu) {
        return Err(format!(
            "scheduler bug: the VMCS is still active on pCPU {other} (not cleared before moving)"
        ));
    }
    // SAFETY: in VMX root operation; the VMCS was prepared by `Vcpu::new` and is active on no
    // other CPU (checked above: a vCPU that may move is cleared at the end of each slice).
    unsafe { instructions::vmptrld(vcpu.vmcs) }.map_err(|e| format!("VMPTRLD failed: {e}"))?;
    // SAFETY: VMX root operation with this vCPU's VMCS current, on this CPU only.
    let mut vmcs = unsafe { CurrentVmcs::new() };
    if vcpu.host_cpu.is_none() {
        crate::vcpu::write_host_cpu_state(&mut vmcs).map_err(|e| format!("{e}"))?;
        vcpu.host_cpu = Some(cpu);
    }
    if vcpu.last_cpu.is_some_and(|c| c != cpu) && caps.ept_cap(ept_cap::INVVPID) {
        let kind = if caps.ept_cap(ept_cap::INVVPID_SINGLE) {
            Some(instructions::InvVpidType::SingleContext)
        } else if caps.ept_cap(ept_cap::INVVPID_ALL) {
            Some(instructions::InvVpidType::AllContext)
        } else {
            None
        };
        if let Some(kind) = kind {
            // SAFETY: VMX root operation; INVVPID of this type is supported (checked above);
            // invalidating cached translations cannot break memory safety.
            unsafe { instructions::invvpid(kind, vcpu.vpid, 0) }
                .map_err(|e| format!("INVVPID failed: {e}"))?;
        }
    }
    vcpu.last_cpu = Some(cpu);
    Ok(vmcs)
}

/// The run loop of `run_slice`, with the VMCS current.
fn run_loaded(
    vm: &Vm,
    vcpu: &mut Vcpu,
    vmcs: &mut CurrentVmcs,
    caps: &VmxCaps,
    slice_end: u64,
) -> SliceEnd {
    let prof = profiler::this_cpu();
    vcpu.load_state();
    let shift = caps.preemption_timer_shift();
    let start = rdtsc();
    // The budget counts the VM's own running time (all its vCPUs').
    let budget_end = start.saturating_add(
        vm.budget
            .saturating_sub(vm.run_ticks.load(Ordering::Relaxed)),
    );
    let wall_end = vm.wall_deadline.load(Ordering::Relaxed);
    let deadline = budget_end.min(wall_end);
    let mut exit_at: Option<(u16, u64)> = None;
    // An exit for a sampling deadline (its cost is the profiler's): the TSC it began at, moved on
    // by any export done inside it (counted as export), and its sample path and task read ticks.
    let mut sampling_exit: Option<(u64, u64)> = None;
    // The LAPIC timer samples the hypervisor while it handles an exit; a sampling exit leaves it
    // unarmed (nothing runs but the path back into the guest).
    let mut host_clock_armed = true;
    // The last exit took the sampling clock's short path (no handler ran).
    let mut short_path = false;
    prof.set_current(vm.index, vcpu.index, vcpu.vpid, vcpu.last_exit);
    prof.event(profiler::Kind::VcpuIn, 0);
    // A Linux guest's devices need a look before an entry when an exit may have changed them
    // (any exit but the VMX-preemption timer's), when their next event has come, or while an
    // interrupt waits: not at the sampling clock's exits in between.
    let mut devices_touched = true;
    let mut device_event: Option<u64> = None;
    let end = loop {
        // A Linux guest's devices: raise what is due, inject what the guest can take now (with
        // interrupts on, so the sampling clock sees this work for what it is).
        if vm.linux && (devices_touched || device_event.is_some_and(|t| rdtsc() >= t)) {
            if !host_clock_armed {
                prof.arm_host_clock();
                x86_64::instructions::interrupts::enable();
                host_clock_armed = true;
            }
            let (next, waiting) = crate::interrupts::before_entry(vm, vcpu, vmcs, caps, rdtsc());
            device_event = next;
            devices_touched = waiting;
        }
        // Interrupts stay off from here to the VM exit: a tick that falls in this window is
        // taken as a hypervisor sample right here.
        x86_64::instructions::interrupts::disable();
        if host_clock_armed {
            prof.disarm_host_clock();
            host_clock_armed = false;
        }
        let now = rdtsc();
        // A deadline that passed while the hypervisor worked is its sample, taken here; after a
        // sampling exit's short path none can have (the guest sample just moved the deadline a
        // period on).
        if !short_path {
            let _ = prof.sample_host_at(run_slice as *const () as u64, false, now);
        }
        short_path = false;
        if vm.stopping.load(Ordering::Acquire) {
            break SliceEnd::Stopped(Stop::WithVm);
        }
        if now >= deadline {
            break SliceEnd::Stopped(if now >= budget_end {
                Stop::Budget
            } else {
                Stop::WallBudget
            });
        }
        if now >= slice_end {
            break SliceEnd::Preempted;
        }
        // The VMX-preemption timer stops the guest at the next sampling deadline, the end of the
        // slice, the end of the budget or its devices' next event, whichever comes first (SDM
        // Vol. 3C §26.5.1).
        let other = deadline
            .min(slice_end)
            .min(device_event.unwrap_or(u64::MAX));
        let tick = prof.next_tick();
        // The timer is set for a sampling deadline that nothing else needed.
        let timer_for_sampling = tick < other;
        let mut until = tick.min(other).saturating_sub(now);
        // The guest runs at least a quarter of a period at each entry the sampling clock ends:
        // with a period shorter than the exits it causes, it would otherwise never run at all.
        if timer_for_sampling {
            until = until.max(prof.period() / 4);
        }
        let timer = (until >> shift).min(u32::MAX as u64) as u32;
        if let Err(e) = vmcs.write32(Guest32::PreemptionTimerValue, timer) {
            break SliceEnd::Stopped(Stop::Fault(format!(
                "VMWRITE of the preemption timer failed: {e}"
            )));
        }
        if let Some((reason, t)) = exit_at.take() {
            vcpu.stats.record(reason, rdtsc() - t);
        }
        // A sampling exit ends at the entry: it is booked after it, so that the booking is the
        // only part of it left out.
        let ending = sampling_exit.take();
        let t_entry = rdtsc();
        // SAFETY: the VMCS is current and complete (host state is this pCPU's); `launched`
        // tracks VMLAUNCH since the last VMCLEAR.
        let flags = unsafe { crate::vcpu::entry::vmx_run(&mut vcpu.regs, vcpu.launched as u64) };
        let t_exit = rdtsc();
        if let Some((t, inside)) = ending {
            prof.sampling_exit_done(t, t_entry, inside);
        }
        if flags != 0 {
            let why = hvprof_vmx::errors::VmFail::from_rflags(flags, || {
                vmcs.read32(hvprof_vmx::vmcs::ReadOnly32::VmInstructionError)
                    .unwrap_or(0)
            });
            let what = if vcpu.launched {
                "VMRESUME"
            } else {
                "VMLAUNCH"
            };
            break SliceEnd::Stopped(Stop::Fault(match why {
                Err(e) => format!("{what} failed: {e}"),
                Ok(()) => format!("{what} returned with RFLAGS {flags:#x}"),
            }));
        }
        let reason = match vmcs.exit_reason() {
            Ok(r) => r,
            Err(e) => {
                break SliceEnd::Stopped(Stop::Fault(format!(
                    "VMREAD of the exit reason failed: {e}"
                )));
            }
        };
        if reason.entry_failure() {
            let qual = vmcs.exit_qualification().unwrap_or(0);
            let detail = hvprof_vmx::errors::EntryFailure::decode(reason, qual)
                .map(|f| format!("{f}"))
                .unwrap_or_default();
            break SliceEnd::Stopped(Stop::Fault(format!("VM entry failed: {reason} {detail}")));
        }
        vcpu.launched = true;
        let preemption = reason.basic() == BasicExit::PreemptionTimer as u16;
        // A VMX-preemption timer exit happens between instructions, never while an event is being
        // delivered (SDM Vol. 3C §26.5.1 and §28.2.4: only exits that the delivery itself causes
        // leave valid IDT-vectoring information), so the sampling clock's exits skip the check.
        if !preemption {
            crate::interrupts::redeliver_interrupted_event(vmcs);
        }
        // The guest sample (if the deadline has come: the preemption timer's exit, or any exit
        // that found it passed) carries the previous exit reason; then this exit becomes the
        // last one.
        let mut inside = 0;
        if let Some(cost) = prof.sample_guest_if_due(vmcs, t_exit) {
            inside = cost;
            if let Some(off) = &vm.task_offsets {
                let t = rdtsc();
                track_task(vm, vcpu, vmcs, off, t_exit);
                let ticks = rdtsc() - t;
                prof.costs.task_reads.add(ticks);
                inside += ticks;
            }
        }
        if vcpu.last_exit != reason.basic() {
            vcpu.last_exit = reason.basic();
            prof.set_current(vm.index, vcpu.index, vcpu.vpid, vcpu.last_exit);
        }
        exit_at = Some((reason.basic(), t_exit));
        if preemption && timer_for_sampling {
            sampling_exit = Some((t_exit, inside));
        }
        // The sampling clock's exit: nothing to handle. Straight back into the guest, unless the
        // ring or the console has something to move on (done below, where it is sampled).
        if preemption && !profiler::export::wants_drain(prof) && !crate::console::pump_due(t_exit) {
            short_path = matches!(sampling_exit, Some((_, sampled)) if sampled > 0);
            continue;
        }
        devices_touched |= !preemption;
        prof.arm_host_clock();
        host_clock_armed = true;
        x86_64::instructions::interrupts::enable();
        let flow = vmexit::handle(vm, vcpu, vmcs, reason);
        x86_64::instructions::interrupts::disable();
        match flow {
            vmexit::Flow::Resume => {}
            vmexit::Flow::Halt => break SliceEnd::Halted,
            vmexit::Flow::Stop(stop) => break SliceEnd::Stopped(stop),
        }
        x86_64::instructions::interrupts::enable();
        let export = profiler::export::drain_if_full(prof);
        if let Some((t, _)) = &mut sampling_exit {
            *t += export;
        }
        crate::console::pump();
    };
    x86_64::instructions::interrupts::disable();
    if let Some((reason, t)) = exit_at.take() {
        vcpu.stats.record(reason, rdtsc() - t);
    }
    if let Some((t, inside)) = sampling_exit.take() {
        prof.sampling_exit_done(t, rdtsc(), inside);
    }
    if host_clock_armed {
        prof.disarm_host_clock();
    }
    prof.event(
        profiler::Kind::VcpuOut,
        match end {
            SliceEnd::Preempted => profiler::OUT_PREEMPTED,
            SliceEnd::Halted => profiler::OUT_HALTED,
            SliceEnd::Stopped(_) => profiler::OUT_STOPPED,
        },
    );
    prof.set_current(profiler::NO_VM, 0xffff, 0, profiler::NO_EXIT);
    vm.run_ticks.fetch_add(rdtsc() - start, Ordering::Relaxed);
    vcpu.save_state();
    end
}

/// After a sample of a Linux guest: reads the task its vCPU runs (`guest_walk::read_task`) and,
/// when it is not the one seen at the vCPU's previous sample, records the change for the log.
/// The task's address, pid and name are compared, so a task structure reused by a new process
/// (or a CR3 reused by one) still shows as a change, and so does an exec().
fn track_task(vm: &Vm, vcpu: &mut Vcpu, vmcs: &CurrentVmcs, off: &TaskOffsets, tsc: u64) {
    use hvprof_vmx::vmcs::GuestNatural;
    let read = |f| crate::vmexit::must(vmcs.read_natural(f), "VMREAD guest state");
    let cr3 = read(GuestNatural::Cr3);
    // The kernel's per-CPU base: GS base in kernel mode, IA32_KERNEL_GS_BASE (the guest's
    // value, live on this CPU while the vCPU is loaded) in user mode.
    let base = if crate::vmexit::guest_cpl(vmcs) == 0 {
        read(GuestNatural::GsBase)
    } else {
        crate::arch::msr::read_safe(0xc000_0102).unwrap_or(0)
    };
    let read_phys = |gpa: u64| vm.read_guest_u64(gpa);
    let read_bytes = |gpa: u64, buf: &mut [u8]| vm.read_guest(gpa, buf);
    let Some(ids) =
        guest_walk::read_task_ids(&mut vcpu.tlb, &read_phys, &read_bytes, cr3, base, off)
    else {
        return;
    };
    // Same task, same ids, same address space: same name (exec() changes the name and the CR3
    // together), so no need to read it again.
    let space = cr3 & !0xfff;
    if vcpu
        .last_task
        .is_some_and(|(i, s, _)| i == ids && s == space)
    {
        return;
    }
    let Some(comm) =
        guest_walk::read_task_comm(&mut vcpu.tlb, &read_phys, &read_bytes, cr3, ids.0, off)
    else {
        return;
    };
    let changed = vcpu.last_task.is_none_or(|(i, _, c)| i != ids || c != comm);
    vcpu.last_task = Some((ids, space, comm));
    if !changed {
        return;
    }
    let (task, pid, tgid) = ids;
    let len = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());
    let name = core::str::from_utf8(&comm[..len]).unwrap_or("?");
    profiler::this_cpu().task_changed(hvprof_samplelog::Task {
        pcpu: crate::percpu::index() as u16,
        tsc,
        vm: vm.index,
        vcpu: vcpu.index,
        cr3,
        task,
        pid,
        tgid,
        comm: hvprof_samplelog::FixedStr::truncated(name),
    });
}

/// After a VM's stop (all its vCPUs stopped): the rest of its console line, then why it stopped
/// (`print_exit_stats` follows at the end of the run).
pub fn finish(vm: &Vm, stop: &Stop) {
    let (lines, bytes) = {
        let mut guard = vm.devices.lock();
        let VmDevices { board, console, .. } = &mut *guard;
        if let Some(rest) = board.uart.flush() {
            console.emit(&vm.name, rest, rdtsc());
        }
        (console.lines_dropped, console.bytes_dropped)
    };
    if lines > 0 {
        println!(
            "vm {}: {lines} console lines ({bytes} bytes) dropped: the guest printed faster than the console line carries ({} bytes/s, bursts of {} bytes)",
            vm.name,
            GuestConsole::LINE_BYTES_PER_SECOND,
            GuestConsole::BURST
        );
    }
    report(vm, stop);
    if vm.linux {
        // The guest kernel's system-call entry: with the offline symbols it gives the KASLR
        // slide (`entry_SYSCALL_64` moves with the kernel), for hvprof-analyze.
        let lstar = vm.vcpus[0].lock().msrs[crate::vcpu::LSTAR_SLOT];
        println!("vm {}: guest IA32_LSTAR {lstar:#018x}", vm.name);
    }
}

fn report(vm: &Vm, stop: &Stop) {
    let name = &vm.name;
    match stop {
        Stop::Exited { code, how } => {
            println!(
                "vm {name}: stopped: exit code {code} ({how}) after {} ticks",
                vm.run_ticks.load(Ordering::Relaxed)
            )
        }
        Stop::WithVm => println!("vm {name}: stopped"),
        Stop::Fault(report) => {
            for (i, line) in report.lines().enumerate() {
                if i == 0 {
                    println!("vm {name}: stopped: {line}");
                } else {
                    println!("vm {name}:   {line}");
                }
            }
        }
        Stop::Budget => println!(
            "vm {name}: stopped: run budget of {} ticks exhausted (budget= module argument)",
            vm.budget
        ),
        Stop::WallBudget => println!(
            "vm {name}: stopped: wall budget of {} ticks since its start exhausted after {} ticks of running (wall-budget= module argument)",
            vm.wall_budget,
            vm.run_ticks.load(Ordering::Relaxed)
        ),
        Stop::HaltedForever => println!(
            "vm {name}: stopped: HLT with no event that could wake the vCPU (no virtual timer armed)"
        ),
    }
    if let Some(t) = &vm.target {
        match t.checksum {
            Some(before) => {
                let after = page_checksum(t.hpa);
                println!(
                    "vm {name}: target {} at host {:#x}: page checksum {before:#018x} before, {after:#018x} after: {}",
                    t.what,
                    t.hpa,
                    if before == after {
                        "unchanged"
                    } else {
                        "CHANGED"
                    }
                );
            }
            None => println!(
                "vm {name}: target {} at {:#x} (not RAM: no checksum)",
                t.what, t.hpa
            ),
        }
    }
}

/// The VM's exit statistics (its vCPUs' added up). Printed once every VM has stopped: on a slow
/// console the table costs more than the run's last slices, and it would be sampled as theirs.
pub fn print_exit_stats(vm: &Vm) {
    let mut stats = ExitStats::default();
    for v in &vm.vcpus {
        stats.merge(&v.lock().stats);
    }
    print!("{}", stats.table(&vm.name, exit_name));
}

pub fn exit_name(reason: u16) -> &'static str {
    BasicExit::from_number(reason).map_or("UNKNOWN", |b| b.name())
}
