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
const GUESTS: [&str; 6] = ["hello", "probe", "busy", "attack", "mix", "hostile"];

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
