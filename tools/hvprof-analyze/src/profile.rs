//! Every sample of a capture, named: the model the charts and the export formats are drawn from,
//! with the report built from the same decoding (so their totals agree by construction).
//!
//! A sample's frame is four names, outermost first: the VM, the process, the module, the
//! function. Guest samples: `guestOS1; cr3:0x1000 (or comm[tgid]); mix1.elf; work_a`.
//! Hypervisor samples: `[hypervisor]; <VM>: <exit reason> (or "no VM"); hvprof; <function>`.
//! Idle samples: `[idle]` alone.

use anyhow::{Context, Result};
use rustc_hash::FxHashMap as HashMap;

use hvprof_samplelog::{Decoded, Event, NO_VM, Record, SampleKind};

use crate::naming::{Namer, ProcessKey, VmMeta, exit_name};
use crate::progress::Progress;
use crate::report::Report;
use crate::symbols::Images;
use crate::timeline::Owner;

/// What a pCPU was doing at a sample.
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
    /// The guest CR3 (guest samples; 0 for the others).
    pub cr3: u64,
    /// The sampled address: guest RIP, or hypervisor RIP.
    pub addr: u64,
    /// Index into `Profile::frames`.
    pub frame: u32,
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
        match self.what {
            What::GuestKernel | What::GuestUser => Owner::Guest {
                vm: self.vm,
                vcpu: self.vcpu,
            },
            What::Hypervisor => Owner::Hypervisor {
                vm: self.vm,
                vcpu: self.vcpu,
            },
            What::Idle => Owner::Idle,
        }
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
        self.names()
            .map(|n| n.replace(';', ","))
            .collect::<Vec<_>>()
            .join(";")
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
    /// Guest samples: the guest CR3; 0 for the others.
    pub cr3: u64,
    /// The guest process (guest samples): its task where the log names it, else its CR3.
    pub process: Option<ProcessKey>,
    /// Index into `Profile::frames`.
    pub frame: u32,
    /// Samples of this stack.
    pub count: u64,
}

/// One sample: its TSC and its stack (index into `Samples::stacks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub tsc: u64,
    pub stack: u32,
}

/// Every sample of a capture: the distinct stacks, and per pCPU each sample's TSC and stack in
/// TSC order. Iterating gives every sample as a [`Sampled`], in TSC order (then pCPU).
#[derive(Debug, Default)]
pub struct Samples {
    stacks: Vec<Stack>,
    /// Per pCPU (ascending): its samples in TSC order.
    pcpus: Vec<(u16, Vec<Slot>)>,
    len: usize,
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

    /// Each pCPU's samples in TSC order, by pCPU.
    pub fn pcpus(&self) -> impl Iterator<Item = (u16, &[Slot])> {
        self.pcpus.iter().map(|(c, l)| (*c, l.as_slice()))
    }

    /// A sample whole.
    pub fn sampled(&self, slot: Slot) -> Sampled {
        let s = &self.stacks[slot.stack as usize];
        Sampled {
            tsc: slot.tsc,
            cr3: s.cr3,
            addr: s.addr,
            frame: s.frame,
            pcpu: s.pcpu,
            vm: s.vm,
            vcpu: s.vcpu,
            exit: s.exit,
            what: s.what,
        }
    }

    /// Every sample in TSC order, then pCPU (the pCPUs' lists merged).
    pub fn iter(&self) -> InOrder<'_> {
        let mut heads = std::collections::BinaryHeap::new();
        for (i, (_, list)) in self.pcpus.iter().enumerate() {
            if let Some(first) = list.first() {
                heads.push(std::cmp::Reverse((first.tsc, i, 0usize)));
            }
        }
        InOrder {
            samples: self,
            heads,
        }
    }

    /// First and last sample TSC (0, 0 without samples).
    pub fn span(&self) -> (u64, u64) {
        let first = self
            .pcpus
            .iter()
            .filter_map(|(_, l)| l.first())
            .map(|s| s.tsc)
            .min();
        let last = self
            .pcpus
            .iter()
            .filter_map(|(_, l)| l.last())
            .map(|s| s.tsc)
            .max();
        (first.unwrap_or(0), last.unwrap_or(0))
    }
}

/// [`Samples::iter`]: a k-way merge of the pCPUs' lists.
pub struct InOrder<'a> {
    samples: &'a Samples,
    /// (TSC, pCPU index, position) of each pCPU's next sample.
    heads: std::collections::BinaryHeap<std::cmp::Reverse<(u64, usize, usize)>>,
}

impl Iterator for InOrder<'_> {
    type Item = Sampled;

    fn next(&mut self) -> Option<Sampled> {
        let std::cmp::Reverse((_, p, at)) = self.heads.pop()?;
        let list = &self.samples.pcpus[p].1;
        if let Some(next) = list.get(at + 1) {
            self.heads.push(std::cmp::Reverse((next.tsc, p, at + 1)));
        }
        Some(self.samples.sampled(list[at]))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.samples.len))
    }
}

impl<'a> IntoIterator for &'a Samples {
    type Item = Sampled;
    type IntoIter = InOrder<'a>;
    fn into_iter(self) -> InOrder<'a> {
        self.iter()
    }
}

/// A whole capture, named.
pub struct Profile {
    pub report: Report,
    pub tsc_hz: u64,
    pub period_ticks: u64,
    pub pcpus: u16,
    pub vms: Vec<VmMeta>,
    /// Every sample, in TSC order (then pCPU).
    pub samples: Samples,
    pub frames: Vec<Frame>,
    /// Every scheduling event with its pCPU, in TSC order.
    pub events: Vec<(u16, Event)>,
    /// The console text of the capture (shown, never read for data).
    pub text: String,
    /// The VM end frames: exit tables, LSTAR, task offsets.
    pub vm_ends: Vec<hvprof_samplelog::VmEnd>,
}

/// `keep_guest` names Linux guests' samples by process in the report (`--kernel`,
/// `--processes`; the other views always do).
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    pub threads: usize,
    pub keep_guest: bool,
}

/// A sample classified, before naming: the fields of [`Stack`] the records give.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    addr: u64,
    cr3: u64,
    pcpu: u16,
    vm: u16,
    vcpu: u16,
    exit: u16,
    what: What,
}

/// The one classification of a sample: what it is and which address names it.
fn classify(pcpu: u16, s: &hvprof_samplelog::Sample) -> Key {
    let (what, addr) = match s.kind {
        SampleKind::Guest if s.cpl() == 3 => (What::GuestUser, s.guest_rip),
        SampleKind::Guest => (What::GuestKernel, s.guest_rip),
        SampleKind::Hypervisor => (What::Hypervisor, s.host_rip),
        SampleKind::Idle => (What::Idle, s.host_rip),
    };
    let guest = matches!(what, What::GuestKernel | What::GuestUser);
    Key {
        addr,
        cr3: if guest { s.guest_cr3 } else { 0 },
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
    fn merge(&mut self, o: CostSum) {
        self.sum = self.sum.saturating_add(o.sum);
        self.min = self.min.min(o.min);
        self.max = self.max.max(o.max);
    }
}

/// Samples per chunk of a [`Part`]'s lists (1 MB).
const CHUNK: usize = 1 << 16;

/// What one decoding thread classified: its distinct keys with their counts, each pCPU's
/// samples (TSC, key index) in stream order, the scheduling events, the cost. A key is found
/// in two steps, so that the per-sample table stays small (it is the one random access per
/// sample): its context (all but the address; consecutive samples mostly share it), then
/// (address, context).
#[derive(Default)]
struct Part {
    contexts: HashMap<Key, u32>,
    context_keys: Vec<Key>,
    /// (address, context) → (key index, samples).
    ids: HashMap<(u64, u32), (u32, u64)>,
    keys: Vec<Key>,
    /// Per pCPU, its samples in stream order, in chunks of [`CHUNK`] (a list never regrows: a
    /// 10 M-sample capture would copy and zero its lists again at each doubling).
    lists: HashMap<u16, Vec<Vec<Slot>>>,
    events: Vec<(u16, Event)>,
    cost: CostSum,
}

impl Part {
    fn add(&mut self, pcpu: u16, records: &[Record]) {
        let chunks = self.lists.entry(pcpu).or_default();
        let mut list = match chunks.pop() {
            Some(l) => l,
            None => Vec::with_capacity(CHUNK),
        };
        let mut last: Option<(Key, u32)> = None;
        for r in records {
            let s = match r {
                Record::Sample(s) => s,
                Record::Event(e) => {
                    self.events.push((pcpu, *e));
                    continue;
                }
            };
            let cost = u64::from(s.cost);
            self.cost.sum += cost;
            self.cost.min = self.cost.min.min(cost);
            self.cost.max = self.cost.max.max(cost);
            let key = classify(pcpu, s);
            let context = Key { addr: 0, ..key };
            let ctx = match last {
                Some((c, i)) if c == context => i,
                _ => {
                    let keys = &mut self.context_keys;
                    let i = *self.contexts.entry(context).or_insert_with(|| {
                        keys.push(context);
                        (keys.len() - 1) as u32
                    });
                    last = Some((context, i));
                    i
                }
            };
            let keys = &mut self.keys;
            let entry = self.ids.entry((key.addr, ctx)).or_insert_with(|| {
                keys.push(key);
                ((keys.len() - 1) as u32, 0)
            });
            entry.1 += 1;
            if list.len() == list.capacity() {
                chunks.push(std::mem::replace(&mut list, Vec::with_capacity(CHUNK)));
            }
            list.push(Slot {
                tsc: s.tsc,
                stack: entry.0,
            });
        }
        chunks.push(list);
    }

    /// Adds `n` samples of `key`; returns its index.
    fn count(&mut self, key: Key, n: u64) -> u32 {
        let context = Key { addr: 0, ..key };
        let keys = &mut self.context_keys;
        let ctx = *self.contexts.entry(context).or_insert_with(|| {
            keys.push(context);
            (keys.len() - 1) as u32
        });
        let keys = &mut self.keys;
        let entry = self.ids.entry((key.addr, ctx)).or_insert_with(|| {
            keys.push(key);
            ((keys.len() - 1) as u32, 0)
        });
        entry.1 += n;
        entry.0
    }

    /// Each key with its samples, by key index.
    fn counted_keys(&self) -> Vec<(Key, u64)> {
        let mut out: Vec<(Key, u64)> = self.keys.iter().map(|&k| (k, 0)).collect();
        for &(id, n) in self.ids.values() {
            out[id as usize].1 = n;
        }
        out
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
}

impl Classified {
    /// Decodes `bytes` on `threads` threads, classifying every sample as it is decoded.
    pub fn decode(bytes: &[u8], threads: usize, progress: &Progress) -> (Decoded, Classified) {
        progress.phase("decoding", None, "records");
        let (decoded, parts) = hvprof_samplelog::decode_parallel(
            bytes,
            threads,
            Part::default,
            |part: &mut Part, pcpu, records: &[Record]| {
                part.add(pcpu, records);
                progress.inc(records.len() as u64);
            },
        );
        (decoded, Self::merge(parts))
    }

    /// The parts' keys made one table, their lists joined per pCPU in stream order (each
    /// allocated once, at its size), then put in TSC order.
    fn merge(parts: Vec<Part>) -> Classified {
        // The first part's table becomes the capture's (its keys keep their index): the other
        // parts' keys are looked up in it, and the new ones added after its own, in order.
        let mut parts = parts.into_iter();
        let mut base = parts.next().unwrap_or_default();
        let mut parts: Vec<Part> = parts.collect();
        let mut events = std::mem::take(&mut base.events);
        let mut cost = base.cost;
        // Per part after the first: its key indices in the capture's table.
        let mut remaps: Vec<Vec<u32>> = Vec::with_capacity(parts.len());
        for part in &mut parts {
            let remap: Vec<u32> = part
                .counted_keys()
                .into_iter()
                .map(|(k, n)| base.count(k, n))
                .collect();
            remaps.push(remap);
            events.append(&mut part.events);
            cost.merge(part.cost);
        }
        let stacks: Vec<Stack> = base
            .counted_keys()
            .into_iter()
            .map(|(k, count)| Stack {
                what: k.what,
                pcpu: k.pcpu,
                vm: k.vm,
                vcpu: k.vcpu,
                exit: k.exit,
                addr: k.addr,
                cr3: k.cr3,
                process: None,
                frame: 0,
                count,
            })
            .collect();
        let mut sizes: std::collections::BTreeMap<u16, usize> = Default::default();
        for part in std::iter::once(&base).chain(&parts) {
            for (&pcpu, chunks) in &part.lists {
                *sizes.entry(pcpu).or_default() += chunks.iter().map(Vec::len).sum::<usize>();
            }
        }
        let len = sizes.values().sum();
        /// A pCPU, its samples, and its chunks in each part (in stream order).
        type Work = (u16, usize, Vec<Vec<Vec<Slot>>>);
        let work: Vec<Work> = sizes
            .into_iter()
            .filter(|&(_, n)| n > 0)
            .map(|(c, n)| {
                let chunks = std::iter::once(&mut base)
                    .chain(parts.iter_mut())
                    .map(|part| part.lists.remove(&c).unwrap_or_default())
                    .collect();
                (c, n, chunks)
            })
            .collect();
        let pcpus = crate::par_map(work, |(c, n, per_part)| {
            let mut l = Vec::with_capacity(n);
            let mut per_part = per_part.into_iter();
            for chunk in per_part.next().unwrap_or_default() {
                l.extend_from_slice(&chunk);
            }
            for (chunks, remap) in per_part.zip(&remaps) {
                for chunk in chunks {
                    l.extend(chunk.iter().map(|s| Slot {
                        tsc: s.tsc,
                        stack: remap[s.stack as usize],
                    }));
                }
            }
            if !l.is_sorted_by_key(|s| s.tsc) {
                l.sort_by_key(|s| s.tsc);
            }
            (c, l)
        });
        Classified {
            samples: Samples { stacks, pcpus, len },
            events,
            cost,
        }
    }

    /// Names every stack: a guest sample's process (for Linux guests the task its vCPU ran at
    /// the sample's time, which splits a stack by task), then its frame.
    fn name(&mut self, namer: &Namer) -> Vec<Frame> {
        let samples = &mut self.samples;
        // Stacks whose process depends on the time: guest samples of Linux VMs.
        let timed: Vec<bool> = samples
            .stacks
            .iter()
            .map(|s| is_guest(s.what) && namer.is_linux(s.vm))
            .collect();
        for s in samples.stacks.iter_mut() {
            if is_guest(s.what) {
                s.process = Some(ProcessKey::Cr3(s.cr3));
            }
        }
        if timed.iter().any(|&t| t) {
            let mut split: HashMap<(u32, ProcessKey), u32> = HashMap::default();
            for s in samples.stacks.iter_mut().zip(&timed).filter(|(_, t)| **t) {
                s.0.count = 0;
            }
            let stacks = &mut samples.stacks;
            for (_, list) in samples.pcpus.iter_mut() {
                for slot in list.iter_mut() {
                    let i = slot.stack as usize;
                    if !timed[i] {
                        continue;
                    }
                    let base = stacks[i];
                    let pk = namer.process_key(base.vm, base.vcpu, slot.tsc, base.cr3);
                    let id = *split.entry((slot.stack, pk)).or_insert_with(|| {
                        stacks.push(Stack {
                            process: Some(pk),
                            count: 0,
                            ..base
                        });
                        (stacks.len() - 1) as u32
                    });
                    stacks[id as usize].count += 1;
                    slot.stack = id;
                }
            }
            // The stacks split by task are no one's now: drop them.
            let mut remap = vec![0u32; samples.stacks.len()];
            let mut kept = 0u32;
            for (i, r) in remap.iter_mut().enumerate() {
                if i >= timed.len() || !timed[i] {
                    *r = kept;
                    kept += 1;
                }
            }
            let mut i = 0;
            samples.stacks.retain(|_| {
                i += 1;
                i > timed.len() || !timed[i - 1]
            });
            for (_, list) in samples.pcpus.iter_mut() {
                for slot in list.iter_mut() {
                    slot.stack = remap[slot.stack as usize];
                }
            }
        }
        // Named once per distinct (what, VM, exit, address, process, address space), then
        // merged by name. A user sample's address space is part of it: two processes with one
        // label (a PID reused by the same program) map their own files at one address.
        type FrameKey = (What, u16, u16, u64, Option<ProcessKey>, u64);
        let mut named: HashMap<FrameKey, u32> = HashMap::default();
        let mut frames: Vec<Frame> = Vec::new();
        let mut index: HashMap<Frame, u32> = HashMap::default();
        for s in samples.stacks.iter_mut() {
            let key: FrameKey = match s.what {
                What::GuestUser => (
                    s.what,
                    s.vm,
                    0,
                    s.addr,
                    s.process,
                    crate::naming::address_space(s.cr3),
                ),
                What::GuestKernel => (s.what, s.vm, 0, s.addr, s.process, 0),
                What::Hypervisor => (s.what, s.vm, s.exit, s.addr, None, 0),
                What::Idle => (s.what, 0, 0, 0, None, 0),
            };
            s.frame = *named.entry(key).or_insert_with(|| {
                let f = make_frame(namer, s);
                *index.entry(f.clone()).or_insert_with(|| {
                    frames.push(f);
                    (frames.len() - 1) as u32
                })
            });
        }
        frames
    }
}

fn is_guest(what: What) -> bool {
    matches!(what, What::GuestKernel | What::GuestUser)
}

impl Profile {
    /// Reads and names a capture file.
    pub fn load(
        path: &std::path::Path,
        images: &Images,
        options: LoadOptions,
        progress: &Progress,
    ) -> Result<Profile> {
        let bytes =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let profile = Self::from_bytes(&bytes, images, options, progress);
        if profile.samples.is_empty() {
            anyhow::bail!(
                "{}: no samples in this capture ({} bytes{}): is it an hvprof serial log?",
                path.display(),
                bytes.len(),
                if profile.report.lost.truncated {
                    ", no end frame"
                } else {
                    ""
                }
            );
        }
        Ok(profile)
    }

    /// Decodes (on `options.threads` threads) and classifies a capture, names its stacks and
    /// builds the report from them.
    pub fn from_bytes(
        bytes: &[u8],
        images: &Images,
        options: LoadOptions,
        progress: &Progress,
    ) -> Profile {
        let (decoded, mut classified) = Classified::decode(bytes, options.threads, progress);
        progress.phase("naming", None, "stacks");
        let mut warnings = Vec::new();
        let namer = Namer::new(&decoded, images, &mut warnings);
        let frames = classified.name(&namer);
        let report = crate::report::build(
            &decoded,
            &classified,
            &frames,
            &namer,
            images,
            options.keep_guest,
            warnings,
        );
        let Classified {
            samples,
            mut events,
            ..
        } = classified;
        events.sort_by_key(|(pcpu, e)| (e.tsc, *pcpu));
        let header = decoded.header.clone().unwrap_or_default();
        Profile {
            report,
            tsc_hz: header.tsc_hz,
            period_ticks: header.period_ticks,
            pcpus: header.pcpus,
            vms: namer.vms.clone(),
            samples,
            frames,
            events,
            text: decoded.text_joined(),
            vm_ends: decoded.vm_ends.clone(),
        }
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
        self.samples.pcpus().map(|(c, _)| c).collect()
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

    /// Nanoseconds of `ticks` TSC ticks (ticks when the TSC frequency is unknown).
    pub fn ticks_to_ns(&self, ticks: u64) -> u64 {
        if self.tsc_hz == 0 {
            ticks
        } else {
            (u128::from(ticks) * 1_000_000_000 / u128::from(self.tsc_hz)) as u64
        }
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
            LoadOptions {
                threads: 2,
                keep_guest: false,
            },
            &Progress::hidden(),
        );
        assert_eq!(p.samples.len() as u64, p.report.total_samples);
        assert_eq!(p.report.total_samples, cap.samples);
        let all: Vec<Sampled> = p.samples.iter().collect();
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
        for s in p.samples.iter().filter(|s| s.what == What::Hypervisor) {
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
        let stack = |cr3| Stack {
            what: What::GuestUser,
            pcpu: 0,
            vm: 0,
            vcpu: 0,
            exit: 0,
            addr: 0x20_0484,
            cr3,
            process: None,
            frame: 0,
            count: 1,
        };
        let mut classified = Classified {
            samples: Samples {
                stacks: vec![stack(0x2_0000), stack(0x2_4000 | 0x1000)],
                pcpus: vec![(
                    0,
                    vec![
                        Slot { tsc: 10, stack: 0 },
                        Slot {
                            tsc: 2000,
                            stack: 1,
                        },
                    ],
                )],
                len: 2,
            },
            events: Vec::new(),
            cost: CostSum::default(),
        };
        let frames = classified.name(&namer);
        let named: Vec<&Frame> = classified
            .samples
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
