//! Building the VMs from the boot modules (on the boot CPU, before the scheduler starts): guest
//! memory, the guest image or Linux kernel, the EPT, one VMCS per vCPU.

use super::{AttackTarget, CLOCK_START, GuestConsole, HostPhys, Vm, VmDevices, page_checksum};
use crate::tsc::rdtsc;
use crate::vcpu::{Bitmaps, Vcpu};
use crate::{memory, println};
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicBool, AtomicU64};
use hvprof_boot::info::ModuleTag;
use hvprof_ept::{Ept, EptCaps, MemoryType, PageSizes, Permissions};
use hvprof_hypervisor::devices::board::Board;
use hvprof_hypervisor::vm_config::{self, MEM_GRANULE, Target};
use hvprof_hypervisor::vm_config::{Pins, Ple};
use hvprof_hypervisor::{guest_image, linux_boot, multiboot};
use hvprof_vmx::caps::{VmxCaps, ept_cap};
use hvprof_vmx::instructions;
use spin::Mutex;

/// Builds every VM from the boot modules that passed `check_module`. A module that cannot
/// become a VM is reported and skipped, as is one pinned to a pCPU that is not online (`pcpus`
/// are). `data`: the modules VMs name by `initrd=` and `unwind=`.
pub fn build_all(
    caps: &VmxCaps,
    modules: &[(usize, ModuleTag<'static>)],
    data: &[ModuleTag<'static>],
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
            Some(name) => match module_bytes(data, name) {
                Some(b) => b,
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
            Ok(mut vm) => {
                vm.unwind = unwind_tables(&config, data);
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

/// The bytes of the data module named `name`.
fn module_bytes(data: &[ModuleTag<'static>], name: &str) -> Option<&'static [u8]> {
    let m = data.iter().find(|m| m.name() == Some(name))?;
    // SAFETY: `data` holds modules `check_module` accepted (inside available memory, excluded
    // from the frame allocator, so left as GRUB loaded them for the hypervisor's whole life).
    Some(unsafe { core::slice::from_raw_parts(m.start as *const u8, m.len() as usize) })
}

/// The unwind tables `unwind=` names, each checked whole; one that is missing or malformed is
/// reported and left out (the VM runs, its programs' chains then by frame pointers alone).
fn unwind_tables(
    config: &vm_config::VmConfig,
    data: &[ModuleTag<'static>],
) -> &'static [hvprof_linux_walk::UnwindTable<'static>] {
    let mut tables = Vec::new();
    for name in config.unwind_modules() {
        let Some(bytes) = module_bytes(data, name) else {
            println!(
                "vm {}: error: unwind={name}: no boot module of that name; left out",
                config.name
            );
            continue;
        };
        match hvprof_linux_walk::UnwindTable::parse(bytes) {
            Ok(t) => {
                println!(
                    "vm {}: unwind table {name}: {} entries for code at {:#x}-{:#x}, used where the process holds build id {} at {:#x}",
                    config.name,
                    t.len(),
                    t.start,
                    t.end,
                    Hex(t.id()),
                    t.id_addr
                );
                tables.push(t);
            }
            Err(e) => println!(
                "vm {}: error: unwind table {name}: {e}; left out",
                config.name
            ),
        }
    }
    tables.leak()
}

/// Bytes in hex.
struct Hex<'a>(&'a [u8]);

impl core::fmt::Display for Hex<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
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

/// Writes the ACPI tables of an `apic=on` VM into its memory at `guest_acpi::ACPI_GPA` (a MADT
/// with a local APIC per vCPU and the I/O APIC, a FADT with the PM1 blocks); returns the RSDP's
/// guest-physical address.
/// `pm_timer`: the FADT gives the ACPI PM timer. Not to a Linux guest: Debian's kernel, given one,
/// spent its boot in more delay loops (580 pause-loop exits in `delay_tsc` on
/// `bochs-linux-ple-on` instead of 34) and took a fifth longer to boot in some scenarios.
fn acpi_tables(
    mem: &mut [u8],
    config: &vm_config::VmConfig,
    pm_timer: bool,
) -> Result<u64, String> {
    use hvprof_hypervisor::guest_acpi::{self, ACPI_GPA, ACPI_SIZE, IOAPIC_BASE, LAPIC_BASE};
    let ids: Vec<u8> = (0..config.vcpus).map(|i| i as u8).collect();
    let at = ACPI_GPA as usize;
    let page: &mut [u8; ACPI_SIZE] = mem
        .get_mut(at..at + ACPI_SIZE)
        .and_then(|p| p.try_into().ok())
        .ok_or("no room for the ACPI tables")?;
    let rsdp = guest_acpi::build(&ids, true, pm_timer, ACPI_GPA, page)
        .map_err(|e| format!("ACPI tables: {e}"))?;
    println!(
        "vm {}: local APIC (xAPIC at {LAPIC_BASE:#x}) per vCPU; ACPI tables at GPA {rsdp:#x}: MADT with {} vCPU{} and the I/O APIC (ID {}, at {IOAPIC_BASE:#x}; IRQ 0 on pin 2)",
        config.name,
        ids.len(),
        if ids.len() == 1 { "" } else { "s" },
        ids.len(),
    );
    Ok(rsdp)
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
    let output = match config.output {
        0 => None,
        bytes => {
            let at = memory::alloc_zeroed(bytes, 4096).ok_or_else(|| {
                format!("output={}K: no contiguous memory left for it", bytes >> 10)
            })?;
            // SAFETY: the range was just allocated for this store (zeroed, identity-mapped) and
            // is never freed or used for anything else.
            let buf = unsafe { core::slice::from_raw_parts_mut(at as *mut u8, bytes as usize) };
            Some(Mutex::new(
                hvprof_hypervisor::output_store::OutputStore::new(buf),
            ))
        }
    };
    // The attack guest learns its target's address through its arguments.
    let mut args = String::from(config.args);
    if let Some(t) = &target {
        args.push_str(&format!(" addr={:#x}", t.hpa));
    }
    // SAFETY: the range was just allocated for this VM (zeroed, identity-mapped).
    let mem = unsafe { core::slice::from_raw_parts_mut(mem_hpa as *mut u8, config.mem as usize) };
    let linux = config.format == vm_config::Format::Linux || linux_boot::is_bzimage(image);
    let is_multiboot =
        config.format == vm_config::Format::Multiboot || multiboot::is_multiboot(image);
    // A local APIC per vCPU, the I/O APIC, ACPI PM1 and ACPI tables describing them (`apic=on`):
    // Linux guests and 64-bit test guests (a real-mode image has no room for them).
    let apic = config.apic && config.format != vm_config::Format::Real16;
    let boot = if linux {
        let cmdline = vm_config::guest_args(config.args)
            .collect::<Vec<_>>()
            .join(" ");
        let (boot, l) =
            linux_boot::load(mem, image, initrd, &cmdline).map_err(|e| format!("{e}"))?;
        if apic {
            let rsdp = acpi_tables(mem, config, false)?;
            linux_boot::set_acpi_rsdp(mem, rsdp).map_err(|e| format!("{e}"))?;
        }
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
    } else if is_multiboot {
        // The command line as GRUB and QEMU give a Multiboot kernel: the image's name (a
        // kernel's argv[0]), then the VM's own arguments without the hypervisor's keys.
        let cmdline = core::iter::once(image_name)
            .chain(vm_config::guest_args(config.args))
            .collect::<Vec<_>>()
            .join(" ");
        let module = config.initrd.map(|_| initrd);
        let l = multiboot::load(mem, image, &cmdline, module).map_err(|e| format!("{e}"))?;
        if apic {
            acpi_tables(mem, config, true)?;
        }
        println!(
            "vm {}: Multiboot 1 kernel at GPA {:#x}-{:#x}, entry {:#x} in 32-bit protected mode; information at {:#x}{}; command line \"{cmdline}\"",
            config.name,
            l.start,
            l.end,
            l.boot.entry,
            multiboot::INFO_GPA,
            match l.module {
                Some((a, b)) => format!("; module ({} bytes) at GPA {a:#x}", b - a),
                None => String::new(),
            }
        );
        l.boot
    } else {
        let boot = match config.format {
            vm_config::Format::Real16 => guest_image::load_real16(mem, image, &args),
            _ => guest_image::load(mem, image, &args),
        }
        .map_err(|e| format!("{e}"))?;
        if apic {
            // The RSDP sits in the BIOS area (0xE0000-0xFFFFF), where a guest finds it by its
            // signature (ACPI 6.5 §5.2.5.1).
            acpi_tables(mem, config, true)?;
        }
        boot
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
    // The CPU's APIC virtualization where it has all of it (and `apic=emulated` does not turn
    // it down): the guest's xAPIC page maps onto an APIC-access page (SDM Vol. 3C §29.4: the
    // CPU recognizes accesses by the address EPT translates them to).
    let apic_access = if apic {
        let why_not = if config.apic_virtualization {
            crate::vm::virtual_apic::missing(caps)
        } else {
            Some("apic=emulated")
        };
        match why_not {
            None => {
                let page = memory::alloc_zeroed(0x1000, 0x1000)
                    .ok_or("no memory for the APIC-access page")?;
                ept.map(
                    hvprof_hypervisor::guest_acpi::LAPIC_BASE,
                    page,
                    0x1000,
                    Permissions::all(),
                    MemoryType::Uncacheable,
                )
                .map_err(|e| format!("EPT (APIC-access page): {e}"))?;
                println!(
                    "vm {}: APIC virtualization: TPR shadow, APIC-register virtualization, virtual-interrupt delivery (SDM Vol. 3C ch. 29)",
                    config.name
                );
                page
            }
            Some(why) => {
                println!(
                    "vm {}: APIC virtualization: off ({why}): every local APIC access is trapped and emulated",
                    config.name
                );
                0
            }
        }
    } else {
        0
    };
    let testdev_memory = if config.testdev {
        // pc-testdev's 64 KiB of test memory (QEMU's `IOMEM_LEN` at 0xff000000): memory of the
        // VM's own, where kvm-unit-tests' kernels run accesses of every kind.
        let (gpa, len) = hvprof_hypervisor::devices::testdev::IOMEM;
        let at = memory::alloc_zeroed(len, 0x1000).ok_or("no memory for pc-testdev's memory")?;
        ept.map(gpa, at, len, Permissions::all(), MemoryType::WriteBack)
            .map_err(|e| format!("EPT (pc-testdev memory at {gpa:#x}): {e}"))?;
        at
    } else {
        0
    };
    let ple = match config.ple {
        Ple::Off => Ple::Off,
        asked if crate::vm::pause_loop::offered(caps) => {
            println!(
                "vm {}: pause-loop exiting (ple={}): a PAUSE loop at CPL 0 longer than {} TSC ticks (gap {}) exits and yields the pCPU{} (SDM Vol. 3C §25.6.13)",
                config.name,
                asked.as_str(),
                crate::vm::pause_loop::WINDOW,
                crate::vm::pause_loop::GAP,
                if asked == Ple::Directed {
                    ", to a preempted vCPU of the same VM first"
                } else {
                    ""
                }
            );
            asked
        }
        asked => {
            println!(
                "vm {}: pause-loop exiting: off (ple={}, but the CPU has no PAUSE-loop exiting control)",
                config.name,
                asked.as_str()
            );
            Ple::Off
        }
    };
    crate::vm::vpmu::describe(config.name, config.vpmu, apic);
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
        let (mut vcpu, mut vmcs) =
            Vcpu::new(caps, bitmaps, eptp, vpid, &start).map_err(|e| format!("vCPU {i}: {e}"))?;
        if apic_access != 0 {
            let page = memory::alloc_zeroed(0x1000, 0x1000)
                .ok_or_else(|| format!("vCPU {i}: no memory for its virtual-APIC page"))?;
            crate::vm::virtual_apic::enable(caps, &mut vcpu, &mut vmcs, page, apic_access);
        }
        if ple != Ple::Off {
            crate::vm::pause_loop::enable(&mut vmcs);
        }
        // Made on the boot CPU, it may run on any pCPU: clear it (SDM Vol. 3C §25.11.3), so the
        // pCPU that runs it first loads it and writes its own host state.
        // SAFETY: VMX root operation; the VMCS was just made current on this CPU.
        unsafe { instructions::vmclear(vcpu.vmcs) }.map_err(|e| format!("VMCLEAR: {e}"))?;
        vcpu.host_cpu = None;
        // The guest learns which vCPU it is in RDX.
        vcpu.regs.rdx = u64::from(i);
        vcpu.index = i;
        // With local APICs, only vCPU 0 starts: the others wait for the guest's SIPI.
        vcpu.wait_for_sipi = apic && i > 0;
        if config.vpmu != hvprof_hypervisor::vm_config::Vpmu::Off {
            let mut pmu = hvprof_hypervisor::vcpu_pmu::VcpuPmu::new(config.vpmu, crate::tsc::hz());
            crate::vm::vpmu::choose_backend(&mut pmu, &mut vmcs, caps, config.name, i == 0)?;
            vcpu.pmu = Some(pmu);
        }
        vcpus.push(Mutex::new(vcpu));
    }
    Ok(Vm {
        index: index as u16,
        vcpus,
        pin: config.pin,
        ple,
        linux,
        machine_exit: linux || is_multiboot,
        task_offsets: config.task_offsets,
        mm_layout: config.mm_layout,
        module_layout: config.module_layout,
        orc_layout: config.orc_layout,
        apic,
        apic_access,
        testdev_memory,
        ins_outs_info: caps.ins_outs_info(),
        kicks: AtomicU64::new(0),
        console: Mutex::new(GuestConsole::new(crate::tsc::hz(), rdtsc())),
        running_on: (0..config.vcpus)
            .map(|_| core::sync::atomic::AtomicU8::new(super::NOT_RUNNING))
            .collect(),
        sipi: (0..config.vcpus)
            .map(|_| core::sync::atomic::AtomicU16::new(0))
            .collect(),
        unwind: &[],
        mode_epts: (0..config.vcpus).map(|_| Mutex::new(None)).collect(),
        maps: Mutex::new(Default::default()),
        output,
        name: String::from(config.name),
        mem_hpa,
        mem_size: config.mem,
        ept,
        devices: Mutex::new(VmDevices {
            board: {
                let mut b = Board::new(crate::tsc::hz(), CLOCK_START);
                // The I/O APIC's ID follows the vCPUs' APIC IDs, as the MADT says.
                b.ioapic = hvprof_hypervisor::devices::ioapic::IoApic::new(config.vcpus as u8);
                b
            },
            lapics: if apic {
                (0..config.vcpus)
                    .map(|i| hvprof_hypervisor::devices::lapic::Lapic::new(i as u8))
                    .collect()
            } else {
                Vec::new()
            },
            pm: Default::default(),
            fw_cfg: hvprof_hypervisor::devices::fw_cfg::FwCfg::new(config.vcpus, config.mem),
            testdev: config
                .testdev
                .then(hvprof_hypervisor::devices::testdev::PcTestdev::default),
            ipis: 0,
            inits: 0,
            sipis: 0,
            nmis: 0,
            io_apic_messages: 0,
            logged_ipis: Vec::new(),
            logged_msrs: Vec::new(),
            logged_ports: Vec::new(),
        }),
        budget: config.budget,
        wall_budget: config.wall_budget,
        wall_deadline: AtomicU64::new(u64::MAX),
        target,
        run_ticks: AtomicU64::new(0),
        stopping: AtomicBool::new(false),
        isolation: spin::Once::new(),
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

/// MAXPHYADDR (CPUID.80000008H:EAX[7:0], which guests see as it is), 36 when the leaf is
/// missing (SDM Vol. 3A §4.1.4).
pub fn phys_addr_bits() -> u8 {
    raw_cpuid::CpuId::new()
        .get_processor_capacity_feature_info()
        .map_or(36, |c| c.physical_address_bits())
}
