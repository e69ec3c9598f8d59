//! Loading a Linux bzImage through the x86 64-bit boot protocol (the kernel's
//! `Documentation/arch/x86/boot.rst`, "64-bit Boot Protocol"): the protected-mode kernel is copied
//! to its preferred address, `boot_params` (the "zero page") gets the setup header, an e820
//! memory map, the command line and the initrd, and the vCPU starts in 64-bit mode at
//! `load address + 0x200` with RSI pointing at `boot_params`, interrupts off, and an identity map
//! covering the kernel, the zero page, the command line and the initrd.
//!
//! The setup header is read by `hvprof_linux_boot` (`shared/linux-boot`), the one parser the
//! host tools use too. The bzImage decompresses itself in the guest, so the loader needs no
//! decompressor. Pure: the host tests it on a `Vec`.

use crate::guest_image::{BootState, PD_GPA, PDPT_GPA, PML4_GPA, StartMode};
use core::fmt;
use hvprof_linux_boot::boot_params::{
    E820_ENTRIES, E820_ENTRY_SIZE, E820_MAX_ENTRIES, E820_RAM, E820_RESERVED, E820_TABLE,
    EXT_CMD_LINE_PTR, EXT_RAMDISK_IMAGE, EXT_RAMDISK_SIZE,
};
use hvprof_linux_boot::{HeaderError, LOADED_HIGH, LOADER_UNDEFINED, MIN_LEN, offset as off};
/// The setup header, parsed by the crate the host tools share (`shared/linux-boot`).
pub use hvprof_linux_boot::{SetupHeader, looks_like_bzimage as is_bzimage};

/// Where the loader puts its own pieces (all below 1 MiB, in RAM the e820 map reports as usable:
/// Linux reclaims it once it runs on its own page tables).
pub const GDT_GPA: u64 = 0x1000;
pub const BOOT_PARAMS_GPA: u64 = 0x1_0000;
pub const CMDLINE_GPA: u64 = 0x2_0000;
/// The conventional memory's end (the EBDA and the BIOS area above are reserved).
pub const LOW_RAM_END: u64 = 0x9_fc00;
pub const HIGH_RAM_START: u64 = 0x10_0000;

/// The boot protocol's selectors: `__BOOT_CS` = 0x10 (64-bit code here) and `__BOOT_DS` = 0x18.
pub const CODE_SELECTOR: u16 = 0x10;
pub const DATA_SELECTOR: u16 = 0x18;
const GDT: [u64; 4] = [0, 0, 0x00af_9b00_0000_ffff, 0x00cf_9300_0000_ffff];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinuxError {
    /// Not a bzImage: no "HdrS" or boot flag.
    NotBzImage,
    /// The header is older than what the 64-bit entry needs, or lacks it.
    Protocol(&'static str, u16),
    Truncated {
        needed: usize,
        len: usize,
    },
    CmdlineTooLong {
        len: usize,
        max: u32,
    },
    /// The kernel (with its `init_size`) and the initrd do not fit in guest memory.
    NoRoom {
        what: &'static str,
        need: u64,
        mem: u64,
    },
}

impl fmt::Display for LinuxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinuxError::NotBzImage => f.write_str(
                "not a Linux bzImage (no \"HdrS\" setup header at offset 0x202, or no 0xAA55 boot flag)",
            ),
            LinuxError::Protocol(what, v) => write!(
                f,
                "bzImage boot protocol {}.{:02}: {what}",
                v >> 8,
                v & 0xff
            ),
            LinuxError::Truncated { needed, len } => write!(
                f,
                "bzImage truncated: the header says {needed} bytes, the module has {len}"
            ),
            LinuxError::CmdlineTooLong { len, max } => write!(
                f,
                "kernel command line of {len} bytes is longer than the kernel's limit of {max}"
            ),
            LinuxError::NoRoom { what, need, mem } => write!(
                f,
                "{what} needs {} MiB more than the {} MiB of guest memory give (raise mem=)",
                need.div_ceil(1 << 20),
                mem >> 20
            ),
        }
    }
}

/// Copies `bytes` to guest-physical `at`; `NoRoom` if they do not all fit in `mem` (the image's
/// header chooses some of these addresses: nothing it says may index outside guest memory).
fn put(mem: &mut [u8], at: u64, bytes: &[u8]) -> Result<(), LinuxError> {
    let size = mem.len() as u64;
    let room = usize::try_from(at)
        .ok()
        .and_then(|start| Some(start..start.checked_add(bytes.len())?))
        .and_then(|range| mem.get_mut(range));
    match room {
        Some(dst) => {
            dst.copy_from_slice(bytes);
            Ok(())
        }
        None => Err(LinuxError::NoRoom {
            what: "a part of the boot image at the address the header gives",
            need: at.saturating_add(bytes.len() as u64).saturating_sub(size),
            mem: size,
        }),
    }
}

/// Reads and checks the setup header (`hvprof_linux_boot`): protocol 2.12 or later, with the
/// 64-bit entry this loader uses.
pub fn parse_header(image: &[u8]) -> Result<SetupHeader, LinuxError> {
    if !is_bzimage(image) {
        return Err(LinuxError::NotBzImage);
    }
    let h = SetupHeader::parse(image).map_err(|e| match e {
        HeaderError::BootFlag(_) | HeaderError::Magic(_) => LinuxError::NotBzImage,
        HeaderError::Protocol(v) => {
            LinuxError::Protocol("2.12 or later is needed for the 64-bit entry", v)
        }
        HeaderError::TooShort { len } => LinuxError::Truncated {
            needed: MIN_LEN,
            len,
        },
        HeaderError::KernelPastEnd { kernel_offset, len } => LinuxError::Truncated {
            needed: kernel_offset + 1,
            len,
        },
        HeaderError::Payload { start, length, len } => LinuxError::Truncated {
            needed: usize::try_from(start + u64::from(length)).unwrap_or(usize::MAX),
            len,
        },
    })?;
    if !h.has_64bit_entry() {
        return Err(LinuxError::Protocol(
            "the kernel has no 64-bit entry point (XLF_KERNEL_64 clear)",
            h.version,
        ));
    }
    Ok(h)
}

/// Where things went, for the boot log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinuxLayout {
    pub header: SetupHeader,
    pub kernel_gpa: u64,
    pub kernel_len: u64,
    pub initrd_gpa: u64,
    pub initrd_len: u64,
    pub entry: u64,
}

/// `boot_params.acpi_rsdp_addr` (boot protocol 2.14+, offset 0x070): where the kernel finds the
/// RSDP without scanning for it.
const ACPI_RSDP_ADDR: u64 = 0x070;

/// Tells a loaded kernel where its ACPI tables' RSDP is (`load` first).
pub fn set_acpi_rsdp(mem: &mut [u8], rsdp: u64) -> Result<(), LinuxError> {
    put(mem, BOOT_PARAMS_GPA + ACPI_RSDP_ADDR, &rsdp.to_le_bytes())
}

/// The e820 map of a guest with `mem` bytes of RAM: conventional memory, the reserved EBDA and
/// BIOS area, then RAM from 1 MiB to the end.
pub fn e820(mem: u64) -> [(u64, u64, u32); 4] {
    [
        (0, LOW_RAM_END, E820_RAM),
        (LOW_RAM_END, 0xa_0000 - LOW_RAM_END, E820_RESERVED),
        (0xf_0000, 0x1_0000, E820_RESERVED),
        (HIGH_RAM_START, mem - HIGH_RAM_START, E820_RAM),
    ]
}

/// Loads `image` (a bzImage) with `initrd` and `cmdline` into `mem` (all of guest memory,
/// zeroed) and returns the vCPU's start and the layout.
pub fn load(
    mem: &mut [u8],
    image: &[u8],
    initrd: &[u8],
    cmdline: &str,
) -> Result<(BootState, LinuxLayout), LinuxError> {
    let h = parse_header(image)?;
    let size = mem.len() as u64;
    // 1. The protected-mode kernel at its preferred address (it is relocatable and decompresses
    //    itself; KASLR may move it later, inside the e820 RAM).
    let kernel = &image[h.kernel_offset()..];
    let kernel_len = kernel.len() as u64;
    let kernel_gpa = h.pref_address.max(HIGH_RAM_START);
    let kernel_end = kernel_gpa.saturating_add(u64::from(h.init_size).max(kernel_len));
    if kernel_end > size {
        return Err(LinuxError::NoRoom {
            what: "the kernel's init_size from its load address",
            need: kernel_end - size,
            mem: size,
        });
    }
    put(mem, kernel_gpa, kernel)?;

    // 2. The initrd at the top of memory (below initrd_addr_max), page-aligned, above the kernel.
    let initrd_len = initrd.len() as u64;
    let mut initrd_gpa = 0;
    if !initrd.is_empty() {
        let top = size.min(u64::from(h.initrd_addr_max).saturating_add(1));
        let at = top.saturating_sub(initrd_len) & !0xfff;
        if at < kernel_end || top < initrd_len {
            return Err(LinuxError::NoRoom {
                what: "the initrd above the kernel",
                need: kernel_end.saturating_add(initrd_len).saturating_sub(top),
                mem: size,
            });
        }
        initrd_gpa = at;
        put(mem, initrd_gpa, initrd)?;
    }

    // 3. The command line.
    let max = if h.cmdline_size == 0 {
        255
    } else {
        h.cmdline_size
    };
    if cmdline.len() as u64 > u64::from(max) {
        return Err(LinuxError::CmdlineTooLong {
            len: cmdline.len(),
            max,
        });
    }
    put(mem, CMDLINE_GPA, cmdline.as_bytes())?;
    put(mem, CMDLINE_GPA + cmdline.len() as u64, &[0])?;

    // 4. boot_params: the setup header as the file has it, then what the loader fills in.
    let bp = BOOT_PARAMS_GPA;
    let at = |o: usize| bp + o as u64;
    put(
        mem,
        at(off::SETUP_SECTS),
        hvprof_linux_boot::setup_header_bytes(image),
    )?;
    put(mem, at(off::TYPE_OF_LOADER), &[LOADER_UNDEFINED])?;
    put(mem, at(off::LOADFLAGS), &[h.loadflags | LOADED_HIGH])?;
    let put32 = |mem: &mut [u8], o: usize, v: u64| put(mem, at(o), &(v as u32).to_le_bytes());
    put32(mem, off::CMD_LINE_PTR, CMDLINE_GPA)?;
    put32(mem, EXT_CMD_LINE_PTR, CMDLINE_GPA >> 32)?;
    put32(mem, off::RAMDISK_IMAGE, initrd_gpa)?;
    put32(mem, EXT_RAMDISK_IMAGE, initrd_gpa >> 32)?;
    put32(mem, off::RAMDISK_SIZE, initrd_len)?;
    put32(mem, EXT_RAMDISK_SIZE, initrd_len >> 32)?;
    let map = e820(size);
    put(mem, at(E820_ENTRIES), &[map.len() as u8])?;
    const _: () = assert!(4 <= E820_MAX_ENTRIES);
    for (i, (addr, len, kind)) in map.iter().enumerate() {
        let entry = at(E820_TABLE + E820_ENTRY_SIZE * i);
        put(mem, entry, &addr.to_le_bytes())?;
        put(mem, entry + 8, &len.to_le_bytes())?;
        put(mem, entry + 16, &kind.to_le_bytes())?;
    }

    // 5. GDT and identity map of all guest memory with 2 MiB pages.
    for (i, d) in GDT.iter().enumerate() {
        put(mem, GDT_GPA + 8 * i as u64, &d.to_le_bytes())?;
    }
    put(mem, PML4_GPA, &(PDPT_GPA | 0x3).to_le_bytes())?;
    let pages = size.div_ceil(2 << 20);
    for i in 0..pages.div_ceil(512) {
        put(
            mem,
            PDPT_GPA + 8 * i,
            &((PD_GPA + 0x1000 * i) | 0x3).to_le_bytes(),
        )?;
    }
    for p in 0..pages {
        put(mem, PD_GPA + 8 * p, &((p << 21) | 0x83).to_le_bytes())?;
    }
    let entry = kernel_gpa + 0x200;
    Ok((
        BootState {
            mode: StartMode::Long64,
            entry,
            // The kernel sets up its own stack before it uses one.
            rsp: BOOT_PARAMS_GPA,
            cr3: PML4_GPA,
            gdt_base: GDT_GPA,
            gdt_limit: (GDT.len() * 8 - 1) as u16,
            rax: 0,
            rbx: 0,
            rdi: 0,
            rsi: BOOT_PARAMS_GPA,
            code_selector: CODE_SELECTOR,
            data_selector: DATA_SELECTOR,
        },
        LinuxLayout {
            header: h,
            kernel_gpa,
            kernel_len,
            initrd_gpa,
            initrd_len,
            entry,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;
    use alloc::vec::Vec;

    fn u32_at(b: &[u8], o: usize) -> u32 {
        u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
    }
    fn u64_at(b: &[u8], o: usize) -> u64 {
        u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
    }

    /// A minimal bzImage: boot sector with the header, `setup_sects` setup sectors, then a
    /// "kernel" of `kernel` bytes.
    fn bzimage(setup_sects: u8, kernel: usize, version: u16, xlf: u16) -> Vec<u8> {
        let mut b = vec![0u8; (usize::from(setup_sects) + 1) * 512 + kernel];
        b[off::SETUP_SECTS] = setup_sects;
        b[off::BOOT_FLAG..off::BOOT_FLAG + 2].copy_from_slice(&0xaa55u16.to_le_bytes());
        b[off::JUMP_LENGTH] = 0x6a; // header up to 0x26c, as 2.15 kernels have
        b[off::HEADER..off::HEADER + 4]
            .copy_from_slice(&hvprof_linux_boot::HEADER_MAGIC.to_le_bytes());
        b[off::VERSION..off::VERSION + 2].copy_from_slice(&version.to_le_bytes());
        b[off::LOADFLAGS] = 0x01;
        b[off::INITRD_ADDR_MAX..off::INITRD_ADDR_MAX + 4]
            .copy_from_slice(&0x7fff_ffffu32.to_le_bytes());
        b[off::KERNEL_ALIGNMENT..off::KERNEL_ALIGNMENT + 4]
            .copy_from_slice(&0x20_0000u32.to_le_bytes());
        b[off::RELOCATABLE_KERNEL] = 1;
        b[off::XLOADFLAGS..off::XLOADFLAGS + 2].copy_from_slice(&xlf.to_le_bytes());
        b[off::CMDLINE_SIZE..off::CMDLINE_SIZE + 4].copy_from_slice(&2047u32.to_le_bytes());
        b[off::PREF_ADDRESS..off::PREF_ADDRESS + 8].copy_from_slice(&0x100_0000u64.to_le_bytes());
        b[off::INIT_SIZE..off::INIT_SIZE + 4].copy_from_slice(&0x200_0000u32.to_le_bytes());
        let k = (usize::from(setup_sects) + 1) * 512;
        for (i, x) in b[k..].iter_mut().enumerate() {
            *x = (i % 251) as u8;
        }
        b
    }

    #[test]
    fn loads_kernel_initrd_cmdline_and_zero_page() {
        let img = bzimage(27, 5000, 0x020f, 0x7f);
        let initrd: Vec<u8> = (0..10_000u32).map(|i| (i % 7) as u8).collect();
        let mut mem = vec![0u8; 64 << 20];
        let (boot, lay) = load(&mut mem, &img, &initrd, "console=ttyS0 quiet").unwrap();
        assert_eq!(lay.header.setup_sects, 27);
        assert_eq!(lay.kernel_gpa, 0x100_0000);
        assert_eq!(boot.entry, 0x100_0200);
        assert_eq!(&mem[0x100_0000..0x100_0000 + 5000], &img[28 * 512..]);
        // The initrd at the top, page-aligned.
        assert_eq!(lay.initrd_gpa, ((64 << 20) - 10_000) & !0xfff);
        let i = lay.initrd_gpa as usize;
        assert_eq!(&mem[i..i + initrd.len()], &initrd[..]);
        let bp = BOOT_PARAMS_GPA as usize;
        assert_eq!(u32_at(&mem, bp + off::RAMDISK_IMAGE) as u64, lay.initrd_gpa);
        assert_eq!(u32_at(&mem, bp + off::RAMDISK_SIZE), 10_000);
        assert_eq!(u32_at(&mem, bp + off::CMD_LINE_PTR) as u64, CMDLINE_GPA);
        assert_eq!(
            &mem[CMDLINE_GPA as usize..CMDLINE_GPA as usize + 20],
            b"console=ttyS0 quiet\0"
        );
        assert_eq!(
            u32_at(&mem, bp + off::HEADER),
            hvprof_linux_boot::HEADER_MAGIC
        );
        assert_eq!(mem[bp + off::TYPE_OF_LOADER], 0xff);
        // e820: four entries, the last one RAM from 1 MiB to the end.
        assert_eq!(mem[bp + E820_ENTRIES], 4);
        let last = bp + E820_TABLE + 3 * 20;
        assert_eq!(u64_at(&mem, last), 0x10_0000);
        assert_eq!(u64_at(&mem, last + 8), (64 << 20) - 0x10_0000);
        assert_eq!(u32_at(&mem, last + 16), E820_RAM);
        // The boot protocol's state: RSI = boot_params, __BOOT_CS / __BOOT_DS selectors.
        assert_eq!(boot.rsi, BOOT_PARAMS_GPA);
        assert_eq!((boot.code_selector, boot.data_selector), (0x10, 0x18));
        assert_eq!(u64_at(&mem, (GDT_GPA + 0x10) as usize), GDT[2]);
        // The identity map covers all memory: PD entry 31 maps 62 MiB.
        assert_eq!(u64_at(&mem, (PD_GPA + 8 * 31) as usize), (31 << 21) | 0x83);
    }

    #[test]
    fn refusals() {
        let mut mem = vec![0u8; 64 << 20];
        assert_eq!(
            load(&mut mem, b"not a kernel", &[], "").unwrap_err(),
            LinuxError::NotBzImage
        );
        let old = bzimage(4, 100, 0x020a, 0);
        assert!(matches!(
            load(&mut mem, &old, &[], ""),
            Err(LinuxError::Protocol(_, 0x020a))
        ));
        let no64 = bzimage(4, 100, 0x020f, 0);
        assert!(matches!(
            load(&mut mem, &no64, &[], ""),
            Err(LinuxError::Protocol(_, 0x020f))
        ));
        let img = bzimage(4, 100, 0x020f, 1);
        let mut small = vec![0u8; 32 << 20];
        let e = load(&mut small, &img, &[], "").unwrap_err();
        assert!(matches!(e, LinuxError::NoRoom { .. }), "{e}");
        assert!(e.to_string().contains("raise mem="));
        let big_initrd = vec![1u8; 40 << 20];
        assert!(matches!(
            load(&mut mem, &img, &big_initrd, ""),
            Err(LinuxError::NoRoom {
                what: "the initrd above the kernel",
                ..
            })
        ));
        let long = "x".repeat(3000);
        assert_eq!(
            load(&mut mem, &img, &[], &long).unwrap_err(),
            LinuxError::CmdlineTooLong {
                len: 3000,
                max: 2047
            }
        );
        let mut truncated = bzimage(30, 0, 0x020f, 1);
        truncated.truncate(2000);
        assert!(matches!(
            parse_header(&truncated),
            Err(LinuxError::Truncated { .. })
        ));
    }

    /// A header whose preferred address or sizes run past the end of the address space is
    /// refused, not a panic (the sum used to overflow, then index guest memory out of bounds).
    #[test]
    fn absurd_header_addresses_are_refused() {
        let mut mem = vec![0u8; 40 << 20];
        for (pref, init, initrd_max) in [
            (u64::MAX - 0x1000, 0x100_0000u32, u32::MAX),
            (u64::MAX, u32::MAX, u32::MAX),
            (0x1000_0000_0000_0000, 1, 0),
            (0x100_0000, u32::MAX, u32::MAX),
        ] {
            let mut img = bzimage(4, 64, 0x020f, 1);
            img[off::PREF_ADDRESS..off::PREF_ADDRESS + 8].copy_from_slice(&pref.to_le_bytes());
            img[off::INIT_SIZE..off::INIT_SIZE + 4].copy_from_slice(&init.to_le_bytes());
            img[off::INITRD_ADDR_MAX..off::INITRD_ADDR_MAX + 4]
                .copy_from_slice(&initrd_max.to_le_bytes());
            match load(&mut mem, &img, &[1; 4096], "console=ttyS0") {
                Err(LinuxError::NoRoom { .. }) => {}
                other => panic!("pref {pref:#x} init {init:#x}: {other:?}"),
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn header_numbers_never_panic(pref in proptest::num::u64::ANY,
                                      init in proptest::num::u32::ANY,
                                      initrd_max in proptest::num::u32::ANY,
                                      initrd_len in 0usize..8192) {
            let mut img = bzimage(4, 64, 0x020f, 1);
            img[off::PREF_ADDRESS..off::PREF_ADDRESS + 8].copy_from_slice(&pref.to_le_bytes());
            img[off::INIT_SIZE..off::INIT_SIZE + 4].copy_from_slice(&init.to_le_bytes());
            img[off::INITRD_ADDR_MAX..off::INITRD_ADDR_MAX + 4]
                .copy_from_slice(&initrd_max.to_le_bytes());
            let mut mem = vec![0u8; 8 << 20];
            let _ = load(&mut mem, &img, &vec![7u8; initrd_len], "console=ttyS0");
        }

        #[test]
        fn never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..2048),
                        patch in proptest::num::u8::ANY) {
            let mut img = bzimage(4, 64, 0x020f, 1);
            for (i, b) in bytes.iter().enumerate() {
                let at = 0x1f1 + (i * 7 + usize::from(patch)) % 0x80;
                img[at] = *b;
            }
            let mut mem = vec![0u8; 40 << 20];
            let _ = load(&mut mem, &img, &bytes, "console=ttyS0");
            let _ = load(&mut mem, &bytes, &[], "");
        }
    }
}
