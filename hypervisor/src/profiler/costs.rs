//! What profiling costs a pCPU, tallied where it happens (TSC to TSC) and reported as disjoint
//! parts of the pCPU's time (the pCPU cost frame, `hvprof_samplelog::PcpuCost`, and the closing
//! console lines). The hypervisor's sampler (`bin/hvprof/profiler/sampler.rs`) keeps one
//! [`Costs`] and one [`PathCost`] per pCPU; only that pCPU writes them, and the export reads
//! them.

use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use hvprof_samplelog::PcpuCost;

/// A count of events and the TSC ticks they took.
pub struct Tally {
    count: AtomicU64,
    ticks: AtomicU64,
}

impl Tally {
    #[inline]
    pub const fn new() -> Self {
        Tally {
            count: AtomicU64::new(0),
            ticks: AtomicU64::new(0),
        }
    }

    /// One more event that took `ticks`.
    #[inline(always)]
    pub fn add(&self, ticks: u64) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.ticks.fetch_add(ticks, Ordering::Relaxed);
    }

    #[inline]
    /// (events, ticks).
    pub fn get(&self) -> (u64, u64) {
        (
            self.count.load(Ordering::Relaxed),
            self.ticks.load(Ordering::Relaxed),
        )
    }
}

impl Default for Tally {
    fn default() -> Self {
        Self::new()
    }
}

/// The reads that walks by unwind tables took against their budget: the most one walk took, and
/// how many walks the budget stopped (a guest's tables or stack that would make a walk read more
/// are cut there: its chain ends as a bad frame).
pub struct BudgetUse {
    pub limit: u32,
    pub most: AtomicU32,
    pub stopped: AtomicU64,
}

impl BudgetUse {
    #[inline]
    pub const fn new(limit: u32) -> Self {
        BudgetUse {
            limit,
            most: AtomicU32::new(0),
            stopped: AtomicU64::new(0),
        }
    }

    #[inline]
    /// A walk that began with `limit` reads ended with `left`; `stopped`: at the budget.
    pub fn record(&self, left: u32, stopped: bool) {
        let used = self.limit.saturating_sub(left);
        // Only this pCPU's walks write here: a plain load and store keep the maximum (a walk in
        // an NMI's sample between them could at worst have its figure overwritten by a smaller
        // one; no count is lost).
        if used > self.most.load(Ordering::Relaxed) {
            self.most.store(used, Ordering::Relaxed);
        }
        if stopped {
            self.stopped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The sample path's own cost (TSC in to TSC out, which every sample carries): samples, total,
/// smallest and largest.
pub struct PathCost {
    samples: AtomicU64,
    total: AtomicU64,
    min: AtomicU64,
    max: AtomicU64,
}

impl PathCost {
    #[inline]
    pub const fn new() -> Self {
        PathCost {
            samples: AtomicU64::new(0),
            total: AtomicU64::new(0),
            min: AtomicU64::new(u64::MAX),
            max: AtomicU64::new(0),
        }
    }

    /// One more sample whose path took `cost` ticks.
    #[inline(always)]
    pub fn record(&self, cost: u64) {
        self.samples.fetch_add(1, Ordering::Relaxed);
        self.total.fetch_add(cost, Ordering::Relaxed);
        // Plain compare-and-store, not a CAS loop: only this pCPU writes them (an NMI sample that
        // lands in between can lose a new minimum or maximum, never corrupt it).
        if cost < self.min.load(Ordering::Relaxed) {
            self.min.store(cost, Ordering::Relaxed);
        }
        if cost > self.max.load(Ordering::Relaxed) {
            self.max.store(cost, Ordering::Relaxed);
        }
    }

    #[inline]
    /// Samples taken.
    pub fn samples(&self) -> u64 {
        self.samples.load(Ordering::Relaxed)
    }

    #[inline]
    /// (samples, mean, min, max) in ticks; all 0 before the first sample.
    pub fn summary(&self) -> (u64, u64, u64, u64) {
        let n = self.samples();
        let total = self.total.load(Ordering::Relaxed);
        (
            n,
            total.checked_div(n).unwrap_or(0),
            if n == 0 {
                0
            } else {
                self.min.load(Ordering::Relaxed)
            },
            self.max.load(Ordering::Relaxed),
        )
    }
}

impl Default for PathCost {
    fn default() -> Self {
        Self::new()
    }
}

/// What profiling costs one pCPU besides the sample path (whose cost every sample measures), each
/// measured from TSC to TSC where it happens.
pub struct Costs {
    /// VM exits that exist only to take a sample (the VMX-preemption timer at a sampling deadline
    /// that nothing else needed): VM exit to the next VM entry, their sample and task read
    /// included, any export they did excluded. Samples never see this time: a sampling exit
    /// begins with its sample, and the next deadline is a period later.
    pub sampling_exits: Tally,
    /// The LAPIC timer's interrupts in the hypervisor and idle loop (handler entry to exit, their
    /// sample included).
    pub timer_interrupts: Tally,
    /// Reading a Linux guest's running task at its samples.
    pub task_reads: Tally,
    /// Walking call chains (inside the sample path's cost) and the frames found: at guest
    /// samples (the guest chain), and at hypervisor samples (the host chain, and the guest's
    /// exit-cause chain during a vCPU's exit).
    pub guest_walks: Tally,
    pub guest_frames: AtomicU64,
    pub host_walks: Tally,
    pub host_frames: AtomicU64,
    /// Guest pages the walks found by a walk of the guest's page tables (not remembered), and
    /// unwind entries found remembered or by a search of the tables.
    pub page_walks: AtomicU64,
    pub orc_hits: AtomicU64,
    pub orc_searches: AtomicU64,
    /// How close the walks by unwind tables came to their read budgets: kernel walks by ORC
    /// and user walks by the VM's unwind tables.
    pub kernel_walk_reads: BudgetUse,
    pub user_walk_reads: BudgetUse,
    /// Samples whose path took more than half a period, after which the next deadline was
    /// moved to half a period after it ended (`DeadlineClock::stretch`).
    pub stretched: AtomicU64,
    /// Draining the rings, encoding and sending the log.
    pub export: Tally,
    /// Sample-path and task-read ticks spent inside the sampling exits and timer interrupts (so
    /// that the whole cost counts them once).
    pub inside: AtomicU64,
}

impl Costs {
    #[inline]
    /// `kernel_reads` and `user_reads`: the walks' read budgets.
    pub const fn new(kernel_reads: u32, user_reads: u32) -> Self {
        Costs {
            sampling_exits: Tally::new(),
            timer_interrupts: Tally::new(),
            task_reads: Tally::new(),
            guest_walks: Tally::new(),
            guest_frames: AtomicU64::new(0),
            host_walks: Tally::new(),
            host_frames: AtomicU64::new(0),
            page_walks: AtomicU64::new(0),
            orc_hits: AtomicU64::new(0),
            orc_searches: AtomicU64::new(0),
            kernel_walk_reads: BudgetUse::new(kernel_reads),
            user_walk_reads: BudgetUse::new(user_reads),
            stretched: AtomicU64::new(0),
            export: Tally::new(),
            inside: AtomicU64::new(0),
        }
    }

    #[inline]
    /// A sampling exit that began at TSC `start` ends at `end`; `inside` of its ticks were its
    /// sample path and task read (counted there too).
    pub fn sampling_exit_done(&self, start: u64, end: u64, inside: u64) {
        self.sampling_exits.add(end.saturating_sub(start));
        self.inside.fetch_add(inside, Ordering::Relaxed);
    }

    #[inline]
    /// The whole cost of pCPU `pcpu` over `span` ticks, in disjoint parts: the sampling exits,
    /// the timer interrupts, the export, and the sample paths and task reads of samples taken
    /// elsewhere (those inside the first two are theirs already).
    pub fn report(&self, pcpu: u16, span: u64, path: &PathCost) -> PcpuCost {
        let (sampling_exits, sampling_exit_ticks) = self.sampling_exits.get();
        let (timer_interrupts, timer_ticks) = self.timer_interrupts.get();
        let (task_reads, task_read_ticks) = self.task_reads.get();
        let (_, export_ticks) = self.export.get();
        let sampled = path
            .total
            .load(Ordering::Relaxed)
            .saturating_add(task_read_ticks);
        PcpuCost {
            pcpu,
            span_ticks: span,
            samples: path.samples(),
            other_sample_ticks: sampled.saturating_sub(self.inside.load(Ordering::Relaxed)),
            sampling_exits,
            sampling_exit_ticks,
            timer_interrupts,
            timer_ticks,
            task_reads,
            task_read_ticks,
            export_ticks,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tallies_count_events_and_ticks() {
        let t = Tally::new();
        assert_eq!(t.get(), (0, 0));
        t.add(10);
        t.add(32);
        assert_eq!(t.get(), (2, 42));
    }

    #[test]
    fn the_path_cost_keeps_mean_min_and_max() {
        let p = PathCost::new();
        assert_eq!(p.summary(), (0, 0, 0, 0), "nothing before the first sample");
        for c in [40, 38, 49, 41] {
            p.record(c);
        }
        assert_eq!(p.summary(), (4, 42, 38, 49));
    }

    #[test]
    fn budget_use_keeps_the_most_reads_and_counts_stopped_walks() {
        let b = BudgetUse::new(640);
        b.record(600, false);
        b.record(0, true);
        b.record(100, false);
        assert_eq!(b.most.load(Ordering::Relaxed), 640);
        assert_eq!(b.stopped.load(Ordering::Relaxed), 1);
        // A walk cannot have more left than it began with; the figure stays sane if it did.
        b.record(700, false);
        assert_eq!(b.most.load(Ordering::Relaxed), 640);
    }

    #[test]
    fn the_report_counts_each_tick_once() {
        let c = Costs::new(640, 160);
        let p = PathCost::new();
        // Two sampling exits of 300 ticks, each with a 40-tick sample and a 100-tick task read
        // inside; one timer interrupt of 150 with a 40-tick sample inside; one sample of 40
        // taken on another exit; 500 ticks of export.
        for _ in 0..2 {
            p.record(40);
            c.task_reads.add(100);
            c.sampling_exit_done(1000, 1300, 140);
        }
        p.record(40);
        c.timer_interrupts.add(150);
        c.inside.fetch_add(40, Ordering::Relaxed);
        p.record(40);
        c.export.add(500);
        let r = c.report(1, 100_000, &p);
        assert_eq!(r.pcpu, 1);
        assert_eq!(r.span_ticks, 100_000);
        assert_eq!(r.samples, 4);
        assert_eq!((r.sampling_exits, r.sampling_exit_ticks), (2, 600));
        assert_eq!((r.timer_interrupts, r.timer_ticks), (1, 150));
        assert_eq!((r.task_reads, r.task_read_ticks), (2, 200));
        assert_eq!(r.export_ticks, 500);
        // All samples and task reads (160 + 200) less those inside (280 + 40): the one sample
        // taken on another exit.
        assert_eq!(r.other_sample_ticks, 40);
    }
}
