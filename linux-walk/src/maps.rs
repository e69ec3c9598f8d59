//! A process's executable file mappings, as a profiler needs them: for each executable VMA that
//! maps a file, its range, file offset, the file's path and, when the file's ELF header is
//! mapped and resident, its GNU build id (read from the `PT_NOTE` segment in memory).

use crate::maple::{MmLayout, Vma, file_path, walk_vmas};
use crate::{Budget, GuestMemory, Stop, field, kernel_ptr, read, read_u32, read_u64};

/// The most VMAs one process's walk keeps (a process with more is cut, reported as `Full`).
pub const MAX_VMAS: usize = 256;
/// Capacity of [`ExecMapping::path`].
pub const PATH_CAP: usize = 255;

/// One executable file mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExecMapping {
    /// First address mapped.
    pub start: u64,
    /// First address past it.
    pub end: u64,
    /// File offset of `start`, in 4 KiB pages.
    pub pgoff: u64,
    /// The file's path (UTF-8 when the guest's names are; cut from the left with `…`).
    pub path: [u8; PATH_CAP],
    /// Bytes of `path` used.
    pub path_len: usize,
    /// The GNU build id, if read.
    pub build_id: [u8; 20],
    /// Bytes of `build_id` used (0: not read).
    pub build_id_len: usize,
}

impl ExecMapping {
    /// The path's bytes.
    #[must_use]
    pub fn path(&self) -> &[u8] {
        &self.path[..self.path_len]
    }

    /// The build id's bytes (empty when it was not read).
    #[must_use]
    pub fn build_id(&self) -> &[u8] {
        &self.build_id[..self.build_id_len]
    }
}

/// The outcome of [`exec_mappings`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MapsWalk {
    /// Mappings given to the sink.
    pub mappings: u32,
    /// Why the walk ended early, if it did.
    pub stop: Option<Stop>,
}

/// The executable file mappings of the process whose `task_struct` is at `task`, in address
/// order, each given to `sink` (which returns `false` to stop). A kernel thread (no `mm`) has
/// none. Bounded by `budget`.
pub fn exec_mappings(
    mem: &dyn GuestMemory,
    layout: &MmLayout,
    task: u64,
    budget: &mut Budget,
    sink: &mut dyn FnMut(&ExecMapping) -> bool,
) -> MapsWalk {
    let mut out = MapsWalk::default();
    out.stop = inner(mem, layout, task, budget, sink, &mut out).err();
    out
}

fn inner(
    mem: &dyn GuestMemory,
    layout: &MmLayout,
    task: u64,
    budget: &mut Budget,
    sink: &mut dyn FnMut(&ExecMapping) -> bool,
    out: &mut MapsWalk,
) -> Result<(), Stop> {
    if !kernel_ptr(task) {
        return Err(Stop::Malformed);
    }
    let mm = read_u64(mem, budget, field(task, layout.task_mm)?)?;
    if mm == 0 {
        return Ok(());
    }
    let mut vmas = [Vma::default(); MAX_VMAS];
    let mut n = 0usize;
    let walk = walk_vmas(mem, layout, mm, budget, &mut |v| {
        if v.file == 0 {
            return true; // anonymous memory: not needed, not kept
        }
        vmas[n] = *v;
        n += 1;
        n < MAX_VMAS
    });
    let vmas = &vmas[..n];
    for v in vmas.iter().filter(|v| v.is_exec()) {
        let mut m = ExecMapping {
            start: v.start,
            end: v.end,
            pgoff: v.pgoff,
            path: [0; PATH_CAP],
            path_len: 0,
            build_id: [0; 20],
            build_id_len: 0,
        };
        let (at, _) = file_path(mem, layout, v.file, budget, &mut m.path)?;
        m.path.copy_within(at.., 0);
        m.path_len = PATH_CAP - at;
        // The file's ELF header is where its page 0 is mapped (usually the read-only VMA just
        // below its text).
        if let Some(head) = vmas.iter().find(|h| h.file == v.file && h.pgoff == 0) {
            match build_id(mem, head.start, budget) {
                Ok(Some((id, len))) => {
                    m.build_id = id;
                    m.build_id_len = len;
                }
                Ok(None) | Err(Stop::Unreadable { .. } | Stop::Malformed) => {}
                Err(e) => return Err(e),
            }
        }
        out.mappings += 1;
        if !sink(&m) {
            return Err(Stop::Full);
        }
    }
    match walk.stop {
        None => Ok(()),
        Some(e) => Err(e),
    }
}

/// `PT_LOAD`, `PT_NOTE` (ELF gABI), `NT_GNU_BUILD_ID` (binutils).
const PT_LOAD: u32 = 1;
const PT_NOTE: u32 = 4;
const NT_GNU_BUILD_ID: u32 = 3;
/// The most program headers read.
const MAX_PHDRS: u64 = 32;
/// The most note bytes read per `PT_NOTE` segment.
const MAX_NOTES: usize = 256;

/// The GNU build id of the ELF file whose header is mapped at `base`, from its `PT_NOTE`
/// segments as mapped in memory (their addresses moved by the load bias: `base` minus the first
/// `PT_LOAD` segment's page-aligned address). `Ok(None)`: not an ELF file or no build id.
///
/// # Errors
/// A read failed (not resident) or the budget ran out.
pub fn build_id(
    mem: &dyn GuestMemory,
    base: u64,
    budget: &mut Budget,
) -> Result<Option<([u8; 20], usize)>, Stop> {
    let mut ehdr = [0u8; 64];
    read(mem, budget, base, &mut ehdr)?;
    // ELF64 little-endian (EI_CLASS 2, EI_DATA 1).
    if ehdr[..4] != *b"\x7fELF" || ehdr[4] != 2 || ehdr[5] != 1 {
        return Ok(None);
    }
    let u16_at = |o: usize| u16::from_le_bytes([ehdr[o], ehdr[o + 1]]);
    let phoff = u64::from_le_bytes(ehdr[0x20..0x28].try_into().unwrap_or([0; 8]));
    let phentsize = u64::from(u16_at(0x36));
    let phnum = u64::from(u16_at(0x38)).min(MAX_PHDRS);
    if phentsize < 56 {
        return Ok(None);
    }
    let mut bias = None;
    let mut notes = [(0u64, 0u64); 4];
    let mut n_notes = 0;
    for i in 0..phnum {
        let ph = base
            .checked_add(phoff)
            .and_then(|a| a.checked_add(i * phentsize))
            .ok_or(Stop::Malformed)?;
        let p_type = read_u32(mem, budget, ph)?;
        let vaddr = read_u64(mem, budget, field(ph, 16)?)?;
        match p_type {
            PT_LOAD if bias.is_none() => bias = Some(base.wrapping_sub(vaddr & !0xfff)),
            PT_NOTE if n_notes < notes.len() => {
                notes[n_notes] = (vaddr, read_u64(mem, budget, field(ph, 40)?)?);
                n_notes += 1;
            }
            _ => {}
        }
    }
    let bias = bias.unwrap_or(0);
    for &(vaddr, size) in &notes[..n_notes] {
        let mut buf = [0u8; MAX_NOTES];
        let len = usize::try_from(size).unwrap_or(MAX_NOTES).min(MAX_NOTES);
        if read(mem, budget, vaddr.wrapping_add(bias), &mut buf[..len]).is_err() {
            continue;
        }
        if let Some(id) = find_build_id(&buf[..len]) {
            return Ok(Some(id));
        }
    }
    Ok(None)
}

/// The `NT_GNU_BUILD_ID` note's descriptor (owner `GNU`) in a note segment's bytes.
fn find_build_id(notes: &[u8]) -> Option<([u8; 20], usize)> {
    let word = |o: usize| {
        notes
            .get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    let mut at = 0usize;
    while at + 12 <= notes.len() {
        let (namesz, descsz, kind) = (word(at)?, word(at + 4)?, word(at + 8)?);
        let name_at = at + 12;
        let desc_at = name_at.checked_add(namesz.checked_add(3)? & !3)?;
        let next = desc_at.checked_add(descsz.checked_add(3)? & !3)?;
        if kind == NT_GNU_BUILD_ID as usize
            && notes.get(name_at..name_at + namesz) == Some(b"GNU\0".as_slice())
            && (1..=20).contains(&descsz)
        {
            let mut id = [0u8; 20];
            id[..descsz].copy_from_slice(notes.get(desc_at..desc_at + descsz)?);
            return Some((id, descsz));
        }
        at = next;
    }
    None
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation, reason = "test values are small")]
mod tests {
    use super::*;
    use crate::model::Memory;

    fn elf_with_build_id(mem: &mut Memory, base: u64, id: &[u8]) {
        let mut e = [0u8; 64];
        e[..4].copy_from_slice(b"\x7fELF");
        e[4] = 2;
        e[5] = 1;
        e[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        e[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        e[0x38..0x3a].copy_from_slice(&2u16.to_le_bytes());
        mem.put(base, &e);
        // PT_LOAD at vaddr 0 (a PIE), PT_NOTE at vaddr 0x300, 36 bytes.
        let ph = base + 64;
        mem.zero(ph, 112);
        mem.put_u32(ph, PT_LOAD);
        mem.put_u32(ph + 56, PT_NOTE);
        mem.put_u64(ph + 56 + 16, 0x300);
        mem.put_u64(ph + 56 + 40, 16 + 20);
        let mut note = vec![];
        note.extend_from_slice(&4u32.to_le_bytes());
        note.extend_from_slice(&(id.len() as u32).to_le_bytes());
        note.extend_from_slice(&NT_GNU_BUILD_ID.to_le_bytes());
        note.extend_from_slice(b"GNU\0");
        note.extend_from_slice(id);
        mem.put(base + 0x300, &note);
    }

    #[test]
    fn build_id_from_the_mapped_header() {
        let mut mem = Memory::default();
        let base = 0x5555_5555_4000;
        let id: Vec<u8> = (1..=20).collect();
        elf_with_build_id(&mut mem, base, &id);
        let got = build_id(&mem, base, &mut Budget::new(100))
            .unwrap()
            .unwrap();
        assert_eq!(&got.0[..got.1], &id[..]);
        // Not an ELF file.
        mem.put(base, b"\x7fELG");
        assert_eq!(build_id(&mem, base, &mut Budget::new(100)), Ok(None));
        // Not resident.
        assert!(matches!(
            build_id(&mem, 0x1000, &mut Budget::new(100)),
            Err(Stop::Unreadable { .. })
        ));
    }

    /// A process with a PIE program (header VMA r--, text VMA r-x), an anonymous heap and a
    /// shared library's text, in a one-leaf tree laid out as Linux 6.1 does.
    #[test]
    fn a_process_gives_its_executable_file_mappings() {
        use crate::maple::VM_EXEC;
        let layout = crate::maple::tests_layout();
        let mut mem = Memory::default();
        let task = 0xffff_8880_0010_0000u64;
        let mm = 0xffff_8880_0100_0000u64;
        let leaf = 0xffff_8880_0200_0000u64;
        mem.zero(task, 0x1000);
        mem.put_u64(task + u64::from(layout.task_mm), mm);
        mem.zero(mm, 0x100);
        mem.zero(leaf, 256);
        mem.put_u64(mm + u64::from(layout.mm_root), leaf | (1 << 3) | 2);
        // Dentries: / -> bin -> prog, / -> lib -> libq.so.
        let d = |i: u64| 0xffff_8880_0400_0000 + 0x100 * i;
        let dentry = |mem: &mut Memory, at: u64, parent: u64, name: &str| {
            mem.zero(at, 0x100);
            mem.put_u64(at + u64::from(layout.d_parent), parent);
            mem.put_u32(at + u64::from(layout.d_name_len), name.len() as u32);
            mem.put_u64(at + u64::from(layout.d_name_name), at + 0x80);
            mem.put(at + 0x80, name.as_bytes());
        };
        dentry(&mut mem, d(0), d(0), "/");
        dentry(&mut mem, d(1), d(0), "bin");
        dentry(&mut mem, d(2), d(1), "prog");
        dentry(&mut mem, d(3), d(0), "lib");
        dentry(&mut mem, d(4), d(3), "libq.so");
        let file = |i: u64| 0xffff_8880_0500_0000 + 0x100 * i;
        for (i, dn) in [(0, 2), (1, 4)] {
            mem.zero(file(i), 0x100);
            mem.put_u64(file(i) + u64::from(layout.file_dentry), d(dn));
        }
        let prog = 0x5555_5555_4000u64;
        elf_with_build_id(&mut mem, prog, &[0xab; 20]);
        // (start, end, pgoff, flags, file)
        let vmas = [
            (prog, prog + 0x1000, 0, 1, file(0)),
            (prog + 0x1000, prog + 0x3000, 1, 1 | VM_EXEC, file(0)),
            (prog + 0x10_0000, prog + 0x12_0000, 0, 3, 0),
            (0x7fff_f7c0_0000, 0x7fff_f7c2_0000, 4, 1 | VM_EXEC, file(1)),
        ];
        for (i, &(start, end, pgoff, flags, f)) in vmas.iter().enumerate() {
            let vma = 0xffff_8880_0300_0000 + 0x200 * i as u64;
            mem.zero(vma, 0x200);
            mem.put_u64(vma + u64::from(layout.vm_start), start);
            mem.put_u64(vma + u64::from(layout.vm_end), end);
            mem.put_u64(vma + u64::from(layout.vm_mm), mm);
            mem.put_u64(vma + u64::from(layout.vm_flags), flags);
            mem.put_u64(vma + u64::from(layout.vm_pgoff), pgoff);
            mem.put_u64(vma + u64::from(layout.vm_file), f);
            // Leaf: a gap before each VMA, then the VMA.
            let slot = 2 * i as u64;
            mem.put_u64(leaf + 8 + 8 * slot, start - 1);
            mem.put_u64(leaf + 8 + 8 * (slot + 1), end - 1);
            mem.put_u64(leaf + 128 + 8 * (slot + 1), vma);
        }
        mem.put_u64(leaf + 8 + 8 * 8, u64::MAX);
        mem.bytes.insert(leaf + 248, 8);
        let mut got = vec![];
        let w = exec_mappings(&mem, &layout, task, &mut Budget::new(10_000), &mut |m| {
            got.push((
                m.start,
                m.end,
                m.pgoff,
                String::from_utf8(m.path().to_vec()).unwrap(),
                m.build_id().to_vec(),
            ));
            true
        });
        assert_eq!(w.stop, None);
        assert_eq!(
            got,
            vec![
                (
                    prog + 0x1000,
                    prog + 0x3000,
                    1,
                    "/bin/prog".into(),
                    vec![0xab; 20]
                ),
                (
                    0x7fff_f7c0_0000,
                    0x7fff_f7c2_0000,
                    4,
                    "/lib/libq.so".into(),
                    vec![]
                ),
            ]
        );
        // A kernel thread has no mm: no mappings.
        mem.put_u64(task + u64::from(layout.task_mm), 0);
        let w = exec_mappings(&mem, &layout, task, &mut Budget::new(100), &mut |_| true);
        assert_eq!(w, MapsWalk::default());
    }

    #[test]
    fn notes_are_parsed_safely() {
        let mut notes = vec![];
        // A note of another kind first, then the build id.
        for (kind, name, desc) in [
            (1u32, &b"GNU\0"[..], &[9u8; 16][..]),
            (3, b"GNU\0", &[7; 20]),
        ] {
            notes.extend_from_slice(&(name.len() as u32).to_le_bytes());
            notes.extend_from_slice(&(desc.len() as u32).to_le_bytes());
            notes.extend_from_slice(&kind.to_le_bytes());
            notes.extend_from_slice(name);
            notes.extend_from_slice(desc);
        }
        assert_eq!(find_build_id(&notes), Some(([7; 20], 20)));
        // Absurd sizes end the walk, never panic.
        let mut bad = vec![0xffu8; 12];
        bad.extend_from_slice(&[0; 20]);
        assert_eq!(find_build_id(&bad), None);
        assert_eq!(find_build_id(&[1, 2, 3]), None);
    }
}
