//! What a pCPU's guest call-chain walks remember from one sample to the next: the guest pages
//! they translated (`StackPages`) and the code addresses they found to be no prologue or
//! epilogue (`OrdinaryCodeSlots`, see `stack_walk::OrdinaryCode`). Both are keyed by the guest's
//! CR3 (kernel-half entries by `ANY_CR3`: every process maps the kernel half alike), which says
//! nothing about the VM: two VMs may use the same CR3 value and the same code addresses for other
//! code and other pages (every 64-bit test guest runs at CR3 0x3000). So a pCPU's
//! [`WalkCache`] belongs to one VM at a time: [`WalkCache::enter_vm`] forgets what another VM's
//! walks left before a vCPU of a new VM runs (docs/SECURITY.md, "Call chains").
//!
//! Written by one pCPU's sample paths only (a VM exit's, or an NMI's that may interrupt one):
//! seqlocks and two-word slots keep a reader that interrupts a writer from using half an entry.

use crate::profiler::guest_walk::Leaf;
use crate::profiler::stack_walk::{self, OrdinaryCode};
use core::sync::atomic::{AtomicU64, Ordering, compiler_fence};

/// Entries of `StackPages`.
const STACK_PAGES: usize = 4;

/// Slots of the ordinary-code memo (direct-mapped by the RIP's low bits).
pub const ORDINARY_CODE: usize = 64;

/// What `StackPages` keys a kernel-half translation by, in place of a CR3.
const ANY_CR3: u64 = u64::MAX - 1;

/// A slot or entry that holds nothing (no RIP, CR3 or tag is all ones).
const EMPTY: u64 = u64::MAX;

/// The sequence lock of a pCPU's walk cache (`StackPages`, `guest_chain`'s ORC entries): odd
/// while an entry is written. A reader that interrupts a write (an NMI's sample inside the run
/// loop's) or is interrupted by one gets nothing rather than half an entry; a write that
/// interrupts another leaves it alone.
pub(crate) struct SeqLock(AtomicU64);

impl SeqLock {
    pub const fn new() -> Self {
        SeqLock(AtomicU64::new(0))
    }

    /// What `read` reads of the entries, if no write was under way before or during it.
    #[inline(always)]
    pub fn read<T>(&self, read: impl FnOnce() -> Option<T>) -> Option<T> {
        let before = self.0.load(Ordering::Acquire);
        if before % 2 == 1 {
            return None;
        }
        let value = read();
        core::sync::atomic::fence(Ordering::Acquire);
        if self.0.load(Ordering::Relaxed) != before {
            return None;
        }
        value
    }

    /// Runs `write` (stores to the entries), unless it interrupted another write.
    #[inline(always)]
    pub fn write(&self, write: impl FnOnce()) {
        let seq = self.0.fetch_add(1, Ordering::Acquire);
        if seq % 2 == 1 {
            // Another write is under way below us (we interrupted it): leave it alone.
            self.0.fetch_sub(1, Ordering::Release);
            return;
        }
        write();
        self.0.fetch_add(1, Ordering::Release);
    }
}

/// The walk caches of one pCPU, for the VM it runs.
pub struct WalkCache {
    /// The VM whose walks filled the caches (`EMPTY`: none yet).
    vm: AtomicU64,
    pub pages: StackPages,
    ordinary: [[AtomicU64; 2]; ORDINARY_CODE],
}

impl Default for WalkCache {
    fn default() -> Self {
        Self::new()
    }
}

impl WalkCache {
    pub const fn new() -> Self {
        WalkCache {
            vm: AtomicU64::new(EMPTY),
            pages: StackPages::new(),
            ordinary: [const { [const { AtomicU64::new(EMPTY) }; 2] }; ORDINARY_CODE],
        }
    }

    /// This pCPU runs a vCPU of VM `vm` from now on: when the caches hold another VM's entries,
    /// they are forgotten (about 140 stores, once per switch between VMs, never on the sample
    /// path). Call it before the VM's first sample on this pCPU.
    pub fn enter_vm(&self, vm: u16) {
        let vm = u64::from(vm);
        if self.vm.load(Ordering::Relaxed) == vm {
            return;
        }
        for slot in &self.ordinary {
            // The RIP first: a walk that interrupts this sees no RIP with the old tag.
            slot[0].store(EMPTY, Ordering::Relaxed);
            slot[1].store(EMPTY, Ordering::Relaxed);
        }
        self.pages.forget();
        compiler_fence(Ordering::Release);
        self.vm.store(vm, Ordering::Relaxed);
    }

    /// The ordinary-code memo for the address space `cr3`.
    #[inline(always)]
    pub fn ordinary_code(&self, cr3: u64) -> OrdinaryCodeSlots<'_> {
        OrdinaryCodeSlots {
            slots: &self.ordinary,
            cr3,
        }
    }
}

/// The ordinary-code memo for one address space (`cr3`; the kernel half is every process's).
/// An NMI sample that lands between a slot's two stores reads a RIP with another's tag, which at
/// worst spares one look at the code (a caller missed at a prologue, as without the look).
pub struct OrdinaryCodeSlots<'a> {
    slots: &'a [[AtomicU64; 2]; ORDINARY_CODE],
    cr3: u64,
}

impl OrdinaryCodeSlots<'_> {
    #[inline(always)]
    fn slot(&self, rip: u64) -> (&[AtomicU64; 2], u64) {
        let i = ((rip ^ rip >> 4 ^ rip >> 8) as usize) % ORDINARY_CODE;
        (&self.slots[i], StackPages::tag(self.cr3, rip))
    }
}

impl OrdinaryCode for OrdinaryCodeSlots<'_> {
    #[inline(always)]
    fn is_ordinary(&self, rip: u64) -> bool {
        let (s, tag) = self.slot(rip);
        s[0].load(Ordering::Relaxed) == rip && s[1].load(Ordering::Relaxed) == tag
    }

    #[inline(always)]
    fn remember(&self, rip: u64) {
        let (s, tag) = self.slot(rip);
        s[0].store(rip, Ordering::Relaxed);
        s[1].store(tag, Ordering::Relaxed);
    }
}

/// The guest pages the last walks translated, so that the next walk on the same pages skips
/// the guest page walk: each entry is checked before use by reading again the paging entry
/// that mapped it (`guest_walk::Leaf`), so a page the guest has unmapped or moved since is
/// translated anew. An entry covers its whole page, as the guest mapped it: a Linux kernel's
/// image (its ORC tables) lies in a few 2 MiB pages. Kernel-half entries hold for every CR3
/// (every process maps the kernel half alike, as `guest_walk::Tlb` assumes). (A guest that
/// rewrites the levels above an entry, or maps its kernel half differently per process, can
/// have one chain read from the page it mapped before: still its own memory.) Under a
/// [`SeqLock`]: an NMI sample that lands while an entry is written translates without it.
pub struct StackPages {
    seq: SeqLock,
    next: AtomicU64,
    /// The entry the last lookup found, looked at first (a walk's lookups are mostly of one
    /// stack page): only a hint, any value of it is safe.
    last: AtomicU64,
    /// Per entry: CR3 (or `ANY_CR3`), guest-virtual base and offset mask of the page, entry
    /// address, entry value, guest-physical base.
    entries: [[AtomicU64; 6]; STACK_PAGES],
}

impl StackPages {
    const fn new() -> Self {
        StackPages {
            seq: SeqLock::new(),
            next: AtomicU64::new(0),
            last: AtomicU64::new(0),
            entries: [const { [const { AtomicU64::new(EMPTY) }; 6] }; STACK_PAGES],
        }
    }

    #[inline(always)]
    fn tag(cr3: u64, va: u64) -> u64 {
        if va >= stack_walk::UPPER_HALF.lo {
            ANY_CR3
        } else {
            cr3
        }
    }

    /// The guest-physical address of the 4 KiB page at `page` under `cr3`, if an entry has it
    /// and still holds (`read_u64` reads the guest's memory, for the paging entry).
    #[inline(always)]
    pub fn find(&self, cr3: u64, page: u64, read_u64: impl Fn(u64) -> Option<u64>) -> Option<u64> {
        let tag = Self::tag(cr3, page);
        // The tag first: a walk's other entries are not loaded further.
        let entry = |e: &[AtomicU64; 6]| {
            let v = |i: usize| e[i].load(Ordering::Relaxed);
            if v(0) != tag {
                return None;
            }
            let mask = v(2);
            (page & !mask == v(1)).then(|| (v(3), v(4), v(5) + (page & mask)))
        };
        let hit = self.seq.read(|| {
            let last = self.last.load(Ordering::Relaxed) as usize % STACK_PAGES;
            entry(&self.entries[last]).or_else(|| {
                let (i, hit) = self
                    .entries
                    .iter()
                    .enumerate()
                    .find_map(|(i, e)| entry(e).map(|hit| (i, hit)))?;
                self.last.store(i as u64, Ordering::Relaxed);
                Some(hit)
            })
        });
        let (entry_gpa, entry, gpa) = hit?;
        (read_u64(entry_gpa) == Some(entry)).then_some(gpa)
    }

    /// Remembers that `va` under `cr3` is in the page `leaf` maps.
    pub fn remember(&self, cr3: u64, va: u64, leaf: Leaf) {
        let slot = (self.next.fetch_add(1, Ordering::Relaxed) as usize) % STACK_PAGES;
        let mask = leaf.size - 1;
        self.write(
            slot,
            [
                Self::tag(cr3, va),
                va & !mask,
                mask,
                leaf.entry_gpa,
                leaf.entry,
                leaf.gpa & !mask,
            ],
        );
    }

    /// Forgets every entry.
    fn forget(&self) {
        for slot in 0..STACK_PAGES {
            self.write(slot, [EMPTY; 6]);
        }
    }

    fn write(&self, slot: usize, values: [u64; 6]) {
        self.seq.write(|| {
            for (e, v) in self.entries[slot].iter().zip(values) {
                e.store(v, Ordering::Relaxed);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lock's three interruptions: a read inside a write and a read that a write
    /// interrupts get nothing; a write inside a write is not made.
    #[test]
    fn the_seqlock_keeps_readers_and_writers_apart() {
        let (lock, word) = (SeqLock::new(), AtomicU64::new(1));
        let read = || lock.read(|| Some(word.load(Ordering::Relaxed)));
        assert_eq!(read(), Some(1));
        lock.write(|| {
            assert_eq!(read(), None);
            lock.write(|| word.store(2, Ordering::Relaxed));
            word.store(3, Ordering::Relaxed);
        });
        assert_eq!(read(), Some(3));
        let interrupted = lock.read(|| {
            lock.write(|| word.store(4, Ordering::Relaxed));
            Some(word.load(Ordering::Relaxed))
        });
        assert_eq!(interrupted, None);
        assert_eq!(read(), Some(4));
    }

    /// A guest page table's leaf for the 2 MiB page at `gpa`, its entry at `entry_gpa`.
    fn leaf(gpa: u64, entry_gpa: u64) -> Leaf {
        Leaf {
            gpa,
            entry_gpa,
            entry: gpa | 0x83,
            size: 2 << 20,
            rights: 0x2,
        }
    }

    /// Two VMs whose guests run at the same CR3 (0x3000, as every test guest) with other code
    /// at the same address: what the first VM's walks found ordinary is not ordinary for the
    /// second, which runs a prologue there.
    #[test]
    fn another_vm_at_the_same_address_starts_from_nothing() {
        let cache = WalkCache::new();
        let (cr3, rip) = (0x3000, 0x20_1234);
        cache.enter_vm(0);
        cache.ordinary_code(cr3).remember(rip);
        assert!(cache.ordinary_code(cr3).is_ordinary(rip));
        cache.enter_vm(0);
        assert!(
            cache.ordinary_code(cr3).is_ordinary(rip),
            "the same VM keeps its memo"
        );
        cache.enter_vm(1);
        assert!(
            !cache.ordinary_code(cr3).is_ordinary(rip),
            "VM 1 must look at its own code at {rip:#x}"
        );
        // A kernel-half address (tagged for every CR3) likewise.
        let kernel = 0xffff_ffff_8100_0000;
        cache.ordinary_code(cr3).remember(kernel);
        cache.enter_vm(0);
        assert!(!cache.ordinary_code(0x9000).is_ordinary(kernel));
    }

    /// The same for translated pages: VM 0 maps guest-virtual 0x200000 to guest-physical
    /// 0x200000 and VM 1 to 0x600000, with the paging entry at the same guest-physical address
    /// holding the same value in each VM's memory (the first VM's entry would pass the check
    /// against the second VM's memory).
    #[test]
    fn another_vms_translations_are_not_used() {
        let cache = WalkCache::new();
        let cr3 = 0x3000;
        let entry_gpa = 0x5008;
        let vm0 = leaf(0x20_0000, entry_gpa);
        // Both VMs' memories hold VM 0's entry at `entry_gpa`.
        let memory = |gpa: u64| (gpa == entry_gpa).then_some(vm0.entry);
        cache.enter_vm(0);
        cache.pages.remember(cr3, 0x20_1000, vm0);
        assert_eq!(cache.pages.find(cr3, 0x20_3000, memory), Some(0x20_3000));
        cache.enter_vm(1);
        assert_eq!(
            cache.pages.find(cr3, 0x20_3000, memory),
            None,
            "VM 1 walks its own page tables"
        );
        // And its own entries work as before.
        cache.pages.remember(cr3, 0x20_1000, vm0);
        assert_eq!(cache.pages.find(cr3, 0x20_3000, memory), Some(0x20_3000));
    }

    /// The entry of the last lookup is looked at first: lookups that alternate between pages,
    /// an entry replaced after it was found, and a forgotten cache all find what the entries
    /// hold now, never what the hint pointed to before.
    #[test]
    fn the_last_entry_found_is_only_a_hint() {
        let cache = WalkCache::new();
        cache.enter_vm(0);
        let cr3 = 0x3000;
        let page = |i: u64| 0x40_0000 * (i + 1);
        let leaves: [Leaf; STACK_PAGES] =
            core::array::from_fn(|i| leaf(page(i as u64), 0x5000 + 8 * i as u64));
        let memory = |gpa: u64| leaves.iter().find(|l| l.entry_gpa == gpa).map(|l| l.entry);
        for (i, l) in leaves.iter().enumerate() {
            cache.pages.remember(cr3, page(i as u64), *l);
        }
        for round in 0..3 {
            for i in [3u64, 0, 3, 1, 1, 2] {
                assert_eq!(
                    cache.pages.find(cr3, page(i) + 0x1000, memory),
                    Some(page(i) + 0x1000),
                    "round {round}, page {i}"
                );
            }
        }
        // The entry last found (page 0's, slot 0) replaced by another page, as the next
        // `remember` does: page 0 is not found through the hint any more, the new page is, and
        // the others still are.
        assert_eq!(cache.pages.find(cr3, page(0), memory), Some(page(0)));
        let other = leaf(0x400_0000, 0x6000);
        let memory2 = |gpa: u64| {
            (gpa == other.entry_gpa)
                .then_some(other.entry)
                .or_else(|| memory(gpa))
        };
        cache.pages.remember(cr3, other.gpa, other);
        assert_eq!(cache.pages.find(cr3, page(0), memory2), None);
        assert_eq!(
            cache.pages.find(cr3, other.gpa + 0x1000, memory2),
            Some(other.gpa + 0x1000)
        );
        for i in 1..STACK_PAGES as u64 {
            assert_eq!(cache.pages.find(cr3, page(i), memory2), Some(page(i)));
        }
        cache.pages.forget();
        assert!((0..STACK_PAGES as u64).all(|i| cache.pages.find(cr3, page(i), memory).is_none()));
    }

    #[test]
    fn a_changed_paging_entry_is_translated_anew() {
        let cache = WalkCache::new();
        cache.enter_vm(0);
        let l = leaf(0x40_0000, 0x5010);
        cache.pages.remember(0x3000, 0x40_0000, l);
        assert_eq!(
            cache.pages.find(0x3000, 0x40_1000, |_| Some(l.entry)),
            Some(0x40_1000)
        );
        assert_eq!(cache.pages.find(0x3000, 0x40_1000, |_| Some(0)), None);
        assert_eq!(
            cache.pages.find(0x4000, 0x40_1000, |_| Some(l.entry)),
            None,
            "another CR3's lower half"
        );
    }
}
