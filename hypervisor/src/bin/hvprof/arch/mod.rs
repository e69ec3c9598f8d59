//! x86-64 platform pieces: descriptor tables, exception entry, fault-tolerant MSR access.
pub mod gdt;
pub mod idt;
pub mod lapic;
pub mod msr;
