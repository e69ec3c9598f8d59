//! The first pass ([`Classified::decode`]): the capture decoded in parts, one per core, each
//! thread classifying and counting the samples of its blocks ([`crate::model::first_pass_part`]),
//! then the parts made one ([`Classified::merge`]): every part's keys looked up in the first
//! part's table (a few dozen at a time, their slots prefetched) and the new ones added, their
//! segments, blocks and events joined per pCPU in stream order, their counts summed.

use hvprof_samplelog::Event;

use crate::model::cost::CostSum;
use crate::model::first_pass_part::{
    BlockSpan, KeptAt, KeptPart, KeyCounts, Located, Part, PartKeys, PartTimes, StreamSegments,
    Tally,
};
use crate::model::progress::Progress;
use crate::model::samples::{Samples, Stack};
use crate::model::stack_table;
use crate::model::timeline::Segment;
use crate::model::window::Window;
use crate::naming::namer::Processes;
use hvprof_samplelog::{Decoded, Record};

/// A capture's samples classified once, before naming: what the report and every view are
/// built from.
pub struct Classified {
    /// Stacks without their frame (`frame` 0) until named.
    pub samples: Samples,
    /// Every scheduling event with its pCPU, in stream order.
    pub events: Vec<(u16, Event)>,
    pub cost: CostSum,
    /// Every sample's owner, as segments per pCPU in stream order, and where each starts.
    pub(super) segments: StreamSegments,
    /// Per decoding thread, the samples it kept (none unless [`Keep::samples`]).
    pub(super) kept: Vec<KeptPart>,
    /// Per pCPU (ascending), its blocks that hold samples, in stream order.
    pub(super) blocks: Vec<(u16, Vec<BlockSpan>)>,
    /// The TSCs of the first and last sample of the capture (`--time` aside); `None` without.
    pub(super) seen: Option<(u64, u64)>,
}

/// What the first pass keeps besides the stacks ([`Classified::decode`]).
#[derive(Debug, Clone, Copy)]
pub struct Keep {
    /// The samples' owners as segments per pCPU, for the report's time axis (the exports,
    /// which have no tables, read none).
    pub segments: bool,
    /// Each sample's TSC and stack ([`crate::model::profile::LoadOptions::keep_samples`]).
    pub samples: bool,
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
            || Part::new(window, keep.segments, keep.samples),
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
}

/// Keys of another part added to the first part's table at a time (see [`Classified::merge`]).
const MERGE_BATCH: usize = 64;

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
                wide: k.wide,
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
                    wide: k.wide,
                    remap: key_ids,
                });
            }
        }
        (base.counts, kept)
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

/// [`PartTimes`] of every part joined.
pub(super) struct Times {
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
                    kept: b.kept.map(|k| KeptAt { part: number, ..k }),
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
    /// The parts' keys made one table, their segments joined per pCPU in stream order: the two
    /// at once (they share nothing).
    pub(super) fn merge(parts: Vec<Part>) -> Classified {
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
                chains: counts.index.chains.list,
                len,
                span: if len == 0 { (0, 0) } else { (first, last) },
            },
            events,
            cost,
            segments,
            kept,
            blocks,
            seen: (seen.0 <= seen.1).then_some(seen),
        }
    }
}
