//! `busy`: a known instruction mix for the exit-statistics tests.
//!
//! Arguments (all default 0): `cpuid=N io=M vmcall=K hlt=H spin=S`. First `spin=S` rounds of
//! register arithmetic that cause no exit at all (for the VMX-preemption timer), then the mix. Runs exactly N CPUID (leaf 0),
//! M `out` of one byte to the unused port 0x2e8 (dropped by the hypervisor), K VERSION hypercalls
//! and H HLT, interleaved in one loop, then prints
//! `busy: done cpuid=N io=M vmcall=K` (plus ` hlt=H` when H > 0) and exits with 0.
//!
//! Nothing else in the guest executes CPUID, VMCALL or HLT, and nothing else touches port 0x2e8.
//! The other exits are the console's and the exit's own: every printed byte is one IN from the
//! UART's LSR (0x3fd) and one OUT to its THR (0x3f8), and the exit is one OUT to 0xf4; count
//! those separately. A bad argument prints `busy: bad argument ...` before any of the mix and
//! exits with 2.
//!
//! Interrupts are off in the guest: each HLT comes back only if the hypervisor resumes the vCPU
//! after the HLT exit (as a yield), so keep `hlt=0` unless it does.
#![no_std]
#![no_main]

use hvprof_guests::{arg_num, cpu, exit_code, hypercall, io, println};

hvprof_guests::guest_entry!(main);

/// A port nothing is behind: reads return all ones, writes are dropped and counted.
const UNUSED_PORT: u16 = 0x2e8;

fn main(args: &str) -> u8 {
    let mut counts = [0u64; 4];
    for (count, key) in counts.iter_mut().zip(["cpuid", "io", "vmcall", "hlt"]) {
        match arg_num(args, key, 0) {
            Ok(n) => *count = n,
            Err(e) => {
                println!("busy: {e}");
                return exit_code::BAD_ARGS;
            }
        }
    }
    let [cpuids, ios, vmcalls, hlts] = counts;
    let spins = match arg_num(args, "spin", 0) {
        Ok(n) => n,
        Err(e) => {
            println!("busy: {e}");
            return exit_code::BAD_ARGS;
        }
    };
    let mut x = 1u64;
    for i in 0..spins {
        x = core::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
    }
    core::hint::black_box(x);
    let rounds = cpuids.max(ios).max(vmcalls).max(hlts);
    for i in 0..rounds {
        if i < cpuids {
            cpu::cpuid(0, 0);
        }
        if i < ios {
            // SAFETY: nothing is behind port 0x2e8 (guest ABI: writes are dropped).
            unsafe { io::outb(UNUSED_PORT, i as u8) };
        }
        if i < vmcalls {
            hypercall::version();
        }
        if i < hlts {
            cpu::hlt();
        }
    }
    let measure = match arg_num(args, "measure", 0) {
        Ok(n) => n,
        Err(e) => {
            println!("busy: {e}");
            return exit_code::BAD_ARGS;
        }
    };
    if measure > 0 {
        let time = |f: &dyn Fn()| {
            (0..measure)
                .map(|_| {
                    let t = cpu::rdtsc();
                    f();
                    cpu::rdtsc() - t
                })
                .min()
                .unwrap_or(0)
        };
        let c = time(&|| {
            cpu::cpuid(0, 0);
        });
        // SAFETY: nothing is behind port 0x2e8 (guest ABI: writes are dropped).
        let o = time(&|| unsafe { io::outb(UNUSED_PORT, 0) });
        let v = time(&|| {
            hypercall::version();
        });
        println!("busy: round trip cpuid={c} io={o} vmcall={v} ticks");
    }
    if hlts > 0 {
        println!("busy: done cpuid={cpuids} io={ios} vmcall={vmcalls} hlt={hlts}");
    } else {
        println!("busy: done cpuid={cpuids} io={ios} vmcall={vmcalls}");
    }
    0
}
