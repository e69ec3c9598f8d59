//! Linux kernel modules' functions from their `.ko` files under `--guest-root`.
//!
//! A loaded module's code is not in the kernel's kallsyms (`--kernel`): the module mapping
//! frames give where its core is (`core_layout.base`, its size) and its name, and its `.ko` (an
//! ELF relocatable object, `ET_REL`) gives its functions, each at an offset in its section. The
//! kernel lays the sections out in the core itself (`layout_sections`, kernel/module/main.c):
//! [`core_text_layout`] does the same for the executable part, so a function's run-time address
//! is the core's base + its section's offset there + its symbol value.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use object::{Object, ObjectSection, ObjectSymbol, SectionFlags, SymbolKind};
use rustc_hash::FxHashMap as HashMap;

use crate::naming::symbols::Symbols;

const SHF_ALLOC: u64 = object::elf::SHF_ALLOC.0;
const SHF_EXECINSTR: u64 = object::elf::SHF_EXECINSTR.0;

/// One section header as `layout_sections` reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SectionHeader {
    pub name: String,
    /// `sh_flags`.
    pub flags: u64,
    /// `sh_addralign` (0 and 1: no alignment).
    pub align: u64,
    /// `sh_size`.
    pub size: u64,
}

/// Linux 6.1's `layout_sections` for the executable part of a module's core: for each section
/// (in section-header order), its offset from the core's base, or `None` when it is not in the
/// core's text; and the text's size. The sections taken are those with `SHF_EXECINSTR |
/// SHF_ALLOC` whose name does not start with `.init` (those go to the init layout, freed after
/// loading; with CONFIG_MODULE_UNLOAD=y, Debian's, `.exit.text` stays in the core). Each is put
/// at `ALIGN(size, sh_addralign ?: 1)` and the size grows to its end (`module_get_offset`;
/// x86's `arch_mod_section_prepend` is 0). This is 6.1's `core_layout`, before 6.4 reworked
/// the layouts into `mod->mem[]`. `None` when an alignment is not a power of two or the sizes
/// overflow (not a module the kernel would have loaded).
pub fn core_text_layout(sections: &[SectionHeader]) -> Option<(Vec<Option<u64>>, u64)> {
    let mut size = 0u64;
    let mut offsets = Vec::with_capacity(sections.len());
    for s in sections {
        let in_text = s.flags & (SHF_EXECINSTR | SHF_ALLOC) == SHF_EXECINSTR | SHF_ALLOC
            && !s.name.starts_with(".init");
        if !in_text {
            offsets.push(None);
            continue;
        }
        let align = s.align.max(1);
        if !align.is_power_of_two() {
            return None;
        }
        let offset = size.checked_add(align - 1)? & !(align - 1);
        size = offset.checked_add(s.size)?;
        offsets.push(Some(offset));
    }
    Some((offsets, size))
}

/// A module's functions, by offset from its core's base.
pub struct ModuleSymbols {
    pub symbols: Symbols,
    /// The size of the core's executable part: more than the core the guest reported means
    /// another build of the module.
    pub text_size: u64,
}

/// Reads a `.ko`'s functions at their offsets in the module's core ([`core_text_layout`]);
/// functions of sections outside it (`.init.text`) are left out. A function without a size
/// extends to the end of its section (not over the module's data).
pub fn parse_module(data: &[u8], path: &Path) -> Result<ModuleSymbols> {
    let file = object::File::parse(data)
        .with_context(|| format!("{} is not an object file", path.display()))?;
    if file.format() != object::BinaryFormat::Elf || file.kind() != object::ObjectKind::Relocatable
    {
        bail!(
            "{} is not a kernel module (an ELF relocatable object)",
            path.display()
        );
    }
    let sections: Vec<(object::SectionIndex, SectionHeader)> = file
        .sections()
        .map(|s| {
            let flags = match s.flags() {
                SectionFlags::Elf { sh_flags, .. } => sh_flags.0,
                _ => 0,
            };
            let header = SectionHeader {
                name: s.name().unwrap_or("").to_owned(),
                flags,
                align: s.align(),
                size: s.size(),
            };
            (s.index(), header)
        })
        .collect();
    let headers: Vec<SectionHeader> = sections.iter().map(|(_, h)| h.clone()).collect();
    let (offsets, text_size) = core_text_layout(&headers)
        .with_context(|| format!("{}: its sections cannot be laid out", path.display()))?;
    // Section index → (offset in the core, section size).
    let placed: HashMap<object::SectionIndex, (u64, u64)> = sections
        .iter()
        .zip(&offsets)
        .filter_map(|((i, h), o)| Some((*i, (((*o)?), h.size))))
        .collect();
    let functions = file
        .symbols()
        .filter(|s| s.kind() == SymbolKind::Text)
        .filter_map(|s| {
            let &(offset, section_size) = placed.get(&s.section_index()?)?;
            let name = s.name().ok().filter(|n| !n.is_empty())?;
            let value = s.address();
            if value >= section_size {
                return None;
            }
            let size = match s.size() {
                0 => section_size - value,
                n => n.min(section_size - value),
            };
            Some((offset.checked_add(value)?, size, s.size() == 0, name))
        })
        .collect::<Vec<_>>();
    let symbols = Symbols::from_module_functions(path, file.build_id().ok().flatten(), functions);
    Ok(ModuleSymbols { symbols, text_size })
}

/// Linux treats `-` and `_` in module names alike (the name the kernel keeps has `_`).
pub fn module_key(name: &str) -> String {
    name.replace('-', "_")
}

/// The `.ko` files under `root/lib/modules/<release>/` by module name ([`module_key`]), for the
/// names `wanted`: `release` (the `--kernel` image's) is searched first, then the other
/// releases in name order; the first file found for a name is kept. Compressed modules
/// (`.ko.xz`, `.ko.zst`) are not read (Debian 6.1 ships them uncompressed).
pub fn find_module_files(
    root: &Path,
    release: Option<&str>,
    wanted: &[String],
) -> HashMap<String, PathBuf> {
    let mut found: HashMap<String, PathBuf> = HashMap::default();
    let wanted: Vec<String> = wanted.iter().map(|n| module_key(n)).collect();
    let base = root.join("lib/modules");
    let mut releases: Vec<PathBuf> = match std::fs::read_dir(&base) {
        Ok(dir) => dir.flatten().map(|e| e.path()).collect(),
        Err(_) => return found,
    };
    releases.sort();
    if let Some(r) = release {
        releases.sort_by_key(|p| p.file_name().and_then(|n| n.to_str()) != Some(r));
    }
    for dir in releases {
        walk(&dir, 0, &mut |path| {
            let Some(stem) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".ko"))
            else {
                return;
            };
            let key = module_key(stem);
            if wanted.contains(&key) && !found.contains_key(&key) {
                found.insert(key, path.to_path_buf());
            }
        });
        if wanted.iter().all(|w| found.contains_key(w)) {
            break;
        }
    }
    found
}

/// Calls `f` on every regular file under `dir`, not following symbolic links (a release's
/// `build` and `source` links lead to the kernel headers, or out of the root), at most 16
/// levels deep.
fn walk(dir: &Path, depth: usize, f: &mut dyn FnMut(&Path)) {
    if depth > 16 {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        match e.file_type() {
            Ok(t) if t.is_dir() => walk(&e.path(), depth + 1, f),
            Ok(t) if t.is_file() => f(&e.path()),
            _ => {}
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn section(name: &str, flags: u64, align: u64, size: u64) -> SectionHeader {
        SectionHeader {
            name: name.to_owned(),
            flags,
            align,
            size,
        }
    }

    const AX: u64 = SHF_ALLOC | SHF_EXECINSTR;

    #[test]
    fn the_core_text_is_laid_out_as_linux_does() {
        let sections = [
            section("", 0, 0, 0),
            section(".note.gnu.build-id", SHF_ALLOC, 4, 0x24),
            section(".text", AX, 16, 0x123),
            section(".rela.text", 0, 8, 0x300),
            section(".text.unlikely", AX, 1, 0x10),
            section(".init.text", AX, 16, 0x40),
            section(".rodata", SHF_ALLOC, 32, 0x80),
            section(".exit.text", AX, 16, 0x11),
            section(".altinstr_replacement", AX, 0, 0x5),
            section(".data", SHF_ALLOC | object::elf::SHF_WRITE.0, 8, 0x10),
            // Executable but not allocated: not loaded at all.
            section(".discard.text", SHF_EXECINSTR, 16, 0x10),
        ];
        let (offsets, size) = core_text_layout(&sections).unwrap();
        assert_eq!(
            offsets,
            [
                None,
                None,
                Some(0),     // .text: the first, at the base
                None,        // relocations are not loaded
                Some(0x123), // align 1: right after .text
                None,        // .init.text: in the init layout, freed after loading
                None,        // data: after the text
                Some(0x140), // 0x133 aligned to 16
                Some(0x151), // align 0 is 1
                None,
                None,
            ]
        );
        assert_eq!(size, 0x156);
        // An alignment the kernel could not use: no layout rather than a wrong one.
        assert_eq!(core_text_layout(&[section(".text", AX, 12, 0x10)]), None);
        assert_eq!(
            core_text_layout(&[
                section(".text", AX, 1, u64::MAX),
                section(".text.2", AX, 16, 1),
            ]),
            None
        );
    }

    /// A synthetic `.ko`: `.text` (align 16, 0x123 bytes: `mod_work` at 0x10, 0x40 bytes;
    /// `mod_label`, no size, at 0x100), `.init.text` (`mod_init`), `.exit.text` (align 16:
    /// `mod_exit` at 0, 0x11 bytes), `.data`. In the core: `.text` at 0, `.exit.text` at 0x130.
    pub(crate) fn synthetic_ko() -> Vec<u8> {
        use object::write::{Object as WObject, Symbol, SymbolSection};
        use object::{Architecture, BinaryFormat, Endianness, SymbolFlags, SymbolScope};
        let mut obj = WObject::new(BinaryFormat::Elf, Architecture::X86_64, Endianness::Little);
        let mut section = |name: &str, kind, align, size| {
            let id = obj.add_section(Vec::new(), name.as_bytes().to_vec(), kind);
            obj.append_section_data(id, &vec![0xcc; size], align);
            id
        };
        let text = section(".text", object::SectionKind::Text, 16, 0x123);
        let init = section(".init.text", object::SectionKind::Text, 16, 0x20);
        let exit = section(".exit.text", object::SectionKind::Text, 16, 0x11);
        let data = section(".data", object::SectionKind::Data, 8, 0x40);
        for (name, section, value, size, kind) in [
            ("mod_work", text, 0x10, 0x40, SymbolKind::Text),
            ("mod_label", text, 0x100, 0, SymbolKind::Text),
            ("mod_init", init, 0, 0x20, SymbolKind::Text),
            ("mod_exit", exit, 0, 0x11, SymbolKind::Text),
            ("mod_table", data, 0, 0x40, SymbolKind::Data),
        ] {
            obj.add_symbol(Symbol {
                name: name.as_bytes().to_vec(),
                value,
                size,
                kind,
                scope: SymbolScope::Compilation,
                weak: false,
                section: SymbolSection::Section(section),
                flags: SymbolFlags::None,
            });
        }
        obj.write().unwrap()
    }

    #[test]
    fn a_synthetic_module_is_laid_out_and_named() {
        let m = parse_module(&synthetic_ko(), Path::new("m.ko")).unwrap();
        assert_eq!(m.text_size, 0x141);
        assert_eq!(m.symbols.lookup(0x10), Some("mod_work"));
        assert_eq!(m.symbols.lookup(0x4f), Some("mod_work"));
        assert_eq!(m.symbols.lookup(0x50), None, "between functions");
        // An unsized label runs to its section's end, not into the next section.
        assert_eq!(m.symbols.lookup(0x122), Some("mod_label"));
        assert_eq!(m.symbols.lookup(0x125), None, "alignment padding");
        assert_eq!(m.symbols.lookup(0x130), Some("mod_exit"));
        assert_eq!(m.symbols.lookup(0x141), None);
        assert!(
            m.symbols
                .functions()
                .all(|(_, _, n)| n != "mod_init" && n != "mod_table")
        );
        // A truncated file: an error, no panic.
        let ko = synthetic_ko();
        assert!(parse_module(&ko[..4], Path::new("x.ko")).is_err());
        assert!(parse_module(&ko[..0x40], Path::new("x.ko")).is_err());
    }

    #[test]
    fn module_names_match_with_dashes_or_underscores() {
        assert_eq!(module_key("crc32c-intel"), "crc32c_intel");
        assert_eq!(module_key("crc32c_intel"), module_key("crc32c-intel"));
    }

    /// The real `wp512.ko` of the Debian kernel `cargo xtask linux-image` downloads, extracted
    /// into `dir`: its path, or `None` (the reason printed) when the package is absent.
    pub(crate) fn real_wp512(dir: &Path) -> Option<(PathBuf, String)> {
        let debs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/linux/debs");
        let deb = std::fs::read_dir(&debs).ok().and_then(|d| {
            d.flatten().map(|e| e.path()).find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("linux-image-6.1") && n.ends_with(".deb"))
            })
        });
        let Some(deb) = deb else {
            eprintln!(
                "skipped: no linux-image-6.1*.deb in {} (run `cargo xtask linux-image`)",
                debs.display()
            );
            return None;
        };
        // linux-image-6.1.0-48-cloud-amd64_6.1.172-1_amd64.deb: the release is 6.1.0-48-cloud-amd64.
        let name = deb.file_name()?.to_str()?;
        let release = name
            .strip_prefix("linux-image-")?
            .split('_')
            .next()?
            .to_owned();
        let member = format!("./lib/modules/{release}/kernel/crypto/wp512.ko");
        let script = format!(
            "dpkg-deb --fsys-tarfile '{}' | tar -x -C '{}' '{member}'",
            deb.display(),
            dir.display()
        );
        match std::process::Command::new("sh")
            .arg("-c")
            .arg(&script)
            .output()
        {
            Ok(o) if o.status.success() => {}
            Ok(o) => {
                eprintln!(
                    "skipped: cannot extract wp512.ko: {}",
                    String::from_utf8_lossy(&o.stderr)
                );
                return None;
            }
            Err(e) => {
                eprintln!("skipped: cannot run dpkg-deb ({e})");
                return None;
            }
        }
        Some((dir.join(&member[2..]), release))
    }

    #[test]
    fn the_real_wp512_module_is_named_by_function() {
        let dir = crate::naming::symbols::tests::scratch("wp512");
        let Some((ko, release)) = real_wp512(&dir) else {
            return;
        };
        let data = std::fs::read(&ko).unwrap();
        let m = parse_module(&data, &ko).unwrap();
        // The symbol values as the file has them, for comparison.
        let file = object::File::parse(&*data).unwrap();
        let value = |name: &str| {
            file.symbols()
                .find(|s| s.name() == Ok(name))
                .map(|s| s.address())
                .unwrap()
        };
        let text = file.section_by_name(".text").unwrap();
        let exit = file.section_by_name(".exit.text").unwrap();
        // .text is the first executable section: at the base, its functions at their values.
        let at = value("wp512_process_buffer");
        assert!(at < text.size(), "{at:#x} is inside .text");
        assert_eq!(m.symbols.lookup(at), Some("wp512_process_buffer"));
        assert_eq!(m.symbols.lookup(at + 0x100), Some("wp512_process_buffer"));
        assert_eq!(
            m.symbols.lookup(value("wp512_update")),
            Some("wp512_update")
        );
        // .exit.text follows it (CONFIG_MODULE_UNLOAD=y): the function that unregisters the
        // algorithms, after the aligned end of .text.
        let exit_at = text.size().next_multiple_of(exit.align().max(1));
        let fini = m.symbols.lookup(exit_at).unwrap();
        assert!(
            fini == "wp512_mod_fini" || fini == "cleanup_module",
            "{fini}"
        );
        assert_eq!(m.text_size, exit_at + exit.size());
        // .init.text is not in the core: its function is not named anywhere.
        assert!(
            m.symbols
                .functions()
                .all(|(_, _, n)| n != "wp512_mod_init" && n != "init_module")
        );
        // Plain names: functions, no section symbols or offsets.
        for (_, _, name) in m.symbols.functions() {
            assert!(
                !name.is_empty() && !name.starts_with('.') && !name.contains('+'),
                "{name}"
            );
        }
        // Past the text (the module's data): no function.
        assert_eq!(m.symbols.lookup(m.text_size), None);
        assert_eq!(m.symbols.lookup(m.text_size + 0x40), None);
        // Found under a root by name, with the release given.
        let found = find_module_files(&dir, Some(&release), &["wp512".to_owned()]);
        assert_eq!(found.get("wp512"), Some(&ko));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn module_files_are_found_by_name_in_the_kernels_release_first() {
        let root = crate::naming::symbols::tests::scratch("modroot");
        for (rel, file) in [
            ("6.1.0-40-amd64", "kernel/crypto/wp512.ko"),
            ("6.1.0-48-cloud-amd64", "kernel/crypto/wp512.ko"),
            (
                "6.1.0-48-cloud-amd64",
                "kernel/arch/x86/crypto/crc32c-intel.ko",
            ),
            ("6.1.0-48-cloud-amd64", "kernel/fs/ext4.ko.xz"),
        ] {
            let p = root.join("lib/modules").join(rel).join(file);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, rel).unwrap();
        }
        let want = [
            "wp512".to_owned(),
            "crc32c_intel".to_owned(),
            "ext4".to_owned(),
        ];
        let found = find_module_files(&root, Some("6.1.0-48-cloud-amd64"), &want);
        let release_of = |name: &str| found.get(name).map(|p| std::fs::read_to_string(p).unwrap());
        assert_eq!(release_of("wp512").as_deref(), Some("6.1.0-48-cloud-amd64"));
        assert_eq!(
            release_of("crc32c_intel").as_deref(),
            Some("6.1.0-48-cloud-amd64")
        );
        assert_eq!(release_of("ext4"), None, "compressed: not read");
        // Another release asked for: its own file first.
        let found = find_module_files(&root, Some("6.1.0-40-amd64"), &want);
        assert_eq!(
            found
                .get("wp512")
                .map(|p| std::fs::read_to_string(p).unwrap())
                .as_deref(),
            Some("6.1.0-40-amd64")
        );
        // No root: nothing.
        assert!(find_module_files(&root.join("none"), None, &want).is_empty());
        let _ = std::fs::remove_dir_all(root);
    }
}
