//! The views and export formats of real captures (end-to-end scenarios kept in `tests/data`,
//! with symbol-only copies of the ELF files that made them), through the command line users run:
//! every format holds every sample the report counts, and each parses as its readers parse it.
//!
//! - `script`: inferno's perf collapser (the Rust port of FlameGraph's stackcollapse-perf.pl)
//!   folds it with no sample lost, stacks rooted at the VM, guest kernel frames marked kernel,
//!   one tid per VM and vCPU, no negative pid;
//! - `export --pprof`: decodes as profile.proto, totals equal the report's, per VM too;
//! - `export --firefox`: the processed-profile structure holds (tables, indexes), one process
//!   per VM and one thread per vCPU, totals equal the report's;
//! - `timeline`: the SVG parses and holds one bar series per state, bar for bar;
//! - `flamegraph`: the SVG parses and its root counts every sample.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use hvprof_analyze::model::profile::{LoadOptions, Profile};
use hvprof_analyze::model::progress::Progress;
use hvprof_analyze::naming::symbols::Images;
use hvprof_analyze::naming::symbols::Symbols;
use hvprof_analyze::views::chart::Timeline;
use serde_json::Value;

use crate::data;

/// A fixture capture and the symbol files for it.
struct Capture {
    log: &'static str,
    hypervisor: &'static str,
    image: &'static str,
}

const CAPTURES: [Capture; 4] = [
    // Three VMs on one pCPU (the demo's setup, the paper's Tables 12/13).
    Capture {
        log: "sched-3vms-1pcpu.log",
        hypervisor: "hvprof-3a995a71.sym",
        image: "mix.elf",
    },
    // One VM, two vCPUs on one pCPU (Tables 8/9).
    Capture {
        log: "sched-2vcpus-1pcpu.log",
        hypervisor: "hvprof-3a995a71.sym",
        image: "mix.elf",
    },
    // Busy a third of the time, then halted (Tables 14/15): idle samples.
    Capture {
        log: "sched-halt.log",
        hypervisor: "hvprof-3a995a71.sym",
        image: "mix.elf",
    },
    // CPUID, I/O and VMCALL exits: the hypervisor at work.
    Capture {
        log: "vm-exit-stats.log",
        hypervisor: "hvprof-401c55b7.sym",
        image: "busy.elf",
    },
];

impl Capture {
    fn args(&self) -> Vec<String> {
        vec![
            data(self.log).display().to_string(),
            "--hypervisor".into(),
            data(self.hypervisor).display().to_string(),
            "--image".into(),
            data(self.image).display().to_string(),
        ]
    }

    fn profile(&self) -> Profile {
        let images = Images {
            hypervisor: Some(Symbols::load(&data(self.hypervisor)).unwrap()),
            guests: vec![Symbols::load(&data(self.image)).unwrap()],
            kernel: None,
            guest_root: None,
        };
        Profile::load(
            &data(self.log),
            &images,
            LoadOptions::all(2),
            &Progress::hidden(),
        )
        .unwrap()
    }
}

/// Runs the analyzer on `capture`; its standard output.
fn analyze(cmd: &str, capture: &Capture, extra: &[&str]) -> Vec<u8> {
    let mut args = vec![cmd.to_owned()];
    args.extend(capture.args());
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    succeed(&args)
}

/// Runs the analyzer with `args`, which must succeed; its standard output.
fn succeed<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Vec<u8> {
    let out = Command::new(env!("CARGO_BIN_EXE_hvprof-analyze"))
        .args(args)
        .output()
        .expect("run hvprof-analyze");
    assert!(
        out.status.success(),
        "hvprof-analyze {}: {}",
        args.iter()
            .map(|a| a.as_ref().to_string_lossy())
            .collect::<Vec<_>>()
            .join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn report(c: &Capture) -> Value {
    serde_json::from_slice(&analyze("report", c, &["--json"])).unwrap()
}

fn total(report: &Value) -> u64 {
    report["total_samples"].as_u64().unwrap()
}

/// Host-level samples of a row (`[guestOS1]`, `[idle]`).
fn host_row(report: &Value, function: &str) -> u64 {
    report["host"]["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["function"] == function)
        .map(|r| r["samples"].as_u64().unwrap())
        .sum()
}

fn tmp(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hvprof-analyze");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn script_collapses_in_inferno_with_no_sample_lost() {
    use inferno::collapse::Collapse;
    use inferno::collapse::perf::{Folder, Options};
    for c in &CAPTURES {
        let r = report(c);
        let text = analyze("script", c, &[]);
        // Event lines: a tid belongs to one comm and one pid; no pid is negative.
        let s = String::from_utf8(text.clone()).unwrap();
        let mut tids: HashMap<String, (String, String)> = HashMap::new();
        let mut events = 0u64;
        for block in s.split("\n\n").filter(|b| !b.is_empty()) {
            events += 1;
            let head = block.lines().next().unwrap();
            let mut words = head.split_whitespace();
            let comm = words.next().unwrap().to_owned();
            let (pid, tid) = words.next().unwrap().split_once('/').unwrap();
            assert!(
                pid.parse::<u32>().is_ok() && tid.parse::<u32>().is_ok(),
                "{head}"
            );
            let prev = tids.insert(tid.to_owned(), (comm.clone(), pid.to_owned()));
            assert!(
                prev.is_none_or(|p| p == (comm, pid.to_owned())),
                "tid {tid} of two threads: {head}"
            );
            assert!(head.ends_with(": cpu-clock:"), "{head}");
        }
        assert_eq!(events, total(&r), "{}: one event per sample", c.log);

        // inferno, as `inferno-collapse-perf` runs it.
        let mut folded = Vec::new();
        Folder::from(Options::default())
            .collapse(text.as_slice(), &mut folded)
            .unwrap();
        let folded = String::from_utf8(folded).unwrap();
        let mut sum = 0u64;
        let mut per_root: HashMap<String, u64> = HashMap::new();
        for line in folded.lines() {
            let (stack, n) = line.rsplit_once(' ').unwrap();
            let n: u64 = n.parse().unwrap();
            sum += n;
            *per_root
                .entry(stack.split(';').next().unwrap().to_owned())
                .or_default() += n;
        }
        assert_eq!(sum, total(&r), "{}: samples lost in the collapse", c.log);
        // Rooted at the VM: each VM's guest samples, as the host-level table counts them.
        for vm in r["vms"].as_array().unwrap() {
            let name = vm["name"].as_str().unwrap();
            assert_eq!(
                per_root.get(name).copied().unwrap_or(0),
                host_row(&r, &format!("[{name}]")),
                "{}: VM {name}",
                c.log
            );
        }
        assert_eq!(
            per_root.get("[idle]").copied().unwrap_or(0),
            host_row(&r, "[idle]")
        );

        // Kernel annotation: the test guests run in ring 0, so every guest frame is kernel.
        let mut folded = Vec::new();
        let mut opts = Options::default();
        opts.annotate_kernel = true;
        Folder::from(opts)
            .collapse(text.as_slice(), &mut folded)
            .unwrap();
        let folded = String::from_utf8(folded).unwrap();
        let vm_names: HashSet<&str> = r["vms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].as_str().unwrap())
            .collect();
        let mut guest_lines = 0;
        for line in folded.lines() {
            let (stack, _) = line.rsplit_once(' ').unwrap();
            let frames: Vec<&str> = stack.split(';').collect();
            if vm_names.contains(frames[0]) {
                guest_lines += 1;
                assert!(
                    frames.last().unwrap().ends_with("_[k]"),
                    "guest kernel frame not marked kernel: {line}"
                );
                assert!(frames[1].starts_with("cr3:0x"), "process frame: {line}");
            }
        }
        assert!(guest_lines > 0, "{}", c.log);
    }
}

#[test]
fn pprof_decodes_and_its_totals_equal_the_report() {
    for c in &CAPTURES {
        let r = report(c);
        let path = tmp(&format!("{}.pb.gz", c.log));
        analyze("export", c, &["--pprof", path.to_str().unwrap()]);
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..2], &[0x1f, 0x8b], "gzipped");
        let p = hvprof_analyze::views::pprof::read(&bytes).unwrap();
        let s = |i: i64| p.string_table[i as usize].as_str();
        assert_eq!(s(0), "");
        let types: Vec<(&str, &str)> = p
            .sample_type
            .iter()
            .map(|t| (s(t.r#type), s(t.unit)))
            .collect();
        assert_eq!(types, [("samples", "count"), ("cpu", "nanoseconds")]);
        let samples: i64 = p.sample.iter().map(|x| x.value[0]).sum();
        assert_eq!(samples as u64, total(&r), "{}", c.log);
        let period = p.period;
        assert!(period > 0);
        let ns: i64 = p.sample.iter().map(|x| x.value[1]).sum();
        assert_eq!(ns, samples * period);
        // Every location and function referenced exists.
        let locs: HashSet<u64> = p.location.iter().map(|l| l.id).collect();
        let funcs: HashSet<u64> = p.function.iter().map(|f| f.id).collect();
        for l in &p.location {
            assert!(l.line.iter().all(|x| funcs.contains(&x.function_id)));
        }
        // Labels: the guest samples of each VM (root frame the VM, labels vm and process).
        // A guest sample's stack ends with its process's frame, then its VM's: the names its
        // labels give.
        let function_name: HashMap<u64, &str> =
            p.function.iter().map(|f| (f.id, s(f.name))).collect();
        let location_name: HashMap<u64, &str> = p
            .location
            .iter()
            .map(|l| (l.id, function_name[&l.line[0].function_id]))
            .collect();
        let mut per_vm: HashMap<String, i64> = HashMap::new();
        for x in &p.sample {
            assert!(x.location_id.iter().all(|id| locs.contains(id)));
            let label = |k: &str| x.label.iter().find(|l| s(l.key) == k);
            if let (Some(vm), Some(process), Some(cr3)) =
                (label("vm"), label("process"), label("cr3"))
            {
                assert!(label("vcpu").is_some());
                assert!(cr3.num > 0);
                *per_vm.entry(s(vm.str).to_owned()).or_default() += x.value[0];
                let outer: Vec<&str> = x.location_id[x.location_id.len() - 2..]
                    .iter()
                    .map(|id| location_name[id])
                    .collect();
                assert_eq!(outer, [s(process.str), s(vm.str)], "{}", c.log);
            }
        }
        for vm in r["vms"].as_array().unwrap() {
            let name = vm["name"].as_str().unwrap();
            assert_eq!(
                per_vm.get(name).copied().unwrap_or(0) as u64,
                host_row(&r, &format!("[{name}]")),
                "{}: VM {name}",
                c.log
            );
        }
    }
}

#[test]
fn firefox_profile_is_well_formed() {
    for c in &CAPTURES {
        let r = report(c);
        let path = tmp(&format!("{}.firefox.json", c.log));
        analyze("export", c, &["--firefox", path.to_str().unwrap()]);
        let v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let meta = &v["meta"];
        assert!(meta["version"].as_u64().unwrap() >= 24);
        assert!(meta["preprocessedProfileVersion"].as_u64().is_some());
        assert!(meta["interval"].as_f64().unwrap() > 0.0);
        let categories = meta["categories"].as_array().unwrap();
        let names: Vec<&str> = categories
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        for want in ["Guest kernel", "Hypervisor", "Scheduling"] {
            assert!(names.contains(&want), "{names:?}");
        }
        let threads = v["threads"].as_array().unwrap();
        let mut samples = 0u64;
        let mut tids = HashSet::new();
        let mut vcpu_threads = 0;
        for t in threads {
            let len = |table: &Value| table["length"].as_u64().unwrap() as usize;
            let col = |table: &Value, key: &str| table[key].as_array().unwrap().clone();
            assert!(tids.insert(t["tid"].to_string()), "tid twice");
            let (st, fr, fu) = (&t["stackTable"], &t["frameTable"], &t["funcTable"]);
            let strings = t["stringArray"].as_array().unwrap().len();
            let s = &t["samples"];
            assert_eq!(col(s, "stack").len(), len(s));
            assert_eq!(col(s, "timeDeltas").len(), len(s));
            for x in col(s, "stack") {
                assert!(x.as_u64().unwrap() < len(st) as u64);
            }
            for (i, (prefix, frame)) in col(st, "prefix").iter().zip(col(st, "frame")).enumerate() {
                assert!(prefix.is_null() || (prefix.as_u64().unwrap() as usize) < i);
                assert!((frame.as_u64().unwrap() as usize) < len(fr));
            }
            for (func, cat) in col(fr, "func").iter().zip(col(fr, "category")) {
                assert!((func.as_u64().unwrap() as usize) < len(fu));
                assert!((cat.as_u64().unwrap() as usize) < categories.len());
            }
            for name in col(fu, "name") {
                assert!((name.as_u64().unwrap() as usize) < strings);
            }
            let weights = col(s, "weight");
            samples += if weights.is_empty() {
                len(s) as u64
            } else {
                weights.iter().map(|w| w.as_u64().unwrap()).sum()
            };
            if t["processName"].as_str().unwrap().starts_with("VM ") {
                vcpu_threads += 1;
                // The scheduling markers: when it ran and why it did not.
                assert!(len(&t["markers"]) > 0, "no markers on {}", t["name"]);
            }
        }
        assert_eq!(samples, total(&r), "{}", c.log);
        let vcpus: usize = r["vms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["vcpus"].as_array().unwrap().len())
            .sum();
        assert_eq!(vcpu_threads, vcpus, "{}: one thread per vCPU", c.log);
    }
}

/// Rectangles by fill color (upper case).
fn rects_by_fill(doc: &roxmltree::Document) -> HashMap<String, usize> {
    let mut out = HashMap::new();
    for n in doc.descendants().filter(|n| n.has_tag_name("rect")) {
        if let Some(f) = n.attribute("fill") {
            *out.entry(f.to_uppercase()).or_default() += 1;
        }
    }
    out
}

#[test]
fn timeline_svg_holds_one_bar_series_per_state() {
    for c in &CAPTURES {
        let svg = String::from_utf8(analyze("timeline", c, &[])).unwrap();
        let doc = roxmltree::Document::parse(&svg).unwrap();
        let texts: HashSet<String> = doc
            .descendants()
            .filter(|n| n.has_tag_name("text"))
            .filter_map(|n| n.text().map(|t| t.trim().to_owned()))
            .collect();
        let fills = rects_by_fill(&doc);
        let t = Timeline::build(&c.profile(), 120).unwrap();
        let bars = t.bars_per_state();
        assert!(t.states.len() >= 3, "{}: {:?}", c.log, t.states);
        let mut colors = HashSet::new();
        for (state, color) in &t.states {
            let hex = format!("#{:02X}{:02X}{:02X}", color.0, color.1, color.2);
            assert!(colors.insert(hex.clone()), "two states share {hex}");
            assert!(
                texts.contains(&t.label(*state)),
                "{}: no legend for {}",
                c.log,
                t.label(*state)
            );
            // Its bars, and its legend swatch.
            assert_eq!(
                fills.get(&hex).copied().unwrap_or(0),
                bars[state] + 1,
                "{}: series {}",
                c.log,
                state.label()
            );
        }
        // One row per pCPU and per vCPU.
        for row in &t.rows {
            assert!(texts.contains(&row.label), "{}: row {}", c.log, row.label);
        }
        let p = c.profile();
        assert_eq!(t.rows.len(), p.pcpu_list().len() + p.vcpus().len());
    }
}

#[test]
fn timeline_states_match_the_report() {
    // Three VMs on one pCPU: a vCPU row's steal is the report's [steal] (outside), its
    // hypervisor segments the report's [steal] (hypervisor) (the scheduler's too).
    let c = &CAPTURES[0];
    let r = report(c);
    let t = Timeline::build(&c.profile(), 50).unwrap();
    for vm in r["vms"].as_array().unwrap() {
        let name = vm["name"].as_str().unwrap();
        let row = t
            .rows
            .iter()
            .find(|x| x.label == format!("{name} vCPU 0"))
            .unwrap();
        let mut by: HashMap<String, u64> = HashMap::new();
        for b in &row.bins {
            for (s, n) in b {
                *by.entry(s.label()).or_default() += n;
            }
        }
        let rows = vm["rows"].as_array().unwrap();
        let steal = |m: &str| -> u64 {
            rows.iter()
                .filter(|x| x["function"] == "[steal]" && x["module"] == m)
                .map(|x| x["samples"].as_u64().unwrap())
                .sum()
        };
        assert_eq!(by.get("steal").copied().unwrap_or(0), steal("(outside)"));
        let hyper: u64 = by
            .iter()
            .filter(|(k, _)| k.starts_with("hypervisor"))
            .map(|(_, n)| n)
            .sum();
        assert_eq!(hyper, steal("(hypervisor)"), "{name}");
        let total: u64 = by.values().sum();
        assert_eq!(total, vm["samples"].as_u64().unwrap(), "{name}");
    }
}

#[test]
fn flamegraph_svg_parses_and_counts_every_sample() {
    for c in &CAPTURES {
        let r = report(c);
        let svg = String::from_utf8(analyze("flamegraph", c, &[])).unwrap();
        // inferno writes the SVG 1.1 doctype.
        let doc = roxmltree::Document::parse_with_options(
            &svg,
            roxmltree::ParsingOptions {
                allow_dtd: true,
                ..roxmltree::ParsingOptions::default()
            },
        )
        .unwrap();
        let titles: Vec<String> = doc
            .descendants()
            .filter(|n| n.has_tag_name("title"))
            .filter_map(|n| n.text().map(str::to_owned))
            .collect();
        let all = titles
            .iter()
            .find(|t| t.starts_with("all ("))
            .expect("the root frame");
        let n: u64 = all["all (".len()..]
            .split(' ')
            .next()
            .unwrap()
            .replace(',', "")
            .parse()
            .unwrap();
        assert_eq!(n, total(&r), "{}", c.log);
        // The VM frames are there with their samples.
        for vm in r["vms"].as_array().unwrap() {
            let name = vm["name"].as_str().unwrap();
            let want = host_row(&r, &format!("[{name}]"));
            if want == 0 {
                continue;
            }
            let prefix = format!("{name} (");
            let t = titles.iter().find(|t| t.starts_with(&prefix)).unwrap();
            let got: u64 = t[prefix.len()..]
                .split(' ')
                .next()
                .unwrap()
                .replace(',', "")
                .parse()
                .unwrap();
            assert_eq!(got, want, "{}: {name}", c.log);
        }
    }
}

#[test]
fn stat_reads_the_exact_tables_and_estimates_from_samples() {
    let c = &CAPTURES[3];
    let v: Value = serde_json::from_slice(&analyze("stat", c, &["--json"])).unwrap();
    let vm = &v["vms"][0];
    assert_eq!(vm["name"], "busy");
    let exact = vm["exact"]["reasons"].as_array().unwrap();
    let reasons: HashSet<&str> = exact
        .iter()
        .map(|r| r["reason"].as_str().unwrap())
        .collect();
    for want in ["CPUID", "IO_INSTRUCTION", "VMCALL"] {
        assert!(reasons.contains(want), "{reasons:?}");
    }
    // From the VM end frame, exactly as the guest made them (`busy cpuid=1000 vmcall=200`),
    // with the handler-cost histogram holding every exit and its median bucket within min..max.
    let row = |name: &str| exact.iter().find(|r| r["reason"] == name).unwrap();
    assert_eq!(row("CPUID")["count"], 1000);
    assert_eq!(row("VMCALL")["count"], 200);
    for r in exact {
        let n: u64 = r["histogram"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["count"].as_u64().unwrap())
            .sum();
        assert_eq!(n, r["count"].as_u64().unwrap(), "{r}");
        let median = &r["median_bucket"];
        assert!(median["from_ticks"].as_u64().unwrap() <= r["max_ticks"].as_u64().unwrap());
    }
    // The exact shares add up; the estimate counts the hypervisor's samples on the VM's exits.
    let share: f64 = exact
        .iter()
        .map(|r| r["count_percent"].as_f64().unwrap())
        .sum();
    assert!((share - 100.0).abs() < 1e-6);
    let est = &vm["estimated"];
    let by_reason: u64 = est["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["samples"].as_u64().unwrap())
        .sum();
    assert_eq!(by_reason, est["hypervisor_samples"].as_u64().unwrap());
    let cpuid = est["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["reason"] == "CPUID")
        .unwrap();
    assert!(cpuid["per_exit_ticks"].as_f64().unwrap() > 0.0);
    // The text says which figures are exact and which are estimates.
    let text = String::from_utf8(analyze("stat", c, &[])).unwrap();
    assert!(text.contains("Exact, from the hypervisor's exit table"));
    assert!(text.contains("Estimated, from the samples"));
}

#[test]
fn bad_input_gets_a_clear_error() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_hvprof-analyze"))
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let junk = tmp("junk.log");
    std::fs::write(&junk, b"hello, this is not a capture\n").unwrap();
    let junk = junk.to_str().unwrap();
    for cmd in ["report", "timeline", "flamegraph", "stat", "script", "html"] {
        let e = run(&[cmd, junk]);
        assert!(e.contains("no hvprof frame in this file"), "{cmd}: {e}");
    }
    // A capture whose frames hold no sample (here its header alone): the report says what
    // there is; the views, which draw samples, say there are none.
    let header_only = tmp("header-only.log");
    let mut frame = vec![0u8; hvprof_samplelog::MAX_HEADER_FRAME_LEN];
    let n =
        hvprof_samplelog::encode_header(&hvprof_samplelog::Header::default(), &mut frame).unwrap();
    std::fs::write(&header_only, &frame[..n]).unwrap();
    let header_only = header_only.to_str().unwrap();
    let out = succeed(&["report", header_only]);
    assert!(String::from_utf8_lossy(&out).contains("Total samples: 0"));
    for cmd in ["timeline", "flamegraph", "stat", "script", "html"] {
        let e = run(&[cmd, header_only]);
        assert!(e.contains("no samples in this capture"), "{cmd}: {e}");
    }
    let e = run(&["script", "/nonexistent/serial.log"]);
    assert!(e.contains("cannot read /nonexistent/serial.log"), "{e}");
    let log = data("sched-halt.log");
    let e = run(&["export", log.to_str().unwrap()]);
    assert!(e.contains("--pprof FILE and/or --firefox FILE"), "{e}");
    let e = run(&["timeline", log.to_str().unwrap(), "--bins", "0"]);
    assert!(e.contains("--bins"), "{e}");
    // A VM the capture does not have is named, with those it has.
    let e = run(&["report", log.to_str().unwrap(), "--vm", "nosuchvm"]);
    assert!(
        e.contains("--vm nosuchvm: no VM of that name") && e.contains("(its VMs: "),
        "{e}"
    );
    // A stretch of time with no sample says where the capture's samples are, not that the
    // file is no capture.
    for cmd in ["timeline", "script", "flamegraph"] {
        let e = run(&[cmd, log.to_str().unwrap(), "--time", "100000,"]);
        assert!(
            e.contains("--time 100000,: no samples in this stretch; the capture's run from"),
            "{cmd}: {e}"
        );
    }
    let e = run(&[
        "flamegraph",
        log.to_str().unwrap(),
        "-o",
        "/nonexistent/dir/f.svg",
    ]);
    assert!(e.contains("cannot create /nonexistent/dir/f.svg"), "{e}");
    // The exports' files are created while the export is computed: the path still says why.
    for flag in ["--pprof", "--firefox"] {
        let e = run(&["export", log.to_str().unwrap(), flag, "/nonexistent/dir/f"]);
        assert!(
            e.contains("cannot create /nonexistent/dir/f"),
            "{flag}: {e}"
        );
    }
}

/// `export --pprof` encodes the samples as they are made: the file holds the encoding of the
/// whole profile `pprof::build` makes.
#[test]
fn pprof_file_is_the_whole_profile_encoded() {
    use prost::Message;
    for c in &CAPTURES {
        let p = c.profile();
        let mut written = Vec::new();
        hvprof_analyze::views::pprof::write(&p, &mut written, &Progress::hidden()).unwrap();
        let mut raw = Vec::new();
        std::io::Read::read_to_end(
            &mut flate2::read::GzDecoder::new(written.as_slice()),
            &mut raw,
        )
        .unwrap();
        let whole = hvprof_analyze::views::pprof::build(&p, &Progress::hidden()).encode_to_vec();
        assert!(raw == whole, "{}: the pprof profile differs", c.log);
    }
}
