//! The record bitstream of a block frame: per-block delta state, Rice-parameter choice, and the
//! encoder / decoder of one record. The byte-exact description is in the crate documentation.

#[cfg(feature = "std")]
use crate::bits::{BitReader, Malformed, unzigzag};
use crate::bits::{BitWriter, RICE_ESCAPE, bit_len, low_u8, zigzag};
use crate::types::{Chain, Event, MAX_CHAIN_DEPTH, Record, Sample, SampleKind};
#[cfg(feature = "std")]
use crate::types::{EventKind, OutReason};

/// Recent guest RIPs per context, the references of RIP deltas.
pub(crate) const RIP_SLOTS: usize = 16;
/// Recent CR3 values / exit reasons per context: the current one and four earlier ones.
const HISTORY: usize = 5;

pub(crate) const F_KIND: u8 = 0;
pub(crate) const F_VM: u8 = 1;
pub(crate) const F_VCPU: u8 = 2;
pub(crate) const F_VPID: u8 = 3;
pub(crate) const F_CR3: u8 = 4;
pub(crate) const F_MODE: u8 = 5;
pub(crate) const F_EXIT: u8 = 6;
pub(crate) const F_HOST_RIP: u8 = 7;

/// Most bits one record can take (a sample with every field changed and every value escaped).
pub(crate) const MAX_RECORD_BITS: usize = 512;

/// Most bits the two call chains of one sample take: per chain a bit, `u2` end, two `lp3`s of
/// at most 9 bits, and per frame at most `lp7` of 64 bits.
pub(crate) const MAX_CHAIN_BITS_PER_RECORD: usize = 2 * (1 + 2 + 9 + 9);
/// Most bits one chain frame takes.
pub(crate) const MAX_FRAME_BITS: usize = 7 + 64;

/// Bytes of the packed [`Params`].
pub(crate) const PARAMS_LEN: usize = 4;

/// The block's code parameters, packed in a little-endian u32 in the block header: bits 0..6
/// `k_tsc`, 6..12 `k_rip`, 12..18 `k_cost`, 18..24 `k_evt`, 24..26 `k_slot`, 26..32 zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Params {
    k_tsc: u32,
    k_rip: u32,
    k_cost: u32,
    k_evt: u32,
    k_slot: u32,
    /// The samples carry call chains.
    pub(crate) chains: bool,
}

impl Params {
    pub(crate) fn pack(self) -> [u8; PARAMS_LEN] {
        (self.k_tsc
            | self.k_rip << 6
            | self.k_cost << 12
            | self.k_evt << 18
            | self.k_slot << 24
            | u32::from(self.chains) << 26)
            .to_le_bytes()
    }

    #[cfg(feature = "std")]
    pub(crate) fn unpack(b: [u8; PARAMS_LEN]) -> Result<Self, Malformed> {
        let v = u32::from_le_bytes(b);
        if v >> 27 != 0 {
            return Err(Malformed);
        }
        Ok(Self {
            k_tsc: v & 63,
            k_rip: (v >> 6) & 63,
            k_cost: (v >> 12) & 63,
            k_evt: (v >> 18) & 63,
            k_slot: (v >> 24) & 3,
            chains: (v >> 26) & 1 != 0,
        })
    }
}

/// The vCPU-side fields of one context.
#[derive(Clone, Copy)]
struct Ctx {
    vm: u16,
    vcpu: u16,
    vpid: u16,
    /// Current CR3 first, then earlier distinct values, most recent first.
    cr3: [u64; HISTORY],
    /// Current guest mode, then the previous different one.
    mode: [u8; 2],
    /// Current exit reason first, then earlier distinct values.
    exit: [u16; HISTORY],
    /// Recent guest RIPs, most recently used first.
    rips: RipSlots,
}

/// The recent guest RIPs of a context, by slot (most recently used first, the wire format's
/// order): the values stay where they were written, and the order is a permutation of their
/// places, one 4-bit place per slot in a `u64`. Moving a slot to the front is then a few
/// shifts and masks, with no branch on the slot (which the data decides), instead of moving up
/// to 15 values (a `memmove` call per sample, encoding and decoding).
#[derive(Clone, Copy)]
struct RipSlots {
    values: [u64; RIP_SLOTS],
    /// Slot `i`'s place in `values` in bits `4i..4i+4`.
    order: u64,
}

const _: () = assert!(RIP_SLOTS == 16, "a slot's place is one of 16 nibbles");

impl RipSlots {
    /// Every slot 0, slot `i` at place `i`.
    const ZERO: RipSlots = RipSlots {
        values: [0; RIP_SLOTS],
        order: 0xfedc_ba98_7654_3210,
    };

    /// The value in slot `slot` (< 16).
    #[inline]
    fn get(&self, slot: usize) -> u64 {
        self.values[self.place(slot)]
    }

    #[inline]
    fn place(&self, slot: usize) -> usize {
        usize::from(low_u8((self.order >> ((slot & 15) * 4)) & 15))
    }

    /// Moves slot `slot` (< 16) to the front with the value `v`: slots before it move back by
    /// one. Slot 15 is the one that falls off when a new value comes in.
    #[inline]
    fn bring_to_front(&mut self, slot: usize, v: u64) {
        let shift = (slot & 15) * 4;
        let place = (self.order >> shift) & 15;
        let before = self.order & ((1u64 << shift) - 1);
        // The slots after it, where they are (`2 << 63` is 0: nothing after the last).
        let after = self.order & !((2u64 << (shift + 3)).wrapping_sub(1));
        self.order = after | (before << 4) | place;
        self.values[usize::from(low_u8(place))] = v;
    }
}

/// The delta state, reset at the start of every block.
#[derive(Clone, Copy)]
struct State {
    /// TSC of the previous record (sample or event).
    last_tsc: u64,
    /// TSC of the previous sample.
    last_sample_tsc: u64,
    /// Kind of the previous sample.
    kind: SampleKind,
    /// Context 0 serves guest and hypervisor samples, context 1 idle samples.
    ctx: [Ctx; 2],
    /// Last host RIP per sample kind.
    host_rip: [u64; 3],
    /// Last non-zero host RIP, any kind: the reference of host RIP deltas.
    host_ref: u64,
    /// Last cost per sample kind.
    cost: [u32; 3],
}

/// A reference call chain of the delta state.
#[derive(Clone, Copy)]
struct ChainRef {
    chain: Chain,
    frames: [u64; MAX_CHAIN_DEPTH],
}

impl ChainRef {
    const EMPTY: ChainRef = ChainRef {
        chain: Chain::NOT_WALKED,
        frames: [0; MAX_CHAIN_DEPTH],
    };

    fn frames(&self) -> &[u64] {
        &self.frames[..self.chain.depth()]
    }

    fn set(&mut self, chain: Chain, frames: &[u64]) {
        self.chain = chain;
        self.frames[..frames.len()].copy_from_slice(frames);
    }
}

/// Guest chain references kept per block (most recently used first).
const GUEST_CHAIN_KEYS: usize = 4;

/// The call-chain references, reset at every block start (only blocks with chains use them).
struct ChainState {
    /// Per sample kind.
    host: [ChainRef; 3],
    /// (kind, vm, vcpu) and its last guest chain, most recently used first.
    guest: [((u8, u16, u16), ChainRef); GUEST_CHAIN_KEYS],
    /// Entries of `guest` in use.
    guest_len: usize,
}

impl ChainState {
    fn new() -> Self {
        ChainState {
            host: [ChainRef::EMPTY; 3],
            guest: [((0, 0, 0), ChainRef::EMPTY); GUEST_CHAIN_KEYS],
            guest_len: 0,
        }
    }

    /// The guest reference of `key`, moved to the front (a new key takes the front with the
    /// empty reference, the least recently used one falls off).
    fn guest_ref(&mut self, key: (u8, u16, u16)) -> &mut ChainRef {
        let found = self.guest[..self.guest_len]
            .iter()
            .position(|(k, _)| *k == key);
        match found {
            Some(i) => self.guest[..=i].rotate_right(1),
            None => {
                self.guest_len = (self.guest_len + 1).min(GUEST_CHAIN_KEYS);
                self.guest[..self.guest_len].rotate_right(1);
                self.guest[0] = (key, ChainRef::EMPTY);
            }
        }
        &mut self.guest[0].1
    }
}

fn guest_key(s: &Sample) -> (u8, u16, u16) {
    (s.kind as u8, s.vm, s.vcpu)
}

/// Writes one chain against its reference and makes it the reference.
fn write_chain(w: &mut BitWriter<'_>, r: &mut ChainRef, chain: Chain, frames: &[u64], leaf: u64) {
    if chain == r.chain && frames == r.frames() {
        w.bit(true);
        return;
    }
    w.bit(false);
    w.put(chain.end() as u64, 2);
    w.lp(frames.len() as u64, 3);
    let old = r.frames();
    let shared = frames
        .iter()
        .rev()
        .zip(old.iter().rev())
        .take_while(|(a, b)| a == b)
        .count();
    w.lp(shared as u64, 3);
    let new = frames.len() - shared;
    let mut prev = leaf;
    for (i, &f) in frames[..new].iter().enumerate() {
        let reference = chain_ref(old, frames.len(), i, prev);
        w.lp(zigzag(f.wrapping_sub(reference) as i64), 7);
        prev = f;
    }
    r.set(chain, frames);
}

/// `ref_i` of the specification: the old chain's frame at the same distance from the outermost
/// frame as frame `i` of a chain of `depth` frames, else `prev`.
#[inline]
fn chain_ref(old: &[u64], depth: usize, i: usize, prev: u64) -> u64 {
    let from_root = depth - i;
    if from_root <= old.len() {
        old[old.len() - from_root]
    } else {
        prev
    }
}

/// Reads one chain coded against `r`, appends its frames to `out`, makes it the reference.
#[cfg(feature = "std")]
fn read_chain(
    rd: &mut BitReader<'_>,
    r: &mut ChainRef,
    leaf: u64,
    out: &mut Vec<u64>,
) -> Result<Chain, Malformed> {
    if rd.bit() {
        out.extend_from_slice(r.frames());
        return Ok(r.chain);
    }
    let end = crate::types::ChainEnd::from_u8(low_u8(rd.get(2)));
    let depth = usize::try_from(rd.lp(3, 7)?).map_err(|_| Malformed)?;
    let shared = usize::try_from(rd.lp(3, 7)?).map_err(|_| Malformed)?;
    if depth > MAX_CHAIN_DEPTH || shared > depth || shared > r.chain.depth() {
        return Err(Malformed);
    }
    let chain = Chain::new(depth, end);
    let mut frames = [0u64; MAX_CHAIN_DEPTH];
    let new = depth - shared;
    let old = r.frames();
    let mut prev = leaf;
    for (i, slot) in frames[..new].iter_mut().enumerate() {
        let reference = chain_ref(old, depth, i, prev);
        let f = reference.wrapping_add(unzigzag(rd.lp(7, 64)?) as u64);
        *slot = f;
        prev = f;
    }
    frames[new..depth].copy_from_slice(&old[old.len() - shared..]);
    out.extend_from_slice(&frames[..depth]);
    r.set(chain, &frames[..depth]);
    Ok(chain)
}

impl State {
    const ZERO: State = State {
        last_tsc: 0,
        last_sample_tsc: 0,
        kind: SampleKind::Guest,
        ctx: [Ctx {
            vm: 0,
            vcpu: 0,
            vpid: 0,
            cr3: [0; HISTORY],
            mode: [0; 2],
            exit: [0; HISTORY],
            rips: RipSlots::ZERO,
        }; 2],
        host_rip: [0; 3],
        host_ref: 0,
        cost: [0; 3],
    };
}

#[inline]
fn ctx_index(kind: SampleKind) -> usize {
    usize::from(kind == SampleKind::Idle)
}

/// Moves `v` to the front of a most-recent-first history: an existing entry at `hit` moves,
/// otherwise everything shifts down and the last entry falls off.
/// Shifted by hand: `rotate_right` is a call to a general rotation, slow for these few
/// entries. (The RIPs, which move for every sample, are [`RipSlots`].)
#[inline]
fn to_front<T: Copy, const N: usize>(list: &mut [T; N], hit: Option<usize>, v: T) {
    match hit {
        Some(i) => {
            let front = list[i];
            let mut j = i;
            while j > 0 {
                list[j] = list[j - 1];
                j -= 1;
            }
            list[0] = front;
        }
        None if N > 0 => {
            // A shift of known length: moves the compiler writes out, no call.
            list.copy_within(..N - 1, 1);
            list[0] = v;
        }
        None => {}
    }
}

/// Index `1..HISTORY` of `v` in an earlier-values history.
#[inline]
fn history_hit<T: Copy + PartialEq>(list: &[T], v: T) -> Option<usize> {
    (1..list.len()).find(|&i| list[i] == v)
}

/// How one sample is coded against the state.
struct SamplePlan {
    mask: u8,
    tsc: u64,
    slot: usize,
    /// `None` when the RIP equals the slot's exactly, else `zigzag(delta) - 1`.
    rip: Option<u64>,
    cost: u64,
}

#[inline]
fn plan_sample(st: &State, s: &Sample, period: u64) -> SamplePlan {
    let c = &st.ctx[ctx_index(s.kind)];
    let k = s.kind as usize;
    let mut mask = 0;
    let mut flag = |changed: bool, f: u8| {
        if changed {
            mask |= 1 << f;
        }
    };
    flag(s.kind != st.kind, F_KIND);
    flag(s.vm != c.vm, F_VM);
    flag(s.vcpu != c.vcpu, F_VCPU);
    flag(s.vpid != c.vpid, F_VPID);
    flag(s.guest_cr3 != c.cr3[0], F_CR3);
    flag(s.guest_mode != c.mode[0], F_MODE);
    flag(s.exit_reason != c.exit[0], F_EXIT);
    flag(s.host_rip != st.host_rip[k], F_HOST_RIP);
    let tsc = zigzag(s.tsc.wrapping_sub(st.last_sample_tsc).wrapping_sub(period) as i64);
    let mut slot = 0;
    let mut best = u64::MAX;
    for j in 0..RIP_SLOTS {
        let d = zigzag(s.guest_rip.wrapping_sub(c.rips.get(j)) as i64);
        if d < best {
            best = d;
            slot = j;
        }
    }
    let rip = if best == 0 { None } else { Some(best - 1) };
    let cost = zigzag(i64::from(s.cost) - i64::from(st.cost[k]));
    SamplePlan {
        mask,
        tsc,
        slot,
        rip,
        cost,
    }
}

#[inline]
fn apply_sample(st: &mut State, s: &Sample, slot: usize, exact: bool) {
    st.last_tsc = s.tsc;
    st.last_sample_tsc = s.tsc;
    st.kind = s.kind;
    let k = s.kind as usize;
    st.host_rip[k] = s.host_rip;
    if s.host_rip != 0 {
        st.host_ref = s.host_rip;
    }
    st.cost[k] = s.cost;
    let c = &mut st.ctx[ctx_index(s.kind)];
    c.vm = s.vm;
    c.vcpu = s.vcpu;
    c.vpid = s.vpid;
    if c.cr3[0] != s.guest_cr3 {
        let hit = history_hit(&c.cr3, s.guest_cr3);
        to_front(&mut c.cr3, hit, s.guest_cr3);
    }
    if c.mode[0] != s.guest_mode {
        c.mode = [s.guest_mode, c.mode[0]];
    }
    if c.exit[0] != s.exit_reason {
        let hit = history_hit(&c.exit, s.exit_reason);
        to_front(&mut c.exit, hit, s.exit_reason);
    }
    // An exact RIP is its slot's value; any other comes in, and the last slot falls off.
    c.rips
        .bring_to_front(if exact { slot } else { RIP_SLOTS - 1 }, s.guest_rip);
}

#[inline]
fn event_tsc(st: &State, e: &Event) -> u64 {
    zigzag(e.tsc.wrapping_sub(st.last_tsc) as i64)
}

#[inline]
fn apply_event(st: &mut State, e: &Event) {
    st.last_tsc = e.tsc;
    st.ctx[0].vm = e.vm;
    st.ctx[0].vcpu = e.vcpu;
}

/// Accumulates the exact cost of the escaped Rice code for every parameter 0..=63.
///
/// For a value of bit length `b`, parameter `k` costs `1 + k` bits when `b ≤ k`, `2 + k` when
/// `b = k + 1`, `3 + k` when `b = k + 2` and `v >> k = 2`, and `b + 8` (escape) otherwise.
struct RiceCost {
    /// Values per bit length.
    count: [u32; 65],
    /// Values with `v >> k == 2`, indexed by `k = b - 2`.
    q2: [u32; 64],
}

impl RiceCost {
    const fn new() -> Self {
        Self {
            count: [0; 65],
            q2: [0; 64],
        }
    }

    #[inline]
    fn add(&mut self, v: u64) {
        let b = bit_len(v) as usize;
        self.count[b] += 1;
        if b >= 2 && v >> (b - 2) == 2 {
            self.q2[b - 2] += 1;
        }
    }

    /// The parameter with the fewest total bits (the smallest on ties).
    fn best(&self) -> u32 {
        let esc = RICE_ESCAPE + 6 - 1;
        let count = |b: usize| u64::from(self.count.get(b).copied().unwrap_or(0));
        // Σ over b of count·(b + 8), for b > k + 2, maintained as k grows.
        let mut esc_above: u64 = (3..=64).map(|b| count(b) * (b as u64 + esc)).sum();
        let mut at_most_k = count(0);
        let mut best_k = 0u32;
        let mut best_bits = u64::MAX;
        for (k, k32) in (0..64usize).zip(0u32..) {
            if k > 0 {
                at_most_k += count(k);
                esc_above -= count(k + 2) * ((k + 2) as u64 + esc);
            }
            let k64 = k as u64;
            let q2 = u64::from(self.q2[k]);
            let bits = at_most_k * (1 + k64)
                + count(k + 1) * (2 + k64)
                + q2 * (3 + k64)
                + (count(k + 2) - q2) * ((k + 2) as u64 + esc)
                + esc_above;
            if bits < best_bits {
                best_bits = bits;
                best_k = k32;
            }
        }
        best_k
    }
}

/// Chooses the block's code parameters for `records` (each the one giving the fewest bits, the
/// smallest on ties).
pub(crate) fn choose_params(records: &[Record], period: u64) -> Params {
    let [mut tsc, mut rip, mut cost, mut evt] = [const { RiceCost::new() }; 4];
    let mut slots = [0u32; RIP_SLOTS];
    let mut st = State::ZERO;
    for r in records {
        match r {
            Record::Sample(s) => {
                let p = plan_sample(&st, s, period);
                tsc.add(p.tsc);
                if let Some(v) = p.rip {
                    rip.add(v);
                }
                slots[p.slot] += 1;
                cost.add(p.cost);
                apply_sample(&mut st, s, p.slot, p.rip.is_none());
            }
            Record::Event(e) => {
                evt.add(event_tsc(&st, e));
                apply_event(&mut st, e);
            }
        }
    }
    let slot_bits = |k: u32| -> u64 {
        (0..RIP_SLOTS)
            .zip(0u32..)
            .map(|(i, i32)| u64::from(slots[i]) * u64::from((i32 >> k) + 1 + k))
            .sum()
    };
    let chains = records
        .iter()
        .filter_map(Record::as_sample)
        .any(|s| s.host_chain != Chain::NOT_WALKED || s.guest_chain != Chain::NOT_WALKED);
    Params {
        k_tsc: tsc.best(),
        k_rip: rip.best(),
        k_cost: cost.best(),
        k_evt: evt.best(),
        k_slot: (0..4).min_by_key(|&k| (slot_bits(k), k)).unwrap_or(0),
        chains,
    }
}

fn write_history<T: Copy + PartialEq>(
    w: &mut BitWriter<'_>,
    list: &[T; HISTORY],
    v: T,
    literal: impl FnOnce(&mut BitWriter<'_>),
) {
    match history_hit(list, v) {
        Some(i) => {
            w.bit(true);
            w.put((i - 1) as u64, 2);
        }
        None => {
            w.bit(false);
            literal(w);
        }
    }
}

/// Writes the records' bitstream into `out`; the number of bytes, `None` if `out` is too small.
/// `frames`: the samples' chain frames (see [`crate::with_chains`]), used when `ks.chains`.
pub(crate) fn write_records(
    records: &[Record],
    frames: &[u64],
    period: u64,
    ks: Params,
    out: &mut [u8],
) -> Option<usize> {
    let mut w = BitWriter::new(out);
    let mut st = State::ZERO;
    let mut cs = ks.chains.then(ChainState::new);
    for (r, chains) in crate::types::with_chains(records, frames) {
        match r {
            Record::Sample(s) => {
                let p = plan_sample(&st, s, period);
                let c = &st.ctx[ctx_index(s.kind)];
                match p.mask.count_ones() {
                    0 => w.bit(false),
                    1 => {
                        w.put(0b01, 2); // '1', '0'
                        w.put(u64::from(p.mask.trailing_zeros()), 3);
                    }
                    _ => {
                        w.put(0b011, 3); // '1', '1', '0'
                        w.put(u64::from(p.mask), 8);
                    }
                }
                let has = |f: u8| p.mask & (1 << f) != 0;
                if has(F_KIND) {
                    w.put(s.kind as u64, 2);
                }
                if has(F_VM) {
                    w.lp(u64::from(s.vm), 5);
                }
                if has(F_VCPU) {
                    w.lp(u64::from(s.vcpu), 5);
                }
                if has(F_VPID) {
                    w.lp(u64::from(s.vpid), 5);
                }
                if has(F_CR3) {
                    write_history(&mut w, &c.cr3, s.guest_cr3, |w| {
                        w.lp(zigzag(s.guest_cr3.wrapping_sub(c.cr3[0]) as i64), 7);
                    });
                }
                if has(F_MODE) {
                    if s.guest_mode == c.mode[1] {
                        w.bit(true);
                    } else {
                        w.bit(false);
                        w.put(u64::from(s.guest_mode & 0xf), 4);
                        let high = s.guest_mode >> 4;
                        w.bit(high != 0);
                        if high != 0 {
                            w.put(u64::from(high), 4);
                        }
                    }
                }
                if has(F_EXIT) {
                    write_history(&mut w, &c.exit, s.exit_reason, |w| {
                        w.lp(u64::from(s.exit_reason), 5);
                    });
                }
                if has(F_HOST_RIP) {
                    w.lp(zigzag(s.host_rip.wrapping_sub(st.host_ref) as i64), 7);
                }
                w.rice(ks.k_tsc, p.tsc);
                w.small_rice(ks.k_slot, p.slot as u64);
                match p.rip {
                    None => w.bit(true),
                    Some(v) => {
                        w.bit(false);
                        w.rice(ks.k_rip, v);
                    }
                }
                w.rice(ks.k_cost, p.cost);
                if let Some(cs) = &mut cs {
                    let k = s.kind as usize;
                    write_chain(
                        &mut w,
                        &mut cs.host[k],
                        s.host_chain,
                        chains.host,
                        s.host_rip,
                    );
                    let g = cs.guest_ref(guest_key(s));
                    write_chain(&mut w, g, s.guest_chain, chains.guest, s.guest_rip);
                }
                apply_sample(&mut st, s, p.slot, p.rip.is_none());
            }
            Record::Event(e) => {
                w.put(0b111, 3);
                w.put(e.kind as u64, 1);
                if (e.vm, e.vcpu) == (st.ctx[0].vm, st.ctx[0].vcpu) {
                    w.bit(false);
                } else {
                    w.bit(true);
                    w.lp(u64::from(e.vm), 5);
                    w.lp(u64::from(e.vcpu), 5);
                }
                w.put(e.reason as u64, 2);
                w.rice(ks.k_evt, event_tsc(&st, e));
                apply_event(&mut st, e);
            }
        }
    }
    w.finish()
}

/// Decodes `count` records from the bitstream at the start of `data`, appending them to `out`
/// and their chain frames to `frames`. Returns the number of bytes the bitstream occupies
/// (`ceil(bits / 8)`).
#[cfg(feature = "std")]
pub(crate) fn read_records(
    data: &[u8],
    count: usize,
    period: u64,
    ks: Params,
    out: &mut Vec<Record>,
    frames: &mut Vec<u64>,
) -> Result<usize, Malformed> {
    let mut r = BitReader::new(data);
    let mut st = State::ZERO;
    let mut cs = ks.chains.then(ChainState::new);
    out.reserve(count);
    for _ in 0..count {
        // Once per record, so that a common sample's fields (some 40 bits) find their bits
        // buffered: a refill when a field runs short depends on the data and is mispredicted
        // often (about 3 % of `report`'s time on 10 M samples).
        r.refill();
        let mask = if !r.bit() {
            Some(0)
        } else if !r.bit() {
            Some(1u8 << r.get(3))
        } else if !r.bit() {
            Some(low_u8(r.get(8)))
        } else {
            None
        };
        match mask {
            Some(mask) => {
                let mut s = read_sample(&mut r, &mut st, mask, period, ks)?;
                if let Some(cs) = &mut cs {
                    let k = s.kind as usize;
                    s.host_chain = read_chain(&mut r, &mut cs.host[k], s.host_rip, frames)?;
                    let g = cs.guest_ref(guest_key(&s));
                    s.guest_chain = read_chain(&mut r, g, s.guest_rip, frames)?;
                }
                out.push(Record::Sample(s));
            }
            None => {
                let kind = if r.bit() {
                    EventKind::VcpuOut
                } else {
                    EventKind::VcpuIn
                };
                let (vm, vcpu) = if r.bit() {
                    (lp16(&mut r)?, lp16(&mut r)?)
                } else {
                    (st.ctx[0].vm, st.ctx[0].vcpu)
                };
                let reason = OutReason::from_u8(low_u8(r.get(2))).ok_or(Malformed)?;
                let tsc = st.last_tsc.wrapping_add(unzigzag(r.rice(ks.k_evt)?) as u64);
                let e = Event {
                    tsc,
                    kind,
                    vm,
                    vcpu,
                    reason,
                };
                apply_event(&mut st, &e);
                out.push(Record::Event(e));
            }
        }
        if r.overrun() {
            return Err(Malformed);
        }
    }
    Ok(r.consumed_bits().div_ceil(8))
}

#[cfg(feature = "std")]
#[inline]
fn lp16(r: &mut BitReader<'_>) -> Result<u16, Malformed> {
    u16::try_from(r.lp(5, 16)?).map_err(|_| Malformed)
}

#[cfg(feature = "std")]
#[inline]
fn read_history<T: Copy>(
    r: &mut BitReader<'_>,
    list: &[T; HISTORY],
    literal: impl FnOnce(&mut BitReader<'_>) -> Result<T, Malformed>,
) -> Result<T, Malformed> {
    if r.bit() {
        Ok(list[1 + usize::from(low_u8(r.get(2)))])
    } else {
        literal(r)
    }
}

#[cfg(feature = "std")]
#[inline]
fn read_sample(
    r: &mut BitReader<'_>,
    st: &mut State,
    mask: u8,
    period: u64,
    ks: Params,
) -> Result<Sample, Malformed> {
    let has = |f: u8| mask & (1 << f) != 0;
    let kind = if has(F_KIND) {
        SampleKind::from_u8(low_u8(r.get(2))).ok_or(Malformed)?
    } else {
        st.kind
    };
    let k = kind as usize;
    let c = &st.ctx[ctx_index(kind)];
    let mut s = Sample {
        tsc: 0,
        kind,
        vm: c.vm,
        vcpu: c.vcpu,
        vpid: c.vpid,
        guest_rip: 0,
        guest_cr3: c.cr3[0],
        guest_mode: c.mode[0],
        exit_reason: c.exit[0],
        host_rip: st.host_rip[k],
        cost: 0,
        host_chain: Chain::NOT_WALKED,
        guest_chain: Chain::NOT_WALKED,
    };
    if mask & !(1 << F_KIND) != 0 {
        if has(F_VM) {
            s.vm = lp16(r)?;
        }
        if has(F_VCPU) {
            s.vcpu = lp16(r)?;
        }
        if has(F_VPID) {
            s.vpid = lp16(r)?;
        }
        if has(F_CR3) {
            s.guest_cr3 = read_history(r, &c.cr3, |r| {
                Ok(c.cr3[0].wrapping_add(unzigzag(r.lp(7, 64)?) as u64))
            })?;
        }
        if has(F_MODE) {
            s.guest_mode = if r.bit() {
                c.mode[1]
            } else {
                let low = low_u8(r.get(4));
                let high = if r.bit() { low_u8(r.get(4)) } else { 0 };
                low | (high << 4)
            };
        }
        if has(F_EXIT) {
            s.exit_reason = read_history(r, &c.exit, lp16)?;
        }
        if has(F_HOST_RIP) {
            s.host_rip = st.host_ref.wrapping_add(unzigzag(r.lp(7, 64)?) as u64);
        }
    }
    s.tsc = st
        .last_sample_tsc
        .wrapping_add(period)
        .wrapping_add(unzigzag(r.rice(ks.k_tsc)?) as u64);
    // The slot's quotient is at most 15 >> k_slot.
    let slot = usize::from(low_u8(r.small_rice(ks.k_slot, (15 >> ks.k_slot) + 1)?));
    let base = c.rips.get(slot);
    let exact = r.bit();
    // Whether the RIP is exact depends on the data: its delta is read, or not, without a branch.
    let v = r.rice_if(!exact, ks.k_rip)?.wrapping_add(1);
    if !exact && v == 0 {
        return Err(Malformed);
    }
    s.guest_rip =
        core::hint::select_unpredictable(exact, base, base.wrapping_add(unzigzag(v) as u64));
    let cost = i64::from(st.cost[k]).wrapping_add(unzigzag(r.rice(ks.k_cost)?));
    s.cost = u32::try_from(cost).map_err(|_| Malformed)?;
    apply_sample(st, &s, slot, exact);
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bits::rice_bits;
    use proptest::prelude::*;

    proptest! {
        /// The slots as a permutation read, after any moves, as the list the format defines
        /// (moved entry by entry, as `to_front` does for the other histories).
        #[test]
        fn rip_slots_are_the_most_recent_first_list(
            moves in prop::collection::vec((0usize..RIP_SLOTS, any::<bool>(), any::<u64>()), 0..200)
        ) {
            let mut slots = RipSlots::ZERO;
            let mut list = [0u64; RIP_SLOTS];
            for (slot, exact, v) in moves {
                let v = if exact { list[slot] } else { v };
                slots.bring_to_front(if exact { slot } else { RIP_SLOTS - 1 }, v);
                to_front(&mut list, exact.then_some(slot), v);
                let seen: Vec<u64> = (0..RIP_SLOTS).map(|i| slots.get(i)).collect();
                prop_assert_eq!(&seen[..], &list[..]);
            }
        }
    }

    #[test]
    fn rice_cost_picks_the_exact_optimum() {
        let sets: [&[u64]; 7] = [
            &[0, 0, 0, 1],
            &[100, 200, 300, 150, 90, 5000],
            &[u64::MAX, 1 << 40, 3],
            &[7; 10],
            &[1 << 20, (1 << 20) + 5, 1 << 22, 12, 1 << 63],
            &[2, 3, 2, 3, 5, 6, 8, 11, 12],
            &[u64::MAX; 3],
        ];
        for set in sets {
            let mut c = RiceCost::new();
            for &v in set {
                c.add(v);
            }
            let bits = |k: u32| set.iter().map(|&v| u64::from(rice_bits(k, v))).sum::<u64>();
            let brute = (0..64u32).min_by_key(|&k| (bits(k), k)).unwrap();
            assert_eq!(c.best(), brute, "{set:?}");
        }
    }
}
