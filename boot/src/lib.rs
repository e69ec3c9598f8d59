//! hvprof's boot crate: the Multiboot2 header and 32→64-bit trampoline (`entry`, bare metal
//! only), and the pure, host-testable parsers of the untrusted boot input (the Multiboot2 boot
//! information, the hypervisor's command line, boot modules, the memory map, the ACPI `\_S5_`).
#![cfg_attr(not(test), no_std)]

pub mod acpi;
#[cfg(target_os = "none")]
pub mod ap;
pub mod cmdline;
#[cfg(target_os = "none")]
pub mod entry;
pub mod image;
pub mod info;
pub mod memory;
