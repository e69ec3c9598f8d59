//! The bootable ISO: a GRUB tree holding the hypervisor and its modules, made hybrid BIOS+UEFI by
//! `grub-mkrescue`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Where GRUB finds the hypervisor inside the ISO.
pub const HYPERVISOR_ISO_PATH: &str = "/boot/hvprof";
/// The folder of the modules inside the ISO.
pub const MODULES_ISO_DIR: &str = "/boot/modules";
/// GRUB modules put into the image: enough for Multiboot2 from an ISO, and no more (a minimal list
/// halves GRUB's time in Bochs). `--install-modules` applies to every GRUB platform at once.
pub const GRUB_INSTALL_MODULES: &str =
    "multiboot2 normal iso9660 part_msdos part_gpt configfile boot";

/// One boot module: a file and the command line GRUB passes with it.
///
/// Convention: the command line's first token is the module's image name
/// (`hello.elf vm=hello mem=16M`); [`IsoModule::with_args`] follows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IsoModule {
    /// The file to put into the ISO (under its own file name).
    pub path: PathBuf,
    /// The module's full command line.
    pub cmdline: String,
}

impl IsoModule {
    /// A module with an explicit full command line.
    pub fn new(path: impl Into<PathBuf>, cmdline: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            cmdline: cmdline.into(),
        }
    }

    /// A module whose command line is its file name followed by `args`.
    pub fn with_args(path: impl Into<PathBuf>, args: &str) -> Result<Self> {
        let path = path.into();
        let name = file_name(&path)?;
        let cmdline = if args.trim().is_empty() {
            name
        } else {
            format!("{name} {}", args.trim())
        };
        Ok(Self { path, cmdline })
    }

    /// The module's name inside the ISO.
    pub fn file_name(&self) -> Result<String> {
        file_name(&self.path)
    }
}

fn file_name(path: &Path) -> Result<String> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .with_context(|| format!("module path {} has no UTF-8 file name", path.display()))?;
    if name
        .chars()
        .any(|c| c.is_whitespace() || c == '\'' || c == '"')
    {
        bail!("module file name {name:?} must not contain whitespace or quotes");
    }
    Ok(name.to_owned())
}

/// Quotes one word for GRUB's script parser when it holds anything but plain characters.
fn grub_word(word: &str) -> String {
    let plain = word
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "._,:/=+@%-".contains(c));
    if plain && !word.is_empty() {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// A command line as GRUB script words (split on whitespace, each quoted if needed).
fn grub_words(cmdline: &str) -> String {
    cmdline
        .split_whitespace()
        .map(grub_word)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The `grub.cfg`: no menu delay, one entry that loads the hypervisor and the modules.
///
/// `modules` holds (file name inside [`MODULES_ISO_DIR`], module command line).
pub fn grub_cfg(cmdline: &str, modules: &[(String, String)]) -> String {
    let mut cfg = String::from("set timeout=0\nset default=0\n\nmenuentry \"hvprof\" {\n");
    let args = grub_words(cmdline);
    if args.is_empty() {
        cfg.push_str(&format!("    multiboot2 {HYPERVISOR_ISO_PATH}\n"));
    } else {
        cfg.push_str(&format!("    multiboot2 {HYPERVISOR_ISO_PATH} {args}\n"));
    }
    for (name, module_cmdline) in modules {
        let args = grub_words(module_cmdline);
        let file = grub_word(&format!("{MODULES_ISO_DIR}/{name}"));
        if args.is_empty() {
            cfg.push_str(&format!("    module2 {file}\n"));
        } else {
            cfg.push_str(&format!("    module2 {file} {args}\n"));
        }
    }
    cfg.push_str("    boot\n}\n");
    cfg
}

/// What goes into one ISO.
#[derive(Debug, Clone)]
pub struct IsoSpec<'a> {
    /// The hypervisor ELF.
    pub hypervisor: &'a Path,
    /// The hypervisor's command line.
    pub cmdline: &'a str,
    /// The boot modules, in order (module 0 first).
    pub modules: &'a [IsoModule],
}

/// Writes the ISO tree into `tree` (replacing what was there) and makes `iso` from it.
/// Copies the hypervisor's ELF into the ISO without its debug sections (`objcopy
/// --strip-debug`): GRUB reads the whole file it loads, about 10 emulated instructions a byte,
/// and the debug sections are 60 % of it (13.9 MB of which 8.6 MB, 91 M of a small scenario's
/// 300 M Bochs instructions). The loaded segments, the symbols and the build-id note stay, so the
/// image runs the same and the analyzer, given the full ELF, still matches it by build id.
fn strip_debug(elf: &Path, dest: &Path) -> Result<()> {
    let output = Command::new("objcopy")
        .arg("--strip-debug")
        .arg(elf)
        .arg(dest)
        .output()
        .context("cannot run objcopy (is binutils installed?)")?;
    if !output.status.success() {
        bail!(
            "objcopy --strip-debug {} failed ({}): {}",
            elf.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// Whether `path` is an ELF file with `.debug_*` sections (one the tests craft, malformed on
/// purpose, is not read as one and goes into the ISO as it is).
fn has_debug_sections(path: &Path) -> bool {
    use object::{Object, ObjectSection};
    let Ok(bytes) = fs::read(path) else {
        return false;
    };
    object::File::parse(&*bytes).is_ok_and(|f| {
        f.sections()
            .any(|s| s.name().is_ok_and(|n| n.starts_with(".debug_")))
    })
}

pub fn build_iso(spec: &IsoSpec<'_>, tree: &Path, iso: &Path) -> Result<()> {
    if tree.exists() {
        fs::remove_dir_all(tree)
            .with_context(|| format!("cannot remove the old ISO tree {}", tree.display()))?;
    }
    let grub_dir = tree.join("boot/grub");
    let modules_dir = tree.join("boot/modules");
    fs::create_dir_all(&grub_dir)
        .with_context(|| format!("cannot create {}", grub_dir.display()))?;
    fs::create_dir_all(&modules_dir)
        .with_context(|| format!("cannot create {}", modules_dir.display()))?;

    let hv_dest = tree.join(HYPERVISOR_ISO_PATH.trim_start_matches('/'));
    strip_debug(spec.hypervisor, &hv_dest)?;

    let mut entries = Vec::with_capacity(spec.modules.len());
    for module in spec.modules {
        let name = module.file_name()?;
        if entries.iter().any(|(n, _): &(String, String)| *n == name) {
            bail!("two modules are named {name:?}: module file names must differ");
        }
        let dest = modules_dir.join(&name);
        // A guest ELF without its debug sections, like the hypervisor (the test guests' are 98 %
        // of the file); any other module as it is.
        if !(has_debug_sections(&module.path) && strip_debug(&module.path, &dest).is_ok()) {
            let _ = fs::remove_file(&dest);
            link_or_copy(&module.path, &dest)
                .with_context(|| format!("cannot copy module {}", module.path.display()))?;
        }
        entries.push((name, module.cmdline.clone()));
    }

    let cfg_path = grub_dir.join("grub.cfg");
    fs::write(&cfg_path, grub_cfg(spec.cmdline, &entries))
        .with_context(|| format!("cannot write {}", cfg_path.display()))?;

    if let Some(parent) = iso.parent() {
        fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    let output = Command::new("grub-mkrescue")
        .arg("-o")
        .arg(iso)
        .arg(format!("--install-modules={GRUB_INSTALL_MODULES}"))
        .args(["--locales=", "--fonts=", "--themes="])
        .arg(tree)
        .output()
        .context("cannot run grub-mkrescue (is grub-common installed?)")?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(15).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "grub-mkrescue failed ({}):\n{}",
            output.status,
            tail.join("\n")
        );
    }
    if !iso.is_file() {
        bail!("grub-mkrescue succeeded but wrote no {}", iso.display());
    }
    // The tree is in the ISO now; a Linux scenario's tree is about 40 MB, and a test run makes
    // dozens of them.
    fs::remove_dir_all(tree)
        .with_context(|| format!("cannot remove the ISO tree {}", tree.display()))?;
    Ok(())
}

/// Puts the file `from` at `to` (replacing what is there) as a hard link, or as a copy where a
/// link cannot be made (another file system, a file system without links). The test run places a
/// Linux kernel and its initramfs (about 25 MB) into every Linux scenario's folder and ISO tree:
/// links cost no disk space. Nothing writes to a placed file: writing to it would change `from`.
pub fn link_or_copy(from: &Path, to: &Path) -> std::io::Result<()> {
    match fs::remove_file(to) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    match fs::hard_link(from, to) {
        Ok(()) => Ok(()),
        Err(_) => fs::copy(from, to).map(drop),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_or_copy_links_and_replaces() {
        use std::os::unix::fs::MetadataExt;
        let dir = std::env::temp_dir().join(format!("hvprof-link-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let from = dir.join("kernel");
        let to = dir.join("placed");
        fs::write(&from, b"the kernel").unwrap();
        fs::write(&to, b"an older file at the place").unwrap();
        link_or_copy(&from, &to).unwrap();
        assert_eq!(fs::read(&to).unwrap(), b"the kernel");
        // On one file system it is the same file: no space taken.
        let (a, b) = (fs::metadata(&from).unwrap(), fs::metadata(&to).unwrap());
        assert_eq!((a.dev(), a.ino()), (b.dev(), b.ino()));
        // Placing it again works (the old link is replaced, not refused).
        link_or_copy(&from, &to).unwrap();
        assert_eq!(fs::read(&to).unwrap(), b"the kernel");
        // A missing source is an error, and names no file that was made.
        let err = link_or_copy(&dir.join("missing"), &dir.join("other")).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
        assert!(!dir.join("other").exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn grub_cfg_without_modules() {
        let cfg = grub_cfg("", &[]);
        assert_eq!(
            cfg,
            "set timeout=0\nset default=0\n\nmenuentry \"hvprof\" {\n    multiboot2 /boot/hvprof\n    boot\n}\n"
        );
    }

    #[test]
    fn grub_cfg_with_cmdline_and_modules() {
        let cfg = grub_cfg(
            "period=1ms  bogus=1",
            &[
                ("sample.elf".into(), "sample.elf vm=sample".into()),
                ("bad.elf".into(), "bad.elf".into()),
            ],
        );
        assert!(cfg.starts_with("set timeout=0\n"));
        let lines: Vec<&str> = cfg.lines().map(str::trim).collect();
        let mb = lines
            .iter()
            .position(|l| l.starts_with("multiboot2"))
            .unwrap();
        assert_eq!(lines[mb], "multiboot2 /boot/hvprof period=1ms bogus=1");
        assert_eq!(
            lines[mb + 1],
            "module2 /boot/modules/sample.elf sample.elf vm=sample"
        );
        assert_eq!(lines[mb + 2], "module2 /boot/modules/bad.elf bad.elf");
        assert_eq!(lines[mb + 3], "boot");
        assert_eq!(cfg.matches("menuentry").count(), 1);
    }

    #[test]
    fn grub_words_are_quoted_when_needed() {
        assert_eq!(grub_word("vm=hello"), "vm=hello");
        assert_eq!(grub_word("a;b"), "'a;b'");
        assert_eq!(grub_word("$x"), "'$x'");
        assert_eq!(grub_word("it's"), r"'it'\''s'");
    }

    #[test]
    fn module_cmdline_starts_with_file_name() {
        let m = IsoModule::with_args("/tmp/x/hello.elf", "vm=hello mem=16M").unwrap();
        assert_eq!(m.cmdline, "hello.elf vm=hello mem=16M");
        let m = IsoModule::with_args("/tmp/x/hello.elf", "").unwrap();
        assert_eq!(m.cmdline, "hello.elf");
        assert!(IsoModule::with_args("/tmp/x/a b.elf", "").is_err());
    }
}
