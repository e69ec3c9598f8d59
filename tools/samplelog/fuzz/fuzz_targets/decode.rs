//! The decoder must never panic, and streaming it in two pieces must give the same result.
#![no_main]

use hvprof_samplelog::{Collector, StreamDecoder, decode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let whole = decode(data);
    assert_eq!(whole.bytes, data.len() as u64);
    // Split at a point derived from the input.
    let cut = data.first().map_or(0, |&b| usize::from(b) * data.len() / 256);
    let mut dec = StreamDecoder::new();
    let mut col = Collector::new();
    dec.feed(&data[..cut], &mut |item| col.push(item));
    dec.feed(&data[cut..], &mut |item| col.push(item));
    dec.finish(&mut |item| col.push(item));
    assert_eq!(col.finish(dec.position()), whole);
});
