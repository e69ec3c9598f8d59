//! `decode_parallel` tells the same story as `decode`: the same records (in order, per pCPU) and
//! the same losses, whatever the number of parts, on clean and damaged captures.

use hvprof_samplelog::synth::{self, CaptureOptions, SynthConfig};
use hvprof_samplelog::{
    BlockReader, FRAME_TASK, FixedStr, MAGIC, MAX_TASK_FRAME_LEN, Record, Task, decode,
    decode_metadata_parallel, decode_parallel, encode_task,
};
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

/// `capture(seed)` with a task frame after every 6th frame delimiter (as a Linux guest's run
/// interleaves them with the blocks).
fn capture_with_tasks(seed: u64) -> Vec<u8> {
    let bytes = capture(seed);
    let mut out = Vec::with_capacity(bytes.len() + 4096);
    let mut zeros = 0u64;
    for &b in &bytes {
        out.push(b);
        if b == 0 {
            zeros += 1;
            if zeros.is_multiple_of(6) {
                let t = Task {
                    pcpu: (zeros % 3) as u16,
                    tsc: zeros * 1000,
                    vm: 1,
                    vcpu: (zeros % 2) as u16,
                    cr3: 0x1000 * zeros,
                    task: 0xffff_8880_0000_0000 + zeros,
                    pid: zeros as u32,
                    tgid: zeros as u32,
                    comm: FixedStr::truncated("w41"),
                };
                let mut frame = [0u8; MAX_TASK_FRAME_LEN];
                let n = encode_task(&t, &mut frame).unwrap();
                out.extend_from_slice(&frame[..n]);
            }
        }
    }
    out
}

/// `decode_metadata_parallel` finds every frame but the blocks as `decode` does, and reads no
/// block.
fn compare_metadata(bytes: &[u8], parts: usize) -> Result<(), TestCaseError> {
    let whole = decode(bytes);
    let meta = decode_metadata_parallel(bytes, parts);
    prop_assert_eq!(&meta.header, &whole.header);
    prop_assert_eq!(&meta.tasks, &whole.tasks);
    prop_assert_eq!(&meta.vm_ends, &whole.vm_ends);
    prop_assert_eq!(&meta.costs, &whole.costs);
    prop_assert_eq!(&meta.mappings, &whole.mappings);
    prop_assert_eq!(&meta.end, &whole.end);
    prop_assert_eq!(&meta.text, &whole.text);
    // The end frame names the pCPUs; none has a block.
    prop_assert!(
        meta.pcpus
            .values()
            .all(|l| l.blocks_received == 0 && l.records.is_empty()),
        "no block is counted"
    );
    Ok(())
}

#[test]
fn metadata_without_the_blocks() {
    let bytes = capture_with_tasks(3);
    let whole = decode(&bytes);
    assert!(whole.tasks.len() > 10, "{} tasks", whole.tasks.len());
    assert!(
        whole.header.is_some() && whole.end.is_some(),
        "{:?}",
        whole.end
    );
    for parts in [1, 2, 3, 8] {
        compare_metadata(&bytes, parts).unwrap();
    }
}

/// A task frame glued to the frame before it (a block, its delimiter lost) is found by the
/// metadata pass as `decode` finds it: the pass skips a block's span unread only when no other
/// frame starts in it.
#[test]
fn metadata_finds_a_frame_glued_to_a_block() {
    let mut bytes = capture_with_tasks(5);
    let starts: Vec<usize> = (1..bytes.len().saturating_sub(5))
        .filter(|&i| {
            bytes[i - 1] == 0 && bytes[i + 1..i + 4] == MAGIC && bytes[i + 4] == FRAME_TASK
        })
        .collect();
    assert!(starts.len() > 10, "{} task frames", starts.len());
    let tasks = decode(&bytes).tasks.len();
    // Every third task frame loses the delimiters before it (its own leading one and the
    // previous frame's trailing one), and is glued to that frame.
    let mut glued = 0;
    for &i in starts.iter().step_by(3).rev() {
        let mut from = i;
        while from > 0 && bytes[from - 1] == 0 {
            from -= 1;
        }
        if from > 0 {
            bytes.drain(from..i);
            glued += 1;
        }
    }
    assert!(
        glued > 3,
        "{glued} task frames glued to the frame before them"
    );
    let whole = decode(&bytes);
    assert_eq!(whole.tasks.len(), tasks, "decode finds every task frame");
    for parts in [1, 2, 3] {
        let meta = decode_metadata_parallel(&bytes, parts);
        assert_eq!(meta.tasks, whole.tasks, "{parts} parts");
    }
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

    #[test]
    fn damaged_capture_metadata(seed in 0u64..1000, flips in prop::collection::vec((any::<prop::sample::Index>(), 1u8..), 1..8), parts in 1usize..5) {
        let mut bytes = capture_with_tasks(seed);
        for (i, x) in flips {
            let at = i.index(bytes.len());
            if bytes[at] != 0 && bytes[at] ^ x != 0 {
                bytes[at] ^= x;
            }
        }
        compare_metadata(&bytes, parts)?;
    }
}
