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
        .cmdline("period=100000ticks")
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
