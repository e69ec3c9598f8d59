//! The deadline clock's arithmetic, per pCPU: whether a sample is due at a TSC value, where the
//! next deadline goes, and how a long sample path pushes it out. The hypervisor's sample path
//! (`bin/hvprof/profiler/sampler.rs`) is its only user; the timers that fire at its deadlines
//! (the VMX-preemption timer in guests, the LAPIC timer in the hypervisor) are the run loop's and
//! the sampler's. This is the one place that decides a deadline sample is due.

use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// A pCPU's sampling deadlines: every `period` TSC ticks from the start, skipping those missed.
/// Stopped, its next deadline is `u64::MAX`, which no TSC reaches (2^64 ticks are centuries at
/// any rate): the sample path's two questions (`take_due`, `next_tick`) need no other test.
pub struct DeadlineClock {
    enabled: AtomicBool,
    period: AtomicU64,
    next: AtomicU64,
}

impl DeadlineClock {
    #[inline]
    pub const fn new() -> Self {
        DeadlineClock {
            enabled: AtomicBool::new(false),
            period: AtomicU64::new(u64::MAX),
            next: AtomicU64::new(u64::MAX),
        }
    }

    #[inline]
    /// Starts at TSC `now` with `period` ticks (at least 1). `deadlines`: the clock's own
    /// deadlines are the sampling source; without, no deadline ever comes (the PMU samples) but
    /// the period still paces what depends on it.
    pub fn begin(&self, period: u64, now: u64, deadlines: bool) {
        let period = period.max(1);
        self.period.store(period, Ordering::Relaxed);
        let next = if deadlines {
            now.saturating_add(period)
        } else {
            u64::MAX
        };
        self.next.store(next, Ordering::Relaxed);
        self.enabled.store(true, Ordering::Release);
    }

    #[inline]
    /// Stops: no sample is due any more. Called on the clock's own pCPU, outside its timer
    /// interrupt: no `take_due` is midway there, and one that interrupts this finds no deadline
    /// from the first store on.
    pub fn stop(&self) {
        self.next.store(u64::MAX, Ordering::Relaxed);
        self.enabled.store(false, Ordering::Release);
    }

    #[inline]
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    #[inline]
    /// The period in TSC ticks.
    pub fn period(&self) -> u64 {
        self.period.load(Ordering::Relaxed)
    }

    /// The next deadline (`u64::MAX` when stopped).
    #[inline(always)]
    pub fn next_tick(&self) -> u64 {
        self.next.load(Ordering::Relaxed)
    }

    /// Whether a sample is due at `now`, a TSC value (below u64::MAX, the stopped clock's
    /// deadline, which the TSC never reaches); if so, moves the deadline past `now`. Deadlines
    /// missed while no sample could be taken are skipped, not bunched: one sample per elapsed
    /// deadline would fake time the CPU did not spend there.
    #[inline(always)]
    pub fn take_due(&self, now: u64) -> bool {
        // Stopped, `next` is u64::MAX.
        let next = self.next.load(Ordering::Relaxed);
        if now < next {
            return false;
        }
        // At least 1 whenever the clock runs (`begin`).
        let period = self.period.load(Ordering::Relaxed);
        let late = now - next;
        // Usually the deadline is less than a period ago: no division on the sample path.
        let missed = if late < period { 0 } else { late / period };
        self.next
            .store(next + (missed + 1) * period, Ordering::Relaxed);
        true
    }

    /// A sample path that began at `t0` took `cost` ticks. One longer than half a period (a deep
    /// chain through memory the walk has not seen yet) must not leave the sampled code no time:
    /// the deadline it moved past its start may have come already, and the next entry would
    /// exit at once, sample, and so on. The next deadline is then half a period after the path's
    /// end at the earliest. Returns whether it moved the deadline.
    #[inline(always)]
    pub fn stretch(&self, t0: u64, cost: u64) -> bool {
        let period = self.period.load(Ordering::Relaxed);
        if cost <= period / 2 {
            return false;
        }
        let floor = t0.saturating_add(cost).saturating_add(period / 2);
        if self.next.load(Ordering::Relaxed) < floor {
            self.next.store(floor, Ordering::Relaxed);
            return true;
        }
        false
    }
}

impl Default for DeadlineClock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_due_before_the_start_or_after_the_stop() {
        let c = DeadlineClock::new();
        // (The TSC never reaches u64::MAX: centuries at any rate.)
        assert!(!c.take_due(u64::MAX - 1));
        assert_eq!(c.next_tick(), u64::MAX);
        c.begin(1000, 5000, true);
        assert_eq!(c.next_tick(), 6000);
        c.stop();
        assert!(!c.take_due(10_000));
        assert_eq!(c.next_tick(), u64::MAX);
        // A long path after the stop does not bring a deadline back.
        assert!(!c.stretch(10_000, 5_000));
        assert_eq!(c.next_tick(), u64::MAX);
    }

    #[test]
    fn a_deadline_is_taken_once_and_the_next_is_a_period_on() {
        let c = DeadlineClock::new();
        c.begin(1000, 0, true);
        assert!(!c.take_due(999));
        assert!(c.take_due(1000));
        assert_eq!(c.next_tick(), 2000);
        assert!(!c.take_due(1500));
        // Late, but within a period: the next stays on the grid.
        assert!(c.take_due(2999));
        assert_eq!(c.next_tick(), 3000);
    }

    #[test]
    fn missed_deadlines_are_skipped_not_bunched() {
        let c = DeadlineClock::new();
        c.begin(1000, 0, true);
        // Ten periods late: one sample, and the next deadline is the first one after now.
        assert!(c.take_due(10_500));
        assert_eq!(c.next_tick(), 11_000);
        assert!(!c.take_due(10_999));
        assert!(c.take_due(11_000));
        assert_eq!(c.next_tick(), 12_000);
    }

    #[test]
    fn without_deadlines_nothing_is_due_but_the_period_is_kept() {
        let c = DeadlineClock::new();
        c.begin(0, 100, false);
        assert_eq!(c.period(), 1, "a period of 0 becomes 1");
        assert!(!c.take_due(u64::MAX - 1));
        assert_eq!(c.next_tick(), u64::MAX);
    }

    #[test]
    fn a_long_sample_path_moves_the_next_deadline_half_a_period_after_it() {
        let c = DeadlineClock::new();
        c.begin(1000, 0, true);
        assert!(c.take_due(1000));
        // 500 ticks is half a period: no move.
        assert!(!c.stretch(1000, 500));
        assert_eq!(c.next_tick(), 2000);
        // 900 ticks: the path ends at 1900, the next deadline may not come before 2400.
        assert!(c.take_due(2000));
        assert!(c.stretch(2000, 900));
        assert_eq!(c.next_tick(), 3400);
        // A deadline already past the floor stays.
        assert!(!c.stretch(2000, 600));
        assert_eq!(c.next_tick(), 3400);
    }

    #[test]
    fn the_arithmetic_saturates_at_the_end_of_time() {
        let c = DeadlineClock::new();
        c.begin(u64::MAX, u64::MAX - 1, true);
        assert_eq!(c.next_tick(), u64::MAX);
        // The floor saturates at the end of time, where the deadline is already.
        assert!(!c.stretch(u64::MAX - 10, u64::MAX));
        assert_eq!(c.next_tick(), u64::MAX);
    }
}
