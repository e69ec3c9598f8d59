//! `cargo xtask kvm-unit-tests [--dir DIR] [--filter F]`: kvm-unit-tests' x86 kernels (a
//! peer's conformance suite, test data outside the project) as VMs under hvprof in Bochs, beside
//! a baseline of the same kernels in QEMU TCG without hvprof.
//!
//! - `unittests.cfg` (upstream's list) gives each test's kernel, vCPUs (`smp`), arguments
//!   (`test_args`, the VM's command line after the kernel's name) and QEMU options
//!   (`qemu_params`): `-append` adds to the command line, `-m` is the VM's memory, `-smp` its
//!   vCPUs; `-cpu` and the others are QEMU's alone (hvprof gives every VM its own CPUID). The
//!   QEMU baseline gets the options and arguments as upstream's runner gives them.
//! - A test whose feature hvprof deliberately does not offer is skipped, with the reason
//!   ([`skip_reason`]): nested VMX/SVM, Hyper-V and KVM paravirtual interfaces, upstream's
//!   `nodefault` group and i386-only tests.
//! - The others boot in batches: several VMs under one hypervisor boot, each test its own VM
//!   (`format=multiboot apic=on`, the platform the kernels expect: local APICs, I/O APIC, ACPI
//!   with a PM timer, fw_cfg for the CPU count and RAM size, QEMU's pc-testdev ports; an
//!   environment module says whether to use the pc-testdev), with a run budget that stops a
//!   hung one. A
//!   VM's serial lines (`[name] PASS: ...`, `SUMMARY: ...`) and its exit through port 0xf4
//!   give the result: the status is `(code << 1) | 1` as QEMU's isa-debug-exit makes it (1
//!   pass, 77 skip, anything else fail), the counts from the PASS/FAIL/SKIP lines.
//! - Each batch's serial log and capture stay under `target/kvm-unit-tests/`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use qemu_tests::emulator::{Emulator, RunFiles};
use qemu_tests::iso::{IsoModule, IsoSpec, build_iso};
use qemu_tests::process::{Launch, Limit, RunEnd, launch};
use qemu_tests::runner::DEFAULT_END_MARKER;

use crate::build::build_hypervisor;
use crate::target_dir;
use crate::tools::ensure_tools;

/// Where the suite is when `--dir` and `KVM_UNIT_TESTS_DIR` do not say.
pub const DEFAULT_DIR: &str = "../shared/kvm-unit-tests";

/// One test of `unittests.cfg`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Test {
    pub name: String,
    pub file: String,
    pub smp: u32,
    /// The QEMU options (`qemu_params`, formerly `extra_params`).
    pub extra_params: String,
    /// The kernel's arguments (`test_args`).
    pub test_args: String,
    pub arch: Option<String>,
    pub groups: Vec<String>,
    pub accel: Option<String>,
}

/// Parses upstream's `unittests.cfg`: `[name]` sections of `key = value` lines, `#` comments.
pub fn parse_cfg(text: &str) -> Vec<Test> {
    let mut tests: Vec<Test> = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            tests.push(Test {
                name: name.trim().to_owned(),
                smp: 1,
                ..Test::default()
            });
            continue;
        }
        let (Some(t), Some((key, value))) = (tests.last_mut(), line.split_once('=')) else {
            continue;
        };
        let value = value.trim().to_owned();
        match key.trim() {
            "file" => t.file = value,
            "smp" => t.smp = value.parse().unwrap_or(1).max(1),
            "extra_params" | "qemu_params" => t.extra_params = value,
            "test_args" => t.test_args = shell_words(&value).join(" "),
            "arch" => t.arch = Some(value),
            "groups" => t.groups = value.split_whitespace().map(str::to_owned).collect(),
            "accel" => t.accel = Some(value),
            _ => {}
        }
    }
    tests
}

/// The tests of `parse_cfg(text)`, and after them a test for each kernel in `flats` (file
/// names) that no entry of `unittests.cfg` names (`dummy.flat`, `hpet_read_test.flat`,
/// `tscdeadline_latency.flat` in upstream's tree): upstream builds them to be run by hand
/// (`x86/run x86/dummy.flat`), so they run as that would, on 1 CPU with no arguments, under the
/// file's name.
pub fn with_unlisted(mut tests: Vec<Test>, flats: &[String]) -> Vec<Test> {
    let mut extra: Vec<&String> = flats
        .iter()
        .filter(|f| f.ends_with(".flat") && !tests.iter().any(|t| &t.file == *f))
        .collect();
    extra.sort();
    for f in extra {
        tests.push(Test {
            name: f.trim_end_matches(".flat").to_owned(),
            file: f.clone(),
            smp: 1,
            ..Test::default()
        });
    }
    tests
}

/// Splits QEMU options as a shell would: words, '...' and "..." quoting.
pub fn shell_words(s: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut any = false;
    let mut quote: Option<char> = None;
    for c in s.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => cur.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                any = true;
            }
            (None, c) if c.is_whitespace() => {
                if any || !cur.is_empty() {
                    words.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            (None, c) => cur.push(c),
        }
    }
    if any || !cur.is_empty() {
        words.push(cur);
    }
    words
}

/// What a test's QEMU options mean for its VM.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VmShape {
    /// `-append`: the kernel's command line.
    pub append: String,
    /// `-m`: memory in MiB.
    pub mem_mib: Option<u64>,
    /// `-smp`: vCPUs (else the test's `smp`).
    pub smp: Option<u32>,
    /// `-cpu`: the CPU model and flags upstream asks QEMU for (hvprof gives its own CPUID).
    pub cpu: Option<String>,
}

/// Reads the options hvprof maps; the others are QEMU's alone (the baseline's).
pub fn vm_shape(extra_params: &str) -> VmShape {
    let words = shell_words(extra_params);
    let mut shape = VmShape::default();
    let mut i = 0;
    while i < words.len() {
        let next = words.get(i + 1).cloned();
        match words[i].as_str() {
            "-append" => shape.append = next.unwrap_or_default(),
            "-m" => {
                shape.mem_mib = next.as_deref().and_then(|m| {
                    let m = m.trim_end_matches(['M', 'm']);
                    m.strip_suffix(['G', 'g'])
                        .and_then(|g| g.parse::<u64>().ok().map(|g| g * 1024))
                        .or_else(|| m.parse().ok())
                });
            }
            "-smp" => {
                shape.smp = next
                    .as_deref()
                    .and_then(|s| s.split(',').next())
                    .and_then(|s| s.trim_start_matches("cpus=").parse().ok());
            }
            "-cpu" => shape.cpu = next,
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    shape
}

/// Why hvprof does not run `t` (`None`: it runs it). `have` says whether its kernel is there.
pub fn skip_reason(t: &Test, have: bool) -> Option<String> {
    let name = t.name.as_str();
    let file = t.file.trim_end_matches(".flat");
    let any = |list: &[&str]| {
        list.iter()
            .any(|p| name.starts_with(p) || file.starts_with(p))
    };
    if t.arch.as_deref() == Some("i386") {
        return Some("an i386 test: this build is x86_64".into());
    }
    if any(&["vmx", "svm"]) {
        return Some("nested VMX/SVM: hvprof offers neither to its guests".into());
    }
    if any(&["hyperv"]) {
        return Some("Hyper-V enlightenments: not offered".into());
    }
    if any(&["kvmclock", "asyncpf"]) {
        return Some(
            "KVM paravirtual interfaces (kvmclock, async page faults): not offered".into(),
        );
    }
    if any(&["vmware_backdoors"]) {
        return Some("VMware backdoor ports: not offered".into());
    }
    if any(&["hpet"]) {
        return Some(
            "an HPET: not offered (the PIT, the local APIC timers and the PM timer are)".into(),
        );
    }
    if any(&["pmu_lbr"]) {
        return Some("last-branch records: the virtual PMU (vpmu=) has none".into());
    }
    if any(&["pmu_pebs"]) {
        return Some("PEBS: the virtual PMU (vpmu=) has none".into());
    }
    if t.groups.iter().any(|g| g == "nodefault") {
        return Some("upstream leaves it out of its default run (group nodefault)".into());
    }
    if !have {
        return Some(format!("{} is not in this build", t.file));
    }
    None
}

/// A test's result under hvprof (or the baseline).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// PASS, FAIL, SKIP, or why there is none (TIMEOUT, CRASH: the VM stopped otherwise).
    pub verdict: String,
    pub pass: u32,
    pub fail: u32,
    pub skip: u32,
    /// The kernel's SUMMARY line, if it printed one.
    pub summary: Option<String>,
    /// The exit port's status, `(code << 1) | 1`.
    pub status: Option<u32>,
    /// How the VM stopped, when not through the exit port.
    pub stop: Option<String>,
    /// The VM's run time in TSC ticks (in Bochs, instructions), when it exited.
    pub ticks: Option<u64>,
}

/// The verdict of an exit status as upstream's runner reads QEMU's (scripts/arch-run.bash,
/// runtime.bash): 1 (exit code 0) pass, 77 (exit code 38: report_summary's `77 >> 1` for a test
/// that skipped everything) skip, anything else a failure.
fn verdict_of(status: u32) -> &'static str {
    match status {
        1 => "PASS",
        77 => "SKIP",
        _ => "FAIL",
    }
}

/// The counts of a kernel's output lines (without their `[vm]` prefix).
fn count(lines: &[&str], o: &mut Outcome) {
    for l in lines {
        let l = l.trim_start();
        if l.starts_with("PASS:") || l.starts_with("XPASS:") {
            o.pass += 1;
        } else if l.starts_with("FAIL:") || l.starts_with("XFAIL:") {
            o.fail += 1;
        } else if l.starts_with("SKIP:") {
            o.skip += 1;
        } else if l.starts_with("SUMMARY:") {
            o.summary = Some(l.trim().to_owned());
        }
    }
}

/// Reads the result of VM `vm` from a batch's serial log.
pub fn outcome_under_hvprof(serial: &str, vm: &str) -> Outcome {
    let prefix = format!("[{vm}] ");
    let lines: Vec<&str> = serial
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .collect();
    let mut o = Outcome::default();
    count(&lines, &mut o);
    let stopped = format!("vm {vm}: stopped");
    let stop = serial.lines().find_map(|l| l.strip_prefix(&stopped));
    match stop {
        Some(rest) => {
            let rest = rest.trim_start_matches(':').trim();
            let code = rest
                .strip_prefix("exit code ")
                .filter(|r| r.contains("(port 0xf4)"))
                .and_then(|r| r.split_whitespace().next())
                .and_then(|c| c.parse::<u32>().ok());
            o.ticks = rest
                .split_once(" after ")
                .and_then(|(_, t)| t.split_whitespace().next())
                .and_then(|t| t.parse().ok());
            match code {
                Some(c) => {
                    let status = (c << 1) | 1;
                    o.status = Some(status);
                    o.verdict = verdict_of(status).to_owned();
                }
                None => {
                    if rest.contains("run budget") {
                        o.verdict = "TIMEOUT".into();
                        // "run budget of N ticks exhausted (budget= module argument)".
                        let ticks = rest.split_whitespace().nth(3).unwrap_or("its");
                        o.stop = Some(format!("used its {ticks} ticks"));
                    } else {
                        o.verdict = "CRASH".into();
                        o.stop = Some(rest.to_owned());
                    }
                }
            }
        }
        None => {
            o.verdict = "TIMEOUT".into();
            o.stop = Some("the hypervisor's run ended before the VM stopped".into());
        }
    }
    o
}

/// A test ready to run: its kernel, shape, and VM name.
struct Job<'a> {
    test: &'a Test,
    kernel: PathBuf,
    shape: VmShape,
    vcpus: u32,
    mem_mib: u64,
    /// Its run budget in TSC ticks ([`run_budget`]).
    budget: u64,
    /// Its environment module (`TEST_DEVICE=`, [`test_device`]).
    env: PathBuf,
}

/// The VM's memory when the test does not say: upstream's default (QEMU's 128 MiB is what its
/// runner gives, `-m 256` in some tests).
const DEFAULT_MEM_MIB: u64 = 128;
/// Memory for all of a batch's VMs (the Bochs machine has 1 GiB; the hypervisor keeps some).
const BATCH_MEM_MIB: u64 = 768;
/// VMs per batch: enough to spread the BIOS and GRUB over several tests, few enough that a
/// slow test does not hold many others (they share the pCPUs).
const BATCH_VMS: usize = 6;
/// A VM's run budget in TSC ticks (in Bochs, instructions): 400 M, about 15 s of Bochs. The
/// slowest test that ends does so in under 50 M (xsave); the vmexit group's loops and access's
/// page-table permutations need several G, beyond any budget a test run can give.
const RUN_BUDGET: u64 = 400_000_000;

/// The tests that need more than [`RUN_BUDGET`] to end, and how much: each of the vmexit group
/// times its exit in loops that double until one takes 2^30 TSC ticks (`GOAL` in vmexit.c), so
/// 2^31 to 2^32 ticks in all (`vmexit_ipi` and `vmexit_ipi_halt` up to twice that: one
/// iteration, a call on the other vCPU, which halts between calls, costs some 4,000 ticks, so
/// the loop that reaches 2^30 can last 2^31); sieve sieves 10^6 numbers twice (static, then
/// mapped), then 10^8 three times in virtual memory (some 2.3 G instructions each); apic.flat
/// (`xapic`, `x2apic`) waits 10^6 TSC ticks before each of its some 10,000
/// logical-destination IPIs (a blink on hardware, 10^6 instructions in Bochs: some 10 G
/// ticks), then sends 230,000 NMIs, each an exit (about 8 G more);
/// tscdeadline_latency prints the latency of each of its 10,000 timer interrupts, a line each
/// through the emulated UART.
/// Recorded as slow, `cargo xtask test` leaves them out; `cargo xtask kvm-unit-tests` runs them.
const LONG_RUNS: &[(&str, u64)] = &[
    ("vmexit_ipi", 12_000_000_000),
    // Parallel: both vCPUs run its loop (`on_cpus`), and the budget is the VM's, both vCPUs'
    // time: up to 2 x 2^32.
    ("vmexit_cr0_wp", 12_000_000_000),
    ("vmexit_", 5_000_000_000),
    ("sieve", 12_000_000_000),
    ("xapic", 32_000_000_000),
    ("x2apic", 32_000_000_000),
    ("tscdeadline_latency", 2_000_000_000),
    // Its reference-cycle calibration alone runs a billion-iteration `loop`.
    ("pmu", 3_000_000_000),
];

/// Whether a test is told to use the pc-testdev (`TEST_DEVICE=1`; every VM has one,
/// `testdev=on`, and the kernels that drive its ports unconditionally, `ioapic` and `realmode`
/// among them, find it). The kernels also read the variable as "running under KVM": apic.flat
/// (`xapic`, `x2apic`) then tries KVM's paravirtual IPI hypercall, and syscall.flat a 32-bit
/// SYSCALL that only AMD CPUs, or KVM's emulation of them, execute; neither is offered, so
/// those two are told there is none.
fn test_device(t: &Test) -> bool {
    !matches!(t.file.as_str(), "apic.flat" | "syscall.flat")
}

/// The instructions a second of Bochs' CPU time that a batch's run limit assumes (a safety net
/// against a hypervisor that hangs, not a measure): 5 M, where Bochs runs 20 to 30 M, except for
/// kernels that slow Bochs down per instruction. `vmexit_cr0_wp` toggles CR0.WP in a loop, which
/// makes Bochs drop its translations: it runs at some 3 M.
const SLOW_IN_BOCHS: &[(&str, u64)] = &[("vmexit_cr0_wp", 1_000_000)];

/// [`SLOW_IN_BOCHS`]' rate for a test, else 5 M instructions a second.
fn worst_rate(name: &str) -> u64 {
    SLOW_IN_BOCHS
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(5_000_000, |&(_, rate)| rate)
}

/// A test's run budget: [`LONG_RUNS`], else [`RUN_BUDGET`].
fn run_budget(name: &str) -> u64 {
    LONG_RUNS
        .iter()
        .find(|(prefix, _)| name.starts_with(prefix))
        .map_or(RUN_BUDGET, |&(_, b)| b)
}

/// The suite's directory: `--dir`, else KVM_UNIT_TESTS_DIR, else ../shared/kvm-unit-tests.
pub fn suite_dir(arg: Option<&Path>) -> PathBuf {
    match (arg, std::env::var_os("KVM_UNIT_TESTS_DIR")) {
        (Some(d), _) => d.to_owned(),
        (None, Some(d)) => PathBuf::from(d),
        (None, None) => crate::workspace_root().join(DEFAULT_DIR),
    }
}

/// One row of the table.
#[derive(Clone, Debug)]
pub struct Row {
    pub name: String,
    pub skip: Option<String>,
    pub hvprof: Option<Outcome>,
    pub baseline: Option<Outcome>,
    pub seconds: f64,
}

/// Kernels that run in a boot of their own: `eventinj` checks NMI blocking to the instruction,
/// and Bochs 2.7 keeps a CPU's virtual-NMI blocking across VM entries whose guest state has it
/// clear (its VM entry masks the event when the interruptibility state sets bit 3 but never
/// unmasks it; later Bochs unmask first): with other VMs taking turns on its pCPUs, a guest that
/// left its NMI handler finds NMIs blocked again until its next IRET, and eventinj's second
/// self-NMI comes late (traced: blocking set again between two of its I/O exits, with no NMI
/// injected). hvprof writes the state the SDM asks for (Vol. 3C §27.3.1.5, §27.7.1.2).
const ALONE: &[&str] = &["eventinj"];

/// The jobs in batches, one hypervisor boot each: first every long run ([`LONG_RUNS`]) alone
/// (the vmexit group's figures are the cost of an exit, not of sharing the pCPUs) and the
/// kernels of [`ALONE`], then the others, up to [`BATCH_VMS`] and [`BATCH_MEM_MIB`] a batch, in
/// `jobs`' order.
fn batches<'a>(jobs: &'a [Job<'a>]) -> Vec<Vec<&'a Job<'a>>> {
    let alone = |j: &Job| j.budget > RUN_BUDGET || ALONE.contains(&j.test.name.as_str());
    let mut out: Vec<Vec<&Job>> = jobs.iter().filter(|j| alone(j)).map(|j| vec![j]).collect();
    let first_quick = out.len();
    let mut mem = 0;
    for j in jobs.iter().filter(|j| !alone(j)) {
        let full = out.len() == first_quick
            || out
                .last()
                .is_some_and(|b| b.len() >= BATCH_VMS || mem + j.mem_mib > BATCH_MEM_MIB);
        if full {
            out.push(Vec::new());
            mem = 0;
        }
        mem += j.mem_mib;
        if let Some(b) = out.last_mut() {
            b.push(j);
        }
    }
    out
}

/// A batch's outcomes, one per job, and its seconds.
type BatchResult = Result<(Vec<Outcome>, f64)>;

/// Boots one batch under hvprof in Bochs; each job's outcome and the batch's seconds.
fn run_batch(hypervisor: &Path, batch: &[&Job], dir: &Path) -> BatchResult {
    std::fs::create_dir_all(dir)?;
    let name_of = |p: &Path| -> Result<String> {
        Ok(p.file_name()
            .and_then(|n| n.to_str())
            .context("environment module name")?
            .to_owned())
    };
    // Each VM's kernel under the test's name: several tests share a kernel, and an ISO's
    // modules need names of their own.
    let kernels = dir.join("kernels");
    std::fs::create_dir_all(&kernels)?;
    let mut modules: Vec<IsoModule> = Vec::new();
    let mut envs: Vec<&Path> = Vec::new();
    for j in batch {
        let file = format!("{}.flat", j.test.name);
        let copy = kernels.join(&file);
        std::fs::copy(&j.kernel, &copy)
            .with_context(|| format!("cannot copy {}", j.kernel.display()))?;
        let env_name = name_of(&j.env)?;
        if !envs.contains(&j.env.as_path()) {
            envs.push(&j.env);
        }
        modules.push(IsoModule::new(
                &copy,
                format!(
                    "{file} vm={} mem={}M vcpus={} apic=on testdev=on{} format=multiboot initrd={env_name} budget={} {}",
                    j.test.name,
                    j.mem_mib,
                    j.vcpus,
                    // The PMU tests get the virtual PMU.
                    if j.test.groups.iter().any(|g| g == "pmu") {
                        " vpmu=cpu"
                    } else {
                        ""
                    },
                    j.budget,
                    j.shape.append
                )
                .trim_end()
                .to_owned(),
            ));
    }
    for env in envs {
        modules.push(IsoModule::new(env, name_of(env)?));
    }
    let iso = dir.join("kvm-unit-tests.iso");
    build_iso(
        &IsoSpec {
            hypervisor,
            // A sample every 20 ms: each batch keeps a profile, and its end does not spend
            // minutes sending one through the emulated UART (six VMs stopped at their budgets
            // made 600 K samples at the default 1 ms, whose export outlasted their run).
            cmdline: "export=end period=20ms",
            modules: &modules,
        },
        &dir.join("iso"),
        &iso,
    )?;
    // Without the CPUs' informational messages: the kernels that time TPR writes and
    // TSC-deadline interrupts in loops made Bochs log three lines every few instructions.
    let emulator = Emulator::bochs(qemu_tests::emulator::DEFAULT_BOCHS_MODEL).without_cpu_info();
    let files = RunFiles::in_dir(dir, &iso, &emulator);
    let cpus = batch.iter().map(|j| j.vcpus).max().unwrap_or(1).min(2);
    // A safety net against a hypervisor that hangs, not a measure: the VMs' budgets at their
    // worst rate ([`worst_rate`]), and the BIOS, GRUB and the export besides; twice that of
    // wall time.
    let cpu_limit = Duration::from_secs(
        300 + batch
            .iter()
            .map(|j| j.budget / worst_rate(&j.test.name))
            .sum::<u64>(),
    );
    let start = Instant::now();
    let outcome = launch(
        &Launch {
            emulator: &emulator,
            cpus,
            files: &files,
            end_marker: DEFAULT_END_MARKER,
            limit: Some(Limit {
                cpu: cpu_limit,
                wall: 2 * cpu_limit,
            }),
        },
        &mut |_| {},
    )?;
    let seconds = start.elapsed().as_secs_f64();
    let capture = files.capture().context("cannot read the capture")?;
    std::fs::write(dir.join("capture.log"), &capture)?;
    let serial = String::from_utf8_lossy(&capture).into_owned();
    if !matches!(outcome.end, RunEnd::Marker) {
        eprintln!(
            "kvm-unit-tests: batch in {}: {}",
            dir.display(),
            outcome.end.describe(DEFAULT_END_MARKER)
        );
    }
    Ok((
        batch
            .iter()
            .map(|j| outcome_under_hvprof(&serial, &j.test.name))
            .collect(),
        seconds,
    ))
}

/// The same kernel in QEMU TCG without hvprof, as upstream's runner boots it (`-kernel`,
/// isa-debug-exit at 0xf4, pc-testdev, the test's own options).
fn run_baseline(job: &Job, dir: &Path) -> Result<Outcome> {
    std::fs::create_dir_all(dir)?;
    let mut cmd = Command::new("qemu-system-x86_64");
    // TCG's `max` model (every feature TCG emulates) unless the test names its own: the closest
    // TCG comes to the Haswell Bochs emulates under hvprof.
    if job.shape.cpu.is_none() {
        cmd.args(["-cpu", "max"]);
    }
    cmd.args(["-nodefaults", "-nographic", "-no-reboot", "-accel", "tcg"])
        .args(["-device", "isa-debug-exit,iobase=0xf4,iosize=0x4"])
        .args(["-device", "pc-testdev"])
        .args(["-serial", "stdio", "-m", &format!("{}", job.mem_mib)])
        .args(["-smp", &job.vcpus.to_string()])
        .arg("-kernel")
        .arg(&job.kernel);
    // The test's own QEMU options, less those given above.
    if !job.shape.append.is_empty() {
        cmd.args(["-append", &job.shape.append]);
    }
    let words = shell_words(&job.test.extra_params);
    let mut i = 0;
    while i < words.len() {
        match words[i].as_str() {
            "-m" | "-smp" | "-append" => i += 2,
            _ => {
                cmd.arg(&words[i]);
                i += 1;
            }
        }
    }
    if job.test.extra_params.contains("-initrd") {
        // The test's own module stands instead of the environment.
    } else {
        cmd.arg("-initrd").arg(&job.env);
    }
    let out = run_with_timeout(cmd, Duration::from_secs(90), dir)?;
    std::fs::write(dir.join("serial.log"), &out.0)?;
    let text = String::from_utf8_lossy(&out.0).into_owned();
    let lines: Vec<&str> = text.lines().collect();
    let mut o = Outcome::default();
    count(&lines, &mut o);
    match out.1 {
        Some(status) => {
            o.status = Some(status);
            o.verdict = verdict_of(status).to_owned();
        }
        None => o.verdict = "TIMEOUT".into(),
    }
    Ok(o)
}

/// Runs `cmd` with its stdout captured; kills it after `limit`. (stdout, exit status).
fn run_with_timeout(
    mut cmd: Command,
    limit: Duration,
    out_dir: &Path,
) -> Result<(Vec<u8>, Option<u32>)> {
    let out_path = out_dir.join("qemu.out");
    let file = std::fs::File::create(&out_path)?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start qemu-system-x86_64 (the baseline's emulator)")?;
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s.code().map(|c| c as u32);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = std::fs::read(&out_path).unwrap_or_default();
    let _ = std::fs::remove_file(&out_path);
    Ok((out, status))
}

fn describe(o: &Outcome) -> String {
    let mut s = format!("{} {}/{}/{}", o.verdict, o.pass, o.fail, o.skip);
    if let Some(stop) = &o.stop {
        let short: String = stop.chars().take(60).collect();
        s.push_str(&format!(" ({short})"));
    }
    s
}

/// Prints the table: test, hvprof's result and counts (pass/fail/skip), the baseline's, time.
pub fn print_table(rows: &[Row]) {
    let width = rows.iter().map(|r| r.name.len()).max().unwrap_or(4).max(4);
    println!(
        "{:<width$}  {:<40}  {:<24}  {:>6}",
        "test", "hvprof (Bochs): result pass/fail/skip", "baseline (QEMU TCG)", "time"
    );
    for r in rows {
        match &r.skip {
            Some(why) => println!("{:<width$}  skipped: {why}", r.name),
            None => println!(
                "{:<width$}  {:<40}  {:<24}  {:>5.1}s",
                r.name,
                r.hvprof.as_ref().map(describe).unwrap_or_default(),
                r.baseline
                    .as_ref()
                    .map(describe)
                    .unwrap_or_else(|| "-".into()),
                r.seconds
            ),
        }
    }
    let count = |f: &dyn Fn(&Row) -> bool| rows.iter().filter(|r| f(r)).count();
    println!(
        "kvm-unit-tests: {} tests: {} pass, {} fail, {} skipped by the test, {} timed out or crashed under hvprof; {} not run (features hvprof does not offer); baseline: {} pass",
        rows.len(),
        count(&|r| r.hvprof.as_ref().is_some_and(|o| o.verdict == "PASS")),
        count(&|r| r.hvprof.as_ref().is_some_and(|o| o.verdict == "FAIL")),
        count(&|r| r.hvprof.as_ref().is_some_and(|o| o.verdict == "SKIP")),
        count(&|r| r
            .hvprof
            .as_ref()
            .is_some_and(|o| o.verdict == "TIMEOUT" || o.verdict == "CRASH")),
        count(&|r| r.skip.is_some()),
        count(&|r| r.baseline.as_ref().is_some_and(|o| o.verdict == "PASS")),
    );
}

/// Every test of the build in `dir`: `unittests.cfg`'s, then the kernels it does not name
/// ([`with_unlisted`]).
fn suite_tests(dir: &Path) -> Result<Vec<Test>> {
    let cfg_path = dir.join("x86/unittests.cfg");
    let text = std::fs::read_to_string(&cfg_path)
        .with_context(|| format!("cannot read {}", cfg_path.display()))?;
    let flats: Vec<String> = std::fs::read_dir(dir.join("x86"))
        .with_context(|| format!("cannot list {}", dir.join("x86").display()))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    Ok(with_unlisted(parse_cfg(&text), &flats))
}

/// Runs the suite but the tests named in `leave_out`; the rows in `unittests.cfg`'s order.
pub fn run_suite_except(
    dir: &Path,
    filter: Option<&str>,
    baseline: bool,
    leave_out: &[String],
) -> Result<Vec<Row>> {
    let tests: Vec<Test> = suite_tests(dir)?
        .into_iter()
        .filter(|t| filter.is_none_or(|f| f.split(',').any(|f| t.name.contains(f))))
        .filter(|t| !leave_out.contains(&t.name))
        .collect();
    if tests.is_empty() {
        bail!(
            "no test of {} matches {:?}",
            dir.join("x86/unittests.cfg").display(),
            filter
        );
    }
    ensure_tools()?;
    let hypervisor = build_hypervisor(false)?;
    let out = target_dir().join("kvm-unit-tests");
    std::fs::create_dir_all(&out)?;
    // The kernels' environment (their one Multiboot module), read instead of probing: whether
    // to use the pc-testdev ([`test_device`]).
    let with_testdev = out.join("testdev.env");
    std::fs::write(&with_testdev, "TEST_DEVICE=1\n")?;
    let without_testdev = out.join("no-testdev.env");
    std::fs::write(&without_testdev, "TEST_DEVICE=0\n")?;
    let mut skips: BTreeMap<String, String> = BTreeMap::new();
    let mut jobs = Vec::new();
    for t in &tests {
        let kernel = dir.join("x86").join(&t.file);
        if let Some(why) = skip_reason(t, kernel.is_file()) {
            skips.insert(t.name.clone(), why);
            continue;
        }
        let mut shape = vm_shape(&t.extra_params);
        shape.append = [t.test_args.as_str(), shape.append.as_str()]
            .iter()
            .filter(|a| !a.is_empty())
            .copied()
            .collect::<Vec<_>>()
            .join(" ");
        let vcpus = shape.smp.unwrap_or(t.smp).clamp(1, 8);
        let mem_mib = shape.mem_mib.unwrap_or(DEFAULT_MEM_MIB).clamp(32, 512);
        jobs.push(Job {
            test: t,
            kernel,
            shape,
            vcpus,
            mem_mib,
            budget: run_budget(&t.name),
            env: if test_device(t) {
                with_testdev.clone()
            } else {
                without_testdev.clone()
            },
        });
    }
    let mut results: BTreeMap<String, (Outcome, f64)> = BTreeMap::new();
    let groups = batches(&jobs);
    // One batch per core (each Bochs runs on one core), each core taking the next batch as it
    // finishes one: the long runs, first and alone, overlap the quick batches.
    let jobs_at_once = qemu_tests::runner::default_jobs();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let finished: std::sync::Mutex<Vec<(usize, BatchResult)>> = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..jobs_at_once.min(groups.len()) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(b) = groups.get(i) else { break };
                    let dir = out.join(format!("batch-{i}"));
                    let names: Vec<&str> = b.iter().map(|j| j.test.name.as_str()).collect();
                    eprintln!(
                        "kvm-unit-tests: booting {} in {}",
                        names.join(", "),
                        dir.display()
                    );
                    let r = run_batch(&hypervisor, b, &dir);
                    if let Ok(mut f) = finished.lock() {
                        f.push((i, r));
                    }
                }
            });
        }
    });
    let mut finished = finished.into_inner().unwrap_or_default();
    finished.sort_by_key(|(i, _)| *i);
    for (i, r) in finished {
        let names: Vec<String> = groups[i].iter().map(|j| j.test.name.clone()).collect();
        match r {
            Ok((outs, seconds)) => {
                for (n, o) in names.iter().zip(outs) {
                    results.insert(n.clone(), (o, seconds / names.len() as f64));
                }
            }
            // A batch that did not run: its tests have no result, and say why.
            Err(e) => {
                for n in names {
                    let o = Outcome {
                        verdict: "CRASH".into(),
                        stop: Some(format!(
                            "the batch in {} did not run: {e:#}",
                            out.join(format!("batch-{i}")).display()
                        )),
                        ..Outcome::default()
                    };
                    results.insert(n, (o, 0.0));
                }
            }
        }
    }
    let mut base: BTreeMap<String, Outcome> = BTreeMap::new();
    if baseline {
        // One QEMU per core.
        for chunk in jobs.chunks(jobs_at_once) {
            let outs: Vec<Result<Outcome>> = std::thread::scope(|s| {
                let spawned: Vec<_> = chunk
                    .iter()
                    .map(|j| {
                        let dir = out.join("baseline").join(&j.test.name);
                        s.spawn(move || run_baseline(j, &dir))
                    })
                    .collect();
                spawned
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| bail!("a baseline thread panicked"))
                    })
                    .collect()
            });
            for (j, o) in chunk.iter().zip(outs) {
                base.insert(j.test.name.clone(), o?);
            }
        }
    }
    Ok(tests
        .iter()
        .map(|t| {
            let (hvprof, seconds) = match results.remove(&t.name) {
                Some((o, s)) => (Some(o), s),
                None => (None, 0.0),
            };
            Row {
                name: t.name.clone(),
                skip: skips.remove(&t.name),
                hvprof,
                baseline: base.remove(&t.name),
                seconds,
            }
        })
        .collect())
}

/// The results recorded as expected (`xtask/kvm-unit-tests.expected`): per test its verdict
/// under hvprof and its pass/fail/skip counts, one `name verdict pass fail skip [slow]` line
/// each; `slow` marks a test that runs longer than [`SLOW_TICKS`].
pub const EXPECTED: &str = include_str!("../kvm-unit-tests.expected");

/// A test that runs longer than this (TSC ticks: in Bochs, instructions; about 10 s of Bochs) is
/// left out of `cargo xtask test`, as is one that used its whole budget. msr.flat's 1052 checks
/// (207 M) stay in.
pub const SLOW_TICKS: u64 = 250_000_000;

/// The expected results: name -> (verdict, pass, fail, skip).
pub fn parse_expected(text: &str) -> BTreeMap<String, (String, u32, u32, u32)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            let n = |i: usize| w.get(i).and_then(|x| x.parse().ok()).unwrap_or(0);
            Some((
                w.first()?.to_string(),
                (w.get(1)?.to_string(), n(2), n(3), n(4)),
            ))
        })
        .collect()
}

/// The tests the expected results mark `slow`.
fn slow_in(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split_whitespace().nth(5) == Some("slow"))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

/// The expected-results file for `rows` over what `recorded` holds: what `--record` writes.
/// A test of `rows` gets its new line; a recorded test `rows` does not have (a run with
/// `--filter`) keeps its old one.
pub fn expected_file(rows: &[Row], recorded: &str) -> String {
    let mut lines: BTreeMap<String, String> = recorded
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| Some((l.split_whitespace().next()?.to_owned(), l.to_owned())))
        .collect();
    for r in rows {
        let Some(o) = &r.hvprof else {
            continue;
        };
        let slow = o.verdict == "TIMEOUT"
            || o.ticks.is_some_and(|t| t > SLOW_TICKS)
            || run_budget(&r.name) > RUN_BUDGET;
        lines.insert(
            r.name.clone(),
            format!(
                "{} {} {} {} {}{}",
                r.name,
                o.verdict,
                o.pass,
                o.fail,
                o.skip,
                if slow { " slow" } else { "" }
            ),
        );
    }
    let mut s = String::from(
        "# kvm-unit-tests under hvprof in Bochs: name verdict pass fail skip [slow], as\n\
         # `cargo xtask kvm-unit-tests --record` wrote them; `cargo xtask test` checks them\n\
         # (docs/KVM-UNIT-TESTS.md). slow: over 250 M ticks or its whole budget, left out of\n\
         # `cargo xtask test`, as is every long run (LONG_RUNS in kvm_unit_tests.rs).\n",
    );
    for l in lines.values() {
        s.push_str(l);
        s.push('\n');
    }
    s
}

/// Where `rows` differ from `expected`: one line each (empty: as recorded).
pub fn differences(
    rows: &[Row],
    expected: &BTreeMap<String, (String, u32, u32, u32)>,
) -> Vec<String> {
    let mut out = Vec::new();
    for r in rows {
        let Some(o) = &r.hvprof else {
            continue;
        };
        let got = (o.verdict.clone(), o.pass, o.fail, o.skip);
        match expected.get(&r.name) {
            None => out.push(format!(
                "{}: {} {}/{}/{}, and no result recorded for it in xtask/kvm-unit-tests.expected",
                r.name, got.0, got.1, got.2, got.3
            )),
            Some(e) if *e != got => out.push(format!(
                "{}: {} {}/{}/{} where {} {}/{}/{} was recorded",
                r.name, got.0, got.1, got.2, got.3, e.0, e.1, e.2, e.3
            )),
            Some(_) => {}
        }
    }
    out
}

/// The `cargo xtask test` stage: every test hvprof runs, except those recorded as slow (their
/// whole run budget, or over [`SLOW_TICKS`]: `cargo xtask kvm-unit-tests` runs them), without the
/// baseline; fails on any result that differs from the recorded one.
pub fn test_stage(dir: &Path) -> Result<()> {
    let expected = parse_expected(EXPECTED);
    if expected.is_empty() {
        println!(
            "kvm-unit-tests: not run: no results recorded in xtask/kvm-unit-tests.expected yet (`cargo xtask kvm-unit-tests --record` records them)"
        );
        return Ok(());
    }
    let slow = slow_tests(dir)?;
    let rows = run_suite_except(dir, None, false, &slow)?;
    print_table(&rows);
    if !slow.is_empty() {
        println!(
            "kvm-unit-tests: not run here, recorded as slow (over 250 M ticks, or their whole budget), or long runs: {}",
            slow.join(", ")
        );
    }
    let diffs = differences(&rows, &expected);
    if diffs.is_empty() {
        return Ok(());
    }
    for d in &diffs {
        println!("kvm-unit-tests: {d}");
    }
    bail!(
        "{} kvm-unit-tests results differ from xtask/kvm-unit-tests.expected",
        diffs.len()
    )
}

/// The tests `cargo xtask test` leaves out: those recorded as slow, and the long runs
/// ([`LONG_RUNS`]) whether recorded or not.
fn slow_tests(dir: &Path) -> Result<Vec<String>> {
    let mut slow = slow_in(EXPECTED);
    for t in suite_tests(dir)? {
        if run_budget(&t.name) > RUN_BUDGET && !slow.contains(&t.name) {
            slow.push(t.name);
        }
    }
    Ok(slow)
}

/// `cargo xtask kvm-unit-tests`.
pub fn kvm_unit_tests(
    dir: Option<&Path>,
    filter: Option<&str>,
    baseline: bool,
    record: bool,
    quick: bool,
) -> Result<ExitCode> {
    let dir = suite_dir(dir);
    if !dir.join("x86/unittests.cfg").is_file() {
        bail!(
            "no kvm-unit-tests build at {} (x86/unittests.cfg): give --dir or KVM_UNIT_TESTS_DIR",
            dir.display()
        );
    }
    let leave_out = if quick { slow_tests(&dir)? } else { Vec::new() };
    let rows = run_suite_except(&dir, filter, baseline, &leave_out)?;
    print_table(&rows);
    let unrun = rows
        .iter()
        .filter(|r| {
            r.hvprof
                .as_ref()
                .and_then(|o| o.stop.as_deref())
                .is_some_and(|s| s.starts_with("the batch in"))
        })
        .count();
    if record && unrun > 0 {
        bail!("{unrun} tests' batches did not run: nothing recorded");
    }
    if record {
        let path = crate::workspace_root().join("xtask/kvm-unit-tests.expected");
        let recorded = std::fs::read_to_string(&path).unwrap_or_default();
        std::fs::write(&path, expected_file(&rows, &recorded))?;
        println!("kvm-unit-tests: results recorded in {}", path.display());
    } else {
        for d in differences(&rows, &parse_expected(EXPECTED)) {
            println!("kvm-unit-tests: {d}");
        }
    }
    println!(
        "kvm-unit-tests: serial logs and captures in {}",
        target_dir().join("kvm-unit-tests").display()
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CFG: &str = "\
# a comment
[setjmp]
file = setjmp.flat

[vmexit_cpuid]
file = vmexit.flat
test_args = 'cpuid'
qemu_params = -m 256
groups = vmexit

[smptest3]
file = smptest.flat
smp = 3

[vmx]
file = vmx.flat
extra_params = -cpu max,+vmx -append \"-exit_monitor_from_l2_test\"
arch = x86_64
groups = vmx nodefault
";

    #[test]
    fn reads_upstreams_list() {
        let t = parse_cfg(CFG);
        assert_eq!(t.len(), 4);
        assert_eq!(
            (t[0].name.as_str(), t[0].file.as_str(), t[0].smp),
            ("setjmp", "setjmp.flat", 1)
        );
        assert_eq!(t[2].smp, 3);
        assert_eq!(t[3].groups, ["vmx", "nodefault"]);
        assert_eq!(t[1].test_args, "cpuid");
        assert_eq!(vm_shape(&t[1].extra_params).mem_mib, Some(256));
        let s = vm_shape(&t[3].extra_params);
        assert_eq!(s.append, "-exit_monitor_from_l2_test");
        assert_eq!(s.cpu.as_deref(), Some("max,+vmx"));
        assert_eq!(vm_shape("-m 2G -smp 4").mem_mib, Some(2048));
        assert_eq!(vm_shape("-smp cpus=4").smp, Some(4));
    }

    #[test]
    fn kernels_no_entry_names_run_with_defaults() {
        let flats = ["dummy.flat", "setjmp.flat", "setjmp.elf", "vmexit.flat"].map(String::from);
        let t = with_unlisted(parse_cfg(CFG), &flats);
        // The four entries (vmexit_cpuid names vmexit.flat), then dummy.
        assert_eq!(t.len(), 5);
        assert_eq!(
            (t[4].name.as_str(), t[4].file.as_str(), t[4].smp),
            ("dummy", "dummy.flat", 1)
        );
        assert!(t[4].test_args.is_empty() && t[4].groups.is_empty());
    }

    #[test]
    fn recording_some_tests_keeps_the_others() {
        let recorded = "# header\nsetjmp PASS 10 0 0\nxapic FAIL 40 3 1 slow\n";
        let row = |name: &str, verdict: &str, ticks| Row {
            name: name.into(),
            skip: None,
            hvprof: Some(Outcome {
                verdict: verdict.into(),
                pass: 1,
                ticks: Some(ticks),
                ..Outcome::default()
            }),
            baseline: None,
            seconds: 0.0,
        };
        let text = expected_file(
            &[
                row("setjmp", "FAIL", 1000),
                row("vmexit_cpuid", "PASS", 1000),
            ],
            recorded,
        );
        let got = parse_expected(&text);
        assert_eq!(got["setjmp"], ("FAIL".into(), 1, 0, 0), "the new result");
        assert_eq!(got["xapic"], ("FAIL".into(), 40, 3, 1), "kept");
        assert!(slow_in(&text).contains(&"xapic".to_owned()));
        assert!(
            slow_in(&text).contains(&"vmexit_cpuid".to_owned()),
            "a long run is slow whatever its ticks"
        );
        assert!(!slow_in(&text).contains(&"setjmp".to_owned()));
    }

    #[test]
    fn long_runs_go_first_and_alone() {
        let tests = parse_cfg(CFG);
        let job = |t: &'static Test| Job {
            test: t,
            kernel: PathBuf::new(),
            shape: VmShape::default(),
            vcpus: t.smp,
            mem_mib: DEFAULT_MEM_MIB,
            budget: run_budget(&t.name),
            env: PathBuf::new(),
        };
        let tests: &'static [Test] = Box::leak(tests.into_boxed_slice());
        let jobs: Vec<Job> = tests.iter().chain(tests).map(job).collect();
        let b = batches(&jobs);
        let names = |b: &Vec<&Job>| b.iter().map(|j| j.test.name.clone()).collect::<Vec<_>>();
        // vmexit_cpuid twice, alone each time, first; the six others in one batch.
        assert_eq!(b.len(), 3, "{:?}", b.iter().map(names).collect::<Vec<_>>());
        assert_eq!(names(&b[0]), ["vmexit_cpuid"]);
        assert_eq!(names(&b[1]), ["vmexit_cpuid"]);
        assert_eq!(b[2].len(), 6);
    }

    #[test]
    fn the_long_loops_get_a_longer_budget() {
        assert_eq!(run_budget("setjmp"), RUN_BUDGET);
        assert!(
            run_budget("vmexit_cpuid") >= 1 << 32,
            "2^31 to 2^32 ticks of loops"
        );
        assert!(run_budget("sieve") > RUN_BUDGET);
    }

    #[test]
    fn skips_what_hvprof_does_not_offer_with_the_reason() {
        let t = parse_cfg(CFG);
        assert_eq!(skip_reason(&t[0], true), None);
        assert!(skip_reason(&t[3], true).unwrap().contains("nested VMX"));
        assert!(
            skip_reason(&t[0], false)
                .unwrap()
                .contains("not in this build")
        );
    }

    #[test]
    fn reads_a_vms_result_from_the_serial_log() {
        let log = "\
[setjmp] enabling apic
[setjmp] PASS: actual 0 == expected 0
[other] FAIL: not mine
[setjmp] SKIP: no feature
[setjmp] FAIL: one
[setjmp] SUMMARY: 3 tests, 1 unexpected failures, 1 skipped
vm setjmp: stopped: exit code 1 (port 0xf4) after 100 ticks
vm other: stopped: run budget of 5 ticks exhausted (budget= module argument)
vm crash: stopped: triple fault
";
        let o = outcome_under_hvprof(log, "setjmp");
        assert_eq!((o.pass, o.fail, o.skip), (1, 1, 1));
        assert_eq!((o.verdict.as_str(), o.status), ("FAIL", Some(3)));
        assert_eq!(
            o.summary.as_deref(),
            Some("SUMMARY: 3 tests, 1 unexpected failures, 1 skipped")
        );
        assert_eq!(outcome_under_hvprof(log, "other").verdict, "TIMEOUT");
        assert_eq!(outcome_under_hvprof(log, "crash").verdict, "CRASH");
        assert_eq!(outcome_under_hvprof(log, "absent").verdict, "TIMEOUT");
        let pass = "vm t: stopped: exit code 0 (port 0xf4) after 1 ticks\n";
        assert_eq!(outcome_under_hvprof(pass, "t").verdict, "PASS");
        let skip = "vm t: stopped: exit code 38 (port 0xf4) after 1 ticks\n";
        assert_eq!(outcome_under_hvprof(skip, "t").verdict, "SKIP");
    }

    #[test]
    fn shell_words_keep_quoted_words() {
        assert_eq!(
            shell_words("-append 'a b' -cpu \"x,+y\" ''"),
            ["-append", "a b", "-cpu", "x,+y", ""]
        );
    }
}
