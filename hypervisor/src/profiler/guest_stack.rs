//! A running vCPU's memory as the profiler's walks of its call chains read it: a guest-virtual
//! page through the guest's own page tables (its CR3), remembered in the pCPU's walk cache
//! (`walk_cache`), to a host page wholly inside the VM's memory (`GuestRam`). `GuestStack` serves
//! the frame-pointer walk (`stack_walk`), `WalkMemory` the walks by unwind tables (`table_walk`):
//! any bytes, page by page, with the pages of one walk remembered.

use crate::guest_ram::GuestRam;
use crate::profiler::costs::Costs;
use crate::profiler::guest_walk;
use crate::profiler::stack_walk::FrameMemory;
use crate::profiler::walk_cache::{OrdinaryCodeSlots, WalkCache};
use core::sync::atomic::Ordering;

/// The running vCPU's memory, as a frame walk reads it: a guest-virtual page through the guest's
/// own page tables (`cr3`) to a guest-physical page wholly inside its memory.
pub struct GuestStack<'a> {
    ram: GuestRam,
    cr3: u64,
    /// This pCPU's walk caches (the running VM's).
    cache: &'a WalkCache,
    /// Where its page counts go.
    costs: &'a Costs,
}

impl<'a> GuestStack<'a> {
    #[inline]
    pub fn new(ram: GuestRam, cr3: u64, cache: &'a WalkCache, costs: &'a Costs) -> Self {
        GuestStack {
            ram,
            cr3,
            cache,
            costs,
        }
    }

    /// The code addresses of this address space a frame-pointer walk need not look at.
    #[inline]
    pub fn ordinary_code(&self) -> OrdinaryCodeSlots<'a> {
        self.cache.ordinary_code(self.cr3)
    }
}

impl GuestStack<'_> {
    /// The host address of the guest-virtual page `page`, if it maps to a page wholly inside
    /// the VM's memory.
    #[inline(always)]
    fn host_page(&self, page: u64) -> Option<u64> {
        let ram = self.ram;
        let gpa = match self
            .cache
            .pages
            .find(self.cr3, page, |gpa| ram.read_u64(gpa))
        {
            Some(gpa) => gpa,
            None => {
                self.costs.page_walks.fetch_add(1, Ordering::Relaxed);
                let leaf = guest_walk::translate_leaf(&|gpa| ram.read_u64(gpa), self.cr3, page)?;
                self.cache.pages.remember(self.cr3, page, leaf);
                leaf.gpa & !0xfff
            }
        };
        ram.host_page(gpa)
    }
}

impl FrameMemory for GuestStack<'_> {
    /// The host address of the page.
    type Page = u64;

    #[inline(always)]
    fn page(&mut self, page: u64) -> Option<u64> {
        self.host_page(page)
    }

    #[inline(always)]
    fn word(&self, page: u64, offset: u64) -> u64 {
        // SAFETY: `page` is the host address of a guest page wholly inside the VM's memory
        // (`page` gave it: `GuestRam::host`), which its maker keeps readable (`GuestRam::new`);
        // `offset` < 4096 keeps the 8-aligned word inside it. The guest may write it meanwhile:
        // any value is valid.
        unsafe { core::ptr::read_volatile((page + offset) as *const u64) }
    }
}

/// A guest's memory as an unwinding walk reads it (the kernel's by ORC, a user's by unwind
/// tables): any bytes, page by page, through the same translation as `GuestStack`'s, and the
/// pages this walk translated remembered (guest-virtual page, host page; `u64::MAX`: none), with
/// the next one to replace. Such a walk reads the same few pages (its stack's, the tables')
/// over and over, and the vCPU whose memory it reads is stopped meanwhile. (A frame-pointer walk
/// asks for each page once: it needs none of this.)
pub struct WalkMemory<'s, 'a> {
    stack: &'s GuestStack<'a>,
    memo: [core::cell::Cell<(u64, u64)>; WALK_PAGES],
    next: core::cell::Cell<usize>,
}

/// Pages an unwinding walk remembers (`WalkMemory::memo`).
const WALK_PAGES: usize = 4;

impl<'s, 'a> WalkMemory<'s, 'a> {
    #[inline]
    pub fn new(stack: &'s GuestStack<'a>) -> Self {
        WalkMemory {
            stack,
            memo: [const { core::cell::Cell::new((u64::MAX, 0)) }; WALK_PAGES],
            next: core::cell::Cell::new(0),
        }
    }

    /// `GuestStack::host_page`, through this walk's memo.
    #[inline(always)]
    fn host_page(&self, page: u64) -> Option<u64> {
        for m in &self.memo {
            let (p, host) = m.get();
            if p == page {
                return Some(host);
            }
        }
        let host = self.stack.host_page(page)?;
        let i = self.next.get();
        self.memo[i].set((page, host));
        self.next.set((i + 1) % WALK_PAGES);
        Some(host)
    }
}

impl WalkMemory<'_, '_> {
    /// The `T` (`u32` or `u64`) at `addr`, which must be aligned to its size: one translation,
    /// one load.
    #[inline(always)]
    fn load<T: Copy>(&self, addr: u64) -> Option<T> {
        debug_assert!(size_of::<T>() <= 8 && addr.is_multiple_of(size_of::<T>() as u64));
        let page = self.host_page(addr & !0xfff)?;
        // SAFETY: `page` is the host address of a guest page wholly inside the VM's memory
        // (`host_page`: `GuestRam::host`), readable (`GuestRam::new`); `addr` is aligned to the
        // size of `T` (at most 8, a divisor of 4096), so the value at `addr & 0xfff` lies inside
        // it, aligned. The guest may write it meanwhile: any value of a `u32` or `u64` is valid.
        Some(unsafe { core::ptr::read_volatile((page + (addr & 0xfff)) as *const T) })
    }
}

impl hvprof_linux_walk::GuestMemory for WalkMemory<'_, '_> {
    #[inline(always)]
    fn read_word(&self, addr: u64) -> Option<u64> {
        if addr.is_multiple_of(8) {
            return self.load(addr);
        }
        let mut b = [0u8; 8];
        self.read(addr, &mut b).then(|| u64::from_le_bytes(b))
    }

    #[inline(always)]
    fn read_half(&self, addr: u64) -> Option<u32> {
        if addr.is_multiple_of(4) {
            return self.load(addr);
        }
        let mut b = [0u8; 4];
        self.read(addr, &mut b).then(|| u32::from_le_bytes(b))
    }

    #[inline]
    fn read(&self, addr: u64, out: &mut [u8]) -> bool {
        // The unwinder's reads (4, 6 and 8 bytes) inside one page: one translation, one load.
        if out.len() <= 8 && (addr & 0xfff) + out.len() as u64 <= 0x1000 {
            let Some(page) = self.host_page(addr & !0xfff) else {
                return false;
            };
            let at = page + (addr & 0xfff);
            // SAFETY: as below; `[u8; N]` has alignment 1, so any address is aligned for it.
            unsafe {
                match out.len() {
                    8 => out.copy_from_slice(&core::ptr::read_volatile(at as *const [u8; 8])),
                    6 => out.copy_from_slice(&core::ptr::read_volatile(at as *const [u8; 6])),
                    4 => out.copy_from_slice(&core::ptr::read_volatile(at as *const [u8; 4])),
                    _ => {
                        for (i, b) in out.iter_mut().enumerate() {
                            *b = core::ptr::read_volatile((at + i as u64) as *const u8);
                        }
                    }
                }
            }
            return true;
        }
        let mut done = 0;
        while done < out.len() {
            let at = addr.wrapping_add(done as u64);
            let Some(page) = self.host_page(at & !0xfff) else {
                return false;
            };
            let n = (0x1000 - (at & 0xfff) as usize).min(out.len() - done);
            for (i, b) in out[done..done + n].iter_mut().enumerate() {
                // SAFETY: `page` is the host address of a guest page wholly inside the VM's
                // memory (`host_page`: `GuestRam::host`), readable (`GuestRam::new`), and
                // `(at & 0xfff) + i` < 4096 stays inside it. The guest may write it meanwhile:
                // any value is valid.
                *b = unsafe {
                    core::ptr::read_volatile((page + (at & 0xfff) + i as u64) as *const u8)
                };
            }
            done += n;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvprof_linux_walk::GuestMemory;

    use crate::profiler::test_guest::Guest;

    /// A page comes from the guest's page tables once and from the walk cache after; a page the
    /// guest maps outside its memory, or does not map, gives nothing.
    #[test]
    fn pages_inside_the_vms_memory_only_and_walked_once() {
        let mut g = Guest::new();
        let stack = 0x7fff_f000_0000u64;
        g.map(stack, 0x10_0000);
        g.map(stack + 0x1000, 0x1f_f000);
        g.map(stack + 0x2000, 0x20_0000);
        g.put(0x10_0ff8, &0x1122_3344_5566_7788u64.to_le_bytes());
        let (cache, costs) = (WalkCache::new(), Costs::new(0, 0));
        let mut s = GuestStack::new(g.ram, Guest::CR3, &cache, &costs);
        let walks = || costs.page_walks.load(Ordering::Relaxed);
        let page = s.page(stack).expect("mapped inside");
        assert_eq!(page, g.ram.hpa() + 0x10_0000);
        assert_eq!(s.word(page, 0xff8), 0x1122_3344_5566_7788);
        assert_eq!(walks(), 1);
        assert_eq!(s.page(stack), Some(page));
        assert_eq!(walks(), 1, "the second time from the cache");
        assert_eq!(
            s.page(stack + 0x1000),
            Some(g.ram.hpa() + 0x1f_f000),
            "the last page"
        );
        assert_eq!(
            s.page(stack + 0x2000),
            None,
            "mapped past the end of the memory"
        );
        assert_eq!(s.page(stack + 0x3000), None, "not mapped");
        // Another address space does not see this one's pages.
        let mut other = GuestStack::new(g.ram, 0x1f_0000, &cache, &costs);
        assert_eq!(other.page(stack), None);
    }

    /// An unwinding walk's reads: aligned words and halves by one load, unaligned ones and any
    /// bytes across a page boundary through both pages' translations (which need not be
    /// contiguous in guest-physical memory), and nothing where a page is not there.
    #[test]
    fn walk_reads_any_bytes_page_by_page() {
        let mut g = Guest::new();
        let va = 0xffff_c900_0000_0000u64;
        // Two guest-virtual pages, the second mapped below the first.
        g.map(va, 0x15_0000);
        g.map(va + 0x1000, 0x12_0000);
        let bytes: alloc::vec::Vec<u8> = (0..=255u8).cycle().take(0x2000).collect();
        g.put(0x15_0000, &bytes[..0x1000]);
        g.put(0x12_0000, &bytes[0x1000..]);
        let (cache, costs) = (WalkCache::new(), Costs::new(0, 0));
        let s = GuestStack::new(g.ram, Guest::CR3, &cache, &costs);
        let m = WalkMemory::new(&s);
        let want = |at: usize, n: usize| bytes[at..at + n].to_vec();
        let word = |at: usize| u64::from_le_bytes(want(at, 8).try_into().unwrap());
        assert_eq!(m.read_word(va + 0x10), Some(word(0x10)));
        assert_eq!(m.read_word(va + 0x13), Some(word(0x13)));
        assert_eq!(
            m.read_word(va + 0xffc),
            Some(word(0xffc)),
            "across the pages"
        );
        assert_eq!(
            m.read_half(va + 0xffe),
            Some(u32::from_le_bytes(want(0xffe, 4).try_into().unwrap()))
        );
        for (at, n) in [(0x20, 6), (0xffd, 6), (0x7f0, 100), (0, 0x2000)] {
            let mut out = alloc::vec![0u8; n];
            assert!(m.read(va + at as u64, &mut out));
            assert_eq!(out, want(at, n), "{n} bytes at {at:#x}");
        }
        let mut out = [0u8; 8];
        assert!(
            !m.read(va + 0x1ffc, &mut out),
            "the third page is not there"
        );
        assert_eq!(m.read_word(va + 0x2000), None);
        // More pages than the walk remembers: still read right.
        for i in 0..8u64 {
            g.map(va + 0x10_0000 + i * 0x1000, 0x16_0000 + i * 0x1000);
            g.put(0x16_0000 + i * 0x1000 + 8, &(i * 3).to_le_bytes());
        }
        let s = GuestStack::new(g.ram, Guest::CR3, &cache, &costs);
        let m = WalkMemory::new(&s);
        for round in 0..2 {
            for i in 0..8u64 {
                assert_eq!(
                    m.read_word(va + 0x10_0000 + i * 0x1000 + 8),
                    Some(i * 3),
                    "{round}"
                );
            }
        }
    }
}
