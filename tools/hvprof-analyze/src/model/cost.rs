//! The sample path's cost over the samples ([`CostSum`]), and the profiler's whole cost, as the
//! hypervisor measured it and sent it at the end of the run in
//! one pCPU cost frame per pCPU: the VM exits that exist only to take samples, the LAPIC timer
//! interrupts, the export during the run and the task reads of Linux guests, per pCPU, as a
//! share of its time. (The console's `profiler: pCPU <i> cost: ...` lines say the same for
//! people; they are never read here.)

use std::collections::BTreeMap;

use hvprof_samplelog::PcpuCost as CostFrame;
use serde::Serialize;

/// The sample path's cost over the samples: sum, min, max (TSC ticks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CostSum {
    pub sum: u64,
    pub min: u64,
    pub max: u64,
}

impl Default for CostSum {
    fn default() -> Self {
        CostSum {
            sum: 0,
            min: u64::MAX,
            max: 0,
        }
    }
}

impl CostSum {
    /// One more sample path's cost.
    #[inline]
    pub(super) fn add(&mut self, cost: u64) {
        self.sum = self.sum.saturating_add(cost);
        self.min = self.min.min(cost);
        self.max = self.max.max(cost);
    }

    pub(super) fn merge(&mut self, o: CostSum) {
        self.sum = self.sum.saturating_add(o.sum);
        self.min = self.min.min(o.min);
        self.max = self.max.max(o.max);
    }
}

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
    /// All pCPUs together, percent of their time (the guests' virtual PMUs' exits included).
    pub percent: f64,
    pub pcpus: Vec<PcpuCost>,
    /// The exits the guests' virtual PMUs caused or served (`vpmu=`), from the VM end frames:
    /// their count, the hypervisor's ticks on them and their share of the pCPUs' time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vpmu: Option<VpmuCost>,
}

/// The guests' virtual PMUs' part of the whole cost.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct VpmuCost {
    pub exits: u64,
    pub ticks: u64,
    pub percent: f64,
}

/// The whole cost from a capture's pCPU cost frames (a pCPU's last frame counts); `None` when
/// it has none (a log from a hypervisor older than format version 2, or one cut short before
/// the end).
pub fn from_frames(frames: &[CostFrame], vm_ends: &[hvprof_samplelog::VmEnd]) -> Option<WholeCost> {
    let mut last: BTreeMap<u16, &CostFrame> = BTreeMap::new();
    for f in frames {
        last.insert(f.pcpu, f);
    }
    if last.is_empty() {
        return None;
    }
    let pcpus: Vec<PcpuCost> = last.values().map(|f| row(f)).collect();
    let whole: u64 = last.values().map(|f| f.whole()).sum();
    let span: u64 = last.values().map(|f| f.span_ticks.max(1)).sum();
    // A VM's last end frame counts.
    let mut ends: BTreeMap<u16, &hvprof_samplelog::VpmuEnd> = BTreeMap::new();
    for e in vm_ends {
        if let Some(p) = &e.vpmu {
            ends.insert(e.vm, p);
        }
    }
    let vpmu = (!ends.is_empty()).then(|| {
        let counts = ends.values().flat_map(|p| p.vcpus());
        let exits = counts
            .clone()
            .map(|c| c.exits)
            .fold(0u64, u64::saturating_add);
        let ticks = counts.map(|c| c.exit_ticks).fold(0u64, u64::saturating_add);
        VpmuCost {
            exits,
            ticks,
            percent: share(ticks, span),
        }
    });
    Some(WholeCost {
        percent: share(whole.saturating_add(vpmu.map_or(0, |v| v.ticks)), span),
        pcpus,
        vpmu,
    })
}

fn share(ticks: u64, span: u64) -> f64 {
    ticks as f64 * 100.0 / span.max(1) as f64
}

fn row(f: &CostFrame) -> PcpuCost {
    let mean = |ticks: u64, n: u64| ticks.checked_div(n).unwrap_or(0);
    PcpuCost {
        pcpu: u64::from(f.pcpu),
        percent: share(f.whole(), f.span_ticks),
        span_ticks: f.span_ticks,
        samples: f.samples,
        sampling_exits: f.sampling_exits,
        sampling_exit_mean: mean(f.sampling_exit_ticks, f.sampling_exits),
        sampling_exit_percent: share(f.sampling_exit_ticks, f.span_ticks),
        timer_interrupts: f.timer_interrupts,
        timer_interrupt_mean: mean(f.timer_ticks, f.timer_interrupts),
        timer_percent: share(f.timer_ticks, f.span_ticks),
        other_sample_ticks: f.other_sample_ticks,
        other_sample_percent: share(f.other_sample_ticks, f.span_ticks),
        export_ticks: f.export_ticks,
        export_percent: share(f.export_ticks, f.span_ticks),
        task_reads: f.task_reads,
        task_read_mean: mean(f.task_read_ticks, f.task_reads),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(pcpu: u16, span_ticks: u64) -> CostFrame {
        CostFrame {
            pcpu,
            span_ticks,
            samples: 125_692,
            sampling_exits: 80_847,
            sampling_exit_ticks: 80_847 * 952 + 100,
            timer_interrupts: 44_775,
            timer_ticks: 44_775 * 116,
            other_sample_ticks: 7,
            export_ticks: 95_183_755,
            task_reads: 80_853,
            task_read_ticks: 80_853 * 532,
        }
    }

    #[test]
    fn the_guests_virtual_pmus_exits_are_part_of_the_whole_cost() {
        let span = CostFrame {
            pcpu: 0,
            span_ticks: 10_000,
            sampling_exit_ticks: 1_000,
            sampling_exits: 1,
            ..CostFrame::default()
        };
        let end = |vm: u16, exits: u64, ticks: u64| {
            let mut p = hvprof_samplelog::VpmuEnd::new(false);
            p.add(hvprof_samplelog::VpmuCounts {
                exits,
                exit_ticks: ticks,
                ..Default::default()
            });
            hvprof_samplelog::VmEnd {
                vm,
                vpmu: Some(p),
                ..Default::default()
            }
        };
        // VM 0 sent twice: its last frame counts (a frame without a vPMU changes nothing).
        let ends = [
            end(0, 1, 99),
            end(0, 4, 400),
            hvprof_samplelog::VmEnd::default(),
            end(2, 1, 100),
        ];
        let c = from_frames(&[span], &ends).unwrap();
        let v = c.vpmu.unwrap();
        assert_eq!((v.exits, v.ticks), (5, 500));
        assert!((v.percent - 5.0).abs() < 1e-9);
        assert!((c.percent - 15.0).abs() < 1e-9, "10 % sampling + 5 % vPMU");
        assert_eq!(from_frames(&[span], &[]).unwrap().vpmu, None);
    }

    #[test]
    fn the_whole_cost_comes_from_the_frames() {
        let idle = CostFrame {
            pcpu: 1,
            span_ticks: 1000,
            samples: 10,
            sampling_exits: 3,
            sampling_exit_ticks: 900,
            ..CostFrame::default()
        };
        // pCPU 0 sent twice: its last frame counts.
        let c = from_frames(&[frame(0, 1), idle, frame(0, 315_703_835)], &[]).unwrap();
        assert_eq!(c.pcpus.len(), 2);
        let p = &c.pcpus[0];
        assert_eq!((p.pcpu, p.span_ticks, p.samples), (0, 315_703_835, 125_692));
        assert_eq!((p.sampling_exits, p.sampling_exit_mean), (80847, 952));
        assert_eq!((p.timer_interrupts, p.timer_interrupt_mean), (44775, 116));
        assert_eq!((p.other_sample_ticks, p.export_ticks), (7, 95_183_755));
        assert_eq!((p.task_reads, p.task_read_mean), (80853, 532));
        let whole0 = 80_847 * 952 + 100 + 44_775 * 116 + 7 + 95_183_755;
        assert!((p.percent - whole0 as f64 * 100.0 / 315_703_835.0).abs() < 1e-9);
        assert!((p.export_percent - 95_183_755.0 * 100.0 / 315_703_835.0).abs() < 1e-9);
        let p1 = &c.pcpus[1];
        assert!((p1.percent - 90.0).abs() < 1e-9);
        let all = (whole0 + 900) as f64 * 100.0 / (315_703_835.0 + 1000.0);
        assert!((c.percent - all).abs() < 1e-9);
    }

    #[test]
    fn no_cost_frames_no_cost() {
        assert_eq!(from_frames(&[], &[]), None);
    }
}
