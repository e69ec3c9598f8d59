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

/// The hypervisor's keys for the kernel (what the Linux scenarios and `cargo xtask run --config`
/// put on its module line) agree with what `cargo xtask linux-image` wrote in the manifest.
#[test]
fn module_keys_of_the_real_kernel_match_the_manifest() {
    let (Some(path), Some(manifest)) = (input("vmlinux"), input("manifest.json")) else {
        return;
    };
    let keys = KernelImage::from_vmlinux(&path).unwrap().module_keys();
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(manifest).unwrap()).unwrap();
    let o = &m["task_offsets"];
    let get = |k: &str| o[k].as_u64().unwrap();
    assert_eq!(
        keys.task_offsets,
        format!(
            "task-offsets={:#x}:{}:{}:{}",
            get("current_task"),
            get("pid"),
            get("tgid"),
            get("comm")
        )
    );
    for (key, field, derived) in [
        ("mm-layout", "mm_layout", &keys.mm_layout),
        ("module-layout", "module_layout", &keys.module_layout),
        ("orc-layout", "orc_layout", &keys.orc_layout),
    ] {
        let written = m[field].as_str().unwrap();
        match derived {
            Ok(word) => assert_eq!(*word, format!("{key}={written}")),
            Err(why) => assert_eq!(written, format!("unavailable: {why}")),
        }
    }
    let words = keys.words();
    assert_eq!(words.len(), 1 + 3 - keys.unavailable().len());
    assert!(words[0].starts_with("task-offsets=0x"), "{words:?}");
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

/// The kernel's memory as far as its loaded sections go (file bytes), with `.orc_lookup` filled
/// in as the kernel's `unwind_init` fills it at boot.
struct Image {
    sections: Vec<(u64, Vec<u8>)>,
}

impl hvprof_linux_walk::GuestMemory for Image {
    fn read(&self, addr: u64, out: &mut [u8]) -> bool {
        self.sections.iter().any(|(at, data)| {
            let Some(off) = addr.checked_sub(*at) else {
                return false;
            };
            let off = off as usize;
            let Some(bytes) = data.get(off..off + out.len()) else {
                return false;
            };
            out.copy_from_slice(bytes);
            true
        })
    }
}

#[test]
fn orc_tables_of_the_real_kernel_unwind_as_linux_reads_them() {
    use hvprof_linux_walk::orc::{OrcEntry, find, kind, reg};
    use hvprof_linux_walk::{Budget, GuestMemory};
    use object::{Object, ObjectSection};
    let Some(path) = input("vmlinux") else { return };
    let data = std::fs::read(&path).unwrap();
    let k = KernelImage::from_vmlinux_bytes(&data).unwrap();
    let l = k.orc_layout.clone().unwrap();
    let t = l.at(l.entry_syscall_64).unwrap();
    assert!(l.count > 100_000, "{l}");
    let elf = object::File::parse(&*data).unwrap();
    let mut sections: Vec<(u64, Vec<u8>)> = [".orc_unwind_ip", ".orc_unwind"]
        .iter()
        .map(|n| {
            let s = elf.section_by_name(n).unwrap();
            (s.address(), s.data().unwrap().to_vec())
        })
        .collect();
    let image = Image {
        sections: sections.clone(),
    };
    let ip_at = |i: u32| {
        let slot = t.ip_table + 4 * u64::from(i);
        let mut b = [0u8; 4];
        assert!(image.read(slot, &mut b));
        slot.wrapping_add_signed(i64::from(i32::from_le_bytes(b)))
    };
    let entry_at = |i: u32| {
        let mut b = [0u8; 6];
        assert!(image.read(t.entries + 6 * u64::from(i), &mut b));
        OrcEntry::from_bytes(b)
    };
    // Sorted at build time (scripts/sorttable), as `orc_find` needs.
    let ips: Vec<u64> = (0..l.count).map(ip_at).collect();
    assert!(ips.windows(2).all(|w| w[0] <= w[1]));
    // Every entry decodes to a register and type Linux 6.1 knows.
    let entries: Vec<OrcEntry> = (0..l.count).map(entry_at).collect();
    assert!(entries.iter().all(|e| e.sp_reg <= reg::SP_INDIRECT
        && [reg::UNDEFINED, reg::PREV_SP, reg::BP].contains(&e.bp_reg)
        && e.kind <= kind::REGS_PARTIAL));
    assert!(entries.iter().any(|e| e.sp_reg == reg::UNDEFINED && e.end));
    // A C function's first instruction: the return address on top of the stack.
    let rightmost = |ip: u64| ips.partition_point(|&a| a <= ip).checked_sub(1).unwrap();
    let schedule = k.symbols.by_name("schedule").unwrap().address;
    let e = entries[rightmost(schedule)];
    assert_eq!((e.sp_reg, e.sp_offset, e.kind), (reg::SP, 8, kind::CALL));
    // The system-call entry saves the user's registers: somewhere in it, pt_regs on top.
    let entry = l.entry_syscall_64;
    let (lo, hi) = (rightmost(entry), rightmost(entry + 0x100));
    assert!(
        entries[lo..=hi]
            .iter()
            .any(|e| (e.sp_reg, e.sp_offset, e.kind) == (reg::SP, 0, kind::REGS)),
        "{:?}",
        &entries[lo..=hi]
    );
    // The lookup table, as `unwind_init` fills it; then `find` through it agrees with a search
    // of the whole table for an address inside every function.
    let lookup: Vec<u8> = (0..l.lookup_blocks)
        .flat_map(|b| {
            let ip = if b == l.lookup_blocks - 1 {
                l.etext
            } else {
                l.stext + 256 * u64::from(b)
            };
            (rightmost(ip) as u32).to_le_bytes()
        })
        .collect();
    sections.push((t.lookup, lookup));
    let image = Image { sections };
    let (mut checked, mut inits) = (0, 0);
    for s in k.symbols.kernel_symbols() {
        let ip = s.address + 1;
        let init = (l.sinittext..l.einittext).contains(&ip);
        if !init && !(l.stext..l.etext).contains(&ip) {
            continue;
        }
        inits += usize::from(init);
        let mut budget = Budget::new(64);
        let got = find(&image, &t, ip, &mut budget).unwrap();
        assert_eq!(got, Some(entries[rightmost(ip)]), "{}", s.name);
        assert!(64 - budget.left() <= 24, "{} reads", 64 - budget.left());
        checked += 1;
    }
    assert!(
        checked > 30_000 && inits > 1000,
        "{checked} functions, {inits} in .init.text"
    );
}
