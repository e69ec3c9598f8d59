//! The Multiboot2 boot information: a validating parser for untrusted input.
//!
//! Format: Multiboot2 specification 2.0, §3.6 "Boot information format". The boot information is
//! a `u32 total_size`, a `u32 reserved`, then tags, each starting 8-byte aligned with a
//! `u32 type, u32 size` header (`size` counts the header and the payload but not the padding),
//! terminated by a type-0 tag of size 8. Everything is little-endian.
//!
//! [`parse`] takes a copy of the boot information as a byte slice (no alignment assumed) and
//! validates every tag it knows up front, so the accessors of [`BootInfo`] cannot fail. Malformed
//! input gives an [`InfoError`]; nothing here panics or reads out of bounds.
//!
//! Decisions a caller must know:
//! - `total_size` must be at least 16 (header and end tag) and within the slice; bytes of the
//!   slice past `total_size` are ignored. `total_size` need not be a multiple of 8: the walk stops
//!   at the end tag, which must lie wholly inside `total_size`; bytes after it are ignored.
//! - Tags 1, 2, 4, 6, 14 and 15 may appear at most once. Unknown tag types are skipped without
//!   checks beyond the header; so are known tags this parser does not decode.
//! - The command line and the boot loader name must be NUL-terminated UTF-8 (the string ends at
//!   the first NUL). Module command lines must be NUL-terminated but may be any bytes; see
//!   [`ModuleTag::cmdline_str`] and [`check_module`].
//! - Memory map entries: `entry_size` a multiple of 8 and at least 24, any `entry_version`
//!   (only the first 24 bytes of each entry are read), and no region may wrap past 2^64
//!   (`start + len` must fit in a `u64`).
//! - RSDP tags: signature `"RSD PTR "` and the ACPI 1.0 checksum over the first 20 bytes; for
//!   tag 15 also revision >= 2, a `length` field in `36..=payload length` and the extended
//!   checksum over `length` bytes (ACPI 6.5 §5.2.5.3).

use core::fmt;

/// Tag type: end of the tag list.
pub const TAG_END: u32 = 0;
/// Tag type: the kernel command line.
pub const TAG_CMDLINE: u32 = 1;
/// Tag type: the boot loader name.
pub const TAG_BOOTLOADER_NAME: u32 = 2;
/// Tag type: one boot module.
pub const TAG_MODULE: u32 = 3;
/// Tag type: basic memory information (lower and upper memory in KiB).
pub const TAG_BASIC_MEMORY: u32 = 4;
/// Tag type: the memory map.
pub const TAG_MEMORY_MAP: u32 = 6;
/// Tag type: a copy of the ACPI 1.0 RSDP.
pub const TAG_ACPI_OLD: u32 = 14;
/// Tag type: a copy of the ACPI 2.0+ RSDP.
pub const TAG_ACPI_NEW: u32 = 15;

const HEADER_SIZE: usize = 8;
const TAG_ALIGN: usize = 8;
const MIN_TOTAL_SIZE: u32 = 16;
const MEMORY_ENTRY_MIN: u32 = 24;
const RSDP_SIGNATURE: &[u8; 8] = b"RSD PTR ";
const RSDP_V1_LEN: usize = 20;
const RSDP_V2_MIN_LEN: u32 = 36;

/// A human name for a Multiboot2 boot-information tag type (for messages and debug dumps).
pub fn tag_name(tag: u32) -> &'static str {
    match tag {
        0 => "end",
        1 => "command line",
        2 => "boot loader name",
        3 => "module",
        4 => "basic memory information",
        5 => "BIOS boot device",
        6 => "memory map",
        7 => "VBE info",
        8 => "framebuffer info",
        9 => "ELF symbols",
        10 => "APM table",
        11 => "EFI 32-bit system table",
        12 => "EFI 64-bit system table",
        13 => "SMBIOS tables",
        14 => "ACPI 1.0 RSDP",
        15 => "ACPI 2.0 RSDP",
        16 => "networking information",
        17 => "EFI memory map",
        18 => "EFI boot services not terminated",
        19 => "EFI 32-bit image handle",
        20 => "EFI 64-bit image handle",
        21 => "image load base address",
        _ => "unknown",
    }
}

/// The minimum `size` (header included) of a tag of this type.
fn min_tag_size(tag: u32) -> u32 {
    match tag {
        // At least the terminating NUL.
        TAG_CMDLINE | TAG_BOOTLOADER_NAME => 9,
        // mod_start, mod_end and at least the NUL of the command line.
        TAG_MODULE => 17,
        TAG_BASIC_MEMORY | TAG_MEMORY_MAP => 16,
        TAG_ACPI_OLD => 8 + RSDP_V1_LEN as u32,
        TAG_ACPI_NEW => 8 + RSDP_V2_MIN_LEN,
        _ => HEADER_SIZE as u32,
    }
}

/// "a memory map", for "below the 16-byte minimum for a memory map".
fn min_size_noun(tag: u32, min: u32) -> &'static str {
    if min <= HEADER_SIZE as u32 {
        return "a tag";
    }
    match tag {
        TAG_CMDLINE => "a command line",
        TAG_BOOTLOADER_NAME => "a boot loader name",
        TAG_MODULE => "a module",
        TAG_BASIC_MEMORY => "basic memory information",
        TAG_MEMORY_MAP => "a memory map",
        TAG_ACPI_OLD => "an ACPI 1.0 RSDP",
        TAG_ACPI_NEW => "an ACPI 2.0 RSDP",
        _ => "a tag",
    }
}

/// Index into the "seen" table for tags that may appear only once.
fn unique_slot(tag: u32) -> Option<usize> {
    match tag {
        TAG_CMDLINE => Some(0),
        TAG_BOOTLOADER_NAME => Some(1),
        TAG_BASIC_MEMORY => Some(2),
        TAG_MEMORY_MAP => Some(3),
        TAG_ACPI_OLD => Some(4),
        TAG_ACPI_NEW => Some(5),
        _ => None,
    }
}

fn le_u32(bytes: &[u8], at: usize) -> Option<u32> {
    let b = bytes.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(b.try_into().ok()?))
}

fn le_u64(bytes: &[u8], at: usize) -> Option<u64> {
    let b = bytes.get(at..at.checked_add(8)?)?;
    Some(u64::from_le_bytes(b.try_into().ok()?))
}

fn byte_sum(bytes: &[u8]) -> u8 {
    bytes.iter().fold(0u8, |acc, b| acc.wrapping_add(*b))
}

/// Why [`parse`] rejected the boot information. Offsets are from the start of the boot
/// information; `tag` is the tag type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InfoError {
    /// The input cannot hold the 8-byte fixed header.
    HeaderTruncated { len: usize },
    /// `total_size` is below 16 (fixed header plus end tag).
    TotalSizeTooSmall { total_size: u32 },
    /// `total_size` is larger than the input.
    TotalSizeBeyondInput { total_size: u32, available: usize },
    /// The tags ran to the end of `total_size` without an end tag (`offset` is where the next tag
    /// header would start).
    MissingEndTag { offset: usize, total_size: usize },
    /// A tag's size is below the minimum for its type (8 for any tag).
    TagTooSmall {
        offset: usize,
        tag: u32,
        size: u32,
        min: u32,
    },
    /// A tag runs past `total_size`.
    TagBeyondEnd {
        offset: usize,
        tag: u32,
        size: u32,
        total_size: usize,
    },
    /// The end tag (type 0) has a size other than 8.
    EndTagSize { offset: usize, size: u32 },
    /// A tag that may appear only once appears again.
    DuplicateTag {
        offset: usize,
        tag: u32,
        first_offset: usize,
    },
    /// A string tag (or a module's command line) has no terminating NUL.
    StringNotTerminated { offset: usize, tag: u32 },
    /// The command line or boot loader name is not UTF-8; `valid_up_to` indexes the string.
    StringNotUtf8 {
        offset: usize,
        tag: u32,
        valid_up_to: usize,
    },
    /// The memory map's `entry_size` is below 24 or not a multiple of 8.
    MemoryMapEntrySize { offset: usize, entry_size: u32 },
    /// The memory map's entries do not fill the tag exactly.
    MemoryMapLength {
        offset: usize,
        size: u32,
        entry_size: u32,
    },
    /// A memory region's `start + len` does not fit in 64 bits.
    MemoryRegionOverflow {
        offset: usize,
        index: usize,
        start: u64,
        len: u64,
    },
    /// An RSDP tag does not start with `"RSD PTR "`.
    RsdpSignature { offset: usize, tag: u32 },
    /// The ACPI 2.0 RSDP tag holds an RSDP with revision below 2.
    RsdpRevision { offset: usize, revision: u8 },
    /// The ACPI 2.0 RSDP's `length` field is below 36 or beyond the tag's payload.
    RsdpLength {
        offset: usize,
        length: u32,
        available: usize,
    },
    /// An RSDP checksum fails; `covered` is the number of bytes summed (20 or `length`).
    RsdpChecksum {
        offset: usize,
        tag: u32,
        covered: usize,
    },
}

impl fmt::Display for InfoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("boot info: ")?;
        match *self {
            Self::HeaderTruncated { len } => write!(
                f,
                "only {len} bytes, too short for the 8-byte header (total size and reserved)"
            ),
            Self::TotalSizeTooSmall { total_size } => write!(
                f,
                "total size {total_size} is below the 16-byte minimum (header and end tag)"
            ),
            Self::TotalSizeBeyondInput {
                total_size,
                available,
            } => write!(
                f,
                "total size {total_size:#x} exceeds the {available:#x} bytes available"
            ),
            Self::MissingEndTag { offset, total_size } => write!(
                f,
                "no end tag: the tags reach offset {offset:#x} of total size {total_size:#x} \
                 without a type-0 tag"
            ),
            Self::TagTooSmall {
                offset,
                tag,
                size,
                min,
            } => write!(
                f,
                "tag {tag} at offset {offset:#x} has size {size}, below the {min}-byte minimum \
                 for {}",
                min_size_noun(tag, min)
            ),
            Self::TagBeyondEnd {
                offset,
                tag,
                size,
                total_size,
            } => write!(
                f,
                "tag {tag} at offset {offset:#x} has size {size}, which runs past the total \
                 size {total_size:#x}"
            ),
            Self::EndTagSize { offset, size } => {
                write!(
                    f,
                    "end tag at offset {offset:#x} has size {size}, expected 8"
                )
            }
            Self::DuplicateTag {
                offset,
                tag,
                first_offset,
            } => write!(
                f,
                "tag {tag} ({}) at offset {offset:#x} repeats the one at offset \
                 {first_offset:#x}; it may appear only once",
                tag_name(tag)
            ),
            Self::StringNotTerminated { offset, tag } => write!(
                f,
                "tag {tag} ({}) at offset {offset:#x}: the string is not NUL-terminated",
                tag_name(tag)
            ),
            Self::StringNotUtf8 {
                offset,
                tag,
                valid_up_to,
            } => write!(
                f,
                "tag {tag} ({}) at offset {offset:#x}: the string is not UTF-8 (invalid byte \
                 at index {valid_up_to})",
                tag_name(tag)
            ),
            Self::MemoryMapEntrySize { offset, entry_size } => write!(
                f,
                "tag 6 (memory map) at offset {offset:#x}: entry size {entry_size} is not a \
                 multiple of 8 of at least 24"
            ),
            Self::MemoryMapLength {
                offset,
                size,
                entry_size,
            } => write!(
                f,
                "tag 6 (memory map) at offset {offset:#x}: size {size} does not hold a whole \
                 number of {entry_size}-byte entries after the 16-byte header"
            ),
            Self::MemoryRegionOverflow {
                offset,
                index,
                start,
                len,
            } => write!(
                f,
                "tag 6 (memory map) at offset {offset:#x}: region {index} (start {start:#x}, \
                 length {len:#x}) runs past the end of the 64-bit address space"
            ),
            Self::RsdpSignature { offset, tag } => write!(
                f,
                "tag {tag} ({}) at offset {offset:#x}: the RSDP signature is not 'RSD PTR '",
                tag_name(tag)
            ),
            Self::RsdpRevision { offset, revision } => write!(
                f,
                "tag 15 (ACPI 2.0 RSDP) at offset {offset:#x}: the RSDP has revision \
                 {revision}, expected 2 or more"
            ),
            Self::RsdpLength {
                offset,
                length,
                available,
            } => write!(
                f,
                "tag 15 (ACPI 2.0 RSDP) at offset {offset:#x}: the RSDP length {length} is \
                 outside 36..={available}"
            ),
            Self::RsdpChecksum {
                offset,
                tag,
                covered,
            } => write!(
                f,
                "tag {tag} ({}) at offset {offset:#x}: the RSDP checksum over {covered} bytes \
                 does not sum to zero",
                tag_name(tag)
            ),
        }
    }
}

impl core::error::Error for InfoError {}

/// One tag as the walker sees it.
#[derive(Clone, Copy, Debug)]
struct RawTag<'a> {
    offset: usize,
    tag: u32,
    size: u32,
    payload: &'a [u8],
}

/// Walks the tags of `bytes` (already cut to `total_size`), checking the generic tag framing.
/// Yields every tag before the end tag, then stops; after an error it yields that error once and
/// stops.
#[derive(Clone, Debug)]
struct Walker<'a> {
    bytes: &'a [u8],
    offset: usize,
    done: bool,
}

impl<'a> Walker<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self {
            bytes,
            offset: HEADER_SIZE,
            done: false,
        }
    }

    fn step(&mut self) -> Result<Option<RawTag<'a>>, InfoError> {
        let total_size = self.bytes.len();
        let offset = self.offset;
        let (Some(tag), Some(size)) = (
            le_u32(self.bytes, offset),
            le_u32(self.bytes, offset.saturating_add(4)),
        ) else {
            return Err(InfoError::MissingEndTag { offset, total_size });
        };
        if (size as usize) < HEADER_SIZE {
            return Err(InfoError::TagTooSmall {
                offset,
                tag,
                size,
                min: HEADER_SIZE as u32,
            });
        }
        let too_big = InfoError::TagBeyondEnd {
            offset,
            tag,
            size,
            total_size,
        };
        let end = offset.checked_add(size as usize).ok_or(too_big)?;
        let payload = self.bytes.get(offset + HEADER_SIZE..end).ok_or(too_big)?;
        if tag == TAG_END {
            if size as usize != HEADER_SIZE {
                return Err(InfoError::EndTagSize { offset, size });
            }
            return Ok(None);
        }
        self.offset = end
            .checked_next_multiple_of(TAG_ALIGN)
            .unwrap_or(usize::MAX);
        Ok(Some(RawTag {
            offset,
            tag,
            size,
            payload,
        }))
    }
}

impl<'a> Iterator for Walker<'a> {
    type Item = Result<RawTag<'a>, InfoError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        match self.step() {
            Ok(Some(tag)) => Some(Ok(tag)),
            Ok(None) => {
                self.done = true;
                None
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

/// The kind of a memory map region (Multiboot2 §3.6.8).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// 1: usable RAM.
    Available,
    /// 2: reserved.
    Reserved,
    /// 3: usable RAM holding ACPI tables.
    AcpiReclaimable,
    /// 4: ACPI NVS, to be preserved across hibernation.
    AcpiNvs,
    /// 5: defective RAM.
    Defective,
    /// Any other type value (to be treated as reserved).
    Other(u32),
}

impl MemoryKind {
    /// The kind for a raw type value.
    pub fn from_code(code: u32) -> Self {
        match code {
            1 => Self::Available,
            2 => Self::Reserved,
            3 => Self::AcpiReclaimable,
            4 => Self::AcpiNvs,
            5 => Self::Defective,
            other => Self::Other(other),
        }
    }

    /// The raw type value.
    pub fn code(self) -> u32 {
        match self {
            Self::Available => 1,
            Self::Reserved => 2,
            Self::AcpiReclaimable => 3,
            Self::AcpiNvs => 4,
            Self::Defective => 5,
            Self::Other(code) => code,
        }
    }
}

impl From<u32> for MemoryKind {
    fn from(code: u32) -> Self {
        Self::from_code(code)
    }
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Available => f.write_str("available"),
            Self::Reserved => f.write_str("reserved"),
            Self::AcpiReclaimable => f.write_str("ACPI reclaimable"),
            Self::AcpiNvs => f.write_str("ACPI NVS"),
            Self::Defective => f.write_str("defective"),
            Self::Other(code) => write!(f, "type {code}"),
        }
    }
}

/// One memory map entry. From [`parse`], `start + len` never overflows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemoryRegion {
    pub start: u64,
    pub len: u64,
    pub kind: MemoryKind,
}

impl MemoryRegion {
    /// The exclusive end address (saturating, for regions not made by [`parse`]).
    pub fn end(&self) -> u64 {
        self.start.saturating_add(self.len)
    }

    /// Whether this region is usable RAM.
    pub fn is_available(&self) -> bool {
        self.kind == MemoryKind::Available
    }
}

/// A copy of the ACPI RSDP (ACPI 6.5 §5.2.5.3) from tag 14 (`version` 1, the 20-byte ACPI 1.0
/// structure) or tag 15 (`version` 2, `length` bytes). Signature and checksums are verified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rsdp<'a> {
    pub version: u8,
    pub bytes: &'a [u8],
}

impl<'a> Rsdp<'a> {
    /// The 6-byte OEM ID.
    pub fn oem_id(&self) -> &'a [u8] {
        self.bytes.get(9..15).unwrap_or(&[])
    }

    /// The RSDP's own revision field (0 for ACPI 1.0; tag 14 may hold a newer RSDP's first 20
    /// bytes).
    pub fn revision(&self) -> u8 {
        self.bytes.get(15).copied().unwrap_or(0)
    }

    /// The 32-bit physical address of the RSDT.
    pub fn rsdt_address(&self) -> u32 {
        le_u32(self.bytes, 16).unwrap_or(0)
    }

    /// The 64-bit physical address of the XSDT (version 2 only).
    pub fn xsdt_address(&self) -> Option<u64> {
        if self.version >= 2 {
            le_u64(self.bytes, 24)
        } else {
            None
        }
    }
}

/// One boot module (tag 3). `end` is exclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModuleTag<'a> {
    pub start: u32,
    pub end: u32,
    /// The module's command line without the NUL; not necessarily UTF-8.
    pub cmdline: &'a [u8],
}

impl<'a> ModuleTag<'a> {
    /// The command line as UTF-8.
    pub fn cmdline_str(&self) -> Result<&'a str, core::str::Utf8Error> {
        core::str::from_utf8(self.cmdline)
    }

    /// The module's length in bytes (0 if `end` lies before `start`).
    pub fn len(&self) -> u32 {
        self.end.saturating_sub(self.start)
    }

    /// Whether the module holds no bytes (also when `end` lies before `start`).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The image name: by our convention the first whitespace-separated word of the command
    /// line. `None` if the command line is not UTF-8 or blank.
    pub fn name(&self) -> Option<&'a str> {
        self.cmdline_str().ok()?.split_whitespace().next()
    }

    /// The command line after the name, trimmed (`Some("")` if there is nothing after it).
    /// `None` if the command line is not UTF-8.
    pub fn args(&self) -> Option<&'a str> {
        let s = self.cmdline_str().ok()?.trim_start();
        let rest = match s.find(char::is_whitespace) {
            Some(i) => s.get(i..).unwrap_or(""),
            None => "",
        };
        Some(rest.trim())
    }
}

fn module_from_payload(payload: &[u8]) -> Option<ModuleTag<'_>> {
    let start = le_u32(payload, 0)?;
    let end = le_u32(payload, 4)?;
    let rest = payload.get(8..)?;
    let nul = rest.iter().position(|&b| b == 0)?;
    Some(ModuleTag {
        start,
        end,
        cmdline: rest.get(..nul)?,
    })
}

/// A validated Multiboot2 boot information. See [`parse`].
#[derive(Clone, Copy, Debug)]
pub struct BootInfo<'a> {
    /// Cut to `total_size`.
    bytes: &'a [u8],
    cmdline: Option<&'a str>,
    bootloader_name: Option<&'a str>,
    basic_memory: Option<(u32, u32)>,
    /// (entry size, entries).
    memory_map: Option<(usize, &'a [u8])>,
    rsdp_v1: Option<Rsdp<'a>>,
    rsdp_v2: Option<Rsdp<'a>>,
}

/// Validates a copy of the Multiboot2 boot information. See the module documentation for what
/// is checked.
pub fn parse(bytes: &[u8]) -> Result<BootInfo<'_>, InfoError> {
    let total_size = le_u32(bytes, 0).ok_or(InfoError::HeaderTruncated { len: bytes.len() })?;
    if total_size < MIN_TOTAL_SIZE {
        return Err(InfoError::TotalSizeTooSmall { total_size });
    }
    let bytes = bytes
        .get(..total_size as usize)
        .ok_or(InfoError::TotalSizeBeyondInput {
            total_size,
            available: bytes.len(),
        })?;
    let mut info = BootInfo {
        bytes,
        cmdline: None,
        bootloader_name: None,
        basic_memory: None,
        memory_map: None,
        rsdp_v1: None,
        rsdp_v2: None,
    };
    let mut seen: [Option<usize>; 6] = [None; 6];
    for tag in Walker::new(bytes) {
        let tag = tag?;
        let min = min_tag_size(tag.tag);
        if tag.size < min {
            return Err(InfoError::TagTooSmall {
                offset: tag.offset,
                tag: tag.tag,
                size: tag.size,
                min,
            });
        }
        if let Some(slot) = unique_slot(tag.tag).and_then(|i| seen.get_mut(i)) {
            if let Some(first_offset) = *slot {
                return Err(InfoError::DuplicateTag {
                    offset: tag.offset,
                    tag: tag.tag,
                    first_offset,
                });
            }
            *slot = Some(tag.offset);
        }
        match tag.tag {
            TAG_CMDLINE => info.cmdline = Some(c_string(&tag)?),
            TAG_BOOTLOADER_NAME => info.bootloader_name = Some(c_string(&tag)?),
            TAG_MODULE => {
                module_from_payload(tag.payload).ok_or(InfoError::StringNotTerminated {
                    offset: tag.offset,
                    tag: tag.tag,
                })?;
            }
            TAG_BASIC_MEMORY => {
                info.basic_memory = le_u32(tag.payload, 0).zip(le_u32(tag.payload, 4));
            }
            TAG_MEMORY_MAP => info.memory_map = Some(check_memory_map(&tag)?),
            TAG_ACPI_OLD => info.rsdp_v1 = Some(check_rsdp(&tag)?),
            TAG_ACPI_NEW => info.rsdp_v2 = Some(check_rsdp(&tag)?),
            _ => {}
        }
    }
    Ok(info)
}

fn c_string<'a>(tag: &RawTag<'a>) -> Result<&'a str, InfoError> {
    let (offset, ty) = (tag.offset, tag.tag);
    let nul = tag
        .payload
        .iter()
        .position(|&b| b == 0)
        .ok_or(InfoError::StringNotTerminated { offset, tag: ty })?;
    let bytes = tag.payload.get(..nul).unwrap_or(&[]);
    core::str::from_utf8(bytes).map_err(|e| InfoError::StringNotUtf8 {
        offset,
        tag: ty,
        valid_up_to: e.valid_up_to(),
    })
}

fn check_memory_map<'a>(tag: &RawTag<'a>) -> Result<(usize, &'a [u8]), InfoError> {
    let offset = tag.offset;
    let entry_size = le_u32(tag.payload, 0).unwrap_or(0);
    if entry_size < MEMORY_ENTRY_MIN || !entry_size.is_multiple_of(8) {
        return Err(InfoError::MemoryMapEntrySize { offset, entry_size });
    }
    let entries = tag.payload.get(8..).unwrap_or(&[]);
    let step = entry_size as usize;
    if !entries.len().is_multiple_of(step) {
        return Err(InfoError::MemoryMapLength {
            offset,
            size: tag.size,
            entry_size,
        });
    }
    for (index, entry) in entries.chunks_exact(step).enumerate() {
        let start = le_u64(entry, 0).unwrap_or(0);
        let len = le_u64(entry, 8).unwrap_or(0);
        if start.checked_add(len).is_none() {
            return Err(InfoError::MemoryRegionOverflow {
                offset,
                index,
                start,
                len,
            });
        }
    }
    Ok((step, entries))
}

fn check_rsdp<'a>(tag: &RawTag<'a>) -> Result<Rsdp<'a>, InfoError> {
    let (offset, ty, payload) = (tag.offset, tag.tag, tag.payload);
    if payload.get(..RSDP_SIGNATURE.len()) != Some(RSDP_SIGNATURE.as_slice()) {
        return Err(InfoError::RsdpSignature { offset, tag: ty });
    }
    let v1 = payload.get(..RSDP_V1_LEN).unwrap_or(&[]);
    if v1.len() != RSDP_V1_LEN || byte_sum(v1) != 0 {
        return Err(InfoError::RsdpChecksum {
            offset,
            tag: ty,
            covered: RSDP_V1_LEN,
        });
    }
    if ty != TAG_ACPI_NEW {
        return Ok(Rsdp {
            version: 1,
            bytes: v1,
        });
    }
    let revision = payload.get(15).copied().unwrap_or(0);
    if revision < 2 {
        return Err(InfoError::RsdpRevision { offset, revision });
    }
    let length = le_u32(payload, 20).unwrap_or(0);
    let available = payload.len();
    let bytes = payload
        .get(..length as usize)
        .filter(|_| length >= RSDP_V2_MIN_LEN)
        .ok_or(InfoError::RsdpLength {
            offset,
            length,
            available,
        })?;
    if byte_sum(bytes) != 0 {
        return Err(InfoError::RsdpChecksum {
            offset,
            tag: ty,
            covered: bytes.len(),
        });
    }
    Ok(Rsdp { version: 2, bytes })
}

impl<'a> BootInfo<'a> {
    /// `total_size`: the number of bytes the boot information occupies.
    pub fn total_size(&self) -> usize {
        self.bytes.len()
    }

    /// The boot information's bytes, cut to `total_size`.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The kernel command line (tag 1), without the NUL.
    pub fn cmdline(&self) -> Option<&'a str> {
        self.cmdline
    }

    /// The boot loader name (tag 2), without the NUL.
    pub fn bootloader_name(&self) -> Option<&'a str> {
        self.bootloader_name
    }

    /// The boot modules (tag 3) in the order of the tags.
    pub fn modules(&self) -> Modules<'a> {
        Modules {
            walker: Walker::new(self.bytes),
        }
    }

    /// Whether a memory map tag (tag 6) is present (it may still have no entries).
    pub fn has_memory_map(&self) -> bool {
        self.memory_map.is_some()
    }

    /// The memory map regions (tag 6) in the order given; empty if there is no memory map.
    pub fn memory_map(&self) -> MemoryMap<'a> {
        let (entry_size, rest) = self.memory_map.unwrap_or((MEMORY_ENTRY_MIN as usize, &[]));
        MemoryMap { rest, entry_size }
    }

    /// The ACPI RSDP: the one from tag 15 (ACPI 2.0+) if present, else the one from tag 14.
    pub fn rsdp(&self) -> Option<Rsdp<'a>> {
        self.rsdp_v2.or(self.rsdp_v1)
    }

    /// Lower and upper memory in KiB (tag 4), if the loader gave them.
    pub fn basic_memory(&self) -> Option<(u32, u32)> {
        self.basic_memory
    }

    /// Every tag before the end tag as (type, payload without the 8-byte header and padding),
    /// for a debug dump.
    pub fn tags(&self) -> Tags<'a> {
        Tags {
            walker: Walker::new(self.bytes),
        }
    }
}

/// Iterator over the module tags, see [`BootInfo::modules`].
#[derive(Clone, Debug)]
pub struct Modules<'a> {
    walker: Walker<'a>,
}

impl<'a> Iterator for Modules<'a> {
    type Item = ModuleTag<'a>;

    fn next(&mut self) -> Option<ModuleTag<'a>> {
        loop {
            let tag = self.walker.next()?.ok()?;
            if tag.tag == TAG_MODULE
                && let Some(module) = module_from_payload(tag.payload)
            {
                return Some(module);
            }
        }
    }
}

/// Iterator over every tag, see [`BootInfo::tags`].
#[derive(Clone, Debug)]
pub struct Tags<'a> {
    walker: Walker<'a>,
}

impl<'a> Iterator for Tags<'a> {
    type Item = (u32, &'a [u8]);

    fn next(&mut self) -> Option<(u32, &'a [u8])> {
        let tag = self.walker.next()?.ok()?;
        Some((tag.tag, tag.payload))
    }
}

/// Iterator over the memory map, see [`BootInfo::memory_map`].
#[derive(Clone, Debug)]
pub struct MemoryMap<'a> {
    rest: &'a [u8],
    entry_size: usize,
}

impl Iterator for MemoryMap<'_> {
    type Item = MemoryRegion;

    fn next(&mut self) -> Option<MemoryRegion> {
        if self.entry_size < MEMORY_ENTRY_MIN as usize {
            return None;
        }
        let entry = self.rest.get(..self.entry_size)?;
        self.rest = self.rest.get(self.entry_size..).unwrap_or(&[]);
        Some(MemoryRegion {
            start: le_u64(entry, 0)?,
            len: le_u64(entry, 8)?,
            kind: MemoryKind::from_code(le_u32(entry, 16)?),
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.rest.len().checked_div(self.entry_size).unwrap_or(0);
        (n, Some(n))
    }
}

impl ExactSizeIterator for MemoryMap<'_> {}

/// What is wrong with a module, see [`check_module`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleErrorKind {
    /// `end` lies before `start`.
    EndBeforeStart,
    /// `start == end`.
    Empty,
    /// The command line is not UTF-8 (`valid_up_to` indexes the command line).
    NotUtf8Cmdline { valid_up_to: usize },
    /// The command line is blank, so the module has no image name.
    MissingName,
    /// The module overlaps a forbidden range `[start, end)` described by `what`.
    Overlaps {
        what: &'static str,
        start: u64,
        end: u64,
    },
    /// Part of the module lies outside the memory the map marks available (or inside a region
    /// marked otherwise).
    NotInAvailableMemory,
}

/// A module that failed [`check_module`]: the module and what is wrong with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModuleError<'a> {
    pub module: ModuleTag<'a>,
    pub kind: ModuleErrorKind,
}

/// Writes untrusted bytes readably: valid UTF-8 with `escape_debug`, other bytes as `\xNN`.
fn write_escaped(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    for chunk in bytes.utf8_chunks() {
        write!(f, "{}", chunk.valid().escape_debug())?;
        for b in chunk.invalid() {
            write!(f, "\\x{b:02x}")?;
        }
    }
    Ok(())
}

impl fmt::Display for ModuleError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.module;
        let name = m
            .cmdline
            .split(|b| b.is_ascii_whitespace())
            .find(|word| !word.is_empty());
        match name {
            Some(name) => {
                f.write_str("module '")?;
                write_escaped(f, name)?;
                f.write_str("'")?;
            }
            None => f.write_str("unnamed module")?,
        }
        write!(f, " ({:#x}-{:#x}): ", m.start, m.end)?;
        match self.kind {
            ModuleErrorKind::EndBeforeStart => f.write_str("end lies before start"),
            ModuleErrorKind::Empty => f.write_str("empty (end equals start)"),
            ModuleErrorKind::NotUtf8Cmdline { valid_up_to } => write!(
                f,
                "the command line is not UTF-8 (invalid byte at index {valid_up_to})"
            ),
            ModuleErrorKind::MissingName => f.write_str(
                "the command line is blank; its first word must name the image \
                 (module2 <file> <name> [args])",
            ),
            ModuleErrorKind::Overlaps { what, start, end } => {
                write!(f, "overlaps {what} ({start:#x}-{end:#x})")
            }
            ModuleErrorKind::NotInAvailableMemory => {
                f.write_str("does not lie wholly in memory the memory map marks available")
            }
        }
    }
}

impl core::error::Error for ModuleError<'_> {}

/// Checks one module against the memory map and the regions it must not overlap.
///
/// In order: `end` not before `start`, not empty, UTF-8 command line with a name, no overlap
/// with any `forbidden` range (`(start, exclusive end, what)`; empty ranges overlap nothing), and
/// `[start, end)` covered by available regions (adjacent or overlapping available regions may
/// together cover it) without overlapping any region of another kind.
pub fn check_module<'a, I>(
    m: &ModuleTag<'a>,
    forbidden: &[(u64, u64, &'static str)],
    memory: I,
) -> Result<(), ModuleError<'a>>
where
    I: IntoIterator<Item = MemoryRegion>,
    I::IntoIter: Clone,
{
    let fail = |kind| Err(ModuleError { module: *m, kind });
    if m.end < m.start {
        return fail(ModuleErrorKind::EndBeforeStart);
    }
    if m.end == m.start {
        return fail(ModuleErrorKind::Empty);
    }
    match m.cmdline_str() {
        Err(e) => {
            return fail(ModuleErrorKind::NotUtf8Cmdline {
                valid_up_to: e.valid_up_to(),
            });
        }
        Ok(s) if s.split_whitespace().next().is_none() => {
            return fail(ModuleErrorKind::MissingName);
        }
        Ok(_) => {}
    }
    let (start, end) = (u64::from(m.start), u64::from(m.end));
    for &(f_start, f_end, what) in forbidden {
        if start < f_end && f_start < end && f_start < f_end {
            return fail(ModuleErrorKind::Overlaps {
                what,
                start: f_start,
                end: f_end,
            });
        }
    }
    let regions = memory.into_iter();
    let overlaps = |r: &MemoryRegion| r.start < end && start < r.end();
    if regions.clone().any(|r| !r.is_available() && overlaps(&r)) {
        return fail(ModuleErrorKind::NotInAvailableMemory);
    }
    // Advance a cursor through available regions; each step moves it to a distinct region end,
    // so there are at most as many steps as regions.
    let mut cursor = start;
    for _ in 0..=regions.clone().count() {
        if cursor >= end {
            return Ok(());
        }
        let reach = regions
            .clone()
            .filter(|r| r.is_available() && r.start <= cursor && cursor < r.end())
            .map(|r| r.end())
            .max();
        match reach {
            Some(next) => cursor = next,
            None => break,
        }
    }
    fail(ModuleErrorKind::NotInAvailableMemory)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Builds boot-information images: tags padded to 8 bytes, `total_size` fixed on finish.
    struct Builder {
        buf: Vec<u8>,
        headers: Vec<usize>,
    }

    impl Builder {
        fn new() -> Self {
            Self {
                buf: vec![0; 8],
                headers: Vec::new(),
            }
        }

        fn pad(&mut self) {
            while !self.buf.len().is_multiple_of(8) {
                self.buf.push(0);
            }
        }

        /// A tag with an explicit size field (which may lie).
        fn raw(mut self, ty: u32, size: u32, payload: &[u8]) -> Self {
            self.pad();
            self.headers.push(self.buf.len());
            self.buf.extend(ty.to_le_bytes());
            self.buf.extend(size.to_le_bytes());
            self.buf.extend(payload);
            self
        }

        fn tag(self, ty: u32, payload: &[u8]) -> Self {
            let size = u32::try_from(8 + payload.len()).unwrap();
            self.raw(ty, size, payload)
        }

        fn string(self, ty: u32, s: &[u8]) -> Self {
            let mut payload = s.to_vec();
            payload.push(0);
            self.tag(ty, &payload)
        }

        fn cmdline(self, s: &str) -> Self {
            self.string(TAG_CMDLINE, s.as_bytes())
        }

        fn bootloader_name(self, s: &str) -> Self {
            self.string(TAG_BOOTLOADER_NAME, s.as_bytes())
        }

        fn module(self, start: u32, end: u32, cmdline: &[u8]) -> Self {
            let mut payload = Vec::new();
            payload.extend(start.to_le_bytes());
            payload.extend(end.to_le_bytes());
            payload.extend(cmdline);
            payload.push(0);
            self.tag(TAG_MODULE, &payload)
        }

        fn basic_memory(self, lower: u32, upper: u32) -> Self {
            let mut payload = Vec::new();
            payload.extend(lower.to_le_bytes());
            payload.extend(upper.to_le_bytes());
            self.tag(TAG_BASIC_MEMORY, &payload)
        }

        fn memory_map_with(
            self,
            entry_size: u32,
            version: u32,
            entries: &[(u64, u64, u32)],
        ) -> Self {
            let mut payload = Vec::new();
            payload.extend(entry_size.to_le_bytes());
            payload.extend(version.to_le_bytes());
            for &(start, len, kind) in entries {
                let mut entry = Vec::new();
                entry.extend(start.to_le_bytes());
                entry.extend(len.to_le_bytes());
                entry.extend(kind.to_le_bytes());
                entry.resize(entry_size as usize, 0xa5);
                payload.extend(entry);
            }
            self.tag(TAG_MEMORY_MAP, &payload)
        }

        fn memory_map(self, entries: &[(u64, u64, u32)]) -> Self {
            self.memory_map_with(24, 0, entries)
        }

        fn finish_without_end(mut self) -> Vec<u8> {
            self.pad();
            let total = u32::try_from(self.buf.len()).unwrap();
            self.buf[..4].copy_from_slice(&total.to_le_bytes());
            self.buf
        }

        fn finish_with_headers(self) -> (Vec<u8>, Vec<usize>) {
            let mut b = self.tag(TAG_END, &[]);
            let headers = b.headers.clone();
            b.headers.clear();
            (b.finish_without_end(), headers)
        }

        fn finish(self) -> Vec<u8> {
            self.finish_with_headers().0
        }
    }

    fn fix_checksum(bytes: &mut [u8], at: usize) {
        bytes[at] = 0;
        bytes[at] = 0u8.wrapping_sub(byte_sum(bytes));
    }

    fn rsdp_v1(oem: [u8; 6], revision: u8, rsdt: u32) -> Vec<u8> {
        let mut b = vec![0u8; 20];
        b[..8].copy_from_slice(RSDP_SIGNATURE);
        b[9..15].copy_from_slice(&oem);
        b[15] = revision;
        b[16..20].copy_from_slice(&rsdt.to_le_bytes());
        fix_checksum(&mut b, 8);
        b
    }

    fn rsdp_v2(oem: [u8; 6], rsdt: u32, xsdt: u64) -> Vec<u8> {
        let mut b = rsdp_v1(oem, 2, rsdt);
        b.resize(36, 0);
        b[20..24].copy_from_slice(&36u32.to_le_bytes());
        b[24..32].copy_from_slice(&xsdt.to_le_bytes());
        fix_checksum(&mut b[..20], 8);
        fix_checksum(&mut b, 32);
        b
    }

    const GRUB_MMAP: [(u64, u64, u32); 6] = [
        (0, 0x9fc00, 1),
        (0x9fc00, 0x400, 2),
        (0xf0000, 0x10000, 2),
        (0x10_0000, 0x7ee_0000, 1),
        (0x7fe_0000, 0x2_0000, 2),
        (0xfffc_0000, 0x4_0000, 2),
    ];

    /// Roughly what GRUB 2 hands a Multiboot2 kernel under QEMU/SeaBIOS.
    fn grub_image() -> Vec<u8> {
        Builder::new()
            .cmdline("period=250us export=stream")
            .bootloader_name("GRUB 2.12")
            .module(0x60_0000, 0x61_1000, b"hello.elf")
            .module(0x61_1000, 0xa1_1000, b"linux.bzImage console=ttyS0 quiet")
            .basic_memory(639, 129_920)
            .tag(5, &[0xff, 0xff, 0xff, 0xe0, 0, 0, 0, 0, 0, 0, 0, 0])
            .memory_map(&GRUB_MMAP)
            .tag(8, &[0u8; 24])
            .tag(TAG_ACPI_OLD, &rsdp_v1(*b"BOCHS ", 0, 0x7fe_1000))
            .tag(TAG_ACPI_NEW, &rsdp_v2(*b"BOCHS ", 0x7fe_1000, 0x7fe_2000))
            .finish()
    }

    const HYPERVISOR: (u64, u64, &str) = (0x20_0000, 0x40_0000, "the hypervisor image");

    #[test]
    fn grub_like_image() {
        let image = grub_image();
        let info = parse(&image).unwrap();
        assert_eq!(info.total_size(), image.len());
        assert_eq!(info.cmdline(), Some("period=250us export=stream"));
        assert_eq!(info.bootloader_name(), Some("GRUB 2.12"));
        assert_eq!(info.basic_memory(), Some((639, 129_920)));

        let modules: Vec<_> = info.modules().collect();
        assert_eq!(modules.len(), 2);
        assert_eq!((modules[0].start, modules[0].end), (0x60_0000, 0x61_1000));
        assert_eq!(modules[0].len(), 0x11000);
        assert_eq!(modules[0].name(), Some("hello.elf"));
        assert_eq!(modules[0].args(), Some(""));
        assert_eq!(modules[1].name(), Some("linux.bzImage"));
        assert_eq!(modules[1].args(), Some("console=ttyS0 quiet"));
        assert_eq!(
            modules[1].cmdline_str(),
            Ok("linux.bzImage console=ttyS0 quiet")
        );

        let map: Vec<_> = info.memory_map().collect();
        assert_eq!(info.memory_map().len(), 6);
        let expected: Vec<_> = GRUB_MMAP
            .iter()
            .map(|&(start, len, kind)| MemoryRegion {
                start,
                len,
                kind: kind.into(),
            })
            .collect();
        assert_eq!(map, expected);
        assert!(info.has_memory_map());

        let rsdp = info.rsdp().unwrap();
        assert_eq!(rsdp.version, 2);
        assert_eq!(rsdp.bytes.len(), 36);
        assert_eq!(rsdp.oem_id(), b"BOCHS ");
        assert_eq!(rsdp.revision(), 2);
        assert_eq!(rsdp.rsdt_address(), 0x7fe_1000);
        assert_eq!(rsdp.xsdt_address(), Some(0x7fe_2000));

        let types: Vec<u32> = info.tags().map(|(t, _)| t).collect();
        assert_eq!(types, [1, 2, 3, 3, 4, 5, 6, 8, 14, 15]);
        assert_eq!(info.tags().nth(1).unwrap().1, b"GRUB 2.12\0");

        for m in &modules {
            check_module(m, &[HYPERVISOR], info.memory_map()).unwrap();
        }
    }

    #[test]
    fn rsdp_v1_only_and_missing_optional_tags() {
        let image = Builder::new()
            .tag(TAG_ACPI_OLD, &rsdp_v1(*b"OEMID ", 0, 0xe0000))
            .finish();
        let info = parse(&image).unwrap();
        let rsdp = info.rsdp().unwrap();
        assert_eq!(rsdp.version, 1);
        assert_eq!(rsdp.bytes.len(), 20);
        assert_eq!(rsdp.rsdt_address(), 0xe0000);
        assert_eq!(rsdp.xsdt_address(), None);
        assert_eq!(info.cmdline(), None);
        assert_eq!(info.bootloader_name(), None);
        assert_eq!(info.basic_memory(), None);
        assert!(!info.has_memory_map());
        assert_eq!(info.memory_map().count(), 0);
        assert_eq!(info.modules().count(), 0);

        let empty = Builder::new().finish();
        let empty = parse(&empty).unwrap();
        assert_eq!(empty.total_size(), 16);
        assert_eq!(empty.rsdp(), None);
        assert_eq!(empty.tags().count(), 0);
    }

    #[test]
    fn lenient_cases() {
        // Unaligned input, slice longer than total_size.
        let image = grub_image();
        let mut shifted = vec![0xee];
        shifted.extend(&image);
        shifted.extend([0xee; 5]);
        assert_eq!(parse(&shifted[1..]).unwrap().total_size(), image.len());

        // Bytes after the end tag within total_size, total_size not a multiple of 8.
        let mut trailing = Builder::new().cmdline("x").finish();
        trailing.extend([1, 2, 3, 4]);
        let total = u32::try_from(trailing.len()).unwrap();
        trailing[..4].copy_from_slice(&total.to_le_bytes());
        assert_eq!(parse(&trailing).unwrap().cmdline(), Some("x"));

        // Memory map with bigger entries and another version; bytes after the string's NUL.
        let image = Builder::new()
            .memory_map_with(32, 7, &[(0x1000, 0x2000, 1), (0x3000, 0, 9)])
            .tag(TAG_CMDLINE, b"abc\0junk\xff")
            .module(1, 2, b"")
            .finish();
        let info = parse(&image).unwrap();
        let map: Vec<_> = info.memory_map().collect();
        assert_eq!(
            map[1],
            MemoryRegion {
                start: 0x3000,
                len: 0,
                kind: MemoryKind::Other(9)
            }
        );
        assert_eq!(map[0].end(), 0x3000);
        assert_eq!(info.cmdline(), Some("abc"));
        let m = info.modules().next().unwrap();
        assert_eq!((m.name(), m.args()), (None, Some("")));

        // A module command line that is not UTF-8 parses; it is reported per module.
        let image = Builder::new().module(0x1000, 0x2000, b"a\xffb c").finish();
        let m = parse(&image).unwrap().modules().next().unwrap();
        assert!(m.cmdline_str().is_err());
        assert_eq!((m.name(), m.args()), (None, None));
    }

    fn err(image: &[u8]) -> InfoError {
        parse(image).unwrap_err()
    }

    #[test]
    fn header_errors() {
        assert_eq!(err(&[16, 0, 0]), InfoError::HeaderTruncated { len: 3 });
        assert_eq!(
            err(&[8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0]),
            InfoError::TotalSizeTooSmall { total_size: 8 }
        );
        let mut image = Builder::new().finish();
        image[0] = 24;
        assert_eq!(
            err(&image),
            InfoError::TotalSizeBeyondInput {
                total_size: 24,
                available: 16
            }
        );
        assert_eq!(
            err(&image).to_string(),
            "boot info: total size 0x18 exceeds the 0x10 bytes available"
        );
    }

    #[test]
    fn missing_end_tag() {
        let image = Builder::new().cmdline("abc").finish_without_end();
        assert_eq!(
            err(&image),
            InfoError::MissingEndTag {
                offset: 24,
                total_size: 24
            }
        );
        // Last tag's padding leaves room for only half a header.
        let mut image = Builder::new().cmdline("abc").finish();
        image[0] = 28;
        image.truncate(28);
        assert_eq!(
            err(&image),
            InfoError::MissingEndTag {
                offset: 24,
                total_size: 28
            }
        );
        assert!(err(&image).to_string().contains("no end tag"));
    }

    #[test]
    fn tag_too_small() {
        // 55 characters and a NUL put the next tag at offset 0x48.
        let image = Builder::new()
            .cmdline(&"x".repeat(55))
            .raw(TAG_MEMORY_MAP, 12, &[24, 0, 0, 0])
            .finish();
        let e = err(&image);
        assert_eq!(
            e,
            InfoError::TagTooSmall {
                offset: 0x48,
                tag: 6,
                size: 12,
                min: 16
            }
        );
        assert_eq!(
            e.to_string(),
            "boot info: tag 6 at offset 0x48 has size 12, below the 16-byte minimum for a memory map"
        );
        let image = Builder::new().raw(77, 4, &[0; 8]).finish();
        assert_eq!(
            err(&image),
            InfoError::TagTooSmall {
                offset: 8,
                tag: 77,
                size: 4,
                min: 8
            }
        );
        assert!(
            err(&image)
                .to_string()
                .ends_with("below the 8-byte minimum for a tag")
        );
        let image = Builder::new().tag(TAG_MODULE, &[0; 8]).finish();
        assert_eq!(
            err(&image),
            InfoError::TagTooSmall {
                offset: 8,
                tag: 3,
                size: 16,
                min: 17
            }
        );
        let image = Builder::new()
            .tag(TAG_ACPI_OLD, &rsdp_v1(*b"ABCDEF", 0, 1)[..19])
            .finish();
        assert_eq!(
            err(&image),
            InfoError::TagTooSmall {
                offset: 8,
                tag: 14,
                size: 27,
                min: 28
            }
        );
        let image = Builder::new()
            .tag(TAG_ACPI_NEW, &rsdp_v1(*b"ABCDEF", 2, 1))
            .finish();
        assert_eq!(
            err(&image),
            InfoError::TagTooSmall {
                offset: 8,
                tag: 15,
                size: 28,
                min: 44
            }
        );
        let image = Builder::new().tag(TAG_CMDLINE, &[]).finish();
        assert_eq!(
            err(&image),
            InfoError::TagTooSmall {
                offset: 8,
                tag: 1,
                size: 8,
                min: 9
            }
        );
    }

    #[test]
    fn tag_beyond_end_and_end_tag_size() {
        let image = Builder::new().raw(TAG_CMDLINE, 200, b"abc\0").finish();
        assert_eq!(
            err(&image),
            InfoError::TagBeyondEnd {
                offset: 8,
                tag: 1,
                size: 200,
                total_size: 32
            }
        );
        let image = Builder::new()
            .raw(TAG_END, u32::MAX, &[])
            .finish_without_end();
        assert!(matches!(
            err(&image),
            InfoError::TagBeyondEnd { tag: 0, .. }
        ));
        let image = Builder::new().tag(TAG_END, &[0; 8]).finish_without_end();
        assert_eq!(
            err(&image),
            InfoError::EndTagSize {
                offset: 8,
                size: 16
            }
        );
        assert_eq!(
            err(&image).to_string(),
            "boot info: end tag at offset 0x8 has size 16, expected 8"
        );
    }

    #[test]
    fn duplicate_tags() {
        let image = Builder::new()
            .cmdline("a")
            .bootloader_name("b")
            .cmdline("c")
            .finish();
        assert_eq!(
            err(&image),
            InfoError::DuplicateTag {
                offset: 40,
                tag: 1,
                first_offset: 8
            }
        );
        assert_eq!(
            err(&image).to_string(),
            "boot info: tag 1 (command line) at offset 0x28 repeats the one at offset 0x8; it may \
             appear only once"
        );
        let image = Builder::new().memory_map(&[]).memory_map(&[]).finish();
        assert_eq!(
            err(&image),
            InfoError::DuplicateTag {
                offset: 24,
                tag: 6,
                first_offset: 8
            }
        );
        let v1 = rsdp_v1(*b"ABCDEF", 0, 1);
        let image = Builder::new()
            .tag(TAG_ACPI_OLD, &v1)
            .tag(TAG_ACPI_OLD, &v1)
            .finish();
        assert!(matches!(
            err(&image),
            InfoError::DuplicateTag { tag: 14, .. }
        ));
        // Modules and unknown tags may repeat.
        let image = Builder::new()
            .module(1, 2, b"a")
            .module(1, 2, b"a")
            .tag(99, &[1])
            .tag(99, &[2])
            .finish();
        assert_eq!(parse(&image).unwrap().modules().count(), 2);
    }

    #[test]
    fn string_errors() {
        let image = Builder::new().tag(TAG_BOOTLOADER_NAME, b"GRUB").finish();
        assert_eq!(
            err(&image),
            InfoError::StringNotTerminated { offset: 8, tag: 2 }
        );
        let mut payload = vec![0u8; 8];
        payload.extend(b"name");
        let image = Builder::new().tag(TAG_MODULE, &payload).finish();
        assert_eq!(
            err(&image),
            InfoError::StringNotTerminated { offset: 8, tag: 3 }
        );
        let image = Builder::new().tag(TAG_CMDLINE, b"ab\xc3(\0").finish();
        assert_eq!(
            err(&image),
            InfoError::StringNotUtf8 {
                offset: 8,
                tag: 1,
                valid_up_to: 2
            }
        );
        assert!(
            err(&image)
                .to_string()
                .contains("not UTF-8 (invalid byte at index 2)")
        );
    }

    #[test]
    fn memory_map_errors() {
        for entry_size in [0, 16, 20, 28] {
            let image = Builder::new().memory_map_with(entry_size, 0, &[]).finish();
            assert_eq!(
                err(&image),
                InfoError::MemoryMapEntrySize {
                    offset: 8,
                    entry_size
                }
            );
        }
        let mut payload = Vec::new();
        payload.extend(24u32.to_le_bytes());
        payload.extend(0u32.to_le_bytes());
        payload.extend([0u8; 30]);
        let image = Builder::new().tag(TAG_MEMORY_MAP, &payload).finish();
        assert_eq!(
            err(&image),
            InfoError::MemoryMapLength {
                offset: 8,
                size: 46,
                entry_size: 24
            }
        );
        let image = Builder::new()
            .memory_map(&[(0, 0x1000, 1), (u64::MAX - 5, 6, 2)])
            .finish();
        assert_eq!(
            err(&image),
            InfoError::MemoryRegionOverflow {
                offset: 8,
                index: 1,
                start: u64::MAX - 5,
                len: 6
            }
        );
        // Ending exactly below 2^64 is fine.
        let image = Builder::new().memory_map(&[(u64::MAX - 5, 5, 2)]).finish();
        assert_eq!(
            parse(&image).unwrap().memory_map().next().unwrap().end(),
            u64::MAX
        );
    }

    #[test]
    fn rsdp_errors() {
        let mut v1 = rsdp_v1(*b"ABCDEF", 0, 1);
        v1[0] = b'X';
        let image = Builder::new().tag(TAG_ACPI_OLD, &v1).finish();
        assert_eq!(err(&image), InfoError::RsdpSignature { offset: 8, tag: 14 });

        let mut v1 = rsdp_v1(*b"ABCDEF", 0, 1);
        v1[19] ^= 1;
        let image = Builder::new().tag(TAG_ACPI_OLD, &v1).finish();
        assert_eq!(
            err(&image),
            InfoError::RsdpChecksum {
                offset: 8,
                tag: 14,
                covered: 20
            }
        );

        let mut v2 = rsdp_v1(*b"ABCDEF", 0, 1);
        v2.resize(36, 0);
        let image = Builder::new().tag(TAG_ACPI_NEW, &v2).finish();
        assert_eq!(
            err(&image),
            InfoError::RsdpRevision {
                offset: 8,
                revision: 0
            }
        );

        for length in [20u32, 40] {
            let mut v2 = rsdp_v2(*b"ABCDEF", 1, 2);
            v2[20..24].copy_from_slice(&length.to_le_bytes());
            fix_checksum(&mut v2[..20], 8);
            let image = Builder::new().tag(TAG_ACPI_NEW, &v2).finish();
            assert_eq!(
                err(&image),
                InfoError::RsdpLength {
                    offset: 8,
                    length,
                    available: 36
                }
            );
        }

        let mut v2 = rsdp_v2(*b"ABCDEF", 1, 2);
        v2[30] ^= 0x80;
        let image = Builder::new().tag(TAG_ACPI_NEW, &v2).finish();
        assert_eq!(
            err(&image),
            InfoError::RsdpChecksum {
                offset: 8,
                tag: 15,
                covered: 36
            }
        );
        assert_eq!(
            err(&image).to_string(),
            "boot info: tag 15 (ACPI 2.0 RSDP) at offset 0x8: the RSDP checksum over 36 bytes \
             does not sum to zero"
        );

        // Bytes after `length` in the tag are not covered.
        let mut v2 = rsdp_v2(*b"ABCDEF", 1, 2);
        v2.extend([1, 2, 3]);
        let image = Builder::new().tag(TAG_ACPI_NEW, &v2).finish();
        assert_eq!(parse(&image).unwrap().rsdp().unwrap().bytes.len(), 36);
    }

    #[test]
    fn every_error_displays() {
        let samples = [
            InfoError::HeaderTruncated { len: 3 },
            InfoError::TotalSizeTooSmall { total_size: 8 },
            InfoError::TotalSizeBeyondInput {
                total_size: 24,
                available: 16,
            },
            InfoError::MissingEndTag {
                offset: 24,
                total_size: 24,
            },
            InfoError::TagTooSmall {
                offset: 8,
                tag: 14,
                size: 27,
                min: 28,
            },
            InfoError::TagBeyondEnd {
                offset: 8,
                tag: 1,
                size: 200,
                total_size: 32,
            },
            InfoError::EndTagSize {
                offset: 8,
                size: 16,
            },
            InfoError::DuplicateTag {
                offset: 24,
                tag: 6,
                first_offset: 8,
            },
            InfoError::StringNotTerminated { offset: 8, tag: 2 },
            InfoError::StringNotUtf8 {
                offset: 8,
                tag: 1,
                valid_up_to: 2,
            },
            InfoError::MemoryMapEntrySize {
                offset: 8,
                entry_size: 20,
            },
            InfoError::MemoryMapLength {
                offset: 8,
                size: 46,
                entry_size: 24,
            },
            InfoError::MemoryRegionOverflow {
                offset: 8,
                index: 1,
                start: 1,
                len: u64::MAX,
            },
            InfoError::RsdpSignature { offset: 8, tag: 14 },
            InfoError::RsdpRevision {
                offset: 8,
                revision: 0,
            },
            InfoError::RsdpLength {
                offset: 8,
                length: 20,
                available: 36,
            },
            InfoError::RsdpChecksum {
                offset: 8,
                tag: 14,
                covered: 20,
            },
        ];
        for e in samples {
            let text = e.to_string();
            assert!(text.starts_with("boot info: "), "{text}");
            let _: &dyn core::error::Error = &e;
        }
    }

    #[test]
    fn memory_kind_display() {
        let names: Vec<String> = (1..=6).map(|c| MemoryKind::from(c).to_string()).collect();
        assert_eq!(
            names,
            [
                "available",
                "reserved",
                "ACPI reclaimable",
                "ACPI NVS",
                "defective",
                "type 6"
            ]
        );
        for c in 0..10 {
            assert_eq!(MemoryKind::from_code(c).code(), c);
        }
    }

    fn regions(list: &[(u64, u64, u32)]) -> Vec<MemoryRegion> {
        list.iter()
            .map(|&(start, len, kind)| MemoryRegion {
                start,
                len,
                kind: kind.into(),
            })
            .collect()
    }

    fn module_err(m: &ModuleTag<'_>, memory: &[MemoryRegion]) -> ModuleErrorKind {
        check_module(m, &[HYPERVISOR], memory.iter().copied())
            .unwrap_err()
            .kind
    }

    #[test]
    fn check_module_errors() {
        let memory = regions(&GRUB_MMAP);
        let m = ModuleTag {
            start: 0x300_0000,
            end: 0x2ff_f000,
            cmdline: b"hello.elf",
        };
        assert_eq!(m.len(), 0);
        assert!(m.is_empty());
        let e = check_module(&m, &[], memory.iter().copied()).unwrap_err();
        assert_eq!(e.kind, ModuleErrorKind::EndBeforeStart);
        assert_eq!(
            e.to_string(),
            "module 'hello.elf' (0x3000000-0x2fff000): end lies before start"
        );

        let m = ModuleTag {
            start: 0x300_0000,
            end: 0x300_0000,
            cmdline: b"a b",
        };
        assert_eq!(module_err(&m, &memory), ModuleErrorKind::Empty);

        let m = ModuleTag {
            start: 0x300_0000,
            end: 0x300_1000,
            cmdline: b"bad\xff name",
        };
        assert_eq!(
            module_err(&m, &memory),
            ModuleErrorKind::NotUtf8Cmdline { valid_up_to: 3 }
        );
        let text = check_module(&m, &[], memory.iter().copied())
            .unwrap_err()
            .to_string();
        assert!(
            text.starts_with("module 'bad\\xff' (0x3000000-0x3001000): "),
            "{text}"
        );

        let m = ModuleTag {
            start: 0x300_0000,
            end: 0x300_1000,
            cmdline: b" \t ",
        };
        assert_eq!(module_err(&m, &memory), ModuleErrorKind::MissingName);
        let text = check_module(&m, &[], memory.iter().copied())
            .unwrap_err()
            .to_string();
        assert!(
            text.starts_with("unnamed module (0x3000000-0x3001000): "),
            "{text}"
        );

        let m = ModuleTag {
            start: 0x3f_f000,
            end: 0x40_1000,
            cmdline: b"x",
        };
        let e = check_module(&m, &[HYPERVISOR], memory.iter().copied()).unwrap_err();
        assert_eq!(
            e.kind,
            ModuleErrorKind::Overlaps {
                what: "the hypervisor image",
                start: 0x20_0000,
                end: 0x40_0000
            }
        );
        assert_eq!(
            e.to_string(),
            "module 'x' (0x3ff000-0x401000): overlaps the hypervisor image (0x200000-0x400000)"
        );
        // Touching is not overlapping; empty forbidden ranges overlap nothing.
        let m = ModuleTag {
            start: 0x40_0000,
            end: 0x40_1000,
            cmdline: b"x",
        };
        check_module(
            &m,
            &[HYPERVISOR, (0x40_0800, 0x40_0800, "nothing")],
            memory.iter().copied(),
        )
        .unwrap();

        // Reaches into reserved memory, lies in a hole, or above the map.
        for (start, end) in [
            (0x9f000, 0x9fd00),
            (0xa0000, 0xa1000),
            (0x800_0000, 0x800_1000),
        ] {
            let m = ModuleTag {
                start,
                end,
                cmdline: b"x",
            };
            assert_eq!(
                module_err(&m, &memory),
                ModuleErrorKind::NotInAvailableMemory
            );
        }
        assert_eq!(
            module_err(
                &ModuleTag {
                    start: 1,
                    end: 2,
                    cmdline: b"x"
                },
                &[]
            ),
            ModuleErrorKind::NotInAvailableMemory
        );
    }

    #[test]
    fn check_module_coverage() {
        // Split and overlapping available regions together cover the module, in any order.
        let memory = regions(&[
            (0x3000, 0x1000, 1),
            (0x1000, 0x1800, 1),
            (0x2000, 0x1000, 1),
            (0x1000, 0x100, 1),
        ]);
        let m = ModuleTag {
            start: 0x1000,
            end: 0x4000,
            cmdline: b"x",
        };
        check_module(&m, &[], memory.iter().copied()).unwrap();
        let m = ModuleTag {
            start: 0x1000,
            end: 0x4001,
            cmdline: b"x",
        };
        assert_eq!(
            module_err(&m, &memory),
            ModuleErrorKind::NotInAvailableMemory
        );
        // An available region overlapped by a reserved one does not count there.
        let memory = regions(&[(0x1000, 0x3000, 1), (0x2000, 0x10, 2)]);
        let m = ModuleTag {
            start: 0x1000,
            end: 0x4000,
            cmdline: b"x",
        };
        assert_eq!(
            module_err(&m, &memory),
            ModuleErrorKind::NotInAvailableMemory
        );
        let m = ModuleTag {
            start: 0x3000,
            end: 0x4000,
            cmdline: b"x",
        };
        check_module(&m, &[], memory.iter().copied()).unwrap();
    }

    /// Uses every accessor; checks the guarantees that hold for any successful parse.
    fn exercise(info: &BootInfo<'_>) {
        assert!(info.total_size() >= 16);
        let _ = (info.cmdline(), info.bootloader_name(), info.basic_memory());
        let map_len = info.memory_map().len();
        assert_eq!(info.memory_map().count(), map_len);
        for r in info.memory_map() {
            assert!(r.start.checked_add(r.len).is_some());
            let _ = r.kind.to_string();
        }
        for m in info.modules() {
            let _ = (m.cmdline_str(), m.len(), m.name(), m.args());
            assert!(!m.cmdline.contains(&0));
            if let Err(e) = check_module(&m, &[HYPERVISOR], info.memory_map()) {
                let _ = e.to_string();
            }
        }
        if let Some(r) = info.rsdp() {
            assert_eq!(&r.bytes[..8], RSDP_SIGNATURE);
            assert_eq!(byte_sum(&r.bytes[..20]), 0);
            assert_eq!(byte_sum(r.bytes), 0);
            let _ = (r.oem_id(), r.revision(), r.rsdt_address(), r.xsdt_address());
        }
        for (ty, payload) in info.tags() {
            assert_ne!(ty, TAG_END);
            assert!(payload.len() <= info.total_size());
            let _ = tag_name(ty);
        }
    }

    fn check_any(bytes: &[u8]) {
        match parse(bytes) {
            Ok(info) => exercise(&info),
            Err(e) => {
                let _ = e.to_string();
            }
        }
    }

    /// One tag of a generated image.
    #[derive(Clone, Debug)]
    enum Piece {
        Cmdline(String),
        Loader(String),
        Module(u32, u32, Vec<u8>),
        Basic(u32, u32),
        Mmap {
            entry_size: u32,
            version: u32,
            entries: Vec<(u64, u64, u32)>,
        },
        RsdpV1([u8; 6], u8, u32),
        RsdpV2([u8; 6], u32, u64, usize),
        Unknown(u32, Vec<u8>),
    }

    fn no_nul_string() -> impl Strategy<Value = String> {
        "[^\u{0}]{0,24}"
    }

    fn region() -> impl Strategy<Value = (u64, u64, u32)> {
        (any::<u64>(), any::<u64>(), 0u32..8)
            .prop_map(|(start, len, kind)| (start, len.min(u64::MAX - start), kind))
    }

    fn pieces() -> impl Strategy<Value = Vec<Piece>> {
        let unique = (
            proptest::option::of(no_nul_string().prop_map(Piece::Cmdline)),
            proptest::option::of(no_nul_string().prop_map(Piece::Loader)),
            proptest::option::of(
                (any::<u32>(), any::<u32>()).prop_map(|(l, u)| Piece::Basic(l, u)),
            ),
            proptest::option::of(
                (
                    prop_oneof![Just(24u32), Just(32), Just(48)],
                    prop_oneof![Just(0u32), any::<u32>()],
                    proptest::collection::vec(region(), 0..8),
                )
                    .prop_map(|(entry_size, version, entries)| Piece::Mmap {
                        entry_size,
                        version,
                        entries,
                    }),
            ),
            proptest::option::of(
                (any::<[u8; 6]>(), any::<u8>(), any::<u32>())
                    .prop_map(|(o, r, a)| Piece::RsdpV1(o, r, a)),
            ),
            proptest::option::of(
                (any::<[u8; 6]>(), any::<u32>(), any::<u64>(), 0usize..5)
                    .prop_map(|(o, r, x, extra)| Piece::RsdpV2(o, r, x, extra)),
            ),
        );
        let modules = proptest::collection::vec(
            (
                any::<u32>(),
                any::<u32>(),
                proptest::collection::vec(1u8..=255, 0..24),
            )
                .prop_map(|(s, e, c)| Piece::Module(s, e, c)),
            0..4,
        );
        let unknown = proptest::collection::vec(
            (
                prop_oneof![Just(5u32), 7u32..=13, 16u32..1000],
                proptest::collection::vec(any::<u8>(), 0..20),
            )
                .prop_map(|(t, p)| Piece::Unknown(t, p)),
            0..4,
        );
        (unique, modules, unknown).prop_flat_map(|((a, b, c, d, e, f), modules, unknown)| {
            let mut all: Vec<Piece> = [a, b, c, d, e, f].into_iter().flatten().collect();
            all.extend(modules);
            all.extend(unknown);
            Just(all).prop_shuffle()
        })
    }

    fn build(pieces: &[Piece]) -> (Vec<u8>, Vec<usize>) {
        let mut b = Builder::new();
        for piece in pieces {
            b = match piece {
                Piece::Cmdline(s) => b.cmdline(s),
                Piece::Loader(s) => b.bootloader_name(s),
                Piece::Module(s, e, c) => b.module(*s, *e, c),
                Piece::Basic(l, u) => b.basic_memory(*l, *u),
                Piece::Mmap {
                    entry_size,
                    version,
                    entries,
                } => b.memory_map_with(*entry_size, *version, entries),
                Piece::RsdpV1(o, r, a) => b.tag(TAG_ACPI_OLD, &rsdp_v1(*o, *r, *a)),
                Piece::RsdpV2(o, r, x, extra) => {
                    let mut bytes = rsdp_v2(*o, *r, *x);
                    bytes.extend(std::iter::repeat_n(0x5a, *extra));
                    b.tag(TAG_ACPI_NEW, &bytes)
                }
                Piece::Unknown(t, p) => b.tag(*t, p),
            };
        }
        b.finish_with_headers()
    }

    #[derive(Clone, Debug)]
    enum Mutation {
        Flip(usize, u8),
        Set(usize, u8),
        Truncate(usize),
        TagSize(usize, u32),
        TotalSize(u32),
    }

    fn mutation() -> impl Strategy<Value = Mutation> {
        let size = prop_oneof![0u32..80, any::<u32>()];
        prop_oneof![
            (any::<usize>(), 0u8..8).prop_map(|(i, bit)| Mutation::Flip(i, bit)),
            (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
            any::<usize>().prop_map(Mutation::Truncate),
            (any::<usize>(), size.clone()).prop_map(|(i, s)| Mutation::TagSize(i, s)),
            size.prop_map(Mutation::TotalSize),
        ]
    }

    fn mutate(image: &mut Vec<u8>, headers: &[usize], m: &Mutation) {
        let len = image.len();
        if len == 0 {
            return;
        }
        match *m {
            Mutation::Flip(i, bit) => image[i % len] ^= 1 << bit,
            Mutation::Set(i, b) => image[i % len] = b,
            Mutation::Truncate(n) => image.truncate(n % len),
            Mutation::TagSize(i, size) => {
                if let Some(&h) = headers.get(i % headers.len().max(1))
                    && let Some(field) = image.get_mut(h + 4..h + 8)
                {
                    field.copy_from_slice(&size.to_le_bytes());
                }
            }
            Mutation::TotalSize(size) => {
                if let Some(field) = image.get_mut(..4) {
                    field.copy_from_slice(&size.to_le_bytes());
                }
            }
        }
    }

    proptest! {
        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            check_any(&bytes);
            // Also with a plausible total_size, to get past the header check more often.
            let mut fixed = bytes.clone();
            if fixed.len() >= 8 {
                let total = u32::try_from(fixed.len()).unwrap();
                fixed[..4].copy_from_slice(&total.to_le_bytes());
                check_any(&fixed);
            }
        }

        #[test]
        fn mutations_never_panic(
            pieces in pieces(),
            grub in any::<bool>(),
            mutations in proptest::collection::vec(mutation(), 1..6),
        ) {
            let (mut image, headers) = if grub {
                let image = grub_image();
                let info = parse(&image).unwrap();
                let headers = {
                    // Recompute header offsets from the tag payload positions.
                    let base = image.as_ptr() as usize;
                    let mut h: Vec<usize> =
                        info.tags().map(|(_, p)| p.as_ptr() as usize - base - 8).collect();
                    h.push(image.len() - 8);
                    h
                };
                (image, headers)
            } else {
                build(&pieces)
            };
            for m in &mutations {
                mutate(&mut image, &headers, m);
            }
            check_any(&image);
        }

        #[test]
        fn round_trip(pieces in pieces()) {
            let (image, headers) = build(&pieces);
            let info = parse(&image).unwrap();
            exercise(&info);
            prop_assert_eq!(info.total_size(), image.len());
            prop_assert_eq!(info.tags().count() + 1, headers.len());

            let mut modules = Vec::new();
            let (mut cmdline, mut loader, mut basic, mut map) = (None, None, None, None);
            let (mut v1, mut v2) = (None, None);
            for (piece, (ty, _)) in pieces.iter().zip(info.tags()) {
                match piece {
                    Piece::Cmdline(s) => { prop_assert_eq!(ty, 1); cmdline = Some(s.as_str()); }
                    Piece::Loader(s) => { prop_assert_eq!(ty, 2); loader = Some(s.as_str()); }
                    Piece::Module(s, e, c) => modules.push((*s, *e, c.as_slice())),
                    Piece::Basic(l, u) => basic = Some((*l, *u)),
                    Piece::Mmap { entries, .. } => map = Some(regions(entries)),
                    Piece::RsdpV1(o, r, a) => v1 = Some(rsdp_v1(*o, *r, *a)),
                    Piece::RsdpV2(o, r, x, _) => v2 = Some(rsdp_v2(*o, *r, *x)),
                    Piece::Unknown(t, _) => prop_assert_eq!(ty, *t),
                }
            }
            prop_assert_eq!(info.cmdline(), cmdline);
            prop_assert_eq!(info.bootloader_name(), loader);
            prop_assert_eq!(info.basic_memory(), basic);
            prop_assert_eq!(info.has_memory_map(), map.is_some());
            prop_assert_eq!(info.memory_map().collect::<Vec<_>>(), map.unwrap_or_default());
            let got: Vec<_> = info.modules().map(|m| (m.start, m.end, m.cmdline)).collect();
            prop_assert_eq!(got, modules);
            let expected_rsdp = v2.clone().map(|b| (2, b)).or(v1.map(|b| (1, b)));
            prop_assert_eq!(info.rsdp().map(|r| (r.version, r.bytes.to_vec())), expected_rsdp);
        }
    }
}
