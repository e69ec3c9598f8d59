//! Reading a guest's virtual memory from the hypervisor: a walk of the guest's own 4-level page
//! tables (Intel SDM Vol. 3A §5.5, "4-Level Paging and 5-Level Paging"; 4 KiB, 2 MiB and 1 GiB
//! pages) over its guest-physical memory, and the Linux task a vCPU runs (its `current_task`
//! per-CPU variable, then the task's pid, tgid and comm), with offsets the host derives from the
//! kernel image (BTF and kallsyms). Pure: `read_phys` supplies guest-physical memory, so the host
//! tests it on a model.

use hvprof_samplelog::TaskOffsets;

/// Bits 51:12 of a paging-structure entry.
const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
const PRESENT: u64 = 1;
const RW: u64 = 1 << 1;
const US: u64 = 1 << 2;
const PAGE_SIZE_BIT: u64 = 1 << 7;

/// The guest-physical address of `gva` under the page tables at `cr3`, or `None` where a level
/// is not present or the address is not canonical. `read_phys(gpa)` returns the 8 bytes at a
/// guest-physical address (`None` outside guest memory).
pub fn translate(read_phys: &impl Fn(u64) -> Option<u64>, cr3: u64, gva: u64) -> Option<u64> {
    translate_leaf(read_phys, cr3, gva).map(|t| t.gpa)
}

/// Whether `a` is a canonical 48-bit address (bits 63:47 all equal; SDM Vol. 1 §3.3.7.1).
pub fn canonical(a: u64) -> bool {
    let top = a >> 47;
    top == 0 || top == 0x1_ffff
}

/// A translation and the paging-structure entry that made it (the PTE, or the PDE or PDPTE of a
/// large page): while that entry keeps its value, and the levels above it theirs, the
/// translation holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leaf {
    pub gpa: u64,
    /// The guest-physical address of the entry, and its value.
    pub entry_gpa: u64,
    pub entry: u64,
    /// The size of the page it maps (4 KiB, 2 MiB or 1 GiB).
    pub size: u64,
    /// Bits 2:1 of every level's entry ANDed: R/W (bit 1) and U/S (bit 2), which allow a write
    /// and a user-mode access only when every level does (SDM Vol. 3A §5.6, "Access Rights").
    pub rights: u64,
}

impl Leaf {
    /// Whether every level allows writes (R/W).
    #[must_use]
    pub fn writable(&self) -> bool {
        self.rights & RW != 0
    }

    /// Whether every level allows user-mode accesses (U/S).
    #[must_use]
    pub fn user(&self) -> bool {
        self.rights & US != 0
    }
}

/// `translate`, with the entry that mapped the page.
pub fn translate_leaf(read_phys: &impl Fn(u64) -> Option<u64>, cr3: u64, gva: u64) -> Option<Leaf> {
    if !canonical(gva) {
        return None;
    }
    let mut table = cr3 & ADDR_MASK;
    let mut rights = RW | US;
    for level in (0..4).rev() {
        let shift = 12 + 9 * level;
        let index = (gva >> shift) & 0x1ff;
        let entry_gpa = table + 8 * index;
        let entry = read_phys(entry_gpa)?;
        if entry & PRESENT == 0 {
            return None;
        }
        rights &= entry;
        // PDPTE (level 2) with PS: 1 GiB page; PDE (level 1) with PS: 2 MiB page.
        let size = 1u64 << shift;
        if level == 0 || ((level == 2 || level == 1) && entry & PAGE_SIZE_BIT != 0) {
            return Some(Leaf {
                gpa: (entry & ADDR_MASK & !(size - 1)) | (gva & (size - 1)),
                entry_gpa,
                entry,
                size,
                rights,
            });
        }
        table = entry & ADDR_MASK;
    }
    None
}

/// Translations of kernel-half pages, kept per vCPU between samples. Every Linux process's page
/// tables map the kernel half the same way (under page-table isolation, the kernel's PGD of
/// every pair: the reads go through those, [`space_mask`]), and the kernel's mappings of its direct map and
/// per-CPU areas do not change once made, so the cache is keyed by the page alone: reading the
/// running task at a sample needs no page walk once its pages are known, whichever process runs.
/// (A guest that maps its kernel half differently per process only misnames its own tasks: every
/// read still goes through its own memory, bounded by `read_phys`.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tlb {
    /// (page, guest-physical page), most recently filled last.
    entries: [Option<(u64, u64)>; TLB_ENTRIES],
    next: usize,
    /// The words every sample of a Linux guest reads, each with the guest-physical address it
    /// was last read at, by its virtual address (0: none yet): the per-CPU `current_task`
    /// ([`WORD_CURRENT`]), the running task's pid and tgid ([`WORD_IDS`]) and the two halves of
    /// its name ([`WORD_NAME`]). Found here in one comparison, a sample's read is a load, not a
    /// search of `entries`.
    words: [(u64, u64); WORDS],
}

/// The task a vCPU ran at its last sample, as every next sample checks it: the per-CPU base
/// and address space it was read under, and the two words [`read_task_ids`] read for it (the
/// per-CPU `current_task` word and the task's pid and tgid), each kept as a `W` that reads it
/// without a search or a bound check (the caller makes a `W` once, for a guest-physical address
/// inside the VM's memory). The check of every sample of a Linux guest: two comparisons, two
/// loads and their comparisons. While the task's name is not settled (`NameState::UntilUser`:
/// an exec may rename it), its two words too, and a user-mode sample (which settles it) does
/// not hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SameTask<W> {
    percpu_base: u64,
    space: u64,
    current: W,
    ids_word: W,
    task: u64,
    ids: u64,
    /// The name's two words and their values, while it is not settled.
    name: Option<(W, W, [u64; 2])>,
}

impl<W: Copy> SameTask<W> {
    /// After [`read_task_ids`] found `ids` at `percpu_base` in address space `space` (the CR3
    /// as [`space_mask`] makes it): the check of the next samples, through the words `tlb` kept for
    /// them, each made a `W` by `word` from its guest-physical address. `None` when `tlb` does
    /// not keep both for this task (pid and tgid apart, or across a page: every sample then
    /// reads the task in full), or when `word` refuses an address. `unsettled`: the name
    /// [`read_task_comm`] read for it, when it is not settled; it is then checked too, through
    /// the words `tlb` kept for it (`None` when it lies across a page).
    pub fn new(
        tlb: &Tlb,
        percpu_base: u64,
        space: u64,
        off: &TaskOffsets,
        (task, pid, tgid): TaskIds,
        unsettled: Option<[u8; 16]>,
        word: impl Fn(u64) -> Option<W>,
    ) -> Option<Self> {
        if off.tgid != off.pid.wrapping_add(4) {
            return None;
        }
        let current = tlb.kept(WORD_CURRENT, percpu_base.wrapping_add(off.current_task))?;
        let ids_at = tlb.kept(WORD_IDS, task.wrapping_add(u64::from(off.pid)))?;
        let name = match unsettled {
            None => None,
            Some(comm) => {
                let at = task.wrapping_add(u64::from(off.comm));
                let lo = tlb.kept(WORD_NAME, at)?;
                let hi = tlb.kept(WORD_NAME + 1, at.wrapping_add(8))?;
                let half = |i: usize| {
                    u64::from_le_bytes(comm[8 * i..8 * i + 8].try_into().unwrap_or_default())
                };
                Some((word(lo)?, word(hi)?, [half(0), half(1)]))
            }
        };
        Some(SameTask {
            percpu_base,
            space,
            current: word(current)?,
            ids_word: word(ids_at)?,
            task,
            ids: u64::from(pid) | u64::from(tgid) << 32,
            name,
        })
    }

    /// Whether the task running now, at `percpu_base` in `space`, is still this one, with the
    /// same pid and tgid (a task structure freed and reused by a new task has the new pid) and,
    /// while its name is not settled, the same name at a kernel-mode sample (`user`: the sample
    /// is a user-mode one), read through `read`. `false` sends the caller to [`read_task_ids`].
    #[inline(always)]
    pub fn holds(&self, percpu_base: u64, space: u64, user: bool, read: impl Fn(W) -> u64) -> bool {
        self.percpu_base == percpu_base
            && self.space == space
            && read(self.current) == self.task
            && read(self.ids_word) == self.ids
            && match self.name {
                None => true,
                Some((lo, hi, [a, b])) => !user && read(lo) == a && read(hi) == b,
            }
    }

    /// The task's address, pid and tgid.
    pub fn ids(&self) -> TaskIds {
        (self.task, self.ids as u32, (self.ids >> 32) as u32)
    }
}

/// [`Tlb::words`]' slot of the per-CPU `current_task` word.
const WORD_CURRENT: usize = 0;
/// [`Tlb::words`]' slot of the running task's pid and tgid.
const WORD_IDS: usize = 1;
/// [`Tlb::words`]' slots of the running task's name, its first 8 bytes and its last.
const WORD_NAME: usize = 2;
const WORDS: usize = 4;

/// Pages a vCPU's cache holds: the per-CPU page and two or three pages of each of the tasks it
/// switches between most.
const TLB_ENTRIES: usize = 8;

impl Tlb {
    pub const fn new() -> Self {
        Tlb {
            entries: [None; TLB_ENTRIES],
            next: 0,
            words: [(0, 0); WORDS],
        }
    }

    /// `translate`, through the cache for kernel-half addresses.
    pub fn translate(
        &mut self,
        read_phys: &impl Fn(u64) -> Option<u64>,
        cr3: u64,
        gva: u64,
    ) -> Option<u64> {
        let page = gva & !0xfff;
        let kernel = gva >= KERNEL_HALF;
        if kernel && let Some((_, gpa)) = self.entries.iter().flatten().find(|(p, _)| *p == page) {
            return Some(gpa | (gva & 0xfff));
        }
        let gpa = translate(read_phys, cr3, gva)?;
        if kernel {
            self.entries[self.next] = Some((page, gpa & !0xfff));
            self.next = (self.next + 1) % TLB_ENTRIES;
        }
        Some(gpa)
    }

    /// The 8 bytes at kernel-half `gva` ([`read_virt`] under `cr3`), through the word kept in
    /// `slot` when `gva` is its address. A word within one page is then kept there (a
    /// kernel-half translation does not change: see [`Tlb`]).
    #[inline]
    fn read_word(
        &mut self,
        slot: usize,
        read_phys: &impl Fn(u64) -> Option<u64>,
        read_bytes: &impl Fn(u64, &mut [u8]) -> bool,
        cr3: u64,
        gva: u64,
    ) -> Option<u64> {
        if let Some(gpa) = self.kept(slot, gva) {
            return read_phys(gpa);
        }
        self.read_word_again(slot, read_phys, read_bytes, cr3, gva)
    }

    /// The guest-physical address `slot` keeps, when it keeps the word at `gva`.
    #[inline(always)]
    fn kept(&self, slot: usize, gva: u64) -> Option<u64> {
        let (va, gpa) = self.words[slot];
        (va == gva && va != 0).then_some(gpa)
    }

    /// [`Tlb::read_word`] for a word not kept in `slot`: out of line, as it is seldom needed.
    #[inline(never)]
    #[cold]
    fn read_word_again(
        &mut self,
        slot: usize,
        read_phys: &impl Fn(u64) -> Option<u64>,
        read_bytes: &impl Fn(u64, &mut [u8]) -> bool,
        cr3: u64,
        gva: u64,
    ) -> Option<u64> {
        let mut word = [0u8; 8];
        if !read_virt(self, read_phys, read_bytes, cr3, gva, &mut word) {
            return None;
        }
        if gva >= KERNEL_HALF
            && gva & 0xfff <= 0x1000 - 8
            && let Some(gpa) = self.translate(read_phys, cr3, gva)
        {
            self.words[slot] = (gva, gpa);
        }
        Some(u64::from_le_bytes(word))
    }
}

/// Reads `buf.len()` bytes at `gva` (may cross pages) through the page tables at `cr3` (its low
/// 12 bits, the PCID, ignored; for the kernel half under page-table isolation, the kernel's PGD
/// of the pair: [`space_mask`]). `read_bytes(gpa, buf)` copies guest-physical bytes and says
/// whether they were all inside guest memory.
pub fn read_virt(
    tlb: &mut Tlb,
    read_phys: &impl Fn(u64) -> Option<u64>,
    read_bytes: &impl Fn(u64, &mut [u8]) -> bool,
    cr3: u64,
    gva: u64,
    buf: &mut [u8],
) -> bool {
    let mut done = 0;
    while done < buf.len() {
        let at = gva.wrapping_add(done as u64);
        let Some(gpa) = tlb.translate(read_phys, cr3, at) else {
            return false;
        };
        let in_page = (4096 - (at & 0xfff)) as usize;
        let n = in_page.min(buf.len() - done);
        // A whole word (the common case: pointers, pid and tgid) in one read.
        if n == 8 {
            match read_phys(gpa) {
                Some(v) => buf[done..done + 8].copy_from_slice(&v.to_le_bytes()),
                None => return false,
            }
        } else if !read_bytes(gpa, &mut buf[done..done + n]) {
            return false;
        }
        done += n;
    }
    true
}

/// The task a Linux vCPU runs, as read from its memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestTask {
    pub task: u64,
    pub pid: u32,
    pub tgid: u32,
    pub comm: [u8; 16],
}

/// Lowest kernel-half address (a `task_struct` pointer below it is not one).
pub const KERNEL_HALF: u64 = 0xffff_8000_0000_0000;

/// The running task's identity without its name: (task address, pid, tgid).
pub type TaskIds = (u64, u32, u32);

/// Reads the running task: `percpu_base` is the kernel's per-CPU base of this vCPU (GS base in
/// kernel mode, IA32_KERNEL_GS_BASE in user mode), `cr3` the guest's CR3 as [`space_mask`]
/// makes it a root that maps the kernel half (the PCID masked; under page-table isolation the
/// kernel's PGD of the pair).
pub fn read_task(
    tlb: &mut Tlb,
    read_phys: &impl Fn(u64) -> Option<u64>,
    read_bytes: &impl Fn(u64, &mut [u8]) -> bool,
    cr3: u64,
    percpu_base: u64,
    off: &TaskOffsets,
) -> Option<GuestTask> {
    let (task, pid, tgid) = read_task_ids(tlb, read_phys, read_bytes, cr3, percpu_base, off)?;
    let comm = read_task_comm(tlb, read_phys, read_bytes, cr3, task, off)?;
    Some(GuestTask {
        task,
        pid,
        tgid,
        comm,
    })
}

/// The part of [`read_task`] that changes at every task switch: the running task's address and
/// ids (its name changes only at exec, which also changes the CR3).
#[inline]
pub fn read_task_ids(
    tlb: &mut Tlb,
    read_phys: &impl Fn(u64) -> Option<u64>,
    read_bytes: &impl Fn(u64, &mut [u8]) -> bool,
    cr3: u64,
    percpu_base: u64,
    off: &TaskOffsets,
) -> Option<TaskIds> {
    if percpu_base < KERNEL_HALF {
        return None;
    }
    let at = percpu_base.wrapping_add(off.current_task);
    let task = tlb.read_word(WORD_CURRENT, read_phys, read_bytes, cr3, at)?;
    if task < KERNEL_HALF {
        return None;
    }
    // pid and tgid sit side by side in Linux's task_struct: one read for both when they do.
    // Both are read at every sample, even of the task read at the last one: a task structure
    // freed and reused by a new task between two samples has the new task's pid.
    let at = |field: u32| task.wrapping_add(u64::from(field));
    let (pid, tgid) = if off.tgid == off.pid.wrapping_add(4) {
        let ids = tlb.read_word(WORD_IDS, read_phys, read_bytes, cr3, at(off.pid))?;
        (ids as u32, (ids >> 32) as u32)
    } else {
        let mut ids = [0u8; 4];
        let mut read_u32 = |field: u32| {
            read_virt(tlb, read_phys, read_bytes, cr3, at(field), &mut ids)
                .then(|| u32::from_le_bytes(ids))
        };
        (read_u32(off.pid)?, read_u32(off.tgid)?)
    };
    Some((task, pid, tgid))
}

/// The word at `offset` in the task structure at `task` (its `mm` pointer, say).
pub fn read_task_u64(
    tlb: &mut Tlb,
    read_phys: &impl Fn(u64) -> Option<u64>,
    read_bytes: &impl Fn(u64, &mut [u8]) -> bool,
    cr3: u64,
    task: u64,
    offset: u32,
) -> Option<u64> {
    let mut word = [0u8; 8];
    let at = task.wrapping_add(u64::from(offset));
    read_virt(tlb, read_phys, read_bytes, cr3, at, &mut word).then(|| u64::from_le_bytes(word))
}

/// The name (`comm`) of the task at `task`.
pub fn read_task_comm(
    tlb: &mut Tlb,
    read_phys: &impl Fn(u64) -> Option<u64>,
    read_bytes: &impl Fn(u64, &mut [u8]) -> bool,
    cr3: u64,
    task: u64,
    off: &TaskOffsets,
) -> Option<[u8; 16]> {
    let at = task.wrapping_add(u64::from(off.comm));
    let lo = tlb.read_word(WORD_NAME, read_phys, read_bytes, cr3, at)?;
    let hi = tlb.read_word(
        WORD_NAME + 1,
        read_phys,
        read_bytes,
        cr3,
        at.wrapping_add(8),
    )?;
    let mut comm = [0u8; 16];
    comm[..8].copy_from_slice(&lo.to_le_bytes());
    comm[8..].copy_from_slice(&hi.to_le_bytes());
    Some(comm)
}

/// What a user-mode CR3 tells of its guest's page-table isolation (KPTI), from the per-CPU
/// `current_task` word at `percpu_base` and the task it names. Without isolation every PGD maps
/// the whole kernel half, both included: `Some(false)`. With it, user mode runs on the user PGD
/// of an 8 KiB-aligned pair (Linux: CR3 bit 12, `PTI_USER_PGTABLE_MASK`), which maps little of
/// the kernel (its entry code and per-CPU entry area; not the task structures): `Some(true)`
/// when the CR3 misses either and the kernel's PGD 4 KiB below maps both. `None` when it cannot
/// tell (no per-CPU base, no task yet, a word outside the VM's memory). Two or four page walks,
/// not cached: asked until a guest has told.
pub fn isolation_shown(
    read_phys: &impl Fn(u64) -> Option<u64>,
    cr3: u64,
    percpu_base: u64,
    off: &TaskOffsets,
) -> Option<bool> {
    if percpu_base < KERNEL_HALF {
        return None;
    }
    let word = percpu_base.wrapping_add(off.current_task);
    // Whether `root` maps the word and the task it names (`None`: no task to tell by).
    let reaches_task = |root: u64| -> Option<bool> {
        let Some(gpa) = translate(read_phys, root, word) else {
            return Some(false);
        };
        let task = read_phys(gpa)?;
        if task < KERNEL_HALF {
            return None;
        }
        Some(translate(read_phys, root, task).is_some())
    };
    let root = cr3 & ADDR_MASK;
    if reaches_task(root)? {
        return Some(false);
    }
    // (For a root with bit 12 clear this asks the same root again: `None`.)
    reaches_task(root & !0x1000)?.then_some(true)
}

/// The address space of a CR3 as the task check and the process table key it, and the root
/// every read of the guest's kernel goes through: the CR3 without its PCID (low 12 bits) and,
/// in a guest that isolates its page tables (`isolating`: [`isolation_shown`] said so), without
/// bit 12, so that the user PGD of an isolation pair is the kernel's, which maps both halves.
/// Not without isolation: there a PGD may lie at any page, and another process's 4 KiB below.
#[must_use]
pub const fn space_mask(isolating: bool) -> u64 {
    if isolating { !0x1fff } else { !0xfff }
}

/// One guest address space (a CR3: under page-table isolation the kernel's PGD of the pair,
/// [`space_mask`]) read through its own page tables and the VM's memory, as
/// `hvprof_linux_walk`'s walkers read guest memory: every read bounded to the VM (`read_phys`,
/// `read_bytes` fail outside it), kernel-half translations cached for the walk.
pub struct AddressSpace<'a, P, B> {
    tlb: core::cell::RefCell<Tlb>,
    read_phys: &'a P,
    read_bytes: &'a B,
    cr3: u64,
}

impl<'a, P, B> AddressSpace<'a, P, B>
where
    P: Fn(u64) -> Option<u64>,
    B: Fn(u64, &mut [u8]) -> bool,
{
    pub fn new(read_phys: &'a P, read_bytes: &'a B, cr3: u64) -> Self {
        AddressSpace {
            tlb: core::cell::RefCell::new(Tlb::new()),
            read_phys,
            read_bytes,
            cr3,
        }
    }
}

impl<P, B> hvprof_linux_walk::GuestMemory for AddressSpace<'_, P, B>
where
    P: Fn(u64) -> Option<u64>,
    B: Fn(u64, &mut [u8]) -> bool,
{
    fn read(&self, addr: u64, out: &mut [u8]) -> bool {
        let Ok(mut tlb) = self.tlb.try_borrow_mut() else {
            return false;
        };
        read_virt(
            &mut tlb,
            self.read_phys,
            self.read_bytes,
            self.cr3,
            addr,
            out,
        )
    }
}

/// Whether the name read for a vCPU's task can be trusted until the task or its address space
/// changes, or must be read again at the next sample. An exec switches the address space
/// (`exec_mmap`, which then frees the old one: that can take many samples, and the task may be
/// switched out and in meanwhile) before it renames the task (`__set_task_comm`), so a name read
/// in kernel mode may be the old program's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameState {
    /// Read in user mode (no exec under way), or the task is a kernel thread (it never execs).
    Settled,
    /// Read in kernel mode for a task with an address space of its own: read again until a
    /// user-mode sample.
    UntilUser,
}

/// The state of the name just read for task `ids` in address space `space` (user mode or not),
/// after `last` (the vCPU's previous task, address space, name and state). `kernel_thread`
/// tells, when asked, whether the task has no `mm` of its own (a kernel thread runs on whichever
/// address space was loaded before it).
#[must_use]
pub fn name_state(
    last: Option<(TaskIds, u64, [u8; 16], NameState)>,
    ids: TaskIds,
    space: u64,
    user: bool,
    kernel_thread: impl FnOnce() -> bool,
) -> NameState {
    if user {
        return NameState::Settled;
    }
    match last {
        // Still the same task in kernel mode: no need to ask again.
        Some((i, s, _, NameState::UntilUser)) if i == ids && s == space => NameState::UntilUser,
        _ if kernel_thread() => NameState::Settled,
        _ => NameState::UntilUser,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;
    use alloc::vec::Vec;

    #[test]
    fn canonical_addresses() {
        assert!(canonical(0xffff_8000_0000_0000) && canonical(0x7fff_ffff_ffff));
        assert!(!canonical(0x8000_0000_0000));
    }
    use core::cell::RefCell;

    /// Guest-physical memory of 16 MiB with a page-table builder.
    struct Mem {
        bytes: RefCell<Vec<u8>>,
        next_table: RefCell<u64>,
    }

    impl Mem {
        fn new() -> Self {
            Mem {
                bytes: RefCell::new(vec![0; 16 << 20]),
                next_table: RefCell::new(0x10_0000),
            }
        }
        fn u64(&self, gpa: u64) -> Option<u64> {
            let b = self.bytes.borrow();
            let s = b.get(gpa as usize..gpa as usize + 8)?;
            Some(u64::from_le_bytes(s.try_into().unwrap()))
        }
        fn put(&self, gpa: u64, v: &[u8]) {
            self.bytes.borrow_mut()[gpa as usize..gpa as usize + v.len()].copy_from_slice(v);
        }
        fn bytes(&self, gpa: u64, out: &mut [u8]) -> bool {
            let b = self.bytes.borrow();
            match b.get(gpa as usize..gpa as usize + out.len()) {
                Some(s) => {
                    out.copy_from_slice(s);
                    true
                }
                None => false,
            }
        }
        fn table(&self) -> u64 {
            let mut n = self.next_table.borrow_mut();
            *n += 0x1000;
            *n
        }
        /// Maps the 4 KiB page at `gva` to `gpa` under `cr3` (or a 2 MiB page with `big`).
        fn map(&self, cr3: u64, gva: u64, gpa: u64, big: bool) {
            let mut table = cr3;
            for level in (0..4).rev() {
                let index = (gva >> (12 + 9 * level)) & 0x1ff;
                let at = table + 8 * index;
                if level == 0 || (big && level == 1) {
                    let ps = if big { PAGE_SIZE_BIT } else { 0 };
                    self.put(at, &(gpa | PRESENT | 2 | ps).to_le_bytes());
                    return;
                }
                let e = self.u64(at).unwrap();
                table = if e & PRESENT != 0 {
                    e & ADDR_MASK
                } else {
                    let t = self.table();
                    self.put(at, &(t | PRESENT | 2).to_le_bytes());
                    t
                };
            }
        }
    }

    const OFF: TaskOffsets = TaskOffsets {
        current_task: 0x21440,
        pid: 2416,
        tgid: 2420,
        comm: 2976,
    };

    /// A write or a user-mode access is allowed only where every level allows it.
    #[test]
    fn rights_are_every_levels() {
        let m = Mem::new();
        let cr3 = 0x20_0000;
        m.map(cr3, 0x40_0000, 0x50_0000, false);
        let read = |g| m.u64(g);
        let leaf = translate_leaf(&read, cr3, 0x40_0123).unwrap();
        assert!(leaf.writable() && !leaf.user());
        // U/S on the leaf alone is not enough; on every level it is.
        let pte = leaf.entry_gpa;
        m.put(pte, &(leaf.entry | US).to_le_bytes());
        assert!(!translate_leaf(&read, cr3, 0x40_0123).unwrap().user());
        let mut table = cr3;
        for level in (1..4).rev() {
            let at = table + 8 * ((0x40_0000u64 >> (12 + 9 * level)) & 0x1ff);
            let e = m.u64(at).unwrap();
            m.put(at, &(e | US).to_le_bytes());
            table = e & ADDR_MASK;
        }
        assert!(translate_leaf(&read, cr3, 0x40_0123).unwrap().user());
        // A read-only directory makes the page read-only (the address is in PML4 entry 0).
        let pml4e = cr3;
        let e = m.u64(pml4e).unwrap();
        m.put(pml4e, &(e & !RW).to_le_bytes());
        let leaf = translate_leaf(&read, cr3, 0x40_0123).unwrap();
        assert!(!leaf.writable() && leaf.user());
    }

    #[test]
    fn walks_4k_and_2m_pages_and_reads_the_task() {
        let m = Mem::new();
        let cr3 = 0x20_0000; // 8 KiB aligned: the kernel PGD of a PTI pair
        let percpu = 0xffff_8880_0fa0_0000u64;
        let task = 0xffff_8880_0123_4000u64;
        // The per-CPU page holding current_task, and the task spread over two pages.
        m.map(cr3, (percpu + OFF.current_task) & !0xfff, 0x30_0000, false);
        m.map(cr3, task & !0x1f_ffff, 0x40_0000, true);
        let read = |g| m.u64(g);
        let bytes = |g, b: &mut [u8]| m.bytes(g, b);
        assert_eq!(
            translate(&read, cr3, task + 0x10),
            Some(0x40_0000 + (task & 0x1f_ffff) + 0x10)
        );
        assert_eq!(translate(&read, cr3, 0x1234_0000), None, "not mapped");
        assert_eq!(
            translate(&read, cr3, 0x8000_0000_0000),
            None,
            "not canonical"
        );
        m.put(
            0x30_0000 + ((percpu + OFF.current_task) & 0xfff),
            &task.to_le_bytes(),
        );
        let t = 0x40_0000 + (task & 0x1f_ffff);
        m.put(t + 2416, &4242u32.to_le_bytes());
        m.put(t + 2420, &4240u32.to_le_bytes());
        m.put(t + 2976, b"w41\0\0\0\0\0\0\0\0\0\0\0\0\0");
        // User mode under PTI: CR3 is the user PGD (bit 12) with a PCID; read through the
        // kernel's PGD of the pair (`space_mask`).
        let user = cr3 | 0x1000 | 0x5;
        let mut tlb = Tlb::new();
        let got = read_task(
            &mut tlb,
            &read,
            &bytes,
            user & space_mask(true),
            percpu,
            &OFF,
        )
        .unwrap();
        assert_eq!((got.task, got.pid, got.tgid), (task, 4242, 4240));
        assert_eq!(&got.comm[..4], b"w41\0");
        // Read again through the cache: the same.
        let again = read_task(&mut tlb, &read, &bytes, cr3, percpu, &OFF).unwrap();
        assert_eq!(again, got);
        // A user-space GS base (not the kernel's per-CPU base) gives nothing.
        assert_eq!(
            read_task(&mut tlb, &read, &bytes, cr3, 0x7fff_0000_0000, &OFF),
            None
        );
        // A task pointer that is not a kernel address gives nothing.
        m.put(
            0x30_0000 + ((percpu + OFF.current_task) & 0xfff),
            &0x1000u64.to_le_bytes(),
        );
        assert_eq!(read_task(&mut tlb, &read, &bytes, cr3, percpu, &OFF), None);
    }

    /// The words kept between samples (`Tlb::words`) are read again at every sample: another
    /// task, a task structure reused by a new task (its pid), another per-CPU base, and a pid
    /// and tgid that straddle a page are all seen as they are in memory now.
    #[test]
    fn the_words_kept_between_samples_are_read_again_each_time() {
        let m = Mem::new();
        let cr3 = 0x20_0000;
        let (percpu_a, percpu_b) = (0xffff_8880_0fa0_0000u64, 0xffff_8880_0fb0_0000u64);
        let (task_a, task_b) = (0xffff_8880_0123_4000u64, 0xffff_8880_0567_8000u64);
        m.map(
            cr3,
            (percpu_a + OFF.current_task) & !0xfff,
            0x30_0000,
            false,
        );
        m.map(
            cr3,
            (percpu_b + OFF.current_task) & !0xfff,
            0x31_0000,
            false,
        );
        m.map(cr3, task_a & !0x1f_ffff, 0x40_0000, true);
        m.map(cr3, task_b & !0x1f_ffff, 0x60_0000, true);
        let current = |percpu: u64, gpa: u64, task: u64| {
            m.put(
                gpa + ((percpu + OFF.current_task) & 0xfff),
                &task.to_le_bytes(),
            );
        };
        let ids = |task: u64, base: u64, off: &TaskOffsets, pid: u32, tgid: u32| {
            let t = base + (task & 0x1f_ffff);
            m.put(t + u64::from(off.pid), &pid.to_le_bytes());
            m.put(t + u64::from(off.tgid), &tgid.to_le_bytes());
        };
        let read = |g| m.u64(g);
        let bytes = |g, b: &mut [u8]| m.bytes(g, b);
        let mut tlb = Tlb::new();
        let ids_now = |tlb: &mut Tlb, percpu: u64, off: &TaskOffsets| {
            read_task_ids(tlb, &read, &bytes, cr3, percpu, off)
        };
        // `SameTask`, the check of every sample, made after the read that found `last` (as the
        // run loop makes it), agrees with a full read each time.
        let still = |tlb: &Tlb, percpu: u64, off: &TaskOffsets, last: TaskIds| {
            SameTask::new(tlb, percpu, cr3, off, last, None, Some)
                .is_some_and(|same| same.holds(percpu, cr3, false, |gpa| m.u64(gpa).unwrap_or(!0)))
        };
        assert!(
            !still(&tlb, percpu_a, &OFF, (task_a, 100, 100)),
            "nothing kept yet"
        );
        current(percpu_a, 0x30_0000, task_a);
        ids(task_a, 0x40_0000, &OFF, 100, 100);
        assert_eq!(ids_now(&mut tlb, percpu_a, &OFF), Some((task_a, 100, 100)));
        assert!(still(&tlb, percpu_a, &OFF, (task_a, 100, 100)));
        assert!(!still(&tlb, percpu_a, &OFF, (task_a, 100, 101)));
        assert!(!still(&tlb, percpu_b, &OFF, (task_a, 100, 100)));
        // The same task structure, reused by a new task: its new pid.
        ids(task_a, 0x40_0000, &OFF, 200, 200);
        assert!(!still(&tlb, percpu_a, &OFF, (task_a, 100, 100)));
        assert_eq!(ids_now(&mut tlb, percpu_a, &OFF), Some((task_a, 200, 200)));
        assert!(still(&tlb, percpu_a, &OFF, (task_a, 200, 200)));
        // Another task runs.
        current(percpu_a, 0x30_0000, task_b);
        ids(task_b, 0x60_0000, &OFF, 300, 299);
        assert!(!still(&tlb, percpu_a, &OFF, (task_a, 200, 200)));
        assert_eq!(ids_now(&mut tlb, percpu_a, &OFF), Some((task_b, 300, 299)));
        assert!(still(&tlb, percpu_a, &OFF, (task_b, 300, 299)));
        // Another per-CPU base (the vCPU's other view of GS), another current task.
        current(percpu_b, 0x31_0000, task_a);
        assert!(!still(&tlb, percpu_b, &OFF, (task_b, 300, 299)));
        assert_eq!(ids_now(&mut tlb, percpu_b, &OFF), Some((task_a, 200, 200)));
        // No current task: nothing, and the next read still finds the one that comes back.
        current(percpu_b, 0x31_0000, 0);
        assert_eq!(ids_now(&mut tlb, percpu_b, &OFF), None);
        current(percpu_b, 0x31_0000, task_b);
        assert_eq!(ids_now(&mut tlb, percpu_b, &OFF), Some((task_b, 300, 299)));
        // pid and tgid across a page boundary (one read across the page end, never kept):
        // still right.
        let straddle = TaskOffsets {
            pid: 0xffc,
            tgid: 0x1000,
            ..OFF
        };
        ids(task_b, 0x60_0000, &straddle, 400, 401);
        for _ in 0..2 {
            assert_eq!(
                ids_now(&mut tlb, percpu_b, &straddle),
                Some((task_b, 400, 401))
            );
            // Not kept, so never taken as unchanged: the caller reads them in full.
            assert!(!still(&tlb, percpu_b, &straddle, (task_b, 400, 401)));
        }
    }

    /// An unsettled name (a task seen in kernel mode, perhaps inside an exec) is checked too: a
    /// kernel-mode sample holds while the name is unchanged, not once the exec renamed the task,
    /// and a user-mode sample (which settles the name) never holds. A settled name is not read.
    #[test]
    fn an_unsettled_name_is_checked_at_each_sample() {
        let m = Mem::new();
        let cr3 = 0x20_0000;
        let percpu = 0xffff_8880_0fa0_0000u64;
        let task = 0xffff_8880_0123_4000u64;
        m.map(cr3, (percpu + OFF.current_task) & !0xfff, 0x30_0000, false);
        // The task's pages in 4 KiB pages, the second below the first in guest-physical memory.
        let (page0, page1) = (0x45_0000u64, 0x41_0000u64);
        m.map(cr3, task, page0, false);
        m.map(cr3, task + 0x1000, page1, false);
        m.put(
            0x30_0000 + ((percpu + OFF.current_task) & 0xfff),
            &task.to_le_bytes(),
        );
        m.put(page0 + u64::from(OFF.pid), &7u32.to_le_bytes());
        m.put(page0 + u64::from(OFF.tgid), &9u32.to_le_bytes());
        let name = |n: &[u8]| {
            let mut comm = [0u8; 16];
            comm[..n.len()].copy_from_slice(n);
            m.put(page0 + u64::from(OFF.comm), &comm);
            comm
        };
        let old = name(b"workload-a");
        let read = |g| m.u64(g);
        let bytes = |g, b: &mut [u8]| m.bytes(g, b);
        let mut tlb = Tlb::new();
        let ids = read_task_ids(&mut tlb, &read, &bytes, cr3, percpu, &OFF).unwrap();
        assert_eq!(ids, (task, 7, 9));
        let comm = read_task_comm(&mut tlb, &read, &bytes, cr3, task, &OFF).unwrap();
        assert_eq!(comm, old);
        let word = |gpa: u64| m.u64(gpa).unwrap_or(!0);
        let unsettled = SameTask::new(&tlb, percpu, cr3, &OFF, ids, Some(comm), Some).unwrap();
        let settled = SameTask::new(&tlb, percpu, cr3, &OFF, ids, None, Some).unwrap();
        assert_eq!(
            (unsettled.ids(), settled.ids()),
            (ids, ids),
            "pid and tgid in order"
        );
        assert!(unsettled.holds(percpu, cr3, false, word));
        assert!(
            !unsettled.holds(percpu, cr3, true, word),
            "a user-mode sample settles it"
        );
        assert!(settled.holds(percpu, cr3, true, word));
        // The exec renames the task, here in the name's last 8 bytes alone: the unsettled check
        // fails, the settled one does not look.
        name(b"workload-b");
        assert!(!unsettled.holds(percpu, cr3, false, word));
        assert!(settled.holds(percpu, cr3, false, word));
        // Nor does either hold in another address space, or under another per-CPU base.
        assert!(!settled.holds(percpu, cr3 + 0x1000, false, word));
        assert!(!settled.holds(percpu + 0x1000, cr3, false, word));
        // A name whose first half lies across the task's two pages: read right through both
        // translations, but that half is not kept, so no check is made with it (every sample
        // reads the task in full, as before any was kept).
        let straddle = TaskOffsets { comm: 0xffc, ..OFF };
        m.put(page0 + 0xffc, b"span");
        m.put(page1, b"-the-page\0\0\0");
        let c = read_task_comm(&mut tlb, &read, &bytes, cr3, task, &straddle).unwrap();
        assert_eq!(&c, b"span-the-page\0\0\0");
        assert_eq!(
            SameTask::new(&tlb, percpu, cr3, &straddle, ids, Some(c), Some),
            None
        );
    }

    #[test]
    fn reads_across_a_page_boundary() {
        let m = Mem::new();
        let cr3 = 0x20_0000;
        m.map(cr3, 0xffff_ffff_8000_0000, 0x50_0000, false);
        m.map(cr3, 0xffff_ffff_8000_1000, 0x70_0000, false);
        m.put(0x50_0ffe, b"ab");
        m.put(0x70_0000, b"cd");
        let mut buf = [0u8; 4];
        assert!(read_virt(
            &mut Tlb::new(),
            &|g| m.u64(g),
            &|g, b: &mut [u8]| m.bytes(g, b),
            cr3,
            0xffff_ffff_8000_0ffe,
            &mut buf
        ));
        assert_eq!(&buf, b"abcd");
    }

    proptest::proptest! {
        #[test]
        fn walks_never_panic(entries in proptest::collection::vec(proptest::num::u64::ANY, 0..64),
                             cr3 in proptest::num::u64::ANY, gva in proptest::num::u64::ANY) {
            let m = Mem::new();
            for (i, e) in entries.iter().enumerate() {
                m.put((cr3 & 0xf_ffff & !0xfff) + 8 * i as u64 % 4096, &e.to_le_bytes());
            }
            let _ = translate(&|g| m.u64(g), cr3, gva);
            let _ = read_task(&mut Tlb::new(), &|g| m.u64(g), &|g, b: &mut [u8]| m.bytes(g, b), cr3, gva, &OFF);
        }
    }

    #[test]
    fn a_name_read_inside_an_exec_is_read_again_until_user_mode() {
        let ids = (0xffff_8880_0100_0000, 88, 88);
        let old = *b"busybox\0\0\0\0\0\0\0\0\0";
        let no_mm = || true;
        let has_mm = || false;
        // In user mode a name is settled.
        assert_eq!(
            name_state(None, ids, 0x1000, true, has_mm),
            NameState::Settled
        );
        let settled = Some((ids, 0x1000, old, NameState::Settled));
        // The exec switched the address space; the name may be the old one: read again until
        // user mode, however many kernel-mode samples (and switches) come first.
        let s = name_state(settled, ids, 0x2000, false, has_mm);
        assert_eq!(s, NameState::UntilUser);
        let again = Some((ids, 0x2000, old, s));
        assert_eq!(
            name_state(again, ids, 0x2000, false, || panic!("not asked")),
            NameState::UntilUser
        );
        let other = (0xffff_8880_0200_0000, 2, 2);
        let between = Some((other, 0x2000, old, NameState::Settled));
        assert_eq!(
            name_state(between, ids, 0x2000, false, has_mm),
            NameState::UntilUser
        );
        assert_eq!(
            name_state(again, ids, 0x2000, true, has_mm),
            NameState::Settled
        );
        // A kernel thread, on whichever address space it borrows: settled at once.
        assert_eq!(
            name_state(settled, other, 0x1000, false, no_mm),
            NameState::Settled
        );
        let kthread = Some((other, 0x1000, old, NameState::Settled));
        assert_eq!(
            name_state(kthread, other, 0x3000, false, no_mm),
            NameState::Settled
        );
    }

    /// A task at `task` (pid 4242, tgid 4240, named `name`) as the per-CPU word at `percpu`
    /// names it, mapped under `root`: the per-CPU page at `percpu_gpa` and the task's at
    /// `task_gpa` (4 KiB each).
    fn put_task(
        m: &Mem,
        root: u64,
        (percpu, percpu_gpa): (u64, u64),
        task: u64,
        task_gpa: u64,
        name: &[u8; 4],
    ) {
        let word = percpu + OFF.current_task;
        m.map(root, word & !0xfff, percpu_gpa, false);
        m.put(percpu_gpa + (word & 0xfff), &task.to_le_bytes());
        m.map(root, task & !0xfff, task_gpa, false);
        let t = task_gpa + (task & 0xfff);
        m.put(t + 2416, &4242u32.to_le_bytes());
        m.put(t + 2420, &4240u32.to_le_bytes());
        let mut comm = [0u8; 16];
        comm[..4].copy_from_slice(name);
        m.put(t + 2976, &comm);
    }

    /// Without page-table isolation a process's PGD may have bit 12 set: its task is read
    /// through it, not through whatever page lies 4 KiB below (here another PGD that names
    /// another task), and its user-mode CR3 tells that the guest does not isolate.
    #[test]
    fn a_pgd_with_bit_12_set_is_read_as_it_is() {
        let m = Mem::new();
        let percpu = 0xffff_8880_0fa0_0000u64;
        let (pgd, below) = (0x21_1000, 0x21_0000);
        put_task(
            &m,
            pgd,
            (percpu, 0x30_0000),
            0xffff_8880_0123_4000,
            0x40_0000,
            b"real",
        );
        put_task(
            &m,
            below,
            (percpu, 0x31_0000),
            0xffff_8880_0999_9000,
            0x41_0000,
            b"fake",
        );
        let read = |g| m.u64(g);
        let bytes = |g, b: &mut [u8]| m.bytes(g, b);
        assert_eq!(isolation_shown(&read, pgd | 0x7, percpu, &OFF), Some(false));
        let root = (pgd | 0x7) & space_mask(false);
        let mut tlb = Tlb::new();
        let got = read_task(&mut tlb, &read, &bytes, root, percpu, &OFF).unwrap();
        assert_eq!(got.task, 0xffff_8880_0123_4000);
        assert_eq!(&got.comm[..4], b"real");
    }

    /// With isolation, the user-mode CR3 is the user PGD of an 8 KiB-aligned pair, which maps
    /// the kernel's entry area (here the per-CPU page) but not its task structures: its CR3
    /// tells so, and from then on the kernel's PGD below it is the address space of both and
    /// the root the task and the process's memory are read through.
    #[test]
    fn the_user_pgd_of_an_isolation_pair_is_read_through_the_kernels() {
        let m = Mem::new();
        let percpu = 0xffff_8880_0fa0_0000u64;
        let task = 0xffff_8880_0123_4000u64;
        // (A pair 8 KiB aligned and no more, so that a mask wider than bit 12 would show.)
        let kernel = 0x22_6000;
        let user = kernel | 0x1000;
        put_task(&m, kernel, (percpu, 0x30_0000), task, 0x40_0000, b"w41\0");
        // The user half: mapped in both PGDs of the pair (as Linux's are).
        m.map(kernel, 0x40_1000, 0x50_0000, false);
        m.map(user, 0x40_1000, 0x50_0000, false);
        m.put(0x50_0010, &0x1234_5678u64.to_le_bytes());
        let read = |g| m.u64(g);
        let bytes = |g, b: &mut [u8]| m.bytes(g, b);
        // Neither the per-CPU word nor the task mapped in the user PGD: isolation.
        assert_eq!(
            isolation_shown(&read, user | 0x805, percpu, &OFF),
            Some(true)
        );
        // The per-CPU page mapped there too (a kernel that maps it in its entry area): the task
        // still is not.
        m.map(user, (percpu + OFF.current_task) & !0xfff, 0x30_0000, false);
        assert_eq!(
            isolation_shown(&read, user | 0x805, percpu, &OFF),
            Some(true)
        );
        // The kernel-mode CR3 maps both: it cannot be the user half of a pair.
        assert_eq!(
            isolation_shown(&read, kernel | 0x5, percpu, &OFF),
            Some(false)
        );
        // A user PGD whose pair below maps nothing of it either tells nothing; nor does a
        // per-CPU base in the user half.
        assert_eq!(isolation_shown(&read, 0x61_3000, percpu, &OFF), None);
        assert_eq!(isolation_shown(&read, user, 0x7fff_0000_0000, &OFF), None);
        // Nor a per-CPU word that names no task yet.
        let other = 0xffff_8880_0fb0_0000u64;
        m.map(
            kernel,
            (other + OFF.current_task) & !0xfff,
            0x32_0000,
            false,
        );
        assert_eq!(isolation_shown(&read, user, other, &OFF), None);
        let root = (user | 0x805) & space_mask(true);
        assert_eq!(root, kernel);
        let mut tlb = Tlb::new();
        let got = read_task(&mut tlb, &read, &bytes, root, percpu, &OFF).unwrap();
        assert_eq!((got.task, got.pid, got.tgid), (task, 4242, 4240));
        // Through the user PGD itself the task is not there.
        let mut cold = Tlb::new();
        assert_eq!(
            read_task(&mut cold, &read, &bytes, user, percpu, &OFF),
            None
        );
        // A process's memory, through the kernel's PGD: both halves.
        use hvprof_linux_walk::GuestMemory;
        let space = AddressSpace::new(&read, &bytes, root);
        let mut buf = [0u8; 8];
        assert!(space.read(0x40_1010, &mut buf));
        assert_eq!(u64::from_le_bytes(buf), 0x1234_5678);
        assert!(space.read(task + 2416, &mut buf));
        assert_eq!(u32::from_le_bytes(buf[..4].try_into().unwrap()), 4242);
        assert!(!space.read(0xffff_8880_0777_0000, &mut buf));
    }
}
