//! x86-64 platform pieces: descriptor tables, the hypervisor's own local APIC, fault-tolerant MSR access.
pub mod gdt;
pub mod host_apic;
pub mod msr;
