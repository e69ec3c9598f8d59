//! Host side of Linux guests for hvprof.
//!
//! - [`bzimage`]: the bzImage setup header a boot loader reads, and the vmlinux ELF inside its
//!   compressed payload (LZ4 legacy, XZ, gzip).
//! - [`kallsyms`]: the kernel's complete symbol table, rebuilt from a stripped vmlinux (Debian
//!   ships no symbols outside the 858 MB `-dbg` package; the tables `/proc/kallsyms` prints from
//!   are inside the image).
//! - [`btf`] and [`TaskOffsets`]: where the running task's pid, tgid, comm, mm and page-table root
//!   are, derived from the kernel's own `.BTF` section, for the hypervisor to name processes.
//! - [`KernelImage`]: all of that for one kernel, plus the KASLR slide from a guest's `IA32_LSTAR`.
//! - [`initramfs`]: a gzip-compressed newc cpio archive writer.
//! - [`unwind`]: a user program's unwind table (from its `.eh_frame`), for call chains through
//!   code built without frame pointers.

pub mod btf;
pub mod bzimage;
pub mod initramfs;
pub mod kallsyms;
pub mod layouts;
mod offsets;
pub mod unwind;

use std::path::Path;

use object::{Object, ObjectSection};

pub use bzimage::{BzImage, SetupHeader};
pub use kallsyms::{Hit, Kallsyms, Symbol};
pub use offsets::TaskOffsets;

/// Everything that can be wrong with the input, naming what.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("bzImage: {0}")]
    BzImage(String),
    #[error("vmlinux: {0}")]
    Elf(String),
    #[error("kallsyms: {0}")]
    Kallsyms(String),
    #[error("BTF: {0}")]
    Btf(String),
    #[error("task offsets: {0}")]
    Offsets(String),
    #[error("KASLR: {0}")]
    Kaslr(String),
    #[error("initramfs: {0}")]
    Initramfs(String),
    #[error("unwind table: {0}")]
    Unwind(String),
}

/// The kernel is linked at a multiple of CONFIG_PHYSICAL_ALIGN and KASLR moves it by multiples
/// of it (2 MiB on x86-64 distribution kernels).
pub const KASLR_ALIGN: u64 = 0x20_0000;

/// What the profiler needs to know about one guest kernel, from its decompressed vmlinux.
#[derive(Clone, Debug)]
pub struct KernelImage {
    pub symbols: Kallsyms,
    pub offsets: TaskOffsets,
    /// The `linux_banner` ("Linux version 6.1.0-56-cloud-amd64 ..."), when found.
    pub banner: Option<String>,
    /// The GNU build ID, hex.
    pub build_id: Option<String>,
    /// Where a process's memory map and the module list are, for the hypervisor's walkers (an
    /// error on kernels whose structures the walkers do not read, e.g. before 6.1).
    pub mm_layout: Result<hvprof_linux_walk::MmLayout, String>,
    /// See `mm_layout`.
    pub module_layout: Result<hvprof_linux_walk::ModuleLayout, String>,
    /// Where the kernel's ORC unwind tables are, for the hypervisor's kernel call chains (an
    /// error on kernels built without `CONFIG_UNWINDER_ORC`).
    pub orc_layout: Result<hvprof_linux_walk::OrcLayout, String>,
}

impl KernelImage {
    /// Reads a decompressed vmlinux ELF file.
    pub fn from_vmlinux(path: impl AsRef<Path>) -> Result<Self, Error> {
        let data = read(path.as_ref())?;
        Self::from_vmlinux_bytes(&data)
    }

    /// Reads a bzImage and decompresses its vmlinux first.
    pub fn from_bzimage(path: impl AsRef<Path>) -> Result<Self, Error> {
        let data = read(path.as_ref())?;
        Self::from_vmlinux_bytes(&BzImage::parse(&data)?.vmlinux()?)
    }

    pub fn from_vmlinux_bytes(data: &[u8]) -> Result<Self, Error> {
        let elf =
            object::File::parse(data).map_err(|e| Error::Elf(format!("not an ELF file: {e}")))?;
        fn section_data<'d>(s: &object::Section<'d, '_>) -> Result<&'d [u8], Error> {
            s.data()
                .map_err(|e| Error::Elf(format!("section {}: {e}", s.name().unwrap_or("?"))))
        }
        // The tables are in .rodata; look in the other loaded sections if not.
        let mut sections: Vec<_> = elf
            .sections()
            .filter(|s| s.kind() == object::SectionKind::ReadOnlyData || s.name() == Ok(".rodata"))
            .collect();
        sections.sort_by_key(|s| s.name() != Ok(".rodata"));
        let mut symbols = Err(Error::Kallsyms(
            "vmlinux has no read-only data section".into(),
        ));
        for s in &sections {
            symbols = Kallsyms::find(section_data(s)?, s.address());
            if symbols.is_ok() {
                break;
            }
        }
        let symbols = symbols?;
        let btf_section = elf.section_by_name(".BTF").ok_or_else(|| {
            Error::Btf("vmlinux has no .BTF section (CONFIG_DEBUG_INFO_BTF is off?)".into())
        })?;
        let btf = btf::Btf::parse(section_data(&btf_section)?)?;
        let offsets = TaskOffsets::derive(&btf, &symbols)?;
        let mm_layout = layouts::mm_layout(&btf).map_err(|e| e.to_string());
        let module_layout = layouts::module_layout(&btf, &symbols).map_err(|e| e.to_string());
        let orc_layout = layouts::orc_layout(&elf, &symbols).map_err(|e| e.to_string());
        let banner = elf
            .section_by_name(".rodata")
            .and_then(|s| s.data().ok())
            .and_then(find_banner);
        let build_id = elf
            .build_id()
            .ok()
            .flatten()
            .map(|id| id.iter().map(|b| format!("{b:02x}")).collect());
        Ok(Self {
            symbols,
            offsets,
            banner,
            build_id,
            mm_layout,
            module_layout,
            orc_layout,
        })
    }

    /// The link-time address of `entry_SYSCALL_64`, where IA32_LSTAR points once the kernel runs.
    pub fn entry_syscall_64(&self) -> Result<u64, Error> {
        self.symbols
            .by_name("entry_SYSCALL_64")
            .map(|s| s.address)
            .ok_or_else(|| Error::Kallsyms("no entry_SYSCALL_64 symbol".into()))
    }

    /// The KASLR slide (runtime − link-time address of kernel text) from the guest's IA32_LSTAR
    /// as the running kernel set it. 0 when booted with `nokaslr`.
    pub fn kaslr_slide(&self, lstar: u64) -> Result<u64, Error> {
        let entry = self.entry_syscall_64()?;
        let slide = lstar.wrapping_sub(entry);
        if lstar < entry || slide % KASLR_ALIGN != 0 || slide >= 1 << 31 {
            return Err(Error::Kaslr(format!(
                "IA32_LSTAR {lstar:#x} is not entry_SYSCALL_64 ({entry:#x}) plus a 2 MiB-aligned slide below 2 GiB: another kernel, or LSTAR not set yet"
            )));
        }
        Ok(slide)
    }

    /// The kernel symbol at a runtime address, given the slide.
    pub fn lookup(&self, runtime_address: u64, slide: u64) -> Option<Hit<'_>> {
        self.symbols.lookup(runtime_address.wrapping_sub(slide))
    }

    /// The kernel release ("6.1.0-56-cloud-amd64") from the banner.
    pub fn release(&self) -> Option<&str> {
        self.banner
            .as_deref()?
            .strip_prefix("Linux version ")?
            .split(' ')
            .next()
    }

    /// The boot-module keys that tell the hypervisor where this kernel keeps what it reads
    /// (`hypervisor/src/vm_config.rs`). The Linux test scenarios and `cargo xtask run --config`
    /// (a VM's `vmlinux`) both take them from here.
    pub fn module_keys(&self) -> ModuleKeys {
        fn key<T: std::fmt::Display>(
            name: &str,
            layout: &Result<T, String>,
        ) -> Result<String, String> {
            layout
                .as_ref()
                .map(|l| format!("{name}={l}"))
                .map_err(Clone::clone)
        }
        let o = &self.offsets;
        ModuleKeys {
            task_offsets: format!(
                "task-offsets={:#x}:{}:{}:{}",
                o.current_task, o.pid, o.tgid, o.comm
            ),
            mm_layout: key("mm-layout", &self.mm_layout),
            module_layout: key("module-layout", &self.module_layout),
            orc_layout: key("orc-layout", &self.orc_layout),
        }
    }
}

/// A kernel's keys for its boot module's command line, each a `key=value` word: `task-offsets=`
/// (the running task, so samples name processes), and where the kernel's structures allow it
/// `mm-layout=` (a process's memory map: the files it runs), `module-layout=` (the module list:
/// kernel modules) and `orc-layout=` (the ORC tables: kernel call chains, `stacks=`), each
/// else the reason it is unavailable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleKeys {
    pub task_offsets: String,
    pub mm_layout: Result<String, String>,
    pub module_layout: Result<String, String>,
    pub orc_layout: Result<String, String>,
}

impl ModuleKeys {
    /// The available keys, in the order above.
    pub fn words(&self) -> Vec<&str> {
        let mut words = vec![self.task_offsets.as_str()];
        words.extend(
            [&self.mm_layout, &self.module_layout, &self.orc_layout]
                .into_iter()
                .filter_map(|k| k.as_deref().ok()),
        );
        words
    }

    /// The keys left out, with why: `("orc-layout", "no .orc_unwind section ...")`.
    pub fn unavailable(&self) -> Vec<(&'static str, &str)> {
        [
            ("mm-layout", &self.mm_layout),
            ("module-layout", &self.module_layout),
            ("orc-layout", &self.orc_layout),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.as_ref().err().map(|e| (k, e.as_str())))
        .collect()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })
}

fn find_banner(rodata: &[u8]) -> Option<String> {
    let needle = b"Linux version ";
    let at = rodata.windows(needle.len()).position(|w| w == needle)?;
    let tail = &rodata[at..];
    let end = tail.iter().take(512).position(|&c| c == b'\n' || c == 0)?;
    Some(String::from_utf8_lossy(&tail[..end]).into_owned())
}
