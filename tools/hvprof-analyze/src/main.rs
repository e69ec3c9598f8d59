//! `hvprof-analyze`: reads a serial capture of hvprof (console text with the sample log's frames
//! in it) and prints the unified profile of the machine, or draws it, or exports it.
//!
//! ```text
//! hvprof-analyze report LOG [--hypervisor ELF] [--image ELF]... [--kernel VMLINUX] [--json] [--top N] [--vm NAME] [--call-graph]
//! hvprof-analyze timeline LOG [...] [-o FILE.svg] [--bins N]
//! hvprof-analyze flamegraph LOG [...] [-o FILE.svg]
//! hvprof-analyze stat LOG [...] [--json]
//! hvprof-analyze script LOG [...] [-o FILE]
//! hvprof-analyze export LOG [...] [--pprof FILE.pb.gz] [--firefox FILE.json]
//! hvprof-analyze html LOG [...] [-o FILE.html]
//! hvprof-analyze decode LOG [--text] [--records]
//! hvprof-analyze record SOURCE -o CAPTURE [--until-end] [--idle-timeout SECS]
//! hvprof-analyze top SOURCE [--window SECS] [--replay] [--speed X] [--batch] [symbol options]
//! ```
//! (`[...]`: the symbol options of `report`.) `docs/ANALYZER.md` describes every command.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};

use hvprof_analyze::live::{record, source, top};
use hvprof_analyze::model::profile::{LoadOptions, Profile};
use hvprof_analyze::model::progress::Progress;
use hvprof_analyze::naming::symbols::Images;
use hvprof_analyze::views::report::{self, Report};
use hvprof_analyze::views::{
    callgraph, chart, firefox, flame, html, pprof, preemption, script, stat, stolen, text,
};

#[derive(Parser)]
#[command(
    name = "hvprof-analyze",
    version,
    about = "The unified profile of a machine running hvprof"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

/// The capture and what names its addresses.
#[derive(Args, Clone)]
struct Input {
    /// The serial capture.
    log: PathBuf,
    /// The hypervisor's ELF, for its function names.
    #[arg(long)]
    hypervisor: Option<PathBuf>,
    /// A guest image (ELF), matched to VMs by build id, else by file name. Repeatable.
    #[arg(long = "image")]
    images: Vec<PathBuf>,
    /// A folder to look in for the hypervisor's and the guests' ELF files by the build ids the
    /// capture carries, when --hypervisor or --image does not name them (files in it, and the
    /// layouts DIR/.build-id/ab/cdef….debug and DIR/<build id>/executable). Repeatable; also
    /// HVPROF_SEARCH_PATH (colon-separated). The capture's folder and the target/ folders above
    /// it and the working directory are looked in too.
    #[arg(long = "search", value_name = "DIR")]
    search: Vec<PathBuf>,
    /// Do not look for ELF files that --hypervisor and --image do not name.
    #[arg(long)]
    no_search: bool,
    /// The Linux guests' kernel (decompressed vmlinux, or the bzImage): kernel functions by
    /// name under [guest.kallsyms], processes by name from the task frames, user functions
    /// from the `--image` named like the process.
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Name the Linux guests' processes from the task frames: the default (kept so that
    /// older command lines still run).
    #[arg(long, hide = true)]
    processes: bool,
    /// The Linux guests' root file system (or the extracted Debian packages): the programs and
    /// shared libraries their processes map (from the mapping frames) are read from here by
    /// path, and used when their build id matches; their separate debug files by build id
    /// (usr/lib/debug/.build-id/, Debian's -dbgsym packages) name the functions of stripped
    /// files, `--image` ones too; the kernel modules the guests loaded are named from their
    /// .ko files in lib/modules/<release>/ (the `--kernel` image's release first).
    #[arg(long, value_name = "DIR")]
    guest_root: Option<PathBuf>,
    /// Only this stretch of host time, in seconds as `script` prints them: `START,END`, either
    /// end may be left open (`2.5,` or `,4`). The samples outside are left out and each vCPU's
    /// scheduling events are cut to it, so steal and idle are of the stretch; exit statistics
    /// and the profiler's cost stay whole-run figures.
    #[arg(long, value_name = "START,END")]
    time: Option<hvprof_analyze::model::window::TimeRange>,
}

/// What names a live stream's addresses (`top`): the options of [`Input`].
#[derive(Args)]
struct SymbolOptions {
    /// The hypervisor's ELF, for its function names.
    #[arg(long)]
    hypervisor: Option<PathBuf>,
    /// A guest image (ELF), matched to VMs by build id, else by file name. Repeatable.
    #[arg(long = "image")]
    images: Vec<PathBuf>,
    /// The Linux guests' kernel: its functions are named once the VM's end frame (its
    /// IA32_LSTAR) has arrived.
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// The Linux guests' root file system (see `report --help`); used for what the mapping
    /// frames name, which arrive at the end of a run.
    #[arg(long, value_name = "DIR")]
    guest_root: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Cmd {
    /// The host-level and guest-level tables (the paper's Tables 3-5).
    Report {
        #[command(flatten)]
        input: Input,
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
        /// Rows per table.
        #[arg(long, default_value_t = 20)]
        top: usize,
        /// Only this VM's guest-level table.
        #[arg(long)]
        vm: Option<String>,
        /// The call graph from the samples' call chains, like `perf report --children -g
        /// caller`: per function its Children% (samples whose stack holds it) and Self%, at the
        /// host level and per VM, the callers and callees of the top functions, the guest code
        /// at the exits the hypervisor's samples caught (exit causes). JSON: "call_graph".
        #[arg(long)]
        call_graph: bool,
        /// Per vCPU, where it was when it lost its pCPU (the function of its last sample before
        /// each preemption), weighted by the steal that followed: a lock holder preempted with
        /// the lock held shows here. Reads the samples a second time. JSON: "preemptions".
        #[arg(long)]
        preemptions: bool,
        /// Per vCPU, who held its pCPU while it was out and runnable (its steal): other vCPUs'
        /// guest code by VM, vCPU and function, the hypervisor by exit reason and function, or
        /// no one (idle); and per pCPU, who stole from whom as a matrix. Reads the samples a
        /// second time. JSON: "stolen".
        #[arg(long)]
        stolen: bool,
    },
    /// Two captures compared by share, B minus A in points (positive: a larger share in B):
    /// per VM (by name) its OS/user/idle/steal shares, its processes (by name, without the pid)
    /// and functions, each capture's samples and share and the change, largest change first;
    /// the host level likewise. Captures of different lengths and pCPU counts compare. The
    /// naming options apply to both.
    Diff {
        /// The first capture, A (with the naming options).
        #[command(flatten)]
        input: Input,
        /// The second capture, B.
        after: PathBuf,
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
        /// Rows per table.
        #[arg(long, default_value_t = 20)]
        top: usize,
    },
    /// Stacked bars over host time per pCPU and per vCPU (SVG): each VM's guest (pCPU rows, one
    /// colour per VM), guest user and kernel (vCPU rows), hypervisor by exit reason, idle, steal.
    Timeline {
        #[command(flatten)]
        input: Input,
        /// Output file (default: standard output).
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Bars (time bins) per row.
        #[arg(long, default_value_t = 120)]
        bins: usize,
    },
    /// A flame graph (SVG, inferno): VM;process;module;function.
    Flamegraph {
        #[command(flatten)]
        input: Input,
        /// Output file (default: standard output).
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// Exit statistics in the manner of `perf kvm stat`: exact from the hypervisor's tables,
    /// estimated from the samples (per VM and per vCPU).
    Stat {
        #[command(flatten)]
        input: Input,
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Every sample as `perf script` text (for FlameGraph, inferno, speedscope, the Firefox
    /// Profiler).
    Script {
        #[command(flatten)]
        input: Input,
        /// Output file (default: standard output).
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// Standard profile files: pprof (gzipped profile.proto) and the Firefox Profiler's format.
    Export {
        #[command(flatten)]
        input: Input,
        /// Write a pprof profile here (`go tool pprof`, `pprof -http`).
        #[arg(long)]
        pprof: Option<PathBuf>,
        /// Write a Firefox Profiler profile (JSON) here.
        #[arg(long)]
        firefox: Option<PathBuf>,
    },
    /// One self-contained HTML page: the tables, the timeline, the flame graph, the exit
    /// statistics.
    Html {
        #[command(flatten)]
        input: Input,
        /// Output file (default: standard output).
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Bars (time bins) per timeline row.
        #[arg(long, default_value_t = 120)]
        bins: usize,
        /// Rows per table.
        #[arg(long, default_value_t = 25)]
        top: usize,
    },
    /// Throughput on a synthetic capture of N samples (the figure `cargo xtask bench` records).
    BenchSynthetic {
        #[arg(default_value_t = 10_000_000)]
        samples: u64,
        /// Also time `script`, `export --pprof` and `export --firefox` on it.
        #[arg(long)]
        exports: bool,
        /// Also write the capture to this file (for timing the commands on it).
        #[arg(long)]
        write: Option<PathBuf>,
        /// Samples carry call chains (the generator's fixed caller tree): times the chain path.
        #[arg(long)]
        chains: bool,
        /// The Linux guests' vCPUs name the task they run in task frames (one every 16 frames),
        /// as a Linux guest's capture does: their samples are then classified by task.
        #[arg(long)]
        tasks: bool,
    },
    /// Writes a live stream to a capture file, byte for byte as it arrives, with a status line
    /// (on a terminal): bytes, frames, samples, events, losses, damage, rate. Stops when the
    /// source ends (socket, pipe), with --until-end, after --idle-timeout, or on Ctrl-C; the
    /// capture is then complete for every other command.
    ///
    /// SOURCE: a file being written (read from its start and followed as it grows, like
    /// `tail -f`: QEMU `-serial file:PATH`); a serial device such as /dev/ttyS0 or /dev/ttyUSB0,
    /// read raw as it is (set its line speed and raw mode first: `stty -F /dev/ttyUSB0 115200
    /// raw -echo`); a named pipe; `-` for standard input; `unix:PATH` for a Unix socket (QEMU
    /// `-chardev socket,id=s,path=PATH,server=on,wait=off -serial chardev:s`); `tcp:HOST:PORT`
    /// (QEMU `-chardev socket,id=s,host=127.0.0.1,port=4555,server=on,wait=off -serial
    /// chardev:s`). Sockets, pipes and standard input are read to their end.
    Record {
        /// Where the stream comes from (see above).
        source: String,
        /// The capture file to write (created, or truncated).
        #[arg(short, long)]
        output: PathBuf,
        /// Stop once the end frame has arrived and the source has then been quiet for a second
        /// (the hypervisor's closing console lines follow the end frame).
        #[arg(long)]
        until_end: bool,
        /// Stop after this many seconds without a byte (default: 5 for a file, never for the
        /// other sources; 0: never).
        #[arg(long, value_name = "SECS")]
        idle_timeout: Option<f64>,
    },
    /// A live view refreshed every second like `perf top`, over the last N seconds of host time
    /// (the log's TSC): the host level (each VM, the hypervisor's functions, idle), each VM's
    /// hottest guest functions, each vCPU's idle and steal (exact, from the scheduling events
    /// in the window: out halted = idle, out otherwise = steal), and the losses so far. Reads
    /// the sources `record` reads, or replays a capture at its recorded speed (--replay). Quit
    /// with q, Esc or Ctrl-C.
    ///
    /// A Linux guest's functions are per process (its task frames, as they arrive), its user
    /// functions named through the process (`--image` named like it, or `--guest-root` once
    /// the mapping frames arrive at the end of a run).
    Top {
        /// Where the stream comes from (as for `record`), or the capture to --replay.
        source: String,
        #[command(flatten)]
        symbols: SymbolOptions,
        /// The window: the last SECS seconds of host time.
        #[arg(long, default_value_t = 10, value_name = "SECS")]
        window: u64,
        /// Replay a capture file at its recorded speed (its records' TSCs).
        #[arg(long)]
        replay: bool,
        /// Replay this many times faster than recorded.
        #[arg(long, default_value_t = 1.0, requires = "replay")]
        speed: f64,
        /// Print each screen as text on standard output (every second, and the last when the
        /// source ends) instead of keeping the terminal.
        #[arg(long)]
        batch: bool,
        /// --batch: the screen's size.
        #[arg(long, default_value_t = 120)]
        width: u16,
        /// --batch: the screen's size.
        #[arg(long, default_value_t = 40)]
        height: u16,
        /// --batch: stop after this many seconds without a byte (default: 5 for a file, never
        /// for the other sources; 0: never).
        #[arg(long, value_name = "SECS")]
        idle_timeout: Option<f64>,
        /// Use the samples' call chains, like `perf top -g`: each function's children share
        /// (the samples whose stack holds it, once each) beside its self share, its callers
        /// included, the rows ranked by it.
        #[arg(long, short = 'g')]
        call_graph: bool,
    },
    /// Makes the unwind table of a guest program built without frame pointers (from its
    /// .eh_frame), for call chains through it: pass the file as a boot module and name it in
    /// the VM's `unwind=` (docs/PROFILER.md). The program must be static and non-PIE.
    UnwindTable {
        /// The program, as the guest runs it (its build id must match).
        program: PathBuf,
        /// Output file (default: PROGRAM.unwind).
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// What a guest program wrote to its stdout or stderr through the output leaf (a VM with
    /// `output=`; `cargo xtask profile` gives its Linux VM one), kept whole in the capture:
    /// its bytes as written, to stdout or a file. Says on stderr how many bytes were lost.
    Output {
        log: PathBuf,
        /// The VM, by name or number (default: the only VM with output in the capture).
        #[arg(long)]
        vm: Option<String>,
        /// The stream.
        #[arg(long, value_enum, default_value = "stdout")]
        stream: OutputStreamArg,
        /// Write it here instead of stdout.
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// What the capture holds: frames, records, losses, console text.
    Decode {
        log: PathBuf,
        /// Print the console text.
        #[arg(long)]
        text: bool,
        /// Print every record.
        #[arg(long)]
        records: bool,
    },
}

fn main() -> ExitCode {
    keep_freed_memory();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        // `hvprof-analyze script LOG | head`: the reader has what it wanted.
        Err(e)
            if e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) =>
        {
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("hvprof-analyze: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Reads the symbol files `input` names (`symbols::Images::load`), and those the capture's build
/// ids find where it does not name them (`naming::discover`), saying which file named what.
fn load_images(input: &Input) -> Result<Images> {
    let mut hypervisor = input.hypervisor.clone();
    let mut images = input.images.clone();
    if !input.no_search
        && let Some(header) = hvprof_analyze::naming::discover::header_of(&input.log)
    {
        // The given images' ids (their notes only: `Images::load` reads them whole below).
        let have: Vec<Vec<u8>> = images
            .iter()
            .filter_map(|p| hvprof_analyze::naming::discover::build_id_of(p))
            .collect();
        let wanted = header.vms.as_slice().iter().any(|v| {
            !v.image_build_id.is_none() && !have.contains(&v.image_build_id.as_bytes().to_vec())
        });
        if hypervisor.is_none() || wanted {
            let dirs = hvprof_analyze::naming::discover::search_dirs(&input.log, &input.search);
            let found =
                hvprof_analyze::naming::discover::find(&header, &dirs, hypervisor.is_none(), &have);
            if let Some(h) = found.hypervisor {
                eprintln!(
                    "hvprof-analyze: the hypervisor named from {} (its build id)",
                    h.display()
                );
                hypervisor = Some(h);
            }
            for (vm, path) in found.images {
                eprintln!(
                    "hvprof-analyze: VM {vm} named from {} (its build id)",
                    path.display()
                );
                images.push(path);
            }
        }
    }
    Images::load(
        hypervisor.as_deref(),
        &images,
        input.kernel.as_deref(),
        input.guest_root.as_deref(),
    )
}

/// The options every command decodes with; `tables` for those that show the report's tables
/// (the exports do not, and then keep no segments), `in_time_order` for those that read the
/// samples again in TSC order (the first pass keeps each sample's TSC and key for them).
fn load_options(input: &Input, tables: bool, in_time_order: bool) -> LoadOptions {
    LoadOptions {
        threads: hvprof_analyze::model::par::cores(),
        // A Linux guest's samples by function and process, as every view names them (`report`
        // named them by address without `--kernel` until 2026-11, user addresses under the
        // kernel's image).
        keep_guest: true,
        tables,
        report_only: false,
        time: input.time,
        top_rows: None,
        keep_samples: in_time_order,
    }
}

/// Decodes and names the capture for a view without the report's tables, with a progress bar
/// on a terminal (see [`load_options`]).
fn load_profile(input: &Input, in_time_order: bool, progress: &Progress) -> Result<Profile> {
    load_profile_with(input, load_options(input, false, in_time_order), progress)
}

/// [`load_profile`] with `options`.
fn load_profile_with(input: &Input, options: LoadOptions, progress: &Progress) -> Result<Profile> {
    let images = load_images(input)?;
    let p = Profile::load(&input.log, &images, options, progress)?;
    warn(&p, progress);
    Ok(p)
}

/// [`load_profile_with`], and the report built from the profile.
fn load_report_with(
    input: &Input,
    options: LoadOptions,
    progress: &Progress,
) -> Result<(Profile, Report)> {
    let images = load_images(input)?;
    let (p, r) = report::load(&input.log, &images, options, progress)?;
    warn(&p, progress);
    Ok((p, r))
}

/// The profile's warnings, on stderr.
fn warn(p: &Profile, progress: &Progress) {
    for w in &p.warnings {
        progress.warn(&format!("hvprof-analyze: warning: {w}"));
    }
}

/// Standard output, or a file created for writing.
fn output(path: Option<&Path>) -> Result<Box<dyn Write>> {
    Ok(match path {
        None => Box::new(std::io::BufWriter::with_capacity(
            1 << 20,
            std::io::stdout().lock(),
        )),
        Some(p) if p.as_os_str() == "-" => Box::new(std::io::BufWriter::with_capacity(
            1 << 20,
            std::io::stdout().lock(),
        )),
        Some(p) => Box::new(std::io::BufWriter::with_capacity(
            1 << 20,
            std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))?,
        )),
    })
}

/// The capture's file name, for titles (with its folder for a scenario's `serial.log`).
fn source_name(log: &Path) -> String {
    let name = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned());
    match (name(log), log.parent().and_then(name)) {
        (Some(f), Some(dir)) if f == "serial.log" => format!("{dir}/{f}"),
        (Some(f), _) => f,
        (None, _) => log.display().to_string(),
    }
}

/// An output file created on another thread while the caller computes what goes in it: when it
/// replaces a large file, emptying the old one takes the kernel tens of milliseconds (some
/// 50 ms for a 260 MB Firefox profile). The first write waits for it; a file that cannot be
/// created fails that write, with its path.
struct Opening {
    pending: Option<std::thread::JoinHandle<std::io::Result<std::fs::File>>>,
    file: Option<std::io::BufWriter<std::fs::File>>,
}

impl Opening {
    fn start(path: &Path) -> Opening {
        let path = path.to_path_buf();
        Opening {
            pending: Some(std::thread::spawn(move || {
                std::fs::File::create(&path).map_err(|e| {
                    std::io::Error::new(e.kind(), format!("cannot create {}: {e}", path.display()))
                })
            })),
            file: None,
        }
    }

    /// The file, once created.
    fn file(&mut self) -> std::io::Result<&mut std::io::BufWriter<std::fs::File>> {
        if let Some(pending) = self.pending.take() {
            let file = pending
                .join()
                .unwrap_or_else(|e| std::panic::resume_unwind(e))?;
            self.file = Some(std::io::BufWriter::with_capacity(1 << 20, file));
        }
        self.file
            .as_mut()
            .ok_or_else(|| std::io::Error::other("the output file could not be created"))
    }
}

impl Write for Opening {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.file()?.write(buf)
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        self.file()?.write_all(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file()?.flush()
    }
}

fn finish(mut out: Box<dyn Write>, what: Option<&Path>) -> Result<()> {
    out.flush().with_context(|| match what {
        Some(p) => format!("cannot write {}", p.display()),
        None => "cannot write to standard output".into(),
    })
}

fn run(cli: Cli) -> Result<()> {
    let progress = Progress::new();
    let result = run_with(cli, &progress);
    progress.finish();
    result
}

fn run_with(cli: Cli, progress: &Progress) -> Result<()> {
    match cli.command {
        Cmd::Diff {
            input,
            after,
            json,
            top,
        } => {
            let mut reports = Vec::new();
            for log in [input.log.clone(), after] {
                let input = Input {
                    log: log.clone(),
                    ..input.clone()
                };
                let bytes = hvprof_analyze::model::capture::Capture::open(&log)?;
                let imgs = load_images(&input)?;
                let options = LoadOptions {
                    report_only: true,
                    top_rows: None,
                    ..load_options(&input, true, false)
                };
                let (p, r) = report::from_capture(bytes, &imgs, options, progress);
                p.is_capture(&log)?;
                reports.push(r);
            }
            let d = hvprof_analyze::views::diff::diff(&reports[0], &reports[1]);
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            if json {
                serde_json::to_writer_pretty(&mut out, &d)?;
                writeln!(out)?;
            } else {
                hvprof_analyze::views::diff::write_text(&mut out, &d, top)?;
            }
            out.flush()?;
            Ok(())
        }
        Cmd::Report {
            input,
            json,
            top,
            vm,
            call_graph,
            preemptions,
            stolen,
        } => {
            let log = &input.log;
            let bytes = hvprof_analyze::model::capture::Capture::open(log)?;
            let imgs = load_images(&input)?;
            // A capture without samples still gets its report (what was lost, the warnings).
            // The call graph needs every stack and chain named, the preemptions every guest
            // stack.
            // The text report shows the first `top` rows of each table: only those are made
            // (the JSON report has every row).
            let options = LoadOptions {
                report_only: !call_graph && !preemptions && !stolen,
                top_rows: (!json).then_some(top),
                ..load_options(&input, true, preemptions || stolen)
            };
            let (p, mut r) = report::from_capture(bytes, &imgs, options, progress);
            p.is_capture(log)?;
            if let Some(name) = vm.as_deref()
                && !r.vms.iter().any(|v| v.name == name)
            {
                let names: Vec<&str> = r.vms.iter().map(|v| v.name.as_str()).collect();
                bail!(
                    "--vm {name}: no VM of that name in {} (its VMs: {})",
                    log.display(),
                    if names.is_empty() {
                        "none".to_owned()
                    } else {
                        names.join(", ")
                    }
                );
            }
            progress.phase("tables", None, "rows");
            r.call_graph = call_graph.then(|| callgraph::build(&p));
            if preemptions {
                r.preemptions = Some(preemption::build(&p)?);
            }
            if stolen {
                r.stolen = Some(stolen::build(&p)?);
            }
            if json {
                // Written as it is made: with every row of every table (a capture without
                // symbols has one per address), the text can be larger than the report.
                let mut out = std::io::BufWriter::new(std::io::stdout().lock());
                serde_json::to_writer_pretty(&mut out, &r).map_err(std::io::Error::from)?;
                writeln!(out)?;
                out.flush()?;
            } else {
                // Through a writer, so that a reader that stops early (`| head`) ends it
                // quietly (print! panics on a closed pipe).
                let mut out = std::io::stdout().lock();
                out.write_all(text::render(&r, top, vm.as_deref()).as_bytes())?;
                if let Some(g) = &r.call_graph {
                    write!(out, "\n{}", callgraph::render(g, top, vm.as_deref()))?;
                }
                if let Some(v) = &r.preemptions {
                    out.write_all(preemption::render(v, top, r.tsc_hz).as_bytes())?;
                }
                if let Some(s) = &r.stolen {
                    out.write_all(stolen::render(s, top).as_bytes())?;
                }
                out.flush()?;
            }
            exiting((p, r));
            Ok(())
        }
        Cmd::Timeline {
            input,
            output: path,
            bins,
        } => {
            if bins == 0 {
                bail!("--bins must be at least 1");
            }
            let p = load_profile(&input, true, progress)?;
            let mut out = output(path.as_deref())?;
            chart::write(
                &p,
                bins,
                &format!("hvprof timeline: {}", source_name(&input.log)),
                &mut out,
            )?;
            finish(out, path.as_deref())
        }
        Cmd::Flamegraph {
            input,
            output: path,
        } => {
            let p = load_profile(&input, false, progress)?;
            let mut out = output(path.as_deref())?;
            flame::write(
                &p,
                &format!("hvprof flame graph: {}", source_name(&input.log)),
                true,
                &mut out,
            )?;
            finish(out, path.as_deref())
        }
        Cmd::Stat { input, json } => {
            let p = load_profile(&input, false, progress)?;
            let s = stat::build(&p);
            if json {
                let mut out = std::io::stdout().lock();
                serde_json::to_writer_pretty(&mut out, &s).map_err(std::io::Error::from)?;
                writeln!(out)?;
            } else {
                std::io::stdout()
                    .lock()
                    .write_all(stat::render(&s).as_bytes())?;
            }
            Ok(())
        }
        Cmd::Script {
            input,
            output: path,
        } => {
            let p = load_profile(&input, true, progress)?;
            let mut out = output(path.as_deref())?;
            script::write(&p, &mut out, progress)
                .with_context(|| "cannot write the perf script text")?;
            exiting(p);
            finish(out, path.as_deref())
        }
        Cmd::Export {
            input,
            pprof: pprof_path,
            firefox: firefox_path,
        } => {
            if pprof_path.is_none() && firefox_path.is_none() {
                bail!("export: say what to write: --pprof FILE and/or --firefox FILE");
            }
            // The Firefox profile holds every sample in time order.
            let options = load_options(&input, false, firefox_path.is_some());
            let p = load_profile_with(&input, options, progress)?;
            // Each file is created (an old one emptied) while its export is computed.
            let opening = |path: &Option<PathBuf>| -> Result<Option<Box<dyn Write>>> {
                Ok(match path.as_deref() {
                    Some(p) if p.as_os_str() != "-" => Some(Box::new(Opening::start(p))),
                    Some(p) => Some(output(Some(p))?),
                    None => None,
                })
            };
            let (pprof_out, firefox_out) = (opening(&pprof_path)?, opening(&firefox_path)?);
            if let (Some(path), Some(mut out)) = (&pprof_path, pprof_out) {
                pprof::write(&p, &mut out, progress)?;
                finish(out, Some(path))?;
            }
            if let (Some(path), Some(mut out)) = (&firefox_path, firefox_out) {
                firefox::write(&p, &mut out, progress)?;
                finish(out, Some(path))?;
            }
            exiting(p);
            Ok(())
        }
        Cmd::Html {
            input,
            output: path,
            bins,
            top,
        } => {
            if bins == 0 {
                bail!("--bins must be at least 1");
            }
            // The page shows the first `top` rows of each table: only those are made.
            let options = LoadOptions {
                top_rows: Some(top),
                ..load_options(&input, true, true)
            };
            let (p, r) = load_report_with(&input, options, progress)?;
            let page = html::render(&p, &r, &source_name(&input.log), bins, top)?;
            let mut out = output(path.as_deref())?;
            out.write_all(page.as_bytes())?;
            finish(out, path.as_deref())
        }
        Cmd::BenchSynthetic {
            samples,
            exports,
            write,
            chains,
            tasks,
        } => bench_synthetic(samples, exports, write.as_deref(), chains, tasks),
        Cmd::Record {
            source,
            output,
            until_end,
            idle_timeout,
        } => run_record(&source, &output, until_end, idle_timeout),
        Cmd::Top {
            source,
            symbols,
            window,
            replay,
            speed,
            batch,
            width,
            height,
            idle_timeout,
            call_graph,
        } => {
            if window == 0 {
                bail!("--window must be at least 1 second");
            }
            let src = source::Source::parse(&source);
            let reader = if replay {
                let source::Source::File(path) = &src else {
                    bail!("--replay reads a capture file, not {src}");
                };
                source::Reader::replay(path, speed)?
            } else {
                source::Reader::open(&src)?
            };
            let images = Images::load(
                symbols.hypervisor.as_deref(),
                &symbols.images,
                symbols.kernel.as_deref(),
                symbols.guest_root.as_deref(),
            )?;
            let interrupted = interrupt_flag()?;
            let options = top::TopOptions {
                window,
                title: if replay {
                    format!("{src} (replay x{speed})")
                } else {
                    src.to_string()
                },
                batch: batch.then_some((width.max(40), height.max(12))),
                idle_timeout: idle(idle_timeout, &src)?,
                call_graph,
            };
            top::run(
                &reader,
                &images,
                &options,
                &interrupted,
                &mut std::io::stdout().lock(),
            )
        }
        Cmd::UnwindTable { program, output } => {
            let elf = std::fs::read(&program)
                .with_context(|| format!("cannot read {}", program.display()))?;
            let (table, s) = linux_guest::unwind::unwind_table(&elf)
                .with_context(|| program.display().to_string())?;
            let out = output.unwrap_or_else(|| {
                let mut p = program.clone().into_os_string();
                p.push(".unwind");
                PathBuf::from(p)
            });
            std::fs::write(&out, &table)
                .with_context(|| format!("cannot write {}", out.display()))?;
            println!(
                "{}: {} entries for {} functions ({} without a rule: frame pointers there), \
                 {:#x}-{:#x}, build id {}, {} bytes",
                out.display(),
                s.entries,
                s.fdes,
                s.no_rule,
                s.start,
                s.end,
                s.build_id,
                table.len()
            );
            Ok(())
        }
        Cmd::Output {
            log,
            vm,
            stream,
            output,
        } => run_output(&log, vm.as_deref(), stream, output.as_deref()),
        Cmd::Decode { log, text, records } => {
            let bytes = hvprof_analyze::model::capture::Capture::open(&log)?;
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            if records {
                // Every record, each pCPU's in order: the capture decoded whole.
                let d = hvprof_samplelog::decode(&bytes);
                let counted = |l: &hvprof_samplelog::PcpuLog| l.records.len() as u64;
                text::write_decode_summary(&mut out, &d, &counted, text, true)?;
            } else {
                // Its description, and each pCPU's records counted (on every core), not kept.
                let (d, parts) = hvprof_samplelog::decode_parallel(
                    &bytes,
                    hvprof_analyze::model::par::cores(),
                    std::collections::BTreeMap::<u16, u64>::new,
                    |counts, at, records: &[hvprof_samplelog::Record], _| {
                        *counts.entry(at.header.pcpu).or_default() += records.len() as u64;
                    },
                );
                let mut counts: std::collections::BTreeMap<u16, u64> = Default::default();
                for (pcpu, n) in parts.into_iter().flatten() {
                    *counts.entry(pcpu).or_default() += n;
                }
                let counted =
                    |l: &hvprof_samplelog::PcpuLog| counts.get(&l.pcpu).copied().unwrap_or(0);
                text::write_decode_summary(&mut out, &d, &counted, text, false)?;
            }
            out.flush()?;
            Ok(())
        }
    }
}

/// `output --stream`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum OutputStreamArg {
    Stdout,
    Stderr,
}

/// `output`: one VM's stream of guest output from the capture.
fn run_output(
    log: &Path,
    vm: Option<&str>,
    stream: OutputStreamArg,
    to: Option<&Path>,
) -> Result<()> {
    let bytes = hvprof_analyze::model::capture::Capture::open(log)?;
    let (d, _) = hvprof_samplelog::decode_parallel(
        &bytes,
        hvprof_analyze::model::par::cores(),
        || (),
        |_, _, _, _| {},
    );
    let vms: Vec<(u16, String)> = d
        .header
        .as_ref()
        .map(|h| {
            h.vms
                .iter()
                .map(|v| (v.id, v.name.as_str().to_owned()))
                .collect()
        })
        .unwrap_or_default();
    let with_output: std::collections::BTreeSet<u16> = d
        .output
        .keys()
        .map(|(v, _)| *v)
        .chain(d.output_lost.keys().copied())
        .collect();
    let name_of = |id: u16| {
        vms.iter()
            .find(|(i, _)| *i == id)
            .map_or_else(|| format!("{id}"), |(_, n)| n.clone())
    };
    let id = match vm {
        Some(v) => vms
            .iter()
            .find(|(_, n)| n == v)
            .map(|(i, _)| *i)
            .or_else(|| v.parse().ok())
            .with_context(|| format!("--vm {v}: no such VM in {}", log.display()))?,
        None => match with_output.iter().collect::<Vec<_>>().as_slice() {
            [one] => **one,
            [] => anyhow::bail!(
                "{}: no guest output in the capture (a VM needs output= in its module line, and a program that writes to the output leaf: docs/GUEST-ABI.md)",
                log.display()
            ),
            many => anyhow::bail!(
                "{}: output of several VMs ({}): say which with --vm",
                log.display(),
                many.iter()
                    .map(|v| name_of(**v))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        },
    };
    let key = match stream {
        OutputStreamArg::Stdout => hvprof_samplelog::OutputStream::Stdout,
        OutputStreamArg::Stderr => hvprof_samplelog::OutputStream::Stderr,
    };
    let data = d.output.get(&(id, key)).map_or(&[][..], Vec::as_slice);
    match to {
        Some(p) => {
            std::fs::write(p, data).with_context(|| format!("cannot write {}", p.display()))?
        }
        None => std::io::stdout().lock().write_all(data)?,
    }
    if let Some(lost) = d.output_lost.get(&id) {
        eprintln!(
            "hvprof-analyze: VM {}: {lost} bytes of its output were lost (the hypervisor's store for it was full: a larger output=)",
            name_of(id)
        );
    }
    Ok(())
}

/// Sets a flag on Ctrl-C (and on a termination signal) instead of dying.
fn interrupt_flag() -> Result<std::sync::Arc<std::sync::atomic::AtomicBool>> {
    let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let set = flag.clone();
    ctrlc::set_handler(move || set.store(true, std::sync::atomic::Ordering::Relaxed))
        .context("cannot handle Ctrl-C")?;
    Ok(flag)
}

/// `--idle-timeout`: given in seconds (0: never), else the source's default.
fn idle(secs: Option<f64>, src: &source::Source) -> Result<Option<std::time::Duration>> {
    match secs {
        None => Ok(src.default_idle_timeout()),
        Some(0.0) => Ok(None),
        Some(s) => std::time::Duration::try_from_secs_f64(s)
            .map(Some)
            .map_err(|_| anyhow::anyhow!("--idle-timeout must be a number of seconds")),
    }
}

/// `record`: the stream into the capture, with the status on stderr (a live line on a terminal,
/// else the final summary only).
fn run_record(
    source: &str,
    output: &Path,
    until_end: bool,
    idle_timeout: Option<f64>,
) -> Result<()> {
    use std::io::IsTerminal;
    let src = source::Source::parse(source);
    let options = record::RecordOptions {
        until_end,
        idle_timeout: idle(idle_timeout, &src)?,
        ..record::RecordOptions::default()
    };
    if let source::Source::File(input) = &src
        && let (Ok(a), Ok(b)) = (input.canonicalize(), output.canonicalize())
        && a == b
    {
        bail!(
            "record: {} is the source; write the capture elsewhere",
            output.display()
        );
    }
    let reader = source::Reader::open(&src)?;
    let mut file = std::fs::File::create(output)
        .with_context(|| format!("cannot create {}", output.display()))?;
    let interrupted = interrupt_flag()?;
    let tty = std::io::stderr().is_terminal();
    let mut on_status = |s: &record::Status| {
        if tty {
            eprint!("\r\x1b[2Krecording {src}: {}", s.line());
        }
    };
    let recorded = record::record(&reader, &mut file, &options, &interrupted, &mut on_status)
        .with_context(|| format!("cannot write {}", output.display()))?;
    if tty {
        eprint!("\r\x1b[2K");
    }
    eprintln!(
        "recorded {src} into {} ({}): {}",
        output.display(),
        recorded.stop,
        recorded.status.line()
    );
    let d = &recorded.decoded;
    if !d.end_seen() {
        eprintln!(
            "no end frame: what the hypervisor sent after the last block received is unknown"
        );
    }
    match recorded.stop {
        record::Stop::Failed(e) => bail!("reading {src} failed: {e}"),
        _ => Ok(()),
    }
}

/// Generates a realistic synthetic capture (hvprof-samplelog's generator: 4 pCPUs, several VMs,
/// hot functions, jitter; with `chains`, call chains), then times decoding and the report's
/// aggregation.
fn bench_synthetic(
    samples: u64,
    exports: bool,
    write: Option<&Path>,
    chains: bool,
    tasks: bool,
) -> Result<()> {
    use hvprof_samplelog::synth::{self, CaptureOptions, SynthConfig};
    use std::time::Instant;
    let pcpus = 4u16;
    let cfg = SynthConfig {
        pcpus,
        samples_per_pcpu: samples.div_ceil(u64::from(pcpus)),
        chains,
        ..SynthConfig::default()
    };
    let cap = synth::capture(
        &cfg,
        &CaptureOptions {
            keep_records: false,
            ..CaptureOptions::default()
        },
    );
    let mut cap = cap;
    if tasks {
        // The capture's time: from the generator's boot (40 to 41 s of TSC), each pCPU's
        // samples a period apart.
        let from = 40 * cfg.tsc_hz;
        let span = cfg.tsc_hz + cap.samples / u64::from(pcpus) * cap.header.period_ticks;
        cap.bytes = with_task_frames(&cap.bytes, &cap.header, from..from + span);
    }
    let n = cap.samples as f64;
    println!(
        "capture: {} samples, {} bytes ({:.3} bytes/sample)",
        cap.samples,
        cap.bytes.len(),
        cap.bytes.len() as f64 / n
    );
    if let Some(path) = write {
        std::fs::write(path, &cap.bytes)
            .with_context(|| format!("cannot write {}", path.display()))?;
        println!("written to {}", path.display());
    }
    let options = |threads, tables| LoadOptions {
        threads,
        keep_guest: false,
        tables,
        report_only: tables,
        time: None,
        top_rows: None,
        keep_samples: false,
    };
    for threads in [1, hvprof_analyze::model::par::cores()] {
        let t = Instant::now();
        let (_, r) = report::from_bytes(
            &cap.bytes,
            &Images::default(),
            options(threads, true),
            &Progress::hidden(),
        );
        let took = t.elapsed();
        println!(
            "report on {threads} thread(s): {:.2?} for decoding, classifying, naming and the tables: {:.1} M samples/s ({} samples reported)",
            took,
            n / took.as_secs_f64() / 1e6,
            r.total_samples
        );
    }
    if exports {
        // As the exports read it: with each sample kept by the first pass (`script` and the
        // Firefox profile read them again in time order).
        let p = Profile::from_bytes(
            &cap.bytes,
            &Images::default(),
            LoadOptions {
                keep_samples: true,
                ..options(hvprof_analyze::model::par::cores(), false)
            },
            &Progress::hidden(),
        );
        println!(
            "profile: {} distinct stacks, {} frames",
            p.samples.stacks().len(),
            p.frames.len()
        );
        let rate = |took: std::time::Duration| n / took.as_secs_f64() / 1e6;
        let mut sink = Counting(0);
        let t = Instant::now();
        script::write(&p, &mut sink, &Progress::hidden())?;
        let took = t.elapsed();
        println!(
            "script: {took:.2?}, {:.1} M samples/s, {:.1} MB of text",
            rate(took),
            sink.0 as f64 / 1e6
        );
        let mut sink = Counting(0);
        let t = Instant::now();
        pprof::write(&p, &mut sink, &Progress::hidden())?;
        let took = t.elapsed();
        println!(
            "pprof: {took:.2?}, {:.1} M samples/s, {:.2} MB gzipped",
            rate(took),
            sink.0 as f64 / 1e6
        );
        let mut sink = Counting(0);
        let t = Instant::now();
        firefox::write(&p, &mut sink, &Progress::hidden())?;
        let took = t.elapsed();
        println!(
            "firefox: {took:.2?}, {:.1} M samples/s, {:.1} MB of JSON",
            rate(took),
            sink.0 as f64 / 1e6
        );
    }
    Ok(())
}

/// `bytes` with a task frame after every 16th frame delimiter, for each Linux guest's vCPUs in
/// turn (a guest whose image is a bzImage), their times stepping through `time` (TSC).
fn with_task_frames(
    bytes: &[u8],
    header: &hvprof_samplelog::Header,
    time: std::ops::Range<u64>,
) -> Vec<u8> {
    use hvprof_samplelog::{FixedStr, MAX_TASK_FRAME_LEN, Task, encode_task};
    let vcpus: Vec<(u16, u16)> = header
        .vms
        .iter()
        .filter(|v| v.image.as_str().starts_with("bzImage"))
        .flat_map(|v| (0..v.vcpus).map(move |c| (v.id, c)))
        .collect();
    let comms = ["nginx", "postgres", "w41", "sshd", "kworker/0:1"];
    let mut out = Vec::with_capacity(bytes.len() + bytes.len() / 16);
    let mut frame = [0u8; MAX_TASK_FRAME_LEN];
    let step =
        (time.end - time.start) / (bytes.iter().filter(|&&b| b == 0).count() as u64 / 16).max(1);
    let mut zeros = 0u64;
    for &b in bytes {
        out.push(b);
        if b != 0 || vcpus.is_empty() {
            continue;
        }
        zeros += 1;
        if !zeros.is_multiple_of(16) {
            continue;
        }
        let k = zeros / 16;
        let (vm, vcpu) = vcpus[k as usize % vcpus.len()];
        let pid = 100 + (k % 50) as u32;
        let t = Task {
            pcpu: (k % u64::from(header.pcpus.max(1))) as u16,
            tsc: time.start + k * step,
            vm,
            vcpu,
            cr3: 0x1_0000_0000 + (k % 5) * 0x1000,
            task: 0xffff_8880_0000_0000 + u64::from(pid) * 0x1000,
            pid,
            tgid: pid,
            comm: FixedStr::truncated(comms[k as usize % comms.len()]),
        };
        if let Ok(n) = encode_task(&t, &mut frame) {
            out.extend_from_slice(&frame[..n]);
        }
    }
    out
}

/// A writer that only counts bytes.
struct Counting(u64);

impl Write for Counting {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The profile of a command that ends next, not dropped: the process's memory goes back to
/// the system at once when it exits, instead of its hundreds of thousands of strings (frames,
/// table rows) being freed one by one first.
fn exiting<T>(p: T) {
    std::mem::forget(p);
}

/// The analyzer allocates and frees a string per distinct function, frame and table row (a
/// synthetic 10 M-sample capture without symbols has some 300,000): mimalloc does that several
/// times faster than the system allocator (`cargo xtask bench` measures the whole).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (its number in `mi_option_e`, mimalloc.h, the same in
/// mimalloc 2 and 3; libmimalloc-sys names no constant for it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Tells mimalloc never to give the memory the analyzer frees back to the system (`-1`: no
/// purging), instead of after 10 ms. The analyzer is a short run whose tables grow by doubling
/// and whose phases free what the next one allocates again: memory given back is faulted in
/// and zeroed again by the kernel when it is reused, which cost a 10 M-sample `report` a
/// third of its system time (`cargo xtask bench` measures the whole). Memory goes back to the
/// system when the process exits, a moment later.
fn keep_freed_memory() {
    // SAFETY: `mi_option_set` only stores the option's value (mimalloc's options are plain
    // integers read when it decides to purge); the option number is mimalloc's own.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
}
