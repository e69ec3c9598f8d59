//! The Linux x86 boot protocol's setup header (`Documentation/arch/x86/boot.rst`, "The Real-Mode
//! Kernel Header") and the parts of the zero page (`struct boot_params`,
//! `arch/x86/include/uapi/asm/bootparam.h`) a 64-bit boot loader fills in.
//!
//! One definition for the hypervisor's bzImage loader (`hypervisor/src/linux_boot.rs`) and the
//! host tools (`tools/linux-guest`, which also decompresses the payload). `no_std`, no
//! allocation; parsing any input returns a value or an error, never panics.
//!
//! Offsets are file offsets, which are also offsets into the zero page: a boot loader copies the
//! setup header to the same place there.
#![cfg_attr(not(test), no_std)]

use core::fmt;
use core::ops::Range;

/// File offset of the setup header (`struct setup_header`, the `hdr` field of `boot_params`).
pub const SETUP_HEADER_OFFSET: usize = 0x1f1;
/// `"HdrS"`, at [`offset::HEADER`].
pub const HEADER_MAGIC: u32 = 0x5372_6448;
/// The boot sector's signature at [`offset::BOOT_FLAG`].
pub const BOOT_FLAG: u16 = 0xaa55;
/// The oldest protocol parsed: 2.12 added `xloadflags` (and with it the 64-bit entry flag).
pub const MIN_VERSION: u16 = 0x020c;
/// Bytes a file needs for every field [`SetupHeader`] reads (the header of protocol 2.15 ends at
/// 0x26c; rounded up to the next 16 bytes).
pub const MIN_LEN: usize = 0x270;
/// Offset of the 64-bit entry point from the start of the protected-mode kernel (the load
/// address), when `xloadflags` has [`XLF_KERNEL_64`].
pub const ENTRY_64_OFFSET: u64 = 0x200;
/// The `type_of_loader` value of a boot loader without an assigned ID.
pub const LOADER_UNDEFINED: u8 = 0xff;

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

/// Setup header fields: offsets in the file and in the zero page (boot.rst "The Real-Mode Kernel
/// Header").
pub mod offset {
    pub const SETUP_SECTS: usize = 0x1f1;
    pub const BOOT_FLAG: usize = 0x1fe;
    /// The second byte of the `jmp` at 0x200: the header ends at 0x202 plus this byte.
    pub const JUMP_LENGTH: usize = 0x201;
    pub const HEADER: usize = 0x202;
    pub const VERSION: usize = 0x206;
    /// `u16 kernel_version`: the version string is at this value + 0x200 in the file.
    pub const KERNEL_VERSION: usize = 0x20e;
    pub const TYPE_OF_LOADER: usize = 0x210;
    pub const LOADFLAGS: usize = 0x211;
    pub const CODE32_START: usize = 0x214;
    pub const RAMDISK_IMAGE: usize = 0x218;
    pub const RAMDISK_SIZE: usize = 0x21c;
    pub const CMD_LINE_PTR: usize = 0x228;
    pub const INITRD_ADDR_MAX: usize = 0x22c;
    pub const KERNEL_ALIGNMENT: usize = 0x230;
    pub const RELOCATABLE_KERNEL: usize = 0x234;
    pub const MIN_ALIGNMENT: usize = 0x235;
    pub const XLOADFLAGS: usize = 0x236;
    pub const CMDLINE_SIZE: usize = 0x238;
    pub const PAYLOAD_OFFSET: usize = 0x248;
    pub const PAYLOAD_LENGTH: usize = 0x24c;
    pub const PREF_ADDRESS: usize = 0x258;
    pub const INIT_SIZE: usize = 0x260;
    pub const HANDOVER_OFFSET: usize = 0x264;
    pub const KERNEL_INFO_OFFSET: usize = 0x268;
}

/// Offsets into `struct boot_params` (the zero page) a 64-bit boot loader fills in besides the
/// setup header (`arch/x86/include/uapi/asm/bootparam.h`; boot.rst "The Zero Page").
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
}

/// What is wrong with a setup header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderError {
    /// The file is shorter than [`MIN_LEN`].
    TooShort { len: usize },
    /// No 0xAA55 at 0x1fe.
    BootFlag(u16),
    /// No "HdrS" at 0x202.
    Magic(u32),
    /// Boot protocol older than [`MIN_VERSION`].
    Protocol(u16),
    /// `setup_sects` puts the protected-mode kernel at or past the end of the file.
    KernelPastEnd { kernel_offset: usize, len: usize },
    /// `payload_offset`/`payload_length` are empty or reach past the end of the file.
    Payload { start: u64, length: u32, len: usize },
}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            HeaderError::TooShort { len } => write!(
                f,
                "{len} bytes is too short for a setup header (needs {MIN_LEN:#x})"
            ),
            HeaderError::BootFlag(flag) => {
                write!(f, "boot_flag at 0x1fe is {flag:#06x}, not 0xaa55")
            }
            HeaderError::Magic(magic) => write!(
                f,
                "no \"HdrS\" signature at 0x202 (found {magic:#010x}): not a bzImage"
            ),
            HeaderError::Protocol(v) => write!(
                f,
                "boot protocol {}.{:02} is older than 2.12 (no xloadflags, no 64-bit entry)",
                v >> 8,
                v & 0xff
            ),
            HeaderError::KernelPastEnd { kernel_offset, len } => write!(
                f,
                "setup_sects puts the protected-mode kernel at {kernel_offset:#x}, past the end of the {len}-byte file"
            ),
            HeaderError::Payload { start, length, len } => write!(
                f,
                "payload {start:#x}+{length:#x} does not fit in the {len}-byte file"
            ),
        }
    }
}

impl core::error::Error for HeaderError {}

/// The setup header fields a boot loader reads, as found in the file (boot protocol 2.12+).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct SetupHeader {
    /// Number of 512-byte setup sectors after the boot sector (0 means 4).
    pub setup_sects: u8,
    /// Boot protocol version, e.g. 0x020f for 2.15.
    pub version: u16,
    /// Where the kernel version string is: this value + 0x200 in the file (0: none).
    pub kernel_version: u16,
    pub loadflags: u8,
    /// 32-bit entry (protected mode), the default load address 0x100000 for a bzImage.
    pub code32_start: u32,
    /// The highest address the initrd may end at.
    pub initrd_addr_max: u32,
    pub kernel_alignment: u32,
    pub relocatable_kernel: bool,
    /// log2 of the smallest alignment the kernel accepts.
    pub min_alignment: u8,
    pub xloadflags: u16,
    /// Maximum command line length, without the NUL.
    pub cmdline_size: u32,
    /// Offset of the compressed payload from the start of the protected-mode code.
    pub payload_offset: u32,
    pub payload_length: u32,
    /// Preferred load address.
    pub pref_address: u64,
    /// Memory the kernel needs from its load address until it has set itself up.
    pub init_size: u32,
    pub handover_offset: u32,
    pub kernel_info_offset: u32,
}

fn bytes<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    b.get(at..at.saturating_add(N))
        .and_then(|s| s.try_into().ok())
        .unwrap_or([0; N])
}
fn u8_at(b: &[u8], at: usize) -> u8 {
    b.get(at).copied().unwrap_or(0)
}
fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(bytes(b, at))
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes(b, at))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes(b, at))
}

/// Whether `image` carries a setup header's signatures (0xAA55 at 0x1fe, "HdrS" at 0x202),
/// whatever else is wrong with it.
pub fn looks_like_bzimage(image: &[u8]) -> bool {
    u16_at(image, offset::BOOT_FLAG) == BOOT_FLAG && u32_at(image, offset::HEADER) == HEADER_MAGIC
}

impl SetupHeader {
    /// Parses and checks the setup header of a bzImage: long enough, both signatures, protocol
    /// 2.12 or later, and a protected-mode kernel inside the file. Whether the kernel has the
    /// entry a loader needs is the loader's question ([`Self::has_64bit_entry`]).
    pub fn parse(image: &[u8]) -> Result<Self, HeaderError> {
        if image.len() < MIN_LEN {
            return Err(HeaderError::TooShort { len: image.len() });
        }
        let boot_flag = u16_at(image, offset::BOOT_FLAG);
        if boot_flag != BOOT_FLAG {
            return Err(HeaderError::BootFlag(boot_flag));
        }
        let magic = u32_at(image, offset::HEADER);
        if magic != HEADER_MAGIC {
            return Err(HeaderError::Magic(magic));
        }
        let version = u16_at(image, offset::VERSION);
        if version < MIN_VERSION {
            return Err(HeaderError::Protocol(version));
        }
        let header = SetupHeader {
            setup_sects: u8_at(image, offset::SETUP_SECTS),
            version,
            kernel_version: u16_at(image, offset::KERNEL_VERSION),
            loadflags: u8_at(image, offset::LOADFLAGS),
            code32_start: u32_at(image, offset::CODE32_START),
            initrd_addr_max: u32_at(image, offset::INITRD_ADDR_MAX),
            kernel_alignment: u32_at(image, offset::KERNEL_ALIGNMENT),
            relocatable_kernel: u8_at(image, offset::RELOCATABLE_KERNEL) != 0,
            min_alignment: u8_at(image, offset::MIN_ALIGNMENT),
            xloadflags: u16_at(image, offset::XLOADFLAGS),
            cmdline_size: u32_at(image, offset::CMDLINE_SIZE),
            payload_offset: u32_at(image, offset::PAYLOAD_OFFSET),
            payload_length: u32_at(image, offset::PAYLOAD_LENGTH),
            pref_address: u64_at(image, offset::PREF_ADDRESS),
            init_size: u32_at(image, offset::INIT_SIZE),
            handover_offset: u32_at(image, offset::HANDOVER_OFFSET),
            kernel_info_offset: u32_at(image, offset::KERNEL_INFO_OFFSET),
        };
        if header.kernel_offset() >= image.len() {
            return Err(HeaderError::KernelPastEnd {
                kernel_offset: header.kernel_offset(),
                len: image.len(),
            });
        }
        Ok(header)
    }

    /// The number of setup sectors: `setup_sects`, where 0 means 4.
    pub fn setup_sectors(&self) -> usize {
        match self.setup_sects {
            0 => 4,
            n => usize::from(n),
        }
    }

    /// File offset of the protected-mode kernel: `(setup sectors + 1) * 512`.
    pub fn kernel_offset(&self) -> usize {
        (self.setup_sectors() + 1) * 512
    }

    /// Whether the image has a 64-bit entry point at load address + [`ENTRY_64_OFFSET`].
    pub fn has_64bit_entry(&self) -> bool {
        self.xloadflags & XLF_KERNEL_64 != 0
    }

    /// The file range of the compressed payload (the vmlinux), checked against the file length.
    pub fn payload_range(&self, file_len: usize) -> Result<Range<usize>, HeaderError> {
        let start = self.kernel_offset() as u64 + u64::from(self.payload_offset);
        let end = start + u64::from(self.payload_length);
        match (usize::try_from(start), usize::try_from(end)) {
            (Ok(s), Ok(e)) if self.payload_length != 0 && e <= file_len => Ok(s..e),
            _ => Err(HeaderError::Payload {
                start,
                length: self.payload_length,
                len: file_len,
            }),
        }
    }

    /// The kernel version string the header points to, up to its NUL (at most 256 bytes), or
    /// `None` when there is none or it is not terminated inside the file.
    pub fn kernel_version_bytes<'a>(&self, image: &'a [u8]) -> Option<&'a [u8]> {
        if self.kernel_version == 0 {
            return None;
        }
        let tail = image.get(usize::from(self.kernel_version) + 0x200..)?;
        let end = tail.iter().take(256).position(|&c| c == 0)?;
        Some(&tail[..end])
    }
}

/// The setup header's bytes as the file has them, from 0x1f1 to its end (0x202 plus the byte at
/// 0x201, the `jmp` over the header): what a boot loader copies into the zero page.
pub fn setup_header_bytes(image: &[u8]) -> &[u8] {
    let end = (offset::HEADER + usize::from(u8_at(image, offset::JUMP_LENGTH))).min(image.len());
    image.get(SETUP_HEADER_OFFSET..end).unwrap_or(&[])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A bzImage header with every field set to a distinct value, `setup_sects` setup sectors,
    /// then a payload of `payload` bytes at +0x10.
    fn image(setup_sects: u8, payload: usize) -> Vec<u8> {
        let sectors = if setup_sects == 0 {
            4
        } else {
            usize::from(setup_sects)
        };
        let mut b = vec![0u8; (sectors + 1) * 512 + 0x10 + payload];
        let mut put = |at: usize, v: &[u8]| b[at..at + v.len()].copy_from_slice(v);
        put(offset::SETUP_SECTS, &[setup_sects]);
        put(offset::BOOT_FLAG, &BOOT_FLAG.to_le_bytes());
        put(0x200, &[0xeb, 0x6a]);
        put(offset::HEADER, b"HdrS");
        put(offset::VERSION, &0x020fu16.to_le_bytes());
        put(offset::KERNEL_VERSION, &0x100u16.to_le_bytes());
        put(0x300, b"6.9.9 (test)\0");
        put(offset::LOADFLAGS, &[LOADED_HIGH | CAN_USE_HEAP]);
        put(offset::CODE32_START, &0x10_0000u32.to_le_bytes());
        put(offset::INITRD_ADDR_MAX, &0x7fff_ffffu32.to_le_bytes());
        put(offset::KERNEL_ALIGNMENT, &0x20_0000u32.to_le_bytes());
        put(offset::RELOCATABLE_KERNEL, &[1, 21]);
        put(offset::XLOADFLAGS, &0x7fu16.to_le_bytes());
        put(offset::CMDLINE_SIZE, &2047u32.to_le_bytes());
        put(offset::PAYLOAD_OFFSET, &0x10u32.to_le_bytes());
        put(offset::PAYLOAD_LENGTH, &(payload as u32).to_le_bytes());
        put(offset::PREF_ADDRESS, &0x100_0000u64.to_le_bytes());
        put(offset::INIT_SIZE, &0x337_8000u32.to_le_bytes());
        put(offset::HANDOVER_OFFSET, &0xd7_2f10u32.to_le_bytes());
        put(offset::KERNEL_INFO_OFFSET, &0xd7_f81cu32.to_le_bytes());
        b
    }

    #[test]
    fn every_field_comes_from_its_offset() {
        let img = image(39, 100);
        let h = SetupHeader::parse(&img).unwrap();
        assert_eq!(
            h,
            SetupHeader {
                setup_sects: 39,
                version: 0x020f,
                kernel_version: 0x100,
                loadflags: LOADED_HIGH | CAN_USE_HEAP,
                code32_start: 0x10_0000,
                initrd_addr_max: 0x7fff_ffff,
                kernel_alignment: 0x20_0000,
                relocatable_kernel: true,
                min_alignment: 21,
                xloadflags: 0x7f,
                cmdline_size: 2047,
                payload_offset: 0x10,
                payload_length: 100,
                pref_address: 0x100_0000,
                init_size: 0x337_8000,
                handover_offset: 0xd7_2f10,
                kernel_info_offset: 0xd7_f81c,
            }
        );
        assert_eq!(h.kernel_offset(), 40 * 512);
        assert!(h.has_64bit_entry());
        assert_eq!(
            h.payload_range(img.len()).unwrap(),
            40 * 512 + 0x10..img.len()
        );
        assert_eq!(h.kernel_version_bytes(&img), Some(&b"6.9.9 (test)"[..]));
        // The header as copied into the zero page: 0x1f1 up to 0x202 + 0x6a.
        let hdr = setup_header_bytes(&img);
        assert_eq!(hdr.len(), 0x26c - 0x1f1);
        assert_eq!(hdr[0], 39);
        assert_eq!(&hdr[offset::HEADER - 0x1f1..][..4], b"HdrS");
    }

    #[test]
    fn zero_setup_sects_means_four() {
        let h = SetupHeader::parse(&image(0, 8)).unwrap();
        assert_eq!(
            (h.setup_sects, h.setup_sectors(), h.kernel_offset()),
            (0, 4, 2560)
        );
    }

    #[test]
    fn each_refusal_names_its_reason() {
        let good = image(4, 64);
        assert!(looks_like_bzimage(&good) && looks_like_bzimage(&good[..0x206]));
        assert!(!looks_like_bzimage(b"not a kernel"));
        assert_eq!(
            SetupHeader::parse(&good[..0x26f]),
            Err(HeaderError::TooShort { len: 0x26f })
        );
        let mut bad = good.clone();
        bad[offset::BOOT_FLAG] = 0;
        assert_eq!(SetupHeader::parse(&bad), Err(HeaderError::BootFlag(0xaa00)));
        assert!(!looks_like_bzimage(&bad));
        let mut bad = good.clone();
        bad[offset::HEADER] = b'X';
        assert!(matches!(
            SetupHeader::parse(&bad),
            Err(HeaderError::Magic(_))
        ));
        assert!(
            SetupHeader::parse(&bad)
                .unwrap_err()
                .to_string()
                .contains("HdrS")
        );
        let mut old = good.clone();
        old[offset::VERSION] = 0x0b;
        assert_eq!(SetupHeader::parse(&old), Err(HeaderError::Protocol(0x020b)));
        assert!(
            HeaderError::Protocol(0x020b)
                .to_string()
                .starts_with("boot protocol 2.11 ")
        );
        let mut past = good.clone();
        past[offset::SETUP_SECTS] = 200;
        assert_eq!(
            SetupHeader::parse(&past),
            Err(HeaderError::KernelPastEnd {
                kernel_offset: 201 * 512,
                len: good.len()
            })
        );
        let h = SetupHeader::parse(&good).unwrap();
        assert!(matches!(
            h.payload_range(good.len() - 1),
            Err(HeaderError::Payload { length: 64, .. })
        ));
        let empty = SetupHeader {
            payload_length: 0,
            ..h
        };
        assert!(empty.payload_range(good.len()).is_err());
    }

    proptest! {
        /// Any bytes: a header or an error, never a panic; a parsed header's derived ranges stay
        /// inside the file.
        #[test]
        fn any_input_parses_or_is_refused(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let _ = looks_like_bzimage(&bytes);
            let copied = setup_header_bytes(&bytes);
            prop_assert!(copied.len() <= 0x202 + 0xff - 0x1f1);
            if let Ok(h) = SetupHeader::parse(&bytes) {
                prop_assert!(h.kernel_offset() < bytes.len());
                if let Ok(r) = h.payload_range(bytes.len()) {
                    prop_assert!(r.start < r.end && r.end <= bytes.len());
                }
                if let Some(v) = h.kernel_version_bytes(&bytes) {
                    prop_assert!(v.len() < 256 && !v.contains(&0));
                }
            }
        }

        /// A valid header with any bytes of its header overwritten, cut anywhere: a header or an
        /// error, never a panic, and a header's ranges stay inside the file.
        #[test]
        fn damaged_headers_parse_or_are_refused(
            patches in proptest::collection::vec((0x1f0usize..0x280, any::<u8>()), 0..64),
            cut in 0usize..4096,
        ) {
            let mut img = image(4, 1024);
            for (at, b) in patches {
                img[at] = b;
            }
            img.truncate(cut.max(0x200));
            if let Ok(h) = SetupHeader::parse(&img) {
                prop_assert!(h.version >= MIN_VERSION && h.kernel_offset() < img.len());
                if let Ok(r) = h.payload_range(img.len()) {
                    prop_assert!(r.start < r.end && r.end <= img.len());
                }
                let _ = h.kernel_version_bytes(&img);
            }
            let _ = setup_header_bytes(&img);
        }

        /// A valid header with any field values patched in: parsing never panics and reads back
        /// exactly what was written.
        #[test]
        fn patched_fields_read_back(pref in any::<u64>(), init in any::<u32>(),
                                    payload_offset in any::<u32>(), payload_length in any::<u32>(),
                                    kernel_version in any::<u16>(), file_len in 0usize..1 << 20) {
            let mut img = image(4, 64);
            img[offset::PREF_ADDRESS..][..8].copy_from_slice(&pref.to_le_bytes());
            img[offset::INIT_SIZE..][..4].copy_from_slice(&init.to_le_bytes());
            img[offset::PAYLOAD_OFFSET..][..4].copy_from_slice(&payload_offset.to_le_bytes());
            img[offset::PAYLOAD_LENGTH..][..4].copy_from_slice(&payload_length.to_le_bytes());
            img[offset::KERNEL_VERSION..][..2].copy_from_slice(&kernel_version.to_le_bytes());
            let h = SetupHeader::parse(&img).unwrap();
            prop_assert_eq!((h.pref_address, h.init_size), (pref, init));
            prop_assert_eq!((h.payload_offset, h.payload_length), (payload_offset, payload_length));
            let _ = h.kernel_version_bytes(&img);
            if let Ok(r) = h.payload_range(file_len) {
                prop_assert_eq!(r.len(), payload_length as usize);
                prop_assert!(r.end <= file_len);
            }
        }
    }
}
