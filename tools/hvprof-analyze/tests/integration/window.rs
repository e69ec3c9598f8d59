//! `--time START,END`: a stretch of host time alone. Every view holds exactly the samples whose
//! TSC falls in the stretch (call chains included: a sample left out must not shift the chains
//! of the samples after it), and each vCPU's scheduling events are cut to it, so its exact
//! split is of the stretch's ticks and agrees with its samples.

use hvprof_analyze::model::profile::{LoadOptions, Profile};
use hvprof_analyze::model::progress::Progress;
use hvprof_analyze::model::window::TimeRange;
use hvprof_analyze::naming::symbols::Images;
use hvprof_analyze::views::script;
use hvprof_samplelog::synth::{self, CaptureOptions, SynthConfig};

use crate::data;

fn profile(bytes: &[u8], time: Option<&str>) -> Profile {
    Profile::from_bytes(
        bytes,
        &Images::default(),
        LoadOptions {
            time: time.map(|t| t.parse::<TimeRange>().unwrap()),
            top_rows: None,
            ..LoadOptions::all(2)
        },
        &Progress::hidden(),
    )
}

/// `script`'s events (blank-line separated) with their time in seconds.
fn script_events(p: &Profile) -> Vec<(f64, String)> {
    let mut out = Vec::new();
    script::write(p, &mut out, &Progress::hidden()).unwrap();
    String::from_utf8(out)
        .unwrap()
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let time = e.split_whitespace().nth(3).unwrap();
            (
                time.trim_end_matches(':').parse::<f64>().unwrap(),
                e.to_owned(),
            )
        })
        .collect()
}

#[test]
fn a_stretch_holds_the_samples_inside_it_chains_and_all() {
    let cfg = SynthConfig {
        pcpus: 2,
        samples_per_pcpu: 20_000,
        chains: true,
        ring_drop_rate: 0.0,
        ..SynthConfig::default()
    };
    let cap = synth::capture(&cfg, &CaptureOptions::default());
    let decoded = hvprof_samplelog::decode(&cap.bytes);
    let tscs: Vec<u64> = decoded
        .pcpus
        .values()
        .flat_map(|l| l.samples().map(|s| s.tsc))
        .collect();
    let (lo, hi) = (
        *tscs.iter().min().unwrap() as f64 / cfg.tsc_hz as f64,
        *tscs.iter().max().unwrap() as f64 / cfg.tsc_hz as f64,
    );
    let (from, to) = (lo + 0.3 * (hi - lo), lo + 0.6 * (hi - lo));
    let window = format!("{from},{to}");
    let range: TimeRange = window.parse().unwrap();
    let w = range.ticks(cfg.tsc_hz);
    let inside = tscs.iter().filter(|&&t| w.contains(t)).count() as u64;
    assert!(inside > 5_000 && inside < 20_000, "{inside}");

    let whole = profile(&cap.bytes, None);
    let part = profile(&cap.bytes, Some(&window));
    assert_eq!(part.samples.len() as u64, inside);
    assert_eq!(part.time, Some(range));
    assert_eq!(whole.time, None);

    // The same events as the whole capture's inside the stretch, chains and all (away from its
    // ends, where the printed time's rounding could not tell).
    let away = |t: f64| t > from + 1e-5 && t < to - 1e-5;
    let want: Vec<String> = script_events(&whole)
        .into_iter()
        .filter(|(t, _)| away(*t))
        .map(|(_, e)| e)
        .collect();
    let got: Vec<String> = script_events(&part)
        .into_iter()
        .filter(|(t, _)| away(*t))
        .map(|(_, e)| e)
        .collect();
    assert!(want.len() > 5_000);
    assert_eq!(got, want);
    // Nothing outside it.
    assert!(
        script_events(&part)
            .iter()
            .all(|(t, _)| *t >= from - 1e-6 && *t <= to + 1e-6)
    );

    // The whole capture as a stretch is the whole capture.
    let all = profile(&cap.bytes, Some(","));
    assert_eq!(all.samples.len(), whole.samples.len());
    assert_eq!(all.time, None);
}

#[test]
fn each_vcpus_exact_split_is_of_the_stretch() {
    // One VM, two vCPUs on one pCPU, taking turns (the paper's Tables 8/9).
    let bytes = std::fs::read(data("sched-2vcpus-1pcpu.log")).unwrap();
    let whole = profile(&bytes, None);
    let hz = whole.tsc_hz as f64;
    let tscs: Vec<u64> = whole.events.iter().map(|(_, e)| e.tsc).collect();
    let (lo, hi) = (
        *tscs.iter().min().unwrap() as f64 / hz,
        *tscs.iter().max().unwrap() as f64 / hz,
    );
    let (from, to) = (lo + 0.25 * (hi - lo), lo + 0.5 * (hi - lo));
    let range: TimeRange = format!("{from},{to}").parse().unwrap();
    let w = range.ticks(whole.tsc_hz);
    let (part, report) = hvprof_analyze::views::report::from_bytes(
        &bytes,
        &Images::default(),
        LoadOptions {
            time: Some(range.to_string().parse().unwrap()),
            top_rows: None,
            keep_samples: false,
            ..LoadOptions::all(2)
        },
        &Progress::hidden(),
    );
    let vm = &report.vms[0];
    assert_eq!(vm.vcpus.len(), 2);
    for v in &vm.vcpus {
        let exact = v.table.exact.as_ref().expect("exact split");
        // Both vCPUs exist throughout: their events cover the stretch exactly.
        assert_eq!(exact.ticks, w.to - w.from, "vCPU {}", v.vcpu);
        assert!(
            exact.steal_difference.abs() < 1.0 && exact.idle_difference.abs() < 1.0,
            "vCPU {}: {exact:?}",
            v.vcpu
        );
        // Turns: about half each.
        assert!(
            (exact.steal - 50.0).abs() < 10.0,
            "vCPU {}: {exact:?}",
            v.vcpu
        );
    }
    // The samples are those of the stretch.
    let decoded = hvprof_samplelog::decode(&bytes);
    let n = decoded
        .pcpus
        .values()
        .flat_map(|l| l.samples())
        .filter(|s| w.contains(s.tsc))
        .count() as u64;
    assert!(n > 0);
    assert_eq!(part.samples.len() as u64, n);
}

#[test]
fn a_stretch_without_samples_says_where_they_are() {
    let bytes = std::fs::read(data("sched-2vcpus-1pcpu.log")).unwrap();
    let p = profile(&bytes, Some("1000,2000"));
    assert_eq!(p.samples.len(), 0);
    // The reader learns where the samples are.
    let w = &p.warnings;
    assert!(
        w.iter().any(|w| w
            .starts_with("--time 1000,2000: no samples in this stretch; the capture's run from ")),
        "{w:?}"
    );
}
