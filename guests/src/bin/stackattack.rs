//! `stackattack`: hostile frame-pointer chains for the call-chain walker. Each phase points RBP
//! at a forged chain of frame records and spins (no exit but the sampling clock's), so that every
//! sample of the phase walks that chain. The return addresses are markers, `0x4141_P000 + i` for
//! phase P and record i, so the test knows each sample's phase from its frames:
//!
//! 1. a record that points at itself: one frame, then a bad frame (the chain does not climb);
//! 2. two records that point at each other: two frames, then a bad frame;
//! 3. a climbing chain whose next record lies on a page this guest maps to guest-physical memory
//!    outside the VM (`addr=`, resolved by the loader from `target=`, e.g. another VM's memory):
//!    one frame, then a bad frame, and nothing read there;
//! 4. a climbing chain whose next record is on an unmapped page: one frame, then a bad frame;
//! 5. a climbing chain of hundreds of records: cut at the walker's depth limit.
//!
//! `rounds=R` (default 200) repeats the five phases, each spinning `spin=S` iterations (default
//! 20000, two instructions each). Prints `stackattack: done rounds=R` and exits with 0.
#![no_std]
#![no_main]

use hvprof_guests::paging::{self, Mapped};
use hvprof_guests::{arg, arg_num, args::parse_u64, exit_code, println};

hvprof_guests::guest_entry!(main);

/// The long chain (phase 5) runs from record 64 to record `DEEP - 1`.
const DEEP: usize = 1000;

/// The forged records: 16 bytes each (saved RBP, return address), in the guest's own memory.
#[repr(C, align(4096))]
struct Records([u64; 2 * DEEP + 64]);

static mut RECORDS: Records = Records([0; 2 * DEEP + 64]);

/// A virtual address the identity map leaves free (256 GiB), for the pages of phases 3 and 4.
const FAR: u64 = 0x40_0000_0000;

/// The marker return address of record `i` of phase `p`.
const fn marker(p: u64, i: u64) -> u64 {
    0x4141_0000 + (p << 12) + i
}

// `spin_with_rbp(rbp, iterations)`: RBP = `rbp` for `iterations` rounds of a two-instruction
// loop, then RBP restored (the System V AMD64 ABI keeps RBP callee-saved: §3.2.1).
core::arch::global_asm!(
    ".global spin_with_rbp",
    ".type spin_with_rbp, @function",
    "spin_with_rbp:",
    "push rbp",
    "mov rbp, rdi",
    "test rsi, rsi",
    "jz 3f",
    "2:",
    "dec rsi",
    "jnz 2b",
    "3:",
    "pop rbp",
    "ret",
    ".size spin_with_rbp, . - spin_with_rbp",
);

unsafe extern "C" {
    fn spin_with_rbp(rbp: u64, iterations: u64);
}

fn spin(rbp: u64, iterations: u64) {
    // SAFETY: `spin_with_rbp` only loads RBP, counts down RSI and restores RBP; it reads and
    // writes no memory but its own stack slot.
    unsafe { spin_with_rbp(rbp, iterations) };
}

/// Writes record `i` of the forged area: (next RBP, return address).
fn record(i: usize, next: u64, ret: u64) {
    // SAFETY: single-threaded guest; `i` is in bounds (checked by the indexing); nothing else
    // refers to the area while it is written.
    let r = unsafe { &raw mut RECORDS.0 };
    // SAFETY: as above; the raw pointer is to the whole array, indexed in bounds.
    unsafe {
        (*r)[2 * i] = next;
        (*r)[2 * i + 1] = ret;
    }
}

/// The address of record `i`.
fn at(i: usize) -> u64 {
    // SAFETY: only the address is taken, no reference is made.
    (unsafe { &raw const RECORDS.0 }) as u64 + 16 * i as u64
}

fn main(args: &str) -> u8 {
    let (rounds, iterations) = match (arg_num(args, "rounds", 200), arg_num(args, "spin", 20000)) {
        (Ok(r), Ok(s)) => (r, s),
        (Err(e), _) | (_, Err(e)) => {
            println!("stackattack: {e}");
            return exit_code::BAD_ARGS;
        }
    };
    let Some(outside) = arg(args, "addr").and_then(parse_u64) else {
        println!("stackattack: bad or missing argument addr=: expected an address (0x...)");
        return exit_code::BAD_ARGS;
    };
    // Phase 3 and 4's pages: FAR maps the records' first page again, FAR + 4 KiB the page outside
    // the VM; FAR + 8 KiB stays unmapped.
    let records_page = at(0) & !0xfff;
    // SAFETY: CR3 holds the hypervisor's identity map; the new pages are at virtual addresses
    // nothing else uses, and the one onto guest memory aliases only the forged records.
    let mapped = unsafe {
        (
            paging::map_page(FAR, records_page),
            paging::map_page(FAR + 0x1000, outside),
        )
    };
    if !matches!(mapped, (Ok(Mapped::New { .. }), Ok(Mapped::New { .. }))) {
        println!("stackattack: cannot map the far pages: {mapped:?}");
        return 4;
    }
    println!("stackattack: chains ready; outside page at GPA {outside:#x}");
    // Phase 1: a record pointing at itself.
    record(0, at(0), marker(1, 0));
    // Phase 2: two records pointing at each other.
    record(2, at(3), marker(2, 0));
    record(3, at(2), marker(2, 1));
    // Phases 3 and 4 use record 4 through its far alias.
    let far4 = FAR + 16 * 4;
    // Phase 5: a long climbing chain from record 64.
    for i in 64..64 + DEEP - 64 {
        record(i, at(i + 1), marker(5, (i - 64) as u64));
    }
    for _ in 0..rounds {
        spin(at(0), iterations);
        spin(at(2), iterations);
        record(4, FAR + 0x1000 + 0x100, marker(3, 0));
        spin(far4, iterations);
        record(4, FAR + 0x2000 + 0x100, marker(4, 0));
        spin(far4, iterations);
        spin(at(64), iterations);
    }
    println!("stackattack: done rounds={rounds}");
    0
}
