//! Physical memory: the frame allocator (built from the boot memory map minus everything already
//! in use, see `hvprof_boot::memory`) and the heap (`linked_list_allocator`) carved from it.

use hvprof_boot::memory::{FreeRanges, PAGE_SIZE, Range};
use linked_list_allocator::LockedHeap;
use spin::Mutex;

#[global_allocator]
static HEAP: LockedHeap = LockedHeap::empty();

static FRAMES: Mutex<Option<FreeRanges>> = Mutex::new(None);

pub const HEAP_SIZE: u64 = 8 << 20;

/// The end of the identity map set up by the boot trampoline: frames above it are not used yet.
pub const MAPPED_LIMIT: u64 = 4 << 30;

unsafe extern "C" {
    static __image_start: u8;
    static __image_end: u8;
}

/// The hypervisor image in physical memory (identity-mapped, so the link addresses).
pub fn image_range() -> Range {
    // The linker script defines both symbols around the one loadable segment; only their
    // addresses are taken.
    Range::new(
        core::ptr::addr_of!(__image_start) as u64,
        core::ptr::addr_of!(__image_end) as u64,
    )
}

/// Hands the free ranges to the allocator and sets up the heap.
pub fn init(mut free: FreeRanges) -> Result<(), &'static str> {
    let heap = free
        .take(HEAP_SIZE, PAGE_SIZE)
        .ok_or("not enough free memory for the 8 MiB heap")?;
    // SAFETY: `take` removed these bytes from the free ranges, so nothing else will ever use
    // them; they are identity-mapped (below MAPPED_LIMIT) and writable.
    unsafe { HEAP.lock().init(heap as *mut u8, HEAP_SIZE as usize) };
    *FRAMES.lock() = Some(free);
    Ok(())
}

/// Allocates zeroed, physically contiguous memory: `bytes` rounded up to pages, aligned to
/// `align`. Returns the physical (= virtual) address.
pub fn alloc_zeroed(bytes: u64, align: u64) -> Option<u64> {
    let addr = FRAMES.lock().as_mut()?.take(bytes, align)?;
    let len = hvprof_boot::memory::align_up(bytes);
    // SAFETY: the range was just taken from the free ranges (owned by nobody else) and lies in
    // the identity map.
    unsafe { core::ptr::write_bytes(addr as *mut u8, 0, len as usize) };
    Some(addr)
}

/// Allocates physically contiguous memory as `alloc_zeroed` does, without zeroing it: for a
/// buffer that is written before it is read, whose size makes zeroing cost (the export's
/// `export=end` store takes the free memory: 373 MB of `rep stos`, 2 s of a Bochs boot).
pub fn alloc_uninit(bytes: u64, align: u64) -> Option<u64> {
    FRAMES.lock().as_mut()?.take(bytes, align)
}

/// Free memory left in the frame allocator, in bytes.
pub fn free_bytes() -> u64 {
    FRAMES.lock().as_ref().map_or(0, FreeRanges::total_bytes)
}

/// Page-table entry bits (Intel SDM Vol. 3A §4.5, Tables 4-15 to 4-18): present, writable,
/// write-through and cache-disable (uncachable with the default PAT), page size (2 MiB in a
/// page directory).
const PTE_PRESENT: u64 = 1 << 0;
const PTE_WRITABLE: u64 = 1 << 1;
const PTE_PWT: u64 = 1 << 3;
const PTE_PCD: u64 = 1 << 4;
const PTE_PS: u64 = 1 << 7;
const PTE_ADDRESS: u64 = 0x000f_ffff_ffff_f000;
const TWO_MIB: u64 = 2 << 20;

/// Identity-maps `len` bytes of device memory at `phys` (uncachable, 2 MiB pages) where the
/// boot page tables do not map it yet: the first 4 GiB are mapped already (device memory there
/// is uncachable by the firmware's MTRRs); above, the page directories (and page-directory
/// pointer tables) needed are taken from the frame allocator. Only the boot CPU calls it,
/// before the pages are used; the other CPUs share the tables and have never cached these
/// translations (not-present entries are not cached, SDM Vol. 3A §4.10.2.3).
pub fn map_device(phys: u64, len: u64) -> Result<(), &'static str> {
    let end = phys.checked_add(len).ok_or("device range wraps")?;
    if end <= MAPPED_LIMIT {
        return Ok(());
    }
    if end > 1 << 46 {
        return Err("device range above 64 TiB");
    }
    let pml4 = x86_64::registers::control::Cr3::read()
        .0
        .start_address()
        .as_u64();
    let mut page = phys.max(MAPPED_LIMIT) & !(TWO_MIB - 1);
    while page < end {
        // SAFETY: the paging structures are identity-mapped (they lie below 4 GiB: the boot
        // tables in the image, the new ones from the frame allocator); each entry is read, and
        // written only when not present (never changing a live translation), as SDM Vol. 3A §4.5
        // lays out 4-level paging: PML4 index bits 47:39, PDPT 38:30, PD 29:21.
        unsafe {
            let pdpt = next_table(pml4 as *mut u64, (page >> 39) & 0x1ff)?;
            let pd = next_table(pdpt, (page >> 30) & 0x1ff)?;
            let entry = pd.add(((page >> 21) & 0x1ff) as usize);
            if entry.read_volatile() & PTE_PRESENT == 0 {
                entry
                    .write_volatile(page | PTE_PRESENT | PTE_WRITABLE | PTE_PWT | PTE_PCD | PTE_PS);
            }
        }
        page += TWO_MIB;
    }
    Ok(())
}

/// The table entry `index` of `table` points to, made (zeroed, from the frame allocator) when
/// not present.
///
/// # Safety
/// `table` is an identity-mapped paging structure of the current hierarchy.
unsafe fn next_table(table: *mut u64, index: u64) -> Result<*mut u64, &'static str> {
    // SAFETY: `index` < 512 and `table` is a 4 KiB paging structure (the caller's contract).
    let entry = unsafe { table.add(index as usize) };
    // SAFETY: as above.
    let value = unsafe { entry.read_volatile() };
    if value & PTE_PRESENT != 0 {
        if value & PTE_PS != 0 {
            return Err("a large page already maps part of the device range");
        }
        return Ok((value & PTE_ADDRESS) as *mut u64);
    }
    let new = alloc_zeroed(PAGE_SIZE, PAGE_SIZE).ok_or("no memory for a page table")?;
    // SAFETY: as above; the new table is zeroed (no entry present) before it is linked.
    unsafe { entry.write_volatile(new | PTE_PRESENT | PTE_WRITABLE) };
    Ok(new as *mut u64)
}
