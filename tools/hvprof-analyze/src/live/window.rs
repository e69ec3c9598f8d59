//! The live view's model (`record`'s status line, `top`'s screen), fed the decoder's items as
//! bytes arrive: running counts of what was received and lost ([`StreamStats`]), and the samples
//! and scheduling events of the last N seconds of host time ([`Live`]), read as a [`Snapshot`].
//! No terminal, no clock: host time is the log's TSC (the header's `tsc_hz`), so the same input
//! gives the same snapshot.
//!
//! The window holds whole seconds of host time (TSC / tsc_hz): the current one (up to the latest
//! TSC received) and the N-1 before it, each a bucket of counts. When the latest TSC enters a
//! new second the oldest buckets leave, so no sample older than N seconds is counted and the
//! window spans between N-1 and N seconds (the snapshot says how long exactly). The vCPUs' idle
//! and steal are exact: the time each spent out halted (idle) and out otherwise (steal, runnable
//! but not running), from its scheduling events, as fractions of the window's span.
//!
//! Each sample is classified as every command classifies it ([`classify`]: its key, a Linux
//! guest's process included, from the task frames received so far: the hypervisor sends a
//! vCPU's task change before the samples that follow it), and the window counts keys.
//!
//! With call graphs ([`Live::with_call_graph`]) each sample is counted with its call chain (the
//! guest's callers at a guest sample, the hypervisor's at a hypervisor or idle sample), each
//! distinct chain numbered once; a snapshot then gives every function on the window's stacks
//! its children count (the samples whose stack holds it, once each, as `perf top -g` shows),
//! callers that are never a leaf included, and ranks the rows by it.

use std::collections::{BTreeMap, HashSet, VecDeque};

use rustc_hash::FxHashMap as HashMap;

use hvprof_samplelog::{
    Chains, Decoded, Event, EventKind, Header, Item, OutReason, PcpuTotals, Record, Sample,
};

use crate::model::classify::{Key, classify};
use crate::model::samples::What;
use crate::naming::namer::{Namer, ProcessKey, Processes, TaskMemo};
use crate::naming::symbols::Images;

/// What a stream held so far: counts of frames, records and damage, and the losses known so
/// far (sequence gaps; after the end frame, exact and equal to a whole decode's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    /// Bytes fed.
    pub bytes: u64,
    /// Valid frames of every type.
    pub frames: u64,
    /// Samples received (blocks received twice count once).
    pub samples: u64,
    /// Scheduling events received.
    pub events: u64,
    /// Blocks lost: gaps in the pCPUs' sequence numbers (and, after the end frame, the blocks it
    /// counts beyond the last one received).
    pub blocks_lost: u64,
    /// Samples those blocks held.
    pub samples_lost: u64,
    /// Events those blocks held.
    pub events_lost: u64,
    /// Samples the hypervisor dropped because a ring was full (never recorded).
    pub ring_drops: u64,
    /// Damaged frames and unrecognised stretches of bytes.
    pub damaged: u64,
    /// Whether the end frame arrived.
    pub end_seen: bool,
}

/// One pCPU's progress: what arrived and where its numbering stands.
#[derive(Debug, Clone, Default)]
struct PcpuProgress {
    seqs: HashSet<u64>,
    next_seq: u64,
    next_sample: u64,
    next_event: u64,
    samples: u64,
    events: u64,
    ring_drops: u64,
    end: Option<PcpuTotals>,
}

impl PcpuProgress {
    fn blocks_lost(&self) -> u64 {
        let sent = self
            .end
            .map_or(self.next_seq, |e| e.blocks.max(self.next_seq));
        sent.saturating_sub(self.seqs.len() as u64)
    }

    fn samples_lost(&self) -> u64 {
        let sent = self
            .end
            .map_or(self.next_sample, |e| e.samples.max(self.next_sample));
        sent.saturating_sub(self.samples)
    }

    fn events_lost(&self) -> u64 {
        let sent = self
            .end
            .map_or(self.next_event, |e| e.events.max(self.next_event));
        sent.saturating_sub(self.events)
    }
}

/// Running counts over a stream's items: what `record` shows as bytes arrive. The losses are
/// the blocks' sequence gaps so far; for a stream whose numbering is consistent they equal
/// those of [`hvprof_samplelog::decode`] on the same bytes once the end frame has arrived.
#[derive(Debug, Clone, Default)]
pub struct StreamStats {
    bytes: u64,
    frames: u64,
    damaged: u64,
    end_seen: bool,
    pcpus: BTreeMap<u16, PcpuProgress>,
}

impl StreamStats {
    /// Nothing seen yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts `n` more bytes fed to the decoder.
    pub fn add_bytes(&mut self, n: u64) {
        self.bytes = self.bytes.saturating_add(n);
    }

    /// Takes one item of the decoder.
    pub fn push(&mut self, item: &Item<'_>) {
        match item {
            Item::Damage(_) => self.damaged += 1,
            Item::Text { .. } => {}
            Item::Block {
                header, records, ..
            } => {
                self.frames += 1;
                let p = self.pcpus.entry(header.pcpu).or_default();
                if !p.seqs.insert(header.seq) {
                    return;
                }
                let samples = records
                    .iter()
                    .filter(|r| matches!(r, Record::Sample(_)))
                    .count() as u64;
                let events = records.len() as u64 - samples;
                p.samples = p.samples.saturating_add(samples);
                p.events = p.events.saturating_add(events);
                p.next_seq = p.next_seq.max(header.seq.saturating_add(1));
                p.next_sample = p
                    .next_sample
                    .max(header.first_sample.saturating_add(samples));
                p.next_event = p.next_event.max(header.first_event.saturating_add(events));
                p.ring_drops = p.ring_drops.max(header.ring_drops);
            }
            Item::End { totals, .. } => {
                self.frames += 1;
                self.end_seen = true;
                for t in totals.iter() {
                    let p = self.pcpus.entry(t.pcpu).or_default();
                    p.end = Some(*t);
                    p.ring_drops = t.ring_drops;
                }
            }
            Item::Header { .. }
            | Item::Task { .. }
            | Item::VmEnd { .. }
            | Item::PcpuCost { .. }
            | Item::Mapping { .. }
            | Item::Output { .. }
            | Item::Unknown { .. } => self.frames += 1,
        }
    }

    /// The counts so far.
    pub fn totals(&self) -> Totals {
        let sum = |f: fn(&PcpuProgress) -> u64| {
            self.pcpus
                .values()
                .fold(0u64, |n, p| n.saturating_add(f(p)))
        };
        Totals {
            bytes: self.bytes,
            frames: self.frames,
            samples: sum(|p| p.samples),
            events: sum(|p| p.events),
            blocks_lost: sum(PcpuProgress::blocks_lost),
            samples_lost: sum(PcpuProgress::samples_lost),
            events_lost: sum(PcpuProgress::events_lost),
            ring_drops: sum(|p| p.ring_drops),
            damaged: self.damaged,
            end_seen: self.end_seen,
        }
    }
}

/// What names the view's rows: [`Namer`] does, as in every other command.
pub trait Names {
    /// A VM's name.
    fn vm_name(&self, vm: u16) -> String;
    /// A guest address's function and module; `process` is a Linux guest's task label.
    fn guest_function(
        &self,
        vm: u16,
        user: bool,
        addr: u64,
        cr3: u64,
        process: Option<&str>,
    ) -> (String, String);
    /// A hypervisor address's function.
    fn hypervisor_function(&self, addr: u64) -> String;
}

impl Names for Namer<'_> {
    fn vm_name(&self, vm: u16) -> String {
        Namer::vm_name(self, vm)
    }

    fn guest_function(
        &self,
        vm: u16,
        user: bool,
        addr: u64,
        cr3: u64,
        process: Option<&str>,
    ) -> (String, String) {
        Namer::guest_function(self, vm, user, addr, cr3, process)
    }

    fn hypervisor_function(&self, addr: u64) -> String {
        Namer::hypervisor_function(self, addr)
    }
}

/// A distinct call chain (the callers' return addresses, innermost first) of the window's
/// samples: its number in [`Live`]'s list; 0 is the empty chain.
type StackId = u32;

/// Sample counts of one second, or of the whole window: per key and the chain of its callers
/// (the guest's at a guest sample, the hypervisor's at a hypervisor or idle sample; 0 without
/// call graphs).
#[derive(Debug, Clone, Default)]
struct Counts {
    samples: u64,
    keys: HashMap<(Key, StackId), u64>,
}

impl Counts {
    fn add(&mut self, key: (Key, StackId)) {
        self.samples += 1;
        *self.keys.entry(key).or_default() += 1;
    }

    /// Removes `other` (a part of these counts).
    fn remove(&mut self, other: &Counts) {
        self.samples -= other.samples;
        for (k, n) in &other.keys {
            if let Some(c) = self.keys.get_mut(k) {
                *c -= n;
                if *c == 0 {
                    self.keys.remove(k);
                }
            }
        }
    }
}

/// A vCPU's state after one of its events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum VcpuState {
    In,
    OutHalted,
    Out,
    Stopped,
}

impl VcpuState {
    fn of(e: &Event) -> Self {
        match (e.kind, e.reason) {
            (EventKind::VcpuIn, _) => Self::In,
            (EventKind::VcpuOut, OutReason::Halted) => Self::OutHalted,
            (EventKind::VcpuOut, OutReason::Stopped) => Self::Stopped,
            (EventKind::VcpuOut, _) => Self::Out,
        }
    }
}

/// A vCPU's events in the window (TSC order), each with its state after it and its pCPU, and
/// its state when the window starts.
#[derive(Debug, Clone, Default)]
struct VcpuTrack {
    before: Option<(u64, VcpuState, u16)>,
    events: VecDeque<(u64, VcpuState, u16)>,
}

impl VcpuTrack {
    fn insert(&mut self, tsc: u64, state: VcpuState, pcpu: u16, start: u64) {
        if tsc < start {
            if self.before.is_none_or(|(t, _, _)| t <= tsc) {
                self.before = Some((tsc, state, pcpu));
            }
            return;
        }
        // Events mostly arrive in order: insert from the back.
        let at = self
            .events
            .iter()
            .rposition(|&(t, _, _)| t <= tsc)
            .map_or(0, |i| i + 1);
        self.events.insert(at, (tsc, state, pcpu));
    }

    fn evict(&mut self, start: u64) {
        while self.events.front().is_some_and(|&(t, _, _)| t < start) {
            self.before = self.events.pop_front();
        }
    }

    /// Its stretches within `[start, end]`: (state, pCPU, from, to) (time before its first
    /// known event counts in none).
    fn stretches(
        &self,
        start: u64,
        end: u64,
    ) -> impl Iterator<Item = (VcpuState, u16, u64, u64)> + '_ {
        let mut at = start;
        let mut state = self.before.map(|(_, s, p)| (s, p));
        self.events
            .iter()
            .take_while(move |&&(t, _, _)| t <= end)
            .map(Some)
            .chain(std::iter::once(None))
            .filter_map(move |e| {
                let to = e.map_or(end, |&(t, _, _)| t);
                let done = state.map(|(s, p)| (s, p, at, to));
                at = to;
                state = e.map(|&(_, s, p)| (s, p));
                done
            })
    }

    /// Ticks in, out halted and out otherwise within `[start, end]` (time before its first
    /// known event, and after it stopped, counts in none).
    fn ticks(&self, start: u64, end: u64) -> (u64, u64, u64) {
        let (mut run, mut halted, mut out) = (0u64, 0u64, 0u64);
        for (state, _, from, to) in self.stretches(start, end) {
            let span = to.saturating_sub(from);
            match state {
                VcpuState::In => run += span,
                VcpuState::OutHalted => halted += span,
                VcpuState::Out => out += span,
                VcpuState::Stopped => {}
            }
        }
        (run, halted, out)
    }
}

/// A row of a snapshot's tables.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The function, or `[vm name]`, or `[idle]`.
    pub name: String,
    /// Its module: the guest image, `hvprof`, `(vm N)`, `(idle)`.
    pub module: String,
    /// A Linux guest's function: the process (`comm[tgid]`) it ran in.
    pub process: Option<String>,
    /// Samples in the window.
    pub samples: u64,
    /// Percent of the table's total.
    pub percent: f64,
    /// With call graphs: samples whose stack holds it (once each), its own included; else
    /// `samples`.
    pub children: u64,
    /// `children`, as a percent of the table's total.
    pub children_percent: f64,
}

/// A VM's hottest guest functions in the window.
#[derive(Debug, Clone, PartialEq)]
pub struct VmTop {
    /// The VM's id.
    pub vm: u16,
    /// Its name.
    pub name: String,
    /// Its guest samples in the window.
    pub samples: u64,
    /// Percent of all the window's samples.
    pub percent: f64,
    /// Its functions, hottest first, percent of its guest samples.
    pub rows: Vec<Row>,
}

/// A vCPU's time in the window, from its scheduling events (fractions of the window's span).
#[derive(Debug, Clone, PartialEq)]
pub struct VcpuTime {
    /// The VM's id.
    pub vm: u16,
    /// The VM's name.
    pub name: String,
    /// The vCPU.
    pub vcpu: u16,
    /// In (running on a pCPU).
    pub running: f64,
    /// Out halted.
    pub idle: f64,
    /// Out otherwise (preempted, yielded): runnable but not running.
    pub steal: f64,
    /// Of `steal`, who held the pCPU it went out of (exact, from the events): another VM by
    /// name, or a sibling vCPU of its own VM (`vcpuN`); the largest first. The rest no vCPU
    /// held (the hypervisor, or idle).
    pub steal_by: Vec<(String, f64)>,
}

/// The view at one moment: the window's tables and the stream's counts.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// The header has not arrived (nothing can be placed in host time yet).
    pub waiting: bool,
    /// The rows have children counts from the call chains (ranked by them).
    pub call_graph: bool,
    /// The window's nominal length (seconds).
    pub window: u64,
    /// The host time the window spans (seconds).
    pub span: f64,
    /// Host time from the first record to the latest (seconds).
    pub elapsed: f64,
    /// Samples in the window.
    pub samples: u64,
    /// Samples per second of host time in the window.
    pub rate: f64,
    /// Percent of the window's samples: in the VMs' guests, in the hypervisor, idle.
    pub vm_percent: f64,
    /// See `vm_percent`.
    pub hypervisor_percent: f64,
    /// See `vm_percent`.
    pub idle_percent: f64,
    /// The host level: each VM as one row, the hypervisor's functions, `[idle]`; hottest first.
    pub host: Vec<Row>,
    /// Per VM with samples in the window (by id), its hottest guest functions.
    pub vms: Vec<VmTop>,
    /// Per vCPU (the header's, and any with events), its time in the window.
    pub vcpus: Vec<VcpuTime>,
    /// What the stream held so far.
    pub totals: Totals,
}

/// The last N seconds of a stream's samples and events, and the stream's counts.
pub struct Live {
    window: u64,
    stats: StreamStats,
    tsc_hz: u64,
    /// Latest TSC received (a record's).
    now: Option<u64>,
    /// Earliest TSC received.
    first: Option<u64>,
    /// Per second of host time, ascending.
    buckets: VecDeque<(u64, Counts)>,
    /// The buckets' sum.
    counts: Counts,
    vcpus: BTreeMap<(u16, u16), VcpuTrack>,
    /// Whether samples are counted with their call chains.
    call_graph: bool,
    /// The distinct chains, by number (the first is the empty chain), and their numbers.
    stacks: Vec<Box<[u64]>>,
    stack_ids: HashMap<Box<[u64]>, StackId>,
    /// Who ran in the Linux guests: every task frame received that samples of the window
    /// (or later) fall in.
    processes: Processes,
    /// The task the last guest sample's vCPU ran, and until when (emptied when the tasks
    /// change).
    task_memo: TaskMemo,
    /// What naming needs: the header, a task per VM (which VMs are Linux guests), the VM end
    /// frames, the mapping frames.
    meta: Decoded,
    meta_version: u64,
}

impl Live {
    /// An empty view over the last `window` seconds (at least 1).
    pub fn new(window: u64) -> Self {
        Live {
            window: window.max(1),
            stats: StreamStats::new(),
            tsc_hz: 0,
            now: None,
            first: None,
            buckets: VecDeque::new(),
            counts: Counts::default(),
            vcpus: BTreeMap::new(),
            call_graph: false,
            stacks: vec![Box::default()],
            stack_ids: HashMap::default(),
            processes: Processes::default(),
            task_memo: TaskMemo::default(),
            meta: Decoded::default(),
            meta_version: 0,
        }
    }

    /// An empty view over the last `window` seconds that counts each sample with its call
    /// chain: its snapshots give children counts.
    pub fn with_call_graph(window: u64) -> Self {
        Live {
            call_graph: true,
            ..Live::new(window)
        }
    }

    /// Counts `n` more bytes fed to the decoder.
    pub fn add_bytes(&mut self, n: u64) {
        self.stats.add_bytes(n);
    }

    /// The stream's counts so far.
    pub fn stats(&self) -> &StreamStats {
        &self.stats
    }

    /// The first header received.
    pub fn header(&self) -> Option<&Header> {
        self.meta.header.as_ref()
    }

    /// Changes whenever what names the samples changes (a header, a VM end frame, a mapping, a
    /// VM's first task frame): the caller then makes a new [`Namer`] with [`Live::namer`].
    pub fn naming_version(&self) -> u64 {
        self.meta_version
    }

    /// A namer for what the stream said so far.
    pub fn namer<'a>(&self, images: &'a Images, warnings: &mut Vec<String>) -> Namer<'a> {
        Namer::new(&self.meta, images, warnings)
    }

    /// Takes one item of the decoder.
    pub fn push(&mut self, item: Item<'_>) {
        self.stats.push(&item);
        match item {
            Item::Header { header, .. } => {
                if self.meta.header.is_none() {
                    self.tsc_hz = header.tsc_hz;
                    self.meta.header = Some(header.clone());
                    self.meta_version += 1;
                }
            }
            Item::Block {
                header,
                records,
                frames,
                ..
            } => {
                // Without the header's TSC frequency nothing can be placed in host time.
                if self.tsc_hz == 0 {
                    return;
                }
                for (r, chains) in hvprof_samplelog::with_chains(records, frames) {
                    match r {
                        Record::Sample(s) => self.sample(header.pcpu, s, chains),
                        Record::Event(e) => self.event(header.pcpu, e),
                    }
                }
            }
            Item::Task { task, .. } => {
                self.processes.add_task(&task);
                self.task_memo = TaskMemo::default();
                // The namer needs a VM's first task frame alone (it is a Linux guest): the
                // processes are named from `processes`.
                if !self.meta.tasks.iter().any(|t| t.vm == task.vm) {
                    self.meta.tasks.push(task);
                    self.meta_version += 1;
                }
            }
            Item::VmEnd { vm_end, .. } => {
                self.meta.vm_ends.push(vm_end.clone());
                self.meta_version += 1;
            }
            Item::Mapping { mapping, .. } => {
                self.meta.mappings.push(*mapping);
                self.meta_version += 1;
            }
            Item::End { .. }
            | Item::PcpuCost { .. }
            | Item::Output { .. }
            | Item::Unknown { .. }
            | Item::Text { .. }
            | Item::Damage(_) => {}
        }
    }

    /// The first second the window holds when the latest TSC is `now`.
    fn first_second(&self, now: u64) -> u64 {
        (now / self.tsc_hz).saturating_sub(self.window - 1)
    }

    /// Where the window starts (TSC): its first second's start, or the first record's TSC.
    fn start(&self) -> u64 {
        match self.now {
            Some(now) => {
                let start = self.first_second(now).saturating_mul(self.tsc_hz);
                start.max(self.first.unwrap_or(0))
            }
            None => 0,
        }
    }

    /// Moves the window's end to `tsc` if it is later; returns whether a record at `tsc` is
    /// in the window.
    fn advance(&mut self, tsc: u64) -> bool {
        self.first = Some(self.first.map_or(tsc, |f| f.min(tsc)));
        if self.now.is_none_or(|now| tsc > now) {
            let old_first = self.now.map(|now| self.first_second(now));
            self.now = Some(tsc);
            let keep = self.first_second(tsc);
            if old_first != Some(keep) {
                while self.buckets.front().is_some_and(|(s, _)| *s < keep) {
                    if let Some((_, c)) = self.buckets.pop_front() {
                        self.counts.remove(&c);
                    }
                }
                let start = self.start();
                for v in self.vcpus.values_mut() {
                    v.evict(start);
                }
                self.processes.forget_before(start);
                self.task_memo = TaskMemo::default();
            }
        }
        tsc >= self.start()
    }

    /// The number of the chain `frames` (0 without call graphs).
    fn stack(&mut self, frames: &[u64]) -> StackId {
        if !self.call_graph || frames.is_empty() {
            return 0;
        }
        if let Some(&id) = self.stack_ids.get(frames) {
            return id;
        }
        let id = StackId::try_from(self.stacks.len()).unwrap_or(StackId::MAX);
        if id == StackId::MAX {
            // Four billion distinct chains: the rest count as their leaf alone.
            return 0;
        }
        self.stacks.push(frames.into());
        self.stack_ids.insert(frames.into(), id);
        id
    }

    fn sample(&mut self, pcpu: u16, s: &Sample, chains: Chains<'_>) {
        if !self.advance(s.tsc) {
            return;
        }
        let second = s.tsc / self.tsc_hz;
        let key = classify(pcpu, s, Some(&self.processes), &mut self.task_memo);
        let chain = match key.what {
            What::GuestKernel | What::GuestUser => chains.guest,
            What::Hypervisor | What::Idle => chains.host,
        };
        let counted = (key, self.stack(chain));
        // Mostly the last second; a lagging pCPU's samples go further back.
        let i = match self.buckets.iter().rposition(|(b, _)| *b <= second) {
            Some(i) if self.buckets[i].0 == second => i,
            found => {
                let at = found.map_or(0, |i| i + 1);
                self.buckets.insert(at, (second, Counts::default()));
                at
            }
        };
        self.buckets[i].1.add(counted);
        self.counts.add(counted);
    }

    fn event(&mut self, pcpu: u16, e: &Event) {
        self.advance(e.tsc);
        let start = self.start();
        self.vcpus
            .entry((e.vm, e.vcpu))
            .or_default()
            .insert(e.tsc, VcpuState::of(e), pcpu, start);
    }

    /// The view now: `top` rows per table, named by `names`.
    pub fn snapshot(&self, names: &dyn Names, top: usize) -> Snapshot {
        let totals = self.stats.totals();
        let (start, end) = (self.start(), self.now.unwrap_or(0));
        let span_ticks = end.saturating_sub(start);
        let secs = |ticks: u64| {
            if self.tsc_hz == 0 {
                0.0
            } else {
                ticks as f64 / self.tsc_hz as f64
            }
        };
        let total = self.counts.samples;
        let pct = |n: u64, of: u64| {
            if of == 0 {
                0.0
            } else {
                100.0 * n as f64 / of as f64
            }
        };
        // The host level (each VM one row), merged by name; a caller (a return address: its
        // call, `addr - 1`, as perf names it) is a hypervisor function. Each VM's functions,
        // merged by name and process; callers named in the leaf's context.
        let mut host = Tally::default();
        let mut per_vm: BTreeMap<u16, Tally> = BTreeMap::new();
        let mut vm_rows: BTreeMap<u16, u64> = BTreeMap::new();
        let mut hv_names: HashMap<u64, String> = HashMap::default();
        let mut guest_names: HashMap<GuestName, (String, String)> = HashMap::default();
        let (mut hv_samples, mut idle_samples) = (0u64, 0u64);
        for (&(k, stack), &n) in &self.counts.keys {
            let chain = &self.stacks[stack as usize];
            let mut hypervisor = |addr: u64| -> RowName {
                let name = hv_names
                    .entry(addr)
                    .or_insert_with(|| names.hypervisor_function(addr));
                (name.clone(), "hvprof".to_owned(), None)
            };
            match k.what {
                What::GuestKernel | What::GuestUser => {
                    *vm_rows.entry(k.vm).or_default() += n;
                    let user = k.what == What::GuestUser;
                    let process = k.process.and_then(|p| self.processes.label(p));
                    let mut guest = |addr: u64| -> RowName {
                        let at = GuestName {
                            vm: k.vm,
                            user,
                            addr,
                            // The page-table root itself (PCID masked): a finer key than
                            // the process's address space, so never two names under one.
                            cr3: if user { k.cr3 & !0xfff } else { 0 },
                            process: k.process,
                        };
                        let (function, module) = guest_names.entry(at).or_insert_with(|| {
                            names.guest_function(k.vm, user, addr, k.cr3, process)
                        });
                        (function.clone(), module.clone(), process.map(str::to_owned))
                    };
                    let leaf = guest(k.addr);
                    let callers: Vec<RowName> = chain
                        .iter()
                        .map(|&ret| guest(ret.saturating_sub(1)))
                        .collect();
                    per_vm.entry(k.vm).or_default().add(leaf, callers, n);
                }
                What::Hypervisor => {
                    hv_samples += n;
                    let leaf = hypervisor(k.addr);
                    let callers = chain.iter().map(|&ret| hypervisor(ret.saturating_sub(1)));
                    host.add(leaf, callers.collect(), n);
                }
                What::Idle => {
                    idle_samples += n;
                    let leaf = ("[idle]".to_owned(), "(idle)".to_owned(), None);
                    let callers = chain.iter().map(|&ret| hypervisor(ret.saturating_sub(1)));
                    host.add(leaf, callers.collect(), n);
                }
            }
        }
        let vm_samples = vm_rows.values().sum();
        for (vm, n) in vm_rows {
            let row = (
                format!("[{}]", names.vm_name(vm)),
                format!("(vm {vm})"),
                None,
            );
            host.add(row, Vec::new(), n);
        }
        let vms = per_vm
            .into_iter()
            .map(|(vm, rows)| {
                let samples = rows.samples;
                VmTop {
                    vm,
                    name: names.vm_name(vm),
                    samples,
                    percent: pct(samples, total),
                    rows: rows.ranked(self.call_graph, top),
                }
            })
            .collect();
        // Every vCPU the header lists, and any other with events.
        let mut keys: Vec<(u16, u16)> = self
            .meta
            .header
            .iter()
            .flat_map(|h| h.vms.iter())
            .flat_map(|v| (0..v.vcpus).map(move |c| (v.id, c)))
            .collect();
        keys.extend(self.vcpus.keys().copied());
        keys.sort_unstable();
        keys.dedup();
        let fraction = |t: u64| {
            if span_ticks == 0 {
                0.0
            } else {
                t as f64 / span_ticks as f64
            }
        };
        // Who held each pCPU when, from every vCPU's stretches in within the window.
        let stretch = |key: (u16, u16), (_, pcpu, from, to): (VcpuState, u16, u64, u64)| {
            crate::model::timeline::Stretch {
                vcpu: key,
                pcpu,
                start: from,
                end: to,
            }
        };
        let holders =
            crate::model::timeline::Holders::new(self.vcpus.iter().flat_map(|(&k, t)| {
                t.stretches(start, end)
                    .filter(|s| s.0 == VcpuState::In)
                    .map(move |s| stretch(k, s))
            }));
        let vcpus = keys
            .into_iter()
            .map(|(vm, vcpu)| {
                let track = self.vcpus.get(&(vm, vcpu));
                let (run, halted, out) = track.map_or((0, 0, 0), |t| t.ticks(start, end));
                let mut held: HashMap<(u16, u16), u64> = HashMap::default();
                for s in track
                    .into_iter()
                    .flat_map(|t| t.stretches(start, end))
                    .filter(|s| s.0 == VcpuState::Out)
                {
                    holders.add(&stretch((vm, vcpu), s), &mut held);
                }
                let mut by: BTreeMap<String, u64> = BTreeMap::new();
                for ((v, c), t) in held {
                    let name = if v == vm {
                        format!("vcpu{c}")
                    } else {
                        names.vm_name(v)
                    };
                    *by.entry(name).or_default() += t;
                }
                let mut steal_by: Vec<(String, f64)> =
                    by.into_iter().map(|(n, t)| (n, fraction(t))).collect();
                steal_by.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
                VcpuTime {
                    vm,
                    name: names.vm_name(vm),
                    vcpu,
                    running: fraction(run),
                    idle: fraction(halted),
                    steal: fraction(out),
                    steal_by,
                }
            })
            .collect();
        let span = secs(span_ticks);
        Snapshot {
            waiting: self.meta.header.is_none(),
            call_graph: self.call_graph,
            window: self.window,
            span,
            elapsed: secs(end.saturating_sub(self.first.unwrap_or(end))),
            samples: total,
            rate: if span > 0.0 { total as f64 / span } else { 0.0 },
            vm_percent: pct(vm_samples, total),
            hypervisor_percent: pct(hv_samples, total),
            idle_percent: pct(idle_samples, total),
            host: host.ranked(self.call_graph, top),
            vms,
            vcpus,
            totals,
        }
    }
}

/// A row's names: function (or `[vm name]`, `[idle]`), module, process.
type RowName = (String, String, Option<String>);

/// What names a guest address the same way: the VM, the mode, the address, the address space
/// (user addresses) and the process.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct GuestName {
    vm: u16,
    user: bool,
    addr: u64,
    cr3: u64,
    process: Option<ProcessKey>,
}

/// A table's rows being summed: per row, its samples as a leaf (self) and those whose stack
/// holds it (children).
#[derive(Default)]
struct Tally {
    samples: u64,
    rows: HashMap<RowName, (u64, u64)>,
}

impl Tally {
    /// `n` samples of `leaf` called by `callers`: each function on the stack counts them once.
    fn add(&mut self, leaf: RowName, callers: Vec<RowName>, n: u64) {
        self.samples += n;
        let mut seen: Vec<RowName> = Vec::new();
        for f in callers {
            if f != leaf && !seen.contains(&f) {
                seen.push(f);
            }
        }
        for f in seen {
            self.rows.entry(f).or_default().1 += n;
        }
        let row = self.rows.entry(leaf).or_default();
        row.0 += n;
        row.1 += n;
    }

    /// The `top` hottest rows, as percentages of the samples: by children (with call graphs),
    /// by samples, then by name.
    fn ranked(self, call_graph: bool, top: usize) -> Vec<Row> {
        let total = self.samples;
        let pct = |n: u64| {
            if total == 0 {
                0.0
            } else {
                100.0 * n as f64 / total as f64
            }
        };
        let mut rows: Vec<Row> = self
            .rows
            .into_iter()
            .map(|((name, module, process), (samples, children))| Row {
                name,
                module,
                process,
                samples,
                percent: pct(samples),
                children,
                children_percent: pct(children),
            })
            .collect();
        rows.sort_by(|a, b| {
            let by_children = if call_graph {
                b.children.cmp(&a.children)
            } else {
                std::cmp::Ordering::Equal
            };
            by_children
                .then_with(|| b.samples.cmp(&a.samples))
                .then_with(|| a.name.cmp(&b.name))
                .then_with(|| a.module.cmp(&b.module))
                .then_with(|| a.process.cmp(&b.process))
        });
        rows.truncate(top);
        rows
    }
}

/// `n` with its digits grouped by three (`1,234,567`).
pub fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvprof_samplelog::{BlockHeader, Header, SampleKind};

    const HZ: u64 = 1_000_000;

    /// Names by number only.
    struct Plain;

    impl Names for Plain {
        fn vm_name(&self, vm: u16) -> String {
            format!("vm{vm}")
        }
        fn guest_function(
            &self,
            _: u16,
            _: bool,
            addr: u64,
            _: u64,
            _: Option<&str>,
        ) -> (String, String) {
            (format!("{addr:#x}"), String::new())
        }
        fn hypervisor_function(&self, addr: u64) -> String {
            format!("{addr:#x}")
        }
    }

    fn live(window: u64) -> Live {
        let mut l = Live::new(window);
        let header = Header {
            tsc_hz: HZ,
            ..Header::default()
        };
        l.push(Item::Header {
            offset: 0,
            header: &header,
        });
        l
    }

    fn feed(l: &mut Live, seq: u64, records: &[Record]) {
        l.push(Item::Block {
            offset: 0,
            frames: &[],
            header: BlockHeader {
                pcpu: 0,
                seq,
                first_sample: 0,
                first_event: 0,
                ring_drops: 0,
                period_ticks: HZ,
            },
            records,
        });
    }

    fn idle_at(tsc: u64) -> Record {
        Record::Sample(Sample {
            tsc,
            kind: SampleKind::Idle,
            vm: hvprof_samplelog::NO_VM,
            ..Sample::default()
        })
    }

    fn event(tsc: u64, kind: EventKind, reason: OutReason) -> Record {
        Record::Event(Event {
            tsc,
            kind,
            vm: 0,
            vcpu: 0,
            reason,
        })
    }

    /// One sample in the middle of each second 0..20 with a 10 s window: the last ten remain,
    /// over 9.5 s; then a sample at 25.5 s leaves those of seconds 16..=19 and itself. The
    /// vCPU halted at 2..3 s (gone) and from 8 s on (before the window, still out): idle the
    /// whole window.
    #[test]
    fn the_window_forgets_what_is_older_than_n_seconds() {
        let mut l = live(10);
        let mut records: Vec<Record> = (0..20).map(|k| idle_at(k * HZ + HZ / 2)).collect();
        records.insert(2, event(2 * HZ, EventKind::VcpuOut, OutReason::Halted));
        records.insert(4, event(3 * HZ, EventKind::VcpuIn, OutReason::Preempted));
        records.insert(10, event(8 * HZ, EventKind::VcpuOut, OutReason::Halted));
        feed(&mut l, 0, &records);
        let s = l.snapshot(&Plain, 10);
        assert_eq!(s.samples, 10);
        assert_eq!(s.host[0].samples, 10);
        assert!((s.span - 9.5).abs() < 1e-9, "{}", s.span);
        assert!((s.elapsed - 19.0).abs() < 1e-9, "from 0.5 s to 19.5 s");
        assert!((s.rate - 10.0 / 9.5).abs() < 1e-9);
        assert_eq!(s.vcpus.len(), 1);
        assert_eq!(s.vcpus[0].idle, 1.0);
        assert_eq!(s.vcpus[0].running, 0.0);
        // Late: a sample older than the window counts in the totals only.
        feed(&mut l, 1, &[idle_at(HZ / 4), idle_at(25 * HZ + HZ / 2)]);
        let s = l.snapshot(&Plain, 10);
        assert_eq!(s.samples, 5);
        assert!((s.span - 9.5).abs() < 1e-9);
        assert_eq!(s.totals.samples, 22);
        // Back in at 24 s: halted 8.0 of the 9.5 s, running 1.5.
        feed(
            &mut l,
            2,
            &[event(24 * HZ, EventKind::VcpuIn, OutReason::Preempted)],
        );
        let s = l.snapshot(&Plain, 10);
        assert!((s.vcpus[0].idle - 8.0 / 9.5).abs() < 1e-9);
        assert!((s.vcpus[0].running - 1.5 / 9.5).abs() < 1e-9);
        assert_eq!(s.vcpus[0].steal, 0.0);
    }

    /// Three VMs take turns on pCPU 0 in slices of 0.1 s for 6 s; a sample each slice. In a
    /// 10 s window each VM's steal is held half by each of the other two, exactly from the
    /// events.
    #[test]
    fn steal_is_split_by_who_held_the_pcpu() {
        let mut l = live(10);
        let at = |vm: u16, tsc: u64, kind: EventKind| {
            Record::Event(Event {
                tsc,
                kind,
                vm,
                vcpu: 0,
                reason: OutReason::Preempted,
            })
        };
        let mut records = Vec::new();
        for slice in 0..60u64 {
            let vm = (slice % 3) as u16;
            let t = slice * HZ / 10;
            records.push(at(vm, t, EventKind::VcpuIn));
            records.push(idle_at(t + HZ / 20));
            records.push(at(vm, t + HZ / 10, EventKind::VcpuOut));
        }
        feed(&mut l, 0, &records);
        let s = l.snapshot(&Plain, 10);
        for v in &s.vcpus {
            // Two slices of three out, less those before its first event.
            assert!((v.steal - 2.0 / 3.0).abs() < 0.04, "{v:?}");
            let held: f64 = v.steal_by.iter().map(|(_, f)| f).sum();
            assert!(
                (held - v.steal).abs() < 1e-9,
                "no gap between slices: {v:?}"
            );
            let others: Vec<String> = (0..3u16)
                .filter(|o| *o != v.vm)
                .map(|o| format!("vm{o}"))
                .collect();
            assert_eq!(v.steal_by.len(), 2, "{v:?}");
            for (name, f) in &v.steal_by {
                assert!(others.contains(name), "{v:?}");
                assert!((f - v.steal / 2.0).abs() < 0.02, "{v:?}");
            }
        }
    }

    /// A Linux guest's samples are classified as every command classifies them: by the task
    /// their vCPU ran at their time, from the task frames received so far. Its functions are
    /// rows per process; a VM without task frames has no process. Task changes older than the
    /// window are forgotten, the last one before it kept.
    #[test]
    fn a_linux_guests_rows_are_per_process() {
        use hvprof_samplelog::{FixedStr, Task, guest_mode};
        let mut l = live(2);
        let task = |tsc: u64, pid: u32, comm: &str| Task {
            tsc,
            vm: 0,
            vcpu: 0,
            pid,
            tgid: pid,
            comm: FixedStr::truncated(comm),
            ..Task::default()
        };
        let user_at = |vm: u16, tsc: u64| {
            Record::Sample(Sample {
                tsc,
                kind: SampleKind::Guest,
                vm,
                guest_mode: guest_mode(3, 2),
                guest_rip: 0x1000,
                guest_cr3: 0x5000,
                ..Sample::default()
            })
        };
        // Task a from 0, three samples in it; task b from 0.5 s, two; VM 1 has no tasks.
        l.push(Item::Task {
            offset: 0,
            task: task(0, 10, "a"),
        });
        feed(
            &mut l,
            0,
            &[
                user_at(0, 1000),
                user_at(0, 2000),
                user_at(0, 3000),
                user_at(1, 0),
            ],
        );
        l.push(Item::Task {
            offset: 0,
            task: task(HZ / 2, 20, "b"),
        });
        feed(
            &mut l,
            1,
            &[
                user_at(0, HZ / 2),
                user_at(0, HZ / 2 + 1000),
                user_at(1, HZ / 2),
            ],
        );
        let s = l.snapshot(&Plain, 10);
        let rows = |s: &Snapshot, vm: usize| -> Vec<(Option<String>, u64)> {
            s.vms[vm]
                .rows
                .iter()
                .map(|r| (r.process.clone(), r.samples))
                .collect()
        };
        assert_eq!(
            rows(&s, 0),
            [(Some("a[10]".to_owned()), 3), (Some("b[20]".to_owned()), 2)]
        );
        assert_eq!(rows(&s, 1), [(None, 2)]);
        // Three seconds on: the window holds 2..3 s, whose samples ran b, the last task before it.
        feed(&mut l, 2, &[user_at(0, 3 * HZ + HZ / 5)]);
        assert_eq!(l.processes.label(ProcessKey::Task(1)), Some("b[20]"));
        let s = l.snapshot(&Plain, 10);
        assert_eq!(rows(&s, 0), [(Some("b[20]".to_owned()), 1)]);
    }

    /// Losses are the sequence gaps so far; a duplicate counts once; the end frame adds what
    /// followed the last block received.
    #[test]
    fn losses_are_counted_as_blocks_arrive() {
        let mut st = StreamStats::new();
        let rec = [idle_at(1), idle_at(2)];
        let block = |seq: u64| BlockHeader {
            pcpu: 3,
            seq,
            first_sample: 2 * seq,
            first_event: 0,
            ring_drops: seq,
            period_ticks: 1,
        };
        for seq in [0, 2, 2, 3] {
            st.push(&Item::Block {
                offset: 0,
                header: block(seq),
                records: &rec,
                frames: &[],
            });
        }
        let t = st.totals();
        assert_eq!((t.frames, t.samples), (4, 6));
        assert_eq!((t.blocks_lost, t.samples_lost, t.ring_drops), (1, 2, 3));
        assert!(!t.end_seen);
        let totals = [PcpuTotals {
            pcpu: 3,
            samples: 12,
            events: 1,
            ring_drops: 9,
            blocks: 6,
        }];
        st.push(&Item::End {
            offset: 0,
            totals: &totals,
        });
        let t = st.totals();
        assert_eq!((t.blocks_lost, t.samples_lost, t.events_lost), (3, 6, 1));
        assert_eq!(t.ring_drops, 9);
        assert!(t.end_seen);
        assert_eq!(grouped(1_234_567), "1,234,567");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(0), "0");
    }
}
