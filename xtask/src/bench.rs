//! `cargo xtask bench`: runs the benchmarks and records their figures in `docs/BENCHMARKS.md`,
//! each between its own markers, with the command that produced them.

use std::fs;
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use qemu_tests::benches::{self, ROUNDS};
use qemu_tests::runner::{RunnerConfig, Verdict, run_scenario};

use crate::build::build_hypervisor;
use crate::tools::ensure_tools;
use crate::{target_dir, workspace_root};

/// Runs every benchmark, or with `host_only` only those that need no emulator (the decoder's
/// and the analyzer's throughput).
pub fn bench(host_only: bool, profile_only: bool) -> Result<ExitCode> {
    let doc = workspace_root().join("docs/BENCHMARKS.md");
    if profile_only {
        let section = profile_start()?;
        println!("{section}");
        record(&doc, "profile-start", "Time to your command", &section)?;
        return Ok(ExitCode::SUCCESS);
    }
    if host_only {
        let analyzer = crate::build::build_analyzer()?;
        host_benches(&analyzer, &doc)?;
        println!("recorded in docs/BENCHMARKS.md");
        return Ok(ExitCode::SUCCESS);
    }
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
         figure: TSC at the return of the entry stub to TSC just before the next VM entry (the \
         previous exit's booking in the exit statistics, done after the exit, inside it); the \
         round trip adds the VM exit and entry themselves and the RDTSC pair. The mean of I/O \
         includes the exits on the console UART, whose handler prints a line on the real serial \
         port when the guest completes one.\n\n{table}",
        scenario.name
    );
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
         changed, with the checks of the sample's address against the process's known \
         mappings and the kernel's known modules (and the reads of maps and module lists they \
         ask for). `hvprof-analyze report` prints the same figures (`whole_cost` in its JSON).\n\n\
         | run | pCPU | whole cost | sampling exits x mean ticks (share) | timer interrupts x mean ticks (share) | export | task reads x mean ticks |\n\
         |---|---:|---:|---:|---:|---:|---:|\n{table}\n\
         Whole machine: test guest {whole:.2}%{}. Goal: a whole sampling exit ≤ 300 ticks, for \
         Linux guests too: {goal}.{linux_note}\n",
        linux_whole.map_or(String::new(), |w| format!(", Linux {w:.2}%")),
    );
    println!("{section}");
    record(&doc, "whole-cost", "The profiler's whole cost", &section)?;

    // The virtual PMU's cost to the same sampling exits.
    let mut vpmu_rows = format!(
        "| the test guest `mix` 80/20, no vPMU (`bench-profile-costs`) | {} |\n",
        exit_mean(&rows)
    );
    for (scenario, what) in [
        (
            benches::vpmu_idle(),
            "the same with an idle vPMU (`vpmu=cpu`, no counter enabled)",
        ),
        (
            benches::vpmu_counting(),
            "the `pmu` guest's counted loop, its seven counters running (`n=20000000 pmi-loop=1000 vpmu=cpu`)",
        ),
    ] {
        let log = run(&scenario, &config)?;
        let (rows, _) = benches::whole_costs(&log).map_err(anyhow::Error::msg)?;
        vpmu_rows.push_str(&format!(
            "| {what} (`{}`) | {} |\n",
            scenario.name,
            exit_mean(&rows)
        ));
    }
    let section = format!(
        "Measured by `cargo xtask bench` (Bochs `corei7_haswell_4770`, one tick = one instruction, \
         the default 1 ms period, `export=end`): the mean sampling exit, from the exit to the next \
         VM entry, of a vCPU without a virtual PMU and with one (`vpmu=`, docs/PROFILER.md \
         \"A guest's own PMU\").\n\n\
         | run | sampling exits x mean ticks |\n|---|---:|\n{vpmu_rows}"
    );
    println!("{section}");
    record(&doc, "vpmu-costs", "The guests' virtual PMU", &section)?;

    let section = channel_throughput(&config)?;
    println!("{section}");
    record(&doc, "channels", "Export channels", &section)?;

    let section = call_chain_costs(&config)?;
    println!("{section}");
    record(&doc, "call-chains", "Call chains", &section)?;

    match profile_start() {
        Ok(section) => {
            println!("{section}");
            record(&doc, "profile-start", "Time to your command", &section)?;
        }
        Err(e) => println!("profile start not measured: {e:#}"),
    }

    host_benches(&analyzer, &doc)?;
    println!("recorded in docs/BENCHMARKS.md");
    Ok(ExitCode::SUCCESS)
}

/// One `cargo xtask profile -- /bin/true`: the seconds from its start to the emulator's start,
/// and to the command's.
fn profile_once(out: &Path) -> Result<(f64, f64)> {
    let run = Command::new(std::env::current_exe()?)
        .arg("profile")
        .arg("--out")
        .arg(out)
        .args(["--", "/bin/true"])
        .stdin(Stdio::null())
        .output()
        .context("cannot run cargo xtask profile")?;
    let err = String::from_utf8_lossy(&run.stderr);
    let seconds = |before: &str, after: &str| {
        err.lines()
            .find_map(|l| l.split_once(after).map(|(head, _)| head.to_owned()))
            .and_then(|head| head.rsplit(before).next().map(str::to_owned))
            .and_then(|n| n.trim().parse::<f64>().ok())
    };
    match (
        seconds("), ", " s after the start"),
        seconds("the command started ", " s after `cargo xtask profile`"),
    ) {
        (Some(boot), Some(command)) if run.status.success() => Ok((boot, command)),
        _ => bail!("cargo xtask profile failed ({}): {err}", run.status),
    }
}

/// How long `cargo xtask profile` takes to its command: cold (the guest image missing: built
/// from the packages `target/linux/debs` holds) and warm (a second run), each split into the
/// host's part (to the emulator's start) and the emulator's boot of the guest.
fn profile_start() -> Result<String> {
    let out = target_dir().join("bench").join("profile");
    // Cold: the image is built again by the run itself.
    let _ = fs::remove_file(crate::linux::linux_dir().join("initramfs.cpio"));
    let (cold_host, cold_command) = profile_once(&out)?;
    let (warm_host, warm_command) = profile_once(&out)?;
    let verdict = if warm_host <= 5.0 { "met" } else { "not met" };
    Ok(format!(
        "Measured by `cargo xtask bench`: `cargo xtask profile -- /bin/true` twice, in Bochs; the \
         seconds from its start to the emulator's start (the host's part: builds checked, the \
         run's initramfs and guest root, the ISO) and to the command's start in the guest (the \
         rest is the emulator booting the kernel). Cold: the guest image missing, built by the run \
         from the packages already downloaded into `target/linux/debs` (a first download adds the \
         network's time). Warm: the second run.\n\n\
         | run | to the emulator's start (s) | emulator's boot to the command (s) | to the command (s) |\n|---|---:|---:|---:|\n\
         | cold | {cold_host:.1} | {:.1} | {cold_command:.1} |\n\
         | warm | {warm_host:.1} | {:.1} | {warm_command:.1} |\n\n\
         Goal: warm, at most 5 s over the emulator's own boot ({verdict}: {warm_host:.1} s).\n",
        cold_command - cold_host,
        warm_command - warm_host,
    ))
}

/// The decoder's and the analyzer's throughput, beside `perf report`'s measured in the same run.
fn host_benches(analyzer: &Path, doc: &Path) -> Result<()> {
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
         ```\n{}\n```\n\n`perf report`'s rate on this machine, measured in the same run, is in \
         the next section.\n",
        text.trim()
    );
    println!("{section}");
    record(
        doc,
        "decode-throughput",
        "Sample-log size and decoding speed",
        &section,
    )?;
    let section = analyzer_throughput(analyzer)?;
    println!("{section}");
    record(
        doc,
        "analyzer-throughput",
        "hvprof-analyze throughput",
        &section,
    )
}

/// Samples in the synthetic capture of the analyzer's benchmark.
const SYNTHETIC_SAMPLES: u64 = 10_000_000;

/// `hvprof-analyze` on a synthetic capture: its own timing of each step, then each command as a
/// user runs it (wall time and peak memory of the process), and `perf report` on a perf.data
/// recorded here, in the same run.
fn analyzer_throughput(analyzer: &Path) -> Result<String> {
    let dir = target_dir().join("bench");
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let capture = dir.join("synthetic.log");
    let out = bench_synthetic(analyzer, "--exports", &capture)?;
    let steps = String::from_utf8_lossy(&out.stdout)
        .trim()
        .replace(&format!("{}/", workspace_root().display()), "");
    let samples: u64 = steps
        .lines()
        .find_map(|l| l.strip_prefix("capture: "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .context("bench-synthetic did not say how many samples its capture holds")?;
    // Other work on the machine slows every figure here alike; the load says how much there was.
    let load = fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "unknown".into());
    // The same capture with the Linux guests' task frames, as a Linux guest's run carries them.
    let with_tasks = dir.join("synthetic-tasks.log");
    bench_synthetic(analyzer, "--tasks", &with_tasks)?;
    // The same trace with call chains (the generator's caller tree), as a capture with
    // `stacks=` carries them.
    let with_chains = dir.join("synthetic-chains.log");
    bench_synthetic(analyzer, "--chains", &with_chains)?;
    let cap = capture.to_string_lossy().into_owned();
    let cap_tasks = with_tasks.to_string_lossy().into_owned();
    let cap_chains = with_chains.to_string_lossy().into_owned();
    let pprof = dir.join("synthetic.pb.gz").to_string_lossy().into_owned();
    let firefox = dir.join("synthetic.json").to_string_lossy().into_owned();
    // (command, how the table names it, arguments)
    let commands: [(&str, &str, Vec<&str>); 8] = [
        ("report", "`hvprof-analyze report`", vec!["report", &cap]),
        (
            "report",
            "`hvprof-analyze report`, the same capture with the Linux guests' task frames (their rows by function and process)",
            vec!["report", &cap_tasks],
        ),
        (
            "report",
            "`hvprof-analyze report`, the same trace with call chains",
            vec!["report", &cap_chains],
        ),
        (
            "script",
            "`hvprof-analyze script`",
            vec!["script", &cap, "-o", "/dev/null"],
        ),
        (
            "export --pprof",
            "`hvprof-analyze export --pprof`",
            vec!["export", &cap, "--pprof", &pprof],
        ),
        (
            "export --firefox",
            "`hvprof-analyze export --firefox`",
            vec!["export", &cap, "--firefox", &firefox],
        ),
        (
            "timeline",
            "`hvprof-analyze timeline`",
            vec!["timeline", &cap, "-o", "/dev/null"],
        ),
        (
            "html",
            "`hvprof-analyze html` (tables, timeline, flame graph, exit statistics)",
            vec!["html", &cap, "-o", "/dev/null"],
        ),
    ];
    let mut table = String::from(
        "| command (10 M samples) | wall time (s): median of 5 runs (fastest-slowest) | M samples/s (median) | CPU (s): user / system, medians | peak memory (MB, largest) |\n|---|---:|---:|---:|---:|\n",
    );
    let mut report_rate = 0.0;
    for (i, (name, cell, args)) in commands.iter().enumerate() {
        let run = timed_runs(|| {
            let mut c = Command::new(analyzer);
            c.args(args);
            c
        })
        .with_context(|| format!("hvprof-analyze {name}"))?;
        let rate = samples as f64 / run.seconds / 1e6;
        if i == 0 {
            report_rate = rate;
        }
        table.push_str(&run.row(cell, rate));
    }
    let report_rows = report_rows(analyzer, &capture)?;
    // `perf report` on a profile of the capture's size and shape, then on one of a handful of
    // rows (its fastest case), each with its ratio.
    let mut perf = String::new();
    for (workload, what) in [
        (
            PerfWorkload::Spread,
            "`cargo xtask spread-code`: code without symbols on every core",
        ),
        (PerfWorkload::Shells, "two CPU-bound shells"),
    ] {
        match perf_report_rate(&dir, workload) {
            Ok(p) => {
                table.push_str(&p.run.row(
                    &format!(
                        "`perf report --stdio --sort comm,dso,sym` on {what} ({} samples, {} rows)",
                        p.samples, p.rows
                    ),
                    p.rate() / 1e6,
                ));
                perf.push_str(&format!(
                    "- {what}: `perf report` read {:.2} M samples/s ({} samples, {} rows); \
                     `hvprof-analyze report` {report_rate:.1} M samples/s ({samples} samples, \
                     {report_rows} rows): **{:.1}x**.\n",
                    p.rate() / 1e6,
                    p.samples,
                    p.rows,
                    report_rate * 1e6 / p.rate()
                ));
            }
            Err(why) => perf.push_str(&format!("- {what}: `perf report` not measured: {why}.\n")),
        }
    }
    Ok(format!(
        "Measured by `cargo xtask bench` (release build, this 2-core machine; its load average, 1 min, was {load} \
         midway). \
         `hvprof-analyze bench-synthetic {SYNTHETIC_SAMPLES} --exports --write {}` makes the \
         synthetic capture (the trace above: 4 pCPUs, several VMs, no symbols, so every distinct \
         address is a row) and times each step in the process:\n\n```\n{steps}\n```\n\n\
         `bench-synthetic --tasks` writes the same capture with a task frame every 16 frames for \
         the Linux guests' vCPUs (as a Linux guest's run carries them), whose samples are then \
         classified by task; `bench-synthetic --chains` the same trace with call chains (the \
         generator's caller tree, as a capture with `stacks=` carries them).\n\n\
         Then each command runs on that file as a user runs it (its whole process: reading the \
         file, decoding on every core, classifying, naming, writing), and `perf report` on two \
         perf.data files that `perf record -e cpu-clock -c 10000` made here (their samples and \
         rows counted with `perf report --sort comm,dso,sym -F sample`): one of the capture's \
         size and shape, about as many samples over about as many rows, each an address \
         without a symbol (`cargo xtask spread-code`, which calls into {} KiB of NOP sleds on \
         every core); and one of two CPU-bound shells, some 1 M samples \
         over a handful of rows, the kind `perf report` reads fastest. Each runs {RUNS} times \
         in a row and the median counts: on this virtual machine the first touch of memory the \
         host has not backed yet (fresh heap or page cache) costs the kernel several times what \
         reused memory does, which moves one run's wall time by up to 2x:\n\n{table}\n{perf}\n\
         Goal: `report` ≥ 20 M samples/s and ≥ 15x `perf report`; `script`, pprof and Firefox \
         ≥ 10 M samples/s.\n",
        capture
            .strip_prefix(workspace_root())
            .unwrap_or(&capture)
            .display(),
        SPREAD_CODE_BYTES >> 10,
    ))
}

/// `hvprof-analyze bench-synthetic` with `option`, its capture written to `capture`: its output.
fn bench_synthetic(analyzer: &Path, option: &str, capture: &Path) -> Result<std::process::Output> {
    let out = Command::new(analyzer)
        .args([
            "bench-synthetic",
            &SYNTHETIC_SAMPLES.to_string(),
            option,
            "--write",
        ])
        .arg(capture)
        .output()
        .with_context(|| format!("cannot run hvprof-analyze bench-synthetic {option}"))?;
    if !out.status.success() {
        bail!(
            "hvprof-analyze bench-synthetic {option} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out)
}

/// A child process's wall time and peak resident memory.
struct Run {
    seconds: f64,
    peak_kb: u64,
    /// CPU time in the process, and in the kernel for it (seconds).
    user: f64,
    system: f64,
}

/// Runs of a command measured in the analyzer's table.
const RUNS: usize = 5;

/// A command run [`RUNS`] times, one after another: the median wall time, the fastest and the
/// slowest, and the largest peak resident set size. One run is not a measurement here: on a
/// virtual machine, the first touch of memory the host has not backed yet (a fresh page of the
/// heap or of the page cache) costs the kernel several times what a reused one does, and it
/// moved one command's wall time by 2x between consecutive runs of the same binary.
struct Runs {
    seconds: f64,
    fastest: f64,
    slowest: f64,
    peak_kb: u64,
    /// Median CPU time in the process and in the kernel for it: the kernel's is what moves
    /// from run to run.
    user: f64,
    system: f64,
}

impl Runs {
    /// The command's row in the analyzer's table, `cell` naming it, `rate` in M samples/s.
    fn row(&self, cell: &str, rate: f64) -> String {
        format!(
            "| {cell} | {:.2} ({:.2}-{:.2}) | {rate:.1} | {:.2} / {:.2} | {:.0} |\n",
            self.seconds,
            self.fastest,
            self.slowest,
            self.user,
            self.system,
            self.peak_kb as f64 / 1024.0
        )
    }
}

/// Runs the command `make` gives [`RUNS`] times (see [`Runs`]).
fn timed_runs(make: impl Fn() -> Command) -> Result<Runs> {
    let mut runs = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        runs.push(timed(&mut make())?);
    }
    let sorted = |f: fn(&Run) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let seconds = sorted(|r| r.seconds);
    Ok(Runs {
        seconds: seconds[RUNS / 2],
        fastest: seconds[0],
        slowest: seconds[RUNS - 1],
        peak_kb: runs.iter().map(|r| r.peak_kb).max().unwrap_or(0),
        user: sorted(|r| r.user)[RUNS / 2],
        system: sorted(|r| r.system)[RUNS / 2],
    })
}

/// Runs `cmd` (its output discarded) and measures it: wall time, and the peak resident set
/// size from the kernel's accounting of the child (`wait4`).
fn timed(cmd: &mut Command) -> Result<Run> {
    let start = Instant::now();
    let child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start it")?;
    let pid = libc::pid_t::try_from(child.id()).context("pid out of range")?;
    let mut status: libc::c_int = 0;
    // SAFETY: `rusage` is a plain C struct of integers, for which all zero bytes are a value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is our child, which nothing else waits for (the `Child` handle is dropped
    // without waiting); `status` and `usage` are live locals the call may write.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    let seconds = start.elapsed().as_secs_f64();
    if r != pid {
        bail!("wait4 failed: {}", std::io::Error::last_os_error());
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        bail!("it failed (wait status {status:#x})");
    }
    drop(child);
    let cpu = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ok(Run {
        seconds,
        // Linux reports ru_maxrss in KiB.
        peak_kb: u64::try_from(usage.ru_maxrss).unwrap_or(0),
        user: cpu(usage.ru_utime),
        system: cpu(usage.ru_stime),
    })
}

/// `perf report` on a perf.data of known size and shape, recorded here.
struct PerfRun {
    samples: u64,
    /// Its rows (comm, dso, symbol; an address without a symbol is its own).
    rows: u64,
    run: Runs,
}

impl PerfRun {
    fn rate(&self) -> f64 {
        self.samples as f64 / self.run.seconds
    }
}

/// What `perf record` records for `perf report` to read.
#[derive(Clone, Copy)]
enum PerfWorkload {
    /// Two CPU-bound shells for 6 s: some 1 M samples over a handful of rows, the kind of
    /// profile `perf report` reads fastest.
    Shells,
    /// `cargo xtask spread-code` (see spread.rs) for as long as it takes to get about
    /// [`SYNTHETIC_SAMPLES`] samples on this machine's cores, over [`SPREAD_CODE_BYTES`] of code
    /// without symbols: a profile of the synthetic capture's size and shape.
    Spread,
}

/// Code the spread workload runs over: about as many distinct addresses sampled (the rows of
/// `perf report`) as the synthetic capture's report has rows (255 k for 9.9 M samples, against
/// the capture's 239 k, when this was chosen; the bench prints both).
const SPREAD_CODE_BYTES: usize = 256 << 10;

/// Samples a second `perf record -e cpu-clock -c 10000` takes on a busy core (one every 10 µs).
const PERF_SAMPLES_PER_CORE_SECOND: f64 = 100_000.0;

/// Records `workload` with `perf record -e cpu-clock -c 10000` (a sample every 10 µs of CPU
/// time), counts its samples and rows, and times `perf report` on them.
fn perf_report_rate(dir: &Path, workload: PerfWorkload) -> std::result::Result<PerfRun, String> {
    let mut rec = Command::new("perf");
    rec.args(["record", "-q", "-e", "cpu-clock", "-c", "10000", "-o"]);
    let data = match workload {
        PerfWorkload::Shells => {
            let data = dir.join("perf.data");
            rec.arg(&data).args([
                "--",
                "sh",
                "-c",
                "timeout 6 sh -c 'while :; do :; done' & timeout 6 sh -c 'while :; do :; done'; wait",
            ]);
            data
        }
        PerfWorkload::Spread => {
            let data = dir.join("perf-spread.data");
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            // A quarter more than the samples asked for: a virtual machine's cores lose some.
            let seconds =
                1.25 * SYNTHETIC_SAMPLES as f64 / (cores as f64 * PERF_SAMPLES_PER_CORE_SECOND);
            let me = std::env::current_exe()
                .map_err(|e| format!("cannot find the xtask program ({e})"))?;
            rec.arg(&data)
                .arg("--")
                .arg(me)
                .args(["spread-code", "--bytes"])
                .arg(SPREAD_CODE_BYTES.to_string())
                .arg("--seconds")
                .arg(format!("{seconds:.1}"));
            data
        }
    };
    let rec = rec
        .stdout(Stdio::null())
        .output()
        .map_err(|e| format!("perf cannot be run ({e}); Debian package linux-perf"))?;
    if !rec.status.success() {
        return Err(format!(
            "perf record failed: {}",
            String::from_utf8_lossy(&rec.stderr).trim()
        ));
    }
    // One line per row: its samples, then the row's comm, dso and symbol.
    let count = Command::new("perf")
        .args([
            "report",
            "--stdio",
            "--sort",
            "comm,dso,sym",
            "-F",
            "sample",
            "-i",
        ])
        .arg(&data)
        .output()
        .map_err(|e| format!("perf report failed: {e}"))?;
    let (samples, rows) = samples_and_rows(&String::from_utf8_lossy(&count.stdout));
    if samples == 0 {
        return Err("perf record took no samples".into());
    }
    let run = timed_runs(|| {
        let mut c = Command::new("perf");
        c.args(["report", "--stdio", "--sort", "comm,dso,sym", "-i"])
            .arg(&data);
        c
    })
    .map_err(|e| format!("perf report failed: {e:#}"))?;
    Ok(PerfRun { samples, rows, run })
}

/// The samples and the rows of `perf report --stdio --sort ... -F sample`'s output: a row is a
/// line that begins with its sample count (the header's lines begin with `#`).
fn samples_and_rows(text: &str) -> (u64, u64) {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok())
        .fold((0, 0), |(n, rows), s| (n + s, rows + 1))
}

/// The rows of `hvprof-analyze report --json` on `capture`: the host table's and every VM's
/// (not the vCPUs', which split a VM's rows again). The report goes through a file and is read
/// back row by row without keeping any: held whole, its hundreds of megabytes would stay in this
/// process, and every command started after it would count them in its peak memory (a child
/// starts as a copy of this process).
fn report_rows(analyzer: &Path, capture: &Path) -> Result<u64> {
    #[derive(serde::Deserialize)]
    struct Table {
        rows: Vec<serde::de::IgnoredAny>,
    }
    #[derive(serde::Deserialize)]
    struct Report {
        host: Table,
        vms: Vec<Table>,
    }
    let json = capture.with_extension("report.json");
    let file =
        fs::File::create(&json).with_context(|| format!("cannot create {}", json.display()))?;
    let status = Command::new(analyzer)
        .args(["report", "--json"])
        .arg(capture)
        .stdout(file)
        .stderr(Stdio::null())
        .status()
        .context("cannot run hvprof-analyze report --json")?;
    if !status.success() {
        bail!("hvprof-analyze report --json failed ({status})");
    }
    let file = fs::File::open(&json).with_context(|| format!("cannot read {}", json.display()))?;
    let r: Report = serde_json::from_reader(std::io::BufReader::new(file))
        .with_context(|| format!("{} is not a report", json.display()))?;
    fs::remove_file(&json).ok();
    Ok((r.host.rows.len() + r.vms.iter().map(|v| v.rows.len()).sum::<usize>()) as u64)
}

/// The export channels' throughput: the channel self-test through the virtio console and
/// through the UART, in QEMU TCG (SeaBIOS), in the same run.
/// What call chains cost: the walk at depth 16 (from runs at `stacks=1` and `stacks=16` on a
/// guest whose every sample is 20 calls deep, so the cost of exactly 16 frames is known from the
/// fixed part and the cost per frame), the sample path with and without chains, and the log's
/// bytes per sample for the known call tree of `bochs-stacks-known-tree`.
fn call_chain_costs(config: &RunnerConfig) -> Result<String> {
    let deep = "rounds=1000 tree=0,0,1,0 depth=20 cpuid=0";
    let tree_args = "rounds=600 depth=4 cpuid=20";
    let mut figures = Vec::new();
    for (name, stacks, args) in [
        ("bench-chains-off", "off", deep),
        ("bench-chains-depth1", "1", deep),
        ("bench-chains-depth16", "16", deep),
        ("bench-chains-tree-off", "off", tree_args),
        ("bench-chains-tree", "16", tree_args),
    ] {
        let log = run(&benches::chain_costs(name, stacks, args), config)?;
        figures.push(benches::chain_figures(&log).map_err(anyhow::Error::msg)?);
    }
    let [off, one, sixteen, tree_off, tree] = figures[..] else {
        anyhow::bail!("five runs expected");
    };
    let per_frame = (sixteen.guest_ticks as f64 - one.guest_ticks as f64)
        / (sixteen.guest_frames - one.guest_frames).max(1.0);
    let at16 = one.guest_ticks as f64 + per_frame * (16.0 - one.guest_frames);
    let verdict = |ok: bool| if ok { "met" } else { "not met" };
    Ok(format!(
        "Measured by `cargo xtask bench` (Bochs `corei7_haswell_4770`, one tick = one \
         instruction, `export=end`). The `stacks` guest with `{deep}` puts nearly every sample 20 \
         calls deep; the hypervisor times its own walks (TSC before and after, inside the sample \
         path's cost) and prints them. The cost of a 16-frame walk is the fixed part (the \
         `stacks=1` run) plus 16 frames at the cost per frame (the slope between the two runs).\n\n\
         | figure | value | goal |\n|---|---:|---:|\n\
         | guest walk, `stacks=1`: mean frames / mean ticks | {:.1} / {} | |\n\
         | guest walk, `stacks=16`: mean frames / mean ticks | {:.1} / {} | |\n\
         | walk cost per frame (ticks) | {per_frame:.1} | |\n\
         | **walk of 16 frames (ticks)** | **{at16:.0}** | ≤ 500 ({}) |\n\
         | hypervisor samples' walks (own chain and exit cause), `stacks=16`: mean frames / ticks | {:.1} / {} | |\n\
         | sample path, mean ticks: `stacks=off` / `stacks=1` / `stacks=16` | {} / {} / {} | |\n\
         | bytes per sample, known tree (`{tree_args}`): `stacks=off` / `stacks=16` | {:.2} / {:.2} | ≤ 32 ({}) |\n\n\
         Bytes per sample are the whole log (frames, CRC, header, events, end frame) over its \
         samples. A chain is coded against the previous chain of its vCPU, sharing its outermost \
         frames, so a sample whose callers did not change costs one bit more.\n",
        one.guest_frames,
        one.guest_ticks,
        sixteen.guest_frames,
        sixteen.guest_ticks,
        verdict(at16 <= 500.0),
        sixteen.host_frames,
        sixteen.host_ticks,
        off.sample_mean,
        one.sample_mean,
        sixteen.sample_mean,
        tree_off.bytes_per_sample,
        tree.bytes_per_sample,
        verdict(tree.bytes_per_sample <= 32.0),
    ))
}

fn channel_throughput(config: &RunnerConfig) -> Result<String> {
    use qemu_tests::channel_scenarios::{self, check_channel_capture};
    let mut rows = String::new();
    let mut rates = Vec::new();
    for (name, records) in [
        (
            "qemu-tcg-virtio-selftest",
            channel_scenarios::VIRTIO_RECORDS,
        ),
        (
            "qemu-tcg-serial-selftest",
            channel_scenarios::SERIAL_RECORDS,
        ),
    ] {
        let scenario = channel_scenarios::all()
            .into_iter()
            .find(|s| s.name == name)
            .with_context(|| format!("no {name} scenario"))?;
        let log = run(&scenario, config)?;
        let r = check_channel_capture(log.raw(), records).map_err(anyhow::Error::msg)?;
        let rate = r.bytes_per_second();
        rows.push_str(&format!(
            "| `{name}` | {records} | {} | {} | {:.2} |\n",
            r.bytes,
            r.ticks,
            rate / 1e6
        ));
        rates.push(rate);
    }
    let ratio = rates[0] / rates[1].max(1.0);
    Ok(format!(
        "Measured by `cargo xtask bench`: the channel self-test (`selftest=channel:N`, before any \
         VMX check) sends `hvprof_samplelog::channel_test`'s synthetic stream through the virtio \
         console and through the UART of QEMU TCG (SeaBIOS) in the same run; the check finds every \
         frame in the capture byte for byte. The time is the sender's own: TSC ticks spent in the \
         channel (in pCPU 0's cost frame), at the TSC rate it calibrated.\n\n\
         | run | records | bytes | ticks in the channel | MB/s |\n|---|---:|---:|---:|---:|\n{rows}\n\
         virtio is {ratio:.0}x the UART. Goal: ≥ 20x.\n"
    ))
}

/// The Linux w41 scenario, for its cost lines.
fn linux_cost_run(config: &RunnerConfig) -> Result<qemu_tests::SerialLog> {
    let scenario = qemu_tests::linux_scenarios::all()
        .into_iter()
        .find(|s| s.name == "bochs-linux-w41")
        .context("no bochs-linux-w41 scenario")?;
    run(&scenario, config)
}

/// pCPU 0's sampling exits, as "N x mean".
fn exit_mean(rows: &[benches::PcpuCost]) -> String {
    rows.first().map_or("—".to_owned(), |r| {
        format!("{} x {}", r.sampling_exits, r.sampling_exit_mean)
    })
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
    let bytes = qemu_tests::emulator::capture_of(&dir)
        .with_context(|| format!("cannot read the capture in {}", dir.display()))?;
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

#[cfg(test)]
mod tests {
    /// `perf report -F sample` as perf 6 prints it: a header of `#` lines, blank lines, one
    /// line per row (an address without a symbol too), a tip at the end.
    #[test]
    fn perf_report_rows_and_samples_are_counted() {
        let text = "# To display the perf.data header info, please use --header/--header-only options.\n\
                    #\n\
                    # Total Lost Samples: 0\n\
                    #\n\
                    # Samples: 1K of event 'cpu-clock'\n\
                    #\n\
                    #  Samples  Command  Shared Object      Symbol\n\
                    # ........  .......  .................  ..................\n\
                    #\n\
                    \x20      1000  xtask    [anon]             [.] 0x00007f0000001234\n\
                    \x20        24  xtask    xtask              [.] xtask::spread::spread_code\n\
                    \x20         3  sh       [kernel.kallsyms]  [k] ___d_drop\n\
                    \n\
                    \n\
                    #\n\
                    # (Tip: Use parent filter to see specific call path: perf report -p <regex>)\n\
                    #\n";
        assert_eq!(super::samples_and_rows(text), (1027, 3));
        assert_eq!(super::samples_and_rows(""), (0, 0));
    }
}
