//! VMX: capability MSRs and control adjustment, typed VMCS fields, VMX instructions with
//! VM-instruction-error decoding, exit reasons and qualifications, and the register save area of
//! the entry/exit stub. Pure parts build and test on the host.
#![cfg_attr(not(test), no_std)]
// The codecs here take bit fields out of exit qualifications, VMCS fields and MSRs: a cast that
// silently drops bits, flips a sign or widens lossily is a decoding bug. Every narrowing cast says
// which bits it keeps (a mask or a shift the lint can see); widening uses `From`.
#![deny(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    clippy::cast_lossless
)]

pub mod caps;
pub mod errors;
pub mod exit;
#[cfg(any(test, feature = "fake-vmcs"))]
pub mod fake;
pub mod guest;
#[cfg(target_arch = "x86_64")]
pub mod instructions;
pub mod regs;
pub mod vmcs;
