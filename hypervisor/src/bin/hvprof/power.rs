//! Powering the machine off, cleanly: the console is drained first (LSR.TEMT) so the log's last
//! line reaches the host, then ACPI S5, then the emulators' own exits, then a halt loop.

use crate::acpi::PowerOff;
use crate::console;
use core::fmt::Write;
use spin::Once;
use x86_64::instructions::port::Port;

static ACPI_S5: Once<Option<PowerOff>> = Once::new();

/// Records the ACPI power-off registers once the FADT has been read.
pub fn set_acpi(power_off: Option<PowerOff>) {
    ACPI_S5.call_once(|| power_off);
}

/// Prints the last line and powers off.
pub fn off() -> ! {
    let method = match ACPI_S5.get().copied().flatten() {
        Some(_) => "ACPI S5",
        None => "emulator exit",
    };
    // The TSC of the boot CPU: in Bochs the number of instructions it ran since reset, which the
    // test runner uses to measure the emulator's speed.
    crate::println!("hvprof: power off ({method}; TSC {})", crate::tsc::rdtsc());
    shut_down()
}

/// Powers off from a fault path without taking the console lock.
pub fn off_after_fault() -> ! {
    let _ = writeln!(
        console::emergency_writer(),
        "hvprof: power off (after a fatal error)"
    );
    shut_down()
}

fn shut_down() -> ! {
    x86_64::instructions::interrupts::disable();
    console::drain();
    if let Some(s5) = ACPI_S5.get().copied().flatten() {
        // SLP_TYP in bits 12:10, SLP_EN in bit 13 of PM1x_CNT (ACPI 6.5 §4.8.3.2.1).
        let a = ((s5.slp_typ_a as u16 & 7) << 10) | (1 << 13);
        let b = ((s5.slp_typ_b as u16 & 7) << 10) | (1 << 13);
        // SAFETY: the ports are the FADT's PM1 control registers; writing SLP_EN with the \_S5
        // sleep type is the ACPI-defined way to enter S5 (soft off).
        unsafe {
            if let Some(pm1b) = s5.pm1b_control {
                Port::<u16>::new(pm1b).write(b);
            }
            Port::<u16>::new(s5.pm1a_control).write(a);
        }
    }
    // SAFETY: on Bochs, writing "Shutdown" to port 0x8900 ends the simulation; on QEMU's PIIX4 PM
    // block, 0x2000 to port 0x604 is S5. On other machines these ports are unused and the writes
    // have no effect, after which we halt.
    unsafe {
        for b in b"Shutdown" {
            Port::<u8>::new(0x8900).write(*b);
        }
        Port::<u16>::new(0x604).write(0x2000);
    }
    halt_forever()
}

pub fn halt_forever() -> ! {
    loop {
        x86_64::instructions::interrupts::disable();
        x86_64::instructions::hlt();
    }
}
