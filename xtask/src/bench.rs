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
    let analyzer = crate::build::build_analyzer()?;
    let config = RunnerConfig {
        guest_dir: crate::build::guest_dir(&hypervisor),
        hypervisor_elf: hypervisor,
        // The Linux run checks its profile too.
        analyzer: Some(analyzer.clone()),
        out_dir: target_dir().join("bench"),
        filter: None,
        jobs: 1,
        // Benchmarks measure instruction counts, not time: no machine is too slow for them.
        slowdown: 10.0,
    };
    let scenario = benches::exit_paths();
    let log = run(&scenario, &config)?;
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
    let doc = workspace_root().join("docs/BENCHMARKS.md");
    record(&doc, "exit-paths", "VM-exit handler path lengths", &section)?;

    let scenario = benches::profile_costs();
    let log = run(&scenario, &config)?;
    let f = benches::profile_figures(&log).map_err(anyhow::Error::msg)?;
    let section = format!(
        "Measured by `cargo xtask bench` (scenario `{}`: the `mix` guest, 80/20, profiled at the \
         default 1 ms period with `export=end`, Bochs `corei7_haswell_4770`, one tick = one \
         instruction).\n\n\
         | figure | value | goal |\n|---|---:|---:|\n\
         | sample path, mean (ticks per sample) | {} | ≤ 200 |\n\
         | sample path, min / max (ticks) | {} / {} | |\n\
         | samples | {} | |\n\
         | sampling period (ticks) | {} | |\n\
         | whole VMX-preemption-timer exit with its sample, mean (ticks) | {} | |\n\
         | bytes per record on the wire (framing, CRC, header and end frame included) | {:.2} | ≤ 6 (perf.data: 40-49) |\n\n\
         The sample path is the code between the sampling event and the record in the ring (it \
         measures itself: TSC in, TSC out). The whole exit adds the VM exit and entry, the exit \
         bookkeeping and re-arming the clocks. Bochs' TSC advances by exactly one per instruction, \
         so successive samples are nearly periodic and compress better than real traces: see the \
         synthetic trace below for a realistic figure.\n",
        scenario.name,
        f.cost_mean,
        f.cost_min,
        f.cost_max,
        f.samples,
        f.period,
        f.timer_exit_mean,
        f.bytes_per_record
    );
    println!("{section}");
    record(&doc, "profile-costs", "The profiler's own costs", &section)?;

    // The whole cost: the same test-guest run, then a Linux guest (when its image is built).
    let (rows, whole) = benches::whole_costs(&log).map_err(anyhow::Error::msg)?;
    let mut table =
        benches::whole_cost_rows("test guest `mix` 80/20, period 1 ms (4,000 ticks)", &rows);
    let mut linux_note = String::new();
    let mut linux_whole = None;
    let mut exits = vec![(
        "the test guest",
        rows.first().map_or(0, |r| r.sampling_exit_mean),
    )];
    match linux_cost_run(&config) {
        Ok(log) => {
            let (rows, whole) = benches::whole_costs(&log).map_err(anyhow::Error::msg)?;
            table.push_str(&benches::whole_cost_rows(
                "Linux w41 (`bochs-linux-w41`: 1 GHz clock, period 8,000 ticks)",
                &rows,
            ));
            linux_whole = Some(whole);
            exits.push(("Linux", rows.first().map_or(0, |r| r.sampling_exit_mean)));
        }
        Err(e) => linux_note = format!("\n\nLinux not measured in this run: {e:#}.\n"),
    }
    let goal = exits
        .iter()
        .map(|(what, ticks)| {
            let verdict = if *ticks <= 300 { "met" } else { "not met" };
            format!("{verdict} for {what} ({ticks} ticks)")
        })
        .collect::<Vec<_>>()
        .join(", ");
    let section = format!(
        "Measured by `cargo xtask bench` (the `bench-profile-costs` run above, and \
         `bochs-linux-w41` when `cargo xtask linux-image` has built the guest). Everything the \
         profiler adds to a run, from the hypervisor's own TSC readings: the VM exits that exist \
         only to take a sample (VMX-preemption timer exits for a sampling deadline, from the exit \
         to the next VM entry, task read included), the LAPIC timer interrupts that sample the \
         hypervisor and idle time, and the export of the log during the run; as a share of each \
         pCPU's time from the start of sampling to its end. A task read is the Linux guest's \
         running task read from guest memory, once per guest sample, when its identity may have \
         changed. `hvprof-analyze report` prints the same figures (`whole_cost` in its JSON).\n\n\
         | run | pCPU | whole cost | sampling exits x mean ticks (share) | timer interrupts x mean ticks (share) | export | task reads x mean ticks |\n\
         |---|---:|---:|---:|---:|---:|---:|\n{table}\n\
         Whole machine: test guest {whole:.2}%{}. Goal: a whole sampling exit ≤ 300 ticks, for \
         Linux guests too: {goal}.{linux_note}\n",
        linux_whole.map_or(String::new(), |w| format!(", Linux {w:.2}%")),
    );
    println!("{section}");
    record(&doc, "whole-cost", "The profiler's whole cost", &section)?;

    let out = crate::build::cargo()
        .args([
            "run",
            "--release",
            "-q",
            "-p",
            "hvprof-samplelog",
            "--features",
            "std",
            "--example",
            "throughput",
            "--",
            "10000000",
        ])
        .output()
        .context("cannot run the samplelog throughput example")?;
    if !out.status.success() {
        bail!(
            "the throughput example failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let section = format!(
        "Measured by `cargo xtask bench`, which runs `cargo run --release -p hvprof-samplelog \
         --features std --example throughput -- 10000000` (a synthetic 10 M-sample trace over 4 \
         pCPUs: several VMs, hot functions, timing jitter; one core of this 2-core machine):\n\n\
         ```\n{}\n```\n\nFor comparison, `perf report` reads about 1.35 M samples/s and \
         `perf script` about 0.9 M samples/s on these machines (shared/platform/PLATFORM.md).\n",
        text.trim()
    );
    println!("{section}");
    record(
        &doc,
        "decode-throughput",
        "Sample-log size and decoding speed",
        &section,
    )?;
    let out = std::process::Command::new(&analyzer)
        .args(["bench-synthetic", "10000000"])
        .output()
        .context("cannot run hvprof-analyze bench-synthetic")?;
    if !out.status.success() {
        bail!(
            "hvprof-analyze bench-synthetic failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let section = format!(
        "Measured by `cargo xtask bench`, which runs `hvprof-analyze bench-synthetic 10000000` \
         (release build; the same synthetic trace; the report as `hvprof-analyze report` makes it: \
         the capture decoded in parts by `hvprof_samplelog::decode_parallel` while each thread \
         counts its samples, then the tables; on one thread, then on the machine's cores):\n\n```\n{}\n```\n\nGoal: ≥ 20 M samples/s \
         on 2 cores; `perf report` does about 1.35 M samples/s here.\n",
        text.trim()
    );
    println!("{section}");
    record(
        &doc,
        "analyzer-throughput",
        "hvprof-analyze throughput",
        &section,
    )?;
    println!("recorded in docs/BENCHMARKS.md");
    Ok(ExitCode::SUCCESS)
}

/// The Linux w41 scenario, for its cost lines.
fn linux_cost_run(config: &RunnerConfig) -> Result<qemu_tests::SerialLog> {
    let scenario = qemu_tests::linux_scenarios::all()
        .into_iter()
        .find(|s| s.name == "bochs-linux-w41")
        .context("no bochs-linux-w41 scenario")?;
    run(&scenario, config)
}

/// Runs one benchmark scenario and returns its serial log.
fn run(scenario: &qemu_tests::Scenario, config: &RunnerConfig) -> Result<qemu_tests::SerialLog> {
    let (result, detail) = run_scenario(scenario, config);
    if !matches!(result.verdict, Verdict::Pass) {
        bail!(
            "{} did not run cleanly: {:?}\n{detail}",
            scenario.name,
            result.verdict
        );
    }
    // The whole capture: console text and, with `channel=lpt`, the parallel port's frames.
    let dir = config.out_dir.join(&scenario.name);
    let mut bytes = fs::read(dir.join("serial.log"))
        .with_context(|| format!("cannot read {}", dir.display()))?;
    if let Ok(lpt) = fs::read(dir.join("lpt.log")) {
        bytes.extend_from_slice(b"\r\n");
        bytes.extend_from_slice(&lpt);
    }
    Ok(qemu_tests::SerialLog::from_bytes(&bytes))
}

/// Replaces the text between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`, appending the
/// section when the markers are missing.
fn record(path: &Path, name: &str, title: &str, body: &str) -> Result<()> {
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
        _ => format!("{}\n\n## {title}\n\n{block}\n", old.trim_end()),
    };
    fs::write(path, new).with_context(|| format!("cannot write {}", path.display()))
}
