//! A vCPU's local APIC in xAPIC mode: the register file a guest reads and writes at
//! 0xfee00000, the timer, interrupt acceptance and priorities, EOI, and the IPIs its ICR sends.
//! Pure logic: the caller decodes the guest's access (an APIC-access exit or an EPT violation,
//! `mmio_decode`) and applies it with [`Lapic::mmio`] (an APIC-write exit's with
//! [`Lapic::write`]), carries out the [`Effect`] a write returns (an IPI to other vCPUs, an EOI
//! to broadcast to the I/O APIC), injects [`Lapic::pending`]'s vector when the vCPU can take it
//! and calls [`Lapic::acknowledge`] then, and wakes the vCPU at [`Lapic::next_event`] (the
//! timer). With the CPU's virtual-interrupt delivery, the CPU delivers the vectors instead:
//! [`Lapic::hand_over`] gives it TPR, IRR and ISR before a VM entry, [`Lapic::take_back`] takes
//! back what it made of them after the exit.
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

use crate::mmio_decode::Op;

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
/// SVR's writable bits: the spurious vector, software enable, focus processor checking (bit 9).
/// Bit 12 (EOI-broadcast suppression) is reserved to 0, as `VERSION` does not offer it (SDM Vol.
/// 3A, "Spurious-Interrupt Vector Register", "EOI-Broadcast Suppression").
const SVR_WRITABLE: u32 = 0x3ff;
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
    /// The sender's place on the bus (its vCPU index, the APIC ID it had at reset), for the
    /// shorthands: the sender is itself whatever ID it has now.
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

/// What a guest's instruction did at the local APIC's page ([`Lapic::mmio`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mmio {
    /// A load: general register `reg` (0-15) gets `value`, zero-extended (a 32-bit load).
    Load { reg: u8, value: u32 },
    /// A store, and what it asks of the caller.
    Store(Effect),
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
    /// The xAPIC ID (bits 31:24 of the ID register), which software may change.
    id: u8,
    /// Its place on the bus: the APIC ID at reset, which the vCPU's CPUID reports (the IPIs'
    /// `source`).
    index: u8,
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
    /// TMICT: the count a write starts; it keeps its value when a one-shot count ends.
    timer_initial: u32,
    /// Whether the count runs: from a write of a non-zero TMICT until a one-shot count reaches
    /// 0 (TMCCT then reads 0), a write of 0, or a change to or from TSC-deadline mode.
    timer_running: bool,
    divide: u32,
    /// The TSC at which the count was (or would have been, under the current divider)
    /// `timer_initial`; kept with wrapping arithmetic (a divider change may put it before TSC 0).
    timer_start: u64,
    /// TSC-deadline mode's deadline (0: disarmed).
    deadline: u64,
    /// NMIs sent to this CPU and not taken yet: at most two, one to deliver and one latched
    /// behind it, as while none is in service two that arrive together are both delivered
    /// (KVM's rule, which kvm-unit-tests' apic.flat checks); while one is in service the CPU
    /// latches one (SDM Vol. 3A §6.7.1, "Handling Multiple NMIs": `nmi_in_service`).
    nmis: u8,
    /// Counts every change of a register the virtual-APIC page shows (`page_registers`), so
    /// that the page is rewritten only after one.
    generation: u64,
    /// With virtual-interrupt delivery: what the virtual-APIC page and the VMCS hold, as this
    /// model last wrote them (`hand_over`) or read them back (`take_back`); none when unknown
    /// (at first, after INIT).
    page: Option<VirtualState>,
    /// Between `hand_over` and `take_back`: the CPU's copy of TPR, IRR and ISR is the true one.
    handed: bool,
    /// TPR, IRR, ISR or TMR changed since the last `hand_over` (it has something to write).
    dirty: bool,
    /// The vectors accepted since the last `hand_over` (`take_back` adds them to the CPU's IRR).
    fresh: Bits,
    /// IA32_APIC_BASE's global enable (bit 11): cleared, the APIC is off until set again.
    globally_enabled: bool,
    /// IA32_APIC_BASE's physical base (bits 12 and up): where the registers answer.
    base: u64,
}

/// The part of a local APIC the CPU keeps while the vCPU runs with virtual-interrupt delivery
/// (SDM Vol. 3C §29.1.1, "Virtualized APIC Registers"; §24.4.2, "Guest interrupt status";
/// §29.1.2-29.1.4): VTPR, VIRR and VISR in the virtual-APIC page, RVI and SVI in the VMCS, and
/// the EOI-exit bitmap that makes the EOI of a level-triggered vector a VM exit (its I/O APIC
/// entry waits for it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VirtualState {
    pub tpr: u32,
    /// VIRR: the 8 32-bit words at offsets 0x200-0x270.
    pub irr: [u32; 8],
    /// VISR: the 8 words at 0x100-0x170.
    pub isr: [u32; 8],
    /// Guest interrupt status: RVI (the highest requested vector) in bits 7:0, SVI (the highest
    /// in service) in bits 15:8.
    pub status: u16,
    /// EOI-exit bitmap 0-3 (bit `v` of the 256: vector `v`'s EOI exits).
    pub eoi_exit: [u64; 4],
}

/// The registers whose reads APIC-register virtualization serves from the virtual-APIC page
/// (SDM Vol. 3C §29.4.2, "Virtualizing Reads from the APIC-Access Page"), besides TPR, ISR and
/// IRR (`VirtualState`): a read of any other offset (PPR, the timer's current count, ...) is an
/// APIC-access VM exit.
pub const PAGE_REGISTERS: [u32; 25] = [
    reg::ID,
    reg::VERSION,
    reg::EOI,
    reg::LDR,
    reg::DFR,
    reg::SVR,
    reg::TMR,
    reg::TMR + 0x10,
    reg::TMR + 0x20,
    reg::TMR + 0x30,
    reg::TMR + 0x40,
    reg::TMR + 0x50,
    reg::TMR + 0x60,
    reg::TMR + 0x70,
    reg::ESR,
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

/// The APIC's architectural physical base (IA32_APIC_BASE bits 12 and up).
const APIC_BASE: u64 = 0xfee0_0000;

/// IA32_APIC_BASE (SDM Vol. 3A §11.4.4) of an APIC at the architectural base: the global
/// enable (bit 11) when `enabled`, and the BSP flag (bit 8) for the bootstrap processor.
#[must_use]
pub fn apic_base_value(enabled: bool, bsp: bool) -> u64 {
    apic_base_at(APIC_BASE, enabled, bsp)
}

/// IA32_APIC_BASE of an APIC at physical `base`.
fn apic_base_at(base: u64, enabled: bool, bsp: bool) -> u64 {
    base | if enabled { 1 << 11 } else { 0 } | if bsp { 1 << 8 } else { 0 }
}
const LVT_TIMER: usize = 0;
const LVT_PERF: usize = 2;
const LVT_LINT0: usize = 3;

impl Lapic {
    /// An APIC after reset (or INIT): every LVT masked, software-disabled, `id` its APIC ID.
    #[must_use]
    pub fn new(id: u8) -> Lapic {
        Lapic {
            id,
            index: id,
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
            timer_running: false,
            divide: 0,
            timer_start: 0,
            deadline: 0,
            nmis: 0,
            generation: 0,
            page: None,
            handed: false,
            dirty: true,
            fresh: Bits::default(),
            globally_enabled: true,
            base: APIC_BASE,
        }
    }

    /// The state INIT leaves (the SDM's "state after INIT": as reset, the APIC ID kept). What
    /// the CPU held for it (`hand_over`) is dropped, and the page written again. IA32_APIC_BASE
    /// is as it was (INIT does not reset it: SDM Vol. 3A Table 10-1 lists it under power-up and
    /// reset only).
    pub fn init(&mut self) {
        let generation = self.generation + 1;
        let globally_enabled = self.globally_enabled;
        let base = self.base;
        let id = self.id;
        *self = Lapic::new(self.index);
        self.id = id;
        self.generation = generation;
        self.globally_enabled = globally_enabled;
        self.base = base;
    }

    /// IA32_APIC_BASE as the vCPU reads it: its base, the global enable (bit 11), and the BSP
    /// flag (bit 8) for the bootstrap processor.
    #[must_use]
    pub fn apic_base(&self, bsp: bool) -> u64 {
        apic_base_at(self.base, self.globally_enabled, bsp)
    }

    /// Whether the APIC's registers answer at the 4-KiB page of guest-physical address `gpa`:
    /// it is globally enabled and based there.
    #[must_use]
    pub fn answers_at(&self, gpa: u64) -> bool {
        self.globally_enabled && gpa & !0xfff == self.base
    }

    /// A WRMSR of `value` to IA32_APIC_BASE on a CPU whose physical addresses have `phys_bits`
    /// bits (MAXPHYADDR); false for a value the vCPU cannot write (the caller injects #GP):
    /// a reserved bit (7:0, 9, and MAXPHYADDR and up: SDM Vol. 3A §11.4.4, Figure 11-5), or
    /// x2APIC mode (bit 10: not offered, CPUID.1:ECX[21] is clear). The base may move to any
    /// page (the guest's accesses there reach the registers; at a page of its RAM, the RAM
    /// answers, as under KVM). The BSP flag is the processor's and stays as it is. Clearing the
    /// global enable turns the APIC off and loses its state: it is as after reset, its ID kept,
    /// when it is enabled again (§11.4.3), as on every processor since the Pentium 4, whose
    /// APIC may be re-enabled without a reset.
    #[must_use]
    pub fn write_apic_base(&mut self, value: u64, phys_bits: u8) -> bool {
        const EXTD: u64 = 1 << 10;
        const ENABLE: u64 = 1 << 11;
        // Bits 7:0 and 9 are reserved; bit 8 (BSP) is read-only.
        let reserved = 0x2ff | u64::MAX.checked_shl(u32::from(phys_bits)).unwrap_or(0);
        if value & (reserved | EXTD) != 0 {
            return false;
        }
        let enable = value & ENABLE != 0;
        if self.globally_enabled && !enable {
            // As after reset: the APIC ID too is the processor's again.
            self.init();
            self.id = self.index;
        }
        self.globally_enabled = enable;
        self.base = value & !0xfff;
        true
    }

    /// Whether IA32_APIC_BASE's global enable is set.
    #[must_use]
    pub fn globally_enabled(&self) -> bool {
        self.globally_enabled
    }

    /// Counts changes of the registers the virtual-APIC page shows.
    #[must_use]
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Each register the virtual-APIC page shows for reads (`PAGE_REGISTERS`, the LVT) with
    /// its value; TPR, ISR and IRR come with `hand_over`.
    pub fn page_registers(&self, mut write: impl FnMut(u32, u32)) {
        for o in PAGE_REGISTERS {
            // The timer's current count is not among them: `read` needs no time here.
            write(o, self.read(o, 0));
        }
    }

    /// What the virtual-APIC page and the VMCS should hold for this APIC's TPR, IRR, ISR and TMR.
    fn image(&self) -> VirtualState {
        let mut irr = [0; 8];
        let mut isr = [0; 8];
        for i in 0..8 {
            irr[i] = self.irr.word(i as u32);
            isr[i] = self.isr.word(i as u32);
        }
        let rvi = self.irr.highest().unwrap_or(0);
        let svi = self.isr.highest().unwrap_or(0);
        VirtualState {
            tpr: self.tpr,
            irr,
            isr,
            status: u16::from(rvi) | u16::from(svi) << 8,
            eoi_exit: self.tmr.0,
        }
    }

    /// Gives the CPU this APIC's TPR, IRR and ISR for a VM entry with virtual-interrupt
    /// delivery: the state to put in the virtual-APIC page and the VMCS, with what they hold
    /// now (none: unknown, write all of it), so that only what differs is written; or nothing
    /// when they hold it already (the common case: an exit that touched no interrupt). Until
    /// `take_back`, the CPU's copy is the true one (what `accept` adds meanwhile is kept apart).
    pub fn hand_over(&mut self) -> Option<(VirtualState, Option<VirtualState>)> {
        self.fresh = Bits::default();
        self.handed = true;
        if !self.dirty && self.page.is_some() {
            return None;
        }
        self.dirty = false;
        let state = self.image();
        let before = self.page.replace(state);
        (before != Some(state)).then_some((state, before))
    }

    /// Takes back what `hand_over` gave the CPU, after a VM exit: `status` is the guest
    /// interrupt status and `tpr` VTPR now; `page(offset)` reads a word of the virtual-APIC
    /// page. While the guest ran, the CPU may have changed VIRR and VISR without an exit in
    /// every way SDM Vol. 3C §29.1-29.2 lets it: a virtual-interrupt delivery moves a vector
    /// from VIRR to VISR (§29.2.2), an EOI virtualization clears VISR's highest (§29.1.4), a
    /// self-IPI virtualization sets any VIRR bit (§29.1.5: the guest's `ICR` write of a fixed,
    /// edge self-IPI; RVI moves only if the vector is above it, so that RVI and SVI may be as
    /// they were with VIRR and VISR changed). So all 8 words of each are read back, whatever
    /// the status says; the model's IRR is the CPU's with the vectors accepted meanwhile
    /// (`accept`) added, its ISR the CPU's. Also read back: ICR, whose halves the guest writes
    /// there without an exit (§29.4.3.2: the high half's write never exits, the low half's not
    /// when it is a self-IPI the CPU virtualizes), and reads there. Nothing to do when nothing
    /// was handed over. Returns whether the CPU changed IRR or ISR.
    pub fn take_back(&mut self, status: u16, tpr: u32, page: impl Fn(u32) -> u32) -> bool {
        if !core::mem::take(&mut self.handed) {
            return false;
        }
        let Some(mut p) = self.page else {
            return false;
        };
        self.tpr = tpr & 0xff;
        p.tpr = self.tpr;
        // The CPU clears the bytes below the destination (§29.4.3.2); masked all the same.
        self.icr_high = page(reg::ICR_HIGH) & 0xff00_0000;
        // Delivery status (bit 12) is 0 in a self-IPI the CPU virtualizes; sends are immediate.
        self.icr_low = page(reg::ICR_LOW) & !(1 << 12);
        let mut changed = false;
        let mut irr = Bits::default();
        let mut isr = Bits::default();
        for i in 0..8 {
            let at = 0x10 * i as u32;
            let (r, s) = (page(reg::IRR + at), page(reg::ISR + at));
            changed |= r != p.irr[i] || s != p.isr[i];
            p.irr[i] = r;
            p.isr[i] = s;
            let (w, shift) = (i / 2, (i % 2) * 32);
            irr.0[w] |= u64::from(r) << shift;
            isr.0[w] |= u64::from(s) << shift;
        }
        p.status = status;
        for w in 0..4 {
            irr.0[w] |= self.fresh.0[w];
        }
        self.irr = irr;
        self.isr = isr;
        self.page = Some(p);
        changed
    }

    /// Whether the CPU holds this APIC's interrupt state now (between `hand_over` and
    /// `take_back`).
    #[must_use]
    pub fn handed_over(&self) -> bool {
        self.handed
    }

    /// A virtualized EOI of level-triggered `vector` (an EOI-induced VM exit, SDM Vol. 3C
    /// §29.1.4): the CPU ended it in VISR; what is left is the I/O APIC's.
    pub fn virtual_eoi(&mut self, vector: u8) -> Effect {
        if self.tmr.get(vector) {
            Effect::LevelEoi(vector)
        } else {
            Effect::None
        }
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
        if !self.timer_running || self.timer_mode() == TimerMode::TscDeadline {
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
            _ => self
                .timer_running
                .then(|| self.timer_start.wrapping_add(self.period())),
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
            // TMICT keeps its value (SDM Vol. 3A §11.5.4: the count stops at 0).
            TimerMode::OneShot => self.timer_running = false,
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
        self.fresh.set(vector, true);
        self.dirty = true;
        if self.tmr.get(vector) != level {
            self.tmr.set(vector, level);
            self.generation += 1;
        }
    }

    /// A performance-monitoring counter overflowed with its interrupt enabled (the vCPU's virtual
    /// PMU, `hvprof_pmu::virtual_pmu`): the LVT performance counter entry delivers it as
    /// programmed, a fixed vector or an NMI (SDM Vol. 3B §21.2.2 "... the counter overflow
    /// ... generates a performance monitoring interrupt (PMI) through the local APIC's LVT
    /// performance counter entry"; Vol. 3A §11.5.1). Intel processors then set the entry's mask
    /// bit, and the PMI handler clears it again (Linux's and kvm-unit-tests' pmu.flat do; KVM
    /// models the same). A masked entry, or a software-disabled APIC, delivers nothing.
    /// Returns whether it delivered.
    pub fn performance_interrupt(&mut self) -> bool {
        let lvt = self.lvt[LVT_PERF];
        if lvt & MASKED != 0 || !self.software_enabled() {
            return false;
        }
        match Delivery::of(lvt) {
            Delivery::Fixed => self.accept((lvt & LVT_VECTOR) as u8, false),
            Delivery::Nmi => self.accept_nmi(),
            // SMI, INIT and ExtINT are not for this entry; nothing arrives.
            _ => return false,
        }
        self.lvt[LVT_PERF] |= MASKED;
        self.generation += 1;
        true
    }

    /// An NMI for this CPU (an NMI IPI). Taken even while the APIC is software-disabled, as
    /// NMI, INIT and SIPI are (SDM Vol. 3A §11.4.7.2).
    pub fn accept_nmi(&mut self) {
        self.nmis = (self.nmis + 1).min(2);
    }

    /// Whether an NMI waits to be taken.
    #[must_use]
    pub fn nmi_pending(&self) -> bool {
        self.nmis != 0
    }

    /// Takes a waiting NMI (the CPU delivers it now); another may wait behind it.
    pub fn take_nmi(&mut self) -> bool {
        let taken = self.nmis != 0;
        self.nmis = self.nmis.saturating_sub(1);
        taken
    }

    /// The CPU has an NMI in service (its handler runs until IRET, blocking NMIs) or on its way:
    /// those that wait are latched as one (SDM Vol. 3A §6.7.1).
    pub fn nmi_in_service(&mut self) {
        self.nmis = self.nmis.min(1);
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
        self.dirty = true;
        self.irr.set(vector, false);
        self.isr.set(vector, true);
    }

    /// Whether an IPI's destination names this APIC (`Ipi::source` is the sender's ID).
    #[must_use]
    pub fn is_target(&self, ipi: &Ipi) -> bool {
        match ipi.destination {
            Destination::ToSelf => ipi.source == self.index,
            Destination::All => true,
            Destination::AllButSelf => ipi.source != self.index,
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

    /// Reads the 32-bit register at page offset `offset` at TSC `now`. The registers are at
    /// 16-byte boundaries: other offsets, as reserved ones, read 0.
    #[must_use]
    pub fn read(&self, offset: u32, now: u64) -> u32 {
        if !offset.is_multiple_of(16) {
            return 0;
        }
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

    /// Writes the 32-bit register at page offset `offset` at TSC `now`; what the caller must do
    /// next. A write at an offset that is not a register's 16-byte boundary is ignored. A write
    /// that changes the timer (its LVT, counts, divider, or SVR, which masks it) finds an
    /// expiry due by `now` raised already, as it was on time.
    pub fn write(&mut self, offset: u32, value: u32, now: u64) -> Effect {
        if !offset.is_multiple_of(16) {
            return Effect::None;
        }
        if matches!(
            offset,
            reg::LVT_TIMER | reg::TIMER_INITIAL | reg::TIMER_DIVIDE | reg::SVR
        ) {
            self.run_timer(now);
        }
        self.generation += 1;
        self.dirty = true;
        match offset {
            // The xAPIC ID is writable (SDM Vol. 3A §11.4.6: software may change it on the
            // Pentium 4 and later processors' xAPIC; KVM lets it, and kvm-unit-tests' apic.flat
            // gives two vCPUs the same ID). Physical destinations follow it.
            reg::ID => self.id = (value >> 24) as u8,
            reg::TPR => self.tpr = value & 0xff,
            reg::EOI => return self.eoi(),
            reg::LDR => self.ldr = value & 0xff00_0000,
            reg::DFR => self.dfr = value | 0x0fff_ffff,
            reg::SVR => {
                self.svr = value & SVR_WRITABLE;
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
                let deadline = TimerMode::TscDeadline;
                if i == LVT_TIMER && (was == deadline) != (self.timer_mode() == deadline) {
                    // "Transitioning between TSC-deadline mode and other timer modes also
                    // disarms the timer" (SDM Vol. 3A §11.5.4.1): TMICT and the deadline are 0.
                    self.timer_initial = 0;
                    self.timer_running = false;
                    self.timer_start = 0;
                    self.deadline = 0;
                    return Effect::Timer;
                }
                if i == LVT_TIMER && self.timer_mode() != was {
                    // Between one-shot and periodic the count goes on from where it is: to 0
                    // and a stop, or to 0 and TMICT again; a stopped count stays at 0 (as on
                    // the CPU and under KVM; kvm-unit-tests' apic.flat checks it).
                    return Effect::Timer;
                }
            }
            reg::TIMER_INITIAL => {
                if self.timer_mode() == TimerMode::TscDeadline {
                    return Effect::None;
                }
                self.timer_initial = value;
                self.timer_running = value != 0;
                self.timer_start = now;
                return Effect::Timer;
            }
            reg::TIMER_DIVIDE => {
                // Keep the count where it is under the new divider.
                let current = self.current_count(now);
                self.divide = value & 0xb;
                if self.timer_running && self.timer_mode() != TimerMode::TscDeadline {
                    let done = u64::from(self.timer_initial - current.min(self.timer_initial));
                    self.timer_start = now.wrapping_sub(done * self.ticks_per_count());
                    return Effect::Timer;
                }
            }
            _ => {}
        }
        Effect::None
    }

    /// A guest's access at byte `offset` of the APIC page (0-0xfff), by the instruction
    /// `mmio_decode` decoded as `op`, at TSC `now`: an EPT violation at the page, or an
    /// APIC-access exit (SDM Vol. 3C §29.4.4) for an access the CPU does not virtualize.
    /// `gpr(r)` is general register `r`, for a store from a register (the low 32 bits are
    /// stored). An access where no register is behind it reads 0 or is ignored (`read`,
    /// `write`). The caller completes a load into the register and carries out a store's
    /// effect, and moves RIP past the instruction.
    pub fn mmio(&mut self, offset: u32, op: Op, gpr: impl FnOnce(u8) -> u64, now: u64) -> Mmio {
        match op {
            Op::Read { reg } => Mmio::Load {
                reg,
                value: self.read(offset, now),
            },
            Op::Write { reg } => Mmio::Store(self.write(offset, gpr(reg) as u32, now)),
            Op::WriteImm { imm } => Mmio::Store(self.write(offset, imm, now)),
        }
    }

    /// IA32_TSC_DEADLINE written at TSC `now` (TSC-deadline mode only; 0 disarms). A deadline
    /// that passed by `now` has raised its interrupt already, as it did on time.
    pub fn write_deadline(&mut self, tsc: u64, now: u64) -> Effect {
        if self.timer_mode() != TimerMode::TscDeadline {
            return Effect::None;
        }
        self.run_timer(now);
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

    /// EOI: the highest vector in service ends; a level-triggered one's EOI goes on to the I/O
    /// APIC. TMR stays as it is: only the next acceptance of the vector changes its bit (SDM Vol.
    /// 3A §11.8.4: "upon acceptance of an interrupt into the IRR, the corresponding TMR bit is
    /// cleared for edge-triggered interrupts and set for level-triggered interrupts").
    fn eoi(&mut self) -> Effect {
        let Some(v) = self.isr.highest() else {
            return Effect::None;
        };
        self.isr.set(v, false);
        if self.tmr.get(v) {
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
            source: self.index,
            level_triggered: low & ICR_TRIGGER_LEVEL != 0,
            assert: low & ICR_LEVEL_ASSERT != 0,
        })
    }
}

#[cfg(test)]
mod cpu_vapic;

#[cfg(test)]
mod proptests;

#[cfg(test)]
mod tests {
    use super::cpu_vapic::CpuVapic;
    use super::*;

    fn enabled(id: u8) -> Lapic {
        let mut l = Lapic::new(id);
        l.write(reg::SVR, SVR_ENABLE | 0xff, 0);
        l
    }

    #[test]
    fn a_counter_overflow_arrives_through_the_performance_lvt_which_masks_itself() {
        // Masked (after reset): nothing.
        let mut l = enabled(0);
        assert!(!l.performance_interrupt());
        assert_eq!(l.pending(), None);
        // A fixed vector: accepted once, and the entry is masked until the handler unmasks it.
        l.write(reg::LVT_PERF, 0x42, 0);
        let before = l.generation();
        assert!(l.performance_interrupt());
        assert_eq!(l.pending(), Some(0x42));
        assert_eq!(l.read(reg::LVT_PERF, 0), 0x42 | MASKED);
        assert!(l.generation() > before, "the page shows the mask bit");
        assert!(
            !l.performance_interrupt(),
            "masked now: a second overflow is lost"
        );
        l.write(reg::LVT_PERF, 0x42, 0);
        assert!(l.performance_interrupt());
        // NMI delivery (Linux's choice): an NMI, no vector.
        let mut l = enabled(0);
        l.write(reg::LVT_PERF, 4 << DELIVERY_SHIFT, 0);
        assert!(l.performance_interrupt());
        assert!(l.nmi_pending());
        assert_eq!(l.pending(), None);
        // A software-disabled APIC delivers nothing.
        let mut l = Lapic::new(0);
        l.write(reg::LVT_PERF, 0x42, 0);
        assert!(!l.performance_interrupt());
        assert!(!l.nmi_pending());
    }

    #[test]
    fn virtual_interrupt_delivery_hands_the_state_over_and_back() {
        let mut l = enabled(0);
        l.accept(0x31, false);
        l.accept(0x50, true);
        let mut cpu = CpuVapic::new();
        let (given, _) = cpu.enter(&mut l).expect("new state");
        assert!(l.handed_over());
        assert_eq!(given.status, 0x50, "RVI 0x50, SVI 0");
        assert_eq!(given.irr[1], 1 << 17, "0x31 in VIRR's second word");
        assert_eq!(given.irr[2], 1 << 16, "0x50 in the third");
        assert_eq!(
            given.eoi_exit[1],
            1 << (0x50 - 64),
            "the level vector's EOI exits"
        );
        // Nothing delivered (the guest runs with interrupts disabled), and a vector that came
        // meanwhile is kept. The guest wrote ICR's high half, which exits only with the low
        // half's write.
        l.accept(0x40, false);
        cpu.write_icr_high(0x0100_0000);
        assert!(!cpu.exit(&mut l), "the CPU changed neither IRR nor ISR");
        assert_eq!(l.read(reg::ICR_HIGH, 0), 0x0100_0000);
        assert!(!l.handed_over());
        assert_eq!(l.pending(), Some(0x50));
        // The CPU delivers 0x50; meanwhile another 0x31 arrives (an IPI from the other vCPU):
        // it waits behind the one in service. The guest raises its TPR.
        cpu.enter(&mut l).expect("new state");
        assert_eq!(cpu.deliver(), Some(0x50));
        assert_eq!(cpu.status, 0x50 << 8 | 0x40);
        l.accept(0x31, false);
        cpu.write_tpr(0x20);
        assert!(cpu.exit(&mut l));
        assert_eq!(l.read(reg::TPR, 0), 0x20, "VTPR taken back");
        assert_eq!(l.read(reg::ISR + 0x20, 0), 1 << 16, "0x50 in service");
        assert_eq!(l.read(reg::IRR + 0x10, 0), 1 << 17, "0x31 waits");
        assert_eq!(l.read(reg::IRR + 0x20, 0), 1, "0x40 waits, 0x50 went");
        assert_eq!(l.ppr(), 0x50);
        assert_eq!(l.pending(), None, "both below the one in service");
        // Its EOI, virtualized: the CPU clears VISR and exits (a level vector), the exit tells
        // the I/O APIC. (The second 0x31 merged into the first in VIRR: nothing to write.)
        assert_eq!(cpu.enter(&mut l), None);
        assert_eq!(cpu.eoi(), (0x50, true));
        assert!(cpu.exit(&mut l));
        assert_eq!(l.virtual_eoi(0x50), Effect::LevelEoi(0x50));
        assert_eq!(
            l.read(reg::TMR + 0x20, 0),
            1 << 16,
            "TMR keeps 0x50 after its EOI (SDM Vol. 3A §11.8.4)"
        );
        assert_eq!(
            l.virtual_eoi(0x40),
            Effect::None,
            "an edge vector's EOI has no effect"
        );
        assert_eq!(l.read(reg::ISR + 0x20, 0), 0);
        assert_eq!(l.pending(), Some(0x40));
    }

    #[test]
    fn an_unchanged_state_is_not_handed_over_again() {
        let mut l = enabled(0);
        l.accept(0x31, false);
        let mut cpu = CpuVapic::new();
        let (_, before) = cpu.enter(&mut l).expect("first");
        assert_eq!(before, None, "the page unknown: all of it written");
        // An exit that changed nothing: nothing to write at the next entry.
        assert!(!cpu.exit(&mut l));
        assert_eq!(cpu.enter(&mut l), None);
        assert!(l.handed_over());
        // A vector from another vCPU: written.
        l.accept(0x41, false);
        assert!(!cpu.exit(&mut l));
        let (given, before) = cpu.enter(&mut l).expect("a new vector");
        let before = before.expect("the page as the last entry left it");
        assert_eq!(
            (before.irr[2], given.irr[2]),
            (0, 1 << 1),
            "only 0x41's word differs"
        );
        // The CPU delivers 0x41, the guest ends it, and 0x41 comes again: the model is as it
        // was given, but the page is not (VIRR lost 0x41): it is handed over again, against
        // the page as the CPU left it.
        assert_eq!(cpu.deliver(), Some(0x41));
        assert_eq!(cpu.eoi(), (0x41, false));
        l.accept(0x41, false);
        assert!(cpu.exit(&mut l));
        let (again, before) = cpu.enter(&mut l).expect("VIRR lost 0x41");
        assert_eq!(again, given);
        assert_eq!(
            before.map(|b| b.irr[2]),
            Some(0),
            "the page as the CPU left it"
        );
    }

    /// Self-IPIs the CPU virtualizes (SDM Vol. 3C §29.1.5) set a VIRR bit without an exit,
    /// in any word, and move RVI only when above it: `take_back` finds them all.
    #[test]
    fn self_ipis_the_cpu_virtualizes_are_taken_back() {
        let mut l = enabled(0);
        l.accept(0x80, false);
        let mut cpu = CpuVapic::new();
        cpu.enter(&mut l).expect("new state");
        // The guest runs with interrupts disabled and sends itself 0x42, below RVI: neither
        // RVI nor SVI moves.
        let status = cpu.status;
        assert!(cpu.self_ipi(0x42));
        assert_eq!(cpu.status, status);
        assert!(cpu.exit(&mut l), "the CPU changed VIRR");
        assert_eq!(l.read(reg::IRR + 0x20, 0), 1 << 2, "0x42 taken back");
        assert_eq!(l.read(reg::IRR + 0x40, 0), 1, "0x80 still waits");
        // Next time the CPU delivers 0x80 and the guest sends itself 0x23, in a VIRR word
        // that held nothing when the state was handed over.
        cpu.enter(&mut l);
        assert_eq!(cpu.deliver(), Some(0x80));
        assert!(cpu.self_ipi(0x23));
        assert!(cpu.exit(&mut l));
        assert_eq!(l.read(reg::IRR + 0x10, 0), 1 << 3, "0x23 taken back");
        assert_eq!(l.read(reg::IRR + 0x20, 0), 1 << 2, "0x42 still waits");
        assert_eq!(l.read(reg::ISR + 0x40, 0), 1, "0x80 in service");
        assert_eq!(l.pending(), None, "both below the one in service");
        // Handed over again with a vector from another vCPU (`enter` checks that the page
        // and the status are the model's state), both are delivered, highest first, as the
        // guest ends each.
        l.accept(0x21, false);
        let (given, _) = cpu.enter(&mut l).expect("0x21 is new to the CPU");
        assert_eq!(given.status, 0x80 << 8 | 0x42);
        assert_eq!(cpu.deliver(), None);
        assert_eq!(cpu.eoi(), (0x80, false));
        assert_eq!(cpu.deliver(), Some(0x42));
        assert_eq!(cpu.eoi(), (0x42, false));
        assert_eq!(cpu.deliver(), Some(0x23));
        assert_eq!(cpu.eoi(), (0x23, false));
        assert_eq!(cpu.deliver(), Some(0x21));
        assert_eq!(cpu.eoi(), (0x21, false));
        assert_eq!(cpu.deliver(), None);
        assert!(cpu.exit(&mut l));
        for i in 0..8 {
            assert_eq!(l.read(reg::IRR + 0x10 * i, 0), 0);
            assert_eq!(l.read(reg::ISR + 0x10 * i, 0), 0);
        }
    }

    /// Deliveries, EOIs and self-IPIs can leave RVI and SVI as they were with VISR changed:
    /// the guest interrupt status alone does not say whether the CPU changed anything.
    #[test]
    fn an_unchanged_interrupt_status_does_not_mean_an_unchanged_state() {
        let mut l = enabled(0);
        l.accept(0x50, false);
        l.accept(0x60, false);
        l.acknowledge(0x60);
        let mut cpu = CpuVapic::new();
        cpu.enter(&mut l).expect("new state");
        let status = cpu.status;
        assert_eq!(status, 0x60 << 8 | 0x50, "RVI 0x50, SVI 0x60");
        // The guest ends 0x60 and takes 0x50; in its handler it sends itself 0x60 and 0x50
        // again, and takes 0x60.
        assert_eq!(cpu.eoi(), (0x60, false));
        assert_eq!(cpu.deliver(), Some(0x50));
        assert!(cpu.self_ipi(0x60));
        assert!(cpu.self_ipi(0x50));
        assert_eq!(cpu.deliver(), Some(0x60));
        assert_eq!(cpu.status, status, "RVI 0x50, SVI 0x60 again");
        assert!(cpu.exit(&mut l));
        assert_eq!(
            l.read(reg::ISR + 0x20, 0),
            1 << 16,
            "0x50 in service under 0x60"
        );
        assert_eq!(l.read(reg::ISR + 0x30, 0), 1, "0x60 in service");
        assert_eq!(l.read(reg::IRR + 0x20, 0), 1 << 16, "the second 0x50 waits");
        // Handed over again, the second 0x50 waits for the first's EOI.
        cpu.enter(&mut l);
        assert_eq!(cpu.eoi(), (0x60, false));
        assert_eq!(cpu.deliver(), None, "0x50 is in service");
        assert_eq!(cpu.eoi(), (0x50, false));
        assert_eq!(cpu.deliver(), Some(0x50));
    }

    /// A self-IPI the CPU virtualizes leaves the guest's command in the page's ICR (SDM Vol.
    /// 3C §29.4.3.1: the write is done there), where the guest reads it: the model takes it
    /// back, and the page keeps it when its registers are written again.
    #[test]
    fn a_virtualized_self_ipi_leaves_its_command_in_icr() {
        let mut l = enabled(0);
        let mut cpu = CpuVapic::new();
        cpu.enter(&mut l);
        assert!(cpu.self_ipi(0x42));
        cpu.exit(&mut l);
        assert_eq!(l.read(reg::ICR_LOW, 0), 1 << 18 | 0x42);
        // An APIC-write exit for another register: the page's registers are written again.
        l.write(reg::LVT_TIMER, 0xec, 0);
        cpu.enter(&mut l);
        assert_eq!(cpu.word(reg::ICR_LOW), 1 << 18 | 0x42);
    }

    #[test]
    fn init_drops_what_the_cpu_held() {
        let mut l = enabled(1);
        l.accept(0x31, false);
        let (given, _) = l.hand_over().expect("new state");
        let before = l.generation();
        l.init();
        assert!(!l.handed_over() && l.generation() > before);
        assert!(!l.take_back(given.status ^ 1, 0x40, |o| panic!("page read at {o:#x}")));
        assert_eq!((l.pending(), l.read(reg::TPR, 0)), (None, 0));
    }

    #[test]
    fn the_page_shows_every_register_a_virtualized_read_may_ask_for() {
        let mut l = enabled(2);
        l.write(reg::LDR, 0x0400_0000, 0);
        l.write(reg::LVT_TIMER, 0x2_00ef, 0);
        l.write(reg::ICR_HIGH, 0x0100_0000, 0);
        let mut shown = Vec::new();
        l.page_registers(|o, v| shown.push((o, v)));
        assert_eq!(shown.len(), PAGE_REGISTERS.len());
        for (o, v) in shown {
            assert_eq!(v, l.read(o, 0), "{o:#x}");
            assert!(
                o != reg::PPR && o != reg::TIMER_CURRENT,
                "{o:#x} exits instead"
            );
        }
        // Every write changes the generation; reads and deliveries that leave the page as it
        // was do not.
        let g = l.generation();
        let _ = l.read(reg::SVR, 0);
        l.accept(0x33, false);
        assert_eq!(l.generation(), g);
        l.write(reg::TPR, 0x10, 0);
        assert!(l.generation() > g);
    }

    /// The registers are 32 bits at 16-byte boundaries: an offset within one's 16 bytes is
    /// no register (it reads 0, a write there changes nothing), within the ranges of IRR, ISR,
    /// TMR and the LVT too.
    #[test]
    fn only_16_byte_boundaries_are_registers() {
        let mut l = enabled(0);
        l.accept(0x21, true);
        l.write(reg::LVT_TIMER, 0xec, 0);
        for o in [
            reg::IRR + 0x10,
            reg::TMR + 0x10,
            reg::LVT_TIMER,
            reg::VERSION,
        ] {
            assert_ne!(l.read(o, 0), 0, "{o:#x}");
            for d in 1..16 {
                assert_eq!(l.read(o + d, 0), 0, "{:#x}", o + d);
            }
        }
        let before = l.clone();
        for d in 1..16 {
            l.write(reg::LVT_TIMER + d, 0x1_00fe, 0);
            l.write(reg::SVR + d, 0, 0);
            l.write(reg::EOI + d, 0, 0);
        }
        assert_eq!(l.read(reg::LVT_TIMER, 0), 0xec);
        assert!(l.software_enabled());
        assert_eq!(l.generation(), before.generation(), "nothing written");
    }

    /// Linux's moves, decoded, reach the registers as the exit handlers pass them on.
    #[test]
    fn decoded_moves_reach_the_registers() {
        use crate::mmio_decode::decode;
        let mut l = enabled(0);
        let none = |_| panic!("no register is stored");
        // mov 0xffffffffff5fc0f0,%eax: SVR into EAX.
        let a = decode(&[0x8b, 0x04, 0x25, 0xf0, 0xc0, 0x5f, 0xff], true).unwrap();
        assert_eq!(
            l.mmio(reg::SVR, a.op, none, 0),
            Mmio::Load {
                reg: 0,
                value: SVR_ENABLE | 0xff
            }
        );
        // movl $0x10000,0xffffffffff5fc380: the timer's initial count.
        let a = decode(
            &[0xc7, 0x04, 0x25, 0x80, 0xc3, 0x5f, 0xff, 0, 0, 1, 0],
            true,
        )
        .unwrap();
        assert_eq!(
            l.mmio(reg::TIMER_INITIAL, a.op, none, 5),
            Mmio::Store(Effect::Timer)
        );
        assert_eq!(l.read(reg::TIMER_INITIAL, 0), 0x10000);
        // mov %r8d,(%rax) at ICR's low half: a self-IPI, R8's low 32 bits.
        let a = decode(&[0x44, 0x89, 0x00], true).unwrap();
        let r8 = |r| {
            assert_eq!(r, 8);
            0xdead_0000_0004_00f3
        };
        let Mmio::Store(Effect::Ipi(ipi)) = l.mmio(reg::ICR_LOW, a.op, r8, 0) else {
            panic!("no IPI")
        };
        assert_eq!((ipi.vector, ipi.destination), (0xf3, Destination::ToSelf));
        // mov 0x10(%rbx),%ecx between two registers.
        let a = decode(&[0x8b, 0x4b, 0x10], true).unwrap();
        assert_eq!(
            l.mmio(reg::SVR + 4, a.op, none, 0),
            Mmio::Load { reg: 1, value: 0 }
        );
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

    /// SVR keeps what this APIC has: no EOI-broadcast suppression (version bit 24 clear), so
    /// SVR bit 12 stays 0, as the other reserved bits.
    #[test]
    fn svr_has_no_eoi_broadcast_suppression() {
        let mut l = Lapic::new(0);
        assert_eq!(VERSION & 1 << 24, 0);
        l.write(reg::SVR, 0xffff_ffff, 0);
        assert_eq!(l.read(reg::SVR, 0), 0x3ff);
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

    /// A write to the timer's registers (or the deadline's MSR) after an expiry the timer
    /// has not been run to yet finds the interrupt raised, as it was on time: the write does
    /// not lose it.
    #[test]
    fn a_timer_write_after_an_expiry_keeps_its_interrupt() {
        let one_shot = |l: &mut Lapic| {
            l.write(reg::TIMER_DIVIDE, 0xb, 0); // divide by 1
            l.write(reg::LVT_TIMER, 0xec, 0);
            l.write(reg::TIMER_INITIAL, 1000, 0);
        };
        let rearm: [(u32, u32); 4] = [
            (reg::TIMER_INITIAL, 1000),
            (reg::TIMER_DIVIDE, 0),
            (reg::LVT_TIMER, MASKED | 0xec),
            (reg::SVR, 0xff),
        ];
        for (o, v) in rearm {
            let mut l = enabled(0);
            one_shot(&mut l);
            // Due at 1000; the guest writes at 1500, before the timer is run.
            l.write(o, v, 1500);
            assert_eq!(l.pending(), Some(0xec), "a write at {o:#x}");
        }
        // Masked at expiry: no interrupt, unmasked after.
        let mut l = enabled(0);
        l.write(reg::TIMER_DIVIDE, 0xb, 0);
        l.write(reg::LVT_TIMER, MASKED | 0xec, 0);
        l.write(reg::TIMER_INITIAL, 1000, 0);
        l.write(reg::LVT_TIMER, 0xec, 1500);
        assert_eq!(l.pending(), None);
        // The deadline's MSR: a deadline that passed fires before the next one is set.
        let mut l = enabled(0);
        l.write(reg::LVT_TIMER, (2 << TIMER_MODE_SHIFT) | 0xef, 0);
        l.write_deadline(1000, 0);
        assert_eq!(l.write_deadline(5000, 1100), Effect::Timer);
        assert_eq!(l.pending(), Some(0xef));
        assert_eq!(l.next_event(), Some(5000));
    }

    #[test]
    fn tsc_deadline_mode() {
        let mut l = enabled(0);
        // Not in deadline mode: the MSR is ignored.
        assert_eq!(l.write_deadline(500, 0), Effect::None);
        l.write(reg::LVT_TIMER, (2 << TIMER_MODE_SHIFT) | 0xef, 0);
        assert_eq!(l.timer_mode(), TimerMode::TscDeadline);
        // The initial count is ignored in this mode.
        assert_eq!(l.write(reg::TIMER_INITIAL, 10, 0), Effect::None);
        assert_eq!(l.write_deadline(5000, 0), Effect::Timer);
        assert_eq!(l.deadline(), 5000);
        assert!(!l.run_timer(4999));
        assert!(l.run_timer(5000));
        assert_eq!(l.deadline(), 0);
        assert_eq!(l.pending(), Some(0xef));
        // A deadline at the end of time never comes.
        l.write_deadline(u64::MAX, 5000);
        assert!(!l.run_timer(100));
        // A mode change disarms.
        l.write_deadline(9000, 5000);
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

    /// Two NMIs that arrive while none is in service are both delivered; any number that arrive
    /// while one is in service are one; a software-disabled APIC takes them; INIT drops them.
    #[test]
    fn nmis_wait_two_at_most_and_one_behind_one_in_service() {
        let mut l = Lapic::new(1);
        assert!(!l.software_enabled() && !l.nmi_pending());
        for _ in 0..3 {
            l.accept_nmi();
        }
        assert!(l.take_nmi() && l.take_nmi());
        assert!(!l.take_nmi() && !l.nmi_pending());
        // kvm-unit-tests' pending_nmi: the handler sends ten to itself; one more follows.
        for _ in 0..10 {
            l.accept_nmi();
        }
        l.nmi_in_service();
        assert!(l.take_nmi() && !l.nmi_pending());
        l.nmi_in_service();
        assert!(!l.nmi_pending());
        l.accept_nmi();
        l.init();
        assert!(!l.nmi_pending());
    }

    /// kvm-unit-tests' apic.flat, `test_apic_change_mode`: between one-shot and periodic the
    /// count goes on; a one-shot count that reached 0 keeps TMICT and stays at 0 in periodic
    /// mode; TSC-deadline mode, entered or left, disarms the timer.
    #[test]
    fn timer_mode_changes_keep_the_count() {
        const PERIODIC: u32 = 1 << TIMER_MODE_SHIFT;
        const DEADLINE: u32 = 2 << TIMER_MODE_SHIFT;
        let mut l = enabled(0);
        l.write(reg::TIMER_DIVIDE, 0xb, 0); // by 1
        l.write(reg::LVT_TIMER, 0xec, 0);
        l.write(reg::TIMER_INITIAL, 1000, 0);
        assert_eq!(l.write(reg::LVT_TIMER, PERIODIC | 0xec, 100), Effect::Timer);
        assert_eq!(l.read(reg::TIMER_INITIAL, 100), 1000);
        assert_eq!(l.read(reg::TIMER_CURRENT, 100), 900);
        // Periodic: from 0 back to TMICT, with an interrupt.
        assert!(l.run_timer(1000));
        assert_eq!(l.pending(), Some(0xec));
        l.acknowledge(0xec);
        l.write(reg::EOI, 0, 1000);
        assert_eq!(l.read(reg::TIMER_CURRENT, 1400), 600);
        // Back to one-shot at 600: the count goes on to 0, then stops there.
        l.write(reg::LVT_TIMER, 0xec, 1400);
        assert_eq!(l.read(reg::TIMER_CURRENT, 1400), 600);
        assert_eq!(l.next_event(), Some(2000));
        assert!(l.run_timer(2000));
        assert_eq!(l.read(reg::TIMER_CURRENT, 2500), 0);
        assert_eq!(l.read(reg::TIMER_INITIAL, 2500), 1000);
        assert_eq!(l.next_event(), None);
        // A stopped count stays stopped in periodic mode.
        l.write(reg::LVT_TIMER, PERIODIC | 0xec, 2500);
        assert_eq!(l.read(reg::TIMER_CURRENT, 2600), 0);
        assert_eq!(l.next_event(), None);
        // TSC-deadline mode disarms, and so does leaving it.
        l.write(reg::TIMER_INITIAL, 1000, 3000);
        l.write(reg::LVT_TIMER, DEADLINE | 0xec, 3100);
        assert_eq!(l.read(reg::TIMER_INITIAL, 3100), 0);
        l.write_deadline(5000, 3100);
        l.write(reg::LVT_TIMER, 0xec, 3200);
        assert_eq!((l.deadline(), l.next_event()), (0, None));
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

    /// kvm-unit-tests' reset_apic: clear the global enable, set it again; the APIC is as after
    /// reset (software-disabled, LVTs masked), its ID kept. x2APIC mode or a reserved bit is
    /// refused; the BSP flag follows the processor.
    #[test]
    fn the_global_enable_turns_the_apic_off_and_on_again() {
        let mut l = Lapic::new(3);
        l.write(reg::SVR, 0x1ff, 0);
        assert!(l.software_enabled());
        assert_eq!(l.apic_base(true), 0xfee0_0900);
        assert_eq!(l.apic_base(false), 0xfee0_0800);
        assert!(l.write_apic_base(0xfee0_0100, 36));
        assert!(!l.globally_enabled() && !l.answers_at(0xfee0_0030));
        assert_eq!(l.apic_base(true), 0xfee0_0100);
        assert!(l.write_apic_base(0xfee0_0900, 36));
        assert!(l.globally_enabled() && !l.software_enabled());
        assert_eq!(l.id(), 3);
        // INIT keeps the global enable as it is.
        assert!(l.write_apic_base(0xfee0_0000, 36));
        l.init();
        assert!(!l.globally_enabled());
        for bad in [0xfee0_0d00, 0xfee0_0901, 0xfee0_0a00, 0x10_fee0_0900] {
            assert!(!l.write_apic_base(bad, 36), "{bad:#x}");
        }
        assert!(l.write_apic_base(0x10_fee0_0800, 40));
    }

    /// kvm-unit-tests' apic.flat, `test_aliased_xapic_physical_ipi`: two APICs given the same
    /// xAPIC ID both take an IPI to it; the shorthands still know the sender; INIT keeps the ID,
    /// a global disable gives the processor's back.
    #[test]
    fn the_xapic_id_is_writable_and_may_alias() {
        let mut a = enabled(0);
        let mut b = enabled(1);
        b.write(reg::ID, 0, 0);
        assert_eq!(b.read(reg::ID, 0), 0);
        let Effect::Ipi(ipi) = a.write(reg::ICR_LOW, 0x40, 0) else {
            panic!("no IPI")
        };
        assert_eq!(ipi.destination, Destination::Physical(0));
        assert!(a.is_target(&ipi) && b.is_target(&ipi));
        let Effect::Ipi(others) = b.write(reg::ICR_LOW, (3 << 18) | 0x40, 0) else {
            panic!("no IPI")
        };
        assert!(a.is_target(&others) && !b.is_target(&others));
        b.write(reg::ID, 7 << 24, 0);
        b.init();
        assert_eq!(b.id(), 7);
        assert!(b.write_apic_base(0xfee0_0000, 36) && b.write_apic_base(0xfee0_0800, 36));
        assert_eq!(b.id(), 1);
    }

    /// kvm-unit-tests' apic.flat, `test_apicbase`: the registers move with the base, which INIT
    /// keeps; bits at and above MAXPHYADDR are reserved.
    #[test]
    fn the_base_moves_the_registers() {
        let mut l = Lapic::new(0);
        assert!(l.answers_at(0xfee0_0030) && !l.answers_at(0xfed4_0030));
        assert!(l.write_apic_base(0xfed4_0900, 39));
        assert!(l.answers_at(0xfed4_0030) && !l.answers_at(0xfee0_0030));
        assert_eq!(l.apic_base(true), 0xfed4_0900);
        assert_eq!(l.apic_base(false), 0xfed4_0800);
        l.init();
        assert!(l.answers_at(0xfed4_0ff0));
        assert!(!l.write_apic_base(0xfed4_0900 | 1 << 39, 39));
        assert!(l.write_apic_base(0xfee0_0900, 39));
        assert!(l.answers_at(0xfee0_0000));
    }
}
