//! Wire size on the realistic synthetic trace: at most 6 bytes per sample, everything included.

use hvprof_samplelog::decode;
use hvprof_samplelog::synth::{self, CaptureOptions, SynthConfig};

fn measure(cfg: &SynthConfig, block_records: usize) -> f64 {
    let cap = synth::capture(
        cfg,
        &CaptureOptions {
            block_records,
            keep_records: false,
            ..CaptureOptions::default()
        },
    );
    let d = decode(&cap.bytes);
    assert!(d.is_complete());
    assert_eq!(d.samples(), cap.samples);
    let events: u64 = cap.totals.iter().map(|t| t.events).sum();
    let per_sample = cap.bytes.len() as f64 / cap.samples as f64;
    println!(
        "seed {} blocks of {block_records}: {} samples + {events} events in {} bytes = {per_sample:.3} bytes/sample",
        cfg.seed,
        cap.samples,
        cap.bytes.len()
    );
    per_sample
}

#[test]
fn realistic_trace_takes_at_most_6_bytes_per_sample() {
    for seed in [1, 2, 3] {
        let cfg = SynthConfig {
            seed,
            samples_per_pcpu: 20_000,
            ..SynthConfig::default()
        };
        let b = measure(&cfg, 64);
        assert!(b <= 6.0, "{b:.3} bytes/sample");
    }
}

#[test]
fn larger_blocks_are_smaller() {
    let cfg = SynthConfig {
        samples_per_pcpu: 10_000,
        ..SynthConfig::default()
    };
    let b16 = measure(&cfg, 16);
    let b64 = measure(&cfg, 64);
    let b255 = measure(&cfg, 255);
    assert!(b255 < b64 && b64 < b16);
}
