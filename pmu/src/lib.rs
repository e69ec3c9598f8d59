//! Sampling sources: the functional probe of the architectural PMU and the counter-overflow
//! (PMI-as-NMI) sampler. Pure parts build and test on the host.
#![cfg_attr(not(test), no_std)]

pub mod percpu;
pub mod probe;
pub mod sampler;
pub mod virtual_pmu;
