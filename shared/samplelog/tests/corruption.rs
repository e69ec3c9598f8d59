//! Damage: the decoder never panics, recovers every intact frame, and counts what was lost
//! exactly; console text is text, not damage.

use std::collections::{BTreeMap, BTreeSet};

use hvprof_samplelog::synth::{self, Capture, CaptureOptions, FrameKind, SynthConfig};
use hvprof_samplelog::{Collector, DamageKind, Decoded, Item, Record, StreamDecoder, decode};
use proptest::prelude::*;

fn small_capture(seed: u64, console_every: usize) -> Capture {
    synth::capture(
        &SynthConfig {
            seed,
            pcpus: 3,
            samples_per_pcpu: 700,
            ..SynthConfig::default()
        },
        &CaptureOptions {
            block_records: 48,
            console_every,
            ..CaptureOptions::default()
        },
    )
}

/// Decodes and also lists the blocks recovered, as (pcpu, seq) → records.
fn decode_with_blocks(bytes: &[u8]) -> (Decoded, BTreeMap<(u16, u64), Vec<Record>>) {
    let mut dec = StreamDecoder::new();
    let mut col = Collector::new();
    let mut blocks = BTreeMap::new();
    let mut sink = |item: Item<'_>| {
        if let Item::Block {
            header, records, ..
        } = item
        {
            blocks
                .entry((header.pcpu, header.seq))
                .or_insert_with(|| records.to_vec());
        }
        col.push(item);
    };
    dec.feed(bytes, &mut sink);
    dec.finish(&mut sink);
    (col.finish(dec.position()), blocks)
}

/// (pcpu, seq) → (frame index, samples, events) for every block of the capture.
fn blocks_of(cap: &Capture) -> BTreeMap<(u16, u64), (usize, u64, u64)> {
    cap.frames
        .iter()
        .enumerate()
        .filter_map(|(i, f)| match &f.kind {
            FrameKind::Block {
                header,
                samples,
                events,
            } => Some(((header.pcpu, header.seq), (i, *samples, *events))),
            _ => None,
        })
        .collect()
}

/// Checks the decoder's loss accounting against the ground truth, given which blocks it
/// recovered: every recovered block is bit-exact, records are the recovered blocks in order, and
/// blocks/samples/events lost are exactly those of the missing blocks the decoder can know about
/// (all of them with the end frame; otherwise those before the last recovered block).
fn check_accounting(cap: &Capture, d: &Decoded, got: &BTreeMap<(u16, u64), Vec<Record>>) {
    let all = blocks_of(cap);
    for (key, recs) in got {
        let (i, _, _) = all[key];
        assert_eq!(recs, &cap.frames[i].records, "block {key:?} altered");
    }
    let end_seen = d.end_seen();
    if end_seen {
        assert_eq!(d.end.as_ref(), Some(&cap.totals));
    }
    for t in &cap.totals {
        let pcpu = t.pcpu;
        let last_got = got.keys().filter(|k| k.0 == pcpu).map(|k| k.1).max();
        let (mut blocks, mut samples, mut events) = (0, 0, 0);
        let mut records = Vec::new();
        for (&(p, seq), &(i, s, e)) in all.range((pcpu, 0)..=(pcpu, u64::MAX)) {
            debug_assert_eq!(p, pcpu);
            if got.contains_key(&(p, seq)) {
                records.extend_from_slice(&cap.frames[i].records);
            } else if end_seen || last_got.is_some_and(|l| seq < l) {
                blocks += 1;
                samples += s;
                events += e;
            }
        }
        match d.pcpus.get(&pcpu) {
            Some(log) => {
                assert_eq!(log.records, records, "pcpu {pcpu} records");
                assert_eq!(log.blocks_lost, blocks, "pcpu {pcpu} blocks lost");
                assert_eq!(log.samples_lost, samples, "pcpu {pcpu} samples lost");
                assert_eq!(log.events_lost, events, "pcpu {pcpu} events lost");
                assert_eq!(log.inconsistent_blocks, 0);
                assert_eq!(
                    log.gaps.iter().map(|g| g.samples).sum::<u64>(),
                    log.samples_lost
                );
                if end_seen {
                    assert_eq!(log.ring_drops, t.ring_drops);
                    assert_eq!(log.is_complete(), blocks == 0);
                }
            }
            None => assert!(records.is_empty() && !end_seen),
        }
    }
}

#[test]
fn console_text_is_returned_and_is_not_damage() {
    let cap = small_capture(7, 3);
    assert!(cap.text.len() > 10);
    let d = decode(&cap.bytes);
    assert!(d.damaged.is_empty(), "{:?}", d.damaged);
    assert!(d.is_complete());
    let want: Vec<(u64, String)> = cap
        .text
        .iter()
        .map(|r| {
            (
                r.start as u64,
                String::from_utf8(cap.bytes[r.clone()].to_vec()).unwrap(),
            )
        })
        .collect();
    let got: Vec<(u64, String)> = d.text.iter().map(|t| (t.offset, t.text.clone())).collect();
    assert_eq!(got, want);
}

#[test]
fn text_around_frames_and_without_any_frame() {
    let cap = small_capture(8, 0);
    let mut bytes = b"GRUB loading.\nBooting hvprof\n".to_vec();
    bytes.extend_from_slice(&cap.bytes);
    bytes.extend_from_slice(b"hvprof: done, HVP log complete\nreboot: Restarting system");
    let d = decode(&bytes);
    assert!(d.is_complete());
    assert!(d.damaged.is_empty());
    assert_eq!(
        d.text_joined(),
        "GRUB loading.\nBooting hvprof\nhvprof: done, HVP log complete\nreboot: Restarting system"
    );
    let d = decode("plain console, HVP\u{1} ünïcödé\n".as_bytes());
    assert_eq!(d.frames, 0);
    assert!(d.damaged.is_empty());
    assert_eq!(d.text_joined(), "plain console, HVP\u{1} ünïcödé\n");
    assert!(!d.end_seen());
}

/// Flips one byte in the middle of each chosen block frame (never producing 0x00).
fn flip_frames(cap: &Capture, frames: &[usize]) -> Vec<u8> {
    let mut bytes = cap.bytes.clone();
    for &i in frames {
        let r = &cap.frames[i].range;
        let at = r.start + r.len() / 2;
        bytes[at] = if bytes[at] == 0xA5 { 0x5A } else { 0xA5 };
    }
    bytes
}

#[test]
fn damaged_blocks_are_counted_exactly() {
    let cap = small_capture(3, 5);
    let all = blocks_of(&cap);
    // Every 7th block, the first block of pCPU 1 and the last block of pCPU 2.
    let mut victims: BTreeSet<usize> = all.values().map(|v| v.0).step_by(7).collect();
    victims.insert(all[&(1, 0)].0);
    let last2 = all.keys().filter(|k| k.0 == 2).max().unwrap();
    victims.insert(all[last2].0);
    let victims: Vec<usize> = victims.into_iter().collect();
    let bytes = flip_frames(&cap, &victims);
    let (d, got) = decode_with_blocks(&bytes);
    assert!(d.end_seen());
    check_accounting(&cap, &d, &got);
    assert_eq!(got.len(), all.len() - victims.len());
    // Each damaged frame is reported once, at its offset, as a CRC failure; text is untouched.
    let want: Vec<(u64, DamageKind)> = victims
        .iter()
        .map(|&i| (cap.frames[i].range.start as u64 + 1, DamageKind::Crc))
        .collect();
    let damage: Vec<(u64, DamageKind)> = d.damaged.iter().map(|x| (x.offset, x.kind)).collect();
    assert_eq!(damage, want);
    assert_eq!(d.text.len(), cap.text.len());
    // Concretely, for pCPU 1 the loss starts at its first block.
    let log1 = &d.pcpus[&1];
    assert_eq!(log1.gaps[0].at_record, 0);
    assert_eq!(log1.gaps[0].after_tsc, None);
    assert!(!log1.is_complete());
}

#[test]
fn a_zero_injected_into_a_frame_loses_only_that_frame() {
    let cap = small_capture(4, 0);
    let all = blocks_of(&cap);
    let (i, _, _) = all[&(0, 3)];
    let mut bytes = cap.bytes.clone();
    let r = cap.frames[i].range.clone();
    bytes[r.start + r.len() / 3] = 0;
    let (d, got) = decode_with_blocks(&bytes);
    assert!(!got.contains_key(&(0, 3)));
    assert_eq!(got.len(), all.len() - 1);
    check_accounting(&cap, &d, &got);
    assert_eq!(d.pcpus[&0].blocks_lost, 1);
    assert!(!d.damaged.is_empty());
    assert!(
        d.damaged
            .iter()
            .all(|x| x.offset >= r.start as u64 && x.offset < r.end as u64)
    );
}

#[test]
fn truncated_capture_is_reported_as_truncated() {
    let cap = small_capture(5, 0);
    let all = blocks_of(&cap);
    let (i, _, _) = all[&(1, 10)];
    let r = cap.frames[i].range.clone();
    let cut = r.start + r.len() / 2;
    let (d, got) = decode_with_blocks(&cap.bytes[..cut]);
    assert!(!d.end_seen());
    assert!(!d.is_complete());
    assert_eq!(d.damaged.len(), 1);
    assert_eq!(d.damaged[0].kind, DamageKind::Truncated);
    assert_eq!(d.damaged[0].offset, r.start as u64 + 1);
    // Everything before the cut is there; nothing is counted lost (losses after the last block
    // received are unknown without the end frame).
    assert_eq!(
        got.len(),
        cap.frames[..i]
            .iter()
            .filter(|f| matches!(f.kind, FrameKind::Block { .. }))
            .count()
    );
    assert_eq!(d.blocks_lost(), 0);
    check_accounting(&cap, &d, &got);
    // Cut right after a frame's last byte but before its closing 0x00: still recovered.
    let (d, got) = decode_with_blocks(&cap.bytes[..r.end - 1]);
    assert!(got.contains_key(&(1, 10)));
    assert!(d.damaged.is_empty());
}

#[test]
fn frames_that_lost_a_delimiter_are_recovered() {
    let cap = small_capture(6, 2);
    // A block followed by console text: drop its closing 0x00 (frame + text merge), and a block
    // preceded by text: drop its opening 0x00 (text + frame merge).
    let text_after: Vec<usize> = cap
        .frames
        .iter()
        .enumerate()
        .filter(|(_, f)| {
            matches!(f.kind, FrameKind::Block { .. })
                && cap.text.iter().any(|t| t.start == f.range.end)
        })
        .map(|(i, _)| i)
        .collect();
    let a = cap.frames[text_after[1]].range.clone();
    let b = cap.frames[text_after[4] + 1].range.clone();
    assert!(cap.text.iter().any(|t| t.end == b.start));
    let mut bytes = cap.bytes.clone();
    bytes.remove(b.start);
    bytes.remove(a.end - 1);
    let (d, got) = decode_with_blocks(&bytes);
    assert_eq!(got.len(), blocks_of(&cap).len());
    assert!(d.is_complete());
    check_accounting(&cap, &d, &got);
    assert!(d.damaged.is_empty(), "{:?}", d.damaged);
    // The text is all still there.
    let want: String = cap
        .text
        .iter()
        .map(|r| std::str::from_utf8(&cap.bytes[r.clone()]).unwrap())
        .collect();
    assert_eq!(d.text_joined(), want);
}

#[test]
fn damaged_header_and_end_frames() {
    let cap = small_capture(9, 0);
    let last = cap.frames.len() - 1;
    let bytes = flip_frames(&cap, &[0, last]);
    let (d, got) = decode_with_blocks(&bytes);
    assert!(d.header.is_none());
    assert!(!d.end_seen());
    assert_eq!(d.damaged.len(), 2);
    assert_eq!(got.len(), blocks_of(&cap).len());
    check_accounting(&cap, &d, &got);
}

#[derive(Clone, Debug)]
enum Op {
    Flip { at: usize, xor: u8 },
    Zero { at: usize },
    Drop { at: usize, len: usize },
    Insert { at: usize, byte: u8 },
    Truncate { at: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (any::<usize>(), 1u8..=255).prop_map(|(at, xor)| Op::Flip { at, xor }),
        1 => any::<usize>().prop_map(|at| Op::Zero { at }),
        2 => (any::<usize>(), 1usize..600).prop_map(|(at, len)| Op::Drop { at, len }),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Op::Insert { at, byte }),
        1 => any::<usize>().prop_map(|at| Op::Truncate { at }),
    ]
}

/// Applies `ops`, tracking which original bytes were touched (modified, dropped, or next to an
/// insertion).
fn damage(bytes: &[u8], ops: &[Op]) -> (Vec<u8>, Vec<bool>) {
    const INSERTED: usize = usize::MAX;
    let mut data: Vec<(usize, u8)> = bytes.iter().copied().enumerate().collect();
    let mut touched = vec![false; bytes.len()];
    let mark = |touched: &mut Vec<bool>, i: usize| {
        if i != INSERTED {
            touched[i] = true;
        }
    };
    for op in ops {
        if data.is_empty() {
            break;
        }
        let n = data.len();
        match *op {
            Op::Flip { at, xor } => {
                let e = &mut data[at % n];
                e.1 ^= xor;
                mark(&mut touched, e.0);
            }
            Op::Zero { at } => {
                let e = &mut data[at % n];
                e.1 = 0;
                mark(&mut touched, e.0);
            }
            Op::Drop { at, len } => {
                let at = at % n;
                let end = (at + len).min(n);
                for e in data.drain(at..end) {
                    mark(&mut touched, e.0);
                }
            }
            Op::Insert { at, byte } => {
                let at = at % n;
                mark(&mut touched, data[at].0);
                if at > 0 {
                    mark(&mut touched, data[at - 1].0);
                }
                data.insert(at, (INSERTED, byte));
            }
            Op::Truncate { at } => {
                for e in data.drain(at % n..) {
                    mark(&mut touched, e.0);
                }
            }
        }
    }
    let out = data.iter().map(|e| e.1).collect();
    // Insertions are tracked via their neighbours.
    (out, touched)
}

/// `PROPTEST_CASES` overrides the default number of cases (for long local runs).
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(160), ..ProptestConfig::default() })]

    #[test]
    fn damaged_captures_recover_every_intact_frame(
        seed in 0u64..50,
        ops in prop::collection::vec(op(), 1..12),
    ) {
        let cap = small_capture(seed, 3);
        let (bytes, touched) = damage(&cap.bytes, &ops);
        let (d, got) = decode_with_blocks(&bytes);
        // Every frame none of whose bytes (delimiters included) was touched is recovered.
        for (i, f) in cap.frames.iter().enumerate() {
            if touched[f.range.clone()].iter().any(|&t| t) {
                continue;
            }
            match &f.kind {
                FrameKind::Block { header, .. } => prop_assert!(got.contains_key(&(header.pcpu, header.seq)), "intact frame {i} lost"),
                FrameKind::Header => prop_assert!(d.header.is_some()),
                FrameKind::End => prop_assert!(d.end_seen()),
            }
        }
        check_accounting(&cap, &d, &got);
        // Intact text lines come back verbatim.
        let joined = d.text_joined();
        for t in &cap.text {
            if !touched[t.clone()].iter().any(|&x| x) && !touched[t.start - 1] && !touched.get(t.end).copied().unwrap_or(false) {
                let line = std::str::from_utf8(&cap.bytes[t.clone()]).unwrap();
                prop_assert!(joined.contains(line));
            }
        }
    }

    #[test]
    fn decoder_never_panics_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..4000)) {
        let d = decode(&bytes);
        prop_assert_eq!(d.bytes, bytes.len() as u64);
    }

    #[test]
    fn decoder_never_panics_on_frame_like_noise(
        parts in prop::collection::vec(prop_oneof![
            Just(vec![0u8]),
            (5u8..=255, 1u8..=8).prop_map(|(c, t)| vec![c, b'H', b'V', b'P', t]),
            prop::collection::vec(any::<u8>(), 0..64),
            prop::collection::vec(prop_oneof![Just(0u8), Just(0xffu8), Just(1u8), any::<u8>()], 0..300),
        ], 0..40)
    ) {
        let bytes = parts.concat();
        let _ = decode(&bytes);
    }

    #[test]
    fn decoder_never_panics_on_corrupted_frames(seed in 0u64..20, ops in prop::collection::vec(op(), 1..40)) {
        let cap = small_capture(seed, 0);
        let (bytes, _) = damage(&cap.bytes, &ops);
        let _ = decode(&bytes);
    }
}

#[test]
fn long_text_without_zero_bytes_is_bounded_and_kept() {
    let line = "guest console line without any frame at all\n";
    let text = line.repeat(120_000);
    let mut dec = StreamDecoder::new();
    let mut col = Collector::new();
    for chunk in text.as_bytes().chunks(100_000) {
        dec.feed(chunk, &mut |item| col.push(item));
    }
    dec.finish(&mut |item| col.push(item));
    let d = col.finish(dec.position());
    assert!(d.damaged.is_empty());
    assert_eq!(d.text_joined().len(), text.len());
}
