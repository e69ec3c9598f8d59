//! Bringing up the application processors listed in the MADT: INIT-SIPI-SIPI through the boot
//! CPU's local APIC (Intel SDM Vol. 3A §10.4.4, "MP Initialization Example"), each AP entering
//! `ap_main` in 64-bit mode through the trampoline in `boot/src/ap.rs`; then the TSC consistency
//! check across CPUs. Each AP then waits for the boot CPU to build the VMs (`release`), enters
//! VMX operation, starts its own sampler and runs the scheduler until every VM has stopped.

use crate::arch::host_apic::Lapic;
use crate::percpu::MAX_CPUS;
use crate::tsc::rdtsc;
use crate::{arch, interrupts, memory, println, profiler, scheduler, vmx_root};
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use hvprof_boot::ap::{self, Params};

const AP_STACK: u64 = 64 * 1024;

/// CPUs that reached `ap_main` (the boot CPU counts as one).
static ONLINE: AtomicU32 = AtomicU32::new(1);
/// The index of the AP the boot CPU is starting (written before the SIPI, read by the AP).
static STARTING: AtomicU64 = AtomicU64::new(0);
/// TSC ping-pong between the boot CPU and the AP being checked.
static PING: AtomicU64 = AtomicU64::new(0);
static PONG: AtomicU64 = AtomicU64::new(0);

/// What the boot CPU learnt while starting the APs.
pub struct SmpReport {
    pub online: usize,
    /// Largest TSC difference seen between the boot CPU and an AP, beyond the round trip.
    pub tsc_skew: u64,
}

fn delay(ticks: u64) {
    let start = rdtsc();
    while rdtsc() - start < ticks {
        core::hint::spin_loop();
    }
}

/// Starts every AP in `apic_ids` (the boot CPU's own id is skipped). `page` is a free 4 KiB page
/// below 1 MiB for the trampoline.
pub fn start_aps(lapic: &Lapic, apic_ids: &[u32], page: u32, tsc_hz: u64) -> SmpReport {
    let me = lapic.id();
    let image = ap::image();
    let mut skew = 0u64;
    for &id in apic_ids {
        if id == me {
            continue;
        }
        // pCPUs are numbered in start-up order: the boot CPU is 0.
        let index = ONLINE.load(Ordering::Acquire) as usize;
        if index >= MAX_CPUS {
            println!(
                "smp: warning: APIC id {id} and the CPUs after it are not started (hvprof runs on at most {MAX_CPUS} CPUs)"
            );
            break;
        }
        let Some(stack) = memory::alloc_zeroed(AP_STACK, 4096) else {
            println!("smp: error: no memory for the stack of CPU {index}; not started");
            break;
        };
        // Where its hypervisor call chains may lie.
        crate::profiler::sampler::cpu(index).set_stack(stack, stack + AP_STACK);
        let params = Params {
            cr3: x86_64::registers::control::Cr3::read_raw()
                .0
                .start_address()
                .as_u64(),
            stack_top: stack + AP_STACK,
            entry: ap_main as *const () as u64,
            index: index as u64,
        };
        // SAFETY: `page` is a free page below 1 MiB (chosen from available memory outside the
        // boot information and the modules), identity-mapped; nothing else uses it now.
        let bytes = unsafe { core::slice::from_raw_parts_mut(page as u64 as *mut u8, 4096) };
        image.install(bytes, page, &params);
        let before = ONLINE.load(Ordering::Acquire);
        STARTING.store(index as u64, Ordering::Release);
        PING.store(0, Ordering::Release);
        PONG.store(0, Ordering::Release);
        // INIT (level assert), 10 ms, then two start-up IPIs 200 µs apart (§10.4.4).
        lapic.send_ipi(id, 0x4500);
        delay(tsc_hz / 100);
        for _ in 0..2 {
            lapic.send_ipi(id, 0x4600 | (page >> 12));
            delay(tsc_hz / 5000);
        }
        let deadline = rdtsc() + tsc_hz / 10;
        while ONLINE.load(Ordering::Acquire) == before && rdtsc() < deadline {
            core::hint::spin_loop();
        }
        if ONLINE.load(Ordering::Acquire) == before {
            println!("smp: error: CPU {index} (APIC id {id}) did not start within 100 ms");
            // It may still come up later and take this number: start no more.
            break;
        }
        skew = skew.max(check_tsc());
    }
    SmpReport {
        online: ONLINE.load(Ordering::Acquire) as usize,
        tsc_skew: skew,
    }
}

/// The boot CPU's side of the TSC check with the AP that just came up: 16 ping-pongs. If the
/// TSCs agree, the AP's reading lies between the boot CPU's before and after; the largest amount
/// by which it falls outside is the skew this check can see.
fn check_tsc() -> u64 {
    let mut skew = 0u64;
    for round in 1..=16u64 {
        let before = rdtsc();
        PING.store(round, Ordering::Release);
        while PONG.load(Ordering::Acquire) != round {
            core::hint::spin_loop();
        }
        let after = rdtsc();
        let theirs = PING_TSC.load(Ordering::Acquire);
        let outside = before
            .saturating_sub(theirs)
            .max(theirs.saturating_sub(after));
        skew = skew.max(outside);
    }
    PING.store(u64::MAX, Ordering::Release);
    skew
}

static PING_TSC: AtomicU64 = AtomicU64::new(0);

/// The AP's side of `check_tsc`.
fn answer_tsc() {
    let mut seen = 0;
    loop {
        let round = PING.load(Ordering::Acquire);
        if round == u64::MAX {
            return;
        }
        if round != seen {
            PING_TSC.store(rdtsc(), Ordering::Release);
            PONG.store(round, Ordering::Release);
            seen = round;
        }
        core::hint::spin_loop();
    }
}

/// What the APs need to run vCPUs, given by the boot CPU once the VMs are built.
pub struct ApWork {
    pub caps: &'static hvprof_vmx::caps::VmxCaps,
    pub period: u64,
    pub pmu: Option<&'static hvprof_pmu::probe::PmuInfo>,
}

/// `None`: there is no work (the APs stay halted).
static WORK: spin::Once<Option<ApWork>> = spin::Once::new();
/// APs that have left the scheduler (or never entered it).
static FINISHED: AtomicU32 = AtomicU32::new(0);

/// Lets the APs go: with work, each enters VMX operation and runs the scheduler.
pub fn release(work: Option<ApWork>) {
    WORK.call_once(|| work);
}

/// Waits until every AP that came online has left the scheduler (after `release`).
pub fn wait_for_aps() {
    let aps = ONLINE.load(Ordering::Acquire) - 1;
    while FINISHED.load(Ordering::Acquire) < aps {
        core::hint::spin_loop();
    }
}

/// Where an AP arrives, in 64-bit mode on its own stack, interrupts off.
extern "C" fn ap_main(index: u64) -> ! {
    let cpu = index as usize;
    crate::percpu::init(cpu, arch::gdt::init_ap());
    interrupts::init();
    ONLINE.fetch_add(1, Ordering::AcqRel);
    answer_tsc();
    if let Some(work) = WORK.wait() {
        match vmx_root::enable(work.caps) {
            Ok(_) => {
                let lapic = Lapic::init();
                profiler::start(work.period, lapic, work.pmu);
                scheduler::run_cpu(cpu);
                profiler::stop();
            }
            Err(e) => {
                println!("smp: error: pCPU {cpu} cannot enter VMX operation: {e}");
                scheduler::cpu_unavailable(cpu, "it could not enter VMX operation");
            }
        }
    }
    FINISHED.fetch_add(1, Ordering::AcqRel);
    crate::power::halt_forever()
}
