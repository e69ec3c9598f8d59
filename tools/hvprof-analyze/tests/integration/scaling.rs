//! The figure in docs/FUZZING.md: every view of a log with K vCPUs (each in once for 20 samples
//! on one of two pCPUs, then out for good, so every later sample of its pCPU is its steal: the
//! case that made the timeline quadratic), for doubling K. Each view's time should double too.
//!
//! `cargo test --release -p hvprof-analyze --test integration scaling -- --ignored --nocapture`

use std::time::Instant;

use hvprof_analyze::model::profile::LoadOptions;
use hvprof_analyze::model::progress::Progress;
use hvprof_analyze::naming::symbols::Images;
use hvprof_analyze::views::chart::Timeline;
use hvprof_analyze::views::{firefox, flame, html, pprof, report, script, stat, text};
use hvprof_samplelog::{Event, EventKind, OutReason, Record, Sample, guest_mode, synth};

fn log(k: u64) -> Vec<u8> {
    let mut records = [Vec::new(), Vec::new()];
    for k in 0..k {
        let (vm, vcpu) = ((k / 8) as u16, (k % 8) as u16);
        let t = 100 * k;
        let ev = |tsc, kind| {
            Record::Event(Event {
                tsc,
                kind,
                vm,
                vcpu,
                reason: OutReason::Preempted,
            })
        };
        let r = &mut records[(k % 2) as usize];
        r.push(ev(t, EventKind::VcpuIn));
        r.extend((1..=20).map(|i| {
            Record::Sample(Sample {
                tsc: t + i,
                vm,
                vcpu,
                guest_mode: guest_mode(0, 2),
                ..Sample::default()
            })
        }));
        r.push(ev(t + 21, EventKind::VcpuOut));
    }
    let mut bytes = Vec::new();
    for (pcpu, r) in records.iter().enumerate() {
        bytes.extend(synth::encode_blocks(pcpu as u16, r, 10, 64));
    }
    bytes
}

#[test]
#[ignore = "a benchmark"]
fn views_scale_linearly() {
    for k in [500u64, 1000, 2000, 4000] {
        let bytes = log(k);
        let progress = Progress::hidden();
        let t = Instant::now();
        let (p, r) = report::from_bytes(&bytes, &Images::default(), LoadOptions::all(1), &progress);
        let load = t.elapsed();
        let mut times = vec![("decode+report+names", load)];
        let mut time = |name: &'static str, f: &mut dyn FnMut()| {
            let t = Instant::now();
            f();
            times.push((name, t.elapsed()));
        };
        time("text", &mut || drop(text::render(&r, 20, None)));
        time("timeline", &mut || drop(Timeline::build(&p, 120).unwrap()));
        time("folded", &mut || drop(flame::folded(&p)));
        time("stat", &mut || drop(stat::render(&stat::build(&p))));
        time("script", &mut || {
            script::write(&p, &mut std::io::sink(), &progress).unwrap()
        });
        time("firefox", &mut || {
            firefox::write(&p, &mut std::io::sink(), &progress).unwrap()
        });
        time("pprof", &mut || drop(pprof::build(&p, &progress)));
        time("html (SVGs)", &mut || {
            drop(html::render(&p, &r, "t", 120, 25).unwrap())
        });
        let list: Vec<String> = times
            .iter()
            .map(|(n, d)| format!("{n} {:.1} ms", d.as_secs_f64() * 1e3))
            .collect();
        println!(
            "{k} vCPUs, {} samples, {} bytes: {}",
            p.samples.len(),
            bytes.len(),
            list.join(", ")
        );
    }
}
