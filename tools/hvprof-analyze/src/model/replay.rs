//! The samples read again, in TSC order (then pCPU), for the views that read them in time
//! ([`crate::model::profile::Profile::replay`]): each block's samples copied from the first
//! pass's copy of them (each sample's TSC and key: none is decoded or classified again), in
//! runs on every core, the pCPUs merged by TSC; a pCPU whose blocks are out of TSC order (a
//! damaged or forged capture) read and sorted once. Also the report's time axis
//! ([`TimeAxis`]): the first pass's segments in TSC order, and the samples of a segment read
//! again (their TSCs alone) where a scheduling event falls inside it.

use anyhow::{Result, bail};
use rustc_hash::FxHashMap as HashMap;

use hvprof_samplelog::{BlockReader, Record};

use crate::model::capture::Capture;
use crate::model::first_pass_part::{BlockSpan, KeptPart, Located, StreamSegments};
use crate::model::merge::merge_all;

use crate::model::samples::{Sampled, Samples};
use crate::model::timeline::Segments;
use crate::model::window::Window;

/// Samples per run [`crate::model::profile::Profile::replay`] hands its work (≈ 32 K: each run's samples and what
/// the work makes of them are in memory at once, a few runs per core; small enough that the
/// allocator reuses their memory rather than asking the kernel for fresh pages each time).
const RUN_SAMPLES: u64 = 1 << 15;

/// Runs each [`crate::model::profile::Profile::replay`] worker may have made and not yet handed to its consumer.
const RUNS_AHEAD: usize = 1;

/// What reads a capture's samples again, in TSC order: the capture, its blocks per pCPU, and
/// the samples the first pass kept.
#[derive(Default)]
pub(super) struct Replay {
    pub(super) bytes: Capture,
    pub(super) blocks: Vec<(u16, Vec<BlockSpan>)>,
    /// The samples the first pass kept, per decoding thread (see [`crate::model::first_pass::Classified::kept`]).
    pub(super) kept: Vec<KeptPart>,
    /// The samples the first pass counted (`--time`): the same are read again.
    pub(super) window: Window,
}

/// What a [`crate::model::profile::Profile::replay`] worker reuses from run to run.
#[derive(Default)]
struct RunScratch {
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

impl Replay {
    /// A block's samples, (TSC, stack), as the first pass kept them.
    fn block(&self, b: &BlockSpan, out: &mut Vec<(u64, u32)>) {
        let Some(at) = b.kept else {
            debug_assert!(false, "block at {} not kept", b.offset);
            return;
        };
        let KeptPart {
            samples,
            wide,
            remap,
        } = &self.kept[at.part as usize];
        let range = at.at..at.at + b.samples as usize;
        if at.wide {
            let stack = |id: u32| {
                if remap.is_empty() {
                    id
                } else {
                    remap[id as usize]
                }
            };
            out.extend(wide[range].iter().map(|&(tsc, id)| (tsc, stack(id))));
            return;
        }
        let tsc = |offset: u32| b.first + u64::from(offset);
        if remap.is_empty() {
            out.extend(samples[range].iter().map(|&(offset, id)| (tsc(offset), id)));
        } else {
            out.extend(
                samples[range]
                    .iter()
                    .map(|&(offset, id)| (tsc(offset), remap[id as usize])),
            );
        }
    }

    /// Each pCPU's samples in stream order, sorted by TSC, for pCPUs whose blocks are not.
    fn sorted_lists(&self) -> Vec<(u16, Vec<(u64, u32)>)> {
        self.blocks
            .iter()
            .filter(|(_, bs)| !in_order(bs))
            .map(|(c, bs)| {
                let mut l = Vec::new();
                for b in bs {
                    self.block(b, &mut l);
                }
                l.sort_by_key(|&(t, _)| t);
                (*c, l)
            })
            .collect()
    }

    /// The TSCs of the samples of `blocks` the first pass counted (`--time`), in stream
    /// order, given to `f` until it returns false.
    fn tscs(&self, blocks: &[BlockSpan], mut f: impl FnMut(u64) -> bool) {
        let mut reader = BlockReader::new();
        for b in blocks {
            let Some((_, records, _)) = reader.block_at(&self.bytes, b.offset) else {
                return;
            };
            for r in records {
                if let Record::Sample(s) = r
                    && self.window.contains(s.tsc)
                    && !f(s.tsc)
                {
                    return;
                }
            }
        }
    }
}

/// The common time axis: every pCPU's samples' owners as segments in TSC order, where each
/// segment starts, and the TSCs of pCPUs whose blocks are out of TSC order, sorted.
pub(super) struct TimeAxis {
    pub(super) segments: Segments,
    located: Vec<Vec<Located>>,
    sorted: HashMap<u16, Vec<u64>>,
}

impl Replay {
    /// The time axis from the segments the first pass made (in stream order): those of a pCPU
    /// whose blocks are out of TSC order (a damaged or forged capture) are made again from
    /// its samples' TSCs, read again, each with its owner from the segments, sorted.
    pub(super) fn time_axis(&self, (owners, lists): StreamSegments) -> TimeAxis {
        let mut sorted: HashMap<u16, Vec<u64>> = HashMap::default();
        let mut pcpus = Vec::with_capacity(lists.len());
        let mut located = Vec::with_capacity(lists.len());
        for (pcpu, segs, at) in lists {
            let blocks = self
                .blocks
                .binary_search_by_key(&pcpu, |(c, _)| *c)
                .map(|b| &self.blocks[b].1[..]);
            match blocks {
                Ok(bs) if !in_order(bs) => {
                    let mut owner = segs
                        .iter()
                        .flat_map(|s| std::iter::repeat_n(s.owner, s.count as usize));
                    let mut list: Vec<(u64, u32)> = Vec::new();
                    self.tscs(bs, |tsc| {
                        list.extend(owner.next().map(|o| (tsc, o)));
                        true
                    });
                    list.sort_by_key(|&(t, _)| t);
                    let (mut segs, mut at) = (Vec::new(), Vec::new());
                    for (i, &(tsc, o)) in list.iter().enumerate() {
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
                    sorted.insert(pcpu, list.into_iter().map(|(t, _)| t).collect());
                }
                _ => {
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
    pub(super) fn partial(
        &self,
        axis: &TimeAxis,
        pcpu: u16,
        i: usize,
        lo: u64,
        hi: Option<u64>,
    ) -> u64 {
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
                .filter(|&&t| inside(t))
                .count() as u64;
        }
        let Ok(b) = self.blocks.binary_search_by_key(&pcpu, |(c, _)| *c) else {
            return 0;
        };
        let blocks = &self.blocks[b].1;
        let Ok(first) = blocks.binary_search_by_key(&at.offset, |b| b.offset) else {
            return 0;
        };
        let (mut skip, mut seen, mut n) = (at.skip as usize, 0usize, 0u64);
        self.tscs(&blocks[first..], |tsc| {
            if skip > 0 {
                skip -= 1;
                return true;
            }
            if seen == want {
                return false;
            }
            seen += 1;
            n += u64::from(inside(tsc));
            true
        });
        n
    }
}

/// Whether a pCPU's blocks, in stream order, hold its samples in TSC order.
fn in_order(blocks: &[BlockSpan]) -> bool {
    blocks.iter().all(|b| b.sorted) && blocks.windows(2).all(|w| w[0].last <= w[1].first)
}

impl Replay {
    /// [`crate::model::profile::Profile::replay`] of `samples`' stacks.
    pub(super) fn replay<R: Send + Default>(
        &self,
        samples: &Samples,
        work: impl Fn(&[Sampled], &mut R) + Sync,
        consume: impl FnMut(&mut R) -> Result<()>,
    ) -> Result<()> {
        self.replay_runs(
            |scratch, sources, lo, hi, out| {
                work(self.run_samples(samples, scratch, sources, lo, hi), out);
            },
            consume,
        )
    }

    /// [`crate::model::profile::Profile::replay_stacks`].
    pub(super) fn replay_stacks<R: Send + Default>(
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

    /// The runs of [`crate::model::profile::Profile::replay`]: `work` reads the samples of `lo..hi` from the sources
    /// with a scratch of its own, into an `R`.
    fn replay_runs<R: Send + Default>(
        &self,
        work: impl Fn(&mut RunScratch, &[(u16, Source<'_>)], u64, Option<u64>, &mut R) + Sync,
        mut consume: impl FnMut(&mut R) -> Result<()>,
    ) -> Result<()> {
        if self
            .blocks
            .iter()
            .flat_map(|(_, bs)| bs)
            .any(|b| b.kept.is_none())
        {
            bail!(
                "the samples cannot be read again: the profile was loaded without them (LoadOptions::keep_samples)"
            );
        }
        let sorted = self.sorted_lists();
        let sources: Vec<(u16, Source<'_>)> = self
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
        samples: &Samples,
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
        let stacks = &samples.stacks;
        for (i, &(tsc, stack)) in merged.iter().enumerate() {
            if let Some(&(_, next)) = merged.get(i + AHEAD) {
                crate::model::stack_table::prefetch(&stacks[next as usize]);
            }
            out.push(samples.sampled(tsc, stack));
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
                        self.block(b, l);
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
}
