//! `mix`: functions that execute a known number of instructions, for the profiler's accuracy
//! tests. In Bochs the TSC counts instructions, so each function's expected share of the samples
//! is exact by construction.
//!
//! Arguments: `mix=W0,W1[,W2,W3]` (weights, e.g. `mix=80,20` or `mix=40,30,20,10`), `unit=U`
//! (loop iterations per weight point, default 997), `rounds=R` (default 100). Each round calls
//! `work_a` for W0 x U iterations, `work_b` for W1 x U, and so on. Every iteration is two
//! instructions (`dec`, `jnz`), so function i executes 2 x Wi x U instructions per round plus a
//! handful of call overhead. Prints `mix: done rounds=R` and exits with 0.
//!
//! With `idle=N` (a whole number), the guest then halts for N times as long as its work took
//! (measured with RDTSC), woken by its virtual timer (the SET_TIMER hypercall), before it exits:
//! `idle=2` makes it busy for the first third of its life and halted for the other two.
//!
//! With `interrupts=on` it runs with RFLAGS.IF set, as an operating system does (nothing
//! interrupts it but the host: a host interrupt then stops it at once with an
//! external-interrupt exit, SDM Vol. 3C §26.2; under Bochs a guest with IF clear exits for none).
#![no_std]
#![no_main]

use hvprof_guests::{arg, arg_num, exit_code, println};

hvprof_guests::guest_entry!(main);

hvprof_guests::countdown!(work_a, 0xa);
hvprof_guests::countdown!(work_b, 0xb);
hvprof_guests::countdown!(work_c, 0xc);
hvprof_guests::countdown!(work_d, 0xd);

const WORK: [extern "C" fn(u64); 4] = [work_a, work_b, work_c, work_d];

fn main(args: &str) -> u8 {
    let mut weights = [0u64; 4];
    let mut n = 0;
    for (i, w) in arg(args, "mix").unwrap_or("80,20").split(',').enumerate() {
        match (weights.get_mut(i), w.parse::<u64>()) {
            (Some(slot), Ok(v)) => {
                *slot = v;
                n = i + 1;
            }
            _ => {
                println!("mix: bad argument mix=: up to four comma-separated weights");
                return exit_code::BAD_ARGS;
            }
        }
    }
    let (unit, rounds) = match (arg_num(args, "unit", 997), arg_num(args, "rounds", 100)) {
        (Ok(u), Ok(r)) => (u, r),
        (Err(e), _) | (_, Err(e)) => {
            println!("mix: {e}");
            return exit_code::BAD_ARGS;
        }
    };
    let idle = match arg_num(args, "idle", 0) {
        Ok(n) => n,
        Err(e) => {
            println!("mix: {e}");
            return exit_code::BAD_ARGS;
        }
    };
    if arg(args, "interrupts") == Some("on") {
        // SAFETY: this guest has no virtual interrupt source (no local APIC, no devices that
        // raise lines): STI lets only the host's interrupts stop it, as VM exits.
        unsafe { core::arch::asm!("sti", options(nomem, nostack)) };
    }
    let start = hvprof_guests::cpu::rdtsc();
    for _ in 0..rounds {
        for (f, w) in WORK.iter().zip(&weights[..n]) {
            f(core::hint::black_box(w * unit));
        }
    }
    let busy = hvprof_guests::cpu::rdtsc() - start;
    if idle > 0 {
        hvprof_guests::hypercall::set_timer(busy.saturating_mul(idle));
        hvprof_guests::cpu::hlt();
    }
    println!("mix: done rounds={rounds}");
    0
}
