//! Decoder throughput on a synthetic capture (default 10 M samples over 4 pCPUs).
//!
//! ```text
//! cargo run --release -p hvprof-samplelog --features std --example throughput [-- SAMPLES]
//! ```
//!
//! Prints the wire size per sample, then samples/s for the streaming decoder (items only) and for
//! `decode()` (which also collects every record).

use std::time::Instant;

use hvprof_samplelog::synth::{self, CaptureOptions, SynthConfig};
use hvprof_samplelog::{Item, Record, StreamDecoder, decode};

fn main() {
    let total: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.replace('_', "").parse().ok())
        .unwrap_or(10_000_000);
    let pcpus: u16 = 4;
    let cfg = SynthConfig {
        pcpus,
        samples_per_pcpu: total.div_ceil(u64::from(pcpus)),
        ..SynthConfig::default()
    };
    let t = Instant::now();
    let cap = synth::capture(
        &cfg,
        &CaptureOptions {
            keep_records: false,
            ..CaptureOptions::default()
        },
    );
    let gen_time = t.elapsed();
    println!(
        "generated + encoded {} samples in {} blocks: {} bytes, {:.3} bytes/sample ({:.2?}, {:.1} M samples/s)",
        cap.samples,
        cap.frames.len() - 2,
        cap.bytes.len(),
        cap.bytes.len() as f64 / cap.samples as f64,
        gen_time,
        cap.samples as f64 / gen_time.as_secs_f64() / 1e6,
    );

    let t = Instant::now();
    let mut dec = StreamDecoder::new();
    let mut samples = 0u64;
    let mut damaged = 0u64;
    let mut sink = |item: Item<'_>| match item {
        Item::Block { records, .. } => {
            samples += records
                .iter()
                .filter(|r| matches!(r, Record::Sample(_)))
                .count() as u64;
        }
        Item::Damage(_) => damaged += 1,
        _ => {}
    };
    for chunk in cap.bytes.chunks(64 * 1024) {
        dec.feed(chunk, &mut sink);
    }
    dec.finish(&mut sink);
    let dt = t.elapsed();
    assert_eq!(samples, cap.samples);
    assert_eq!(damaged, 0);
    println!(
        "StreamDecoder: {samples} samples in {dt:.2?}: {:.1} M samples/s, {:.0} MB/s",
        samples as f64 / dt.as_secs_f64() / 1e6,
        cap.bytes.len() as f64 / dt.as_secs_f64() / 1e6,
    );

    let t = Instant::now();
    let d = decode(&cap.bytes);
    let dt = t.elapsed();
    assert_eq!(d.samples(), cap.samples);
    assert!(d.is_complete());
    println!(
        "decode():      {} samples in {dt:.2?}: {:.1} M samples/s",
        d.samples(),
        d.samples() as f64 / dt.as_secs_f64() / 1e6,
    );
}
