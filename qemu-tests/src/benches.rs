//! Benchmarks that run in Bochs, where a TSC delta counts instructions: exact, reproducible path
//! lengths. `cargo xtask bench` runs them and records the figures in `docs/BENCHMARKS.md`.

use crate::emulator::Emulator;
use crate::log::SerialLog;
use crate::runner::{ModuleSource, Scenario};
use crate::scenarios::HASWELL;
use crate::vm_scenarios::exit_count;

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
    [
        ("CPUID", trip("cpuid")),
        ("IO_INSTRUCTION", trip("io")),
        ("VMCALL", trip("vmcall")),
        ("PREEMPTION_TIMER", None),
    ]
    .into_iter()
    .map(|(reason, round_trip)| {
        let prefix = format!("vm bench: exit {reason} ");
        let line = log.expect(&prefix)?;
        let cols: Vec<u64> = line[prefix.len()..]
            .split_whitespace()
            .map(|c| c.parse().map_err(|_| format!("bad number in {line:?}")))
            .collect::<Result<_, _>>()?;
        let [count, _total, min, _max, mean] = cols[..] else {
            return Err(format!("expected 5 columns in {line:?}"));
        };
        debug_assert_eq!(exit_count(log, "bench", reason).ok(), Some(count));
        Ok(ExitPath {
            reason,
            count,
            min,
            mean,
            round_trip,
        })
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_read() {
        let log = SerialLog::new(
            "[bench] busy: round trip cpuid=400 io=380 vmcall=420 ticks\n\
             vm bench: exit CPUID                       2000         580000       290       300       290\n\
             vm bench: exit IO_INSTRUCTION              2100         600000       260     30000       285\n\
             vm bench: exit VMCALL                      2000         630000       315       315       315\n\
             vm bench: exit PREEMPTION_TIMER              20           2920       146       146       146\n",
        );
        let f = exit_path_figures(&log).unwrap();
        assert_eq!(f.len(), 4);
        assert_eq!(f[0].round_trip, Some(400));
        assert_eq!((f[3].count, f[3].min, f[3].round_trip), (20, 146, None));
        assert!(exit_path_figures(&SerialLog::new("nothing")).is_err());
    }
}

/// The profiler's own costs: the `mix` guest (80/20) profiled at the default 1 ms period, the log
/// kept in memory and sent at the end.
pub fn profile_costs() -> Scenario {
    Scenario::new("bench-profile-costs", Emulator::bochs(HASWELL))
        .cmdline("export=end")
        .module(
            "mix.elf",
            ModuleSource::Guest("mix"),
            "vm=bench mix=80,20 rounds=100",
        )
        .check(|log| profile_figures(log).map(drop))
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

pub fn profile_figures(log: &SerialLog) -> Result<ProfileFigures, String> {
    let cost = log.expect("profiler: sample path cost over ")?;
    let nums: Vec<u64> = cost
        .split(|c: char| !c.is_ascii_digit())
        .filter(|w| !w.is_empty())
        .filter_map(|w| w.parse().ok())
        .collect();
    // "over N samples: mean A, min B, max C TSC ticks (x.yz% of the P-tick period)"
    let [samples, mean, min, max, _, _, period] = nums[..] else {
        return Err(format!("cannot read {cost:?}"));
    };
    let sent = log.expect("profiler: sample log sent: ")?;
    let bytes_per_record = sent
        .rsplit_once('(')
        .and_then(|(_, r)| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("cannot read {sent:?}"))?;
    let timer = log.expect("vm bench: exit PREEMPTION_TIMER ")?;
    let cols: Vec<u64> = timer["vm bench: exit PREEMPTION_TIMER ".len()..]
        .split_whitespace()
        .filter_map(|c| c.parse().ok())
        .collect();
    Ok(ProfileFigures {
        samples,
        cost_mean: mean,
        cost_min: min,
        cost_max: max,
        period,
        bytes_per_record,
        timer_exit_mean: cols.get(4).copied().unwrap_or(0),
    })
}

#[cfg(test)]
mod profile_tests {
    use super::*;

    #[test]
    fn profile_figures_are_read() {
        let log = SerialLog::new(
            "vm bench: exit PREEMPTION_TIMER             5567        2163815       315      5030       388\n\
             profiler: sample path cost over 5675 samples: mean 30, min 30, max 35 TSC ticks (0.75% of the 4000-tick period)\n\
             profiler: sample log sent: 5679 records taken, 0 records dropped (ring or buffer full), 5675 samples and 4 events in 89 blocks, 9972 bytes (1.76 bytes per record)\n",
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

/// The whole-cost lines of a run (read by the analyzer's `cost::parse`, which the report uses).
pub fn whole_costs(log: &SerialLog) -> Result<(Vec<PcpuCost>, f64), String> {
    let cost = hvprof_analyze::cost::parse(log.text())
        .ok_or("no `profiler: whole cost` line in the log")?;
    if cost.pcpus.is_empty() {
        return Err("no `profiler: pCPU <i> cost:` line".into());
    }
    Ok((cost.pcpus, cost.percent))
}

pub use hvprof_analyze::cost::PcpuCost;

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
    fn cost_lines_make_table_rows() {
        let log = SerialLog::new(
            "profiler: pCPU 0 cost: 56.20% of 315703835 ticks (125692 samples): 80847 sampling exits x 952 ticks (24.39%), 44775 timer interrupts x 116 ticks (1.65%), other samples 0 ticks (0.00%), export 95183755 ticks (30.15%); 80853 task reads x 532 ticks\n\
             profiler: whole cost 56.01% of the pCPUs' time (1 of 2 ticks)\n",
        );
        let (rows, whole) = whole_costs(&log).unwrap();
        assert_eq!(whole, 56.01);
        assert_eq!(
            whole_cost_rows("x", &rows),
            "| x | 0 | 56.20% | 80847 x 952 (24.39%) | 44775 x 116 (1.65%) | 30.15% | 80853 x 532 |\n"
        );
        assert!(whole_costs(&SerialLog::new("nothing\n")).is_err());
    }
}
