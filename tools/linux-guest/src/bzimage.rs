//! The bzImage file: its real-mode setup header (Linux x86 boot protocol,
//! `Documentation/arch/x86/boot.rst`) and its compressed payload, the vmlinux ELF.
//!
//! Offsets below are file offsets, which are also offsets into the "zero page"
//! (`struct boot_params`): the setup header is copied to the same place there.

use std::fmt;

use crate::Error;

/// File offset of the setup header (`struct setup_header`, the `hdr` field of `boot_params`).
pub const SETUP_HEADER_OFFSET: usize = 0x1f1;
/// `"HdrS"`, at 0x202.
pub const HEADER_MAGIC: u32 = 0x5372_6448;
/// Offset of the 64-bit entry point from the start of the protected-mode kernel
/// (the load address), when `xloadflags` has `XLF_KERNEL_64`.
pub const ENTRY_64_OFFSET: u64 = 0x200;

/// `loadflags` bits.
pub const LOADED_HIGH: u8 = 1 << 0;
pub const KASLR_FLAG: u8 = 1 << 1;
pub const QUIET_FLAG: u8 = 1 << 5;
pub const KEEP_SEGMENTS: u8 = 1 << 6;
pub const CAN_USE_HEAP: u8 = 1 << 7;

/// `xloadflags` bits.
pub const XLF_KERNEL_64: u16 = 1 << 0;
pub const XLF_CAN_BE_LOADED_ABOVE_4G: u16 = 1 << 1;
pub const XLF_EFI_HANDOVER_32: u16 = 1 << 2;
pub const XLF_EFI_HANDOVER_64: u16 = 1 << 3;
pub const XLF_EFI_KEXEC: u16 = 1 << 4;

/// Offsets into `struct boot_params` (the zero page) a 64-bit boot loader fills in, besides the
/// setup header it copies to [`SETUP_HEADER_OFFSET`] (`arch/x86/include/uapi/asm/bootparam.h`).
pub mod boot_params {
    /// Size of the zero page.
    pub const SIZE: usize = 0x1000;
    /// `u64 acpi_rsdp_addr`.
    pub const ACPI_RSDP_ADDR: usize = 0x070;
    /// `u32 ext_ramdisk_image`, `ext_ramdisk_size`, `ext_cmd_line_ptr`: the high 32 bits.
    pub const EXT_RAMDISK_IMAGE: usize = 0x0c0;
    pub const EXT_RAMDISK_SIZE: usize = 0x0c4;
    pub const EXT_CMD_LINE_PTR: usize = 0x0c8;
    /// `u8 e820_entries`.
    pub const E820_ENTRIES: usize = 0x1e8;
    /// `struct boot_e820_entry e820_table[128]`: `u64 addr, u64 size, u32 type`, packed (20 bytes).
    pub const E820_TABLE: usize = 0x2d0;
    pub const E820_ENTRY_SIZE: usize = 20;
    pub const E820_MAX_ENTRIES: usize = 128;
    /// e820 types.
    pub const E820_RAM: u32 = 1;
    pub const E820_RESERVED: u32 = 2;
    /// Setup header fields in the zero page (same offsets as in the file).
    pub const TYPE_OF_LOADER: usize = 0x210;
    pub const LOADFLAGS: usize = 0x211;
    pub const RAMDISK_IMAGE: usize = 0x218;
    pub const RAMDISK_SIZE: usize = 0x21c;
    pub const CMD_LINE_PTR: usize = 0x228;
}

/// The setup header fields a boot loader reads, as found in the file.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SetupHeader {
    /// Number of 512-byte setup sectors after the boot sector (0 means 4).
    pub setup_sects: u8,
    /// Boot protocol version, e.g. 0x020f for 2.15.
    pub version: u16,
    /// The kernel version string the header points to (`kernel_version` + 0x200).
    pub kernel_version: Option<String>,
    pub loadflags: u8,
    /// 32-bit entry (protected mode), the default load address 0x100000 for a bzImage.
    pub code32_start: u32,
    pub initrd_addr_max: u32,
    pub kernel_alignment: u32,
    pub relocatable_kernel: bool,
    pub min_alignment: u8,
    pub xloadflags: u16,
    /// Maximum command line length, without the NUL.
    pub cmdline_size: u32,
    /// Offset of the compressed payload from the start of the protected-mode code.
    pub payload_offset: u32,
    pub payload_length: u32,
    pub pref_address: u64,
    /// Memory the kernel needs from its load address until it has set itself up.
    pub init_size: u32,
    pub handover_offset: u32,
    pub kernel_info_offset: u32,
}

impl SetupHeader {
    /// Parses the setup header of a bzImage. Needs boot protocol 2.10 or later (the fields up
    /// to `init_size`); 2.12 for `xloadflags`.
    pub fn parse(image: &[u8]) -> Result<Self, Error> {
        let bad = |what: String| Error::BzImage(what);
        if image.len() < 0x270 {
            return Err(bad(format!(
                "{} bytes is too short for a setup header (needs 0x270)",
                image.len()
            )));
        }
        let boot_flag = le16(image, 0x1fe);
        if boot_flag != 0xaa55 {
            return Err(bad(format!(
                "boot_flag at 0x1fe is {boot_flag:#06x}, not 0xaa55"
            )));
        }
        let magic = le32(image, 0x202);
        if magic != HEADER_MAGIC {
            return Err(bad(format!(
                "no \"HdrS\" signature at 0x202 (found {magic:#010x}): not a bzImage"
            )));
        }
        let version = le16(image, 0x206);
        if version < 0x020c {
            return Err(bad(format!(
                "boot protocol {}.{:02} is older than 2.12 (no xloadflags)",
                version >> 8,
                version & 0xff
            )));
        }
        let setup_sects = image[0x1f1];
        let kernel_version = match le16(image, 0x20e) {
            0 => None,
            ptr => c_string(image, usize::from(ptr) + 0x200),
        };
        let header = SetupHeader {
            setup_sects,
            version,
            kernel_version,
            loadflags: image[0x211],
            code32_start: le32(image, 0x214),
            initrd_addr_max: le32(image, 0x22c),
            kernel_alignment: le32(image, 0x230),
            relocatable_kernel: image[0x234] != 0,
            min_alignment: image[0x235],
            xloadflags: le16(image, 0x236),
            cmdline_size: le32(image, 0x238),
            payload_offset: le32(image, 0x248),
            payload_length: le32(image, 0x24c),
            pref_address: le64(image, 0x258),
            init_size: le32(image, 0x260),
            handover_offset: le32(image, 0x264),
            kernel_info_offset: le32(image, 0x268),
        };
        if header.kernel_offset() >= image.len() {
            return Err(bad(format!(
                "setup_sects {} puts the protected-mode kernel at {:#x}, past the end of the {}-byte file",
                setup_sects,
                header.kernel_offset(),
                image.len()
            )));
        }
        Ok(header)
    }

    /// File offset of the protected-mode kernel: `(setup_sects + 1) * 512`.
    pub fn kernel_offset(&self) -> usize {
        let sects = if self.setup_sects == 0 {
            4
        } else {
            usize::from(self.setup_sects)
        };
        (sects + 1) * 512
    }

    /// Whether the image has a 64-bit entry point at load address + 0x200.
    pub fn has_64bit_entry(&self) -> bool {
        self.xloadflags & XLF_KERNEL_64 != 0
    }

    /// The payload's file range.
    pub fn payload_range(&self, file_len: usize) -> Result<std::ops::Range<usize>, Error> {
        let start = self.kernel_offset() + self.payload_offset as usize;
        let end = start + self.payload_length as usize;
        if self.payload_length == 0 || end > file_len {
            return Err(Error::BzImage(format!(
                "payload {:#x}+{:#x} does not fit in the {}-byte file",
                start, self.payload_length, file_len
            )));
        }
        Ok(start..end)
    }
}

impl fmt::Display for SetupHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "boot protocol {}.{:02}, kernel \"{}\"",
            self.version >> 8,
            self.version & 0xff,
            self.kernel_version.as_deref().unwrap_or("?")
        )?;
        writeln!(
            f,
            "setup_sects {} (protected-mode kernel at file offset {:#x}), code32_start {:#x}, 64-bit entry at load address + {:#x}: {}",
            self.setup_sects,
            self.kernel_offset(),
            self.code32_start,
            ENTRY_64_OFFSET,
            if self.has_64bit_entry() { "yes" } else { "no" }
        )?;
        writeln!(
            f,
            "loadflags {:#04x} (LOADED_HIGH {}, CAN_USE_HEAP {}), xloadflags {:#06x} (KERNEL_64 {}, CAN_BE_LOADED_ABOVE_4G {})",
            self.loadflags,
            self.loadflags & LOADED_HIGH != 0,
            self.loadflags & CAN_USE_HEAP != 0,
            self.xloadflags,
            self.xloadflags & XLF_KERNEL_64 != 0,
            self.xloadflags & XLF_CAN_BE_LOADED_ABOVE_4G != 0
        )?;
        writeln!(
            f,
            "relocatable {}, kernel_alignment {:#x}, min_alignment 2^{}, pref_address {:#x}, init_size {:#x} ({} MiB)",
            self.relocatable_kernel,
            self.kernel_alignment,
            self.min_alignment,
            self.pref_address,
            self.init_size,
            self.init_size >> 20
        )?;
        write!(
            f,
            "initrd_addr_max {:#x}, cmdline_size {}, payload at +{:#x}, {} bytes, handover_offset {:#x}, kernel_info_offset {:#x}",
            self.initrd_addr_max,
            self.cmdline_size,
            self.payload_offset,
            self.payload_length,
            self.handover_offset,
            self.kernel_info_offset
        )
    }
}

/// How the payload is compressed (found from its magic bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Compression {
    /// LZ4 legacy frame format (`lz4 -l`), used by Debian's cloud kernel.
    Lz4Legacy,
    /// XZ with the x86 BCJ filter, the default of Debian's standard kernel.
    Xz,
    Gzip,
}

impl Compression {
    /// Recognizes the compressor from the first bytes of the payload.
    pub fn detect(payload: &[u8]) -> Result<Self, Error> {
        match payload {
            [0x02, 0x21, 0x4c, 0x18, ..] => Ok(Self::Lz4Legacy),
            [0xfd, b'7', b'z', b'X', b'Z', 0x00, ..] => Ok(Self::Xz),
            [0x1f, 0x8b, ..] => Ok(Self::Gzip),
            _ => Err(Error::BzImage(format!(
                "payload starts with {:02x?}: not LZ4 legacy, XZ or gzip (bzip2, LZMA, LZO and zstd kernels are not supported)",
                &payload[..payload.len().min(6)]
            ))),
        }
    }
}

/// The kernel writes the size of the decompressed image as a little-endian u32 after the
/// compressed stream (`size_append` in `arch/x86/boot/compressed/Makefile`).
const SIZE_TRAILER: usize = 4;
/// LZ4 legacy frames split the input into blocks of 8 MiB of output.
const LZ4_LEGACY_BLOCK: usize = 8 << 20;
const LZ4_LEGACY_MAGIC: [u8; 4] = [0x02, 0x21, 0x4c, 0x18];
/// A decompressed kernel larger than this is refused (the trailer is read from the input).
const MAX_VMLINUX: usize = 1 << 30;
/// The most memory reserved up front from the (untrusted) trailer.
const PREALLOCATE: usize = 128 << 20;

/// A parsed bzImage.
#[derive(Clone, Debug)]
pub struct BzImage<'a> {
    pub header: SetupHeader,
    pub compression: Compression,
    payload: &'a [u8],
}

impl<'a> BzImage<'a> {
    pub fn parse(image: &'a [u8]) -> Result<Self, Error> {
        let header = SetupHeader::parse(image)?;
        let payload = &image[header.payload_range(image.len())?];
        let compression = Compression::detect(payload)?;
        Ok(Self {
            header,
            compression,
            payload,
        })
    }

    /// The size of the decompressed vmlinux the payload announces in its trailer.
    pub fn vmlinux_size(&self) -> Result<usize, Error> {
        if self.payload.len() < SIZE_TRAILER {
            return Err(Error::BzImage(
                "payload too short for its size trailer".into(),
            ));
        }
        let size = le32(self.payload, self.payload.len() - SIZE_TRAILER) as usize;
        if size > MAX_VMLINUX {
            return Err(Error::BzImage(format!(
                "payload trailer announces a {size}-byte vmlinux, more than the 1 GiB accepted"
            )));
        }
        Ok(size)
    }

    /// Decompresses the payload: the vmlinux ELF file. Checks its size against the trailer.
    pub fn vmlinux(&self) -> Result<Vec<u8>, Error> {
        let expected = self.vmlinux_size()?;
        let stream = &self.payload[..self.payload.len() - SIZE_TRAILER];
        let out = match self.compression {
            Compression::Lz4Legacy => lz4_legacy(stream, expected)?,
            Compression::Xz => read_all(xz2::read::XzDecoder::new(stream), expected, "XZ")?,
            Compression::Gzip => read_all(flate2::read::GzDecoder::new(stream), expected, "gzip")?,
        };
        if out.len() != expected {
            return Err(Error::BzImage(format!(
                "payload decompressed to {} bytes, its trailer says {expected}",
                out.len()
            )));
        }
        if !out.starts_with(b"\x7fELF") {
            return Err(Error::BzImage(
                "decompressed payload is not an ELF file".into(),
            ));
        }
        Ok(out)
    }
}

fn read_all(mut reader: impl std::io::Read, expected: usize, what: &str) -> Result<Vec<u8>, Error> {
    use std::io::Read;
    let mut out = Vec::with_capacity(expected.min(PREALLOCATE));
    // Read one byte more than announced so a longer stream is caught, without reading a bomb.
    (&mut reader)
        .take(expected as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| Error::BzImage(format!("{what} payload: {e}")))?;
    Ok(out)
}

/// Decodes an LZ4 legacy stream: the magic, then blocks each preceded by their compressed
/// size (u32 LE), each decompressing to at most 8 MiB. A repeated magic starts a new stream.
fn lz4_legacy(mut input: &[u8], expected: usize) -> Result<Vec<u8>, Error> {
    let bad = |what: String| Error::BzImage(format!("LZ4 legacy payload: {what}"));
    let mut out = Vec::with_capacity(expected.min(PREALLOCATE));
    let mut block = vec![0u8; LZ4_LEGACY_BLOCK];
    if !input.starts_with(&LZ4_LEGACY_MAGIC) {
        return Err(bad("no legacy-frame magic".into()));
    }
    input = &input[4..];
    while !input.is_empty() {
        if input.len() < 4 {
            return Err(bad(format!("{} stray bytes at the end", input.len())));
        }
        if input.starts_with(&LZ4_LEGACY_MAGIC) {
            input = &input[4..];
            continue;
        }
        let size = le32(input, 0) as usize;
        input = &input[4..];
        if size > input.len() {
            return Err(bad(format!(
                "block of {size} bytes but only {} left",
                input.len()
            )));
        }
        let n = lz4_flex::block::decompress_into(&input[..size], &mut block)
            .map_err(|e| bad(format!("block at output offset {}: {e}", out.len())))?;
        if out.len() + n > MAX_VMLINUX {
            return Err(bad("output larger than 1 GiB".into()));
        }
        out.extend_from_slice(&block[..n]);
        input = &input[size..];
    }
    Ok(out)
}

pub(crate) fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

pub(crate) fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

pub(crate) fn le64(b: &[u8], at: usize) -> u64 {
    u64::from(le32(b, at)) | (u64::from(le32(b, at + 4)) << 32)
}

fn c_string(b: &[u8], at: usize) -> Option<String> {
    let tail = b.get(at..)?;
    let end = tail.iter().take(256).position(|&c| c == 0)?;
    Some(String::from_utf8_lossy(&tail[..end]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal bzImage: 1 setup sector, a payload of `payload` at +0.
    pub(crate) fn synthetic(payload: &[u8]) -> Vec<u8> {
        let mut img = vec![0u8; 1024];
        img[0x1f1] = 1;
        img[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
        img[0x202..0x206].copy_from_slice(b"HdrS");
        img[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
        img[0x20e..0x210].copy_from_slice(&0x100u16.to_le_bytes()); // string at 0x300
        img[0x300..0x305].copy_from_slice(b"6.9.9");
        img[0x211] = LOADED_HIGH | CAN_USE_HEAP;
        img[0x214..0x218].copy_from_slice(&0x100000u32.to_le_bytes());
        img[0x234] = 1;
        img[0x236..0x238].copy_from_slice(&0x7fu16.to_le_bytes());
        img[0x248..0x24c].copy_from_slice(&0u32.to_le_bytes());
        img[0x24c..0x250].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        img[0x258..0x260].copy_from_slice(&0x1000000u64.to_le_bytes());
        img.extend_from_slice(payload);
        img
    }

    fn fake_elf(len: usize) -> Vec<u8> {
        let mut v: Vec<u8> = (0..len).map(|i| (i * 7 % 13) as u8).collect();
        v[..4].copy_from_slice(b"\x7fELF");
        v
    }

    #[test]
    fn header_fields_are_read_from_their_offsets() {
        let img = synthetic(&[0x1f, 0x8b, 0, 0, 0, 0, 0, 0]);
        let h = SetupHeader::parse(&img).unwrap();
        assert_eq!(h.version, 0x020f);
        assert_eq!(h.kernel_offset(), 1024);
        assert_eq!(h.kernel_version.as_deref(), Some("6.9.9"));
        assert_eq!(h.code32_start, 0x100000);
        assert!(h.relocatable_kernel && h.has_64bit_entry());
        assert_eq!(h.pref_address, 0x1000000);
        assert_eq!(h.payload_range(img.len()).unwrap(), 1024..1032);
    }

    #[test]
    fn not_a_bzimage_is_named() {
        let mut img = synthetic(&[0; 8]);
        img[0x202] = b'X';
        let e = SetupHeader::parse(&img).unwrap_err().to_string();
        assert!(e.contains("HdrS"), "{e}");
        let e = SetupHeader::parse(&img[..100]).unwrap_err().to_string();
        assert!(e.contains("too short"), "{e}");
    }

    #[test]
    fn lz4_legacy_payload_round_trips_across_blocks() {
        // 9 MiB: two legacy blocks.
        let elf = fake_elf(9 << 20);
        let mut payload = LZ4_LEGACY_MAGIC.to_vec();
        for chunk in elf.chunks(LZ4_LEGACY_BLOCK) {
            let c = lz4_flex::block::compress(chunk);
            payload.extend_from_slice(&(c.len() as u32).to_le_bytes());
            payload.extend_from_slice(&c);
        }
        payload.extend_from_slice(&(elf.len() as u32).to_le_bytes());
        let img = synthetic(&payload);
        let bz = BzImage::parse(&img).unwrap();
        assert_eq!(bz.compression, Compression::Lz4Legacy);
        assert_eq!(bz.vmlinux().unwrap(), elf);
    }

    #[test]
    fn gzip_payload_round_trips_and_size_is_checked() {
        use std::io::Write;
        let elf = fake_elf(5000);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&elf).unwrap();
        let mut payload = gz.finish().unwrap();
        payload.extend_from_slice(&(elf.len() as u32).to_le_bytes());
        let bz_img = synthetic(&payload);
        assert_eq!(BzImage::parse(&bz_img).unwrap().vmlinux().unwrap(), elf);
        // A wrong trailer is reported.
        let n = payload.len();
        payload[n - 4..].copy_from_slice(&4999u32.to_le_bytes());
        let e = BzImage::parse(&synthetic(&payload))
            .unwrap()
            .vmlinux()
            .unwrap_err()
            .to_string();
        assert!(e.contains("trailer says 4999"), "{e}");
    }

    #[test]
    fn xz_payload_round_trips() {
        use std::io::Write;
        let elf = fake_elf(100_000);
        let mut xz = xz2::write::XzEncoder::new(Vec::new(), 1);
        xz.write_all(&elf).unwrap();
        let mut payload = xz.finish().unwrap();
        payload.extend_from_slice(&(elf.len() as u32).to_le_bytes());
        let bz = BzImage::parse(&synthetic(&payload))
            .unwrap()
            .vmlinux()
            .unwrap();
        assert_eq!(bz, elf);
    }

    #[test]
    fn unknown_compression_is_named() {
        let e = BzImage::parse(&synthetic(b"BZh91AY&SY"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not LZ4 legacy, XZ or gzip"), "{e}");
    }
}
