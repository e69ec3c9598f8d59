//! Run configuration files: `cargo xtask run --config FILE` and `cargo xtask iso --config FILE`.
//!
//! A TOML file describes one machine: the hypervisor's boot options, the emulated machine and the
//! VMs. xtask turns it into the hypervisor's command line and the boot modules of each VM
//! (`configs/three-vms.toml`, `configs/two-pcpus.toml` and `configs/linux-smp.toml` are
//! examples):
//!
//! ```toml
//! [hypervisor]                 # optional table; every key optional
//! period = "1ms"               # boot option period=: <n>ns, <n>us, <n>ms or <n>ticks
//! slice = "10ms"               # boot option slice= (scheduler time slice), same syntax
//! export = "end"               # boot option export=: "stream" or "end"
//! buffer = 100000              # boot option buffer=: records kept for export=end, or "auto"
//! channel = "lpt"              # boot option channel=: "serial", "lpt" or "virtio"
//! stacks = 16                  # boot option stacks=: call-chain depth 1 to 32, "on" or "off"
//! emulator = "bochs"           # bochs | qemu-kvm | qemu-tcg | qemu-uefi (default: the best here)
//! cpus = 1                     # pCPUs of the emulated machine, 1 to 64 (default 1)
//! cpu_model = "corei7_haswell_4770"  # the Bochs CPU model (Bochs only)
//!
//! [[vm]]                       # one table per VM, at least one; module order = table order
//! name = "guestOS1"            # vm=: 1-32 characters of [A-Za-z0-9_.-], unique
//! image = "target/x86_64-unknown-none/release/mix"   # the guest image (see below)
//! memory = "16M"               # mem=: K/M/G suffix, multiple of 2 MiB, 4 MiB to 4 GiB (default 16M)
//! vcpus = 1                    # vcpus=: 1 to 8 (default 1)
//! pin = [0]                    # optional pin=0,1: the pCPU of each vCPU (one per vCPU, < cpus)
//! format = "elf64"             # optional format=: "elf64" or "real16"
//! budget = 2000000000          # optional budget=: TSC ticks the VM may run
//! vpmu = "cpu"                 # optional vpmu=: "off", "cpu" or "domain" (a virtual PMU)
//! args = "mix=80,20 rounds=60" # optional: more arguments, passed to the guest as they are
//!
//! [[vm]]                       # a Linux VM: kernel instead of image (exactly one of the two)
//! name = "linux"
//! kernel = "target/linux/bzImage"           # a bzImage, booted by the Linux boot protocol
//! initrd = "target/linux/initramfs.cpio"    # optional initrd=: its initrd (or initramfs)
//! vmlinux = "target/linux/vmlinux"          # optional: derive task-offsets=, mm-layout=,
//!                                           #   module-layout=, orc-layout= from it
//! unwind = ["target/linux/bin/shor"]        # optional unwind=: 1 to 4 static programs whose
//!                                           #   .eh_frame become unwind tables (stacks=)
//! memory = "256M"              # required for a Linux VM (16M is too little for a kernel)
//! vcpus = 2                    # more than one needs apic = true
//! pin = [0, 1]
//! apic = true                  # optional apic=on: local APICs and ACPI tables (default false)
//! budget = 100000000000
//! cmdline = "console=ttyS0 quiet hvprof.run=w41"   # the kernel's command line
//! ```
//!
//! The hypervisor's command line holds the boot options given, in the order period, slice,
//! export, buffer, channel, stacks (`period=1ms slice=10ms export=end buffer=100000`); the
//! emulator keys only choose how `run` boots (`--emulator` on the command line overrides
//! `emulator`; `--cpus`, `--cpu-model`, `--cmdline` and `--module` cannot be combined with
//! `--config`).
//!
//! Each VM becomes the module `<file> vm=<name> mem=<memory> vcpus=<n> [pin=a,b]
//! [format=...] [budget=...] [<args>]`, where `<file>` is the image's file name inside the ISO.
//! The image's file name is kept unless two modules' files have the same file name (the ISO holds
//! each file once under its own name) or the name is not plain `[A-Za-z0-9_.,+-]`: then the image
//! is copied to `target/config-modules/<name>.elf` (`<name>.bin` for `real16`). The analyzer
//! matches guest images by build id, so a copied image still finds its symbols.
//!
//! **Linux VMs.** A VM with `kernel` becomes the module `<kernel file> vm=<name> mem=<memory>
//! vcpus=<n> [pin=a,b] [budget=...] [initrd=<initrd file>] [apic=on] [unwind=<table>,...]
//! [task-offsets=... mm-layout=... module-layout=... orc-layout=...] [<cmdline>] [<args>]`, as
//! the Linux scenarios write it (`qemu-tests/src/linux_scenarios.rs`), followed by the initrd's
//! module and the unwind tables' modules, each with its file name alone as its command line. The
//! hypervisor passes every word that is not one of its keys to the kernel, so `cmdline` must not
//! hold a hypervisor key (`vm=`, `initrd=`, `apic=`, `wall-budget=`, ...: the error names the
//! field that sets it); `args` is for the keys without a field (`wall-budget=`, `target=`), and
//! its other words reach the kernel's command line too. With `vmlinux` the kernel's keys are
//! derived when the file is loaded (`linux_guest::KernelImage::module_keys`, which the scenarios
//! use too), so samples name the guest's processes, files, kernel modules and kernel call chains;
//! a layout the kernel does not allow is left out with a warning. The unwind tables are made
//! from the programs when the ISO is (`linux_guest::unwind::unwind_table`, as
//! `hvprof-analyze unwind-table` does). Inside the ISO, a shared or unusual kernel file name
//! becomes `<name>.bzImage`, an initrd's `<name>.initrd` and `unwind[k]`'s table, normally
//! `<program>.unwind`, `<name>.<k>.unwind`. Refused: `initrd`, `cmdline`, `apic`, `vmlinux` or
//! `unwind` on a VM with `image`; `format` on a VM with `kernel` (and `format = "linux"`: give a
//! `kernel`); a Linux VM without `memory`, or with more than one vCPU without `apic = true` (the
//! kernel starts its other CPUs through their local APICs); `acpi=off` or `nolapic` in the
//! `cmdline` of a VM with `apic = true`. Without `apic = true` the VM has the 8259 pair and the
//! PIT only: a `cmdline` without `acpi=off nolapic` gets a warning.
//!
//! **Paths.** An absolute path (image, kernel, initrd, vmlinux, unwind program) is taken as it
//! is; a path starting with `target/` is in cargo's target folder (`<workspace>/target`, or
//! `CARGO_TARGET_DIR` when set), where the test guests and the Linux image are built; any other
//! path is relative to the folder of the configuration file. The files must exist when the ISO is
//! made (after the build, so freshly built guests count), the vmlinux when the file is loaded; a
//! missing file of the Linux image is reported with the command that makes it (`cargo xtask
//! linux-image`). A `kernel` must be a bzImage, and an `image` must not be one.
//!
//! **Validation.** Unknown keys and wrong types are refused with the line and column. Every
//! value is checked with the parsers the hypervisor itself uses (`hvprof_boot::cmdline::parse`
//! for the boot options, `hvprof_hypervisor::vm_config::parse` for the modules), and the final
//! command lines are parsed once more by them, so the file and the hypervisor cannot disagree. A
//! VM's `args` must not set a key the configuration sets (`vm=`, `mem=`, `vcpus=`, `pin=`,
//! `format=`, `budget=`, `initrd=`, `apic=`, `unwind=`, and `task-offsets=`, `mm-layout=`,
//! `module-layout=`, `orc-layout=`, which `vmlinux` sets). Every problem is reported on one line
//! naming the file, the field and the value: `configs/x.toml: vm[1].memory = "3M": must be a
//! multiple of 2 MiB between 4 MiB and 4 GiB`.

use std::fmt::{self, Display};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use hvprof_boot::cmdline::{self as boot_cmdline, CmdlineError, ValueProblem};
use hvprof_hypervisor::vm_config::{
    self, ConfigError, MEM_DEFAULT, MEM_MAX, MEM_MIN, NAME_MAX, UNWIND_MAX, VCPUS_MAX,
};
use qemu_tests::iso::IsoModule;
use serde::Deserialize;

use crate::EmulatorArg;

/// The most pCPUs the hypervisor uses (its ACPI table of CPUs, `hypervisor/src/bin/hvprof/acpi.rs`).
pub const CPUS_MAX: u32 = 64;

/// Module arguments the configuration sets itself, with the field that sets each.
const RESERVED_ARGS: [(&str, &str); 14] = [
    ("vm", "name"),
    ("mem", "memory"),
    ("vcpus", "vcpus"),
    ("pin", "pin"),
    ("format", "format"),
    ("budget", "budget"),
    ("initrd", "initrd"),
    ("apic", "apic"),
    ("vpmu", "vpmu"),
    ("unwind", "unwind"),
    ("task-offsets", "vmlinux"),
    ("mm-layout", "vmlinux"),
    ("module-layout", "vmlinux"),
    ("orc-layout", "vmlinux"),
];

/// The kernel command-line words that turn off what `apic = true` gives a Linux VM.
const NO_APIC_WORDS: [&str; 2] = ["acpi=off", "nolapic"];

/// The file as written.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    #[serde(default)]
    hypervisor: HypervisorTable,
    #[serde(default)]
    vm: Vec<VmTable>,
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct HypervisorTable {
    period: Option<String>,
    slice: Option<String>,
    export: Option<String>,
    /// A number of records or `"auto"`.
    buffer: Option<toml::Value>,
    channel: Option<String>,
    /// A depth or `"on"`/`"off"`.
    stacks: Option<toml::Value>,
    emulator: Option<EmulatorArg>,
    cpus: Option<i64>,
    cpu_model: Option<String>,
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct VmTable {
    name: String,
    image: Option<String>,
    kernel: Option<String>,
    initrd: Option<String>,
    cmdline: Option<String>,
    apic: Option<bool>,
    vmlinux: Option<String>,
    unwind: Option<Vec<String>>,
    memory: Option<String>,
    vcpus: Option<i64>,
    pin: Option<Vec<i64>>,
    format: Option<String>,
    budget: Option<i64>,
    vpmu: Option<String>,
    args: Option<String>,
}

/// A validated configuration: what to put on the ISO and how to boot it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The configuration file (for messages).
    pub file: PathBuf,
    /// The hypervisor's command line.
    pub cmdline: String,
    /// The VMs' boot modules, one per VM (with a Linux VM's initrd and unwind tables), in the
    /// file's order.
    pub modules: Vec<PlannedModule>,
    pub emulator: Option<EmulatorArg>,
    pub cpus: Option<u32>,
    pub cpu_model: Option<String>,
    /// What the configuration allows but may not mean, one line each (shown by `describe`).
    pub warnings: Vec<String>,
    /// Cargo's target folder, where `cargo xtask linux-image` puts the Linux image.
    target: PathBuf,
}

/// One VM's boot module, and the modules only it reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedModule {
    /// `vm[i].image` or `vm[i].kernel`, for messages.
    pub field: String,
    /// The image or kernel file on this machine.
    pub image: PathBuf,
    /// Whether `image` is a Linux kernel (`vm[i].kernel`).
    pub linux: bool,
    /// The module's file name inside the ISO (the first word of `cmdline`).
    pub iso_name: String,
    /// The module's command line.
    pub cmdline: String,
    /// A Linux VM's initrd, then its unwind tables (the modules `initrd=` and `unwind=` name).
    pub data: Vec<DataModule>,
    /// `vm[i].vmlinux`: the kernel's keys are derived from it ([`Plan::derive_kernel_keys`]).
    pub vmlinux: Option<PathBuf>,
    /// The command line's words after the file name: the keys of the fields,
    keys: Vec<String>,
    /// `apic=on`,
    apic: bool,
    /// the kernel's keys derived from `vmlinux`,
    derived: Vec<String>,
    /// and the guest's words (`cmdline`, then `args`).
    guest: String,
}

/// A boot module a Linux VM reads (its initrd, an unwind table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataModule {
    /// `vm[i].initrd` or `vm[i].unwind[k]`, for messages.
    pub field: String,
    /// The file on this machine: the initrd, or the program whose unwind table the module is.
    pub source: PathBuf,
    /// Whether the module is `source`'s unwind table (made when the ISO is) rather than `source`.
    pub unwind_table: bool,
    /// Its file name inside the ISO (its whole command line).
    pub iso_name: String,
}

impl PlannedModule {
    /// Writes `cmdline` from the parts and the modules' names.
    fn compose(&mut self) {
        let mut words = vec![self.iso_name.clone()];
        words.extend(self.keys.iter().cloned());
        let (initrd, unwind): (Vec<&DataModule>, Vec<&DataModule>) =
            self.data.iter().partition(|d| !d.unwind_table);
        if let Some(d) = initrd.first() {
            words.push(format!("initrd={}", d.iso_name));
        }
        if self.apic {
            words.push("apic=on".to_owned());
        }
        if !unwind.is_empty() {
            let names: Vec<&str> = unwind.iter().map(|d| d.iso_name.as_str()).collect();
            words.push(format!("unwind={}", names.join(",")));
        }
        words.extend(self.derived.iter().cloned());
        if !self.guest.is_empty() {
            words.push(self.guest.clone());
        }
        self.cmdline = words.join(" ");
    }
}

/// Reads and validates a configuration file, and derives its Linux kernels' keys from their
/// `vmlinux` (the images' existence is checked by [`Plan::iso_modules`], after the build).
pub fn load(file: &Path) -> Result<Plan> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read the configuration {}", file.display()))?;
    let dir = file.parent().unwrap_or(Path::new(""));
    let mut plan = parse(&text, file, dir, &crate::target_dir())?;
    plan.derive_kernel_keys()?;
    Ok(plan)
}

/// Collects the problems of one file, each on a line of its own.
struct Problems<'a> {
    file: &'a Path,
    lines: Vec<String>,
}

impl Problems<'_> {
    /// `<file>: <field> = <value>: <problem>`.
    fn value(&mut self, field: &str, value: impl Display, problem: impl Display) {
        self.lines.push(format!(
            "{}: {field} = {value}: {problem}",
            self.file.display()
        ));
    }

    /// `<file>: <field>: <problem>`.
    fn field(&mut self, field: &str, problem: impl Display) {
        self.lines
            .push(format!("{}: {field}: {problem}", self.file.display()));
    }
}

/// A string as TOML writes it (for the basic strings of these files, as Rust's `{:?}`).
struct Quoted<'a>(&'a str);

impl Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

/// An array of integers as TOML writes it.
struct Array<'a>(&'a [i64]);

impl Display for Array<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let items: Vec<String> = self.0.iter().map(i64::to_string).collect();
        write!(f, "[{}]", items.join(", "))
    }
}

/// An array of strings as TOML writes it.
struct Strings<'a>(&'a [String]);

impl Display for Strings<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let items: Vec<String> = self.0.iter().map(|s| format!("{:?}", s)).collect();
        write!(f, "[{}]", items.join(", "))
    }
}

/// Parses and validates the text of configuration `file`; relative image paths are resolved
/// against `dir` (the file's folder) and `target` (cargo's target folder, for `target/...`).
pub fn parse(text: &str, file: &Path, dir: &Path, target: &Path) -> Result<Plan> {
    let config: ConfigFile = toml::from_str(text).map_err(|e| toml_error(file, text, &e))?;
    let mut problems = Problems {
        file,
        lines: Vec::new(),
    };
    let hv = &config.hypervisor;

    // The hypervisor's command line, each value checked by the boot parser.
    // A number or a string, as the boot option's text.
    let mut number_or_word = |key: &str, value: &Option<toml::Value>, expected: &str| {
        value.as_ref().and_then(|v| match v {
            toml::Value::Integer(n) => Some(n.to_string()),
            toml::Value::String(s) => Some(s.clone()),
            other => {
                problems.value(&format!("hypervisor.{key}"), other, expected);
                None
            }
        })
    };
    let buffer = number_or_word(
        "buffer",
        &hv.buffer,
        "expected a positive number of records or \"auto\"",
    );
    let stacks = number_or_word(
        "stacks",
        &hv.stacks,
        "expected \"off\", \"on\" or a depth from 1 to 32",
    );
    let options = [
        ("period", hv.period.clone()),
        ("slice", hv.slice.clone()),
        ("export", hv.export.clone()),
        ("buffer", buffer),
        ("channel", hv.channel.clone()),
        ("stacks", stacks),
    ];
    let mut tokens = Vec::new();
    for (key, value) in options {
        let Some(value) = value else { continue };
        let shown: &dyn Display = match (key, &hv.buffer, &hv.stacks) {
            ("buffer", Some(raw), _) | ("stacks", _, Some(raw)) => raw,
            _ => &Quoted(&value),
        };
        match check_boot_option(key, &value) {
            Ok(()) => tokens.push(format!("{key}={value}")),
            Err(problem) => problems.value(&format!("hypervisor.{key}"), shown, problem),
        }
    }
    let cmdline = tokens.join(" ");
    if problems.lines.is_empty()
        && let Err(e) = boot_cmdline::parse(&cmdline)
    {
        problems.field(
            "hypervisor",
            format!("the hypervisor refuses its command line {cmdline:?}: {e}"),
        );
    }

    let cpus = match hv.cpus {
        None => None,
        Some(n) => match u32::try_from(n).ok().filter(|n| (1..=CPUS_MAX).contains(n)) {
            Some(n) => Some(n),
            None => {
                problems.value(
                    "hypervisor.cpus",
                    n,
                    format!("expected a number of pCPUs from 1 to {CPUS_MAX}"),
                );
                None
            }
        },
    };
    if let Some(model) = &hv.cpu_model {
        if model.is_empty() || model.chars().any(char::is_whitespace) {
            problems.value(
                "hypervisor.cpu_model",
                Quoted(model),
                "expected a Bochs CPU model name such as \"corei7_haswell_4770\"",
            );
        } else if let Some(other) = hv.emulator.filter(|e| *e != EmulatorArg::Bochs) {
            problems.value(
                "hypervisor.cpu_model",
                Quoted(model),
                format!(
                    "only Bochs has CPU models, and hypervisor.emulator = {:?}",
                    emulator_name(other)
                ),
            );
        }
    }

    // The VMs.
    if config.vm.is_empty() {
        problems.field(
            "vm",
            "no [[vm]] table: a configuration needs at least one VM",
        );
    }
    let machine_cpus = cpus.unwrap_or(1);
    let mut modules = Vec::new();
    let mut warnings = Vec::new();
    for (i, vm) in config.vm.iter().enumerate() {
        if let Some(module) = plan_vm(
            i,
            vm,
            machine_cpus,
            hv.cpus.is_some(),
            dir,
            target,
            &mut problems,
            &mut warnings,
        ) {
            modules.push(module);
        }
    }
    for (i, vm) in config.vm.iter().enumerate() {
        if let Some(j) = config.vm[..i].iter().position(|o| o.name == vm.name) {
            problems.field(
                &format!("vm[{i}].name"),
                format_args!("duplicate VM name {:?} (vm[{j}].name)", vm.name),
            );
        }
    }
    if problems.lines.is_empty() {
        name_iso_files(&config.vm, &mut modules, &mut problems);
    }
    if problems.lines.is_empty() {
        for (i, (vm, module)) in config.vm.iter().zip(modules.iter_mut()).enumerate() {
            module.compose();
            check_module_line(
                &format!("vm[{i}].args"),
                vm.args.as_deref().unwrap_or("").trim(),
                &module.cmdline,
                &mut problems,
            );
        }
    }
    if !problems.lines.is_empty() {
        bail!("{}", problems.lines.join("\n"));
    }
    Ok(Plan {
        file: file.to_path_buf(),
        cmdline,
        modules,
        emulator: hv.emulator,
        cpus,
        cpu_model: hv.cpu_model.clone(),
        warnings,
        target: target.to_path_buf(),
    })
}

/// Checks one boot option with the hypervisor's parser.
fn check_boot_option(key: &str, value: &str) -> Result<(), String> {
    let syntax = match key {
        "period" | "slice" => ValueProblem::PeriodSyntax,
        "export" => ValueProblem::ExportChoice,
        "channel" => ValueProblem::ChannelChoice,
        "stacks" => ValueProblem::StacksChoice,
        _ => ValueProblem::BufferSyntax,
    };
    if value.chars().any(char::is_whitespace) {
        return Err(describe(syntax));
    }
    let token = format!("{key}={value}");
    match boot_cmdline::parse(&token) {
        Ok(_) => Ok(()),
        Err(CmdlineError::EmptyValue { .. }) => Err(format!("{}, not empty", describe(syntax))),
        Err(CmdlineError::BadValue { problem, .. }) => Err(describe(problem)),
        Err(e) => Err(e.to_string()),
    }
}

/// A boot option's problem in the words of the configuration file.
fn describe(problem: ValueProblem) -> String {
    match problem {
        ValueProblem::PeriodSyntax => "expected <n>ns, <n>us, <n>ms or <n>ticks".into(),
        ValueProblem::PeriodZero => "must be greater than zero".into(),
        ValueProblem::PeriodTooLarge => {
            "too large: must fit in 64 bits of nanoseconds or ticks".into()
        }
        ValueProblem::ExportChoice => "expected \"stream\" or \"end\"".into(),
        ValueProblem::BufferSyntax => {
            "expected a positive number of records below 2^32, or \"auto\"".into()
        }
        ValueProblem::ChannelChoice => "expected \"serial\", \"lpt\" or \"virtio\"".into(),
        ValueProblem::StacksChoice => {
            "expected \"off\", \"on\" (16 frames) or a depth from 1 to 32".into()
        }
        other => other.to_string(),
    }
}

/// The name `--emulator` and the file use for an emulator.
fn emulator_name(e: EmulatorArg) -> &'static str {
    match e {
        EmulatorArg::Bochs => "bochs",
        EmulatorArg::QemuKvm => "qemu-kvm",
        EmulatorArg::QemuTcg => "qemu-tcg",
        EmulatorArg::QemuUefi => "qemu-uefi",
    }
}

/// A module value's problem, in the words of the configuration file.
fn vm_problem(e: &ConfigError<'_>) -> String {
    match e {
        ConfigError::BadName(_) => {
            format!("a VM name is 1-{NAME_MAX} characters of [A-Za-z0-9_.-]")
        }
        ConfigError::BadMem(_) => "expected a size with a K, M or G suffix, e.g. \"16M\"".into(),
        ConfigError::MemRange(_) => format!(
            "must be a multiple of 2 MiB between {} MiB and {} GiB",
            MEM_MIN >> 20,
            MEM_MAX >> 30
        ),
        ConfigError::BadBudget(_) => "expected a positive number of TSC ticks".into(),
        ConfigError::BadFormat(_) => "expected \"elf64\" or \"real16\"".into(),
        ConfigError::BadVcpus(_) => format!("expected a number of vCPUs from 1 to {VCPUS_MAX}"),
        other => other.to_string(),
    }
}

/// Checks one module argument (`key=value`) with the hypervisor's parser, alone on a module
/// command line; a value with whitespace gets the error of a malformed value.
fn check_vm_value<'a>(
    key: &str,
    value: &'a str,
    malformed: fn(&'a str) -> ConfigError<'a>,
) -> Result<(), String> {
    if value.chars().any(char::is_whitespace) {
        return Err(vm_problem(&malformed(value)));
    }
    let line = format!("image {key}={value}");
    vm_config::parse(&line)
        .map(|_| ())
        .map_err(|e| vm_problem(&e))
}

/// The field of a VM that sets hypervisor key `key`, or where to give it.
fn field_of_key(key: &str) -> &'static str {
    if key == "format" {
        // A Linux VM's format is its `kernel`.
        return "kernel";
    }
    RESERVED_ARGS
        .iter()
        .find(|(k, _)| *k == key)
        .map_or("args", |(_, field)| field)
}

/// One line of text: no line breaks or control characters.
fn one_line(text: &str) -> bool {
    !text
        .chars()
        .any(|c| c.is_control() && c != ' ' && c != '\t')
}

/// Validates one `[[vm]]` and makes its modules (with the files' own names for now; the command
/// line is written once every module has its name).
#[allow(clippy::too_many_arguments)]
fn plan_vm(
    i: usize,
    vm: &VmTable,
    machine_cpus: u32,
    cpus_given: bool,
    dir: &Path,
    target: &Path,
    problems: &mut Problems<'_>,
    warnings: &mut Vec<String>,
) -> Option<PlannedModule> {
    let before = problems.lines.len();
    let field = |name: &str| format!("vm[{i}].{name}");

    // An image or a Linux kernel, and what only a Linux VM has.
    let (image_field, image_path) = match (&vm.image, &vm.kernel) {
        (Some(image), None) => ("image", image.as_str()),
        (None, Some(kernel)) => ("kernel", kernel.as_str()),
        (Some(image), Some(kernel)) => {
            problems.value(
                &field("kernel"),
                Quoted(kernel),
                format!(
                    "and image = {:?} are both set: a VM boots a guest image or a Linux kernel, \
                     give one of them",
                    image
                ),
            );
            ("image", image.as_str())
        }
        (None, None) => {
            problems.field(
                &format!("vm[{i}]"),
                "no image or kernel: give the guest image (image = \"...\") or a Linux kernel \
                 (kernel = \"...\")",
            );
            ("image", "")
        }
    };
    let linux = image_field == "kernel";
    if vm.image.is_some() && vm.kernel.is_none() {
        let image = Quoted(image_path);
        let mut only_linux = |name: &str, value: &dyn Display| {
            problems.value(
                &field(name),
                value,
                format_args!(
                    "only a Linux VM takes {name}: this VM boots image = {image}; give a \
                     Linux kernel with kernel = \"...\" instead"
                ),
            );
        };
        if let Some(v) = &vm.initrd {
            only_linux("initrd", &Quoted(v));
        }
        if let Some(v) = &vm.cmdline {
            only_linux("cmdline", &Quoted(v));
        }
        if let Some(v) = &vm.apic {
            only_linux("apic", v);
        }
        if let Some(v) = &vm.vmlinux {
            only_linux("vmlinux", &Quoted(v));
        }
        if let Some(v) = &vm.unwind {
            only_linux("unwind", &Strings(v));
        }
    }

    if let Err(p) = check_vm_value("vm", &vm.name, ConfigError::BadName) {
        problems.value(&field("name"), Quoted(&vm.name), p);
    }
    if linux && vm.memory.is_none() {
        problems.field(
            &field("memory"),
            format!(
                "a Linux VM needs its memory given ({}M, the default for guest images, is too \
                 little for a kernel; the test image boots in \"256M\")",
                MEM_DEFAULT >> 20
            ),
        );
    }
    let memory = vm
        .memory
        .clone()
        .unwrap_or_else(|| format!("{}M", MEM_DEFAULT >> 20));
    if let Err(p) = check_vm_value("mem", &memory, ConfigError::BadMem) {
        problems.value(&field("memory"), Quoted(&memory), p);
    }
    let vcpus = vm.vcpus.unwrap_or(1);
    let vcpus_ok = match check_vm_value("vcpus", &vcpus.to_string(), ConfigError::BadVcpus) {
        Ok(()) => true,
        Err(p) => {
            problems.value(&field("vcpus"), vcpus, p);
            false
        }
    };
    let apic = vm.apic.unwrap_or(false);
    if linux && vcpus_ok && vcpus > 1 && !apic {
        problems.value(
            &field("vcpus"),
            vcpus,
            "a Linux VM starts its other vCPUs through their local APICs: set apic = true",
        );
    }
    if let Some(pin) = &vm.pin {
        if vcpus_ok && i64::try_from(pin.len()).ok() != Some(vcpus) {
            problems.value(
                &field("pin"),
                Array(pin),
                format!(
                    "has {} entr{} but vcpus = {vcpus}: give one pCPU per vCPU",
                    pin.len(),
                    if pin.len() == 1 { "y" } else { "ies" }
                ),
            );
        }
        if let Some(bad) = pin
            .iter()
            .find(|&&p| u32::try_from(p).map_or(true, |p| p >= machine_cpus))
        {
            problems.value(
                &field("pin"),
                Array(pin),
                format!(
                    "pCPU {bad} does not exist: the machine has hypervisor.cpus = {machine_cpus}{} \
                     (pCPUs 0 to {})",
                    if cpus_given { "" } else { " (the default)" },
                    machine_cpus.saturating_sub(1)
                ),
            );
        }
    }
    let format = match &vm.format {
        None => None,
        Some(f) if linux => {
            problems.value(
                &field("format"),
                Quoted(f),
                "a kernel boots by the Linux boot protocol: leave format out",
            );
            None
        }
        Some(f) if f == "linux" => {
            problems.value(
                &field("format"),
                Quoted(f),
                "give a Linux kernel with kernel = \"...\" instead of image (with its initrd \
                 and cmdline)",
            );
            None
        }
        Some(f) => match check_vm_value("format", f, ConfigError::BadFormat) {
            Ok(()) => Some(f.as_str()),
            Err(p) => {
                problems.value(&field("format"), Quoted(f), p);
                None
            }
        },
    };
    if let Some(budget) = vm.budget
        && let Err(p) = check_vm_value("budget", &budget.to_string(), ConfigError::BadBudget)
    {
        problems.value(&field("budget"), budget, p);
    }
    if let Some(v) = &vm.vpmu
        && let Err(p) = check_vm_value("vpmu", v, ConfigError::BadVpmu)
    {
        problems.value(&field("vpmu"), Quoted(v), p);
    }

    // The kernel's command line: the kernel's words only (refused above without a kernel).
    let cmdline = match &vm.cmdline {
        Some(c) if linux => c.trim(),
        _ => "",
    };
    if !one_line(cmdline) {
        problems.value(
            &field("cmdline"),
            Quoted(cmdline),
            "must be one line of text (no line breaks or control characters)",
        );
    }
    for word in cmdline.split_whitespace() {
        let key = word.split_once('=').map_or(word, |(k, _)| k);
        if vm_config::KEYS.contains(&key) && word.contains('=') {
            problems.value(
                &field("cmdline"),
                Quoted(cmdline),
                format!(
                    "{key}= is the hypervisor's, not the kernel's: use the key {} instead",
                    field_of_key(key)
                ),
            );
        }
        if apic && NO_APIC_WORDS.contains(&word) {
            problems.value(
                &field("cmdline"),
                Quoted(cmdline),
                format!(
                    "{word} turns off the local APICs and ACPI tables apic = true gives the VM: \
                     leave it out"
                ),
            );
        }
    }
    if linux && !apic {
        let missing: Vec<&str> = NO_APIC_WORDS
            .iter()
            .copied()
            .filter(|w| !cmdline.split_whitespace().any(|c| c == *w))
            .collect();
        if !missing.is_empty() {
            warnings.push(format!(
                "{}: {}: without apic = true the VM has no local APIC or ACPI tables, and the \
                 kernel command line lacks {} (the Linux scenarios boot such a VM with \
                 acpi=off nolapic)",
                problems.file.display(),
                field("cmdline"),
                missing.join(" ")
            ));
        }
    }

    let args = vm.args.as_deref().unwrap_or("").trim();
    if !one_line(args) {
        problems.value(
            &field("args"),
            Quoted(args),
            "must be one line of text (no line breaks or control characters)",
        );
    }
    for word in args.split_whitespace() {
        let key = word.split_once('=').map_or(word, |(k, _)| k);
        if let Some((_, set_by)) = RESERVED_ARGS.iter().find(|(k, _)| *k == key) {
            problems.value(
                &field("args"),
                Quoted(args),
                format!("{key}= is set by the configuration: use the key {set_by} instead"),
            );
        }
    }

    // The files.
    let (image, iso_name) = if vm.image.is_none() && vm.kernel.is_none() {
        (PathBuf::new(), String::new())
    } else {
        file_path(&field(image_field), image_path, dir, target, problems)
    };
    let mut data = Vec::new();
    if let (true, Some(initrd)) = (linux, &vm.initrd) {
        let (source, iso_name) = file_path(&field("initrd"), initrd, dir, target, problems);
        data.push(DataModule {
            field: field("initrd"),
            source,
            unwind_table: false,
            iso_name,
        });
    }
    if let (true, Some(programs)) = (linux, &vm.unwind) {
        if !(1..=UNWIND_MAX).contains(&programs.len()) {
            problems.value(
                &field("unwind"),
                Strings(programs),
                format!("expected 1 to {UNWIND_MAX} programs' paths"),
            );
        }
        for (k, program) in programs.iter().enumerate() {
            let f = format!("vm[{i}].unwind[{k}]");
            let (source, name) = file_path(&f, program, dir, target, problems);
            data.push(DataModule {
                field: f,
                source,
                unwind_table: true,
                iso_name: format!("{name}.unwind"),
            });
        }
    }
    let vmlinux = match (linux, &vm.vmlinux) {
        (true, Some(v)) => Some(file_path(&field("vmlinux"), v, dir, target, problems).0),
        _ => None,
    };
    if problems.lines.len() != before {
        return None;
    }

    let mut keys = vec![
        format!("vm={}", vm.name),
        format!("mem={memory}"),
        format!("vcpus={vcpus}"),
    ];
    if let Some(pin) = &vm.pin {
        let pins: Vec<String> = pin.iter().map(i64::to_string).collect();
        keys.push(format!("pin={}", pins.join(",")));
    }
    if let Some(f) = format {
        keys.push(format!("format={f}"));
    }
    if let Some(b) = vm.budget {
        keys.push(format!("budget={b}"));
    }
    if let Some(v) = &vm.vpmu {
        keys.push(format!("vpmu={v}"));
    }
    let guest: Vec<&str> = [cmdline, args]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect();
    Some(PlannedModule {
        field: field(image_field),
        image,
        linux,
        iso_name,
        cmdline: String::new(),
        data,
        vmlinux,
        keys,
        apic,
        derived: Vec::new(),
        guest: guest.join(" "),
    })
}

/// A file's path on this machine and its file name, or a problem with `field`.
fn file_path(
    field: &str,
    path: &str,
    dir: &Path,
    target: &Path,
    problems: &mut Problems<'_>,
) -> (PathBuf, String) {
    let resolved = resolve_image(path, dir, target);
    let name = match resolved.file_name().and_then(|n| n.to_str()) {
        Some(n) if !path.is_empty() && !path.ends_with('/') => n.to_owned(),
        _ => {
            problems.value(field, Quoted(path), "expected the path of a file");
            String::new()
        }
    };
    (resolved, name)
}

/// Parses a finished module command line with the hypervisor's parser; what it refuses now can
/// only come from `args` (e.g. `target=`).
fn check_module_line(field: &str, args: &str, cmdline: &str, problems: &mut Problems<'_>) {
    if let Err(e) = vm_config::parse(cmdline) {
        problems.value(
            field,
            Quoted(args),
            format!("the hypervisor refuses the module command line {cmdline:?}: {e}"),
        );
    }
}

/// Where an image path points (see the module documentation).
fn resolve_image(image: &str, dir: &Path, target: &Path) -> PathBuf {
    let path = Path::new(image);
    if path.is_absolute() {
        path.to_path_buf()
    } else if let Some(rest) = image.strip_prefix("target/") {
        target.join(rest)
    } else {
        dir.join(path)
    }
}

/// Whether GRUB and the ISO builder take a file name as it is.
fn plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.,+-".contains(c))
}

/// Gives every module a distinct file name inside the ISO: a shared or unusual file name
/// becomes the VM's name with a suffix: `<vm>.elf` (`.bin` for `real16`) for an image,
/// `<vm>.bzImage` for a kernel, `<vm>.initrd` for an initrd, `<vm>.<k>.unwind` for the unwind
/// table of `unwind[k]`.
fn name_iso_files(vms: &[VmTable], modules: &mut [PlannedModule], problems: &mut Problems<'_>) {
    // Every module's name, with the module's place: (VM, None for its image or kernel, or
    // Some(k) for its data module k).
    let mut names: Vec<(usize, Option<usize>, String)> = Vec::new();
    for (i, m) in modules.iter().enumerate() {
        names.push((i, None, m.iso_name.clone()));
        for (k, d) in m.data.iter().enumerate() {
            names.push((i, Some(k), d.iso_name.clone()));
        }
    }
    let original = names.clone();
    for (n, (i, slot, name)) in names.iter_mut().enumerate() {
        let shared = original
            .iter()
            .enumerate()
            .any(|(o, (_, _, other))| o != n && other == name);
        let module = &modules[*i];
        // `unwind=` separates its names with commas.
        let unwind_k = slot.filter(|&k| module.data[k].unwind_table);
        let plain = plain_file_name(name) && (unwind_k.is_none() || !name.contains(','));
        if !shared && plain {
            continue;
        }
        let vm = &vms[*i].name;
        *name = match slot {
            None if module.linux => format!("{vm}.bzImage"),
            None if vms[*i].format.as_deref() == Some("real16") => format!("{vm}.bin"),
            None => format!("{vm}.elf"),
            Some(k) => match unwind_k {
                // The index among the unwind tables, as in `unwind[k]`.
                Some(_) => {
                    let first = usize::from(module.data.first().is_some_and(|d| !d.unwind_table));
                    format!("{vm}.{}.unwind", *k - first)
                }
                None => format!("{vm}.initrd"),
            },
        };
    }
    let place = |i: usize, slot: Option<usize>| match slot {
        None => format!("vm[{i}]"),
        Some(k) => modules[i].data[k].field.clone(),
    };
    let mut clashes = Vec::new();
    for (n, (i, slot, name)) in names.iter().enumerate() {
        if let Some((j, other, _)) = names[..n].iter().find(|(_, _, o)| o == name) {
            let field = match slot {
                None => modules[*i].field.clone(),
                Some(k) => modules[*i].data[*k].field.clone(),
            };
            clashes.push((
                field,
                format!(
                    "its file name inside the ISO, {name:?}, is also {}'s: rename the file or the VM",
                    place(*j, *other)
                ),
            ));
        }
    }
    for (field, problem) in clashes {
        problems.field(&field, problem);
    }
    for (i, slot, name) in names {
        match slot {
            None => modules[i].iso_name = name,
            Some(k) => modules[i].data[k].iso_name = name,
        }
    }
}

/// A TOML or type error on one line: `<file>:<line>:<column>: <message>`, with the table it is in.
fn toml_error(file: &Path, text: &str, e: &toml::de::Error) -> anyhow::Error {
    let message = e.message().trim_end();
    let Some(span) = e.span() else {
        return anyhow::anyhow!("{}: {message}", file.display());
    };
    let start = span.start.min(text.len());
    let before = text.get(..start).unwrap_or("");
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    let line_text = text.lines().nth(line - 1).unwrap_or("").trim();
    // The table the error is in: the last header before its line (`[[vm]]` counted).
    let mut table = None;
    let mut vms = 0usize;
    if !line_text.starts_with('[') {
        for l in text.lines().take(line - 1) {
            let l = l.trim();
            if l.starts_with("[[vm]]") {
                table = Some(format!("vm[{vms}]"));
                vms += 1;
            } else if l.starts_with("[hypervisor]") {
                table = Some("hypervisor".to_owned());
            } else if l.starts_with('[') {
                table = None;
            }
        }
    }
    let within = table.map(|t| format!(" (in {t})")).unwrap_or_default();
    anyhow::anyhow!(
        "{}:{line}:{column}: {message}{within}: `{line_text}`",
        file.display()
    )
}

impl Plan {
    /// For `cargo xtask profile --config`: the Linux VM `name` (the only Linux VM when `None`)
    /// runs the profiled command. Its initrd must be the project's image (`image_initrd`: its
    /// /init and `hvrun` run the command) and becomes `initrd` (the image's with the run's
    /// files); its kernel command line loses `hvprof.run=` and `hvprof.arg=` and gains
    /// `printk.devkmsg=on hvprof.run=@`, and it gets `output_key` (its output store, `output=`).
    /// The sample log goes to the end of the run on the
    /// parallel port (`export=end channel=lpt`, where `profile` reads it); `period` and
    /// `stacks` are the file's, else `defaults`. Returns the VM's name and its `vmlinux`.
    pub fn run_command_in(
        &mut self,
        name: Option<&str>,
        image_initrd: &Path,
        initrd: &Path,
        defaults: &[String],
        output_key: &str,
    ) -> Result<(String, Option<PathBuf>)> {
        let vm_name = |m: &PlannedModule| {
            m.keys
                .iter()
                .find_map(|k| k.strip_prefix("vm="))
                .unwrap_or("")
                .to_owned()
        };
        let linux: Vec<usize> = (0..self.modules.len())
            .filter(|&i| self.modules[i].linux)
            .collect();
        let names: Vec<String> = linux.iter().map(|&i| vm_name(&self.modules[i])).collect();
        let file = self.file.display().to_string();
        let index = match name {
            Some(n) => *linux
                .iter()
                .find(|&&i| vm_name(&self.modules[i]) == n)
                .with_context(|| {
                    format!("--vm {n}: {file} has no Linux VM {n} (its Linux VMs: {names:?})")
                })?,
            None => match linux.as_slice() {
                [i] => *i,
                [] => bail!("{file} has no Linux VM (a [[vm]] with kernel) to run the command in"),
                _ => bail!(
                    "{file} has several Linux VMs ({names:?}): say which runs the command with --vm"
                ),
            },
        };
        let m = &mut self.modules[index];
        let vm = vm_name(m);
        let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        let data = m
            .data
            .iter_mut()
            .find(|d| !d.unwind_table)
            .filter(|d| same(&d.source, image_initrd))
            .with_context(|| {
                format!(
                    "{file}: VM {vm} runs the command, so its initrd must be the project's image {} (its /init runs the command)",
                    image_initrd.display()
                )
            })?;
        data.source = initrd.to_path_buf();
        let mut words: Vec<&str> = m
            .guest
            .split_whitespace()
            .filter(|w| !w.starts_with("hvprof.run=") && !w.starts_with("hvprof.arg="))
            .collect();
        words.extend(["printk.devkmsg=on", "hvprof.run=@"]);
        m.guest = words.join(" ");
        m.keys.retain(|k| !k.starts_with("output="));
        m.keys.push(output_key.to_owned());
        m.compose();
        let mut line: Vec<String> = self
            .cmdline
            .split_whitespace()
            .filter(|w| !w.starts_with("export=") && !w.starts_with("channel="))
            .map(str::to_owned)
            .collect();
        for d in defaults {
            let key = d.split('=').next().unwrap_or("");
            if !line.iter().any(|w| w.split('=').next() == Some(key)) {
                line.push(d.clone());
            }
        }
        line.extend(["export=end".to_owned(), "channel=lpt".to_owned()]);
        self.cmdline = line.join(" ");
        Ok((vm, m.vmlinux.clone()))
    }

    /// Derives the keys of each Linux kernel given with a `vmlinux` (`task-offsets=`,
    /// `mm-layout=`, `module-layout=`, `orc-layout=`: `linux_guest::KernelImage::module_keys`,
    /// as the Linux scenarios do) and puts them on its module's command line. A layout the kernel
    /// does not allow is left out with a warning.
    pub fn derive_kernel_keys(&mut self) -> Result<()> {
        let mut problems = Problems {
            file: &self.file,
            lines: Vec::new(),
        };
        for (i, m) in self.modules.iter_mut().enumerate() {
            let Some(vmlinux) = m.vmlinux.clone() else {
                continue;
            };
            let field = format!("vm[{i}].vmlinux");
            if !vmlinux.is_file() {
                problems.field(&field, no_such_file(&vmlinux, &self.target));
                continue;
            }
            let keys = match linux_guest::KernelImage::from_vmlinux(&vmlinux) {
                Ok(k) => k.module_keys(),
                Err(e) => {
                    problems.value(
                        &field,
                        vmlinux.display(),
                        format!("not a kernel's vmlinux with kallsyms and BTF: {e}"),
                    );
                    continue;
                }
            };
            for (key, why) in keys.unavailable() {
                self.warnings.push(format!(
                    "{}: {field}: no {key}= for this kernel: {why}",
                    self.file.display()
                ));
            }
            m.derived = keys.words().into_iter().map(str::to_owned).collect();
            m.compose();
            if let Err(e) = vm_config::parse(&m.cmdline) {
                problems.value(
                    &field,
                    vmlinux.display(),
                    format!(
                        "the hypervisor refuses the module command line {:?}: {e}",
                        m.cmdline
                    ),
                );
            }
        }
        if !problems.lines.is_empty() {
            bail!("{}", problems.lines.join("\n"));
        }
        Ok(())
    }

    /// The ISO's modules, each VM's module followed by its data modules: checks that every file
    /// exists, places the renamed ones into `staging` (linked where it can) and makes the unwind
    /// tables there.
    pub fn iso_modules(&self, staging: &Path) -> Result<Vec<IsoModule>> {
        self.check_images()?;
        let in_staging = |name: &str| -> Result<PathBuf> {
            std::fs::create_dir_all(staging)
                .with_context(|| format!("cannot create {}", staging.display()))?;
            Ok(staging.join(name))
        };
        let file_named = |path: &Path, name: &str| -> Result<PathBuf> {
            if path.file_name().and_then(|n| n.to_str()) == Some(name) {
                return Ok(path.to_path_buf());
            }
            let copy = in_staging(name)?;
            qemu_tests::iso::link_or_copy(path, &copy)
                .with_context(|| format!("cannot copy {} to {}", path.display(), copy.display()))?;
            Ok(copy)
        };
        let mut out = Vec::new();
        for m in &self.modules {
            out.push(IsoModule::new(
                file_named(&m.image, &m.iso_name)?,
                m.cmdline.clone(),
            ));
            for d in &m.data {
                let path = if d.unwind_table {
                    let program = &d.source;
                    let elf = std::fs::read(program)
                        .with_context(|| format!("cannot read {}", program.display()))?;
                    let (table, _) = linux_guest::unwind::unwind_table(&elf).map_err(|e| {
                        anyhow::anyhow!(
                            "{}: {}: no unwind table for {}: {e}",
                            self.file.display(),
                            d.field,
                            program.display()
                        )
                    })?;
                    let path = in_staging(&d.iso_name)?;
                    std::fs::write(&path, table)
                        .with_context(|| format!("cannot write {}", path.display()))?;
                    path
                } else {
                    file_named(&d.source, &d.iso_name)?
                };
                out.push(IsoModule::new(path, d.iso_name.clone()));
            }
        }
        Ok(out)
    }

    /// Every image, kernel, initrd and program must be a file; a kernel must be a bzImage, and an
    /// image must not be one.
    pub fn check_images(&self) -> Result<()> {
        let mut problems = Problems {
            file: &self.file,
            lines: Vec::new(),
        };
        for m in &self.modules {
            let files = std::iter::once((&m.field, &m.image))
                .chain(m.data.iter().map(|d| (&d.field, &d.source)));
            for (field, path) in files {
                if !path.is_file() {
                    problems.field(field, no_such_file(path, &self.target));
                }
            }
            if m.image.is_file() {
                let bzimage = starts_like_bzimage(&m.image)
                    .with_context(|| format!("cannot read {}", m.image.display()))?;
                if m.linux && !bzimage {
                    problems.field(
                        &m.field,
                        format_args!(
                            "{} is not a Linux bzImage (no \"HdrS\" setup header)",
                            m.image.display()
                        ),
                    );
                } else if !m.linux && bzimage {
                    problems.field(
                        &m.field,
                        format_args!(
                            "{} is a Linux kernel (a bzImage): give it with kernel = \"...\" \
                             instead of image",
                            m.image.display()
                        ),
                    );
                }
            }
        }
        if !problems.lines.is_empty() {
            bail!("{}", problems.lines.join("\n"));
        }
        Ok(())
    }

    /// What the configuration makes, for the terminal.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "xtask: {}: hypervisor command line {:?}",
            self.file.display(),
            self.cmdline
        );
        let mut n = 0;
        for m in &self.modules {
            s.push_str(&format!(
                "\nxtask:   module {n}: {} ({})",
                m.cmdline,
                m.image.display()
            ));
            n += 1;
            for d in &m.data {
                let what = if d.unwind_table {
                    "the unwind table of "
                } else {
                    ""
                };
                s.push_str(&format!(
                    "\nxtask:   module {n}: {} ({what}{})",
                    d.iso_name,
                    d.source.display()
                ));
                n += 1;
            }
        }
        for w in &self.warnings {
            s.push_str(&format!("\nxtask: warning: {w}"));
        }
        s
    }
}

/// "no such file", with the command that makes the file when it is the Linux image's.
fn no_such_file(path: &Path, target: &Path) -> String {
    let made_by = if path.starts_with(target.join("linux")) {
        " (made by `cargo xtask linux-image`)"
    } else {
        ""
    };
    format!("no such file {}{made_by}", path.display())
}

/// Whether the file begins with a bzImage's setup header signatures.
fn starts_like_bzimage(path: &Path) -> std::io::Result<bool> {
    use std::io::Read;
    let mut head = Vec::with_capacity(1024);
    std::fs::File::open(path)?
        .take(1024)
        .read_to_end(&mut head)?;
    Ok(hvprof_hypervisor::linux_boot::is_bzimage(&head))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "configs/x.toml";

    /// A new folder with `mix`, `hello` and `boot.bin` images, as the config's folder and the
    /// target folder.
    fn fixture() -> PathBuf {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("xtask-config-test-{}-{n}", std::process::id()));
        std::fs::create_dir_all(dir.join("x86_64-unknown-none/release")).unwrap();
        std::fs::write(dir.join("x86_64-unknown-none/release/mix"), b"mix").unwrap();
        std::fs::write(dir.join("x86_64-unknown-none/release/hello"), b"hello").unwrap();
        std::fs::write(dir.join("boot.bin"), b"boot").unwrap();
        // A Linux image: a kernel with a setup header's signatures, an initrd, a vmlinux and a
        // program that are not what they claim.
        std::fs::create_dir_all(dir.join("linux/bin")).unwrap();
        let mut kernel = vec![0u8; 0x400];
        kernel[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
        kernel[0x202..0x206].copy_from_slice(b"HdrS");
        std::fs::write(dir.join("linux/bzImage"), kernel).unwrap();
        std::fs::write(dir.join("linux/initramfs.cpio"), b"070701").unwrap();
        std::fs::write(dir.join("linux/vmlinux"), b"not an ELF").unwrap();
        std::fs::write(dir.join("linux/bin/shor"), b"not an ELF").unwrap();
        dir
    }

    fn plan(text: &str) -> Result<Plan> {
        let dir = fixture();
        let plan = plan_in(&dir, text);
        let _ = std::fs::remove_dir_all(&dir);
        plan
    }

    fn plan_in(dir: &Path, text: &str) -> Result<Plan> {
        parse(text, Path::new(FILE), dir, dir)
    }

    /// The error of `text`, which must be refused.
    fn refused(text: &str) -> String {
        match plan(text) {
            Ok(p) => panic!("accepted: {p:?}"),
            Err(e) => format!("{e:#}"),
        }
    }

    /// A one-VM file with `extra` lines in its `[[vm]]` and `hv` in `[hypervisor]`.
    fn one_vm(hv: &str, extra: &str) -> String {
        format!(
            "[hypervisor]\n{hv}\n[[vm]]\nname = \"a\"\nimage = \"target/x86_64-unknown-none/release/mix\"\n{extra}\n"
        )
    }

    /// A one-VM file with a Linux VM and `extra` lines in its `[[vm]]`.
    fn linux_vm(extra: &str) -> String {
        format!(
            "[hypervisor]\ncpus = 2\n[[vm]]\nname = \"l\"\nkernel = \"target/linux/bzImage\"\n\
             memory = \"256M\"\n{extra}\n"
        )
    }

    /// The kernel command line of the SMP scenario.
    const SMP_CMDLINE: &str = "console=ttyS0 tsc=reliable quiet hvprof.run=w41 hvprof.arg=400";

    const THREE_VMS: &str = r#"
[hypervisor]
period = "1ms"
slice = "10ms"
export = "end"
buffer = 100000
emulator = "bochs"
cpus = 2
cpu_model = "corei7_haswell_4770"

[[vm]]
name = "guestOS1"
image = "target/x86_64-unknown-none/release/mix"
memory = "16M"
vcpus = 2
pin = [0, 1]
budget = 2000000000
args = "mix=80,20 rounds=60"

[[vm]]
name = "guestOS2"
image = "target/x86_64-unknown-none/release/mix"
memory = "32M"
args = "mix=50,50"

[[vm]]
name = "hello"
image = "target/x86_64-unknown-none/release/hello"

[[vm]]
name = "rm"
image = "boot.bin"
format = "real16"
"#;

    #[test]
    fn valid_config() {
        let dir = fixture();
        let p = plan_in(&dir, THREE_VMS).unwrap();
        assert_eq!(p.cmdline, "period=1ms slice=10ms export=end buffer=100000");
        assert_eq!(p.emulator, Some(EmulatorArg::Bochs));
        assert_eq!(p.cpus, Some(2));
        assert_eq!(p.cpu_model.as_deref(), Some("corei7_haswell_4770"));
        let lines: Vec<(&str, &str)> = p
            .modules
            .iter()
            .map(|m| (m.iso_name.as_str(), m.cmdline.as_str()))
            .collect();
        assert_eq!(
            lines,
            [
                (
                    "guestOS1.elf",
                    "guestOS1.elf vm=guestOS1 mem=16M vcpus=2 pin=0,1 budget=2000000000 mix=80,20 rounds=60"
                ),
                (
                    "guestOS2.elf",
                    "guestOS2.elf vm=guestOS2 mem=32M vcpus=1 mix=50,50"
                ),
                ("hello", "hello vm=hello mem=16M vcpus=1"),
                ("boot.bin", "boot.bin vm=rm mem=16M vcpus=1 format=real16"),
            ]
        );
        let release = dir.join("x86_64-unknown-none/release");
        assert_eq!(p.modules[0].image, release.join("mix"));
        assert_eq!(p.modules[3].image, dir.join("boot.bin"));

        // The ISO modules: the shared image is copied under each VM's name.
        let staging = dir.join("staging");
        let iso = p.iso_modules(&staging).unwrap();
        assert_eq!(iso[0].path, staging.join("guestOS1.elf"));
        assert_eq!(iso[1].path, staging.join("guestOS2.elf"));
        assert_eq!(iso[2].path, release.join("hello"));
        assert_eq!(std::fs::read(&iso[1].path).unwrap(), b"mix");
        let names: Vec<String> = iso.iter().map(|m| m.file_name().unwrap()).collect();
        assert_eq!(names, ["guestOS1.elf", "guestOS2.elf", "hello", "boot.bin"]);
        assert_eq!(
            iso[3].cmdline,
            "boot.bin vm=rm mem=16M vcpus=1 format=real16"
        );

        // Every line is accepted by the hypervisor's own parsers.
        let options = boot_cmdline::parse(&p.cmdline).unwrap();
        assert_eq!(options.buffer, 100_000);
        let c = vm_config::parse(&p.modules[0].cmdline).unwrap();
        assert_eq!((c.name, c.mem, c.vcpus), ("guestOS1", 16 << 20, 2));
        assert_eq!(
            vm_config::parse(&p.modules[3].cmdline).unwrap().format,
            vm_config::Format::Real16
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn minimal_config_and_defaults() {
        let p = plan("[[vm]]\nname = \"a\"\nimage = \"target/x86_64-unknown-none/release/mix\"\n")
            .unwrap();
        assert_eq!(p.cmdline, "");
        assert_eq!((p.emulator, p.cpus, p.cpu_model), (None, None, None));
        assert_eq!(p.modules[0].cmdline, "mix vm=a mem=16M vcpus=1");
        let p = plan(&one_vm("buffer = \"auto\"\nperiod = \"4000ticks\"", "")).unwrap();
        assert_eq!(p.cmdline, "period=4000ticks buffer=auto");
    }

    #[test]
    fn the_example_file_is_valid() {
        let root = crate::workspace_root();
        let file = root.join("configs/three-vms.toml");
        let text = std::fs::read_to_string(&file).unwrap();
        let p = parse(&text, &file, file.parent().unwrap(), Path::new("target")).unwrap();
        assert_eq!(p.cmdline, "period=1ms slice=10ms export=end buffer=100000");
        assert_eq!(p.modules.len(), 3);
        assert!(p.modules.iter().all(|m| m.iso_name.ends_with(".elf")));
        let file = root.join("configs/two-pcpus.toml");
        let text = std::fs::read_to_string(&file).unwrap();
        let p = parse(&text, &file, file.parent().unwrap(), Path::new("target")).unwrap();
        assert_eq!(p.cpus, Some(2));
        assert!(p.modules[0].cmdline.contains("vcpus=2 pin=0,1"));
    }

    #[test]
    fn hypervisor_values() {
        assert_eq!(
            refused(&one_vm("period = \"5parsecs\"", "")),
            "configs/x.toml: hypervisor.period = \"5parsecs\": expected <n>ns, <n>us, <n>ms or <n>ticks"
        );
        assert_eq!(
            refused(&one_vm("slice = \"0ms\"", "")),
            "configs/x.toml: hypervisor.slice = \"0ms\": must be greater than zero"
        );
        assert_eq!(
            refused(&one_vm("period = \"1 ms\"", "")),
            "configs/x.toml: hypervisor.period = \"1 ms\": expected <n>ns, <n>us, <n>ms or <n>ticks"
        );
        assert_eq!(
            refused(&one_vm("period = \"\"", "")),
            "configs/x.toml: hypervisor.period = \"\": expected <n>ns, <n>us, <n>ms or <n>ticks, not empty"
        );
        assert_eq!(
            refused(&one_vm("export = \"later\"", "")),
            "configs/x.toml: hypervisor.export = \"later\": expected \"stream\" or \"end\""
        );
        assert_eq!(
            refused(&one_vm("buffer = 0", "")),
            "configs/x.toml: hypervisor.buffer = 0: expected a positive number of records below 2^32, or \"auto\""
        );
        assert_eq!(
            refused(&one_vm("buffer = \"lots\"", "")),
            "configs/x.toml: hypervisor.buffer = \"lots\": expected a positive number of records below 2^32, or \"auto\""
        );
        assert!(
            refused(&one_vm("buffer = 1.5", ""))
                .starts_with("configs/x.toml: hypervisor.buffer = 1.5: expected")
        );
        assert_eq!(
            refused(&one_vm("cpus = 0", "")),
            "configs/x.toml: hypervisor.cpus = 0: expected a number of pCPUs from 1 to 64"
        );
        assert_eq!(
            refused(&one_vm("emulator = \"qemu-tcg\"\ncpu_model = \"x\"", "")),
            "configs/x.toml: hypervisor.cpu_model = \"x\": only Bochs has CPU models, and \
             hypervisor.emulator = \"qemu-tcg\""
        );
        let e = refused(&one_vm("emulator = \"vmware\"", ""));
        assert!(
            e.starts_with("configs/x.toml:2:12: unknown variant `vmware`"),
            "{e}"
        );
        assert!(e.contains("(in hypervisor)"), "{e}");
    }

    #[test]
    fn unknown_keys_and_types() {
        let e = refused(&one_vm("", "memry = \"16M\""));
        assert!(
            e.starts_with("configs/x.toml:6:1: unknown field `memry`"),
            "{e}"
        );
        assert!(e.contains("(in vm[0])"), "{e}");
        let e = refused(&one_vm("periode = \"1ms\"", ""));
        assert!(
            e.starts_with("configs/x.toml:2:1: unknown field `periode`"),
            "{e}"
        );
        let e = refused("[hypervisr]\n[[vm]]\nname = \"a\"\nimage = \"x\"\n");
        assert!(e.starts_with("configs/x.toml:1:"), "{e}");
        assert!(e.contains("unknown field `hypervisr`"), "{e}");
        let e = refused(&one_vm("", "vcpus = \"two\""));
        assert!(
            e.contains("invalid type: string \"two\", expected i64"),
            "{e}"
        );
        assert!(e.contains("(in vm[0])"), "{e}");
        assert_eq!(
            refused("[[vm]]\nname = \"a\"\n"),
            "configs/x.toml: vm[0]: no image or kernel: give the guest image (image = \"...\") \
             or a Linux kernel (kernel = \"...\")"
        );
        let e = refused("[hypervisor\n");
        assert!(e.starts_with("configs/x.toml:1:"), "{e}");
    }

    #[test]
    fn vm_values() {
        assert_eq!(
            refused(&one_vm("", "memory = \"3M\"")),
            "configs/x.toml: vm[0].memory = \"3M\": must be a multiple of 2 MiB between 4 MiB and 4 GiB"
        );
        assert_eq!(
            refused(&one_vm("", "memory = \"16\"")),
            "configs/x.toml: vm[0].memory = \"16\": expected a size with a K, M or G suffix, e.g. \"16M\""
        );
        assert_eq!(
            refused(&one_vm("", "memory = \"16 M\"")),
            "configs/x.toml: vm[0].memory = \"16 M\": expected a size with a K, M or G suffix, e.g. \"16M\""
        );
        assert_eq!(
            refused(&one_vm("", "vcpus = 9")),
            "configs/x.toml: vm[0].vcpus = 9: expected a number of vCPUs from 1 to 8"
        );
        assert_eq!(
            refused(&one_vm("", "format = \"pe\"")),
            "configs/x.toml: vm[0].format = \"pe\": expected \"elf64\" or \"real16\""
        );
        assert_eq!(
            refused(&one_vm("", "budget = 0")),
            "configs/x.toml: vm[0].budget = 0: expected a positive number of TSC ticks"
        );
        assert_eq!(
            refused("[[vm]]\nname = \"a\"\nimage = \"\"\n"),
            "configs/x.toml: vm[0].image = \"\": expected the path of a file"
        );
    }

    #[test]
    fn names() {
        for bad in ["", "a/b", "a b", "abcdefghijabcdefghijabcdefghijabc"] {
            let text = format!("[[vm]]\nname = {bad:?}\nimage = \"boot.bin\"\n");
            assert_eq!(
                refused(&text),
                format!(
                    "configs/x.toml: vm[0].name = {bad:?}: a VM name is 1-32 characters of [A-Za-z0-9_.-]"
                )
            );
        }
        let text = "[[vm]]\nname = \"a\"\nimage = \"boot.bin\"\n\
                    [[vm]]\nname = \"b\"\nimage = \"boot.bin\"\n\
                    [[vm]]\nname = \"a\"\nimage = \"boot.bin\"\n";
        assert_eq!(
            refused(text),
            "configs/x.toml: vm[2].name: duplicate VM name \"a\" (vm[0].name)"
        );
    }

    #[test]
    fn pins() {
        assert_eq!(
            refused(&one_vm("cpus = 2", "vcpus = 2\npin = [0]")),
            "configs/x.toml: vm[0].pin = [0]: has 1 entry but vcpus = 2: give one pCPU per vCPU"
        );
        assert_eq!(
            refused(&one_vm("cpus = 2", "vcpus = 2\npin = [0, 2]")),
            "configs/x.toml: vm[0].pin = [0, 2]: pCPU 2 does not exist: the machine has \
             hypervisor.cpus = 2 (pCPUs 0 to 1)"
        );
        assert_eq!(
            refused(&one_vm("", "pin = [1]")),
            "configs/x.toml: vm[0].pin = [1]: pCPU 1 does not exist: the machine has \
             hypervisor.cpus = 1 (the default) (pCPUs 0 to 0)"
        );
        assert!(refused(&one_vm("cpus = 2", "pin = [-1]")).contains("pCPU -1 does not exist"));
        let p = plan(&one_vm("cpus = 4", "vcpus = 3\npin = [3, 1, 3]")).unwrap();
        assert_eq!(p.modules[0].cmdline, "mix vm=a mem=16M vcpus=3 pin=3,1,3");
    }

    #[test]
    fn args() {
        assert_eq!(
            refused(&one_vm("", "args = \"rounds=5 vm=b\"")),
            "configs/x.toml: vm[0].args = \"rounds=5 vm=b\": vm= is set by the configuration: \
             use the key name instead"
        );
        assert_eq!(
            refused(&one_vm("", "args = \"mem=8M\"")),
            "configs/x.toml: vm[0].args = \"mem=8M\": mem= is set by the configuration: \
             use the key memory instead"
        );
        for key in ["vcpus", "pin", "format", "budget"] {
            let e = refused(&one_vm("", &format!("args = \"{key}=1\"")));
            assert!(
                e.contains(&format!("{key}= is set by the configuration")),
                "{e}"
            );
        }
        assert_eq!(
            refused(&one_vm("", "args = \"target=kernel\"")),
            "configs/x.toml: vm[0].args = \"target=kernel\": the hypervisor refuses the module \
             command line \"mix vm=a mem=16M vcpus=1 target=kernel\": target=\"kernel\": expected \
             hypervisor, vm:<name>, unmapped or mmio"
        );
        assert!(
            refused(&one_vm("", "args = \"\"\"a=1\nb=2\"\"\""))
                .contains("must be one line of text")
        );
        let p = plan(&one_vm("", "args = \"  code=7 target=vm:b  \"")).unwrap();
        assert_eq!(
            p.modules[0].cmdline,
            "mix vm=a mem=16M vcpus=1 code=7 target=vm:b"
        );
    }

    #[test]
    fn vms_and_images() {
        assert_eq!(
            refused("[hypervisor]\nperiod = \"1ms\"\n"),
            "configs/x.toml: vm: no [[vm]] table: a configuration needs at least one VM"
        );
        let p = plan("[[vm]]\nname = \"a\"\nimage = \"nope.elf\"\n").unwrap();
        let e = format!("{:#}", p.check_images().unwrap_err());
        assert!(
            e.starts_with("configs/x.toml: vm[0].image: no such file ") && e.ends_with("nope.elf"),
            "{e}"
        );
        // Several problems are reported together, one per line.
        let e = refused(&one_vm("period = \"x\"", "memory = \"3M\""));
        assert_eq!(e.lines().count(), 2, "{e}");
        // An image file name the ISO cannot hold is renamed.
        let dir = fixture();
        std::fs::write(dir.join("my guest.elf"), b"g").unwrap();
        let p = plan_in(&dir, "[[vm]]\nname = \"g\"\nimage = \"my guest.elf\"\n").unwrap();
        assert_eq!(p.modules[0].cmdline, "g.elf vm=g mem=16M vcpus=1");
        // A renamed image must not take another module's file name.
        let text = "[[vm]]\nname = \"mix\"\nimage = \"target/x86_64-unknown-none/release/mix\"\n\
                    [[vm]]\nname = \"b\"\nimage = \"target/x86_64-unknown-none/release/mix\"\n\
                    [[vm]]\nname = \"c\"\nimage = \"mix.elf\"\n";
        std::fs::write(dir.join("mix.elf"), b"m").unwrap();
        assert_eq!(
            format!("{:#}", plan_in(&dir, text).unwrap_err()),
            "configs/x.toml: vm[2].image: its file name inside the ISO, \"mix.elf\", is also \
             vm[0]'s: rename the file or the VM"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_linux_vm() {
        let dir = fixture();
        let config = |unwind: &str| {
            format!(
                "[hypervisor]\ncpus = 2\nchannel = \"lpt\"\nstacks = 16\n\
                 [[vm]]\nname = \"linux\"\nkernel = \"target/linux/bzImage\"\n\
                 initrd = \"target/linux/initramfs.cpio\"\nmemory = \"256M\"\nvcpus = 2\n\
                 pin = [0, 1]\napic = true\nbudget = 100000000000\n\
                 cmdline = \"{SMP_CMDLINE}\"\n{unwind}\nargs = \"wall-budget=9\"\n"
            )
        };
        let text = config("unwind = [\"target/linux/bin/shor\", \"tools/zeroread\"]");
        std::fs::create_dir_all(dir.join("tools")).unwrap();
        let p = plan_in(&dir, &text).unwrap();
        assert_eq!(p.cmdline, "channel=lpt stacks=16");
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
        let m = &p.modules[0];
        assert!(m.linux);
        assert_eq!(m.field, "vm[0].kernel");
        assert_eq!(m.image, dir.join("linux/bzImage"));
        assert_eq!(
            m.cmdline,
            format!(
                "bzImage vm=linux mem=256M vcpus=2 pin=0,1 budget=100000000000 \
                 initrd=initramfs.cpio apic=on unwind=shor.unwind,zeroread.unwind \
                 {SMP_CMDLINE} wall-budget=9"
            )
        );
        let data: Vec<(&str, &str, bool)> = m
            .data
            .iter()
            .map(|d| (d.field.as_str(), d.iso_name.as_str(), d.unwind_table))
            .collect();
        assert_eq!(
            data,
            [
                ("vm[0].initrd", "initramfs.cpio", false),
                ("vm[0].unwind[0]", "shor.unwind", true),
                ("vm[0].unwind[1]", "zeroread.unwind", true),
            ]
        );
        assert_eq!(m.data[2].source, dir.join("tools/zeroread"));
        // The hypervisor reads it as the scenarios' line: its keys, and the rest for the kernel.
        let c = vm_config::parse(&m.cmdline).unwrap();
        assert_eq!((c.name, c.mem, c.vcpus), ("linux", 256 << 20, 2));
        assert_eq!(c.initrd, Some("initramfs.cpio"));
        assert!(c.apic);
        assert_eq!(
            c.unwind_modules().collect::<Vec<_>>(),
            ["shor.unwind", "zeroread.unwind"]
        );
        assert_eq!(
            vm_config::guest_args(c.args).collect::<Vec<_>>().join(" "),
            SMP_CMDLINE
        );
        // The describe lines name every module.
        let d = p.describe();
        assert!(d.contains("module 1: initramfs.cpio ("), "{d}");
        assert!(
            d.contains("module 2: shor.unwind (the unwind table of "),
            "{d}"
        );
        // No vmlinux: nothing derived.
        let mut q = p.clone();
        q.derive_kernel_keys().unwrap();
        assert_eq!(q, p);
        // The ISO: the kernel and initrd as they are; a program that is no ELF has no table.
        std::fs::write(dir.join("tools/zeroread"), b"z").unwrap();
        let e = format!("{:#}", p.iso_modules(&dir.join("staging")).unwrap_err());
        assert!(
            e.starts_with("configs/x.toml: vm[0].unwind[0]: no unwind table for "),
            "{e}"
        );
        let one = plan_in(&dir, &config("")).unwrap();
        let iso = one.iso_modules(&dir.join("staging")).unwrap();
        let lines: Vec<(PathBuf, &str)> = iso
            .iter()
            .map(|m| (m.path.clone(), m.cmdline.as_str()))
            .collect();
        assert_eq!(
            lines[1],
            (dir.join("linux/initramfs.cpio"), "initramfs.cpio")
        );
        assert_eq!(lines[0].0, dir.join("linux/bzImage"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_minimal_linux_vm_and_its_warning() {
        let p = plan(&linux_vm("")).unwrap();
        assert_eq!(p.modules[0].cmdline, "bzImage vm=l mem=256M vcpus=1");
        assert!(p.modules[0].data.is_empty());
        assert_eq!(
            p.warnings,
            [
                "configs/x.toml: vm[0].cmdline: without apic = true the VM has no local APIC or ACPI \
              tables, and the kernel command line lacks acpi=off nolapic (the Linux scenarios \
              boot such a VM with acpi=off nolapic)"
            ]
        );
        assert!(
            p.describe()
                .contains("\nxtask: warning: configs/x.toml: vm[0].cmdline: ")
        );
        let p = plan(&linux_vm("cmdline = \"console=ttyS0 acpi=off nolapic\"")).unwrap();
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
        let p = plan(&linux_vm("apic = false\ncmdline = \"nolapic\"")).unwrap();
        assert_eq!(p.warnings.len(), 1);
        assert!(
            p.warnings[0].contains("lacks acpi=off ("),
            "{:?}",
            p.warnings
        );
    }

    #[test]
    fn linux_values() {
        assert_eq!(
            refused(
                "[[vm]]\nname = \"a\"\nimage = \"boot.bin\"\nkernel = \"k\"\ninitrd = \"rd\"\n"
            ),
            "configs/x.toml: vm[0].kernel = \"k\": and image = \"boot.bin\" are both set: a VM \
             boots a guest image or a Linux kernel, give one of them"
        );
        for (field, value) in [
            ("initrd", "\"rd\""),
            ("cmdline", "\"quiet\""),
            ("apic", "true"),
            ("vmlinux", "\"vmlinux\""),
            ("unwind", "[\"a\", \"b\"]"),
        ] {
            assert_eq!(
                refused(&one_vm("", &format!("{field} = {value}"))),
                format!(
                    "configs/x.toml: vm[0].{field} = {value}: only a Linux VM takes {field}: \
                     this VM boots image = \"target/x86_64-unknown-none/release/mix\"; give a \
                     Linux kernel with kernel = \"...\" instead"
                )
            );
        }
        assert_eq!(
            refused(&one_vm("", "format = \"linux\"")),
            "configs/x.toml: vm[0].format = \"linux\": give a Linux kernel with kernel = \"...\" \
             instead of image (with its initrd and cmdline)"
        );
        assert_eq!(
            refused(&linux_vm("format = \"elf64\"")),
            "configs/x.toml: vm[0].format = \"elf64\": a kernel boots by the Linux boot \
             protocol: leave format out"
        );
        assert_eq!(
            refused("[[vm]]\nname = \"l\"\nkernel = \"target/linux/bzImage\"\n"),
            "configs/x.toml: vm[0].memory: a Linux VM needs its memory given (16M, the default \
             for guest images, is too little for a kernel; the test image boots in \"256M\")"
        );
        assert_eq!(
            refused(&linux_vm("vcpus = 2")),
            "configs/x.toml: vm[0].vcpus = 2: a Linux VM starts its other vCPUs through their \
             local APICs: set apic = true"
        );
        assert_eq!(
            refused(&linux_vm(
                "apic = true\ncmdline = \"console=ttyS0 nolapic\""
            )),
            "configs/x.toml: vm[0].cmdline = \"console=ttyS0 nolapic\": nolapic turns off the \
             local APICs and ACPI tables apic = true gives the VM: leave it out"
        );
        assert!(
            refused(&linux_vm("apic = true\ncmdline = \"acpi=off\""))
                .contains("acpi=off turns off the local APICs")
        );
        assert!(
            refused(&linux_vm("cmdline = \"\"\"a\nb\"\"\"")).contains("must be one line of text")
        );
        assert_eq!(
            refused(&linux_vm("initrd = \"\"")),
            "configs/x.toml: vm[0].initrd = \"\": expected the path of a file"
        );
        assert_eq!(
            refused(&linux_vm("unwind = []")),
            "configs/x.toml: vm[0].unwind = []: expected 1 to 4 programs' paths"
        );
        assert!(
            refused(&linux_vm("unwind = [\"a\", \"b\", \"c\", \"d\", \"e\"]"))
                .starts_with("configs/x.toml: vm[0].unwind = [\"a\", \"b\", \"c\", \"d\", \"e\"]: expected 1 to 4")
        );
        assert_eq!(
            refused(&linux_vm("unwind = [\"bin/\"]")),
            "configs/x.toml: vm[0].unwind[0] = \"bin/\": expected the path of a file"
        );
        let e = refused(&linux_vm("apic = \"on\""));
        assert!(
            e.contains("invalid type: string \"on\", expected a boolean"),
            "{e}"
        );
    }

    #[test]
    fn hypervisor_keys_in_the_kernel_command_line() {
        for (key, field) in [
            ("vm", "name"),
            ("mem", "memory"),
            ("initrd", "initrd"),
            ("apic", "apic"),
            ("unwind", "unwind"),
            ("format", "kernel"),
            ("task-offsets", "vmlinux"),
            ("orc-layout", "vmlinux"),
            ("wall-budget", "args"),
            ("target", "args"),
        ] {
            let cmdline = format!("console=ttyS0 {key}=1 acpi=off nolapic");
            assert_eq!(
                refused(&linux_vm(&format!("cmdline = \"{cmdline}\""))),
                format!(
                    "configs/x.toml: vm[0].cmdline = \"{cmdline}\": {key}= is the hypervisor's, \
                     not the kernel's: use the key {field} instead"
                )
            );
        }
        // A word without a value is the kernel's (`quiet`, even `vm`).
        assert!(plan(&linux_vm("cmdline = \"vm quiet acpi=off nolapic\"")).is_ok());
        // The keys the new fields set are refused in args, for every VM.
        for (key, field) in [
            ("initrd", "initrd"),
            ("apic", "apic"),
            ("unwind", "unwind"),
            ("mm-layout", "vmlinux"),
            ("module-layout", "vmlinux"),
        ] {
            assert_eq!(
                refused(&one_vm("", &format!("args = \"{key}=x\""))),
                format!(
                    "configs/x.toml: vm[0].args = \"{key}=x\": {key}= is set by the \
                     configuration: use the key {field} instead"
                )
            );
        }
    }

    #[test]
    fn linux_files() {
        let dir = fixture();
        // Missing files, the Linux image's with the command that makes it.
        let text = linux_vm("initrd = \"rd.cpio\"\nunwind = [\"target/linux/bin/nope\"]");
        let p = plan_in(&dir, &text).unwrap();
        assert_eq!(
            format!("{:#}", p.check_images().unwrap_err()),
            format!(
                "configs/x.toml: vm[0].initrd: no such file {}\n\
                 configs/x.toml: vm[0].unwind[0]: no such file {} (made by `cargo xtask linux-image`)",
                dir.join("rd.cpio").display(),
                dir.join("linux/bin/nope").display()
            )
        );
        std::fs::remove_file(dir.join("linux/bzImage")).unwrap();
        let p = plan_in(&dir, &linux_vm("")).unwrap();
        assert_eq!(
            format!("{:#}", p.check_images().unwrap_err()),
            format!(
                "configs/x.toml: vm[0].kernel: no such file {} (made by `cargo xtask linux-image`)",
                dir.join("linux/bzImage").display()
            )
        );
        // A kernel must be a bzImage, and an image must not be one.
        std::fs::write(dir.join("linux/bzImage"), b"MZ").unwrap();
        let e = format!("{:#}", p.check_images().unwrap_err());
        assert!(
            e.starts_with("configs/x.toml: vm[0].kernel: ")
                && e.ends_with("bzImage is not a Linux bzImage (no \"HdrS\" setup header)"),
            "{e}"
        );
        std::fs::copy(
            dir.join("x86_64-unknown-none/release/mix"),
            dir.join("linux/bzImage"),
        )
        .unwrap();
        std::fs::write(dir.join("x86_64-unknown-none/release/mix"), {
            let mut k = vec![0u8; 0x300];
            k[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
            k[0x202..0x206].copy_from_slice(b"HdrS");
            k
        })
        .unwrap();
        let p = plan_in(&dir, &one_vm("", "")).unwrap();
        let e = format!("{:#}", p.check_images().unwrap_err());
        assert!(
            e.ends_with(
                "mix is a Linux kernel (a bzImage): give it with kernel = \"...\" instead of image"
            ),
            "{e}"
        );
        // The vmlinux is read when the configuration is loaded: missing, or not a kernel's.
        let mut p = plan_in(&dir, &linux_vm("vmlinux = \"target/linux/vmlinux2\"")).unwrap();
        assert_eq!(p.modules[0].vmlinux, Some(dir.join("linux/vmlinux2")));
        assert_eq!(
            format!("{:#}", p.derive_kernel_keys().unwrap_err()),
            format!(
                "configs/x.toml: vm[0].vmlinux: no such file {} (made by `cargo xtask linux-image`)",
                dir.join("linux/vmlinux2").display()
            )
        );
        let mut p = plan_in(&dir, &linux_vm("vmlinux = \"target/linux/vmlinux\"")).unwrap();
        let e = format!("{:#}", p.derive_kernel_keys().unwrap_err());
        assert!(
            e.starts_with(&format!(
                "configs/x.toml: vm[0].vmlinux = {}: not a kernel's vmlinux with kallsyms and BTF: ",
                dir.join("linux/vmlinux").display()
            )),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn linux_modules_get_names_of_their_own() {
        let dir = fixture();
        let vm = |name: &str| {
            format!(
                "[[vm]]\nname = \"{name}\"\nkernel = \"target/linux/bzImage\"\nmemory = \"256M\"\n\
                 initrd = \"target/linux/initramfs.cpio\"\nunwind = [\"target/linux/bin/shor\"]\n"
            )
        };
        let p = plan_in(&dir, &format!("{}{}", vm("a"), vm("b"))).unwrap();
        let names: Vec<Vec<&str>> = p
            .modules
            .iter()
            .map(|m| {
                std::iter::once(m.iso_name.as_str())
                    .chain(m.data.iter().map(|d| d.iso_name.as_str()))
                    .collect()
            })
            .collect();
        assert_eq!(
            names,
            [
                ["a.bzImage", "a.initrd", "a.0.unwind"],
                ["b.bzImage", "b.initrd", "b.0.unwind"]
            ]
        );
        assert!(
            p.modules[1]
                .cmdline
                .starts_with("b.bzImage vm=b mem=256M vcpus=1 initrd=b.initrd unwind=b.0.unwind"),
            "{}",
            p.modules[1].cmdline
        );
        // The copies in the ISO's staging folder.
        let iso = p.modules[0].clone();
        let staging = dir.join("staging");
        let only_files = Plan {
            modules: vec![PlannedModule {
                data: iso.data[..1].to_vec(),
                ..iso
            }],
            ..p.clone()
        };
        let files = only_files.iso_modules(&staging).unwrap();
        assert_eq!(files[0].path, staging.join("a.bzImage"));
        assert_eq!(
            (files[1].path.clone(), files[1].cmdline.as_str()),
            (staging.join("a.initrd"), "a.initrd")
        );
        assert_eq!(std::fs::read(&files[1].path).unwrap(), b"070701");
        // A name with a comma cannot be in unwind=; an initrd's may be another VM's image's.
        std::fs::write(dir.join("linux/bin/a,b"), b"x").unwrap();
        std::fs::write(dir.join("mix"), b"x").unwrap();
        let text = format!(
            "{}[[vm]]\nname = \"l\"\nkernel = \"target/linux/bzImage\"\nmemory = \"256M\"\n\
             initrd = \"mix\"\nunwind = [\"target/linux/bin/a,b\"]\n",
            one_vm("", "")
        );
        let p = plan_in(&dir, &text).unwrap();
        assert_eq!(p.modules[0].iso_name, "a.elf");
        assert_eq!(p.modules[1].data[0].iso_name, "l.initrd");
        assert_eq!(p.modules[1].data[1].iso_name, "l.0.unwind");
        // A renamed module must not take another's name.
        std::fs::write(dir.join("l.initrd"), b"x").unwrap();
        let text = format!(
            "{}{}[[vm]]\nname = \"c\"\nimage = \"l.initrd\"\n",
            vm("l"),
            vm("m")
        );
        assert_eq!(
            format!("{:#}", plan_in(&dir, &text).unwrap_err()),
            "configs/x.toml: vm[2].image: its file name inside the ISO, \"l.initrd\", is also \
             vm[0].initrd's: rename the file or the VM"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_linux_example_file_is_valid() {
        let root = crate::workspace_root();
        let file = root.join("configs/linux-smp.toml");
        let text = std::fs::read_to_string(&file).unwrap();
        let target = crate::target_dir();
        let mut p = parse(&text, &file, file.parent().unwrap(), &target).unwrap();
        assert_eq!(p.cmdline, "period=8000ticks export=end channel=lpt");
        assert_eq!((p.cpus, p.emulator), (Some(2), Some(EmulatorArg::Bochs)));
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
        let m = &p.modules[0];
        // The SMP scenario's kernel command line and workload.
        let kernel = qemu_tests::linux_scenarios::KERNEL_CMDLINE.replace(" acpi=off nolapic", "");
        assert_eq!(
            m.cmdline,
            format!(
                "bzImage vm=linux mem=256M vcpus=2 pin=0,1 budget=100000000000 \
                 initrd=initramfs.cpio apic=on {kernel} hvprof.run=w41 hvprof.arg=400"
            )
        );
        assert_eq!(m.image, target.join("linux/bzImage"));
        assert_eq!(m.data[0].source, target.join("linux/initramfs.cpio"));
        assert_eq!(m.vmlinux, Some(target.join("linux/vmlinux")));
        // With the image built, the kernel's keys are derived and every file is there.
        if !target.join("linux/vmlinux").is_file() {
            eprintln!(
                "skipped the derived keys: no {} (cargo xtask linux-image)",
                target.join("linux/vmlinux").display()
            );
            return;
        }
        p.derive_kernel_keys().unwrap();
        p.check_images().unwrap();
        let m = &p.modules[0];
        let c = vm_config::parse(&m.cmdline).unwrap();
        assert!(c.task_offsets.is_some() && c.mm_layout.is_some());
        assert!(c.module_layout.is_some() && c.orc_layout.is_some());
        assert!(
            m.cmdline.contains(" apic=on task-offsets=0x")
                && m.cmdline.ends_with(" hvprof.arg=400"),
            "{}",
            m.cmdline
        );
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    }

    /// The unwind table of the image's `shor` (libquantum and libgomp without frame pointers),
    /// made for the ISO as the stacks scenario makes it.
    #[test]
    fn the_unwind_table_of_a_real_program() {
        let target = crate::target_dir();
        let shor = target.join("linux/bin/shor");
        if !shor.is_file() {
            eprintln!("skipped: no {} (cargo xtask linux-image)", shor.display());
            return;
        }
        let dir = fixture();
        let text = format!(
            "[[vm]]\nname = \"l\"\nkernel = \"{}\"\nmemory = \"256M\"\n\
             unwind = [\"{}\"]\n",
            dir.join("linux/bzImage").display(),
            shor.display()
        );
        let p = parse(&text, Path::new(FILE), &dir, &target).unwrap();
        assert_eq!(
            p.modules[0].cmdline,
            "bzImage vm=l mem=256M vcpus=1 unwind=shor.unwind"
        );
        let iso = p.iso_modules(&dir.join("staging")).unwrap();
        assert_eq!(iso[1].path, dir.join("staging/shor.unwind"));
        assert_eq!(iso[1].cmdline, "shor.unwind");
        let (table, _) = linux_guest::unwind::unwind_table(&std::fs::read(&shor).unwrap()).unwrap();
        assert_eq!(std::fs::read(&iso[1].path).unwrap(), table);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn channel_and_stacks() {
        let p = plan(&one_vm("channel = \"lpt\"\nstacks = \"on\"", "")).unwrap();
        assert_eq!(p.cmdline, "channel=lpt stacks=on");
        assert_eq!(
            refused(&one_vm("channel = \"usb\"", "")),
            "configs/x.toml: hypervisor.channel = \"usb\": expected \"serial\", \"lpt\" or \"virtio\""
        );
        assert_eq!(
            refused(&one_vm("stacks = 33", "")),
            "configs/x.toml: hypervisor.stacks = 33: expected \"off\", \"on\" (16 frames) or a \
             depth from 1 to 32"
        );
        assert!(
            refused(&one_vm("stacks = true", ""))
                .starts_with("configs/x.toml: hypervisor.stacks = true: expected")
        );
    }
}
