//! A first look at a boot module's bytes: is it an ELF64 x86-64 executable we can load? Parsed
//! with the `object` crate, which bounds-checks every header it reads; anything else is refused
//! with a reason, never a fault.

use core::fmt;
use object::Endianness;
use object::elf;
use object::read::elf::{ElfFile64, FileHeader, ProgramHeader};

/// What a loadable guest image looks like.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageInfo {
    pub entry: u64,
    /// Number of PT_LOAD segments.
    pub load_segments: usize,
    /// Lowest and highest (exclusive) guest-physical address the segments occupy.
    pub lowest: u64,
    pub highest: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageError {
    NotElf,
    NotElf64,
    BigEndian,
    WrongMachine(u16),
    NotExecutable(u16),
    Malformed(&'static str),
    NoLoadSegments,
    SegmentOutOfFile { index: usize },
    SegmentOverflow { index: usize },
}

impl fmt::Display for ImageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageError::NotElf => f.write_str("not an ELF image (bad magic)"),
            ImageError::NotElf64 => f.write_str("not a 64-bit ELF image (ELFCLASS32?)"),
            ImageError::BigEndian => f.write_str("big-endian ELF image"),
            ImageError::WrongMachine(m) => write!(f, "ELF image for machine {m}, not x86-64 (62)"),
            ImageError::NotExecutable(t) => {
                write!(f, "ELF type {t} is not an executable (ET_EXEC)")
            }
            ImageError::Malformed(why) => write!(f, "malformed ELF image: {why}"),
            ImageError::NoLoadSegments => f.write_str("ELF image has no PT_LOAD segment"),
            ImageError::SegmentOutOfFile { index } => {
                write!(f, "ELF segment {index} lies outside the file")
            }
            ImageError::SegmentOverflow { index } => {
                write!(f, "ELF segment {index} has an address range that overflows")
            }
        }
    }
}

impl core::error::Error for ImageError {}

/// Checks that `bytes` hold an ELF64 little-endian x86-64 executable whose PT_LOAD segments lie
/// inside the file, and summarises it.
pub fn inspect(bytes: &[u8]) -> Result<ImageInfo, ImageError> {
    if bytes.len() < 4 || bytes[..4] != elf::ELFMAG {
        return Err(ImageError::NotElf);
    }
    if bytes.get(4) != Some(&elf::ELFCLASS64.0) {
        return Err(ImageError::NotElf64);
    }
    if bytes.get(5) != Some(&elf::ELFDATA2LSB.0) {
        return Err(ImageError::BigEndian);
    }
    let file = ElfFile64::<Endianness>::parse(bytes)
        .map_err(|_| ImageError::Malformed("truncated or inconsistent headers"))?;
    let header = file.elf_header();
    let endian = file.endian();
    let machine = header.e_machine(endian);
    if machine != elf::EM_X86_64 {
        return Err(ImageError::WrongMachine(machine.0));
    }
    let kind = header.e_type(endian);
    if kind != elf::ET_EXEC {
        return Err(ImageError::NotExecutable(kind.0));
    }
    let mut info = ImageInfo {
        entry: header.e_entry(endian),
        load_segments: 0,
        lowest: u64::MAX,
        highest: 0,
    };
    for (index, ph) in file.elf_program_headers().iter().enumerate() {
        if ph.p_type(endian) != elf::PT_LOAD {
            continue;
        }
        let (offset, filesz) = (ph.p_offset(endian), ph.p_filesz(endian));
        let in_file = offset
            .checked_add(filesz)
            .is_some_and(|end| end <= bytes.len() as u64);
        if !in_file {
            return Err(ImageError::SegmentOutOfFile { index });
        }
        let (paddr, memsz) = (ph.p_paddr(endian), ph.p_memsz(endian));
        let end = paddr
            .checked_add(memsz)
            .filter(|_| memsz >= filesz)
            .ok_or(ImageError::SegmentOverflow { index })?;
        info.load_segments += 1;
        info.lowest = info.lowest.min(paddr);
        info.highest = info.highest.max(end);
    }
    if info.load_segments == 0 {
        return Err(ImageError::NoLoadSegments);
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A minimal valid image: ELF header, one PT_LOAD covering 0x1000 bytes at 1 MiB.
    fn minimal() -> Vec<u8> {
        let mut b = vec![0u8; 0x1000];
        b[..4].copy_from_slice(&elf::ELFMAG);
        b[4] = elf::ELFCLASS64.0;
        b[5] = elf::ELFDATA2LSB.0;
        b[6] = 1;
        b[16..18].copy_from_slice(&elf::ET_EXEC.0.to_le_bytes());
        b[18..20].copy_from_slice(&elf::EM_X86_64.0.to_le_bytes());
        b[20..24].copy_from_slice(&1u32.to_le_bytes());
        b[24..32].copy_from_slice(&0x10_0000u64.to_le_bytes()); // e_entry
        b[32..40].copy_from_slice(&64u64.to_le_bytes()); // e_phoff
        b[52..54].copy_from_slice(&64u16.to_le_bytes()); // e_ehsize
        b[54..56].copy_from_slice(&56u16.to_le_bytes()); // e_phentsize
        b[56..58].copy_from_slice(&1u16.to_le_bytes()); // e_phnum
        b[58..60].copy_from_slice(&64u16.to_le_bytes()); // e_shentsize
        let ph = 64;
        b[ph..ph + 4].copy_from_slice(&elf::PT_LOAD.0.to_le_bytes());
        b[ph + 4..ph + 8].copy_from_slice(&7u32.to_le_bytes());
        b[ph + 16..ph + 24].copy_from_slice(&0x10_0000u64.to_le_bytes()); // vaddr
        b[ph + 24..ph + 32].copy_from_slice(&0x10_0000u64.to_le_bytes()); // paddr
        b[ph + 32..ph + 40].copy_from_slice(&0x1000u64.to_le_bytes()); // filesz
        b[ph + 40..ph + 48].copy_from_slice(&0x2000u64.to_le_bytes()); // memsz
        b
    }

    #[test]
    fn minimal_image() {
        let info = inspect(&minimal()).unwrap();
        assert_eq!(info.entry, 0x10_0000);
        assert_eq!((info.lowest, info.highest), (0x10_0000, 0x10_2000));
    }

    #[test]
    fn refusals() {
        assert_eq!(inspect(b"NOTELF garbage"), Err(ImageError::NotElf));
        let mut b = minimal();
        b[4] = elf::ELFCLASS32.0;
        assert_eq!(inspect(&b), Err(ImageError::NotElf64));
        let mut b = minimal();
        b[18] = 3;
        assert_eq!(inspect(&b), Err(ImageError::WrongMachine(3)));
        let mut b = minimal();
        b[16] = elf::ET_DYN.0 as u8;
        assert_eq!(inspect(&b), Err(ImageError::NotExecutable(elf::ET_DYN.0)));
        let mut b = minimal();
        b[64 + 32..64 + 40].copy_from_slice(&0x2000u64.to_le_bytes());
        assert_eq!(inspect(&b), Err(ImageError::SegmentOutOfFile { index: 0 }));
        let mut b = minimal();
        b[64 + 24..64 + 32].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(inspect(&b), Err(ImageError::SegmentOverflow { index: 0 }));
        assert!(matches!(
            inspect(&minimal()[..40]),
            Err(ImageError::Malformed(_))
        ));
    }

    proptest! {
        #[test]
        fn never_panics(flips in prop::collection::vec((0usize..200, any::<u8>()), 0..8), cut in 0usize..0x1000) {
            let mut b = minimal();
            for (i, v) in flips {
                b[i] = v;
            }
            b.truncate(cut.max(1));
            let _ = inspect(&b);
        }
    }
}
