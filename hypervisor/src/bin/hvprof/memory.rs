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

/// Free memory left in the frame allocator, in bytes.
pub fn free_bytes() -> u64 {
    FRAMES.lock().as_ref().map_or(0, FreeRanges::total_bytes)
}
