//! The first parallel port (LPT1, I/O 0x378) as an output channel for the sample log
//! (`channel=lpt`).
//!
//! A byte goes out in the IEEE 1284 compatibility-mode handshake: wait until the printer is not
//! busy (status bit 7, nBUSY, reads 1), put the byte on the data lines, pulse nSTROBE (control
//! bit 0, inverted on the wire: writing 1 asserts it), release it. There is no baud rate: Bochs
//! (`parport1: file=...`) and QEMU (`-parallel file:...`) write each strobed byte to their file at
//! the cost of a few port writes, whatever their emulated clock, which makes this the channel for
//! emulated machines whose clock runs at a realistic GHz rate (where the UART's 87 µs per byte
//! are tens of thousands of instructions). On real hardware a printer-port capture device works
//! the same way.

use spin::Mutex;
use x86_64::instructions::port::Port;

const BASE: u16 = 0x378;
const DATA: u16 = BASE;
const STATUS: u16 = BASE + 1;
const CONTROL: u16 = BASE + 2;

/// Control: nSTROBE (written 1 = asserted).
const CTRL_STROBE: u8 = 1 << 0;
/// Control: nINIT (written 0 = printer reset).
const CTRL_INIT: u8 = 1 << 2;
/// Control: SELECT IN (written 1 = printer selected).
const CTRL_SELECT: u8 = 1 << 3;
/// Status: nBUSY (1 = ready for a byte).
const STATUS_READY: u8 = 1 << 7;

/// How long a byte may wait for the printer to be ready (status polls) before the port is given
/// up as absent or stuck.
const READY_POLLS: u32 = 1_000_000;

struct Lpt {
    present: bool,
    /// Bytes refused because the port never became ready.
    lost: u64,
}

static LPT: Mutex<Lpt> = Mutex::new(Lpt {
    present: false,
    lost: 0,
});

/// Detects the port (the data latch reads back what was written) and resets the printer.
/// Returns whether a port answers at 0x378.
pub fn init() -> bool {
    let mut data = Port::<u8>::new(DATA);
    let mut control = Port::<u8>::new(CONTROL);
    let mut status = Port::<u8>::new(STATUS);
    // SAFETY: 0x378-0x37a are LPT1's data, status and control registers on the PC platform; the
    // hypervisor uses them for nothing else and guests never reach host ports (the I/O bitmap
    // makes every guest port access exit). Where no port answers, the writes go nowhere and the
    // reads float high, which the read-back check detects.
    let present = unsafe {
        data.write(0x55);
        let a = data.read();
        data.write(0xaa);
        let b = data.read();
        if a == 0x55 && b == 0xaa {
            // nINIT low resets the printer; then selected, not reset, strobe released.
            control.write(CTRL_SELECT);
            control.write(CTRL_SELECT | CTRL_INIT);
            let _ = status.read();
            true
        } else {
            false
        }
    };
    LPT.lock().present = present;
    present
}

/// Sends `bytes`; a byte the port does not take within `READY_POLLS` polls is counted as lost
/// and the port is given up.
pub fn write(bytes: &[u8]) {
    let mut lpt = LPT.lock();
    if !lpt.present {
        lpt.lost += bytes.len() as u64;
        return;
    }
    let mut data = Port::<u8>::new(DATA);
    let mut control = Port::<u8>::new(CONTROL);
    let mut status = Port::<u8>::new(STATUS);
    for (i, &b) in bytes.iter().enumerate() {
        // SAFETY: as in `init`: LPT1's registers, owned by the hypervisor; the handshake only
        // moves a byte to the printer.
        let ready = unsafe {
            let mut polls = 0;
            while status.read() & STATUS_READY == 0 {
                polls += 1;
                if polls == READY_POLLS {
                    break;
                }
                core::hint::spin_loop();
            }
            if polls == READY_POLLS {
                false
            } else {
                data.write(b);
                control.write(CTRL_SELECT | CTRL_INIT | CTRL_STROBE);
                control.write(CTRL_SELECT | CTRL_INIT);
                true
            }
        };
        if !ready {
            lpt.present = false;
            lpt.lost += (bytes.len() - i) as u64;
            return;
        }
    }
}

/// Bytes lost because the port was absent or stopped answering.
pub fn lost() -> u64 {
    LPT.lock().lost
}
