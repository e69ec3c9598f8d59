//! Lost records are reported up front and marked in every view: the text report opens with
//! where (pCPU) and when (TSC and seconds) records are missing, the JSON report lists the ranges,
//! the timeline draws them over their pCPU's row, the HTML page warns before its tables, the
//! Firefox profile has a marker per range, pprof a `[lost]` sample and the flame graph a
//! `[lost]` frame.

use hvprof_analyze::model::profile::{LoadOptions, Profile};
use hvprof_analyze::model::progress::Progress;
use hvprof_analyze::naming::symbols::Images;
use hvprof_analyze::views::chart::{LOST_COLOR, Timeline};
use hvprof_analyze::views::report::{self, Report};
use hvprof_analyze::views::{firefox, flame, html, pprof, text};
use hvprof_samplelog::{
    BlockHeader, Header, MAX_HEADER_FRAME_LEN, PcpuTotals, Record, Sample, SampleKind,
    encode_block, encode_end, encode_header, max_block_frame_len, max_end_frame_len,
};
use serde_json::Value;

const HZ: u64 = 1_000_000;

fn frame(out: &mut Vec<u8>, f: impl FnOnce(&mut [u8]) -> usize) {
    let mut buf = vec![0u8; 1 << 16];
    let n = f(&mut buf);
    out.extend_from_slice(&buf[..n]);
}

/// Block `seq` of `pcpu`: one idle sample per TSC, numbered as if every block held two.
fn block(out: &mut Vec<u8>, pcpu: u16, seq: u64, tscs: [u64; 2], drops: u64) {
    let h = BlockHeader {
        pcpu,
        seq,
        first_sample: 2 * seq,
        first_event: 0,
        ring_drops: drops,
        period_ticks: 1000,
    };
    let rec = tscs.map(|tsc| {
        Record::Sample(Sample {
            tsc,
            kind: SampleKind::Idle,
            vm: hvprof_samplelog::NO_VM,
            ..Sample::default()
        })
    });
    assert!(max_block_frame_len(2, 0) < 1 << 16);
    frame(out, |b| encode_block(&h, &rec, &[], b).unwrap());
}

/// pCPU 0: blocks 0 (TSC 1000, 2000), 1 lost (3000, 4000), 2 (5000, 6000); pCPU 1: blocks 0
/// (1500, 2500) and 1 (7500, 8500) with 3 samples dropped by the hypervisor in between. With
/// `end`, the end frame; without, the log is truncated.
fn capture(end: bool) -> Vec<u8> {
    let mut out = Vec::new();
    let header = Header {
        tsc_hz: HZ,
        pcpus: 2,
        period_ticks: 1000,
        ..Header::default()
    };
    const { assert!(MAX_HEADER_FRAME_LEN < 1 << 16) };
    frame(&mut out, |b| encode_header(&header, b).unwrap());
    block(&mut out, 0, 0, [1000, 2000], 0);
    block(&mut out, 1, 0, [1500, 2500], 0);
    block(&mut out, 0, 2, [5000, 6000], 0);
    block(&mut out, 1, 1, [7500, 8500], 3);
    if end {
        let totals = [
            PcpuTotals {
                pcpu: 0,
                samples: 6,
                events: 0,
                ring_drops: 0,
                blocks: 3,
            },
            PcpuTotals {
                pcpu: 1,
                samples: 4,
                events: 0,
                ring_drops: 3,
                blocks: 2,
            },
        ];
        assert!(max_end_frame_len(2) < 1 << 16);
        frame(&mut out, |b| encode_end(&totals, b).unwrap());
    }
    out
}

fn profile(bytes: &[u8]) -> Profile {
    report(bytes).0
}

/// The profile and its report.
fn report(bytes: &[u8]) -> (Profile, Report) {
    report::from_bytes(
        bytes,
        &Images::default(),
        LoadOptions::all(2),
        &Progress::hidden(),
    )
}

const LOST_0: &str = "records lost: pCPU 0: 2 samples and 0 events lost in 1 block(s) from TSC 2000 (0.001000 s) to TSC 5000 (0.004000 s)";
const LOST_1: &str = "records lost: pCPU 1: 3 samples dropped by the hypervisor (ring full) from TSC 2500 (0.001500 s) to TSC 7500 (0.006500 s)";

#[test]
fn text_report_opens_with_the_losses() {
    let (_, r) = report(&capture(true));
    let out = text::render(&r, 20, None);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], format!("warning: {LOST_0}"));
    assert_eq!(lines[1], format!("warning: {LOST_1}"));
    assert!(lines[2].is_empty() && lines[3].starts_with("Host level"));
    // Truncated: each pCPU's end is unknown, until the end of the log.
    let (_, r) = report(&capture(false));
    let out = text::render(&r, 20, None);
    let warnings: Vec<&str> = out
        .lines()
        .take_while(|l| l.starts_with("warning: "))
        .collect();
    // By pCPU, then in host time.
    assert_eq!(warnings[0], format!("warning: {LOST_0}"));
    assert_eq!(
        warnings[1],
        "warning: records lost: pCPU 0: no end frame: what it recorded is unknown from TSC 6000 (0.005000 s) to the end of the log"
    );
    assert_eq!(warnings[2], format!("warning: {LOST_1}"));
    assert_eq!(
        warnings[3],
        "warning: records lost: pCPU 1: no end frame: what it recorded is unknown from TSC 8500 (0.007500 s) to the end of the log"
    );
    assert!(warnings[4].starts_with("warning: no end frame: the capture is truncated"));
}

#[test]
fn json_report_lists_the_ranges() {
    let (_, r) = report(&capture(true));
    let v: Value = serde_json::to_value(&r).unwrap();
    let l = v["losses"].as_array().unwrap();
    assert_eq!(l.len(), 2);
    assert_eq!(
        l[0],
        serde_json::json!({"pcpu": 0, "from_tsc": 2000, "to_tsc": 5000, "from_seconds": 0.001,
            "to_seconds": 0.004, "blocks": 1, "samples": 2, "events": 0, "dropped": 0,
            "truncated": false})
    );
    assert_eq!(
        (&l[1]["pcpu"], &l[1]["dropped"], &l[1]["samples"]),
        (&Value::from(1), &Value::from(3), &Value::from(0))
    );
    assert_eq!(v["warnings"][0], LOST_0);
}

#[test]
fn timeline_draws_the_losses_over_their_pcpu() {
    let p = profile(&capture(true));
    let t = Timeline::build(&p, 10).unwrap();
    assert_eq!(t.pcpus, [0, 1]);
    // Milliseconds since the first sample (TSC 1000): 1 ms per 1000 ticks.
    let x_max = 10.0;
    assert_eq!(t.loss_spans(0, 1.0, x_max), [(1.0, 4.0)]);
    assert_eq!(t.loss_spans(1, 1.0, x_max), [(1.5, 6.5)]);
    assert!(
        t.summary()
            .contains(&format!("lost: {}", &LOST_0["records lost: ".len()..]))
    );
    let svg = t.svg("t").unwrap();
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let red = format!(
        "#{:02X}{:02X}{:02X}",
        LOST_COLOR.0, LOST_COLOR.1, LOST_COLOR.2
    );
    let overlays = doc
        .descendants()
        .filter(|n| {
            n.has_tag_name("rect")
                && n.attribute("fill")
                    .is_some_and(|f| f.eq_ignore_ascii_case(&red))
        })
        .count();
    // One band per range, and the legend's swatch.
    assert_eq!(overlays, 3);
    assert!(svg.contains("records lost"));
}

#[test]
fn html_warns_before_the_tables() {
    let (p, r) = report(&capture(true));
    let page = html::render(&p, &r, "t", 10, 5).unwrap();
    let warn = page
        .find(&format!("<p class=warn>warning: {LOST_0}</p>"))
        .unwrap();
    assert!(warn < page.find("<h2 id=timeline>").unwrap());
    assert!(page.contains(&format!("<p class=warn>warning: {LOST_1}</p>")));
    // The timeline's legend names the red bands.
    let timeline =
        &page[page.find("<h2 id=timeline>").unwrap()..page.find("<h2 id=flame>").unwrap()];
    assert!(timeline.contains("records lost"));
}

/// The text report and the HTML page say what was lost in the same words.
#[test]
fn text_and_html_give_one_loss_line() {
    let (p, r) = report(&capture(false));
    let text = text::render(&r, 20, None);
    let line = text.lines().find(|l| l.starts_with("Lost: ")).unwrap();
    assert_eq!(
        line,
        "Lost: 1 blocks (2 samples, 0 events), 3 samples dropped in the hypervisor (ring or buffer full), 0 damaged frames; TRUNCATED (no end frame)"
    );
    let page = html::render(&p, &r, "t", 10, 5).unwrap();
    assert!(page.contains(&format!("<p>{line}</p>\n")), "{page}");
}

#[test]
fn firefox_profile_has_a_marker_per_range() {
    let p = profile(&capture(true));
    let mut written = Vec::new();
    firefox::write(&p, &mut written, &Progress::hidden()).unwrap();
    let v: Value = serde_json::from_slice(&written).unwrap();
    let mut found = Vec::new();
    for t in v["threads"].as_array().unwrap() {
        let strings = t["stringArray"].as_array().unwrap();
        let m = &t["markers"];
        for i in 0..m["length"].as_u64().unwrap() as usize {
            let name = &strings[m["name"][i].as_u64().unwrap() as usize];
            if name == "records lost" {
                found.push((
                    t["tid"].to_string(),
                    m["startTime"][i].as_f64().unwrap(),
                    m["endTime"][i].as_f64().unwrap(),
                    // The marker's "why": an index into the thread's strings.
                    strings[m["data"][i]["why"].as_u64().unwrap() as usize].to_string(),
                ));
            }
        }
    }
    found.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(found.len(), 2, "{found:?}");
    // Milliseconds since the first sample.
    // On the hypervisor's pCPU threads (tid 10 + pCPU), in milliseconds since the first sample.
    let tid = |s: &str| s.trim_matches('"').parse::<u32>().unwrap();
    assert_eq!((tid(&found[0].0), found[0].1, found[0].2), (10, 1.0, 4.0));
    assert_eq!((tid(&found[1].0), found[1].1, found[1].2), (11, 1.5, 6.5));
    assert_eq!(
        found[0].3,
        format!("{:?}", &LOST_0["records lost: ".len()..])
    );
    assert_eq!(
        found[1].3,
        format!("{:?}", &LOST_1["records lost: ".len()..])
    );
}

#[test]
fn pprof_has_a_lost_sample_per_range() {
    let p = profile(&capture(true));
    let prof = pprof::build(&p, &Progress::hidden());
    let s = |i: i64| prof.string_table[i as usize].as_str();
    let lost_fn = prof
        .function
        .iter()
        .find(|f| s(f.name) == pprof::LOST)
        .unwrap()
        .id;
    let lost_loc = prof
        .location
        .iter()
        .find(|l| l.line[0].function_id == lost_fn)
        .unwrap()
        .id;
    let mut lost: Vec<(i64, Vec<(String, i64)>)> = prof
        .sample
        .iter()
        .filter(|x| x.location_id == [lost_loc])
        .map(|x| {
            let labels = x
                .label
                .iter()
                .map(|l| (s(l.key).to_owned(), l.num))
                .collect();
            (x.value[0], labels)
        })
        .collect();
    lost.sort();
    let label = |k: &str, v| (k.to_owned(), v);
    assert_eq!(
        lost,
        [
            (
                2,
                vec![
                    label("pcpu", 0),
                    label("lost_from_tsc", 2000),
                    label("lost_to_tsc", 5000)
                ]
            ),
            (
                3,
                vec![
                    label("pcpu", 1),
                    label("lost_from_tsc", 2500),
                    label("lost_to_tsc", 7500)
                ]
            ),
        ]
    );
    let comments: Vec<&str> = prof.comment.iter().map(|&c| s(c)).collect();
    assert!(
        comments.contains(&LOST_0) && comments.contains(&LOST_1),
        "{comments:?}"
    );
}

#[test]
fn flame_graph_has_a_lost_frame() {
    let p = profile(&capture(true));
    let folded = flame::folded(&p);
    // 2 samples lost on pCPU 0, 3 on pCPU 1.
    assert!(folded.contains(&"[lost] 5".to_owned()), "{folded:?}");
    let mut svg = Vec::new();
    flame::write(&p, "t", false, &mut svg).unwrap();
    assert!(String::from_utf8(svg).unwrap().contains("and 5 lost"));
}
