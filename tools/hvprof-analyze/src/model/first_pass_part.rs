//! What one thread of the first pass does ([`Part::add`]): it classifies every sample of the
//! blocks it decodes ([`crate::model::classify`]), counts its distinct keys in its own stack
//! table (one random access per sample, the block's slots prefetched before any is counted),
//! keeps its samples' owners as segments per pCPU for the report's time axis, notes where each
//! block is for the replay and, for the Firefox export, each sample's TSC and key. It keeps no
//! sample otherwise.

use rustc_hash::FxHashMap as HashMap;

use hvprof_samplelog::{BlockAt, Event, Record, Sample};

use crate::model::chains::{ChainCursor, ChainIds, has_chains};
use crate::model::classify::{Key, classify};
use crate::model::cost::CostSum;
use crate::model::samples::{What, owner};
use crate::model::stack_table::{self, StackTable};
use crate::model::timeline::{Owner, Segment, Segments};
use crate::model::window::Window;
use crate::naming::namer::{Processes, TaskMemo};

/// Finds a key's stack in two steps, so that the per-sample table stays small (it is the one
/// random access per sample): its context (all but the address, with its chains' number;
/// consecutive samples mostly share it), then (address, context).
#[derive(Debug, Default)]
pub(super) struct StackIndex {
    pub(super) contexts: HashMap<(Key, u32), u32>,
    /// (address, context) → (stack, its samples): one random access per sample, which the
    /// loops over a block's samples prefetch for the whole block before they look up any.
    pub(super) ids: StackTable,
    /// The distinct call chains (samples with chains look theirs up first).
    pub(super) chains: ChainIds,
}

/// Where a block's samples are, for the second pass: its pCPU, its frame's offset, its
/// samples' first and last TSC, whether they are in TSC order.
#[derive(Debug, Clone, Copy)]
pub(super) struct BlockSpan {
    pub(super) pcpu: u16,
    pub(super) offset: u64,
    pub(super) first: u64,
    pub(super) last: u64,
    pub(super) samples: u32,
    pub(super) sorted: bool,
    /// Where the first pass kept its samples; `None` when not kept.
    pub(super) kept: Option<KeptAt>,
}

/// Where the first pass kept a block's samples ([`Kept`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct KeptAt {
    /// The decoding thread's number.
    pub(super) part: u32,
    /// The first sample's place in its list: [`Kept::samples`], or [`Kept::wide`] for a
    /// block whose samples span more than 2^32 ticks.
    pub(super) at: usize,
    pub(super) wide: bool,
}

/// Each sample of a decoding thread as the first pass classified it, for the views that read
/// them all again in time order ([`crate::model::profile::LoadOptions::keep_samples`]): its
/// TSC as an offset from its block's first and its key's number, 8 bytes a sample, which
/// [`crate::model::replay::Replay`] copies: no sample is decoded or classified twice. A block
/// whose samples span more than 2^32 ticks (64 records over 4.3 s at 1 GHz) keeps each TSC
/// whole, 16 bytes a sample.
#[derive(Debug, Default)]
pub(super) struct Kept {
    pub(super) samples: Vec<(u32, u32)>,
    /// The samples of blocks that span more than 2^32 ticks: TSC and key.
    pub(super) wide: Vec<(u64, u32)>,
    /// The block being classified: each sample's TSC and its run in [`Part::pending`].
    block: Vec<(u64, u32)>,
    /// The key of each run of the block.
    ids: Vec<u32>,
}

/// The samples a decoding thread kept ([`Kept::samples`], [`Kept::wide`]) and its keys'
/// numbers in the capture's table, by the thread's number (none for the first thread's,
/// whose table it is).
#[derive(Debug, Default)]
pub(super) struct KeptPart {
    pub(super) samples: Vec<(u32, u32)>,
    pub(super) wide: Vec<(u64, u32)>,
    pub(super) remap: Vec<u32>,
}

/// Where a segment's first sample is: in the block whose frame is at `offset`, after `skip`
/// samples of it; or (a pCPU out of TSC order) at `skip` in its sorted list.
#[derive(Debug, Clone, Copy)]
pub(super) struct Located {
    pub(super) offset: u64,
    pub(super) skip: u32,
}

/// The owners, and per pCPU its samples' owners as segments in stream order with where each
/// starts: the first pass's time axis.
pub(super) type StreamSegments = (OwnerIds, Vec<(u16, Vec<Segment>, Vec<Located>)>);

/// Owners numbered in the order they are first seen.
#[derive(Default)]
pub(super) struct OwnerIds {
    ids: HashMap<Owner, u32>,
    pub(super) list: Vec<Owner>,
}

impl OwnerIds {
    pub(super) fn id(&mut self, owner: Owner) -> u32 {
        let list = &mut self.list;
        *self.ids.entry(owner).or_insert_with(|| {
            list.push(owner);
            (list.len() - 1) as u32
        })
    }
}

/// Per pCPU, its samples' owners as segments in stream order, with where each starts.
#[derive(Default)]
pub(super) struct PartSegments {
    pub(super) owners: OwnerIds,
    pub(super) lists: HashMap<u16, (Vec<Segment>, Vec<Located>)>,
}

/// The distinct keys a decoding thread found, with their samples (in `index.ids`). A key is
/// its address and its context (the key without its address, with its chains' number): the
/// table holds both, so the keys are not listed beside it (a list that grows with the keys,
/// in fresh memory, while the table does too).
#[derive(Default)]
pub(super) struct KeyCounts {
    pub(super) index: StackIndex,
    /// The contexts by number (`index.contexts` the other way).
    pub(super) contexts: Vec<(Key, u32)>,
    /// The keys so far (numbered in the order first added).
    len: u32,
}

impl KeyCounts {
    /// The index of a context (a key without its address).
    pub(super) fn context(&mut self, context: (Key, u32)) -> u32 {
        let next = self.contexts.len() as u32;
        let list = &mut self.contexts;
        *self.index.contexts.entry(context).or_insert_with(|| {
            list.push(context);
            next
        })
    }

    /// Adds `n` samples of the key at `addr` in context `ctx`; returns the key's index.
    #[cfg(test)]
    pub(super) fn add(&mut self, addr: u64, ctx: u32, n: u64) -> u32 {
        self.add_hashed(addr, ctx, stack_table::hash(addr, ctx), n)
    }

    /// Adds `n` samples of the key at `addr` in context `ctx`, whose hash is `hash`; returns
    /// the key's index.
    #[inline]
    pub(super) fn add_hashed(&mut self, addr: u64, ctx: u32, hash: u64, n: u64) -> u32 {
        let (id, new) = self.index.ids.add(hash, addr, ctx, n, self.len);
        if new {
            self.len += 1;
        }
        id
    }

    /// Each key (address, context) with its samples, by key index.
    pub(super) fn entries(&self) -> Vec<(u64, u32, u64)> {
        let mut out = vec![(0, 0, 0); self.len as usize];
        for (addr, ctx, id, n) in self.index.ids.iter() {
            out[id as usize] = (addr, ctx, n);
        }
        out
    }

    /// The key at `addr` in context `ctx`, and its chains' number.
    pub(super) fn key(&self, addr: u64, ctx: u32) -> (Key, u32) {
        let (k, chain) = self.contexts[ctx as usize];
        (Key { addr, ..k }, chain)
    }
}

/// What one decoding thread classified: its distinct keys with their counts, the blocks it
/// read, its samples' owners as segments, the scheduling events, the cost.
pub(super) struct Part {
    /// Whether the samples' owners are kept as segments (the report's time axis; the exports
    /// read none).
    keep_segments: bool,
    /// Its keys with their counts (and its kept samples).
    pub(super) keys: PartKeys,
    /// Its samples in time: segments, blocks, events, cost, span.
    pub(super) times: PartTimes,
    /// The block's samples classified, to be counted once their slots are prefetched.
    pending: Vec<Pending>,
    chain_scratch: ChainScratch,
    /// The task the last guest sample's vCPU ran, and until when.
    task_memo: TaskMemo,
    /// The stretch of host time whose samples count (`--time`).
    window: Window,
    /// Records decoded and not yet told to the progress bar.
    pub(super) unreported: u64,
}

impl Part {
    /// A decoding thread's part: the samples in `window` count; with `segments` their owners
    /// are kept as segments, with `samples` each sample's TSC and key.
    pub(super) fn new(window: Window, segments: bool, samples: bool) -> Part {
        Part {
            keep_segments: segments,
            keys: PartKeys {
                counts: KeyCounts::default(),
                kept: samples.then(Kept::default),
            },
            times: PartTimes::default(),
            pending: Vec::new(),
            chain_scratch: ChainScratch::default(),
            task_memo: TaskMemo::default(),
            window,
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
    /// A sample with chains: their number in `ids`, read from `cursor` (0: none). Out of
    /// line, so that the loop over a capture without chains stays as it was.
    #[inline(never)]
    fn walked(&mut self, ids: &mut ChainIds, s: &Sample, cursor: &mut ChainCursor) -> u32 {
        if !cursor.next(s, &mut self.packed) {
            return 0;
        }
        if self.last.1 != 0 && self.last.0 == self.packed {
            self.last.1
        } else {
            let id = ids.id(&self.packed);
            std::mem::swap(&mut self.last.0, &mut self.packed);
            self.last.1 = id;
            id
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

impl Part {
    /// Classifies and counts a block's samples: classified first, each one's slot in the
    /// stack table prefetched, then counted (so that the table's cache misses overlap).
    pub(super) fn add(
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
            let key = classify(pcpu, s, processes, &mut self.task_memo);
            let chain = if has_chains(s) {
                self.chain_scratch
                    .walked(&mut self.keys.counts.index.chains, s, &mut cursor)
            } else {
                0
            };
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
            // Its samples' TSCs as offsets from the first, or whole (the part numbers its
            // blocks when the parts are merged).
            let Kept {
                samples,
                wide,
                block,
                ids,
            } = k;
            if span.samples > 0 {
                let whole = span.last - span.first > u64::from(u32::MAX);
                let list = if whole { wide.len() } else { samples.len() };
                span.kept = Some(KeptAt {
                    part: 0,
                    at: list,
                    wide: whole,
                });
                let keyed = block.iter().map(|&(tsc, run)| (tsc, ids[run as usize]));
                if whole {
                    wide.extend(keyed);
                } else {
                    samples.extend(keyed.map(|(tsc, id)| ((tsc - span.first) as u32, id)));
                }
            }
            block.clear();
            ids.clear();
        }
        if span.samples > 0 {
            tally.len += span.samples as usize;
            tally.first = tally.first.min(span.first);
            tally.last = tally.last.max(span.last);
            self.times.blocks.push(span);
        }
    }
}

/// What [`crate::model::first_pass::Classified::merge`] makes one table of: a part's keys, and its kept samples.
#[derive(Default)]
pub(super) struct PartKeys {
    pub(super) counts: KeyCounts,
    /// Each sample's TSC and key, when kept ([`crate::model::profile::LoadOptions::keep_samples`]).
    pub(super) kept: Option<Kept>,
}

/// A part's samples (or the capture's) counted: their sample path's cost, how many fall in
/// the stretch (`--time`) and the first and last one's TSC, and the TSCs of the first and last
/// sample, those outside the stretch included.
#[derive(Clone, Copy)]
pub(super) struct Tally {
    pub(super) cost: CostSum,
    pub(super) len: usize,
    pub(super) first: u64,
    pub(super) last: u64,
    pub(super) seen: (u64, u64),
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

/// What [`crate::model::first_pass::Classified::merge`] joins in time: a part's segments, blocks and events, and its
/// samples counted.
#[derive(Default)]
pub(super) struct PartTimes {
    pub(super) segments: PartSegments,
    pub(super) blocks: Vec<BlockSpan>,
    pub(super) events: Vec<(u16, Event)>,
    pub(super) tally: Tally,
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
