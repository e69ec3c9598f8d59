//! Multiboot 1 guests (`format=multiboot`, or any image with a Multiboot 1 header that is not a
//! 64-bit ELF): the kernel loaded as the Multiboot Specification 0.6.96 says a boot loader loads
//! it, with its information structure, into the VM's memory given as a byte slice (guest-physical
//! address = offset). Pure, so the host tests it on a `Vec`.
//!
//! - The header (§3.1): magic 0x1BADB002 at a 4-aligned offset in the first 8192 bytes, flags,
//!   and a checksum that makes the three add up to 0. Bits 0 (modules page-aligned: they always
//!   are) and 1 (memory information: always given) are honoured; bit 2 (a video mode) asks for
//!   what a VM without a display cannot give and is ignored, as the specification allows for an
//!   optional request; any other bit of 0-15 is a requirement this loader does not know, and the
//!   image is refused (§3.1.2). With bit 16 the header's address fields say where the image
//!   loads (the "a.out kludge"); otherwise the image must be an ELF32 executable, loaded by its
//!   program headers at their physical addresses.
//! - The machine state (§3.2): 32-bit protected mode without paging, flat 4 GiB code and data
//!   segments, interrupts off; EAX 0x2BADB002 and EBX the information structure's address.
//! - The information structure (§3.3): memory (`mem_lower`, `mem_upper` and a memory map), the
//!   command line (the VM's own arguments), the boot loader's name, and at most one module
//!   (the VM's `initrd=` file), page-aligned after the kernel. A kernel may load in
//!   conventional memory above the information page, or from 1 MiB.

use core::fmt;

use object::Endianness;
use object::read::elf::{ElfFile32, FileHeader, ProgramHeader};

use crate::guest_image::{BootState, GDT_GPA, IMAGE_MIN_GPA, StartMode};

/// The header's magic and the value EAX holds at entry (§3.1.1, §3.2).
pub const HEADER_MAGIC: u32 = 0x1bad_b002;
pub const BOOTLOADER_MAGIC: u32 = 0x2bad_b002;
/// The header lies in the image's first 8192 bytes, 4-aligned (§3.1).
const SEARCH: usize = 8192;

/// Header flags (§3.1.2).
const PAGE_ALIGN: u32 = 1 << 0;
const MEMORY_INFO: u32 = 1 << 1;
const VIDEO_MODE: u32 = 1 << 2;
const ADDRESS_FIELDS: u32 = 1 << 16;
/// The requirement bits this loader meets (or may ignore: the video mode).
const KNOWN_REQUIREMENTS: u32 = PAGE_ALIGN | MEMORY_INFO | VIDEO_MODE;

/// Information structure flags (§3.3).
const INFO_MEMORY: u32 = 1 << 0;
const INFO_CMDLINE: u32 = 1 << 2;
const INFO_MODS: u32 = 1 << 3;
const INFO_MMAP: u32 = 1 << 6;
const INFO_LOADER_NAME: u32 = 1 << 9;

/// Where the information structure and what it points to go: one page below 1 MiB.
pub const INFO_GPA: u64 = 0x2000;
const MMAP_OFFSET: u64 = 0x80;
const MODS_OFFSET: u64 = 0x180;
const NAME_OFFSET: u64 = 0x1a0;
const CMDLINE_OFFSET: u64 = 0x200;
/// The longest command line that fits in the page after it (its NUL included).
pub const CMDLINE_MAX: usize = 0x1000 - CMDLINE_OFFSET as usize - 1;
/// Where the stack pointer starts (the kernel must set its own, §3.2; this is a harmless one).
const STACK_TOP: u64 = 0x7000;
/// Conventional memory ends where a PC's EBDA begins.
const LOW_END: u64 = 0x9_fc00;
/// The BIOS area (the ACPI tables are in its last 64 KiB).
const BIOS_AREA: u64 = 0xe_0000;

/// A flat 32-bit GDT: null, code (base 0, 4 GiB, execute/read, D=1, G=1), data (read/write).
const GDT32: [u64; 3] = [0, 0x00cf_9b00_0000_ffff, 0x00cf_9300_0000_ffff];
pub const CODE_SELECTOR: u16 = 0x08;
pub const DATA_SELECTOR: u16 = 0x10;

/// A Multiboot 1 header as found in an image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Its offset in the image.
    pub offset: usize,
    pub flags: u32,
    /// The address fields (flag 16): header, load, load end, bss end, entry.
    pub addresses: Option<[u32; 5]>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MultibootError {
    /// No Multiboot 1 header in the first 8192 bytes.
    NoHeader,
    /// The magic is there but the checksum does not match (offset, flags, checksum).
    BadChecksum {
        offset: usize,
        flags: u32,
    },
    /// A requirement bit (0-15) this loader does not know.
    UnknownRequirement(u32),
    /// Flag 16 without room for its fields, or fields that do not describe the file.
    BadAddressFields(&'static str),
    /// Not an ELF32 executable (and no address fields).
    NotElf32(&'static str),
    /// A segment (or the a.out image) does not fit in the VM's memory above 1 MiB.
    OutsideMemory {
        start: u64,
        end: u64,
        mem: u64,
    },
    /// The entry point lies in no loaded segment.
    EntryOutsideImage(u64),
    CmdlineTooLong(usize),
    /// The module does not fit after the kernel.
    ModuleTooLarge {
        len: usize,
        at: u64,
        mem: u64,
    },
    /// The VM has less memory than a Multiboot kernel needs (2 MiB) or more than 4 GiB.
    MemorySize(u64),
}

impl fmt::Display for MultibootError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MultibootError::NoHeader => write!(
                f,
                "no Multiboot 1 header (magic {HEADER_MAGIC:#x}, 4-aligned) in the first {SEARCH} bytes"
            ),
            MultibootError::BadChecksum { offset, flags } => write!(
                f,
                "Multiboot 1 header at offset {offset:#x} (flags {flags:#x}): its checksum does not make magic + flags + checksum 0"
            ),
            MultibootError::UnknownRequirement(bits) => write!(
                f,
                "the Multiboot 1 header requires flag bits {bits:#x}, which this loader does not offer (the specification says to refuse the image)"
            ),
            MultibootError::BadAddressFields(why) => {
                write!(f, "Multiboot 1 header address fields (flag 16): {why}")
            }
            MultibootError::NotElf32(why) => write!(
                f,
                "a Multiboot 1 image without address fields must be an ELF32 executable: {why}"
            ),
            MultibootError::OutsideMemory { start, end, mem } => write!(
                f,
                "the kernel's {start:#x}-{end:#x} lies neither in conventional memory [{LOW_START:#x}, {LOW_END:#x}) nor in guest memory [{IMAGE_MIN_GPA:#x}, {mem:#x})"
            ),
            MultibootError::EntryOutsideImage(e) => {
                write!(f, "entry point {e:#x} lies outside every loaded segment")
            }
            MultibootError::CmdlineTooLong(n) => {
                write!(f, "command line of {n} bytes, above {CMDLINE_MAX}")
            }
            MultibootError::ModuleTooLarge { len, at, mem } => write!(
                f,
                "the module ({len} bytes) does not fit at {at:#x} in guest memory of {mem:#x} bytes"
            ),
            MultibootError::MemorySize(m) => write!(
                f,
                "guest memory of {m:#x} bytes: a Multiboot guest needs 2 MiB to 4 GiB"
            ),
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// The image's Multiboot 1 header, if it has one.
///
/// # Errors
/// `NoHeader` without the magic; `BadChecksum` or `BadAddressFields` for a damaged one.
pub fn header(image: &[u8]) -> Result<Header, MultibootError> {
    let end = image.len().min(SEARCH);
    let offset = (0..end.saturating_sub(11))
        .step_by(4)
        .find(|&o| u32_at(image, o) == Some(HEADER_MAGIC))
        .ok_or(MultibootError::NoHeader)?;
    let flags = u32_at(image, offset + 4).ok_or(MultibootError::NoHeader)?;
    let checksum = u32_at(image, offset + 8).ok_or(MultibootError::NoHeader)?;
    if HEADER_MAGIC.wrapping_add(flags).wrapping_add(checksum) != 0 {
        return Err(MultibootError::BadChecksum { offset, flags });
    }
    let addresses = if flags & ADDRESS_FIELDS != 0 {
        let mut a = [0u32; 5];
        for (i, x) in a.iter_mut().enumerate() {
            *x = u32_at(image, offset + 12 + 4 * i).ok_or(MultibootError::BadAddressFields(
                "the header ends before them",
            ))?;
        }
        Some(a)
    } else {
        None
    };
    Ok(Header {
        offset,
        flags,
        addresses,
    })
}

/// Whether `image` is a Multiboot 1 kernel that is not a 64-bit ELF (those boot as test
/// guests, whatever headers they carry).
pub fn is_multiboot(image: &[u8]) -> bool {
    let elf64 = image.get(..5) == Some(b"\x7fELF\x02");
    !elf64 && header(image).is_ok()
}

/// What [`load`] put where.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Loaded {
    pub boot: BootState,
    /// The kernel's lowest and highest (exclusive) loaded address.
    pub start: u64,
    pub end: u64,
    /// The module's guest-physical range, when there is one.
    pub module: Option<(u64, u64)>,
}

/// Where a kernel may load: conventional memory above the GDT and the information page, or RAM
/// from 1 MiB (GRUB and QEMU load kvm-unit-tests' `realmode.flat` at 0x8000).
const LOW_START: u64 = INFO_GPA + 0x1000;

fn check_range(start: u64, end: u64, mem: u64) -> Result<(), MultibootError> {
    let low = start >= LOW_START && end <= LOW_END;
    let high = start >= IMAGE_MIN_GPA && end <= mem;
    if end < start || !(low || high) {
        return Err(MultibootError::OutsideMemory { start, end, mem });
    }
    Ok(())
}

/// Loads the segments of an ELF32 image; returns (lowest, highest end, entry).
fn load_elf32(mem: &mut [u8], image: &[u8]) -> Result<(u64, u64, u64), MultibootError> {
    let size = mem.len() as u64;
    let file = ElfFile32::<Endianness>::parse(image)
        .map_err(|_| MultibootError::NotElf32("unreadable ELF32 headers"))?;
    let endian = file.endian();
    let hdr = file.elf_header();
    if hdr.e_type(endian) != object::elf::ET_EXEC {
        return Err(MultibootError::NotElf32("not an executable (ET_EXEC)"));
    }
    if hdr.e_machine(endian) != object::elf::EM_386 {
        return Err(MultibootError::NotElf32("not for the i386 architecture"));
    }
    let virtual_entry = u64::from(hdr.e_entry(endian));
    let (mut low, mut high) = (u64::MAX, 0u64);
    // The entry, physical: paging is off at entry, so a virtual entry inside a segment is
    // translated as that segment loads (as GRUB does).
    let mut entry = None;
    for ph in file.elf_program_headers() {
        if ph.p_type(endian) != object::elf::PT_LOAD {
            continue;
        }
        let start = u64::from(ph.p_paddr(endian));
        let memsz = u64::from(ph.p_memsz(endian));
        let filesz = u64::from(ph.p_filesz(endian));
        let offset = u64::from(ph.p_offset(endian));
        if filesz > memsz || offset + filesz > image.len() as u64 {
            return Err(MultibootError::NotElf32(
                "a segment's file bytes lie outside the file or exceed its size in memory",
            ));
        }
        let end = start + memsz;
        check_range(start, end, size)?;
        let dst = &mut mem[start as usize..end as usize];
        dst[..filesz as usize].copy_from_slice(&image[offset as usize..(offset + filesz) as usize]);
        dst[filesz as usize..].fill(0);
        low = low.min(start);
        high = high.max(end);
        let vaddr = u64::from(ph.p_vaddr(endian));
        if entry.is_none() && (vaddr..vaddr + memsz).contains(&virtual_entry) {
            entry = Some(start + (virtual_entry - vaddr));
        }
    }
    if high == 0 {
        return Err(MultibootError::NotElf32("no loadable segment"));
    }
    let entry = entry.ok_or(MultibootError::EntryOutsideImage(virtual_entry))?;
    Ok((low, high, entry))
}

/// Loads an image by the header's address fields (§3.1.3); returns (lowest, highest end, entry).
fn load_by_addresses(
    mem: &mut [u8],
    image: &[u8],
    h: &Header,
    [header_addr, load_addr, load_end, bss_end, entry]: [u32; 5],
) -> Result<(u64, u64, u64), MultibootError> {
    let size = mem.len() as u64;
    let bad = MultibootError::BadAddressFields;
    if load_addr > header_addr {
        return Err(bad("load_addr lies above header_addr"));
    }
    // The file offset where loading starts: the header's, less what lies before it in memory.
    let skip = u64::from(header_addr - load_addr);
    let from = (h.offset as u64).checked_sub(skip).ok_or(bad(
        "header_addr - load_addr reaches before the file's start",
    ))?;
    let text_len = if load_end == 0 {
        image.len() as u64 - from
    } else {
        u64::from(
            load_end
                .checked_sub(load_addr)
                .ok_or(bad("load_end_addr lies below load_addr"))?,
        )
    };
    if from + text_len > image.len() as u64 {
        return Err(bad("load_end_addr reaches past the end of the file"));
    }
    let start = u64::from(load_addr);
    let text_end = start + text_len;
    let end = if bss_end == 0 {
        text_end
    } else {
        u64::from(bss_end).max(text_end)
    };
    check_range(start, end, size)?;
    mem[start as usize..text_end as usize]
        .copy_from_slice(&image[from as usize..(from + text_len) as usize]);
    mem[text_end as usize..end as usize].fill(0);
    let entry = u64::from(entry);
    if !(start..end).contains(&entry) {
        return Err(MultibootError::EntryOutsideImage(entry));
    }
    Ok((start, end, entry))
}

fn put32(mem: &mut [u8], gpa: u64, v: u32) {
    mem[gpa as usize..gpa as usize + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(mem: &mut [u8], gpa: u64, v: u64) {
    mem[gpa as usize..gpa as usize + 8].copy_from_slice(&v.to_le_bytes());
}

/// The memory map (§3.3, "mmap"): conventional memory, the EBDA and BIOS area reserved, and the
/// rest of the VM's memory above 1 MiB. Each entry: size (20), base, length, type (1: RAM).
fn memory_map(mem_size: u64) -> [(u64, u64, u32); 4] {
    [
        (0, LOW_END, 1),
        (LOW_END, 0xa_0000 - LOW_END, 2),
        (BIOS_AREA, IMAGE_MIN_GPA - BIOS_AREA, 2),
        (IMAGE_MIN_GPA, mem_size - IMAGE_MIN_GPA, 1),
    ]
}

/// Loads a Multiboot 1 kernel into `mem` (all of guest memory, zeroed by the caller), with
/// `cmdline` as its command line and `module` (if any) as its one module, and builds the
/// information structure and the boot state.
///
/// # Errors
/// What is wrong with the image, or what does not fit.
pub fn load(
    mem: &mut [u8],
    image: &[u8],
    cmdline: &str,
    module: Option<&[u8]>,
) -> Result<Loaded, MultibootError> {
    let size = mem.len() as u64;
    if !(2 * IMAGE_MIN_GPA..=4 << 30).contains(&size) {
        return Err(MultibootError::MemorySize(size));
    }
    if cmdline.len() > CMDLINE_MAX {
        return Err(MultibootError::CmdlineTooLong(cmdline.len()));
    }
    let h = header(image)?;
    let unknown = h.flags & 0xffff & !KNOWN_REQUIREMENTS;
    if unknown != 0 {
        return Err(MultibootError::UnknownRequirement(unknown));
    }
    let (start, end, entry) = match h.addresses {
        Some(a) => load_by_addresses(mem, image, &h, a)?,
        None => load_elf32(mem, image)?,
    };

    // The module, page-aligned after the kernel (from 1 MiB for a kernel in low memory).
    let module_range = match module {
        None => None,
        Some(m) => {
            let at = end.max(IMAGE_MIN_GPA).next_multiple_of(0x1000);
            let m_end = at + m.len() as u64;
            if m_end > size {
                return Err(MultibootError::ModuleTooLarge {
                    len: m.len(),
                    at,
                    mem: size,
                });
            }
            mem[at as usize..m_end as usize].copy_from_slice(m);
            Some((at, m_end))
        }
    };

    // The information structure (§3.3).
    let info = INFO_GPA;
    mem[info as usize..info as usize + 0x1000].fill(0);
    let mut flags = INFO_MEMORY | INFO_CMDLINE | INFO_MMAP | INFO_LOADER_NAME;
    put32(mem, info + 4, (LOW_END / 1024) as u32);
    put32(mem, info + 8, ((size - IMAGE_MIN_GPA) / 1024) as u32);
    let cmd = info + CMDLINE_OFFSET;
    mem[cmd as usize..cmd as usize + cmdline.len()].copy_from_slice(cmdline.as_bytes());
    put32(mem, info + 16, cmd as u32);
    if let Some((m_start, m_end)) = module_range {
        flags |= INFO_MODS;
        let mods = info + MODS_OFFSET;
        put32(mem, mods, m_start as u32);
        put32(mem, mods + 4, m_end as u32);
        // The module's string: none (0), as GRUB gives an empty one; reserved 0.
        put32(mem, info + 20, 1);
        put32(mem, info + 24, mods as u32);
    }
    let mmap = info + MMAP_OFFSET;
    let entries = memory_map(size);
    for (i, (base, len, kind)) in entries.iter().enumerate() {
        let e = mmap + 24 * i as u64;
        put32(mem, e, 20);
        put64(mem, e + 4, *base);
        put64(mem, e + 12, *len);
        put32(mem, e + 20, *kind);
    }
    put32(mem, info + 44, 24 * entries.len() as u32);
    put32(mem, info + 48, mmap as u32);
    let name = info + NAME_OFFSET;
    mem[name as usize..name as usize + 7].copy_from_slice(b"hvprof\0");
    put32(mem, info + 64, name as u32);
    put32(mem, info, flags);

    for (i, d) in GDT32.iter().enumerate() {
        put64(mem, GDT_GPA + 8 * i as u64, *d);
    }
    Ok(Loaded {
        boot: BootState {
            mode: StartMode::Protected32,
            entry,
            rsp: STACK_TOP,
            cr3: 0,
            gdt_base: GDT_GPA,
            gdt_limit: (GDT32.len() * 8 - 1) as u16,
            rax: u64::from(BOOTLOADER_MAGIC),
            rbx: info,
            rdi: 0,
            rsi: 0,
            code_selector: CODE_SELECTOR,
            data_selector: DATA_SELECTOR,
        },
        start,
        end,
        module: module_range,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u32s(b: &[u8], at: u64) -> u32 {
        u32::from_le_bytes(b[at as usize..at as usize + 4].try_into().unwrap())
    }

    /// A Multiboot 1 header with `flags` at `offset` of a buffer of `len`.
    fn with_header(len: usize, offset: usize, flags: u32) -> Vec<u8> {
        let mut b = vec![0u8; len];
        b[offset..offset + 4].copy_from_slice(&HEADER_MAGIC.to_le_bytes());
        b[offset + 4..offset + 8].copy_from_slice(&flags.to_le_bytes());
        let sum = 0u32.wrapping_sub(HEADER_MAGIC).wrapping_sub(flags);
        b[offset + 8..offset + 12].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// An ELF32 executable: one PT_LOAD of `filesz` bytes (0x90 0x90 ...) at `paddr`, `memsz`
    /// in memory, entry at its start, a Multiboot header with `flags` right after the program
    /// header.
    fn elf32(paddr: u32, filesz: u32, memsz: u32, flags: u32) -> Vec<u8> {
        let data_at = 0x100u32;
        let mut b = with_header(data_at as usize + filesz as usize, 0x60, flags);
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 1; // ELFCLASS32
        b[5] = 1; // little endian
        b[6] = 1;
        b[16..18].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
        b[18..20].copy_from_slice(&3u16.to_le_bytes()); // EM_386
        b[20..24].copy_from_slice(&1u32.to_le_bytes());
        b[24..28].copy_from_slice(&paddr.to_le_bytes()); // e_entry
        b[28..32].copy_from_slice(&52u32.to_le_bytes()); // e_phoff
        b[40..42].copy_from_slice(&52u16.to_le_bytes()); // e_ehsize
        b[42..44].copy_from_slice(&32u16.to_le_bytes()); // e_phentsize
        b[44..46].copy_from_slice(&1u16.to_le_bytes()); // e_phnum
        b[46..48].copy_from_slice(&40u16.to_le_bytes());
        let ph = 52;
        b[ph..ph + 4].copy_from_slice(&1u32.to_le_bytes()); // PT_LOAD
        b[ph + 4..ph + 8].copy_from_slice(&data_at.to_le_bytes());
        b[ph + 8..ph + 12].copy_from_slice(&paddr.to_le_bytes());
        b[ph + 12..ph + 16].copy_from_slice(&paddr.to_le_bytes());
        b[ph + 16..ph + 20].copy_from_slice(&filesz.to_le_bytes());
        b[ph + 20..ph + 24].copy_from_slice(&memsz.to_le_bytes());
        b[ph + 24..ph + 28].copy_from_slice(&5u32.to_le_bytes());
        for x in &mut b[data_at as usize..] {
            *x = 0x90;
        }
        b
    }

    #[test]
    fn finds_the_header_and_checks_it() {
        let b = with_header(0x100, 0x40, 0);
        assert_eq!(
            header(&b),
            Ok(Header {
                offset: 0x40,
                flags: 0,
                addresses: None
            })
        );
        // Not 4-aligned: not a header.
        let b = with_header(0x100, 0x42, 0);
        assert_eq!(header(&b), Err(MultibootError::NoHeader));
        // Beyond the first 8192 bytes.
        let b = with_header(0x3000, 0x2000, 0);
        assert_eq!(header(&b), Err(MultibootError::NoHeader));
        let mut b = with_header(0x100, 0x40, 0);
        b[0x48] ^= 1;
        assert!(matches!(
            header(&b),
            Err(MultibootError::BadChecksum { offset: 0x40, .. })
        ));
        // Flag 16 with the header at the very end: its fields are missing.
        let b = with_header(0x4c, 0x40, ADDRESS_FIELDS);
        assert!(matches!(
            header(&b),
            Err(MultibootError::BadAddressFields(_))
        ));
        assert!(!is_multiboot(b"\x7fELF\x02 a 64-bit ELF"));
    }

    #[test]
    fn loads_an_elf32_kernel_with_its_information_structure() {
        let image = elf32(0x40_0000, 0x20, 0x3000, PAGE_ALIGN | MEMORY_INFO);
        assert!(is_multiboot(&image));
        let mut mem = vec![0xaau8; 8 << 20];
        let l = load(&mut mem, &image, "setjmp arg1", Some(b"NR_CPUS=1\n")).unwrap();
        assert_eq!((l.start, l.end), (0x40_0000, 0x40_3000));
        assert_eq!(mem[0x40_0000], 0x90);
        assert_eq!(mem[0x40_0020], 0, "bss zeroed");
        let b = l.boot;
        assert_eq!(b.mode, StartMode::Protected32);
        assert_eq!((b.entry, b.rax, b.rbx), (0x40_0000, 0x2bad_b002, INFO_GPA));
        let flags = u32s(&mem, INFO_GPA);
        assert_eq!(
            flags,
            INFO_MEMORY | INFO_CMDLINE | INFO_MODS | INFO_MMAP | INFO_LOADER_NAME
        );
        assert_eq!(u32s(&mem, INFO_GPA + 4), 639);
        assert_eq!(u32s(&mem, INFO_GPA + 8), 7 * 1024);
        let cmd = u32s(&mem, INFO_GPA + 16) as usize;
        assert_eq!(&mem[cmd..cmd + 12], b"setjmp arg1\0");
        // One module, page-aligned after the kernel.
        assert_eq!(u32s(&mem, INFO_GPA + 20), 1);
        let mods = u64::from(u32s(&mem, INFO_GPA + 24));
        assert_eq!(
            (u32s(&mem, mods), u32s(&mem, mods + 4)),
            (0x40_3000, 0x40_300a)
        );
        assert_eq!(&mem[0x40_3000..0x40_300a], b"NR_CPUS=1\n");
        assert_eq!(l.module, Some((0x40_3000, 0x40_300a)));
        // The memory map: four entries, the last all RAM above 1 MiB.
        assert_eq!(u32s(&mem, INFO_GPA + 44), 96);
        let mmap = u64::from(u32s(&mem, INFO_GPA + 48));
        let last = mmap + 72;
        assert_eq!(u32s(&mem, last), 20);
        assert_eq!(
            u64::from_le_bytes(
                mem[last as usize + 4..last as usize + 12]
                    .try_into()
                    .unwrap()
            ),
            0x10_0000
        );
        assert_eq!(u32s(&mem, last + 20), 1);
        // The GDT: flat 32-bit code and data.
        assert_eq!(
            u64::from_le_bytes(mem[0x1008..0x1010].try_into().unwrap()),
            0x00cf_9b00_0000_ffff
        );
    }

    #[test]
    fn loads_by_the_address_fields() {
        // A flat image: the header at file offset 0x10, which loads at 0x100010; text to the
        // end of the file, bss to 0x102000, entry 0x100040.
        let mut image = with_header(0x80, 0x10, ADDRESS_FIELDS);
        for (i, v) in [0x10_0010u32, 0x10_0000, 0, 0x10_2000, 0x10_0040]
            .iter()
            .enumerate()
        {
            image[0x1c + 4 * i..0x20 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        image[0x40] = 0xf4;
        let mut mem = vec![0xaau8; 4 << 20];
        let l = load(&mut mem, &image, "", None).unwrap();
        assert_eq!(
            (l.start, l.end, l.boot.entry),
            (0x10_0000, 0x10_2000, 0x10_0040)
        );
        assert_eq!(mem[0x10_0040], 0xf4);
        assert_eq!(mem[0x10_0080], 0, "bss zeroed");
        assert_eq!(u32s(&mem, INFO_GPA) & INFO_MODS, 0);
    }

    #[test]
    fn refuses_what_it_cannot_load() {
        let mut mem = vec![0u8; 4 << 20];
        // An unknown requirement bit.
        let image = elf32(0x20_0000, 0x10, 0x10, 1 << 5);
        assert_eq!(
            load(&mut mem, &image, "", None),
            Err(MultibootError::UnknownRequirement(1 << 5))
        );
        // Over the information page, or across the EBDA and BIOS area.
        for at in [0x2000, 0x9f000] {
            let image = elf32(at, 0x10, 0x1000, 0);
            assert!(matches!(
                load(&mut mem, &image, "", None),
                Err(MultibootError::OutsideMemory { .. })
            ));
        }
        // In conventional memory, as realmode.flat loads: allowed, its module from 1 MiB.
        let image = elf32(0x8000, 0x10, 0x2000, 0);
        let l = load(&mut mem, &image, "", Some(b"env")).unwrap();
        assert_eq!((l.start, l.module), (0x8000, Some((0x10_0000, 0x10_0003))));
        // Beyond the VM's memory.
        let image = elf32(0x3f_f000, 0x10, 0x2000, 0);
        assert!(matches!(
            load(&mut mem, &image, "", None),
            Err(MultibootError::OutsideMemory { .. })
        ));
        // A module that does not fit.
        let image = elf32(0x20_0000, 0x10, 0x10, 0);
        let big = vec![0u8; 3 << 20];
        assert!(matches!(
            load(&mut mem, &image, "", Some(&big)),
            Err(MultibootError::ModuleTooLarge { .. })
        ));
        // Not an ELF, no address fields.
        let image = with_header(0x100, 0x40, 0);
        assert!(matches!(
            load(&mut mem, &image, "", None),
            Err(MultibootError::NotElf32(_))
        ));
        let long = "x".repeat(CMDLINE_MAX + 1);
        let image = elf32(0x20_0000, 0x10, 0x10, 0);
        assert_eq!(
            load(&mut mem, &image, &long, None),
            Err(MultibootError::CmdlineTooLong(CMDLINE_MAX + 1))
        );
        let mut small = vec![0u8; 1 << 20];
        assert!(matches!(
            load(&mut small, &image, "", None),
            Err(MultibootError::MemorySize(_))
        ));
    }

    proptest::proptest! {
        /// Any bytes: the loader never panics, and whatever it accepts starts in protected
        /// mode at an address inside what it loaded.
        #[test]
        fn any_image_loads_or_is_refused(
            mut bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..0x400),
            flags in proptest::prelude::any::<u32>(),
            elf in proptest::prelude::any::<bool>(),
        ) {
            if bytes.len() >= 0x40 {
                let h = with_header(0x40, 0x20, flags & (ADDRESS_FIELDS | 0x7));
                bytes[..0x40].copy_from_slice(&h);
                if elf {
                    bytes[..4].copy_from_slice(b"\x7fELF");
                    bytes[4] = 1;
                }
            }
            let mut mem = vec![0u8; 4 << 20];
            if let Ok(l) = load(&mut mem, &bytes, "x", Some(b"m")) {
                proptest::prop_assert!(l.start <= l.boot.entry && l.boot.entry < l.end);
                proptest::prop_assert!(l.end <= mem.len() as u64);
            }
        }
    }
}
