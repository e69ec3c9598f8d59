//! `iso`, `run` and `demo`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use qemu_tests::emulator::{Emulator, RunFiles, kvm_vmx_available};
use qemu_tests::iso::{IsoModule, IsoSpec, build_iso};
use qemu_tests::process::{Launch, Limit, RunEnd, RunOutcome, launch};
use qemu_tests::runner::DEFAULT_END_MARKER;

use crate::build::build_hypervisor;
use crate::config::Plan;
use crate::tools::ensure_tools;
use crate::{EmulatorArg, IsoArgs, RunArgs, target_dir};

/// Parses `FILE` or `FILE=ARGS`.
fn parse_module(spec: &str) -> Result<IsoModule> {
    let (file, args) = spec.split_once('=').unwrap_or((spec, ""));
    let path = PathBuf::from(file);
    if !path.is_file() {
        bail!("module file {} does not exist", path.display());
    }
    IsoModule::with_args(path, args)
}

/// Builds the hypervisor and target/hvprof.iso; returns the ISO's path.
pub fn iso(args: &IsoArgs) -> Result<PathBuf> {
    let plan = load_config(args)?;
    make_iso(args, plan.as_ref())
}

/// The configuration `--config` names, validated and described on stderr.
fn load_config(args: &IsoArgs) -> Result<Option<Plan>> {
    let Some(file) = &args.config else {
        return Ok(None);
    };
    let plan = crate::config::load(file)?;
    eprintln!("{}", plan.describe());
    Ok(Some(plan))
}

/// Builds the hypervisor and the ISO from the flags, or from the configuration when there is one.
fn make_iso(args: &IsoArgs, plan: Option<&Plan>) -> Result<PathBuf> {
    let flag_modules = match plan {
        Some(_) => Vec::new(),
        None => args
            .modules
            .iter()
            .map(|m| parse_module(m))
            .collect::<Result<Vec<_>>>()?,
    };
    ensure_tools()?;
    let hypervisor = build_hypervisor(args.debug)?;
    let target = target_dir();
    // The images of a configuration are checked after the build, which makes the test guests.
    let (cmdline, modules) = match plan {
        Some(plan) => (
            plan.cmdline.as_str(),
            plan.iso_modules(&target.join("config-modules"))?,
        ),
        None => (args.cmdline.as_str(), flag_modules),
    };
    let iso = target.join("hvprof.iso");
    build_iso(
        &IsoSpec {
            hypervisor: &hypervisor,
            cmdline,
            modules: &modules,
        },
        &target.join("iso"),
        &iso,
    )?;
    Ok(iso)
}

/// The emulator `--emulator` names, or the best one here.
pub(crate) fn choose_emulator(arg: Option<EmulatorArg>, cpu_model: &str) -> Result<Emulator> {
    Ok(match arg {
        Some(EmulatorArg::Bochs) => Emulator::bochs(cpu_model),
        Some(EmulatorArg::QemuTcg) => Emulator::QemuTcgBios,
        Some(EmulatorArg::QemuUefi) => Emulator::QemuTcgUefi,
        Some(EmulatorArg::QemuKvm) => {
            if let Err(why) = kvm_vmx_available() {
                bail!("qemu-kvm cannot run a VMX guest here: {why}");
            }
            Emulator::QemuKvm
        }
        None => match kvm_vmx_available() {
            Ok(()) => Emulator::QemuKvm,
            Err(why) => {
                eprintln!("xtask: using Bochs: no nested VMX under KVM here ({why})");
                Emulator::bochs(cpu_model)
            }
        },
    })
}

/// Bochs at the realistic clock the Linux scenarios use when a module is a Linux kernel: its
/// timer tick and delays are set in time, and at Bochs' default 4 MHz a Debian kernel boots for
/// about 40 minutes of guest time (measured: a `hashload` run had not started its workload after
/// 800 s of wall time) with the tick taking a quarter of the machine.
fn with_linux_clock(emulator: Emulator, images: &[PathBuf]) -> Emulator {
    let linux = images
        .iter()
        .any(|p| std::fs::read(p).is_ok_and(|bytes| linux_guest::BzImage::parse(&bytes).is_ok()));
    if linux && matches!(emulator, Emulator::Bochs { .. }) {
        eprintln!(
            "xtask: a Linux kernel among the modules: Bochs runs at a {} MHz clock, as the Linux scenarios do",
            qemu_tests::emulator::BOCHS_IPS_REALISTIC / 1_000_000
        );
        emulator.with_ips(qemu_tests::emulator::BOCHS_IPS_REALISTIC)
    } else {
        emulator
    }
}

/// Builds, makes the ISO, boots it and streams the serial log.
fn boot(args: &RunArgs) -> Result<RunOutcome> {
    let plan = load_config(&args.iso)?;
    // A configuration sets the machine; `--emulator` still overrides its emulator.
    let (emulator, cpus, cpu_model) = match &plan {
        Some(plan) => (
            args.emulator.or(plan.emulator),
            plan.cpus.unwrap_or(1),
            plan.cpu_model.as_deref().unwrap_or(&args.cpu_model),
        ),
        None => (args.emulator, args.cpus, args.cpu_model.as_str()),
    };
    let images: Vec<PathBuf> = match &plan {
        Some(plan) => plan.modules.iter().map(|m| m.image.clone()).collect(),
        None => args
            .iso
            .modules
            .iter()
            .map(|m| PathBuf::from(m.split_once('=').map_or(m.as_str(), |(file, _)| file)))
            .collect(),
    };
    let emulator = with_linux_clock(choose_emulator(emulator, cpu_model)?, &images);
    let iso = make_iso(&args.iso, plan.as_ref())?;
    let dir = target_dir().join("run");
    let files = RunFiles::in_dir(&dir, &iso, &emulator);
    eprintln!(
        "xtask: booting {} on {} with {} CPU(s); serial log in {} (Ctrl-C stops)",
        iso.display(),
        emulator.label(),
        cpus,
        files.serial_log.display()
    );
    let mut live = crate::live::LiveEcho::new(std::io::stdout(), true);
    let outcome = launch(
        &Launch {
            emulator: &emulator,
            cpus,
            files: &files,
            end_marker: DEFAULT_END_MARKER,
            limit: args.timeout.map(|t| Limit {
                cpu: Duration::from_secs(t),
                wall: Duration::from_secs(t),
            }),
        },
        &mut |bytes| live.feed(bytes),
    )?;
    live.finish();
    // One file with everything the analyzer reads: the serial log, then what the parallel port
    // carried (`channel=lpt`).
    let capture = dir.join("capture.log");
    std::fs::write(
        &capture,
        files.capture().context("cannot read the capture")?,
    )
    .with_context(|| format!("cannot write {}", capture.display()))?;
    eprintln!(
        "xtask: {} after {:.1} s; the whole capture is in {} (emulator log: {})",
        outcome.end.describe(DEFAULT_END_MARKER),
        outcome.elapsed.as_secs_f64(),
        capture.display(),
        files.emulator_log.display()
    );
    Ok(outcome)
}

fn exit_code(end: &RunEnd) -> ExitCode {
    match end {
        RunEnd::Marker => ExitCode::SUCCESS,
        RunEnd::Interrupted => ExitCode::from(130),
        RunEnd::Exited(_) | RunEnd::TimedOut(_) => ExitCode::FAILURE,
    }
}

/// `cargo xtask run`.
pub fn run(args: &RunArgs) -> Result<ExitCode> {
    let outcome = boot(args)?;
    Ok(exit_code(&outcome.end))
}

/// `cargo xtask demo`: a run with the defaults, then the platform report.
pub fn demo() -> Result<ExitCode> {
    // The paper's Tables 12/13: three VMs (`mix`: functions with a known 80/20 instruction split)
    // sharing one pCPU, plus `busy` with a known exit mix; profiled at the default 1 ms period, the
    // log sent at the end.
    let hypervisor = crate::build::build_hypervisor(false)?;
    let analyzer = crate::build::build_analyzer()?;
    let guests = crate::build::guest_dir(&hypervisor);
    // Each VM's module needs its own file name in the ISO: copy the image per VM.
    let copies = target_dir().join("run").join("demo");
    std::fs::create_dir_all(&copies).context("cannot create target/run/demo")?;
    let module = |name: &str, args: &str| -> Result<String> {
        let vm = args
            .split_whitespace()
            .find_map(|w| w.strip_prefix("vm="))
            .unwrap_or(name);
        let copy = copies.join(format!("{vm}.elf"));
        std::fs::copy(guests.join(name), &copy)
            .with_context(|| format!("cannot copy the {name} guest"))?;
        Ok(format!("{}={args}", copy.display()))
    };
    let args = RunArgs {
        cpus: 1,
        cpu_model: qemu_tests::emulator::DEFAULT_BOCHS_MODEL.to_owned(),
        iso: IsoArgs {
            cmdline: "export=end".to_owned(),
            modules: vec![
                module("mix", "vm=guestOS1 mix=80,20 rounds=60")?,
                module("mix", "vm=guestOS2 mix=80,20 rounds=60")?,
                module("mix", "vm=guestOS3 mix=80,20 rounds=60")?,
                module("busy", "vm=busy cpuid=2000 io=500 vmcall=500")?,
            ],
            ..IsoArgs::default()
        },
        ..RunArgs::default()
    };
    // Each VM's exit statistics are in the console text shown during the run (and in the
    // report's tables below): not printed a second time.
    let outcome = boot(&args)?;
    println!();
    println!("== profile (hvprof-analyze report) ==");
    let mut cmd = std::process::Command::new(&analyzer);
    cmd.arg("report")
        .arg(target_dir().join("run").join("capture.log"))
        .arg("--hypervisor")
        .arg(&hypervisor)
        .args(["--top", "12"]);
    for g in ["mix", "busy"] {
        cmd.arg("--image").arg(guests.join(g));
    }
    let status = cmd.status().context("cannot run hvprof-analyze")?;
    if !status.success() {
        bail!("hvprof-analyze failed ({status})");
    }
    Ok(exit_code(&outcome.end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_specs() {
        let dir = std::env::temp_dir();
        let file = dir.join("xtask-module-spec-test.elf");
        std::fs::write(&file, b"x").unwrap();
        let m = parse_module(&format!("{}=vm=hello mem=16M", file.display())).unwrap();
        assert_eq!(m.cmdline, "xtask-module-spec-test.elf vm=hello mem=16M");
        let m = parse_module(&file.display().to_string()).unwrap();
        assert_eq!(m.cmdline, "xtask-module-spec-test.elf");
        assert!(parse_module("/no/such/file.elf=vm=x").is_err());
        let _ = std::fs::remove_file(&file);
    }

    #[test]
    fn a_linux_kernel_module_runs_bochs_at_the_realistic_clock() {
        use qemu_tests::emulator::{BOCHS_IPS, BOCHS_IPS_REALISTIC};
        let ips = |e: &Emulator| match e {
            Emulator::Bochs { ips, .. } => *ips,
            _ => 0,
        };
        let file = std::env::temp_dir().join("xtask-clock-test.elf");
        std::fs::write(&file, b"\x7fELF not a kernel").unwrap();
        let bochs = || Emulator::bochs("corei7_haswell_4770");
        assert_eq!(
            ips(&with_linux_clock(bochs(), std::slice::from_ref(&file))),
            BOCHS_IPS
        );
        assert_eq!(ips(&with_linux_clock(bochs(), &[])), BOCHS_IPS);
        let _ = std::fs::remove_file(&file);
        // The image's kernel, where `cargo xtask linux-image` has built it.
        let kernel = crate::target_dir().join("linux/bzImage");
        if !kernel.exists() {
            eprintln!("skipped the kernel case: no {}", kernel.display());
            return;
        }
        let with = with_linux_clock(bochs(), &[file, kernel.clone()]);
        assert_eq!(ips(&with), BOCHS_IPS_REALISTIC);
        // Other emulators keep their own clock.
        assert!(matches!(
            with_linux_clock(Emulator::QemuTcgBios, &[kernel]),
            Emulator::QemuTcgBios
        ));
    }
}
