//! VMX: capability MSRs and control adjustment (more to come: typed VMCS fields, VMX
//! instructions, exit reasons). Pure parts build and test on the host.
#![cfg_attr(not(test), no_std)]

pub mod caps;
