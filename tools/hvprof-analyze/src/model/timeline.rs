//! The common host-time axis (the paper's Key Technique 3, §3.5): each vCPU gets a virtual sample
//! stream on the host's time axis. At every sample taken on the pCPU the vCPU belongs to (the
//! pCPU of its latest "vCPU in"), while the vCPU exists, the vCPU either ran (its own guest
//! sample) or was blank. A blank slot is `[idle]` when the vCPU was out because it halted (its
//! last exit was HLT), else `[steal]`: `(on vcpuN)` when another vCPU of the same VM held the
//! pCPU (its guest, or the hypervisor handling its exits), `(hypervisor)` when the hypervisor
//! worked for no VM there (the scheduler between slices), `(outside)` otherwise (another VM, or
//! the hypervisor handling that VM's exits). The hypervisor's time on the vCPU's own exits while
//! it was in is `[steal] (hypervisor)` too, though the events count it as running. The exact
//! figures come from the scheduling events beside the sample-based ones.
//!
//! Each vCPU's stream is a list of [`Run`]s (a range of one pCPU's samples in one state), found
//! by binary search from its events, and counted per run: the work grows with the events and
//! samples, not with their product (a log with thousands of vCPUs and many samples is as quick as
//! one with a few).

use std::ops::Range;

use hvprof_samplelog::{Event, EventKind, OutReason};
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

/// Who a sample belongs to: a vCPU's guest, the hypervisor (on behalf of a vCPU or not), idle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Owner {
    Guest { vm: u16, vcpu: u16 },
    Hypervisor { vm: u16, vcpu: u16 },
    Idle,
}

impl Owner {
    /// The vCPU (VM, vCPU) it is or works for; none for idle.
    pub fn vcpu(self) -> Option<(u16, u16)> {
        match self {
            Owner::Guest { vm, vcpu } | Owner::Hypervisor { vm, vcpu } => Some((vm, vcpu)),
            Owner::Idle => None,
        }
    }
}

/// What a vCPU's virtual stream holds besides its own samples.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Blanks {
    /// Slots while it was out halted.
    pub idle: u64,
    /// Slots while another vCPU of its VM held its pCPU, per that vCPU.
    pub steal_on: HashMap<u16, u64>,
    /// The same for siblings beyond the first [`STEAL_ON_MAX`] of a pCPU (a forged log).
    pub steal_on_others: u64,
    /// Every other blank slot while it was out.
    pub steal_outside: u64,
    /// Of `steal_outside`, the slots another VM held the pCPU in (its guest, or the hypervisor
    /// handling its exits), per VM; the rest no one held (the pCPU idle while the vCPU was
    /// runnable).
    pub steal_by_vm: HashMap<u16, u64>,
    /// Slots on its pCPU while it was in that are not its own: the hypervisor handling its exits.
    pub hypervisor: u64,
    /// Slots on its pCPU while it was out (not halted) in which the hypervisor worked for no VM.
    pub hypervisor_out: u64,
    /// Exact TSC ticks from the events: out halted, out otherwise (preempted), in.
    pub ticks_halted: u64,
    pub ticks_out: u64,
    pub ticks_in: u64,
    /// Times it gave its pCPU up spinning (out events `Yielded`: pause-loop exits).
    pub yields: u64,
    /// Of `ticks_out`, the exact ticks each other vCPU (VM, vCPU) was in on the pCPU this one
    /// went out on, from the events; the rest no vCPU held (the hypervisor, or idle).
    pub ticks_out_by: HashMap<(u16, u16), u64>,
}

/// What a vCPU was doing over a stretch of host time, from its scheduling events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Class {
    /// In: it held the pCPU.
    In,
    /// Out because it halted.
    OutHalted,
    /// Out otherwise (preempted, yielded): runnable.
    Out,
}

/// A stretch of one vCPU's virtual stream: the samples `samples` (indices into the pCPU's list)
/// of pCPU `pcpu`, all taken while the vCPU was in `class` there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    pub vcpu: (u16, u16),
    pub pcpu: u16,
    pub samples: Range<usize>,
    pub class: Class,
}

/// One vCPU's events in time order, with the pCPU each came from.
struct Track {
    events: Vec<(u64, u16, Event)>,
}

/// What one slot of a vCPU's virtual stream holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// Its own guest sample.
    Own,
    /// On its pCPU while it was in, not its own: the hypervisor handling its exits.
    Hypervisor,
    /// Out, halted.
    Idle,
    /// Out, its pCPU held by vCPU N of the same VM.
    StealOn(u16),
    /// Out, its pCPU held by the hypervisor working for no VM (the scheduler).
    HypervisorOut,
    /// Out, anything else: another VM (`Some`: its guest, or the hypervisor handling its
    /// exits), or no one (`None`: the pCPU idle).
    StealOutside(Option<u16>),
}

/// The slot of vCPU `(vm, vcpu)`, in `class` on the pCPU of a sample owned by `owner`.
pub fn slot((vm, vcpu): (u16, u16), class: Class, owner: Owner) -> Slot {
    match class {
        Class::In if owner == (Owner::Guest { vm, vcpu }) => Slot::Own,
        // Its pCPU, while it was in: the hypervisor handling its exit.
        Class::In => Slot::Hypervisor,
        Class::OutHalted => Slot::Idle,
        // The pCPU held by a sibling vCPU: running its guest, or the hypervisor handling its
        // exits.
        Class::Out => match owner {
            Owner::Guest { vm: v, vcpu: c } | Owner::Hypervisor { vm: v, vcpu: c }
                if v == vm && c != vcpu =>
            {
                Slot::StealOn(c)
            }
            Owner::Hypervisor {
                vm: hvprof_samplelog::NO_VM,
                ..
            } => Slot::HypervisorOut,
            Owner::Guest { vm: v, .. } | Owner::Hypervisor { vm: v, .. }
                if v != hvprof_samplelog::NO_VM =>
            {
                Slot::StealOutside(Some(v))
            }
            _ => Slot::StealOutside(None),
        },
    }
}

/// Each vCPU's events in TSC order (events at the same TSC keep their order), by vCPU.
fn tracks(events: &[(u16, Event)]) -> Vec<((u16, u16), Track)> {
    let mut tracks: HashMap<(u16, u16), Track> = HashMap::default();
    for &(pcpu, e) in events {
        tracks
            .entry((e.vm, e.vcpu))
            .or_insert_with(|| Track { events: Vec::new() })
            .events
            .push((e.tsc, pcpu, e));
    }
    let mut tracks: Vec<_> = tracks.into_iter().collect();
    tracks.sort_unstable_by_key(|(k, _)| *k);
    for (_, track) in &mut tracks {
        track.events.sort_by_key(|(t, _, _)| *t);
    }
    tracks
}

/// Per pCPU, its samples in TSC order, each with its TSC and owner: what the virtual streams are
/// made of. The report reads the profile's own lists ([`crate::model::profile::Slot`], the owner from
/// the stack); the chart and the tests give (TSC, owner) pairs.
pub trait Lists {
    type Item: Sync;
    /// The pCPUs that have a list, in any order.
    fn pcpus(&self) -> Vec<u16>;
    /// A pCPU's samples in TSC order.
    fn list(&self, pcpu: u16) -> Option<&[Self::Item]>;
    fn tsc(&self, item: &Self::Item) -> u64;
    fn owner(&self, item: &Self::Item) -> Owner;
}

impl Lists for HashMap<u16, Vec<(u64, Owner)>> {
    type Item = (u64, Owner);
    fn pcpus(&self) -> Vec<u16> {
        self.keys().copied().collect()
    }
    fn list(&self, pcpu: u16) -> Option<&[(u64, Owner)]> {
        self.get(&pcpu).map(Vec::as_slice)
    }
    fn tsc(&self, item: &(u64, Owner)) -> u64 {
        item.0
    }
    fn owner(&self, item: &(u64, Owner)) -> Owner {
        item.1
    }
}

/// Every vCPU's virtual stream as runs. `samples`: per pCPU, (TSC, owner) in TSC order;
/// `events`: every scheduling event with its pCPU. After an event the vCPU is in the state it
/// names, on that event's pCPU, from the samples at its TSC on until the vCPU's next event; it
/// has no slots before its first event and none from its first `Stopped` on (a stopped vCPU
/// stays stopped). Time O(E log E + E log S) for E events and S samples: each run is found by
/// two binary searches, whatever the number of vCPUs.
pub fn runs<L: Lists>(samples: &L, events: &[(u16, Event)]) -> Vec<Run> {
    time_runs(events)
        .into_iter()
        .filter_map(|r| {
            let list = samples.list(r.pcpu)?;
            let start = list.partition_point(|s| samples.tsc(s) < r.from);
            let end = match r.to {
                Some(next) => list.partition_point(|s| samples.tsc(s) < next),
                None => list.len(),
            };
            (start < end).then_some(Run {
                vcpu: r.vcpu,
                pcpu: r.pcpu,
                samples: start..end,
                class: r.class,
            })
        })
        .collect()
}

/// A vCPU's run as a stretch of host time: the samples of `pcpu` with `from <= tsc < to` (no
/// end without `to`) are its slots of `class` (see [`runs`]).
#[derive(Debug, Clone, Copy)]
pub struct TimeRun {
    pub vcpu: (u16, u16),
    pub pcpu: u16,
    pub from: u64,
    pub to: Option<u64>,
    pub class: Class,
    /// An [`Class::Out`] run that a pause-loop exit began (out event `Yielded`): the vCPU gave
    /// its pCPU up spinning.
    pub yielded: bool,
}

/// Every vCPU's virtual stream as stretches of time on a pCPU, as [`runs`] reads it (without
/// the samples: a stretch may hold none).
pub fn time_runs(events: &[(u16, Event)]) -> Vec<TimeRun> {
    let mut out = Vec::new();
    for (key, track) in tracks(events) {
        for (k, &(t, pcpu, e)) in track.events.iter().enumerate() {
            let class = match (e.kind, e.reason) {
                (EventKind::VcpuIn, _) => Class::In,
                (EventKind::VcpuOut, OutReason::Stopped) => break,
                (EventKind::VcpuOut, OutReason::Halted) => Class::OutHalted,
                (EventKind::VcpuOut, _) => Class::Out,
            };
            out.push(TimeRun {
                vcpu: key,
                pcpu,
                from: t,
                to: track.events.get(k + 1).map(|&(next, _, _)| next),
                class,
                yielded: e.kind == EventKind::VcpuOut && e.reason == OutReason::Yielded,
            });
        }
    }
    out
}

/// Classifies every slot of every vCPU's virtual stream (see [`runs`]). `visit` gets the vCPU,
/// the pCPU, the index of the sample in that pCPU's list, and the slot. Its calls are the
/// output: one per slot; [`blanks`] and the chart count slots per run instead.
pub fn classify<L: Lists>(
    samples: &L,
    events: &[(u16, Event)],
    mut visit: impl FnMut((u16, u16), u16, usize, Slot),
) {
    for run in runs(samples, events) {
        let Some(list) = samples.list(run.pcpu) else {
            continue;
        };
        for i in run.samples.clone() {
            let owner = samples.owner(&list[i]);
            visit(run.vcpu, run.pcpu, i, slot(run.vcpu, run.class, owner));
        }
    }
}

/// A set of a pCPU's units (its samples, or its [`Segment`]s), each with its samples, counted
/// in any range of unit indices by binary search.
pub trait Counter: Default {
    /// Adds unit `unit` (after every unit added so far), holding `n` samples.
    fn push(&mut self, unit: usize, n: u64);
    /// Samples of the units in `r`.
    fn count(&self, r: &Range<usize>) -> u64;
}

/// Units of one sample each: their positions in the pCPU's list (32 bits: a pCPU's list of
/// 4 G samples would come from a capture of more than 20 GB).
#[derive(Default)]
pub struct Positions(Vec<u32>);

impl Counter for Positions {
    fn push(&mut self, unit: usize, n: u64) {
        debug_assert_eq!(n, 1);
        self.0.push(unit as u32);
    }

    fn count(&self, r: &Range<usize>) -> u64 {
        let below = |end: usize| self.0.partition_point(|&i| (i as usize) < end);
        (below(r.end) - below(r.start)) as u64
    }
}

/// Units of several samples: (unit index, samples in the units before it and in it).
#[derive(Default)]
pub struct Cumulative(Vec<(u32, u64)>);

impl Cumulative {
    /// Samples in the units before index `x`.
    fn before(&self, x: usize) -> u64 {
        let k = self.0.partition_point(|&(i, _)| (i as usize) < x);
        k.checked_sub(1).map_or(0, |k| self.0[k].1)
    }
}

impl Counter for Cumulative {
    fn push(&mut self, unit: usize, n: u64) {
        let before = self.0.last().map_or(0, |&(_, c)| c);
        self.0.push((unit as u32, before + n));
    }

    fn count(&self, r: &Range<usize>) -> u64 {
        self.before(r.end) - self.before(r.start)
    }
}

/// Every unit of a pCPU, each with its samples: the samples before each unit, so that a range
/// of units is counted without a search.
struct Prefix(Vec<u64>);

impl Prefix {
    fn new(units: impl ExactSizeIterator<Item = u64>) -> Self {
        let mut before = Vec::with_capacity(units.len() + 1);
        let mut sum = 0u64;
        before.push(0);
        for n in units {
            sum += n;
            before.push(sum);
        }
        Prefix(before)
    }

    /// Samples of the units in `r` (of the units there are).
    fn count(&self, r: &Range<usize>) -> u64 {
        self.0[r.end] - self.0[r.start]
    }
}

/// Most siblings of a vCPU its `[steal] (on vcpuN)` slots are told apart for, per pCPU (the
/// hypervisor runs at most 8 vCPUs per VM; a log naming more is forged or damaged, and the rest
/// go to `Blanks::steal_on_others`, which keeps the work linear).
pub const STEAL_ON_MAX: usize = 64;

/// The owners a run's slots are told apart by.
#[derive(Clone, Copy)]
enum Kind {
    /// A vCPU's guest.
    Guest((u16, u16)),
    /// A vCPU: its guest, or the hypervisor on its behalf.
    Vcpu((u16, u16)),
    /// A VM: its guests, or the hypervisor on their behalf.
    Vm(u16),
    /// The hypervisor working for no VM.
    HvNoVm,
}

impl Kind {
    fn holds(self, owner: Owner) -> bool {
        match (self, owner) {
            (Kind::Guest(k), Owner::Guest { vm, vcpu }) => k == (vm, vcpu),
            (Kind::Vcpu(k), Owner::Guest { vm, vcpu } | Owner::Hypervisor { vm, vcpu }) => {
                k == (vm, vcpu)
            }
            (Kind::Vm(k), Owner::Guest { vm, .. } | Owner::Hypervisor { vm, .. }) => k == vm,
            (Kind::HvNoVm, Owner::Hypervisor { vm, .. }) => vm == hvprof_samplelog::NO_VM,
            _ => false,
        }
    }
}

/// One pCPU's units (samples, or segments) indexed by owner: what a run's slots are counted with.
pub struct PcpuIndex<C = Positions> {
    /// Units owned by a vCPU: its guest or the hypervisor on its behalf.
    by_vcpu: HashMap<(u16, u16), C>,
    /// Guest units of a vCPU.
    guest: HashMap<(u16, u16), C>,
    /// Units owned by a VM (guest or hypervisor on its behalf).
    by_vm: HashMap<u16, C>,
    /// The hypervisor working for no VM.
    hv_no_vm: C,
    /// Each VM's vCPUs that own units here, sorted.
    vcpus: HashMap<u16, Vec<u16>>,
}

impl<C: Counter> PcpuIndex<C> {
    /// Indexes one pCPU's units (in TSC order): each one's owner and samples. The counters
    /// are kept in one list while they fill, each owner's found once (by its last unit's
    /// owner, else a lookup), and put in their maps at the end: a pCPU has hundreds of
    /// thousands of units and a few owners.
    pub fn new(units: impl Iterator<Item = (Owner, u64)>) -> Self {
        /// Where an owner's units are counted, in `counters`: by its vCPU, by its VM, and its
        /// guest units or the hypervisor's for no VM.
        #[derive(Clone, Copy)]
        struct Slots {
            vcpu: usize,
            vm: usize,
            also: Option<usize>,
        }
        let mut ix = PcpuIndex {
            by_vcpu: HashMap::default(),
            guest: HashMap::default(),
            by_vm: HashMap::default(),
            hv_no_vm: C::default(),
            vcpus: HashMap::default(),
        };
        // Counter 0 is the hypervisor's for no VM; then each map's counters as first met.
        let mut counters: Vec<C> = vec![C::default()];
        let mut vcpu_at: HashMap<(u16, u16), usize> = HashMap::default();
        let mut guest_at: HashMap<(u16, u16), usize> = HashMap::default();
        let mut vm_at: HashMap<u16, usize> = HashMap::default();
        let mut of_owner: HashMap<Owner, Slots> = HashMap::default();
        let mut last: Option<(Owner, Slots)> = None;
        for (i, (owner, n)) in units.enumerate() {
            let slots = match last {
                Some((o, s)) if o == owner => s,
                _ => {
                    let (vm, vcpu, guest) = match owner {
                        Owner::Guest { vm, vcpu } => (vm, vcpu, true),
                        Owner::Hypervisor { vm, vcpu } => (vm, vcpu, false),
                        Owner::Idle => continue,
                    };
                    let s = *of_owner.entry(owner).or_insert_with(|| {
                        let at = |counters: &mut Vec<C>| {
                            counters.push(C::default());
                            counters.len() - 1
                        };
                        let vcpu_slot = *vcpu_at
                            .entry((vm, vcpu))
                            .or_insert_with(|| at(&mut counters));
                        Slots {
                            vcpu: vcpu_slot,
                            vm: *vm_at.entry(vm).or_insert_with(|| at(&mut counters)),
                            also: if guest {
                                Some(
                                    *guest_at
                                        .entry((vm, vcpu))
                                        .or_insert_with(|| at(&mut counters)),
                                )
                            } else {
                                (vm == hvprof_samplelog::NO_VM).then_some(0)
                            },
                        }
                    });
                    last = Some((owner, s));
                    s
                }
            };
            if let Some(a) = slots.also {
                counters[a].push(i, n);
            }
            counters[slots.vcpu].push(i, n);
            counters[slots.vm].push(i, n);
        }
        ix.vcpus = vcpus_by_vm(vcpu_at.keys().copied());
        let mut take = |at: usize| std::mem::take(&mut counters[at]);
        ix.by_vcpu = vcpu_at.into_iter().map(|(k, at)| (k, take(at))).collect();
        ix.guest = guest_at.into_iter().map(|(k, at)| (k, take(at))).collect();
        ix.by_vm = vm_at.into_iter().map(|(k, at)| (k, take(at))).collect();
        ix.hv_no_vm = take(0);
        ix
    }
}

impl PcpuIndex<Positions> {
    /// Indexes one pCPU's samples (in TSC order) from its list.
    pub fn of_list<L: Lists>(lists: &L, list: &[L::Item]) -> Self {
        PcpuIndex::new(list.iter().map(|item| (lists.owner(item), 1)))
    }
}

/// The samples of a vCPU's run on one pCPU: the whole units in `whole` (counted through the
/// index), and in `parts` samples counted by owner: at most two units of which only some
/// samples fall in the run, and (a short run over segments) its whole segments, per owner.
pub struct Window<'a, C> {
    /// The units indexed, for `whole` (none when `whole` is empty).
    ix: Option<&'a PcpuIndex<C>>,
    /// Each VM's vCPUs that own units on the pCPU, sorted.
    vcpus: &'a HashMap<u16, Vec<u16>>,
    whole: Range<usize>,
    parts: Vec<(Owner, u64)>,
    /// Its samples.
    len: u64,
}

impl<'a> Window<'a, Positions> {
    /// The samples `r` of a pCPU's list.
    pub fn samples(ix: &'a PcpuIndex<Positions>, r: Range<usize>) -> Self {
        Window {
            ix: Some(ix),
            vcpus: &ix.vcpus,
            len: r.len() as u64,
            whole: r,
            parts: Vec::new(),
        }
    }
}

impl<C: Counter> Window<'_, C> {
    fn count(&self, kind: Kind) -> u64 {
        let map = |c: Option<&C>| c.map_or(0, |c| c.count(&self.whole));
        // An empty range counts nothing: no counter is looked up.
        let whole = match self.ix.filter(|_| !self.whole.is_empty()) {
            None => 0,
            Some(ix) => match kind {
                Kind::Guest(v) => map(ix.guest.get(&v)),
                Kind::Vcpu(v) => map(ix.by_vcpu.get(&v)),
                Kind::Vm(vm) => map(ix.by_vm.get(&vm)),
                Kind::HvNoVm => map(Some(&ix.hv_no_vm)),
            },
        };
        let parts: u64 = self
            .parts
            .iter()
            .filter(|(o, _)| kind.holds(*o))
            .map(|(_, n)| n)
            .sum();
        whole + parts
    }

    /// Guest samples of `vcpu`: its [`Slot::Own`] slots while in.
    pub fn own(&self, vcpu: (u16, u16)) -> u64 {
        self.count(Kind::Guest(vcpu))
    }

    /// [`Slot::HypervisorOut`] slots of `vcpu` while it is out.
    pub fn hypervisor_out(&self, (vm, vcpu): (u16, u16)) -> u64 {
        if vm == hvprof_samplelog::NO_VM {
            // Its own "VM": the hypervisor's samples for the other vCPUs are siblings'.
            self.count(Kind::Vcpu((vm, vcpu))) - self.own((vm, vcpu))
        } else {
            self.count(Kind::HvNoVm)
        }
    }

    /// [`Slot::StealOn`] slots of `vcpu` while it is out: all of them, and per sibling (the
    /// first [`STEAL_ON_MAX`] of its VM's vCPUs here; the rest are in the total only).
    pub fn steal_on(&self, (vm, vcpu): (u16, u16)) -> (u64, Vec<(u16, u64)>) {
        let total = self.count(Kind::Vm(vm)) - self.count(Kind::Vcpu((vm, vcpu)));
        let mut each = Vec::new();
        if total > 0 {
            for &c in self.vcpus.get(&vm).into_iter().flatten().take(STEAL_ON_MAX) {
                if c != vcpu {
                    let n = self.count(Kind::Vcpu((vm, c)));
                    if n > 0 {
                        each.push((c, n));
                    }
                }
            }
        }
        (total, each)
    }

    /// Adds the slots of `vcpu`, in `class` over the window, to `b`.
    fn add_slots(&self, vcpu: (u16, u16), class: Class, b: &mut Blanks) {
        match class {
            Class::In => b.hypervisor += self.len - self.own(vcpu),
            Class::OutHalted => b.idle += self.len,
            Class::Out => {
                let hv = self.hypervisor_out(vcpu);
                let (steal_on, each) = self.steal_on(vcpu);
                b.hypervisor_out += hv;
                b.steal_outside += self.len - hv - steal_on;
                // Who held the pCPU: every other VM with units here.
                for (&v, _) in self
                    .vcpus
                    .iter()
                    .filter(|(v, _)| **v != vcpu.0 && **v != hvprof_samplelog::NO_VM)
                {
                    let n = self.count(Kind::Vm(v));
                    if n > 0 {
                        *b.steal_by_vm.entry(v).or_default() += n;
                    }
                }
                // The vCPU's own samples while out (a forged log) are steal outside by its VM.
                let own = self.count(Kind::Vcpu(vcpu));
                if own > 0 && vcpu.0 != hvprof_samplelog::NO_VM {
                    *b.steal_by_vm.entry(vcpu.0).or_default() += own;
                }
                let mut named = 0;
                for (c, n) in each {
                    *b.steal_on.entry(c).or_default() += n;
                    named += n;
                }
                b.steal_on_others += steal_on - named;
            }
        }
    }
}

/// A stretch of a vCPU's time on a pCPU, `[start, end)`: from one of its events to its next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stretch {
    pub vcpu: (u16, u16),
    pub pcpu: u16,
    pub start: u64,
    pub end: u64,
}

/// Every vCPU's stretches out while runnable (preempted, yielded: [`Class::Out`]), each on the
/// pCPU it went out of, sorted by start (a stopped vCPU's last out is no stretch, nor is one
/// with no later event).
pub fn out_stretches(events: &[(u16, Event)]) -> Vec<Stretch> {
    let mut out = Vec::new();
    for (key, track) in tracks(events) {
        for w in track.events.windows(2) {
            let e = w[0].2;
            if e.kind == EventKind::VcpuOut
                && !matches!(e.reason, OutReason::Halted | OutReason::Stopped)
                && w[1].0 > w[0].0
            {
                out.push(Stretch {
                    vcpu: key,
                    pcpu: w[0].1,
                    start: w[0].0,
                    end: w[1].0,
                });
            }
        }
    }
    out.sort_unstable_by_key(|o| (o.start, o.pcpu, o.vcpu));
    out
}

/// Who held each pCPU when: the vCPUs' stretches in, per pCPU sorted by start, each with the
/// latest end of those up to it (ascending even where a forged log overlaps them).
#[derive(Default)]
pub struct Holders {
    by_pcpu: HashMap<u16, Vec<(Stretch, u64)>>,
}

impl Holders {
    /// From the vCPUs' stretches in.
    pub fn new(ins: impl IntoIterator<Item = Stretch>) -> Holders {
        let mut by_pcpu: HashMap<u16, Vec<Stretch>> = HashMap::default();
        for s in ins.into_iter().filter(|s| s.end > s.start) {
            by_pcpu.entry(s.pcpu).or_default().push(s);
        }
        let by_pcpu = by_pcpu
            .into_iter()
            .map(|(pcpu, mut list)| {
                list.sort_unstable_by_key(|h| (h.start, h.vcpu));
                let mut latest = 0;
                let list = list
                    .into_iter()
                    .map(|h| {
                        latest = latest.max(h.end);
                        (h, latest)
                    })
                    .collect();
                (pcpu, list)
            })
            .collect();
        Holders { by_pcpu }
    }

    /// Adds to `by` the ticks of `out` (a vCPU's stretch out) each other vCPU was in on its
    /// pCPU.
    pub fn add(&self, out: &Stretch, by: &mut HashMap<(u16, u16), u64>) {
        let Some(list) = self.by_pcpu.get(&out.pcpu) else {
            return;
        };
        let first = list.partition_point(|&(_, latest)| latest <= out.start);
        for (h, _) in list[first..].iter().take_while(|(h, _)| h.start < out.end) {
            let overlap = h.end.min(out.end).saturating_sub(h.start.max(out.start));
            if overlap > 0 && h.vcpu != out.vcpu {
                *by.entry(h.vcpu).or_default() += overlap;
            }
        }
    }
}

/// The vCPUs' stretches in, from their tracks.
fn in_stretches(tracks: &[((u16, u16), Track)]) -> Holders {
    Holders::new(tracks.iter().flat_map(|(key, track)| {
        track
            .events
            .windows(2)
            .filter(|w| w[0].2.kind == EventKind::VcpuIn)
            .map(|w| Stretch {
                vcpu: *key,
                pcpu: w[0].1,
                start: w[0].0,
                end: w[1].0,
            })
    }))
}

/// Each vCPU's exact ticks in, out halted and out otherwise, and who held its pCPU while it
/// was out, from the events.
fn exact_ticks(events: &[(u16, Event)]) -> HashMap<(u16, u16), Blanks> {
    let mut out: HashMap<(u16, u16), Blanks> = HashMap::default();
    let tracks = tracks(events);
    let holders = in_stretches(&tracks);
    for (key, track) in tracks {
        let b = out.entry(key).or_default();
        b.yields += track
            .events
            .iter()
            .filter(|e| e.2.kind == EventKind::VcpuOut && e.2.reason == OutReason::Yielded)
            .count() as u64;
        // Exact time, from the events.
        for w in track.events.windows(2) {
            let span = w[1].0.saturating_sub(w[0].0);
            let ticks = match (w[0].2.kind, w[0].2.reason) {
                (EventKind::VcpuIn, _) => &mut b.ticks_in,
                (EventKind::VcpuOut, OutReason::Halted) => &mut b.ticks_halted,
                (EventKind::VcpuOut, OutReason::Stopped) => continue,
                (EventKind::VcpuOut, _) => {
                    let out = Stretch {
                        vcpu: key,
                        pcpu: w[0].1,
                        start: w[0].0,
                        end: w[1].0,
                    };
                    holders.add(&out, &mut b.ticks_out_by);
                    &mut b.ticks_out
                }
            };
            *ticks = ticks.saturating_add(span);
        }
    }
    out
}

/// Classifies every vCPU's blank slots. `samples`: per pCPU, (TSC, owner) in TSC order;
/// `events`: every scheduling event with its pCPU. Counts per run (see [`runs`]), never per
/// slot: time O((E + S) log(E + S)), with at most [`STEAL_ON_MAX`] siblings per run.
pub fn blanks<L: Lists + Sync>(
    samples: &L,
    events: &[(u16, Event)],
) -> HashMap<(u16, u16), Blanks> {
    let mut out = exact_ticks(events);
    let index: HashMap<u16, PcpuIndex> = crate::model::par::par_map(samples.pcpus(), |p| {
        samples.list(p).map(|l| (p, PcpuIndex::of_list(samples, l)))
    })
    .into_iter()
    .flatten()
    .collect();
    for run in runs(samples, events) {
        let b = out.entry(run.vcpu).or_default();
        Window::samples(&index[&run.pcpu], run.samples).add_slots(run.vcpu, run.class, b);
    }
    out
}

/// A stretch of one pCPU's samples, consecutive in TSC order, with one owner (an index into
/// [`Segments::owners`]): the common time axis kept at the size of its owner changes, not of
/// its samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// TSC of its first and last sample.
    pub first: u64,
    pub last: u64,
    pub owner: u32,
    pub count: u32,
}

/// Per pCPU (ascending), its samples as [`Segment`]s in TSC order (each one's `last` at most
/// the next one's `first`).
#[derive(Clone, Debug, Default)]
pub struct Segments {
    pub owners: Vec<Owner>,
    pub pcpus: Vec<(u16, Vec<Segment>)>,
}

impl Segments {
    /// A pCPU's segments from its samples' (TSC, owner index) in TSC order.
    pub fn push_sample(list: &mut Vec<Segment>, tsc: u64, owner: u32) {
        match list.last_mut() {
            Some(s) if s.owner == owner && s.count < u32::MAX => {
                s.last = tsc;
                s.count += 1;
            }
            _ => list.push(Segment {
                first: tsc,
                last: tsc,
                owner,
                count: 1,
            }),
        }
    }
}

/// `list.partition_point(pred)` for a `pred` known to hold on `list[..start]`: searched from
/// `start` in steps that double, then by halves in the last step (a run's segments are few, and
/// a binary search over the whole list misses the cache at every step).
fn partition_from<T>(list: &[T], start: usize, pred: impl Fn(&T) -> bool) -> usize {
    let mut lo = start.min(list.len());
    let mut step = 1;
    loop {
        let probe = lo + step - 1;
        match list.get(probe) {
            Some(x) if pred(x) => {
                lo = probe + 1;
                step *= 2;
            }
            _ => {
                let end = probe.min(list.len());
                return lo + list[lo..end].partition_point(pred);
            }
        }
    }
}

/// Runs over at most this many segments (of at most [`DIRECT_OWNERS`] owners) are counted
/// segment by segment in [`segment_blanks`] (most runs are over a few; the index of a pCPU's
/// segments is made for the first run over more, if any).
const DIRECT_SEGMENTS: usize = 256;

/// Owners of the segments of a run counted one by one at most (more go through the index).
const DIRECT_OWNERS: usize = 16;

/// Adds the samples of `segs` to `parts` per owner, if they have at most [`DIRECT_OWNERS`]
/// owners; else leaves `parts` as it was and returns false.
fn count_per_owner(parts: &mut Vec<(Owner, u64)>, segs: &[Segment], owners: &[Owner]) -> bool {
    let before = parts.len();
    for s in segs {
        let owner = owners[s.owner as usize];
        let added = parts.len() - before;
        match parts[before..].iter_mut().find(|(o, _)| *o == owner) {
            Some((_, n)) => *n += u64::from(s.count),
            None if added < DIRECT_OWNERS => parts.push((owner, u64::from(s.count))),
            None => {
                parts.truncate(before);
                return false;
            }
        }
    }
    true
}

/// One pCPU's segments, as [`segment_blanks`] counts a vCPU's runs on them.
struct PcpuSegments<'a> {
    segs: &'a [Segment],
    /// Each VM's vCPUs that own segments here, sorted.
    vcpus: HashMap<u16, Vec<u16>>,
    /// The segments indexed by owner, and the samples before each.
    index: std::sync::OnceLock<(PcpuIndex<Cumulative>, Prefix)>,
}

/// Each VM's vCPUs among `vcpus` (VM, vCPU), sorted.
fn vcpus_by_vm(vcpus: impl Iterator<Item = (u16, u16)>) -> HashMap<u16, Vec<u16>> {
    let mut out: HashMap<u16, Vec<u16>> = HashMap::default();
    for (vm, vcpu) in vcpus {
        out.entry(vm).or_default().push(vcpu);
    }
    for v in out.values_mut() {
        v.sort_unstable();
        v.dedup();
    }
    out
}

/// [`blanks`] from [`Segments`]: the same figures, counted per segment. `partial(pcpu, i, lo,
/// hi)` counts the samples of segment `i` of `pcpu` with `lo <= tsc` and `tsc < hi` (no upper
/// bound without `hi`): the only place individual samples are read, for the segments a
/// scheduling event falls inside (a vCPU leaving or entering a pCPU while another owner's
/// samples run on there, which the pCPU's own events never do).
pub fn segment_blanks(
    segments: &Segments,
    events: &[(u16, Event)],
    partial: &(dyn Fn(u16, usize, u64, Option<u64>) -> u64 + Sync),
) -> HashMap<(u16, u16), Blanks> {
    blanks_counting(segments, events, partial, DIRECT_SEGMENTS)
}

/// [`segment_blanks`], counting runs over at most `direct` segments segment by segment.
fn blanks_counting(
    segments: &Segments,
    events: &[(u16, Event)],
    partial: &(dyn Fn(u16, usize, u64, Option<u64>) -> u64 + Sync),
    direct: usize,
) -> HashMap<(u16, u16), Blanks> {
    let mut out = exact_ticks(events);
    let owners = &segments.owners;
    // Per pCPU: its segments, each VM's vCPUs among their owners, and (made for the first run
    // over many segments, on the core that meets it) their index by owner and their samples.
    let index: HashMap<u16, PcpuSegments> =
        crate::model::par::par_map(segments.pcpus.iter().collect(), |(p, segs)| {
            // Its owners, each once (found per change of owner: a forged capture may have
            // more owners than a pCPU has segments).
            let mut present: HashSet<u32> = HashSet::default();
            let mut last = None;
            for s in segs {
                if last != Some(s.owner) {
                    present.insert(s.owner);
                    last = Some(s.owner);
                }
            }
            let entry = PcpuSegments {
                segs,
                vcpus: vcpus_by_vm(
                    present
                        .into_iter()
                        .filter_map(|o| owners[o as usize].vcpu()),
                ),
                index: std::sync::OnceLock::new(),
            };
            (*p, entry)
        })
        .into_iter()
        .collect();
    // Each vCPU's slots (its events in order), the vCPUs on every core, then added to their
    // exact ticks.
    let slots = crate::model::par::par_map(tracks(events), |(vcpu, track)| {
        let mut b = Blanks::default();
        // The window's partial segments, kept from event to event.
        let mut parts = Vec::new();
        // Per pCPU, where the track's last run there started.
        let mut cursors: HashMap<u16, usize> = HashMap::default();
        for (k, &(t, pcpu, e)) in track.events.iter().enumerate() {
            let class = match (e.kind, e.reason) {
                (EventKind::VcpuIn, _) => Class::In,
                (EventKind::VcpuOut, OutReason::Stopped) => break,
                (EventKind::VcpuOut, OutReason::Halted) => Class::OutHalted,
                (EventKind::VcpuOut, _) => Class::Out,
            };
            let Some(PcpuSegments { segs, vcpus, index }) = index.get(&pcpu) else {
                continue;
            };
            let next = track.events.get(k + 1).map(|&(n, _, _)| n);
            let below = |x: u64| next.is_none_or(|n| x < n);
            // The track's events come in TSC order, so on one pCPU each run starts at or after
            // the previous one's start: searched from there.
            let cursor = cursors.entry(pcpu).or_insert(0);
            let from = partition_from(segs, *cursor, |s| s.last < t);
            *cursor = from;
            let to = partition_from(segs, from, |s| below(s.first));
            if from == to {
                continue;
            }
            let mut w = Window {
                ix: None,
                vcpus,
                whole: from..to,
                parts: std::mem::take(&mut parts),
                len: 0,
            };
            let cut_start = segs[from].first < t;
            let cut_end = !below(segs[to - 1].last);
            if cut_start || cut_end {
                if to - from == 1 {
                    w.whole = from..from;
                    let n = partial(pcpu, from, t, next);
                    w.parts.push((owners[segs[from].owner as usize], n));
                } else {
                    if cut_start {
                        w.whole.start += 1;
                        let n = partial(pcpu, from, t, None);
                        w.parts.push((owners[segs[from].owner as usize], n));
                    }
                    if cut_end {
                        w.whole.end -= 1;
                        let n = partial(pcpu, to - 1, 0, next);
                        w.parts.push((owners[segs[to - 1].owner as usize], n));
                    }
                }
            }
            // A run over a few segments of a few owners (most runs) counts them one by one, per
            // owner: cheaper than the index's searches, which are for runs over many.
            let mut whole = 0;
            if w.whole.len() <= direct
                && count_per_owner(&mut w.parts, &segs[w.whole.clone()], owners)
            {
                w.whole = from..from;
            } else {
                let (ix, all) = index.get_or_init(|| {
                    let units = segs
                        .iter()
                        .map(|s| (owners[s.owner as usize], u64::from(s.count)));
                    let all = Prefix::new(segs.iter().map(|s| u64::from(s.count)));
                    (PcpuIndex::new(units), all)
                });
                w.ix = Some(ix);
                whole = all.count(&w.whole);
            }
            w.len = whole + w.parts.iter().map(|(_, n)| n).sum::<u64>();
            if w.len > 0 {
                w.add_slots(vcpu, class, &mut b);
            }
            parts = w.parts;
            parts.clear();
        }
        (vcpu, b)
    });
    for (vcpu, b) in slots {
        let o = out.entry(vcpu).or_default();
        o.idle += b.idle;
        o.steal_on_others += b.steal_on_others;
        o.steal_outside += b.steal_outside;
        for (v, n) in b.steal_by_vm {
            *o.steal_by_vm.entry(v).or_default() += n;
        }
        o.hypervisor += b.hypervisor;
        o.hypervisor_out += b.hypervisor_out;
        // The exact ticks have no slots: the vCPU's map as it was made.
        if o.steal_on.is_empty() {
            o.steal_on = b.steal_on;
        } else {
            for (c, n) in b.steal_on {
                *o.steal_on.entry(c).or_default() += n;
            }
        }
    }
    out
}

/// The classification slot by slot, as it was before [`runs`]: for every vCPU, every sample of
/// every pCPU, looking its state up (quadratic). The reference the tests compare with.
#[cfg(test)]
pub(crate) fn naive_classify(
    samples: &HashMap<u16, Vec<(u64, Owner)>>,
    events: &[(u16, Event)],
    mut visit: impl FnMut((u16, u16), u16, usize, Slot),
) {
    for (key, track) in tracks(events) {
        // A stopped vCPU stays stopped.
        let cut = track
            .events
            .iter()
            .position(|e| e.2.kind == EventKind::VcpuOut && e.2.reason == OutReason::Stopped)
            .map_or(track.events.len(), |i| i + 1);
        let evs = &track.events[..cut];
        for (&pcpu, list) in samples {
            let mut cursor = 0;
            for (i, &(t, owner)) in list.iter().enumerate() {
                while cursor < evs.len() && evs[cursor].0 <= t {
                    cursor += 1;
                }
                let Some(&(_, p, e)) = cursor.checked_sub(1).and_then(|c| evs.get(c)) else {
                    continue;
                };
                let class = match (e.kind, e.reason) {
                    (EventKind::VcpuIn, _) => Class::In,
                    (EventKind::VcpuOut, OutReason::Stopped) => break,
                    (EventKind::VcpuOut, OutReason::Halted) => Class::OutHalted,
                    (EventKind::VcpuOut, _) => Class::Out,
                };
                if p == pcpu {
                    visit(key, pcpu, i, slot(key, class, owner));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// [`blanks`] from [`naive_classify`].
    fn naive_blanks(
        samples: &HashMap<u16, Vec<(u64, Owner)>>,
        events: &[(u16, Event)],
    ) -> HashMap<(u16, u16), Blanks> {
        let mut out: HashMap<(u16, u16), Blanks> = HashMap::default();
        for (key, b) in blanks(&HashMap::default(), events) {
            // The exact ticks only: no samples.
            out.insert(key, b);
        }
        naive_classify(samples, events, |key, _, _, slot| {
            let b = out.entry(key).or_default();
            match slot {
                Slot::Own => {}
                Slot::Hypervisor => b.hypervisor += 1,
                Slot::Idle => b.idle += 1,
                Slot::StealOn(c) => *b.steal_on.entry(c).or_default() += 1,
                Slot::HypervisorOut => b.hypervisor_out += 1,
                Slot::StealOutside(by) => {
                    b.steal_outside += 1;
                    if let Some(v) = by {
                        *b.steal_by_vm.entry(v).or_default() += 1;
                    }
                }
            }
        });
        out
    }

    fn arb_owner() -> impl Strategy<Value = Owner> {
        let vm = prop_oneof![Just(0u16), Just(1), Just(hvprof_samplelog::NO_VM)];
        prop_oneof![
            (vm.clone(), 0u16..4).prop_map(|(vm, vcpu)| Owner::Guest { vm, vcpu }),
            (vm, 0u16..4).prop_map(|(vm, vcpu)| Owner::Hypervisor { vm, vcpu }),
            Just(Owner::Idle),
        ]
    }

    fn arb_event() -> impl Strategy<Value = (u16, Event)> {
        let vm = prop_oneof![Just(0u16), Just(1), Just(hvprof_samplelog::NO_VM)];
        (0u16..3, 0u64..60, vm, 0u16..4, any::<bool>(), 0u8..4).prop_map(
            |(pcpu, tsc, vm, vcpu, out, reason)| {
                (
                    pcpu,
                    Event {
                        tsc,
                        kind: if out {
                            EventKind::VcpuOut
                        } else {
                            EventKind::VcpuIn
                        },
                        vm,
                        vcpu,
                        reason: OutReason::from_u8(reason).unwrap_or_default(),
                    },
                )
            },
        )
    }

    /// Per pCPU (its place in `lists`), its list sorted by TSC.
    fn sorted_lists(lists: Vec<Vec<(u64, Owner)>>) -> HashMap<u16, Vec<(u64, Owner)>> {
        let mut samples = HashMap::default();
        for (p, mut l) in lists.into_iter().enumerate() {
            l.sort_by_key(|s| s.0);
            samples.insert(p as u16, l);
        }
        samples
    }

    /// [`segment_blanks`] of per-pCPU (TSC, owner) lists: their segments, and partial counts
    /// read from the lists. Checks that counting every run through the index, or none, gives
    /// the same.
    fn blanks_by_segments(
        samples: &HashMap<u16, Vec<(u64, Owner)>>,
        events: &[(u16, Event)],
    ) -> HashMap<(u16, u16), Blanks> {
        let mut segments = Segments::default();
        let mut owner_ids: HashMap<Owner, u32> = HashMap::default();
        let mut pcpus: Vec<u16> = samples.keys().copied().collect();
        pcpus.sort_unstable();
        for p in pcpus {
            let mut list = Vec::new();
            for &(t, o) in &samples[&p] {
                let id = *owner_ids.entry(o).or_insert_with(|| {
                    segments.owners.push(o);
                    (segments.owners.len() - 1) as u32
                });
                Segments::push_sample(&mut list, t, id);
            }
            segments.pcpus.push((p, list));
        }
        let partial = |p: u16, i: usize, lo: u64, hi: Option<u64>| -> u64 {
            let segs = &segments.pcpus.iter().find(|(c, _)| *c == p).unwrap().1;
            let start: usize = segs[..i].iter().map(|s| s.count as usize).sum();
            samples[&p][start..start + segs[i].count as usize]
                .iter()
                .filter(|(t, _)| *t >= lo && hi.is_none_or(|h| *t < h))
                .count() as u64
        };
        let counted = segment_blanks(&segments, events, &partial);
        assert_eq!(counted, blanks_counting(&segments, events, &partial, 0));
        assert_eq!(
            counted,
            blanks_counting(&segments, events, &partial, usize::MAX)
        );
        counted
    }

    proptest! {
        /// Counting per segment gives what counting per sample gives.
        #[test]
        fn segments_count_what_samples_count(
            events in prop::collection::vec(arb_event(), 0..40),
            lists in prop::collection::vec(prop::collection::vec((0u64..60, arb_owner()), 0..60), 1..4),
            runs_of in 1usize..6,
        ) {
            let mut samples: HashMap<u16, Vec<(u64, Owner)>> = HashMap::default();
            for (p, mut l) in lists.into_iter().enumerate() {
                l.sort_by_key(|s| s.0);
                // Owners in runs, as a pCPU's samples come (one vCPU for a while).
                for i in 1..l.len() {
                    if i % runs_of != 0 {
                        l[i].1 = l[i - 1].1;
                    }
                }
                samples.insert(p as u16, l);
            }
            prop_assert_eq!(blanks_by_segments(&samples, &events), blanks(&samples, &events));
        }

        /// The same with long runs over many segments: few events over many samples whose
        /// owner changes often.
        #[test]
        fn segments_of_long_runs_count_what_samples_count(
            events in prop::collection::vec(arb_event(), 0..8),
            lists in prop::collection::vec(prop::collection::vec((0u64..60, arb_owner()), 0..400), 1..3),
        ) {
            let samples = sorted_lists(lists);
            prop_assert_eq!(blanks_by_segments(&samples, &events), blanks(&samples, &events));
        }

        /// The search from a known start finds what the binary search over the list finds.
        #[test]
        fn partition_from_is_partition_point(
            mut list in prop::collection::vec(0u32..1000, 0..300),
            x in 0u32..1100,
            start in 0usize..400,
        ) {
            list.sort_unstable();
            let want = list.partition_point(|&v| v < x);
            // Any start at or before the answer (the predicate holds before it).
            let start = start.min(want);
            prop_assert_eq!(partition_from(&list, start, |&v| v < x), want);
        }

        /// Counting per run gives what classifying slot by slot gives, on any events (out of
        /// order, at equal TSCs, on several pCPUs, `NO_VM` as a VM) and any owners.
        #[test]
        fn runs_count_what_slots_count(
            events in prop::collection::vec(arb_event(), 0..40),
            lists in prop::collection::vec(prop::collection::vec((0u64..60, arb_owner()), 0..60), 1..4),
        ) {
            let samples = sorted_lists(lists);
            prop_assert_eq!(blanks(&samples, &events), naive_blanks(&samples, &events));
            let mut slots = Vec::new();
            classify(&samples, &events, |k, p, i, s| slots.push((k, p, i, format!("{s:?}"))));
            let mut naive = Vec::new();
            naive_classify(&samples, &events, |k, p, i, s| naive.push((k, p, i, format!("{s:?}"))));
            slots.sort();
            naive.sort();
            prop_assert_eq!(slots, naive);
        }
    }

    /// The figure in docs/FUZZING.md: `cargo test --release -p hvprof-analyze --lib
    /// timeline::tests::bench_many_vcpus -- --ignored --nocapture`.
    #[test]
    #[ignore = "a benchmark"]
    fn bench_many_vcpus() {
        for k in [1000u64, 4000] {
            let (samples, events) = many_vcpus(k, 20);
            let t = std::time::Instant::now();
            let fast = blanks(&samples, &events);
            let fast_t = t.elapsed();
            let t = std::time::Instant::now();
            let slow = naive_blanks(&samples, &events);
            let slow_t = t.elapsed();
            assert_eq!(fast, slow);
            println!(
                "{k} vCPUs, {} samples, {} events: runs {fast_t:.2?}, slot by slot {slow_t:.2?}",
                k * 20,
                events.len()
            );
        }
    }

    type Lists = HashMap<u16, Vec<(u64, Owner)>>;

    /// `k` vCPUs, each in once for `own` samples on one of two pCPUs, then out for good.
    fn many_vcpus(k: u64, own: u64) -> (Lists, Vec<(u16, Event)>) {
        let mut events = Vec::new();
        let mut samples: HashMap<u16, Vec<(u64, Owner)>> = HashMap::default();
        for k in 0..k {
            let (vm, vcpu, pcpu) = ((k / 8) as u16, (k % 8) as u16, (k % 2) as u16);
            let t = 100 * k;
            let ev = |tsc, kind| {
                (
                    pcpu,
                    Event {
                        tsc,
                        kind,
                        vm,
                        vcpu,
                        reason: OutReason::Preempted,
                    },
                )
            };
            events.push(ev(t, EventKind::VcpuIn));
            let list = samples.entry(pcpu).or_default();
            list.extend((1..=own).map(|i| (t + i, Owner::Guest { vm, vcpu })));
            events.push(ev(t + own + 1, EventKind::VcpuOut));
        }
        (samples, events)
    }

    /// Thousands of vCPUs, each in once on one of two pCPUs and then out (preempted) for good:
    /// every later sample of its pCPU is a blank of all of them. VM `k / 8`, vCPU `k % 8`.
    #[test]
    fn thousands_of_vcpus() {
        const K: u64 = 3000;
        const OWN: u64 = 20;
        let (samples, events) = many_vcpus(K, OWN);
        let b = blanks(&samples, &events);
        assert_eq!(b.len(), K as usize);
        for k in 0..K {
            let x = &b[&((k / 8) as u16, (k % 8) as u16)];
            // Later vCPUs on the same pCPU: the rest of its VM's octet, then the others.
            let later = (k + 2..K).step_by(2);
            let siblings: Vec<u64> = later.clone().filter(|j| j / 8 == k / 8).collect();
            let outside = later.count() as u64 - siblings.len() as u64;
            assert_eq!(x.steal_outside, OWN * outside, "vCPU {k}");
            assert_eq!(x.steal_on.len(), siblings.len(), "vCPU {k}");
            for j in siblings {
                assert_eq!(x.steal_on[&((j % 8) as u16)], OWN);
            }
            assert_eq!((x.idle, x.hypervisor, x.hypervisor_out), (0, 0, 0));
            assert_eq!((x.ticks_in, x.ticks_out), (OWN + 1, 0));
        }
    }

    /// The same counted per segment: each vCPU's last run (out for good) spans the later
    /// vCPUs' segments on its pCPU (one each), up to 500 (counted through the pCPU's index),
    /// the last vCPUs' a few (counted one by one).
    #[test]
    fn a_thousand_vcpus_by_segments() {
        let (samples, events) = many_vcpus(1000, 20);
        assert_eq!(
            blanks_by_segments(&samples, &events),
            blanks(&samples, &events)
        );
    }

    fn ev(tsc: u64, vm: u16, vcpu: u16, kind: EventKind, reason: OutReason) -> (u16, Event) {
        (
            0,
            Event {
                tsc,
                kind,
                vm,
                vcpu,
                reason,
            },
        )
    }

    #[test]
    fn three_vms_round_robin_on_one_pcpu() {
        // Slices of 10 ticks: vm0, vm1, vm2, vm0, ...; a sample every tick owned by the runner.
        let mut events = Vec::new();
        let mut samples = Vec::new();
        for slice in 0..30u64 {
            let vm = (slice % 3) as u16;
            let start = slice * 10;
            events.push(ev(start, vm, 0, EventKind::VcpuIn, OutReason::Preempted));
            for t in start..start + 10 {
                samples.push((t, Owner::Guest { vm, vcpu: 0 }));
            }
            let reason = if slice >= 27 {
                OutReason::Stopped
            } else {
                OutReason::Preempted
            };
            events.push(ev(start + 10, vm, 0, EventKind::VcpuOut, reason));
        }
        let mut per: HashMap<u16, Vec<(u64, Owner)>> = HashMap::default();
        per.insert(0, samples);
        let b = blanks(&per, &events);
        for vm in 0..3u16 {
            let x = &b[&(vm, 0)];
            // Each VM: 100 own samples; blanks are the others' samples during its life.
            assert_eq!(x.idle, 0);
            assert!(x.steal_on.is_empty());
            let life_end = 280 + 10 * u64::from(vm);
            let blank = (life_end - 10 * u64::from(vm)) - 100;
            assert_eq!(x.steal_outside, blank, "vm {vm}");
            assert_eq!(x.ticks_in, 100);
            // Exactly from the events: while it was out, the other two held the pCPU in turn.
            let by = |other: u16| x.ticks_out_by.get(&(other, 0)).copied().unwrap_or(0);
            let others: Vec<u16> = (0..3).filter(|o| *o != vm).collect();
            assert_eq!(by(others[0]) + by(others[1]), x.ticks_out, "vm {vm}");
            assert_eq!(by(vm), 0);
            // Nine stretches out, each a turn of each other VM.
            assert_eq!((by(others[0]), by(others[1])), (90, 90), "vm {vm}");
        }
    }

    #[test]
    fn who_held_the_pcpu_from_the_events_with_a_gap_and_overlaps() {
        // vm0 out over [10, 40) on pCPU 0; vm1 in [12, 20), nobody [20, 25), vm2 in [25, 45).
        let events = vec![
            ev(0, 0, 0, EventKind::VcpuIn, OutReason::Preempted),
            ev(10, 0, 0, EventKind::VcpuOut, OutReason::Preempted),
            ev(12, 1, 0, EventKind::VcpuIn, OutReason::Preempted),
            ev(20, 1, 0, EventKind::VcpuOut, OutReason::Halted),
            ev(25, 2, 0, EventKind::VcpuIn, OutReason::Preempted),
            ev(40, 0, 0, EventKind::VcpuIn, OutReason::Preempted),
            ev(45, 2, 0, EventKind::VcpuOut, OutReason::Stopped),
            ev(50, 0, 0, EventKind::VcpuOut, OutReason::Stopped),
        ];
        let b = exact_ticks(&events);
        let v0 = &b[&(0, 0)];
        assert_eq!(v0.ticks_out, 30);
        assert_eq!(v0.ticks_out_by.get(&(1, 0)), Some(&8));
        // A forged overlap (vm2 in while vm0 is back in) is counted only inside vm0's stretch.
        assert_eq!(v0.ticks_out_by.get(&(2, 0)), Some(&15));
        // vm1, halted, has no steal to blame.
        assert!(b[&(1, 0)].ticks_out_by.is_empty());
    }

    #[test]
    fn halted_and_sibling_vcpus() {
        // vCPU 0 and 1 of VM 0 share pCPU 0: 0 runs [0,10), 1 runs [10,20), 0 runs [20,30) then
        // halts [30,50), then stops.
        let events = vec![
            ev(0, 0, 0, EventKind::VcpuIn, OutReason::Preempted),
            ev(10, 0, 0, EventKind::VcpuOut, OutReason::Preempted),
            ev(10, 0, 1, EventKind::VcpuIn, OutReason::Preempted),
            ev(20, 0, 1, EventKind::VcpuOut, OutReason::Stopped),
            ev(20, 0, 0, EventKind::VcpuIn, OutReason::Preempted),
            ev(30, 0, 0, EventKind::VcpuOut, OutReason::Halted),
            ev(50, 0, 0, EventKind::VcpuIn, OutReason::Preempted),
            ev(51, 0, 0, EventKind::VcpuOut, OutReason::Stopped),
        ];
        let mut samples = Vec::new();
        for t in 0..50u64 {
            let owner = match t {
                0..10 | 20..30 => Owner::Guest { vm: 0, vcpu: 0 },
                10..20 => Owner::Guest { vm: 0, vcpu: 1 },
                _ => Owner::Idle,
            };
            samples.push((t, owner));
        }
        let mut per: HashMap<u16, Vec<(u64, Owner)>> = HashMap::default();
        per.insert(0, samples);
        let b = blanks(&per, &events);
        let v0 = &b[&(0, 0)];
        assert_eq!(v0.steal_on.get(&1), Some(&10));
        assert_eq!(v0.idle, 20);
        assert_eq!(v0.steal_outside, 0);
        assert_eq!((v0.ticks_in, v0.ticks_out, v0.ticks_halted), (21, 10, 20));
        let v1 = &b[&(0, 1)];
        assert_eq!(
            v1.steal_outside + v1.idle,
            0,
            "vCPU 1 is blank before it starts: not counted"
        );
    }

    #[test]
    fn two_pcpus_pinned_and_scheduler_time() {
        // vCPU 0 on pCPU 0 and vCPU 1 on pCPU 1, each in [0,10) and [12,20), out preempted in
        // [10,12) while its pCPU's scheduler works for no VM; pCPU 1's samples never count for
        // vCPU 0 and the other way round.
        let mut events = Vec::new();
        let mut per: HashMap<u16, Vec<(u64, Owner)>> = HashMap::default();
        for cpu in 0..2u16 {
            let e = |t, kind, reason| {
                let (_, e) = ev(t, 0, cpu, kind, reason);
                (cpu, e)
            };
            events.push(e(0, EventKind::VcpuIn, OutReason::Preempted));
            events.push(e(10, EventKind::VcpuOut, OutReason::Preempted));
            events.push(e(12, EventKind::VcpuIn, OutReason::Preempted));
            events.push(e(20, EventKind::VcpuOut, OutReason::Stopped));
            let samples = (0..20u64)
                .map(|t| {
                    let owner = match t {
                        10 | 11 => Owner::Hypervisor {
                            vm: hvprof_samplelog::NO_VM,
                            vcpu: 0xffff,
                        },
                        5 => Owner::Hypervisor { vm: 0, vcpu: cpu },
                        _ => Owner::Guest { vm: 0, vcpu: cpu },
                    };
                    (t, owner)
                })
                .collect();
            per.insert(cpu, samples);
        }
        let b = blanks(&per, &events);
        for cpu in 0..2u16 {
            let x = &b[&(0, cpu)];
            assert_eq!(x.hypervisor, 1, "its own exit, while in");
            assert_eq!(x.hypervisor_out, 2, "the scheduler, while out");
            assert_eq!(x.steal_outside, 0);
            assert!(x.steal_on.is_empty(), "the sibling runs on another pCPU");
            assert_eq!((x.ticks_in, x.ticks_out), (18, 2));
        }
    }
}
