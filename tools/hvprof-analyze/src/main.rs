//! `hvprof-analyze`: reads a serial capture of hvprof (console text with the sample log's frames
//! in it) and prints the unified profile of the machine.
//!
//! ```text
//! hvprof-analyze report LOG [--hypervisor ELF] [--image ELF]... [--kernel VMLINUX] [--json] [--top N] [--vm NAME]
//! hvprof-analyze decode LOG [--text] [--records]
//! ```

use hvprof_analyze::{report, symbols, text};

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

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

#[derive(Subcommand)]
enum Cmd {
    /// The host-level and guest-level tables (the paper's Tables 3-5).
    Report {
        /// The serial capture.
        log: PathBuf,
        /// The hypervisor's ELF, for its function names.
        #[arg(long)]
        hypervisor: Option<PathBuf>,
        /// A guest image (ELF), matched to VMs by build id, else by file name. Repeatable.
        #[arg(long = "image")]
        images: Vec<PathBuf>,
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
        /// Rows per table.
        #[arg(long, default_value_t = 20)]
        top: usize,
        /// Only this VM's guest-level table.
        #[arg(long)]
        vm: Option<String>,
        /// The Linux guests' kernel (decompressed vmlinux, or the bzImage): kernel functions by
        /// name under [guest.kallsyms], processes by name from the task frames, user functions
        /// from the `--image` named like the process.
        #[arg(long)]
        kernel: Option<PathBuf>,
        /// Name the Linux guests' processes from the task frames even without `--kernel`.
        #[arg(long)]
        processes: bool,
    },
    /// Throughput on a synthetic capture of N samples (the figure `cargo xtask bench` records).
    BenchSynthetic {
        #[arg(default_value_t = 10_000_000)]
        samples: u64,
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
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hvprof-analyze: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Cmd::Report {
            log,
            hypervisor,
            images,
            json,
            top,
            vm,
            kernel,
            processes,
        } => {
            let bytes =
                std::fs::read(&log).with_context(|| format!("cannot read {}", log.display()))?;
            let mut imgs = report::Images::default();
            if let Some(k) = &kernel {
                let image = if linux_guest::BzImage::parse(
                    &std::fs::read(k).with_context(|| format!("cannot read {}", k.display()))?,
                )
                .is_ok()
                {
                    linux_guest::KernelImage::from_bzimage(k)
                } else {
                    linux_guest::KernelImage::from_vmlinux(k)
                };
                imgs.kernel = Some(image.with_context(|| {
                    format!(
                        "{}: not a Linux kernel image hvprof-analyze can read",
                        k.display()
                    )
                })?);
            }
            let (decoded, agg) = report::analyze(&bytes, threads(), kernel.is_some() || processes);
            if let Some(h) = hypervisor {
                match symbols::Symbols::load(&h) {
                    Ok(s) => imgs.hypervisor = Some(s),
                    Err(e) => {
                        eprintln!("hvprof-analyze: warning: {e:#}; hypervisor addresses stay hex")
                    }
                }
            }
            for i in images {
                match symbols::Symbols::load(&i) {
                    Ok(s) if s.is_empty() => eprintln!(
                        "hvprof-analyze: warning: {} has no function symbols (stripped?)",
                        i.display()
                    ),
                    Ok(s) => imgs.guests.push(s),
                    Err(e) => eprintln!("hvprof-analyze: warning: {e:#}"),
                }
            }
            let r = report::build_from(&decoded, agg, &imgs);
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                print!("{}", text::render(&r, top, vm.as_deref()));
            }
            Ok(())
        }
        Cmd::BenchSynthetic { samples } => {
            bench_synthetic(samples);
            Ok(())
        }
        Cmd::Decode { log, text, records } => {
            let bytes =
                std::fs::read(&log).with_context(|| format!("cannot read {}", log.display()))?;
            let d = hvprof_samplelog::decode(&bytes);
            print!("{}", text::decode_summary(&d, text, records));
            Ok(())
        }
    }
}

/// Generates a realistic synthetic capture (hvprof-samplelog's generator: 4 pCPUs, several VMs,
/// hot functions, jitter), then times decoding and the report's aggregation.
fn bench_synthetic(samples: u64) {
    use hvprof_samplelog::synth::{self, CaptureOptions, SynthConfig};
    use std::time::Instant;
    let pcpus = 4u16;
    let cfg = SynthConfig {
        pcpus,
        samples_per_pcpu: samples.div_ceil(u64::from(pcpus)),
        ..SynthConfig::default()
    };
    let cap = synth::capture(
        &cfg,
        &CaptureOptions {
            keep_records: false,
            ..CaptureOptions::default()
        },
    );
    let n = cap.samples as f64;
    println!(
        "capture: {} samples, {} bytes ({:.3} bytes/sample)",
        cap.samples,
        cap.bytes.len(),
        cap.bytes.len() as f64 / n
    );
    for threads in [1, threads()] {
        let t = Instant::now();
        let (decoded, agg) = report::analyze(&cap.bytes, threads, false);
        let r = report::build_from(&decoded, agg, &report::Images::default());
        let took = t.elapsed();
        println!(
            "report on {threads} thread(s): {:.2?} for decoding, counting and the tables: {:.1} M samples/s ({} samples reported)",
            took,
            n / took.as_secs_f64() / 1e6,
            r.total_samples
        );
    }
}

/// Decoder threads: the machine's cores, at most 8.
fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}
