//! Port I/O. Under hvprof every port is virtual (guest ABI "Devices"): COM1 at 0x3f8-0x3ff, the
//! exit port 0xf4, and all ones / dropped writes everywhere else.

/// Reads a byte from an I/O port.
///
/// # Safety
/// Reading a device register can have side effects on that device.
pub unsafe fn inb(port: u16) -> u8 {
    let value: u8;
    // SAFETY: the caller accepts the device's side effects; IN touches no memory.
    unsafe {
        core::arch::asm!("in al, dx", in("dx") port, out("al") value,
            options(nomem, nostack, preserves_flags));
    }
    value
}

/// Writes a byte to an I/O port.
///
/// # Safety
/// Writing a device register can have any effect that device has (0xf4 stops the VM).
pub unsafe fn outb(port: u16, value: u8) {
    // SAFETY: the caller accepts the device's side effects; OUT touches no memory.
    unsafe {
        core::arch::asm!("out dx, al", in("dx") port, in("al") value,
            options(nomem, nostack, preserves_flags));
    }
}

/// Writes a 16-bit word to an I/O port.
///
/// # Safety
/// Writing a device register can have any effect that device has.
pub unsafe fn outw(port: u16, value: u16) {
    // SAFETY: the caller accepts the device's side effects; OUT touches no memory.
    unsafe {
        core::arch::asm!("out dx, ax", in("dx") port, in("ax") value,
            options(nomem, nostack, preserves_flags));
    }
}
