//! A vCPU's local APIC in xAPIC mode: the register file a guest reads and writes at
//! 0xfee00000, the timer, interrupt acceptance and priorities, EOI, and the IPIs its ICR sends.
//! Pure logic: the caller decodes the guest's access (an APIC-access exit or an EPT violation)
//! into [`Lapic::read`] / [`Lapic::write`], carries out the [`Effect`] a write returns (an IPI to
//! other vCPUs, an EOI to broadcast to the I/O APIC), injects [`Lapic::pending`]'s vector when the
//! vCPU can take it and calls [`Lapic::acknowledge`] then, and wakes the vCPU at
//! [`Lapic::next_event`] (the timer).
//!
//! Why xAPIC and not x2APIC: Debian's 6.1 kernel turns x2APIC on without interrupt remapping only
//! where `x86_init.hyper.x2apic_available()` says so, which is true for hypervisors it knows (KVM,
//! Hyper-V, VMware, Xen, ACRN, Jailhouse) and false otherwise; it then turns an x2APIC left on by
//! firmware back off. A hypervisor that does not claim to be one of those gets xAPIC mode, and
//! this is that.
//!
//! Intel SDM Vol. 3A, "Advanced Programmable Interrupt Controller (APIC)": "Local APIC Register
//! Address Map" (Table "Local APIC Register Address Map"), "Local Vector Table", "APIC Timer"
//! and "TSC-Deadline Mode", "Issuing Interprocessor Interrupts" (the ICR, "Determining IPI
//! Destination", logical flat and cluster models), "Task and Processor Priorities" (TPR, PPR),
//! "IRR, ISR and TMR", "Signaling Interrupt Servicing Completion" (EOI), "Spurious Interrupt",
//! "Local APIC State After It Has Been Software Disabled".
//!
//! Model choices:
//! - The timer counts TSC ticks divided by the Divide Configuration register: the guest measures
//!   its frequency against the PIT or the TSC, as on hardware, and finds the TSC's.
//! - TSC-deadline mode is offered (CPUID.01H:ECX[24] is the caller's to set); its deadline is the
//!   guest's TSC, which is the host's here (no TSC offsetting).
//! - Lowest-priority delivery is delivered as fixed to every destination (the SDM lets the
//!   arbitration be model-specific; Linux uses physical fixed delivery).
//! - Error status: only "illegal vector" (vectors 0-15 sent or received) and "send illegal
//!   vector" are raised.

/// Register offsets (the APIC page's byte offsets).
pub mod reg {
    pub const ID: u32 = 0x20;
    pub const VERSION: u32 = 0x30;
    pub const TPR: u32 = 0x80;
    pub const APR: u32 = 0x90;
    pub const PPR: u32 = 0xa0;
    pub const EOI: u32 = 0xb0;
    pub const RRD: u32 = 0xc0;
    pub const LDR: u32 = 0xd0;
    pub const DFR: u32 = 0xe0;
    pub const SVR: u32 = 0xf0;
    pub const ISR: u32 = 0x100;
    pub const TMR: u32 = 0x180;
    pub const IRR: u32 = 0x200;
    pub const ESR: u32 = 0x280;
    pub const LVT_CMCI: u32 = 0x2f0;
    pub const ICR_LOW: u32 = 0x300;
    pub const ICR_HIGH: u32 = 0x310;
    pub const LVT_TIMER: u32 = 0x320;
    pub const LVT_THERMAL: u32 = 0x330;
    pub const LVT_PERF: u32 = 0x340;
    pub const LVT_LINT0: u32 = 0x350;
    pub const LVT_LINT1: u32 = 0x360;
    pub const LVT_ERROR: u32 = 0x370;
    pub const TIMER_INITIAL: u32 = 0x380;
    pub const TIMER_CURRENT: u32 = 0x390;
    pub const TIMER_DIVIDE: u32 = 0x3e0;
}

/// The version register: version 0x14 (an integrated APIC), 6 LVT entries (max index 5), no
/// EOI-broadcast suppression.
pub const VERSION: u32 = 0x0005_0014;

/// LVT bits.
const MASKED: u32 = 1 << 16;
const LVT_VECTOR: u32 = 0xff;
/// The timer LVT's mode field (bits 18:17): one-shot, periodic, TSC-deadline.
const TIMER_MODE_SHIFT: u32 = 17;
/// Delivery mode field of an LVT or the ICR (bits 10:8).
const DELIVERY_SHIFT: u32 = 8;
/// SVR bit 8: APIC software enable.
const SVR_ENABLE: u32 = 1 << 8;
/// ICR bit 12: delivery status (send pending); never set here, sends are immediate.
const ICR_DEST_LOGICAL: u32 = 1 << 11;
const ICR_LEVEL_ASSERT: u32 = 1 << 14;
const ICR_TRIGGER_LEVEL: u32 = 1 << 15;
/// ESR bits.
const ESR_SEND_ILLEGAL: u32 = 1 << 5;
const ESR_RECEIVE_ILLEGAL: u32 = 1 << 6;

/// An LVT's or the ICR's delivery mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    Fixed,
    LowestPriority,
    Smi,
    Nmi,
    Init,
    StartUp,
    ExtInt,
    Reserved,
}

impl Delivery {
    /// The delivery mode in bits 8-10 of an ICR, LVT or I/O APIC redirection entry.
    #[must_use]
    pub fn of(v: u32) -> Delivery {
        match (v >> DELIVERY_SHIFT) & 7 {
            0 => Delivery::Fixed,
            1 => Delivery::LowestPriority,
            2 => Delivery::Smi,
            4 => Delivery::Nmi,
            5 => Delivery::Init,
            6 => Delivery::StartUp,
            7 => Delivery::ExtInt,
            _ => Delivery::Reserved,
        }
    }
}

/// The timer's mode (LVT timer bits 18:17).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimerMode {
    OneShot,
    Periodic,
    TscDeadline,
}

/// Whom an IPI goes to (ICR destination shorthand, mode and field).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Destination {
    /// The sender only.
    ToSelf,
    /// Every APIC, the sender included.
    All,
    /// Every APIC but the sender.
    AllButSelf,
    /// The APIC whose ID is this (0xff: every APIC).
    Physical(u8),
    /// The APICs whose logical ID matches this (per their DFR model).
    Logical(u8),
}

/// An IPI the ICR sent: the caller delivers it to every vCPU `Lapic::is_target` picks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ipi {
    pub delivery: Delivery,
    pub vector: u8,
    pub destination: Destination,
    /// The sender's APIC ID (for the shorthands).
    pub source: u8,
    /// Level-triggered (INIT level de-assert has this with `assert` false).
    pub level_triggered: bool,
    pub assert: bool,
}

impl Ipi {
    /// INIT level de-assert: an old synchronization message that modern APICs ignore and Linux
    /// still sends after INIT.
    #[must_use]
    pub fn is_init_deassert(&self) -> bool {
        self.delivery == Delivery::Init && self.level_triggered && !self.assert
    }
}

/// What a write asks of the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    None,
    /// Deliver this IPI.
    Ipi(Ipi),
    /// The EOI of a level-triggered vector: tell the I/O APIC (its remote IRR).
    LevelEoi(u8),
    /// The timer changed: its next event is `next_event`.
    Timer,
}

/// A 256-bit vector register (ISR, IRR, TMR).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Bits([u64; 4]);

impl Bits {
    fn set(&mut self, v: u8, on: bool) {
        let (w, b) = (usize::from(v / 64), v % 64);
        if on {
            self.0[w] |= 1 << b;
        } else {
            self.0[w] &= !(1 << b);
        }
    }
    fn get(&self, v: u8) -> bool {
        self.0[usize::from(v / 64)] & (1 << (v % 64)) != 0
    }
    fn highest(&self) -> Option<u8> {
        (0..4).rev().find_map(|w| {
            let x = self.0[w];
            // `w < 4` and `leading_zeros < 64`: the vector fits in a u8.
            (x != 0).then(|| (w as u8) * 64 + 63 - x.leading_zeros() as u8)
        })
    }
    /// The 32 bits at register `i` (0-7) of the 8 the APIC page shows.
    fn word(&self, i: u32) -> u32 {
        let w = self.0[(i / 2) as usize];
        if i.is_multiple_of(2) {
            w as u32
        } else {
            (w >> 32) as u32
        }
    }
}

/// A local APIC.
#[derive(Clone, Debug)]
pub struct Lapic {
    id: u8,
    tpr: u32,
    ldr: u32,
    dfr: u32,
    svr: u32,
    isr: Bits,
    irr: Bits,
    tmr: Bits,
    esr: u32,
    /// Errors since the last ESR write (they show in ESR after it).
    esr_pending: u32,
    icr_low: u32,
    icr_high: u32,
    /// Timer, thermal, performance, LINT0, LINT1, error, CMCI.
    lvt: [u32; 7],
    timer_initial: u32,
    divide: u32,
    /// The TSC at which the count was (or would have been, under the current divider)
    /// `timer_initial`; kept with wrapping arithmetic (a divider change may put it before TSC 0).
    timer_start: u64,
    /// TSC-deadline mode's deadline (0: disarmed).
    deadline: u64,
    /// An NMI sent to this CPU and not taken yet. The CPU latches one: more NMIs while one
    /// waits are one (SDM Vol. 3A §6.7.1, "Handling Multiple NMIs").
    nmi: bool,
}

const LVT_TIMER: usize = 0;
const LVT_LINT0: usize = 3;

impl Lapic {
    /// An APIC after reset (or INIT): every LVT masked, software-disabled, `id` its APIC ID.
    #[must_use]
    pub fn new(id: u8) -> Lapic {
        Lapic {
            id,
            tpr: 0,
            ldr: 0,
            dfr: 0xffff_ffff,
            svr: 0xff,
            isr: Bits::default(),
            irr: Bits::default(),
            tmr: Bits::default(),
            esr: 0,
            esr_pending: 0,
            icr_low: 0,
            icr_high: 0,
            lvt: [MASKED; 7],
            timer_initial: 0,
            divide: 0,
            timer_start: 0,
            deadline: 0,
            nmi: false,
        }
    }

    /// The state INIT leaves (the SDM's "state after INIT": as reset, the APIC ID kept).
    pub fn init(&mut self) {
        *self = Lapic::new(self.id);
    }

    #[must_use]
    pub fn id(&self) -> u8 {
        self.id
    }

    /// SVR's software enable.
    #[must_use]
    pub fn software_enabled(&self) -> bool {
        self.svr & SVR_ENABLE != 0
    }

    /// Whether the 8259's INTR (wired to LINT0 on a PC) reaches the CPU: LVT LINT0 unmasked in
    /// ExtINT mode, or the APIC still software-disabled as the firmware leaves it (the PC's
    /// virtual-wire mode, where Linux finds the 8259 working before it sets the APIC up).
    #[must_use]
    pub fn accepts_pic(&self) -> bool {
        let lint0 = self.lvt[LVT_LINT0];
        !self.software_enabled() || (lint0 & MASKED == 0 && Delivery::of(lint0) == Delivery::ExtInt)
    }

    /// The timer's mode.
    #[must_use]
    pub fn timer_mode(&self) -> TimerMode {
        match (self.lvt[LVT_TIMER] >> TIMER_MODE_SHIFT) & 3 {
            1 => TimerMode::Periodic,
            2 => TimerMode::TscDeadline,
            _ => TimerMode::OneShot,
        }
    }

    /// TSC ticks per timer count (Divide Configuration: bits 3, 1, 0).
    fn ticks_per_count(&self) -> u64 {
        let d = ((self.divide & 8) >> 1) | (self.divide & 3);
        if d == 7 { 1 } else { 2 << d }
    }

    /// TSC ticks since `timer_start` (0 if `now` is before it: another pCPU's TSC may lag a
    /// little).
    fn elapsed(&self, now: u64) -> u64 {
        let e = now.wrapping_sub(self.timer_start);
        if e > 1 << 63 { 0 } else { e }
    }

    /// TSC ticks of a whole count from `timer_initial`.
    fn period(&self) -> u64 {
        u64::from(self.timer_initial) * self.ticks_per_count()
    }

    /// The timer's current count at TSC `now`.
    fn current_count(&self, now: u64) -> u32 {
        if self.timer_initial == 0 || self.timer_mode() == TimerMode::TscDeadline {
            return 0;
        }
        let elapsed = self.elapsed(now) / self.ticks_per_count();
        let initial = u64::from(self.timer_initial);
        match self.timer_mode() {
            TimerMode::Periodic => (initial - elapsed % initial) as u32,
            _ => initial.saturating_sub(elapsed) as u32,
        }
    }

    /// The TSC of the timer's next interrupt, if it is running (masked or not: a masked timer
    /// still counts, and its expiry only has no interrupt).
    #[must_use]
    pub fn next_event(&self) -> Option<u64> {
        match self.timer_mode() {
            TimerMode::TscDeadline => (self.deadline != 0).then_some(self.deadline),
            // One-shot: the end of the count; periodic: the end of this period (`run_timer`
            // moves `timer_start` on at each).
            _ => (self.timer_initial != 0).then(|| self.timer_start.wrapping_add(self.period())),
        }
    }

    /// Runs the timer to TSC `now`: at an expiry, the timer LVT's vector is accepted (unless
    /// masked), a periodic count restarts, a one-shot count or a deadline ends. Returns whether
    /// it expired.
    pub fn run_timer(&mut self, now: u64) -> bool {
        let Some(at) = self.next_event() else {
            return false;
        };
        let due = match self.timer_mode() {
            TimerMode::TscDeadline => now >= at,
            // A count's end may be kept wrapped (see `timer_start`).
            _ => now.wrapping_sub(at) <= 1 << 63,
        };
        if !due {
            return false;
        }
        match self.timer_mode() {
            TimerMode::TscDeadline => self.deadline = 0,
            TimerMode::Periodic => {
                // Periods missed while the vCPU did not run are one interrupt, as an IRR bit
                // holds one.
                let period = self.period();
                let missed = now.wrapping_sub(at) / period;
                self.timer_start = at.wrapping_add(missed * period);
            }
            TimerMode::OneShot => {
                self.timer_initial = 0;
                self.timer_start = 0;
            }
        }
        let lvt = self.lvt[LVT_TIMER];
        if lvt & MASKED == 0 && self.software_enabled() {
            self.accept((lvt & LVT_VECTOR) as u8, false);
        }
        true
    }

    /// An interrupt arrives (fixed delivery): IRR, and TMR for a level-triggered one. Vectors
    /// 0-15 are illegal and set the error status instead. A software-disabled APIC takes none.
    pub fn accept(&mut self, vector: u8, level: bool) {
        if vector < 16 {
            self.esr_pending |= ESR_RECEIVE_ILLEGAL;
            return;
        }
        if !self.software_enabled() {
            return;
        }
        self.irr.set(vector, true);
        self.tmr.set(vector, level);
    }

    /// An NMI for this CPU (an NMI IPI). Taken even while the APIC is software-disabled, as
    /// NMI, INIT and SIPI are (SDM Vol. 3A §11.4.7.2).
    pub fn accept_nmi(&mut self) {
        self.nmi = true;
    }

    /// Whether an NMI waits to be taken.
    #[must_use]
    pub fn nmi_pending(&self) -> bool {
        self.nmi
    }

    /// Takes the waiting NMI (the CPU delivers it now).
    pub fn take_nmi(&mut self) -> bool {
        core::mem::take(&mut self.nmi)
    }

    /// The processor priority (PPR): TPR, or the class of the highest vector in service if that
    /// is higher.
    #[must_use]
    pub fn ppr(&self) -> u32 {
        let isrv = self.isr.highest().map_or(0, u32::from);
        if (self.tpr & 0xf0) >= (isrv & 0xf0) {
            self.tpr & 0xff
        } else {
            isrv & 0xf0
        }
    }

    /// The vector to deliver to the CPU when it can take an interrupt: the highest requested
    /// one whose priority class is above PPR's.
    #[must_use]
    pub fn pending(&self) -> Option<u8> {
        let v = self.irr.highest()?;
        (u32::from(v) & 0xf0 > self.ppr() & 0xf0).then_some(v)
    }

    /// The CPU took `vector` (`pending` gave it): from IRR to ISR.
    pub fn acknowledge(&mut self, vector: u8) {
        self.irr.set(vector, false);
        self.isr.set(vector, true);
    }

    /// Whether an IPI's destination names this APIC (`Ipi::source` is the sender's ID).
    #[must_use]
    pub fn is_target(&self, ipi: &Ipi) -> bool {
        match ipi.destination {
            Destination::ToSelf => ipi.source == self.id,
            Destination::All => true,
            Destination::AllButSelf => ipi.source != self.id,
            Destination::Physical(d) => d == 0xff || d == self.id,
            Destination::Logical(d) => {
                let logical = (self.ldr >> 24) as u8;
                if (self.dfr >> 28) == 0xf {
                    // Flat model: a bit per APIC.
                    d & logical != 0
                } else {
                    // Cluster model: cluster in the high nibble, a bit per APIC in the low.
                    (d == 0xff) || ((d >> 4) == (logical >> 4) && (d & logical & 0xf) != 0)
                }
            }
        }
    }

    /// Reads the 32-bit register at `offset` (16-byte aligned; other offsets read 0) at TSC
    /// `now`.
    #[must_use]
    pub fn read(&self, offset: u32, now: u64) -> u32 {
        match offset {
            reg::ID => u32::from(self.id) << 24,
            reg::VERSION => VERSION,
            reg::TPR => self.tpr,
            reg::APR => 0,
            reg::PPR => self.ppr(),
            reg::LDR => self.ldr,
            reg::DFR => self.dfr,
            reg::SVR => self.svr,
            o if (reg::ISR..reg::ISR + 0x80).contains(&o) => self.isr.word((o - reg::ISR) / 0x10),
            o if (reg::TMR..reg::TMR + 0x80).contains(&o) => self.tmr.word((o - reg::TMR) / 0x10),
            o if (reg::IRR..reg::IRR + 0x80).contains(&o) => self.irr.word((o - reg::IRR) / 0x10),
            reg::ESR => self.esr,
            reg::ICR_LOW => self.icr_low,
            reg::ICR_HIGH => self.icr_high,
            reg::LVT_CMCI => self.lvt[6],
            o if (reg::LVT_TIMER..=reg::LVT_ERROR).contains(&o) => {
                self.lvt[((o - reg::LVT_TIMER) / 0x10) as usize]
            }
            reg::TIMER_INITIAL => self.timer_initial,
            reg::TIMER_CURRENT => self.current_count(now),
            reg::TIMER_DIVIDE => self.divide,
            _ => 0,
        }
    }

    /// Writes the 32-bit register at `offset` at TSC `now`; what the caller must do next.
    pub fn write(&mut self, offset: u32, value: u32, now: u64) -> Effect {
        match offset {
            // The APIC ID is read-only here (Linux never moves it).
            reg::TPR => self.tpr = value & 0xff,
            reg::EOI => return self.eoi(),
            reg::LDR => self.ldr = value & 0xff00_0000,
            reg::DFR => self.dfr = value | 0x0fff_ffff,
            reg::SVR => {
                self.svr = value & 0x13ff;
                if !self.software_enabled() {
                    // Software-disabled: every LVT masked.
                    for l in &mut self.lvt {
                        *l |= MASKED;
                    }
                }
            }
            reg::ESR => {
                self.esr = self.esr_pending;
                self.esr_pending = 0;
            }
            reg::ICR_HIGH => self.icr_high = value & 0xff00_0000,
            reg::ICR_LOW => {
                self.icr_low = value & !(1 << 12);
                return self.send();
            }
            reg::LVT_CMCI => self.lvt[6] = self.lvt_value(value, 0x0001_07ff),
            o if (reg::LVT_TIMER..=reg::LVT_ERROR).contains(&o) => {
                let i = ((o - reg::LVT_TIMER) / 0x10) as usize;
                let writable = match i {
                    LVT_TIMER => 0x0007_00ff,
                    1 | 2 => 0x0001_07ff,
                    3 | 4 => 0x0001_a7ff,
                    _ => 0x0001_00ff,
                };
                let was = self.timer_mode();
                self.lvt[i] = self.lvt_value(value, writable);
                if i == LVT_TIMER && self.timer_mode() != was {
                    // A mode change stops the timer (the SDM: "the timer is disarmed").
                    self.timer_initial = 0;
                    self.timer_start = 0;
                    self.deadline = 0;
                    return Effect::Timer;
                }
            }
            reg::TIMER_INITIAL => {
                if self.timer_mode() == TimerMode::TscDeadline {
                    return Effect::None;
                }
                self.timer_initial = value;
                self.timer_start = if value == 0 { 0 } else { now };
                return Effect::Timer;
            }
            reg::TIMER_DIVIDE => {
                // Keep the count where it is under the new divider.
                let current = self.current_count(now);
                self.divide = value & 0xb;
                if self.timer_initial != 0 && self.timer_mode() != TimerMode::TscDeadline {
                    let done = u64::from(self.timer_initial - current.min(self.timer_initial));
                    self.timer_start = now.wrapping_sub(done * self.ticks_per_count());
                    return Effect::Timer;
                }
            }
            _ => {}
        }
        Effect::None
    }

    /// IA32_TSC_DEADLINE written (TSC-deadline mode only; 0 disarms).
    pub fn write_deadline(&mut self, tsc: u64) -> Effect {
        if self.timer_mode() != TimerMode::TscDeadline {
            return Effect::None;
        }
        self.deadline = tsc;
        Effect::Timer
    }

    /// IA32_TSC_DEADLINE read.
    #[must_use]
    pub fn deadline(&self) -> u64 {
        if self.timer_mode() == TimerMode::TscDeadline {
            self.deadline
        } else {
            0
        }
    }

    /// An LVT write: masked while software-disabled.
    fn lvt_value(&self, value: u32, writable: u32) -> u32 {
        let v = value & writable;
        if self.software_enabled() {
            v
        } else {
            v | MASKED
        }
    }

    /// EOI: the highest vector in service ends.
    fn eoi(&mut self) -> Effect {
        let Some(v) = self.isr.highest() else {
            return Effect::None;
        };
        self.isr.set(v, false);
        if self.tmr.get(v) {
            self.tmr.set(v, false);
            Effect::LevelEoi(v)
        } else {
            Effect::None
        }
    }

    /// The IPI the ICR now holds.
    fn send(&mut self) -> Effect {
        let low = self.icr_low;
        let delivery = Delivery::of(low);
        let vector = (low & 0xff) as u8;
        let destination = match (low >> 18) & 3 {
            1 => Destination::ToSelf,
            2 => Destination::All,
            3 => Destination::AllButSelf,
            _ => {
                let d = (self.icr_high >> 24) as u8;
                if low & ICR_DEST_LOGICAL != 0 {
                    Destination::Logical(d)
                } else {
                    Destination::Physical(d)
                }
            }
        };
        if matches!(delivery, Delivery::Fixed | Delivery::LowestPriority) && vector < 16 {
            self.esr_pending |= ESR_SEND_ILLEGAL;
            return Effect::None;
        }
        Effect::Ipi(Ipi {
            delivery,
            vector,
            destination,
            source: self.id,
            level_triggered: low & ICR_TRIGGER_LEVEL != 0,
            assert: low & ICR_LEVEL_ASSERT != 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enabled(id: u8) -> Lapic {
        let mut l = Lapic::new(id);
        l.write(reg::SVR, SVR_ENABLE | 0xff, 0);
        l
    }

    #[test]
    fn reset_state_is_the_sdms() {
        let l = Lapic::new(3);
        assert_eq!(l.read(reg::ID, 0), 3 << 24);
        assert_eq!(l.read(reg::VERSION, 0), VERSION);
        assert_eq!(l.read(reg::SVR, 0), 0xff);
        assert_eq!(l.read(reg::DFR, 0), 0xffff_ffff);
        for lvt in [
            reg::LVT_TIMER,
            reg::LVT_LINT0,
            reg::LVT_LINT1,
            reg::LVT_ERROR,
        ] {
            assert_eq!(l.read(lvt, 0), MASKED, "{lvt:#x}");
        }
        // Software-disabled: the 8259 reaches the CPU through LINT0, nothing is accepted.
        assert!(l.accepts_pic());
        let mut l = l;
        l.accept(0x30, false);
        assert_eq!(l.pending(), None);
    }

    #[test]
    fn priorities_tpr_ppr_and_eoi() {
        let mut l = enabled(0);
        l.accept(0x31, false);
        l.accept(0x52, false);
        l.accept(0x41, true);
        assert_eq!(l.pending(), Some(0x52));
        l.acknowledge(0x52);
        assert_eq!(l.read(reg::PPR, 0), 0x50);
        // 0x41 is in a lower class than what is in service: it waits.
        assert_eq!(l.pending(), None);
        assert_eq!(l.read(reg::ISR + 0x20, 0), 1 << (0x52 - 64));
        assert_eq!(l.write(reg::EOI, 0, 0), Effect::None);
        assert_eq!(l.pending(), Some(0x41));
        l.acknowledge(0x41);
        // A level-triggered vector's EOI goes on to the I/O APIC.
        assert_eq!(l.write(reg::EOI, 0, 0), Effect::LevelEoi(0x41));
        // TPR blocks classes at or below it.
        l.write(reg::TPR, 0x30, 0);
        assert_eq!(l.pending(), None);
        l.write(reg::TPR, 0x20, 0);
        assert_eq!(l.pending(), Some(0x31));
        // Illegal vectors set the error status, visible after an ESR write.
        l.accept(5, false);
        assert_eq!(l.read(reg::ESR, 0), 0);
        l.write(reg::ESR, 0, 0);
        assert_eq!(l.read(reg::ESR, 0), ESR_RECEIVE_ILLEGAL);
    }

    #[test]
    fn one_shot_and_periodic_timers_count_tsc_ticks() {
        let mut l = enabled(0);
        l.write(reg::TIMER_DIVIDE, 0xb, 0); // divide by 1
        l.write(reg::LVT_TIMER, 0xec, 0); // one-shot, vector 0xec
        assert_eq!(l.write(reg::TIMER_INITIAL, 1000, 100), Effect::Timer);
        assert_eq!(l.next_event(), Some(1100));
        assert_eq!(l.read(reg::TIMER_CURRENT, 600), 500);
        assert!(!l.run_timer(1099));
        assert!(l.run_timer(1100));
        assert_eq!(l.pending(), Some(0xec));
        assert_eq!(l.next_event(), None);
        assert_eq!(l.read(reg::TIMER_CURRENT, 2000), 0);
        // Periodic, divide by 16: 100 counts are 1,600 ticks; missed periods make one interrupt.
        l.acknowledge(0xec);
        l.write(reg::EOI, 0, 0);
        l.write(reg::TIMER_DIVIDE, 3, 0);
        l.write(reg::LVT_TIMER, (1 << TIMER_MODE_SHIFT) | 0xec, 0);
        l.write(reg::TIMER_INITIAL, 100, 0);
        assert_eq!(l.next_event(), Some(1600));
        assert!(l.run_timer(5000));
        assert_eq!(l.next_event(), Some(6400));
        assert_eq!(l.read(reg::TIMER_CURRENT, 5000), 100 - (5000 - 4800) / 16);
        // A masked timer counts but raises nothing.
        l.acknowledge(0xec);
        l.write(reg::EOI, 0, 0);
        l.write(reg::LVT_TIMER, (1 << TIMER_MODE_SHIFT) | MASKED | 0xec, 0);
        assert!(l.run_timer(7000));
        assert_eq!(l.pending(), None);
    }

    #[test]
    fn tsc_deadline_mode() {
        let mut l = enabled(0);
        // Not in deadline mode: the MSR is ignored.
        assert_eq!(l.write_deadline(500), Effect::None);
        l.write(reg::LVT_TIMER, (2 << TIMER_MODE_SHIFT) | 0xef, 0);
        assert_eq!(l.timer_mode(), TimerMode::TscDeadline);
        // The initial count is ignored in this mode.
        assert_eq!(l.write(reg::TIMER_INITIAL, 10, 0), Effect::None);
        assert_eq!(l.write_deadline(5000), Effect::Timer);
        assert_eq!(l.deadline(), 5000);
        assert!(!l.run_timer(4999));
        assert!(l.run_timer(5000));
        assert_eq!(l.deadline(), 0);
        assert_eq!(l.pending(), Some(0xef));
        // A deadline at the end of time never comes.
        l.write_deadline(u64::MAX);
        assert!(!l.run_timer(100));
        // A mode change disarms.
        l.write_deadline(9000);
        assert_eq!(l.write(reg::LVT_TIMER, 0xef, 0), Effect::Timer);
        assert_eq!(l.next_event(), None);
    }

    #[test]
    fn the_icr_sends_what_linux_sends() {
        let mut l = enabled(0);
        // INIT assert to APIC 1, then de-assert, then two SIPIs at vector 0x9a (page 0x9a000).
        l.write(reg::ICR_HIGH, 1 << 24, 0);
        let Effect::Ipi(init) = l.write(reg::ICR_LOW, 0x0000_c500, 0) else {
            panic!("no IPI")
        };
        assert_eq!(init.delivery, Delivery::Init);
        assert_eq!(init.destination, Destination::Physical(1));
        assert!(!init.is_init_deassert());
        let Effect::Ipi(deassert) = l.write(reg::ICR_LOW, 0x0000_8500, 0) else {
            panic!("no IPI")
        };
        assert!(deassert.is_init_deassert());
        let Effect::Ipi(sipi) = l.write(reg::ICR_LOW, 0x0000_069a, 0) else {
            panic!("no IPI")
        };
        assert_eq!((sipi.delivery, sipi.vector), (Delivery::StartUp, 0x9a));
        // A fixed IPI to all but self (a reschedule), and NMI to self.
        let Effect::Ipi(all) = l.write(reg::ICR_LOW, (3 << 18) | 0xfd, 0) else {
            panic!("no IPI")
        };
        let (me, other) = (enabled(0), enabled(1));
        assert!(!me.is_target(&all) && other.is_target(&all));
        let Effect::Ipi(nmi) = l.write(reg::ICR_LOW, (1 << 18) | (4 << 8), 0) else {
            panic!("no IPI")
        };
        assert!(me.is_target(&nmi) && !other.is_target(&nmi));
        // A fixed IPI with an illegal vector is refused with an error.
        assert_eq!(l.write(reg::ICR_LOW, 0x0000_0005, 0), Effect::None);
        l.write(reg::ESR, 0, 0);
        assert_eq!(l.read(reg::ESR, 0), ESR_SEND_ILLEGAL);
    }

    #[test]
    fn nmis_are_latched_once_and_taken_even_while_disabled() {
        let mut l = Lapic::new(1);
        assert!(!l.software_enabled() && !l.nmi_pending());
        l.accept_nmi();
        l.accept_nmi();
        assert!(l.nmi_pending());
        assert!(l.take_nmi());
        assert!(!l.take_nmi() && !l.nmi_pending());
        l.accept_nmi();
        l.init();
        assert!(!l.nmi_pending());
    }

    #[test]
    fn logical_destinations_flat_and_cluster() {
        let mut a = enabled(0);
        let mut b = enabled(1);
        a.write(reg::LDR, 0x01 << 24, 0);
        b.write(reg::LDR, 0x02 << 24, 0);
        let ipi = |d| Ipi {
            delivery: Delivery::Fixed,
            vector: 0x40,
            destination: Destination::Logical(d),
            source: 0,
            level_triggered: false,
            assert: true,
        };
        assert!(a.is_target(&ipi(0x03)) && b.is_target(&ipi(0x03)));
        assert!(!a.is_target(&ipi(0x02)) && b.is_target(&ipi(0x02)));
        // Cluster model: cluster 1, members 0 and 1.
        for (l, ldr) in [(&mut a, 0x11), (&mut b, 0x12)] {
            l.write(reg::DFR, 0x0fff_ffff, 0);
            l.write(reg::LDR, ldr << 24, 0);
        }
        assert!(a.is_target(&ipi(0x11)) && !b.is_target(&ipi(0x11)));
        assert!(!a.is_target(&ipi(0x21)));
        assert!(b.is_target(&ipi(0x13)));
    }

    #[test]
    fn software_disable_masks_and_init_resets() {
        let mut l = enabled(2);
        l.write(reg::LVT_LINT0, 7 << DELIVERY_SHIFT, 0);
        assert!(l.accepts_pic());
        l.write(reg::LVT_LINT0, (7 << DELIVERY_SHIFT) | MASKED, 0);
        assert!(!l.accepts_pic());
        l.write(reg::LVT_TIMER, 0xec, 0);
        l.write(reg::SVR, 0xff, 0);
        assert_eq!(l.read(reg::LVT_TIMER, 0) & MASKED, MASKED);
        // Writes while disabled stay masked.
        l.write(reg::LVT_ERROR, 0xfe, 0);
        assert_eq!(l.read(reg::LVT_ERROR, 0), MASKED | 0xfe);
        l.write(reg::SVR, SVR_ENABLE | 0xff, 0);
        l.accept(0x40, false);
        l.init();
        assert_eq!(l.id(), 2);
        assert_eq!(l.pending(), None);
        assert!(!l.software_enabled());
    }

    #[test]
    fn divide_change_keeps_the_count() {
        let mut l = enabled(0);
        l.write(reg::TIMER_DIVIDE, 0xb, 0); // by 1
        l.write(reg::LVT_TIMER, 0xec, 0);
        l.write(reg::TIMER_INITIAL, 1000, 0);
        assert_eq!(l.read(reg::TIMER_CURRENT, 400), 600);
        l.write(reg::TIMER_DIVIDE, 0, 400); // by 2
        assert_eq!(l.read(reg::TIMER_CURRENT, 400), 600);
        assert_eq!(l.next_event(), Some(400 + 1200));
    }
}
