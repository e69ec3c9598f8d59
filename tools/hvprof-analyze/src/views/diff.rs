//! `hvprof-analyze diff A B`: two captures' reports side by side, by share. Per VM (matched by
//! name) its OS/user/idle/steal shares (and spinning, with pause-loop exits) and, per process
//! and per function, each capture's samples and share of the VM's samples, and the change in
//! points, B minus A: positive means a larger share of the VM's time in B. Captures of different
//! lengths compare by share; their pCPU counts may differ. The host level compares the
//! hypervisor's, the VMs' and idle's shares, and the hypervisor's functions.
//!
//! A Linux guest's process is matched by its name without the process id (`w41[92]` in A and
//! `w41[95]` in B are both `w41`): two runs of a program rarely keep their pids.

use std::collections::BTreeMap;
use std::io::Write;

use comfy_table::presets::NOTHING;
use comfy_table::{CellAlignment, Table};
use serde::Serialize;

use super::report::{GuestTable, Report, Row};

/// One function (or process) in both captures.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DiffRow {
    pub function: String,
    pub module: String,
    /// The process's name (without its pid), for Linux guests.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<String>,
    pub a_samples: u64,
    pub b_samples: u64,
    /// Shares of the table's samples in A and in B (percent), and B minus A (points).
    pub a_percent: f64,
    pub b_percent: f64,
    pub delta: f64,
}

/// A share in both captures.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Change {
    pub a: f64,
    pub b: f64,
    pub delta: f64,
}

impl Change {
    fn new(a: f64, b: f64) -> Self {
        Change { a, b, delta: b - a }
    }
}

/// One VM in both captures (or in one: its samples in the other are 0).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct VmDiff {
    pub name: String,
    pub a_samples: u64,
    pub b_samples: u64,
    pub os: Change,
    pub user: Change,
    pub idle: Change,
    pub steal: Change,
    /// Spinning, from the pause-loop exits (`ple=`), when either capture has it (0 in one
    /// without).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spinning: Option<Change>,
    /// Per process (Linux guests), sorted by the size of the change.
    pub processes: Vec<DiffRow>,
    /// Per function, sorted by the size of the change.
    pub functions: Vec<DiffRow>,
}

/// The host level in both captures.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct HostDiff {
    pub a_samples: u64,
    pub b_samples: u64,
    pub a_pcpus: u16,
    pub b_pcpus: u16,
    pub hypervisor: Change,
    pub vm: Change,
    pub idle: Change,
    /// The hypervisor's functions (and each VM's line), sorted by the size of the change.
    pub functions: Vec<DiffRow>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Diff {
    /// "B minus A, in points of each table's samples".
    pub sign: &'static str,
    pub host: HostDiff,
    pub vms: Vec<VmDiff>,
}

/// A process name without its `[pid]`.
fn process_name(p: &str) -> &str {
    match p.rsplit_once('[') {
        Some((name, pid)) if pid.ends_with(']') => name,
        _ => p,
    }
}

/// The rows of both tables matched by `key`, with their shares of `a_total` and `b_total`,
/// sorted by the size of the change (then by name, for a stable order).
fn pair(
    a: &[Row],
    b: &[Row],
    a_total: u64,
    b_total: u64,
    key: impl Fn(&Row) -> (String, String, Option<String>),
) -> Vec<DiffRow> {
    let mut m: BTreeMap<(String, String, Option<String>), (u64, u64)> = BTreeMap::new();
    for r in a {
        m.entry(key(r)).or_default().0 += r.samples;
    }
    for r in b {
        m.entry(key(r)).or_default().1 += r.samples;
    }
    let share = |n: u64, total: u64| {
        if total == 0 {
            0.0
        } else {
            100.0 * n as f64 / total as f64
        }
    };
    let mut rows: Vec<DiffRow> = m
        .into_iter()
        .map(|((function, module, process), (na, nb))| {
            let (pa, pb) = (share(na, a_total), share(nb, b_total));
            DiffRow {
                function,
                module,
                process,
                a_samples: na,
                b_samples: nb,
                a_percent: pa,
                b_percent: pb,
                delta: pb - pa,
            }
        })
        .collect();
    rows.sort_by(|x, y| {
        y.delta
            .abs()
            .total_cmp(&x.delta.abs())
            .then_with(|| x.function.cmp(&y.function))
    });
    rows
}

fn vm_diff(name: &str, a: Option<&GuestTable>, b: Option<&GuestTable>) -> VmDiff {
    let empty = GuestTable::default();
    let (ta, tb) = (a.unwrap_or(&empty), b.unwrap_or(&empty));
    let function = |r: &Row| {
        (
            r.function.clone(),
            r.module.clone(),
            r.process.as_deref().map(|p| process_name(p).to_owned()),
        )
    };
    let process = |r: &Row| {
        let p = r.process.as_deref().map(|p| process_name(p).to_owned());
        (p.clone().unwrap_or_default(), String::new(), None)
    };
    let with_process = |rows: &[Row]| -> Vec<Row> {
        rows.iter()
            .filter(|r| r.process.is_some())
            .cloned()
            .collect()
    };
    VmDiff {
        name: name.to_owned(),
        a_samples: ta.samples,
        b_samples: tb.samples,
        os: Change::new(ta.os, tb.os),
        user: Change::new(ta.user, tb.user),
        idle: Change::new(ta.idle, tb.idle),
        steal: Change::new(ta.steal, tb.steal),
        spinning: {
            let spinning = |t: &GuestTable| t.exact.as_ref().and_then(|e| e.spinning);
            match (spinning(ta), spinning(tb)) {
                (None, None) => None,
                (a, b) => Some(Change::new(a.unwrap_or(0.0), b.unwrap_or(0.0))),
            }
        },
        processes: pair(
            &with_process(&ta.rows),
            &with_process(&tb.rows),
            ta.samples,
            tb.samples,
            process,
        ),
        functions: pair(&ta.rows, &tb.rows, ta.samples, tb.samples, function),
    }
}

/// The two reports compared.
pub fn diff(a: &Report, b: &Report) -> Diff {
    let host_total = |r: &Report| r.host.rows.iter().map(|x| x.samples).sum::<u64>();
    let (ha, hb) = (host_total(a), host_total(b));
    let mut names: Vec<&str> = a.vms.iter().map(|v| v.name.as_str()).collect();
    for v in &b.vms {
        if !names.contains(&v.name.as_str()) {
            names.push(&v.name);
        }
    }
    let table = |r: &'_ Report, n: &str| -> Option<GuestTable> {
        r.vms.iter().find(|v| v.name == n).map(|v| v.table.clone())
    };
    Diff {
        sign: "B minus A, in points of each table's samples",
        host: HostDiff {
            a_samples: ha,
            b_samples: hb,
            a_pcpus: a.pcpus,
            b_pcpus: b.pcpus,
            hypervisor: Change::new(a.host.hypervisor, b.host.hypervisor),
            vm: Change::new(a.host.vm, b.host.vm),
            idle: Change::new(a.host.idle, b.host.idle),
            functions: pair(&a.host.rows, &b.host.rows, ha, hb, |r| {
                (r.function.clone(), r.module.clone(), None)
            }),
        },
        vms: names
            .into_iter()
            .map(|n| vm_diff(n, table(a, n).as_ref(), table(b, n).as_ref()))
            .collect(),
    }
}

fn change(c: &Change) -> String {
    format!("{:.2}% -> {:.2}% ({:+.2})", c.a, c.b, c.delta)
}

/// What a table of rows shows after the figures.
#[derive(Clone, Copy, PartialEq)]
enum Columns {
    /// Function and module.
    Functions,
    /// Function, module and process.
    FunctionsOfProcesses,
    /// The process alone.
    Processes,
}

fn rows_table(
    out: &mut dyn Write,
    rows: &[DiffRow],
    top: usize,
    columns: Columns,
) -> std::io::Result<()> {
    let mut t = Table::new();
    t.load_preset(NOTHING);
    let mut header = vec!["A %", "B %", "Delta", "A samples", "B samples"];
    header.extend(match columns {
        Columns::Functions => &["Function", "Module"][..],
        Columns::FunctionsOfProcesses => &["Function", "Module", "Process"][..],
        Columns::Processes => &["Process"][..],
    });
    t.set_header(header);
    let text = |s: &str| crate::naming::escape::printable(s).into_owned();
    for r in rows.iter().take(top) {
        let mut cells = vec![
            format!("{:.2}", r.a_percent),
            format!("{:.2}", r.b_percent),
            format!("{:+.2}", r.delta),
            r.a_samples.to_string(),
            r.b_samples.to_string(),
            text(&r.function),
        ];
        if columns != Columns::Processes {
            cells.push(text(&r.module));
        }
        if columns == Columns::FunctionsOfProcesses {
            cells.push(text(r.process.as_deref().unwrap_or("")));
        }
        t.add_row(cells);
    }
    for i in 0..5 {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    writeln!(out, "{t}")?;
    if rows.len() > top {
        writeln!(out, "  ... {} more rows (--top)", rows.len() - top)?;
    }
    Ok(())
}

/// The comparison as text: the host level, then each VM, `top` rows per table.
pub fn write_text(out: &mut dyn Write, d: &Diff, top: usize) -> std::io::Result<()> {
    writeln!(out, "Delta: {} (positive: a larger share in B)", d.sign)?;
    let h = &d.host;
    writeln!(
        out,
        "\nHost level: {} samples on {} pCPU(s) in A, {} on {} in B",
        h.a_samples, h.a_pcpus, h.b_samples, h.b_pcpus
    )?;
    writeln!(
        out,
        "HYPERVISOR {}   VM {}   IDLE {}",
        change(&h.hypervisor),
        change(&h.vm),
        change(&h.idle)
    )?;
    rows_table(out, &h.functions, top, Columns::Functions)?;
    for v in &d.vms {
        writeln!(
            out,
            "\nGuest level: VM {}: {} samples in A, {} in B",
            crate::naming::escape::printable(&v.name),
            v.a_samples,
            v.b_samples
        )?;
        writeln!(
            out,
            "OS {}   USER {}   IDLE {}   steal {}",
            change(&v.os),
            change(&v.user),
            change(&v.idle),
            change(&v.steal)
        )?;
        if let Some(s) = &v.spinning {
            writeln!(out, "spinning (pause-loop exits) {}", change(s))?;
        }
        if !v.processes.is_empty() {
            writeln!(out, "Processes:")?;
            rows_table(out, &v.processes, top, Columns::Processes)?;
            writeln!(out, "Functions:")?;
        }
        let columns = if v.processes.is_empty() {
            Columns::Functions
        } else {
            Columns::FunctionsOfProcesses
        };
        rows_table(out, &v.functions, top, columns)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(function: &str, process: Option<&str>, samples: u64) -> Row {
        Row {
            function: function.to_owned(),
            module: "m".to_owned(),
            process: process.map(str::to_owned),
            samples,
            percent: 0.0,
        }
    }

    #[test]
    fn rows_pair_by_share_sorted_by_the_change() {
        let a = [row("f", None, 50), row("g", None, 50)];
        let b = [
            row("f", None, 300),
            row("g", None, 100),
            row("h", None, 100),
        ];
        let d = pair(&a, &b, 100, 500, |r| {
            (r.function.clone(), r.module.clone(), None)
        });
        let names: Vec<&str> = d.iter().map(|r| r.function.as_str()).collect();
        // g: 50 -> 20 (-30); h: 0 -> 20 (+20); f: 50 -> 60 (+10).
        assert_eq!(names, ["g", "h", "f"]);
        assert!((d[0].delta + 30.0).abs() < 1e-9);
        assert_eq!((d[1].a_samples, d[1].b_samples), (0, 100));
        assert!((d[2].b_percent - 60.0).abs() < 1e-9);
    }

    #[test]
    fn processes_match_without_their_pids() {
        let t = |rows: Vec<Row>, samples| GuestTable {
            samples,
            rows,
            ..GuestTable::default()
        };
        let a = t(
            vec![
                row("work", Some("w41[92]"), 80),
                row("k", Some("sh[90]"), 20),
            ],
            100,
        );
        let b = t(
            vec![
                row("work", Some("w41[95]"), 40),
                row("k", Some("sh[91]"), 60),
            ],
            100,
        );
        let v = vm_diff("linux", Some(&a), Some(&b));
        assert_eq!(v.functions.len(), 2);
        assert_eq!(v.functions[0].process.as_deref(), Some("sh"));
        assert!((v.functions[0].delta - 40.0).abs() < 1e-9);
        let w41 = v.processes.iter().find(|p| p.function == "w41").unwrap();
        assert!((w41.delta + 40.0).abs() < 1e-9);
        // A VM only one capture has.
        let only = vm_diff("new", None, Some(&b));
        assert_eq!(only.a_samples, 0);
        assert!(
            only.functions
                .iter()
                .all(|r| r.a_samples == 0 && r.delta > 0.0)
        );
    }

    #[test]
    fn pids_are_cut_only_where_they_are() {
        assert_eq!(process_name("w41[92]"), "w41");
        assert_eq!(process_name("kworker/u2:1[24]"), "kworker/u2:1");
        assert_eq!(process_name("plain"), "plain");
        assert_eq!(process_name("odd[x"), "odd[x");
    }
}
