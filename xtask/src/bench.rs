//! `cargo xtask bench`: runs the benchmarks and records their figures in `docs/BENCHMARKS.md`,
//! each between its own markers, with the command that produced them.

use std::fs;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use qemu_tests::benches::{self, ROUNDS};
use qemu_tests::runner::{RunnerConfig, Verdict, run_scenario};

use crate::build::build_hypervisor;
use crate::tools::ensure_tools;
use crate::{target_dir, workspace_root};

pub fn bench() -> Result<ExitCode> {
    ensure_tools()?;
    let hypervisor = build_hypervisor(false)?;
    let config = RunnerConfig {
        guest_dir: hypervisor
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default(),
        hypervisor_elf: hypervisor,
        analyzer: None,
        out_dir: target_dir().join("bench"),
        filter: None,
        jobs: 1,
    };
    let scenario = benches::exit_paths();
    let (result, detail) = run_scenario(&scenario, &config);
    if !matches!(result.verdict, Verdict::Pass) {
        bail!(
            "{} did not run cleanly: {:?}\n{detail}",
            scenario.name,
            result.verdict
        );
    }
    let log_path = config.out_dir.join(&scenario.name).join("serial.log");
    let log = qemu_tests::SerialLog::from_bytes(
        &fs::read(&log_path).with_context(|| format!("cannot read {}", log_path.display()))?,
    );
    let rows = benches::exit_path_figures(&log).map_err(anyhow::Error::msg)?;
    let mut table = String::from(
        "| exit reason | exits | handler min (ticks) | handler mean (ticks) | guest-measured round trip, min (ticks) |\n|---|---:|---:|---:|---:|\n",
    );
    for r in &rows {
        table.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            r.reason,
            r.count,
            r.min,
            r.mean,
            r.round_trip.map_or("—".to_owned(), |t| t.to_string())
        ));
    }
    println!("{table}");
    let section = format!(
        "Measured by `cargo xtask bench` (scenario `{}`: Bochs 2.7, `corei7_haswell_4770`, \
         `clock: sync=none`, so one TSC tick is one instruction). The `busy` guest executes \
         {ROUNDS} CPUIDs, {ROUNDS} OUTs to an unused port and {ROUNDS} VERSION hypercalls, then \
         times {ROUNDS} more of each with RDTSC around the instruction; it first spins so that the \
         VMX-preemption timer fires at its 100,000-tick period. \"Handler\" is the hypervisor's own \
         figure: TSC at the return of the entry stub to TSC just before the next VM entry; the \
         round trip adds the VM exit and entry themselves and the RDTSC pair. The mean of I/O \
         includes the exits on the console UART, whose handler prints a line on the real serial \
         port when the guest completes one.\n\n{table}",
        scenario.name
    );
    record(
        &workspace_root().join("docs/BENCHMARKS.md"),
        "exit-paths",
        &section,
    )?;
    println!("recorded in docs/BENCHMARKS.md");
    Ok(ExitCode::SUCCESS)
}

/// Replaces the text between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`, appending the
/// section when the markers are missing.
fn record(path: &Path, name: &str, body: &str) -> Result<()> {
    let old = fs::read_to_string(path).unwrap_or_else(|_| {
        "# Benchmarks\n\nEvery figure here is written by `cargo xtask bench`; rerun it to refresh them.\n".to_owned()
    });
    let (open, close) = (
        format!("<!-- bench:{name} -->"),
        format!("<!-- /bench:{name} -->"),
    );
    let block = format!("{open}\n{body}{close}");
    let new = match (old.find(&open), old.find(&close)) {
        (Some(a), Some(b)) if a < b => format!("{}{block}{}", &old[..a], &old[b + close.len()..]),
        _ => format!(
            "{}\n## VM-exit handler path lengths\n\n{block}\n",
            old.trim_end()
        ),
    };
    fs::write(path, new).with_context(|| format!("cannot write {}", path.display()))
}
