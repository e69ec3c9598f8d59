//! The call graph (`report --call-graph`): per function the samples whose stack holds it
//! (children, `total`) and those whose leaf it is (`self`), and who calls whom, like
//! `perf report --children -g caller`; at the host level and per VM (the guest level).
//!
//! - Host level: every sample, as the pCPUs saw it, on one tree: a guest sample is its VM
//!   (`[guestOS1]`, as the host table names it) calling its guest frames then its function,
//!   named with the VM (`work_a [guestOS1]`: two VMs' functions of one name stay apart), so the
//!   VM's total is its row of the host table and its calls are the VM level's, as shares of the
//!   whole machine; a hypervisor sample its hypervisor frames then its function, an idle sample
//!   its hypervisor frames then `[idle]`.
//! - VM level: that VM's guest samples, their guest frames then their function.
//! - Exit causes: the hypervisor samples taken on a vCPU's exit whose guest chain was walked, by
//!   VM, exit reason, the guest function at the exit's RIP and its caller.
//!
//! A cut chain starts with a `[truncated: depth limit]` or `[truncated: bad frame]` frame, so
//! that its samples are not taken for calls from the root. A sample without chains is its
//! leaf alone. An edge counts a sample once however often its stack makes that call, a total
//! once however often the function is on it (recursion).
//!
//! # JSON (`report --json --call-graph`, key `call_graph`)
//! ```text
//! { "levels": [ { "level": "host" | "<vm name>", "samples": u64 } ],
//!   "edges": [ { "level", "caller", "callee", "samples": u64 } ],
//!   "functions": [ { "level", "function", "self": u64, "total": u64 } ],
//!   "exit_causes": [ { "vm", "exit_reason", "guest_function", "guest_caller": string | null,
//!                      "samples": u64 } ],
//!   "truncated": { "depth_limit": u64, "bad_frame": u64 } }
//! ```
//! Levels: the host first, then the VMs in the header's order. Functions are sorted by level,
//! then total (descending), self (descending), name; edges by level, samples (descending),
//! caller, callee; exit causes by VM, samples (descending), reason, function, caller.
//! `guest_caller` is null when the chain ends at the exit's function (complete), the
//! `[truncated: ...]` frame when it was cut there. `truncated` counts the samples with a chain
//! cut at the walker's depth limit, and at a bad frame.

use std::borrow::Cow;
use std::fmt::Write;

use hvprof_samplelog::NO_VM;
use rustc_hash::FxHashMap as HashMap;
use serde::Serialize;

use crate::model::calls::{CallStack, truncated_name};
use crate::model::profile::Profile;
use crate::model::samples::{ChainEnd, What};
use crate::naming::escape::printable;
use crate::naming::namer::exit_name;

/// One level of the call graph and its samples.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Level {
    /// `host`, or the VM's name.
    pub level: String,
    /// Its samples: every sample (host), or the VM's guest samples.
    pub samples: u64,
}

/// Samples in which `caller` calls `callee` directly (at `level`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Edge {
    /// `host`, or the VM's name.
    pub level: String,
    /// The calling function.
    pub caller: String,
    /// The function it calls.
    pub callee: String,
    /// Samples whose stack has this call (once each).
    pub samples: u64,
}

/// A function's samples at a level: whose leaf it is (`self`), whose stack holds it (`total`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Function {
    /// `host`, or the VM's name.
    pub level: String,
    /// Its name.
    pub function: String,
    /// Samples whose leaf it is (JSON `self`).
    #[serde(rename = "self")]
    pub self_samples: u64,
    /// Samples whose stack holds it (once each).
    pub total: u64,
}

/// Hypervisor samples on a VM's exits: the exit's reason, the guest function at its RIP and
/// that function's caller.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ExitCause {
    /// The VM's name.
    pub vm: String,
    /// The exit's reason, as the report names it (`CPUID`).
    pub exit_reason: String,
    /// The guest function at the exit's RIP.
    pub guest_function: String,
    /// Its caller (`None`: the chain ends there; a cut chain's `[truncated: ...]`).
    pub guest_caller: Option<String>,
    /// The hypervisor's samples on such exits.
    pub samples: u64,
}

/// Samples with a cut chain.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Truncated {
    /// Samples with a chain cut at the walker's depth limit.
    pub depth_limit: u64,
    /// Samples with a chain cut at a bad frame.
    pub bad_frame: u64,
}

/// The call graph of a profile (see the module documentation).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CallGraph {
    /// The host level, then each VM's.
    pub levels: Vec<Level>,
    /// Who calls whom, per level.
    pub edges: Vec<Edge>,
    /// Each function's self and total samples, per level.
    pub functions: Vec<Function>,
    /// The guest code at the exits the hypervisor's samples caught.
    pub exit_causes: Vec<ExitCause>,
    /// Samples with cut chains.
    pub truncated: Truncated,
    /// Whether any sample has a call chain (the text says when none has).
    #[serde(skip)]
    pub chains: bool,
}

/// Counts of one level, by interned function.
#[derive(Default)]
struct LevelCounts<'a> {
    samples: u64,
    names: Vec<Cow<'a, str>>,
    ids: HashMap<Cow<'a, str>, u32>,
    self_: HashMap<u32, u64>,
    total: HashMap<u32, u64>,
    edges: HashMap<(u32, u32), u64>,
}

impl<'a> LevelCounts<'a> {
    fn id(&mut self, name: Cow<'a, str>) -> u32 {
        if let Some(&i) = self.ids.get(&name) {
            return i;
        }
        let i = self.names.len() as u32;
        self.names.push(name.clone());
        self.ids.insert(name, i);
        i
    }

    /// Adds `n` samples of the stack `path` (outermost first; its last is the leaf).
    fn add(&mut self, path: &[u32], n: u64) {
        self.samples += n;
        let Some(&leaf) = path.last() else { return };
        *self.self_.entry(leaf).or_default() += n;
        for (i, f) in path.iter().enumerate() {
            if !path[..i].contains(f) {
                *self.total.entry(*f).or_default() += n;
            }
        }
        for (i, w) in path.windows(2).enumerate() {
            let pair = (w[0], w[1]);
            if !path[..i + 1].windows(2).any(|v| (v[0], v[1]) == pair) {
                *self.edges.entry(pair).or_default() += n;
            }
        }
    }
}

/// An exit cause's VM, exit reason, guest function and caller.
type CauseKey<'a> = (u16, u16, &'a str, Option<&'a str>);

/// A function's number in a level, found once per distinct frame (a leaf's, by its number in
/// `Profile::frames`, or a chain's, by its number in `Profile::calls`) and VM, not once per
/// stack: a capture without symbols has a frame per address, and every one of its stacks would
/// otherwise make and hash its names again.
#[derive(Default)]
struct Ids {
    /// (frame, VM) → its number.
    of: HashMap<(u32, u16), u32>,
}

impl Ids {
    /// The number of (`frame`, `vm`), from `make` the first time.
    fn get(&mut self, frame: u32, vm: u16, make: impl FnOnce() -> u32) -> u32 {
        *self.of.entry((frame, vm)).or_insert_with(make)
    }
}

/// The numbers, in `level`, of a chain's frames (`sites`, innermost first), outermost first,
/// after its `[truncated: ...]` frame: each named by `name` (a chain frame's function).
fn chain_ids<'a>(
    p: &'a Profile,
    sites: &[u32],
    end: ChainEnd,
    vm: u16,
    memo: &mut Ids,
    mut id: impl FnMut(Cow<'a, str>) -> u32,
    path: &mut Vec<u32>,
) {
    if let Some(t) = truncated_name(end) {
        path.push(id(Cow::Borrowed(t)));
    }
    for &i in sites.iter().rev() {
        path.push(memo.get(i, vm, || {
            id(Cow::Borrowed(p.calls.frame(i).function.as_str()))
        }));
    }
}

/// Builds the call graph of `p` (whose stacks and chains are named: not a report-only load).
pub fn build(p: &Profile) -> CallGraph {
    // Levels: the host, then each VM in the header's order, then VMs it does not list.
    let mut vm_order: Vec<u16> = p.vms.iter().map(|v| v.id).collect();
    let mut extra: Vec<u16> = p
        .samples
        .stacks()
        .iter()
        .filter(|s| matches!(s.what, What::GuestKernel | What::GuestUser))
        .map(|s| s.vm)
        .filter(|vm| !vm_order.contains(vm))
        .collect();
    extra.sort_unstable();
    extra.dedup();
    vm_order.extend(extra);
    let mut host = LevelCounts::default();
    let mut vms: HashMap<u16, LevelCounts> = HashMap::default();
    let mut causes: HashMap<CauseKey, u64> = HashMap::default();
    let mut truncated = Truncated::default();
    // Each VM's host-level function (`[guestOS1]`).
    let mut vm_ids: HashMap<u16, u32> = HashMap::default();
    let empty = CallStack::default();
    let mut path: Vec<u32> = Vec::new();
    // Per level kind: the host level's guest functions (named with their VM), its hypervisor
    // functions, and each VM's level; leaves and chain frames apart (their numbers are of two
    // lists).
    let (mut host_guest_leaf, mut host_guest_site) = (Ids::default(), Ids::default());
    let (mut host_leaf, mut host_site) = (Ids::default(), Ids::default());
    let (mut vm_leaf, mut vm_site) = (Ids::default(), Ids::default());
    for s in p.samples.stacks().iter().filter(|s| s.count > 0) {
        let n = s.count;
        let c = if s.calls == 0 { &empty } else { p.calls.of(s) };
        for end in [c.host_end, c.guest_end] {
            match end {
                ChainEnd::DepthLimit => truncated.depth_limit += n,
                ChainEnd::BadFrame => truncated.bad_frame += n,
                ChainEnd::Complete | ChainEnd::NotWalked => {}
            }
        }
        let leaf = p.frames[s.frame as usize].function.as_str();
        // The host level.
        path.clear();
        match s.what {
            What::GuestKernel | What::GuestUser => {
                let id = *vm_ids
                    .entry(s.vm)
                    .or_insert_with(|| host.id(Cow::Owned(format!("[{}]", p.vm_name(s.vm)))));
                path.push(id);
                let with_vm = |host: &mut LevelCounts<'_>, n: &str| {
                    host.id(Cow::Owned(format!("{n} [{}]", p.vm_name(s.vm))))
                };
                chain_ids(
                    p,
                    &c.guest,
                    c.guest_end,
                    s.vm,
                    &mut host_guest_site,
                    |n| with_vm(&mut host, &n),
                    &mut path,
                );
                path.push(host_guest_leaf.get(s.frame, s.vm, || with_vm(&mut host, leaf)));
            }
            What::Hypervisor | What::Idle => {
                chain_ids(
                    p,
                    &c.host,
                    c.host_end,
                    NO_VM,
                    &mut host_site,
                    |n| host.id(n),
                    &mut path,
                );
                path.push(host_leaf.get(s.frame, NO_VM, || host.id(Cow::Borrowed(leaf))));
            }
        }
        host.add(&path, n);
        // The guest level.
        if matches!(s.what, What::GuestKernel | What::GuestUser) {
            let level = vms.entry(s.vm).or_default();
            path.clear();
            chain_ids(
                p,
                &c.guest,
                c.guest_end,
                s.vm,
                &mut vm_site,
                |n| level.id(n),
                &mut path,
            );
            path.push(vm_leaf.get(s.frame, s.vm, || level.id(Cow::Borrowed(leaf))));
            level.add(&path, n);
        }
        // Exit causes.
        if s.exit_cause
            && let Some(&first) = c.guest.first()
        {
            let function = p.calls.frame(first).function.as_str();
            let caller = match c.guest.get(1) {
                Some(&i) => Some(p.calls.frame(i).function.as_str()),
                None => truncated_name(c.guest_end),
            };
            *causes.entry((s.vm, s.exit, function, caller)).or_default() += n;
        }
    }
    let mut levels = vec![Level {
        level: "host".into(),
        samples: host.samples,
    }];
    let (mut functions, mut edges) = (Vec::new(), Vec::new());
    let mut emit = |name: &str, counts: &LevelCounts| {
        let mut fs: Vec<Function> = counts
            .total
            .iter()
            .map(|(&f, &total)| Function {
                level: name.to_owned(),
                function: counts.names[f as usize].to_string(),
                self_samples: counts.self_.get(&f).copied().unwrap_or(0),
                total,
            })
            .collect();
        fs.sort_by(|a, b| {
            b.total
                .cmp(&a.total)
                .then(b.self_samples.cmp(&a.self_samples))
                .then_with(|| a.function.cmp(&b.function))
        });
        functions.extend(fs);
        let mut es: Vec<Edge> = counts
            .edges
            .iter()
            .map(|(&(a, b), &samples)| Edge {
                level: name.to_owned(),
                caller: counts.names[a as usize].to_string(),
                callee: counts.names[b as usize].to_string(),
                samples,
            })
            .collect();
        es.sort_by(|a, b| {
            b.samples
                .cmp(&a.samples)
                .then_with(|| a.caller.cmp(&b.caller))
                .then_with(|| a.callee.cmp(&b.callee))
        });
        edges.extend(es);
    };
    emit("host", &host);
    for vm in &vm_order {
        let Some(counts) = vms.get(vm) else { continue };
        let name = p.vm_name(*vm);
        emit(&name, counts);
        levels.push(Level {
            level: name,
            samples: counts.samples,
        });
    }
    let rank = |vm: u16| vm_order.iter().position(|&v| v == vm).unwrap_or(usize::MAX);
    let mut causes: Vec<(CauseKey, u64)> = causes.into_iter().collect();
    causes.sort_by(|(a, na), (b, nb)| {
        rank(a.0)
            .cmp(&rank(b.0))
            .then(a.0.cmp(&b.0))
            .then(nb.cmp(na))
            .then_with(|| exit_name(a.1).cmp(&exit_name(b.1)))
            .then_with(|| (a.2, a.3).cmp(&(b.2, b.3)))
    });
    let exit_causes = causes
        .into_iter()
        .map(|((vm, exit, function, caller), samples)| ExitCause {
            vm: p.vm_name(vm),
            exit_reason: exit_name(exit),
            guest_function: function.to_owned(),
            guest_caller: caller.map(str::to_owned),
            samples,
        })
        .collect();
    CallGraph {
        levels,
        edges,
        functions,
        exit_causes,
        truncated,
        chains: p.samples.has_chains(),
    }
}

/// `n` as a percentage of `total`.
fn pct(n: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        100.0 * n as f64 / total as f64
    }
}

/// Functions whose callers and callees the text lists, per level.
const DETAILED: usize = 10;

/// The call graph as text: per level (the host's unless `only_vm`, then each VM's or only
/// `only_vm`'s) its `top` functions by children with their self share, then for the first of
/// them their callers and callees, the exit causes, the cut chains.
pub fn render(g: &CallGraph, top: usize, only_vm: Option<&str>) -> String {
    let mut out = String::new();
    if !g.chains {
        out.push_str(
            "Call graph: no sample of this capture has a call chain (each is its function alone)\n\n",
        );
    }
    for l in &g.levels {
        let is_host = l.level == "host";
        if only_vm.is_some_and(|v| is_host || v != l.level) {
            continue;
        }
        let title = if is_host {
            "host level".to_owned()
        } else {
            format!("VM {}", printable(&l.level))
        };
        let _ = writeln!(
            out,
            "Call graph, {title}: {} samples (Children: samples whose stack holds the function; Self: whose leaf it is)",
            l.samples
        );
        let fs: Vec<&Function> = g.functions.iter().filter(|f| f.level == l.level).collect();
        let _ = writeln!(out, "  {:>9}  {:>8}  Function", "Children", "Self");
        for f in fs.iter().take(top) {
            let _ = writeln!(
                out,
                "  {:>8.2}%  {:>7.2}%  {}",
                pct(f.total, l.samples),
                pct(f.self_samples, l.samples),
                printable(&f.function)
            );
        }
        if fs.len() > top {
            let _ = writeln!(out, "  ... {} more functions (--top)", fs.len() - top);
        }
        let edges: Vec<&Edge> = g.edges.iter().filter(|e| e.level == l.level).collect();
        for f in fs.iter().take(top.min(DETAILED)) {
            let callers: Vec<&&Edge> = edges.iter().filter(|e| e.callee == f.function).collect();
            let callees: Vec<&&Edge> = edges.iter().filter(|e| e.caller == f.function).collect();
            if callers.is_empty() && callees.is_empty() {
                continue;
            }
            let _ = writeln!(
                out,
                "\n  {} (children {:.2}%, self {:.2}%)",
                printable(&f.function),
                pct(f.total, l.samples),
                pct(f.self_samples, l.samples)
            );
            let shown = top.min(DETAILED);
            for (what, list) in [("callers", &callers), ("callees", &callees)] {
                for (i, e) in list.iter().take(shown).enumerate() {
                    let name = if what == "callers" {
                        &e.caller
                    } else {
                        &e.callee
                    };
                    let _ = writeln!(
                        out,
                        "    {:<8} {:>7.2}%  {}",
                        if i == 0 { what } else { "" },
                        pct(e.samples, l.samples),
                        printable(name)
                    );
                }
                if list.len() > shown {
                    let _ = writeln!(out, "    {:<8} ... {} more", "", list.len() - shown);
                }
            }
        }
        out.push('\n');
    }
    let host_samples = g.levels.first().map_or(0, |l| l.samples);
    let mut vms: Vec<&str> = Vec::new();
    for c in &g.exit_causes {
        if !vms.contains(&c.vm.as_str()) && only_vm.is_none_or(|v| v == c.vm) {
            vms.push(&c.vm);
        }
    }
    for vm in vms {
        let _ = writeln!(
            out,
            "Exit causes, VM {}: the guest code at the exits whose handling the hypervisor's samples caught",
            printable(vm)
        );
        let _ = writeln!(
            out,
            "  {:>8}  {:>7}  {:<22}  {:<30}  Caller",
            "Samples", "%Host", "Exit", "Guest function"
        );
        for c in g.exit_causes.iter().filter(|c| c.vm == vm).take(top) {
            let _ = writeln!(
                out,
                "  {:>8}  {:>6.2}%  {:<22}  {:<30}  {}",
                c.samples,
                pct(c.samples, host_samples),
                printable(&c.exit_reason),
                printable(&c.guest_function),
                c.guest_caller
                    .as_deref()
                    .map_or(Cow::Borrowed("-"), printable)
            );
        }
        out.push('\n');
    }
    if g.chains {
        let _ = writeln!(
            out,
            "Cut chains: {} samples at the walker's depth limit, {} at a bad frame (their outermost frame is [truncated: ...])",
            g.truncated.depth_limit, g.truncated.bad_frame
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::model::profile::{LoadOptions, Profile};
    use crate::model::progress::Progress;
    use crate::naming::symbols::Images;
    use hvprof_samplelog::synth;

    /// A capture with call chains decoded in parts (on one thread, on three) draws the same
    /// flame graph stacks and call graph.
    #[test]
    fn chains_decoded_in_parts_draw_the_same_graphs() {
        let cfg = synth::SynthConfig {
            pcpus: 2,
            samples_per_pcpu: 3000,
            chains: true,
            ..synth::SynthConfig::default()
        };
        let cap = synth::capture(&cfg, &synth::CaptureOptions::default());
        let load = |threads| {
            Profile::from_bytes(
                &cap.bytes,
                &Images::default(),
                LoadOptions::all(threads),
                &Progress::hidden(),
            )
        };
        let (one, three) = (load(1), load(3));
        assert!(one.samples.has_chains());
        assert_eq!(
            crate::views::flame::folded(&one),
            crate::views::flame::folded(&three)
        );
        assert_eq!(super::build(&one), super::build(&three));
    }
}
