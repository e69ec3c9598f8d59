//! A log a guest may have forged frames into: the report says so at its top (a second, different
//! header; a block sent twice; task frames naming VMs the header does not list), in text and in
//! JSON; and names the guest chose (VM names, process `comm`s, console text) never reach a text
//! or HTML output with their control characters.

use hvprof_analyze::model::integrity::Integrity;
use hvprof_analyze::model::profile::{LoadOptions, Profile};
use hvprof_analyze::model::progress::Progress;
use hvprof_analyze::naming::symbols::Images;
use hvprof_analyze::views::report;
use hvprof_analyze::views::{html, script, text};
use hvprof_samplelog::{
    BlockEncoder, BuildId, FixedStr, Header, PcpuTotals, Record, Sample, SampleKind, Task, VmInfo,
    encode_end, encode_header, encode_task, guest_mode,
};
use serde_json::Value;

const EVIL_COMM: &str = "evil\n\x1b[2J";
const EVIL_VM: &str = "vm\x1b]0;pwned\x07";

fn header(tsc_hz: u64) -> Header {
    header_named(tsc_hz, ["web", EVIL_VM])
}

fn header_named(tsc_hz: u64, names: [&str; 2]) -> Header {
    let mut h = Header {
        tsc_hz,
        pcpus: 1,
        period_ticks: 1000,
        ..Header::default()
    };
    for (id, name) in [(0u16, names[0]), (1, names[1])] {
        h.vms
            .push(VmInfo {
                id,
                name: FixedStr::truncated(name),
                vcpus: 1,
                image: FixedStr::truncated("w.elf"),
                image_build_id: BuildId::default(),
            })
            .unwrap();
    }
    h
}

fn task(vm: u16, comm: &str) -> Task {
    Task {
        pcpu: 0,
        tsc: 0,
        vm,
        vcpu: 0,
        cr3: 0x1000,
        task: 0xffff_8880_0000_1000,
        pid: 100,
        tgid: 100,
        comm: FixedStr::truncated(comm),
    }
}

/// A capture from pCPU 0: header, task frames, one block of guest samples (VM 0 in user mode,
/// VM 1), console text with an escape sequence, end frame. `forged`: also a second header with
/// another TSC frequency, the block again, and a task frame for VM 7.
fn capture(forged: bool) -> Vec<u8> {
    capture_named(forged, ["web", EVIL_VM], EVIL_COMM)
}

/// [`capture`] with these VM names and this `comm` in its task frame.
fn capture_named(forged: bool, names: [&str; 2], comm: &str) -> Vec<u8> {
    let mut out = b"boot \x1b[31mred\x1b[0m\n".to_vec();
    let mut buf = vec![0u8; 1 << 16];
    let put = |out: &mut Vec<u8>, n: usize, buf: &[u8]| out.extend_from_slice(&buf[..n]);
    let n = encode_header(&header_named(1_000_000, names), &mut buf).unwrap();
    put(&mut out, n, &buf);
    let n = encode_task(&task(0, comm), &mut buf).unwrap();
    put(&mut out, n, &buf);
    if forged {
        let n = encode_task(&task(7, "ghost"), &mut buf).unwrap();
        put(&mut out, n, &buf);
    }
    let records: Vec<Record> = (0..20u64)
        .map(|i| {
            Record::Sample(Sample {
                tsc: 1000 * (i + 1),
                kind: SampleKind::Guest,
                vm: u16::from(i % 4 == 0),
                vcpu: 0,
                guest_rip: 0x40_1000,
                guest_cr3: 0x1000,
                guest_mode: guest_mode(3, 2),
                ..Sample::default()
            })
        })
        .collect();
    let mut enc = BlockEncoder::new(0, 1000);
    let n = enc.encode(&records, &[], 0, &mut buf).unwrap();
    let block = buf[..n].to_vec();
    out.extend_from_slice(&block);
    if forged {
        let n = encode_header(&header(3_000_000_000), &mut buf).unwrap();
        put(&mut out, n, &buf);
        out.extend_from_slice(&block);
    }
    let totals: [PcpuTotals; 1] = [enc.totals(0)];
    let n = encode_end(&totals, &mut buf).unwrap();
    put(&mut out, n, &buf);
    out
}

fn report(bytes: &[u8]) -> report::Report {
    report::from_bytes(
        bytes,
        &Images::default(),
        LoadOptions {
            threads: 2,
            keep_guest: true,
            tables: true,
            report_only: false,
            time: None,
            top_rows: None,
            keep_samples: false,
        },
        &Progress::hidden(),
    )
    .1
}

#[test]
fn forged_frames_are_reported_first() {
    let r = report(&capture(true));
    assert_eq!(
        r.integrity,
        Integrity {
            header_conflicts: 1,
            duplicate_blocks: 1,
            tasks_of_unknown_vms: 1,
            unknown_task_vms: vec![7],
        }
    );
    // Nothing was lost: the integrity warnings open the report.
    assert!(r.losses.is_empty());
    let out = text::render(&r, 20, None);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[..3],
        [
            "warning: log integrity: 1 header frame(s) differ from the first one (forged or corrupted; the first is used)",
            "warning: log integrity: 1 duplicate block(s), a pCPU's sequence number sent twice (replayed or forged; later copies ignored)",
            "warning: log integrity: 1 task frame(s) name VMs the header does not list (vm7): forged or corrupted",
        ]
    );
    // The duplicate is not counted twice.
    assert_eq!(r.total_samples, 20);
    let v: Value = serde_json::to_value(&r).unwrap();
    assert_eq!(
        v["integrity"],
        serde_json::json!({"header_conflicts": 1, "duplicate_blocks": 1,
            "tasks_of_unknown_vms": 1, "unknown_task_vms": [7]})
    );
    assert!(
        v["warnings"][0]
            .as_str()
            .unwrap()
            .starts_with("log integrity: 1 header")
    );
}

#[test]
fn a_clean_log_has_no_integrity_warning() {
    let r = report(&capture(false));
    assert_eq!(r.integrity, Integrity::default());
    let out = text::render(&r, 20, None);
    assert!(!out.contains("integrity"), "{out}");
    // Its only warnings: no symbols for the VM without task frames, no kernel for the Linux
    // guest (the VM with them).
    let warnings: Vec<&str> = out.lines().filter(|l| l.starts_with("warning")).collect();
    assert_eq!(warnings.len(), 2, "{out}");
    assert!(warnings[0].starts_with("warning: no symbols for VM"));
    assert!(warnings[1].starts_with("warning: no kernel symbols for VM"));
}

/// No control character but the line breaks (and, in `perf script`, its tabs).
fn assert_printable(what: &str, s: &str, allowed: &[char]) {
    if let Some(c) = s
        .chars()
        .find(|&c| (c.is_control() || c == '\u{202e}') && !allowed.contains(&c))
    {
        panic!("{what}: raw {c:?} in\n{s}");
    }
}

#[test]
fn guest_chosen_names_are_escaped() {
    let bytes = capture(true);
    let r = report(&bytes);
    let out = text::render(&r, 20, None);
    assert_printable("text report", &out, &['\n']);
    // The process column and the VM's title hold the names, escaped.
    assert!(out.contains(r"evil\n\x1b[2J[100]"), "{out}");
    assert!(
        out.contains(r"Guest level: VM vm\x1b]0;pwned\x07 (w.elf)"),
        "{out}"
    );
    assert!(!out.lines().any(|l| l.starts_with("[2J")));
    // The JSON report carries the same escaped names.
    let v: Value = serde_json::to_value(&r).unwrap();
    assert_eq!(v["vms"][1]["name"], r"vm\x1b]0;pwned\x07");
    // The decode summary, console text included.
    let summary = text::decode_summary(&hvprof_samplelog::decode(&bytes), true, true);
    assert_printable("decode summary", &summary, &['\n']);
    assert!(summary.contains(r"boot \x1b[31mred\x1b[0m"), "{summary}");
    assert!(summary.contains(r"vm 1: vm\x1b]0;pwned\x07"), "{summary}");
    // Every view of the profile.
    let (p, r) = report::from_bytes(
        &bytes,
        &Images::default(),
        LoadOptions {
            threads: 1,
            keep_guest: true,
            tables: true,
            report_only: false,
            time: None,
            top_rows: None,
            keep_samples: true,
        },
        &Progress::hidden(),
    );
    let page = html::render(&p, &r, "t", 10, 10).unwrap();
    assert_printable("html", &page, &['\n']);
    assert!(page.contains(r"evil\n\x1b[2J[100]"));
    let mut perf = Vec::new();
    script::write(&p, &mut perf, &Progress::hidden()).unwrap();
    assert_printable(
        "perf script",
        &String::from_utf8(perf).unwrap(),
        &['\n', '\t'],
    );
    let folded = hvprof_analyze::views::flame::folded(&p).join("\n");
    assert_printable("folded stacks", &folded, &['\n']);
    assert!(folded.contains(r"evil\n\x1b[2J[100]"), "{folded}");
}

/// Names that spell the keys the Firefox export looks for in the JSON it splices its tables
/// into (a thread's `"frameTable":`, `"samples":`, `"stringArray":`) do not mislead it: in the
/// JSON a name's quotes are escaped, so no name can begin a key. The file parses, every
/// thread's tables and samples are whole, and the names are there as they are.
#[test]
fn names_like_json_keys_do_not_move_the_firefox_tables() {
    for forged in [false, true] {
        let bytes = capture_named(
            forged,
            [r#""frameTable":{"#, r#""samples":{"length":"#],
            r#""stringArray":[""#,
        );
        let p = Profile::from_bytes(
            &bytes,
            &Images::default(),
            LoadOptions::all(2),
            &Progress::hidden(),
        );
        let mut written = Vec::new();
        hvprof_analyze::views::firefox::write(&p, &mut written, &Progress::hidden()).unwrap();
        let v: Value = serde_json::from_slice(&written).unwrap();
        for t in v["threads"].as_array().unwrap() {
            for (table, column) in [
                ("frameTable", "func"),
                ("funcTable", "name"),
                ("stackTable", "frame"),
                ("samples", "stack"),
            ] {
                assert_eq!(
                    t[table][column].as_array().unwrap().len() as u64,
                    t[table]["length"].as_u64().unwrap(),
                    "forged: {forged}: {table}"
                );
            }
        }
        let samples: u64 = v["threads"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["samples"]["length"].as_u64().unwrap())
            .sum();
        assert_eq!(samples, 20);
        let names: Vec<&str> = v["threads"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["processName"].as_str().unwrap())
            .collect();
        assert!(
            names.iter().any(|n| n.contains(r#""samples":{"#)),
            "{names:?}"
        );
    }
}
