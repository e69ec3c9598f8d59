//! The serial console: a 16550 UART (COM1 by default) through the `uart_16550` crate, 115200 8N1.
//!
//! `println!` takes a spin lock. The fault paths (exceptions, panic, NMI) must print even when
//! the interrupted code held that lock, so they use [`emergency_writer`], which bypasses it; they
//! only run when the machine is about to stop, or on a CPU that owns the console already.

use core::fmt::{self, Write};
use spin::Mutex;
use uart_16550::backend::PioBackend;
use uart_16550::spec::registers::LSR;
use uart_16550::{BaudRate, Config, Uart16550};

struct Console {
    uart: Option<Uart16550<PioBackend>>,
}

static CONSOLE: Mutex<Console> = Mutex::new(Console { uart: None });

/// Sets up the UART at `port`. Without a UART there (real hardware without COM1) output is
/// dropped: there is nowhere else to send it this early.
pub fn init(port: u16) {
    let mut console = CONSOLE.lock();
    console.uart = open(port);
}

fn open(port: u16) -> Option<Uart16550<PioBackend>> {
    // SAFETY: the port range [port, port + 8) is a 16550's register block on the PC platform (or
    // nothing, which `init` detects through the scratch register); the console lock serialises
    // every access.
    let mut uart = unsafe { Uart16550::new_port(port) }.ok()?;
    let config = Config {
        baud_rate: BaudRate::Baud115200,
        ..Config::DEFAULT
    };
    uart.init(config).ok()?;
    Some(uart)
}

impl Console {
    fn write_bytes(&mut self, bytes: &[u8]) {
        let Some(uart) = self.uart.as_mut() else {
            return;
        };
        for line in bytes.split_inclusive(|&b| b == b'\n') {
            match line.split_last() {
                Some((b'\n', text)) => {
                    uart.send_bytes_exact(text);
                    uart.send_bytes_exact(b"\r\n");
                }
                _ => uart.send_bytes_exact(line),
            }
        }
    }

    fn drain(&mut self) {
        if let Some(uart) = self.uart.as_mut() {
            while !uart.lsr().contains(LSR::TRANSMITTER_EMPTY) {
                core::hint::spin_loop();
            }
        }
    }
}

impl Write for Console {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.write_bytes(s.as_bytes());
        Ok(())
    }
}

#[doc(hidden)]
pub fn _print(args: fmt::Arguments) {
    // Interrupts stay disabled in the hypervisor for now, so nothing can re-enter this lock on
    // the same CPU except the fault paths, which use `emergency_writer`.
    let _ = CONSOLE.lock().write_fmt(args);
}

/// Writes bytes as they are (binary sample-log frames: no newline translation). Frames hold no
/// 0x00 inside and are delimited by it, so they share the line with text.
pub fn write_raw(bytes: &[u8]) {
    let mut console = CONSOLE.lock();
    if let Some(uart) = console.uart.as_mut() {
        uart.send_bytes_exact(bytes);
    }
}

/// Waits until the UART has sent every byte (LSR.TEMT): powering off earlier loses the tail.
pub fn drain() {
    emergency_writer().drain();
}

/// A writer for the fault paths that does not wait for the console lock.
pub fn emergency_writer() -> EmergencyWriter {
    EmergencyWriter
}

pub struct EmergencyWriter;

impl EmergencyWriter {
    fn console(&mut self) -> spin::MutexGuard<'static, Console> {
        if let Some(guard) = CONSOLE.try_lock() {
            return guard;
        }
        // SAFETY: called only on the way down (exception, panic) when the interrupted holder of
        // the lock will never run again on this CPU; a garbled line is the worst outcome if
        // another CPU prints at the same moment.
        unsafe { CONSOLE.force_unlock() };
        CONSOLE.lock()
    }
    pub fn drain(&mut self) {
        self.console().drain();
    }
}

impl Write for EmergencyWriter {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.console().write_bytes(s.as_bytes());
        Ok(())
    }
}

#[macro_export]
macro_rules! print {
    ($($arg:tt)*) => ($crate::console::_print(format_args!($($arg)*)));
}

#[macro_export]
macro_rules! println {
    () => ($crate::print!("\n"));
    ($($arg:tt)*) => ($crate::console::_print(format_args!("{}\n", format_args!($($arg)*))));
}
