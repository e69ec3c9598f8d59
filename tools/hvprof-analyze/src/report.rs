//! The unified profile (the paper's Tables 3-5): a host-level table (each VM as one row, the
//! hypervisor's functions, `[idle]`) and a guest-level table per VM and per vCPU (guest functions
//! with their module, OS/USER split, `[steal]`), with the sample path's cost and every loss.
//!
//! # JSON schema (`report --json`)
//! ```text
//! { "total_samples": u64,            // samples received (all kinds)
//!   "events": u64,                   // scheduling events received
//!   "period_ticks": u64, "tsc_hz": u64, "pcpus": u16, "source": "deadline" | "pmu",
//!   "hypervisor_build_id": hex, "hypervisor_build_id_matches": bool | null,
//!   "lost": { "blocks": u64, "samples": u64, "events": u64, "dropped": u64,
//!             "damaged_frames": u64, "truncated": bool },
//!   "losses": [ { "pcpu": u16,                      // where records are missing, per pCPU:
//!                 "from_tsc": u64 | null,           // last record before (null: log start)
//!                 "to_tsc": u64 | null,             // first record after (null: log end)
//!                 "from_seconds": f64 | null, "to_seconds": f64 | null, // since the 1st sample
//!                 "blocks": u64, "samples": u64, "events": u64,         // lost on the way
//!                 "dropped": u64,                   // dropped by the hypervisor (ring full)
//!                 "truncated": bool } ],            // no end frame: the rest is unknown
//!   "integrity": { "header_conflicts": u64,         // headers differing from the first
//!                  "duplicate_blocks": u64,         // a pCPU's block number seen twice
//!                  "tasks_of_unknown_vms": u64,     // task frames naming unlisted VMs,
//!                  "unknown_task_vms": [ u16 ] },   // and those VMs
//!   "cost": { "mean": f64, "min": u64, "max": u64, "percent_of_period": f64 }, // sample path
//!   "whole_cost": null | { "percent": f64,         // the profiler's whole cost, all pCPUs,
//!       "pcpus": [ { "pcpu", "percent", "span_ticks", "samples", // as the hypervisor measured
//!         "sampling_exits", "sampling_exit_mean", "sampling_exit_percent", // it (crate::cost)
//!         "timer_interrupts", "timer_interrupt_mean", "timer_percent",
//!         "other_sample_ticks", "other_sample_percent", "export_ticks", "export_percent",
//!         "task_reads", "task_read_mean" } ] },
//!   "host": { "hypervisor": f64, "vm": f64, "idle": f64,          // percentages
//!             "rows": [ { "function", "module", "samples", "percent" } ] },
//!   "vms": [ { "id": u16, "name", "image", "samples": u64,        // guest + steal samples
//!              "os": f64, "user": f64, "idle": f64, "steal": f64, // percentages of "samples"
//!              "rows": [ row ], "vcpus": [ { "vcpu": u16, "samples", "os", "user", "idle",
//!              "steal", "rows": [ row ] } ] } ] },
//!   "warnings": [ string ] }   // losses first (one per range, up to 20), integrity, the others
//! ```
//! Rows are sorted by samples (descending), then function name. Percentages are of the table's
//! total; they are not rounded.

use rustc_hash::FxHashMap as HashMap;

use hvprof_samplelog::{Decoded, Record, SampleKind};
use serde::Serialize;

use crate::naming::{Namer, function_name as name};
use crate::symbols::{Symbols, hex};
use crate::timeline::Owner;

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Row {
    pub function: String,
    pub module: String,
    /// The guest process (`comm[tgid]`), for Linux guests whose task frames name it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<String>,
    pub samples: u64,
    pub percent: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Lost {
    pub blocks: u64,
    pub samples: u64,
    pub events: u64,
    pub dropped: u64,
    pub damaged_frames: u64,
    pub truncated: bool,
}

/// Signs that the log was tampered with (or badly damaged): a guest that could write to the
/// capture channel might forge frames.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Integrity {
    /// Header frames that differ from the first one (the first is used).
    pub header_conflicts: u64,
    /// Blocks received twice (same pCPU and sequence number; later copies are ignored).
    pub duplicate_blocks: u64,
    /// Task frames naming a VM the header does not list.
    pub tasks_of_unknown_vms: u64,
    /// Those VMs.
    pub unknown_task_vms: Vec<u16>,
}

impl Integrity {
    fn of(decoded: &Decoded) -> Self {
        let listed = |vm: u16| {
            decoded
                .header
                .as_ref()
                .is_some_and(|h| h.vms.iter().any(|v| v.id == vm))
        };
        let mut unknown: Vec<u16> = Vec::new();
        let mut tasks = 0u64;
        for t in decoded.tasks.iter().filter(|t| !listed(t.vm)) {
            tasks += 1;
            unknown.push(t.vm);
        }
        unknown.sort_unstable();
        unknown.dedup();
        Integrity {
            header_conflicts: decoded.header_conflicts,
            duplicate_blocks: decoded
                .pcpus
                .values()
                .fold(0, |n, p| n.saturating_add(p.duplicate_blocks)),
            tasks_of_unknown_vms: tasks,
            unknown_task_vms: unknown,
        }
    }

    /// The warnings, one per kind of sign.
    fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        if self.header_conflicts > 0 {
            w.push(format!(
                "log integrity: {} header frame(s) differ from the first one (forged or corrupted; the first is used)",
                self.header_conflicts
            ));
        }
        if self.duplicate_blocks > 0 {
            w.push(format!(
                "log integrity: {} duplicate block(s), a pCPU's sequence number sent twice (replayed or forged; later copies ignored)",
                self.duplicate_blocks
            ));
        }
        if self.tasks_of_unknown_vms > 0 {
            const SHOWN: usize = 10;
            let mut vms: Vec<String> = self
                .unknown_task_vms
                .iter()
                .take(SHOWN)
                .map(|v| format!("vm{v}"))
                .collect();
            if self.unknown_task_vms.len() > SHOWN {
                vms.push(format!("{} more", self.unknown_task_vms.len() - SHOWN));
            }
            w.push(format!(
                "log integrity: {} task frame(s) name VMs the header does not list ({}): forged or corrupted",
                self.tasks_of_unknown_vms,
                vms.join(", ")
            ));
        }
        w
    }
}

/// Where a pCPU's records are missing, in host time (one per decoder `Gap`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LossRange {
    pub pcpu: u16,
    /// TSC of the last record received before the loss (`None`: from the start of the log).
    pub from_tsc: Option<u64>,
    /// TSC of the first record received after it (`None`: until the end of the log).
    pub to_tsc: Option<u64>,
    /// The same in seconds since the capture's first sample (`None` also when the TSC
    /// frequency is unknown).
    pub from_seconds: Option<f64>,
    pub to_seconds: Option<f64>,
    /// Blocks lost on the way, and the samples and events they held.
    pub blocks: u64,
    pub samples: u64,
    pub events: u64,
    /// Samples the hypervisor dropped (ring full).
    pub dropped: u64,
    /// The log ends here without an end frame: what followed is unknown.
    pub truncated: bool,
}

impl LossRange {
    /// Samples missing here (lost in blocks and dropped), saturating.
    pub fn samples_missing(&self) -> u64 {
        self.samples.saturating_add(self.dropped)
    }

    /// One line for the reader: how many samples, on which pCPU, over which host time.
    pub fn describe(&self) -> String {
        let at = |tsc: Option<u64>, s: Option<f64>, none: &str| match (tsc, s) {
            (Some(t), Some(s)) => format!("TSC {t} ({s:.6} s)"),
            (Some(t), None) => format!("TSC {t}"),
            (None, _) => none.to_owned(),
        };
        let from = at(self.from_tsc, self.from_seconds, "the start of the log");
        let to = at(self.to_tsc, self.to_seconds, "the end of the log");
        let mut what = Vec::new();
        if self.blocks > 0 || self.samples > 0 {
            what.push(format!(
                "{} samples and {} events lost in {} block(s)",
                self.samples, self.events, self.blocks
            ));
        }
        if self.dropped > 0 {
            what.push(format!(
                "{} samples dropped by the hypervisor (ring full)",
                self.dropped
            ));
        }
        if self.truncated {
            what.push("no end frame: what it recorded is unknown".into());
        }
        format!(
            "pCPU {}: {} from {from} to {to}",
            self.pcpu,
            what.join("; ")
        )
    }
}

/// The capture's losses, in host time, and the warnings that open the report: one per range
/// (the first `MAX_LOSS_LINES`, then their total).
fn losses(decoded: &Decoded, first_tsc: Option<u64>, tsc_hz: u64) -> (Vec<LossRange>, Vec<String>) {
    let seconds = |tsc: Option<u64>| {
        let (t, first) = (tsc?, first_tsc?);
        (tsc_hz > 0).then(|| t.saturating_sub(first) as f64 / tsc_hz as f64)
    };
    let ranges: Vec<LossRange> = decoded
        .gaps()
        .map(|g| LossRange {
            pcpu: g.pcpu,
            from_tsc: g.after_tsc,
            to_tsc: g.before_tsc,
            from_seconds: seconds(g.after_tsc),
            to_seconds: seconds(g.before_tsc),
            blocks: g.blocks,
            samples: g.samples,
            events: g.events,
            dropped: g.dropped,
            truncated: g.truncated,
        })
        .collect();
    let mut lines: Vec<String> = ranges
        .iter()
        .take(MAX_LOSS_LINES)
        .map(|l| format!("records lost: {}", l.describe()))
        .collect();
    if ranges.len() > MAX_LOSS_LINES {
        let rest = &ranges[MAX_LOSS_LINES..];
        let n = rest
            .iter()
            .fold(0u64, |n, l| n.saturating_add(l.samples_missing()));
        lines.push(format!(
            "records lost: {} more ranges ({n} samples): see the JSON report's \"losses\"",
            rest.len()
        ));
    }
    (ranges, lines)
}

/// Loss ranges the report's warnings list one by one.
pub const MAX_LOSS_LINES: usize = 20;

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Cost {
    pub mean: f64,
    pub min: u64,
    pub max: u64,
    pub percent_of_period: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Host {
    pub hypervisor: f64,
    pub vm: f64,
    pub idle: f64,
    pub rows: Vec<Row>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct GuestTable {
    pub samples: u64,
    pub os: f64,
    pub user: f64,
    pub idle: f64,
    pub steal: f64,
    pub rows: Vec<Row>,
    /// The same split from the scheduling events (exact TSC time), when the log has them.
    pub exact: Option<Exact>,
}

/// Percentages of a vCPU's (or VM's) lifetime from its scheduling events, and how far the
/// sample-based figures are from them (percentage points; the steal difference leaves out
/// `[steal] (hypervisor)`, the hypervisor's work while the vCPU was in, which the events count as
/// running).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Exact {
    pub ticks: u64,
    pub running: f64,
    pub idle: f64,
    pub steal: f64,
    pub idle_difference: f64,
    pub steal_difference: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct VcpuReport {
    pub vcpu: u16,
    #[serde(flatten)]
    pub table: GuestTable,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct VmReport {
    pub id: u16,
    pub name: String,
    pub image: String,
    #[serde(flatten)]
    pub table: GuestTable,
    pub vcpus: Vec<VcpuReport>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Report {
    pub total_samples: u64,
    pub events: u64,
    pub period_ticks: u64,
    pub tsc_hz: u64,
    pub pcpus: u16,
    pub source: &'static str,
    pub hypervisor_build_id: String,
    pub hypervisor_build_id_matches: Option<bool>,
    pub lost: Lost,
    /// Where records are missing, per pCPU, in host time.
    pub losses: Vec<LossRange>,
    /// Signs of a forged or damaged log.
    pub integrity: Integrity,
    pub cost: Cost,
    /// The profiler's whole cost, from the hypervisor's closing lines (`None` without them).
    pub whole_cost: Option<crate::cost::WholeCost>,
    pub host: Host,
    pub vms: Vec<VmReport>,
    /// Warnings for the reader: first where records were lost, then signs of a forged log
    /// (`integrity`), then missing symbols, mismatched build ids, truncation.
    pub warnings: Vec<String>,
}

/// What symbolizes what.
#[derive(Default)]
pub struct Images {
    pub hypervisor: Option<Symbols>,
    pub guests: Vec<Symbols>,
    /// The kernel of the Linux guests (`--kernel`): their kernel functions, by VM after the
    /// KASLR slide each VM's `IA32_LSTAR` line gives.
    pub kernel: Option<linux_guest::KernelImage>,
}

/// A guest table row's identity: function, module, process.
type RowKey = (String, String, Option<String>);

/// Guest-level counts of one VM or vCPU, before naming.
#[derive(Default)]
struct GuestCounts {
    /// (rip, cpl 0 or 3) → samples.
    by_rip: HashMap<(u64, bool), u64>,
    /// Samples already named (Linux guests): (function, module, process) → samples.
    named: HashMap<RowKey, u64>,
    os: u64,
    user: u64,
    /// `[steal]` slots by their module label: `(outside)`, `(on vcpuN)`, `(hypervisor)`.
    steal: HashMap<String, u64>,
    idle: u64,
}

impl GuestCounts {
    fn add_guest(&mut self, rip: u64, user: bool, n: u64) {
        *self.by_rip.entry((rip, user)).or_default() += n;
        if user {
            self.user += n;
        } else {
            self.os += n;
        }
    }

    fn add_named(&mut self, key: &RowKey, user: bool) {
        *self.named.entry(key.clone()).or_default() += 1;
        if user {
            self.user += 1;
        } else {
            self.os += 1;
        }
    }

    fn steal_total(&self) -> u64 {
        self.steal.values().sum()
    }

    fn table(&self, symbols: Option<&Symbols>, module: &str) -> GuestTable {
        let steal = self.steal_total();
        let total = self.os + self.user + steal + self.idle;
        let pct = |n: u64| percent(n, total);
        // Name each distinct address once, then merge by function.
        let mut by_fn: HashMap<RowKey, u64> = HashMap::default();
        for (&(rip, _), &n) in &self.by_rip {
            *by_fn
                .entry((name(symbols, rip), module.to_owned(), None))
                .or_default() += n;
        }
        for (key, &n) in &self.named {
            *by_fn.entry(key.clone()).or_default() += n;
        }
        for (label, &n) in &self.steal {
            if n > 0 {
                by_fn.insert(("[steal]".into(), label.clone(), None), n);
            }
        }
        if self.idle > 0 {
            by_fn.insert(("[idle]".into(), "(halted)".into(), None), self.idle);
        }
        GuestTable {
            samples: total,
            os: pct(self.os),
            user: pct(self.user),
            idle: pct(self.idle),
            steal: pct(steal),
            rows: rows(by_fn, total),
            exact: None,
        }
    }
}

/// `n` as a percentage of `total` (0 when there is nothing).
fn percent(n: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        100.0 * n as f64 / total as f64
    }
}

fn rows(counts: HashMap<RowKey, u64>, total: u64) -> Vec<Row> {
    let mut rows: Vec<Row> = counts
        .into_iter()
        .map(|((function, module, process), samples)| Row {
            function,
            module,
            process,
            samples,
            percent: percent(samples, total),
        })
        .collect();
    rows.sort_by(|a, b| {
        b.samples
            .cmp(&a.samples)
            .then_with(|| a.function.cmp(&b.function))
    });
    rows
}

/// (vm, vcpu, user mode).
pub type VcpuMode = (u16, u16, bool);

/// Every sample, counted: what the report needs from the records, built while they are decoded
/// (possibly on several threads, then merged).
#[derive(Debug, Clone, Default)]
pub struct Aggregate {
    pub total: u64,
    pub events: u64,
    pub hv_by_rip: HashMap<u64, u64>,
    pub idle: u64,
    /// Per (vm, vcpu, user mode): guest RIP → samples. A short list: a capture has few vCPUs,
    /// and consecutive samples mostly come from the same one (`last` remembers it).
    pub guest: Vec<(VcpuMode, HashMap<u64, u64>)>,
    last: usize,
    /// Where each key is in `guest` (a forged log may name thousands of vCPUs).
    guest_index: HashMap<VcpuMode, usize>,
    /// (vm, vcpu) → hypervisor samples taken on that vCPU's behalf.
    pub steal: HashMap<(u16, u16), u64>,
    pub cost_sum: u64,
    pub cost_min: u64,
    pub cost_max: u64,
    /// Per pCPU: every sample's TSC and owner, for the common time axis.
    pub timeline: HashMap<u16, Vec<(u64, Owner)>>,
    /// Every scheduling event, with its pCPU.
    pub sched: Vec<(u16, hvprof_samplelog::Event)>,
    /// Keep every guest sample (for naming Linux guests' processes and kernel functions, which
    /// needs each sample's time) instead of counting it by address.
    pub keep_guest: bool,
    pub guest_samples: Vec<GuestSample>,
}

/// The index of `key`'s counts in `guest`, added if new.
fn guest_slot(
    guest: &mut Vec<(VcpuMode, HashMap<u64, u64>)>,
    index: &mut HashMap<VcpuMode, usize>,
    key: VcpuMode,
) -> usize {
    *index.entry(key).or_insert_with(|| {
        guest.push((key, HashMap::default()));
        guest.len() - 1
    })
}

/// A guest sample kept whole (see `Aggregate::keep_guest`).
#[derive(Debug, Clone, Copy)]
pub struct GuestSample {
    pub vm: u16,
    pub vcpu: u16,
    pub tsc: u64,
    pub rip: u64,
    pub user: bool,
}

impl Aggregate {
    pub fn new() -> Self {
        Self {
            cost_min: u64::MAX,
            ..Self::default()
        }
    }

    /// An aggregate that keeps every guest sample (`keep_guest`).
    pub fn keeping_guest_samples() -> Self {
        Self {
            keep_guest: true,
            ..Self::new()
        }
    }

    pub fn add(&mut self, pcpu: u16, records: &[Record]) {
        let line = self.timeline.entry(pcpu).or_default();
        for r in records {
            let s = match r {
                Record::Sample(s) => s,
                Record::Event(e) => {
                    self.events += 1;
                    self.sched.push((pcpu, *e));
                    continue;
                }
            };
            line.push((
                s.tsc,
                match s.kind {
                    SampleKind::Guest => Owner::Guest {
                        vm: s.vm,
                        vcpu: s.vcpu,
                    },
                    SampleKind::Hypervisor => Owner::Hypervisor {
                        vm: s.vm,
                        vcpu: s.vcpu,
                    },
                    SampleKind::Idle => Owner::Idle,
                },
            ));
            self.total += 1;
            let cost = u64::from(s.cost);
            self.cost_sum += cost;
            self.cost_min = self.cost_min.min(cost);
            self.cost_max = self.cost_max.max(cost);
            match s.kind {
                SampleKind::Guest if self.keep_guest => self.guest_samples.push(GuestSample {
                    vm: s.vm,
                    vcpu: s.vcpu,
                    tsc: s.tsc,
                    rip: s.guest_rip,
                    user: s.cpl() == 3,
                }),
                SampleKind::Guest => {
                    let key = (s.vm, s.vcpu, s.cpl() == 3);
                    if self.guest.get(self.last).is_none_or(|g| g.0 != key) {
                        self.last = guest_slot(&mut self.guest, &mut self.guest_index, key);
                    }
                    *self.guest[self.last].1.entry(s.guest_rip).or_default() += 1;
                }
                SampleKind::Hypervisor => {
                    *self.hv_by_rip.entry(s.host_rip).or_default() += 1;
                    // Time the hypervisor spent on a VM's behalf is that VM's steal.
                    if s.vm != hvprof_samplelog::NO_VM {
                        *self.steal.entry((s.vm, s.vcpu)).or_default() += 1;
                    }
                }
                SampleKind::Idle => self.idle += 1,
            }
        }
    }

    pub fn merge(&mut self, other: Aggregate) {
        self.total += other.total;
        self.events += other.events;
        self.idle += other.idle;
        self.cost_sum += other.cost_sum;
        self.cost_min = self.cost_min.min(other.cost_min);
        self.cost_max = self.cost_max.max(other.cost_max);
        for (k, v) in other.hv_by_rip {
            *self.hv_by_rip.entry(k).or_default() += v;
        }
        for (key, rips) in other.guest {
            let i = guest_slot(&mut self.guest, &mut self.guest_index, key);
            for (rip, n) in rips {
                *self.guest[i].1.entry(rip).or_default() += n;
            }
        }
        for (k, v) in other.steal {
            *self.steal.entry(k).or_default() += v;
        }
        for (k, v) in other.timeline {
            self.timeline.entry(k).or_default().extend(v);
        }
        self.sched.extend(other.sched);
        self.guest_samples.extend(other.guest_samples);
    }
}

/// Decodes a capture on `threads` threads and counts its samples as they come (keeping every
/// guest sample with `keep_guest`, for Linux guests).
pub fn analyze(bytes: &[u8], threads: usize, keep_guest: bool) -> (Decoded, Aggregate) {
    let init = || {
        if keep_guest {
            Aggregate::keeping_guest_samples()
        } else {
            Aggregate::new()
        }
    };
    let (decoded, parts) =
        hvprof_samplelog::decode_parallel(bytes, threads, init, |a, p, r| a.add(p, r));
    let mut agg = init();
    for p in parts {
        agg.merge(p);
    }
    (decoded, agg)
}

/// Builds the report of a decoded capture (its records counted here).
#[cfg(test)]
pub fn build(decoded: &Decoded, images: &Images) -> Report {
    let mut agg = Aggregate::new();
    for (&pcpu, log) in &decoded.pcpus {
        agg.add(pcpu, &log.records);
    }
    build_from(decoded, agg, images)
}

/// Names the guest samples kept whole (`Aggregate::keep_guest`): each takes its vCPU's process at
/// its time from the task frames; kernel-mode samples of a Linux VM take the kernel's function
/// (after the VM's KASLR slide) under `[guest.kallsyms]`, user-mode ones the function of the
/// image named like the process (`--image w41` for process `w41`), else their address. Samples
/// of the other VMs are counted by address, as without `keep_guest`.
fn name_linux_samples(
    namer: &Namer,
    samples: &[GuestSample],
    per_vm: &mut HashMap<u16, GuestCounts>,
    per_vcpu: &mut HashMap<(u16, u16), GuestCounts>,
) {
    let mut cache: HashMap<(u16, bool, u64, Option<String>), RowKey> = HashMap::default();
    for g in samples {
        if !namer.is_linux(g.vm) {
            per_vm.entry(g.vm).or_default().add_guest(g.rip, g.user, 1);
            per_vcpu
                .entry((g.vm, g.vcpu))
                .or_default()
                .add_guest(g.rip, g.user, 1);
            continue;
        }
        let process = namer.task(g.vm, g.vcpu, g.tsc).map(str::to_owned);
        let key = cache
            .entry((g.vm, g.user, g.rip, process.clone()))
            .or_insert_with(|| {
                let (function, module) =
                    namer.guest_function(g.vm, g.user, g.rip, process.as_deref());
                (function, module, process)
            })
            .clone();
        per_vm.entry(g.vm).or_default().add_named(&key, g.user);
        per_vcpu
            .entry((g.vm, g.vcpu))
            .or_default()
            .add_named(&key, g.user);
    }
}

/// The exact split of the vCPUs' lifetimes from their scheduling events, beside `table`.
fn exact_of<'a>(
    table: &GuestTable,
    blanks: impl Iterator<Item = &'a crate::timeline::Blanks>,
) -> Option<Exact> {
    let (mut run, mut out, mut halted) = (0u64, 0u64, 0u64);
    let mut hypervisor_out = 0u64;
    let mut any = false;
    for b in blanks {
        any = true;
        hypervisor_out += b.hypervisor_out;
        run += b.ticks_in;
        out += b.ticks_out;
        halted += b.ticks_halted;
    }
    let ticks = run + out + halted;
    if !any || ticks == 0 {
        return None;
    }
    let pct = |n: u64| 100.0 * n as f64 / ticks as f64;
    // The events time the vCPU's absence (preempted); the hypervisor's work while it was in is
    // steal for the samples but running for the events: compare like with like (its work while
    // the vCPU was out is absence for both).
    let hypervisor: f64 = table
        .rows
        .iter()
        .filter(|r| r.function == "[steal]" && r.module == "(hypervisor)")
        .map(|r| r.percent)
        .sum::<f64>()
        - percent(hypervisor_out, table.samples);
    Some(Exact {
        ticks,
        running: pct(run),
        idle: pct(halted),
        steal: pct(out),
        idle_difference: table.idle - pct(halted),
        steal_difference: table.steal - hypervisor - pct(out),
    })
}

/// Builds the report from a capture's description and its counted samples.
pub fn build_from(decoded: &Decoded, agg: Aggregate, images: &Images) -> Report {
    let mut warnings = Vec::new();
    let header = decoded.header.clone().unwrap_or_default();
    if decoded.header.is_none() {
        warnings.push("no header frame: VM names and the period are unknown".into());
    }
    let namer = Namer::new(decoded, images, &mut warnings);
    let vm_table: Vec<(u16, String, String)> = namer
        .vms
        .iter()
        .map(|v| (v.id, v.name.clone(), v.image.clone()))
        .collect();
    let hv_id = header.build_id.as_bytes().to_vec();
    let hv_matches = images
        .hypervisor
        .as_ref()
        .map(|s| s.build_id.as_deref() == Some(hv_id.as_slice()));
    if hv_matches == Some(false) {
        warnings.push(
            "the hypervisor ELF given does not have the build id in the log: its names may be wrong"
                .into(),
        );
    }

    let Aggregate {
        total,
        events,
        hv_by_rip,
        idle,
        guest,
        steal,
        cost_sum,
        cost_min,
        cost_max,
        mut timeline,
        sched,
        guest_samples,
        ..
    } = agg;
    let mut per_vm: HashMap<u16, GuestCounts> = HashMap::default();
    let mut per_vcpu: HashMap<(u16, u16), GuestCounts> = HashMap::default();
    for &((vm, vcpu, user), ref rips) in &guest {
        for (&rip, &n) in rips {
            per_vm.entry(vm).or_default().add_guest(rip, user, n);
            per_vcpu
                .entry((vm, vcpu))
                .or_default()
                .add_guest(rip, user, n);
        }
    }
    name_linux_samples(&namer, &guest_samples, &mut per_vm, &mut per_vcpu);
    let mut exact: HashMap<(u16, u16), crate::timeline::Blanks> = HashMap::default();
    if sched.is_empty() {
        // No scheduling events (an old or partial log): the hypervisor's samples on a vCPU's
        // behalf are all that can be called its steal.
        for (&(vm, vcpu), &n) in &steal {
            *per_vm
                .entry(vm)
                .or_default()
                .steal
                .entry("(hypervisor)".into())
                .or_default() += n;
            *per_vcpu
                .entry((vm, vcpu))
                .or_default()
                .steal
                .entry("(hypervisor)".into())
                .or_default() += n;
        }
    } else {
        for line in timeline.values_mut() {
            line.sort_by_key(|(t, _)| *t);
        }
        exact = crate::timeline::blanks(&timeline, &sched);
        for (&(vm, vcpu), b) in &exact {
            let add = |g: &mut GuestCounts| {
                g.idle += b.idle;
                if b.steal_outside > 0 {
                    *g.steal.entry("(outside)".into()).or_default() += b.steal_outside;
                }
                if b.hypervisor + b.hypervisor_out > 0 {
                    *g.steal.entry("(hypervisor)".into()).or_default() +=
                        b.hypervisor + b.hypervisor_out;
                }
                for (&other, &n) in &b.steal_on {
                    *g.steal.entry(format!("(on vcpu{other})")).or_default() += n;
                }
                if b.steal_on_others > 0 {
                    *g.steal.entry("(on other vcpus)".into()).or_default() += b.steal_on_others;
                }
            };
            add(per_vm.entry(vm).or_default());
            add(per_vcpu.entry((vm, vcpu)).or_default());
        }
    }

    // Host level.
    let pct = |n: u64| percent(n, total);
    let mut host_counts: HashMap<(String, String), u64> = HashMap::default();
    let mut vm_samples = 0u64;
    for (&vm, c) in &per_vm {
        let n = c.os + c.user;
        if n == 0 {
            continue;
        }
        vm_samples += n;
        let label = vm_table
            .iter()
            .find(|v| v.0 == vm)
            .map_or_else(|| format!("vm{vm}"), |v| v.1.clone());
        host_counts.insert((format!("[{label}]"), format!("(vm {vm})")), n);
    }
    let mut hv_samples = 0u64;
    for (&rip, &n) in &hv_by_rip {
        hv_samples += n;
        *host_counts
            .entry((name(images.hypervisor.as_ref(), rip), "hvprof".into()))
            .or_default() += n;
    }
    if idle > 0 {
        host_counts.insert(("[idle]".into(), "(idle)".into()), idle);
    }

    let mut vms: Vec<VmReport> = vm_table
        .iter()
        .map(|(id, name, image)| {
            let counts = per_vm.remove(id).unwrap_or_default();
            let symbols = namer.guest_symbols(*id);
            let mut vcpus: Vec<VcpuReport> = per_vcpu
                .iter()
                .filter(|((vm, _), _)| vm == id)
                .map(|(&(_, vcpu), c)| {
                    let mut table = c.table(symbols, image);
                    table.exact = exact_of(&table, exact.get(&(*id, vcpu)).into_iter());
                    VcpuReport { vcpu, table }
                })
                .collect();
            vcpus.sort_by_key(|v| v.vcpu);
            let mut table = counts.table(symbols, image);
            table.exact = exact_of(
                &table,
                exact.iter().filter(|((vm, _), _)| vm == id).map(|(_, b)| b),
            );
            VmReport {
                id: *id,
                name: name.clone(),
                image: image.clone(),
                table,
                vcpus,
            }
        })
        .collect();
    // Samples of VMs the header does not list (a damaged or missing header).
    let mut unknown: Vec<u16> = per_vm.keys().copied().collect();
    unknown.sort_unstable();
    for id in unknown {
        let counts = &per_vm[&id];
        vms.push(VmReport {
            id,
            name: format!("vm{id}"),
            image: String::new(),
            table: counts.table(None, "?"),
            vcpus: Vec::new(),
        });
    }

    let lost = Lost {
        blocks: decoded.blocks_lost(),
        samples: decoded.samples_lost(),
        events: decoded.events_lost(),
        dropped: decoded.ring_drops(),
        damaged_frames: decoded.damaged.len() as u64,
        truncated: !decoded.end_seen(),
    };
    if lost.truncated {
        warnings.push(
            "no end frame: the capture is truncated (losses after the last block are unknown)"
                .into(),
        );
    }
    let first_tsc = timeline.values().flat_map(|l| l.iter().map(|s| s.0)).min();
    let (losses, mut first_lines) = losses(decoded, first_tsc, header.tsc_hz);
    let integrity = Integrity::of(decoded);
    first_lines.extend(integrity.warnings());
    warnings.splice(0..0, first_lines);
    let mean = if total == 0 {
        0.0
    } else {
        cost_sum as f64 / total as f64
    };
    Report {
        total_samples: total,
        events,
        period_ticks: header.period_ticks,
        tsc_hz: header.tsc_hz,
        pcpus: header.pcpus,
        source: if header.source == hvprof_samplelog::SOURCE_PMU {
            "pmu"
        } else {
            "deadline"
        },
        hypervisor_build_id: hex(&hv_id),
        hypervisor_build_id_matches: hv_matches,
        lost,
        losses,
        integrity,
        cost: Cost {
            mean,
            min: if total == 0 { 0 } else { cost_min },
            max: cost_max,
            percent_of_period: if header.period_ticks == 0 {
                0.0
            } else {
                100.0 * mean / header.period_ticks as f64
            },
        },
        whole_cost: crate::cost::from_frames(&decoded.costs),
        host: Host {
            hypervisor: pct(hv_samples),
            vm: pct(vm_samples),
            idle: pct(idle),
            rows: rows(
                host_counts
                    .into_iter()
                    .map(|((f, m), n)| ((f, m, None), n))
                    .collect(),
                total,
            ),
        },
        vms,
        warnings,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvprof_samplelog::synth;

    use hvprof_samplelog::{
        BlockEncoder, BuildId, FixedStr, Header, MAX_HEADER_FRAME_LEN, PcpuTotals, Sample, VmInfo,
        encode_end, encode_header, max_block_frame_len, max_end_frame_len,
    };
    use proptest::prelude::*;

    #[test]
    fn empty_capture() {
        let r = build(&hvprof_samplelog::decode(&[]), &Images::default());
        assert_eq!(r.total_samples, 0);
        assert!(r.lost.truncated);
        assert!(r.host.rows.is_empty());
    }

    fn sample(kind: SampleKind, vm: u16, rip: u64, cpl: u8) -> Record {
        Record::Sample(Sample {
            tsc: 0,
            kind,
            vm,
            vcpu: 0,
            vpid: vm.wrapping_add(1),
            guest_rip: if kind == SampleKind::Guest { rip } else { 0 },
            guest_cr3: 0x1000,
            guest_mode: hvprof_samplelog::guest_mode(cpl, 2),
            exit_reason: 52,
            host_rip: if kind == SampleKind::Hypervisor {
                rip
            } else {
                0
            },
            cost: 30,
        })
    }

    /// A capture with a known mix: VM a: 60 kernel + 20 user samples, VM b: 10 samples, 8
    /// hypervisor samples on behalf of VM a, 2 idle.
    fn known_capture() -> Vec<u8> {
        let mut header = Header {
            period_ticks: 4000,
            tsc_hz: 4_000_000,
            pcpus: 1,
            ..Header::default()
        };
        for (id, name) in [(0u16, "a"), (1, "b")] {
            header
                .vms
                .push(VmInfo {
                    id,
                    name: FixedStr::truncated(name),
                    vcpus: 1,
                    image: FixedStr::truncated("img.elf"),
                    image_build_id: BuildId::default(),
                })
                .unwrap();
        }
        let mut records = Vec::new();
        records.extend((0..60).map(|i| sample(SampleKind::Guest, 0, 0x1000 + i % 4, 0)));
        records.extend((0..20).map(|_| sample(SampleKind::Guest, 0, 0x2000, 3)));
        records.extend((0..10).map(|_| sample(SampleKind::Guest, 1, 0x3000, 0)));
        records.extend((0..8).map(|_| sample(SampleKind::Hypervisor, 0, 0x100_0000, 0)));
        records.extend((0..2).map(|_| sample(SampleKind::Idle, hvprof_samplelog::NO_VM, 0, 0)));
        let mut out = b"boot text\n".to_vec();
        let mut buf = vec![
            0u8;
            MAX_HEADER_FRAME_LEN
                .max(max_block_frame_len(64))
                .max(max_end_frame_len(1))
        ];
        let n = encode_header(&header, &mut buf).unwrap();
        out.extend_from_slice(&buf[..n]);
        let mut enc = BlockEncoder::new(0, 4000);
        for chunk in records.chunks(64) {
            let n = enc.encode(chunk, 0, &mut buf).unwrap();
            out.extend_from_slice(&buf[..n]);
        }
        let totals: [PcpuTotals; 1] = [enc.totals(0)];
        let n = encode_end(&totals, &mut buf).unwrap();
        out.extend_from_slice(&buf[..n]);
        out
    }

    #[test]
    fn known_counts() {
        let r = build(
            &hvprof_samplelog::decode(&known_capture()),
            &Images::default(),
        );
        assert_eq!(r.total_samples, 100);
        assert!(!r.lost.truncated && r.lost.blocks == 0);
        let host = |f: &str| {
            r.host
                .rows
                .iter()
                .find(|x| x.function == f)
                .map(|x| x.samples)
        };
        assert_eq!(host("[a]"), Some(80));
        assert_eq!(host("[b]"), Some(10));
        assert_eq!(host("[idle]"), Some(2));
        assert_eq!(host("[unknown] 0x1000000"), Some(8));
        assert_eq!(
            (r.host.vm, r.host.hypervisor, r.host.idle),
            (90.0, 8.0, 2.0)
        );
        let a = &r.vms[0];
        assert_eq!((a.name.as_str(), a.table.samples), ("a", 88));
        assert!((a.table.os - 100.0 * 60.0 / 88.0).abs() < 1e-9);
        assert!((a.table.user - 100.0 * 20.0 / 88.0).abs() < 1e-9);
        assert!((a.table.steal - 100.0 * 8.0 / 88.0).abs() < 1e-9);
        let steal = a
            .table
            .rows
            .iter()
            .find(|x| x.function == "[steal]")
            .unwrap();
        assert_eq!(steal.samples, 8);
        // Without symbols, four distinct kernel addresses stay four rows.
        assert_eq!(a.table.rows.len(), 4 + 1 + 1);
        assert_eq!(r.vms[1].table.samples, 10);
        // JSON round trip keeps the numbers.
        let v: serde_json::Value =
            serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(v["vms"][0]["samples"], 88);
        assert_eq!(v["host"]["rows"][0]["function"], "[a]");
    }

    #[test]
    fn parallel_analysis_equals_sequential() {
        let cfg = synth::SynthConfig {
            pcpus: 3,
            samples_per_pcpu: 4000,
            ..synth::SynthConfig::default()
        };
        let cap = synth::capture(&cfg, &synth::CaptureOptions::default());
        let seq = build(&hvprof_samplelog::decode(&cap.bytes), &Images::default());
        for threads in [1, 2, 4] {
            let (d, agg) = analyze(&cap.bytes, threads, false);
            assert_eq!(
                build_from(&d, agg, &Images::default()),
                seq,
                "{threads} threads"
            );
        }
    }

    #[test]
    fn synthetic_trace_totals() {
        let cfg = synth::SynthConfig {
            pcpus: 2,
            samples_per_pcpu: 5000,
            ..synth::SynthConfig::default()
        };
        let cap = synth::capture(&cfg, &synth::CaptureOptions::default());
        let r = build(&hvprof_samplelog::decode(&cap.bytes), &Images::default());
        assert_eq!(r.total_samples, cap.samples);
        let sum: u64 = r.host.rows.iter().map(|x| x.samples).sum();
        assert_eq!(sum, r.total_samples);
    }

    proptest! {
        #[test]
        fn never_panics(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
            let _ = build(&hvprof_samplelog::decode(&bytes), &Images::default());
        }

        #[test]
        fn damaged_known_capture(flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)) {
            let mut bytes = known_capture();
            for (i, v) in flips {
                let at = i.index(bytes.len());
                bytes[at] ^= v | 1;
            }
            let r = build(&hvprof_samplelog::decode(&bytes), &Images::default());
            // Whatever survives is counted, whatever is lost is accounted for.
            prop_assert!(r.total_samples + r.lost.samples <= 100);
        }
    }
}
