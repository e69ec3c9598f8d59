//! A token bucket over TSC time: how much of a shared resource (the console line) one VM may use.

/// Up to `capacity` tokens; one more every `ticks_per_token` TSC ticks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenBucket {
    tokens: u64,
    capacity: u64,
    ticks_per_token: u64,
    /// TSC up to which tokens were added.
    last: u64,
}

impl TokenBucket {
    /// A full bucket at TSC `now`.
    pub const fn new(capacity: u64, ticks_per_token: u64, now: u64) -> Self {
        TokenBucket {
            tokens: capacity,
            capacity,
            ticks_per_token: if ticks_per_token == 0 {
                1
            } else {
                ticks_per_token
            },
            last: now,
        }
    }

    /// Takes `n` tokens at TSC `now` if the bucket holds them; `false` (nothing taken) if not.
    pub fn take(&mut self, n: u64, now: u64) -> bool {
        let elapsed = now.saturating_sub(self.last);
        let new = elapsed / self.ticks_per_token;
        if new > 0 {
            self.tokens = self.tokens.saturating_add(new).min(self.capacity);
            // Keep the remainder: tokens accrue exactly, however often `take` is called.
            self.last = self
                .last
                .saturating_add(new.saturating_mul(self.ticks_per_token));
        }
        if self.tokens >= n {
            self.tokens -= n;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn burst_then_rate() {
        let mut b = TokenBucket::new(100, 10, 0);
        assert!(b.take(60, 0));
        assert!(b.take(40, 0));
        assert!(!b.take(1, 5), "empty, and 5 ticks earn nothing");
        assert!(b.take(1, 10));
        assert!(!b.take(1, 19));
        assert!(b.take(2, 30), "the remainder carried over");
        // A long pause refills to capacity only.
        assert!(b.take(100, 1_000_000));
        assert!(!b.take(1, 1_000_000));
    }

    #[test]
    fn more_than_capacity_never_passes() {
        let mut b = TokenBucket::new(10, 1, 0);
        assert!(!b.take(11, u64::MAX));
    }

    proptest! {
        /// Over any sequence of requests, what passes is at most the capacity plus what the
        /// elapsed time earns.
        #[test]
        fn never_more_than_earned(
            capacity in 1u64..10_000,
            rate in 1u64..1000,
            reqs in proptest::collection::vec((0u64..5000, 1u64..500), 1..200),
        ) {
            let mut b = TokenBucket::new(capacity, rate, 0);
            let (mut now, mut passed) = (0u64, 0u64);
            for (dt, n) in reqs {
                now += dt;
                if b.take(n, now) {
                    passed += n;
                }
            }
            prop_assert!(passed <= capacity + now / rate);
        }
    }
}
