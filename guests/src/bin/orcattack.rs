//! `orcattack`: a kernel whose ORC tables make every kernel walk as long as they can. Its VM is
//! given `orc-layout=` (as a Linux VM is), so the profiler walks its kernel-mode samples by the
//! tables below, which live in this guest's memory and are the guest's to shape:
//!
//! - `orc_unwind_ip` holds 2^20 slots (the search of a whole table reads 20 of them), every one
//!   with the same relative offset, so slot `i` covers `KB + 4 i`;
//! - every `orc_unwind` entry is a call frame (CFA = SP + 16, return address at CFA - 8, saved
//!   RBP at CFA - 16: two stack reads per frame);
//! - the whole alias of the guest's first 16 MiB is `.init.text`, which the walker searches
//!   whole (no `orc_lookup` shortcut);
//! - the code spins at its kernel alias on a forged stack of `frames=F` call frames (default 64)
//!   whose return addresses it rewrites all the time, each into a different slot, so that no
//!   remembered entry serves a walk.
//!
//! A walk of this stack costs 23 reads per frame, more than `KERNEL_WALK_READS` (640) before
//! the deepest chain `stacks=` allows (32 frames). The profiler must stop it at its budget.
//!
//! The VM's `orc-layout=`, in its order (entry_SYSCALL_64:_stext:_etext:_sinittext:_einittext:
//! orc_unwind_ip:orc_unwind:count:orc_lookup:blocks), is
//! `0xffffffff80001000:0xffffffff81f80000:0xffffffff81f80100:0xffffffff80000000:0xffffffff81000000:0xffffffff81000000:0xffffffff81800000:1048576:0xffffffff81f00000:2`
//! (KB + the constants below; `_stext`.. `_etext` is one 256-byte block at KB + 0x1f8_0000 where
//! no IP falls); the VM needs `mem=32M` or more. `rounds=R` (default 20) calls of `spin=S` iterations (default 2000) each. Prints
//! `orcattack: done rounds=R` and exits with 0.
#![no_std]
#![no_main]

use hvprof_guests::paging::{ADDR_MASK, P, RW};
use hvprof_guests::{arg_num, cpu, exit_code, println};

hvprof_guests::guest_entry!(main);

/// The kernel alias: virtual `KB + x` maps guest-physical `x` (PML4 slot 511, PDPT slot 510,
/// where Linux keeps its text mapping).
const KB: u64 = 0xffff_ffff_8000_0000;
/// Guest-physical places of the tables and the forged stack.
const IP_TABLE: u64 = 0x100_0000;
const ENTRIES: u64 = 0x180_0000;
const COUNT: u64 = 1 << 20;
const LOOKUP: u64 = 0x1f0_0000;
const STACK: u64 = 0x1f1_0000;
const ENTRY_SYSCALL_64: u64 = 0x1000;
/// The most forged frames (the stack's room, 32 KiB).
const MAX_FRAMES: u64 = 2048;

/// The entry every slot holds: `sp_offset` 16, `bp_offset` -16, `sp_reg` SP (5), `bp_reg`
/// PREV_SP (1), type CALL (0), not an end.
const ENTRY: [u8; 6] = [16, 0, 0xf0, 0xff, 0x15, 0];

/// The kernel alias's PDPT (PML4 slot 511).
#[repr(C, align(4096))]
struct Table([u64; 512]);
static mut ALIAS_PDPT: Table = Table([0; 512]);

// `orc_spin(stack, iterations, frames)`: RSP = `stack` (a kernel-alias address) while it
// rewrites the `frames` call frames there `iterations` times: frame k's saved RBP at
// stack + 16 k (its own address) and its return address at stack + 16 k + 8, one past the IP
// slot `(x + 7919 k) mod 2^20` covers, x moving on at each iteration. Only caller-saved
// registers are used (System V AMD64 ABI §3.2.1); nothing runs on the forged stack (no
// interrupts: IF is clear, and no call is made), and RSP is restored before `ret`.
core::arch::global_asm!(
    ".global orc_spin",
    ".type orc_spin, @function",
    "orc_spin:",
    "mov r8, rsp",
    "mov rsp, rdi",
    "xor r9d, r9d",
    "movabs r10, 0xffffffff80000000",
    "2:",
    "mov rdi, rsp",
    "mov rcx, rdx",
    "mov r11, r9",
    "3:",
    "mov rax, r11",
    "and eax, 0xfffff",
    "lea rax, [r10 + rax * 4 + 1]",
    "mov [rdi + 8], rax",
    "mov [rdi], rdi",
    "add rdi, 16",
    "add r11, 7919",
    "dec rcx",
    "jnz 3b",
    "add r9, 104729",
    "dec rsi",
    "jnz 2b",
    "mov rsp, r8",
    "ret",
    ".size orc_spin, . - orc_spin",
);

unsafe extern "C" {
    fn orc_spin(stack: u64, iterations: u64, frames: u64);
}

/// Maps the kernel alias: PML4 slot 511 -> `ALIAS_PDPT`, whose slot 510 is the identity map's
/// first PDPT entry (the first GiB: the page directory of the guest's memory, SDM Vol. 3A
/// §5.5.4). Returns false where the identity map is not as the hypervisor builds it.
///
/// # Safety
/// CR3 must hold the hypervisor's identity map (the guest's own tables, identity-mapped), and
/// nothing else may use PML4 slot 511.
unsafe fn map_kernel_alias() -> bool {
    let pml4 = (cpu::read_cr3() & ADDR_MASK) as *mut u64;
    // SAFETY: the caller's contract: the tables are the guest's own, identity-mapped, and
    // slot 511 is free for this alias.
    unsafe {
        let low = pml4.read_volatile();
        if low & P == 0 || pml4.add(511).read_volatile() & P != 0 {
            return false;
        }
        let pdpt = (low & ADDR_MASK) as *const u64;
        let first = pdpt.read_volatile();
        if first & P == 0 {
            return false;
        }
        let alias = &raw mut ALIAS_PDPT;
        (*alias).0[510] = first;
        pml4.add(511)
            .write_volatile((alias as u64 & ADDR_MASK) | P | RW);
        // Reloading CR3 flushes the old (absent) translations (SDM Vol. 3A §4.10.4.1).
        core::arch::asm!("mov rax, cr3", "mov cr3, rax", out("rax") _, options(nostack));
    }
    true
}

fn main(args: &str) -> u8 {
    let (rounds, iterations, frames) = match (
        arg_num(args, "rounds", 20),
        arg_num(args, "spin", 2000),
        arg_num(args, "frames", 64),
    ) {
        (Ok(r), Ok(s), Ok(f)) if (1..=MAX_FRAMES).contains(&f) && s >= 1 => (r, s, f),
        (Ok(_), Ok(_), Ok(f)) => {
            println!(
                "orcattack: bad spin= or frames={f}: expected at least 1, at most {MAX_FRAMES} frames"
            );
            return exit_code::BAD_ARGS;
        }
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
            println!("orcattack: {e}");
            return exit_code::BAD_ARGS;
        }
    };
    // SAFETY: CR3 holds the hypervisor's identity map and this guest uses no other mapping.
    if !unsafe { map_kernel_alias() } {
        println!("orcattack: the identity map is not as expected; no kernel alias");
        return 4;
    }
    // The tables, written through the identity map. Slot i at KB + IP_TABLE + 4 i holds
    // KB + 4 i minus its own address.
    let rel = (IP_TABLE as i64).wrapping_neg() as i32 as u32;
    for i in 0..COUNT {
        // SAFETY: [IP_TABLE, LOOKUP) lies inside the VM's memory (mem=32M or more, checked by
        // the hypervisor's identity map covering it), used by nothing but these tables.
        unsafe {
            ((IP_TABLE + 4 * i) as *mut u32).write_volatile(rel);
            let e = (ENTRIES + 6 * i) as *mut u8;
            for (j, b) in ENTRY.iter().enumerate() {
                e.add(j).write_volatile(*b);
            }
        }
    }
    // SAFETY: as above; the lookup table's two entries (`blocks` = 2) cover the one-block
    // `_stext` range, where no IP falls.
    unsafe { (LOOKUP as *mut [u32; 2]).write_volatile([0, 0]) };
    // SAFETY: IA32_LSTAR only says where SYSCALL would enter; this guest never executes it.
    if let Err(f) = unsafe { cpu::wrmsr_safe(0xc000_0082, KB + ENTRY_SYSCALL_64) } {
        println!("orcattack: cannot set IA32_LSTAR: {f:?}");
        return 4;
    }
    println!("orcattack: tables ready ({COUNT} entries), {frames} forged frames");
    // SAFETY: the alias maps `orc_spin`'s code (position-independent: it refers to no address
    // of its own) and the forged stack, which holds `MAX_FRAMES` frames.
    let spin: unsafe extern "C" fn(u64, u64, u64) =
        unsafe { core::mem::transmute(KB + orc_spin as *const () as u64) };
    for _ in 0..rounds {
        // SAFETY: as above.
        unsafe { spin(KB + STACK, iterations, frames) };
    }
    println!("orcattack: done rounds={rounds}");
    0
}
