//! `stacks`: a call tree known by construction, for the call-chain tests. In Bochs the TSC counts
//! instructions, so every edge's share of the samples is exact by construction.
//!
//! Each round (`rounds=R`, default 1000) runs, from `round`:
//! - `parent_a`, which calls `leaf` for 7 x U iterations, and `parent_b`, which calls `leaf` for
//!   3 x U: `leaf`'s samples come 70 % from `parent_a` and 30 % from `parent_b`;
//! - `recurse` nested `depth=D` times (default 4), the innermost calling `deep_leaf` for 2 x U:
//!   every `deep_leaf` sample has exactly D `recurse` frames above it;
//! - `nofp_caller`, which calls `nofp`, a function without a frame pointer (assembly), which
//!   calls `nofp_leaf` for 1 x U: a frame-pointer walk from `nofp_leaf` finds `nofp`, then
//!   skips `nofp_caller` (its return address is on the stack but in no frame record) and goes
//!   on at `round`: the known blind spot of frame pointers;
//! - `cpuid_loop`, which executes `cpuid=C` CPUIDs (default 20; each a VM exit): the hypervisor's
//!   time for them is caused by `cpuid_loop`, called from `round`.
//!
//! `unit=U` (default 997) is the loop iterations per weight point; every iteration is two
//! instructions (`dec`, `jnz`). `tree=A,B,R,N` (default `7,3,2,1`) changes the weights of
//! `parent_a`, `parent_b`, `recurse` and `nofp_caller` (the benchmark's `tree=0,0,1,0 depth=20`
//! puts nearly every sample 20 frames deep). Prints `stacks: done rounds=R` and exits with 0.
//!
//! With `plant=N` it runs no tree: it overwrites `deep_leaf` and `leaf`, in its own memory at
//! their own addresses, with a loop of one-byte NOPs and runs it N times, so that its samples
//! find ordinary code where another VM running `stacks` has its prologues and epilogues (same
//! image, same addresses, same CR3): that VM's call chains must not be walked by what this one's
//! walks found (docs/SECURITY.md, "Call chains across VMs"). Prints `stacks: planted N` and
//! exits with 0.
#![no_std]
#![no_main]

use hvprof_guests::{arg_num, exit_code, println};

hvprof_guests::guest_entry!(main);

hvprof_guests::countdown!(leaf, 0x1);
hvprof_guests::countdown!(deep_leaf, 0x2);
hvprof_guests::countdown!(nofp_leaf, 0x3);

// The two parents differ by a constant after the call, so that the linker cannot fold them
// into one function (and the call is no tail call: the frame stays while `leaf` runs).
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn parent_a(iterations: u64) {
    leaf(core::hint::black_box(iterations));
    core::hint::black_box(0xa);
}

#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn parent_b(iterations: u64) {
    leaf(core::hint::black_box(iterations));
    core::hint::black_box(0xb);
}

#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn recurse(depth: u64, iterations: u64) {
    if depth <= 1 {
        deep_leaf(core::hint::black_box(iterations));
    } else {
        recurse(core::hint::black_box(depth - 1), iterations);
    }
    // Not a tail call: the frame stays while its callee runs.
    core::hint::black_box(depth);
}

// `nofp(iterations)`: calls `nofp_leaf(iterations)` without setting up a frame of its own (RBP is
// left as its caller's), keeping the stack 16-byte aligned at the call (System V AMD64 ABI
// §3.2.2).
core::arch::global_asm!(
    ".global nofp",
    ".type nofp, @function",
    "nofp:",
    "sub rsp, 8",
    "call {leaf}",
    "add rsp, 8",
    "ret",
    ".size nofp, . - nofp",
    leaf = sym nofp_leaf,
);

unsafe extern "C" {
    fn nofp(iterations: u64);
}

#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn nofp_caller(iterations: u64) {
    // SAFETY: `nofp` takes one integer argument in RDI and follows the C ABI (it only calls
    // `nofp_leaf` with it).
    unsafe { nofp(core::hint::black_box(iterations)) };
    core::hint::black_box(iterations);
}

/// `n` CPUIDs (leaf 0), each a VM exit, executed in this function itself.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn cpuid_loop(n: u64) {
    for _ in 0..n {
        hvprof_guests::cpu::cpuid(0, 0);
    }
}

/// One round: `w` are the iterations of `parent_a`, `parent_b`, `recurse` and `nofp_caller`.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn round(w: &[u64; 4], depth: u64, cpuids: u64) {
    parent_a(w[0]);
    parent_b(w[1]);
    recurse(depth, w[2]);
    nofp_caller(w[3]);
    cpuid_loop(cpuids);
    core::hint::black_box(w);
}

/// The loop of `plant=`: NOPs from `deep_leaf` on, then `dec rcx; jnz <deep_leaf>; ret` ending
/// where `nofp_caller` begins; run `loops` times.
fn plant(loops: u64) -> u8 {
    let start = deep_leaf as *const () as usize;
    let middle = leaf as *const () as usize;
    let end = nofp_caller as *const () as usize;
    if !(start < middle && middle < end && (16..=120).contains(&(end - start))) {
        println!(
            "stacks: plant: deep_leaf {start:#x}, leaf {middle:#x}, nofp_caller {end:#x}: not the layout the loop needs"
        );
        return exit_code::BAD_ARGS;
    }
    // dec rcx (REX.W FF /1); jnz rel8 (75 cb); ret (C3).
    let tail_at = end - 6;
    let rel = start as isize - (tail_at + 5) as isize;
    let tail = [0x48, 0xff, 0xc9, 0x75, rel as i8 as u8, 0xc3];
    let code = start as *mut u8;
    for i in 0..end - start {
        let byte = if i < tail_at - start {
            0x90
        } else {
            tail[i - (tail_at - start)]
        };
        // SAFETY: the bytes from `deep_leaf` to `nofp_caller` are this VM's own memory,
        // identity-mapped writable and executable; in this mode nothing calls `deep_leaf` or
        // `leaf` (they are rewritten as a whole), and x86 sees the stores before the call below
        // (SDM Vol. 3A §10.6, self-modifying code).
        unsafe { code.add(i).write_volatile(byte) };
    }
    // Runs of 50 to 62 turns, so that the sampling deadlines fall on every byte of the loop
    // (a loop of a fixed length sampled at a fixed period would show a few of them only).
    let mut left = loops;
    let mut i = 0u64;
    while left > 0 {
        let turns = (50 + i % 13).min(left);
        // SAFETY: the loop just written: NOPs, then `dec rcx; jnz; ret`, which clobbers only
        // RCX and the flags and returns to here.
        unsafe {
            core::arch::asm!("call {f}", f = in(reg) start, inout("rcx") turns => _, clobber_abi("C"));
        }
        left -= turns;
        i += 1;
    }
    println!("stacks: planted {loops}");
    0
}

fn main(args: &str) -> u8 {
    if let Ok(n @ 1..) = arg_num(args, "plant", 0) {
        return plant(n);
    }
    let mut values = [0u64; 4];
    for (v, (key, default)) in
        values
            .iter_mut()
            .zip([("unit", 997), ("rounds", 1000), ("depth", 4), ("cpuid", 20)])
    {
        match arg_num(args, key, default) {
            Ok(n) => *v = n,
            Err(e) => {
                println!("stacks: {e}");
                return exit_code::BAD_ARGS;
            }
        }
    }
    let [unit, rounds, depth, cpuids] = values;
    if depth == 0 || depth > 64 {
        println!("stacks: bad argument depth={depth}: expected 1 to 64");
        return exit_code::BAD_ARGS;
    }
    let mut weights = [7u64, 3, 2, 1];
    if let Some(tree) = hvprof_guests::arg(args, "tree") {
        let mut parts = tree.split(',');
        for w in weights.iter_mut() {
            match parts.next().and_then(hvprof_guests::args::parse_u64) {
                Some(v) => *w = v * unit,
                None => {
                    println!("stacks: bad argument tree={tree}: expected four weights A,B,R,N");
                    return exit_code::BAD_ARGS;
                }
            }
        }
    } else {
        weights.iter_mut().for_each(|w| *w *= unit);
    }
    for _ in 0..rounds {
        round(
            core::hint::black_box(&weights),
            core::hint::black_box(depth),
            core::hint::black_box(cpuids),
        );
    }
    println!("stacks: done rounds={rounds}");
    0
}
