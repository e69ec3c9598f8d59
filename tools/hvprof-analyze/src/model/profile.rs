//! Every sample of a capture, named: the model the charts and the export formats are drawn from,
//! with the report built from the same decoding (so their totals agree by construction).
//!
//! A sample's frame is four names, outermost first: the VM, the process, the module, the
//! function. Guest samples: `guestOS1; cr3:0x1000 (or comm[tgid]); mix1.elf; work_a`.
//! Hypervisor samples: `[hypervisor]; <VM>: <exit reason> (or "no VM"); hvprof; <function>`.
//! Idle samples: `[idle]` alone.
//!
//! Samples with call chains (format 3) keep them in their key: each distinct pair of chains
//! (the hypervisor's frames, the guest's, and how each walk ended) is numbered once
//! ([`Samples::chain`]), so memory grows with the distinct stacks, not the samples. Their frames
//! are named once per distinct address and context ([`Calls`]): a return address as the call
//! instruction before it (`addr - 1`, as perf does), in the symbols of the sample's leaf (the
//! hypervisor's for host frames; the VM's image, Linux kernel or process for guest frames; for a
//! hypervisor sample on a vCPU's exit, its guest frames in that vCPU's context, the first being
//! the guest RIP at the exit, named as it is).

use std::hash::BuildHasher;
use std::sync::Arc;

use anyhow::Result;
use rustc_hash::FxHashMap as HashMap;

pub use hvprof_samplelog::ChainEnd;
use hvprof_samplelog::{
    BlockAt, BlockReader, Chain, Decoded, Event, NO_VM, Record, Sample, SampleKind,
};

pub use crate::model::calls::Calls;
use crate::model::capture::Capture;
use crate::model::cost::WholeCost;
use crate::model::integrity::Integrity;
use crate::model::losses::{LossRange, Lost, losses};
use crate::model::merge::{merge_all, sort_events};
use crate::model::progress::Progress;
use crate::model::stack_table::{self, StackTable};
use crate::model::timeline::Blanks;
use crate::model::timeline::{Owner, Segment, Segments};
use crate::model::window::TimeRange;
use crate::model::window::Window;
use crate::naming::namer::{Namer, ProcessKey, Processes, TaskMemo, VmMeta, exit_name};
use crate::naming::symbols::{Images, hex};

/// What a pCPU was doing at a sample. (`Idle` stays last: a table by `What` has
/// `What::Idle as usize + 1` entries.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum What {
    GuestKernel,
    GuestUser,
    Hypervisor,
    Idle,
}

/// One sample, whole (made on the fly from its [`Slot`] and [`Stack`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sampled {
    pub tsc: u64,
    /// The guest CR3 (guest samples, and hypervisor samples with an exit-cause chain; 0 for
    /// the others).
    pub cr3: u64,
    /// The sampled address: guest RIP, or hypervisor RIP.
    pub addr: u64,
    /// Index into `Profile::frames`.
    pub frame: u32,
    /// Index into `Samples::stacks`.
    pub stack: u32,
    pub pcpu: u16,
    /// `NO_VM` for the hypervisor's work for no VM, and idle.
    pub vm: u16,
    pub vcpu: u16,
    /// The vCPU's last exit reason (`NO_EXIT` when none): hypervisor samples; 0 for the others.
    pub exit: u16,
    pub what: What,
}

impl Sampled {
    pub fn owner(&self) -> Owner {
        owner(self.what, self.vm, self.vcpu)
    }
}

/// Who a sample of `what` on `vm`'s `vcpu` belongs to on the common time axis.
fn owner(what: What, vm: u16, vcpu: u16) -> Owner {
    match what {
        What::GuestKernel | What::GuestUser => Owner::Guest { vm, vcpu },
        What::Hypervisor => Owner::Hypervisor { vm, vcpu },
        What::Idle => Owner::Idle,
    }
}

/// A named frame: VM, process, module, function (outermost first).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    pub what: What,
    pub vm: String,
    pub process: String,
    pub module: String,
    pub function: String,
    /// The guest process's identity, for labels (guest frames).
    pub process_key: Option<ProcessKey>,
}

impl Frame {
    /// A frame with no names (no memory of its own): a slot to be filled, or the base of one.
    fn placeholder() -> Frame {
        Frame {
            what: What::Idle,
            vm: String::new(),
            process: String::new(),
            module: String::new(),
            function: String::new(),
            process_key: None,
        }
    }
}

/// The label of the hypervisor's "process" frame: whom it worked for, and on which exit.
pub fn hypervisor_label(vm_name: Option<&str>, exit: u16) -> String {
    match vm_name {
        None => "no VM".to_owned(),
        Some(name) => format!("{name}: {}", exit_name(exit)),
    }
}

impl Frame {
    /// The frame's names, outermost first, without the empty ones.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        [
            self.vm.as_str(),
            self.process.as_str(),
            self.module.as_str(),
            self.function.as_str(),
        ]
        .into_iter()
        .filter(|s| !s.is_empty())
    }

    /// The folded stack (`VM;process;module;function`), with `;` in names made `,` (Rust generic
    /// arrays `[u8; 4]` would split a frame).
    pub fn folded(&self) -> String {
        let mut out = String::new();
        for (i, n) in self.names().enumerate() {
            if i > 0 {
                out.push(';');
            }
            // One string, not one per name (a flame graph folds every frame).
            for (j, part) in n.split(';').enumerate() {
                if j > 0 {
                    out.push(',');
                }
                out.push_str(part);
            }
        }
        out
    }
}

/// A distinct sample, all but its time: what every view reads from a sample. Samples with
/// equal fields share one `Stack`, and the profile keeps each sample as its TSC and the index
/// of its stack ([`Slot`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stack {
    pub what: What,
    pub pcpu: u16,
    pub vm: u16,
    pub vcpu: u16,
    /// Hypervisor samples: the vCPU's last exit reason (`NO_EXIT` when none); 0 for the others.
    pub exit: u16,
    /// The sampled address: guest RIP, or hypervisor RIP.
    pub addr: u64,
    /// Guest samples, and hypervisor samples with an exit-cause chain: the guest CR3; 0 for
    /// the others.
    pub cr3: u64,
    /// The guest process (guest samples, and hypervisor samples with an exit-cause chain): its
    /// task where the log names it, else its CR3.
    pub process: Option<ProcessKey>,
    /// Index into `Profile::frames`.
    pub frame: u32,
    /// A hypervisor sample taken while the hypervisor handled a vCPU's exit, whose guest chain
    /// was walked: the guest code path at that exit (the exit's RIP, then its callers).
    pub exit_cause: bool,
    /// Its call chains as the capture gives them: see [`Samples::chain`] (0: none).
    pub chain: u32,
    /// Its call chains named: index into `Profile::calls.stacks` (0: none, or not named).
    pub calls: u32,
    /// Samples of this stack.
    pub count: u64,
}

/// A capture's distinct samples ([`Stack`]s, each with its count), how many samples there are
/// and the TSC of the first and last. Memory grows with the distinct stacks, not the samples;
/// the samples themselves are read again, in TSC order, by [`Profile::replay`].
#[derive(Debug, Default)]
pub struct Samples {
    stacks: Vec<Stack>,
    /// The distinct call chains, packed (see [`pack_chains`]); `chains[i]` is chain `i + 1`.
    chains: Vec<Arc<[u64]>>,
    len: usize,
    /// (first, last) sample TSC; (0, 0) without samples.
    span: (u64, u64),
}

/// A sample's call chains as the capture gives them: the hypervisor's frames and the guest's,
/// innermost first (return addresses; at an exit-cause sample the guest's first frame is the
/// guest RIP at the exit), and how each walk ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawChains<'a> {
    /// The hypervisor's frames.
    pub host: &'a [u64],
    /// How the hypervisor's walk ended.
    pub host_end: ChainEnd,
    /// The guest's frames.
    pub guest: &'a [u64],
    /// How the guest's walk ended.
    pub guest_end: ChainEnd,
}

/// A sample's chains packed as one list, the key of the chain table: a word with the ends and
/// the host frames' number (`host_end | guest_end << 8 | host_len << 16`), the host frames,
/// the guest frames. Clears `out` first.
fn pack_chains(s: &Sample, host: &[u64], guest: &[u64], out: &mut Vec<u64>) {
    out.clear();
    out.push(
        s.host_chain.end() as u64 | (s.guest_chain.end() as u64) << 8 | (host.len() as u64) << 16,
    );
    out.extend_from_slice(host);
    out.extend_from_slice(guest);
}

/// A packed chain (see [`pack_chains`]) read back.
fn unpack_chains(packed: &[u64]) -> RawChains<'_> {
    let (head, frames) = packed.split_first().map_or((0, &[][..]), |(h, f)| (*h, f));
    let host_len = ((head >> 16) as usize).min(frames.len());
    RawChains {
        host: &frames[..host_len],
        host_end: ChainEnd::from_u8((head & 3) as u8),
        guest: &frames[host_len..],
        guest_end: ChainEnd::from_u8((head >> 8 & 3) as u8),
    }
}

/// Walks a block's frame list beside its samples: each sample's chains, packed.
struct ChainCursor<'a> {
    frames: &'a [u64],
    at: usize,
}

impl<'a> ChainCursor<'a> {
    fn new(frames: &'a [u64]) -> Self {
        ChainCursor { frames, at: 0 }
    }

    /// The next sample's chains packed in `out`; false (and nothing read) when it has none
    /// (neither chain walked, no frame).
    #[inline]
    fn next(&mut self, s: &Sample, out: &mut Vec<u64>) -> bool {
        if !has_chains(s) {
            return false;
        }
        self.read(s, out);
        true
    }

    /// Steps over a sample's chains unread (a sample left out by `--time`).
    fn skip(&mut self, s: &Sample) {
        self.at = self
            .at
            .saturating_add(s.host_chain.depth() + s.guest_chain.depth());
    }

    /// Reads a sample's chains (see [`ChainCursor::next`]).
    #[inline(never)]
    fn read(&mut self, s: &Sample, out: &mut Vec<u64>) {
        let mut take = |n: usize| {
            let from = self.at.min(self.frames.len());
            let to = self.at.saturating_add(n).min(self.frames.len());
            self.at = self.at.saturating_add(n);
            &self.frames[from..to]
        };
        let host = take(s.host_chain.depth());
        let guest = take(s.guest_chain.depth());
        pack_chains(s, host, guest, out);
    }
}

/// Whether a sample has call chains (either walked).
#[inline(always)]
fn has_chains(s: &Sample) -> bool {
    s.host_chain != Chain::NOT_WALKED || s.guest_chain != Chain::NOT_WALKED
}

/// The distinct chains, numbered from 1 in the order first seen (0: a sample without chains).
#[derive(Debug, Default)]
struct ChainIds {
    ids: HashMap<Arc<[u64]>, u32>,
    list: Vec<Arc<[u64]>>,
}

impl ChainIds {
    fn id(&mut self, packed: &[u64]) -> u32 {
        if let Some(&i) = self.ids.get(packed) {
            return i;
        }
        let a: Arc<[u64]> = packed.into();
        self.list.push(a.clone());
        let id = self.list.len() as u32;
        self.ids.insert(a, id);
        id
    }

    fn get(&self, packed: &[u64]) -> Option<u32> {
        self.ids.get(packed).copied()
    }
}

impl Samples {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The distinct stacks, each with its count.
    pub fn stacks(&self) -> &[Stack] {
        &self.stacks
    }

    /// The call chains `Stack::chain` numbers (`None` for 0, a sample without chains).
    pub fn chain(&self, id: u32) -> Option<RawChains<'_>> {
        let i = (id as usize).checked_sub(1)?;
        self.chains.get(i).map(|c| unpack_chains(c))
    }

    /// Whether any sample has call chains.
    pub fn has_chains(&self) -> bool {
        !self.chains.is_empty()
    }

    /// First and last sample TSC (0, 0 without samples).
    pub fn span(&self) -> (u64, u64) {
        self.span
    }

    /// A sample whole, from its TSC and stack.
    pub fn sampled(&self, tsc: u64, stack: u32) -> Sampled {
        let s = &self.stacks[stack as usize];
        Sampled {
            tsc,
            cr3: s.cr3,
            addr: s.addr,
            frame: s.frame,
            stack,
            pcpu: s.pcpu,
            vm: s.vm,
            vcpu: s.vcpu,
            exit: s.exit,
            what: s.what,
        }
    }
}

/// A whole capture, named.
pub struct Profile {
    pub tsc_hz: u64,
    pub period_ticks: u64,
    pub pcpus: u16,
    pub vms: Vec<VmMeta>,
    /// The distinct samples, with their counts.
    pub samples: Samples,
    pub frames: Vec<Frame>,
    /// The call chains' frames, named (empty for a capture without chains, and for the report
    /// alone: `LoadOptions::report_only`).
    pub calls: Calls,
    /// Every scheduling event with its pCPU, in TSC order (in stream order for a profile
    /// loaded for the report alone: `LoadOptions::report_only`, which reads them only to
    /// build the report).
    pub events: Vec<(u16, Event)>,
    /// The console text of the capture (shown, never read for data).
    pub text: String,
    /// The VM end frames: exit tables, LSTAR, task offsets.
    pub vm_ends: Vec<hvprof_samplelog::VmEnd>,
    /// The frames found in the capture, whole (0: no hvprof frame at all, whatever the file is).
    pub frames_found: u64,
    /// The sample source the header names: `deadline` or `pmu`.
    pub source: &'static str,
    /// The hypervisor's build id in the header, in hex.
    pub hypervisor_build_id: String,
    /// Whether the `--hypervisor` ELF has that build id (`None` without one).
    pub hypervisor_build_id_matches: Option<bool>,
    /// What the capture lost, in all.
    pub lost: Lost,
    /// Where records are missing, per pCPU, in host time.
    pub losses: Vec<LossRange>,
    /// Signs of a forged or damaged capture.
    pub integrity: Integrity,
    /// The sample path's cost over the samples.
    pub cost: CostSum,
    /// The profiler's whole cost, from the hypervisor's cost frames (`None` without them).
    pub whole_cost: Option<WholeCost>,
    /// Warnings for the reader: first where records were lost, then signs of a forged log
    /// (`integrity`), then missing symbols, mismatched build ids, truncation.
    pub warnings: Vec<String>,
    /// The stretch of host time shown (`--time START,END`), when not the whole run.
    pub time: Option<TimeRange>,
    /// Each vCPU's blank slots (`[idle]`, `[steal]`) on the common time axis, counted from the
    /// scheduling events ([`crate::model::timeline::segment_blanks`]): with
    /// [`LoadOptions::tables`], when the capture has events (`None` otherwise).
    pub blanks: Option<HashMap<(u16, u16), Blanks>>,
    /// What reads the samples again in order: the capture and where its blocks are.
    replay: Replay,
}

/// How a capture is read. `keep_guest` names Linux guests' samples by process in the report
/// (the command line always asks for it, as the other views always do; without it the report
/// names them by address). `tables` builds the report's tables
/// (host level, each VM's and vCPU's, with `[steal]` and `[idle]` on the common time axis);
/// without it (the exports) the report has its totals, losses and warnings only.
/// `report_only` names only the stacks the report reads (the hypervisor's, and Linux guests'
/// with `keep_guest`; the report names the others by address): the others' frame is a
/// placeholder, and the events are left in stream order, so the profile is for the report
/// alone.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    pub threads: usize,
    pub keep_guest: bool,
    pub tables: bool,
    pub report_only: bool,
    /// Only the samples of this stretch of host time (`--time`, [`crate::model::window`]).
    pub time: Option<crate::model::window::TimeRange>,
    /// Only the first rows of each guest table of the report (the text report shows no more;
    /// the others are counted, and only the rows kept are named): `None` for every row.
    pub top_rows: Option<usize>,
    /// Keep each sample's TSC and stack from the first pass (8 bytes a sample), so that the
    /// views that read the samples again in TSC order ([`Profile::replay`]) copy them instead
    /// of decoding the capture again: for the Firefox profile, which holds every sample anyway.
    pub keep_samples: bool,
}

impl LoadOptions {
    /// Every view's data on `threads` threads, the whole capture, guest processes by address
    /// space.
    #[must_use]
    pub const fn all(threads: usize) -> LoadOptions {
        LoadOptions {
            threads,
            keep_guest: false,
            tables: true,
            report_only: false,
            time: None,
            top_rows: None,
            keep_samples: false,
        }
    }
}

/// A sample classified, before naming: the fields of [`Stack`] the records give, and its
/// process (guest samples).
/// A hypervisor sample whose key has a process is an exit cause (see [`exit_cause`]). Its
/// chains' number is beside it (in `KeyCounts`, `StackIndex::ids`); its context is the key
/// without its address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key {
    addr: u64,
    cr3: u64,
    process: Option<ProcessKey>,
    pcpu: u16,
    vm: u16,
    vcpu: u16,
    exit: u16,
    what: What,
}

/// Every field, as four words: a context is looked up for about one sample in six (the
/// derived hash wrote each field on its own, nine writes).
impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        let (tag, process) = match self.process {
            None => (0, 0),
            Some(ProcessKey::Task(t)) => (1, u64::from(t)),
            Some(ProcessKey::Cr3(c)) => (2, c),
        };
        h.write_u64(self.addr);
        h.write_u64(self.cr3 ^ process.rotate_left(32));
        h.write_u64(
            u64::from(self.pcpu)
                | u64::from(self.vm) << 16
                | u64::from(self.vcpu) << 32
                | u64::from(self.exit) << 48,
        );
        h.write_u64(tag | (self.what as u64) << 8);
    }
}

impl Key {
    /// The key without its address.
    #[inline]
    fn context(&self) -> Key {
        Key { addr: 0, ..*self }
    }

    /// Whether it is a hypervisor sample's on a vCPU's exit, with the exit's guest chain.
    fn exit_cause(&self) -> bool {
        self.what == What::Hypervisor && self.process.is_some()
    }
}

/// The one classification of a sample: what it is, which address names it, and (guest
/// samples) who ran: with `processes`, a Linux guest's task at the sample's time. A sample
/// with chains has more: see [`exit_cause`].
///
/// Always inlined: called, it returns the key through memory, which the caller then reads
/// back in other widths (its context, the comparison with the last one), a store-forwarding
/// stall per sample (about 6 % of the first pass on 10 M samples).
#[inline(always)]
fn classify(pcpu: u16, s: &Sample, processes: Option<&Processes>, memo: &mut TaskMemo) -> Key {
    let (what, addr) = match s.kind {
        SampleKind::Guest if s.cpl() == 3 => (What::GuestUser, s.guest_rip),
        SampleKind::Guest => (What::GuestKernel, s.guest_rip),
        SampleKind::Hypervisor => (What::Hypervisor, s.host_rip),
        SampleKind::Idle => (What::Idle, s.host_rip),
    };
    let guest = is_guest(what);
    let process = guest.then(|| process(s, processes, memo));
    Key {
        addr,
        cr3: if guest { s.guest_cr3 } else { 0 },
        process,
        pcpu,
        vm: s.vm,
        vcpu: s.vcpu,
        exit: if what == What::Hypervisor {
            s.exit_reason
        } else {
            0
        },
        what,
    }
}

/// Who ran in the guest at a sample.
#[inline]
fn process(s: &Sample, processes: Option<&Processes>, memo: &mut TaskMemo) -> ProcessKey {
    match processes {
        Some(p) => p.key_memo(memo, s.vm, s.vcpu, s.tsc, s.guest_cr3),
        None => ProcessKey::Cr3(s.guest_cr3),
    }
}

/// A sample with chains of kind `what` is an exit cause when it is the hypervisor's on a
/// vCPU's exit and that vCPU's guest chain was walked: its key gets the guest context that
/// names that chain, the guest CR3 and process (returned).
#[inline]
fn exit_cause(
    what: What,
    s: &Sample,
    processes: Option<&Processes>,
    memo: &mut TaskMemo,
) -> Option<(u64, ProcessKey)> {
    (what == What::Hypervisor && s.vm != NO_VM && s.guest_chain != Chain::NOT_WALKED)
        .then(|| (s.guest_cr3, process(s, processes, memo)))
}

/// The sample path's cost over the samples: sum, min, max (TSC ticks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CostSum {
    pub sum: u64,
    pub min: u64,
    pub max: u64,
}

impl Default for CostSum {
    fn default() -> Self {
        CostSum {
            sum: 0,
            min: u64::MAX,
            max: 0,
        }
    }
}

impl CostSum {
    /// One more sample path's cost.
    #[inline]
    fn add(&mut self, cost: u64) {
        self.sum = self.sum.saturating_add(cost);
        self.min = self.min.min(cost);
        self.max = self.max.max(cost);
    }

    fn merge(&mut self, o: CostSum) {
        self.sum = self.sum.saturating_add(o.sum);
        self.min = self.min.min(o.min);
        self.max = self.max.max(o.max);
    }
}

/// Finds a key's stack in two steps, so that the per-sample table stays small (it is the one
/// random access per sample): its context (all but the address, with its chains' number;
/// consecutive samples mostly share it), then (address, context).
#[derive(Debug, Default)]
struct StackIndex {
    contexts: HashMap<(Key, u32), u32>,
    /// (address, context) → (stack, its samples): one random access per sample, which the
    /// loops over a block's samples prefetch for the whole block before they look up any.
    ids: StackTable,
    /// The distinct call chains (samples with chains look theirs up first).
    chains: ChainIds,
}

/// Where a block's samples are, for the second pass: its pCPU, its frame's offset, its
/// samples' first and last TSC, whether they are in TSC order.
#[derive(Debug, Clone, Copy)]
struct BlockSpan {
    pcpu: u16,
    offset: u64,
    first: u64,
    last: u64,
    samples: u32,
    sorted: bool,
    /// Where the first pass kept its samples (see [`Kept`]): the decoding thread's number and
    /// the first one's place in its list; `None` when not kept.
    kept: Option<(u32, u32)>,
}

/// Each sample of a decoding thread as the first pass classified it, for a view that reads
/// them all again ([`LoadOptions::keep_samples`]): its TSC as an offset from its block's first
/// and its key's number, 8 bytes a sample, so that [`Replay::block`] copies them instead of
/// decoding and classifying the block again. A block whose samples span more than 2^32 ticks
/// is not kept (it is read again).
#[derive(Debug, Default)]
struct Kept {
    samples: Vec<(u32, u32)>,
    /// The block being classified: each sample's TSC and its run in [`Part::pending`].
    block: Vec<(u64, u32)>,
    /// The key of each run of the block.
    ids: Vec<u32>,
}

/// The samples a decoding thread kept ([`Kept::samples`]) and its keys' numbers in the
/// capture's table, by the thread's number (none for the first thread's, whose table it is).
#[derive(Debug, Default)]
struct KeptPart {
    samples: Vec<(u32, u32)>,
    remap: Vec<u32>,
}

/// Where a segment's first sample is: in the block whose frame is at `offset`, after `skip`
/// samples of it; or (a pCPU out of TSC order) at `skip` in its sorted list.
#[derive(Debug, Clone, Copy)]
struct Located {
    offset: u64,
    skip: u32,
}

/// The owners, and per pCPU its samples' owners as segments in stream order with where each
/// starts: the first pass's time axis.
type StreamSegments = (OwnerIds, Vec<(u16, Vec<Segment>, Vec<Located>)>);

/// Owners numbered in the order they are first seen.
#[derive(Default)]
struct OwnerIds {
    ids: HashMap<Owner, u32>,
    list: Vec<Owner>,
}

impl OwnerIds {
    fn id(&mut self, owner: Owner) -> u32 {
        let list = &mut self.list;
        *self.ids.entry(owner).or_insert_with(|| {
            list.push(owner);
            (list.len() - 1) as u32
        })
    }
}

/// Per pCPU, its samples' owners as segments in stream order, with where each starts.
#[derive(Default)]
struct PartSegments {
    owners: OwnerIds,
    lists: HashMap<u16, (Vec<Segment>, Vec<Located>)>,
}

/// The distinct keys a decoding thread found, with their samples (in `index.ids`). A key is
/// its address and its context (the key without its address, with its chains' number): the
/// table holds both, so the keys are not listed beside it (a list that grows with the keys,
/// in fresh memory, while the table does too).
#[derive(Default)]
struct KeyCounts {
    index: StackIndex,
    /// The contexts by number (`index.contexts` the other way).
    contexts: Vec<(Key, u32)>,
    /// The keys so far (numbered in the order first added).
    len: u32,
}

impl KeyCounts {
    /// The index of a context (a key without its address).
    fn context(&mut self, context: (Key, u32)) -> u32 {
        let next = self.contexts.len() as u32;
        let list = &mut self.contexts;
        *self.index.contexts.entry(context).or_insert_with(|| {
            list.push(context);
            next
        })
    }

    /// Adds `n` samples of the key at `addr` in context `ctx`; returns the key's index.
    #[cfg(test)]
    fn add(&mut self, addr: u64, ctx: u32, n: u64) -> u32 {
        self.add_hashed(addr, ctx, stack_table::hash(addr, ctx), n)
    }

    /// Adds `n` samples of the key at `addr` in context `ctx`, whose hash is `hash`; returns
    /// the key's index.
    #[inline]
    fn add_hashed(&mut self, addr: u64, ctx: u32, hash: u64, n: u64) -> u32 {
        let (id, new) = self.index.ids.add(hash, addr, ctx, n, self.len);
        if new {
            self.len += 1;
        }
        id
    }

    /// Each key (address, context) with its samples, by key index.
    fn entries(&self) -> Vec<(u64, u32, u64)> {
        let mut out = vec![(0, 0, 0); self.len as usize];
        for (addr, ctx, id, n) in self.index.ids.iter() {
            out[id as usize] = (addr, ctx, n);
        }
        out
    }

    /// The key at `addr` in context `ctx`, and its chains' number.
    fn key(&self, addr: u64, ctx: u32) -> (Key, u32) {
        let (k, chain) = self.contexts[ctx as usize];
        (Key { addr, ..k }, chain)
    }
}

/// Keys of another part added to the first part's table at a time (see [`Classified::merge`]).
const MERGE_BATCH: usize = 64;

/// What one decoding thread classified: its distinct keys with their counts, the blocks it
/// read, its samples' owners as segments, the scheduling events, the cost.
struct Part {
    /// Whether the samples' owners are kept as segments (the report's time axis; the exports
    /// read none).
    keep_segments: bool,
    /// Its keys with their counts (and its kept samples).
    keys: PartKeys,
    /// Its samples in time: segments, blocks, events, cost, span.
    times: PartTimes,
    /// The block's samples classified, to be counted once their slots are prefetched.
    pending: Vec<Pending>,
    chain_scratch: ChainScratch,
    /// The task the last guest sample's vCPU ran, and until when.
    task_memo: TaskMemo,
    /// The stretch of host time whose samples count (`--time`).
    window: Window,
    /// Records decoded and not yet told to the progress bar.
    unreported: u64,
}

impl Default for Part {
    fn default() -> Part {
        Part {
            keep_segments: true,
            keys: PartKeys::default(),
            times: PartTimes::default(),
            pending: Vec::new(),
            chain_scratch: ChainScratch::default(),
            task_memo: TaskMemo::default(),
            window: Window::ALL,
            unreported: 0,
        }
    }
}

/// The chains of the sample being classified, and of the one before it (with its number).
#[derive(Default)]
struct ChainScratch {
    packed: Vec<u64>,
    last: (Vec<u64>, u32),
}

impl ChainScratch {
    /// A sample with chains (of kind `what`): their number in `ids`, read from `cursor`, and
    /// the guest context of its key when it is an exit cause ([`exit_cause`]). Out of line, so
    /// that the loop over a capture without chains stays as it was.
    #[inline(never)]
    fn walked(
        &mut self,
        ids: &mut ChainIds,
        what: What,
        s: &Sample,
        cursor: &mut ChainCursor,
        processes: Option<&Processes>,
        memo: &mut TaskMemo,
    ) -> Walked {
        if !cursor.next(s, &mut self.packed) {
            return Walked::default();
        }
        let chain = if self.last.1 != 0 && self.last.0 == self.packed {
            self.last.1
        } else {
            let id = ids.id(&self.packed);
            std::mem::swap(&mut self.last.0, &mut self.packed);
            self.last.1 = id;
            id
        };
        Walked {
            chain,
            exit_cause: exit_cause(what, s, processes, memo),
        }
    }
}

/// A run of samples of one key classified, to be counted (see [`Part::add`]).
struct Pending {
    addr: u64,
    ctx: u32,
    hash: u64,
    n: u64,
}

/// What [`ChainScratch::walked`] found.
#[derive(Default)]
struct Walked {
    chain: u32,
    /// An exit cause's guest CR3 and process.
    exit_cause: Option<(u64, ProcessKey)>,
}

impl Part {
    /// Classifies and counts a block's samples: classified first, each one's slot in the
    /// stack table prefetched, then counted (so that the table's cache misses overlap).
    fn add(
        &mut self,
        at: BlockAt,
        records: &[Record],
        frames: &[u64],
        processes: Option<&Processes>,
    ) {
        let pcpu = at.header.pcpu;
        let mut cursor = ChainCursor::new(frames);
        let seg = &mut self.times.segments;
        let (segs, located) = seg.lists.entry(pcpu).or_default();
        let tally = &mut self.times.tally;
        // The last context of each kind of sample (guest kernel, guest user, hypervisor,
        // idle) and its index: a pCPU's samples alternate between kinds (a guest sample, the
        // hypervisor's on the next exit), each of which mostly keeps its context.
        let mut last_ctx: [Option<((Key, u32), u32)>; What::Idle as usize + 1] = Default::default();
        let mut last_owner: Option<(Owner, u32)> = None;
        let mut span = BlockSpan {
            pcpu,
            offset: at.offset,
            first: u64::MAX,
            last: 0,
            samples: 0,
            sorted: true,
            kept: None,
        };
        let mut prev = 0u64;
        for r in records {
            let s = match r {
                Record::Sample(s) => s,
                Record::Event(e) => {
                    self.times.events.push((pcpu, *e));
                    continue;
                }
            };
            tally.seen = (tally.seen.0.min(s.tsc), tally.seen.1.max(s.tsc));
            if !self.window.contains(s.tsc) {
                cursor.skip(s);
                continue;
            }
            tally.cost.add(u64::from(s.cost));
            span.sorted &= span.samples == 0 || s.tsc >= prev;
            prev = s.tsc;
            span.samples += 1;
            span.first = span.first.min(s.tsc);
            span.last = span.last.max(s.tsc);
            let mut key = classify(pcpu, s, processes, &mut self.task_memo);
            let mut chain = 0;
            if has_chains(s) {
                let w = self.chain_scratch.walked(
                    &mut self.keys.counts.index.chains,
                    key.what,
                    s,
                    &mut cursor,
                    processes,
                    &mut self.task_memo,
                );
                chain = w.chain;
                if let Some((cr3, process)) = w.exit_cause {
                    key.cr3 = cr3;
                    key.process = Some(process);
                }
            }
            let context = (key.context(), chain);
            let memo = &mut last_ctx[key.what as usize];
            let ctx = match *memo {
                Some((c, i)) if c == context => i,
                _ => {
                    let i = self.keys.counts.context(context);
                    *memo = Some((context, i));
                    i
                }
            };
            match self.pending.last_mut() {
                Some(p) if p.addr == key.addr && p.ctx == ctx => p.n += 1,
                _ => {
                    let hash = stack_table::hash(key.addr, ctx);
                    self.keys.counts.index.ids.prefetch(hash);
                    self.pending.push(Pending {
                        addr: key.addr,
                        ctx,
                        hash,
                        n: 1,
                    });
                }
            }
            if let Some(k) = &mut self.keys.kept {
                k.block.push((s.tsc, (self.pending.len() - 1) as u32));
            }
            if !self.keep_segments {
                continue;
            }
            let owner = owner(key.what, key.vm, key.vcpu);
            let o = match last_owner {
                Some((w, i)) if w == owner => i,
                _ => {
                    let i = seg.owners.id(owner);
                    last_owner = Some((owner, i));
                    i
                }
            };
            let before = segs.len();
            Segments::push_sample(segs, s.tsc, o);
            if segs.len() > before {
                located.push(Located {
                    offset: at.offset,
                    skip: span.samples - 1,
                });
            }
        }
        for p in self.pending.drain(..) {
            let id = self.keys.counts.add_hashed(p.addr, p.ctx, p.hash, p.n);
            if let Some(k) = &mut self.keys.kept {
                k.ids.push(id);
            }
        }
        if let Some(k) = &mut self.keys.kept {
            // Its samples' TSCs as offsets from the first (the part numbers its blocks when
            // the parts are merged).
            if let Ok(at) = u32::try_from(k.samples.len())
                && span.samples > 0
                && span.last - span.first <= u64::from(u32::MAX)
            {
                span.kept = Some((0, at));
                let Kept {
                    samples,
                    block,
                    ids,
                } = k;
                samples.extend(
                    block
                        .iter()
                        .map(|&(tsc, run)| ((tsc - span.first) as u32, ids[run as usize])),
                );
            }
            k.block.clear();
            k.ids.clear();
        }
        if span.samples > 0 {
            tally.len += span.samples as usize;
            tally.first = tally.first.min(span.first);
            tally.last = tally.last.max(span.last);
            self.times.blocks.push(span);
        }
    }
}

/// A capture's samples classified once, before naming: what the report and every view are
/// built from.
pub struct Classified {
    /// Stacks without their frame (`frame` 0) until named.
    pub samples: Samples,
    /// Every scheduling event with its pCPU, in stream order.
    pub events: Vec<(u16, Event)>,
    pub cost: CostSum,
    /// Every sample's owner, as segments per pCPU in stream order, and where each starts.
    segments: StreamSegments,
    index: StackIndex,
    /// Per decoding thread, the samples it kept (none unless [`Keep::samples`]).
    kept: Vec<KeptPart>,
    /// Per pCPU (ascending), its blocks that hold samples, in stream order.
    blocks: Vec<(u16, Vec<BlockSpan>)>,
    /// The TSCs of the first and last sample of the capture (`--time` aside); `None` without.
    seen: Option<(u64, u64)>,
}

/// What the first pass keeps besides the stacks ([`Classified::decode`]).
#[derive(Debug, Clone, Copy)]
pub struct Keep {
    /// The samples' owners as segments per pCPU, for the report's time axis (the exports,
    /// which have no tables, read none).
    pub segments: bool,
    /// Each sample's TSC and stack ([`LoadOptions::keep_samples`]).
    pub samples: bool,
}

/// What [`Classified::merge`] makes one table of: a part's keys, and its kept samples.
#[derive(Default)]
struct PartKeys {
    counts: KeyCounts,
    /// Each sample's TSC and key, when kept ([`LoadOptions::keep_samples`]).
    kept: Option<Kept>,
}

impl PartKeys {
    /// The parts' keys in one table, and the kept samples by part.
    fn merge(parts: Vec<PartKeys>) -> (KeyCounts, Vec<KeptPart>) {
        // The first part's table becomes the capture's (its keys keep their index): the other
        // parts' keys are looked up in it, and the new ones added after its own, in order.
        let mut parts = parts.into_iter();
        let Some(mut base) = parts.next() else {
            return (KeyCounts::default(), Vec::new());
        };
        // The first part's kept samples name their keys as the capture's table does.
        let mut kept: Vec<KeptPart> = Vec::new();
        if let Some(k) = base.kept.take() {
            kept.push(KeptPart {
                samples: k.samples,
                remap: Vec::new(),
            });
        }
        for part in parts {
            // Its chains in the first part's table.
            let chains: Vec<u32> = std::iter::once(0)
                .chain(
                    part.counts
                        .index
                        .chains
                        .list
                        .iter()
                        .map(|c| base.counts.index.chains.id(c)),
                )
                .collect();
            // Its contexts (a few) in the first part's table, each looked up when first met
            // (so the new ones are added in the same order), not once per key.
            let mut contexts: Vec<Option<u32>> = vec![None; part.counts.contexts.len()];
            // Added a few dozen at a time, their slots in the table asked for first (each
            // lookup is a miss to memory: this way they overlap), in key order.
            let mut batch: Vec<(u64, u32, u64, u64)> = Vec::with_capacity(MERGE_BATCH);
            // Its keys' numbers in the first part's table, when its samples are kept.
            let mut key_ids: Vec<u32> = Vec::new();
            for chunk in part.counts.entries().chunks(MERGE_BATCH) {
                batch.clear();
                for &(addr, ctx, n) in chunk {
                    let ctx = *contexts[ctx as usize].get_or_insert_with(|| {
                        let (k, c) = part.counts.contexts[ctx as usize];
                        base.counts.context((k.context(), chains[c as usize]))
                    });
                    let hash = stack_table::hash(addr, ctx);
                    base.counts.index.ids.prefetch(hash);
                    batch.push((addr, ctx, hash, n));
                }
                for &(addr, ctx, hash, n) in &batch {
                    let id = base.counts.add_hashed(addr, ctx, hash, n);
                    if part.kept.is_some() {
                        key_ids.push(id);
                    }
                }
            }
            if let Some(k) = part.kept {
                kept.push(KeptPart {
                    samples: k.samples,
                    remap: key_ids,
                });
            }
        }
        (base.counts, kept)
    }
}

/// A part's samples (or the capture's) counted: their sample path's cost, how many fall in
/// the stretch (`--time`) and the first and last one's TSC, and the TSCs of the first and last
/// sample, those outside the stretch included.
#[derive(Clone, Copy)]
struct Tally {
    cost: CostSum,
    len: usize,
    first: u64,
    last: u64,
    seen: (u64, u64),
}

impl Default for Tally {
    fn default() -> Tally {
        Tally {
            cost: CostSum::default(),
            len: 0,
            first: u64::MAX,
            last: 0,
            seen: (u64::MAX, 0),
        }
    }
}

impl Tally {
    fn merge(&mut self, o: Tally) {
        self.cost.merge(o.cost);
        self.len += o.len;
        self.first = self.first.min(o.first);
        self.last = self.last.max(o.last);
        self.seen = (self.seen.0.min(o.seen.0), self.seen.1.max(o.seen.1));
    }
}

/// What [`Classified::merge`] joins in time: a part's segments, blocks and events, and its
/// samples counted.
#[derive(Default)]
struct PartTimes {
    segments: PartSegments,
    blocks: Vec<BlockSpan>,
    events: Vec<(u16, Event)>,
    tally: Tally,
}

/// [`PartTimes`] of every part joined.
struct Times {
    segments: StreamSegments,
    blocks: Vec<(u16, Vec<BlockSpan>)>,
    events: Vec<(u16, Event)>,
    tally: Tally,
}

impl PartTimes {
    /// The parts' segments joined per pCPU in stream order (their owners numbered as the
    /// first part's), their blocks per pCPU, their events in stream order.
    fn merge(parts: Vec<PartTimes>) -> Times {
        let mut parts = parts.into_iter();
        let mut base = parts.next().unwrap_or_default();
        let mut seg_lists: std::collections::BTreeMap<u16, (Vec<Segment>, Vec<Located>)> =
            std::mem::take(&mut base.segments.lists)
                .into_iter()
                .collect();
        for (number, mut part) in (1u32..).zip(parts) {
            // Its owners in the first part's table.
            let remap: Vec<u32> = part
                .segments
                .owners
                .list
                .iter()
                .map(|&o| base.segments.owners.id(o))
                .collect();
            for (pcpu, (segs, located)) in part.segments.lists {
                let (all, all_at) = seg_lists.entry(pcpu).or_default();
                all.extend(segs.into_iter().map(|s| Segment {
                    owner: remap[s.owner as usize],
                    ..s
                }));
                all_at.extend(located);
            }
            base.events.append(&mut part.events);
            // Its kept samples are the part's by its number.
            base.blocks
                .extend(part.blocks.into_iter().map(|b| BlockSpan {
                    kept: b.kept.map(|(_, at)| (number, at)),
                    ..b
                }));
            base.tally.merge(part.tally);
        }
        let mut per_pcpu: std::collections::BTreeMap<u16, Vec<BlockSpan>> = Default::default();
        for b in base.blocks {
            per_pcpu.entry(b.pcpu).or_default().push(b);
        }
        Times {
            segments: (
                base.segments.owners,
                seg_lists
                    .into_iter()
                    .filter(|(_, (s, _))| !s.is_empty())
                    .map(|(p, (s, l))| (p, s, l))
                    .collect(),
            ),
            blocks: per_pcpu.into_iter().collect(),
            events: base.events,
            tally: base.tally,
        }
    }
}

impl Classified {
    /// Decodes `bytes` on `threads` threads, classifying every sample as it is decoded. The
    /// processes of Linux guests' samples depend on their time and on task frames anywhere in
    /// the capture: with `processes` they are found as the samples are decoded; without, a
    /// guest sample's process is its address space. `keep` says what is kept besides the
    /// stacks.
    pub fn decode(
        bytes: &[u8],
        threads: usize,
        processes: Option<&Processes>,
        window: Window,
        keep: Keep,
        progress: &Progress,
    ) -> (Decoded, Classified) {
        progress.phase("decoding", None, "records");
        let (decoded, parts) = hvprof_samplelog::decode_parallel(
            bytes,
            threads,
            || Part {
                window,
                keep_segments: keep.segments,
                keys: PartKeys {
                    counts: KeyCounts::default(),
                    kept: keep.samples.then(Kept::default),
                },
                ..Part::default()
            },
            |part: &mut Part, at, records: &[Record], frames: &[u64]| {
                part.add(at, records, frames, processes);
                // Told in steps of 64 Ki records: the bar is shared by the threads.
                part.unreported += records.len() as u64;
                if part.unreported >= 1 << 16 {
                    progress.inc(std::mem::take(&mut part.unreported));
                }
            },
        );
        progress.phase("merging", None, "stacks");
        (decoded, Self::merge(parts))
    }

    /// The parts' keys made one table, their segments joined per pCPU in stream order: the two
    /// at once (they share nothing).
    fn merge(parts: Vec<Part>) -> Classified {
        let (keys, times): (Vec<PartKeys>, Vec<PartTimes>) =
            parts.into_iter().map(|p| (p.keys, p.times)).unzip();
        let ((counts, kept), times) = std::thread::scope(|sc| {
            let times = sc.spawn(move || PartTimes::merge(times));
            let keys = PartKeys::merge(keys);
            let times = times
                .join()
                .unwrap_or_else(|e| std::panic::resume_unwind(e));
            (keys, times)
        });
        let Times {
            segments,
            blocks,
            events,
            tally:
                Tally {
                    cost,
                    len,
                    first,
                    last,
                    seen,
                },
        } = times;
        let stacks: Vec<Stack> = counts
            .entries()
            .into_iter()
            .map(|(addr, ctx, count)| {
                let (k, chain) = counts.key(addr, ctx);
                (k, chain, count)
            })
            .map(|(k, chain, count)| Stack {
                what: k.what,
                pcpu: k.pcpu,
                vm: k.vm,
                vcpu: k.vcpu,
                exit: k.exit,
                addr: k.addr,
                cr3: k.cr3,
                process: k.process,
                frame: 0,
                exit_cause: k.exit_cause(),
                chain,
                calls: 0,
                count,
            })
            .collect();
        Classified {
            samples: Samples {
                stacks,
                chains: counts.index.chains.list.clone(),
                len,
                span: if len == 0 { (0, 0) } else { (first, last) },
            },
            events,
            cost,
            segments,
            index: counts.index,
            kept,
            blocks,
            seen: (seen.0 <= seen.1).then_some(seen),
        }
    }
}

impl Samples {
    /// Names every stack (once per distinct (what, VM, exit, address, process, address space),
    /// then merged by name). A user sample's address space is part of it: two processes with
    /// one label (a PID reused by the same program) map their own files at one address.
    fn name(&mut self, namer: &Namer, needed: impl Fn(&Stack) -> bool) -> Vec<Frame> {
        // A frame's key is its address and its context as naming sees it (what, VM, exit or
        // process, address space): the contexts, a few thousand at most, are numbered first,
        // so that the table of distinct keys (up to one per stack, over a million with Linux
        // guests' tasks) holds 12 bytes a key and hashes two words.
        type FrameContext = (What, u16, u16, Option<ProcessKey>, u64);
        let frame_key = |s: &Stack| -> (FrameContext, u64) {
            match s.what {
                What::GuestUser => (
                    (
                        s.what,
                        s.vm,
                        0,
                        s.process,
                        crate::naming::namer::address_space(s.cr3),
                    ),
                    s.addr,
                ),
                What::GuestKernel => ((s.what, s.vm, 0, s.process, 0), s.addr),
                What::Hypervisor => ((s.what, s.vm, s.exit, None, 0), s.addr),
                What::Idle => ((s.what, 0, 0, None, 0), 0),
            }
        };
        // Each distinct key named once, on every core; each stack's key by its number.
        let mut contexts: HashMap<FrameContext, u32> = HashMap::default();
        let mut last: Option<(FrameContext, u32)> = None;
        let mut first: HashMap<(u64, u32), u32> = HashMap::default();
        let mut distinct: Vec<usize> = Vec::new();
        let not_named = u32::MAX;
        let key_of: Vec<u32> = self
            .stacks
            .iter()
            .enumerate()
            .map(|(i, s)| {
                if !needed(s) {
                    return not_named;
                }
                let (context, addr) = frame_key(s);
                let c = match last {
                    Some((l, c)) if l == context => c,
                    _ => {
                        let next = contexts.len() as u32;
                        let c = *contexts.entry(context).or_insert(next);
                        last = Some((context, c));
                        c
                    }
                };
                *first.entry((addr, c)).or_insert_with(|| {
                    distinct.push(i);
                    (distinct.len() - 1) as u32
                })
            })
            .collect();
        drop(first);
        // Each frame with its hash, made on every core, so that merging them by name (on one)
        // hashes no string; each core names its chunks in place, in one list (not in lists of
        // its own copied into one after: over a million frames without symbols).
        let stacks = &self.stacks;
        let mut named: Vec<(Frame, u64)> = Vec::new();
        named.resize_with(distinct.len(), || (Frame::placeholder(), 0));
        let chunks: Vec<_> = distinct.chunks(4096).zip(named.chunks_mut(4096)).collect();
        crate::model::par::par_map(chunks, |(c, out)| {
            for (&i, slot) in c.iter().zip(out) {
                let f = make_frame(namer, &stacks[i]);
                let hash = rustc_hash::FxBuildHasher.hash_one(&f);
                *slot = (f, hash);
            }
        });
        // Merged by name, without copying: the first of each name is kept.
        let mut index: hashbrown::HashTable<(u32, u32)> =
            hashbrown::HashTable::with_capacity(named.len());
        let mut frame_of: Vec<u32> = Vec::with_capacity(named.len());
        let mut keep: Vec<bool> = Vec::with_capacity(named.len());
        let mut next = 0u32;
        for (i, (f, hash)) in named.iter().enumerate() {
            let same = |&(j, _): &(u32, u32)| named[j as usize].0 == *f;
            let rehash = |&(j, _): &(u32, u32)| named[j as usize].1;
            match index.entry(*hash, same, rehash) {
                hashbrown::hash_table::Entry::Occupied(e) => {
                    frame_of.push(e.get().1);
                    keep.push(false);
                }
                hashbrown::hash_table::Entry::Vacant(e) => {
                    e.insert((i as u32, next));
                    frame_of.push(next);
                    keep.push(true);
                    next += 1;
                }
            }
        }
        drop(index);
        // The first of each name kept, in place (over a million frames without symbols: a
        // second list of them would double the phase's memory).
        let mut kept = keep.into_iter();
        named.retain(|_| kept.next().unwrap_or(false));
        let mut frames: Vec<Frame> = named.into_iter().map(|(f, _)| f).collect();
        // The stacks not named share a placeholder frame.
        let mut placeholder = None;
        for (s, &k) in self.stacks.iter_mut().zip(&key_of) {
            s.frame = if k == not_named {
                *placeholder.get_or_insert_with(|| {
                    frames.push(Frame {
                        what: s.what,
                        function: "[not named]".into(),
                        ..Frame::placeholder()
                    });
                    (frames.len() - 1) as u32
                })
            } else {
                frame_of[k as usize]
            };
        }
        frames
    }
}

pub(crate) fn is_guest(what: What) -> bool {
    matches!(what, What::GuestKernel | What::GuestUser)
}

/// Samples per run [`Profile::replay`] hands its work (≈ 32 K: each run's samples and what
/// the work makes of them are in memory at once, a few runs per core; small enough that the
/// allocator reuses their memory rather than asking the kernel for fresh pages each time).
const RUN_SAMPLES: u64 = 1 << 15;

/// Runs each [`Profile::replay`] worker may have made and not yet handed to its consumer.
const RUNS_AHEAD: usize = 1;

/// What reads a capture's samples again, in TSC order: the capture, its blocks per pCPU, the
/// stack of each key, and who ran in Linux guests.
#[derive(Default)]
struct Replay {
    bytes: Capture,
    blocks: Vec<(u16, Vec<BlockSpan>)>,
    index: StackIndex,
    /// The samples the first pass kept, per decoding thread (see [`Classified::kept`]).
    kept: Vec<KeptPart>,
    processes: Option<Processes>,
    /// The samples the first pass kept (`--time`): the same are read again.
    window: Window,
}

/// What a [`Profile::replay`] worker reuses from run to run.
#[derive(Default)]
struct RunScratch {
    block: BlockScratch,
    lists: Vec<Vec<(u64, u32)>>,
    /// Lists to reuse (merging makes new ones of the old).
    pool: Vec<Vec<(u64, u32)>>,
    /// The run's samples merged: (TSC, stack).
    merged: Vec<(u64, u32)>,
    out: Vec<Sampled>,
}

/// Where one pCPU's samples of a run are.
enum Source<'a> {
    /// Its blocks in stream order are in TSC order: read those the run covers.
    Blocks(&'a [BlockSpan]),
    /// They are not (a damaged or forged capture): its samples, read and sorted once.
    Sorted(&'a [(u64, u32)]),
}

/// What [`Replay::block`] reuses from block to block.
#[derive(Default)]
struct BlockScratch {
    reader: BlockReader,
    /// The block's samples found so far: TSC, address, context, hash of the two.
    pending: Vec<(u64, u64, u32, u64)>,
    packed: Vec<u64>,
    task_memo: TaskMemo,
}

impl Replay {
    /// A block's samples: (TSC, stack). Each sample's slot in the stack table is prefetched
    /// before any is looked up (so that the table's cache misses overlap).
    fn block(&self, scratch: &mut BlockScratch, b: &BlockSpan, out: &mut Vec<(u64, u32)>) {
        if let Some((part, at)) = b.kept
            && let Some(KeptPart { samples, remap }) = self.kept.get(part as usize)
            && let Some(kept) = samples.get(at as usize..at as usize + b.samples as usize)
        {
            let tsc = |offset: u32| b.first + u64::from(offset);
            if remap.is_empty() {
                out.extend(kept.iter().map(|&(offset, id)| (tsc(offset), id)));
            } else {
                out.extend(
                    kept.iter()
                        .map(|&(offset, id)| (tsc(offset), remap[id as usize])),
                );
            }
            return;
        }
        let BlockScratch {
            reader,
            pending,
            packed,
            task_memo,
        } = scratch;
        let Some((header, records, frames)) = reader.block_at(&self.bytes, b.offset) else {
            debug_assert!(false, "block at {} not read again", b.offset);
            return;
        };
        let processes = self.processes.as_ref();
        let mut last: Option<((Key, u32), Option<u32>)> = None;
        let mut cursor = ChainCursor::new(frames);
        pending.clear();
        for r in records {
            let Record::Sample(s) = r else { continue };
            if !self.window.contains(s.tsc) {
                cursor.skip(s);
                continue;
            }
            let mut key = classify(header.pcpu, s, processes, task_memo);
            let chain = if cursor.next(s, packed) {
                match self.index.chains.get(packed) {
                    Some(c) => c,
                    None => continue,
                }
            } else {
                0
            };
            if chain != 0
                && let Some((cr3, process)) = exit_cause(key.what, s, processes, task_memo)
            {
                key.cr3 = cr3;
                key.process = Some(process);
            }
            let context = (key.context(), chain);
            let ctx = match last {
                Some((c, i)) if c == context => i,
                _ => {
                    let i = self.index.contexts.get(&context).copied();
                    last = Some((context, i));
                    i
                }
            };
            if let Some(c) = ctx {
                let hash = stack_table::hash(key.addr, c);
                self.index.ids.prefetch(hash);
                pending.push((s.tsc, key.addr, c, hash));
            }
        }
        out.extend(pending.iter().filter_map(|&(tsc, addr, ctx, hash)| {
            self.index.ids.get(hash, addr, ctx).map(|id| (tsc, id))
        }));
    }

    /// Each pCPU's samples in stream order, sorted by TSC, for pCPUs whose blocks are not.
    fn sorted_lists(&self) -> Vec<(u16, Vec<(u64, u32)>)> {
        let mut scratch = BlockScratch::default();
        self.blocks
            .iter()
            .filter(|(_, bs)| !in_order(bs))
            .map(|(c, bs)| {
                let mut l = Vec::new();
                for b in bs {
                    self.block(&mut scratch, b, &mut l);
                }
                l.sort_by_key(|&(t, _)| t);
                (*c, l)
            })
            .collect()
    }
}

/// The common time axis: every pCPU's samples' owners as segments in TSC order, where each
/// segment starts, and the samples of pCPUs whose blocks are out of TSC order, sorted.
struct TimeAxis {
    segments: Segments,
    located: Vec<Vec<Located>>,
    sorted: HashMap<u16, Vec<(u64, u32)>>,
}

impl Replay {
    /// The time axis from the segments the first pass made (in stream order): those of a pCPU
    /// whose blocks are out of TSC order (a damaged or forged capture) are made again from
    /// its samples, read and sorted.
    fn time_axis(&self, (mut owners, lists): StreamSegments, stacks: &[Stack]) -> TimeAxis {
        let sorted: HashMap<u16, Vec<(u64, u32)>> = self.sorted_lists().into_iter().collect();
        let mut pcpus = Vec::with_capacity(lists.len());
        let mut located = Vec::with_capacity(lists.len());
        for (pcpu, segs, at) in lists {
            match sorted.get(&pcpu) {
                None => {
                    pcpus.push((pcpu, segs));
                    located.push(at);
                }
                Some(list) => {
                    let (mut segs, mut at) = (Vec::new(), Vec::new());
                    for (i, &(tsc, stack)) in list.iter().enumerate() {
                        let s = &stacks[stack as usize];
                        let o = owners.id(owner(s.what, s.vm, s.vcpu));
                        let before = segs.len();
                        Segments::push_sample(&mut segs, tsc, o);
                        if segs.len() > before {
                            at.push(Located {
                                offset: 0,
                                skip: i as u32,
                            });
                        }
                    }
                    pcpus.push((pcpu, segs));
                    located.push(at);
                }
            }
        }
        TimeAxis {
            segments: Segments {
                owners: owners.list,
                pcpus,
            },
            located,
            sorted,
        }
    }

    /// The samples of segment `i` of `pcpu` with `lo <= tsc < hi` (no upper bound without
    /// `hi`), read again from its blocks (or its sorted list).
    fn partial(&self, axis: &TimeAxis, pcpu: u16, i: usize, lo: u64, hi: Option<u64>) -> u64 {
        let Ok(p) = axis.segments.pcpus.binary_search_by_key(&pcpu, |(c, _)| *c) else {
            return 0;
        };
        let seg = axis.segments.pcpus[p].1[i];
        let at = axis.located[p][i];
        let inside = |t: u64| t >= lo && hi.is_none_or(|h| t < h);
        let want = seg.count as usize;
        if let Some(list) = axis.sorted.get(&pcpu) {
            let from = at.skip as usize;
            return list[from..(from + want).min(list.len())]
                .iter()
                .filter(|(t, _)| inside(*t))
                .count() as u64;
        }
        let Ok(b) = self.blocks.binary_search_by_key(&pcpu, |(c, _)| *c) else {
            return 0;
        };
        let blocks = &self.blocks[b].1;
        let Ok(first) = blocks.binary_search_by_key(&at.offset, |b| b.offset) else {
            return 0;
        };
        let mut reader = BlockReader::new();
        let (mut seen, mut n) = (0usize, 0u64);
        let mut skip = at.skip as usize;
        for b in &blocks[first..] {
            let Some((_, records, _)) = reader.block_at(&self.bytes, b.offset) else {
                break;
            };
            for r in records {
                let Record::Sample(s) = r else { continue };
                if !self.window.contains(s.tsc) {
                    continue;
                }
                if skip > 0 {
                    skip -= 1;
                    continue;
                }
                if seen == want {
                    return n;
                }
                seen += 1;
                n += u64::from(inside(s.tsc));
            }
        }
        n
    }
}

/// Whether a pCPU's blocks, in stream order, hold its samples in TSC order.
fn in_order(blocks: &[BlockSpan]) -> bool {
    blocks.iter().all(|b| b.sorted) && blocks.windows(2).all(|w| w[0].last <= w[1].first)
}

impl Profile {
    /// Reads and names a capture file.
    pub fn load(
        path: &std::path::Path,
        images: &Images,
        options: LoadOptions,
        progress: &Progress,
    ) -> Result<Profile> {
        Self::load_with_namer(path, images, options, progress).map(|(p, _)| p)
    }

    /// [`Profile::load`], and the namer that named it (see [`Profile::from_capture_with_namer`]).
    pub fn load_with_namer<'i>(
        path: &std::path::Path,
        images: &'i Images,
        options: LoadOptions,
        progress: &Progress,
    ) -> Result<(Profile, Namer<'i>)> {
        let bytes = Capture::open(path)?;
        let len = bytes.len();
        let (profile, namer) = Self::from_capture_with_namer(bytes, images, options, progress);
        profile.is_capture(path)?;
        if profile.samples.is_empty()
            && let Some(range) = options.time
        {
            // The capture has samples, outside the stretch (the warning says where they are).
            let why = profile
                .warnings
                .iter()
                .find(|w| w.starts_with("--time "))
                .cloned()
                .unwrap_or_else(|| format!("--time {range}: no samples in this stretch"));
            anyhow::bail!("{}: {why}", path.display());
        }
        if profile.samples.is_empty() {
            anyhow::bail!(
                "{}: no samples in this capture ({} bytes{}): is it an hvprof serial log?",
                path.display(),
                len,
                if profile.lost.truncated {
                    ", no end frame"
                } else {
                    ""
                }
            );
        }
        Ok((profile, namer))
    }

    /// An error unless the file at `path` held at least one hvprof frame: a capture whose
    /// samples were all lost still has its report (what was lost), a file of anything else
    /// (a wrong path, the console log of another program) has none.
    pub fn is_capture(&self, path: &std::path::Path) -> Result<()> {
        if self.frames_found == 0 {
            anyhow::bail!(
                "{}: no hvprof frame in this file ({}): is it an hvprof serial log?",
                path.display(),
                match self.text.len() {
                    0 => "it is empty".to_owned(),
                    n => format!("{n} bytes of other text or data"),
                }
            );
        }
        Ok(())
    }

    /// [`Profile::from_capture`] of a copy of `bytes`.
    pub fn from_bytes(
        bytes: &[u8],
        images: &Images,
        options: LoadOptions,
        progress: &Progress,
    ) -> Profile {
        Self::from_capture(bytes.to_vec().into(), images, options, progress)
    }

    /// Decodes (on `options.threads` threads) and classifies a capture, and names its stacks.
    pub fn from_capture(
        bytes: Capture,
        images: &Images,
        options: LoadOptions,
        progress: &Progress,
    ) -> Profile {
        Self::from_capture_with_namer(bytes, images, options, progress).0
    }

    /// [`Profile::from_capture`], and the namer that named it: the report's tables name with it
    /// what the profile leaves unnamed (`LoadOptions::report_only`).
    pub fn from_capture_with_namer<'i>(
        bytes: Capture,
        images: &'i Images,
        options: LoadOptions,
        progress: &Progress,
    ) -> (Profile, Namer<'i>) {
        let mut warnings = Vec::new();
        let window = match options.time {
            None => Window::ALL,
            Some(range) => match crate::model::window::tsc_hz(&bytes) {
                Some(hz) => range.ticks(hz),
                None => {
                    warnings.push(format!(
                        "--time {range}: the capture has no header (no TSC frequency to read the times with): the whole capture is shown"
                    ));
                    Window::ALL
                }
            },
        };
        // Who ran (the task frames) first, from the capture's frames without its records: a
        // Linux guest's samples are classified by the task their vCPU ran, so the records are
        // read once, knowing them.
        progress.phase("reading", None, "frames");
        let meta = hvprof_samplelog::decode_metadata_parallel(&bytes, options.threads);
        let namer = Namer::new(&meta, images, &mut warnings);
        drop(meta);
        let processes = Some(namer.processes()).filter(Processes::any_linux);
        let (decoded, classified) = Classified::decode(
            &bytes,
            options.threads,
            processes.as_ref(),
            window,
            Keep {
                segments: options.tables,
                samples: options.keep_samples,
            },
            progress,
        );
        progress.phase("naming", None, "stacks");
        let Classified {
            mut samples,
            events,
            cost,
            segments,
            index,
            kept,
            blocks,
            seen,
        } = classified;
        if let Some(range) = options
            .time
            .filter(|_| samples.len == 0 && !window.is_all())
        {
            let hz = decoded.header.as_ref().map_or(0, |h| h.tsc_hz).max(1) as f64;
            warnings.push(match seen {
                Some((a, b)) => format!(
                    "--time {range}: no samples in this stretch; the capture's run from {:.6} s to {:.6} s",
                    a as f64 / hz,
                    b as f64 / hz
                ),
                None => format!("--time {range}: no samples in this stretch, nor in the capture"),
            });
        }
        let mut events = crate::model::window::clip_events(events, window);
        let replay = Replay {
            bytes,
            blocks,
            index,
            kept,
            processes,
            window,
        };
        let needed = |s: &Stack| {
            !options.report_only
                || !is_guest(s.what)
                || (options.keep_guest && namer.is_linux(s.vm))
        };
        // The time axis (made before naming: it reads no name), and each vCPU's blank slots
        // on it, counted on another core while the stacks are named (neither reads what the
        // other makes).
        let axis = options
            .tables
            .then(|| replay.time_axis(segments, &samples.stacks));
        let (frames, calls, blanks) = std::thread::scope(|sc| {
            let blanks = axis.as_ref().map(|axis| {
                let (events, replay) = (&events, &replay);
                sc.spawn(move || {
                    let partial = |pcpu: u16, i: usize, lo: u64, hi: Option<u64>| {
                        replay.partial(axis, pcpu, i, lo, hi)
                    };
                    (!events.is_empty()).then(|| {
                        crate::model::timeline::segment_blanks(&axis.segments, events, &partial)
                    })
                })
            });
            let frames = samples.name(&namer, needed);
            // The report alone reads no chain.
            let calls = if options.report_only {
                Calls::default()
            } else {
                let (calls, ids) = crate::model::calls::name(&samples, &namer, needed);
                for (s, id) in samples.stacks.iter_mut().zip(ids) {
                    s.calls = id;
                }
                calls
            };
            let blanks =
                blanks.and_then(|b| b.join().unwrap_or_else(|e| std::panic::resume_unwind(e)));
            (frames, calls, blanks)
        });
        let header = decoded.header.clone().unwrap_or_default();
        if decoded.header.is_none() {
            warnings.insert(
                0,
                "no header frame: VM names and the period are unknown".into(),
            );
        }
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
        let lost = Lost::of(&decoded);
        if lost.truncated {
            warnings.push(
                "no end frame: the capture is truncated (losses after the last block are unknown)"
                    .into(),
            );
        }
        // What was lost and the signs of a forged log open the warnings.
        let first_tsc = (!samples.is_empty()).then(|| samples.span().0);
        let (losses, mut first_lines) = losses(&decoded, first_tsc, header.tsc_hz);
        let integrity = Integrity::of(&decoded);
        first_lines.extend(integrity.warnings());
        warnings.splice(0..0, first_lines);
        if !options.report_only {
            sort_events(&mut events);
        }
        let profile = Profile {
            tsc_hz: header.tsc_hz,
            period_ticks: header.period_ticks,
            pcpus: header.pcpus,
            vms: namer.vms.clone(),
            samples,
            frames,
            calls,
            events,
            text: decoded.text_joined(),
            vm_ends: decoded.vm_ends.clone(),
            frames_found: decoded.frames,
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
            cost,
            whole_cost: crate::model::cost::from_frames(&decoded.costs),
            warnings,
            time: options.time.filter(|_| !window.is_all()),
            blanks,
            replay,
        };
        (profile, namer)
    }

    /// Reads every sample again, in TSC order (then pCPU): consecutive runs of them go to
    /// `work` on every core, a few runs at a time, which fills an `R` (the one a previous run
    /// filled and `consume` emptied: `work` clears it first), and `consume` gets each run's
    /// `R` in order. Memory holds a few runs, never every sample (but for a pCPU whose blocks
    /// are out of TSC order, a damaged capture's, whose samples are read and sorted first),
    /// and is reused from run to run.
    pub fn replay<R: Send + Default>(
        &self,
        work: impl Fn(&[Sampled], &mut R) + Sync,
        consume: impl FnMut(&mut R) -> Result<()>,
    ) -> Result<()> {
        self.replay_runs(
            |scratch, sources, lo, hi, out| {
                work(self.run_samples(scratch, sources, lo, hi), out);
            },
            consume,
        )
    }

    /// As [`Profile::replay`], each sample as its TSC and its stack (an index into
    /// [`Samples::stacks`]) only: for a view that reads no other field, which spares the
    /// workers making each sample whole.
    pub fn replay_stacks<R: Send + Default>(
        &self,
        work: impl Fn(&[(u64, u32)], &mut R) + Sync,
        consume: impl FnMut(&mut R) -> Result<()>,
    ) -> Result<()> {
        self.replay_runs(
            |scratch, sources, lo, hi, out| {
                work(self.run_merged(scratch, sources, lo, hi), out);
            },
            consume,
        )
    }

    /// The runs of [`Profile::replay`]: `work` reads the samples of `lo..hi` from the sources
    /// with a scratch of its own, into an `R`.
    fn replay_runs<R: Send + Default>(
        &self,
        work: impl Fn(&mut RunScratch, &[(u16, Source<'_>)], u64, Option<u64>, &mut R) + Sync,
        mut consume: impl FnMut(&mut R) -> Result<()>,
    ) -> Result<()> {
        let r = &self.replay;
        let sorted = r.sorted_lists();
        let sources: Vec<(u16, Source<'_>)> = r
            .blocks
            .iter()
            .map(|(c, bs)| match sorted.iter().find(|(s, _)| s == c) {
                Some((_, l)) => (*c, Source::Sorted(l)),
                None => (*c, Source::Blocks(bs)),
            })
            .collect();
        // Cuts: TSCs that split the samples into runs of about RUN_SAMPLES.
        let mut marks: Vec<(u64, u64)> = Vec::new();
        for (_, s) in &sources {
            match s {
                Source::Blocks(bs) => {
                    marks.extend(bs.iter().map(|b| (b.first, u64::from(b.samples))));
                }
                Source::Sorted(l) => {
                    marks.extend(l.chunks(1024).map(|c| (c[0].0, c.len() as u64)));
                }
            }
        }
        marks.sort_unstable();
        let mut cuts: Vec<u64> = vec![0];
        let mut acc = 0u64;
        for (tsc, n) in marks {
            if acc >= RUN_SAMPLES && tsc > *cuts.last().unwrap_or(&0) {
                cuts.push(tsc);
                acc = 0;
            }
            acc += n;
        }
        let runs: Vec<(u64, Option<u64>)> = cuts
            .iter()
            .enumerate()
            .map(|(i, &lo)| (lo, cuts.get(i + 1).copied()))
            .collect();
        let threads = crate::model::par::cores().min(runs.len()).max(1);
        let work = &work;
        let sources = &sources;
        let runs = &runs;
        // Worker `w` makes runs w, w + threads, ... in order, each into an `R` it gets back
        // once consumed (or a new one), and hands them on through a channel of its own that
        // holds RUNS_AHEAD: `consume` takes run i from worker i % threads, so it sees them in
        // order while the workers make the next ones. When `consume` fails the channels close
        // and the workers stop at their next run.
        std::thread::scope(|sc| {
            let mut made = Vec::with_capacity(threads);
            let mut emptied = Vec::with_capacity(threads);
            for w in 0..threads {
                let (done, take) = std::sync::mpsc::sync_channel::<R>(RUNS_AHEAD);
                let (give_back, back) = std::sync::mpsc::channel::<R>();
                made.push(take);
                emptied.push(give_back);
                sc.spawn(move || {
                    let mut scratch = RunScratch::default();
                    for &(lo, hi) in runs.iter().skip(w).step_by(threads) {
                        let mut out = back.try_recv().unwrap_or_default();
                        work(&mut scratch, sources, lo, hi, &mut out);
                        if done.send(out).is_err() {
                            return;
                        }
                    }
                });
            }
            for i in 0..runs.len() {
                let w = i % threads;
                // A worker that ended early panicked: the scope passes its panic on.
                let Ok(mut out) = made[w].recv() else { break };
                consume(&mut out)?;
                // A worker past its last run has dropped its end: nothing to give back.
                let _ = emptied[w].send(out);
            }
            Ok(())
        })
    }

    /// The samples with `lo <= tsc < hi` (no upper bound without `hi`), in TSC order, then
    /// pCPU, in `scratch`.
    fn run_samples<'s>(
        &self,
        scratch: &'s mut RunScratch,
        sources: &[(u16, Source<'_>)],
        lo: u64,
        hi: Option<u64>,
    ) -> &'s [Sampled] {
        self.run_merged(scratch, sources, lo, hi);
        let RunScratch { merged, out, .. } = scratch;
        // Each sample whole, from its stack: a random access into the stacks, prefetched a few
        // samples ahead so that the misses overlap.
        const AHEAD: usize = 16;
        out.clear();
        out.reserve(merged.len());
        let stacks = &self.samples.stacks;
        for (i, &(tsc, stack)) in merged.iter().enumerate() {
            if let Some(&(_, next)) = merged.get(i + AHEAD) {
                crate::model::stack_table::prefetch(&stacks[next as usize]);
            }
            out.push(self.samples.sampled(tsc, stack));
        }
        out
    }

    /// The samples with `lo <= tsc < hi` (no upper bound without `hi`), in TSC order, then
    /// pCPU, as (TSC, stack) in `scratch.merged`.
    fn run_merged<'s>(
        &self,
        scratch: &'s mut RunScratch,
        sources: &[(u16, Source<'_>)],
        lo: u64,
        hi: Option<u64>,
    ) -> &'s [(u64, u32)] {
        let below = |t: u64| hi.is_none_or(|h| t < h);
        let RunScratch {
            block,
            lists,
            pool,
            merged,
            ..
        } = scratch;
        lists.resize_with(sources.len(), || pool.pop().unwrap_or_default());
        for ((_, source), l) in sources.iter().zip(lists.iter_mut()) {
            l.clear();
            match source {
                Source::Blocks(bs) => {
                    let from = bs.partition_point(|b| b.last < lo);
                    let to = bs.partition_point(|b| below(b.first));
                    for b in &bs[from..to.max(from)] {
                        self.replay.block(block, b, l);
                    }
                    l.retain(|&(t, _)| t >= lo && below(t));
                }
                Source::Sorted(all) => {
                    let from = all.partition_point(|&(t, _)| t < lo);
                    let to = all.partition_point(|&(t, _)| below(t));
                    l.extend_from_slice(&all[from..to.max(from)]);
                }
            }
        }
        // Merged by (TSC, pCPU): each list is in TSC order, pCPUs ascending. Neighbours two by
        // two, then their results, and so on (each merge takes the left one's sample on a tie:
        // the lower pCPUs'), every merge step without a branch on the data (the pCPUs'
        // samples interleave one by one: a branch per sample would be mispredicted).
        match merge_all(std::mem::take(lists), pool, |&(t, _)| t) {
            Some(all) => pool.push(std::mem::replace(merged, all)),
            None => merged.clear(),
        }
        merged
    }

    /// Every sample in TSC order (then pCPU), one by one on this thread.
    pub fn for_each_sample(&self, mut f: impl FnMut(&Sampled)) {
        self.for_each_run(|run| run.iter().for_each(&mut f));
    }

    /// Every sample in TSC order (then pCPU), a run of them at a time on this thread (the
    /// caller may look ahead in a run, to prefetch).
    pub fn for_each_run(&self, mut f: impl FnMut(&[Sampled])) {
        let _ = self.replay(
            |run, out: &mut Vec<Sampled>| {
                out.clear();
                out.extend_from_slice(run);
            },
            |run| {
                f(run);
                Ok(())
            },
        );
    }

    /// Every sample in TSC order (then pCPU), in memory (tests, small captures).
    pub fn samples_in_order(&self) -> Vec<Sampled> {
        let mut all = Vec::with_capacity(self.samples.len());
        self.for_each_sample(|s| all.push(*s));
        all
    }

    /// The VM's name (`vm<N>` when the header does not list it).
    pub fn vm_name(&self, vm: u16) -> String {
        self.vms
            .iter()
            .find(|v| v.id == vm)
            .map_or_else(|| format!("vm{vm}"), |v| v.name.clone())
    }

    /// Every vCPU that has samples or events, sorted.
    pub fn vcpus(&self) -> Vec<(u16, u16)> {
        let mut v: Vec<(u16, u16)> = self
            .samples
            .stacks()
            .iter()
            .filter(|s| is_guest(s.what) && s.count > 0)
            .map(|s| (s.vm, s.vcpu))
            .chain(self.events.iter().map(|(_, e)| (e.vm, e.vcpu)))
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The pCPUs that have samples, sorted.
    pub fn pcpu_list(&self) -> Vec<u16> {
        self.replay.blocks.iter().map(|(c, _)| *c).collect()
    }

    /// First and last sample TSC.
    pub fn span(&self) -> (u64, u64) {
        self.samples.span()
    }

    /// Seconds since the first sample.
    pub fn seconds(&self, tsc: u64) -> f64 {
        let hz = if self.tsc_hz == 0 {
            1e9
        } else {
            self.tsc_hz as f64
        };
        tsc.saturating_sub(self.span().0) as f64 / hz
    }

    /// Nanoseconds of `ticks` TSC ticks (ticks when the TSC frequency is unknown), rounded
    /// down (and, were it past `u64`, its low 64 bits).
    pub fn ticks_to_ns(&self, ticks: u64) -> u64 {
        if self.tsc_hz == 0 {
            ticks
        } else {
            mul_div(ticks, 1_000_000_000, self.tsc_hz)
        }
    }

    /// [`Profile::ticks_to_ns`] for a loop over the samples: the same nanoseconds, the
    /// division by the TSC rate made once.
    pub fn nanos(&self) -> Nanos {
        Nanos::new(self.tsc_hz)
    }
}

/// TSC ticks to nanoseconds at a fixed rate, as [`Profile::ticks_to_ns`]: `mul_div(ticks, 10^9,
/// hz)`, its divisions by the rate done as multiplications (`strength_reduce`), a few times
/// faster than a division (a conversion per sample in the exports).
#[derive(Debug, Clone, Copy)]
pub enum Nanos {
    /// The rate is unknown: nanoseconds are ticks.
    Ticks,
    /// The rate, `10^9` times which fits in 64 bits.
    Reduced(strength_reduce::StrengthReducedU64),
    /// A rate whose `10^9` times does not fit (a 128-bit division).
    Wide(u64),
}

impl Nanos {
    /// The conversion at `hz` ticks per second (0: unknown).
    pub fn new(hz: u64) -> Nanos {
        match hz {
            0 => Nanos::Ticks,
            hz if hz.checked_mul(1_000_000_000).is_some() => {
                Nanos::Reduced(strength_reduce::StrengthReducedU64::new(hz))
            }
            hz => Nanos::Wide(hz),
        }
    }

    /// Nanoseconds of `ticks`.
    #[inline]
    pub fn of(&self, ticks: u64) -> u64 {
        match *self {
            Nanos::Ticks => ticks,
            // As `mul_div`: ticks = q hz + r with r < hz, and r 10^9 < hz 10^9 fits.
            Nanos::Reduced(hz) => {
                let (q, r) = strength_reduce::StrengthReducedU64::div_rem(ticks, hz);
                q.wrapping_mul(1_000_000_000)
                    .wrapping_add(r * 1_000_000_000 / hz)
            }
            Nanos::Wide(hz) => mul_div(ticks, 1_000_000_000, hz),
        }
    }
}

/// `a * b / c` rounded down, truncated to 64 bits: what `(a as u128 * b as u128 / c as u128) as
/// u64` gives, in 64-bit divisions when `b * c` fits in 64 bits (a TSC rate in Hz times 10^9
/// does), which are several times faster than a 128-bit one (a call per sample in the
/// exports). `c` is not 0.
#[inline]
pub fn mul_div(a: u64, b: u64, c: u64) -> u64 {
    if b.checked_mul(c).is_some() {
        // a = q c + r with r < c, so a b / c = q b + r b / c, and r b < c b fits.
        let (q, r) = (a / c, a % c);
        q.wrapping_mul(b).wrapping_add(r * b / c)
    } else {
        (u128::from(a) * u128::from(b) / u128::from(c)) as u64
    }
}

fn make_frame(namer: &Namer, s: &Stack) -> Frame {
    match s.what {
        What::GuestKernel | What::GuestUser => {
            let task = s.process.and_then(|p| namer.task_label(p));
            let (function, module) =
                namer.guest_function(s.vm, s.what == What::GuestUser, s.addr, s.cr3, task);
            Frame {
                what: s.what,
                vm: namer.vm_name(s.vm),
                process: s.process.map(|p| namer.process(p)).unwrap_or_default(),
                module,
                function,
                process_key: s.process,
            }
        }
        What::Hypervisor => Frame {
            what: s.what,
            vm: "[hypervisor]".into(),
            process: hypervisor_label(
                (s.vm != NO_VM).then(|| namer.vm_name(s.vm)).as_deref(),
                s.exit,
            ),
            module: "hvprof".into(),
            function: namer.hypervisor_function(s.addr),
            process_key: None,
        },
        What::Idle => Frame {
            what: s.what,
            vm: String::new(),
            process: String::new(),
            module: String::new(),
            function: "[idle]".into(),
            process_key: None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvprof_samplelog::synth;
    use proptest::prelude::*;

    #[test]
    fn every_sample_is_named_and_counted_once() {
        let cfg = synth::SynthConfig {
            pcpus: 2,
            samples_per_pcpu: 3000,
            ..synth::SynthConfig::default()
        };
        let cap = synth::capture(&cfg, &synth::CaptureOptions::default());
        let p = Profile::from_bytes(
            &cap.bytes,
            &Images::default(),
            LoadOptions::all(2),
            &Progress::hidden(),
        );
        assert_eq!(p.samples.len() as u64, cap.samples);
        let all: Vec<Sampled> = p.samples_in_order();
        assert_eq!(all.len(), p.samples.len());
        assert!(
            all.windows(2)
                .all(|w| (w[0].tsc, w[0].pcpu) <= (w[1].tsc, w[1].pcpu))
        );
        assert!(all.iter().all(|s| (s.frame as usize) < p.frames.len()));
        // Frames are distinct.
        let set: std::collections::HashSet<_> = p.frames.iter().collect();
        assert_eq!(set.len(), p.frames.len());
        // Hypervisor frames name whom they worked for.
        for s in all.iter().filter(|s| s.what == What::Hypervisor) {
            let f = &p.frames[s.frame as usize];
            assert_eq!(f.vm, "[hypervisor]");
            if s.vm == NO_VM {
                assert_eq!(f.process, "no VM");
            } else {
                assert!(f.process.starts_with(&p.vm_name(s.vm)), "{}", f.process);
            }
        }
    }

    #[test]
    fn chains_are_kept_with_their_samples_counted_once_and_read_again() {
        use std::collections::HashMap as Map;
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
        assert_eq!(one.samples.len() as u64, cap.samples);
        // Read again, every sample is found (its chain too).
        assert_eq!(three.samples_in_order().len(), three.samples.len());
        // Kept by the first pass on three threads, the same samples are read again.
        let kept = Profile::from_bytes(
            &cap.bytes,
            &Images::default(),
            LoadOptions {
                keep_samples: true,
                ..LoadOptions::all(3)
            },
            &Progress::hidden(),
        );
        assert!(
            kept.replay
                .blocks
                .iter()
                .flat_map(|(_, b)| b)
                .all(|b| b.kept.is_some())
        );
        assert_eq!(kept.samples_in_order(), three.samples_in_order());
        // Each stack's chains are its samples': counted per (kind, VM, address, chains) from
        // the decoder's records and frames.
        type ChainKey = (bool, u16, u64, Vec<u64>, ChainEnd, Vec<u64>, ChainEnd);
        let mut want: Map<ChainKey, u64> = Map::new();
        let d = hvprof_samplelog::decode(&cap.bytes);
        for log in d.pcpus.values() {
            for (s, c) in log.samples_with_chains() {
                let hv = s.kind != SampleKind::Guest;
                let addr = if hv { s.host_rip } else { s.guest_rip };
                let key = (
                    hv,
                    s.vm,
                    addr,
                    c.host.to_vec(),
                    s.host_chain.end(),
                    c.guest.to_vec(),
                    s.guest_chain.end(),
                );
                *want.entry(key).or_default() += 1;
            }
        }
        let mut got: Map<ChainKey, u64> = Map::new();
        for st in three.samples.stacks() {
            let hv = !is_guest(st.what);
            let key = match three.samples.chain(st.chain) {
                Some(c) => (
                    hv,
                    st.vm,
                    st.addr,
                    c.host.to_vec(),
                    c.host_end,
                    c.guest.to_vec(),
                    c.guest_end,
                ),
                None => (
                    hv,
                    st.vm,
                    st.addr,
                    Vec::new(),
                    ChainEnd::NotWalked,
                    Vec::new(),
                    ChainEnd::NotWalked,
                ),
            };
            *got.entry(key).or_default() += st.count;
        }
        assert_eq!(got, want);
        // Exit causes keep their vCPU's guest context.
        assert!(
            three
                .samples
                .stacks()
                .iter()
                .any(|s| s.exit_cause && s.process.is_some() && s.calls != 0)
        );
    }

    #[test]
    fn a_block_longer_than_32_bits_of_ticks_is_read_again_not_kept() {
        use hvprof_samplelog::Sample;
        // Ten samples a block; 2^33 ticks between the 15th and 16th, so inside the second.
        let records: Vec<Record> = (0..30u64)
            .map(|i| {
                Record::Sample(Sample {
                    kind: SampleKind::Hypervisor,
                    host_rip: 0x2000 + i % 3,
                    tsc: 1000 * i + if i >= 15 { 1 << 33 } else { 0 },
                    ..Sample::default()
                })
            })
            .collect();
        let bytes = hvprof_samplelog::synth::encode_blocks(0, &records, 10, 10);
        let load = |keep_samples| {
            Profile::from_bytes(
                &bytes,
                &Images::default(),
                LoadOptions {
                    keep_samples,
                    ..LoadOptions::all(1)
                },
                &Progress::hidden(),
            )
        };
        let (kept, read) = (load(true), load(false));
        let spans: Vec<bool> = kept.replay.blocks[0]
            .1
            .iter()
            .map(|b| b.kept.is_some())
            .collect();
        assert_eq!(spans, [true, false, true]);
        assert_eq!(kept.samples_in_order().len(), 30);
        assert_eq!(kept.samples_in_order(), read.samples_in_order());
    }

    #[test]
    fn one_label_in_two_address_spaces_names_two_files() {
        use hvprof_samplelog::{FixedStr, Mapping, MappingKind, Task};
        // PID 80 reused by another run of `job`: one label, two address spaces, each mapping
        // its own file at 0x200000.
        let task = |tsc, cr3| Task {
            tsc,
            tgid: 80,
            pid: 80,
            cr3,
            comm: FixedStr::truncated("job"),
            ..Task::default()
        };
        let mapping = |cr3, path: &str| Mapping {
            kind: MappingKind::Process,
            cr3,
            tgid: 80,
            start: 0x20_0000,
            end: 0x20_4000,
            path: FixedStr::truncated(path),
            ..Mapping::default()
        };
        let decoded = hvprof_samplelog::Decoded {
            tasks: vec![task(0, 0x2_0000), task(1000, 0x2_4000)],
            mappings: vec![
                mapping(0x2_0000, "/bin/job"),
                mapping(0x2_4000, "/usr/local/bin/job.v2"),
            ],
            ..Default::default()
        };
        let images = Images::default();
        let mut warnings = Vec::new();
        let namer = Namer::new(&decoded, &images, &mut warnings);
        // Each stack's process as the decoding pass finds it: the task at its sample's time.
        let processes = namer.processes();
        let stack = |tsc, cr3| Stack {
            what: What::GuestUser,
            pcpu: 0,
            vm: 0,
            vcpu: 0,
            exit: 0,
            addr: 0x20_0484,
            cr3,
            process: Some(processes.key(0, 0, tsc, cr3)),
            frame: 0,
            exit_cause: false,
            chain: 0,
            calls: 0,
            count: 1,
        };
        let mut classified = Classified {
            samples: Samples {
                stacks: vec![stack(10, 0x2_0000), stack(2000, 0x2_4000 | 0x1000)],
                chains: Vec::new(),
                len: 2,
                span: (10, 2000),
            },
            events: Vec::new(),
            cost: CostSum::default(),
            segments: Default::default(),
            index: StackIndex::default(),
            kept: Vec::new(),
            blocks: Vec::new(),
            seen: Some((10, 2000)),
        };
        let frames = classified.samples.name(&namer, |_| true);
        let named: Vec<&Frame> = classified
            .samples
            .stacks()
            .iter()
            .map(|s| &frames[s.frame as usize])
            .collect();
        assert_eq!(named.len(), 2);
        assert_eq!(named[0].process, "job[80]");
        assert_eq!(named[1].process, "job[80]");
        assert_eq!(named[0].process_key, named[1].process_key);
        assert_eq!(
            (named[0].module.as_str(), named[0].function.as_str()),
            ("job", "[unknown] job+0x484")
        );
        assert_eq!(
            (named[1].module.as_str(), named[1].function.as_str()),
            ("job.v2", "[unknown] job.v2+0x484")
        );
    }

    /// Random records on a few pCPUs: samples of a few owners in runs (as a pCPU's samples
    /// come), scheduling events, TSCs rising (or not).
    fn arb_pcpu_records() -> impl Strategy<Value = Vec<Record>> {
        use hvprof_samplelog::{Event, EventKind, OutReason, Sample, guest_mode};
        let vm = prop_oneof![Just(0u16), Just(1), Just(NO_VM)];
        let sample = (0u8..3, vm.clone(), 0u16..3, 1usize..6, 0u64..3).prop_map(
            |(kind, vm, vcpu, n, rip)| {
                let s = Sample {
                    kind: SampleKind::from_u8(kind).unwrap_or_default(),
                    vm,
                    vcpu,
                    guest_mode: guest_mode(0, 2),
                    guest_rip: 0x1000 + rip,
                    host_rip: 0x2000 + rip,
                    ..Sample::default()
                };
                vec![Record::Sample(s); n]
            },
        );
        let event = (any::<bool>(), vm, 0u16..3, 0u8..4).prop_map(|(out, vm, vcpu, reason)| {
            vec![Record::Event(Event {
                kind: if out {
                    EventKind::VcpuOut
                } else {
                    EventKind::VcpuIn
                },
                vm,
                vcpu,
                reason: OutReason::from_u8(reason).unwrap_or_default(),
                tsc: 0,
            })]
        });
        prop::collection::vec((0u64..30, prop_oneof![2 => sample, 1 => event]), 0..40).prop_map(
            |groups| {
                let mut t = 0u64;
                let mut out = Vec::new();
                for (dt, group) in groups {
                    for mut r in group {
                        t += dt / 4;
                        match &mut r {
                            Record::Sample(s) => s.tsc = t,
                            Record::Event(e) => e.tsc = t,
                        }
                        out.push(r);
                    }
                }
                out
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        /// What the report counts per segment, reading samples again from the blocks where an
        /// event falls inside a segment (and from sorted lists for a pCPU whose blocks came out
        /// of TSC order), is what counting every sample gives; the samples read again are every
        /// sample, in TSC order.
        #[test]
        fn segments_and_replay_agree_with_every_sample(
            pcpus in prop::collection::vec(arb_pcpu_records(), 1..4),
            block_records in 1usize..9,
            swap in any::<bool>(),
        ) {
            let mut bytes = Vec::new();
            for (pcpu, r) in pcpus.iter().enumerate() {
                let stream = hvprof_samplelog::synth::encode_blocks(pcpu as u16, r, 10, block_records);
                // Its frames (each `0x00 COBS 0x00`), the first two sent in the other order
                // (their numbers tell the decoder; their TSCs go back).
                let mut frames: Vec<&[u8]> = stream
                    .split(|&b| b == 0)
                    .filter(|f| !f.is_empty())
                    .collect();
                if swap && frames.len() > 1 {
                    frames.swap(0, 1);
                }
                for f in frames {
                    bytes.push(0);
                    bytes.extend_from_slice(f);
                    bytes.push(0);
                }
            }
            let p = Profile::from_bytes(
                &bytes,
                &Images::default(),
                LoadOptions::all(2),
                &Progress::hidden(),
            );
            let all = p.samples_in_order();
            prop_assert_eq!(all.len(), p.samples.len());
            // Kept by the first pass, the same samples are read again.
            let kept = Profile::from_bytes(
                &bytes,
                &Images::default(),
                LoadOptions { keep_samples: true, ..LoadOptions::all(2) },
                &Progress::hidden(),
            );
            prop_assert_eq!(kept.samples_in_order(), all.clone());
            prop_assert!(all.windows(2).all(|w| (w[0].tsc, w[0].pcpu) <= (w[1].tsc, w[1].pcpu)));
            let mut lists: HashMap<u16, Vec<(u64, Owner)>> = HashMap::default();
            for s in &all {
                lists.entry(s.pcpu).or_default().push((s.tsc, s.owner()));
            }
            for l in lists.values_mut() {
                l.sort_by_key(|s| s.0);
            }
            let want = crate::model::timeline::blanks(&lists, &p.events);
            let classified =
                Classified::decode(&bytes, 2, None, Window::ALL, Keep { segments: true, samples: false }, &Progress::hidden()).1;
            let axis = p.replay.time_axis(classified.segments, &p.samples.stacks);
            let partial = |pcpu: u16, i: usize, lo: u64, hi: Option<u64>| {
                p.replay.partial(&axis, pcpu, i, lo, hi)
            };
            let got = crate::model::timeline::segment_blanks(&axis.segments, &p.events, &partial);
            prop_assert_eq!(got, want);
        }
    }

    proptest! {
        /// The strength-reduced conversion is `mul_div`'s, for any TSC and rate.
        #[test]
        fn nanos_are_mul_div(a in any::<u64>(), hz in prop_oneof![1u64..=20_000_000_000, any::<u64>()]) {
            let want = if hz == 0 { a } else { mul_div(a, 1_000_000_000, hz) };
            prop_assert_eq!(Nanos::new(hz).of(a), want);
        }

        /// The 64-bit `mul_div` is the 128-bit formula, truncated, for any TSC and rate.
        #[test]
        fn mul_div_is_the_128_bit_quotient(a in any::<u64>(), b in 1u64..=1_000_000_000, c in 1u64..) {
            prop_assert_eq!(mul_div(a, b, c), (u128::from(a) * u128::from(b) / u128::from(c)) as u64);
        }
    }

    #[test]
    fn key_counts_past_four_billion() {
        let key = Key {
            addr: 0x1000,
            cr3: 0,
            process: None,
            pcpu: 0,
            vm: 0,
            vcpu: 0,
            exit: 0,
            what: What::Idle,
        };
        let mut c = KeyCounts::default();
        let ctx = c.context((key.context(), 0));
        assert_eq!(c.add(key.addr, ctx, u64::from(u32::MAX)), 0);
        for _ in 0..3 {
            c.add(key.addr, ctx, 1);
        }
        c.add(0x2000, ctx, 5);
        c.add(key.addr, ctx, 1 << 33);
        assert_eq!(
            c.entries(),
            vec![
                (0x1000, ctx, u64::from(u32::MAX) + 3 + (1 << 33)),
                (0x2000, ctx, 5)
            ]
        );
        assert_eq!(
            c.key(0x2000, ctx),
            (
                Key {
                    addr: 0x2000,
                    ..key
                },
                0
            )
        );
    }

    #[test]
    fn folded_frames_never_split_on_semicolons() {
        let f = Frame {
            what: What::Hypervisor,
            vm: "[hypervisor]".into(),
            process: "no VM".into(),
            module: "hvprof".into(),
            function: "<[u8; 4] as Foo>::bar".into(),
            process_key: None,
        };
        assert_eq!(
            f.folded(),
            "[hypervisor];no VM;hvprof;<[u8, 4] as Foo>::bar"
        );
        let idle = Frame {
            what: What::Idle,
            vm: String::new(),
            process: String::new(),
            module: String::new(),
            function: "[idle]".into(),
            process_key: None,
        };
        assert_eq!(idle.folded(), "[idle]");
    }
}
