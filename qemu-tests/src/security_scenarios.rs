//! Hostile guests (docs/SECURITY.md): each scenario runs the `hostile` guest against what it
//! shares with other VMs and the hypervisor (the sample log, the FPU/AVX state, the debug
//! registers and CR8, the CPU's identity, the control registers, the scheduler, the console),
//! and checks that the hypervisor kept its promise: the guest itself reports `hostile: <mode>: ok`
//! (it saw nothing it should not), the other VMs run to their end with their share of the pCPU,
//! and the profile is the real one.

use serde_json::Value;

use crate::emulator::Emulator;
use crate::log::SerialLog;
use crate::profile::{ProfileRun, num, vm};
use crate::runner::{ModuleSource, Scenario};
use crate::scenarios::HASWELL;
use crate::vm_scenarios::{all_of, check_exit_code, exit_count};

const HOSTILE: ModuleSource = ModuleSource::Guest("hostile");
const MIX: ModuleSource = ModuleSource::Guest("mix");

/// `hostile: <mode>: ok` printed by VM `vm`, which then exited with 0.
fn hostile_ok(log: &SerialLog, vm: &str, mode: &str) -> Result<(), String> {
    let line = log.expect(&format!("[{vm}] hostile: {mode}: "))?;
    if !line.contains(&format!("hostile: {mode}: ok")) {
        return Err(format!("VM {vm}: {line}"));
    }
    check_exit_code(log, vm, 0, "port 0xf4")
}

/// The names of the VMs in the report.
fn vm_names(report: &Value) -> Vec<String> {
    report
        .get("vms")
        .and_then(Value::as_array)
        .map(|vms| {
            vms.iter()
                .filter_map(|v| v.get("name").and_then(Value::as_str))
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// Whether `forged` (a name, an address, a pid) appears in the report: inside any string (a VM,
/// process or function name, an address), or as a whole number (a pid or tgid field). Not in the
/// text of other numbers: a share of 50.6666 % is no forged pid.
fn shows(value: &Value, forged: &str) -> bool {
    match value {
        Value::String(s) => s.contains(forged),
        Value::Number(n) => n.as_u64().is_some_and(|n| n.to_string() == forged),
        Value::Array(items) => items.iter().any(|v| shows(v, forged)),
        Value::Object(fields) => fields
            .iter()
            .any(|(k, v)| k.contains(forged) || shows(v, forged)),
        Value::Bool(_) | Value::Null => false,
    }
}

/// A guest that prints forged frames (header, block, task) cannot change the profile: the VMs
/// keep their names, no forged sample or process appears, and its output reaches the console
/// with every control byte escaped (no NUL, no frame-type byte).
fn check_forgery(run: &ProfileRun) -> Result<(), String> {
    let report = run.report(None)?;
    let names = vm_names(&report);
    let mut errors = Vec::new();
    if names != ["victim", "forger"] {
        errors.push(format!(
            "the report's VMs are {names:?}, not [victim, forger]"
        ));
    }
    for forged in ["forged", "0xf0f0f0f0", "6666"] {
        if shows(&report, forged) {
            errors.push(format!("the report shows the forgery ({forged:?})"));
        }
    }
    for what in ["blocks", "dropped", "damaged_frames"] {
        if num(&report, &format!("/lost/{what}")).unwrap_or(0.0) != 0.0 {
            errors.push(format!("the log reports lost {what}"));
        }
    }
    // The forger's console lines carry its bytes escaped: no 0x00 between "[forger]" and the
    // end of its line.
    for line in run.capture.split(|&b| b == b'\n') {
        if line.starts_with(b"[forger]") && line.iter().any(|&b| b < 0x20 && b != b'\r') {
            errors.push(format!(
                "a forger line reached the console with control bytes: {:?}",
                String::from_utf8_lossy(line)
            ));
            break;
        }
    }
    all_of(errors.into_iter().map(Err))
}

/// A VM that floods the console cannot take the pCPU from another: over the victim's life (all of
/// it beside the flooder, which prints for longer) the victim runs at least `min` percent of the
/// time (a fair share is 50%), and the flooder's dropped output is reported.
fn check_flood(run: &ProfileRun, min: f64) -> Result<(), String> {
    let report = run.report(None)?;
    let steal = num(vm(&report, "victim")?, "/steal")?;
    if 100.0 - steal < min {
        return Err(format!(
            "the victim ran {:.1}% of its life beside the flooder (steal {steal:.1}%), expected at least {min}%",
            100.0 - steal
        ));
    }
    Ok(())
}

/// `profiler: guest task changes: <n> recorded, 0 dropped ...` with at least `min` recorded.
fn check_task_changes(log: &SerialLog, min: u64) -> Result<(), String> {
    let line = log.expect("profiler: guest task changes: ")?;
    let mut words = line.split_whitespace().skip(4);
    let recorded: u64 = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
    let dropped: u64 = words
        .nth(1)
        .and_then(|w| w.parse().ok())
        .unwrap_or(u64::MAX);
    if recorded < min || dropped != 0 {
        return Err(format!(
            "expected at least {min} task changes recorded and none dropped: {line:?}"
        ));
    }
    Ok(())
}

/// IPIs a guest sends to itself in a loop (by its APIC ID, each an exit) interrupt no other
/// pCPU: the pCPUs, each running a victim VM pinned to it while the sender moves between them,
/// take at most `max` kicks in all (`hvprof: pCPU <i>: <n> kicks taken`), against one per IPI
/// when every IPI kicked every other pCPU; and each victim takes at most `max`
/// external-interrupt exits (kicks and the profiler's timer alike).
fn check_ipi_storm(log: &SerialLog, sent: u64, max: u64) -> Result<(), String> {
    log.expect_containing("vm stormer: local APICs: ", &format!("{sent} IPIs sent"))?;
    let mut errors = Vec::new();
    let mut kicks = 0;
    for cpu in 0..2 {
        let line = log.expect(&format!("hvprof: pCPU {cpu}: "))?;
        kicks += line
            .split_whitespace()
            .nth(3)
            .and_then(|w| w.parse::<u64>().ok())
            .ok_or_else(|| format!("no kick count in {line:?}"))?;
    }
    if kicks > max {
        errors.push(Err(format!(
            "the pCPUs took {kicks} kicks while a VM sent {sent} IPIs to itself (at most {max} expected)"
        )));
    }
    for victim in ["victim0", "victim1"] {
        check_exit_code(log, victim, 0, "port 0xf4")?;
        let n = exit_count(log, victim, "EXTERNAL_INTERRUPT")?;
        if n > max {
            errors.push(Err(format!(
                "VM {victim} took {n} external-interrupt exits while another VM sent {sent} IPIs to itself (at most {max} expected)"
            )));
        }
    }
    all_of(errors)
}

/// Requests for a sleep state the VM does not have (each refused with a line about the VM) stay
/// within the VM's console rate: at most `max` of them reach the console, the rest is counted,
/// and the sample log loses nothing.
fn check_pm1_flood(log: &SerialLog, rounds: u64, max: usize) -> Result<(), String> {
    let printed = log.all("vm pm1: ACPI sleep type 1 requested").len();
    let dropped =
        log.expect_containing("vm pm1: ", "of the hypervisor's lines about the VM dropped")?;
    let n: u64 = dropped
        .trim_start_matches("vm pm1: ")
        .split_whitespace()
        .next()
        .and_then(|w| w.parse().ok())
        .unwrap_or(0);
    if printed > max || printed as u64 + n != rounds {
        return Err(format!(
            "{printed} refusal lines printed and {n} counted as dropped for {rounds} requests (at most {max} printed expected, all counted)"
        ));
    }
    Ok(())
}

/// The sample log lost nothing.
fn check_nothing_lost(run: &ProfileRun) -> Result<(), String> {
    let report = run.report(None)?;
    for what in ["blocks", "samples", "dropped", "damaged_frames"] {
        let n = num(&report, &format!("/lost/{what}"))?;
        if n != 0.0 {
            return Err(format!("the log lost {n} {what}"));
        }
    }
    Ok(())
}

/// VM `vm` took exactly `want` exits of `reason`.
fn check_exits(log: &SerialLog, vm: &str, reason: &str, want: u64) -> Result<(), String> {
    match exit_count(log, vm, reason)? {
        n if n == want => Ok(()),
        n => Err(format!("VM {vm} took {n} {reason} exits, expected {want}")),
    }
}

/// The hostile guest's `self-ipi` mode with `apic=<apic>` beside a busy VM on one pCPU.
fn self_ipi(name: &str, apic: &str, rounds: u64) -> Scenario {
    Scenario::new(name, Emulator::bochs(HASWELL))
        .cmdline("export=end slice=2ms")
        .module("victim.elf", MIX, "vm=victim mix=80,20 rounds=100")
        .module(
            "selfipi.elf",
            HOSTILE,
            &format!("vm=selfipi apic={apic} hostile=self-ipi rounds={rounds}"),
        )
}

/// The scenarios.
pub fn all() -> Vec<Scenario> {
    let bochs = || Emulator::bochs(HASWELL);
    vec![
        // Finding 1: forged frames on the console (export=end: the real header comes last, so a
        // forged one would be the first the reader sees).
        Scenario::new("bochs-attack-forge-log", bochs())
            .cmdline("export=end")
            .module("victim.elf", MIX, "vm=victim mix=80,20 rounds=20")
            .module("forger.elf", HOSTILE, "vm=forger hostile=forge")
            .check(|log| {
                check_exit_code(log, "victim", 0, "port 0xf4")?;
                hostile_ok(log, "forger", "forge")
            })
            .profile(check_forgery),
        // Finding 2: AVX state (and XCR0) between two VMs that take turns on one pCPU.
        Scenario::new("bochs-attack-avx-leak", bochs())
            .cmdline("export=end slice=2ms")
            .module(
                "secret.elf",
                HOSTILE,
                "vm=secret hostile=avx-secret rounds=40",
            )
            .module("spy.elf", HOSTILE, "vm=spy hostile=avx-spy rounds=40")
            .check(|log| {
                all_of([
                    hostile_ok(log, "secret", "avx-secret"),
                    hostile_ok(log, "spy", "avx-spy"),
                ])
            }),
        // Finding 9: debug registers, CR8, RDPMC, RDTSCP/RDPID, CPUID identity, MONITOR/MWAIT;
        // both VMs on pCPU 1, whose host APIC id is 1.
        Scenario::new("bochs-attack-cpu-state", bochs())
            .cpus(2)
            .cmdline("export=end slice=2ms")
            .module(
                "setter.elf",
                HOSTILE,
                "vm=setter pin=1 hostile=state-set rounds=40",
            )
            .module(
                "spy.elf",
                HOSTILE,
                "vm=spy pin=1 hostile=state-spy rounds=40",
            )
            .check(|log| {
                all_of([
                    hostile_ok(log, "setter", "state-set"),
                    hostile_ok(log, "spy", "state-spy"),
                    // MONITOR and MWAIT exit (a guest may not arm the CPU's monitor nor put the
                    // pCPU into a C-state): the spy's one MONITOR and one MWAIT are exits.
                    // Without the exiting controls they return all the same, so the count is
                    // what shows the protection.
                    check_exits(log, "spy", "MONITOR", 1),
                    check_exits(log, "spy", "MWAIT", 1),
                ])
            }),
        // Finding 11: control-register values the CPU refuses are the guest's #GP, not a failed
        // VM entry.
        Scenario::new("bochs-attack-cr", bochs())
            .module("cr.elf", HOSTILE, "vm=cr hostile=cr")
            .check(|log| hostile_ok(log, "cr", "cr")),
        // Finding 3: a guest that arms its timer for the end of time and halts is stopped by its
        // wall budget; the other VM runs to its end and the machine powers off.
        Scenario::new("bochs-attack-sleep", bochs())
            .cmdline("export=end")
            .module("victim.elf", MIX, "vm=victim mix=80,20 rounds=10")
            .module(
                "sleeper.elf",
                HOSTILE,
                "vm=sleeper hostile=sleep wall-budget=200000000",
            )
            .check(|log| {
                check_exit_code(log, "victim", 0, "port 0xf4")?;
                log.expect_containing("vm sleeper: stopped: ", "wall budget")?;
                log.expect_none("[sleeper] hostile: sleep: woke up")
            }),
        // A guest posing as Linux whose every sample shows a new process, each with a memory
        // map whose maple tree is a node that is its own child: every walk is cut at the tree's
        // height (31 nodes), at most 1,024 processes are walked, and the rest is counted.
        Scenario::new("bochs-attack-maps", bochs())
            .cmdline("export=end channel=lpt period=2000ticks")
            .module(
                "maps.elf",
                HOSTILE,
                "vm=maps hostile=tasks maps=1 rounds=3000 every=800 task-offsets=0x100:2416:2420:2976 mm-layout=72:0:8:16:32:120:128:24:24:36:40:2272:256:8:128:16:248:8:80:10:240:0",
            )
            .check(|log| {
                all_of([
                    hostile_ok(log, "maps", "tasks"),
                    log.expect_none("PANIC"),
                    log.expect("vm maps: 0 executable mappings of 1024 processes read from guest memory (")
                        .and_then(|l| {
                            // "(<r> maps read again ..., <refused> re-reads refused; <cut> walks
                            // cut short, <dropped> processes and 0 mappings ...)"
                            let nums: Vec<u64> = l
                                .split(['(', ',', ' ', ';'])
                                .filter_map(|w| w.parse().ok())
                                .collect();
                            match nums[..] {
                                [_, _, 0, _, cut, dropped, 0, ..] if cut >= 1000 && dropped > 0 => Ok(()),
                                _ => Err(format!(
                                    "expected about 1,024 walks cut short and processes not kept: {l}"
                                )),
                            }
                        }),
                ])
            }),
        // Finding 4: a task change at about every sample on two pCPUs (a guest renaming itself in
        // a loop), 40,000 each: more than the hypervisor keeps in memory for `export=end` (its
        // task buffer is flushed when full; the heap used to run out and the capture was lost).
        Scenario::new("bochs-attack-task-flood", bochs())
            .cpus(2)
            .cmdline("export=end channel=lpt period=2000ticks")
            .module(
                "tasks1.elf",
                HOSTILE,
                "vm=tasks1 pin=0 hostile=tasks rounds=40000 every=800 task-offsets=0x100:2416:2420:2976",
            )
            .module(
                "tasks2.elf",
                HOSTILE,
                "vm=tasks2 pin=1 hostile=tasks rounds=40000 every=800 task-offsets=0x100:2416:2420:2976",
            )
            .budget(std::time::Duration::from_secs(180))
            .check(|log| {
                all_of([
                    hostile_ok(log, "tasks1", "tasks"),
                    hostile_ok(log, "tasks2", "tasks"),
                    log.expect_none("PANIC"),
                    check_task_changes(log, 70_000),
                ])
            })
            .profile(check_nothing_lost),
        // Finding 5: 4 KiB PRINTs as fast as the guest can beside a busy VM on one pCPU.
        Scenario::new("bochs-attack-flood", bochs())
            .cmdline("export=end")
            .module("victim.elf", MIX, "vm=victim mix=80,20 rounds=20")
            .module(
                "flooder.elf",
                HOSTILE,
                "vm=flooder hostile=flood rounds=2000",
            )
            .check(|log| {
                check_exit_code(log, "victim", 0, "port 0xf4")?;
                hostile_ok(log, "flooder", "flood")?;
                log.expect_containing("vm flooder: ", "console lines")
                    .map(drop)
            })
            .profile(|run| check_flood(run, 40.0)),
        // Guests against guests, 1: a VM that sends IPIs to itself in a loop (not pinned, so it
        // moves between the pCPUs) beside two VMs pinned one to each pCPU.
        Scenario::new("bochs-attack-ipi-storm", bochs())
            .cpus(2)
            .cmdline("export=end")
            .module("victim0.elf", MIX, "vm=victim0 pin=0 mix=80,20 rounds=200 interrupts=on")
            .module("victim1.elf", MIX, "vm=victim1 pin=1 mix=80,20 rounds=200 interrupts=on")
            .module(
                "stormer.elf",
                HOSTILE,
                "vm=stormer apic=on hostile=ipi-storm rounds=15000",
            )
            .check(|log| {
                hostile_ok(log, "stormer", "ipi-storm")?;
                check_ipi_storm(log, 15000, 150)
            }),
        // Guests against guests, 2: a VM that asks for a sleep state it does not have in a
        // loop (a console line each) beside a busy VM on one pCPU, the sample log streamed on
        // the same serial line.
        Scenario::new("bochs-attack-pm1-flood", bochs())
            .module("victim.elf", MIX, "vm=victim mix=80,20 rounds=20")
            .module("pm1.elf", HOSTILE, "vm=pm1 apic=on hostile=pm1-flood rounds=4000")
            .check(|log| {
                check_exit_code(log, "victim", 0, "port 0xf4")?;
                log.expect("[victim] mix: done")?;
                hostile_ok(log, "pm1", "pm1-flood")?;
                check_pm1_flood(log, 4000, 400)
            })
            .profile(check_nothing_lost),
        // Guests against guests, 3: self-IPIs the CPU's APIC virtualization delivers without an
        // exit (into the virtual IRR), mixed with one that exits, beside a busy VM on one pCPU:
        // every one reaches the guest (none lost from the hypervisor's APIC model, whose next
        // hand-over would otherwise rewrite the virtual IRR without them).
        self_ipi("bochs-attack-self-ipi", "on", 3000)
            .check(|log| check_exit_code(log, "victim", 0, "port 0xf4"))
            .check(|log| hostile_ok(log, "selfipi", "self-ipi")),
        // The same with every APIC access trapped and emulated (`apic=emulated`): CR8 exits and
        // reaches the model's TPR (both CR8 writes and the read exit).
        self_ipi("bochs-attack-self-ipi-emulated", "emulated", 1000)
            .check(|log| check_exit_code(log, "victim", 0, "port 0xf4"))
            .check(|log| hostile_ok(log, "selfipi", "self-ipi"))
            .check(|log| check_exits(log, "selfipi", "CR_ACCESS", 3)),
    ]
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_forgery_shows_in_names_and_whole_numbers_not_inside_other_numbers() {
        let report = serde_json::json!({
            "vms": [{"name": "victim", "steal": 50.66660937013203, "ticks": 16666}],
            "processes": [{"pid": 42, "label": "sh[42]"}]
        });
        assert!(!super::shows(&report, "6666"));
        assert!(super::shows(&serde_json::json!([{"pid": 6666}]), "6666"));
        assert!(super::shows(
            &serde_json::json!({"label": "forged-task[6666]"}),
            "6666"
        ));
        assert!(super::shows(
            &serde_json::json!({"rip": "0xf0f0f0f0"}),
            "0xf0f0f0f0"
        ));
    }
}
