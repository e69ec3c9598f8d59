//! Adding a mapping to the guest's own page tables (4-level paging, SDM Vol. 3A §5.5).
//!
//! The hypervisor identity-maps `[0, mem)` with 2 MiB pages (PML4 at 0x3000, CR3 points there).
//! A guest that wants to touch a guest-physical address outside that range, so that the access
//! reaches the EPT instead of faulting in its own page walk, maps it here: a 4 KiB identity page,
//! with the missing tables taken from a static, page-aligned pool inside the guest image (the
//! image is identity-mapped, so a table's address is its guest-physical address).

/// Present.
pub const P: u64 = 1 << 0;
/// Writable.
pub const RW: u64 = 1 << 1;
/// Page size: a 1 GiB (PDPT) or 2 MiB (PD) leaf.
pub const PS: u64 = 1 << 7;
/// The physical-address field of an entry (bits 51:12).
pub const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;

/// The table indices of a virtual address, PML4 first: bits 47:39, 38:30, 29:21, 20:12.
pub const fn indices(va: u64) -> [usize; 4] {
    [
        ((va >> 39) & 0x1ff) as usize,
        ((va >> 30) & 0x1ff) as usize,
        ((va >> 21) & 0x1ff) as usize,
        ((va >> 12) & 0x1ff) as usize,
    ]
}

/// Whether `va` is canonical with 48-bit linear addresses (bits 63:47 all equal).
pub const fn is_canonical(va: u64) -> bool {
    let top = va >> 47;
    top == 0 || top == 0x1_ffff
}

/// What [`map_identity`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mapped {
    /// A new 4 KiB page maps the address (and `tables` new tables were linked in).
    New { tables: usize },
    /// A present entry already maps the address (inside the guest's own memory?).
    Existing,
}

/// Why [`map_identity`] could not map an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapError {
    /// Not a canonical address: no page table can map it.
    NotCanonical,
    /// The static table pool is used up.
    OutOfTables,
}

#[cfg(target_os = "none")]
mod imp {
    use super::*;
    use core::sync::atomic::{AtomicUsize, Ordering};

    const POOL_PAGES: usize = 8;

    #[repr(C, align(4096))]
    struct Pool([[u64; 512]; POOL_PAGES]);

    /// Table pages for [`map_identity`], in .bss (zeroed by the loader).
    static mut POOL: Pool = Pool([[0; 512]; POOL_PAGES]);
    static POOL_USED: AtomicUsize = AtomicUsize::new(0);

    fn alloc_table() -> Option<*mut u64> {
        let i = POOL_USED.fetch_add(1, Ordering::Relaxed);
        if i >= POOL_PAGES {
            return None;
        }
        // SAFETY: index `i` was handed out once (the counter only grows); the page is in bounds
        // and nothing else refers to it.
        let table = unsafe { (&raw mut POOL.0[i]).cast::<u64>() };
        for j in 0..512 {
            // SAFETY: `j` < 512 stays inside the 4 KiB page owned by this caller.
            unsafe { table.add(j).write_volatile(0) };
        }
        Some(table)
    }

    /// Maps the 4 KiB page holding `addr` to itself (virtual = guest-physical), read/write,
    /// executable, in the page tables CR3 points to, then flushes it with `invlpg`.
    ///
    /// # Safety
    /// The page tables must be the hypervisor's identity map (or another the guest can reach at
    /// their physical addresses), and the new mapping must not alias memory Rust code relies on
    /// in an incompatible way.
    pub unsafe fn map_identity(addr: u64) -> Result<Mapped, MapError> {
        // SAFETY: the caller's contract.
        unsafe { map_page(addr, addr) }
    }

    /// Maps the 4 KiB page holding virtual `addr` to the guest-physical page holding `phys`,
    /// read/write, executable (as [`map_identity`], for any virtual address).
    ///
    /// # Safety
    /// As for [`map_identity`].
    pub unsafe fn map_page(addr: u64, phys: u64) -> Result<Mapped, MapError> {
        if !is_canonical(addr) {
            return Err(MapError::NotCanonical);
        }
        let idx = indices(addr);
        let mut table = (crate::cpu::read_cr3() & ADDR_MASK) as *mut u64;
        let mut tables = 0;
        for (level, &i) in idx.iter().enumerate() {
            // SAFETY: `table` is a page-table page reachable at its physical address (the
            // caller's contract for the hypervisor's tables, the identity-mapped pool for ours);
            // `i` < 512.
            let entry = unsafe { table.add(i) };
            // SAFETY: as above.
            let e = unsafe { entry.read_volatile() };
            let leaf = level == 3;
            if e & P != 0 {
                if leaf || (level > 0 && e & PS != 0) {
                    return Ok(Mapped::Existing);
                }
                table = (e & ADDR_MASK) as *mut u64;
                continue;
            }
            let value = if leaf {
                (phys & ADDR_MASK) | P | RW
            } else {
                let next = alloc_table().ok_or(MapError::OutOfTables)?;
                tables += 1;
                table = next;
                next as u64 | P | RW
            };
            // SAFETY: as above; the entry was not present, so no translation changes under code
            // that is running.
            unsafe { entry.write_volatile(value) };
        }
        // SAFETY: invalidating a TLB entry has no effect beyond the next walk.
        unsafe { crate::cpu::invlpg(addr) };
        Ok(Mapped::New { tables })
    }
}

#[cfg(target_os = "none")]
pub use imp::{map_identity, map_page};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_addresses() {
        assert_eq!(indices(0), [0, 0, 0, 0]);
        // 1 TiB: PML4 slot 2.
        assert_eq!(indices(1 << 40), [2, 0, 0, 0]);
        // The local APIC: 3 GiB + 1006 MiB.
        assert_eq!(indices(0xfee0_0000), [0, 3, 503, 0]);
        // 16 MiB (the hypervisor image): the ninth 2 MiB page of the first GiB.
        assert_eq!(indices(0x100_0000), [0, 0, 8, 0]);
        assert_eq!(indices(0x7fff_ffff_f123), [255, 511, 511, 511]);
    }

    #[test]
    fn canonical() {
        assert!(is_canonical(0));
        assert!(is_canonical(0x7fff_ffff_ffff));
        assert!(!is_canonical(0x8000_0000_0000));
        assert!(is_canonical(0xffff_8000_0000_0000));
        assert!(!is_canonical(0xfff0_0000_0000_0000));
    }
}
