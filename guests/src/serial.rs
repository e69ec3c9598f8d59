//! Output through the virtual 16550 at 0x3f8 (COM1): poll LSR.THRE, then write THR. Each byte
//! is one IN from 0x3fd and one OUT to 0x3f8, two I/O exits; the hypervisor prints complete
//! lines as `[<vm name>] <text>`.

use crate::io::{inb, outb};
use core::fmt;

/// Transmit holding register (DLAB = 0).
pub const THR: u16 = 0x3f8;
/// Line status register.
pub const LSR: u16 = 0x3fd;
/// Scratch register.
pub const SCR: u16 = 0x3ff;
/// LSR: transmit holding register empty.
const LSR_THRE: u8 = 1 << 5;

/// Sends one byte.
pub fn write_byte(byte: u8) {
    // SAFETY: LSR reads have no side effect on a 16550 (nor on hvprof's model, which reads
    // 0x60); a THR write sends the byte.
    unsafe {
        while inb(LSR) & LSR_THRE == 0 {
            core::hint::spin_loop();
        }
        outb(THR, byte);
    }
}

/// Sends bytes as they are (`\n` ends a line; no `\r` is added).
pub fn write_bytes(bytes: &[u8]) {
    bytes.iter().copied().for_each(write_byte);
}

/// The serial port as a `fmt::Write` target (the guest has one vCPU and no interrupts: no lock).
pub struct Serial;

impl fmt::Write for Serial {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        write_bytes(s.as_bytes());
        Ok(())
    }
}

#[doc(hidden)]
pub fn _print(args: fmt::Arguments<'_>) {
    let _ = fmt::Write::write_fmt(&mut Serial, args);
}
