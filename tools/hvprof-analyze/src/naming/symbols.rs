//! Function symbols of an ELF image (the hypervisor, a guest), for turning sampled addresses into
//! names: `object` reads the symbol table, `rustc-demangle` the Rust names.

use std::path::Path;

use anyhow::{Context, Result};
use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol, SymbolKind};

/// What names the capture's addresses: the one place symbol files are read.
#[derive(Default)]
pub struct Images {
    pub hypervisor: Option<Symbols>,
    pub guests: Vec<Symbols>,
    /// The kernel of the Linux guests (`--kernel`): their kernel functions, by VM after the
    /// KASLR slide each VM's `IA32_LSTAR` line gives.
    pub kernel: Option<linux_guest::KernelImage>,
    /// `--guest-root DIR`: the guests' root file system (or extracted packages), where the files
    /// their processes map are found by the paths the mapping frames give.
    pub guest_root: Option<std::path::PathBuf>,
}

impl Images {
    /// Reads the symbol files: the hypervisor's ELF, guest images, the Linux guests' kernel
    /// (vmlinux or bzImage). A hypervisor or guest file that cannot be used is a warning (printed
    /// on stderr; its addresses stay hex); a kernel that cannot be read is an error.
    /// With `guest_root`, a guest image's functions may come from its separate debug file
    /// there ([`Symbols::with_debug_file`]).
    pub fn load(
        hypervisor: Option<&Path>,
        guests: &[std::path::PathBuf],
        kernel: Option<&Path>,
        guest_root: Option<&Path>,
    ) -> Result<Images> {
        let mut imgs = Images {
            guest_root: guest_root.map(Path::to_path_buf),
            ..Images::default()
        };
        if let Some(k) = kernel {
            let image = if linux_guest::BzImage::parse(
                &std::fs::read(k).with_context(|| format!("cannot read {}", k.display()))?,
            )
            .is_ok()
            {
                linux_guest::KernelImage::from_bzimage(k)
            } else {
                linux_guest::KernelImage::from_vmlinux(k)
            };
            imgs.kernel = Some(image.with_context(|| {
                format!(
                    "{}: not a Linux kernel image hvprof-analyze can read",
                    k.display()
                )
            })?);
        }
        if let Some(h) = hypervisor {
            match Symbols::load(h) {
                Ok(s) => imgs.hypervisor = Some(s),
                Err(e) => {
                    eprintln!("hvprof-analyze: warning: {e:#}; hypervisor addresses stay hex")
                }
            }
        }
        for i in guests {
            let loaded = Symbols::load(i).map(|s| match guest_root {
                Some(root) => s.with_debug_file(root),
                None => s,
            });
            match loaded {
                Ok(s) if s.is_empty() => eprintln!(
                    "hvprof-analyze: warning: {} has no function symbols (stripped?)",
                    i.display()
                ),
                Ok(s) => imgs.guests.push(s),
                Err(e) => eprintln!("hvprof-analyze: warning: {e:#}"),
            }
        }
        Ok(imgs)
    }
}

/// One image's functions, sorted by address.
#[derive(Debug, Clone, Default)]
pub struct Symbols {
    /// The file name (the "module" column).
    pub module: String,
    pub build_id: Option<Vec<u8>>,
    /// (start, size, demangled name), sorted by start.
    functions: Vec<(u64, u64, String)>,
    /// A position-independent file (ELF `ET_DYN`: a PIE program or a shared library): loaded at
    /// an address chosen at run time, so a sample's address is translated through its mapping.
    pub relocatable: bool,
    /// The file's `PT_LOAD` segments: (file offset, file size, virtual address).
    segments: Vec<(u64, u64, u64)>,
}

impl Symbols {
    /// Reads `path`'s function symbols and build id.
    pub fn load(path: &Path) -> Result<Symbols> {
        let data =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        Self::parse(&data, path)
    }

    pub fn parse(data: &[u8], path: &Path) -> Result<Symbols> {
        let file = object::File::parse(data)
            .with_context(|| format!("{} is not an object file", path.display()))?;
        // `.symtab` first, then the dynamic symbol table: a stripped file (Debian's libc.so.6,
        // libgomp.so.1) keeps only the latter, and its exported functions are still named. Both
        // tables list most exported functions: one entry per address is kept, the larger, else
        // the `.symtab` one (the sort is stable).
        let mut functions: Vec<(u64, u64, String)> = file
            .symbols()
            .chain(file.dynamic_symbols())
            // Not `is_definition`, which leaves out GNU indirect functions (libc's `memcpy`).
            .filter(|s| s.kind() == SymbolKind::Text && !s.is_undefined() && s.address() != 0)
            .filter_map(|s| {
                let name = s.name().ok()?;
                if name.is_empty() {
                    return None;
                }
                Some((s.address(), s.size(), demangle(name)))
            })
            .collect();
        functions.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        functions.dedup_by_key(|f| f.0);
        let module = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        add_unnamed_functions(
            &mut functions,
            &crate::naming::eh_frame::function_ranges(&file),
            &module,
        );
        let build_id = file
            .build_id()
            .ok()
            .flatten()
            .map(<[u8]>::to_vec)
            .or_else(|| {
                // Some linkers put the note where `build_id` does not look: read the section.
                file.section_by_name(".note.gnu.build-id")
                    .and_then(|s| s.data().ok())
                    .and_then(note_desc)
            });
        let relocatable = file.kind() == object::ObjectKind::Dynamic;
        let segments = file
            .segments()
            .map(|s| (s.file_range().0, s.file_range().1, s.address()))
            .collect();
        Ok(Symbols {
            module,
            build_id,
            functions,
            relocatable,
            segments,
        })
    }

    /// A kernel module's functions (`crate::naming::modules::parse_module`): (offset in the module's
    /// core, size, whether the symbol had no size, name). At one offset a sized function is
    /// kept over an unsized label, else the first in the file's order.
    pub(crate) fn from_module_functions(
        path: &Path,
        build_id: Option<&[u8]>,
        functions: Vec<(u64, u64, bool, &str)>,
    ) -> Symbols {
        let mut functions: Vec<(u64, u64, bool, String)> = functions
            .into_iter()
            .map(|(at, size, no_size, name)| (at, size, no_size, demangle(name)))
            .collect();
        functions.sort_by(|a, b| a.0.cmp(&b.0).then(a.2.cmp(&b.2)).then(b.1.cmp(&a.1)));
        functions.dedup_by_key(|f| f.0);
        Symbols {
            module: path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            ),
            build_id: build_id.map(<[u8]>::to_vec),
            functions: functions
                .into_iter()
                .map(|(at, size, _, name)| (at, size, name))
                .collect(),
            relocatable: false,
            segments: Vec::new(),
        }
    }

    /// Every function: (start, size, name), by start.
    pub fn functions(&self) -> impl Iterator<Item = (u64, u64, &str)> {
        self.functions
            .iter()
            .map(|(start, size, name)| (*start, *size, name.as_str()))
    }

    /// The same file with the function symbols of its separate debug file, when `root` has one
    /// for its build id (`<root>/usr/lib/debug/.build-id/ab/cdef....debug`, the GNU layout
    /// Debian's -dbg and -dbgsym packages install) with more functions than the file itself. A
    /// debug file has the stripped file's addresses but not its contents (its sections are
    /// empty, its segments' file ranges are not the file's): only its symbols are taken, the
    /// segments stay the real file's. One with another build id, or that cannot be read, is
    /// ignored.
    pub fn with_debug_file(mut self, root: &Path) -> Symbols {
        let Some(path) = self
            .build_id
            .as_deref()
            .and_then(|id| debug_file_path(root, id))
        else {
            return self;
        };
        let Ok(data) = std::fs::read(&path) else {
            return self;
        };
        // Compared by named functions: the ones `.eh_frame` adds without a name do not count.
        let named =
            |f: &[(u64, u64, String)]| f.iter().filter(|(_, _, n)| !n.starts_with(UNNAMED)).count();
        if let Ok(debug) = Symbols::parse(&data, &path)
            && debug.build_id == self.build_id
            && named(&debug.functions) > named(&self.functions)
        {
            let unnamed: Vec<(u64, u64)> = self
                .functions
                .iter()
                .filter(|(_, _, n)| n.starts_with(UNNAMED))
                .map(|&(start, size, _)| (start, start.saturating_add(size)))
                .collect();
            self.functions = debug.functions;
            add_unnamed_functions(&mut self.functions, &unnamed, &self.module);
        }
        self
    }

    /// The function at run-time address `addr` in a mapping of this file that starts at `start`
    /// with file page offset `pgoff` (as the guest's VMA says): a fixed-address program's
    /// addresses are its own; a relocatable file's are moved to the segment holding that file
    /// offset.
    pub fn lookup_mapped(&self, addr: u64, start: u64, pgoff: u64) -> Option<&str> {
        self.lookup_mapped_offset(addr, start, pgoff)
            .map(|(name, _)| name)
    }

    /// [`Symbols::lookup_mapped`] with `addr`'s offset from the function's start.
    pub fn lookup_mapped_offset(&self, addr: u64, start: u64, pgoff: u64) -> Option<(&str, u64)> {
        if !self.relocatable {
            return self.lookup_offset(addr);
        }
        let offset = addr
            .checked_sub(start)?
            .checked_add(pgoff.checked_mul(4096)?)?;
        let &(file_off, _, vaddr) = self
            .segments
            .iter()
            .find(|(o, n, _)| (*o..o.saturating_add(*n)).contains(&offset))?;
        self.lookup_offset(vaddr.checked_add(offset - file_off)?)
    }

    /// The function holding `addr`: the last symbol starting at or before it, if `addr` lies
    /// within its size (or, for symbols without a size, before the next symbol).
    pub fn lookup(&self, addr: u64) -> Option<&str> {
        self.lookup_offset(addr).map(|(name, _)| name)
    }

    /// [`Symbols::lookup`] with `addr`'s offset from the function's start (`perf script`'s
    /// `function+0x12`).
    pub fn lookup_offset(&self, addr: u64) -> Option<(&str, u64)> {
        let i = self.functions.partition_point(|f| f.0 <= addr);
        let (start, size, name) = self.functions.get(i.checked_sub(1)?)?;
        let inside = if *size > 0 {
            addr < start + size
        } else {
            self.functions.get(i).is_none_or(|next| addr < next.0)
        };
        inside.then_some((name.as_str(), addr - start))
    }

    pub fn is_empty(&self) -> bool {
        self.functions.is_empty()
    }
}

/// Where the GNU layout puts the separate debug file of build id `id` under `root`: the first
/// byte is a directory, the rest the file name.
pub fn debug_file_path(root: &Path, id: &[u8]) -> Option<std::path::PathBuf> {
    let (first, rest) = id.split_first()?;
    if rest.is_empty() {
        return None;
    }
    Some(
        root.join("usr/lib/debug/.build-id")
            .join(format!("{first:02x}"))
            .join(format!("{}.debug", hex(rest))),
    )
}

/// How a function without a symbol is named (then its file and its start).
const UNNAMED: &str = "[unknown] ";

/// Adds the functions the unwinding tables describe (`ranges`, from `.eh_frame`) that no symbol
/// names, as `[unknown] <module>+0x<start>`: a stripped file's local functions (libquantum's
/// OpenMP bodies) are then counted per function, under the address `addr2line` and callgrind
/// give them, instead of per instruction. `functions` stays sorted by start.
fn add_unnamed_functions(
    functions: &mut Vec<(u64, u64, String)>,
    ranges: &[(u64, u64)],
    module: &str,
) {
    let named = |at: u64, functions: &[(u64, u64, String)]| {
        let i = functions.partition_point(|f| f.0 <= at);
        i.checked_sub(1)
            .and_then(|i| functions.get(i))
            .is_some_and(|(start, size, _)| *start == at || at < start.saturating_add(*size))
    };
    let extra: Vec<(u64, u64, String)> = ranges
        .iter()
        .filter(|&&(start, _)| !named(start, functions))
        .map(|&(start, end)| (start, end - start, format!("{UNNAMED}{module}+{start:#x}")))
        .collect();
    if !extra.is_empty() {
        functions.extend(extra);
        functions.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        functions.dedup_by_key(|f| f.0);
    }
}

/// Demangles a Rust (or C++-less) symbol, dropping the hash suffix.
pub fn demangle(name: &str) -> String {
    // A guest image's symbol names are the guest author's: no control characters in outputs.
    crate::naming::escape::printable(&format!("{:#}", rustc_demangle::demangle(name))).into_owned()
}

/// The descriptor of a GNU build-id note (`namesz`, `descsz`, `type`, "GNU\0", desc).
fn note_desc(note: &[u8]) -> Option<Vec<u8>> {
    let word = |i: usize| {
        note.get(i..i + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    let (namesz, descsz) = (word(0)?, word(4)?);
    let desc = 12 + namesz.div_ceil(4) * 4;
    note.get(desc..desc + descsz).map(<[u8]>::to_vec)
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use object::write::{Object as WObject, StandardSection, Symbol, SymbolSection};
    use object::{Architecture, BinaryFormat, Endianness, SymbolFlags, SymbolScope};

    /// An ELF object with three functions at known addresses (0x1000 size 0x10, 0x1010 size
    /// 0x30, 0x2000 size 0 followed by nothing) and a build-id note.
    pub(crate) fn test_elf() -> Vec<u8> {
        let mut obj = WObject::new(BinaryFormat::Elf, Architecture::X86_64, Endianness::Little);
        let text = obj.section_id(StandardSection::Text);
        obj.append_section_data(text, &[0x90; 0x2000], 16);
        for (name, value, size) in [
            ("work_a", 0x1000u64, 0x10u64),
            ("_ZN5guest4work17h0123456789abcdefE", 0x1010, 0x30),
            ("tail", 0x1f00, 0),
        ] {
            obj.add_symbol(Symbol {
                name: name.as_bytes().to_vec(),
                value,
                size,
                kind: SymbolKind::Text,
                scope: SymbolScope::Linkage,
                weak: false,
                section: SymbolSection::Section(text),
                flags: SymbolFlags::None,
            });
        }
        let note = obj.add_section(
            Vec::new(),
            b".note.gnu.build-id".to_vec(),
            object::SectionKind::Note,
        );
        let mut n = Vec::new();
        n.extend_from_slice(&4u32.to_le_bytes());
        n.extend_from_slice(&4u32.to_le_bytes());
        n.extend_from_slice(&3u32.to_le_bytes());
        n.extend_from_slice(b"GNU\0");
        n.extend_from_slice(&[0xde, 0xad, 0xbe, 0xef]);
        obj.append_section_data(note, &n, 4);
        obj.write().unwrap()
    }

    #[test]
    fn lookup_and_demangle() {
        let s = Symbols::parse(&test_elf(), Path::new("guest.elf")).unwrap();
        assert_eq!(s.module, "guest.elf");
        assert_eq!(s.lookup(0x1000), Some("work_a"));
        assert_eq!(s.lookup(0x100f), Some("work_a"));
        assert_eq!(s.lookup(0x1010), Some("guest::work"));
        assert_eq!(s.lookup(0x103f), Some("guest::work"));
        assert_eq!(s.lookup(0x1040), None, "past the sized symbol");
        assert_eq!(s.lookup(0x0fff), None);
        assert_eq!(
            s.lookup(0x5000),
            Some("tail"),
            "unsized: up to the next symbol"
        );
        assert_eq!(s.build_id.as_deref(), Some(&[0xde, 0xad, 0xbe, 0xef][..]));
    }

    /// A fresh scratch directory for one test (removed by the caller).
    pub(crate) fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("hvprof-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Runs a host tool (gcc, strip, objcopy); `None`, with the reason printed, when it is
    /// missing, so that the test is skipped rather than failed on a machine without it.
    pub(crate) fn run(tool: &str, args: &[&std::ffi::OsStr]) -> Option<()> {
        match std::process::Command::new(tool).args(args).output() {
            Ok(o) if o.status.success() => Some(()),
            Ok(o) => panic!("{tool} failed: {}", String::from_utf8_lossy(&o.stderr)),
            Err(e) => {
                eprintln!("skipped: cannot run {tool} ({e})");
                None
            }
        }
    }

    /// The address of `name` in an ELF file's symbol tables, and the file offset it lies at.
    pub(crate) fn address_of(data: &[u8], name: &str) -> (u64, u64) {
        let file = object::File::parse(data).unwrap();
        let sym = file
            .symbols()
            .chain(file.dynamic_symbols())
            .find(|s| s.name() == Ok(name))
            .unwrap_or_else(|| panic!("no symbol {name}"));
        let addr = sym.address();
        let seg = file
            .segments()
            .find(|s| (s.address()..s.address() + s.size()).contains(&addr))
            .unwrap();
        (addr, addr - seg.address() + seg.file_range().0)
    }

    /// C source of a small library: an exported function calling a file-local one.
    pub(crate) const LIB_C: &str = "__attribute__((noinline)) static int helper(int x) { return x * 7 + 3; }\n\
        int hvprof_exported(int x) { return helper(x) + helper(x + 1); }\n\
        int hvprof_other(int x) { return x - 1; }\n";

    #[test]
    fn a_stripped_library_still_names_its_exported_functions() {
        let dir = scratch("stripped");
        std::fs::write(dir.join("lib.c"), LIB_C).unwrap();
        let so = dir.join("libt.so");
        let built = run(
            "gcc",
            &[
                "-shared".as_ref(),
                "-fPIC".as_ref(),
                "-O1".as_ref(),
                "-o".as_ref(),
                so.as_os_str(),
                dir.join("lib.c").as_os_str(),
            ],
        );
        if built.is_none() {
            return;
        }
        let full = std::fs::read(&so).unwrap();
        let (_, exported_off) = address_of(&full, "hvprof_exported");
        let (_, helper_off) = address_of(&full, "helper");
        if run("strip", &["--strip-all".as_ref(), so.as_os_str()]).is_none() {
            return;
        }
        let data = std::fs::read(&so).unwrap();
        let stripped = object::File::parse(&*data).unwrap();
        assert!(
            stripped.section_by_name(".symtab").is_none(),
            "strip left a .symtab: the test would not test the dynamic table"
        );
        let s = Symbols::parse(&data, &so).unwrap();
        assert!(s.relocatable);
        // The library's text mapped at 0x7f12_3450_0000 + its file offset's page (pgoff), the
        // way the guest's VMA says it.
        let base = 0x7f12_3450_0000u64;
        let at = |off: u64| {
            let pgoff = off / 4096;
            (base + off, base + pgoff * 4096, pgoff)
        };
        let (rip, start, pgoff) = at(exported_off);
        assert_eq!(s.lookup_mapped(rip, start, pgoff), Some("hvprof_exported"));
        assert_eq!(
            s.lookup_mapped(rip + 1, start, pgoff),
            Some("hvprof_exported")
        );
        // The file-local helper is in no symbol table now: never named as its neighbour, but
        // counted as its own function, from the unwinding tables.
        let (rip, start, pgoff) = at(helper_off);
        let got = s.lookup_mapped(rip, start, pgoff);
        assert!(
            got.is_some_and(|n| n.starts_with("[unknown] ") && n.contains(".so+0x")),
            "{got:?}"
        );
        assert_eq!(s.lookup_mapped(rip + 1, start, pgoff), got);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A PIE program with a build id, built by gcc from C source `src` as `dir/name`.
    fn build_program(dir: &Path, name: &str, src: &str) -> Option<std::path::PathBuf> {
        let c = dir.join(format!("{name}.c"));
        std::fs::write(&c, src).unwrap();
        let out = dir.join(name);
        let args: [&std::ffi::OsStr; 7] = [
            "-O0".as_ref(),
            "-fPIE".as_ref(),
            "-pie".as_ref(),
            "-Wl,--build-id".as_ref(),
            "-o".as_ref(),
            out.as_os_str(),
            c.as_os_str(),
        ];
        run("gcc", &args)?;
        Some(out)
    }

    const PROGRAM_C: &str = "__attribute__((noinline)) static int hidden_work(int x) { return x * 7 + 3; }\n\
        int main(int argc, char **argv) { (void)argv; return hidden_work(argc); }\n";

    #[test]
    fn a_stripped_program_takes_its_functions_from_its_debug_file() {
        let dir = scratch("debugfile");
        let Some(prog) = build_program(&dir, "prog", PROGRAM_C) else {
            return;
        };
        // A second program, another build id: its debug file must not name the first.
        let Some(other) = build_program(&dir, "other", "int main(void) { return 1; }\n") else {
            return;
        };
        let full = std::fs::read(&prog).unwrap();
        let (_, work_off) = address_of(&full, "hidden_work");
        let id = Symbols::parse(&full, &prog).unwrap().build_id.unwrap();
        let root = dir.join("root");
        std::fs::create_dir_all(root.join("bin")).unwrap();
        let debug = debug_file_path(&root, &id).unwrap();
        std::fs::create_dir_all(debug.parent().unwrap()).unwrap();
        let keep_debug = |from: &Path| {
            run(
                "objcopy",
                &[
                    "--only-keep-debug".as_ref(),
                    from.as_os_str(),
                    debug.as_os_str(),
                ],
            )
        };
        if keep_debug(&prog).is_none() {
            return;
        }
        let stripped = root.join("bin/prog");
        std::fs::copy(&prog, &stripped).unwrap();
        if run("strip", &["--strip-all".as_ref(), stripped.as_os_str()]).is_none() {
            return;
        }
        // Mapped the way the guest's VMA says: text page `pgoff` at `start`.
        let pgoff = work_off / 4096;
        let start = 0x5555_5555_0000 + pgoff * 4096;
        let rip = start + work_off % 4096;
        let alone = Symbols::load(&stripped).unwrap();
        let got = alone.lookup_mapped(rip, start, pgoff);
        assert!(
            got.is_some_and(|n| n.starts_with("[unknown] prog+0x")),
            "stripped: {got:?}"
        );

        // Through `--image` with `--guest-root`: named from the debug file.
        let images =
            Images::load(None, std::slice::from_ref(&stripped), None, Some(&root)).unwrap();
        assert_eq!(images.guests.len(), 1);
        let named = &images.guests[0];
        assert_eq!(named.module, "prog");
        assert!(named.relocatable);
        assert_eq!(named.lookup_mapped(rip, start, pgoff), Some("hidden_work"));
        assert_eq!(
            named.lookup_mapped(rip + 2, start, pgoff),
            Some("hidden_work")
        );
        // The same through the file found under the root (the mapping frames' way): the
        // stripped file, with whatever debug file is at its build-id path now.
        let with_debug = || {
            Symbols::load(&stripped)
                .unwrap()
                .with_debug_file(&root)
                .lookup_mapped(rip, start, pgoff)
                .map(str::to_owned)
        };
        let got = got.map(str::to_owned);
        assert_eq!(with_debug().as_deref(), Some("hidden_work"));

        // Another build's debug file at that path: ignored.
        if keep_debug(&other).is_none() {
            return;
        }
        assert_eq!(with_debug(), got, "another build's");
        // Not an ELF file, an empty one, a directory: ignored, no panic.
        std::fs::write(&debug, b"not an elf").unwrap();
        assert_eq!(with_debug(), got);
        std::fs::write(&debug, b"").unwrap();
        assert_eq!(with_debug(), got);
        std::fs::remove_file(&debug).unwrap();
        std::fs::create_dir(&debug).unwrap();
        assert_eq!(with_debug(), got);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn the_hosts_stripped_libc_names_its_exported_functions() {
        // Debian's libc.so.6 has no .symtab: its functions come from the dynamic table.
        let path = Path::new("/lib/x86_64-linux-gnu/libc.so.6");
        let Ok(data) = std::fs::read(path) else {
            eprintln!("skipped: no {}", path.display());
            return;
        };
        let file = object::File::parse(&*data).unwrap();
        if file.section_by_name(".symtab").is_some() {
            eprintln!("skipped: {} is not stripped", path.display());
            return;
        }
        let s = Symbols::parse(&data, path).unwrap();
        let sym = file
            .dynamic_symbols()
            .find(|s| s.name() == Ok("getpid") && s.kind() == SymbolKind::Text)
            .unwrap();
        // One of the names at that address (libc exports `getpid` and `__getpid` there).
        let aliases = |addr: u64| -> Vec<&str> {
            file.dynamic_symbols()
                .filter(|s| s.address() == addr)
                .filter_map(|s| s.name().ok())
                .collect()
        };
        let named = s.lookup(sym.address()).unwrap();
        assert!(named.ends_with("getpid"), "{named}");
        assert!(aliases(sym.address()).contains(&named));
        // An indirect function (its resolver, run at load time) is named too.
        let ifunc = file
            .dynamic_symbols()
            .find(|s| s.name() == Ok("memcpy"))
            .unwrap();
        let named = s.lookup(ifunc.address()).unwrap();
        assert!(aliases(ifunc.address()).contains(&named), "{named}");
    }

    #[test]
    fn debug_files_are_found_by_build_id() {
        let root = Path::new("/r");
        assert_eq!(
            debug_file_path(root, &[0xab, 0xcd, 0x01]),
            Some(std::path::PathBuf::from(
                "/r/usr/lib/debug/.build-id/ab/cd01.debug"
            ))
        );
        assert_eq!(debug_file_path(root, &[0xab]), None);
        assert_eq!(debug_file_path(root, &[]), None);
    }

    #[test]
    fn not_an_elf() {
        assert!(Symbols::parse(b"not an elf", Path::new("x")).is_err());
    }
}
