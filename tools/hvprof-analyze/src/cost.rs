//! The profiler's whole cost, as the hypervisor measured and printed it at the end of the run
//! (`profiler: pCPU <i> cost: ...` and `profiler: whole cost ...`, docs/BOOT-LOG.md): the VM
//! exits that exist only to take samples, the LAPIC timer interrupts, the export during the run
//! and the task reads of Linux guests, per pCPU, as a share of its time.
//!
//! The lines are console text of the hypervisor's own: a guest's console lines always start with
//! `[<vm name>] ` and have their control bytes escaped, so no guest can write one.

use serde::Serialize;

/// One pCPU's whole cost.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PcpuCost {
    pub pcpu: u64,
    /// Share of the pCPU's time (from the start of sampling to its end), percent.
    pub percent: f64,
    /// That time, TSC ticks.
    pub span_ticks: u64,
    pub samples: u64,
    /// VMX-preemption-timer exits for a sampling deadline nothing else needed: count, mean
    /// ticks from the exit to the next VM entry, share of the pCPU's time.
    pub sampling_exits: u64,
    pub sampling_exit_mean: u64,
    pub sampling_exit_percent: f64,
    /// LAPIC timer interrupts (samples of the hypervisor and of idle time).
    pub timer_interrupts: u64,
    pub timer_interrupt_mean: u64,
    pub timer_percent: f64,
    /// Samples taken elsewhere (on other exits), ticks and share.
    pub other_sample_ticks: u64,
    pub other_sample_percent: f64,
    /// Sending or moving the log during the run.
    pub export_ticks: u64,
    pub export_percent: f64,
    /// Linux guests: reads of the running task (part of the sampling exits' ticks).
    pub task_reads: u64,
    pub task_read_mean: u64,
}

/// The whole cost of a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WholeCost {
    /// All pCPUs together, percent of their time.
    pub percent: f64,
    pub pcpus: Vec<PcpuCost>,
}

/// Reads the cost lines from the console text of a capture; `None` when it has none (a log
/// from an older hypervisor, or one cut short before the end).
pub fn parse(text: &str) -> Option<WholeCost> {
    let mut pcpus = Vec::new();
    let mut percent = None;
    for line in text.lines().map(|l| l.trim_end_matches('\r')) {
        if let Some(rest) = line.strip_prefix("profiler: whole cost ") {
            percent = rest.split('%').next().and_then(|n| n.parse().ok());
        } else if line.starts_with("profiler: pCPU ") && line.contains(" cost: ") {
            pcpus.extend(pcpu_line(line));
        }
    }
    Some(WholeCost {
        percent: percent?,
        pcpus,
    })
}

/// `profiler: pCPU i cost: S% of T ticks (N samples): E sampling exits x M ticks (s%), I timer
/// interrupts x m ticks (s%), other samples o ticks (s%), export x ticks (s%); R task reads x r
/// ticks`
fn pcpu_line(line: &str) -> Option<PcpuCost> {
    let nums: Vec<f64> = line
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .map(|w| w.trim_matches('.'))
        .filter(|w| !w.is_empty())
        .filter_map(|w| w.parse().ok())
        .collect();
    let [
        pcpu,
        percent,
        span,
        samples,
        exits,
        exit_mean,
        exit_percent,
        ints,
        int_mean,
        int_percent,
        other,
        other_percent,
        export,
        export_percent,
        reads,
        read_mean,
    ] = nums[..]
    else {
        return None;
    };
    Some(PcpuCost {
        pcpu: pcpu as u64,
        percent,
        span_ticks: span as u64,
        samples: samples as u64,
        sampling_exits: exits as u64,
        sampling_exit_mean: exit_mean as u64,
        sampling_exit_percent: exit_percent,
        timer_interrupts: ints as u64,
        timer_interrupt_mean: int_mean as u64,
        timer_percent: int_percent,
        other_sample_ticks: other as u64,
        other_sample_percent: other_percent,
        export_ticks: export as u64,
        export_percent,
        task_reads: reads as u64,
        task_read_mean: read_mean as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINES: &str = "profiler: pCPU 0: 133794 records taken, 33076 dropped\r\n\
        profiler: pCPU 0 cost: 56.20% of 315703835 ticks (125692 samples): 80847 sampling exits x 952 ticks (24.39%), 44775 timer interrupts x 116 ticks (1.65%), other samples 7 ticks (0.01%), export 95183755 ticks (30.15%); 80853 task reads x 532 ticks\r\n\
        [evil] profiler: whole cost 0.00% of the pCPUs' time (0 of 1 ticks)\r\n\
        profiler: pCPU 1 cost: 0.50% of 1000 ticks (10 samples): 3 sampling exits x 300 ticks (0.40%), 1 timer interrupts x 100 ticks (0.10%), other samples 0 ticks (0.00%), export 0 ticks (0.00%); 0 task reads x 0 ticks\r\n\
        profiler: whole cost 56.01% of the pCPUs' time (1 of 2 ticks)\r\n";

    #[test]
    fn the_hypervisors_cost_lines_are_read() {
        let c = parse(LINES).unwrap();
        assert_eq!(c.percent, 56.01);
        assert_eq!(c.pcpus.len(), 2);
        let p = &c.pcpus[0];
        assert_eq!((p.pcpu, p.span_ticks, p.samples), (0, 315_703_835, 125_692));
        assert_eq!((p.sampling_exits, p.sampling_exit_mean), (80847, 952));
        assert_eq!((p.timer_interrupts, p.timer_interrupt_mean), (44775, 116));
        assert_eq!((p.other_sample_ticks, p.export_ticks), (7, 95_183_755));
        assert_eq!((p.task_reads, p.task_read_mean), (80853, 532));
        assert_eq!(
            (
                p.percent,
                p.sampling_exit_percent,
                p.timer_percent,
                p.export_percent
            ),
            (56.2, 24.39, 1.65, 30.15)
        );
        assert_eq!(c.pcpus[1].pcpu, 1);
    }

    #[test]
    fn no_cost_lines_no_cost() {
        assert_eq!(parse("hvprof: ready\n"), None);
        // A guest's line is never the hypervisor's.
        assert_eq!(parse("[vm] profiler: whole cost 1.00% of x\n"), None);
        // A cut line is skipped, not misread.
        let c = parse("profiler: pCPU 0 cost: 5.00% of 10 ticks\nprofiler: whole cost 5.00%\n");
        assert_eq!(c.unwrap().pcpus, vec![]);
    }
}
