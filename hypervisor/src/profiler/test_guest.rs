//! Guest memory for the host tests of the walks: a leaked buffer as a VM's memory, with a
//! 4-level page-table builder.

use crate::guest_ram::GuestRam;

const PRESENT_RW: u64 = 3;

/// 2 MiB of guest memory in a leaked buffer, with a 4-level page-table builder (4 KiB pages).
/// The test writes it, and the code under test reads it, through the one raw pointer.
pub struct Guest {
    base: *mut u8,
    pub ram: GuestRam,
    next_table: u64,
}

impl Guest {
    pub const CR3: u64 = 0x1000;
    pub const SIZE: usize = 2 << 20;

    pub fn new() -> Self {
        let base = alloc::vec![0u8; Self::SIZE].leak().as_mut_ptr();
        // SAFETY: a leaked buffer of `SIZE` bytes, readable for the program's life.
        let ram = unsafe { GuestRam::new(base as u64, Self::SIZE as u64) };
        Guest {
            base,
            ram,
            next_table: 0x2000,
        }
    }
    pub fn put(&mut self, gpa: u64, bytes: &[u8]) {
        assert!(gpa as usize + bytes.len() <= Self::SIZE);
        // SAFETY: inside the leaked buffer (checked); nothing else accesses it meanwhile.
        unsafe {
            core::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base.add(gpa as usize), bytes.len())
        };
    }
    pub fn get(&self, gpa: u64) -> u64 {
        assert!(gpa as usize + 8 <= Self::SIZE);
        // SAFETY: as in `put`.
        unsafe { core::ptr::read_unaligned(self.base.add(gpa as usize) as *const u64) }
    }
    /// Maps the 4 KiB page at `gva` to `gpa` (which may lie outside the memory).
    pub fn map(&mut self, gva: u64, gpa: u64) {
        let mut table = Self::CR3;
        for level in (1..4).rev() {
            let at = table + 8 * ((gva >> (12 + 9 * level)) & 0x1ff);
            let e = self.get(at);
            table = if e & 1 != 0 {
                e & !0xfff
            } else {
                let t = self.next_table;
                self.next_table += 0x1000;
                self.put(at, &(t | PRESENT_RW).to_le_bytes());
                t
            };
        }
        let at = table + 8 * ((gva >> 12) & 0x1ff);
        self.put(at, &(gpa | PRESENT_RW).to_le_bytes());
    }
}
