//! `decode_parallel` tells the same story as `decode`: the same records (in order, per pCPU) and
//! the same losses, whatever the number of parts, on clean and damaged captures.

use hvprof_samplelog::synth::{self, CaptureOptions, SynthConfig};
use hvprof_samplelog::{BlockReader, Record, decode, decode_parallel};
use proptest::prelude::*;

fn capture(seed: u64) -> Vec<u8> {
    let cfg = SynthConfig {
        seed,
        pcpus: 3,
        samples_per_pcpu: 3000,
        ..SynthConfig::default()
    };
    synth::capture(&cfg, &CaptureOptions::default()).bytes
}

fn compare(bytes: &[u8], parts: usize) -> Result<(), TestCaseError> {
    let whole = decode(bytes);
    let (meta, accs) = decode_parallel(
        bytes,
        parts,
        Vec::new,
        |acc: &mut Vec<(u16, Record)>, at, records, frames| {
            // Each block reads back the same from its offset.
            let mut reader = BlockReader::new();
            let again = reader
                .block_at(bytes, at.offset)
                .map(|(h, r, f)| (h, r.to_vec(), f.to_vec()));
            assert_eq!(again, Some((at.header, records.to_vec(), frames.to_vec())));
            acc.extend(records.iter().map(|r| (at.header.pcpu, *r)));
        },
    );
    prop_assert_eq!(meta.blocks_lost(), whole.blocks_lost());
    prop_assert_eq!(meta.samples_lost(), whole.samples_lost());
    prop_assert_eq!(meta.ring_drops(), whole.ring_drops());
    prop_assert_eq!(meta.end_seen(), whole.end_seen());
    prop_assert_eq!(&meta.header, &whole.header);
    let mut got: Vec<(u16, Record)> = accs.into_iter().flatten().collect();
    // Records arrive per part in capture order; compare per pCPU in block order.
    got.sort_by_key(|(p, _)| *p);
    for (pcpu, log) in &whole.pcpus {
        let mine: Vec<Record> = got
            .iter()
            .filter(|(p, _)| p == pcpu)
            .map(|(_, r)| *r)
            .collect();
        prop_assert_eq!(&mine, &log.records, "pcpu {}", pcpu);
    }
    Ok(())
}

#[test]
fn clean_capture_any_parts() {
    let bytes = capture(7);
    for parts in [1, 2, 3, 8] {
        compare(&bytes, parts).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn damaged_capture(seed in 0u64..1000, flips in prop::collection::vec((any::<prop::sample::Index>(), 1u8..), 1..8), parts in 1usize..5) {
        let mut bytes = capture(seed);
        for (i, x) in flips {
            let at = i.index(bytes.len());
            // Keep delimiters: damage inside frames (a lost 0x00 may be healed differently
            // depending on where the parts split).
            if bytes[at] != 0 && bytes[at] ^ x != 0 {
                bytes[at] ^= x;
            }
        }
        compare(&bytes, parts)?;
    }
}
