//! Exit statistics in the manner of `perf kvm stat`, from two sources, kept apart:
//!
//! - **exact**: the per-VM tables the hypervisor prints on the console when a VM stops (every
//!   exit counted, its handler cost from VM exit to VM entry in TSC ticks: total, min, max,
//!   mean). The hypervisor keeps no sum of squares, so the spread is given as the largest
//!   standard deviation those figures allow (Bhatia–Davis: σ² ≤ (max − mean)(mean − min)).
//! - **estimated**: the sample log, per VM and per vCPU: the hypervisor's samples taken while it
//!   worked on a vCPU's exit, by that vCPU's last exit reason. Each stands for one period; the
//!   estimate's standard deviation is √n periods (n samples, Poisson). With the deadline clock
//!   the exit each sample causes is never itself sampled, so these show the other exits' cost.

use std::fmt::Write;

use rustc_hash::FxHashMap as HashMap;
use serde::Serialize;

use hvprof_samplelog::NO_VM;

use crate::naming::exit_name;
use crate::profile::{Profile, What};

/// One exit reason in the hypervisor's own table.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ExactReason {
    pub reason: String,
    pub count: u64,
    /// Share of the VM's exits.
    pub count_percent: f64,
    pub total_ticks: u64,
    /// Share of the VM's handler time.
    pub time_percent: f64,
    pub min_ticks: u64,
    pub max_ticks: u64,
    pub mean_ticks: f64,
    /// The largest standard deviation count, min, max and mean allow.
    pub stddev_bound_ticks: f64,
}

/// A VM's table as the hypervisor printed it.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct ExactVm {
    pub exits: u64,
    pub reasons: Vec<ExactReason>,
    /// Exits of a reason number beyond the hypervisor's table.
    pub unknown_reason: u64,
    /// I/O exits per port (`0x03f8`).
    pub io_ports: Vec<(String, u64)>,
}

/// One exit reason, from the samples.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SampledReason {
    pub reason: String,
    pub samples: u64,
    /// Share of the table's hypervisor samples.
    pub percent: f64,
    /// samples × period, and its standard deviation √samples × period.
    pub time_ticks: u64,
    pub time_stddev_ticks: f64,
    /// The estimated time divided by the exact count of such exits (per VM, when the console
    /// has the table), with its standard deviation.
    pub per_exit_ticks: Option<f64>,
    pub per_exit_stddev_ticks: Option<f64>,
}

/// The sample-based table of a VM or vCPU.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct SampledTable {
    /// The hypervisor's samples on this VM's (vCPU's) exits.
    pub hypervisor_samples: u64,
    /// Its guest samples.
    pub guest_samples: u64,
    /// The hypervisor's share of both.
    pub hypervisor_percent: f64,
    pub reasons: Vec<SampledReason>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct VcpuStat {
    pub vcpu: u16,
    pub estimated: SampledTable,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct VmStat {
    pub id: u16,
    pub name: String,
    /// From the console (exact); `None` when the capture has no table for this VM.
    pub exact: Option<ExactVm>,
    pub estimated: SampledTable,
    pub vcpus: Vec<VcpuStat>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Stat {
    pub period_ticks: u64,
    pub tsc_hz: u64,
    pub vms: Vec<VmStat>,
    pub notes: Vec<String>,
}

fn pct(n: f64, total: f64) -> f64 {
    if total == 0.0 { 0.0 } else { 100.0 * n / total }
}

/// The hypervisor's exit tables from the console text: VM name → table.
pub fn parse_console(text: &str) -> HashMap<String, ExactVm> {
    let mut out: HashMap<String, ExactVm> = HashMap::default();
    for line in text.lines() {
        let Some((name, rest)) = line
            .trim_end_matches('\r')
            .strip_prefix("vm ")
            .and_then(|r| r.split_once(": "))
        else {
            continue;
        };
        if let Some(tail) = rest.strip_prefix("exits: ") {
            if let Some(n) = tail.split_whitespace().next().and_then(|n| n.parse().ok()) {
                out.entry(name.to_owned()).or_default().exits = n;
            }
        } else if let Some(tail) = rest.strip_prefix("exit ") {
            let f: Vec<&str> = tail.split_whitespace().collect();
            let vm = out.entry(name.to_owned()).or_default();
            if tail.starts_with("(unknown reason)") {
                vm.unknown_reason = f.last().and_then(|n| n.parse().ok()).unwrap_or(0);
                continue;
            }
            let nums: Option<Vec<u64>> = f.get(1..6).map(|n| {
                n.iter()
                    .filter_map(|x| x.parse().ok())
                    .collect::<Vec<u64>>()
            });
            let Some([count, total, min, max, _mean]) =
                nums.and_then(|n| <[u64; 5]>::try_from(n).ok())
            else {
                continue; // the column header, or a line cut short
            };
            let mean = if count == 0 {
                0.0
            } else {
                total as f64 / count as f64
            };
            vm.reasons.push(ExactReason {
                reason: crate::naming::printable(f[0]).into_owned(),
                count,
                count_percent: 0.0,
                total_ticks: total,
                time_percent: 0.0,
                min_ticks: min,
                max_ticks: max,
                mean_ticks: mean,
                stddev_bound_ticks: ((max as f64 - mean).max(0.0) * (mean - min as f64).max(0.0))
                    .sqrt(),
            });
        } else if let Some(tail) = rest.strip_prefix("io port ") {
            let f: Vec<&str> = tail.split_whitespace().collect();
            if let (Some(port), Some(n)) = (f.first(), f.last().and_then(|n| n.parse().ok())) {
                let port = if *port == "(others)" {
                    "others".to_owned()
                } else {
                    (*port).to_owned()
                };
                out.entry(name.to_owned())
                    .or_default()
                    .io_ports
                    .push((port, n));
            }
        }
    }
    for vm in out.values_mut() {
        let count: u64 = vm.reasons.iter().map(|r| r.count).sum::<u64>() + vm.unknown_reason;
        let time: u64 = vm.reasons.iter().map(|r| r.total_ticks).sum();
        if vm.exits == 0 {
            vm.exits = count;
        }
        for r in &mut vm.reasons {
            r.count_percent = pct(r.count as f64, count as f64);
            r.time_percent = pct(r.total_ticks as f64, time as f64);
        }
        vm.reasons
            .sort_by(|a, b| b.count.cmp(&a.count).then(a.reason.cmp(&b.reason)));
    }
    out
}

fn sampled_table(
    by_reason: &HashMap<u16, u64>,
    guest: u64,
    period: u64,
    exact: Option<&ExactVm>,
) -> SampledTable {
    let hv: u64 = by_reason.values().sum();
    let mut reasons: Vec<SampledReason> = by_reason
        .iter()
        .map(|(&reason, &n)| {
            let name = exit_name(reason);
            let time = n * period;
            let sd = (n as f64).sqrt() * period as f64;
            let count = exact
                .and_then(|e| e.reasons.iter().find(|r| r.reason == name))
                .map(|r| r.count)
                .filter(|&c| c > 0);
            SampledReason {
                reason: name,
                samples: n,
                percent: pct(n as f64, hv as f64),
                time_ticks: time,
                time_stddev_ticks: sd,
                per_exit_ticks: count.map(|c| time as f64 / c as f64),
                per_exit_stddev_ticks: count.map(|c| sd / c as f64),
            }
        })
        .collect();
    reasons.sort_by(|a, b| b.samples.cmp(&a.samples).then(a.reason.cmp(&b.reason)));
    SampledTable {
        hypervisor_samples: hv,
        guest_samples: guest,
        hypervisor_percent: pct(hv as f64, (hv + guest) as f64),
        reasons,
    }
}

/// The exit statistics of a profile.
pub fn build(p: &Profile) -> Stat {
    let console = parse_console(&p.text);
    let mut per_vm: HashMap<u16, HashMap<u16, u64>> = HashMap::default();
    let mut per_vcpu: HashMap<(u16, u16), HashMap<u16, u64>> = HashMap::default();
    let mut guest_vm: HashMap<u16, u64> = HashMap::default();
    let mut guest_vcpu: HashMap<(u16, u16), u64> = HashMap::default();
    for s in &p.samples {
        match s.what {
            What::Hypervisor if s.vm != NO_VM => {
                *per_vm.entry(s.vm).or_default().entry(s.exit).or_default() += 1;
                *per_vcpu
                    .entry((s.vm, s.vcpu))
                    .or_default()
                    .entry(s.exit)
                    .or_default() += 1;
            }
            What::GuestKernel | What::GuestUser => {
                *guest_vm.entry(s.vm).or_default() += 1;
                *guest_vcpu.entry((s.vm, s.vcpu)).or_default() += 1;
            }
            _ => {}
        }
    }
    let mut ids: Vec<u16> = p.vms.iter().map(|v| v.id).collect();
    ids.extend(per_vm.keys().chain(guest_vm.keys()));
    ids.sort_unstable();
    ids.dedup();
    let empty = HashMap::default();
    let vms = ids
        .into_iter()
        .map(|id| {
            let name = p.vm_name(id);
            let exact = console.get(&name).cloned();
            let mut vcpus: Vec<u16> = per_vcpu
                .keys()
                .chain(guest_vcpu.keys())
                .filter(|(v, _)| *v == id)
                .map(|(_, c)| *c)
                .collect();
            vcpus.sort_unstable();
            vcpus.dedup();
            VmStat {
                id,
                estimated: sampled_table(
                    per_vm.get(&id).unwrap_or(&empty),
                    guest_vm.get(&id).copied().unwrap_or(0),
                    p.period_ticks,
                    exact.as_ref(),
                ),
                vcpus: vcpus
                    .into_iter()
                    .map(|c| VcpuStat {
                        vcpu: c,
                        estimated: sampled_table(
                            per_vcpu.get(&(id, c)).unwrap_or(&empty),
                            guest_vcpu.get(&(id, c)).copied().unwrap_or(0),
                            p.period_ticks,
                            None,
                        ),
                    })
                    .collect(),
                name,
                exact,
            }
        })
        .collect::<Vec<_>>();
    let mut notes = vec![
        "exact: the hypervisor's own exit table (console), every exit counted, handler cost from VM exit to VM entry; stddev is the largest that count, min, max and mean allow (the hypervisor keeps no sum of squares)".to_owned(),
        format!(
            "estimated: from the samples, one period ({} ticks) per hypervisor sample taken on a vCPU's exit, by its last exit reason; ± is √n periods; the exit each sample causes is never sampled (deadline clock)",
            p.period_ticks
        ),
    ];
    if vms.iter().all(|v| v.exact.is_none()) {
        notes.push("the capture has no exit table on its console (a VM that did not stop, or console text lost): exact figures unavailable".into());
    }
    Stat {
        period_ticks: p.period_ticks,
        tsc_hz: p.tsc_hz,
        vms,
        notes,
    }
}

fn us(ticks: f64, hz: u64) -> String {
    if hz == 0 {
        String::new()
    } else {
        format!("{:.2}", ticks * 1e6 / hz as f64)
    }
}

/// The statistics as text tables.
pub fn render(s: &Stat) -> String {
    let mut out = String::new();
    let unit = if s.tsc_hz == 0 {
        "TSC ticks".to_owned()
    } else {
        format!("TSC ticks ({} Hz; us in brackets)", s.tsc_hz)
    };
    for vm in &s.vms {
        let _ = writeln!(
            out,
            "Analyze events for VM {} (vm {}):",
            crate::naming::printable(&vm.name),
            vm.id
        );
        match &vm.exact {
            Some(e) => {
                let _ = writeln!(
                    out,
                    "Exact, from the hypervisor's exit table: {} exits; handler cost in {unit}",
                    e.exits
                );
                let _ = writeln!(
                    out,
                    "{:>24} {:>9} {:>9} {:>8} {:>9} {:>9} {:>24}",
                    "VM-EXIT", "Samples", "Samples%", "Time%", "Min", "Max", "Avg time ± stddev"
                );
                for r in &e.reasons {
                    let avg = format!(
                        "{:.1} ± ≤{:.1}{}",
                        r.mean_ticks,
                        r.stddev_bound_ticks,
                        if s.tsc_hz == 0 {
                            String::new()
                        } else {
                            format!(" [{} us]", us(r.mean_ticks, s.tsc_hz))
                        }
                    );
                    let _ = writeln!(
                        out,
                        "{:>24} {:>9} {:>8.2}% {:>7.2}% {:>9} {:>9} {:>24}",
                        r.reason,
                        r.count,
                        r.count_percent,
                        r.time_percent,
                        r.min_ticks,
                        r.max_ticks,
                        avg
                    );
                }
                if e.unknown_reason > 0 {
                    let _ = writeln!(out, "{:>24} {:>9}", "(unknown reason)", e.unknown_reason);
                }
                if !e.io_ports.is_empty() {
                    let ports: Vec<String> = e
                        .io_ports
                        .iter()
                        .map(|(p, n)| format!("{p}: {n}"))
                        .collect();
                    let _ = writeln!(out, "IO_INSTRUCTION by port: {}", ports.join(", "));
                }
            }
            None => {
                let _ = writeln!(
                    out,
                    "Exact: no exit table on the console for this VM (it did not stop, or the text was lost)"
                );
            }
        }
        sampled(&mut out, "VM", &vm.estimated);
        if vm.vcpus.len() > 1 {
            for c in &vm.vcpus {
                sampled(&mut out, &format!("vCPU {}", c.vcpu), &c.estimated);
            }
        }
        out.push('\n');
    }
    for n in &s.notes {
        let _ = writeln!(out, "note: {n}");
    }
    out
}

fn sampled(out: &mut String, what: &str, t: &SampledTable) {
    let _ = writeln!(
        out,
        "Estimated, from the samples ({what}): {} hypervisor samples on its exits, {} guest samples ({:.2}% hypervisor)",
        t.hypervisor_samples, t.guest_samples, t.hypervisor_percent
    );
    if t.reasons.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "{:>24} {:>9} {:>9} {:>26} {:>24}",
        "VM-EXIT", "Samples", "Samples%", "Time (ticks) ± stddev", "Per exit ± stddev"
    );
    for r in &t.reasons {
        let per_exit = match (r.per_exit_ticks, r.per_exit_stddev_ticks) {
            (Some(m), Some(sd)) => format!("{m:.1} ± {sd:.1}"),
            _ => "-".to_owned(),
        };
        let time = format!("{} ± {:.0}", r.time_ticks, r.time_stddev_ticks);
        let _ = writeln!(
            out,
            "{:>24} {:>9} {:>8.2}% {:>26} {:>24}",
            r.reason, r.samples, r.percent, time, per_exit,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONSOLE: &str = "vm guestOS1: exits: 3792 in all; handler cost in TSC ticks, VM exit to VM entry\r\n\
vm guestOS1: exit reason                      count          total       min       max      mean\r\n\
vm guestOS1: exit PREEMPTION_TIMER             3751        1701876       220      6167       453\r\n\
vm guestOS1: exit IO_INSTRUCTION                 41          31314       323     10825       763\r\n\
vm guestOS1: exit (unknown reason)          2\r\n\
vm guestOS1: io port 0x03fd         20\r\n\
vm guestOS1: io port 0x00f4          1\r\n\
vm other: stopped: exit code 0 (port 0xf4) after 14138765 ticks\r\n";

    #[test]
    fn console_tables_are_read_exactly() {
        let t = parse_console(CONSOLE);
        assert_eq!(t.len(), 1, "a stop line is not a table: {:?}", t.keys());
        let vm = &t["guestOS1"];
        assert_eq!(vm.exits, 3792);
        assert_eq!(vm.unknown_reason, 2);
        assert_eq!(vm.reasons.len(), 2);
        let timer = &vm.reasons[0];
        assert_eq!(timer.reason, "PREEMPTION_TIMER");
        assert_eq!(
            (
                timer.count,
                timer.total_ticks,
                timer.min_ticks,
                timer.max_ticks
            ),
            (3751, 1_701_876, 220, 6167)
        );
        assert!((timer.mean_ticks - 1_701_876.0 / 3751.0).abs() < 1e-9);
        assert!((timer.count_percent - 100.0 * 3751.0 / 3794.0).abs() < 1e-9);
        assert!((timer.time_percent - 100.0 * 1_701_876.0 / (1_701_876.0 + 31_314.0)).abs() < 1e-9);
        // Bhatia–Davis: the spread can be no larger than this.
        let m = timer.mean_ticks;
        assert!((timer.stddev_bound_ticks - ((6167.0 - m) * (m - 220.0)).sqrt()).abs() < 1e-9);
        assert_eq!(
            vm.io_ports,
            vec![("0x03fd".to_owned(), 20), ("0x00f4".to_owned(), 1)]
        );
    }

    #[test]
    fn estimates_scale_with_the_period_and_use_exact_counts() {
        let exact = &parse_console(CONSOLE)["guestOS1"];
        let mut by: HashMap<u16, u64> = HashMap::default();
        by.insert(52, 100);
        by.insert(30, 4);
        let t = sampled_table(&by, 896, 4000, Some(exact));
        assert_eq!(t.hypervisor_samples, 104);
        assert!((t.hypervisor_percent - 10.4).abs() < 1e-9);
        let timer = &t.reasons[0];
        assert_eq!(timer.reason, "PREEMPTION_TIMER");
        assert_eq!(timer.time_ticks, 400_000);
        assert!((timer.time_stddev_ticks - 40_000.0).abs() < 1e-9);
        assert!((timer.per_exit_ticks.unwrap() - 400_000.0 / 3751.0).abs() < 1e-9);
        let io = &t.reasons[1];
        assert_eq!(io.reason, "IO_INSTRUCTION");
        assert!((io.percent - 100.0 * 4.0 / 104.0).abs() < 1e-9);
    }
}
