//! A vCPU's own time-stamp counter: the host's TSC plus an offset the guest sets by writing
//! IA32_TSC or IA32_TSC_ADJUST (SDM Vol. 3B §18.17, "Time-Stamp Counter"; §18.17.3,
//! "Time-Stamp Counter Adjustment"). The CPU applies the offset itself to the guest's RDTSC and
//! to RDMSR of IA32_TSC under the "use TSC offsetting" control (SDM Vol. 3C §26.3, "Changes to
//! Instruction Behavior in VMX Non-Root Operation"; §25.6.5, "Time-Stamp Counter Offset and
//! Multiplier"). The profiler's time axis stays the host's TSC: samples, run budgets and the
//! scheduler never see the offset.
//!
//! IA32_TSC_ADJUST follows the SDM's rules: a write of IA32_TSC changes the counter and adds
//! the same difference to IA32_TSC_ADJUST; a write of IA32_TSC_ADJUST adds the difference between
//! the new and the old value to the counter. The TSC-deadline timer's deadline is written in the
//! guest's time and armed on the host's.

/// A vCPU's TSC offset and IA32_TSC_ADJUST. All arithmetic wraps, as the 64-bit counter does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GuestTsc {
    /// Added to the host's TSC (two's complement: a guest behind the host has a "negative"
    /// offset): the VMCS's TSC-offset field.
    pub offset: u64,
    /// IA32_TSC_ADJUST as the guest reads it.
    pub adjust: u64,
}

impl GuestTsc {
    /// The guest's TSC at host TSC `host`.
    #[must_use]
    pub fn guest(&self, host: u64) -> u64 {
        host.wrapping_add(self.offset)
    }

    /// WRMSR IA32_TSC: the counter reads `value` now (host TSC `host_now`), and IA32_TSC_ADJUST
    /// moves by as much as the counter did.
    pub fn write_tsc(&mut self, value: u64, host_now: u64) {
        let delta = value.wrapping_sub(self.guest(host_now));
        self.offset = self.offset.wrapping_add(delta);
        self.adjust = self.adjust.wrapping_add(delta);
    }

    /// WRMSR IA32_TSC_ADJUST: the counter moves by the difference between `value` and the old
    /// adjustment.
    pub fn write_adjust(&mut self, value: u64) {
        let delta = value.wrapping_sub(self.adjust);
        self.offset = self.offset.wrapping_add(delta);
        self.adjust = value;
    }

    /// The host TSC at which a TSC-deadline timer the guest set to `deadline` (in its time)
    /// fires, at host TSC `host_now`: 0 stays 0 (disarmed); a deadline the guest's counter has
    /// passed already fires now, whatever the offset (a deadline taken through the offset
    /// could wrap past the end of the host's counter and never fire).
    #[must_use]
    pub fn deadline_to_host(&self, deadline: u64, host_now: u64) -> u64 {
        if deadline == 0 {
            return 0;
        }
        let now = self.guest(host_now);
        if deadline <= now {
            host_now.max(1)
        } else {
            host_now.saturating_add(deadline - now)
        }
    }

    /// A deadline the model holds on the host's axis, as the guest reads it back (0: disarmed).
    #[must_use]
    pub fn deadline_to_guest(&self, host: u64) -> u64 {
        if host == 0 { 0 } else { self.guest(host) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_fresh_vcpu_reads_the_host_counter() {
        let t = GuestTsc::default();
        assert_eq!(t.guest(12_345), 12_345);
        assert_eq!(t.adjust, 0);
    }

    #[test]
    fn writing_the_counter_moves_the_adjustment_with_it() {
        // tsc_adjust.flat's sequence: write IA32_TSC_ADJUST, read back, the counter jumped.
        let mut t = GuestTsc::default();
        t.write_adjust(100_000_000_000);
        assert_eq!(t.adjust, 100_000_000_000);
        assert_eq!(t.guest(1000), 100_000_001_000);
        t.write_adjust(0);
        assert_eq!(t.guest(2000), 2000);
        // WRMSR IA32_TSC at host 3000: the adjustment becomes what the write moved.
        t.write_tsc(100_000_000_000, 3000);
        assert_eq!(t.guest(3000), 100_000_000_000);
        assert_eq!(t.adjust, 100_000_000_000 - 3000);
        assert_eq!(t.guest(3500), 100_000_000_500, "it keeps counting");
        // Back to 0: the offset is "negative" and the adjustment follows it.
        t.write_tsc(0, 4000);
        assert_eq!(t.guest(4000), 0);
        assert_eq!(t.adjust, 0u64.wrapping_sub(4000));
        assert_eq!(t.guest(4100), 100);
    }

    #[test]
    fn deadlines_are_armed_on_the_hosts_axis() {
        let mut t = GuestTsc::default();
        t.write_tsc(1_000_000, 10_000); // guest = host + 990_000
        assert_eq!(t.deadline_to_host(0, 20_000), 0, "0 disarms");
        assert_eq!(t.deadline_to_host(1_010_500, 20_000), 20_500);
        assert_eq!(t.deadline_to_guest(20_500), 1_010_500);
        // Passed already: fires now.
        assert_eq!(t.deadline_to_host(5, 20_000), 20_000);
        // A guest far behind the host (TSC written to 0): an early deadline does not wrap.
        let mut behind = GuestTsc::default();
        behind.write_tsc(0, u64::MAX / 2);
        assert_eq!(
            behind.deadline_to_host(100, u64::MAX / 2),
            u64::MAX / 2 + 100
        );
        assert_eq!(
            behind.deadline_to_host(50, u64::MAX / 2 + 60),
            u64::MAX / 2 + 60
        );
    }

    proptest! {
        /// The SDM's invariant: the guest's counter is the host's plus IA32_TSC_ADJUST plus
        /// whatever IA32_TSC writes did beyond it, so that writing IA32_TSC_ADJUST back to a
        /// value it had restores the counter's distance to the host's.
        #[test]
        fn adjust_tracks_every_change(
            writes in proptest::collection::vec((any::<bool>(), any::<u64>(), 0u64..1 << 40), 0..20),
        ) {
            let mut t = GuestTsc::default();
            let mut host = 0u64;
            for (tsc, value, step) in writes {
                host = host.wrapping_add(step);
                let before = t;
                if tsc {
                    t.write_tsc(value, host);
                    prop_assert_eq!(t.guest(host), value);
                } else {
                    t.write_adjust(value);
                    prop_assert_eq!(t.adjust, value);
                }
                // Counter and adjustment move together.
                prop_assert_eq!(
                    t.offset.wrapping_sub(before.offset),
                    t.adjust.wrapping_sub(before.adjust)
                );
            }
            // From any state, a deadline ahead of the guest's counter fires that far ahead.
            let ahead = t.deadline_to_host(t.guest(host).wrapping_add(1000), host);
            if t.guest(host) < u64::MAX - 1000 {
                prop_assert_eq!(ahead, host.saturating_add(1000));
            }
        }
    }
}
