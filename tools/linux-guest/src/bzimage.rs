//! The bzImage file: its real-mode setup header (Linux x86 boot protocol,
//! `Documentation/arch/x86/boot.rst`) and its compressed payload, the vmlinux ELF.
//!
//! The setup header itself is parsed by `hvprof_linux_boot` (re-exported here), the crate the
//! hypervisor's loader uses too; this module adds what only the host needs: the kernel version
//! string and the decompressed payload.

use std::fmt;

use crate::Error;

/// The setup header and the boot protocol's constants: one parser, shared with the hypervisor's
/// loader (`shared/linux-boot`).
pub use hvprof_linux_boot::{
    self as protocol, CAN_USE_HEAP, ENTRY_64_OFFSET, HeaderError, LOADED_HIGH, SetupHeader,
    XLF_CAN_BE_LOADED_ABOVE_4G, XLF_KERNEL_64, boot_params,
};

impl From<HeaderError> for Error {
    fn from(e: HeaderError) -> Self {
        Error::BzImage(e.to_string())
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
    /// The string the header's `kernel_version` points to (lossy UTF-8).
    pub kernel_version: Option<String>,
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
            kernel_version: header
                .kernel_version_bytes(image)
                .map(|b| String::from_utf8_lossy(b).into_owned()),
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

impl fmt::Display for BzImage<'_> {
    /// The setup header, one group of fields a line, and the payload.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = &self.header;
        writeln!(
            f,
            "boot protocol {}.{:02}, kernel \"{}\"",
            h.version >> 8,
            h.version & 0xff,
            self.kernel_version.as_deref().unwrap_or("?")
        )?;
        writeln!(
            f,
            "setup_sects {} (protected-mode kernel at file offset {:#x}), code32_start {:#x}, 64-bit entry at load address + {:#x}: {}",
            h.setup_sects,
            h.kernel_offset(),
            h.code32_start,
            ENTRY_64_OFFSET,
            if h.has_64bit_entry() { "yes" } else { "no" }
        )?;
        writeln!(
            f,
            "loadflags {:#04x} (LOADED_HIGH {}, CAN_USE_HEAP {}), xloadflags {:#06x} (KERNEL_64 {}, CAN_BE_LOADED_ABOVE_4G {})",
            h.loadflags,
            h.loadflags & LOADED_HIGH != 0,
            h.loadflags & CAN_USE_HEAP != 0,
            h.xloadflags,
            h.xloadflags & XLF_KERNEL_64 != 0,
            h.xloadflags & XLF_CAN_BE_LOADED_ABOVE_4G != 0
        )?;
        writeln!(
            f,
            "relocatable {}, kernel_alignment {:#x}, min_alignment 2^{}, pref_address {:#x}, init_size {:#x} ({} MiB)",
            h.relocatable_kernel,
            h.kernel_alignment,
            h.min_alignment,
            h.pref_address,
            h.init_size,
            h.init_size >> 20
        )?;
        write!(
            f,
            "initrd_addr_max {:#x}, cmdline_size {}, payload at +{:#x}, {} bytes, handover_offset {:#x}, kernel_info_offset {:#x}",
            h.initrd_addr_max,
            h.cmdline_size,
            h.payload_offset,
            h.payload_length,
            h.handover_offset,
            h.kernel_info_offset
        )
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
        let bz = BzImage::parse(&img).unwrap();
        let h = bz.header;
        assert_eq!(h.version, 0x020f);
        assert_eq!(h.kernel_offset(), 1024);
        assert_eq!(bz.kernel_version.as_deref(), Some("6.9.9"));
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
