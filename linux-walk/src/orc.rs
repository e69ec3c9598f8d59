//! A Linux guest's kernel call chain, unwound with the kernel's own ORC tables.
//!
//! Debian's kernels are built with `CONFIG_UNWINDER_ORC`, not frame pointers: objtool writes,
//! for every instruction range of the kernel's text, how to find the caller's stack pointer
//! (the CFA: a register plus an offset), where the return address is (just below the CFA) and
//! where the caller's RBP was saved. The tables sit in the image (`.orc_unwind_ip`: sorted
//! 32-bit offsets, each relative to its own slot; `.orc_unwind`: one 6-byte entry per slot;
//! `.orc_lookup`: per 256 bytes of `.text`, the first slot that covers them, filled in at boot by
//! `unwind_init`). This reads them from the guest's memory at the addresses the host found in the
//! image (`OrcLayout`, passed as `task-offsets=` is), moved by the KASLR slide that the guest's
//! IA32_LSTAR gives, and follows Linux 6.1's `arch/x86/kernel/unwind_orc.c` (`orc_find`,
//! `unwind_next_frame`) and `arch/x86/include/asm/orc_types.h` (the entry's layout).
//!
//! The unwind crosses interrupt, exception and system-call frames (`pt_regs`): where the
//! interrupted code was in user mode it stops and hands the user's RIP, RSP and RBP back, so the
//! caller goes on into the user stack by frame pointers.
//!
//! Guest memory is hostile: every read can fail and every value can be garbage. A walk is
//! bounded by a [`Budget`] of reads and by its sink's depth; the stack must climb from frame to
//! frame except where the tables say it switches (an indirect CFA, a `pt_regs` frame), and it
//! may switch only [`MAX_STACK_SWITCHES`] times. What was found before the first bad step is
//! kept and the walk says how it ended.

use crate::{Budget, GuestMemory, KERNEL_HALF, Stop, read, read_u32, read_u64};

/// Where a kernel's ORC tables are, at link time (the slide is added at run time), and the
/// `.text` range its lookup table covers. Derived on the host from the kernel image by
/// `linux-guest`; the hypervisor's `orc-layout=` argument.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct OrcLayout {
    /// The link-time address of `entry_SYSCALL_64`: with the guest's IA32_LSTAR it gives the
    /// KASLR slide.
    pub entry_syscall_64: u64,
    /// `_stext` and `_etext`: the text `.orc_lookup` covers (`LOOKUP_START_IP`,
    /// `LOOKUP_STOP_IP`).
    pub stext: u64,
    /// See `stext`.
    pub etext: u64,
    /// `_sinittext` and `_einittext`: the boot-time text, which `orc_find` searches the whole
    /// table for (it is freed once the kernel has booted).
    pub sinittext: u64,
    /// See `sinittext`.
    pub einittext: u64,
    /// `.orc_unwind_ip`'s address.
    pub ip_table: u64,
    /// `.orc_unwind`'s address.
    pub entries: u64,
    /// Slots in both tables.
    pub count: u32,
    /// `.orc_lookup`'s address, and its length in 32-bit slots.
    pub lookup: u64,
    /// See `lookup`.
    pub lookup_blocks: u32,
}

/// `LOOKUP_BLOCK_ORDER`: one `.orc_lookup` slot per 256 bytes of text.
const LOOKUP_BLOCK_ORDER: u32 = 8;

/// The most tables a `OrcLayout` may describe (Debian's 6.1 kernel has about 370 000 slots).
pub const MAX_SLOTS: u32 = 1 << 24;

impl OrcLayout {
    /// The compact form:
    /// `entry:stext:etext:sinittext:einittext:ip_table:entries:count:lookup:lookup_blocks`,
    /// addresses in 0x-hex, counts in decimal. `None` if malformed or implausible.
    #[must_use]
    pub fn parse(s: &str) -> Option<OrcLayout> {
        let mut it = s.split(':');
        let hex = |v: Option<&str>| u64::from_str_radix(v?.strip_prefix("0x")?, 16).ok();
        let dec = |v: Option<&str>| v?.parse::<u32>().ok();
        let l = OrcLayout {
            entry_syscall_64: hex(it.next())?,
            stext: hex(it.next())?,
            etext: hex(it.next())?,
            sinittext: hex(it.next())?,
            einittext: hex(it.next())?,
            ip_table: hex(it.next())?,
            entries: hex(it.next())?,
            count: dec(it.next())?,
            lookup: hex(it.next())?,
            lookup_blocks: dec(it.next())?,
        };
        let kernel = l.addresses().iter().all(|&a| a >= KERNEL_HALF);
        (it.next().is_none()
            && kernel
            && l.stext < l.etext
            && l.sinittext <= l.einittext
            && (1..=MAX_SLOTS).contains(&l.count)
            && l.lookup_blocks >= 2
            && l.ip_table.is_multiple_of(4)
            && l.lookup.is_multiple_of(4))
        .then_some(l)
    }

    /// Its addresses, in the order of the compact form (the counts left out).
    #[must_use]
    pub fn addresses(&self) -> [u64; 8] {
        [
            self.entry_syscall_64,
            self.stext,
            self.etext,
            self.sinittext,
            self.einittext,
            self.ip_table,
            self.entries,
            self.lookup,
        ]
    }

    /// The layout of `addresses` (in the order `addresses` gives them) and the two counts.
    #[must_use]
    pub fn from_addresses(a: [u64; 8], count: u32, lookup_blocks: u32) -> OrcLayout {
        let [
            entry_syscall_64,
            stext,
            etext,
            sinittext,
            einittext,
            ip_table,
            entries,
            lookup,
        ] = a;
        OrcLayout {
            entry_syscall_64,
            stext,
            etext,
            sinittext,
            einittext,
            ip_table,
            entries,
            count,
            lookup,
            lookup_blocks,
        }
    }

    /// The layout as a kernel whose IA32_LSTAR is `lstar` has it: every address moved by the
    /// KASLR slide (so `entry_syscall_64` is `lstar`); `None` before the kernel has set it (0)
    /// or if it is no kernel address.
    #[must_use]
    pub fn at(&self, lstar: u64) -> Option<OrcLayout> {
        if lstar < KERNEL_HALF {
            return None;
        }
        let slide = lstar.wrapping_sub(self.entry_syscall_64);
        // KASLR moves the kernel by whole pages (2 MiB, `CONFIG_PHYSICAL_ALIGN`).
        if !slide.is_multiple_of(4096) {
            return None;
        }
        Some(OrcLayout::from_addresses(
            self.addresses().map(|a| a.wrapping_add(slide)),
            self.count,
            self.lookup_blocks,
        ))
    }
}

impl core::fmt::Display for OrcLayout {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "{:#x}:{:#x}:{:#x}:{:#x}:{:#x}:{:#x}:{:#x}:{}:{:#x}:{}",
            self.entry_syscall_64,
            self.stext,
            self.etext,
            self.sinittext,
            self.einittext,
            self.ip_table,
            self.entries,
            self.count,
            self.lookup,
            self.lookup_blocks
        )
    }
}

/// The register an entry's CFA or saved RBP is found from (`ORC_REG_*`).
pub mod reg {
    pub const UNDEFINED: u8 = 0;
    pub const PREV_SP: u8 = 1;
    pub const DX: u8 = 2;
    pub const DI: u8 = 3;
    pub const BP: u8 = 4;
    pub const SP: u8 = 5;
    pub const R10: u8 = 6;
    pub const R13: u8 = 7;
    pub const BP_INDIRECT: u8 = 8;
    pub const SP_INDIRECT: u8 = 9;
}

/// What an entry's CFA holds (`ORC_TYPE_*`, Linux 6.1: two bits).
pub mod kind {
    /// A return address just below the CFA.
    pub const CALL: u8 = 0;
    /// A whole `pt_regs` at the CFA.
    pub const REGS: u8 = 1;
    /// An IRET frame (RIP, CS, RFLAGS, RSP, SS) at the CFA.
    pub const REGS_PARTIAL: u8 = 2;
}

/// One `struct orc_entry` (6 bytes, packed; Linux 6.1: `s16 sp_offset; s16 bp_offset;
/// unsigned sp_reg:4, bp_reg:4, type:2, end:1`, little-endian bit fields from bit 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OrcEntry {
    pub sp_offset: i16,
    pub bp_offset: i16,
    pub sp_reg: u8,
    pub bp_reg: u8,
    pub kind: u8,
    /// With `sp_reg` undefined: the stack's outermost frame (a kernel thread's).
    pub end: bool,
}

impl OrcEntry {
    /// Decodes an entry's 6 bytes.
    #[must_use]
    pub fn from_bytes(b: [u8; 6]) -> OrcEntry {
        OrcEntry {
            sp_offset: i16::from_le_bytes([b[0], b[1]]),
            bp_offset: i16::from_le_bytes([b[2], b[3]]),
            sp_reg: b[4] & 0xf,
            bp_reg: b[4] >> 4,
            kind: b[5] & 3,
            end: b[5] & 4 != 0,
        }
    }

    /// The same 6 bytes (for a cache that keeps entries in a word).
    #[must_use]
    pub fn to_bytes(self) -> [u8; 6] {
        let [a, b] = self.sp_offset.to_le_bytes();
        let [c, d] = self.bp_offset.to_le_bytes();
        [
            a,
            b,
            c,
            d,
            (self.sp_reg & 0xf) | (self.bp_reg << 4),
            (self.kind & 3) | (u8::from(self.end) << 2),
        ]
    }

    /// Linux's entry for IP 0 (a call through a null function pointer): the return address is
    /// on top of the stack.
    const NULL: OrcEntry = OrcEntry {
        sp_offset: 8,
        bp_offset: 0,
        sp_reg: reg::SP,
        bp_reg: reg::UNDEFINED,
        kind: kind::CALL,
        end: false,
    };
}

/// Entries found before, by the IP they were looked up for (the hypervisor keeps one per
/// pCPU; the kernel's text does not change, so an entry stays right while the tables do).
pub trait OrcCache {
    fn get(&self, ip: u64) -> Option<OrcEntry>;
    fn put(&self, ip: u64, entry: OrcEntry);
}

/// No cache.
impl OrcCache for () {
    fn get(&self, _: u64) -> Option<OrcEntry> {
        None
    }
    fn put(&self, _: u64, _: OrcEntry) {}
}

/// The entry that covers `ip` (`orc_find` for the kernel's own text; IPs in modules or outside
/// the kernel have none): through `.orc_lookup`, then a binary search of the slots it gives for
/// the rightmost one at or below `ip`; for `.init.text`, a search of the whole table.
pub fn find<M: GuestMemory + ?Sized>(
    mem: &M,
    t: &OrcLayout,
    ip: u64,
    budget: &mut Budget,
) -> Result<Option<OrcEntry>, Stop> {
    if ip == 0 {
        return Ok(Some(OrcEntry::NULL));
    }
    if (t.sinittext..t.einittext).contains(&ip) {
        return search(mem, t, ip, 0, t.count, budget);
    }
    if ip < t.stext || ip >= t.etext {
        return Ok(None);
    }
    let idx = (ip - t.stext) >> LOOKUP_BLOCK_ORDER;
    if idx + 1 >= u64::from(t.lookup_blocks) {
        return Ok(None);
    }
    let start = read_u32(mem, budget, t.lookup + 4 * idx)?;
    let stop = read_u32(mem, budget, t.lookup + 4 * (idx + 1))?.saturating_add(1);
    if start >= t.count || stop > t.count || start >= stop {
        // Before `unwind_init` the lookup table is zeros (start == stop - 1 == 0 finds slot 0,
        // which does not cover `ip`: caught below); afterwards this is garbage.
        return Err(Stop::Malformed);
    }
    search(mem, t, ip, start, stop, budget)
}

/// The entry of the rightmost slot in `[start, stop)` whose IP is at or below `ip`.
fn search<M: GuestMemory + ?Sized>(
    mem: &M,
    t: &OrcLayout,
    ip: u64,
    start: u32,
    stop: u32,
    budget: &mut Budget,
) -> Result<Option<OrcEntry>, Stop> {
    let (mut lo, mut hi) = (start, stop);
    let mut found = None;
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let slot = t.ip_table + 4 * u64::from(mid);
        let rel = read_u32(mem, budget, slot)? as i32;
        let at = slot.wrapping_add_signed(i64::from(rel));
        if at <= ip {
            found = Some(mid);
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    let Some(i) = found else {
        return Err(Stop::Malformed);
    };
    let mut b = [0u8; 6];
    read(mem, budget, t.entries + 6 * u64::from(i), &mut b)?;
    Ok(Some(OrcEntry::from_bytes(b)))
}

/// Where a kernel unwind starts: the interrupted code's registers (the sample's). The few
/// entries whose CFA is in another register (RDX, RDI, R10, R13: entry code) are followed only
/// after a full `pt_regs`, which holds them; at the start such an entry ends the walk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelRegs {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
}

/// The user-mode state a kernel stack ends in (from its `pt_regs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UserRegs {
    pub ip: u64,
    pub sp: u64,
    /// `None` where only an IRET frame was saved and RBP had changed since (it never has, in
    /// practice: the entry code saves it before using it).
    pub bp: Option<u64>,
}

/// How a kernel unwind ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelEnd {
    /// At the outermost frame of a kernel thread's stack.
    Complete,
    /// At the `pt_regs` of interrupted user-mode code: the user stack goes on from there.
    User(UserRegs),
    /// The sink took no more frames.
    Full,
    /// A step failed: no entry for an IP (module code, garbage), an unreadable stack, a stack
    /// that does not climb, the read budget. The frames before are right.
    Bad(Stop),
}

/// The most times a kernel unwind may move to another stack (IRQ stack → task stack, an
/// exception stack → the interrupted one, and into user mode).
pub const MAX_STACK_SWITCHES: u32 = 6;

/// Offsets in `struct pt_regs` (x86-64, `arch/x86/include/asm/ptrace.h`).
mod pt_regs {
    pub const BP: u64 = 4 * 8;
    pub const R10: u64 = 7 * 8;
    pub const DX: u64 = 12 * 8;
    pub const DI: u64 = 14 * 8;
    pub const R13: u64 = 2 * 8;
    /// The IRET frame: RIP, CS, RFLAGS, RSP, SS (`IRET_FRAME_OFFSET`).
    pub const IP: u64 = 16 * 8;
    pub const CS: u64 = 17 * 8;
    pub const SP: u64 = 19 * 8;
}

/// Where the registers of the frame being unwound come from.
#[derive(Clone, Copy)]
enum Regs {
    /// None but IP, SP and BP (after a call frame).
    None,
    /// A full `pt_regs` at this address.
    Full(u64),
    /// Only an IRET frame (its `pt_regs` would start at this address).
    Partial(u64),
}

/// Unwinds the kernel stack from `start`, giving each caller's return address (innermost first;
/// the IP of an interrupted frame, where a `pt_regs` frame is crossed) to `sink`, which returns
/// `false` when it takes no more. `start.ip` itself is not given (it is the sample's RIP).
pub fn unwind_kernel<M: GuestMemory + ?Sized, C: OrcCache + ?Sized>(
    mem: &M,
    t: &OrcLayout,
    cache: &C,
    start: KernelRegs,
    budget: &mut Budget,
    sink: &mut dyn FnMut(u64) -> bool,
) -> KernelEnd {
    let (mut ip, mut sp, mut bp) = (start.ip, start.sp, start.bp);
    let mut regs = Regs::None;
    // The IP is where the code was interrupted (the start, or after a `pt_regs`), not a
    // return address (which may lie past the end of a call to a function that never returns).
    let mut exact = true;
    let mut switches = 0;
    loop {
        let at = if exact { ip } else { ip.wrapping_sub(1) };
        let orc = match cache.get(at) {
            Some(e) => e,
            None => match find(mem, t, at, budget) {
                Ok(Some(e)) => {
                    cache.put(at, e);
                    e
                }
                Ok(None) => return KernelEnd::Bad(Stop::Malformed),
                Err(s) => return KernelEnd::Bad(s),
            },
        };
        match step(mem, budget, orc, sp, bp, regs) {
            Err(s) => return KernelEnd::Bad(s),
            Ok(None) => return KernelEnd::Complete,
            Ok(Some(next)) => {
                let climbs = next.sp > sp;
                if !climbs || next.switch {
                    if !next.switch || switches == MAX_STACK_SWITCHES {
                        return KernelEnd::Bad(Stop::Malformed);
                    }
                    switches += 1;
                }
                if let Regs::Full(r) | Regs::Partial(r) = next.regs {
                    // Interrupted user mode (CS's RPL is 3): the kernel stack ends here.
                    let cs = match read_u64(mem, budget, r + pt_regs::CS) {
                        Ok(cs) => cs,
                        Err(s) => return KernelEnd::Bad(s),
                    };
                    if cs & 3 == 3 {
                        return KernelEnd::User(UserRegs {
                            ip: next.ip,
                            sp: next.sp,
                            bp: matches!(next.regs, Regs::Full(_)).then_some(next.bp),
                        });
                    }
                }
                if !sink(next.ip) {
                    return KernelEnd::Full;
                }
                (ip, sp, bp, regs) = (next.ip, next.sp, next.bp, next.regs);
                exact = !matches!(regs, Regs::None);
            }
        }
    }
}

/// The caller's frame.
struct Next {
    ip: u64,
    sp: u64,
    bp: u64,
    regs: Regs,
    /// The entry said the stack may change here.
    switch: bool,
}

/// One step of `unwind_next_frame`: the caller's IP, SP and BP from `orc`; `None` at the end of
/// a kernel thread's stack.
fn step<M: GuestMemory + ?Sized>(
    mem: &M,
    budget: &mut Budget,
    orc: OrcEntry,
    sp: u64,
    bp: u64,
    regs: Regs,
) -> Result<Option<Next>, Stop> {
    if orc.sp_reg == reg::UNDEFINED {
        return if orc.end {
            Ok(None)
        } else {
            Err(Stop::Malformed)
        };
    }
    let off = i64::from(orc.sp_offset);
    let (cfa, switch) = match orc.sp_reg {
        reg::SP => (sp.wrapping_add_signed(off), false),
        reg::BP => (bp.wrapping_add_signed(off), false),
        // The stack was switched inside this function: the old top is saved at (SP) (since
        // Linux 5.12, `(%rsp) + offset`), or at (BP + offset).
        reg::SP_INDIRECT => (read_u64(mem, budget, sp)?.wrapping_add_signed(off), true),
        reg::BP_INDIRECT => (read_u64(mem, budget, bp.wrapping_add_signed(off))?, true),
        reg::R10 => (other(mem, budget, regs, pt_regs::R10)?, true),
        reg::R13 => (other(mem, budget, regs, pt_regs::R13)?, true),
        reg::DI => (other(mem, budget, regs, pt_regs::DI)?, true),
        reg::DX => (other(mem, budget, regs, pt_regs::DX)?, true),
        _ => return Err(Stop::Malformed),
    };
    if cfa < KERNEL_HALF || !cfa.is_multiple_of(8) {
        return Err(Stop::Malformed);
    }
    let (ip, new_sp, new_regs, switch) = match orc.kind {
        kind::CALL => (read_u64(mem, budget, cfa - 8)?, cfa, Regs::None, switch),
        kind::REGS => {
            let ip = read_u64(mem, budget, cfa + pt_regs::IP)?;
            let sp = read_u64(mem, budget, cfa + pt_regs::SP)?;
            (ip, sp, Regs::Full(cfa), true)
        }
        kind::REGS_PARTIAL => {
            let base = cfa.wrapping_sub(pt_regs::IP);
            let ip = read_u64(mem, budget, cfa)?;
            let sp = read_u64(mem, budget, cfa + (pt_regs::SP - pt_regs::IP))?;
            (ip, sp, Regs::Partial(base), true)
        }
        _ => return Err(Stop::Malformed),
    };
    let new_bp = match orc.bp_reg {
        reg::UNDEFINED => match new_regs {
            Regs::Full(p) => read_u64(mem, budget, p + pt_regs::BP)?,
            _ => bp,
        },
        reg::PREV_SP => read_u64(
            mem,
            budget,
            cfa.wrapping_add_signed(i64::from(orc.bp_offset)),
        )?,
        reg::BP => read_u64(
            mem,
            budget,
            bp.wrapping_add_signed(i64::from(orc.bp_offset)),
        )?,
        _ => return Err(Stop::Malformed),
    };
    Ok(Some(Next {
        ip,
        sp: new_sp,
        bp: new_bp,
        regs: new_regs,
        switch,
    }))
}

/// A register of the interrupted code (for an entry whose CFA is in RDX, RDI, R10 or R13), at
/// offset `at` of a full `pt_regs`; unknown at the start, after a call frame or an IRET frame.
fn other<M: GuestMemory + ?Sized>(
    mem: &M,
    budget: &mut Budget,
    regs: Regs,
    at: u64,
) -> Result<u64, Stop> {
    match regs {
        Regs::Full(p) => read_u64(mem, budget, p + at),
        Regs::None | Regs::Partial(_) => Err(Stop::Malformed),
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // test tables are small
mod tests {
    use super::*;
    use crate::model::Memory;
    use proptest::prelude::*;

    const TEXT: u64 = 0xffff_ffff_8100_0000;
    const TABLES: u64 = 0xffff_ffff_8200_0000;
    const STACK: u64 = 0xffff_c900_0000_0000;
    const INIT: u64 = 0xffff_ffff_8180_0000;

    /// Writes ORC tables for `rows` (IP, entry; sorted by IP) over a text of `text_len` bytes
    /// at `TEXT`, with the lookup table `unwind_init` would fill in.
    fn tables(mem: &mut Memory, rows: &[(u64, OrcEntry)], text_len: u64) -> OrcLayout {
        let ip_table = TABLES;
        let entries = TABLES + 0x10_0000;
        let lookup = TABLES + 0x20_0000;
        for (i, (ip, e)) in rows.iter().enumerate() {
            let slot = ip_table + 4 * i as u64;
            mem.put_u32(slot, (ip.wrapping_sub(slot) as i64) as i32 as u32);
            mem.put(entries + 6 * i as u64, &e.to_bytes());
        }
        let blocks = text_len.div_ceil(256) + 1;
        let rightmost = |ip: u64| rows.iter().rposition(|(at, _)| *at <= ip).unwrap_or(0);
        for b in 0..blocks {
            let ip = if b == blocks - 1 {
                TEXT + text_len
            } else {
                TEXT + 256 * b
            };
            mem.put_u32(lookup + 4 * b, rightmost(ip) as u32);
        }
        OrcLayout {
            entry_syscall_64: TEXT,
            stext: TEXT,
            etext: TEXT + text_len,
            sinittext: INIT,
            einittext: INIT + 0x1000,
            ip_table,
            entries,
            count: rows.len() as u32,
            lookup,
            lookup_blocks: blocks as u32,
        }
    }

    fn call(sp_reg: u8, sp_offset: i16, bp_reg: u8, bp_offset: i16) -> OrcEntry {
        OrcEntry {
            sp_offset,
            bp_offset,
            sp_reg,
            bp_reg,
            kind: kind::CALL,
            end: false,
        }
    }

    fn unwind(mem: &Memory, t: &OrcLayout, start: KernelRegs) -> (std::vec::Vec<u64>, KernelEnd) {
        let mut frames = std::vec::Vec::new();
        let end = unwind_kernel(mem, t, &(), start, &mut Budget::new(1000), &mut |ip| {
            frames.push(ip);
            frames.len() < 32
        });
        (frames, end)
    }

    /// Three functions: `c` (a leaf: its return address on top), `b` (pushed RBP and 0x18 more
    /// bytes), `a` (a frame-pointer frame), called from a system call's entry, whose entry says
    /// `pt_regs` of user mode is at the CFA.
    #[test]
    fn from_a_leaf_through_a_system_call_into_user_mode() {
        let (a, b, c, entry) = (TEXT + 0x100, TEXT + 0x400, TEXT + 0x800, TEXT + 0x900);
        let regs_entry = OrcEntry {
            sp_offset: 0,
            bp_offset: 0,
            sp_reg: reg::SP,
            bp_reg: reg::UNDEFINED,
            kind: kind::REGS,
            end: false,
        };
        let rows = [
            (TEXT, call(reg::SP, 8, reg::UNDEFINED, 0)),
            (a, call(reg::BP, 16, reg::PREV_SP, -16)),
            (b, call(reg::SP, 0x28, reg::PREV_SP, -16)),
            (c, call(reg::SP, 8, reg::UNDEFINED, 0)),
            (entry, regs_entry),
            (entry + 0x40, call(reg::SP, 8, reg::UNDEFINED, 0)),
        ];
        let mut mem = Memory::default();
        let t = tables(&mut mem, &rows, 0x1000);
        // The stack, from the leaf's SP up.
        let sp = STACK + 0x3e00;
        mem.put_u64(sp, b + 0x10); // c's return into b
        // b's frame: 0x18 bytes of locals, then its caller's RBP, then the return into a.
        mem.zero(sp + 8, 0x18);
        let b_cfa = sp + 8 + 0x28;
        mem.put_u64(b_cfa - 16, STACK + 0x3f00); // a's RBP, saved by b
        mem.put_u64(b_cfa - 8, a + 0x20); // b's return into a
        // a's frame record at its RBP: the entry's RBP, then the return into the entry.
        let a_bp = STACK + 0x3f00;
        mem.put_u64(a_bp, 0x7fff_0000_1000); // the user's RBP (saved by a, from pt_regs)
        mem.put_u64(a_bp + 8, entry + 0x3);
        // pt_regs at a's CFA.
        let regs = a_bp + 16;
        mem.zero(regs, 21 * 8);
        mem.put_u64(regs + pt_regs::BP, 0x7fff_0000_1000);
        mem.put_u64(regs + pt_regs::IP, 0x40_1234);
        mem.put_u64(regs + pt_regs::CS, 0x33);
        mem.put_u64(regs + pt_regs::SP, 0x7fff_0000_0f00);
        let (frames, end) = unwind(
            &mem,
            &t,
            KernelRegs {
                ip: c + 5,
                sp,
                bp: a_bp,
            },
        );
        assert_eq!(frames, [b + 0x10, a + 0x20, entry + 3]);
        assert_eq!(
            end,
            KernelEnd::User(UserRegs {
                ip: 0x40_1234,
                sp: 0x7fff_0000_0f00,
                bp: Some(0x7fff_0000_1000),
            })
        );
    }

    #[test]
    fn a_kernel_thread_ends_complete_and_a_loop_ends_bad() {
        let end_entry = OrcEntry {
            sp_offset: 0,
            bp_offset: 0,
            sp_reg: reg::UNDEFINED,
            bp_reg: reg::UNDEFINED,
            kind: kind::CALL,
            end: true,
        };
        let (f, top) = (TEXT + 0x100, TEXT + 0x200);
        let rows = [
            (TEXT, call(reg::SP, 8, reg::UNDEFINED, 0)),
            (f, call(reg::SP, 8, reg::UNDEFINED, 0)),
            (top, end_entry),
            (top + 0x10, call(reg::SP, 0, reg::UNDEFINED, 0)),
        ];
        let mut mem = Memory::default();
        let t = tables(&mut mem, &rows, 0x1000);
        let sp = STACK + 0x100;
        mem.put_u64(sp, top + 5);
        let start = KernelRegs {
            ip: f + 1,
            sp,
            bp: 0,
        };
        assert_eq!(
            unwind(&mem, &t, start),
            (vec![top + 5], KernelEnd::Complete)
        );
        // An entry whose CFA is its own SP: the stack does not climb.
        mem.put_u64(sp - 8, top + 0x11);
        let start = KernelRegs {
            ip: top + 0x11,
            sp,
            ..start
        };
        assert_eq!(
            unwind(&mem, &t, start),
            (vec![], KernelEnd::Bad(Stop::Malformed))
        );
    }

    #[test]
    fn an_unreadable_stack_an_unknown_ip_and_the_budget_end_the_walk() {
        let f = TEXT + 0x100;
        let rows = [
            (TEXT, call(reg::SP, 8, reg::UNDEFINED, 0)),
            (f, call(reg::SP, 8, reg::UNDEFINED, 0)),
        ];
        let mut mem = Memory::default();
        let t = tables(&mut mem, &rows, 0x1000);
        let start = KernelRegs {
            ip: f,
            sp: STACK,
            bp: 0,
        };
        assert_eq!(
            unwind(&mem, &t, start),
            (vec![], KernelEnd::Bad(Stop::Unreadable { addr: STACK }))
        );
        // A return address into a module (no entry).
        mem.put_u64(STACK, 0xffff_ffff_c000_1000);
        assert_eq!(
            unwind(&mem, &t, start),
            (vec![0xffff_ffff_c000_1000], KernelEnd::Bad(Stop::Malformed))
        );
        let mut frames = 0;
        let end = unwind_kernel(&mem, &t, &(), start, &mut Budget::new(3), &mut |_| {
            frames += 1;
            true
        });
        assert_eq!(end, KernelEnd::Bad(Stop::Budget));
    }

    /// A handler on the IRQ stack (its CFA: the old stack top saved at the IRQ stack's top,
    /// plus 8), under an interrupt of kernel code (a `pt_regs` of kernel mode), whose callers go
    /// on by their own entries.
    #[test]
    fn crosses_the_irq_stack_and_a_kernel_mode_interrupt() {
        let (handler, thunk, asm_entry, k) =
            (TEXT + 0x100, TEXT + 0x200, TEXT + 0x300, TEXT + 0x400);
        let rows = [
            (TEXT, call(reg::SP, 8, reg::UNDEFINED, 0)),
            (handler, call(reg::SP, 8, reg::UNDEFINED, 0)),
            (thunk, call(reg::SP_INDIRECT, 8, reg::UNDEFINED, 0)),
            (
                asm_entry,
                OrcEntry {
                    sp_offset: 0,
                    bp_offset: 0,
                    sp_reg: reg::SP,
                    bp_reg: reg::UNDEFINED,
                    kind: kind::REGS,
                    end: false,
                },
            ),
            (k, call(reg::SP, 8, reg::UNDEFINED, 0)),
        ];
        let mut mem = Memory::default();
        let t = tables(&mut mem, &rows, 0x1000);
        let irq = STACK + 0x10_0000; // the IRQ stack, below the task stack
        let task = STACK + 0x8000;
        mem.put_u64(irq, thunk + 4); // handler's return into the thunk
        mem.put_u64(irq + 8, task - 16); // the task stack's top, saved by the thunk
        mem.put_u64(task - 16, asm_entry + 2); // the thunk's return (below the old top)
        // pt_regs of the interrupted kernel code at the task stack's `task`.
        mem.zero(task - 8, 8);
        mem.zero(task, 21 * 8);
        mem.put_u64(task - 8 + pt_regs::IP, k + 7);
        mem.put_u64(task - 8 + pt_regs::CS, 0x10);
        mem.put_u64(task - 8 + pt_regs::SP, task + 0x400);
        mem.put_u64(task + 0x400, 0xffff_ffff_c000_0000); // k's return: a module
        let (frames, end) = unwind(
            &mem,
            &t,
            KernelRegs {
                ip: handler + 1,
                sp: irq,
                bp: 0,
            },
        );
        assert_eq!(
            frames,
            [thunk + 4, asm_entry + 2, k + 7, 0xffff_ffff_c000_0000]
        );
        assert_eq!(end, KernelEnd::Bad(Stop::Malformed));
    }

    /// Boot-time text has no lookup blocks: the whole table is searched.
    #[test]
    fn init_text_is_found_by_a_whole_search() {
        let init = call(reg::BP, 16, reg::PREV_SP, -16);
        let rows = [
            (TEXT, call(reg::SP, 8, reg::UNDEFINED, 0)),
            (TEXT + 0x10, call(reg::SP, 16, reg::UNDEFINED, 0)),
            (INIT + 0x100, init),
            (INIT + 0x200, call(reg::SP, 8, reg::UNDEFINED, 0)),
        ];
        let mut mem = Memory::default();
        let t = tables(&mut mem, &rows, 0x100);
        let found = |ip| find(&mem, &t, ip, &mut Budget::new(100));
        assert_eq!(found(INIT + 0x150), Ok(Some(init)));
        assert_eq!(found(TEXT + 0x20), Ok(Some(rows[1].1)));
        assert_eq!(found(INIT + 0x1000), Ok(None));
    }

    #[test]
    fn a_layout_reads_back_and_moves_by_the_slide() {
        let l = OrcLayout {
            entry_syscall_64: 0xffff_ffff_8200_0040,
            stext: 0xffff_ffff_8100_0000,
            etext: 0xffff_ffff_81e0_1ef2,
            sinittext: 0xffff_ffff_8304_c000,
            einittext: 0xffff_ffff_830a_f5ab,
            ip_table: 0xffff_ffff_82c5_d2e8,
            entries: 0xffff_ffff_82dc_42e0,
            count: 368_638,
            lookup: 0xffff_ffff_82fd_ead4,
            lookup_blocks: 57376,
        };
        let s = std::format!("{l}");
        assert_eq!(OrcLayout::parse(&s), Some(l));
        assert_eq!(
            OrcLayout::from_addresses(l.addresses(), l.count, l.lookup_blocks),
            l
        );
        assert_eq!(
            OrcLayout::parse(&s[..s.len() - 1]).map(|p| p.lookup_blocks),
            Some(5737)
        );
        assert_eq!(OrcLayout::parse("0x1:0x2"), None);
        assert_eq!(OrcLayout::parse(&std::format!("{s}:1")), None);
        let t = l.at(0xffff_ffff_a200_0040).unwrap();
        assert_eq!(t.stext, 0xffff_ffff_a100_0000);
        assert_eq!(t.lookup, 0xffff_ffff_a2fd_ead4);
        assert_eq!(l.at(0), None);
        assert_eq!(l.at(0xffff_ffff_a200_0041), None);
    }

    proptest! {
        #[test]
        fn entries_read_back(b in proptest::array::uniform6(any::<u8>())) {
            let e = OrcEntry::from_bytes(b);
            prop_assert_eq!(OrcEntry::from_bytes(e.to_bytes()), e);
        }

        /// The lookup table's shortcut finds what a search of the whole table finds.
        #[test]
        fn find_agrees_with_a_whole_search(
            gaps in proptest::collection::vec(1u64..300, 1..60),
            probes in proptest::collection::vec(0u64..20_000, 1..40),
        ) {
            let mut ip = TEXT;
            let rows: std::vec::Vec<_> = gaps.iter().enumerate().map(|(i, g)| {
                let at = ip;
                ip += g;
                (at, call(reg::SP, 8 * (i as i16 + 1), reg::UNDEFINED, 0))
            }).collect();
            let len = ip - TEXT + 1;
            let mut mem = Memory::default();
            let t = tables(&mut mem, &rows, len);
            for p in probes {
                let at = TEXT + p % len;
                let want = rows.iter().rev().find(|(ip, _)| *ip <= at).map(|r| r.1);
                prop_assert_eq!(find(&mem, &t, at, &mut Budget::new(100)), Ok(want));
            }
        }

        /// Garbage memory never makes a walk fault, loop or read without bound.
        #[test]
        fn garbage_stacks_end(words in proptest::collection::vec(any::<u64>(), 64), start in 0u64..64) {
            let rows = [
                (TEXT, call(reg::SP, 8, reg::PREV_SP, -16)),
                (TEXT + 0x40, call(reg::SP_INDIRECT, 8, reg::BP, 0)),
                (TEXT + 0x80, OrcEntry { sp_offset: 0, bp_offset: 0, sp_reg: reg::SP, bp_reg: reg::UNDEFINED, kind: kind::REGS, end: false }),
                (TEXT + 0xc0, OrcEntry { sp_offset: 0, bp_offset: 0, sp_reg: reg::SP, bp_reg: reg::UNDEFINED, kind: kind::REGS_PARTIAL, end: false }),
            ];
            let mut mem = Memory::default();
            let t = tables(&mut mem, &rows, 0x100);
            for (i, w) in words.iter().enumerate() {
                // Half the words point back into the stack or the text.
                let v = match w % 4 {
                    0 => STACK + (w >> 8) % 512,
                    1 => TEXT + (w >> 8) % 0x100,
                    _ => *w,
                };
                mem.put_u64(STACK + 8 * i as u64, v);
            }
            let mut budget = Budget::new(200);
            let mut n = 0;
            let _ = unwind_kernel(&mem, &t, &(), KernelRegs { ip: TEXT + 0x41, sp: STACK + 8 * start, bp: STACK }, &mut budget, &mut |_| { n += 1; n < 32 });
            prop_assert!(mem.reads.get() <= 200);
        }
    }
}
