//! Property tests of the local APIC model against a reference, with the CPU's virtual-interrupt
//! delivery modelled (`cpu_vapic`): random interleavings of what the other vCPUs and the I/O
//! APIC send (`accept`), VM entries and exits (`hand_over`, `take_back`), what the CPU does
//! while the guest runs (deliveries, EOIs, self-IPIs, TPR writes) and what the model does
//! without virtual-interrupt delivery (`acknowledge`, EOI and TPR writes); and, for the
//! register model and the MMIO decoder together, any bytes decoded as the guest's instruction
//! at any offset of the APIC page, applied as the exit handlers apply them (`Lapic::mmio`),
//! mixed with all of that and the timer.
//!
//! The reference is the local APIC as the SDM describes it (Vol. 3A, "Interrupt Acceptance for
//! Fixed Interrupts", "Task and Processor Priorities", "Signaling Interrupt Servicing
//! Completion", "Error Handling"): a set of requested vectors (IRR) and one of vectors in
//! service (ISR), TPR, the level-triggered vectors (TMR), the error status. An interrupt
//! accepted while the CPU holds the state reaches IRR at the next `take_back` (the model keeps
//! it apart until then, as an interrupt message still on its way). Checked after every step,
//! against the model when it holds the state and against the CPU's page and guest interrupt
//! status when the CPU does: no vector lost, none added or duplicated, RVI and SVI the highest
//! of VIRR and VISR, PPR (or VPPR) from TPR and the highest in service, and the vector that
//! would be delivered now the reference's (so that nothing stalls); and at each entry, that the
//! model's idea of the page is what it holds (`CpuVapic::enter`). The register checks are
//! `World::check_registers`'s.

use super::cpu_vapic::CpuVapic;
use super::{
    Delivery, ESR_RECEIVE_ILLEGAL, ESR_SEND_ILLEGAL, Effect, Lapic, MASKED, Mmio, SVR_ENABLE,
    TimerMode, VERSION, reg,
};
use crate::mmio_decode::{self, MAX_LEN, Op};
use proptest::prelude::*;
use std::collections::BTreeSet;

/// Vectors the steps mostly pick from: a few per VIRR word and priority class, some sharing
/// both, vectors 0-15 (illegal) among them.
const VECTORS: [u8; 15] = [
    0x05, 0x10, 0x21, 0x22, 0x31, 0x41, 0x42, 0x5f, 0x60, 0x61, 0x80, 0x81, 0xc3, 0xef, 0xff,
];

/// Level-triggered vectors (I/O APIC entries in level mode): always accepted as level, and
/// only when none of them is requested or in service (the entry's remote IRR holds the next
/// back until the EOI reaches the I/O APIC), never sent as IPIs.
const LEVEL: [u8; 2] = [0x42, 0x81];

/// The registers of the SDM's map (Vol. 3A, "Local APIC Register Address Map"); every other
/// 16-byte boundary of the page is reserved.
const REGISTERS: [u32; 47] = [
    reg::ID,
    reg::VERSION,
    reg::TPR,
    reg::APR,
    reg::PPR,
    reg::EOI,
    reg::RRD,
    reg::LDR,
    reg::DFR,
    reg::SVR,
    reg::ISR,
    reg::ISR + 0x10,
    reg::ISR + 0x20,
    reg::ISR + 0x30,
    reg::ISR + 0x40,
    reg::ISR + 0x50,
    reg::ISR + 0x60,
    reg::ISR + 0x70,
    reg::TMR,
    reg::TMR + 0x10,
    reg::TMR + 0x20,
    reg::TMR + 0x30,
    reg::TMR + 0x40,
    reg::TMR + 0x50,
    reg::TMR + 0x60,
    reg::TMR + 0x70,
    reg::IRR,
    reg::IRR + 0x10,
    reg::IRR + 0x20,
    reg::IRR + 0x30,
    reg::IRR + 0x40,
    reg::IRR + 0x50,
    reg::IRR + 0x60,
    reg::IRR + 0x70,
    reg::ESR,
    reg::LVT_CMCI,
    reg::ICR_LOW,
    reg::ICR_HIGH,
    reg::LVT_TIMER,
    reg::LVT_THERMAL,
    reg::LVT_PERF,
    reg::LVT_LINT0,
    reg::LVT_LINT1,
    reg::LVT_ERROR,
    reg::TIMER_INITIAL,
    reg::TIMER_CURRENT,
    reg::TIMER_DIVIDE,
];

/// The registers a write changes (or acts through: EOI, ESR, ICR); the others of the map are
/// read-only (the APIC ID too, here), and a write there changes nothing, as at a reserved
/// offset.
const WRITABLE: [u32; 18] = [
    reg::ID,
    reg::TPR,
    reg::EOI,
    reg::LDR,
    reg::DFR,
    reg::SVR,
    reg::ESR,
    reg::LVT_CMCI,
    reg::ICR_LOW,
    reg::ICR_HIGH,
    reg::LVT_TIMER,
    reg::LVT_THERMAL,
    reg::LVT_PERF,
    reg::LVT_LINT0,
    reg::LVT_LINT1,
    reg::LVT_ERROR,
    reg::TIMER_INITIAL,
    reg::TIMER_DIVIDE,
];

/// Each LVT entry and its bits software can write (SDM Vol. 3A, "Local Vector Table": the
/// vector, the delivery mode where it has one, the LINT pins' polarity and trigger mode, the
/// mask, the timer's mode); delivery status and remote IRR are read-only, the rest reserved.
const LVTS: [(u32, u32); 7] = [
    (reg::LVT_TIMER, 0x7_00ff),
    (reg::LVT_THERMAL, 0x1_07ff),
    (reg::LVT_PERF, 0x1_07ff),
    (reg::LVT_LINT0, 0x1_a7ff),
    (reg::LVT_LINT1, 0x1_a7ff),
    (reg::LVT_ERROR, 0x1_00ff),
    (reg::LVT_CMCI, 0x1_07ff),
];

/// Register values worth writing: enables, timer modes, IPIs Linux sends, dividers.
const VALUES: [u32; 18] = [
    SVR_ENABLE | 0xff,
    0xff,
    0x2_00ec,
    0x4_00ef,
    0xec,
    0x1_00ec,
    0x4_0042,
    0x4_0005,
    0x31,
    0x8_00fd,
    0xc_0061,
    0xc500,
    0x4_0400,
    0x0b,
    0x03,
    0x10,
    0x0100_0000,
    0x0700,
];

/// One thing that happens to a vCPU's local APIC.
#[derive(Clone, Debug)]
enum Step {
    /// An interrupt from the I/O APIC or another vCPU (`vmexit::lapic::deliver_to_targets`).
    Accept(u8),
    /// A VM entry (`virtual_apic::hand_over`; none while the CPU holds the state).
    Enter,
    /// A VM exit that looks at the model (`virtual_apic::take_back`).
    Exit,
    /// The guest can take an interrupt: the CPU delivers the one it recognizes, if any.
    CpuDeliver,
    /// The guest writes EOI: the CPU virtualizes it (and exits for a level vector).
    CpuEoi,
    /// The guest writes ICR's low half for a fixed, edge IPI to itself: the CPU virtualizes it
    /// (vector 16-255), else it exits and the model sends it.
    CpuSelfIpi(u8),
    /// The guest writes TPR: the CPU virtualizes it.
    CpuTpr(u8),
    /// Without virtual-interrupt delivery (`vm::virtual_interrupts::inject`): the model's
    /// pending vector is injected.
    Acknowledge,
    /// Without: the guest's EOI write, emulated.
    ModelEoi,
    /// Without: the guest's TPR write, emulated.
    ModelTpr(u8),
    /// INIT from another vCPU.
    Init,
    /// The guest enables the APIC (SVR), as after INIT.
    Enable,
    /// An interrupt of any trigger mode, from anywhere (IPIs may be level-triggered).
    AcceptAny(u8, bool),
    /// An access at the APIC page that exits (an EPT violation, or an APIC-access exit): the
    /// instruction's bytes, fetched in 64-bit mode or not, decoded; the page offset; the value
    /// of every general register.
    Mmio {
        bytes: Vec<u8>,
        long: bool,
        offset: u32,
        gpr: u64,
        time: Time,
    },
    /// The timer run to a time (`vm::virtual_interrupts::waiting`).
    RunTimer(Time),
    /// The guest writes IA32_TSC_DEADLINE: this many ticks after the last step's time.
    Deadline(u32),
    /// The guest arms the timer as Linux does, through two exits as `Mmio` (`mov %eax,
    /// 0xfee00320` with the vector, one-shot unmasked, then `mov %eax, 0xfee00380` with the
    /// count).
    ArmTimer(u8, u16),
}

/// A step's TSC.
#[derive(Clone, Copy, Debug)]
enum Time {
    /// This many ticks after the last step's.
    Later(u32),
    /// Any time (another pCPU's TSC, a wrapped one).
    At(u64),
}

/// The local APIC as the SDM describes it.
#[derive(Clone, Debug, Default)]
struct Reference {
    /// IRR: the vectors requested, as the holder of the state (the model or the CPU) has them.
    requested: BTreeSet<u8>,
    /// Accepted while the CPU holds the state: they join `requested` at the next exit.
    in_flight: BTreeSet<u8>,
    /// ISR.
    in_service: BTreeSet<u8>,
    /// TMR: the vectors last accepted as level-triggered (an EOI leaves the bit; the next
    /// edge-triggered acceptance of the vector clears it).
    level: BTreeSet<u8>,
    tpr: u32,
    enabled: bool,
    /// ESR as read, and the errors since the last ESR write (they show after the next one).
    esr: u32,
    esr_pending: u32,
}

impl Reference {
    /// PPR (SDM Vol. 3A, "Processor Priority Register").
    fn ppr(&self) -> u32 {
        let isrv = self.in_service.last().map_or(0, |&v| u32::from(v));
        if self.tpr >> 4 >= isrv >> 4 {
            self.tpr
        } else {
            isrv & 0xf0
        }
    }

    /// The vector the APIC delivers when the CPU can take one: the highest requested, if its
    /// class is above PPR's.
    fn pending(&self) -> Option<u8> {
        let v = *self.requested.last()?;
        (u32::from(v >> 4) > self.ppr() >> 4).then_some(v)
    }

    /// Any of the level-triggered vectors on its way, requested or in service.
    fn level_outstanding(&self, v: u8) -> bool {
        self.requested.contains(&v) || self.in_flight.contains(&v) || self.in_service.contains(&v)
    }
}

/// The 8 words of a 256-bit register holding `set`.
fn words(set: &BTreeSet<u8>) -> [u32; 8] {
    let mut w = [0; 8];
    for &v in set {
        w[usize::from(v / 32)] |= 1 << (v % 32);
    }
    w
}

/// A vCPU's local APIC model, the CPU's copy of its state, and the reference.
struct World {
    lapic: Lapic,
    cpu: CpuVapic,
    r: Reference,
    /// Level-triggered interrupts only as the I/O APIC sends them (`LEVEL`); checks that each
    /// one's EOI reaches it.
    strict: bool,
    /// The last step's TSC.
    now: u64,
}

impl World {
    fn new(strict: bool) -> World {
        let mut lapic = Lapic::new(0);
        lapic.write(reg::SVR, SVR_ENABLE | 0xff, 0);
        World {
            lapic,
            cpu: CpuVapic::new(),
            r: Reference {
                enabled: true,
                ..Reference::default()
            },
            strict,
            now: 0,
        }
    }

    fn time(&mut self, t: Time) -> u64 {
        self.now = match t {
            Time::Later(d) => self.now.wrapping_add(u64::from(d)),
            Time::At(t) => t,
        };
        self.now
    }

    fn handed(&self) -> bool {
        self.lapic.handed_over()
    }

    /// A VM exit: the state taken back, what came meanwhile requested now.
    fn exit(&mut self) {
        if self.handed() {
            self.cpu.exit(&mut self.lapic);
            let mut came = std::mem::take(&mut self.r.in_flight);
            self.r.requested.append(&mut came);
        }
    }

    /// A fixed interrupt for this APIC.
    fn accept(&mut self, v: u8, level: bool) {
        self.lapic.accept(v, level);
        self.accepted(v, level);
    }

    /// The reference's side of `accept`.
    fn accepted(&mut self, v: u8, level: bool) {
        if v < 16 {
            self.r.esr_pending |= ESR_RECEIVE_ILLEGAL;
            return;
        }
        if !self.r.enabled {
            return;
        }
        if self.handed() {
            self.r.in_flight.insert(v);
        } else {
            self.r.requested.insert(v);
        }
        if level {
            self.r.level.insert(v);
        } else {
            self.r.level.remove(&v);
        }
    }

    /// What a write asks for, done as `vmexit::lapic::carry_out` does for this vCPU alone (an
    /// INIT or a SIPI is not for the sender).
    fn carry_out(&mut self, effect: Effect) {
        if let Effect::Ipi(ipi) = effect
            && self.lapic.is_target(&ipi)
        {
            match ipi.delivery {
                Delivery::Fixed | Delivery::LowestPriority => {
                    self.accept(ipi.vector, ipi.level_triggered);
                }
                Delivery::Nmi => self.lapic.accept_nmi(),
                _ => {}
            }
        }
    }

    /// The EOI of `ended` (none: nothing was in service) had `effect`.
    fn check_eoi(&mut self, ended: Option<u8>, effect: Effect) -> Result<(), TestCaseError> {
        let want = match ended {
            Some(v) if self.r.level.contains(&v) => Effect::LevelEoi(v),
            _ => Effect::None,
        };
        prop_assert_eq!(effect, want, "EOI of {:?}", ended);
        Ok(())
    }

    fn step(&mut self, step: &Step) -> Result<(), TestCaseError> {
        match *step {
            Step::Accept(v) => {
                let level = LEVEL.contains(&v);
                if !(level && self.r.level_outstanding(v)) {
                    self.accept(v, level);
                }
            }
            Step::Enter => {
                if !self.handed() {
                    self.cpu.enter(&mut self.lapic);
                }
            }
            Step::Exit => self.exit(),
            Step::CpuDeliver => {
                if self.handed() {
                    let want = self.r.pending();
                    prop_assert_eq!(self.cpu.deliver(), want);
                    if let Some(v) = want {
                        self.r.requested.remove(&v);
                        self.r.in_service.insert(v);
                    }
                }
            }
            Step::CpuEoi => {
                if self.handed() {
                    let ended = self.r.in_service.pop_last();
                    let (v, exits) = self.cpu.eoi();
                    prop_assert_eq!(v, ended.unwrap_or(0), "the vector ended");
                    if exits {
                        // An EOI-induced exit: the model has the state back first.
                        self.exit();
                        let effect = self.lapic.virtual_eoi(v);
                        self.check_eoi(ended, effect)?;
                    } else if self.strict {
                        // A level vector in service was level when handed over: its EOI exits.
                        prop_assert!(!ended.is_some_and(|v| self.r.level.contains(&v)));
                    }
                }
            }
            Step::CpuSelfIpi(v) => {
                if self.handed() && !(self.strict && LEVEL.contains(&v)) {
                    let icr = 1 << 18 | u32::from(v);
                    if self.cpu.write_icr_low(icr) {
                        self.r.requested.insert(v);
                    } else {
                        // An APIC-write exit: the model sends it.
                        prop_assert!(v < 16);
                        self.exit();
                        let effect = self.lapic.write(reg::ICR_LOW, icr, self.now);
                        prop_assert_eq!(effect, Effect::None, "an illegal vector");
                        self.r.esr_pending |= ESR_SEND_ILLEGAL;
                    }
                }
            }
            Step::CpuTpr(t) => {
                if self.handed() {
                    self.cpu.write_tpr(u32::from(t));
                    self.r.tpr = u32::from(t);
                }
            }
            Step::Acknowledge => {
                self.exit();
                let v = self.lapic.pending();
                prop_assert_eq!(v, self.r.pending());
                if let Some(v) = v {
                    self.lapic.acknowledge(v);
                    self.r.requested.remove(&v);
                    self.r.in_service.insert(v);
                }
            }
            Step::ModelEoi => {
                self.exit();
                let effect = self.lapic.write(reg::EOI, 0, self.now);
                let ended = self.r.in_service.pop_last();
                self.check_eoi(ended, effect)?;
            }
            Step::ModelTpr(t) => {
                self.exit();
                self.lapic.write(reg::TPR, u32::from(t), self.now);
                self.r.tpr = u32::from(t);
            }
            Step::Init => {
                self.lapic.init();
                self.r = Reference::default();
            }
            Step::AcceptAny(v, level) => self.accept(v, level),
            Step::Mmio {
                ref bytes,
                long,
                offset,
                gpr,
                time,
            } => {
                // The exit handler gives the model 32-bit accesses only.
                let Ok(access) = mmio_decode::decode(bytes, long) else {
                    return Ok(());
                };
                if access.size != 4 {
                    return Ok(());
                }
                prop_assert!(access.len <= bytes.len().min(MAX_LEN));
                // The exit that brings the access takes the state back first.
                self.exit();
                let now = self.time(time);
                let before = self.registers(now);
                // A timer due now has fired when its registers are written.
                let timer = matches!(
                    offset,
                    reg::LVT_TIMER | reg::TIMER_INITIAL | reg::TIMER_DIVIDE | reg::SVR
                );
                let fired = if timer && !matches!(access.op, Op::Read { .. }) {
                    self.due(now)
                } else {
                    None
                };
                let done = self.lapic.mmio(offset, access.op, |_| gpr, now);
                if let Some(v) = fired {
                    self.accepted(v, false);
                }
                match (access.op, done) {
                    (Op::Read { reg }, Mmio::Load { reg: into, value }) => {
                        prop_assert_eq!(into, reg);
                        let want = if offset.is_multiple_of(16) && offset < 0x400 {
                            before[(offset / 16) as usize]
                        } else {
                            0
                        };
                        prop_assert_eq!(value, want, "load at {:#x}", offset);
                        prop_assert_eq!(self.registers(now), before, "a load changes nothing");
                    }
                    (Op::Write { .. }, Mmio::Store(effect)) => {
                        self.stored(offset, gpr as u32, effect, &before, now)?;
                    }
                    (Op::WriteImm { imm }, Mmio::Store(effect)) => {
                        self.stored(offset, imm, effect, &before, now)?;
                    }
                    (op, done) => prop_assert!(false, "{:?} did {:?}", op, done),
                }
            }
            Step::RunTimer(time) => {
                let now = self.time(time);
                let lvt = self.lapic.read(reg::LVT_TIMER, now);
                let deadline = self.lapic.timer_mode() == TimerMode::TscDeadline;
                let expired = self.lapic.run_timer(now);
                if expired && lvt & MASKED == 0 && self.r.enabled {
                    self.accepted(lvt as u8, false);
                }
                // Nothing left due: the next expiry is after `now`, or none.
                if let Some(at) = self.lapic.next_event() {
                    if deadline {
                        prop_assert!(at > now);
                    } else {
                        prop_assert!(now.wrapping_sub(at) > 1 << 63, "{} due at {}", at, now);
                    }
                }
            }
            Step::Deadline(d) => {
                let armed = self.lapic.timer_mode() == TimerMode::TscDeadline;
                if let Some(v) = self.due(self.now).filter(|_| armed) {
                    self.accepted(v, false);
                }
                let effect = self
                    .lapic
                    .write_deadline(self.now.wrapping_add(u64::from(d)), self.now);
                prop_assert_eq!(effect, if armed { Effect::Timer } else { Effect::None });
            }
            Step::ArmTimer(vector, count) => {
                for (offset, value) in [
                    (reg::LVT_TIMER, u32::from(vector)),
                    (reg::TIMER_INITIAL, u32::from(count)),
                ] {
                    let [a, b, c, d] = (0xfee0_0000 | offset).to_le_bytes();
                    self.step(&Step::Mmio {
                        bytes: vec![0x89, 0x04, 0x25, a, b, c, d],
                        long: true,
                        offset,
                        gpr: u64::from(value),
                        time: Time::Later(0),
                    })?;
                }
            }
            Step::Enable => {
                self.exit();
                if let Some(v) = self.due(self.now) {
                    self.accepted(v, false);
                }
                self.lapic.write(reg::SVR, SVR_ENABLE | 0xff, self.now);
                self.r.enabled = true;
            }
        }
        Ok(())
    }

    /// The vector the timer raises if it is due at `now` (its next expiry come, its LVT
    /// unmasked, the APIC enabled).
    fn due(&self, now: u64) -> Option<u8> {
        let at = self.lapic.next_event()?;
        let due = match self.lapic.timer_mode() {
            TimerMode::TscDeadline => now >= at,
            // A count's end may be before TSC 0 (a wrapped start): its time has come when
            // `now` is at most half the TSC's range after it.
            _ => now.wrapping_sub(at) <= 1 << 63,
        };
        let lvt = self.lapic.read(reg::LVT_TIMER, now);
        (due && lvt & MASKED == 0 && self.r.enabled).then_some(lvt as u8)
    }

    /// Every 16-byte boundary up to 0x400, read at `now` (the rest of the page is reserved:
    /// a load there is checked to read 0).
    fn registers(&self, now: u64) -> Vec<u32> {
        (0..0x400)
            .step_by(16)
            .map(|o| self.lapic.read(o, now))
            .collect()
    }

    /// A store of `value` at `offset` had `effect`; `before`, the registers before it.
    fn stored(
        &mut self,
        offset: u32,
        value: u32,
        effect: Effect,
        before: &[u32],
        now: u64,
    ) -> Result<(), TestCaseError> {
        if !offset.is_multiple_of(16) || !WRITABLE.contains(&offset) {
            prop_assert_eq!(effect, Effect::None);
            prop_assert_eq!(
                self.registers(now),
                before,
                "a store at {:#x} changes nothing",
                offset
            );
            return Ok(());
        }
        let at = |o: u32| before[(o / 16) as usize];
        match offset {
            reg::TPR => self.r.tpr = value & 0xff,
            reg::EOI => {
                let ended = self.r.in_service.pop_last();
                self.check_eoi(ended, effect)?;
            }
            reg::SVR => self.r.enabled = value & SVR_ENABLE != 0,
            reg::ESR => self.r.esr = std::mem::take(&mut self.r.esr_pending),
            reg::ICR_LOW => {
                // Fixed and lowest-priority IPIs of vectors 0-15 are not sent (SDM Vol. 3A,
                // "Error Handling": send illegal vector).
                if matches!((value >> 8) & 7, 0 | 1) && value & 0xf0 == 0 {
                    prop_assert_eq!(effect, Effect::None);
                    self.r.esr_pending |= ESR_SEND_ILLEGAL;
                } else {
                    prop_assert!(matches!(effect, Effect::Ipi(_)), "{:?}", effect);
                    self.carry_out(effect);
                }
            }
            _ => {}
        }
        // What reads back: the register's writable bits of the value.
        let kept = match offset {
            reg::ID => Some(value & 0xff00_0000),
            reg::TPR => Some(value & 0xff),
            reg::LDR => Some(value & 0xff00_0000),
            reg::DFR => Some(value | 0x0fff_ffff),
            reg::SVR => Some(value & 0x3ff),
            reg::ICR_HIGH => Some(value & 0xff00_0000),
            reg::ICR_LOW => Some(value & !(1 << 12)),
            reg::TIMER_DIVIDE => Some(value & 0xb),
            reg::TIMER_INITIAL => Some(if self.lapic.timer_mode() == TimerMode::TscDeadline {
                at(reg::TIMER_INITIAL)
            } else {
                value
            }),
            o => LVTS.iter().find(|&&(l, _)| l == o).map(|&(_, writable)| {
                let masked = if self.r.enabled { 0 } else { MASKED };
                (value & writable) | masked
            }),
        };
        if let Some(kept) = kept
            && !(offset == reg::LVT_TIMER && self.lapic.timer_mode() == TimerMode::TscDeadline)
        {
            prop_assert_eq!(self.lapic.read(offset, now), kept, "{:#x}", offset);
        }
        Ok(())
    }

    /// The register file as the SDM has it, read at the last step's time: reserved offsets and
    /// bits read 0; ID and version as they are; EOI (write-only) reads 0; PPR from TPR and
    /// ISR; no vector 0-15 in IRR, ISR or TMR; `pending` IRR's highest if its class is above
    /// PPR's; ESR the errors up to the last ESR write; ICR's delivery status 0 (sends are
    /// immediate); every LVT masked while the APIC is software-disabled; the timer's current
    /// count at most its initial one, both 0 in TSC-deadline mode.
    fn check_registers(&self) -> Result<(), TestCaseError> {
        let all = self.registers(self.now);
        let at = |o: u32| all[(o / 16) as usize];
        for (i, &v) in all.iter().enumerate() {
            let o = 16 * i as u32;
            if !REGISTERS.contains(&o) {
                prop_assert_eq!(v, 0, "reserved {:#x}", o);
            }
        }
        prop_assert_eq!(at(reg::ID), u32::from(self.lapic.id()) << 24);
        prop_assert_eq!(at(reg::VERSION), VERSION);
        prop_assert_eq!(at(reg::EOI), 0, "EOI is write-only");
        let tpr = at(reg::TPR);
        prop_assert_eq!(tpr & !0xff, 0);
        let vectors = |base: u32| -> Vec<u32> { (0..8).map(|i| at(base + 0x10 * i)).collect() };
        let highest = |w: &[u32]| {
            (0..256u32)
                .rev()
                .find(|&v| w[(v / 32) as usize] & 1 << (v % 32) != 0)
        };
        let (isr, irr, tmr) = (vectors(reg::ISR), vectors(reg::IRR), vectors(reg::TMR));
        let isrv = highest(&isr).unwrap_or(0);
        let ppr = if tpr >> 4 >= isrv >> 4 {
            tpr
        } else {
            isrv & 0xf0
        };
        prop_assert_eq!(at(reg::PPR), ppr);
        for w in [&isr, &irr, &tmr] {
            prop_assert_eq!(w[0] & 0xffff, 0, "a vector 0-15");
        }
        let pending = highest(&irr).filter(|&v| v >> 4 > ppr >> 4);
        prop_assert_eq!(self.lapic.pending().map(u32::from), pending);
        prop_assert_eq!(at(reg::LDR) & 0x00ff_ffff, 0);
        prop_assert_eq!(at(reg::DFR) & 0x0fff_ffff, 0x0fff_ffff);
        prop_assert_eq!(at(reg::SVR) & !0x3ff, 0);
        prop_assert_eq!(at(reg::SVR) & SVR_ENABLE != 0, self.r.enabled);
        prop_assert_eq!(at(reg::ESR), self.r.esr);
        prop_assert_eq!(at(reg::ICR_LOW) & 1 << 12, 0);
        prop_assert_eq!(at(reg::ICR_HIGH) & 0x00ff_ffff, 0);
        for (o, writable) in LVTS {
            prop_assert_eq!(at(o) & !writable, 0, "{:#x}", o);
            if !self.r.enabled {
                prop_assert!(at(o) & MASKED != 0, "{:#x} unmasked while disabled", o);
            }
        }
        prop_assert_eq!(at(reg::TIMER_DIVIDE) & !0xb, 0);
        let (initial, current) = (at(reg::TIMER_INITIAL), at(reg::TIMER_CURRENT));
        prop_assert!(
            current <= initial,
            "current {} initial {}",
            current,
            initial
        );
        if self.lapic.timer_mode() == TimerMode::TscDeadline {
            prop_assert_eq!((initial, current), (0, 0));
        }
        Ok(())
    }

    /// The state as the reference has it, in the model or in the CPU, whichever holds it.
    fn check(&self) -> Result<(), TestCaseError> {
        let (l, r) = (&self.lapic, &self.r);
        for i in 0..8 {
            prop_assert_eq!(l.read(reg::TMR + 0x10 * i, 0), words(&r.level)[i as usize]);
        }
        if self.handed() {
            let c = &self.cpu;
            prop_assert_eq!(
                c.vectors(reg::IRR),
                r.requested.iter().copied().collect::<Vec<_>>()
            );
            prop_assert_eq!(
                c.vectors(reg::ISR),
                r.in_service.iter().copied().collect::<Vec<_>>()
            );
            prop_assert_eq!(c.word(reg::TPR), r.tpr);
            prop_assert_eq!(c.rvi(), r.requested.last().copied().unwrap_or(0), "RVI");
            prop_assert_eq!(c.svi(), r.in_service.last().copied().unwrap_or(0), "SVI");
            prop_assert_eq!(c.word(reg::PPR), r.ppr(), "VPPR");
            prop_assert_eq!(c.recognized(), r.pending());
        } else {
            prop_assert!(r.in_flight.is_empty());
            for i in 0..8 {
                let at = 0x10 * i;
                prop_assert_eq!(l.read(reg::IRR + at, 0), words(&r.requested)[i as usize]);
                prop_assert_eq!(l.read(reg::ISR + at, 0), words(&r.in_service)[i as usize]);
            }
            prop_assert_eq!(l.read(reg::TPR, 0), r.tpr);
            prop_assert_eq!(l.read(reg::PPR, 0), r.ppr());
            prop_assert_eq!(l.pending(), r.pending());
        }
        Ok(())
    }
}

fn vector() -> impl Strategy<Value = u8> {
    prop_oneof![4 => prop::sample::select(VECTORS.to_vec()), 1 => any::<u8>()]
}

/// TPR values: mostly low enough to let interrupts through.
fn tpr() -> impl Strategy<Value = u8> {
    prop_oneof![2 => Just(0u8), 2 => 0u8..0x60, 1 => any::<u8>()]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        12 => vector().prop_map(Step::Accept),
        12 => Just(Step::Enter),
        4 => Just(Step::Exit),
        12 => Just(Step::CpuDeliver),
        10 => Just(Step::CpuEoi),
        8 => vector().prop_map(Step::CpuSelfIpi),
        2 => tpr().prop_map(Step::CpuTpr),
        3 => Just(Step::Acknowledge),
        3 => Just(Step::ModelEoi),
        1 => tpr().prop_map(Step::ModelTpr),
        1 => Just(Step::Init),
        4 => Just(Step::Enable),
    ]
}

fn time() -> impl Strategy<Value = Time> {
    prop_oneof![8 => (0u32..20_000).prop_map(Time::Later), 1 => any::<u64>().prop_map(Time::At)]
}

/// A register value: any, small (counts, dividers), or one from `VALUES`.
fn value() -> impl Strategy<Value = u32> {
    prop_oneof![
        2 => any::<u32>(),
        2 => 0u32..0x400,
        3 => prop::sample::select(VALUES.to_vec()),
    ]
}

/// An instruction's bytes: a 32-bit MOV to or from memory, encoded (legacy prefixes the
/// decoder takes, REX without W, 89, 8B or C7 /0, ModR/M, SIB and displacement as they say, a
/// register value as C7's immediate); something like one (prefixes it refuses, REX.W, any
/// opcode, any bytes after); or any bytes.
fn instruction() -> impl Strategy<Value = Vec<u8>> {
    let taken = prop::sample::select(vec![0x26u8, 0x2e, 0x36, 0x3e, 0x64, 0x65, 0x67]);
    let mov = (
        prop::collection::vec(taken, 0..3),
        prop::option::weighted(0.25, 0x40u8..0x48),
        prop::sample::select(vec![0x89u8, 0x8b, 0xc7]),
        (0u8..3, 0u8..8, 0u8..8, any::<u8>()),
        (any::<u32>(), value()),
    )
        .prop_map(|(mut b, rex, op, (md, r, rm, sib), (disp, imm))| {
            b.extend(rex);
            b.push(op);
            b.push(md << 6 | if op == 0xc7 { 0 } else { r << 3 } | rm);
            let mut len = match md {
                1 => 1,
                2 => 4,
                _ => 0,
            };
            if rm == 4 {
                b.push(sib);
                if md == 0 && sib & 7 == 5 {
                    len = 4;
                }
            } else if md == 0 && rm == 5 {
                len = 4;
            }
            b.extend(&disp.to_le_bytes()[..len]);
            if op == 0xc7 {
                b.extend(imm.to_le_bytes());
            }
            b
        });
    let prefix = prop::sample::select(vec![
        0x26u8, 0x2e, 0x36, 0x3e, 0x64, 0x65, 0x67, 0x66, 0xf0, 0xf3,
    ]);
    let opcode = prop_oneof![
        3 => prop::sample::select(vec![0x89u8, 0x8b, 0xc7]),
        1 => any::<u8>(),
    ];
    let like = (
        prop::collection::vec(prefix, 0..3),
        prop::option::of(0x40u8..0x50),
        opcode,
        any::<u8>(),
        prop::collection::vec(any::<u8>(), 0..12),
    )
        .prop_map(|(mut b, rex, op, modrm, tail)| {
            b.extend(rex);
            b.push(op);
            b.push(modrm);
            b.extend(tail);
            b
        });
    prop_oneof![
        4 => mov,
        1 => like,
        1 => prop::collection::vec(any::<u8>(), 0..20),
    ]
}

/// A page offset: one of the registers Linux uses most (the timer's twice over), any
/// register's, one within a register's 16 bytes, or any.
fn offset() -> impl Strategy<Value = u32> {
    let most = vec![
        reg::TPR,
        reg::PPR,
        reg::EOI,
        reg::SVR,
        reg::ESR,
        reg::ICR_LOW,
        reg::ICR_HIGH,
        reg::LVT_TIMER,
        reg::LVT_TIMER,
        reg::TIMER_INITIAL,
        reg::TIMER_INITIAL,
        reg::TIMER_CURRENT,
        reg::TIMER_DIVIDE,
    ];
    let regs: Vec<u32> = REGISTERS.iter().copied().chain([0x3f0, 0x400]).collect();
    prop_oneof![
        6 => prop::sample::select(most),
        3 => prop::sample::select(regs.clone()),
        1 => (prop::sample::select(regs), 1u32..16).prop_map(|(o, d)| o + d),
        1 => 0u32..0x1000,
    ]
}

/// Steps with the register file and the decoder: every step above, the guest's accesses that
/// exit, the timer; interrupts of any trigger mode.
fn any_step() -> impl Strategy<Value = Step> {
    let mmio = (
        instruction(),
        any::<bool>(),
        offset(),
        (value(), any::<u32>()),
        time(),
    )
        .prop_map(|(bytes, long, offset, (lo, hi), time)| Step::Mmio {
            bytes,
            long,
            offset,
            gpr: u64::from(hi) << 32 | u64::from(lo),
            time,
        });
    prop_oneof![
        6 => (vector(), any::<bool>()).prop_map(|(v, l)| Step::AcceptAny(v, l)),
        6 => Just(Step::Enter),
        2 => Just(Step::Exit),
        5 => Just(Step::CpuDeliver),
        4 => Just(Step::CpuEoi),
        3 => vector().prop_map(Step::CpuSelfIpi),
        1 => tpr().prop_map(Step::CpuTpr),
        3 => Just(Step::Acknowledge),
        1 => Just(Step::ModelEoi),
        1 => Just(Step::Init),
        1 => Just(Step::Enable),
        16 => mmio,
        3 => time().prop_map(Step::RunTimer),
        1 => (0u32..40_000).prop_map(Step::Deadline),
        2 => (vector(), any::<u16>()).prop_map(|(v, n)| Step::ArmTimer(v, n)),
    ]
}

proptest! {
    /// Any interleaving keeps the model, or the CPU while it holds the state, equal to the
    /// reference: no vector lost or duplicated, the priorities right, nothing stalled.
    #[test]
    fn interrupts_survive_any_interleaving_with_the_cpu(
        steps in prop::collection::vec(step(), 0..200),
    ) {
        let mut w = World::new(true);
        for s in &steps {
            w.step(s)?;
            w.check()?;
        }
    }

    /// Any bytes the decoder takes, at any offset of the page, applied as the exit handlers
    /// apply them, among all the rest: no panic, the interrupt state the reference's, the
    /// register file the SDM's (`World::check_registers`), a load the register's value and a
    /// store to a read-only or reserved offset without effect.
    #[test]
    fn decoded_accesses_keep_the_register_file_right(
        steps in prop::collection::vec(any_step(), 0..200),
    ) {
        let mut w = World::new(false);
        for s in &steps {
            w.step(s)?;
            w.check()?;
            w.check_registers()?;
        }
    }
}
