//! The glue between a sample and the walks by unwind tables (`hvprof_linux_walk`): a Linux
//! guest's kernel chain by its ORC tables and a user chain by the VM's unwind tables, each with
//! its read budget, their return addresses written into the sample's frame slots, and the
//! chain's end as the sample log carries it. The binary's sampler gives the guest memory (read
//! through the guest's page tables, `bin/hvprof/profiler/sampler.rs`) and the user walk's
//! frame-pointer fallback; the rest is here and tested on the host.

use super::costs::BudgetUse;
use core::mem::MaybeUninit;
use hvprof_linux_walk::cfi::EntryCache;
use hvprof_linux_walk::orc::OrcCache;
use hvprof_linux_walk::{
    Budget, GuestMemory, KernelEnd, KernelRegs, OrcLayout, Stop, UnwindTable, UserEnd, UserStart,
};
use hvprof_samplelog::{Chain, ChainEnd};

/// Reads at most this many guest words and table slots per kernel walk.
pub const KERNEL_WALK_READS: u32 = 640;

/// Reads at most this many guest words per user walk by unwind tables.
pub const USER_WALK_READS: u32 = 160;

/// Runs `walk` with a read budget of `reads.limit` and a sink that writes each return address
/// into the next of `out`'s first `max` slots (false once they are full); records the reads it
/// took in `reads` (`stopped`: the walk's end says the budget stopped it). Returns the slots
/// written and the walk's end.
#[inline(always)]
fn budgeted<E>(
    reads: &BudgetUse,
    max: usize,
    out: &mut [MaybeUninit<u64>],
    walk: impl FnOnce(&mut Budget, &mut dyn FnMut(u64) -> bool) -> E,
    stopped: impl FnOnce(&E) -> bool,
) -> (usize, E) {
    let max = max.min(out.len());
    let mut n = 0;
    let mut budget = Budget::new(reads.limit);
    let end = walk(&mut budget, &mut |ip| {
        if n == max {
            return false;
        }
        out[n].write(ip);
        n += 1;
        n < max
    });
    reads.record(budget.left(), stopped(&end));
    (n, end)
}

/// Where a kernel walk ended, with the frames it wrote: complete, cut, or in user mode's
/// `pt_regs` (then the user's registers, for [`after_kernel`]).
pub struct KernelFrames {
    pub written: usize,
    pub end: KernelEnd,
}

/// A kernel chain by the ORC tables `tables` from `start` (the interrupted kernel code): its
/// return addresses written to the start of `out`, at most `max` (and `out`'s length) of them,
/// the walk's reads counted in `reads`, whose limit is its budget ([`KERNEL_WALK_READS`] in the
/// hypervisor; a walk stopped there ends as a bad frame).
#[inline(always)]
pub fn kernel_frames<M: GuestMemory + ?Sized, C: OrcCache>(
    mem: &M,
    tables: &OrcLayout,
    cache: &C,
    start: KernelRegs,
    reads: &BudgetUse,
    max: usize,
    out: &mut [MaybeUninit<u64>],
) -> KernelFrames {
    let (written, end) = budgeted(
        reads,
        max,
        out,
        |budget, sink| hvprof_linux_walk::unwind_kernel(mem, tables, cache, start, budget, sink),
        |end| matches!(end, KernelEnd::Bad(Stop::Budget)),
    );
    KernelFrames { written, end }
}

/// The chain of a kernel walk that wrote `k.written` of `out`'s first `max` slots: where it
/// ended in user mode, the user's RIP next and then its callers, which `user` walks from
/// (ip, sp, bp) into the slots it is given and returns with the count it wrote. Returns the
/// chain (its depth is the slots written in all).
#[inline(always)]
pub fn after_kernel(
    k: KernelFrames,
    max: usize,
    out: &mut [MaybeUninit<u64>],
    user: impl FnOnce((u64, u64, u64), &mut [MaybeUninit<u64>]) -> (Chain, usize),
) -> Chain {
    let max = max.min(out.len());
    let mut n = k.written;
    let end = match k.end {
        KernelEnd::Complete => ChainEnd::Complete,
        KernelEnd::Full => ChainEnd::DepthLimit,
        KernelEnd::Bad(_) => ChainEnd::BadFrame,
        KernelEnd::User(_) if n >= max => ChainEnd::DepthLimit,
        KernelEnd::User(u) => {
            out[n].write(u.ip);
            n += 1;
            match u.bp {
                Some(bp) if n < max => {
                    let (chain, written) = user((u.ip, u.sp, bp), &mut out[n..max]);
                    n += written;
                    chain.end()
                }
                Some(_) => ChainEnd::DepthLimit,
                None => ChainEnd::BadFrame,
            }
        }
    };
    Chain::new(n, end)
}

/// A user chain by the unwind tables `tables` from `start`: its return addresses written to the
/// start of `out` (at most `max` and its length), the walk's reads counted in `reads`, whose limit
/// is its budget ([`USER_WALK_READS`] in the hypervisor; a walk stopped there ends as a bad frame). Returns the chain and the slots written.
#[inline(always)]
pub fn user_frames<M: GuestMemory + ?Sized, C: EntryCache>(
    mem: &M,
    tables: &[UnwindTable<'_>],
    cache: &C,
    start: UserStart,
    reads: &BudgetUse,
    max: usize,
    out: &mut [MaybeUninit<u64>],
) -> (Chain, usize) {
    let (n, end) = budgeted(
        reads,
        max,
        out,
        |budget, sink| hvprof_linux_walk::unwind_user(mem, tables, cache, start, budget, sink),
        |end| matches!(end, UserEnd::Bad(Stop::Budget)),
    );
    let end = match end {
        UserEnd::Complete => ChainEnd::Complete,
        UserEnd::Full => ChainEnd::DepthLimit,
        UserEnd::Bad(_) => ChainEnd::BadFrame,
    };
    (Chain::new(n, end), n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::sync::atomic::Ordering;
    use hvprof_linux_walk::model::Memory;

    /// The kernel alias and the tables of a small kernel whose every entry is a call frame
    /// (CFA = SP + 16, return address at CFA - 8, saved RBP at CFA - 16), covering
    /// `[TEXT, TEXT + 4 * SLOTS)` through `.init.text` (searched whole).
    const TEXT: u64 = 0xffff_ffff_8100_0000;
    const IP_TABLE: u64 = 0xffff_ffff_8200_0000;
    const ENTRIES: u64 = 0xffff_ffff_8300_0000;
    const STACK: u64 = 0xffff_c900_0000_0000;
    const SLOTS: u32 = 64;

    fn layout(slots: u32) -> OrcLayout {
        OrcLayout::parse(&format!(
            "{:#x}:{:#x}:{:#x}:{TEXT:#x}:{:#x}:{IP_TABLE:#x}:{ENTRIES:#x}:{slots}:{:#x}:2",
            TEXT + 0x10,
            TEXT + 0x100_0000,
            TEXT + 0x100_0100,
            TEXT + 0x100_0000,
            TEXT + 0x200_0000,
        ))
        .expect("a valid layout")
    }

    /// Tables of `slots` call-frame entries, slot i covering TEXT + 4 i; `end_at`: that slot's
    /// entry ends the stack (a kernel thread's outermost frame).
    fn tables(m: &mut Memory, slots: u32, end_at: Option<u32>) {
        for i in 0..slots {
            let slot = IP_TABLE + 4 * u64::from(i);
            let ip = TEXT + 4 * u64::from(i);
            m.put_u32(slot, (ip.wrapping_sub(slot)) as u32);
            let entry = if Some(i) == end_at {
                [0, 0, 0, 0, 0, 4] // sp_reg undefined, end
            } else {
                [16, 0, 0xf0, 0xff, 0x15, 0]
            };
            m.put(ENTRIES + 6 * u64::from(i), &entry);
        }
    }

    /// A stack of call frames returning to slot `rets[k]`'s IP (+1, as a return address is).
    fn stack(m: &mut Memory, rets: &[u32]) {
        for (k, &r) in rets.iter().enumerate() {
            let frame = STACK + 16 * k as u64;
            m.put_u64(frame, frame);
            m.put_u64(frame + 8, TEXT + 4 * u64::from(r) + 1);
        }
    }

    fn start() -> KernelRegs {
        KernelRegs {
            ip: TEXT + 4 * 3,
            sp: STACK,
            bp: 0,
        }
    }

    fn written(out: &[MaybeUninit<u64>], n: usize) -> Vec<u64> {
        // SAFETY: the first `n` slots were written by the walk under test.
        out[..n]
            .iter()
            .map(|s| unsafe { s.assume_init() })
            .collect()
    }

    fn no_user(_: (u64, u64, u64), _: &mut [MaybeUninit<u64>]) -> (Chain, usize) {
        panic!("no user walk expected")
    }

    #[test]
    fn a_kernel_thread_chain_is_complete_and_its_reads_counted() {
        let mut m = Memory::default();
        tables(&mut m, SLOTS, Some(9));
        stack(&mut m, &[5, 7, 9]);
        let reads = BudgetUse::new(KERNEL_WALK_READS);
        let mut out = [MaybeUninit::uninit(); 32];
        let k = kernel_frames(&m, &layout(SLOTS), &(), start(), &reads, 16, &mut out);
        let n = k.written;
        let chain = after_kernel(k, 16, &mut out, no_user);
        assert_eq!(chain.end(), ChainEnd::Complete);
        assert_eq!(
            written(&out, n),
            vec![TEXT + 21, TEXT + 29, TEXT + 37],
            "the return addresses of the three frames"
        );
        assert_eq!(chain.depth(), 3);
        let most = reads.most.load(Ordering::Relaxed);
        assert!(most > 0 && most < KERNEL_WALK_READS, "{most} reads");
        assert_eq!(reads.stopped.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_chain_is_cut_at_the_depth_asked_for() {
        let mut m = Memory::default();
        tables(&mut m, SLOTS, None);
        stack(&mut m, &[5; 40]);
        let reads = BudgetUse::new(KERNEL_WALK_READS);
        let mut out = [MaybeUninit::uninit(); 32];
        let k = kernel_frames(&m, &layout(SLOTS), &(), start(), &reads, 4, &mut out);
        assert_eq!(k.written, 4);
        let chain = after_kernel(k, 4, &mut out, no_user);
        assert_eq!((chain.depth(), chain.end()), (4, ChainEnd::DepthLimit));
    }

    /// A kernel of 2^20 slots, its tables made up as they are read (every slot with the same
    /// relative offset and entry, as the `orcattack` guest lays them out), and a stack of
    /// call frames.
    struct HugeTables {
        stack: Memory,
    }

    impl GuestMemory for HugeTables {
        fn read(&self, addr: u64, out: &mut [u8]) -> bool {
            let slots = 1u64 << 20;
            for (i, b) in out.iter_mut().enumerate() {
                let a = addr + i as u64;
                *b = if (IP_TABLE..IP_TABLE + 4 * slots).contains(&a) {
                    // Slot j covers TEXT + 4 j: its offset is TEXT - IP_TABLE in every slot.
                    TEXT.wrapping_sub(IP_TABLE).to_le_bytes()[((a - IP_TABLE) % 4) as usize]
                } else if (ENTRIES..ENTRIES + 6 * slots).contains(&a) {
                    [16, 0, 0xf0, 0xff, 0x15, 0][((a - ENTRIES) % 6) as usize]
                } else {
                    let mut one = [0u8];
                    if !self.stack.read(a, &mut one) {
                        return false;
                    }
                    one[0]
                };
            }
            true
        }
    }

    #[test]
    fn a_walk_that_would_read_too_much_stops_at_its_budget_as_a_bad_frame() {
        // Each frame's search reads 20 slots, 23 reads a frame in all: 32 frames would take
        // 736 reads (the bochs-attack-walk-budget guest's tables).
        let slots = 1 << 20;
        let mut m = HugeTables {
            stack: Memory::default(),
        };
        let rets: Vec<u32> = (0..40u32).map(|k| (k * 7919 + 11) % slots).collect();
        stack(&mut m.stack, &rets);
        let reads = BudgetUse::new(KERNEL_WALK_READS);
        let mut out = [MaybeUninit::uninit(); 32];
        let k = kernel_frames(&m, &layout(slots), &(), start(), &reads, 32, &mut out);
        let depth = k.written;
        let chain = after_kernel(k, 32, &mut out, no_user);
        assert_eq!(chain.end(), ChainEnd::BadFrame);
        assert!(
            (20..32).contains(&depth),
            "cut before the depth limit: {depth} frames"
        );
        assert_eq!(
            written(&out, 2),
            vec![TEXT + 4 * 11 + 1, TEXT + 4 * (7919 + 11) + 1],
            "each frame's return address, found through the searched slot"
        );
        assert_eq!(reads.most.load(Ordering::Relaxed), KERNEL_WALK_READS);
        assert_eq!(reads.stopped.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_chain_into_user_mode_goes_on_with_the_users_callers() {
        let k = KernelFrames {
            written: 2,
            end: KernelEnd::User(hvprof_linux_walk::UserRegs {
                ip: 0x40_1000,
                sp: 0x7ff0_0000,
                bp: Some(0x7ff0_0100),
            }),
        };
        let mut out = [MaybeUninit::new(1); 8];
        let chain = after_kernel(k, 6, &mut out, |(ip, sp, bp), rest| {
            assert_eq!((ip, sp, bp), (0x40_1000, 0x7ff0_0000, 0x7ff0_0100));
            assert_eq!(rest.len(), 3, "the slots left below the depth");
            rest[0].write(0x40_2000);
            rest[1].write(0x40_3000);
            (Chain::new(2, ChainEnd::Complete), 2)
        });
        assert_eq!((chain.depth(), chain.end()), (5, ChainEnd::Complete));
        assert_eq!(written(&out, 5)[2..], [0x40_1000, 0x40_2000, 0x40_3000]);
    }

    #[test]
    fn user_mode_reached_at_the_depth_limit_or_without_a_frame_pointer_ends_there() {
        let user = |bp| KernelFrames {
            written: 3,
            end: KernelEnd::User(hvprof_linux_walk::UserRegs {
                ip: 0x40_1000,
                sp: 0x7ff0_0000,
                bp,
            }),
        };
        let mut out = [MaybeUninit::new(1); 8];
        let full = after_kernel(user(Some(1)), 3, &mut out, no_user);
        assert_eq!((full.depth(), full.end()), (3, ChainEnd::DepthLimit));
        let last = after_kernel(user(Some(1)), 4, &mut out, no_user);
        assert_eq!((last.depth(), last.end()), (4, ChainEnd::DepthLimit));
        let no_bp = after_kernel(user(None), 8, &mut out, no_user);
        assert_eq!((no_bp.depth(), no_bp.end()), (4, ChainEnd::BadFrame));
    }
}
