//! Call chains of user code built without frame pointers, by unwind tables the host derives
//! from the program's own `.eh_frame`.
//!
//! Compilers keep no frame record in optimized code (`-fomit-frame-pointer` is GCC's default at
//! `-O2` on x86-64): RBP is a general register there, and a frame-pointer walk skips or invents
//! callers. What every such program does keep is its call-frame information (`.eh_frame`, the
//! DWARF CFI that C++ exceptions and debuggers use): for every instruction, how to find the
//! caller's stack pointer (the CFA: RSP or RBP plus an offset), the return address (just below
//! the CFA) and the caller's RBP. Interpreting DWARF CFI in the hypervisor at every sample would
//! cost too much and trust too much; instead `linux-guest` evaluates it on the host, once, into
//! a table with the shape of the kernel's ORC tables (sorted IPs, one [`OrcEntry`] each, a lookup
//! block per 256 bytes of text), which the hypervisor receives as a boot module (`unwind=`).
//!
//! A table belongs to one build of one program: it names the bytes of the program's GNU build
//! id and where they are loaded, and a walk uses it only in a process whose memory holds those
//! bytes there (a static, non-PIE program is loaded at its link addresses). A frame outside
//! every table (the vDSO, code without CFI) is stepped by its frame pointer, as before.
//!
//! The table is the host's, checked whole when the hypervisor parses it (`UnwindTable::parse`);
//! the stack is the guest's and hostile: every read goes through [`GuestMemory`] and a
//! [`Budget`], the stack must climb by at most [`MAX_FRAME_SPAN`] per frame, and a bad step ends
//! the walk with the frames found before it.
//!
//! The file, little-endian:
//! ```text
//!  0  magic "HVUNWND" and version 1                         8 bytes
//!  8  id_addr: where the build id's bytes are loaded         u64
//! 16  id_len: 1 to 20                                        u32
//! 20  count: entries                                         u32
//! 24  id: the build id, zero-padded                          20 bytes
//! 44  blocks: lookup blocks                                  u32
//! 48  start: the lowest IP covered (the first entry's)       u64
//! 56  end: the first IP past the table                       u64
//! 64  ips: count x u32, each entry's IP - start, ascending
//!     entries: count x 6 bytes (`OrcEntry`)
//!     lookup: (blocks + 1) x u32: for block b (IPs start + 256 b ..), the index of the entry
//!             that covers its first byte; the last is count - 1
//! ```
//! Entry kinds: `sp_reg` SP or BP with `kind::CALL` (a frame: CFA = reg + `sp_offset`, return
//! address at CFA - 8, the caller's RBP at CFA + `bp_offset` where `bp_reg` is PREV_SP, else
//! unchanged); `sp_reg` UNDEFINED with `end` (the outermost frame, `_start`: the chain is whole);
//! `sp_reg` UNDEFINED without `end` (no rule here: the frame pointer steps instead).

use crate::orc::{OrcEntry, kind, reg};
use crate::{Budget, GuestMemory, Stop, read, read_u64};

/// The file's first 8 bytes: "HVUNWND" and the format's version.
pub const MAGIC: [u8; 8] = *b"HVUNWND\x01";
/// Bytes before the IPs.
pub const HEADER: usize = 64;
/// Longest build id kept (GNU's SHA-1 ids are 20 bytes).
pub const MAX_ID: usize = 20;
/// One lookup block per this many bytes of text (`1 << LOOKUP_BLOCK_ORDER`).
pub const LOOKUP_BLOCK_ORDER: u32 = 8;
/// The most entries a table may have.
pub const MAX_ENTRIES: u32 = 1 << 22;
/// Farthest apart the stack pointers of two consecutive frames may be.
pub const MAX_FRAME_SPAN: u64 = 1 << 20;
/// The user half of the address space: every frame of a user chain lies below it.
pub const USER_END: u64 = 0x0000_8000_0000_0000;
/// A table covers code below 16 TiB (static programs are linked near 4 MiB), so a cache can
/// tell its entries from another table's and from the kernel's by the bits above
/// (`EntryCache`).
pub const TABLE_END: u64 = 1 << 44;

/// The entry for code without a rule (`end` false: its frame pointer steps instead) or for the
/// outermost frame (`end` true: the chain is whole); see the module's "Entry kinds".
#[must_use]
pub const fn no_rule(end: bool) -> OrcEntry {
    OrcEntry {
        sp_offset: 0,
        bp_offset: 0,
        sp_reg: reg::UNDEFINED,
        bp_reg: reg::UNDEFINED,
        kind: kind::CALL,
        end,
    }
}

/// Why a table file was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableError {
    /// Not an unwind table of this version (its first 8 bytes).
    Magic,
    /// Shorter than its header and its counts say.
    Truncated,
    /// A count or length out of range, or IPs not ascending, or a range that wraps.
    Malformed(&'static str),
}

impl core::fmt::Display for TableError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            TableError::Magic => write!(
                f,
                "not an unwind table of this version (made by `hvprof-analyze unwind-table`)"
            ),
            TableError::Truncated => write!(f, "truncated: shorter than its counts say"),
            TableError::Malformed(why) => write!(f, "malformed: {why}"),
        }
    }
}

/// A parsed table: views into the file's bytes, checked whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnwindTable<'a> {
    /// Where the program's build id is loaded, and its bytes.
    pub id_addr: u64,
    id: [u8; MAX_ID],
    id_len: usize,
    /// `[start, end)`: the IPs the table covers.
    pub start: u64,
    pub end: u64,
    /// Each entry's IP - `start`, then the entries, then the lookup blocks, as the file has
    /// them (little-endian).
    ips: &'a [[u8; 4]],
    entries: &'a [[u8; 6]],
    lookup: &'a [[u8; 4]],
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

impl<'a> UnwindTable<'a> {
    /// Checks a table file whole: its header, that its parts fit, that its IPs ascend inside
    /// `[start, end)`, that its lookup blocks cover that range with ascending indices.
    pub fn parse(b: &'a [u8]) -> Result<UnwindTable<'a>, TableError> {
        if b.len() < 8 || b[..8] != MAGIC {
            return Err(TableError::Magic);
        }
        if b.len() < HEADER {
            return Err(TableError::Truncated);
        }
        let id_addr = u64_at(b, 8);
        let id_len = u32_at(b, 16) as usize;
        let count = u32_at(b, 20);
        let blocks = u32_at(b, 44);
        let start = u64_at(b, 48);
        let end = u64_at(b, 56);
        if id_len == 0 || id_len > MAX_ID {
            return Err(TableError::Malformed("build id length not 1 to 20"));
        }
        if count == 0 || count > MAX_ENTRIES {
            return Err(TableError::Malformed("entry count not 1 to 4 Mi"));
        }
        if start >= end || end > USER_END || id_addr.checked_add(id_len as u64).is_none() {
            return Err(TableError::Malformed(
                "range empty or outside the user half",
            ));
        }
        let span = end - start;
        if span > u64::from(u32::MAX) {
            return Err(TableError::Malformed("range wider than 4 GiB"));
        }
        let want_blocks = span.div_ceil(1 << LOOKUP_BLOCK_ORDER);
        if u64::from(blocks) != want_blocks {
            return Err(TableError::Malformed(
                "lookup blocks do not cover the range",
            ));
        }
        let count = count as usize;
        let ips_len = count * 4;
        let entries_len = count * 6;
        let lookup_len = (blocks as usize + 1) * 4;
        let total = HEADER + ips_len + entries_len + lookup_len;
        if b.len() < total {
            return Err(TableError::Truncated);
        }
        if b.len() > total {
            return Err(TableError::Malformed("bytes after the lookup blocks"));
        }
        let ips = b[HEADER..HEADER + ips_len].as_chunks().0;
        let entries = b[HEADER + ips_len..HEADER + ips_len + entries_len]
            .as_chunks()
            .0;
        let lookup = b[HEADER + ips_len + entries_len..total].as_chunks().0;
        let mut id = [0u8; MAX_ID];
        id[..id_len].copy_from_slice(&b[24..24 + id_len]);
        let t = UnwindTable {
            id_addr,
            id,
            id_len,
            start,
            end,
            ips,
            entries,
            lookup,
        };
        if t.ip(0) != 0 {
            return Err(TableError::Malformed("the first entry is not at the start"));
        }
        for i in 1..count {
            if t.ip(i) <= t.ip(i - 1) || u64::from(t.ip(i)) >= span {
                return Err(TableError::Malformed("IPs not ascending inside the range"));
            }
        }
        for k in 0..=blocks as usize {
            let i = t.block(k);
            if i >= count || (k > 0 && i < t.block(k - 1)) {
                return Err(TableError::Malformed("lookup block index out of order"));
            }
        }
        Ok(t)
    }

    /// The build id the table was made for.
    #[must_use]
    pub fn id(&self) -> &[u8] {
        &self.id[..self.id_len]
    }

    /// Entries.
    #[must_use]
    pub fn len(&self) -> usize {
        self.ips.len()
    }

    /// Never: a parsed table has at least one entry.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.ips.is_empty()
    }

    #[inline(always)]
    fn ip(&self, i: usize) -> u32 {
        u32::from_le_bytes(self.ips[i])
    }

    /// The first entry of lookup block `k`.
    #[inline(always)]
    fn block(&self, k: usize) -> usize {
        u32::from_le_bytes(self.lookup[k]) as usize
    }

    /// Entry `i`.
    #[must_use]
    pub fn entry(&self, i: usize) -> OrcEntry {
        OrcEntry::from_bytes(self.entries[i])
    }

    /// Whether `ip` lies in the range the table covers.
    #[must_use]
    pub fn covers(&self, ip: u64) -> bool {
        ip >= self.start && ip < self.end
    }

    /// The entry that covers `ip` (the last at or below it), `None` outside the range. A lookup
    /// block narrows the search to the entries of 256 bytes of text.
    #[must_use]
    pub fn find(&self, ip: u64) -> Option<OrcEntry> {
        if !self.covers(ip) {
            return None;
        }
        let off = ip - self.start;
        // The range is at most 4 GiB wide (checked by `parse`).
        let off32 = u32::try_from(off).ok()?;
        let block = usize::try_from(off >> LOOKUP_BLOCK_ORDER).ok()?;
        let mut lo = self.block(block);
        // The entry covering the next block's first byte is the last candidate.
        let mut hi = self.block(block + 1);
        // Rightmost entry in [lo, hi] whose IP is at or below `off`.
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.ip(mid) <= off32 {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        Some(self.entry(lo))
    }

    /// Whether the process whose memory `mem` reads runs this table's program: its build id's
    /// bytes at `id_addr`.
    pub fn matches<M: GuestMemory + ?Sized>(&self, mem: &M, budget: &mut Budget) -> bool {
        // A word at a time (the id is 20 bytes: two words and a half-word, or bytes at the end).
        let mut at = 0;
        while at < self.id_len {
            let addr = self.id_addr + at as u64;
            let want = &self.id[at..self.id_len];
            let same = if want.len() >= 8 {
                read_u64(mem, budget, addr).is_ok_and(|w| w.to_le_bytes() == want[..8])
            } else {
                let mut got = [0u8; 8];
                let got = &mut got[..want.len()];
                read(mem, budget, addr, got).is_ok() && got == want
            };
            if !same {
                return false;
            }
            at += want.len().min(8);
        }
        true
    }
}

/// The size of the file for `count` entries over `[start, end)`.
#[must_use]
pub fn encoded_len(count: usize, start: u64, end: u64) -> usize {
    let blocks = end.saturating_sub(start).div_ceil(1 << LOOKUP_BLOCK_ORDER);
    let blocks = usize::try_from(blocks).unwrap_or(usize::MAX / 8);
    HEADER + count * 10 + (blocks + 1) * 4
}

/// Writes a table file into `out` (`encoded_len` bytes): the program's build id `id` loaded at
/// `id_addr`, and `rows` (IP, entry), ascending, the first at `start`, all below `end`.
/// Returns the bytes written; the result always passes `UnwindTable::parse` (it is checked).
pub fn encode(
    id_addr: u64,
    id: &[u8],
    start: u64,
    end: u64,
    rows: &[(u64, OrcEntry)],
    out: &mut [u8],
) -> Result<usize, TableError> {
    if id.is_empty() || id.len() > MAX_ID {
        return Err(TableError::Malformed("build id length not 1 to 20"));
    }
    if rows.is_empty() || rows.len() > MAX_ENTRIES as usize || start >= end {
        return Err(TableError::Malformed(
            "no entries, too many, or an empty range",
        ));
    }
    let count = rows.len();
    let len = encoded_len(count, start, end);
    if out.len() < len {
        return Err(TableError::Truncated);
    }
    let span = end - start;
    let blocks = u32::try_from(span.div_ceil(1 << LOOKUP_BLOCK_ORDER))
        .map_err(|_| TableError::Malformed("range too wide"))?;
    let small = |n: usize| u32::try_from(n).map_err(|_| TableError::Malformed("too long"));
    let out = &mut out[..len];
    out.fill(0);
    out[..8].copy_from_slice(&MAGIC);
    out[8..16].copy_from_slice(&id_addr.to_le_bytes());
    out[16..20].copy_from_slice(&small(id.len())?.to_le_bytes());
    out[20..24].copy_from_slice(&small(count)?.to_le_bytes());
    out[24..24 + id.len()].copy_from_slice(id);
    out[44..48].copy_from_slice(&blocks.to_le_bytes());
    out[48..56].copy_from_slice(&start.to_le_bytes());
    out[56..64].copy_from_slice(&end.to_le_bytes());
    let (ips, rest) = out[HEADER..].split_at_mut(count * 4);
    let (entries, lookup) = rest.split_at_mut(count * 6);
    for (i, (ip, e)) in rows.iter().enumerate() {
        let off = ip
            .checked_sub(start)
            .and_then(|o| u32::try_from(o).ok())
            .ok_or(TableError::Malformed("an entry outside the range"))?;
        ips[4 * i..4 * i + 4].copy_from_slice(&off.to_le_bytes());
        entries[6 * i..6 * i + 6].copy_from_slice(&e.to_bytes());
    }
    // Block b's first byte is covered by the last entry at or below it.
    let mut i = 0;
    for (b, slot) in lookup.chunks_exact_mut(4).enumerate() {
        let first = start
            .saturating_add((b as u64) << LOOKUP_BLOCK_ORDER)
            .min(end - 1);
        while i + 1 < count && rows[i + 1].0 <= first {
            i += 1;
        }
        slot.copy_from_slice(&small(i)?.to_le_bytes());
    }
    UnwindTable::parse(out)?;
    Ok(len)
}

/// Where a user chain starts: the interrupted (or sampled) user code's registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UserStart {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
}

/// How a user unwind ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UserEnd {
    /// At the outermost frame (a table's end entry, or a zero return address or frame pointer).
    Complete,
    /// The sink took no more.
    Full,
    /// A step failed: the frames before it stand.
    Bad(Stop),
}

/// Entries found before, by table (its index in the walk's list) and IP: a walk's frames repeat
/// from sample to sample, and a cache hit is cheaper than a search (the hypervisor keeps one per
/// pCPU, shared with the kernel's ORC entries).
pub trait EntryCache {
    fn get(&self, table: usize, ip: u64) -> Option<OrcEntry>;
    fn put(&self, table: usize, ip: u64, entry: OrcEntry);
}

/// No cache.
impl EntryCache for () {
    fn get(&self, _: usize, _: u64) -> Option<OrcEntry> {
        None
    }
    fn put(&self, _: usize, _: u64, _: OrcEntry) {}
}

/// Which of the tables a walk may use: checked against the process once each, at the first
/// frame inside its range.
struct Chosen {
    /// Bit i: table i checked; bit 8 + i: it matched.
    bits: u16,
}

/// The most tables one walk considers.
pub const MAX_TABLES: usize = 8;

impl Chosen {
    fn table<'t, M: GuestMemory + ?Sized>(
        &mut self,
        tables: &'t [UnwindTable<'t>],
        mem: &M,
        budget: &mut Budget,
        ip: u64,
    ) -> Option<(usize, &'t UnwindTable<'t>)> {
        for (i, t) in tables.iter().enumerate().take(MAX_TABLES) {
            if !t.covers(ip) {
                continue;
            }
            if self.bits & (1 << i) == 0 {
                self.bits |= 1 << i;
                if t.matches(mem, budget) {
                    self.bits |= 1 << (8 + i);
                }
            }
            if self.bits & (1 << (8 + i)) != 0 {
                return Some((i, t));
            }
        }
        None
    }
}

/// Unwinds a user stack from `start`, giving each caller's return address (innermost first) to
/// `sink`, which returns `false` when it takes no more. `start.ip` itself is not given (it is the
/// sample's RIP). Each frame is stepped by the first of `tables` that covers its IP and whose
/// program the process runs, else by its frame pointer.
pub fn unwind_user<M: GuestMemory + ?Sized, C: EntryCache + ?Sized>(
    mem: &M,
    tables: &[UnwindTable<'_>],
    cache: &C,
    start: UserStart,
    budget: &mut Budget,
    sink: &mut dyn FnMut(u64) -> bool,
) -> UserEnd {
    let (mut ip, mut sp, mut bp) = (start.ip, start.sp, start.bp);
    let mut chosen = Chosen { bits: 0 };
    // The first IP is where the code was stopped; the others are return addresses, which may
    // lie just past a call that never returns (the next function's first byte): look them up
    // one byte back, inside the call.
    let mut exact = true;
    loop {
        let at = if exact { ip } else { ip.wrapping_sub(1) };
        let entry =
            chosen
                .table(tables, mem, budget, at)
                .and_then(|(i, t)| match cache.get(i, at) {
                    Some(e) => Some(e),
                    None => {
                        let e = t.find(at)?;
                        cache.put(i, at, e);
                        Some(e)
                    }
                });
        let next = match entry {
            Some(e) if e.sp_reg == reg::UNDEFINED && e.end => return UserEnd::Complete,
            Some(e) if e.kind == kind::CALL && (e.sp_reg == reg::SP || e.sp_reg == reg::BP) => {
                cfi_step(mem, budget, e, sp, bp)
            }
            // No rule for this IP (or one the table cannot express): its frame pointer.
            _ => fp_step(mem, budget, sp, bp),
        };
        let (ret, next_sp, next_bp) = match next {
            Ok(Some(n)) => n,
            Ok(None) => return UserEnd::Complete,
            Err(s) => return UserEnd::Bad(s),
        };
        if ret == 0 {
            return UserEnd::Complete;
        }
        if ret >= USER_END {
            return UserEnd::Bad(Stop::Malformed);
        }
        if !sink(ret) {
            return UserEnd::Full;
        }
        (ip, sp, bp) = (ret, next_sp, next_bp);
        exact = false;
    }
}

/// The stack must climb, by at most `MAX_FRAME_SPAN`, and stay in the user half.
fn climbs(sp: u64, next: u64) -> Result<(), Stop> {
    if next > sp && next - sp <= MAX_FRAME_SPAN && next < USER_END {
        Ok(())
    } else {
        Err(Stop::Malformed)
    }
}

/// One frame by its table entry: the return address, the caller's RSP (the CFA) and RBP.
#[allow(clippy::type_complexity)]
fn cfi_step<M: GuestMemory + ?Sized>(
    mem: &M,
    budget: &mut Budget,
    e: OrcEntry,
    sp: u64,
    bp: u64,
) -> Result<Option<(u64, u64, u64)>, Stop> {
    let base = if e.sp_reg == reg::SP { sp } else { bp };
    let cfa = base
        .checked_add_signed(i64::from(e.sp_offset))
        .ok_or(Stop::Malformed)?;
    climbs(sp, cfa)?;
    let ret = read_u64(mem, budget, cfa - 8)?;
    let next_bp = if e.bp_reg == reg::PREV_SP {
        let at = cfa
            .checked_add_signed(i64::from(e.bp_offset))
            .ok_or(Stop::Malformed)?;
        read_u64(mem, budget, at)?
    } else {
        bp
    };
    Ok(Some((ret, cfa, next_bp)))
}

/// One frame by its frame pointer: `[bp]` is the caller's RBP, `[bp + 8]` the return address;
/// the caller's RSP is `bp + 16`. `None` where RBP is 0 (the outermost frame).
#[allow(clippy::type_complexity)]
fn fp_step<M: GuestMemory + ?Sized>(
    mem: &M,
    budget: &mut Budget,
    sp: u64,
    bp: u64,
) -> Result<Option<(u64, u64, u64)>, Stop> {
    if bp == 0 {
        return Ok(None);
    }
    // The record lies in the stack at or above RSP (RSP is the record itself right after
    // `push rbp`).
    if !bp.is_multiple_of(8) || bp < sp {
        return Err(Stop::Malformed);
    }
    let next_sp = bp.checked_add(16).ok_or(Stop::Malformed)?;
    climbs(sp, next_sp)?;
    let next_bp = read_u64(mem, budget, bp)?;
    let ret = read_u64(mem, budget, bp + 8)?;
    Ok(Some((ret, next_sp, next_bp)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Memory;
    use proptest::prelude::*;

    const TEXT: u64 = 0x40_1000;
    const ID_AT: u64 = 0x40_0280;
    const ID: [u8; 20] = [7; 20];
    const STACK: u64 = 0x7fff_0000_0000;

    /// A frame whose CFA is RSP + `off` (no frame pointer; RBP unchanged).
    fn sp(off: i16) -> OrcEntry {
        OrcEntry {
            sp_offset: off,
            bp_offset: 0,
            sp_reg: reg::SP,
            bp_reg: reg::UNDEFINED,
            kind: kind::CALL,
            end: false,
        }
    }

    /// A frame whose CFA is RBP + 16, the caller's RBP saved at CFA - 16 (a frame record).
    fn bp() -> OrcEntry {
        OrcEntry {
            sp_offset: 16,
            bp_offset: -16,
            sp_reg: reg::BP,
            bp_reg: reg::PREV_SP,
            kind: kind::CALL,
            end: false,
        }
    }

    fn table_bytes(rows: &[(u64, OrcEntry)], end: u64) -> Vec<u8> {
        let mut out = vec![0u8; encoded_len(rows.len(), rows[0].0, end)];
        let n = encode(ID_AT, &ID, rows[0].0, end, rows, &mut out).unwrap();
        assert_eq!(n, out.len());
        out
    }

    /// The program: `leaf` at TEXT (CFA = RSP + 24), `mid` at TEXT + 0x100 (RBP-based with a
    /// saved RBP), a gap at TEXT + 0x200 (no rule: frame pointers), `_start` at TEXT + 0x300
    /// (the end), up to TEXT + 0x400.
    fn program() -> Vec<u8> {
        table_bytes(
            &[
                (TEXT, sp(24)),
                (TEXT + 0x100, bp()),
                (TEXT + 0x200, no_rule(false)),
                (TEXT + 0x300, no_rule(true)),
            ],
            TEXT + 0x400,
        )
    }

    fn walk(mem: &Memory, tables: &[UnwindTable<'_>], start: UserStart) -> (Vec<u64>, UserEnd) {
        let mut out = Vec::new();
        let mut budget = Budget::new(64);
        let end = unwind_user(mem, tables, &(), start, &mut budget, &mut |ip| {
            out.push(ip);
            out.len() < 16
        });
        (out, end)
    }

    /// leaf (sampled at TEXT + 0x10, RSP = STACK) <- mid <- fp_func (in the gap, frame
    /// record) <- _start.
    fn stack() -> (Memory, UserStart) {
        let mut m = Memory::default();
        m.put(ID_AT, &ID);
        // leaf: CFA = STACK + 24; return into mid at CFA - 8.
        m.put_u64(STACK + 16, TEXT + 0x150);
        // mid: RBP = STACK + 0x40: [RBP] the caller's RBP, [RBP + 8] the return into the gap.
        m.put_u64(STACK + 0x40, STACK + 0x80);
        m.put_u64(STACK + 0x48, TEXT + 0x250);
        // fp_func's record at STACK + 0x80: returns into _start, whose RBP is 0.
        m.put_u64(STACK + 0x80, 0);
        m.put_u64(STACK + 0x88, TEXT + 0x310);
        (
            m,
            UserStart {
                ip: TEXT + 0x10,
                sp: STACK,
                bp: STACK + 0x40,
            },
        )
    }

    #[test]
    fn tables_then_frame_pointers_to_the_end() {
        let bytes = program();
        let t = UnwindTable::parse(&bytes).unwrap();
        let (m, start) = stack();
        let (chain, end) = walk(&m, &[t], start);
        assert_eq!(chain, vec![TEXT + 0x150, TEXT + 0x250, TEXT + 0x310]);
        assert_eq!(end, UserEnd::Complete);
    }

    #[test]
    fn another_programs_table_is_not_used() {
        let bytes = program();
        let t = UnwindTable::parse(&bytes).unwrap();
        let (mut m, start) = stack();
        m.put(ID_AT, &[8; 20]);
        // By frame pointers alone, leaf's caller (mid) is skipped: its record is mid's.
        let (chain, _) = walk(&m, &[t], start);
        assert_eq!(chain, vec![TEXT + 0x250, TEXT + 0x310]);
        // And an unreadable build id is no match either.
        m.bytes.retain(|&a, _| !(ID_AT..ID_AT + 20).contains(&a));
        let (chain, _) = walk(&m, &[t], start);
        assert_eq!(chain, vec![TEXT + 0x250, TEXT + 0x310]);
    }

    #[test]
    fn a_return_address_is_looked_up_inside_its_call() {
        // mid's call is its last instruction: the return address is the gap's first byte, but
        // the frame is mid's (looked up one byte back).
        let bytes = program();
        let t = UnwindTable::parse(&bytes).unwrap();
        let (mut m, start) = stack();
        m.put_u64(STACK + 16, TEXT + 0x200);
        let (chain, end) = walk(&m, &[t], start);
        assert_eq!(chain, vec![TEXT + 0x200, TEXT + 0x250, TEXT + 0x310]);
        assert_eq!(end, UserEnd::Complete);
    }

    #[test]
    fn hostile_stacks_end_as_bad_frames() {
        let bytes = program();
        let t = UnwindTable::parse(&bytes).unwrap();
        // A frame pointer that points down (a loop).
        let (mut m, start) = stack();
        m.put_u64(STACK + 0x80, STACK + 0x40);
        m.put_u64(STACK + 0x88, TEXT + 0x250);
        let (chain, end) = walk(&m, &[t], start);
        assert_eq!(chain.len(), 3);
        assert_eq!(end, UserEnd::Bad(Stop::Malformed));
        // An unreadable return address.
        let (mut m, start) = stack();
        m.bytes
            .retain(|&a, _| !(STACK + 16..STACK + 24).contains(&a));
        assert_eq!(
            walk(&m, &[t], start),
            (vec![], UserEnd::Bad(Stop::Unreadable { addr: STACK + 16 }))
        );
        // A return address into the kernel half.
        let (mut m, start) = stack();
        m.put_u64(STACK + 16, 0xffff_8000_0000_0000);
        assert_eq!(walk(&m, &[t], start).1, UserEnd::Bad(Stop::Malformed));
        // A CFA that does not climb (an entry with a negative offset).
        let neg = table_bytes(&[(TEXT, sp(-8))], TEXT + 0x100);
        let t = UnwindTable::parse(&neg).unwrap();
        let (m, start) = stack();
        assert_eq!(
            walk(&m, &[t], start),
            (vec![], UserEnd::Bad(Stop::Malformed))
        );
    }

    #[test]
    fn a_cache_gives_the_same_chain() {
        use std::cell::RefCell;
        use std::collections::HashMap;
        struct Cache(RefCell<HashMap<(usize, u64), OrcEntry>>);
        impl EntryCache for Cache {
            fn get(&self, table: usize, ip: u64) -> Option<OrcEntry> {
                self.0.borrow().get(&(table, ip)).copied()
            }
            fn put(&self, table: usize, ip: u64, entry: OrcEntry) {
                self.0.borrow_mut().insert((table, ip), entry);
            }
        }
        let bytes = program();
        let t = UnwindTable::parse(&bytes).unwrap();
        let (m, start) = stack();
        let cache = Cache(RefCell::default());
        let run = || {
            let mut out = Vec::new();
            let end = unwind_user(&m, &[t], &cache, start, &mut Budget::new(64), &mut |ip| {
                out.push(ip);
                true
            });
            (out, end)
        };
        let first = run();
        // Every frame's entry was kept: leaf's, mid's, the gap's "no rule", _start's end.
        assert_eq!(cache.0.borrow().len(), 4);
        assert_eq!(run(), first);
        assert_eq!(first.0, vec![TEXT + 0x150, TEXT + 0x250, TEXT + 0x310]);
    }

    #[test]
    fn parse_refuses_what_is_not_a_whole_table() {
        let good = program();
        assert!(UnwindTable::parse(&good).is_ok());
        assert_eq!(UnwindTable::parse(&good[..7]), Err(TableError::Magic));
        assert_eq!(
            UnwindTable::parse(&good[..good.len() - 1]),
            Err(TableError::Truncated)
        );
        let mut long = good.clone();
        long.push(0);
        assert!(matches!(
            UnwindTable::parse(&long),
            Err(TableError::Malformed(_))
        ));
        let mut v2 = good.clone();
        v2[7] = 2;
        assert_eq!(UnwindTable::parse(&v2), Err(TableError::Magic));
        // IPs out of order.
        let mut swapped = good.clone();
        swapped[HEADER + 4..HEADER + 8].copy_from_slice(&0x300u32.to_le_bytes());
        assert!(matches!(
            UnwindTable::parse(&swapped),
            Err(TableError::Malformed(_))
        ));
        // A range in the kernel half.
        let mut high = good;
        high[56..64].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(UnwindTable::parse(&high).is_err());
    }

    /// Rows at ascending IPs from TEXT, each one of a few kinds.
    fn rows() -> impl Strategy<Value = Vec<(u64, OrcEntry)>> {
        prop::collection::vec((1u64..600, 0u8..4), 1..60).prop_map(|steps| {
            let mut ip = TEXT;
            steps
                .into_iter()
                .map(|(gap, k)| {
                    let e = match k {
                        0 => sp(8 * (1 + i16::from(k))),
                        1 => bp(),
                        2 => no_rule(false),
                        _ => sp(16),
                    };
                    let row = (ip, e);
                    ip += gap;
                    row
                })
                .collect()
        })
    }

    proptest! {
        #[test]
        fn find_agrees_with_a_whole_search(rows in rows(), probe in 0u64..40_000) {
            let end = rows.last().unwrap().0 + 1 + probe % 700;
            let bytes = table_bytes(&rows, end);
            let t = UnwindTable::parse(&bytes).unwrap();
            let ip = TEXT + probe;
            let want = rows.iter().rev().find(|(at, _)| *at <= ip).map(|r| r.1);
            let got = t.find(ip);
            if ip < end {
                prop_assert_eq!(got, want);
            } else {
                prop_assert_eq!(got, None);
            }
        }

        #[test]
        fn damaged_tables_are_refused_or_safe(
            at in 0usize..400,
            byte in any::<u8>(),
            cut in 0usize..400,
        ) {
            let mut b = program();
            let i = at % b.len();
            b[i] = byte;
            b.truncate(b.len() - cut % b.len().min(80));
            if let Ok(t) = UnwindTable::parse(&b) {
                // Whatever passed is usable: every lookup stays inside its slices.
                for ip in (t.start.saturating_sub(4)..t.end + 4).step_by(7) {
                    let _ = t.find(ip);
                }
            }
        }

        #[test]
        fn garbage_stacks_stay_in_budget(
            words in prop::collection::vec(any::<u64>(), 1..64),
            ip in TEXT..TEXT + 0x400,
            bp in 0u64..0x400,
        ) {
            let bytes = program();
            let t = UnwindTable::parse(&bytes).unwrap();
            let mut m = Memory::default();
            m.put(ID_AT, &ID);
            for (i, w) in words.iter().enumerate() {
                // Half the words point back into the stack or the text.
                let v = match w % 4 {
                    0 => STACK + (w >> 8) % 0x200,
                    1 => TEXT + (w >> 8) % 0x400,
                    _ => *w,
                };
                m.put_u64(STACK + 8 * i as u64, v);
            }
            let mut budget = Budget::new(40);
            let mut n = 0;
            let _ = unwind_user(&m, &[t], &(), UserStart { ip, sp: STACK, bp: STACK + bp }, &mut budget, &mut |_| {
                n += 1;
                n < 16
            });
            prop_assert!(m.reads.get() <= 40);
            prop_assert!(n <= 16);
        }
    }
}
