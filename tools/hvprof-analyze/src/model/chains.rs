//! A sample's call chains as the capture gives them, packed as one list: the key of the table
//! that numbers each distinct pair of chains once ([`ChainIds`], read back by
//! [`crate::model::samples::Samples::chain`]), and the walk of a block's frame list beside its
//! samples ([`ChainCursor`]).

use std::sync::Arc;

use rustc_hash::FxHashMap as HashMap;

use hvprof_samplelog::{Chain, ChainEnd, Sample};

/// A sample's call chains as the capture gives them: the hypervisor's frames and the guest's,
/// innermost first (return addresses; at an exit-cause sample the guest's first frame is the
/// guest RIP at the exit), and how each walk ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawChains<'a> {
    /// The hypervisor's frames.
    pub host: &'a [u64],
    /// How the hypervisor's walk ended.
    pub host_end: ChainEnd,
    /// The guest's frames.
    pub guest: &'a [u64],
    /// How the guest's walk ended.
    pub guest_end: ChainEnd,
}

/// A sample's chains packed as one list, the key of the chain table: a word with the ends and
/// the host frames' number (`host_end | guest_end << 8 | host_len << 16`), the host frames,
/// the guest frames. Clears `out` first.
fn pack_chains(s: &Sample, host: &[u64], guest: &[u64], out: &mut Vec<u64>) {
    out.clear();
    out.push(
        s.host_chain.end() as u64 | (s.guest_chain.end() as u64) << 8 | (host.len() as u64) << 16,
    );
    out.extend_from_slice(host);
    out.extend_from_slice(guest);
}

/// A packed chain (see [`pack_chains`]) read back.
pub(super) fn unpack_chains(packed: &[u64]) -> RawChains<'_> {
    let (head, frames) = packed.split_first().map_or((0, &[][..]), |(h, f)| (*h, f));
    let host_len = ((head >> 16) as usize).min(frames.len());
    RawChains {
        host: &frames[..host_len],
        host_end: ChainEnd::from_u8((head & 3) as u8),
        guest: &frames[host_len..],
        guest_end: ChainEnd::from_u8((head >> 8 & 3) as u8),
    }
}

/// Walks a block's frame list beside its samples: each sample's chains, packed.
pub(super) struct ChainCursor<'a> {
    frames: &'a [u64],
    at: usize,
}

impl<'a> ChainCursor<'a> {
    pub(super) fn new(frames: &'a [u64]) -> Self {
        ChainCursor { frames, at: 0 }
    }

    /// The next sample's chains packed in `out`; false (and nothing read) when it has none
    /// (neither chain walked, no frame).
    #[inline]
    pub(super) fn next(&mut self, s: &Sample, out: &mut Vec<u64>) -> bool {
        if !has_chains(s) {
            return false;
        }
        self.read(s, out);
        true
    }

    /// Steps over a sample's chains unread (a sample left out by `--time`).
    pub(super) fn skip(&mut self, s: &Sample) {
        self.at = self
            .at
            .saturating_add(s.host_chain.depth() + s.guest_chain.depth());
    }

    /// Reads a sample's chains (see [`ChainCursor::next`]).
    #[inline(never)]
    fn read(&mut self, s: &Sample, out: &mut Vec<u64>) {
        let mut take = |n: usize| {
            let from = self.at.min(self.frames.len());
            let to = self.at.saturating_add(n).min(self.frames.len());
            self.at = self.at.saturating_add(n);
            &self.frames[from..to]
        };
        let host = take(s.host_chain.depth());
        let guest = take(s.guest_chain.depth());
        pack_chains(s, host, guest, out);
    }
}

/// Whether a sample has call chains (either walked).
#[inline(always)]
pub(super) fn has_chains(s: &Sample) -> bool {
    s.host_chain != Chain::NOT_WALKED || s.guest_chain != Chain::NOT_WALKED
}

/// The distinct chains, numbered from 1 in the order first seen (0: a sample without chains).
#[derive(Debug, Default)]
pub(super) struct ChainIds {
    ids: HashMap<Arc<[u64]>, u32>,
    pub(super) list: Vec<Arc<[u64]>>,
}

impl ChainIds {
    pub(super) fn id(&mut self, packed: &[u64]) -> u32 {
        if let Some(&i) = self.ids.get(packed) {
            return i;
        }
        let a: Arc<[u64]> = packed.into();
        self.list.push(a.clone());
        let id = self.list.len() as u32;
        self.ids.insert(a, id);
        id
    }
}
