//! Scenarios and the parallel runner.

use std::fmt;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::emulator::{Emulator, RunFiles};
use crate::iso::{IsoModule, IsoSpec, build_iso, link_or_copy};
use crate::log::SerialLog;
use crate::process::{self, Launch, RunEnd};

/// The line the hypervisor prints last, and the default end of a run.
pub const DEFAULT_END_MARKER: &str = "hvprof: power off";

/// A scenario's verdict on a serial log: `Err` says what was wrong.
pub type Check = Box<dyn Fn(&SerialLog) -> Result<(), String> + Send + Sync>;

/// Where a module's bytes come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModuleSource {
    /// A copy of the hypervisor ELF under test (a valid ELF64 executable).
    HypervisorCopy,
    /// These bytes.
    Bytes(Vec<u8>),
    /// An existing file.
    File(PathBuf),
    /// A test guest from `guests/` (the binary's name: `hello`, `probe`, `busy`, `attack`).
    Guest(&'static str),
    /// The unwind table of this program (`hvprof-analyze unwind-table`'s derivation), made when
    /// the scenario is built, so it always matches the program the guest runs.
    UnwindTable(PathBuf),
}

/// One boot module of a scenario.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScenarioModule {
    /// The module's file name in the ISO, and the first token of its command line.
    pub file_name: String,
    /// Its contents.
    pub source: ModuleSource,
    /// The rest of its command line (`vm=sample`).
    pub args: String,
}

/// One end-to-end scenario: boot an ISO on an emulator and check the serial log.
pub struct Scenario {
    /// Unique name; also the folder of its artifacts.
    pub name: String,
    /// Where it runs.
    pub emulator: Emulator,
    /// Number of CPUs.
    pub cpus: u32,
    /// The hypervisor's command line.
    pub cmdline: String,
    /// Boot modules, module 0 first.
    pub modules: Vec<ScenarioModule>,
    /// The run ends when a line of the serial log starts with this.
    pub end_marker: String,
    /// The emulator CPU time the run may take on the reference machine (see
    /// [`REFERENCE_BOCHS_SPEED`]); the runner scales it to this machine's measured emulator speed.
    pub budget: Duration,
    /// The verdict on the serial log.
    pub check: Check,
    /// A verdict on the profile (`hvprof-analyze`'s report of the capture), after `check`.
    pub profile: Option<crate::profile::ProfileCheck>,
    /// Programs that follow the run as it happens (`hvprof-analyze record`, `top`): made from
    /// the analyzer and the run's files (their standard output and error are theirs to set;
    /// standard input is closed), started at the emulator's first output, each given
    /// [`LIVE_GRACE`] after the run ends to finish on its own (then stopped, and the scenario
    /// fails).
    pub live: Option<LiveTools>,
}

/// See [`Scenario::live`].
pub type LiveTools = Box<dyn Fn(&LiveRun<'_>) -> Vec<Command> + Send + Sync>;

/// What a live tool is made from.
pub struct LiveRun<'a> {
    /// The `hvprof-analyze` binary.
    pub analyzer: &'a Path,
    /// The run's files.
    pub files: &'a RunFiles,
    /// The hypervisor ELF and the test guests' folder (for symbols).
    pub hypervisor: &'a Path,
    pub guest_dir: &'a Path,
}

/// How long a live tool may run on after the emulator's run ends.
pub const LIVE_GRACE: Duration = Duration::from_secs(60);

impl fmt::Debug for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scenario")
            .field("name", &self.name)
            .field("emulator", &self.emulator)
            .field("cpus", &self.cpus)
            .field("cmdline", &self.cmdline)
            .field("modules", &self.modules)
            .field("end_marker", &self.end_marker)
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

impl Scenario {
    /// A scenario with 1 CPU, an empty command line, no modules, the default end marker, the
    /// emulator's default budget, and a check that accepts everything.
    pub fn new(name: &str, emulator: Emulator) -> Self {
        let budget = emulator.default_budget();
        Self {
            name: name.to_owned(),
            emulator,
            cpus: 1,
            cmdline: String::new(),
            modules: Vec::new(),
            end_marker: DEFAULT_END_MARKER.to_owned(),
            budget,
            check: Box::new(|_| Ok(())),
            profile: None,
            live: None,
        }
    }

    /// Adds a check of the run's profile.
    #[must_use]
    pub fn profile(
        mut self,
        check: impl Fn(&crate::profile::ProfileRun) -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        self.profile = Some(match self.profile.take() {
            None => Box::new(check),
            Some(before) => Box::new(move |run| before(run).and_then(|()| check(run))),
        });
        self
    }

    /// Adds programs that follow the run live (see [`Scenario::live`]).
    #[must_use]
    pub fn live(
        mut self,
        tools: impl Fn(&LiveRun<'_>) -> Vec<Command> + Send + Sync + 'static,
    ) -> Self {
        self.live = Some(Box::new(tools));
        self
    }

    /// Sets the CPU count.
    #[must_use]
    pub fn cpus(mut self, cpus: u32) -> Self {
        self.cpus = cpus;
        self
    }

    /// Sets the hypervisor's command line.
    #[must_use]
    pub fn cmdline(mut self, cmdline: &str) -> Self {
        self.cmdline = cmdline.to_owned();
        self
    }

    /// Adds a module.
    #[must_use]
    pub fn module(mut self, file_name: &str, source: ModuleSource, args: &str) -> Self {
        self.modules.push(ScenarioModule {
            file_name: file_name.to_owned(),
            source,
            args: args.to_owned(),
        });
        self
    }

    /// Sets the end marker.
    #[must_use]
    pub fn end_marker(mut self, marker: &str) -> Self {
        self.end_marker = marker.to_owned();
        self
    }

    /// Sets the budget: emulator CPU time on the reference machine.
    #[must_use]
    pub fn budget(mut self, budget: Duration) -> Self {
        self.budget = budget;
        self
    }

    /// Adds a check of the serial log: every check given runs, in order, and the first that
    /// fails is the verdict.
    #[must_use]
    pub fn check(
        mut self,
        check: impl Fn(&SerialLog) -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        let before = self.check;
        self.check = Box::new(move |log| before(log).and_then(|()| check(log)));
        self
    }
}

/// A scenario's verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The check passed.
    Pass,
    /// It failed, and why.
    Fail(String),
    /// It could not run here, and why.
    Skip(String),
}

/// One scenario's result.
#[derive(Debug, Clone)]
pub struct ScenarioResult {
    /// The scenario's name.
    pub name: String,
    /// The verdict.
    pub verdict: Verdict,
    /// Wall time of the whole scenario (ISO included).
    pub elapsed: Duration,
}

/// The results of one [`run_scenarios`] call, in scenario order.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// One per scenario run (or skipped).
    pub results: Vec<ScenarioResult>,
}

impl Summary {
    fn count(&self, f: impl Fn(&Verdict) -> bool) -> usize {
        self.results.iter().filter(|r| f(&r.verdict)).count()
    }

    /// How many passed.
    pub fn passed(&self) -> usize {
        self.count(|v| matches!(v, Verdict::Pass))
    }

    /// How many failed.
    pub fn failed(&self) -> usize {
        self.count(|v| matches!(v, Verdict::Fail(_)))
    }

    /// How many were skipped.
    pub fn skipped(&self) -> usize {
        self.count(|v| matches!(v, Verdict::Skip(_)))
    }

    /// The closing line: `scenarios: N passed, M failed, K skipped`.
    pub fn closing_line(&self) -> String {
        format!(
            "scenarios: {} passed, {} failed, {} skipped",
            self.passed(),
            self.failed(),
            self.skipped()
        )
    }
}

/// What every scenario of a run shares.
#[derive(Debug, Clone)]
pub struct RunnerConfig {
    /// The hypervisor ELF under test.
    pub hypervisor_elf: PathBuf,
    /// Where the test guests' ELF files are (`target/x86_64-unknown-none/release`).
    pub guest_dir: PathBuf,
    /// The `hvprof-analyze` binary, for scenarios that check a profile.
    pub analyzer: Option<PathBuf>,
    /// Artifacts go to `<out_dir>/<scenario name>/`.
    pub out_dir: PathBuf,
    /// Run only scenarios whose name contains this.
    pub filter: Option<String>,
    /// How many scenarios run at once (0: the core count, at most 2).
    pub jobs: usize,
    /// Budgets are multiplied by this ([`calibrate`]): how much slower this machine runs the
    /// emulator than the reference machine (at least 1).
    pub slowdown: f64,
}

/// Emulated instructions per second of emulator CPU time that Bochs reached on the machine the
/// budgets were set on (the calibration boot of [`calibrate`], on a 2-core machine of the kind CI
/// uses, measured by `cargo xtask test`, which prints it). A machine where Bochs is slower gets
/// proportionally larger limits; a faster one keeps them.
pub const REFERENCE_BOCHS_SPEED: f64 = 32.0e6;

/// Wall time a run may take, in multiples of its CPU-time limit: room for a machine loaded with
/// other work (two emulators and a CPU hog per core on two cores still give each emulator a
/// third of a core), while an emulator that stopped using the CPU is still caught.
pub const WALL_PER_CPU: u32 = 6;

/// What [`calibrate`] measured.
#[derive(Debug, Clone, Copy)]
pub struct Calibration {
    /// Emulated instructions (TSC ticks of the boot CPU at power off).
    pub instructions: u64,
    /// The emulator's CPU time for them.
    pub cpu: Duration,
}

impl Calibration {
    /// Emulated instructions per CPU second.
    pub fn speed(&self) -> f64 {
        self.instructions as f64 / self.cpu.as_secs_f64().max(1e-3)
    }

    /// How many times slower than the reference machine (at least 1).
    pub fn slowdown(&self) -> f64 {
        (REFERENCE_BOCHS_SPEED / self.speed()).max(1.0)
    }
}

/// Measures this machine's Bochs speed: boots the hypervisor alone (no VM) in Bochs, reads the
/// boot CPU's TSC at power off from the log (one tick per emulated instruction) and divides by
/// the emulator's CPU time.
pub fn calibrate(config: &RunnerConfig) -> Result<Calibration> {
    let dir = config.out_dir.join("calibration");
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("cannot remove {}", dir.display()))?;
    }
    let emulator = Emulator::bochs(crate::scenarios::HASWELL);
    let files = RunFiles::in_dir(&dir, &dir.join("hvprof.iso"), &emulator);
    build_iso(
        &IsoSpec {
            hypervisor: &config.hypervisor_elf,
            cmdline: "",
            modules: &[],
        },
        &dir.join("iso"),
        &files.iso,
    )?;
    let outcome = process::launch(
        &Launch {
            emulator: &emulator,
            cpus: 1,
            files: &files,
            end_marker: DEFAULT_END_MARKER,
            limit: Some(process::Limit::cpu(Duration::from_secs(600), WALL_PER_CPU)),
        },
        &mut |_| {},
    )?;
    if outcome.end != RunEnd::Marker {
        anyhow::bail!(
            "the calibration boot did not power off: {}",
            outcome.end.describe(DEFAULT_END_MARKER)
        );
    }
    let instructions = outcome
        .serial
        .lines()
        .find_map(|l| {
            l.strip_prefix(DEFAULT_END_MARKER)?
                .split("TSC ")
                .nth(1)?
                .trim_end_matches(')')
                .parse::<u64>()
                .ok()
        })
        .context("the calibration boot's power-off line has no TSC")?;
    let _ = fs::remove_file(&files.iso);
    Ok(Calibration {
        instructions,
        cpu: outcome.cpu,
    })
}

/// The default parallelism: the core count, at most 2 (each Bochs takes a whole core).
pub fn default_jobs() -> usize {
    thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 2)
}

/// The scenarios `filter` selects (all when `None`).
pub fn select<'a>(scenarios: &'a [Scenario], filter: Option<&str>) -> Vec<&'a Scenario> {
    scenarios
        .iter()
        .filter(|s| filter.is_none_or(|f| s.name.contains(f)))
        .collect()
}

/// Runs the selected scenarios, in parallel up to `config.jobs`, printing one line per scenario
/// as it ends (and, for a failure, the tails of its logs). The caller prints the closing line.
pub fn run_scenarios(scenarios: &[Scenario], config: &RunnerConfig) -> Summary {
    process::install_interrupt_handler();
    let selected = select(scenarios, config.filter.as_deref());
    let jobs = if config.jobs == 0 {
        default_jobs()
    } else {
        config.jobs
    }
    .min(selected.len().max(1));
    // The longest first (by budget), so that no long scenario starts last and runs alone while
    // the other cores wait: the whole run's wall time is then close to its CPU time / jobs.
    let mut order: Vec<usize> = (0..selected.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(selected[i].budget));
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<ScenarioResult>>> = Mutex::new(vec![None; selected.len()]);
    let stdout = Mutex::new(());
    thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| {
                while let Some(&index) = order.get(next.fetch_add(1, Ordering::SeqCst)) {
                    let scenario = selected[index];
                    let (result, details) = if process::interrupted() {
                        let r = ScenarioResult {
                            name: scenario.name.clone(),
                            verdict: Verdict::Skip("interrupted".to_owned()),
                            elapsed: Duration::ZERO,
                        };
                        (r, String::new())
                    } else {
                        run_scenario(scenario, config)
                    };
                    {
                        let _guard = stdout.lock().unwrap_or_else(|e| e.into_inner());
                        let mut out = std::io::stdout().lock();
                        let _ = writeln!(out, "{}", result_line(&result));
                        let _ = out.write_all(details.as_bytes());
                        let _ = out.flush();
                    }
                    results.lock().unwrap_or_else(|e| e.into_inner())[index] = Some(result);
                }
            });
        }
    });
    Summary {
        results: results
            .into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .into_iter()
            .flatten()
            .collect(),
    }
}

/// `PASS name (3.1 s)`, `FAIL name: reason`, `SKIP name: reason`.
pub fn result_line(result: &ScenarioResult) -> String {
    match &result.verdict {
        Verdict::Pass => format!(
            "PASS {} ({:.1} s)",
            result.name,
            result.elapsed.as_secs_f64()
        ),
        Verdict::Fail(reason) => format!("FAIL {}: {reason}", result.name),
        Verdict::Skip(reason) => format!("SKIP {}: {reason}", result.name),
    }
}

/// Writes the scenario's module files into `dir` and returns them as ISO modules.
fn materialize_modules(
    scenario: &Scenario,
    hypervisor: &Path,
    guest_dir: &Path,
    dir: &Path,
) -> Result<Vec<IsoModule>> {
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    scenario
        .modules
        .iter()
        .map(|m| {
            let path = dir.join(&m.file_name);
            match &m.source {
                ModuleSource::HypervisorCopy => link_or_copy(hypervisor, &path)
                    .with_context(|| format!("cannot copy {}", hypervisor.display()))?,
                ModuleSource::Bytes(bytes) => fs::write(&path, bytes)
                    .with_context(|| format!("cannot write {}", path.display()))?,
                ModuleSource::File(src) => link_or_copy(src, &path)
                    .with_context(|| format!("cannot copy {}", src.display()))?,
                ModuleSource::UnwindTable(program) => {
                    let elf = fs::read(program)
                        .with_context(|| format!("cannot read {}", program.display()))?;
                    let (table, _) = linux_guest::unwind::unwind_table(&elf)
                        .with_context(|| program.display().to_string())?;
                    fs::write(&path, table)
                        .with_context(|| format!("cannot write {}", path.display()))?
                }
                ModuleSource::Guest(name) => {
                    let src = guest_dir.join(name);
                    link_or_copy(&src, &path).with_context(|| {
                        format!(
                            "cannot copy the test guest {} (built by xtask?)",
                            src.display()
                        )
                    })?
                }
            }
            IsoModule::with_args(path, &m.args)
        })
        .collect()
}

fn profile_verdict(
    check: &crate::profile::ProfileCheck,
    scenario: &Scenario,
    config: &RunnerConfig,
    files: &RunFiles,
) -> Result<(), String> {
    let analyzer = config.analyzer.clone().ok_or_else(|| {
        format!(
            "{} needs hvprof-analyze, which was not built",
            scenario.name
        )
    })?;
    let capture = files
        .capture()
        .map_err(|e| format!("cannot read the capture in {}: {e}", files.dir.display()))?;
    let path = files.dir.join(crate::profile::CAPTURE);
    fs::write(&path, &capture).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    check(&crate::profile::ProfileRun {
        capture,
        dir: files.dir.clone(),
        analyzer,
        hypervisor: config.hypervisor_elf.clone(),
        guest_dir: config.guest_dir.clone(),
    })
}

/// Runs one scenario; returns its result and, for a failure, the text to print under the
/// result line (the log tails).
pub fn run_scenario(scenario: &Scenario, config: &RunnerConfig) -> (ScenarioResult, String) {
    let start = Instant::now();
    let finish = |verdict: Verdict| ScenarioResult {
        name: scenario.name.clone(),
        verdict,
        elapsed: start.elapsed(),
    };
    if let Err(reason) = scenario.emulator.availability() {
        return (finish(Verdict::Skip(reason)), String::new());
    }
    let dir = config.out_dir.join(&scenario.name);
    let files = RunFiles::in_dir(&dir, &dir.join("hvprof.iso"), &scenario.emulator);
    let outcome = (|| -> Result<_> {
        if dir.exists() {
            fs::remove_dir_all(&dir).with_context(|| format!("cannot remove {}", dir.display()))?;
        }
        let modules = materialize_modules(
            scenario,
            &config.hypervisor_elf,
            &config.guest_dir,
            &dir.join("modules"),
        )?;
        build_iso(
            &IsoSpec {
                hypervisor: &config.hypervisor_elf,
                cmdline: &scenario.cmdline,
                modules: &modules,
            },
            &dir.join("iso"),
            &files.iso,
        )?;
        let mut spawned: Vec<(String, std::io::Result<std::process::Child>)> = Vec::new();
        let mut started = false;
        let outcome = process::launch(
            &Launch {
                emulator: &scenario.emulator,
                cpus: scenario.cpus,
                files: &files,
                end_marker: &scenario.end_marker,
                limit: Some(process::Limit::cpu(
                    scenario.budget.mul_f64(config.slowdown.max(1.0)),
                    WALL_PER_CPU,
                )),
            },
            &mut |_| {
                if started {
                    return;
                }
                started = true;
                if let (Some(tools), Some(analyzer)) = (&scenario.live, &config.analyzer) {
                    let run = LiveRun {
                        analyzer,
                        files: &files,
                        hypervisor: &config.hypervisor_elf,
                        guest_dir: &config.guest_dir,
                    };
                    for mut cmd in tools(&run) {
                        let name = format!("{cmd:?}");
                        cmd.stdin(Stdio::null());
                        spawned.push((name, cmd.spawn()));
                    }
                }
            },
        );
        if scenario.live.is_some() && config.analyzer.is_none() {
            bail!(
                "{} follows its run with hvprof-analyze, which was not built",
                scenario.name
            );
        }
        if scenario.live.is_some() && !started {
            bail!("the emulator wrote nothing: the live tools never started");
        }
        // A run that did not end at its marker (an error, a timeout, Ctrl-C) leaves the tools
        // nothing to finish.
        let ended = matches!(&outcome, Ok(o) if matches!(o.end, RunEnd::Marker));
        for (name, child) in spawned {
            let mut child = child.with_context(|| format!("cannot start {name}"))?;
            if !ended {
                let _ = child.kill();
                let _ = child.wait();
                continue;
            }
            let deadline = Instant::now() + LIVE_GRACE;
            loop {
                if let Some(status) = child.try_wait()? {
                    if !status.success() {
                        bail!("{name} ended with {status}");
                    }
                    break;
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    bail!("{name} was still running {LIVE_GRACE:?} after the run ended");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        outcome
    })();
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(e) => {
            let details = format!("  in {}\n", dir.display());
            return (finish(Verdict::Fail(format!("{e:#}"))), details);
        }
    };
    let verdict = match &outcome.end {
        RunEnd::Marker => match (scenario.check)(&outcome.serial) {
            Ok(()) => match &scenario.profile {
                None => Verdict::Pass,
                Some(check) => match profile_verdict(check, scenario, config, &files) {
                    Ok(()) => Verdict::Pass,
                    Err(reason) => Verdict::Fail(format!("profile: {reason}")),
                },
            },
            Err(reason) => Verdict::Fail(reason),
        },
        RunEnd::Interrupted => Verdict::Skip("interrupted".to_owned()),
        other => Verdict::Fail(other.describe(&scenario.end_marker)),
    };
    let details = match verdict {
        Verdict::Fail(_) => failure_details(scenario, &files, &outcome.serial),
        _ => String::new(),
    };
    // A failed scenario keeps its ISO, to boot again by hand; a passed one keeps its logs and
    // captures only (a Linux scenario's ISO is about 45 MB: the whole run's would be gigabytes),
    // unless HVPROF_KEEP_ISO is set (to trace a passing run in Bochs' debugger, say).
    if verdict == Verdict::Pass && std::env::var_os("HVPROF_KEEP_ISO").is_none() {
        let _ = fs::remove_file(&files.iso);
    }
    (finish(verdict), details)
}

fn failure_details(scenario: &Scenario, files: &RunFiles, serial: &SerialLog) -> String {
    let mut text = format!(
        "  --- {}: {} with {} CPU(s), cmdline {:?}; artifacts in {}\n",
        scenario.name,
        scenario.emulator.label(),
        scenario.cpus,
        scenario.cmdline,
        files.dir.display()
    );
    let tail = serial.tail(30);
    text.push_str(&format!(
        "  --- last {} lines of {}:\n",
        tail.len(),
        files.serial_log.display()
    ));
    for line in tail {
        text.push_str(&format!("  | {}\n", process::strip_control(line)));
    }
    let mut emu_tail = process::file_tail(&files.emulator_log, 10);
    let mut emu_path = &files.emulator_log;
    if emu_tail.is_empty() {
        emu_tail = process::file_tail(&files.emulator_out, 10);
        emu_path = &files.emulator_out;
    }
    text.push_str(&format!(
        "  --- last {} lines of {}:\n",
        emu_tail.len(),
        emu_path.display()
    ));
    for line in emu_tail {
        text.push_str(&format!("  | {line}\n"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builder_defaults() {
        let s = Scenario::new("x", Emulator::QemuTcgBios);
        assert_eq!(s.cpus, 1);
        assert_eq!(s.end_marker, DEFAULT_END_MARKER);
        assert_eq!(s.budget, Duration::from_secs(30));
        assert!((s.check)(&SerialLog::default()).is_ok());
        let s = s
            .cpus(2)
            .cmdline("a=1")
            .module("m.elf", ModuleSource::Bytes(vec![1]), "vm=m");
        assert_eq!((s.cpus, s.cmdline.as_str(), s.modules.len()), (2, "a=1", 1));
    }

    /// Every check given runs: an earlier one that fails is the verdict, a later one too.
    #[test]
    fn checks_add_up() {
        let s = Scenario::new("x", Emulator::QemuTcgBios)
            .check(|log| log.expect("a").map(drop))
            .check(|log| log.expect("b").map(drop));
        assert!((s.check)(&SerialLog::new("a\nb\n")).is_ok());
        assert!(
            (s.check)(&SerialLog::new("b\n")).is_err(),
            "the first check was dropped"
        );
        assert!(
            (s.check)(&SerialLog::new("a\n")).is_err(),
            "the second check was dropped"
        );
    }

    #[test]
    fn summary_lines() {
        let r = |name: &str, verdict| ScenarioResult {
            name: name.into(),
            verdict,
            elapsed: Duration::from_millis(3140),
        };
        let summary = Summary {
            results: vec![
                r("a", Verdict::Pass),
                r("b", Verdict::Fail("no line".into())),
                r("c", Verdict::Skip("no kvm".into())),
                r("d", Verdict::Pass),
            ],
        };
        assert_eq!(
            summary.closing_line(),
            "scenarios: 2 passed, 1 failed, 1 skipped"
        );
        assert_eq!(result_line(&summary.results[0]), "PASS a (3.1 s)");
        assert_eq!(result_line(&summary.results[1]), "FAIL b: no line");
        assert_eq!(result_line(&summary.results[2]), "SKIP c: no kvm");
    }

    #[test]
    fn filter_selects_by_substring() {
        let list = vec![
            Scenario::new("bochs-a", Emulator::bochs("ryzen")),
            Scenario::new("qemu-b", Emulator::QemuTcgBios),
        ];
        assert_eq!(select(&list, None).len(), 2);
        assert_eq!(select(&list, Some("qemu"))[0].name, "qemu-b");
        assert!(select(&list, Some("nothing")).is_empty());
    }
}
