//! EPT paging-structure entries: permissions, memory types, the four entry formats and the
//! validating decoder (SDM Vol. 3C §29.3.2, Tables 29-1..29-6; §29.3.3.1; §29.3.7).

use core::fmt;

use bitflags::bitflags;

use crate::table::Error;
use crate::{PAGE_1G, PAGE_2M, PAGE_4K};

bitflags! {
    /// Access rights of an EPT entry, bits 2:0 of every format (SDM Vol. 3C §29.3.2,
    /// Tables 29-1..29-6). `EXECUTE` is bit 2: execute access, or supervisor-mode execute access
    /// when "mode-based execute control for EPT" is 1 (this crate never sets the user-mode
    /// execute bit 10, so it is meant for VMs without that control).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct Permissions: u8 {
        const READ = 1 << 0;
        const WRITE = 1 << 1;
        const EXECUTE = 1 << 2;
    }
}

impl Permissions {
    pub const RW: Self = Self::READ.union(Self::WRITE);
    pub const RX: Self = Self::READ.union(Self::EXECUTE);
    pub const RWX: Self = Self::all();
}

/// `read/write/execute` (the words joined by `/`, or `none`); with `{:#}`, the compact `rwx`
/// form with `-` for a missing right.
impl fmt::Display for Permissions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const NAMES: [(Permissions, &str, &str); 3] = [
            (Permissions::READ, "read", "r"),
            (Permissions::WRITE, "write", "w"),
            (Permissions::EXECUTE, "execute", "x"),
        ];
        if f.alternate() {
            for (p, _, c) in NAMES {
                f.write_str(if self.contains(p) { c } else { "-" })?;
            }
            return Ok(());
        }
        if self.is_empty() {
            return f.write_str("none");
        }
        let mut first = true;
        for (p, name, _) in NAMES {
            if self.contains(p) {
                if !first {
                    f.write_str("/")?;
                }
                f.write_str(name)?;
                first = false;
            }
        }
        Ok(())
    }
}

/// An EPT memory type, bits 5:3 of a leaf entry (SDM Vol. 3C §29.3.7 "EPT and Memory Typing";
/// the encodings are those of the PAT/MTRR types, Vol. 3A §12.3). Values 2, 3 and 7 are reserved
/// and cause an EPT misconfiguration in a leaf (§29.3.3.1), so they have no variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MemoryType {
    Uncacheable = 0,
    WriteCombining = 1,
    WriteThrough = 4,
    WriteProtected = 5,
    WriteBack = 6,
}

impl TryFrom<u8> for MemoryType {
    /// The reserved value itself.
    type Error = u8;
    fn try_from(v: u8) -> Result<Self, u8> {
        Ok(match v {
            0 => Self::Uncacheable,
            1 => Self::WriteCombining,
            4 => Self::WriteThrough,
            5 => Self::WriteProtected,
            6 => Self::WriteBack,
            _ => return Err(v),
        })
    }
}

impl fmt::Display for MemoryType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Uncacheable => "UC",
            Self::WriteCombining => "WC",
            Self::WriteThrough => "WT",
            Self::WriteProtected => "WP",
            Self::WriteBack => "WB",
        })
    }
}

/// Size of the page a leaf entry maps (SDM Vol. 3C §29.3.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PageSize {
    Size4K,
    Size2M,
    Size1G,
}

impl PageSize {
    pub const fn bytes(self) -> u64 {
        match self {
            Self::Size4K => PAGE_4K,
            Self::Size2M => PAGE_2M,
            Self::Size1G => PAGE_1G,
        }
    }
}

impl fmt::Display for PageSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Size4K => "4 KiB",
            Self::Size2M => "2 MiB",
            Self::Size1G => "1 GiB",
        })
    }
}

/// The large pages the CPU supports: IA32_VMX_EPT_VPID_CAP bit 16 (2 MiB) and bit 17 (1 GiB)
/// (SDM Vol. 3D §A.10). Without support, bit 7 of an EPT PDE / PDPTE is reserved
/// (SDM Vol. 3C §29.3.2), so setting it is a misconfiguration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageSizes {
    pub two_mib: bool,
    pub one_gib: bool,
}

/// What the CPU allows, as far as EPT entries are concerned. Build it from the vmx crate's
/// capability reading: IA32_VMX_EPT_VPID_CAP bits 0 (execute-only), 16 and 17 (page sizes), and
/// MAXPHYADDR from `CPUID.80000008H:EAX[7:0]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EptCaps {
    pub pages: PageSizes,
    /// Execute-only translations (bits 2:0 = 100b) are allowed: IA32_VMX_EPT_VPID_CAP bit 0.
    /// Without it they are a misconfiguration (SDM Vol. 3C §29.3.3.1).
    pub execute_only: bool,
    /// MAXPHYADDR. Address bits 51:MAXPHYADDR of every entry are reserved
    /// (SDM Vol. 3C §29.3.2, Tables 29-1..29-6; §29.3.3.1). At most 52.
    pub phys_addr_bits: u8,
}

/// A level of the 4-level EPT hierarchy (SDM Vol. 3C §29.3.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Level {
    /// EPT PML4 table: entries reference a PDPT (Table 29-1).
    Pml4,
    /// EPT page-directory-pointer table: 1 GiB leaf (Table 29-2) or page directory (Table 29-3).
    Pdpt,
    /// EPT page directory: 2 MiB leaf (Table 29-4) or page table (Table 29-5).
    Pd,
    /// EPT page table: 4 KiB leaf (Table 29-6).
    Pt,
}

impl Level {
    /// Bit position of this level's index field in a GPA: 47:39, 38:30, 29:21, 20:12
    /// (SDM Vol. 3C §29.3.2).
    pub const fn shift(self) -> u32 {
        match self {
            Self::Pml4 => 39,
            Self::Pdpt => 30,
            Self::Pd => 21,
            Self::Pt => 12,
        }
    }
    /// Bytes of guest-physical space one entry of this level controls.
    pub const fn coverage(self) -> u64 {
        1 << self.shift()
    }
    /// The index of the entry of this level used to translate `gpa`.
    pub const fn index(self, gpa: u64) -> u64 {
        (gpa >> self.shift()) & 0x1ff
    }
    /// The level below, `None` for the page table.
    pub const fn next(self) -> Option<Self> {
        match self {
            Self::Pml4 => Some(Self::Pdpt),
            Self::Pdpt => Some(Self::Pd),
            Self::Pd => Some(Self::Pt),
            Self::Pt => None,
        }
    }
    /// The size of a page mapped by a leaf at this level; `None` for the PML4, which has none.
    pub const fn page_size(self) -> Option<PageSize> {
        match self {
            Self::Pml4 => None,
            Self::Pdpt => Some(PageSize::Size1G),
            Self::Pd => Some(PageSize::Size2M),
            Self::Pt => Some(PageSize::Size4K),
        }
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Pml4 => "PML4E",
            Self::Pdpt => "PDPTE",
            Self::Pd => "PDE",
            Self::Pt => "PTE",
        })
    }
}

// Bit positions shared by Tables 29-1..29-6 (SDM Vol. 3C §29.3.2).
pub(crate) const RWX_MASK: u64 = 0b111;
const MEMTYPE_SHIFT: u32 = 3; // bits 5:3, leaves only
const MEMTYPE_MASK: u64 = 0b111 << MEMTYPE_SHIFT;
const IGNORE_PAT: u64 = 1 << 6; // leaves only
const PAGE_SIZE_BIT: u64 = 1 << 7; // PDPTE / PDE: 1 = maps a page
const ACCESSED: u64 = 1 << 8; // meaningful only with EPTP bit 6 (§29.3.4)
const DIRTY: u64 = 1 << 9; // leaves only, with EPTP bit 6
/// Bits 51:12: the widest address field (MAXPHYADDR ≤ 52).
pub(crate) const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;

/// Bits `hi..=lo` set.
const fn bits(hi: u32, lo: u32) -> u64 {
    ((1u64 << (hi + 1)) - 1) & !((1u64 << lo) - 1)
}

/// Address bits 51:MAXPHYADDR, reserved in every entry (SDM Vol. 3C §29.3.2).
const fn high_reserved(phys_addr_bits: u8) -> u64 {
    let n = if phys_addr_bits > 52 {
        52
    } else {
        phys_addr_bits as u32
    };
    ADDR_MASK & !((1u64 << n) - 1)
}

/// A present, non-leaf entry: it references the paging structure of the next level
/// (Tables 29-1, 29-3, 29-5, which share one layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableRef {
    /// Host-physical address of the next table, 4 KiB aligned (bits N-1:12).
    pub addr: u64,
    /// Bits 2:0. The rights of a translation are the AND over all the entries of the walk
    /// (SDM Vol. 3C §29.3.3.2), so tables built by [`crate::Ept`] are always read/write/execute.
    pub perms: Permissions,
    /// Bit 8, written by the CPU when EPTP bit 6 enables accessed flags (§29.3.4).
    pub accessed: bool,
}

/// A present leaf: a PDPTE or PDE with bit 7 set, or a PTE (Tables 29-2, 29-4, 29-6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leaf {
    /// Host-physical address of the page, aligned to the page size.
    pub addr: u64,
    pub perms: Permissions,
    /// Bits 5:3 (§29.3.7).
    pub memtype: MemoryType,
    /// Bit 6: if set, the guest PAT is ignored and `memtype` is the effective type (§29.3.7.2).
    pub ignore_pat: bool,
    /// Bit 8 (with EPTP bit 6).
    pub accessed: bool,
    /// Bit 9 (with EPTP bit 6).
    pub dirty: bool,
}

impl Leaf {
    /// A leaf with the guest PAT honoured and the A/D flags clear.
    pub const fn new(addr: u64, perms: Permissions, memtype: MemoryType) -> Self {
        Self {
            addr,
            perms,
            memtype,
            ignore_pat: false,
            accessed: false,
            dirty: false,
        }
    }
}

/// A decoded, valid entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// Bits 2:0 are 0: the entry is not present and all its other bits are ignored
    /// (SDM Vol. 3C §29.3.2).
    NotPresent,
    Table(TableRef),
    Page(Leaf),
}

/// Why the CPU would take an EPT misconfiguration VM exit (exit reason 49) on an entry
/// (SDM Vol. 3C §29.3.3.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Misconfig {
    /// Bit 1 set and bit 0 clear.
    WriteWithoutRead,
    /// Bits 2:0 = 100b on a CPU without execute-only support (IA32_VMX_EPT_VPID_CAP bit 0).
    ExecuteOnlyUnsupported,
    /// Bit 7 of a PDPTE (PDE) set on a CPU without 1 GiB (2 MiB) EPT pages: the bit is reserved.
    LargePageUnsupported { level: Level },
    /// These reserved bits are set (the entry's own reserved fields, or address bits at and
    /// above MAXPHYADDR).
    ReservedBits { mask: u64 },
    /// A leaf has memory type 2, 3 or 7.
    ReservedMemoryType(u8),
}

impl fmt::Display for Misconfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::WriteWithoutRead => f.write_str("write access without read access"),
            Self::ExecuteOnlyUnsupported => {
                f.write_str("execute-only entry on a CPU without execute-only EPT translations")
            }
            Self::LargePageUnsupported { level } => write!(
                f,
                "bit 7 (page size) set in an EPT {level} but the CPU has no such EPT pages"
            ),
            Self::ReservedBits { mask } => write!(f, "reserved bits {mask:#x} set"),
            Self::ReservedMemoryType(t) => write!(f, "reserved memory type {t}"),
        }
    }
}

/// Validates and decodes a raw entry of `level` the way the CPU's page walk would
/// (SDM Vol. 3C §29.3.2 for the formats, §29.3.3.1 for the misconfiguration rules).
/// Ignored bits (9 and 11 of non-leaves, 10 without mode-based execute control, 63:52) are
/// dropped.
pub fn decode_entry(level: Level, raw: u64, caps: &EptCaps) -> Result<Entry, Misconfig> {
    let rwx = raw & RWX_MASK;
    // §29.3.2: an entry whose bits 2:0 are all 0 is not present; nothing else is looked at.
    if rwx == 0 {
        return Ok(Entry::NotPresent);
    }
    let perms = Permissions::from_bits_truncate(rwx as u8);
    // §29.3.3.1: "Bit 0 of the entry is clear (indicating that data reads are not allowed) and
    // bit 1 is set (indicating that data writes are allowed)."
    if perms.contains(Permissions::WRITE) && !perms.contains(Permissions::READ) {
        return Err(Misconfig::WriteWithoutRead);
    }
    // §29.3.3.1: execute-only (100b) unless IA32_VMX_EPT_VPID_CAP bit 0 allows it.
    if perms == Permissions::EXECUTE && !caps.execute_only {
        return Err(Misconfig::ExecuteOnlyUnsupported);
    }
    let is_leaf = match level {
        Level::Pml4 => false,
        Level::Pdpt | Level::Pd => raw & PAGE_SIZE_BIT != 0,
        Level::Pt => true,
    };
    // §29.3.2: bit 7 of a PDPTE (PDE) may be 1 only if the CPU supports 1 GiB (2 MiB) pages.
    if is_leaf
        && ((level == Level::Pdpt && !caps.pages.one_gib)
            || (level == Level::Pd && !caps.pages.two_mib))
    {
        return Err(Misconfig::LargePageUnsupported { level });
    }
    let own_reserved = match (level, is_leaf) {
        // Table 29-1: bits 7:3 reserved.
        (Level::Pml4, _) => bits(7, 3),
        // Tables 29-3, 29-5: bits 7:3 reserved; bit 7 is 0 here by construction.
        (Level::Pdpt | Level::Pd, false) => bits(6, 3),
        // Table 29-2: bits 29:12 reserved.
        (Level::Pdpt, true) => bits(29, 12),
        // Table 29-4: bits 20:12 reserved.
        (Level::Pd, true) => bits(20, 12),
        // Table 29-6: only the address bits above MAXPHYADDR (bit 7 is ignored).
        (Level::Pt, _) => 0,
    };
    let set = raw & (own_reserved | high_reserved(caps.phys_addr_bits));
    if set != 0 {
        return Err(Misconfig::ReservedBits { mask: set });
    }
    if !is_leaf {
        return Ok(Entry::Table(TableRef {
            addr: raw & ADDR_MASK,
            perms,
            accessed: raw & ACCESSED != 0,
        }));
    }
    // §29.3.3.1: a leaf whose bits 5:3 are 2, 3 or 7.
    let mt = ((raw & MEMTYPE_MASK) >> MEMTYPE_SHIFT) as u8;
    let memtype = MemoryType::try_from(mt).map_err(Misconfig::ReservedMemoryType)?;
    Ok(Entry::Page(Leaf {
        addr: raw & ADDR_MASK,
        perms,
        memtype,
        ignore_pat: raw & IGNORE_PAT != 0,
        accessed: raw & ACCESSED != 0,
        dirty: raw & DIRTY != 0,
    }))
}

/// Checks an address field: aligned to `align`, and within the 52-bit architectural limit
/// (the builder also checks MAXPHYADDR).
fn check_addr(addr: u64, align: u64) -> Result<u64, Error> {
    if addr & (align - 1) != 0 {
        return Err(Error::Unaligned);
    }
    if addr & !ADDR_MASK != 0 {
        return Err(Error::AddressTooWide);
    }
    Ok(addr)
}

/// Encodes a non-leaf entry (Tables 29-1, 29-3, 29-5): bits 7:3 zero.
pub(crate) fn encode_table(t: &TableRef) -> Result<u64, Error> {
    Ok(check_addr(t.addr, PAGE_4K)?
        | u64::from(t.perms.bits())
        | if t.accessed { ACCESSED } else { 0 })
}

/// Encodes a leaf at `level` (Tables 29-2, 29-4, 29-6). `level` must not be the PML4.
pub(crate) fn encode_leaf(level: Level, l: &Leaf) -> Result<u64, Error> {
    let size = match level.page_size() {
        Some(s) => s.bytes(),
        None => return Err(Error::Unaligned),
    };
    let ps = if level == Level::Pt { 0 } else { PAGE_SIZE_BIT };
    Ok(check_addr(l.addr, size)?
        | u64::from(l.perms.bits())
        | (l.memtype as u64) << MEMTYPE_SHIFT
        | if l.ignore_pat { IGNORE_PAT } else { 0 }
        | ps
        | if l.accessed { ACCESSED } else { 0 }
        | if l.dirty { DIRTY } else { 0 })
}

macro_rules! typed_entry {
    ($(#[$m:meta])* $name:ident, $level:expr) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
        #[repr(transparent)]
        pub struct $name(pub u64);

        impl $name {
            /// The paging-structure level this entry type belongs to.
            pub const LEVEL: Level = $level;
            /// A not-present entry.
            pub const NOT_PRESENT: Self = Self(0);
            pub const fn raw(self) -> u64 {
                self.0
            }
            /// Validates the entry as the CPU would (see [`decode_entry`]).
            pub fn decode(self, caps: &EptCaps) -> Result<Entry, Misconfig> {
                decode_entry(Self::LEVEL, self.0, caps)
            }
        }
    };
}

typed_entry!(
    /// An EPT PML4 entry (SDM Vol. 3C §29.3.2, Table 29-1); it always references a PDPT.
    Pml4e,
    Level::Pml4
);
typed_entry!(
    /// An EPT PDPT entry: a 1 GiB page (Table 29-2) or a page directory (Table 29-3).
    Pdpte,
    Level::Pdpt
);
typed_entry!(
    /// An EPT page-directory entry: a 2 MiB page (Table 29-4) or a page table (Table 29-5).
    Pde,
    Level::Pd
);
typed_entry!(
    /// An EPT page-table entry: a 4 KiB page (Table 29-6).
    Pte,
    Level::Pt
);

impl Pml4e {
    /// Fails with `Unaligned` or `AddressTooWide` on a bad `addr`.
    pub fn table(t: TableRef) -> Result<Self, Error> {
        encode_table(&t).map(Self)
    }
}
impl Pdpte {
    pub fn table(t: TableRef) -> Result<Self, Error> {
        encode_table(&t).map(Self)
    }
    /// A 1 GiB page: `addr` must be 1 GiB aligned.
    pub fn page(l: Leaf) -> Result<Self, Error> {
        encode_leaf(Level::Pdpt, &l).map(Self)
    }
}
impl Pde {
    pub fn table(t: TableRef) -> Result<Self, Error> {
        encode_table(&t).map(Self)
    }
    /// A 2 MiB page: `addr` must be 2 MiB aligned.
    pub fn page(l: Leaf) -> Result<Self, Error> {
        encode_leaf(Level::Pd, &l).map(Self)
    }
}
impl Pte {
    pub fn page(l: Leaf) -> Result<Self, Error> {
        encode_leaf(Level::Pt, &l).map(Self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAPS: EptCaps = EptCaps {
        pages: PageSizes {
            two_mib: true,
            one_gib: true,
        },
        execute_only: false,
        phys_addr_bits: 46,
    };

    fn leaves() -> impl Iterator<Item = (Permissions, MemoryType, bool, bool, bool)> {
        let perms = [
            Permissions::READ,
            Permissions::RW,
            Permissions::RX,
            Permissions::RWX,
        ];
        let types = [
            MemoryType::Uncacheable,
            MemoryType::WriteCombining,
            MemoryType::WriteThrough,
            MemoryType::WriteProtected,
            MemoryType::WriteBack,
        ];
        perms.into_iter().flat_map(move |p| {
            types.into_iter().flat_map(move |t| {
                (0..8u8).map(move |b| (p, t, b & 1 != 0, b & 2 != 0, b & 4 != 0))
            })
        })
    }

    #[test]
    fn leaf_round_trip_every_level() {
        let addr_1g = 0x12_4000_0000;
        for (perms, memtype, ipat, a, d) in leaves() {
            let mk = |addr| Leaf {
                addr,
                perms,
                memtype,
                ignore_pat: ipat,
                accessed: a,
                dirty: d,
            };
            let e = Pdpte::page(mk(addr_1g)).unwrap();
            assert_eq!(e.raw() & (1 << 7), 1 << 7);
            assert_eq!(e.decode(&CAPS), Ok(Entry::Page(mk(addr_1g))));
            let e = Pde::page(mk(addr_1g + PAGE_2M * 3)).unwrap();
            assert_eq!(e.raw() & (1 << 7), 1 << 7);
            assert_eq!(e.decode(&CAPS), Ok(Entry::Page(mk(addr_1g + PAGE_2M * 3))));
            let e = Pte::page(mk(0x3fff_ffff_f000)).unwrap();
            assert_eq!(e.raw() & (1 << 7), 0);
            assert_eq!(e.decode(&CAPS), Ok(Entry::Page(mk(0x3fff_ffff_f000))));
            // The exact bit layout of Table 29-6.
            assert_eq!(e.raw() & 7, u64::from(perms.bits()));
            assert_eq!((e.raw() >> 3) & 7, memtype as u64);
            assert_eq!(e.raw() >> 6 & 1, ipat as u64);
            assert_eq!(e.raw() >> 8 & 1, a as u64);
            assert_eq!(e.raw() >> 9 & 1, d as u64);
            assert_eq!(e.raw() & ADDR_MASK, 0x3fff_ffff_f000);
        }
    }

    #[test]
    fn table_round_trip_every_level() {
        for perms in [Permissions::READ, Permissions::RW, Permissions::RWX] {
            for accessed in [false, true] {
                let t = TableRef {
                    addr: 0x1234_5000,
                    perms,
                    accessed,
                };
                let raw = [
                    Pml4e::table(t).unwrap().raw(),
                    Pdpte::table(t).unwrap().raw(),
                    Pde::table(t).unwrap().raw(),
                ];
                for (level, raw) in [Level::Pml4, Level::Pdpt, Level::Pd].into_iter().zip(raw) {
                    assert_eq!(raw & bits(7, 3), 0);
                    assert_eq!(decode_entry(level, raw, &CAPS), Ok(Entry::Table(t)));
                }
            }
        }
        assert_eq!(Pte::NOT_PRESENT.decode(&CAPS), Ok(Entry::NotPresent));
        // Not present: everything but bits 2:0 is ignored.
        assert_eq!(Pml4e(!7).decode(&CAPS), Ok(Entry::NotPresent));
    }

    #[test]
    fn encoders_refuse_bad_addresses() {
        let l = |addr| Leaf::new(addr, Permissions::READ, MemoryType::WriteBack);
        assert_eq!(Pdpte::page(l(PAGE_2M)), Err(Error::Unaligned));
        assert_eq!(Pde::page(l(PAGE_4K)), Err(Error::Unaligned));
        assert_eq!(Pte::page(l(0x800)), Err(Error::Unaligned));
        assert_eq!(Pte::page(l(1 << 52)), Err(Error::AddressTooWide));
        let t = TableRef {
            addr: 0x10,
            perms: Permissions::RWX,
            accessed: false,
        };
        assert_eq!(Pml4e::table(t), Err(Error::Unaligned));
    }

    #[test]
    fn misconfigurations() {
        use Misconfig::*;
        let d = |level, raw| decode_entry(level, raw, &CAPS);
        // Write without read, with and without execute.
        assert_eq!(d(Level::Pt, 0b010 | 6 << 3), Err(WriteWithoutRead));
        assert_eq!(d(Level::Pml4, 0b110), Err(WriteWithoutRead));
        // Execute-only depends on the capability.
        assert_eq!(d(Level::Pt, 0b100 | 6 << 3), Err(ExecuteOnlyUnsupported));
        let xo = EptCaps {
            execute_only: true,
            ..CAPS
        };
        assert!(matches!(
            decode_entry(Level::Pt, 0b100 | 6 << 3, &xo),
            Ok(Entry::Page(Leaf {
                perms: Permissions::EXECUTE,
                ..
            }))
        ));
        // Reserved memory types in leaves.
        for mt in [2u64, 3, 7] {
            assert_eq!(d(Level::Pt, 1 | mt << 3), Err(ReservedMemoryType(mt as u8)));
            assert_eq!(
                d(Level::Pd, 1 | mt << 3 | 1 << 7),
                Err(ReservedMemoryType(mt as u8))
            );
        }
        // Bits 5:3 are reserved, not a memory type, in a non-leaf.
        assert_eq!(d(Level::Pd, 1 | 6 << 3), Err(ReservedBits { mask: 6 << 3 }));
        assert_eq!(
            d(Level::Pml4, 1 | 1 << 7),
            Err(ReservedBits { mask: 1 << 7 })
        );
        assert_eq!(
            d(Level::Pdpt, 1 | 1 << 6),
            Err(ReservedBits { mask: 1 << 6 })
        );
        // Bit 6 is "ignore PAT" in a leaf.
        assert!(d(Level::Pt, 1 | 6 << 3 | 1 << 6).is_ok());
        // Address bits below the page size of a large page.
        assert_eq!(
            d(Level::Pdpt, 1 | 6 << 3 | 1 << 7 | 1 << 29),
            Err(ReservedBits { mask: 1 << 29 })
        );
        assert_eq!(
            d(Level::Pd, 1 | 6 << 3 | 1 << 7 | 1 << 12),
            Err(ReservedBits { mask: 1 << 12 })
        );
        assert!(d(Level::Pd, 1 | 6 << 3 | 1 << 7 | 1 << 21).is_ok());
        // Address bits at and above MAXPHYADDR (46 here), in every format.
        for level in [Level::Pml4, Level::Pdpt, Level::Pd, Level::Pt] {
            let valid = if level == Level::Pt {
                1 | 6 << 3
            } else {
                0b111
            };
            assert_eq!(
                d(level, valid | 1 << 46),
                Err(ReservedBits { mask: 1 << 46 })
            );
        }
        assert!(d(Level::Pt, 1 | 6 << 3 | 1 << 45).is_ok());
        // Bits 63:52 are ignored.
        assert!(d(Level::Pt, 1 | 6 << 3 | 0xfff << 52).is_ok());
        // Large pages the CPU lacks.
        let small = EptCaps {
            pages: PageSizes::default(),
            ..CAPS
        };
        assert_eq!(
            decode_entry(Level::Pdpt, 1 | 6 << 3 | 1 << 7, &small),
            Err(LargePageUnsupported { level: Level::Pdpt })
        );
        assert_eq!(
            decode_entry(Level::Pd, 1 | 6 << 3 | 1 << 7, &small),
            Err(LargePageUnsupported { level: Level::Pd })
        );
        // Bit 7 is ignored in a PTE.
        assert!(decode_entry(Level::Pt, 1 | 6 << 3 | 1 << 7, &small).is_ok());
    }

    #[test]
    fn display() {
        assert_eq!(Permissions::RX.to_string(), "read/execute");
        assert_eq!(Permissions::empty().to_string(), "none");
        assert_eq!(format!("{:#}", Permissions::RX), "r-x");
        assert_eq!(MemoryType::WriteBack.to_string(), "WB");
        assert_eq!(MemoryType::try_from(3), Err(3));
        assert_eq!(PageSize::Size2M.to_string(), "2 MiB");
    }
}
