//! QEMU's firmware configuration device, its traditional port interface: a guest writes an item's
//! key to the selector port (0x510, 16 bits) and reads the item's bytes one at a time from the
//! data port (0x511), from its start after each selection (QEMU's docs/specs/fw_cfg.rst). The
//! items are the machine's shape, which guests written for QEMU (kvm-unit-tests' x86 kernels)
//! read instead of probing: the signature, the interface's features (none beyond the ports:
//! no DMA), the number of CPUs and the RAM size. Any other key reads as an empty item (zeros),
//! as QEMU's does; writes to the data port are ignored (the write channel is not offered).

/// The selector and data ports.
pub const SELECTOR: u16 = 0x510;
pub const DATA: u16 = 0x511;

/// Item keys (QEMU's include/standard-headers/linux/qemu_fw_cfg.h).
pub const SIGNATURE: u16 = 0x00;
pub const ID: u16 = 0x01;
pub const RAM_SIZE: u16 = 0x03;
pub const NB_CPUS: u16 = 0x05;
pub const MAX_CPUS: u16 = 0x0f;

/// Bit 0 of the ID item: the traditional (port) interface.
const ID_TRADITIONAL: u32 = 1;

/// The device: the machine's shape and where the guest's reading is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FwCfg {
    cpus: u16,
    ram: u64,
    selected: u16,
    offset: usize,
}

impl FwCfg {
    /// A machine of `cpus` CPUs and `ram` bytes of RAM.
    #[must_use]
    pub fn new(cpus: u16, ram: u64) -> Self {
        FwCfg {
            cpus,
            ram,
            selected: SIGNATURE,
            offset: 0,
        }
    }

    /// Whether `port` is one of the device's.
    #[must_use]
    pub fn claims(port: u16) -> bool {
        port == SELECTOR || port == DATA
    }

    /// The bytes of item `key` (little endian, as QEMU's x86 machines give them), into `buf`;
    /// its length (0: no such item).
    fn item(&self, key: u16, buf: &mut [u8; 8]) -> usize {
        match key {
            SIGNATURE => {
                buf[..4].copy_from_slice(b"QEMU");
                4
            }
            ID => {
                buf[..4].copy_from_slice(&ID_TRADITIONAL.to_le_bytes());
                4
            }
            RAM_SIZE => {
                *buf = self.ram.to_le_bytes();
                8
            }
            NB_CPUS | MAX_CPUS => {
                buf[..2].copy_from_slice(&self.cpus.to_le_bytes());
                2
            }
            _ => 0,
        }
    }

    /// A guest's OUT of `value` (of `size` bytes) to `port`: a new selection restarts the item.
    pub fn write(&mut self, port: u16, value: u32, size: u8) {
        if port == SELECTOR {
            // A byte write selects by its low byte, as QEMU's 16-bit port takes a narrower one.
            self.selected = if size >= 2 {
                value as u16
            } else {
                u16::from(value as u8)
            };
            self.offset = 0;
        }
    }

    /// A guest's IN of `size` bytes from `port`: from the data port, the selected item's next
    /// bytes (zeros past its end); the selector reads back as zeros.
    pub fn read(&mut self, port: u16, size: u8) -> u32 {
        if port != DATA {
            return 0;
        }
        let mut buf = [0u8; 8];
        let len = self.item(self.selected, &mut buf);
        let mut v = 0u32;
        for i in 0..usize::from(size.min(4)) {
            let b = if self.offset < len {
                buf[self.offset]
            } else {
                0
            };
            v |= u32::from(b) << (8 * i);
            self.offset = self.offset.saturating_add(1);
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_item(d: &mut FwCfg, key: u16, bytes: usize) -> u64 {
        d.write(SELECTOR, u32::from(key), 2);
        (0..bytes).fold(0u64, |v, i| v | u64::from(d.read(DATA, 1)) << (8 * i))
    }

    #[test]
    fn gives_the_machines_shape_as_qemu_does() {
        let mut d = FwCfg::new(2, 256 << 20);
        assert_eq!(
            read_item(&mut d, SIGNATURE, 4),
            u64::from(u32::from_le_bytes(*b"QEMU"))
        );
        assert_eq!(read_item(&mut d, ID, 4), 1);
        assert_eq!(read_item(&mut d, NB_CPUS, 2), 2);
        assert_eq!(read_item(&mut d, MAX_CPUS, 2), 2);
        assert_eq!(read_item(&mut d, RAM_SIZE, 8), 256 << 20);
        // kvm-unit-tests' FW_CFG_MAX_RAM (0x11): no such item, zeros ("no limit").
        assert_eq!(read_item(&mut d, 0x11, 8), 0);
    }

    #[test]
    fn reading_past_the_end_gives_zeros_and_a_selection_restarts() {
        let mut d = FwCfg::new(3, 0);
        d.write(SELECTOR, u32::from(NB_CPUS), 2);
        assert_eq!(d.read(DATA, 1), 3);
        assert_eq!(d.read(DATA, 1), 0);
        assert_eq!(d.read(DATA, 1), 0, "past the end");
        d.write(SELECTOR, u32::from(NB_CPUS), 2);
        assert_eq!(d.read(DATA, 1), 3, "from the start again");
        // A wider read takes the next bytes.
        d.write(SELECTOR, u32::from(SIGNATURE), 2);
        assert_eq!(d.read(DATA, 4), u32::from_le_bytes(*b"QEMU"));
        assert_eq!(d.read(SELECTOR, 2), 0);
        assert!(FwCfg::claims(0x510) && FwCfg::claims(0x511) && !FwCfg::claims(0x512));
    }
}
