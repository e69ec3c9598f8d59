//! `bochs-stream-live` (issue 15): a Bochs profile streamed over the serial line, followed as it
//! is written by `hvprof-analyze record` (into a capture of its own) and `hvprof-analyze top
//! --batch` (a live view printed as text). The recording must be the serial log byte for byte,
//! and `top`'s last screen (its window covers the whole run) must agree with `report` on the
//! recorded capture: the host level's shares, the samples, each VM's share and its hottest
//! function.

use std::fs::File;
use std::process::Command;

use serde_json::Value;

use crate::emulator::Emulator;
use crate::profile::{ProfileRun, num, row_samples, vm};
use crate::runner::{LiveRun, ModuleSource, Scenario};
use crate::scenarios::HASWELL;
use crate::vm_scenarios::check_exit_code;

/// The recording `record` makes, and the screens `top` prints, in the scenario's folder.
const RECORDED: &str = "recorded.log";
const TOP: &str = "top.txt";

/// `top`'s last screen: the host level's shares, the samples in its window, each VM's share
/// and hottest function.
#[derive(Debug, Default, PartialEq)]
pub struct TopScreen {
    pub vm: f64,
    pub hypervisor: f64,
    pub idle: f64,
    pub samples: u64,
    /// (VM name, % of the window's samples, its hottest function).
    pub vms: Vec<(String, f64, String)>,
}

fn percent(word: &str) -> Option<f64> {
    word.trim_end_matches('%').parse().ok()
}

/// Reads the last screen of `top --batch`'s output.
pub fn last_screen(text: &str) -> Result<TopScreen, String> {
    let start = text.rfind("hvprof top:").ok_or("top printed no screen")?;
    let screen = &text[start..];
    let mut out = TopScreen::default();
    let host = screen
        .lines()
        .find(|l| l.starts_with("host: VMs"))
        .ok_or("no host line")?;
    let words: Vec<&str> = host.split_whitespace().collect();
    // host: VMs  62.1% hypervisor  37.9% idle   0.0% | 1,851 samples in the window, ...
    let at = |name: &str| {
        words
            .iter()
            .position(|w| *w == name)
            .and_then(|i| words.get(i + 1))
            .and_then(|w| percent(w))
            .ok_or(format!("no {name} share in {host:?}"))
    };
    out.vm = at("VMs")?;
    out.hypervisor = at("hypervisor")?;
    out.idle = at("idle")?;
    out.samples = words
        .iter()
        .position(|w| *w == "samples")
        .and_then(|i| words.get(i - 1))
        .and_then(|w| w.replace(',', "").parse().ok())
        .ok_or(format!("no sample count in {host:?}"))?;
    // The hottest functions: a VM line `│ 62.1%  1,149 [a] (vm 0) │`, then its functions.
    let mut in_table = false;
    for line in screen.lines() {
        if line.contains("Hottest guest functions") {
            in_table = true;
            continue;
        }
        if !in_table {
            continue;
        }
        let cells: Vec<&str> = line
            .trim_matches(|c| c == '│' || c == ' ')
            .split_whitespace()
            .collect();
        if cells.len() >= 4 && cells[2].starts_with('[') && cells[3] == "(vm" {
            let name = cells[2].trim_start_matches('[').trim_end_matches(']');
            out.vms.push((
                name.to_owned(),
                percent(cells[0]).unwrap_or(-1.0),
                String::new(),
            ));
        } else if cells.len() >= 3
            && let Some(last) = out.vms.last_mut()
            && last.2.is_empty()
            && percent(cells[0]).is_some()
        {
            last.2 = cells[2].to_owned();
        }
    }
    Ok(out)
}

/// The report's host shares, total, and each VM's share of all samples and top function.
fn compare(top: &TopScreen, report: &Value) -> Result<(), String> {
    let host = report.get("host").ok_or("the report has no host level")?;
    let total = num(report, "/total_samples")?;
    let mut errors = Vec::new();
    if top.samples as f64 != total {
        errors.push(format!(
            "top counted {} samples, report {total}",
            top.samples
        ));
    }
    for (what, got) in [
        ("vm", top.vm),
        ("hypervisor", top.hypervisor),
        ("idle", top.idle),
    ] {
        let want = num(host, &format!("/{what}"))?;
        // top prints one decimal.
        if (got - want).abs() > 0.06 {
            errors.push(format!("{what}: top {got}%, report {want:.2}%"));
        }
    }
    if top.vms.is_empty() {
        errors.push("top showed no VM".into());
    }
    for (name, share, hottest) in &top.vms {
        let v = vm(report, name)?;
        let guest = row_samples(
            host.get("rows").unwrap_or(&Value::Null),
            &format!("[{name}]"),
        );
        let want = 100.0 * guest / total;
        if (share - want).abs() > 0.11 {
            errors.push(format!("VM {name}: top {share}%, report {want:.2}%"));
        }
        let first = v
            .get("rows")
            .and_then(Value::as_array)
            .and_then(|rows| {
                rows.iter()
                    .map(|r| r.get("function").and_then(Value::as_str).unwrap_or(""))
                    .find(|f| !f.starts_with('['))
            })
            .unwrap_or("");
        if hottest != first {
            errors.push(format!(
                "VM {name}: top's hottest function {hottest}, report's {first}"
            ));
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// The scenario.
pub fn all() -> Vec<Scenario> {
    vec![
        Scenario::new("bochs-stream-live", Emulator::bochs(HASWELL))
            .cpus(2)
            .cmdline("export=stream")
            .module(
                "a.elf",
                ModuleSource::Guest("mix"),
                "vm=a pin=0 mix=60,40 rounds=40",
            )
            .module(
                "b.elf",
                ModuleSource::Guest("mix"),
                "vm=b pin=1 mix=30,70 rounds=30",
            )
            .live(|run: &LiveRun<'_>| {
                let files = run.files;
                let serial = files.serial_log.display().to_string();
                let mut record = Command::new(run.analyzer);
                record
                    .args(["record", &serial, "--until-end", "-o"])
                    .arg(files.dir.join(RECORDED));
                // Its summary line, kept with the run's files.
                if let Ok(f) = File::create(files.dir.join("record.txt")) {
                    record.stderr(f);
                }
                let mut top = Command::new(run.analyzer);
                top.args(["top", &serial, "--batch", "--window", "100000"])
                    .arg("--hypervisor")
                    .arg(run.hypervisor)
                    .arg("--image")
                    .arg(run.guest_dir.join("mix"));
                match File::create(files.dir.join(TOP)) {
                    Ok(f) => {
                        top.stdout(f);
                    }
                    Err(_) => return vec![record],
                }
                vec![record, top]
            })
            .check(|log| {
                check_exit_code(log, "a", 0, "port 0xf4")?;
                check_exit_code(log, "b", 0, "port 0xf4")
            })
            .profile(|run: &ProfileRun| {
                let serial = std::fs::read(run.dir.join("serial.log"))
                    .map_err(|e| format!("cannot read serial.log: {e}"))?;
                let recorded = std::fs::read(run.dir.join(RECORDED))
                    .map_err(|e| format!("record wrote no {RECORDED}: {e}"))?;
                if recorded != serial {
                    return Err(format!(
                        "the recording ({} bytes) is not the serial log ({} bytes)",
                        recorded.len(),
                        serial.len()
                    ));
                }
                let text = std::fs::read_to_string(run.dir.join(TOP))
                    .map_err(|e| format!("top wrote no {TOP}: {e}"))?;
                let screen = last_screen(&text)?;
                let report = run.report(Some((RECORDED, &recorded)))?;
                compare(&screen, &report)
            }),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A screen as `top --batch` printed it in a run (cut to its rows that matter).
    const SCREEN: &str = "\
hvprof top: serial.log (live) | q quits
hvprof top: serial.log (nothing arrived for 5.0 s) | q quits
window: the last 100000 s of host time (3.6 s covered, 3.6 s since the first record)
host: VMs  55.5% hypervisor  34.1% idle  10.4% | 7,177 samples in the window, 1,999 samples/s
┌Hottest guest functions per VM (a VM: % of the window's samples; a function: % of its VM's)──┐
│%      samples   function                                                     module         │
│ 31.4%     2,251 [a] (vm 0)                                                                  │
│ 59.9%     1,349   work_a                                                     a.elf          │
│ 40.0%       900   work_b                                                     a.elf          │
│ 24.1%     1,730 [b] (vm 1)                                                                  │
│ 70.2%     1,215   work_b                                                     b.elf          │
└─────────────────────────────────────────────────────────────────────────────────────────────┘
";

    #[test]
    fn the_last_screen_is_read() {
        let s = last_screen(SCREEN).unwrap();
        assert_eq!(
            (s.vm, s.hypervisor, s.idle, s.samples),
            (55.5, 34.1, 10.4, 7177)
        );
        assert_eq!(
            s.vms,
            vec![
                ("a".to_owned(), 31.4, "work_a".to_owned()),
                ("b".to_owned(), 24.1, "work_b".to_owned())
            ]
        );
        assert!(last_screen("nothing").is_err());
    }

    #[test]
    fn a_disagreement_is_reported() {
        let s = last_screen(SCREEN).unwrap();
        let report = serde_json::json!({
            "total_samples": 7177,
            "host": {"vm": 55.5, "hypervisor": 34.1, "idle": 10.4, "rows": [
                {"function": "[a]", "samples": 2251}, {"function": "[b]", "samples": 1730}]},
            "vms": [
                {"name": "a", "rows": [{"function": "work_a"}]},
                {"name": "b", "rows": [{"function": "[steal]"}, {"function": "work_b"}]}]
        });
        compare(&s, &report).unwrap();
        let mut other = report.clone();
        other["total_samples"] = 7000.into();
        assert!(compare(&s, &other).is_err());
        let mut other = report.clone();
        other["vms"][1]["rows"][1]["function"] = "work_a".into();
        assert!(compare(&s, &other).is_err());
    }
}
