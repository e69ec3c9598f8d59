//! The parsers of outside input never panic, whatever the bytes.

use linux_guest::btf::Btf;
use linux_guest::btf::synth::Builder;
use linux_guest::kallsyms::synth::{Options, build};
use linux_guest::{BzImage, Kallsyms, SetupHeader, TaskOffsets};
use proptest::prelude::*;

/// A bzImage header around `payload` (one setup sector).
fn bzimage(payload: &[u8], payload_len: u32, setup_sects: u8) -> Vec<u8> {
    let mut img = vec![0u8; 1024];
    img[0x1f1] = setup_sects;
    img[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
    img[0x202..0x206].copy_from_slice(b"HdrS");
    img[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
    img[0x20e..0x210].copy_from_slice(&0xfff0u16.to_le_bytes());
    img[0x24c..0x250].copy_from_slice(&payload_len.to_le_bytes());
    img.extend_from_slice(payload);
    img
}

fn btf_blob() -> Vec<u8> {
    let mut b = Builder::new();
    let int = b.int("int", 4);
    let inner = b.structure("", 16, &[("pgd", int, 64)]);
    let anon = b.union("", 16, &[("x", int, 0), ("", inner, 0)]);
    b.structure("mm_struct", 64, &[("", anon, 128)]);
    let v = b.var("current_task", int);
    b.datasec(".data..percpu", &[(v, 0x100, 8)]);
    b.finish()
}

fn kallsyms_blob() -> Vec<u8> {
    let names: Vec<String> = (0..300).map(|i| format!("Tfn_{i}")).collect();
    let syms: Vec<(u64, &str)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (0xffff_ffff_8100_0000 + 16 * i as u64, n.as_str()))
        .collect();
    build(
        &syms,
        0xffff_ffff_8100_0000,
        16,
        Options {
            offsets_first: true,
            seqs: true,
        },
    )
}

fn mutate(mut blob: Vec<u8>, flips: &[(usize, u8)]) -> Vec<u8> {
    let n = blob.len();
    for &(at, v) in flips {
        blob[at % n] = v;
    }
    blob
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn bzimage_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = SetupHeader::parse(&bytes);
        if let Ok(bz) = BzImage::parse(&bytes) {
            let _ = bz.vmlinux();
        }
    }

    #[test]
    fn bzimage_header_with_garbage_payload(
        kind in 0usize..4,
        body in proptest::collection::vec(any::<u8>(), 0..512),
        claimed in any::<u32>(),
        sects in any::<u8>(),
    ) {
        let magic: &[u8] = [&[0x02u8, 0x21, 0x4c, 0x18][..], b"\xfd7zXZ\0", b"\x1f\x8b", b""][kind];
        let payload = [magic, &body].concat();
        let len = if claimed % 2 == 0 { payload.len() as u32 } else { claimed };
        let img = bzimage(&payload, len, sects);
        if let Ok(bz) = BzImage::parse(&img) {
            let _ = bz.vmlinux_size();
            let _ = bz.vmlinux();
            let _ = bz.to_string();
        }
    }

    #[test]
    fn btf_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
        if let Ok(btf) = Btf::parse(&bytes) {
            for id in 0..btf.len() as u32 + 2 {
                let _ = btf.member(id, "pgd");
                let _ = btf.array_len(id);
                let _ = btf.size_of(id);
            }
        }
    }

    #[test]
    fn btf_mutated(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
        let blob = mutate(btf_blob(), &flips);
        if let Ok(btf) = Btf::parse(&blob) {
            if let Ok(mm) = btf.struct_id("mm_struct") {
                let _ = btf.member(mm, "pgd");
            }
            for id in 0..btf.len() as u32 + 2 {
                let _ = btf.member(id, "x");
                let _ = btf.size_of(id);
                let _ = btf.array_len(id);
            }
            let _ = btf.datasec_var(".data..percpu", "current_task");
        }
    }

    #[test]
    fn kallsyms_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..4096), base in any::<u64>()) {
        let _ = Kallsyms::find(&bytes, base & !7);
    }

    #[test]
    fn kallsyms_mutated(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
        let blob = mutate(kallsyms_blob(), &flips);
        if let Ok(k) = Kallsyms::find(&blob, 0xffff_ffff_8200_0000) {
            let _ = k.lookup(0xffff_ffff_8100_0010);
            let _ = k.by_name("fn_3");
        }
    }

    #[test]
    fn task_offsets_text(s in "\\PC{0,80}") {
        let _ = s.parse::<TaskOffsets>();
    }

    #[test]
    fn task_offsets_round_trip(ct in any::<u64>(), v in proptest::array::uniform6(any::<u32>())) {
        let o = TaskOffsets { current_task: ct, pid: v[0], tgid: v[1], comm: v[2], comm_len: v[3], mm: v[4], pgd: v[5] };
        prop_assert_eq!(o.to_compact().parse::<TaskOffsets>().unwrap(), o);
    }
}
