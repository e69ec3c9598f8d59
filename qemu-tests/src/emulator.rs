//! The emulators a scenario can run on, and how each is started.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// The Bochs BIOS the Debian `bochsbios` package installs.
pub const BOCHS_BIOS: &str = "/usr/share/bochs/BIOS-bochs-latest";
/// The VGA BIOS the Debian `vgabios` package installs.
pub const BOCHS_VGA_BIOS: &str = "/usr/share/vgabios/vgabios.bin";
/// The emulated machine's CMOS clock at power-on, in seconds since 1970 (2026-01-01 00:00 UTC),
/// the same for every run.
pub const BOCHS_TIME0: u64 = 1_767_225_600;
/// Guest memory, MiB, in every emulator.
pub const GUEST_MEGS: u32 = 1024;
/// Bochs' emulated instructions per second by default: with `clock: sync=none` the TSC counts
/// instructions whatever this is, and it scales the time-based devices (UART, PIT, BIOS and GRUB
/// delays), so the hypervisor measures its TSC at this many Hz. 4 MHz keeps the serial line cheap
/// (344 instructions per byte) for the test guests, which do not care about the clock.
pub const BOCHS_IPS: u64 = 4_000_000;
/// A realistic clock (1 GHz): for Linux guests, whose timer tick and delays are set in time, so
/// that a tick costs what it costs on hardware (about 0.1% of the CPU at HZ=250) and not a quarter
/// of the machine as at 4 MHz. The UART is then 87,000 instructions per byte: the sample log goes
/// to the parallel port (`channel=lpt`), which costs a few instructions per byte at any clock.
pub const BOCHS_IPS_REALISTIC: u64 = 1_000_000_000;
/// The Bochs CPU model used when none is named: VMX, EPT, VPID, unrestricted guest and the
/// VMX-preemption timer, and Linux guests run on it.
pub const DEFAULT_BOCHS_MODEL: &str = "corei7_haswell_4770";

/// An emulator (or accelerator) to boot the ISO on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Emulator {
    /// Bochs with the given CPU model (e.g. `corei7_haswell_4770`): VMX with EPT, no PMU.
    Bochs {
        /// The `cpu: model=` value.
        model: String,
        /// Emulated instructions per emulated second (`cpu: ips=`): the TSC's apparent frequency.
        ips: u64,
        /// The CPUs' informational messages go to Bochs' log (`info: ... cpuN=`): on by
        /// default. With APIC virtualization Bochs writes three lines for each virtual
        /// interrupt and each virtualized TPR or EOI write; a guest that loops on them (a
        /// kvm-unit-tests kernel timing `mov %cr8`) fills gigabytes of log at a line per five
        /// instructions, and runs at the speed of the disk.
        cpu_info: bool,
    },
    /// QEMU TCG with SeaBIOS: no VMX.
    QemuTcgBios,
    /// QEMU TCG with OVMF: no VMX; the UEFI boot path.
    QemuTcgUefi,
    /// QEMU with KVM and nested VMX (`-cpu host,+vmx,pmu=on`); only where the host offers VMX.
    QemuKvm,
}

impl Emulator {
    /// Bochs with `model`, at the default clock ([`BOCHS_IPS`]).
    pub fn bochs(model: &str) -> Self {
        Self::Bochs {
            model: model.to_owned(),
            ips: BOCHS_IPS,
            cpu_info: true,
        }
    }

    /// The same emulator without the CPUs' informational messages in its log (Bochs only).
    #[must_use]
    pub fn without_cpu_info(self) -> Self {
        match self {
            Self::Bochs { model, ips, .. } => Self::Bochs {
                model,
                ips,
                cpu_info: false,
            },
            other => other,
        }
    }

    /// The same emulator at another clock (Bochs only; the others keep theirs).
    #[must_use]
    pub fn with_ips(self, new: u64) -> Self {
        match self {
            Self::Bochs {
                model, cpu_info, ..
            } => Self::Bochs {
                model,
                ips: new,
                cpu_info,
            },
            other => other,
        }
    }

    /// A short human name.
    pub fn label(&self) -> String {
        match self {
            Self::Bochs { model, ips, .. } if *ips == BOCHS_IPS => format!("bochs ({model})"),
            Self::Bochs { model, ips, .. } => {
                format!("bochs ({model}, {} MHz)", ips / 1_000_000)
            }
            Self::QemuTcgBios => "qemu-tcg (SeaBIOS)".to_owned(),
            Self::QemuTcgUefi => "qemu-tcg (OVMF)".to_owned(),
            Self::QemuKvm => "qemu-kvm (nested VMX)".to_owned(),
        }
    }

    /// The emulator CPU time a scenario on this emulator may take by default, on the reference
    /// machine (`runner::REFERENCE_BOCHS_SPEED`).
    pub fn default_budget(&self) -> Duration {
        match self {
            Self::Bochs { .. } | Self::QemuTcgUefi => Duration::from_secs(60),
            Self::QemuTcgBios | Self::QemuKvm => Duration::from_secs(30),
        }
    }

    /// `Ok` when this machine can run the emulator as intended, else why not (the scenario is
    /// then skipped). Only nested KVM depends on the host; missing programs are errors, reported
    /// when the emulator is started.
    pub fn availability(&self) -> Result<(), String> {
        match self {
            Self::QemuKvm => kvm_vmx_available(),
            _ => Ok(()),
        }
    }
}

/// Whether nested VMX under KVM can work, from the host's `/proc/cpuinfo` text and whether
/// `/dev/kvm` opened read-write.
pub fn kvm_decision(cpuinfo: &str, dev_kvm_rw: bool) -> Result<(), String> {
    let has_vmx = cpuinfo
        .lines()
        .filter(|line| line.starts_with("flags"))
        .filter_map(|line| line.split_once(':'))
        .any(|(_, flags)| flags.split_whitespace().any(|flag| flag == "vmx"));
    match (dev_kvm_rw, has_vmx) {
        (true, true) => Ok(()),
        (false, true) => Err("/dev/kvm cannot be opened read-write".to_owned()),
        (true, false) => Err("the host CPU has no vmx flag in /proc/cpuinfo".to_owned()),
        (false, false) => {
            Err("/dev/kvm cannot be opened read-write and the host CPU has no vmx flag".to_owned())
        }
    }
}

/// [`kvm_decision`] for this machine.
pub fn kvm_vmx_available() -> Result<(), String> {
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let dev_kvm_rw = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    kvm_decision(&cpuinfo, dev_kvm_rw)
}

/// The UEFI firmware for QEMU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ovmf {
    /// One combined image, given with `-bios`.
    Combined(PathBuf),
    /// Code and variable-store templates, given as two pflash drives (the variables on a copy).
    Split {
        /// The read-only code image.
        code: PathBuf,
        /// The variable-store template (copied per run).
        vars: PathBuf,
    },
}

/// Where the Debian `ovmf` package puts its images, best first.
const OVMF_COMBINED: &[&str] = &["/usr/share/ovmf/OVMF.fd", "/usr/share/qemu/OVMF.fd"];
const OVMF_SPLIT: &[(&str, &str)] = &[
    (
        "/usr/share/OVMF/OVMF_CODE.fd",
        "/usr/share/OVMF/OVMF_VARS.fd",
    ),
    (
        "/usr/share/OVMF/OVMF_CODE_4M.fd",
        "/usr/share/OVMF/OVMF_VARS_4M.fd",
    ),
];

/// The first OVMF installation found on this machine.
pub fn find_ovmf() -> Option<Ovmf> {
    if let Some(path) = OVMF_COMBINED.iter().map(Path::new).find(|p| p.is_file()) {
        return Some(Ovmf::Combined(path.to_path_buf()));
    }
    OVMF_SPLIT
        .iter()
        .find(|(code, vars)| Path::new(code).is_file() && Path::new(vars).is_file())
        .map(|(code, vars)| Ovmf::Split {
            code: code.into(),
            vars: vars.into(),
        })
}

/// The values a generated `bochsrc` needs.
#[derive(Debug, Clone)]
pub struct BochsConfig<'a> {
    /// The `cpu: model=` value.
    pub model: &'a str,
    /// Number of CPUs.
    pub cpus: u32,
    /// `cpu: ips=`.
    pub ips: u64,
    /// The ISO to boot, as a hard disk of this many cylinders (see [`disk_cylinders`]).
    pub iso: &'a Path,
    pub iso_cylinders: u64,
    /// Where COM1 goes.
    pub serial_log: &'a Path,
    /// Where LPT1 goes.
    pub lpt_log: &'a Path,
    /// Bochs' own log.
    pub log: &'a Path,
    /// The CPUs' informational messages in it ([`Emulator::Bochs`]).
    pub cpu_info: bool,
}

/// A headless, deterministic `bochsrc` (`clock: sync=none`: runs are repeatable to the byte).
/// The CMOS clock starts at a fixed time, [`BOCHS_TIME0`]: `time0=1` would start it at the
/// host's local time, and a Linux guest's boot reads it (two runs of the same scenario then
/// differed in their exit counts and timings).
/// `options=fastboot` skips the BIOS's "Press F12 for boot menu" wait: three seconds of emulated
/// time, which at the Linux scenarios' 1 GHz clock were 3.1 G of a w41 run's 5.3 G instructions.
/// The ISO (a hybrid image: `grub-mkrescue` writes an MBR that boots it from a disk) is the
/// first hard disk, not a CD-ROM: Bochs emulates a CD-ROM's transfer time, and the BIOS polls
/// the drive through it, so that GRUB's reads cost instructions in proportion to the emulated
/// clock. At the Linux scenarios' 1 GHz a CD-ROM took 28 instructions a byte loaded, a disk
/// takes 11: an 8 MB module took 9 s of Bochs' time more from a CD-ROM, 3 s from a disk.
pub fn bochsrc(cfg: &BochsConfig<'_>) -> String {
    format!(
        "# Generated by qemu-tests. Run: bochs-bin -q -f bochsrc -rc continue.rc </dev/null\n\
         megs: {GUEST_MEGS}\n\
         romimage: file={BOCHS_BIOS}, options=fastboot\n\
         vgaromimage: file={BOCHS_VGA_BIOS}\n\
         display_library: term\n\
         cpu: model={model}, count={cpus}, ips={ips}, reset_on_triple_fault=0, ignore_bad_msrs=1\n\
         clock: sync=none, time0={BOCHS_TIME0}\n\
         ata0: enabled=1, ioaddr1=0x1f0, ioaddr2=0x3f0, irq=14\n\
         ata0-master: type=disk, path=\"{iso}\", mode=flat, cylinders={cylinders}, heads={DISK_HEADS}, spt={DISK_SPT}\n\
         boot: disk\n\
         com1: enabled=1, mode=file, dev=\"{serial}\"\n\
         parport1: enabled=1, file=\"{lpt}\"\n\
         port_e9_hack: enabled=1\n\
         speaker: enabled=0\n\
         sound: waveoutdrv=dummy, waveindrv=dummy, midioutdrv=dummy\n\
         mouse: enabled=0\n\
         log: {log}\n\
         panic: action=fatal\n\
         error: action=ignore\n\
         info: action=report{cpu_quiet}\n\
         debug: action=ignore\n",
        model = cfg.model,
        cpus = cfg.cpus,
        ips = cfg.ips,
        iso = cfg.iso.display(),
        cylinders = cfg.iso_cylinders,
        serial = cfg.serial_log.display(),
        lpt = cfg.lpt_log.display(),
        log = cfg.log.display(),
        cpu_quiet = if cfg.cpu_info {
            String::new()
        } else {
            (0..cfg.cpus).map(|i| format!(", cpu{i}=ignore")).collect()
        },
    )
}

/// The disk geometry the ISO is booted with: heads and sectors per track (of 512 bytes).
const DISK_HEADS: u64 = 16;
const DISK_SPT: u64 = 63;

/// Pads `iso` with zeros to whole cylinders of the disk geometry (Bochs reads a flat image as
/// cylinders x heads x sectors; the ISO's file system ignores what follows it) and returns
/// their number.
pub fn disk_cylinders(iso: &Path) -> Result<u64> {
    let cylinder = DISK_HEADS * DISK_SPT * 512;
    let file = fs::OpenOptions::new()
        .write(true)
        .open(iso)
        .with_context(|| format!("cannot open {}", iso.display()))?;
    let len = file
        .metadata()
        .with_context(|| format!("cannot read the size of {}", iso.display()))?
        .len();
    let cylinders = len.div_ceil(cylinder).max(1);
    if cylinders * cylinder != len {
        file.set_len(cylinders * cylinder)
            .with_context(|| format!("cannot pad {} to whole cylinders", iso.display()))?;
    }
    Ok(cylinders)
}

/// Bochs' config parser splits on commas and whitespace and knows no escapes.
fn check_bochs_path(path: &Path) -> Result<()> {
    let text = path.display().to_string();
    if text
        .chars()
        .any(|c| c.is_whitespace() || c == ',' || c == '"')
    {
        bail!("Bochs cannot take the path {text:?} (it holds whitespace, a comma or a quote)");
    }
    Ok(())
}

/// The files of one emulator run.
#[derive(Debug, Clone)]
pub struct RunFiles {
    /// The folder the run's files go to (bochsrc, continue.rc, OVMF variables).
    pub dir: PathBuf,
    /// The ISO to boot.
    pub iso: PathBuf,
    /// Where COM1 goes.
    pub serial_log: PathBuf,
    /// Where LPT1 goes (the sample log with `channel=lpt`).
    pub lpt_log: PathBuf,
    /// Where QEMU's virtio console goes (the sample log with `channel=virtio`).
    pub virtio_log: PathBuf,
    /// The emulator's log: Bochs' `log:` file, or QEMU's stdout and stderr.
    pub emulator_log: PathBuf,
    /// Where the emulator's stdout and stderr go: for Bochs `emulator.out` (the term display's
    /// screen, escape codes and all), for QEMU the same file as `emulator_log`.
    pub emulator_out: PathBuf,
}

impl RunFiles {
    /// The usual names inside `dir` for `emulator`.
    pub fn in_dir(dir: &Path, iso: &Path, emulator: &Emulator) -> Self {
        let emulator_log = dir.join("emulator.log");
        let emulator_out = match emulator {
            Emulator::Bochs { .. } => dir.join("emulator.out"),
            _ => emulator_log.clone(),
        };
        Self {
            dir: dir.to_path_buf(),
            iso: iso.to_path_buf(),
            serial_log: dir.join("serial.log"),
            lpt_log: dir.join("lpt.log"),
            virtio_log: dir.join("virtio.log"),
            emulator_log,
            emulator_out,
        }
    }

    /// The whole capture the analyzer reads: the serial log (console text, and the sample log
    /// with `channel=serial`) followed by what the parallel port carried (`channel=lpt`) and
    /// what the virtio console carried (`channel=virtio`). The sample log's frames are
    /// self-delimiting, so they join into one valid stream; a line break keeps the last console
    /// line apart from the first frame.
    pub fn capture(&self) -> std::io::Result<Vec<u8>> {
        capture_of(&self.dir)
    }
}

/// The capture of a run from the serial, parallel-port and virtio logs in its folder
/// ([`RunFiles::capture`]).
pub fn capture_of(dir: &Path) -> std::io::Result<Vec<u8>> {
    let mut bytes = fs::read(dir.join("serial.log"))?;
    for channel in ["lpt.log", "virtio.log"] {
        match fs::read(dir.join(channel)) {
            Ok(more) if !more.is_empty() => {
                bytes.extend_from_slice(b"\r\n");
                bytes.extend_from_slice(&more);
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(bytes)
}

/// QEMU's arguments (pure: the firmware is passed in, the OVMF variables copy is named by
/// `vars_copy`).
pub fn qemu_args(
    emulator: &Emulator,
    cpus: u32,
    files: &RunFiles,
    ovmf: Option<&Ovmf>,
    vars_copy: &Path,
) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "-m".into(),
        GUEST_MEGS.to_string(),
        "-cdrom".into(),
        files.iso.display().to_string(),
        "-serial".into(),
        format!("file:{}", files.serial_log.display()),
        "-parallel".into(),
        format!("file:{}", files.lpt_log.display()),
        // A virtio console (modern transport only) for `channel=virtio`; unused otherwise.
        "-device".into(),
        "virtio-serial-pci,disable-legacy=on".into(),
        "-chardev".into(),
        format!("file,id=hvprof-log,path={}", files.virtio_log.display()),
        "-device".into(),
        "virtconsole,chardev=hvprof-log".into(),
        "-display".into(),
        "none".into(),
        "-no-reboot".into(),
        "-monitor".into(),
        "none".into(),
        "-smp".into(),
        cpus.to_string(),
    ];
    match emulator {
        Emulator::QemuKvm => {
            args.extend(["-accel", "kvm", "-cpu", "host,+vmx,pmu=on"].map(String::from));
        }
        Emulator::QemuTcgBios | Emulator::QemuTcgUefi => {
            args.extend(["-accel", "tcg"].map(String::from));
        }
        Emulator::Bochs { .. } => {}
    }
    if *emulator == Emulator::QemuTcgUefi {
        match ovmf {
            Some(Ovmf::Combined(path)) => {
                args.extend(["-bios".into(), path.display().to_string()]);
            }
            Some(Ovmf::Split { code, .. }) => {
                args.extend([
                    "-drive".into(),
                    format!(
                        "if=pflash,format=raw,unit=0,readonly=on,file={}",
                        code.display()
                    ),
                    "-drive".into(),
                    format!("if=pflash,format=raw,unit=1,file={}", vars_copy.display()),
                ]);
            }
            None => {}
        }
    }
    args
}

/// Prepares the run's files and returns the command that starts the emulator (stdin, stdout and
/// stderr not yet set: [`crate::process`] sets them).
pub fn command(emulator: &Emulator, cpus: u32, files: &RunFiles) -> Result<Command> {
    fs::create_dir_all(&files.dir)
        .with_context(|| format!("cannot create {}", files.dir.display()))?;
    match emulator {
        Emulator::Bochs {
            model,
            ips,
            cpu_info,
        } => {
            for path in [
                &files.iso,
                &files.serial_log,
                &files.lpt_log,
                &files.emulator_log,
            ] {
                check_bochs_path(path)?;
            }
            let rc = files.dir.join("bochsrc");
            let text = bochsrc(&BochsConfig {
                model,
                cpus,
                ips: *ips,
                iso: &files.iso,
                iso_cylinders: disk_cylinders(&files.iso)?,
                serial_log: &files.serial_log,
                lpt_log: &files.lpt_log,
                log: &files.emulator_log,
                cpu_info: *cpu_info,
            });
            fs::write(&rc, text).with_context(|| format!("cannot write {}", rc.display()))?;
            let cont = files.dir.join("continue.rc");
            fs::write(&cont, "continue\n")
                .with_context(|| format!("cannot write {}", cont.display()))?;
            let mut cmd = Command::new("bochs-bin");
            cmd.arg("-q").arg("-f").arg(&rc).arg("-rc").arg(&cont);
            // The term display needs a terminal description even when its screen goes to a file.
            cmd.env("TERM", "xterm");
            Ok(cmd)
        }
        Emulator::QemuTcgBios | Emulator::QemuTcgUefi | Emulator::QemuKvm => {
            let vars_copy = files.dir.join("OVMF_VARS.fd");
            let ovmf = if *emulator == Emulator::QemuTcgUefi {
                let ovmf = find_ovmf().context(
                    "no OVMF firmware found (install the Debian package ovmf): looked for \
                     /usr/share/ovmf/OVMF.fd and /usr/share/OVMF/OVMF_CODE.fd",
                )?;
                if let Ovmf::Split { vars, .. } = &ovmf {
                    fs::copy(vars, &vars_copy).with_context(|| {
                        format!("cannot copy the OVMF variables {}", vars.display())
                    })?;
                }
                Some(ovmf)
            } else {
                None
            };
            let mut cmd = Command::new("qemu-system-x86_64");
            cmd.args(qemu_args(emulator, cpus, files, ovmf.as_ref(), &vars_copy));
            Ok(cmd)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_iso_is_padded_to_whole_cylinders() {
        let dir = std::env::temp_dir().join(format!("hvprof-disk-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let iso = dir.join("x.iso");
        let cylinder = 16 * 63 * 512;
        for (len, want) in [
            (1, 1),
            (cylinder, 1),
            (cylinder + 1, 2),
            (5 * cylinder - 7, 5),
        ] {
            fs::write(&iso, vec![7u8; len as usize]).unwrap();
            assert_eq!(disk_cylinders(&iso).unwrap(), want, "{len} bytes");
            let bytes = fs::read(&iso).unwrap();
            assert_eq!(bytes.len() as u64, want * cylinder);
            assert!(bytes[..len as usize].iter().all(|&b| b == 7));
            assert!(bytes[len as usize..].iter().all(|&b| b == 0));
        }
        assert!(disk_cylinders(&dir.join("missing.iso")).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bochsrc_is_headless_and_deterministic() {
        let rc = |cpu_info| {
            bochsrc(&BochsConfig {
                model: "corei7_haswell_4770",
                cpus: 2,
                ips: BOCHS_IPS,
                iso: Path::new("/t/s/hvprof.iso"),
                iso_cylinders: 59,
                serial_log: Path::new("/t/s/serial.log"),
                lpt_log: Path::new("/t/s/lpt.log"),
                log: Path::new("/t/s/emulator.log"),
                cpu_info,
            })
        };
        let text = rc(true);
        let lines: Vec<&str> = text.lines().collect();
        for wanted in [
            "megs: 1024",
            "display_library: term",
            "cpu: model=corei7_haswell_4770, count=2, ips=4000000, reset_on_triple_fault=0, ignore_bad_msrs=1",
            "clock: sync=none, time0=1767225600",
            "ata0-master: type=disk, path=\"/t/s/hvprof.iso\", mode=flat, cylinders=59, heads=16, spt=63",
            "boot: disk",
            "com1: enabled=1, mode=file, dev=\"/t/s/serial.log\"",
            "parport1: enabled=1, file=\"/t/s/lpt.log\"",
            "port_e9_hack: enabled=1",
            "log: /t/s/emulator.log",
            "romimage: file=/usr/share/bochs/BIOS-bochs-latest, options=fastboot",
            "vgaromimage: file=/usr/share/vgabios/vgabios.bin",
        ] {
            assert!(lines.contains(&wanted), "missing {wanted:?} in:\n{text}");
        }
        assert!(!text.contains("realtime"));
        assert!(lines.contains(&"info: action=report"));
        let quiet = rc(false);
        assert!(
            quiet
                .lines()
                .any(|l| l == "info: action=report, cpu0=ignore, cpu1=ignore"),
            "{quiet}"
        );
    }

    #[test]
    fn bochs_paths_are_checked() {
        assert!(check_bochs_path(Path::new("/a/b.iso")).is_ok());
        assert!(check_bochs_path(Path::new("/a b/c.iso")).is_err());
        assert!(check_bochs_path(Path::new("/a,b/c.iso")).is_err());
    }

    const CPUINFO_VMX: &str = "processor\t: 0\nvendor_id\t: GenuineIntel\n\
        flags\t\t: fpu vme de pse tsc msr pae vmx smx est\nbugs\t\t: spectre_v1\n";
    const CPUINFO_NO_VMX: &str = "processor\t: 0\nvendor_id\t: GenuineIntel\n\
        flags\t\t: fpu vme de pse tsc msr pae hypervisor\nvmx flags\t: none\n";

    #[test]
    fn kvm_needs_both_the_device_and_the_flag() {
        assert_eq!(kvm_decision(CPUINFO_VMX, true), Ok(()));
        let err = kvm_decision(CPUINFO_NO_VMX, true).unwrap_err();
        assert!(err.contains("vmx"), "{err}");
        let err = kvm_decision(CPUINFO_VMX, false).unwrap_err();
        assert!(err.contains("/dev/kvm"), "{err}");
        assert!(kvm_decision(CPUINFO_NO_VMX, false).is_err());
        assert!(kvm_decision("", true).is_err());
        // "vmxe" or a "vmx flags" line is not the vmx flag.
        assert!(kvm_decision("flags\t: vmxe svm\n", true).is_err());
    }

    fn files() -> RunFiles {
        RunFiles::in_dir(
            Path::new("/t/s"),
            Path::new("/t/s/hvprof.iso"),
            &Emulator::QemuTcgBios,
        )
    }

    #[test]
    fn qemu_bios_args() {
        let args = qemu_args(&Emulator::QemuTcgBios, 2, &files(), None, Path::new("/v"));
        let joined = args.join(" ");
        assert_eq!(
            joined,
            "-m 1024 -cdrom /t/s/hvprof.iso -serial file:/t/s/serial.log \
             -parallel file:/t/s/lpt.log -device virtio-serial-pci,disable-legacy=on \
             -chardev file,id=hvprof-log,path=/t/s/virtio.log \
             -device virtconsole,chardev=hvprof-log -display none \
             -no-reboot -monitor none -smp 2 -accel tcg"
        );
    }

    #[test]
    fn qemu_uefi_and_kvm_args() {
        let combined = Ovmf::Combined("/usr/share/ovmf/OVMF.fd".into());
        let args = qemu_args(
            &Emulator::QemuTcgUefi,
            1,
            &files(),
            Some(&combined),
            Path::new("/v"),
        );
        assert!(
            args.join(" ")
                .ends_with("-accel tcg -bios /usr/share/ovmf/OVMF.fd")
        );
        let split = Ovmf::Split {
            code: "/c.fd".into(),
            vars: "/v.fd".into(),
        };
        let args = qemu_args(
            &Emulator::QemuTcgUefi,
            1,
            &files(),
            Some(&split),
            Path::new("/t/s/V.fd"),
        );
        let joined = args.join(" ");
        assert!(joined.contains("if=pflash,format=raw,unit=0,readonly=on,file=/c.fd"));
        assert!(joined.contains("if=pflash,format=raw,unit=1,file=/t/s/V.fd"));
        let args = qemu_args(&Emulator::QemuKvm, 2, &files(), None, Path::new("/v"));
        assert!(args.join(" ").ends_with("-accel kvm -cpu host,+vmx,pmu=on"));
    }

    #[test]
    fn budgets() {
        assert_eq!(Emulator::bochs("ryzen").default_budget().as_secs(), 60);
        assert_eq!(Emulator::QemuTcgBios.default_budget().as_secs(), 30);
        assert_eq!(Emulator::QemuTcgUefi.default_budget().as_secs(), 60);
    }
}
