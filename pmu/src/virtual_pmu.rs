//! A guest's virtual architectural PMU: what a vCPU sees of performance monitoring (SDM Vol. 3B
//! §21.2, "Architectural Performance Monitoring", version 2), as a model of its state.
//!
//! The model is the guest-facing half: CPUID leaf 0AH, the MSRs with their reserved bits (a
//! write that sets one is a #GP, as on hardware), the counters, their overflow into
//! IA32_PERF_GLOBAL_STATUS, and whether an overflow asks for a PMI. What the counters count comes
//! from outside ([`VirtualPmu::count`]: a slice of the vCPU's time in one privilege mode, with its
//! instructions, core cycles and reference cycles), so the same model serves a backend that
//! derives them from the vCPU's own guest time (where one TSC tick is one instruction, as in
//! Bochs) and one that reads real counters. It touches no hardware and tests on the host.
//!
//! What it offers, and leaves out:
//! - version 2: 4 general counters and 3 fixed counters, 48 bits wide; the architectural events
//!   UnHalted Core Cycles (3CH/00H), Instructions Retired (C0H/00H) and UnHalted Reference Cycles
//!   (3CH/01H), the others reported unavailable in CPUID.0AH:EBX (a general counter programmed
//!   with one of them, or with any other event, counts nothing);
//! - a general counter with an edge, invert or counter-mask qualifier counts nothing (those
//!   count cycles by a threshold on events per cycle, which the slices do not carry);
//! - no IA32_PERF_CAPABILITIES (so no full-width writes through IA32_A_PMCx: the guest writes a
//!   counter through IA32_PMCx, whose bits 31:0 are sign-extended, SDM §21.2.6), no AnyThread
//!   (version 3), no PEBS or freeze on PMI.

use crate::probe::msr;
use crate::{evtsel, fixed_ctrl};

/// General counters.
pub const GENERAL: usize = 4;
/// Fixed counters: 0 instructions retired, 1 core cycles, 2 reference cycles (§21.2.2).
pub const FIXED: usize = 3;
/// Counter width in bits (general and fixed).
pub const WIDTH: u32 = 48;
/// The architectural PMU version offered.
pub const VERSION: u32 = 2;
/// Architectural events CPUID.0AH:EBX describes (bits 0 to 6, §21.2.1.2).
const ARCH_EVENTS: u32 = 7;
/// Of those, the ones counted: core cycles, instructions retired, reference cycles.
const COUNTED_EVENTS: u32 = 0b111;

const MASK: u64 = (1 << WIDTH) - 1;

/// IA32_PERFEVTSELx bits reserved here: 63:32 and AnyThread (bit 21, version 3).
const EVTSEL_RESERVED: u64 = 0xffff_ffff_0000_0000 | 1 << 21;

/// The IA32_FIXED_CTR_CTRL bits a counter may set here (AnyThread is version 3).
const FIXED_ALLOWED: u64 = fixed_ctrl::OS | fixed_ctrl::USR | fixed_ctrl::PMI;

/// IA32_PERF_GLOBAL_STATUS bits beyond the counters' (§21.2.2, Figure 21-3).
const OVF_BUFFER: u64 = 1 << 62;
const COND_CHGD: u64 = 1 << 63;

/// The counter bits of IA32_PERF_GLOBAL_CTRL and _STATUS: general counters from bit 0, fixed
/// counters from bit 32.
const COUNTER_BITS: u64 = ((1 << GENERAL) - 1) | ((1 << FIXED) - 1) << 32;

/// A WRMSR or RDMSR the processor would refuse with #GP(0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gp;

/// One slice of a vCPU's execution, in one privilege mode, and what it retired and ran.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slice {
    /// CPL > 0 (counted by USR, not by OS).
    pub user: bool,
    pub instructions: u64,
    pub core_cycles: u64,
    pub ref_cycles: u64,
}

/// The architectural events the model counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Counted {
    #[default]
    Instructions,
    CoreCycles,
    RefCycles,
}

impl Counted {
    fn of(self, s: &Slice) -> u64 {
        match self {
            Counted::Instructions => s.instructions,
            Counted::CoreCycles => s.core_cycles,
            Counted::RefCycles => s.ref_cycles,
        }
    }
}

/// A counter that counts something, as its control registers program it: made once at each
/// write to them (`VirtualPmu::plan`), so that counting a slice, at every VM exit, decodes
/// nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Active {
    /// Its bit in IA32_PERF_GLOBAL_CTRL and _STATUS.
    bit: u64,
    /// Its value's index in `VirtualPmu::counters`.
    slot: usize,
    event: Counted,
    /// Counts in user mode (USR), in kernel mode (OS).
    user: bool,
    kernel: bool,
    /// Asks for a PMI when it wraps (INT, or the fixed field's PMI).
    pmi: bool,
}

impl Active {
    fn counts(&self, user: bool) -> bool {
        if user { self.user } else { self.kernel }
    }
}

/// One vCPU's virtual PMU.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VirtualPmu {
    evtsel: [u64; GENERAL],
    /// The counters' values: the general ones, then the fixed ones (from [`GENERAL`]).
    counters: [u64; GENERAL + FIXED],
    fixed_ctrl: u64,
    global_ctrl: u64,
    global_status: u64,
    /// The counters that count something now, `active[..n_active]`, general ones first.
    active: [Active; GENERAL + FIXED],
    n_active: usize,
}

impl VirtualPmu {
    /// The state after reset: every counter 0 and disabled. (A processor's
    /// IA32_PERF_GLOBAL_CTRL resets to the general counters' enable bits set, §21.2.2, which
    /// with every IA32_PERFEVTSELx clear counts nothing; Linux writes it before use either way.)
    pub fn new() -> Self {
        let mut pmu = VirtualPmu {
            global_ctrl: (1 << GENERAL) - 1,
            ..Self::default()
        };
        pmu.plan();
        pmu
    }

    /// CPUID leaf 0AH as (EAX, EBX, ECX, EDX) (SDM Vol. 2A, CPUID, "Architectural Performance
    /// Monitoring Leaf").
    pub fn cpuid(&self) -> (u32, u32, u32, u32) {
        let eax = VERSION | (GENERAL as u32) << 8 | WIDTH << 16 | ARCH_EVENTS << 24;
        let ebx = ((1 << ARCH_EVENTS) - 1) & !COUNTED_EVENTS;
        let edx = FIXED as u32 | WIDTH << 5;
        (eax, ebx, 0, edx)
    }

    /// Whether `index` is one of the MSRs this model answers (any other performance-monitoring
    /// MSR, IA32_A_PMCx and IA32_PERF_CAPABILITIES among them, is the caller's #GP).
    pub fn handles(index: u32) -> bool {
        Self::register(index).is_some()
    }

    fn register(index: u32) -> Option<Register> {
        let in_range = |base: u32, n: usize| index.checked_sub(base).filter(|&i| (i as usize) < n);
        if let Some(i) = in_range(msr::IA32_PERFEVTSEL0, GENERAL) {
            return Some(Register::EventSelect(i as usize));
        }
        if let Some(i) = in_range(msr::IA32_PMC0, GENERAL) {
            return Some(Register::General(i as usize));
        }
        if let Some(i) = in_range(msr::IA32_FIXED_CTR0, FIXED) {
            return Some(Register::Fixed(i as usize));
        }
        match index {
            msr::IA32_FIXED_CTR_CTRL => Some(Register::FixedCtrl),
            msr::IA32_PERF_GLOBAL_STATUS => Some(Register::GlobalStatus),
            msr::IA32_PERF_GLOBAL_CTRL => Some(Register::GlobalCtrl),
            msr::IA32_PERF_GLOBAL_OVF_CTRL => Some(Register::GlobalOvfCtrl),
            _ => None,
        }
    }

    /// RDMSR.
    pub fn read(&self, index: u32) -> Result<u64, Gp> {
        Ok(match Self::register(index).ok_or(Gp)? {
            Register::EventSelect(i) => self.evtsel[i],
            Register::General(i) => self.counters[i],
            Register::Fixed(i) => self.counters[GENERAL + i],
            Register::FixedCtrl => self.fixed_ctrl,
            Register::GlobalStatus => self.global_status,
            Register::GlobalCtrl => self.global_ctrl,
            // Write-only in effect: reads as 0, as KVM's does.
            Register::GlobalOvfCtrl => 0,
        })
    }

    /// WRMSR: `Err(Gp)` leaves the state as it was.
    pub fn write(&mut self, index: u32, value: u64) -> Result<(), Gp> {
        let register = Self::register(index).ok_or(Gp)?;
        self.write_register(register, value)?;
        if matches!(
            register,
            Register::EventSelect(_) | Register::FixedCtrl | Register::GlobalCtrl
        ) {
            self.plan();
        }
        Ok(())
    }

    /// The counters that count something, as the control registers program them now.
    fn plan(&mut self) {
        let mut n = 0;
        for i in 0..GENERAL {
            let Some((event, sel)) = self.general_event(i) else {
                continue;
            };
            self.active[n] = Active {
                bit: 1 << i,
                slot: i,
                event,
                user: sel & evtsel::USR != 0,
                kernel: sel & evtsel::OS != 0,
                pmi: sel & evtsel::INT != 0,
            };
            n += usize::from(self.active[n].user || self.active[n].kernel);
        }
        for (j, event) in [
            Counted::Instructions,
            Counted::CoreCycles,
            Counted::RefCycles,
        ]
        .into_iter()
        .enumerate()
        {
            let field = self.fixed_ctrl >> (4 * j) & FIXED_ALLOWED;
            if self.global_ctrl & 1 << (32 + j) == 0 {
                continue;
            }
            self.active[n] = Active {
                bit: 1 << (32 + j),
                slot: GENERAL + j,
                event,
                user: field & fixed_ctrl::USR != 0,
                kernel: field & fixed_ctrl::OS != 0,
                pmi: field & fixed_ctrl::PMI != 0,
            };
            n += usize::from(self.active[n].user || self.active[n].kernel);
        }
        // The slots past the last stay as they were: never read.
        self.n_active = n;
    }

    fn write_register(&mut self, register: Register, value: u64) -> Result<(), Gp> {
        match register {
            Register::EventSelect(i) => {
                if value & EVTSEL_RESERVED != 0 {
                    return Err(Gp);
                }
                self.evtsel[i] = value;
            }
            // IA32_PMCx takes bits 31:0 and sign-extends them (§21.2.6: full-width writes go
            // through IA32_A_PMCx, which needs IA32_PERF_CAPABILITIES.FW_WRITE).
            Register::General(i) => {
                self.counters[i] = (value as u32 as i32 as i64 as u64) & MASK;
            }
            // The fixed counters take the counter's width.
            Register::Fixed(i) => self.counters[GENERAL + i] = value & MASK,
            Register::FixedCtrl => {
                let allowed = (0..FIXED).fold(0, |m, i| m | FIXED_ALLOWED << (4 * i));
                if value & !allowed != 0 {
                    return Err(Gp);
                }
                self.fixed_ctrl = value;
            }
            // Read-only.
            Register::GlobalStatus => return Err(Gp),
            Register::GlobalCtrl => {
                if value & !COUNTER_BITS != 0 {
                    return Err(Gp);
                }
                self.global_ctrl = value;
            }
            // Write 1 to clear.
            Register::GlobalOvfCtrl => {
                if value & !(COUNTER_BITS | OVF_BUFFER | COND_CHGD) != 0 {
                    return Err(Gp);
                }
                self.global_status &= !value;
            }
        }
        Ok(())
    }

    /// RDPMC with `ecx` (SDM Vol. 2B, RDPMC: bit 30 selects the fixed counters, the low bits the
    /// counter). Whether RDPMC is allowed at the guest's CPL (CR4.PCE) is the caller's check.
    pub fn rdpmc(&self, ecx: u32) -> Result<u64, Gp> {
        let index = (ecx & 0x3fff_ffff) as usize;
        let counters: &[u64] = if ecx & 1 << 30 != 0 {
            &self.counters[GENERAL..]
        } else {
            &self.counters[..GENERAL]
        };
        if ecx & 1 << 31 != 0 {
            // The "fast read" bit of early processors: reserved here.
            return Err(Gp);
        }
        counters.get(index).copied().ok_or(Gp)
    }

    /// What general counter `i` counts now, if anything.
    fn general_event(&self, i: usize) -> Option<(Counted, u64)> {
        let sel = self.evtsel[i];
        if sel & evtsel::EN == 0 || self.global_ctrl & 1 << i == 0 {
            return None;
        }
        if sel & (evtsel::EDGE | evtsel::INV | evtsel::CMASK) != 0 {
            return None;
        }
        let event = match (sel & evtsel::EVENT, (sel & evtsel::UMASK) >> 8) {
            (0x3c, 0x00) => Counted::CoreCycles,
            (0xc0, 0x00) => Counted::Instructions,
            (0x3c, 0x01) => Counted::RefCycles,
            _ => return None,
        };
        Some((event, sel))
    }

    /// Counts `slice` on every counter enabled for its mode. Returns whether an overflow asks
    /// for a PMI (a counter that wrapped with its INT or PMI bit set); every wrap sets its bit in
    /// IA32_PERF_GLOBAL_STATUS either way (§21.2.2).
    pub fn count(&mut self, slice: &Slice) -> bool {
        self.count_except(slice, 0)
    }

    /// [`VirtualPmu::count`], leaving out the counters whose IA32_PERF_GLOBAL_CTRL bits are in
    /// `real` (those a hardware backend runs on the real PMU, `hardware_vpmu`).
    pub fn count_except(&mut self, slice: &Slice, real: u64) -> bool {
        let mut pmi = false;
        for a in &self.active[..self.n_active] {
            if real & a.bit != 0 || !a.counts(slice.user) {
                continue;
            }
            if add(&mut self.counters[a.slot], a.event.of(slice)) {
                self.global_status |= a.bit;
                pmi |= a.pmi;
            }
        }
        pmi
    }

    /// General counter `i`'s IA32_PERFEVTSELx and value, fixed counter `j`'s value, and the
    /// fixed counters' control and the global control: what a hardware backend loads into the
    /// real PMU. (Panics on an index beyond [`GENERAL`] or [`FIXED`].)
    pub fn evtsel(&self, i: usize) -> u64 {
        self.evtsel[i]
    }

    pub fn general_counter(&self, i: usize) -> u64 {
        self.counters[..GENERAL][i]
    }

    pub fn fixed_counter(&self, j: usize) -> u64 {
        self.counters[GENERAL..][j]
    }

    pub fn fixed_ctrl(&self) -> u64 {
        self.fixed_ctrl
    }

    pub fn global_ctrl(&self) -> u64 {
        self.global_ctrl
    }

    /// What the real PMU counted on general counter `i` (and fixed counter `j`): saved back.
    pub fn set_general_counter(&mut self, i: usize, value: u64) {
        self.counters[..GENERAL][i] = value & MASK;
    }

    pub fn set_fixed_counter(&mut self, j: usize, value: u64) {
        self.counters[GENERAL..][j] = value & MASK;
    }

    /// Counters with these IA32_PERF_GLOBAL_STATUS bits wrapped on the real PMU: their bits set
    /// here. Whether one of them asks for a PMI (INT, or the fixed field's PMI).
    pub fn overflowed(&mut self, bits: u64) -> bool {
        let bits = bits & COUNTER_BITS;
        self.global_status |= bits;
        let general = (0..GENERAL).any(|i| bits & 1 << i != 0 && self.evtsel[i] & evtsel::INT != 0);
        let fixed = (0..FIXED).any(|j| {
            bits & 1 << (32 + j) != 0 && self.fixed_ctrl >> (4 * j) & fixed_ctrl::PMI != 0
        });
        general || fixed
    }

    /// Whether any counter counts anything now (enabled, in some mode, an event the model
    /// counts): while none does, counting a slice changes nothing.
    #[inline]
    pub fn counting(&self) -> bool {
        self.n_active != 0
    }

    /// Whether some enabled counter counts in one privilege mode and not the other (USR without
    /// OS, or OS without USR): its count depends on where inside a run the guest changes mode,
    /// which the backend must then see.
    pub fn mode_sensitive(&self) -> bool {
        self.mode_sensitive_except(0)
    }

    /// [`VirtualPmu::mode_sensitive`] of the counters whose IA32_PERF_GLOBAL_CTRL bits are not
    /// in `real` (a real counter tells the modes apart by itself).
    pub fn mode_sensitive_except(&self, real: u64) -> bool {
        self.active[..self.n_active]
            .iter()
            .any(|a| real & a.bit == 0 && a.user != a.kernel)
    }

    /// Of the counters that would ask for a PMI when they wrap and count in the mode `user`,
    /// the fewest events any of them needs to wrap: a backend that derives the events from
    /// guest time stops the guest there (as the host's sampling deadlines do). `None`: no such
    /// counter.
    pub fn events_to_pmi(&self, user: bool) -> Option<u64> {
        self.events_to_pmi_except(user, 0)
    }

    /// [`VirtualPmu::events_to_pmi`] of the counters whose IA32_PERF_GLOBAL_CTRL bits are not
    /// in `real` (those a hardware backend runs on the real PMU wrap there by themselves).
    pub fn events_to_pmi_except(&self, user: bool, real: u64) -> Option<u64> {
        let mut fewest = None;
        for a in &self.active[..self.n_active] {
            if real & a.bit != 0 || !a.pmi || !a.counts(user) {
                continue;
            }
            let left = (1 << WIDTH) - self.counters[a.slot];
            fewest = Some(fewest.map_or(left, |f: u64| f.min(left)));
        }
        fewest
    }
}

/// Adds `n` to a `WIDTH`-bit counter; whether it wrapped.
fn add(counter: &mut u64, n: u64) -> bool {
    // `counter` < 2^WIDTH: the sum wraps u64 only past 2^64, which the second test sees.
    let sum = counter.wrapping_add(n);
    *counter = sum & MASK;
    sum >> WIDTH != 0 || sum < n
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Register {
    EventSelect(usize),
    General(usize),
    Fixed(usize),
    FixedCtrl,
    GlobalStatus,
    GlobalCtrl,
    GlobalOvfCtrl,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::PmuInfo;
    use proptest::prelude::*;

    const INSTRUCTIONS: u64 = 0xc0;
    const CYCLES: u64 = 0x3c;
    const REF_CYCLES: u64 = 0x013c;

    fn user(n: u64) -> Slice {
        Slice {
            user: true,
            instructions: n,
            core_cycles: 2 * n,
            ref_cycles: 3 * n,
        }
    }

    fn kernel(n: u64) -> Slice {
        Slice {
            user: false,
            ..user(n)
        }
    }

    #[test]
    fn cpuid_describes_version_2_with_its_counters_as_the_probe_reads_it() {
        let p = VirtualPmu::new();
        let (eax, ebx, ecx, edx) = p.cpuid();
        let info = PmuInfo::from_cpuid(eax, edx);
        assert_eq!(info.version, 2);
        assert_eq!(usize::from(info.gp_counters), GENERAL);
        assert_eq!(u32::from(info.gp_width), WIDTH);
        assert_eq!(usize::from(info.fixed_counters), FIXED);
        assert_eq!(u32::from(info.fixed_width), WIDTH);
        // Cycles, instructions and reference cycles available (bits clear), the other four
        // architectural events not (bits set).
        assert_eq!(ebx, 0b111_1000);
        assert_eq!(eax >> 24, 7);
        assert_eq!(ecx, 0);
    }

    #[test]
    fn a_counter_of_one_mode_makes_the_pmu_mode_sensitive() {
        let mut p = VirtualPmu::new();
        assert!(!p.mode_sensitive(), "nothing enabled");
        let sel = evtsel::EN | evtsel::USR | evtsel::OS | INSTRUCTIONS;
        p.write(msr::IA32_PERFEVTSEL0, sel).unwrap();
        assert!(!p.mode_sensitive(), "both modes");
        p.write(msr::IA32_PERFEVTSEL0, sel & !evtsel::OS).unwrap();
        assert!(p.mode_sensitive(), "instructions:u");
        p.write(msr::IA32_PERF_GLOBAL_CTRL, 0).unwrap();
        assert!(!p.mode_sensitive(), "globally off");
        // An event the model does not count cannot depend on the mode.
        p.write(msr::IA32_PERF_GLOBAL_CTRL, 1).unwrap();
        p.write(msr::IA32_PERFEVTSEL0, evtsel::EN | evtsel::USR | 0x412e)
            .unwrap();
        assert!(!p.mode_sensitive());
        // Fixed counter 1 counting ring 0 only.
        p.write(msr::IA32_FIXED_CTR_CTRL, fixed_ctrl::OS << 4)
            .unwrap();
        assert!(!p.mode_sensitive(), "not enabled globally");
        p.write(msr::IA32_PERF_GLOBAL_CTRL, 1 << 33).unwrap();
        assert!(p.mode_sensitive());
        p.write(
            msr::IA32_FIXED_CTR_CTRL,
            (fixed_ctrl::OS | fixed_ctrl::USR) << 4,
        )
        .unwrap();
        assert!(!p.mode_sensitive());
    }

    #[test]
    fn reserved_bits_are_a_gp_and_change_nothing() {
        let mut p = VirtualPmu::new();
        let before = p.clone();
        let sel0 = msr::IA32_PERFEVTSEL0;
        assert_eq!(p.write(sel0, 1 << 32), Err(Gp));
        assert_eq!(p.write(sel0, 1 << 21), Err(Gp), "AnyThread is version 3");
        assert_eq!(p.write(msr::IA32_FIXED_CTR_CTRL, 0b0100), Err(Gp));
        assert_eq!(p.write(msr::IA32_FIXED_CTR_CTRL, 1 << 12), Err(Gp));
        assert_eq!(p.write(msr::IA32_PERF_GLOBAL_CTRL, 1 << 4), Err(Gp));
        assert_eq!(p.write(msr::IA32_PERF_GLOBAL_CTRL, 1 << 35), Err(Gp));
        assert_eq!(p.write(msr::IA32_PERF_GLOBAL_STATUS, 0), Err(Gp));
        assert_eq!(p.write(msr::IA32_PERF_GLOBAL_OVF_CTRL, 1 << 40), Err(Gp));
        assert_eq!(p, before);
        // Counters beyond the offered ones, the full-width aliases and PERF_CAPABILITIES are not
        // this model's: the caller's #GP.
        for index in [
            msr::IA32_PERFEVTSEL0 + 4,
            msr::IA32_PMC0 + 4,
            msr::IA32_FIXED_CTR0 + 3,
            msr::IA32_A_PMC0,
            msr::IA32_PERF_CAPABILITIES,
        ] {
            assert!(!VirtualPmu::handles(index), "{index:#x}");
            assert_eq!(p.read(index), Err(Gp));
        }
        // What Linux writes is taken.
        let linux = CYCLES | evtsel::USR | evtsel::OS | evtsel::INT | evtsel::EN;
        assert_eq!(p.write(sel0 + 3, linux), Ok(()));
        assert_eq!(p.read(sel0 + 3), Ok(linux));
        assert_eq!(p.write(msr::IA32_FIXED_CTR_CTRL, 0xbbb), Ok(()));
        assert_eq!(p.write(msr::IA32_PERF_GLOBAL_CTRL, 0x7_0000_000f), Ok(()));
    }

    #[test]
    fn counters_count_their_event_in_their_modes_when_enabled_twice() {
        let mut p = VirtualPmu::new();
        let sel = |n| msr::IA32_PERFEVTSEL0 + n;
        p.write(sel(0), INSTRUCTIONS | evtsel::USR | evtsel::EN)
            .unwrap();
        p.write(sel(1), CYCLES | evtsel::OS | evtsel::EN).unwrap();
        p.write(sel(2), REF_CYCLES | evtsel::USR | evtsel::OS | evtsel::EN)
            .unwrap();
        // Enabled locally, not globally.
        p.write(sel(3), INSTRUCTIONS | evtsel::USR | evtsel::EN)
            .unwrap();
        p.write(msr::IA32_PERF_GLOBAL_CTRL, 0b0111 | 0b111 << 32)
            .unwrap();
        // Fixed: instructions in user mode, cycles in both, reference cycles off.
        p.write(msr::IA32_FIXED_CTR_CTRL, 0x032).unwrap();
        assert!(!p.count(&user(100)));
        assert!(!p.count(&kernel(10)));
        let pmc = |p: &VirtualPmu, n| p.read(msr::IA32_PMC0 + n).unwrap();
        let fixed = |p: &VirtualPmu, n| p.read(msr::IA32_FIXED_CTR0 + n).unwrap();
        assert_eq!(pmc(&p, 0), 100);
        assert_eq!(pmc(&p, 1), 20);
        assert_eq!(pmc(&p, 2), 330);
        assert_eq!(pmc(&p, 3), 0);
        assert_eq!((fixed(&p, 0), fixed(&p, 1), fixed(&p, 2)), (100, 220, 0));
        // A qualifier the slices cannot honour, or another event: nothing.
        p.write(sel(0), INSTRUCTIONS | evtsel::USR | evtsel::EN | 1 << 24)
            .unwrap();
        p.write(sel(1), 0x2e | 0x41 << 8 | evtsel::OS | evtsel::EN)
            .unwrap();
        p.count(&user(5));
        p.count(&kernel(5));
        assert_eq!((pmc(&p, 0), pmc(&p, 1)), (100, 20));
        // Globally disabled: nothing.
        p.write(msr::IA32_PERF_GLOBAL_CTRL, 0).unwrap();
        p.count(&user(1000));
        assert_eq!((pmc(&p, 2), fixed(&p, 0)), (360, 105));
    }

    #[test]
    fn a_wrap_sets_its_status_bit_and_asks_for_a_pmi_only_with_int() {
        let mut p = VirtualPmu::new();
        p.write(
            msr::IA32_PERFEVTSEL0,
            INSTRUCTIONS | evtsel::USR | evtsel::EN,
        )
        .unwrap();
        p.write(
            msr::IA32_PERFEVTSEL0 + 1,
            INSTRUCTIONS | evtsel::USR | evtsel::EN | evtsel::INT,
        )
        .unwrap();
        p.write(msr::IA32_FIXED_CTR_CTRL, 0b1010 << 4).unwrap();
        p.write(msr::IA32_PERF_GLOBAL_CTRL, 0b11 | 0b10 << 32)
            .unwrap();
        // Linux arms a period of N as -N through the 32-bit write, sign-extended to 48 bits.
        p.write(msr::IA32_PMC0, (-1000i64) as u64).unwrap();
        assert_eq!(p.read(msr::IA32_PMC0), Ok(MASK - 999));
        p.write(msr::IA32_PMC0 + 1, (-500i64) as u64).unwrap();
        p.write(msr::IA32_FIXED_CTR0 + 1, MASK - 99).unwrap();
        assert_eq!(p.events_to_pmi(true), Some(100), "fixed 1: 100 core cycles");
        assert_eq!(p.events_to_pmi(false), None);
        assert!(!p.count(&user(40)), "80 cycles, 40 instructions: no wrap");
        assert!(p.count(&user(20)), "the fixed counter wraps, with PMI");
        assert_eq!(
            p.read(msr::IA32_PERF_GLOBAL_STATUS),
            Ok(1 << 33),
            "only the fixed counter"
        );
        assert_eq!(p.read(msr::IA32_FIXED_CTR0 + 1), Ok(20));
        assert_eq!(p.events_to_pmi(true), Some(440), "general counter 1");
        // General counter 0 wraps without INT: its bit, no PMI.
        assert!(!p.count(&user(440 - 1)));
        assert!(p.count(&user(1000)));
        assert_eq!(p.read(msr::IA32_PERF_GLOBAL_STATUS), Ok(1 << 33 | 0b11));
        // Write 1 to clear; a read of OVF_CTRL gives 0.
        p.write(msr::IA32_PERF_GLOBAL_OVF_CTRL, 1 << 33 | 1)
            .unwrap();
        assert_eq!(p.read(msr::IA32_PERF_GLOBAL_STATUS), Ok(0b10));
        assert_eq!(p.read(msr::IA32_PERF_GLOBAL_OVF_CTRL), Ok(0));
    }

    #[test]
    fn rdpmc_reads_the_general_and_fixed_counters() {
        let mut p = VirtualPmu::new();
        p.write(msr::IA32_PMC0 + 2, 7).unwrap();
        p.write(msr::IA32_FIXED_CTR0 + 1, 9).unwrap();
        assert_eq!(p.rdpmc(2), Ok(7));
        assert_eq!(p.rdpmc(1 << 30 | 1), Ok(9));
        assert_eq!(p.rdpmc(4), Err(Gp));
        assert_eq!(p.rdpmc(1 << 30 | 3), Err(Gp));
        assert_eq!(p.rdpmc(1 << 31), Err(Gp));
    }

    proptest! {
        /// Any sequence of writes and slices: the counters stay within their width, the status
        /// holds only counter bits, a refused write changes nothing, and a PMI is asked for only
        /// when a counter with INT or PMI wrapped.
        #[test]
        fn any_guest_keeps_the_model_consistent(
            ops in proptest::collection::vec(
                (0u32..0x400, any::<u64>(), any::<bool>(), 0u64..1 << 50),
                1..200,
            )
        ) {
            let mut p = VirtualPmu::new();
            let indices = [
                msr::IA32_PERFEVTSEL0, msr::IA32_PERFEVTSEL0 + 3, msr::IA32_PMC0,
                msr::IA32_PMC0 + 1, msr::IA32_FIXED_CTR0, msr::IA32_FIXED_CTR0 + 2,
                msr::IA32_FIXED_CTR_CTRL, msr::IA32_PERF_GLOBAL_CTRL,
                msr::IA32_PERF_GLOBAL_STATUS, msr::IA32_PERF_GLOBAL_OVF_CTRL,
            ];
            for (pick, value, is_user, n) in ops {
                if pick % 3 == 0 {
                    let pmi = p.count(&Slice { user: is_user, instructions: n, core_cycles: n, ref_cycles: n });
                    // A wrap always sets its status bit.
                    prop_assert!(!pmi || p.status_and_counters().0 != 0);
                } else {
                    let index = indices[pick as usize % indices.len()];
                    let before = p.clone();
                    if p.write(index, value).is_err() {
                        prop_assert_eq!(&p, &before);
                    }
                }
                let (status, counters) = p.status_and_counters();
                prop_assert_eq!(status & !COUNTER_BITS, 0);
                prop_assert!(counters.iter().all(|&c| c <= MASK));
            }
        }

        /// The counters planned at each write (`plan`) count, stop for PMIs and tell the modes
        /// apart exactly as the control registers read at each slice say: any programming
        /// (events counted and not, modes, INT and PMI bits, EDGE/INV/CMASK, enables), any
        /// counters left to the real PMU (`real`), any slice.
        #[test]
        fn the_plan_is_what_the_registers_say(
            sels in proptest::collection::vec(
                (any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>(), 0usize..6, any::<bool>()),
                GENERAL,
            ),
            fixed_ctrl in 0u64..1 << 12,
            global in any::<u64>(),
            values in proptest::collection::vec(0u64..1 << WIDTH, GENERAL + FIXED),
            real in any::<u64>(),
            slices in proptest::collection::vec((any::<bool>(), 0u64..1 << 20), 1..8),
        ) {
            let mut p = VirtualPmu::new();
            let events = [INSTRUCTIONS, CYCLES, REF_CYCLES, 0x2e, 0xc4, 0x013c | 0x4f << 24];
            for (i, &(en, usr, os, int, event, edge)) in sels.iter().enumerate() {
                let bit = |on: bool, b: u64| if on { b } else { 0 };
                let sel = events[event]
                    | bit(en, evtsel::EN)
                    | bit(usr, evtsel::USR)
                    | bit(os, evtsel::OS)
                    | bit(int, evtsel::INT)
                    | bit(edge, evtsel::EDGE);
                p.write(msr::IA32_PERFEVTSEL0 + i as u32, sel).unwrap();
            }
            p.write(msr::IA32_FIXED_CTR_CTRL, fixed_ctrl & 0xbbb).unwrap();
            p.write(msr::IA32_PERF_GLOBAL_CTRL, global & COUNTER_BITS).unwrap();
            for (i, &v) in values.iter().enumerate() {
                if i < GENERAL {
                    p.set_general_counter(i, v);
                } else {
                    p.set_fixed_counter(i - GENERAL, v);
                }
            }
            let real = real & COUNTER_BITS;
            let mut reference = p.clone();
            for (user, n) in slices {
                let slice = Slice { user, instructions: n, core_cycles: n + 1, ref_cycles: n + 2 };
                prop_assert_eq!(p.counting(), reference.decoded_counting());
                prop_assert_eq!(p.mode_sensitive_except(real), reference.decoded_mode_sensitive(real));
                for mode in [false, true] {
                    prop_assert_eq!(
                        p.events_to_pmi_except(mode, real),
                        reference.decoded_events_to_pmi(mode, real)
                    );
                }
                let pmi = p.count_except(&slice, real);
                prop_assert_eq!(pmi, reference.decoded_count(&slice, real));
                prop_assert_eq!(p.status_and_counters(), reference.status_and_counters());
            }
        }
    }

    /// The counters each control register programs, decoded from the registers at each call:
    /// the reference the plan is held against.
    impl VirtualPmu {
        fn decoded(&self) -> impl Iterator<Item = (u64, Counted, bool, bool, bool)> + '_ {
            let general = (0..GENERAL).filter_map(|i| {
                let (event, sel) = self.general_event(i)?;
                Some((
                    1 << i,
                    event,
                    sel & evtsel::USR != 0,
                    sel & evtsel::OS != 0,
                    sel & evtsel::INT != 0,
                ))
            });
            let fixed = [
                Counted::Instructions,
                Counted::CoreCycles,
                Counted::RefCycles,
            ]
            .into_iter()
            .enumerate()
            .filter(|&(j, _)| self.global_ctrl & 1 << (32 + j) != 0)
            .map(|(j, event)| {
                let field = self.fixed_ctrl >> (4 * j);
                (
                    1 << (32 + j),
                    event,
                    field & fixed_ctrl::USR != 0,
                    field & fixed_ctrl::OS != 0,
                    field & fixed_ctrl::PMI != 0,
                )
            });
            general.chain(fixed)
        }
        fn value(&mut self, bit: u64) -> &mut u64 {
            let i = bit.trailing_zeros() as usize;
            &mut self.counters[if i >= 32 { GENERAL + i - 32 } else { i }]
        }
        fn decoded_counting(&self) -> bool {
            self.decoded().any(|(_, _, u, k, _)| u || k)
        }
        fn decoded_mode_sensitive(&self, real: u64) -> bool {
            self.decoded()
                .any(|(bit, _, u, k, _)| real & bit == 0 && u != k)
        }
        fn decoded_events_to_pmi(&self, user: bool, real: u64) -> Option<u64> {
            let mut me = self.clone();
            self.decoded()
                .filter(|&(bit, _, u, k, int)| real & bit == 0 && int && if user { u } else { k })
                .map(|(bit, ..)| (1 << WIDTH) - *me.value(bit))
                .min()
        }
        fn decoded_count(&mut self, slice: &Slice, real: u64) -> bool {
            let mut pmi = false;
            let counters: std::vec::Vec<_> = self.decoded().collect();
            for (bit, event, u, k, int) in counters {
                if real & bit != 0 || !(if slice.user { u } else { k }) {
                    continue;
                }
                if add(self.value(bit), event.of(slice)) {
                    self.global_status |= bit;
                    pmi |= int;
                }
            }
            pmi
        }
    }

    impl VirtualPmu {
        fn status_and_counters(&self) -> (u64, [u64; GENERAL + FIXED]) {
            (self.global_status, self.counters)
        }
    }
}
