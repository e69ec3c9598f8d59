//! A virtual 16550A UART (one per VM, at COM1's ports 0x3f8-0x3ff). Output is line-buffered: a
//! complete line (or a full buffer) is handed back to the caller, which prints it on the
//! hypervisor console with the VM's name in front. A byte written is sent at once, so the
//! transmitter is always ready; with IER.ETBEI set, "transmitter holding register empty" is an
//! interrupt (on the PC's IRQ 4, gated by MCR.OUT2: `irq`), as Linux's 8250 driver needs for
//! user-space output. FIFOs (FCR) are reported as present; loopback (MCR bit 4) reflects the
//! modem-control outputs in MSR. Register offsets and bits: the PC16550D data sheet.

/// Offsets from the base port.
pub const THR_RBR_DLL: u8 = 0;
pub const IER_DLM: u8 = 1;
pub const IIR_FCR: u8 = 2;
pub const LCR: u8 = 3;
pub const MCR: u8 = 4;
pub const LSR: u8 = 5;
pub const MSR: u8 = 6;
pub const SCR: u8 = 7;

/// LSR: transmitter holding register empty | transmitter empty.
pub const LSR_READY: u8 = 0x60;
const LCR_DLAB: u8 = 0x80;
/// IIR with no interrupt pending.
const IIR_NONE: u8 = 0x01;
/// IIR: transmitter holding register empty (priority 3).
const IIR_THRE: u8 = 0x02;
/// IIR bits 7:6 when the FIFOs are enabled.
const IIR_FIFO: u8 = 0xc0;
const IER_ETBEI: u8 = 0x02;
const MCR_OUT2: u8 = 0x08;
const MCR_LOOP: u8 = 0x10;
/// MSR outside loopback: carrier detect, data set ready, clear to send.
const MSR_READY: u8 = 0xb0;

pub const LINE_MAX: usize = 200;

#[derive(Clone, Debug)]
pub struct Uart {
    ier: u8,
    lcr: u8,
    mcr: u8,
    scr: u8,
    dll: u8,
    dlm: u8,
    line: [u8; LINE_MAX],
    len: usize,
    /// Bytes the guest sent in all.
    pub bytes_out: u64,
    /// FCR bit 0.
    fifo: bool,
    /// The THRE interrupt is pending (cleared by reading IIR or writing THR).
    thre: bool,
}

impl Default for Uart {
    fn default() -> Self {
        Self {
            ier: 0,
            lcr: 0x03,
            mcr: 0,
            scr: 0,
            dll: 1,
            dlm: 0,
            line: [0; LINE_MAX],
            len: 0,
            bytes_out: 0,
            fifo: false,
            thre: false,
        }
    }
}

impl Uart {
    fn dlab(&self) -> bool {
        self.lcr & LCR_DLAB != 0
    }

    /// A guest write to `base + offset`. Returns a line to print when one is complete.
    pub fn write(&mut self, offset: u8, value: u8) -> Option<&[u8]> {
        match (offset & 7, self.dlab()) {
            (THR_RBR_DLL, false) => {
                // Sent at once: the holding register is empty again right away.
                self.thre = true;
                if self.mcr & MCR_LOOP != 0 {
                    return None;
                }
                return self.send(value);
            }
            (THR_RBR_DLL, true) => self.dll = value,
            (IER_DLM, false) => {
                // Enabling the THRE interrupt with the register empty raises it.
                if value & IER_ETBEI != 0 && self.ier & IER_ETBEI == 0 {
                    self.thre = true;
                }
                self.ier = value & 0x0f;
            }
            (IER_DLM, true) => self.dlm = value,
            (IIR_FCR, _) => self.fifo = value & 1 != 0,
            (LCR, _) => self.lcr = value,
            (MCR, _) => self.mcr = value & 0x1f,
            (SCR, _) => self.scr = value,
            _ => {} // LSR, MSR: read-only.
        }
        None
    }

    /// The level of the UART's interrupt line as a PC wires it (MCR.OUT2 gates it onto IRQ 4).
    pub fn irq(&self) -> bool {
        self.mcr & MCR_OUT2 != 0 && self.thre && self.ier & IER_ETBEI != 0
    }

    /// A guest read of `base + offset`.
    pub fn read(&mut self, offset: u8) -> u8 {
        match (offset & 7, self.dlab()) {
            (THR_RBR_DLL, false) => 0,
            (THR_RBR_DLL, true) => self.dll,
            (IER_DLM, false) => self.ier,
            (IER_DLM, true) => self.dlm,
            (IIR_FCR, _) => {
                let fifo = if self.fifo { IIR_FIFO } else { 0 };
                if self.thre && self.ier & IER_ETBEI != 0 {
                    // Reading IIR with THRE the source clears it (data sheet, Table 4).
                    self.thre = false;
                    IIR_THRE | fifo
                } else {
                    IIR_NONE | fifo
                }
            }
            (LCR, _) => self.lcr,
            (MCR, _) => self.mcr,
            (LSR, _) => LSR_READY,
            (MSR, _) if self.mcr & MCR_LOOP != 0 => {
                // Loopback: DTR→DSR, RTS→CTS, OUT1→RI, OUT2→DCD.
                let m = self.mcr;
                (m & 1) << 5 | (m & 2) << 3 | (m & 4) << 4 | (m & 8) << 4
            }
            (MSR, _) => MSR_READY,
            _ => self.scr,
        }
    }

    /// A byte for the transmitter (what a THR write does; the PRINT hypercall uses it too).
    pub fn send(&mut self, byte: u8) -> Option<&[u8]> {
        self.bytes_out += 1;
        match byte {
            b'\n' => return Some(self.take()),
            b'\r' => {}
            _ => {
                self.line[self.len] = byte;
                self.len += 1;
                if self.len == LINE_MAX {
                    return Some(self.take());
                }
            }
        }
        None
    }

    fn take(&mut self) -> &[u8] {
        let n = core::mem::take(&mut self.len);
        &self.line[..n]
    }

    /// What is left of an unterminated line (at VM stop).
    pub fn flush(&mut self) -> Option<&[u8]> {
        (self.len > 0).then(|| self.take())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send(u: &mut Uart, s: &[u8]) -> Vec<Vec<u8>> {
        s.iter()
            .filter_map(|&b| u.write(THR_RBR_DLL, b).map(<[u8]>::to_vec))
            .collect()
    }

    #[test]
    fn lines_and_ready() {
        let mut u = Uart::default();
        assert_eq!(u.read(LSR), LSR_READY);
        assert_eq!(send(&mut u, b"hello\r\nwor"), vec![b"hello".to_vec()]);
        assert_eq!(u.flush(), Some(&b"wor"[..]));
        assert_eq!(u.flush(), None);
        assert_eq!(u.bytes_out, 10);
    }

    #[test]
    fn long_lines_are_cut() {
        let mut u = Uart::default();
        let out = send(&mut u, &[b'x'; LINE_MAX + 5]);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].len(), LINE_MAX);
        assert_eq!(u.flush().map(<[u8]>::len), Some(5));
    }

    #[test]
    fn registers() {
        let mut u = Uart::default();
        u.write(SCR, 0x5a);
        assert_eq!(u.read(SCR), 0x5a);
        // Divisor latch: with DLAB set, offsets 0 and 1 are DLL/DLM and send nothing.
        u.write(LCR, 0x83);
        assert_eq!(u.write(THR_RBR_DLL, b'\n'), None);
        u.write(IER_DLM, 0);
        assert_eq!((u.read(THR_RBR_DLL), u.read(IER_DLM)), (b'\n', 0));
        u.write(LCR, 0x03);
        assert_eq!(u.read(IIR_FCR), IIR_NONE);
        assert_eq!(u.bytes_out, 0);
    }

    #[test]
    fn what_the_8250_driver_probes_and_the_thre_interrupt() {
        let mut u = Uart::default();
        // FIFO detection: a 16550A reports both FIFO bits once FCR enables them.
        u.write(IIR_FCR, 0x07);
        assert_eq!(u.read(IIR_FCR) & 0xc0, 0xc0);
        // Loopback test: MCR 0x1a reads back as MSR 0x90, and nothing is sent.
        u.write(MCR, 0x1a);
        assert_eq!(u.read(MSR) & 0xf0, 0x90);
        assert_eq!(u.write(THR_RBR_DLL, b'\n'), None);
        assert_eq!(u.bytes_out, 0);
        u.write(MCR, 0x0b); // DTR, RTS, OUT2
        assert_eq!(u.read(MSR), MSR_READY);
        // THRE interrupt: raised by enabling it, cleared by reading IIR, raised by each byte.
        assert!(!u.irq());
        u.write(IER_DLM, IER_ETBEI);
        assert!(u.irq());
        assert_eq!(u.read(IIR_FCR) & 0x0f, IIR_THRE);
        assert!(!u.irq());
        assert_eq!(u.read(IIR_FCR) & 0x0f, IIR_NONE);
        u.write(THR_RBR_DLL, b'x');
        assert!(u.irq());
        // OUT2 low: the line is not driven.
        u.write(MCR, 0x03);
        assert!(!u.irq());
        u.write(IER_DLM, 0);
        u.write(MCR, 0x0b);
        assert!(!u.irq());
    }
}
