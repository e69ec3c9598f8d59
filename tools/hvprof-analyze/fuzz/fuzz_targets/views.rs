//! Every view of whatever a log decodes to: the report (text and JSON), the decode summary, the
//! timeline (chart, SVG, summary), the folded stacks and flame graph, the call graph (text and
//! JSON), the exit statistics,
//! `perf script`, the HTML page, the Firefox profile and pprof. None may panic (overflow checks
//! on: `cargo fuzz run -a`); run with `-timeout` so that a view slower than linear shows.
//! The first input byte picks the options (threads, Linux naming, tables cut to their first rows, bins), the second
//! whether the report's tables are made.
#![no_main]

use hvprof_analyze::model::profile::LoadOptions;
use hvprof_analyze::model::progress::Progress;
use hvprof_analyze::naming::symbols::Images;
use hvprof_analyze::views::chart::Timeline;
use hvprof_analyze::views::{callgraph, firefox, flame, html, pprof, report, script, stat, text};
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let opt = data.first().copied().unwrap_or(0);
    let progress = Progress::hidden();
    let (p, r) = report::from_bytes(
        data,
        &Images::default(),
        LoadOptions {
            threads: 1 + usize::from(opt & 1),
            keep_guest: opt & 2 != 0,
            tables: data.get(1).is_none_or(|b| b & 1 == 0),
            report_only: false,
            time: None,
            // The text report's tables, cut to their first rows.
            top_rows: (opt & 4 != 0).then_some(5),
            // The samples read again in time order, as the first pass kept them.
            keep_samples: true,
        },
        &progress,
    );
    let r = &r;
    assert_eq!(p.samples.len() as u64, r.total_samples);
    // The samples read again are every sample, in TSC order (then pCPU).
    let all = p.samples_in_order().unwrap();
    assert_eq!(all.len(), p.samples.len());
    assert!(
        all.windows(2)
            .all(|w| (w[0].tsc, w[0].pcpu) <= (w[1].tsc, w[1].pcpu))
    );
    // Text outputs hold no control character but line breaks (and perf script's tabs).
    let printable = |s: &str, allowed: &[char]| {
        assert!(
            s.chars().all(|c| !c.is_control() || allowed.contains(&c)),
            "{s:?}"
        );
    };
    printable(&text::render(r, 20, None), &['\n']);
    serde_json::to_string(r).unwrap();
    printable(
        &text::decode_summary(&hvprof_samplelog::decode(data), true, true),
        &['\n'],
    );
    let bins = 1 + usize::from(opt >> 4);
    let t = Timeline::build(&p, bins).unwrap();
    printable(&t.summary(), &['\n']);
    printable(&flame::folded(&p).join("\n"), &['\n']);
    let g = callgraph::build(&p);
    printable(&callgraph::render(&g, 10, None), &['\n']);
    serde_json::to_string(&g).unwrap();
    let s = stat::build(&p);
    printable(&stat::render(&s), &['\n']);
    serde_json::to_string(&s).unwrap();
    let mut perf = Vec::new();
    script::write(&p, &mut perf, &progress).unwrap();
    printable(std::str::from_utf8(&perf).unwrap(), &['\n', '\t']);
    // Drawing (plotters, inferno) is most of the time and depends little on the input beyond
    // the rows and states it gets: one input in four draws the HTML page, which holds the
    // timeline's SVG and the flame graph's.
    if opt & 0x0c == 0 {
        if let Ok(page) = html::render(&p, r, "fuzz", bins, 10) {
            printable(&page, &['\n']);
        }
        let mut sink = Vec::new();
        let _ = flame::write(&p, "fuzz", true, &mut sink);
    }
    // The file `export --firefox` writes parses, and holds every sample.
    let mut written = Vec::new();
    firefox::write(&p, &mut written, &progress).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&written).unwrap();
    let samples: u64 = v["threads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["samples"]["length"].as_u64().unwrap())
        .sum();
    assert_eq!(samples, r.total_samples);
    pprof::build(&p, &progress).encode_to_vec();
});
