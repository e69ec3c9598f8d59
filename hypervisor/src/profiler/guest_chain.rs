//! A guest sample's call chain: which walk serves it (frame pointers; a Linux kernel's ORC
//! tables, found through the guest's IA32_LSTAR; the VM's unwind tables for its programs), over
//! the running vCPU's memory (`guest_stack`), with the pCPU's caches of what earlier walks
//! found. The sampler (`bin/hvprof/profiler/sampler.rs`) keeps one [`GuestChains`] per pCPU and
//! asks it for the chain at a guest sample, and for the exit-cause chain at a hypervisor sample
//! during a vCPU's exit; the MSR read goes through [`Processor`], so all of it is tested here.

use crate::guest_ram::GuestRam;
use crate::profiler::costs::Costs;
use crate::profiler::guest_stack::{GuestStack, WalkMemory};
use crate::profiler::sample_path::Processor;
use crate::profiler::stack_walk;
use crate::profiler::table_walk;
use crate::profiler::walk_cache::{SeqLock, WalkCache};
use core::mem::MaybeUninit;
use core::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering, compiler_fence};
use hvprof_linux_walk::UnwindTable;
use hvprof_samplelog::{Chain, MAX_CHAIN_DEPTH};

/// IA32_LSTAR (SDM Vol. 4, Table 2-2): a 64-bit kernel's system-call entry, `entry_SYSCALL_64`.
const IA32_LSTAR: u32 = 0xc000_0082;

/// Where a guest chain starts: the sampled guest state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestAt {
    pub cr3: u64,
    pub cpl: u8,
    /// 64-bit code (chains are walked there only).
    pub long: bool,
    pub rip: u64,
}

/// One pCPU's view of the guest it runs, for its walks: the VM's memory, how its kernel-mode
/// chains are walked, the vCPU's RBP at its last exit, and the walks' caches. Every field is
/// atomic: the run loop sets them, the timer and NMI samples of the same pCPU read them.
pub struct GuestChains {
    /// The memory of the VM whose vCPU runs here (host-physical base and size; size 0: none),
    /// and how its kernel-mode chains are walked (`KernelStacks`, as a `u8`), with its
    /// kernel's ORC tables where they are walked by those.
    hpa: AtomicU64,
    size: AtomicU64,
    kernel_mode: AtomicU8,
    kernel_orc: AtomicOrcTables,
    /// ORC entries found by earlier kernel walks, and unwind-table entries by user walks.
    orc_entries: OrcEntries,
    /// That vCPU's RBP at its last VM exit.
    rbp: AtomicU64,
    /// Guest pages translated and code found ordinary by earlier walks, of the VM this pCPU
    /// runs (`walk_cache`).
    walk_cache: WalkCache,
}

impl Default for GuestChains {
    fn default() -> Self {
        Self::new()
    }
}

impl GuestChains {
    #[must_use]
    pub const fn new() -> Self {
        GuestChains {
            hpa: AtomicU64::new(0),
            size: AtomicU64::new(0),
            kernel_mode: AtomicU8::new(0),
            kernel_orc: AtomicOrcTables::new(),
            orc_entries: OrcEntries::new(),
            rbp: AtomicU64::new(0),
            walk_cache: WalkCache::new(),
        }
    }

    /// The VM whose vCPU this pCPU runs now and its memory (`None`: none), and how its
    /// kernel-mode chains are walked (`orc`: where its kernel's ORC tables are, for
    /// `KernelStacks::Orc`; without them, not at all).
    ///
    /// # Safety
    /// No walk of this `GuestChains` may run on another CPU meanwhile: only on this one, in an
    /// interrupt or NMI that lands inside this call. Such a walk runs whole between two of this
    /// call's stores, which are in program order (compiler fences): it sees a size of 0 (no
    /// memory: nothing read) until the new address is stored, then the new memory whole. On
    /// another CPU a walk could pair the old address with the new size.
    pub unsafe fn set_memory(
        &self,
        ram: Option<(u16, GuestRam)>,
        kernel: KernelStacks,
        orc: Option<hvprof_linux_walk::OrcLayout>,
    ) {
        let (hpa, size) = ram.map_or((0, 0), |(_, r)| (r.hpa(), r.size()));
        // No walk reads the fields while the size is 0: a sample that interrupts this sees
        // either the old VM or the new one whole.
        self.size.store(0, Ordering::Relaxed);
        compiler_fence(Ordering::Release);
        if let Some((vm, _)) = ram {
            // What another VM's walks left here is not this one's (walk_cache.rs).
            self.walk_cache.enter_vm(vm);
        }
        let kernel = match (kernel, orc) {
            (KernelStacks::Orc, Some(l)) => {
                self.kernel_orc.store(&l);
                KernelStacks::Orc
            }
            (KernelStacks::Orc, None) => KernelStacks::None,
            (k, _) => k,
        };
        self.kernel_mode.store(kernel as u8, Ordering::Relaxed);
        self.hpa.store(hpa, Ordering::Relaxed);
        compiler_fence(Ordering::Release);
        self.size.store(size, Ordering::Relaxed);
    }

    /// Whether a VM's memory is set (a vCPU runs here).
    #[inline]
    pub fn has_memory(&self) -> bool {
        self.size.load(Ordering::Relaxed) != 0
    }

    /// The running vCPU's RBP at its VM exit (where its guest chain starts).
    #[inline(always)]
    pub fn set_rbp(&self, rbp: u64) {
        self.rbp.store(rbp, Ordering::Relaxed);
    }

    /// The running vCPU's guest chain from `at`, in VM `vm`, through its own page tables and
    /// its own memory: 64-bit code only. In user mode, by the VM's unwind tables
    /// (`user_tables`) where they cover the code, else by frame pointers from its RBP at its
    /// last exit; in kernel mode, by frame pointers where the guest keeps them there, or by a
    /// Linux kernel's ORC tables from the RIP and the RSP that `rsp` reads, through any
    /// `pt_regs` into the user's frames. At most `depth` frames, written to the start of `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn walk<'a, 't>(
        &self,
        cpu: &impl Processor,
        costs: &Costs,
        vm: u16,
        user_tables: impl FnOnce() -> &'t [UnwindTable<'t>],
        at: GuestAt,
        rsp: impl FnOnce() -> u64,
        depth: usize,
        out: &'a mut [MaybeUninit<u64>],
    ) -> (Chain, &'a [u64]) {
        // SAFETY: `set_memory` stored these from a `GuestRam` (whose maker vouched for its
        // memory for as long as it or a copy is used: this is a copy), or zeros (no memory:
        // nothing is read); its contract keeps a walk from pairing one memory's address with
        // another's size (none runs on another CPU while it changes them).
        let ram = unsafe {
            GuestRam::new(
                self.hpa.load(Ordering::Relaxed),
                self.size.load(Ordering::Relaxed),
            )
        };
        if ram.size() == 0 || !at.long {
            return (Chain::NOT_WALKED, &[]);
        }
        let GuestAt { cr3, cpl, rip, .. } = at;
        let fp = self.rbp.load(Ordering::Relaxed);
        let mut mem = GuestStack::new(ram, cr3, &self.walk_cache, costs);
        let cache = VmOrcEntries {
            entries: &self.orc_entries,
            vm,
            costs,
        };
        if cpl == 3 {
            let max = depth.min(MAX_CHAIN_DEPTH).min(out.len());
            let (chain, n) = walk_user(
                &mut mem,
                user_tables(),
                &cache,
                (rip, rsp, fp),
                &mut out[..max],
            );
            // SAFETY: `walk_user` wrote the first `n` slots; `MaybeUninit<u64>` has the layout
            // of `u64`.
            let frames = unsafe { &*(&out[..n] as *const [MaybeUninit<u64>] as *const [u64]) };
            return (chain, frames);
        }
        match KernelStacks::from_u8(self.kernel_mode.load(Ordering::Relaxed)) {
            KernelStacks::None => (Chain::NOT_WALKED, &[]),
            KernelStacks::FramePointers => {
                let known = mem.ordinary_code();
                stack_walk::walk_from(
                    &mut mem,
                    (rip, rsp, fp),
                    stack_walk::half_of(fp),
                    depth,
                    out,
                    &known,
                )
            }
            KernelStacks::Orc => {
                let Some(orc) = self.kernel_orc.tables(cpu) else {
                    return (Chain::NOT_WALKED, &[]);
                };
                let start = hvprof_linux_walk::KernelRegs {
                    ip: rip,
                    sp: rsp(),
                    bp: fp,
                };
                walk_kernel(&mut mem, &orc, &cache, user_tables(), start, depth, out)
            }
        }
    }
}

/// How a guest's kernel-mode call chains are walked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum KernelStacks {
    /// Not at all (a Linux kernel without ORC tables given, or before it set IA32_LSTAR).
    None = 0,
    /// By frame pointers (the test guests keep them).
    FramePointers = 1,
    /// By the Linux kernel's ORC tables (`orc-layout=`).
    Orc = 2,
}

impl KernelStacks {
    #[must_use]
    pub fn from_u8(v: u8) -> Self {
        match v {
            1 => KernelStacks::FramePointers,
            2 => KernelStacks::Orc,
            _ => KernelStacks::None,
        }
    }
}

/// A kernel's ORC tables at link time (`OrcLayout`), each field atomic (see `set_memory`
/// for how they change), and the KASLR slide once known.
struct AtomicOrcTables {
    /// `entry_SYSCALL_64`, `_stext`, `_etext`, `_sinittext`, `_einittext`, `.orc_unwind_ip`,
    /// `.orc_unwind`, `.orc_lookup`.
    addrs: [AtomicU64; 8],
    /// Slots, lookup blocks.
    counts: [AtomicU32; 2],
    /// The slide, or `NO_SLIDE` until a walk has read it from the guest's IA32_LSTAR.
    slide: AtomicU64,
}

/// `AtomicOrcTables::slide` before it is known.
const NO_SLIDE: u64 = u64::MAX;

impl AtomicOrcTables {
    const fn new() -> Self {
        AtomicOrcTables {
            addrs: [const { AtomicU64::new(0) }; 8],
            counts: [const { AtomicU32::new(0) }; 2],
            slide: AtomicU64::new(NO_SLIDE),
        }
    }

    fn store(&self, l: &hvprof_linux_walk::OrcLayout) {
        for (a, v) in self.addrs.iter().zip(l.addresses()) {
            a.store(v, Ordering::Relaxed);
        }
        self.counts[0].store(l.count, Ordering::Relaxed);
        self.counts[1].store(l.lookup_blocks, Ordering::Relaxed);
        self.slide.store(NO_SLIDE, Ordering::Relaxed);
    }

    /// The running kernel's tables: the slide from its IA32_LSTAR (live on this CPU while its
    /// vCPU is loaded; read at the first walk after `store`, which each slice's `set_memory`
    /// makes, as the kernel sets it early in its boot, and kept until then); `None` while the
    /// kernel has not set it.
    fn tables(&self, cpu: &impl Processor) -> Option<hvprof_linux_walk::OrcLayout> {
        let layout = hvprof_linux_walk::OrcLayout::from_addresses(
            core::array::from_fn(|i| self.addrs[i].load(Ordering::Relaxed)),
            self.counts[0].load(Ordering::Relaxed),
            self.counts[1].load(Ordering::Relaxed),
        );
        let slide = self.slide.load(Ordering::Relaxed);
        if slide != NO_SLIDE {
            return layout.at(layout.entry_syscall_64.wrapping_add(slide));
        }
        let lstar = cpu.read_msr(IA32_LSTAR).unwrap_or(0);
        let tables = layout.at(lstar)?;
        self.slide.store(
            lstar.wrapping_sub(layout.entry_syscall_64),
            Ordering::Relaxed,
        );
        Some(tables)
    }
}

/// Entries of `OrcEntries` (a power of two).
const ORC_ENTRIES: usize = 256;

/// ORC entries found by earlier walks on this pCPU, by the IP they were found for and the VM
/// (direct-mapped): the callers a profile sees repeat, so most frames of a kernel walk skip the
/// search of the tables. User walks keep their unwind tables' entries here too (see
/// `EntryCache for VmOrcEntries` for how their keys differ). Under a `walk_cache::SeqLock`,
/// as `walk_cache::StackPages`. A VM that rewrites its own tables can be walked by the entries it
/// had: its own chains only, read from its own memory all the same.
struct OrcEntries {
    seq: SeqLock,
    /// Per entry: key (the IP's low 48 bits, the VM index above), the entry's 6 bytes.
    entries: [[AtomicU64; 2]; ORC_ENTRIES],
}

impl OrcEntries {
    const fn new() -> Self {
        OrcEntries {
            seq: SeqLock::new(),
            entries: [const { [const { AtomicU64::new(u64::MAX) }; 2] }; ORC_ENTRIES],
        }
    }

    fn key(vm: u16, ip: u64) -> (u64, usize) {
        let key = (ip & 0xffff_ffff_ffff) | (u64::from(vm) << 48);
        // Return addresses spread over the low bits; fold in a few higher ones.
        (key, ((ip ^ (ip >> 7)) as usize) % ORC_ENTRIES)
    }
}

/// `OrcEntries` for one VM's walk.
struct VmOrcEntries<'a> {
    entries: &'a OrcEntries,
    vm: u16,
    costs: &'a Costs,
}

impl hvprof_linux_walk::orc::OrcCache for VmOrcEntries<'_> {
    fn get(&self, ip: u64) -> Option<hvprof_linux_walk::orc::OrcEntry> {
        let (key, i) = OrcEntries::key(self.vm, ip);
        let e = &self.entries.entries[i];
        let (k, v) = self
            .entries
            .seq
            .read(|| Some((e[0].load(Ordering::Relaxed), e[1].load(Ordering::Relaxed))))?;
        if k != key {
            return None;
        }
        self.costs.orc_hits.fetch_add(1, Ordering::Relaxed);
        let b = v.to_le_bytes();
        Some(hvprof_linux_walk::orc::OrcEntry::from_bytes([
            b[0], b[1], b[2], b[3], b[4], b[5],
        ]))
    }

    fn put(&self, ip: u64, entry: hvprof_linux_walk::orc::OrcEntry) {
        self.costs.orc_searches.fetch_add(1, Ordering::Relaxed);
        let (key, i) = OrcEntries::key(self.vm, ip);
        let [a, b, c, d, e, f] = entry.to_bytes();
        let v = u64::from_le_bytes([a, b, c, d, e, f, 0, 0]);
        let slot = &self.entries.entries[i];
        self.entries.seq.write(|| {
            slot[0].store(key, Ordering::Relaxed);
            slot[1].store(v, Ordering::Relaxed);
        });
    }
}

/// A Linux guest's kernel chain by ORC (`start`: the interrupted kernel code), then, where it
/// ends in user mode's `pt_regs`, the user's RIP and its callers (by the VM's unwind tables
/// `user`, where they cover the code, else by frame pointers), into `out`
/// (`hvprof_hypervisor::profiler::table_walk`).
fn walk_kernel<'a>(
    mem: &mut GuestStack<'_>,
    tables: &hvprof_linux_walk::OrcLayout,
    cache: &VmOrcEntries<'_>,
    user_tables: &[UnwindTable<'_>],
    start: hvprof_linux_walk::KernelRegs,
    depth: usize,
    out: &'a mut [MaybeUninit<u64>],
) -> (Chain, &'a [u64]) {
    let max = depth.min(MAX_CHAIN_DEPTH).min(out.len());
    let reads = &cache.costs.kernel_walk_reads;
    let kernel =
        table_walk::kernel_frames(&WalkMemory::new(mem), tables, cache, start, reads, max, out);
    let chain = table_walk::after_kernel(kernel, max, out, |(ip, sp, bp), rest| {
        walk_user(mem, user_tables, cache, (ip, || sp, bp), rest)
    });
    let n = chain.depth();
    // SAFETY: the first `n` slots of `out` were written (by the kernel walk, the user RIP and
    // the user walk, which writes the start of the part it is given: `after_kernel`);
    // `MaybeUninit<u64>` has the layout of `u64`.
    let frames = unsafe { &*(&out[..n] as *const [MaybeUninit<u64>] as *const [u64]) };
    (chain, frames)
}

/// The same cache for a user walk's unwind-table entries: keyed by the IP tagged with the
/// table's place in the VM's list (`unwind=` takes at most 4) in bits 44-46, which no covered IP
/// has (`cfi::TABLE_END`) and no kernel IP's low 48 bits lack (bit 47 is set in all of them).
impl hvprof_linux_walk::cfi::EntryCache for VmOrcEntries<'_> {
    fn get(&self, table: usize, ip: u64) -> Option<hvprof_linux_walk::orc::OrcEntry> {
        hvprof_linux_walk::orc::OrcCache::get(self, user_key(table, ip))
    }

    fn put(&self, table: usize, ip: u64, entry: hvprof_linux_walk::orc::OrcEntry) {
        hvprof_linux_walk::orc::OrcCache::put(self, user_key(table, ip), entry);
    }
}

/// See `EntryCache for VmOrcEntries`.
fn user_key(table: usize, ip: u64) -> u64 {
    debug_assert!(table < crate::vm_config::UNWIND_MAX);
    (ip & (hvprof_linux_walk::cfi::TABLE_END - 1)) | ((table as u64 + 1) & 7) << 44
}

/// A user chain from `(ip, sp, bp)` (RSP read only where a table is walked, or where the
/// sampled function has no frame record: `stack_walk::walk_from`) by the unwind
/// tables where they cover the code and the process runs their program, else by frame
/// pointers (without tables, the frame-pointer walk alone): its return addresses written to the
/// start of `out` (at most its length). Returns the chain and how many slots were written.
fn walk_user(
    mem: &mut GuestStack<'_>,
    tables: &[UnwindTable<'_>],
    cache: &VmOrcEntries<'_>,
    (ip, sp, bp): (u64, impl FnOnce() -> u64, u64),
    out: &mut [MaybeUninit<u64>],
) -> (Chain, usize) {
    let max = out.len().min(MAX_CHAIN_DEPTH);
    if tables.is_empty() {
        let known = mem.ordinary_code();
        let (chain, _) =
            stack_walk::walk_from(mem, (ip, sp, bp), stack_walk::LOWER_HALF, max, out, &known);
        return (chain, chain.depth());
    }
    let start = hvprof_linux_walk::UserStart { ip, sp: sp(), bp };
    let reads = &cache.costs.user_walk_reads;
    table_walk::user_frames(&WalkMemory::new(mem), tables, cache, start, reads, max, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profiler::test_guest::Guest;
    use core::cell::Cell;
    use hvprof_linux_walk::orc::{OrcCache, OrcEntry};
    use hvprof_linux_walk::{OrcLayout, cfi::EntryCache};
    use hvprof_samplelog::ChainEnd;

    /// A processor whose IA32_LSTAR is `lstar` (`None`: the read faults), counting its reads.
    struct Msrs {
        lstar: Cell<Option<u64>>,
        reads: Cell<u32>,
    }

    impl Msrs {
        fn lstar(v: Option<u64>) -> Self {
            Msrs {
                lstar: Cell::new(v),
                reads: Cell::new(0),
            }
        }
    }

    impl Processor for Msrs {
        fn tsc(&self) -> u64 {
            0
        }
        fn without_interrupts<R>(&self, f: impl FnOnce() -> R) -> R {
            f()
        }
        fn interrupts_enabled(&self) -> bool {
            false
        }
        fn read_msr(&self, msr: u32) -> Option<u64> {
            assert_eq!(msr, IA32_LSTAR);
            self.reads.set(self.reads.get() + 1);
            self.lstar.get()
        }
    }

    const VM: u16 = 3;
    const USER_STACK: u64 = 0x7fff_f000_0000;
    const KERNEL_STACK: u64 = 0xffff_c900_0000_0000;

    /// A guest whose stacks at `USER_STACK` and `KERNEL_STACK` hold two frame records each: the
    /// first at offset 0x100 of the page (return address `ret`), the second at 0x200 (`ret + 1`,
    /// the outermost: its saved frame pointer is 0).
    fn guest_with_stacks(ret_user: u64, ret_kernel: u64) -> Guest {
        let mut g = Guest::new();
        for (stack, gpa, ret) in [
            (USER_STACK, 0x10_0000, ret_user),
            (KERNEL_STACK, 0x11_0000, ret_kernel),
        ] {
            g.map(stack, gpa);
            g.put(gpa + 0x100, &(stack + 0x200).to_le_bytes());
            g.put(gpa + 0x108, &ret.to_le_bytes());
            g.put(gpa + 0x200, &0u64.to_le_bytes());
            g.put(gpa + 0x208, &(ret + 1).to_le_bytes());
        }
        g
    }

    fn chains_for(g: &Guest, kernel: KernelStacks, orc: Option<OrcLayout>) -> GuestChains {
        let c = GuestChains::new();
        // SAFETY: one thread.
        unsafe { c.set_memory(Some((VM, g.ram)), kernel, orc) };
        c
    }

    fn at(cpl: u8, long: bool) -> GuestAt {
        GuestAt {
            cr3: Guest::CR3,
            cpl,
            long,
            rip: 0x40_0000,
        }
    }

    /// Walks with frame pointer `fp` at its last exit and no unwind tables.
    fn walk(c: &GuestChains, cpu: &Msrs, at: GuestAt, fp: u64, depth: usize) -> (Chain, Vec<u64>) {
        let costs = Costs::new(640, 160);
        c.set_rbp(fp);
        let mut out = [MaybeUninit::uninit(); MAX_CHAIN_DEPTH];
        let (chain, frames) = c.walk(cpu, &costs, VM, || &[], at, || 0, depth, &mut out);
        (chain, frames.to_vec())
    }

    #[test]
    fn user_and_kernel_chains_by_frame_pointers() {
        let g = guest_with_stacks(0x40_1000, 0xffff_ffff_8100_2000);
        let c = chains_for(&g, KernelStacks::FramePointers, None);
        let cpu = Msrs::lstar(None);
        let (chain, frames) = walk(&c, &cpu, at(3, true), USER_STACK + 0x100, 16);
        assert_eq!(frames, [0x40_1000, 0x40_1001]);
        assert_eq!(chain, Chain::new(2, ChainEnd::Complete));
        let (chain, frames) = walk(&c, &cpu, at(0, true), KERNEL_STACK + 0x100, 16);
        assert_eq!(frames, [0xffff_ffff_8100_2000, 0xffff_ffff_8100_2001]);
        assert_eq!(chain, Chain::new(2, ChainEnd::Complete));
        // The depth asked for cuts the chain.
        let (chain, frames) = walk(&c, &cpu, at(3, true), USER_STACK + 0x100, 1);
        assert_eq!(frames, [0x40_1000]);
        assert_eq!(chain, Chain::new(1, ChainEnd::DepthLimit));
        // A user frame pointer in the kernel's half is no user frame.
        let (chain, frames) = walk(&c, &cpu, at(3, true), KERNEL_STACK + 0x100, 16);
        assert!(frames.is_empty());
        assert_eq!(chain.end(), ChainEnd::BadFrame);
        assert_eq!(cpu.reads.get(), 0, "no MSR read without ORC tables");
    }

    #[test]
    fn nothing_is_walked_without_memory_64_bit_code_or_a_kernel_walker() {
        let g = guest_with_stacks(0x40_1000, 0xffff_ffff_8100_2000);
        let cpu = Msrs::lstar(None);
        // 32-bit code.
        let c = chains_for(&g, KernelStacks::FramePointers, None);
        let (chain, frames) = walk(&c, &cpu, at(3, false), USER_STACK + 0x100, 16);
        assert_eq!((chain, frames.len()), (Chain::NOT_WALKED, 0));
        // No VM's memory (the pCPU runs none).
        // SAFETY: one thread.
        unsafe { c.set_memory(None, KernelStacks::FramePointers, None) };
        assert!(!c.has_memory());
        let (chain, _) = walk(&c, &cpu, at(3, true), USER_STACK + 0x100, 16);
        assert_eq!(chain, Chain::NOT_WALKED);
        // Kernel chains not walked: user chains still are.
        let c = chains_for(&g, KernelStacks::None, None);
        assert!(c.has_memory());
        let (chain, _) = walk(&c, &cpu, at(0, true), KERNEL_STACK + 0x100, 16);
        assert_eq!(chain, Chain::NOT_WALKED);
        let (_, frames) = walk(&c, &cpu, at(3, true), USER_STACK + 0x100, 16);
        assert_eq!(frames.len(), 2);
        // ORC asked for without the tables' layout: not walked either.
        let c = chains_for(&g, KernelStacks::Orc, None);
        let (chain, _) = walk(&c, &cpu, at(0, true), KERNEL_STACK + 0x100, 16);
        assert_eq!(chain, Chain::NOT_WALKED);
        assert_eq!(cpu.reads.get(), 0);
    }

    fn layout() -> OrcLayout {
        OrcLayout::from_addresses(
            [
                0xffff_ffff_81c0_0080,
                0xffff_ffff_8100_0000,
                0xffff_ffff_81e0_0000,
                0xffff_ffff_8300_0000,
                0xffff_ffff_830b_0000,
                0xffff_ffff_82c5_d5c0,
                0xffff_ffff_82dc_52e0,
                0xffff_ffff_82fe_0e90,
            ],
            1000,
            64,
        )
    }

    /// The ORC tables move by the KASLR slide read from IA32_LSTAR once; before the kernel set
    /// it (0, or a read that faults) the kernel's chains are not walked and the next walk asks
    /// again; the layout set again (each slice, whichever VM's kernel) forgets the slide.
    #[test]
    fn the_kernel_tables_follow_lstar_read_once() {
        let g = guest_with_stacks(0x40_1000, 0xffff_ffff_8100_2000);
        let c = chains_for(&g, KernelStacks::Orc, Some(layout()));
        let cpu = Msrs::lstar(Some(0));
        assert_eq!(c.kernel_orc.tables(&cpu), None);
        cpu.lstar.set(None);
        assert_eq!(c.kernel_orc.tables(&cpu), None);
        assert_eq!(cpu.reads.get(), 2);
        let slide = 0x1e0_0000;
        cpu.lstar.set(Some(layout().entry_syscall_64 + slide));
        let want = layout().at(layout().entry_syscall_64 + slide).unwrap();
        assert_eq!(want.stext, 0xffff_ffff_8100_0000 + slide);
        assert_eq!(c.kernel_orc.tables(&cpu), Some(want));
        assert_eq!(c.kernel_orc.tables(&cpu), Some(want));
        assert_eq!(cpu.reads.get(), 3, "the slide is kept");
        // A kernel walk now reads the guest's tables (not there: it finds no entry) and ends.
        let (chain, _) = walk(&c, &cpu, at(0, true), KERNEL_STACK + 0x100, 16);
        assert_ne!(chain, Chain::NOT_WALKED);
        assert_eq!(cpu.reads.get(), 3);
        // The next slice (here another VM's): the slide is read anew.
        // SAFETY: one thread.
        unsafe { c.set_memory(Some((VM + 1, g.ram)), KernelStacks::Orc, Some(layout())) };
        assert_eq!(c.kernel_orc.tables(&cpu), Some(want));
        assert_eq!(cpu.reads.get(), 4);
    }

    fn entry(sp: i16) -> OrcEntry {
        OrcEntry {
            sp_offset: sp,
            bp_offset: -16,
            sp_reg: 4,
            bp_reg: 6,
            kind: 1,
            end: false,
        }
    }

    #[test]
    fn orc_entries_are_kept_per_vm_and_counted() {
        let (entries, costs) = (OrcEntries::new(), Costs::new(1, 1));
        let for_vm = |vm| VmOrcEntries {
            entries: &entries,
            vm,
            costs: &costs,
        };
        let ip = 0xffff_ffff_8123_4567;
        assert_eq!(OrcCache::get(&for_vm(1), ip), None);
        OrcCache::put(&for_vm(1), ip, entry(8));
        assert_eq!(OrcCache::get(&for_vm(1), ip), Some(entry(8)));
        assert_eq!(OrcCache::get(&for_vm(2), ip), None, "another VM's kernel");
        // Direct-mapped: an IP that shares the slot takes it over.
        let other = (0..)
            .map(|i| ip + 0x1_0000 * i)
            .find(|&o| o != ip && OrcEntries::key(1, o).1 == OrcEntries::key(1, ip).1)
            .unwrap();
        OrcCache::put(&for_vm(1), other, entry(24));
        assert_eq!(OrcCache::get(&for_vm(1), other), Some(entry(24)));
        assert_eq!(OrcCache::get(&for_vm(1), ip), None);
        assert_eq!(costs.orc_hits.load(Ordering::Relaxed), 2);
        assert_eq!(costs.orc_searches.load(Ordering::Relaxed), 2);
    }

    /// A walk that interrupts a write of the cache (an NMI's, inside the run loop's) neither
    /// reads the entry being written nor writes over it.
    #[test]
    fn an_orc_entry_under_write_is_neither_read_nor_written() {
        let (entries, costs) = (OrcEntries::new(), Costs::new(1, 1));
        let c = VmOrcEntries {
            entries: &entries,
            vm: 1,
            costs: &costs,
        };
        OrcCache::put(&c, 0x1000, entry(8));
        entries.seq.write(|| {
            assert_eq!(OrcCache::get(&c, 0x1000), None);
            OrcCache::put(&c, 0x1000, entry(16));
        });
        assert_eq!(OrcCache::get(&c, 0x1000), Some(entry(8)));
    }

    /// A user table's entries share the cache with the kernel's under keys neither the kernel's
    /// nor another table's can take.
    #[test]
    fn user_table_keys_are_apart_from_kernel_keys_and_each_other() {
        // (Tables cover IPs below `cfi::TABLE_END` only.)
        let ip = 0x0555_5555_1234;
        let keys: Vec<u64> = (0..crate::vm_config::UNWIND_MAX)
            .map(|t| user_key(t, ip))
            .collect();
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(k & (hvprof_linux_walk::cfi::TABLE_END - 1), ip);
            assert_eq!(k & (1 << 47), 0, "kernel IPs have bit 47 set");
            assert!(keys[i + 1..].iter().all(|o| o != k));
        }
        let (entries, costs) = (OrcEntries::new(), Costs::new(1, 1));
        let c = VmOrcEntries {
            entries: &entries,
            vm: 1,
            costs: &costs,
        };
        EntryCache::put(&c, 0, ip, entry(8));
        assert_eq!(EntryCache::get(&c, 0, ip), Some(entry(8)));
        assert_eq!(EntryCache::get(&c, 1, ip), None);
        assert_eq!(OrcCache::get(&c, ip), None);
    }
}
