//! `cargo xtask`: build the hypervisor, make its ISO, run it, test everything.

mod bench;
mod build;
mod config;
mod debs;
mod kvm_unit_tests;
mod linux;
mod live;
#[cfg(test)]
mod modgraph;
mod profile;
mod profile_debian;
mod profile_vpmu;
mod rules;
mod run;
mod spread;
mod test;
mod tools;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Build, run and test hvprof")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build the hypervisor for x86_64-unknown-none (release unless --debug).
    Build {
        /// Build the debug profile (slow in Bochs: it counts instructions).
        #[arg(long)]
        debug: bool,
    },
    /// Build the hypervisor and a bootable ISO (target/hvprof.iso).
    Iso(IsoArgs),
    /// Build, make the ISO, boot it and stream the serial log (kept in target/run/serial.log).
    Run(RunArgs),
    /// Run with the best emulator here and summarize the platform report.
    Demo,
    /// Profile one command in the Linux guest under hvprof, then print its report:
    /// `cargo xtask profile [OPTIONS] -- COMMAND [ARGS...]`.
    Profile(Box<profile::ProfileArgs>),
    /// fmt, clippy, unit tests, hypervisor build, end-to-end scenarios.
    Test {
        /// Run only the scenarios whose name contains this.
        #[arg(long)]
        filter: Option<String>,
        /// Skip the end-to-end scenarios.
        #[arg(long)]
        no_e2e: bool,
        /// Only the end-to-end scenarios (and the builds they need): no fmt, clippy or unit tests.
        #[arg(long, conflicts_with = "no_e2e")]
        e2e_only: bool,
    },
    /// Run the benchmarks and record their figures in docs/BENCHMARKS.md.
    Bench {
        /// Only the host-side benchmarks (decoder and analyzer throughput, beside `perf
        /// report`): no emulator.
        #[arg(long)]
        host_only: bool,
        /// Only the time from `cargo xtask profile` to its command, cold and warm.
        #[arg(long, conflicts_with = "host_only")]
        profile_only: bool,
    },
    /// kvm-unit-tests' x86 kernels as VMs under hvprof in Bochs, beside a QEMU TCG baseline:
    /// one table of each test's result, pass/fail/skip counts and time (docs/KVM-UNIT-TESTS.md).
    KvmUnitTests {
        /// The suite's build (default: KVM_UNIT_TESTS_DIR, else ../shared/kvm-unit-tests).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Only the tests whose name contains this (or one of these, comma-separated:
        /// `--filter tsc,xsave`).
        #[arg(long)]
        filter: Option<String>,
        /// Without the QEMU TCG baseline.
        #[arg(long)]
        no_baseline: bool,
        /// Write the results as the expected ones (xtask/kvm-unit-tests.expected), which
        /// `cargo xtask test` checks; with --filter or --quick, the tests run only.
        #[arg(long)]
        record: bool,
        /// Only the tests `cargo xtask test` runs: not the long runs, nor those recorded as
        /// slow.
        #[arg(long)]
        quick: bool,
    },
    /// Build the Linux guest under target/linux from Debian packages (docs/LINUX-GUESTS.md).
    LinuxImage {
        /// Download the packages again (the current versions) instead of using target/linux/debs.
        #[arg(long)]
        refresh: bool,
    },
    /// Native perf ground truth of the Linux workloads (target/linux/truth.json).
    LinuxTruth,
    /// Boot the Linux guest in QEMU TCG, without the hypervisor, and time it.
    LinuxQemu {
        /// The workload: w41, shor or shell.
        #[arg(long, default_value = "w41")]
        run: String,
        /// Its arguments, comma-separated (default: the workload's own).
        #[arg(long)]
        arg: Option<String>,
        /// Stop after this many seconds.
        #[arg(long, default_value_t = 300)]
        timeout: u64,
    },
    /// A CPU-bound workload over BYTES of code without symbols, on every core, for SECONDS:
    /// what `bench` records for `perf report` to read (see spread.rs).
    #[command(hide = true)]
    SpreadCode {
        #[arg(long)]
        bytes: usize,
        #[arg(long)]
        seconds: f64,
    },
}

#[derive(clap::Args, Clone, Debug, Default)]
struct IsoArgs {
    /// The hypervisor's command line.
    #[arg(long, default_value = "")]
    cmdline: String,
    /// A boot module: FILE, or FILE=ARGS (its command line becomes "<file name> ARGS").
    #[arg(long = "module", value_name = "FILE[=ARGS]")]
    modules: Vec<String>,
    /// A run configuration (TOML, e.g. configs/three-vms.toml): the hypervisor's boot options,
    /// the VMs and the emulated machine, instead of --cmdline, --module, --cpus and --cpu-model.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["cmdline", "modules"])]
    config: Option<PathBuf>,
    /// Use the debug build of the hypervisor.
    #[arg(long)]
    debug: bool,
}

#[derive(clap::Args, Clone, Debug, Default)]
struct RunArgs {
    #[command(flatten)]
    iso: IsoArgs,
    /// The emulator (default: qemu-kvm where nested VMX works, else bochs).
    #[arg(long, value_enum)]
    emulator: Option<EmulatorArg>,
    /// Number of CPUs.
    #[arg(long, default_value_t = 1, conflicts_with = "config")]
    cpus: u32,
    /// The Bochs CPU model.
    #[arg(long, default_value = qemu_tests::emulator::DEFAULT_BOCHS_MODEL, conflicts_with = "config")]
    cpu_model: String,
    /// Stop after this many seconds (default: no limit).
    #[arg(long)]
    timeout: Option<u64>,
}

/// The emulators, as `--emulator` and the configuration files' `emulator` name them.
#[derive(ValueEnum, serde::Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
enum EmulatorArg {
    Bochs,
    QemuKvm,
    QemuTcg,
    QemuUefi,
}

/// The workspace root (xtask lives one level below it).
fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

/// Cargo's target folder (CARGO_TARGET_DIR when set).
fn target_dir() -> PathBuf {
    let root = workspace_root();
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => root.join(dir),
        None => root.join("target"),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result: Result<ExitCode> = match cli.command {
        Cmd::Build { debug } => build::build_hypervisor(debug).map(|path| {
            println!("{}", path.display());
            ExitCode::SUCCESS
        }),
        Cmd::Iso(args) => run::iso(&args).map(|path| {
            println!("{}", path.display());
            ExitCode::SUCCESS
        }),
        Cmd::Run(args) => run::run(&args),
        Cmd::Demo => run::demo(),
        Cmd::Profile(args) => profile::profile(&args),
        Cmd::Test {
            filter,
            no_e2e,
            e2e_only,
        } => test::test(filter.as_deref(), no_e2e, e2e_only),
        Cmd::Bench {
            host_only,
            profile_only,
        } => bench::bench(host_only, profile_only),
        Cmd::KvmUnitTests {
            dir,
            filter,
            no_baseline,
            record,
            quick,
        } => kvm_unit_tests::kvm_unit_tests(
            dir.as_deref(),
            filter.as_deref(),
            !no_baseline,
            record,
            quick,
        ),
        Cmd::LinuxImage { refresh } => linux::image(refresh).map(|()| ExitCode::SUCCESS),
        Cmd::LinuxTruth => linux::truth().map(|()| ExitCode::SUCCESS),
        Cmd::LinuxQemu { run, arg, timeout } => linux::qemu(&run, arg.as_deref(), timeout),
        Cmd::SpreadCode { bytes, seconds } => {
            spread::spread_code(bytes, seconds).map(|()| ExitCode::SUCCESS)
        }
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
