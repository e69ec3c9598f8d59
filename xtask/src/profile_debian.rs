//! The part of `cargo xtask test`'s `xtask-profile` stage that profiles programs from Debian
//! packages the project does not build (`cargo xtask profile --deb`), each compared with
//! callgrind's instruction counts of the same binary on the same input on the host: in Bochs a
//! TSC tick is an instruction, so each function's share of the program's user-mode samples is
//! its share of the instructions the program ran.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Output};

use anyhow::{Context, Result, bail};

use crate::linux::output;
use crate::profile::{report_json, report_rows, row_text};

/// A Debian program the stage profiles.
pub struct DebianProgram {
    pub package: &'static str,
    /// Its command line, in the guest and under callgrind.
    pub command: &'static [&'static str],
    /// Its process name in the guest.
    pub comm: &'static str,
    /// What its output must hold (the answer its input has by construction).
    pub prints: &'static str,
}

/// The run's folder name under the stage's folder.
pub const OUT: &str = "run-debian";

/// Environment for every program, in the guest and under callgrind.
const ENV: &[(&str, &str)] = &[("PYTHONHASHSEED", "0"), ("LC_ALL", "C")];

/// Python 3.11's interpreter (`_PyEval_EvalFrameDefault` and the integer operations are
/// exported: the interpreter is linked with `-export-dynamic`) on a loop of integer arithmetic,
/// without `site` (-S) or bytecode files (-B); and Perl's (`Perl_runops_standard`, `Perl_pp_*`).
/// sum(i*i % 7 for i < 300000) = 599998 and sum(i*i % 7 for 1 <= i <= 400000) = 800002. Both
/// run in one guest, one after the other: one boot, and each compared by its own process.
pub const PROGRAMS: [DebianProgram; 2] = [
    DebianProgram {
        package: "python3.11-minimal",
        command: &[
            "python3.11",
            "-S",
            "-B",
            "-c",
            "def f(n):\n    s = 0\n    for i in range(n):\n        s += i * i % 7\n    return s\nprint(f(300000))\n",
        ],
        comm: "python3.11",
        prints: "599998",
    },
    DebianProgram {
        package: "perl-base",
        command: &[
            "perl",
            "-e",
            "my $s = 0; for my $i (1 .. 400000) { $s += $i * $i % 7 } print \"$s\\n\";",
        ],
        comm: "perl",
        prints: "800002",
    },
];

/// `word` quoted for the shell: as is when it holds only characters the shell leaves alone,
/// else in single quotes (a single quote inside written as `'\''`).
fn sh_quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+%@".contains(&b));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

/// The guest's shell command that runs every program of `programs` in turn, stopping at the
/// first that fails.
fn script(programs: &[DebianProgram]) -> String {
    programs
        .iter()
        .map(|p| {
            p.command
                .iter()
                .map(|w| sh_quote(w))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join(" && ")
}

/// The `cargo xtask profile` command that runs [`PROGRAMS`], its output in `dir/OUT`.
pub fn command(xtask: &Path, dir: &Path) -> Command {
    let mut c = Command::new(xtask);
    c.arg("profile").arg("--out").arg(dir.join(OUT));
    for p in &PROGRAMS {
        c.arg("--deb").arg(p.package);
    }
    for (k, v) in ENV {
        c.arg("--env").arg(format!("{k}={v}"));
    }
    c.args(["--", "sh", "-c", &script(&PROGRAMS)]);
    c.stdin(std::process::Stdio::null());
    c
}

/// callgrind on the host, on the run's own guest root's binary and libraries, started.
fn callgrind(dir: &Path, r: &DebianProgram) -> Result<(Child, std::path::PathBuf)> {
    let run = dir.join(OUT);
    let root = run.join("root");
    let exe = root.join("usr/bin").join(r.command[0]);
    let out = run.join(format!("callgrind-{}.out", r.comm));
    let libs = format!(
        "{}:{}",
        root.join("lib/x86_64-linux-gnu").display(),
        root.join("usr/lib/x86_64-linux-gnu").display()
    );
    let mut c = Command::new("valgrind");
    c.arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(&exe)
        .args(&r.command[1..])
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("LD_LIBRARY_PATH", libs)
        .envs(ENV.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    println!("profile check: {OUT}: {c:?}");
    let child = c
        .spawn()
        .context("cannot run valgrind (Debian's valgrind package)")?;
    Ok((child, out))
}

/// A function's share of a program, keyed by name; code outside every symbol of a file by
/// where it starts, `[unknown] FILE+0xADDR`.
pub(crate) type Shares = BTreeMap<String, f64>;

/// `callgrind_annotate` rows `1,234 (12.34%)  ???:function [/path/object]`: each function's
/// share of the program's instructions.
pub(crate) fn callgrind_shares(text: &str) -> Shares {
    let mut shares = Shares::new();
    for line in text.lines() {
        let Some((_, rest)) = line.split_once('(') else {
            continue;
        };
        let Some((share, what)) = rest.split_once("%)") else {
            continue;
        };
        let Ok(share) = share.trim().parse::<f64>() else {
            continue;
        };
        let what = what.trim();
        let (func, object) = match what.rsplit_once(" [") {
            Some((f, o)) => (f, o.trim_end_matches(']')),
            None => (what, ""),
        };
        if func == "PROGRAM TOTALS" || func.starts_with("PROGRAM") {
            continue;
        }
        let func = func.rsplit_once(':').map_or(func, |(_, f)| f);
        let file = object.rsplit('/').next().unwrap_or(object);
        // callgrind names code outside every symbol by its first address in the file, as the
        // analyzer does (`[unknown] FILE+0xADDR`).
        let key = match func
            .strip_prefix("0x")
            .and_then(|hex| u64::from_str_radix(hex, 16).ok())
        {
            Some(addr) => format!("[unknown] {file}+{addr:#x}"),
            None => func.to_owned(),
        };
        *shares.entry(key).or_default() += share;
    }
    shares
}

/// The report's rows of process `comm` in user mode: each function's share of its user-mode
/// samples, and the samples.
pub(crate) fn report_shares(report: &serde_json::Value, comm: &str) -> Result<(Shares, f64)> {
    let rows = report_rows(report, "linux")?;
    let text = row_text;
    let prefix = format!("{comm}[");
    let mut counts = Shares::new();
    for r in rows {
        let module = text(r, "module");
        if !text(r, "process").starts_with(&prefix)
            || module.starts_with('[')
            || module.starts_with('(')
        {
            continue;
        }
        let key = text(r, "function");
        *counts.entry(key).or_default() += r.get("samples").and_then(|s| s.as_f64()).unwrap_or(0.0);
    }
    let total: f64 = counts.values().sum();
    if total < 1000.0 {
        bail!("only {total} user-mode samples of {comm}");
    }
    Ok((
        counts
            .into_iter()
            .map(|(k, n)| (k, 100.0 * n / total))
            .collect(),
        total,
    ))
}

/// Every function of at least `floor` % on either side, and the points between the two.
pub(crate) fn compare(ours: &Shares, theirs: &Shares, floor: f64) -> Vec<(String, f64, f64)> {
    let mut names: Vec<&String> = ours
        .iter()
        .chain(theirs.iter())
        .filter(|(_, s)| **s >= floor)
        .map(|(n, _)| n)
        .collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .map(|n| {
            (
                n.clone(),
                ours.get(n).copied().unwrap_or(0.0),
                theirs.get(n).copied().unwrap_or(0.0),
            )
        })
        .collect()
}

/// Checks the finished run of [`PROGRAMS`]: status 0, each program's expected output, and for
/// each, every function of ≥ 5 % within 2 points of callgrind's share.
pub fn check(dir: &Path, out: &Output) -> Vec<String> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let missing: Vec<&str> = PROGRAMS
        .iter()
        .map(|p| p.prints)
        .filter(|want| !stdout.contains(want))
        .collect();
    if out.status.code() != Some(0) || !missing.is_empty() {
        return vec![format!(
            "{OUT}: status {:?} (want 0), stdout {:?} (missing {missing:?}); stderr: {}",
            out.status.code(),
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .filter(|l| l.starts_with("xtask"))
                .collect::<Vec<_>>()
                .join(" | ")
        )];
    }
    let mut errors = Vec::new();
    let mut started = Vec::new();
    for p in &PROGRAMS {
        match callgrind(dir, p) {
            Ok(c) => started.push((p, c)),
            Err(e) => errors.push(format!("{OUT}: {}: {e:#}", p.comm)),
        }
    }
    let report = match report_json(&dir.join(OUT), 100_000) {
        Ok(r) => r,
        Err(e) => {
            errors.push(format!("{OUT}: {e:#}"));
            return errors;
        }
    };
    for (p, (child, file)) in started {
        if let Err(e) = compare_program(&report, p, child, &file) {
            errors.push(format!("{OUT}: {}: {e:#}", p.comm));
        }
    }
    errors
}

fn compare_program(
    report: &serde_json::Value,
    r: &DebianProgram,
    child: Child,
    file: &Path,
) -> Result<()> {
    let done = child.wait_with_output()?;
    if !done.status.success() {
        bail!(
            "valgrind failed: {}",
            String::from_utf8_lossy(&done.stderr).trim()
        );
    }
    let hint = "callgrind_annotate comes with Debian's valgrind package.";
    let text = output(
        Command::new("callgrind_annotate")
            .args(["--threshold=100", "--auto=no"])
            .arg(file),
        hint,
    )?;
    let theirs = callgrind_shares(&text);
    let (ours, samples) = report_shares(report, r.comm)?;
    let rows = compare(&ours, &theirs, 5.0);
    println!(
        "profile check: {OUT}: {} ({samples} user-mode samples) against callgrind, functions of 5 % or more:",
        r.comm
    );
    let mut bad = Vec::new();
    for (name, o, t) in &rows {
        println!("profile check:   {o:6.2} % hvprof  {t:6.2} % callgrind  {name}");
        if (o - t).abs() > 2.0 {
            bad.push(format!("{name}: {o:.2} % (callgrind {t:.2} %)"));
        }
    }
    if rows.is_empty() {
        bail!("no function of 5 % or more on either side");
    }
    if !bad.is_empty() {
        bail!("more than 2 points from callgrind: {}", bad.join(", "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guest_script_quotes_what_the_shell_would_change() {
        assert_eq!(sh_quote("python3.11"), "python3.11");
        assert_eq!(sh_quote("-S"), "-S");
        assert_eq!(sh_quote(""), "''");
        assert_eq!(sh_quote("a b"), "'a b'");
        assert_eq!(sh_quote("it's $x"), "'it'\\''s $x'");
        let s = script(&PROGRAMS);
        assert!(s.starts_with("python3.11 -S -B -c 'def f(n):\n"), "{s}");
        assert!(s.contains("' && perl -e 'my $s = 0;"), "{s}");
        // What sh hands each program is its command, byte for byte.
        let out = std::process::Command::new("sh")
            .args(["-c", &format!("printf '%s\\0' {}", s.replace(" && ", " "))])
            .output()
            .unwrap();
        let words: Vec<&[u8]> = out
            .stdout
            .split(|&b| b == 0)
            .filter(|w| !w.is_empty())
            .collect();
        let want: Vec<&[u8]> = PROGRAMS
            .iter()
            .flat_map(|p| p.command.iter().map(|w| w.as_bytes()))
            .collect();
        assert_eq!(words, want);
    }

    #[test]
    fn callgrind_rows_by_function_and_unnamed_code_by_file() {
        let text = "\
--------------------------------------------------------------------------------
Ir
--------------------------------------------------------------------------------
200,000 (100.0%)  PROGRAM TOTALS

Ir               file:function
--------------------------------------------------------------------------------
120,000 (60.00%)  ???:_PyEval_EvalFrameDefault [/r/usr/bin/python3.11]
 20,000 (10.00%)  ???:0x00000000001bc2d0 [/r/usr/bin/python3.11]
 10,000 ( 5.00%)  ???:0x00000000001bd000 [/r/usr/bin/python3.11]
 10,000 ( 5.00%)  ./malloc/malloc.c:malloc [/r/lib/x86_64-linux-gnu/libc.so.6]
";
        let s = callgrind_shares(text);
        assert_eq!(s.get("_PyEval_EvalFrameDefault"), Some(&60.0));
        assert_eq!(s.get("[unknown] python3.11+0x1bc2d0"), Some(&10.0));
        assert_eq!(s.get("[unknown] python3.11+0x1bd000"), Some(&5.0));
        assert_eq!(s.get("malloc"), Some(&5.0));
        assert_eq!(s.len(), 4);
    }

    #[test]
    fn report_rows_of_the_process_in_user_mode() {
        let mut rows = vec![
            serde_json::json!({"process": "perl[90]", "module": "perl", "function": "Perl_pp_add", "samples": 600.0}),
            serde_json::json!({"process": "perl[90]", "module": "perl", "function": "[unknown] perl+0x10", "samples": 300.0}),
            serde_json::json!({"process": "perl[90]", "module": "perl", "function": "[unknown] perl+0x20", "samples": 100.0}),
            serde_json::json!({"process": "perl[90]", "module": "[guest.kallsyms]", "function": "clear_page_erms", "samples": 500.0}),
            serde_json::json!({"process": "perlish[91]", "module": "perlish", "function": "x", "samples": 500.0}),
        ];
        rows.push(serde_json::json!({"process": "perl[90]", "module": "libc.so.6", "function": "memcpy", "samples": 1000.0}));
        let report = serde_json::json!({"vms": [{"name": "linux", "rows": rows}]});
        let (s, total) = report_shares(&report, "perl").unwrap();
        assert_eq!(total, 2000.0);
        assert_eq!(s.get("Perl_pp_add"), Some(&30.0));
        assert_eq!(s.get("[unknown] perl+0x10"), Some(&15.0));
        assert_eq!(s.get("[unknown] perl+0x20"), Some(&5.0));
        assert_eq!(s.get("memcpy"), Some(&50.0));
        assert_eq!(s.len(), 4);
    }

    #[test]
    fn the_comparison_takes_functions_above_the_floor_on_either_side() {
        let ours: Shares = [("a".into(), 50.0), ("b".into(), 4.0), ("c".into(), 1.0)].into();
        let theirs: Shares = [("a".into(), 49.0), ("b".into(), 6.0), ("d".into(), 2.0)].into();
        let rows = compare(&ours, &theirs, 5.0);
        assert_eq!(rows, vec![("a".into(), 50.0, 49.0), ("b".into(), 4.0, 6.0)]);
    }
}
