//! Time units: TSC ticks to seconds since the first sample and to nanoseconds.

use crate::model::profile::Profile;

impl Profile {
    /// Seconds since the first sample.
    pub fn seconds(&self, tsc: u64) -> f64 {
        let hz = if self.tsc_hz == 0 {
            1e9
        } else {
            self.tsc_hz as f64
        };
        tsc.saturating_sub(self.span().0) as f64 / hz
    }

    /// Nanoseconds of `ticks` TSC ticks (ticks when the TSC frequency is unknown), rounded
    /// down (and, were it past `u64`, its low 64 bits).
    pub fn ticks_to_ns(&self, ticks: u64) -> u64 {
        if self.tsc_hz == 0 {
            ticks
        } else {
            mul_div(ticks, 1_000_000_000, self.tsc_hz)
        }
    }

    /// [`Profile::ticks_to_ns`] for a loop over the samples: the same nanoseconds, the
    /// division by the TSC rate made once.
    pub fn nanos(&self) -> Nanos {
        Nanos::new(self.tsc_hz)
    }
}

/// TSC ticks to nanoseconds at a fixed rate, as [`Profile::ticks_to_ns`]: `mul_div(ticks, 10^9,
/// hz)`, its divisions by the rate done as multiplications (`strength_reduce`), a few times
/// faster than a division (a conversion per sample in the exports).
#[derive(Debug, Clone, Copy)]
pub enum Nanos {
    /// The rate is unknown: nanoseconds are ticks.
    Ticks,
    /// The rate, `10^9` times which fits in 64 bits.
    Reduced(strength_reduce::StrengthReducedU64),
    /// A rate whose `10^9` times does not fit (a 128-bit division).
    Wide(u64),
}

impl Nanos {
    /// The conversion at `hz` ticks per second (0: unknown).
    pub fn new(hz: u64) -> Nanos {
        match hz {
            0 => Nanos::Ticks,
            hz if hz.checked_mul(1_000_000_000).is_some() => {
                Nanos::Reduced(strength_reduce::StrengthReducedU64::new(hz))
            }
            hz => Nanos::Wide(hz),
        }
    }

    /// Nanoseconds of `ticks`.
    #[inline]
    pub fn of(&self, ticks: u64) -> u64 {
        match *self {
            Nanos::Ticks => ticks,
            // As `mul_div`: ticks = q hz + r with r < hz, and r 10^9 < hz 10^9 fits.
            Nanos::Reduced(hz) => {
                let (q, r) = strength_reduce::StrengthReducedU64::div_rem(ticks, hz);
                q.wrapping_mul(1_000_000_000)
                    .wrapping_add(r * 1_000_000_000 / hz)
            }
            Nanos::Wide(hz) => mul_div(ticks, 1_000_000_000, hz),
        }
    }
}

/// `a * b / c` rounded down, truncated to 64 bits: what `(a as u128 * b as u128 / c as u128) as
/// u64` gives, in 64-bit divisions when `b * c` fits in 64 bits (a TSC rate in Hz times 10^9
/// does), which are several times faster than a 128-bit one (a call per sample in the
/// exports). `c` is not 0.
#[inline]
pub fn mul_div(a: u64, b: u64, c: u64) -> u64 {
    if b.checked_mul(c).is_some() {
        // a = q c + r with r < c, so a b / c = q b + r b / c, and r b < c b fits.
        let (q, r) = (a / c, a % c);
        q.wrapping_mul(b).wrapping_add(r * b / c)
    } else {
        (u128::from(a) * u128::from(b) / u128::from(c)) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use proptest::prelude::*;

    proptest! {
        /// The strength-reduced conversion is `mul_div`'s, for any TSC and rate.
        #[test]
        fn nanos_are_mul_div(a in any::<u64>(), hz in prop_oneof![1u64..=20_000_000_000, any::<u64>()]) {
            let want = if hz == 0 { a } else { mul_div(a, 1_000_000_000, hz) };
            prop_assert_eq!(Nanos::new(hz).of(a), want);
        }

        /// The 64-bit `mul_div` is the 128-bit formula, truncated, for any TSC and rate.
        #[test]
        fn mul_div_is_the_128_bit_quotient(a in any::<u64>(), b in 1u64..=1_000_000_000, c in 1u64..) {
            prop_assert_eq!(mul_div(a, b, c), (u128::from(a) * u128::from(b) / u128::from(c)) as u64);
        }
    }
}
