//! VMX: capability MSRs and control adjustment, typed VMCS fields, VMX instructions with
//! VM-instruction-error decoding, exit reasons and qualifications, and the register save area of
//! the entry/exit stub. Pure parts build and test on the host.
#![cfg_attr(not(test), no_std)]

pub mod caps;
pub mod errors;
pub mod exit;
pub mod guest;
#[cfg(target_arch = "x86_64")]
pub mod instructions;
pub mod regs;
pub mod vmcs;
