//! Exit statistics in the manner of `perf kvm stat`, from two sources, kept apart:
//!
//! - **exact**: the per-VM tables the hypervisor sends in a VM end frame when a VM stops (every
//!   exit counted, its handler cost from VM exit to VM entry in TSC ticks: total, min, max and a
//!   log2 histogram, from which the median and 99th-percentile buckets). The hypervisor keeps
//!   no sum of squares, so the spread is given as the largest standard deviation those figures
//!   allow (Bhatia–Davis: σ² ≤ (max − mean)(mean − min)). The console shows the same table for
//!   people; it is never read here.
//! - **estimated**: the sample log, per VM and per vCPU: the hypervisor's samples taken while it
//!   worked on a vCPU's exit, by that vCPU's last exit reason. Each stands for one period; the
//!   estimate's standard deviation is √n periods (n samples, Poisson). With the deadline clock
//!   the exit each sample causes is never itself sampled, so these show the other exits' cost.

use std::fmt::Write;

use rustc_hash::FxHashMap as HashMap;
use serde::Serialize;

use hvprof_samplelog::{ExitStats, HISTOGRAM_BUCKETS, NO_VM, VmEnd, histogram_bucket_start};

use crate::model::profile::Profile;
use crate::model::samples::What;
use crate::naming::namer::exit_name;

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
    /// The handler costs' log2 histogram (non-empty buckets), and the buckets holding the
    /// median and the 99th percentile.
    pub histogram: Vec<CostBucket>,
    pub median_bucket: Option<CostBucket>,
    pub p99_bucket: Option<CostBucket>,
}

/// A VM's table as the hypervisor counted it (its VM end frame).
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
    /// The estimated time divided by the exact count of such exits (per VM, when the capture
    /// has its VM end frame), with its standard deviation.
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
    /// From its VM end frame (exact); `None` when the capture has none for this VM.
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

/// A histogram bucket's cost range, ticks (`to` is `None` for the last, open bucket).
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct CostBucket {
    pub from_ticks: u64,
    pub to_ticks: Option<u64>,
    pub count: u64,
}

impl CostBucket {
    /// `256-511`, `<64`, `≥1048576`.
    fn range(&self) -> String {
        match (self.from_ticks, self.to_ticks) {
            (0, Some(to)) => format!("<{}", to + 1),
            (from, Some(to)) => format!("{from}-{to}"),
            (from, None) => format!("≥{from}"),
        }
    }
}

/// The bucket holding quantile `q` (0..=1) of the exits (`None` without exits).
fn quantile_bucket(h: &[CostBucket], q: f64) -> Option<CostBucket> {
    let n: u64 = h.iter().map(|b| b.count).sum();
    if n == 0 {
        return None;
    }
    let rank = ((q * n as f64).ceil() as u64).clamp(1, n);
    let mut seen = 0;
    h.iter()
        .find(|b| {
            seen += b.count;
            seen >= rank
        })
        .copied()
}

impl ExactVm {
    /// A VM's table from its VM end frame: reasons named, shares computed, most frequent first.
    pub fn from_exits(e: &ExitStats) -> ExactVm {
        let count = e.total_exits();
        let time: u64 = e.reasons().map(|(_, r)| r.total).sum();
        let mut reasons: Vec<ExactReason> = e
            .reasons()
            .map(|(reason, r)| {
                let mean = r.total as f64 / r.count as f64;
                let histogram = (0..HISTOGRAM_BUCKETS)
                    .filter(|&b| r.histogram[b] > 0)
                    .map(|b| CostBucket {
                        from_ticks: histogram_bucket_start(b),
                        to_ticks: (b + 1 < HISTOGRAM_BUCKETS)
                            .then(|| histogram_bucket_start(b + 1) - 1),
                        count: u64::from(r.histogram[b]),
                    })
                    .collect::<Vec<_>>();
                ExactReason {
                    reason: exit_name(reason),
                    count: r.count,
                    count_percent: pct(r.count as f64, count as f64),
                    total_ticks: r.total,
                    time_percent: pct(r.total as f64, time as f64),
                    min_ticks: r.min,
                    max_ticks: r.max,
                    mean_ticks: mean,
                    stddev_bound_ticks: ((r.max as f64 - mean).max(0.0)
                        * (mean - r.min as f64).max(0.0))
                    .sqrt(),
                    median_bucket: quantile_bucket(&histogram, 0.5),
                    p99_bucket: quantile_bucket(&histogram, 0.99),
                    histogram,
                }
            })
            .collect();
        reasons.sort_by(|a, b| b.count.cmp(&a.count).then(a.reason.cmp(&b.reason)));
        let mut io_ports: Vec<(String, u64)> = e
            .ports()
            .iter()
            .map(|&(port, n)| (format!("{port:#06x}"), n))
            .collect();
        if e.ports_other > 0 {
            io_ports.push(("others".to_owned(), e.ports_other));
        }
        ExactVm {
            exits: count,
            reasons,
            unknown_reason: e.other,
            io_ports,
        }
    }
}

/// The exact tables of a capture's VM end frames: VM id → table (a VM's last frame wins).
pub fn exact_tables(vm_ends: &[VmEnd]) -> HashMap<u16, ExactVm> {
    let mut last: HashMap<u16, &VmEnd> = HashMap::default();
    for v in vm_ends {
        last.insert(v.vm, v);
    }
    last.into_iter()
        .map(|(id, v)| (id, ExactVm::from_exits(&v.exits)))
        .collect()
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
    let exact_by_vm = exact_tables(&p.vm_ends);
    let mut per_vm: HashMap<u16, HashMap<u16, u64>> = HashMap::default();
    let mut per_vcpu: HashMap<(u16, u16), HashMap<u16, u64>> = HashMap::default();
    let mut guest_vm: HashMap<u16, u64> = HashMap::default();
    let mut guest_vcpu: HashMap<(u16, u16), u64> = HashMap::default();
    for s in p.samples.stacks() {
        let n = s.count;
        match s.what {
            What::Hypervisor if s.vm != NO_VM => {
                *per_vm.entry(s.vm).or_default().entry(s.exit).or_default() += n;
                *per_vcpu
                    .entry((s.vm, s.vcpu))
                    .or_default()
                    .entry(s.exit)
                    .or_default() += n;
            }
            What::GuestKernel | What::GuestUser => {
                *guest_vm.entry(s.vm).or_default() += n;
                *guest_vcpu.entry((s.vm, s.vcpu)).or_default() += n;
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
            let exact = exact_by_vm.get(&id).cloned();
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
        "exact: the hypervisor's own exit table (its VM end frame), every exit counted, handler cost from VM exit to VM entry; stddev is the largest that count, min, max and mean allow (the hypervisor keeps no sum of squares)".to_owned(),
        format!(
            "estimated: from the samples, one period ({} ticks) per hypervisor sample taken on a vCPU's exit, by its last exit reason; ± is √n periods; the exit each sample causes is never sampled (deadline clock)",
            p.period_ticks
        ),
    ];
    if vms.iter().all(|v| v.exact.is_none()) {
        notes.push("the capture has no VM end frame (a VM that did not stop, a capture cut short, or a log from a hypervisor older than format version 2): exact figures unavailable".into());
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
            crate::naming::escape::printable(&vm.name),
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
                    "{:>24} {:>9} {:>9} {:>8} {:>9} {:>9} {:>24} {:>14} {:>14}",
                    "VM-EXIT",
                    "Samples",
                    "Samples%",
                    "Time%",
                    "Min",
                    "Max",
                    "Avg time ± stddev",
                    "Median in",
                    "p99 in"
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
                    let bucket = |b: &Option<CostBucket>| b.map_or("-".to_owned(), |b| b.range());
                    let _ = writeln!(
                        out,
                        "{:>24} {:>9} {:>8.2}% {:>7.2}% {:>9} {:>9} {:>24} {:>14} {:>14}",
                        r.reason,
                        r.count,
                        r.count_percent,
                        r.time_percent,
                        r.min_ticks,
                        r.max_ticks,
                        avg,
                        bucket(&r.median_bucket),
                        bucket(&r.p99_bucket)
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
                    "Exact: no VM end frame for this VM (it did not stop, or the capture was cut short)"
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

    /// The table of the old console example, as the hypervisor counts it: 3751 timer exits
    /// (220..6167 ticks, 1701876 in all), 41 port I/O exits (323..10825, 31314), 2 of an
    /// unknown reason, ports 0x3fd x20 and 0xf4 x1.
    fn guest_os1() -> ExitStats {
        let mut e = ExitStats::new();
        e.record(52, 220);
        e.record(52, 6167);
        let rest = 1_701_876 - 220 - 6167;
        for i in 0..3749u64 {
            e.record(52, rest / 3749 + u64::from(i < rest % 3749));
        }
        e.record(30, 323);
        e.record(30, 10_825);
        let rest = 31_314 - 323 - 10_825;
        for i in 0..39u64 {
            e.record(30, rest / 39 + u64::from(i < rest % 39));
        }
        e.record(200, 1);
        e.record(300, 1);
        for _ in 0..20 {
            e.record_port(0x3fd);
        }
        e.record_port(0xf4);
        e
    }

    #[test]
    fn vm_end_tables_are_read_exactly() {
        let ends = [
            VmEnd {
                vm: 3,
                exits: ExitStats::new(),
                ..VmEnd::default()
            },
            VmEnd {
                vm: 3,
                exits: guest_os1(),
                ..VmEnd::default()
            },
        ];
        let t = exact_tables(&ends);
        assert_eq!(t.len(), 1);
        let vm = &t[&3];
        assert_eq!(vm.exits, 3794);
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
        // 3749 of the 3751 timer exits cost about 452 ticks: bucket 256-511 holds the median and
        // the 99th percentile; the histogram holds every exit.
        let b = timer.median_bucket.unwrap();
        assert_eq!((b.from_ticks, b.to_ticks), (256, Some(511)));
        assert_eq!(timer.p99_bucket.unwrap().from_ticks, 256);
        assert_eq!(timer.histogram.iter().map(|b| b.count).sum::<u64>(), 3751);
        assert_eq!(b.range(), "256-511");
    }

    #[test]
    fn estimates_scale_with_the_period_and_use_exact_counts() {
        let exact = &ExactVm::from_exits(&guest_os1());
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
