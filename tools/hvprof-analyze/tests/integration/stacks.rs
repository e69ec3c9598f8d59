//! Call stacks, end to end: a handmade capture whose call tree is known, with ELF files whose
//! symbols are known (the hypervisor's and the guest's), through the command line and the
//! views. VM `g` runs:
//!
//! - `leaf` called from `a` (70 samples) and from `b` (30), both called from `main`;
//! - `rec` recursing three deep from `main` (20);
//! - `leaf` from `a`, the chain cut at the walker's depth limit (10), and from `b`, cut at a
//!   bad frame (5);
//! - `main` without a chain (8).
//!
//! The hypervisor: `cpuid_handler` from `handle_exit` from `run` on VM `g`'s CPUID exits, whose
//! guest chain is `a` (the exit's RIP, a CPUID instruction) called from `main` (40); the same
//! function with its host chain cut at the depth limit and no guest chain (12); the idle loop
//! called from `run` (15).
//!
//! Checked: the JSON call graph's edges, totals and exit causes exactly; the flame graph's
//! lines; `perf script`'s callchains, and that inferno's perf collapser folds them into the
//! flame graph's stacks; pprof's stacks hold per function the call graph's totals; the Firefox
//! profile and the HTML page carry the frames; a capture without chains is drawn as before.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use hvprof_analyze::model::profile::{LoadOptions, Profile};
use hvprof_analyze::model::progress::Progress;
use hvprof_analyze::naming::symbols::{Images, Symbols};
use hvprof_analyze::views::{flame, pprof};
use hvprof_samplelog::{
    BlockEncoder, BuildId, Chain, ChainEnd, FixedStr, Header, MAX_HEADER_FRAME_LEN, NO_VM,
    PcpuTotals, Record, Sample, SampleKind, VmInfo, encode_end, encode_header, max_block_frame_len,
    max_end_frame_len,
};
use serde_json::{Value, json};

/// An ELF object with functions `(name, address, size)` in its text.
fn elf(functions: &[(&str, u64, u64)]) -> Vec<u8> {
    use object::write::{Object, StandardSection, Symbol, SymbolSection};
    use object::{Architecture, BinaryFormat, Endianness, SymbolFlags, SymbolKind, SymbolScope};
    let mut obj = Object::new(BinaryFormat::Elf, Architecture::X86_64, Endianness::Little);
    let text = obj.section_id(StandardSection::Text);
    let end = functions.iter().map(|f| f.1 + f.2).max().unwrap_or(0);
    obj.append_section_data(text, &vec![0x90; end as usize], 16);
    for &(name, value, size) in functions {
        obj.add_symbol(Symbol {
            name: name.as_bytes().to_vec(),
            value,
            size,
            kind: SymbolKind::Text,
            scope: SymbolScope::Linkage,
            weak: false,
            section: SymbolSection::Section(text),
            flags: SymbolFlags::None,
        });
    }
    obj.write().unwrap()
}

const GUEST: [(&str, u64, u64); 5] = [
    ("main", 0x1000, 0x100),
    ("a", 0x1100, 0x100),
    ("b", 0x1200, 0x100),
    ("leaf", 0x1300, 0x100),
    ("rec", 0x1400, 0x100),
];

const HYPERVISOR: [(&str, u64, u64); 4] = [
    ("run", 0x10_0000, 0x100),
    ("handle_exit", 0x10_0100, 0x100),
    ("cpuid_handler", 0x10_0200, 0x100),
    ("idle_loop", 0x10_0300, 0x100),
];

/// Return addresses (the instruction after a call) in each function.
const IN_MAIN: [u64; 4] = [0x1010, 0x1020, 0x1030, 0x1040];
const IN_A: u64 = 0x1120;
const IN_B: u64 = 0x1220;
const IN_REC: u64 = 0x1430;
const IN_RUN: u64 = 0x10_0020;
const IN_HANDLE_EXIT: u64 = 0x10_0120;
/// The CPUID instruction in `a` at the exit.
const EXIT_RIP: u64 = 0x1150;

/// `n` samples of `s` with chains `host` and `guest` (frames innermost first, each chain's end;
/// `None`: not walked).
fn samples(
    out: &mut Vec<(Record, Vec<u64>)>,
    n: usize,
    s: Sample,
    host: Option<(&[u64], ChainEnd)>,
    guest: Option<(&[u64], ChainEnd)>,
) {
    let chain = |c: Option<(&[u64], ChainEnd)>| match c {
        Some((f, end)) => Chain::new(f.len(), end),
        None => Chain::NOT_WALKED,
    };
    let mut frames = Vec::new();
    for (f, _) in host.iter().chain(guest.iter()) {
        frames.extend_from_slice(f);
    }
    let s = Sample {
        host_chain: chain(host),
        guest_chain: chain(guest),
        ..s
    };
    for _ in 0..n {
        out.push((Record::Sample(s), frames.clone()));
    }
}

/// The capture described at the top (with `chains`), or the same samples without any chain.
fn capture(chains: bool) -> Vec<u8> {
    let mut header = Header {
        period_ticks: 1000,
        tsc_hz: 1_000_000,
        pcpus: 1,
        ..Header::default()
    };
    header
        .vms
        .push(VmInfo {
            id: 0,
            name: FixedStr::truncated("g"),
            vcpus: 1,
            image: FixedStr::truncated("g.elf"),
            image_build_id: BuildId::default(),
        })
        .unwrap();
    let guest = |rip: u64| Sample {
        kind: SampleKind::Guest,
        vm: 0,
        vcpu: 0,
        vpid: 1,
        guest_rip: rip,
        guest_cr3: 0x1000,
        guest_mode: hvprof_samplelog::guest_mode(0, hvprof_samplelog::MODE_LONG),
        exit_reason: 10,
        cost: 30,
        ..Sample::default()
    };
    let hypervisor = |rip: u64| Sample {
        kind: SampleKind::Hypervisor,
        host_rip: rip,
        guest_cr3: 0x1000,
        ..guest(0)
    };
    let idle = Sample {
        kind: SampleKind::Idle,
        vm: NO_VM,
        vcpu: hvprof_samplelog::NO_VCPU,
        host_rip: 0x10_0310,
        exit_reason: hvprof_samplelog::NO_EXIT,
        cost: 30,
        ..Sample::default()
    };
    use ChainEnd::{BadFrame, Complete, DepthLimit};
    let mut list = Vec::new();
    let leaf = guest(0x1310);
    samples(
        &mut list,
        70,
        leaf,
        None,
        Some((&[IN_A, IN_MAIN[0]], Complete)),
    );
    samples(
        &mut list,
        30,
        leaf,
        None,
        Some((&[IN_B, IN_MAIN[1]], Complete)),
    );
    let rec = guest(0x1410);
    let rec_chain = [IN_REC, IN_REC, IN_MAIN[3]];
    samples(&mut list, 20, rec, None, Some((&rec_chain, Complete)));
    samples(&mut list, 10, leaf, None, Some((&[IN_A], DepthLimit)));
    samples(&mut list, 5, leaf, None, Some((&[IN_B], BadFrame)));
    samples(&mut list, 8, guest(0x1050), None, None);
    let handler = hypervisor(0x10_0210);
    let host = [IN_HANDLE_EXIT, IN_RUN];
    let exit = [EXIT_RIP, IN_MAIN[2]];
    samples(
        &mut list,
        40,
        handler,
        Some((&host, Complete)),
        Some((&exit, Complete)),
    );
    samples(
        &mut list,
        12,
        handler,
        Some((&[IN_HANDLE_EXIT], DepthLimit)),
        None,
    );
    samples(
        &mut list,
        15,
        idle,
        Some((&[IN_RUN + 0x10], Complete)),
        None,
    );
    // Interleaved (as a pCPU's samples come), one period apart.
    let mut order: Vec<usize> = (0..list.len()).collect();
    order.sort_by_key(|&i| (i * 7919) % list.len());
    let mut out = b"boot\n".to_vec();
    let mut buf = vec![
        0u8;
        MAX_HEADER_FRAME_LEN
            .max(max_block_frame_len(16, 16 * 64))
            .max(max_end_frame_len(1))
    ];
    let n = encode_header(&header, &mut buf).unwrap();
    out.extend_from_slice(&buf[..n]);
    let mut enc = BlockEncoder::new(0, 1000);
    let mut tsc = 1_000_000;
    for chunk in order.chunks(16) {
        let mut records = Vec::new();
        let mut frames = Vec::new();
        for &i in chunk {
            let (mut r, f) = list[i].clone();
            if let Record::Sample(s) = &mut r {
                s.tsc = tsc;
                tsc += 1000;
                if !chains {
                    s.host_chain = Chain::NOT_WALKED;
                    s.guest_chain = Chain::NOT_WALKED;
                }
            }
            records.push(r);
            if chains {
                frames.extend_from_slice(&f);
            }
        }
        let n = enc.encode(&records, &frames, 0, &mut buf).unwrap();
        out.extend_from_slice(&buf[..n]);
    }
    let totals: [PcpuTotals; 1] = [enc.totals(0)];
    let n = encode_end(&totals, &mut buf).unwrap();
    out.extend_from_slice(&buf[..n]);
    out
}

/// The capture and its symbol files, written once per name.
struct Files {
    log: PathBuf,
    hypervisor: PathBuf,
    image: PathBuf,
}

fn files(name: &str, chains: bool) -> Files {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("hvprof-stacks-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    let f = Files {
        log: dir.join("serial.log"),
        hypervisor: dir.join("hvprof"),
        image: dir.join("g.elf"),
    };
    std::fs::write(&f.log, capture(chains)).unwrap();
    std::fs::write(&f.hypervisor, elf(&HYPERVISOR)).unwrap();
    std::fs::write(&f.image, elf(&GUEST)).unwrap();
    f
}

impl Files {
    fn run(&self, cmd: &str, extra: &[&str]) -> Vec<u8> {
        let out = Command::new(env!("CARGO_BIN_EXE_hvprof-analyze"))
            .arg(cmd)
            .arg(&self.log)
            .arg("--hypervisor")
            .arg(&self.hypervisor)
            .arg("--image")
            .arg(&self.image)
            .args(extra)
            .output()
            .expect("run hvprof-analyze");
        assert!(
            out.status.success(),
            "hvprof-analyze {cmd}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    }

    fn profile(&self) -> Profile {
        let images = Images {
            hypervisor: Some(Symbols::load(&self.hypervisor).unwrap()),
            guests: vec![Symbols::load(&self.image).unwrap()],
            kernel: None,
            guest_root: None,
        };
        Profile::load(&self.log, &images, LoadOptions::all(2), &Progress::hidden()).unwrap()
    }
}

/// `level`'s rows of a call-graph list, as (the fields but `level`) sorted.
fn rows(list: &Value, level: &str, fields: &[&str]) -> Vec<Vec<Value>> {
    let mut out: Vec<Vec<Value>> = list
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["level"] == level)
        .map(|r| fields.iter().map(|f| r[*f].clone()).collect())
        .collect();
    out.sort_by_key(|r| format!("{r:?}"));
    out
}

fn sorted(mut v: Vec<Vec<Value>>) -> Vec<Vec<Value>> {
    v.sort_by_key(|r| format!("{r:?}"));
    v
}

#[test]
fn json_call_graph_is_the_known_tree() {
    let f = files("json", true);
    let r: Value = serde_json::from_slice(&f.run("report", &["--json", "--call-graph"])).unwrap();
    assert_eq!(r["total_samples"], 210);
    let g = &r["call_graph"];
    assert_eq!(
        g["levels"],
        json!([{"level": "host", "samples": 210}, {"level": "g", "samples": 143}])
    );
    let e = |a: &str, b: &str, n: u64| vec![json!(a), json!(b), json!(n)];
    assert_eq!(
        rows(&g["edges"], "g", &["caller", "callee", "samples"]),
        sorted(vec![
            e("main", "a", 70),
            e("main", "b", 30),
            e("a", "leaf", 80),
            e("b", "leaf", 35),
            e("main", "rec", 20),
            // The recursion: counted once per sample.
            e("rec", "rec", 20),
            e("[truncated: depth limit]", "a", 10),
            e("[truncated: bad frame]", "b", 5),
        ])
    );
    let t = |name: &str, self_: u64, total: u64| vec![json!(name), json!(self_), json!(total)];
    assert_eq!(
        rows(&g["functions"], "g", &["function", "self", "total"]),
        sorted(vec![
            t("leaf", 115, 115),
            t("main", 8, 128),
            t("a", 0, 80),
            t("b", 0, 35),
            t("rec", 20, 20),
            t("[truncated: depth limit]", 0, 10),
            t("[truncated: bad frame]", 0, 5),
        ])
    );
    // The host level: the hypervisor's calls, and the VM's guest calls under its row (its
    // functions named with the VM), with the same counts as at the VM level.
    let gv = |n: &str| format!("{n} [g]");
    let mut host_edges = vec![
        e("run", "handle_exit", 40),
        e("handle_exit", "cpuid_handler", 52),
        e("[truncated: depth limit]", "handle_exit", 12),
        e("run", "[idle]", 15),
        e("[g]", &gv("main"), 128),
        e("[g]", &gv("[truncated: depth limit]"), 10),
        e("[g]", &gv("[truncated: bad frame]"), 5),
    ];
    for (a, b, n) in [
        ("main", "a", 70),
        ("main", "b", 30),
        ("a", "leaf", 80),
        ("b", "leaf", 35),
        ("main", "rec", 20),
        ("rec", "rec", 20),
        ("[truncated: depth limit]", "a", 10),
        ("[truncated: bad frame]", "b", 5),
    ] {
        host_edges.push(e(&gv(a), &gv(b), n));
    }
    assert_eq!(
        rows(&g["edges"], "host", &["caller", "callee", "samples"]),
        sorted(host_edges)
    );
    assert_eq!(
        rows(&g["functions"], "host", &["function", "self", "total"]),
        sorted(vec![
            t("[g]", 0, 143),
            t(&gv("leaf"), 115, 115),
            t(&gv("main"), 8, 128),
            t(&gv("a"), 0, 80),
            t(&gv("b"), 0, 35),
            t(&gv("rec"), 20, 20),
            t(&gv("[truncated: depth limit]"), 0, 10),
            t(&gv("[truncated: bad frame]"), 0, 5),
            t("cpuid_handler", 52, 52),
            t("handle_exit", 0, 52),
            t("run", 0, 55),
            t("[idle]", 15, 15),
            t("[truncated: depth limit]", 0, 12),
        ])
    );
    // Functions by level, then total.
    let order: Vec<(&str, &str)> = g["functions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["level"].as_str().unwrap(),
                f["function"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(order[0], ("host", "[g]"));
    assert_eq!(order.iter().find(|(l, _)| *l == "g"), Some(&("g", "main")));
    assert!(
        order.iter().position(|(l, _)| *l == "g") > order.iter().rposition(|(l, _)| *l == "host")
    );
    assert_eq!(
        g["exit_causes"],
        json!([{"vm": "g", "exit_reason": "CPUID", "guest_function": "a",
                "guest_caller": "main", "samples": 40}])
    );
    assert_eq!(g["truncated"], json!({"depth_limit": 22, "bad_frame": 5}));
    // The tables are those of the report without --call-graph.
    let plain: Value = serde_json::from_slice(&f.run("report", &["--json"])).unwrap();
    assert!(plain.get("call_graph").is_none());
    assert_eq!(plain["vms"], r["vms"]);
    assert_eq!(plain["host"], r["host"]);
    // The text: percentages of each level.
    let text = String::from_utf8(f.run("report", &["--call-graph"])).unwrap();
    assert!(
        text.contains("Call graph, host level: 210 samples"),
        "{text}"
    );
    assert!(text.contains("Call graph, VM g: 143 samples"), "{text}");
    assert!(text.contains("     89.51%     5.59%  main"), "{text}");
    assert!(text.contains("callers    48.95%  main"), "{text}");
    assert!(text.contains("Exit causes, VM g"), "{text}");
    assert!(text.contains("22 samples at the walker's depth limit, 5 at a bad frame"));
}

/// The flame graph's lines.
const FOLDED: [&str; 9] = [
    "[hypervisor];g: CPUID;[truncated: depth limit];handle_exit;cpuid_handler 12",
    "[idle];run;[idle] 15",
    "g;cr3:0x1000;[truncated: bad frame];b;leaf 5",
    "g;cr3:0x1000;[truncated: depth limit];a;leaf 10",
    "g;cr3:0x1000;g.elf;main 8",
    "g;cr3:0x1000;main;a;leaf 70",
    "g;cr3:0x1000;main;b;leaf 30",
    "g;cr3:0x1000;main;rec;rec;rec 20",
    "g;main;a;[exit: CPUID];run;handle_exit;cpuid_handler 40",
];

#[test]
fn flame_graph_and_script_draw_the_stacks() {
    use inferno::collapse::Collapse;
    use inferno::collapse::perf::{Folder, Options};
    let f = files("views", true);
    let p = f.profile();
    let lines = flame::folded(&p);
    assert_eq!(lines, FOLDED);
    // perf script: each sample's callchain, innermost first, the exit causes on the vCPU's
    // thread.
    let text = String::from_utf8(f.run("script", &[])).unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 210);
    let find = |needle: &str| {
        events
            .iter()
            .find(|e| e.contains(needle))
            .unwrap_or_else(|| panic!("no event with {needle}:\n{text}"))
            .lines()
            .skip(1)
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        find("1310 leaf"),
        [
            "\t            1310 leaf ([guest.kallsyms:g.elf])",
            "\t            1120 a+0x20 ([guest.kallsyms:g.elf])",
            "\t            1010 main+0x10 ([guest.kallsyms:g.elf])",
            "\t               0 cr3:0x1000 (guest.process)",
        ]
    );
    assert_eq!(
        find("1150 a+0x50"),
        [
            "\t          100210 cpuid_handler ([hvprof])",
            "\t          100120 handle_exit+0x20 ([hvprof])",
            "\t          100020 run+0x20 ([hvprof])",
            "\t               0 [exit: CPUID] ([hvprof])",
            "\t            1150 a+0x50 ([guest.kallsyms:g.elf])",
            "\t            1030 main+0x30 ([guest.kallsyms:g.elf])",
        ]
    );
    let exit_event = events.iter().find(|e| e.contains("[exit: CPUID]")).unwrap();
    assert!(
        exit_event.starts_with("g 100000/100001 [000] "),
        "{exit_event}"
    );
    assert_eq!(
        find("[truncated: bad frame]"),
        [
            "\t            1310 leaf ([guest.kallsyms:g.elf])",
            "\t            1220 b+0x20 ([guest.kallsyms:g.elf])",
            "\t               0 [truncated: bad frame] ([unknown])",
            "\t               0 cr3:0x1000 (guest.process)",
        ]
    );
    // inferno's perf collapser (FlameGraph's stackcollapse-perf.pl) folds it into the flame
    // graph's stacks (the samples without chains keep their function under the process, the
    // flame graph puts their module between).
    let mut folded = Vec::new();
    Folder::from(Options::default())
        .collapse(text.as_bytes(), &mut folded)
        .unwrap();
    let mut collapsed: Vec<String> = String::from_utf8(folded)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    collapsed.sort();
    let want: Vec<String> = FOLDED
        .iter()
        .map(|l| l.replace("g.elf;main", "main"))
        .collect();
    let mut want = want;
    want.sort();
    assert_eq!(collapsed, want);
}

#[test]
fn pprof_totals_equal_the_call_graph() {
    let f = files("pprof", true);
    let p = f.profile();
    let g = hvprof_analyze::views::callgraph::build(&p);
    let prof = pprof::build(&p, &Progress::hidden());
    let s = |i: i64| prof.string_table[i as usize].as_str();
    let name: HashMap<u64, &str> = prof
        .location
        .iter()
        .map(|l| {
            let f = prof
                .function
                .iter()
                .find(|f| f.id == l.line[0].function_id)
                .unwrap();
            (l.id, s(f.name))
        })
        .collect();
    // Per function, the samples whose stack holds it (once each): the VM's guest samples
    // (labelled with a process) and the others.
    let mut guest: HashMap<&str, i64> = HashMap::new();
    let mut host: HashMap<&str, i64> = HashMap::new();
    let mut leaf_first = Vec::new();
    for x in &prof.sample {
        let is_guest = x.label.iter().any(|l| s(l.key) == "process");
        let mut seen: Vec<&str> = x.location_id.iter().map(|id| name[id]).collect();
        leaf_first.push(seen.clone());
        seen.sort_unstable();
        seen.dedup();
        for n in seen {
            *(if is_guest { &mut guest } else { &mut host })
                .entry(n)
                .or_default() += x.value[0];
        }
    }
    for fun in &g.functions {
        let got = if fun.level == "host" {
            // The VM's row and its functions (named with the VM) are the VM level's.
            if fun.function.starts_with("[g]") || fun.function.ends_with(" [g]") {
                continue;
            }
            host.get(fun.function.as_str())
        } else {
            guest.get(fun.function.as_str())
        };
        assert_eq!(
            got.copied().unwrap_or(0) as u64,
            fun.total,
            "{} at {}",
            fun.function,
            fun.level
        );
    }
    // Leaf first, each frame its own location.
    assert!(leaf_first.contains(&vec!["leaf", "a", "main", "cr3:0x1000", "g"]));
    assert!(leaf_first.contains(&vec![
        "cpuid_handler",
        "handle_exit",
        "run",
        "[exit: CPUID]",
        "a",
        "main",
        "g"
    ]));
    let total: i64 = prof.sample.iter().map(|x| x.value[0]).sum();
    assert_eq!(total, 210);
}

/// With call chains too, `export --pprof` holds the whole profile `pprof::build` makes.
#[test]
fn pprof_file_with_chains_is_the_whole_profile_encoded() {
    use prost::Message;
    let p = files("pprof-bytes", true).profile();
    let mut written = Vec::new();
    pprof::write(&p, &mut written, &Progress::hidden()).unwrap();
    let mut raw = Vec::new();
    std::io::Read::read_to_end(
        &mut flate2::read::GzDecoder::new(written.as_slice()),
        &mut raw,
    )
    .unwrap();
    let whole = pprof::build(&p, &Progress::hidden()).encode_to_vec();
    assert!(raw == whole);
}

#[test]
fn firefox_and_html_carry_the_frames() {
    let f = files("firefox", true);
    let path = f.log.with_file_name("profile.json");
    f.run("export", &["--firefox", path.to_str().unwrap()]);
    let v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let mut names = Vec::new();
    let mut samples = 0;
    for t in v["threads"].as_array().unwrap() {
        let strings = t["stringArray"].as_array().unwrap();
        for n in t["funcTable"]["name"].as_array().unwrap() {
            names.push(
                strings[n.as_u64().unwrap() as usize]
                    .as_str()
                    .unwrap()
                    .to_owned(),
            );
        }
        samples += t["samples"]["length"].as_u64().unwrap();
    }
    assert_eq!(samples, 210);
    for want in [
        "main (g.elf)",
        "a (g.elf)",
        "handle_exit",
        "run",
        "[exit: CPUID]",
    ] {
        assert!(names.iter().any(|n| n == want), "{want}: {names:?}");
    }
    let page = String::from_utf8(f.run("html", &[])).unwrap();
    assert!(page.contains("<h2 id=calls>Call graph</h2>"));
    assert!(
        page.contains("<td>leaf</td><td>a (55.94%), b (24.48%)</td>"),
        "{page}"
    );
}

#[test]
fn a_capture_without_chains_is_drawn_as_before() {
    let f = files("plain", false);
    let p = f.profile();
    assert!(!p.samples.has_chains());
    assert_eq!(
        flame::folded(&p),
        [
            "[hypervisor];g: CPUID;hvprof;cpuid_handler 52",
            "[idle] 15",
            "g;cr3:0x1000;g.elf;leaf 115",
            "g;cr3:0x1000;g.elf;main 8",
            "g;cr3:0x1000;g.elf;rec 20",
        ]
    );
    let text = String::from_utf8(f.run("script", &[])).unwrap();
    assert!(!text.contains("+0x"));
    let page = String::from_utf8(f.run("html", &[])).unwrap();
    assert!(!page.contains("id=calls"));
    // The call graph: every sample its leaf alone (under its VM's row at the host level).
    let r: Value = serde_json::from_slice(&f.run("report", &["--json", "--call-graph"])).unwrap();
    assert_eq!(
        r["call_graph"]["edges"],
        json!([
            {"level": "host", "caller": "[g]", "callee": "leaf [g]", "samples": 115},
            {"level": "host", "caller": "[g]", "callee": "rec [g]", "samples": 20},
            {"level": "host", "caller": "[g]", "callee": "main [g]", "samples": 8},
        ])
    );
    assert_eq!(
        r["call_graph"]["truncated"],
        json!({"depth_limit": 0, "bad_frame": 0})
    );
}

/// `top --call-graph` (replayed, batch mode) gives each function its children share from the
/// chains in the window, callers that never are a leaf included, ranked by it; without the
/// flag the rows are the leaves alone.
#[test]
fn top_call_graph_shows_the_children_shares() {
    let f = files("top", true);
    let top = |extra: &[&str]| {
        let mut args = vec!["--batch", "--replay", "--speed", "100", "--height", "50"];
        args.extend_from_slice(extra);
        let out = String::from_utf8(f.run("top", &args)).unwrap();
        // The last screen (the source ended).
        out.rsplit("hvprof top:").next().unwrap().to_owned()
    };
    let screen = top(&["--call-graph"]);
    let rows: Vec<Vec<&str>> = screen
        .lines()
        .map(|l| {
            l.split(|c: char| c == '│' || c.is_whitespace())
                .filter(|w| !w.is_empty())
                .collect()
        })
        .collect();
    // A row: children, self, samples, the function, ...
    let row = |name: &str| -> Vec<&str> {
        rows.iter()
            .find(|r| r.get(3) == Some(&name))
            .unwrap_or_else(|| panic!("no row {name} in\n{screen}"))
            .clone()
    };
    // Host level (210 samples): children, self, samples, the function.
    assert_eq!(row("run")[..4], ["26.2%", "0.0%", "0", "run"], "{screen}");
    assert_eq!(row("handle_exit")[..3], ["24.8%", "0.0%", "0"]);
    assert_eq!(row("cpuid_handler")[..3], ["24.8%", "24.8%", "52"]);
    assert_eq!(row("[idle]")[..3], ["7.1%", "7.1%", "15"]);
    // VM g's functions (143 guest samples): `rec` counts its recursion once.
    assert_eq!(row("main")[..5], ["89.5%", "5.6%", "8", "main", "g.elf"]);
    assert_eq!(row("leaf")[..3], ["80.4%", "80.4%", "115"]);
    assert_eq!(row("a")[..3], ["55.9%", "0.0%", "0"]);
    assert_eq!(row("b")[..3], ["24.5%", "0.0%", "0"]);
    assert_eq!(row("rec")[..3], ["14.0%", "14.0%", "20"]);
    // Ranked by children: main, leaf, a, b, rec.
    let order: Vec<&str> = rows
        .iter()
        .filter_map(|r| r.get(3).copied())
        .filter(|f| ["main", "leaf", "a", "b", "rec"].contains(f))
        .collect();
    assert_eq!(order, ["main", "leaf", "a", "b", "rec"], "{screen}");

    // Without the flag: the leaves alone (by samples), no children column.
    let flat = top(&[]);
    let functions: Vec<Vec<&str>> = flat
        .lines()
        .map(|l| {
            l.split(|c: char| c == '│' || c.is_whitespace())
                .filter(|w| !w.is_empty())
                .collect()
        })
        .filter(|r: &Vec<&str>| r.get(3).is_some_and(|m| *m == "g.elf"))
        .collect();
    assert_eq!(
        functions,
        [
            ["80.4%", "115", "leaf", "g.elf"],
            ["14.0%", "20", "rec", "g.elf"],
            ["5.6%", "8", "main", "g.elf"]
        ],
        "{flat}"
    );
    assert!(!flat.contains("children"), "{flat}");
}
