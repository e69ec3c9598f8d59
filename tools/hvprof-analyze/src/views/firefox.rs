//! Firefox Profiler export (fxprof-processed-profile, the processed profile format): each VM is a
//! process and each of its vCPUs a thread, with its guest samples on the host time axis
//! (stack: guest process, function) and markers for when it ran, was preempted or halted (from
//! the scheduling events); the hypervisor is a process with one thread per pCPU holding its own
//! samples (stack: whom it worked for and on which exit, function) and the idle loop's, and a
//! "records lost" marker over each range where the pCPU's records are missing.
//! pids and tids are those of the `perf script` output.
//!
//! A sample with call chains has its whole stack (`whole_stack::whole_stack`) as its frames: guest
//! samples their process, their callers and their function; the hypervisor's whom it worked
//! for, its callers and its function; on a vCPU's exit with its guest chain, the VM, the guest's
//! frames, `[exit: REASON]`, the hypervisor's frames, its function (on its pCPU's thread). The
//! callers' frames have the category of their code (guest kernel or user, hypervisor).
//!
//! [`write`] writes the file. The skeleton (its processes, threads, categories and markers) is
//! made and serialized with fxprof-processed-profile ([`skeleton`]); each thread's frame,
//! function and stack tables ([`Tables`], numbered as fxprof-processed-profile numbers them:
//! strings after the markers' by first use, a function per string, a frame per (string,
//! category), a stack per (prefix, frame)) are made on every core while the samples are read
//! again into each thread's columns ([`Column`], 8 bytes per sample), and both are written into
//! the skeleton's JSON where fxprof-processed-profile writes a thread's tables. No frame or
//! sample goes through fxprof-processed-profile, which holds 36 bytes per sample (and twice that
//! while its vectors grow) and hashes and copies each frame's name three times (some 1.5 µs per
//! stack of a capture of 460,000 stacks).

use std::borrow::Cow;
use std::io::Write;
use std::ops::Range;

use anyhow::{Context, Result, bail};
use fxprof_processed_profile::{
    CategoryColor, CategoryHandle, CpuDelta, MarkerFieldFlags, MarkerFieldFormat, MarkerTiming,
    Profile as FxProfile, ReferenceTimestamp, SamplingInterval, StaticSchemaMarker,
    StaticSchemaMarkerField, StringHandle, ThreadHandle, Timestamp,
};
use rustc_hash::FxHashMap as HashMap;

use hvprof_samplelog::{EventKind, OutReason};

use crate::model::interner::Interner;
use crate::model::profile::Profile;
use crate::model::progress::Progress;
use crate::model::samples::{Stack, What};
use crate::model::whole_stack::{Part, part_name, whole_stack};
use crate::views::script::ids;

/// A vCPU's scheduling interval.
struct VcpuMarker {
    name: StringHandle,
    why: StringHandle,
    category: CategoryHandle,
}

impl StaticSchemaMarker for VcpuMarker {
    const UNIQUE_MARKER_TYPE_NAME: &'static str = "VcpuState";
    const DESCRIPTION: Option<&'static str> =
        Some("When the vCPU held a pCPU, and why it did not (from the scheduling events)");
    const CHART_LABEL: Option<&'static str> = Some("{marker.data.why}");
    const TABLE_LABEL: Option<&'static str> = Some("{marker.name}: {marker.data.why}");
    const FIELDS: &'static [StaticSchemaMarkerField] = &[StaticSchemaMarkerField {
        key: "why",
        label: "Why",
        format: MarkerFieldFormat::String,
        flags: MarkerFieldFlags::SEARCHABLE,
    }];

    fn name(&self, _profile: &mut FxProfile) -> StringHandle {
        self.name
    }

    fn category(&self, _profile: &mut FxProfile) -> CategoryHandle {
        self.category
    }

    fn string_field_value(&self, _field_index: u32) -> StringHandle {
        self.why
    }

    fn number_field_value(&self, _field_index: u32) -> f64 {
        0.0
    }
}

/// No thread, no Firefox stack (in the lists indexed by the profile's stacks).
const NONE: u32 = u32::MAX;

/// The category of a stack's frames: the code they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Cat {
    User,
    Kernel,
    Hyper,
    Idle,
}

impl Cat {
    fn of(what: What) -> Cat {
        match what {
            What::GuestUser => Cat::User,
            What::GuestKernel => Cat::Kernel,
            What::Hypervisor => Cat::Hyper,
            What::Idle => Cat::Idle,
        }
    }
}

/// The frames' categories in the profile.
#[derive(Clone, Copy)]
struct Categories {
    user: CategoryHandle,
    kernel: CategoryHandle,
    hyper: CategoryHandle,
    idle: CategoryHandle,
}

impl Categories {
    fn handle(&self, c: Cat) -> CategoryHandle {
        match c {
            Cat::User => self.user,
            Cat::Kernel => self.kernel,
            Cat::Hyper => self.hyper,
            Cat::Idle => self.idle,
        }
    }
}

/// A guest function's label: with its module.
fn guest_label<'p>(function: &'p str, module: &str) -> Cow<'p, str> {
    if module.is_empty() {
        Cow::Borrowed(function)
    } else {
        // As `format!("{function} ({module})")`, without the formatting machinery (a label per
        // stack).
        let mut label = String::with_capacity(function.len() + module.len() + 3);
        label.push_str(function);
        label.push_str(" (");
        label.push_str(module);
        label.push(')');
        Cow::Owned(label)
    }
}

/// The frames of a stack of the profile as the Firefox profile shows it, outermost first: each
/// its name (none empty) and category. Without chains: guest samples their process and their
/// function, the hypervisor's whom it worked for and its function, idle `[idle]`; with chains,
/// its whole stack but for the root its thread already says.
fn frames_of<'p>(p: &'p Profile, st: &Stack) -> Vec<(Cow<'p, str>, Cat)> {
    let guest = matches!(st.what, What::GuestKernel | What::GuestUser);
    let cat = Cat::of(st.what);
    let f = &p.frames[st.frame as usize];
    let mut out = Vec::new();
    if let Some(parts) = whole_stack(p, st) {
        for part in &parts {
            let (name, cat) = match part {
                // The thread is the VM's or the hypervisor's already.
                Part::Root(_) if !st.exit_cause && st.what != What::Idle => continue,
                Part::Site(i) => {
                    let c = p.calls.frame(*i);
                    let name = if c.what == What::Hypervisor {
                        Cow::Borrowed(c.function.as_str())
                    } else {
                        guest_label(&c.function, &c.module)
                    };
                    (name, Cat::of(c.what))
                }
                Part::Leaf(f) if guest => (guest_label(&f.function, &f.module), cat),
                other => (part_name(p, other), cat),
            };
            if !name.is_empty() {
                out.push((name, cat));
            }
        }
        return out;
    }
    let names: [Cow<'p, str>; 2] = match st.what {
        What::GuestKernel | What::GuestUser => [
            Cow::Borrowed(f.process.as_str()),
            guest_label(&f.function, &f.module),
        ],
        What::Hypervisor => [
            Cow::Borrowed(f.process.as_str()),
            Cow::Borrowed(f.function.as_str()),
        ],
        What::Idle => [Cow::Borrowed(""), Cow::Borrowed("[idle]")],
    };
    out.extend(
        names
            .into_iter()
            .filter(|n| !n.is_empty())
            .map(|n| (n, cat)),
    );
    out
}

/// The profile without its samples: its categories, processes, threads and markers.
struct Skeleton {
    fx: FxProfile,
    cats: Categories,
    /// The threads, in the order they were made: those of [`sampled_threads`] first.
    threads: Vec<ThreadHandle>,
}

/// The threads with samples ([`thread_key`]s), in the profile's order of stacks, and per stack
/// its thread's place in that list ([`NONE`]: no samples). The [`Skeleton`] makes them first,
/// in this order.
fn sampled_threads(p: &Profile) -> (Vec<(bool, u16, u16)>, Vec<u32>) {
    let mut keys = Vec::new();
    let mut slots: HashMap<(bool, u16, u16), u32> = HashMap::default();
    let slot_of = p
        .samples
        .stacks()
        .iter()
        .map(|st| {
            if st.count == 0 {
                return NONE;
            }
            let key = thread_key(st.what, st.pcpu, st.vm, st.vcpu);
            *slots.entry(key).or_insert_with(|| {
                keys.push(key);
                (keys.len() - 1) as u32
            })
        })
        .collect();
    (keys, slot_of)
}

/// Makes the [`Skeleton`]: the threads with samples (`sampled`, [`sampled_threads`]), then the
/// scheduling markers on the vCPU threads and the lost records' on the pCPU threads (the
/// markers' names go first in each thread's string table, before its frames').
fn skeleton(p: &Profile, sampled: &[(bool, u16, u16)]) -> Skeleton {
    let period_ns = p.ticks_to_ns(p.period_ticks).max(1);
    let mut fx = FxProfile::new(
        &format!(
            "hvprof ({} pCPU(s), {} source, period {} TSC ticks)",
            p.pcpus, p.source, p.period_ticks
        ),
        ReferenceTimestamp::from_millis_since_unix_epoch(0.0),
        SamplingInterval::from_nanos(period_ns),
    );
    let cats = Categories {
        user: fx.add_category("Guest user", CategoryColor::Yellow),
        kernel: fx.add_category("Guest kernel", CategoryColor::Orange),
        hyper: fx.add_category("Hypervisor", CategoryColor::Blue),
        idle: fx.add_category("Idle", CategoryColor::Transparent),
    };
    let sched = fx.add_category("Scheduling", CategoryColor::Green);
    let (start, end) = p.span();
    let ts =
        |tsc: u64| Timestamp::from_nanos_since_reference(p.ticks_to_ns(tsc.saturating_sub(start)));
    let t0 = ts(start);
    let hv = fx.add_process("hypervisor (hvprof)", 1, t0);
    let mut threads = Threads {
        processes: HashMap::default(),
        map: HashMap::default(),
        list: Vec::new(),
        hv,
        t0,
    };
    for &(guest, a, b) in sampled {
        threads.get(&mut fx, p, guest, a, b);
    }
    // Scheduling markers on the vCPU threads.
    let mut open: HashMap<(u16, u16), u64> = HashMap::default();
    let mut last_out: HashMap<(u16, u16), (u64, OutReason)> = HashMap::default();
    let running = fx.intern_string("running");
    let out_name = fx.intern_string("out");
    for &(pcpu, e) in &p.events {
        let key = (e.vm, e.vcpu);
        let (t, _) = threads.get(&mut fx, p, true, e.vm, e.vcpu);
        match e.kind {
            EventKind::VcpuIn => {
                if let Some((from, reason)) = last_out.remove(&key) {
                    let why = fx.intern_string(match reason {
                        OutReason::Halted => "halted (idle)",
                        OutReason::Yielded => "yielded (steal)",
                        _ => "preempted (steal)",
                    });
                    fx.add_marker(
                        t,
                        MarkerTiming::Interval(ts(from), ts(e.tsc)),
                        VcpuMarker {
                            name: out_name,
                            why,
                            category: sched,
                        },
                    );
                }
                open.insert(key, e.tsc);
            }
            EventKind::VcpuOut => {
                if let Some(from) = open.remove(&key) {
                    let why = fx.intern_string(&format!("on pCPU {pcpu}"));
                    fx.add_marker(
                        t,
                        MarkerTiming::Interval(ts(from), ts(e.tsc)),
                        VcpuMarker {
                            name: running,
                            why,
                            category: sched,
                        },
                    );
                }
                if e.reason != OutReason::Stopped {
                    last_out.insert(key, (e.tsc, e.reason));
                }
            }
        }
    }
    // Lost records: an interval marker on the pCPU's thread, from the last record before to
    // the first after (the profile's ends when there is none).
    let lost_cat = fx.add_category("Lost records", CategoryColor::Red);
    let lost = fx.intern_string("records lost");
    for l in &p.losses {
        let (t, _) = threads.get(&mut fx, p, false, l.pcpu, 0);
        let why = fx.intern_string(&l.describe());
        let (from, to) = (l.from_tsc.unwrap_or(start), l.to_tsc.unwrap_or(end));
        fx.add_marker(
            t,
            MarkerTiming::Interval(ts(from), ts(to.max(from))),
            VcpuMarker {
                name: lost,
                why,
                category: lost_cat,
            },
        );
    }
    for &t in &threads.list {
        fx.set_thread_show_markers_in_timeline(t, true);
    }
    Skeleton {
        fx,
        cats,
        threads: threads.list,
    }
}

/// The profile's processes and threads as they are made.
struct Threads {
    /// Per VM, its process.
    processes: HashMap<u16, fxprof_processed_profile::ProcessHandle>,
    /// Per [`thread_key`], the thread and its place in `list`.
    map: HashMap<(bool, u16, u16), (ThreadHandle, u32)>,
    list: Vec<ThreadHandle>,
    hv: fxprof_processed_profile::ProcessHandle,
    t0: Timestamp,
}

impl Threads {
    /// A VM's vCPU's thread (`guest`: `a` the VM, `b` the vCPU), or a pCPU's (`a`), made the
    /// first time; and its place in `list`.
    fn get(
        &mut self,
        fx: &mut FxProfile,
        p: &Profile,
        guest: bool,
        a: u16,
        b: u16,
    ) -> (ThreadHandle, u32) {
        if let Some(&t) = self.map.get(&(guest, a, b)) {
            return t;
        }
        let t0 = self.t0;
        let t = if guest {
            let (pid, tid) = ids(What::GuestUser, a, b, 0);
            let process = *self
                .processes
                .entry(a)
                .or_insert_with(|| fx.add_process(&format!("VM {}", p.vm_name(a)), pid, t0));
            let t = fx.add_thread(process, tid, t0, b == 0);
            fx.set_thread_name(t, &format!("{} vCPU {b}", p.vm_name(a)));
            t
        } else {
            let (_, tid) = ids(What::Hypervisor, 0, 0, a);
            let t = fx.add_thread(self.hv, tid, t0, a == 0);
            fx.set_thread_name(t, &format!("pCPU {a}"));
            t
        };
        let slot = self.list.len() as u32;
        self.list.push(t);
        self.map.insert((guest, a, b), (t, slot));
        (t, slot)
    }
}

/// The thread a sample goes to: its vCPU's (guest samples), or its pCPU's.
fn thread_key(what: What, pcpu: u16, vm: u16, vcpu: u16) -> (bool, u16, u16) {
    if matches!(what, What::GuestKernel | What::GuestUser) {
        (true, vm, vcpu)
    } else {
        (false, pcpu, 0)
    }
}

/// A thread's samples, in time order: each its stack (an index into the profile's stacks) and
/// its time since the thread's previous sample (the first: since the profile's start), in
/// nanoseconds; a delta that does not fit 32 bits is `u32::MAX` here and in `long` in order.
#[derive(Default)]
struct Column {
    stacks: Vec<u32>,
    deltas: Vec<u32>,
    long: Vec<u64>,
    last: u64,
}

impl Column {
    /// A sample of stack `stack` at `nanos`; false when it is before the thread's last one.
    #[inline]
    fn push(&mut self, stack: u32, nanos: u64) -> bool {
        let Some(delta) = nanos.checked_sub(self.last) else {
            return false;
        };
        self.last = nanos;
        self.stacks.push(stack);
        match u32::try_from(delta) {
            Ok(d) if d != u32::MAX => self.deltas.push(d),
            _ => {
                self.deltas.push(u32::MAX);
                self.long.push(delta);
            }
        }
        true
    }
}

/// A run of samples read again, per thread: each sample's stack and its time since the
/// profile's start (nanoseconds).
#[derive(Default)]
struct RunColumns {
    threads: Vec<(Vec<u32>, Vec<u64>)>,
}

/// Each thread's samples in its [`Column`] (sized from the stacks' counts up front); `None`
/// when a thread's samples are out of time order (never, from a replay in TSC order: the
/// samples cannot be written as deltas then). The replay's workers sort each run's samples by
/// thread and time them; the columns take them in order.
fn columns(
    p: &Profile,
    slot_of: &[u32],
    threads: usize,
    progress: &Progress,
) -> Option<Vec<Column>> {
    let mut per_thread = vec![0u64; threads];
    for (st, &slot) in p.samples.stacks().iter().zip(slot_of) {
        if slot != NONE {
            per_thread[slot as usize] += st.count;
        }
    }
    let mut columns: Vec<Column> = per_thread
        .iter()
        .map(|&n| {
            let n = usize::try_from(n).unwrap_or(0);
            Column {
                stacks: Vec::with_capacity(n),
                deltas: Vec::with_capacity(n),
                ..Column::default()
            }
        })
        .collect();
    let start = p.span().0;
    let to_ns = p.nanos();
    let mut ordered = true;
    let _ = p.replay_stacks(
        |run, out: &mut RunColumns| {
            out.threads.resize_with(threads, Default::default);
            for (stacks, nanos) in &mut out.threads {
                stacks.clear();
                nanos.clear();
            }
            // The stacks are read in no order: their thread is prefetched a few samples ahead.
            const AHEAD: usize = 16;
            for (k, &(tsc, stack)) in run.iter().enumerate() {
                if let Some(&(_, next)) = run.get(k + AHEAD) {
                    crate::model::stack_table::prefetch(&slot_of[next as usize]);
                }
                // A sample's stack counts it, so it has a thread.
                if let Some((stacks, nanos)) = out.threads.get_mut(slot_of[stack as usize] as usize)
                {
                    stacks.push(stack);
                    nanos.push(to_ns.of(tsc.saturating_sub(start)));
                }
            }
        },
        |out| {
            let mut samples = 0;
            for ((stacks, nanos), c) in out.threads.iter().zip(&mut columns) {
                for (&stack, &ns) in stacks.iter().zip(nanos) {
                    ordered &= c.push(stack, ns);
                }
                samples += stacks.len() as u64;
            }
            progress.inc(samples);
            Ok(())
        },
    );
    ordered.then_some(columns)
}

/// Numbers of pairs (`a`, `b`) whose `a` is itself a number (dense, from 0): the first `b` met
/// with each `a` beside it in a vector at `a` (most `a`s have one: a name has one category, a
/// frame one prefix), the others in a map. A new `a` is at the end of the vector, in the cache,
/// where a hash map's slot would be a miss to memory.
struct PairIds<B> {
    first: Vec<Option<(B, u32)>>,
    more: HashMap<(u32, B), u32>,
}

impl<B: Copy + Eq + std::hash::Hash> PairIds<B> {
    fn with_capacity(n: usize) -> Self {
        PairIds {
            first: Vec::with_capacity(n),
            more: HashMap::default(),
        }
    }

    /// The number of (`a`, `b`); `next` when it is new.
    #[inline]
    fn number(&mut self, a: u32, b: B, next: u32) -> u32 {
        let i = a as usize;
        if i >= self.first.len() {
            self.first.resize(i + 1, None);
        }
        match self.first[i] {
            None => {
                self.first[i] = Some((b, next));
                next
            }
            Some((first, n)) if first == b => n,
            Some(_) => *self.more.entry((a, b)).or_insert(next),
        }
    }
}

/// One thread's frame, function and stack tables and the strings they add to its string table,
/// numbered as fxprof-processed-profile numbers them when the thread's stacks are interned in
/// the profile's order after its markers: a string by first use, after the
/// skeleton's (the same string is the same number); a function per string, by first use; a
/// frame per (string, category), by first use; a stack per (prefix, frame), by first use.
struct Tables<'p> {
    /// The skeleton's strings (the markers').
    base: u32,
    /// The skeleton's strings, then the thread's.
    strings: Interner<Cow<'p, str>>,
    /// Per string number, its function's number plus one (0: none yet).
    func_of: Vec<u32>,
    /// Each function's string.
    funcs: Vec<u32>,
    /// (string, category) → frame.
    frame_ids: PairIds<u16>,
    /// Each frame's category and function.
    frames: Vec<(u16, u32)>,
    /// (frame, prefix plus one, 0 for none) → stack.
    stack_ids: PairIds<u32>,
    /// Each stack's prefix and frame.
    stacks: Vec<(Option<u32>, u32)>,
}

impl<'p> Tables<'p> {
    /// Tables after the skeleton's strings `skeleton`, for about `stacks` stacks (of two
    /// frames each, without chains: their room is made once).
    fn new(skeleton: Vec<String>, stacks: usize) -> Tables<'p> {
        let base = skeleton.len() as u32;
        let frames = 2 * stacks;
        let mut strings = Interner::with_capacity(skeleton.len() + frames);
        for s in skeleton {
            // The skeleton's strings are distinct (fxprof-processed-profile's string table).
            strings.number_owned(Cow::Owned(s));
        }
        let mut func_of = Vec::with_capacity(base as usize + frames);
        func_of.resize(base as usize, 0);
        Tables {
            base,
            strings,
            func_of,
            funcs: Vec::with_capacity(frames),
            frame_ids: PairIds::with_capacity(base as usize + frames),
            frames: Vec::with_capacity(frames),
            stack_ids: PairIds::with_capacity(frames),
            stacks: Vec::with_capacity(frames),
        }
    }

    /// The stack of `frames` (outermost first; categories as numbers); `None` without frames.
    fn stack(&mut self, frames: impl Iterator<Item = (Cow<'p, str>, u16)>) -> Option<u32> {
        let mut prefix = None;
        for (name, category) in frames {
            let (string, new) = self.strings.number_owned(name);
            if new {
                self.func_of.push(0);
            }
            let next = self.frames.len() as u32;
            let frame = self.frame_ids.number(string, category, next);
            if frame == next {
                let func = &mut self.func_of[string as usize];
                if *func == 0 {
                    self.funcs.push(string);
                    *func = self.funcs.len() as u32;
                }
                self.frames.push((category, *func - 1));
            }
            let next = self.stacks.len() as u32;
            let stack = self
                .stack_ids
                .number(frame, prefix.map_or(0, |p| p + 1), next);
            if stack == next {
                self.stacks.push((prefix, frame));
            }
            prefix = Some(stack);
        }
        prefix
    }

    /// The frame table, as fxprof-processed-profile's `FrameTable` serializes (labels only).
    fn frame_table(&self, out: &mut Vec<u8>) {
        let n = self.frames.len();
        json_table(
            out,
            n,
            vec![
                ("address", Values::Same(b"-1")),
                ("inlineDepth", Values::Same(b"0")),
                (
                    "category",
                    Values::Numbers(self.frames.iter().map(|f| Some(u32::from(f.0))).collect()),
                ),
                ("subcategory", Values::Same(b"0")),
                (
                    "func",
                    Values::Numbers(self.frames.iter().map(|f| Some(f.1)).collect()),
                ),
                ("nativeSymbol", Values::Same(b"null")),
                ("innerWindowID", Values::Same(b"0")),
                ("line", Values::Same(b"null")),
                ("column", Values::Same(b"null")),
            ],
        );
    }

    /// The function table, as fxprof-processed-profile's `FuncTable` serializes (no resources,
    /// no flags).
    fn func_table(&self, out: &mut Vec<u8>) {
        json_table(
            out,
            self.funcs.len(),
            vec![
                (
                    "name",
                    Values::Numbers(self.funcs.iter().map(|&f| Some(f)).collect()),
                ),
                ("isJS", Values::Same(b"false")),
                ("relevantForJS", Values::Same(b"false")),
                ("resource", Values::Same(b"-1")),
                ("fileName", Values::Same(b"null")),
                ("lineNumber", Values::Same(b"null")),
                ("columnNumber", Values::Same(b"null")),
            ],
        );
    }

    /// The stack table, as fxprof-processed-profile's `StackTable` serializes.
    fn stack_table(&self, out: &mut Vec<u8>) {
        json_table(
            out,
            self.stacks.len(),
            vec![
                (
                    "prefix",
                    Values::Numbers(self.stacks.iter().map(|s| s.0).collect()),
                ),
                (
                    "frame",
                    Values::Numbers(self.stacks.iter().map(|s| Some(s.1)).collect()),
                ),
            ],
        );
    }

    /// The strings after the skeleton's, each as serde_json writes a string, each after a comma
    /// when `after` (the skeleton has strings).
    fn strings(&self, out: &mut Vec<u8>, after: bool) -> Result<()> {
        for (i, s) in self.strings.values[self.base as usize..].iter().enumerate() {
            if after || i > 0 {
                out.push(b',');
            }
            serde_json::to_writer(&mut *out, s.as_ref())?;
        }
        Ok(())
    }
}

/// A column of a table as fxprof-processed-profile serializes it.
enum Values {
    /// One value for every row.
    Same(&'static [u8]),
    /// A number per row (`null` for none).
    Numbers(Vec<Option<u32>>),
}

/// `{"length":n,"key":[...],...}`: a table of `n` rows, its columns in order, as serde_json
/// writes fxprof-processed-profile's tables.
fn json_table(out: &mut Vec<u8>, n: usize, columns: Vec<(&str, Values)>) {
    let mut num = itoa::Buffer::new();
    out.extend_from_slice(br#"{"length":"#);
    out.extend_from_slice(num.format(n).as_bytes());
    for (key, values) in columns {
        out.extend_from_slice(b",\"");
        out.extend_from_slice(key.as_bytes());
        out.extend_from_slice(b"\":[");
        match values {
            Values::Same(item) if n > 0 => {
                out.extend_from_slice(item);
                let mut more = Vec::with_capacity(item.len() + 1);
                more.push(b',');
                more.extend_from_slice(item);
                out.extend_from_slice(&more.repeat(n - 1));
            }
            Values::Same(_) => {}
            Values::Numbers(list) => {
                for (i, x) in list.into_iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    match x {
                        Some(x) => out.extend_from_slice(num.format(x).as_bytes()),
                        None => out.extend_from_slice(b"null"),
                    }
                }
            }
        }
        out.push(b']');
    }
    out.push(b'}');
}

/// Where a thread's tables are in the skeleton's JSON: the byte ranges of the values of its
/// `frameTable`, `funcTable`, `samples`, `stackTable` and `stringArray`, in that order.
struct Layout {
    frame_table: Range<usize>,
    func_table: Range<usize>,
    samples: Range<usize>,
    stack_table: Range<usize>,
    strings: Range<usize>,
}

/// The key of a thread's first table. Within a string a quote is escaped: this is a key.
const FRAME_TABLE_KEY: &[u8] = br#""frameTable":"#;
/// What starts a thread's sample table in fxprof-processed-profile's JSON.
const SAMPLES_KEY: &[u8] = br#""samples":"#;

/// Each thread's [`Layout`] in the skeleton's JSON, in order.
fn layouts(json: &[u8]) -> Result<Vec<Layout>> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(i) = memchr::memmem::find(&json[at..], FRAME_TABLE_KEY) {
        let frame_table = value_at(json, at + i + FRAME_TABLE_KEY.len())?;
        let func_table = value_after(json, frame_table.end, br#","funcTable":"#)?;
        let Some(i) = memchr::memmem::find(&json[func_table.end..], SAMPLES_KEY) else {
            bail!("a Firefox thread without its samples");
        };
        let samples = value_at(json, func_table.end + i + SAMPLES_KEY.len())?;
        let stack_table = value_after(json, samples.end, br#","stackTable":"#)?;
        let strings = value_after(json, stack_table.end, br#","stringArray":"#)?;
        at = strings.end;
        out.push(Layout {
            frame_table,
            func_table,
            samples,
            stack_table,
            strings,
        });
    }
    Ok(out)
}

/// The byte range of the JSON value (an object or an array) that starts at `from`.
fn value_at(json: &[u8], from: usize) -> Result<Range<usize>> {
    let mut values =
        serde_json::Deserializer::from_slice(&json[from..]).into_iter::<serde::de::IgnoredAny>();
    match values.next() {
        Some(Ok(_)) => Ok(from..from + values.byte_offset()),
        _ => bail!("a Firefox table not ours"),
    }
}

/// The byte range of the value of the key `key` (`,"name":`) that follows at `from`.
fn value_after(json: &[u8], from: usize, key: &[u8]) -> Result<Range<usize>> {
    if !json[from..].starts_with(key) {
        bail!("a Firefox table not ours");
    }
    value_at(json, from + key.len())
}

/// A placeholder sample table read back: per sample its weight (the thread's place).
#[derive(serde::Deserialize)]
struct Placeholder {
    weight: Vec<i64>,
}

/// One thread's tables as [`write`] splices them: its place in the skeleton's list of
/// threads, each of its stacks with its Firefox stack, its frame, function and stack tables
/// and its strings after the skeleton's (as JSON), and whether they were written.
type ThreadTables = (usize, Vec<(u32, u32)>, [Vec<u8>; 4], Result<()>);

/// What [`skeleton_and_tables`] makes: the skeleton's JSON; per thread in it, its layout, its
/// place (none: no samples) and the skeleton's strings; each thread's tables.
type SkeletonAndTables = (
    Vec<u8>,
    Vec<(Layout, Option<u32>, Vec<String>)>,
    Vec<Option<ThreadTables>>,
);

/// The skeleton (threads `sampled` first, [`sampled_threads`]) serialized with a placeholder
/// sample per thread with samples; where each thread's tables are in it, with its place and
/// the skeleton's strings; and each thread's tables, made on every core (`slot_of`: each
/// stack's thread).
fn skeleton_and_tables(
    p: &Profile,
    sampled: &[(bool, u16, u16)],
    slot_of: &[u32],
) -> Result<SkeletonAndTables> {
    let Skeleton {
        mut fx,
        cats,
        threads,
    } = skeleton(p, sampled);
    // The threads with samples are the first ones made.
    for (slot, &t) in threads.iter().enumerate().take(sampled.len()) {
        let weight = i32::try_from(slot).context("too many threads for a Firefox profile")?;
        fx.add_sample(
            t,
            Timestamp::from_nanos_since_reference(0),
            None,
            CpuDelta::ZERO,
            weight,
        );
    }
    let skeleton = serde_json::to_vec(&fx).context("cannot write the Firefox profile")?;
    drop(fx);
    // Per thread in the JSON: its layout, its place and the skeleton's strings (none: the
    // thread has no samples, and its tables are written as they are).
    let mut found = Vec::new();
    for l in layouts(&skeleton)? {
        let placeholder: Placeholder = serde_json::from_slice(&skeleton[l.samples.clone()])
            .context("a Firefox sample table not ours")?;
        let slot = match placeholder.weight.first() {
            None => None,
            Some(&w) => Some(
                u32::try_from(w)
                    .ok()
                    .filter(|&s| (s as usize) < sampled.len())
                    .context("a Firefox sample table not ours")?,
            ),
        };
        let strings: Vec<String> = serde_json::from_slice(&skeleton[l.strings.clone()])
            .context("a Firefox string table not ours")?;
        found.push((l, slot, strings));
    }
    // Each thread's stacks, in the profile's order.
    let mut stacks_of: Vec<Vec<u32>> = vec![Vec::new(); sampled.len()];
    for (i, &slot) in slot_of.iter().enumerate() {
        if slot != NONE {
            stacks_of[slot as usize].push(i as u32);
        }
    }
    let category = |c: Cat| -> Result<u16> { Ok(serde_json::to_string(&cats.handle(c))?.parse()?) };
    let numbers = [Cat::User, Cat::Kernel, Cat::Hyper, Cat::Idle]
        .map(|c| category(c).map(|n| (c, n)))
        .into_iter()
        .collect::<Result<Vec<_>>>()
        .context("a Firefox category not ours")?;
    let number = |c: Cat| numbers.iter().find(|(k, _)| *k == c).map_or(0, |(_, n)| *n);
    // The threads with most stacks first, each to the next free core.
    let mut work: Vec<(usize, Option<u32>, Vec<String>)> = found
        .iter_mut()
        .enumerate()
        .map(|(k, (_, slot, strings))| (k, *slot, std::mem::take(strings)))
        .collect();
    work.sort_by_key(|(_, slot, _)| {
        std::cmp::Reverse(slot.map_or(0, |s| stacks_of[s as usize].len()))
    });
    let tables = crate::model::par::par_map_queue(work, |(k, slot, strings)| {
        let slot = slot?;
        let mine = &stacks_of[slot as usize];
        let mut t = Tables::new(strings, mine.len());
        let stacks = p.samples.stacks();
        // Each stack's frame and its names are read in no order: the frame is asked for a
        // few stacks ahead, its names (read from it by then) a few less.
        const AHEAD: usize = 8;
        let frame = |k: usize| {
            mine.get(k)
                .map(|&i| &p.frames[stacks[i as usize].frame as usize])
        };
        let index: Vec<(u32, u32)> = mine
            .iter()
            .enumerate()
            .map(|(k, &i)| {
                if let Some(f) = frame(k + AHEAD) {
                    crate::model::stack_table::prefetch(f);
                }
                if let Some(f) = frame(k + AHEAD / 2) {
                    crate::model::stack_table::prefetch(f.function.as_bytes());
                    crate::model::stack_table::prefetch(f.process.as_bytes());
                    crate::model::stack_table::prefetch(f.module.as_bytes());
                }
                let st = &stacks[i as usize];
                let frames = frames_of(p, st)
                    .into_iter()
                    .map(|(name, c)| (name, number(c)));
                (i, t.stack(frames).unwrap_or(NONE))
            })
            .collect();
        let mut bytes = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        t.frame_table(&mut bytes[0]);
        t.func_table(&mut bytes[1]);
        t.stack_table(&mut bytes[2]);
        let written = t.strings(&mut bytes[3], t.base > 0);
        Some((k, index, bytes, written))
    });
    Ok((skeleton, found, tables))
}

/// Writes the profile as JSON (the Firefox Profiler opens it as it is, or gzipped), the bytes
/// fxprof-processed-profile would write for the same profile.
///
/// The samples are read again into each thread's columns from the start. Meanwhile the
/// skeleton gets one placeholder sample per thread with samples, its weight the thread's
/// place, and is serialized; each thread's tables are found in it ([`layouts`]), its
/// placeholder saying which thread it is, and made on every core ([`skeleton_and_tables`]).
/// The output is the skeleton with each thread's tables, samples and strings written in place
/// of its own.
pub fn write(p: &Profile, out: &mut dyn Write, progress: &Progress) -> Result<()> {
    let (sampled, slot_of) = sampled_threads(p);
    progress.phase("firefox", Some(p.samples.len() as u64), "samples");
    // The replay fills the columns from the start, while this thread makes the skeleton and
    // every core the tables.
    let (columns, made) = std::thread::scope(|sc| {
        let columns = sc.spawn(|| columns(p, &slot_of, sampled.len(), progress));
        let made = skeleton_and_tables(p, &sampled, &slot_of);
        (columns.join(), made)
    });
    let (skeleton, found, tables) = made?;
    let Some(columns) = columns.unwrap_or_else(|e| std::panic::resume_unwind(e)) else {
        // Never: the replay reads the samples in TSC order.
        bail!("cannot write the Firefox profile: a thread's samples are out of time order");
    };
    progress.phase("writing", None, "bytes");
    // Per stack of the profile: its Firefox stack in its thread ([`NONE`]: none), and whether
    // its samples are idle.
    let mut index = vec![NONE; slot_of.len()];
    let mut per_thread: Vec<Option<[Vec<u8>; 4]>> = (0..found.len()).map(|_| None).collect();
    for (k, stacks, bytes, written) in tables.into_iter().flatten() {
        written.context("cannot write the Firefox profile")?;
        for (i, s) in stacks {
            index[i as usize] = s;
        }
        per_thread[k] = Some(bytes);
    }
    let texts = stack_texts(&index);
    drop(index);
    let idle: Vec<bool> = p
        .samples
        .stacks()
        .iter()
        .map(|s| s.what == What::Idle)
        .collect();
    let period_us =
        serde_json::to_string(&CpuDelta::from_nanos(p.ticks_to_ns(p.period_ticks).max(1)))?;
    let mut w = Splice {
        buf: Vec::with_capacity(1 << 20),
        out,
        chunks: Vec::new(),
    };
    let mut at = 0;
    for ((l, slot, _), bytes) in found.iter().zip(&per_thread) {
        let (Some(slot), Some(bytes)) = (slot, bytes) else {
            continue;
        };
        let [frame_table, func_table, stack_table, strings] = bytes;
        w.bytes(&skeleton[at..l.frame_table.start])?;
        w.bytes(frame_table)?;
        w.bytes(&skeleton[l.frame_table.end..l.func_table.start])?;
        w.bytes(func_table)?;
        w.bytes(&skeleton[l.func_table.end..l.samples.start])?;
        write_samples(&mut w, &columns[*slot as usize], &texts, &idle, &period_us)
            .context("cannot write the Firefox profile")?;
        w.bytes(&skeleton[l.samples.end..l.stack_table.start])?;
        w.bytes(stack_table)?;
        w.bytes(&skeleton[l.stack_table.end..l.strings.start])?;
        // The skeleton's strings but for the closing bracket, then the thread's own.
        w.bytes(&skeleton[l.strings.start..l.strings.end - 1])?;
        w.bytes(strings)?;
        w.bytes(b"]")?;
        at = l.strings.end;
    }
    w.bytes(&skeleton[at..])?;
    w.flush()?;
    Ok(())
}

/// Buffered writing to the output (its writes are dynamic calls).
struct Splice<'a> {
    buf: Vec<u8>,
    out: &'a mut dyn Write,
    /// Per core, a buffer a column's chunk is formatted into, and the bytes written in it
    /// ([`chunked`]).
    chunks: Vec<(Vec<u8>, Range<usize>)>,
}

impl Splice<'_> {
    #[inline]
    fn io(&mut self, b: &[u8]) -> std::io::Result<()> {
        if b.len() >= 1 << 16 {
            // Large enough to go out as it is, not copied first.
            self.out.write_all(&self.buf)?;
            self.buf.clear();
            return self.out.write_all(b);
        }
        self.buf.extend_from_slice(b);
        if self.buf.len() >= 1 << 20 {
            self.out.write_all(&self.buf)?;
            self.buf.clear();
        }
        Ok(())
    }

    fn bytes(&mut self, b: &[u8]) -> Result<()> {
        self.io(b).context("cannot write the Firefox profile")
    }

    fn flush(&mut self) -> Result<()> {
        self.out
            .write_all(&self.buf)
            .context("cannot write the Firefox profile")?;
        self.buf.clear();
        Ok(())
    }
}

/// A short text kept in a fixed array, its length in the last byte: copying it is a move of
/// the whole array, not a call (a sample table copies four per sample).
type Piece<const N: usize> = [u8; N];

/// `text` (shorter than `N`) as a [`Piece`].
fn piece<const N: usize>(text: &[u8]) -> Piece<N> {
    assert!(text.len() < N && N <= 256, "a piece of text too long");
    let mut p = [0; N];
    p[..text.len()].copy_from_slice(text);
    p[N - 1] = text.len() as u8;
    p
}

/// Pieces written one after another into a buffer that has room for the largest of each (it
/// is resized once and reused, never shrunk).
struct Cursor<'a> {
    buf: &'a mut Vec<u8>,
    at: usize,
}

impl<'a> Cursor<'a> {
    /// A cursor at the start of `buf`, which gets room for `items` pieces of `N` bytes.
    fn new<const N: usize>(buf: &'a mut Vec<u8>, items: usize) -> Cursor<'a> {
        let room = (items + 1) * N;
        if buf.len() < room {
            buf.resize(room, 0);
        }
        Cursor { buf, at: 0 }
    }

    /// Writes `p` (the cursor has room for it: see [`Cursor::new`]).
    #[inline(always)]
    fn put<const N: usize>(&mut self, p: &Piece<N>) {
        self.buf[self.at..self.at + N].copy_from_slice(p);
        self.at += usize::from(p[N - 1]);
    }
}

/// Per stack of the profile, its Firefox stack's index as a sample table writes it, after a
/// comma (`,null` for none).
fn stack_texts(index: &[u32]) -> Vec<Piece<16>> {
    let mut num = itoa::Buffer::new();
    index
        .iter()
        .map(|&s| match s {
            NONE => piece(b",null"),
            s => {
                let mut t = [0u8; 12];
                let digits = num.format(s).as_bytes();
                t[0] = b',';
                t[1..=digits.len()].copy_from_slice(digits);
                piece(&t[..=digits.len()])
            }
        })
        .collect()
}

/// A thread's sample table, as fxprof-processed-profile writes it (`SampleTable`'s
/// serialization through serde_json, its samples in time order): the length, the weight type,
/// then per sample its stack index (`texts` of its stack, [`stack_texts`]), its time since the
/// previous sample (float milliseconds), its weight (1), its CPU time (`period_us`, 0 when
/// idle). The columns are formatted in chunks on every core, written in order; each item is
/// written after a comma, and the column's first comma is left out.
fn write_samples(
    w: &mut Splice<'_>,
    c: &Column,
    texts: &[Piece<16>],
    idle: &[bool],
    period_us: &str,
) -> std::io::Result<()> {
    let n = c.stacks.len();
    let mut num = itoa::Buffer::new();
    w.io(br#"{"length":"#)?;
    w.io(num.format(n).as_bytes())?;
    w.io(br#","weightType":"samples","stack":["#)?;
    chunked(w, n, |_, range, buf| {
        let first = usize::from(range.start == 0);
        let mut out = Cursor::new::<16>(buf, range.len());
        for i in range {
            out.put(&texts[c.stacks[i] as usize]);
        }
        first..out.at
    })?;
    w.io(br#"],"timeDeltas":["#)?;
    // Where each chunk's long deltas start.
    let long_from: Vec<usize> = c
        .deltas
        .chunks(CHUNK)
        .scan(0, |before, d| {
            let from = *before;
            *before += d.iter().filter(|&&d| d == u32::MAX).count();
            Some(from)
        })
        .collect();
    if long_from.last().is_some_and(|&from| {
        from + c.deltas[(n - 1) / CHUNK * CHUNK..]
            .iter()
            .filter(|&&d| d == u32::MAX)
            .count()
            != c.long.len()
    }) {
        return Err(std::io::Error::other("a Firefox sample's time lost"));
    }
    chunked(w, n, |k, range, buf| {
        let first = usize::from(range.start == 0);
        let mut out = Cursor::new::<32>(buf, range.len());
        let mut long = c.long[long_from[k]..].iter();
        // Periodic samples: mostly the same delta, formatted once.
        let mut last: Option<u64> = None;
        let mut text: Piece<32> = [0; 32];
        for i in range {
            let d = match c.deltas[i] {
                u32::MAX => long.next().copied().unwrap_or_default(),
                d => u64::from(d),
            };
            if last != Some(d) {
                text = millis(d);
                last = Some(d);
            }
            out.put(&text);
        }
        first..out.at
    })?;
    w.io(br#"],"weight":["#)?;
    let one: Piece<4> = piece(b",1");
    chunked(w, n, |_, range, buf| {
        let first = usize::from(range.start == 0);
        let mut out = Cursor::new::<4>(buf, range.len());
        for _ in range {
            out.put(&one);
        }
        first..out.at
    })?;
    w.io(br#"],"threadCPUDelta":["#)?;
    let busy: Piece<32> = piece(format!(",{period_us}").as_bytes());
    let zero: Piece<32> = piece(b",0");
    chunked(w, n, |_, range, buf| {
        let first = usize::from(range.start == 0);
        let mut out = Cursor::new::<32>(buf, range.len());
        for i in range {
            out.put(if idle[c.stacks[i] as usize] {
                &zero
            } else {
                &busy
            });
        }
        first..out.at
    })?;
    w.io(b"]}")
}

/// Samples per chunk of a column formatted at once.
const CHUNK: usize = 1 << 16;

/// Items `0..n` formatted by `format(k, range, buf)` (chunk `k`, its items `range`; it returns
/// the bytes of `buf` it wrote) on every core, a few chunks at a time, and written in order.
fn chunked(
    w: &mut Splice<'_>,
    n: usize,
    format: impl Fn(usize, Range<usize>, &mut Vec<u8>) -> Range<usize> + Sync,
) -> std::io::Result<()> {
    let chunks = n.div_ceil(CHUNK);
    // The buffers are the writer's, kept from column to column (a chunk's is some 2 MB).
    let mut bufs = std::mem::take(&mut w.chunks);
    if bufs.is_empty() {
        bufs = vec![(Vec::new(), 0..0); crate::model::par::cores()];
    }
    let threads = bufs.len();
    let format = &format;
    let mut k = 0;
    while k < chunks {
        let wave = threads.min(chunks - k);
        std::thread::scope(|sc| {
            for (j, (buf, written)) in bufs.iter_mut().take(wave).enumerate() {
                let chunk = k + j;
                let range = chunk * CHUNK..((chunk + 1) * CHUNK).min(n);
                if j + 1 == wave {
                    *written = format(chunk, range, buf);
                } else {
                    sc.spawn(move || *written = format(chunk, range, buf));
                }
            }
        });
        for (buf, written) in bufs.iter().take(wave) {
            w.io(&buf[written.clone()])?;
        }
        k += wave;
    }
    w.chunks = bufs;
    Ok(())
}

/// `,` and `nanos` as float milliseconds, as serde_json writes `nanos as f64 / 1e6` (fxprof-
/// processed-profile's time deltas): the shortest decimal that reads back as that float. Below
/// 10^15 ns the quotient's exact decimal (at most 15 significant digits, six after the point)
/// is it: the float is the one nearest to that decimal (a correctly rounded quotient), and two
/// decimals of at most 15 digits never share a float, so no shorter one reads back as it.
/// serde_json writes it in fixed notation from 10^-5 on (`1.0` for a whole number); smaller
/// and larger values are left to it (a float's JSON text is at most 24 bytes).
fn millis(nanos: u64) -> Piece<32> {
    if !(10_000..1_000_000_000_000_000).contains(&nanos) {
        use serde_json::ser::Formatter;
        let mut text = vec![b','];
        // Into a vector: cannot fail.
        let _ = serde_json::ser::CompactFormatter.write_f64(&mut text, nanos as f64 / 1_000_000.0);
        return piece(&text);
    }
    // At most 1 + 12 + 1 + 6 bytes.
    let mut t = [0u8; 32];
    t[0] = b',';
    let mut num = itoa::Buffer::new();
    let whole = num.format(nanos / 1_000_000).as_bytes();
    t[1..=whole.len()].copy_from_slice(whole);
    let mut at = 1 + whole.len();
    t[at] = b'.';
    at += 1;
    let frac = (nanos % 1_000_000) as usize;
    if frac == 0 {
        t[at] = b'0';
        at += 1;
    } else {
        // Six digits, two at a time, written as one word; the trailing zeros left out: the
        // word's high bytes that are '0' (the last two bytes are zero, so at most 6 digits
        // are counted, and the fraction is not 0, so at least one is kept).
        let pair = |p: usize| [DIGIT_PAIRS[2 * p], DIGIT_PAIRS[2 * p + 1]];
        let [a, b] = pair(frac / 10_000);
        let [c, d] = pair(frac / 100 % 100);
        let [e, f] = pair(frac % 100);
        let word = [a, b, c, d, e, f, 0, 0];
        let zeros = (u64::from_le_bytes(word) ^ 0x0000_3030_3030_3030).leading_zeros() / 8 - 2;
        t[at..at + 8].copy_from_slice(&word);
        at += 6 - zeros as usize;
    }
    t[31] = at as u8;
    t
}

/// "00" to "99", each number's two digits.
const DIGIT_PAIRS: [u8; 200] = {
    let mut t = [0u8; 200];
    let mut i = 0;
    while i < 100 {
        t[2 * i] = b'0' + (i / 10) as u8;
        t[2 * i + 1] = b'0' + (i % 10) as u8;
        i += 1;
    }
    t
};

#[cfg(test)]
mod tests {
    use super::{
        CHUNK, Cat, Column, NONE, PairIds, Splice, What, frames_of, ids, millis, sampled_threads,
        stack_texts, write, write_samples,
    };
    use crate::model::profile::{LoadOptions, Profile};
    use crate::model::progress::Progress;
    use crate::naming::symbols::{Images, Symbols};
    use proptest::prelude::*;
    use serde_json::Value;
    use std::collections::HashSet;

    /// A frame as the file names it: its function's name and its category's.
    type Named = (String, String);

    /// A thread of the written file read back: each sample's frames (outermost first) and its
    /// time since the first sample (nanoseconds). Checks that its tables are numbered as the
    /// processed format numbers them: each string, function, frame per (function, category)
    /// and stack per (prefix, frame) once, every index in range (a prefix before its stack),
    /// each column as long as its table, every sample of weight 1.
    fn read_thread(t: &Value, categories: &[String]) -> Vec<(Vec<Named>, u64)> {
        let len = |x: &Value| x["length"].as_u64().unwrap() as usize;
        let col = |x: &Value, k: &str| -> Vec<Value> {
            let c = x[k].as_array().unwrap().clone();
            assert_eq!(c.len(), len(x), "{k}");
            c
        };
        let index = |v: &Value| v.as_u64().unwrap() as usize;
        let strings: Vec<String> = t["stringArray"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_owned())
            .collect();
        assert_eq!(strings.iter().collect::<HashSet<_>>().len(), strings.len());
        let (fu, fr, st, sa) = (
            &t["funcTable"],
            &t["frameTable"],
            &t["stackTable"],
            &t["samples"],
        );
        let funcs: Vec<usize> = col(fu, "name").iter().map(index).collect();
        assert!(funcs.iter().all(|&n| n < strings.len()));
        assert_eq!(funcs.iter().collect::<HashSet<_>>().len(), funcs.len());
        let frames: Vec<(usize, usize)> = col(fr, "func")
            .iter()
            .map(index)
            .zip(col(fr, "category").iter().map(index))
            .collect();
        assert!(
            frames
                .iter()
                .all(|&(f, c)| f < funcs.len() && c < categories.len())
        );
        assert_eq!(frames.iter().collect::<HashSet<_>>().len(), frames.len());
        let stacks: Vec<(Option<usize>, usize)> = col(st, "prefix")
            .iter()
            .map(|p| p.as_u64().map(|p| p as usize))
            .zip(col(st, "frame").iter().map(index))
            .collect();
        for (i, &(prefix, frame)) in stacks.iter().enumerate() {
            assert!(prefix.is_none_or(|p| p < i) && frame < frames.len());
        }
        assert_eq!(stacks.iter().collect::<HashSet<_>>().len(), stacks.len());
        assert!(col(sa, "weight").iter().all(|w| w.as_u64() == Some(1)));
        let mut at = 0u64;
        col(sa, "stack")
            .iter()
            .zip(col(sa, "timeDeltas"))
            .map(|(s, ms)| {
                let mut named = Vec::new();
                let mut next = s.as_u64().map(|s| s as usize);
                while let Some(i) = next {
                    let (prefix, frame) = stacks[i];
                    let (func, category) = frames[frame];
                    named.push((strings[funcs[func]].clone(), categories[category].clone()));
                    next = prefix;
                }
                named.reverse();
                at += (ms.as_f64().unwrap() * 1e6).round() as u64;
                (named, at)
            })
            .collect()
    }

    /// The category [`write`] gives frames of `c`.
    fn category(c: Cat) -> &'static str {
        match c {
            Cat::User => "Guest user",
            Cat::Kernel => "Guest kernel",
            Cat::Hyper => "Hypervisor",
            Cat::Idle => "Idle",
        }
    }

    /// The written file read back holds, in each thread with samples (the first threads, in
    /// [`sampled_threads`]'s order), every sample of its stacks in time order, each with the
    /// frames [`frames_of`] gives its stack and its time since the first sample; the other
    /// threads (a vCPU's scheduling markers, a pCPU's losses) have none.
    fn written_threads_hold_each_sample(p: &Profile) {
        let mut out = Vec::new();
        write(p, &mut out, &Progress::hidden()).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        let categories: Vec<String> = v["meta"]["categories"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap().to_owned())
            .collect();
        let (sampled, slot_of) = sampled_threads(p);
        let mut want: Vec<Vec<(Vec<Named>, u64)>> = vec![Vec::new(); sampled.len()];
        let start = p.span().0;
        p.for_each_sample(|s| {
            let st = &p.samples.stacks()[s.stack as usize];
            let frames = frames_of(p, st)
                .into_iter()
                .map(|(n, c)| (n.into_owned(), category(c).to_owned()))
                .collect();
            want[slot_of[s.stack as usize] as usize].push((frames, p.ticks_to_ns(s.tsc - start)));
        })
        .unwrap();
        // Each thread with samples by its tid (the threads are in the file in the order of their
        // processes).
        let tid = |&(guest, a, b): &(bool, u16, u16)| {
            if guest {
                ids(What::GuestUser, a, b, 0).1
            } else {
                ids(What::Hypervisor, 0, 0, a).1
            }
        };
        let threads = v["threads"].as_array().unwrap();
        assert!(threads.len() >= sampled.len());
        let mut samples = 0;
        for t in threads {
            let got = read_thread(t, &categories);
            samples += got.len();
            let id = t["tid"]
                .as_u64()
                .or_else(|| t["tid"].as_str()?.parse().ok())
                .unwrap() as u32;
            match sampled.iter().position(|k| tid(k) == id) {
                Some(k) => assert!(got == want[k], "thread {}", t["name"]),
                None => assert!(got.is_empty(), "thread {}", t["name"]),
            }
        }
        assert_eq!(samples, p.samples.len());
    }

    /// Synthetic captures (with call chains or without) and the end-to-end captures of
    /// `tests/data` with their symbols.
    #[test]
    fn written_threads_hold_each_sample_with_its_frames() {
        use hvprof_samplelog::synth;
        for chains in [false, true] {
            let cfg = synth::SynthConfig {
                pcpus: 2,
                samples_per_pcpu: 3000,
                chains,
                ..synth::SynthConfig::default()
            };
            let cap = synth::capture(&cfg, &synth::CaptureOptions::default());
            let p = Profile::from_bytes(
                &cap.bytes,
                &Images::default(),
                LoadOptions::all(2),
                &Progress::hidden(),
            );
            assert!(!p.losses.is_empty() && p.samples.has_chains() == chains);
            written_threads_hold_each_sample(&p);
        }
        let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
        for (log, hypervisor, image) in [
            ("sched-3vms-1pcpu.log", "hvprof-3a995a71.sym", "mix.elf"),
            ("sched-2vcpus-1pcpu.log", "hvprof-3a995a71.sym", "mix.elf"),
            ("sched-halt.log", "hvprof-3a995a71.sym", "mix.elf"),
            ("vm-exit-stats.log", "hvprof-401c55b7.sym", "busy.elf"),
        ] {
            let images = Images {
                hypervisor: Some(Symbols::load(&data.join(hypervisor)).unwrap()),
                guests: vec![Symbols::load(&data.join(image)).unwrap()],
                ..Images::default()
            };
            let p = Profile::load(
                &data.join(log),
                &images,
                LoadOptions::all(2),
                &Progress::hidden(),
            )
            .unwrap();
            written_threads_hold_each_sample(&p);
        }
    }

    proptest! {
        /// Pairs are numbered as a map numbers them by first sight, whichever `a`s come first
        /// and however many `b`s each has.
        #[test]
        fn pair_ids_number_by_first_sight(pairs in prop::collection::vec((0u32..40, 0u16..4), 0..300)) {
            let mut ids = PairIds::with_capacity(0);
            let mut want: std::collections::HashMap<(u32, u16), u32> = Default::default();
            for (a, b) in pairs {
                let next = want.len() as u32;
                let expected = *want.entry((a, b)).or_insert(next);
                prop_assert_eq!(ids.number(a, b, next), expected);
            }
        }
    }

    /// A sample table of several chunks, with deltas too long for 32 bits among them, is what
    /// serde_json writes for its columns.
    #[test]
    fn sample_tables_are_written_whole_in_chunks() {
        let n = 2 * CHUNK + 123;
        let mut c = Column::default();
        let mut deltas = Vec::new();
        for i in 0..n {
            let h = (i * 7 % 5) as u32;
            let d = match i % 40_000 {
                17 => 5_000_000_000 + i as u64,
                18 => u64::from(u32::MAX),
                _ => 1_000_000 + (i as u64 % 3) * 1_234,
            };
            c.stacks.push(h);
            match u32::try_from(d) {
                Ok(x) if x != u32::MAX => c.deltas.push(x),
                _ => {
                    c.deltas.push(u32::MAX);
                    c.long.push(d);
                }
            }
            deltas.push(d as f64 / 1_000_000.0);
        }
        // Stack 3 has no Firefox stack; stack 4 is idle.
        let index = [10, 11, 12, NONE, 14];
        let idle: Vec<bool> = (0..5).map(|k| k == 4).collect();
        let mut out = Vec::new();
        let mut w = Splice {
            buf: Vec::new(),
            out: &mut out,
            chunks: Vec::new(),
        };
        write_samples(&mut w, &c, &stack_texts(&index), &idle, "1000").unwrap();
        w.flush().unwrap();
        let want = serde_json::json!({
            "length": n,
            "weightType": "samples",
            "stack": c.stacks.iter().map(|&h| Some(index[h as usize]).filter(|&s| s != NONE)).collect::<Vec<_>>(),
            "timeDeltas": deltas,
            "weight": vec![1; n],
            "threadCPUDelta": c.stacks.iter().map(|&h| if h == 4 { 0 } else { 1000 }).collect::<Vec<_>>(),
        });
        // serde_json's map keeps the keys sorted: compare values, then the order of the keys.
        let got: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(got, want);
        let text = String::from_utf8(out).unwrap();
        let at = |k: &str| text.find(&format!("\"{k}\"")).unwrap();
        assert!(at("length") < at("weightType") && at("weightType") < at("stack"));
        assert!(at("stack") < at("timeDeltas") && at("timeDeltas") < at("weight"));
        assert!(at("weight") < at("threadCPUDelta"));
        assert!(!text.contains(' '));
    }

    /// Time deltas in float milliseconds: the bytes serde_json writes for the float.
    #[test]
    fn millis_are_what_serde_json_writes() {
        let check = |nanos: u64| {
            let p = millis(nanos);
            let got = p[1..usize::from(p[31])].to_vec();
            assert_eq!(p[0], b',');
            let want = serde_json::to_vec(&(nanos as f64 / 1_000_000.0)).unwrap();
            assert_eq!(
                String::from_utf8(got).unwrap(),
                String::from_utf8(want).unwrap(),
                "{nanos} ns"
            );
        };
        for nanos in (0..3_000_000).chain(999_000_000..1_001_000_000) {
            check(nanos);
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2_000_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            check(x >> (x % 64));
        }
        for p in 0..64 {
            for d in [0, 1, 2, 999, 1000] {
                check((1u64 << p).wrapping_sub(d));
                check((1u64 << p).wrapping_add(d));
            }
        }
        for p in 0..20 {
            for d in [0, 1, 2, 999, 1000] {
                check(10u64.pow(p).wrapping_sub(d));
                check(10u64.pow(p).wrapping_add(d));
            }
        }
        check(u64::MAX);
    }
}
