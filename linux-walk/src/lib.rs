//! Reading a Linux guest's kernel structures from its memory, with no agent in the guest: a
//! process's memory map (the VMAs of its `mm`, kept in a maple tree since Linux 6.1), the file
//! behind a mapping (its name from the dentry chain) and the kernel's list of loaded modules.
//!
//! The hypervisor runs these walkers over the guest's memory (through the guest's page tables
//! and the VM's own EPT); the host tests run them over models of that memory. Every layout (an
//! offset, an array length) comes from the kernel's own BTF, derived on the host by
//! `linux-guest` and passed to the hypervisor as `task-offsets=` is: nothing here is hard-coded
//! to one kernel build.
//!
//! Guest memory is hostile input: every read can fail (unmapped, outside the VM), every pointer
//! can point anywhere, every structure can be garbage or change under the walk. So each walk is
//! bounded by a [`Budget`] of reads, never recurses deeper than the format allows, checks what it
//! can (a VMA points back to its `mm`, VMAs are sorted and disjoint, node types are known), and
//! reports a truncated result as such rather than fault or loop. `no_std`, no allocation.

#![cfg_attr(not(test), no_std)]
#![forbid(unsafe_code)]
#![deny(clippy::cast_possible_truncation)]

pub mod cfi;
pub mod maple;
pub mod maps;
pub mod modules;
pub mod orc;

pub use cfi::{UnwindTable, UserEnd, UserStart, unwind_user};
pub use maple::{MapleLayout, MmLayout, Vma, VmaWalk, walk_vmas};
pub use maps::{ExecMapping, MapsWalk, exec_mappings};
pub use modules::{Module, ModuleLayout, ModuleWalk, walk_modules};
pub use orc::{KernelEnd, KernelRegs, OrcLayout, UserRegs, unwind_kernel};

/// Reads guest-virtual memory of one address space.
pub trait GuestMemory {
    /// Fills `out` from guest-virtual address `addr`; `false` if any byte is not readable
    /// (unmapped, not present, outside the VM). Must never read outside the VM.
    fn read(&self, addr: u64, out: &mut [u8]) -> bool;

    /// The little-endian `u64` at `addr`, `None` where unreadable. A reader that can load a
    /// word faster than it copies bytes overrides it (the kernel unwinder reads words).
    #[inline]
    fn read_word(&self, addr: u64) -> Option<u64> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b).then(|| u64::from_le_bytes(b))
    }

    /// The little-endian `u32` at `addr`, `None` where unreadable (see `read_word`).
    #[inline]
    fn read_half(&self, addr: u64) -> Option<u32> {
        let mut b = [0u8; 4];
        self.read(addr, &mut b).then(|| u32::from_le_bytes(b))
    }
}

/// A bound on the work of one walk, in guest reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    reads: u32,
}

impl Budget {
    /// At most `reads` guest reads.
    #[must_use]
    pub const fn new(reads: u32) -> Self {
        Self { reads }
    }

    /// Reads left.
    #[must_use]
    pub const fn left(&self) -> u32 {
        self.reads
    }

    #[inline(always)]
    fn take(&mut self) -> Result<(), Stop> {
        self.reads = self.reads.checked_sub(1).ok_or(Stop::Budget)?;
        Ok(())
    }
}

/// Why a walk ended early (its results so far are valid but incomplete).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// The read budget ran out.
    Budget,
    /// A read failed (unmapped or outside the VM).
    Unreadable {
        /// The guest-virtual address.
        addr: u64,
    },
    /// A structure was not what the layout says (an unknown node type, a cycle, unsorted
    /// entries, a pointer that does not point back).
    Malformed,
    /// The caller's sink asked to stop (it is full).
    Full,
}

/// Reads a little-endian `u64` at `addr`, counted against `budget`. Generic (also over
/// `dyn GuestMemory`): the kernel unwinder runs at every sample, and the hypervisor's reader then
/// inlines into it.
#[inline(always)]
fn read_u64<M: GuestMemory + ?Sized>(mem: &M, budget: &mut Budget, addr: u64) -> Result<u64, Stop> {
    budget.take()?;
    mem.read_word(addr).ok_or(Stop::Unreadable { addr })
}

/// Reads a little-endian `u32` at `addr`, counted against `budget`.
#[inline(always)]
fn read_u32<M: GuestMemory + ?Sized>(mem: &M, budget: &mut Budget, addr: u64) -> Result<u32, Stop> {
    budget.take()?;
    mem.read_half(addr).ok_or(Stop::Unreadable { addr })
}

#[inline(always)]
fn read<M: GuestMemory + ?Sized>(
    mem: &M,
    budget: &mut Budget,
    addr: u64,
    out: &mut [u8],
) -> Result<(), Stop> {
    budget.take()?;
    if mem.read(addr, out) {
        Ok(())
    } else {
        Err(Stop::Unreadable { addr })
    }
}

/// `base + offset` for a field, or `Malformed` if it wraps.
fn field(base: u64, offset: u32) -> Result<u64, Stop> {
    base.checked_add(u64::from(offset)).ok_or(Stop::Malformed)
}

/// Lowest kernel-half address: kernel pointers are at or above it.
pub const KERNEL_HALF: u64 = 0xffff_8000_0000_0000;

/// A plausible kernel pointer: in the kernel half and 8-byte aligned.
fn kernel_ptr(p: u64) -> bool {
    p >= KERNEL_HALF && p.is_multiple_of(8)
}

#[cfg(any(test, feature = "model"))]
pub mod model;
