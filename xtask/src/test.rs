//! `cargo xtask test`: every check CI runs, in order.

use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use qemu_tests::runner::{
    REFERENCE_BOCHS_SPEED, RunnerConfig, calibrate, default_jobs, run_scenarios, select,
};
use qemu_tests::scenarios;
use qemu_tests::smp_scenarios::{PLE_DIFF, check_ple_diff};

use crate::build::{TARGET, build_analyzer, build_hypervisor, cargo, ensure_rust_target};
use crate::target_dir;
use crate::tools::ensure_tools;

/// The bare-metal crates, linted for their own target.
const BARE_METAL_CRATES: &[&str] = &[
    "hvprof-hypervisor",
    "hvprof-boot",
    "hvprof-vmx",
    "hvprof-ept",
    "hvprof-pmu",
    "hvprof-guests",
];

#[derive(Default)]
struct Tally {
    passed: usize,
    failed: usize,
    skipped: usize,
}

impl Tally {
    fn stage(&mut self, name: &str, f: impl FnOnce() -> Result<()>) -> bool {
        println!("--- {name}");
        let start = Instant::now();
        match f() {
            Ok(()) => {
                println!("PASS stage {name} ({:.1} s)", start.elapsed().as_secs_f64());
                self.passed += 1;
                true
            }
            Err(e) => {
                println!("FAIL stage {name}: {e:#}");
                self.failed += 1;
                false
            }
        }
    }
}

/// Runs a cargo command from the workspace root; an error names it when it fails.
fn cargo_stage(args: &[&str]) -> Result<()> {
    let mut cmd: Command = cargo();
    cmd.args(args);
    let status = cmd
        .status()
        .with_context(|| format!("cannot run cargo {}", args.join(" ")))?;
    if status.success() {
        Ok(())
    } else {
        bail!("cargo {} failed ({status})", args.join(" "))
    }
}

/// fmt, clippy and the unit tests.
fn checks(tally: &mut Tally) {
    tally.stage("fmt", || cargo_stage(&["fmt", "--all", "--", "--check"]));
    // The host crates are the workspace's default members.
    tally.stage("clippy (host)", || {
        cargo_stage(&["clippy", "--all-targets", "--", "-D", "warnings"])
    });
    tally.stage("clippy (x86_64-unknown-none)", || {
        let mut args = vec!["clippy"];
        for krate in BARE_METAL_CRATES {
            args.extend(["-p", krate]);
        }
        args.extend(["--target", TARGET, "--", "-D", "warnings"]);
        cargo_stage(&args)
    });
    tally.stage("clippy (hypervisor logic on the host)", || {
        cargo_stage(&[
            "clippy",
            "-p",
            "hvprof-hypervisor",
            "--lib",
            "--tests",
            "--",
            "-D",
            "warnings",
        ])
    });
    tally.stage("unit tests", || cargo_stage(&["test"]));
    // The hypervisor crate is not a default member (its binary is bare metal); its library of
    // pure logic is tested on the host.
    tally.stage("unit tests (hypervisor logic)", || {
        cargo_stage(&[
            "test",
            "-p",
            "hvprof-hypervisor",
            "-p",
            "hvprof-guests",
            "--lib",
        ])
    });
}

/// What a whole run from a clean clone writes under target/ at its peak, rounded up: with
/// `.ci/run`'s settings (no incremental builds, line tables only in the test builds), and with
/// cargo's defaults. The builds, the Linux images, the scenarios' logs and captures, and the ISOs
/// of the scenarios running. Measured by sampling `du -sm target` through such runs (2.8 GB and
/// 5.2 GB on 2026-11-27; the README says so).
const CLEAN_RUN_DISK_MB: u64 = 3_500;
const CLEAN_RUN_DISK_MB_DEFAULTS: u64 = 6_000;

/// The space free for an unprivileged writer on the file system that holds `path`, in MiB.
fn free_disk_mb(path: &std::path::Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .with_context(|| format!("{} holds a NUL byte", path.display()))?;
    // SAFETY: `statvfs` is plain old data, for which all zeroes is a valid value.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is a NUL-terminated string alive for the call, and `stat` a valid,
    // writable `statvfs` the call fills in.
    let r = unsafe { libc::statvfs(c_path.as_ptr(), &mut stat) };
    if r != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("cannot read the free space of {}", path.display()));
    }
    let bytes = u128::from(stat.f_bavail) * u128::from(stat.f_frsize);
    Ok(u64::try_from(bytes >> 20).unwrap_or(u64::MAX))
}

/// Says how much disk the run has, and warns when a run from a clean clone might not fit: a full
/// disk fails scenarios with "No space left on device" midway, which this line explains first.
fn report_disk() {
    let target = target_dir();
    let mut probe = target.as_path();
    // target/ may not exist yet: its nearest existing folder is on the same file system.
    while !probe.exists() {
        match probe.parent() {
            Some(p) => probe = p,
            None => return,
        }
    }
    match free_disk_mb(probe) {
        Ok(free) if free < CLEAN_RUN_DISK_MB_DEFAULTS => println!(
            "warning: {free} MB free on the disk of {}; a run from a clean clone writes up to about {CLEAN_RUN_DISK_MB} MB there with .ci/run's settings, {CLEAN_RUN_DISK_MB_DEFAULTS} MB with cargo's defaults (less when it holds earlier builds): free some space if stages fail with \"No space left on device\"",
            target.display()
        ),
        Ok(free) => println!("disk: {free} MB free on the disk of {}", target.display()),
        Err(e) => println!("disk: {e:#}"),
    }
}

/// Whether `--filter` selects the kvm-unit-tests stage (named `kvm-unit-tests`).
fn kvm_unit_tests_selected(filter: Option<&str>) -> bool {
    filter.is_none_or(|f| "kvm-unit-tests".contains(f))
}

/// Whether `--filter` selects the check of `cargo xtask profile` (named `xtask-profile`).
fn profile_check_selected(filter: Option<&str>) -> bool {
    filter.is_none_or(|f| "xtask-profile".contains(f))
}

/// `cargo xtask test [--filter S] [--no-e2e | --e2e-only]`.
pub fn test(filter: Option<&str>, no_e2e: bool, e2e_only: bool) -> Result<ExitCode> {
    let mut tally = Tally::default();
    report_disk();
    // The bare-metal lint and build need the target; a fresh machine may lack it.
    ensure_rust_target()?;
    // Emulators, ISO tools, valgrind and Chromium (the HTML report's browser check among the
    // unit tests): installed first, so a fresh machine runs every test the first time.
    tally.stage("tools", ensure_tools);
    if !e2e_only {
        checks(&mut tally);
    }
    let mut hypervisor = None;
    tally.stage("build hypervisor", || {
        hypervisor = Some(build_hypervisor(false)?);
        Ok(())
    });
    let mut analyzer = None;
    tally.stage("build hvprof-analyze", || {
        analyzer = Some(build_analyzer()?);
        Ok(())
    });

    if !no_e2e
        && select(&scenarios::all(), filter)
            .iter()
            .any(|s| s.name.contains("linux"))
    {
        // The Linux scenarios' kernel, initramfs and ground truth, from Debian's packages
        // (downloaded once into target/linux/debs).
        tally.stage("linux guest images", || crate::linux::image(false));
        if !crate::linux::truth_is_current() {
            tally.stage("linux ground truth", crate::linux::truth);
        }
    }
    if !no_e2e {
        println!("--- end-to-end scenarios");
        let all = scenarios::all();
        if select(&all, filter).is_empty()
            && !profile_check_selected(filter)
            && !kvm_unit_tests_selected(filter)
        {
            println!(
                "FAIL e2e: no scenario name contains {:?}",
                filter.unwrap_or("")
            );
            tally.failed += 1;
        } else if let Some(hypervisor) = hypervisor {
            match ensure_tools() {
                Ok(()) => {
                    let mut config = RunnerConfig {
                        guest_dir: crate::build::guest_dir(&hypervisor),
                        hypervisor_elf: hypervisor,
                        analyzer: analyzer.clone(),
                        out_dir: target_dir().join("scenarios"),
                        filter: filter.map(str::to_owned),
                        jobs: default_jobs(),
                        slowdown: 1.0,
                    };
                    // Every scenario's emulator CPU budget is set for the reference machine; this
                    // machine's Bochs speed scales them.
                    match calibrate(&config) {
                        Ok(c) => {
                            config.slowdown = c.slowdown();
                            println!(
                                "calibration: Bochs ran {:.1} M instructions in {:.2} s of CPU time: {:.1} M/s (reference {:.1} M/s): budgets x{:.2}",
                                c.instructions as f64 / 1e6,
                                c.cpu.as_secs_f64(),
                                c.speed() / 1e6,
                                REFERENCE_BOCHS_SPEED / 1e6,
                                config.slowdown
                            );
                        }
                        Err(e) => {
                            config.slowdown = 3.0;
                            println!(
                                "calibration failed ({e:#}): budgets x{:.1}",
                                config.slowdown
                            );
                        }
                    }
                    let summary = run_scenarios(&all, &config);
                    // Checks across two scenarios' captures, once both passed.
                    let passed = |name: &str| {
                        summary.results.iter().any(|r| {
                            r.name == name && r.verdict == qemu_tests::runner::Verdict::Pass
                        })
                    };
                    if let Some(analyzer) = &analyzer
                        && PLE_DIFF.iter().all(|n| passed(n))
                    {
                        tally.stage("ple diff (hvprof-analyze diff, PLE off against on)", || {
                            let said = check_ple_diff(&config.out_dir, analyzer)
                                .map_err(|e| anyhow::anyhow!(e))?;
                            println!("largest change: {said}");
                            Ok(())
                        });
                    }
                    println!("{}", summary.closing_line());
                    tally.passed += summary.passed();
                    tally.failed += summary.failed();
                    tally.skipped += summary.skipped();
                }
                Err(e) => {
                    println!("FAIL e2e: {e:#}");
                    tally.failed += 1;
                }
            }
        } else {
            println!("e2e scenarios not run: the hypervisor did not build");
        }
    }

    // kvm-unit-tests' kernels under hvprof, against the recorded results, when the suite's
    // build is here.
    if !no_e2e && kvm_unit_tests_selected(filter) {
        let dir = crate::kvm_unit_tests::suite_dir(None);
        if dir.join("x86/unittests.cfg").is_file() {
            tally.stage(
                "kvm-unit-tests (under hvprof, against xtask/kvm-unit-tests.expected)",
                || crate::kvm_unit_tests::test_stage(&dir),
            );
        } else {
            println!(
                "--- kvm-unit-tests: not run: no build at {} (x86/unittests.cfg); KVM_UNIT_TESTS_DIR names another",
                dir.display()
            );
        }
    }

    // `cargo xtask profile` end to end: it boots its own runs (two at once), after the
    // scenarios.
    if !no_e2e && profile_check_selected(filter) {
        tally.stage(
            "xtask-profile (cargo xtask profile end to end)",
            crate::profile::check,
        );
    }

    println!(
        "total: {} passed, {} failed, {} skipped",
        tally.passed, tally.failed, tally.skipped
    );
    Ok(if tally.failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_disk_is_read_and_a_missing_path_is_an_error() {
        let here = std::env::current_dir().unwrap();
        let free = free_disk_mb(&here).unwrap();
        // The same file system, asked twice, gives about the same answer (other writers aside).
        let again = free_disk_mb(&here.join(".")).unwrap();
        assert!(free.abs_diff(again) < 1024, "{free} then {again} MB");
        let err = free_disk_mb(&here.join("no-such-folder-here")).unwrap_err();
        assert!(format!("{err:#}").contains("cannot read the free space"));
        assert!(free_disk_mb(std::path::Path::new("a\0b")).is_err());
    }
}
