//! End-to-end scenarios of the guests' virtual PMU (`vpmu=`, docs/PROFILER.md "A guest's own
//! PMU"): the `pmu` test guest counts loops of known length, takes PMIs and pokes at what it may
//! not, in four VMs that share one pCPU in 2 ms slices.
//!
//! The lines these checks read:
//! - the guest's `[<vm>] pmu: exact n=<n> expected=<2n+3> instructions=<i> cycles=<c>
//!   ref-cycles=<r> gp-instructions=<g> gp-user=<u> gp-cycles=<gc> gp-llc-misses=<l>`,
//!   `[<vm>] pmu: storm ... pmis=<p> ...`, `[<vm>] pmu: none ...` and `[<vm>] pmu: done failed=0`;
//! - the hypervisor's `vm <vm>: vCPU 0 vpmu=<mode>: <t> guest ticks, <e> emulated instructions,
//!   <h> hypervisor ticks counted; <p> PMIs delivered, <held> held by the rate limit, <u> with no
//!   taker`, its exit statistics (`vm <vm>: exit <REASON> <count> <total> ...`) and `tsc: <hz> Hz`.

use crate::emulator::Emulator;
use crate::log::SerialLog;
use crate::profile::ProfileRun;
use crate::runner::{ModuleSource, Scenario};
use crate::scenarios::HASWELL;
use crate::vm_scenarios::check_exit_code;

const PMU: ModuleSource = ModuleSource::Guest("pmu");

/// PMIs a vCPU may get per second of its own running time, and the fewest guest ticks between
/// two (`vcpu_pmu::MAX_PMI_RATE`, `MIN_PMI_GAP`).
const MAX_PMI_RATE: u64 = 100_000;
const MIN_PMI_GAP: u64 = 400;

/// The `key=value` numbers of a line, by key.
fn field(line: &str, key: &str) -> Result<u64, String> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("no {key}= in {line:?}"))
}

/// The guest's line `[<vm>] pmu: <what> ...`.
fn guest_line<'a>(log: &'a SerialLog, vm: &str, what: &str) -> Result<&'a str, String> {
    log.expect(&format!("[{vm}] pmu: {what}"))
}

/// What the hypervisor says vCPU 0 of `vm`'s virtual PMU counted and delivered: guest ticks,
/// emulated instructions, hypervisor ticks, PMIs delivered, held, with no taker, its own exits
/// and their ticks.
fn vpmu_stats(log: &SerialLog, vm: &str) -> Result<[u64; 8], String> {
    let line = log.expect(&format!("vm {vm}: vCPU 0 vpmu="))?;
    let numbers: Vec<u64> = line
        .split_once(": ")
        .map(|(_, rest)| rest)
        .and_then(|rest| rest.split_once(": "))
        .map(|(_, rest)| rest)
        .unwrap_or("")
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    numbers
        .try_into()
        .map_err(|n: Vec<u64>| format!("{} numbers in {line:?}, expected 8", n.len()))
}

/// The sum of the total column of `vm`'s exit statistics: the hypervisor's ticks on its exits.
fn exit_ticks(log: &SerialLog, vm: &str) -> Result<u64, String> {
    let lines = log.all(&format!("vm {vm}: exit "));
    let mut total = 0;
    for line in lines.iter().filter(|l| !l.contains("exit reason")) {
        let cols: Vec<&str> = line.split_whitespace().collect();
        // vm <vm>: exit <REASON> <count> <total> <min> <max> <mean>
        total += cols
            .get(5)
            .and_then(|t| t.parse::<u64>().ok())
            .ok_or_else(|| format!("no total in {line:?}"))?;
    }
    Ok(total)
}

/// In Bochs a guest tick is an instruction: `vpmu=cpu` counts the loop exactly, cycles and
/// reference cycles are its ticks (the instructions less the enabling WRMSR, which the
/// hypervisor emulated), and the general counters agree with the fixed ones.
fn check_exact(log: &SerialLog, vm: &str) -> Result<(), String> {
    let line = guest_line(log, vm, "exact")?;
    let n = field(line, "n")?;
    let want = 2 * n + 3;
    let got = [
        "instructions",
        "cycles",
        "ref-cycles",
        "gp-instructions",
        "gp-cycles",
        "gp-user",
        "gp-llc-misses",
    ]
    .map(|k| field(line, k));
    let expected = [want, want - 1, want - 1, want, want - 1, 0, 0];
    for ((key, got), want) in ["instructions", "cycles", "ref-cycles", "gp-instructions"]
        .iter()
        .chain(&["gp-cycles", "gp-user", "gp-llc-misses"])
        .zip(got)
        .zip(expected)
    {
        let got = got?;
        if got != want {
            return Err(format!("VM {vm}: {key}={got}, expected {want} ({line:?})"));
        }
    }
    Ok(())
}

/// `vpmu=domain`: the counters also hold the hypervisor's ticks on the exits inside the loop
/// (the same in instructions and cycles), and over the whole run the ticks counted for the
/// hypervisor are its exit statistics' total.
fn check_domain(log: &SerialLog, vm: &str) -> Result<(), String> {
    let line = guest_line(log, vm, "exact")?;
    let n = field(line, "n")?;
    let (i, c) = (field(line, "instructions")?, field(line, "cycles")?);
    let extra = i
        .checked_sub(2 * n + 3)
        .ok_or("fewer instructions than the loop's")?;
    if extra == 0 || c != 2 * n + 2 + extra {
        return Err(format!(
            "VM {vm}: the hypervisor's ticks inside the loop: {extra} in instructions, {} in \
             cycles (expected the same, above 0): {line:?}",
            c as i64 - (2 * n + 2) as i64
        ));
    }
    let [_, _, hypervisor, ..] = vpmu_stats(log, vm)?;
    let exits = exit_ticks(log, vm)?;
    if hypervisor != exits {
        return Err(format!(
            "VM {vm}: {hypervisor} hypervisor ticks counted, the exit statistics hold {exits}"
        ));
    }
    Ok(())
}

/// A period of 1 gets PMIs at most once per `hz / MAX_PMI_RATE` ticks of the vCPU's own time
/// (at least `MIN_PMI_GAP`),
/// and the guest still finishes its loop (it printed the storm's line).
fn check_storm(log: &SerialLog, vm: &str) -> Result<(), String> {
    let storm = guest_line(log, vm, "storm")?;
    let hz_line = log.expect("tsc: ")?;
    let hz: u64 = hz_line
        .split_whitespace()
        .nth(1)
        .and_then(|h| h.parse().ok())
        .ok_or_else(|| format!("no frequency in {hz_line:?}"))?;
    let gap = (hz / MAX_PMI_RATE).max(MIN_PMI_GAP);
    let [guest, _, _, delivered, held, ..] = vpmu_stats(log, vm)?;
    let most = guest / gap + 1;
    if delivered > most || held == 0 || field(storm, "pmis")? < 2 {
        return Err(format!(
            "VM {vm}: {delivered} PMIs delivered ({held} held) over {guest} guest ticks: at \
             most {most} allowed, and a storm must be held ({storm:?})"
        ));
    }
    Ok(())
}

/// The analyzer's report says which mode each VM's virtual PMU ran in and what it counted (from
/// the VM end frames), and nothing for the VM without one.
fn check_report(run: &ProfileRun) -> Result<(), String> {
    let report = run.report(None)?;
    let log = SerialLog::from_bytes(&run.capture);
    let vms = report["vms"].as_array().ok_or("no vms in the report")?;
    // The profiler's whole cost holds the virtual PMUs' own exits, all VMs'.
    let mut own = (0, 0);
    for vm in ["cpu", "domain", "noapic"] {
        let [.., exits, ticks] = vpmu_stats(&log, vm)?;
        own = (own.0 + exits, own.1 + ticks);
    }
    let whole = &report["whole_cost"]["vpmu"];
    if whole["exits"] != own.0 || whole["ticks"] != own.1 {
        return Err(format!(
            "the whole cost's vPMU part is {whole}, the console's {} exits and {} ticks",
            own.0, own.1
        ));
    }
    for (vm, mode) in [
        ("cpu", Some("cpu")),
        ("domain", Some("domain")),
        ("noapic", Some("cpu")),
        ("off", None),
    ] {
        let r = vms
            .iter()
            .find(|v| v["name"] == vm)
            .ok_or_else(|| format!("VM {vm} is not in the report"))?;
        let vpmu = &r["vpmu"];
        match mode {
            None if vpmu.is_null() => {}
            None => {
                return Err(format!(
                    "VM {vm} has no virtual PMU, yet the report shows {vpmu}"
                ));
            }
            Some(m) => {
                let [
                    guest,
                    emulated,
                    hypervisor,
                    pmis,
                    held,
                    _,
                    exits,
                    exit_ticks,
                ] = vpmu_stats(&log, vm)?;
                let want = serde_json::json!({
                    "mode": m, "guest_ticks": guest, "emulated": emulated,
                    "hypervisor_ticks": hypervisor, "pmis": pmis, "held": held,
                    "exits": exits, "exit_ticks": exit_ticks,
                });
                for (k, v) in want.as_object().into_iter().flatten() {
                    if &vpmu[k] != v {
                        return Err(format!(
                            "VM {vm}: the report's vpmu.{k} is {}, the console's {v}",
                            vpmu[k]
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

fn done(log: &SerialLog, vm: &str) -> Result<(), String> {
    guest_line(log, vm, "done failed=0")?;
    check_exit_code(log, vm, 0, "port 0xf4")
}

pub fn all() -> Vec<Scenario> {
    vec![
        // Four VMs take turns on one pCPU: `cpu` (exact counts, PMIs, a PMI storm), `domain`,
        // one without a virtual PMU, one without a local APIC. Each VM's exact counts span many
        // slices of the others: they hold only its own time.
        Scenario::new("bochs-vpmu", Emulator::bochs(HASWELL))
            .cmdline("export=end slice=2ms")
            .module(
                "cpu.elf",
                PMU,
                "vm=cpu vpmu=cpu apic=on n=300000 period=50000 pmi-loop=500000 storm=20000",
            )
            .module(
                "domain.elf",
                PMU,
                "vm=domain vpmu=domain apic=on n=200000 period=50000 pmi-loop=100000 domain=1",
            )
            .module("off.elf", PMU, "vm=off apic=on")
            .module("noapic.elf", PMU, "vm=noapic vpmu=cpu n=50000")
            .check(|log| {
                for vm in ["cpu", "domain", "off", "noapic"] {
                    done(log, vm)?;
                }
                check_exact(log, "cpu")?;
                check_exact(log, "noapic")?;
                check_domain(log, "domain")?;
                check_storm(log, "cpu")?;
                let none = guest_line(log, "off", "none")?;
                if !none.contains("rdpmc-gp=true pmc0-gp=true") {
                    return Err(format!("VM off reached a counter: {none:?}"));
                }
                guest_line(log, "noapic", "pmi skipped")?;
                let [_, _, _, delivered, ..] = vpmu_stats(log, "noapic")?;
                if delivered != 0 {
                    return Err(format!(
                        "VM noapic got {delivered} PMIs without a local APIC"
                    ));
                }
                Ok(())
            })
            .profile(check_report),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hypervisors_lines_parse() {
        let log = SerialLog::new(
            "tsc: 4000439 Hz (PIT), invariant yes\n\
             vm cpu: vCPU 0 vpmu=cpu: 676273 guest ticks, 1494 emulated instructions, 0 \
             hypervisor ticks counted; 114 PMIs delivered, 94 held by the rate limit, 0 with no \
             taker; 300 exits of its own, 700000 ticks\n\
             vm cpu: exits: 3 in all; handler cost in TSC ticks, VM exit to VM entry\n\
             vm cpu: exit reason                      count          total       min       max      mean\n\
             vm cpu: exit IO_INSTRUCTION               1657        5536027       617    100207      3340\n\
             vm cpu: exit WRMSR                          69         414717      1331    100036      6010\n\
             [cpu] pmu: storm period=1 rounds=20000 instructions=40003 pmis=94 ticks=1793874\n",
        );
        assert_eq!(
            vpmu_stats(&log, "cpu"),
            Ok([676273, 1494, 0, 114, 94, 0, 300, 700000])
        );
        assert_eq!(exit_ticks(&log, "cpu"), Ok(5536027 + 414717));
        assert!(check_storm(&log, "cpu").is_ok());
        assert_eq!(
            field(guest_line(&log, "cpu", "storm").unwrap(), "pmis"),
            Ok(94)
        );
    }
}
