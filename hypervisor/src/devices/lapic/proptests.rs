//! Property tests of the local APIC model against a reference, with the CPU's virtual-interrupt
//! delivery modelled (`cpu_vapic`): random interleavings of what the other vCPUs and the I/O
//! APIC send (`accept`), VM entries and exits (`hand_over`, `take_back`), what the CPU does
//! while the guest runs (deliveries, EOIs, self-IPIs, TPR writes) and what the model does
//! without virtual-interrupt delivery (`acknowledge`, EOI and TPR writes).
//!
//! The reference is the local APIC as the SDM describes it (Vol. 3A, "Interrupt Acceptance for
//! Fixed Interrupts", "Task and Processor Priorities", "Signaling Interrupt Servicing
//! Completion"): a set of requested vectors (IRR) and one of vectors in service (ISR), TPR, the
//! level-triggered vectors (TMR). An interrupt accepted while the CPU holds the state reaches
//! IRR at the next `take_back` (the model keeps it apart until then, as an interrupt message
//! still on its way). Checked after every step, against the model when it holds the state and
//! against the CPU's page and guest interrupt status when the CPU does: no vector lost, none
//! added or duplicated, RVI and SVI the highest of VIRR and VISR, PPR (or VPPR) from TPR and
//! the highest in service, and the vector that would be delivered now the reference's (so that
//! nothing stalls); and at each entry, that the model's idea of the page is what it holds
//! (`CpuVapic::enter`).

use super::cpu_vapic::CpuVapic;
use super::{Delivery, Effect, Lapic, SVR_ENABLE, reg};
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
    /// TMR: the vectors last accepted as level-triggered, until their EOI.
    level: BTreeSet<u8>,
    tpr: u32,
    enabled: bool,
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
}

impl World {
    fn new() -> World {
        let mut lapic = Lapic::new(0);
        lapic.write(reg::SVR, SVR_ENABLE | 0xff, 0);
        World {
            lapic,
            cpu: CpuVapic::new(),
            r: Reference {
                enabled: true,
                ..Reference::default()
            },
        }
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
        if v < 16 || !self.r.enabled {
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

    /// What a write asks for, done as `vmexit::lapic::carry_out` does for this vCPU alone.
    fn carry_out(&mut self, effect: Effect) {
        if let Effect::Ipi(ipi) = effect
            && matches!(ipi.delivery, Delivery::Fixed | Delivery::LowestPriority)
            && self.lapic.is_target(&ipi)
        {
            self.accept(ipi.vector, ipi.level_triggered);
        }
    }

    /// The EOI of `ended` (none: nothing was in service) had `effect`.
    fn check_eoi(&mut self, ended: Option<u8>, effect: Effect) -> Result<(), TestCaseError> {
        let want = match ended {
            Some(v) if self.r.level.remove(&v) => Effect::LevelEoi(v),
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
                    } else {
                        // A level vector in service was level when handed over: its EOI exits.
                        prop_assert!(!ended.is_some_and(|v| self.r.level.contains(&v)));
                    }
                }
            }
            Step::CpuSelfIpi(v) => {
                if self.handed() && !LEVEL.contains(&v) {
                    let icr = 1 << 18 | u32::from(v);
                    if self.cpu.write_icr_low(icr) {
                        self.r.requested.insert(v);
                    } else {
                        // An APIC-write exit: the model sends it.
                        prop_assert!(v < 16);
                        self.exit();
                        let effect = self.lapic.write(reg::ICR_LOW, icr, 0);
                        self.carry_out(effect);
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
                let effect = self.lapic.write(reg::EOI, 0, 0);
                let ended = self.r.in_service.pop_last();
                self.check_eoi(ended, effect)?;
            }
            Step::ModelTpr(t) => {
                self.exit();
                self.lapic.write(reg::TPR, u32::from(t), 0);
                self.r.tpr = u32::from(t);
            }
            Step::Init => {
                self.lapic.init();
                self.r = Reference::default();
            }
            Step::Enable => {
                self.exit();
                self.lapic.write(reg::SVR, SVR_ENABLE | 0xff, 0);
                self.r.enabled = true;
            }
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

proptest! {
    /// Any interleaving keeps the model, or the CPU while it holds the state, equal to the
    /// reference: no vector lost or duplicated, the priorities right, nothing stalled.
    #[test]
    fn interrupts_survive_any_interleaving_with_the_cpu(
        steps in prop::collection::vec(step(), 0..200),
    ) {
        let mut w = World::new();
        for s in &steps {
            w.step(s)?;
            w.check()?;
        }
    }
}
