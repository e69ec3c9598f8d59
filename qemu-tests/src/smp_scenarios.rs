//! SMP Linux guests against the paper's steal experiments (Tables 8-11) and lock-holder
//! preemption: a 2-vCPU Debian kernel with local APICs and ACPI tables (`apic=on`) runs two
//! CPU-bound copies of w41 (`hvprof.copies=2`: one bound to each vCPU), or the two threads of
//! `lockholder`, on one pCPU or on two.
//!
//! The figures are read over the workload's own stretch of host time (`report --time`, from its
//! first sample to its last, found in `script`'s output): the boot before it is a different
//! machine (both vCPUs boot, halt and wait on each other).

use std::collections::HashMap;
use std::ffi::OsString;
use std::time::Duration;

use serde_json::Value;

use crate::linux_scenarios::{
    LINUX_PERIOD, check_io_apic, check_smp_boot, check_smp_profile, linux_apic_module, linux_args,
    linux_machine, linux_smp_module,
};
use crate::profile::{ProfileRun, vm};
use crate::runner::Scenario;
use crate::vm_scenarios::{all_of, check_exit_code};

/// One sample as `hvprof-analyze script` prints it: its VM (comm), vCPU (tid - pid - 1), host
/// time in seconds, its function and its guest process (`name[tgid]`, empty when none).
#[derive(Clone, Debug)]
pub struct ScriptSample {
    pub comm: String,
    pub vcpu: i64,
    pub time: f64,
    pub function: String,
    pub process: String,
}

/// `script`'s samples of the scenario's capture.
fn script_samples(run: &ProfileRun) -> Result<Vec<ScriptSample>, String> {
    let mut args: Vec<OsString> = vec!["script".into()];
    args.extend(linux_args());
    let args: Vec<&str> = args.iter().filter_map(|a| a.to_str()).collect();
    let out = run.analyze(&args, "capture-script.log", &run.capture)?;
    parse_script(&String::from_utf8_lossy(&out))
}

/// The samples of `hvprof-analyze script`'s text (see `tools/hvprof-analyze/src/views/script.rs`
/// for the layout).
pub fn parse_script(text: &str) -> Result<Vec<ScriptSample>, String> {
    let mut samples = Vec::new();
    for event in text.split("\n\n") {
        let mut lines = event.lines();
        let Some(head) = lines.next() else { continue };
        let words: Vec<&str> = head.split_whitespace().collect();
        if words.len() < 4 {
            continue;
        }
        let (pid, tid) = words[1].split_once('/').unwrap_or(("0", "0"));
        let number = |s: &str| s.parse::<i64>().unwrap_or(0);
        let Ok(time) = words[3].trim_end_matches(':').parse::<f64>() else {
            continue;
        };
        let frame = |l: &str| {
            let l = l.trim();
            let (_, rest) = l.split_once(' ').unwrap_or(("", l));
            let rest = rest.trim();
            match rest.rsplit_once(" (") {
                Some((f, m)) => (f.to_owned(), m.trim_end_matches(')').to_owned()),
                None => (rest.to_owned(), String::new()),
            }
        };
        let frames: Vec<(String, String)> = lines.map(frame).collect();
        let Some((function, _)) = frames.first().cloned() else {
            continue;
        };
        let process = frames
            .iter()
            .find(|(_, m)| m == "guest.process")
            .map(|(f, _)| f.clone())
            .unwrap_or_default();
        samples.push(ScriptSample {
            comm: words[0].to_owned(),
            vcpu: number(tid) - number(pid) - 1,
            time,
            function,
            process,
        });
    }
    if samples.is_empty() {
        return Err("hvprof-analyze script printed no samples".into());
    }
    Ok(samples)
}

/// The `--time` argument spanning the samples of processes named one of `names`
/// (`name[tgid]`): from the first to just after the last.
pub fn process_window(samples: &[ScriptSample], names: &[&str]) -> Result<String, String> {
    let times = samples
        .iter()
        .filter(|s| {
            names.iter().any(|n| {
                s.process
                    .strip_prefix(n)
                    .is_some_and(|rest| rest.starts_with('['))
            })
        })
        .map(|s| s.time);
    let (first, last) = times.fold((f64::MAX, f64::MIN), |(a, b), t| (a.min(t), b.max(t)));
    if first > last {
        return Err(format!(
            "no samples of a process named {}",
            names.join(" or ")
        ));
    }
    Ok(format!("{first:.6},{:.6}", last + 0.000_001))
}

/// The stretch of host time in which every vCPU runs lockholder's loop: from the latest of the
/// vCPUs' first samples in `spin_wait` or `critical_work` to the earliest of their last. Before
/// it the main thread creates the threads and the kernel moves each to its CPU; after it one
/// thread has finished and exits while the other ends alone. Those are kernel paths (slab
/// allocation, cross-CPU calls), not the loop whose preemptions the scenario knows by
/// construction.
fn lockholder_loop_window(samples: &[ScriptSample]) -> Result<String, String> {
    let mut spans: HashMap<i64, (f64, f64)> = HashMap::new();
    for s in samples.iter().filter(|s| {
        s.process.starts_with("lockholder[")
            && (s.function == "spin_wait" || s.function == "critical_work")
    }) {
        let span = spans.entry(s.vcpu).or_insert((s.time, s.time));
        *span = (span.0.min(s.time), span.1.max(s.time));
    }
    let first = spans.values().map(|s| s.0).fold(f64::MIN, f64::max);
    let last = spans.values().map(|s| s.1).fold(f64::MAX, f64::min);
    if spans.len() != 2 || first >= last {
        return Err(format!(
            "lockholder's loop should run on both vCPUs at once: its samples span {spans:?}"
        ));
    }
    Ok(format!("{first:.6},{:.6}", last + 0.000_001))
}

/// The report over the stretch `--time window`, with more of the analyzer's arguments.
fn report_during(run: &ProfileRun, window: &str, more: &[&str]) -> Result<Value, String> {
    let mut args = linux_args();
    args.push("--time".into());
    args.push(window.into());
    args.extend(more.iter().map(OsString::from));
    let report = run.report_with(None, &args)?;
    if report.get("time").is_none() {
        return Err("the report does not say which stretch of time it shows".into());
    }
    Ok(report)
}

/// The vCPUs of VM `linux` in `report`.
pub(crate) fn vcpus(report: &Value) -> Result<Vec<Value>, String> {
    let v = vm(report, "linux")?
        .get("vcpus")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if v.len() != 2 {
        return Err(format!("{} vCPUs in the report, expected 2", v.len()));
    }
    Ok(v)
}

pub(crate) fn field(v: &Value, k: &str) -> f64 {
    v.pointer(k).and_then(Value::as_f64).unwrap_or(f64::NAN)
}

/// The share (%) of a vCPU's rows whose function (and module) match.
fn share(vcpu: &Value, function: &str, module: Option<&str>) -> f64 {
    vcpu.get("rows")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|r| r.get("function").and_then(Value::as_str) == Some(function))
        .filter(|r| module.is_none_or(|m| r.get("module").and_then(Value::as_str) == Some(m)))
        .filter_map(|r| r.get("percent").and_then(Value::as_f64))
        .sum()
}

/// A vCPU's figures in one line, for the failure messages.
fn summary(v: &Value) -> String {
    format!(
        "vCPU {}: {} samples, idle {:.1}%, steal {:.1}% (exact: idle {:.1}%, steal {:.1}%; differences {:+.2}, {:+.2})",
        field(v, "/vcpu"),
        field(v, "/samples"),
        field(v, "/idle"),
        field(v, "/steal"),
        field(v, "/exact/idle"),
        field(v, "/exact/steal"),
        field(v, "/exact/idle_difference"),
        field(v, "/exact/steal_difference"),
    )
}

/// Samples and scheduling events agree on each vCPU's idle and steal within 1 point.
pub(crate) fn events_agree(vcpus: &[Value]) -> Vec<String> {
    let mut errors = Vec::new();
    for v in vcpus {
        for k in ["/exact/idle_difference", "/exact/steal_difference"] {
            let d = field(v, k).abs();
            if d.is_nan() || d > 1.0 {
                errors.push(format!(
                    "samples and scheduling events disagree by more than 1 point ({k}): {}",
                    summary(v)
                ));
            }
        }
    }
    errors
}

/// w41's 4:1 split holds on each vCPU (work_a 80 % of its w41 samples, within 3 points).
fn w41_splits(vcpus: &[Value]) -> Vec<String> {
    let mut errors = Vec::new();
    for v in vcpus {
        let (a, b) = (
            share(v, "work_a", Some("w41")),
            share(v, "work_b", Some("w41")),
        );
        if a + b < 10.0 || (100.0 * a / (a + b) - 80.0).abs() > 3.0 {
            errors.push(format!(
                "w41 on each vCPU should split 80:20 between work_a and work_b: {a:.1}% and {b:.1}% on {}",
                summary(v)
            ));
        }
    }
    errors
}

/// The two copies of w41: their stretch of host time, each vCPU's figures over it, and the
/// failures every such run shares (samples and events disagree, w41's split is off).
fn w41_copies(run: &ProfileRun) -> Result<(String, Vec<Value>, Vec<String>), String> {
    let samples = script_samples(run)?;
    let window = process_window(&samples, &["w41"])?;
    let report = report_during(run, &window, &[])?;
    let vcpus = vcpus(&report)?;
    let mut errors = events_agree(&vcpus);
    errors.extend(w41_splits(&vcpus));
    Ok((window, vcpus, errors))
}

/// `bochs-linux-smp-steal` (Tables 8/9): two copies of w41 on two vCPUs that share one pCPU.
/// While they run, each vCPU holds the pCPU half the time: its table shows about 50 % steal,
/// nearly all of it `[steal] (on vcpuN)` of the other vCPU, and samples and events agree within 1
/// point.
fn check_steal(run: &ProfileRun) -> Result<(), String> {
    let (window, vcpus, mut errors) = w41_copies(run)?;
    for (i, v) in vcpus.iter().enumerate() {
        let other = format!("(on vcpu{})", 1 - i);
        let (steal, on_other) = (field(v, "/steal"), share(v, "[steal]", Some(&other)));
        // Each vCPU runs every other slice: 50 %, less the stretch's ends (where one copy ran
        // alone) and the hypervisor's own work on the vCPU's exits.
        if !(40.0..=56.0).contains(&steal) || on_other < 38.0 {
            errors.push(format!(
                "over w41's run ({window} s), each vCPU should lose about half its time to the other: [steal] {other} {on_other:.1}%; {}",
                summary(v)
            ));
        }
    }
    all_of(errors.into_iter().map(Err))
}

/// `bochs-linux-smp-pinned` (Tables 10/11): the same two copies, each vCPU on a pCPU of its
/// own: no vCPU waits for the other, so the steal left is the hypervisor's work on the vCPU's
/// own exits (`[steal] (hypervisor)`), and none is of the other vCPU.
fn check_pinned(run: &ProfileRun) -> Result<(), String> {
    let (_, vcpus, mut errors) = w41_copies(run)?;
    for (i, v) in vcpus.iter().enumerate() {
        let other = format!("(on vcpu{})", 1 - i);
        let on_other = share(v, "[steal]", Some(&other)) + share(v, "[steal]", Some("(outside)"));
        let steal = field(v, "/steal");
        let exact = field(v, "/exact/steal");
        if on_other > 0.2 || steal > 3.0 || exact > 0.5 {
            errors.push(format!(
                "pinned to pCPUs of their own, the vCPUs should not wait for each other: [steal] {other} and (outside) {on_other:.2}%; {}",
                summary(v)
            ));
        }
    }
    all_of(errors.into_iter().map(Err))
}

/// `bochs-linux-lock-holder`: lockholder's two threads take turns at a ticket spinlock, one on
/// each vCPU, both vCPUs on one pCPU. A vCPU loses the pCPU at the end of its slice, mostly in
/// `critical_work` with the lock held; the other vCPU's thread then spins in `spin_wait` for the
/// whole of its slice. On the common time axis: while one vCPU spins, the other is `[steal]`,
/// preempted in `critical_work` (its last sample before it lost the pCPU); the rest of the
/// spinning waits for a thread preempted in `spin_wait` that the ticket lock has already chosen
/// (lock-waiter preemption). The report covers the stretch in which both vCPUs run the loop.
fn check_lock_holder(run: &ProfileRun) -> Result<(), String> {
    let samples = script_samples(run)?;
    let window = lockholder_loop_window(&samples)?;
    let report = report_during(run, &window, &["--preemptions"])?;
    let vcpus = vcpus(&report)?;
    let mut errors = events_agree(&vcpus);
    for (i, v) in vcpus.iter().enumerate() {
        let other = format!("(on vcpu{})", 1 - i);
        let spin = share(v, "spin_wait", Some("lockholder"));
        let critical = share(v, "critical_work", Some("lockholder"));
        let steal = share(v, "[steal]", Some(&other));
        // By construction (a critical section of 1.5 slices, the lock handed over in turn):
        // each vCPU holds the pCPU half the time, and spends it a half in each function.
        if spin < 12.0 || critical < 12.0 || steal < 30.0 {
            errors.push(format!(
                "each vCPU should spin, work with the lock held, and lose the pCPU to the other: spin_wait {spin:.1}%, critical_work {critical:.1}%, [steal] {other} {steal:.1}%; {}",
                summary(v)
            ));
        }
    }
    // `--preemptions`: where each vCPU lost its pCPU. By construction, in each three of its
    // slices a vCPU is preempted once in critical_work (the lock held) and twice in spin_wait
    // (waiting for a holder that cannot run), each followed by one slice out: a third of its
    // steal follows a preemption in critical_work, two thirds one in spin_wait. The window
    // starts at a sample, so the preemption that ends a vCPU's first slice in it may have no
    // sample before it (`[no sample]`, once at most); the shares are of the rest. Up to 10
    // points (about three of a vCPU's 35 preemptions) may come in the guest kernel: its tick.
    let preemptions = report
        .get("preemptions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if preemptions.len() != 2 {
        errors.push(format!(
            "report --preemptions: {} vCPUs, expected 2",
            preemptions.len()
        ));
    }
    for c in &preemptions {
        let places = c.get("places").and_then(Value::as_array);
        let places = places.map(Vec::as_slice).unwrap_or_default();
        fn name(p: &Value) -> &str {
            p.get("function").and_then(Value::as_str).unwrap_or("?")
        }
        let place = |f: &str| {
            places
                .iter()
                .filter(|p| name(p) == f)
                .map(|p| (field(p, "/percent"), field(p, "/times")))
                .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1))
        };
        let (unknown, unknown_times) = place("[no sample]");
        let known = |percent: f64| 100.0 * percent / (100.0 - unknown);
        let (critical, spin) = (known(place("critical_work").0), known(place("spin_wait").0));
        if !(18.0..=50.0).contains(&critical) || critical + spin < 90.0 || unknown_times > 1.0 {
            let all: Vec<String> = places
                .iter()
                .map(|p| {
                    let process = p.get("process").and_then(Value::as_str).unwrap_or("");
                    let (percent, times) = (field(p, "/percent"), field(p, "/times"));
                    format!("{} {process} {percent:.1}% ({times} times)", name(p))
                })
                .collect();
            errors.push(format!(
                "vCPU {}: of its steal whose place is known, preempted in critical_work {critical:.1}% and spin_wait {spin:.1}% (expected about a third and two thirds); all places: {}",
                field(c, "/vcpu"),
                all.join(", ")
            ));
        }
    }
    // The time axis: where the other vCPU was, by its latest sample, at each sample of
    // spin_wait.
    let mut latest: HashMap<i64, &str> = HashMap::new();
    let (mut spins, mut holder_preempted) = (0u64, 0u64);
    let mut ordered: Vec<&ScriptSample> = samples.iter().filter(|s| s.comm == "linux").collect();
    ordered.sort_by(|a, b| a.time.total_cmp(&b.time));
    for s in ordered {
        if s.function == "spin_wait" && s.process.starts_with("lockholder[") {
            spins += 1;
            if latest.get(&(1 - s.vcpu)) == Some(&"critical_work") {
                holder_preempted += 1;
            }
        }
        latest.insert(s.vcpu, s.function.as_str());
    }
    // Two thirds by construction (see lockholder.c).
    let part = holder_preempted as f64 / spins.max(1) as f64;
    if spins < 1000 || part < 0.5 {
        errors.push(format!(
            "the spinning should wait for a holder preempted in critical_work: of {spins} spin_wait samples, {holder_preempted} ({:.0}%) while the other vCPU's latest sample was in critical_work",
            100.0 * part
        ));
    }
    all_of(errors.into_iter().map(Err))
}

/// The SMP Linux scenarios of the steal experiments and lock-holder preemption.
pub fn all() -> Vec<Scenario> {
    // A 2 ms slice: about a hundred turns of each vCPU in an emulated second.
    let cmdline = format!("export=end channel=lpt {LINUX_PERIOD} slice=2ms");
    vec![
        linux_apic_module(
            linux_machine("bochs-linux-smp-steal")
                .cmdline(&cmdline)
                .budget(Duration::from_secs(300)),
            "0,0",
            "hvprof.run=w41 hvprof.arg=800 hvprof.copies=2",
        )
        .check(|log| check_exit_code(log, "linux", 0, "port 0xf4"))
        .profile(check_steal),
        // SMP Linux on two pCPUs, with local APICs, the I/O APIC and ACPI tables (`apic=on`):
        // the second vCPU started by the guest's INIT-SIPI-SIPI; the two copies of w41; then
        // COM1's interrupt bound to each vCPU in turn.
        linux_apic_module(
            // Bochs runs both CPUs in one thread: twice a uniprocessor boot's time.
            linux_machine("bochs-linux-smp-pinned")
                .cpus(2)
                .cmdline(&cmdline)
                .budget(Duration::from_secs(480)),
            "0,1",
            "hvprof.run=w41 hvprof.arg=800 hvprof.copies=2 hvprof.irqs=1",
        )
        .check(|log| check_exit_code(log, "linux", 0, "port 0xf4"))
        .check(check_smp_boot)
        .check(check_io_apic)
        .profile(check_smp_profile)
        .profile(check_pinned),
        // A 2.1 ms slice, not 2: the guest's tick (HZ=250, every 4 ms) would fall at the same
        // place of every other slice of a vCPU, and in deterministic Bochs either never or
        // always just before its preemption. A critical section of 1.5 slices: 630,000 steps
        // of 5 instructions.
        linux_apic_module(
            linux_machine("bochs-linux-lock-holder")
                .cmdline(&format!(
                    "export=end channel=lpt {LINUX_PERIOD} slice=2100us"
                ))
                .budget(Duration::from_secs(300)),
            "0,0",
            "hvprof.run=lockholder hvprof.arg=12,630000",
        )
        .check(|log| check_exit_code(log, "linux", 0, "port 0xf4"))
        .profile(check_lock_holder),
        ple_scenario("bochs-linux-ple-off", "off"),
        ple_scenario("bochs-linux-ple-on", "on"),
        ple_scenario("bochs-linux-ple-directed", "directed"),
    ]
}

/// The arguments of shootdown in the pause-loop scenarios: 40 changes of 20,000 loop steps,
/// the sibling thread on CPU 2, a busy process on CPU 1.
pub const SHOOTDOWN_ARGS: &str = "40,20000,2,1";

/// Pause-loop exiting (`ple=`): shootdown on three vCPUs that share one pCPU. Its thread on
/// vCPU 0 changes the page tables its sibling thread on vCPU 2 uses, and waits at CPL 0 for each
/// shootdown IPI, which the preempted vCPU 2 takes only when it runs again; vCPU 1 runs a busy
/// process. `off`: vCPU 0 spins to the end of its slice; `on`: a PLE window, then the pCPU goes
/// to the next vCPU in turn (vCPU 1, busy, before vCPU 2); `directed`: to vCPU 2 first.
/// With `ple=on`, lockholder runs after shootdown: its threads spin in user mode, where PAUSE
/// never exits (pause-loop exiting watches CPL 0 only).
fn ple_scenario(name: &str, ple: &'static str) -> Scenario {
    let cmdline = format!("export=end channel=lpt {LINUX_PERIOD} slice=2ms");
    let then = if ple == "on" {
        " hvprof.then=lockholder hvprof.thenarg=6,600000"
    } else {
        ""
    };
    linux_smp_module(
        linux_machine(name)
            .cmdline(&cmdline)
            .budget(Duration::from_secs(300)),
        &format!("apic=on vcpus=3 pin=0,0,0 ple={ple}"),
        &format!("hvprof.run=shootdown hvprof.arg={SHOOTDOWN_ARGS}{then}"),
    )
    .check(|log| check_exit_code(log, "linux", 0, "port 0xf4"))
    .profile(move |run| check_ple(run, ple))
}

/// The scenarios [`check_ple_diff`] compares.
pub const PLE_DIFF: [&str; 2] = ["bochs-linux-ple-off", "bochs-linux-ple-on"];

/// `hvprof-analyze diff` of the two pause-loop captures [`PLE_DIFF`] (in `out_dir`, each
/// scenario's folder) names [`SPIN_FUNCTION`] as VM linux's function with the largest change, a
/// loss of share with PLE on; and the spinning line appears (0 without PLE). Returns that
/// change.
pub fn check_ple_diff(
    out_dir: &std::path::Path,
    analyzer: &std::path::Path,
) -> Result<String, String> {
    let capture = |name: &str| out_dir.join(name).join(crate::profile::CAPTURE);
    let out = std::process::Command::new(analyzer)
        .arg("diff")
        .arg("--json")
        .arg(capture(PLE_DIFF[0]))
        .arg(capture(PLE_DIFF[1]))
        .args(linux_args())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", analyzer.display()))?;
    if !out.status.success() {
        return Err(format!(
            "hvprof-analyze diff failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let d: Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("hvprof-analyze diff --json: {e}"))?;
    let linux = d
        .get("vms")
        .and_then(Value::as_array)
        .and_then(|v| {
            v.iter()
                .find(|m| m.get("name").and_then(Value::as_str) == Some("linux"))
        })
        .ok_or("the diff has no VM linux")?;
    // The first code row: `[steal]` and `[idle]` rows are not functions (the spinning vCPU's
    // time shows as `[steal] (on vcpu0)` of its siblings too).
    let first = linux
        .get("functions")
        .and_then(Value::as_array)
        .and_then(|rows| {
            rows.iter().find(|r| {
                !r.get("function")
                    .and_then(Value::as_str)
                    .unwrap_or("[")
                    .starts_with('[')
            })
        })
        .ok_or("the diff of VM linux has no function rows")?;
    let function = first.get("function").and_then(Value::as_str).unwrap_or("");
    let delta = first
        .get("delta")
        .and_then(Value::as_f64)
        .unwrap_or(f64::NAN);
    let spinning = linux.pointer("/spinning/b").and_then(Value::as_f64);
    let said = format!(
        "{function} {delta:+.2} points (A {} %, B {} %); spinning with PLE on {spinning:?} %",
        first.get("a_percent").unwrap_or(&Value::Null),
        first.get("b_percent").unwrap_or(&Value::Null)
    );
    if function != SPIN_FUNCTION || delta >= 0.0 || spinning.is_none() {
        return Err(format!(
            "diff {} {}: the largest change should be less time in {SPIN_FUNCTION}, and the spinning line should be there: {said}",
            PLE_DIFF[0], PLE_DIFF[1]
        ));
    }
    Ok(said)
}

/// The kernel function whose PAUSE loop waits for a shootdown IPI (`csd_lock_wait`, inlined).
pub const SPIN_FUNCTION: &str = "smp_call_function_many_cond";

/// vCPU 0 of VM 0's yields (out events `Yielded`), each with the vCPU its pCPU ran next: (TSC of
/// the yield, that vCPU), from the whole capture.
fn yields_of_vcpu0(capture: &[u8]) -> Vec<(u64, u16)> {
    use hvprof_samplelog::{EventKind, OutReason, Record};
    let d = hvprof_samplelog::decode(capture);
    let mut out = Vec::new();
    for log in d.pcpus.values() {
        let mut yielded = None;
        for r in &log.records {
            let Record::Event(e) = r else { continue };
            match (e.kind, e.reason) {
                (EventKind::VcpuOut, OutReason::Yielded) if (e.vm, e.vcpu) == (0, 0) => {
                    yielded = Some(e.tsc);
                }
                (EventKind::VcpuIn, _) => {
                    if let Some(t) = yielded.take() {
                        out.push((t, e.vcpu));
                    }
                }
                _ => {}
            }
        }
    }
    out
}

/// Of `yields` ([`yields_of_vcpu0`]), those between TSCs `from` and `to`: the vCPU run next,
/// counted per vCPU.
fn after_yields(yields: &[(u64, u16)], from: u64, to: u64) -> HashMap<u16, u64> {
    let mut next = HashMap::new();
    for &(_, vcpu) in yields.iter().filter(|(t, _)| (from..to).contains(t)) {
        *next.entry(vcpu).or_insert(0) += 1;
    }
    next
}

/// The pause-loop scenarios (see [`ple_scenario`]), over shootdown's stretch of host time:
/// - samples and events agree on each vCPU's idle and steal within 1 point;
/// - `off`: vCPU 0 spins in `smp_call_function_many_cond` (at least 10 % of its samples), and
///   the report has no pause-loop exits;
/// - `on` and `directed`: at least one pause-loop exit per change, most of them in
///   `smp_call_function_many_cond`; vCPU 0's spinning from its exits (each a PLE window) and its
///   samples in the function agree within 2 points; after its yields in the stretch the pCPU
///   went to vCPU 1 (`on`: next in turn) or to vCPU 2 (`directed`: the preempted sibling the
///   IPI waits for), nine times in ten at least;
/// - `on`: lockholder, after it, spins in user mode (`spin_wait`) without pause-loop exits: none
///   at a user address, and those of its stretch (the kernel's) under 1 % of its spin time.
fn check_ple(run: &ProfileRun, ple: &str) -> Result<(), String> {
    let samples = script_samples(run)?;
    let window = process_window(&samples, &["shootdown"])?;
    let report = report_during(run, &window, &[])?;
    let linux = vm(&report, "linux")?;
    let vcpus = linux
        .get("vcpus")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if vcpus.len() != 3 {
        return Err(format!("{} vCPUs in the report, expected 3", vcpus.len()));
    }
    let mut errors = events_agree(&vcpus);
    let v0 = &vcpus[0];
    let spin = share(v0, SPIN_FUNCTION, None);
    let pause_loop = linux.get("pause_loop");
    if ple == "off" {
        if spin < 10.0 {
            errors.push(format!(
                "without pause-loop exiting, vCPU 0 should spin in {SPIN_FUNCTION} for the shootdowns: {spin:.1}% of its samples; {}",
                summary(v0)
            ));
        }
        if let Some(p) = pause_loop {
            errors.push(format!(
                "ple=off, yet the report has pause-loop exiting: {p}"
            ));
        }
        return all_of(errors.into_iter().map(Err));
    }
    let Some(p) = pause_loop else {
        return Err(format!(
            "ple={ple}, yet the report has no pause-loop exiting"
        ));
    };
    let exits = p.get("exits").and_then(Value::as_u64).unwrap_or(0);
    let changes: u64 = SHOOTDOWN_ARGS
        .split(',')
        .next()
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let top = p.pointer("/sites/0/function").and_then(Value::as_str);
    if p.get("mode").and_then(Value::as_str) != Some(ple)
        || exits < changes
        || top != Some(SPIN_FUNCTION)
    {
        errors.push(format!(
            "ple={ple}: expected at least {changes} pause-loop exits, most in {SPIN_FUNCTION}: {p}"
        ));
    }
    let spinning = field(v0, "/exact/spinning");
    if spinning.is_nan() || (spinning - spin).abs() > 2.0 {
        errors.push(format!(
            "vCPU 0's spinning from its pause-loop exits ({spinning:.2}%) and its samples in {SPIN_FUNCTION} ({spin:.2}%) should agree within 2 points"
        ));
    }
    // A stretch `START,END` in TSC ticks (`script` prints TSC / TSC rate, in seconds).
    let hz = report.get("tsc_hz").and_then(Value::as_f64).unwrap_or(0.0);
    let tsc = |t: &str| (t.parse::<f64>().unwrap_or(0.0) * hz) as u64;
    let ticks = |window: &str| {
        let (from, to) = window.split_once(',').unwrap_or(("0", "0"));
        (tsc(from), tsc(to))
    };
    let all_yields = yields_of_vcpu0(&run.capture);
    let (from, to) = ticks(&window);
    let next = after_yields(&all_yields, from, to);
    if ple == "on" {
        // lockholder's user-mode spinning makes no pause-loop exit: every exit's RIP is a kernel
        // address, and the exits in lockholder's stretch (the kernel's own waits, setting its
        // threads up and tearing them down) account for under 1 % of its spin_wait time.
        let window = process_window(&samples, &["lockholder"])?;
        let (from, to) = ticks(&window);
        let yields: u64 = after_yields(&all_yields, from, to).values().sum();
        let spin_wait = samples
            .iter()
            .filter(|s| s.function == "spin_wait" && s.process.starts_with("lockholder["))
            .count() as u64;
        let ple_window = p.get("window").and_then(Value::as_u64).unwrap_or(0);
        let period = report
            .get("period_ticks")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        if spin_wait < 100 || 100 * yields * ple_window > spin_wait * period {
            errors.push(format!(
                "lockholder spins in user mode ({spin_wait} spin_wait samples of {period} ticks, expected 100 or more), where PAUSE never exits: {yields} pause-loop exits of vCPU 0 ({ple_window} ticks each) in its stretch ({window} s), expected under 1 % of that"
            ));
        }
        let user_sites: Vec<&Value> = p
            .get("sites")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|s| {
                s.get("rip")
                    .and_then(Value::as_u64)
                    .is_some_and(|r| r < 0xffff_8000_0000_0000)
            })
            .collect();
        if !user_sites.is_empty() {
            errors.push(format!(
                "pause-loop exits at user-mode addresses (PLE watches CPL 0 only): {user_sites:?}"
            ));
        }
    }
    let yields: u64 = next.values().sum();
    let want = if ple == "directed" { 2 } else { 1 };
    let to_want = next.get(&want).copied().unwrap_or(0);
    if yields == 0 || 10 * to_want < 9 * yields {
        errors.push(format!(
            "ple={ple}: after vCPU 0's {yields} yields the pCPU should go to vCPU {want} nine times in ten at least; it went to (vCPU: times) {next:?}"
        ));
    }
    all_of(errors.into_iter().map(Err))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_spans_the_named_processes_first_to_last_sample() {
        let script = "linux 100000/100001 [000] 1.000000: cpu-clock:\n\tffffffff81000000 f ([guest.kallsyms])\n\t               0 swapper[0] (guest.process)\n\n\
                      linux 100000/100001 [000] 1.500000: cpu-clock:\n\t    5555 main (known)\n\t               0 known[90] (guest.process)\n\n\
                      linux 100000/100002 [001] 1.250000: cpu-clock:\n\t    5555 x (hvrun)\n\t               0 hvrun[89] (guest.process)\n\n\
                      linux 100000/100001 [000] 2.000000: cpu-clock:\n\t    5555 y (other)\n\t               0 knownx[91] (guest.process)\n";
        let samples = parse_script(script).unwrap();
        assert_eq!(samples.len(), 4);
        assert_eq!(
            (samples[2].vcpu, samples[2].process.as_str()),
            (1, "hvrun[89]")
        );
        assert_eq!(
            process_window(&samples, &["hvrun", "known"]).unwrap(),
            "1.250000,1.500001"
        );
        assert_eq!(
            process_window(&samples, &["known"]).unwrap(),
            "1.500000,1.500001"
        );
        assert!(process_window(&samples, &["nothing"]).is_err());
        assert!(parse_script("").is_err());
    }
}
