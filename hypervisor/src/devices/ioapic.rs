//! The I/O APIC a Linux guest with `apic=on` sees at GPA 0xfec00000 (Intel 82093AA I/O Advanced
//! Programmable Interrupt Controller datasheet, §3 "Register Description"): IOREGSEL at +0x00
//! selects the register IOWIN at +0x10 reads and writes; IOAPICID (0), IOAPICVER (1: version
//! 0x11, 24 redirection entries), IOAPICARB (2), and the redirection table IOREDTBL0-23 at
//! 0x10 + 2n (low half) and 0x11 + 2n (high half).
//!
//! A redirection entry: vector (bits 0-7), delivery mode (8-10, as the local APIC's ICR), logical
//! destination mode (11), delivery status (12, read-only), polarity active low (13), remote IRR
//! (14, read-only), level-triggered (15), mask (16), destination (56-63).
//!
//! Lines: an edge-triggered pin latches a rising edge while it is unmasked (a masked one loses
//! it, as the 82093AA does) and sends one message; a level-triggered pin sends a message while
//! it is asserted and its remote IRR is clear, and sets remote IRR until the local APIC's EOI of
//! that vector ([`IoApic::eoi`]) or until the guest makes the entry edge-triggered (Linux's way
//! to clear it on a version 0x11 I/O APIC, which has no EOI register).

use super::lapic::Delivery;

/// Redirection entries (pins).
pub const PINS: usize = 24;
/// IOAPICVER: maximum redirection entry (23) in bits 16-23, version 0x11.
const VERSION: u32 = ((PINS as u32 - 1) << 16) | 0x11;

const REG_ID: u32 = 0;
const REG_VERSION: u32 = 1;
const REG_ARBITRATION: u32 = 2;
const REG_TABLE: u32 = 0x10;

/// IOREGSEL and IOWIN's offsets in the page.
pub const IOREGSEL: u32 = 0x00;
pub const IOWIN: u32 = 0x10;

const DELIVERY_STATUS: u64 = 1 << 12;
const ACTIVE_LOW: u64 = 1 << 13;
const REMOTE_IRR: u64 = 1 << 14;
const LEVEL: u64 = 1 << 15;
const MASKED: u64 = 1 << 16;
const LOGICAL: u64 = 1 << 11;
/// The bits the guest writes (the rest are read-only: delivery status, remote IRR).
const WRITABLE: u64 = !(DELIVERY_STATUS | REMOTE_IRR);

/// An interrupt message from a pin to the local APICs it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Message {
    pub pin: u8,
    pub vector: u8,
    pub delivery: Delivery,
    /// Logical destination mode (else physical).
    pub logical: bool,
    pub destination: u8,
    pub level: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IoApic {
    id: u8,
    select: u8,
    table: [u64; PINS],
    /// Each pin's input line as the device drives it (before polarity).
    lines: u32,
    /// Edges latched on unmasked edge-triggered pins, not sent yet.
    edges: u32,
    /// The unmasked level-triggered pins that are asserted with remote IRR clear: each has a
    /// message to send. Kept with every change of an entry, a line or remote IRR, so that
    /// [`IoApic::next_message`] has nothing to scan while no pin has anything (every VM entry
    /// of a VM with interrupt controllers asks it).
    level_ready: u32,
}

impl IoApic {
    /// The I/O APIC after reset: every entry masked, `id` its APIC ID.
    #[must_use]
    pub fn new(id: u8) -> IoApic {
        IoApic {
            id,
            select: 0,
            table: [MASKED; PINS],
            lines: 0,
            edges: 0,
            level_ready: 0,
        }
    }

    /// Reads the 32-bit register at `offset` in the page (IOREGSEL or IOWIN; anything else
    /// reads 0).
    #[must_use]
    pub fn read(&self, offset: u32) -> u32 {
        match offset {
            IOREGSEL => u32::from(self.select),
            IOWIN => self.register(u32::from(self.select)),
            _ => 0,
        }
    }

    /// Writes `value` at `offset` in the page.
    pub fn write(&mut self, offset: u32, value: u32) {
        match offset {
            IOREGSEL => self.select = value as u8,
            IOWIN => self.set_register(u32::from(self.select), value),
            _ => {}
        }
    }

    fn register(&self, reg: u32) -> u32 {
        match reg {
            REG_ID => u32::from(self.id & 0xf) << 24,
            REG_VERSION => VERSION,
            REG_ARBITRATION => u32::from(self.id & 0xf) << 24,
            r if (REG_TABLE..REG_TABLE + 2 * PINS as u32).contains(&r) => {
                let entry = self.entry(((r - REG_TABLE) / 2) as usize);
                if r % 2 == 0 {
                    entry as u32
                } else {
                    (entry >> 32) as u32
                }
            }
            _ => 0,
        }
    }

    fn set_register(&mut self, reg: u32, value: u32) {
        match reg {
            REG_ID => self.id = ((value >> 24) & 0xf) as u8,
            r if (REG_TABLE..REG_TABLE + 2 * PINS as u32).contains(&r) => {
                let pin = ((r - REG_TABLE) / 2) as usize;
                let old = self.table[pin];
                let written = if r % 2 == 0 {
                    (old & !0xffff_ffff) | u64::from(value)
                } else {
                    (old & 0xffff_ffff) | (u64::from(value) << 32)
                };
                let mut new = (written & WRITABLE) | (old & REMOTE_IRR);
                // An edge-triggered entry has no remote IRR (82093AA: the bit is undefined for
                // edge-triggered interrupts; Linux clears it this way).
                if new & LEVEL == 0 {
                    new &= !REMOTE_IRR;
                }
                self.table[pin] = new;
                if new & MASKED != 0 {
                    self.edges &= !(1 << pin);
                }
                self.refresh(pin);
            }
            _ => {}
        }
    }

    /// Redirection entry `pin` as the guest reads it (delivery status: a level-triggered
    /// interrupt sent and not yet taken shows as remote IRR).
    #[must_use]
    pub fn entry(&self, pin: usize) -> u64 {
        self.table.get(pin).copied().unwrap_or(MASKED)
    }

    /// The device drives input `pin` to `level`.
    pub fn set_irq(&mut self, pin: u8, level: bool) {
        let pin = usize::from(pin);
        if pin >= PINS {
            return;
        }
        let bit = 1u32 << pin;
        let was = self.asserted(pin);
        if level {
            self.lines |= bit;
        } else {
            self.lines &= !bit;
        }
        let entry = self.table[pin];
        if entry & (LEVEL | MASKED) == 0 && !was && self.asserted(pin) {
            self.edges |= bit;
        }
        self.refresh(pin);
    }

    /// Recomputes `pin`'s bit of `level_ready`.
    fn refresh(&mut self, pin: usize) {
        let entry = self.table[pin];
        let ready = entry & (LEVEL | MASKED | REMOTE_IRR) == LEVEL && self.asserted(pin);
        let bit = 1u32 << pin;
        if ready {
            self.level_ready |= bit;
        } else {
            self.level_ready &= !bit;
        }
    }

    /// Whether input `pin` is asserted, its polarity applied.
    fn asserted(&self, pin: usize) -> bool {
        let line = self.lines & (1 << pin) != 0;
        line != (self.table[pin] & ACTIVE_LOW != 0)
    }

    /// The next message to send, if any pin has one: a latched edge, or an asserted
    /// level-triggered pin without remote IRR (which it then sets).
    pub fn next_message(&mut self) -> Option<Message> {
        // Only a pin with a latched edge or a ready level can send, lowest first.
        let mut candidates = self.edges | self.level_ready;
        while candidates != 0 {
            let pin = candidates.trailing_zeros() as usize;
            candidates &= candidates - 1;
            if let Some(m) = self.send(pin) {
                return Some(m);
            }
        }
        None
    }

    /// `pin`'s message, if it has one to send now (taking its latched edge, or setting its
    /// remote IRR).
    fn send(&mut self, pin: usize) -> Option<Message> {
        let entry = self.table[pin];
        if entry & MASKED != 0 {
            return None;
        }
        let send = if entry & LEVEL == 0 {
            let bit = 1 << pin;
            let latched = self.edges & bit != 0;
            self.edges &= !bit;
            latched
        } else if entry & REMOTE_IRR == 0 && self.asserted(pin) {
            self.table[pin] |= REMOTE_IRR;
            self.level_ready &= !(1 << pin);
            true
        } else {
            false
        };
        send.then(|| Message {
            pin: pin as u8,
            vector: entry as u8,
            delivery: Delivery::of(entry as u32),
            logical: entry & LOGICAL != 0,
            destination: (entry >> 56) as u8,
            level: entry & LEVEL != 0,
        })
    }

    /// A local APIC's EOI of level-triggered `vector`: the entries that sent it may send again.
    pub fn eoi(&mut self, vector: u8) {
        for pin in 0..PINS {
            let e = self.table[pin];
            if e & REMOTE_IRR != 0 && e as u8 == vector {
                self.table[pin] = e & !REMOTE_IRR;
                self.refresh(pin);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn program(io: &mut IoApic, pin: u32, low: u32, high: u32) {
        io.write(IOREGSEL, REG_TABLE + 2 * pin);
        io.write(IOWIN, low);
        io.write(IOREGSEL, REG_TABLE + 2 * pin + 1);
        io.write(IOWIN, high);
    }

    fn read(io: &IoApic, reg: u32) -> u32 {
        let mut io = io.clone();
        io.write(IOREGSEL, reg);
        io.read(IOWIN)
    }

    #[test]
    fn registers_read_back_as_the_datasheet_says() {
        let mut io = IoApic::new(2);
        assert_eq!(read(&io, REG_ID), 2 << 24);
        assert_eq!(read(&io, REG_VERSION), 0x0017_0011);
        // After reset every entry is masked.
        for pin in 0..PINS as u32 {
            assert_eq!(read(&io, REG_TABLE + 2 * pin), MASKED as u32);
        }
        io.write(IOREGSEL, REG_ID);
        io.write(IOWIN, 5 << 24);
        assert_eq!(read(&io, REG_ID), 5 << 24);
        program(&mut io, 4, 0x0000_0934, 0x0300_0000);
        assert_eq!(read(&io, REG_TABLE + 8), 0x934);
        assert_eq!(read(&io, REG_TABLE + 9), 0x0300_0000);
        assert_eq!(io.read(IOREGSEL), REG_TABLE + 9);
        // Unknown registers and offsets read 0.
        assert_eq!(read(&io, 0x50), 0);
        assert_eq!(io.read(0x20), 0);
    }

    #[test]
    fn an_edge_sends_one_message_and_a_masked_pin_loses_it() {
        let mut io = IoApic::new(2);
        io.set_irq(2, true);
        io.set_irq(2, false);
        assert_eq!(io.next_message(), None, "masked: lost");
        // Fixed, logical, destination 0x01, vector 0x30.
        program(&mut io, 2, 0x0000_0830, 0x0100_0000);
        io.set_irq(2, true);
        io.set_irq(2, true);
        io.set_irq(2, false);
        let m = io.next_message().unwrap();
        assert_eq!(
            m,
            Message {
                pin: 2,
                vector: 0x30,
                delivery: Delivery::Fixed,
                logical: true,
                destination: 1,
                level: false,
            }
        );
        assert_eq!(io.next_message(), None, "one edge, one message");
        // Two edges before the look are one (the pin latches one).
        for _ in 0..2 {
            io.set_irq(2, true);
            io.set_irq(2, false);
        }
        assert!(io.next_message().is_some());
        assert_eq!(io.next_message(), None);
        // A latched edge is dropped when the entry is masked before it is sent.
        io.set_irq(2, true);
        io.set_irq(2, false);
        program(&mut io, 2, 0x0001_0830, 0x0100_0000);
        program(&mut io, 2, 0x0000_0830, 0x0100_0000);
        assert_eq!(io.next_message(), None);
    }

    #[test]
    fn a_level_waits_for_the_eoi_of_its_vector() {
        let mut io = IoApic::new(2);
        // Level-triggered, active high, physical destination 1, vector 0x41.
        program(&mut io, 9, 0x0000_8041, 0x0100_0000);
        io.set_irq(9, true);
        let m = io.next_message().unwrap();
        assert!(m.level && !m.logical && m.destination == 1 && m.vector == 0x41);
        assert_eq!(io.next_message(), None, "remote IRR set");
        assert_ne!(read(&io, REG_TABLE + 18) & REMOTE_IRR as u32, 0);
        // Remote IRR is read-only.
        program(&mut io, 9, 0x0000_8041, 0x0100_0000);
        assert_eq!(io.next_message(), None);
        // Another vector's EOI does nothing; its own sends again while the line is up.
        io.eoi(0x42);
        assert_eq!(io.next_message(), None);
        io.eoi(0x41);
        assert!(io.next_message().is_some());
        // Once the line is down, the EOI ends it.
        io.set_irq(9, false);
        io.eoi(0x41);
        assert_eq!(io.next_message(), None);
        // Made edge-triggered, the entry loses its remote IRR (Linux's EOI on version 0x11).
        io.set_irq(9, true);
        assert!(io.next_message().is_some());
        program(&mut io, 9, 0x0001_0041, 0x0100_0000);
        assert_eq!(read(&io, REG_TABLE + 18) & REMOTE_IRR as u32, 0);
    }

    #[test]
    fn active_low_pins_assert_on_a_low_line() {
        let mut io = IoApic::new(2);
        // Level-triggered, active low: the line is low, so the pin is asserted at once.
        io.set_irq(10, true);
        program(&mut io, 10, 0x0000_a051, 0);
        assert!(io.next_message().is_none(), "line high: not asserted");
        io.set_irq(10, false);
        let m = io.next_message().unwrap();
        assert_eq!((m.pin, m.vector, m.level), (10, 0x51, true));
        io.set_irq(10, true);
        io.eoi(0x51);
        assert!(io.next_message().is_none());
    }

    #[test]
    fn pins_out_of_range_are_ignored() {
        let mut io = IoApic::new(0);
        io.set_irq(24, true);
        io.set_irq(255, true);
        assert_eq!(io.next_message(), None);
        assert_eq!(io.entry(99), MASKED);
    }

    /// Every pin asked in turn, as `next_message` did before it kept `level_ready`: the
    /// reference for which pins can send.
    fn scan(io: &mut IoApic) -> Option<Message> {
        (0..PINS).find_map(|pin| io.send(pin))
    }

    #[derive(Clone, Debug)]
    enum Op {
        Line(u8, bool),
        Entry(u8, u32),
        Eoi(u8),
        Next,
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        // Few pins and vectors, so that the operations meet.
        let low = (
            0u32..4,
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(v, low, level, masked, logical)| {
                (0x30 + v)
                    | u32::from(low) << 13
                    | u32::from(level) << 15
                    | u32::from(masked) << 16
                    | u32::from(logical) << 11
            });
        prop_oneof![
            (0u8..4, any::<bool>()).prop_map(|(p, l)| Op::Line(p, l)),
            (0u8..4, low).prop_map(|(p, v)| Op::Entry(p, v)),
            (0u8..4).prop_map(|v| Op::Eoi(0x30 + v)),
            Just(Op::Next),
        ]
    }

    proptest::proptest! {
        /// Whatever the guest and the devices do, the messages are the full scan's, in order.
        #[test]
        fn messages_are_the_full_scans(ops in proptest::collection::vec(op(), 1..200)) {
            let mut fast = IoApic::new(2);
            let mut slow = IoApic::new(2);
            for op in ops {
                match op {
                    Op::Line(p, l) => {
                        fast.set_irq(p, l);
                        slow.set_irq(p, l);
                    }
                    Op::Entry(p, v) => {
                        program(&mut fast, u32::from(p), v, 0);
                        program(&mut slow, u32::from(p), v, 0);
                    }
                    Op::Eoi(v) => {
                        fast.eoi(v);
                        slow.eoi(v);
                    }
                    Op::Next => {
                        proptest::prop_assert_eq!(fast.next_message(), scan(&mut slow));
                    }
                }
                proptest::prop_assert_eq!(&fast.table, &slow.table);
            }
            while let Some(m) = scan(&mut slow) {
                proptest::prop_assert_eq!(fast.next_message(), Some(m));
            }
            proptest::prop_assert_eq!(fast.next_message(), None);
        }
    }
}
