//! `pmu`: drives the virtual PMU (`vpmu=`) the way a guest's profiler does, with counts known by
//! construction, and checks what it reads.
//!
//! Arguments: `n=N` (iterations of the counted loop, default 1000000), `period=P` (events
//! between PMIs in the interrupt test, default 100000), `pmi-loop=L` (its loop's iterations,
//! default 1000000), `storm=S` (iterations of a loop run with a period of 1, default 0: none),
//! `domain=1` (the VM has `vpmu=domain`: the counters also count the hypervisor's work on the
//! guest's exits, so the counts are at least the loop's, not equal to it).
//!
//! Every counted loop is one `asm!` block: the WRMSR to IA32_PERF_GLOBAL_CTRL that enables the
//! counters, `N` rounds of `dec`/`jnz`, two `xor`, and the WRMSR that disables them. A PMU that
//! counts as hardware (and KVM) do counts the enabling WRMSR and not the disabling one:
//! `2N + 3` instructions retired, in ring 0 (this guest never leaves it). The guest prints one
//! line per check (`pmu: <check> key=value ...`), `pmu: FAIL <why>` for each check that failed,
//! and exits with 0 when all passed, 1 otherwise.
//!
//! Without a virtual PMU (CPUID leaf 0AH all zero) it checks that the counters are out of reach
//! (RDPMC and the counter MSRs are #GP) and exits with 0. The PMI tests run where the module line
//! has `apic=on` (a local APIC at 0xfee00000).
#![no_std]
#![no_main]

use core::sync::atomic::{AtomicU64, Ordering};
use hvprof_guests::{arg, arg_num, cpu, exit_code, idt, paging, println};

hvprof_guests::guest_entry!(main);

const PMC0: u32 = 0xc1;
const PERFEVTSEL0: u32 = 0x186;
const FIXED_CTR0: u32 = 0x309;
const PERF_CAPABILITIES: u32 = 0x345;
const FIXED_CTR_CTRL: u32 = 0x38d;
const GLOBAL_STATUS: u32 = 0x38e;
const GLOBAL_CTRL: u32 = 0x38f;
const GLOBAL_OVF_CTRL: u32 = 0x390;
const A_PMC0: u32 = 0x4c1;

const USR: u64 = 1 << 16;
const OS: u64 = 1 << 17;
const EN: u64 = 1 << 22;
/// Instructions retired, core cycles, LLC misses (architectural events, SDM Vol. 3B Table 21-1).
const INSTRUCTIONS: u64 = 0xc0;
const CYCLES: u64 = 0x3c;
const LLC_MISSES: u64 = 0x412e;
/// IA32_FIXED_CTR_CTRL's field of one counter: count in ring 0, PMI on overflow.
const FIXED_OS: u64 = 1;
const FIXED_PMI: u64 = 8;

const LAPIC: u64 = 0xfee0_0000;
const SVR: u64 = 0xf0;
const EOI: u64 = 0xb0;
const LVT_PERF: u64 = 0x340;
const PMI_VECTOR: u8 = 0x40;
const WIDTH: u32 = 48;

static PMIS: AtomicU64 = AtomicU64::new(0);
/// The counter's value after each PMI's reload (2^48 minus the period).
static RELOAD: AtomicU64 = AtomicU64::new(0);

struct Checks {
    failed: u32,
}

impl Checks {
    fn check(&mut self, ok: bool, what: core::fmt::Arguments<'_>) {
        if !ok {
            self.failed += 1;
            println!("pmu: FAIL {what}");
        }
    }
}

fn rd(msr: u32) -> u64 {
    cpu::rdmsr_safe(msr).unwrap_or(u64::MAX)
}

fn wr(msr: u32, value: u64) -> bool {
    // SAFETY: the performance-monitoring MSRs change nothing this guest relies on.
    unsafe { cpu::wrmsr_safe(msr, value) }.is_ok()
}

/// The counted loop: enable (`enable` into IA32_PERF_GLOBAL_CTRL), `n` >= 1 rounds, disable.
#[inline(never)]
fn counted_loop(n: u64, enable: u64) {
    // SAFETY: WRMSR of IA32_PERF_GLOBAL_CTRL (the guest's virtual PMU) and a register countdown.
    unsafe {
        core::arch::asm!(
            "wrmsr",
            "2:",
            "dec {n}",
            "jnz 2b",
            "xor eax, eax",
            "xor edx, edx",
            "wrmsr",
            n = inout(reg) n.max(1) => _,
            inout("eax") enable as u32 => _,
            inout("edx") (enable >> 32) as u32 => _,
            in("ecx") GLOBAL_CTRL,
            options(nostack),
        );
    }
}

fn lapic_write(offset: u64, value: u32) {
    // SAFETY: the local APIC's page, mapped by `main` before any use.
    unsafe { ((LAPIC + offset) as *mut u32).write_volatile(value) }
}

fn lapic_read(offset: u64) -> u32 {
    // SAFETY: as for `lapic_write`.
    unsafe { ((LAPIC + offset) as *const u32).read_volatile() }
}

/// The PMI handler, as a profiler's: count, clear the overflow, unmask the LVT entry the PMI
/// masked, EOI, reload the counter.
/// The counter is reloaded last, as the counters are re-enabled last by Linux's handler: with a
/// period of 1 it wraps again at once, with the entry unmasked, and the PMIs follow each other
/// as fast as the hypervisor lets them.
fn on_pmi(_: u8) {
    PMIS.fetch_add(1, Ordering::Relaxed);
    wr(GLOBAL_OVF_CTRL, 1 << 32);
    lapic_write(LVT_PERF, u32::from(PMI_VECTOR));
    lapic_write(EOI, 0);
    wr(FIXED_CTR0, RELOAD.load(Ordering::Relaxed));
}

fn main(args: &str) -> u8 {
    let mut nums = [0u64; 5];
    for (v, (key, default)) in nums.iter_mut().zip([
        ("n", 1_000_000),
        ("period", 100_000),
        ("pmi-loop", 1_000_000),
        ("storm", 0),
        ("domain", 0),
    ]) {
        match arg_num(args, key, default) {
            Ok(x) => *v = x,
            Err(e) => {
                println!("pmu: {e}");
                return exit_code::BAD_ARGS;
            }
        }
    }
    let [n, period, pmi_loop, storm, domain] = nums;
    let domain = domain != 0;
    // Equal to the loop's count, or (domain) at least it.
    let counts = |got: u64, want: u64| if domain { got >= want } else { got == want };
    if n == 0 || period == 0 || period >= 1 << 31 || pmi_loop == 0 {
        println!("pmu: bad arguments: n, period (below 2^31) and pmi-loop must be at least 1");
        return exit_code::BAD_ARGS;
    }
    let mut c = Checks { failed: 0 };
    let leaf = cpu::cpuid(0xa, 0);
    let version = leaf.eax & 0xff;
    if version == 0 {
        let rdpmc = cpu::rdpmc_safe(0).is_err();
        let msr = cpu::rdmsr_safe(PMC0).is_err();
        println!(
            "pmu: none cpuid-0a={:#x} rdpmc-gp={rdpmc} pmc0-gp={msr}",
            leaf.eax
        );
        c.check(rdpmc && msr, format_args!("no PMU, yet a counter answered"));
        println!("pmu: done failed={}", c.failed);
        return u8::from(c.failed != 0);
    }
    let (gp, width, fixed) = (
        (leaf.eax >> 8) & 0xff,
        (leaf.eax >> 16) & 0xff,
        leaf.edx & 0x1f,
    );
    println!(
        "pmu: cpuid version={version} gp={gp} width={width} fixed={fixed} fixed-width={} ebx={:#x}",
        (leaf.edx >> 5) & 0xff,
        leaf.ebx
    );
    c.check(
        version >= 2 && gp >= 4 && fixed >= 3 && width == WIDTH,
        format_args!("CPUID.0AH {:#x}/{:#x}", leaf.eax, leaf.edx),
    );

    // Counters never enabled read 0.
    let never: u64 = (0..4)
        .map(|i| rd(PMC0 + i))
        .chain((0..3).map(|i| rd(FIXED_CTR0 + i)))
        .fold(0, |a, v| a | v);
    println!("pmu: never-enabled or={never:#x}");
    c.check(
        never == 0,
        format_args!("a counter never enabled reads {never:#x}"),
    );

    // Exact counts: fixed 0-2 (instructions, cycles, reference cycles) in ring 0; general 0
    // instructions in ring 0, 1 instructions in ring 3 (none), 2 core cycles, 3 an event the
    // PMU does not count.
    // IA32_PERF_GLOBAL_CTRL resets with the general counters enabled: off while programming.
    wr(GLOBAL_CTRL, 0);
    wr(FIXED_CTR_CTRL, FIXED_OS | FIXED_OS << 4 | FIXED_OS << 8);
    wr(PERFEVTSEL0, EN | OS | INSTRUCTIONS);
    wr(PERFEVTSEL0 + 1, EN | USR | INSTRUCTIONS);
    wr(PERFEVTSEL0 + 2, EN | OS | CYCLES);
    wr(PERFEVTSEL0 + 3, EN | OS | USR | LLC_MISSES);
    for i in 0..4 {
        wr(PMC0 + i, 0);
    }
    for i in 0..3 {
        wr(FIXED_CTR0 + i, 0);
    }
    counted_loop(n, 0xf | 0x7 << 32);
    let fixed0 = rd(FIXED_CTR0);
    let cycles = rd(FIXED_CTR0 + 1);
    let reference = rd(FIXED_CTR0 + 2);
    let gp: [u64; 4] = core::array::from_fn(|i| rd(PMC0 + i as u32));
    let expected = 2 * n.max(1) + 3;
    println!(
        "pmu: exact n={n} expected={expected} instructions={fixed0} cycles={cycles} ref-cycles={reference} gp-instructions={} gp-user={} gp-cycles={} gp-llc-misses={}",
        gp[0], gp[1], gp[2], gp[3]
    );
    c.check(
        counts(fixed0, expected),
        format_args!("fixed 0 counted {fixed0}, not {expected}"),
    );
    c.check(
        gp[0] == fixed0,
        format_args!("general 0 counted {}, fixed 0 {fixed0}", gp[0]),
    );
    c.check(
        gp[1] == 0,
        format_args!("ring 3 instructions {} in a ring-0 guest", gp[1]),
    );
    c.check(
        gp[3] == 0,
        format_args!("an uncounted event read {}", gp[3]),
    );
    c.check(
        cycles >= 2 * n && reference == cycles && gp[2] == cycles,
        format_args!(
            "cycles {cycles}, reference {reference}, general 2 {}",
            gp[2]
        ),
    );

    // RDPMC reads the same counters; a counter that does not exist is #GP.
    let by_rdpmc = (cpu::rdpmc_safe(0), cpu::rdpmc_safe(1 << 30));
    let bad: [bool; 3] = [4, 1 << 30 | 3, 1 << 31].map(|e| cpu::rdpmc_safe(e).is_err());
    println!(
        "pmu: rdpmc general0={:?} fixed0={:?} bad-index-gp={}",
        by_rdpmc.0,
        by_rdpmc.1,
        bad.iter().all(|&b| b)
    );
    c.check(
        by_rdpmc == (Ok(gp[0]), Ok(fixed0)),
        format_args!("RDPMC disagrees with RDMSR"),
    );
    c.check(
        bad.iter().all(|&b| b),
        format_args!("RDPMC of a missing counter: {bad:?}"),
    );

    // Reserved bits are #GP and change nothing; so are the MSRs this PMU does not have.
    let sel = rd(PERFEVTSEL0);
    let refused = [
        !wr(PERFEVTSEL0, sel | 1 << 32),
        !wr(PERFEVTSEL0, sel | 1 << 21),
        !wr(FIXED_CTR_CTRL, 1 << 2),
        !wr(GLOBAL_CTRL, 1 << 4),
        !wr(GLOBAL_CTRL, 1 << 35),
        !wr(GLOBAL_STATUS, 0),
        cpu::rdmsr_safe(PERF_CAPABILITIES).is_err(),
        cpu::rdmsr_safe(A_PMC0).is_err(),
        cpu::rdmsr_safe(PMC0 + 4).is_err(),
    ];
    let kept = rd(PERFEVTSEL0) == sel;
    println!(
        "pmu: reserved refused={}/{} unchanged={kept}",
        refused.iter().filter(|&&r| r).count(),
        refused.len()
    );
    c.check(
        refused.iter().all(|&r| r) && kept,
        format_args!("reserved: {refused:?} kept={kept}"),
    );

    // Overflow: the counter wraps into IA32_PERF_GLOBAL_STATUS; OVF_CTRL clears it.
    wr(FIXED_CTR_CTRL, FIXED_OS);
    wr(FIXED_CTR0, (1 << WIDTH) - 1000);
    counted_loop(1000, 1 << 32);
    let status = rd(GLOBAL_STATUS);
    let after = rd(FIXED_CTR0);
    wr(GLOBAL_OVF_CTRL, 1 << 32);
    let cleared = rd(GLOBAL_STATUS);
    println!("pmu: overflow status={status:#x} counter-after={after} cleared={cleared:#x}");
    c.check(
        status == 1 << 32 && counts(after, 2003 - 1000) && cleared == 0,
        format_args!("overflow: status {status:#x}, counter {after}, after clearing {cleared:#x}"),
    );

    // PMIs through the local APIC's LVT performance counter entry, if there is a local APIC.
    // The VM has a local APIC where its module line says `apic=on` (the hypervisor's key; the
    // guest sees its whole command line).
    if arg(args, "apic") == Some("on") {
        // SAFETY: the local APIC's page is MMIO, mapped to itself; nothing else uses it.
        if unsafe { paging::map_identity(LAPIC) }.is_err() {
            println!("pmu: cannot map the local APIC");
            return 1;
        }
        idt::on_interrupt(PMI_VECTOR, on_pmi);
        lapic_write(SVR, 0x1ff);
        lapic_write(LVT_PERF, u32::from(PMI_VECTOR));
        for (name, p, rounds) in [("pmi", period, pmi_loop), ("storm", 1, storm)] {
            if rounds == 0 {
                continue;
            }
            PMIS.store(0, Ordering::Relaxed);
            RELOAD.store((1 << WIDTH) - p, Ordering::Relaxed);
            wr(FIXED_CTR0, (1 << WIDTH) - p);
            wr(FIXED_CTR_CTRL, FIXED_OS | FIXED_PMI);
            let t0 = cpu::rdtsc();
            x86_64_sti();
            counted_loop(rounds, 1 << 32);
            x86_64_cli();
            let ticks = cpu::rdtsc() - t0;
            let pmis = PMIS.load(Ordering::Relaxed);
            let lvt = lapic_read(LVT_PERF);
            println!(
                "pmu: {name} period={p} rounds={rounds} instructions={} pmis={pmis} ticks={ticks} lvt={lvt:#x}",
                2 * rounds + 3
            );
            if name == "pmi" {
                // One PMI per period, less those the counter skids past before the handler
                // reloads it (a skid of a few hundred events is a small part of a period).
                let most = (2 * rounds + 3) / p;
                c.check(
                    (domain || pmis <= most + 1) && pmis + 2 >= most * 9 / 10,
                    format_args!(
                        "{pmis} PMIs for {} instructions at period {p}",
                        2 * rounds + 3
                    ),
                );
            } else {
                c.check(pmis > 1, format_args!("a period of 1 raised {pmis} PMIs"));
            }
        }
        wr(FIXED_CTR_CTRL, 0);
    } else {
        println!("pmu: pmi skipped: no local APIC (apic=on gives one)");
    }
    println!("pmu: done failed={}", c.failed);
    u8::from(c.failed != 0)
}

fn x86_64_sti() {
    // SAFETY: the IDT handles every vector (the runtime's), and the PMI's has its handler.
    unsafe { core::arch::asm!("sti", options(nomem, nostack)) }
}

fn x86_64_cli() {
    // SAFETY: turns interrupts off again.
    unsafe { core::arch::asm!("cli", options(nomem, nostack)) }
}
