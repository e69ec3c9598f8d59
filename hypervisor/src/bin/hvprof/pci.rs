//! PCI configuration space through configuration mechanism #1 (I/O ports 0xCF8/0xCFC, PCI Local
//! Bus Specification 3.0 §3.2.2.3.2): enough to find a device by its IDs, walk its capability
//! list and read its memory BARs. Used by the virtio console channel.

use spin::Mutex;
use x86_64::instructions::port::Port;

const CONFIG_ADDRESS: u16 = 0xcf8;
const CONFIG_DATA: u16 = 0xcfc;

/// The address/data pair is one shared register: one access at a time.
static CONFIG: Mutex<()> = Mutex::new(());

/// Configuration-space offsets (PCI 3.0 §6.1, type 0 header).
const VENDOR_ID: u8 = 0x00;
const COMMAND: u8 = 0x04;
const STATUS: u8 = 0x06;
const HEADER_TYPE: u8 = 0x0e;
const BAR0: u8 = 0x10;
const CAPABILITIES: u8 = 0x34;

/// Status: the capability list exists (PCI 3.0 §6.2.3).
const STATUS_CAPABILITIES: u16 = 1 << 4;
/// Command: memory space decoding and bus mastering (PCI 3.0 §6.2.2).
pub const COMMAND_MEMORY: u16 = 1 << 1;
pub const COMMAND_BUS_MASTER: u16 = 1 << 2;

/// One function of one device on one bus.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Function {
    pub bus: u8,
    pub device: u8,
    pub function: u8,
}

impl Function {
    fn address(&self, offset: u8) -> u32 {
        (1 << 31)
            | (u32::from(self.bus) << 16)
            | (u32::from(self.device & 0x1f) << 11)
            | (u32::from(self.function & 0x7) << 8)
            | u32::from(offset & 0xfc)
    }

    /// The dword at `offset` (rounded down to a dword).
    pub fn read32(&self, offset: u8) -> u32 {
        let _guard = CONFIG.lock();
        let mut address = Port::<u32>::new(CONFIG_ADDRESS);
        let mut data = Port::<u32>::new(CONFIG_DATA);
        // SAFETY: 0xCF8/0xCFC are the PC platform's configuration mechanism #1 registers, used by
        // nothing else in the hypervisor (guests never reach host ports: every guest port access
        // exits); the lock keeps the address and the data access together. Where no function
        // answers, the read returns all ones.
        unsafe {
            address.write(self.address(offset));
            data.read()
        }
    }

    /// Writes the dword at `offset` (rounded down to a dword).
    pub fn write32(&self, offset: u8, value: u32) {
        let _guard = CONFIG.lock();
        let mut address = Port::<u32>::new(CONFIG_ADDRESS);
        let mut data = Port::<u32>::new(CONFIG_DATA);
        // SAFETY: as `read32`; only the command register and nothing the firmware set up for
        // the hypervisor's own use is written.
        unsafe {
            address.write(self.address(offset));
            data.write(value);
        }
    }

    pub fn read16(&self, offset: u8) -> u16 {
        (self.read32(offset) >> (u32::from(offset & 2) * 8)) as u16
    }

    pub fn read8(&self, offset: u8) -> u8 {
        (self.read32(offset) >> (u32::from(offset & 3) * 8)) as u8
    }

    pub fn vendor(&self) -> u16 {
        self.read16(VENDOR_ID)
    }

    pub fn device_id(&self) -> u16 {
        self.read16(VENDOR_ID + 2)
    }

    /// Sets bits of the command register (keeping the status register, which is written 1 to
    /// clear, untouched: its half of the dword is written as zeros).
    pub fn enable(&self, bits: u16) {
        let command = self.read16(COMMAND) | bits;
        self.write32(COMMAND, u32::from(command));
    }

    /// The base address of memory BAR `index` (64-bit BARs take two slots); `None` for an I/O
    /// BAR, an unassigned one or an index past the six.
    pub fn memory_bar(&self, index: u8) -> Option<u64> {
        if index > 5 {
            return None;
        }
        let low = self.read32(BAR0 + 4 * index);
        if low & 1 != 0 {
            return None;
        }
        let base = u64::from(low & !0xf);
        let address = match (low >> 1) & 3 {
            // 64-bit (PCI 3.0 §6.2.5.1).
            2 if index < 5 => base | (u64::from(self.read32(BAR0 + 4 * (index + 1))) << 32),
            0 => base,
            _ => return None,
        };
        (address != 0).then_some(address)
    }

    /// The offsets of its capabilities (PCI 3.0 §6.7), at most 48 (a looping list ends there).
    pub fn capabilities(&self) -> impl Iterator<Item = u8> + '_ {
        let mut next = if self.read16(STATUS) & STATUS_CAPABILITIES != 0 {
            self.read8(CAPABILITIES) & 0xfc
        } else {
            0
        };
        let mut left = 48;
        core::iter::from_fn(move || {
            if next < 0x40 || left == 0 {
                return None;
            }
            left -= 1;
            let at = next;
            next = self.read8(at + 1) & 0xfc;
            Some(at)
        })
    }
}

/// The first function with these IDs, scanning every bus, device and function.
pub fn find(vendor: u16, device_id: u16) -> Option<Function> {
    for bus in 0..=255u8 {
        for device in 0..32u8 {
            let first = Function {
                bus,
                device,
                function: 0,
            };
            if first.vendor() == 0xffff {
                continue;
            }
            let functions = if first.read8(HEADER_TYPE) & 0x80 != 0 {
                8
            } else {
                1
            };
            for function in 0..functions {
                let f = Function {
                    bus,
                    device,
                    function,
                };
                if f.vendor() == vendor && f.device_id() == device_id {
                    return Some(f);
                }
            }
        }
    }
    None
}
