//! Checks on the real Debian kernel `cargo xtask linux-image` downloads (target/linux/).
//! Skipped, with a message, when it has not been built.

use std::path::PathBuf;

use linux_guest::{BzImage, KernelImage};

fn linux_dir() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => root.join(dir).join("linux"),
        None => root.join("target/linux"),
    }
}

fn input(name: &str) -> Option<PathBuf> {
    let path = linux_dir().join(name);
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
fn kallsyms_of_the_real_kernel_look_like_proc_kallsyms() {
    let Some(path) = input("vmlinux") else { return };
    let k = KernelImage::from_vmlinux(&path).unwrap();
    let syms = k.symbols.kernel_symbols();
    assert!(syms.len() > 50_000, "{} symbols", syms.len());
    assert!(syms.windows(2).all(|w| w[0].address <= w[1].address));
    let text = k.symbols.by_name("_text").unwrap().address;
    assert_eq!(text, k.symbols.layout().relative_base);
    assert_eq!(syms[0].address, text);
    for name in [
        "entry_SYSCALL_64",
        "schedule",
        "do_syscall_64",
        "startup_64",
    ] {
        let s = k
            .symbols
            .by_name(name)
            .unwrap_or_else(|| panic!("no {name}"));
        assert_eq!(s.kind, 'T', "{name}");
        assert!(
            s.address >= text && s.address < 0xffff_ffff_c000_0000,
            "{name}"
        );
        // An address inside the function resolves to it, with a plausible size.
        let hit = k.symbols.lookup(s.address + 1).unwrap();
        assert_eq!(hit.symbol.address, s.address);
        assert_eq!(hit.offset, 1);
        let size = hit.size.unwrap();
        assert!(size > 1 && size < 0x10_0000, "{name} size {size}");
    }
    // Local (static) functions are there too, as in /proc/kallsyms.
    assert!(syms.iter().any(|s| s.kind == 't'));
    assert!(
        k.symbols
            .percpu_symbols()
            .iter()
            .any(|s| s.name == "current_task")
    );
}

#[test]
fn task_offsets_and_kaslr_of_the_real_kernel() {
    let Some(path) = input("vmlinux") else { return };
    let k = KernelImage::from_vmlinux(&path).unwrap();
    let o = k.offsets;
    // The offsets BTF gave for Debian's 6.1.0-56-cloud-amd64 when it was first measured
    // (task_struct.pid 2416, tgid 2420, comm 2976, mm 2272; mm_struct.pgd 72). They are
    // derived from the image here, so other builds need only be plausible.
    if k.release() == Some("6.1.0-56-cloud-amd64") {
        assert_eq!(
            (o.pid, o.tgid, o.comm, o.mm, o.pgd),
            (2416, 2420, 2976, 2272, 72)
        );
    }
    assert_eq!(o.tgid, o.pid + 4);
    assert_eq!(o.comm_len, 16);
    assert!(o.mm < o.pid && o.pid < o.comm && o.comm < 16384);
    assert!(o.pgd < 4096 && o.current_task < 0x10_0000);
    let entry = k.entry_syscall_64().unwrap();
    assert_eq!(k.kaslr_slide(entry).unwrap(), 0);
    assert_eq!(k.kaslr_slide(entry + 0x1e00_0000).unwrap(), 0x1e00_0000);
    assert!(k.kaslr_slide(entry + 0x1000).is_err());
    assert!(k.kaslr_slide(entry - 0x20_0000).is_err());
    let schedule = k.symbols.by_name("schedule").unwrap().address;
    let hit = k.lookup(schedule + 0x1e00_0000 + 4, 0x1e00_0000).unwrap();
    assert_eq!((hit.symbol.name.as_str(), hit.offset), ("schedule", 4));
}

#[test]
fn bzimage_decompresses_to_the_vmlinux() {
    let (Some(bz), Some(vmlinux)) = (input("bzImage"), input("vmlinux")) else {
        return;
    };
    let bytes = std::fs::read(bz).unwrap();
    let image = BzImage::parse(&bytes).unwrap();
    let h = &image.header;
    assert!(h.version >= 0x020c && h.has_64bit_entry() && h.relocatable_kernel);
    assert_eq!(h.code32_start, 0x10_0000);
    assert!(h.init_size as u64 > image.vmlinux_size().unwrap() as u64 / 2);
    assert_eq!(image.vmlinux().unwrap(), std::fs::read(vmlinux).unwrap());
}
