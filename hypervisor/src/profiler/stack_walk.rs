//! Call chains by frame pointers, for the hypervisor's own stack and a guest's. Code built with
//! frame pointers keeps, at `[rbp]`, its caller's `rbp` and, at `[rbp + 8]`, the return address
//! into its caller (System V AMD64 ABI §3.2.2, "The Stack Frame"); following `rbp` gives the
//! callers without any unwinding table.
//!
//! The walk trusts nothing it reads: every frame record must lie inside the bounds the caller
//! gives (the hypervisor's stack, or one half of a guest's address space), be 8-byte aligned, and
//! lie above the previous one by at most `MAX_FRAME_SPAN` (stacks grow down, so callers' frames
//! are higher: a loop or a jump backwards ends the walk). A read that fails (unmapped, outside
//! the VM) ends it too. Return addresses are only recorded, never read, so they are not checked
//! (one that is no code address is a frame the analyzer cannot name). The chain then says how it ended (`ChainEnd`), and keeps the frames
//! found before. Pure: a [`FrameMemory`] supplies memory, so the host tests it on a model.

use core::mem::MaybeUninit;
use hvprof_samplelog::{Chain, ChainEnd, MAX_CHAIN_DEPTH};

/// Farthest apart two consecutive frame records may be (a frame larger than this ends the walk
/// as a bad frame).
pub const MAX_FRAME_SPAN: u64 = 1 << 20;

/// Where frame records may lie: `[lo, hi)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    pub lo: u64,
    pub hi: u64,
}

/// The lower (user) half of a 48-bit canonical address space, without its first page.
pub const LOWER_HALF: Bounds = Bounds {
    lo: 0x1000,
    hi: 0x0000_8000_0000_0000,
};
/// The upper (kernel) half of a 48-bit canonical address space.
pub const UPPER_HALF: Bounds = Bounds {
    lo: 0xffff_8000_0000_0000,
    hi: u64::MAX,
};

/// The half of the address space `fp` lies in: a chain never crosses from one to the other.
pub fn half_of(fp: u64) -> Bounds {
    if fp >= UPPER_HALF.lo {
        UPPER_HALF
    } else {
        LOWER_HALF
    }
}

/// Memory a walk reads, a 4 KiB page at a time: the walk asks for the page of each frame record
/// once and reads its two words from it, so a chain that stays on one page costs one lookup.
pub trait FrameMemory {
    /// A readable page.
    type Page: Copy;
    /// The page at `page` (4 KiB aligned), or `None` where it cannot be read.
    fn page(&mut self, page: u64) -> Option<Self::Page>;
    /// The 8-byte word at byte `offset` (8-aligned, below 4096) of `page`.
    fn word(&self, page: Self::Page, offset: u64) -> u64;
}

/// Walks the frame-pointer chain from `fp`, writing return addresses (innermost first) into
/// `out` (at most `max_depth` of them, and at most `MAX_CHAIN_DEPTH`); returns the chain's shape
/// and its frames (the start of `out`: it need not be initialized, so a sample path pays for no
/// zeroing).
/// `bounds` must be whole pages (4 KiB aligned; `hi` may be `u64::MAX` for the top of the
/// address space): the bounds are checked once per page, and each frame on a page already
/// read costs only the checks that it climbs and is aligned.
#[inline(always)]
pub fn walk<'a, M: FrameMemory>(
    mem: &mut M,
    fp: u64,
    bounds: Bounds,
    max_depth: usize,
    out: &'a mut [MaybeUninit<u64>],
) -> (Chain, &'a [u64]) {
    let max = max_depth.min(MAX_CHAIN_DEPTH).min(out.len());
    let out = &mut out[..max];
    let mut fp = fp;
    // The frame record before: the first one has none (any `fp` above it climbs).
    let mut prev = fp.wrapping_sub(1);
    let mut n = 0;
    // The highest page inside the bounds.
    let top = bounds.hi.saturating_sub(0x1000) & !0xfff;
    // Never page 0 (`on_page`'s step check relies on a record's page not being it).
    let lo = bounds.lo.max(0x1000);
    let fits = |b: u64| b >= lo && b <= top && bounds.hi >= 0x1000;
    let end = loop {
        if fp == 0 {
            break ChainEnd::Complete;
        }
        if n == out.len() {
            break ChainEnd::DepthLimit;
        }
        // A new page: within the bounds, not too far up.
        let base = fp & !0xfff;
        if fp <= prev || !fp.is_multiple_of(8) || fp - prev > MAX_FRAME_SPAN || !fits(base) {
            break ChainEnd::BadFrame;
        }
        let Some(page) = mem.page(base) else {
            break ChainEnd::BadFrame;
        };
        if fp & 0xfff == 0xff8 {
            // A record across two pages: its return address is the next page's first word.
            let Some(q) = fits(base + 0x1000)
                .then(|| mem.page(base + 0x1000))
                .flatten()
            else {
                break ChainEnd::BadFrame;
            };
            let next = mem.word(page, 0xff8);
            if let Some(end) = step(mem.word(q, 0), out, &mut n) {
                break end;
            }
            prev = fp;
            fp = next;
            continue;
        }
        match on_page(mem, page, base, fp, out, &mut n) {
            Ok((p, f)) => {
                prev = p;
                fp = f;
            }
            Err(end) => break end,
        }
    };
    let frames = &out[..n];
    // SAFETY: `step` wrote each of the first `n` slots before counting it; `MaybeUninit<u64>`
    // has the layout of `u64`.
    let frames = unsafe { &*(frames as *const [MaybeUninit<u64>] as *const [u64]) };
    (Chain::new(n, end), frames)
}

/// Where, from RSP, a function keeps its return address when the instruction at its sampled RIP
/// runs before its frame record exists or after it is gone, so that `[rbp + 8]` is not its
/// caller's return address but its caller's caller's; `code` is the 4 bytes at RIP, little-endian.
/// A frame-pointer walk from such a sample would skip the caller. Frame-pointer code makes its
/// record in its first instructions (`push rbp; mov rbp, rsp`, after an `endbr64` where built
/// for CET) and drops it just before `ret` (`pop rbp` or `leave`), and the ABI keeps the return
/// address at `[rsp]` at the call (System V AMD64 ABI §3.2.2); the opcodes are those of the SDM
/// (Vol. 2: ENDBR64 F3 0F 1E FA, PUSH r64 50+rd, MOV r/m64,r64 REX.W 89 /r and MOV r64,r/m64
/// REX.W 8B /r with ModRM E5 / EC, RET C3, and C3 after a REP prefix as some compilers emit).
pub fn return_slot(code: u32) -> Option<u64> {
    match code.to_le_bytes() {
        // `push rbp` (the function's first instruction) or `endbr64` before it, `ret`, `rep ret`.
        [0x55, ..] | [0xf3, 0x0f, 0x1e, 0xfa] | [0xc3, ..] | [0xf3, 0xc3, ..] => Some(0),
        // `mov rbp, rsp`, either encoding: the caller's RBP is pushed above the return address.
        [0x48, 0x89, 0xe5, _] | [0x48, 0x8b, 0xec, _] => Some(8),
        _ => None,
    }
}

/// The 4 bytes at `rip`, little-endian (those past an unreadable page boundary read as 0, which
/// no multi-byte pattern of `return_slot` ends with); `None` where `rip`'s page is unreadable.
fn code_at<M: FrameMemory>(mem: &mut M, rip: u64) -> Option<u32> {
    let word = rip & !7;
    let shift = (rip & 7) * 8;
    let page = mem.page(word & !0xfff)?;
    let lo = mem.word(page, word & 0xfff) >> shift;
    if shift <= 32 {
        return Some(lo as u32);
    }
    let next = word.wrapping_add(8);
    let hi = if next & 0xfff != 0 {
        Some(mem.word(page, next & 0xfff))
    } else if next != 0 {
        mem.page(next).map(|p| mem.word(p, 0))
    } else {
        None
    };
    Some((lo | hi.unwrap_or(0) << (64 - shift)) as u32)
}

/// Remembers code addresses whose instruction is none of [`return_slot`]'s, so that a sample
/// there needs no look at the code (samples fall in the same hot loops over and over). A stale
/// or wrong answer costs at most the caller of a sample taken in a prologue or an epilogue,
/// which is what the walk found without the look.
pub trait OrdinaryCode {
    /// Whether the instruction at `rip` was found to be none of them.
    fn is_ordinary(&self, rip: u64) -> bool;
    /// The instruction at `rip` is none of them.
    fn remember(&self, rip: u64);
}

/// Remembers nothing: every walk looks at the code.
impl OrdinaryCode for () {
    fn is_ordinary(&self, _: u64) -> bool {
        false
    }
    fn remember(&self, _: u64) {}
}

/// Like [`walk`], for a sample taken at `rip` with stack pointer `rsp` (read only where needed)
/// and frame pointer `fp`: where the instruction at `rip` runs before the sampled function's
/// frame record exists or after it is gone ([`return_slot`]), its return address, read from
/// the stack, comes first and the walk from `fp` (its caller's record) follows; elsewhere this
/// is `walk`. The stack word must lie inside `bounds`, and the code page be readable, or the
/// chain is `walk`'s. `known` spares the look at code found ordinary before.
#[inline(always)]
pub fn walk_from<'a, M: FrameMemory>(
    mem: &mut M,
    (rip, rsp, fp): (u64, impl FnOnce() -> u64, u64),
    bounds: Bounds,
    max_depth: usize,
    out: &'a mut [MaybeUninit<u64>],
    known: &impl OrdinaryCode,
) -> (Chain, &'a [u64]) {
    let max = max_depth.min(MAX_CHAIN_DEPTH).min(out.len());
    let slot = if max > 0 && !known.is_ordinary(rip) {
        let slot = code_at(mem, rip).map(return_slot);
        if slot == Some(None) {
            known.remember(rip);
        }
        slot.flatten()
    } else {
        None
    };
    let ret = slot.and_then(|slot| {
        let at = rsp().checked_add(slot)?;
        let inside = at >= bounds.lo && at < bounds.hi && bounds.hi - at >= 8;
        if !inside || !at.is_multiple_of(8) {
            return None;
        }
        let page = mem.page(at & !0xfff)?;
        Some(mem.word(page, at & 0xfff)).filter(|&r| r != 0)
    });
    let Some(ret) = ret else {
        return walk(mem, fp, bounds, max, out);
    };
    let (first, rest) = out.split_at_mut(1);
    first[0].write(ret);
    let (chain, callers) = walk(mem, fp, bounds, max - 1, rest);
    let n = callers.len() + 1;
    // SAFETY: slot 0 was written above and `walk` wrote the next `callers.len()` (the start of
    // `rest`); `MaybeUninit<u64>` has the layout of `u64`.
    let frames = unsafe { &*(&out[..n] as *const [MaybeUninit<u64>] as *const [u64]) };
    (Chain::new(n, chain.end()), frames)
}

/// Follows the chain while its frame records lie whole on `page` (at `base`), from the record at
/// `fp` (on it, climbing and aligned), writing return addresses from `out[*n]` on. Returns the
/// last record read and the next frame pointer, which lies elsewhere (or is 0, misaligned or does
/// not climb, or `out` is full: the caller judges it), or how the chain ended.
#[inline(always)]
fn on_page<M: FrameMemory>(
    mem: &M,
    page: M::Page,
    base: u64,
    fp: u64,
    out: &mut [MaybeUninit<u64>],
    n: &mut usize,
) -> Result<(u64, u64), ChainEnd> {
    // The record's offset on the page and the count, in registers for the loop (written back on
    // the way out).
    let mut offset = fp - base;
    let mut next = fp;
    let mut i = *n;
    while i < out.len() {
        next = mem.word(page, offset);
        let ret = mem.word(page, offset + 8);
        if ret == 0 {
            *n = i;
            return Err(ChainEnd::Complete);
        }
        out[i].write(ret);
        i += 1;
        // On to the caller's record if it is on this page too (and below its last word),
        // climbs and is aligned; anything else goes back to the caller's checks. The climb is
        // compared as signed offsets from the page: a caller's record below the page (an offset
        // that wraps) does not climb. (`(offset + 8) & !0xff8 == 0`: `offset` a multiple of 8
        // from -8 to 0xff0; -8 lies below the record, which is on this page, so the climb check
        // refuses it.)
        let next_offset = next.wrapping_sub(base);
        if next_offset as i64 <= offset as i64 || next_offset.wrapping_add(8) & !0xff8 != 0 {
            *n = i;
            return Ok((base + offset, next));
        }
        offset = next_offset;
    }
    // `out` is full.
    *n = i;
    Ok((base + offset, next))
}

/// Takes return address `ret` as the next frame (`n < out.len()`); how the chain ends if it
/// does.
#[inline(always)]
fn step(ret: u64, out: &mut [MaybeUninit<u64>], n: &mut usize) -> Option<ChainEnd> {
    if ret == 0 {
        return Some(ChainEnd::Complete);
    }
    if let Some(slot) = out.get_mut(*n) {
        slot.write(ret);
    }
    *n += 1;
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, HashSet};

    /// Memory as a map of 8-byte words; a page is readable when it holds one of them. Records
    /// the pages asked for.
    struct Words {
        words: HashMap<u64, u64>,
        asked: Vec<u64>,
    }

    impl FrameMemory for Words {
        type Page = u64;
        fn page(&mut self, page: u64) -> Option<u64> {
            self.asked.push(page);
            self.words
                .keys()
                .any(|a| a & !0xfff == page)
                .then_some(page)
        }
        fn word(&self, page: u64, offset: u64) -> u64 {
            self.words.get(&(page + offset)).copied().unwrap_or(0)
        }
    }

    fn mem(words: &[(u64, u64)]) -> Words {
        Words {
            words: words.iter().copied().collect(),
            asked: Vec::new(),
        }
    }

    const B: Bounds = Bounds {
        lo: 0x10_0000,
        hi: 0x20_0000,
    };

    #[test]
    fn follows_a_chain_to_its_end() {
        // Three frames: 0x10_0100 -> 0x10_0200 -> 0x10_1400 -> 0 (end), over two pages.
        let mut m = mem(&[
            (0x10_0100, 0x10_0200),
            (0x10_0108, 0x40_1111),
            (0x10_0200, 0x10_1400),
            (0x10_0208, 0x40_2222),
            (0x10_1400, 0),
            (0x10_1408, 0x40_3333),
        ]);
        let mut out = [MaybeUninit::uninit(); 32];
        let (c, frames) = walk(&mut m, 0x10_0100, B, 16, &mut out);
        assert_eq!(frames.len(), c.depth());
        assert_eq!((c.depth(), c.end()), (3, ChainEnd::Complete));
        assert_eq!(frames, &[0x40_1111, 0x40_2222, 0x40_3333]);
        assert_eq!(m.asked, vec![0x10_0000, 0x10_1000], "one lookup per page");
        // Several records on each of two pages.
        let mut m = mem(&[
            (0x10_0100, 0x10_0200),
            (0x10_0108, 0x40_1111),
            (0x10_0200, 0x10_2000),
            (0x10_0208, 0x40_2222),
            (0x10_2000, 0x10_2010),
            (0x10_2008, 0x40_3333),
            (0x10_2010, 0),
            (0x10_2018, 0x40_4444),
        ]);
        let (c, frames) = walk(&mut m, 0x10_0100, B, 16, &mut out);
        assert_eq!(frames.len(), c.depth());
        assert_eq!((c.depth(), c.end()), (4, ChainEnd::Complete));
        assert_eq!(frames, &[0x40_1111, 0x40_2222, 0x40_3333, 0x40_4444]);
    }

    #[test]
    fn a_record_across_two_pages_is_read() {
        let mut m = mem(&[(0x10_0ff8, 0), (0x10_1000, 0x40_1111)]);
        let mut out = [MaybeUninit::uninit(); 32];
        let (c, frames) = walk(&mut m, 0x10_0ff8, B, 16, &mut out);
        assert_eq!(frames.len(), c.depth());
        assert_eq!((c.depth(), c.end()), (1, ChainEnd::Complete));
        assert_eq!(frames, &[0x40_1111]);
    }

    #[test]
    fn a_zero_return_address_ends_it() {
        let mut m = mem(&[(0x10_0100, 0x10_0200), (0x10_0108, 0)]);
        let (c, _) = walk(&mut m, 0x10_0100, B, 16, &mut [MaybeUninit::uninit(); 32]);
        assert_eq!((c.depth(), c.end()), (0, ChainEnd::Complete));
    }

    #[test]
    fn the_depth_limit_cuts_it() {
        // An endless but climbing chain: each record points 16 bytes up.
        let words: Vec<(u64, u64)> = (0..200u64)
            .flat_map(|i| {
                let fp = 0x10_0000 + 16 * i;
                [(fp, fp + 16), (fp + 8, 0x40_0000 + i)]
            })
            .collect();
        let mut out = [MaybeUninit::uninit(); 32];
        let (c, frames) = walk(&mut mem(&words), 0x10_0000, B, 5, &mut out);
        assert_eq!(frames.len(), c.depth());
        assert_eq!((c.depth(), c.end()), (5, ChainEnd::DepthLimit));
        let (c, frames) = walk(&mut mem(&words), 0x10_0000, B, 99, &mut out);
        assert_eq!(frames.len(), c.depth());
        assert_eq!(
            (c.depth(), c.end()),
            (MAX_CHAIN_DEPTH, ChainEnd::DepthLimit)
        );
    }

    #[test]
    fn hostile_chains_end_as_bad_frames() {
        let mut out = [MaybeUninit::uninit(); 32];
        // A loop: the frame points at itself.
        let mut m = mem(&[(0x10_0100, 0x10_0100), (0x10_0108, 0x40_1000)]);
        let (c, frames) = walk(&mut m, 0x10_0100, B, 16, &mut out);
        assert_eq!(frames.len(), c.depth());
        assert_eq!((c.depth(), c.end()), (1, ChainEnd::BadFrame));
        // Backwards.
        let mut m = mem(&[(0x10_0100, 0x10_0080), (0x10_0108, 0x40_1000)]);
        let (c, frames) = walk(&mut m, 0x10_0100, B, 16, &mut out);
        assert_eq!(frames.len(), c.depth());
        assert_eq!((c.depth(), c.end()), (1, ChainEnd::BadFrame));
        // A return address that is no address is a frame like another (it is never read;
        // the analyzer cannot name it), and the chain goes on.
        let mut m = mem(&[(0x10_0100, 0), (0x10_0108, 0x1234_5678_9abc_def0)]);
        let (c, frames) = walk(&mut m, 0x10_0100, B, 16, &mut out);
        assert_eq!(
            (frames, c.end()),
            (&[0x1234_5678_9abc_def0][..], ChainEnd::Complete)
        );
        // Out of bounds (another VM's memory, the hypervisor's): never asked for.
        let mut m = mem(&[
            (0x10_0100, 0x30_0000),
            (0x10_0108, 0x40_1000),
            (0x30_0000, 0),
        ]);
        let (c, frames) = walk(&mut m, 0x10_0100, B, 16, &mut out);
        assert_eq!(frames.len(), c.depth());
        assert_eq!((c.depth(), c.end()), (1, ChainEnd::BadFrame));
        let asked: HashSet<u64> = m.asked.iter().copied().collect();
        assert_eq!(asked, HashSet::from([0x10_0000]));
        // Misaligned, a too-large jump, an unreadable page.
        for (words, fp) in [
            (vec![], 0x10_0101),
            (
                vec![(0x10_0100, 0x1f_0000), (0x10_0108, 0x40_1000)],
                0x10_0100,
            ),
            (vec![], 0x10_0100),
        ] {
            let (c, frames) = walk(&mut mem(&words), fp, B, 16, &mut out);
            assert_eq!(frames.len(), c.depth());
            assert_eq!(c.end(), ChainEnd::BadFrame, "{words:x?} {fp:#x}");
        }
        // The top of the bounds: a frame record must fit below `hi`.
        let (c, frames) = walk(&mut mem(&[]), B.hi - 8, B, 16, &mut out);
        assert_eq!(frames.len(), c.depth());
        assert_eq!((c.depth(), c.end()), (0, ChainEnd::BadFrame));
        let (c, frames) = walk(&mut mem(&[]), u64::MAX - 7, UPPER_HALF, 16, &mut out);
        assert_eq!(frames.len(), c.depth());
        assert_eq!(c.end(), ChainEnd::BadFrame);
    }

    /// The little-endian word holding `bytes` at byte `at & 7` of the word at `at & !7` (the
    /// rest zero), and the next word's share where they run past it.
    fn code(at: u64, bytes: &[u8]) -> Vec<(u64, u64)> {
        let mut image = [0u8; 16];
        let start = (at & 7) as usize;
        image[start..start + bytes.len()].copy_from_slice(bytes);
        let word = |i: usize| u64::from_le_bytes(image[i..i + 8].try_into().unwrap());
        vec![(at & !7, word(0)), ((at & !7) + 8, word(8))]
    }

    #[test]
    fn return_slots_are_the_prologue_and_epilogue_instructions() {
        let slot = |b: [u8; 4]| return_slot(u32::from_le_bytes(b));
        assert_eq!(slot([0x55, 0x48, 0x89, 0xe5]), Some(0), "push rbp");
        assert_eq!(slot([0xf3, 0x0f, 0x1e, 0xfa]), Some(0), "endbr64");
        assert_eq!(slot([0x48, 0x89, 0xe5, 0x90]), Some(8), "mov rbp, rsp");
        assert_eq!(slot([0x48, 0x8b, 0xec, 0x90]), Some(8), "mov rbp, rsp (8B)");
        assert_eq!(slot([0xc3, 0xcc, 0xcc, 0xcc]), Some(0), "ret");
        assert_eq!(slot([0xf3, 0xc3, 0, 0]), Some(0), "rep ret");
        for other in [
            [0x41, 0x55, 0, 0],       // push r13
            [0x48, 0xff, 0xc9, 0x75], // dec rcx; jnz
            [0x5d, 0xc3, 0, 0],       // pop rbp: its record is still at rbp
            [0xc9, 0xc3, 0, 0],       // leave: likewise
            [0x48, 0x89, 0xe6, 0],    // mov rsi, rsp
        ] {
            assert_eq!(slot(other), None, "{other:x?}");
        }
    }

    #[test]
    fn a_leaf_sampled_before_its_frame_record_keeps_its_caller() {
        // The caller's record at 0x10_0100 (its own return address 0x40_1111 into the
        // caller's caller); the leaf's return address into its caller, 0x40_9999, at RSP.
        let record = [(0x10_0100, 0), (0x10_0108, 0x40_1111)];
        let stack = |at: u64| [(at, 0x40_9999)];
        let mut out = [MaybeUninit::uninit(); 32];
        for (rip, bytes, rsp, slot) in [
            (0x40_2000, &[0x55u8][..], 0x10_00f0, 0),       // push rbp
            (0x40_2006, &[0x48, 0x89, 0xe5], 0x10_00e8, 8), // mov rbp, rsp, across two words
            (0x40_2ffc, &[0xf3, 0x0f, 0x1e, 0xfa], 0x10_00f0, 0), // endbr64 at a page's end
            (0x40_2fff, &[0xc3], 0x10_00f0, 0),             // ret, the next page unmapped
        ] {
            let mut words = record.to_vec();
            words.extend(stack(rsp + slot));
            words.extend(
                code(rip, bytes)
                    .into_iter()
                    .filter(|(a, _)| a & !0xfff == rip & !0xfff),
            );
            let mut m = mem(&words);
            let (c, frames) = walk_from(&mut m, (rip, || rsp, 0x10_0100), B, 16, &mut out, &());
            assert_eq!(frames, &[0x40_9999, 0x40_1111], "{bytes:x?} at {rip:#x}");
            assert_eq!((c.depth(), c.end()), (2, ChainEnd::Complete));
            // Room for the leaf's caller only.
            let (c, frames) = walk_from(
                &mut mem(&words),
                (rip, || rsp, 0x10_0100),
                B,
                1,
                &mut out,
                &(),
            );
            assert_eq!((frames, c.end()), (&[0x40_9999][..], ChainEnd::DepthLimit));
        }
    }

    #[test]
    fn elsewhere_walk_from_is_the_frame_pointer_walk() {
        let record = [(0x10_0100, 0), (0x10_0108, 0x40_1111)];
        let mut out = [MaybeUninit::uninit(); 32];
        // (RIP, the code there, RSP, the stack words.)
        type Case<'a> = (u64, &'a [u8], u64, &'a [(u64, u64)]);
        let cases: [Case; 5] = [
            // Inside a function's body: RSP is never read.
            (0x40_2000, &[0x48, 0xff, 0xc9], 0, &[]),
            // A return slot outside the bounds, misaligned, or holding 0.
            (0x40_2000, &[0x55], 0x30_0000, &[(0x30_0000, 0x40_9999)]),
            (0x40_2000, &[0x55], 0x10_00f4, &[(0x10_00f0, 0x40_9999)]),
            (0x40_2000, &[0xc3], 0x10_00f0, &[(0x10_00f0, 0)]),
            // The code page unreadable.
            (0x50_0000, &[], 0x10_00f0, &[(0x10_00f0, 0x40_9999)]),
        ];
        for (rip, bytes, rsp, extra) in cases {
            let mut words = record.to_vec();
            words.extend_from_slice(extra);
            if !bytes.is_empty() {
                words.extend(code(rip, bytes));
            }
            let rsp = || {
                assert!(rsp != 0, "RSP read inside a function's body");
                rsp
            };
            let (c, frames) = walk_from(
                &mut mem(&words),
                (rip, rsp, 0x10_0100),
                B,
                16,
                &mut out,
                &(),
            );
            assert_eq!(
                (frames, c.end()),
                (&[0x40_1111][..], ChainEnd::Complete),
                "{bytes:x?} at {rip:#x}"
            );
        }
    }

    /// Remembers in a set.
    struct Seen(std::cell::RefCell<HashSet<u64>>);
    impl OrdinaryCode for Seen {
        fn is_ordinary(&self, rip: u64) -> bool {
            self.0.borrow().contains(&rip)
        }
        fn remember(&self, rip: u64) {
            self.0.borrow_mut().insert(rip);
        }
    }

    #[test]
    fn ordinary_code_is_looked_at_once() {
        let seen = Seen(Default::default());
        let mut words = vec![
            (0x10_0100, 0),
            (0x10_0108, 0x40_1111),
            (0x10_00f0, 0x40_9999),
        ];
        words.extend(code(0x40_2000, &[0x48, 0xff, 0xc9]));
        words.extend(code(0x40_2010, &[0x55]));
        let mut out = [MaybeUninit::uninit(); 32];
        for _ in 0..2 {
            for (rip, want) in [
                (0x40_2000, &[0x40_1111][..]),
                (0x40_2010, &[0x40_9999, 0x40_1111]),
            ] {
                let mut m = mem(&words);
                let (_, frames) = walk_from(
                    &mut m,
                    (rip, || 0x10_00f0, 0x10_0100),
                    B,
                    16,
                    &mut out,
                    &seen,
                );
                assert_eq!(frames, want, "{rip:#x}");
            }
        }
        // The loop's code is remembered, the prologue's never is.
        assert_eq!(*seen.0.borrow(), HashSet::from([0x40_2000]));
        let mut m = mem(&words);
        walk_from(&mut m, (0x40_2000, || 0, 0x10_0100), B, 16, &mut out, &seen);
        assert!(
            !m.asked.contains(&0x40_2000),
            "the code's page is not read again"
        );
    }

    proptest::proptest! {
        /// Any memory, registers and bounds: the walk ends, within its depth, with as many
        /// frames as its chain says.
        #[test]
        fn walks_never_panic(
            words in proptest::collection::vec((0u64..0x4000, proptest::num::u64::ANY), 0..64),
            base in proptest::sample::select(vec![0u64, 0x10_0000, 0xffff_ffff_ffff_c000]),
            rip in proptest::num::u64::ANY, rsp in proptest::num::u64::ANY,
            fp in proptest::num::u64::ANY, depth in 0usize..40,
        ) {
            let words: Vec<(u64, u64)> =
                words.into_iter().map(|(a, w)| (base.wrapping_add(a & !7), w)).collect();
            let near = |x: u64| if x.is_multiple_of(2) { base.wrapping_add(x % 0x4000) } else { x };
            for bounds in [B, LOWER_HALF, UPPER_HALF] {
                let mut out = [MaybeUninit::uninit(); 32];
                let (c, frames) =
                    walk_from(&mut mem(&words), (near(rip), || near(rsp), near(fp)), bounds, depth, &mut out, &());
                proptest::prop_assert_eq!(frames.len(), c.depth());
                proptest::prop_assert!(c.depth() <= depth.min(MAX_CHAIN_DEPTH));
            }
        }
    }

    #[test]
    fn halves() {
        assert_eq!(half_of(0x7fff_ffff_e000), LOWER_HALF);
        assert_eq!(half_of(0xffff_c900_0001_0000), UPPER_HALF);
    }
}
