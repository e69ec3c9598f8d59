//! The executable file mappings of a VM's Linux processes, kept until the end of the run, when
//! they are sent as mapping frames. A process's map is read the first time one of its tasks is
//! seen in an address space (a new process, or an exec), and read again when a user-mode sample
//! falls outside every executable range known for it (a shared library mapped after the
//! process started: the dynamic loader maps them after the exec, `dlopen` at any time).
//!
//! Bounded: at most `MAX_PROCESSES` processes and `MAX_MAPPINGS` mappings per VM,
//! `MAX_RANGES` known ranges and `MAX_REREADS` re-reads per process; what does not fit is
//! counted; a process whose walk was cut short is not read again. An address that a re-read
//! finds in no file mapping (the vDSO, JIT code) is remembered as such, so it never causes
//! another read. A mapping read before its ELF header was resident has no build id: the process
//! is read again `ID_RETRY_AFTER` user-mode samples later, at most `MAX_ID_RETRIES` times.

use alloc::vec::Vec;

use hvprof_samplelog::Mapping;

/// The most processes a VM's table remembers.
pub const MAX_PROCESSES: usize = 1024;
/// The most mappings a VM's table keeps.
pub const MAX_MAPPINGS: usize = 4096;
/// The most guest reads one process's walk may take.
pub const WALK_READS: u32 = 20_000;
/// The most executable ranges (file mappings and pages known to be in none) kept per process.
pub const MAX_RANGES: usize = 64;
/// The most times a process's map is read again after its first read.
pub const MAX_REREADS: u8 = 8;
/// The most times a process's map is read again for a build id not yet resident, and the
/// user-mode samples to wait before each (the program touches its headers early on).
pub const MAX_ID_RETRIES: u8 = 2;
pub const ID_RETRY_AFTER: u32 = 64;

/// x86-64 Linux's module area (`MODULES_VADDR`..`MODULES_END`,
/// `arch/x86/include/asm/pgtable_64_types.h`: above the kernel image's 1 GiB, below the fixmap).
/// Modules are loaded there (KASLR moves them inside it), and so are BPF programs and ftrace
/// trampolines, which are in no module.
pub const MODULE_AREA: core::ops::Range<u64> = 0xffff_ffff_c000_0000..0xffff_ffff_ff00_0000;
/// The most times a VM's module list is read during the run (at a kernel-mode sample in the
/// module area outside every module known), besides the read at the end.
pub const MAX_MODULE_READS: u32 = 16;

/// The kernel modules a VM has loaded, each kept once from every read of its module list (a
/// module unloaded before the end of the run is still named).
#[derive(Default)]
pub struct KernelModules {
    /// Every module seen (module mappings), in the order seen.
    pub list: Vec<Mapping>,
    /// Lists read during the run, and reads refused (`MAX_MODULE_READS` used).
    pub reads: u32,
    pub reads_refused: u64,
    /// Modules not kept (`MAX_MAPPINGS` reached).
    pub dropped: u64,
    /// Pages of the module area a read found in no module (BPF, trampolines), at most
    /// `MAX_RANGES`: samples there cause no read.
    not_modules: Vec<(u64, u64)>,
}

impl KernelModules {
    /// Whether a kernel-mode sample at `rip` should read the module list now: it is in the
    /// module area, in no module known and no page known to be in none, and reads are left
    /// (refusals counted).
    pub fn wants_read(&mut self, rip: u64) -> bool {
        if !MODULE_AREA.contains(&rip)
            || self.list.iter().any(|m| (m.start..m.end).contains(&rip))
            || self.not_modules.iter().any(|&(s, e)| (s..e).contains(&rip))
        {
            return false;
        }
        if self.reads >= MAX_MODULE_READS {
            self.reads_refused += 1;
            return false;
        }
        self.reads += 1;
        true
    }

    /// Keeps a module (once: the same name at the same range is the same module).
    pub fn add(&mut self, m: Mapping) {
        if self
            .list
            .iter()
            .any(|k| (k.start, k.end) == (m.start, m.end) && k.path == m.path)
        {
            return;
        }
        if self.list.len() < MAX_MAPPINGS {
            self.list.push(m);
        } else {
            self.dropped += 1;
        }
    }

    /// Remembers the page of `rip` as in no module (after a read that did not find it).
    pub fn note_not_module(&mut self, rip: u64) {
        let page = rip & !0xfff;
        if self.not_modules.len() < MAX_RANGES {
            self.not_modules.push((page, page.saturating_add(0x1000)));
        }
    }
}

/// One process (a thread group in one address space) and what is known of its map.
struct Process {
    tgid: u32,
    space: u64,
    /// Executable address ranges known: its file mappings, and pages found in none.
    ranges: Vec<(u64, u64)>,
    rereads: u8,
    /// A mapping of it has no build id yet (its ELF header was not resident when read), the
    /// reads made for that (at most `MAX_ID_RETRIES`), and user-mode samples since the last read.
    missing_id: bool,
    id_retries: u8,
    since_read: u32,
    /// A walk of its map ended early: reading it again would end early again (a malformed or
    /// hostile map, or one beyond the budget), so it is not read again.
    cut: bool,
}

/// A VM's processes seen and their mappings.
#[derive(Default)]
pub struct ProcessMaps {
    processes: Vec<Process>,
    /// Their executable file mappings, in the order read (each once).
    pub mappings: Vec<Mapping>,
    /// Processes not read (the table was full) and mappings not kept.
    pub processes_dropped: u64,
    pub mappings_dropped: u64,
    /// Walks that ended early (budget, unreadable or malformed memory).
    pub walks_cut: u64,
    /// Maps read again because a sample fell outside them, and re-reads refused (the process
    /// had used its `MAX_REREADS`).
    pub rereads: u64,
    pub rereads_refused: u64,
    /// The CR3 of the last task read (any process maps the kernel half: the module list is
    /// read through it).
    pub kernel_cr3: u64,
    /// The kernel's modules.
    pub modules: KernelModules,
}

/// A process in the table (`ProcessMaps::enter`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessIndex(usize);

impl ProcessMaps {
    /// The process `tgid` in address space `space`, and whether it is new (then its map should
    /// be read). `None` when the table is full (counted): such a process is never read.
    pub fn enter(&mut self, tgid: u32, space: u64) -> Option<(ProcessIndex, bool)> {
        if let Some(i) = self
            .processes
            .iter()
            .position(|p| p.tgid == tgid && p.space == space)
        {
            return Some((ProcessIndex(i), false));
        }
        if self.processes.len() >= MAX_PROCESSES {
            self.processes_dropped += 1;
            return None;
        }
        self.processes.push(Process {
            tgid,
            space,
            ranges: Vec::new(),
            rereads: 0,
            missing_id: false,
            id_retries: 0,
            since_read: 0,
            cut: false,
        });
        Some((ProcessIndex(self.processes.len() - 1), true))
    }

    /// Whether `rip` lies in a range known for the process.
    pub fn covers(&self, p: ProcessIndex, rip: u64) -> bool {
        self.processes
            .get(p.0)
            .is_some_and(|p| p.ranges.iter().any(|&(s, e)| (s..e).contains(&rip)))
    }

    /// The known range of process `p` that holds `rip`, when the process waits for no build id
    /// (`wants_id_retry` would never ask for a read): a vCPU may keep it and skip this table
    /// for its next samples there, since a known range stays known.
    pub fn settled_range(&self, p: ProcessIndex, rip: u64) -> Option<(u64, u64)> {
        let p = self.processes.get(p.0)?;
        if p.missing_id && !p.cut && p.id_retries < MAX_ID_RETRIES {
            return None;
        }
        p.ranges
            .iter()
            .copied()
            .find(|&(s, e)| (s..e).contains(&rip))
    }

    /// Whether the process's map may be read again (its allowance is then used; refusals are
    /// counted).
    pub fn may_reread(&mut self, p: ProcessIndex) -> bool {
        let Some(p) = self.processes.get_mut(p.0) else {
            return false;
        };
        if p.rereads >= MAX_REREADS || p.cut {
            self.rereads_refused += 1;
            return false;
        }
        p.rereads += 1;
        self.rereads += 1;
        true
    }

    /// A read of process `p`'s map is done: whether some mapping of it still lacks a build id.
    pub fn read_done(&mut self, p: ProcessIndex, missing_id: bool) {
        if let Some(p) = self.processes.get_mut(p.0) {
            p.missing_id = missing_id;
            p.since_read = 0;
        }
    }

    /// At a user-mode sample of process `p` inside its known ranges: whether to read its map
    /// again for a build id that was not resident (`ID_RETRY_AFTER` samples after the last
    /// read, at most `MAX_ID_RETRIES` times).
    pub fn wants_id_retry(&mut self, p: ProcessIndex) -> bool {
        let Some(p) = self.processes.get_mut(p.0) else {
            return false;
        };
        p.since_read = p.since_read.saturating_add(1);
        if p.missing_id && !p.cut && p.id_retries < MAX_ID_RETRIES && p.since_read >= ID_RETRY_AFTER
        {
            p.id_retries += 1;
            p.since_read = 0;
            return true;
        }
        false
    }

    /// A walk of process `p`'s map ended early (counted; the process is not read again).
    pub fn walk_cut(&mut self, p: ProcessIndex) {
        self.walks_cut += 1;
        if let Some(p) = self.processes.get_mut(p.0) {
            p.cut = true;
        }
    }

    /// Keeps a mapping of process `p` (once: a mapping read again is not kept twice; counted as
    /// dropped when the table is full) and remembers its range.
    pub fn add(&mut self, p: ProcessIndex, m: Mapping) {
        let space = m.cr3 & !0xfff;
        let known = self.mappings.iter_mut().find(|k| {
            k.tgid == m.tgid
                && k.cr3 & !0xfff == space
                && (k.start, k.end, k.pgoff) == (m.start, m.end, m.pgoff)
                && k.path == m.path
        });
        if let Some(k) = known {
            // Read again once its ELF header was resident: the build id is known now.
            if k.build_id.is_none() {
                k.build_id = m.build_id;
            }
        } else {
            if self.mappings.len() < MAX_MAPPINGS {
                self.mappings.push(m);
            } else {
                self.mappings_dropped += 1;
            }
        }
        self.remember(p, m.start, m.end);
    }

    /// Remembers the page of `rip` as in no file mapping of process `p`, so that samples there
    /// cause no more reads.
    pub fn note_unmapped(&mut self, p: ProcessIndex, rip: u64) {
        let page = rip & !0xfff;
        self.remember(p, page, page.saturating_add(0x1000));
    }

    fn remember(&mut self, p: ProcessIndex, start: u64, end: u64) {
        if let Some(p) = self.processes.get_mut(p.0)
            && !p.ranges.contains(&(start, end))
            && p.ranges.len() < MAX_RANGES
        {
            p.ranges.push((start, end));
        }
    }

    /// Processes read.
    pub fn processes(&self) -> usize {
        self.processes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping(tgid: u32, cr3: u64, start: u64, end: u64) -> Mapping {
        Mapping {
            tgid,
            cr3,
            start,
            end,
            ..Mapping::default()
        }
    }

    #[test]
    fn each_process_is_read_once_per_address_space() {
        let mut t = ProcessMaps::default();
        let (a, new) = t.enter(57, 0x1000).unwrap();
        assert!(new);
        assert_eq!(t.enter(57, 0x1000), Some((a, false)));
        // exec: same tgid, new address space.
        assert!(t.enter(57, 0x2000).unwrap().1);
        // mm reused by another process: same space, another tgid.
        assert!(t.enter(58, 0x1000).unwrap().1);
        for i in 0..MAX_PROCESSES as u32 {
            t.enter(1000 + i, 0x3000);
        }
        assert_eq!(t.processes(), MAX_PROCESSES);
        assert_eq!(t.enter(99_999, 0x4000), None);
        assert_eq!(t.processes_dropped, 4);
        for i in 0..MAX_MAPPINGS as u64 + 2 {
            t.add(a, mapping(57, 0x1000, i * 0x1000, i * 0x1000 + 0x1000));
        }
        assert_eq!((t.mappings.len(), t.mappings_dropped), (MAX_MAPPINGS, 2));
    }

    #[test]
    fn a_sample_outside_the_known_ranges_asks_for_a_bounded_reread() {
        let mut t = ProcessMaps::default();
        let (p, _) = t.enter(57, 0x1000).unwrap();
        // After the exec: the program and the dynamic loader.
        t.add(p, mapping(57, 0x1000, 0x5555_0000, 0x5556_0000));
        t.add(p, mapping(57, 0x1000, 0x7f00_0000, 0x7f01_0000));
        assert!(t.covers(p, 0x5555_1234));
        // A sample in libc, mapped later: not covered, so read again.
        assert!(!t.covers(p, 0x7f10_0040));
        assert!(t.may_reread(p));
        // The re-read finds the old mappings again (kept once) and libc.
        t.add(p, mapping(57, 0x1000, 0x5555_0000, 0x5556_0000));
        t.add(p, mapping(57, 0x1000, 0x7f00_0000, 0x7f01_0000));
        t.add(p, mapping(57, 0x1000, 0x7f10_0000, 0x7f20_0000));
        assert_eq!(t.mappings.len(), 3);
        assert!(t.covers(p, 0x7f10_0040));
        // A mapping read again with its build id (its header now resident) gets it.
        let mut with_id = mapping(57, 0x1000, 0x5555_0000, 0x5556_0000);
        with_id.build_id = hvprof_samplelog::BuildId::new(&[7; 20]).unwrap();
        t.add(p, with_id);
        assert_eq!(t.mappings.len(), 3);
        assert_eq!(t.mappings[0].build_id.as_bytes(), &[7; 20]);
        // A build id missing after a read: read again after ID_RETRY_AFTER samples, at most
        // MAX_ID_RETRIES times; not when every build id was found.
        let (r, _) = t.enter(77, 0x7000).unwrap();
        t.read_done(r, true);
        assert!(!(1..ID_RETRY_AFTER).any(|_| t.wants_id_retry(r)));
        let total = (0..ID_RETRY_AFTER * 10)
            .filter(|_| t.wants_id_retry(r))
            .count();
        assert_eq!(total, usize::from(MAX_ID_RETRIES));
        let (r2, _) = t.enter(78, 0x7000).unwrap();
        t.read_done(r2, false);
        assert!(!(0..ID_RETRY_AFTER * 10).any(|_| t.wants_id_retry(r2)));
        // A range may be kept by a vCPU only where no build id is awaited: not `r`'s before its
        // retries are spent, `p`'s (every id found) at once, and never outside a known range.
        t.add(r, mapping(77, 0x7000, 0x4000_0000, 0x4001_0000));
        t.read_done(r, true);
        let mut r_fresh = ProcessMaps::default();
        let (rf, _) = r_fresh.enter(77, 0x7000).unwrap();
        r_fresh.add(rf, mapping(77, 0x7000, 0x4000_0000, 0x4001_0000));
        r_fresh.read_done(rf, true);
        assert_eq!(r_fresh.settled_range(rf, 0x4000_0010), None);
        assert_eq!(
            t.settled_range(r, 0x4000_0010),
            Some((0x4000_0000, 0x4001_0000))
        );
        assert_eq!(
            t.settled_range(p, 0x5555_1234),
            Some((0x5555_0000, 0x5556_0000))
        );
        assert_eq!(t.settled_range(p, 0x6000_0000), None);
        // The vDSO is in no file mapping: after one re-read, its page is known.
        assert!(t.may_reread(p));
        t.note_unmapped(p, 0x7fff_f123);
        assert!(t.covers(p, 0x7fff_f000) && !t.covers(p, 0x7fff_e000));
        // The allowance ends re-reads.
        for _ in 2..MAX_REREADS {
            assert!(t.may_reread(p));
        }
        assert!(!t.may_reread(p));
        assert_eq!((t.rereads, t.rereads_refused), (u64::from(MAX_REREADS), 1));
        // Another process's ranges are its own.
        let (q, _) = t.enter(58, 0x2000).unwrap();
        assert!(!t.covers(q, 0x5555_1234));
        // A map whose walk was cut short is not read again.
        t.walk_cut(q);
        assert!(!t.may_reread(q));
        assert_eq!((t.walks_cut, t.rereads_refused), (1, 2));
    }

    #[test]
    fn a_kernel_sample_in_an_unknown_module_asks_for_a_bounded_list_read() {
        let mut k = KernelModules::default();
        let module = |start: u64, name: &str| Mapping {
            start,
            end: start + 0x8000,
            path: hvprof_samplelog::FixedStr::truncated(name),
            ..Mapping::default()
        };
        // Kernel text and user addresses never ask.
        assert!(!k.wants_read(0xffff_ffff_8100_0000));
        assert!(!k.wants_read(0x40_1000));
        // A module loaded since: read the list.
        assert!(k.wants_read(0xffff_ffff_c020_f070));
        k.add(module(0xffff_ffff_c020_f000, "wp512"));
        k.add(module(0xffff_ffff_c020_f000, "wp512"));
        assert_eq!(k.list.len(), 1);
        assert!(!k.wants_read(0xffff_ffff_c020_f070));
        // A BPF program: no module holds it; after one read its page is known.
        assert!(k.wants_read(0xffff_ffff_c100_0010));
        k.note_not_module(0xffff_ffff_c100_0010);
        assert!(!k.wants_read(0xffff_ffff_c100_0ff0));
        // Bounded.
        for i in 2..MAX_MODULE_READS {
            assert!(k.wants_read(0xffff_ffff_d000_0000 + u64::from(i) * 0x10_0000));
        }
        assert!(!k.wants_read(0xffff_ffff_e000_0000));
        assert_eq!((k.reads, k.reads_refused), (MAX_MODULE_READS, 1));
    }

    #[test]
    fn ranges_per_process_are_bounded() {
        let mut t = ProcessMaps::default();
        let (p, _) = t.enter(1, 0x1000).unwrap();
        for i in 0..(MAX_RANGES as u64 * 2) {
            t.note_unmapped(p, i << 12);
        }
        assert!(t.covers(p, 0) && !t.covers(p, (MAX_RANGES as u64) << 12));
    }
}
