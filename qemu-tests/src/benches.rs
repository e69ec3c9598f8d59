//! Benchmarks that run in Bochs, where a TSC delta counts instructions: exact, reproducible path
//! lengths. `cargo xtask bench` runs them and records the figures in `docs/BENCHMARKS.md`.

use crate::emulator::Emulator;
use crate::log::SerialLog;
use crate::runner::{ModuleSource, Scenario};
use crate::scenarios::HASWELL;

/// Rounds of each exiting instruction the guest times itself.
pub const ROUNDS: u64 = 1000;

/// VM-exit handler path lengths: the `busy` guest runs CPUID, OUT to an unused port and the
/// VERSION hypercall, times each round trip with RDTSC, and spins long enough for the
/// VMX-preemption timer to fire at a 100,000-tick period.
pub fn exit_paths() -> Scenario {
    Scenario::new("bench-exit-paths", Emulator::bochs(HASWELL))
        .cmdline("period=100000ticks slice=1000ms")
        .module(
            "busy.elf",
            ModuleSource::Guest("busy"),
            &format!(
                "vm=bench spin=2000000 cpuid={ROUNDS} io={ROUNDS} vmcall={ROUNDS} measure={ROUNDS}"
            ),
        )
        .check(|log| exit_path_figures(log).map(drop))
}

/// One row of the exit-path table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitPath {
    pub reason: &'static str,
    pub count: u64,
    pub min: u64,
    pub mean: u64,
    /// The guest-measured round trip (RDTSC before and after the instruction), where measured.
    pub round_trip: Option<u64>,
}

/// The figures of a finished `bench-exit-paths` run.
pub fn exit_path_figures(log: &SerialLog) -> Result<Vec<ExitPath>, String> {
    let round_trips = log
        .expect("[bench] busy: round trip ")?
        .split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| {
            v.parse::<u64>()
                .map(|v| (k.to_owned(), v))
                .map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, _>>()?;
    let trip = |k: &str| round_trips.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
    let exits = vm_exits(log, "bench")?;
    [
        ("CPUID", trip("cpuid")),
        ("IO_INSTRUCTION", trip("io")),
        ("VMCALL", trip("vmcall")),
        ("PREEMPTION_TIMER", None),
    ]
    .into_iter()
    .map(|(reason, round_trip)| {
        let r = exit_row(&exits, reason)?;
        Ok(ExitPath {
            reason,
            count: r.count,
            min: r.min,
            mean: r.mean(),
            round_trip,
        })
    })
    .collect()
}

/// A VM's exit statistics from its VM end frame in the capture `log` holds (the console's table
/// says the same for people; it is not read).
pub fn vm_exits(log: &SerialLog, vm: &str) -> Result<hvprof_samplelog::ExitStats, String> {
    let d = hvprof_samplelog::decode(log.raw());
    let id = d
        .header
        .as_ref()
        .and_then(|h| h.vms.iter().find(|v| v.name.as_str() == vm))
        .map(|v| v.id)
        .ok_or_else(|| format!("no VM {vm:?} in the capture's header"))?;
    d.vm_ends
        .into_iter()
        .rev()
        .find(|e| e.vm == id)
        .map(|e| e.exits)
        .ok_or_else(|| format!("no VM end frame for VM {vm:?} in the capture"))
}

/// The row of the exit named `reason` (`CPUID`, `PREEMPTION_TIMER`, ...).
fn exit_row(
    exits: &hvprof_samplelog::ExitStats,
    reason: &str,
) -> Result<hvprof_samplelog::ReasonStats, String> {
    exits
        .reasons()
        .find(|(r, _)| hvprof_analyze::naming::namer::exit_name(*r) == reason)
        .map(|(_, s)| *s)
        .ok_or_else(|| format!("no {reason} exit in the VM end frame"))
}

/// A capture as the hypervisor sends it: `text`, a header naming VM 0 `bench`, and VM 0's end
/// frame with `exits`.
#[cfg(test)]
pub(crate) fn capture_with_exits(text: &str, exits: hvprof_samplelog::ExitStats) -> SerialLog {
    use hvprof_samplelog::{
        FixedStr, Header, MAX_HEADER_FRAME_LEN, MAX_VM_END_FRAME_LEN, VmEnd, VmInfo, encode_header,
        encode_vm_end,
    };
    let mut header = Header::default();
    header
        .vms
        .push(VmInfo {
            id: 0,
            name: FixedStr::truncated("bench"),
            vcpus: 1,
            ..VmInfo::default()
        })
        .unwrap();
    let mut bytes = text.as_bytes().to_vec();
    let mut buf = vec![0u8; MAX_HEADER_FRAME_LEN.max(MAX_VM_END_FRAME_LEN)];
    let n = encode_header(&header, &mut buf).unwrap();
    bytes.extend_from_slice(&buf[..n]);
    let end = VmEnd {
        vm: 0,
        exits,
        ..VmEnd::default()
    };
    let n = encode_vm_end(&end, &mut buf).unwrap();
    bytes.extend_from_slice(&buf[..n]);
    SerialLog::from_bytes(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_read() {
        let mut e = hvprof_samplelog::ExitStats::new();
        for (reason, n, ticks) in [
            (10, 2000, 290),
            (30, 2100, 285),
            (18, 2000, 315),
            (52, 20, 146),
        ] {
            for _ in 0..n {
                e.record(reason, ticks);
            }
        }
        // The console's table is not read: a wrong one changes nothing.
        let log = capture_with_exits(
            "[bench] busy: round trip cpuid=400 io=380 vmcall=420 ticks\n\
             vm bench: exit CPUID                       1         1       1       1       1\n",
            e,
        );
        let f = exit_path_figures(&log).unwrap();
        assert_eq!(f.len(), 4);
        assert_eq!(f[0].round_trip, Some(400));
        assert_eq!((f[0].count, f[0].min, f[0].mean), (2000, 290, 290));
        assert_eq!((f[3].count, f[3].min, f[3].round_trip), (20, 146, None));
        assert!(exit_path_figures(&SerialLog::new("nothing")).is_err());
    }
}

/// The `mix` guest (80/20) profiled at the default 1 ms period, the log kept in memory and sent
/// at the end; `extra`: more of the VM's arguments.
fn mix_costs(name: &str, extra: &str) -> Scenario {
    Scenario::new(name, Emulator::bochs(HASWELL))
        .cmdline("export=end")
        .module(
            "mix.elf",
            ModuleSource::Guest("mix"),
            &format!("vm=bench mix=80,20 rounds=100{extra}"),
        )
}

/// The profiler's own costs: the `mix` run.
pub fn profile_costs() -> Scenario {
    mix_costs("bench-profile-costs", "").check(|log| profile_figures(log).map(drop))
}

/// The virtual PMU's cost to the sampling exits: `bench-profile-costs`' run with an idle vPMU
/// (`vpmu=cpu`, no counter enabled: the run loop's vPMU instance, counting skipped).
pub fn vpmu_idle() -> Scenario {
    mix_costs("bench-vpmu-idle", " vpmu=cpu").check(|log| whole_costs(log).map(drop))
}

/// The `pmu` guest's counted loop of 20,000,000 rounds with all seven of its virtual counters
/// running (a PMI every 1,000 instructions of the loop): each exit adds the run to each counter.
pub fn vpmu_counting() -> Scenario {
    Scenario::new("bench-vpmu-counting", Emulator::bochs(HASWELL))
        .cmdline("export=end")
        .module(
            "pmu.elf",
            ModuleSource::Guest("pmu"),
            "vm=p n=20000000 pmi-loop=1000 vpmu=cpu",
        )
        .check(|log| whole_costs(log).map(drop))
}

/// Figures of a finished `bench-profile-costs` run.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileFigures {
    pub samples: u64,
    pub cost_mean: u64,
    pub cost_min: u64,
    pub cost_max: u64,
    pub period: u64,
    pub bytes_per_record: f64,
    pub timer_exit_mean: u64,
}

/// The console's sample-path line: "over N samples: mean A, min B, max C TSC ticks (x.yz% of
/// the P-tick period)", as [N, A, B, C, P].
fn sample_path_line(log: &SerialLog) -> Result<[u64; 5], String> {
    let cost = log.expect("profiler: sample path cost over ")?;
    let nums: Vec<u64> = cost
        .split(|c: char| !c.is_ascii_digit())
        .filter(|w| !w.is_empty())
        .filter_map(|w| w.parse().ok())
        .collect();
    match nums[..] {
        [samples, mean, min, max, _, _, period] => Ok([samples, mean, min, max, period]),
        _ => Err(format!("cannot read {cost:?}")),
    }
}

pub fn profile_figures(log: &SerialLog) -> Result<ProfileFigures, String> {
    let [samples, mean, min, max, period] = sample_path_line(log)?;
    let sent = log.expect("profiler: sample log sent: ")?;
    let bytes_per_record = sent
        .rsplit_once('(')
        .and_then(|(_, r)| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("cannot read {sent:?}"))?;
    let timer = exit_row(&vm_exits(log, "bench")?, "PREEMPTION_TIMER")?;
    Ok(ProfileFigures {
        samples,
        cost_mean: mean,
        cost_min: min,
        cost_max: max,
        period,
        bytes_per_record,
        timer_exit_mean: timer.mean(),
    })
}

/// Call chains' costs: the `stacks` guest profiled with `stacks=` (`off`, or a depth), its
/// arguments `args`.
pub fn chain_costs(name: &str, stacks: &str, args: &str) -> Scenario {
    Scenario::new(name, Emulator::bochs(HASWELL))
        .cmdline(&format!("export=end stacks={stacks}"))
        .module(
            "stacks.elf",
            ModuleSource::Guest("stacks"),
            &format!("vm=bench {args}"),
        )
        .check(|log| chain_figures(log).map(drop))
}

/// Figures of a finished `chain_costs` run.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ChainFigures {
    /// The sample path's mean cost (ticks) and the samples.
    pub sample_mean: u64,
    pub samples: u64,
    /// Guest samples' walks: how many, their mean frames and mean ticks (0 without chains).
    pub guest_walks: u64,
    pub guest_frames: f64,
    pub guest_ticks: u64,
    /// Hypervisor samples' walks (own chain and exit cause).
    pub host_walks: u64,
    pub host_frames: f64,
    pub host_ticks: u64,
    /// Bytes sent per sample (all frames of the log, headers and events included).
    pub bytes_per_sample: f64,
}

pub fn chain_figures(log: &SerialLog) -> Result<ChainFigures, String> {
    let [samples, mean, ..] = sample_path_line(log)?;
    let mut f = ChainFigures {
        sample_mean: mean,
        samples,
        ..ChainFigures::default()
    };
    // "guest samples: N samples, mean F frames, mean T TSC ticks; hypervisor samples (...): N
    // samples, mean F frames, mean T TSC ticks"
    if let Ok(line) = log.expect("profiler: call chains walked") {
        let part = |key: &str| -> Option<(u64, f64, u64)> {
            let rest = line.split_once(key)?.1;
            let mut nums = rest
                .split([' ', ',', ';'])
                .filter_map(|w| w.parse::<f64>().ok());
            let (n, frames, ticks) = (nums.next()?, nums.next()?, nums.next()?);
            Some((n as u64, frames, ticks as u64))
        };
        let g = part("guest samples: ").ok_or_else(|| format!("cannot read {line:?}"))?;
        let h = part("exit-cause chains): ").ok_or_else(|| format!("cannot read {line:?}"))?;
        (f.guest_walks, f.guest_frames, f.guest_ticks) = g;
        (f.host_walks, f.host_frames, f.host_ticks) = h;
    }
    let sent = log.expect("profiler: sample log sent: ")?;
    let bytes: f64 = sent
        .split_once(" blocks, ")
        .and_then(|(_, r)| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("cannot read {sent:?}"))?;
    f.bytes_per_sample = bytes / samples.max(1) as f64;
    Ok(f)
}

#[cfg(test)]
mod chain_tests {
    use super::*;

    #[test]
    fn chain_figures_are_read() {
        let log = SerialLog::new(
            "profiler: sample path cost over 1062 samples: mean 564, min 219, max 807 TSC ticks (14.10% of the 4000-tick period)\n\
             profiler: call chains walked (inside the sample path's cost): guest samples: 909 samples, mean 14.9 frames, mean 495 TSC ticks; hypervisor samples (own and exit-cause chains): 153 samples, mean 16.8 frames, mean 622 TSC ticks\n\
             profiler: sample log sent: 9979 records taken, 0 records dropped (ring full), 8359 samples and 1620 events in 156 blocks, 83795 bytes (8.40 bytes per record) on the serial channel\n",
        );
        let f = chain_figures(&log).unwrap();
        assert_eq!((f.samples, f.sample_mean), (1062, 564));
        assert_eq!(
            (f.guest_walks, f.guest_frames, f.guest_ticks),
            (909, 14.9, 495)
        );
        assert_eq!(
            (f.host_walks, f.host_frames, f.host_ticks),
            (153, 16.8, 622)
        );
        assert!((f.bytes_per_sample - 83795.0 / 1062.0).abs() < 1e-9);
        let off = SerialLog::new(
            "profiler: sample path cost over 10 samples: mean 47, min 47, max 65 TSC ticks (1.18% of the 4000-tick period)\n\
             profiler: sample log sent: 12 records taken, 0 records dropped (ring full), 10 samples and 2 events in 1 blocks, 100 bytes (8.33 bytes per record) on the serial channel\n",
        );
        let f = chain_figures(&off).unwrap();
        assert_eq!(
            (f.guest_walks, f.sample_mean, f.bytes_per_sample),
            (0, 47, 10.0)
        );
    }
}

#[cfg(test)]
mod profile_tests {
    use super::*;

    #[test]
    fn profile_figures_are_read() {
        let mut e = hvprof_samplelog::ExitStats::new();
        e.record(52, 300);
        e.record(52, 476);
        let log = capture_with_exits(
            "profiler: sample path cost over 5675 samples: mean 30, min 30, max 35 TSC ticks (0.75% of the 4000-tick period)\n\
             profiler: sample log sent: 5679 records taken, 0 records dropped (ring or buffer full), 5675 samples and 4 events in 89 blocks, 9972 bytes (1.76 bytes per record)\n",
            e,
        );
        let f = profile_figures(&log).unwrap();
        assert_eq!(
            (f.samples, f.cost_mean, f.cost_min, f.cost_max, f.period),
            (5675, 30, 30, 35, 4000)
        );
        assert_eq!(f.bytes_per_record, 1.76);
        assert_eq!(f.timer_exit_mean, 388);
    }
}

/// The whole cost of a run, from the pCPU cost frames of its capture (`log` must hold the
/// whole capture: with `channel=lpt` the frames are in the parallel port's log), as the
/// analyzer's report reads it.
pub fn whole_costs(log: &SerialLog) -> Result<(Vec<PcpuCost>, f64), String> {
    let decoded = hvprof_samplelog::decode(log.raw());
    let cost = hvprof_analyze::model::cost::from_frames(&decoded.costs, &decoded.vm_ends)
        .ok_or("no pCPU cost frame in the capture")?;
    Ok((cost.pcpus, cost.percent))
}

pub use hvprof_analyze::model::cost::PcpuCost;

/// The rows of `whole_costs` as a Markdown table, each labelled with `what`.
pub fn whole_cost_rows(what: &str, rows: &[PcpuCost]) -> String {
    rows.iter()
        .map(|r| {
            format!(
                "| {what} | {} | {:.2}% | {} x {} ({:.2}%) | {} x {} ({:.2}%) | {:.2}% | {} |\n",
                r.pcpu,
                r.percent,
                r.sampling_exits,
                r.sampling_exit_mean,
                r.sampling_exit_percent,
                r.timer_interrupts,
                r.timer_interrupt_mean,
                r.timer_percent,
                r.export_percent,
                if r.task_reads > 0 {
                    format!("{} x {}", r.task_reads, r.task_read_mean)
                } else {
                    "—".into()
                },
            )
        })
        .collect()
}

#[cfg(test)]
mod whole_cost_tests {
    use super::*;

    #[test]
    fn cost_frames_make_table_rows() {
        let frame = hvprof_samplelog::PcpuCost {
            pcpu: 0,
            span_ticks: 1_000_000,
            samples: 1000,
            sampling_exits: 800,
            sampling_exit_ticks: 800 * 300,
            timer_interrupts: 200,
            timer_ticks: 200 * 100,
            other_sample_ticks: 0,
            export_ticks: 10_000,
            task_reads: 5,
            task_read_ticks: 5 * 40,
        };
        let mut buf = [0u8; hvprof_samplelog::MAX_PCPU_COST_FRAME_LEN];
        let n = hvprof_samplelog::encode_pcpu_cost(&frame, &mut buf).unwrap();
        let mut capture = b"profiler: whole cost 99.00% (console text is not read)\r\n".to_vec();
        capture.extend_from_slice(&buf[..n]);
        let (rows, whole) = whole_costs(&SerialLog::from_bytes(&capture)).unwrap();
        assert!((whole - 27.0).abs() < 1e-9, "{whole}");
        assert_eq!(
            whole_cost_rows("x", &rows),
            "| x | 0 | 27.00% | 800 x 300 (24.00%) | 200 x 100 (2.00%) | 1.00% | 5 x 40 |\n"
        );
        assert!(whole_costs(&SerialLog::new("nothing\n")).is_err());
    }
}
