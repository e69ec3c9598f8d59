//! Run configuration files: `cargo xtask run --config FILE` and `cargo xtask iso --config FILE`.
//!
//! A TOML file describes one machine: the hypervisor's boot options, the emulated machine and the
//! VMs. xtask turns it into the hypervisor's command line and one boot module per VM
//! (`configs/three-vms.toml` and `configs/two-pcpus.toml` are examples):
//!
//! ```toml
//! [hypervisor]                 # optional table; every key optional
//! period = "1ms"               # boot option period=: <n>ns, <n>us, <n>ms or <n>ticks
//! slice = "10ms"               # boot option slice= (scheduler time slice), same syntax
//! export = "end"               # boot option export=: "stream" or "end"
//! buffer = 100000              # boot option buffer=: records kept for export=end, or "auto"
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
//! args = "mix=80,20 rounds=60" # optional: more arguments, passed to the guest as they are
//! ```
//!
//! The hypervisor's command line holds the boot options given, in the order period, slice,
//! export, buffer (`period=1ms slice=10ms export=end buffer=100000`); the emulator keys only
//! choose how `run` boots (`--emulator` on the command line overrides `emulator`; `--cpus`,
//! `--cpu-model`, `--cmdline` and `--module` cannot be combined with `--config`).
//!
//! Each VM becomes the module `<file> vm=<name> mem=<memory> vcpus=<n> [pin=a,b]
//! [format=...] [budget=...] [<args>]`, where `<file>` is the image's file name inside the ISO.
//! The image's file name is kept unless two VMs' images have the same file name (the ISO holds
//! each file once under its own name) or the name is not plain `[A-Za-z0-9_.,+-]`: then the image
//! is copied to `target/config-modules/<name>.elf` (`<name>.bin` for `real16`). The analyzer
//! matches guest images by build id, so a copied image still finds its symbols.
//!
//! **Image paths.** An absolute path is taken as it is; a path starting with `target/` is in
//! cargo's target folder (`<workspace>/target`, or `CARGO_TARGET_DIR` when set), where the test
//! guests are built; any other path is relative to the folder of the configuration file. Images
//! must exist when the ISO is made (after the build, so freshly built guests count).
//!
//! **Validation.** Unknown keys and wrong types are refused with the line and column. Every
//! value is checked with the parsers the hypervisor itself uses (`hvprof_boot::cmdline::parse`
//! for the boot options, `hvprof_hypervisor::vm_config::parse` for the modules), and the final
//! command lines are parsed once more by them, so the file and the hypervisor cannot disagree. A
//! VM's `args` must not set a key the configuration sets (`vm=`, `mem=`, `vcpus=`, `pin=`,
//! `format=`, `budget=`). Every problem is reported on one line naming the file, the field and
//! the value: `configs/x.toml: vm[1].memory = "3M": must be a multiple of 2 MiB between 4 MiB
//! and 4 GiB`.

use std::fmt::{self, Display};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use hvprof_boot::cmdline::{self as boot_cmdline, CmdlineError, ValueProblem};
use hvprof_hypervisor::vm_config::{
    self, ConfigError, MEM_DEFAULT, MEM_MAX, MEM_MIN, NAME_MAX, VCPUS_MAX,
};
use qemu_tests::iso::IsoModule;
use serde::Deserialize;

use crate::EmulatorArg;

/// The most pCPUs the hypervisor uses (its ACPI table of CPUs, `hypervisor/src/bin/hvprof/acpi.rs`).
pub const CPUS_MAX: u32 = 64;

/// Module arguments the configuration sets itself, with the field that sets each.
const RESERVED_ARGS: [(&str, &str); 6] = [
    ("vm", "name"),
    ("mem", "memory"),
    ("vcpus", "vcpus"),
    ("pin", "pin"),
    ("format", "format"),
    ("budget", "budget"),
];

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
    emulator: Option<EmulatorArg>,
    cpus: Option<i64>,
    cpu_model: Option<String>,
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct VmTable {
    name: String,
    image: String,
    memory: Option<String>,
    vcpus: Option<i64>,
    pin: Option<Vec<i64>>,
    format: Option<String>,
    budget: Option<i64>,
    args: Option<String>,
}

/// A validated configuration: what to put on the ISO and how to boot it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The configuration file (for messages).
    pub file: PathBuf,
    /// The hypervisor's command line.
    pub cmdline: String,
    /// The boot modules, one per VM, in the file's order.
    pub modules: Vec<PlannedModule>,
    pub emulator: Option<EmulatorArg>,
    pub cpus: Option<u32>,
    pub cpu_model: Option<String>,
}

/// One VM's boot module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedModule {
    /// `vm[i].image`, for messages.
    pub field: String,
    /// The image file on this machine.
    pub image: PathBuf,
    /// The module's file name inside the ISO (the first word of `cmdline`).
    pub iso_name: String,
    /// The module's command line.
    pub cmdline: String,
}

/// Reads and validates a configuration file (the images' existence is checked by
/// [`Plan::iso_modules`], after the build).
pub fn load(file: &Path) -> Result<Plan> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read the configuration {}", file.display()))?;
    let dir = file.parent().unwrap_or(Path::new(""));
    parse(&text, file, dir, &crate::target_dir())
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
    let buffer = hv.buffer.as_ref().and_then(|v| match v {
        toml::Value::Integer(n) => Some(n.to_string()),
        toml::Value::String(s) => Some(s.clone()),
        other => {
            problems.value(
                "hypervisor.buffer",
                other,
                "expected a positive number of records or \"auto\"",
            );
            None
        }
    });
    let options = [
        ("period", hv.period.clone()),
        ("slice", hv.slice.clone()),
        ("export", hv.export.clone()),
        ("buffer", buffer),
    ];
    let mut tokens = Vec::new();
    for (key, value) in options {
        let Some(value) = value else { continue };
        let shown: &dyn Display = match (key, &hv.buffer) {
            ("buffer", Some(raw)) => raw,
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
    for (i, vm) in config.vm.iter().enumerate() {
        if let Some(module) = plan_vm(
            i,
            vm,
            machine_cpus,
            hv.cpus.is_some(),
            dir,
            target,
            &mut problems,
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
    })
}

/// Checks one boot option with the hypervisor's parser.
fn check_boot_option(key: &str, value: &str) -> Result<(), String> {
    let syntax = match key {
        "period" | "slice" => ValueProblem::PeriodSyntax,
        "export" => ValueProblem::ExportChoice,
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

/// Validates one `[[vm]]` and makes its module (with the image's own file name for now).
fn plan_vm(
    i: usize,
    vm: &VmTable,
    machine_cpus: u32,
    cpus_given: bool,
    dir: &Path,
    target: &Path,
    problems: &mut Problems<'_>,
) -> Option<PlannedModule> {
    let before = problems.lines.len();
    let field = |name: &str| format!("vm[{i}].{name}");

    if let Err(p) = check_vm_value("vm", &vm.name, ConfigError::BadName) {
        problems.value(&field("name"), Quoted(&vm.name), p);
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
    let args = vm.args.as_deref().unwrap_or("").trim();
    if args
        .chars()
        .any(|c| c.is_control() && c != ' ' && c != '\t')
    {
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
    let image = resolve_image(&vm.image, dir, target);
    let iso_name = match image.file_name().and_then(|n| n.to_str()) {
        Some(n) if !vm.image.is_empty() && !vm.image.ends_with('/') => n.to_owned(),
        _ => {
            problems.value(
                &field("image"),
                Quoted(&vm.image),
                "expected the path of a file",
            );
            String::new()
        }
    };
    if problems.lines.len() != before {
        return None;
    }

    let mut words = vec![
        iso_name.clone(),
        format!("vm={}", vm.name),
        format!("mem={memory}"),
        format!("vcpus={vcpus}"),
    ];
    if let Some(pin) = &vm.pin {
        let pins: Vec<String> = pin.iter().map(i64::to_string).collect();
        words.push(format!("pin={}", pins.join(",")));
    }
    if let Some(f) = format {
        words.push(format!("format={f}"));
    }
    if let Some(b) = vm.budget {
        words.push(format!("budget={b}"));
    }
    if !args.is_empty() {
        words.push(args.to_owned());
    }
    let module = PlannedModule {
        field: field("image"),
        image,
        iso_name,
        cmdline: words.join(" "),
    };
    check_module_line(&field("args"), args, &module.cmdline, problems);
    Some(module)
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

/// Gives every module a distinct file name inside the ISO: a shared or unusual image file name
/// becomes `<vm name>.elf` (`.bin` for `real16`).
fn name_iso_files(vms: &[VmTable], modules: &mut [PlannedModule], problems: &mut Problems<'_>) {
    let original: Vec<String> = modules.iter().map(|m| m.iso_name.clone()).collect();
    for (i, (vm, module)) in vms.iter().zip(modules.iter_mut()).enumerate() {
        let shared = original
            .iter()
            .enumerate()
            .any(|(j, n)| j != i && *n == module.iso_name);
        if shared || !plain_file_name(&module.iso_name) {
            let ext = if vm.format.as_deref() == Some("real16") {
                "bin"
            } else {
                "elf"
            };
            let renamed = format!("{}.{ext}", vm.name);
            let rest = module
                .cmdline
                .strip_prefix(module.iso_name.as_str())
                .unwrap_or_default()
                .to_owned();
            module.cmdline = format!("{renamed}{rest}");
            module.iso_name = renamed;
        }
    }
    for (i, module) in modules.iter().enumerate() {
        if let Some(j) = modules[..i]
            .iter()
            .position(|m| m.iso_name == module.iso_name)
        {
            problems.field(
                &module.field,
                format_args!(
                    "its file name inside the ISO, {:?}, is also vm[{j}]'s: rename the file or the VM",
                    module.iso_name
                ),
            );
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
    /// The ISO's modules: checks that every image exists and copies the renamed ones into
    /// `staging`.
    pub fn iso_modules(&self, staging: &Path) -> Result<Vec<IsoModule>> {
        self.check_images()?;
        let mut out = Vec::with_capacity(self.modules.len());
        for m in &self.modules {
            let own_name = m.image.file_name().and_then(|n| n.to_str());
            let path = if own_name == Some(m.iso_name.as_str()) {
                m.image.clone()
            } else {
                std::fs::create_dir_all(staging)
                    .with_context(|| format!("cannot create {}", staging.display()))?;
                let copy = staging.join(&m.iso_name);
                std::fs::copy(&m.image, &copy).with_context(|| {
                    format!("cannot copy {} to {}", m.image.display(), copy.display())
                })?;
                copy
            };
            out.push(IsoModule::new(path, m.cmdline.clone()));
        }
        Ok(out)
    }

    /// Every image must be a file.
    pub fn check_images(&self) -> Result<()> {
        let missing: Vec<String> = self
            .modules
            .iter()
            .filter(|m| !m.image.is_file())
            .map(|m| {
                format!(
                    "{}: {}: no such file {}",
                    self.file.display(),
                    m.field,
                    m.image.display()
                )
            })
            .collect();
        if !missing.is_empty() {
            bail!("{}", missing.join("\n"));
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
        for (i, m) in self.modules.iter().enumerate() {
            s.push_str(&format!(
                "\nxtask:   module {i}: {} ({})",
                m.cmdline,
                m.image.display()
            ));
        }
        s
    }
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
        let e = refused("[[vm]]\nname = \"a\"\n");
        assert!(e.contains("missing field `image`"), "{e}");
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
}
