//! The architectural-PMU sampling source: a counter that overflows every `period` events and
//! raises a performance-monitoring interrupt (PMI) delivered as an NMI.
//!
//! Written for real hardware and nested KVM (`-cpu host,pmu=on`). Bochs 2.7, where the end-to-end
//! tests run, has no working PMU (its counter MSRs read 0 and never count), so nothing here runs
//! end to end on the build machine: the logic is unit-tested on the host against a model of the
//! PMU MSRs and of the local APIC's LVT performance-monitoring counters entry. Run
//! [`crate::probe::probe`] first: CPUID.0AH alone lies.
//!
//! Section numbers are those of the SDM editions where "Performance Monitoring" is Vol. 3B
//! chapter 21 and the APIC is Vol. 3A chapter 12 (older editions: chapters 18-20 and 10-11).
//!
//! # Rules this module follows
//! - A counter counts when its own control enables it for the current ring *and*, from version 2
//!   on, its bit in IA32_PERF_GLOBAL_CTRL is set (§21.2.2). Version 1 has no global MSRs at all
//!   (§21.2.1).
//! - IA32_PERFEVTSELx: event select 7:0, umask 15:8, USR 16, OS 17, INT 20 (PMI on overflow),
//!   EN 22 (§21.2.1.1). IA32_FIXED_CTR_CTRL: one nibble per fixed counter, bits 1:0 = ring
//!   enable (01b ring 0, 10b rings > 0, 11b all), bit 2 AnyThread, bit 3 PMI (§21.2.2).
//! - On overflow (wrap to 0) a version ≥ 2 PMU sets the counter's bit in
//!   IA32_PERF_GLOBAL_STATUS (PMCx: bit x, fixed counter i: bit 32 + i), which stays set until
//!   software writes 1 to the same bit of IA32_PERF_GLOBAL_OVF_CTRL, named
//!   IA32_PERF_GLOBAL_STATUS_RESET from version 4 on (§21.2.2, §21.2.4). The counter itself keeps
//!   counting from 0.
//! - WRMSR to IA32_PMCx writes bits 31:0 and sign-extends bit 31 into the upper bits (§21.2.1.1).
//!   Full-width writes to a general counter go through IA32_A_PMCx (0x4C1 + x), available when
//!   IA32_PERF_CAPABILITIES.FW_WRITE\[bit 13\] = 1 (§21.2.6 "Full-Width Writes to Performance
//!   Counter Registers"). Fixed counters are written at full width.
//! - The PMI goes through the LVT performance-monitoring counters entry (xAPIC offset 340H, x2APIC
//!   MSR 834H). Delivery mode 100b is NMI (the vector is ignored). "When the local APIC handles a
//!   performance-monitoring counters interrupt, it automatically sets the mask flag in the LVT
//!   performance counter register ... It can be cleared only by software" (Vol. 3A §12.5.1): the
//!   handler must unmask it or no further PMI arrives. KVM emulates this since 2023 (commit
//!   a16eb25b09c0); unmasking unconditionally is right on both old and new hosts.
//!
//! # The period, the overshoot and the handler's own cycles
//! The counter is loaded with `-period` (modulo 2^width) and overflows after `period` events. It
//! keeps counting while the NMI is delivered and handled (the sampler does not set
//! IA32_DEBUGCTL.Freeze_PerfMon_On_PMI, Vol. 3B "Freezing LBR and Performance Counters on PMI",
//! and needs it clear). That is intended: with reference cycles, the hypervisor's own time is
//! sampled like any other. The handler therefore reloads with `since - period`, where `since` is
//! what the counter holds (events after the wrap): the next sample comes `period` events after the
//! previous overflow, not after the reload, so no events are dropped except the few between the
//! RDMSR and the WRMSR of the reload. If `since` exceeds `period` (the NMI was held off), the whole
//! periods in it are counted in [`Sampler::missed_periods`] and the phase is kept. What a sample
//! costs is measured separately by the sample path: it reads the TSC when it starts and when it
//! ends, and the record carries the difference, so every profile says what profiling cost.
//!
//! # Period limit
//! `1 ..= 2^(w-1) - 1`, where `w` is the counter width, or 32 for a general counter without
//! FW_WRITE (the sign extension of a 32-bit write must produce `-period`, so the period fits 31
//! bits). Keeping the loaded value's top bit set is also how a version 1 PMU, which has no status
//! MSR, tells that the counter wrapped: the top bit is clear only after the overflow.

use core::fmt;

use crate::probe::{MsrAccess, MsrFault, PmuInfo, msr};

/// The local APIC's LVT performance-monitoring counters register (Vol. 3A §12.5.1).
pub mod lvt {
    /// xAPIC MMIO offset of the register.
    pub const XAPIC_OFFSET: u32 = 0x340;
    /// x2APIC MSR of the register.
    pub const X2APIC_MSR: u32 = crate::probe::msr::IA32_X2APIC_LVT_PMI;
    /// Delivery mode, bits 10:8.
    pub const DELIVERY_MODE_MASK: u32 = 0b111 << 8;
    /// Delivery mode 100b: NMI (the vector field is ignored).
    pub const DELIVERY_NMI: u32 = 0b100 << 8;
    /// Delivery status (read-only), bit 12.
    pub const DELIVERY_STATUS: u32 = 1 << 12;
    /// Mask, bit 16: set at reset and by the local APIC when it delivers a PMI.
    pub const MASKED: u32 = 1 << 16;
    /// What the sampler writes: NMI delivery, unmasked.
    pub const NMI_UNMASKED: u32 = DELIVERY_NMI;
}

use crate::{evtsel, fixed_ctrl};

/// IA32_PERF_CAPABILITIES.FW_WRITE (§21.2.6).
pub const PERF_CAPABILITIES_FW_WRITE: u64 = 1 << 13;

/// What to sample on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The paper's CPU_CLK_UNHALTED.REF: fixed counter 2 (CPU_CLK_UNHALTED.REF_TSC, TSC rate), or
    /// the architectural event "UnHalted Reference Cycles" (3CH, umask 01H) on a general counter,
    /// which counts at a fixed reference frequency that may differ from the TSC's (the core
    /// crystal or bus clock on many parts; §21.2.1.2). Check [`Sampler::counter`].
    RefCycles,
    /// Fixed counter 1 (CPU_CLK_UNHALTED.THREAD) or "UnHalted Core Cycles" (3CH, umask 00H).
    CoreCycles,
    /// Fixed counter 0 (INST_RETIRED.ANY) or "Instructions Retired" (C0H, umask 00H).
    Instructions,
    /// A model-specific event on a general counter; no availability check is possible.
    Custom { event: u8, umask: u8 },
}

impl Event {
    /// The fixed counter that counts this event (§21.2.2, association of the fixed-function
    /// counters with architectural events).
    pub const fn fixed_counter(self) -> Option<u8> {
        match self {
            Event::Instructions => Some(0),
            Event::CoreCycles => Some(1),
            Event::RefCycles => Some(2),
            Event::Custom { .. } => None,
        }
    }

    /// The bit of CPUID.0AH:EBX that says the architectural event is *not* available
    /// (§21.2.1.2, pre-defined architectural performance events).
    pub const fn architectural_index(self) -> Option<u8> {
        match self {
            Event::CoreCycles => Some(0),
            Event::Instructions => Some(1),
            Event::RefCycles => Some(2),
            Event::Custom { .. } => None,
        }
    }

    /// Event select and umask for a general counter.
    pub const fn encoding(self) -> (u8, u8) {
        match self {
            Event::RefCycles => (0x3c, 0x01),
            Event::CoreCycles => (0x3c, 0x00),
            Event::Instructions => (0xc0, 0x00),
            Event::Custom { event, umask } => (event, umask),
        }
    }
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::RefCycles => f.write_str("unhalted reference cycles"),
            Event::CoreCycles => f.write_str("unhalted core cycles"),
            Event::Instructions => f.write_str("instructions retired"),
            Event::Custom { event, umask } => write!(f, "event {event:#04x} umask {umask:#04x}"),
        }
    }
}

/// The counter a [`Sampler`] uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CounterChoice {
    /// IA32_FIXED_CTRi.
    Fixed(u8),
    /// IA32_PMCi with IA32_PERFEVTSELi.
    General(u8),
}

impl fmt::Display for CounterChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CounterChoice::Fixed(i) => write!(f, "fixed counter {i}"),
            CounterChoice::General(i) => write!(f, "general counter {i}"),
        }
    }
}

/// Capabilities beyond [`PmuInfo`] that the sampler needs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SamplerCaps {
    /// IA32_PERF_CAPABILITIES.FW_WRITE: general counters are writable at full width through
    /// IA32_A_PMCx.
    pub full_width_write: bool,
    /// Bit i set: architectural event i is not available on a general counter (CPUID.0AH:EBX,
    /// with the bits at or above the vector length EAX\[31:24\] set too).
    pub unavailable_events: u32,
}

impl SamplerCaps {
    /// From CPUID.0AH EAX and EBX; events past the length of the EBX vector count as unavailable.
    pub fn from_cpuid(eax: u32, ebx: u32) -> Self {
        let len = eax >> 24;
        let beyond = if len >= 32 { 0 } else { u32::MAX << len };
        Self {
            full_width_write: false,
            unavailable_events: ebx | beyond,
        }
    }

    /// Adds what IA32_PERF_CAPABILITIES says (read it only when CPUID.01H:ECX.PDCM = 1).
    pub fn with_perf_capabilities(self, value: u64) -> Self {
        Self {
            full_width_write: value & PERF_CAPABILITIES_FW_WRITE != 0,
            ..self
        }
    }
}

/// Why a sampler cannot be built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SamplerError {
    /// The PMU cannot do it (no PMU, no usable counter, odd width).
    Unsupported(&'static str),
    /// CPUID.0AH:EBX says this architectural event does not count on a general counter.
    EventUnavailable(Event),
    /// The period is 0 or does not fit (see the module documentation).
    PeriodOutOfRange { period: u64, max: u64 },
}

impl fmt::Display for SamplerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SamplerError::Unsupported(why) => write!(f, "PMU sampling unsupported: {why}"),
            SamplerError::EventUnavailable(e) => {
                write!(f, "CPUID.0AH:EBX reports {e} as not available")
            }
            SamplerError::PeriodOutOfRange { period, max } => {
                write!(f, "sampling period {period} outside 1..={max}")
            }
        }
    }
}

/// The LAPIC's LVT performance-monitoring counters entry (xAPIC offset 340H or x2APIC MSR 834H).
pub trait Lapic {
    fn write_lvt_pmi(&mut self, value: u32);
    fn read_lvt_pmi(&self) -> u32;
}

/// What [`Sampler::arm`] overwrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Saved {
    global_ctrl: Option<u64>,
    ctrl: u64,
    counter: u64,
    lvt: u32,
}

/// One counter sampling one event on one logical processor. MSRs and the LAPIC are per logical
/// processor: keep one `Sampler` per pCPU and call it only on that pCPU.
/// Not `Clone`: a copy of an armed sampler would restore the saved state twice.
#[derive(Debug)]
pub struct Sampler {
    event: Event,
    counter: CounterChoice,
    period: u64,
    width: u8,
    version: u8,
    full_width_write: bool,
    saved: Option<Saved>,
    overflows: u64,
    missed: u64,
}

impl Sampler {
    /// Chooses the counter for `event` from CPUID.0AH — the event's fixed counter when the PMU
    /// (version ≥ 2) has it, else general counter 0 — and checks that `period` fits. Assumes no
    /// FW_WRITE and every architectural event available; see [`Sampler::with_caps`].
    pub fn new(info: &PmuInfo, event: Event, period: u64) -> Result<Self, SamplerError> {
        Self::with_caps(info, SamplerCaps::default(), event, period)
    }

    /// [`Sampler::new`] with FW_WRITE and the CPUID.0AH:EBX event vector taken into account.
    pub fn with_caps(
        info: &PmuInfo,
        caps: SamplerCaps,
        event: Event,
        period: u64,
    ) -> Result<Self, SamplerError> {
        if info.version == 0 {
            return Err(SamplerError::Unsupported(
                "CPUID.0AH reports no architectural PMU",
            ));
        }
        // Fixed counters exist from version 2 on; EDX[4:0] counts them (§21.2.2).
        let fixed = event
            .fixed_counter()
            .filter(|&i| info.version >= 2 && i < info.fixed_counters);
        let (counter, width) = match fixed {
            Some(i) => (CounterChoice::Fixed(i), info.fixed_width),
            None => {
                if info.gp_counters == 0 {
                    return Err(SamplerError::Unsupported(
                        "no fixed counter for the event and no general counter",
                    ));
                }
                if let Some(bit) = event.architectural_index()
                    && caps.unavailable_events & (1 << bit) != 0
                {
                    return Err(SamplerError::EventUnavailable(event));
                }
                (CounterChoice::General(0), info.gp_width)
            }
        };
        if !(2..=64).contains(&width) {
            return Err(SamplerError::Unsupported(
                "CPUID.0AH counter width outside 2..=64 bits",
            ));
        }
        let sampler = Self {
            event,
            counter,
            period,
            width,
            version: info.version,
            full_width_write: caps.full_width_write,
            saved: None,
            overflows: 0,
            missed: 0,
        };
        let max = sampler.max_period();
        if period == 0 || period > max {
            return Err(SamplerError::PeriodOutOfRange { period, max });
        }
        Ok(sampler)
    }

    pub fn event(&self) -> Event {
        self.event
    }

    pub fn counter(&self) -> CounterChoice {
        self.counter
    }

    pub fn period(&self) -> u64 {
        self.period
    }

    /// The counter's width in bits (CPUID.0AH).
    pub fn width(&self) -> u8 {
        self.width
    }

    /// The largest period this counter accepts (see the module documentation).
    pub fn max_period(&self) -> u64 {
        let bits = match self.counter {
            CounterChoice::General(_) if !self.full_width_write => self.width.min(32),
            _ => self.width,
        };
        (1u64 << (bits - 1)) - 1
    }

    pub fn is_armed(&self) -> bool {
        self.saved.is_some()
    }

    /// Overflows handled by [`Sampler::on_nmi`] since [`Sampler::arm`].
    pub fn overflows(&self) -> u64 {
        self.overflows
    }

    /// Whole periods that elapsed between an overflow and its handler, beyond the one the
    /// handler reported: `overflows() + missed_periods()` is the number of periods counted.
    pub fn missed_periods(&self) -> u64 {
        self.missed
    }

    /// Programs the counter to overflow after `period` events with a PMI, counting in every ring,
    /// sets the LVT entry to NMI delivery, unmasked, and enables the counter. Saves what it
    /// overwrote for [`Sampler::disarm`]. Calling it when armed does nothing.
    ///
    /// A fault while reading leaves everything untouched; a fault while programming puts back
    /// what was saved (best effort) and leaves the sampler disarmed. Either way the fault is
    /// returned.
    pub fn arm(
        &mut self,
        msrs: &mut impl MsrAccess,
        lapic: &mut impl Lapic,
    ) -> Result<(), MsrFault> {
        if self.saved.is_some() {
            return Ok(());
        }
        let saved = Saved {
            global_ctrl: if self.has_global() {
                Some(msrs.read(msr::IA32_PERF_GLOBAL_CTRL)?)
            } else {
                None
            },
            ctrl: msrs.read(self.ctrl_msr())?,
            counter: msrs.read(self.counter_read_msr())?,
            lvt: lapic.read_lvt_pmi(),
        };
        match self.program(&saved, msrs, lapic) {
            Ok(()) => {
                self.saved = Some(saved);
                self.overflows = 0;
                self.missed = 0;
                Ok(())
            }
            Err(fault) => {
                let _ = self.restore(&saved, msrs, lapic);
                Err(fault)
            }
        }
    }

    /// For the NMI handler and the NMI VM exit: was this NMI our counter's overflow?
    ///
    /// Version ≥ 2: reads IA32_PERF_GLOBAL_STATUS; if our bit is set, clears it through
    /// IA32_PERF_GLOBAL_OVF_CTRL, reloads the counter (keeping the events counted since the
    /// wrap, see the module documentation), unmasks the LVT entry last, and returns `true`.
    /// Version 1 has no status MSR: the counter wrapped iff its top bit is clear.
    ///
    /// `false`: not ours, and nothing was written; the NMI has another source the caller must
    /// handle. NMIs do not queue (one can be pending while one is handled), so even after `true`
    /// the caller should poll its other NMI sources. On `Err` the LVT entry stays masked, so no
    /// further PMI arrives: disarm.
    pub fn on_nmi(
        &mut self,
        msrs: &mut impl MsrAccess,
        lapic: &mut impl Lapic,
    ) -> Result<bool, MsrFault> {
        if self.saved.is_none() {
            return Ok(false);
        }
        let mask = self.mask();
        let since = if self.has_global() {
            let bit = self.global_bit();
            if msrs.read(msr::IA32_PERF_GLOBAL_STATUS)? & bit == 0 {
                return Ok(false);
            }
            msrs.write(msr::IA32_PERF_GLOBAL_OVF_CTRL, bit)?;
            msrs.read(self.counter_read_msr())? & mask
        } else {
            let value = msrs.read(self.counter_read_msr())? & mask;
            if value & self.top_bit() != 0 {
                return Ok(false);
            }
            value
        };
        let next = self.period - since % self.period;
        self.write_counter(msrs, next.wrapping_neg() & mask)?;
        // Unmask only after the status is cleared and the counter reloaded (Linux's "late ack":
        // an earlier unmask gives spurious PMIs on some parts).
        lapic.write_lvt_pmi(lvt::NMI_UNMASKED);
        self.overflows += 1;
        self.missed += since / self.period;
        Ok(true)
    }

    /// Stops counting and restores every MSR and the LVT entry [`Sampler::arm`] changed. Our
    /// overflow bit in IA32_PERF_GLOBAL_STATUS (read-only) is cleared rather than restored.
    /// Without FW_WRITE the general counter's saved value comes back as the sign extension of its
    /// low 32 bits (exact for the usual 0). Does nothing when not armed. Every step is attempted
    /// and the sampler ends disarmed; the first fault is returned.
    pub fn disarm(
        &mut self,
        msrs: &mut impl MsrAccess,
        lapic: &mut impl Lapic,
    ) -> Result<(), MsrFault> {
        match self.saved.take() {
            Some(saved) => self.restore(&saved, msrs, lapic),
            None => Ok(()),
        }
    }

    fn program(
        &self,
        saved: &Saved,
        msrs: &mut impl MsrAccess,
        lapic: &mut impl Lapic,
    ) -> Result<(), MsrFault> {
        let bit = self.global_bit();
        // Stop the counter while it is programmed (§21.2.2: the global bit gates it; version 1:
        // its EN bit).
        match saved.global_ctrl {
            Some(global) if global & bit != 0 => {
                msrs.write(msr::IA32_PERF_GLOBAL_CTRL, global & !bit)?
            }
            Some(_) => {}
            None if saved.ctrl & evtsel::EN != 0 => {
                msrs.write(self.ctrl_msr(), saved.ctrl & !evtsel::EN)?
            }
            None => {}
        }
        self.write_counter(msrs, self.period.wrapping_neg() & self.mask())?;
        if self.has_global() {
            // A stale overflow bit would make the first foreign NMI look like ours.
            msrs.write(msr::IA32_PERF_GLOBAL_OVF_CTRL, bit)?;
        }
        lapic.write_lvt_pmi(lvt::NMI_UNMASKED);
        // Version 1: this write starts counting; version ≥ 2: the global enable below does.
        msrs.write(self.ctrl_msr(), self.ctrl_value(saved.ctrl))?;
        if let Some(global) = saved.global_ctrl {
            msrs.write(msr::IA32_PERF_GLOBAL_CTRL, global | bit)?;
        }
        Ok(())
    }

    fn restore(
        &self,
        saved: &Saved,
        msrs: &mut impl MsrAccess,
        lapic: &mut impl Lapic,
    ) -> Result<(), MsrFault> {
        let mut first = Ok(());
        let mut keep = |r: Result<(), MsrFault>| {
            if first.is_ok() {
                first = r;
            }
        };
        let bit = self.global_bit();
        if let Some(global) = saved.global_ctrl {
            keep(msrs.write(msr::IA32_PERF_GLOBAL_CTRL, global & !bit));
        }
        keep(msrs.write(self.ctrl_msr(), saved.ctrl));
        keep(self.write_counter(msrs, saved.counter & self.mask()));
        if self.has_global() {
            keep(msrs.write(msr::IA32_PERF_GLOBAL_OVF_CTRL, bit));
        }
        lapic.write_lvt_pmi(saved.lvt);
        if let Some(global) = saved.global_ctrl {
            keep(msrs.write(msr::IA32_PERF_GLOBAL_CTRL, global));
        }
        first
    }

    fn has_global(&self) -> bool {
        self.version >= 2
    }

    fn mask(&self) -> u64 {
        u64::MAX >> (64 - u32::from(self.width))
    }

    fn top_bit(&self) -> u64 {
        1 << (self.width - 1)
    }

    /// The counter's bit in IA32_PERF_GLOBAL_CTRL / STATUS / OVF_CTRL (§21.2.2).
    fn global_bit(&self) -> u64 {
        match self.counter {
            CounterChoice::Fixed(i) => 1 << (32 + u32::from(i)),
            CounterChoice::General(i) => 1 << i,
        }
    }

    fn ctrl_msr(&self) -> u32 {
        match self.counter {
            CounterChoice::Fixed(_) => msr::IA32_FIXED_CTR_CTRL,
            CounterChoice::General(i) => msr::IA32_PERFEVTSEL0 + u32::from(i),
        }
    }

    /// The control value: ring 0 and ring > 0, PMI on overflow, enabled; the other fixed
    /// counters' nibbles are kept.
    fn ctrl_value(&self, saved: u64) -> u64 {
        match self.counter {
            CounterChoice::Fixed(i) => {
                let shift = 4 * u32::from(i);
                let field = fixed_ctrl::OS | fixed_ctrl::USR | fixed_ctrl::PMI;
                (saved & !(fixed_ctrl::FIELD << shift)) | (field << shift)
            }
            CounterChoice::General(_) => {
                let (event, umask) = self.event.encoding();
                u64::from(event)
                    | (u64::from(umask) << 8)
                    | evtsel::USR
                    | evtsel::OS
                    | evtsel::INT
                    | evtsel::EN
            }
        }
    }

    /// RDMSR of IA32_PMCx and IA32_FIXED_CTRi returns the full width.
    fn counter_read_msr(&self) -> u32 {
        match self.counter {
            CounterChoice::Fixed(i) => msr::IA32_FIXED_CTR0 + u32::from(i),
            CounterChoice::General(i) => msr::IA32_PMC0 + u32::from(i),
        }
    }

    /// Writes `value` (within the width). Through IA32_PMCx the CPU keeps bits 31:0 and
    /// sign-extends bit 31, which gives `value` back for every value the sampler loads (the
    /// period fits 31 bits there).
    fn write_counter(&self, msrs: &mut impl MsrAccess, value: u64) -> Result<(), MsrFault> {
        let target = match self.counter {
            CounterChoice::Fixed(i) => msr::IA32_FIXED_CTR0 + u32::from(i),
            CounterChoice::General(i) if self.full_width_write => msr::IA32_A_PMC0 + u32::from(i),
            CounterChoice::General(i) => msr::IA32_PMC0 + u32::from(i),
        };
        msrs.write(target, value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::cell::RefCell;
    use std::rc::Rc;

    /// A model of the architectural PMU and of the LVT PMI entry of one logical processor.
    ///
    /// - `tick(n)`: `n` events happen in ring `ring`, all at once. Every counter enabled for that
    ///   ring (and, from version 2 on, in IA32_PERF_GLOBAL_CTRL) advances by `n` modulo 2^width.
    ///   A wrap sets the counter's status bit (version ≥ 2) and, if the counter's PMI is enabled,
    ///   requests a PMI. The NMI is taken only after the tick: events that overshoot the wrap
    ///   are in the counter when the handler runs.
    /// - A PMI with the LVT entry unmasked and in NMI mode makes an NMI pending and sets the
    ///   mask bit, as the local APIC does; a PMI with the entry masked is lost. At most one NMI
    ///   is pending; a second one collapses into it.
    /// - Version 1 has no global MSRs (they #GP), IA32_A_PMCx #GP without FW_WRITE, a write
    ///   through IA32_PMCx sign-extends bit 31, a full-width write with bits beyond the width
    ///   #GP, GLOBAL_STATUS is read-only, OVF_CTRL is write-1-to-clear.
    #[derive(Debug, Default)]
    struct Pmu {
        info: PmuInfo,
        fw_write: bool,
        gp: Vec<u64>,
        evtsel: Vec<u64>,
        fixed: Vec<u64>,
        fixed_ctrl: u64,
        global_ctrl: u64,
        status: u64,
        lvt: u32,
        ring: u8,
        nmi_pending: bool,
        nmis: u64,
        collapsed: u64,
        lost_pmis: u64,
        faults: Vec<(u32, bool)>,
        writes: Vec<(u32, u64)>,
        lvt_writes: Vec<u32>,
    }

    fn width_mask(w: u8) -> u64 {
        u64::MAX.checked_shr(64 - u32::from(w)).unwrap_or(0)
    }

    fn index(m: u32, base: u32, n: usize) -> Option<usize> {
        m.checked_sub(base).map(|i| i as usize).filter(|&i| i < n)
    }

    impl Pmu {
        fn new(info: PmuInfo, fw_write: bool) -> Self {
            Self {
                info,
                fw_write,
                gp: vec![0; info.gp_counters.into()],
                evtsel: vec![0; info.gp_counters.into()],
                fixed: vec![0; info.fixed_counters.into()],
                lvt: lvt::MASKED, // reset value
                ..Default::default()
            }
        }

        fn v2(&self) -> bool {
            self.info.version >= 2
        }

        fn tick(&mut self, n: u64) {
            let ring0 = self.ring == 0;
            for i in 0..self.gp.len() {
                let sel = self.evtsel[i];
                let ring = if ring0 { evtsel::OS } else { evtsel::USR };
                let global = !self.v2() || self.global_ctrl & (1 << i) != 0;
                if sel & evtsel::EN != 0 && sel & ring != 0 && global {
                    let (v, wrapped) = add(self.gp[i], n, width_mask(self.info.gp_width));
                    self.gp[i] = v;
                    if wrapped {
                        self.overflow(1 << i, sel & evtsel::INT != 0);
                    }
                }
            }
            for i in 0..self.fixed.len() {
                let field = (self.fixed_ctrl >> (4 * i)) & fixed_ctrl::FIELD;
                let ring = if ring0 {
                    fixed_ctrl::OS
                } else {
                    fixed_ctrl::USR
                };
                if field & ring != 0 && self.global_ctrl & (1 << (32 + i)) != 0 {
                    let (v, wrapped) = add(self.fixed[i], n, width_mask(self.info.fixed_width));
                    self.fixed[i] = v;
                    if wrapped {
                        self.overflow(1 << (32 + i), field & fixed_ctrl::PMI != 0);
                    }
                }
            }
        }

        fn overflow(&mut self, bit: u64, pmi: bool) {
            if self.v2() {
                self.status |= bit;
            }
            if !pmi {
                return;
            }
            if self.lvt & lvt::MASKED != 0 {
                self.lost_pmis += 1;
                return;
            }
            assert_eq!(self.lvt & lvt::DELIVERY_MODE_MASK, lvt::DELIVERY_NMI);
            self.lvt |= lvt::MASKED;
            self.nmis += 1;
            if self.nmi_pending {
                self.collapsed += 1;
            }
            self.nmi_pending = true;
        }

        fn read_msr(&self, m: u32) -> Option<u64> {
            let (gp, fixed) = (self.gp.len(), self.fixed.len());
            if let Some(i) = index(m, msr::IA32_PMC0, gp) {
                return Some(self.gp[i]);
            }
            if let Some(i) = index(m, msr::IA32_A_PMC0, gp).filter(|_| self.fw_write) {
                return Some(self.gp[i]);
            }
            if let Some(i) = index(m, msr::IA32_PERFEVTSEL0, gp) {
                return Some(self.evtsel[i]);
            }
            if !self.v2() {
                return None;
            }
            if let Some(i) = index(m, msr::IA32_FIXED_CTR0, fixed) {
                return Some(self.fixed[i]);
            }
            match m {
                msr::IA32_FIXED_CTR_CTRL => Some(self.fixed_ctrl),
                msr::IA32_PERF_GLOBAL_STATUS => Some(self.status),
                msr::IA32_PERF_GLOBAL_CTRL => Some(self.global_ctrl),
                msr::IA32_PERF_GLOBAL_OVF_CTRL => Some(0),
                _ => None,
            }
        }

        fn write_msr(&mut self, m: u32, v: u64) -> Option<()> {
            let (gp, fixed) = (self.gp.len(), self.fixed.len());
            let (gmask, fmask) = (
                width_mask(self.info.gp_width),
                width_mask(self.info.fixed_width),
            );
            if let Some(i) = index(m, msr::IA32_PMC0, gp) {
                self.gp[i] = (v as u32 as i32 as i64 as u64) & gmask;
                return Some(());
            }
            if let Some(i) = index(m, msr::IA32_A_PMC0, gp).filter(|_| self.fw_write) {
                return (v & !gmask == 0).then(|| self.gp[i] = v);
            }
            if let Some(i) = index(m, msr::IA32_PERFEVTSEL0, gp) {
                self.evtsel[i] = v;
                return Some(());
            }
            if !self.v2() {
                return None;
            }
            if let Some(i) = index(m, msr::IA32_FIXED_CTR0, fixed) {
                return (v & !fmask == 0).then(|| self.fixed[i] = v);
            }
            match m {
                msr::IA32_FIXED_CTR_CTRL => self.fixed_ctrl = v,
                msr::IA32_PERF_GLOBAL_CTRL => self.global_ctrl = v,
                msr::IA32_PERF_GLOBAL_OVF_CTRL => self.status &= !v,
                _ => return None,
            }
            Some(())
        }
    }

    fn add(c: u64, n: u64, mask: u64) -> (u64, bool) {
        assert!(n <= mask, "a tick may wrap the counter at most once");
        let sum = u128::from(c) + u128::from(n);
        ((sum & u128::from(mask)) as u64, sum > u128::from(mask))
    }

    #[derive(Clone)]
    struct H(Rc<RefCell<Pmu>>);

    impl MsrAccess for H {
        fn read(&mut self, m: u32) -> Result<u64, MsrFault> {
            let s = self.0.borrow();
            let fault = MsrFault {
                msr: m,
                write: false,
            };
            if s.faults.contains(&(m, false)) {
                return Err(fault);
            }
            s.read_msr(m).ok_or(fault)
        }
        fn write(&mut self, m: u32, v: u64) -> Result<(), MsrFault> {
            let mut s = self.0.borrow_mut();
            let fault = MsrFault {
                msr: m,
                write: true,
            };
            if s.faults.contains(&(m, true)) {
                return Err(fault);
            }
            s.write_msr(m, v).ok_or(fault)?;
            s.writes.push((m, v));
            Ok(())
        }
    }

    impl Lapic for H {
        fn write_lvt_pmi(&mut self, value: u32) {
            let mut s = self.0.borrow_mut();
            s.lvt = value & !lvt::DELIVERY_STATUS;
            s.lvt_writes.push(value);
        }
        fn read_lvt_pmi(&self) -> u32 {
            self.0.borrow().lvt
        }
    }

    impl H {
        fn new(info: PmuInfo, fw_write: bool) -> Self {
            H(Rc::new(RefCell::new(Pmu::new(info, fw_write))))
        }
        fn pmu(&self) -> std::cell::RefMut<'_, Pmu> {
            self.0.borrow_mut()
        }
        fn arm(&self, s: &mut Sampler) -> Result<(), MsrFault> {
            s.arm(&mut self.clone(), &mut self.clone())
        }
        fn on_nmi(&self, s: &mut Sampler) -> Result<bool, MsrFault> {
            s.on_nmi(&mut self.clone(), &mut self.clone())
        }
        fn disarm(&self, s: &mut Sampler) -> Result<(), MsrFault> {
            s.disarm(&mut self.clone(), &mut self.clone())
        }
        /// `n` events in alternating rings; then, if an NMI is pending, the handler runs and
        /// must claim it; then, if `foreign`, an NMI from another source arrives, which the
        /// handler must not claim. Returns whether our NMI was taken.
        fn step(&self, s: &mut Sampler, n: u64, foreign: bool) -> bool {
            {
                let mut p = self.pmu();
                p.ring = if p.ring == 0 { 3 } else { 0 };
                p.tick(n);
            }
            let pending = std::mem::take(&mut self.pmu().nmi_pending);
            if pending {
                assert_eq!(self.on_nmi(s), Ok(true), "our PMI not recognized");
            }
            if foreign {
                assert_eq!(self.on_nmi(s), Ok(false), "foreign NMI claimed");
            }
            pending
        }
    }

    /// Deterministic xorshift64* for the long runs.
    struct Rng(u64);
    impl Rng {
        fn below_incl(&mut self, max: u64) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            1 + self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % max
        }
    }

    const V3: PmuInfo = PmuInfo {
        version: 3,
        gp_counters: 4,
        gp_width: 48,
        fixed_counters: 3,
        fixed_width: 48,
    };
    const V2_TWO_FIXED: PmuInfo = PmuInfo {
        version: 2,
        gp_counters: 2,
        gp_width: 40,
        fixed_counters: 2,
        fixed_width: 40,
    };
    const V1: PmuInfo = PmuInfo {
        version: 1,
        gp_counters: 2,
        gp_width: 40,
        fixed_counters: 0,
        fixed_width: 0,
    };
    const FW: SamplerCaps = SamplerCaps {
        full_width_write: true,
        unavailable_events: 0,
    };

    #[test]
    fn counter_choice_follows_cpuid() {
        let choice = |info: &PmuInfo, e| Sampler::new(info, e, 1000).map(|s| s.counter());
        use CounterChoice::*;
        assert_eq!(choice(&V3, Event::RefCycles), Ok(Fixed(2)));
        assert_eq!(choice(&V3, Event::CoreCycles), Ok(Fixed(1)));
        assert_eq!(choice(&V3, Event::Instructions), Ok(Fixed(0)));
        let custom = Event::Custom {
            event: 0x2e,
            umask: 0x41,
        };
        assert_eq!(choice(&V3, custom), Ok(General(0)));
        // Two fixed counters: reference cycles fall back to general counter 0 with 3CH/01H.
        assert_eq!(choice(&V2_TWO_FIXED, Event::RefCycles), Ok(General(0)));
        assert_eq!(choice(&V2_TWO_FIXED, Event::CoreCycles), Ok(Fixed(1)));
        // Version 1 has no fixed counters, whatever the (zeroed) count says.
        let v1_lying = PmuInfo {
            fixed_counters: 3,
            fixed_width: 48,
            ..V1
        };
        assert_eq!(choice(&v1_lying, Event::RefCycles), Ok(General(0)));
        assert!(matches!(
            choice(&PmuInfo::default(), Event::RefCycles),
            Err(SamplerError::Unsupported(_))
        ));
        let no_gp = PmuInfo {
            gp_counters: 0,
            ..V2_TWO_FIXED
        };
        assert!(matches!(
            choice(&no_gp, Event::RefCycles),
            Err(SamplerError::Unsupported(_))
        ));
        let no_width = PmuInfo { gp_width: 0, ..V1 };
        assert!(matches!(
            choice(&no_width, Event::CoreCycles),
            Err(SamplerError::Unsupported(_))
        ));
    }

    #[test]
    fn unavailable_architectural_event_is_refused_on_a_general_counter() {
        // EBX bit 2 set: UnHalted Reference Cycles not available; vector length 7.
        let caps = SamplerCaps::from_cpuid(0x0700_0000, 0b100);
        let err = Sampler::with_caps(&V2_TWO_FIXED, caps, Event::RefCycles, 1000).unwrap_err();
        assert_eq!(err, SamplerError::EventUnavailable(Event::RefCycles));
        assert_eq!(
            err.to_string(),
            "CPUID.0AH:EBX reports unhalted reference cycles as not available"
        );
        // The fixed counter does not depend on EBX.
        assert!(Sampler::with_caps(&V3, caps, Event::RefCycles, 1000).is_ok());
        // A vector of length 2 does not enumerate event 2 at all.
        let short = SamplerCaps::from_cpuid(0x0200_0000, 0);
        assert!(Sampler::with_caps(&V1, short, Event::RefCycles, 1000).is_err());
        assert!(Sampler::with_caps(&V1, short, Event::Instructions, 1000).is_ok());
        assert!(
            SamplerCaps::default()
                .with_perf_capabilities(1 << 13)
                .full_width_write
        );
        assert!(
            !SamplerCaps::default()
                .with_perf_capabilities(!(1 << 13))
                .full_width_write
        );
    }

    #[test]
    fn period_limits() {
        let err = |max| Err(SamplerError::PeriodOutOfRange { period: 0, max });
        // Fixed 48-bit counter: up to 2^47 - 1.
        let max48 = (1 << 47) - 1;
        assert_eq!(
            Sampler::new(&V3, Event::RefCycles, 0).map(|_| ()),
            err(max48)
        );
        assert!(Sampler::new(&V3, Event::RefCycles, max48).is_ok());
        assert_eq!(
            Sampler::new(&V3, Event::RefCycles, max48 + 1).unwrap_err(),
            SamplerError::PeriodOutOfRange {
                period: max48 + 1,
                max: max48
            }
        );
        // General counter without FW_WRITE: 31 bits.
        let custom = Event::Custom {
            event: 0xc4,
            umask: 0,
        };
        let max31 = (1 << 31) - 1;
        assert!(Sampler::new(&V3, custom, max31).is_ok());
        assert!(Sampler::new(&V3, custom, max31 + 1).is_err());
        assert_eq!(Sampler::new(&V3, custom, 1).unwrap().max_period(), max31);
        // With FW_WRITE: the counter width.
        let s = Sampler::with_caps(&V3, FW, custom, 1 << 40).unwrap();
        assert_eq!(s.max_period(), max48);
        // Narrow counters (below 32 bits) keep their own limit.
        let narrow = PmuInfo { gp_width: 8, ..V1 };
        assert!(Sampler::new(&narrow, custom, 127).is_ok());
        assert!(Sampler::new(&narrow, custom, 128).is_err());
        assert_eq!(
            Sampler::new(&narrow, custom, 128).unwrap_err().to_string(),
            "sampling period 128 outside 1..=127"
        );
    }

    /// Every pCPU has its own PMU: arming on each pCPU must program that pCPU's MSRs, and each
    /// pCPU's NMIs must be handled by its own sampler. (A single sampler shared by every pCPU
    /// armed only the boot CPU's counters: the APs never sampled.)
    #[test]
    fn every_pcpu_arms_and_services_its_own_counter() {
        use crate::percpu::PerCpuSamplers;
        const CPUS: usize = 4;
        let table: PerCpuSamplers<H, 8> = PerCpuSamplers::new();
        let pcpus: Vec<H> = (0..CPUS).map(|_| H::new(V3, false)).collect();
        for (cpu, h) in pcpus.iter().enumerate() {
            let s = Sampler::new(&V3, Event::RefCycles, 10_000 + cpu as u64).unwrap();
            // SAFETY: (test) each model pCPU's calls are made with its own registers, one at a
            // time.
            unsafe { table.arm(cpu, s, h.clone(), &mut h.clone()) }.unwrap();
            assert!(table.is_armed(cpu));
            let p = h.pmu();
            assert_eq!(p.fixed[2], (1 << 48) - (10_000 + cpu as u64), "pCPU {cpu}");
            assert_eq!(p.lvt, 0x400, "pCPU {cpu}: NMI delivery, unmasked");
        }
        assert!(!table.is_armed(CPUS), "pCPUs that never armed");
        // Arming twice is refused, the first arming stays.
        let again = Sampler::new(&V3, Event::RefCycles, 5).unwrap();
        // SAFETY: (test) as above: its own registers, one call at a time.
        assert!(unsafe { table.arm(1, again, pcpus[1].clone(), &mut pcpus[1].clone()) }.is_err());
        // Each pCPU's overflow is claimed on that pCPU only.
        for (cpu, h) in pcpus.iter().enumerate() {
            h.pmu().tick(20_000);
            assert!(
                std::mem::take(&mut h.pmu().nmi_pending),
                "pCPU {cpu} raised a PMI"
            );
            for (other, o) in pcpus.iter().enumerate().filter(|&(o, _)| o != cpu) {
                // SAFETY: (test) as above: its own registers, one call at a time.
                let claimed = unsafe { table.on_nmi(other, &mut o.clone()) };
                assert!(!claimed, "pCPU {other} claimed pCPU {cpu}'s overflow");
            }
            // SAFETY: (test) as above: its own registers, one call at a time.
            assert!(unsafe { table.on_nmi(cpu, &mut h.clone()) }, "pCPU {cpu}");
            assert_eq!(h.pmu().lvt, 0x400, "pCPU {cpu}: unmasked again");
        }
        for (cpu, h) in pcpus.iter().enumerate() {
            // SAFETY: (test) as above: its own registers, one call at a time.
            unsafe { table.disarm(cpu, &mut h.clone()) }.unwrap();
            assert!(!table.is_armed(cpu));
            assert_eq!(h.pmu().global_ctrl, 0, "pCPU {cpu} restored");
        }
    }

    #[test]
    fn arm_programs_fixed_counter_2() {
        let h = H::new(V3, false);
        h.pmu().fixed_ctrl = 0x0b0; // fixed counter 1 in use by someone
        h.pmu().global_ctrl = 0x1; // PMC0 enabled
        let mut s = Sampler::new(&V3, Event::RefCycles, 10_000).unwrap();
        h.arm(&mut s).unwrap();
        let p = h.pmu();
        assert_eq!(
            p.fixed_ctrl, 0xbb0,
            "nibble 2 = PMI | all rings, others kept"
        );
        assert_eq!(p.global_ctrl, 0x1 | (1 << 34));
        assert_eq!(p.fixed[2], (1 << 48) - 10_000);
        assert_eq!(p.lvt, 0x400, "NMI delivery, unmasked");
        // Enabled last.
        assert_eq!(
            p.writes.last(),
            Some(&(msr::IA32_PERF_GLOBAL_CTRL, 0x1 | (1 << 34)))
        );
    }

    #[test]
    fn arm_programs_general_counter_with_and_without_full_width_writes() {
        for fw in [false, true] {
            let h = H::new(V2_TWO_FIXED, fw);
            let caps = SamplerCaps {
                full_width_write: fw,
                unavailable_events: 0,
            };
            let mut s = Sampler::with_caps(&V2_TWO_FIXED, caps, Event::RefCycles, 5000).unwrap();
            h.arm(&mut s).unwrap();
            let p = h.pmu();
            // 3CH umask 01H, USR | OS | INT | EN.
            assert_eq!(p.evtsel[0], 0x0053_013c);
            assert_eq!(p.gp[0], (1 << 40) - 5000);
            assert_eq!(p.global_ctrl, 1);
            let target = if fw { msr::IA32_A_PMC0 } else { msr::IA32_PMC0 };
            assert!(p.writes.contains(&(target, (1 << 40) - 5000)));
        }
    }

    /// Runs `periods` periods' worth of random ticks of at most `max_tick` events.
    fn long_run(h: &H, s: &mut Sampler, periods: u64, max_tick: u64, seed: u64) -> u64 {
        let mut rng = Rng(seed);
        let mut total = 0;
        while total < periods * s.period() {
            let n = rng.below_incl(max_tick);
            total += n;
            h.step(s, n, n.is_multiple_of(3));
        }
        total
    }

    fn configs() -> Vec<(PmuInfo, SamplerCaps, Event)> {
        vec![
            (V3, SamplerCaps::default(), Event::RefCycles),
            (V3, FW, Event::Instructions),
            (V2_TWO_FIXED, SamplerCaps::default(), Event::RefCycles),
            (V2_TWO_FIXED, FW, Event::RefCycles),
            (V1, SamplerCaps::default(), Event::CoreCycles),
        ]
    }

    #[test]
    fn one_nmi_per_period_over_1000_periods() {
        for (k, (info, caps, event)) in configs().into_iter().enumerate() {
            let h = H::new(info, caps.full_width_write);
            let period = 9973;
            let mut s = Sampler::with_caps(&info, caps, event, period).unwrap();
            h.arm(&mut s).unwrap();
            let total = long_run(&h, &mut s, 1000, period, k as u64 + 1);
            assert_eq!(s.overflows(), total / period, "{info} {event}");
            assert_eq!(s.missed_periods(), 0);
            let p = h.pmu();
            assert_eq!(p.nmis, total / period);
            assert_eq!((p.lost_pmis, p.collapsed), (0, 0));
            assert_eq!(p.lvt, lvt::NMI_UNMASKED);
        }
    }

    #[test]
    fn late_handler_keeps_the_phase_and_counts_missed_periods() {
        for (k, (info, caps, event)) in configs().into_iter().enumerate() {
            let h = H::new(info, caps.full_width_write);
            let period = 1000;
            let mut s = Sampler::with_caps(&info, caps, event, period).unwrap();
            h.arm(&mut s).unwrap();
            // Ticks up to 3.5 periods: up to 3 periods elapse before the handler runs.
            let total = long_run(&h, &mut s, 2000, 3500, k as u64 + 7);
            assert_eq!(s.overflows() + s.missed_periods(), total / period);
            assert!(s.missed_periods() > 0);
            assert_eq!(h.pmu().nmis, s.overflows());
        }
    }

    #[test]
    fn lvt_is_masked_by_the_pmi_and_unmasked_by_the_handler() {
        let h = H::new(V3, false);
        let mut s = Sampler::new(&V3, Event::RefCycles, 100).unwrap();
        h.arm(&mut s).unwrap();
        h.pmu().tick(100);
        assert!(h.pmu().nmi_pending);
        assert_ne!(h.pmu().lvt & lvt::MASKED, 0);
        // Without the handler the next overflow is lost, as on hardware.
        let c = h.pmu().fixed[2];
        h.pmu().tick(width_mask(48) - c);
        h.pmu().tick(1);
        assert_eq!(h.pmu().lost_pmis, 1);
        assert_eq!(h.on_nmi(&mut s), Ok(true));
        assert_eq!(h.pmu().lvt, lvt::NMI_UNMASKED);
        assert_eq!(h.pmu().status, 0);
        // The unmask is the handler's last action.
        let p = h.pmu();
        assert_eq!(p.lvt_writes.last(), Some(&lvt::NMI_UNMASKED));
    }

    #[test]
    fn foreign_nmi_is_not_ours_and_changes_nothing() {
        for (info, caps, event) in configs() {
            let h = H::new(info, caps.full_width_write);
            let mut s = Sampler::with_caps(&info, caps, event, 1000).unwrap();
            // Not armed: never ours, nothing read.
            assert_eq!(h.on_nmi(&mut s), Ok(false));
            // Stale overflow bits, ours among them, from before arm.
            h.pmu().status = if info.version >= 2 {
                0x3 | (0x3 << 32)
            } else {
                0
            };
            h.arm(&mut s).unwrap();
            h.step(&mut s, 999, false);
            let (writes, lvt_writes, counters) = {
                let p = h.pmu();
                (
                    p.writes.len(),
                    p.lvt_writes.len(),
                    (p.gp.clone(), p.fixed.clone()),
                )
            };
            assert_eq!(h.on_nmi(&mut s), Ok(false), "{info}");
            let p = h.pmu();
            assert_eq!(p.writes.len(), writes);
            assert_eq!(p.lvt_writes.len(), lvt_writes);
            assert_eq!((p.gp.clone(), p.fixed.clone()), counters);
            assert_eq!(s.overflows(), 0);
        }
    }

    #[test]
    fn disarm_restores_every_msr_and_the_lvt() {
        for (info, caps, event) in configs() {
            let h = H::new(info, caps.full_width_write);
            {
                let mut p = h.pmu();
                p.lvt = lvt::MASKED | 0xfe; // fixed delivery, vector FEh, masked
                p.evtsel[0] = 0x0010_00c4; // INT set but disabled
                p.evtsel[1] = 0x0003_003c; // rings set, not enabled
                p.gp[0] = 0x1234;
                if info.version >= 2 {
                    // Other counters enabled globally, but not in their own controls, so that
                    // nothing but ours moves during the run.
                    p.global_ctrl = 0x2 | (1 << 33);
                    p.fixed_ctrl = 0x0040; // fixed counter 1: AnyThread only
                    p.fixed[1] = 77;
                    p.fixed.iter_mut().skip(2).for_each(|c| *c = 0xabc);
                }
            }
            let before = format!("{:?}", regs(&h));
            let mut s = Sampler::with_caps(&info, caps, event, 1000).unwrap();
            h.arm(&mut s).unwrap();
            assert_ne!(format!("{:?}", regs(&h)), before);
            h.step(&mut s, 1000, true);
            h.step(&mut s, 600, true);
            h.pmu().tick(500); // overflow pending at disarm
            h.pmu().nmi_pending = false;
            h.disarm(&mut s).unwrap();
            assert!(!s.is_armed());
            assert_eq!(format!("{:?}", regs(&h)), before, "{info} {event}");
            // Stopped: nothing counts any more.
            h.pmu().ring = 0;
            h.pmu().tick(10);
            assert_eq!(format!("{:?}", regs(&h)), before);
            assert_eq!(h.disarm(&mut s), Ok(()), "disarm twice is harmless");
        }
    }

    fn regs(h: &H) -> impl std::fmt::Debug {
        let p = h.pmu();
        (
            p.gp.clone(),
            p.evtsel.clone(),
            p.fixed.clone(),
            p.fixed_ctrl,
            p.global_ctrl,
            p.status,
            p.lvt,
        )
    }

    #[test]
    fn version1_never_touches_global_msrs() {
        let h = H::new(V1, false);
        let mut s = Sampler::new(&V1, Event::RefCycles, 4096).unwrap();
        h.arm(&mut s).unwrap();
        assert_eq!(h.pmu().evtsel[0], 0x0053_013c);
        for _ in 0..100 {
            h.step(&mut s, 4096, true);
        }
        assert_eq!(s.overflows(), 100);
        h.disarm(&mut s).unwrap();
        // The model #GPs on them, so reaching here means none was accessed; check the log too.
        assert!(
            h.pmu()
                .writes
                .iter()
                .all(|&(m, _)| !(0x38d..=0x390).contains(&m))
        );
    }

    #[test]
    fn arm_twice_keeps_the_first_saved_state() {
        let h = H::new(V3, false);
        h.pmu().global_ctrl = 0x1;
        let mut s = Sampler::new(&V3, Event::RefCycles, 1000).unwrap();
        h.arm(&mut s).unwrap();
        let writes = h.pmu().writes.len();
        h.arm(&mut s).unwrap();
        assert_eq!(h.pmu().writes.len(), writes);
        h.disarm(&mut s).unwrap();
        assert_eq!(h.pmu().global_ctrl, 0x1);
    }

    #[test]
    fn msr_faults_propagate() {
        let read = |m| MsrFault {
            msr: m,
            write: false,
        };
        let write = |m| MsrFault {
            msr: m,
            write: true,
        };

        // A read fault: nothing written, not armed.
        let h = H::new(V3, false);
        h.pmu().faults.push((msr::IA32_PERF_GLOBAL_CTRL, false));
        let mut s = Sampler::new(&V3, Event::RefCycles, 1000).unwrap();
        assert_eq!(h.arm(&mut s), Err(read(msr::IA32_PERF_GLOBAL_CTRL)));
        assert!(!s.is_armed());
        assert!(h.pmu().writes.is_empty());

        // A write fault midway: what was written is put back.
        let h = H::new(V3, false);
        h.pmu().global_ctrl = 0x3;
        h.pmu().lvt = lvt::MASKED;
        h.pmu().faults.push((msr::IA32_FIXED_CTR_CTRL, true));
        assert_eq!(h.arm(&mut s), Err(write(msr::IA32_FIXED_CTR_CTRL)));
        assert!(!s.is_armed());
        assert_eq!(h.pmu().global_ctrl, 0x3);
        assert_eq!(h.pmu().fixed[2], 0);
        assert_eq!(h.pmu().lvt, lvt::MASKED);

        // Without FW_WRITE support in the CPU, a sampler told it has FW_WRITE faults on 0x4C1.
        let h = H::new(V3, false);
        let custom = Event::Custom {
            event: 0xc4,
            umask: 0,
        };
        let mut g = Sampler::with_caps(&V3, FW, custom, 1000).unwrap();
        assert_eq!(h.arm(&mut g), Err(write(msr::IA32_A_PMC0)));

        // In the handler.
        let h = H::new(V3, false);
        let mut s = Sampler::new(&V3, Event::RefCycles, 1000).unwrap();
        h.arm(&mut s).unwrap();
        h.pmu().tick(1000);
        h.pmu().faults.push((msr::IA32_PERF_GLOBAL_STATUS, false));
        assert_eq!(h.on_nmi(&mut s), Err(read(msr::IA32_PERF_GLOBAL_STATUS)));
        h.pmu().faults.clear();
        h.pmu().faults.push((msr::IA32_FIXED_CTR0 + 2, true));
        assert_eq!(h.on_nmi(&mut s), Err(write(msr::IA32_FIXED_CTR0 + 2)));
        assert_ne!(h.pmu().lvt & lvt::MASKED, 0, "left masked on error");

        // In disarm: the other steps still happen, the sampler ends disarmed.
        h.pmu().faults.clear();
        h.pmu().faults.push((msr::IA32_FIXED_CTR_CTRL, true));
        assert_eq!(h.disarm(&mut s), Err(write(msr::IA32_FIXED_CTR_CTRL)));
        assert!(!s.is_armed());
        assert_eq!(h.pmu().global_ctrl, 0);
        assert_eq!(h.pmu().lvt, lvt::MASKED);
    }

    fn config_strategy() -> impl Strategy<Value = (PmuInfo, SamplerCaps, Event)> {
        let event = prop_oneof![
            Just(Event::RefCycles),
            Just(Event::CoreCycles),
            Just(Event::Instructions),
            Just(Event::Custom {
                event: 0x2e,
                umask: 0x4f
            }),
        ];
        (1u8..=5, 0u8..=3, 4u8..=48, 4u8..=48, any::<bool>(), event).prop_map(
            |(version, fixed, gp_width, fixed_width, fw, event)| {
                let info = PmuInfo {
                    version,
                    gp_counters: 2,
                    gp_width,
                    fixed_counters: if version >= 2 { fixed } else { 0 },
                    fixed_width: if version >= 2 { fixed_width } else { 0 },
                };
                let caps = SamplerCaps {
                    full_width_write: fw,
                    unavailable_events: 0,
                };
                (info, caps, event)
            },
        )
    }

    proptest! {
        /// Over random PMUs, periods and tick sequences, the overflows handled (plus the periods
        /// a late handler skipped) are exactly the whole periods in the events counted; with
        /// ticks no longer than the period, every period gets its own NMI.
        #[test]
        fn overflows_match_arithmetic(
            (info, caps, event) in config_strategy(),
            period_frac in 0.0f64..=1.0,
            ticks in proptest::collection::vec((0.0f64..=1.0, any::<bool>()), 1..300),
            late in any::<bool>(),
        ) {
            let probe = Sampler::with_caps(&info, caps, event, 1).unwrap();
            let max = probe.max_period();
            let period = 1 + ((max - 1) as f64 * period_frac * period_frac) as u64;
            let mut s = Sampler::with_caps(&info, caps, event, period).unwrap();
            // Ticks of at most one period, or (late handler) at most three periods but less
            // than half the counter range, so that the counter wraps at most once per tick.
            let max_tick = if late { (3 * period).min(max) } else { period };
            let h = H::new(info, caps.full_width_write);
            h.arm(&mut s).unwrap();
            let mut total = 0u64;
            for (t, foreign) in ticks {
                let n = ((max_tick as f64 * t) as u64).clamp(1, max_tick);
                total += n;
                h.step(&mut s, n, foreign);
            }
            prop_assert_eq!(s.overflows() + s.missed_periods(), total / period);
            if !late {
                prop_assert_eq!(s.missed_periods(), 0);
            }
            let p = h.pmu();
            prop_assert_eq!(p.nmis, s.overflows());
            prop_assert_eq!((p.lost_pmis, p.collapsed), (0, 0));
        }
    }
}
