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

/// Follows the chain while its frame records lie whole on `page` (at `base`), from the record at
/// `fp` (on it, climbing and aligned), writing return addresses from `out[*n]` on. Returns the
/// last record read and the next frame pointer, which lies elsewhere (or is 0, misaligned or does
/// not climb, or `out` is full: the caller judges it), or how the chain ended.
#[inline(always)]
fn on_page<M: FrameMemory>(
    mem: &M,
    page: M::Page,
    base: u64,
    mut fp: u64,
    out: &mut [MaybeUninit<u64>],
    n: &mut usize,
) -> Result<(u64, u64), ChainEnd> {
    let mut next = fp;
    for slot in out.iter_mut().skip(*n) {
        let offset = fp - base;
        next = mem.word(page, offset);
        let ret = mem.word(page, offset + 8);
        if ret == 0 {
            return Err(ChainEnd::Complete);
        }
        slot.write(ret);
        *n += 1;
        // On to the caller's record if it is on this page too (and below its last word),
        // climbs and is aligned; anything else goes back to the caller's checks.
        // (`(offset + 8) & !0xff8 == 0`: `offset` a multiple of 8 from -8 to 0xff0; -8 and 0
        // lie at or below `fp`, which is on this page, so the climb check refuses them; -8
        // could only climb from page 0, which `walk` never reads.)
        let offset = next.wrapping_sub(base);
        if next <= fp || offset.wrapping_add(8) & !0xff8 != 0 {
            return Ok((fp, next));
        }
        fp = next;
    }
    // `out` is full.
    Ok((fp, next))
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

    #[test]
    fn halves() {
        assert_eq!(half_of(0x7fff_ffff_e000), LOWER_HALF);
        assert_eq!(half_of(0xffff_c900_0001_0000), UPPER_HALF);
    }
}
