//! Firefox Profiler export (fxprof-processed-profile, the processed profile format): each VM is a
//! process and each of its vCPUs a thread, with its guest samples on the host time axis
//! (stack: guest process, function) and markers for when it ran, was preempted or halted (from
//! the scheduling events); the hypervisor is a process with one thread per pCPU holding its own
//! samples (stack: whom it worked for and on which exit, function) and the idle loop's, and a
//! "records lost" marker over each range where the pCPU's records are missing.
//! pids and tids are those of the `perf script` output.
//!
//! A sample with call chains has its whole stack (`calls::whole_stack`) as its frames: guest
//! samples their process, their callers and their function; the hypervisor's whom it worked
//! for, its callers and its function; on a vCPU's exit with its guest chain, the VM, the guest's
//! frames, `[exit: REASON]`, the hypervisor's frames, its function (on its pCPU's thread). The
//! callers' frames have the category of their code (guest kernel or user, hypervisor).
//!
//! [`write`] does not hand the samples to fxprof-processed-profile, whose sample table holds
//! 36 bytes per sample (and twice that while its vectors grow): each thread's samples are kept
//! here as two columns, their stack's number and their time since the thread's previous sample
//! (8 bytes per sample, sized from the stacks' counts up front), and written into the profile's
//! JSON where fxprof-processed-profile would write them, in the same bytes ([`build`] is the
//! reference: a test compares the two).

use std::io::Write;

use anyhow::{Context, Result};
use fxprof_processed_profile::{
    CategoryColor, CategoryHandle, CategoryPairHandle, CpuDelta, Frame, FrameFlags, FrameHandle,
    FrameInfo, MarkerFieldFlags, MarkerFieldFormat, MarkerTiming, Profile as FxProfile,
    ReferenceTimestamp, SamplingInterval, StaticSchemaMarker, StaticSchemaMarkerField,
    StringHandle, ThreadHandle, Timestamp,
};
use rustc_hash::FxHashMap as HashMap;

use hvprof_samplelog::{EventKind, OutReason};

use crate::calls::{Part, part_name, whole_stack};
use crate::profile::{Profile, What};
use crate::progress::Progress;
use crate::script::ids;

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

/// A thread's samples, in time order: each its stack (an index into [`Parts::stacks`]) and its
/// time since the thread's previous sample (the first: since the profile's start), in
/// nanoseconds; a delta that does not fit 32 bits is `u32::MAX` here and in `long` in order.
#[derive(Default)]
struct Column {
    stacks: Vec<u32>,
    deltas: Vec<u32>,
    long: Vec<u64>,
    last: u64,
}

/// The profile without its samples, and the samples beside it (see [`write`]).
struct Parts {
    fx: FxProfile,
    /// Each thread's samples, by [`Parts::threads`]' order.
    columns: Vec<Column>,
    /// The threads, in the order they were made.
    threads: Vec<ThreadHandle>,
    /// The distinct (thread, Firefox stack) pairs the samples have, numbered in the order
    /// first seen: the thread's place in `threads`, the stack, and whether its samples are
    /// idle (no CPU time).
    stacks: Vec<(u32, Option<fxprof_processed_profile::StackHandle>, bool)>,
    /// A sample out of time order on its thread (never, from a replay in TSC order): the
    /// samples cannot be written as deltas here.
    unordered: bool,
}

/// Builds the Firefox profile.
pub fn build(p: &Profile, progress: &Progress) -> FxProfile {
    build_parts(p, progress, true).fx
}

/// Builds the Firefox profile, its samples added to it (`into_fx`) or kept in columns beside
/// it.
fn build_parts(p: &Profile, progress: &Progress, into_fx: bool) -> Parts {
    let period_ns = p.ticks_to_ns(p.period_ticks).max(1);
    let mut fx = FxProfile::new(
        &format!(
            "hvprof ({} pCPU(s), {} source, period {} TSC ticks)",
            p.pcpus, p.report.source, p.period_ticks
        ),
        ReferenceTimestamp::from_millis_since_unix_epoch(0.0),
        SamplingInterval::from_nanos(period_ns),
    );
    let user = fx.add_category("Guest user", CategoryColor::Yellow);
    let kernel = fx.add_category("Guest kernel", CategoryColor::Orange);
    let hyper = fx.add_category("Hypervisor", CategoryColor::Blue);
    let idle = fx.add_category("Idle", CategoryColor::Transparent);
    let sched = fx.add_category("Scheduling", CategoryColor::Green);
    let (start, _) = p.span();
    let ts =
        |tsc: u64| Timestamp::from_nanos_since_reference(p.ticks_to_ns(tsc.saturating_sub(start)));
    let t0 = ts(start);

    // Processes and threads; each thread's samples, counted from the stacks (to size its
    // columns).
    let mut per_thread: HashMap<(bool, u16, u16), u64> = HashMap::default();
    if !into_fx {
        for st in p.samples.stacks() {
            *per_thread
                .entry(thread_key(st.what, st.pcpu, st.vm, st.vcpu))
                .or_default() += st.count;
        }
    }
    let hv = fx.add_process("hypervisor (hvprof)", 1, t0);
    let mut threads = Threads {
        processes: HashMap::default(),
        map: HashMap::default(),
        list: Vec::new(),
        columns: Vec::new(),
        per_thread,
        hv,
        t0,
        unordered: false,
    };

    progress.phase("firefox", Some(p.samples.len() as u64), "samples");
    // Stacks with chains per (thread, frame, named chains, exit cause).
    type StackKey = (ThreadHandle, u32, u32, bool);
    let mut stacks: HashMap<StackKey, Option<fxprof_processed_profile::StackHandle>> =
        HashMap::default();
    let category = |what: What| -> CategoryPairHandle {
        match what {
            What::GuestUser => user.into(),
            What::GuestKernel => kernel.into(),
            What::Hypervisor => hyper.into(),
            What::Idle => idle.into(),
        }
    };
    // A guest function's label: with its module.
    let guest_label = |function: &str, module: &str| {
        if module.is_empty() {
            function.to_owned()
        } else {
            format!("{function} ({module})")
        }
    };
    let chains = p.samples.has_chains();
    // Per stack of the profile, its thread's place and its (thread, Firefox stack) pair's
    // number in `handles` (`slot << 32 | pair`) once a sample of it is seen (NONE before):
    // every sample of one stack has the same, so the key above is looked up once per stack,
    // not per sample.
    const NONE: u64 = u64::MAX;
    let mut memo: Vec<u64> = vec![NONE; p.samples.stacks().len()];
    let mut handles: Vec<(u32, Option<fxprof_processed_profile::StackHandle>, bool)> = Vec::new();
    // One sample: into the Firefox profile, or its thread's columns.
    let add = |fx: &mut FxProfile,
               threads: &mut Threads,
               handles: &[(u32, Option<fxprof_processed_profile::StackHandle>, bool)],
               known: u64,
               tsc: u64| {
        let (slot, pair) = ((known >> 32) as u32, known as u32);
        if into_fx {
            let (_, stack, idle) = handles[pair as usize];
            let cpu = if idle {
                CpuDelta::ZERO
            } else {
                CpuDelta::from_nanos(period_ns)
            };
            fx.add_sample(threads.list[slot as usize], ts(tsc), stack, cpu, 1);
        } else {
            threads.push(slot, pair, p.ticks_to_ns(tsc.saturating_sub(start)));
        }
    };
    let mut interner = Interner::default();
    let mut labels: Vec<Option<(Option<StringHandle>, Option<StringHandle>)>> =
        vec![None; p.frames.len()];
    // A stack's first sample: its thread and Firefox stack, made, and their pair numbered.
    let mut first =
        |fx: &mut FxProfile,
         threads: &mut Threads,
         handles: &mut Vec<(u32, Option<fxprof_processed_profile::StackHandle>, bool)>,
         s: &crate::profile::Sampled|
         -> u64 {
            let guest = matches!(s.what, What::GuestKernel | What::GuestUser);
            let (t, slot) = if guest {
                threads.get(fx, p, true, s.vm, s.vcpu)
            } else {
                threads.get(fx, p, false, s.pcpu, 0)
            };
            // A capture without chains never looks at the stack again.
            let st = chains.then(|| &p.samples.stacks()[s.stack as usize]);
            let mut make = || {
                let f = &p.frames[s.frame as usize];
                let cat = category(s.what);
                if let Some((st, parts)) = st.and_then(|st| Some((st, whole_stack(p, st)?))) {
                    let frames: Vec<(StringHandle, CategoryPairHandle)> = parts
                        .iter()
                        .filter_map(|part| {
                            let (name, cat) = match part {
                                // The thread is the VM's or the hypervisor's already.
                                Part::Root(_) if !st.exit_cause && s.what != What::Idle => {
                                    return None;
                                }
                                Part::Site(i) => {
                                    let c = p.calls.frame(*i);
                                    let name = if c.what == What::Hypervisor {
                                        c.function.clone()
                                    } else {
                                        guest_label(&c.function, &c.module)
                                    };
                                    (name, category(c.what))
                                }
                                Part::Leaf(f) if guest => {
                                    (guest_label(&f.function, &f.module), cat)
                                }
                                other => (part_name(p, other).into_owned(), cat),
                            };
                            (!name.is_empty()).then_some((name, cat))
                        })
                        .map(|(n, cat)| (fx.intern_string(&n), cat))
                        .collect();
                    return interner.stack(fx, t, frames.into_iter());
                }
                // The frame's two names (an empty one is left out), interned once per frame.
                let (process, function) = *labels[s.frame as usize].get_or_insert_with(|| {
                    let mut name = |n: &str| (!n.is_empty()).then(|| fx.intern_string(n));
                    match s.what {
                        What::GuestKernel | What::GuestUser => {
                            (name(&f.process), name(&guest_label(&f.function, &f.module)))
                        }
                        What::Hypervisor => (name(&f.process), name(&f.function)),
                        What::Idle => (None, name("[idle]")),
                    }
                });
                let frames = [process, function].into_iter().flatten().map(|n| (n, cat));
                interner.stack(fx, t, frames)
            };
            // The stacks of one (thread, frame, named chains) share their Firefox stack, made
            // once; without chains, a frame's names are interned once, and making the stack
            // again is a few lookups.
            let stack = match st {
                Some(st) => *stacks
                    .entry((t, s.frame, st.calls, st.exit_cause))
                    .or_insert_with(make),
                None => make(),
            };
            let pair = handles.len() as u64;
            handles.push((slot, stack, s.what == What::Idle));
            u64::from(slot) << 32 | pair
        };
    p.for_each_run(|run| {
        // The stacks are read in no order: their memo is prefetched a few samples ahead.
        const AHEAD: usize = 16;
        for (k, s) in run.iter().enumerate() {
            if let Some(next) = run.get(k + AHEAD) {
                crate::stack_table::prefetch(&memo[next.stack as usize]);
            }
            let mut known = memo[s.stack as usize];
            if known == NONE {
                known = first(&mut fx, &mut threads, &mut handles, s);
                memo[s.stack as usize] = known;
            }
            add(&mut fx, &mut threads, &handles, known, s.tsc);
        }
        progress.inc(run.len() as u64);
    });
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
    let end = p.span().1;
    for l in &p.report.losses {
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
    Parts {
        fx,
        columns: threads.columns,
        threads: threads.list,
        stacks: handles,
        unordered: threads.unordered,
    }
}

/// The profile's processes and threads as they are made, and each thread's columns.
struct Threads {
    /// Per VM, its process.
    processes: HashMap<u16, fxprof_processed_profile::ProcessHandle>,
    /// Per [`thread_key`], the thread and its place in `list`.
    map: HashMap<(bool, u16, u16), (ThreadHandle, u32)>,
    list: Vec<ThreadHandle>,
    columns: Vec<Column>,
    /// Per [`thread_key`], its samples (empty when the samples go into the profile).
    per_thread: HashMap<(bool, u16, u16), u64>,
    hv: fxprof_processed_profile::ProcessHandle,
    t0: Timestamp,
    /// See [`Parts::unordered`].
    unordered: bool,
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
        let n = self
            .per_thread
            .get(&(guest, a, b))
            .map_or(0, |&n| usize::try_from(n).unwrap_or(0));
        self.columns.push(Column {
            stacks: Vec::with_capacity(n),
            deltas: Vec::with_capacity(n),
            ..Column::default()
        });
        self.map.insert((guest, a, b), (t, slot));
        (t, slot)
    }

    /// A sample of stack `handle` at `nanos` on thread `slot`, in its columns.
    fn push(&mut self, slot: u32, handle: u32, nanos: u64) {
        let c = &mut self.columns[slot as usize];
        let Some(delta) = nanos.checked_sub(c.last) else {
            self.unordered = true;
            return;
        };
        c.last = nanos;
        c.stacks.push(handle);
        match u32::try_from(delta) {
            Ok(d) if d != u32::MAX => c.deltas.push(d),
            _ => {
                c.deltas.push(u32::MAX);
                c.long.push(delta);
            }
        }
    }
}

/// Firefox frames made once per (thread, name, category).
#[derive(Default)]
struct Interner {
    frames: HashMap<(ThreadHandle, StringHandle, CategoryPairHandle), FrameHandle>,
}

impl Interner {
    /// The stack of `frames` (outermost first) on thread `t`, as `FxProfile::intern_stack_frames`
    /// makes it (the same frames and stacks, in the same order); `None` without frames.
    fn stack(
        &mut self,
        fx: &mut FxProfile,
        t: ThreadHandle,
        frames: impl Iterator<Item = (StringHandle, CategoryPairHandle)>,
    ) -> Option<fxprof_processed_profile::StackHandle> {
        let mut prefix = None;
        for (name, category_pair) in frames {
            let frame = *self
                .frames
                .entry((t, name, category_pair))
                .or_insert_with(|| {
                    fx.intern_frame(
                        t,
                        FrameInfo {
                            frame: Frame::Label(name),
                            category_pair,
                            flags: FrameFlags::empty(),
                        },
                    )
                });
            prefix = Some(fx.intern_stack(t, prefix, frame));
        }
        prefix
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

/// Writes the profile as JSON (the Firefox Profiler opens it as it is, or gzipped): the same
/// bytes as fxprof-processed-profile writes for [`build`]'s profile.
///
/// The profile is built without its samples, each thread's kept in columns beside it
/// ([`Column`]). To learn each stack's index in its thread's stack table (fxprof-processed-
/// profile does not say), the profile gets one placeholder sample per distinct (thread, stack),
/// its weight that pair's number; as the profile is written, each thread's sample table is
/// caught ([`Splicer`]), parsed back for the numbers and replaced by the thread's real samples,
/// written here as fxprof-processed-profile writes a sample table.
pub fn write(p: &Profile, out: &mut dyn Write, progress: &Progress) -> Result<()> {
    let mut parts = build_parts(p, progress, false);
    progress.phase("writing", None, "bytes");
    if parts.unordered {
        // Never from a replay in TSC order; fxprof-processed-profile sorts such samples.
        drop(parts);
        let fx = build(p, progress);
        return serde_json::to_writer(out, &fx).context("cannot write the Firefox profile");
    }
    for (n, &(slot, stack, _)) in parts.stacks.iter().enumerate() {
        let weight = i32::try_from(n).context("too many distinct stacks for a Firefox profile")?;
        parts.fx.add_sample(
            parts.threads[slot as usize],
            Timestamp::from_nanos_since_reference(n as u64),
            stack,
            CpuDelta::ZERO,
            weight,
        );
    }
    let period_us = CpuDelta::from_nanos(p.ticks_to_ns(p.period_ticks).max(1));
    let mut splicer = Splicer {
        w: Splice {
            buf: Vec::with_capacity(1 << 20),
            out,
        },
        held: Vec::new(),
        table: None,
        index: vec![None; parts.stacks.len()],
        columns: &parts.columns,
        stacks: &parts.stacks,
        period_us: serde_json::to_string(&period_us)?,
    };
    // serde_json writes a token at a time: the splicer looks at them a large buffer at a time.
    let mut buffered = std::io::BufWriter::with_capacity(1 << 16, &mut splicer);
    serde_json::to_writer(&mut buffered, &parts.fx).context("cannot write the Firefox profile")?;
    buffered
        .flush()
        .context("cannot write the Firefox profile")?;
    drop(buffered);
    if splicer.table.is_some() {
        anyhow::bail!("a Firefox sample table without its end");
    }
    let held = std::mem::take(&mut splicer.held);
    splicer.w.bytes(&held)?;
    splicer.w.flush()?;
    Ok(())
}

/// What starts a thread's sample table in fxprof-processed-profile's JSON. Within a string a
/// quote is escaped: this is a key.
const SAMPLES_KEY: &[u8] = br#""samples":{"length":"#;

/// The output of the profile's serialization, passed on but for the sample tables, which it
/// replaces (see [`write`]).
struct Splicer<'a, 'o> {
    w: Splice<'o>,
    /// Bytes not passed on yet: the end of what was written, which may begin [`SAMPLES_KEY`].
    held: Vec<u8>,
    /// Within a sample table: its bytes so far (from its brace).
    table: Option<Vec<u8>>,
    /// Each (thread, stack) pair's index in its thread's stack table, by its number.
    index: Vec<Option<u32>>,
    columns: &'a [Column],
    stacks: &'a [(u32, Option<fxprof_processed_profile::StackHandle>, bool)],
    period_us: String,
}

impl Splicer<'_, '_> {
    /// A placeholder sample table whole (`{...}`): the thread's real samples instead.
    fn replace(&mut self, table: &[u8]) -> std::io::Result<()> {
        let placeholder: Placeholder = serde_json::from_slice(table)?;
        let Some(&first) = placeholder.weight.first() else {
            // A thread without samples: its table as it is.
            return self.w.io(table);
        };
        let invalid = || std::io::Error::other("a Firefox sample table not ours");
        let pair = |n: i64| usize::try_from(n).ok().filter(|&n| n < self.stacks.len());
        let slot = self.stacks[pair(first).ok_or_else(invalid)?].0;
        for (&n, &stack) in placeholder.weight.iter().zip(&placeholder.stack) {
            self.index[pair(n).ok_or_else(invalid)?] = stack;
        }
        let column = &self.columns[slot as usize];
        write_samples(
            &mut self.w,
            column,
            self.stacks,
            &self.index,
            &self.period_us,
        )
    }
}

impl Write for Splicer<'_, '_> {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let mut rest = data;
        while !rest.is_empty() {
            if let Some(table) = &mut self.table {
                // The table holds numbers, null and one string without braces: it ends at the
                // first closing brace.
                match memchr::memchr(b'}', rest) {
                    Some(i) => {
                        table.extend_from_slice(&rest[..=i]);
                        rest = &rest[i + 1..];
                        let table = self.table.take().unwrap_or_default();
                        self.replace(&table)?;
                    }
                    None => {
                        table.extend_from_slice(rest);
                        rest = &[];
                    }
                }
                continue;
            }
            let from = self.held.len().saturating_sub(SAMPLES_KEY.len() - 1);
            self.held.extend_from_slice(rest);
            rest = &[];
            match find(&self.held[from..], SAMPLES_KEY) {
                Some(i) => {
                    let brace = from + i + br#""samples":"#.len();
                    self.w.io(&self.held[..brace])?;
                    let after = self.held[brace..].to_vec();
                    self.held.clear();
                    self.table = Some(Vec::new());
                    self.write_all(&after)?;
                }
                None => {
                    // Keep what may begin the key.
                    let keep = self.held.len().saturating_sub(SAMPLES_KEY.len() - 1);
                    self.w.io(&self.held[..keep])?;
                    self.held.drain(..keep);
                }
            }
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A placeholder sample table read back: per sample its stack index and weight.
#[derive(serde::Deserialize)]
struct Placeholder {
    stack: Vec<Option<u32>>,
    weight: Vec<i64>,
}

/// Where `needle` first is in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    memchr::memmem::find(hay, needle)
}

/// Buffered writing to the output (its writes are dynamic calls).
struct Splice<'a> {
    buf: Vec<u8>,
    out: &'a mut dyn Write,
}

impl Splice<'_> {
    #[inline]
    fn io(&mut self, b: &[u8]) -> std::io::Result<()> {
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

/// A thread's sample table, as fxprof-processed-profile writes it (`SampleTable`'s
/// serialization through serde_json, its samples in time order): the length, the weight type,
/// then per sample its stack index (`index` of its pair), its time since the previous sample
/// (float milliseconds), its weight (1), its CPU time (`period_us`, 0 when idle). The columns
/// are formatted in chunks on every core, written in order.
fn write_samples(
    w: &mut Splice<'_>,
    c: &Column,
    stacks: &[(u32, Option<fxprof_processed_profile::StackHandle>, bool)],
    index: &[Option<u32>],
    period_us: &str,
) -> std::io::Result<()> {
    let n = c.stacks.len();
    let mut num = itoa::Buffer::new();
    w.io(br#"{"length":"#)?;
    w.io(num.format(n).as_bytes())?;
    w.io(br#","weightType":"samples","stack":["#)?;
    chunked(w, n, |_, range, out| {
        let mut num = itoa::Buffer::new();
        for i in range {
            if i > 0 {
                out.push(b',');
            }
            match index[c.stacks[i] as usize] {
                Some(s) => out.extend_from_slice(num.format(s).as_bytes()),
                None => out.extend_from_slice(b"null"),
            }
        }
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
    chunked(w, n, |k, range, out| {
        let mut long = c.long[long_from[k]..].iter();
        // Periodic samples: mostly the same delta, formatted once.
        let mut last: Option<u64> = None;
        let mut text: Vec<u8> = Vec::new();
        for i in range {
            if i > 0 {
                out.push(b',');
            }
            let d = match c.deltas[i] {
                u32::MAX => long.next().copied().unwrap_or_default(),
                d => u64::from(d),
            };
            if last != Some(d) {
                text.clear();
                // Into a vector: cannot fail.
                let _ = millis(&mut text, d);
                last = Some(d);
            }
            out.extend_from_slice(&text);
        }
    })?;
    w.io(br#"],"weight":["#)?;
    chunked(w, n, |_, range, out| {
        for i in range {
            out.extend_from_slice(if i > 0 { b",1" } else { b"1" });
        }
    })?;
    w.io(br#"],"threadCPUDelta":["#)?;
    chunked(w, n, |_, range, out| {
        for i in range {
            if i > 0 {
                out.push(b',');
            }
            if stacks[c.stacks[i] as usize].2 {
                out.push(b'0');
            } else {
                out.extend_from_slice(period_us.as_bytes());
            }
        }
    })?;
    w.io(b"]}")
}

/// Samples per chunk of a column formatted at once.
const CHUNK: usize = 1 << 16;

/// Items `0..n` formatted by `format(k, range, out)` (chunk `k`, its items `range`) on every
/// core, a few chunks at a time, and written in order.
fn chunked(
    w: &mut Splice<'_>,
    n: usize,
    format: impl Fn(usize, std::ops::Range<usize>, &mut Vec<u8>) + Sync,
) -> std::io::Result<()> {
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get().min(8));
    let chunks = n.div_ceil(CHUNK);
    let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); threads];
    let format = &format;
    let mut k = 0;
    while k < chunks {
        let wave = threads.min(chunks - k);
        std::thread::scope(|sc| {
            for (j, buf) in bufs.iter_mut().take(wave).enumerate() {
                let chunk = k + j;
                let range = chunk * CHUNK..((chunk + 1) * CHUNK).min(n);
                buf.clear();
                if j + 1 == wave {
                    format(chunk, range, buf);
                } else {
                    sc.spawn(move || format(chunk, range, buf));
                }
            }
        });
        for buf in bufs.iter().take(wave) {
            w.io(buf)?;
        }
        k += wave;
    }
    Ok(())
}

/// `nanos` as float milliseconds, as serde_json writes `nanos as f64 / 1e6` (fxprof-processed-
/// profile's time deltas): the shortest decimal that reads back as that float. Below 10^15 ns
/// the quotient's exact decimal (at most 15 significant digits, six after the point) is it:
/// the float is the one nearest to that decimal (a correctly rounded quotient), and two
/// decimals of at most 15 digits never share a float, so no shorter one reads back as it.
/// serde_json writes it in fixed notation from 10^-5 on (`1.0` for a whole number); smaller
/// and larger values are left to it.
fn millis(out: &mut Vec<u8>, nanos: u64) -> std::io::Result<()> {
    if !(10_000..1_000_000_000_000_000).contains(&nanos) {
        use serde_json::ser::Formatter;
        return serde_json::ser::CompactFormatter.write_f64(out, nanos as f64 / 1_000_000.0);
    }
    let mut num = itoa::Buffer::new();
    out.extend_from_slice(num.format(nanos / 1_000_000).as_bytes());
    out.push(b'.');
    let mut frac = nanos % 1_000_000;
    if frac == 0 {
        out.push(b'0');
        return Ok(());
    }
    let mut digits = 6;
    while frac.is_multiple_of(10) {
        frac /= 10;
        digits -= 1;
    }
    let text = num.format(frac);
    out.extend(std::iter::repeat_n(b'0', digits - text.len()));
    out.extend_from_slice(text.as_bytes());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{CHUNK, Column, Splice, millis, write_samples};

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
        // Pair 3 has no stack; pair 4 is idle.
        let index = [Some(10), Some(11), Some(12), None, Some(14)];
        let stacks: Vec<(u32, Option<fxprof_processed_profile::StackHandle>, bool)> =
            (0..5).map(|k| (0, None, k == 4)).collect();
        let mut out = Vec::new();
        let mut w = Splice {
            buf: Vec::new(),
            out: &mut out,
        };
        write_samples(&mut w, &c, &stacks, &index, "1000").unwrap();
        w.flush().unwrap();
        let want = serde_json::json!({
            "length": n,
            "weightType": "samples",
            "stack": c.stacks.iter().map(|&h| index[h as usize]).collect::<Vec<_>>(),
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
            let mut got = Vec::new();
            millis(&mut got, nanos).unwrap();
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
