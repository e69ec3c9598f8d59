//! Checks on the profile a scenario's run produced: the serial capture is given to
//! `hvprof-analyze` (the same binary users run) and its `--json` report is parsed.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

/// What a profile check can use.
pub struct ProfileRun {
    /// The whole capture (console text and sample-log frames; also in [`CAPTURE`]).
    pub capture: Vec<u8>,
    /// The scenario's artifact folder.
    pub dir: PathBuf,
    /// The `hvprof-analyze` binary.
    pub analyzer: PathBuf,
    /// The hypervisor ELF and the folder of the test guests' ELF files (for symbols).
    pub hypervisor: PathBuf,
    pub guest_dir: PathBuf,
}

/// The file in a scenario's folder that holds its whole capture (the serial log, then what the
/// parallel port carried): what the analyzer reads.
pub const CAPTURE: &str = "capture.log";

/// A check of a scenario's profile.
pub type ProfileCheck = Box<dyn Fn(&ProfileRun) -> Result<(), String> + Send + Sync>;

/// The test guests whose symbols the analyzer is given.
const GUESTS: [&str; 9] = [
    "hello",
    "probe",
    "busy",
    "attack",
    "mix",
    "hostile",
    "stacks",
    "stackattack",
    "pmu",
];

impl ProfileRun {
    /// `hvprof-analyze report --json` on the capture (or on `bytes` instead, e.g. a damaged
    /// copy), with the hypervisor's and the guests' ELF files.
    pub fn report(&self, bytes: Option<(&str, &[u8])>) -> Result<Value, String> {
        self.report_with(bytes, &[])
    }

    /// `report`, with more arguments for the analyzer (`--kernel`, more `--image`s).
    pub fn report_with(
        &self,
        bytes: Option<(&str, &[u8])>,
        extra: &[std::ffi::OsString],
    ) -> Result<Value, String> {
        let path = match bytes {
            Some((name, b)) => {
                let p = self.dir.join(name);
                std::fs::write(&p, b).map_err(|e| format!("cannot write {}: {e}", p.display()))?;
                p
            }
            None => self.dir.join(CAPTURE),
        };
        let mut cmd = Command::new(&self.analyzer);
        cmd.arg("report").arg("--json").arg(&path).args(extra);
        cmd.arg("--hypervisor").arg(&self.hypervisor);
        for g in GUESTS {
            let elf = self.guest_dir.join(g);
            if elf.is_file() {
                cmd.arg("--image").arg(elf);
            }
        }
        let out = cmd
            .output()
            .map_err(|e| format!("cannot run {}: {e}", self.analyzer.display()))?;
        if !out.status.success() {
            return Err(format!(
                "hvprof-analyze failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let json_path = path.with_extension("json");
        let _ = std::fs::write(&json_path, &out.stdout);
        serde_json::from_slice(&out.stdout).map_err(|e| format!("the report is not JSON: {e}"))
    }
}

impl ProfileRun {
    /// `hvprof-analyze <args> <capture>` (the capture given as bytes, written to `name`), its
    /// standard output.
    pub fn analyze(&self, args: &[&str], name: &str, bytes: &[u8]) -> Result<Vec<u8>, String> {
        let path = self.dir.join(name);
        std::fs::write(&path, bytes)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        let out = Command::new(&self.analyzer)
            .args(args)
            .arg(&path)
            .output()
            .map_err(|e| format!("cannot run {}: {e}", self.analyzer.display()))?;
        if !out.status.success() {
            return Err(format!(
                "hvprof-analyze {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(out.stdout)
    }
}

/// The capture with every piece of console text reworded (each line reversed behind a `~ `
/// prefix) and every sample-log frame kept byte for byte: what a hypervisor that printed its
/// console differently would have sent. Frames are the spans between `0x00` bytes whose second
/// to fourth bytes are the magic `HVP`; console text never contains `0x00`.
pub fn reword_console(capture: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(capture.len() * 2);
    for (i, span) in capture.split(|&b| b == 0).enumerate() {
        if i > 0 {
            out.push(0);
        }
        if span.get(1..4) == Some(b"HVP".as_slice()) {
            out.extend_from_slice(span);
            continue;
        }
        let text = String::from_utf8_lossy(span);
        for (j, line) in text.split('\n').enumerate() {
            if j > 0 {
                out.push(b'\n');
            }
            if !line.trim().is_empty() {
                out.extend_from_slice(b"~ ");
                out.extend(line.chars().rev().collect::<String>().into_bytes());
            }
        }
    }
    out
}

/// The frames are the only contract: `stat` and `report` (with `extra`, e.g. `--kernel`) say the
/// same about the capture and about [`reword_console`] of it. Compares `stat --json` whole and
/// the report's host table, VM tables, exact costs, whole cost and losses.
pub fn check_console_is_not_read(
    run: &ProfileRun,
    extra: &[std::ffi::OsString],
) -> Result<(), String> {
    let reworded = reword_console(&run.capture);
    if reworded == run.capture {
        return Err("rewording changed nothing: the capture has no console text".into());
    }
    let stat = |name: &str, bytes: &[u8]| -> Result<Value, String> {
        let out = run.analyze(&["stat", "--json"], name, bytes)?;
        serde_json::from_slice(&out).map_err(|e| format!("stat --json is not JSON: {e}"))
    };
    let (a, b) = (
        stat("stat-original.log", &run.capture)?,
        stat("stat-reworded.log", &reworded)?,
    );
    if a != b {
        return Err(format!(
            "stat differs once the console is reworded:\n{a:#}\n---\n{b:#}"
        ));
    }
    if a.pointer("/vms/0/exact").is_none_or(Value::is_null) {
        return Err("stat has no exact exit table (no VM end frame?)".into());
    }
    let original = run.report_with(None, extra)?;
    let other = run.report_with(Some(("capture-reworded.log", &reworded)), extra)?;
    for key in [
        "host",
        "vms",
        "cost",
        "whole_cost",
        "losses",
        "total_samples",
    ] {
        if original.get(key) != other.get(key) {
            return Err(format!(
                "the report's {key:?} differs once the console is reworded"
            ));
        }
    }
    if original.get("whole_cost").is_none_or(Value::is_null) {
        return Err("the report has no whole cost (no pCPU cost frame?)".into());
    }
    Ok(())
}

/// A number at a JSON pointer (`/vms/0/samples`).
pub fn num(v: &Value, pointer: &str) -> Result<f64, String> {
    v.pointer(pointer)
        .and_then(Value::as_f64)
        .ok_or_else(|| format!("the report has no number at {pointer}"))
}

/// The VM called `name` in the report's `vms` array.
pub fn vm<'a>(v: &'a Value, name: &str) -> Result<&'a Value, String> {
    v.get("vms")
        .and_then(Value::as_array)
        .and_then(|vms| {
            vms.iter()
                .find(|m| m.get("name").and_then(Value::as_str) == Some(name))
        })
        .ok_or_else(|| format!("the report has no VM {name:?}"))
}

/// Samples of the rows whose `function` is `function` in `rows`.
pub fn row_samples(rows: &Value, function: &str) -> f64 {
    rows.as_array()
        .map(|rows| {
            rows.iter()
                .filter(|r| r.get("function").and_then(Value::as_str) == Some(function))
                .filter_map(|r| r.get("samples").and_then(Value::as_f64))
                .sum()
        })
        .unwrap_or(0.0)
}

/// `got` within `tolerance` points of `want` (percentages).
pub fn within(what: &str, got: f64, want: f64, tolerance: f64) -> Result<(), String> {
    if (got - want).abs() <= tolerance {
        Ok(())
    } else {
        Err(format!(
            "{what}: {got:.2}%, expected {want:.2}% ± {tolerance}"
        ))
    }
}

#[cfg(test)]
mod reword_tests {
    use super::*;

    #[test]
    fn text_is_reworded_and_frames_kept() {
        let mut capture = b"vm a: guest IA32_LSTAR 0x1\r\nline two\n".to_vec();
        let frame = [0u8, 9, b'H', b'V', b'P', 5, 1, 2, 3, 4, 0];
        capture.extend_from_slice(&frame);
        capture.extend_from_slice(b"after\n");
        let out = reword_console(&capture);
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with("~ \r1x0 RATSL_23AI"), "{text}");
        assert!(text.contains("~ owt enil\n"), "{text}");
        assert!(out.windows(frame.len()).any(|w| w == frame), "frame kept");
        assert!(text.ends_with("~ retfa\n"), "{text}");
    }
}
