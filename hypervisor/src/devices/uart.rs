//! A virtual 16550 UART (one per VM, at COM1's ports 0x3f8-0x3ff). Output is line-buffered: a
//! complete line (or a full buffer) is handed back to the caller, which prints it on the
//! hypervisor console with the VM's name in front. It never raises interrupts and is always ready
//! to send (docs/GUEST-ABI.md, "Devices"). Register offsets and bits: the PC16550D data sheet.

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
            (THR_RBR_DLL, false) => return self.send(value),
            (THR_RBR_DLL, true) => self.dll = value,
            (IER_DLM, false) => self.ier = value & 0x0f,
            (IER_DLM, true) => self.dlm = value,
            (IIR_FCR, _) => {} // FIFO control: nothing to model.
            (LCR, _) => self.lcr = value,
            (MCR, _) => self.mcr = value & 0x1f,
            (SCR, _) => self.scr = value,
            _ => {} // LSR, MSR: read-only.
        }
        None
    }

    /// A guest read of `base + offset`.
    pub fn read(&self, offset: u8) -> u8 {
        match (offset & 7, self.dlab()) {
            (THR_RBR_DLL, false) => 0,
            (THR_RBR_DLL, true) => self.dll,
            (IER_DLM, false) => self.ier,
            (IER_DLM, true) => self.dlm,
            (IIR_FCR, _) => IIR_NONE,
            (LCR, _) => self.lcr,
            (MCR, _) => self.mcr,
            (LSR, _) => LSR_READY,
            (MSR, _) => 0,
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
}
