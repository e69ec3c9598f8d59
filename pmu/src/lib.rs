//! Sampling sources: the functional probe of the architectural PMU and the counter-overflow
//! (PMI-as-NMI) sampler. Pure parts build and test on the host.
#![cfg_attr(not(test), no_std)]

pub mod hardware_vpmu;
pub mod percpu;
pub mod probe;
pub mod sampler;
pub mod virtual_pmu;

/// IA32_PERFEVTSELx fields (SDM Vol. 3B §21.2.1.1, Figure 21-1).
pub mod evtsel {
    pub const EVENT: u64 = 0xff;
    pub const UMASK: u64 = 0xff << 8;
    pub const USR: u64 = 1 << 16;
    pub const OS: u64 = 1 << 17;
    pub const EDGE: u64 = 1 << 18;
    pub const INT: u64 = 1 << 20;
    pub const EN: u64 = 1 << 22;
    pub const INV: u64 = 1 << 23;
    pub const CMASK: u64 = 0xff << 24;
}

/// IA32_FIXED_CTR_CTRL: four bits per counter (§21.2.2, Figure 21-2): enable in ring 0 (bit
/// 0), above ring 0 (bit 1), AnyThread (bit 2, from version 3), PMI (bit 3).
pub mod fixed_ctrl {
    pub const OS: u64 = 0b0001;
    pub const USR: u64 = 0b0010;
    pub const ANY_THREAD: u64 = 0b0100;
    pub const PMI: u64 = 0b1000;
    /// A counter's four bits.
    pub const FIELD: u64 = 0b1111;
}
