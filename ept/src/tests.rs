//! Builder tests over fake memory.

use proptest::prelude::*;

use crate::fake::FakeMem;
use crate::*;

const GIB: u64 = PAGE_1G;
const MIB2: u64 = PAGE_2M;
const K4: u64 = PAGE_4K;
/// 3 GiB + 6 MiB + 12 KiB.
const REGION: u64 = 3 * GIB + 3 * MIB2 + 3 * K4;

fn caps(two_mib: bool, one_gib: bool) -> EptCaps {
    EptCaps {
        pages: PageSizes { two_mib, one_gib },
        execute_only: false,
        phys_addr_bits: 46,
    }
}

fn ept(frames: usize, caps: EptCaps) -> Ept<FakeMem> {
    Ept::new(FakeMem::new(frames), caps).unwrap()
}

fn stats(pages_1g: u64, pages_2m: u64, pages_4k: u64, table_pages: u64) -> Stats {
    Stats {
        pages_4k,
        pages_2m,
        pages_1g,
        table_pages,
    }
}

/// Walks every reachable table, checks that each entry decodes (no misconfiguration, no
/// pointer outside allocated frames: FakeMem panics), and recounts the stats.
fn audit(e: &Ept<FakeMem>) -> Stats {
    fn visit(e: &Ept<FakeMem>, table: u64, level: Level, s: &mut Stats) {
        s.table_pages += 1;
        for i in 0..512 {
            let raw = e.mem().read_u64(table + i * 8);
            match decode_entry(level, raw, e.caps()) {
                Ok(Entry::NotPresent) => assert_eq!(raw, 0, "half-written entry {raw:#x}"),
                Ok(Entry::Table(t)) => {
                    assert_eq!(t.perms, Permissions::RWX);
                    visit(e, t.addr, level.next().unwrap(), s);
                }
                Ok(Entry::Page(_)) => match level {
                    Level::Pdpt => s.pages_1g += 1,
                    Level::Pd => s.pages_2m += 1,
                    Level::Pt => s.pages_4k += 1,
                    Level::Pml4 => unreachable!(),
                },
                Err(m) => panic!("misconfigured {level} {raw:#x}: {m}"),
            }
        }
    }
    let mut s = Stats::default();
    visit(e, e.pml4_hpa(), Level::Pml4, &mut s);
    assert_eq!(s, e.stats(), "incremental stats disagree with the tables");
    s
}

#[test]
fn eptp_bits() {
    let e = ept(1, caps(true, true));
    let pml4 = e.pml4_hpa();
    assert_eq!(pml4 & 0xfff, 0);
    assert_eq!(e.eptp(false), pml4 | 6 | 3 << 3);
    assert_eq!(e.eptp(true), pml4 | 6 | 3 << 3 | 1 << 6);
    assert_eq!(eptp(0x1234_5000, false) & 0b111, 6, "WB");
    assert_eq!(eptp(0x1234_5000, false) >> 3 & 0b111, 3, "4-level walk");
    assert_eq!(eptp(0x1234_5000, true) & !0xfff, 0x1234_5000);
    assert_eq!(eptp(0x1234_5000, true) & 0xf80, 0, "bits 11:7 clear");
}

#[test]
fn new_needs_a_frame_and_sane_caps() {
    assert!(matches!(
        Ept::new(FakeMem::new(0), caps(true, true)),
        Err(Error::OutOfFrames)
    ));
    let bad = EptCaps {
        phys_addr_bits: 53,
        ..caps(true, true)
    };
    assert!(matches!(
        Ept::new(FakeMem::new(1), bad),
        Err(Error::BadCaps)
    ));
}

fn map_region(c: EptCaps, gpa: u64, hpa: u64) -> Stats {
    let mut e = ept(10_000, c);
    e.map(gpa, hpa, REGION, Permissions::RWX, MemoryType::WriteBack)
        .unwrap();
    assert_eq!(e.stats().mapped_bytes(), REGION);
    for probe in [0, K4, MIB2 + 5 * K4, GIB + 8, REGION - K4, REGION - 1] {
        let t = e.translate(gpa + probe).unwrap();
        assert_eq!(t.hpa, hpa + probe);
        assert_eq!(t.perms, Permissions::RWX);
        assert_eq!(t.memtype, MemoryType::WriteBack);
    }
    assert_eq!(e.translate(gpa + REGION), None);
    assert_eq!(e.translate(gpa - 1), None);
    audit(&e)
}

#[test]
fn page_size_mix_aligned() {
    // 1 GiB aligned: 3 x 1 GiB, 3 x 2 MiB, 3 x 4 KiB; PML4 + PDPT + PD + PT.
    assert_eq!(
        map_region(caps(true, true), GIB, 5 * GIB),
        stats(3, 3, 3, 4)
    );
    // Without 1 GiB pages: 3 * 512 + 3 x 2 MiB; one PD per GiB touched (4) + PT.
    assert_eq!(
        map_region(caps(true, false), GIB, 5 * GIB),
        stats(0, 1539, 3, 7)
    );
    // GPA 1 GiB aligned but HPA only 2 MiB aligned: no 1 GiB page can be used.
    assert_eq!(
        map_region(caps(true, true), GIB, 5 * GIB + MIB2),
        stats(0, 1539, 3, 7)
    );
}

#[test]
fn page_size_mix_misaligned() {
    // From 1 GiB + 4 KiB: 511 x 4 KiB up to 1 GiB + 2 MiB, 511 x 2 MiB up to 2 GiB,
    // 2 x 1 GiB up to 4 GiB, then 3 x 2 MiB and 4 x 4 KiB.
    // Tables: PML4, PDPT, PD+PT at 1 GiB, PD+PT at 4 GiB.
    let s = map_region(caps(true, true), GIB + K4, 9 * GIB + K4);
    assert_eq!(s, stats(2, 514, 515, 6));
    // Without 1 GiB pages the 2 GiB in the middle become 1024 x 2 MiB in two more PDs.
    let s = map_region(caps(true, false), GIB + K4, 9 * GIB + K4);
    assert_eq!(s, stats(0, 514 + 1024, 515, 8));
}

#[test]
fn four_kib_only() {
    // No large pages at all: every page is a PTE. 6 MiB + 12 KiB keeps this quick.
    let mut e = ept(100, caps(false, false));
    e.map(
        MIB2 - K4,
        0x4000_0000,
        3 * MIB2 + 3 * K4,
        Permissions::RX,
        MemoryType::Uncacheable,
    )
    .unwrap();
    assert_eq!(audit(&e), stats(0, 0, 1539, 1 + 1 + 1 + 5));
    let t = e.translate(MIB2 + 0x123).unwrap();
    assert_eq!(t.hpa, 0x4000_0000 + K4 + 0x123);
    assert_eq!(t.page_size, PageSize::Size4K);
    assert_eq!(t.memtype, MemoryType::Uncacheable);
}

#[test]
fn existing_page_table_forces_small_pages() {
    let mut e = ept(100, caps(true, true));
    e.map(0, 0x100_0000, K4, Permissions::READ, MemoryType::WriteBack)
        .unwrap();
    // [4 KiB, 4 MiB): the first 2 MiB share the page table, the second gets a 2 MiB page.
    e.map(
        K4,
        0x20_1000,
        2 * MIB2 - K4,
        Permissions::RW,
        MemoryType::WriteBack,
    )
    .unwrap();
    assert_eq!(audit(&e), stats(0, 1, 512, 4));
}

#[test]
fn overlap_is_refused_without_any_change() {
    let mut e = ept(100, caps(true, true));
    e.map(
        GIB + 3 * MIB2,
        0x8000_0000,
        MIB2 + 2 * K4,
        Permissions::RW,
        MemoryType::WriteBack,
    )
    .unwrap();
    let before = e.mem().clone();
    let stats = e.stats();
    let cases = [
        // Starts in fresh space that would need new tables, runs into the mapping.
        (0x1000, 2 * GIB, GIB + 3 * MIB2),
        // Exactly the same range.
        (GIB + 3 * MIB2, MIB2 + 2 * K4, GIB + 3 * MIB2),
        // Only the last 4 KiB page.
        (GIB + 4 * MIB2 + K4, K4, GIB + 4 * MIB2 + K4),
        // Starts inside, ends outside.
        (GIB + 4 * MIB2, 4 * MIB2, GIB + 4 * MIB2),
    ];
    for (gpa, len, first) in cases {
        assert_eq!(
            e.map(
                gpa,
                0x1_0000_0000,
                len,
                Permissions::RWX,
                MemoryType::WriteBack
            ),
            Err(Error::AlreadyMapped { gpa: first })
        );
        assert_eq!(e.mem(), &before, "tables or frame count changed");
        assert_eq!(e.stats(), stats);
    }
    // Adjacent on both sides is fine.
    e.map(
        GIB + 2 * MIB2,
        0,
        MIB2,
        Permissions::READ,
        MemoryType::WriteBack,
    )
    .unwrap();
    e.map(
        GIB + 4 * MIB2 + 2 * K4,
        0,
        K4,
        Permissions::READ,
        MemoryType::WriteBack,
    )
    .unwrap();
    audit(&e);
}

#[test]
fn out_of_frames_leaves_nothing_half_done() {
    // A fresh range from 511 GiB + 2 MiB - 4 KiB, 4 KiB pages only, crossing a PML4 entry and
    // several PDs: it needs PDPT, PD, PT, PT, ... frames along the way.
    let c = caps(false, false);
    let (gpa, len) = (512 * GIB - MIB2 - K4, 2 * MIB2 + 2 * K4);
    let needed = {
        let mut e = ept(1000, c);
        e.map(0, 0, K4, Permissions::READ, MemoryType::WriteBack)
            .unwrap();
        let t0 = e.stats().table_pages;
        e.map(gpa, 0x100_0000, len, Permissions::RW, MemoryType::WriteBack)
            .unwrap();
        e.stats().table_pages - t0
    };
    assert_eq!(needed, 2 + 1 + 1 + 2 + 1); // PT, PT before 512 GiB, (PDPT, PD, PT) after.
    for n in 0..needed {
        // 1 PML4 + 3 for the first mapping, then n frames.
        let mut e = ept(4 + n as usize, c);
        e.map(0, 0, K4, Permissions::READ, MemoryType::WriteBack)
            .unwrap();
        assert_eq!(
            e.map(gpa, 0x100_0000, len, Permissions::RW, MemoryType::WriteBack),
            Err(Error::OutOfFrames)
        );
        let s = audit(&e);
        assert_eq!((s.pages_4k, s.pages_2m, s.pages_1g), (1, 0, 0));
        let mut a = gpa;
        while a < gpa + len {
            assert!(matches!(e.walk(a), Walk::NotPresent { .. }));
            a += K4;
        }
        assert!(e.translate(0).is_some());
        // More frames: the same map now succeeds over the leftover empty tables.
        e.mem_mut().left += needed as usize;
        e.map(gpa, 0x100_0000, len, Permissions::RW, MemoryType::WriteBack)
            .unwrap();
        assert_eq!(
            e.translate(gpa + len - 1).unwrap().hpa,
            0x100_0000 + len - 1
        );
        audit(&e);
    }
}

#[test]
fn argument_checks() {
    let mut e = ept(10, caps(true, true));
    let wb = MemoryType::WriteBack;
    let rw = Permissions::RW;
    assert_eq!(e.map(0x800, 0, K4, rw, wb), Err(Error::Unaligned));
    assert_eq!(e.map(0, 0x800, K4, rw, wb), Err(Error::Unaligned));
    assert_eq!(e.map(0, 0, 0x800, rw, wb), Err(Error::Unaligned));
    assert_eq!(e.map(1 << 48, 0, K4, rw, wb), Err(Error::AddressTooWide));
    assert_eq!(
        e.map((1 << 48) - K4, 0, 2 * K4, rw, wb),
        Err(Error::AddressTooWide)
    );
    assert_eq!(e.map(!0xfff_u64, 0, K4, rw, wb), Err(Error::AddressTooWide));
    // MAXPHYADDR is 46 here.
    assert_eq!(e.map(0, 1 << 46, K4, rw, wb), Err(Error::AddressTooWide));
    assert_eq!(
        e.map(0, (1 << 46) - K4, 2 * K4, rw, wb),
        Err(Error::AddressTooWide)
    );
    for p in [
        Permissions::empty(),
        Permissions::WRITE,
        Permissions::WRITE | Permissions::EXECUTE,
        Permissions::EXECUTE,
    ] {
        assert_eq!(e.map(0, 0, K4, p, wb), Err(Error::BadPermissions), "{p:?}");
    }
    assert_eq!(e.stats(), stats(0, 0, 0, 1));
    // Zero length is a no-op; the top of the GPA space is reachable.
    e.map(0, 0, 0, rw, wb).unwrap();
    e.map((1 << 48) - K4, (1 << 46) - K4, K4, rw, wb).unwrap();
    assert_eq!(e.translate((1 << 48) - 1).unwrap().hpa, (1 << 46) - 1);
    assert_eq!(e.translate(1 << 48), None);
    // Execute-only where the CPU has it.
    let mut e = ept(
        10,
        EptCaps {
            execute_only: true,
            ..caps(true, true)
        },
    );
    e.map(0, 0, K4, Permissions::EXECUTE, wb).unwrap();
    assert_eq!(e.translate(0).unwrap().perms, Permissions::EXECUTE);
}

#[test]
fn unmap_then_remap() {
    let mut e = ept(20, caps(true, true));
    let wb = MemoryType::WriteBack;
    e.map(0, GIB, GIB + MIB2 + K4, Permissions::RWX, wb)
        .unwrap();
    assert_eq!(e.stats(), stats(1, 1, 1, 4));
    let before = e.mem().clone();
    // Cutting into the 1 GiB or the 2 MiB page is refused, changing nothing.
    assert_eq!(e.unmap(MIB2, MIB2), Err(Error::WouldSplit { gpa: MIB2 }));
    assert_eq!(
        e.unmap(GIB - K4, 2 * K4),
        Err(Error::WouldSplit { gpa: GIB - K4 })
    );
    assert_eq!(
        e.unmap(GIB + K4, MIB2 + K4),
        Err(Error::WouldSplit { gpa: GIB + K4 })
    );
    assert_eq!(e.mem(), &before);
    // Whole pages, holes included.
    assert_eq!(e.unmap(GIB, 4 * MIB2), Ok(MIB2 + K4));
    assert_eq!(e.translate(GIB), None);
    assert_eq!(e.translate(GIB - 1).unwrap().hpa, 2 * GIB - 1);
    assert_eq!(audit(&e), stats(1, 0, 0, 4));
    // Remapping reuses the now empty tables, with small pages where a table exists.
    e.map(GIB, 0, MIB2, Permissions::READ, MemoryType::Uncacheable)
        .unwrap();
    assert_eq!(audit(&e), stats(1, 1, 0, 4));
    e.map(GIB + MIB2, 0, MIB2, Permissions::READ, wb).unwrap();
    assert_eq!(audit(&e), stats(1, 1, 512, 4));
    assert_eq!(e.unmap(0, 1 << 47), Ok(GIB + 2 * MIB2));
    assert_eq!(audit(&e), stats(0, 0, 0, 4));
}

#[test]
fn walk_reports_misconfiguration() {
    let mut e = ept(20, caps(true, false));
    e.map(0, 0, 2 * MIB2, Permissions::RW, MemoryType::WriteBack)
        .unwrap();
    // Find the PDE for GPA 0 and give it memory type 2.
    let pml4e = e.mem().read_u64(e.pml4_hpa());
    let pdpt = pml4e & !0xfff;
    let pd = e.mem().read_u64(pdpt) & !0xfff;
    let pde = e.mem().read_u64(pd);
    assert_eq!(pde & 0xff, 0x80 | 6 << 3 | 0b011);
    e.mem_mut().write_u64(pd, (pde & !(7 << 3)) | 2 << 3);
    assert_eq!(
        e.walk(0x1234),
        Walk::Misconfigured {
            level: Level::Pd,
            reason: Misconfig::ReservedMemoryType(2)
        }
    );
    assert_eq!(e.translate(0x1234), None);
    assert!(e.translate(MIB2).is_some());
    assert_eq!(
        e.map(
            0,
            0x10_0000_0000,
            K4,
            Permissions::READ,
            MemoryType::WriteBack
        ),
        Err(Error::Corrupt {
            gpa: 0,
            level: Level::Pd,
            reason: Misconfig::ReservedMemoryType(2)
        })
    );
    // Write without read in the PML4E.
    let pml4 = e.pml4_hpa();
    e.mem_mut().write_u64(pml4, pml4e & !1);
    assert_eq!(
        e.walk(MIB2),
        Walk::Misconfigured {
            level: Level::Pml4,
            reason: Misconfig::WriteWithoutRead
        }
    );
}

#[test]
fn rights_are_anded_over_the_walk() {
    let mut e = ept(20, caps(true, true));
    e.map(0, 0, K4, Permissions::RWX, MemoryType::WriteBack)
        .unwrap();
    let pml4e = e.mem().read_u64(e.pml4_hpa());
    let pml4 = e.pml4_hpa();
    e.mem_mut().write_u64(pml4, pml4e & !0b010);
    assert_eq!(e.translate(0).unwrap().perms, Permissions::RX);
}

#[test]
fn ranges_for_reports() {
    let mut e = ept(20, caps(true, true));
    e.map(
        GIB - K4,
        0x100_0000 - K4,
        MIB2 + 2 * K4,
        Permissions::RWX,
        MemoryType::WriteBack,
    )
    .unwrap();
    e.map(
        GIB + MIB2 + K4,
        0,
        K4,
        Permissions::RWX,
        MemoryType::WriteBack,
    )
    .unwrap();
    e.map(
        GIB + MIB2 + 2 * K4,
        K4,
        K4,
        Permissions::READ,
        MemoryType::WriteBack,
    )
    .unwrap();
    let mut v = Vec::new();
    e.for_each_range(|r| v.push(r.to_string()));
    assert_eq!(
        v,
        [
            "GPA 0x3ffff000..0x40201000 -> HPA 0xfff000 rwx WB",
            "GPA 0x40201000..0x40202000 -> HPA 0x0 rwx WB",
            "GPA 0x40202000..0x40203000 -> HPA 0x1000 r-- WB",
        ]
    );
    let mut sizes = Vec::new();
    e.for_each_mapping(|gpa, t| sizes.push((gpa, t.page_size)));
    assert_eq!(sizes.len(), 1 + 1 + 1 + 1 + 1);
    assert_eq!(sizes[1], (GIB, PageSize::Size2M));
    assert_eq!(
        e.stats().to_string(),
        "2 MiB mapped: 0 x 1 GiB, 1 x 2 MiB, 4 x 4 KiB; 6 table pages"
    );
}

#[derive(Clone, Copy, Debug)]
struct Req {
    gpa: u64,
    hpa: u64,
    len: u64,
    perms: Permissions,
    memtype: MemoryType,
}

impl Req {
    fn end(&self) -> u64 {
        self.gpa + self.len
    }
}

#[derive(Clone, Debug)]
enum Op {
    Map(Req),
    /// Unmap the model region with this index (modulo their number).
    Unmap(usize),
}

/// An address made of GiB, 2 MiB and 4 KiB parts, often aligned so that large pages occur.
fn addr(gibs: u64) -> impl Strategy<Value = u64> {
    let part = || prop_oneof![Just(0u64), 0u64..512];
    (0..gibs, part(), part()).prop_map(|(g, m, k)| g * GIB + m * MIB2 + k * K4)
}

fn req(c: EptCaps) -> impl Strategy<Value = Req> {
    let perms = prop_oneof![
        Just(Permissions::READ),
        Just(Permissions::RW),
        Just(Permissions::RX),
        Just(Permissions::RWX),
    ];
    let memtype = prop_oneof![
        Just(MemoryType::WriteBack),
        Just(MemoryType::Uncacheable),
        Just(MemoryType::WriteCombining),
        Just(MemoryType::WriteThrough),
        Just(MemoryType::WriteProtected),
    ];
    let len = (0u64..2, prop_oneof![Just(0u64), 0u64..3], 0u64..4)
        .prop_map(|(g, m, k)| (g * GIB + m * MIB2 + k * K4).max(K4));
    (addr(6), addr(60), len, perms, memtype).prop_map(move |(gpa, hpa, len, perms, memtype)| {
        // Where only 4 KiB pages fit, keep the page count (and the test time) small.
        let small = !c.pages.two_mib || (gpa ^ hpa) & (MIB2 - 1) != 0;
        let len = if small { len.min(8 * MIB2) } else { len };
        Req {
            gpa,
            hpa,
            len,
            perms,
            memtype,
        }
    })
}

fn caps_and_ops() -> impl Strategy<Value = (EptCaps, Vec<Op>, Vec<u64>)> {
    (any::<bool>(), any::<bool>()).prop_flat_map(|(two_mib, one_gib)| {
        let c = caps(two_mib, one_gib);
        let op = prop_oneof![
            4 => req(c).prop_map(Op::Map),
            1 => any::<usize>().prop_map(Op::Unmap),
        ];
        (
            Just(c),
            prop::collection::vec(op, 1..8),
            prop::collection::vec(0u64..8 * GIB, 0..64),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Random maps (overlapping ones must be refused, naming their first mapped GPA) and
    /// unmaps against a model; then every probed address translates to exactly what the model
    /// says, or to nothing.
    #[test]
    fn translate_agrees_with_the_model((c, ops, probes) in caps_and_ops()) {
        let mut e = ept(100_000, c);
        let mut model: Vec<Req> = Vec::new();
        for op in ops {
            match op {
                Op::Map(r) => {
                    let first = model
                        .iter()
                        .filter(|m| m.gpa < r.end() && r.gpa < m.end())
                        .map(|m| m.gpa.max(r.gpa))
                        .min();
                    let got = e.map(r.gpa, r.hpa, r.len, r.perms, r.memtype);
                    match first {
                        Some(gpa) => prop_assert_eq!(got, Err(Error::AlreadyMapped { gpa })),
                        None => {
                            prop_assert_eq!(got, Ok(()));
                            model.push(r);
                        }
                    }
                }
                Op::Unmap(i) if !model.is_empty() => {
                    let r = model.remove(i % model.len());
                    prop_assert_eq!(e.unmap(r.gpa, r.len), Ok(r.len));
                }
                Op::Unmap(_) => prop_assert_eq!(e.unmap(0, 1 << 48), Ok(0)),
            }
        }
        let s = audit(&e);
        prop_assert_eq!(s.mapped_bytes(), model.iter().map(|r| r.len).sum::<u64>());
        let edges = model
            .iter()
            .flat_map(|r| [r.gpa.wrapping_sub(1), r.gpa, r.end() - 1, r.end()]);
        for a in probes.iter().copied().chain(edges) {
            let want = model.iter().find(|r| r.gpa <= a && a < r.end());
            let got = e.translate(a);
            match (want, got) {
                (None, None) => {}
                (Some(r), Some(t)) => {
                    prop_assert_eq!(t.hpa, r.hpa + (a - r.gpa));
                    prop_assert_eq!(t.perms, r.perms);
                    prop_assert_eq!(t.memtype, r.memtype);
                    // The page holding `a` lies inside the region.
                    let base = a & !(t.page_size.bytes() - 1);
                    prop_assert!(r.gpa <= base && base + t.page_size.bytes() <= r.end());
                    prop_assert!(t.page_size != PageSize::Size1G || c.pages.one_gib);
                    prop_assert!(t.page_size != PageSize::Size2M || c.pages.two_mib);
                }
                (w, g) => prop_assert!(false, "{a:#x}: model {w:?}, tables {g:?}"),
            }
        }
        // Every leaf lies inside one region, at the right HPA.
        let mut ok = true;
        e.for_each_mapping(|gpa, t| {
            ok &= model.iter().any(|r| {
                r.gpa <= gpa
                    && gpa + t.page_size.bytes() <= r.end()
                    && t.hpa == r.hpa + (gpa - r.gpa)
            });
        });
        prop_assert!(ok);
    }
}

#[test]
fn execute_is_set_per_4k_page_splitting_what_holds_it() {
    let mut e = ept(10_000, caps(true, true));
    // 1 GiB + 2 MiB + 4 KiB of read/write memory: a 1 GiB page, a 2 MiB page, a 4 KiB page.
    let len = GIB + MIB2 + K4;
    e.map(0, 4 * GIB, len, Permissions::RW, MemoryType::WriteBack)
        .unwrap();
    let before = audit(&e);
    assert_eq!(before, stats(1, 1, 1, 4));
    // Taking away what a large page does not have changes nothing and splits nothing.
    assert_eq!(e.set_execute(GIB + 5 * K4, false), Ok(false));
    assert_eq!(audit(&e), before);
    let perms = |e: &Ept<FakeMem>, gpa: u64| e.translate(gpa).unwrap().perms;
    // Inside the 1 GiB page: split to 2 MiB, then the 2 MiB piece to 4 KiB.
    let page = 3 * MIB2 + 7 * K4;
    assert_eq!(e.set_execute(page + 5, true), Ok(true));
    assert_eq!(perms(&e, page), Permissions::RWX);
    for other in [page - K4, page + K4, 0, GIB - K4, GIB + 8, GIB + MIB2] {
        assert_eq!(perms(&e, other), Permissions::RW, "{other:#x}");
        assert_eq!(e.translate(other).unwrap().hpa, 4 * GIB + other);
    }
    assert_eq!(e.translate(page).unwrap().hpa, 4 * GIB + page);
    assert_eq!(
        e.translate(page).unwrap().page_size,
        PageSize::Size4K,
        "split down to the page"
    );
    // 511 x 2 MiB and 512 x 4 KiB from the 1 GiB page, plus the others; two more tables.
    assert_eq!(audit(&e), stats(0, 511 + 1, 512 + 1, 6));
    // Again: nothing to change. Taken away: back to read/write, no more splits.
    assert_eq!(e.set_execute(page, true), Ok(false));
    assert_eq!(e.set_execute(page, false), Ok(true));
    assert_eq!(perms(&e, page), Permissions::RW);
    assert_eq!(audit(&e), stats(0, 512, 513, 6));
    // The lone 4 KiB page, a hole, and memory types kept.
    assert_eq!(e.set_execute(GIB + MIB2, true), Ok(true));
    assert_eq!(perms(&e, GIB + MIB2), Permissions::RWX);
    assert_eq!(e.set_execute(len, true), Err(Error::NotMapped { gpa: len }));
    assert_eq!(e.translate(page).unwrap().memtype, MemoryType::WriteBack);
    // Out of frames for the second split: no permission changes (the first split stays).
    let mut tight = ept(3, caps(true, true));
    tight
        .map(0, 0, GIB, Permissions::RW, MemoryType::WriteBack)
        .unwrap();
    assert_eq!(tight.set_execute(0, true), Err(Error::OutOfFrames));
    assert_eq!(tight.translate(0).unwrap().perms, Permissions::RW);
    assert_eq!(audit(&tight), stats(0, 512, 0, 3));
}
