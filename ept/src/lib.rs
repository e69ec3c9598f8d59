//! Intel EPT (extended page tables): entry formats, memory types, permissions, a table builder
//! that runs over any physical-memory abstraction, GPA walks, EPT-violation exit qualifications
//! and the INVEPT descriptor.
//!
//! References are to the Intel SDM, Vol. 3C, in the current numbering: §29.3 "The Extended Page
//! Table Mechanism (EPT)" (Tables 29-1..29-6 for the entry formats), §29.3.3.1 "EPT
//! Misconfigurations", §29.3.7 "EPT and Memory Typing", §29.4.3 INVEPT and the invalidation
//! rules, §25.6.11 "Extended-Page-Table Pointer (EPTP)", §28.2.1 Table 28-7 "Exit Qualification
//! for EPT Violations".
//!
//! The library allocates nothing: paging-structure frames come from a [`FrameSource`] and are
//! read and written through [`PhysMem`], so the same code runs over fake memory in host tests and
//! over identity-mapped physical memory in the hypervisor.
#![cfg_attr(not(test), no_std)]

mod entry;
mod invept;
mod table;
mod violation;

#[cfg(test)]
mod fake;
#[cfg(test)]
mod tests;

pub use entry::{
    Entry, EptCaps, Leaf, Level, MemoryType, Misconfig, PageSize, PageSizes, Pde, Pdpte,
    Permissions, Pml4e, Pte, TableRef, decode_entry,
};
#[cfg(target_arch = "x86_64")]
pub use invept::invept;
pub use invept::{InveptDescriptor, InveptError, InveptType};
pub use table::{
    Ept, Error, FrameSource, MAX_GPA_BITS, MappedRange, PhysMem, Stats, Translation, Walk, eptp,
};
pub use violation::{Access, EptViolation};

/// Size of a paging-structure page and of the smallest EPT page (SDM Vol. 3C §29.3.2).
pub const PAGE_4K: u64 = 1 << 12;
/// Size of a page mapped by an EPT PDE with bit 7 set (SDM Vol. 3C §29.3.2, Table 29-4).
pub const PAGE_2M: u64 = 1 << 21;
/// Size of a page mapped by an EPT PDPTE with bit 7 set (SDM Vol. 3C §29.3.2, Table 29-2).
pub const PAGE_1G: u64 = 1 << 30;
