//! Every distinct stack named into a frame ([`Frame`]: VM, process, module, function): once per
//! distinct address and naming context, on every core, each frame with its hash, then merged by
//! name so that no string is hashed on one core.

use std::hash::BuildHasher;

use rustc_hash::FxHashMap as HashMap;

use hvprof_samplelog::NO_VM;

use crate::model::samples::{Frame, Samples, Stack, What, hypervisor_label};
use crate::naming::namer::{Namer, ProcessKey};

impl Samples {
    /// Names every stack (once per distinct (what, VM, exit, address, process, address space),
    /// then merged by name). A user sample's address space is part of it: two processes with
    /// one label (a PID reused by the same program) map their own files at one address.
    pub(super) fn name(&mut self, namer: &Namer, needed: impl Fn(&Stack) -> bool) -> Vec<Frame> {
        // A frame's key is its address and its context as naming sees it (what, VM, exit or
        // process, address space): the contexts, a few thousand at most, are numbered first,
        // so that the table of distinct keys (up to one per stack, over a million with Linux
        // guests' tasks) holds 12 bytes a key and hashes two words.
        type FrameContext = (What, u16, u16, Option<ProcessKey>, u64);
        let frame_key = |s: &Stack| -> (FrameContext, u64) {
            match s.what {
                What::GuestUser => (
                    (s.what, s.vm, 0, s.process, namer.address_space(s.vm, s.cr3)),
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
    use crate::model::cost::CostSum;
    use crate::model::first_pass::Classified;
    use crate::naming::symbols::Images;

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
}
