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

use std::io::Write;

use anyhow::{Context, Result};
use fxprof_processed_profile::{
    CategoryColor, CategoryHandle, CategoryPairHandle, CpuDelta, Frame, FrameFlags, FrameInfo,
    MarkerFieldFlags, MarkerFieldFormat, MarkerTiming, Profile as FxProfile, ReferenceTimestamp,
    SamplingInterval, StaticSchemaMarker, StaticSchemaMarkerField, StringHandle, ThreadHandle,
    Timestamp,
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

/// Builds the Firefox profile.
pub fn build(p: &Profile, progress: &Progress) -> FxProfile {
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

    // Processes and threads.
    let mut processes = HashMap::default();
    let mut threads: HashMap<(bool, u16, u16), ThreadHandle> = HashMap::default();
    let hv = fx.add_process("hypervisor (hvprof)", 1, t0);
    let mut thread = |fx: &mut FxProfile, guest: bool, a: u16, b: u16| -> ThreadHandle {
        if let Some(&t) = threads.get(&(guest, a, b)) {
            return t;
        }
        let t = if guest {
            let (pid, tid) = ids(What::GuestUser, a, b, 0);
            let process = *processes
                .entry(a)
                .or_insert_with(|| fx.add_process(&format!("VM {}", p.vm_name(a)), pid, t0));
            let t = fx.add_thread(process, tid, t0, b == 0);
            fx.set_thread_name(t, &format!("{} vCPU {b}", p.vm_name(a)));
            t
        } else {
            let (_, tid) = ids(What::Hypervisor, 0, 0, a);
            let t = fx.add_thread(hv, tid, t0, a == 0);
            fx.set_thread_name(t, &format!("pCPU {a}"));
            t
        };
        threads.insert((guest, a, b), t);
        t
    };

    progress.phase("firefox", Some(p.samples.len() as u64), "samples");
    // Stacks per (thread, frame, named chains, exit cause).
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
    let mut i = 0u64;
    let chains = p.samples.has_chains();
    // Per stack of the profile, its (thread, Firefox stack) in `handles` once a sample of it is
    // seen (NONE before): every sample of one stack has the same, so the key above is looked up
    // once per stack, not per sample.
    const NONE: u32 = u32::MAX;
    let mut memo: Vec<u32> = vec![NONE; p.samples.stacks().len()];
    let mut handles: Vec<(ThreadHandle, Option<fxprof_processed_profile::StackHandle>)> =
        Vec::new();
    p.for_each_sample(|s| {
        let cpu = if s.what == What::Idle {
            CpuDelta::ZERO
        } else {
            CpuDelta::from_nanos(period_ns)
        };
        let known = memo[s.stack as usize];
        if known != NONE {
            let (t, stack) = handles[known as usize];
            fx.add_sample(t, ts(s.tsc), stack, cpu, 1);
            i += 1;
            if i.is_multiple_of(65536) {
                progress.inc(65536);
            }
            return;
        }
        let guest = matches!(s.what, What::GuestKernel | What::GuestUser);
        let t = if guest {
            thread(&mut fx, true, s.vm, s.vcpu)
        } else {
            thread(&mut fx, false, s.pcpu, 0)
        };
        // A capture without chains never looks at the stack again.
        let st = chains.then(|| &p.samples.stacks()[s.stack as usize]);
        let key = match st {
            Some(st) => (t, s.frame, st.calls, st.exit_cause),
            None => (t, s.frame, 0, false),
        };
        let stack = *stacks.entry(key).or_insert_with(|| {
            let f = &p.frames[s.frame as usize];
            let cat = category(s.what);
            if let Some((st, parts)) = st.and_then(|st| Some((st, whole_stack(p, st)?))) {
                let frames: Vec<FrameInfo> = parts
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
                            Part::Leaf(f) if guest => (guest_label(&f.function, &f.module), cat),
                            other => (part_name(p, other).into_owned(), cat),
                        };
                        (!name.is_empty()).then_some((name, cat))
                    })
                    .map(|(n, cat)| FrameInfo {
                        frame: Frame::Label(fx.intern_string(&n)),
                        category_pair: cat,
                        flags: FrameFlags::empty(),
                    })
                    .collect();
                return fx.intern_stack_frames(t, frames.into_iter());
            }
            let mut names: Vec<String> = Vec::new();
            match s.what {
                What::GuestKernel | What::GuestUser => {
                    names.push(f.process.clone());
                    names.push(guest_label(&f.function, &f.module));
                }
                What::Hypervisor => {
                    names.push(f.process.clone());
                    names.push(f.function.clone());
                }
                What::Idle => names.push("[idle]".into()),
            }
            let frames: Vec<FrameInfo> = names
                .iter()
                .filter(|n| !n.is_empty())
                .map(|n| FrameInfo {
                    frame: Frame::Label(fx.intern_string(n)),
                    category_pair: cat,
                    flags: FrameFlags::empty(),
                })
                .collect();
            fx.intern_stack_frames(t, frames.into_iter())
        });
        memo[s.stack as usize] = handles.len() as u32;
        handles.push((t, stack));
        fx.add_sample(t, ts(s.tsc), stack, cpu, 1);
        i += 1;
        if i.is_multiple_of(65536) {
            progress.inc(65536);
        }
    });

    // Scheduling markers on the vCPU threads.
    let mut open: HashMap<(u16, u16), u64> = HashMap::default();
    let mut last_out: HashMap<(u16, u16), (u64, OutReason)> = HashMap::default();
    let running = fx.intern_string("running");
    let out_name = fx.intern_string("out");
    for &(pcpu, e) in &p.events {
        let key = (e.vm, e.vcpu);
        let t = thread(&mut fx, true, e.vm, e.vcpu);
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
        let t = thread(&mut fx, false, l.pcpu, 0);
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
    for &t in threads.values() {
        fx.set_thread_show_markers_in_timeline(t, true);
    }
    fx
}

/// Writes the profile as JSON (the Firefox Profiler opens it as it is, or gzipped).
pub fn write(p: &Profile, out: &mut dyn Write, progress: &Progress) -> Result<()> {
    let fx = build(p, progress);
    serde_json::to_writer(out, &fx).context("cannot write the Firefox profile")
}
