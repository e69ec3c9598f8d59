//! hvprof: a Type-1 micro-hypervisor for Intel VMX with EPT, whose first feature is a profiler
//! built into its VM-exit and NMI paths.
//!
//! Boot order (the boot CPU): `boot/` brings us to 64-bit mode and calls [`hvprof_boot_main`],
//! which copies the boot information, opens the console, loads the GDT/TSS/IDT, reads the boot
//! options, builds the frame allocator and the heap, lists the modules, reads ACPI, reports the
//! CPU and refuses clearly what it cannot run on.
#![no_std]
#![no_main]
#![deny(unsafe_op_in_unsafe_fn)]

extern crate alloc;

mod acpi;
// The CPU's own tables and devices (GDT/TSS, IDT and exception handlers, local APIC, MSRs).
mod arch;
mod channel_test;
mod console;
mod interrupts;
mod isolation;
mod memory;
mod parallel;
mod pci;
mod percpu;
mod platform;
mod power;
mod profiler;
mod run;
mod scheduler;
mod smp;
mod tsc;
mod vcpu;
mod virtio_console;
mod vm;
mod vmexit;
mod vmx_root;

use alloc::vec::Vec;
use core::fmt::Write;
use hvprof_boot::cmdline::{self, Options, SelfTest};
use hvprof_boot::entry::MULTIBOOT2_BOOTLOADER_MAGIC;
use hvprof_boot::info::{self, BootInfo, ModuleTag};
use hvprof_boot::memory::{FreeRanges, Range};

pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The boot information is copied here first thing: GRUB may leave it anywhere in free memory
/// (under UEFI in low memory), and the frame allocator must be free to hand that memory out.
const BOOT_INFO_MAX: usize = 64 * 1024;
#[repr(C, align(8))]
struct BootInfoCopy([u8; BOOT_INFO_MAX]);
static mut BOOT_INFO_COPY: BootInfoCopy = BootInfoCopy([0; BOOT_INFO_MAX]);

/// Called by the trampoline in `boot/src/entry.rs` on the boot stack, 64-bit mode, interrupts
/// off, the first 4 GiB identity-mapped.
#[unsafe(no_mangle)]
extern "C" fn hvprof_boot_main(magic: u32, info_addr: u32) -> ! {
    // The firmware's and the loader's time before the hypervisor (in an emulator that counts
    // instructions, their instructions), for the boot line.
    let entry_tsc = tsc::rdtsc();
    console::init(cmdline::DEFAULT_SERIAL);
    mask_pic();
    // The boot CPU is pCPU 0.
    percpu::init(0, arch::gdt::init_bsp());
    interrupts::init();
    {
        unsafe extern "C" {
            /// The top of the boot stack (`boot/src/entry.rs`), which stays the boot CPU's.
            static boot_stack_top: u8;
        }
        // Only the symbol's address is taken.
        let top = core::ptr::addr_of!(boot_stack_top) as u64;
        profiler::this_cpu().set_stack(top - hvprof_boot::entry::BOOT_STACK_SIZE as u64, top);
    }
    // The TSC's rate and the local APIC before the first line: from here on the console halts
    // while its UART sends, instead of spinning through the line time (87 µs a byte: the boot's
    // 1.5 KB of text before the platform report were 130 ms of spinning, 130 million
    // instructions that an emulator at 1 GHz runs one by one).
    let tsc = tsc::calibrate();
    console::set_tsc_hz(tsc.hz);
    let lapic = arch::host_apic::Lapic::init();
    if let Some(l) = lapic {
        profiler::sampler::this_cpu().set_lapic(l);
        console::halt_while_sending(|t| profiler::sampler::this_cpu().halt_for_console(t));
    }
    println!("hvprof {VERSION} build-id {}", BuildId);

    if magic != MULTIBOOT2_BOOTLOADER_MAGIC {
        println!(
            "hvprof: error: not started by a Multiboot2 loader (EAX={magic:#x}, expected {MULTIBOOT2_BOOTLOADER_MAGIC:#x})"
        );
        power::off();
    }
    let (bytes, original) = match copy_boot_info(info_addr) {
        Ok(v) => v,
        Err(e) => {
            println!("hvprof: error: {e}");
            power::off();
        }
    };
    let boot = match info::parse(bytes) {
        Ok(b) => b,
        Err(e) => {
            println!("hvprof: error: {e}");
            power::off();
        }
    };
    println!(
        "boot: loader \"{}\" cmdline \"{}\"; entered at TSC {entry_tsc}",
        boot.bootloader_name().unwrap_or("unknown"),
        boot.cmdline().unwrap_or("")
    );
    let options = match cmdline::parse(boot.cmdline().unwrap_or("")) {
        Ok(o) => o,
        Err(e) => {
            println!("hvprof: error: {e}");
            power::off();
        }
    };
    if options.serial != cmdline::DEFAULT_SERIAL {
        console::init(options.serial);
    }
    println!("options: {options}");

    init_memory(&boot, original);
    let ap_page = trampoline_page(&boot, original);
    let (guests, data) = list_modules(&boot, original);
    let (cpus, apic_ids) = init_acpi(&boot);
    if let SelfTest::Channel(records) = options.selftest {
        channel_test::run(records, options.channel, BuildId::bytes(), tsc.hz);
    }

    let cpu = match platform::report() {
        Ok(report) => report,
        Err(refusal) => {
            println!("hvprof: refused: {refusal}");
            power::off();
        }
    };

    selftest(&options);
    let period = options.period.to_tsc_ticks(tsc.hz).max(1);
    profiler::sampler::set_stack_depth(options.stacks);
    println!(
        "tsc: {} Hz ({}), invariant {}; sampling period {} = {period} ticks",
        tsc.hz,
        tsc.source,
        if tsc.invariant { "yes" } else { "no" },
        options.period
    );
    if let Err(e) = vmx_root::enable(&cpu.vmx) {
        println!("hvprof: error: cannot enter VMX operation: {e}");
        power::off();
    }
    println!("vmx: VMXON done on the boot CPU");
    vcpu::fpu::init();
    println!("{}", vcpu::fpu::describe());
    println!("{}", isolation::init());
    match &lapic {
        Some(l) => println!(
            "profiler: deadline clock: VMX-preemption timer in guests, LAPIC timer ({:?}) in the hypervisor; period {period} ticks",
            l.timer
        ),
        None => println!(
            "profiler: deadline clock: VMX-preemption timer in guests; no usable local APIC, so hypervisor time is sampled only at VM entries"
        ),
    }
    let mut online = 1usize;
    let mut tsc_skew = 0u64;
    if let (Some(l), true) = (&lapic, apic_ids.len() > 1) {
        match ap_page {
            Some(page) => {
                let r = smp::start_aps(l, &apic_ids, page, tsc.hz);
                online = r.online;
                tsc_skew = r.tsc_skew;
                println!(
                    "smp: {} of {} CPUs online; TSC skew at most {} ticks",
                    r.online,
                    apic_ids.len(),
                    r.tsc_skew
                );
            }
            None => println!(
                "smp: error: no free page below 1 MiB for the AP trampoline; running on the boot CPU only"
            ),
        }
    }
    let vms: &'static [vm::Vm] = vm::build::build_all(&cpu.vmx, &guests, &data, online).leak();
    profiler::sampler::set_unwind_tables(vms.iter().map(|v| v.unwind).collect());
    let caps: &'static hvprof_vmx::caps::VmxCaps =
        alloc::boxed::Box::leak(alloc::boxed::Box::new(cpu.vmx));
    let pmu: Option<&'static hvprof_pmu::probe::PmuInfo> = cpu
        .pmu
        .counting()
        .then(|| &*alloc::boxed::Box::leak(alloc::boxed::Box::new(cpu.pmu_info)));
    // From here on output is queued and sent between VM exits: sampling starts next, and a
    // synchronous line of 100 bytes would hold this pCPU for 8.7 ms of line time in the profile.
    // A fault on the way still sends the queue first (`console::emergency_writer`).
    console::set_queueing(true);
    let source = profiler::start(period, lapic, pmu);
    println!("profiler: sampling source: {source:?}");
    let entries: Vec<profiler::export::VmEntry> = vms
        .iter()
        .map(|v| profiler::export::VmEntry {
            name: &v.name,
            vcpus: v.vcpus.len() as u16,
            image: &v.image,
            build_id: &v.build_id,
        })
        .collect();
    profiler::export::init(
        options.export,
        options.channel,
        BuildId::bytes(),
        tsc.hz,
        online as u16,
        tsc_skew,
        period,
        source == profiler::Source::Pmu,
        options.buffer,
        &entries,
    );
    drop(entries);

    println!(
        "hvprof: ready ({cpus} CPUs, {online} running the scheduler, {} VMs)",
        vms.len()
    );
    let slice = options.slice.to_tsc_ticks(tsc.hz).max(1);
    scheduler::setup(vms, caps, slice, online);
    smp::release(Some(smp::ApWork { caps, period, pmu }));
    scheduler::run_cpu(0);
    profiler::stop();
    smp::wait_for_aps();
    console::set_queueing(false);
    for vm in vms {
        vm::report::exit_stats(vm);
    }
    profiler::export::finish();
    interrupts::STRAY.report();
    println!("hvprof: all VMs stopped");
    power::off()
}

/// Masks every line of the legacy 8259 PICs: the hypervisor takes no legacy interrupts, and
/// with external-interrupt exiting an unmasked PIT would interrupt every guest.
fn mask_pic() {
    use x86_64::instructions::port::Port;
    // SAFETY: ports 0x21 and 0xa1 are the interrupt mask registers of the master and slave
    // 8259 (OCW1); masking all lines has no other effect.
    unsafe {
        Port::<u8>::new(0x21).write(0xff);
        Port::<u8>::new(0xa1).write(0xff);
    }
}

/// Copies the boot information into `BOOT_INFO_COPY`; returns the copy and the original range.
fn copy_boot_info(addr: u32) -> Result<(&'static [u8], Range), &'static str> {
    if addr == 0 || !addr.is_multiple_of(8) {
        return Err("boot information address is null or not 8-byte aligned");
    }
    // SAFETY: a Multiboot2 loader passes the physical address of the boot information, which
    // starts with its total size (Multiboot2 spec §3.6.1); it lies below 4 GiB (it came in a
    // 32-bit register), where everything is identity-mapped.
    let size = unsafe { core::ptr::read_volatile(addr as *const u32) } as usize;
    if !(16..=BOOT_INFO_MAX).contains(&size) {
        return Err("boot information size is below 16 bytes or above 64 KiB");
    }
    // SAFETY: called once, before anything else reads BOOT_INFO_COPY; the source range
    // [addr, addr + size) is the boot information the loader left in identity-mapped memory.
    let copy = unsafe {
        let dst = &mut *core::ptr::addr_of_mut!(BOOT_INFO_COPY);
        core::ptr::copy_nonoverlapping(addr as *const u8, dst.0.as_mut_ptr(), size);
        &dst.0[..size]
    };
    Ok((copy, Range::new(addr as u64, addr as u64 + size as u64)))
}

fn init_memory(boot: &BootInfo, boot_info: Range) {
    let mut available = 0u64;
    for region in boot.memory_map() {
        println!(
            "memory: {:#018x}-{:#018x} {}",
            region.start,
            region.end(),
            region.kind
        );
        if region.is_available() {
            available += region.len;
        }
    }
    let image = memory::image_range();
    let mut excluded = [Range::default(); 3 + 32];
    // The first MiB: real-mode IVT, BDA, EBDA, option ROMs, and later the AP start-up page.
    excluded[0] = Range::new(0, 1 << 20);
    excluded[1] = image;
    excluded[2] = boot_info;
    let mut n = 3;
    for m in boot.modules().take(32) {
        excluded[n] = Range::new(m.start as u64, (m.end as u64).max(m.start as u64));
        n += 1;
    }
    let free = FreeRanges::new(
        boot.memory_map()
            .filter(|r| r.is_available())
            .map(|r| Range::new(r.start, r.end())),
        &excluded[..n],
        memory::MAPPED_LIMIT,
    );
    let above_limit: u64 = boot
        .memory_map()
        .filter(|r| r.is_available() && r.end() > memory::MAPPED_LIMIT)
        .map(|r| r.end() - r.start.max(memory::MAPPED_LIMIT))
        .sum();
    let dropped = free.dropped_bytes;
    if let Err(e) = memory::init(free) {
        println!("hvprof: error: {e}");
        power::off();
    }
    println!(
        "memory: usable {} MiB, {} free frames after excluding the image {image}, the boot info {boot_info}, the first MiB and {} modules; heap {} MiB",
        available >> 20,
        memory::free_bytes() / 4096,
        boot.modules().count(),
        memory::HEAP_SIZE >> 20,
    );
    if above_limit > 0 || dropped > 0 {
        println!(
            "memory: warning: {} MiB above 4 GiB and {} MiB in excess ranges are not used",
            above_limit >> 20,
            dropped >> 20
        );
    }
}

/// Reports every module; returns those that are loadable guest images, and those that hold data
/// a VM names by another module's `initrd=` (a Linux guest's initrd) or `unwind=` (unwind
/// tables).
fn list_modules(
    boot: &BootInfo<'static>,
    boot_info: Range,
) -> (Vec<(usize, ModuleTag<'static>)>, Vec<ModuleTag<'static>>) {
    let mut guests = Vec::new();
    let mut data = Vec::new();
    let image = memory::image_range();
    let forbidden = [
        (image.start, image.end, "the hypervisor image"),
        (boot_info.start, boot_info.end, "the boot information"),
    ];
    let configs: Vec<_> = boot
        .modules()
        .filter_map(|m| hvprof_hypervisor::vm_config::parse(m.cmdline_str().unwrap_or("")).ok())
        .collect();
    let initrd_names: Vec<&str> = configs.iter().filter_map(|c| c.initrd).collect();
    let unwind_names: Vec<&str> = configs.iter().flat_map(|c| c.unwind_modules()).collect();
    for (i, m) in boot.modules().enumerate() {
        if let Err(e) = info::check_module(&m, &forbidden, boot.memory_map()) {
            println!("module {i}: error: {e}");
            continue;
        }
        // SAFETY: `check_module` verified that [start, end) is non-empty, lies in memory the map
        // marks available (below 4 GiB: module addresses are 32-bit) and overlaps nothing of
        // ours; the frame allocator excluded it, so the bytes stay as GRUB loaded them.
        let bytes = unsafe { core::slice::from_raw_parts(m.start as *const u8, m.len() as usize) };
        let name = m.name().unwrap_or("?");
        if initrd_names.contains(&name) {
            println!(
                "module {i}: {name} {:#x}-{:#x} {} bytes: initrd of a Linux guest",
                m.start,
                m.end,
                m.len()
            );
            data.push(m);
            continue;
        }
        if unwind_names.contains(&name) {
            println!(
                "module {i}: {name} {:#x}-{:#x} {} bytes: unwind table of a guest's program",
                m.start,
                m.end,
                m.len()
            );
            data.push(m);
            continue;
        }
        let format =
            hvprof_hypervisor::vm_config::parse(m.cmdline_str().unwrap_or("")).map(|c| c.format);
        if format == Ok(hvprof_hypervisor::vm_config::Format::Real16) {
            guests.push((i, m));
            println!(
                "module {i}: {name} {:#x}-{:#x} {} bytes, args \"{}\": flat real-mode image",
                m.start,
                m.end,
                m.len(),
                m.args().unwrap_or("")
            );
            continue;
        }
        // A Multiboot 1 kernel: asked for, or recognised by its header (a 64-bit ELF with one
        // still boots as a test guest).
        let multiboot = format == Ok(hvprof_hypervisor::vm_config::Format::Multiboot)
            || hvprof_hypervisor::multiboot::is_multiboot(bytes);
        if multiboot {
            match hvprof_hypervisor::multiboot::header(bytes) {
                Ok(h) => {
                    guests.push((i, m));
                    println!(
                        "module {i}: {name} {:#x}-{:#x} {} bytes, args \"{}\": Multiboot 1 kernel (header at {:#x}, flags {:#x})",
                        m.start,
                        m.end,
                        m.len(),
                        m.args().unwrap_or(""),
                        h.offset,
                        h.flags
                    );
                }
                Err(e) => println!(
                    "module {i}: error: '{name}' ({:#x}-{:#x}, {} bytes) is not a loadable Multiboot 1 kernel: {e}",
                    m.start,
                    m.end,
                    m.len()
                ),
            }
            continue;
        }
        if let Ok(h) = hvprof_hypervisor::linux_boot::parse_header(bytes) {
            guests.push((i, m));
            println!(
                "module {i}: {name} {:#x}-{:#x} {} bytes, args \"{}\": Linux bzImage, boot protocol {}.{:02}, {} setup sectors, preferred address {:#x}, init_size {} MiB",
                m.start,
                m.end,
                m.len(),
                m.args().unwrap_or(""),
                h.version >> 8,
                h.version & 0xff,
                h.setup_sects,
                h.pref_address,
                h.init_size >> 20
            );
            continue;
        }
        match hvprof_boot::image::inspect(bytes) {
            Ok(img) => {
                guests.push((i, m));
                println!(
                    "module {i}: {name} {:#x}-{:#x} {} bytes, args \"{}\": ELF64 x86-64 executable, entry {:#x}, {} load segments at {:#x}-{:#x}",
                    m.start,
                    m.end,
                    m.len(),
                    m.args().unwrap_or(""),
                    img.entry,
                    img.load_segments,
                    img.lowest,
                    img.highest
                )
            }
            Err(e) => println!(
                "module {i}: error: '{name}' ({:#x}-{:#x}, {} bytes) is not a loadable guest image: {e}{}",
                m.start,
                m.end,
                m.len(),
                if hvprof_hypervisor::linux_boot::is_bzimage(bytes) {
                    alloc::format!(
                        " (a bzImage the loader refuses: {})",
                        hvprof_hypervisor::linux_boot::parse_header(bytes)
                            .err()
                            .map(|e| alloc::format!("{e}"))
                            .unwrap_or_default()
                    )
                } else {
                    alloc::string::String::new()
                }
            ),
        }
    }
    (guests, data)
}

/// A free 4 KiB page below 1 MiB for the AP start-up trampoline: available in the memory map,
/// not page 0 (the real-mode IVT), not the boot information, not a module.
fn trampoline_page(boot: &BootInfo, boot_info: Range) -> Option<u32> {
    let taken = |page: &Range| {
        page.overlaps(&boot_info)
            || boot
                .modules()
                .any(|m| page.overlaps(&Range::new(m.start.into(), m.end.into())))
    };
    (1..0x100u64)
        .map(|i| Range::new(i << 12, (i + 1) << 12))
        .find(|page| {
            !taken(page)
                && boot
                    .memory_map()
                    .any(|r| r.is_available() && r.start <= page.start && page.end <= r.end())
        })
        .map(|page| page.start as u32)
}

/// Reads the MADT and FADT; returns the number of CPUs and their APIC ids.
fn init_acpi(boot: &BootInfo) -> (usize, Vec<u32>) {
    let Some(rsdp) = boot.rsdp() else {
        println!("acpi: warning: the loader passed no RSDP; assuming 1 CPU, no ACPI power-off");
        return (1, Vec::new());
    };
    println!(
        "acpi: RSDP v{} at {:#x} (copy in the boot info), OEM \"{}\"",
        rsdp.version,
        rsdp.bytes.as_ptr() as usize,
        core::str::from_utf8(rsdp.oem_id()).unwrap_or("?")
    );
    match acpi::init(rsdp.bytes.as_ptr() as usize) {
        Ok(p) => {
            let mut line = alloc::string::String::new();
            for (i, id) in p.cpus[..p.cpu_count].iter().enumerate() {
                let _ = write!(
                    line,
                    "{}apic-id {id}{}",
                    if i == 0 { "" } else { ", " },
                    if i == 0 { " (boot CPU)" } else { "" }
                );
            }
            println!(
                "acpi: MADT: {} CPUs: {line}; local APIC at {:#x}",
                p.cpu_count, p.local_apic_address
            );
            if p.cpus_ignored > 0 {
                println!("acpi: warning: {} more CPUs ignored", p.cpus_ignored);
            }
            match p.power_off {
                Some(s5) => println!(
                    "acpi: FADT: PM1a_CNT {:#x}, S5 sleep type {}",
                    s5.pm1a_control, s5.slp_typ_a
                ),
                None => println!("acpi: FADT: no usable S5 power-off (will try emulator exits)"),
            }
            power::set_acpi(p.power_off);
            (p.cpu_count.max(1), p.cpus[..p.cpu_count].to_vec())
        }
        Err(e) => {
            println!("acpi: warning: {e}; assuming 1 CPU");
            (1, Vec::new())
        }
    }
}

/// `selftest=`: fault on purpose to show the handlers work.
fn selftest(options: &Options) {
    match options.selftest {
        SelfTest::None => {}
        SelfTest::Ud => {
            println!("selftest: executing UD2");
            // SAFETY: deliberately raises #UD; the exception handler reports it and powers off.
            unsafe { core::arch::asm!("ud2") };
        }
        SelfTest::PageFault => {
            println!("selftest: reading an unmapped address (64 GiB)");
            // SAFETY: deliberately raises #PF: only the first 4 GiB are mapped.
            unsafe { core::ptr::read_volatile(0x10_0000_0000 as *const u64) };
        }
        SelfTest::Gp => {
            println!("selftest: reading a non-canonical address");
            // SAFETY: deliberately raises #GP (non-canonical address).
            unsafe { core::ptr::read_volatile(0x8000_0000_0000_0000u64 as *const u64) };
        }
        SelfTest::Panic => panic!("selftest: deliberate panic"),
        // Run before the platform checks (`channel_test::run`).
        SelfTest::Channel(_) => {}
    }
}

/// The GNU build id of this image (`--build-id=sha1`), read from its own ELF note.
struct BuildId;

unsafe extern "C" {
    static __build_id_note: u8;
    static __build_id_note_end: u8;
}

impl BuildId {
    fn bytes() -> &'static [u8] {
        // SAFETY: the linker script brackets the .note.gnu.build-id section with these symbols;
        // it is read-only data inside the loaded image.
        let note = unsafe {
            let start = core::ptr::addr_of!(__build_id_note);
            let end = core::ptr::addr_of!(__build_id_note_end);
            core::slice::from_raw_parts(start, end.offset_from(start) as usize)
        };
        // Elf64_Nhdr: namesz, descsz, type (3 = NT_GNU_BUILD_ID), name "GNU\0", desc.
        let word = |i: usize| {
            note.get(i..i + 4)
                .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        };
        let (namesz, descsz) = (word(0), word(4));
        let desc = 12 + namesz.next_multiple_of(4);
        note.get(desc..desc + descsz).unwrap_or(&[])
    }
}

impl core::fmt::Display for BuildId {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let bytes = Self::bytes();
        if bytes.is_empty() {
            return f.write_str("none");
        }
        bytes.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    let mut w = console::emergency_writer();
    let _ = writeln!(w, "PANIC: {info}");
    power::off_after_fault()
}
