//! What a pCPU's ring holds, and how the exporter makes blocks of it. A sample's call-chain
//! frames travel in the ring right behind its record, a few to a slot, pushed with it in one
//! all-or-nothing push (`Ring::push_with`); the exporter takes a record and its frame slots
//! together, so a block's records and its frame list (what `hvprof_samplelog`'s encoder takes)
//! always agree. Pure, so the host tests it.

use hvprof_samplelog::Record;

/// A record as the ring holds it: the wire format's own record (`hvprof_samplelog::Record`, what
/// the encoder takes), and the ring's drop count when it was pushed (records lost before it on
/// this pCPU: a block never spans a change of it, so the decoder places each loss).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamped {
    pub record: Record,
    pub drops: u64,
}

/// Frames one ring slot holds.
pub const SLOT_FRAMES: usize = 7;

/// A slot of the ring: a record, or up to `SLOT_FRAMES` frames of the call chains of the sample
/// just before it (its host chain's frames then its guest chain's, as many slots as they need:
/// the sample's chain depths say how many).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    Record(Stamped),
    Frames([u64; SLOT_FRAMES]),
}

/// Slots a record with `frames` chain frames takes.
pub const fn slots_for(frames: usize) -> usize {
    1 + frames.div_ceil(SLOT_FRAMES)
}

/// Slot `i` of a record and its `frames` (`i < slots_for(frames.len())`): the record, then the
/// frames `SLOT_FRAMES` at a time (the last slot's unused places zero).
#[inline(always)]
pub fn slot(stamped: Stamped, frames: &[u64], i: usize) -> Slot {
    let Some(c) = i.checked_sub(1) else {
        return Slot::Record(stamped);
    };
    let chunk = frames.get(c * SLOT_FRAMES..).unwrap_or(&[]);
    Slot::Frames(match chunk.first_chunk::<SLOT_FRAMES>() {
        Some(whole) => *whole,
        None => {
            let mut f = [0; SLOT_FRAMES];
            for (place, v) in f.iter_mut().zip(chunk) {
                *place = *v;
            }
            f
        }
    })
}

/// Frame slots that follow a record slot: its chains' frames, `SLOT_FRAMES` a slot.
#[inline(always)]
pub fn frame_slots(slot: &Slot) -> usize {
    match slot {
        Slot::Record(s) => s.record.chain_frames().div_ceil(SLOT_FRAMES),
        Slot::Frames(_) => 0,
    }
}

/// A block `fill_block` made: its records and chain frames (the starts of the caller's buffers),
/// and the drop count they share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub records: usize,
    pub frames: usize,
    pub drops: u64,
}

/// Makes the next block from the slots waiting (`slot(i)`: the `i`-th, `None` past the last): up
/// to `records.len()` records into `records` and their chain frames into `frames`. A block never
/// spans a change of the drop count, so that its `ring_drops` says how many records were lost
/// just before it. Returns the slots it used (to free) and the block. It always uses a slot when
/// there is one: frames without their record (which a ring never holds) are skipped, and so is a
/// first record whose frames are not all there, so an exporter never stalls.
pub fn fill_block(
    slot: impl Fn(usize) -> Option<Slot>,
    records: &mut [Record],
    frames: &mut [u64],
) -> (usize, Block) {
    let (mut i, mut n, mut f, mut drops) = (0, 0, 0, 0);
    while n < records.len() {
        let Some(s) = slot(i) else { break };
        let Slot::Record(stamped) = s else {
            i += 1;
            continue;
        };
        if n > 0 && stamped.drops != drops {
            break;
        }
        let want = stamped.record.chain_frames();
        let k = want.div_ceil(SLOT_FRAMES);
        if f + want > frames.len() {
            break;
        }
        let mut got = 0;
        for j in 1..=k {
            let Some(Slot::Frames(chunk)) = slot(i + j) else {
                break;
            };
            let m = (want - got).min(SLOT_FRAMES);
            frames[f + got..f + got + m].copy_from_slice(&chunk[..m]);
            got += m;
        }
        if got < want {
            if n == 0 {
                i += 1;
                continue;
            }
            break;
        }
        drops = stamped.drops;
        records[n] = stamped.record;
        n += 1;
        f += want;
        i += 1 + k;
    }
    (
        i,
        Block {
            records: n,
            frames: f,
            drops,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvprof_samplelog::{Chain, ChainEnd, Event, Sample, chain_frames};
    use proptest::prelude::*;

    fn sample(tsc: u64, host: usize, guest: usize) -> Record {
        Record::Sample(Sample {
            tsc,
            host_chain: Chain::new(host, ChainEnd::Complete),
            guest_chain: if guest == 0 {
                Chain::NOT_WALKED
            } else {
                Chain::new(guest, ChainEnd::DepthLimit)
            },
            ..Sample::default()
        })
    }

    /// The slots of records with their frames and drop counts, as the sample path pushes them.
    fn slots(items: &[(Record, Vec<u64>, u64)]) -> Vec<Slot> {
        let mut v = Vec::new();
        for (r, f, drops) in items {
            let st = Stamped {
                record: *r,
                drops: *drops,
            };
            v.extend((0..slots_for(f.len())).map(|i| slot(st, f, i)));
        }
        v
    }

    proptest! {
        /// Whatever the records, chains and drop counts, draining the slots block by block gives
        /// back every record with its frames, in order, and no block spans a drop-count change.
        #[test]
        fn blocks_give_back_records_and_frames(
            shapes in prop::collection::vec((0usize..=32, 0usize..=32, any::<bool>(), 0u64..3), 0..60),
            block in 1usize..20,
        ) {
            let mut items = Vec::new();
            let mut drops = 0;
            let mut next = 1u64;
            for (t, (h, g, event, more)) in shapes.into_iter().enumerate() {
                drops += more;
                let (r, n) = if event {
                    (Record::Event(Event { tsc: t as u64, ..Event::default() }), 0)
                } else {
                    (sample(t as u64, h, g), h + g)
                };
                let f: Vec<u64> = (0..n as u64).map(|k| next + k).collect();
                next += n as u64;
                items.push((r, f, drops));
            }
            let all = slots(&items);
            let (mut records, mut frames) = (vec![Record::Event(Event::default()); block], vec![0; 64 * block]);
            let mut at = 0;
            let (mut got_r, mut got_f) = (Vec::new(), Vec::new());
            while at < all.len() {
                let (used, b) = fill_block(|i| all.get(at + i).copied(), &mut records, &mut frames);
                prop_assert!(used > 0);
                prop_assert!(b.records <= block);
                // The block's records share one drop count.
                let firsts: Vec<u64> = items
                    .iter()
                    .skip(got_r.len())
                    .take(b.records)
                    .map(|(_, _, d)| *d)
                    .collect();
                prop_assert!(firsts.iter().all(|d| *d == b.drops));
                prop_assert_eq!(chain_frames(&records[..b.records]), b.frames);
                got_r.extend_from_slice(&records[..b.records]);
                got_f.extend_from_slice(&frames[..b.frames]);
                at += used;
            }
            let want_r: Vec<Record> = items.iter().map(|(r, _, _)| *r).collect();
            let want_f: Vec<u64> = items.iter().flat_map(|(_, f, _)| f.iter().copied()).collect();
            prop_assert_eq!(got_r, want_r);
            prop_assert_eq!(got_f, want_f);
        }
    }

    #[test]
    fn a_record_without_its_frames_is_skipped_not_stalled_on() {
        // A sample that says it has 10 frames, followed by only one frame slot, then a record.
        let st = Stamped {
            record: sample(1, 10, 0),
            drops: 0,
        };
        let good = Stamped {
            record: sample(2, 0, 0),
            drops: 0,
        };
        let v = [
            Slot::Record(st),
            Slot::Frames([1; SLOT_FRAMES]),
            Slot::Record(good),
        ];
        let (mut records, mut frames) = (vec![Record::Event(Event::default()); 4], vec![0; 64]);
        // The broken record and the stray frame slot are skipped, the good record taken.
        let (used, b) = fill_block(|i| v.get(i).copied(), &mut records, &mut frames);
        assert_eq!((used, b.records, b.frames), (3, 1, 0));
        assert_eq!(records[0], good.record);
        // A broken record after a good one ends the block before it.
        let w = [
            Slot::Record(good),
            Slot::Record(st),
            Slot::Frames([1; SLOT_FRAMES]),
        ];
        let (used, b) = fill_block(|i| w.get(i).copied(), &mut records, &mut frames);
        assert_eq!((used, b.records), (1, 1));
    }

    #[test]
    fn slots_hold_frames_in_order() {
        let f: Vec<u64> = (1..=9).collect();
        let st = Stamped {
            record: sample(0, 4, 5),
            drops: 0,
        };
        assert_eq!(slots_for(9), 3);
        assert_eq!(slot(st, &f, 1), Slot::Frames([1, 2, 3, 4, 5, 6, 7]));
        assert_eq!(slot(st, &f, 2), Slot::Frames([8, 9, 0, 0, 0, 0, 0]));
        assert_eq!(frame_slots(&slot(st, &f, 0)), 2);
    }
}
