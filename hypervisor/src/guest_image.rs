//! A test guest's initial memory (docs/GUEST-ABI.md): the ELF image's segments, a GDT, the
//! argument page and identity-mapping page tables, written into the VM's memory given as a byte
//! slice (guest-physical address = offset). Pure, so the host tests it on a `Vec`.

use core::fmt;
use hvprof_boot::image::{self, ImageError};
use object::Endianness;
use object::read::elf::{ElfFile64, ProgramHeader};

pub const GDT_GPA: u64 = 0x1000;
pub const ARGS_GPA: u64 = 0x2000;
pub const PML4_GPA: u64 = 0x3000;
pub const PDPT_GPA: u64 = 0x4000;
pub const PD_GPA: u64 = 0x5000;
/// Images load at or above 1 MiB.
pub const IMAGE_MIN_GPA: u64 = 0x10_0000;
pub const ARGS_MAX: usize = 4095;

/// Selectors in the guest GDT.
pub const CODE_SELECTOR: u16 = 0x08;
pub const DATA_SELECTOR: u16 = 0x10;
/// 64-bit code (L=1, P, S, type execute/read, accessed) and data (P, S, read/write, accessed,
/// G, D/B) descriptors (Intel SDM Vol. 3A §3.4.5).
const GDT: [u64; 3] = [0, 0x00af_9b00_0000_ffff, 0x00cf_9300_0000_ffff];
/// Access rights in the VMCS format (SDM Vol. 3C §25.4.1, Table 25-2) of the same segments.
pub const CODE_ACCESS_RIGHTS: u32 = 0xa09b;
pub const DATA_ACCESS_RIGHTS: u32 = 0xc093;

/// The mode a guest starts in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartMode {
    /// 64-bit mode with the hypervisor's page tables and GDT.
    Long64,
    /// Real mode, paging and protection off (needs unrestricted guest, SDM Vol. 3C §26.6).
    Real16,
    /// 32-bit protected mode, paging off, flat segments from the GDT at `gdt_base` (a Multiboot
    /// 1 kernel's entry state; needs unrestricted guest too).
    Protected32,
}

impl StartMode {
    /// Whether the vCPU starts outside IA-32e mode (and so needs unrestricted guest).
    #[must_use]
    pub fn legacy(self) -> bool {
        self != StartMode::Long64
    }
}

/// A flat real-mode image loads here (0000:7C00, like a boot sector) ...
pub const REAL16_LOAD: u64 = 0x7c00;
/// ... and may reach up to the EBDA's usual start.
pub const REAL16_END: u64 = 0x8_0000;

/// Where the guest starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BootState {
    pub mode: StartMode,
    pub entry: u64,
    pub rsp: u64,
    pub cr3: u64,
    pub gdt_base: u64,
    pub gdt_limit: u16,
    /// EAX and EBX at entry (a Multiboot kernel's magic and information structure).
    pub rax: u64,
    pub rbx: u64,
    pub rdi: u64,
    pub rsi: u64,
    /// The code and data selectors in the GDT at `gdt_base` (64-bit mode).
    pub code_selector: u16,
    pub data_selector: u16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadError {
    Image(ImageError),
    SegmentOutsideMemory {
        index: usize,
        start: u64,
        end: u64,
        mem: u64,
    },
    EntryOutsideImage(u64),
    ArgsTooLong(usize),
    MemoryTooSmall(u64),
    FlatImageSize(usize),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Image(e) => write!(f, "{e}"),
            LoadError::SegmentOutsideMemory {
                index,
                start,
                end,
                mem,
            } => write!(
                f,
                "ELF segment {index} ({start:#x}-{end:#x}) does not fit in guest memory [{IMAGE_MIN_GPA:#x}, {mem:#x})"
            ),
            LoadError::EntryOutsideImage(e) => {
                write!(
                    f,
                    "ELF entry point {e:#x} lies outside every loaded segment"
                )
            }
            LoadError::ArgsTooLong(n) => {
                write!(f, "module arguments are {n} bytes, above {ARGS_MAX}")
            }
            LoadError::MemoryTooSmall(m) => write!(f, "guest memory of {m:#x} bytes is too small"),
            LoadError::FlatImageSize(n) => write!(
                f,
                "a real-mode image of {n} bytes does not fit between {REAL16_LOAD:#x} and {REAL16_END:#x}"
            ),
        }
    }
}

/// Loads `elf` into `mem` (all of guest memory, zeroed by the caller) and builds the boot state.
pub fn load(mem: &mut [u8], elf: &[u8], args: &str) -> Result<BootState, LoadError> {
    let size = mem.len() as u64;
    if !(2 * IMAGE_MIN_GPA..=4 << 30).contains(&size) {
        return Err(LoadError::MemoryTooSmall(size));
    }
    if args.len() > ARGS_MAX {
        return Err(LoadError::ArgsTooLong(args.len()));
    }
    let info = image::inspect(elf).map_err(LoadError::Image)?;
    let file = ElfFile64::<Endianness>::parse(elf)
        .map_err(|_| LoadError::Image(ImageError::Malformed("unreadable headers")))?;
    let endian = file.endian();
    let mut entry_ok = false;
    for (index, ph) in file.elf_program_headers().iter().enumerate() {
        if ph.p_type(endian) != object::elf::PT_LOAD {
            continue;
        }
        let start = ph.p_paddr(endian);
        let memsz = ph.p_memsz(endian);
        // `inspect` checked that the range does not overflow and that filesz <= memsz lies in
        // the file.
        let end = start + memsz;
        if start < IMAGE_MIN_GPA || end > size {
            return Err(LoadError::SegmentOutsideMemory {
                index,
                start,
                end,
                mem: size,
            });
        }
        let offset = ph.p_offset(endian) as usize;
        let filesz = ph.p_filesz(endian) as usize;
        let dst = &mut mem[start as usize..end as usize];
        dst[..filesz].copy_from_slice(&elf[offset..offset + filesz]);
        dst[filesz..].fill(0);
        entry_ok |= (ph.p_vaddr(endian)..ph.p_vaddr(endian) + memsz).contains(&info.entry);
    }
    if !entry_ok {
        return Err(LoadError::EntryOutsideImage(info.entry));
    }

    for (i, d) in GDT.iter().enumerate() {
        put_u64(mem, GDT_GPA + 8 * i as u64, *d);
    }
    let a = ARGS_GPA as usize;
    mem[a..a + args.len()].copy_from_slice(args.as_bytes());
    mem[a + args.len()] = 0;

    // Identity map of [0, size) with 2 MiB pages (SDM Vol. 3A §5.5, 4-level paging): PML4[0] ->
    // PDPT; PDPT[i] -> PD i; PD entries P | RW | PS.
    put_u64(mem, PML4_GPA, PDPT_GPA | 0x3);
    let pages = size.div_ceil(2 << 20);
    for i in 0..pages.div_ceil(512) {
        put_u64(mem, PDPT_GPA + 8 * i, (PD_GPA + 0x1000 * i) | 0x3);
    }
    for p in 0..pages {
        put_u64(mem, PD_GPA + 8 * p, (p << 21) | 0x83);
    }
    Ok(BootState {
        mode: StartMode::Long64,
        entry: info.entry,
        rsp: size,
        cr3: PML4_GPA,
        gdt_base: GDT_GPA,
        gdt_limit: (GDT.len() * 8 - 1) as u16,
        rax: 0,
        rbx: 0,
        rdi: ARGS_GPA,
        rsi: args.len() as u64,
        code_selector: CODE_SELECTOR,
        data_selector: DATA_SELECTOR,
    })
}

/// Loads a flat real-mode image at 0000:7C00; the arguments go to the argument page as for
/// 64-bit guests (DS:SI would reach them at 0000:2000). Starts at CS:IP = 0000:7C00 with
/// SS:SP = 0000:7C00.
pub fn load_real16(mem: &mut [u8], image: &[u8], args: &str) -> Result<BootState, LoadError> {
    if (mem.len() as u64) < REAL16_END {
        return Err(LoadError::MemoryTooSmall(mem.len() as u64));
    }
    if image.is_empty() || image.len() as u64 > REAL16_END - REAL16_LOAD {
        return Err(LoadError::FlatImageSize(image.len()));
    }
    if args.len() > ARGS_MAX {
        return Err(LoadError::ArgsTooLong(args.len()));
    }
    let at = REAL16_LOAD as usize;
    mem[at..at + image.len()].copy_from_slice(image);
    let a = ARGS_GPA as usize;
    mem[a..a + args.len()].copy_from_slice(args.as_bytes());
    mem[a + args.len()] = 0;
    Ok(BootState {
        mode: StartMode::Real16,
        entry: REAL16_LOAD,
        rsp: REAL16_LOAD,
        cr3: 0,
        gdt_base: 0,
        gdt_limit: 0xffff,
        rax: 0,
        rbx: 0,
        rdi: ARGS_GPA,
        rsi: args.len() as u64,
        code_selector: 0,
        data_selector: 0,
    })
}

/// The GNU build id of an ELF image (its `NT_GNU_BUILD_ID` note), if it has one.
pub fn build_id(elf: &[u8]) -> Option<&[u8]> {
    let file = ElfFile64::<Endianness>::parse(elf).ok()?;
    let endian = file.endian();
    let data = file.data();
    for ph in file.elf_program_headers() {
        let Ok(Some(mut notes)) = ph.notes(endian, data) else {
            continue;
        };
        while let Ok(Some(note)) = notes.next() {
            if note.name() == b"GNU" && note.n_type(endian) == object::elf::NT_GNU_BUILD_ID {
                return Some(note.desc());
            }
        }
    }
    None
}

fn put_u64(mem: &mut [u8], gpa: u64, v: u64) {
    mem[gpa as usize..gpa as usize + 8].copy_from_slice(&v.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny ELF: one PT_LOAD of 0x20 bytes at 2 MiB (memsz 0x1000), entry at its start.
    fn elf(paddr: u64, entry: u64) -> Vec<u8> {
        let mut b = vec![0u8; 0x100];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        b[6] = 1;
        b[16..18].copy_from_slice(&2u16.to_le_bytes());
        b[18..20].copy_from_slice(&62u16.to_le_bytes());
        b[20..24].copy_from_slice(&1u32.to_le_bytes());
        b[24..32].copy_from_slice(&entry.to_le_bytes());
        b[32..40].copy_from_slice(&64u64.to_le_bytes());
        b[52..54].copy_from_slice(&64u16.to_le_bytes());
        b[54..56].copy_from_slice(&56u16.to_le_bytes());
        b[56..58].copy_from_slice(&1u16.to_le_bytes());
        b[58..60].copy_from_slice(&64u16.to_le_bytes());
        let ph = 64;
        b[ph..ph + 4].copy_from_slice(&1u32.to_le_bytes());
        b[ph + 4..ph + 8].copy_from_slice(&7u32.to_le_bytes());
        b[ph + 8..ph + 16].copy_from_slice(&0xe0u64.to_le_bytes());
        b[ph + 16..ph + 24].copy_from_slice(&paddr.to_le_bytes());
        b[ph + 24..ph + 32].copy_from_slice(&paddr.to_le_bytes());
        b[ph + 32..ph + 40].copy_from_slice(&0x20u64.to_le_bytes());
        b[ph + 40..ph + 48].copy_from_slice(&0x1000u64.to_le_bytes());
        for (i, x) in b[0xe0..].iter_mut().enumerate() {
            *x = 0x90 + i as u8;
        }
        b
    }

    fn u64_at(mem: &[u8], gpa: u64) -> u64 {
        u64::from_le_bytes(mem[gpa as usize..gpa as usize + 8].try_into().unwrap())
    }

    #[test]
    fn loads_and_maps() {
        let mut mem = vec![0xccu8; 8 << 20];
        mem[..0x10000].fill(0);
        let s = load(&mut mem, &elf(0x20_0000, 0x20_0000), "vm=x code=3").unwrap();
        assert_eq!(s.entry, 0x20_0000);
        assert_eq!(s.rsp, 8 << 20);
        assert_eq!(mem[0x20_0000], 0x90);
        assert_eq!(mem[0x20_001f], 0x90 + 0x1f);
        assert!(
            mem[0x20_0020..0x20_1000].iter().all(|&b| b == 0),
            "bss zeroed"
        );
        assert_eq!(&mem[0x2000..0x200c], b"vm=x code=3\0");
        assert_eq!(s.rsi, 11);
        assert_eq!(u64_at(&mem, PML4_GPA), PDPT_GPA | 3);
        assert_eq!(u64_at(&mem, PDPT_GPA), PD_GPA | 3);
        for p in 0..4 {
            assert_eq!(u64_at(&mem, PD_GPA + 8 * p), (p << 21) | 0x83);
        }
        assert_eq!(u64_at(&mem, PD_GPA + 32), 0, "nothing beyond guest memory");
        assert_eq!(u64_at(&mem, GDT_GPA + 8), GDT[1]);
    }

    #[test]
    fn real_mode_image() {
        let mut mem = vec![0u8; 4 << 20];
        let s = load_real16(&mut mem, &[0xf4; 3], "x=1").unwrap();
        assert_eq!(
            (s.mode, s.entry, s.rsp),
            (StartMode::Real16, 0x7c00, 0x7c00)
        );
        assert_eq!(&mem[0x7c00..0x7c04], &[0xf4, 0xf4, 0xf4, 0]);
        assert_eq!(&mem[0x2000..0x2004], b"x=1\0");
        assert_eq!(
            load_real16(&mut mem, &[], ""),
            Err(LoadError::FlatImageSize(0))
        );
        let big = vec![0u8; 0x8_0000];
        assert_eq!(
            load_real16(&mut mem, &big, ""),
            Err(LoadError::FlatImageSize(0x8_0000))
        );
    }

    #[test]
    fn refusals() {
        let mut mem = vec![0u8; 4 << 20];
        assert!(matches!(
            load(&mut mem, &elf(0x40_0000, 0x40_0000), ""),
            Err(LoadError::SegmentOutsideMemory { .. })
        ));
        assert!(matches!(
            load(&mut mem, &elf(0x1000, 0x1000), ""),
            Err(LoadError::SegmentOutsideMemory { .. })
        ));
        assert_eq!(
            load(&mut mem, &elf(0x20_0000, 0x30_0000), ""),
            Err(LoadError::EntryOutsideImage(0x30_0000))
        );
        assert_eq!(
            load(&mut mem, b"NOTELF", ""),
            Err(LoadError::Image(ImageError::NotElf))
        );
        let long = "x".repeat(5000);
        assert_eq!(
            load(&mut mem, &elf(0x20_0000, 0x20_0000), &long),
            Err(LoadError::ArgsTooLong(5000))
        );
    }
}
