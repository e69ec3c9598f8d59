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
//!         "sampling_exits", "sampling_exit_mean", "sampling_exit_percent", // it (crate::model::cost)
//!         "timer_interrupts", "timer_interrupt_mean", "timer_percent",
//!         "other_sample_ticks", "other_sample_percent", "export_ticks", "export_percent",
//!         "task_reads", "task_read_mean" } ],
//!       "vpmu": { "exits", "ticks", "percent" } }, // the guests' virtual PMUs' exits (in "percent")
//!   "host": { "hypervisor": f64, "vm": f64, "idle": f64,          // percentages
//!             "rows": [ { "function", "module", "samples", "percent" } ] },
//!   "vms": [ { "id": u16, "name", "image", "samples": u64,        // guest + steal samples
//!              "os": f64, "user": f64, "idle": f64, "steal": f64, // percentages of "samples"
//!              "rows": [ row ], "vcpus": [ { "vcpu": u16, "samples", "os", "user", "idle",
//!              "steal", "rows": [ row ] } ] } ] },
//!   "warnings": [ string ],    // losses first (one per range, up to 20), integrity, the others
//!   "call_graph": { ... } }    // with --call-graph only: see crate::views::callgraph
//! ```
//! Rows are sorted by samples (descending), then function name, module and process.
//! Percentages are of the table's total; they are not rounded.

use std::borrow::Cow;
use std::hash::BuildHasher;

use rustc_hash::FxHashMap as HashMap;

use serde::Serialize;

use crate::model::capture::Capture;
use crate::model::integrity::Integrity;
use crate::model::losses::{LossRange, Lost};
use crate::model::profile::{LoadOptions, Profile};
use crate::model::progress::Progress;
use crate::model::samples::{Frame, Stack, What, is_guest};
use crate::model::timeline::Blanks;
use crate::naming::namer::{Namer, function_name as name};
use crate::naming::symbols::{Images, Symbols};

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
pub struct Cost {
    pub mean: f64,
    pub min: u64,
    pub max: u64,
    pub percent_of_period: f64,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Host {
    pub hypervisor: f64,
    pub vm: f64,
    pub idle: f64,
    pub rows: Vec<Row>,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct GuestTable {
    pub samples: u64,
    pub os: f64,
    pub user: f64,
    pub idle: f64,
    pub steal: f64,
    pub rows: Vec<Row>,
    /// The same split from the scheduling events (exact TSC time), when the log has them.
    pub exact: Option<Exact>,
    /// Rows left out after `rows` (`LoadOptions::top_rows`: the text report's; the JSON report
    /// has every row).
    #[serde(skip)]
    pub left_out: usize,
    /// Whether any row, kept or left out, names a process (the Process column).
    #[serde(skip)]
    pub processes: bool,
    /// The share of the `[steal] (hypervisor)` row (0 without), kept or left out.
    #[serde(skip)]
    pub steal_hypervisor: f64,
    /// `[steal] (outside)` by who held the pCPU meanwhile: each other VM (its guest, or the
    /// hypervisor handling its exits), then no one (the pCPU idle while this was runnable);
    /// the largest first. Shares of the table's samples, as the row's.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub steal_by: Vec<StealBy>,
}

/// A share of `[steal] (outside)` and who held the pCPU in it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StealBy {
    /// The VM that held it (`None`: no one did).
    pub vm: Option<u16>,
    /// Its name, or "no one".
    pub name: String,
    pub samples: u64,
    pub percent: f64,
    /// The same from the scheduling events, exact: the share of the lifetime (`Exact::ticks`)
    /// its vCPUs were in on the pCPU this one had gone out of. None for "no one" (the events do
    /// not tell the hypervisor's work from idle) and without events.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub events: Option<f64>,
}

/// `[steal] (outside)` of `blanks` (a VM's vCPUs, or one vCPU) by who held the pCPU, as shares
/// of `total` samples (and of the exact lifetime ticks, from the events), named by `name`.
fn steal_by<'a>(
    blanks: impl Iterator<Item = &'a crate::model::timeline::Blanks>,
    vm: u16,
    total: u64,
    name: impl Fn(u16) -> String,
) -> Vec<StealBy> {
    let mut by: HashMap<u16, u64> = HashMap::default();
    let mut ticks_by: HashMap<u16, u64> = HashMap::default();
    let mut outside = 0u64;
    let mut life = 0u64;
    for b in blanks {
        outside += b.steal_outside;
        life += b.ticks_in + b.ticks_out + b.ticks_halted;
        for (&v, &n) in &b.steal_by_vm {
            *by.entry(v).or_default() += n;
        }
        // Its siblings are `[steal] (on vcpuN)`.
        for (&(v, _), &t) in b.ticks_out_by.iter().filter(|((v, _), _)| *v != vm) {
            *ticks_by.entry(v).or_default() += t;
        }
    }
    let held: u64 = by.values().sum();
    let mut vms: Vec<u16> = by.keys().chain(ticks_by.keys()).copied().collect();
    vms.sort_unstable();
    vms.dedup();
    let mut out: Vec<StealBy> = vms
        .into_iter()
        .map(|v| {
            let n = by.get(&v).copied().unwrap_or(0);
            StealBy {
                vm: Some(v),
                name: name(v),
                samples: n,
                percent: percent(n, total),
                events: (life > 0).then(|| percent(ticks_by.get(&v).copied().unwrap_or(0), life)),
            }
        })
        .collect();
    let no_one = outside.saturating_sub(held);
    if no_one > 0 {
        out.push(StealBy {
            vm: None,
            name: "no one".to_owned(),
            samples: no_one,
            percent: percent(no_one, total),
            events: None,
        });
    }
    out.sort_by(|a, b| b.samples.cmp(&a.samples).then(a.vm.cmp(&b.vm)));
    out
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
    /// Pause-loop exits (out events `Yielded`), and the share of the ticks spent spinning
    /// before them: each ended a PAUSE loop of at least the VM's PLE window (with `ple=`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pause_loop_exits: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spinning: Option<f64>,
}

/// A VM's pause-loop exiting (`ple=on|directed`): its controls, and where its vCPUs spun.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PauseLoopReport {
    /// `on` or `directed`.
    pub mode: &'static str,
    /// PLE_Gap and PLE_Window, TSC ticks.
    pub gap: u32,
    pub window: u32,
    pub exits: u64,
    /// The guest RIPs of the exits, named: the most exits first.
    pub sites: Vec<SpinRow>,
    /// Exits at RIPs the hypervisor kept no count of.
    pub others: u64,
}

/// A VM's virtual PMU (`vpmu=cpu|domain`): its accounting mode and what its vCPUs' counters
/// counted, from its end frame.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct VpmuReport {
    /// `cpu` or `domain`.
    pub mode: &'static str,
    pub guest_ticks: u64,
    pub emulated: u64,
    pub hypervisor_ticks: u64,
    pub pmis: u64,
    pub held: u64,
    pub undelivered: u64,
    /// The virtual PMU's own exits and the hypervisor's ticks on them.
    pub exits: u64,
    pub exit_ticks: u64,
}

impl VpmuReport {
    fn of(vm_ends: &[hvprof_samplelog::VmEnd], vm: u16) -> Option<VpmuReport> {
        let p = vm_ends.iter().rev().find(|e| e.vm == vm)?.vpmu?;
        let sum = |f: fn(&hvprof_samplelog::VpmuCounts) -> u64| {
            p.vcpus().iter().map(f).fold(0u64, u64::saturating_add)
        };
        Some(VpmuReport {
            mode: if p.domain { "domain" } else { "cpu" },
            guest_ticks: sum(|c| c.guest_ticks),
            emulated: sum(|c| c.emulated),
            hypervisor_ticks: sum(|c| c.hypervisor_ticks),
            pmis: sum(|c| c.pmis),
            held: sum(|c| c.held),
            undelivered: sum(|c| c.undelivered),
            exits: sum(|c| c.exits),
            exit_ticks: sum(|c| c.exit_ticks),
        })
    }

    /// One line: what the guest's own counters included.
    pub fn describe(&self) -> String {
        let what = if self.mode == "domain" {
            format!(
                "the guest's run ({} ticks) and the hypervisor's work on its exits ({} ticks)",
                self.guest_ticks, self.hypervisor_ticks
            )
        } else {
            format!(
                "the guest's run only ({} ticks; not its steal, not the hypervisor's work)",
                self.guest_ticks
            )
        };
        format!(
            "Virtual PMU (vpmu={}): the guest's counters counted {what}, and {} instructions the hypervisor emulated; {} PMIs delivered, {} held by the rate limit, {} with no taker; its own exits {} ({} ticks)",
            self.mode,
            self.emulated,
            self.pmis,
            self.held,
            self.undelivered,
            self.exits,
            self.exit_ticks
        )
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SpinRow {
    pub vcpu: u16,
    pub rip: u64,
    pub function: String,
    pub module: String,
    pub exits: u64,
}

impl PauseLoopReport {
    /// `Pause-loop exiting (ple=on, window 4096 ticks): 120 exits, at f (vCPU 0) 100, ...`.
    pub fn describe(&self) -> String {
        let mut line = format!(
            "Pause-loop exiting (ple={}, gap {} and window {} ticks): {} exits",
            self.mode, self.gap, self.window, self.exits
        );
        for (i, s) in self.sites.iter().take(4).enumerate() {
            line.push_str(if i == 0 { ", at " } else { ", " });
            line.push_str(&format!("{} (vCPU {}) {}", s.function, s.vcpu, s.exits));
        }
        if self.sites.len() > 4 {
            line.push_str(&format!(", {} more places", self.sites.len() - 4));
        }
        line
    }
}

/// VM `vm`'s pause-loop exiting from its end frame (the last one), its sites named by `namer`.
fn pause_loop_of(
    namer: &Namer,
    vm_ends: &[hvprof_samplelog::VmEnd],
    vm: u16,
) -> Option<PauseLoopReport> {
    let p = vm_ends.iter().rev().find(|e| e.vm == vm)?.pause_loop?;
    let mut sites: Vec<SpinRow> = p
        .sites()
        .iter()
        .map(|s| {
            // A PAUSE loop exits only at CPL 0: a kernel address.
            let (function, module) = namer.guest_function(vm, false, s.rip, 0, None);
            SpinRow {
                vcpu: s.vcpu,
                rip: s.rip,
                function,
                module,
                exits: s.exits,
            }
        })
        .collect();
    sites.sort_by(|a, b| {
        b.exits
            .cmp(&a.exits)
            .then((a.vcpu, a.rip).cmp(&(b.vcpu, b.rip)))
    });
    Some(PauseLoopReport {
        mode: if p.directed { "directed" } else { "on" },
        gap: p.gap,
        window: p.window,
        exits: p.exits(),
        sites,
        others: p.others,
    })
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pause_loop: Option<PauseLoopReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vpmu: Option<VpmuReport>,
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
    pub whole_cost: Option<crate::model::cost::WholeCost>,
    pub host: Host,
    pub vms: Vec<VmReport>,
    /// Warnings for the reader: first where records were lost, then signs of a forged log
    /// (`integrity`), then missing symbols, mismatched build ids, truncation.
    pub warnings: Vec<String>,
    /// The call graph (`report --call-graph`; see `crate::views::callgraph`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub call_graph: Option<crate::views::callgraph::CallGraph>,
    /// Where each vCPU was when it lost its pCPU (`report --preemptions`; see
    /// `crate::views::preemption`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preemptions: Option<Vec<crate::views::preemption::VcpuPreemptions>>,
    /// `--stolen`: who held each vCPU's pCPU in its steal.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stolen: Option<crate::views::stolen::Stolen>,
    /// The stretch of host time shown (`--time START,END`, seconds), when not the whole run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub time: Option<crate::model::window::TimeRange>,
}

/// One table of the report as every renderer shows it (`text.rs`, `html.rs`): which level, its
/// title, the lines above it, its rows. The renderers differ only in markup.
pub struct Section<'a> {
    pub level: Level,
    /// `VM guestOS1 (guestOS1.elf)`, `VM guestOS1 vCPU 1`, `Host level`.
    pub title: String,
    /// `Total samples: N`.
    pub total: String,
    /// `HYPERVISOR:VM:IDLE = ...` or `OS:USER:IDLE:steal = ...`.
    pub split: String,
    /// The exact split from the scheduling events, when the log has them.
    pub exact: Option<String>,
    /// Who held the pCPU in `[steal] (outside)` (`GuestTable::steal_by`), when anyone did.
    pub steal_by: Option<String>,
    /// A VM's pause-loop exiting and where it spun (`VmReport::pause_loop`), when on.
    pub pause_loop: Option<String>,
    /// What a VM's virtual PMU counted (`VmReport::vpmu`), when it has one.
    pub vpmu: Option<String>,
    pub rows: &'a [Row],
    /// Rows left out after `rows` ([`GuestTable::left_out`]).
    pub left_out: usize,
    /// Whether the table has a Process column.
    pub processes: bool,
}

impl Section<'_> {
    /// The rows beyond the first `top`, shown or left out (`None` when there are none).
    pub fn more_rows(&self, top: usize) -> Option<usize> {
        (self.rows.len() + self.left_out)
            .checked_sub(top)
            .filter(|&n| n > 0)
    }
}

/// A section's level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Host,
    Vm,
    Vcpu,
}

impl Report {
    /// The tables in order: the host level (unless `only_vm`), then each VM (or only the one
    /// named `only_vm`) followed by its vCPUs when it has more than one.
    pub fn sections(&self, only_vm: Option<&str>) -> Vec<Section<'_>> {
        let mut out = Vec::new();
        if only_vm.is_none() {
            out.push(Section {
                level: Level::Host,
                title: "Host level".into(),
                total: match &self.time {
                    None => format!("Total samples: {}", self.total_samples),
                    Some(t) => format!(
                        "Total samples: {} (host time {} only: exit statistics and costs are of the whole run)",
                        self.total_samples,
                        t.describe()
                    ),
                },
                split: format!(
                    "HYPERVISOR:VM:IDLE = {:.2}%:{:.2}%:{:.2}%",
                    self.host.hypervisor, self.host.vm, self.host.idle
                ),
                exact: None,
                steal_by: None,
                pause_loop: None,
                vpmu: None,
                rows: &self.host.rows,
                left_out: 0,
                processes: self.host.rows.iter().any(|r| r.process.is_some()),
            });
        }
        for vm in self
            .vms
            .iter()
            .filter(|vm| only_vm.is_none_or(|n| n == vm.name))
        {
            let mut section = vm
                .table
                .section(Level::Vm, format!("VM {} ({})", vm.name, vm.image));
            section.pause_loop = vm.pause_loop.as_ref().map(PauseLoopReport::describe);
            section.vpmu = vm.vpmu.as_ref().map(VpmuReport::describe);
            out.push(section);
            if vm.vcpus.len() > 1 {
                for v in &vm.vcpus {
                    out.push(
                        v.table
                            .section(Level::Vcpu, format!("VM {} vCPU {}", vm.name, v.vcpu)),
                    );
                }
            }
        }
        out
    }
}

impl GuestTable {
    fn section(&self, level: Level, title: String) -> Section<'_> {
        Section {
            level,
            title,
            total: format!("Total samples: {}", self.samples),
            split: format!(
                "OS:USER:IDLE:steal = {:.2}%:{:.2}%:{:.2}%:{:.2}%",
                self.os, self.user, self.idle, self.steal
            ),
            exact: self.exact.as_ref().map(|e| {
                let spinning = match (e.spinning, e.pause_loop_exits) {
                    (Some(s), Some(n)) => {
                        format!("; spinning {s:.2}% ({n} pause-loop exits)")
                    }
                    _ => String::new(),
                };
                format!(
                    "Exact, from the scheduling events: running {:.2}%, idle {:.2}%, steal {:.2}% of {} ticks (samples differ by {:+.2} and {:+.2} points){spinning}",
                    e.running, e.idle, e.steal, e.ticks, e.idle_difference, e.steal_difference
                )
            }),
            steal_by: (!self.steal_by.is_empty()).then(|| {
                let who: Vec<String> = self
                    .steal_by
                    .iter()
                    .map(|b| match b.events {
                        Some(e) => format!("{} {:.2}% (events {e:.2}%)", b.name, b.percent),
                        None => format!("{} {:.2}%", b.name, b.percent),
                    })
                    .collect();
                format!(
                    "[steal] (outside) by who held the pCPU: {} (--stolen: their vCPUs and functions)",
                    who.join(", ")
                )
            }),
            pause_loop: None,
            vpmu: None,
            rows: &self.rows,
            left_out: self.left_out,
            processes: self.processes,
        }
    }
}

/// A table's columns and its first `top` rows as text (names as they are: each renderer
/// escapes them for its medium). The Process column appears when a Linux guest's task frames
/// name processes.
pub fn cells(rows: &[Row], processes: bool, top: usize) -> (Vec<&'static str>, Vec<Vec<String>>) {
    let mut header = vec!["Samples", "%Ratio", "Function", "Module"];
    if processes {
        header.push("Process");
    }
    let body = rows
        .iter()
        .take(top)
        .map(|r| {
            let mut row = vec![
                r.samples.to_string(),
                format!("{:.2}", r.percent),
                r.function.clone(),
                r.module.clone(),
            ];
            if processes {
                row.push(r.process.clone().unwrap_or_default());
            }
            row
        })
        .collect();
    (header, body)
}

/// A guest table row's identity: function, module, process.
type RowKey = (String, String, Option<String>);

/// A row's names, borrowed: function, module, process.
type RowName<'a> = (&'a str, &'a str, Option<&'a str>);

/// The rows the Linux guests' named samples fall in (`keep_guest`): each distinct (function,
/// module, process) of their frames once, numbered, and each frame's number. Made once per
/// report, so that the tables count numbers: a capture without symbols has a row per address
/// and process (over a million), whose names would otherwise be copied and hashed per stack
/// and per table.
struct NamedRows<'a> {
    frames: &'a [Frame],
    namer: &'a Namer<'a>,
    /// Each row's first frame and its names' hash.
    rows: Vec<(u32, u64)>,
    /// The rows by name.
    index: hashbrown::HashTable<u32>,
    /// Per frame, its row ([`NO_ROW`]: not a Linux guest's frame).
    of_frame: Vec<u32>,
}

const NO_ROW: u32 = u32::MAX;

/// A frame's row names: function, module, process label.
fn frame_row_name<'a>(frames: &'a [Frame], namer: &'a Namer<'a>, frame: u32) -> RowName<'a> {
    let f = &frames[frame as usize];
    (
        f.function.as_str(),
        f.module.as_str(),
        f.process_key.and_then(|p| namer.task_label(p)),
    )
}

fn row_hash(name: &RowName<'_>) -> u64 {
    rustc_hash::FxBuildHasher.hash_one(name)
}

impl<'a> NamedRows<'a> {
    /// The rows of the frames of `stacks` that `named` says are named by process.
    fn new(
        stacks: &[Stack],
        frames: &'a [Frame],
        namer: &'a Namer<'a>,
        named: impl Fn(&Stack) -> bool,
    ) -> NamedRows<'a> {
        let name_of = |f: u32| frame_row_name(frames, namer, f);
        // The frames to number, each once, in the order first met.
        let mut of_frame = vec![NO_ROW; frames.len()];
        let mut wanted: Vec<u32> = Vec::new();
        for s in stacks.iter().filter(|s| s.count > 0 && named(s)) {
            if of_frame[s.frame as usize] == NO_ROW {
                of_frame[s.frame as usize] = 0;
                wanted.push(s.frame);
            }
        }
        // Their names hashed on every core, then numbered on one (hashing no string).
        let hashes: Vec<u64> =
            crate::model::par::par_map(wanted.chunks(4096).collect(), |c: &[u32]| {
                c.iter().map(|&f| row_hash(&name_of(f))).collect::<Vec<_>>()
            })
            .into_iter()
            .flatten()
            .collect();
        let mut rows: Vec<(u32, u64)> = Vec::with_capacity(wanted.len());
        let mut index = hashbrown::HashTable::with_capacity(wanted.len());
        for (&f, hash) in wanted.iter().zip(hashes) {
            let name = name_of(f);
            let same = |&r: &u32| name_of(rows[r as usize].0) == name;
            let rehash = |&r: &u32| rows[r as usize].1;
            of_frame[f as usize] = match index.entry(hash, same, rehash) {
                hashbrown::hash_table::Entry::Occupied(e) => *e.get(),
                hashbrown::hash_table::Entry::Vacant(e) => {
                    let row = rows.len() as u32;
                    e.insert(row);
                    rows.push((f, hash));
                    row
                }
            };
        }
        NamedRows {
            frames,
            namer,
            rows,
            index,
            of_frame,
        }
    }

    /// A row's names.
    fn name(&self, row: u32) -> RowName<'a> {
        frame_row_name(self.frames, self.namer, self.rows[row as usize].0)
    }

    /// The row named `name`, if any.
    fn find(&self, name: &RowName<'_>) -> Option<u32> {
        self.index
            .find(row_hash(name), |&r| self.name(r) == *name)
            .copied()
    }
}

/// Guest-level counts of one VM or vCPU, before naming.
#[derive(Default)]
struct GuestCounts {
    /// Guest address → samples (user and kernel alike: the table names an address once).
    by_rip: HashMap<u64, u64>,
    /// Samples already named (Linux guests): their row in [`NamedRows`] → samples.
    named: HashMap<u32, u64>,
    os: u64,
    user: u64,
    /// `[steal]` slots by their module label: `(outside)`, `(on vcpuN)`, `(hypervisor)`.
    steal: HashMap<String, u64>,
    idle: u64,
}

impl GuestCounts {
    fn add_guest(&mut self, rip: u64, user: bool, n: u64) {
        *self.by_rip.entry(rip).or_default() += n;
        if user {
            self.user += n;
        } else {
            self.os += n;
        }
    }

    fn add_named(&mut self, row: u32, user: bool, n: u64) {
        *self.named.entry(row).or_default() += n;
        if user {
            self.user += n;
        } else {
            self.os += n;
        }
    }

    fn steal_total(&self) -> u64 {
        self.steal.values().sum()
    }

    /// The table: every row, or with `keep` the first `keep` (the others counted). `rows`
    /// names the rows of [`GuestCounts::named`].
    fn table(
        &self,
        symbols: Option<&Symbols>,
        module: &str,
        keep: Option<usize>,
        rows: &NamedRows<'_>,
    ) -> GuestTable {
        let steal = self.steal_total();
        let total = self.os + self.user + steal + self.idle;
        let pct = |n: u64| percent(n, total);
        // Name each distinct address once, then merge by function; an address without a
        // function is a row of its own (merged by address only: no string to hash).
        let mut by_fn: HashMap<RowName<'_>, u64> = HashMap::default();
        let mut unnamed: Vec<(u64, u64)> = Vec::new();
        for (&rip, &n) in &self.by_rip {
            match symbols.and_then(|s| s.lookup(rip)) {
                Some(f) => *by_fn.entry((f, module, None)).or_default() += n,
                None => unnamed.push((rip, n)),
            }
        }
        for (label, &n) in &self.steal {
            if n > 0 {
                by_fn.insert(("[steal]", label.as_str(), None), n);
            }
        }
        if self.idle > 0 {
            by_fn.insert(("[idle]", "(halted)", None), self.idle);
        }
        // The numbered rows, in number order; a row named by function above too (never, but
        // for a function that names itself like them) counted once, in its numbered row.
        let mut ids: Vec<(u32, u64)> = self.named.iter().map(|(&r, &n)| (r, n)).collect();
        ids.sort_unstable();
        if !ids.is_empty() {
            by_fn.retain(|name, n| {
                let Some(at) = rows
                    .find(name)
                    .and_then(|r| ids.binary_search_by_key(&r, |&(id, _)| id).ok())
                else {
                    return true;
                };
                ids[at].1 += *n;
                false
            });
        }
        let pending = PendingRows {
            named: named_rows(by_fn),
            ids,
            names: Some(rows),
            unnamed,
            module,
        };
        let (rows, left_out, processes) = pending.made(total, keep);
        GuestTable {
            samples: total,
            os: pct(self.os),
            user: pct(self.user),
            idle: pct(self.idle),
            steal: pct(steal),
            rows,
            exact: None,
            left_out,
            processes,
            steal_hypervisor: self.steal.get(HYPERVISOR_STEAL).map_or(0.0, |&n| pct(n)),
            steal_by: Vec::new(),
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

/// A table's row before it is made (see [`PendingRows::made`]): its names, borrowed where they
/// can be, and its samples.
struct RowRef<'a> {
    function: Cow<'a, str>,
    module: Cow<'a, str>,
    process: Option<Cow<'a, str>>,
    samples: u64,
}

/// A table's rows, one per key (its names owned or borrowed), with no shares yet (see
/// [`PendingRows::made`]).
fn named_rows<'a, S: Into<Cow<'a, str>>>(
    counts: impl IntoIterator<Item = ((S, S, Option<S>), u64)>,
) -> Vec<RowRef<'a>> {
    counts
        .into_iter()
        .map(|((function, module, process), samples)| RowRef {
            function: function.into(),
            module: module.into(),
            process: process.map(Into::into),
            samples,
        })
        .collect()
}

/// The module of a guest table's `[steal]` row for the hypervisor's work on the vCPU's behalf.
const HYPERVISOR_STEAL: &str = "(hypervisor)";

/// A table's rows before they are made: the named ones, then (Linux guests' tables) those
/// named by number in `names`, then (guest tables) the addresses without a function
/// (`[unknown] 0x…` in `module`, named only if kept).
struct PendingRows<'a> {
    named: Vec<RowRef<'a>>,
    ids: Vec<(u32, u64)>,
    names: Option<&'a NamedRows<'a>>,
    unnamed: Vec<(u64, u64)>,
    module: &'a str,
}

/// Where a row of [`PendingRows`] is.
enum RowAt {
    Named(usize),
    Id(usize),
    Unnamed(usize),
}

impl RowAt {
    /// Row `i` after `named` rows by name and `ids` by number.
    fn of(i: usize, named: usize, ids: usize) -> RowAt {
        match i.checked_sub(named) {
            None => RowAt::Named(i),
            Some(j) => match j.checked_sub(ids) {
                None => RowAt::Id(j),
                Some(k) => RowAt::Unnamed(k),
            },
        }
    }
}

impl PendingRows<'_> {
    /// The rows, named and not.
    fn count(&self) -> usize {
        self.named.len() + self.ids.len() + self.unnamed.len()
    }
    fn at(&self, i: usize) -> RowAt {
        RowAt::of(i, self.named.len(), self.ids.len())
    }
    /// Row `i`'s samples.
    fn samples(&self, i: usize) -> u64 {
        match self.at(i) {
            RowAt::Named(j) => self.named[j].samples,
            RowAt::Id(j) => self.ids[j].1,
            RowAt::Unnamed(j) => self.unnamed[j].1,
        }
    }
    /// The names of row `id` of `names` (there are rows by number only with `names`).
    fn id_name(&self, id: u32) -> RowName<'_> {
        self.names.map_or(("", "", None), |n| n.name(id))
    }
    /// Row `i`'s module and process.
    fn module_process(&self, i: usize) -> (&str, Option<&str>) {
        match self.at(i) {
            RowAt::Named(j) => (&self.named[j].module, self.named[j].process.as_deref()),
            RowAt::Id(j) => {
                let (_, module, process) = self.id_name(self.ids[j].0);
                (module, process)
            }
            RowAt::Unnamed(_) => (self.module, None),
        }
    }
    /// Row `i`'s function name (in `buf` when it is made on the fly).
    fn function<'b>(&'b self, i: usize, buf: &'b mut [u8; 28]) -> &'b [u8] {
        match self.at(i) {
            RowAt::Named(j) => self.named[j].function.as_bytes(),
            RowAt::Id(j) => self.id_name(self.ids[j].0).0.as_bytes(),
            RowAt::Unnamed(j) => {
                let (b, n) = crate::naming::namer::unknown_bytes(self.unnamed[j].0);
                *buf = b;
                &buf[..n]
            }
        }
    }
}

/// The order of a table's rows: by samples (most first), then function, module and process,
/// keeping the order of rows equal in all (a stable sort by those); with `keep`, only the
/// first `keep` rows (a selection, then a sort of those). A table has a row per distinct address of a capture
/// without symbols (hundreds of thousands, most with a few samples, so that ties on the
/// samples are the rule): each row's sort key is its samples, the first 32 bytes of its
/// function as two integers (which order as the strings do: zero-padded big-endian bytes) and
/// its place, so that the sort compares integers and moves small keys, and reads a function
/// whole only when the first 32 bytes are equal.
fn row_order(rows: &PendingRows<'_>, keep: Option<usize>) -> Vec<u32> {
    /// Bytes `from..from + 16` of `s`, zero-padded, big-endian.
    fn word(s: &[u8], from: usize) -> u128 {
        let mut b = [0u8; 16];
        if let Some(tail) = s.get(from..) {
            let n = tail.len().min(16);
            b[..n].copy_from_slice(&tail[..n]);
        }
        u128::from_be_bytes(b)
    }
    // With `keep`, only the rows with at least the `keep`-th most samples can be among the
    // first `keep` (those with more all are; those with as many are chosen by name): only
    // theirs are keyed and named.
    let candidates: Vec<usize> = match keep {
        Some(0) => return Vec::new(),
        Some(k) if k < rows.count() => {
            let mut samples: Vec<u64> = (0..rows.count()).map(|i| rows.samples(i)).collect();
            let (_, &mut least, _) = samples.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
            (0..rows.count())
                .filter(|&i| rows.samples(i) >= least)
                .collect()
        }
        _ => (0..rows.count()).collect(),
    };
    let mut buf = [0u8; 28];
    let mut keys: Vec<(u64, u128, u128, u32)> = candidates
        .into_iter()
        .map(|i| {
            let f = rows.function(i, &mut buf);
            (rows.samples(i), word(f, 0), word(f, 16), i as u32)
        })
        .collect();
    let cmp = |a: &(u64, u128, u128, u32), b: &(u64, u128, u128, u32)| {
        b.0.cmp(&a.0)
            .then(a.1.cmp(&b.1))
            .then(a.2.cmp(&b.2))
            .then_with(|| {
                let (mut ba, mut bb) = ([0u8; 28], [0u8; 28]);
                let fa = rows.function(a.3 as usize, &mut ba);
                let fb = rows.function(b.3 as usize, &mut bb);
                if fa.len() <= 32 && fb.len() <= 32 {
                    // Equal padded bytes and both within them: equal, unless one ends in
                    // zero bytes the other lacks.
                    fa.len().cmp(&fb.len())
                } else {
                    fa.cmp(fb)
                }
            })
            .then_with(|| {
                rows.module_process(a.3 as usize)
                    .cmp(&rows.module_process(b.3 as usize))
            })
            .then(a.3.cmp(&b.3))
    };
    match keep {
        Some(k) if k < keys.len() => {
            // The keys are distinct (their places are): the first `k` are those of a sort.
            keys.select_nth_unstable_by(k, cmp);
            keys.truncate(k);
            keys.sort_unstable_by(cmp);
        }
        _ => keys.sort_unstable_by(cmp),
    }
    keys.into_iter().map(|(.., i)| i).collect()
}

impl PendingRows<'_> {
    /// The rows in order, each with its share of `total`; with `keep` only the first `keep`.
    /// Also: how many were left out, and whether any row names a process (the Process
    /// column's).
    fn made(mut self, total: u64, keep: Option<usize>) -> (Vec<Row>, usize, bool) {
        let order = row_order(&self, keep);
        let left_out = self.count() - order.len();
        let processes = self.named.iter().any(|r| r.process.is_some())
            || self.ids.iter().any(|&(id, _)| self.id_name(id).2.is_some());
        let (first, ids) = (self.named.len(), self.ids.len());
        let mut named: Vec<Option<RowRef<'_>>> = std::mem::take(&mut self.named)
            .into_iter()
            .map(Some)
            .collect();
        let rows = order
            .into_iter()
            .filter_map(|i| {
                let row = match RowAt::of(i as usize, first, ids) {
                    RowAt::Named(j) => {
                        let r = named[j].take()?;
                        Row {
                            function: r.function.into_owned(),
                            module: r.module.into_owned(),
                            process: r.process.map(Cow::into_owned),
                            samples: r.samples,
                            percent: 0.0,
                        }
                    }
                    RowAt::Id(j) => {
                        let (id, samples) = self.ids[j];
                        let (function, module, process) = self.id_name(id);
                        Row {
                            function: function.to_owned(),
                            module: module.to_owned(),
                            process: process.map(str::to_owned),
                            samples,
                            percent: 0.0,
                        }
                    }
                    RowAt::Unnamed(j) => {
                        let (rip, samples) = self.unnamed[j];
                        Row {
                            function: name(None, rip),
                            module: self.module.to_owned(),
                            process: None,
                            samples,
                            percent: 0.0,
                        }
                    }
                };
                Some(Row {
                    percent: percent(row.samples, total),
                    ..row
                })
            })
            .collect();
        (rows, left_out, processes)
    }
}

/// The exact split of the vCPUs' lifetimes from their scheduling events, beside `table`.
/// With `window` (the VM's PLE window, with `ple=`), the pause-loop exits and the spinning.
fn exact_of<'a>(
    table: &GuestTable,
    blanks: impl Iterator<Item = &'a crate::model::timeline::Blanks>,
    window: Option<u32>,
) -> Option<Exact> {
    let (mut run, mut out, mut halted) = (0u64, 0u64, 0u64);
    let mut hypervisor_out = 0u64;
    let mut yields = 0u64;
    let mut any = false;
    for b in blanks {
        any = true;
        hypervisor_out += b.hypervisor_out;
        run += b.ticks_in;
        out += b.ticks_out;
        halted += b.ticks_halted;
        yields += b.yields;
    }
    let ticks = run + out + halted;
    if !any || ticks == 0 {
        return None;
    }
    let pct = |n: u64| 100.0 * n as f64 / ticks as f64;
    // The events time the vCPU's absence (preempted); the hypervisor's work while it was in is
    // steal for the samples but running for the events: compare like with like (its work while
    // the vCPU was out is absence for both).
    let hypervisor = table.steal_hypervisor - percent(hypervisor_out, table.samples);
    Some(Exact {
        ticks,
        running: pct(run),
        idle: pct(halted),
        steal: pct(out),
        idle_difference: table.idle - pct(halted),
        steal_difference: table.steal - hypervisor - pct(out),
        pause_loop_exits: window.map(|_| yields),
        spinning: window.map(|w| pct(yields.saturating_mul(u64::from(w)))),
    })
}

/// Builds the report from a capture's profile and the namer that named it: the host level,
/// each VM's and vCPU's guest level with the exact split from the scheduling events (with
/// `options.tables`), and what the profile found (losses, integrity, warnings). The namer names
/// what the profile left unnamed (`LoadOptions::report_only`); `options.keep_guest` names Linux
/// guests' samples by process; `options.top_rows` keeps only the first rows of each guest table
/// (the others counted).
pub fn build(p: &Profile, namer: &Namer, options: LoadOptions) -> Report {
    let samples = &p.samples;
    let total = samples.len() as u64;
    let (host, vms) = if options.tables {
        let mut guests = guest_counts(samples.stacks(), &p.frames, namer, options.keep_guest);
        let none = HashMap::default();
        let exact = p.blanks.as_ref().unwrap_or(&none);
        add_blanks(p.blanks.as_ref(), &mut guests);
        let host = host_level(samples.stacks(), &p.frames, namer, &guests.per_vm, total);
        (
            host,
            guest_level(namer, guests, exact, &p.vm_ends, options.top_rows),
        )
    } else {
        (Host::default(), Vec::new())
    };
    let cost = p.cost;
    let mean = if total == 0 {
        0.0
    } else {
        cost.sum as f64 / total as f64
    };
    Report {
        total_samples: total,
        events: p.events.len() as u64,
        period_ticks: p.period_ticks,
        tsc_hz: p.tsc_hz,
        pcpus: p.pcpus,
        source: p.source,
        hypervisor_build_id: p.hypervisor_build_id.clone(),
        hypervisor_build_id_matches: p.hypervisor_build_id_matches,
        lost: p.lost.clone(),
        losses: p.losses.clone(),
        integrity: p.integrity.clone(),
        cost: Cost {
            mean,
            min: if total == 0 { 0 } else { cost.min },
            max: cost.max,
            percent_of_period: if p.period_ticks == 0 {
                0.0
            } else {
                100.0 * mean / p.period_ticks as f64
            },
        },
        whole_cost: p.whole_cost.clone(),
        host,
        vms,
        warnings: p.warnings.clone(),
        call_graph: None,
        preemptions: None,
        stolen: None,
        time: p.time,
    }
}

/// A capture read into its profile ([`Profile::from_capture_with_namer`]) and its report
/// built.
pub fn from_capture(
    bytes: Capture,
    images: &Images,
    options: LoadOptions,
    progress: &Progress,
) -> (Profile, Report) {
    let (p, namer) = Profile::from_capture_with_namer(bytes, images, options, progress);
    progress.phase("report", None, "stacks");
    let r = build(&p, &namer, options);
    (p, r)
}

/// [`from_capture`] of a copy of `bytes`.
pub fn from_bytes(
    bytes: &[u8],
    images: &Images,
    options: LoadOptions,
    progress: &Progress,
) -> (Profile, Report) {
    from_capture(bytes.to_vec().into(), images, options, progress)
}

/// A capture file read into its profile ([`Profile::load_with_namer`]: the same errors) and
/// its report built.
pub fn load(
    path: &std::path::Path,
    images: &Images,
    options: LoadOptions,
    progress: &Progress,
) -> anyhow::Result<(Profile, Report)> {
    let (p, namer) = Profile::load_with_namer(path, images, options, progress)?;
    progress.phase("report", None, "stacks");
    let r = build(&p, &namer, options);
    Ok((p, r))
}

/// Guest-level counts per VM and per vCPU, and the hypervisor's samples on each vCPU's behalf.
struct Guests<'a> {
    per_vm: HashMap<u16, GuestCounts>,
    per_vcpu: HashMap<(u16, u16), GuestCounts>,
    /// (vm, vcpu) → hypervisor samples taken on that vCPU's behalf.
    hypervisor: HashMap<(u16, u16), u64>,
    /// The rows of the counts' `named` samples.
    rows: NamedRows<'a>,
}

/// Counts the guest samples of each VM and vCPU: by address, or for Linux guests with
/// `keep_guest` by (function, module, process) as their frames name them (kernel functions
/// under `[guest.kallsyms]` after the VM's KASLR slide, user functions from the image named
/// like the process).
fn guest_counts<'a>(
    stacks: &[Stack],
    frames: &'a [Frame],
    namer: &'a Namer,
    keep_guest: bool,
) -> Guests<'a> {
    let named = |s: &Stack| keep_guest && is_guest(s.what) && namer.is_linux(s.vm);
    let rows = NamedRows::new(stacks, frames, namer, named);
    // The VMs' tables and the vCPUs' made at once: each holds up to every guest address of its
    // VM (hundreds of thousands, a million with Linux guests' tasks).
    let (per_vm, per_vcpu) = std::thread::scope(|sc| {
        let per_vm = sc.spawn(|| counts_by(stacks, &rows, named, |s| s.vm));
        let per_vcpu = counts_by(stacks, &rows, named, |s| (s.vm, s.vcpu));
        let per_vm = per_vm
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e));
        (per_vm, per_vcpu)
    });
    // Time the hypervisor spent on a VM's behalf is that VM's steal.
    let mut hypervisor: HashMap<(u16, u16), u64> = HashMap::default();
    for s in stacks
        .iter()
        .filter(|s| s.count > 0 && s.what == What::Hypervisor && s.vm != hvprof_samplelog::NO_VM)
    {
        *hypervisor.entry((s.vm, s.vcpu)).or_default() += s.count;
    }
    Guests {
        per_vm,
        per_vcpu,
        hypervisor,
        rows,
    }
}

/// The guest samples counted per `key` (a VM, or a vCPU), as [`guest_counts`] says: those
/// `named` by their row in `rows`, the others by address.
fn counts_by<K: std::hash::Hash + Eq>(
    stacks: &[Stack],
    rows: &NamedRows<'_>,
    named: impl Fn(&Stack) -> bool,
    key: impl Fn(&Stack) -> K,
) -> HashMap<K, GuestCounts> {
    let mut out: HashMap<K, GuestCounts> = HashMap::default();
    for s in stacks.iter().filter(|s| s.count > 0) {
        let user = match s.what {
            What::GuestKernel => false,
            What::GuestUser => true,
            What::Hypervisor | What::Idle => continue,
        };
        let counts = out.entry(key(s)).or_default();
        if named(s) {
            counts.add_named(rows.of_frame[s.frame as usize], user, s.count);
        } else {
            counts.add_guest(s.addr, user, s.count);
        }
    }
    out
}

/// Adds each vCPU's blank slots (`[idle]`, `[steal]`) on the common time axis, counted from
/// the scheduling events (`timeline::segment_blanks`).
/// Without events (`None`: an old or partial log) the hypervisor's samples on a vCPU's behalf
/// are all that can be called its steal.
fn add_blanks(blanks: Option<&HashMap<(u16, u16), Blanks>>, g: &mut Guests) {
    let Some(exact) = blanks else {
        for (&(vm, vcpu), &n) in &g.hypervisor {
            for counts in [
                g.per_vm.entry(vm).or_default(),
                g.per_vcpu.entry((vm, vcpu)).or_default(),
            ] {
                *counts.steal.entry(HYPERVISOR_STEAL.into()).or_default() += n;
            }
        }
        return;
    };
    for (&(vm, vcpu), b) in exact {
        let add = |g: &mut GuestCounts| {
            g.idle += b.idle;
            if b.steal_outside > 0 {
                *g.steal.entry("(outside)".into()).or_default() += b.steal_outside;
            }
            if b.hypervisor + b.hypervisor_out > 0 {
                *g.steal.entry(HYPERVISOR_STEAL.into()).or_default() +=
                    b.hypervisor + b.hypervisor_out;
            }
            for (&other, &n) in &b.steal_on {
                *g.steal.entry(format!("(on vcpu{other})")).or_default() += n;
            }
            if b.steal_on_others > 0 {
                *g.steal.entry("(on other vcpus)".into()).or_default() += b.steal_on_others;
            }
        };
        add(g.per_vm.entry(vm).or_default());
        add(g.per_vcpu.entry((vm, vcpu)).or_default());
    }
}

/// The host level: each VM as one row, the hypervisor's functions, `[idle]`.
fn host_level(
    stacks: &[Stack],
    frames: &[Frame],
    namer: &Namer,
    per_vm: &HashMap<u16, GuestCounts>,
    total: u64,
) -> Host {
    let pct = |n: u64| percent(n, total);
    let mut host_counts: HashMap<RowKey, u64> = HashMap::default();
    let mut vm_samples = 0u64;
    for (&vm, c) in per_vm {
        let n = c.os + c.user;
        if n == 0 {
            continue;
        }
        vm_samples += n;
        host_counts.insert(
            (
                format!("[{}]", namer.vm_name(vm)),
                format!("(vm {vm})"),
                None,
            ),
            n,
        );
    }
    let (mut hv_samples, mut idle) = (0u64, 0u64);
    for s in stacks.iter().filter(|s| s.count > 0) {
        match s.what {
            What::Hypervisor => {
                hv_samples += s.count;
                let function = frames[s.frame as usize].function.clone();
                *host_counts
                    .entry((function, "hvprof".into(), None))
                    .or_default() += s.count;
            }
            What::Idle => idle += s.count,
            What::GuestKernel | What::GuestUser => {}
        }
    }
    if idle > 0 {
        host_counts.insert(("[idle]".into(), "(idle)".into(), None), idle);
    }
    Host {
        hypervisor: pct(hv_samples),
        vm: pct(vm_samples),
        idle: pct(idle),
        rows: PendingRows {
            named: named_rows(host_counts),
            ids: Vec::new(),
            names: None,
            unnamed: Vec::new(),
            module: "",
        }
        .made(total, None)
        .0,
    }
}

/// The guest level: per VM of the header, its table and its vCPUs' (with the exact split from
/// the events), then the VMs the header does not list (a damaged or missing header).
fn guest_level(
    namer: &Namer,
    mut g: Guests,
    exact: &HashMap<(u16, u16), crate::model::timeline::Blanks>,
    vm_ends: &[hvprof_samplelog::VmEnd],
    keep: Option<usize>,
) -> Vec<VmReport> {
    // Each VM's counts, and its vCPUs' (sorted), then every table made on every core.
    let per_vm: Vec<GuestCounts> = namer
        .vms
        .iter()
        .map(|v| g.per_vm.remove(&v.id).unwrap_or_default())
        .collect();
    let vcpus_of: Vec<Vec<(u16, &GuestCounts)>> = namer
        .vms
        .iter()
        .map(|v| {
            let mut vcpus: Vec<(u16, &GuestCounts)> = g
                .per_vcpu
                .iter()
                .filter(|((vm, _), _)| *vm == v.id)
                .map(|(&(_, vcpu), c)| (vcpu, c))
                .collect();
            vcpus.sort_by_key(|&(vcpu, _)| vcpu);
            vcpus
        })
        .collect();
    let jobs: Vec<(&GuestCounts, Option<&Symbols>, &str)> = namer
        .vms
        .iter()
        .enumerate()
        .flat_map(|(i, v)| {
            let symbols = namer.guest_symbols(v.id);
            std::iter::once((&per_vm[i], symbols, v.image.as_str())).chain(
                vcpus_of[i]
                    .iter()
                    .map(move |&(_, c)| (c, symbols, v.image.as_str())),
            )
        })
        .collect();
    let mut tables = crate::model::par::par_map(jobs, |(c, symbols, image)| {
        c.table(symbols, image, keep, &g.rows)
    })
    .into_iter();
    let mut vms: Vec<VmReport> = Vec::with_capacity(namer.vms.len());
    for (i, v) in namer.vms.iter().enumerate() {
        let (Some(mut table), vcpu_tables) = (
            tables.next(),
            tables.by_ref().take(vcpus_of[i].len()).collect::<Vec<_>>(),
        ) else {
            break;
        };
        let culprit = |vm: u16| {
            if vm == v.id {
                // Its own vCPU's samples after its out event: the hypervisor finishing with it.
                "the hypervisor (finishing its exit)".to_owned()
            } else {
                namer.vm_name(vm)
            }
        };
        let pause_loop = pause_loop_of(namer, vm_ends, v.id);
        let window = pause_loop.as_ref().map(|p| p.window);
        let vcpus = vcpus_of[i]
            .iter()
            .zip(vcpu_tables)
            .map(|(&(vcpu, _), mut table)| {
                table.exact = exact_of(&table, exact.get(&(v.id, vcpu)).into_iter(), window);
                table.steal_by = steal_by(
                    exact.get(&(v.id, vcpu)).into_iter(),
                    v.id,
                    table.samples,
                    culprit,
                );
                VcpuReport { vcpu, table }
            })
            .collect();
        let of_vm = || {
            exact
                .iter()
                .filter(|((vm, _), _)| *vm == v.id)
                .map(|(_, b)| b)
        };
        table.exact = exact_of(&table, of_vm(), window);
        table.steal_by = steal_by(of_vm(), v.id, table.samples, culprit);
        vms.push(VmReport {
            id: v.id,
            name: v.name.clone(),
            image: v.image.clone(),
            table,
            vcpus,
            pause_loop,
            vpmu: VpmuReport::of(vm_ends, v.id),
        });
    }
    let mut unknown: Vec<u16> = g.per_vm.keys().copied().collect();
    unknown.sort_unstable();
    for id in unknown {
        vms.push(VmReport {
            id,
            name: format!("vm{id}"),
            image: String::new(),
            table: g.per_vm[&id].table(None, "?", keep, &g.rows),
            vcpus: Vec::new(),
            pause_loop: None,
            vpmu: None,
        });
    }
    vms
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvprof_samplelog::synth;

    use hvprof_samplelog::{
        BlockEncoder, BuildId, FixedStr, Header, MAX_HEADER_FRAME_LEN, PcpuTotals, Record, Sample,
        SampleKind, VmInfo, encode_end, encode_header, max_block_frame_len, max_end_frame_len,
    };
    use proptest::prelude::*;

    /// Rows as [`PendingRows`] takes them.
    fn refs(rows: Vec<Row>) -> Vec<RowRef<'static>> {
        rows.into_iter()
            .map(|r| RowRef {
                function: r.function.into(),
                module: r.module.into(),
                process: r.process.map(Cow::from),
                samples: r.samples,
            })
            .collect()
    }

    /// A table's rows are in the order a stable sort by (samples descending, function, module,
    /// process) gives: functions that tie within their first 32 bytes, that are prefixes of one
    /// another, that hold zero bytes, and rows equal in all (kept in their order).
    #[test]
    fn rows_sort_as_a_stable_sort_by_samples_then_names() {
        let names = [
            "[unknown] 0xffffffff81234567",
            "[unknown] 0xffffffff8123456",
            "[unknown] 0xffffffff812345670000",
            "[unknown] 0xffffffff812345670001",
            "a_function_name_longer_than_thirty_two_bytes_x",
            "a_function_name_longer_than_thirty_two_bytes_y",
            "a_function_name_longer_than_thirty_two_bytes",
            "ab",
            "ab\0",
            "ab\0\0",
            "",
            "[steal]",
            "[idle]",
        ];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut rows = Vec::new();
        for i in 0..5000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            rows.push(Row {
                function: names[(x % names.len() as u64) as usize].to_owned(),
                module: (i % 7).to_string(),
                process: (i % 3 > 0).then(|| format!("p{}", i % 5)),
                samples: (x >> 20) % 4,
                percent: 0.0,
            });
        }
        let mut want = rows.clone();
        want.sort_by(|a, b| {
            b.samples
                .cmp(&a.samples)
                .then_with(|| a.function.cmp(&b.function))
                .then_with(|| a.module.cmp(&b.module))
                .then_with(|| a.process.cmp(&b.process))
        });
        let rows = PendingRows {
            named: refs(rows),
            ids: Vec::new(),
            names: None,
            unnamed: Vec::new(),
            module: "",
        }
        .made(0, None)
        .0;
        assert_eq!(rows, want);
    }

    /// A table made with only its first `keep` rows has the first `keep` rows of the whole
    /// table, with the names, shares and module the whole one gives them; the others are
    /// counted; a named row's process shows even when it is left out.
    #[test]
    fn a_table_cut_to_its_first_rows_is_the_whole_tables_start() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let names = [
            "[steal]",
            "[idle]",
            "main",
            "a_function_name_longer_than_thirty_two_bytes",
        ];
        for round in 0..40 {
            let named: Vec<Row> = (0..next() % 6)
                .map(|i| Row {
                    function: names[(next() % 4) as usize].to_owned(),
                    module: format!("m{i}"),
                    process: (round % 3 == 0 && i == 0).then(|| "w41[57]".to_owned()),
                    samples: next() % 5,
                    percent: 0.0,
                })
                .collect();
            // Addresses of 1 to 16 hex digits, many with equal samples.
            let unnamed: Vec<(u64, u64)> = (0..next() % 300)
                .map(|_| (next() >> (next() % 64), next() % 4))
                .collect();
            let pending = |named: &Vec<Row>| PendingRows {
                named: refs(named.clone()),
                ids: Vec::new(),
                names: None,
                unnamed: unnamed.clone(),
                module: "bzImage",
            };
            let (all, none_left, processes) = pending(&named).made(1000, None);
            assert_eq!(none_left, 0);
            assert_eq!(processes, named.iter().any(|r| r.process.is_some()));
            for keep in [0, 1, 3, 10, 1000] {
                let (first, left_out, p) = pending(&named).made(1000, Some(keep));
                assert_eq!(&first[..], &all[..keep.min(all.len())], "keep {keep}");
                assert_eq!(left_out, all.len() - first.len());
                assert_eq!(p, processes);
            }
        }
    }

    /// A Linux guest's table counts its samples by (function, module, process) whatever
    /// frames they come from: frames equal but for the kind of sample, processes with one
    /// label (threads of one program), address spaces without a task (no label), and a frame
    /// that names itself like the `[steal]` row all fall in one row each, whose samples are
    /// the sum of theirs; every other row is a frame's.
    #[test]
    fn named_rows_are_counted_by_name_whatever_their_frames() {
        use crate::naming::namer::ProcessKey;
        use hvprof_samplelog::{FixedStr, Task};
        let task = |pid, tgid, comm: &str| Task {
            tsc: 0,
            pid,
            tgid,
            comm: FixedStr::truncated(comm),
            ..Task::default()
        };
        let decoded = hvprof_samplelog::Decoded {
            tasks: vec![
                task(80, 80, "job"),
                task(81, 80, "job"),
                task(90, 90, "other"),
            ],
            ..Default::default()
        };
        let images = Images::default();
        let mut warnings = Vec::new();
        let namer = Namer::new(&decoded, &images, &mut warnings);
        assert!(namer.is_linux(0));
        let keys = [
            Some(ProcessKey::Task(0)),
            Some(ProcessKey::Task(1)),
            Some(ProcessKey::Task(2)),
            Some(ProcessKey::Cr3(0x1000)),
            Some(ProcessKey::Cr3(0x2000)),
            None,
        ];
        let mut frames = Vec::new();
        for what in [What::GuestUser, What::GuestKernel] {
            for function in ["f", "g", "[steal]"] {
                for module in ["m", "(outside)"] {
                    for process_key in keys {
                        frames.push(Frame {
                            what,
                            vm: "vm".into(),
                            process: format!("{process_key:?}"),
                            module: module.into(),
                            function: function.into(),
                            process_key,
                        });
                    }
                }
            }
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let stacks: Vec<Stack> = (0..400)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let frame = (x % frames.len() as u64) as u32;
                let f = &frames[frame as usize];
                Stack {
                    what: f.what,
                    pcpu: 0,
                    vm: 0,
                    vcpu: (i % 2) as u16,
                    exit: 0,
                    addr: x >> 40,
                    cr3: 0,
                    process: f.process_key,
                    frame,
                    exit_cause: false,
                    chain: 0,
                    calls: 0,
                    count: (x >> 8) % 5,
                }
            })
            .collect();
        let mut guests = guest_counts(&stacks, &frames, &namer, true);
        let steal = 7;
        let counts = guests.per_vm.get_mut(&0).unwrap();
        counts.steal.insert("(outside)".into(), steal);
        let table = counts.table(None, "bzImage", None, &guests.rows);
        // What the rows must be: the samples summed by name.
        let mut want: HashMap<(String, String, Option<String>), u64> = HashMap::default();
        for s in stacks.iter().filter(|s| s.count > 0) {
            let f = &frames[s.frame as usize];
            let process = f.process_key.and_then(|p| namer.task_label(p));
            *want
                .entry((
                    f.function.clone(),
                    f.module.clone(),
                    process.map(str::to_owned),
                ))
                .or_default() += s.count;
        }
        *want
            .entry(("[steal]".into(), "(outside)".into(), None))
            .or_default() += steal;
        let got: HashMap<(String, String, Option<String>), u64> = table
            .rows
            .iter()
            .map(|r| {
                (
                    (r.function.clone(), r.module.clone(), r.process.clone()),
                    r.samples,
                )
            })
            .collect();
        assert_eq!(got.len(), table.rows.len(), "a name in two rows");
        assert_eq!(got, want);
        // Threads of one program share its label: fewer rows than frames met.
        assert!(want.keys().any(|(_, _, p)| p.as_deref() == Some("job[80]")));
        assert!(table.processes);
    }

    /// The report of a capture, decoded on `threads` threads.
    fn report_with(bytes: &[u8], threads: usize) -> Report {
        from_bytes(
            bytes,
            &Images::default(),
            LoadOptions::all(threads),
            &Progress::hidden(),
        )
        .1
    }

    fn report_of(bytes: &[u8]) -> Report {
        report_with(bytes, 1)
    }

    #[test]
    fn empty_capture() {
        let r = report_of(&[]);
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
            ..Default::default()
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
                .max(max_block_frame_len(64, 0))
                .max(max_end_frame_len(1))
        ];
        let n = encode_header(&header, &mut buf).unwrap();
        out.extend_from_slice(&buf[..n]);
        let mut enc = BlockEncoder::new(0, 4000);
        for chunk in records.chunks(64) {
            let n = enc.encode(chunk, &[], 0, &mut buf).unwrap();
            out.extend_from_slice(&buf[..n]);
        }
        let totals: [PcpuTotals; 1] = [enc.totals(0)];
        let n = encode_end(&totals, &mut buf).unwrap();
        out.extend_from_slice(&buf[..n]);
        out
    }

    #[test]
    fn known_counts() {
        let r = report_of(&known_capture());
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
        let seq = report_of(&cap.bytes);
        for threads in [2, 4] {
            assert_eq!(report_with(&cap.bytes, threads), seq, "{threads} threads");
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
        let r = report_of(&cap.bytes);
        assert_eq!(r.total_samples, cap.samples);
        let sum: u64 = r.host.rows.iter().map(|x| x.samples).sum();
        assert_eq!(sum, r.total_samples);
    }

    proptest! {
        #[test]
        fn never_panics(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
            let _ = report_of(&bytes);
        }

        #[test]
        fn damaged_known_capture(flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)) {
            let mut bytes = known_capture();
            for (i, v) in flips {
                let at = i.index(bytes.len());
                bytes[at] ^= v | 1;
            }
            let r = report_of(&bytes);
            // Whatever survives is counted, whatever is lost is accounted for.
            prop_assert!(r.total_samples + r.lost.samples <= 100);
        }
    }
}
