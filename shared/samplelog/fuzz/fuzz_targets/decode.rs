//! The decoder must never panic (overflow checks on: `cargo fuzz run -a`), streaming it in two
//! pieces must give the same result, and its gaps must account for every loss it counts.
#![no_main]

use hvprof_samplelog::{Collector, StreamDecoder, decode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let whole = decode(data);
    assert_eq!(whole.bytes, data.len() as u64);
    // Split at a point derived from the input.
    let cut = data
        .first()
        .map_or(0, |&b| usize::from(b) * data.len() / 256);
    let mut dec = StreamDecoder::new();
    let mut col = Collector::new();
    dec.feed(&data[..cut], &mut |item| col.push(item));
    dec.feed(&data[cut..], &mut |item| col.push(item));
    dec.finish(&mut |item| col.push(item));
    assert_eq!(col.finish(dec.position()), whole);
    // Every loss counted is in a gap, on its pCPU, in stream order.
    for (&pcpu, log) in &whole.pcpus {
        let sum = |f: fn(&hvprof_samplelog::Gap) -> u64| {
            log.gaps.iter().fold(0u64, |n, g| n.saturating_add(f(g)))
        };
        assert_eq!(sum(|g| g.blocks), log.blocks_lost);
        assert_eq!(sum(|g| g.samples), log.samples_lost);
        assert_eq!(sum(|g| g.events), log.events_lost);
        assert!(log.gaps.iter().all(|g| g.pcpu == pcpu));
        assert!(
            log.gaps
                .windows(2)
                .all(|w| w[0].at_record <= w[1].at_record)
        );
        assert!(log.gaps.iter().all(|g| g.at_record <= log.records.len()));
        assert_eq!(log.gaps.iter().any(|g| g.truncated), !whole.end_seen());
    }
});
