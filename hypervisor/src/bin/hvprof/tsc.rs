//! The TSC: its frequency (for periods given in time units), from CPUID leaf 15H when it names
//! the crystal, else measured against the 8254 PIT (channel 2, mode 0, 10 ms) as Linux's
//! `pit_calibrate_tsc` does. In Bochs with `clock: sync=none` the TSC counts instructions, so the
//! "frequency" is the emulated instructions per emulated second (`ips`).

use x86_64::instructions::port::Port;

/// The calibrated frequency (0 before `calibrate`).
static HZ: core::sync::atomic::AtomicU64 = core::sync::atomic::AtomicU64::new(0);

/// The TSC frequency `calibrate` found.
pub fn hz() -> u64 {
    HZ.load(core::sync::atomic::Ordering::Relaxed)
}

pub fn rdtsc() -> u64 {
    // SAFETY: RDTSC has no side effects (CR4.TSD is clear in the hypervisor).
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[derive(Clone, Copy, Debug)]
pub struct TscInfo {
    pub hz: u64,
    pub source: &'static str,
    pub invariant: bool,
}

const PIT_HZ: u64 = 1_193_182;
/// 10 ms of PIT ticks.
const PIT_COUNT: u16 = 11_932;

pub fn calibrate() -> TscInfo {
    let info = measure();
    HZ.store(info.hz, core::sync::atomic::Ordering::Relaxed);
    info
}

fn measure() -> TscInfo {
    let cpuid = raw_cpuid::CpuId::new();
    let invariant = cpuid
        .get_advanced_power_mgmt_info()
        .is_some_and(|p| p.has_invariant_tsc());
    if let Some(hz) = cpuid.get_tsc_info().and_then(|t| t.tsc_frequency()) {
        return TscInfo {
            hz,
            source: "CPUID.15H",
            invariant,
        };
    }
    match pit_calibrate() {
        Some(hz) => TscInfo {
            hz,
            source: "PIT",
            invariant,
        },
        None => TscInfo {
            // Nothing to measure against: assume 1 GHz and say so.
            hz: 1_000_000_000,
            source: "assumed (PIT did not count)",
            invariant,
        },
    }
}

fn pit_calibrate() -> Option<u64> {
    let mut ctrl = Port::<u8>::new(0x61);
    let mut cmd = Port::<u8>::new(0x43);
    let mut ch2 = Port::<u8>::new(0x42);
    // SAFETY: ports 0x61 (NMI status/control: speaker gate), 0x43 and 0x42 (PIT command and
    // channel 2) belong to the platform timer, which nothing else in the hypervisor uses;
    // channel 2 drives only the speaker, whose output bit (1) is kept clear.
    unsafe {
        let v = ctrl.read();
        ctrl.write((v & !0x02) | 0x01);
        // Channel 2, lobyte/hibyte, mode 0 (interrupt on terminal count), binary.
        cmd.write(0b1011_0000);
        ch2.write(PIT_COUNT as u8);
        ch2.write((PIT_COUNT >> 8) as u8);
        let start = rdtsc();
        let mut spins = 0u64;
        // OUT2 (port 0x61 bit 5) goes high at terminal count.
        while ctrl.read() & 0x20 == 0 {
            spins += 1;
            if spins > 50_000_000 {
                return None;
            }
        }
        let ticks = rdtsc() - start;
        Some(ticks * PIT_HZ / PIT_COUNT as u64)
    }
}
