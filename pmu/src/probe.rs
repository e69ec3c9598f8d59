//! Functional detection of the architectural PMU (Intel SDM Vol. 3B §21.2, "Architectural
//! Performance Monitoring").
//!
//! CPUID leaf 0AH alone lies on some platforms: Bochs 2.7 advertises version 3 with 4 general and
//! 3 fixed counters whose MSRs never count (they read 0; with Bochs' `ignore_bad_msrs=0` they
//! raise #GP instead). So the probe programs a counter, runs a known workload, and checks that the
//! counter moved. The MSR interface is a trait so the logic is unit-tested on the host against
//! models of working, silent and faulting PMUs.

use core::fmt;

/// MSR numbers (SDM Vol. 4, Table 2-2).
pub mod msr {
    pub const IA32_PMC0: u32 = 0xc1;
    pub const IA32_PERFEVTSEL0: u32 = 0x186;
    /// IA32_DEBUGCTL; bit 12 is Freeze_PerfMon_On_PMI.
    pub const IA32_DEBUGCTL: u32 = 0x1d9;
    pub const IA32_FIXED_CTR0: u32 = 0x309;
    /// Present when CPUID.01H:ECX.PDCM\[bit 15\] = 1.
    pub const IA32_PERF_CAPABILITIES: u32 = 0x345;
    pub const IA32_FIXED_CTR_CTRL: u32 = 0x38d;
    pub const IA32_PERF_GLOBAL_STATUS: u32 = 0x38e;
    pub const IA32_PERF_GLOBAL_CTRL: u32 = 0x38f;
    pub const IA32_PERF_GLOBAL_OVF_CTRL: u32 = 0x390;
    /// The name of 0x390 from architectural PMU version 4 on (same write-1-to-clear semantics).
    pub const IA32_PERF_GLOBAL_STATUS_RESET: u32 = 0x390;
    /// Full-width write aliases of IA32_PMCx (when IA32_PERF_CAPABILITIES.FW_WRITE = 1).
    pub const IA32_A_PMC0: u32 = 0x4c1;
    /// The x2APIC MSR of the LVT performance-monitoring counters register (xAPIC offset 0x340).
    pub const IA32_X2APIC_LVT_PMI: u32 = 0x834;
}

/// What CPUID leaf 0AH says (SDM Vol. 2A, CPUID, "Architectural Performance Monitoring Leaf").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PmuInfo {
    pub version: u8,
    pub gp_counters: u8,
    pub gp_width: u8,
    pub fixed_counters: u8,
    pub fixed_width: u8,
}

impl PmuInfo {
    /// Decodes EAX and EDX of CPUID.0AH.
    pub fn from_cpuid(eax: u32, edx: u32) -> Self {
        let version = eax as u8;
        Self {
            version,
            gp_counters: (eax >> 8) as u8,
            gp_width: (eax >> 16) as u8,
            // EDX[4:0] and EDX[12:5] are valid only from version 2 on.
            fixed_counters: if version >= 2 { (edx & 0x1f) as u8 } else { 0 },
            fixed_width: if version >= 2 { (edx >> 5) as u8 } else { 0 },
        }
    }
}

impl fmt::Display for PmuInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CPUID.0AH v{}: {} general ({} bits), {} fixed ({} bits)",
            self.version, self.gp_counters, self.gp_width, self.fixed_counters, self.fixed_width
        )
    }
}

/// A faulting MSR access (#GP on RDMSR/WRMSR).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsrFault {
    pub msr: u32,
    pub write: bool,
}

impl fmt::Display for MsrFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = if self.write { "WRMSR" } else { "RDMSR" };
        write!(f, "{op} {:#x} faulted", self.msr)
    }
}

/// MSR access that reports faults instead of taking them.
pub trait MsrAccess {
    fn read(&mut self, msr: u32) -> Result<u64, MsrFault>;
    fn write(&mut self, msr: u32, value: u64) -> Result<(), MsrFault>;
}

/// The counter the probe programmed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// Fixed counter 1, CPU_CLK_UNHALTED.THREAD.
    FixedCoreCycles,
    /// General counter 0 with the architectural event "UnHalted Core Cycles" (event 3CH, umask 0).
    General0CoreCycles,
}

impl fmt::Display for Counter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Counter::FixedCoreCycles => "fixed counter 1 (unhalted core cycles)",
            Counter::General0CoreCycles => "general counter 0 (event 3CH, unhalted core cycles)",
        })
    }
}

/// The probe's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// CPUID.0AH reports no architectural PMU at all.
    Absent,
    /// The counter moved by `delta` over the workload.
    Counting { counter: Counter, delta: u64 },
    /// Advertised, but the counter did not move.
    Silent { counter: Counter },
    /// Advertised, but programming it faulted.
    Faulted(MsrFault),
}

impl Probe {
    pub fn counting(&self) -> bool {
        matches!(self, Probe::Counting { .. })
    }
}

impl fmt::Display for Probe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Probe::Absent => write!(f, "no architectural PMU"),
            Probe::Counting { counter, delta } => {
                write!(f, "{counter} counted {delta} over the probe workload")
            }
            Probe::Silent { counter } => {
                write!(f, "{counter} did not move over the probe workload")
            }
            Probe::Faulted(fault) => write!(f, "{fault} while programming it"),
        }
    }
}

const FIXED_CTR1: u32 = msr::IA32_FIXED_CTR0 + 1;
/// IA32_FIXED_CTR_CTRL: fixed counter 1 enabled for ring 0 and ring 3 (bits 5:4).
const FIXED_CTR1_ENABLE: u64 = 0b11 << 4;
/// IA32_PERFEVTSEL: USR (16), OS (17), EN (22); event 3CH umask 0.
const EVTSEL_CORE_CYCLES: u64 = 0x3c | (1 << 16) | (1 << 17) | (1 << 22);

/// Programs one counter, runs `workload`, reads the counter, and puts every MSR it touched back
/// the way it found it. The fixed counter is preferred (it leaves the general counters free).
pub fn probe(info: &PmuInfo, msrs: &mut impl MsrAccess, workload: impl FnOnce()) -> Probe {
    if info.version == 0 || (info.gp_counters == 0 && info.fixed_counters == 0) {
        return Probe::Absent;
    }
    let counter = if info.version >= 2 && info.fixed_counters >= 2 {
        Counter::FixedCoreCycles
    } else {
        Counter::General0CoreCycles
    };
    match run(info, msrs, counter, workload) {
        Ok(0) => Probe::Silent { counter },
        Ok(delta) => Probe::Counting { counter, delta },
        Err(fault) => Probe::Faulted(fault),
    }
}

fn run(
    info: &PmuInfo,
    msrs: &mut impl MsrAccess,
    counter: Counter,
    workload: impl FnOnce(),
) -> Result<u64, MsrFault> {
    let global = info.version >= 2;
    let (ctr, ctl, enable, global_bit) = match counter {
        Counter::FixedCoreCycles => (
            FIXED_CTR1,
            msr::IA32_FIXED_CTR_CTRL,
            FIXED_CTR1_ENABLE,
            1u64 << 33,
        ),
        Counter::General0CoreCycles => (
            msr::IA32_PMC0,
            msr::IA32_PERFEVTSEL0,
            EVTSEL_CORE_CYCLES,
            1u64 << 0,
        ),
    };
    let saved_global = if global {
        Some(msrs.read(msr::IA32_PERF_GLOBAL_CTRL)?)
    } else {
        None
    };
    let saved_ctl = msrs.read(ctl)?;
    let saved_ctr = msrs.read(ctr)?;

    let result = (|| {
        if let Some(g) = saved_global {
            msrs.write(msr::IA32_PERF_GLOBAL_CTRL, g & !global_bit)?;
        }
        msrs.write(ctr, 0)?;
        msrs.write(ctl, (saved_ctl & !enable_mask(counter)) | enable)?;
        if let Some(g) = saved_global {
            msrs.write(msr::IA32_PERF_GLOBAL_CTRL, g | global_bit)?;
        }
        let before = msrs.read(ctr)?;
        workload();
        let after = msrs.read(ctr)?;
        Ok(after.wrapping_sub(before))
    })();

    // Restore in reverse order; a fault while restoring is reported only if the probe itself
    // succeeded.
    let restore = (|| {
        if let Some(g) = saved_global {
            msrs.write(msr::IA32_PERF_GLOBAL_CTRL, g)?;
        }
        msrs.write(ctl, saved_ctl)?;
        msrs.write(ctr, saved_ctr)
    })();
    let delta = result?;
    restore?;
    Ok(delta)
}

fn enable_mask(counter: Counter) -> u64 {
    match counter {
        Counter::FixedCoreCycles => 0xf << 4,
        Counter::General0CoreCycles => u64::MAX,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A model of the PMU MSRs. `counts` decides whether enabled counters advance when the
    /// workload runs; `faulting` lists MSRs that #GP.
    #[derive(Default)]
    struct Model {
        regs: HashMap<u32, u64>,
        counts: bool,
        faulting: Vec<u32>,
        writes: Vec<(u32, u64)>,
    }

    impl Model {
        fn tick(&mut self, n: u64) {
            if !self.counts {
                return;
            }
            let global = self
                .regs
                .get(&msr::IA32_PERF_GLOBAL_CTRL)
                .copied()
                .unwrap_or(0);
            let fixed = self
                .regs
                .get(&msr::IA32_FIXED_CTR_CTRL)
                .copied()
                .unwrap_or(0);
            if global & (1 << 33) != 0 && fixed & (0b11 << 4) != 0 {
                *self.regs.entry(FIXED_CTR1).or_default() += n;
            }
            let sel = self.regs.get(&msr::IA32_PERFEVTSEL0).copied().unwrap_or(0);
            if global & 1 != 0 && sel & (1 << 22) != 0 {
                *self.regs.entry(msr::IA32_PMC0).or_default() += n;
            }
        }
    }

    impl MsrAccess for std::rc::Rc<std::cell::RefCell<Model>> {
        fn read(&mut self, m: u32) -> Result<u64, MsrFault> {
            let s = self.borrow();
            if s.faulting.contains(&m) {
                return Err(MsrFault {
                    msr: m,
                    write: false,
                });
            }
            Ok(s.regs.get(&m).copied().unwrap_or(0))
        }
        fn write(&mut self, m: u32, v: u64) -> Result<(), MsrFault> {
            let mut s = self.borrow_mut();
            if s.faulting.contains(&m) {
                return Err(MsrFault {
                    msr: m,
                    write: true,
                });
            }
            s.writes.push((m, v));
            s.regs.insert(m, v);
            Ok(())
        }
    }

    fn model(counts: bool) -> std::rc::Rc<std::cell::RefCell<Model>> {
        let m = Model {
            counts,
            ..Default::default()
        };
        std::rc::Rc::new(std::cell::RefCell::new(m))
    }

    const V3: PmuInfo = PmuInfo {
        version: 3,
        gp_counters: 4,
        gp_width: 48,
        fixed_counters: 3,
        fixed_width: 48,
    };

    #[test]
    fn cpuid_decoding() {
        // Bochs haswell: EAX = 0x07300403 (v3, 4 x 48-bit), EDX = 0x00000603 (3 x 48-bit).
        assert_eq!(PmuInfo::from_cpuid(0x0730_0403, 0x0603), V3);
        // Version 1 has no fixed counters whatever EDX says.
        assert_eq!(PmuInfo::from_cpuid(0x0728_0201, 0xffff).fixed_counters, 0);
    }

    #[test]
    fn counting_pmu_is_found_and_restored() {
        let m = model(true);
        m.borrow_mut().regs.insert(msr::IA32_PERF_GLOBAL_CTRL, 0x3);
        m.borrow_mut().regs.insert(msr::IA32_FIXED_CTR_CTRL, 0x0b00);
        let w = m.clone();
        let p = probe(&V3, &mut m.clone(), move || w.borrow_mut().tick(1234));
        assert_eq!(
            p,
            Probe::Counting {
                counter: Counter::FixedCoreCycles,
                delta: 1234
            }
        );
        let s = m.borrow();
        assert_eq!(s.regs[&msr::IA32_PERF_GLOBAL_CTRL], 0x3);
        assert_eq!(s.regs[&msr::IA32_FIXED_CTR_CTRL], 0x0b00);
        assert_eq!(s.regs[&FIXED_CTR1], 0);
    }

    #[test]
    fn bochs_like_silent_pmu_is_not_counting() {
        let m = model(false);
        let w = m.clone();
        let p = probe(&V3, &mut m.clone(), move || w.borrow_mut().tick(10_000));
        assert_eq!(
            p,
            Probe::Silent {
                counter: Counter::FixedCoreCycles
            }
        );
        assert!(!p.counting());
        assert!(p.to_string().contains("did not move"));
    }

    #[test]
    fn faulting_msr_is_reported() {
        let m = model(true);
        m.borrow_mut().faulting.push(msr::IA32_FIXED_CTR_CTRL);
        let p = probe(&V3, &mut m.clone(), || {});
        assert_eq!(
            p,
            Probe::Faulted(MsrFault {
                msr: msr::IA32_FIXED_CTR_CTRL,
                write: false
            })
        );
        assert_eq!(p.to_string(), "RDMSR 0x38d faulted while programming it");
    }

    #[test]
    fn version1_uses_general_counter_without_global_ctrl() {
        let info = PmuInfo::from_cpuid(0x0728_0201, 0);
        let m = model(true);
        // No global control on v1: model it as always enabled.
        m.borrow_mut().regs.insert(msr::IA32_PERF_GLOBAL_CTRL, 1);
        let w = m.clone();
        let p = probe(&info, &mut m.clone(), move || w.borrow_mut().tick(77));
        assert_eq!(
            p,
            Probe::Counting {
                counter: Counter::General0CoreCycles,
                delta: 77
            }
        );
        assert!(
            m.borrow()
                .writes
                .iter()
                .all(|(r, _)| *r != msr::IA32_PERF_GLOBAL_CTRL)
        );
    }

    #[test]
    fn absent_pmu() {
        let m = model(true);
        assert_eq!(
            probe(&PmuInfo::default(), &mut m.clone(), || {}),
            Probe::Absent
        );
    }
}
