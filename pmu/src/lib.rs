//! Sampling sources. For now: the functional probe of the architectural PMU. Pure parts build and
//! test on the host.
#![cfg_attr(not(test), no_std)]

pub mod probe;
