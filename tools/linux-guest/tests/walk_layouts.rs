//! The walkers' layouts derived from the real Debian kernel's BTF (target/linux/, built by
//! `cargo xtask linux-image`; skipped with a message when absent), and the walkers run over a
//! model of that kernel's memory laid out by those offsets.

use std::path::PathBuf;

use hvprof_linux_walk::model::Memory;
use hvprof_linux_walk::{Budget, walk_modules, walk_vmas};
use linux_guest::KernelImage;

fn vmlinux() -> Option<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => root.join(dir).join("linux"),
        None => root.join("target/linux"),
    };
    let path = dir.join("vmlinux");
    if path.exists() {
        Some(path)
    } else {
        eprintln!(
            "skipped: {} is absent (run `cargo xtask linux-image`)",
            path.display()
        );
        None
    }
}

#[test]
fn layouts_of_the_real_kernel_are_derived_and_walk() {
    let Some(path) = vmlinux() else { return };
    let k = KernelImage::from_vmlinux(&path).unwrap();
    let mm = k.mm_layout.clone().unwrap();
    let m = mm.maple;
    // Linux 6.1 (lib/maple_tree.c): 256-byte nodes, 16 slots in range nodes, 10 in
    // allocation-range nodes, the metadata in the last slot / after the gaps.
    assert_eq!(
        (m.node_size, m.range64_slots, m.arange64_slots),
        (256, 16, 10)
    );
    assert_eq!(
        (m.range64_pivot, m.range64_slot, m.range64_meta),
        (8, 128, 248)
    );
    assert_eq!(
        (m.arange64_pivot, m.arange64_slot, m.arange64_meta),
        (8, 80, 240)
    );
    assert_eq!((mm.vm_start, mm.vm_end), (0, 8));
    let modules = k.module_layout.clone().unwrap();
    assert_eq!(modules.name_len, 56);
    assert!(modules.modules >= 0xffff_ffff_8000_0000);

    // One process of three VMAs in a one-leaf tree, laid out by the derived offsets.
    let mut mem = Memory::default();
    let mm_addr = 0xffff_8880_0100_0000u64;
    let leaf = 0xffff_8880_0200_0000u64;
    mem.zero(mm_addr, 4096);
    mem.zero(leaf, 256);
    mem.put_u64(mm_addr + u64::from(mm.mm_root), leaf | (1 << 3) | 2);
    let ranges = [
        (0x5555_0000_0000u64, 0x5555_0000_2000u64),
        (0x5555_0000_2000, 0x5555_0000_9000),
        (0x7fff_f000_0000, 0x7fff_f002_1000),
    ];
    let mut slot = 0u64;
    let mut prev = 0u64;
    for (i, &(s, e)) in ranges.iter().enumerate() {
        let vma = 0xffff_8880_0300_0000 + 0x1000 * i as u64;
        mem.zero(vma, 512);
        mem.put_u64(vma + u64::from(mm.vm_start), s);
        mem.put_u64(vma + u64::from(mm.vm_end), e);
        mem.put_u64(vma + u64::from(mm.vm_mm), mm_addr);
        mem.put_u64(vma + u64::from(mm.vm_flags), 0x4);
        mem.put_u64(vma + u64::from(mm.vm_pgoff), i as u64);
        if s > prev {
            mem.put_u64(leaf + u64::from(m.range64_pivot) + 8 * slot, s - 1);
            slot += 1;
        }
        mem.put_u64(leaf + u64::from(m.range64_pivot) + 8 * slot, e - 1);
        mem.put_u64(leaf + u64::from(m.range64_slot) + 8 * slot, vma);
        slot += 1;
        prev = e;
    }
    mem.put_u64(leaf + u64::from(m.range64_pivot) + 8 * slot, u64::MAX);
    mem.put(leaf + u64::from(m.range64_meta + m.meta_end), &[slot as u8]);
    let mut got = Vec::new();
    let w = walk_vmas(&mem, &mm, mm_addr, &mut Budget::new(1000), &mut |v| {
        got.push((v.start, v.end, v.pgoff));
        true
    });
    assert_eq!(w.stop, None);
    assert_eq!(
        got,
        ranges
            .iter()
            .enumerate()
            .map(|(i, r)| (r.0, r.1, i as u64))
            .collect::<Vec<_>>()
    );

    // Two modules on the list, laid out by the derived offsets.
    let head = modules.modules;
    let at = [0xffff_ffff_c000_0000u64, 0xffff_ffff_c001_0000];
    let node = |i: usize| at[i] + u64::from(modules.list);
    mem.zero(head, 16);
    mem.put_u64(head, node(0));
    mem.put_u64(head + 8, node(1));
    for (i, name) in ["virtio_blk", "ext4"].iter().enumerate() {
        mem.zero(at[i], 0x1000);
        mem.put_u64(node(i), if i == 0 { node(1) } else { head });
        mem.put_u64(node(i) + 8, if i == 0 { head } else { node(0) });
        mem.put(at[i] + u64::from(modules.name), name.as_bytes());
        mem.put_u64(
            at[i] + u64::from(modules.base),
            0xffff_ffff_c100_0000 + 0x10_0000 * i as u64,
        );
        mem.put(at[i] + u64::from(modules.size), &0x8000u32.to_le_bytes());
    }
    let mut names = Vec::new();
    let w = walk_modules(&mem, &modules, head, &mut Budget::new(100), &mut |m| {
        names.push((
            String::from_utf8_lossy(m.name()).into_owned(),
            m.base,
            m.size,
        ));
        true
    });
    assert_eq!(w.stop, None);
    assert_eq!(
        names,
        [
            ("virtio_blk".to_owned(), 0xffff_ffff_c100_0000, 0x8000),
            ("ext4".to_owned(), 0xffff_ffff_c110_0000, 0x8000)
        ]
    );
}
