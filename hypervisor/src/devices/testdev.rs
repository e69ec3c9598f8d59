//! QEMU's pc-testdev (`-device pc-testdev`), the test device kvm-unit-tests' kernels drive, for
//! a VM that asks for it (`testdev=on`): the I/O ports of QEMU's `hw/misc/pc-testdev.c`.
//!
//! - 0xe0-0xe3: a 32-bit scratch register, readable and writable at any byte offset and size
//!   (a read at offset `n` gives the register shifted right by `8n`).
//! - 0xe4-0xe7: "flush page": a write names a guest-physical page whose host mapping QEMU drops
//!   and restores, so that KVM takes a fault on the guest's next access. Guest memory here is
//!   mapped once, whole, for the VM's life (docs/GUEST-ABI.md): there is no host mapping to
//!   drop, and the write changes nothing the guest can see.
//! - 0x2000-0x2017: the ISA interrupt lines, one port each: writing a non-zero byte raises the
//!   line, zero lowers it (`ioapic.flat` drives the I/O APIC's edge and level inputs this way).
//!   Reads give 0.
//! - 0xff000000-0xff00ffff ([`IOMEM`]): 64 KiB of test memory. QEMU serves it as MMIO, so
//!   that under KVM each access goes through KVM's instruction emulator (`emulator.flat` and
//!   `lam.flat` run string instructions and other emulator paths on it). hvprof has no
//!   instruction emulator to exercise: the VM's build maps it as memory of the VM's own, which
//!   reads back what was written, as QEMU's buffer does.

/// The test memory: guest-physical base and length (QEMU's `IOMEM_LEN`).
pub const IOMEM: (u64, u64) = (0xff00_0000, 0x1_0000);

/// The scratch register's ports.
const SCRATCH: core::ops::RangeInclusive<u16> = 0xe0..=0xe3;
/// The page-flush ports.
const FLUSH: core::ops::RangeInclusive<u16> = 0xe4..=0xe7;
/// The first interrupt-line port, and the number of lines.
const IRQ_BASE: u16 = 0x2000;
pub const IRQ_LINES: u16 = 24;

/// What a write asks of the rest of the board.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    None,
    /// ISA interrupt line `irq` goes to `level`.
    IrqLine {
        irq: u8,
        level: bool,
    },
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PcTestdev {
    scratch: u32,
}

impl PcTestdev {
    /// Whether `port` is one of the device's.
    #[must_use]
    pub fn claims(port: u16) -> bool {
        SCRATCH.contains(&port)
            || FLUSH.contains(&port)
            || (IRQ_BASE..IRQ_BASE + IRQ_LINES).contains(&port)
    }

    /// An IN of `size` bytes (1, 2 or 4) at `port`.
    #[must_use]
    pub fn read(&self, port: u16, size: u8) -> u32 {
        if SCRATCH.contains(&port) {
            let shifted = self.scratch >> (u32::from(port - SCRATCH.start()) * 8);
            shifted & mask(size)
        } else {
            0
        }
    }

    /// An OUT of `value` (`size` bytes) at `port`.
    pub fn write(&mut self, port: u16, value: u32, size: u8) -> Effect {
        if SCRATCH.contains(&port) {
            // Bytes past the register's end fall off, as QEMU's shifted mask makes them.
            let shift = u32::from(port - SCRATCH.start()) * 8;
            let bits = u64::from(mask(size)) << shift;
            let bits = bits as u32;
            self.scratch = (self.scratch & !bits) | ((value << shift) & bits);
            Effect::None
        } else if (IRQ_BASE..IRQ_BASE + IRQ_LINES).contains(&port) {
            Effect::IrqLine {
                irq: (port - IRQ_BASE) as u8,
                level: value & 0xff != 0,
            }
        } else {
            Effect::None
        }
    }
}

fn mask(size: u8) -> u32 {
    match size {
        1 => 0xff,
        2 => 0xffff,
        _ => u32::MAX,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scratch_register_takes_any_size_at_any_offset() {
        let mut d = PcTestdev::default();
        assert_eq!(d.write(0xe0, 0x1234_5678, 4), Effect::None);
        assert_eq!(d.read(0xe0, 4), 0x1234_5678);
        assert_eq!(d.read(0xe1, 1), 0x56);
        assert_eq!(d.read(0xe2, 2), 0x1234);
        assert_eq!(d.read(0xe3, 4), 0x12, "past the end reads 0");
        d.write(0xe1, 0xab, 1);
        assert_eq!(d.read(0xe0, 4), 0x1234_ab78);
        d.write(0xe2, 0xffff_cdef, 4);
        assert_eq!(
            d.read(0xe0, 4),
            0xcdef_ab78,
            "the bytes past the end fall off"
        );
    }

    #[test]
    fn the_line_ports_raise_and_lower_isa_lines() {
        let mut d = PcTestdev::default();
        assert_eq!(
            d.write(0x200e, 1, 1),
            Effect::IrqLine {
                irq: 14,
                level: true
            }
        );
        assert_eq!(
            d.write(0x200e, 0, 1),
            Effect::IrqLine {
                irq: 14,
                level: false
            }
        );
        assert_eq!(d.read(0x200e, 1), 0);
        assert!(PcTestdev::claims(0x2017) && !PcTestdev::claims(0x2018));
        assert!(PcTestdev::claims(0xe4) && !PcTestdev::claims(0xe8));
        assert_eq!(
            d.write(0xe4, 0x1000, 4),
            Effect::None,
            "flush page: nothing to drop"
        );
    }
}
