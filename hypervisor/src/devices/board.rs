//! The legacy PC a VM sees: the 8259 pair, the 8254 PIT with port 0x61, the MC146818 CMOS clock
//! and COM1's 16550, wired as on a PC (PIT channel 0 on IRQ 0, COM1 on IRQ 4), with the port
//! decoding in one place. The same lines also reach the I/O APIC's pins (IRQ 0 on pin 2, as the
//! MADT's interrupt source override says; IRQ 4 on pin 4), which a guest that has one
//! (`apic=on`) programs instead of the 8259. Time is the host TSC (`now`), read by the caller.

use super::cmos::Cmos;
use super::ioapic::IoApic;
use super::pic::PicPair;
use super::pit::Pit;
use super::uart::Uart;

pub const COM1: u16 = 0x3f8;
/// The POST-code port: Linux writes it as an I/O delay.
pub const POST: u16 = 0x80;
const IRQ_PIT: u8 = 0;
const IRQ_COM1: u8 = 4;
/// The I/O APIC's pins of those lines (ISA IRQ 0 is GSI 2 on a PC).
const GSI_PIT: u8 = 2;
const GSI_COM1: u8 = 4;

/// What a port access did.
#[derive(Debug, PartialEq, Eq)]
pub enum Access<'a> {
    /// A device took it; for a read, the value.
    Done(u8),
    /// The UART completed a line of output.
    Line(&'a [u8]),
    /// No device at this port.
    Unclaimed,
}

pub struct Board {
    pub uart: Uart,
    pub pic: PicPair,
    pub pit: Pit,
    pub cmos: Cmos,
    /// Unused (every entry masked) unless the guest has local APICs and programs it.
    pub ioapic: IoApic,
    /// The UART's interrupt line as the PIC last saw it.
    com1_level: bool,
}

impl Board {
    /// A board whose PIT converts from a TSC of `tsc_hz` and whose clock starts at
    /// `unix_seconds`.
    pub fn new(tsc_hz: u64, unix_seconds: u64) -> Self {
        Board {
            uart: Uart::default(),
            pic: PicPair::default(),
            pit: Pit::new(tsc_hz),
            cmos: Cmos::new(unix_seconds, tsc_hz),
            ioapic: IoApic::new(0),
            com1_level: false,
        }
    }

    /// Raises on the PICs what happened on the lines up to `now`: an edge of IRQ 0 for each
    /// period of PIT channel 0 that ended (several coalesce into one request, as on a PC whose
    /// interrupt was not serviced in time), and the UART's level on IRQ 4.
    pub fn update(&mut self, now: u64) {
        if self.pit.irq0_edges(now) > 0 {
            self.pic.set_irq(IRQ_PIT, true);
            self.pic.set_irq(IRQ_PIT, false);
            self.ioapic.set_irq(GSI_PIT, true);
            self.ioapic.set_irq(GSI_PIT, false);
        }
        let level = self.uart.irq();
        if level != self.com1_level {
            self.com1_level = level;
            self.pic.set_irq(IRQ_COM1, level);
            self.ioapic.set_irq(GSI_COM1, level);
        }
    }

    /// ISA interrupt line `irq` (0-23) driven to `level` from outside the board (the
    /// pc-testdev): lines 0-15 reach the 8259 pair; every line reaches the I/O APIC's pin of
    /// the same number, except IRQ 0, which is pin 2 (the MADT's override; QEMU's I/O APIC
    /// maps its inputs so too).
    pub fn set_isa_line(&mut self, irq: u8, level: bool) {
        if irq < 16 {
            self.pic.set_irq(irq, level);
        }
        let gsi = if irq == IRQ_PIT { GSI_PIT } else { irq };
        self.ioapic.set_irq(gsi, level);
    }

    /// When the next interrupt-raising event falls (the PIT's next edge on IRQ 0).
    pub fn next_event(&self, now: u64) -> Option<u64> {
        self.pit.next_irq0(now)
    }

    /// A guest's OUT of `value` to `port`.
    pub fn write(&mut self, port: u16, value: u8, now: u64) -> Access<'_> {
        match port {
            0x20 | 0x21 | 0xa0 | 0xa1 => self.pic.write(port, value),
            0x40..=0x43 => self.pit.write(port, value, now),
            0x61 => self.pit.port61_write(value, now),
            0x70 | 0x71 => self.cmos.write(port, value, now),
            POST => {}
            p if (COM1..COM1 + 8).contains(&p) => {
                return match self.uart.write((p - COM1) as u8, value) {
                    Some(line) => Access::Line(line),
                    None => Access::Done(0),
                };
            }
            _ => return Access::Unclaimed,
        }
        Access::Done(0)
    }

    /// A guest's IN from `port`.
    pub fn read(&mut self, port: u16, now: u64) -> Access<'_> {
        Access::Done(match port {
            0x20 | 0x21 | 0xa0 | 0xa1 => self.pic.read(port),
            0x40..=0x43 => self.pit.read(port, now),
            0x61 => self.pit.port61_read(now),
            0x70 | 0x71 => self.cmos.read(port, now),
            p if (COM1..COM1 + 8).contains(&p) => self.uart.read((p - COM1) as u8),
            _ => return Access::Unclaimed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HZ: u64 = 4_000_000;

    #[test]
    fn pit_channel_0_interrupts_through_the_pic() {
        let mut b = Board::new(HZ, 0);
        // The PICs as Linux sets them up: vectors 0x30 and 0x38, cascade on IRQ 2, 8086 mode.
        for (port, v) in [
            (0x20, 0x11),
            (0x21, 0x30),
            (0x21, 0x04),
            (0x21, 0x01),
            (0xa0, 0x11),
            (0xa1, 0x38),
            (0xa1, 0x02),
            (0xa1, 0x01),
            (0x21, 0xfe), // only IRQ 0 unmasked
            (0xa1, 0xff),
        ] {
            assert_eq!(b.write(port, v, 0), Access::Done(0));
        }
        // Channel 0, mode 2, lobyte/hibyte, count 11932: 10 ms at 1.193182 MHz.
        b.write(0x43, 0x34, 0);
        b.write(0x40, (11932 & 0xff) as u8, 0);
        b.write(0x40, (11932 >> 8) as u8, 0);
        let first = b.next_event(0).expect("channel 0 runs");
        assert!((39_900..40_100).contains(&first), "{first}");
        b.update(first - 1);
        assert_eq!(b.pic.pending(), None);
        b.update(first);
        assert_eq!(b.pic.pending(), Some(0x30));
        assert_eq!(b.pic.acknowledge(), Some(0x30));
        // In service: nothing more until the EOI, even after more periods.
        b.update(first + 100_000);
        assert_eq!(b.pic.pending(), None);
        b.write(0x20, 0x20, first + 100_000);
        assert_eq!(b.pic.pending(), Some(0x30));
    }

    #[test]
    fn the_pit_and_com1_reach_the_io_apic_pins_a_pc_wires_them_to() {
        use crate::devices::ioapic::{IOREGSEL, IOWIN};
        let mut b = Board::new(HZ, 0);
        // Pin 2 (IRQ 0) and pin 4 (IRQ 4): fixed, physical, to APIC 1.
        for (pin, vector) in [(2u32, 0x30u32), (4, 0x34)] {
            b.ioapic.write(IOREGSEL, 0x10 + 2 * pin);
            b.ioapic.write(IOWIN, vector);
            b.ioapic.write(IOREGSEL, 0x11 + 2 * pin);
            b.ioapic.write(IOWIN, 1 << 24);
        }
        b.write(0x43, 0x34, 0);
        b.write(0x40, 0x9c, 0);
        b.write(0x40, 0x2e, 0);
        let first = b.next_event(0).expect("channel 0 runs");
        b.update(first);
        let m = b.ioapic.next_message().expect("IRQ 0 on pin 2");
        assert_eq!((m.pin, m.vector, m.destination), (2, 0x30, 1));
        assert_eq!(b.ioapic.next_message(), None);
        // COM1's interrupt: THR empty, enabled in IER, the line gated on by MCR's OUT2.
        b.write(COM1 + 4, 0x08, first);
        b.write(COM1 + 1, 0x02, first);
        b.update(first);
        let m = b.ioapic.next_message().expect("IRQ 4 on pin 4");
        assert_eq!((m.pin, m.vector), (4, 0x34));
    }

    #[test]
    fn unclaimed_ports_and_the_post_port() {
        let mut b = Board::new(HZ, 0);
        assert_eq!(b.read(0x2e8, 0), Access::Unclaimed);
        assert_eq!(b.write(0xcf8, 0, 0), Access::Unclaimed);
        assert_eq!(b.write(POST, 0x42, 0), Access::Done(0));
        // COM1's scratch register reads back.
        b.write(COM1 + 7, 0x5a, 0);
        assert_eq!(b.read(COM1 + 7, 0), Access::Done(0x5a));
    }
}
