//! The EPT builder: tables in frames from a [`FrameSource`], reached through [`PhysMem`].

use core::fmt;
use core::sync::atomic::{Ordering, compiler_fence};

use crate::entry::{
    Entry, EptCaps, Leaf, Level, MemoryType, Misconfig, PageSize, Permissions, TableRef,
    decode_entry, encode_leaf, encode_table,
};
use crate::{PAGE_1G, PAGE_2M, PAGE_4K};

/// Guest-physical address width a 4-level EPT translates: bits 47:0 (SDM Vol. 3C §29.3.2).
pub const MAX_GPA_BITS: u32 = 48;

/// Page-walk length of the tables this crate builds (SDM Vol. 3C §29.3.2).
const WALK_LENGTH: u64 = 4;

/// Errors of the builder and of the entry encoders.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Error {
    /// An address or length is not aligned to 4 KiB (or an entry address to its page size).
    Unaligned,
    /// The frame source is exhausted.
    OutOfFrames,
    /// `gpa` (the first such address of the requested range) is already mapped.
    AlreadyMapped { gpa: u64 },
    /// The range goes beyond the 48-bit GPA space, beyond MAXPHYADDR (at most 52 bits) of HPA,
    /// or wraps around.
    AddressTooWide,
    /// No access at all, write without read, or execute-only where the CPU has none
    /// (SDM Vol. 3C §29.3.3.1).
    BadPermissions,
    /// The frame source returned an address that is not 4 KiB aligned or is beyond MAXPHYADDR.
    BadFrame { hpa: u64 },
    /// Unmapping the range would split the large page that maps `gpa`.
    WouldSplit { gpa: u64 },
    /// A paging-structure entry met on the way to `gpa` is misconfigured: the tables were
    /// written behind the builder's back.
    Corrupt {
        gpa: u64,
        level: Level,
        reason: Misconfig,
    },
    /// `EptCaps::phys_addr_bits` is not a plausible MAXPHYADDR (32..=52).
    BadCaps,
    /// `gpa` is not mapped.
    NotMapped { gpa: u64 },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unaligned => f.write_str("EPT: address or length not 4 KiB aligned"),
            Self::OutOfFrames => f.write_str("EPT: out of frames for paging structures"),
            Self::AlreadyMapped { gpa } => write!(f, "EPT: GPA {gpa:#x} is already mapped"),
            Self::AddressTooWide => {
                f.write_str("EPT: address beyond the 48-bit GPA space or MAXPHYADDR")
            }
            Self::BadPermissions => f.write_str(
                "EPT: bad permissions (none, write without read, or unsupported execute-only)",
            ),
            Self::BadFrame { hpa } => {
                write!(f, "EPT: frame source returned an unusable frame {hpa:#x}")
            }
            Self::WouldSplit { gpa } => {
                write!(
                    f,
                    "EPT: unmapping would split the large page mapping GPA {gpa:#x}"
                )
            }
            Self::Corrupt { gpa, level, reason } => {
                write!(
                    f,
                    "EPT: misconfigured {level} on the walk of GPA {gpa:#x}: {reason}"
                )
            }
            Self::BadCaps => f.write_str("EPT: MAXPHYADDR outside 32..=52"),
            Self::NotMapped { gpa } => write!(f, "EPT: GPA {gpa:#x} is not mapped"),
        }
    }
}

/// Source of paging-structure frames.
pub trait FrameSource {
    /// A 4 KiB-aligned host-physical frame, already zeroed, owned by the EPT from now on (the
    /// builder never frees frames), or `None` when exhausted.
    fn alloc_zeroed_frame(&mut self) -> Option<u64>;
}

/// Access to host-physical memory holding the paging structures.
///
/// On hardware the tables may be live (in use by a CPU in VMX non-root operation) while they
/// are changed, so `write_u64` must be one 8-byte aligned store (a volatile `u64` write), never
/// split, so the CPU's page walk sees the old or the new entry and nothing in between.
pub trait PhysMem {
    fn read_u64(&self, hpa: u64) -> u64;
    fn write_u64(&mut self, hpa: u64, v: u64);
}

/// The result of a GPA→HPA walk (SDM Vol. 3C §29.3.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Translation {
    /// Host-physical address of the probed GPA (from [`Ept::for_each_mapping`]: of the page).
    pub hpa: u64,
    /// The rights the translation allows: the AND of bits 2:0 over every entry of the walk
    /// (SDM Vol. 3C §29.3.3.2).
    pub perms: Permissions,
    pub memtype: MemoryType,
    pub ignore_pat: bool,
    pub page_size: PageSize,
    /// Accessed / dirty flags of the leaf (meaningful only with EPTP bit 6, §29.3.4).
    pub accessed: bool,
    pub dirty: bool,
}

/// A GPA walk in full: where it ended and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Walk {
    Mapped(Translation),
    /// The entry at `level` is not present: an access would be an EPT violation.
    NotPresent {
        level: Level,
    },
    /// The entry at `level` would cause an EPT misconfiguration.
    Misconfigured {
        level: Level,
        reason: Misconfig,
    },
}

impl Walk {
    pub fn translation(self) -> Option<Translation> {
        match self {
            Self::Mapped(t) => Some(t),
            _ => None,
        }
    }
}

/// Counts of the structures in an EPT.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub pages_4k: u64,
    pub pages_2m: u64,
    pub pages_1g: u64,
    /// Paging-structure pages, the PML4 included. Tables are never freed, so this includes
    /// tables emptied by `unmap` or by a failed `map`.
    pub table_pages: u64,
}

impl Stats {
    /// Guest-physical bytes mapped.
    pub fn mapped_bytes(&self) -> u64 {
        self.pages_4k * PAGE_4K + self.pages_2m * PAGE_2M + self.pages_1g * PAGE_1G
    }
    fn count(&mut self, size: PageSize, add: bool) {
        let c = match size {
            PageSize::Size4K => &mut self.pages_4k,
            PageSize::Size2M => &mut self.pages_2m,
            PageSize::Size1G => &mut self.pages_1g,
        };
        if add {
            *c += 1;
        } else {
            *c -= 1;
        }
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} MiB mapped: {} x 1 GiB, {} x 2 MiB, {} x 4 KiB; {} table pages",
            self.mapped_bytes() >> 20,
            self.pages_1g,
            self.pages_2m,
            self.pages_4k,
            self.table_pages
        )
    }
}

/// A run of leaves contiguous in GPA and HPA with equal attributes, for reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappedRange {
    pub gpa: u64,
    pub hpa: u64,
    pub len: u64,
    pub perms: Permissions,
    pub memtype: MemoryType,
}

impl fmt::Display for MappedRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "GPA {:#x}..{:#x} -> HPA {:#x} {:#} {}",
            self.gpa,
            self.gpa + self.len,
            self.hpa,
            self.perms,
            self.memtype
        )
    }
}

/// An EPTP for a 4-level EPT whose PML4 is at `pml4_hpa` (SDM Vol. 3C §25.6.11, Table 25-9):
/// bits 2:0 paging-structure memory type WB (6), bits 5:3 page-walk length − 1 (3), bit 6
/// enable accessed/dirty flags, bits N−1:12 the PML4 address; bits 7 (supervisor shadow-stack
/// enforcement) and 11:8 are 0.
///
/// The CPU must allow WB paging structures (IA32_VMX_EPT_VPID_CAP bit 14) and, for `ad_bits`,
/// A/D flags (bit 21); otherwise VM entry fails on an invalid control field (SDM Vol. 3C
/// §27.2.1.1).
pub const fn eptp(pml4_hpa: u64, ad_bits: bool) -> u64 {
    (pml4_hpa & crate::entry::ADDR_MASK)
        | MemoryType::WriteBack as u64
        | (WALK_LENGTH - 1) << 3
        | if ad_bits { 1 << 6 } else { 0 }
}

/// Where a walk for one GPA stopped (internal).
enum Slot {
    /// The entry at `slot` (its HPA) of `level` is not present.
    Hole {
        level: Level,
    },
    /// A leaf at `level`, found in the entry at `slot`; `perms` is the AND over the walk.
    Leaf {
        level: Level,
        slot: u64,
        leaf: Leaf,
        perms: Permissions,
    },
    Bad {
        level: Level,
        reason: Misconfig,
    },
}

/// A 4-level EPT, built over `M`'s memory (SDM Vol. 3C §29.3).
///
/// Invariants kept by the builder: every table entry it writes is read/write/execute and
/// references a zeroed (or builder-written) table; every leaf it writes is valid for the
/// capabilities given at construction; a GPA is never remapped without `unmap` first.
pub struct Ept<M> {
    mem: M,
    pml4: u64,
    caps: EptCaps,
    stats: Stats,
}

impl<M: PhysMem> Ept<M> {
    /// Host-physical address of the PML4 table.
    pub fn pml4_hpa(&self) -> u64 {
        self.pml4
    }
    pub fn caps(&self) -> &EptCaps {
        &self.caps
    }
    pub fn stats(&self) -> Stats {
        self.stats
    }
    pub fn mem(&self) -> &M {
        &self.mem
    }
    /// The memory, e.g. to allocate other frames from the same source. Writing the tables
    /// through it breaks the builder's invariants (and `walk` will report what it finds).
    pub fn mem_mut(&mut self) -> &mut M {
        &mut self.mem
    }
    /// The memory back; the tables stay where they are (the frames are not freed).
    pub fn into_inner(self) -> M {
        self.mem
    }

    /// The EPTP that makes the CPU use these tables (see [`eptp`] for what the CPU must
    /// support). With `ad_bits`, the CPU treats guest paging-structure accesses as writes
    /// (SDM Vol. 3C §29.3.4), so guest page tables must be mapped writable.
    pub fn eptp(&self, ad_bits: bool) -> u64 {
        eptp(self.pml4, ad_bits)
    }

    /// Walks the tables for `gpa` (SDM Vol. 3C §29.3.2), stopping at the leaf, at a
    /// not-present entry, or at a misconfigured one.
    fn locate(&self, gpa: u64) -> Slot {
        let mut table = self.pml4;
        let mut level = Level::Pml4;
        let mut perms = Permissions::all();
        loop {
            let slot = table + level.index(gpa) * 8;
            match decode_entry(level, self.mem.read_u64(slot), &self.caps) {
                Ok(Entry::NotPresent) => return Slot::Hole { level },
                Ok(Entry::Page(leaf)) => {
                    return Slot::Leaf {
                        level,
                        slot,
                        leaf,
                        perms: perms & leaf.perms,
                    };
                }
                Ok(Entry::Table(t)) => match level.next() {
                    Some(next) => {
                        perms &= t.perms;
                        table = t.addr;
                        level = next;
                    }
                    // decode_entry never reports a table in a PT.
                    None => unreachable!(),
                },
                Err(reason) => return Slot::Bad { level, reason },
            }
        }
    }

    /// The full walk of `gpa`. A GPA at or above 2^48 is not translated (`NotPresent` at the
    /// PML4): a 4-level EPT has no entries for it.
    pub fn walk(&self, gpa: u64) -> Walk {
        if gpa >> MAX_GPA_BITS != 0 {
            return Walk::NotPresent { level: Level::Pml4 };
        }
        match self.locate(gpa) {
            Slot::Hole { level } => Walk::NotPresent { level },
            Slot::Bad { level, reason } => Walk::Misconfigured { level, reason },
            Slot::Leaf {
                level, leaf, perms, ..
            } => {
                // Leaves exist only at levels with a page size.
                let page_size = level.page_size().unwrap_or(PageSize::Size4K);
                Walk::Mapped(Translation {
                    hpa: leaf.addr | (gpa & (page_size.bytes() - 1)),
                    perms,
                    memtype: leaf.memtype,
                    ignore_pat: leaf.ignore_pat,
                    page_size,
                    accessed: leaf.accessed,
                    dirty: leaf.dirty,
                })
            }
        }
    }

    /// GPA → HPA (SDM Vol. 3C §29.3.2): `None` if not mapped (or misconfigured).
    pub fn translate(&self, gpa: u64) -> Option<Translation> {
        self.walk(gpa).translation()
    }

    /// Calls `f(gpa_of_page, translation_of_page)` for every leaf, in increasing GPA order.
    /// Misconfigured entries are skipped (use [`Ept::walk`] to diagnose one).
    pub fn for_each_mapping(&self, mut f: impl FnMut(u64, &Translation)) {
        self.visit(self.pml4, Level::Pml4, 0, Permissions::all(), &mut f);
    }

    fn visit(
        &self,
        table: u64,
        level: Level,
        base: u64,
        perms: Permissions,
        f: &mut impl FnMut(u64, &Translation),
    ) {
        for i in 0..512 {
            let gpa = base + i * level.coverage();
            match decode_entry(level, self.mem.read_u64(table + i * 8), &self.caps) {
                Ok(Entry::Table(t)) => {
                    if let Some(next) = level.next() {
                        self.visit(t.addr, next, gpa, perms & t.perms, f);
                    }
                }
                Ok(Entry::Page(leaf)) => {
                    let page_size = level.page_size().unwrap_or(PageSize::Size4K);
                    f(
                        gpa,
                        &Translation {
                            hpa: leaf.addr,
                            perms: perms & leaf.perms,
                            memtype: leaf.memtype,
                            ignore_pat: leaf.ignore_pat,
                            page_size,
                            accessed: leaf.accessed,
                            dirty: leaf.dirty,
                        },
                    );
                }
                Ok(Entry::NotPresent) | Err(_) => {}
            }
        }
    }

    /// Like [`Ept::for_each_mapping`], with leaves contiguous in GPA and HPA and of equal rights
    /// and memory type merged into one range.
    pub fn for_each_range(&self, mut f: impl FnMut(&MappedRange)) {
        let mut run: Option<MappedRange> = None;
        self.for_each_mapping(|gpa, t| {
            let len = t.page_size.bytes();
            if let Some(r) = run.as_mut() {
                if r.gpa + r.len == gpa
                    && r.hpa + r.len == t.hpa
                    && r.perms == t.perms
                    && r.memtype == t.memtype
                {
                    r.len += len;
                    return;
                }
                f(r);
            }
            run = Some(MappedRange {
                gpa,
                hpa: t.hpa,
                len,
                perms: t.perms,
                memtype: t.memtype,
            });
        });
        if let Some(r) = run {
            f(&r);
        }
    }

    /// The first mapped GPA in `[start, end)`, skipping holes a whole entry at a time.
    fn first_mapped(&self, start: u64, end: u64) -> Result<Option<u64>, Error> {
        let mut cur = start;
        while cur < end {
            match self.locate(cur) {
                Slot::Hole { level } => cur = (cur | (level.coverage() - 1)) + 1,
                Slot::Leaf { .. } => return Ok(Some(cur)),
                Slot::Bad { level, reason } => {
                    return Err(Error::Corrupt {
                        gpa: cur,
                        level,
                        reason,
                    });
                }
            }
        }
        Ok(None)
    }

    /// Clears every leaf in `[start, end)`. With `check`, changes nothing and fails if a leaf
    /// straddles a boundary of the range. Returns the bytes unmapped (or that would be).
    fn clear_range(&mut self, start: u64, end: u64, check: bool) -> Result<u64, Error> {
        let mut cur = start;
        let mut cleared = 0;
        while cur < end {
            match self.locate(cur) {
                Slot::Hole { level } => cur = (cur | (level.coverage() - 1)) + 1,
                Slot::Leaf { level, slot, .. } => {
                    let size = level.page_size().unwrap_or(PageSize::Size4K);
                    let base = cur & !(size.bytes() - 1);
                    if base < start || base + size.bytes() > end {
                        return Err(Error::WouldSplit { gpa: cur });
                    }
                    if !check {
                        // One store makes the entry not present (bits 2:0 = 0, §29.3.2).
                        self.mem.write_u64(slot, 0);
                        self.stats.count(size, false);
                    }
                    cleared += size.bytes();
                    cur = base + size.bytes();
                }
                Slot::Bad { level, reason } => {
                    return Err(Error::Corrupt {
                        gpa: cur,
                        level,
                        reason,
                    });
                }
            }
        }
        Ok(cleared)
    }

    /// Checks a range request: 4 KiB alignment, the 48-bit GPA space, MAXPHYADDR for HPA.
    fn check_range(&self, gpa: u64, hpa: Option<u64>, len: u64) -> Result<(), Error> {
        let mask = PAGE_4K - 1;
        if (gpa | hpa.unwrap_or(0) | len) & mask != 0 {
            return Err(Error::Unaligned);
        }
        let fits = |a: u64, bits: u32| a.checked_add(len).is_some_and(|e| e <= 1u64 << bits);
        if !fits(gpa, MAX_GPA_BITS)
            || hpa.is_some_and(|h| !fits(h, self.caps.phys_addr_bits.into()))
        {
            return Err(Error::AddressTooWide);
        }
        Ok(())
    }

    /// Unmaps every page in `[gpa, gpa + len)`, holes allowed, and returns the bytes unmapped.
    /// Fails with `WouldSplit` (changing nothing) if a large page crosses either end.
    /// Paging-structure pages are kept.
    ///
    /// On live tables the caller must then execute INVEPT (single-context with this EPTP, or
    /// all-context) before the HPA frames are reused, since the CPU may still hold the old
    /// translations (SDM Vol. 3C §29.4.3, "Guidelines for Use of the INVEPT Instruction").
    pub fn unmap(&mut self, gpa: u64, len: u64) -> Result<u64, Error> {
        self.check_range(gpa, None, len)?;
        self.clear_range(gpa, gpa + len, true)?;
        self.clear_range(gpa, gpa + len, false)
    }
}

impl<M: PhysMem + FrameSource> Ept<M> {
    /// Allocates the PML4 table. `caps.phys_addr_bits` must be MAXPHYADDR (32..=52).
    pub fn new(mut mem: M, caps: EptCaps) -> Result<Self, Error> {
        if !(32..=52).contains(&caps.phys_addr_bits) {
            return Err(Error::BadCaps);
        }
        let pml4 = Self::frame(&mut mem, &caps)?;
        Ok(Self {
            mem,
            pml4,
            caps,
            stats: Stats {
                table_pages: 1,
                ..Stats::default()
            },
        })
    }

    fn frame(mem: &mut M, caps: &EptCaps) -> Result<u64, Error> {
        let hpa = mem.alloc_zeroed_frame().ok_or(Error::OutOfFrames)?;
        if hpa & (PAGE_4K - 1) != 0 || hpa >> caps.phys_addr_bits != 0 {
            return Err(Error::BadFrame { hpa });
        }
        Ok(hpa)
    }

    /// Maps `[gpa, gpa + len)` to `[hpa, hpa + len)` with `perms` and `memtype` (guest PAT
    /// honoured: ignore-PAT clear, SDM Vol. 3C §29.3.7.2), with the largest pages that the
    /// alignment of both addresses, the remaining length and the CPU allow. A region where a
    /// page table already exists (left by earlier 4 KiB mappings) gets smaller pages instead of
    /// a large one: existing entries are never replaced.
    ///
    /// All or nothing: if any page of the range is mapped, fails with `AlreadyMapped` (its
    /// first GPA) without touching the tables; on `OutOfFrames` the leaves written so far are
    /// cleared again, so the range is unmapped as before (new, empty tables may remain linked).
    /// On live tables, a failed `map` should be followed by INVEPT, since the guest may have
    /// used the leaves for a moment (SDM Vol. 3C §29.4.3).
    ///
    /// The HPA range must be memory the VM may own: never the hypervisor's, never these tables.
    pub fn map(
        &mut self,
        gpa: u64,
        hpa: u64,
        len: u64,
        perms: Permissions,
        memtype: MemoryType,
    ) -> Result<(), Error> {
        self.check_range(gpa, Some(hpa), len)?;
        // §29.3.3.1: no write without read, no execute-only unless supported; and an entry
        // without rights would not be present at all (§29.3.2).
        if perms.is_empty()
            || (perms.contains(Permissions::WRITE) && !perms.contains(Permissions::READ))
            || (perms == Permissions::EXECUTE && !self.caps.execute_only)
        {
            return Err(Error::BadPermissions);
        }
        if let Some(first) = self.first_mapped(gpa, gpa + len)? {
            return Err(Error::AlreadyMapped { gpa: first });
        }
        let mut done = 0;
        while done < len {
            match self.map_one(gpa + done, hpa + done, len - done, perms, memtype) {
                Ok(size) => done += size,
                Err(e) => {
                    // Everything in [gpa, gpa + done) was written by this call and is whole.
                    let _ = self.clear_range(gpa, gpa + done, false);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Grants or takes away execute permission on the 4 KiB page at `gpa`, read and write as they
    /// were. A large page that holds it is first split into 512 pages of the next size with its
    /// own permissions and memory type (recursively down to 4 KiB), so the rest of it keeps what
    /// it had. Returns whether the page's permissions changed; `NotMapped` for a hole. On
    /// `OutOfFrames` no permission changed (a split made before it stays: the same memory with
    /// the same attributes in smaller pages).
    ///
    /// Taking execute away from a page of live tables needs INVEPT (single-context with this
    /// EPTP) before the guest may rely on it, and so does a split (SDM Vol. 3C §29.4.3.1); a grant
    /// may leave a stale not-executable translation, whose EPT violation then asks for the same
    /// grant again (which changes nothing: the caller invalidates and retries).
    pub fn set_execute(&mut self, gpa: u64, execute: bool) -> Result<bool, Error> {
        let gpa = gpa & !(PAGE_4K - 1);
        loop {
            let (level, slot, leaf) = match self.locate(gpa) {
                Slot::Leaf {
                    level, slot, leaf, ..
                } => (level, slot, leaf),
                Slot::Hole { .. } => return Err(Error::NotMapped { gpa }),
                Slot::Bad { level, reason } => return Err(Error::Corrupt { gpa, level, reason }),
            };
            if leaf.perms.contains(Permissions::EXECUTE) == execute {
                // Already so, whatever the page's size: nothing to split.
                return Ok(false);
            }
            if level == Level::Pt {
                let mut perms = leaf.perms;
                perms.set(Permissions::EXECUTE, execute);
                if perms == leaf.perms {
                    return Ok(false);
                }
                if perms == Permissions::EXECUTE && !self.caps.execute_only {
                    return Err(Error::BadPermissions);
                }
                let raw = encode_leaf(level, &Leaf { perms, ..leaf })?;
                self.mem.write_u64(slot, raw);
                return Ok(true);
            }
            self.split(level, slot, leaf)?;
        }
    }

    /// Replaces the large page `leaf` in the entry at `slot` of `level` by a table of 512 pages
    /// of the next size covering the same memory with the same attributes.
    fn split(&mut self, level: Level, slot: u64, leaf: Leaf) -> Result<(), Error> {
        let (Some(next), Some(size)) = (level.next(), level.page_size()) else {
            return Err(Error::BadPermissions);
        };
        let small = next.page_size().map_or(PAGE_4K, |p| p.bytes());
        let frame = Self::frame(&mut self.mem, &self.caps)?;
        for i in 0..512 {
            let piece = Leaf {
                addr: leaf.addr + i * small,
                ..leaf
            };
            self.mem
                .write_u64(frame + i * 8, encode_leaf(next, &piece)?);
        }
        self.link_table(slot, frame)?;
        self.stats.count(size, false);
        let smaller = next.page_size().unwrap_or(PageSize::Size4K);
        for _ in 0..512 {
            self.stats.count(smaller, true);
        }
        Ok(())
    }

    /// Points the entry at `slot` to the table in `frame` (read/write/execute), once the frame's
    /// contents are written.
    fn link_table(&mut self, slot: u64, frame: u64) -> Result<(), Error> {
        let raw = encode_table(&TableRef {
            addr: frame,
            perms: Permissions::all(),
            accessed: false,
        })?;
        // The frame's contents (zeroes, or the pages of a split) must be in memory before the
        // CPU can reach the frame (x86 stores are not reordered with each other; keep the
        // compiler from it).
        compiler_fence(Ordering::Release);
        self.mem.write_u64(slot, raw);
        self.stats.table_pages += 1;
        Ok(())
    }

    /// Maps one page at `gpa` (known unmapped), the largest allowed; returns its size.
    fn map_one(
        &mut self,
        gpa: u64,
        hpa: u64,
        remaining: u64,
        perms: Permissions,
        memtype: MemoryType,
    ) -> Result<u64, Error> {
        let mut table = self.pml4;
        let mut level = Level::Pml4;
        loop {
            let slot = table + level.index(gpa) * 8;
            let current = decode_entry(level, self.mem.read_u64(slot), &self.caps)
                .map_err(|reason| Error::Corrupt { gpa, level, reason })?;
            let allowed = match level {
                Level::Pml4 => false,
                Level::Pdpt => self.caps.pages.one_gib,
                Level::Pd => self.caps.pages.two_mib,
                Level::Pt => true,
            };
            if let (Entry::NotPresent, Some(size), true) = (current, level.page_size(), allowed) {
                let bytes = size.bytes();
                if (gpa | hpa) & (bytes - 1) == 0 && remaining >= bytes {
                    let raw = encode_leaf(level, &Leaf::new(hpa, perms, memtype))?;
                    self.mem.write_u64(slot, raw);
                    self.stats.count(size, true);
                    return Ok(bytes);
                }
            }
            let Some(next) = level.next() else {
                // A present PTE: first_mapped said the range was free.
                return Err(Error::AlreadyMapped { gpa });
            };
            table = match current {
                Entry::Table(t) => t.addr,
                Entry::Page(_) => return Err(Error::AlreadyMapped { gpa }),
                Entry::NotPresent => {
                    let frame = Self::frame(&mut self.mem, &self.caps)?;
                    self.link_table(slot, frame)?;
                    frame
                }
            };
            level = next;
        }
    }
}
