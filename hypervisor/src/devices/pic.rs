//! The PC's pair of 8259A programmable interrupt controllers: the master at ports 0x20/0x21 (IRQs
//! 0-7), the slave at 0xa0/0xa1 (IRQs 8-15) with its INT output wired to the master's IR2. Pure
//! logic: the caller raises lines with [`PicPair::set_irq`], asks [`PicPair::pending`] whether the
//! CPU's INTR line is up, and runs the INTA cycle with [`PicPair::acknowledge`] when it injects.
//!
//! Datasheet: Intel 8259A Programmable Interrupt Controller (order number 231468):
//! "Interrupt Sequence" (INTA cycles, spurious IR7), "Programming the 8259A" (ICW1-ICW4, Figure 6
//! initialization flowchart), "Operation Command Words" (OCW1-OCW3, Figure 8), "Fully Nested
//! Mode", "End of Interrupt", "Automatic Rotation", "Specific Rotation", "Special Mask Mode",
//! "Poll Command", "Reading the 8259A Status", "Edge and Level Triggered Modes", "The Special Fully
//! Nested Mode", "Cascade Mode".
//!
//! Model choices, all within what the datasheet allows a PC to do:
//! - Only 8086 mode matters on x86: the vector is ICW2's T7-T3 with the IR level in bits 2-0, whether
//!   or not ICW4's µPM bit is set.
//! - Edge-triggered inputs latch IRR on a rising edge and keep the request until the INTA cycle,
//!   even when the line falls first (the hypervisor pulses IRQ 0); the datasheet's "the IR input
//!   must remain high until after the falling edge of the first INTA" is not enforced.
//!   With ICW1's LTIM bit, IRR follows the line level instead.
//! - The master's IR2 input follows the slave's INT output (a level), so the master's view of the
//!   cascade never goes stale. IRQ 2 itself is the cascade: `set_irq(2, ..)` is ignored.
//! - The INTA cycle is atomic with the decision, so a request cannot vanish between INT and INTA:
//!   [`PicPair::acknowledge`] returns `None` exactly when [`PicPair::pending`] does (INT low, no
//!   INTA cycle). The datasheet's default vectors remain for a master that selects the cascade
//!   while the slave has nothing to give: the slave's IR7 (IRQ 15) vector, with the master's IR2
//!   in service and nothing in service on the slave, which Linux recognises as spurious.
//! - Ports 0x4d0/0x4d1 (the PC chipsets' edge/level control registers) are plain latches.
//! - Before ICW1, the pair behaves as a BIOS leaves it (vectors 0x08 and 0x70, cascade on IR2,
//!   8086 mode) with every IRQ masked.

/// The master's command port (ICW1, OCW2, OCW3; reads IRR/ISR or the poll word).
pub const MASTER_CMD: u16 = 0x20;
/// The master's data port (ICW2-ICW4, OCW1 = IMR).
pub const MASTER_DATA: u16 = 0x21;
/// The slave's command port.
pub const SLAVE_CMD: u16 = 0xa0;
/// The slave's data port.
pub const SLAVE_DATA: u16 = 0xa1;
/// Edge/level control registers of PC chipsets (IRQs 0-7 and 8-15): plain latches here.
pub const ELCR_MASTER: u16 = 0x4d0;
pub const ELCR_SLAVE: u16 = 0x4d1;

/// The master's IR input the slave's INT drives.
const CASCADE_IR: u8 = 2;

/// Where the initialization sequence stands (datasheet Figure 6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Init {
    Done,
    Icw2,
    Icw3,
    Icw4,
}

/// One 8259A.
#[derive(Clone, Debug)]
struct Pic {
    /// Interrupt request register (latched requests; for the master's IR2 see `PicPair`).
    irr: u8,
    /// In-service register.
    isr: u8,
    /// Interrupt mask register (OCW1).
    imr: u8,
    /// The IR input levels as last set (edge detection).
    lines: u8,
    /// ICW2's T7-T3: the vector of IR0.
    base: u8,
    /// ICW3: the master's slave bits or the slave's ID.
    icw3: u8,
    /// The IR with the highest priority (0 after ICW1; rotation moves it).
    highest: u8,
    /// ICW1 LTIM: level-triggered inputs.
    level_triggered: bool,
    /// ICW1 SNGL: no cascade.
    single: bool,
    /// ICW1 IC4: ICW4 follows.
    icw4_needed: bool,
    /// ICW4 AEOI.
    auto_eoi: bool,
    /// OCW2 "rotate in automatic EOI mode".
    rotate_on_aeoi: bool,
    /// ICW4 SFNM.
    special_fully_nested: bool,
    /// OCW3 SMM.
    special_mask: bool,
    /// OCW3 RIS: the command port reads ISR (else IRR).
    read_isr: bool,
    /// OCW3 P: the next command-port read is a poll.
    poll: bool,
    init: Init,
    /// The ELCR latch at 0x4d0/0x4d1.
    elcr: u8,
}

impl Pic {
    fn new(base: u8, icw3: u8) -> Self {
        Pic {
            irr: 0,
            isr: 0,
            imr: 0xff,
            lines: 0,
            base,
            icw3,
            highest: 0,
            level_triggered: false,
            single: false,
            icw4_needed: false,
            auto_eoi: false,
            rotate_on_aeoi: false,
            special_fully_nested: false,
            special_mask: false,
            read_isr: false,
            poll: false,
            init: Init::Done,
            elcr: 0,
        }
    }

    /// The priority (0 = highest) of the highest-priority IR set in `mask`, 8 when none.
    fn priority(&self, mask: u8) -> u8 {
        (0..8)
            .find(|p| mask & (1 << ((p + self.highest) & 7)) != 0)
            .unwrap_or(8)
    }

    /// The IR this chip would interrupt for, given its requests `irr` (the master's with the
    /// cascade folded in): the highest-priority unmasked request above everything in service
    /// ("Fully Nested Mode"), with the special mask mode's and the special fully nested mode's
    /// exceptions.
    fn best(&self, irr: u8, is_master: bool) -> Option<u8> {
        let request = self.priority(irr & !self.imr);
        if request == 8 {
            return None;
        }
        let mut in_service = self.isr;
        if self.special_mask {
            // "Special Mask Mode": a masked level in service does not inhibit the others.
            in_service &= !self.imr;
        }
        if self.special_fully_nested && is_master && !self.single {
            // "The Special Fully Nested Mode": the slave's own priority logic decides, so the
            // cascade input in service does not block further slave requests.
            in_service &= !(1 << CASCADE_IR);
        }
        (request < self.priority(in_service)).then_some((request + self.highest) & 7)
    }

    /// The INTA cycle for `ir` on this chip: IRR → ISR, or automatic EOI.
    fn ack(&mut self, ir: u8) {
        let bit = 1 << ir;
        if !self.level_triggered {
            self.irr &= !bit;
        }
        if self.auto_eoi {
            if self.rotate_on_aeoi {
                self.highest = (ir + 1) & 7;
            }
        } else {
            self.isr |= bit;
        }
    }

    fn set_line(&mut self, ir: u8, level: bool) {
        let bit = 1 << ir;
        if self.level_triggered {
            if level {
                self.irr |= bit;
            } else {
                self.irr &= !bit;
            }
        } else if level && self.lines & bit == 0 {
            self.irr |= bit;
        }
        if level {
            self.lines |= bit;
        } else {
            self.lines &= !bit;
        }
    }

    /// A write to the command port (A0 = 0): ICW1, OCW2 or OCW3.
    fn write_cmd(&mut self, value: u8) {
        if value & 0x10 != 0 {
            self.icw1(value);
        } else if value & 0x08 != 0 {
            self.ocw3(value);
        } else {
            self.ocw2(value);
        }
    }

    /// ICW1: the start of initialization. "Initialization Command Words": the edge sense
    /// circuit is reset (a line must go low and high again), the IMR is cleared, IR7 gets the
    /// lowest priority, the special mask mode is cleared, status read is set to IRR, and without
    /// IC4 every ICW4 function is zero. ISR and the edge-latched requests are cleared too, as PC
    /// emulators do, so no stale request survives a re-initialization.
    fn icw1(&mut self, value: u8) {
        self.icw4_needed = value & 0x01 != 0;
        self.single = value & 0x02 != 0;
        self.level_triggered = value & 0x08 != 0;
        self.imr = 0;
        self.isr = 0;
        self.irr = if self.level_triggered { self.lines } else { 0 };
        self.highest = 0;
        self.special_mask = false;
        self.read_isr = false;
        self.poll = false;
        self.auto_eoi = false;
        self.rotate_on_aeoi = false;
        self.special_fully_nested = false;
        self.init = Init::Icw2;
    }

    /// A write to the data port (A0 = 1): the next ICW during initialization, else OCW1.
    fn write_data(&mut self, value: u8) {
        match self.init {
            Init::Done => self.imr = value,
            Init::Icw2 => {
                self.base = value & 0xf8;
                self.init = if !self.single {
                    Init::Icw3
                } else if self.icw4_needed {
                    Init::Icw4
                } else {
                    Init::Done
                };
            }
            Init::Icw3 => {
                self.icw3 = value;
                self.init = if self.icw4_needed {
                    Init::Icw4
                } else {
                    Init::Done
                };
            }
            Init::Icw4 => {
                // µPM (bit 0) and BUF/M-S (bits 2-3) change nothing a PC can observe.
                self.auto_eoi = value & 0x02 != 0;
                self.special_fully_nested = value & 0x10 != 0;
                self.init = Init::Done;
            }
        }
    }

    /// OCW2: R, SL, EOI in bits 7-5, the level in bits 2-0 (datasheet Figure 8).
    fn ocw2(&mut self, value: u8) {
        let level = value & 7;
        match value >> 5 {
            // Non-specific EOI, and rotate on non-specific EOI: the highest-priority level in
            // service is the one being serviced.
            0b001 | 0b101 => {
                let p = self.priority(self.isr);
                if p < 8 {
                    let ir = (p + self.highest) & 7;
                    self.isr &= !(1 << ir);
                    if value & 0x80 != 0 {
                        self.highest = (ir + 1) & 7;
                    }
                }
            }
            // Specific EOI.
            0b011 => self.isr &= !(1 << level),
            // Rotate on specific EOI.
            0b111 => {
                self.isr &= !(1 << level);
                self.highest = (level + 1) & 7;
            }
            // Set priority: `level` becomes the lowest.
            0b110 => self.highest = (level + 1) & 7,
            // Rotate in automatic EOI mode (set / clear).
            0b100 => self.rotate_on_aeoi = true,
            0b000 => self.rotate_on_aeoi = false,
            // 0b010: no operation.
            _ => {}
        }
    }

    /// OCW3: ESMM/SMM in bits 6-5, P in bit 2, RR/RIS in bits 1-0.
    fn ocw3(&mut self, value: u8) {
        if value & 0x40 != 0 {
            self.special_mask = value & 0x20 != 0;
        }
        if value & 0x02 != 0 {
            self.read_isr = value & 0x01 != 0;
        }
        self.poll = value & 0x04 != 0;
    }

    /// A read of the command port: the poll word, or IRR / ISR as OCW3 selected. `irr` is the
    /// IRR as seen (the master's with the cascade folded in).
    fn read_cmd(&self, irr: u8) -> u8 {
        if self.read_isr { self.isr } else { irr }
    }
}

/// The two 8259As of a PC, cascaded on the master's IR2.
#[derive(Clone, Debug)]
pub struct PicPair {
    master: Pic,
    slave: Pic,
}

impl Default for PicPair {
    fn default() -> Self {
        PicPair {
            master: Pic::new(0x08, 1 << CASCADE_IR),
            slave: Pic::new(0x70, CASCADE_IR),
        }
    }
}

impl PicPair {
    /// Whether the master takes its IR2 vector from the slave (ICW1 without SNGL, ICW3's S2).
    fn cascaded(&self) -> bool {
        !self.master.single && self.master.icw3 & (1 << CASCADE_IR) != 0
    }

    /// The master's IRR with the slave's INT output on IR2 ("Cascade Mode").
    fn master_irr(&self) -> u8 {
        let slave_int = self.slave.best(self.slave.irr, false).is_some();
        if !self.master.single && slave_int {
            self.master.irr | 1 << CASCADE_IR
        } else {
            self.master.irr & !(1 << CASCADE_IR)
        }
    }

    /// A guest write (OUT) to one of the PICs' ports; others are ignored.
    pub fn write(&mut self, port: u16, value: u8) {
        match port {
            MASTER_CMD => self.master.write_cmd(value),
            MASTER_DATA => self.master.write_data(value),
            SLAVE_CMD => self.slave.write_cmd(value),
            SLAVE_DATA => self.slave.write_data(value),
            // Bits 0-2 (timer, keyboard, cascade) and 8 and 13 are always edge on PC chipsets.
            ELCR_MASTER => self.master.elcr = value & 0xf8,
            ELCR_SLAVE => self.slave.elcr = value & 0xde,
            _ => {}
        }
    }

    /// A guest read (IN) of one of the PICs' ports (others read 0xff). A read of a command port
    /// after an OCW3 poll command is the poll: it acknowledges the request like an INTA cycle
    /// and returns 0x80 | level, or 0 when nothing is requested ("Poll Command").
    pub fn read(&mut self, port: u16) -> u8 {
        match port {
            MASTER_CMD => {
                let irr = self.master_irr();
                if core::mem::take(&mut self.master.poll) {
                    match self.master.best(irr, true) {
                        Some(ir) => {
                            self.master.ack(ir);
                            0x80 | ir
                        }
                        None => 0,
                    }
                } else {
                    self.master.read_cmd(irr)
                }
            }
            SLAVE_CMD => {
                let irr = self.slave.irr;
                if core::mem::take(&mut self.slave.poll) {
                    match self.slave.best(irr, false) {
                        Some(ir) => {
                            self.slave.ack(ir);
                            0x80 | ir
                        }
                        None => 0,
                    }
                } else {
                    self.slave.read_cmd(irr)
                }
            }
            MASTER_DATA => self.master.imr,
            SLAVE_DATA => self.slave.imr,
            ELCR_MASTER => self.master.elcr,
            ELCR_SLAVE => self.slave.elcr,
            _ => 0xff,
        }
    }

    /// Drives IRQ line `irq` (0-15) to `level`. Edge-triggered (the PC default): a rising edge
    /// sets the IRR bit, which stays set until acknowledged. IRQ 2 (the cascade) and numbers above
    /// 15 are ignored.
    pub fn set_irq(&mut self, irq: u8, level: bool) {
        match irq {
            CASCADE_IR => {}
            0..=7 => self.master.set_line(irq, level),
            8..=15 => self.slave.set_line(irq - 8, level),
            _ => {}
        }
    }

    /// The vector the pair would deliver now if the CPU ran an INTA cycle (the master's INT
    /// output is high), without acknowledging anything.
    pub fn pending(&self) -> Option<u8> {
        let ir = self.master.best(self.master_irr(), true)?;
        Some(if ir == CASCADE_IR && self.cascaded() {
            match self.slave.best(self.slave.irr, false) {
                Some(sir) => self.slave.base | sir,
                None => self.slave.base | 7,
            }
        } else {
            self.master.base | ir
        })
    }

    /// The INTA cycle ("Interrupt Sequence"): the chosen IRR bit moves to ISR (or not, under
    /// automatic EOI) on the master and, for the cascade, on the slave; returns the vector. `None`
    /// when no interrupt is requested. When the master selects the cascade and the slave has no
    /// request, the slave answers with its IR7 vector and sets nothing in service (the spurious
    /// IRQ 15), while the master's IR2 goes in service as on real hardware.
    pub fn acknowledge(&mut self) -> Option<u8> {
        let ir = self.master.best(self.master_irr(), true)?;
        if ir == CASCADE_IR && self.cascaded() {
            let vector = match self.slave.best(self.slave.irr, false) {
                Some(sir) => {
                    self.slave.ack(sir);
                    self.slave.base | sir
                }
                None => self.slave.base | 7,
            };
            self.master.ack(ir);
            Some(vector)
        } else {
            self.master.ack(ir);
            Some(self.master.base | ir)
        }
    }

    /// The IMRs (master in bits 0-7, slave in 8-15): for diagnostics.
    pub fn masks(&self) -> u16 {
        u16::from(self.master.imr) | u16::from(self.slave.imr) << 8
    }

    /// The ISRs (master in bits 0-7, slave in 8-15): for diagnostics.
    pub fn in_service(&self) -> u16 {
        u16::from(self.master.isr) | u16::from(self.slave.isr) << 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The PICs as Linux's init_8259A programs them: vectors 0x30 and 0x38, cascade on IR2,
    /// 8086 mode, optionally automatic EOI; every IRQ unmasked.
    fn linux(auto_eoi: bool) -> PicPair {
        let mut p = PicPair::default();
        let icw4 = if auto_eoi { 0x03 } else { 0x01 };
        for (port, v) in [
            (0x21, 0xff),
            (0xa1, 0xff),
            (0x20, 0x11),
            (0x21, 0x30),
            (0x21, 0x04),
            (0x21, icw4),
            (0xa0, 0x11),
            (0xa1, 0x38),
            (0xa1, 0x02),
            (0xa1, 0x01),
            (0x21, 0x00),
            (0xa1, 0x00),
        ] {
            p.write(port, v);
        }
        p
    }

    fn pulse(p: &mut PicPair, irq: u8) {
        p.set_irq(irq, true);
        p.set_irq(irq, false);
    }

    #[test]
    fn nothing_before_initialization_is_delivered() {
        let mut p = PicPair::default();
        pulse(&mut p, 0);
        pulse(&mut p, 12);
        assert_eq!(p.pending(), None, "everything is masked at power-on");
        assert_eq!(p.acknowledge(), None);
        // Linux's probe_8259A: the IMR reads back what was written.
        p.write(SLAVE_DATA, 0xff);
        p.write(MASTER_DATA, 0xfb);
        assert_eq!(p.read(MASTER_DATA), 0xfb);
    }

    #[test]
    fn fully_nested_priorities_and_eoi() {
        let mut p = linux(false);
        pulse(&mut p, 4);
        pulse(&mut p, 1);
        // IR1 has priority over IR4.
        assert_eq!(p.pending(), Some(0x31));
        assert_eq!(p.acknowledge(), Some(0x31));
        assert_eq!(p.in_service(), 0x0002);
        // IR4 is lower than IR1 in service: blocked until the EOI.
        assert_eq!(p.pending(), None);
        // A higher-priority IR0 nests.
        pulse(&mut p, 0);
        assert_eq!(p.acknowledge(), Some(0x30));
        // Non-specific EOI ends the highest level in service: IR0.
        p.write(MASTER_CMD, 0x20);
        assert_eq!(p.in_service(), 0x0002);
        assert_eq!(p.pending(), None);
        // Specific EOI for IR1 (what Linux's mask_and_ack_8259A sends).
        p.write(MASTER_CMD, 0x61);
        assert_eq!(p.in_service(), 0);
        assert_eq!(p.acknowledge(), Some(0x34));
        assert_eq!(p.acknowledge(), None);
    }

    #[test]
    fn requests_are_edge_latched() {
        let mut p = linux(false);
        p.set_irq(4, true);
        assert_eq!(p.acknowledge(), Some(0x34));
        p.write(MASTER_CMD, 0x20);
        // The line is still high: no new edge, no new request.
        p.set_irq(4, true);
        assert_eq!(p.pending(), None);
        p.set_irq(4, false);
        p.set_irq(4, true);
        assert_eq!(p.pending(), Some(0x34));
    }

    #[test]
    fn masked_requests_wait_in_irr() {
        let mut p = linux(false);
        p.write(MASTER_DATA, 0x01);
        pulse(&mut p, 0);
        assert_eq!(p.pending(), None);
        // Default OCW3 read: IRR.
        assert_eq!(p.read(MASTER_CMD), 0x01);
        p.write(MASTER_DATA, 0x00);
        assert_eq!(p.acknowledge(), Some(0x30));
        assert_eq!(p.read(MASTER_CMD), 0x00);
        // OCW3 RR|RIS selects ISR; the selection sticks.
        p.write(MASTER_CMD, 0x0b);
        assert_eq!(p.read(MASTER_CMD), 0x01);
        assert_eq!(p.read(MASTER_CMD), 0x01);
        p.write(MASTER_CMD, 0x0a);
        assert_eq!(p.read(MASTER_CMD), 0x00);
    }

    #[test]
    fn slave_interrupts_go_through_the_cascade() {
        let mut p = linux(false);
        pulse(&mut p, 12);
        // The master sees the slave's INT on IR2.
        assert_eq!(p.read(MASTER_CMD), 0x04);
        assert_eq!(p.pending(), Some(0x3c));
        assert_eq!(p.acknowledge(), Some(0x3c));
        assert_eq!(p.in_service(), 1 << 12 | 1 << 2);
        // The slave's IR4 in service blocks IRQ 13, and master's IR2 blocks IRQ 3.
        pulse(&mut p, 13);
        pulse(&mut p, 3);
        assert_eq!(p.pending(), None);
        // Linux: specific EOI to the slave, then to the master's cascade.
        p.write(SLAVE_CMD, 0x64);
        p.write(MASTER_CMD, 0x62);
        assert_eq!(p.in_service(), 0);
        // IRQ 13 (via IR2) outranks IRQ 3.
        assert_eq!(p.acknowledge(), Some(0x3d));
        // IRQ 0 still nests above the cascade in service.
        pulse(&mut p, 0);
        assert_eq!(p.acknowledge(), Some(0x30));
    }

    #[test]
    fn masking_the_slave_request_withdraws_the_cascade() {
        let mut p = linux(false);
        pulse(&mut p, 9);
        p.write(SLAVE_DATA, 0x02);
        assert_eq!(p.pending(), None);
        assert_eq!(p.read(MASTER_CMD), 0x00);
        p.write(SLAVE_DATA, 0x00);
        assert_eq!(p.acknowledge(), Some(0x39));
    }

    #[test]
    fn a_slave_poll_withdraws_the_cascade_and_single_mode_has_none() {
        // An IRQ 9 request taken by a poll of the slave before any INTA cycle.
        let mut p = linux(false);
        pulse(&mut p, 9);
        // The master's IRR shows the cascade; the slave hands its request over in a poll.
        p.write(SLAVE_CMD, 0x0c);
        assert_eq!(p.read(SLAVE_CMD), 0x81);
        assert_eq!(p.pending(), None, "the slave's INT went low with the poll");
        // A latched IR2 on a master in single mode has no slave to ask: the master's own vector.
        let mut p = PicPair::default();
        p.write(MASTER_CMD, 0x13); // ICW1: SNGL, IC4
        p.write(MASTER_DATA, 0x20);
        p.write(MASTER_DATA, 0x01);
        pulse(&mut p, 5);
        assert_eq!(p.acknowledge(), Some(0x25));
    }

    #[test]
    fn auto_eoi_leaves_nothing_in_service() {
        let mut p = linux(true);
        pulse(&mut p, 1);
        pulse(&mut p, 4);
        assert_eq!(p.acknowledge(), Some(0x31));
        assert_eq!(p.in_service(), 0);
        assert_eq!(p.acknowledge(), Some(0x34));
        // Linux sets automatic EOI on the master only: the slave's level stays in service.
        pulse(&mut p, 10);
        assert_eq!(p.acknowledge(), Some(0x3a));
        assert_eq!(p.in_service(), 1 << 10);
    }

    #[test]
    fn icw1_resets_masks_and_requests() {
        let mut p = linux(false);
        p.write(MASTER_DATA, 0xff);
        pulse(&mut p, 3);
        p.write(MASTER_CMD, 0x11);
        // Mid-sequence, the data port takes ICWs, not the mask.
        p.write(MASTER_DATA, 0x40);
        p.write(MASTER_DATA, 0x04);
        p.write(MASTER_DATA, 0x01);
        assert_eq!(p.read(MASTER_DATA), 0x00, "ICW1 clears the IMR");
        assert_eq!(p.pending(), None, "ICW1 resets the edge latches");
        pulse(&mut p, 3);
        assert_eq!(p.acknowledge(), Some(0x43));
    }

    #[test]
    fn level_triggered_mode_follows_the_line() {
        let mut p = PicPair::default();
        for (port, v) in [(0x20, 0x19), (0x21, 0x50), (0x21, 0x04), (0x21, 0x01)] {
            p.write(port, v);
        }
        p.set_irq(3, true);
        assert_eq!(p.pending(), Some(0x53));
        p.set_irq(3, false);
        assert_eq!(p.pending(), None, "the request went away with the line");
        p.set_irq(3, true);
        assert_eq!(p.acknowledge(), Some(0x53));
        p.write(MASTER_CMD, 0x20);
        // Still high after the EOI: requested again.
        assert_eq!(p.pending(), Some(0x53));
    }

    #[test]
    fn rotation_and_set_priority() {
        let mut p = linux(false);
        // Set priority: IR4 lowest, so IR5 highest.
        p.write(MASTER_CMD, 0xc4);
        pulse(&mut p, 3);
        pulse(&mut p, 6);
        assert_eq!(p.acknowledge(), Some(0x36));
        // Rotate on non-specific EOI: IR6 ends and becomes the lowest; IR7 is now highest.
        p.write(MASTER_CMD, 0xa0);
        pulse(&mut p, 7);
        assert_eq!(p.acknowledge(), Some(0x37));
        // Rotate on specific EOI of 7: IR0 highest again.
        p.write(MASTER_CMD, 0xe7);
        assert_eq!(p.acknowledge(), Some(0x33));
    }

    #[test]
    fn special_mask_mode_lets_lower_levels_in() {
        let mut p = linux(false);
        pulse(&mut p, 1);
        assert_eq!(p.acknowledge(), Some(0x31));
        pulse(&mut p, 5);
        assert_eq!(p.pending(), None);
        // Mask IR1 (in service) and set the special mask mode.
        p.write(MASTER_DATA, 0x02);
        p.write(MASTER_CMD, 0x68);
        assert_eq!(p.pending(), Some(0x35));
        // Reset the special mask mode: IR1 in service blocks again.
        p.write(MASTER_CMD, 0x48);
        assert_eq!(p.pending(), None);
    }

    #[test]
    fn poll_command() {
        let mut p = linux(false);
        p.write(MASTER_CMD, 0x0c);
        assert_eq!(p.read(MASTER_CMD), 0x00, "nothing requested");
        pulse(&mut p, 6);
        p.write(MASTER_CMD, 0x0c);
        assert_eq!(p.read(MASTER_CMD), 0x86);
        assert_eq!(p.in_service(), 0x40, "the poll read acknowledged IR6");
        // The poll is one read only: the next read is IRR again.
        assert_eq!(p.read(MASTER_CMD), 0x00);
    }

    #[test]
    fn elcr_latches() {
        let mut p = PicPair::default();
        p.write(ELCR_MASTER, 0xff);
        p.write(ELCR_SLAVE, 0xff);
        assert_eq!((p.read(ELCR_MASTER), p.read(ELCR_SLAVE)), (0xf8, 0xde));
        assert_eq!(p.read(0x22), 0xff);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Write(u16, u8),
        Read(u16),
        Irq(u8, bool),
        Ack,
    }

    fn op() -> impl Strategy<Value = Op> {
        let port = prop::sample::select(vec![0x20u16, 0x21, 0xa0, 0xa1, 0x4d0, 0x4d1, 0x22]);
        prop_oneof![
            (port.clone(), any::<u8>()).prop_map(|(p, v)| Op::Write(p, v)),
            port.prop_map(Op::Read),
            (0u8..20, any::<bool>()).prop_map(|(i, l)| Op::Irq(i, l)),
            Just(Op::Ack),
        ]
    }

    proptest! {
        /// No sequence of accesses panics, and `acknowledge` agrees with `pending`.
        #[test]
        fn any_sequence(ops in prop::collection::vec(op(), 0..200)) {
            let mut p = linux(false);
            for op in ops {
                match op {
                    Op::Write(port, v) => p.write(port, v),
                    Op::Read(port) => { p.read(port); }
                    Op::Irq(i, l) => p.set_irq(i, l),
                    Op::Ack => {
                        let want = p.pending();
                        prop_assert_eq!(p.acknowledge(), want);
                    }
                }
            }
        }
    }
}
