//! The host programs and files the end-to-end runs need, and the Debian packages that bring them.

use std::env;
use std::path::{Path, PathBuf};

use crate::emulator::{BOCHS_BIOS, BOCHS_VGA_BIOS, find_ovmf};

/// The Debian packages that bring every tool. `bochs-term` is named so that apt satisfies
/// `bochs`'s GUI dependency with it instead of pulling the wxWidgets GUI.
pub const APT_PACKAGES: &[&str] = &[
    "bochs",
    "bochs-term",
    "bochsbios",
    "vgabios",
    "grub-pc-bin",
    "grub-efi-amd64-bin",
    "grub-common",
    "xorriso",
    "mtools",
    "binutils",
    "qemu-system-x86",
    "ovmf",
    "valgrind",
    "chromium",
];

/// The Bochs term display plugin (Debian's multiarch path).
pub const BOCHS_TERM_PLUGIN: &str = "/usr/lib/x86_64-linux-gnu/bochs/plugins/libbx_term_gui.so";

/// One thing a run needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requirement {
    /// A program on `PATH`.
    Program(&'static str),
    /// A file or folder.
    Path(&'static str),
    /// Any OVMF firmware QEMU can use.
    Ovmf,
}

/// Everything needed, each with the package that brings it.
pub const REQUIREMENTS: &[(Requirement, &str)] = &[
    (Requirement::Program("bochs-bin"), "bochs"),
    (Requirement::Path(BOCHS_TERM_PLUGIN), "bochs-term"),
    (Requirement::Path(BOCHS_BIOS), "bochsbios"),
    (Requirement::Path(BOCHS_VGA_BIOS), "vgabios"),
    (Requirement::Program("grub-mkrescue"), "grub-common"),
    (Requirement::Path("/usr/lib/grub/i386-pc"), "grub-pc-bin"),
    (
        Requirement::Path("/usr/lib/grub/x86_64-efi"),
        "grub-efi-amd64-bin",
    ),
    (Requirement::Program("xorriso"), "xorriso"),
    (Requirement::Program("mformat"), "mtools"),
    // The ISO's copy of the hypervisor without its debug sections (`iso::build_iso`).
    (Requirement::Program("objcopy"), "binutils"),
    (
        Requirement::Program("qemu-system-x86_64"),
        "qemu-system-x86",
    ),
    (Requirement::Ovmf, "ovmf"),
    // The Linux scenarios' ground truth: instructions per function (callgrind).
    (Requirement::Program("callgrind_annotate"), "valgrind"),
    // The HTML report's check: headless Chromium renders it (hvprof-analyze's tests).
    (Requirement::Program("chromium"), "chromium"),
];

/// The full path of `program` on `PATH`.
pub fn which(program: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// Whether `req` is satisfied on this machine.
pub fn is_present(req: &Requirement) -> bool {
    match req {
        Requirement::Program(name) => which(name).is_some(),
        Requirement::Path(path) => Path::new(path).exists(),
        Requirement::Ovmf => find_ovmf().is_some(),
    }
}

/// What is missing, as (description, package).
pub fn missing() -> Vec<(String, &'static str)> {
    REQUIREMENTS
        .iter()
        .filter(|(req, _)| !is_present(req))
        .map(|(req, package)| {
            let what = match req {
                Requirement::Program(name) => format!("program {name}"),
                Requirement::Path(path) => path.to_string(),
                Requirement::Ovmf => "OVMF firmware (/usr/share/ovmf/OVMF.fd)".to_owned(),
            };
            (what, *package)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_requirement_names_a_listed_package() {
        for (_, package) in REQUIREMENTS {
            assert!(APT_PACKAGES.contains(package), "{package}");
        }
    }

    #[test]
    fn which_finds_sh() {
        assert!(which("sh").is_some());
        assert!(which("surely-no-such-program-hvprof").is_none());
    }
}
